"""The paper's all-BF16 tiled numerics (kernels/paper.py): exact in float64, biased in BF16."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from flashwatch.kernels import flash_attention
from flashwatch.kernels.paper import paper_attention
from research.lab import InputSpec, bias_stats, exact_attention, make_inputs

# tile 512 (one tile here), small tiles (running max and sum across tiles), unequal query/key
# tiles (rows of a tile fully masked), odd N (ragged last tiles)
TILES = [512, 16, (8, 24)]


def _qkv(B, H, N, D, Hkv=None, dtype=torch.float64, scale=1.0):
    Hkv = Hkv or H
    q = torch.randn(B, H, N, D, dtype=dtype) * scale
    k = torch.randn(B, Hkv, N, D, dtype=dtype) * scale
    v = torch.randn(B, Hkv, N, D, dtype=dtype)
    return q, k, v


@pytest.mark.parametrize("tile", TILES)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("fixed", [False, True])
def test_float64_matches_sdpa(tile, causal, fixed):
    torch.manual_seed(0)
    q, k, v = (t.requires_grad_(True) for t in _qkv(2, 4, 53, 32, Hkv=2))
    out = paper_attention(q, k, v, causal=causal, fixed=fixed, tile=tile)
    kr, vr = (t.repeat_interleave(2, dim=1) for t in (k, v))
    ref = F.scaled_dot_product_attention(q, kr, vr, is_causal=causal)
    # fixed + causal + several key tiles: the public code's rule sees a fully masked tile as a
    # tie, shifts its max to 0 and adds the clamped row sum 1e-10 of that tile: a relative error
    # of 1e-10 per masked tile over the row sum (~1e-8 on early rows, whose row sum is small),
    # lost below BF16's resolution. Everything else is exact.
    tol = 1e-6 if fixed and causal and tile != 512 else 1e-12
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), g)
    ref_grads = torch.autograd.grad(ref, (q, k, v), g)
    for name, a, b in zip("qkv", grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=max(tol, 1e-10), atol=max(tol, 1e-10), msg=f"d{name}")


def test_bf16_ties_are_biased_negative_as_in_numerics_section_3():
    """Duplicated keys, V ~ N(-2, 0.5^2), query scale 1: the all-BF16 kernel rounds tie rows
    away from zero (z around -10 here, -18 on the H200 at 4x the rows), the FA2-style reference
    does not (its z is small and positive, as SDPA's on the H200)."""
    spec = InputSpec("dup_q1", duplicate_keys=True, query_scale=1.0)
    q, k, v, _ = make_inputs(spec, (4, 8, 512, 64), seed=0)
    exact, tie = exact_attention(q, k, v)
    assert tie.float().mean() > 0.98
    for tile in (512, 128):
        z = bias_stats(paper_attention(q, k, v, tile=tile).double() - exact, tie)
        assert z["z_feat"] < -4 and z["z_pooled"] < -4, (tile, z)
        z_fixed = bias_stats(paper_attention(q, k, v, tile=tile, fixed=True).double() - exact, tie)
        assert z_fixed["z_feat"] < -4, (tile, z_fixed)  # the per-tile fix does not remove it here
    z_fa2 = bias_stats(flash_attention(q, k, v).double() - exact, tie)
    assert z_fa2["z_feat"] > -2, z_fa2


def test_bf16_gradients_flow_and_approximate_float64():
    torch.manual_seed(1)
    q, k, v = (t.to(torch.bfloat16).requires_grad_(True) for t in _qkv(2, 4, 97, 64, Hkv=2, dtype=torch.float32))
    for fixed in (False, True):
        out = paper_attention(q, k, v, fixed=fixed, tile=32)
        g = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), g)
        q64, k64, v64 = (t.detach().double().requires_grad_(True) for t in (q, k, v))
        ref = F.scaled_dot_product_attention(q64, k64.repeat_interleave(2, 1), v64.repeat_interleave(2, 1), is_causal=True)
        ref_grads = torch.autograd.grad(ref, (q64, k64, v64), g.double())
        assert out.dtype == torch.bfloat16 and (out.double() - ref).abs().max() < 0.05
        for name, a, b in zip("qkv", grads, ref_grads):
            assert a.dtype == torch.bfloat16 and a.shape == b.shape and torch.isfinite(a).all(), name
            rel = (a.double() - b).norm() / b.norm()
            assert rel < 0.05, f"d{name}: relative error {rel:.3f}"  # BF16 everywhere, lse in BF16


def test_fixed_rule_is_unguarded_rows_vanish_at_large_logits():
    """The paper's rule as published: a tied max of ~100 is shifted to ~200, exp(-100)
    underflows, the 1e-10 clamp hides the zero row sum and the row comes out as zeros.
    flashwatch's own ``fixed`` variant guards against this."""
    torch.manual_seed(2)
    q = (1.0 + 0.1 * torch.randn(1, 1, 8, 16)).to(torch.bfloat16)
    k = q * 40  # every score ~ 40 |q|^2 / sqrt(16) ~ 160
    k[:, :, 1::2] = k[:, :, 0::2]  # rows 1, 3, 5, 7 see only duplicated keys: their max is a tie
    out = paper_attention(q, k, torch.ones_like(q), causal=True, fixed=True)
    plain = paper_attention(q, k, torch.ones_like(q), causal=True)
    assert (plain == 1).all()
    assert (out[0, 0, 1::2] == 0).all(), "expected tied rows zeroed by the unguarded rule"
    assert (out[0, 0, 0] == 1).all()  # row 0 has a single key: no tie, no shift


def test_autocast_does_not_change_the_numerics():
    torch.manual_seed(3)
    q, k, v = (t.to(torch.bfloat16) for t in _qkv(1, 2, 40, 32, dtype=torch.float32))
    plain = paper_attention(q, k, v, tile=16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        auto = paper_attention(q, k, v, tile=16)
    assert torch.equal(plain, auto)


def test_non_contiguous_inputs():
    torch.manual_seed(4)
    q, k, v = (t.to(torch.bfloat16) for t in _qkv(2, 3, 33, 32, dtype=torch.float32))
    qt, kt, vt = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    assert not qt.is_contiguous()
    assert torch.equal(paper_attention(qt, kt, vt, tile=8), paper_attention(q, k, v, tile=8))


@pytest.mark.parametrize("kwargs, match", [
    ({"tile": 0}, "tile must be"),
    ({"tile": (8,)}, "tile must be"),
    ({"sm_scale": -1.0}, "sm_scale must be"),
    ({"causal": 1}, "causal must be a bool"),
    ({"fixed": "yes"}, "fixed must be a bool"),
])
def test_bad_arguments(kwargs, match):
    q = torch.zeros(1, 1, 4, 16, dtype=torch.bfloat16)
    with pytest.raises((ValueError, TypeError), match=match):
        paper_attention(q, q, q, **kwargs)
