"""The Triton kernels, run by Triton's CPU interpreter at small shapes (CI has no GPU).

The interpreter's bf16 dot multiplies raw bit patterns and its fp32->bf16 cast truncates; the
kernels work around both when they run on CPU tensors, and the last tests prove the
workarounds matter by switching them off.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from flashwatch.kernels import AttentionStats, attention_statistics, faults, flash_attention, reference
from attention_oracles import max_err
from kernel_cases import (check_against_float64, check_statistics, delta_error_at_scale, planted_near_ties,
                          planted_ties, random_qkv, worst_relative_error)

pytestmark = pytest.mark.usefixtures("interpret_dispatch")
_cast = None  # set by test_exact_bf16_rounding_fixes_the_interpreter_cast

CASES = [  # (B, H, Hkv, N, D)
    (1, 2, 2, 1, 64),
    (2, 2, 2, 17, 64),
    (1, 2, 1, 97, 64),
    (1, 1, 1, 128, 128),
    (1, 4, 2, 33, 32),
    (1, 2, 2, 40, 16),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "B{}H{}Hkv{}N{}D{}".format(*c))
@pytest.mark.parametrize("causal", [True, False])
def test_plain_bf16_within_tolerance_rule(case, causal):
    B, H, Hkv, N, D = case
    check_against_float64(*random_qkv(B, H, N, D, Hkv=Hkv, seed=N + D), causal=causal, variant="plain")


@pytest.mark.parametrize("variant", ["fixed", "fp32_delta"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_variants_and_fp16_within_tolerance_rule(variant, dtype):
    check_against_float64(*random_qkv(1, 2, 97, 64, Hkv=1, dtype=dtype, seed=3), causal=True, variant=variant)


def test_float32_inputs_are_computed_without_tf32():
    q, k, v = random_qkv(1, 2, 33, 64, dtype=torch.float32, seed=4)
    out = flash_attention(q, k, v)
    ref = reference.flash_attention(q.double(), k.double(), v.double())
    assert max_err(out, ref) < 1e-5


def test_fixed_variant_on_ties_and_huge_logits_never_nan():
    q, k, v = planted_ties(B=1, H=2, N=70, D=64)
    for scale in (1.0, 40.0):  # 40: logits in the thousands
        qs = (q.float() * scale).bfloat16().requires_grad_(True)
        stats = AttentionStats(2)
        out = flash_attention(qs, k, v, variant="fixed", stats=stats)
        out.backward(torch.ones_like(out))  # repeated-max rows are counted by the backward
        assert torch.isfinite(out).all() and torch.isfinite(qs.grad).all()
        qs = qs.detach()
        assert stats.repeated_max_rows.sum() > 0
        want = reference.flash_attention(qs.double(), k.double(), v.double())
        assert max_err(out, want) < 0.05
    assert stats.max_logit.max() > 1000


def test_statistics_on_planted_ties_match_reference():
    stats, ref = check_statistics(*planted_ties())
    assert stats.repeated_max_rows.min() >= 20, "the planted ties should be counted"


@pytest.mark.parametrize("causal", [True, False])
def test_statistics_on_random_inputs_gqa(causal):
    q, k, v = random_qkv(2, 4, 57, 32, Hkv=2, seed=5)
    check_statistics(q, k, v, causal=causal)


def test_near_ties_inside_and_outside_eps_across_tiles():
    q, k, v = planted_near_ties()
    stats, ref = check_statistics(q, k, v, eps=1e-3)
    s = reference.scores(q, k, True, 64 ** -0.5)
    m1, m2 = reference.row_top2(s)
    tied = reference.tie_flags(m1, m2, 1e-3)[0]
    assert tied[:, :, 30].all() and not tied[:, :, 31].any(), "planting failed: gaps not at eps/2 and 2 eps"


def test_statistics_pass_matches_reference_pass():
    q, k, v = (t.detach() for t in random_qkv(1, 4, 45, 64, Hkv=1, seed=6))
    out = reference.flash_attention(q, k, v)  # "the other kernel"
    g = torch.randn_like(out)
    got, want = AttentionStats(4, format="fp8_e5m2"), AttentionStats(4, format="fp8_e5m2")
    attention_statistics(q, k, v, out, g, got)
    reference.attention_statistics(q, k, v, out, g, want)
    assert want.repeated_max_rows_format.sum() > want.repeated_max_rows.sum()  # the E5M2 grid ties more rows
    for name in ("rows", "repeated_max_rows", "repeated_max_rows_bf16", "repeated_max_rows_format"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    torch.testing.assert_close(got.max_logit, want.max_logit)
    scale = want.delta_error_abs
    assert ((got.delta_error - want.delta_error).abs() <= 1e-4 * scale + 1e-6).all()
    torch.testing.assert_close(got.delta_error_abs, want.delta_error_abs, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("seed", [7, 8, 9, 10])
def test_delta_error_at_large_logits_matches_float64(seed):
    """At max logits of ~1,050-1,200 both kernels keep the delta error within 0.5% of float64's
    (relative to its sum of |row errors|): the dQ pass divides rowsum(P dP) by rowsum(P) (P through
    lse carries lse's FP32 rounding, common to the row), the statistics pass takes P as exp(s - m)
    over its row sum."""
    own, seen, truth, max_logit = delta_error_at_scale(300.0, flash_attention, attention_statistics, seed=seed)
    assert max_logit > 1000
    assert worst_relative_error(own, truth) < 0.005, worst_relative_error(own, truth)
    assert worst_relative_error(seen, truth) < 0.005, worst_relative_error(seen, truth)


def test_fp32_delta_residual_reaches_the_backward():
    """fp32_delta's delta is rowsum(dO * (O + R)): its delta error is only the P_bar rounding."""
    q, k, v = random_qkv(1, 2, 64, 64, seed=7)
    errs = {}
    for variant in ("plain", "fp32_delta"):
        stats = AttentionStats(2)
        out = flash_attention(q, k, v, variant=variant, stats=stats)
        out.backward(torch.ones_like(out))
        errs[variant] = stats.delta_error_abs.sum().item()
    assert errs["fp32_delta"] < 0.8 * errs["plain"], errs


def test_injection_biases_tied_rows_and_fixed_disarms_it():
    q, k, v = (t.detach() for t in planted_ties(B=1, H=2, N=70, D=64))
    base = flash_attention(q, k, v)
    with faults.rounding_bias(1.0):  # INJECTED
        injected = flash_attention(q, k, v)
        injected_ref = reference.flash_attention(q, k, v)
        fixed = flash_attention(q, k, v, variant="fixed")
    assert faults.rounding_bias_strength() == 0.0, "the with block restores the strength"
    assert (injected != base).float().mean() > 0.1, "most tied-row values should move"
    assert (injected.float().abs() >= base.float().abs()).all(), "injection must round away from zero"
    # the kernel and the reference round O_fp32 alike up to P_bar tiling: the injection adds no
    # disagreement of its own
    base_flips = (base != reference.flash_attention(q, k, v)).float().mean()
    injected_flips = (injected != injected_ref).float().mean()
    assert injected_flips <= base_flips + 0.02, (injected_flips, base_flips)
    assert torch.equal(fixed, flash_attention(q, k, v, variant="fixed"))
    assert torch.equal(flash_attention(q, k, v), base), "off again after the with block"


def test_injection_reaches_fp32_delta_output_but_not_its_delta():
    """Under fp32_delta the fault moves O, but the backward's delta comes from O + R (the FP32
    output before the fault): its delta error stays that of the clean run, while plain's grows."""
    q, k, v = (t.detach() for t in planted_ties(B=1, H=2, N=70, D=64))
    g = torch.randn(q.shape, generator=torch.Generator().manual_seed(12)).bfloat16()
    errs, outs = {}, {}
    for variant in ("plain", "fp32_delta"):
        for strength in (0.0, 4.0):
            stats = AttentionStats(2)
            qq = q.clone().requires_grad_(True)
            with faults.rounding_bias(strength):  # INJECTED
                out = flash_attention(qq, k, v, variant=variant, stats=stats)
            out.backward(g)
            errs[variant, strength] = stats.delta_error_abs.sum().item()
            outs[variant, strength] = out.detach()
    assert (outs["fp32_delta", 4.0] != outs["fp32_delta", 0.0]).float().mean() > 0.1, "the fault must reach O"
    assert errs["plain", 4.0] > 2 * errs["plain", 0.0], errs
    # R = O_fp32 - O is rounded to BF16 and now carries the injected push: a little slack
    assert errs["fp32_delta", 4.0] <= 1.05 * errs["fp32_delta", 0.0], errs


def _max_ever_repeats(s: torch.Tensor, eps: float) -> torch.Tensor:
    """(B, H, N) bool: at some key j the row's running max so far, m, had s_j within eps
    (m - eps <= s_j <= m + eps), i.e. some prefix of the row repeated its max. The fixed
    kernel's online flag can only turn on in such rows, whatever its tiling."""
    running = torch.cummax(s, dim=-1).values[..., :-1]  # max of s[..., :j], for j >= 1
    later = s[..., 1:]
    return ((later >= running - eps) & (later <= running + eps) & torch.isfinite(later)).any(dim=-1)


def test_fixed_changes_the_rows_whose_max_repeats_and_no_other():
    """The fixed variant's shift is the plain one on rows whose max never repeated (their output
    is bitwise the plain kernel's) and larger on tied rows, whose P_bar all fall below 1 and round
    anew: their output moves. A fixed kernel that never shifted would pass every tolerance test."""
    q, k, v = (t.detach() for t in planted_ties(B=1, H=2, N=70, D=64))
    plain = flash_attention(q, k, v)
    fixed = flash_attention(q, k, v, variant="fixed")
    s = reference.scores(q.double(), k.double(), True, q.shape[-1] ** -0.5)
    tied, _ = reference.tie_flags(*reference.row_top2(s), 1e-3)
    moved = (fixed != plain).any(dim=-1)  # (B, H, N)
    assert tied.sum() >= 40, "the planted ties should give many repeated-max rows"
    assert moved[tied].float().mean() > 0.8, moved[tied].float().mean()
    never = ~_max_ever_repeats(s, 1e-3)
    assert never.sum() >= 40
    assert not moved[never].any(), "rows whose max never repeated must equal the plain kernel's"
    assert max_err(fixed, reference.flash_attention(q.double(), k.double(), v.double())) < 0.05


def test_nan_in_one_head_stays_there():
    q, k, v = (t.detach() for t in random_qkv(1, 2, 20, 64, seed=8))
    q[0, 1, 4, 0] = float("nan")
    out = flash_attention(q, k, v)
    assert torch.isnan(out[0, 1, 4]).all() and torch.isfinite(out[0, 0]).all()


def test_non_contiguous_inputs():
    x = torch.randn(1, 24, 2, 3 * 64).bfloat16()
    q, k, v = (t.transpose(1, 2) for t in x.split(64, dim=-1))
    assert not q.is_contiguous()
    out = flash_attention(q, k, v)
    assert torch.equal(out, flash_attention(q.contiguous(), k.contiguous(), v.contiguous()))


def test_workarounds_matter(triton_interpreter, monkeypatch):
    """Without the workarounds, the interpreted bf16 kernel is garbage (the dot multiplies raw
    bits) — so the passing tests above really depend on them."""
    q, k, v = (t.detach() for t in random_qkv(1, 1, 16, 64, seed=9))
    want = reference.flash_attention(q.double(), k.double(), v.double())
    assert max_err(flash_attention(q, k, v), want) < 0.02
    monkeypatch.setattr(triton_interpreter, "INTERPRETER_WORKAROUNDS", False)
    assert not max_err(flash_attention(q, k, v), want) < 1.0


def test_exact_bf16_rounding_fixes_the_interpreter_cast(triton_interpreter):
    """The interpreter truncates fp32->bf16; _cast with EXACT_BF16 rounds to nearest even."""
    import triton
    import triton.language as tl

    from flashwatch.kernels import triton_kernels  # interpreted: the fixture built it so

    global _cast
    _cast = triton_kernels._cast  # the kernel below resolves it from this module's globals

    @triton.jit
    def kernel(X, Y, Z, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        x = tl.load(X + offs)
        tl.store(Y + offs, _cast(x, tl.bfloat16, True))
        tl.store(Z + offs, _cast(x, tl.bfloat16, False))

    x = torch.randn(1024) * torch.logspace(-3, 3, 1024)
    y = torch.empty(1024, dtype=torch.bfloat16)
    z = torch.empty(1024, dtype=torch.bfloat16)
    kernel[(1,)](x, y, z, BLOCK=1024)
    assert torch.equal(y, x.bfloat16()), "explicit rounding must equal torch's round-to-nearest-even"
    assert (z != x.bfloat16()).sum() > 100, "the interpreter's own cast truncates (bug fixed upstream?)"


def test_bf16_lower_bound_is_the_exact_rounding_threshold(triton_interpreter):
    """bf16(x) >= t  <=>  x >= _bf16_lower_bound(t), for thresholds of every sign and scale,
    including BF16 values themselves and midpoints between BF16 neighbours."""
    import triton
    import triton.language as tl

    from flashwatch.kernels import triton_kernels  # interpreted: the fixture built it so

    global _bound
    _bound = triton_kernels._bf16_lower_bound

    @triton.jit
    def kernel(T, L, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        tl.store(L + offs, _bound(tl.load(T + offs), True))

    g = torch.Generator().manual_seed(10)
    t = torch.randn(4096, generator=g) * torch.logspace(-4, 3, 4096)
    t[:512] = t[:512].bfloat16().float()  # exactly representable thresholds
    b = t[512:1024].bfloat16().float()
    t[512:1024] = b + (b.abs() * 2.0 ** -9)  # midpoints-ish between neighbours
    t[1024] = 0.0
    t[1025] = -0.0
    bound = torch.empty_like(t)
    kernel[(1,)](t, bound, BLOCK=4096)
    assert (bound.bfloat16().float() >= t).all(), "x = bound must round to >= t"
    below = torch.nextafter(bound, torch.full_like(bound, -float("inf")))
    assert (below.bfloat16().float() < t).all(), "the FP32 value just below must round to < t"


_bound = None  # set by test_bf16_lower_bound_is_the_exact_rounding_threshold


def test_raw_threshold_turns_a_scaled_test_into_a_raw_one(triton_interpreter):
    """fp32(r * scale) >= t  <=>  r >= _raw_threshold(t, scale), checked at the threshold's
    neighbours for many t and the scales attention uses."""
    import triton
    import triton.language as tl

    from flashwatch.kernels import triton_kernels  # interpreted: the fixture built it so

    global _raw
    _raw = triton_kernels._raw_threshold

    @triton.jit
    def kernel(T, R, scale, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        tl.store(R + offs, _raw(tl.load(T + offs), scale))

    g = torch.Generator().manual_seed(11)
    t = torch.randn(2048, generator=g) * torch.logspace(-3, 3, 2048)
    for scale in (64 ** -0.5, 128 ** -0.5, 0.3, 1.0):
        r = torch.empty_like(t)
        kernel[(1,)](t, r, scale, BLOCK=2048)
        s = torch.tensor(scale, dtype=torch.float32)
        assert (r * s >= t).all()
        below = torch.nextafter(r, torch.full_like(r, -float("inf")))
        assert (below * s < t).all()


_raw = None  # set by test_raw_threshold_turns_a_scaled_test_into_a_raw_one


def test_gradients_through_a_fused_qkv_projection():
    """Strided q, k, v views (a model's fused projection): gradients land in the right place."""
    from kernel_cases import check_fused_projection_gradients

    check_fused_projection_gradients("cpu")


# --- per-row outputs (AttentionStats.rows_hook) ------------------------------------------------

@pytest.mark.parametrize("variant", ["plain", "fixed", "fp32_delta"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("D, Hkv", [(16, 1), (32, 2), (64, 4)], ids=["D16-Hkv1", "D32-Hkv2", "D64-Hkv4"])
def test_rows_hook_matches_float64(variant, causal, D, Hkv):
    """N=37: two and a half 16-row tiles, a ragged tail; H=4 over Hkv kv heads."""
    from kernel_cases import check_rows_hook

    check_rows_hook(*random_qkv(1, 4, 37, D, Hkv=Hkv, seed=D), causal=causal, variant=variant)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_rows_hook_other_dtypes(dtype):
    """FP16 inputs: P K from P rounded to FP16; FP32 inputs take the IEEE product."""
    from kernel_cases import check_rows_hook, check_rows_hook_observe

    check_rows_hook(*random_qkv(1, 2, 37, 32, Hkv=1, dtype=dtype, seed=17))
    check_rows_hook_observe(*random_qkv(1, 2, 37, 32, Hkv=1, dtype=dtype, seed=18))


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("D, Hkv", [(16, 1), (64, 2)], ids=["D16-Hkv1", "D64-Hkv2"])
def test_rows_hook_in_the_statistics_pass_matches_float64(causal, D, Hkv):
    from kernel_cases import check_rows_hook_observe

    check_rows_hook_observe(*random_qkv(1, 4, 37, D, Hkv=Hkv, seed=D + 1), causal=causal)


def test_rows_hook_fresh_tensors_and_not_called_without_it():
    from kernel_cases import RowsRecorder

    q, k, v = random_qkv(1, 2, 20, 16, seed=15)
    stats = AttentionStats(2)
    stats.rows_hook = hook = RowsRecorder()
    for _ in range(2):
        flash_attention(q, k, v, stats=stats).backward(torch.ones(q.shape, dtype=q.dtype))
    assert len(hook.calls) == 2
    (e1, p1), (e2, p2) = hook.calls
    assert len({t.data_ptr() for t in (e1, p1, e2, p2)}) == 4, "every call hands over new tensors"
    torch.testing.assert_close(p1, p2)
    flash_attention(q, k, v).backward(torch.ones(q.shape, dtype=q.dtype))  # stats None
    stats.rows_hook = None
    flash_attention(q, k, v, stats=stats).backward(torch.ones(q.shape, dtype=q.dtype))
    attention_statistics(q.detach(), k.detach(), v.detach(), q.detach(), q.detach(), stats)
    assert len(hook.calls) == 2


def test_rows_hook_error_propagates_from_the_statistics_pass():
    q, k, v = (t.detach() for t in random_qkv(1, 2, 20, 16, seed=16))
    stats = AttentionStats(2)

    def broken(delta_error_rows, pk):
        raise RuntimeError("hook failed")

    stats.rows_hook = broken
    with pytest.raises(RuntimeError, match="hook failed"):
        attention_statistics(q, k, v, q, q, stats)
    assert stats.rows.tolist() == [20, 20], "the statistics were added before the hook ran"


def test_a_forward_without_backward_adds_no_max_logit():
    """As the reference: the kernel's forward writes the call's own max logit, folded into the
    statistics when the call's backward runs."""
    q, k, v = (t.requires_grad_(True) for t in random_qkv(1, 2, 33, 32, seed=3))
    stats = AttentionStats(2)
    before = stats.max_logit.clone()
    flash_attention((q.float() * 40).bfloat16(), k, v, stats=stats)  # never differentiated
    assert torch.equal(stats.max_logit, before)
    out = flash_attention(q, k, v, stats=stats)
    assert torch.equal(stats.max_logit, before)
    out.backward(torch.ones_like(out))
    ref = AttentionStats(2)
    reference.flash_attention(q.detach().double().requires_grad_(True), k.double(), v.double(), stats=ref).sum().backward()
    torch.testing.assert_close(stats.max_logit, ref.max_logit, rtol=1e-5, atol=1e-5)


def test_every_entry_point_launches_under_its_inputs_device(interpret_dispatch, monkeypatch):
    """Triton launches on the current device, which need not be the inputs' (a model on cuda:1 with
    cuda:0 current): the own kernel's forward and backward (``triton_attn._forward`` / ``_backward``,
    reached through ``flash_attention`` and through the compiled-path operators) and the statistics
    pass each run inside ``on_device(q)``. (The two-GPU test in test_triton_gpu.py checks what the
    guard does.)"""
    from flashwatch.kernels import ops

    triton_attn = interpret_dispatch
    guarded = []

    def recording(t):
        guarded.append(t.shape)
        return contextlib.nullcontext()

    monkeypatch.setattr(triton_attn, "on_device", recording)
    q, k, v = random_qkv(1, 2, 20, 16, seed=3)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    do = torch.randn_like(q)
    out = flash_attention(q, k, v, stats=AttentionStats(2))
    assert guarded == [q.shape]  # the forward
    out.backward(do)
    assert guarded == [q.shape, q.shape]  # and the backward
    guarded.clear()
    attention_statistics(q.detach(), k.detach(), v.detach(), out.detach(), do, AttentionStats(2))
    assert guarded == [q.shape]
    guarded.clear()
    flag = torch.ones((), dtype=torch.int32)
    out = ops.attention(q, k, v, flag=flag, stats=AttentionStats(2), coverage=torch.zeros(2, dtype=torch.int64),
                        causal=True, variant="plain")
    out.backward(do)
    assert guarded == [q.shape, q.shape]  # the operators' forward and backward
