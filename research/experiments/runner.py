"""Run many experiment runs as subprocesses, a few at a time, and gather their results in one JSON.

``run_plan(plan, ...)`` starts each run as ``sys.executable -m research.experiments.worker
--spec RUN_DIR/spec.json`` with the caller's environment and the repository root on
``PYTHONPATH`` (so ``research`` imports from any working directory, and ``PYTHONPATH=$PWD``
runs flashwatch without installing it), at most ``parallel`` at a time, spread
over ``devices`` (``CUDA_VISIBLE_DEVICES`` per subprocess; CPU runs get ``CUDA_VISIBLE_DEVICES=""``
and one CPU thread each unless the spec says otherwise). A subprocess's output goes to ``RUN_DIR/worker.log``.

Bounds: each run stops itself at ``max_steps``, at ``max_seconds`` of its own time, or at
blow-up; the runner kills one that overstays (``max_seconds`` + ``GRACE_S``) and never starts a
run that the overall ``budget_s`` cannot hold, shortening the last runs' ``max_seconds`` to fit
(a run cut by the budget is recorded as such, with what it recorded). A run that fails (a
crash, a missing device, a kill) is recorded as an error with the tail of its log; the others
go on.

After each run the runner analyses its folder (``flashwatch.replay.runs.analyze_run``: blow-up,
replayed alerts, baselines) and merges the summary into the results JSON under the key
``scenario/arm/seed`` (``flashwatch.replay.results.merge_results``): earlier runs stay, a rerun
replaces its key. The JSON also carries the aggregate per arm, the targets (with the least lead
each scenario asks for, ``min_lead``), and the definitions (recomputed at every merge).
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from flashwatch.replay.records import RUN_FILE, read_run
from flashwatch.replay.results import load_results, merge_results
from flashwatch.replay.runs import analyze_run, run_key

from .scenarios import Scenario
from .worker import CHECKPOINT_FILE

__all__ = ["RunSpec", "make_plan", "run_plan", "estimate", "GRACE_S", "STARTUP_S"]

REPOSITORY = Path(__file__).resolve().parents[2]  # the folder holding research/: on the workers' PYTHONPATH

GRACE_S = 90.0  # a worker past max_seconds + this is killed (start-up, compilation, the last flush)
STARTUP_S = {"cpu": 5.0, "cuda": 45.0}  # process start, imports, corpus, CUDA context, Triton compiles
# Assumed ms per step for the dry-run estimate when the results JSON has no measurement of the
# arm: one process alone on an H200 (the reference GPT under SDPA: ~19 ms a step, its own-kernel
# step a little slower). A results JSON's measured ms/step replace these.
ASSUMED_MS = {("cuda", "sdpa", "bf16"): 22.0, ("cuda", "own", "bf16"): 24.0, ("cuda", "sdpa", "fp32"): 45.0,
              ("cuda", "paper", "bf16"): 50.0, ("cpu", "own", "bf16_attention"): 35.0}
SHARE = 2.0  # processes that share one GPU without slowing each other (launch-bound small models); beyond: linear


@dataclass
class RunSpec:
    """One planned run (what the worker's spec.json holds)."""

    scenario: str
    arm: dict
    recipe: dict
    seed: int
    run_dir: str
    device: str
    max_steps: int
    max_seconds: float
    label: str
    tiny: bool = False
    threads: int | None = None
    flush_every: int = 50
    monitor_overrides: dict = field(default_factory=dict)
    checkpoint: bool = False  # save a checkpoint when stopped by a bound; a later plan with it resumes
    after_blowup: int = 0  # steps to keep training past a confirmed blow-up

    @property
    def key(self) -> str:
        return run_key(self.scenario, self.arm["name"], self.seed)


def make_plan(scenarios: list[tuple[Scenario, list]], seeds: list[int] | None, out: Path, *, device: str | None,
              tiny: bool, max_steps: int | None, max_seconds: float | None,
              monitor_overrides: dict | None = None, inject: float | None = None, resumable: bool = False,
              after_blowup: int = 0) -> list[RunSpec]:
    """Runs for each (scenario, arms) x seed, seeds interleaved (seed 0 of every arm first).

    An arm is a name (run with ``seeds``, or the scenario's seeds) or a (name, seeds) pair.
    ``inject`` replaces the strength of the arms that inject a fault.
    """
    plan = []
    jobs: list[tuple[int, Scenario, str, int]] = []
    for scenario, arms in scenarios:
        for item in arms:
            name, own = (item, None) if isinstance(item, str) else item
            for i, seed in enumerate(own if own is not None else (seeds if seeds is not None else scenario.seeds)):
                jobs.append((i, scenario, name, seed))
    order = {id(s): k for k, (s, _) in enumerate(scenarios)}
    jobs.sort(key=lambda j: (j[0], order[id(j[1])]))  # stable: arm order kept within a round
    for _, scenario, name, seed in jobs:
        arm = scenario.arm(name)
        if inject is not None and arm.inject:
            arm = replace(arm, inject=float(inject))
        recipe = scenario.tiny if tiny else scenario.recipe
        if arm.lr is not None and not tiny:
            recipe = replace(recipe, lr=arm.lr)
        steps = max_steps if max_steps is not None else (scenario.tiny_max_steps if tiny else scenario.max_steps)
        if arm.decay_steps is not None:  # a tiny run decays over its own length: the same code path, shortened
            recipe = replace(recipe, decay_steps=steps if tiny else arm.decay_steps)
        plan.append(RunSpec(scenario=scenario.name, arm=arm.to_dict(), recipe=recipe.to_dict(), seed=seed,
                            run_dir=str(out / scenario.name / name / f"seed{seed}"), device=device or scenario.device,
                            max_steps=steps, max_seconds=max_seconds if max_seconds is not None else scenario.max_seconds,
                            label=arm.label, tiny=tiny, monitor_overrides=dict(monitor_overrides or {}),
                            checkpoint=resumable, after_blowup=after_blowup))
    return plan


def _ms_per_step(spec: RunSpec, measured: dict) -> tuple[float, str]:
    key = (spec.scenario, spec.arm["name"], spec.tiny, spec.device)
    if key in measured:
        return measured[key], "measured"
    kind = "paper" if spec.arm["attention"] == "paper" else ("own" if spec.arm["monitor"].get("mode") == "own_kernel"
                                                              else "sdpa")
    ms = ASSUMED_MS.get((spec.device, kind, spec.arm["precision"]))
    if ms is None:
        ms = ASSUMED_MS.get((spec.device, kind, "bf16"), 30.0)
    if spec.tiny:
        ms = 30.0
    scale = (spec.recipe["n_layer"] * spec.recipe["n_embd"] ** 2 * spec.recipe["batch_size"] *
             spec.recipe["block_size"]) / (6 * 384 ** 2 * 32 * 512) if spec.device == "cuda" and not spec.tiny else 1.0
    return ms * max(scale, 0.25), "assumed"


def measured_speeds(results: dict) -> dict:
    """ms per step measured in earlier runs (median per scenario, arm, tiny, device), from a results JSON."""
    acc: dict = {}
    for r in results.get("runs", {}).values():
        if r.get("ms_per_step") and r.get("status") in ("completed", "blown_up", "time_limit", "budget"):
            dev = r.get("device_kind") or "cpu"
            acc.setdefault((r["scenario"], r["arm"], bool(r.get("tiny")), dev), []).append(r["ms_per_step"])
    return {k: sorted(v)[len(v) // 2] for k, v in acc.items()}


def estimate(plan: list[RunSpec], parallel: int, devices: list[str], measured: dict | None = None) -> dict:
    """Estimated wall time of a plan: greedy list scheduling of each run's bound-limited time."""
    measured = measured or {}
    gpus = max(1, len(devices))
    per_gpu = math.ceil(parallel / gpus)
    slow = max(1.0, per_gpu / SHARE)
    slots = [0.0] * max(1, parallel)
    rows = []
    for spec in plan:
        ms, source = _ms_per_step(spec, measured)
        if spec.device == "cuda":
            ms *= slow
        run_s = min(spec.max_seconds, spec.max_steps * ms / 1000.0) + STARTUP_S.get(spec.device, 5.0)
        i = min(range(len(slots)), key=slots.__getitem__)
        slots[i] += run_s
        rows.append({"key": spec.key, "ms_per_step": round(ms, 1), "source": source, "seconds_at_most": round(run_s)})
    if any(spec.device == "cuda" for spec in plan):
        how = (f"{per_gpu} processes per GPU, each assumed {slow:.2f}x slower than alone (a guess: up to {SHARE:g} "
               "share a GPU for free, these small models being launch-bound; measured ms/step replace it once a "
               "results JSON has them)")
    else:
        how = "CPU runs, one thread each, on as many cores as --parallel"
    return {"wall_s": round(max(slots)), "runs": rows, "processes_per_gpu": per_gpu,
            "assumption": how + "; every run taken to its max_steps or max_seconds (a blow-up ends one sooner)"}


# --- one finished run ------------------------------------------------------------------------------

def _error_summary(spec: RunSpec, message: str) -> dict:
    return {"key": spec.key, "scenario": spec.scenario, "arm": spec.arm["name"], "seed": spec.seed,
            "label": spec.label, "injected": bool(spec.arm.get("inject")), "expect": spec.arm.get("expect"),
            "status": "error", "error": message, "summary_error": True, "run_dir": spec.run_dir, "tiny": spec.tiny}


def _tail(path: Path, n: int = 2000) -> str:
    try:
        data = path.read_bytes()
        return data[-n:].decode(errors="replace")
    except OSError:
        return ""


def summarize(spec: RunSpec, returncode: int | None, note: str | None = None) -> dict:
    """The analysed summary of a finished run, or an error record that says what went wrong."""
    run_dir = Path(spec.run_dir)
    try:
        run = read_run(run_dir)
    except (OSError, ValueError):
        run = {}
    if run.get("status") == "paused":  # a piece of a longer run: analysed once it ends
        return {"key": spec.key, "scenario": spec.scenario, "arm": spec.arm["name"], "seed": spec.seed,
                "label": spec.label, "status": "paused", "steps": run.get("steps_done"), "run_dir": spec.run_dir,
                "tiny": spec.tiny, "ms_per_step": run.get("ms_per_step"), "device": run.get("device_name")}
    try:
        summary = analyze_run(run_dir)
    except Exception as exc:
        log_tail = _tail(run_dir / "worker.log")
        return _error_summary(spec, f"{note or f'exit code {returncode}'}; analysis failed ({type(exc).__name__}: "
                                    f"{exc}); log tail: {log_tail[-800:]}")
    if note:
        summary["runner_note"] = note
        if summary.get("status") in (None, "starting", "running", "killed"):
            summary["status"] = "budget" if "budget" in note else "killed"
    if returncode not in (0, None) and summary.get("status") != "error":
        summary["runner_note"] = (summary.get("runner_note") or "") + f" exit code {returncode}"
    if summary.get("status") == "error":
        summary["error"] = summary.get("error") or _tail(run_dir / "worker.log", 800)
    return summary


def run_plan(plan: list[RunSpec], *, parallel: int, devices: list[str], json_path: Path, budget_s: float | None = None,
             poll_s: float = 0.5, echo=print, extra: dict | None = None, min_lead: dict[str, int] | None = None) -> dict:
    """Run ``plan`` (see the module docstring); returns the merged results. ``min_lead``:
    ``{scenario: steps}`` for the targets (``Scenario.min_lead``)."""
    t0 = time.monotonic()
    deadline = None if budget_s is None else t0 + budget_s
    queue = list(plan)
    running: list[tuple[subprocess.Popen, RunSpec, str, float, object]] = []
    load = {d: 0 for d in devices} if devices else {}
    results = load_results(json_path)
    skipped: list[RunSpec] = []
    previous = signal.getsignal(signal.SIGTERM)

    def _interrupt(signum, frame):
        raise KeyboardInterrupt

    def merge(summary: dict) -> dict:
        return merge_results(json_path, [summary], extra, min_lead)

    try:
        signal.signal(signal.SIGTERM, _interrupt)
    except ValueError:  # not the main thread
        previous = None
    try:
        results = _loop(queue, running, load, results, skipped, parallel, deadline, t0, poll_s, echo, merge)
    except KeyboardInterrupt:
        echo("interrupted: stopping the running workers (they keep what they recorded)")
        for proc, spec, dev, started, log in running:
            _terminate(proc)
            log.close()
            results = merge(summarize(spec, proc.returncode, "killed by the runner: interrupted"))
        skipped.extend(queue)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    if skipped:
        echo(f"not started: {', '.join(s.key for s in skipped)}")
    return results


def _loop(queue, running, load, results, skipped, parallel, deadline, t0, poll_s, echo, merge) -> dict:
    while queue or running:
        while queue and len(running) < parallel:
            spec = queue[0]
            startup = STARTUP_S.get(spec.device, 5.0)
            if deadline is not None:
                left = deadline - time.monotonic() - startup - 20.0
                if left < 30.0:
                    skipped.extend(queue)
                    queue.clear()
                    break
                if left < spec.max_seconds:
                    spec.max_seconds = round(left, 1)
            queue.pop(0)
            run_dir = Path(spec.run_dir)
            resuming = spec.checkpoint and (run_dir / CHECKPOINT_FILE).exists()
            if spec.checkpoint and not resuming and _finished(run_dir):
                echo(f"[{time.monotonic() - t0:6.0f}s] skip  {spec.key}: finished earlier")
                continue
            env = dict(os.environ)
            env["PYTHONUNBUFFERED"] = "1"
            env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPOSITORY), env.get("PYTHONPATH")) if p)
            dev = ""
            if spec.device == "cuda":
                dev = min(load, key=load.get) if load else "0"
                env["CUDA_VISIBLE_DEVICES"] = dev
                if load:
                    load[dev] += 1
                spec.threads = spec.threads or 2  # the CPU side of a GPU run is the data index and launches
                env["OMP_NUM_THREADS"] = str(spec.threads)
            else:
                env["CUDA_VISIBLE_DEVICES"] = ""
                # one thread each by default: these models are too small for intra-op threads to pay,
                # and on a shared or oversubscribed CPU OpenMP threads spin (measured 10x slower)
                spec.threads = spec.threads or 1
                env["OMP_NUM_THREADS"] = str(spec.threads)
            run_dir.mkdir(parents=True, exist_ok=True)
            if not resuming:
                (run_dir / RUN_FILE).unlink(missing_ok=True)
            with open(run_dir / "spec.json", "w") as f:
                json.dump({**asdict(spec), "parallel": parallel}, f, indent=1)
            log = open(run_dir / "worker.log", "a" if resuming else "w")
            try:
                # the runner's process group and POSIX session: if the runner is killed outright, whoever
                # kills its group (a terminal, a job runner) takes the workers with it
                proc = subprocess.Popen([sys.executable, "-m", "research.experiments.worker", "--spec",
                                         str(run_dir / "spec.json")], stdout=log, stderr=subprocess.STDOUT, env=env)
            except OSError as exc:
                log.close()
                results = merge(_error_summary(spec, f"could not start the worker: {exc}"))
                continue
            running.append((proc, spec, dev, time.monotonic(), log))
            echo(f"[{time.monotonic() - t0:6.0f}s] start {spec.key} on {spec.device}{(':' + dev) if dev else ''}")
        time.sleep(poll_s)
        for item in list(running):
            proc, spec, dev, started, log = item
            code = proc.poll()
            note = None
            overdue = time.monotonic() - started > spec.max_seconds + GRACE_S
            past_budget = deadline is not None and time.monotonic() > deadline
            if code is None and (overdue or past_budget):
                note = "killed by the runner: " + ("over the budget" if past_budget else "over max_seconds + grace")
                _terminate(proc)
                code = proc.returncode
            if code is None:
                continue
            running.remove(item)
            log.close()
            if dev and dev in load:
                load[dev] -= 1
            summary = summarize(spec, code, note)
            results = merge(summary)
            echo(f"[{time.monotonic() - t0:6.0f}s] done  {spec.key}: {summary.get('status')}"
                 f"{'' if summary.get('blowup_step') is None else ', blow-up at ' + str(summary['blowup_step'])}"
                 f"{'' if not summary.get('error') else ' ERROR ' + str(summary['error'])[:200]}")
    return results


def _finished(run_dir: Path) -> bool:
    """Whether a resumable run already ended (completed or blown up; not paused, not failed)."""
    try:
        return read_run(run_dir).get("status") in ("completed", "blown_up")
    except (OSError, ValueError):
        return False


def _terminate(proc: subprocess.Popen) -> None:
    """SIGTERM the worker (it ends its run at the next step and saves its recordings), SIGKILL after 20 s."""
    if proc.poll() is not None:
        return
    try:
        proc.terminate()
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    except ProcessLookupError:
        pass
