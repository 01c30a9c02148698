"""Configurations of the plain kernels (forward, dQ, dK/dV), by device time against cuDNN (needs CUDA).

    python benchmarks/plain_sweep.py [--kind fwd|dq|dkdv ...] [--shape B,H,N,D ...] [--json sweep.json]

At D = 128 the plain forward+backward is 0.75-0.80x cuDNN's speed on an H200, and Nsight Compute
finds all three kernels at 2 warps a scheduler (registers and shared memory allow one or two
programs an SM), issuing an instruction every 2.7-3.4 cycles (docs/KERNEL_TUNING.md). For each
shape (default: the bench's two D = 128 shapes) this times causal BF16 forward+backward replayed
from a CUDA graph (``flashwatch.bench.device_fwd_bwd_ms``): torch SDPA's cuDNN backend, the plain
kernels at their ``tuning.TABLE`` entries, then, one kernel kind at a time, every candidate of
``tuning.CANDIDATES[kind]`` with the other kinds at their entries. Each line gives the time, the
change over the table's configuration and the speed against cuDNN (> 1: faster); the fastest per
kind is marked. A candidate that does not compile or launch is reported and skipped.
"""

from __future__ import annotations

import argparse
import sys

import torch

KINDS = ("fwd", "dq", "dkdv")
D128_SHAPES = ((4, 32, 4096, 128), (1, 32, 16384, 128))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kind", action="append", choices=KINDS, help="kernel kind(s) to sweep (default: all three)")
    ap.add_argument("--shape", action="append", metavar="B,H,N,D",
                    help="shape(s) (default: the bench's D = 128 shapes, 4,32,4096,128 and 1,32,16384,128)")
    ap.add_argument("--json", metavar="PATH", help="write every number as JSON")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("plain_sweep needs CUDA", file=sys.stderr)
        return 2
    from flashwatch import bench
    from flashwatch.kernels import tuning

    shapes = [bench.parse_shape(s) for s in args.shape] if args.shape else D128_SHAPES
    kinds = args.kind or list(KINDS)
    fns = bench.kernel_functions()
    rows = []
    for shape in shapes:
        D = shape[3]

        def time_plain() -> float:
            return bench.device_fwd_bwd_ms(fns["plain"], shape, True, torch.bfloat16)

        cudnn_ms = bench.device_fwd_bwd_ms(fns["sdpa_cudnn"], shape, True, torch.bfloat16)
        table_ms = time_plain()
        print(f"\nshape {shape}: cuDNN {cudnn_ms:.3f} ms; plain at the table's entries {table_ms:.3f} ms "
              f"({cudnn_ms / table_ms:.2f}x cuDNN)")
        row = {"shape": list(shape), "cudnn_ms": cudnn_ms, "table_ms": table_ms, "kinds": {}}
        for kind in kinds:
            results, best = bench.sweep_configurations(kind, time_plain, table_ms)
            for r in results:
                if "ms" in r:
                    r["speed_vs_cudnn"] = cudnn_ms / r["ms"]
            print(f" {kind} (table: {bench.config_label(tuning.TABLE[kind][D])}), fwd+bwd by its configuration, "
                  f"over the table's, and against cuDNN:")
            bench.print_sweep(results, best, tuning.TABLE[kind][D], peer_ms=cudnn_ms)
            row["kinds"][kind] = {"table_config": tuning.TABLE[kind][D], "candidates": results,
                                  "best": best["config"] if best else None}
        rows.append(row)
    bench.write_sweep_json(args.json, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
