"""Device time of two versions of the Triton kernels, side by side in one run (needs CUDA).

    mkdir -p kernels/_ab_before && git archive <rev> kernels | tar -x --strip-components=1 -C kernels/_ab_before
    python benchmarks/kernel_ab.py --before kernels/_ab_before [--before other ...] --json ab.json
    python benchmarks/kernel_ab.py --hopper fwd,dkdv --hopper 1 --hopper ws --cudnn --json ab.json

``--hopper SPEC`` adds the working tree's kernels with the opt-in Hopper variants of SPEC
(``kernels/tuning.py``: ``parse_hopper``, the FLASHWATCH_HOPPER syntax) as one more version,
set while that version runs (forward and backward); without ``--before`` the first version is the
working tree's kernels with the Hopper variants off. ``--cudnn`` times SDPA's cuDNN backend in
the same rounds and prints each version's speed ratio to it (> 1: faster than cuDNN).

For each shape and each of plain, plain with statistics and fixed, the forward+backward of each
"before" version and of the working tree's kernels are replayed from CUDA graphs
(``flashwatch.bench.device_fwd_bwd_ms``: GPU time, no host work), in interleaved rounds; the
median of the rounds is printed with each version's ratio to the first before version and its
overhead vs its own plain.
Why: a kernel change worth a few percent is smaller than the spread between two runs on
different occasions (docs/KERNEL_TUNING.md), so its gain is measured in one process, on the
same inputs.
A before version is a folder holding another revision's ``triton_attn.py`` (the launchers) and
``triton_kernels.py`` (the jitted kernels), or one file from before the two were split (a copy of
that revision's ``kernels/triton_attn.py``). It is loaded as a sibling module of
``flashwatch.kernels``: its relative imports resolve there (the current tuning table, checks and
statistics), except that its launchers get its own kernels, which it compiles.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import statistics
import sys
from pathlib import Path

import torch

VARIANTS = (("plain", False), ("plain_stats", True), ("fixed", False))


KERNELS_MODULE = "flashwatch.kernels.triton_kernels"


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"--before: cannot load {str(path)!r} as a Python module")
    module = importlib.util.module_from_spec(spec)
    module.__package__ = "flashwatch.kernels"
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def load_before(path: str, index: int = 0):
    """A before version (see the module docstring) as a module with ``flash_attention``."""
    import flashwatch.kernels  # noqa: F401  (the package the before version's relative imports use)

    name = f"flashwatch.kernels._ab_before{index}"
    where = Path(path)
    if where.is_dir():
        launchers, kernels = where / "triton_attn.py", where / "triton_kernels.py"
        if not (launchers.is_file() and kernels.is_file()):
            raise SystemExit(f"--before: {path!r} must hold triton_attn.py and triton_kernels.py of one revision "
                             "(a copy of its kernels/ folder)")
        jitted = _load(name + "_kernels", kernels)
        current = sys.modules.get(KERNELS_MODULE)
        sys.modules[KERNELS_MODULE] = jitted  # what the launchers' `from .triton_kernels import` binds
        try:
            module = _load(name, launchers)
        finally:
            if current is None:
                sys.modules.pop(KERNELS_MODULE, None)
            else:
                sys.modules[KERNELS_MODULE] = current
    elif where.is_file():
        if re.search(r"^from \.triton_kernels import", where.read_text(), re.MULTILINE):
            raise SystemExit(f"--before: {path!r} holds only the launchers; pass the folder that holds it and the "
                             "same revision's triton_kernels.py")
        module = _load(name, where)
    else:
        raise SystemExit(f"--before: {path!r} does not exist")
    if not hasattr(module, "flash_attention"):
        raise SystemExit(f"--before: {path!r} has no flash_attention (expected a copy of kernels/triton_attn.py, "
                         "or a folder holding one)")
    return module


def kernel(module, name: str, with_stats: bool, hopper: str | None = None):
    """A forward function of ``module`` for variant ``name``. Every call sets the opt-in Hopper
    variants (``tuning.set_hopper``) to ``hopper`` (None: the environment's, off by default) and
    leaves them so, for the backward that follows the call."""
    from flashwatch.kernels import AttentionStats, tuning

    variant = "fixed" if name == "fixed" else "plain"
    held: dict = {}

    def run(q, k, v, causal):
        tuning.set_hopper(hopper)
        stats = None
        if with_stats:
            stats = held.get(q.shape[1])
            if stats is None:  # one per head count, kept across calls as a Monitor keeps its layers'
                stats = held[q.shape[1]] = AttentionStats(q.shape[1], q.device)
        return module.flash_attention(q, k, v, causal=causal, variant=variant, stats=stats)

    return run


def main(argv=None) -> int:
    from flashwatch import bench
    from flashwatch.kernels import triton_attn as after
    from flashwatch.kernels import tuning

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", action="append", default=[],
                    help="an earlier version: a copy of its kernels/ folder, or (before the launchers and "
                         "kernels were split) of its kernels/triton_attn.py; repeat for several")
    ap.add_argument("--hopper", action="append", default=[], metavar="SPEC",
                    help="the working tree's kernels with the opt-in Hopper variants of SPEC (FLASHWATCH_HOPPER "
                         "syntax, e.g. 'fwd,dkdv', '1', 'ws', 'dkdv,tma'); repeat for several")
    ap.add_argument("--variant", action="append", choices=[name for name, _ in VARIANTS],
                    help="time only these variants (default: all three)")
    ap.add_argument("--cudnn", action="store_true", help="also time SDPA cuDNN and print ratios to it")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds per shape (default 3)")
    ap.add_argument("--shape", action="append", metavar="B,H,N,D", help="shape(s) (default: the bench's four)")
    ap.add_argument("--json", metavar="PATH", help="write every number as JSON")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error(f"--rounds must be >= 1, got {args.rounds}")
    if not args.before and not args.hopper:
        ap.error("nothing to compare: give --before and/or --hopper")
    for spec in args.hopper:
        try:
            tuning.parse_hopper(spec)
        except ValueError as e:
            ap.error(f"--hopper: {e}")
    if not torch.cuda.is_available():
        print("kernel_ab needs CUDA", file=sys.stderr)
        return 2
    shapes = [bench.parse_shape(s) for s in args.shape] if args.shape else bench.DEFAULT_SHAPES
    variants = [(name, st) for name, st in VARIANTS if not args.variant or name in args.variant]
    # version -> (module, Hopper specification: "0" = off, whatever the environment says)
    versions = {f"before{i}": (load_before(path, i), "0") for i, path in enumerate(args.before)}
    if args.before:
        versions["after"] = (after, "0")
    else:
        versions["before0"] = (after, "0")  # the baseline: the working tree with the Hopper variants off
    for spec in args.hopper:
        versions[f"hopper[{spec}]"] = (after, spec)
    names = list(versions)
    width = max(9, *(len(n) for n in names))
    rows = []
    try:
        for shape in shapes:
            samples: dict[str, list[float]] = {}
            fns = {f"{ver}/{name}": kernel(mod, name, st, spec) for ver, (mod, spec) in versions.items()
                   for name, st in variants}
            if args.cudnn:
                fns["sdpa_cudnn"] = bench.kernel_functions()["sdpa_cudnn"]
            for _ in range(args.rounds):
                for key, fn in fns.items():
                    samples.setdefault(key, []).append(bench.device_fwd_bwd_ms(fn, shape, True, torch.bfloat16))
            med = {key: statistics.median(v) for key, v in samples.items()}
            rows.append({"shape": list(shape), "device_fwd_bwd_ms": med, "samples": samples})
            print(f"\nshape {shape} causal bf16, forward+backward device ms (median of {args.rounds}); "
                  f"x = ratio to before0, vs plain = overhead over the same version's plain"
                  + (f"; x cuDNN = cuDNN's time / this (cuDNN {med['sdpa_cudnn']:.3f} ms)" if args.cudnn else ""))
            cudnn_head = " x cuDNN" if args.cudnn else ""
            print(f"{'kernel':<12}" + "".join(f" {n:>{width}} {'x':>6} {'vs plain':>9}{cudnn_head}" for n in names))
            for name, _ in variants:
                line = f"{name:<12}"
                for ver in names:
                    t = med[f"{ver}/{name}"]
                    plain = med.get(f"{ver}/plain")
                    over = f"{t / plain - 1.0:+9.1%}" if plain else f"{'':>9}"
                    line += f" {t:{width}.3f} {t / med[f'before0/{name}']:6.3f} {over}"
                    if args.cudnn:
                        line += f" {med['sdpa_cudnn'] / t:7.3f}"
                print(line)
    finally:
        tuning.set_hopper(None)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"environment": bench.environment(), "before": args.before, "hopper": args.hopper, "rows": rows},
                      f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
