"""The Grafana dashboard, the Prometheus rules and the runbook follow the metric table and the
vocabulary, and the committed copies are the generated ones."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from flashwatch.metrics import ALL_METRICS, METRICS, exported_names
from flashwatch.vocabulary import (ALERT_SPECS, RULE_SPECS, RULES, SEVERITY, STOPPED_REPORTING, VARIANT_CODE,
                                   markdown_table)

DASHBOARDS = Path(__file__).resolve().parents[1] / "dashboards"
KNOWN = {n for m in ALL_METRICS for n in exported_names(m)}
METRIC_TOKEN = re.compile(r"\b(flashwatch_[a-z0-9_]+)")
DS = {"type": "prometheus", "uid": "${datasource}"}


def load_builder():
    """dashboards/build_dashboard.py as a module (it imports build_alerts from beside itself)."""
    spec = importlib.util.spec_from_file_location("build_dashboard", DASHBOARDS / "build_dashboard.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
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
    files = builder.outputs()
    assert {p.name for p in files} == {"flashwatch.json", "alerts.yml", "ALERTS.md"}
    for path, text in files.items():
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
                 "flashwatch_alerts_total", "flashwatch_attention_coverage"):
        assert name in used, f"the dashboard shows no {name}"


def test_dashboard_is_portable_and_passes_the_linter_rules(builder, dash):
    """The Grafana dashboard-linter's rules, checked here (the linter itself is a Go program)."""
    assert dash["id"] is None
    assert dash["editable"] is False  # uneditable-dashboard: change the generator, not the dashboard
    templating = {v["name"]: v for v in dash["templating"]["list"]}
    # template-datasource-rule: one datasource variable, named `datasource`
    assert [v["name"] for v in templating.values() if v["type"] == "datasource"] == ["datasource"]
    assert templating["datasource"]["query"] == "prometheus"
    assert templating["datasource"]["label"] == "Data source"
    # template-job-rule and template-instance-rule (layer and head follow them)
    for name in ("job", "instance", "layer", "head"):
        v = templating[name]
        assert v["type"] == "query" and v["datasource"] == DS, name
        assert v["label"] == name.capitalize(), name
        assert v["multi"] and v["includeAll"] and v["allValue"] == ".+", name
        assert v["refresh"] == 2, name  # template-on-time-change-reload-rule
        assert re.fullmatch(r"label_values\(.+\)", v["query"]["query"]), name  # template-label-promql-rule
    # panel-datasource-rule, for every panel, target and annotation
    refs = [a["datasource"] for a in dash["annotations"]["list"] if "expr" in a]
    for p in dash["panels"]:
        refs.append(p["datasource"])
        refs += [t["datasource"] for t in p["targets"]]
    assert refs and all(d == DS for d in refs)
    assert '"uid": "flashwatch-prometheus"' not in json.dumps(dash)  # nothing of the machine it was made on
    # panel-title-description-rule
    for p in dash["panels"]:
        assert p["title"] and p["description"], p["id"]
    exprs = [(w, e) for w, e in builder.expressions(dash) if not w.startswith("variable")]
    assert len(exprs) >= 15
    for where, expr in exprs:
        # target-job-rule, target-instance-rule: every selector matches $job and $instance
        for selector in re.findall(r"\bflashwatch_[a-z0-9_]+(?:\{[^}]*\})?", expr):
            assert 'job=~"$job"' in selector and 'instance=~"$instance"' in selector, (where, selector)
        # target-counter-agg-rule: a counter only inside rate/irate/increase of a range
        for m in re.finditer(r"\bflashwatch_[a-z0-9_]+_total\b", expr):
            assert re.search(r"\b(rate|irate|increase)\($", expr[:m.start()]), (where, expr)
            assert re.match(r"\{[^}]*\}\[[^\]]+\]\)", expr[m.end():]), (where, expr)
        # target-rate-interval-rule
        for m in re.finditer(r"\b(i?rate)\([^\[]*\[([^\]]+)\]", expr):
            assert m.group(2) == "$__rate_interval", (where, expr)


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


def test_dashboard_reads_the_vocabulary(dash):
    by_title = {p["title"]: p for p in dash["panels"]}
    variants = by_title["Kernel variant per layer"]
    mapping = variants["fieldConfig"]["defaults"]["mappings"][0]["options"]
    assert {v["text"]: int(code) for code, v in mapping.items()} == VARIANT_CODE
    for v, code in VARIANT_CODE.items():
        assert f'variant="{v}"}} == 1) * {code}' in variants["targets"][0]["expr"]
    rule_column = by_title["Active alerts"]["fieldConfig"]["overrides"][0]
    assert rule_column["matcher"]["options"] == "rule"
    mappings = rule_column["properties"][0]["value"]
    assert [next(iter(m["options"].items())) for m in mappings] == [
        (r.name, {"text": f"{r.name} ({r.severity})", "color": {"warning": "orange", "critical": "red"}[r.severity],
                  "index": i}) for i, r in enumerate(RULE_SPECS)]
    colours = {o["matcher"]["options"]: o["properties"][0]["value"]["fixedColor"]
               for o in by_title["Alerts raised in the time range, by rule"]["fieldConfig"]["overrides"]}
    assert colours == {r.name: {"warning": "orange", "critical": "red"}[r.severity] for r in RULE_SPECS}


def test_alert_rules_fire_on_the_monitors_decisions(rules):
    assert [r["alert"] for r in rules] == [s.alert for s in ALERT_SPECS]
    assert [r["labels"]["rule"] for r in rules] == [*RULES, STOPPED_REPORTING.name]
    for r, spec in zip(rules, ALERT_SPECS):
        assert r["labels"] == {"rule": spec.name, "severity": spec.severity}, r["alert"]
        names = METRIC_TOKEN.findall(r["expr"])
        assert names and set(names) <= KNOWN, (r["alert"], names)
        assert r["annotations"]["summary"] == spec.summary and "\n" not in spec.summary
        assert r["annotations"]["runbook_url"] == f"docs/ALERTS.md#{spec.name}"
        description = r["annotations"]["description"]
        assert "{{ $labels.instance }}" in description, r["alert"]
        if spec.scope != "run":
            assert "{{ $labels.layer }}" in description, r["alert"]
        if spec.scope in ("head", "head or run"):
            assert "{{ $labels.head }}" in description, r["alert"]
        if spec.name in RULES:
            # the Monitor decides; Prometheus relays (no threshold of its own to drift apart)
            assert r["expr"] == f'flashwatch_alert_active{{rule="{spec.name}"}} == 1'
            assert r["for"] == "0m" and SEVERITY[spec.name] == spec.severity
            if spec.signal:
                assert f"`{spec.signal}{{" in description and "| query" in description, r["alert"]
    stopped = rules[-1]
    # the age of the last monitored step, while Prometheus still reaches the endpoint
    age = re.fullmatch(r"time\(\) - flashwatch_last_step_timestamp_seconds > (\d+) and on\(job, instance\) up == 1",
                       stopped["expr"])
    assert age and int(age.group(1)) >= 600, stopped["expr"]
    assert "{{ $value | humanizeDuration }}" in stopped["annotations"]["description"]  # the age
    assert "`flashwatch_step{" in stopped["annotations"]["description"]  # and the last step


def test_runbook_has_a_section_per_alert_with_the_tables_text():
    text = (DASHBOARDS.parent / "docs" / "ALERTS.md").read_text()
    assert markdown_table(link="#") in text
    sections = re.split(r"^## ", text, flags=re.M)[1:]
    assert [s.split("\n", 1)[0] for s in sections] == [spec.name for spec in ALERT_SPECS]  # the anchors
    for section, spec in zip(sections, ALERT_SPECS):
        for part in (spec.summary, spec.meaning, spec.action, spec.alert, f"**{spec.severity}**"):
            assert part in section, (spec.name, part)
        for setting in spec.settings:
            assert f"`{setting}=" in section, (spec.name, setting)


def test_promtool_tests_cover_every_alert():
    tests = yaml.safe_load((DASHBOARDS / "alerts_test.yml").read_text())["tests"]
    cases = [case for t in tests for case in t["alert_rule_test"]]
    assert {c["alertname"] for c in cases if c["exp_alerts"]} == {s.alert for s in ALERT_SPECS}
    # and where it must stay quiet: before the decision, after it cleared, on a healthy run
    assert {c["alertname"] for c in cases if not c["exp_alerts"]} >= {
        "FlashwatchDeltaDrift", "FlashwatchRepeatedMaxRise", "FlashwatchNonFinite", "FlashwatchLossSpike",
        "FlashwatchStoppedReporting"}


def test_prometheus_config_scrapes_the_demo_port_and_loads_the_rules():
    cfg = yaml.safe_load((DASHBOARDS / "prometheus.yml").read_text())
    assert cfg["rule_files"] == ["alerts.yml"]
    (job,) = cfg["scrape_configs"]
    assert job["static_configs"][0]["targets"] == ["127.0.0.1:9400"]
    ds = yaml.safe_load((DASHBOARDS / "provisioning/datasources/flashwatch.yml").read_text())
    assert ds["datasources"][0]["type"] == "prometheus"
    prov = yaml.safe_load((DASHBOARDS / "provisioning/dashboards/flashwatch.yml").read_text())
    assert prov["providers"][0]["type"] == "file"


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed (make prometheus)")
def test_the_guides_chain_score_expression_is_the_smaller_of_its_two_terms(tmp_path):
    """docs/GUIDE.md's PromQL for the run's `chain` score: per head the smaller of coherence / 0.52
    and |drift z| / 4.5, then the run's largest head (a max instead of the min would read 2.0); a head
    whose coherence is not measured (NaN) has no score (before: |z| / 4.5 alone, here 2.2)."""
    guide = (DASHBOARDS.parent / "docs/GUIDE.md").read_text()
    expr = guide.split("```promql\n", 1)[1].split("```", 1)[0]
    assert "flashwatch_wq_error_coherence / 0.52" in expr and "abs(flashwatch_delta_drift_z) / 4.5" in expr
    rule = "\n".join("      " + line for line in expr.strip().splitlines())
    (tmp_path / "rules.yml").write_text(
        "groups:\n- name: guide\n  rules:\n  - record: run:flashwatch_chain_score:max\n    expr: |\n" + rule + "\n")
    heads = {("0", "0"): (0.26, -9), ("0", "1"): (1.04, 2.25), ("1", "0"): (0.78, 9),  # min: 0.5, 0.5, 1.5
             ("1", "1"): ("NaN", 9.9)}  # not measured: no score
    series = "".join(
        f"  - series: 'flashwatch_wq_error_coherence{{job=\"j\",instance=\"i\",layer=\"{l}\",head=\"{h}\"}}'\n"
        f"    values: '{c} {c}'\n"
        f"  - series: 'flashwatch_delta_drift_z{{job=\"j\",instance=\"i\",layer=\"{l}\",head=\"{h}\"}}'\n"
        f"    values: '{z} {z}'\n" for (l, h), (c, z) in heads.items())
    (tmp_path / "test.yml").write_text(
        "rule_files: [rules.yml]\nevaluation_interval: 1m\ntests:\n- interval: 1m\n  input_series:\n" + series +
        "  promql_expr_test:\n  - expr: run:flashwatch_chain_score:max\n    eval_time: 1m\n    exp_samples:\n"
        "    - labels: 'run:flashwatch_chain_score:max{job=\"j\",instance=\"i\"}'\n      value: 1.5\n")
    out = subprocess.run(["promtool", "test", "rules", "test.yml"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_heads_table_queries_merge_into_one_row_per_head(dash):
    """Grafana's merge joins the rows of several table queries on the labels they share: a raw
    selector carries its own __name__, which would keep each query's rows apart (six half-empty
    rows per head). Every query aggregates, which drops the name."""
    (panel,) = [p for p in dash["panels"] if p.get("title") == "Heads now (layer x head)"]
    exprs = [t["expr"] for t in panel["targets"]]
    assert len(exprs) == 6 and all(re.match(r"max without \(\) \(flashwatch_\w+\{", e) for e in exprs), exprs
