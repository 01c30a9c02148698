"""Calibration of the detectors' thresholds on recorded runs: margins and sweeps.

``calibrate(run_dirs)`` is the evidence behind ``MonitorConfig``'s defaults (docs/CALIBRATION.md
says which numbers came from it): how far the healthy runs' largest statistic stays below the failing runs'
(``extremes``), and what each threshold over a grid would have done, replayed on every run
(``sweeps``), with the baselines at other thresholds beside them (``baseline_sweeps``).
``flashwatch experiment analyze RUNS --calibrate PATH`` writes it as JSON and prints it
(``tables.format_calibration``).
"""

from __future__ import annotations

import math
import os
from typing import Sequence

from ..config import MonitorConfig
from . import baselines
from .blowup import blowup_step
from .playback import build_signals, config_for, load_records, replay
from .records import read_run, read_steps
from .runs import MECHANISM_RULES, _extremes, _first, _healthy_reference, _median

__all__ = ["SWEEPS", "BASELINE_SWEEPS", "calibrate"]

# (label, MonitorConfig field, values, rules replayed)
SWEEPS = (
    ("drift_threshold", "drift_threshold", (3.5, 4.0, 4.5, 5.0, 5.5, 6.0), ("delta_drift",)),
    ("drift_window_threshold", "drift_window_threshold", (3.5, 4.0, 4.5, 5.0), ("delta_drift",)),
    ("repeated_max_factor", "repeated_max_factor", (2.0, 3.0, 4.0, 6.0), ("repeated_max_rise",)),
    ("repeated_max_margin", "repeated_max_margin", (0.1, 0.15, 0.2, 0.25, 0.3, 0.4), ("repeated_max_rise",)),
    # wq_growth is judged once its comparison point (t - window) lies after warm-up
    ("wq_growth_factor", "wq_growth_factor", (2.0, 2.5, 3.0, 4.0), ("wq_growth",)),
    ("wq_outlier_ratio", "wq_outlier_ratio", (2.0, 3.0, 4.0), ("wq_outlier",)),
    ("max_logit_bound", "max_logit_bound", (100.0, 300.0, 500.0, 1000.0, 3000.0), ("max_logit",)),
    ("warmup", "warmup", (10, 20, 50), MECHANISM_RULES),
)

# the baselines at other thresholds: (label, baselines function, keyword, values)
BASELINE_SWEEPS = (
    ("loss_spike rtol", "loss_spike", "rtol", (2.0, 1.0, 0.5, 0.25)),
    ("zclip z_thresh", "zclip", "z_thresh", (2.5, 4.0, 6.0, 10.0, 20.0)),
    ("qk_clip tau", "qk_clip", "tau", (100.0, 300.0, 1000.0, 3000.0)),
)


def _sweep_tally(outcomes) -> dict:
    """One calibration row: ``outcomes`` yields (run label, blow-up step or None, healthy
    reference?, steps at which the rule fired); counts alerts before blow-up, lead times and
    false alarms on healthy references."""
    n_blown = n_before = n_healthy = n_fa = 0
    leads, firsts = [], {}
    for label, blow, healthy_ref, fired in outcomes:
        firsts[label] = _first(fired)
        first = _first(f for f in fired if blow is None or f < blow)
        if blow is not None:
            n_blown += 1
            if first is not None:
                n_before += 1
                leads.append(blow - first)
        elif healthy_ref:
            n_healthy += 1
            n_fa += bool(fired)
    return {"blown_up_alerted_before": n_before, "blown_up": n_blown, "median_lead": _median(leads),
            "min_lead": min(leads) if leads else None, "healthy_with_alert": n_fa, "healthy": n_healthy,
            "first": firsts}


def _baseline_fires(name: str, key: str, value: float, steps: dict, monitored: list, max_logits: list) -> list[int]:
    if name == "loss_spike":
        return baselines.loss_spike(steps["step"].tolist(), steps["loss"].tolist(), **{key: value})
    if name == "zclip":
        return baselines.zclip(steps["step"].tolist(), steps["grad_norm"].tolist(), **{key: value})
    return baselines.qk_clip(monitored, max_logits, **{key: value})


def calibrate(run_dirs: Sequence[str | os.PathLike], summaries: dict[str, dict] | None = None,
              sweeps: Sequence[tuple] | None = None) -> dict:
    """Evidence for the default thresholds, from recorded runs (not only the summaries).

    Three parts:

    - ``extremes``: per rule statistic, the largest value reached on healthy reference runs
      (arms meant to stay healthy, no blow-up, no auto-fix switch) against the smallest over blown-up runs of their
      largest value before the blow-up. A threshold between the two separates them on these
      runs; ``margin`` = failing / healthy says by how much (> 1: separable).
    - ``sweeps``: one field of ``MonitorConfig`` at a time over a grid (the others at their
      defaults), replayed on every run: blown-up runs alerted before blow-up, median and
      smallest lead, healthy reference runs with an alert. Only the rules the sweep names are
      replayed. ``sweeps``: (label, field, values, rules) tuples (default ``SWEEPS``).
    - ``baseline_sweeps``: the same for the baselines at other thresholds (``BASELINE_SWEEPS``),
      so that flashwatch can also be compared with a baseline made as quiet on the healthy runs
      as flashwatch's defaults are.

    Each sweep row also names, per run, the first alert (``first``: run label -> step or None).
    """
    sweeps = SWEEPS if sweeps is None else sweeps
    loaded, steps_of, labels = [], [], []
    for d in run_dirs:
        run = read_run(d)
        if run.get("status") == "error":
            continue
        s = read_steps(d)
        blow = blowup_step(s["step"].tolist(), s["loss"].tolist())
        records = load_records(d, s)
        healthy_ref = _healthy_reference({"expect": run.get("arm", {}).get("expect"), "blowup_step": blow,
                                          "switches": run.get("switches")})
        loaded.append((run, blow, records, healthy_ref))
        steps_of.append(s)
        labels.append(f"{run['scenario']}/{run['arm']['name']}/{run['seed']}")
    base = MonitorConfig()
    healthy, failing = {}, {}
    cache: dict[tuple, list] = {}

    def signals_of(i: int, window: int):
        key = (i, window)
        if key not in cache:
            cache[key] = build_signals(loaded[i][2], window)
        return cache[key]

    for i, (run, blow, records, healthy_ref) in enumerate(loaded):
        ext = _extremes(signals_of(i, config_for(run).window), config_for(run), blow)
        label = f"{run['scenario']}/{run['arm']['name']}/{run['seed']}"
        if healthy_ref:
            for k, v in ext.items():
                if k not in healthy or v["max"] > healthy[k]["max"]:
                    healthy[k] = {"max": v["max"], "run": label, "step": v["step"]}
        elif blow is not None:
            for k, v in ext.items():
                if k not in failing or v["max"] < failing[k]["min_of_max"]:
                    failing[k] = {"min_of_max": v["max"], "run": label}
    extremes = {}
    for k in sorted(set(healthy) | set(failing)):
        h, f = healthy.get(k), failing.get(k)
        margin = (f["min_of_max"] / h["max"]) if h and f and h["max"] > 0 else None
        extremes[k] = {"healthy_max": h, "failing_min_of_max_before_blowup": f, "margin": margin}

    def detector_outcomes(field_name, value, rules):
        for i, (run, blow, records, healthy_ref) in enumerate(loaded):
            try:
                cfg = config_for(run, {field_name: value})
            except ValueError:
                continue
            alerts = replay(signals_of(i, cfg.window), cfg, rules)
            yield labels[i], blow, healthy_ref, [a.step for a in alerts]

    def baseline_outcomes(name, key, value):
        for i, (run, blow, records, healthy_ref) in enumerate(loaded):
            recs = [r for r in records if not r.get("monitor_error")]
            mls = [max((x for row in r["max_logit"] for x in row if math.isfinite(x)), default=math.nan)
                   for r in recs]
            yield labels[i], blow, healthy_ref, _baseline_fires(name, key, value, steps_of[i],
                                                                 [r["step"] for r in recs], mls)

    sweep_out: dict[str, list] = {}
    for label, field_name, values, rules in sweeps:
        sweep_out[label] = [{"value": value, "default": getattr(base, field_name) == value,
                             **_sweep_tally(detector_outcomes(field_name, value, rules))} for value in values]

    base_out: dict[str, list] = {}
    for label, name, key, values in BASELINE_SWEEPS:
        base_out[label] = [{"value": value, **_sweep_tally(baseline_outcomes(name, key, value))} for value in values]
    return {"runs": len(loaded), "extremes": extremes, "sweeps": sweep_out, "baseline_sweeps": base_out,
            "defaults": {f: getattr(base, f) for _, f, _, _ in sweeps}}
