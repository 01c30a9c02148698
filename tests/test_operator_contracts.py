"""The compiled path's custom operators keep their declared contracts (``torch.library.opcheck``).

Each operator of ``flashwatch.kernels.ops`` is checked on the CPU with grouped-query inputs (4
query heads, 2 key heads) and a mask: its schema declares every tensor it mutates (the statistics
buffers, the coverage counters), so the compiler never reorders or drops their updates, and its
fake implementation gives the outputs the real one gives (shapes, dtypes, strides), which
compiled graphs are built from. A fake that gave an output of the wrong shape, or a coverage
counter or gradient written into but not declared as mutated, compiles into wrong graphs with no
error at the call.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from flashwatch.kernels import AttentionStats, layouts, ops

B, H, HKV, N, D = 2, 4, 2, 8, 16
CHECKS = ("test_schema", "test_faketensor")


@pytest.fixture
def call():
    """One grouped-query call's inputs, its output and output gradient, the statistics buffers of a
    monitored step (flag on), a key-padding mask and a registered layer's key."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, N, D, generator=g)
    k, v = (torch.randn(B, HKV, N, D, generator=g) for _ in range(2))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    stats = AttentionStats(H)
    counts, values = ops.stats_buffers(stats)
    mask = torch.ones(B, 1, 1, N, dtype=torch.bool)
    mask[1, ..., 5:] = False
    layer = ops.register_layer("contract test")
    yield dict(q=q, k=k, v=v, out=out, grad=torch.randn(out.shape, generator=g), flag=torch.ones((), dtype=torch.int32),
               counts=counts, values=values, coverage=torch.zeros(2, dtype=torch.int64), mask=mask, layer=layer,
               unit_gap=float(stats.unit_gap))
    ops.unregister_layer(int(layer))


def _op(name: str):
    return getattr(getattr(torch.ops.flashwatch, name), ops.CONTRACT)


@pytest.mark.parametrize("masked", [False, True], ids=["plain", "masked"])
def test_the_own_kernel_forward_and_backward(call, masked):
    c = call
    mask = c["mask"] if masked else None
    forward = (c["q"], c["k"], c["v"], c["flag"], c["counts"], c["values"], c["coverage"], not masked, D ** -0.5,
               "plain", 2.0, 1e-3, c["unit_gap"], None, None, c["layer"], mask)
    torch.library.opcheck(_op("attention_with_stats"), forward, test_utils=CHECKS)
    o, lse, r, rowmax, max_logit, read = _op("attention_with_stats")(*forward)
    saved = [c["q"], c["k"], c["v"], o, lse, r, rowmax, max_logit, c["flag"], read]
    grads = layouts.grads_like(c["q"], c["k"], c["v"])
    assert grads[0].shape == c["q"].shape and grads[1].shape == grads[2].shape == c["k"].shape  # key heads
    backward = (c["grad"], saved, c["counts"], c["values"], c["coverage"], not masked, D ** -0.5, 1e-3, c["unit_gap"],
                None, None, c["layer"], mask, *grads)
    torch.library.opcheck(_op("attention_grad"), backward, test_utils=CHECKS)
    assert _op("attention_grad")(*backward) is None
    # the gradients written into the given tensors, as autograd computes them
    q, k, v = (c[name].clone().requires_grad_() for name in "qkv")
    want = torch.autograd.grad(ops._Attention.apply(q, k, v, c["flag"], c["counts"], c["values"], c["coverage"],
                                                    not masked, D ** -0.5, "plain", 2.0, 1e-3, c["unit_gap"], None,
                                                    None, None, mask),
                               (q, k, v), c["grad"])
    for got, expected in zip(grads, want):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


@pytest.mark.parametrize("masked", [False, True], ids=["plain", "masked"])
def test_the_observed_call_and_the_call_measured_in_part(call, masked):
    c = call
    mask = c["mask"] if masked else None
    pattern_read = None
    if masked:  # the forward's read of the mask's pattern (declared: the count of reads it adds to)
        reads = torch.zeros((), dtype=torch.int64)
        torch.library.opcheck(_op("mask_pattern"), (mask, c["flag"], reads, N), test_utils=CHECKS)
        pattern_read = _op("mask_pattern")(mask, c["flag"], reads, N)
        assert pattern_read.tolist() == [1, 0, 0, 1]  # read; neither causal nor full; a boolean mask: no bias
    for scores_only in (None, "attention dropout is on"):  # measured in full; its scores only
        torch.library.opcheck(
            _op("observe_statistics"),
            (c["q"], c["k"], c["v"], c["out"], c["grad"], c["flag"], c["counts"], c["values"], c["coverage"], mask,
             not masked, D ** -0.5, 1e-3, masked, c["unit_gap"], None, None, c["layer"], pattern_read, scores_only),
            test_utils=CHECKS)


def test_the_call_not_measured(call):
    c = call
    torch.library.opcheck(_op("unmeasured_call"), (c["flag"], c["coverage"], c["layer"], "a reason"),
                          test_utils=CHECKS)
