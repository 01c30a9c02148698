"""The pre-registered test of the early warning (research/preregistration/early-warning-protocol.md).

    python -m research.early_warning calibrate RUNS... --out THRESHOLDS.json [--controls RUNS...]
    python -m research.early_warning test RUNS... --thresholds THRESHOLDS.json --out RESULT.json [--markdown T.md] [--require-complete] [--horizon STEPS]
    python -m research.early_warning ratio RESULT.json [--rule chain] [--factor 3]
    python -m research.early_warning auc RUNS... --thresholds THRESHOLDS.json --lead 1000 --out AUC.json
    python -m research.early_warning landmark RUNS... --thresholds THRESHOLDS.json --lead 1000 --margin 1000 --out L.json
    python -m research.early_warning figure RESULT.json [RESULT.json ...] --rules chain,max_logit --out F.png
    python -m research.early_warning outcomes RUNS... --out O.json [--markdown O.md]
    python -m research.early_warning pilot [--protocol 9] RATE=OUTCOMES.json [RATE=OUTCOMES.json]

RUNS: run folders of the seed-split scenario, or folders holding them. Everything here follows
the protocol: outcomes (blow-up, confirmed, survivor), each rule's per-run score series (the
Monitor's readings replayed through ``flashwatch.step_signals.SignalBuilder``), thresholds
from calibration survivors (theta = M + 0.05 |M|), firing from step ``START_STEP`` on,
detections, leads and false alarms on the test runs, the pass criteria, and, labelled as
computed after, a table over thresholds.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from flashwatch.replay.baselines import loss_spike, zclip_scores
from flashwatch.replay.blowup import BlowupTracker
from flashwatch.replay.playback import build_signals, load_records
from flashwatch.replay.records import read_run, read_steps
from flashwatch.replay.runs import find_runs

from research import pilot

__all__ = ["RULES", "BASELINES", "START_STEP", "outcome", "scores", "calibrate", "evaluate"]

START_STEP = 500  # rules and baselines fire from here on (past the learning-rate warm-up)
WINDOW = 50  # MonitorConfig.window: the trends' and the coherence's window
MARGIN = 0.05  # theta = M + MARGIN * |M|
MIN_LEAD = 1000  # pass: lead >= this ...
MIN_DETECTED = 0.8  # ... in at least this share of the blow-ups ...
MAX_FALSE_ALARM = 1 / 7  # ... and false alarms in at most this share of the survivors
MIN_GROUP = 6  # a verdict needs at least this many confirmed blow-ups and survivors (else: undecided)
CONFIRM_TAIL = 200  # recorded steps whose median confirms a blow-up (>= 1.25 x the best median before it)
CONFIRM_FACTOR = 1.25
DRIFT_Z = 4.5  # the chain rule's drift condition (MonitorConfig.drift_threshold)

RULES = ("max_logit", "max_logit_growth_rate", "repeated_max_rise", "repeated_max_bf16_trend", "delta_drift",
         "wq_growth", "wq_sigma_growth_rate", "wq_error_coherence", "wq_error_alignment", "wq_error_push_share",
         "chain")
BASELINES = ("qk_clip_100", "zclip_2.5", "zclip_calibrated", "loss_spike")


# --- outcome --------------------------------------------------------------------------------------

def outcome(run_dir: Path) -> dict:
    """Blow-up step, whether it is confirmed as sustained, and the run's length (the protocol's definitions)."""
    steps = read_steps(run_dir)
    s, losses = steps["step"].tolist(), steps["loss"].tolist()
    tracker = BlowupTracker()
    for step, loss in zip(s, losses):
        if tracker.update(int(step), float(loss)) is not None:
            break
    b = tracker.blowup
    best_before = tracker.best  # the lowest running median before the blow-up's streak
    tail = losses[-CONFIRM_TAIL:]
    tail_median = statistics.median(tail) if tail else math.nan
    confirmed = b is not None and (not math.isfinite(tail_median) or tail_median >= CONFIRM_FACTOR * best_before)
    return {"blowup": b, "confirmed": bool(confirmed), "survivor": b is None, "last_step": int(s[-1]) if s else None,
            "steps_after_blowup": (int(s[-1]) - b) if (b is not None and s) else None,
            "tail_median_loss": tail_median, "best_median_before": best_before}


def monitoring(run_dir: Path, upto: int | None) -> dict:
    """Whether the Monitor measured every monitored step of the run that the test reads (all of
    them for a survivor, those before the blow-up for a blow-up): the monitored steps it recorded
    as failed there (``monitor_error``; their readings are stale copies, and the replay leaves them
    out, so a rule cannot fire there), and the step up to which it measured without a gap."""
    records = [r for r in load_records(run_dir) if upto is None or r["step"] < upto]
    failed = [int(r["step"]) for r in records if r.get("monitor_error")]
    measured = [int(r["step"]) for r in records if not r.get("monitor_error")]
    before_gap = [t for t in measured if not failed or t < failed[0]]
    through = before_gap[-1] if before_gap else None
    return {"failed_steps": len(failed), "monitored_steps": len(records), "first_failed_step": failed[0] if failed else None,
            "complete": not failed and bool(records), "measured_through": through}


# --- score series ---------------------------------------------------------------------------------

def _max(t: torch.Tensor | None) -> float:
    if t is None:
        return math.nan
    finite = t[torch.isfinite(t)]
    return float(finite.max()) if finite.numel() else math.nan


def scores(run_dir: Path, theta_coherence: float | None = None) -> dict[str, list[tuple[int, float]]]:
    """Every rule's and baseline's score at each monitored (rules, QK-Clip) or optimizer (ZClip) step.

    Scores are maxima over layers and heads. ``chain`` needs ``theta_coherence`` (else it is left out).
    """
    steps = read_steps(run_dir)
    records = load_records(run_dir, steps)
    signals = build_signals(records, WINDOW)
    out: dict[str, list[tuple[int, float]]] = {r: [] for r in RULES}
    baseline_rm: dict[int, torch.Tensor] = {}
    rm_hist: dict[int, list[torch.Tensor]] = {}
    align_hist: dict[int, list[torch.Tensor]] = {}
    for sig in signals:
        t = sig.step
        per = {r: [] for r in RULES}
        for ls in sig.layers:
            i = ls.layer
            per["max_logit"].append(_max(ls.max_logit))
            per["max_logit_growth_rate"].append(_max(ls.max_logit_growth))
            # BF16 repeated-max ratio over its baseline: mean over monitored steps 20-39
            if 20 <= sig.index < 40:
                rm_hist.setdefault(i, []).append(ls.repeated_max_ratio_bf16)
            if sig.index >= 40 and i not in baseline_rm and rm_hist.get(i):
                baseline_rm[i] = torch.stack(rm_hist[i]).nanmean(0)
            per["repeated_max_rise"].append(_max(ls.repeated_max_ratio_bf16 - baseline_rm[i]) if i in baseline_rm
                                            else math.nan)
            per["repeated_max_bf16_trend"].append(_max(ls.repeated_max_bf16_trend))
            per["delta_drift"].append(_max(ls.drift_z.abs()))
            per["wq_growth"].append(_max(ls.wq_growth) if sig.index >= 20 + WINDOW else math.nan)
            per["wq_sigma_growth_rate"].append(_max(ls.wq_sigma_growth_rate))
            per["wq_error_coherence"].append(_max(ls.wq_error_coherence))
            hist = align_hist.setdefault(i, [])
            if ls.wq_error_alignment is not None:
                hist.append(ls.wq_error_alignment)
                del hist[:-10]
            per["wq_error_alignment"].append(_max(torch.stack(hist).nanmean(0)) if len(hist) == 10 else math.nan)
            per["wq_error_push_share"].append(_max(ls.wq_error_push_share))
            if theta_coherence is not None and ls.wq_error_coherence is not None:
                both = torch.minimum(ls.wq_error_coherence / theta_coherence, ls.drift_z.abs() / DRIFT_Z)
                per["chain"].append(_max(both))
        for r in RULES:
            vals = [v for v in per[r] if math.isfinite(v)]
            if vals:
                out[r].append((t, max(vals)))
    if theta_coherence is None:
        del out["chain"]
    out["qk_clip"] = list(out["max_logit"])
    out["zclip"] = zclip_scores(steps["step"].tolist(), steps["grad_norm"].tolist())
    spikes = loss_spike(steps["step"].tolist(), steps["loss"].tolist())
    out["loss_spike"] = [(s, 1.0) for s in spikes]
    return out


def first_fire(series: list[tuple[int, float]], theta: float) -> int | None:
    """The first step >= START_STEP whose score reaches ``theta``."""
    return next((s for s, v in series if s >= START_STEP and v >= theta), None)


def _score_upto(series: list[tuple[int, float]], upto: int | None) -> float:
    """The largest score from START_STEP on (up to ``upto``, excluded, if given)."""
    vals = [v for s, v in series if s >= START_STEP and (upto is None or s < upto) and math.isfinite(v)]
    return max(vals, default=-math.inf)


# --- the protocol ---------------------------------------------------------------------------------

def _runs(paths: list[str]) -> list[Path]:
    out: list[Path] = []
    for p in paths:
        out.extend(find_runs(p))
    return sorted(set(out))


def _commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                              cwd=Path(__file__).resolve().parent).stdout.strip() or None
    except Exception:
        return None


def _file_commit(path: Path) -> str | None:
    """The last commit that changed ``path`` (the frozen thresholds' commit, recorded with the test)."""
    try:
        return subprocess.run(["git", "log", "-1", "--format=%H", "--", path.name], capture_output=True, text=True,
                              timeout=5, cwd=path.resolve().parent).stdout.strip() or None
    except Exception:
        return None


def _theta(m: float) -> float:
    return m + MARGIN * abs(m)


def calibrate(run_dirs: list[Path], control_dirs: list[Path] = ()) -> dict:
    """Thresholds from the calibration survivors (controls stand in when there is none)."""
    runs = {str(d): outcome(d) for d in run_dirs}
    survivors = [Path(d) for d, o in runs.items() if o["survivor"]]
    source = "calibration survivors"
    if not survivors:
        survivors, source = list(control_dirs), "controls (no calibration survivor)"
    if not survivors:
        raise SystemExit("no calibration survivor and no control run: the thresholds cannot be set")
    series = {str(d): scores(d) for d in survivors}
    theta = {}
    for r in [r for r in RULES if r != "chain"] + ["zclip"]:
        m = max(_score_upto(series[str(d)][r], None) for d in survivors)
        theta[r] = _theta(m) if math.isfinite(m) else math.inf
    theta["chain"] = 1.0
    return {"protocol": "research/preregistration/early-warning-protocol.md", "computed": time.strftime("%Y-%m-%d"),
            "commit": _commit(), "threshold_source": source, "margin": MARGIN, "start_step": START_STEP,
            "thresholds": theta, "calibration_runs": runs, "survivors_used": [str(d) for d in survivors]}


def evaluate(run_dirs: list[Path], frozen: dict, require_complete: bool = False, horizon: int | None = None) -> dict:
    """The test: per rule and baseline, detections and leads on confirmed blow-ups, false alarms on survivors.

    ``require_complete`` (the fourth protocol): a run whose monitoring is not complete before its
    blow-up (all of it for a survivor) is left out of every count and listed in
    ``excluded_incomplete``. ``horizon`` (the ninth protocol): a survivor must have run this many
    steps; a run without a blow-up that stopped short of it is left out and listed in
    ``excluded_short``."""
    theta = dict(frozen["thresholds"])
    rules_theta = {**{r: theta[r] for r in RULES}, "qk_clip_100": 100.0, "zclip_2.5": 2.5,
                   "zclip_calibrated": theta["zclip"], "loss_spike": 1.0}
    source = {**{r: r for r in RULES}, "qk_clip_100": "qk_clip", "zclip_2.5": "zclip",
              "zclip_calibrated": "zclip", "loss_spike": "loss_spike"}
    per_run, excluded, incomplete_left_out, short = {}, [], [], []
    for d in run_dirs:
        o = outcome(d)
        if o["blowup"] is not None and not o["confirmed"]:
            excluded.append({"run": str(d), "seed": read_run(d).get("seed"), "outcome": o})
            continue
        if horizon is not None and o["survivor"] and (o["last_step"] is None or o["last_step"] < horizon - 1):
            short.append({"run": str(d), "seed": read_run(d).get("seed"), "outcome": o})
            continue
        m = monitoring(d, o["blowup"])
        if require_complete and not m["complete"]:
            incomplete_left_out.append({"run": str(d), "seed": read_run(d).get("seed"), "monitoring": m})
            continue
        s = scores(d, theta_coherence=theta["wq_error_coherence"])
        fires = {name: first_fire(s[source[name]], rules_theta[name]) for name in rules_theta}
        peaks = {name: _score_upto(s[source[name]], o["blowup"]) for name in rules_theta}
        per_run[str(d)] = {"outcome": o, "first_fire": fires, "peak_before_blowup": peaks,
                           "seed": read_run(d).get("seed"), "monitoring": m}
    blowups = {k: v for k, v in per_run.items() if not v["outcome"]["survivor"]}
    survivors = {k: v for k, v in per_run.items() if v["outcome"]["survivor"]}
    table = {}
    for name in rules_theta:
        leads = [v["outcome"]["blowup"] - v["first_fire"][name] for v in blowups.values()
                 if v["first_fire"][name] is not None and v["first_fire"][name] < v["outcome"]["blowup"]]
        early = sum(1 for x in leads if x >= MIN_LEAD)
        false = sum(1 for v in survivors.values() if v["first_fire"][name] is not None)
        n_b, n_s = len(blowups), len(survivors)
        verdict = _verdict(n_b, early, n_s, false) if name in RULES else None
        table[name] = {"threshold": rules_theta[name], "blowups": n_b, "detected": len(leads),
                       f"lead_ge_{MIN_LEAD}": early, "leads": sorted(leads), "survivors": n_s,
                       "false_alarms": false, "verdict": verdict,
                       "passes": (verdict == "pass") if name in RULES else None}
    incomplete = sorted(v["seed"] for v in per_run.values() if not v["monitoring"]["complete"])
    return {"protocol": frozen["protocol"], "thresholds_commit": frozen.get("commit"), "evaluated": time.strftime("%Y-%m-%d"),
            "commit": _commit(), "table": table, "runs": per_run, "excluded_unconfirmed": excluded,
            "monitoring_incomplete": incomplete, "require_complete": require_complete,
            "excluded_incomplete": incomplete_left_out, "horizon": horizon, "excluded_short": short,
            "post_hoc_threshold_table": _post_hoc(per_run, source)}


def outcomes(run_dirs: list[Path]) -> dict:
    """Each run's outcome and monitoring, and nothing about any rule: what a protocol allows to be
    reported of its test runs before its analysis (blow-up steps, confirmations, survivors)."""
    per_run = {}
    for d in run_dirs:
        o = outcome(d)
        per_run[str(d)] = {"seed": read_run(d).get("seed"), "outcome": o, "monitoring": monitoring(d, o["blowup"])}
    values = per_run.values()
    counts = {"runs": len(per_run),
              "survivors": sum(1 for v in values if v["outcome"]["survivor"]),
              "blowups_confirmed": sum(1 for v in values if v["outcome"]["blowup"] is not None and v["outcome"]["confirmed"]),
              "blowups_unconfirmed": sum(1 for v in values if v["outcome"]["blowup"] is not None
                                         and not v["outcome"]["confirmed"]),
              "monitoring_incomplete": sum(1 for v in values if not v["monitoring"]["complete"])}
    return {"kind": "outcomes", "evaluated": time.strftime("%Y-%m-%d"), "commit": _commit(), "counts": counts,
            "runs": per_run}


def outcomes_markdown(result: dict) -> str:
    """The counts, then one line per run (``runs_markdown``'s columns)."""
    c = result["counts"]
    head = (f"{c['runs']} runs: {c['blowups_confirmed']} blew up (confirmed), {c['blowups_unconfirmed']} blew up "
            f"(not confirmed), {c['survivors']} survived; monitoring incomplete in {c['monitoring_incomplete']}.")
    return head + "\n\n" + runs_markdown(result)


def _verdict(n_blowups: int, early: int, n_survivors: int, false_alarms: int) -> str:
    """"pass" or "fail" by the protocol's criteria; "undecided" while a group the verdict depends on
    has fewer than MIN_GROUP runs (the protocol adds seeds until both groups have MIN_GROUP)."""
    detects = early >= MIN_DETECTED * n_blowups
    quiet = false_alarms <= MAX_FALSE_ALARM * n_survivors
    if n_blowups >= MIN_GROUP and not detects:
        return "fail"
    if n_survivors >= MIN_GROUP and not quiet:
        return "fail"
    if n_blowups >= MIN_GROUP and n_survivors >= MIN_GROUP:
        return "pass"
    return "undecided"


def _post_hoc(per_run: dict, source: dict) -> dict:
    """Computed after (not part of the pre-registered test): for each rule and baseline, at each
    number of false alarms k on the test survivors, the detections and median lead of the lowest
    threshold that has k false alarms (from the runs' peak scores)."""
    blowups = [v for v in per_run.values() if not v["outcome"]["survivor"]]
    survivors = [v for v in per_run.values() if v["outcome"]["survivor"]]
    out = {}
    for name in source:
        if name == "loss_spike":
            continue
        surv_peaks = sorted((v["peak_before_blowup"][name] for v in survivors), reverse=True)
        rows = []
        for k in range(len(survivors) + 1):
            # threshold just above the (k+1)-th highest survivor peak: k survivors reach it
            above = surv_peaks[k] if k < len(surv_peaks) else -math.inf
            detected = [v for v in blowups if v["peak_before_blowup"][name] > above]
            rows.append({"false_alarms": k, "threshold_above": above, "detected": len(detected)})
        out[name] = rows
    return out


def blowup_ratios(result: dict, rule: str, factor: float) -> list[dict]:
    """Per run of a test result: the rule's first firing step f, the blow-up step b (None: survived),
    b / f, and whether the third protocol's descriptive prediction holds there: a run in which the
    rule fired blows up by step ``factor`` x f (None where the run ended before that step without a
    blow-up: not decided)."""
    out = []
    for v in sorted(result["runs"].values(), key=lambda v: v["seed"]):
        f, o = v["first_fire"].get(rule), v["outcome"]
        b, last = o["blowup"], o["last_step"]
        if f is None:
            holds = None
        elif b is not None:
            holds = b <= factor * f
        else:
            holds = False if last >= factor * f else None
        out.append({"seed": v["seed"], "first_fire": f, "blowup": b, "last_step": last,
                    "ratio": (b / f) if (b is not None and f) else None, "holds": holds})
    return out


# --- the fourth protocol's threshold-free secondary test ---------------------------------------------

AUC_RULES = RULES + ("qk_clip", "zclip")  # score series of scores(); qk_clip is the max logit
AUC_CLAIM = 0.70  # claim: the lower end of the 95% interval at 1,000 steps' lead is above this
AUC_RESAMPLES = 2000


def peak_upto(series: list[tuple[int, float]], h: int) -> float:
    """Max of a score series over START_STEP <= t <= h (finite values); -inf where it has none."""
    vals = [v for t, v in series if START_STEP <= t <= h and math.isfinite(v)]
    return max(vals) if vals else -math.inf


def pair_matrix(blowup_peaks: list[float], survivor_peaks: list[list[float]]) -> torch.Tensor:
    """(I, J) float64: 1 where blow-up i's peak beats survivor j's peak read at i's horizon, 0.5 on
    a tie, else 0. ``survivor_peaks[i][j]`` is survivor j's peak up to blow-up i's horizon (NaN: the
    pair is not comparable and stays NaN)."""
    b = torch.tensor(blowup_peaks, dtype=torch.float64)[:, None]
    s = torch.tensor(survivor_peaks, dtype=torch.float64).reshape(len(blowup_peaks), -1)
    m = (b > s).double() + 0.5 * (b == s).double()
    return torch.where(torch.isnan(s), torch.full_like(m, math.nan), m)


def auc_with_interval(m: torch.Tensor, resamples: int = AUC_RESAMPLES, seed: int = 0) -> dict:
    """The mean of the comparable pairs of ``m`` (I, J) and a 95% bootstrap interval (blow-ups and
    survivors resampled within their groups)."""
    ok = ~torch.isnan(m)
    if not ok.any():
        return {"auc": None, "low": None, "high": None, "pairs": 0}
    auc = float(m[ok].mean())
    g = torch.Generator().manual_seed(seed)
    I, J = m.shape
    stats = []
    for _ in range(resamples):
        sub = m[torch.randint(I, (I,), generator=g)][:, torch.randint(J, (J,), generator=g)]
        keep = ~torch.isnan(sub)
        if keep.any():
            stats.append(float(sub[keep].mean()))
    q = torch.tensor(stats, dtype=torch.float64).quantile(torch.tensor([0.025, 0.975], dtype=torch.float64))
    return {"auc": auc, "low": float(q[0]), "high": float(q[1]), "pairs": int(ok.sum())}


def time_matched_auc(run_dirs: list[Path], frozen: dict, lead: int, allow_incomplete: bool = False) -> dict:
    """The fourth protocol's secondary test: per rule, AUC over (blow-up, survivor) pairs of the
    peak score up to B_i - lead, the survivor read at the same step; complete runs only (with
    ``allow_incomplete``, computed-after use on older recordings: a pair counts only where both
    runs were measured through that step)."""
    theta_coh = dict(frozen["thresholds"])["wq_error_coherence"]
    blowups, survivors, left_out = [], [], []
    for d in run_dirs:
        o = outcome(d)
        if o["blowup"] is not None and not o["confirmed"]:
            left_out.append({"run": str(d), "why": "blow-up not confirmed"})
            continue
        m = monitoring(d, o["blowup"])
        if not m["complete"] and not allow_incomplete:
            left_out.append({"run": str(d), "why": "monitoring incomplete"})
            continue
        through = m["measured_through"] if m["measured_through"] is not None else -1
        entry = {"run": str(d), "seed": read_run(d).get("seed"), "through": through, "scores": scores(d, theta_coh)}
        (survivors if o["survivor"] else blowups).append({**entry, "blowup": o["blowup"]})
    table = {}
    for rule in AUC_RULES:
        bp, sp = [], []
        for b in blowups:
            h = b["blowup"] - lead
            bp.append(peak_upto(b["scores"][rule], h) if b["through"] >= h else math.nan)
            sp.append([peak_upto(s["scores"][rule], h) if s["through"] >= h else math.nan for s in survivors])
        keep = [i for i, x in enumerate(bp) if not math.isnan(x)]
        m = pair_matrix([bp[i] for i in keep], [sp[i] for i in keep]) if keep and survivors else torch.empty(0, 0)
        row = auc_with_interval(m) if m.numel() else {"auc": None, "low": None, "high": None, "pairs": 0}
        ok = ~torch.isnan(m) if m.numel() else torch.zeros(0, 0, dtype=torch.bool)
        # runs in at least one comparable pair (all of them when every run is complete)
        row["blowups"], row["survivors"] = int(ok.any(1).sum()), int(ok.any(0).sum())
        enough = row["blowups"] >= MIN_GROUP and row["survivors"] >= MIN_GROUP
        row["verdict"] = ("undecided" if not enough or row["low"] is None
                          else "separates" if row["low"] > AUC_CLAIM else "does not separate")
        table[rule] = row
    return {"lead": lead, "claim_above": AUC_CLAIM, "resamples": AUC_RESAMPLES, "blowups": len(blowups),
            "survivors": len(survivors), "allow_incomplete": allow_incomplete, "left_out": left_out,
            "commit": _commit(), "evaluated": time.strftime("%Y-%m-%d"), "table": table}


def auc_markdown(result: dict) -> str:
    lines = [f"| rule | AUC at {result['lead']:,} steps' lead | 95% interval | pairs (blow-ups x survivors) | verdict |",
             "|---|---|---|---|---|"]
    for rule, row in result["table"].items():
        if row["auc"] is None:
            lines.append(f"| `{rule}` | - | - | 0 | {row['verdict']} |")
        else:
            lines.append(f"| `{rule}` | {row['auc']:.3f} | {row['low']:.3f}-{row['high']:.3f} | {row['pairs']} "
                         f"({row['blowups']} x {row['survivors']}) | {row['verdict']} |")
    return "\n".join(lines)


# --- the fifth protocol: landmark AUC against runs that stay healthy longer ----------------------

LANDMARK_MARGIN = 1000  # a control is healthy through at least B_i + this many steps
LANDMARK_MIN_CASES = 6  # a verdict needs this many blow-ups in at least one pair ...
LANDMARK_MIN_CONTROLS = 4  # ... and this many distinct control runs
LANDMARK_PRIMARY = "chain"  # the rule the claim is about
LANDMARK_BASELINE = "qk_clip"  # what QK-Clip users already have: the max logit


def landmark_pairs(runs: list[dict], lead: int, margin: int) -> torch.Tensor:
    """(n, n) bool over ``runs`` (each with ``blowup``: B or None, ``healthy_through``: the last step
    known healthy): pair (i, j) is valid when run i blew up and run j was still healthy at B_i + margin,
    so that at the landmark B_i - lead, j was at least lead + margin steps from any blow-up. A run is
    never its own control (it is not healthy at B_i)."""
    n = len(runs)
    ok = torch.zeros(n, n, dtype=torch.bool)
    for i, a in enumerate(runs):
        if a["blowup"] is None:
            continue
        for j, b in enumerate(runs):
            ok[i, j] = j != i and b["healthy_through"] >= a["blowup"] + margin
    return ok


def landmark_matrix(runs: list[dict], rule: str, lead: int, valid: torch.Tensor) -> torch.Tensor:
    """(n, n) float64: for each valid pair, 1 where case i's peak score up to B_i - lead beats control
    j's peak up to the same step, 0.5 on a tie, 0 below; NaN elsewhere."""
    n = len(runs)
    m = torch.full((n, n), math.nan, dtype=torch.float64)
    for i, j in valid.nonzero().tolist():
        h = runs[i]["blowup"] - lead
        a, b = peak_upto(runs[i]["scores"][rule], h), peak_upto(runs[j]["scores"][rule], h)
        m[i, j] = 1.0 if a > b else 0.5 if a == b else 0.0
    return m


def _pair_mean(m: torch.Tensor) -> float:
    keep = ~torch.isnan(m)
    return float(m[keep].mean()) if keep.any() else math.nan


def landmark_bootstrap(mats: dict[str, torch.Tensor], resamples: int = AUC_RESAMPLES, seed: int = 0) -> dict:
    """Per rule the AUC (mean over valid pairs) and a 95% interval from resampling runs with
    replacement (a run can be a case for one pair and a control for another, so runs, not groups,
    are resampled; the pairs among the drawn runs are re-formed, a run drawn twice is not its own
    control). Also each rule's AUC minus the baseline's on the same resamples."""
    n = next(iter(mats.values())).shape[0]
    g = torch.Generator().manual_seed(seed)
    draws = {r: [] for r in mats}
    diffs = {r: [] for r in mats}
    for _ in range(resamples):
        idx = torch.randint(n, (n,), generator=g)
        vals = {r: _pair_mean(m[idx][:, idx]) for r, m in mats.items()}
        base = vals.get(LANDMARK_BASELINE, math.nan)
        for r, v in vals.items():
            if not math.isnan(v):
                draws[r].append(v)
                if not math.isnan(base):
                    diffs[r].append(v - base)
    q = torch.tensor([0.025, 0.975], dtype=torch.float64)
    out = {}
    for r, m in mats.items():
        auc = _pair_mean(m)
        base = _pair_mean(mats[LANDMARK_BASELINE]) if LANDMARK_BASELINE in mats else math.nan
        lo, hi = (torch.tensor(draws[r], dtype=torch.float64).quantile(q).tolist() if draws[r] else (None, None))
        dlo, dhi = (torch.tensor(diffs[r], dtype=torch.float64).quantile(q).tolist() if diffs[r] else (None, None))
        out[r] = {"auc": None if math.isnan(auc) else auc, "low": lo, "high": hi,
                  "minus_baseline": None if math.isnan(auc - base) else auc - base,
                  "minus_baseline_low": dlo, "minus_baseline_high": dhi}
    return out


def landmark_auc(run_dirs: list[Path], frozen: dict, lead: int = MIN_LEAD, margin: int = LANDMARK_MARGIN,
                 resamples: int = AUC_RESAMPLES) -> dict:
    """The fifth protocol's test: per rule, the AUC over (case, control) pairs of the peak score up to
    the landmark B_i - lead, where the controls of blow-up i are the runs of the same configuration
    (later blow-ups and survivors) still healthy at B_i + margin, read at the same step. Complete runs
    with a confirmed blow-up or none enter; the rest are listed as left out."""
    theta_coh = dict(frozen["thresholds"])["wq_error_coherence"]
    runs, left_out = [], []
    for d in run_dirs:
        o = outcome(d)
        if o["blowup"] is not None and not o["confirmed"]:
            left_out.append({"run": str(d), "why": "blow-up not confirmed"})
            continue
        if not monitoring(d, o["blowup"])["complete"]:
            left_out.append({"run": str(d), "why": "monitoring incomplete"})
            continue
        healthy = o["blowup"] - 1 if o["blowup"] is not None else o["last_step"]
        runs.append({"run": str(d), "seed": read_run(d).get("seed"), "blowup": o["blowup"],
                     "healthy_through": healthy, "scores": scores(d, theta_coh)})
    valid = landmark_pairs(runs, lead, margin)
    cases, controls = int(valid.any(1).sum()), int(valid.any(0).sum())
    enough = cases >= LANDMARK_MIN_CASES and controls >= LANDMARK_MIN_CONTROLS
    mats = {r: landmark_matrix(runs, r, lead, valid) for r in AUC_RULES}
    table = landmark_bootstrap(mats, resamples) if valid.any() else {r: {"auc": None} for r in AUC_RULES}
    for r, row in table.items():
        row["verdict"] = ("undecided" if not enough or row.get("low") is None
                          else "separates" if row["low"] > AUC_CLAIM else "does not separate")
        if r != LANDMARK_BASELINE and enough and row.get("minus_baseline_low") is not None:
            row["beats_baseline"] = row["minus_baseline_low"] > 0
    conc = {r: concordance(runs, r, CONCORDANCE_STEP) for r in AUC_RULES}
    ctable = landmark_bootstrap(conc, resamples) if any((~torch.isnan(m)).any() for m in conc.values()) else {}
    return {"lead": lead, "margin": margin, "claim_above": AUC_CLAIM, "primary": LANDMARK_PRIMARY,
            "concordance_step": CONCORDANCE_STEP, "concordance": ctable,
            "concordance_pairs": int((~torch.isnan(conc[LANDMARK_PRIMARY])).sum()),
            "baseline": LANDMARK_BASELINE, "resamples": resamples, "runs": len(runs), "pairs": int(valid.sum()),
            "cases": cases, "controls": controls,
            "pair_list": [[runs[i]["seed"], runs[j]["seed"]] for i, j in valid.nonzero().tolist()],
            "left_out": left_out, "commit": _commit(), "evaluated": time.strftime("%Y-%m-%d"), "table": table}


CONCORDANCE_STEP = 6000  # the fifth protocol's secondary reading: every test run is still healthy here


def concordance(runs: list[dict], rule: str, at: int) -> torch.Tensor:
    """(n, n) float64 over ``runs`` (each with ``blowup``: B or None, ``healthy_through``): for each
    pair where both runs were healthy at step ``at`` and run i blew up before run j was last seen
    healthy, 1 where i's peak score up to ``at`` beats j's, 0.5 on a tie, 0 below; NaN elsewhere
    (Harrell's concordance, survivors censored at their last step)."""
    n = len(runs)
    m = torch.full((n, n), math.nan, dtype=torch.float64)
    for i, a in enumerate(runs):
        if a["blowup"] is None or a["blowup"] <= at:
            continue
        for j, b in enumerate(runs):
            if j != i and b["healthy_through"] >= a["blowup"]:
                x, y = peak_upto(a["scores"][rule], at), peak_upto(b["scores"][rule], at)
                m[i, j] = 1.0 if x > y else 0.5 if x == y else 0.0
    return m


def landmark_claims(result: dict) -> tuple[str, str]:
    """The fifth protocol's two claims about the primary rule, as a landmark result decides them:
    ("separates" | "does not separate" | "undecided", "made" | "not made" | "undecided")."""
    row = result["table"].get(result["primary"], {})
    beats = row.get("beats_baseline")
    return row.get("verdict", "undecided"), "undecided" if beats is None else "made" if beats else "not made"


def _landmark_claims_text(result: dict) -> str:
    first, second = landmark_claims(result)
    rule = result["primary"]
    return (f"Claim 1 (`{rule}` separates, lower end above {result['claim_above']}): {first}. "
            f"Claim 2 (`{rule}` beats `{result['baseline']}`, lower end of the difference above 0): {second}.")


def _landmark_row_verdict(result: dict, rule: str) -> str:
    """The primary rule's verdict; every other rule's reading is reported with no claim (the protocol
    tests one rule: a claim for each of 13 would make chance passes likely)."""
    verdict = result["table"][rule]["verdict"]
    if rule == result["primary"] or verdict == "undecided":
        return verdict
    return f"lower end {'above' if verdict == 'separates' else 'not above'} {result['claim_above']} (no claim)"


def landmark_markdown(result: dict) -> str:
    registered = ([f"Registered in `{result['test_protocol']}` (commit {result['test_protocol_commit']}); thresholds "
                   f"`{result['thresholds_file']}` (commit {result['thresholds_file_commit']}); code {result['commit']}.", ""]
                  if result.get("test_protocol") else [])
    lines = registered + [f"{result['pairs']} pairs: {result['cases']} blow-ups, each against the runs still healthy "
             f"{result['margin']:,} steps after it ({result['controls']} distinct); read {result['lead']:,} steps "
             f"before the blow-up; primary rule `{result['primary']}`, baseline `{result['baseline']}` (the max logit).",
             "", _landmark_claims_text(result), "",
             "| rule | AUC | 95% interval | minus baseline (95% interval) | verdict |",
             "|---|---|---|---|---|"]
    for rule, row in result["table"].items():
        if row.get("auc") is None:
            lines.append(f"| `{rule}` | - | - | - | {_landmark_row_verdict(result, rule)} |")
            continue
        diff = ("-" if rule == result["baseline"] or row.get("minus_baseline") is None
                else f"{row['minus_baseline']:+.3f} ({row['minus_baseline_low']:+.3f} to {row['minus_baseline_high']:+.3f})")
        lines.append(f"| `{rule}` | {row['auc']:.3f} | {row['low']:.3f}-{row['high']:.3f} | {diff} | {_landmark_row_verdict(result, rule)} |")
    if result.get("concordance"):
        lines += ["", f"Concordance at step {result['concordance_step']:,} (descriptive; {result['concordance_pairs']} pairs "
                  "of runs healthy there, the earlier blow-up against the later one or a survivor):", "",
                  "| rule | concordance | 95% interval |", "|---|---|---|"]
        for rule, row in result["concordance"].items():
            if row.get("auc") is not None:
                lines.append(f"| `{rule}` | {row['auc']:.3f} | {row['low']:.3f}-{row['high']:.3f} |")
    return "\n".join(lines)


def timeline_figure(results: list[tuple[str, dict]], rules: list[str], out: Path) -> None:
    """One panel per test result: a row per run (sorted by blow-up step, survivors last), a line to
    its blow-up (x) or to its last step (survivor), dotted where the Monitor did not measure the run,
    and a marker where each rule first fired."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    markers = "o^sDv<>P*X"
    fig, axes = plt.subplots(1, len(results), figsize=(6.2 * len(results), 0.5 + 0.22 * max(
        len(r["runs"]) for _, r in results)), squeeze=False)
    for ax, (title, result) in zip(axes[0], results):
        runs = sorted(result["runs"].values(), key=lambda v: (v["outcome"]["survivor"],
                                                              v["outcome"]["blowup"] or 0, v["seed"]))
        for y, v in enumerate(runs):
            o = v["outcome"]
            end = o["blowup"] if o["blowup"] is not None else o["last_step"]
            color = "tab:red" if o["blowup"] is not None else "tab:green"
            m = v.get("monitoring") or {"complete": True}
            cut = end if m["complete"] or m["measured_through"] is None else min(m["measured_through"], end)
            ax.plot([0, cut], [y, y], color=color, lw=1.5)
            if cut < end:  # not measured from here on (monitoring failed): no rule could fire there
                ax.plot([cut, end], [y, y], color=color, lw=1.0, ls=":", alpha=0.6)
            if o["blowup"] is not None:
                ax.plot(end, y, "x", color="tab:red", ms=7)
            for i, rule in enumerate(rules):
                f = v["first_fire"].get(rule)
                if f is not None:
                    ax.plot(f, y, markers[i % len(markers)], color=f"C{i}", ms=5, mfc="none")
        ax.set_yticks(range(len(runs)), [str(v["seed"]) for v in runs], fontsize=7)
        ax.set_xlabel("optimizer step")
        ax.set_title(title, fontsize=9)
        ax.grid(axis="x", alpha=0.3)
        proxies = [ax.plot([], [], markers[i % len(markers)], color=f"C{i}", ms=5, mfc="none", label=f"{rule} fires")[0]
                   for i, rule in enumerate(rules)]
        proxies.append(ax.plot([], [], color="gray", lw=1.0, ls=":", label="not measured (monitoring failed)")[0])
        ax.legend(handles=proxies, fontsize=7, loc="lower right")
    axes[0][0].set_ylabel("seed (red: blew up at x; green: survived)")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def markdown(result: dict) -> str:
    lines = ["| rule | threshold | detected / blow-ups | lead >= 1,000 | leads (steps) | false alarms / survivors | verdict |",
             "|---|---|---|---|---|---|---|"]
    for name, row in result["table"].items():
        leads = ", ".join(f"{x:,}" for x in row["leads"]) or "-"
        passes = row.get("verdict") or "-"
        lines.append(f"| `{name}` | {row['threshold']:.4g} | {row['detected']} / {row['blowups']} | "
                     f"{row[f'lead_ge_{MIN_LEAD}']} | {leads} | {row['false_alarms']} / {row['survivors']} | {passes} |")
    return "\n".join(lines)


def runs_markdown(result: dict) -> str:
    """One line per test run: seed, blow-up step, the confirmation (median of the last losses against
    the best before), steps run."""
    lines = ["| seed | blow-up step | confirmed (median of last 200 losses / best before) | steps run | measured through |",
             "|---|---|---|---|---|"]
    rows = sorted(result["runs"].values(), key=lambda v: v["seed"])
    for v in rows:
        o, m = v["outcome"], v.get("monitoring")
        if m is None:
            measured = "not checked"
        elif m["complete"]:
            measured = "every monitored step"
        else:
            measured = f"{m['measured_through']:,} ({m['failed_steps']:,} of {m['monitored_steps']:,} failed after)"
        if o["survivor"]:
            lines.append(f"| {v['seed']} | - (survived) | | {o['last_step'] + 1:,} | {measured} |")
        else:
            unconfirmed = "" if o.get("confirmed", True) else ", not confirmed"
            lines.append(f"| {v['seed']} | {o['blowup']:,}{unconfirmed} | {o['tail_median_loss']:.3f} / "
                         f"{o['best_median_before']:.3f} | {o['last_step'] + 1:,} | {measured} |")
    for e in result.get("excluded_unconfirmed", []):
        o = e["outcome"]
        lines.append(f"| {e['seed']} | {o['blowup']:,}, not confirmed (left out) | {o['tail_median_loss']:.3f} / "
                     f"{o['best_median_before']:.3f} | {o['last_step'] + 1:,} | |")
    for e in result.get("excluded_short", []):
        o = e["outcome"]
        ran = "-" if o["last_step"] is None else f"{o['last_step'] + 1:,}"
        lines.append(f"| {e['seed']} | no blow-up, stopped before {result['horizon']:,} steps (left out) | | {ran} | |")
    for e in result.get("excluded_incomplete", []):
        m = e["monitoring"]
        lines.append(f"| {e['seed']} | monitoring incomplete (left out) | | | "
                     f"{m['measured_through'] if m['measured_through'] is not None else '-'} |")
    return "\n".join(lines)


def readme_paragraph(result: dict, configuration: str) -> str:
    """The README's account of a test result, every number taken from ``result`` (a test holds the
    README equal to this text): runs, outcomes, each rule's and baseline's early detections, false
    alarms, and the verdict."""
    table = result["table"]
    any_row = next(iter(table.values()))
    n_b, n_s = any_row["blowups"], any_row["survivors"]
    key = f"lead_ge_{MIN_LEAD}"

    def count(name: str) -> str:
        row = table[name]
        fa = f" (false alarm{'s' if row['false_alarms'] != 1 else ''} in {row['false_alarms']} of {n_s})" \
            if row["false_alarms"] else ""
        return f"`{name}` {row[key]}{fa}"

    rules = sorted((r for r in RULES if r != "chain"), key=lambda r: (-table[r][key], r))
    verdicts = {table[r]["verdict"] for r in RULES}
    passed = [r for r in RULES if table[r]["verdict"] == "pass"]
    if passed:
        verdict = f"passed: {', '.join(f'`{r}`' for r in passed)} (now critical)."
    elif verdicts == {"fail"}:
        verdict = "no rule passed, so every alert stays a warning."
    else:
        undecided = [r for r in RULES if table[r]["verdict"] == "undecided"]
        verdict = (f"no rule has passed: {', '.join(f'`{r}`' for r in undecided)} cannot be judged with "
                   f"{n_s} survivor{'s' if n_s != 1 else ''} (the test needs {MIN_GROUP}), the others failed; "
                   "every alert stays a warning.")
    return (f"{configuration}: {n_b + n_s} runs, {n_b} blew up and {n_s} survived. Runs with an alert at least "
            f"{MIN_LEAD:,} steps before the blow-up, of {n_b}: " + ", ".join(count(r) for r in rules)
            + "; baselines: " + ", ".join(count(b) for b in ("qk_clip_100", "zclip_2.5", "zclip_calibrated"))
            + f". Verdict: {verdict}")


def _write(result: dict, text: str, out: str, markdown: str | None) -> int:
    """A result as JSON at ``out``, its table as Markdown (if asked) and on stdout."""
    Path(out).write_text(json.dumps(result, indent=1, default=str))
    if markdown:
        Path(markdown).write_text(text + "\n")
    print(text)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m research.early_warning", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("calibrate", help="thresholds from calibration runs")
    c.add_argument("runs", nargs="+")
    c.add_argument("--controls", nargs="*", default=[])
    c.add_argument("--out", required=True)
    t = sub.add_parser("test", help="the pre-registered evaluation of test runs")
    t.add_argument("runs", nargs="+")
    t.add_argument("--thresholds", required=True)
    t.add_argument("--out", required=True)
    t.add_argument("--markdown")
    t.add_argument("--require-complete", action="store_true",
                   help="leave out runs whose monitoring failed before their blow-up or end (the fourth protocol)")
    t.add_argument("--protocol", help="the protocol file this test was registered in, recorded in the result with "
                   "its commit (the result's 'protocol' is the one that froze the thresholds)")
    t.add_argument("--horizon", type=int, help="steps a survivor must have run (the ninth protocol: 10000); runs "
                   "without a blow-up that stopped sooner are left out and listed")
    q = sub.add_parser("ratio", help="blow-up step over a rule's first firing step, per run of a test result")
    q.add_argument("result")
    q.add_argument("--rule", default="chain", choices=RULES + BASELINES)
    q.add_argument("--factor", type=float, default=3.0)
    a = sub.add_parser("auc", help="the fourth protocol's threshold-free test: time-matched AUC per rule")
    a.add_argument("runs", nargs="+")
    a.add_argument("--thresholds", required=True, help="the frozen thresholds (the chain rule needs theta_coherence)")
    a.add_argument("--lead", type=int, default=1000)
    a.add_argument("--allow-incomplete", action="store_true",
                   help="older recordings: keep runs whose monitoring stopped, comparing pairs only where both were measured")
    a.add_argument("--out", required=True)
    a.add_argument("--markdown")
    lm = sub.add_parser("landmark", help="the fifth protocol's test: AUC against runs that stay healthy longer")
    lm.add_argument("runs", nargs="+")
    lm.add_argument("--thresholds", required=True, help="the frozen thresholds (the chain rule needs theta_coherence)")
    lm.add_argument("--lead", type=int, default=MIN_LEAD)
    lm.add_argument("--margin", type=int, default=LANDMARK_MARGIN)
    lm.add_argument("--out", required=True)
    lm.add_argument("--markdown")
    lm.add_argument("--protocol", help="the protocol file this test was registered in, recorded in the result with its commit")
    pl = sub.add_parser("pilot", help="a protocol's choice of rate from its pilots' outcomes results (research.pilot)")
    pl.add_argument("pilots", nargs="+", metavar="RATE=OUTCOMES.json")
    pl.add_argument("--protocol", type=int, default=8, choices=sorted(pilot.RULES),
                    help="whose pilot rule (default 8)")
    bl = sub.add_parser("blocks", help="whether a block-wise test runs another block, from its blocks' outcomes results "
                                       "(research.pilot.next_block)")
    bl.add_argument("blocks", nargs="+", metavar="OUTCOMES.json")
    bl.add_argument("--protocol", type=int, required=True, choices=sorted(pilot.BLOCK_RULES))
    oc = sub.add_parser("outcomes", help="each run's outcome and monitoring, no rule (before a protocol's analysis)")
    oc.add_argument("runs", nargs="+")
    oc.add_argument("--out", required=True)
    oc.add_argument("--markdown")
    g = sub.add_parser("figure", help="a timeline per test result: blow-ups, survivors, the rules' first firings")
    g.add_argument("results", nargs="+", help="RESULT.json or TITLE=RESULT.json")
    g.add_argument("--rules", default="chain,repeated_max_bf16_trend,max_logit")
    g.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if args.command == "figure":
        pairs = [(a.split("=", 1) if "=" in a else (a, a)) for a in args.results]
        rules = [r for r in args.rules.split(",") if r]
        unknown = [r for r in rules if r not in RULES + BASELINES]
        if unknown:
            raise SystemExit(f"unknown rule(s) {unknown}; accepted: {', '.join(RULES + BASELINES)}")
        timeline_figure([(title, json.loads(Path(path).read_text())) for title, path in pairs], rules, Path(args.out))
        print(f"wrote {args.out}")
        return 0
    if args.command == "blocks":
        try:
            blocks = [json.loads(Path(path).read_text()) for path in args.blocks]
        except (ValueError, OSError) as e:
            raise SystemExit(f"expected outcomes results (python -m research.early_warning outcomes): {e}")
        print(json.dumps(pilot.next_block(pilot.BLOCK_RULES[args.protocol], blocks), indent=1))
        return 0
    if args.command == "pilot":
        pilots = {}
        for item in args.pilots:
            rate, sep, path = item.partition("=")
            try:
                pilots[float(rate)] = json.loads(Path(path).read_text())
            except (ValueError, OSError) as e:
                raise SystemExit(f"{item}: expected RATE=OUTCOMES.json (e.g. 0.00125=pilot.json): {e}")
            if not sep or pilots[float(rate)].get("kind") != "outcomes":
                raise SystemExit(f"{item}: expected RATE=OUTCOMES.json, a result of 'early_warning outcomes'")
        try:
            choice = pilot.choose(pilot.RULES[args.protocol], pilots)
        except ValueError as e:
            raise SystemExit(str(e))
        print(json.dumps(choice, indent=1, default=str))
        return 0
    if args.command == "outcomes":
        result = outcomes(_runs(args.runs))
        return _write(result, outcomes_markdown(result), args.out, args.markdown)
    if args.command == "landmark":
        for name, value in (("--lead", args.lead), ("--margin", args.margin)):
            if value < 0:
                raise SystemExit(f"{name} must be >= 0 steps, got {value}")
        if args.protocol and not Path(args.protocol).is_file():
            raise SystemExit(f"--protocol {args.protocol}: no such file (a protocol under research/preregistration/)")
        result = landmark_auc(_runs(args.runs), json.loads(Path(args.thresholds).read_text()), args.lead, args.margin)
        result["thresholds_file"], result["thresholds_file_commit"] = args.thresholds, _file_commit(Path(args.thresholds))
        if args.protocol:
            result["test_protocol"], result["test_protocol_commit"] = args.protocol, _file_commit(Path(args.protocol))
        return _write(result, landmark_markdown(result), args.out, args.markdown)
    if args.command == "auc":
        if args.lead < 0:
            raise SystemExit(f"--lead must be >= 0 steps, got {args.lead}")
        result = time_matched_auc(_runs(args.runs), json.loads(Path(args.thresholds).read_text()), args.lead,
                                  args.allow_incomplete)
        return _write(result, auc_markdown(result), args.out, args.markdown)
    if args.command == "ratio":
        rows = blowup_ratios(json.loads(Path(args.result).read_text()), args.rule, args.factor)
        print(f"| seed | {args.rule} first fires | blow-up | b / f | blow-up by {args.factor:g} x f |")
        print("|---|---|---|---|---|")
        for r in rows:
            fmt = lambda x: "-" if x is None else f"{x:,}"
            holds = {True: "yes", False: "no", None: "-"}[r["holds"]] if r["first_fire"] is not None else "(no alarm)"
            if r["first_fire"] is not None and r["holds"] is None:
                holds = f"not decided (ran to {r['last_step'] + 1:,})"
            ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}"
            print(f"| {r['seed']} | {fmt(r['first_fire'])} | {fmt(r['blowup']) if r['blowup'] is not None else 'survived'} "
                  f"| {ratio} | {holds} |")
        return 0
    if args.command == "calibrate":
        result = calibrate(_runs(args.runs), _runs(args.controls) if args.controls else [])
        Path(args.out).write_text(json.dumps(result, indent=1, default=str))
        for r, v in result["thresholds"].items():
            print(f"{r:28s} {v:.6g}")
        return 0
    if args.protocol and not Path(args.protocol).is_file():
        raise SystemExit(f"--protocol {args.protocol}: no such file (a protocol under research/preregistration/)")
    if args.horizon is not None and args.horizon <= 0:
        raise SystemExit(f"--horizon must be a positive number of steps, got {args.horizon}")
    frozen = json.loads(Path(args.thresholds).read_text())
    result = evaluate(_runs(args.runs), frozen, require_complete=args.require_complete, horizon=args.horizon)
    result["thresholds_file"] = args.thresholds
    result["thresholds_file_commit"] = _file_commit(Path(args.thresholds))
    if args.protocol:
        result["test_protocol"], result["test_protocol_commit"] = args.protocol, _file_commit(Path(args.protocol))
    Path(args.out).write_text(json.dumps(result, indent=1, default=str))
    text = markdown(result)
    if args.markdown:
        Path(args.markdown).write_text(text + "\n\n" + runs_markdown(result) + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
