"""``render`` (a run folder to a file) and the ``flashwatch report`` command."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from .load import UnreadableRun, load_run
from .page import to_html
from .png import MissingMatplotlib, to_png

__all__ = ["render", "main"]


def render(path: str | os.PathLike, out: str | os.PathLike | None = None) -> Path:
    """Render a run folder (or its ``metrics.jsonl``) to ``out`` (.html or .png; default RUN_DIR/report.html).

    Raises:
        FileNotFoundError: no ``metrics.jsonl`` at ``path``, or no folder for ``out``.
        UnreadableRun: ``metrics.jsonl`` cannot be read or holds no step record.
        MissingMatplotlib: a .png asked for without matplotlib.
        ValueError: ``out`` ends neither in .html/.htm nor .png.
    """
    if out is not None:
        suffix = Path(out).suffix.lower()
        if suffix not in (".html", ".htm", ".png"):
            raise ValueError(f"--out {out}: the format comes from the suffix, .html (default) or .png")
    run = load_run(path)
    out = Path(out) if out is not None else run.path.parent / "report.html"
    if not out.parent.is_dir():
        raise FileNotFoundError(f"--out {out}: no folder {out.parent} to write it in")
    if out.suffix.lower() == ".png":
        return to_png(run, out)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(to_html(run), encoding="utf-8")
    os.replace(tmp, out)
    return out


def main(args) -> int:
    """The ``flashwatch report`` command (arguments ``run_dir`` and ``out`` from ``flashwatch.cli``)."""
    try:
        out = render(args.run_dir, args.out)
    except (OSError, UnreadableRun, MissingMatplotlib, ValueError) as exc:
        print(f"flashwatch report: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0
