"""Argument checks shared by every attention path, the check of the environment switches, and
the numbers of the fixed variant.

Each error names the argument, what it was, and what is accepted.
"""

from __future__ import annotations

import math
import numbers
import os

import torch

# absolute, not `..vocabulary`: with a checkout's root on sys.path (python -m from there) other
# packages may import this folder as a top-level `kernels` (transformers looks for a package of that name)
from flashwatch.vocabulary import VARIANTS

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
HEAD_DIMS = (16, 32, 64, 128)

# The fixed variant subtracts shift = m + offset on rows whose max repeats, instead of m, so
# that every exp(s - shift) < 1. Qiu & Yao's offset is (beta - 1) * m for m > 0 and -m for
# m < 0 (their shift beta*m or 0). Two guards:
# - at least FIXED_MIN_OFFSET, so that exp(-offset) rounds below 1 in BF16 (1 - 2**-9 would
#   round to 1) also when m == 0, a case the paper's rule leaves alone;
# - at most FIXED_MAX_OFFSET[dtype], so that the row sum never underflows: the paper's rule
#   unguarded gives exp(-m) -> 0 and a zero row sum (NaN) once logits reach the hundreds
#   (exp(-x) rounds to 0 in FP32 beyond x = 104). exp(-20) = 2e-9 keeps 67 natural-log units
#   of FP32 range below the shifted max (BF16 has FP32's range). For FP16 inputs P is rounded
#   to FP16 for the PV product, whose normal range ends near exp(-9.7) and subnormals near
#   exp(-16.6): every nat of offset moves a nat of a row's keys below the max out of that
#   range (into subnormals, then to 0) while the FP32 row sum still counts them, so a long row
#   of keys ~10 below a repeated max lost ~1% of its output at an offset of 8. 1 keeps FP16's
#   tied rows within plain's accuracy (P_bar at the tied keys exp(-1), well below 1).
FIXED_MIN_OFFSET = 1.0 / 64.0
FIXED_MAX_OFFSET = {torch.bfloat16: 20.0, torch.float32: 20.0, torch.float16: 1.0, torch.float64: 20.0}


# The kernels' on/off environment switches: variable -> (on when unset, what on does, what off does).
# Each accepts 1 (on), 0 (off) or unset (its default); any other value is refused.
SWITCHES = {
    "FLASHWATCH_FAST_LAUNCH": (True, "the cached launch and launch plans", "every launch through Triton's own"),
    "FLASHWATCH_KERNEL_REDUCTION": (True, "reduce in the kernels", "store the rows"),
    "FLASHWATCH_AUTOTUNE": (False, "time every candidate block shape at a shape's first call", "the tuned table"),
    "FLASHWATCH_HOPPER_WS_UNVERIFIED": (False, "accept the feature 'ws' in FLASHWATCH_HOPPER", "refuse it"),
}


def switch(variable: str) -> bool:
    """Whether the environment switch ``variable`` of ``SWITCHES`` is on now: "1" on, "0" off, unset
    its default; any other value is refused with what is accepted and what each setting does."""
    value = os.environ.get(variable, "")
    default, on, off = SWITCHES[variable]
    if value not in ("", "0", "1"):
        unset = "on" if default else "off"
        raise ValueError(f"{variable}={value!r}: accepted are 1 ({on}), 0 ({off}) or unset ({unset})")
    return default if value == "" else value == "1"


def check_switches() -> None:
    """Refuse a bad value of any of ``SWITCHES`` now (``import flashwatch.kernels`` calls this), not at
    the first call that imports the module reading it, where it would stop the kernel path mid-run."""
    for variable in SWITCHES:
        switch(variable)


def _is_real(value) -> bool:
    """A finite real number (``numbers.Real``: int, float, numpy scalars), never a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def check_options(variant: str, beta: float, eps: float, causal: bool, sm_scale) -> None:
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    if not _is_real(beta) or beta <= 1.0:
        raise ValueError(f"beta must be a finite number > 1 (the fixed variant subtracts beta*max), got {beta!r}")
    if not _is_real(eps) or eps < 0:
        raise ValueError(f"eps must be a finite number >= 0 (tie tolerance in logits), got {eps!r}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if sm_scale is not None and (not _is_real(sm_scale) or sm_scale <= 0):
        raise ValueError(f"sm_scale must be None (1/sqrt(D)) or a finite number > 0 (not a bool), got {sm_scale!r}")


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed_dtypes=DTYPES) -> None:
    """q: (B, H, N, D); k, v: (B, Hkv, N, D) with Hkv dividing H; one dtype, one device."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must have 4 dimensions (B, heads, N, D), got shape {tuple(t.shape)}")
        if t.dtype not in allowed_dtypes:
            raise TypeError(f"{name} has dtype {t.dtype}; accepted: {', '.join(str(d) for d in allowed_dtypes)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    B, H, N, D = q.shape
    if k.shape[0] != B:
        raise ValueError(f"batch sizes differ: q has {B}, k and v have {k.shape[0]}")
    if k.shape[2] != N:
        raise ValueError(f"sequence lengths differ: q has N={N}, k and v have N={k.shape[2]}; "
                         "flashwatch attention is self-attention with one length")
    if k.shape[3] != D:
        raise ValueError(f"head dims differ: q has D={D}, k and v have D={k.shape[3]}")
    if D not in HEAD_DIMS:
        raise ValueError(f"head dim D={D} is not supported; accepted: {HEAD_DIMS}")
    Hkv = k.shape[1]
    if Hkv < 1 or H % Hkv:
        raise ValueError(f"k/v heads Hkv={Hkv} must divide q heads H={H} (grouped-query attention)")
    if N < 1 or B < 1:
        raise ValueError(f"q must have at least one batch entry and one row, got shape {tuple(q.shape)}")


def check_attn_mask(attn_mask, q: torch.Tensor) -> None:
    """An attn_mask of ``flash_attention``: None, or a tensor on q's device, boolean (True = attend) or
    floating (added to the scaled scores), of a shape that broadcasts to (B, H, N, N), needing no gradient."""
    if attn_mask is None:
        return
    if not isinstance(attn_mask, torch.Tensor):
        raise TypeError(f"attn_mask must be None or a torch.Tensor, got {type(attn_mask).__name__}")
    if attn_mask.dtype != torch.bool and not attn_mask.dtype.is_floating_point:
        raise TypeError(f"attn_mask has dtype {attn_mask.dtype}; accepted: torch.bool (True = attend) or a "
                        "floating dtype (added to the scaled scores)")
    if attn_mask.device != q.device:
        raise ValueError(f"attn_mask is on {attn_mask.device}, q on {q.device}: they must be on one device")
    if attn_mask.requires_grad and torch.is_grad_enabled():
        raise ValueError("attn_mask requires a gradient (a learned bias), and the kernels compute none for it; "
                         "accepted: a mask without one (detach it), or torch SDPA for this call")
    B, H, N, _ = q.shape
    try:
        if attn_mask.dim() > 4:
            raise RuntimeError
        torch.broadcast_shapes(tuple(attn_mask.shape), (B, H, N, N))
    except RuntimeError:
        raise ValueError(f"attn_mask of shape {tuple(attn_mask.shape)} does not broadcast to (B, H, N, N) = "
                         f"{(B, H, N, N)}; accepted: e.g. (N, N), (B, 1, 1, N) key padding, (B, 1, N, N)") from None


def fixed_offset(m: torch.Tensor, beta: float, dtype: torch.dtype) -> torch.Tensor:
    """Offset added to the row max m on repeated-max rows by the fixed variant (guarded)."""
    raw = torch.where(m > 0, (beta - 1.0) * m, -m)
    return raw.clamp(min=FIXED_MIN_OFFSET, max=FIXED_MAX_OFFSET[dtype])
