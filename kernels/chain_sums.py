"""The W^Q-error chain's two per-call sums on the GPU, one launch each where PyTorch takes four or five.

- ``add_partials``: after a statistics launch in reduce mode (``rows.RowOutputs``), the programs'
  partial sums, ``part_ugv`` (B, H, S) and ``part_sketch`` (B, H, S, D, r), summed over the batch
  and the S row blocks and added into the chain's ``ugv`` (H,) and ``sketch`` (H, D, r): what
  ``ugv += part_ugv.sum((0, 2)); sketch += part_sketch.sum((0, 2))`` computes, in FP32.
- ``subtract_push``: the true gradient's push from one backward's W^Q gradient G (H, D, C), any
  strides: ``push[h] -= sum_{d, c} u[h, d] G[h, d, c] v[h, c]``, the products G v in FP32 (float64
  for a float64 G), their sums and the product with u in float64.

Both give the same result in every run: ``add_partials`` writes each output element from one
program, summing its terms in one order; ``subtract_push`` splits a head's terms over several
programs and its last program to finish adds their shares in one fixed order (atomics count the
programs and pass the shares on; no float is summed by atomics). The PyTorch expressions above are
the reference (the CPU path of ``flashwatch.chain`` and the tests' oracle).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import launch

__all__ = ["add_partials", "subtract_push", "PushScratch"]

# add_partials: a program sums BLOCK_T (batch, row block) slots at a time of BLOCK_W sketch columns, tiles of
# _PARTIALS_TILE entries (GPT-2 small at batch 16: 256 slots at once by 16 of the 4096 columns, 3072 programs):
# each program's loads are in flight together (the partials, 50 MB a call there, are read once)
_PARTIALS_TILE = 4096
# subtract_push: SPLIT programs per head share its (D, C) block's tiles of BLOCK_D x BLOCK_C (GPT-2 small's
# 64 x 768: 24 tiles a head over 16 programs, 192 programs in all)
_PUSH = dict(BLOCK_D=16, BLOCK_C=128, num_warps=4)
_PUSH_SPLIT = 16


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
def _subtract_push_kernel(G, U, V, PUSH, PARTS, ARRIVED, D, C, stride_gh, stride_gd, stride_gc,
                          F64: tl.constexpr, SPLIT: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_C: tl.constexpr):
    # grid (H, SPLIT): program s of head h takes tiles s, s + SPLIT, ... of the head's (D, C) block of G
    # (tile i: rows (i // tiles_c) * BLOCK_D.., columns (i % tiles_c) * BLOCK_C..), stores its float64
    # share in PARTS[h, s] and counts itself in ARRIVED[h]; the head's last program to arrive sums the
    # SPLIT shares in one fixed order (the same result whichever program is last), subtracts the sum
    # from PUSH[h] and sets ARRIVED[h] back to 0 for the next launch.
    h = tl.program_id(0)
    s = tl.program_id(1)
    tiles_c = tl.cdiv(C, BLOCK_C)
    g_head = G + h.to(tl.int64) * stride_gh
    acc = tl.zeros([BLOCK_D], dtype=tl.float64)  # sum over this program's tiles of (G v)[d] u[d]
    for i in range(s, tl.cdiv(D, BLOCK_D) * tiles_c, SPLIT):
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
    # the share (its float64 bits: PARTS is int64) and the count as atomics of one thread each, in program
    # order: the count releases the share, and the last program's count acquires every other program's
    tl.atomic_xchg(PARTS + h * SPLIT + s, tl.sum(acc, axis=0).to(tl.int64, bitcast=True), sem="release")
    if tl.atomic_add(ARRIVED + h, 1, sem="acq_rel") == SPLIT - 1:
        bits = tl.atomic_add(PARTS + h * SPLIT + tl.arange(0, SPLIT), 0, sem="acquire")  # read through L2
        shares = bits.to(tl.float64, bitcast=True)
        tl.store(PUSH + h, tl.load(PUSH + h) - tl.sum(shares, axis=0))
        tl.atomic_xchg(ARRIVED + h, 0, sem="relaxed")


def add_partials(part_ugv: torch.Tensor, part_sketch: torch.Tensor, ugv: torch.Tensor,
                 sketch: torch.Tensor) -> None:
    """ugv (H,) += part_ugv (B, H, S) summed over B and S; sketch (H, D, r) += part_sketch
    (B, H, S, D, r) likewise. All FP32 and contiguous on one device (the launcher's own buffers)."""
    B, H, S = part_ugv.shape
    W = sketch[0].numel()
    block_t = min(256, triton.next_power_of_2(B * S))
    block_w = min(max(16, _PARTIALS_TILE // block_t), triton.next_power_of_2(W))
    launch(_add_partials_kernel, (H, triton.cdiv(W, block_w)), (part_ugv, part_sketch, ugv, sketch, H, S, B * S, W),
           dict(BLOCK_T=block_t, BLOCK_W=block_w, num_warps=4))


def subtract_push(g: torch.Tensor, u: torch.Tensor, v: torch.Tensor, push: torch.Tensor,
                  scratch: "PushScratch") -> None:
    """push (H,) float64 -= u_h^T G_h v_h for G (H, D, C) (any strides; FP32, BF16, FP16 or float64),
    u (H, D) and v (H, C) FP32, all on one device; ``scratch`` holds the programs' shares (one per
    chain: launches of one chain follow one another on its stream)."""
    H, D, C = g.shape
    if not push.is_contiguous():
        raise ValueError("subtract_push: push must be a contiguous (H,) float64 tensor")
    u, v = u.contiguous(), v.contiguous()
    parts, arrived = scratch.buffers(H, g.device)
    launch(_subtract_push_kernel, (H, _PUSH_SPLIT), (g, u, v, push, parts, arrived, D, C, *g.stride()),
           dict(F64=g.dtype == torch.float64, SPLIT=_PUSH_SPLIT, **_PUSH))


class PushScratch:
    """``subtract_push``'s device buffers for one accumulator: the programs' float64 shares (H, SPLIT),
    held as their bits in int64 (atomics pass them on), and each head's count of programs arrived (H,)
    int32, 0 between launches; made at the first use."""

    def __init__(self):
        self._buffers: tuple[torch.Tensor, torch.Tensor] | None = None

    def buffers(self, heads: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        b = self._buffers
        if b is None or b[1].shape[0] != heads or b[1].device != device:
            b = self._buffers = (torch.zeros(heads, _PUSH_SPLIT, dtype=torch.int64, device=device),
                                 torch.zeros(heads, dtype=torch.int32, device=device))
        return b
