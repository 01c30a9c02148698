"""Build the Grafana dashboard from flashwatch's own tables (and, with it, the alert rules).

    python dashboards/build_dashboard.py           # rewrite flashwatch.json, alerts.yml, docs/ALERTS.md
    python dashboards/build_dashboard.py --check   # exit 1 if a committed file is stale

The outputs are committed; ``tests/test_dashboards.py`` fails when they differ from what this
script generates. Every metric name and unit comes from the metric table
(``flashwatch.metrics``), every rule, severity and kernel variant from ``flashwatch.vocabulary``;
the alert rules and the runbook are ``build_alerts.py``'s.

The dashboard is portable and passes the Grafana dashboard-linter's rules: ``"id": null``; the
datasource is the template variable ``datasource``; ``job`` and ``instance`` variables (multi
select, "All" = ``.+``) are matched by every selector; counters are read through ``increase()``;
every panel has a description and a unit; ``editable`` is false (change the generator, not the
dashboard). ``layer`` and ``head`` variables narrow the per-head panels. It needs Grafana 10 or
newer (heatmap with ``calculate: false``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE.parent) not in sys.path:  # run from a clone without installing; last, so that the clone's
    sys.path.append(str(HERE.parent))  # kernels/ folder never shadows an installed `kernels` package
sys.path.insert(0, str(HERE))  # build_alerts, beside this file

import build_alerts  # noqa: E402
from flashwatch.config import MonitorConfig  # noqa: E402
from flashwatch.metrics import BY_NAME  # noqa: E402
from flashwatch.vocabulary import RULE_SPECS, VARIANT_CODE  # noqa: E402

DASHBOARD = HERE / "flashwatch.json"
DS = {"type": "prometheus", "uid": "${datasource}"}
SEL = 'job=~"$job", instance=~"$instance"'
HEAD_SEL = SEL + ', layer=~"$layer", head=~"$head"'
SEVERITY_COLOR = {"warning": "orange", "critical": "red"}
VARIANT_COLOR = {"sdpa": "text", "plain": "blue", "fixed": "purple", "fp32_delta": "green"}
DRIFT_THRESHOLD = MonitorConfig().drift_threshold  # the red line of the drift panel: the rule's default


def _g(x: float) -> str:
    return f"{x:g}"


# --- dashboard -----------------------------------------------------------------------------------

class _Ids:
    def __init__(self) -> None:
        self.n = 0

    def __call__(self) -> int:
        self.n += 1
        return self.n


def _target(expr: str, legend: str = "", *, fmt: str = "time_series", instant: bool = False,
            ref: str = "A") -> dict:
    return {"datasource": DS, "expr": expr, "legendFormat": legend, "format": fmt,
            "instant": instant, "range": not instant, "refId": ref}


def _panel(ids: _Ids, kind: str, title: str, description: str, targets: list[dict], unit: str,
           grid: tuple[int, int, int, int], *, options: dict | None = None, custom: dict | None = None,
           thresholds: list[dict] | None = None, extra: dict | None = None) -> dict:
    x, y, w, h = grid
    defaults: dict = {"unit": unit}
    if custom:
        defaults["custom"] = custom
    if thresholds:
        defaults["thresholds"] = {"mode": "absolute", "steps": thresholds}
    panel = {"id": ids(), "type": kind, "title": title, "description": description, "datasource": DS,
             "gridPos": {"x": x, "y": y, "w": w, "h": h},
             "fieldConfig": {"defaults": defaults, "overrides": []},
             "options": options or {}, "targets": targets}
    panel.update(extra or {})
    return panel


def _red_above(value: float) -> list[dict]:
    return [{"color": "green", "value": None}, {"color": "red", "value": value}]


def _heatmap(ids: _Ids, metric: str, title: str, grid: tuple[int, int, int, int], *, expr: str | None = None,
             scheme: str = "Oranges") -> dict:
    spec = BY_NAME[metric]
    return _panel(
        ids, "heatmap", title,
        f"{spec.help} One row per (layer, head), time across; rows follow the layer and head "
        "variables.",
        [_target(expr or f"{metric}{{{HEAD_SEL}}}", "L{{layer}} H{{head}}")], spec.unit, grid,
        options={"calculate": False, "yAxis": {"axisPlacement": "left", "unit": "none"},
                 "rowsFrame": {"layout": "auto"},
                 "color": {"mode": "scheme", "scheme": scheme, "steps": 64, "exponent": 0.5,
                           "reverse": False},
                 "cellGap": 1, "legend": {"show": True},
                 "tooltip": {"show": True, "yHistogram": False}})


def _variant_code_expr() -> str:
    """Per layer, the code (``VARIANT_CODE``) of the variant it runs: one row per layer."""
    parts = [f'(flashwatch_kernel_variant{{{SEL}, layer=~"$layer", variant="{v}"}} == 1) * {code}'
             for v, code in VARIANT_CODE.items()]
    return f"max by (job, instance, layer) ({' or '.join(parts)})"


def _rule_mappings() -> list[dict]:
    """Value mappings of the ``rule`` column: the rule with its severity, coloured by it."""
    return [{"type": "value", "options": {r.name: {"text": f"{r.name} ({r.severity})",
                                                   "color": SEVERITY_COLOR[r.severity], "index": i}}}
            for i, r in enumerate(RULE_SPECS)]


def dashboard() -> dict:
    ids = _Ids()
    ts_custom = {"drawStyle": "line", "lineWidth": 1, "showPoints": "never", "spanNulls": True}
    panels = [
        _panel(ids, "timeseries", "Loss", "Training loss at each monitored step "
               "(flashwatch_loss); alerts are drawn as annotations.",
               [_target(f"flashwatch_loss{{{SEL}}}", "{{instance}}")], BY_NAME["flashwatch_loss"].unit,
               (0, 0, 12, 8), custom=ts_custom, options={"legend": {"showLegend": False}}),
        _panel(ids, "timeseries", "Gradient norm (before clipping)", BY_NAME["flashwatch_grad_norm"].help,
               [_target(f"flashwatch_grad_norm{{{SEL}}}", "{{instance}}")], BY_NAME["flashwatch_grad_norm"].unit,
               (12, 0, 6, 5), custom=ts_custom, options={"legend": {"showLegend": False}}),
        _panel(ids, "stat", "Since the last monitored step",
               "Age of the last monitored step (flashwatch_last_step_timestamp_seconds) by Prometheus's "
               f"clock; red past {build_alerts.STALL_MIN} minutes, where FlashwatchStoppedReporting fires.",
               [_target(f"time() - flashwatch_last_step_timestamp_seconds{{{SEL}}}", "{{instance}}",
                        instant=True)],
               "s", (12, 5, 6, 3), thresholds=_red_above(build_alerts.STALL_MIN * 60),
               options={"colorMode": "value", "graphMode": "none", "textMode": "value_and_name",
                        "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False}}),
        _panel(ids, "bargauge", "Alerts raised in the time range, by rule",
               BY_NAME["flashwatch_alerts_total"].help + " Counted over the dashboard's time range; the "
               "colour is the rule's severity (orange: warning, red: critical).",
               [_target(f"sum by (rule) (increase(flashwatch_alerts_total{{{SEL}}}[$__range]))", "{{rule}}",
                        instant=True)],
               "none", (18, 0, 6, 8),
               options={"orientation": "horizontal", "displayMode": "basic",
                        "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False}},
               extra={"fieldConfig": {"defaults": {"unit": "none", "decimals": 0,
                                                   "color": {"mode": "fixed", "fixedColor": "green"}},
                                      "overrides": [
                   {"matcher": {"id": "byName", "options": r.name},
                    "properties": [{"id": "color", "value": {"mode": "fixed",
                                                             "fixedColor": SEVERITY_COLOR[r.severity]}}]}
                   for r in RULE_SPECS]}}),
        _panel(ids, "timeseries", "Max |drift z| per layer",
               f"Largest |flashwatch_delta_drift_z| over the selected heads of each layer; the red line "
               f"is the delta_drift rule's default threshold ({_g(DRIFT_THRESHOLD)}); the Monitor's "
               "decisions are in 'Active alerts'.",
               [_target(f"max by (job, instance, layer) (abs(flashwatch_delta_drift_z{{{HEAD_SEL}}}))",
                        "{{instance}} layer {{layer}}")],
               "none", (0, 8, 12, 8), thresholds=_red_above(DRIFT_THRESHOLD),
               custom={**ts_custom, "thresholdsStyle": {"mode": "line"}}),
        _panel(ids, "timeseries", "Top 5 heads by W^Q spectral norm", BY_NAME["flashwatch_wq_spectral_norm"].help,
               [_target(f"topk(5, flashwatch_wq_spectral_norm{{{HEAD_SEL}}})", "L{{layer}} H{{head}}")],
               BY_NAME["flashwatch_wq_spectral_norm"].unit, (12, 8, 12, 8), custom=ts_custom),
        _heatmap(ids, "flashwatch_delta_drift_z", "Drift z (layer x head)", (0, 16, 12, 10), scheme="RdBu"),
        _heatmap(ids, "flashwatch_repeated_max_ratio", "Repeated-max ratio, FP32 scores (layer x head)",
                 (12, 16, 12, 10)),
        _heatmap(ids, "flashwatch_repeated_max_ratio_bf16", "Repeated-max ratio, BF16 scores (layer x head)",
                 (0, 26, 12, 10)),
        _heatmap(ids, "flashwatch_wq_spectral_norm", "W^Q spectral norm (layer x head)", (12, 26, 12, 10),
                 scheme="Blues"),
        _heatmap(ids, "flashwatch_max_logit", "Max logit (layer x head)", (0, 36, 12, 10), scheme="Purples"),
        _panel(ids, "state-timeline", "Kernel variant per layer",
               BY_NAME["flashwatch_kernel_variant"].help + " One row per layer, coloured by the variant it "
               "runs (sdpa: the model's own attention, observed).",
               [_target(_variant_code_expr(), "{{instance}} layer {{layer}}")],
               "none", (12, 36, 12, 10),
               options={"showValue": "auto", "mergeValues": True, "rowHeight": 0.8,
                        "legend": {"showLegend": False}},
               extra={"fieldConfig": {"defaults": {
                   "unit": "none",
                   "mappings": [{"type": "value", "options": {
                       str(code): {"text": v, "color": VARIANT_COLOR[v], "index": code}
                       for v, code in VARIANT_CODE.items()}}],
                   "color": {"mode": "thresholds"},
                   "thresholds": {"mode": "absolute", "steps": [{"color": "text", "value": None}]}},
                   "overrides": []}}),
        _panel(ids, "table", "Active alerts",
               BY_NAME["flashwatch_alert_active"].help + " The Monitor's decisions, which the Prometheus "
               "alerts fire on. Layer or head -1: the alert concerns no single layer or head.",
               [_target(f"flashwatch_alert_active{{{SEL}}} == 1", fmt="table", instant=True)],
               "none", (0, 46, 12, 8),
               options={"showHeader": True, "sortBy": [{"displayName": "rule", "desc": False}]},
               extra={"transformations": [{"id": "organize", "options": {
                   "excludeByName": {"Time": True, "Value": True, "__name__": True, "job": True},
                   "indexByName": {"rule": 0, "layer": 1, "head": 2, "instance": 3}}}],
                   "fieldConfig": {"defaults": {"unit": "none"}, "overrides": [
                       {"matcher": {"id": "byName", "options": "rule"},
                        "properties": [{"id": "mappings", "value": _rule_mappings()},
                                       {"id": "custom.cellOptions", "value": {"type": "color-text"}}]}]}}),
        _panel(ids, "table", "Heads now (layer x head)",
               "Last value of every per-head signal of the selected heads, sortable by any column.",
               # an aggregation drops __name__: rows of the six queries then share every label and merge
               [_target(f"max without () ({m}{{{HEAD_SEL}}})", fmt="table", instant=True, ref=ref)
                for ref, m in zip("ABCDEF", ("flashwatch_delta_drift_z", "flashwatch_repeated_max_ratio",
                                             "flashwatch_repeated_max_ratio_bf16", "flashwatch_max_logit",
                                             "flashwatch_wq_spectral_norm", "flashwatch_delta_error_cumulative"))],
               "none", (12, 46, 12, 8),
               options={"showHeader": True, "sortBy": [{"displayName": "drift z", "desc": True}]},
               extra={"transformations": [
                   {"id": "merge", "options": {}},
                   {"id": "organize", "options": {
                       "excludeByName": {"Time": True, "job": True},
                       "renameByName": {"Value #A": "drift z", "Value #B": "repeated-max",
                                        "Value #C": "repeated-max bf16", "Value #D": "max logit",
                                        "Value #E": "W^Q norm", "Value #F": "C_T"}}}]}),
    ]
    # per-column units of the heads table
    heads_table = panels[-1]
    heads_table["fieldConfig"]["overrides"] = [
        {"matcher": {"id": "byName", "options": col},
         "properties": [{"id": "unit", "value": BY_NAME[m].unit}]}
        for col, m in (("repeated-max", "flashwatch_repeated_max_ratio"),
                       ("repeated-max bf16", "flashwatch_repeated_max_ratio_bf16"))]
    # the W^Q-gradient error chain, the windowed trends and the format's ties: one heatmap each, two per row
    chain = (("flashwatch_wq_error_push", "W^Q-error push on sigma_max (layer x head)", "RdBu"),
             ("flashwatch_wq_error_push_cumulative", "Cumulative W^Q-error push (layer x head)", "RdBu"),
             ("flashwatch_wq_error_push_share", "W^Q-error push share of the true push (layer x head)", "RdBu"),
             ("flashwatch_wq_error_alignment", "W^Q-error alignment, step to step (layer x head)", "RdBu"),
             ("flashwatch_wq_error_coherence", "W^Q-error coherence over the window (layer x head)", "Oranges"),
             ("flashwatch_max_logit_growth_rate", "Max-logit growth rate, log per 1k steps (layer x head)", "Purples"),
             ("flashwatch_wq_spectral_norm_growth_rate", "W^Q norm growth rate, log per 1k steps (layer x head)",
              "Blues"),
             ("flashwatch_repeated_max_ratio_bf16_trend", "BF16 repeated-max trend per 1k steps (layer x head)",
              "Oranges"),
             ("flashwatch_repeated_max_ratio_format", "Rows with P_bar = 1 at 2+ keys in the P_bar V format "
              "(layer x head)", "Oranges"))
    panels.extend(_heatmap(ids, metric, title, (12 * (i % 2), 54 + 10 * (i // 2), 12, 10), scheme=scheme)
                  for i, (metric, title, scheme) in enumerate(chain))
    coverage = BY_NAME["flashwatch_attention_coverage"]
    panels.append(_panel(ids, "timeseries", "Attention coverage per layer",
                         coverage.help + " Below 1, part of the layer's attention is not measured; at 0 its "
                         "signals are blind (the attention_coverage alert).",
                         [_target(f'flashwatch_attention_coverage{{{SEL}, layer=~"$layer"}}',
                                  "{{instance}} layer {{layer}}")],
                         coverage.unit, (0, 54 + 10 * ((len(chain) + 1) // 2), 24, 8),
                         custom=ts_custom, thresholds=[{"color": "red", "value": None},
                                                       {"color": "green", "value": 1e-9}]))

    def var(name: str, query: str) -> dict:
        return {"name": name, "label": name.capitalize(), "type": "query", "datasource": DS,
                "query": {"query": query, "refId": f"{name}-var"}, "definition": query,
                "refresh": 2, "multi": True, "includeAll": True, "allValue": ".+",
                "current": {}, "options": [], "sort": 3 if name in ("layer", "head") else 1, "hide": 0,
                "regex": ""}

    return {
        "id": None,
        "uid": "flashwatch",
        "title": "flashwatch: BF16 flash attention stability",
        "description": "Signals of flashwatch's Monitor (metric table: flashwatch/metrics.py; alerts: "
                       "docs/ALERTS.md). Generated by dashboards/build_dashboard.py.",
        "tags": ["flashwatch", "training", "attention"],
        "timezone": "browser",
        "editable": False,
        "graphTooltip": 1,
        "refresh": "10s",
        "schemaVersion": 39,
        "version": 1,
        "time": {"from": "now-1h", "to": "now"},
        "links": [],
        "annotations": {"list": [
            {"builtIn": 1, "datasource": {"type": "grafana", "uid": "-- Grafana --"}, "enable": True,
             "hide": True, "iconColor": "rgba(0, 211, 255, 1)", "name": "Annotations & Alerts", "type": "dashboard"},
            {"name": "flashwatch alerts", "datasource": DS, "enable": True, "iconColor": "red",
             "expr": f"sum by (rule) (increase(flashwatch_alerts_total{{{SEL}}}[$__rate_interval])) > 0",
             "step": "15s", "titleFormat": "alert: {{rule}}", "textFormat": "new {{rule}} alert(s)",
             "tagKeys": "rule", "useValueForTime": False},
        ]},
        "templating": {"list": [
            {"name": "datasource", "label": "Data source", "type": "datasource", "query": "prometheus",
             "current": {}, "options": [], "refresh": 1, "hide": 0, "regex": ""},
            var("job", "label_values(flashwatch_step, job)"),
            var("instance", 'label_values(flashwatch_step{job=~"$job"}, instance)'),
            var("layer", f"label_values(flashwatch_delta_drift_z{{{SEL}}}, layer)"),
            var("head", f'label_values(flashwatch_delta_drift_z{{{SEL}, layer=~"$layer"}}, head)'),
        ]},
        "panels": panels,
    }


def expressions(dash: dict) -> list[tuple[str, str]]:
    """Every PromQL expression of a dashboard as (where, expr): panel targets, annotations, and
    the metric selectors inside ``label_values(...)`` of the template variables."""
    out = []
    for p in dash["panels"]:
        for t in p.get("targets", []):
            out.append((f"panel {p['title']!r} target {t['refId']}", t["expr"]))
    for a in dash["annotations"]["list"]:
        if "expr" in a:
            out.append((f"annotation {a['name']!r}", a["expr"]))
    for v in dash["templating"]["list"]:
        q = v.get("query")
        if isinstance(q, dict) and q["query"].startswith("label_values("):
            selector = q["query"][len("label_values("):].rsplit(",", 1)[0]
            out.append((f"variable {v['name']!r}", selector))
    return out


def dashboard_json() -> str:
    return json.dumps(dashboard(), indent=2, ensure_ascii=False) + "\n"


def outputs() -> dict[Path, str]:
    """Every committed file generated here and by build_alerts.py: path -> text."""
    return {DASHBOARD: dashboard_json(), **build_alerts.outputs()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="exit 1 if a committed file differs")
    return build_alerts.write(outputs(), p.parse_args(argv).check)


if __name__ == "__main__":
    sys.exit(main())
