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
    if not compiled:
        assert "it reports variant sdpa" in caplog.text
