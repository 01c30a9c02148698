"""Attention in plain PyTorch with the semantics, variants and statistics of the Triton kernel.

The CPU path of ``flash_attention`` and the oracle of the kernel tests. Dense: it builds the
(B, H, N, N) score tensor, so keep N moderate (the demo uses N <= 256 on the CPU).

Numerics, as the FlashAttention-2 style Triton kernel computes them:

- forward: s = sm_scale * q.k^T in FP32 (FP64 for FP64 inputs); shift = row max m (the fixed
  variant adds a guarded offset on repeated-max rows); P_bar = exp(s - shift) rounded to the
  input dtype for the P_bar V product, accumulated in FP32; O_fp32 = (P_bar V) / rowsum(P_bar);
  O = O_fp32 rounded once to the input dtype; lse = shift + log(rowsum(P_bar)).
- backward: P = exp(s - lse) in FP32; dP = dO V^T; delta_used = rowsum(dO * O) for
  ``plain``/``fixed`` and rowsum(dO * (O + R)) for ``fp32_delta``, with R = O_fp32 - O kept by
  the forward in the input dtype; dS = P * (dP - delta_used); P and dS are rounded to the input
  dtype for the dV, dQ, dK products, as the kernel feeds them to the tensor cores.
- statistics: see ``stats.AttentionStats``; delta_hp = rowsum(P * dP), the delta of the exact
  softmax output in FP32; the own kernel's backward takes it as rowsum(P * dP) / rowsum(P) with
  P through lse as above (the row sum takes out lse's FP32 rounding, a factor common to the row),
  the statistics pass of observe mode (``attention_statistics``) with P as exp(s - m) over its
  row sum: at max logits in the thousands both keep the delta error to FP32's accuracy. The per-row outputs of ``AttentionStats.rows_hook``: delta_used -
  delta_hp and P K, an FP32 product of the FP32 P (float64 inputs: computed in float64), always
  handed to the hook (a hook's ``reduction``, which the Triton kernels apply in-kernel, is not
  used here: the hook reduces the rows itself, e.g. ``flashwatch.chain.LayerChain.add_rows``).

The Triton kernel's tiling changes FP32 rounding (running max, accumulation order), not the
function: outputs and gradients agree within the tolerance rule of the tests; repeated-max
counts and max logits agree exactly.
"""

from __future__ import annotations

import math

import torch

from . import faults
from .checks import check_attn_mask, check_options, check_qkv, fixed_offset
from .stats import AttentionStats, CallMaxLogit, fold_max_logit

__all__ = ["flash_attention", "attention_statistics", "forward", "backward", "scores", "row_top2",
           "inject_rounding_bias", "unit_p_gap", "format_tie_flags"]

_COMPUTE = {torch.float64: torch.float64}
_PRECISION_BITS = {torch.bfloat16: 8, torch.float16: 11, torch.float32: 24, torch.float64: 53}


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return _COMPUTE.get(dtype, torch.float32)


def _round_to(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x rounded to ``dtype`` (round-to-nearest-even), returned in x's dtype."""
    if dtype in (torch.float32, torch.float64):
        return x
    return x.to(dtype).to(x.dtype)


def _expand_kv(t: torch.Tensor, num_heads: int) -> torch.Tensor:
    """(B, Hkv, N, D) -> (B, H, N, D): query head h reads kv head h // (H // Hkv) (as Llama)."""
    groups = num_heads // t.shape[1]
    return t if groups == 1 else t.repeat_interleave(groups, dim=1)


def scores(q: torch.Tensor, k: torch.Tensor, causal: bool, sm_scale: float,
           attn_mask: torch.Tensor | None = None) -> torch.Tensor:
    """s = sm_scale * q.k^T in the compute dtype, -inf above the diagonal when causal. (B, H, N, N).
    ``attn_mask`` (broadcasting to s) as SDPA applies it: a boolean mask (True = attend) sets the
    scores it masks to -inf, a float mask is added (its entries at or below ``MASKED_AT`` as the
    kernels take them: ``_add_mask``)."""
    cd = _compute_dtype(q.dtype)
    s = torch.matmul(q.to(cd), _expand_kv(k, q.shape[1]).to(cd).transpose(-1, -2)) * sm_scale
    if attn_mask is not None:
        s = s.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else _add_mask(s, attn_mask)
    if causal:
        n = q.shape[2]
        mask = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1)
        s = s.masked_fill(mask, float("-inf"))
    return s


# A float mask's finite entries at or below MASKED_AT (masked.MASKED_AT) make the scaled score this constant
# (the kernels' _attention_mask): no weight beside any other key; a row masked so everywhere averages evenly
MASKED_AT, MASKED_SCORE = -1e4, -1e6


def _add_mask(s: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Scaled scores s plus a float mask, as the kernels add it (``MASKED_SCORE``)."""
    m = mask.to(s.dtype)
    floor = torch.where(m == float("-inf"), float("-inf"), MASKED_SCORE).to(s.dtype)
    return torch.where(m > MASKED_AT, s + m, floor)


def row_top2(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Largest and second largest score of each row, counted with multiplicity. (B, H, N) each.

    A row repeats its max within eps iff second >= first - eps: this is how the kernel counts
    exactly over the whole row while it only ever holds one tile of it.
    """
    if s.shape[-1] == 1:
        return s[..., 0], torch.full_like(s[..., 0], float("-inf"))
    top = torch.topk(s, 2, dim=-1).values
    return top[..., 0], top[..., 1]


def tie_flags(m1: torch.Tensor, m2: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(repeated-max row on the scores, the same on BF16-rounded scores), as bool (B, H, N).

    Rounding is monotone, so the top two of the BF16-rounded row are the rounded top two.
    """
    tied = m2 >= m1 - eps
    m1b = m1.to(torch.bfloat16).to(m1.dtype)
    m2b = m2.to(torch.bfloat16).to(m1.dtype)
    return tied, m2b >= m1b - eps


def unit_p_gap(dtype: torch.dtype) -> float:
    """ln(1 - 2**-p): P_bar = exp(s - m) rounds to exactly 1 in ``dtype`` iff s - m >= this
    (values in (1 - 2**-p, 1] round to 1; the midpoint rounds to 1, the even neighbour).
    About -0.00196 for BF16, -0.00049 for FP16, -6e-8 for FP32."""
    return math.log1p(-(2.0 ** -_PRECISION_BITS[dtype]))


def inject_rounding_bias(o_fp32: torch.Tensor, rows: torch.Tensor, strength: float, dtype: torch.dtype) -> torch.Tensor:
    """INJECTED FAULT (experiments only): inflate |O| by strength * 2**-p before rounding.

    p is the dtype's precision in bits (8 for BF16), so strength 1 pushes every value of the
    selected rows by at least half a unit in the last place: rounding then always goes away
    from zero, the direction of the bias Qiu & Yao describe. ``rows`` (B, H, N) bool selects
    the rows where the kernel accumulates P_bar V with P_bar exactly 1 at two or more keys:
    second score - max >= ``unit_p_gap(dtype)``.
    """
    factor = 1.0 + strength * 2.0 ** -_PRECISION_BITS[dtype]
    return torch.where(rows.unsqueeze(-1), o_fp32 * factor, o_fp32)


def _add_max_logit(stats: "AttentionStats | CallMaxLogit", m1) -> None:
    stats.max_logit.copy_(torch.maximum(stats.max_logit, m1.amax(dim=(0, 2)).to(torch.float32)))


def format_tie_flags(m1: torch.Tensor, m2: torch.Tensor, gap: float) -> torch.Tensor:
    """Rows where P_bar rounds to exactly 1 at two or more keys in a format: second >= max + gap,
    gap = ``AttentionStats.unit_gap`` (negative). (B, H, N) bool."""
    return m2 >= m1 + gap


def _add_row_counts(stats: AttentionStats, tied, tied_bf16, tied_format) -> None:
    B, H, N = tied.shape
    stats.rows.add_(B * N)
    stats.repeated_max_rows.add_(tied.sum(dim=(0, 2)))
    stats.repeated_max_rows_bf16.add_(tied_bf16.sum(dim=(0, 2)))
    stats.repeated_max_rows_format.add_(tied_format.sum(dim=(0, 2)))


def _report_rows(stats: AttentionStats, err: torch.Tensor, p: torch.Tensor, k: torch.Tensor) -> None:
    """Call ``stats.rows_hook(delta_error_rows, pk)`` if one is set. err: (B, H, N) delta_used -
    delta_hp; p: (B, H, N, N) exact softmax; k: (B, Hkv, N, D). Both outputs FP32."""
    hook = stats.rows_hook
    if hook is not None:
        pk = torch.matmul(p, _expand_kv(k, p.shape[1]).to(p.dtype))
        hook(err.to(torch.float32), pk.to(torch.float32))


def _add_delta_stats(stats: AttentionStats, err: torch.Tensor, tied: torch.Tensor) -> None:
    """err: (B, H, N) delta_used - delta_hp; tied: (B, H, N) bool."""
    err = err.to(torch.float32)
    stats.delta_error.add_(err.sum(dim=(0, 2)))
    stats.delta_error_abs.add_(err.abs().sum(dim=(0, 2)))
    stats.delta_error_sq.add_((err * err).sum(dim=(0, 2)))
    stats.delta_error_tied.add_(torch.where(tied, err, torch.zeros_like(err)).sum(dim=(0, 2)))


def _no_autocast(fn):
    """Run ``fn`` with autocast off on its inputs' device: the reference chooses its own
    precision (FP32 scores and accumulation), as the Triton kernel does; an enclosing
    autocast region must not turn its matrix products into BF16 ones."""

    def wrapped(ctx, first, *args):
        with torch.autocast(device_type=first.device.type, enabled=False):
            return fn(ctx, first, *args)

    wrapped.__doc__ = fn.__doc__
    return wrapped


def forward(q, k, v, causal, sm_scale, variant, beta, eps, stats, fault_strength, attn_mask=None):
    """The forward without autograd: (out, lse, residual or None). Adds the max logit into
    ``stats.max_logit`` (when given: a ``CallMaxLogit`` under autograd), as the kernel's forward
    does, but for a call with an ``attn_mask`` (its backward measures it: ``masked.measure_call``).
    A row the mask leaves no key gets output 0 and lse +inf (no gradient), as SDPA gives it.
    Autocast must be off."""
    dtype = q.dtype
    s = scores(q, k, causal, sm_scale, attn_mask)  # (B, H, N, N)
    m1, m2 = row_top2(s)
    shift = m1
    if variant == "fixed":
        tied, _ = tie_flags(m1, m2, eps)
        shift = m1 + torch.where(tied, fixed_offset(m1, beta, dtype), torch.zeros_like(m1))
    empty = m1 == float("-inf")  # rows with no key (a mask's): shift 0, not -inf (no inf - inf)
    shift = torch.where(empty, torch.zeros_like(shift), shift)
    p_bar = torch.exp(s - shift.unsqueeze(-1))
    row_sum = p_bar.sum(-1)
    vv = _expand_kv(v, q.shape[1]).to(s.dtype)
    o_fp32 = torch.matmul(_round_to(p_bar, dtype), vv) / torch.where(empty, 1.0, row_sum).unsqueeze(-1)
    o_hp = o_fp32  # before any injected fault: fp32_delta's delta comes from it
    if fault_strength and variant != "fixed":
        # the fixed variant keeps every P_bar < 1, so the injected fault never triggers there
        unit_rows = (m2 - m1) >= unit_p_gap(dtype)  # P_bar rounds to 1 at two or more keys
        o_fp32 = inject_rounding_bias(o_fp32, unit_rows, fault_strength, dtype)
    out = o_fp32.to(dtype)
    residual = (o_hp - out.to(o_hp.dtype)).to(dtype) if variant == "fp32_delta" else None
    lse = torch.where(empty, float("inf"), shift + torch.log(row_sum))
    if stats is not None and attn_mask is None:  # as the kernel: max logit here, rows and tie counts in the backward
        _add_max_logit(stats, m1)
    return out, lse, residual


def backward(grad_out, q, k, v, out, lse, residual, causal, sm_scale, eps, stats, attn_mask=None,
             pattern_read=None):
    """The backward without autograd: (dq, dk, dv). Adds rows, repeated-max counts and the
    delta-error sums into ``stats`` (when given) and calls its ``rows_hook``; for a call with an
    ``attn_mask`` by ``masked.measure_call`` (``pattern_read``: its mask's read, started in the forward).
    Autocast must be off."""
    dtype = q.dtype
    H, Hkv = q.shape[1], k.shape[1]
    s = scores(q, k, causal, sm_scale, attn_mask)
    cd = s.dtype
    p = torch.exp(s - lse.unsqueeze(-1))  # (B, H, N, N), exact softmax in FP32
    do = grad_out.to(cd)
    vv = _expand_kv(v, H).to(cd)
    dp = torch.matmul(do, vv.transpose(-1, -2))
    o_used = out.to(cd) if residual is None else out.to(cd) + residual.to(cd)
    delta_used = (do * o_used).sum(-1)
    ds = p * (dp - delta_used.unsqueeze(-1))
    dv = torch.matmul(_round_to(p, dtype).transpose(-1, -2), do)
    ds_r = _round_to(ds, dtype)
    dq = torch.matmul(ds_r, _expand_kv(k, H).to(cd)) * sm_scale
    dk = torch.matmul(ds_r.transpose(-1, -2), q.to(cd)) * sm_scale
    if Hkv != H:  # sum the gradients of the query heads that share a kv head
        B, _, N, D = k.shape
        dk = dk.view(B, Hkv, H // Hkv, N, D).sum(2)
        dv = dv.view(B, Hkv, H // Hkv, N, D).sum(2)
    if stats is not None and attn_mask is not None:
        from . import masked

        masked.measure_call(q, k, v, out, residual, grad_out, stats, attn_mask, causal, sm_scale, eps, pattern_read)
    elif stats is not None:
        m1, m2 = row_top2(s)  # the forward's scores, computed again
        tied, tied_bf16 = tie_flags(m1, m2, eps)
        # delta_hp over P's own row sum: exp(s - lse) carries lse's FP32 rounding (|lse| 2^-24), a
        # factor common to the row that the sum takes out (as the Triton dQ pass does)
        err = delta_used - (p * dp).sum(-1) / p.sum(-1)  # delta_used - delta_hp
        _add_row_counts(stats, tied, tied_bf16, format_tie_flags(m1, m2, stats.unit_gap))
        _add_delta_stats(stats, err, tied)
        _report_rows(stats, err, p, k)
    return dq.to(dtype), dk.to(dtype), dv.to(dtype)


class _ReferenceAttention(torch.autograd.Function):
    @staticmethod
    @_no_autocast
    def forward(ctx, q, k, v, causal, sm_scale, variant, beta, eps, stats, fault_strength, attn_mask):
        call = CallMaxLogit(q.shape[1], q.device) if stats is not None else None  # folded in at the backward
        out, lse, residual = forward(q, k, v, causal, sm_scale, variant, beta, eps, call, fault_strength, attn_mask)
        ctx.save_for_backward(q, k, v, out, lse, residual, attn_mask)
        ctx.causal, ctx.sm_scale, ctx.eps, ctx.stats, ctx.call = causal, sm_scale, eps, stats, call
        ctx.pattern_read = None
        if stats is not None and attn_mask is not None:  # read now, for the backward's choice of pass
            from . import masked

            ctx.pattern_read = masked.start_read(attn_mask, q.shape[2], q.shape[2], causal)
        return out

    @staticmethod
    @_no_autocast
    def backward(ctx, grad_out):
        if ctx.stats is not None:
            fold_max_logit(ctx.stats, ctx.call.max_logit)
        q, k, v, out, lse, residual, attn_mask = ctx.saved_tensors
        dq, dk, dv = backward(grad_out, q, k, v, out, lse, residual, ctx.causal, ctx.sm_scale, ctx.eps, ctx.stats,
                              attn_mask, ctx.pattern_read)
        return dq, dk, dv, None, None, None, None, None, None, None, None


def flash_attention(q, k, v, *, causal=True, sm_scale=None, variant="plain", beta=2.0, eps=1e-3,
                    stats=None, attn_mask=None):
    """Reference attention; same contract as ``flashwatch.kernels.flash_attention``.

    Also accepts float64 inputs (computed in float64 throughout), for use as an oracle. The
    INJECTED rounding bias of ``faults`` is read here, at call time, as the Triton path does.
    """
    check_qkv(q, k, v, allowed_dtypes=(torch.bfloat16, torch.float16, torch.float32, torch.float64))
    check_options(variant, beta, eps, causal, sm_scale)
    check_attn_mask(attn_mask, q)
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(q.shape[-1])
    if stats is not None:
        stats.check_compatible(q.shape[1], q.device)
    return _ReferenceAttention.apply(q, k, v, causal, float(sm_scale), variant, float(beta), float(eps),
                                     stats, faults.rounding_bias_strength(), attn_mask)


@torch.no_grad()
def attention_statistics(q, k, v, out, grad_out, stats, *, causal=True, sm_scale=None, eps=1e-3):
    """Statistics-only pass for observe mode: add ``out``'s statistics into ``stats``.

    ``out`` is the output the model's own attention produced and saved (its backward takes
    delta_used = rowsum(grad_out * out)), ``grad_out`` its gradient. Adds rows, repeated-max
    counts, max logit and the delta-error sums of delta_used - rowsum(P * dP). Returns None.
    """
    check_qkv(q, k, v, allowed_dtypes=(torch.bfloat16, torch.float16, torch.float32, torch.float64))
    check_options("plain", 2.0, eps, causal, sm_scale)
    if out.shape != q.shape or grad_out.shape != q.shape:
        raise ValueError(f"out and grad_out must have q's shape {tuple(q.shape)}, got "
                         f"{tuple(out.shape)} and {tuple(grad_out.shape)}")
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(q.shape[-1])
    stats.check_compatible(q.shape[1], q.device)
    with torch.autocast(device_type=q.device.type, enabled=False):
        _statistics(q, k, v, out, grad_out, stats, causal, float(sm_scale), eps)


def _statistics(q, k, v, out, grad_out, stats, causal, sm_scale, eps):
    s = scores(q, k, causal, sm_scale)
    m1, m2 = row_top2(s)
    tied, tied_bf16 = tie_flags(m1, m2, eps)
    _add_max_logit(stats, m1)
    _add_row_counts(stats, tied, tied_bf16, format_tie_flags(m1, m2, stats.unit_gap))
    cd = s.dtype
    # P as the statistics pass computes it: exp(s - m) over its row sum. Through the log-sum-exp,
    # exp(s - lse) would carry lse's rounding, |lse| 2^-24 of every P: at max logits in the
    # thousands a sizeable part of the delta error, itself a rounding residue
    e = torch.exp(s - m1.unsqueeze(-1))
    p = e / e.sum(-1, keepdim=True)
    do = grad_out.to(cd)
    dp = torch.matmul(do, _expand_kv(v, q.shape[1]).to(cd).transpose(-1, -2))
    delta_hp = (p * dp).sum(-1)
    delta_used = (do * out.to(cd)).sum(-1)
    err = delta_used - delta_hp
    _add_delta_stats(stats, err, tied)
    _report_rows(stats, err, p, k)
