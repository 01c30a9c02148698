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

HTML (default) is one file with inline SVG: no scripts, no external assets, opens offline.
PNG needs matplotlib (``pip install matplotlib``). A missing, empty or unreadable
``metrics.jsonl`` is an error that names the file.

Example::

    flashwatch report runs/demo-20261130-101500            # -> runs/demo-.../report.html
    flashwatch report runs/demo-20261130-101500 --out run.png

Modules: ``load`` (the run folder into columns), ``charts`` (what each chart shows, prepared
once), ``svg`` and ``png`` (the two renderers), ``page`` (the HTML page), ``command`` (``render``
and the command).
"""

from .charts import HEATMAPS, MAX_COLUMNS, Heatmap, nice_ticks
from .command import main, render
from .load import RunData, UnreadableRun, load_run
from .page import to_html
from .png import MissingMatplotlib, to_png
from .svg import heatmap_svg, loss_svg

__all__ = ["RunData", "load_run", "render", "to_html", "to_png", "main", "HEATMAPS", "Heatmap", "MAX_COLUMNS",
           "MissingMatplotlib", "UnreadableRun", "loss_svg", "heatmap_svg", "nice_ticks"]
