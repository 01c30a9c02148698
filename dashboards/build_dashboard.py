"""Build the Grafana dashboard and the Prometheus alert rules from flashwatch's own tables.

    python dashboards/build_dashboard.py           # rewrite flashwatch.json and alerts.yml
    python dashboards/build_dashboard.py --check   # exit 1 if the committed files are stale

Both outputs are committed; ``tests/test_dashboards.py`` fails when they differ from what this
script generates, so the metric table (``flashwatch.metrics``), ``MonitorConfig``'s default
thresholds and the detectors' severities are the single source of every name, unit, threshold
and severity in the dashboard and the rules.

The dashboard is portable: ``"id": null``, the datasource is the template variable
``${DS_PROMETHEUS}`` (a ``datasource`` variable, so import and provisioning both work), every
panel has a unit, and ``instance``/``layer``/``head`` are template variables filled with
``label_values``. It needs Grafana 10 or newer (heatmap with ``calculate: false``).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # run from a clone without installing

from flashwatch.config import MonitorConfig  # noqa: E402
from flashwatch.detectors import RULES, build_detectors  # noqa: E402
from flashwatch.metrics import BY_NAME  # noqa: E402

DASHBOARD = HERE / "flashwatch.json"
ALERTS = HERE / "alerts.yml"
DS = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
SEL = 'instance=~"$instance"'
HEAD_SEL = 'instance=~"$instance", layer=~"$layer", head=~"$head"'

# --- thresholds: the one place. They mirror MonitorConfig's defaults (read from it, not copied),
# so the Prometheus rules fire where the in-process detectors do. Counts of monitored steps
# become optimizer steps at the default interval; time windows are Prometheus's own (the
# detectors count monitored steps, Prometheus sees wall time) and are set here.
_CFG = MonitorConfig()
THRESHOLDS = {
    "drift_z": _CFG.drift_threshold,                   # |z| >= this
    "repeated_max_factor": _CFG.repeated_max_factor,   # BF16 ratio >= factor x baseline ...
    "repeated_max_margin": _CFG.repeated_max_margin,   # ... and >= baseline + margin
    "wq_growth_factor": _CFG.wq_growth_factor,         # sigma now / sigma at the window's start
    "wq_outlier_ratio": _CFG.wq_outlier_ratio,         # sigma / the layer's median head
    "max_logit_bound": _CFG.max_logit_bound,           # max logit >= this
    "loss_spike_rtol": _CFG.loss_spike_rtol,           # loss - mean >= rtol x |mean|
    # warm-up in optimizer steps: warmup monitored steps x interval
    "warmup_steps": _CFG.warmup * _CFG.interval,
    # the repeated-max baseline is complete after warmup + repeated_max_baseline monitored steps
    "baseline_steps": (_CFG.warmup + _CFG.repeated_max_baseline) * _CFG.interval,
    # W^Q growth is judged once its comparison point (window monitored steps back) is past warm-up
    "wq_growth_steps": (_CFG.warmup + _CFG.window) * _CFG.interval,
}
WINDOWS = {
    "baseline": "6h",    # repeated-max baseline: the lowest ratio in this window
    "wq_growth": "1h",   # W^Q growth: now over the lowest norm in this window
    "loss_mean": "10m",  # loss spike: running mean over this window
}
SEVERITY = {d.rule: d.severity for d in build_detectors(_CFG)}


def _g(x: float) -> str:
    return f"{x:g}"


# --- alert rules ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Rule:
    """One Prometheus alerting rule mirroring the in-process detector of the same name."""

    rule: str                 # detector name: the `rule` label, as in flashwatch_alerts_total
    expr: str                 # PromQL that returns the series in alert
    inner: tuple[str, ...]    # the expression(s) before the comparison: data on a healthy run
    for_: str
    summary: str
    description: str

    @property
    def alert(self) -> str:
        return "Flashwatch" + "".join(w.capitalize() for w in self.rule.split("_"))


def _after_warmup(expr: str, steps_key: str = "warmup_steps") -> str:
    return f"{expr} and on(job, instance) flashwatch_step >= {THRESHOLDS[steps_key]}"


def alert_rules() -> list[Rule]:
    t, w = THRESHOLDS, WINDOWS
    rm = "flashwatch_repeated_max_ratio_bf16"
    rm_base = f"min_over_time({rm}[{w['baseline']}])"
    wq = "flashwatch_wq_spectral_norm"
    wq_median = f"on(job, instance, layer) group_left quantile by (job, instance, layer) (0.5, {wq})"
    loss_mean = f"avg_over_time(flashwatch_loss[{w['loss_mean']}])"
    # delta_drift does not judge layers running fp32_delta (their delta comes from the FP32 output)
    fp32_delta = 'on(job, instance, layer) flashwatch_kernel_variant{variant="fp32_delta"} == 1'
    rules = [
        Rule("delta_drift",
             _after_warmup(f"abs(flashwatch_delta_drift_z) >= {_g(t['drift_z'])} unless {fp32_delta}"),
             ("abs(flashwatch_delta_drift_z)", "flashwatch_step"), "2m",
             "delta error of layer {{ $labels.layer }} head {{ $labels.head }} keeps one sign "
             "(drift z {{ $value | printf \"%.2f\" }})",
             "The signed delta error sum_rows(delta_used - delta_hp) of this head has drifted "
             f"|z| >= {_g(t['drift_z'])} standard deviations from zero: BF16 rounding of the attention "
             "output biases W^Q's gradient (Qiu & Yao). The bias is there in healthy BF16 runs too (a "
             "warning, not a forecast): a failure is likelier when the repeated-max and max-logit alerts "
             "follow. Remedy: the fp32_delta kernel variant (layers already running it are not judged)."),
        Rule("repeated_max_rise",
             _after_warmup(f"{rm} >= {_g(t['repeated_max_factor'])} * {rm_base} and {rm} >= "
                           f"{_g(t['repeated_max_margin'])} + {rm_base}", "baseline_steps"),
             (rm, f"{rm} - {rm_base}"), "2m",
             "BF16 repeated-max rows of layer {{ $labels.layer }} head {{ $labels.head }} rose to "
             "{{ $value | humanizePercentage }}",
             f"The fraction of rows whose BF16 maximum repeats is >= {_g(t['repeated_max_factor'])}x "
             f"its baseline and >= baseline + {_g(t['repeated_max_margin'])} (baseline here: the lowest "
             f"value over {w['baseline']}; the detector uses its mean over the first monitored steps "
             "after warm-up)."),
        Rule("wq_growth",
             _after_warmup(f"{wq} / min_over_time({wq}[{w['wq_growth']}]) >= {_g(t['wq_growth_factor'])}",
                           "wq_growth_steps"),
             (f"{wq} / min_over_time({wq}[{w['wq_growth']}])",), "2m",
             "W^Q spectral norm of layer {{ $labels.layer }} head {{ $labels.head }} grew "
             "x{{ $value | printf \"%.2f\" }}",
             f"sigma_max(W^Q_h) is >= {_g(t['wq_growth_factor'])}x its lowest value over "
             f"{w['wq_growth']} (the detector compares with the value `window` monitored steps ago, once "
             "that lies after warm-up: never with the weights at initialisation)."),
        Rule("wq_outlier",
             _after_warmup(f"{wq} / {wq_median} >= {_g(t['wq_outlier_ratio'])}"),
             (f"{wq} / {wq_median}",), "2m",
             "W^Q spectral norm of layer {{ $labels.layer }} head {{ $labels.head }} is "
             "x{{ $value | printf \"%.2f\" }} its layer's median head",
             f"sigma_max(W^Q_h) / median over the layer's heads >= {_g(t['wq_outlier_ratio'])}: "
             "Qiu & Yao found a few heads with outsized norms in the failing layer."),
        Rule("max_logit",
             f"flashwatch_max_logit >= {_g(t['max_logit_bound'])}",
             ("flashwatch_max_logit",), "2m",
             "max logit of layer {{ $labels.layer }} head {{ $labels.head }} is {{ $value | printf \"%.4g\" }}",
             f"The largest scaled attention score reached {_g(t['max_logit_bound'])} (QK-Clip's tau is 100, "
             "which healthy runs pass: see flashwatch/config.py). Weak evidence alone: read it with the drift "
             "and repeated-max alerts."),
        Rule("non_finite",
             "flashwatch_loss != flashwatch_loss or abs(flashwatch_loss) == Inf"
             " or abs(flashwatch_grad_norm) == Inf or abs(flashwatch_delta_error) == Inf"
             " or flashwatch_max_logit == Inf"
             " or flashwatch_wq_spectral_norm != flashwatch_wq_spectral_norm"
             " or abs(flashwatch_wq_spectral_norm) == Inf",
             ("flashwatch_loss", "flashwatch_grad_norm", "flashwatch_delta_error", "flashwatch_max_logit",
              "flashwatch_wq_spectral_norm"), "0m",
             "non-finite value in flashwatch's signals"
             "{{ if $labels.layer }} (layer {{ $labels.layer }} head {{ $labels.head }}){{ end }}",
             "NaN or infinity in the loss, the gradient norm or a head's statistics. A NaN gradient "
             "norm means 'not given' and a NaN delta error or max logit 'layer not measured at this "
             "step' in the metric table, so only infinities count there."),
        Rule("loss_spike",
             f"flashwatch_loss - {loss_mean} >= {_g(t['loss_spike_rtol'])} * abs({loss_mean})",
             (f"flashwatch_loss - {loss_mean}",), "0m",
             "loss spike: {{ $value | printf \"%.4g\" }} above its running mean",
             f"The loss exceeds its mean over {w['loss_mean']} by >= {_g(t['loss_spike_rtol'])}x |mean| "
             "(Lightning's SpikeDetection rule, as the loss_spike detector)."),
    ]
    assert [r.rule for r in rules] == list(RULES), "one Prometheus rule per detector, in RULES order"
    return rules


def alerts_yaml() -> str:
    header = [
        "# Prometheus alerting rules mirroring flashwatch's in-process detectors (flashwatch/detectors.py).",
        "# GENERATED by dashboards/build_dashboard.py: edit that script, then run it; a test checks this copy.",
        "#",
        "# Thresholds, in one place: they mirror MonitorConfig's defaults (flashwatch/config.py) and are",
        "# read from it when this file is generated.",
    ]
    header += [f"#   {k}: {_g(v)}" for k, v in THRESHOLDS.items()]
    header += ["# Prometheus time windows (detectors count monitored steps, Prometheus sees time):"]
    header += [f"#   {k}: {v}" for k, v in WINDOWS.items()]
    header += [
        "# Every alert carries `rule` (the detector's name, as in flashwatch_alerts_total) and `severity`.",
        "# Load with rule_files in prometheus.yml; test with `promtool test rules alerts_test.yml`.",
        "",
    ]
    body = {"groups": [{"name": "flashwatch", "rules": [
        {"alert": r.alert, "expr": r.expr, "for": r.for_,
         "labels": {"rule": r.rule, "severity": SEVERITY[r.rule]},
         "annotations": {"summary": r.summary, "description": r.description}}
        for r in alert_rules()]}]}
    return "\n".join(header) + yaml.safe_dump(body, sort_keys=False, width=1000, allow_unicode=True)


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


def dashboard() -> dict:
    ids = _Ids()
    t = THRESHOLDS
    ts_custom = {"drawStyle": "line", "lineWidth": 1, "showPoints": "never", "spanNulls": True}
    panels = [
        _panel(ids, "timeseries", "Loss", "Training loss at each monitored step "
               "(flashwatch_loss); alerts are drawn as annotations.",
               [_target(f"flashwatch_loss{{{SEL}}}", "loss")], BY_NAME["flashwatch_loss"].unit, (0, 0, 12, 8),
               custom=ts_custom, options={"legend": {"showLegend": False}}),
        _panel(ids, "timeseries", "Gradient norm (before clipping)", BY_NAME["flashwatch_grad_norm"].help,
               [_target(f"flashwatch_grad_norm{{{SEL}}}", "grad norm")], BY_NAME["flashwatch_grad_norm"].unit,
               (12, 0, 6, 8), custom=ts_custom, options={"legend": {"showLegend": False}}),
        _panel(ids, "bargauge", "Alerts raised, by rule", BY_NAME["flashwatch_alerts_total"].help,
               [_target(f"sum by (rule) (flashwatch_alerts_total{{{SEL}}})", "{{rule}}", instant=True)],
               "none", (18, 0, 6, 8), thresholds=_red_above(1),
               options={"orientation": "horizontal", "displayMode": "basic",
                        "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False}}),
        _panel(ids, "timeseries", "Max |drift z| per layer",
               f"Largest |flashwatch_delta_drift_z| over the selected heads of each layer; the red line "
               f"is the delta_drift threshold ({_g(t['drift_z'])}).",
               [_target(f"max by (layer) (abs(flashwatch_delta_drift_z{{{HEAD_SEL}}}))", "layer {{layer}}")],
               "none", (0, 8, 12, 8), thresholds=_red_above(t["drift_z"]),
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
        _panel(ids, "state-timeline", "Active kernel variant per layer",
               BY_NAME["flashwatch_kernel_variant"].help + " One row per layer and variant; a bar while "
               "that variant runs (sdpa: the model's own attention, observed).",
               [_target(f"flashwatch_kernel_variant{{{SEL}, layer=~\"$layer\"}} == 1",
                        "L{{layer}} {{variant}}")],
               "none", (12, 36, 12, 10),
               options={"showValue": "never", "mergeValues": True, "rowHeight": 0.8,
                        "legend": {"showLegend": False}},
               extra={"fieldConfig": {"defaults": {
                   "unit": "none",
                   "mappings": [{"type": "value", "options": {"1": {"text": "active", "color": "green"}}}],
                   "color": {"mode": "fixed", "fixedColor": "green"}}, "overrides": []}}),
        _panel(ids, "table", "Active alerts",
               BY_NAME["flashwatch_alert_active"].help + " Layer or head -1: the alert concerns no single "
               "layer or head.",
               [_target(f"flashwatch_alert_active{{{SEL}}} == 1", fmt="table", instant=True)],
               "none", (0, 46, 12, 8),
               options={"showHeader": True, "sortBy": [{"displayName": "rule", "desc": False}]},
               extra={"transformations": [{"id": "organize", "options": {
                   "excludeByName": {"Time": True, "Value": True, "__name__": True, "job": True},
                   "indexByName": {"rule": 0, "layer": 1, "head": 2, "instance": 3}}}]}),
        _panel(ids, "table", "Heads now (layer x head)",
               "Last value of every per-head signal of the selected heads, sortable by any column.",
               [_target(f"{m}{{{HEAD_SEL}}}", fmt="table", instant=True, ref=ref)
                for ref, m in zip("ABCDEF", ("flashwatch_delta_drift_z", "flashwatch_repeated_max_ratio",
                                             "flashwatch_repeated_max_ratio_bf16", "flashwatch_max_logit",
                                             "flashwatch_wq_spectral_norm", "flashwatch_delta_error_cumulative"))],
               "none", (12, 46, 12, 8),
               options={"showHeader": True, "sortBy": [{"displayName": "drift z", "desc": True}]},
               extra={"transformations": [
                   {"id": "merge", "options": {}},
                   {"id": "organize", "options": {
                       "excludeByName": {"Time": True, "job": True, "instance": True},
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

    def var(name: str, label: str, query: str) -> dict:
        return {"name": name, "label": label, "type": "query", "datasource": DS,
                "query": {"query": query, "refId": f"{name}-var"}, "definition": query,
                "refresh": 2, "multi": name != "instance", "includeAll": True, "allValue": ".*",
                "current": {}, "options": [], "sort": 3 if name != "instance" else 1, "hide": 0, "regex": ""}

    return {
        "id": None,
        "uid": "flashwatch",
        "title": "flashwatch: BF16 flash attention stability",
        "description": "Signals of flashwatch's Monitor (metric table: flashwatch/metrics.py). "
                       "Generated by dashboards/build_dashboard.py.",
        "tags": ["flashwatch", "training", "attention"],
        "timezone": "browser",
        "editable": True,
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
             "expr": f"sum by (rule) (changes(flashwatch_alerts_total{{{SEL}}}[1m])) > 0",
             "step": "15s", "titleFormat": "alert: {{rule}}", "textFormat": "new {{rule}} alert(s)",
             "tagKeys": "rule", "useValueForTime": False},
        ]},
        "templating": {"list": [
            {"name": "DS_PROMETHEUS", "label": "Prometheus", "type": "datasource", "query": "prometheus",
             "current": {}, "options": [], "refresh": 1, "hide": 0, "regex": ""},
            var("instance", "run (instance)", "label_values(flashwatch_step, instance)"),
            var("layer", "layer", 'label_values(flashwatch_delta_drift_z{instance=~"$instance"}, layer)'),
            var("head", "head", 'label_values(flashwatch_delta_drift_z{instance=~"$instance", '
                                'layer=~"$layer"}, head)'),
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
    return {DASHBOARD: dashboard_json(), ALERTS: alerts_yaml()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="exit 1 if a committed file differs")
    args = p.parse_args(argv)
    stale = []
    for path, text in outputs().items():
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(path.name)
        else:
            path.write_text(text)
            print(f"wrote {path}")
    if stale:
        print(f"stale: {', '.join(stale)}; run python dashboards/build_dashboard.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
