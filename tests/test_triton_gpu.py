"""The compiled Triton kernels on a CUDA GPU: tolerance rule against float64, exact
statistics, determinism, memory. Skipped without CUDA (marker ``gpu``)."""

from __future__ import annotations

import pytest
import torch

from flashwatch.kernels import AttentionStats, attention_statistics, flash_attention, reference
from attention_oracles import max_err
from kernel_cases import (check_against_float64, check_statistics, planted_near_ties, planted_ties,
                          random_qkv)

pytestmark = pytest.mark.gpu

CASES = [  # (B, H, Hkv, N, D)
    (2, 4, 4, 1, 64),
    (2, 4, 4, 17, 64),
    (2, 4, 2, 97, 64),
    (1, 4, 4, 128, 128),
    (2, 4, 1, 1025, 64),
    (1, 2, 2, 1025, 128),
    (1, 2, 2, 300, 32),
    (1, 2, 2, 300, 16),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "B{}H{}Hkv{}N{}D{}".format(*c))
@pytest.mark.parametrize("causal", [True, False])
def test_plain_within_tolerance_rule(case, causal):
    B, H, Hkv, N, D = case
    check_against_float64(*random_qkv(B, H, N, D, Hkv=Hkv, device="cuda", seed=N + D), causal=causal,
                          variant="plain")


@pytest.mark.parametrize("variant", ["fixed", "fp32_delta"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("D", [64, 128])
def test_variants_within_tolerance_rule(variant, dtype, D):
    check_against_float64(*random_qkv(2, 4, 1025, D, Hkv=2, dtype=dtype, device="cuda", seed=D), causal=True,
                          variant=variant)


def test_float32_without_tf32():
    q, k, v = random_qkv(1, 2, 257, 64, dtype=torch.float32, device="cuda", seed=3)
    out = flash_attention(q, k, v)
    assert max_err(out, reference.flash_attention(*(t.detach().cpu().double() for t in (q, k, v)))) < 1e-5


@pytest.mark.parametrize("N", [70, 1000])
def test_statistics_on_planted_ties(N):
    q, k, v = planted_ties(B=2, H=3, N=N, D=64, device="cuda")
    stats, _ = check_statistics(q, k, v)
    assert stats.repeated_max_rows.min() >= 20


def test_statistics_near_ties_and_gqa():
    check_statistics(*planted_near_ties(device="cuda"))
    check_statistics(*random_qkv(2, 8, 513, 128, Hkv=2, device="cuda", seed=4), causal=False)


def test_statistics_pass_matches_reference():
    q, k, v = (t.detach() for t in random_qkv(2, 4, 777, 64, Hkv=2, device="cuda", seed=5))
    out = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                                           is_causal=True)
    g = torch.randn_like(out)
    got, want = AttentionStats(4, "cuda"), AttentionStats(4, "cpu")
    attention_statistics(q, k, v, out, g, got)
    reference.attention_statistics(q.cpu(), k.cpu(), v.cpu(), out.cpu(), g.cpu(), want)
    for name in ("rows", "repeated_max_rows", "repeated_max_rows_bf16", "repeated_max_rows_format"):
        assert getattr(got, name).tolist() == getattr(want, name).tolist(), name
    torch.testing.assert_close(got.max_logit.cpu(), want.max_logit, rtol=1e-6, atol=1e-6)
    assert ((got.delta_error.cpu() - want.delta_error).abs() <= 1e-3 * want.delta_error_abs + 1e-5).all()


def test_fixed_variant_huge_logits_finite():
    q, k, v = planted_ties(B=1, H=2, N=1000, D=64, device="cuda")
    stats = AttentionStats(2, "cuda")
    qs = (q.float() * 40).bfloat16().requires_grad_(True)
    out = flash_attention(qs, k, v, variant="fixed", stats=stats)
    out.backward(torch.ones_like(out))  # the forward's max logit reaches the statistics with the backward
    assert torch.isfinite(out).all() and torch.isfinite(qs.grad).all() and stats.max_logit.max() > 1000


def test_backward_is_deterministic():
    q, k, v = random_qkv(2, 8, 1025, 64, Hkv=2, device="cuda", seed=6)
    out = flash_attention(q, k, v)
    g = torch.randn_like(out)
    first = torch.autograd.grad(out, (q, k, v), g, retain_graph=True)
    for _ in range(10):
        again = torch.autograd.grad(out, (q, k, v), g, retain_graph=True)
        for a, b in zip(first, again):
            assert torch.equal(a, b)


def test_nan_stays_in_its_head():
    q, k, v = (t.detach() for t in random_qkv(1, 4, 300, 64, device="cuda", seed=7))
    q[0, 2, 5, 0] = float("nan")
    out = flash_attention(q, k, v)
    assert torch.isnan(out[0, 2, 5]).all()
    assert torch.isfinite(out[0, [0, 1, 3]]).all()


def test_no_quadratic_memory():
    """16k tokens: an N x N score tensor would be 1 GiB per head; stats add O(B*H*N)."""
    q, k, v = random_qkv(1, 2, 16384, 64, device="cuda", seed=8)
    stats = AttentionStats(2, "cuda")
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = flash_attention(q, k, v, stats=stats)
    out.backward(torch.ones_like(out))
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    io = q.numel() * q.element_size()
    assert extra < 12 * io, f"peak extra memory {extra / 2**20:.1f} MiB for {io / 2**20:.1f} MiB inputs"


def test_gradients_through_a_fused_qkv_projection():
    from kernel_cases import check_fused_projection_gradients

    check_fused_projection_gradients("cuda")


# --- per-row outputs (AttentionStats.rows_hook) ------------------------------------------------

@pytest.mark.parametrize("variant", ["plain", "fixed", "fp32_delta"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("D", [64, 128])
def test_rows_hook_matches_float64(variant, causal, D):
    from kernel_cases import check_rows_hook

    check_rows_hook(*random_qkv(2, 4, 1025, D, Hkv=2, device="cuda", seed=D), causal=causal, variant=variant)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_rows_hook_other_dtypes(dtype):
    from kernel_cases import check_rows_hook, check_rows_hook_observe

    check_rows_hook(*random_qkv(1, 4, 300, 64, Hkv=1, dtype=dtype, device="cuda", seed=9))
    check_rows_hook_observe(*random_qkv(1, 4, 300, 64, Hkv=1, dtype=dtype, device="cuda", seed=10))


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("D", [64, 128])
def test_rows_hook_in_the_statistics_pass_matches_float64(causal, D):
    from kernel_cases import check_rows_hook_observe

    check_rows_hook_observe(*random_qkv(2, 4, 1025, D, Hkv=2, device="cuda", seed=D + 1), causal=causal)


def test_rows_hook_changes_no_gradient_and_no_statistic():
    """At D=64 the dQ kernel with the per-row outputs runs the statistics kernel's tiles and the
    same arithmetic for dQ and delta: dK and dV (from the same delta) are bitwise those of the
    run without the hook, dQ within one BF16 rounding (another compilation may contract a
    multiply-add differently), the counts equal."""
    from kernel_cases import RowsRecorder

    q, k, v = random_qkv(2, 4, 777, 64, Hkv=2, device="cuda", seed=11)
    g = None
    results = []
    for hook in (None, RowsRecorder()):
        stats = AttentionStats(4, "cuda")
        stats.rows_hook = hook
        out = flash_attention(q, k, v, stats=stats)
        g = torch.randn_like(out) if g is None else g
        results.append((torch.autograd.grad(out, (q, k, v), g), stats))
    (grads_off, off), (grads_on, on) = results
    torch.testing.assert_close(grads_on[0], grads_off[0], rtol=2 ** -7, atol=1e-6)
    for a, b in zip(grads_off[1:], grads_on[1:]):
        assert torch.equal(a, b)
    for name in ("rows", "repeated_max_rows", "repeated_max_rows_bf16", "repeated_max_rows_format"):
        assert torch.equal(getattr(off, name), getattr(on, name)), name
    torch.testing.assert_close(off.delta_error_abs, on.delta_error_abs, rtol=1e-5, atol=1e-7)


def _on_cuda1_run(current: int, statistics_pass: bool):
    """One call's output, input gradients and statistics for inputs on cuda:1, with ``current`` the
    current device while it runs."""
    gen = torch.Generator(device="cpu").manual_seed(7)
    q, k, v, do = (torch.randn(2, 4, 300, 64, generator=gen).to("cuda:1", torch.bfloat16) for _ in range(4))
    stats = AttentionStats(4, "cuda:1")
    with torch.cuda.device(current):
        if statistics_pass:
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            attention_statistics(q, k, v, out, do, stats)
            grads = ()
        else:
            q, k, v = (t.requires_grad_() for t in (q, k, v))
            out = flash_attention(q, k, v, stats=stats)
            grads = torch.autograd.grad(out, (q, k, v), do)
    torch.cuda.synchronize(1)
    return [t.cpu() for t in (out, *grads)], {n: x for n, x in stats.as_dict().items()}


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
@pytest.mark.parametrize("statistics_pass", [False, True], ids=["own_kernel", "statistics_pass"])
def test_calls_run_on_their_inputs_device_whichever_is_current(statistics_pass):
    """A model on cuda:1 with cuda:0 current (no ``torch.cuda.set_device``): the kernels launch on
    cuda:1 and give what they give with cuda:1 current."""
    want_tensors, want_stats = _on_cuda1_run(1, statistics_pass)
    got_tensors, got_stats = _on_cuda1_run(0, statistics_pass)
    for got, want in zip(got_tensors, want_tensors):
        assert torch.equal(got, want)
    assert got_stats["rows"] == want_stats["rows"] and got_stats["rows"][0] > 0
    for name in ("repeated_max_rows", "max_logit"):
        assert got_stats[name] == want_stats[name]
    for name in ("delta_error", "delta_error_abs"):  # float atomics: the order of the adds may differ
        assert got_stats[name] == pytest.approx(want_stats[name], rel=1e-5, abs=1e-6)
