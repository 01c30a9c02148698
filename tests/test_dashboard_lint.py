"""The rest of the Grafana dashboard-linter's rule set on the generated dashboard (the template,
datasource, job/instance, counter and rate-interval rules are in test_dashboards.py): every query
variable is used, every data panel has queries and a valid unit, and every query parses as PromQL
(checked by promtool, skipped without it)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

DASHBOARDS = Path(__file__).resolve().parents[1] / "dashboards"
DATA_PANELS = {"stat", "singlestat", "graph", "table-old", "timeseries", "gauge"}  # the linter's unit/target set
# Grafana unit ids (grafana-data valueFormats) that a flashwatch panel may use
GRAFANA_UNITS = {"none", "short", "percent", "percentunit", "sci", "locale", "s", "ms", "µs", "ns", "m", "h", "d",
                 "dtdurations", "dtdurationms", "dateTimeAsIso", "dateTimeFromNow", "bytes", "bool"}


@pytest.fixture(scope="module")
def dash():
    return json.loads((DASHBOARDS / "flashwatch.json").read_text())


def _unit(panel: dict) -> str:
    """The unit the linter reads: a unit override first, else the default."""
    for override in panel["fieldConfig"].get("overrides", []):
        for prop in override.get("properties", []):
            if prop["id"] == "unit":
                return prop["value"]
    return panel["fieldConfig"]["defaults"].get("unit", "")


def test_panel_units_rule(dash):
    checked = 0
    for p in dash["panels"]:
        if p["type"] not in DATA_PANELS:
            continue
        if p["type"] == "stat" and p["options"].get("reduceOptions", {}).get("fields", "") != "":
            continue  # a non-numeric stat: the linter skips it
        if p["fieldConfig"]["defaults"].get("mappings"):
            continue  # value mappings replace the unit
        assert _unit(p) in GRAFANA_UNITS, (p["title"], _unit(p))
        checked += 1
    assert checked >= 4


def test_panel_no_targets_rule(dash):
    for p in dash["panels"]:
        if p["type"] not in ("row", "text"):
            assert p.get("targets"), f"panel {p['title']!r} has no queries"
            assert all(t.get("expr") for t in p["targets"]), p["title"]


def test_template_unused_rule(dash):
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    for v in dash["templating"]["list"]:
        if v["type"] != "query":
            continue
        used = re.compile(rf"\$({v['name']})\b|\$\{{{v['name']}(:[^}}]+)?\}}|\[\[{v['name']}\]\]")
        assert any(used.search(e) for e in exprs), f"variable {v['name']!r} is used by no panel"


def test_variables_chain_job_then_instance(dash):
    # each variable's values are those of the variables before it (template-label-promql-rule's spirit)
    queries = {v["name"]: v["query"]["query"] for v in dash["templating"]["list"] if v["type"] == "query"}
    assert 'job=~"$job"' in queries["instance"]
    for name in ("layer", "head"):
        assert 'job=~"$job"' in queries[name] and 'instance=~"$instance"' in queries[name], name


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed (make prometheus)")
def test_target_promql_rule_every_query_parses(dash, tmp_path):
    """Every panel and annotation query, with Grafana's variables filled in, is valid PromQL."""
    fill = {"$__rate_interval": "5m", "$__range": "1h", "$__interval": "1m"}

    def filled(expr: str) -> str:
        for var, value in fill.items():
            expr = expr.replace(var, value)
        return re.sub(r"\$\{?(\w+)\}?", ".+", expr)  # $job, $instance, ...: a regex value

    rules = [{"record": f"panel_{i}_{t['refId']}", "expr": filled(t["expr"])}
             for i, p in enumerate(dash["panels"]) for t in p["targets"]]
    rules += [{"record": "annotation", "expr": filled(a["expr"])} for a in dash["annotations"]["list"] if "expr" in a]
    assert len(rules) >= 15
    path = tmp_path / "exprs.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    out = subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
