"""The report as a PNG with matplotlib (``pip install matplotlib``): the loss with alert
markers above the per-head heatmaps, drawn from the same prepared data as the HTML charts."""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

from .charts import (CRITICAL_COLOUR, HEATMAPS, LOSS_COLOUR, NAN_COLOUR, WARNING_COLOUR, alert_markers, anchors,
                     display_rows, heatmap_grid)
from ..vocabulary import INJECTED
from .load import RunData
from .page import title

__all__ = ["to_png", "MissingMatplotlib"]


class MissingMatplotlib(RuntimeError):
    """PNG output asked for without matplotlib installed."""


def to_png(run: RunData, out: str | os.PathLike) -> Path:
    """Write the report as a PNG to ``out``; returns its path.

    Raises:
        MissingMatplotlib: matplotlib is not installed (``pip install matplotlib``).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.colors import LinearSegmentedColormap
    except ImportError:
        raise MissingMatplotlib("PNG output needs matplotlib: pip install matplotlib (from a flashwatch checkout: "
                                "pip install '.[report]'). HTML needs nothing extra: leave out --out or give a .html path.") from None

    n_rows = max(1, len(display_rows(run)))
    row_in = max(0.6, min(3.2, 0.16 * n_rows + 0.4))
    heights = [2.4] + [row_in] * len(HEATMAPS)
    fig, axes = plt.subplots(len(heights), 1, figsize=(12, sum(heights) + 1.4),
                             gridspec_kw={"height_ratios": heights}, squeeze=False)
    axes = [a[0] for a in axes]
    head = f"[{INJECTED} FAULT] " + title(run) if run.injected else title(run)
    fig.suptitle(head, fontsize=13, color="#b71c1c" if run.injected else "black", x=0.01, y=0.995, ha="left")

    ax = axes[0]
    ax.plot(run.steps, run.loss, color=LOSS_COLOUR, lw=1.4, label="loss")
    ax.set_ylabel("loss")
    ax.set_xlim(run.steps[0], max(run.steps[-1], run.steps[0] + 1))
    labelled = set()
    for m in alert_markers(run):
        label = "critical alert" if m.critical else "warning"
        ax.axvline(m.step, color=CRITICAL_COLOUR if m.critical else WARNING_COLOUR, lw=0.8, ls="--", alpha=0.8,
                   label=None if label in labelled else label)
        labelled.add(label)
    ax.legend(loc="upper right", fontsize=8, frameon=False)
    n_alerts = Counter(a.get("severity") for a in run.alerts)
    ax.set_title(f"loss; alerts: {n_alerts.get('critical', 0)} critical, {n_alerts.get('warning', 0)} warning",
                 fontsize=10, loc="left")

    for ax, hm in zip(axes[1:], HEATMAPS):
        grid = heatmap_grid(run, hm)
        cmap = LinearSegmentedColormap.from_list(
            hm.metric, [(t, tuple(c / 255 for c in rgb)) for t, rgb in anchors(hm)]).with_extremes(bad=NAN_COLOUR)
        # columns are equally wide, as in the SVG; the x axis counts columns, labelled in steps
        im = ax.imshow(grid.values or [[float("nan")]], aspect="auto", interpolation="nearest", vmin=grid.lo,
                       vmax=grid.hi, cmap=cmap, extent=(-0.5, len(grid.columns) - 0.5, n_rows - 0.5, -0.5))
        ticks = grid.step_ticks(8)
        ax.set_xticks([c for c, _ in ticks], [label for _, label in ticks], fontsize=8)
        heading = hm.title + (f" ({hm.combine} per column)" if grid.binned else "")
        heading += " (one row per layer: its most extreme head)" if grid.per_layer else ""
        ax.set_title(heading, fontsize=10, loc="left")
        if n_rows <= 24:
            ax.set_yticks(range(len(grid.rows)), grid.row_labels, fontsize=7)
        else:
            starts = [i for i, (l, h) in enumerate(grid.rows) if h <= 0 and (i == 0 or grid.rows[i - 1][0] != l)]
            ax.set_yticks(starts, [f"L{grid.rows[i][0]}" for i in starts], fontsize=7)
        for row, col, _, _ in grid.cells:  # white under black: visible on every colour
            ax.plot(col, row, marker="s", ms=7, mfc="none", mec="white", mew=2.6)
            ax.plot(col, row, marker="s", ms=7, mfc="none", mec="black", mew=1.1)
        fig.colorbar(im, ax=ax, pad=0.01, fraction=0.03)
    axes[-1].set_xlabel("optimizer step")
    fig.tight_layout(rect=(0, 0, 1, 0.985))
    out = Path(out)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
