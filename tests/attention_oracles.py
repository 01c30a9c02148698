"""Oracles shared by the kernel tests: float64 attention, a same-dtype PyTorch attention for
the tolerance rule, and the rule itself (as flash-attention's tests: the kernel's max error
against float64 is at most twice the same-dtype PyTorch error, plus a small floor)."""

from __future__ import annotations

import math

import torch


def expand_kv(t: torch.Tensor, heads: int) -> torch.Tensor:
    return t.repeat_interleave(heads // t.shape[1], dim=1)


def attention64(q, k, v, causal=True, sm_scale=None, attn_mask=None):
    """Exact attention in float64 on the CPU, with autograd. Returns float64 (B, H, N, D)."""
    q, k, v = (t.detach().to("cpu", torch.float64).requires_grad_(True) for t in (q, k, v))
    mask = attn_mask.cpu() if attn_mask is not None else None
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.double()
    out = _naive(q, k, v, causal, sm_scale, torch.float64, mask)
    return out, (q, k, v)


def attention_same_dtype(q, k, v, causal=True, sm_scale=None, attn_mask=None):
    """A plain PyTorch attention in the inputs' dtype: scores, softmax (fp32 inside, rounded
    back) and the PV product each rounded to the dtype, as a user would write it."""
    return _naive(q, k, v, causal, sm_scale, q.dtype, attn_mask)


def _naive(q, k, v, causal, sm_scale, dtype, attn_mask=None):
    """With ``attn_mask`` as SDPA takes it (boolean: True = attend; float: added to the scaled scores);
    a row left no key gives 0 (as SDPA), with no gradient."""
    D = q.shape[-1]
    scale = 1.0 / math.sqrt(D) if sm_scale is None else sm_scale
    H = q.shape[1]
    s = torch.matmul(q, expand_kv(k, H).transpose(-1, -2)).to(dtype) * scale
    if attn_mask is not None:
        s = s.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else s + attn_mask.to(dtype)
    if causal:
        n = q.shape[2]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    empty = (s == float("-inf")).all(-1, keepdim=True)
    s = s.masked_fill(empty, 0.0)  # no NaN from a row of -inf: its softmax is zeroed below
    p = torch.softmax(s.float() if dtype != torch.float64 else s, dim=-1).to(dtype)
    return torch.matmul(p.masked_fill(empty, 0.0), expand_kv(v, H))


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.detach().double().cpu() - b.detach().double().cpu()).abs().max().item()


def assert_tolerance_rule(name, got, same_dtype, exact, factor=2.0, floor=1e-5):
    """|got - exact|_max <= factor * |same_dtype - exact|_max + floor, and no NaN."""
    got_err = max_err(got, exact)
    base_err = max_err(same_dtype, exact)
    assert math.isfinite(got_err), f"{name}: non-finite values"
    assert got_err <= factor * base_err + floor, (
        f"{name}: max error {got_err:.3e} > {factor} x same-dtype PyTorch error {base_err:.3e} + {floor:g}")
