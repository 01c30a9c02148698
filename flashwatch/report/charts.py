"""What the report's charts show, prepared once for both renderers (SVG in ``svg``, PNG in ``png``).

- ``HEATMAPS``: the per-head heatmaps (metric, colour scale, how binned steps combine, the alert
  rules that outline a cell);
- ``heatmap_grid``: one heatmap's values binned into at most ``MAX_COLUMNS`` columns (fewer where
  there are many rows: ``MAX_CELLS`` cells at most; past ``MAX_HEAD_ROWS`` heads one row per layer,
  ``display_rows``), its colour range and its alert cells;
- ``alert_markers``: the steps where alerts started, for the loss chart;
- colour scales, tick values and labels.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from .load import PER_HEAD_METRICS, RunData, num

__all__ = ["Heatmap", "HEATMAPS", "MAX_COLUMNS", "MAX_CELLS", "MAX_HEAD_ROWS", "HeatmapGrid", "heatmap_grid",
           "display_rows", "AlertMarker", "alert_markers",
           "alert_line", "bins", "nice_ticks", "tick_text", "colour", "rgb", "anchors", "NAN_COLOUR",
           "LOSS_COLOUR", "CRITICAL_COLOUR", "WARNING_COLOUR", "finite"]

MAX_COLUMNS = 240  # heatmap columns at most; longer runs are binned
# the HTML holds a rectangle (with its tooltip) per run of equal colours in a row: cells at most per
# heatmap, so that a report of a model with many heads stays a page a browser opens (GPT-2 small,
# 144 heads: 83 columns), and past MAX_HEAD_ROWS heads one row per layer, its most extreme head
MAX_CELLS = 12_000
MIN_COLUMNS = 24
MAX_HEAD_ROWS = 256
LEVELS = 48  # colour levels (equal neighbours merge into one SVG rectangle)
NAN_COLOUR = "#d9d9d9"
LOSS_COLOUR, CRITICAL_COLOUR, WARNING_COLOUR = "#1f4e79", "#c62828", "#ef6c00"


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
    Heatmap("flashwatch_wq_error_coherence", "W^Q-gradient error coherence (1: one direction)", "sequential",
            "{:.2f}", (), "last"),
    Heatmap("flashwatch_wq_error_push_cumulative", "cumulative W^Q-error push on sigma_max", "diverging", "{:+.3g}",
            (), "last"),
)
assert tuple(h.metric for h in HEATMAPS) == PER_HEAD_METRICS


def finite(xs: Sequence[float]) -> list[float]:
    return [x for x in xs if x == x and not math.isinf(x)]


# --- ticks ----------------------------------------------------------------------------------------

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


def tick_text(v: float) -> str:
    if v == 0:
        return "0"
    if abs(v) >= 1e4 or abs(v) < 1e-3:
        return f"{v:.0e}"
    return f"{v:.10g}" if abs(v - round(v)) < 1e-9 else f"{v:.3g}"


# --- colours --------------------------------------------------------------------------------------

# anchor colours (position on the scale, RGB), interpolated linearly in RGB
_DIVERGING = ((0.0, (33, 102, 172)), (0.25, (103, 169, 207)), (0.5, (247, 247, 247)), (0.75, (239, 138, 98)),
              (1.0, (178, 24, 43)))
_SEQUENTIAL = ((0.0, (250, 250, 237)), (0.2, (237, 248, 177)), (0.45, (127, 205, 187)), (0.7, (44, 127, 184)),
               (1.0, (37, 52, 148)))


def anchors(hm: Heatmap) -> tuple[tuple[float, tuple[int, int, int]], ...]:
    """The colour scale of a heatmap, as (position in [0, 1], RGB) anchors."""
    return _DIVERGING if hm.scale == "diverging" else _SEQUENTIAL


def rgb(t: float, scale) -> str:
    """``#rrggbb`` at position ``t`` in [0, 1] of a scale of ``anchors``."""
    t = min(1.0, max(0.0, t))
    for (t0, c0), (t1, c1) in zip(scale, scale[1:]):
        if t <= t1:
            f = 0.0 if t1 == t0 else (t - t0) / (t1 - t0)
            return "#%02x%02x%02x" % tuple(round(a + (b - a) * f) for a, b in zip(c0, c1))
    return "#%02x%02x%02x" % scale[-1][1]


def colour(v: float, lo: float, hi: float, hm: Heatmap) -> str:
    """The colour of value ``v`` on ``hm``'s scale over [lo, hi], quantised to ``LEVELS`` levels."""
    if not (v == v) or math.isinf(v):
        return NAN_COLOUR
    t = (v - lo) / (hi - lo)
    t = round(min(1.0, max(0.0, t)) * (LEVELS - 1)) / (LEVELS - 1)
    return rgb(t, anchors(hm))


# --- heatmaps -------------------------------------------------------------------------------------

def bins(n: int, max_columns: int = MAX_COLUMNS) -> list[tuple[int, int]]:
    """[start, end) index ranges that split n columns into at most max_columns bins."""
    if n <= max_columns:
        return [(i, i + 1) for i in range(n)]
    edges = [round(i * n / max_columns) for i in range(max_columns + 1)]
    return [(a, b) for a, b in zip(edges, edges[1:]) if b > a]


def combine(values: Sequence[float], how: str) -> float:
    """Values of one bin as one: ``"absmax"``, ``"mean"``, ``"max"`` or ``"last"`` of the finite ones."""
    vals = finite(values)
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
    if hm.metric == "flashwatch_delta_drift_z":
        # saturate at the drift threshold: a full-colour cell is at or past it
        return -run.drift_threshold, run.drift_threshold
    ranges = [(min(vals), max(vals)) for vals in map(finite, run.series[hm.metric]) if vals]  # a row at a time
    if hm.scale == "diverging":  # centred on 0, out to the largest magnitude of the run
        top = max((max(-lo, hi) for lo, hi in ranges), default=0.0)
        top = top if top > 0 else 1.0
        return -top, top
    if not ranges:
        return 0.0, 1.0
    lo, hi = min(lo for lo, _ in ranges), max(hi for _, hi in ranges)
    if hm.metric == "flashwatch_repeated_max_ratio_bf16":
        lo, hi = 0.0, max(hi, 0.05)
    elif hm.metric == "flashwatch_max_logit":
        lo = min(lo, 0.0)
    if hi <= lo:
        hi = lo + 1.0
    return lo, hi


def display_rows(run: RunData) -> list[tuple[int, int]]:
    """The heatmaps' rows: ``run.rows`` ((layer, head)), or past ``MAX_HEAD_ROWS`` heads one row per
    layer, ``(layer, -1)``."""
    if len(run.rows) <= MAX_HEAD_ROWS:
        return list(run.rows)
    return [(layer, -1) for layer in dict.fromkeys(layer for layer, _ in run.rows)]


def row_label(row: tuple[int, int]) -> str:
    return f"L{row[0]}.H{row[1]}" if row[1] >= 0 else f"L{row[0]}"


@dataclass
class HeatmapGrid:
    """One heatmap ready to draw: ``values[row][column]``, columns are bins of monitored steps."""

    heatmap: Heatmap
    rows: list[tuple[int, int]]  # (layer, head) of each row; head -1: the layer's most extreme head
    values: list[list[float]]  # rows x columns (NaN: not measured)
    columns: list[tuple[int, int]]  # (first step, last step) of each column
    lo: float  # colour range
    hi: float
    cells: list[tuple[int, int, int, dict]]  # (row, column, step, alert) of alerts of this heatmap's rules
    binned: bool  # more monitored steps than columns

    @property
    def row_labels(self) -> list[str]:
        return [row_label(r) for r in self.rows]

    @property
    def per_layer(self) -> bool:
        return any(head < 0 for _, head in self.rows)

    def column_of(self, step: float) -> int:
        """The column holding ``step`` (the last column starting at or before it; 0 before the first)."""
        c = 0
        for i, (first, _) in enumerate(self.columns):
            if first <= step:
                c = i
            else:
                break
        return c

    def step_ticks(self, n: int = 8) -> list[tuple[int, str]]:
        """About ``n`` x-axis ticks ``(column, label)``: evenly spaced columns, each labelled with
        the first monitored step it holds, so every label sits under the column of its step."""
        last = len(self.columns) - 1
        picked = [int(t) for t in nice_ticks(0, last, n) if t == int(t) and 0 <= t <= last] if last > 0 else [0]
        return [(c, tick_text(self.columns[c][0])) for c in picked if self.columns]


def heatmap_grid(run: RunData, hm: Heatmap, max_columns: int | None = None) -> HeatmapGrid:
    """``hm``'s values for ``run`` on ``display_rows(run)``, binned into at most ``max_columns`` columns
    (default: ``MAX_COLUMNS``, fewer where the rows times the columns would pass ``MAX_CELLS``;
    ``hm.combine`` per column); a layer's row holds its most extreme head at each step (largest
    magnitude on a diverging scale, largest value on a sequential one)."""
    data, rows = run.series[hm.metric], display_rows(run)
    if len(rows) != len(run.rows):
        across = "absmax" if hm.scale == "diverging" else "max"
        heads = {layer: [i for i, (l, _) in enumerate(run.rows) if l == layer] for layer, _ in rows}
        data = [[combine([data[i][t] for i in heads[layer]], across) for t in range(len(run.steps))]
                for layer, _ in rows]
    if max_columns is None:
        max_columns = min(MAX_COLUMNS, max(MIN_COLUMNS, MAX_CELLS // max(1, len(rows))))
    ranges = bins(len(run.steps), max_columns)
    values = [[combine(row[a:b], hm.combine) for a, b in ranges] for row in data]
    columns = [(run.steps[a], run.steps[b - 1]) for a, b in ranges]
    lo, hi = _scale(run, hm)
    grid = HeatmapGrid(hm, rows, values, columns, lo, hi, [], len(ranges) < len(run.steps))
    index = {rc: i for i, rc in enumerate(rows)}
    per_layer = len(rows) != len(run.rows)  # an alert on a head is outlined in its layer's row
    for a in run.alerts:
        if a.get("rule") in hm.rules:
            layer, head = int(a.get("layer", -1)), int(a.get("head", -1))
            row = index.get((layer, -1 if per_layer else head))
            if row is not None:
                step = int(a.get("step", 0))
                grid.cells.append((row, grid.column_of(step), step, a))
    return grid


# --- alerts ---------------------------------------------------------------------------------------

@dataclass
class AlertMarker:
    """The alerts that started at one step: one marker on the loss chart, red if any is critical."""

    step: int
    alerts: list[dict]

    @property
    def critical(self) -> bool:
        return any(a.get("severity") == "critical" for a in self.alerts)


def alert_markers(run: RunData) -> list[AlertMarker]:
    """One marker per step where alerts started, in step order."""
    at: dict[int, list[dict]] = {}
    for a in run.alerts:
        at.setdefault(int(a.get("step", 0)), []).append(a)
    return [AlertMarker(s, alerts) for s, alerts in sorted(at.items())]


def alert_line(a: dict) -> str:
    """One alert as one line of text (tooltips)."""
    where = ""
    if int(a.get("layer", -1)) >= 0:
        where = f" L{a.get('layer')}" + (f".H{a.get('head')}" if int(a.get("head", -1)) >= 0 else "")
    return (f"step {a.get('step')} {a.get('severity')} {a.get('rule')}{where}: value {num(a.get('value')):.4g}, "
            f"threshold {num(a.get('threshold')):.4g}")
