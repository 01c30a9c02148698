"""flashwatch experiment: runner, worker, recordings, replay, baselines, CLI (CPU, real components)."""

from __future__ import annotations

import gzip
import json
import math
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from flashwatch.config import MonitorConfig
from flashwatch.experiments import analysis, baselines
from flashwatch.experiments.cli import main as experiment_main
from flashwatch.experiments.records import f32_text, read_f32, read_signals, read_steps
from flashwatch.experiments.runner import make_plan, run_plan
from flashwatch.experiments.scenarios import INJECTION


# --- the pipeline, end to end ----------------------------------------------------------------------

def _cli(*argv) -> int:
    return experiment_main([str(a) for a in argv])


def test_injection_runs_through_the_runner_in_parallel_merge_and_replay(tmp_path, capsys):
    out, results = tmp_path / "runs", tmp_path / "results.json"
    # tiny model, 30 steps, Monitor every 2 steps; thresholds low so that alerts fire in 30 steps
    common = ["early-warning", "--scenario", "injection", "--tiny", "--parallel", 2, "--out", out, "--json", results,
              "--monitor-set", "warmup=1", "--monitor-set", "drift_threshold=0.5", "--monitor-set", "max_logit_bound=1"]
    assert _cli(*common, "--seeds", 0, "--arms", "healthy,injected_auto_fix") == 0
    printed = capsys.readouterr().out
    assert "injection/injected_auto_fix/0 [INJECTED x512]" in printed  # labelled in the table
    data = json.loads(results.read_text())
    assert set(data["runs"]) == {"injection/healthy/0", "injection/injected_auto_fix/0"}

    for key, run in data["runs"].items():
        assert run["status"] == "completed", run
        run_dir = Path(run["run_dir"])
        steps = read_steps(run_dir)
        assert steps["step"].tolist() == list(range(30))  # every step recorded
        records = list(read_signals(run_dir))
        assert [r["step"] for r in records] == list(range(0, 30, 2))  # every monitored step
        assert (run_dir / "signals.jsonl.gz").exists() and (run_dir / "worker.log").exists()
        assert run["in_training"]["alerts"] > 0
        assert run["in_training"]["replay_matches"] is True  # offline replay == the Monitor's own alerts
        for b in baselines.BASELINES:
            assert set(run["baselines"][b]) == {"first", "count", "lead"}
        assert run["injected"] == (key != "injection/healthy/0")
    fixed = data["runs"]["injection/injected_auto_fix/0"]
    assert fixed["switches"] and fixed["switches"][0]["to"] == "fixed"  # auto_fix acted on an alert

    # a second sitting adds a seed; the first sitting's runs stay
    assert _cli(*common, "--seeds", 1, "--arms", "healthy") == 0
    data = json.loads(results.read_text())
    assert set(data["runs"]) == {"injection/healthy/0", "injection/injected_auto_fix/0", "injection/healthy/1"}
    assert data["aggregate"]["injection"]["healthy"]["seeds"] == [0, 1]

    # analyze replays the recordings with other thresholds, without training
    capsys.readouterr()
    assert _cli("analyze", out, "--set", "drift_threshold=100", "--set", "max_logit_bound=1e9",
                "--set", "warmup=1", "--markdown", tmp_path / "table.md") == 0
    assert "drift_threshold" in capsys.readouterr().out
    assert (tmp_path / "table.md").read_text().startswith("| run |")


def test_a_failing_run_is_recorded_as_an_error_and_the_others_go_on(tmp_path):
    plan = make_plan([(INJECTION, ["healthy"])], [0, 1], tmp_path / "runs", device="cpu", tiny=True, max_steps=6,
                     max_seconds=60)
    plan[0].monitor_overrides = {"interval": 0}  # MonitorConfig rejects it inside the worker
    results = run_plan(plan, parallel=2, devices=[], json_path=tmp_path / "r.json", echo=lambda *a: None)
    bad, good = results["runs"]["injection/healthy/0"], results["runs"]["injection/healthy/1"]
    assert bad["status"] == "error" and "interval" in bad["error"]
    assert good["status"] == "completed" and good["last_step"] == 5


class _CopyDone:
    """Stands in for the CUDA event of an asynchronous host copy (as in test_monitor)."""

    def synchronize(self):
        pass


def _worker_run(tmp_path, name: str, defer: bool, monkeypatch, arm: str = "auto_fix") -> Path:
    """One tiny real-failure run in this process, thresholds low so that alerts fire; ``defer``: the
    Monitor decides a monitored step at the next step() as on CUDA with async_transfer."""
    from flashwatch.experiments import worker
    from flashwatch.experiments.scenarios import REAL_FAILURE
    from flashwatch.monitor import Monitor

    with monkeypatch.context() as m:
        if defer:
            m.setattr(Monitor, "_start_host_copy", lambda self, values: (values.clone(), _CopyDone()))
        spec = make_plan([(REAL_FAILURE, [arm])], [0], tmp_path / name, device="cpu", tiny=True, max_steps=21,
                         max_seconds=120, monitor_overrides={"warmup": 1, "max_logit_bound": 1.0,
                                                             "drift_threshold": 0.5})[0]
        spec_d = {k: getattr(spec, k) for k in spec.__dataclass_fields__}
        assert worker.run(spec_d) == 0
    return Path(spec.run_dir)


def test_the_worker_records_each_monitored_step_once_decided_with_what_it_ran(tmp_path, monkeypatch):
    """On CUDA (async_transfer) a monitored step is decided at the next step(): the worker must
    record it then, with that step's own readings, variants and alerts (it used to record the
    previous monitored step's readings under the new step, and no alerts)."""
    now, later = (_worker_run(tmp_path, n, d, monkeypatch, "sdpa_observe") for n, d in (("sync", False),
                                                                                        ("deferred", True)))
    a, b = list(read_signals(now)), list(read_signals(later))
    assert [r["step"] for r in b] == list(range(0, 21, 2)) == [r["step"] for r in a]  # the last one too (flush)
    assert all(r["aligned"] for r in b)
    steps = read_steps(later)
    loss_at = dict(zip(steps["step"].tolist(), steps["loss"].tolist()))
    assert all(r["loss"] == loss_at[r["step"]] for r in b)  # each line holds its own step's readings
    for ra, rb in zip(a, b):  # CPU runs are deterministic: the same readings and alerts, decided later
        assert (ra["e"], ra["max_logit"], ra["index"], ra["alerts"]) == (rb["e"], rb["max_logit"], rb["index"],
                                                                          rb["alerts"])
    assert sum(len(r["alerts"]) for r in b) > 0
    s = analysis.analyze_run(later)
    assert s["in_training"]["replay_matches"] is True and not s["records_lag_corrected"]

    fix = _worker_run(tmp_path, "auto_fix", True, monkeypatch)  # auto_fix decided one step late, as on CUDA
    run = json.loads((fix / "run.json").read_text())
    recs = list(read_signals(fix))
    assert run["switches"], "the thresholds above make auto_fix switch a layer"
    first = run["switches"][0]
    ran = [r["variant"][first["layer"]] for r in recs]
    decided_from = [a["step"] for a in run["alerts"] if a["rule"] in ("delta_drift", "repeated_max_rise")][0]
    k = [r["step"] for r in recs].index(decided_from)
    assert ran[k] == "sdpa" and ran[k + 1] == "fp32_delta"  # what each step ran; the switch from the next one on
    assert [al for r in recs for al in r["alerts"]] == run["alerts"]


def test_figures_per_arm_and_an_overview(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from flashwatch.experiments.figures import figures_for

    runs = [_worker_run(tmp_path, "figs", False, monkeypatch, arm) for arm in ("sdpa_observe", "auto_fix")]
    paths = figures_for(runs, tmp_path / "figures")
    assert sorted(p.name for p in paths) == ["real-failure-auto_fix-tiny.png", "real-failure-overview-tiny.png",
                                             "real-failure-sdpa_observe-tiny.png"]
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size < 200_000  # small: a palette PNG


def test_load_records_undoes_the_lag_of_old_cuda_recordings(tmp_path, monkeypatch):
    """Recordings of the worker before the fix (GPU runs of 2026-11-30): line k+1 held monitored
    step k's readings under step k+1's name, with the variants of step k+1, no alerts, and a first
    line without readings. ``load_records`` gives back the true series."""
    good = _worker_run(tmp_path, "good", False, monkeypatch)  # auto_fix: variants change during the run
    truth = analysis.load_records(good)
    old = tmp_path / "old"
    old.mkdir()
    for f in ("run.json", "steps.csv"):
        (old / f).write_bytes((good / f).read_bytes())
    raw = list(gzip.open(good / "signals.jsonl.gz", "rt"))
    lines = []
    for k, line in enumerate(raw):  # what the old worker wrote at monitored step k
        rec = json.loads(line)
        if k == 0:
            shown = {**rec, **{f: [[ "NaN"] * len(row) for row in rec[f]] for f in ("e", "C", "z", "zw", "max_logit",
                                                                                   "sigma")},
                     "rm": [[None] * len(row) for row in rec["rm"]], "rm16": [[None] * len(row) for row in rec["rm16"]],
                     "rows": [0] * len(rec["rows"]), "loss": "NaN", "grad_norm": "NaN"}
        else:
            shown = json.loads(raw[k - 1])
        shown.update(step=rec["step"], index=rec["index"], variant=rec["variant"], alerts=[])
        shown.pop("aligned")
        lines.append(json.dumps(shown))
    (old / "signals.jsonl").write_text("\n".join(lines) + "\n")
    fixed = analysis.load_records(old)
    assert all(r["lag_corrected"] for r in fixed)
    assert len(fixed) == len(truth) - 1  # the last monitored step was never recorded
    for t, f in zip(truth, fixed):
        assert (t["step"], t["index"], t["e"], t["variant"], t["loss"], t["grad_norm"]) == \
               (f["step"], f["index"], f["e"], f["variant"], f["loss"], f["grad_norm"])
    s = analysis.analyze_run(old)
    assert s["records_lag_corrected"] and s["in_training"]["replay_matches"] is True  # alerts from run.json
    assert s["flashwatch"]["non_finite"]["first"] is None  # the empty first line is gone


# --- blow-up and lead time on synthetic series --------------------------------------------------------

def test_blowup_is_the_start_of_a_sustained_excursion_or_a_non_finite_loss():
    falling = [5.0 - 0.01 * i for i in range(300)]  # the 20-step median ends at ~2.1
    steps = list(range(400))
    assert analysis.blowup_step(steps, falling + [2.5] * 100) is None  # 1.19x the best median: not a blow-up
    assert analysis.blowup_step(steps, falling + [3.5] * 100) == 300  # where the loss left its trend
    spike = falling + [3.5] * 10 + [2.0] * 90  # ten steps up, then back: a spike, not a blow-up
    assert analysis.blowup_step(steps, spike) is None
    noisy = falling + [20.0 if i % 7 == 0 else 2.0 for i in range(100)]  # single bad batches: the median ignores them
    assert analysis.blowup_step(steps, noisy) is None
    assert analysis.blowup_step(steps, falling + [2.0] * 50 + [math.nan] + [2.0] * 49) == 350
    assert analysis.blowup_step(steps, falling + [3.5] * 15 + [math.inf] + [2.0] * 84) == 300  # inside an excursion
    tracker = analysis.BlowupTracker()
    for s, loss in zip(steps, falling + [3.5] * 100):
        tracker.update(s, loss)
    assert (tracker.blowup, tracker.confirmed_at) == (300, 328)  # the median crosses at 309, 20 steps of it


def _synthetic_run(run_dir: Path, *, drift_from: int, blowup_at: int, n_steps: int = 1000, interval: int = 10,
                   heads: int = 2) -> None:
    """A run folder written by hand: noise in e_t until ``drift_from``, then one sign; loss blows up at ``blowup_at``."""
    run_dir.mkdir(parents=True)
    rng = random.Random(0)
    monitor = {"mode": "own_kernel"}
    run = {"scenario": "synthetic", "seed": 0, "status": "completed", "recipe": {"interval": interval},
           "arm": {"name": "drift", "monitor": monitor, "expect": "failure", "inject": 0.0},
           "monitor_config": MonitorConfig(**monitor, interval=interval).to_dict()}
    (run_dir / "run.json").write_text(json.dumps(run))
    losses = [max(1.0, 3.0 - s / 200) if s < blowup_at else 4.0 for s in range(n_steps)]
    with open(run_dir / "steps.csv", "w") as f:
        f.write("step,loss,grad_norm,lr,time_s\n")
        for s, loss in enumerate(losses):
            f.write(f"{s},{loss},{0.5 + 0.01 * rng.random():.4f},0.001,{s * 0.01:.3f}\n")
    with open(run_dir / "signals.jsonl", "w") as f:
        for i, s in enumerate(range(0, n_steps, interval)):
            e = [[(1.0 if s >= drift_from else rng.choice((-0.5, 0.5))) * 2 ** -10 for _ in range(heads)]]
            f.write(json.dumps({"step": s, "index": i, "rows": [64], "low_precision": [True], "variant": ["plain"],
                                "monitor_error": False, "alerts": [], "loss": losses[s], "grad_norm": 0.5, "e": e,
                                "C": e, "z": e, "zw": e, "rm": [[0] * heads], "rm16": [[0] * heads],
                                "max_logit": [[5.0] * heads], "sigma": [[1.0] * heads]}) + "\n")


def test_lead_time_counts_from_the_first_alert_to_the_blowup(tmp_path):
    _synthetic_run(tmp_path / "run", drift_from=300, blowup_at=800)
    s = analysis.analyze_run(tmp_path / "run")
    assert s["blowup_step"] == 800
    first = s["flashwatch"]["delta_drift"]["first"]
    # the drift z of a head crosses 4 a few monitored steps after e_t keeps one sign
    assert 300 < first < 700
    assert s["flashwatch"]["delta_drift"]["lead"] == 800 - first == analysis.lead_time(800, first)
    assert s["flashwatch_mechanism_first"] == {"step": first, "rule": "delta_drift", "lead": 800 - first}
    assert s["baselines"]["qk_clip"]["first"] is None  # max logit 5 < 100
    assert s["extremes"]["drift_abs_z"]["max"] >= 4.0
    # a higher threshold fires later: the replay follows MonitorConfig
    later = analysis.analyze_run(tmp_path / "run", {"drift_threshold": 8.0})["flashwatch"]["delta_drift"]["first"]
    assert later > first
    cal = analysis.calibrate([tmp_path / "run"], sweeps=[("drift", "drift_threshold", (4.0, 100.0), ("delta_drift",))])
    assert [r["blown_up_alerted_before"] for r in cal["sweeps"]["drift"]] == [1, 0]


# --- baselines -----------------------------------------------------------------------------------------

def test_baselines_fire_on_what_they_watch():
    steps = list(range(100))
    losses = [2.0] * 50 + [7.0] + [2.0] * 49  # 3.5x the running mean: a Lightning spike (rtol 2)
    assert baselines.loss_spike(steps, losses) == [50]
    assert baselines.loss_spike(steps, [2.0] * 50 + [5.9] + [2.0] * 49) == []  # < 3x the mean
    assert baselines.loss_spike(steps, [2.0] * 50 + [math.nan] + [2.0] * 49) == [50]
    rng = random.Random(0)
    norms = [1.0 + 0.01 * rng.random() for _ in range(100)]
    norms[60] = 3.0
    assert 60 in baselines.zclip(steps, norms)
    assert baselines.zclip(steps[:25], norms[:25]) == []  # warm-up only
    assert baselines.qk_clip([0, 10, 20], [50.0, 100.0, 150.0]) == [20]  # strictly above tau


# --- records -------------------------------------------------------------------------------------------

def test_float32_values_round_trip_exactly():
    vals = np.random.default_rng(0).standard_normal(2000).astype(np.float32) * np.float32(1e3)
    vals = list(vals.astype(np.float64)) + [0.0, -0.0, 1e-40, 3.4e38, math.inf, -math.inf]
    for v in vals:
        text = f32_text(v)
        back = read_f32(json.loads(text, parse_float=str))
        assert back == v and math.copysign(1, back) == math.copysign(1, v)
    assert math.isnan(read_f32(json.loads(f32_text(math.nan))))
    assert read_f32(json.loads(f32_text(0.1), parse_float=str)) == 0.1  # not a float32: kept exactly


# --- CLI -----------------------------------------------------------------------------------------------

@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without CUDA")
def test_real_failure_without_cuda_says_so_and_exits_non_zero(tmp_path, capsys):
    code = _cli("real-failure", "--seeds", 0, "--out", tmp_path / "runs", "--json", tmp_path / "r.json")
    err = capsys.readouterr().err
    assert code == 2
    assert "needs a CUDA GPU" in err and "--device cpu --tiny" in err
    assert not (tmp_path / "runs").exists()
    assert _cli("real-failure", "--device", "cpu", "--seeds", 0, "--out", tmp_path / "runs") == 2  # not without --tiny
    # the plan can still be checked here
    assert _cli("real-failure", "--dry-run", "--seeds", "0-1", "--parallel", 8, "--devices", "0,1") == 0
    out = capsys.readouterr().out
    assert "real-failure/fp32/1" in out and "estimated wall time" in out
    assert "lr1e-3" not in out  # the gentle-lr healthy reference is not a default arm...
    assert _cli("real-failure", "--dry-run", "--arms", "sdpa_observe_lr1e-3@0-4", "--parallel", 5) == 0
    out = capsys.readouterr().out  # ...but can be asked for by name, with seeds
    assert "real-failure/sdpa_observe_lr1e-3/4" in out and "real-failure/sdpa_observe/" not in out


def test_the_gentle_lr_arm_is_the_probe_at_lr_1e_3_observed_in_bf16():
    from flashwatch.experiments.scenarios import REAL_FAILURE

    arm = {a.name: a for a in REAL_FAILURE.arms}["sdpa_observe_lr1e-3"]
    assert (arm.lr, arm.precision, arm.monitor, arm.expect) == (1e-3, "bf16", {"mode": "observe"}, "healthy")
    assert arm.name not in REAL_FAILURE.default_arms


def test_help_is_a_manual(capsys):
    with pytest.raises(SystemExit) as exc:
        experiment_main(["--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    for words in ("Blow-up", "--parallel", "--dry-run", "analyze", "CUDA_VISIBLE_DEVICES"):
        assert words in text
    with pytest.raises(SystemExit):
        experiment_main(["early-warning", "--help"])
    assert "INJECTED" in capsys.readouterr().out
