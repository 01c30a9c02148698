"""python -m research.experiments: train runs that fail, with flashwatch watching, and record them.

Commands (from the repository root)
  python -m research.experiments early-warning   the INJECTED-fault scenario (CPU) and the
                                                 real-numerics scenario (CUDA; skipped without it)
  python -m research.experiments real-failure    the real BF16 failure (CUDA only), six arms
  python -m research.experiments seed-split      one configuration where seeds split (CUDA only)
  python -m research.experiments fp8-failure     the real-failure recipe with P_bar V in FP8 (CUDA only)
  python -m research.experiments list            scenarios, arms, defaults
  python -m research.experiments figures PATH    one PNG per arm from recorded runs

What a run is. One (scenario, arm, seed): a byte-level GPT trained on the Python standard
library's source with flashwatch's Monitor attached, in its own process, stopped at blow-up,
at --max-steps or at --max-seconds. Its folder (OUT/SCENARIO/ARM/seedN) records every step's
loss and gradient norm (steps.csv) and every monitored step's per-head signals
(signals.jsonl.gz: delta error e_t, C_T, drift z, windowed z, repeated-max counts on FP32 and
BF16 scores, max logit, W^Q spectral norm, variants, alerts), plus run.json and worker.log
(the format: flashwatch/replay/records.py).

Blow-up: a non-finite loss, or the median of the last 20 losses at >= 1.25x its lowest earlier
value for 20 consecutive steps (the blow-up step is where that excursion starts; see
flashwatch/replay/blowup.py for why). Lead time = blow-up step - first alert step.

Results. After each run its recordings are analysed and merged into ONE JSON (--json), keyed
by scenario/arm/seed, so runs made at different times (other seeds, other GPUs) add up; a
rerun replaces its key. The JSON holds per run: status, blow-up step, every flashwatch rule's
first alert (replayed with the current MonitorConfig defaults), the baselines' first alerts
(Lightning-style loss spike, ZClip grad-norm z, QK-Clip max logit > 100), lead times, final
loss; per arm aggregates; the targets. A table is printed at the end.

Analyze. The product command `flashwatch experiment analyze` re-reads run folders and replays
the detectors WITHOUT retraining (other thresholds: --set FIELD=VALUE; --calibrate sweeps
thresholds); `figures` renders one PNG per arm (do this on your machine, not on the GPU).

Parallel runs. --parallel N runs N workers at a time; --devices 0,1 spreads CUDA runs over
those GPUs (CUDA_VISIBLE_DEVICES per worker, least-loaded first); CPU runs take one thread each
(small models gain nothing from intra-op threads, and on a busy CPU they spin). --budget
SECONDS ends everything in time: no run starts that cannot get 30 s, the last ones get shorter
--max-seconds, stragglers are stopped (and keep what they recorded). A failing run is recorded
as an error; the others go on. Worker output goes to RUN_DIR/worker.log. Without installing
flashwatch: from the repository root, with flashwatch/kernels linked to kernels/ and
PYTHONPATH=$PWD (see research/gpu_batch.sh); workers inherit that environment.

Check before spending GPU time: --dry-run prints the plan (runs, arms, seeds, devices, bounds)
and an estimated wall time; --device cpu --tiny runs the same code path on a tiny model on the
CPU in seconds.

Examples
  python -m research.experiments early-warning --scenario injection --parallel 2 \\
      --json results/early-warning.json --out runs/experiments
  python -m research.experiments real-failure --seeds 0-2 --parallel 8 --devices 0,1 \\
      --budget 540 --out $OUT/runs --json $OUT/real-failure.json
  python -m research.experiments real-failure --device cpu --tiny --seeds 0 --out /tmp/smoke --json /tmp/smoke.json
  flashwatch experiment analyze runs/experiments --json results/early-warning.json \\
      --calibrate results/calibration.json
  python -m research.experiments figures runs/experiments --out docs/figures
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from flashwatch.cli import run_subcommand
from flashwatch.replay.cli import parse_overrides, print_results, run_folders
from flashwatch.vocabulary import INJECTED

__all__ = ["main", "build_parser"]

PROG = "python -m research.experiments"
EPILOG = f"Run `{PROG} COMMAND --help` for a command's options."


def _seeds(text: str) -> list[int]:
    out: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        if "-" in part[1:]:
            lo, hi = part.split("-", 1)
            out.extend(range(int(lo), int(hi) + 1))
        else:
            out.append(int(part))
    if not out:
        raise argparse.ArgumentTypeError(f"no seeds in {text!r}; e.g. 0-4 or 0,2,5")
    return out


def _parse_arms(text: str) -> list:
    """"a,b@0-2" -> ["a", ("b", [0, 1, 2])]."""
    out: list = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        if "@" in part:
            name, seeds = part.split("@", 1)
            out.append((name.strip(), _seeds(seeds.replace(";", ","))))
        else:
            out.append(part)
    # "a@0-2" splits "0-2" fine; "a@0,1" would split at the comma: write a@0;1 or a@0-1
    return out


def _add_run_options(p: argparse.ArgumentParser, default_json: str) -> None:
    g = p.add_argument_group("what to run")
    g.add_argument("--arms", metavar="A,B@0-2", help="arms to run (default: the scenario's default arms; see `list`); "
                                                       "ARM@SEEDS gives one arm its own seeds, e.g. "
                                                       "sdpa_observe,fp32,fixed@0")
    g.add_argument("--seeds", type=_seeds, metavar="0-4", help="seeds, e.g. 0-4 or 0,2 (default: 0-4)")
    g.add_argument("--tiny", action="store_true", help="tiny model and 30 steps: a smoke run of the same code path")
    g.add_argument("--device", choices=("cpu", "cuda"), help="where the runs train (default: the scenario's)")
    g.add_argument("--inject", type=float, metavar="STRENGTH",
                   help="INJECTED fault strength for the arms that inject (default: the scenario's, 512)")
    g.add_argument("--monitor-set", action="append", metavar="FIELD=VALUE",
                   help="MonitorConfig field for the runs' Monitor (repeatable), e.g. interval=5; recorded in the "
                        "runs and used by their analysis")
    g = p.add_argument_group("bounds and parallelism")
    g.add_argument("--max-steps", type=int, metavar="N", help="steps per run (default: the scenario's)")
    g.add_argument("--max-seconds", type=float, metavar="S", help="seconds per run, start-up excluded "
                                                                  "(default: the scenario's)")
    g.add_argument("--parallel", type=int, default=1, metavar="N", help="runs at a time (default 1)")
    g.add_argument("--devices", default=None, metavar="0,1",
                   help="GPU indices for CUDA runs (default: every visible GPU)")
    g.add_argument("--budget", type=float, metavar="S", help="overall wall-clock budget in seconds (see above)")
    g.add_argument("--resumable", action="store_true",
                   help="checkpoint runs stopped by a bound; run the same command again to continue them")
    g.add_argument("--after-blowup", type=int, default=0, metavar="N",
                   help="keep training N steps past a confirmed blow-up (default 0: stop there)")
    g = p.add_argument_group("output")
    g.add_argument("--out", default="runs/experiments", metavar="DIR",
                   help="run folders go to DIR/SCENARIO/ARM/seedN (default runs/experiments)")
    g.add_argument("--json", default=default_json, metavar="PATH",
                   help=f"results JSON, merged by scenario/arm/seed (default {default_json})")
    g.add_argument("--figures", metavar="DIR", help="also render one PNG per arm into DIR when done "
                                                     "(better: `analyze --figures` on your own machine)")
    g.add_argument("--dry-run", action="store_true", help="print the plan and an estimated wall time; run nothing")


def build_parser() -> argparse.ArgumentParser:
    from .scenarios import SCENARIOS

    parser = argparse.ArgumentParser(prog=PROG, description=__doc__, epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    def scen_doc(name: str) -> str:
        s = SCENARIOS[name]
        lines = [f"{s.name} ({s.device}): {s.summary}",
                 f"  recipe: {_recipe_text(s.recipe)}; {s.max_steps} steps, {s.max_seconds:g} s per run by default"]
        for a in s.arms:
            mark = "*" if a.name in s.default_arms else " "
            lines.append(f"  {mark} {a.name:20s} [{a.expect}] {a.summary}")
            if a.note:
                lines.append(f"      note: {a.note}")
        return "\n".join(lines)

    p = sub.add_parser("early-warning", help="the injected-fault scenario (CPU) and real-numerics (CUDA)",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       description="Early-warning scenarios. Arms marked * run by default.\n\n"
                                   + scen_doc("injection") + "\n\n" + scen_doc("real-numerics") +
                                   "\n\nWithout CUDA the real-numerics scenario is skipped (said so); "
                                   "--device cpu --tiny runs it as a smoke test.")
    p.add_argument("--scenario", choices=("injection", "real-numerics", "all"), default="all",
                   help="which scenario (default: all)")
    _add_run_options(p, "results/early-warning.json")
    p.set_defaults(func=_cmd_run, command_name="early-warning")

    p = sub.add_parser("real-failure", help="the real BF16 failure of the experiments' GPT, six arms (CUDA)",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       description="The real BF16 failure. Arms marked * run by default.\n\n"
                                   + scen_doc("real-failure") +
                                   "\n\nNeeds CUDA: without it the command says so and exits with status 2 "
                                   "(--device cpu --tiny runs the same code path on a tiny model).")
    _add_run_options(p, "results/real-failure.json")
    p.set_defaults(func=_cmd_run, command_name="real-failure", scenario="real-failure")

    p = sub.add_parser("seed-split", help="one configuration where seeds split (CUDA): the pre-registered test",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       description="The seed-split configuration. Arms marked * run by default.\n\n"
                                   + scen_doc("seed-split") +
                                   "\n\nLong runs: --resumable saves a checkpoint when a run is stopped by "
                                   "--max-seconds or --budget, and the same command again continues every "
                                   "unfinished run (finished ones are skipped); --after-blowup N keeps training N "
                                   "steps past a confirmed blow-up.")
    _add_run_options(p, "results/seed-split.json")
    p.set_defaults(func=_cmd_run, command_name="seed-split", scenario="seed-split")

    p = sub.add_parser("fp8-failure", help="the real-failure recipe with P_bar V in FP8 E4M3 (emulated; CUDA)",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       description="The FP8 failure. Arms marked * run by default.\n\n" + scen_doc("fp8-failure") +
                                   "\n\nLong runs: --resumable, as seed-split.")
    _add_run_options(p, "results/fp8-failure.json")
    p.set_defaults(func=_cmd_run, command_name="fp8-failure", scenario="fp8-failure")

    p = sub.add_parser("figures", help="one PNG per (scenario, arm) from recorded runs, and an overview per scenario",
                       description="Figures from recorded runs (matplotlib; no training). PATH: a run folder, a "
                                   "folder of run folders, or a results JSON (its runs' folders are read where they "
                                   "exist). Alerts are replayed with MonitorConfig's defaults, or --set FIELD=VALUE.")
    p.add_argument("paths", nargs="+", metavar="PATH")
    p.add_argument("--out", required=True, metavar="DIR", help="folder for the PNGs")
    p.add_argument("--set", action="append", metavar="FIELD=VALUE", help="MonitorConfig override for the replay")
    p.set_defaults(func=_cmd_figures)

    p = sub.add_parser("list", help="scenarios, arms and defaults")
    p.set_defaults(func=_cmd_list)
    return parser


def _recipe_text(r) -> str:
    return (f"{r.n_layer} layers x {r.n_head} heads, d={r.n_embd}, ctx {r.block_size}, batch {r.batch_size}, "
            f"AdamW lr {r.lr:g} ({r.warmup_steps} warm-up steps, betas ({r.beta1}, {r.beta2}), wd {r.weight_decay:g}), "
            f"clip {r.clip:g}, Monitor every {r.interval} steps")


def _cmd_list(args) -> int:
    from .scenarios import SCENARIOS

    for s in SCENARIOS.values():
        print(f"{s.name} ({s.device}): {s.summary}")
        print(f"  recipe: {_recipe_text(s.recipe)}")
        print(f"  tiny:   {_recipe_text(s.tiny)}")
        print(f"  seeds {','.join(map(str, s.seeds))}; {s.max_steps} steps, {s.max_seconds:g} s per run")
        for a in s.arms:
            mark = "*" if a.name in s.default_arms else " "
            print(f"  {mark} {a.label:34s} [{a.expect}] {a.summary}")
    return 0


def _cuda_devices(text: str | None) -> list[str]:
    if text:
        return [d.strip() for d in text.split(",") if d.strip()]
    try:
        import torch

        n = torch.cuda.device_count()
    except Exception:
        n = 0
    return [str(i) for i in range(max(n, 1))]


def _cmd_run(args) -> int:
    import torch

    from flashwatch.replay.results import load_results

    from .runner import estimate, make_plan, measured_speeds, run_plan
    from .scenarios import get_scenario

    names = ["injection", "real-numerics"] if getattr(args, "scenario", None) == "all" else [args.scenario]
    cuda = torch.cuda.is_available()
    chosen = []
    for name in names:
        scenario = get_scenario(name)
        device = args.device or scenario.device
        if device == "cuda" and not cuda and not args.dry_run:
            msg = (f"{PROG}: the {name} scenario needs a CUDA GPU and torch.cuda.is_available() is "
                   f"False on this machine (torch {torch.__version__}). For a smoke run of the same code path on the "
                   f"CPU: --device cpu --tiny.")
            if args.command_name == "real-failure" or len(names) == 1:
                print(msg, file=sys.stderr)
                return 2
            print(msg.replace("needs", "is skipped: it needs"), file=sys.stderr)
            continue
        if device == "cpu" and scenario.device == "cuda" and not args.tiny:
            print(f"{PROG}: the {name} recipe on a CPU would take days; --device cpu is for "
                  "--tiny smoke runs", file=sys.stderr)
            return 2
        try:
            arms = _parse_arms(args.arms) if args.arms else list(scenario.default_arms)
        except argparse.ArgumentTypeError as exc:
            print(f"{PROG}: --arms: {exc}", file=sys.stderr)
            return 2
        names_of = {x.name for x in scenario.arms}
        unknown = [a if isinstance(a, str) else a[0] for a in arms if (a if isinstance(a, str) else a[0]) not in names_of]
        if unknown:
            if len(names) == 1:
                print(f"{PROG}: scenario {name} has no arm(s) {', '.join(unknown)}; arms: "
                      f"{', '.join(sorted(names_of))}", file=sys.stderr)
                return 2
            arms = [a for a in arms if (a if isinstance(a, str) else a[0]) in names_of]
            if not arms:
                continue
        chosen.append((scenario, arms))
    if not chosen:
        print(f"{PROG}: nothing to run", file=sys.stderr)
        return 2
    out = Path(args.out)
    json_path = Path(args.json)
    plan = make_plan(chosen, args.seeds, out, device=args.device, tiny=args.tiny, max_steps=args.max_steps,
                     max_seconds=args.max_seconds, inject=args.inject,
                     monitor_overrides=parse_overrides(args.monitor_set, "--monitor-set"),
                     resumable=args.resumable, after_blowup=args.after_blowup)
    devices = _cuda_devices(args.devices) if any(s.device == "cuda" for s in plan) else []
    if args.parallel < 1:
        print(f"{PROG}: --parallel must be >= 1", file=sys.stderr)
        return 2
    est = estimate(plan, args.parallel, devices, measured_speeds(load_results(json_path)))
    print(f"plan: {len(plan)} runs, --parallel {args.parallel}"
          f"{', GPUs ' + ','.join(devices) if devices else ''}; results -> {json_path}; run folders -> {out}")
    for spec, row in zip(plan, est["runs"]):
        injected = f"  {INJECTED} x{spec.arm['inject']:g}" if spec.arm.get("inject") else ""
        print(f"  {spec.key:40s} {spec.device:4s} {spec.max_steps:6d} steps <= {spec.max_seconds:5.0f} s  "
              f"~{row['ms_per_step']} ms/step ({row['source']}){injected}")
    budget_note = f" (capped by --budget {args.budget:g} s)" if args.budget else ""
    print(f"estimated wall time at most ~{est['wall_s']} s{budget_note}; {est['assumption']}")
    if args.dry_run:
        if any(s.device == "cuda" for s in plan) and not cuda:
            print("note: no CUDA here; the real run needs it")
        return 0
    results = run_plan(plan, parallel=args.parallel, devices=devices, json_path=json_path, budget_s=args.budget,
                       extra={"machine": _machine()},
                       min_lead={s.name: s.min_lead for s, _ in chosen if s.min_lead is not None})
    keys = {s.key for s in plan}
    paused = sorted(k for k in keys if results.get("runs", {}).get(k, {}).get("status") == "paused")
    if paused:
        print(f"paused (checkpointed; run the same command again to continue): {', '.join(paused)}")
    if keys - set(paused):
        print_results(results, keys - set(paused))
    if args.figures:
        from .figures import figures_for

        paths = figures_for([Path(s.run_dir) for s in plan if (Path(s.run_dir) / "run.json").exists()],
                            Path(args.figures))
        print("figures:", ", ".join(str(p) for p in paths))
    errors = [k for k in keys if results.get("runs", {}).get(k, {}).get("status") == "error"]
    return 1 if errors else 0


def _machine() -> dict:
    import platform

    import torch

    out = {"host_cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
           "torch": torch.__version__, "python": platform.python_version()}
    if torch.cuda.is_available():
        out["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return out


def _cmd_figures(args) -> int:
    from .figures import figures_for

    overrides = parse_overrides(args.set)
    run_dirs = run_folders(args.paths, f"{PROG} figures")
    if run_dirs is None:
        return 2
    for p in figures_for(run_dirs, Path(args.out), overrides):
        print("figure:", p)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_subcommand(build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
