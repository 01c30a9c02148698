"""The paper's all-BF16 tiled FlashAttention-2 numerics, emulated in PyTorch for experiments.

Derived from: the public code of Qiu & Yao, "Why Low-Precision Transformer Training Fails: An
Analysis on Flash Attention" (ICLR 2026, arXiv 2510.04212), repository
ucker/why-low-precision-training-fails, file attention.py (a pure-PyTorch FlashAttention-2
with 512 x 512 tiles; its fix is switched on there by the environment variable STABLE=1).
This is a new implementation of the same arithmetic, not a copy; what it must reproduce is
the rounding of every step:

- forward, per query tile, over key tiles: s = (q k^T) * sm_scale, rounded to the input dtype
  after the product and again after the scale; masked scores are -finfo(dtype).max (finite);
  the tile max, the running max m, P_bar = exp(s - m), the tile row sum (clamped at 1e-10),
  the tile product P_bar V (one matrix product, rounded once), the rescale exp(m_old - m_new),
  the running row sum l = alpha * l + l_tile and the running output O = O * alpha + P_bar V are
  each rounded to the input dtype (BF16) as they are computed; O / l and lse = log(l) + m at the
  end, in the input dtype too.
- fixed=True (the paper's section 4 rule, per key tile): if more than one score of the tile is
  >= tile max - 1e-3 (computed in the input dtype), the tile max becomes 2 * max if max > 0 and
  0 if max < 0; a tile max of exactly 0 is left alone; ties across tiles are not seen.
- backward, per query tile, over key tiles, all in the input dtype: delta = rowsum(dO * O)
  (product rounded, sum rounded once), P = exp(s - lse) with -inf masking, dV += P^T dO,
  dP = dO V^T, dS = (P * sm_scale) * (dP - delta), dQ += dS K, dK += dS^T Q, every product and
  every accumulation rounded to the input dtype.

In float64 every step is exact up to float64 rounding, so the emulation computes softmax
attention (tests/test_paper.py checks it against torch SDPA).

Changes from the public code:
- layout and API of ``flashwatch.kernels.flash_attention``: (B, H, N, D), ``sm_scale`` (the
  public code always uses D**-0.5), GQA by repeating kv heads (dK, dV summed over the query
  heads of a group in the input dtype), ``tile`` configurable (int, or (query, key) pair).
- no padding mask, no separate query/key lengths: self-attention with one length N.
- key tiles entirely above the causal diagonal are skipped where that changes nothing (the
  plain forward and every backward: their contribution is exactly zero). With ``fixed=True``
  they are processed as the public code does, because there its rule sees a fully masked tile
  as a tie of the masked value and raises the running max of those rows to at least 0.
- delta is computed once per query tile (the public code recomputes the same value per key tile).
- autocast is switched off inside and the function is never compiled
  (``torch.compiler.disable``): under CUDA autocast exp, log and sum run in FP32, and inductor
  computes fused BF16 pointwise ops in FP32; either would silently change the numerics.

Cautions:
- This is an emulation of the function's eager numerics on BF16 tensors (as ``research.lab``
  measures them, docs/LAB.md), not necessarily of the paper's training run: its train.py defaults
  to BF16 autocast and torch.compile, under which some of these roundings happen in FP32.
- The fixed rule is the paper's, unguarded: once 2 * max exceeds the scores by ~90 natural-log
  units the tile's P_bar underflows, the 1e-10 clamp hides the zero row sum, and such rows come
  out as zeros or are silently dropped (tests/test_paper.py shows it). For a guarded rule use
  ``flash_attention(..., variant="fixed")``.
- Matrix products use the backend's kernels: FP32 accumulation, one rounding at the end on
  CPU (oneDNN) and on CUDA (cuBLAS), unless a backend is allowed reduced-precision reductions
  (``torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction``).
- Dense per tile: a (B, H, tile, tile) score tensor per step; memory O(B H tile^2 + B H N D).
  Slow (tens of small kernels per tile pair): for experiments and small models, not speed.
- No statistics (``AttentionStats``) and no variants: it is the paper's kernel, nothing more.
"""

from __future__ import annotations

import math

import torch

from .checks import check_qkv

__all__ = ["paper_attention", "TIE_EPS", "ROW_SUM_FLOOR"]

TIE_EPS = 1e-3        # the public code's tie tolerance for its per-tile fix
ROW_SUM_FLOOR = 1e-10  # the public code clamps each tile's row sum at this value

_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def _expand_kv(t: torch.Tensor, num_heads: int) -> torch.Tensor:
    """(B, Hkv, N, D) -> (B, H, N, D): query head h reads kv head h // (H // Hkv)."""
    groups = num_heads // t.shape[1]
    return t if groups == 1 else t.repeat_interleave(groups, dim=1)


def _tiles(n: int, size: int):
    return [(start, min(start + size, n)) for start in range(0, n, size)]


def _causal_mask(q0: int, q1: int, k0: int, k1: int, device) -> torch.Tensor | None:
    """True where key index > query index within the tile pair, or None if nothing is masked."""
    if k1 - 1 <= q0:  # every key of the tile is at or before the first query
        return None
    qi = torch.arange(q0, q1, device=device).unsqueeze(-1)
    kj = torch.arange(k0, k1, device=device).unsqueeze(0)
    return kj > qi


def _tile_scores(qt, kt, sm_scale, mask, fill):
    s = torch.matmul(qt, kt.transpose(-1, -2)) * sm_scale  # (B, H, tq, tk), rounded twice
    return s if mask is None else s.masked_fill(mask, fill)


def _fixed_tile_max(s: torch.Tensor, tile_max: torch.Tensor) -> torch.Tensor:
    """The public code's rule, per key tile: shifted max on tiles whose max repeats."""
    repeated = (s >= tile_max - TIE_EPS).sum(-1, keepdim=True) > 1
    tile_max = torch.where(repeated & (tile_max > 0), 2.0 * tile_max, tile_max)
    return torch.where(repeated & (tile_max < 0), torch.zeros_like(tile_max), tile_max)


def _forward(q, k, v, causal, sm_scale, fixed, tq, tk):
    B, H, N, D = q.shape
    dtype = q.dtype
    kk, vv = _expand_kv(k, H), _expand_kv(v, H)
    lowest = -torch.finfo(dtype).max
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty(B, H, N, 1, dtype=dtype, device=q.device)
    for q0, q1 in _tiles(N, tq):
        qt = q[:, :, q0:q1]
        acc = torch.zeros(B, H, q1 - q0, D, dtype=dtype, device=q.device)   # running O
        l = torch.zeros(B, H, q1 - q0, 1, dtype=dtype, device=q.device)     # running row sum
        m = torch.full((B, H, q1 - q0, 1), lowest, dtype=dtype, device=q.device)  # running max
        for k0, k1 in _tiles(N, tk):
            if causal and k0 > q1 - 1 and not fixed:
                break  # fully masked: P_bar = 0 exactly, the update is a no-op
            mask = _causal_mask(q0, q1, k0, k1, q.device) if causal else None
            s = _tile_scores(qt, kk[:, :, k0:k1], sm_scale, mask, lowest)
            tile_max = s.amax(-1, keepdim=True)
            if fixed:
                tile_max = _fixed_tile_max(s, tile_max)
            m_new = torch.maximum(tile_max, m)
            p_bar = torch.exp(s - m_new)
            tile_sum = p_bar.sum(-1, keepdim=True).clamp(min=ROW_SUM_FLOOR)
            pv = torch.matmul(p_bar, vv[:, :, k0:k1])  # rounded to dtype before it is added
            alpha = torch.exp(m - m_new)
            l = alpha * l + tile_sum
            acc = acc * alpha + pv
            m = m_new
        out[:, :, q0:q1] = acc / l
        lse[:, :, q0:q1] = torch.log(l) + m
    return out, lse


def _backward(q, k, v, out, lse, grad_out, causal, sm_scale, tq, tk):
    B, H, N, D = q.shape
    Hkv = k.shape[1]
    kk, vv = _expand_kv(k, H), _expand_kv(v, H)
    dq = torch.zeros_like(q, memory_format=torch.contiguous_format)
    dk = torch.zeros(B, H, N, D, dtype=q.dtype, device=q.device)  # per query head
    dv = torch.zeros(B, H, N, D, dtype=q.dtype, device=q.device)
    for q0, q1 in _tiles(N, tq):
        qt, dot = q[:, :, q0:q1], grad_out[:, :, q0:q1]
        delta = (dot * out[:, :, q0:q1]).sum(-1, keepdim=True)  # in the input dtype
        lse_t = lse[:, :, q0:q1]
        for k0, k1 in _tiles(N, tk):
            if causal and k0 > q1 - 1:
                break  # fully masked: P = 0, every contribution is exactly zero
            mask = _causal_mask(q0, q1, k0, k1, q.device) if causal else None
            kt, vt = kk[:, :, k0:k1], vv[:, :, k0:k1]
            s = _tile_scores(qt, kt, sm_scale, mask, float("-inf"))
            p = torch.exp(s - lse_t)
            dv[:, :, k0:k1] += torch.matmul(p.transpose(-1, -2), dot)
            dp = torch.matmul(dot, vt.transpose(-1, -2))
            ds = (p * sm_scale) * (dp - delta)
            dq[:, :, q0:q1] += torch.matmul(ds, kt)
            dk[:, :, k0:k1] += torch.matmul(ds.transpose(-1, -2), qt)
    if Hkv != H:  # the query heads of a group share one kv head
        dk = dk.view(B, Hkv, H // Hkv, N, D).sum(2)
        dv = dv.view(B, Hkv, H // Hkv, N, D).sum(2)
    return dq, dk, dv


class _PaperAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, sm_scale, fixed, tq, tk):
        with torch.autocast(q.device.type, enabled=False):
            out, lse = _forward(q, k, v, causal, sm_scale, fixed, tq, tk)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (causal, sm_scale, tq, tk)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        causal, sm_scale, tq, tk = ctx.args
        with torch.autocast(q.device.type, enabled=False):
            dq, dk, dv = _backward(q, k, v, out, lse, grad_out.to(q.dtype), causal, sm_scale, tq, tk)
        return dq, dk, dv, None, None, None, None, None


def _check_tile(tile) -> tuple[int, int]:
    sizes = (tile, tile) if isinstance(tile, int) and not isinstance(tile, bool) else tile
    if (not isinstance(sizes, (tuple, list)) or len(sizes) != 2
            or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 1 for t in sizes)):
        raise ValueError(f"tile must be a positive int or a (query, key) pair of positive ints, got {tile!r}")
    return int(sizes[0]), int(sizes[1])


@torch.compiler.disable
def paper_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True,
                    sm_scale: float | None = None, fixed: bool = False,
                    tile: int | tuple[int, int] = 512) -> torch.Tensor:
    """Attention with the paper's all-BF16 tiled numerics (see the module docstring), with autograd.

    Args:
        q: (B, H, N, D) queries; bf16 (the point), fp16, fp32 or fp64 (exact up to rounding).
        k, v: (B, Hkv, N, D); Hkv divides H (query head h reads kv head h // (H // Hkv)).
        causal: mask keys after the query (as SDPA's ``is_causal``).
        sm_scale: score scale; None means 1/sqrt(D).
        fixed: the paper's per-tile shifted max on tiles whose max repeats (unguarded).
        tile: tile size for queries and keys (512 in the public code), or a (query, key) pair.

    Returns:
        (B, H, N, D) output in q's dtype.

    Raises:
        TypeError, ValueError: with the argument's name and what is accepted.
    """
    check_qkv(q, k, v, allowed_dtypes=_DTYPES)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if not isinstance(fixed, bool):
        raise TypeError(f"fixed must be a bool, got {type(fixed).__name__}")
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(q.shape[-1])
    elif not isinstance(sm_scale, (int, float)) or not math.isfinite(sm_scale) or sm_scale <= 0:
        raise ValueError(f"sm_scale must be None (1/sqrt(D)) or a finite number > 0, got {sm_scale!r}")
    tq, tk = _check_tile(tile)
    return _PaperAttention.apply(q, k, v, causal, float(sm_scale), fixed, tq, tk)
