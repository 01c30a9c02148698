"""flashwatch_attention_coverage and the attention_coverage rule: a layer whose attention calls
could not be measured reads coverage 0 and raises a warning, never a healthy-looking silence.

Fail before: no coverage metric and no rule existed; a model with attention dropout (Hugging
Face GPT-2's default) showed nothing but per-layer log lines.
"""

from __future__ import annotations

import math

import pytest
import torch

from flashwatch import Monitor, MonitorConfig
from flashwatch.tinygpt import GPT, GPTConfig


def _train(dropout: float, steps: int = 1, compiled: bool = False, mode: str = "observe"):
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, dropout=dropout))
    monitor = Monitor(MonitorConfig(interval=1, mode=mode, async_transfer=False))
    monitor.attach(model)
    run = torch.compile(model, backend="aot_eager") if compiled else model
    alerts = []
    for _ in range(steps):
        x = torch.randint(0, 256, (2, 16))
        _, loss = run(x, x)
        loss.backward()
        model.zero_grad(set_to_none=True)
        alerts += monitor.step(loss=loss.detach())
    monitor.detach()
    monitor.close()
    return monitor, alerts


@pytest.mark.parametrize("mode", ["observe", "own_kernel"])
def test_measured_layers_read_full_coverage(mode):
    monitor, alerts = _train(0.0, mode=mode)
    assert monitor.snapshot()["flashwatch_attention_coverage"] == {(0,): 1.0, (1,): 1.0}
    assert not [a for a in alerts if a.rule == "attention_coverage"]


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("mode", ["observe", "own_kernel"])
def test_attention_dropout_measures_scores_not_delta_error_and_warns(mode, compiled):
    if compiled:
        torch._dynamo.reset()
    monitor, alerts = _train(0.1, compiled=compiled, mode=mode)
    snap = monitor.snapshot()
    assert snap["flashwatch_attention_coverage"] == {(0,): 0.0, (1,): 0.0}
    fired = [a for a in alerts if a.rule == "attention_coverage"]
    assert [(a.layer, a.head, a.step, a.severity) for a in fired] == [(0, -1, 0, "warning"), (1, -1, 0, "warning")]
    assert not [a for a in alerts if a.rule == "non_finite"]
    assert {(a.layer, a.head) for a in monitor.active_alerts} >= {(0, -1), (1, -1)}  # holds while blind
    # the scores are measured (repeated maxima, max logit); the delta error is not: NaN, never a healthy 0
    assert all(math.isnan(v) for v in snap["flashwatch_delta_drift_z"].values())
    assert all(math.isnan(v) for v in snap["flashwatch_delta_error"].values())
    assert all(math.isfinite(v) and v > 0 for v in snap["flashwatch_max_logit"].values())
    assert all(0.0 <= v <= 1.0 for v in snap["flashwatch_repeated_max_ratio"].values())
    assert monitor.signals()["rows"] == {(layer, head): 32.0 for layer in range(2) for head in range(2)}
    # W^Q is read from the weights, whatever the calls: each head's exact spectral norm, not a placeholder
    for layer in monitor.layers:
        exact = torch.linalg.matrix_norm(layer.query_weight().detach().double(), ord=2)
        for head, want in enumerate(exact.tolist()):
            assert snap["flashwatch_wq_spectral_norm"][(layer.index, head)] == pytest.approx(want, rel=1e-4)


def test_coverage_alert_clears_once_a_call_is_measured():
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=16, dropout=0.1))
    monitor = Monitor(MonitorConfig(interval=1, async_transfer=False))
    monitor.attach(model)
    x = torch.randint(0, 256, (2, 16))
    model(x, x)[1].backward()
    assert [a.rule for a in monitor.step()] == ["attention_coverage"]
    model.eval()  # tinygpt passes dropout_p=0 outside training
    for _ in range(12):  # measured steps: the alert's episode ends (after MonitorConfig's clear steps, if any)
        with torch.enable_grad():
            model(x, x)[1].backward()
        monitor.step()
        assert monitor.snapshot()["flashwatch_attention_coverage"] == {(0,): 1.0}
        if not monitor.active_alerts:
            break
    assert not monitor.active_alerts
    monitor.detach()


def test_coverage_reaches_jsonl_console_and_report(tmp_path):
    from flashwatch.exporters.jsonl import JsonlExporter, read_jsonl, validate_record
    from flashwatch.report.load import load_run
    from flashwatch.report.page import to_html

    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, dropout=0.1))
    monitor = Monitor(MonitorConfig(interval=1, async_transfer=False), exporters=[JsonlExporter(tmp_path)])
    monitor.attach(model)
    for _ in range(2):
        x = torch.randint(0, 256, (2, 16))
        model(x, x)[1].backward()
        monitor.step()
    monitor.detach()
    monitor.close()
    records = [r for r in read_jsonl(tmp_path) if r["kind"] == "step"]
    for r in records:
        validate_record(r)
        assert r["metrics"]["flashwatch_attention_coverage"] == [{"layer": 0, "value": 0.0},
                                                                 {"layer": 1, "value": 0.0}]
    run = load_run(tmp_path)
    assert run.coverage == {0: [0.0, 0.0], 1: [0.0, 0.0]}
    page = to_html(run)
    assert "<h2>Attention coverage</h2>" in page and "2 of 2" in page


def test_console_names_layers_below_full_coverage():
    from flashwatch.exporters.base import StepRecord
    from flashwatch.exporters.console import ConsoleExporter
    from flashwatch.exporters.testing import synthetic_layout, synthetic_snapshot

    snap = synthetic_snapshot(synthetic_layout(2, 2), step=5)
    console = ConsoleExporter("log")
    record = StepRecord(step=5, time=0.0, snapshot=snap, new_alerts=[], active_alerts=[])
    assert "attention coverage" not in console.summary_line(record)
    snap["flashwatch_attention_coverage"] = {(0,): 1.0, (1,): 0.5}
    assert "attention coverage L1 50%" in console.summary_line(record)


def test_console_says_not_measured_where_no_head_was_measured():
    """Heads read NaN (not measured, e.g. under attention dropout): the line says "not measured",
    never "+nan", and leaves NaN heads out of a top list that has measured ones. Fail before:
    "top |drift z| L0H0 +nan, L0H1 +nan" and "max W^Q-error coherence nan (L0H0)"."""
    from flashwatch.exporters.base import StepRecord
    from flashwatch.exporters.console import ConsoleExporter
    from flashwatch.exporters.testing import synthetic_layout, synthetic_snapshot

    snap = synthetic_snapshot(synthetic_layout(2, 2), step=5)
    for name in ("flashwatch_delta_drift_z", "flashwatch_wq_error_coherence"):
        snap[name] = {key: math.nan for key in snap[name]}
    record = StepRecord(step=5, time=0.0, snapshot=snap, new_alerts=[], active_alerts=[])
    line = ConsoleExporter("log").summary_line(record)
    assert "nan" not in line.lower().replace("not measured", "")
    assert "drift z not measured" in line and "max W^Q-error coherence not measured" in line
    snap["flashwatch_delta_drift_z"][(1, 0)] = -2.5
    line = ConsoleExporter("log").summary_line(record)
    assert "top |drift z| L1H0 -2.50" in line and "+nan" not in line


def test_a_failing_own_kernel_call_is_not_counted_as_measured(monkeypatch):
    from flashwatch import kernels

    def broken(*args, **kwargs):
        raise RuntimeError("kernel failure")

    monkeypatch.setattr(kernels, "flash_attention", broken)
    monitor, _ = _train(0.0, mode="own_kernel")
    assert monitor.errors >= 1  # logged and counted; training went on with torch SDPA
    assert monitor.snapshot()["flashwatch_attention_coverage"] == {(0,): 0.0, (1,): 0.0}


@pytest.mark.parametrize("compiled", [False, True])
def test_a_fix_variant_whose_calls_fall_back_to_sdpa_is_reported_as_sdpa(compiled, caplog):
    """Own-kernel mode with a fix variant on calls the kernel cannot take (head dim 8): those calls run
    torch SDPA, so the kernel-variant gauge, the step records and ``running_variant`` say "sdpa", not
    the variant that is not running (a dashboard must not show the layer as protected); a layer
    whose calls the kernel takes (head dim 16) reports its variant. Fail before: fp32_delta read 1."""
    import logging

    for embd, expected in ((16, "sdpa"), (32, "fp32_delta")):
        torch.manual_seed(0)
        model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=embd, block_size=16))
        monitor = Monitor(MonitorConfig(interval=1, mode="own_kernel", variant="fp32_delta", async_transfer=False))
        monitor.attach(model)
        run = torch.compile(model, backend="aot_eager") if compiled else model
        with caplog.at_level(logging.WARNING, logger="flashwatch"):
            for _ in range(2):
                x = torch.randint(0, 256, (2, 16))
                _, loss = run(x, x)
                loss.backward()
                model.zero_grad(set_to_none=True)
                monitor.step(loss=loss.detach())
        gauge = monitor.snapshot()["flashwatch_kernel_variant"]
        assert {layer: v for (layer, v), on in gauge.items() if on == 1.0} == {0: expected, 1: expected}, embd
        assert [layer.running_variant for layer in monitor.layers] == [expected] * 2
        assert all(layer.variant == "fp32_delta" for layer in monitor.layers)  # what it would run, kept
        monitor.detach()
        monitor.close()
    assert "are not measured are not measured" not in caplog.text
    # compiled code records the fallback where it decides and the Monitor logs it (before: eager only)
    assert "runs torch SDPA instead of flashwatch's kernel for calls where head dim 8" in caplog.text
    assert "so its variant fp32_delta (an auto_fix switch too) is not in effect on them" in caplog.text


def _manual_attention(self, x):
    """tinygpt's attention written out (softmax of masked scores), as Hugging Face's eager
    attention does: no call to torch.nn.functional.scaled_dot_product_attention."""
    B, T, C = x.shape
    q, k, v = (z.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
               for z in self.c_attn(x).split(self.n_embd, dim=2))
    scores = (q @ k.transpose(-2, -1)) * (C // self.n_head) ** -0.5
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    y = (scores.softmax(-1) @ v).transpose(1, 2).contiguous().view(B, T, C)
    return self.resid_dropout(self.c_proj(y))


@pytest.mark.parametrize("compiled", [False, True])
def test_a_layer_whose_attention_flashwatch_never_sees_reads_coverage_0_and_warns(compiled, caplog):
    """Attention written out by hand (Hugging Face's eager attention) in layer 1: flashwatch sees
    none of its calls, so its coverage is 0 and attention_coverage fires, naming the cause; the
    layer that calls SDPA reads 1. Fail before: coverage NaN and no alert, a silence that read
    as health."""
    import logging
    import types

    if compiled:
        torch._dynamo.reset()
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, dropout=0.0))
    monitor = Monitor(MonitorConfig(interval=1, async_transfer=False))
    monitor.attach(model)
    attn = model.transformer.h[1].attn
    attn.forward = types.MethodType(_manual_attention, attn)
    run = torch.compile(model, backend="aot_eager") if compiled else model
    alerts = []
    with caplog.at_level(logging.WARNING, logger="flashwatch"):
        for _ in range(2):
            x = torch.randint(0, 256, (2, 16))
            run(x, x)[1].backward()
            model.zero_grad(set_to_none=True)
            alerts += monitor.step()
    monitor.detach()
    snap = monitor.snapshot()
    assert snap["flashwatch_attention_coverage"] == {(0,): 1.0, (1,): 0.0}
    fired = [a for a in alerts if a.rule == "attention_coverage"]
    assert [(a.layer, a.step) for a in fired] == [(1, 0)]
    assert "saw no attention call" in fired[0].message and "attn_implementation='sdpa'" in fired[0].message
    assert {(a.rule, a.layer) for a in monitor.active_alerts} == {("attention_coverage", 1)}
    assert any("saw no measured attention call" in r.getMessage() for r in caplog.records)


class _OneLayer(torch.nn.Module):
    """One attention layer of nanoGPT's layout (c_attn, n_head, c_proj) whose attention is
    ``attend(q, k, v)`` on (B, heads, T, D) tensors (the output projection after it is what a
    checkpoint's recomputation reaches past the attention call)."""

    def __init__(self, attend, c=32, heads=2):
        super().__init__()
        self.c_attn = torch.nn.Linear(c, 3 * c, bias=False)
        self.c_proj = torch.nn.Linear(c, c, bias=False)
        self.n_head, self.attend = heads, attend

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in self.c_attn(x).split(c, dim=2))
        return self.c_proj(self.attend(q, k, v).transpose(1, 2).reshape(b, t, c))


def _sdpa(*args, **kwargs):  # looked up at each call, as models do: flashwatch routes torch's SDPA while attached
    return torch.nn.functional.scaled_dot_product_attention(*args, **kwargs)


def _two_calls(q, k, v):
    """Two calls a step: one measurable, one with attention dropout."""
    return _sdpa(q, k, v, is_causal=True) + _sdpa(q, k, v, is_causal=True, dropout_p=0.1)


def _all_padding(q, k, v):
    """A batch that is padding throughout: an additive mask of -1e9 on every key (SDPA then
    averages every value; no NaN)."""
    return _sdpa(q, k, v, attn_mask=torch.full((q.shape[2], q.shape[2]), -1e9))


def _with_dropout(q, k, v):
    """Attention dropout: the call is measured in part (the "scores" route)."""
    return _sdpa(q, k, v, is_causal=True, dropout_p=0.1)


def test_a_layer_measured_in_part_reads_its_fraction_and_raises_no_alert():
    """Coverage 0.5 (one call of two measured in full): shown on the console, no attention_coverage
    alert, which is for a layer with nothing measured in full."""
    from flashwatch.exporters.base import StepRecord
    from flashwatch.exporters.console import ConsoleExporter

    torch.manual_seed(0)
    mod = _OneLayer(_two_calls)
    monitor = Monitor(MonitorConfig(interval=1, async_transfer=False))
    monitor.attach(mod)
    x = torch.randn(2, 16, 32)
    mod(x).sum().backward()
    alerts = monitor.step()
    monitor.detach()
    snap = monitor.snapshot()
    assert snap["flashwatch_attention_coverage"] == {(0,): 0.5}
    assert not [a for a in alerts if a.rule == "attention_coverage"]
    record = StepRecord(step=0, time=0.0, snapshot=snap, new_alerts=[], active_alerts=[])
    assert "attention coverage L0 50%" in ConsoleExporter("log").summary_line(record)


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("mode", ["observe", "own_kernel"])
def test_a_frozen_layer_whose_attention_has_no_backward_reads_coverage_0(mode, compiled):
    """Layer 0 and everything below it frozen (a partial fine-tune): its attention gets no backward,
    so nothing of it is measured but the forward; coverage 0 and the alert, in both modes, eager
    and compiled. Fail before: own-kernel mode, eager, counted the call at its forward and read
    coverage 1 with no alert, while the layer's statistics were NaN."""
    if compiled:
        torch._dynamo.reset()
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16))
    for module in (model.transformer.wte, model.transformer.wpe, model.transformer.h[0]):
        module.requires_grad_(False)
    monitor = Monitor(MonitorConfig(interval=1, mode=mode, async_transfer=False))
    monitor.attach(model)
    run = torch.compile(model, backend="aot_eager") if compiled else model
    x = torch.randint(0, 256, (2, 16))
    run(x, x)[1].backward()
    alerts = monitor.step()
    monitor.detach()
    assert monitor.snapshot()["flashwatch_attention_coverage"] == {(0,): 0.0, (1,): 1.0}
    assert [(a.rule, a.layer) for a in alerts if a.rule == "attention_coverage"] == [("attention_coverage", 0)]


@pytest.mark.parametrize("mode", ["observe", "own_kernel"])
def test_a_measured_call_that_leaves_every_row_out_reads_coverage_0(mode):
    """The dense pass ran on the layer's call but left every row out (all padding): nothing of the
    layer was measured, so its coverage reads 0 and attention_coverage fires, as for a call not
    measured at all. Fail before: coverage 1 (the pass ran) beside NaN statistics, no alert."""
    torch.manual_seed(0)
    mod = _OneLayer(_all_padding)
    monitor = Monitor(MonitorConfig(interval=1, mode=mode, async_transfer=False))
    monitor.attach(mod)
    x = torch.randn(2, 16, 32)
    (mod(x) * 0.0).sum().backward()  # padding: no loss reads it (its output gradient is 0)
    assert monitor.layers[0].stats.as_dict()["rows"] == [0.0, 0.0]
    alerts = monitor.step()
    monitor.detach()
    snap = monitor.snapshot()
    assert snap["flashwatch_attention_coverage"] == {(0,): 0.0}
    assert [(a.rule, a.layer) for a in alerts if a.rule == "attention_coverage"] == [("attention_coverage", 0)]
    assert all(math.isnan(v) for v in snap["flashwatch_delta_error"].values())


@pytest.mark.parametrize("checkpointed", [False, True])
@pytest.mark.parametrize("mode", ["observe", "own_kernel"])
def test_a_call_measured_in_part_counts_once_under_activation_checkpointing(mode, checkpointed):
    """A checkpointed forward is recomputed in the backward: a call with attention dropout is still one
    call, its rows counted once. Fail before: eager mode counted such calls (and added their rows and
    repeated maxima) at the forward, twice under checkpointing."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    mod = _OneLayer(_with_dropout)
    monitor = Monitor(MonitorConfig(interval=1, mode=mode, async_transfer=False))
    monitor.attach(mod)
    x = torch.randn(2, 16, 32, requires_grad=True)
    out = checkpoint(mod, x, use_reentrant=False) if checkpointed else mod(x)
    out.sum().backward()
    assert monitor.layers[0].coverage.tolist() == [1, 0]
    assert monitor.layers[0].stats.as_dict()["rows"] == [32.0, 32.0]
    monitor.detach()
    monitor.close()


_BOUND_AT_IMPORT = '''
import torch
from torch import nn
from torch.nn.functional import scaled_dot_product_attention as attend


class Attention(nn.Module):
    """nanoGPT attention that calls SDPA by a name its module bound at import."""

    def __init__(self, c=32, heads=2):
        super().__init__()
        self.c_attn = nn.Linear(c, 3 * c, bias=False)
        self.n_head = heads

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in self.c_attn(x).split(c, dim=2))
        return attend(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
'''


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("mode", ["observe", "own_kernel"])
def test_sdpa_bound_at_import_by_the_model_s_module_is_measured(tmp_path, monkeypatch, mode, compiled):
    """A model file that binds SDPA at import (``from torch.nn.functional import
    scaled_dot_product_attention as attend``) is measured while the Monitor is attached, and its
    name is given back on detach. Fails before: its calls bypassed flashwatch (coverage 0)."""
    import importlib
    import sys

    import torch.nn.functional as F

    (tmp_path / "bound_model.py").write_text(_BOUND_AT_IMPORT)
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("bound_model")
    torch.manual_seed(0)
    model = module.Attention()
    monitor = Monitor(MonitorConfig(interval=1, mode=mode, async_transfer=False))
    monitor.attach(model)
    try:
        torch._dynamo.reset()
        run = torch.compile(model, backend="aot_eager") if compiled else model
        run(torch.randn(2, 8, 32)).square().sum().backward()
        assert monitor.layers[0].coverage.tolist() == [1, 1]
        assert monitor.layers[0].stats.as_dict()["rows"] == [2 * 8.0] * 2
    finally:
        monitor.detach()
        monitor.close()
        sys.modules.pop("bound_model", None)
    assert module.attend is F.scaled_dot_product_attention  # given back
