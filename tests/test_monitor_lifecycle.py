"""The Monitor's life cycle: a context manager, close() decides the last step, a checkpoint changes
nothing about training and carries what is still to be done, the asynchronous copy's stream, and
values that are not what they claim (step() before attach(), a negative gradient norm)."""

from __future__ import annotations

import logging
import math

import pytest
import torch

import flashwatch.collect
from flashwatch import Monitor, MonitorConfig, TrainingStopped
from flashwatch.exporters.base import Exporter
from flashwatch.tinygpt import sample_batch
from test_monitor import DATA, Run, assert_same, _defer_like_cuda
from test_monitor import _detach_runs, _one_thread  # noqa: F401  (autouse: one thread, runs detached)


class Keep(Exporter):
    """Keeps what it is given: (step, new alerts) per record, and how often it was closed."""

    name = "keep"

    def __init__(self):
        self.records, self.closed = [], 0

    def export(self, record):
        self.records.append((record.step, sorted((a.rule, a.layer, a.head) for a in record.new_alerts)))

    def close(self):
        self.closed += 1


# --- context manager and close() ------------------------------------------------------------------

def test_the_monitor_is_a_context_manager_that_decides_the_last_step(monkeypatch):
    _defer_like_cuda(monkeypatch)  # the CUDA path: a monitored step is decided one step() later
    keep = Keep()
    run = Run(MonitorConfig(interval=1), attach=False, exporters=[keep])
    with run.monitor as monitor:
        assert monitor is run.monitor
        monitor.attach(run.model)
        run.train(3)
        assert [s for s, _ in keep.records] == [0, 1]  # step 2 is in flight
    assert [s for s, _ in keep.records] == [0, 1, 2] and keep.closed == 1
    assert run.monitor.monitored_steps == 3


def test_the_context_manager_closes_on_an_exception_and_lets_it_through(monkeypatch):
    _defer_like_cuda(monkeypatch)
    keep = Keep()
    run = Run(MonitorConfig(interval=1), attach=False, exporters=[keep])
    with pytest.raises(KeyError, match="from the training loop"):
        with run.monitor as monitor:
            monitor.attach(run.model)
            run.train(2)
            raise KeyError("from the training loop")
    assert [s for s, _ in keep.records] == [0, 1] and keep.closed == 1


def test_the_context_manager_lets_training_stopped_through_and_still_closes():
    keep = Keep()
    run = Run(MonitorConfig(interval=1, max_logit_bound=-1000.0, stop_on={"max_logit"}), attach=False,
              exporters=[keep])
    with pytest.raises(TrainingStopped):
        with run.monitor:
            run.monitor.attach(run.model)
            run.train(2)
    assert keep.closed == 1 and [s for s, _ in keep.records] == [0]


def test_steps_after_detach_say_once_that_nothing_is_measured(caplog):
    """step() after detach() tracks the loss only: it says so once (as before attach and after
    close), not a run of records with no layer in them and no word why."""
    run = Run(MonitorConfig(interval=1))
    run.train(2)
    run.monitor.detach()
    with caplog.at_level(logging.WARNING, logger="flashwatch"):
        run.train(3)
    assert sum("after detach()" in r.getMessage() for r in caplog.records) == 1
    run.monitor.attach(run.model)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="flashwatch"):
        run.train(1)
    assert not any("after detach()" in r.getMessage() for r in caplog.records)
    run.monitor.close()


def test_close_gives_the_model_back_and_later_steps_measure_and_write_nothing(caplog):
    """After close() (and so after a ``with`` block) torch's SDPA is the model's again and no
    statistics pass runs, whatever step the run ended on; step() warns once and only counts;
    attach() monitors again where the signals stopped."""
    import torch.nn.functional as F

    sdpa = F.scaled_dot_product_attention
    keep = Keep()
    run = Run(MonitorConfig(interval=2), exporters=[keep])
    assert F.scaled_dot_product_attention is not sdpa
    run.train(4)  # ends on a monitored boundary: step 4 would be monitored
    run.monitor.close()
    assert F.scaled_dot_product_attention is sdpa
    rows = run.monitor.layers[0].stats.rows.clone() if run.monitor.layers else None
    with caplog.at_level(logging.WARNING, logger="flashwatch"):
        run.train(3)
    assert sum("after close()" in r.getMessage() for r in caplog.records) == 1
    assert [s for s, _ in keep.records] == [0, 2] and keep.closed == 1
    assert run.monitor.global_step == 7 and run.monitor.monitored_steps == 2  # counted, not measured
    if rows is not None:
        assert torch.equal(run.monitor.layers[0].stats.rows, rows)
    run.monitor.attach(run.model)
    assert F.scaled_dot_product_attention is not sdpa
    run.train(2)
    assert [s for s, _ in keep.records] == [0, 2, 8] and run.monitor.monitored_steps == 3
    run.monitor.close()
    assert F.scaled_dot_product_attention is sdpa


def test_a_state_saved_after_detach_or_close_resumes_the_same_layers(tmp_path):
    """A checkpoint saved after training ended (Lightning saves after fit(), when the callback has
    detached; or after close()) holds the layers' signals as they were left, so a new Monitor on the
    same model resumes from it; a state loaded before attach is saved as loaded."""
    run = Run(MonitorConfig(interval=2))
    run.train(4)
    during = run.monitor.state_dict()
    run.monitor.detach()
    after = run.monitor.state_dict()
    assert [s["name"] for s in after["layers"]] == [s["name"] for s in during["layers"]] != []
    assert after["global_step"] == during["global_step"] == 4
    torch.save(after, tmp_path / "after.pt")
    run.monitor.close()
    assert run.monitor.state_dict()["layers"] is after["layers"]
    fresh = Monitor(MonitorConfig(interval=2))
    fresh.load_state_dict(torch.load(tmp_path / "after.pt", weights_only=False))
    held = fresh.state_dict()
    assert held["global_step"] == 4 and [s["name"] for s in held["layers"]] == [s["name"] for s in after["layers"]]
    assert repr(held["layers"][0]["signals"]) == repr(after["layers"][0]["signals"])
    fresh.attach(run.model)  # the same layers: the saved signals continue
    assert fresh.global_step == 4 and len(fresh.layers) == len(after["layers"])
    fresh.close()


def test_close_decides_the_last_monitored_step_and_logs_a_stop_it_cannot_raise(monkeypatch, caplog):
    _defer_like_cuda(monkeypatch)
    keep = Keep()
    run = Run(MonitorConfig(interval=1, warmup=0, max_logit_bound=-1000.0, stop_on={"max_logit"}), exporters=[keep])
    run.train(1)
    assert keep.records == []  # without close() (or flush()) step 0 would never be decided
    with caplog.at_level(logging.WARNING, logger="flashwatch"):
        run.monitor.close()  # never raises, also for a stop_on alert
    assert keep.records[0][0] == 0 and len(keep.records[0][1]) == 8 and keep.closed == 1
    assert sum("alert [max_logit] step 0" in r.getMessage() for r in caplog.records) == 8


# --- a checkpoint changes nothing and carries what is due ---------------------------------------------

def _trace(run, steps, checkpoint_after=None):
    """Train ``steps`` steps; per step: the loss, the variants the attention ran, the alerts step()
    returned; a state_dict() after step ``checkpoint_after``."""
    import flashwatch.kernels as kernels

    ran = []
    real = kernels.flash_attention

    def spy(*args, **kwargs):
        ran.append(kwargs["variant"])
        return real(*args, **kwargs)

    trace = []
    for t in range(steps):
        ran.clear()
        kernels.flash_attention = spy
        try:
            loss = run.loss(t)
            loss.backward()
        finally:
            kernels.flash_attention = real
        grad_norm = torch.nn.utils.clip_grad_norm_(run.model.parameters(), 1.0)
        run.opt.step()
        run.opt.zero_grad()
        returned = run.monitor.step(loss=loss.detach(), grad_norm=grad_norm)
        trace.append((loss.item(), list(ran), [(a.step, a.rule, a.layer, a.head) for a in returned]))
        if t == checkpoint_after:
            run.monitor.state_dict()
    return trace


@pytest.mark.parametrize("checkpoint_after", [0, 2])
def test_state_dict_does_not_change_what_training_does_next(monkeypatch, checkpoint_after):
    """On CUDA (async copy) state_dict() decides the step in flight; its auto_fix switch still
    applies from the step it would have applied from, and step() returns the same alerts."""
    _defer_like_cuda(monkeypatch)
    cfg = MonitorConfig(interval=2, warmup=0, mode="own_kernel", auto_fix="fp32_delta",
                        auto_fix_on={"max_logit"}, max_logit_bound=-1000.0, layers=[1])
    keep_a, keep_b = Keep(), Keep()
    plain = Run(cfg, exporters=[keep_a])
    checkpointed = Run(cfg, exporters=[keep_b])
    a = _trace(plain, 6)
    b = _trace(checkpointed, 6, checkpoint_after=checkpoint_after)
    if checkpoint_after == 0:
        assert a[1][1] == ["plain"] and a[2][1] == ["fp32_delta"], "step 0's switch applies from step 2"
    assert b == a  # losses, variants run, alerts returned: step by step
    assert checkpointed.monitor.switches == plain.monitor.switches
    assert [x.to_dict() for x in checkpointed.monitor.alerts] == [x.to_dict() for x in plain.monitor.alerts]
    assert keep_b.records == keep_a.records
    for p, q in zip(plain.model.parameters(), checkpointed.model.parameters()):
        assert torch.equal(p, q)


def test_a_stop_decided_by_the_checkpoint_flush_is_saved_and_a_resumed_run_stops(monkeypatch, tmp_path):
    _defer_like_cuda(monkeypatch)
    cfg = MonitorConfig(interval=1, warmup=0, max_logit_bound=-1000.0, stop_on={"max_logit"})
    first = Run(cfg)
    first.train(1)  # step 0 measured, in flight
    path = tmp_path / "ckpt.pt"
    torch.save({"model": first.model.state_dict(), "opt": first.opt.state_dict(),
                "monitor": first.monitor.state_dict()}, path)  # the flush decides step 0: a stop is due
    ckpt = torch.load(path, weights_only=True)
    resumed = Run(cfg, attach=False)
    resumed.model.load_state_dict(ckpt["model"])
    resumed.opt.load_state_dict(ckpt["opt"])
    resumed.monitor.load_state_dict(ckpt["monitor"])
    resumed.monitor.attach(resumed.model)
    resumed.step_index = 1
    with pytest.raises(TrainingStopped, match="at step 0 on max_logit") as resumed_stop:
        resumed.train(1)
    with pytest.raises(TrainingStopped, match="at step 0 on max_logit") as first_stop:
        first.train(1)  # the run that was not interrupted stops at the same step() call
    assert len(resumed_stop.value.alerts) == len(first_stop.value.alerts) == 8
    assert_same(first.monitor.state_dict(), resumed.monitor.state_dict())


def test_a_switch_decided_by_the_checkpoint_flush_is_saved_and_applies_at_the_same_step(monkeypatch, tmp_path):
    _defer_like_cuda(monkeypatch)
    cfg = MonitorConfig(interval=2, warmup=0, mode="own_kernel", auto_fix="fixed", auto_fix_on={"max_logit"},
                        max_logit_bound=-1000.0)
    whole = Run(cfg)
    a = _trace(whole, 5)
    first = Run(cfg)
    _trace(first, 1)
    state = first.monitor.state_dict()
    assert state["due_switches"] and state["due_alerts"]  # decided by the flush, acted on at the next step()
    torch.save({"model": first.model.state_dict(), "opt": first.opt.state_dict(), "monitor": state},
               tmp_path / "ckpt.pt")
    ckpt = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    second = Run(cfg, attach=False)
    second.model.load_state_dict(ckpt["model"])
    second.opt.load_state_dict(ckpt["opt"])
    second.monitor.attach(second.model)
    second.monitor.load_state_dict(ckpt["monitor"])
    b = [None] + _trace_from(second, 1, 5)
    assert b[1:] == a[1:]
    assert second.monitor.switches == whole.monitor.switches


def _trace_from(run, start, stop):
    """``_trace`` of steps start..stop-1 of a resumed run (batches depend on the step only)."""
    loss_of = run.loss
    run.loss = lambda t, micro=0: loss_of(t + start, micro)
    try:
        return _trace(run, stop - start)
    finally:
        run.loss = loss_of


# --- the asynchronous host copy's stream --------------------------------------------------------------

class _Stream:
    def __init__(self, device):
        self.device = device

    def __repr__(self):
        return f"stream of {self.device}"


def test_the_async_copy_and_its_event_are_on_the_stream_of_the_values_device(monkeypatch):
    """The model on cuda:1 while cuda:0 is current: the event that marks the end of the copy must be
    recorded on cuda:1's current stream, where the statistics were made and the copy runs (torch
    mocked: the CPU has no CUDA)."""
    current = {"device": 0}
    log = []

    class Device:
        def __init__(self, device):
            self.index = torch.device(device).index

        def __enter__(self):
            self.before, current["device"] = current["device"], self.index

        def __exit__(self, *exc):
            current["device"] = self.before

    class StreamContext:
        def __init__(self, stream):
            self.stream = stream

        def __enter__(self):
            log.append(("stream", self.stream.device))

        def __exit__(self, *exc):
            log.append(("stream_end", self.stream.device))

    class Event:
        def record(self, stream=None):
            log.append(("record", (stream or _Stream(current["device"])).device))

    class Host:
        def copy_(self, values, non_blocking=False):
            log.append(("copy", non_blocking))

    class Values:
        is_cuda, device, shape, dtype = True, torch.device("cuda", 1), (3,), torch.float64

    def current_stream(device=None):
        return _Stream(current["device"] if device is None else torch.device(device).index)

    monkeypatch.setattr(torch.cuda, "device", Device)
    monkeypatch.setattr(torch.cuda, "stream", StreamContext)
    monkeypatch.setattr(torch.cuda, "current_stream", current_stream)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch, "empty", lambda *a, **k: Host())
    host, event = flashwatch.collect.start_host_copy(Values(), async_transfer=True)
    assert log == [("stream", 1), ("copy", True), ("stream_end", 1), ("record", 1)]
    assert current["device"] == 0  # the caller's current device is left as it was


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_the_async_copy_from_a_second_device_is_complete_when_its_event_is():
    with torch.cuda.device(0):
        values = torch.zeros(1 << 20, dtype=torch.float64, device="cuda:1")
        with torch.cuda.device(1):
            torch.cuda._sleep(200_000_000)  # keep cuda:1's stream busy: the copy waits behind it
            values += 7.0
        host, event = flashwatch.collect.start_host_copy(values, async_transfer=True)
        event.synchronize()
        assert bool((host == 7.0).all())


@pytest.mark.gpu
def test_on_cuda_state_dict_does_not_change_what_training_does_next():
    """The real asynchronous copy: a state_dict() after a monitored step whose alert switches a
    layer leaves the variant each step runs, the alerts step() returns and the switches as they are."""
    from flashwatch.tinygpt import GPT, GPTConfig, sample_batch
    from test_monitor import DATA

    def trace(checkpoint_after):
        torch.manual_seed(0)
        model = GPT(GPTConfig(n_layer=2, n_head=4, n_embd=64, block_size=32)).cuda()
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        monitor = Monitor(MonitorConfig(interval=2, warmup=0, mode="own_kernel", auto_fix="fp32_delta",
                                        auto_fix_on={"max_logit"}, max_logit_bound=-1000.0))
        monitor.attach(model)
        out = []
        try:
            for t in range(6):
                ran = dict(monitor.variants)  # what this step runs
                x, y = sample_batch(DATA, 4, 32, generator=torch.Generator().manual_seed(1000 * t))
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = model(x.cuda(), y.cuda())[1]
                loss.backward()
                grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                opt.zero_grad()
                alerts = monitor.step(loss=loss.detach(), grad_norm=grad_norm)
                out.append((ran, [(a.step, a.rule, a.layer, a.head) for a in alerts]))
                if t == checkpoint_after:
                    monitor.state_dict()
            return out, monitor.switches
        finally:
            monitor.detach()

    plain = trace(None)
    assert plain[0][1][0] == {0: "plain", 1: "plain"} and plain[0][2][0] == {0: "fp32_delta", 1: "fp32_delta"}
    assert trace(0) == plain


# --- values that are not what they claim ----------------------------------------------------------------

def test_step_before_attach_warns_once(caplog):
    monitor = Monitor(MonitorConfig(interval=1))
    with caplog.at_level(logging.WARNING, logger="flashwatch"):
        monitor.step(loss=1.0)
        monitor.step(loss=1.0)
    lines = [r.getMessage() for r in caplog.records if "before attach" in r.getMessage()]
    assert len(lines) == 1 and "monitor.attach(model)" in lines[0]
    assert monitor.snapshot()["flashwatch_loss"] == 1.0  # the loss is still tracked


@pytest.mark.parametrize("as_tensor", [False, True])
def test_a_negative_grad_norm_is_warned_about_and_reported_as_not_measured(caplog, as_tensor):
    """A norm is never negative: training goes on, one warning names the value, the gradient norm
    reads NaN (not measured) and raises no non_finite alert; later valid values are read as usual."""
    monitor = Monitor(MonitorConfig(interval=1))
    with caplog.at_level(logging.WARNING, logger="flashwatch"):
        for _ in range(2):
            monitor.step(loss=1.0, grad_norm=torch.tensor(-2.5) if as_tensor else -2.5)
    lines = [r.getMessage() for r in caplog.records if "negative" in r.getMessage()]
    assert len(lines) == 1 and "-2.5" in lines[0]
    assert math.isnan(monitor.snapshot()["flashwatch_grad_norm"])
    assert monitor.alert_counts["non_finite"] == 0
    monitor.step(loss=1.0, grad_norm=0.75)
    assert monitor.snapshot()["flashwatch_grad_norm"] == 0.75


# --- one line per episode ---------------------------------------------------------------------------

def test_a_flapping_head_gives_one_alert_line_per_episode_in_the_log_console_and_alerts_log(tmp_path, caplog):
    """The provoked demo's flap, in shape: head 0 of layer 0 goes above the bound, dips below the
    clearing level and comes back, four times; one episode, so one line everywhere."""
    from flashwatch.exporters import ConsoleExporter, JsonlExporter

    flap = [12, 12, 5, 5, 9.5, 5, 11, 9.5, 9.5] + [5] * 8 + [11, 11, 11, 9.5] + [5] * 7 + [9.5, 5, 5, 11] + [5] * 3
    keep = Keep()
    run = Run(MonitorConfig(interval=1, max_logit_bound=10.0), attach=False,
              exporters=[keep, JsonlExporter(tmp_path), ConsoleExporter("log", log_alerts=True)])
    with caplog.at_level(logging.INFO, logger="flashwatch"):
        with run.monitor:
            run.monitor.attach(run.model)
            for t, value in enumerate(flap):
                run.loss(t).backward()
                run.opt.step()
                run.opt.zero_grad()
                for layer in run.monitor.layers:
                    layer.stats.max_logit.zero_()
                run.monitor.layers[0].stats.max_logit[0] = value
                run.monitor.step(loss=1.0)
    assert [(a.step, a.rule, a.layer, a.head) for a in run.monitor.alerts] == [(0, "max_logit", 0, 0)]
    assert [(s, new) for s, new in keep.records if new] == [(0, [("max_logit", 0, 0)])]
    messages = [r.getMessage() for r in caplog.records]
    assert sum("alert [max_logit]" in m for m in messages) == 1  # the Monitor's log line
    assert sum("max_logit" in m for m in messages if "alert [" not in m and "cleared" not in m) == 1  # the console's
    assert not any("alert cleared" in m for m in messages)  # the episode was still open at the end
    lines = (tmp_path / "alerts.log").read_text().splitlines()
    assert len(lines) == 1 and "max_logit" in lines[0]


def test_step_after_detach_is_not_called_before_attach(caplog):
    run = Run(MonitorConfig(interval=1))
    run.train(1)
    run.monitor.detach()
    with caplog.at_level(logging.WARNING, logger="flashwatch"):
        run.monitor.step(loss=1.0)
    assert not any("before attach" in r.getMessage() for r in caplog.records)


def test_a_second_monitor_on_the_same_model_takes_it_over_from_one_never_detached(caplog):
    """Attaching a Monitor to a model an earlier one still routes (a notebook cell run twice, the
    first Monitor's name rebound): the earlier one is detached from those layers with a warning, so
    its hooks stop running (and costing); the new one measures; the earlier one's detach() later
    leaves the new one's routing alone. Fail before: both Monitors' hooks stayed on every layer."""
    import torch.nn.functional as F

    from flashwatch.tinygpt import GPT, GPTConfig, sample_batch, stdlib_corpus

    sdpa = F.scaled_dot_product_attention
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16))
    first = Monitor(MonitorConfig(interval=1))
    first.attach(model)
    second = Monitor(MonitorConfig(interval=1))
    with caplog.at_level(logging.WARNING, logger="flashwatch"):
        second.attach(model)
    assert "still attached by an earlier Monitor" in caplog.text
    for block in model.transformer.h:
        assert len(block.attn._forward_pre_hooks) == 1 and len(block.attn._forward_hooks) == 1
    # the earlier one is detached, as the warning says: it neither claims the layers nor alerts on
    # the calls it no longer sees (before: it kept them and raised attention_coverage every step)
    assert first.layers == [] and first.step(loss=1.0) == []
    first.detach()  # the earlier one, detached late: nothing of the new one's routing goes
    x, y = sample_batch(stdlib_corpus(5_000), 2, 16, generator=torch.Generator().manual_seed(0))
    model(x, y)[1].backward()
    assert all(layer.stats.rows.sum() > 0 for layer in second.layers)
    second.detach()
    assert F.scaled_dot_product_attention is sdpa
    assert all(not block.attn._forward_pre_hooks for block in model.transformer.h)


def test_a_deep_copy_of_an_attached_model_is_not_measured_as_it():
    """copy.deepcopy of an attached model carries flashwatch's hooks (an EMA or a second model made
    from it): the copy's calls are not the attached layers' and are not counted under them. Fail
    before: the copy's statistics were added to the original's layers, coverage 1 where the
    original never ran."""
    import copy

    run = Run(MonitorConfig(interval=1))
    twin = copy.deepcopy(run.model)
    x, y = sample_batch(DATA, 2, 32, generator=torch.Generator().manual_seed(0))
    twin(x, y)[1].backward()
    assert all(int(layer.stats.rows.sum()) == 0 for layer in run.monitor.layers)
    assert all(int(layer.coverage[0]) == 0 for layer in run.monitor.layers)
    run.train(1)  # the original is measured as before
    assert all(v == 1.0 for v in run.monitor.snapshot()["flashwatch_attention_coverage"].values())


def test_variants_say_what_a_layer_runs_when_it_falls_back_to_sdpa():
    """Own-kernel mode on a head dimension the kernel does not take (12): the layer runs torch's
    SDPA, and ``monitor.variants`` says so, as the exported metric does (before: 'plain')."""
    from flashwatch.tinygpt import GPT, GPTConfig

    model = GPT(GPTConfig(n_layer=1, n_head=4, n_embd=48, block_size=16))
    monitor = Monitor(MonitorConfig(interval=1, mode="own_kernel"))
    monitor.attach(model)
    x, y = sample_batch(DATA, 2, 16, generator=torch.Generator().manual_seed(0))
    model(x, y)[1].backward()
    monitor.step()
    assert monitor.variants == {0: "sdpa"}
    assert monitor.snapshot()["flashwatch_kernel_variant"][(0, "sdpa")] == 1.0
    monitor.detach()


def test_a_dropped_monitor_stops_routing_a_model_that_trains_on():
    """A Monitor dropped without detach() while its model trains on: once the garbage collector
    frees it, torch's SDPA is back and its hooks are off the model (they hold it weakly). Fail
    before: the model's hooks kept it, and its interception, alive for as long as the model."""
    import gc

    import torch.nn.functional as F

    from flashwatch.tinygpt import GPT, GPTConfig, sample_batch, stdlib_corpus

    sdpa = F.scaled_dot_product_attention
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16))
    monitor = Monitor(MonitorConfig(interval=1))
    monitor.attach(model)
    x, y = sample_batch(stdlib_corpus(5_000), 2, 16, generator=torch.Generator().manual_seed(0))
    model(x, y)[1].backward()
    monitor.step()
    del monitor
    gc.collect()
    assert F.scaled_dot_product_attention is sdpa, "the dropped Monitor still intercepts SDPA"
    assert all(not block.attn._forward_pre_hooks and not block.attn._forward_hooks for block in model.transformer.h)
    model(x, y)[1].backward()  # trains on, unmonitored


def test_a_monitor_taken_off_while_a_fake_tensor_mode_traces_gives_sdpa_back():
    """A router's hooks may come off at any time (its finalizer runs when the garbage collector
    frees it), also while torch.compile traces under a fake-tensor mode. Taking them off reads no
    tensor, and torch's SDPA is given back. Fail before: reading a layer's key tensor failed there,
    the count of routers stayed up, SDPA stayed wrapped, and a later SDPA shim went unmeasured."""
    import torch.nn.functional as F
    from torch._subclasses.fake_tensor import FakeTensorMode

    from flashwatch.tinygpt import GPT, GPTConfig

    before = F.scaled_dot_product_attention
    monitor = Monitor(MonitorConfig(interval=1))
    monitor.attach(GPT(GPTConfig(n_layer=2, n_head=2, n_embd=16, block_size=8)))
    assert F.scaled_dot_product_attention is not before
    with FakeTensorMode():
        monitor._router._finalizer()  # what the garbage collector runs for a router freed there
    assert F.scaled_dot_product_attention is before
    monitor.detach()
    monitor.close()


def test_a_new_run_into_a_folder_that_holds_a_run_is_warned_about_and_a_resumed_one_is_not(tmp_path, caplog):
    from flashwatch.exporters import JsonlExporter

    first = Run(MonitorConfig(interval=1), exporters=[JsonlExporter(tmp_path)])
    first.train(2)
    state = first.monitor.state_dict()
    first.monitor.close()
    with caplog.at_level(logging.WARNING, logger="flashwatch"):
        resumed = Run(MonitorConfig(interval=1), exporters=[JsonlExporter(tmp_path)])
        resumed.monitor.load_state_dict(state)  # after attach, as a plain loop resumes
        resumed.step_index = 2
        resumed.train(1)
        resumed.monitor.close()
    assert not any("already held a run" in r.getMessage() for r in caplog.records)
    with caplog.at_level(logging.WARNING, logger="flashwatch"):
        fresh = Run(MonitorConfig(interval=1), exporters=[JsonlExporter(tmp_path)])
        fresh.train(2)
        fresh.monitor.close()
    warned = [r.getMessage() for r in caplog.records if "already held a run" in r.getMessage()]
    assert len(warned) == 1 and str(tmp_path) in warned[0]


def test_one_exporter_not_in_a_list_is_a_clear_error(tmp_path):
    from flashwatch.exporters import JsonlExporter

    with pytest.raises(TypeError, match=r"exporters must be a list of exporters, e.g. exporters=\[JsonlExporter"):
        Monitor(MonitorConfig(), exporters=JsonlExporter(tmp_path))
    with pytest.raises(TypeError, match=r"got the path 'runs/x': .* exporters=\[JsonlExporter\('runs/x'\)\]"):
        Monitor(MonitorConfig(), exporters="runs/x")
    with pytest.raises(TypeError, match=r"exporters must be a list of exporters \(flashwatch.exporters: .*got object"):
        Monitor(MonitorConfig(), exporters=object())
    # the class rather than an instance (fail before: accepted, then attach failed on a missing 'self')
    with pytest.raises(TypeError, match=r"the class JsonlExporter, not an exporter: pass an instance"):
        Monitor(MonitorConfig(), exporters=[JsonlExporter])
    from flashwatch.lightning import FlashWatchCallback

    for wrong in (JsonlExporter(tmp_path), "runs/x"):
        with pytest.raises(ValueError, match="exporters must be a list of flashwatch.exporters.Exporter instances"):
            FlashWatchCallback(exporters=wrong, port=None)


def test_a_one_element_numpy_loss_is_a_number_and_a_longer_one_an_error():
    import numpy as np

    run = Run(MonitorConfig(interval=1))
    run.loss(0).backward()
    run.monitor.step(loss=np.array(2.5), grad_norm=np.array([0.5]))
    snap = run.monitor.snapshot()
    assert snap["flashwatch_loss"] == 2.5 and snap["flashwatch_grad_norm"] == 0.5
    with pytest.raises(ValueError, match=r"loss must be a float or a one-element tensor, got a numpy array of shape \(2,\)"):
        run.monitor.step(loss=np.array([1.0, 2.0]))


def test_settings_given_to_the_monitor_itself_say_where_they_go():
    """Monitor(interval=5): the error shows the MonitorConfig to write (fail before: Python's bare
    "unexpected keyword argument")."""
    with pytest.raises(TypeError, match=r"Settings go in a MonitorConfig: Monitor\(MonitorConfig\(interval=5\)\)"):
        Monitor(interval=5)


def _damage(state: dict, what: str) -> dict:
    import copy

    state = copy.deepcopy(state)
    if what == "detectors None":
        state["detectors"] = None
    elif what == "an alert without its rule":
        state["alerts"] = [{}]
    elif what == "alert counts a list":
        state["alert_counts"] = []
    elif what == "a layer without its power vectors":
        del state["layers"][0]["power"]
    elif what == "errors None":
        state["errors"] = None
    elif what == "an unknown variant":
        state["layers"][0]["variant"] = "bogus"
    elif what == "an unknown mode":
        state["layers"][1]["mode"] = "fast"
    elif what == "last step a string":
        state["last"] = "x"
    return state


@pytest.mark.parametrize("what", ["detectors None", "an alert without its rule", "alert counts a list",
                                  "a layer without its power vectors", "errors None", "an unknown variant",
                                  "an unknown mode", "last step a string"])
def test_a_damaged_state_is_refused_with_a_clear_error_and_changes_nothing(what):
    """A state damaged in a part (a checkpoint edited by hand, written by other code): a ValueError
    that says so, and the Monitor goes on as it was. Fail before: KeyError, TypeError or
    AttributeError from deep inside, or (an unknown variant or mode, a last step that is no record)
    accepted, after which every monitored step failed or snapshot() raised."""
    saved = Run(MonitorConfig(interval=1))
    saved.train(3)
    state = saved.monitor.state_dict()
    run = Run(MonitorConfig(interval=1))
    run.train(2)
    before = run.monitor.state_dict()
    with pytest.raises(ValueError, match="saved Monitor state is damaged"):
        run.monitor.load_state_dict(_damage(state, what))
    assert_same(run.monitor.state_dict(), before)
    run.train(2)
    assert run.monitor.errors == 0 and run.monitor.failed_in_a_row == 0
    assert run.monitor.global_step == 4


def test_an_attach_that_fails_on_its_saved_state_leaves_no_exporter_open(tmp_path):
    """A state loaded before attach() that does not fit the model: attach() raises and closes what it
    opened (the port is free again, metrics.jsonl has its close record); an exporter that was open
    before that attach (a detached Monitor's) stays open. Fail before: the server kept its port and
    the file stayed open."""
    from flashwatch.exporters import JsonlExporter, PrometheusExporter
    from flashwatch.exporters.jsonl import read_jsonl
    from flashwatch.tinygpt import GPT, GPTConfig

    saved = Run(MonitorConfig(interval=1))
    saved.train(1)
    state = saved.monitor.state_dict()
    other = GPT(GPTConfig(n_layer=3, n_head=4, n_embd=64, block_size=32))
    server, jsonl = PrometheusExporter(port=0), JsonlExporter(tmp_path)
    monitor = Monitor(MonitorConfig(interval=1), exporters=[server, jsonl])
    monitor.load_state_dict(state)
    with pytest.raises(ValueError, match="the saved Monitor state has layers"):
        monitor.attach(other)
    assert server.port is None and monitor.layers == []
    assert [r["kind"] for r in read_jsonl(tmp_path, kinds=None)] == ["open", "close"]

    kept = Keep()
    detached = Monitor(MonitorConfig(interval=1), exporters=[kept])
    detached.attach(Run(MonitorConfig(), attach=False).model)
    detached.detach()  # its exporters stay open
    detached.load_state_dict(state)
    with pytest.raises(ValueError, match="the saved Monitor state has layers"):
        detached.attach(other)
    assert kept.closed == 0
    detached.close()
    assert kept.closed == 1
