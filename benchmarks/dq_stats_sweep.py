"""Configurations of the statistics dQ kernel, by device time (needs CUDA).

    python benchmarks/dq_stats_sweep.py --json sweep.json

With statistics on, the dQ kernel is its own compilation and needs about twice the registers
of the plain one (docs/KERNEL_TUNING.md), so the plain kernel's best block shape need not be
its best. For each shape this times forward+backward with statistics on, replayed from a CUDA
graph (``flashwatch.bench.device_fwd_bwd_ms``), once per candidate of
``tuning.CANDIDATES["dq_stats"]`` (every other kernel at its table entry), against plain
forward+backward in the same process, and prints the overhead of each candidate; the
fastest per shape is marked. A candidate that does not compile or launch is reported and
skipped.
"""

from __future__ import annotations

import argparse
import sys

import torch


def main(argv=None) -> int:
    from flashwatch import bench
    from flashwatch.kernels import AttentionStats, flash_attention, tuning

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", action="append", metavar="B,H,N,D", help="shape(s) (default: the bench's four)")
    ap.add_argument("--json", metavar="PATH", help="write every number as JSON")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("dq_stats_sweep needs CUDA", file=sys.stderr)
        return 2
    shapes = [bench.parse_shape(s) for s in args.shape] if args.shape else bench.DEFAULT_SHAPES

    def plain(q, k, v, causal):
        return flash_attention(q, k, v, causal=causal)

    rows = []
    for shape in shapes:
        stats = AttentionStats(shape[1], "cuda")

        def with_stats(q, k, v, causal):
            return flash_attention(q, k, v, causal=causal, stats=stats)

        base = bench.device_fwd_bwd_ms(plain, shape, True, torch.bfloat16)
        default = tuning.TABLE["dq_stats"][shape[3]]
        results, best = bench.sweep_configurations(
            "dq_stats", lambda: bench.device_fwd_bwd_ms(with_stats, shape, True, torch.bfloat16), base)
        rows.append({"shape": list(shape), "plain_ms": base, "table_config": default, "candidates": results,
                     "best": best["config"] if best else None})
        print(f"\nshape {shape}: plain f+b {base:.3f} ms (device); statistics on, by dQ configuration:")
        bench.print_sweep(results, best, default)
    bench.write_sweep_json(args.json, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
