"""The exporter interface: a do-nothing base, what it receives, and a fan-out that isolates failures.

The Monitor hands every monitored step to its exporters as a :class:`StepRecord`. An exporter
implements any of three methods, each a no-op in :class:`Exporter`:

- ``open(layout)``: once, after the Monitor attached to a model; ``layout`` says how many layers
  and heads there are. Errors here are configuration errors (a port in use, a run folder that
  cannot be written) and are raised, so that a run fails at its start, not hours later.
- ``export(record)``: once per monitored step, on the training thread. Keep it cheap.
- ``close()``: once, at the end of the run (also after an exception). Must release servers and
  files; safe to call twice.

:class:`FanOut` is how the Monitor talks to several exporters: it forwards each call to every
exporter, and a failure in ``export`` or ``close`` of one exporter is logged (once per exporter)
and counted, while the other exporters and the training run go on. Monitoring never stops
training because a dashboard is down.

Example::

    class PrintLoss(Exporter):
        def export(self, record):
            print(record.step, record.snapshot["flashwatch_loss"])

    fan = FanOut([PrintLoss(), JsonlExporter("runs/a")])
    fan.open(Layout(layers=[("blocks.0.attn", 4), ("blocks.1.attn", 4)]))
    fan.export(StepRecord(step=0, time=time.time(), snapshot=monitor.snapshot(),
                          new_alerts=[], active_alerts=[]))
    fan.close()
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

log = logging.getLogger("flashwatch.exporters")


@dataclass
class Layout:
    """The shape of the monitored model, given to ``Exporter.open``.

    Args:
        layers: one ``(module name, number of heads)`` per attention layer; the list index is
            the ``layer`` label of every per-head metric.
        config: the Monitor's ``MonitorConfig`` as plain data (``to_dict()``), or None: the
            thresholds a record of the run is read against (``flashwatch report``).
    """

    layers: list[tuple[str, int]] = field(default_factory=list)
    config: dict | None = None

    def __post_init__(self) -> None:
        checked = []
        for i, entry in enumerate(self.layers):
            try:
                name, heads = entry
            except (TypeError, ValueError):
                raise ValueError(
                    f"Layout.layers[{i}] must be a (module name, num heads) pair, got {entry!r}"
                ) from None
            if not isinstance(heads, int) or isinstance(heads, bool) or heads < 1:
                raise ValueError(
                    f"Layout.layers[{i}] ({name!r}): num heads must be a positive int, got {heads!r}"
                )
            checked.append((str(name), heads))
        self.layers = checked

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def num_heads(self) -> int:
        """Heads over all layers (the number of series of each per-head metric)."""
        return sum(h for _, h in self.layers)

    def heads(self, layer: int) -> int:
        return self.layers[layer][1]


@dataclass
class StepRecord:
    """One monitored step, as the Monitor gives it to ``Exporter.export``.

    Args:
        step: the optimizer step (counted from 0).
        time: unix seconds when the step was recorded.
        snapshot: ``Monitor.snapshot()`` at this step: metric name (``flashwatch.metrics``) ->
            a float, or for a labelled metric a dict keyed by the tuple of its label values.
        new_alerts: alerts raised at this step (``flashwatch.detectors.Alert``).
        active_alerts: alerts holding at this step, the new ones included.
    """

    step: int
    time: float
    snapshot: dict
    new_alerts: list = field(default_factory=list)
    active_alerts: list = field(default_factory=list)


class Exporter:
    """Base class of every exporter: each method does nothing until a subclass overrides it."""

    #: a short name for logs and error counts; subclasses set their own.
    name: str = "exporter"

    def open(self, layout: Layout) -> None:
        """Called once after the Monitor attached; raise here if the exporter cannot work."""

    def export(self, record: StepRecord) -> None:
        """Called once per monitored step, on the training thread."""

    def resume(self, record: StepRecord) -> None:
        """Called when the Monitor continues a saved run (``load_state_dict``), with the last
        monitored step it had decided (``time``: when it resumed); that step was exported before
        the run was saved, so nothing is written again. An exporter that serves the latest values
        (Prometheus) serves these until the next monitored step, so that counters continue and
        do not read 0 in between."""

    def close(self) -> None:
        """Called once at the end of the run; release servers and files. Idempotent."""


def alert_to_dict(alert: Any) -> dict:
    """A plain dict of an alert: ``Alert.to_dict()``, a dict as is, or a dataclass's fields."""
    if isinstance(alert, dict):
        return dict(alert)
    to_dict = getattr(alert, "to_dict", None)
    if callable(to_dict):
        return to_dict()
    if dataclasses.is_dataclass(alert):
        return dataclasses.asdict(alert)
    raise TypeError(f"an alert must be a flashwatch Alert, a dataclass or a dict, got {type(alert).__name__}")


class FanOut(Exporter):
    """Forward every call to several exporters; a failing one never stops the others.

    Args:
        exporters: the exporters, called in this order.
        on_error: called as ``on_error(exporter, phase, exception)`` for every failure in
            ``export`` or ``close`` (the Monitor passes one that counts ``monitor.errors``).

    ``open`` raises the first exporter's error (after closing the exporters already opened):
    a port in use or an unwritable folder must stop the run at its start. ``export`` and
    ``close`` log the first failure of each exporter with its traceback, count every failure
    in ``errors`` (and per exporter name in ``failures``), and go on with the others; a failing
    exporter is still called on later steps, since many failures (a Pushgateway restarting, a
    full disk) are transient.
    """

    name = "fanout"

    def __init__(
        self,
        exporters: Iterable[Exporter] = (),
        *,
        on_error: Callable[[Exporter, str, BaseException], None] | None = None,
    ):
        self.exporters: list[Exporter] = []
        self.on_error = on_error
        self.errors = 0
        self._failures: dict[int, int] = {}  # id(exporter) -> failures
        self._layout: Layout | None = None
        self._opened: list[Exporter] = []
        if isinstance(exporters, (str, bytes, os.PathLike)):
            raise TypeError(f"exporters must be a list of exporters, got the path {exporters!r}: to write a run "
                            f"folder, pass exporters=[JsonlExporter({exporters!r})] (flashwatch.exporters)")
        if callable(getattr(exporters, "export", None)):
            raise TypeError(f"exporters must be a list of exporters, e.g. exporters=[{type(exporters).__name__}(...)], "
                            f"got one {type(exporters).__name__}")
        try:
            listed = list(exporters)
        except TypeError:
            raise TypeError(f"exporters must be a list of exporters (flashwatch.exporters: JsonlExporter, "
                            f"PrometheusExporter, ...), got {type(exporters).__name__}") from None
        for e in listed:
            self.add(e)

    def add(self, exporter: Exporter, layout: Layout | None = None) -> None:
        """Add an exporter; if the fan-out is open already, open it now (errors raise)."""
        if isinstance(exporter, type):
            raise TypeError(f"exporters holds the class {exporter.__name__}, not an exporter: pass an instance, "
                            f"e.g. {exporter.__name__}(...)")
        if not all(callable(getattr(exporter, m, None)) for m in ("open", "export", "close")):
            raise TypeError(
                f"an exporter needs open(layout), export(record) and close() methods "
                f"(subclass flashwatch.exporters.Exporter), got {type(exporter).__name__}"
            )
        self.exporters.append(exporter)
        if self._layout is not None:
            exporter.open(layout or self._layout)
            self._opened.append(exporter)

    def open(self, layout: Layout) -> None:
        self._layout = layout
        for e in self.exporters:
            if e in self._opened:
                continue
            try:
                e.open(layout)
            except BaseException:
                # Leave no server or file behind: close what this call opened, then raise.
                for opened in reversed(self._opened):
                    self._call(opened, "close")
                self._opened.clear()
                self._layout = None
                raise
            self._opened.append(e)

    @property
    def opened(self) -> list[Exporter]:
        """The exporters open now, in the order they were opened."""
        return list(self._opened)

    def close_opened_since(self, before: list[Exporter]) -> None:
        """Close the exporters opened since ``before`` (an earlier ``opened``) was taken, newest first:
        undo an ``open()`` whose caller failed after it."""
        for e in reversed([e for e in self._opened if e not in before]):
            self._call(e, "close")
            self._opened.remove(e)
        if not self._opened:
            self._layout = None

    def export(self, record: StepRecord) -> None:
        for e in self.exporters:
            self._call(e, "export", record)

    def resume(self, record: StepRecord) -> None:
        """``Exporter.resume`` of the opened exporters that have it."""
        for e in self._opened:
            if callable(getattr(e, "resume", None)):
                self._call(e, "resume", record)

    def close(self) -> None:
        for e in self.exporters:
            self._call(e, "close")
        self._opened.clear()
        self._layout = None

    def _call(self, exporter: Exporter, phase: str, *args: Any) -> None:
        try:
            getattr(exporter, phase)(*args)
        except Exception as exc:  # KeyboardInterrupt and SystemExit still stop the run
            self.errors += 1
            n = self._failures.get(id(exporter), 0) + 1
            self._failures[id(exporter)] = n
            label = getattr(exporter, "name", type(exporter).__name__)
            if n == 1:
                log.warning(
                    "flashwatch exporter %r failed in %s(); training goes on and the other "
                    "exporters keep working (later failures of this exporter are counted, "
                    "not logged)", label, phase, exc_info=True,
                )
            elif phase == "close":  # said however often it failed before: its output may lack its end
                log.warning("flashwatch exporter %r failed in close() too: %r", label, exc)
            else:
                log.debug("flashwatch exporter %r failed again in %s(): %r", label, phase, exc)
            if self.on_error is not None:
                try:
                    self.on_error(exporter, phase, exc)
                except Exception:  # an error counter must not break the fan-out
                    log.debug("FanOut.on_error failed", exc_info=True)

    @property
    def failures(self) -> dict[str, int]:
        """Failures per exporter name (exporters that never failed are left out)."""
        out: dict[str, int] = {}
        for e in self.exporters:
            n = self._failures.get(id(e), 0)
            if n:
                label = getattr(e, "name", type(e).__name__)
                out[label] = out.get(label, 0) + n
        return out

    def __len__(self) -> int:
        return len(self.exporters)

    def __iter__(self):
        return iter(self.exporters)


__all__: Sequence[str] = ["Exporter", "FanOut", "Layout", "StepRecord", "alert_to_dict"]
