"""``flashwatch report``: a run's ``metrics.jsonl`` as a picture (self-contained HTML, or PNG).

What it shows, from the step records of ``metrics.jsonl`` (``flashwatch.exporters.jsonl``):

- the loss over steps, with a marker at every step where alerts started (red: critical,
  orange: warning; hover a marker for the alerts);
- per-head heatmaps over steps, one row per ``layer.head``, one column per monitored step
  (or per bin of steps on long runs): drift z (diverging, saturating at the drift
  threshold), the repeated-max ratio on BF16 scores, the W^Q spectral norm, and the max
  logit; a cell where an alert of that signal's rule started is outlined;
- the alerts (counts by rule, the first ones in a table) and kernel-variant switches;
- what ran, from ``demo.json`` when ``flashwatch demo`` wrote the folder; runs with an
  injected fault carry an INJECTED banner.

HTML (default) is one file with inline SVG written here: no scripts, no external assets,
opens offline. PNG needs matplotlib (``pip install flashwatch[report]``).

Example::

    flashwatch report runs/demo-20261130-101500            # -> runs/demo-.../report.html
    flashwatch report runs/demo-20261130-101500 --out run.png
"""

from __future__ import annotations

import html
import json
import math
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from .config import MonitorConfig
from .exporters.jsonl import METRICS_FILE, read_jsonl
from .metrics import BY_NAME

_DEFAULTS = MonitorConfig()

__all__ = ["RunData", "load_run", "render", "to_html", "to_png", "main", "HEATMAPS"]

INJECTED = "INJECTED"
MAX_COLUMNS = 240  # heatmap columns at most; longer runs are binned


@dataclass(frozen=True)
class Heatmap:
    """One per-head heatmap: which metric, how it is coloured and binned, which alert rules mark it."""

    metric: str
    title: str
    scale: str  # "diverging" (centred on 0) | "sequential"
    fmt: str  # value format in tooltips and legends
    rules: tuple[str, ...]  # alert rules whose (layer, head) cells get outlined
    combine: str  # how steps binned into one column combine: "absmax" | "mean" | "last" | "max"


HEATMAPS: tuple[Heatmap, ...] = (
    Heatmap("flashwatch_delta_drift_z", "drift z of the signed delta error", "diverging", "{:+.2f}",
            ("delta_drift",), "absmax"),
    Heatmap("flashwatch_repeated_max_ratio_bf16", "repeated-max ratio, BF16 scores", "sequential", "{:.1%}",
            ("repeated_max_rise",), "mean"),
    Heatmap("flashwatch_wq_spectral_norm", "W^Q spectral norm", "sequential", "{:.3g}",
            ("wq_growth", "wq_outlier"), "last"),
    Heatmap("flashwatch_max_logit", "max logit", "sequential", "{:.3g}", ("max_logit",), "max"),
)


@dataclass
class RunData:
    """A run's step records, as columns. Per-head series are ``[row][column]`` with rows ``row_labels``."""

    path: Path
    steps: list[int]
    loss: list[float]
    grad_norm: list[float]
    rows: list[tuple[int, int]]  # (layer, head) of each row
    layer_names: list[str]
    series: dict[str, list[list[float]]]  # metric -> rows x steps
    alerts: list[dict]  # every new alert, in step order
    switches: list[tuple[int, int, str, str]]  # (step, layer, from, to) kernel-variant changes
    meta: dict = field(default_factory=dict)  # demo.json, when present

    @property
    def row_labels(self) -> list[str]:
        return [f"L{l}.H{h}" for l, h in self.rows]

    @property
    def injected(self) -> bool:
        if self.meta.get("injected"):
            return True
        return any(f"[{INJECTED}]" in str(a.get("message", "")) for a in self.alerts)

    @property
    def drift_threshold(self) -> float:  # the run's own, else MonitorConfig's default
        return float((self.meta.get("monitor_config") or {}).get("drift_threshold", _DEFAULTS.drift_threshold))

    @property
    def max_logit_bound(self) -> float:
        return float((self.meta.get("monitor_config") or {}).get("max_logit_bound", _DEFAULTS.max_logit_bound))


def _metrics_path(path: str | os.PathLike) -> Path:
    p = Path(path)
    if p.is_dir():
        p = p / METRICS_FILE
    if not p.exists():
        raise FileNotFoundError(
            f"no {METRICS_FILE} at {path}: pass a run folder written by flashwatch (FlashWatchCallback's run_dir, "
            f"flashwatch demo's runs/demo-*/, a JsonlExporter folder) or the {METRICS_FILE} file itself")
    return p


def _num(v: Any) -> float:
    if v is None:
        return math.nan
    try:
        return float(v)
    except (TypeError, ValueError):
        return math.nan


def load_run(path: str | os.PathLike) -> RunData:
    """Read a run folder (or its ``metrics.jsonl``) into columns.

    Steps written twice (a resumed run repeats the steps after its checkpoint) keep their last
    record. Heads missing at a step (a layer not measured) are NaN.

    Raises:
        FileNotFoundError: no ``metrics.jsonl`` there.
    """
    p = _metrics_path(path)
    layout: list[tuple[str, int]] = []
    by_step: dict[int, dict] = {}
    for rec in read_jsonl(p, kinds=None):
        kind = rec.get("kind")
        if kind == "open":
            layout = [(str(x.get("name")), int(x.get("heads", 0))) for x in rec.get("layout", [])]
        elif kind == "step" and isinstance(rec.get("metrics"), dict):
            by_step[int(rec["step"])] = rec
    records = [by_step[s] for s in sorted(by_step)]

    heads_per_layer = [h for _, h in layout]
    for rec in records:  # a layout is in every open record; fall back on the grids' own shape
        grid = rec["metrics"].get("flashwatch_delta_drift_z") or []
        for layer, row in enumerate(grid):
            while len(heads_per_layer) <= layer:
                heads_per_layer.append(0)
            heads_per_layer[layer] = max(heads_per_layer[layer], len(row))
    rows = [(layer, head) for layer, n in enumerate(heads_per_layer) for head in range(n)]
    names = [n for n, _ in layout] + [f"layer {i}" for i in range(len(layout), len(heads_per_layer))]

    series: dict[str, list[list[float]]] = {}
    for hm in HEATMAPS:
        cols = []
        for rec in records:
            grid = rec["metrics"].get(hm.metric) or []
            col = []
            for layer, head in rows:
                try:
                    col.append(_num(grid[layer][head]))
                except (IndexError, TypeError):
                    col.append(math.nan)
            cols.append(col)
        series[hm.metric] = [[c[r] for c in cols] for r in range(len(rows))]

    alerts, switches, last_variant = [], [], {}
    for rec in records:
        alerts.extend(a for a in rec.get("new_alerts") or [] if isinstance(a, dict))
        for row in rec["metrics"].get("flashwatch_kernel_variant") or []:
            if isinstance(row, dict) and _num(row.get("value")) == 1.0:
                layer, variant = int(row.get("layer", -1)), str(row.get("variant"))
                before = last_variant.get(layer)
                if before is not None and before != variant:
                    switches.append((int(rec["step"]), layer, before, variant))
                last_variant[layer] = variant

    meta: dict = {}
    demo_json = p.parent / "demo.json"
    if demo_json.exists():
        try:
            meta = json.loads(demo_json.read_text())
        except ValueError:
            meta = {}
    return RunData(path=p, steps=[int(r["step"]) for r in records],
                   loss=[_num(r["metrics"].get("flashwatch_loss")) for r in records],
                   grad_norm=[_num(r["metrics"].get("flashwatch_grad_norm")) for r in records],
                   rows=rows, layer_names=names, series=series, alerts=alerts, switches=switches, meta=meta)


# --- shared helpers -------------------------------------------------------------------------------

def _finite(xs: Sequence[float]) -> list[float]:
    return [x for x in xs if x == x and not math.isinf(x)]


def nice_ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    """About ``n`` round tick values covering [lo, hi]."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return []
    if hi <= lo:
        return [lo]
    raw = (hi - lo) / max(1, n)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step - 1e-9) * step
    ticks, t = [], first
    while t <= hi + step * 1e-9:
        ticks.append(round(t, 12))
        t += step
    return ticks


def _tick_text(v: float) -> str:
    if v == 0:
        return "0"
    if abs(v) >= 1e4 or abs(v) < 1e-3:
        return f"{v:.0e}"
    return f"{v:.10g}" if abs(v - round(v)) < 1e-9 else f"{v:.3g}"


def _bins(n: int, max_columns: int = MAX_COLUMNS) -> list[tuple[int, int]]:
    """[start, end) index ranges that split n columns into at most max_columns bins."""
    if n <= max_columns:
        return [(i, i + 1) for i in range(n)]
    edges = [round(i * n / max_columns) for i in range(max_columns + 1)]
    return [(a, b) for a, b in zip(edges, edges[1:]) if b > a]


def _combine(values: Sequence[float], how: str) -> float:
    vals = _finite(values)
    if not vals:
        return math.nan
    if how == "absmax":
        return max(vals, key=abs)
    if how == "mean":
        return sum(vals) / len(vals)
    if how == "max":
        return max(vals)
    return vals[-1]  # "last"


def _scale(run: RunData, hm: Heatmap) -> tuple[float, float]:
    """The colour range of a heatmap."""
    vals = _finite([v for row in run.series[hm.metric] for v in row])
    if hm.scale == "diverging":
        # saturate at the drift threshold: a full-colour cell is at or past it
        return -run.drift_threshold, run.drift_threshold
    if not vals:
        return 0.0, 1.0
    lo, hi = min(vals), max(vals)
    if hm.metric == "flashwatch_repeated_max_ratio_bf16":
        lo, hi = 0.0, max(hi, 0.05)
    elif hm.metric == "flashwatch_max_logit":
        lo = min(lo, 0.0)
    if hi <= lo:
        hi = lo + 1.0
    return lo, hi


def _alert_cells(run: RunData, hm: Heatmap) -> list[tuple[int, int, dict]]:
    """(row, step, alert) of alerts of this heatmap's rules that concern one head."""
    index = {rc: i for i, rc in enumerate(run.rows)}
    out = []
    for a in run.alerts:
        if a.get("rule") in hm.rules:
            row = index.get((int(a.get("layer", -1)), int(a.get("head", -1))))
            if row is not None:
                out.append((row, int(a.get("step", 0)), a))
    return out


# --- colours --------------------------------------------------------------------------------------

# anchor colours, interpolated linearly in RGB
_DIVERGING = ((0.0, (33, 102, 172)), (0.25, (103, 169, 207)), (0.5, (247, 247, 247)), (0.75, (239, 138, 98)),
              (1.0, (178, 24, 43)))
_SEQUENTIAL = ((0.0, (250, 250, 237)), (0.2, (237, 248, 177)), (0.45, (127, 205, 187)), (0.7, (44, 127, 184)),
               (1.0, (37, 52, 148)))
_NAN = "#d9d9d9"
LEVELS = 48  # colour levels (equal neighbours merge into one SVG rectangle)


def _rgb(t: float, anchors) -> str:
    t = min(1.0, max(0.0, t))
    for (t0, c0), (t1, c1) in zip(anchors, anchors[1:]):
        if t <= t1:
            f = 0.0 if t1 == t0 else (t - t0) / (t1 - t0)
            return "#%02x%02x%02x" % tuple(round(a + (b - a) * f) for a, b in zip(c0, c1))
    return "#%02x%02x%02x" % anchors[-1][1]


def _colour(v: float, lo: float, hi: float, scale: str) -> str:
    if not (v == v) or math.isinf(v):
        return _NAN
    t = (v - lo) / (hi - lo)
    t = round(min(1.0, max(0.0, t)) * (LEVELS - 1)) / (LEVELS - 1)
    return _rgb(t, _DIVERGING if scale == "diverging" else _SEQUENTIAL)


# --- SVG ------------------------------------------------------------------------------------------

_FONT = "font-family='system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif'"
_RED, _ORANGE = "#c62828", "#ef6c00"


def _e(s: Any) -> str:
    return html.escape(str(s), quote=True)


def _alert_line(a: dict) -> str:
    where = ""
    if int(a.get("layer", -1)) >= 0:
        where = f" L{a.get('layer')}" + (f".H{a.get('head')}" if int(a.get("head", -1)) >= 0 else "")
    return (f"step {a.get('step')} {a.get('severity')} {a.get('rule')}{where}: value {_num(a.get('value')):.4g}, "
            f"threshold {_num(a.get('threshold')):.4g}")


def loss_svg(run: RunData, width: int = 960, height: int = 260) -> str:
    """Loss over steps with alert markers."""
    left, right, top, bottom = 64, 96, 30, 40
    pw, ph = width - left - right, height - top - bottom
    steps = run.steps
    parts = [f"<svg xmlns='http://www.w3.org/2000/svg' class='chart' id='loss-chart' width='{width}' "
             f"height='{height}' viewBox='0 0 {width} {height}' {_FONT} font-size='12' role='img' "
             f"aria-label='loss over steps with alert markers'>"]
    losses = _finite(run.loss)
    if not steps or not losses:
        parts.append(f"<text x='{left}' y='{top + 20}'>no loss recorded</text></svg>")
        return "".join(parts)
    s0, s1 = steps[0], max(steps[-1], steps[0] + 1)
    lo, hi = min(losses), max(losses)
    pad = (hi - lo) * 0.06 or abs(hi) * 0.05 or 1.0
    lo, hi = lo - pad, hi + pad

    def x(s: float) -> float:
        return left + (s - s0) / (s1 - s0) * pw

    def y(v: float, a: float = lo, b: float = hi) -> float:
        return top + (1 - (v - a) / (b - a)) * ph

    parts.append(f"<rect x='{left}' y='{top}' width='{pw}' height='{ph}' fill='#fff' stroke='#bbb'/>")
    for t in nice_ticks(lo, hi, 5):
        parts.append(f"<line x1='{left}' x2='{left + pw}' y1='{y(t):.1f}' y2='{y(t):.1f}' stroke='#eee'/>"
                     f"<text x='{left - 6}' y='{y(t) + 4:.1f}' text-anchor='end' fill='#444'>{_tick_text(t)}</text>")
    for t in nice_ticks(s0, s1, 8):
        if s0 <= t <= s1:
            parts.append(f"<line x1='{x(t):.1f}' x2='{x(t):.1f}' y1='{top + ph}' y2='{top + ph + 4}' stroke='#888'/>"
                         f"<text x='{x(t):.1f}' y='{top + ph + 17}' text-anchor='middle' fill='#444'>"
                         f"{_tick_text(t)}</text>")
    parts.append(f"<text x='{left + pw / 2}' y='{height - 6}' text-anchor='middle' fill='#444'>optimizer step</text>"
                 f"<text x='14' y='{top + ph / 2}' text-anchor='middle' fill='#1f4e79' "
                 f"transform='rotate(-90 14 {top + ph / 2})'>loss</text>")

    # the loss, broken at non-finite values
    segments, cur = [], []
    for s, v in zip(steps, run.loss):
        if v == v and not math.isinf(v):
            cur.append(f"{x(s):.1f},{y(v):.1f}")
        elif cur:
            segments.append(cur)
            cur = []
    if cur:
        segments.append(cur)
    for seg in segments:
        parts.append(f"<polyline class='loss' points='{' '.join(seg)}' fill='none' stroke='#1f4e79' "
                     f"stroke-width='1.6'/>")

    # alert markers: one per step that started alerts
    at: dict[int, list[dict]] = {}
    for a in run.alerts:
        at.setdefault(int(a.get("step", 0)), []).append(a)
    for s, alerts in sorted(at.items()):
        critical = any(a.get("severity") == "critical" for a in alerts)
        colour = _RED if critical else _ORANGE
        xs = x(min(max(s, s0), s1))
        tip = "\n".join(_alert_line(a) for a in alerts[:12]) + (f"\n... {len(alerts) - 12} more" if len(alerts) > 12 else "")
        parts.append(f"<g class='alert-marker' data-step='{s}' data-severity='{'critical' if critical else 'warning'}'>"
                     f"<title>{_e(tip)}</title>"
                     f"<line x1='{xs:.1f}' x2='{xs:.1f}' y1='{top}' y2='{top + ph}' stroke='{colour}' "
                     f"stroke-width='1' stroke-dasharray='3,3' opacity='0.8'/>"
                     f"<path d='M{xs - 5:.1f},{top - 9} L{xs + 5:.1f},{top - 9} L{xs:.1f},{top - 1} Z' fill='{colour}'/>"
                     f"</g>")
    parts.append("</svg>")
    return "".join(parts)


def heatmap_svg(run: RunData, hm: Heatmap, width: int = 960) -> str:
    """One per-head heatmap: rows layer.head, columns monitored steps (binned past MAX_COLUMNS)."""
    data = run.series[hm.metric]
    n_rows, n_cols = len(run.rows), len(run.steps)
    left, right, top, bottom = 64, 96, 8, 34
    pw = width - left - right
    row_h = max(3.0, min(16.0, 480.0 / max(1, n_rows)))
    ph = row_h * n_rows
    height = int(top + ph + bottom)
    parts = [f"<svg xmlns='http://www.w3.org/2000/svg' class='heatmap' data-metric='{hm.metric}' width='{width}' "
             f"height='{height}' viewBox='0 0 {width} {height}' {_FONT} font-size='11' role='img' "
             f"aria-label='{_e(hm.title)} per head over steps'>"]
    if not n_rows or not n_cols:
        parts.append(f"<text x='{left}' y='{top + 14}'>no per-head data</text></svg>")
        return "".join(parts)
    lo, hi = _scale(run, hm)
    bins = _bins(n_cols)
    col_w = pw / len(bins)
    fmt = hm.fmt
    parts.append(f"<rect x='{left}' y='{top}' width='{pw}' height='{ph:.1f}' fill='{_NAN}'/>")
    for r in range(n_rows):
        yy = top + r * row_h
        label = run.row_labels[r]
        values = [_combine(data[r][a:b], hm.combine) for a, b in bins]
        colours = [_colour(v, lo, hi, hm.scale) for v in values]
        c = 0
        while c < len(bins):  # merge neighbours of one colour into one rectangle
            e = c + 1
            while e < len(bins) and colours[e] == colours[c]:
                e += 1
            first, last = run.steps[bins[c][0]], run.steps[bins[e - 1][1] - 1]
            v = values[c] if e - c == 1 else _combine(values[c:e], hm.combine)
            shown = "n/a" if not v == v else fmt.format(v)
            span = f"step {first}" if first == last else f"steps {first}-{last}"
            parts.append(f"<rect x='{left + c * col_w:.2f}' y='{yy:.2f}' width='{(e - c) * col_w + 0.3:.2f}' "
                         f"height='{row_h + 0.3:.2f}' fill='{colours[c]}'><title>{label}, {span}: {shown}</title></rect>")
            c = e
    # layer separators and row labels
    label_every = 1 if row_h >= 10 else None
    layer_start = 0
    for r, (layer, head) in enumerate(run.rows + [(-1, -1)]):
        if r == n_rows or (r > 0 and layer != run.rows[r - 1][0]):
            yy = top + r * row_h
            if r < n_rows:
                parts.append(f"<line x1='{left}' x2='{left + pw}' y1='{yy:.1f}' y2='{yy:.1f}' stroke='#fff' "
                             f"stroke-width='1.5'/>")
            if label_every is None:  # rows too thin for one label each: one per layer
                mid = top + (layer_start + r) / 2 * row_h
                parts.append(f"<text x='{left - 6}' y='{mid + 4:.1f}' text-anchor='end' fill='#333'>"
                             f"L{run.rows[layer_start][0]}</text>")
            layer_start = r
        if label_every and r < n_rows:
            parts.append(f"<text x='{left - 6}' y='{top + r * row_h + row_h / 2 + 4:.1f}' text-anchor='end' "
                         f"fill='#333'>{run.row_labels[r]}</text>")
    parts.append(f"<rect x='{left}' y='{top}' width='{pw}' height='{ph:.1f}' fill='none' stroke='#999'/>")

    # x axis in steps
    s0, s1 = run.steps[0], run.steps[-1]

    def col_x(step: float) -> float:
        # position of a step: inside its bin, proportionally
        idx = _step_index(run.steps, step)
        b = next((i for i, (a, e) in enumerate(bins) if a <= idx < e), len(bins) - 1)
        return left + (b + 0.5) * col_w

    for t in nice_ticks(s0, s1, 8):
        if s0 <= t <= s1:
            xx = col_x(t)
            parts.append(f"<line x1='{xx:.1f}' x2='{xx:.1f}' y1='{top + ph:.1f}' y2='{top + ph + 4:.1f}' stroke='#888'/>"
                         f"<text x='{xx:.1f}' y='{top + ph + 16:.1f}' text-anchor='middle' fill='#444'>"
                         f"{_tick_text(t)}</text>")
    if len(bins) < n_cols:
        parts.append(f"<text x='{left + pw}' y='{top + ph + 30:.1f}' text-anchor='end' fill='#777'>"
                     f"{n_cols} monitored steps in {len(bins)} columns ({hm.combine} per column)</text>")

    # alert outlines: white under black, visible on every colour of the scale
    for row, step, a in _alert_cells(run, hm):
        xx = col_x(step)
        w = max(col_w, 6.0)
        box = f"x='{xx - w / 2:.1f}' y='{top + row * row_h + 0.5:.1f}' width='{w:.1f}' height='{max(row_h - 1, 2):.1f}'"
        parts.append(f"<g class='alert-cell' data-step='{step}' data-severity='{_e(a.get('severity'))}'>"
                     f"<title>{_e(_alert_line(a))}</title>"
                     f"<rect {box} fill='none' stroke='#fff' stroke-width='3'/>"
                     f"<rect {box} fill='none' stroke='#000' stroke-width='1.3'/></g>")

    # legend: a vertical colour bar
    lx, lw = left + pw + 18, 12
    gid = f"g-{hm.metric}"
    anchors = _DIVERGING if hm.scale == "diverging" else _SEQUENTIAL
    # offsets ascend top to bottom: the top of the bar is the high end of the scale
    stops = "".join(f"<stop offset='{1 - t:.2f}' stop-color='{_rgb(t, anchors)}'/>" for t, _ in reversed(anchors))
    parts.append(f"<defs><linearGradient id='{gid}' x1='0' y1='0' x2='0' y2='1'>{stops}</linearGradient></defs>"
                 f"<rect x='{lx}' y='{top}' width='{lw}' height='{ph:.1f}' fill='url(#{gid})' stroke='#999'/>")
    for t in nice_ticks(lo, hi, 4):
        if lo <= t <= hi:
            yy = top + (1 - (t - lo) / (hi - lo)) * ph
            parts.append(f"<text x='{lx + lw + 4}' y='{yy + 4:.1f}' fill='#444'>{_tick_text(t)}</text>")
    parts.append("</svg>")
    return "".join(parts)


def _step_index(steps: Sequence[int], step: float) -> int:
    """Index of the last monitored step <= step (0 if before the first)."""
    lo, hi = 0, len(steps) - 1
    if step <= steps[0]:
        return 0
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if steps[mid] <= step:
            lo = mid
        else:
            hi = mid - 1
    return lo


# --- HTML -----------------------------------------------------------------------------------------

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


def _facts(run: RunData) -> list[tuple[str, str]]:
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
    if m:
        model = m.get("model") or {}
        what = m.get("command", "")
        if model:
            what += (f": {model.get('n_layer')}-layer GPT, {model.get('n_head')} heads, d={model.get('n_embd')}, "
                     f"context {model.get('block_size')}, batch {model.get('batch_size')}")
        facts.append(("run", what))
        facts.append(("kernel", f"{m.get('mode')} mode, variant {m.get('variant')}, {m.get('precision')} on "
                                f"{m.get('device')}, seed {m.get('seed')}"))
        if m.get("seconds") is not None:
            facts.append(("time", f"{m.get('seconds')} s, finished {m.get('finished', '')}"))
    return facts


def to_html(run: RunData) -> str:
    """The report as one self-contained HTML page (inline SVG, no scripts, no external assets)."""
    title = f"flashwatch report: {run.path.parent.name or run.path.name}"
    out = ["<!DOCTYPE html>", "<html lang='en'><head><meta charset='utf-8'>",
           f"<title>{_e(title)}{' [' + INJECTED + ']' if run.injected else ''}</title>",
           f"<style>{_CSS}</style></head><body>", f"<h1>{_e(title)}</h1>"]
    if run.injected:
        label = run.meta.get("label") or f"{INJECTED} FAULT: this run used an injected fault"
        if not label.startswith(INJECTED):
            label = f"{INJECTED} FAULT: {label}"
        out.append(f"<div class='banner'>{_e(label)}. Not a real failure: a test of the early warning.</div>")
    out.append("<div class='facts'>" + "".join(f"<div>{_e(k)}</div><div>{_e(v)}</div>" for k, v in _facts(run))
               + "</div>")

    # alerts summary
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
    out.append("<p class='cap legend'><span><i class='sw' style='background:#1f4e79'></i>loss</span>"
               f"<span><i class='sw' style='background:{_RED}'></i>critical alert</span>"
               f"<span><i class='sw' style='background:{_ORANGE}'></i>warning</span></p>")

    out.append("<h2>Per-head signals over steps</h2>")
    out.append("<p class='cap'>One row per attention head (<code>L</code>layer<code>.H</code>head), one column per "
               "monitored step; grey: not measured. Outlined cells (black): an alert of that signal's rule started there. "
               "Hover a cell for its value.</p>")
    for hm in HEATMAPS:
        lo, hi = _scale(run, hm)
        note = ""
        if hm.scale == "diverging":
            note = (f" Colour saturates at ±{run.drift_threshold:g}, the delta_drift threshold: full red or blue "
                    f"is at or past it.")
        elif hm.metric == "flashwatch_max_logit":
            note = f" The max_logit rule warns at {run.max_logit_bound:g}."
        out.append(f"<h3 style='font-size:15px;margin:18px 0 2px'>{_e(hm.title)}</h3>"
                   f"<p class='cap'>{_e(BY_NAME[hm.metric].help)}{_e(note)}</p>")
        out.append(heatmap_svg(run, hm))

    out.append("<h2>Alerts</h2>")
    if run.alerts:
        out.append("<table class='alerts'><tr><th>step</th><th>severity</th><th>rule</th><th>head</th>"
                   "<th>value</th><th>threshold</th><th>message</th></tr>")
        for a in run.alerts[:100]:
            cls = "crit" if a.get("severity") == "critical" else "warn"
            where = (f"L{a.get('layer')}.H{a.get('head')}" if int(a.get("head", -1)) >= 0
                     else f"L{a.get('layer')}" if int(a.get("layer", -1)) >= 0 else "-")
            out.append(f"<tr><td>{_e(a.get('step'))}</td><td class='{cls}'>{_e(a.get('severity'))}</td>"
                       f"<td>{_e(a.get('rule'))}</td><td>{_e(where)}</td><td>{_num(a.get('value')):.4g}</td>"
                       f"<td>{_num(a.get('threshold')):.4g}</td><td>{_e(a.get('message', ''))}</td></tr>")
        out.append("</table>")
        if len(run.alerts) > 100:
            out.append(f"<p class='cap'>... and {len(run.alerts) - 100} more (alerts.log has them all).</p>")
    else:
        out.append("<p class='cap'>None.</p>")
    if run.switches:
        out.append("<h2>Kernel variant switches</h2><table><tr><th>step</th><th>layer</th><th>from</th><th>to</th></tr>"
                   + "".join(f"<tr><td>{s}</td><td>{l}</td><td>{_e(a)}</td><td>{_e(b)}</td></tr>"
                             for s, l, a, b in run.switches) + "</table>")
    out.append("<p class='cap' style='margin-top:24px'>Written by <code>flashwatch report</code> from "
               f"{_e(run.path.name)}. Metric definitions: the README's metric table.</p>")
    out.append("</body></html>")
    return "\n".join(out)


# --- PNG (matplotlib) -----------------------------------------------------------------------------

class MissingMatplotlib(RuntimeError):
    """PNG output asked for without matplotlib installed."""


def to_png(run: RunData, out: str | os.PathLike) -> Path:
    """The report as a PNG (loss with alert markers above the per-head heatmaps).

    Raises:
        MissingMatplotlib: matplotlib is not installed (``pip install flashwatch[report]``).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.colors import LinearSegmentedColormap
    except ImportError:
        raise MissingMatplotlib("PNG output needs matplotlib: pip install flashwatch[report] (or pip install "
                                "matplotlib). HTML needs nothing extra: leave out --out or give a .html path.") from None

    def cmap(anchors, name):
        cm = LinearSegmentedColormap.from_list(name, [(t, tuple(c / 255 for c in rgb)) for t, rgb in anchors])
        return cm.with_extremes(bad=_NAN)

    n_rows = max(1, len(run.rows))
    row_in = max(0.6, min(3.2, 0.16 * n_rows + 0.4))
    heights = [2.4] + [row_in] * len(HEATMAPS)
    fig, axes = plt.subplots(len(heights), 1, figsize=(12, sum(heights) + 1.4),
                             gridspec_kw={"height_ratios": heights}, squeeze=False)
    axes = [a[0] for a in axes]
    title = f"flashwatch report: {run.path.parent.name or run.path.name}"
    if run.injected:
        title = f"[{INJECTED} FAULT] " + title
    fig.suptitle(title, fontsize=13, color="#b71c1c" if run.injected else "black", x=0.01, y=0.995, ha="left")

    ax = axes[0]
    ax.plot(run.steps, run.loss, color="#1f4e79", lw=1.4, label="loss")
    ax.set_ylabel("loss")
    ax.set_xlim(run.steps[0] if run.steps else 0, run.steps[-1] if run.steps else 1)
    seen = set()
    for a in run.alerts:
        crit = a.get("severity") == "critical"
        key = (int(a.get("step", 0)), crit)
        if key in seen:
            continue
        seen.add(key)
        ax.axvline(key[0], color=_RED if crit else _ORANGE, lw=0.8, ls="--", alpha=0.8,
                   label=("critical alert" if crit else "warning") if (crit, "l") not in seen else None)
        seen.add((crit, "l"))
    if not run.steps:
        ax.text(0.5, 0.5, f"no monitored step in {run.path.name} yet", ha="center", va="center",
                transform=ax.transAxes, color="#555")
    ax.legend(loc="upper right", fontsize=8, frameon=False)
    n_alerts = Counter(a.get("severity") for a in run.alerts)
    ax.set_title(f"loss; alerts: {n_alerts.get('critical', 0)} critical, {n_alerts.get('warning', 0)} warning",
                 fontsize=10, loc="left")

    extent_steps = (run.steps[0] - 0.5, run.steps[-1] + 0.5) if run.steps else (0, 1)
    for ax, hm in zip(axes[1:], HEATMAPS):
        lo, hi = _scale(run, hm)
        data = [[v if v == v else float("nan") for v in row] for row in run.series[hm.metric]] or [[float("nan")]]
        im = ax.imshow(data, aspect="auto", interpolation="nearest", vmin=lo, vmax=hi,
                       cmap=cmap(_DIVERGING if hm.scale == "diverging" else _SEQUENTIAL, hm.metric),
                       extent=(extent_steps[0], extent_steps[1], n_rows - 0.5, -0.5))
        ax.set_title(hm.title, fontsize=10, loc="left")
        if n_rows <= 24:
            ax.set_yticks(range(n_rows), run.row_labels, fontsize=7)
        else:
            starts = [i for i, (l, h) in enumerate(run.rows) if h == 0]
            ax.set_yticks(starts, [f"L{run.rows[i][0]}" for i in starts], fontsize=7)
        for row, step, a in _alert_cells(run, hm):  # white under black: visible on every colour
            ax.plot(step, row, marker="s", ms=7, mfc="none", mec="white", mew=2.6)
            ax.plot(step, row, marker="s", ms=7, mfc="none", mec="black", mew=1.1)
        fig.colorbar(im, ax=ax, pad=0.01, fraction=0.03)
    axes[-1].set_xlabel("optimizer step")
    fig.tight_layout(rect=(0, 0, 1, 0.985))
    out = Path(out)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


# --- entry points ---------------------------------------------------------------------------------

def render(path: str | os.PathLike, out: str | os.PathLike | None = None) -> Path:
    """Render a run folder (or its ``metrics.jsonl``) to ``out`` (.html or .png; default RUN_DIR/report.html).

    Raises:
        FileNotFoundError: no ``metrics.jsonl`` at ``path``.
        MissingMatplotlib: a .png asked for without matplotlib.
        ValueError: ``out`` ends neither in .html/.htm nor .png.
    """
    run = load_run(path)
    out = Path(out) if out is not None else run.path.parent / "report.html"
    suffix = out.suffix.lower()
    if suffix == ".png":
        return to_png(run, out)
    if suffix not in (".html", ".htm"):
        raise ValueError(f"--out {out}: the format comes from the suffix, .html (default) or .png")
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(to_html(run), encoding="utf-8")
    os.replace(tmp, out)
    return out


def main(args) -> int:
    """The ``flashwatch report`` command."""
    import sys

    try:
        out = render(args.run_dir, args.out)
    except (FileNotFoundError, MissingMatplotlib, ValueError) as exc:
        print(f"flashwatch report: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0
