"""One forward+backward of plain, plain with statistics and fixed, for a profiler (needs CUDA).

    ncu --clock-control none --kernel-name regex:'_attn_(fwd|bwd_dq)_kernel' --launch-skip 6 \\
        --section SpeedOfLight --section Occupancy --section LaunchStats --section SchedulerStats \\
        --section WarpStateStats --section ComputeWorkloadAnalysis --csv --page details \\
        python3 benchmarks/profile_kernels.py --shape 8,16,2048,64 > ncu.csv

Each variant runs once untimed first (Triton compiles there: the first six launches of the two
kernels, which ``--launch-skip 6`` leaves out), then once more; the launches are in the order
plain, statistics, fixed. docs/KERNEL_TUNING.md has what Nsight Compute said.
"""

from __future__ import annotations

import argparse
import sys

import torch


def main(argv=None) -> int:
    from flashwatch import bench
    from flashwatch.kernels import AttentionStats, flash_attention

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="8,16,2048,64", metavar="B,H,N,D", help="default 8,16,2048,64")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("profile_kernels needs CUDA", file=sys.stderr)
        return 2
    shape = bench.parse_shape(args.shape)
    q, k, v, g = bench.attention_inputs(shape, torch.bfloat16)
    stats = AttentionStats(shape[1], "cuda")
    runs = [("plain", None), ("plain", stats), ("fixed", None)]
    for _ in range(2):  # the first pass compiles
        for variant, st in runs:
            out = flash_attention(q, k, v, variant=variant, stats=st)
            torch.autograd.grad(out, (q, k, v), g)
        torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
