"""The PyTorch reference: the oracle of every kernel test, and the CPU path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from flashwatch.kernels import AttentionStats, faults, reference
from attention_oracles import assert_tolerance_rule, attention64, attention_same_dtype
from kernel_cases import delta_error_at_scale, worst_relative_error

SHAPES = [(2, 4, 1, 64), (2, 4, 17, 64), (1, 2, 97, 128), (2, 2, 128, 64)]


def _inputs(B, H, N, D, Hkv=None, dtype=torch.float64, scale=1.0):
    Hkv = Hkv or H
    q = torch.randn(B, H, N, D, dtype=dtype) * scale
    k = torch.randn(B, Hkv, N, D, dtype=dtype) * scale
    v = torch.randn(B, Hkv, N, D, dtype=dtype)
    return q, k, v


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("variant", ["plain", "fixed", "fp32_delta"])
def test_float64_matches_sdpa(shape, causal, variant):
    torch.manual_seed(1)
    q, k, v = (t.requires_grad_(True) for t in _inputs(*shape))
    out = reference.flash_attention(q, k, v, causal=causal, variant=variant)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), g)
    ref_grads = torch.autograd.grad(ref, (q, k, v), g)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


def test_gqa_matches_sdpa_with_repeated_kv():
    torch.manual_seed(2)
    q, k, v = (t.requires_grad_(True) for t in _inputs(2, 8, 33, 32, Hkv=2))
    out = reference.flash_attention(q, k, v)
    kr, vr = (t.repeat_interleave(4, dim=1) for t in (k, v))
    ref = F.scaled_dot_product_attention(q, kr, vr, is_causal=True)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    g = torch.randn_like(out)
    torch.testing.assert_close(torch.autograd.grad(out, k, g)[0], torch.autograd.grad(ref, k, g)[0])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("variant", ["plain", "fixed", "fp32_delta"])
def test_low_precision_within_tolerance_rule(dtype, variant):
    torch.manual_seed(3)
    q, k, v = (t.to(dtype).requires_grad_(True) for t in _inputs(2, 3, 97, 64, dtype=torch.float32))
    out = reference.flash_attention(q, k, v, variant=variant)
    exact, leaves = attention64(q, k, v)
    same = attention_same_dtype(q, k, v)
    assert_tolerance_rule(f"out {dtype} {variant}", out, same, exact)
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), g)
    base = torch.autograd.grad(same, (q, k, v), g)
    ex = torch.autograd.grad(exact, leaves, g.double())
    for name, a, b, c in zip("qkv", got, base, ex):
        assert_tolerance_rule(f"d{name} {dtype} {variant}", a, b, c)


def test_fixed_variant_survives_huge_logits():
    """The paper's rule unguarded underflows the row sum (NaN) at large logits."""
    torch.manual_seed(4)
    B, H, N, D = 1, 2, 64, 64
    q = torch.randn(B, H, N, D) * 30
    k = q.clone()
    k[:, :, 1::2] = k[:, :, 0::2]  # exact ties at the row max
    q, k, v = (t.bfloat16() for t in (q, k, torch.randn(B, H, N, D)))
    stats = AttentionStats(H, "cpu")
    q.requires_grad_(True)
    out = reference.flash_attention(q, k, v, variant="fixed", stats=stats)
    out.backward(torch.ones_like(out))  # rows and repeated-max counts are added by the backward
    assert torch.isfinite(q.grad).all()
    q = q.detach()
    assert stats.max_logit.max() > 1000, "test inputs should reach logits in the thousands"
    assert stats.repeated_max_rows.sum() > 0
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), reference.flash_attention(q.double(), k.double(), v.double()).float(),
                               atol=2e-2, rtol=2e-2)


def _brute_force_ties(s, eps):
    m = s.amax(-1, keepdim=True)
    tied = (s >= m - eps).sum(-1) >= 2
    sb = s.to(torch.bfloat16).float()
    mb = sb.amax(-1, keepdim=True)
    tied_b = (sb >= mb - eps).sum(-1) >= 2
    return tied, tied_b, m.squeeze(-1)


def test_statistics_count_planted_ties_exactly():
    torch.manual_seed(5)
    B, H, N, D = 2, 3, 50, 64
    eps = 1e-3
    q, k, v = (t.float() for t in _inputs(B, H, N, D, dtype=torch.float32))
    k[:, :, 7] = k[:, :, 3]  # an exact duplicate key
    stats = AttentionStats(H, "cpu")
    q.requires_grad_(True)
    out = reference.flash_attention(q, k, v, stats=stats, eps=eps)
    assert stats.rows.sum() == 0 and not torch.isfinite(stats.max_logit).any(), "the forward adds nothing"
    out.backward(torch.ones_like(out))
    q = q.detach()
    s = reference.scores(q, k, True, 1 / 8)
    tied, tied_b, m = _brute_force_ties(s, eps)
    assert stats.rows.tolist() == [B * N] * H
    assert stats.repeated_max_rows.tolist() == tied.sum(dim=(0, 2)).tolist()
    assert stats.repeated_max_rows_bf16.tolist() == tied_b.sum(dim=(0, 2)).tolist()
    assert torch.equal(stats.max_logit, m.amax(dim=(0, 2)))
    assert out.shape == q.shape


def test_delta_error_matches_float64_definition():
    """e = sum_rows (rowsum(dO * O_used) - rowsum(dO * softmax(s) V)), checked in float64."""
    torch.manual_seed(6)
    B, H, N, D = 2, 2, 40, 32
    for variant in ("plain", "fp32_delta"):
        q, k, v = (t.bfloat16().requires_grad_(True) for t in _inputs(B, H, N, D, dtype=torch.float32))
        stats = AttentionStats(H, "cpu")
        out = reference.flash_attention(q, k, v, variant=variant, stats=stats)
        g = torch.randn_like(out)
        out.backward(g)
        exact, _ = attention64(q, k, v)
        delta_hp = (g.double() * exact.detach()).sum(-1)
        if variant == "plain":
            delta_used = (g.double() * out.detach().double()).sum(-1)
            err = delta_used - delta_hp
            torch.testing.assert_close(stats.delta_error.double(), err.sum(dim=(0, 2)), rtol=1e-3, atol=1e-4)
            torch.testing.assert_close(stats.delta_error_abs.double(), err.abs().sum(dim=(0, 2)), rtol=1e-3, atol=1e-4)
            torch.testing.assert_close(stats.delta_error_sq.double(), (err ** 2).sum(dim=(0, 2)), rtol=1e-3, atol=1e-7)
            plain_abs = stats.delta_error_abs.clone()
        else:
            # fp32_delta takes delta from the FP32 output: what remains is the P_bar rounding
            assert (stats.delta_error_abs < plain_abs).all()


def test_statistics_pass_equals_own_kernel_statistics():
    """Observe mode's statistics pass, fed the reference's own output, adds what the reference's
    forward and backward add: the counts and max logit exactly; the delta-error sums, rounding
    residues, to 1e-3 (the backward takes P through lse over its row sum, the pass as exp(s - m)
    over its row sum: FP32 roundings of delta_hp that differ)."""
    own, seen, _, _ = delta_error_at_scale(1.0, reference.flash_attention, reference.attention_statistics)
    for name in ("rows", "repeated_max_rows", "repeated_max_rows_bf16", "repeated_max_rows_format", "max_logit"):
        assert torch.equal(getattr(own, name), getattr(seen, name)), name
    for name in ("delta_error", "delta_error_abs", "delta_error_sq", "delta_error_tied"):
        torch.testing.assert_close(getattr(own, name), getattr(seen, name), rtol=1e-3, atol=1e-6)


@pytest.mark.parametrize("seed", [7, 8, 9, 10])
def test_both_statistics_keep_the_delta_error_at_large_logits(seed):
    """At max logits of ~1,050-1,200 the delta error, itself a rounding residue, stays within 0.5% of
    float64's (relative to its sum of |row errors|) in both places: the own backward divides
    rowsum(P dP) by rowsum(P), which takes out lse's FP32 rounding (|lse| 2^-24 of every P, common
    to the row; 0.5-7.6% off without it at these seeds), observe mode's pass takes P as exp(s - m)
    over its row sum."""
    own, seen, truth, max_logit = delta_error_at_scale(300.0, reference.flash_attention, reference.attention_statistics,
                                                       seed=seed)
    assert max_logit > 1000
    assert worst_relative_error(own, truth) < 0.005, worst_relative_error(own, truth)
    assert worst_relative_error(seen, truth) < 0.005, worst_relative_error(seen, truth)


def test_autocast_does_not_change_the_reference():
    """An enclosing BF16 autocast region must not turn the reference's FP32 products into BF16."""
    torch.manual_seed(8)
    q, k, v = (t.bfloat16().requires_grad_(True) for t in _inputs(1, 2, 33, 64, dtype=torch.float32))
    out = reference.flash_attention(q, k, v)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out_ac = reference.flash_attention(q, k, v)
        grads_ac = torch.autograd.grad(out_ac, (q, k, v), g)
    assert torch.equal(out, out_ac)
    for a, b in zip(grads, grads_ac):
        assert torch.equal(a, b)


def test_fp32_delta_takes_delta_from_the_output_before_the_injected_fault():
    """The injected rounding bias reaches the forward output of every non-fixed variant, but
    fp32_delta's backward takes delta from the FP32 output before it."""
    torch.manual_seed(9)
    B, H, N, D = 1, 2, 48, 64
    q = torch.randn(B, H, N, D)
    k = q.clone()
    k[:, :, 1::2] = k[:, :, 0::2]  # many rows whose max repeats: P_bar is 1 at two keys
    q, k, v = (t.bfloat16().requires_grad_(True) for t in (q * 3, k, torch.randn(B, H, N, D)))
    g = torch.randn(B, H, N, D).bfloat16()
    grads = {}
    for variant, strength in (("fp32_delta", 0.0), ("fp32_delta", 4.0), ("plain", 4.0)):
        with faults.rounding_bias(strength):  # INJECTED
            out = reference.flash_attention(q, k, v, variant=variant)
        grads[(variant, strength)] = torch.autograd.grad(out, q, g)[0].float()
    clean = grads[("fp32_delta", 0.0)]
    # dq depends on the output only through delta: fp32_delta's stays clean up to the BF16
    # rounding of its residual R = O_fp32 - O (which now carries the injected push)
    off_fp32_delta = (grads[("fp32_delta", 4.0)] - clean).norm()
    off_plain = (grads[("plain", 4.0)] - clean).norm()
    assert off_plain > 0
    assert off_fp32_delta <= 0.05 * off_plain, (off_fp32_delta, off_plain)


# --- per-row outputs (AttentionStats.rows_hook) on the CPU reference path ---------------------

@pytest.mark.parametrize("variant", ["plain", "fixed", "fp32_delta"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("D, Hkv", [(16, 1), (64, 2)])
def test_rows_hook_matches_float64(variant, causal, D, Hkv):
    from kernel_cases import check_rows_hook, random_qkv

    check_rows_hook(*random_qkv(2, 4, 37, D, Hkv=Hkv, seed=D + Hkv), causal=causal, variant=variant)


@pytest.mark.parametrize("causal", [True, False])
def test_rows_hook_in_the_statistics_pass_matches_float64(causal):
    from kernel_cases import check_rows_hook_observe, random_qkv

    check_rows_hook_observe(*random_qkv(2, 4, 37, 32, Hkv=2, seed=13), causal=causal)


def test_rows_hook_on_float64_inputs_gives_float32():
    """The oracle path computes in float64 and hands float32 tensors to the hook."""
    from kernel_cases import RowsRecorder, rows_oracle

    torch.manual_seed(14)
    q, k, v = (t.requires_grad_(True) for t in _inputs(1, 2, 19, 16, Hkv=1))
    stats = AttentionStats(2, "cpu")
    stats.rows_hook = hook = RowsRecorder()
    out = reference.flash_attention(q, k, v, stats=stats)
    g = torch.randn_like(out)
    out.backward(g)
    (err, pk), = hook.calls
    want_err, want_pk, _, _ = rows_oracle(q, k, v, out, g, True)
    assert err.dtype == pk.dtype == torch.float32
    torch.testing.assert_close(err.double(), want_err, rtol=0, atol=1e-6)  # float64 error, float32 rounding
    torch.testing.assert_close(pk.double(), want_pk, rtol=1e-6, atol=1e-6)


def test_a_forward_without_backward_adds_no_max_logit():
    """The forward's max logit reaches the statistics with the call's backward, as its rows do: an
    evaluation with gradients on (or a forward that raised) adds nothing to a monitored step."""
    q, k, v = (t.float().requires_grad_(True) for t in _inputs(1, 2, 9, 16))
    stats = AttentionStats(2)
    before = stats.max_logit.clone()
    reference.flash_attention(q * 50, k, v, stats=stats)  # large logits, never differentiated
    assert torch.equal(stats.max_logit, before) and stats.rows.sum() == 0
    out = reference.flash_attention(q, k, v, stats=stats)
    assert torch.equal(stats.max_logit, before)
    out.sum().backward()
    want = (q.detach() @ k.detach().transpose(-1, -2) / 4).tril().masked_fill(
        ~torch.ones(9, 9, dtype=torch.bool).tril(), float("-inf")).amax(dim=(0, 2, 3))
    torch.testing.assert_close(stats.max_logit, want, rtol=1e-6, atol=1e-6)


def _tied_row_with_a_long_tail(n: int, gap: float, dtype: torch.dtype):
    """One head, n keys: scores 10 at keys 0 and 1 (a repeated maximum) and 10 - gap elsewhere."""
    g = torch.Generator().manual_seed(0)
    q = torch.zeros(1, 1, n, 16)
    q[..., 0] = 4.0
    k = torch.zeros(1, 1, n, 16)
    k[..., 1:] = torch.randn(1, 1, n, 15, generator=g)
    k[..., 0] = 10.0 - gap
    k[:, :, :2, 0] = 10.0
    v = torch.randn(1, 1, n, 16, generator=g) + 1.0
    return tuple(t.to(dtype) for t in (q, k, v))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fixed_keeps_a_tied_rows_tail_as_plain_does(dtype):
    """The fixed variant shifts a repeated-max row by m + offset; in FP16 each nat of offset pushed
    a nat of the row's keys below the max out of FP16's range for the P_bar V product while the FP32
    row sum kept them: with 998 keys 10 below a tied max, an offset of 8 cost 1.1% of the output
    against plain's 0.02%. Its FP16 offset is now capped at 1: within 1.5x plain's error (float64
    reference)."""
    q, k, v = _tied_row_with_a_long_tail(1000, 10.0, dtype)
    exact = torch.softmax(q.double() @ k.double().transpose(-1, -2) / 4, -1) @ v.double()

    def err(variant):
        out = reference.flash_attention(q, k, v, causal=False, variant=variant)
        return float((out.double() - exact).abs().max() / exact.abs().max())

    assert err("fixed") <= 1.5 * err("plain") + 1e-6, (err("fixed"), err("plain"))
