"""Attention calls with masks, grouped-query attention and unequal lengths are measured.

The dense pass (``flashwatch.kernels.masked``) against float64 oracles: a padded batch's
statistics equal those of each sequence cut to its real length (padding rows and keys left
out); a Monitor measures such calls in observe and own-kernel mode, eager and compiled alike.

Fail before: every call with an attn_mask or unequal query/key lengths was logged and skipped.
"""

from __future__ import annotations

import logging
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._dynamo.utils import counters

from flashwatch import Monitor, MonitorConfig
from flashwatch.kernels import AttentionStats, masked, reference

B, H, N, D = 3, 2, 12, 16
LENGTHS = (12, 7, 9)
SCALE = D ** -0.5


def _inputs(nq=N, nk=N, hkv=H):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, nq, D, generator=g, dtype=torch.float64)
    k, v = (torch.randn(B, hkv, nk, D, generator=g, dtype=torch.float64) for _ in range(2))
    grad = torch.randn(B, H, nq, D, generator=g, dtype=torch.float64)
    return q, k, v, grad


def _keep():
    keep = torch.zeros(B, N, dtype=torch.bool)
    for b, n in enumerate(LENGTHS):
        keep[b, :n] = True
    return keep


def _stats(fn, format: str = "bf16", device: str = "cpu") -> dict:
    stats = AttentionStats(H, format=format, device=device)
    fn(stats)
    return stats.as_dict()


def _assert_same(got: dict, want: dict):
    # the same rows added into FP32 sums in another order: a signed sum that nearly cancels keeps
    # an error relative to its terms, not to itself, so its slack scales with the sum of |terms|
    terms = max(max(want["delta_error_abs"]), 1e-30) if "delta_error_abs" in want else 0.0
    for name in got:
        if name.startswith("delta_error"):
            atol = 1e-6 * terms if name in ("delta_error", "delta_error_tied") else 1e-12
            torch.testing.assert_close(torch.tensor(got[name]), torch.tensor(want[name]), rtol=1e-6, atol=atol)
        else:
            assert got[name] == want[name], (name, got[name], want[name])


def _rounded(out):
    """The output rounded to BF16, as a BF16 kernel saves it: a delta error well above float64 noise."""
    return out.to(torch.bfloat16).to(out.dtype)


@pytest.mark.parametrize("kind", ["bool key padding", "bool 4-D causal", "float 4-D causal"])
def test_right_padding_equals_each_sequence_cut_to_its_length(kind):
    q, k, v, grad = _inputs()
    keep = _keep()
    causal = kind != "bool key padding"
    if kind == "bool key padding":
        mask = keep[:, None, None, :]  # (B, 1, 1, N): every row attends to the real keys
    else:
        mask = keep[:, None, None, :] & torch.ones(N, N, dtype=torch.bool).tril()  # Hugging Face's (B, 1, N, N)
    if kind.startswith("float"):
        mask = torch.zeros(mask.shape, dtype=torch.float64).masked_fill(~mask, torch.finfo(torch.float64).min)
    out = _rounded(F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
    grad = grad * keep[:, None, :, None]  # a loss that ignores padding gives its rows no gradient
    got = _stats(lambda s: masked.attention_statistics(q, k, v, out, grad, s, attn_mask=mask, sm_scale=SCALE))

    def oracle(stats):
        for b, n in enumerate(LENGTHS):
            cut = (slice(b, b + 1), slice(None), slice(0, n))
            reference.attention_statistics(q[cut], k[cut], v[cut], out[cut], grad[cut], stats, causal=causal)
    want = _stats(oracle)
    assert got["rows"] == [float(sum(LENGTHS))] * H
    _assert_same(got, want)


def test_padded_rows_count_the_format_s_repeated_maxima():
    """The format's repeated-max rows (P_bar rounding to 1 at two keys in the run's format; FP8 E5M2's
    coarse grid ties many rows) are counted on a padded batch as on each sequence cut to its length.
    Fail before: a masked call left them at 0, a ratio of 0 that read as healthy."""
    q, k, v, grad = _inputs()
    keep = _keep()
    mask = keep[:, None, None, :] & torch.ones(N, N, dtype=torch.bool).tril()
    out = _rounded(F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
    grad = grad * keep[:, None, :, None]
    got = _stats(lambda s: masked.attention_statistics(q, k, v, out, grad, s, attn_mask=mask, sm_scale=SCALE),
                 format="fp8_e5m2")

    def oracle(stats):
        for b, n in enumerate(LENGTHS):
            cut = (slice(b, b + 1), slice(None), slice(0, n))
            reference.attention_statistics(q[cut], k[cut], v[cut], out[cut], grad[cut], stats, causal=True)
    want = _stats(oracle, format="fp8_e5m2")
    assert min(want["repeated_max_rows_format"]) > 0
    _assert_same(got, want)


def test_left_padding_leaves_fully_masked_rows_out():
    """Left padding with a causal mask: the padding rows have no key to attend to."""
    q, k, v, grad = _inputs()
    starts = [N - n for n in LENGTHS]
    allowed = torch.ones(N, N, dtype=torch.bool).tril().repeat(B, 1, 1)
    for b, p in enumerate(starts):
        allowed[b, :, :p] = False  # padding keys: the padding rows keep no key at all
    mask = allowed[:, None]
    out = _rounded(torch.nan_to_num(F.scaled_dot_product_attention(q, k, v, attn_mask=mask)))
    got = _stats(lambda s: masked.attention_statistics(q, k, v, out, grad, s, attn_mask=mask, sm_scale=SCALE))

    def oracle(stats):
        for b, p in enumerate(starts):
            cut = (slice(b, b + 1), slice(None), slice(p, N))
            reference.attention_statistics(q[cut], k[cut], v[cut], out[cut], grad[cut], stats, causal=True)
    assert got["rows"] == [float(sum(LENGTHS))] * H
    _assert_same(got, _stats(oracle))


def test_without_a_mask_the_dense_pass_is_the_plain_one():
    q, k, v, grad = _inputs()
    out = _rounded(F.scaled_dot_product_attention(q, k, v, is_causal=True))
    got = _stats(lambda s: masked.attention_statistics(q, k, v, out, grad, s, causal=True, sm_scale=SCALE))
    want = _stats(lambda s: reference.attention_statistics(q, k, v, out, grad, s, causal=True))
    assert got == want


def test_unequal_lengths_and_grouped_query_attention_against_float64_formulas():
    q, k, v, grad = _inputs(nq=8, nk=12, hkv=1)
    out = _rounded(F.scaled_dot_product_attention(q, k, v, enable_gqa=True))
    got = _stats(lambda s: masked.attention_statistics(q, k, v, out, grad, s, sm_scale=SCALE))
    kk, vv = k.expand(B, H, 12, D), v.expand(B, H, 12, D)
    s = q @ kk.transpose(-1, -2) * SCALE
    top = s.topk(2, dim=-1).values
    p = torch.softmax(s, dim=-1)
    err = (grad * out).sum(-1) - (p * (grad @ vv.transpose(-1, -2))).sum(-1)
    tied = top[..., 1] >= top[..., 0] - 1e-3
    assert got["rows"] == [B * 8.0] * H
    assert got["repeated_max_rows"] == tied.sum(dim=(0, 2)).double().tolist()
    f64 = torch.float64  # statistics are FP32 sums: compared at FP32 precision
    torch.testing.assert_close(torch.tensor(got["max_logit"], dtype=f64), top[..., 0].amax(dim=(0, 2)).float().double())
    torch.testing.assert_close(torch.tensor(got["delta_error"], dtype=f64), err.sum(dim=(0, 2)), rtol=1e-6, atol=1e-12)
    torch.testing.assert_close(torch.tensor(got["delta_error_sq"], dtype=f64), (err * err).sum(dim=(0, 2)), rtol=1e-6,
                               atol=0)


def test_a_finite_additive_bias_on_grouped_query_heads_against_float64_formulas():
    """An ALiBi-style float mask (finite values added to every score, none of them "masked") over
    4 query heads on 2 key heads: the dense pass adds the bias to the scores (the max logit
    includes it) and maps query head h to key head h // 2, as SDPA's enable_gqa does. The other
    mask tests hold only 0 and the dtype's lowest value, or one key head, where neither shows."""
    g = torch.Generator().manual_seed(2)
    hq, hkv = 4, 2
    q = torch.randn(B, hq, N, D, generator=g, dtype=torch.float64)
    k, v = (torch.randn(B, hkv, N, D, generator=g, dtype=torch.float64) for _ in range(2))
    grad = torch.randn(B, hq, N, D, generator=g, dtype=torch.float64)
    slopes = torch.tensor([2.0, 1.0, 0.5, 0.25], dtype=torch.float64).view(1, hq, 1, 1)
    pos = torch.arange(N, dtype=torch.float64)
    bias = -slopes * (pos[None, :] - pos[:, None]).abs()  # (1, 4, N, N), in [-22, 0]
    out = _rounded(F.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=True))
    stats = AttentionStats(hq)
    masked.attention_statistics(q, k, v, out, grad, stats, attn_mask=bias, sm_scale=SCALE)
    got = stats.as_dict()
    kk, vv = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    s = q @ kk.transpose(-1, -2) * SCALE + bias
    top = s.topk(2, dim=-1).values
    p = torch.softmax(s, dim=-1)
    err = (grad * out).sum(-1) - (p * (grad @ vv.transpose(-1, -2))).sum(-1)
    assert got["rows"] == [B * float(N)] * hq
    assert got["repeated_max_rows"] == (top[..., 1] >= top[..., 0] - 1e-3).sum(dim=(0, 2)).double().tolist()
    f64 = torch.float64  # statistics are FP32 sums: compared at FP32 precision
    torch.testing.assert_close(torch.tensor(got["max_logit"], dtype=f64), top[..., 0].amax(dim=(0, 2)).float().double())
    torch.testing.assert_close(torch.tensor(got["delta_error"], dtype=f64), err.sum(dim=(0, 2)), rtol=1e-6, atol=1e-12)
    torch.testing.assert_close(torch.tensor(got["delta_error_sq"], dtype=f64), (err * err).sum(dim=(0, 2)), rtol=1e-6,
                               atol=0)


def test_cross_attention_of_equal_lengths_keeps_every_query_row():
    """Cross attention whose encoder is padded to the decoder's length, with the encoder's key-padding
    mask: every decoder row attends to real keys and reaches the loss, so every one is measured, as
    with the padded keys cut off (unequal lengths, no mask). Fail before: decoder row j was left out
    wherever encoder key j was padding (the self-attention rule applied to any equal lengths)."""
    q, k, v, grad = _inputs()
    mask = _keep()[:, None, None, :]  # (B, 1, 1, Nk): the encoder's padding
    out = _rounded(F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
    got = _stats(lambda s: masked.attention_statistics(q, k, v, out, grad, s, attn_mask=mask, sm_scale=SCALE))

    def oracle(stats):
        for b, n in enumerate(LENGTHS):
            one, cut = slice(b, b + 1), (slice(b, b + 1), slice(None), slice(0, n))
            masked.attention_statistics(q[one], k[cut], v[cut], out[one], grad[one], stats, sm_scale=SCALE)
    assert got["rows"] == [float(B * N)] * H
    _assert_same(got, _stats(oracle))


def test_a_mask_that_hides_each_position_s_own_key_measures_every_row():
    """Self-attention to every other position (the mask hides each row's own key): no position is
    padding, every row is measured, against float64 formulas. Fail before: every position read as
    padding, 0 rows measured."""
    q, k, v, grad = _inputs()
    mask = ~torch.eye(N, dtype=torch.bool)
    out = _rounded(F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
    got = _stats(lambda s: masked.attention_statistics(q, k, v, out, grad, s, attn_mask=mask, sm_scale=SCALE))
    s = (q @ k.transpose(-1, -2) * SCALE).masked_fill(~mask, float("-inf"))
    top = s.topk(2, dim=-1).values
    err = (grad * out).sum(-1) - (torch.softmax(s, dim=-1) * (grad @ v.transpose(-1, -2))).sum(-1)
    assert got["rows"] == [float(B * N)] * H
    assert got["repeated_max_rows"] == (top[..., 1] >= top[..., 0] - 1e-3).sum(dim=(0, 2)).double().tolist()
    f64 = torch.float64  # statistics are FP32 sums: compared at FP32 precision
    torch.testing.assert_close(torch.tensor(got["max_logit"], dtype=f64), top[..., 0].amax(dim=(0, 2)).float().double())
    torch.testing.assert_close(torch.tensor(got["delta_error"], dtype=f64), err.sum(dim=(0, 2)), rtol=1e-6, atol=1e-12)


@pytest.mark.parametrize("value", [-1e9, -1e4, "lowest", float("-inf")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_large_finite_additive_masks_mask_as_a_boolean_one(value, dtype):
    """A causal mask with right padding written as additive values, as models write it (-1e9 in the
    Annotated Transformer, -10,000 in older BERT code, the dtype's lowest value in Hugging Face):
    the same statistics as the boolean mask, in FP32 and BF16 alike. Fail before: only values at
    or below half the dtype's lowest counted as masked, so padding rows under -1e9 or -10,000 were
    counted, each a repeated maximum (every score s - 1e9 rounds to one value)."""
    q, k, v, grad = (t.to(dtype) for t in _inputs())
    keep = _keep()
    allowed = keep[:, None, None, :] & torch.ones(N, N, dtype=torch.bool).tril()
    value = torch.finfo(dtype).min if value == "lowest" else value
    additive = torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, value)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
    grad = grad * keep[:, None, :, None]  # a loss that ignores padding gives its rows no gradient
    got = _stats(lambda s: masked.attention_statistics(q, k, v, out, grad, s, attn_mask=additive, sm_scale=SCALE))
    want = _stats(lambda s: masked.attention_statistics(q, k, v, out, grad, s, attn_mask=allowed, sm_scale=SCALE))
    assert want["rows"] == [float(sum(LENGTHS))] * H
    _assert_same(got, want)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("kind", ["bool (N, N)", "bool (B, 1, N, N)", "float (B, 1, N, N)", "all True"])
def test_a_mask_that_is_only_the_causal_pattern_goes_to_the_plain_pass(kind, device, monkeypatch):
    """Hugging Face under torch.compile passes its causal mask as a tensor: that call is the causal
    call without a mask, measured by the plain pass (the Triton kernel on CUDA, no N x N tensor), as
    is a mask that masks nothing; its statistics are the plain pass's. A mask changed in place is
    read again. Fail before: every such call took the dense pass."""
    from flashwatch import kernels

    dtype = torch.float32 if device == "cpu" else torch.bfloat16  # the Triton kernel takes BF16 / FP16
    q, k, v, grad = (t.to(device, dtype) for t in _inputs())
    causal = kind != "all True"
    allowed = torch.ones(N, N, dtype=torch.bool, device=device).tril() if causal \
        else torch.ones(B, 1, 1, N, dtype=torch.bool, device=device)
    if kind != "bool (N, N)" and causal:
        allowed = allowed.expand(B, 1, N, N).clone()
    mask = allowed if kind != "float (B, 1, N, N)" else \
        torch.zeros(allowed.shape, device=device, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    plain_calls = []
    plain = kernels.attention_statistics
    monkeypatch.setattr(kernels, "attention_statistics", lambda *a, **kw: (plain_calls.append(kw), plain(*a, **kw)))
    got = _stats(lambda s: masked.attention_statistics(q, k, v, out, grad, s, attn_mask=mask, sm_scale=SCALE),
                 device=device)
    assert [c["causal"] for c in plain_calls] == [causal]
    want = _stats(lambda s: plain(q, k, v, out, grad, s, causal=causal, sm_scale=SCALE), device=device)
    if device == "cpu":
        assert got == want
    else:  # the Triton pass adds its FP32 sums with atomics, in no fixed order: two calls differ in the last bits
        _assert_same(got, want)
    if kind == "bool (B, 1, N, N)":  # a key masked in place: the dense pass, padding left out
        mask[1, :, :, LENGTHS[1]:] = False
        masked.attention_statistics(q, k, v, out, grad * _keep().to(device)[:, None, :, None],
                                    AttentionStats(H, device=device), attn_mask=mask, sm_scale=SCALE)
        assert len(plain_calls) == 1


def test_what_the_dense_pass_does_not_take_says_why():
    q, k, v, _ = _inputs()
    assert "lengths that differ" in masked.mask_reason(None, q, k[:, :, :5], causal=True)
    assert "does not broadcast" in masked.mask_reason(torch.ones(5, 5, dtype=torch.bool), q, k, causal=False)
    assert "dtype torch.int64" in masked.mask_reason(torch.ones(N, N, dtype=torch.long), q, k, causal=False)
    assert masked.mask_reason(torch.ones(B, 1, 1, N, dtype=torch.bool), q, k, causal=False) is None


class PaddedAttention(nn.Module):
    """nanoGPT attention over a right-padded batch (a key-padding mask), or grouped-query
    attention with enable_gqa=True (two query heads per key head)."""

    def __init__(self, c=32, heads=2, gqa=False, dropout_p=0.0):
        super().__init__()
        self.c_attn = nn.Linear(c, 3 * c, bias=False)
        self.n_head, self.gqa, self.dropout_p = heads, gqa, dropout_p
        self.mask = _keep()[:, None, None, :8] if not gqa else None

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        if self.gqa:
            return F.scaled_dot_product_attention(q, k[:, :1], v[:, :1], is_causal=True, enable_gqa=True)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask, dropout_p=self.dropout_p)


def _one_step(make, mode: str, compiled: bool, variant: str = "plain", seen: dict | None = None
              ) -> tuple[dict, list]:
    """One monitored step of the module ``make()`` builds (input (3, 8, 32)), eager or compiled
    with aot_eager, under a loss that reads no padding position: its layer's statistics and coverage
    (``seen``, if given, gets the output and the layer's running variant)."""
    torch.manual_seed(0)
    mod = make()
    monitor = Monitor(MonitorConfig(interval=1, mode=mode, variant=variant, async_transfer=False))
    monitor.attach(mod)
    fn = torch.compile(mod, backend="aot_eager") if compiled else mod
    x = torch.randn(3, 8, 32, generator=torch.Generator().manual_seed(1))
    read = _keep()[:, None, :8, None]  # a loss that ignores PaddedAttention's padding positions
    out = fn(x)
    (out * x.view(3, 8, 2, 16).transpose(1, 2) * read).sum().backward()
    result = monitor.layers[0].stats.as_dict(), monitor.layers[0].coverage.tolist()
    if seen is not None:
        seen.update(out=out.detach(), variant=monitor.layers[0].running_variant, module=mod, x=x)
    monitor.detach()
    return result


def _eager_then_compiled(make, mode: str) -> tuple[tuple, tuple]:
    """``_one_step`` eager, then compiled from a fresh Dynamo: no graph break, no recompilation."""
    eager = _one_step(make, mode, False)
    torch._dynamo.reset()
    counters.clear()
    with torch._dynamo.config.patch(error_on_recompile=True):
        compiled = _one_step(make, mode, True)
    assert not counters["graph_break"]
    return eager, compiled


@pytest.mark.parametrize("gqa", [False, True], ids=["key padding", "enable_gqa"])
@pytest.mark.parametrize("mode", ["observe", "own_kernel"])
def test_monitor_measures_them_eager_and_compiled_alike(mode, gqa):
    eager, compiled = _eager_then_compiled(lambda: PaddedAttention(gqa=gqa), mode)
    assert eager[1] == compiled[1] == [1, 1]
    rows = 3 * 8.0 if gqa else float(8 + 7 + 8)  # padding rows left out (lengths 12, 7, 9 cut to 8)
    assert eager[0]["rows"] == [rows, rows]
    assert eager[0] == compiled[0]


@pytest.mark.parametrize("variant", ["plain", "fixed", "fp32_delta"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "aot_eager"])
def test_own_kernel_mode_runs_its_kernel_with_the_mask(variant, compiled):
    """Own-kernel mode (and so ``auto_fix``) runs flashwatch's kernel on calls with an attn_mask, with
    the call's mask and the layer's variant: the layer reports its variant, not sdpa; its output is
    the kernel's; its statistics are those of observe mode's dense pass on that output (padding rows
    left out), eager and compiled alike. Fail before: such calls ran torch SDPA (the layer reported
    variant sdpa), so a switch to a fixed variant did not reach Hugging Face models under torch.compile,
    whose masks are tensors."""
    from flashwatch.kernels import flash_attention

    seen = {}
    stats, coverage = _one_step(PaddedAttention, "own_kernel", compiled, variant, seen)
    assert seen["variant"] == variant and coverage == [1, 1]
    mod, x = seen["module"], seen["x"]
    with torch.no_grad():
        q, k, v = (z.view(3, 8, 2, 16).transpose(1, 2) for z in mod.c_attn(x).split(32, dim=2))
        want = flash_attention(q, k, v, causal=False, attn_mask=mod.mask, variant=variant)
    assert torch.equal(seen["out"], want)
    observed, _ = _one_step(PaddedAttention, "observe", compiled)
    assert stats["rows"] == observed["rows"] == [float(8 + 7 + 8)] * 2
    for name in ("repeated_max_rows", "repeated_max_rows_bf16", "repeated_max_rows_format", "max_logit"):
        assert stats[name] == observed[name], name


@pytest.mark.parametrize("mode", ["observe", "own_kernel"])
def test_a_masked_call_with_attention_dropout_measures_its_scores(mode, caplog):
    """Hugging Face fine-tuning's usual call: a padding mask and attention dropout. Its rows,
    repeated maxima and max logit are those of the same call without dropout (dropout acts after
    the softmax), padding rows left out; its delta error is not measured (the sums stay 0 and the
    call counts as not measured in full: coverage [1, 0]); eager and compiled alike, and the log
    names both the dropout and the mask. Fail before: nothing but W^Q was measured, and the log
    blamed the mask alone."""
    without = _one_step(lambda: PaddedAttention(dropout_p=0.0), mode, False)
    with caplog.at_level(logging.INFO, logger="flashwatch"):
        eager, compiled = _eager_then_compiled(lambda: PaddedAttention(dropout_p=0.1), mode)
    assert eager[1] == compiled[1] == [1, 0]
    assert eager[0]["rows"] == [float(8 + 7 + 8)] * 2  # padding rows left out
    for name in ("rows", "repeated_max_rows", "repeated_max_rows_bf16", "repeated_max_rows_format", "max_logit"):
        assert eager[0][name] == compiled[0][name] == without[0][name], name
    for name in ("delta_error", "delta_error_abs", "delta_error_sq"):
        assert all(v == 0.0 for v in eager[0][name] + compiled[0][name]), name
    assert any("attention dropout is on (dropout_p=0.1) and an attn_mask is given" in r.getMessage()
               for r in caplog.records)


class CrossAttention(nn.Module):
    """Queries from the module's input (8 positions), keys and values from a fixed memory of 12
    positions through the same projection: query and key lengths differ, no mask, not causal."""

    def __init__(self, c=32, heads=2):
        super().__init__()
        self.c_attn = nn.Linear(c, 3 * c, bias=False)
        self.n_head = heads
        self.memory = torch.randn(3, 12, c, generator=torch.Generator().manual_seed(3))

    def forward(self, x):
        b, t, c = x.shape
        q = self.c_attn(x)[..., :c].view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        _, k, v = self.c_attn(self.memory).split(c, dim=2)
        k, v = (z.view(b, 12, self.n_head, c // self.n_head).transpose(1, 2) for z in (k, v))
        return F.scaled_dot_product_attention(q, k, v)


@pytest.mark.parametrize("mode", ["observe", "own_kernel"])
def test_monitor_measures_cross_attention_eager_and_compiled_alike(mode):
    """Query and key lengths that differ, without a mask: the dense pass measures every row in full."""
    eager, compiled = _eager_then_compiled(CrossAttention, mode)
    assert eager[1] == compiled[1] == [1, 1]
    assert eager[0]["rows"] == [3 * 8.0] * 2
    assert eager[0] == compiled[0]


class CausalMaskAttention(nn.Module):
    """nanoGPT attention that passes its causal mask as a tensor made in its forward, as Hugging
    Face's models do under torch.compile; returns (batch, positions, channels)."""

    def __init__(self, c=32, heads=2, dropout_p=0.0):
        super().__init__()
        self.c_attn = nn.Linear(c, 3 * c, bias=False)
        self.n_head, self.dropout_p = heads, dropout_p

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in self.c_attn(x).split(c, dim=2))
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=self.dropout_p)
        return y.transpose(1, 2).reshape(b, t, c)


@pytest.mark.parametrize("mode", ["observe", "own_kernel"])
@pytest.mark.parametrize("dropout_p", [0.0, 0.1], ids=["no dropout", "attention dropout"])
@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
def test_a_causal_mask_tensor_is_read_in_the_forward_and_measured_by_the_plain_pass(backend, dropout_p, mode,
                                                                                     monkeypatch):
    """Whether a mask is only the causal pattern is read on monitored steps in the forward, where
    the mask is made, not in the backward: a read there waits for all the work queued before it,
    once a masked layer on every monitored step (on an H100, compiled GPT-2 small's monitored step
    took 30% longer than an unmonitored one, against 9% without a mask). Every call is measured by
    the plain pass in the backward (with attention dropout: its scores only, counted as not measured
    in full, compiled as in eager mode); unmonitored steps read nothing; compiled: no graph break, no
    recompilation between monitored and unmonitored steps; in own-kernel mode alike, where flashwatch's
    kernel runs the masked call (dropout: torch SDPA, observed). Fail before: the read ran in the
    backward, and a compiled call with dropout was measured in the forward, where it read too."""
    from flashwatch import kernels
    from flashwatch.kernels import ops

    phase, events = ["forward"], []
    read_pattern, plain = masked.read_pattern, kernels.attention_statistics
    monkeypatch.setattr(masked, "read_pattern", lambda *a: (events.append(("read", phase[0])), read_pattern(*a))[1])
    monkeypatch.setattr(kernels, "attention_statistics",
                        lambda *a, **kw: (events.append(("plain", phase[0], kw["causal"])), plain(*a, **kw))[1])
    torch.manual_seed(0)
    model = nn.Sequential(CausalMaskAttention(dropout_p=dropout_p), CausalMaskAttention(dropout_p=dropout_p))
    monitor = Monitor(MonitorConfig(interval=2, mode=mode, async_transfer=False))
    monitor.attach(model)
    torch._dynamo.reset()
    counters.clear()
    run = model if backend == "eager" else torch.compile(model, backend=backend)
    reads_before = int(ops.pattern_reads)
    per_step = []
    with torch._dynamo.config.patch(error_on_recompile=True):
        for step in range(3):  # monitored, unmonitored, monitored
            events.clear()
            phase[0] = "forward"
            loss = run(torch.randn(3, 8, 32, generator=torch.Generator().manual_seed(step))).square().sum()
            phase[0] = "backward"
            loss.backward()
            per_step.append((list(events), [layer.coverage.tolist() for layer in monitor.layers]))
            monitor.step()
    variants = [layer.running_variant for layer in monitor.layers]
    monitor.detach()
    monitored = [("read", "forward")] * 2 + [("plain", "backward", True)] * 2
    assert [events for events, _ in per_step] == [monitored, [], monitored]
    measured = int(dropout_p == 0.0)  # with dropout: a call, not measured in full
    assert per_step[0][1] == [[1, measured], [1, measured]]
    own_kernel_ran = mode == "own_kernel" and dropout_p == 0.0
    if mode == "own_kernel":  # the kernel took the masked calls; with dropout, torch SDPA did
        assert variants == ["plain" if own_kernel_ran else "sdpa"] * 2
    if backend != "eager":
        assert not counters["graph_break"]
        # observe's mask_pattern operator counts its reads (2 layers, 2 monitored steps); the own kernel's
        # forward operator reads without that count
        assert int(ops.pattern_reads) - reads_before == (0 if own_kernel_ran else 4)


@pytest.mark.gpu
def test_a_cuda_mask_s_pattern_is_read_into_pinned_memory_without_waiting():
    """On CUDA the read is a non-blocking copy into pinned memory with its event kept, so its
    reader waits for that copy only; a mask tensor read once is not read again until it changes."""
    mask = torch.ones(64, 64, dtype=torch.bool, device="cuda").tril()
    read = masked.read_pattern(mask, 64)
    assert read.device.type == "cpu" and read.is_pinned() and read.data_ptr() in masked._in_flight
    assert masked._plain_equivalent(mask, 64, read) == "causal"
    assert masked.read_pattern(mask, 64) is read
    mask[0, 1] = True  # changed in place: read again, now any other mask
    assert masked._plain_equivalent(mask, 64) is None
    assert masked._plain_equivalent(mask, 64, masked.no_pattern_read()) is None  # a read of nothing: read now


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_a_failing_read_of_the_mask_s_pattern_changes_nothing_but_where_it_is_read(backend, monkeypatch):
    """A read of the mask's pattern that fails in the forward never breaks the step: the backward
    reads the mask itself and measures the call as before."""
    read_pattern, failed = masked.read_pattern, []

    def failing_in_the_forward(attn_mask, n):
        if not failed:
            failed.append(n)
            raise RuntimeError("a read that fails")
        return read_pattern(attn_mask, n)

    monkeypatch.setattr(masked, "read_pattern", failing_in_the_forward)
    torch.manual_seed(0)
    model = CausalMaskAttention()
    monitor = Monitor(MonitorConfig(interval=1, mode="observe", async_transfer=False))
    monitor.attach(model)
    torch._dynamo.reset()
    run = model if backend == "eager" else torch.compile(model, backend=backend)
    run(torch.randn(3, 8, 32)).square().sum().backward()
    assert failed == [8] and monitor.layers[0].coverage.tolist() == [1, 1]
    assert monitor.layers[0].stats.as_dict()["rows"] == [3 * 8.0] * 2
    monitor.detach()


def test_compiled_hugging_face_gpt2_with_padding_runs_the_own_kernel():
    """Hugging Face GPT-2 fine-tuned on a left-padded batch, compiled (aot_eager), in own-kernel mode with
    fp32_delta: its attention passes a 4-D mask tensor, which the kernel now takes, so every layer runs
    fp32_delta (an auto_fix switch reaches it), is measured in full with the padding rows left out, and
    the Monitor adds no graph break to the model's own. Fail before: every layer ran torch SDPA and reported variant sdpa."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=2, n_head=4, n_embd=64, vocab_size=100, n_positions=32, attn_pdrop=0.0,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    monitor = Monitor(MonitorConfig(interval=1, mode="own_kernel", variant="fp32_delta", async_transfer=False))
    monitor.attach(model)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 100, (2, 16), generator=g)
    attention_mask = torch.ones(2, 16, dtype=torch.long)
    attention_mask[1, :5] = 0  # five positions of left padding
    labels = ids.masked_fill(attention_mask == 0, -100)

    def graph_breaks(run) -> int:
        torch._dynamo.reset()
        counters.clear()
        torch.compile(run, backend="aot_eager")(input_ids=ids, attention_mask=attention_mask,
                                                labels=labels).loss.backward()
        return sum(counters["graph_break"].values())

    monitor.detach()
    own = graph_breaks(model)  # the model's own (a logging call in its forward)
    monitor.attach(model)
    assert graph_breaks(model) == own
    assert [layer.running_variant for layer in monitor.layers] == ["fp32_delta"] * 2
    for layer in monitor.layers:
        assert layer.coverage.tolist() == [1, 1]
        # 32 positions, less the 5 padding rows no loss reads
        assert layer.stats.as_dict()["rows"] == [32.0 - 5] * 4
    monitor.detach()
