"""The W^Q-error chain's two per-call sums on the GPU, one launch each where PyTorch takes four or five.

- ``add_partials``: after a statistics launch in reduce mode (``rows.RowOutputs``), the programs'
  partial sums, ``part_ugv`` (B, H, S) and ``part_sketch`` (B, H, S, D, r), summed over the batch
  and the S row blocks and added into the chain's ``ugv`` (H,) and ``sketch`` (H, D, r): what
  ``ugv += part_ugv.sum((0, 2)); sketch += part_sketch.sum((0, 2))`` computes, in FP32.
- ``subtract_push``: the true gradient's push from one backward's W^Q gradient G (H, D, C), any
  strides: ``push[h] -= sum_{d, c} u[h, d] G[h, d, c] v[h, c]``, the products G v in FP32 (float64
  for a float64 G), their sums and the product with u in float64.

Both are deterministic: each output element is written by one program, which sums its terms in
the same order in every run (no atomics). The PyTorch expressions above are the reference (the
CPU path of ``flashwatch.chain`` and the tests' oracle).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import launch

__all__ = ["add_partials", "subtract_push"]

# add_partials: a program sums BLOCK_T (batch, row block) slots at a time of BLOCK_W sketch columns
_PARTIALS = dict(BLOCK_T=32, BLOCK_W=64, num_warps=4)
# subtract_push: one program per head walks its (D, C) block in tiles of BLOCK_D x BLOCK_C
_PUSH = dict(BLOCK_D=16, BLOCK_C=256, num_warps=8)


@triton.jit
def _add_partials_kernel(PART_UGV, PART_SKETCH, UGV, SKETCH, H, S, T, W,
                         BLOCK_T: tl.constexpr, BLOCK_W: tl.constexpr):
    # grid (H, cdiv(W, BLOCK_W)); W = D * r sketch entries per head, T = B * S slots per head.
    # Slot t = b * S + s of head h is row (b * H + h) * S + s of the (B * H * S, W) partials.
    h = tl.program_id(0)
    wb = tl.program_id(1)
    cols = wb * BLOCK_W + tl.arange(0, BLOCK_W)
    col_ok = cols < W
    acc = tl.zeros([BLOCK_T, BLOCK_W], dtype=tl.float32)
    for t0 in range(0, T, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        row = ((t // S) * H + h).to(tl.int64) * S + t % S  # (BLOCK_T,)
        ok = (t < T)[:, None] & col_ok[None, :]
        acc += tl.load(PART_SKETCH + row[:, None] * W + cols[None, :], mask=ok, other=0.0)
    out = SKETCH + h * W + cols
    tl.store(out, tl.load(out, mask=col_ok) + tl.sum(acc, axis=0), mask=col_ok)
    if wb == 0:  # the head's scalar, by its first program
        scal = tl.zeros([BLOCK_T], dtype=tl.float32)
        for t0 in range(0, T, BLOCK_T):
            t = t0 + tl.arange(0, BLOCK_T)
            row = ((t // S) * H + h).to(tl.int64) * S + t % S
            scal += tl.load(PART_UGV + row, mask=t < T, other=0.0)
        tl.store(UGV + h, tl.load(UGV + h) + tl.sum(scal, axis=0))


@triton.jit
def _subtract_push_kernel(G, U, V, PUSH, D, C, stride_gh, stride_gd, stride_gc,
                          F64: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_C: tl.constexpr):
    # grid (H,): head h's push, its (D, C) block of G walked in (BLOCK_D, BLOCK_C) tiles, one flat loop
    # (tile i: rows (i // tiles_c) * BLOCK_D.., columns (i % tiles_c) * BLOCK_C..) so loads pipeline
    h = tl.program_id(0)
    tiles_c = tl.cdiv(C, BLOCK_C)
    g_head = G + h.to(tl.int64) * stride_gh
    acc = tl.zeros([BLOCK_D], dtype=tl.float64)  # sum over this program's tiles of (G v)[d] u[d]
    for i in range(0, tl.cdiv(D, BLOCK_D) * tiles_c):
        d = (i // tiles_c) * BLOCK_D + tl.arange(0, BLOCK_D)
        c = (i % tiles_c) * BLOCK_C + tl.arange(0, BLOCK_C)
        d_ok = d < D
        c_ok = c < C
        g = tl.load(g_head + d[:, None].to(tl.int64) * stride_gd + c[None, :] * stride_gc,
                    mask=d_ok[:, None] & c_ok[None, :], other=0.0)
        v = tl.load(V + h * C + c, mask=c_ok, other=0.0)
        u = tl.load(U + h * D + d, mask=d_ok, other=0.0)
        if F64:
            gv = tl.sum(g.to(tl.float64) * v.to(tl.float64)[None, :], axis=1)
        else:
            gv = tl.sum((g.to(tl.float32) * v[None, :]).to(tl.float64), axis=1)
        acc += gv * u.to(tl.float64)
    tl.store(PUSH + h, tl.load(PUSH + h) - tl.sum(acc, axis=0))


def add_partials(part_ugv: torch.Tensor, part_sketch: torch.Tensor, ugv: torch.Tensor,
                 sketch: torch.Tensor) -> None:
    """ugv (H,) += part_ugv (B, H, S) summed over B and S; sketch (H, D, r) += part_sketch
    (B, H, S, D, r) likewise. All FP32 and contiguous on one device (the launcher's own buffers)."""
    B, H, S = part_ugv.shape
    W = sketch[0].numel()
    launch(_add_partials_kernel, (H, triton.cdiv(W, _PARTIALS["BLOCK_W"])),
           (part_ugv, part_sketch, ugv, sketch, H, S, B * S, W), _PARTIALS)


def subtract_push(g: torch.Tensor, u: torch.Tensor, v: torch.Tensor, push: torch.Tensor) -> None:
    """push (H,) float64 -= u_h^T G_h v_h for G (H, D, C) (any strides; FP32, BF16, FP16 or float64),
    u (H, D) and v (H, C) FP32 contiguous, all on one device."""
    H, D, C = g.shape
    if not push.is_contiguous():
        raise ValueError("subtract_push: push must be a contiguous (H,) float64 tensor")
    u, v = u.contiguous(), v.contiguous()
    launch(_subtract_push_kernel, (H,), (g, u, v, push, D, C, *g.stride()),
           dict(F64=g.dtype == torch.float64, **_PUSH))
