"""flashwatch's kernel with an attn_mask against torch SDPA with the same mask, on CUDA.

Own-kernel mode runs the kernel on masked calls (Hugging Face models pass their causal and padding
masks as tensors under torch.compile). Times forward and forward+backward (median of
``triton.testing.do_bench``) of each arm on one shape and mask, and prints each arm's time over
SDPA's with the same mask, measured in the same run (> 1: slower):

- ``sdpa_masked``: torch SDPA with the mask (cuDNN or memory-efficient attention: flash takes none);
- ``sdpa_causal``: torch SDPA with is_causal and no mask (what an unmasked causal call costs);
- ``own_masked``, ``own_masked_fp32_delta``: flashwatch's kernel with the mask (plain, fp32_delta);
- ``own_causal``: flashwatch's kernel with causal=True and no mask.

Masks: ``hf`` (B, 1, N, N) boolean, causal with left padding in half the batch (Hugging Face's
4-D mask), ``padding`` (B, 1, 1, N) boolean key padding (not causal).

    python benchmarks/masked_kernel.py --shape 16,12,1024,64 --mask hf --json out.json
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from flashwatch.bench import environment, parse_shape, time_kernel
from flashwatch.kernels import flash_attention


def make_mask(kind: str, B: int, N: int, device: str = "cuda") -> torch.Tensor:
    """The benchmark's mask: a tenth of the positions padded in every other batch entry."""
    pad = N // 10
    if kind == "hf":
        m = torch.ones(N, N, dtype=torch.bool, device=device).tril()[None, None].repeat(B, 1, 1, 1)
        m[1::2, ..., :pad] = False  # left padding
        return m
    if kind == "padding":
        m = torch.ones(B, 1, 1, N, dtype=torch.bool, device=device)
        m[1::2, ..., N - pad:] = False  # right padding
        return m
    raise ValueError(f"--mask must be hf or padding, got {kind!r}")


def arms(mask: torch.Tensor) -> dict:
    """name -> fn(q, k, v, causal) with the arm's mask bound (``time_kernel``'s calling convention)."""
    return {
        "sdpa_masked": lambda q, k, v, causal: F.scaled_dot_product_attention(q, k, v, attn_mask=mask),
        "sdpa_causal": lambda q, k, v, causal: F.scaled_dot_product_attention(q, k, v, is_causal=True),
        "own_masked": lambda q, k, v, causal: flash_attention(q, k, v, causal=False, attn_mask=mask),
        "own_masked_fp32_delta": lambda q, k, v, causal: flash_attention(q, k, v, causal=False, attn_mask=mask,
                                                                         variant="fp32_delta"),
        "own_causal": lambda q, k, v, causal: flash_attention(q, k, v, causal=True),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="16,12,1024,64", help="B,H,N,D (default GPT-2 small's 16,12,1024,64)")
    parser.add_argument("--mask", default="hf", help="hf (4-D causal with left padding) or padding (key padding)")
    parser.add_argument("--rep-ms", type=float, default=200.0, help="do_bench's repetition time per arm")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device")
    shape = parse_shape(args.shape)
    mask = make_mask(args.mask, shape[0], shape[2])
    rows = {name: time_kernel(fn, shape, False, torch.bfloat16, rep_ms=args.rep_ms) for name, fn in arms(mask).items()}
    base = rows["sdpa_masked"]
    print(f"shape {shape}, mask {args.mask} {tuple(mask.shape)}, bf16; ratios over sdpa_masked (> 1: slower)")
    print(f"{'arm':24s} {'fwd ms':>8s} {'fwd+bwd ms':>11s} {'fwd ratio':>10s} {'fwd+bwd ratio':>14s}")
    for name, r in rows.items():
        r["fwd_ratio"], r["fwd_bwd_ratio"] = r["fwd_ms"] / base["fwd_ms"], r["fwd_bwd_ms"] / base["fwd_bwd_ms"]
        print(f"{name:24s} {r['fwd_ms']:8.3f} {r['fwd_bwd_ms']:11.3f} {r['fwd_ratio']:10.3f} {r['fwd_bwd_ratio']:14.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"shape": shape, "mask": args.mask, "arms": rows, "environment": environment()}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
