"""kernels.launch: the cached launch of compiled Triton kernels.

CPU: the specialisation key against Triton's own specialisation of the same arguments, the
dispatch logic (first call ordinary, repeats cached, a new specialisation ordinary again, hooks
or the switch off: ordinary) with a stand-in compiled kernel, and the interpreter path.
GPU (marked ``gpu``): cached launches give the same outputs and statistics as ordinary ones.
"""

from __future__ import annotations

import os

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from triton.backends import BaseBackend  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from flashwatch.kernels import launch  # noqa: E402
from switch_cases import read_at_import  # noqa: E402


def _triton_spec(value):
    """Triton's own specialisation of one argument (type, attribute), as its binder computes it."""
    from triton._C.libtriton import native_specialize_impl

    # its first call imports triton's gluon package, which accepts the interpreted
    # triton.language of these CPU tests only while TRITON_INTERPRET=1 (tests/conftest.py)
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1" if not torch.cuda.is_available() else (old or "0")
    try:
        return native_specialize_impl(BaseBackend, value, False, True, True)
    finally:
        if old is None:
            os.environ.pop("TRITON_INTERPRET")
        else:
            os.environ["TRITON_INTERPRET"] = old


def _aligned(dtype=torch.bfloat16):
    return torch.empty(64, dtype=dtype)


def _misaligned(dtype=torch.bfloat16):
    t = torch.empty(65, dtype=dtype)[1:]  # a sliced view: data_ptr off by one element
    assert t.data_ptr() % 16 != 0
    return t


INTS = [0, 1, 2, 15, 16, 17, 32, 48, 64, 4096, -1, -16, -17, 2 ** 31 - 16, 2 ** 31 - 1, 2 ** 31, 2 ** 31 + 16,
        -2 ** 31, -2 ** 31 - 1, -2 ** 31 - 16, 2 ** 63 - 16, 2 ** 63, 2 ** 63 + 1, 2 ** 64 - 16]


def _values():
    return (INTS + [0.0, 1.0, 0.125, -2.5, True, False, None]
            + [f(dt) for f in (_aligned, _misaligned) for dt in (torch.bfloat16, torch.float16, torch.float32)]
            + [_aligned(torch.int64), torch.empty(8, dtype=torch.int64)[1:]])


def test_key_of_one_argument_matches_triton_specialisation_exactly():
    """Equal keys <=> equal Triton specialisations, over every pair of the hand-made values:
    a cached launch never runs another specialisation, and the cache is no finer than needed."""
    values = _values()
    keys = [launch.specialization_key((v,)) for v in values]
    specs = [_triton_spec(v) for v in values]
    for i in range(len(values)):
        for j in range(len(values)):
            assert (keys[i] == keys[j]) == (specs[i] == specs[j]), (values[i], values[j], keys[i], specs[i], specs[j])


@pytest.mark.parametrize("a, b", [(1, 2), (1, 17), (16, 17), (32, 33), (2 ** 31 - 16, 2 ** 31), (2 ** 63 - 16, 2 ** 63),
                                  (-2 ** 31, -2 ** 31 - 16)])
def test_ints_differing_in_one_or_multiple_of_16_or_width_get_different_keys(a, b):
    args = (_aligned(), 64, 4096)
    assert launch.specialization_key(args + (a,)) != launch.specialization_key(args + (b,))
    assert _triton_spec(a) != _triton_spec(b)


def test_ints_of_one_class_share_a_key():
    assert launch.specialization_key((16, 17)) == launch.specialization_key((4096, 33))


def test_tensor_alignment_and_dtype_change_the_key():
    aligned, view = _aligned(), _misaligned()
    assert launch.specialization_key((aligned, 16)) != launch.specialization_key((view, 16))
    assert launch.specialization_key((aligned,)) != launch.specialization_key((_aligned(torch.float16),))
    assert launch.specialization_key((aligned,)) == launch.specialization_key((_aligned(),))  # another buffer


def test_unsupported_argument_type_is_refused():
    with pytest.raises(launch.UnsupportedArgument):
        launch.specialization_key((_aligned(), object()))


def _fresh_jit(pyfn):
    return JITFunction(pyfn)


def _kernels():
    from flashwatch.kernels import triton_kernels

    return [triton_kernels._attn_fwd_kernel, triton_kernels._attn_bwd_dq_kernel, triton_kernels._attn_bwd_dkdv_kernel,
            triton_kernels._attn_stats_kernel]


@pytest.mark.parametrize("index", range(4))
def test_flashwatch_kernels_are_eligible_when_compiled_and_not_when_interpreted(index):
    kernel = _kernels()[index]
    compiled = _fresh_jit(kernel.fn)  # the same Python function, jitted for the GPU
    assert launch._kernel_eligible(compiled) == triton.__version__.startswith("3.6.")
    interpreted = type("InterpretedFunction", (), {})()
    assert not launch._kernel_eligible(interpreted)


def test_kernel_with_unspecialised_parameter_is_not_eligible():
    from flashwatch.kernels import triton_kernels

    fn = triton_kernels._attn_stats_kernel.fn
    assert not launch._kernel_eligible(JITFunction(fn, do_not_specialize=["N"]))
    assert not launch._kernel_eligible(JITFunction(fn, do_not_specialize_on_alignment=["Q"]))


def test_cuda_backend_specialises_like_the_base_backend():
    """The key mirrors BaseBackend's rules; the CUDA backend must not override them."""
    nvidia = pytest.importorskip("triton.backends.nvidia.compiler")
    for name in ("get_int_specialization", "get_tensor_specialization"):
        assert getattr(nvidia.CUDABackend, name) is getattr(BaseBackend, name)


# --- dispatch, with a stand-in compiled kernel -----------------------------------------------------

def _toy(X, Y, n, scale, BLOCK: tl.constexpr, FLAG: tl.constexpr = False):
    pass


class _Driver:
    class active:
        @staticmethod
        def get_current_device():
            return 0

        @staticmethod
        def get_current_stream(device):
            return 1234


@pytest.fixture
def toy(monkeypatch):
    """A JITFunction whose ordinary launch returns a stand-in CompiledKernel recording its runs."""
    from triton.compiler import CompiledKernel

    if not triton.__version__.startswith("3.6."):
        pytest.skip("the cached launch mirrors Triton 3.6")
    kernel = JITFunction(_toy)
    ordinary, fast = [], []
    compiled_by_spec = {}

    def run(*args, grid, warmup, **kwargs):
        ordinary.append((grid, args, kwargs))
        spec = launch.specialization_key(args) + (tuple(kwargs.items()),)
        if spec not in compiled_by_spec:
            c = CompiledKernel.__new__(CompiledKernel)
            c.function, c.packed_metadata = f"function{len(compiled_by_spec)}", "meta"
            c._run = lambda *a, _c=c: fast.append((_c.function, a))
            compiled_by_spec[spec] = c
        return compiled_by_spec[spec]

    kernel.run = run
    monkeypatch.setattr(launch, "driver", _Driver)
    monkeypatch.setattr(launch, "FAST_LAUNCH", True)
    launch.clear_cache()
    yield kernel, ordinary, fast
    launch.clear_cache()


def test_repeat_is_cached_and_passes_every_argument_in_parameter_order(toy):
    kernel, ordinary, fast = toy
    x, y = _aligned(), _aligned()
    launch.launch(kernel, (3, 2), (x, y, 64, 0.5), {"BLOCK": 16, "num_warps": 4})
    assert len(ordinary) == 1 and not fast
    launch.launch(kernel, (3, 2), (x, y, 80, 0.25), {"BLOCK": 16, "num_warps": 4})  # same classes of ints
    assert len(ordinary) == 1
    function, a = fast[0]
    assert function == "function0"
    # grid (3, 2, 1), stream, function, metadata, no launch metadata or hooks, args, constexprs
    assert a == (3, 2, 1, 1234, "function0", "meta", None, None, None, x, y, 80, 0.25, 16, False)


@pytest.mark.parametrize("change", ["misaligned", "one", "multiple_of_16", "dtype", "constexpr", "option", "bool"])
def test_a_new_specialisation_goes_through_the_ordinary_launch(toy, change):
    kernel, ordinary, fast = toy
    x, y = _aligned(), _aligned()
    base = ((x, y, 64, 0.5), {"BLOCK": 16, "num_warps": 4})
    launch.launch(kernel, (1,), *base)
    args, kwargs = list(base[0]), dict(base[1])
    if change == "misaligned":
        args[1] = _misaligned()
    elif change == "one":
        args[2] = 1
    elif change == "multiple_of_16":
        args[2] = 65
    elif change == "dtype":
        args[0] = _aligned(torch.float16)
    elif change == "constexpr":
        kwargs["BLOCK"] = 32
    elif change == "option":
        kwargs["num_warps"] = 8
    elif change == "bool":
        kwargs["FLAG"] = True
    launch.launch(kernel, (1,), tuple(args), kwargs)
    assert len(ordinary) == 2 and not fast
    launch.launch(kernel, (1,), tuple(args), kwargs)  # and that one is kept too
    assert len(ordinary) == 2 and fast[0][0] == "function1"


def test_attached_launch_hook_or_switch_off_means_ordinary_launch(toy, monkeypatch):
    from triton import knobs

    kernel, ordinary, fast = toy
    args, kwargs = (_aligned(), _aligned(), 64, 0.5), {"BLOCK": 16}
    launch.launch(kernel, (1,), args, kwargs)
    hook = lambda metadata: None  # noqa: E731
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        launch.launch(kernel, (1,), args, kwargs)
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert len(ordinary) == 2 and not fast
    monkeypatch.setattr(launch, "FAST_LAUNCH", False)
    launch.launch(kernel, (1,), args, kwargs)
    assert len(ordinary) == 3 and not fast
    monkeypatch.setattr(launch, "FAST_LAUNCH", True)
    launch.launch(kernel, (1,), args, kwargs)
    assert len(ordinary) == 3 and len(fast) == 1


def test_debug_knob_is_part_of_the_key(toy, monkeypatch):
    from triton import knobs

    kernel, ordinary, fast = toy
    args, kwargs = (_aligned(), _aligned(), 64, 0.5), {"BLOCK": 16}
    launch.launch(kernel, (1,), args, kwargs)
    monkeypatch.setattr(knobs.runtime, "debug", not knobs.runtime.debug)
    launch.launch(kernel, (1,), args, kwargs)
    assert len(ordinary) == 2 and not fast


# --- the interpreter ----------------------------------------------------------------------------------

def test_interpreter_launches_are_ordinary_and_match_the_reference(interpret_dispatch):
    from flashwatch.kernels import flash_attention, reference

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 24, 16, dtype=torch.float32, requires_grad=True) for _ in range(3))
    before = dict(launch.counts)
    out = flash_attention(q, k, v, causal=True)
    out.backward(torch.ones_like(out))
    assert launch.counts["ordinary"] == before["ordinary"] + 3  # forward, dQ, dK/dV
    assert launch.counts["cached"] == before["cached"]
    qr, kr, vr = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref, _, _ = reference.forward(qr, kr, vr, True, 0.25, "plain", 2.0, 1e-3, None, 0.0)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


# --- GPU: cached launches against ordinary ones ------------------------------------------------------

def _run(q, k, v, g, variant, causal, with_stats):
    from flashwatch.kernels import AttentionStats, flash_attention

    qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))  # same memory: a misaligned view stays one
    stats = AttentionStats(q.shape[1], q.device) if with_stats else None
    out = flash_attention(qq, kk, vv, causal=causal, variant=variant, stats=stats)
    out.backward(g)
    return out.detach(), qq.grad, kk.grad, vv.grad, stats


def _same(a, b):
    for x, y in zip(a[:4], b[:4]):
        assert torch.equal(x, y)  # the backward is bitwise deterministic (no atomics on gradients)
    if a[4] is not None:
        sa, sb = a[4].as_dict(), b[4].as_dict()
        for name in ("rows", "repeated_max_rows", "repeated_max_rows_bf16", "repeated_max_rows_format", "max_logit"):
            assert sa[name] == sb[name], name  # integer counts and an atomic max: order-free
        for name in ("delta_error", "delta_error_abs", "delta_error_sq", "delta_error_tied"):
            # float atomic adds: their summation order varies from run to run on either path
            torch.testing.assert_close(torch.tensor(sa[name]), torch.tensor(sb[name]), rtol=1e-5, atol=1e-9)


def _inputs(shape, dtype, offset=0, hkv=None):
    B, H, N, D = shape
    torch.manual_seed(1)
    make = lambda heads: torch.randn(B * heads * N * D + offset, device="cuda", dtype=dtype)[offset:].view(  # noqa: E731
        B, heads, N, D)
    return make(H), make(hkv or H), make(hkv or H), torch.randn(B, H, N, D, device="cuda", dtype=dtype)


GPU_CASES = [((2, 4, 128, 64), torch.bfloat16, "plain", True, False, None),
             ((2, 4, 128, 64), torch.bfloat16, "plain", True, True, None),
             ((1, 4, 97, 64), torch.bfloat16, "fixed", True, True, 2),
             ((1, 2, 200, 128), torch.float16, "fp32_delta", False, True, None),
             ((1, 2, 64, 64), torch.float32, "plain", True, True, None)]


@pytest.mark.gpu
@pytest.mark.parametrize("shape, dtype, variant, causal, with_stats, hkv", GPU_CASES)
def test_cached_launch_is_bit_identical_to_ordinary(monkeypatch, shape, dtype, variant, causal, with_stats, hkv):
    q, k, v, g = _inputs(shape, dtype, hkv=hkv)
    monkeypatch.setattr(launch, "FAST_LAUNCH", False)
    ordinary = _run(q, k, v, g, variant, causal, with_stats)
    monkeypatch.setattr(launch, "FAST_LAUNCH", True)
    launch.clear_cache()
    first = _run(q, k, v, g, variant, causal, with_stats)  # ordinary launches, kept
    before = launch.counts["cached"]
    cached = _run(q, k, v, g, variant, causal, with_stats)
    assert launch.counts["cached"] == before + 3  # forward, dQ, dK/dV all cached
    _same(ordinary, first)
    _same(ordinary, cached)


@pytest.mark.gpu
def test_misaligned_view_after_aligned_call_gets_its_own_kernel(monkeypatch):
    monkeypatch.setattr(launch, "FAST_LAUNCH", True)
    launch.clear_cache()
    shape = (1, 2, 96, 64)
    q, k, v, g = _inputs(shape, torch.bfloat16)
    _run(q, k, v, g, "plain", True, True)
    _run(q, k, v, g, "plain", True, True)  # cached now
    qm, km, vm, _ = _inputs(shape, torch.bfloat16, offset=1)  # same values' layout, 2-byte offset
    qm.copy_(q), km.copy_(k), vm.copy_(v)
    assert qm.data_ptr() % 16 != 0
    before = dict(launch.counts)
    fast = _run(qm, km, vm, g, "plain", True, True)
    assert launch.counts["ordinary"] > before["ordinary"]  # a new specialisation: compiled for it
    monkeypatch.setattr(launch, "FAST_LAUNCH", False)
    _same(_run(qm, km, vm, g, "plain", True, True), fast)
    # and close to the aligned call's results (another compilation, with other loads: not held bitwise)
    for a, b in zip(_run(q, k, v, g, "plain", True, True)[:4], fast[:4]):
        torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-2)  # a few BF16 ulps


@pytest.mark.gpu
def test_second_shape_after_first_is_correct(monkeypatch):
    """N = 80 has the specialisation of N = 64 (multiples of 16 everywhere): its launches reuse
    the kept kernels; N = 33 does not: ordinary launches. Each against the ordinary path."""
    launch.clear_cache()
    for shape, cached_launches in (((1, 2, 64, 64), 0), ((1, 2, 80, 64), 3), ((2, 3, 33, 64), 0),
                                   ((1, 2, 64, 64), 3)):
        q, k, v, g = _inputs(shape, torch.bfloat16)
        monkeypatch.setattr(launch, "FAST_LAUNCH", True)
        before = launch.counts["cached"]
        fast = _run(q, k, v, g, "plain", True, True)
        assert launch.counts["cached"] - before == cached_launches, shape
        monkeypatch.setattr(launch, "FAST_LAUNCH", False)
        _same(_run(q, k, v, g, "plain", True, True), fast)


@pytest.mark.gpu
def test_observe_statistics_pass_cached_matches_ordinary(monkeypatch):
    from flashwatch.kernels import AttentionStats, attention_statistics

    q, k, v, g = _inputs((1, 4, 100, 64), torch.bfloat16)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    results = []
    for fast in (False, True, True):
        monkeypatch.setattr(launch, "FAST_LAUNCH", fast)
        stats = AttentionStats(4, q.device)
        attention_statistics(q, k, v, out, g, stats, causal=True)
        results.append((out, q, k, v, stats))
    _same(results[0], results[1])
    _same(results[0], results[2])


def test_host_ceil_division_matches_triton_cdiv():
    from flashwatch.kernels.triton_attn import _cdiv

    for a in (1, 15, 16, 17, 63, 64, 65, 1000, 16384):
        for b in (16, 32, 64, 128):
            assert _cdiv(a, b) == triton.cdiv(a, b)


@pytest.mark.parametrize("value, expected", [("0", "False"), ("1", "True"), (None, "True"),
                                             ("on", "FLASHWATCH_FAST_LAUNCH='on': accepted are")])
def test_environment_switch_is_read_at_import(value, expected):
    ok, said = read_at_import("FLASHWATCH_FAST_LAUNCH", value, "launch", "FAST_LAUNCH")
    assert ok == (value != "on") and expected in said, said


@pytest.mark.parametrize("variable", ["FLASHWATCH_FAST_LAUNCH", "FLASHWATCH_KERNEL_REDUCTION", "FLASHWATCH_AUTOTUNE",
                                      "FLASHWATCH_HOPPER_WS_UNVERIFIED"])
def test_a_bad_switch_value_is_refused_when_the_monitor_is_imported(variable):
    """Not at the first attention call, where the kernel path's error would be caught as a monitoring
    error and the run would go on unmeasured. Fail before: the import succeeded."""
    import subprocess
    import sys

    env = dict(os.environ, **{variable: "on"})
    out = subprocess.run([sys.executable, "-c", "from flashwatch import Monitor"], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode != 0 and f"{variable}='on': accepted are 1 (" in out.stderr, out.stderr
    assert "0 (" in out.stderr and "or unset (" in out.stderr, out.stderr  # what each setting does



def test_a_bad_hopper_specification_is_refused_when_the_monitor_is_imported():
    """FLASHWATCH_HOPPER is parsed at each launch; a bad one is refused at import too, not at the
    first attention call of a run. Fail before: the import succeeded."""
    import subprocess
    import sys

    env = dict(os.environ, FLASHWATCH_HOPPER="fwd,wgmma")
    out = subprocess.run([sys.executable, "-c", "from flashwatch import Monitor"], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode != 0 and "FLASHWATCH_HOPPER: unknown 'wgmma'" in out.stderr, out.stderr