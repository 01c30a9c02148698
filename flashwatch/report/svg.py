"""The report's charts as inline SVG (no scripts; hover a cell or marker for its ``<title>``)."""

from __future__ import annotations

import html
import math
from typing import Any

from .charts import (CRITICAL_COLOUR, LOSS_COLOUR, NAN_COLOUR, WARNING_COLOUR, Heatmap, HeatmapGrid, alert_line,
                     alert_markers, anchors, colour, combine, display_rows, finite, heatmap_grid, nice_ticks, rgb,
                     tick_text)
from .load import RunData

__all__ = ["loss_svg", "heatmap_svg"]

_FONT = "font-family='system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif'"


def _e(s: Any) -> str:
    return html.escape(str(s), quote=True)


def loss_svg(run: RunData, width: int = 960, height: int = 260) -> str:
    """Loss over steps with a marker at every step where alerts started (red: critical, orange: warning)."""
    left, right, top, bottom = 64, 96, 30, 40
    pw, ph = width - left - right, height - top - bottom
    steps = run.steps
    parts = [f"<svg xmlns='http://www.w3.org/2000/svg' class='chart' id='loss-chart' width='{width}' "
             f"height='{height}' viewBox='0 0 {width} {height}' {_FONT} font-size='12' role='img' "
             f"aria-label='loss over steps with alert markers'>"]
    losses = finite(run.loss)
    if not steps or not losses:
        parts.append(f"<text x='{left}' y='{top + 20}'>no loss recorded</text></svg>")
        return "".join(parts)
    s0, s1 = steps[0], max(steps[-1], steps[0] + 1)
    lo, hi = min(losses), max(losses)
    pad = (hi - lo) * 0.06 or abs(hi) * 0.05 or 1.0
    lo, hi = lo - pad, hi + pad

    def x(s: float) -> float:
        return left + (s - s0) / (s1 - s0) * pw

    def y(v: float) -> float:
        return top + (1 - (v - lo) / (hi - lo)) * ph

    parts.append(f"<rect x='{left}' y='{top}' width='{pw}' height='{ph}' fill='#fff' stroke='#bbb'/>")
    for t in nice_ticks(lo, hi, 5):
        parts.append(f"<line x1='{left}' x2='{left + pw}' y1='{y(t):.1f}' y2='{y(t):.1f}' stroke='#eee'/>"
                     f"<text x='{left - 6}' y='{y(t) + 4:.1f}' text-anchor='end' fill='#444'>{tick_text(t)}</text>")
    for t in nice_ticks(s0, s1, 8):
        if s0 <= t <= s1:
            parts.append(f"<line x1='{x(t):.1f}' x2='{x(t):.1f}' y1='{top + ph}' y2='{top + ph + 4}' stroke='#888'/>"
                         f"<text x='{x(t):.1f}' y='{top + ph + 17}' text-anchor='middle' fill='#444'>"
                         f"{tick_text(t)}</text>")
    parts.append(f"<text x='{left + pw / 2}' y='{height - 6}' text-anchor='middle' fill='#444'>optimizer step</text>"
                 f"<text x='14' y='{top + ph / 2}' text-anchor='middle' fill='{LOSS_COLOUR}' "
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
        parts.append(f"<polyline class='loss' points='{' '.join(seg)}' fill='none' stroke='{LOSS_COLOUR}' "
                     f"stroke-width='1.6'/>")

    for m in alert_markers(run):
        c = CRITICAL_COLOUR if m.critical else WARNING_COLOUR
        xs = x(min(max(m.step, s0), s1))
        more = len(m.alerts) - 12
        tip = "\n".join(alert_line(a) for a in m.alerts[:12]) + (f"\n... {more} more" if more > 0 else "")
        parts.append(f"<g class='alert-marker' data-step='{m.step}' "
                     f"data-severity='{'critical' if m.critical else 'warning'}'><title>{_e(tip)}</title>"
                     f"<line x1='{xs:.1f}' x2='{xs:.1f}' y1='{top}' y2='{top + ph}' stroke='{c}' "
                     f"stroke-width='1' stroke-dasharray='3,3' opacity='0.8'/>"
                     f"<path d='M{xs - 5:.1f},{top - 9} L{xs + 5:.1f},{top - 9} L{xs:.1f},{top - 1} Z' fill='{c}'/>"
                     f"</g>")
    parts.append("</svg>")
    return "".join(parts)


def heatmap_svg(run: RunData, hm: Heatmap, width: int = 960) -> str:
    """One per-head heatmap: rows layer.head (or layers, ``display_rows``), columns monitored steps
    (binned past ``MAX_COLUMNS``, or fewer columns for many rows)."""
    n_rows = len(display_rows(run))
    left, right, top, bottom = 64, 96, 8, 34
    pw = width - left - right
    row_h = max(3.0, min(16.0, 480.0 / max(1, n_rows)))
    ph = row_h * n_rows
    height = int(top + ph + bottom)
    parts = [f"<svg xmlns='http://www.w3.org/2000/svg' class='heatmap' data-metric='{hm.metric}' width='{width}' "
             f"height='{height}' viewBox='0 0 {width} {height}' {_FONT} font-size='11' role='img' "
             f"aria-label='{_e(hm.title)} per head over steps'>"]
    if not n_rows or not run.steps:
        parts.append(f"<text x='{left}' y='{top + 14}'>no per-head data</text></svg>")
        return "".join(parts)
    grid = heatmap_grid(run, hm)
    n_cols = len(grid.columns)
    col_w = pw / n_cols
    parts.append(f"<rect x='{left}' y='{top}' width='{pw}' height='{ph:.1f}' fill='{NAN_COLOUR}'/>")
    for r, values in enumerate(grid.values):
        yy = top + r * row_h
        label = grid.row_labels[r]
        colours = [colour(v, grid.lo, grid.hi, hm) for v in values]
        c = 0
        while c < n_cols:  # merge neighbours of one colour into one rectangle
            e = c + 1
            while e < n_cols and colours[e] == colours[c]:
                e += 1
            first, last = grid.columns[c][0], grid.columns[e - 1][1]
            v = values[c] if e - c == 1 else combine(values[c:e], hm.combine)
            shown = "n/a" if not v == v else hm.fmt.format(v)
            span = f"step {first}" if first == last else f"steps {first}-{last}"
            parts.append(f"<rect x='{left + c * col_w:.2f}' y='{yy:.2f}' width='{(e - c) * col_w + 0.3:.2f}' "
                         f"height='{row_h + 0.3:.2f}' fill='{colours[c]}'><title>{label}, {span}: {shown}</title></rect>")
            c = e
    parts += _row_labels(grid, left, top, pw, row_h)
    parts.append(f"<rect x='{left}' y='{top}' width='{pw}' height='{ph:.1f}' fill='none' stroke='#999'/>")

    # x axis in steps: each label under the middle of the column of its step
    for c, label in grid.step_ticks(8):
        xx = left + (c + 0.5) * col_w
        parts.append(f"<line x1='{xx:.1f}' x2='{xx:.1f}' y1='{top + ph:.1f}' y2='{top + ph + 4:.1f}' stroke='#888'/>"
                     f"<text x='{xx:.1f}' y='{top + ph + 16:.1f}' text-anchor='middle' fill='#444'>{label}</text>")
    if grid.binned:
        parts.append(f"<text x='{left + pw}' y='{top + ph + 30:.1f}' text-anchor='end' fill='#777'>"
                     f"{len(run.steps)} monitored steps in {n_cols} columns ({hm.combine} per column)</text>")

    # alert outlines: white under black, visible on every colour of the scale
    for row, col, step, a in grid.cells:
        xx = left + (col + 0.5) * col_w
        w = max(col_w, 6.0)
        box = f"x='{xx - w / 2:.1f}' y='{top + row * row_h + 0.5:.1f}' width='{w:.1f}' height='{max(row_h - 1, 2):.1f}'"
        parts.append(f"<g class='alert-cell' data-step='{step}' data-severity='{_e(a.get('severity'))}'>"
                     f"<title>{_e(alert_line(a))}</title>"
                     f"<rect {box} fill='none' stroke='#fff' stroke-width='3'/>"
                     f"<rect {box} fill='none' stroke='#000' stroke-width='1.3'/></g>")

    # legend: a vertical colour bar; gradient offsets ascend top to bottom, the top is the high end
    lx, lw = left + pw + 18, 12
    gid = f"g-{hm.metric}"
    stops = "".join(f"<stop offset='{1 - t:.2f}' stop-color='{rgb(t, anchors(hm))}'/>"
                    for t, _ in reversed(anchors(hm)))
    parts.append(f"<defs><linearGradient id='{gid}' x1='0' y1='0' x2='0' y2='1'>{stops}</linearGradient></defs>"
                 f"<rect x='{lx}' y='{top}' width='{lw}' height='{ph:.1f}' fill='url(#{gid})' stroke='#999'/>")
    for t in nice_ticks(grid.lo, grid.hi, 4):
        if grid.lo <= t <= grid.hi:
            yy = top + (1 - (t - grid.lo) / (grid.hi - grid.lo)) * ph
            parts.append(f"<text x='{lx + lw + 4}' y='{yy + 4:.1f}' fill='#444'>{tick_text(t)}</text>")
    parts.append("</svg>")
    return "".join(parts)


def _row_labels(grid: HeatmapGrid, left: float, top: float, pw: float, row_h: float) -> list[str]:
    """White lines between layers; a label per row (``L0.H1``), or per layer when rows are thin."""
    parts = []
    rows = grid.rows
    n_rows = len(rows)
    one_per_row = row_h >= 10
    layer_start = 0
    for r in range(n_rows + 1):
        if r == n_rows or (r > 0 and rows[r][0] != rows[r - 1][0]):
            yy = top + r * row_h
            if r < n_rows:
                parts.append(f"<line x1='{left}' x2='{left + pw}' y1='{yy:.1f}' y2='{yy:.1f}' stroke='#fff' "
                             f"stroke-width='1.5'/>")
            if not one_per_row:
                mid = top + (layer_start + r) / 2 * row_h
                parts.append(f"<text x='{left - 6}' y='{mid + 4:.1f}' text-anchor='end' fill='#333'>"
                             f"L{rows[layer_start][0]}</text>")
            layer_start = r
        if one_per_row and r < n_rows:
            parts.append(f"<text x='{left - 6}' y='{top + r * row_h + row_h / 2 + 4:.1f}' text-anchor='end' "
                         f"fill='#333'>{grid.row_labels[r]}</text>")
    return parts
