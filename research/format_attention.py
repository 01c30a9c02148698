"""Attention whose P_bar V product runs in a low-precision format (FP8 E4M3/E5M2, MXFP4), emulated exactly.

``format_attention(q, k, v, fmt=..., variant=...)`` computes attention as a FlashAttention-style
kernel whose P_bar V matrix product takes P_bar and V in ``fmt`` (``flashwatch.kernels.formats``)
and accumulates in FP32, as FlashAttention-3's FP8 forward does (P_bar and V in FP8 E4M3), and
an MX kernel would with MXFP4 operands (32-key blocks along the key dimension, the product's
reduction dimension, for both operands). Dense (it builds the (B, H, N, N) scores): research
and lab code, not a kernel.

Forward: s = sm_scale * q.k^T in FP32; shift = row max m (``fixed``: m + offset on tied rows,
below); P_bar = exp(s - shift) in FP32; O_fp32 = round(P_bar) round(V) / rowsum(P_bar) (the
row sum of the unrounded FP32 P_bar, as kernels keep it); O = O_fp32 rounded once to q's dtype
(BF16: FP8 kernels write a BF16 output).

Backward (BF16 numerics, as flashwatch's reference: FP8 attention kernels train with a BF16
backward): P = exp(s - lse); dP = dO V^T with the unrounded V; delta_used = rowsum(dO * O) for
``plain`` and ``fixed``, rowsum(dO * (O + R)) for ``fp32_delta`` (R = O_fp32 - O kept in q's
dtype, as flashwatch's ``fp32_delta`` kernel keeps it); dS = P (dP - delta_used); P
and dS rounded to q's dtype for the dV, dQ, dK products.

``fixed`` at a format: the BF16 fix (``flashwatch.kernels``: on rows whose max repeats, subtract
m + offset so that no P_bar is exactly 1) needs two changes where P_bar has fewer bits:
- a row counts as tied when its second score is within max(eps, -ln(t)) of the max, t =
  ``unit_threshold(fmt)``: below 1 the format's grid is coarse, so every key within 0.032 of the
  max (E4M3; 0.065 for E5M2, 0.13 for MXFP4) has a P_bar that rounds to exactly 1;
- the offset (Qiu & Yao's (beta - 1) m for m > 0, -m for m < 0) is clamped to the format's
  ``[fixed_min_offset, fixed_max_offset]``: at least enough that exp(-offset) rounds below 1
  in the format, at most what keeps the shifted P_bar inside its normal range (2 for E4M3).
At ``bf16`` this is flashwatch's ``fixed`` with eps = max(1e-3, 0.00195).

``rounded_sum`` (a candidate fix, not one of flashwatch's kernel variants): O_fp32 = round(P_bar)
round(V) / rowsum(round(P_bar)), the row sum of the rounded P_bar the product actually used, so
that the weights of each row sum to exactly 1 (up to FP32 rounding). Rounding P_bar to a format
of few bits shrinks the rounded row sum below the FP32 one on average, and dividing by the FP32
sum then pulls every O towards zero by that ratio: a one-signed error wherever V has a mean
(docs/LAB.md). The backward is ``plain``'s (delta from the stored output, lse from the FP32 sum).

Example::

    out = format_attention(q, k, v, fmt="fp8_e4m3", variant="fp32_delta")   # q, k, v (B, H, N, D) BF16
    out.backward(grad)
"""

from __future__ import annotations

import math

import torch

from flashwatch.kernels.formats import FORMATS, get_format, round_to_format, unit_gap
from flashwatch.kernels.reference import row_top2, scores

__all__ = ["format_attention", "format_forward", "install_format_sdpa", "FORMAT_VARIANTS", "V_OPERANDS"]

FORMAT_VARIANTS = ("plain", "fixed", "fp32_delta", "rounded_sum")
# How V enters the P_bar V product: "format": rounded to fmt as it is (no scale); "scaled": each
# (batch, head) slice of V multiplied by max_value / amax before rounding and divided after, as
# FlashAttention-3's FP8 path quantizes V with a descale factor per (batch, head); "input": V
# kept in its own dtype (only P_bar in fmt).
V_OPERANDS = ("format", "scaled", "input")


def _v_operand(v: torch.Tensor, fmt: str, v_operand: str) -> torch.Tensor:
    """V (B, H, N, D) as the P_bar V product takes it (V_OPERANDS), in v's dtype."""
    if v_operand == "input":
        return v
    if v_operand == "format":
        return round_to_format(v, fmt, dim=-2)  # blocks of keys: the product's reduction dim
    amax = v.abs().amax(dim=(-2, -1), keepdim=True)  # (B, H, 1, 1)
    scale = torch.where(amax > 0, get_format(fmt).max_value / amax, torch.ones_like(amax))
    return round_to_format(v * scale, fmt, dim=-2) / scale


def _tied_shift(m1: torch.Tensor, m2: torch.Tensor, fmt: str, beta: float, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(shift of the fixed variant, tied rows) at ``fmt``: see the module docstring."""
    f = get_format(fmt)
    tied = (m2 - m1) >= -max(eps, -unit_gap(f))
    raw = torch.where(m1 > 0, (beta - 1.0) * m1, -m1).clamp(f.fixed_min_offset, f.fixed_max_offset)
    return m1 + torch.where(tied, raw, torch.zeros_like(m1)), tied


@torch.no_grad()
def format_forward(q, k, v, *, fmt: str, variant: str = "plain", causal: bool = True, sm_scale=None,
                   beta: float = 2.0, eps: float = 1e-3, round_v: bool = True, v_operand: str | None = None) -> dict:
    """The forward's tensors: {"out" (q's dtype), "o_fp32", "lse", "tied"} (module docstring).

    ``v_operand`` (``V_OPERANDS``; default "format", or "input" when ``round_v=False``): how V
    enters the product; "input" separates the bias of rounding P_bar from that of rounding V."""
    _check(q, fmt, variant, beta)
    v_operand = v_operand or ("format" if round_v else "input")
    if v_operand not in V_OPERANDS:
        raise ValueError(f"v_operand must be one of {V_OPERANDS}, got {v_operand!r}")
    sm_scale = 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else float(sm_scale)
    with torch.autocast(device_type=q.device.type, enabled=False):
        s = scores(q, k, causal, sm_scale)  # (B, H, N, N) FP32 (float64 inputs: float64)
        m1, m2 = row_top2(s)
        if variant == "fixed":
            shift, tied = _tied_shift(m1, m2, fmt, beta, eps)
        else:
            shift, tied = m1, (m2 - m1) >= unit_gap(fmt)
        p_bar = torch.exp(s - shift.unsqueeze(-1))
        row_sum = p_bar.sum(-1)
        vv = _v_operand(v.to(s.dtype), fmt, v_operand)
        p_round = round_to_format(p_bar, fmt, dim=-1)
        norm = p_round.sum(-1) if variant == "rounded_sum" else row_sum
        o_fp32 = torch.matmul(p_round, vv) / norm.unsqueeze(-1)
    return {"out": o_fp32.to(q.dtype), "o_fp32": o_fp32, "lse": shift + torch.log(row_sum), "tied": tied}


def _check(q, fmt, variant, beta) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {FORMATS}, got {fmt!r}")
    if variant not in FORMAT_VARIANTS:
        raise ValueError(f"variant must be one of {FORMAT_VARIANTS}, got {variant!r}")
    if not (isinstance(beta, (int, float)) and math.isfinite(beta) and beta > 1):
        raise ValueError(f"beta must be a finite number > 1, got {beta!r}")
    if q.dim() != 4:
        raise ValueError(f"q, k, v must be (B, H, N, D), got q of shape {tuple(q.shape)}")


class _FormatAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, fmt, variant, causal, sm_scale, beta, eps, v_operand):
        f = format_forward(q, k, v, fmt=fmt, variant=variant, causal=causal, sm_scale=sm_scale, beta=beta, eps=eps,
                           v_operand=v_operand)
        # fp32_delta keeps R = O_fp32 - O in q's dtype, as flashwatch's kernel: delta from O + R
        o_used = f["out"].to(f["o_fp32"].dtype) + (f["o_fp32"] - f["out"].to(f["o_fp32"].dtype)).to(q.dtype) \
            if variant == "fp32_delta" else None
        ctx.save_for_backward(q, k, v, f["out"], f["lse"], o_used)
        ctx.causal = causal
        ctx.sm_scale = 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else float(sm_scale)
        return f["out"]

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, o_used = ctx.saved_tensors
        dtype = q.dtype
        with torch.autocast(device_type=q.device.type, enabled=False):
            s = scores(q, k, ctx.causal, ctx.sm_scale)
            cd = s.dtype
            p = torch.exp(s - lse.unsqueeze(-1))
            do = grad_out.to(cd)
            dp = torch.matmul(do, v.to(cd).transpose(-1, -2))
            delta = (do * (out.to(cd) if o_used is None else o_used)).sum(-1)
            ds = (p * (dp - delta.unsqueeze(-1))).to(dtype).to(cd)
            dv = torch.matmul(p.to(dtype).to(cd).transpose(-1, -2), do)
            dq = torch.matmul(ds, k.to(cd)) * ctx.sm_scale
            dk = torch.matmul(ds.transpose(-1, -2), q.to(cd)) * ctx.sm_scale
        return dq.to(dtype), dk.to(dtype), dv.to(dtype), None, None, None, None, None, None, None


def format_attention(q, k, v, *, fmt: str = "fp8_e4m3", variant: str = "plain", causal: bool = True,
                     sm_scale=None, beta: float = 2.0, eps: float = 1e-3, v_operand: str = "format") -> torch.Tensor:
    """Attention with P_bar and V in ``fmt`` for the P_bar V product (module docstring); differentiable.

    Args:
        q, k, v: (B, H, N, D), one dtype (BF16 in training; float32 for tests), one device.
        fmt: one of ``flashwatch.kernels.formats.FORMATS``.
        variant: ``plain``, ``fixed``, ``fp32_delta`` or ``rounded_sum``.
        causal, sm_scale: as ``flashwatch.kernels.flash_attention`` (sm_scale None: 1/sqrt(D)).
        beta, eps: the fixed variant's beta and tie tolerance (widened to the format's, above).
        v_operand: how V enters the product (``V_OPERANDS``): "format" (rounded as it is),
            "scaled" (per (batch, head) amax scale, as FlashAttention-3's FP8 path), "input".
    Returns: O in q's dtype.
    """
    _check(q, fmt, variant, beta)
    if not (q.shape == k.shape == v.shape):
        raise ValueError(f"q, k, v must have one shape (B, H, N, D), got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    if v_operand not in V_OPERANDS:
        raise ValueError(f"v_operand must be one of {V_OPERANDS}, got {v_operand!r}")
    return _FormatAttention.apply(q, k, v, fmt, variant, bool(causal), sm_scale, float(beta), float(eps), v_operand)


def install_format_sdpa(fmt: str, variant: str = "plain", v_operand: str = "format"):
    """Replace ``F.scaled_dot_product_attention`` by ``format_attention`` for self-attention calls
    without mask or dropout (others go to torch's); returns an undo function. Install it before
    a Monitor attaches, so that observe mode measures it as the model's attention."""
    import torch.nn.functional as F

    _check(torch.empty(1, 1, 1, 1), fmt, variant, 2.0)
    if v_operand not in V_OPERANDS:
        raise ValueError(f"v_operand must be one of {V_OPERANDS}, got {v_operand!r}")
    original = F.scaled_dot_product_attention

    def format_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if attn_mask is not None or dropout_p or enable_gqa or not (query.shape == key.shape == value.shape):
            return original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                            scale=scale, enable_gqa=enable_gqa)
        return format_attention(query, key, value, fmt=fmt, variant=variant, causal=bool(is_causal), sm_scale=scale,
                                v_operand=v_operand)

    F.scaled_dot_product_attention = format_sdpa

    def undo():
        if F.scaled_dot_product_attention is format_sdpa:
            F.scaled_dot_product_attention = original

    return undo
