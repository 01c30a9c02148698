"""End to end against a real Prometheus: the dashboard's and the alert rules' PromQL answer with data.

A real Prometheus server (Debian package ``prometheus``) is started by the test on a free
loopback port, with a temporary config made from ``dashboards/prometheus.yml`` (the committed
rules file loaded, scrape target pointed at the exporter) and a temporary storage folder. It
scrapes a ``PrometheusExporter`` fed by a short real training run: a tiny GPT on the CPU with a
``Monitor`` (max-logit bound -1000, so a real alert fires on every head and the alert series
exist). Then every PromQL expression of the dashboard and of the alert rules goes through
``/api/v1/query``.

The alert rules fire on the Monitor's exported decisions: every rule's expression must
evaluate; ``FlashwatchMaxLogit`` must be firing in Prometheus for exactly the heads whose
``max_logit`` alert the Monitor holds, with its description templated (layer, head, the max
logit read back by the template's query); the other rules, and ``FlashwatchStoppedReporting``
on this live run, must be quiet. A dashboard expression that ends in a comparison with a
number and comes back empty is judged by the part before the comparison; the test prints which
ones.

Skipped, with the reason, when the ``prometheus`` or ``promtool`` binaries are missing
(``make test`` installs them as root with apt-get).
"""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import torch
import yaml

from flashwatch.metrics import METRICS

pytestmark = pytest.mark.prometheus

DASHBOARDS = Path(__file__).resolve().parents[1] / "dashboards"
PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")
needs_prometheus = pytest.mark.skipif(
    PROMETHEUS is None, reason="the prometheus binary is not installed (apt-get install -y prometheus)")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="the promtool binary is not installed (apt-get install -y prometheus)")
# Grafana's variables as a dashboard with every variable on "All" sends them
GRAFANA_VARS = {"$job": ".+", "$instance": ".+", "$layer": ".+", "$head": ".+", "$__rate_interval": "1m",
                "$__range": "1h"}
TRAILING_COMPARISON = re.compile(r"^(?P<inner>.*?)\s*(==|!=|>=|<=|>|<)\s*-?[0-9.]+$", re.S)


def _builder():
    from test_dashboards import load_builder

    return load_builder()


def _promtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=60, cwd=DASHBOARDS)


@needs_promtool
def test_promtool_checks_and_unit_tests_the_rules():
    for args in (("check", "rules", "alerts.yml"), ("test", "rules", "alerts_test.yml"),
                 ("check", "config", "prometheus.yml")):
        r = _promtool(*args)
        assert r.returncode == 0, f"promtool {' '.join(args)} failed:\n{r.stdout}\n{r.stderr}"
        assert "SUCCESS" in r.stdout + r.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, timeout: float = 5.0) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def _query(base: str, expr: str) -> list:
    body = _get(f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expr}))
    assert body["status"] == "success", (expr, body)
    return body["data"]["result"]


def _wait(what: str, ok, timeout: float) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            if ok():
                return
        except (OSError, urllib.error.URLError, KeyError, IndexError, ValueError):
            pass
        time.sleep(0.25)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def _train(monitor, steps: int, pause_s: float) -> None:
    """A tiny GPT trained on the CPU for ``steps`` optimizer steps with the monitor attached."""
    from flashwatch.tinygpt import GPT, GPTConfig, sample_batch, stdlib_corpus

    torch.manual_seed(0)
    data = stdlib_corpus(100_000)
    model = GPT(GPTConfig(n_layer=2, n_head=4, n_embd=64, block_size=32))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    monitor.attach(model)
    for step in range(steps):
        x, y = sample_batch(data, 4, 32, generator=torch.Generator().manual_seed(step))
        _, loss = model(x, y)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        monitor.step(loss=loss.detach(), grad_norm=grad_norm)
        time.sleep(pause_s)  # let Prometheus scrape several steps of the run


@needs_prometheus
@needs_promtool
def test_every_dashboard_and_rule_expression_returns_data(tmp_path):
    from flashwatch import Monitor, MonitorConfig
    from flashwatch.exporters import PrometheusExporter

    builder = _builder()
    exporter = PrometheusExporter(port=0)
    monitor = Monitor(MonitorConfig(interval=2, max_logit_bound=-1e3), exporters=[exporter])
    prom_port = _free_port()
    base = f"http://127.0.0.1:{prom_port}"
    proc = None
    try:
        # the exporter must listen before Prometheus's first scrape: open it now
        exporter.open(None)
        config = yaml.safe_load((DASHBOARDS / "prometheus.yml").read_text())
        config["global"].update(scrape_interval="1s", evaluation_interval="1s")
        config["rule_files"] = [str(DASHBOARDS / f) for f in config["rule_files"]]
        config["scrape_configs"][0]["static_configs"][0]["targets"] = [f"127.0.0.1:{exporter.port}"]
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
        log = open(tmp_path / "prometheus.log", "w")
        proc = subprocess.Popen(
            [PROMETHEUS, f"--config.file={tmp_path / 'prometheus.yml'}",
             f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{prom_port}",
             "--log.level=warn"],
            stdout=log, stderr=subprocess.STDOUT)
        _wait("Prometheus to be ready", lambda: urllib.request.urlopen(f"{base}/-/ready", timeout=2).status == 200,
              timeout=60)

        steps = 24
        _train(monitor, steps, pause_s=0.15)
        last = float((steps - 1) // 2 * 2)
        _wait(f"a scrape of step {last:g}",
              lambda: float(_query(base, "flashwatch_step")[0]["value"][1]) == last, timeout=30)
        # increase() and changes() need two samples: on a busy machine the first scrape may come late
        _wait("a second scrape", lambda: float(
            _query(base, "count_over_time(flashwatch_step[1h])")[0]["value"][1]) >= 2, timeout=30)
        _wait("the rules to be evaluated", lambda: all(
            r["health"] == "ok" and r["lastEvaluation"][:4] != "0001"
            for g in _get(f"{base}/api/v1/rules")["data"]["groups"] for r in g["rules"]), timeout=30)

        # every metric of the table was scraped, per-head ones with every (layer, head)
        for spec in METRICS:
            name = spec.name
            result = _query(base, name)
            assert result, f"{name}: no series in Prometheus"
            if spec.per_head:
                heads = {(r["metric"]["layer"], r["metric"]["head"]) for r in result}
                assert heads == {(str(l), str(h)) for l in range(2) for h in range(4)}, name
        assert float(_query(base, 'flashwatch_alerts_total{rule="max_logit"}')[0]["value"][1]) == 8

        judged_by_inner = []
        for where, expr in builder.expressions(builder.dashboard()):
            for var, value in GRAFANA_VARS.items():
                expr = expr.replace(var, value)
            result = _query(base, expr)
            if not result:
                m = TRAILING_COMPARISON.match(expr)
                assert m, f"{where}: {expr!r} returned no data"
                judged_by_inner.append(where)
                result = _query(base, m["inner"])
            assert result, f"{where}: {expr!r} returned no data"

        rules = builder.build_alerts.alert_rules()
        for rule in rules:
            _query(base, rule["expr"])  # valid PromQL
        loaded = [r["name"] for g in _get(f"{base}/api/v1/rules")["data"]["groups"] for r in g["rules"]]
        assert loaded == [r["alert"] for r in rules]
        # Prometheus fires what the Monitor decided, on the same heads, and nothing else
        held = {(str(a.layer), str(a.head)) for a in monitor.active_alerts if a.rule == "max_logit"}
        assert len(held) == 8 and {a.rule for a in monitor.active_alerts} == {"max_logit"}
        _wait("FlashwatchMaxLogit to fire", lambda: len([
            a for a in _get(f"{base}/api/v1/alerts")["data"]["alerts"] if a["state"] == "firing"]) == 8, timeout=30)
        firing = [a for a in _get(f"{base}/api/v1/alerts")["data"]["alerts"] if a["state"] == "firing"]
        assert {a["labels"]["alertname"] for a in firing} == {"FlashwatchMaxLogit"}
        assert {(a["labels"]["layer"], a["labels"]["head"]) for a in firing} == held
        for a in firing:
            layer, head = a["labels"]["layer"], a["labels"]["head"]
            assert a["labels"]["severity"] == "warning" and a["annotations"]["runbook_url"].endswith("#max_logit")
            assert re.fullmatch(rf"flashwatch/127\.0\.0\.1:\d+ layer {layer} head {head}: the Monitor's max_logit "
                                r"alert holds; flashwatch_max_logit is [-0-9.e+]+ now\.",
                                a["annotations"]["description"]), a["annotations"]["description"]
        print(f"dashboard expressions judged by the part before their comparison: {judged_by_inner}")
    finally:
        monitor.close()
        monitor.detach()  # give torch's SDPA back: later tests check it is restored
        exporter.close()
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
