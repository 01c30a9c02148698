"""One recorded run, analysed: blow-up, replayed alerts per rule, baselines, lead times.

``analyze_run(run_dir)`` reads a run folder (``records``) and returns its summary (JSON-ready):
the blow-up (``blowup``), every flashwatch rule's first alert replayed with ``MonitorConfig``'s
defaults or overrides (``playback``), the baselines' first alerts (``baselines``), lead times,
the final loss, and whether replaying the run's own configuration gives the alerts the Monitor
raised in training (``in_training.replay_matches``).

First alerts and lead times. A detector's first alert is the first step at which it starts an
alert anywhere (any layer or head). Lead time = blow-up step - first alert step (positive:
before the blow-up). ``EARLY_RULES`` (every rule but ``non_finite`` and ``loss_spike``, which
fire at or after a failure by construction) make "flashwatch's first alert";
``MECHANISM_RULES`` (the same without ``max_logit``, which is the QK-Clip baseline's
criterion) make the stricter headline compared with the baselines.

Final loss: the mean of the last ``FINAL_WINDOW`` (100) recorded losses (infinite if any is
not finite).
"""

from __future__ import annotations

import math
import os
import statistics
import time
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch

from ..config import MonitorConfig
from ..detectors import Alert, StepSignals
from ..vocabulary import RULES
from .baselines import BASELINES, run_baselines
from .blowup import BlowupTracker, lead_time
from .playback import build_signals, config_for, config_from_dict, in_training_alerts, load_records, replay
from .records import RUN_FILE, read_run, read_steps

__all__ = ["FINAL_WINDOW", "EARLY_RULES", "MECHANISM_RULES", "analyze_run", "find_runs", "run_key"]

FINAL_WINDOW = 100
EARLY_RULES = ("delta_drift", "repeated_max_rise", "wq_growth", "wq_outlier", "max_logit")
MECHANISM_RULES = ("delta_drift", "repeated_max_rise", "wq_growth", "wq_outlier")


def run_key(scenario: str, arm: str, seed: int) -> str:
    """A run's key in a results JSON: ``scenario/arm/seed``."""
    return f"{scenario}/{arm}/{seed}"


def _first(steps: Iterable[int]) -> int | None:
    steps = list(steps)
    return min(steps) if steps else None


def _finite_mean(xs: Sequence[float]) -> float:
    if not xs:
        return math.nan
    if any(not math.isfinite(x) for x in xs):
        return math.inf
    return math.fsum(xs) / len(xs)


def _rule_table(alerts: list[Alert], blowup: int | None, upto: int | None = None) -> dict:
    """Per rule: first alert step, where, how many, lead time."""
    table = {}
    for rule in RULES:
        mine = [a for a in alerts if a.rule == rule and (upto is None or a.step <= upto)]
        first = min(mine, key=lambda a: (a.step, a.layer, a.head)) if mine else None
        table[rule] = {"first": first.step if first else None,
                       "where": [first.layer, first.head] if first else None,
                       "value": _jnum(first.value) if first else None,
                       "count": len(mine),
                       "lead": lead_time(blowup, first.step if first else None)}
    return table


def _jnum(x: float):
    x = float(x)
    return x if math.isfinite(x) else ("NaN" if x != x else ("Infinity" if x > 0 else "-Infinity"))


def _first_of(table: dict, rules: Sequence[str]) -> dict:
    best = None
    for rule in rules:
        first = table[rule]["first"]
        if first is not None and (best is None or first < best[0]):
            best = (first, rule)
    return {"step": best[0] if best else None, "rule": best[1] if best else None}


def _extremes(signals: list[StepSignals], config: MonitorConfig, upto: int | None) -> dict:
    """Largest value of each rule's statistic over a run (before ``upto`` if given), for calibration.

    Per rule, as the detector judges it: |drift z| and |windowed z| of layers whose delta comes
    from the rounded output once a head has ``warmup`` finite e_t (``drift_abs_z_fp32_delta``:
    the same for layers running fp32_delta, which the rule does not judge); the BF16
    repeated-max ratio over its rule threshold max(factor x baseline, baseline + margin) and its
    rise over the baseline; W^Q growth once its comparison point lies after warm-up; the ratio
    to the layer median after ``warmup`` monitored steps; max logit. Each with the step where it
    was reached.
    """
    out: dict[str, Any] = {}

    def keep(name: str, value: float, step: int) -> None:
        if math.isfinite(value) and (name not in out or value > out[name][0]):
            out[name] = (value, step)

    base_sum: dict[int, torch.Tensor] = {}
    seen_n: dict[int, int] = {}
    warm, nb = config.warmup, config.repeated_max_baseline
    for s in signals:
        if upto is not None and s.step >= upto:
            break
        for ls in s.layers:
            if not ls.seen:
                continue
            ready = ls.drift_count >= warm
            if ls.delta_from_rounded_output and bool(ready.any()):
                keep("drift_abs_z", float(ls.drift_z.abs()[ready].max()), s.step)
                keep("drift_window_abs_z", float(ls.drift_window_z.abs()[ready].max()), s.step)
            elif ls.low_precision and ls.variant == "fp32_delta" and bool(ready.any()):  # not judged: reported
                keep("drift_abs_z_fp32_delta", float(ls.drift_z.abs()[ready].max()), s.step)
            n = seen_n.get(ls.layer, 0)
            r = ls.repeated_max_ratio_bf16
            if warm <= n < warm + nb:
                base_sum[ls.layer] = base_sum.get(ls.layer, torch.zeros_like(r)) + torch.nan_to_num(r, nan=0.0)
            seen_n[ls.layer] = n + 1
            if n >= warm + nb:
                base = base_sum[ls.layer] / nb
                thr = torch.maximum(config.repeated_max_factor * base, base + config.repeated_max_margin)
                keep("rm16_over_threshold", float(torch.nan_to_num(r / thr, nan=0.0).max()), s.step)
                keep("rm16_minus_baseline", float(torch.nan_to_num(r - base, nan=-1.0).max()), s.step)
            keep("rm16_ratio", float(torch.nan_to_num(r, nan=0.0).max()), s.step)
            keep("rm32_ratio", float(torch.nan_to_num(ls.repeated_max_ratio, nan=0.0).max()), s.step)
            keep("max_logit", float(torch.nan_to_num(ls.max_logit, nan=-math.inf).max()), s.step)
            if s.index >= warm + config.window:  # as the rule: the comparison point after warm-up
                keep("wq_growth", float(torch.nan_to_num(ls.wq_growth, nan=0.0).max()), s.step)
            if s.index >= warm:
                keep("wq_ratio", float(torch.nan_to_num(ls.wq_ratio, nan=0.0).max()), s.step)
    return {k: {"max": v, "step": st} for k, (v, st) in out.items()}


def _tie_rows(records: list[dict], upto: int | None) -> dict:
    """How often rows repeat their max: mean over heads of the FP32-score and BF16-score
    repeated-max ratios, averaged over monitored steps (before ``upto``), over the first and
    the last tenth of them. The injected fault fires on the FP32-score ones (with a gap of
    ln(1 - 2**-8) ~ 0.002 rather than eps = 0.001, so a little more often)."""
    def mean_ratio(r: dict, key: str) -> float | None:
        vals = [c / r["rows"][layer] for layer, row in enumerate(r[key]) for c in row
                if c is not None and r["rows"][layer] > 0]
        return sum(vals) / len(vals) if vals else None

    out = {}
    rs = [r for r in records if not r.get("monitor_error") and (upto is None or r["step"] < upto)]
    n = len(rs)
    for key, name in (("rm", "fp32"), ("rm16", "bf16")):
        series = [m for m in (mean_ratio(r, key) for r in rs) if m is not None]
        tenth = max(1, len(series) // 10)
        out[name] = {"mean": statistics.fmean(series) if series else None,
                     "first_tenth": statistics.fmean(series[:tenth]) if series else None,
                     "last_tenth": statistics.fmean(series[-tenth:]) if series else None}
    out["monitored_steps"] = n
    return out


def analyze_run(run_dir: str | os.PathLike, overrides: dict | None = None) -> dict:
    """Summary of one recorded run (JSON-ready): blow-up, replayed alerts per rule, baselines, leads.

    Args:
        run_dir: the run folder.
        overrides: ``MonitorConfig`` fields to replay with instead of the defaults.
    """
    run_dir = Path(run_dir)
    run = read_run(run_dir)
    steps = read_steps(run_dir)
    records = load_records(run_dir, steps)
    step_list = steps["step"].tolist()
    losses = steps["loss"].tolist()
    tracker = BlowupTracker()
    for s, loss in zip(step_list, losses):
        if tracker.update(int(s), float(loss)) is not None:
            break
    blowup = tracker.blowup
    finite = [x for x in losses if math.isfinite(x)]
    tail = losses[-FINAL_WINDOW:]

    config = config_for(run, overrides)
    signals = build_signals(records, config.window)
    alerts = replay(signals, config)
    table = _rule_table(alerts, blowup)

    monitored = [r["step"] for r in records if not r.get("monitor_error")]
    max_logits = [max((x for row in r["max_logit"] for x in row if math.isfinite(x)), default=math.nan)
                  for r in records if not r.get("monitor_error")]
    fired = run_baselines(step_list, losses, steps["grad_norm"].tolist(), monitored, max_logits)
    baselines = {name: {"first": _first(fired[name]), "count": len(fired[name]),
                        "lead": lead_time(blowup, _first(fired[name]))} for name in BASELINES}

    # the run's own configuration, replayed: must give the alerts the Monitor raised in training
    in_training = in_training_alerts(run_dir, records)
    matches, differ = None, None
    if run.get("monitor_config"):
        own = replay(records, config_from_dict(run["monitor_config"]))
        # the last monitored step of a lag-corrected recording was never recorded: its alerts cannot replay
        last = records[-1]["step"] if records else -1
        trained = [a for a in in_training if not (records and records[0]["lag_corrected"] and a.step > last)]
        key = lambda a: (a.rule, a.step, a.layer, a.head)
        matches = [key(a) for a in own] == [key(a) for a in trained]
        differ = [r for r in RULES if [key(a) for a in own if a.rule == r] != [key(a) for a in trained if a.rule == r]]

    arm = run.get("arm", {})
    summary = {
        "key": run_key(run["scenario"], arm.get("name", "?"), run["seed"]),
        "scenario": run["scenario"], "arm": arm.get("name"), "seed": run["seed"],
        "label": run.get("label", arm.get("name")), "injected": bool(arm.get("inject")),
        "inject_strength": arm.get("inject", 0.0), "expect": arm.get("expect"), "tiny": run.get("tiny", False),
        "status": run.get("status"), "error": run.get("error"),
        "steps": len(step_list), "last_step": step_list[-1] if step_list else None,
        "max_steps": run.get("max_steps"), "wall_s": run.get("wall_s"), "ms_per_step": run.get("ms_per_step"),
        "device": run.get("device_name"), "device_kind": run.get("device"), "versions": run.get("versions"),
        "date": time.strftime("%Y-%m-%d", time.gmtime(run["started"])) if run.get("started") else None,
        "parallel": run.get("parallel"),  # runs the runner kept going at once (ms_per_step was measured so)
        "blowup_step": blowup, "blowup_confirmed_step": tracker.confirmed_at,
        "final_loss": _jnum(_finite_mean(tail)), "min_loss": min(finite) if finite else None,
        "monitored_steps": len(records),
        "flashwatch": table,
        "flashwatch_first": _first_of(table, EARLY_RULES),
        "flashwatch_mechanism_first": _first_of(table, MECHANISM_RULES),
        "baselines": baselines,
        "in_training": {"alerts": len(in_training),
                        "first_by_rule": {rule: _first(a.step for a in in_training if a.rule == rule) for rule in RULES},
                        "replay_matches": matches, "replay_differs_in": differ},
        "records_lag_corrected": bool(records and records[0]["lag_corrected"]),
        "switches": run.get("switches", []),
        "monitor_errors": run.get("monitor_errors"),
        "extremes": _extremes(signals, config, blowup),
        "tie_rows": _tie_rows(records, blowup),
        "replay_config": {k: v for k, v in config.to_dict().items() if k not in ("layers",)},
        "run_dir": str(run_dir),
    }
    for key in ("flashwatch_first", "flashwatch_mechanism_first"):
        summary[key]["lead"] = lead_time(blowup, summary[key]["step"])
    return summary


def find_runs(root: str | os.PathLike) -> list[Path]:
    """Run folders (those holding ``run.json``) under ``root``, sorted."""
    root = Path(root)
    if (root / RUN_FILE).exists():
        return [root]
    return sorted(p.parent for p in root.rglob(RUN_FILE))


def _median(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _healthy_reference(run: dict) -> bool:
    """A run that counts as healthy for false alarms and calibration: an arm meant to stay healthy
    (``expect == "healthy"``) that did not blow up and was not switched by auto_fix."""
    return run.get("expect") == "healthy" and run.get("blowup_step") is None and not run.get("switches")
