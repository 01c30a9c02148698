"""Console exporter: a rich live summary on a terminal, plain log lines everywhere else.

On a terminal (``mode="live"``, chosen by ``"auto"``) one panel is redrawn at every monitored
step: the top heads by |drift z| with their repeated-max ratios, max logit and W^Q norm (a head
in red while the Monitor's ``delta_drift`` alert holds for it, or its z is not finite); the
active alerts; and which kernel variant each layer runs. Without a terminal (a batch job, a
log file, CI) each monitored step is one ``INFO`` line of the ``flashwatch`` logger.

Alerts: the Monitor logs each alert once when it starts, on the ``flashwatch`` logger
(``WARNING``, or ``ERROR`` when critical), so they reach whatever logging the program set up;
this exporter shows the active ones in its panel. On a terminal where nothing handles the
``flashwatch`` logger, the exporter attaches a ``rich`` handler to it for the run (removed at
``close()``), so alerts print in colour above the live panel. Driving exporters without a
Monitor, pass ``log_alerts=True`` to have this exporter log new alerts itself.

``mode="print"`` prints the panel instead of redrawing it, at most every ``print_interval_s``
seconds; ``"live"`` falls back to it when another live display (a rich progress bar) already
owns the terminal.

Example::

    Monitor(config, exporters=[ConsoleExporter(top=8)])
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any, Mapping

from rich.console import Console, Group
from rich.errors import LiveError
from rich.live import Live
from rich.logging import RichHandler
from rich.table import Table
from rich.text import Text

from .base import Exporter, Layout, StepRecord, alert_to_dict
from .summary import top_heads, variant_counts

log = logging.getLogger("flashwatch")
alert_log = logging.getLogger("flashwatch.alerts")

MODES = ("auto", "live", "print", "log")


def _f(v: Any, spec: str = ".4g") -> str:
    try:
        return format(float(v), spec)
    except (TypeError, ValueError):
        return "-"


def _alert_text(a: Mapping[str, Any]) -> str:
    where = ""
    if a.get("layer", -1) >= 0:
        where = f" layer {a['layer']}" + (f" head {a['head']}" if a.get("head", -1) >= 0 else "")
    return (f"flashwatch alert {a.get('rule')}{where} at step {a.get('step')}: "
            f"value {_f(a.get('value'))} (threshold {_f(a.get('threshold'))}). {a.get('message', '')}")


class ConsoleExporter(Exporter):
    """Show the monitor's state to a person: a live panel on a terminal, log lines otherwise.

    Args:
        mode: ``"auto"`` (live on a terminal, log lines otherwise), ``"live"``, ``"print"`` or
            ``"log"``.
        top: how many heads the summary lists (by |drift z|).
        console: the rich ``Console`` to draw on (default: a new one on stderr).
        print_interval_s: in ``"print"`` mode, least seconds between two printed panels
            (steps with new alerts always print).
        log_alerts: log each new alert here (on ``flashwatch.alerts``); off by default because
            the Monitor already logs every alert once.

    Raises:
        ValueError: an unknown mode, or ``top``/``print_interval_s`` out of range.
    """

    name = "console"

    def __init__(self, mode: str = "auto", *, top: int = 5, console: Console | None = None,
                 print_interval_s: float = 30.0, log_alerts: bool = False):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        if not isinstance(top, int) or isinstance(top, bool) or top < 1:
            raise ValueError(f"top must be a positive int (heads listed), got {top!r}")
        if not isinstance(print_interval_s, (int, float)) or print_interval_s < 0:
            raise ValueError(f"print_interval_s must be a number >= 0, got {print_interval_s!r}")
        self.console = console if console is not None else Console(stderr=True)
        if mode == "auto":
            mode = "live" if self.console.is_terminal else "log"
        self.mode = mode
        self.top = top
        self.print_interval_s = float(print_interval_s)
        self.log_alerts = bool(log_alerts)
        self.layout: Layout | None = None
        self._live: Live | None = None
        self._handler: RichHandler | None = None
        self._last_print = -float("inf")

    def open(self, layout: Layout) -> None:
        self.layout = layout
        if self.mode != "log" and self._handler is None and not log.hasHandlers():
            # Nothing would show flashwatch's warnings but Python's last-resort stderr handler,
            # which tears the live panel: route them through rich on the same console.
            self._handler = RichHandler(console=self.console, show_path=False, markup=False,
                                        level=logging.WARNING)
            log.addHandler(self._handler)

    def export(self, record: StepRecord) -> None:
        new = [alert_to_dict(a) for a in record.new_alerts]
        for a in new if self.log_alerts else ():
            level = logging.ERROR if a.get("severity") == "critical" else logging.WARNING
            alert_log.log(level, _alert_text(a))
        if self.mode == "log":
            log.info(self.summary_line(record))
            return
        panel = self.render(record)
        if self.mode == "live":
            try:
                if self._live is None:
                    self._live = Live(panel, console=self.console, refresh_per_second=2,
                                      transient=False)
                    self._live.start()
                else:
                    self._live.update(panel)
                return
            except LiveError:
                # A rich progress bar already owns the terminal: print the panel instead.
                self._live = None
                self.mode = "print"
        now = time.monotonic()
        if new or now - self._last_print >= self.print_interval_s:
            self._last_print = now
            self.console.print(panel)

    def close(self) -> None:
        live, handler = self._live, self._handler
        self._live = self._handler = None
        try:
            if live is not None:
                live.stop()
        finally:
            if handler is not None:
                log.removeHandler(handler)

    # -- what is shown --------------------------------------------------------------------

    def summary_line(self, record: StepRecord) -> str:
        """The one-line summary of ``"log"`` mode."""
        s = record.snapshot
        parts = [f"flashwatch step {record.step}: loss {_f(s.get('flashwatch_loss'))}, "
                 f"grad norm {_f(s.get('flashwatch_grad_norm'))}"]
        # NaN ranks last: a NaN at the top means no head was measured (said so, never printed as "nan")
        z = [t for t in top_heads(s, "flashwatch_delta_drift_z", min(self.top, 3), abs) if not math.isnan(t[2])]
        if z:
            parts.append("top |drift z| " + ", ".join(f"L{l}H{h} {_f(v, '+.2f')}" for l, h, v in z))
        elif s.get("flashwatch_delta_drift_z"):
            parts.append("drift z not measured")
        for metric, label in (("flashwatch_repeated_max_ratio", "max repeated-max"),
                              ("flashwatch_repeated_max_ratio_bf16", "bf16"),
                              ("flashwatch_wq_spectral_norm", "max W^Q norm"),
                              ("flashwatch_max_logit", "max logit"),
                              ("flashwatch_wq_error_coherence", "max W^Q-error coherence")):
            top = top_heads(s, metric, 1)
            if top:
                l, h, v = top[0]
                parts.append(f"{label} not measured" if math.isnan(v) else f"{label} {_f(v)} (L{l}H{h})")
        variants = variant_counts(s)
        if variants:
            parts.append("variants " + " ".join(f"{v}x{len(ls)}" for v, ls in sorted(variants.items())))
        partial = _partial_coverage(s)
        if partial:
            parts.append("attention coverage " + ", ".join(f"L{l} {v:.0%}" for l, v in partial))
        parts.append(f"active alerts {len(record.active_alerts)}")
        return "; ".join(parts)

    def render(self, record: StepRecord) -> Group:
        """The rich panel of ``"live"``/``"print"`` mode."""
        s = record.snapshot
        header = Text.assemble(
            ("flashwatch ", "bold"), f"step {record.step}   loss {_f(s.get('flashwatch_loss'))}   "
            f"grad norm {_f(s.get('flashwatch_grad_norm'))}")

        heads = Table(title=f"top {self.top} heads by |drift z|", title_justify="left",
                      expand=False, pad_edge=False)
        for col in ("layer", "head", "drift z", "repeated-max", "bf16 rep-max", "max logit", "W^Q norm",
                    "W^Q-err coh"):
            heads.add_column(col, justify="right")
        # red where the Monitor decided delta_drift: the record carries its decisions, not its thresholds
        drifting = {(a.get("layer"), a.get("head")) for a in map(alert_to_dict, record.active_alerts)
                    if a.get("rule") == "delta_drift"}
        for layer, head, z in top_heads(s, "flashwatch_delta_drift_z", self.top, abs):
            key = (layer, head)
            style = "bold red" if key in drifting or not math.isfinite(z) else None
            heads.add_row(str(layer), str(head), _f(z, "+.2f"),
                          _f(s.get("flashwatch_repeated_max_ratio", {}).get(key), ".2%"),
                          _f(s.get("flashwatch_repeated_max_ratio_bf16", {}).get(key), ".2%"),
                          _f(s.get("flashwatch_max_logit", {}).get(key), ".3g"),
                          _f(s.get("flashwatch_wq_spectral_norm", {}).get(key), ".4g"),
                          _f(s.get("flashwatch_wq_error_coherence", {}).get(key), ".2f"),
                          style=style)

        parts: list[Any] = [header, heads]
        if record.active_alerts:
            alerts = Table(title="active alerts", title_justify="left", pad_edge=False)
            for col in ("rule", "layer", "head", "value", "threshold", "since step"):
                alerts.add_column(col)
            for a in map(alert_to_dict, record.active_alerts):
                alerts.add_row(str(a.get("rule")), str(a.get("layer")), str(a.get("head")),
                               _f(a.get("value")), _f(a.get("threshold")), str(a.get("step")),
                               style="red" if a.get("severity") == "critical" else "yellow")
            parts.append(alerts)
        else:
            parts.append(Text("no active alerts", style="green"))
        partial = _partial_coverage(s)
        if partial:
            parts.append(Text("attention coverage below 100% (calls not measured in full): " + ", ".join(
                f"layer {l} {v:.0%}" for l, v in partial), style="yellow"))
        variants = variant_counts(s)
        if variants:
            parts.append(Text("variants: " + "; ".join(
                f"{v} on layers {_ranges(ls)}" for v, ls in sorted(variants.items()))))
        return Group(*parts)


def _partial_coverage(snapshot: Mapping[str, Any]) -> list[tuple[int, float]]:
    """(layer, coverage) of the layers whose attention calls were not all measured in full."""
    values = snapshot.get("flashwatch_attention_coverage") or {}
    return sorted((key[0], float(v)) for key, v in values.items() if isinstance(v, (int, float)) and v < 1.0)


def _ranges(layers: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``."""
    out, start = [], None
    for i, x in enumerate(layers):
        if start is None:
            start = x
        if i + 1 == len(layers) or layers[i + 1] != x + 1:
            out.append(str(start) if start == x else f"{start}-{x}")
            start = None
    return ", ".join(out)


__all__ = ["ConsoleExporter", "MODES"]
