"""Device time of two versions of the Triton kernels, side by side in one run (needs CUDA).

    mkdir -p kernels/_ab_before && git archive <rev> kernels | tar -x --strip-components=1 -C kernels/_ab_before
    python benchmarks/kernel_ab.py --before kernels/_ab_before [--before other ...] --json ab.json

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


def kernel(module, name: str, with_stats: bool):
    from flashwatch.kernels import AttentionStats

    variant = "fixed" if name == "fixed" else "plain"
    held: dict = {}

    def run(q, k, v, causal):
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

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", required=True, action="append",
                    help="an earlier version: a copy of its kernels/ folder, or (before the launchers and "
                         "kernels were split) of its kernels/triton_attn.py; repeat for several")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds per shape (default 3)")
    ap.add_argument("--shape", action="append", metavar="B,H,N,D", help="shape(s) (default: the bench's four)")
    ap.add_argument("--json", metavar="PATH", help="write every number as JSON")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error(f"--rounds must be >= 1, got {args.rounds}")
    if not torch.cuda.is_available():
        print("kernel_ab needs CUDA", file=sys.stderr)
        return 2
    shapes = [bench.parse_shape(s) for s in args.shape] if args.shape else bench.DEFAULT_SHAPES
    versions = {f"before{i}": load_before(path, i) for i, path in enumerate(args.before)}
    versions["after"] = after
    names = list(versions)
    rows = []
    for shape in shapes:
        samples: dict[str, list[float]] = {}
        fns = {f"{ver}/{name}": kernel(mod, name, st) for ver, mod in versions.items() for name, st in VARIANTS}
        for _ in range(args.rounds):
            for key, fn in fns.items():
                samples.setdefault(key, []).append(bench.device_fwd_bwd_ms(fn, shape, True, torch.bfloat16))
        med = {key: statistics.median(v) for key, v in samples.items()}
        rows.append({"shape": list(shape), "device_fwd_bwd_ms": med, "samples": samples})
        print(f"\nshape {shape} causal bf16, forward+backward device ms (median of {args.rounds}); "
              f"x = ratio to before0, vs plain = overhead over the same version's plain")
        print(f"{'kernel':<12}" + "".join(f" {n:>9} {'x':>6} {'vs plain':>9}" for n in names))
        for name, _ in VARIANTS:
            line = f"{name:<12}"
            for ver in names:
                t = med[f"{ver}/{name}"]
                line += f" {t:9.3f} {t / med[f'before0/{name}']:6.3f} {t / med[f'{ver}/plain'] - 1.0:+9.1%}"
            print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"environment": bench.environment(), "before": args.before, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
