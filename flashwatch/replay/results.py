"""The results JSON: run summaries merged by key, with the aggregate per arm and the targets.

One JSON gathers the summaries of ``runs.analyze_run`` under ``scenario/arm/seed``, so runs
recorded at different times (other seeds, other GPUs) add up and a re-analysed or rerun run
replaces its key. ``merge_results`` recomputes, at every merge, the aggregate per scenario and
arm (``aggregate``), the targets (``evaluate_targets``) and the definitions, and writes the file
atomically. A scenario's target may ask for a least lead (``min_lead``: steps before every
blow-up); whoever defines the scenario says so at a merge, and the JSON keeps it (``"min_lead"``)
for later merges.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from pathlib import Path

from ..vocabulary import RULES
from .baselines import BASELINES
from .blowup import BLOWUP_FACTOR, BLOWUP_PATIENCE, BLOWUP_WINDOW
from .records import read_steps, write_json_atomic
from .runs import EARLY_RULES, FINAL_WINDOW, MECHANISM_RULES, _finite_mean, _healthy_reference, _median

__all__ = ["load_results", "merge_results", "aggregate", "evaluate_targets"]


def load_results(path: Path) -> dict:
    """The results JSON at ``path``, or {} where there is none yet."""
    if path.exists():
        with open(path) as f:
            return json.load(f)
    return {}


def _kept_min_lead(data: dict) -> dict[str, int]:
    """The least lead per scenario a results JSON's targets ask for (``{scenario: steps}``): its
    ``"min_lead"``, or, in a JSON written before that key, what its targets quote."""
    kept = {scenario: t["lead_at_least"]["steps"] for scenario, t in data.get("targets", {}).items()
            if isinstance(t, dict) and "lead_at_least" in t}
    kept.update(data.get("min_lead", {}))
    return kept


def merge_results(path: Path, summaries: list[dict], extra: dict | None = None,
                  min_lead: dict[str, int] | None = None) -> dict:
    """Merge run summaries into the results JSON at ``path`` (by key), recompute aggregates, write atomically.

    ``min_lead``: ``{scenario: steps}``, the least lead the scenario's target asks for; added to
    what the JSON already keeps."""
    data = load_results(path)
    runs = data.get("runs", {})
    leads = {**_kept_min_lead(data), **(min_lead or {})}
    for s in summaries:
        runs[s["key"]] = s
    data.update({
        "schema": 1, "kind": "flashwatch-experiments",
        "updated": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "definitions": {
            "blowup": f"a non-finite loss (that step), or the median of the last {BLOWUP_WINDOW} losses >= "
                      f"{BLOWUP_FACTOR} x its lowest earlier value at {BLOWUP_PATIENCE} consecutive steps (the "
                      "blow-up step: the first loss >= that threshold in the window where it began)",
            "lead": "blow-up step - first alert step (positive: the alert came first)",
            "flashwatch_first": f"first alert of the rules {', '.join(EARLY_RULES)}",
            "flashwatch_mechanism_first": f"first alert of the rules {', '.join(MECHANISM_RULES)} "
                                          "(without max_logit, the QK-Clip criterion)",
            "final_loss": f"mean of the last {FINAL_WINDOW} recorded losses",
            "injected": "runs whose attention carries the INJECTED fault (flashwatch.kernels.faults.rounding_bias): "
                        "not a real failure",
        },
        "runs": dict(sorted(runs.items())),
    })
    if leads:
        data["min_lead"] = dict(sorted(leads.items()))
    data["aggregate"] = aggregate(data["runs"])
    data["targets"] = evaluate_targets(data["runs"], min_lead=leads)
    if extra:
        data.update(extra)
    write_json_atomic(path, data)
    return data


def _loss_at(run: dict, step: int) -> float | None:
    """Mean recorded loss over the FINAL_WINDOW steps ending at ``step`` (needs the run folder)."""
    run_dir = run.get("run_dir")
    if not run_dir or not Path(run_dir).exists():
        return None
    s = read_steps(run_dir)
    sel = [l for st, l in zip(s["step"].tolist(), s["loss"].tolist()) if step - FINAL_WINDOW < st <= step]
    return _finite_mean(sel) if sel else None


def aggregate(runs: dict[str, dict]) -> dict:
    """Per scenario and arm: counts, blow-up steps, first alerts, lead times, false alarms, final loss."""
    out: dict[str, dict] = {}
    for run in sorted(runs.values(), key=lambda r: (r["scenario"], r["arm"], r["seed"])):
        if run.get("summary_error") or run.get("status") == "paused":  # paused: a piece, no outcome yet
            continue
        a = out.setdefault(run["scenario"], {}).setdefault(run["arm"], {
            "label": run.get("label"), "injected": run.get("injected"), "expect": run.get("expect"),
            "seeds": [], "blown_up": 0, "blowup_steps": [], "flashwatch_leads": [], "mechanism_leads": [],
            "baseline_leads": {b: [] for b in BASELINES}, "healthy_runs_with_alerts": 0, "healthy_runs": 0,
            "final_losses": [], "last_steps": [], "errors": 0})
        a["seeds"].append(run["seed"])
        if run.get("status") == "error":
            a["errors"] += 1
        a["final_losses"].append(run.get("final_loss"))
        a["last_steps"].append(run.get("last_step"))
        if run.get("blowup_step") is not None:
            a["blown_up"] += 1
            a["blowup_steps"].append(run["blowup_step"])
            a["flashwatch_leads"].append(run["flashwatch_first"].get("lead"))
            a["mechanism_leads"].append(run["flashwatch_mechanism_first"].get("lead"))
            for b in BASELINES:
                a["baseline_leads"][b].append(run["baselines"][b]["lead"])
        else:
            a["healthy_runs"] += 1
            if any(run["flashwatch"][rule]["count"] for rule in RULES):
                a["healthy_runs_with_alerts"] += 1
    for arms in out.values():
        for a in arms.values():
            a["median_blowup"] = _median(a["blowup_steps"])
            a["median_lead"] = _median(a["flashwatch_leads"])
            a["median_mechanism_lead"] = _median(a["mechanism_leads"])
            a["median_baseline_lead"] = {b: _median(v) for b, v in a["baseline_leads"].items()}
            finite = [x for x in a["final_losses"] if isinstance(x, float) and math.isfinite(x)]
            a["mean_final_loss"] = statistics.fmean(finite) if finite else None
    return out


def evaluate_targets(runs: dict[str, dict], min_lead: dict[str, int] | None = None) -> dict:
    """The experiments' targets per scenario, with the numbers behind each verdict.

    - every blown-up run has a flashwatch alert (mechanism rules) before its blow-up
      (and at least ``min_lead[scenario]`` steps before, where given);
    - that alert is earlier than every baseline's first alert (a baseline that never fired
      counts as later); baselines that also fire on healthy runs are marked;
    - no flashwatch alert (any rule) on healthy reference runs (arms meant to stay healthy that
      did not blow up and were not switched); failure arms that did not blow up are listed apart;
    - auto_fix arms (``expect == "rescued"``): no blow-up, and the final loss within 10% of the
      scenario's healthy non-injected runs of the same seeds at a common step.
    """
    min_lead = min_lead or {}
    out: dict[str, dict] = {}
    by_scenario: dict[str, list] = {}
    for run in runs.values():
        if not run.get("summary_error"):
            by_scenario.setdefault(run["scenario"], []).append(run)
    for scenario, rs in sorted(by_scenario.items()):
        blown = [r for r in rs if r.get("blowup_step") is not None]
        quiet = [r for r in rs if _healthy_reference(r)]
        unexpected = [r["key"] for r in rs if r.get("blowup_step") is None and r.get("expect") == "failure"]
        before = [r for r in blown if (r["flashwatch_mechanism_first"].get("lead") or -1) > 0]
        need = min_lead.get(scenario)
        enough = [r for r in blown if (r["flashwatch_mechanism_first"].get("lead") or -1) >= (need or 1)]
        earlier = {}
        for b in BASELINES:
            wins = 0
            for r in blown:
                fw, bl = r["flashwatch_mechanism_first"].get("step"), r["baselines"][b]["first"]
                if fw is not None and (bl is None or fw < bl):
                    wins += 1
            fa = sum(1 for r in quiet if r["baselines"][b]["count"])
            earlier[b] = {"flashwatch_earlier": wins, "of": len(blown), "healthy_runs_where_baseline_fired": fa,
                          "of_healthy": len(quiet)}
        false_alarms = {rule: sum(1 for r in quiet if r["flashwatch"][rule]["count"]) for rule in RULES}
        rescued = [r for r in rs if r.get("expect") == "rescued"]
        controls = [r for r in rs if r.get("expect") == "healthy" and not r.get("injected")
                    and r.get("blowup_step") is None]
        rescue_rows = []
        for r in rescued:
            peers = [c for c in controls if c["seed"] == r["seed"]] or controls
            row = {"key": r["key"], "blowup_step": r.get("blowup_step"), "switches": len(r.get("switches") or []),
                   "first_switch": (r.get("switches") or [{}])[0].get("step"), "loss_ratio": None}
            if peers and r.get("last_step") is not None:
                common = min([r["last_step"]] + [c["last_step"] for c in peers if c.get("last_step") is not None])
                mine = _loss_at(r, common)
                theirs = [x for x in (_loss_at(c, common) for c in peers) if x is not None and math.isfinite(x)]
                if mine is not None and theirs:
                    row["loss_ratio"] = mine / statistics.fmean(theirs)
                    row["at_step"] = common
            row["ok"] = r.get("blowup_step") is None and row["loss_ratio"] is not None and row["loss_ratio"] <= 1.10
            rescue_rows.append(row)
        out[scenario] = {
            "blown_up_runs": len(blown),
            "alert_before_blowup": {"runs": len(before), "of": len(blown)},
            **({"lead_at_least": {"steps": need, "runs": len(enough), "of": len(blown)}} if need else {}),
            "earlier_than_baseline": earlier,
            "healthy_runs": len(quiet),
            "failure_arm_runs_without_blowup": unexpected,
            "healthy_runs_with_flashwatch_alerts": sum(1 for r in quiet if any(r["flashwatch"][x]["count"]
                                                                                for x in RULES)),
            "healthy_runs_with_alerts_by_rule": false_alarms,
            "auto_fix": rescue_rows,
        }
    return out
