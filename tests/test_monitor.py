"""The Monitor end to end on a tiny GPT (CPU): schedule, cost, aggregation, actions, reliability, resume."""

from __future__ import annotations

import logging
import math
import re

import pytest
import torch

import flashwatch
import flashwatch.collect
from same import assert_same
from flashwatch import Monitor, MonitorConfig, TrainingStopped
from flashwatch.detectors import RULES
from flashwatch.exporters.base import Exporter
from flashwatch.kernels import AttentionStats
from flashwatch.metrics import METRICS
from flashwatch.tinygpt import GPT, GPTConfig, sample_batch, stdlib_corpus

DATA = stdlib_corpus(200_000)


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


RUNS: list = []


@pytest.fixture(autouse=True)
def _detach_runs():
    yield
    while RUNS:
        RUNS.pop().monitor.detach()


class Run:
    """A tiny GPT, its optimizer and a Monitor; batches depend only on the step (resumable)."""

    def __init__(self, config: MonitorConfig, seed=0, attach=True, dtype=None, **monitor_kwargs):
        RUNS.append(self)
        torch.manual_seed(seed)
        self.model = GPT(GPTConfig(n_layer=2, n_head=4, n_embd=64, block_size=32))
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=3e-3)
        self.monitor = Monitor(config, **monitor_kwargs)
        self.dtype = dtype
        self.step_index = 0
        if attach:
            self.monitor.attach(self.model)

    def loss(self, step, micro=0):
        x, y = sample_batch(DATA, 4, 32, generator=torch.Generator().manual_seed(1000 * step + micro))
        if self.dtype is None:
            return self.model(x, y)[1]
        with torch.autocast("cpu", dtype=self.dtype):
            return self.model(x, y)[1]

    def train(self, steps, micro_batches=1, **step_kwargs):
        alerts = []
        for _ in range(steps):
            t = self.step_index
            for m in range(micro_batches):
                loss = self.loss(t, m) / micro_batches
                loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            self.opt.step()
            self.opt.zero_grad()
            self.step_index += 1
            alerts += self.monitor.step(loss=loss.detach() * micro_batches, grad_norm=grad_norm, **step_kwargs)
        return alerts


def test_schedule_monitors_every_interval_from_step_0():
    run = Run(MonitorConfig(interval=3))
    flags = []
    for _ in range(7):
        flags.append(run.monitor.monitoring)
        run.train(1)
    assert flags == [True, False, False, True, False, False, True]
    assert run.monitor.global_step == 7 and run.monitor.monitored_steps == 3
    assert run.monitor.snapshot()["flashwatch_step"] == 6.0


@pytest.mark.parametrize("mode", ["observe", "own_kernel"])
def test_unmonitored_steps_touch_nothing_and_monitored_steps_transfer_once(mode, monkeypatch):
    run = Run(MonitorConfig(interval=3, mode=mode))
    import flashwatch.kernels as kernels

    counts = {"packed": 0, "cpu": 0, "item": 0, "stats_pass": 0}
    inside_step = [False]  # count host reads only inside Monitor.step (the optimizer has its own .item())
    real_packed, real_cpu, real_item = AttentionStats.packed_all, torch.Tensor.cpu, torch.Tensor.item
    real_stats, real_step = kernels.attention_statistics, run.monitor.step

    def counting(name, fn, only_in_step=False):
        def wrapper(*args, **kwargs):
            if inside_step[0] or not only_in_step:
                counts[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    def step(**kwargs):
        inside_step[0] = True
        try:
            return real_step(**kwargs)
        finally:
            inside_step[0] = False

    monkeypatch.setattr(AttentionStats, "packed_all", staticmethod(counting("packed", real_packed)))
    monkeypatch.setattr(torch.Tensor, "cpu", counting("cpu", real_cpu, only_in_step=True))
    monkeypatch.setattr(torch.Tensor, "item", counting("item", real_item, only_in_step=True))
    monkeypatch.setattr(kernels, "attention_statistics", counting("stats_pass", real_stats))
    monkeypatch.setattr(run.monitor, "step", step)
    stats = [layer.stats for layer in run.monitor.layers]

    run.train(1)  # step 0: monitored
    assert counts["packed"] == 1 and counts["cpu"] == 1 and counts["item"] == 0  # every layer packed at once
    assert counts["stats_pass"] == (2 if mode == "observe" else 0)
    versions = [[getattr(s, f)._version for f in ("rows", "max_logit", "delta_error")] for s in stats]
    counts.update(packed=0, cpu=0, item=0, stats_pass=0)
    run.train(2)  # steps 1, 2: not monitored
    assert counts == {"packed": 0, "cpu": 0, "item": 0, "stats_pass": 0}
    # no in-place op reached any statistics tensor (their version counters did not move)
    assert versions == [[getattr(s, f)._version for f in ("rows", "max_logit", "delta_error")] for s in stats]
    run.train(1)  # step 3: monitored again
    assert counts["cpu"] == 1 and counts["packed"] == 1


def test_gradient_accumulation_sums_micro_batches():
    run = Run(MonitorConfig(interval=1, drift_include_fp32=True))
    seen = {}
    real_reset_all = AttentionStats.reset_all

    def keep(stats):  # read the statistics the step saw, before they are reset
        for s in stats:
            seen.setdefault(id(s), s.as_dict())
        real_reset_all(stats)

    saved = AttentionStats.__dict__["reset_all"]
    AttentionStats.reset_all = staticmethod(keep)
    try:
        run.train(1, micro_batches=3)
    finally:
        AttentionStats.reset_all = saved
    s0 = seen[id(run.monitor.layers[0].stats)]
    assert s0["rows"] == [3 * 4 * 32] * 4  # 3 micro-batches x batch 4 x 32 rows
    # the same micro-batches measured one by one add up to it
    singles = Run(MonitorConfig(interval=1, drift_include_fp32=True))
    total = torch.zeros(4, dtype=torch.float64)
    for m in range(3):
        (singles.loss(0, m) / 3).backward()
        total += singles.monitor.layers[0].stats.delta_error.to(torch.float64)
        singles.monitor.layers[0].stats.reset()
    assert torch.allclose(torch.tensor(s0["delta_error"], dtype=torch.float64), total, rtol=1e-5, atol=1e-12)


def test_snapshot_follows_the_metric_table():
    run = Run(MonitorConfig(interval=2, max_logit_bound=0.0))
    before = run.monitor.snapshot()
    assert set(before) == {m.name for m in METRICS} and math.isnan(before["flashwatch_loss"])
    run.train(3)
    snap = run.monitor.snapshot()
    assert set(snap) == {m.name for m in METRICS}
    heads = {(l, h) for l in range(2) for h in range(4)}
    for m in METRICS:
        value = snap[m.name]
        if not m.labels:
            assert isinstance(value, float), m.name
            continue
        assert isinstance(value, dict) and all(isinstance(k, tuple) and len(k) == len(m.labels) for k in value)
        if m.per_head:
            assert set(value) == heads, m.name
            assert all(isinstance(v, float) for v in value.values())
    assert snap["flashwatch_step"] == 2.0 and snap["flashwatch_grad_norm"] > 0
    assert snap["flashwatch_kernel_variant"][(0, "sdpa")] == 1.0 and snap["flashwatch_kernel_variant"][(0, "plain")] == 0
    assert set(snap["flashwatch_alerts_total"]) == {(r,) for r in RULES}
    assert snap["flashwatch_alerts_total"][("max_logit",)] == 8.0  # every head, once (hysteresis)
    assert snap["flashwatch_alert_active"][("max_logit", 1, 3)] == 1.0
    assert all(0 <= v <= 1 for v in snap["flashwatch_repeated_max_ratio_bf16"].values())
    sig = run.monitor.signals()
    assert set(sig) == {"drift_window_z", "wq_growth", "wq_ratio_to_median", "rows", "wq_error_push_true"}
    assert sig["rows"][(0, 0)] == 128


def test_alerts_are_logged_once_and_counted(caplog):
    run = Run(MonitorConfig(interval=1, max_logit_bound=0.0))
    with caplog.at_level(logging.WARNING, logger="flashwatch"):
        alerts = run.train(3)
    assert len(alerts) == 8 and len(run.monitor.alerts) == 8 and len(run.monitor.active_alerts) == 8
    lines = [r for r in caplog.records if "alert [max_logit]" in r.getMessage()]
    assert len(lines) == 8 and all(r.levelno == logging.WARNING for r in lines)


@pytest.mark.parametrize("mode, start, fix", [("observe", "sdpa", "fp32_delta"), ("own_kernel", "plain", "fixed")])
def test_auto_fix_switches_the_flagged_layers_from_the_next_step(mode, start, fix, monkeypatch):
    import flashwatch.kernels as kernels

    variants = []
    real = kernels.flash_attention
    monkeypatch.setattr(kernels, "flash_attention", lambda *a, **k: variants.append(k["variant"]) or real(*a, **k))
    run = Run(MonitorConfig(interval=1, mode=mode, auto_fix=fix, drift_threshold=0.0, warmup=0,
                            drift_include_fp32=True, layers=[1]))
    assert run.monitor.variants == {0: start}
    alerts = run.train(1)
    assert {a.rule for a in alerts} == {"delta_drift"}
    assert run.monitor.variants == {0: fix} and run.monitor.layers[0].mode == "own_kernel"
    assert run.monitor.switches == [{"step": 0, "layer": 0, "name": "transformer.h.1.attn", "from": start,
                                     "to": fix, "rule": "delta_drift"}]
    snap = run.monitor.snapshot()["flashwatch_kernel_variant"]
    assert snap[(0, fix)] == 1.0 and snap[(0, start)] == 0.0
    variants.clear()
    run.train(1)
    assert variants == [fix]  # from the next step on the layer runs the fix
    assert len(run.monitor.switches) == 1


def test_stop_on_raises_training_stopped_after_the_step_completes():
    assert flashwatch.TrainingStopped is TrainingStopped
    run = Run(MonitorConfig(interval=2, max_logit_bound=0.0, stop_on={"max_logit"}))
    with pytest.raises(TrainingStopped, match="flashwatch stopped training at step 0 on max_logit") as info:
        run.train(1)
    assert info.value.step == 0 and len(info.value.alerts) == 8
    assert run.monitor.global_step == 1 and run.monitor.alert_counts["max_logit"] == 8


class Recorder(Exporter):
    name = "recorder"

    def __init__(self):
        self.layout, self.records, self.closed = None, [], 0

    def open(self, layout):
        self.layout = layout

    def export(self, record):
        self.records.append(record)

    def close(self):
        self.closed += 1


class Broken(Exporter):
    name = "broken"

    def export(self, record):
        raise OSError("dashboard down")

    def close(self):
        raise OSError("still down")


def test_exporters_get_every_monitored_step_and_a_broken_one_changes_nothing(caplog):
    good = Recorder()
    reference = Run(MonitorConfig(interval=2, max_logit_bound=0.0))
    run = Run(MonitorConfig(interval=2, max_logit_bound=0.0), exporters=[Broken(), good])
    with caplog.at_level(logging.WARNING):
        run.train(5)
    reference.train(5)
    assert good.layout.layers == [("transformer.h.0.attn", 4), ("transformer.h.1.attn", 4)]
    assert [r.step for r in good.records] == [0, 2, 4]
    assert len(good.records[0].new_alerts) == 8 and good.records[1].new_alerts == []
    assert len(good.records[1].active_alerts) == 8
    assert good.records[0].snapshot["flashwatch_step"] == 0.0
    assert run.monitor.errors == 3
    for p, q in zip(run.model.parameters(), reference.model.parameters()):
        assert torch.equal(p, q)  # training unchanged
    late = Recorder()
    run.monitor.add_exporter(late)  # attached already: opened at once
    assert late.layout == good.layout
    run.monitor.close()  # never raises
    assert good.closed == 1 and late.closed == 1 and run.monitor.errors == 4


def test_failures_inside_monitoring_are_logged_once_and_counted(caplog):
    run = Run(MonitorConfig(interval=1, max_logit_bound=0.0))
    det = run.monitor.detectors[RULES.index("delta_drift")]
    det.update = lambda signals: 1 / 0
    with caplog.at_level(logging.WARNING, logger="flashwatch"):
        run.train(3)
    assert run.monitor.errors == 3
    assert sum("detector delta_drift failed" in r.getMessage() for r in caplog.records) == 1
    assert run.monitor.alert_counts["max_logit"] == 8  # the other detectors went on


def test_monitoring_that_keeps_failing_is_logged_again_and_recovers(caplog, monkeypatch):
    """Every monitored step failing (as when a resumed state sat on the wrong device) is logged at
    the first failure with its traceback, then again after 10 failures in a row; training goes on
    unchanged, and a step that works again resets the count."""
    cfg = MonitorConfig(interval=1)
    broken, healthy = Run(cfg), Run(cfg)
    real = broken.monitor._signals.build
    monkeypatch.setattr(broken.monitor._signals, "build", lambda **kw: 1 / 0)
    with caplog.at_level(logging.WARNING, logger="flashwatch"):
        broken.train(12)
    healthy.train(12)
    for p, q in zip(broken.model.parameters(), healthy.model.parameters()):
        assert torch.equal(p, q)
    messages = [r.getMessage() for r in caplog.records]
    assert sum("step failed" in m for m in messages) == 1
    again = [m for m in messages if "monitored steps all failed" in m]
    assert len(again) == 1 and "the last 10 monitored steps all failed (step 9 the latest)" in again[0]
    assert broken.monitor.errors == 12
    monkeypatch.setattr(broken.monitor._signals, "build", real)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="flashwatch"):
        broken.train(30)
    assert broken.monitor._failed_in_a_row == 0 and broken.monitor.errors == 12
    assert not any("all failed" in r.getMessage() for r in caplog.records)


def test_non_finite_loss_and_statistics_do_not_poison_healthy_heads():
    cfg = MonitorConfig(interval=1, drift_include_fp32=True)
    a, b = Run(cfg), Run(cfg)
    a.train(2)
    b.train(2)
    # step 2: loss NaN for a, and head 1 of layer 0 reports a NaN delta error
    for run, loss in ((a, float("nan")), (b, 1.0)):
        run.loss(2).backward()
        run.opt.zero_grad()
    a.monitor.layers[0].stats.delta_error[1] = float("nan")
    cum_before = a.monitor.snapshot()["flashwatch_delta_error_cumulative"]
    alerts = a.monitor.step(loss=float("nan"))
    b.monitor.step(loss=1.0)
    assert sorted((x.rule, x.layer, x.head) for x in alerts) == [("non_finite", -1, -1), ("non_finite", 0, 1)]
    cum_a = a.monitor.snapshot()["flashwatch_delta_error_cumulative"]
    cum_b = b.monitor.snapshot()["flashwatch_delta_error_cumulative"]
    assert cum_a[(0, 1)] == cum_before[(0, 1)]  # skipped for the bad head
    for key in cum_a:
        if key != (0, 1):
            assert cum_a[key] == cum_b[key]
    assert all(math.isfinite(v) for v in a.monitor.snapshot()["flashwatch_delta_drift_z"].values())


def test_bf16_drift_is_judged_and_fp32_is_not_by_default():
    bf16 = Run(MonitorConfig(interval=1, drift_threshold=0.0, warmup=0), dtype=torch.bfloat16)
    assert {a.rule for a in bf16.train(1)} == {"delta_drift"}
    assert bf16.monitor.layers[0].low_precision is True
    fp32 = Run(MonitorConfig(interval=1, drift_threshold=0.0, warmup=0))
    assert fp32.train(1) == []




@pytest.mark.parametrize("load_before_attach", [False, True])
def test_resume_continues_bit_for_bit(tmp_path, load_before_attach):
    cfg = MonitorConfig(interval=2, warmup=1, window=3, drift_threshold=1.5, drift_include_fp32=True,
                        auto_fix="fp32_delta", max_logit_bound=0.5, repeated_max_baseline=1)
    whole = Run(cfg)
    whole.train(14)

    first = Run(cfg)
    first.train(7)
    path = tmp_path / "ckpt.pt"
    torch.save({"model": first.model.state_dict(), "opt": first.opt.state_dict(),
                "monitor": first.monitor.state_dict()}, path)
    del first
    ckpt = torch.load(path, weights_only=True)  # plain tensors and Python data only
    second = Run(cfg, seed=123, attach=False)
    second.model.load_state_dict(ckpt["model"])
    second.opt.load_state_dict(ckpt["opt"])
    if load_before_attach:
        second.monitor.load_state_dict(ckpt["monitor"])
        second.monitor.attach(second.model)
    else:
        second.monitor.attach(second.model)
        second.monitor.load_state_dict(ckpt["monitor"])
    second.step_index = 7
    assert second.monitor.global_step == 7 and not second.monitor.monitoring
    second.train(7)

    assert whole.monitor.switches, "the run should exercise an auto-fix switch"
    assert whole.monitor.active_alerts, "the run should have active alerts"
    assert_same(whole.monitor.state_dict(), second.monitor.state_dict())
    assert_same(whole.monitor.snapshot(), second.monitor.snapshot())
    assert whole.monitor.variants == second.monitor.variants
    for p, q in zip(whole.model.parameters(), second.model.parameters()):
        assert torch.equal(p, q)


def test_load_state_dict_errors():
    run = Run(MonitorConfig())
    with pytest.raises(ValueError, match="not a flashwatch Monitor state of version 2"):
        run.monitor.load_state_dict({"version": 99})
    state = run.monitor.state_dict()
    state["layers"] = state["layers"][:1]
    with pytest.raises(ValueError, match="the saved Monitor state has layers"):
        run.monitor.load_state_dict(state)


def test_a_state_that_does_not_fit_changes_nothing():
    """A state from a run whose auto_fix switched every layer, with another window: the load is
    refused and the Monitor keeps its kernels, state and readings (before: the layers' variants
    and W^Q-error vectors were loaded, then the window's check refused the rest)."""
    source = Run(MonitorConfig(interval=1, window=5, warmup=0, auto_fix="fp32_delta", max_logit_bound=-1.0,
                               auto_fix_on={"max_logit"}))
    source.train(3)
    saved = source.monitor.state_dict()
    assert set(source.monitor.variants.values()) == {"fp32_delta"}
    run = Run(MonitorConfig(interval=1, window=50), seed=1)
    run.train(2)
    before = run.monitor.state_dict()
    with pytest.raises(ValueError, match=r"another MonitorConfig.window"):
        run.monitor.load_state_dict(saved)
    assert set(run.monitor.variants.values()) == {"sdpa"}
    assert_same(run.monitor.state_dict(), before, "a refused state")
    # a model of another width: refused at its first layer, by name
    wide = Run(MonitorConfig(interval=1, window=5), attach=False)
    wide.model = GPT(GPTConfig(n_layer=2, n_head=4, n_embd=128, block_size=32))
    wide.monitor.attach(wide.model)
    with pytest.raises(ValueError, match=r"does not fit layer 0 \(transformer.h.0.attn\).*model width differ"):
        wide.monitor.load_state_dict(saved)
    assert set(wide.monitor.variants.values()) == {"sdpa"}
    with pytest.raises(ValueError, match=r"not a complete flashwatch Monitor state: it has no 'layers'"):
        Monitor().load_state_dict({"version": 2})


def test_a_head_whose_scores_are_not_finite_reads_no_repeated_max_ratio():
    """A NaN in layer 1's W^Q (head 0's queries NaN): that head's repeated-max ratios read NaN, not
    0 (a NaN score ties with nothing), and non_finite fires; every other head is measured."""
    run = Run(MonitorConfig(interval=1, warmup=0))
    with torch.no_grad():
        run.model.transformer.h[1].attn.c_attn.weight[0, 0] = float("nan")
    alerts = run.train(1)
    snap = run.monitor.snapshot()
    for name in ("flashwatch_repeated_max_ratio", "flashwatch_repeated_max_ratio_bf16",
                 "flashwatch_repeated_max_ratio_format"):
        assert math.isnan(snap[name][(1, 0)]), name
        assert all(math.isfinite(snap[name][(layer, h)]) for layer in (0, 1) for h in range(4) if (layer, h) != (1, 0))
    assert math.isnan(snap["flashwatch_max_logit"][(1, 0)])
    assert "non_finite" in {a.rule for a in alerts}


def test_bad_arguments_are_named():
    with pytest.raises(TypeError, match="config must be a flashwatch.MonitorConfig"):
        Monitor({"interval": 3})
    monitor = Monitor()
    with pytest.raises(ValueError, match=r"loss must be a float or a one-element tensor, got a tensor of shape \(3,\)"):
        monitor.step(loss=torch.ones(3))
    with pytest.raises(TypeError, match="grad_norm must be None, a float or a one-element tensor, got str"):
        monitor.step(grad_norm="1.0")
    # a boolean or complex tensor is not a loss: recorded as 1.0 or as its real part before
    with pytest.raises(TypeError, match="loss must be a real number, got a tensor of dtype torch.bool"):
        monitor.step(loss=torch.tensor(True))
    with pytest.raises(TypeError, match="grad_norm must be a real number, got a tensor of dtype torch.complex64"):
        monitor.step(grad_norm=torch.tensor(3 + 4j))
    assert monitor.global_step == 0


def test_without_a_model_the_monitor_still_tracks_loss():
    monitor = Monitor(MonitorConfig(interval=1))
    monitor.step(loss=2.0)
    monitor.step(loss=torch.tensor(2.1))
    alerts = monitor.step(loss=9.0)
    assert [a.rule for a in alerts] == ["loss_spike"]
    assert monitor.snapshot()["flashwatch_loss"] == 9.0 and math.isnan(monitor.snapshot()["flashwatch_grad_norm"])


def test_a_layer_that_never_runs_sdpa_is_reported_once(caplog):
    run = Run(MonitorConfig(interval=1))
    with caplog.at_level(logging.WARNING, logger="flashwatch"):
        run.monitor.step(loss=1.0)
        run.monitor.step(loss=1.0)
    assert sum("saw no measured attention call" in r.getMessage() for r in caplog.records) == 2  # once per layer


def test_exact_recompute_every_n_monitored_steps_matches_matrix_norm():
    run = Run(MonitorConfig(interval=1, power_exact_every=2, power_block=1))
    run.train(2)
    exact = {(l, h): torch.linalg.matrix_norm(layer.query_weight()[h], ord=2).item()
             for l, layer in enumerate(run.monitor.layers) for h in range(4)}
    snap = run.monitor.snapshot()["flashwatch_wq_spectral_norm"]
    for key, value in exact.items():
        assert snap[key] == pytest.approx(value, rel=1e-5)


def test_wq_power_iteration_groups_split_by_memory_and_agree(monkeypatch):
    import flashwatch.wq as wq_module

    one = Run(MonitorConfig(interval=1))
    monkeypatch.setattr(wq_module, "GROUP_BYTES", 4 * 16 * 64 * 4)  # room for one layer per group
    two = Run(MonitorConfig(interval=1))
    assert [len(g.layers) for g in one.monitor._wq.groups] == [2] and \
        [len(g.layers) for g in two.monitor._wq.groups] == [1, 1]
    one.train(3)
    two.train(3)
    a, b = (r.monitor.snapshot()["flashwatch_wq_spectral_norm"] for r in (one, two))
    assert a.keys() == b.keys() and all(a[k] == pytest.approx(b[k], rel=1e-6) for k in a)
    state = two.monitor.state_dict()
    assert [tuple(layer["power"]["v"].shape) for layer in state["layers"]] == [(4, 64, 4), (4, 64, 4)]


def test_detach_then_attach_again_continues_the_signals():
    cfg = MonitorConfig(interval=1, auto_fix="fixed", drift_threshold=0.0, warmup=0, drift_include_fp32=True,
                        layers=[0])
    whole, parts = Run(cfg), Run(cfg)
    whole.train(4)
    parts.train(2)
    parts.monitor.detach()
    parts.monitor.attach(parts.model)  # e.g. a second trainer.fit with the same callback
    assert parts.monitor.variants == {0: "fixed"}
    parts.train(2)
    assert_same(whole.monitor.state_dict(), parts.monitor.state_dict())


@pytest.mark.parametrize("script, args", [
    ("plain_loop.py", ["--steps", "6", "--interval", "2", "--mode", "own_kernel", "--bf16", "--auto-fix", "fixed"]),
    ("plain_loop.py", ["--steps", "6", "--interval", "2", "--bf16", "--compile"]),
    ("plain_loop.py", ["--steps", "6", "--interval", "2", "--fp16"]),
    ("hf_transformers.py", ["--steps", "3", "--interval", "2", "--family", "llama"]),
    ("hf_transformers.py", ["--steps", "3", "--interval", "2", "--family", "gpt2", "--compile"]),
    ("hf_transformers.py", ["--steps", "3", "--interval", "2", "--mode", "own_kernel", "--compile", "--pad", "9"]),
])
def test_examples_run(script, args, capsys, fresh_dynamo):
    import pathlib
    import runpy

    if script.startswith("hf_"):
        pytest.importorskip("transformers")
    path = pathlib.Path(__file__).resolve().parents[1] / "examples" / script
    main = runpy.run_path(str(path))["main"]
    n = torch.get_num_threads()
    try:
        assert main(args) == 0
    finally:
        torch.set_num_threads(n)
    out = capsys.readouterr().out
    assert "errors: 0" in out
    if "--pad" in args:  # own-kernel mode ran its kernel on the masked calls, every layer measured
        assert "attention run by: {0: 'plain', 1: 'plain'}" in out and "not measured" not in out
    if script == "plain_loop.py":  # every layer measured, compiled or not (a missing value reads "not measured")
        assert re.findall(r"max logit (\S+),", out) and all(v != "not measured" for v in re.findall(r"max logit (.+?),", out))
    assert _sdpa_restored()


def test_the_fp16_example_passes_its_loss_scaler(monkeypatch, capsys, fresh_dynamo):
    """examples/plain_loop.py --fp16 hands its GradScaler to every Monitor.step (else its delta error
    would be in scaled units, and a skipped step would raise non_finite)."""
    import pathlib
    import runpy

    given = []
    real = Monitor.step

    def spy(self, *args, **kwargs):
        given.append(kwargs.get("grad_scaler"))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Monitor, "step", spy)
    path = pathlib.Path(__file__).resolve().parents[1] / "examples" / "plain_loop.py"
    n = torch.get_num_threads()
    try:
        assert runpy.run_path(str(path))["main"](["--steps", "4", "--interval", "2", "--fp16"]) == 0
    finally:
        torch.set_num_threads(n)
    assert len(given) == 4 and all(isinstance(g, torch.amp.GradScaler) and g.is_enabled() for g in given)


def _sdpa_restored():
    import torch.nn.functional as F

    from flashwatch.routing import _import_time_sdpa

    return F.scaled_dot_product_attention is _import_time_sdpa


class _CopyDone:
    """Stands in for the CUDA event of an asynchronous host copy (the copy is a clone here)."""

    synchronized = 0

    def synchronize(self):
        _CopyDone.synchronized += 1


def _defer_like_cuda(monkeypatch):
    """Make the Monitor take its CUDA path on the CPU: the host copy of a monitored step is
    'in flight' until the next step() call decides it."""
    monkeypatch.setattr(flashwatch.collect, "start_host_copy", lambda values, async_transfer: (values.clone(), _CopyDone()))


def test_deferred_decisions_equal_immediate_ones_one_step_later(monkeypatch):
    """async_transfer on CUDA: the same alerts, states and exports, reported at the next step()."""
    cfg = MonitorConfig(interval=2, warmup=0, max_logit_bound=-1000.0, auto_fix="fp32_delta",
                        auto_fix_on=frozenset({"max_logit"}), mode="own_kernel")
    now = Run(cfg)
    now_alerts = [(run_step, a.step, a.rule, a.layer, a.head) for run_step in range(6)
                  for a in now.train(1)]
    _defer_like_cuda(monkeypatch)
    later = Run(cfg)
    later_alerts = [(run_step, a.step, a.rule, a.layer, a.head) for run_step in range(6)
                    for a in later.train(1)]
    assert now_alerts and later_alerts
    # same alerts about the same monitored steps, each returned by the following step() call
    assert [x[1:] for x in later_alerts] == [x[1:] for x in now_alerts]
    assert all(when == step + 1 for when, step, *_ in later_alerts)
    assert all(when == step for when, step, *_ in now_alerts)
    # the switch lands one step later, so the models differ from then on; the monitor's
    # decisions about what it measured do not
    assert [s["step"] for s in later.monitor.switches] == [s["step"] for s in now.monitor.switches]
    later.train(1)  # step 6 (monitored) is in flight now
    assert later.monitor.monitored_steps == 3
    state = later.monitor.state_dict()  # flushes
    assert later.monitor.monitored_steps == 4 and state["last"]["step"] == 6


@pytest.mark.parametrize("deferred", [False, True])
def test_detectors_see_the_variant_each_monitored_step_ran(monkeypatch, deferred):
    """delta_drift judges a layer by what it ran at the step (fp32_delta is not judged). On CUDA a
    monitored step is decided at the next step(), after that step's own training ran: a switch
    decided there applies from the step after, and the step being decided still ran the old variant."""
    if deferred:
        _defer_like_cuda(monkeypatch)
    from flashwatch.detectors import DeltaDriftDetector

    seen = []
    real = DeltaDriftDetector.update

    def spy(self, signals):
        seen.append((signals.step, [ls.variant for ls in signals.layers]))
        return real(self, signals)

    monkeypatch.setattr(DeltaDriftDetector, "update", spy)
    cfg = MonitorConfig(interval=1, warmup=0, mode="observe", auto_fix="fp32_delta",
                        auto_fix_on=frozenset({"max_logit"}), max_logit_bound=-1000.0)
    run = Run(cfg)
    run.train(4)
    run.monitor.flush()
    assert [s["step"] for s in run.monitor.switches] == [0, 0]  # both layers, decided from step 0
    switched_from = 2 if deferred else 1  # step 1 ran before the deferred decision of step 0
    assert seen == [(t, ["sdpa", "sdpa"] if t < switched_from else ["fp32_delta", "fp32_delta"]) for t in range(4)]


def test_deferred_stop_on_raises_at_the_next_step_and_close_flushes(monkeypatch):
    _defer_like_cuda(monkeypatch)
    records = []

    class Keep(Exporter):
        def export(self, record):
            records.append(record.step)

    run = Run(MonitorConfig(interval=1, warmup=0, max_logit_bound=-1000.0, stop_on=frozenset({"max_logit"})),
              exporters=[Keep()])
    run.train(1)  # step 0 measured, decision pending
    assert records == []
    with pytest.raises(TrainingStopped):
        run.train(1)  # step 0 decided at step 1's step(): stop
    run2 = Run(MonitorConfig(interval=1), exporters=[Keep()])
    run2.train(3)
    assert records == [0, 0, 1]
    run2.monitor.close()  # the in-flight step 2 is decided and exported before the exporters close
    assert records == [0, 0, 1, 2]


def test_a_failing_device_half_counts_as_a_failed_step_and_is_logged_again(caplog, monkeypatch):
    """The first half of a monitored step (packing, the W^Q power iteration) failing is a failed
    step like a failed decision: ``failed_in_a_row`` says the snapshot is older than the latest
    monitored step, and the log says so again at 10 in a row; training goes on unchanged."""
    cfg = MonitorConfig(interval=1)
    broken, healthy = Run(cfg), Run(cfg)
    broken.train(2)
    healthy.train(2)
    monkeypatch.setattr(broken.monitor._wq, "step", lambda *a, **k: 1 / 0)
    with caplog.at_level(logging.WARNING, logger="flashwatch"):
        broken.train(11)
    healthy.train(11)
    for p, q in zip(broken.model.parameters(), healthy.model.parameters()):
        assert torch.equal(p, q)
    assert broken.monitor.failed_in_a_row == 11 and broken.monitor.last_decided_step == 1
    assert broken.monitor.monitored_steps == 13
    again = [r.getMessage() for r in caplog.records if "monitored steps all failed" in r.getMessage()]
    assert len(again) == 1 and "the last 10 monitored steps all failed (step 11 the latest)" in again[0]
    monkeypatch.undo()
    broken.train(1)
    assert broken.monitor.failed_in_a_row == 0 and broken.monitor.last_decided_step == 13


def test_an_observed_call_whose_statistics_pass_fails_is_not_measured(caplog, monkeypatch):
    """Coverage counts an observed call as measured only once its statistics pass ran: a pass
    that fails leaves the layer at coverage 0 (the attention_coverage alert), its delta error and
    drift z NaN, and an earlier delta_drift alert held, neither renewed nor cleared."""
    import flashwatch.kernels as kernels

    run = Run(MonitorConfig(interval=1, drift_threshold=0.0, warmup=1, drift_include_fp32=True))
    run.train(3)
    before = run.monitor.snapshot()
    assert all(v == 1.0 for v in before["flashwatch_attention_coverage"].values())
    drifting = {(a.layer, a.head) for a in run.monitor.active_alerts if a.rule == "delta_drift"}
    assert drifting  # threshold 0: every measured head holds one

    def failing(*args, **kwargs):
        raise RuntimeError("out of memory in the statistics pass")
    monkeypatch.setattr(kernels, "attention_statistics", failing)
    with caplog.at_level(logging.WARNING, logger="flashwatch"):
        alerts = run.train(2)
    snap = run.monitor.snapshot()
    assert all(v == 0.0 for v in snap["flashwatch_attention_coverage"].values())
    assert sorted({(a.rule, a.layer) for a in alerts}) == [("attention_coverage", 0), ("attention_coverage", 1)]
    for name in ("flashwatch_delta_drift_z", "flashwatch_delta_error", "flashwatch_delta_error_cumulative"):
        assert all(math.isnan(v) for v in snap[name].values()), name
    assert {(a.layer, a.head) for a in run.monitor.active_alerts if a.rule == "delta_drift"} == drifting
    messages = [r.getMessage() for r in caplog.records]
    assert not any("saw no measured attention call" in m for m in messages)  # it had calls: coverage says it
    monkeypatch.undo()
    run.train(1)
    snap = run.monitor.snapshot()
    assert all(v == 1.0 for v in snap["flashwatch_attention_coverage"].values())
    assert all(math.isfinite(v) for v in snap["flashwatch_delta_drift_z"].values())


@pytest.mark.parametrize("mode", ["observe", "own_kernel"])
def test_a_forward_without_backward_adds_nothing_to_the_monitored_step(mode):
    """An extra forward with gradients on and no backward at a monitored step (an evaluation
    without no_grad), with logits made far larger than the step's: the step reads what it reads
    without that forward (max logit included, which the own kernel's forward finds), eager mode."""
    def one_step(extra: bool) -> dict:
        run = Run(MonitorConfig(interval=1, mode=mode))
        if extra:
            attn = [m for m in run.model.modules() if hasattr(m, "c_attn")]
            saved = [m.c_attn.weight.detach().clone() for m in attn]
            with torch.no_grad():
                for m in attn:
                    m.c_attn.weight.mul_(8.0)
            run.loss(7)  # gradients on, never differentiated
            with torch.no_grad():
                for m, w in zip(attn, saved):
                    m.c_attn.weight.copy_(w)
        run.train(1)
        snap = run.monitor.snapshot()
        run.monitor.detach()
        return snap

    plain, with_extra = one_step(False), one_step(True)
    for name in ("flashwatch_max_logit", "flashwatch_repeated_max_ratio", "flashwatch_delta_error",
                 "flashwatch_attention_coverage"):
        assert with_extra[name] == plain[name], name


def test_an_observed_forward_without_backward_is_not_a_measured_call(caplog):
    """Nothing was measured (coverage 0: no call counted, since none reached a backward), the
    attention_coverage warning says so, and the log asks whether gradients are on."""
    run = Run(MonitorConfig(interval=1))
    with caplog.at_level(logging.WARNING, logger="flashwatch"):
        run.loss(0)  # grad enabled, no backward
        alerts = run.monitor.step(loss=1.0)
    assert all(v == 0.0 for v in run.monitor.snapshot()["flashwatch_attention_coverage"].values())
    assert {a.rule for a in alerts} == {"attention_coverage"}
    assert any("saw no measured attention call" in r.getMessage() for r in caplog.records)
