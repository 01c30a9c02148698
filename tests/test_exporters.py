"""Exporters on real sockets and files: Prometheus over HTTP, JSONL, console, and the fan-out."""

from __future__ import annotations

import io
import json
import logging
import math
import socket
import time
import urllib.request

import pytest
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console
from rich.live import Live

from flashwatch.detectors import Alert
from flashwatch.exporters import Exporter, FanOut, Layout, StepRecord
from flashwatch.exporters.console import ConsoleExporter
from flashwatch.exporters.jsonl import (ALERTS_FILE, METRICS_FILE, SCHEMA, JsonlExporter, read_jsonl,
                                        validate_record)
from flashwatch.exporters.prometheus import PortInUseError, PrometheusExporter, known_rules
from flashwatch.exporters.testing import synthetic_layout, synthetic_record
from flashwatch.metrics import METRICS
from flashwatch.vocabulary import RULES

LAYOUT = synthetic_layout(num_layers=2, num_heads=3)


def drift_alert(step: int, layer: int = 1, head: int = 2, severity: str = "critical") -> Alert:
    return Alert(rule="delta_drift", step=step, layer=layer, head=head, value=4.5, threshold=4.0,
                 severity=severity, message="delta error keeps one sign")


def scrape(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as r:
        assert r.status == 200
        text = r.read().decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


@pytest.fixture
def prom():
    exporter = PrometheusExporter(port=0)
    exporter.open(LAYOUT)
    yield exporter
    exporter.close()


# -- Prometheus -----------------------------------------------------------------------------

def test_prometheus_serves_every_metric_of_the_table_over_http(prom):
    record = synthetic_record(LAYOUT, step=30, alerts=[drift_alert(30)])
    prom.export(record)
    assert prom.url == f"http://127.0.0.1:{prom.port}/metrics" and prom.port > 0
    families = scrape(prom.url)
    snap = record.snapshot
    for spec in METRICS:
        # the parser names a counter family without its _total suffix
        name = spec.name[: -len("_total")] if spec.kind == "counter" else spec.name
        assert name in families, f"{spec.name} missing from /metrics"
        fam = families[name]
        assert fam.type == spec.kind and fam.documentation == spec.help
        samples = [s for s in fam.samples if not s.name.endswith("_created")]
        if not spec.labels:
            assert [s.value for s in samples] == pytest.approx([snap[spec.name]])
            continue
        got = {tuple(s.labels[l] for l in spec.labels): s.value for s in samples}
        for s in samples:
            assert set(s.labels) == set(spec.labels), (spec.name, s.labels)
        if spec.per_head:
            assert set(got) == {(str(l), str(h)) for l in range(2) for h in range(3)}
        for key, value in snap[spec.name].items():
            assert got[tuple(str(k) for k in key)] == pytest.approx(value), (spec.name, key)
    totals = {s.labels["rule"]: s.value for s in families["flashwatch_alerts"].samples
              if s.name == "flashwatch_alerts_total"}
    assert set(totals) == set(RULES) and totals["delta_drift"] == 1
    active = families["flashwatch_alert_active"].samples
    assert [(s.labels, s.value) for s in active] == [
        ({"rule": "delta_drift", "layer": "1", "head": "2"}, 1.0)]


def test_prometheus_shows_the_latest_step_and_non_finite_values(prom):
    prom.export(synthetic_record(LAYOUT, step=10))
    record = synthetic_record(LAYOUT, step=20)
    record.snapshot["flashwatch_loss"] = math.nan
    record.snapshot["flashwatch_max_logit"][(0, 1)] = math.inf
    prom.export(record)
    families = scrape(prom.url)
    assert families["flashwatch_step"].samples[0].value == 20
    assert math.isnan(families["flashwatch_loss"].samples[0].value)
    logits = {(s.labels["layer"], s.labels["head"]): s.value for s in families["flashwatch_max_logit"].samples}
    assert logits[("0", "1")] == math.inf


def test_prometheus_before_the_first_step_serves_its_build_info_zero_alerts_and_its_start(prom):
    """Zero alert counters, so that increase() counts an alert of the first monitored step; the
    start of monitoring as the last step's time, so that stopped_reporting sees a run that hangs
    before its first monitored step. No measured value."""
    before = time.time()
    families = scrape(prom.url)
    assert set(families) - {"flashwatch_alerts_created"} == {
        "flashwatch_build_info", "flashwatch_alerts", "flashwatch_last_step_timestamp_seconds"}
    totals = {s.labels["rule"]: s.value for s in families["flashwatch_alerts"].samples if s.name.endswith("_total")}
    assert totals == {rule: 0.0 for rule in known_rules()}
    started = families["flashwatch_last_step_timestamp_seconds"].samples[0].value
    assert before - 600 < started <= before
    prom.export(synthetic_record(LAYOUT, step=3))
    assert scrape(prom.url)["flashwatch_last_step_timestamp_seconds"].samples[0].value >= started


def test_prometheus_uses_its_own_registry():
    a, b = PrometheusExporter(port=None), PrometheusExporter(port=None)
    a.export(synthetic_record(LAYOUT, step=1))
    b.export(synthetic_record(LAYOUT, step=2))
    assert a.registry.get_sample_value("flashwatch_step") == 1
    assert b.registry.get_sample_value("flashwatch_step") == 2
    assert REGISTRY.get_sample_value("flashwatch_step") is None
    assert a.port is None and a.url is None
    a.close()
    b.close()


def test_prometheus_port_in_use_is_a_clear_error_at_open():
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    try:
        exporter = PrometheusExporter(port=port)
        with pytest.raises(PortInUseError, match=rf"127.0.0.1:{port}: the port is already in use.*port=0"):
            exporter.open(LAYOUT)
        assert exporter.url is None
        exporter.close()  # nothing to close, and no error
    finally:
        holder.close()


def test_prometheus_second_exporter_on_the_same_port_fails_and_close_frees_it(prom):
    with pytest.raises(PortInUseError):
        PrometheusExporter(port=prom.port).open(LAYOUT)
    port = prom.port
    prom.close()
    prom.close()  # idempotent
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)
    again = PrometheusExporter(port=port)
    again.open(LAYOUT)  # the port is free again
    again.close()


def test_prometheus_binds_loopback_by_default(prom):
    assert prom.host == "127.0.0.1"
    assert prom._server.server_address[0] == "127.0.0.1"


@pytest.mark.parametrize("kwargs, match", [
    ({"port": -1}, r"port must be an int in 0\.\.65535"),
    ({"port": "9400"}, r"port must be an int"),
    ({"port": True}, r"port must be an int"),
    ({"host": ""}, r"host must be a non-empty address"),
    ({"pushgateway": ""}, r"pushgateway must be an http\(s\) address"),
    ({"pushgateway": "ftp://gw:9091"}, r"scheme 'ftp' is not http or https"),
    ({"pushgateway": "http://"}, r"names no host"),
    ({"pushgateway": "http://gw:99999"}, r"not a valid address"),
    ({"pushgateway": "gw 9091"}, r"names no host"),
    ({"pushgateway": 9091}, r"pushgateway must be an http\(s\) address"),
    ({"pushgateway": "http://gw:9091", "push_handler": "basic"}, r"push_handler must be"),
    ({"push_timeout_s": True}, r"push_timeout_s must be a number of seconds > 0"),
    ({"run_id": ""}, r"run_id must be a non-empty string"),
    ({"registry": {}}, r"registry must be a prometheus_client.CollectorRegistry"),
    ({"push_interval_s": -1}, r"push_interval_s must be a number >= 0"),
    ({"job": ""}, r"job must be a non-empty string"),
])
def test_prometheus_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PrometheusExporter(**kwargs)


def test_prometheus_rejects_a_malformed_snapshot_at_export():
    exporter = PrometheusExporter(port=None)
    record = synthetic_record(LAYOUT, step=0)
    record.snapshot["flashwatch_delta_drift_z"] = {(0,): 1.0}
    with pytest.raises(ValueError, match=r"flashwatch_delta_drift_z.*\(layer, head\) tuples"):
        exporter.export(record)
    record = synthetic_record(LAYOUT, step=0)
    record.snapshot["flashwatch_loss"] = "high"
    with pytest.raises(ValueError, match=r"flashwatch_loss.*must be numbers"):
        exporter.export(record)


# -- JSONL ----------------------------------------------------------------------------------

def test_jsonl_lines_validate_and_read_back(tmp_path):
    exporter = JsonlExporter(tmp_path / "run")
    exporter.open(LAYOUT)
    records = [synthetic_record(LAYOUT, step=s) for s in (0, 10)]
    records.append(synthetic_record(LAYOUT, step=20, alerts=[drift_alert(20)]))
    records[1].snapshot["flashwatch_loss"] = math.nan
    records[1].snapshot["flashwatch_delta_error"][(1, 0)] = -math.inf
    for r in records:
        exporter.export(r)
    exporter.close()

    lines = (tmp_path / "run" / METRICS_FILE).read_text().splitlines()
    assert len(lines) == 1 + len(records) + 1  # open, steps, close
    for line in lines:
        validate_record(json.loads(line))  # strict JSON: no NaN tokens
    assert [json.loads(line)["kind"] for line in lines] == ["open", "step", "step", "step", "close"]

    back = list(read_jsonl(tmp_path / "run"))
    assert [r["step"] for r in back] == [0, 10, 20]
    m = back[0]["metrics"]
    assert set(m) == {spec.name for spec in METRICS}
    assert m["flashwatch_delta_drift_z"][1][2] == pytest.approx(records[0].snapshot["flashwatch_delta_drift_z"][(1, 2)])
    assert math.isnan(back[1]["metrics"]["flashwatch_loss"])
    assert back[1]["metrics"]["flashwatch_delta_error"][1][0] == -math.inf
    assert back[2]["new_alerts"] == [drift_alert(20).to_dict()]
    assert back[2]["metrics"]["flashwatch_alert_active"] == [
        {"rule": "delta_drift", "layer": 1, "head": 2, "value": 1.0}]
    (header,) = read_jsonl(tmp_path / "run", kinds=["open"])
    assert header["layout"] == [{"name": n, "heads": h} for n, h in LAYOUT.layers]

    log_lines = (tmp_path / "run" / ALERTS_FILE).read_text().splitlines()
    assert len(log_lines) == 1
    assert "step=20 critical delta_drift layer=1 head=2 value=4.5 threshold=4" in log_lines[0]


def test_jsonl_schema_rejects_what_it_does_not_describe(tmp_path):
    exporter = JsonlExporter(tmp_path)
    exporter.open(LAYOUT)
    exporter.export(synthetic_record(LAYOUT, step=3))
    exporter.close()
    record = json.loads((tmp_path / METRICS_FILE).read_text().splitlines()[1])
    validate_record(record)
    bad = json.loads(json.dumps(record))
    del bad["metrics"]["flashwatch_wq_spectral_norm"]
    with pytest.raises(ValueError, match=r"missing required field 'flashwatch_wq_spectral_norm'"):
        validate_record(bad)
    bad = json.loads(json.dumps(record))
    bad["metrics"]["flashwatch_delta_drift_z"][0][1] = "big"
    with pytest.raises(ValueError, match=r"flashwatch_delta_drift_z\[0\]\[1\]"):
        validate_record(bad)
    assert SCHEMA["$schema"].startswith("https://json-schema.org/")


def test_jsonl_fsync_and_errors(tmp_path):
    exporter = JsonlExporter(tmp_path, fsync=True, alerts_file=None)
    exporter.open(LAYOUT)
    exporter.export(synthetic_record(LAYOUT, step=0, alerts=[drift_alert(0)]))
    exporter.close()
    assert not (tmp_path / ALERTS_FILE).exists()
    assert len(list(read_jsonl(tmp_path))) == 1

    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    with pytest.raises(OSError, match="cannot write its run files in .*a_file.*writable run_dir"):
        JsonlExporter(blocker / "run").open(LAYOUT)
    with pytest.raises(RuntimeError, match=r"export\(\) before open\(\)"):
        JsonlExporter(tmp_path).export(synthetic_record(LAYOUT))
    with pytest.raises(ValueError, match="metrics_file must be a plain file name"):
        JsonlExporter(tmp_path, metrics_file="sub/x.jsonl")
    with pytest.raises(ValueError, match="fsync must be True or False"):
        JsonlExporter(tmp_path, fsync=1)
    with pytest.raises(FileNotFoundError):
        list(read_jsonl(tmp_path / "missing"))


# -- FanOut ---------------------------------------------------------------------------------

class Broken(Exporter):
    name = "broken"

    def export(self, record):
        raise RuntimeError("dashboard down")


class Collect(Exporter):
    name = "collect"

    def __init__(self):
        self.steps, self.opened, self.closed = [], 0, 0

    def open(self, layout):
        self.opened += 1

    def export(self, record):
        self.steps.append(record.step)

    def close(self):
        self.closed += 1


def test_fanout_isolates_a_failing_exporter(caplog):
    seen = []
    good_before, good_after = Collect(), Collect()
    fan = FanOut([good_before, Broken(), good_after], on_error=lambda e, phase, exc: seen.append((e.name, phase)))
    fan.open(LAYOUT)
    with caplog.at_level(logging.DEBUG, logger="flashwatch.exporters"):
        for s in range(3):
            fan.export(synthetic_record(LAYOUT, step=s))
    fan.close()
    assert good_before.steps == good_after.steps == [0, 1, 2]
    assert good_before.closed == good_after.closed == 1
    assert fan.errors == 3 and fan.failures == {"broken": 3}
    assert seen == [("broken", "export")] * 3
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "'broken' failed in export()" in warnings[0].getMessage()


def test_an_exporter_whose_close_fails_after_other_failures_is_still_warned_about(caplog):
    """Later failures of an exporter are counted, not logged; but a failed close() is always a warning:
    its file may lack its end record (a full disk at the end of a run). Fail before: logged at DEBUG."""
    class FullDisk(Collect):
        name = "full-disk"

        def export(self, record):
            raise OSError(28, "No space left on device")

        def close(self):
            raise OSError(28, "No space left on device")

    fan = FanOut([FullDisk()])
    fan.open(LAYOUT)
    with caplog.at_level(logging.WARNING, logger="flashwatch.exporters"):
        fan.export(synthetic_record(LAYOUT, step=0))
        fan.close()
    messages = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(messages) == 2 and "failed in export()" in messages[0]
    assert "'full-disk' failed in close() too" in messages[1] and "No space left" in messages[1]


def test_fanout_open_failure_closes_what_it_opened_and_raises():
    first = Collect()
    holder = PrometheusExporter(port=0)
    holder.open(LAYOUT)
    try:
        fan = FanOut([first, PrometheusExporter(port=holder.port)])
        with pytest.raises(PortInUseError):
            fan.open(LAYOUT)
        assert first.opened == 1 and first.closed == 1
    finally:
        holder.close()
    with pytest.raises(TypeError, match="needs open\\(layout\\), export\\(record\\) and close\\(\\)"):
        FanOut([object()])


def test_layout_checks_its_entries():
    assert Layout([("a", 2), ("b", 3)]).num_heads == 5
    with pytest.raises(ValueError, match=r"Layout.layers\[1\] \('b'\): num heads must be a positive int"):
        Layout([("a", 2), ("b", 0)])
    with pytest.raises(ValueError, match=r"Layout.layers\[0\] must be a \(module name, num heads\) pair"):
        Layout([3])


# -- console --------------------------------------------------------------------------------

def test_console_plain_mode_logs_a_line_per_step_and_each_alert_once(caplog):
    exporter = ConsoleExporter(console=Console(file=io.StringIO()), log_alerts=True)  # not a terminal
    assert exporter.mode == "log"
    exporter.open(LAYOUT)
    alert = drift_alert(20)
    with caplog.at_level(logging.INFO, logger="flashwatch"):
        exporter.export(synthetic_record(LAYOUT, step=10))
        exporter.export(synthetic_record(LAYOUT, step=20, alerts=[alert]))
        held = synthetic_record(LAYOUT, step=30)
        held.active_alerts = [alert]  # still active, not new: not logged again
        exporter.export(held)
    exporter.close()
    steps = [r.getMessage() for r in caplog.records if r.name == "flashwatch"]
    assert len(steps) == 3 and steps[0].startswith("flashwatch step 10: loss ")
    assert "top |drift z| L" in steps[0] and "max W^Q norm" in steps[0] and "variants sdpax2" in steps[0]
    assert "active alerts 1" in steps[2]
    alerts = [r for r in caplog.records if r.name == "flashwatch.alerts"]
    assert len(alerts) == 1 and alerts[0].levelno == logging.ERROR
    assert "delta_drift layer 1 head 2 at step 20" in alerts[0].getMessage()


def test_console_leaves_alert_logging_to_the_monitor_by_default(caplog):
    exporter = ConsoleExporter(console=Console(file=io.StringIO()))
    exporter.open(LAYOUT)
    with caplog.at_level(logging.INFO, logger="flashwatch"):
        exporter.export(synthetic_record(LAYOUT, step=20, alerts=[drift_alert(20)]))
    exporter.close()
    assert [r.name for r in caplog.records] == ["flashwatch"]  # the step line only


def test_console_routes_flashwatch_warnings_through_rich_on_a_terminal():
    flashwatch_log = logging.getLogger("flashwatch")
    if flashwatch_log.hasHandlers():  # pytest's capture handler sits on the root logger
        root_handlers = logging.getLogger().handlers[:]
        logging.getLogger().handlers.clear()
    else:
        root_handlers = []
    try:
        buf = io.StringIO()
        exporter = ConsoleExporter(console=Console(file=buf, force_terminal=True, width=200))
        exporter.open(LAYOUT)
        flashwatch_log.warning("flashwatch alert [delta_drift] step 3: drifting")
        exporter.close()
        assert "drifting" in buf.getvalue()
        assert not flashwatch_log.handlers  # removed at close
    finally:
        logging.getLogger().handlers[:] = root_handlers


def test_console_live_mode_on_a_terminal_and_fallback_when_the_terminal_is_taken():
    buf = io.StringIO()
    console = Console(file=buf, force_terminal=True, width=120)
    exporter = ConsoleExporter(console=console, top=3)
    assert exporter.mode == "live"
    exporter.open(LAYOUT)
    exporter.export(synthetic_record(LAYOUT, step=10, alerts=[drift_alert(10, severity="warning")]))
    exporter.close()
    out = buf.getvalue()
    assert "top 3 heads by |drift z|" in out and "active alerts" in out and "sdpa on layers 0-1" in out

    other = ConsoleExporter("live", console=console)
    other.open(LAYOUT)
    with Live("a progress bar", console=console):
        other.export(synthetic_record(LAYOUT, step=20))  # nests (rich >= 14) or prints: never raises
        other.export(synthetic_record(LAYOUT, step=30))
    assert other.mode in ("live", "print")
    other.close()
    with pytest.raises(ValueError, match="mode must be one of auto, live, print, log"):
        ConsoleExporter("fancy")
    with pytest.raises(ValueError, match="top must be a positive int"):
        ConsoleExporter(top=0)


def test_console_marks_the_heads_the_monitor_decided_are_drifting():
    exporter = ConsoleExporter(console=Console(file=io.StringIO()), top=6)
    record = synthetic_record(LAYOUT, step=10, alerts=[drift_alert(10, layer=1, head=2, severity="warning")])
    record.snapshot["flashwatch_delta_drift_z"][(0, 1)] = math.nan
    heads = exporter.render(record).renderables[1]
    cells = [[c._cells[i] for c in heads.columns[:2]] for i in range(heads.row_count)]
    styles = {(int(layer), int(head)): row.style for (layer, head), row in zip(cells, heads.rows)}
    assert len(styles) == 6
    # red: the head with an active delta_drift alert (the Monitor's decision) and a non-finite z
    assert {k for k, style in styles.items() if style == "bold red"} == {(1, 2), (0, 1)}


def test_exporters_read_only_the_vocabulary_and_the_metric_table():
    import subprocess
    import sys

    code = ("import sys, flashwatch.exporters.prometheus, flashwatch.exporters.console, "
            "flashwatch.exporters.jsonl, flashwatch.exporters.testing, flashwatch.exporters.summary; "
            "loaded = sorted(m for m in sys.modules if m.startswith('flashwatch') and "
            "not m.startswith('flashwatch.exporters')); "
            "assert loaded == ['flashwatch', 'flashwatch.metrics', 'flashwatch.vocabulary'], loaded; "
            "assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_step_record_defaults():
    r = StepRecord(step=1, time=0.0, snapshot={})
    assert r.new_alerts == [] and r.active_alerts == []


@pytest.mark.parametrize("load_before_attach", [False, True])
def test_a_resumed_run_serves_its_saved_counters_before_its_first_step(load_before_attach):
    """Prometheus after a resume, before the first monitored step: the saved alert counters,
    active alerts and step, not a fresh run's zeros. Fail before: flashwatch_alerts_total read 0
    until the first step and then jumped back, which Prometheus reads as a counter reset followed
    by as many new alerts (the dashboard's alert panels counted them twice)."""
    import torch

    from flashwatch import Monitor, MonitorConfig
    from flashwatch.tinygpt import GPT, GPTConfig

    def model():
        torch.manual_seed(0)
        return GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=16))

    first = model()
    monitor = Monitor(MonitorConfig(interval=1, max_logit_bound=-1e3))  # every head alerts at step 0
    monitor.attach(first)
    for _ in range(2):
        x = torch.randint(0, 256, (2, 16))
        first(x, x)[1].backward()
        monitor.step(loss=1.0)
    state = monitor.state_dict()
    saved = dict(monitor.alert_counts)
    monitor.close()
    assert saved["max_logit"] == 2

    prom = PrometheusExporter(port=None)
    resumed = Monitor(MonitorConfig(interval=1, max_logit_bound=-1e3), exporters=[prom])
    if load_before_attach:
        resumed.load_state_dict(state)
    resumed.attach(model())
    if not load_before_attach:
        resumed.load_state_dict(state)
    reg = prom.registry
    for rule, n in saved.items():
        assert reg.get_sample_value("flashwatch_alerts_total", {"rule": rule}) == n, rule
    assert reg.get_sample_value("flashwatch_step") == 1
    assert reg.get_sample_value("flashwatch_alert_active", {"rule": "max_logit", "layer": "0", "head": "1"}) == 1
    resumed.close()
