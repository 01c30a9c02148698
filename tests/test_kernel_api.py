"""Argument checking of the public kernel API: every bad input names what was wrong."""

from __future__ import annotations

import pytest
import torch

from flashwatch.kernels import AttentionStats, faults, flash_attention, reference


def _qkv(B=1, H=2, N=8, D=64, Hkv=None, dtype=torch.bfloat16):
    Hkv = Hkv or H
    return (torch.randn(B, H, N, D, dtype=dtype), torch.randn(B, Hkv, N, D, dtype=dtype),
            torch.randn(B, Hkv, N, D, dtype=dtype))


@pytest.mark.parametrize("kwargs, match", [
    (dict(variant="exact"), "variant must be one of"),
    (dict(beta=1.0), "beta must be a finite number > 1"),
    (dict(beta=float("nan")), "beta must be"),
    (dict(eps=-1e-3), "eps must be a finite number >= 0"),
    (dict(sm_scale=0.0), "sm_scale must be"),
    (dict(causal=1), "causal must be a bool"),
])
def test_bad_options(kwargs, match):
    q, k, v = _qkv()
    with pytest.raises((ValueError, TypeError), match=match):
        flash_attention(q, k, v, **kwargs)


def test_bad_shapes_and_dtypes():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="head dim D=48 is not supported"):
        flash_attention(*_qkv(D=48))
    with pytest.raises(ValueError, match="Hkv=3 must divide q heads H=4"):
        flash_attention(*_qkv(H=4, Hkv=3))
    with pytest.raises(TypeError, match="share one dtype"):
        flash_attention(q, k.float(), v)
    with pytest.raises(TypeError, match="accepted"):
        flash_attention(q.to(torch.int32), k, v)
    with pytest.raises(ValueError, match="4 dimensions"):
        flash_attention(q[0], k, v)
    with pytest.raises(ValueError, match="sequence lengths differ"):
        flash_attention(q, k[:, :, :4], v[:, :, :4])
    with pytest.raises(ValueError, match="k and v must have the same shape"):
        flash_attention(q, k, v[:, :1])
    with pytest.raises(ValueError, match="stats has num_heads=3"):
        flash_attention(q, k, v, stats=AttentionStats(3))
    with pytest.raises(TypeError, match="stats must be an AttentionStats"):
        flash_attention(q, k, v, stats={})


def test_non_contiguous_inputs_accepted():
    x = torch.randn(1, 8, 2, 3 * 64, dtype=torch.bfloat16)  # (B, N, H, 3D) layout, as a fused projection
    q, k, v = (t.transpose(1, 2) for t in x.split(64, dim=-1))
    assert not q.is_contiguous()
    out = flash_attention(q, k, v)
    torch.testing.assert_close(out, flash_attention(q.contiguous(), k.contiguous(), v.contiguous()))


def test_nan_stays_in_its_head():
    q, k, v = _qkv(H=2, N=16)
    q[0, 0, 3, 5] = float("nan")
    out = flash_attention(q, k, v)
    assert torch.isnan(out[0, 0]).any()
    assert torch.isfinite(out[0, 1]).all()


def test_the_injected_fault_is_not_an_argument():
    """The INJECTED rounding bias lives in ``faults``, off the public signature."""
    q, k, v = _qkv()
    for fn in (flash_attention, reference.flash_attention):
        with pytest.raises(TypeError, match="inject_bias"):
            fn(q, k, v, inject_bias=1.0)


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf"), "2", True, None])
def test_fault_strength_is_checked(bad):
    with pytest.raises(ValueError, match="rounding-bias strength must be a finite number >= 0"):
        faults.set_rounding_bias(bad)
    with pytest.raises(ValueError, match="rounding-bias strength"):
        with faults.rounding_bias(bad):
            pass
    assert faults.rounding_bias_strength() == 0.0


def test_fault_context_restores_the_previous_strength():
    faults.set_rounding_bias(2.0)
    try:
        with faults.rounding_bias(5.0):
            assert faults.rounding_bias_strength() == 5.0
        assert faults.rounding_bias_strength() == 2.0
        with pytest.raises(RuntimeError):
            with faults.rounding_bias(7.0):
                raise RuntimeError("inside")
        assert faults.rounding_bias_strength() == 2.0
    finally:
        faults.set_rounding_bias(0.0)


# --- AttentionStats.rows_hook (CPU reference path) ---------------------------------------------

def test_rows_hook_is_checked_on_assignment():
    stats = AttentionStats(2)
    assert stats.rows_hook is None
    with pytest.raises(TypeError, match="rows_hook must be a callable hook\\(delta_error_rows, pk\\) or None, got int"):
        stats.rows_hook = 3
    stats.rows_hook = print
    stats.rows_hook = None
    assert stats.rows_hook is None


def test_rows_hook_called_once_per_call_and_only_with_stats():
    calls = []
    q, k, v = (t.requires_grad_(True) for t in _qkv(B=2, H=4, N=9, D=16, Hkv=2))
    stats = AttentionStats(4)
    stats.rows_hook = lambda err, pk: calls.append((err.shape, pk.shape, err.dtype, pk.dtype))
    out = flash_attention(q, k, v, stats=stats)
    assert calls == [], "called by the backward, not the forward"
    out.backward(torch.ones_like(out))
    assert calls == [((2, 4, 9), (2, 4, 9, 16), torch.float32, torch.float32)]
    flash_attention(q, k, v).backward(torch.ones_like(out))  # no stats: no hook
    with torch.no_grad():
        flash_attention(q, k, v, stats=stats)  # no backward: no hook
    stats.rows_hook = None
    flash_attention(q, k, v, stats=stats).backward(torch.ones_like(out))
    assert len(calls) == 1


def test_rows_hook_error_propagates_from_attention_statistics():
    from flashwatch.kernels import attention_statistics

    q, k, v = _qkv(H=2, N=8, D=16)
    stats = AttentionStats(2)

    def broken(delta_error_rows, pk):
        raise RuntimeError("hook failed")

    stats.rows_hook = broken
    with pytest.raises(RuntimeError, match="hook failed"):
        attention_statistics(q, k, v, q, q, stats)
