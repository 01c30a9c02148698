"""JSONL exporter: one JSON line per monitored step, and a one-line-per-alert log, in the run folder.

Files (in ``run_dir``):

- ``metrics.jsonl`` (:data:`METRICS_FILE`): one record per line, strict JSON (RFC 8259):
  an ``open`` record when monitoring starts (the layout), one ``step`` record per monitored
  step (every metric of ``flashwatch.metrics.METRICS`` and the step's alerts), and a ``close``
  record when the run ends cleanly. Every line is written whole and unbuffered (and
  ``os.fsync``-ed with ``fsync=True``), so a crash loses at most the line being written; a
  failed write (a full disk) is cut back to the last whole line, so no record is ever glued
  to another.
  A resumed run appends to the same file: the resumed process's ``open`` record (one more in
  the file) marks where it began, and steps written after the checkpoint appear again (readers
  keep the last record of each step).
- ``alerts.log`` (:data:`ALERTS_FILE`): one human-readable line per alert raised, e.g.
  ``2026-11-30T05:20:01Z step=120 warning delta_drift layer=3 head=5 value=4.71 threshold=4.5: ...``;
  after a resume from an older checkpoint, the alerts of the steps run again appear again.

Step record (``kind == "step"``; :data:`SCHEMA`, from ``jsonl_schema``, is the JSON Schema of every record)::

    {"kind": "step", "schema": 1, "step": 120, "time": 1764480001.2,
     "metrics": {
        "flashwatch_loss": 3.21,                               # metrics without labels
        "flashwatch_delta_drift_z": [[0.3, -1.2], [2.0, 0.1]],  # per head: [layer][head], null if absent
        "flashwatch_kernel_variant": [{"layer": 0, "variant": "plain", "value": 1}, ...],
        "flashwatch_alerts_total": [{"rule": "delta_drift", "value": 1}, ...],
        "flashwatch_alert_active": [{"rule": "delta_drift", "layer": 1, "head": 0, "value": 1}]},
     "new_alerts": [{"rule": "delta_drift", "step": 120, "layer": 1, "head": 0, "value": 4.3,
                     "threshold": 4.0, "severity": "warning", "message": "..."}],
     "active_alerts": [...]}

Numbers that are not finite are written as the strings ``"NaN"``, ``"Infinity"`` and
``"-Infinity"`` (strict JSON has no such numbers); :func:`read_jsonl` turns them back into floats.

Example::

    exporter = JsonlExporter("runs/exp1")        # Monitor(exporters=[exporter]) opens it
    for record in read_jsonl("runs/exp1/metrics.jsonl"):
        print(record["step"], record["metrics"]["flashwatch_loss"])
"""

from __future__ import annotations

import functools
import itertools
import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping

from .. import __version__
from ..metrics import head_keys, present
from .appendfile import AppendFile
from .base import Exporter, Layout, StepRecord, alert_to_dict
from .jsonl_schema import (_INT_LABELS, _NONFINITE, ALERT_SCHEMA, CLOSE_SCHEMA, OPEN_SCHEMA, SCHEMA, SCHEMA_VERSION,
                           STEP_SCHEMA, validate_record)

log = logging.getLogger("flashwatch.exporters.jsonl")

METRICS_FILE = "metrics.jsonl"
ALERTS_FILE = "alerts.log"

# -- encoding -----------------------------------------------------------------------------

def _num(v: Any) -> Any:
    v = float(v)
    if v == v and v not in (math.inf, -math.inf):
        return v
    return "NaN" if v != v else ("Infinity" if v > 0 else "-Infinity")


def _plain(x: Any) -> Any:
    """Alert fields as strict JSON (floats that are not finite become their strings)."""
    if isinstance(x, float):
        return _num(x)
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if x is None or isinstance(x, (str, int, bool)):
        return x
    if hasattr(x, "item"):  # a 0-d tensor or numpy scalar that slipped through
        return _plain(x.item())
    return str(x)


@functools.lru_cache(maxsize=8)
def _starts(heads: tuple[int, ...]) -> tuple[int, ...]:
    """Where each layer's heads start in ``head_keys(heads)``."""
    return tuple(itertools.accumulate((0,) + heads[:-1]))


def encode_metrics(snapshot: Mapping[str, Any], layout: Layout | None = None) -> dict:
    """The ``metrics`` object of a step record, from a ``Monitor.snapshot()``."""
    heads_per_layer = [h for _, h in layout.layers] if layout is not None else []
    out: dict[str, Any] = {}
    for spec, value in present(snapshot):
        if not spec.labels:
            out[spec.name] = _num(value)
        elif spec.per_head:
            shape = list(heads_per_layer)
            keys = head_keys(tuple(shape))
            if len(value) == len(keys) and tuple(value) == keys:  # the usual case: the layout's heads in order
                # finite floats as they are (x - x == 0 holds for them only), the others by _num
                flat = [x if x - x == 0.0 else _num(x) for x in map(float, value.values())]
                out[spec.name] = [flat[start: start + n] for start, n in zip(_starts(tuple(shape)), shape)]
                continue
            for layer, head in value:
                while len(shape) <= layer:
                    shape.append(0)
                shape[layer] = max(shape[layer], head + 1)
            grid: list[list[Any]] = [[None] * n for n in shape]
            for (layer, head), v in value.items():
                grid[layer][head] = _num(v)
            out[spec.name] = grid
        else:
            rows = []
            for key, v in value.items():
                row = {lab: (int(k) if lab in _INT_LABELS else str(k)) for lab, k in zip(spec.labels, key)}
                row["value"] = _num(v)
                rows.append(row)
            out[spec.name] = rows
    return out


def _dumps(record: dict) -> str:
    # allow_nan=False: a non-finite number that escaped _num is a bug, not a silent NaN token.
    return json.dumps(record, allow_nan=False, separators=(",", ":"))


# -- reading ------------------------------------------------------------------------------

def _decode_num(v: Any) -> Any:
    return _NONFINITE.get(v, v) if isinstance(v, str) else v


def _decode(record: dict) -> dict:
    metrics = record.get("metrics")
    if isinstance(metrics, dict):
        for name, value in metrics.items():
            if isinstance(value, list):
                for row in value:
                    if isinstance(row, list):
                        row[:] = [_decode_num(v) for v in row]
                    elif isinstance(row, dict) and "value" in row:
                        row["value"] = _decode_num(row["value"])
            else:
                metrics[name] = _decode_num(value)
    for key in ("new_alerts", "active_alerts"):
        for alert in record.get(key, ()) or ():
            if isinstance(alert, dict):
                for f in ("value", "threshold"):
                    if f in alert:
                        alert[f] = _decode_num(alert[f])
    return record


def read_jsonl(path: str | os.PathLike, *, kinds: Iterable[str] | None = ("step",),
               strict: bool = False) -> Iterator[dict]:
    """Yield the records of a ``metrics.jsonl`` file (or of the one in a run folder).

    Args:
        path: the file, or the run folder that holds ``metrics.jsonl``.
        kinds: record kinds to yield (``"open"``, ``"step"``, ``"close"``); ``None`` for all.
            By default only ``step`` records.
        strict: raise on a line in the middle of the file that is not a JSON record (by
            default it is skipped with a warning; the exporter moves a line a crash cut off
            aside before it writes on, so only a file damaged otherwise has one). A truncated last
            line is always skipped: it is the line a crash interrupted.

    Non-finite numbers come back as floats (``nan``, ``inf``). Steps written twice (a resumed
    run repeats the steps after its checkpoint) are yielded as written; keep the last one.

    Raises:
        FileNotFoundError: no such file (or no ``metrics.jsonl`` in the folder).
        ValueError: with ``strict=True``, a damaged line before the last one.
    """
    p = Path(path)
    if p.is_dir():
        p = p / METRICS_FILE
    wanted = None if kinds is None else set(kinds)
    with open(p, "rb") as f:  # a line at a time: a long run's file is never held whole
        for i, raw in enumerate(f):
            record = _parse_line(p, i, raw, strict)
            if record is not None and (wanted is None or record.get("kind") in wanted):
                yield _decode(record)


def _parse_line(p: Path, i: int, raw: bytes, strict: bool) -> dict | None:
    """Line ``i`` (from 0) of ``p`` as a record; None for a blank line, the cut last line (the only
    one without its newline) or, unless ``strict``, a damaged line (logged)."""
    if not raw.strip():
        return None
    try:
        record = json.loads(raw)
        if not isinstance(record, dict):
            raise ValueError("not a JSON object")
    except ValueError as exc:
        if not raw.endswith(b"\n"):
            log.warning("%s: the last line is cut (%d bytes) and is left out: the run stopped while writing "
                        "it, or is writing it now", p, len(raw))
            return None
        size = len(raw) - 1  # without its newline
        msg = f"{p}:{i + 1}: not a flashwatch JSONL record ({exc}); the line is {size} bytes"
        if strict:
            raise ValueError(msg) from None
        log.warning("%s; skipped (a crashed run resumed after it?)", msg)
        return None
    return record


def _is_record(line: bytes) -> bool:
    """Whether ``line`` is one whole JSON object (a record, even without its newline)."""
    try:
        return isinstance(json.loads(line), dict)
    except ValueError:
        return False


# -- exporter -----------------------------------------------------------------------------

class JsonlExporter(Exporter):
    """Write every monitored step to ``run_dir/metrics.jsonl`` and every alert to ``run_dir/alerts.log``.

    Args:
        run_dir: the run folder (created if missing). Existing files are appended to, so a
            resumed run keeps what the first part wrote.
        fsync: also ``os.fsync`` each line (survives a machine crash, not only a process
            crash; costs a disk round trip per monitored step).
        metrics_file: file name of the step records inside ``run_dir``.
        alerts_file: file name of the alert log inside ``run_dir``; ``None`` writes none.

    What is never lost or glued together:

    - A write that fails (a full disk) raises ``OSError`` naming the file, after cutting the
      file back to its last whole record: the file never holds half a record. The Monitor
      counts the failure (``monitor.errors``), logs the first one at WARNING and goes on;
      this exporter counts its own in ``errors``. Later steps are written once the disk has room.
    - A line a crash cut off is moved to ``metrics.jsonl.cut`` when the file is opened again (a
      resumed run), so the file goes on with whole records; a last line without its newline that
      is a whole record (or any line of the alert log) is kept and ended with one.
    - A run folder deleted (or moved) while the run writes is noticed at the next monitored
      step: the folder and files are created again, a new ``open`` record starts them, a
      WARNING names the path (``recreated`` counts these), and writing goes on there. Where
      they cannot be created then (a full disk), every later step tries again.

    Raises:
        ValueError: a bad argument (named in the message).
        OSError: at ``open()``, when the folder or files cannot be created or written.
    """

    name = "jsonl"

    def __init__(self, run_dir: str | os.PathLike, *, fsync: bool = False,
                 metrics_file: str = METRICS_FILE, alerts_file: str | None = ALERTS_FILE):
        if not isinstance(run_dir, (str, os.PathLike)) or not str(run_dir):
            raise ValueError(f"run_dir must be a folder path, got {run_dir!r}")
        for arg, value in (("metrics_file", metrics_file), ("alerts_file", alerts_file)):
            if value is None and arg == "alerts_file":
                continue
            if not isinstance(value, str) or not value or os.sep in value:
                raise ValueError(f"{arg} must be a plain file name (no folder), got {value!r}")
        if not isinstance(fsync, bool):
            raise ValueError(f"fsync must be True or False, got {fsync!r}")
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / metrics_file
        self.alerts_path = None if alerts_file is None else self.run_dir / alerts_file
        self.fsync = fsync
        self.layout: Layout | None = None
        self.errors = 0  # writes, and re-creations of vanished files, that failed (each raised to the caller)
        self.recreated = 0  # times the run folder or a file vanished and was created again
        self._f: AppendFile | None = None
        self._alerts_f: AppendFile | None = None
        self._open = False  # between open() and close(); the files may be missing meanwhile (_check_files)

    def holds_run(self) -> bool:
        """True when ``run_dir`` already has a non-empty metrics file (a run wrote there)."""
        try:
            return self.path.stat().st_size > 0
        except OSError:
            return False

    def open(self, layout: Layout) -> None:
        if self._open:
            return
        self.layout = layout
        self._open_files()
        self._open = True
        self._write(self._f, self._open_record())

    def _open_record(self) -> dict:
        record = {"kind": "open", "schema": SCHEMA_VERSION, "time": time.time(), "flashwatch_version": __version__,
                  "layout": [{"name": n, "heads": h} for n, h in self.layout.layers]}
        if self.layout.config is not None:  # the thresholds the run was decided by (flashwatch report)
            record["monitor_config"] = _plain(self.layout.config)
        return record

    def _open_files(self) -> None:
        f = af = None
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            f = AppendFile(self.path, self.fsync, complete=_is_record)
            if self.alerts_path is not None:
                af = AppendFile(self.alerts_path, self.fsync)
        except OSError as exc:
            for handle in (f, af):
                if handle is not None:
                    handle.close()
            raise OSError(exc.errno, f"flashwatch cannot write its run files in {self.run_dir}: "
                                     f"{exc.strerror or exc}. Pass a writable run_dir") from exc
        self._f, self._alerts_f = f, af

    def _check_files(self) -> None:
        """Create the run folder and files again if they vanished (deleted while the run writes);
        where that failed before (a full disk, say), try again: each step until it works."""
        if self._f is not None:
            if not (self._f.vanished() or (self._alerts_f is not None and self._alerts_f.vanished())):
                return
            self.recreated += 1
            log.warning("flashwatch: %s vanished while the run was writing to it (run folder deleted or "
                        "moved?); creating it again and writing on there (the records written before are "
                        "wherever the old file went)", self.path)
            for handle in (self._f, self._alerts_f):
                if handle is not None:
                    handle.close()
            self._f = self._alerts_f = None
        try:
            self._open_files()
        except OSError:
            self.errors += 1
            raise
        self._write(self._f, self._open_record())

    def export(self, record: StepRecord) -> None:
        if not self._open:
            raise RuntimeError("JsonlExporter.export() before open(): the Monitor opens its "
                               "exporters at attach; call open(layout) first when used alone")
        self._check_files()
        self._write(self._f, {
            "kind": "step", "schema": SCHEMA_VERSION, "step": int(record.step),
            "time": float(record.time),
            "metrics": encode_metrics(record.snapshot, self.layout),
            "new_alerts": [_plain(alert_to_dict(a)) for a in record.new_alerts],
            "active_alerts": [_plain(alert_to_dict(a)) for a in record.active_alerts],
        })
        if self._alerts_f is not None and record.new_alerts:
            stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(record.time))
            lines = "".join(f"{stamp} {format_alert(alert_to_dict(a))}\n" for a in record.new_alerts)
            self._append(self._alerts_f, lines.encode())

    def close(self) -> None:
        if not self._open:
            return
        try:
            self._check_files()
            self._write(self._f, {"kind": "close", "schema": SCHEMA_VERSION, "time": time.time()})
        finally:
            f, af = self._f, self._alerts_f
            self._f = self._alerts_f = None
            self._open = False
            for handle in (f, af):
                if handle is not None:
                    handle.close()

    def _write(self, f: AppendFile, record: dict) -> None:
        self._append(f, (_dumps(record) + "\n").encode())

    def _append(self, f: AppendFile, data: bytes) -> None:
        try:
            f.write(data)  # one write per line: a crash cuts at most this line
        except OSError:
            self.errors += 1
            raise


def format_alert(alert: Mapping[str, Any]) -> str:
    """One line for the alert log: ``step=.. severity rule layer=.. head=.. value=.. threshold=..: message``."""
    return (f"step={alert.get('step')} {alert.get('severity')} {alert.get('rule')} "
            f"layer={alert.get('layer')} head={alert.get('head')} "
            f"value={_fmt(alert.get('value'))} threshold={_fmt(alert.get('threshold'))}: "
            f"{alert.get('message', '')}")


def _fmt(v: Any) -> str:
    try:
        return f"{float(v):.4g}"
    except (TypeError, ValueError):
        return str(v)


__all__ = ["JsonlExporter", "read_jsonl", "validate_record", "encode_metrics", "format_alert",
           "SCHEMA", "STEP_SCHEMA", "OPEN_SCHEMA", "CLOSE_SCHEMA", "ALERT_SCHEMA", "SCHEMA_VERSION",
           "METRICS_FILE", "ALERTS_FILE"]
