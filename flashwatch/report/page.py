"""The report as one self-contained HTML page: inline SVG charts, no scripts, no external assets."""

from __future__ import annotations

import html
import math
from collections import Counter
from typing import Any

from ..metrics import BY_NAME
from ..vocabulary import INJECTED
from .charts import CRITICAL_COLOUR, HEATMAPS, LOSS_COLOUR, MAX_HEAD_ROWS, WARNING_COLOUR, display_rows
from .load import RunData, num
from .svg import heatmap_svg, loss_svg

__all__ = ["to_html", "title"]

MAX_ALERT_ROWS = 100  # alerts listed in the table; alerts.log has them all

_CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",Helvetica,Arial,sans-serif;margin:24px auto;max-width:1000px;
color:#222;padding:0 16px;line-height:1.45}
h1{font-size:22px;margin:0 0 4px}h2{font-size:17px;margin:28px 0 4px}
.sub{color:#555;margin:0 0 12px}.cap{color:#555;font-size:13px;margin:2px 0 8px}
.banner{background:#b71c1c;color:#fff;padding:10px 14px;border-radius:4px;font-weight:600;margin:12px 0}
table{border-collapse:collapse;font-size:13px;margin:6px 0}td,th{border-bottom:1px solid #e0e0e0;padding:3px 10px;
text-align:left;vertical-align:top}th{background:#f5f5f5}
.crit{color:#c62828;font-weight:600}.warn{color:#ef6c00;font-weight:600}
.facts{display:grid;grid-template-columns:max-content auto;gap:2px 16px;font-size:14px}
.facts div:nth-child(odd){color:#666}code{background:#f3f3f3;padding:0 3px;border-radius:3px}
.legend span{display:inline-block;margin-right:14px}.sw{display:inline-block;width:10px;height:10px;margin-right:4px}
svg{display:block;margin:4px 0}
"""


def _e(s: Any) -> str:
    return html.escape(str(s), quote=True)


def title(run: RunData) -> str:
    """``flashwatch report: <run folder>`` (the PNG's title too)."""
    return f"flashwatch report: {run.path.parent.name or run.path.name}"


def _facts(run: RunData) -> list[tuple[str, str]]:
    """(label, text) lines about the run: the file, steps, loss, heads, and what ran (``demo.json``,
    else the recorded ``MonitorConfig``)."""
    m = run.meta
    facts = [("metrics", str(run.path))]
    if run.steps:
        facts.append(("steps", f"{run.steps[0]}-{run.steps[-1]} ({len(run.steps)} monitored steps)"))
    finite = [(s, v) for s, v in zip(run.steps, run.loss) if v == v and not math.isinf(v)]
    if finite:
        facts.append(("loss", f"{finite[0][1]:.4g} at step {finite[0][0]} → {finite[-1][1]:.4g} at step {finite[-1][0]}"))
    layers = Counter(l for l, _ in run.rows)
    if layers:
        facts.append(("attention", f"{len(layers)} layers, {len(run.rows)} heads: "
                                   + ", ".join(f"{i}={n}" for i, n in enumerate(run.layer_names[:8]))
                                   + (" ..." if len(run.layer_names) > 8 else "")))
    model, what = m.get("model") or {}, m.get("command", "")
    if model:
        what += (f": {model.get('n_layer')}-layer GPT, {model.get('n_head')} heads, width {model.get('n_embd')}, "
                 f"context {model.get('block_size')}, batch {model.get('batch_size')}")
    if what:
        facts.append(("run", what))
    monitoring = _monitoring_fact(m)
    if monitoring:
        facts.append(("monitoring", monitoring))
    if m.get("seconds") is not None:
        stopped = ", interrupted" if m.get("interrupted") else ""
        facts.append(("time", f"{m.get('seconds')} s, finished {m.get('finished', '')}{stopped}"))
    return facts


def _monitoring_fact(meta: dict) -> str:
    """What ran, from what the run recorded (``demo.json``'s facts, else the recorded
    ``MonitorConfig``): only the facts it holds, none shown as "None"."""
    config = meta.get("monitor_config") if isinstance(meta.get("monitor_config"), dict) else {}
    mode = meta.get("mode", config.get("mode"))
    variant = meta.get("variant", config.get("variant"))
    parts = [f"{mode} mode" if mode is not None else None,
             f"variant {variant}" if variant is not None and mode != "observe" else None,
             f"interval {config['interval']}" if config.get("interval") is not None else None,
             f"{meta['precision']} on {meta['device']}" if meta.get("precision") and meta.get("device") else None,
             f"seed {meta['seed']}" if meta.get("seed") is not None else None]
    return ", ".join(p for p in parts if p)


def _alerts_table(run: RunData) -> list[str]:
    if not run.alerts:
        return ["<p class='cap'>None.</p>"]
    out = ["<table class='alerts'><tr><th>step</th><th>severity</th><th>rule</th><th>head</th>"
           "<th>value</th><th>threshold</th><th>message</th></tr>"]
    for a in run.alerts[:MAX_ALERT_ROWS]:
        cls = "crit" if a.get("severity") == "critical" else "warn"
        where = (f"L{a.get('layer')}.H{a.get('head')}" if int(a.get("head", -1)) >= 0
                 else f"L{a.get('layer')}" if int(a.get("layer", -1)) >= 0 else "-")
        out.append(f"<tr><td>{_e(a.get('step'))}</td><td class='{cls}'>{_e(a.get('severity'))}</td>"
                   f"<td>{_e(a.get('rule'))}</td><td>{_e(where)}</td><td>{num(a.get('value')):.4g}</td>"
                   f"<td>{num(a.get('threshold')):.4g}</td><td>{_e(a.get('message', ''))}</td></tr>")
    out.append("</table>")
    if len(run.alerts) > MAX_ALERT_ROWS:
        out.append(f"<p class='cap'>... and {len(run.alerts) - MAX_ALERT_ROWS} more (alerts.log has them all).</p>")
    return out


def _coverage_table(run: RunData) -> list[str]:
    """Layers whose attention was not measured in full at some monitored step (none: nothing shown)."""
    partial = []
    for layer, values in sorted(run.coverage.items()):
        finite = [(v, step) for v, step in zip(values, run.steps) if v == v]
        low = [(v, step) for v, step in finite if v < 1.0]
        if low:
            name = run.layer_names[layer] if layer < len(run.layer_names) else f"layer {layer}"
            partial.append((layer, name, min(low)[0], len(low), len(finite), low[0][1]))
    if not partial:
        return []
    return ["<h2>Attention coverage</h2>",
            f"<p class='cap'>{_e(BY_NAME['flashwatch_attention_coverage'].help)} Layers below 1 at some monitored "
            "step; at 0 the layer's delta error and drift were not measured (the attention_coverage alert).</p>",
            "<table><tr><th>layer</th><th>name</th><th>lowest coverage</th><th>monitored steps below 1</th>"
            "<th>first at step</th></tr>"
            + "".join(f"<tr><td>{layer}</td><td>{_e(name)}</td><td>{low:.0%}</td><td>{n} of {total}</td>"
                      f"<td>{first}</td></tr>" for layer, name, low, n, total, first in partial)
            + "</table>"]


def to_html(run: RunData) -> str:
    """The report as one self-contained HTML page (inline SVG, no scripts, no external assets)."""
    head = title(run)
    out = ["<!DOCTYPE html>", "<html lang='en'><head><meta charset='utf-8'>",
           f"<title>{_e(head)}{' [' + INJECTED + ']' if run.injected else ''}</title>",
           f"<style>{_CSS}</style></head><body>", f"<h1>{_e(head)}</h1>"]
    if run.injected:
        label = run.meta.get("label") or f"{INJECTED} FAULT: this run used an injected fault"
        if not label.startswith(INJECTED):
            label = f"{INJECTED} FAULT: {label}"
        out.append(f"<div class='banner'>{_e(label)}. Not a real failure: a test of the early warning.</div>")
    out.append("<div class='facts'>" + "".join(f"<div>{_e(k)}</div><div>{_e(v)}</div>" for k, v in _facts(run))
               + "</div>")

    counts = Counter(a.get("rule") for a in run.alerts)
    sev = Counter(a.get("severity") for a in run.alerts)
    out.append("<h2>Loss and alerts</h2>")
    if run.alerts:
        out.append(f"<p class='cap'>{len(run.alerts)} alerts started: <span class='crit'>{sev.get('critical', 0)} "
                   f"critical</span>, <span class='warn'>{sev.get('warning', 0)} warning</span> ("
                   + ", ".join(f"{_e(r)} ×{n}" for r, n in counts.most_common())
                   + "). Markers on the loss: red critical, orange warning; hover one for its alerts.</p>")
    else:
        out.append("<p class='cap'>No alert started in this run.</p>")
    out.append(loss_svg(run))
    out.append(f"<p class='cap legend'><span><i class='sw' style='background:{LOSS_COLOUR}'></i>loss</span>"
               f"<span><i class='sw' style='background:{CRITICAL_COLOUR}'></i>critical alert</span>"
               f"<span><i class='sw' style='background:{WARNING_COLOUR}'></i>warning</span></p>")

    out.append("<h2>Per-head signals over steps</h2>")
    per_head = len(display_rows(run)) == len(run.rows)
    rows = ("One row per attention head (<code>L</code>layer<code>.H</code>head)" if per_head
            else f"One row per layer (<code>L</code>layer), its most extreme head of {len(run.rows)} at each step "
                 f"(more than {MAX_HEAD_ROWS} heads)")
    out.append(f"<p class='cap'>{rows}, one column per monitored step (or per bin of steps, fewer columns the more "
               "rows); grey: not measured. Outlined cells (black): an alert of that signal's rule started there. "
               "Hover a cell for its value.</p>")
    default = "" if run.thresholds_recorded else " (MonitorConfig's default: this run did not record its own)"
    for hm in HEATMAPS:
        note = ""
        if hm.metric == "flashwatch_delta_drift_z":
            note = (f" Colour saturates at ±{run.drift_threshold:g}, the delta_drift threshold{default}: full red "
                    f"or blue is at or past it.")
        elif hm.scale == "diverging":
            note = " Colour centred on 0, full red or blue at the run's largest magnitude."
        elif hm.metric == "flashwatch_max_logit":
            note = f" The max_logit rule warns at {run.max_logit_bound:g}{default}."
        out.append(f"<h3 style='font-size:15px;margin:18px 0 2px'>{_e(hm.title)}</h3>"
                   f"<p class='cap'>{_e(BY_NAME[hm.metric].help)}{_e(note)}</p>")
        out.append(heatmap_svg(run, hm))

    out.append("<h2>Alerts</h2>")
    out += _alerts_table(run)
    out += _coverage_table(run)
    if run.switches:
        out.append("<h2>Kernel variant switches</h2><table><tr><th>step</th><th>layer</th><th>from</th><th>to</th></tr>"
                   + "".join(f"<tr><td>{s}</td><td>{l}</td><td>{_e(a)}</td><td>{_e(b)}</td></tr>"
                             for s, l, a, b in run.switches) + "</table>")
    out.append("<p class='cap' style='margin-top:24px'>Written by <code>flashwatch report</code> from "
               f"{_e(run.path.name)}. Metric definitions: docs/SIGNALS.md.</p>")
    out.append("</body></html>")
    return "\n".join(out)
