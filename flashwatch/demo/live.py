"""What the demo shows while it trains: flashwatch's ``ConsoleExporter`` with the run's progress,
and the ``flashwatch`` logger's warnings (alerts) on the same console.

On a terminal the exporter's live panel is redrawn at every step, with a progress line on top;
elsewhere (a pipe, a log file, CI) one summary line is printed per tenth of the run.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
import warnings
from typing import Iterator

from rich.console import Console, Group
from rich.text import Text

from ..exporters.base import Exporter
from ..exporters.console import ConsoleExporter

__all__ = ["DemoConsole", "LossHistory", "say", "alert_logging", "quiet_lightning"]

log = logging.getLogger("flashwatch")


def say(console: Console, text: str = "", style: str | None = None) -> None:
    """One line of plain text (no markup); wrapped by rich on a terminal, left whole otherwise."""
    console.print(text, markup=False, highlight=False, style=style, soft_wrap=not console.is_terminal)


class DemoConsole(ConsoleExporter):
    """``ConsoleExporter`` with the demo's progress, and the Prometheus address said at the start.

    Args:
        console: where to draw.
        live: the live panel (a terminal); else plain summary lines, one per tenth of the run.
        steps: optimizer steps of the run (monitored steps are ``0 .. steps - 1``).
        label: prefix of every line (``"INJECTED "`` on a provoked run).
        prometheus: the run's ``PrometheusExporter`` (opened before this one), or None.
        port_note: said after the address (why it is not the one asked for).
    """

    name = "demo console"

    def __init__(self, console: Console, *, live: bool, steps: int, label: str = "", prometheus=None,
                 port_note: str = "") -> None:
        super().__init__("live" if live else "log", console=console, top=5)
        self.steps, self.label, self.prometheus, self.port_note = steps, label, prometheus, port_note
        self.every = max(1, steps // 10)
        self.start = time.monotonic()
        self.url: str | None = None  # /metrics while training (the server stops with the run)

    def open(self, layout) -> None:
        self.start = time.monotonic()
        self.url = self.prometheus.url if self.prometheus is not None else None
        served = f"{self.url} (while it trains{self.port_note})" if self.url else "not served"
        say(self.console, f"  {self.label}Prometheus metrics: {served}")
        super().open(layout)

    def _progress(self, step: int) -> str:
        done = step + 1
        seconds = time.monotonic() - self.start
        rate = done / max(seconds, 1e-9)
        left = (self.steps - done) / rate if rate > 0 else math.inf
        return (f"{self.label}[{100 * done // self.steps:3d}%] {done}/{self.steps} steps, {rate:.1f} steps/s, "
                f"{seconds:.0f} s elapsed, about {left:.0f} s left")

    def render(self, record) -> Group:
        return Group(Text(self._progress(record.step), style="bold"), super().render(record))

    def export(self, record) -> None:
        if self.mode == "live":
            super().export(record)
            return
        done = record.step + 1
        if done % self.every == 0 or done >= self.steps:
            rate = done / max(time.monotonic() - self.start, 1e-9)
            say(self.console, f"{self.label}[{100 * done // self.steps:3d}%] {self.summary_line(record)} "
                              f"({rate:.1f} steps/s)")


class LossHistory(Exporter):
    """Keeps ``(step, loss)`` of every monitored step (for the end summary)."""

    name = "loss history"

    def __init__(self) -> None:
        self.losses: list[tuple[int, float]] = []

    def export(self, record) -> None:
        self.losses.append((int(record.step), float(record.snapshot.get("flashwatch_loss", math.nan))))


@contextlib.contextmanager
def alert_logging(console: Console, *, rich_output: bool, prefix: str) -> Iterator[None]:
    """Show the ``flashwatch`` logger's warnings (alerts, fallbacks) on the demo's console."""
    if rich_output:
        from rich.logging import RichHandler

        handler: logging.Handler = RichHandler(console=console, show_path=False, markup=False,
                                               level=logging.WARNING)
        handler.setFormatter(logging.Formatter(prefix + "%(message)s"))
    else:
        handler = logging.StreamHandler(console.file)
        handler.setLevel(logging.WARNING)
        handler.setFormatter(logging.Formatter("%(levelname)s " + prefix + "%(message)s"))
    log.addHandler(handler)
    try:
        yield
    finally:
        log.removeHandler(handler)


@contextlib.contextmanager
def quiet_lightning() -> Iterator[None]:
    """Lightning's start-up chatter (GPU available..., tips) and known harmless warnings, off."""
    import pytorch_lightning  # noqa: F401  (its import sets its loggers' levels: set ours after it)

    loggers = [logging.getLogger(n) for n in ("pytorch_lightning", "lightning.pytorch", "lightning_fabric")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.WARNING)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*does not have many workers.*")
        warnings.filterwarnings("ignore", message=".*LeafSpec.*is deprecated.*")
        warnings.filterwarnings("ignore", message=".*`IterableDataset` has `__len__` defined.*")
        warnings.filterwarnings("ignore", message=".*Checkpoint directory .* exists and is not empty.*")
        try:
            yield
        finally:
            for lg, level in zip(loggers, levels):
                lg.setLevel(level)
