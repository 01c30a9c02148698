"""Text of the replay's results: the run table, the targets, the calibration evidence.

Each function returns text (the command line prints it): ``format_table`` (one row per run,
plain or Markdown), ``format_targets`` (one line per scenario of a results JSON),
``format_calibration`` (margins and sweeps of ``calibration.calibrate``).
"""

from __future__ import annotations

import math
from typing import Any

from ..vocabulary import INJECTED, RULES
from .baselines import BASELINES

__all__ = ["format_table", "format_targets", "format_calibration"]


def _s(x: Any, width: int = 0) -> str:
    if x is None:
        text = "-"
    elif isinstance(x, float):
        text = f"{x:.3g}" if math.isfinite(x) else ("inf" if x > 0 else "nan")
    else:
        text = str(x)
    return text.rjust(width) if width else text


def format_table(runs: dict[str, dict], markdown: bool = False) -> str:
    """One row per run: status, blow-up, flashwatch's first alerts and leads, baselines, final loss."""
    head = ["run", "status", "steps", "blow-up", "fw first (rule)", "lead", "fw mech.", "lead", "loss_spike",
            "zclip", "qk_clip", "fw alerts", "mon. errors", "final"]
    lines = []
    for r in sorted(runs.values(), key=lambda r: (r["scenario"], r["arm"], r["seed"])):
        if r.get("summary_error"):
            lines.append([f"{r['key']}", "unreadable", *["-"] * (len(head) - 2)])
            continue
        fw, mech = r["flashwatch_first"], r["flashwatch_mechanism_first"]
        name = f"{r['scenario']}/{r['arm']}/{r['seed']}"
        if r.get("injected"):
            name += f" [{INJECTED} x{r.get('inject_strength') or 0:g}]"
        lines.append([
            name, r.get("status") or "?", _s(r.get("last_step")), _s(r.get("blowup_step")),
            f"{_s(fw.get('step'))} {fw.get('rule') or ''}".strip(), _s(fw.get("lead")),
            f"{_s(mech.get('step'))}", _s(mech.get("lead")),
            *(_s(r["baselines"][b]["first"]) + (f" ({r['baselines'][b]['count']})" if r["baselines"][b]["count"] > 1
                                                 else "") for b in BASELINES),
            _s(sum(r["flashwatch"][x]["count"] for x in RULES)),
            # monitored steps whose monitoring failed: their rules did not run (never read them as quiet)
            _s(r.get("monitor_errors")), _s(r.get("final_loss")),
        ])
    if markdown:
        out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        out += ["| " + " | ".join(row) + " |" for row in lines]
        return "\n".join(out)
    widths = [max(len(h), *(len(row[i]) for row in lines)) if lines else len(h) for i, h in enumerate(head)]
    fmt = lambda row: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
    return "\n".join([fmt(head)] + [fmt(row) for row in lines])


def format_targets(results: dict, scenarios: set | None = None) -> str:
    """One line per scenario of ``results["targets"]`` (only ``scenarios`` where given)."""
    lines = []
    for name, t in results.get("targets", {}).items():
        if scenarios is not None and name not in scenarios:
            continue
        b = t["alert_before_blowup"]
        line = (f"{name}: flashwatch (mechanism rules) alerted before blow-up in {b['runs']}/{b['of']} blown-up runs; "
                + "; ".join(f"earlier than {k} in {v['flashwatch_earlier']}/{v['of']}"
                            f" ({k} fired on {v['healthy_runs_where_baseline_fired']}/{v['of_healthy']} healthy runs)"
                            for k, v in t["earlier_than_baseline"].items())
                + f"; healthy runs with a flashwatch alert: {t['healthy_runs_with_flashwatch_alerts']}/"
                  f"{t['healthy_runs']}")
        if t.get("failure_arm_runs_without_blowup"):
            line += f"; failure-arm runs that did not blow up: {', '.join(t['failure_arm_runs_without_blowup'])}"
        if "lead_at_least" in t:
            la = t["lead_at_least"]
            line += f"; lead >= {la['steps']} steps in {la['runs']}/{la['of']}"
        for row in t.get("auto_fix", []):
            ratio = row.get("loss_ratio")
            line += (f"; {row['key']}: blow-up {row['blowup_step']}, {row['switches']} switch(es), final loss "
                     f"{'-' if ratio is None else f'{ratio:.3f}'} x healthy")
        lines.append(line)
    return "\n".join(lines)


def format_calibration(cal: dict) -> str:
    """The calibration evidence as text: per statistic the healthy maximum against the failing
    runs' smallest maximum before blow-up, then each sweep's rows (* marks the default)."""
    lines = [f"calibration over {cal['runs']} runs (healthy: arms meant to stay healthy, no blow-up, no auto-fix "
             "switch)",
             f"  {'statistic':24s} {'healthy max':>12s} {'failing min(max before blow-up)':>32s} {'margin':>7s}"]
    for k, v in cal["extremes"].items():
        h, f = v["healthy_max"], v["failing_min_of_max_before_blowup"]
        lines.append(f"  {k:24s} {('%.4g' % h['max']) if h else '-':>12s} "
                     f"{('%.4g' % f['min_of_max']) if f else '-':>32s} "
                     f"{('%.3g' % v['margin']) if v['margin'] else '-':>7s}")
    for title, sweeps in (("", cal["sweeps"]), ("baseline ", cal.get("baseline_sweeps", {}))):
        for field, rows in sweeps.items():
            cells = []
            for r in rows:
                mark = "*" if r.get("default") else ""
                cells.append(f"{r['value']:g}{mark}: {r['blown_up_alerted_before']}/{r['blown_up']} before"
                             f" (median lead {r['median_lead']}, min {r['min_lead']}), "
                             f"{r['healthy_with_alert']}/{r['healthy']} healthy alerted")
            lines.append(f"  {title}{field}: " + " | ".join(cells))
    return "\n".join(lines)
