"""A run folder's ``metrics.jsonl`` (and ``demo.json``) read into columns for the charts."""

from __future__ import annotations

import json
import logging
import math
import os
from array import array
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config import MonitorConfig
from ..exporters.jsonl import METRICS_FILE, read_jsonl
from ..vocabulary import INJECTED

log = logging.getLogger("flashwatch")

__all__ = ["RunData", "UnreadableRun", "load_run", "PER_HEAD_METRICS", "num"]

# the per-head metrics the report draws (one heatmap each), read from every step record
PER_HEAD_METRICS = ("flashwatch_delta_drift_z", "flashwatch_repeated_max_ratio_bf16",
                    "flashwatch_wq_spectral_norm", "flashwatch_max_logit", "flashwatch_wq_error_coherence",
                    "flashwatch_wq_error_push_cumulative")
_DEFAULTS = MonitorConfig()


class UnreadableRun(ValueError):
    """A ``metrics.jsonl`` that cannot be read, or holds no step record; the message names the file."""


@dataclass
class RunData:
    """A run's step records, as columns. Per-head series are ``[row][column]`` with rows ``row_labels``."""

    path: Path
    steps: list[int]
    loss: list[float]
    grad_norm: list[float]
    rows: list[tuple[int, int]]  # (layer, head) of each row
    layer_names: list[str]
    series: dict[str, list[array]]  # metric -> rows x steps (one array of doubles a row)
    alerts: list[dict]  # every new alert, in step order
    switches: list[tuple[int, int, str, str]]  # (step, layer, from, to) kernel-variant changes
    meta: dict = field(default_factory=dict)  # demo.json, when present; monitor_config also from metrics.jsonl
    coverage: dict[int, list[float]] = field(default_factory=dict)  # layer -> attention coverage per step

    @property
    def row_labels(self) -> list[str]:
        return [f"L{l}.H{h}" for l, h in self.rows]

    @property
    def injected(self) -> bool:
        if self.meta.get("injected"):
            return True
        return any(f"[{INJECTED}]" in str(a.get("message", "")) for a in self.alerts)

    @property
    def thresholds_recorded(self) -> bool:
        """Whether the run recorded its MonitorConfig (else the thresholds shown are the defaults)."""
        return isinstance(self.meta.get("monitor_config"), dict)

    @property
    def drift_threshold(self) -> float:  # the run's own, else MonitorConfig's default
        return float((self.meta.get("monitor_config") or {}).get("drift_threshold", _DEFAULTS.drift_threshold))

    @property
    def max_logit_bound(self) -> float:
        return float((self.meta.get("monitor_config") or {}).get("max_logit_bound", _DEFAULTS.max_logit_bound))


def num(v: Any) -> float:
    """``v`` as a float; NaN when it is missing or not a number."""
    if v is None:
        return math.nan
    try:
        return float(v)
    except (TypeError, ValueError):
        return math.nan


def _metrics_path(path: str | os.PathLike) -> Path:
    p = Path(path)
    if p.is_dir():
        p = p / METRICS_FILE
    if p.is_dir():
        raise UnreadableRun(f"cannot read {p}: it is a folder, not a {METRICS_FILE} file (pass a run folder written "
                            f"by flashwatch or the {METRICS_FILE} file itself)")
    if not p.exists():
        raise FileNotFoundError(
            f"no {METRICS_FILE} at {path}: pass a run folder written by flashwatch (FlashWatchCallback's run_dir, "
            f"flashwatch demo's runs/demo-*/, a JsonlExporter folder) or the {METRICS_FILE} file itself")
    return p


@dataclass
class _Step:
    """What the report keeps of one step record: numbers in arrays of doubles, not JSON's objects (a
    record of 1,024 heads is about 350 KB of text; a long run holds thousands)."""

    step: int
    loss: float
    grad_norm: float
    grids: dict[str, list[array]]  # per-head metric -> one array a layer (NaN where not a number)
    coverage: list[tuple[int, float]]  # (layer, attention coverage)
    variants: list[tuple[int, str]]  # (layer, the kernel variant in effect)
    new_alerts: list[dict]

    @classmethod
    def of(cls, rec: dict) -> "_Step":
        metrics = rec["metrics"]
        grids = {name: [array("d", (num(v) for v in row)) if isinstance(row, list) else array("d")
                        for row in _list(metrics.get(name))] for name in PER_HEAD_METRICS}
        coverage = [(int(row["layer"]), num(row.get("value"))) for row in
                    _list(metrics.get("flashwatch_attention_coverage")) if isinstance(row, dict) and "layer" in row]
        variants = [(int(row.get("layer", -1)), str(row.get("variant")))
                    for row in _list(metrics.get("flashwatch_kernel_variant"))
                    if isinstance(row, dict) and num(row.get("value")) == 1.0]
        return cls(step=int(rec["step"]), loss=num(metrics.get("flashwatch_loss")),
                   grad_norm=num(metrics.get("flashwatch_grad_norm")), grids=grids, coverage=coverage,
                   variants=variants, new_alerts=[a for a in _list(rec.get("new_alerts")) if isinstance(a, dict)])


def _list(v: Any) -> list:
    """``v`` if it is a list, else empty (a field missing or of another shape reads as not measured)."""
    return v if isinstance(v, list) else []


def _step_records(p: Path) -> tuple[list[tuple[str, int]], list[_Step], dict | None]:
    """The layout and MonitorConfig (None if not recorded) of the last ``open`` record, and the step
    records, one per step (the last one written). A file that holds several runs (a new run started
    from step 0 after an earlier one's steps, e.g. a script run twice into one folder) gives the last
    run's steps only, with a warning; a resumed run (its first step after the earlier part's first)
    continues the earlier part."""
    layout: list[tuple[str, int]] = []
    config: dict | None = None
    by_step: dict[int, _Step] = {}
    segment_start = False  # an open record was read, and no step after it yet
    runs = 1
    try:
        for rec in read_jsonl(p, kinds=None):
            kind = rec.get("kind")
            if kind == "open":
                layout = [(str(x.get("name")), int(x.get("heads", 0))) for x in rec.get("layout", [])]
                config = rec.get("monitor_config") if isinstance(rec.get("monitor_config"), dict) else None
                segment_start = True
            elif kind == "step" and isinstance(rec.get("metrics"), dict):
                step = _Step.of(rec)
                if segment_start:
                    segment_start = False
                    if by_step and step.step <= min(by_step):
                        by_step, runs = {}, runs + 1  # a new run from its start: the earlier one is not this run
                by_step[step.step] = step
    except OSError as exc:
        raise UnreadableRun(f"cannot read {p}: {exc.strerror or exc}") from None
    except (TypeError, ValueError, KeyError, AttributeError) as exc:
        raise UnreadableRun(f"{p} is not a flashwatch metrics.jsonl (a record of an unexpected shape: "
                            f"{type(exc).__name__}: {exc})") from None
    if not by_step:
        what = "is empty" if p.stat().st_size == 0 else "holds no step record"
        raise UnreadableRun(f"{p} {what}: nothing to draw. The report needs the step records a flashwatch run "
                            f"writes (JsonlExporter, FlashWatchCallback's run_dir) once its first monitored step "
                            f"is done")
    if runs > 1:
        log.warning("flashwatch report: %s holds %d runs, each started from step %d; drawing the last one (give each "
                    "run its own folder)", p, runs, min(by_step))
    return layout, [by_step[s] for s in sorted(by_step)], config


def load_run(path: str | os.PathLike) -> RunData:
    """Read a run folder (or its ``metrics.jsonl``) into columns.

    Steps written twice (a resumed run repeats the steps after its checkpoint) keep their last
    record. Heads missing at a step (a layer not measured) are NaN.

    Raises:
        FileNotFoundError: no ``metrics.jsonl`` there.
        UnreadableRun: the file cannot be read, or holds no step record (empty, or not
            flashwatch JSONL).
    """
    p = _metrics_path(path)
    layout, records, config = _step_records(p)

    heads_per_layer = [h for _, h in layout]
    for rec in records:  # a layout is in every open record; fall back on the grids' own shape
        for layer, row in enumerate(rec.grids["flashwatch_delta_drift_z"]):
            while len(heads_per_layer) <= layer:
                heads_per_layer.append(0)
            heads_per_layer[layer] = max(heads_per_layer[layer], len(row))
    rows = [(layer, head) for layer, n in enumerate(heads_per_layer) for head in range(n)]
    names = [n for n, _ in layout] + [f"layer {i}" for i in range(len(layout), len(heads_per_layer))]

    series: dict[str, list[array]] = {}
    for metric in PER_HEAD_METRICS:
        series[metric] = [array("d") for _ in rows]
        for rec in records:
            grid = rec.grids.pop(metric)  # the step's copy goes as the column takes it: one copy held at a time
            for r, (layer, head) in enumerate(rows):
                series[metric][r].append(grid[layer][head] if layer < len(grid) and head < len(grid[layer])
                                         else math.nan)

    coverage: dict[int, list[float]] = {}
    for i, rec in enumerate(records):  # records written before coverage was counted have none: NaN
        for layer, value in rec.coverage:
            coverage.setdefault(layer, [math.nan] * len(records))[i] = value

    alerts, switches, last_variant = [], [], {}
    for rec in records:
        alerts.extend(rec.new_alerts)
        for layer, variant in rec.variants:
            before = last_variant.get(layer)
            if before is not None and before != variant:
                switches.append((rec.step, layer, before, variant))
            last_variant[layer] = variant

    meta: dict = {}
    demo_json = p.parent / "demo.json"
    if demo_json.exists():
        try:
            meta = json.loads(demo_json.read_text())
        except (OSError, ValueError):
            meta = {}
        if not isinstance(meta, dict):
            meta = {}
    if config is not None and "monitor_config" not in meta:  # the run's own thresholds, as it recorded them
        meta = {**meta, "monitor_config": config}
    return RunData(path=p, steps=[r.step for r in records], loss=[r.loss for r in records],
                   grad_norm=[r.grad_norm for r in records],
                   rows=rows, layer_names=names, series=series, alerts=alerts, switches=switches, meta=meta,
                   coverage=coverage)
