"""Statistics of attention calls with an attention mask or unequal query and key lengths.

``attention_statistics(q, k, v, out, grad_out, stats, attn_mask=..., causal=..., ...)`` adds
to ``stats`` what ``flashwatch.kernels.attention_statistics`` adds for a plain call, for calls
the Triton kernels do not take: an ``attn_mask`` (boolean, True = attend, or additive float,
as ``torch.nn.functional.scaled_dot_product_attention`` takes it; any shape that broadcasts to
(B, H, Nq, Nk): key-padding masks (B, 1, 1, Nk), Hugging Face's 4-D masks (B, 1, Nq, Nk), ...)
and query and key lengths that differ (cross attention, a KV cache; not with ``causal``).

Rows left out of every statistic:

- rows with no key to attend to;
- padding rows of self-attention (Nq == Nk): a position j whose own key is masked in its own
  row (mask[j, j]) may be padding; a row that is such a position, or attends to one (which only
  a padding row does), is left out when its output gradient is all zero (no loss reads it, as
  no loss reads padding). The gradient decides because the mask alone cannot: cross attention
  with equal lengths and an encoder key-padding mask, or a mask that hides each position's own
  key, look the same, and their rows are real (their outputs reach the loss). Without an output
  gradient (calls with attention dropout, whose pass gets a zero gradient) the mask alone
  decides. (Older Hugging Face versions let fully masked padding rows attend to every key, to
  keep SDPA's kernels free of NaN; such a row cannot be told from a real one by the mask and
  is counted.)

The mask is applied as SDPA applies it: a boolean mask sets masked scores to -inf, a float
mask is added to the scores. An additive entry at or below ``MASKED_AT`` (-10,000) counts as
masked (-inf, the dtype's lowest value, -1e9 and -10,000 are the usual ones): SDPA gives such a
key no weight next to any real one, and left in, a row with every key so masked would tie at
its maximum by rounding alone (s - 1e9 rounds to a multiple of 64 in FP32). The max logit
includes an additive mask's finite values above it (a position bias is part of the logit).

Dense, as ``reference``: one (H, Nq, Nk) score tensor per batch element at a time, in FP32 (FP64
for FP64 inputs), on the inputs' device. ``stats.rows_hook`` is called once, as by the plain
pass.

A mask that is only the causal pattern, or masks nothing, is the call without it: such a call
goes to the plain pass (``flashwatch.kernels.attention_statistics``, the Triton kernel on CUDA,
no N x N tensor) where that pass takes its shapes. Models pass such masks where they cannot
leave them out: Hugging Face's under ``torch.compile`` build the causal mask as a tensor. Telling
it takes a host read of a few device flags per mask tensor (a model passes one mask to all its
layers; read again only after an in-place change). ``read_pattern(attn_mask, n)`` starts that read
without waiting (a non-blocking copy into pinned memory), for a caller that has the mask in the
forward and measures in the backward: given to ``attention_statistics`` as ``pattern_read``, the
backward waits only until the device got past the forward's read, not for all the work queued
before the backward (a wait there stalls the host, on every monitored step, as often as there
are masked layers).
"""

from __future__ import annotations

import logging

import torch

from torch.utils.weak import WeakIdKeyDictionary

from . import reference
from .checks import check_qkv
from .reference import _add_delta_stats, _add_max_logit, _compute_dtype, _expand_kv, format_tie_flags, row_top2, tie_flags
from .stats import AttentionStats

__all__ = ["attention_statistics", "measure_call", "mask_reason", "has_pattern", "start_read", "read_pattern",
           "no_pattern_read"]

log = logging.getLogger("flashwatch")


def mask_reason(attn_mask, q: torch.Tensor, k: torch.Tensor, causal: bool) -> str | None:
    """Why this mask (and these lengths) cannot be measured here, or None."""
    B, H, Nq, _ = q.shape
    Nk = k.shape[2]
    if causal and Nq != Nk:
        return f"causal attention with query and key lengths that differ ({Nq} vs {Nk})"
    if attn_mask is None:
        return None
    if not isinstance(attn_mask, torch.Tensor):
        return f"attn_mask is a {type(attn_mask).__name__}, not a tensor"
    if attn_mask.dtype != torch.bool and not attn_mask.dtype.is_floating_point:
        return f"attn_mask has dtype {attn_mask.dtype} (accepted: bool, or a float mask added to the scores)"
    if attn_mask.dim() > 4:
        return f"attn_mask has {attn_mask.dim()} dimensions"
    try:
        torch.broadcast_shapes(tuple(attn_mask.shape), (B, H, Nq, Nk))
    except RuntimeError:
        return f"attn_mask of shape {tuple(attn_mask.shape)} does not broadcast to {(B, H, Nq, Nk)}"
    return None


# an additive mask's entries at or below this count as masked (module docstring): a key whose
# weight is below exp(-10,000) next to any unmasked one has none in any float format (the kernels
# and the reference give such a score one constant: reference.MASKED_SCORE)
MASKED_AT = reference.MASKED_AT


def _allowed_and_bias(mask_b: torch.Tensor | None, cd: torch.dtype):
    """(allowed bool, additive bias or None) of one batch element's mask."""
    if mask_b is None:
        return None, None
    if mask_b.dtype == torch.bool:
        return mask_b, None
    return mask_b > MASKED_AT, mask_b.to(cd)  # -inf and NaN compare False: masked


# mask tensor -> (its version when read, its read: read_pattern's tensor); see read_pattern
_patterns: WeakIdKeyDictionary = WeakIdKeyDictionary()
# data pointer of a read's pinned tensor -> the event after its copy, while that copy may be in flight
_in_flight: dict = {}
_IN_FLIGHT_KEPT = 1024  # past this many, the events already passed are forgotten
_read_failed = False  # start_read has logged a failed read

# read_pattern's tensor: int8 (4,) [read, causal, full, unbiased]; read = 0: nothing was read
PATTERN_READ_SHAPE = (4,)


def no_pattern_read() -> torch.Tensor:
    """A read that read nothing (``attention_statistics`` then reads the mask itself)."""
    return torch.zeros(PATTERN_READ_SHAPE, dtype=torch.int8)


def has_pattern(attn_mask, nq: int, nk: int, causal: bool) -> bool:
    """Whether ``attention_statistics`` asks for this mask's pattern: a mask tensor of a call with
    equal query and key lengths, not causal (a caller that has the mask earlier can start the read
    then: ``read_pattern``)."""
    return isinstance(attn_mask, torch.Tensor) and not causal and nq == nk


def start_read(attn_mask, nq: int, nk: int, causal: bool) -> torch.Tensor | None:
    """``read_pattern``'s read of ``attn_mask`` where ``attention_statistics`` will ask for one
    (``has_pattern``), else None. Never raises: a read that fails is logged once and gives None
    (the statistics pass then reads the mask itself)."""
    global _read_failed
    if not has_pattern(attn_mask, nq, nk, causal):
        return None
    try:
        return read_pattern(attn_mask, nq)
    except Exception:
        if not _read_failed:
            _read_failed = True
            log.warning("flashwatch: reading an attention mask's pattern failed; the statistics pass reads it "
                        "itself instead", exc_info=True)
        return None


def read_pattern(attn_mask: torch.Tensor, n: int) -> torch.Tensor:
    """Start reading whether the (..., n, n) ``attn_mask`` is only the causal pattern or masks
    nothing; returns the read, a CPU int8 tensor (4,) to pass to ``attention_statistics`` as
    ``pattern_read``. For a CUDA mask it is filled by a non-blocking copy into pinned memory, and
    its reader waits for that copy only; elsewhere it is filled at once. Launches nothing for a
    mask tensor already read (the same tensor, not changed in place since)."""
    seen = _patterns.get(attn_mask)
    if seen is not None and seen[0] == attn_mask._version:
        return seen[1]
    with torch.no_grad():
        allowed = attn_mask if attn_mask.dtype == torch.bool else attn_mask > MASKED_AT
        index = torch.arange(n, device=attn_mask.device)
        causal = index[:, None] >= index[None, :]  # (n, n): True up to each row's own key
        no_bias = torch.ones((), dtype=torch.bool, device=attn_mask.device) if attn_mask.dtype == torch.bool \
            else ((attn_mask == 0) | ~allowed).all()
        flags = torch.stack([torch.ones((), dtype=torch.bool, device=attn_mask.device), (allowed == causal).all(),
                             allowed.all(), no_bias]).to(torch.int8)
        if attn_mask.device.type == "cuda":
            read = torch.empty(PATTERN_READ_SHAPE, dtype=torch.int8, pin_memory=True)
            read.copy_(flags, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            if len(_in_flight) >= _IN_FLIGHT_KEPT:
                for ptr in [p for p, e in _in_flight.items() if e.query()]:
                    del _in_flight[ptr]
            _in_flight[read.data_ptr()] = event
        else:
            read = flags.cpu()
    _patterns[attn_mask] = (attn_mask._version, read)
    return read


def _decode(read: torch.Tensor) -> tuple[bool, str | None]:
    """(whether ``read`` read anything, and then ``"causal"``, ``"full"`` or None), waiting for
    its copy where that may still be in flight."""
    event = _in_flight.get(read.data_ptr())
    if event is not None:
        event.synchronize()
    was_read, is_causal, is_full, unbiased = read.tolist()
    return bool(was_read), ("causal" if is_causal else "full" if is_full else None) if unbiased else None


def _plain_equivalent(attn_mask: torch.Tensor, n: int, read: torch.Tensor | None = None) -> str | None:
    """``"causal"`` if the (..., n, n) mask lets each row see exactly the keys up to its own,
    ``"full"`` if it masks nothing (a float mask: 0 where it lets a key through), else None; from
    ``read`` (``read_pattern``'s, started earlier) where it read something, else read now."""
    if read is not None:
        was_read, pattern = _decode(read)
        if was_read:
            return pattern
    return _decode(read_pattern(attn_mask, n))[1]


def _plain_pass_takes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    try:
        check_qkv(q, k, v)
    except (TypeError, ValueError):
        return False
    return True


@torch.no_grad()
def attention_statistics(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                         grad_out: torch.Tensor, stats: AttentionStats, *, attn_mask: torch.Tensor | None = None,
                         causal: bool = False, sm_scale: float, eps: float = 1e-3,
                         pattern_read: torch.Tensor | None = None) -> None:
    """Add the statistics of one masked (or unequal-length) attention call into ``stats``.

    Args:
        q: (B, H, Nq, D); k, v: (B, Hkv, Nk, D) with Hkv dividing H; out, grad_out: (B, H, Nq, D)
            the model's attention output and its gradient.
        attn_mask: None, or a boolean / float mask broadcastable to (B, H, Nq, Nk) (see
            ``mask_reason`` for what is accepted; the caller checks).
        causal: top-left causal masking (Nq == Nk only).
        pattern_read: ``read_pattern(attn_mask, Nq)``'s read of this mask, started earlier (None:
            read here, when needed).
    """
    B, H, Nq, D = q.shape
    Nk = k.shape[2]
    if attn_mask is not None and not causal and Nq == Nk and _plain_pass_takes(q, k, v):
        pattern = _plain_equivalent(attn_mask, Nq, pattern_read)
        if pattern is not None:  # the call without its mask: the plain pass, no N x N tensor
            from . import attention_statistics as plain_statistics

            plain_statistics(q, k, v, out, grad_out, stats, causal=pattern == "causal", sm_scale=sm_scale, eps=eps)
            return
    cd = _compute_dtype(q.dtype)
    mask = torch.broadcast_to(attn_mask, (B, H, Nq, Nk)) if attn_mask is not None else None
    causal_block = torch.ones(Nq, Nk, dtype=torch.bool, device=q.device).triu(1) if causal else None
    hook = stats.rows_hook
    errs, pks = [], []
    with torch.autocast(device_type=q.device.type, enabled=False):
        for b in range(B):
            qb, kb, vb = q[b].to(cd), _expand_kv(k[b:b + 1], H)[0].to(cd), _expand_kv(v[b:b + 1], H)[0].to(cd)
            s = torch.matmul(qb, kb.transpose(-1, -2)) * sm_scale  # (H, Nq, Nk)
            allowed, bias = _allowed_and_bias(mask[b] if mask is not None else None, cd)
            if bias is not None:
                s = s + bias
            if allowed is None:
                allowed = torch.ones_like(s, dtype=torch.bool)
            if causal_block is not None:
                allowed = allowed & ~causal_block
            s = s.masked_fill(~allowed, float("-inf"))
            valid = allowed.any(-1)  # (H, Nq): rows with a key to attend to
            if Nq == Nk:
                padding = ~allowed.diagonal(dim1=-2, dim2=-1)  # (H, N): positions whose own key is masked
                near_padding = padding | (allowed & padding[:, None, :]).any(-1)
                unread = (grad_out[b] == 0).all(-1)  # (H, N): rows whose output no loss reads
                valid = valid & ~(near_padding & unread)
            m1, m2 = row_top2(s)
            tied, tied_bf16 = tie_flags(m1, m2, eps)
            tied, tied_bf16 = tied & valid, tied_bf16 & valid
            _add_max_logit(stats, torch.where(valid, m1, torch.full_like(m1, float("-inf")))[None])
            stats.rows.add_(valid.sum(-1))
            stats.repeated_max_rows.add_(tied.sum(-1))
            stats.repeated_max_rows_bf16.add_(tied_bf16.sum(-1))
            stats.repeated_max_rows_format.add_((format_tie_flags(m1, m2, stats.unit_gap) & valid).sum(-1))
            # P as the statistics pass computes it, exp(s - m) over its row sum (not exp(s - lse),
            # which carries lse's rounding: reference._statistics says why); rows left out are 0
            shift = torch.where(valid, m1, torch.zeros_like(m1))[..., None]
            e = torch.exp(s - shift)
            p = torch.where(valid[..., None], e / e.sum(-1, keepdim=True).clamp_min(torch.finfo(cd).tiny),
                            torch.zeros_like(s))
            do = grad_out[b].to(cd)
            dp = torch.matmul(do, vb.transpose(-1, -2))
            err = torch.where(valid, (do * out[b].to(cd)).sum(-1) - (p * dp).sum(-1), torch.zeros_like(m1))
            _add_delta_stats(stats, err[None], tied[None])
            if hook is not None:
                errs.append(err.to(torch.float32))
                pks.append(torch.matmul(p, kb).to(torch.float32))
    if hook is not None:
        hook(torch.stack(errs), torch.stack(pks))


def measure_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, residual: torch.Tensor | None,
                 grad_out: torch.Tensor, stats: AttentionStats, attn_mask: torch.Tensor, causal: bool, sm_scale: float,
                 eps: float, pattern_read: torch.Tensor | None = None) -> None:
    """Add the statistics of one of ``flash_attention``'s calls with an ``attn_mask`` into ``stats``, from its
    backward: the kernels take no statistics with a mask, so this pass measures the call, with the output
    whose rowsum(dO * O) the kernel's backward used as delta (``out``, or ``out + residual`` in FP32 under
    the fp32_delta variant: the delta error it reports is the one the gradients carry)."""
    used = out if residual is None else out.to(torch.float32) + residual.to(torch.float32)
    attention_statistics(q, k, v, used, grad_out, stats, attn_mask=attn_mask, causal=causal, sm_scale=sm_scale,
                         eps=eps, pattern_read=pattern_read)
