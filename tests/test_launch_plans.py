"""kernels.launch plans: a call's launches replayed with the next call's tensors.

CPU: with a stand-in compiled kernel (``toy``), a plan passes each launch what the cached launch
would, and declines (launching nothing) where the launch path changed; with the four flashwatch
kernels ending in stand-ins (``benchmarks/launch_overhead.stand_in_kernels``), a repeated
unmonitored call replays its plan, and each replayed launch gets the arguments the launchers
themselves build for that call. GPU: the outputs of replayed calls are bit-identical to the ordinary
launch's (tests/test_launch_cache.py, whose repeated calls replay plans).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton")

from flashwatch.kernels import launch  # noqa: E402
from test_launch_cache import _aligned, _Driver, toy  # noqa: E402,F401  (the fixture)

ROOT = Path(__file__).resolve().parents[1]


def _recorded(kernel, args, kwargs, grid=(3, 2)):
    with launch.recording() as records:
        launch.launch(kernel, grid, args, kwargs)
    return records


def test_plan_passes_what_a_cached_launch_passes(toy):  # noqa: F811
    kernel, ordinary, fast = toy
    x, y = _aligned(), _aligned()
    kwargs = {"BLOCK": 16, "num_warps": 4}
    records = _recorded(kernel, (x, y, 64, 0.5), kwargs)
    plan = launch.make_plan(records, (x, y))
    assert plan is not None and len(ordinary) == 1
    x2, y2 = _aligned(), _aligned()
    before = launch.counts["cached"]
    assert plan.run((x2, y2))
    launch.launch(kernel, (3, 2), (x2, y2, 64, 0.5), kwargs)  # the cached launch of the same call
    assert len(ordinary) == 1 and launch.counts["cached"] == before + 2
    assert fast[0] == fast[1]
    assert fast[0][1][9:11] == (x2, y2)  # the new tensors, in their slots


def test_plan_fills_repeated_slots_and_keeps_scalars(toy):  # noqa: F811
    kernel, ordinary, fast = toy
    x = _aligned()
    records = _recorded(kernel, (x, x, 48, 2.0), {"BLOCK": 16})
    plan = launch.make_plan(records, (x,))
    x2 = _aligned()
    assert plan.run((x2,))
    assert fast[0][1][9:13] == (x2, x2, 48, 2.0)


@pytest.mark.parametrize("change", ["switch_off", "hook", "debug", "device"])
def test_plan_declines_and_launches_nothing_when_the_launch_path_changed(toy, monkeypatch, change):  # noqa: F811
    from triton import knobs

    kernel, ordinary, fast = toy
    x, y = _aligned(), _aligned()
    plan = launch.make_plan(_recorded(kernel, (x, y, 64, 0.5), {"BLOCK": 16}), (x, y))
    hook = lambda metadata: None  # noqa: E731
    if change == "switch_off":
        monkeypatch.setattr(launch, "FAST_LAUNCH", False)
    elif change == "hook":
        knobs.runtime.launch_enter_hook.add(hook)
    elif change == "debug":
        monkeypatch.setattr(knobs.runtime, "debug", not knobs.runtime.debug)
    else:
        class _Other(_Driver):
            class active(_Driver.active):
                @staticmethod
                def get_current_device():
                    return 1
        monkeypatch.setattr(launch, "driver", _Other)
    try:
        assert not plan.run((x, y))
    finally:
        if change == "hook":
            knobs.runtime.launch_enter_hook.remove(hook)
    assert not fast and len(ordinary) == 1


def test_no_plan_where_one_could_not_stand_for_the_call(toy, monkeypatch):  # noqa: F811
    kernel, ordinary, fast = toy
    x, y, other = _aligned(), _aligned(), _aligned()
    records = _recorded(kernel, (x, y, 64, 0.5), {"BLOCK": 16})
    assert launch.make_plan(records, (x,)) is None  # y is not one of the call's tensors
    assert launch.make_plan(records, (x, y, x)) is None  # an object twice: its slot would be ambiguous
    assert launch.make_plan([], (x, y)) is None
    assert launch.make_plan(_recorded(kernel, (x, 64, y, 0.5), {"BLOCK": 16}), (x, y)) is None  # tensor after a scalar
    monkeypatch.setattr(launch, "FAST_LAUNCH", False)  # an ordinary launch: nothing kept to replay
    assert launch.make_plan(_recorded(kernel, (x, other, 64, 0.5), {"BLOCK": 16}), (x, other)) is None


def test_recording_is_per_thread_and_ends_with_its_block(toy):  # noqa: F811
    import threading

    kernel, ordinary, fast = toy
    x, y = _aligned(), _aligned()
    with launch.recording() as records:
        worker = threading.Thread(target=launch.launch, args=(kernel, (1,), (x, y, 64, 0.5), {"BLOCK": 16}))
        worker.start()
        worker.join()
        assert records == []  # another thread's launch
        launch.launch(kernel, (1,), (x, y, 64, 0.5), {"BLOCK": 16})
    launch.launch(kernel, (1,), (x, y, 64, 0.5), {"BLOCK": 16})
    assert len(records) == 1


def test_clear_cache_forgets_plans(toy):  # noqa: F811
    kernel, ordinary, fast = toy
    x, y = _aligned(), _aligned()
    launch.keep_plan(("key",), launch.make_plan(_recorded(kernel, (x, y, 64, 0.5), {"BLOCK": 16}), (x, y)))
    assert launch.plan(("key",)) is not None
    launch.clear_cache()
    assert launch.plan(("key",)) is None


# --- the flashwatch kernels' calls, launches ending in stand-ins ----------------------------------------

@pytest.fixture
def stand_ins(monkeypatch):
    """The four kernels as compiled-mode copies whose compiled kernel records each run's arguments."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import launch_overhead
    finally:
        sys.path.pop(0)
    if not triton.__version__.startswith("3.6."):
        pytest.skip("the cached launch mirrors Triton 3.6")
    runs = []
    make = launch_overhead._stand_in_compiled

    def recording_stand_in():
        c = make()
        c._run = lambda *args: runs.append(args)
        return c

    monkeypatch.setattr(launch_overhead, "_stand_in_compiled", recording_stand_in)
    monkeypatch.setattr(launch, "FAST_LAUNCH", True)
    with launch_overhead.stand_in_kernels():
        yield runs


def _call(shape, variant="plain", causal=True, dtype=torch.bfloat16, seed=0, stats=None):
    """One forward and backward through the Triton launchers: (q, k, v, do, o, lse, dq, dk, dv)."""
    from flashwatch.kernels import triton_attn

    gen = torch.Generator().manual_seed(seed)
    B, H, N, D = shape
    q, k, v = (torch.randn(shape, generator=gen, dtype=dtype) for _ in range(3))
    do = torch.randn((B, N, H, D), generator=gen, dtype=dtype).transpose(1, 2)
    o, lse, r, rowmax = triton_attn._forward(q, k, v, causal, 0.125, variant, 2.0, 1e-3, stats, 0.0)
    dq, dk, dv = triton_attn._backward(do, q, k, v, o, lse, r, rowmax, causal, 0.125, 1e-3, stats)
    return q, k, v, do, o, lse, dq, dk, dv


def _kernel_args(run):
    """A stand-in run's kernel arguments: after grid (3), stream, function, metadata, launch metadata and hooks."""
    return run[9:]


def _same_launch(a, b, same_objects):
    """Two runs' arguments alike: each tensor by identity where it is one of ``same_objects`` (the call's
    inputs), else by layout (outputs, allocated per call); everything else equal."""
    assert len(a) == len(b)
    for x, y in zip(a, b):
        if isinstance(x, torch.Tensor):
            assert isinstance(y, torch.Tensor)
            if any(x is s for s in same_objects):
                assert y is x
            else:
                assert (x.shape, x.stride(), x.dtype) == (y.shape, y.stride(), y.dtype)
        else:
            assert x == y and type(x) is type(y)


@pytest.mark.parametrize("variant, causal", [("plain", True), ("fp32_delta", False), ("fixed", True)])
def test_repeated_call_replays_the_launches_its_launchers_build(stand_ins, variant, causal):
    runs = stand_ins
    shape = (2, 3, 40, 16)
    _call(shape, variant, causal)  # makes the plans
    before = dict(launch.counts)
    count = len(runs)
    replayed = _call(shape, variant, causal, seed=1)
    assert launch.counts["ordinary"] == before["ordinary"] and launch.counts["cached"] == before["cached"] + 3
    planned = [_kernel_args(r) for r in runs[count:]]
    q, k, v, do, o, lse, dq, dk, dv = replayed
    # the outputs the kernels were given are the ones the call returned
    assert planned[0][3] is o and planned[0][4] is lse
    assert any(a is dq for a in planned[1]) and planned[2][6] is dk and planned[2][7] is dv
    # the same call through the launchers themselves (plans forgotten), on the same inputs
    launch.clear_cache()
    count = len(runs)
    from flashwatch.kernels import triton_attn

    o2, lse2, r2, rowmax2 = triton_attn._forward(q, k, v, causal, 0.125, variant, 2.0, 1e-3, None, 0.0)
    triton_attn._backward(do, q, k, v, o2, lse2, r2, rowmax2, causal, 0.125, 1e-3, None)
    built = [_kernel_args(r) for r in runs[count:]]
    assert len(built) == len(planned) == 3
    for a, b in zip(planned, built):
        _same_launch(a, b, (q, k, v, do))


@pytest.mark.parametrize("change", ["shape", "variant", "causal", "dtype", "misaligned"])
def test_a_call_unlike_the_planned_one_is_not_replayed(stand_ins, change):
    from flashwatch.kernels import triton_attn

    shape = (2, 3, 40, 16)
    _call(shape)
    kwargs = {"shape": (2, 3, 56, 16)} if change == "shape" else {"variant": "fixed"} if change == "variant" \
        else {"causal": False} if change == "causal" else {"dtype": torch.float16} if change == "dtype" else {}
    keys_before = set(launch._plans)
    if change == "misaligned":  # the same layout, 2 bytes off 16-byte alignment
        gen = torch.Generator().manual_seed(1)
        q, k, v = (torch.randn(2 * 3 * 40 * 16 + 1, generator=gen, dtype=torch.bfloat16)[1:].view(shape)
                   for _ in range(3))
        assert q.data_ptr() % 16 != 0
        triton_attn._forward(q, k, v, True, 0.125, "plain", 2.0, 1e-3, None, 0.0)
    else:
        _call(kwargs.pop("shape", shape), **kwargs)
    assert len(set(launch._plans) - keys_before) >= 1  # a plan of its own, not the first one's


def test_calls_with_statistics_are_not_planned(stand_ins):
    from flashwatch.kernels import AttentionStats

    shape = (2, 3, 40, 16)
    _call(shape, stats=AttentionStats(3, torch.device("cpu")))
    assert not launch._plans
    before = launch.counts["cached"]
    _call(shape, stats=AttentionStats(3, torch.device("cpu")))
    assert launch.counts["cached"] == before + 3  # cached launches, through the launchers


def test_tuning_override_means_no_plan(stand_ins):
    from flashwatch.kernels import tuning

    shape = (2, 3, 40, 16)
    tuning.set_override("fwd", dict(tuning.INTERPRETER["fwd"]))
    try:
        _call(shape)
        assert not any(key[0] == "fwd" for key in launch._plans)
    finally:
        tuning.set_override("fwd", None)
