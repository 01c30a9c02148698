"""The sixth pre-registered test (research/preregistration/early-warning-protocol-6.md): does
``auto_fix`` prevent the blow-ups of the seed-split configuration, and what does it cost?

    python -m research.auto_fix_effect FIX_RUNS... --twins TWIN_RUNS... --out R.json [--markdown R.md]
        [--label NAME --min-cases N --min-prevented SHARE]   (other treatments: the seventh protocol's controls)
        [--min-steps 10000 --loss-before-end]                 (the tenth protocol: runs that end at 10,000 steps)

FIX_RUNS: runs of the arm ``auto_fix_lr0.0015``; TWIN_RUNS: the same seeds' runs of
``sdpa_observe_lr0.0015`` (the fourth protocol's), folders or folders holding them. Runs are
paired by seed. Every definition is the protocol's: a blow-up and its confirmation are
``research.early_warning.outcome``'s; a twin's blow-up is prevented when the fix run of its seed
has none to ``MIN_STEPS``; the loss cost is the fix run's median loss over ``LOSS_WINDOW`` over
its twin's (a window before every twin's blow-up), and for a twin that survived also over
``LATE_WINDOW``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from flashwatch.replay.records import read_run, read_steps
from research.early_warning import _commit, _file_commit, _runs, outcome

MIN_STEPS = 13_000  # a fix run that never blew up must have trained this far to count as prevented
LOSS_WINDOW = (7_000, 8_000)  # [start, end): before the earliest twin blow-up (8,396)
LATE_WINDOW = (12_000, 13_000)  # the survivors' cost, near the fix runs' end
SPEED_SPAN = 1_000  # ms/step over this many steps before the first switch and after switch + SPEED_SPAN
MIN_PREVENTED = 0.8  # the claim: at least this share of the twins' confirmed blow-ups prevented ...
MIN_CASES = 5  # ... out of at least this many


def median_loss(steps: dict, window: tuple[int, int]) -> float | None:
    """The median of the recorded losses at steps in [start, end), or None if none was recorded."""
    keep = (steps["step"] >= window[0]) & (steps["step"] < window[1])
    return float(np.median(steps["loss"][keep])) if keep.any() else None


def ms_per_step(steps: dict, start: int, end: int) -> float | None:
    """Wall time per step over [start, end) from the recorded times (None if the run has not both ends)."""
    s, t = steps["step"], steps["time_s"]
    at = {int(a): float(b) for a, b in zip(s, t)}
    if start not in at or end not in at or end <= start:
        return None
    return 1000.0 * (at[end] - at[start]) / (end - start)


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def loss_window_of(twin: dict, loss_window: tuple[int, int] | None, min_steps: int) -> tuple[int, int]:
    """The steps whose losses the pair compares: ``loss_window``, or with None the ``SPEED_SPAN``
    steps before the twin's end (its blow-up, or ``min_steps`` for a twin that survived: the
    loss a finished training keeps)."""
    if loss_window is not None:
        return loss_window
    end = twin["blowup"] if twin["blowup"] is not None else min_steps
    return (max(0, end - SPEED_SPAN), end)


def pair(fix_dir: Path, twin_dir: Path, min_steps: int = MIN_STEPS, loss_window: tuple[int, int] | None = LOSS_WINDOW,
         late_window: tuple[int, int] | None = LATE_WINDOW) -> dict:
    """One seed: both outcomes, the fix run's switches, whether the twin's blow-up was prevented (no
    blow-up of the fix run through ``min_steps``), the loss ratios (``loss_window_of``; and, for a
    twin that survived, over ``late_window`` when given) and the fix run's speed around its first switch."""
    fix_info, fix_steps, twin_steps = read_run(fix_dir), read_steps(fix_dir), read_steps(twin_dir)
    fix, twin = outcome(fix_dir), outcome(twin_dir)
    switches = sorted(fix_info.get("switches") or [], key=lambda s: s["step"])
    first = switches[0]["step"] if switches else None
    case = twin["blowup"] is not None and twin["confirmed"]
    long_enough = fix["last_step"] is not None and fix["last_step"] >= min_steps - 1
    window = loss_window_of(twin, loss_window, min_steps)
    prevented = bool(fix["survivor"] and long_enough) if case else None
    row = {"seed": fix_info.get("seed"), "fix_dir": str(fix_dir), "twin_dir": str(twin_dir),
           "twin": twin, "fix": fix, "case": case, "prevented": prevented,
           "fix_complete": bool(long_enough or not fix["survivor"]),
           "first_switch": first, "switches": [{k: s.get(k) for k in ("step", "layer", "rule", "to")} for s in switches],
           "switched_before_twin_blowup": (first is not None and twin["blowup"] is not None and first < twin["blowup"]),
           "loss_window": window, "loss_ratio": _ratio(median_loss(fix_steps, window), median_loss(twin_steps, window)),
           "late_loss_ratio": None,
           "ms_per_step_before_switch": None, "ms_per_step_after_switch": None}
    if twin["survivor"] and late_window is not None:
        row["late_loss_ratio"] = _ratio(median_loss(fix_steps, late_window), median_loss(twin_steps, late_window))
    if first is not None:
        row["ms_per_step_before_switch"] = ms_per_step(fix_steps, max(0, first - SPEED_SPAN), first)
        row["ms_per_step_after_switch"] = ms_per_step(fix_steps, first + SPEED_SPAN, first + 2 * SPEED_SPAN)
    return row


def evaluate(fix_dirs: list[Path], twin_dirs: list[Path], label: str = "auto_fix", min_cases: int = MIN_CASES,
             min_prevented: float = MIN_PREVENTED, min_steps: int = MIN_STEPS,
             loss_window: tuple[int, int] | None = LOSS_WINDOW, late_window: tuple[int, int] | None = LATE_WINDOW
             ) -> dict:
    """Pair the runs by seed and apply the protocol's claim: ``label`` names the treatment of the
    fix runs (auto_fix, or a control arm), the claim needs ``min_prevented`` of at least
    ``min_cases`` confirmed twin blow-ups prevented. ``min_steps``, ``loss_window`` and
    ``late_window`` default to the sixth protocol's (``pair``; the tenth: 10,000, None, None)."""
    twins = {read_run(d).get("seed"): d for d in twin_dirs}
    fixes = {read_run(d).get("seed"): d for d in fix_dirs}
    unpaired = sorted(set(twins) ^ set(fixes), key=str)
    rows = [pair(fixes[s], twins[s], min_steps, loss_window, late_window) for s in sorted(set(twins) & set(fixes), key=str)]
    cases = [r for r in rows if r["case"]]
    prevented = sum(1 for r in cases if r["prevented"])
    incomplete = [r["seed"] for r in rows if not r["fix_complete"]]
    ratios = [r["loss_ratio"] for r in rows if r["loss_ratio"] is not None]
    survivors = [r for r in rows if r["twin"]["survivor"]]
    kept = [r["loss_ratio"] for r in survivors if r["loss_ratio"] is not None]
    if incomplete or len(cases) < min_cases:
        verdict = "undecided"
    else:
        verdict = "shown" if prevented >= min_prevented * len(cases) else "not shown"
    return {"kind": "auto_fix_effect", "label": label, "evaluated": time.strftime("%Y-%m-%d"), "commit": _commit(),
            "definitions": {"min_steps": min_steps, "loss_window": loss_window, "late_window": late_window,
                            "speed_span": SPEED_SPAN, "min_prevented": min_prevented, "min_cases": min_cases},
            "pairs": rows, "unpaired_seeds": unpaired, "incomplete_fix_runs": incomplete,
            "cases": len(cases), "prevented": prevented, "verdict": verdict,
            "switched_runs": sum(1 for r in rows if r["first_switch"] is not None),
            "loss_ratio_mean": statistics.fmean(ratios) if ratios else None,
            "loss_ratio_range": [min(ratios), max(ratios)] if ratios else None,
            # the twins that survived: how many of their fix runs switched, what their loss cost, and the harm
            # done where a fix run blew up (confirmed) while its twin did not
            "survivors": len(survivors), "switched_survivors": sum(1 for r in survivors if r["first_switch"] is not None),
            "survivor_loss_ratio_mean": statistics.fmean(kept) if kept else None,
            "survivor_loss_ratio_range": [min(kept), max(kept)] if kept else None,
            "harmed": sorted((r["seed"] for r in survivors if r["fix"]["blowup"] is not None and r["fix"]["confirmed"]),
                             key=str)}


def _window_text(window) -> str:
    if window is None:
        return f"over the {SPEED_SPAN:,} steps before the twin's blow-up or end"
    return f"over steps {window[0]:,}-{window[1]:,}"


def markdown(result: dict) -> str:
    """The verdict line, then one row per seed."""
    fmt = lambda x, f="{:,}": "-" if x is None else f.format(x)
    label = result.get("label", "auto_fix")
    registered = (f"Registered in `{result['test_protocol']}` (commit {result['test_protocol_commit']}); code "
                  f"{result['commit']}.\n\n" if result.get("test_protocol") else "")
    head = registered + (f"{label} prevented {result['prevented']} of {result['cases']} confirmed blow-ups of the twins: "
            f"**{result['verdict']}** (the claim needs >= {result['definitions']['min_prevented']:.0%} of at least "
            f"{result['definitions']['min_cases']}). Switched in {result['switched_runs']} of {len(result['pairs'])} runs. "
            f"Loss {_window_text(result['definitions']['loss_window'])}, "
            f"fix / twin: mean {fmt(result['loss_ratio_mean'], '{:.4f}')}.")
    if result.get("survivors"):
        rng = result["survivor_loss_ratio_range"]
        head += (f" Twins that survived: {result['survivors']}, of which {result['switched_survivors']} switched; their "
                 f"loss ratio mean {fmt(result['survivor_loss_ratio_mean'], '{:.4f}')}"
                 f"{'' if rng is None else f' ({rng[0]:.4f}-{rng[1]:.4f})'}; a fix run that blew up where its twin did "
                 f"not: {', '.join(map(str, result['harmed'])) or 'none'}.")
    lines = [head, "", f"| seed | twin (SDPA) | {label} run | first switch (layers) | loss ratio | late loss ratio "
             "| ms/step before / after switch |", "|---|---|---|---|---|---|---|"]
    for r in result["pairs"]:
        def told(o):
            if o["survivor"]:
                return f"survived to {o['last_step'] + 1:,}"
            return f"blew up at {o['blowup']:,}" + ("" if o["confirmed"] else " (not confirmed)")
        layers = ",".join(str(s["layer"]) for s in r["switches"])
        lines.append(f"| {r['seed']} | {told(r['twin'])} | {told(r['fix'])} | {fmt(r['first_switch'])} ({layers or '-'}) "
                     f"| {fmt(r['loss_ratio'], '{:.4f}')} | {fmt(r['late_loss_ratio'], '{:.4f}')} "
                     f"| {fmt(r['ms_per_step_before_switch'], '{:.1f}')} / {fmt(r['ms_per_step_after_switch'], '{:.1f}')} |")
    if result["unpaired_seeds"]:
        lines += ["", f"Left out (no run of the other arm): seeds {result['unpaired_seeds']}."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m research.auto_fix_effect", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", help="the auto_fix runs (or a control arm's: --label)")
    p.add_argument("--twins", nargs="+", required=True, help="the same seeds' SDPA runs")
    p.add_argument("--out", required=True)
    p.add_argument("--markdown")
    p.add_argument("--label", default="auto_fix", help="the treatment's name in the result (default auto_fix)")
    p.add_argument("--min-cases", type=int, default=MIN_CASES, help=f"cases the claim needs (default {MIN_CASES})")
    p.add_argument("--min-prevented", type=float, default=MIN_PREVENTED,
                   help=f"share of the cases to prevent (default {MIN_PREVENTED})")
    p.add_argument("--protocol", help="the protocol file this analysis was registered in, recorded with its commit")
    p.add_argument("--min-steps", type=int, default=MIN_STEPS,
                   help=f"steps a fix run must train without a blow-up to prevent its twin's (default {MIN_STEPS:,})")
    p.add_argument("--loss-before-end", action="store_true",
                   help=f"compare the losses over the {SPEED_SPAN:,} steps before each twin's blow-up or end (the "
                        f"tenth protocol) instead of steps {LOSS_WINDOW[0]:,}-{LOSS_WINDOW[1]:,} and, for survivors, "
                        f"{LATE_WINDOW[0]:,}-{LATE_WINDOW[1]:,}")
    args = p.parse_args(argv)
    if args.min_steps < 1:
        raise SystemExit(f"--min-steps must be >= 1, got {args.min_steps}")
    if args.protocol and not Path(args.protocol).is_file():
        raise SystemExit(f"--protocol {args.protocol}: no such file (a protocol under research/preregistration/)")
    if args.min_cases < 1 or not 0.0 < args.min_prevented <= 1.0:
        raise SystemExit(f"--min-cases must be >= 1 and --min-prevented in (0, 1] "
                         f"(got {args.min_cases} and {args.min_prevented})")
    windows = (None, None) if args.loss_before_end else (LOSS_WINDOW, LATE_WINDOW)
    result = evaluate(_runs(args.runs), _runs(args.twins), args.label, args.min_cases, args.min_prevented,
                      args.min_steps, *windows)
    if not result["pairs"]:
        raise SystemExit(f"no seed has a run in both groups (auto_fix runs' and twins' seeds differ: "
                         f"{result['unpaired_seeds']})")
    if args.protocol:
        result["test_protocol"], result["test_protocol_commit"] = args.protocol, _file_commit(Path(args.protocol))
    text = markdown(result)
    Path(args.out).write_text(json.dumps(result, indent=1, default=str))
    if args.markdown:
        Path(args.markdown).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
