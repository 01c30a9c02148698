"""torch.compile on CUDA: both modes compile (Triton kernels inside custom operators), report
the eager run's values and compile once. Skipped without CUDA.

    python -m pytest -q tests/test_compile_gpu.py
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from flashwatch import Monitor, MonitorConfig
from flashwatch.kernels import STAT_FIELDS
from flashwatch.tinygpt import GPT, GPTConfig

pytestmark = pytest.mark.gpu  # skipped without CUDA (conftest); `pytest -m gpu` selects it

MODES = ("observe", "own_kernel")
COMPILE_MODES = ("default", "max-autotune-no-cudagraphs")


class _Checkpointed(torch.nn.Module):
    """A block run under activation checkpointing (its forward runs again in the backward)."""

    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        return checkpoint(self.block, x, use_reentrant=False)


def _run(mode: str, compile_mode: str | None, steps: int = 4, checkpointed: bool = False, per_block: bool = False):
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=4, n_head=4, n_embd=256, block_size=256)).cuda()
    if checkpointed:
        model.transformer.h = torch.nn.ModuleList(_Checkpointed(b) for b in model.transformer.h)
    monitor = Monitor(MonitorConfig(interval=2, mode=mode, async_transfer=False))
    monitor.attach(model)
    run = model if compile_mode is None or per_block else torch.compile(
        model, mode=None if compile_mode == "default" else compile_mode)
    if per_block:  # each block compiled on its own, as torchtitan does
        for i, block in enumerate(model.transformer.h):
            model.transformer.h[i] = torch.compile(block)
    g = torch.Generator(device="cuda").manual_seed(1)
    seen = []
    for _ in range(steps):
        x = torch.randint(0, 256, (4, 256), device="cuda", generator=g)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            _, loss = run(x, x)
        loss.backward()
        seen.append({"monitored": monitor.monitoring,
                     "stats": [layer.stats.as_dict() for layer in monitor.layers],
                     "coverage": [layer.coverage.tolist() for layer in monitor.layers]})
        model.zero_grad(set_to_none=True)
        monitor.step(loss=loss.detach())
        if seen[-1]["monitored"]:  # the W^Q-error chain's readings of that step
            snap = monitor.snapshot()
            seen[-1]["chain"] = {name: dict(snap[name]) for name in ("flashwatch_wq_error_push",
                                                                     "flashwatch_wq_error_push_share")}
    monitor.detach()
    monitor.close()
    return seen


@pytest.mark.parametrize("compile_mode", COMPILE_MODES)
@pytest.mark.parametrize("mode", MODES)
def test_compiled_on_cuda_measures_every_layer_once_compiled(mode, compile_mode):
    eager = _run(mode, None)
    torch._dynamo.reset()
    counters.clear()
    with torch._dynamo.config.patch(error_on_recompile=True):
        compiled = _run(mode, compile_mode)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1
    _assert_measured_as_eager(eager, compiled)


@pytest.mark.parametrize("mode", MODES)
def test_reduce_overhead_measures_every_monitored_step(mode):
    """CUDA graphs (``mode="reduce-overhead"``): whether Inductor records them with the Monitor's
    operators inside (they read a CPU flag, so a replayed graph could not tell monitored steps
    from others), every monitored step must still be measured as in eager mode and no other
    step counted. What Inductor did is printed (``-s``): its CUDA-graph skips, if any."""
    eager = _run(mode, None, steps=8)
    torch._dynamo.reset()
    counters.clear()
    compiled = _run(mode, "reduce-overhead", steps=8)
    print(f"reduce-overhead, {mode}: inductor counters {dict(counters['inductor'])}")
    _assert_measured_as_eager(eager, compiled)


@pytest.mark.parametrize("mode", MODES)
def test_a_checkpointed_model_compiles_to_one_graph_measured_as_eager(mode):
    """Activation checkpointing under torch.compile on CUDA: one graph, no break, every monitored
    step measured as in the eager run without checkpointing."""
    eager = _run(mode, None)
    torch._dynamo.reset()
    counters.clear()
    with torch._dynamo.config.patch(error_on_recompile=True):
        compiled = _run(mode, "default", checkpointed=True)
    assert not counters["graph_break"] and not counters["unimplemented"], dict(counters["unimplemented"])
    assert counters["stats"]["unique_graphs"] == 1
    _assert_measured_as_eager(eager, compiled)


@pytest.mark.parametrize("mode", MODES)
def test_a_model_compiled_block_by_block_compiles_once_on_cuda(mode):
    """Each block compiled apart: one compilation serves the four blocks, every monitored step
    measured as in eager mode."""
    eager = _run(mode, None)
    torch._dynamo.reset()
    counters.clear()
    compiled = _run(mode, "default", per_block=True)
    assert not counters["graph_break"] and counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    _assert_measured_as_eager(eager, compiled)


def _assert_measured_as_eager(eager, compiled):
    for step, (e, c) in enumerate(zip(eager, compiled)):
        for layer, (se, sc) in enumerate(zip(e["stats"], c["stats"])):
            if not c["monitored"]:
                assert sc["rows"] == [0.0] * 4, (step, layer)
                continue
            assert sc["rows"] == se["rows"] == [4.0 * 256] * 4, (step, layer)
            # Inductor fuses the layer norms, GELU and residual adds: q, k, v and dO differ from
            # the eager ones in the last BF16 place at some elements, which moves max logits by
            # about one BF16 unit (2**-8 relative), flips the odd near-tie and changes the delta
            # error sums at their own scale. Counts within 2% of the rows, max logit within 2%.
            for name in ("repeated_max_rows", "repeated_max_rows_bf16"):
                for a, b in zip(se[name], sc[name]):
                    assert abs(a - b) <= 0.02 * 1024, (step, layer, name, se[name], sc[name])
            torch.testing.assert_close(torch.tensor(sc["max_logit"]), torch.tensor(se["max_logit"]), rtol=2e-2, atol=0)
            assert all(v == v for name in STAT_FIELDS for v in sc[name])  # finite or -inf, no NaN
        expected = [[1, 1]] * 4 if c["monitored"] else [[0, 0]] * 4
        assert c["coverage"] == expected, (step, c["coverage"])
        if c["monitored"]:  # the W^Q-gradient error is measured in compiled code (the kernels' epilogue)
            for name, readings in c["chain"].items():
                assert len(readings) == 16 and all(v == v for v in readings.values()), (step, name, readings)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_observe_mode_leaves_every_gradient_as_without_the_monitor(compiled):
    """Observe mode changes nothing of training on CUDA, eager or compiled: every parameter's gradient at
    monitored and unmonitored steps equals, bit for bit, that of the same model run without a Monitor
    (the CPU test's check where SDPA is FlashAttention and Inductor generates Triton). Both run under
    torch's deterministic algorithms, and two runs without a Monitor are first checked to agree bit
    for bit: without that, FlashAttention's atomically added dQ makes any two runs differ."""
    from training_cases import first_difference, gradients

    config = GPTConfig(n_layer=4, n_head=4, n_embd=256, block_size=256)
    backend = "inductor" if compiled else None
    plain = gradients(config, "cuda", monitored=False, compile_backend=backend, batch=4)
    again = first_difference(plain, gradients(config, "cuda", monitored=False, compile_backend=backend, batch=4))
    assert again is None, f"two runs without a Monitor differ: {again}"
    observed = gradients(config, "cuda", monitored=True, compile_backend=backend, batch=4)
    difference = first_difference(plain, observed)
    assert difference is None, difference
