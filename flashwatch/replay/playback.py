"""Play a recorded run back through the Monitor's detectors, without training.

A run folder (``records``) holds every monitored step's per-head readings. ``build_signals``
rebuilds the ``StepSignals`` the Monitor built from them, with the Monitor's own signal code
(``flashwatch.step_signals.SignalBuilder``); ``replay`` feeds them to the
detectors that ``build_detectors`` makes from a ``MonitorConfig``. A replay with the run's own
configuration reproduces its in-training alerts exactly (``runs.analyze_run`` checks it per
run: ``replay_matches``); a replay with other thresholds shows what they would have done.
``config_for`` makes that configuration: ``MonitorConfig``'s defaults (whatever config.py says
now), the run's own monitor fields, explicit overrides.

Caution: a replay cannot re-run interventions: in an auto_fix run the signals after a switch
are those of the switched kernel.

Example::

    from flashwatch.replay.playback import config_for, load_records, replay
    from flashwatch.replay.records import read_run

    alerts = replay(load_records(run_dir), config_for(read_run(run_dir), {"drift_threshold": 5.0}))
"""

from __future__ import annotations

import math
import os
from typing import Any, Iterable, Sequence

import torch

from ..config import MonitorConfig
from ..detectors import Alert, StepSignals, build_detectors
from ..step_signals import LayerReading, SignalBuilder
from .records import read_run, read_signals, read_steps

__all__ = ["config_for", "config_from_dict", "load_records", "in_training_alerts", "build_signals", "replay"]


def config_for(run: dict | None = None, overrides: dict | None = None) -> MonitorConfig:
    """The detector configuration of a replay: ``MonitorConfig`` defaults, the run's arm fields, overrides.

    The run's own monitor fields (mode, variant, auto_fix, interval) are kept so the replay
    describes the same run; thresholds come from ``MonitorConfig``'s defaults unless overridden.
    """
    fields: dict[str, Any] = {}
    if run is not None:
        fields.update(run.get("arm", {}).get("monitor", {}))
        if "interval" in run.get("recipe", {}):
            fields["interval"] = run["recipe"]["interval"]
        fields.update(run.get("monitor_overrides") or {})
    fields.update(overrides or {})
    return MonitorConfig(**fields)


# A recorded configuration without these fields was recorded before alerts had episodes in time:
# an alert ended at its first clear step and could start again at the next. Replaying it that way
# gives the alerts its Monitor raised.
BEFORE_EPISODES = {"clear_steps": 1, "alert_gap": 0}


def config_from_dict(d: dict) -> MonitorConfig:
    """A ``MonitorConfig`` from ``MonitorConfig.to_dict()`` (sets come back as lists); fields the
    recording's version did not have take its behaviour (``BEFORE_EPISODES``) or the defaults."""
    known = {f for f in MonitorConfig.__dataclass_fields__}
    fields = {k: v for k, v in d.items() if k in known}
    if not any(k in d for k in BEFORE_EPISODES):
        fields.update(BEFORE_EPISODES)
    return MonitorConfig(**fields)


def _record_lag(records: list[dict], loss_at: dict) -> int:
    """0 if each record holds the readings of the step it names; 1 if of the monitored step before.

    Older recordings (docs/EXPERIMENTS.md says which) were written right after ``monitor.step``
    of a monitored step; on CUDA with ``async_transfer`` that step's values are decided only at
    the next ``step()``, so the record named step t holds step t - interval's readings (the
    first one holds none). Records that say ``"aligned": true`` hold their own step's.
    Otherwise the recorded loss is compared with ``steps.csv``: the lag at which more records
    match is the one (the loss is a float32 written exactly).
    """
    if not records or records[0].get("aligned"):
        return 0
    same = sum(1 for r in records if r["step"] in loss_at and r["loss"] == loss_at[r["step"]])
    before = sum(1 for prev, r in zip(records, records[1:])
                 if prev["step"] in loss_at and r["loss"] == loss_at[prev["step"]])
    return 1 if before > same else 0


def load_records(run_dir: str | os.PathLike, steps: dict | None = None) -> list[dict]:
    """A run's monitored-step records, each holding the readings of the step it names.

    Undoes the one-monitored-step lag of recordings made before the worker recorded decided
    steps (``_record_lag``): record k+1's readings are given record k's step and index, and
    record k's ``variant`` and ``low_precision`` (what ran at that step; an auto_fix switch
    decided from step t is recorded from the next monitored step on). The last monitored step of
    such a run (decided when the Monitor closed) was never recorded. ``loss`` and ``grad_norm``
    come from ``steps.csv`` (every step's exact float32 values) where it has the step, else from
    the record. Each record gets ``lag_corrected`` (bool).
    """
    records = list(read_signals(run_dir))
    steps = read_steps(run_dir) if steps is None else steps
    loss_at = dict(zip(steps["step"].tolist(), steps["loss"].tolist()))
    norm_at = dict(zip(steps["step"].tolist(), steps["grad_norm"].tolist()))
    lag = _record_lag(records, loss_at)
    if lag:
        out = []
        for prev, rec in zip(records, records[1:]):
            new = dict(rec)
            new.update(step=prev["step"], index=prev["index"], variant=prev.get("variant"),
                       low_precision=prev["low_precision"], alerts=[],
                       monitor_error=bool(prev.get("monitor_error") or rec.get("monitor_error")))
            out.append(new)
        records = out
    for rec in records:
        rec["lag_corrected"] = bool(lag)
        if rec["step"] in loss_at:
            rec["loss"], rec["grad_norm"] = loss_at[rec["step"]], norm_at[rec["step"]]
    return records


def in_training_alerts(run_dir: str | os.PathLike, records: list[dict] | None = None) -> list[Alert]:
    """The alerts the Monitor raised while the run trained: ``run.json``'s list (complete, each
    dated by the monitored step it was decided from), else those the records carry."""
    run = read_run(run_dir)
    raw = run.get("alerts")
    if raw is None:
        raw = [a for r in (records if records is not None else read_signals(run_dir)) for a in r.get("alerts", ())]
    return [Alert.from_dict({**a, "value": float(a["value"]), "threshold": float(a["threshold"])}) for a in raw]


# recorded per-head keys -> the chain readings they hold (absent in recordings made before the chain)
_CHAIN_KEYS = {"push": "push", "push_true": "push_true", "align": "alignment", "coh": "coherence"}


def _reading(rec: dict, layer: int) -> LayerReading:
    """One layer's raw readings from a recorded line (``records.SignalsWriter``)."""
    f64 = torch.float64
    n = len(rec["e"][layer])

    def heads(key: str) -> torch.Tensor:
        return torch.tensor([math.nan if c is None else float(c) for c in rec[key][layer]], dtype=f64)

    stats = {"rows": torch.full((n,), float(rec["rows"][layer]), dtype=f64),
             "repeated_max_rows": heads("rm"), "repeated_max_rows_bf16": heads("rm16"),
             "max_logit": heads("max_logit"), "delta_error": heads("e")}
    if "rmf" in rec:  # absent in recordings made before the format count
        stats["repeated_max_rows_format"] = heads("rmf")
    chain = {name: heads(key) for key, name in _CHAIN_KEYS.items()} if all(k in rec for k in _CHAIN_KEYS) else None
    variant = (rec.get("variant") or [None] * len(rec["e"]))[layer]
    return LayerReading(stats=stats, sigma=heads("sigma"), chain=chain, low_precision=rec["low_precision"][layer],
                        variant=variant)


def build_signals(records: Iterable[dict], window: int) -> list[StepSignals]:
    """``StepSignals`` per recorded monitored step, built by the Monitor's own builder
    (``flashwatch.step_signals.SignalBuilder``) from the recorded readings.

    Steps where the Monitor failed (``monitor_error``) are left out: its detectors did not run there.
    """
    out: list[StepSignals] = []
    builder: SignalBuilder | None = None
    for rec in records:
        if rec.get("monitor_error"):
            continue
        if builder is None:
            builder = SignalBuilder([len(row) for row in rec["e"]], window)
        readings = [_reading(rec, layer) for layer in range(len(rec["e"]))]
        out.append(builder.build(step=int(rec["step"]), index=int(rec["index"]), loss=float(rec["loss"]),
                                 grad_norm=float(rec["grad_norm"]), readings=readings))
    return out


def replay(records_or_signals, config: MonitorConfig, rules: Sequence[str] | None = None) -> list[Alert]:
    """Every alert the detectors of ``config`` raise on a recording, in order.

    Args:
        records_or_signals: ``read_signals(run_dir)`` records, or ``build_signals`` output built
            with ``config.window``.
        config: the ``MonitorConfig`` whose detectors to run.
        rules: only these rules (default: all).
    """
    items = list(records_or_signals)
    signals = items if not items or isinstance(items[0], StepSignals) else build_signals(items, config.window)
    detectors = [d for d in build_detectors(config) if rules is None or d.rule in rules]
    alerts: list[Alert] = []
    for s in signals:
        for det in detectors:
            alerts.extend(det.update(s))
    return alerts
