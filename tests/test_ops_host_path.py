"""The own kernel's compiled path (``flashwatch.kernels.ops``): the same numbers as the eager
kernel, through operators without ``torch.library.custom_op``'s per-call Python wrappers.

Outputs, gradients and statistics of ``ops.attention`` compiled with Inductor are bit-identical
to ``flash_attention``'s eager ones (the Triton path under the CPU interpreter), on monitored
and unmonitored steps of one compiled graph.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from flashwatch.kernels import STAT_FIELDS, AttentionStats, flash_attention, layouts, ops

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.usefixtures("fresh_dynamo")]



@pytest.mark.parametrize("variant", ["plain", "fp32_delta"])
def test_compiled_operators_give_the_eager_kernels_bits(variant, interpret_dispatch):
    g = torch.Generator().manual_seed(0)
    shape = (1, 2, 40, 16)  # N not a multiple of the blocks: the masked tails run too
    q, k, v, do = (torch.randn(shape, generator=g).to(torch.bfloat16) for _ in range(4))
    flag = torch.zeros((), dtype=torch.int32)

    def run_ops(q, k, v, stats, coverage):
        return ops.attention(q, k, v, flag=flag, stats=stats, coverage=coverage, causal=True, variant=variant)

    compiled = torch.compile(run_ops, backend="inductor", fullgraph=True)
    for monitored in (True, False, True):
        flag.fill_(int(monitored))
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        eager_stats = AttentionStats(2)
        out = flash_attention(*leaves, causal=True, variant=variant, stats=eager_stats if monitored else None)
        expected = (out, *torch.autograd.grad(out, leaves, do))
        reference = eager_stats.as_dict() if monitored else AttentionStats(2).as_dict()
        for how, fn in (("operators, eager", run_ops), ("operators, compiled", compiled)):
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            stats, coverage = AttentionStats(2), torch.zeros(2, dtype=torch.int64)
            out = fn(*leaves, stats, coverage)
            got = (out, *torch.autograd.grad(out, leaves, do))
            for name, e, c in zip(("out", "dq", "dk", "dv"), expected, got):
                assert torch.equal(e, c), (how, monitored, name)
            assert stats.as_dict() == reference, (how, monitored)
            assert coverage.tolist() == ([1, 1] if monitored else [0, 0]), how
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
    assert set(STAT_FIELDS) <= set(reference)


@pytest.mark.parametrize("variant", ["plain", "fp32_delta"])
def test_the_output_is_in_the_memory_order_sdpa_gives(variant, interpret_dispatch):
    """O (B, H, N, D) is laid out as (B, N, H, D), as torch SDPA's flash and cuDNN paths give it, so a
    model's ``o.transpose(1, 2).contiguous()`` copies nothing; eager, and compiled (where Inductor
    checks the real strides against the operator's fake ones). Fail before: O was contiguous."""
    q, k, v = (torch.randn(1, 2, 24, 16).to(torch.bfloat16).requires_grad_() for _ in range(3))
    flag = torch.ones((), dtype=torch.int32)

    def run_ops(q, k, v):
        return ops.attention(q, k, v, flag=flag, stats=AttentionStats(2), coverage=torch.zeros(2, dtype=torch.int64),
                             causal=True, variant=variant)

    for how, fn in (("eager", lambda q, k, v: flash_attention(q, k, v, variant=variant)),
                    ("operators, compiled", torch.compile(run_ops, backend="inductor", fullgraph=True))):
        o = fn(q, k, v)
        assert o.shape == (1, 2, 24, 16) and o.transpose(1, 2).is_contiguous(), how
        y = o.transpose(1, 2).contiguous()
        assert y.data_ptr() == o.data_ptr(), how  # no copy
        o.float().sum().backward()  # the backward takes O with these strides
        assert all(torch.isfinite(t.grad).all() for t in (q, k, v)), how


@pytest.mark.parametrize("monitored", [False, True])
def test_the_gradients_are_in_the_memory_order_of_the_projections(monitored, interpret_dispatch):
    """dQ, dK, dV (B, H, N, D) are laid out as (B, N, H, D), the order of the projections q, k, v are
    views of, so the backward of a model's ``.view(B, N, H, D).transpose(1, 2)`` copies nothing;
    eager and compiled, with statistics off and on. Fail before: they were contiguous."""
    q, k, v = (torch.randn(1, 2, 24, 16).to(torch.bfloat16).requires_grad_() for _ in range(3))
    flag = torch.full((), int(monitored), dtype=torch.int32)
    do = torch.randn(1, 2, 24, 16).to(torch.bfloat16)

    def run_ops(q, k, v):
        return ops.attention(q, k, v, flag=flag, stats=AttentionStats(2), coverage=torch.zeros(2, dtype=torch.int64),
                             causal=True)

    stats = AttentionStats(2) if monitored else None
    for how, fn in (("eager", lambda q, k, v: flash_attention(q, k, v, stats=stats)),
                    ("operators, compiled", torch.compile(run_ops, backend="inductor", fullgraph=True))):
        grads = torch.autograd.grad(fn(q, k, v), (q, k, v), do)
        assert all(g.shape == (1, 2, 24, 16) and g.transpose(1, 2).is_contiguous() for g in grads), how


def test_operators_have_no_python_version_bump():
    """The operators that mutate the statistics buffers do so without a Python ADInplaceOrView
    kernel: ``custom_op`` registers one for a mutating operator, which walks the schema once
    per argument on every call (about 50-100 us of host time a call). Fail before: the
    operators were ``custom_op``s."""
    for name in ("attention_grad", "attention_with_stats", "observe_statistics", "unmeasured_call", "mask_pattern"):
        assert not torch._C._dispatch_has_kernel_for_dispatch_key(ops.qualified(name), "ADInplaceOrView"), name
    schema = getattr(torch.ops.flashwatch.attention_grad, ops.CONTRACT)._schema
    mutated = [a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    # still declared: functionalization sees the writes (and the gradients it writes into, v7)
    assert mutated == ["counts", "values", "coverage", "dq", "dk", "dv"]


# What each operator's fake implementation returns for the inputs below, per ops.CONTRACT: code that
# Inductor cached calls operators by name, so a fake whose outputs change must come with a new
# CONTRACT (and a new entry here), or a graph cached by an earlier flashwatch asserts the old strides.
# v3 and v4 changed a schema (the layer's key a tensor; the query's rotation), not the outputs.
_OUTPUTS_V2 = {
    ("attention_with_stats", "plain"): [((2, 4, 8, 16), (512, 16, 64, 1), "bfloat16"),
                                        ((2, 4, 8), (32, 8, 1), "float32"), ((0,), (1,), "bfloat16"),
                                        ((2, 4, 8), (32, 8, 1), "float32"), ((4,), (1,), "float32")],
    ("attention_with_stats", "fp32_delta"): [((2, 4, 8, 16), (512, 16, 64, 1), "bfloat16"),
                                             ((2, 4, 8), (32, 8, 1), "float32"),
                                             ((2, 4, 8, 16), (512, 16, 64, 1), "bfloat16"),
                                             ((2, 4, 8), (32, 8, 1), "float32"), ((4,), (1,), "float32")],
    ("attention_grad", "plain"): [((2, 4, 8, 16), (512, 128, 16, 1), "bfloat16"),
                                  ((2, 2, 8, 16), (256, 128, 16, 1), "bfloat16"),
                                  ((2, 2, 8, 16), (256, 128, 16, 1), "bfloat16")],
}
_OUTPUTS_V5 = {**_OUTPUTS_V2,  # the gradients in (B, N, heads, D) memory order, as O
               ("attention_grad", "plain"): [((2, 4, 8, 16), (512, 16, 64, 1), "bfloat16"),
                                             ((2, 2, 8, 16), (256, 16, 32, 1), "bfloat16"),
                                             ((2, 2, 8, 16), (256, 16, 32, 1), "bfloat16")]}
_OUTPUTS_V7 = {**_OUTPUTS_V5, ("attention_grad", "plain"): []}  # the gradients written into tensors it is given
# v8: mask_pattern, new, returns its read (CPU int8 (4,))
_OUTPUTS_V8 = {**_OUTPUTS_V7, ("mask_pattern", "plain"): [((4,), (1,), "int8")]}
# v9: attention_with_stats returns its mask's pattern read as well (CPU int8 (4,))
_READ = ((4,), (1,), "int8")
_OUTPUTS_V9 = {**_OUTPUTS_V8,
               ("attention_with_stats", "plain"): _OUTPUTS_V8[("attention_with_stats", "plain")] + [_READ],
               ("attention_with_stats", "fp32_delta"): _OUTPUTS_V8[("attention_with_stats", "fp32_delta")] + [_READ]}
FAKE_OUTPUTS = {"v2": _OUTPUTS_V2, "v3": _OUTPUTS_V2, "v4": _OUTPUTS_V2, "v5": _OUTPUTS_V5, "v6": _OUTPUTS_V5,
                "v7": _OUTPUTS_V7, "v8": _OUTPUTS_V8, "v9": _OUTPUTS_V9}

# Each operator's arguments under the current CONTRACT (v9: the own kernel's operators take the call's
# attn_mask, and the forward returns the mask's pattern read): a schema that changes must come with a new
# CONTRACT too, for the same reason.
SCHEMAS = {"v9": {
    "attention_with_stats": "(Tensor q, Tensor k, Tensor v, Tensor flag, Tensor counts, Tensor values, Tensor coverage, "
                            "bool causal, float sm_scale, str variant, float beta, float eps, float unit_gap, "
                            "Tensor? x, Tensor? rotation, Tensor? layer, Tensor? attn_mask) -> "
                            "(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
    "attention_grad": "(Tensor do, Tensor[] saved, Tensor(a!) counts, Tensor(b!) values, Tensor(c!) coverage, "
                      "bool causal, float sm_scale, float eps, float unit_gap, Tensor? x, Tensor? rotation, "
                      "Tensor? layer, Tensor? attn_mask, Tensor(d!) dq, Tensor(e!) dk, Tensor(f!) dv) -> ()",
    "observe_statistics": "(Tensor q, Tensor k, Tensor v, Tensor out, Tensor grad_out, Tensor flag, Tensor(a!) counts, "
                          "Tensor(b!) values, Tensor(c!) coverage, Tensor? attn_mask, bool causal, float sm_scale, "
                          "float eps, bool masked, float unit_gap, Tensor? x, Tensor? rotation, Tensor? layer, "
                          "Tensor? pattern_read, str? scores_only) -> ()",
    "mask_pattern": "(Tensor attn_mask, Tensor flag, Tensor(a!) reads, int n) -> Tensor",
    "unmeasured_call": "(Tensor flag, Tensor(a!) coverage, Tensor layer, str reason) -> ()",
}}


def test_an_operators_schema_changes_only_with_the_operator_contract():
    """Fails when an operator's arguments change while ops.CONTRACT stays: code Inductor cached
    calls the operator by name with the old arguments. Bump CONTRACT and record the schemas here."""
    assert ops.CONTRACT in SCHEMAS, f"record the schemas of contract {ops.CONTRACT} in SCHEMAS"
    for name, arguments in SCHEMAS[ops.CONTRACT].items():
        schema = str(getattr(getattr(torch.ops.flashwatch, name), ops.CONTRACT)._schema)
        assert schema == f"flashwatch::{name}.{ops.CONTRACT}{arguments}", name


def test_a_fake_implementations_outputs_change_only_with_the_operator_contract(interpret_dispatch):
    """Fails when a fake's output shapes, strides or dtypes change while ops.CONTRACT stays: bump it
    (the operators' overload name, which cached compiled code calls) and record the new outputs."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    assert ops.CONTRACT in FAKE_OUTPUTS, f"record the fake outputs of contract {ops.CONTRACT} in FAKE_OUTPUTS"
    describe = lambda ts: [(tuple(t.shape), tuple(t.stride()), str(t.dtype).removeprefix("torch.")) for t in ts]
    got = {}
    with FakeTensorMode():
        q = torch.empty(2, 4, 8, 16, dtype=torch.bfloat16)
        k, v = (torch.empty(2, 2, 8, 16, dtype=torch.bfloat16) for _ in range(2))
        flag = torch.zeros((), dtype=torch.int32)
        counts, values, coverage = torch.zeros(4, 4, dtype=torch.int64), torch.zeros(5, 4), torch.zeros(4, dtype=torch.int64)
        fwd = getattr(torch.ops.flashwatch.attention_with_stats, ops.CONTRACT)
        for variant in ("plain", "fp32_delta"):
            outs = fwd(q, k, v, flag, counts, values, coverage, True, 0.25, variant, 2.0, 1e-3, -0.002, None, None, None,
                       None)
            got[("attention_with_stats", variant)] = describe(outs)
        grad = getattr(torch.ops.flashwatch.attention_grad, ops.CONTRACT)
        outs = grad(q, [q, k, v, q, q, q, q, q, flag, flag], counts, values, coverage, True, 0.25, 1e-3, -0.002, None,
                    None, None, None, *layouts.grads_like(q, k, v))
        got[("attention_grad", "plain")] = describe(outs or ())
        if ("mask_pattern", "plain") in FAKE_OUTPUTS[ops.CONTRACT]:
            pattern = getattr(torch.ops.flashwatch.mask_pattern, ops.CONTRACT)
            got[("mask_pattern", "plain")] = describe([pattern(torch.empty(8, 8, dtype=torch.bool), flag,
                                                               torch.zeros((), dtype=torch.int64), 8)])
    assert got == FAKE_OUTPUTS[ops.CONTRACT], "a fake's outputs changed: bump ops.CONTRACT and record them here"
