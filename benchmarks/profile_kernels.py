"""One forward+backward of plain, plain with statistics and fixed, for a profiler (needs CUDA).

    ncu --clock-control none --kernel-name regex:'_attn_(fwd|bwd_dq)_kernel' --launch-skip 6 \\
        --section SpeedOfLight --section Occupancy --section LaunchStats --section SchedulerStats \\
        --section WarpStateStats --section ComputeWorkloadAnalysis --csv --page details \\
        python3 benchmarks/profile_kernels.py --shape 8,16,2048,64 > ncu.csv

Each variant runs once untimed first (Triton compiles there: the first six launches of the two
kernels, which ``--launch-skip 6`` leaves out), then once more; the launches are in the order
plain, statistics, fixed (``--variants`` picks some: ``--variants plain`` with the dK/dV kernel
in the regex and ``--launch-skip 3`` profiles the three kernels of one plain call, as
``benchmarks/gpu_session.sh ncu128`` does). docs/KERNEL_TUNING.md has what Nsight Compute said.
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
    ap.add_argument("--variants", default="plain,stats,fixed",
                    help="comma-separated, in this order: plain, stats (plain with statistics), fixed")
    args = ap.parse_args(argv)
    chosen = args.variants.split(",")
    known = ("plain", "stats", "fixed")
    if not chosen or any(v not in known for v in chosen):
        ap.error(f"--variants {args.variants!r}: a comma-separated list out of {', '.join(known)}")
    if not torch.cuda.is_available():
        print("profile_kernels needs CUDA", file=sys.stderr)
        return 2
    shape = bench.parse_shape(args.shape)
    q, k, v, g = bench.attention_inputs(shape, torch.bfloat16)
    stats = AttentionStats(shape[1], "cuda")
    runs = [run for name, run in zip(known, [("plain", None), ("plain", stats), ("fixed", None)]) if name in chosen]
    for _ in range(2):  # the first pass compiles
        for variant, st in runs:
            out = flash_attention(q, k, v, variant=variant, stats=st)
            torch.autograd.grad(out, (q, k, v), g)
        torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
