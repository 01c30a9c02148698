"""flashwatch experiment: replay the detectors on recorded runs, and calibrate their thresholds.

Commands
  flashwatch experiment analyze PATH...   replay detectors and baselines on recorded runs

What a recorded run is. A run folder holds every optimizer step's loss and gradient norm
(steps.csv), every monitored step's per-head signals (signals.jsonl.gz: delta error e_t, C_T,
drift z, windowed z, repeated-max counts on FP32 and BF16 scores, max logit, W^Q spectral
norm, variants, alerts) and run.json (what was trained, the Monitor's configuration, the alerts
it raised); flashwatch.replay.records describes the format. The experiment harness of the
repository (research/, docs/EXPERIMENTS.md) records such runs.

Analyze. `analyze` reads run folders (or the folders a results JSON names) and replays the
detectors WITHOUT retraining: with MonitorConfig's defaults (whatever flashwatch/config.py says
now), or with --set FIELD=VALUE overrides. Per run it reports the blow-up step, every rule's
first alert, the baselines' first alerts (Lightning-style loss spike, ZClip grad-norm z,
QK-Clip max logit > 100), lead times and the final loss; it checks that the run's own
configuration, replayed, gives the alerts the Monitor raised in training.

Blow-up: a non-finite loss, or the median of the last 20 losses at >= 1.25x its lowest earlier
value for 20 consecutive steps (the blow-up step is where that excursion starts; see
flashwatch/replay/blowup.py for why). Lead time = blow-up step - first alert step.

Results. --json merges the analysed runs into ONE JSON keyed by scenario/arm/seed (runs
recorded at different times add up; a re-analysed run replaces its key), with per-arm
aggregates and the targets (--min-lead SCENARIO=STEPS: the targets also ask every blow-up of
that scenario to be warned at least STEPS steps ahead; the JSON keeps it for later merges);
--calibrate sweeps thresholds and writes the evidence behind MonitorConfig's defaults.

Examples
  flashwatch experiment analyze runs/experiments --json results/early-warning.json \\
      --calibrate results/calibration.json
  flashwatch experiment analyze runs/experiments --set drift_threshold=3
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..cli import run_subcommand

__all__ = ["main", "build_parser", "parse_overrides", "parse_min_leads"]

EPILOG = "Run `flashwatch experiment analyze --help` for its options."


def _value(text: str):
    low = text.lower()
    if low in ("none", "null"):
        return None
    if low in ("true", "false"):
        return low == "true"
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
    return text


def parse_overrides(items: list[str] | None, option: str = "--set") -> dict:
    """``["FIELD=VALUE", ...]`` -> ``MonitorConfig`` overrides (values typed); a bad field or value
    exits with a message naming it."""
    out = {}
    for item in items or ():
        if "=" not in item:
            raise SystemExit(f"{option} takes FIELD=VALUE (a MonitorConfig field), got {item!r}")
        k, v = item.split("=", 1)
        out[k.strip()] = _value(v.strip())
    if out:
        import dataclasses

        from ..config import MonitorConfig

        fields = sorted(f.name for f in dataclasses.fields(MonitorConfig))
        unknown = sorted(set(out) - set(fields))
        if unknown:
            raise SystemExit(f"{option}: MonitorConfig has no field {', '.join(unknown)}; fields: {', '.join(fields)}")
        try:
            MonitorConfig(**out)  # fail early, naming the value
        except (TypeError, ValueError) as exc:
            raise SystemExit(f"{option}: {exc}") from None
    return out


def parse_min_leads(items: list[str] | None) -> dict[str, int]:
    """``["SCENARIO=STEPS", ...]`` -> ``{scenario: steps}``; a malformed item exits with a message naming it."""
    out = {}
    for item in items or ():
        scenario, _, steps = item.partition("=")
        try:
            value = int(steps)
        except ValueError:
            value = 0
        if not scenario.strip() or value < 1:
            raise SystemExit(f"--min-lead takes SCENARIO=STEPS (a scenario name and a whole number of steps >= 1), "
                             f"got {item!r}")
        out[scenario.strip()] = value
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flashwatch experiment", description=__doc__, epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    p = sub.add_parser("analyze", help="replay detectors and baselines on recorded runs (no training)",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       description="Replay on recorded runs. PATH: a run folder, a folder of run folders, or a "
                                   "results JSON (its runs' folders are read where they exist).\n"
                                   "Thresholds: MonitorConfig's defaults, or --set FIELD=VALUE (repeatable), e.g. "
                                   "--set drift_threshold=3 --set warmup=50.")
    p.add_argument("paths", nargs="+", metavar="PATH")
    p.add_argument("--set", action="append", metavar="FIELD=VALUE", help="MonitorConfig override for the replay")
    p.add_argument("--json", metavar="PATH", help="merge the re-analysed runs into this results JSON")
    p.add_argument("--min-lead", action="append", metavar="SCENARIO=STEPS",
                   help="with --json: the targets ask for a lead of at least STEPS steps on SCENARIO's blow-ups "
                        "(repeatable; kept in the JSON)")
    p.add_argument("--calibrate", metavar="PATH", help="write the calibration evidence (JSON) to PATH and print it")
    p.add_argument("--markdown", metavar="PATH", help="write the run table as Markdown to PATH")
    p.set_defaults(func=_cmd_analyze)
    return parser


def print_results(results: dict, keys: set | None = None) -> None:
    """The run table of ``results["runs"]`` (only ``keys`` where given), then the targets of their scenarios."""
    from .tables import format_table, format_targets

    runs = {k: v for k, v in results.get("runs", {}).items() if keys is None or k in keys}
    print()
    print(format_table(runs))
    targets = format_targets(results, {r["scenario"] for r in runs.values()})
    if targets:
        print(targets)


def run_folders(paths: list[str], prog: str = "flashwatch experiment analyze") -> list[Path] | None:
    """The run folders named by ``paths`` (run folders, folders of them, results JSONs), sorted;
    None (after saying why) if a path does not exist or no run folder is found."""
    from .runs import find_runs

    run_dirs: list[Path] = []
    for p in paths:
        path = Path(p)
        if path.is_file() and path.suffix == ".json":
            with open(path) as f:
                data = json.load(f)
            run_dirs += [Path(r["run_dir"]) for r in data.get("runs", {}).values()
                         if r.get("run_dir") and (Path(r["run_dir"]) / "run.json").exists()]
        elif path.exists():
            run_dirs += find_runs(path)
        else:
            print(f"{prog}: {p} does not exist", file=sys.stderr)
            return None
    run_dirs = sorted(set(run_dirs))
    if not run_dirs:
        print(f"{prog}: no run folders (with run.json) found", file=sys.stderr)
        return None
    return run_dirs


def _cmd_analyze(args) -> int:
    from .calibration import calibrate
    from .records import write_json_atomic
    from .results import merge_results
    from .runs import analyze_run
    from .tables import format_calibration, format_table

    overrides = parse_overrides(args.set)
    min_lead = parse_min_leads(args.min_lead)
    if min_lead and not args.json:
        raise SystemExit("--min-lead sets a target of the results JSON: it needs --json PATH")
    run_dirs = run_folders(args.paths)
    if run_dirs is None:
        return 2
    summaries = []
    for d in run_dirs:
        try:
            summaries.append(analyze_run(d, overrides))
        except Exception as exc:
            print(f"  {d}: cannot analyse ({type(exc).__name__}: {exc})", file=sys.stderr)
    runs = {s["key"]: s for s in summaries}
    if overrides:
        print(f"replayed with MonitorConfig overrides {overrides}")
    if not args.json:
        print(format_table(runs))
    mismatched = [f"{s['key']} ({', '.join(s['in_training'].get('replay_differs_in') or [])})" for s in summaries
                  if s["in_training"]["replay_matches"] is False and not overrides]
    if mismatched:
        print(f"note: replayed with their own thresholds, these runs' alerts differ from those raised in training, "
              f"in the rules named (expected where a rule's logic changed since the run was recorded): "
              f"{'; '.join(mismatched)}")
    if args.json:
        results = merge_results(Path(args.json), summaries, min_lead=min_lead)
        print_results(results, set(runs))
    if args.markdown:
        Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(args.markdown).write_text(format_table(runs, markdown=True) + "\n")
    if args.calibrate:
        cal = calibrate(run_dirs)
        write_json_atomic(Path(args.calibrate), cal)
        print()
        print(format_calibration(cal))
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_subcommand(build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
