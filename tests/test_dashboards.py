"""The Grafana dashboard and the Prometheus rules follow the metric table, and are current."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest
import yaml

from flashwatch.config import MonitorConfig
from flashwatch.detectors import RULES, build_detectors
from flashwatch.metrics import METRICS, exported_names

DASHBOARDS = Path(__file__).resolve().parents[1] / "dashboards"
KNOWN = {n for m in METRICS for n in exported_names(m)}
METRIC_TOKEN = re.compile(r"\b(flashwatch_[a-z0-9_]+)")


def load_builder():
    spec = importlib.util.spec_from_file_location("build_dashboard", DASHBOARDS / "build_dashboard.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def builder():
    return load_builder()


@pytest.fixture(scope="module")
def dash():
    return json.loads((DASHBOARDS / "flashwatch.json").read_text())


@pytest.fixture(scope="module")
def rules():
    return yaml.safe_load((DASHBOARDS / "alerts.yml").read_text())["groups"][0]["rules"]


def test_committed_files_are_the_generated_ones(builder):
    for path, text in builder.outputs().items():
        assert path.read_text() == text, f"{path.name} is stale: run python dashboards/build_dashboard.py"


def test_every_metric_name_in_the_dashboard_is_in_the_table(builder, dash):
    exprs = builder.expressions(dash)
    assert len(exprs) >= 15
    used = set()
    for where, expr in exprs:
        names = METRIC_TOKEN.findall(expr)
        assert names, f"{where}: {expr!r} reads no flashwatch metric"
        unknown = set(names) - KNOWN
        assert not unknown, f"{where}: {sorted(unknown)} not in flashwatch/metrics.py"
        used |= set(names)
    per_head = {m.name for m in METRICS if m.per_head}
    heatmaps = {METRIC_TOKEN.findall(p["targets"][0]["expr"])[0] for p in dash["panels"] if p["type"] == "heatmap"}
    assert heatmaps == per_head - {"flashwatch_delta_error", "flashwatch_delta_error_cumulative"}
    for name in ("flashwatch_loss", "flashwatch_kernel_variant", "flashwatch_alert_active",
                 "flashwatch_alerts_total"):
        assert name in used, f"the dashboard shows no {name}"


def test_dashboard_is_portable(dash):
    assert dash["id"] is None
    templating = {v["name"]: v for v in dash["templating"]["list"]}
    ds = templating["DS_PROMETHEUS"]
    assert ds["type"] == "datasource" and ds["query"] == "prometheus"
    for name in ("layer", "head", "instance"):
        assert templating[name]["query"]["query"].startswith("label_values("), name
        assert templating[name]["datasource"]["uid"] == "${DS_PROMETHEUS}"
    ds_refs = [dash["annotations"]["list"][1]["datasource"]]
    for p in dash["panels"]:
        ds_refs.append(p["datasource"])
        ds_refs += [t["datasource"] for t in p["targets"]]
    assert all(d == {"type": "prometheus", "uid": "${DS_PROMETHEUS}"} for d in ds_refs)
    # nothing refers to a datasource of the machine the dashboard was made on
    assert '"uid": "flashwatch-prometheus"' not in json.dumps(dash)


def test_every_panel_has_a_unit_and_per_metric_units_follow_the_table(dash):
    by_name = {m.name: m for m in METRICS}
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for p in dash["panels"]:
        unit = p["fieldConfig"]["defaults"].get("unit")
        assert unit, f"panel {p['title']!r} has no unit"
        if p["type"] == "heatmap":
            metric = METRIC_TOKEN.findall(p["targets"][0]["expr"])[0]
            assert unit == by_name[metric].unit, p["title"]
    ratio = next(p for p in dash["panels"] if p["title"].startswith("Repeated-max ratio, BF16"))
    assert ratio["fieldConfig"]["defaults"]["unit"] == "percentunit"


def test_alert_rules_mirror_the_detectors(builder, rules):
    assert [r["labels"]["rule"] for r in rules] == list(RULES)
    severity = {d.rule: d.severity for d in build_detectors(MonitorConfig())}
    for r in rules:
        assert r["labels"]["severity"] == severity[r["labels"]["rule"]], r["alert"]
        names = METRIC_TOKEN.findall(r["expr"])
        assert names and set(names) <= KNOWN, (r["alert"], names)
        assert r["annotations"]["summary"] and r["annotations"]["description"]
        assert re.fullmatch(r"\d+m", r["for"])
    exprs = {r["labels"]["rule"]: r["expr"] for r in rules}
    cfg = MonitorConfig()
    assert f"abs(flashwatch_delta_drift_z) >= {cfg.drift_threshold:g}" in exprs["delta_drift"]
    assert f">= {cfg.max_logit_bound:g}" in exprs["max_logit"]
    assert f">= {cfg.wq_outlier_ratio:g}" in exprs["wq_outlier"]
    assert f">= {cfg.wq_growth_factor:g}" in exprs["wq_growth"]
    assert f"flashwatch_step >= {cfg.warmup * cfg.interval}" in exprs["delta_drift"]
    for rule in builder.alert_rules():
        for inner in rule.inner:
            assert set(METRIC_TOKEN.findall(inner)) <= KNOWN


def test_prometheus_config_scrapes_the_demo_port_and_loads_the_rules():
    cfg = yaml.safe_load((DASHBOARDS / "prometheus.yml").read_text())
    assert cfg["rule_files"] == ["alerts.yml"]
    (job,) = cfg["scrape_configs"]
    assert job["static_configs"][0]["targets"] == ["127.0.0.1:9400"]
    ds = yaml.safe_load((DASHBOARDS / "provisioning/datasources/flashwatch.yml").read_text())
    assert ds["datasources"][0]["type"] == "prometheus"
    prov = yaml.safe_load((DASHBOARDS / "provisioning/dashboards/flashwatch.yml").read_text())
    assert prov["providers"][0]["type"] == "file"
