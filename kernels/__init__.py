"""flashwatch.kernels: flash attention with in-kernel stability statistics and fixed variants.

Installed as the subpackage ``flashwatch.kernels`` (the repository keeps its source in the
top-level ``kernels/`` folder; no top-level ``kernels`` module is installed).

Public API:
    flash_attention(q, k, v, *, causal=True, sm_scale=None, variant="plain", beta=2.0,
                    eps=1e-3, stats=None, attn_mask=None) -> Tensor
    attention_statistics(q, k, v, out, grad_out, stats, *, causal=True, sm_scale=None, eps=1e-3)
    AttentionStats(num_heads, device)
    VARIANTS = ("plain", "fixed", "fp32_delta")
    reference   (module) the same in plain PyTorch, the CPU path and the test oracle
    paper       (module) the paper's all-BF16 tiled numerics, for experiments
    faults      (module) the INJECTED rounding-bias fault, for tests and experiments only

Dispatch: CUDA tensors run the Triton kernel; CPU tensors run ``reference``, unless the
environment variable TRITON_INTERPRET=1 is set, in which case the Triton kernel runs in
Triton's interpreter (slow; for tests at small shapes). FLASHWATCH_HOPPER (off by default)
switches in opt-in Hopper variants of the forward and dK/dV kernels (``tuning.parse_hopper``).
"""

from __future__ import annotations

import os

import torch

from . import faults, reference
from .checks import DTYPES, HEAD_DIMS, VARIANTS, check_attn_mask, check_options, check_qkv, check_switches
from .stats import FIELDS as STAT_FIELDS
from .stats import AttentionStats
from .tuning import HOPPER_ENV, parse_hopper

check_switches()  # a bad value of an on/off switch (checks.SWITCHES) fails here, before training starts
parse_hopper(os.environ.get(HOPPER_ENV, ""))  # and a bad FLASHWATCH_HOPPER (read again at each launch)

__all__ = ["flash_attention", "attention_statistics", "AttentionStats", "VARIANTS", "HEAD_DIMS",
           "DTYPES", "STAT_FIELDS", "reference", "faults", "uses_triton"]


def uses_triton(device: torch.device) -> bool:
    """True where ``flash_attention`` runs the Triton kernel for tensors on ``device``."""
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True,
                    sm_scale: float | None = None, variant: str = "plain", beta: float = 2.0,
                    eps: float = 1e-3, stats: AttentionStats | None = None,
                    attn_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Scaled dot-product attention, as ``F.scaled_dot_product_attention(q, k, v,
    attn_mask=attn_mask, is_causal=causal, scale=sm_scale)``, with autograd, optional statistics and
    variants.

    Args:
        q: (B, H, N, D) queries; bf16, fp16 or fp32 (fp32 computed without TF32).
        k, v: (B, Hkv, N, D) keys and values; Hkv must divide H (grouped-query attention:
            query head h uses kv head h // (H // Hkv)). Non-contiguous tensors are accepted.
        causal: mask keys after the query (top-left aligned, as SDPA's ``is_causal``).
        sm_scale: score scale; None means 1/sqrt(D).
        variant: ``"plain"`` (FlashAttention-2 numerics), ``"fixed"`` (Qiu & Yao's shifted max
            on repeated-max rows, with an underflow guard) or ``"fp32_delta"`` (the backward
            takes delta from the FP32 output). All three compute the same function.
        beta: the fixed variant's factor (> 1): it subtracts beta*max on tied rows with a
            positive max, 0 on tied rows with a negative max (guarded, see ``checks``).
        eps: tie tolerance in logits (>= 0) for repeated-max rows.
        stats: an ``AttentionStats`` to add this call's statistics into when its backward runs
            (rows, repeated-max counts, delta error, and the max logit the forward found: a
            forward without backward adds nothing), on the device, without host
            synchronisation; its ``rows_hook``, if set, is called by the backward with this
            call's per-row delta errors and P K. None costs nothing.
        attn_mask: None, or a mask that broadcasts to (B, H, N, N), as SDPA takes it: boolean
            (True = attend; key padding (B, 1, 1, N), Hugging Face's (B, 1, N, N), ...) or floating
            (added to the scaled scores). With ``causal`` both apply (SDPA takes one or the other).
            A row left no key gets output 0 and no gradient, as SDPA gives it. The variants act as
            without a mask. Statistics of a masked call are taken in its backward by the dense pass
            of ``flashwatch.kernels.masked`` (padding rows left out; an (H, N, N) score tensor per
            batch entry), from the output whose delta the backward used.

    The INJECTED rounding-bias fault of tests and experiments is no argument here: it is the
    process-wide knob ``flashwatch.kernels.faults`` (off by default), read at every call.

    Returns:
        (B, H, N, D) output in q's dtype; where the Triton kernel runs, laid out in memory as
        (B, N, H, D), as SDPA's flash and cuDNN paths give it (``out.transpose(1, 2)`` is contiguous).

    Raises:
        TypeError, ValueError: with the argument's name and what is accepted.
    """
    check_qkv(q, k, v)
    check_options(variant, beta, eps, causal, sm_scale)
    check_attn_mask(attn_mask, q)
    if stats is not None:
        if not isinstance(stats, AttentionStats):
            raise TypeError(f"stats must be an AttentionStats or None, got {type(stats).__name__}")
        stats.check_compatible(q.shape[1], q.device)
    if uses_triton(q.device):
        from . import triton_attn  # imported lazily: the CPU path never needs triton

        return triton_attn.flash_attention(q, k, v, causal=causal, sm_scale=sm_scale, variant=variant,
                                           beta=beta, eps=eps, stats=stats, attn_mask=attn_mask)
    return reference.flash_attention(q, k, v, causal=causal, sm_scale=sm_scale, variant=variant, beta=beta,
                                     eps=eps, stats=stats, attn_mask=attn_mask)


def attention_statistics(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                         grad_out: torch.Tensor, stats: AttentionStats, *, causal: bool = True,
                         sm_scale: float | None = None, eps: float = 1e-3) -> None:
    """Statistics-only pass beside another attention kernel (observe mode).

    Adds to ``stats`` what ``flash_attention(..., stats=stats)`` would add, for an output
    ``out`` (B, H, N, D) that some other kernel computed and saved for its backward, and that
    output's gradient ``grad_out``: rows, repeated-max counts (FP32 and BF16 scores), the max
    logit, and the delta-error sums of rowsum(grad_out * out) - rowsum(P * dP) (P as exp(s - m)
    over its row sum; the own kernel's backward divides by rowsum(P) instead, which takes out the
    log-sum-exp's rounding: both keep the delta error at max logits in the thousands). Runs the Triton
    statistics kernel on CUDA (reads the bf16 inputs, accumulates in FP32, no N x N tensor)
    and the reference on the CPU. No host synchronisation. If ``stats.rows_hook`` is set, it is
    called once, before this returns, with the per-row delta errors and P K
    (``AttentionStats``); an exception it raises propagates.
    """
    check_qkv(q, k, v)
    check_options("plain", 2.0, eps, causal, sm_scale)
    if not isinstance(stats, AttentionStats):
        raise TypeError(f"stats must be an AttentionStats, got {type(stats).__name__}")
    if out.shape != q.shape or grad_out.shape != q.shape:
        raise ValueError(f"out and grad_out must have q's shape {tuple(q.shape)}, got "
                         f"{tuple(out.shape)} and {tuple(grad_out.shape)}")
    stats.check_compatible(q.shape[1], q.device)
    if uses_triton(q.device):
        from . import triton_attn

        return triton_attn.attention_statistics(q, k, v, out, grad_out, stats, causal=causal,
                                                sm_scale=sm_scale, eps=eps)
    return reference.attention_statistics(q, k, v, out, grad_out, stats, causal=causal, sm_scale=sm_scale,
                                          eps=eps)
