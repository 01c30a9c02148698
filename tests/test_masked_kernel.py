"""flashwatch's kernel with an attn_mask (``flash_attention(..., attn_mask=...)``): the masks models pass
(key padding, Hugging Face's 4-D masks, additive float masks, a row left no key), every variant, against
float64; on the CPU by Triton's interpreter, on CUDA compiled (marked gpu)."""

from __future__ import annotations

import pytest
import torch

from flashwatch.kernels import AttentionStats, flash_attention, masked, reference
from kernel_cases import check_against_float64, output_gradient, random_qkv


def _devices():
    return [pytest.param("cpu"), pytest.param("cuda", marks=pytest.mark.gpu)]


def key_padding(B, N, lengths, device="cpu"):
    """(B, 1, 1, N) boolean: entry b attends to its first lengths[b] keys (right padding)."""
    m = torch.zeros(B, 1, 1, N, dtype=torch.bool, device=device)
    for b, n in enumerate(lengths):
        m[b, ..., :n] = True
    return m


def hf_causal_left_padded(B, N, pads, device="cpu"):
    """(B, 1, N, N) boolean as Hugging Face builds it: causal, and the first pads[b] keys of entry b masked."""
    m = torch.ones(N, N, dtype=torch.bool, device=device).tril()[None, None].repeat(B, 1, 1, 1)
    for b, p in enumerate(pads):
        m[b, ..., :p] = False
    return m


def _masks(B, H, N, device):
    g = torch.Generator().manual_seed(5)
    additive = (torch.randn(B, H, N, N, generator=g) * 0.5).to(device)
    additive[..., 3] = float("-inf")  # a key masked in every row, beside a real bias
    hf = hf_causal_left_padded(B, N, [0, 5], device)
    empty_row = torch.ones(N, N, dtype=torch.bool, device=device)
    empty_row[7] = False  # row 7 attends to no key
    finfo_min = torch.zeros(B, 1, N, N, dtype=torch.bfloat16, device=device).masked_fill(
        ~hf, torch.finfo(torch.bfloat16).min)  # older Hugging Face: the dtype's lowest value, not -inf
    return {
        "key_padding": key_padding(B, N, [N - 9, N], device),
        "hf_4d": hf,
        "additive": additive,
        "finfo_min": finfo_min,
        "empty_row": empty_row,
    }


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("kind", ["key_padding", "hf_4d", "additive", "finfo_min", "empty_row"])
@pytest.mark.parametrize("causal", [False, True])
def test_masked_call_within_tolerance_rule(interpreted_on_cpu, device, kind, causal):
    """Output and dq, dk, dv within twice the same-dtype PyTorch error against float64 (N 40 crosses
    tiles and has a ragged tail; GQA). Where finfo.min masks a row everywhere (left padding of Hugging
    Face's older masks), the row averages its values as SDPA's; no loss reads it (output gradient 0):
    the kernel gives its scores no gradient, SDPA one through scores its mask's magnitude absorbed."""
    B, H, Hkv, N, D = 2, 4, 2, 40, 32
    q, k, v = random_qkv(B, H, N, D, Hkv=Hkv, device=device, seed=11)
    mask = _masks(B, H, N, device)[kind]
    unread = None
    if kind == "finfo_min":
        unread = torch.zeros(B, 1, N, dtype=torch.bool, device=device)
        unread[1, :, :5] = True  # causal with 5 keys of left padding: rows 0-4 see only padding
    check_against_float64(q, k, v, causal=causal, variant="plain", attn_mask=mask, unread_rows=unread)


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("variant", ["fixed", "fp32_delta"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_masked_variants_and_dtypes_within_tolerance_rule(interpreted_on_cpu, device, variant, dtype):
    B, H, N, D = 2, 2, 33, 16
    q, k, v = random_qkv(B, H, N, D, dtype=dtype, device=device, seed=12)
    check_against_float64(q, k, v, causal=False, variant=variant, attn_mask=hf_causal_left_padded(B, N, [3, 0], device))


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("variant", ["plain", "fixed", "fp32_delta"])
def test_a_mask_of_the_causal_pattern_is_the_causal_call_bit_for_bit(interpreted_on_cpu, device, variant):
    """The keys a mask hides add exactly 0 (P = 0, no rescaling), so a mask that is the causal pattern
    gives the causal call's output and gradients to the bit: the mask is read where it should be and
    nowhere else, in the forward and in both backward kernels. One exception: on CUDA, fp32_delta's
    gradients under the two compilations (with and without the mask) were seen to differ in their
    last bits (2026-12-06, H100; not diagnosed): there its output is held to the bit and its
    gradients to a BF16 rounding of values near 1 (dS = P (dP - delta) cancels, so a last-bit change of
    delta moves a few entries by more than their own rounding: 10 of 17,920, at most 2^-8)."""
    B, H, N, D = 2, 2, 70, 64
    q, k, v = random_qkv(B, H, N, D, device=device, seed=13)
    g = output_gradient(q)
    pattern = torch.ones(N, N, dtype=torch.bool, device=device).tril()
    results = []
    for kwargs in (dict(causal=True), dict(causal=False, attn_mask=pattern),
                   dict(causal=True, attn_mask=pattern)):
        out = flash_attention(q, k, v, variant=variant, **kwargs)
        results.append((out, *torch.autograd.grad(out, (q, k, v), g)))
    for got in results[1:]:
        assert torch.equal(results[0][0], got[0])
        for a, b in zip(results[0][1:], got[1:]):
            if device == "cuda" and variant == "fp32_delta":
                torch.testing.assert_close(a, b, rtol=2 ** -7, atol=2 ** -7)
            else:
                assert torch.equal(a, b)


@pytest.mark.parametrize("device", _devices())
def test_a_row_left_no_key_gives_zero_and_no_gradient(interpreted_on_cpu, device):
    """As torch SDPA gives it (not 0 / 0): output 0 on the row, its q gets no gradient, no NaN anywhere."""
    B, H, N, D = 1, 2, 40, 16
    q, k, v = random_qkv(B, H, N, D, device=device, seed=14)
    mask = torch.ones(B, 1, N, N, dtype=torch.bool, device=device)
    mask[..., 7, :] = False
    mask[..., 33, :] = False  # in the ragged last tile
    out = flash_attention(q, k, v, causal=True, attn_mask=mask)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), output_gradient(out))
    assert torch.isfinite(out).all() and all(torch.isfinite(t).all() for t in (dq, dk, dv))
    assert (out[:, :, [7, 33]] == 0).all() and (dq[:, :, [7, 33]] == 0).all()
    assert (out[:, :, 8] != 0).any() and (dq[:, :, 8] != 0).any()


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("variant", ["plain", "fp32_delta"])
def test_statistics_of_a_masked_call_are_the_masked_pass_on_its_delta(interpreted_on_cpu, device, variant):
    """With stats, a masked call is measured in its backward by the dense pass (padding rows left out),
    on the output whose delta the backward used: O, or O + R under fp32_delta, whose delta error is then
    only P_bar's rounding."""
    B, H, N, D = 2, 2, 48, 32
    q, k, v = random_qkv(B, H, N, D, device=device, seed=15)
    mask = hf_causal_left_padded(B, N, [0, 6], device)
    stats = AttentionStats(H, device)
    out = flash_attention(q, k, v, causal=False, attn_mask=mask, variant=variant, stats=stats)
    g = output_gradient(out)
    g[1, :, :6] = 0  # padding rows: no loss reads them
    out.backward(g)
    on_output = AttentionStats(H, device)  # the pass on the BF16 output itself
    masked.measure_call(q.detach(), k.detach(), v.detach(), out.detach(), None, g, on_output, mask, False,
                        D ** -0.5, 1e-3)
    assert torch.equal(stats.rows, on_output.rows) and int(stats.rows.sum()) == H * (2 * N - 6)
    for name in ("repeated_max_rows", "repeated_max_rows_bf16", "repeated_max_rows_format"):
        assert torch.equal(getattr(stats, name), getattr(on_output, name)), name
    torch.testing.assert_close(stats.max_logit, on_output.max_logit)
    assert torch.isfinite(stats.max_logit).all()
    if variant == "plain":
        torch.testing.assert_close(stats.delta_error_abs, on_output.delta_error_abs, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(stats.delta_error, on_output.delta_error, rtol=1e-5, atol=1e-7)
    else:  # as test_fp32_delta_residual_reaches_the_backward without a mask
        assert stats.delta_error_abs.sum() < 0.8 * on_output.delta_error_abs.sum()


def test_the_reference_path_takes_the_mask_as_torch_sdpa():
    """The CPU reference (no interpreter) with a mask, in float64, is torch's SDPA."""
    B, H, N, D = 2, 2, 20, 16
    q, k, v = (t.detach().double().requires_grad_(True) for t in random_qkv(B, H, N, D, seed=16))
    for mask in (key_padding(B, N, [12, 20]), hf_causal_left_padded(B, N, [0, 4])):
        out = reference.flash_attention(q, k, v, causal=False, attn_mask=mask)
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
        g = torch.randn_like(out)
        torch.testing.assert_close(torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(want, (q, k, v), g),
                                   rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("mask, error, words", [
    (torch.ones(2, 1, 1, 16, dtype=torch.int64), TypeError, "torch.bool"),
    (torch.ones(3, 1, 16, 16, dtype=torch.bool), ValueError, "does not broadcast"),
    (torch.ones(1, 1, 1, 2, 16, 16, dtype=torch.bool), ValueError, "does not broadcast"),
    ([[True]], TypeError, "torch.Tensor"),
])
def test_a_bad_mask_is_refused_with_what_is_accepted(mask, error, words):
    q, k, v = random_qkv(2, 2, 16, 16, seed=17)
    with pytest.raises(error, match=words):
        flash_attention(q, k, v, causal=False, attn_mask=mask)


def test_a_learned_bias_is_refused_and_own_kernel_mode_leaves_it_to_sdpa():
    """A float mask that requires a gradient (a learned position bias) would lose it in the kernel,
    which computes none for the mask: flash_attention refuses it, and own-kernel mode runs such calls
    in torch SDPA, whose gradient reaches the bias."""
    import torch.nn.functional as F
    from torch import nn

    from flashwatch import Monitor, MonitorConfig

    q, k, v = random_qkv(2, 2, 16, 16, seed=21)
    bias = torch.zeros(1, 2, 16, 16, requires_grad=True)
    with pytest.raises(ValueError, match="requires a gradient"):
        flash_attention(q, k, v, causal=False, attn_mask=bias)
    with torch.no_grad():  # no gradient to lose
        flash_attention(q, k, v, causal=False, attn_mask=bias)

    class BiasedAttention(nn.Module):
        def __init__(self):
            super().__init__()
            self.c_attn = nn.Linear(32, 96, bias=False)
            self.n_head = 2
            self.bias = nn.Parameter(torch.randn(1, 2, 8, 8))

        def forward(self, x):
            q, k, v = (z.view(3, 8, 2, 16).transpose(1, 2) for z in self.c_attn(x).split(32, dim=2))
            return F.scaled_dot_product_attention(q, k, v, attn_mask=self.bias)

    mod = BiasedAttention()
    monitor = Monitor(MonitorConfig(interval=1, mode="own_kernel", async_transfer=False))
    monitor.attach(mod)
    mod(torch.randn(3, 8, 32)).square().sum().backward()
    assert mod.bias.grad is not None and mod.bias.grad.abs().sum() > 0
    assert monitor.layers[0].running_variant == "sdpa" and "requires a gradient" in monitor.layers[0].sdpa_fallback
    monitor.detach()


@pytest.mark.gpu
def test_a_replayed_launch_reads_the_new_mask():
    """Repeats of a call replay its launches (launch plans keyed by layouts): a second mask of the same
    layout must be the one read."""
    B, H, N, D = 2, 4, 256, 64
    q, k, v = random_qkv(B, H, N, D, device="cuda", seed=18)
    for lengths in ([256, 100], [40, 256], [256, 100]):
        mask = key_padding(B, N, lengths, "cuda")
        out = flash_attention(q, k, v, causal=False, attn_mask=mask)
        want = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask)
        assert (out.float() - want).abs().max() < 2e-2
