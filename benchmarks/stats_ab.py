"""Device time of the observe-mode statistics pass in two versions of the Triton kernels, side by side
(needs CUDA).

    mkdir -p kernels/_ab_before && git archive <rev> kernels | tar -x --strip-components=1 -C kernels/_ab_before
    python benchmarks/stats_ab.py --before kernels/_ab_before [--shape B,H,N,D ...] --json stats_ab.json

For each shape (default: GPT-2 small's call, 16 x 12 x 1024 x 64, then the bench's four; causal, BF16)
and each version (the before version, then the working tree's kernels), one ``attention_statistics``
call without rows and one with the W^Q-error chain's rows reduced in the kernel (``bench.ReducingHook``:
random factors, sketch width ``chain.SKETCH_DIM``, the partial sums added up after the launch as a
Monitor's call does), timed by ``triton.testing.do_bench`` (median device time of repeated calls) in
interleaved rounds; printed: the median of the rounds and the working tree's ratio to the before
version. A before version is loaded as in ``kernel_ab.py``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", required=True, help="an earlier version: a copy of its kernels/ folder")
    ap.add_argument("--shape", action="append", metavar="B,H,N,D",
                    help="shape(s) (default: GPT-2 small's call, then the bench's four)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds per shape (default 3)")
    ap.add_argument("--json", metavar="PATH", help="write every number as JSON")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error(f"--rounds must be >= 1, got {args.rounds}")
    if not torch.cuda.is_available():
        print("stats_ab needs CUDA", file=sys.stderr)
        return 2
    import triton.testing

    from flashwatch import bench
    from flashwatch.chain import SKETCH_DIM
    from flashwatch.kernels import AttentionStats
    from flashwatch.kernels import triton_attn as after
    from kernel_ab import load_before
    from stats_sweep import shapes, statistics_inputs

    versions = {"before": load_before(args.before), "after": after}
    rows = []
    for shape in shapes(args.shape):
        B, H, N, D = shape
        q, k, v, out, dout = statistics_inputs(shape)
        hook = bench.ReducingHook(q, SKETCH_DIM)
        fns = {}
        for name, module in versions.items():
            for chain in (False, True):
                stats = AttentionStats(H, "cuda")
                stats.rows_hook = hook if chain else None
                fns[f"{name}/{'chain' if chain else 'statistics'}"] = (
                    lambda m=module, s=stats: m.attention_statistics(q, k, v, out, dout, s, causal=True))
        samples: dict[str, list[float]] = {}
        for _ in range(args.rounds):
            for key, fn in fns.items():
                samples.setdefault(key, []).append(triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median"))
        med = {key: statistics.median(v) for key, v in samples.items()}
        rows.append({"shape": list(shape), "median_ms": med, "samples": samples})
        print(f"\nshape {shape} causal bf16: one statistics call, device us (median of {args.rounds} rounds)")
        for what in ("statistics", "chain"):
            b, a = med[f"before/{what}"], med[f"after/{what}"]
            print(f"  {what + (' (rows reduced)' if what == 'chain' else ' (no rows)'):<24} before {1e3 * b:9.1f}"
                  f"   after {1e3 * a:9.1f}   after / before {a / b:6.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"environment": bench.environment(), "before": args.before, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
