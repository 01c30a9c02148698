"""Tiles of ``chain_sums.add_partials``, by device time (needs CUDA).

    python benchmarks/partials_sweep.py [--shape B,H,S,D,R ...] [--json sweep.json]

On a monitored step each reducing launch (the statistics kernel in observe mode, the dQ kernel in
own-kernel mode) leaves one partial sum per program: a scalar and a (D, r) sketch per (batch,
head, row block), (B, H, S, D, r) FP32, 50 MB at GPT-2 small's call (B 16, H 12, S 16 row blocks
of 64, D 64, r 64). ``add_partials`` sums them over B and S into the chain's (H, D, r) sketch: a
program per head and block of BLOCK_W sketch columns reads BLOCK_T slots of BLOCK_W columns at a
time. BLOCK_W x 4 bytes is how much of each row one load reads in a row (64 B at the default 16
columns); BLOCK_T x BLOCK_W is the tile in flight. The sweep runs each launch alone, its partials
read from memory; in a step they follow the kernel that wrote them, partly from L2, so a tile's gain
here is an upper bound (``stats_ab.py`` times the statistics call with its sum, as a step runs them).

For each shape (default: GPT-2 small's call) this times one launch per tile of ``TILES`` (the
first is the default's; ``--tile`` names others) with ``triton.testing.do_bench`` (median device
time of repeated launches), checks each result against the float64 sum of the same partials
(every tile sums in its own fixed order, within FP32's bound), and prints the time, the read
bandwidth and the ratio to the first tile.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

GPT2_SMALL = (16, 12, 16, 64, 64)  # B, H, S (row blocks of 64 at N 1024), D, r
# (BLOCK_T, BLOCK_W): the default first (chain_sums: 256 x 16 at these shapes), then longer runs along the rows
TILES = [(256, 16), (128, 32), (64, 64), (32, 128), (16, 256), (8, 512), (64, 32), (32, 64), (16, 128), (32, 256)]


def partials(shape, device, seed=0):
    """Random partial sums (B, H, S) and (B, H, S, D, r), FP32, and zeroed sums (H,), (H, D, r)."""
    B, H, S, D, r = shape
    g = torch.Generator().manual_seed(seed)
    part_ugv = torch.randn(B, H, S, generator=g).to(device)
    part_sketch = torch.randn(B, H, S, D, r, generator=g).to(device)
    return part_ugv, part_sketch, torch.zeros(H, device=device), torch.zeros(H, D, r, device=device)


def launch_tile(part_ugv, part_sketch, ugv, sketch, block_t: int, block_w: int, warps: int = 4) -> None:
    """``add_partials`` at one tile: ugv += part_ugv summed over (B, S), sketch += part_sketch likewise."""
    import triton

    from flashwatch.kernels import chain_sums
    from flashwatch.kernels.launch import launch

    B, H, S = part_ugv.shape
    W = sketch[0].numel()
    launch(chain_sums._add_partials_kernel, (H, triton.cdiv(W, block_w)),
           (part_ugv, part_sketch, ugv, sketch, H, S, B * S, W), dict(BLOCK_T=block_t, BLOCK_W=block_w, num_warps=warps))


def check(shape, block_t: int, block_w: int, device, warps: int = 4) -> float:
    """One launch at the tile from zeroed sums against the float64 sums: the largest error over FP32's
    bound (T + 1 additions of the running magnitude, 2^-24 each; <= 1 passes). Raises where it is over."""
    part_ugv, part_sketch, ugv, sketch = partials(shape, device)
    launch_tile(part_ugv, part_sketch, ugv, sketch, block_t, block_w, warps)
    B, H, S, D, r = shape
    bound = (B * S + 1) * 2.0 ** -24
    worst = 0.0
    for got, parts in ((ugv, part_ugv), (sketch, part_sketch.reshape(B, H, S, -1))):
        p = parts.double().cpu()
        want = p.sum((0, 2)).reshape(got.shape)
        scale = p.abs().sum((0, 2)).reshape(got.shape)
        worst = max(worst, float(((got.double().cpu() - want).abs() / (bound * scale)).max()))
    if worst > 1.0:
        raise AssertionError(f"add_partials at tile {block_t} x {block_w}: {worst:.3g} times FP32's bound")
    return worst


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", action="append", metavar="B,H,S,D,R",
                    help="partial sums' shape (default: GPT-2 small's call, 16,12,16,64,64)")
    ap.add_argument("--tile", action="append", metavar="T,W[,WARPS]",
                    help="tile(s) to time instead of TILES: BLOCK_T,BLOCK_W and warps (default 4)")
    ap.add_argument("--json", metavar="PATH", help="write every number as JSON")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("partials_sweep needs CUDA", file=sys.stderr)
        return 2
    import triton.testing

    try:
        shapes = [tuple(int(x) for x in s.split(",")) for s in args.shape] if args.shape else [GPT2_SMALL]
    except ValueError:
        ap.error(f"--shape takes B,H,S,D,R (five ints), got {args.shape}")
    if any(len(s) != 5 or min(s) < 1 for s in shapes):
        ap.error(f"--shape takes B,H,S,D,R (five positive ints), got {args.shape}")
    try:
        tiles = [tuple(int(x) for x in t.split(",")) for t in args.tile] if args.tile else TILES
    except ValueError:
        ap.error(f"--tile takes BLOCK_T,BLOCK_W[,WARPS] (ints), got {args.tile}")
    tiles = [t if len(t) == 3 else (*t, 4) for t in tiles]
    if any(len(t) != 3 or min(t) < 1 or any(x & (x - 1) for x in t) for t in tiles):
        ap.error(f"--tile takes BLOCK_T,BLOCK_W[,WARPS], powers of two, got {args.tile}")
    out = []
    for shape in shapes:
        part_ugv, part_sketch, ugv, sketch = partials(shape, "cuda")
        megabytes = (part_sketch.numel() + part_ugv.numel()) * 4 / 1e6
        print(f"partials {shape} (B, H, S, D, r): {megabytes:.1f} MB read a launch; "
              f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
        print(f"{'BLOCK_T x BLOCK_W, warps':>24s} {'us':>8s} {'GB/s':>8s} {'vs first':>9s} {'error / bound':>14s}")
        base = None
        for block_t, block_w, warps in tiles:
            row = {"shape": shape, "block_t": block_t, "block_w": block_w, "warps": warps}
            name = f"{block_t} x {block_w}, {warps}"
            try:
                row["error_over_bound"] = check(shape, block_t, block_w, "cuda", warps)
                row["us"] = 1e3 * triton.testing.do_bench(
                    lambda: launch_tile(part_ugv, part_sketch, ugv, sketch, block_t, block_w, warps),
                    return_mode="median")
            except Exception as exc:  # noqa: BLE001  (a tile that fails is reported, the others still run)
                row["error"] = f"{type(exc).__name__}: {exc}"
                print(f"{name:>24s} failed: {row['error'][:200]}")
                out.append(row)
                continue
            base = base or row["us"]
            print(f"{name:>24s} {row['us']:8.1f} {megabytes * 1e3 / row['us']:8.0f} "
                  f"{row['us'] / base:8.3f}x {row['error_over_bound']:14.3f}")
            out.append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": out}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
