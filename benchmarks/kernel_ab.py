"""Device time of two versions of the Triton kernels, side by side in one run (needs CUDA).

    git show <rev>:kernels/triton_attn.py > kernels/_ab_before.py
    python benchmarks/kernel_ab.py --before kernels/_ab_before.py [--before other.py ...] --json ab.json

For each shape and each of plain, plain with statistics and fixed, the forward+backward of each
"before" file and of the working tree's ``kernels/triton_attn.py`` are replayed from CUDA graphs
(``flashwatch.bench.device_fwd_bwd_ms``: GPU time, no host work), in interleaved rounds; the
median of the rounds is printed with each version's ratio to the first before file and its
overhead vs its own plain.
Why: a kernel change worth a few percent is smaller than the spread between two runs on
different occasions (docs/KERNEL_TUNING.md), so its gain is measured in one process, on the
same inputs.
The before file is loaded as a sibling module of ``flashwatch.kernels`` (its relative imports
resolve there); it compiles its own kernels.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys

import torch

VARIANTS = (("plain", False), ("plain_stats", True), ("fixed", False))


def load_before(path: str, index: int = 0):
    import flashwatch.kernels  # noqa: F401  (the package the before file's relative imports use)

    name = f"flashwatch.kernels._ab_before{index}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"--before: cannot load {path!r} as a Python module")
    module = importlib.util.module_from_spec(spec)
    module.__package__ = "flashwatch.kernels"
    sys.modules[name] = module
    spec.loader.exec_module(module)
    if not hasattr(module, "flash_attention"):
        raise SystemExit(f"--before: {path!r} has no flash_attention (expected a copy of kernels/triton_attn.py)")
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
                    help="a copy of an earlier kernels/triton_attn.py (repeat for several)")
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
