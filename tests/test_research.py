"""research.experiments: runner, worker, recordings, figures, CLI (CPU, real components).

The research harness runs from the checkout (tests/conftest.py puts the repository root on sys.path,
after the installed packages); it writes recordings that the product's replay (flashwatch.replay) reads.
"""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
import math
from pathlib import Path

import pytest

import flashwatch.collect
import torch

from flashwatch.cli import main as flashwatch_main
from flashwatch.replay import baselines, playback, runs
from flashwatch.replay.records import read_signals, read_steps
from research.experiments.cli import main as experiment_main
from research.experiments.runner import make_plan, run_plan
from research.experiments.scenarios import INJECTION

ROOT = Path(__file__).resolve().parents[1]


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

    # a later call adds a seed; the earlier runs stay
    assert _cli(*common, "--seeds", 1, "--arms", "healthy") == 0
    data = json.loads(results.read_text())
    assert set(data["runs"]) == {"injection/healthy/0", "injection/injected_auto_fix/0", "injection/healthy/1"}
    assert data["aggregate"]["injection"]["healthy"]["seeds"] == [0, 1]

    # the product's analyze replays the recordings with other thresholds, without training
    capsys.readouterr()
    assert flashwatch_main(["experiment", "analyze", str(out), "--set", "drift_threshold=100",
                            "--set", "max_logit_bound=1e9", "--set", "warmup=1",
                            "--markdown", str(tmp_path / "table.md")]) == 0
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
    from research.experiments import worker
    from research.experiments.scenarios import REAL_FAILURE

    with monkeypatch.context() as m:
        if defer:
            m.setattr(flashwatch.collect, "start_host_copy", lambda values, async_transfer: (values.clone(), _CopyDone()))
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
    s = runs.analyze_run(later)
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
    from research.experiments.figures import figures_for

    recorded = [_worker_run(tmp_path, "figs", False, monkeypatch, arm) for arm in ("sdpa_observe", "auto_fix")]
    paths = figures_for(recorded, tmp_path / "figures")
    assert sorted(p.name for p in paths) == ["real-failure-auto_fix-tiny.png", "real-failure-overview-tiny.png",
                                             "real-failure-sdpa_observe-tiny.png"]
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size < 200_000  # small: a palette PNG


def test_load_records_undoes_the_lag_of_old_cuda_recordings(tmp_path, monkeypatch):
    """Older recordings (the GPU runs in results/gpu-2026-11-30): line k+1 held monitored
    step k's readings under step k+1's name, with the variants of step k+1, no alerts, and a first
    line without readings. ``load_records`` gives back the true series."""
    good = _worker_run(tmp_path, "good", False, monkeypatch)  # auto_fix: variants change during the run
    truth = playback.load_records(good)
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
    fixed = playback.load_records(old)
    assert all(r["lag_corrected"] for r in fixed)
    assert len(fixed) == len(truth) - 1  # the last monitored step was never recorded
    for t, f in zip(truth, fixed):
        assert (t["step"], t["index"], t["e"], t["variant"], t["loss"], t["grad_norm"]) == \
               (f["step"], f["index"], f["e"], f["variant"], f["loss"], f["grad_norm"])
    s = runs.analyze_run(old)
    assert s["records_lag_corrected"] and s["in_training"]["replay_matches"] is True  # alerts from run.json
    assert s["flashwatch"]["non_finite"]["first"] is None  # the empty first line is gone


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


def test_the_real_failure_target_asks_for_1000_steps_of_lead(tmp_path):
    """The scenario's definition says so (Scenario.min_lead); the command passes it to the results JSON."""
    from research.experiments.scenarios import REAL_FAILURE

    assert REAL_FAILURE.min_lead == 1000 and INJECTION.min_lead is None
    results = tmp_path / "r.json"
    assert _cli("real-failure", "--device", "cpu", "--tiny", "--arms", "fp32", "--seeds", 0, "--max-steps", 2,
                "--out", tmp_path / "runs", "--json", results) == 0
    data = json.loads(results.read_text())
    assert data["min_lead"] == {"real-failure": 1000}
    assert data["targets"]["real-failure"]["lead_at_least"] == {"steps": 1000, "runs": 0, "of": 0}


def test_the_gentle_lr_arm_is_the_real_failure_recipe_at_lr_1e_3_observed_in_bf16():
    from research.experiments.scenarios import REAL_FAILURE

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


def test_figures_command_says_what_was_wrong(tmp_path, capsys):
    assert experiment_main(["figures", str(tmp_path / "nowhere"), "--out", str(tmp_path / "f")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_the_research_entry_points_run_from_the_repository_root():
    """``python -m research.experiments`` and ``python -m research.lab`` from a checkout."""
    for module, words in (("research.experiments", "real-failure"), ("research.lab", "--quick")):
        out = subprocess.run([sys.executable, "-m", module, "--help"], cwd=ROOT, capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 0, out.stderr
        assert words in out.stdout
    out = subprocess.run([sys.executable, "-m", "research.experiments", "list"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "injected_auto_fix" in out.stdout and "issue" not in out.stdout


def test_flashwatch_never_imports_research():
    """The product does not depend on the research harness (the reverse is the rule)."""
    offenders = [str(p.relative_to(ROOT)) for p in (ROOT / "flashwatch").rglob("*.py")
                 if "research" in "".join(line for line in p.read_text().splitlines()
                                          if line.lstrip().startswith(("import ", "from ")))]
    assert not offenders, offenders


def _seed_split_spec(out: Path, **extra) -> dict:
    from dataclasses import asdict

    from research.experiments.scenarios import get_scenario

    spec = make_plan([(get_scenario("seed-split"), ["sdpa_observe"])], [100], out, device="cpu", tiny=True,
                     max_steps=40, max_seconds=600, resumable=True)[0]
    return {**asdict(spec), **extra}


def test_a_run_cut_into_pieces_resumes_exactly(tmp_path):
    """Three checkpointed pieces record the same losses and monitored steps as one uninterrupted run."""
    from research.experiments import worker

    whole = _seed_split_spec(tmp_path / "whole")
    assert worker.run(whole) == 0
    pieces = _seed_split_spec(tmp_path / "pieces", piece_steps=17)
    statuses = []
    for _ in range(4):
        assert worker.run(pieces) == 0
        statuses.append(json.loads((Path(pieces["run_dir"]) / "run.json").read_text())["status"])
        if statuses[-1] != "paused":
            break
    assert statuses == ["paused", "paused", "completed"]
    a, b = Path(whole["run_dir"]), Path(pieces["run_dir"])
    cols = lambda d: [line.split(",")[:3] for line in (d / "steps.csv").read_text().splitlines()]  # time_s differs
    assert cols(a) == cols(b) and len(cols(a)) == 41
    assert gzip.open(a / "signals.jsonl.gz").read() == gzip.open(b / "signals.jsonl.gz").read()
    assert not (b / "checkpoint.pt").exists()
    run = json.loads((b / "run.json").read_text())
    assert len(run["pieces"]) == 2 and run["steps_done"] == 40
    assert run["monitor_errors"] == 0 and not any(r["monitor_error"] for r in read_signals(b))
    assert all(k in read_signals(b).__next__() for k in ("push", "push_true", "align", "coh"))


def test_a_blow_up_is_run_past_by_after_blowup_steps(tmp_path, monkeypatch):
    """With after_blowup the run goes on to confirmation + N steps; without, it stops at confirmation."""
    from flashwatch.replay import blowup
    from research.experiments import worker

    class Early(blowup.BlowupTracker):  # confirms a blow-up at step 9 whatever the loss does
        def update(self, step, loss):
            if step >= 9 and self.blowup is None:
                self.blowup, self.confirmed_at = 5, 9
            return self.blowup

    monkeypatch.setattr(blowup, "BlowupTracker", Early)
    for after, expected in ((0, 10), (12, 22)):
        spec = _seed_split_spec(tmp_path / f"after{after}", after_blowup=after, flush_every=1)
        assert worker.run(spec) == 0
        run = json.loads((Path(spec["run_dir"]) / "run.json").read_text())
        assert (run["status"], run["blowup_step"], run["steps_done"]) == ("blown_up", 5, expected)


def test_the_preregistered_analysis_runs_end_to_end(tmp_path, monkeypatch):
    """calibrate -> thresholds -> test on tiny CPU runs: every rule and baseline gets a row, the
    outcome definitions hold, a survivor's peak sets the threshold."""
    from research import early_warning as ew
    from research.experiments import worker

    dirs = []
    for seed in (100, 101):
        spec = _seed_split_spec(tmp_path / f"s{seed}")
        spec.update(seed=seed, run_dir=str(tmp_path / f"s{seed}" / "run"), max_steps=60)
        assert worker.run(spec) == 0
        dirs.append(Path(spec["run_dir"]))
    monkeypatch.setattr(ew, "START_STEP", 0)
    frozen = ew.calibrate(dirs[:1])
    assert frozen["threshold_source"] == "calibration survivors" and frozen["thresholds"]["chain"] == 1.0
    peak = ew._score_upto(ew.scores(dirs[0])["max_logit"], None)
    assert frozen["thresholds"]["max_logit"] == pytest.approx(peak + 0.05 * abs(peak))
    result = ew.evaluate(dirs, frozen)
    assert set(result["table"]) == set(ew.RULES) | set(ew.BASELINES)
    assert result["table"]["max_logit"]["survivors"] == 2 and result["table"]["max_logit"]["blowups"] == 0
    # the calibration run's own peak is below its threshold: no false alarm there
    assert result["runs"][str(dirs[0])]["first_fire"]["max_logit"] is None
    assert "| `max_logit` |" in ew.markdown(result)
    # two survivors, no blow-up: fewer than six in a group, so no rule has a verdict yet
    assert result["table"]["max_logit"]["verdict"] == "undecided" and not result["table"]["max_logit"]["passes"]


@pytest.mark.parametrize("n_b,early,n_s,false,expected", [
    (23, 20, 1, 0, "undecided"),  # detection passes, one survivor: the false-alarm half cannot be judged
    (23, 17, 1, 0, "fail"),       # 17/23 < 80% with lead >= 1,000: fails whatever the survivors
    (6, 5, 7, 1, "pass"),         # 5/6 >= 80%, 1/7 false alarms
    (6, 5, 7, 2, "fail"),         # 2/7 > 1/7
    (6, 4, 7, 0, "fail"),         # 4/6 < 80%
    (5, 5, 7, 0, "undecided"),    # five blow-ups: too few to judge detection
    (8, 8, 6, 2, "fail"),         # 2/6 false alarms with six survivors
])
def test_the_verdict_needs_six_runs_in_each_group(n_b, early, n_s, false, expected):
    from research import early_warning as ew
    assert ew._verdict(n_b, early, n_s, false) == expected


def test_the_blowup_ratio_prediction_is_judged_only_where_the_run_decides_it():
    """b <= 3 f holds or fails on blow-ups; a survivor fails it only once it ran past 3 f; no alarm: no judgement."""
    from research import early_warning as ew

    def run(seed, f, b, last):
        return {"seed": seed, "first_fire": {"chain": f},
                "outcome": {"blowup": b, "last_step": last, "survivor": b is None}}
    result = {"runs": {"a": run(1, 2000, 5000, 6000),    # 2.5 x: holds
                       "b": run(2, 2000, 7000, 8000),    # 3.5 x: fails
                       "c": run(3, 3000, None, 9999),    # survived, but only to 3.33 x: fails
                       "d": run(4, 5000, None, 9999),    # survived to 2 x: not decided
                       "e": run(5, None, None, 9999)}}   # no alarm
    rows = {r["seed"]: r for r in ew.blowup_ratios(result, "chain", 3.0)}
    assert [rows[s]["holds"] for s in (1, 2, 3, 4, 5)] == [True, False, False, None, None]
    assert rows[1]["ratio"] == 2.5 and rows[3]["ratio"] is None


def test_the_timeline_figure_is_drawn_and_unknown_rules_are_refused(tmp_path):
    pytest.importorskip("matplotlib")
    from research import early_warning as ew
    result = {"runs": {"a": {"seed": 1, "first_fire": {"chain": 2000}, "outcome": {"blowup": 5000, "last_step": 6000,
                                                                                  "survivor": False}},
                       "b": {"seed": 2, "first_fire": {"chain": None}, "outcome": {"blowup": None, "last_step": 9999,
                                                                                  "survivor": True}}}}
    path = tmp_path / "r.json"
    path.write_text(json.dumps(result))
    out = tmp_path / "f.png"
    assert ew.main(["figure", f"test={path}", "--rules", "chain", "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(SystemExit, match="unknown rule"):
        ew.main(["figure", str(path), "--rules", "chian", "--out", str(out)])


def test_packed_recordings_replay_as_the_originals(tmp_path):
    """research.recordings drops only the fields the replay rebuilds: the replayed signals are equal."""
    from flashwatch.replay.records import read_signals
    from research import early_warning as ew
    from research import recordings
    from research.experiments import worker

    spec = _seed_split_spec(tmp_path / "a")
    spec.update(max_steps=40)
    assert worker.run(spec) == 0
    run = Path(spec["run_dir"])
    archive = tmp_path / "runs.tar.xz"
    recordings.pack([run], archive)
    (unpacked,) = recordings.unpack(archive, tmp_path / "out")
    assert (unpacked / "steps.csv").read_bytes() == (run / "steps.csv").read_bytes()
    original, packed = list(read_signals(run)), list(read_signals(unpacked))
    assert len(original) == len(packed) > 0 and all("C" not in r and "z" not in r for r in packed)
    for a, b in zip(original, packed):
        for key in ("e", "max_logit", "sigma", "push", "coh"):
            assert str(a[key]) == str(b[key])  # NaN-safe equality of the kept fields
    assert json.dumps(ew.scores(run), default=str) == json.dumps(ew.scores(unpacked), default=str)


def test_a_piece_that_fails_after_its_checkpoint_loses_no_recording(tmp_path, monkeypatch):
    """A resumed piece that fails (its recordings get compressed) is resumed again with every line kept."""
    from research.experiments import worker

    whole = _seed_split_spec(tmp_path / "whole")
    assert worker.run(whole) == 0
    spec = _seed_split_spec(tmp_path / "pieces", piece_steps=17)
    assert worker.run(spec) == 0  # paused at 17
    real_load = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("disk hiccup")))
    assert worker.run(spec) == 1  # fails while resuming; the checkpoint stays
    monkeypatch.setattr(torch, "load", real_load)
    a, b = Path(whole["run_dir"]), Path(spec["run_dir"])
    for _ in range(3):
        worker.run(spec)
        if json.loads((b / "run.json").read_text())["status"] != "paused":
            break
    assert json.loads((b / "run.json").read_text())["status"] == "completed"
    assert gzip.open(a / "signals.jsonl.gz").read() == gzip.open(b / "signals.jsonl.gz").read()


@pytest.mark.parametrize("arm", ["fp8_plain", "fp8_rounded_sum"])
def test_the_fp8_failure_arms_run_tiny_on_the_cpu(tmp_path, arm):
    """The fp8-failure scenario's code path: the FP8 SDPA shim observed by the Monitor at the FP8 grid."""
    import gc
    import gzip
    import json

    import torch.nn.functional as F

    from research.experiments import worker
    from research.experiments.scenarios import get_scenario

    gc.collect()  # a Monitor an earlier test dropped without detach() intercepts SDPA until it is collected
    sdpa = F.scaled_dot_product_attention
    spec = make_plan([(get_scenario("fp8-failure"), [arm])], [0], tmp_path, device="cpu", tiny=True, max_steps=6,
                     max_seconds=120)[0]
    assert worker.run({k: getattr(spec, k) for k in spec.__dataclass_fields__}) == 0
    assert F.scaled_dot_product_attention is sdpa  # the shim is removed after the run
    run = json.loads((tmp_path / "fp8-failure" / arm / "seed0" / "run.json").read_text())
    assert run["status"] == "completed" and run["monitor_config"]["format"] == "fp8_e4m3"
    assert run["arm"]["format"] == "fp8_e4m3" and run["arm"]["attention"] == "format"
    with gzip.open(tmp_path / "fp8-failure" / arm / "seed0" / "signals.jsonl.gz", "rt") as f:
        first = json.loads(f.readline())
    # E4M3's grid ties every key within 0.032 of the max: more rows than the FP32 test within eps
    assert sum(map(sum, first["rmf"])) > sum(map(sum, first["rm"]))


def test_time_matched_auc_reads_each_survivor_at_the_blowups_horizon(monkeypatch):
    """The fourth protocol's secondary test on stand-in runs: a survivor's peak is taken up to the
    blow-up's B - lead (a score that only grows with training time gains nothing), ties count half,
    incomplete runs are left out (or, for older recordings, compared only where both were measured),
    and the AUC equals a brute-force float64 count."""
    from research import early_warning as ew
    grow = [(t, t / 1000) for t in range(500, 20001, 10)]  # the same rising score in every run
    runs = {  # name: (blow-up step or None, measured through, score series)
        "b1": (5000, 5000, [(t, 9.0 if t >= 3000 else 0.0) for t in range(500, 5001, 10)]),
        "b2": (8000, 8000, grow),
        "s1": (None, 19990, grow),
        "s2": (None, 19990, [(t, 1.0) for t in range(500, 20001, 10)]),
        "s3": (None, 4000, grow),  # measured only to 4,000 (its monitoring stopped)
    }
    monkeypatch.setattr(ew, "outcome", lambda d: {"blowup": runs[d.name][0], "confirmed": True,
                                                  "survivor": runs[d.name][0] is None})
    monkeypatch.setattr(ew, "monitoring", lambda d, upto: {"complete": runs[d.name][1] >= 19990 or runs[d.name][0]
                                                           is not None, "measured_through": runs[d.name][1]})
    monkeypatch.setattr(ew, "scores", lambda d, theta: {r: runs[d.name][2] for r in ew.AUC_RULES})
    monkeypatch.setattr(ew, "read_run", lambda d: {"seed": d.name})
    frozen = {"thresholds": {"wq_error_coherence": 0.5}}
    dirs = [Path(n) for n in runs]
    result = ew.time_matched_auc(dirs, frozen, lead=1000)
    assert result["left_out"] == [{"run": "s3", "why": "monitoring incomplete"}]
    # b1 at h = 4,000: 9.0 against s1's 4.0 and s2's 1.0 -> 1, 1; b2 at h = 7,000: 7.0 against s1's 7.0 (tie) and 1.0
    row = result["table"]["max_logit"]
    assert row["auc"] == pytest.approx((1 + 1 + 0.5 + 1) / 4) and row["pairs"] == 4
    assert row["low"] <= row["auc"] <= row["high"] and row["verdict"] == "undecided"  # 2 + 2 runs: too few
    assert (row["blowups"], row["survivors"]) == (2, 2)
    loose = ew.time_matched_auc(dirs, frozen, lead=1000, allow_incomplete=True)
    # s3 joins, compared only with b1 (h = 4,000 <= 4,000): 9.0 against 4.0
    assert loose["table"]["max_logit"]["pairs"] == 5 and loose["table"]["max_logit"]["auc"] == pytest.approx(4.5 / 5)


def test_auc_interval_and_verdict_against_a_brute_force_count():
    from research import early_warning as ew
    g = torch.Generator().manual_seed(3)
    b = torch.randn(7, generator=g, dtype=torch.float64).add(1.0).tolist()
    s = torch.randn(7, 8, generator=g, dtype=torch.float64).tolist()
    s[2][3] = b[2]  # a tie
    m = ew.pair_matrix(b, s)
    brute = sum((1.0 if b[i] > s[i][j] else 0.5 if b[i] == s[i][j] else 0.0) for i in range(7) for j in range(8)) / 56
    out = ew.auc_with_interval(m, resamples=500)
    assert out["auc"] == pytest.approx(brute, abs=1e-15) and out["pairs"] == 56
    assert out["low"] < out["auc"] < out["high"]
    assert ew.auc_with_interval(m, resamples=500) == out  # the generator is seeded
    with pytest.raises(SystemExit, match="--lead must be >= 0"):
        ew.main(["auc", "x", "--thresholds", "t.json", "--lead", "-5", "--out", "o.json"])


def test_a_test_names_its_protocol_file_or_is_refused(tmp_path):
    from research import early_warning as ew
    with pytest.raises(SystemExit, match="--protocol nope.md: no such file"):
        ew.main(["test", "x", "--thresholds", "t.json", "--out", str(tmp_path / "o.json"), "--protocol", "nope.md"])


def test_the_fourth_protocol_leaves_incomplete_runs_out_of_every_count(monkeypatch):
    """evaluate(require_complete=True): a run whose monitoring failed before its blow-up (or end)
    is listed apart and counted nowhere; without the flag it is counted, its monitoring reported."""
    from research import early_warning as ew
    runs = {"b1": (5000, True), "b2": (6000, False), "s1": (None, True), "s2": (None, False), "u1": (7000, True)}
    monkeypatch.setattr(ew, "outcome", lambda d: {"blowup": runs[d.name][0], "confirmed": d.name != "u1",
                                                  "survivor": runs[d.name][0] is None, "last_step": 9999,
                                                  "tail_median_loss": 0.6 if d.name == "u1" else 1.0,
                                                  "best_median_before": 0.5})
    monkeypatch.setattr(ew, "monitoring", lambda d, upto: {"complete": runs[d.name][1], "failed_steps": 0 if
                                                           runs[d.name][1] else 9, "measured_through": 4000})
    monkeypatch.setattr(ew, "scores", lambda d, theta_coherence: {r: [(600, 9.0)] for r in (*ew.RULES, "qk_clip",
                                                                                           "zclip", "loss_spike")})
    monkeypatch.setattr(ew, "read_run", lambda d: {"seed": d.name})
    frozen = {"protocol": "p4", "thresholds": {**{r: 1.0 for r in ew.RULES}, "zclip": 3.0}}
    dirs = [Path(n) for n in runs]
    strict = ew.evaluate(dirs, frozen, require_complete=True)
    assert [e["seed"] for e in strict["excluded_incomplete"]] == ["b2", "s2"]
    row = strict["table"]["max_logit"]
    assert (row["blowups"], row["survivors"], row["false_alarms"]) == (1, 1, 1)
    assert "monitoring incomplete (left out)" in ew.runs_markdown(strict)
    # a blow-up that did not last is left out, listed by its seed with the numbers that decided it
    assert [e["seed"] for e in strict["excluded_unconfirmed"]] == ["u1"]
    assert "| u1 | 7,000, not confirmed (left out) | 0.600 / 0.500 | 10,000 | |" in ew.runs_markdown(strict)
    loose = ew.evaluate(dirs, frozen)
    assert loose["excluded_incomplete"] == [] and loose["monitoring_incomplete"] == ["b2", "s2"]
    assert (loose["table"]["max_logit"]["blowups"], loose["table"]["max_logit"]["survivors"]) == (2, 2)


def test_the_ninth_protocol_counts_a_survivor_only_at_the_end_of_its_schedule(monkeypatch):
    """evaluate(horizon=10_000): a run without a blow-up that stopped before the horizon is no
    survivor and is listed apart; one that ran to it is; a blow-up counts wherever it stopped."""
    from research import early_warning as ew
    runs = {"b1": (5000, 5999), "s1": (None, 9999), "s2": (None, 7499)}
    monkeypatch.setattr(ew, "outcome", lambda d: {"blowup": runs[d.name][0], "confirmed": True,
                                                  "survivor": runs[d.name][0] is None, "last_step": runs[d.name][1],
                                                  "tail_median_loss": 1.0, "best_median_before": 0.5})
    monkeypatch.setattr(ew, "monitoring", lambda d, upto: {"complete": True, "failed_steps": 0, "measured_through": 1})
    monkeypatch.setattr(ew, "scores", lambda d, theta_coherence: {r: [(600, 9.0)] for r in (*ew.RULES, "qk_clip",
                                                                                           "zclip", "loss_spike")})
    monkeypatch.setattr(ew, "read_run", lambda d: {"seed": d.name})
    frozen = {"protocol": "p", "thresholds": {**{r: 1.0 for r in ew.RULES}, "zclip": 3.0}}
    result = ew.evaluate([Path(n) for n in runs], frozen, require_complete=True, horizon=10_000)
    assert [e["seed"] for e in result["excluded_short"]] == ["s2"]
    assert (result["table"]["chain"]["blowups"], result["table"]["chain"]["survivors"]) == (1, 1)
    assert "| s2 | no blow-up, stopped before 10,000 steps (left out) | | 7,500 | |" in ew.runs_markdown(result)
    assert ew.evaluate([Path(n) for n in runs], frozen)["table"]["chain"]["survivors"] == 2
    with pytest.raises(SystemExit, match="--horizon must be a positive number of steps"):
        ew.main(["test", "x", "--thresholds", "t.json", "--out", "o.json", "--horizon", "0"])


def test_a_run_records_the_pinned_commit_of_an_archived_copy(tmp_path):
    """A `git archive` copy run from inside another checkout (research/gpu_batch.sh's pinned code)
    records the commit written beside it, not the enclosing checkout's HEAD, and which copy ran."""
    import shutil

    root = Path(__file__).resolve().parents[1]
    copy = tmp_path / "pinned"
    shutil.copytree(root / "research", copy / "research", ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "CODE_COMMIT").write_text("abc1234\n")
    code = "from research.experiments.worker import _versions; import json; print(json.dumps(_versions()))"
    out = subprocess.run([sys.executable, "-c", code], cwd=copy, capture_output=True, text=True, timeout=120,
                         env={**__import__("os").environ, "PYTHONPATH": str(copy)})
    assert out.returncode == 0, out.stderr
    v = json.loads(out.stdout.strip().splitlines()[-1])
    assert v["git_commit"] == "abc1234"
    import flashwatch

    assert v["flashwatch_path"] == str(Path(flashwatch.__file__).resolve().parent)


def _stand_in_runs(monkeypatch, runs):
    """Stand-in run folders for the early-warning analysis: ``runs`` maps a name to (blow-up step
    or None, last step, score series); every blow-up confirmed, every run completely monitored."""
    from research import early_warning as ew
    monkeypatch.setattr(ew, "outcome", lambda d: {"blowup": runs[d.name][0], "confirmed": True,
                                                  "survivor": runs[d.name][0] is None, "last_step": runs[d.name][1]})
    monkeypatch.setattr(ew, "monitoring", lambda d, upto: {"complete": True, "measured_through": runs[d.name][1]})
    monkeypatch.setattr(ew, "scores", lambda d, theta: {r: runs[d.name][2] for r in ew.AUC_RULES})
    monkeypatch.setattr(ew, "read_run", lambda d: {"seed": d.name})
    return [Path(n) for n in runs]


def test_landmark_controls_are_runs_still_healthy_margin_steps_after_the_blowup(monkeypatch):
    """The fifth protocol's test on stand-in runs: blow-up i is compared, at B_i - lead, with every run
    still healthy at B_i + margin (later blow-ups and survivors, never itself); ties count half; the
    AUC equals a brute-force count, and the interval comes from resampling runs."""
    from research import early_warning as ew
    step = lambda f: [(t, f(t)) for t in range(500, 20001, 10)]
    runs = {  # name: (blow-up, last step, score)
        "early": (5000, 6000, step(lambda t: 9.0 if t >= 3000 else 0.0)),
        "mid": (7000, 8000, step(lambda t: t / 1000)),
        "late": (8500, 9500, step(lambda t: 1.0)),
        "surv": (None, 20000, step(lambda t: t / 1000)),
    }
    dirs = _stand_in_runs(monkeypatch, runs)
    result = ew.landmark_auc(dirs, {"thresholds": {"wq_error_coherence": 0.5}}, lead=1000, margin=2000, resamples=300)
    # early (B 5,000): controls healthy at 7,000 -> late (through 8,499) and surv; mid (B 7,000): healthy at
    # 9,000 -> surv only (late blew up at 8,500); late (B 8,500): surv
    assert sorted(map(tuple, result["pair_list"])) == [("early", "late"), ("early", "surv"), ("late", "surv"),
                                                        ("mid", "surv")]
    assert (result["cases"], result["controls"]) == (3, 2)
    # at h = 4,000: early 9.0 vs late 1.0 and surv 4.0 -> 1, 1; mid at 6,000: 6.0 vs surv 6.0 -> 0.5;
    # late at 7,500: 1.0 vs surv 7.5 -> 0
    row = result["table"]["max_logit"]
    assert row["auc"] == pytest.approx(2.5 / 4)
    assert row["low"] <= row["auc"] <= row["high"] and row["verdict"] == "undecided"  # 3 cases, 2 controls
    assert result["table"]["chain"]["minus_baseline"] == pytest.approx(0.0)  # same series as the baseline here
    # concordance at 6,000: runs healthy there are mid, late, surv (early blew up at 5,000); pairs
    # (mid, late), (mid, surv), (late, surv): mid 6.0 vs late 1.0 -> 1, vs surv 6.0 -> 0.5; late 1.0 vs surv 6.0 -> 0
    assert result["concordance_pairs"] == 3
    assert result["concordance"]["max_logit"]["auc"] == pytest.approx(1.5 / 3)
    assert "Claim 1 (`chain` separates, lower end above 0.7): undecided. Claim 2 (`chain` beats `qk_clip`" \
        in ew.landmark_markdown(result)
    # with enough cases, only the primary rule's row carries a verdict; the others are marked as no claim
    for rule, row in result["table"].items():
        row["verdict"] = "separates" if rule in ("chain", "max_logit") else "does not separate"
    text = ew.landmark_markdown(result)
    row = lambda rule: next(l for l in text.splitlines() if l.startswith(f"| `{rule}` |"))
    assert row("chain").endswith("| separates |")
    assert row("max_logit").endswith("| lower end above 0.7 (no claim) |")
    assert row("zclip").endswith("| lower end not above 0.7 (no claim) |")


def test_landmark_bootstrap_against_a_brute_force_resample():
    """The run-level bootstrap re-forms pairs among the drawn runs: one resample, drawn by hand with the
    same generator, gives the same mean."""
    from research import early_warning as ew
    g = torch.Generator().manual_seed(5)
    n = 9
    m = torch.where(torch.rand(n, n, generator=g, dtype=torch.float64) < 0.4,
                    (torch.rand(n, n, generator=g, dtype=torch.float64) > 0.3).double(), torch.full((n, n), math.nan, dtype=torch.float64))
    m.fill_diagonal_(math.nan)
    out = ew.landmark_bootstrap({"qk_clip": m, "chain": 1 - m}, resamples=1)
    idx = torch.randint(n, (n,), generator=torch.Generator().manual_seed(0)).tolist()
    vals = [m[a, b].item() for a in idx for b in idx if not math.isnan(m[a, b].item())]
    assert out["qk_clip"]["low"] == pytest.approx(sum(vals) / len(vals))
    assert out["chain"]["minus_baseline"] == pytest.approx(1 - 2 * ew._pair_mean(m))
    with pytest.raises(SystemExit, match="--margin must be >= 0"):
        ew.main(["landmark", "x", "--thresholds", "t.json", "--margin", "-1", "--out", "o.json"])
    with pytest.raises(SystemExit, match="--protocol nope.md: no such file"):
        ew.main(["landmark", "x", "--thresholds", "t.json", "--out", "o.json", "--protocol", "nope.md"])


def test_outcomes_report_blowups_and_survivors_and_no_rule(monkeypatch):
    """What a protocol may report before its analysis: counts of confirmed and unconfirmed blow-ups,
    survivors and incompletely monitored runs, and a line per run; no score is read."""
    from research import early_warning as ew
    table = {"a": (7000, True, True), "b": (9000, False, True), "c": (None, False, True), "d": (8000, True, False)}
    monkeypatch.setattr(ew, "outcome", lambda d: {
        "blowup": table[d.name][0], "confirmed": table[d.name][1], "survivor": table[d.name][0] is None,
        "last_step": 19999 if table[d.name][0] is None else table[d.name][0] + 1000,
        "tail_median_loss": 1.5, "best_median_before": 0.5})
    monkeypatch.setattr(ew, "monitoring", lambda d, upto: {"complete": table[d.name][2], "measured_through": 4000,
                                                          "failed_steps": 3, "monitored_steps": 900})
    monkeypatch.setattr(ew, "read_run", lambda d: {"seed": d.name})
    monkeypatch.setattr(ew, "scores", lambda *a, **k: pytest.fail("outcomes must not read any rule's score"))
    result = ew.outcomes([Path(n) for n in table])
    assert result["counts"] == {"runs": 4, "survivors": 1, "blowups_confirmed": 2, "blowups_unconfirmed": 1,
                                "monitoring_incomplete": 1}
    text = ew.outcomes_markdown(result)
    assert "| b | 9,000, not confirmed |" in text and "| c | - (survived) |" in text
    assert "| d | 8,000 | 1.500 / 0.500 | 9,001 | 4,000 (3 of 900 failed after) |" in text


def _recorded_run(folder: Path, seed: int, losses, switch_at: int | None = None, slower_after: float = 0.0) -> Path:
    """A run folder as the worker writes it: steps.csv (0.06 s a step, ``slower_after`` more per
    step after ``switch_at``) and run.json (seed, the auto_fix switches)."""
    folder.mkdir(parents=True)
    t, lines = 0.0, ["step,loss,grad_norm,lr,time_s"]
    for step, loss in enumerate(losses):
        t += 0.06 + (slower_after if switch_at is not None and step > switch_at else 0.0)
        lines.append(f"{step},{loss},1.0,0.0015,{t:.3f}")
    (folder / "steps.csv").write_text("\n".join(lines) + "\n")
    switches = [] if switch_at is None else [{"step": switch_at, "layer": 1, "rule": "delta_drift", "to": "fp32_delta"}]
    (folder / "run.json").write_text(json.dumps({"seed": seed, "switches": switches}))
    return folder


def _curve(n: int, blowup: int | None = None, level: float = 1.0) -> list[float]:
    """A flat loss of ``level`` (a little noise), five times higher from ``blowup`` on."""
    g = torch.Generator().manual_seed(n + (blowup or 0))
    noise = (torch.rand(n, generator=g) * 0.02).tolist()
    return [(5.0 if blowup is not None and s >= blowup else level) + noise[s] for s in range(n)]


def test_auto_fix_effect_pairs_seeds_and_counts_prevented_blowups(tmp_path):
    """Seven twins blow up at 9,000; six auto_fix runs survive 13,000 steps, one blows up at 11,000:
    6 of 7 prevented, the claim (>= 80% of >= 5) shown; the loss ratio over the window before the
    blow-ups, the survivor's late ratio and the speed around the switch come from the recordings.
    A fix run cut before 13,000 steps leaves the verdict undecided."""
    from research import auto_fix_effect as afe

    twins, fixes = tmp_path / "twins", tmp_path / "fixes"
    for seed in range(400, 407):
        _recorded_run(twins / f"s{seed}", seed, _curve(10_500, blowup=9_000))
        fix_blowup = 11_000 if seed == 406 else None
        _recorded_run(fixes / f"s{seed}", seed, _curve(13_000 if fix_blowup is None else 12_200, blowup=fix_blowup,
                                                       level=1.02), switch_at=3_000, slower_after=0.01)
    _recorded_run(twins / "s407", 407, _curve(20_000))
    _recorded_run(fixes / "s407", 407, _curve(13_000, level=1.02), switch_at=5_000, slower_after=0.01)
    _recorded_run(twins / "s408", 408, _curve(20_000))  # no auto_fix run: left out
    result = afe.evaluate(sorted(fixes.iterdir()), sorted(twins.iterdir()))
    assert (result["cases"], result["prevented"], result["verdict"]) == (7, 6, "shown")
    assert result["unpaired_seeds"] == [408]
    by_seed = {r["seed"]: r for r in result["pairs"]}
    assert by_seed[406]["prevented"] is False and by_seed[406]["fix"]["blowup"] is not None
    assert by_seed[407]["case"] is False and by_seed[407]["prevented"] is None
    assert by_seed[407]["late_loss_ratio"] == pytest.approx(1.02, abs=0.005)
    assert by_seed[400]["switched_before_twin_blowup"] and by_seed[400]["first_switch"] == 3_000
    assert result["loss_ratio_mean"] == pytest.approx(1.02, abs=0.005)
    assert by_seed[400]["ms_per_step_before_switch"] == pytest.approx(60.0, abs=0.01)
    assert by_seed[400]["ms_per_step_after_switch"] == pytest.approx(70.0, abs=0.01)
    assert "6 of 7" in afe.markdown(result) and "| 406 | blew up at 9,000 |" in afe.markdown(result)

    cut = tmp_path / "cut"
    for seed in range(400, 407):
        _recorded_run(cut / f"s{seed}", seed, _curve(12_000, level=1.02), switch_at=3_000)
    result = afe.evaluate(sorted(cut.iterdir()), sorted(twins.iterdir()))
    assert result["verdict"] == "undecided" and len(result["incomplete_fix_runs"]) == 7
    with pytest.raises(SystemExit, match="no seed has a run in both groups"):
        afe.main([str(cut / "s400"), "--twins", str(twins / "s408"), "--out", str(tmp_path / "r.json")])


def test_the_tenth_protocol_judges_auto_fix_on_runs_that_end(tmp_path):
    """--min-steps 10000 --loss-before-end: a fix run that trained 10,000 steps without a blow-up
    prevents its twin's; each pair's loss ratio is read over the 1,000 steps before the twin's blow-up,
    or before step 10,000 where the twin survived (what the flagged survivor's finished training costs)."""
    from research import auto_fix_effect as afe

    twins, fixes = tmp_path / "twins", tmp_path / "fixes"
    for seed in range(700, 705):
        _recorded_run(twins / f"s{seed}", seed, _curve(7_000, blowup=6_000))
        _recorded_run(fixes / f"s{seed}", seed, _curve(10_000, level=1.02), switch_at=2_000)
    _recorded_run(twins / "s705", 705, _curve(10_000))
    _recorded_run(fixes / "s705", 705, _curve(10_000, level=1.05), switch_at=2_500)
    result = afe.evaluate(sorted(fixes.iterdir()), sorted(twins.iterdir()), min_steps=10_000, loss_window=None,
                          late_window=None)
    assert (result["cases"], result["prevented"], result["verdict"]) == (5, 5, "shown")
    by_seed = {r["seed"]: r for r in result["pairs"]}
    assert by_seed[700]["loss_window"] == (5_000, 6_000) and by_seed[705]["loss_window"] == (9_000, 10_000)
    assert by_seed[705]["loss_ratio"] == pytest.approx(1.05, abs=0.005) and by_seed[705]["late_loss_ratio"] is None
    assert "before the twin's blow-up or end" in afe.markdown(result)
    assert (result["survivors"], result["switched_survivors"], result["harmed"]) == (1, 1, [])
    assert result["survivor_loss_ratio_mean"] == pytest.approx(1.05, abs=0.005)
    assert "Twins that survived: 1, of which 1 switched" in afe.markdown(result)
    harmed = tmp_path / "harmed"
    _recorded_run(harmed / "s705", 705, _curve(9_000, blowup=8_000), switch_at=2_500)
    worse = afe.evaluate([harmed / "s705"], [twins / "s705"], min_steps=10_000, loss_window=None, late_window=None)
    assert worse["harmed"] == [705] and "did not: 705" in afe.markdown(worse)
    # under the sixth protocol's 13,000 steps the same fix runs are too short to prevent anything
    assert afe.evaluate(sorted(fixes.iterdir()), sorted(twins.iterdir()))["verdict"] == "undecided"
    out = tmp_path / "r.json"
    assert afe.main([str(fixes), "--twins", str(twins), "--out", str(out), "--min-steps", "10000",
                     "--loss-before-end"]) == 0
    assert json.loads(out.read_text())["definitions"]["min_steps"] == 10_000
    with pytest.raises(SystemExit, match="--min-steps must be >= 1"):
        afe.main([str(fixes), "--twins", str(twins), "--out", str(out), "--min-steps", "0"])


def test_a_control_arm_is_judged_with_its_own_label_and_bounds(tmp_path):
    """The seventh protocol's controls: four twins blow up, four control runs (no switches) survive
    13,000 steps: 4 of 4 prevented is "shown" under --min-cases 4 --min-prevented 1.0 and
    "undecided" under the sixth protocol's defaults (5 cases); one blow-up among them is "not
    shown"; the label names the treatment in the table; bad bounds are refused."""
    from research import auto_fix_effect as afe

    twins, controls = tmp_path / "twins", tmp_path / "controls"
    for seed in (400, 402, 404, 406):
        _recorded_run(twins / f"s{seed}", seed, _curve(10_500, blowup=9_000))
        _recorded_run(controls / f"s{seed}", seed, _curve(13_000))
    result = afe.evaluate(sorted(controls.iterdir()), sorted(twins.iterdir()), "fp32", 4, 1.0)
    assert (result["cases"], result["prevented"], result["verdict"], result["switched_runs"]) == (4, 4, "shown", 0)
    assert result["label"] == "fp32" and "| seed | twin (SDPA) | fp32 run |" in afe.markdown(result)
    assert afe.evaluate(sorted(controls.iterdir()), sorted(twins.iterdir()))["verdict"] == "undecided"
    _recorded_run(tmp_path / "late" / "s406", 406, _curve(12_000, blowup=10_000))
    mixed = [controls / f"s{s}" for s in (400, 402, 404)] + [tmp_path / "late" / "s406"]
    assert afe.evaluate(mixed, sorted(twins.iterdir()), "fp32", 4, 1.0)["verdict"] == "not shown"
    with pytest.raises(SystemExit, match="--min-prevented in"):
        afe.main([str(controls), "--twins", str(twins), "--out", str(tmp_path / "r.json"), "--min-prevented", "0"])
    # the protocol the analysis was registered in goes into the result with its commit
    with pytest.raises(SystemExit, match="--protocol nope.md: no such file"):
        afe.main([str(controls), "--twins", str(twins), "--out", str(tmp_path / "r.json"), "--protocol", "nope.md"])
    protocol = Path(__file__).resolve().parents[1] / "research/preregistration/early-warning-protocol-7.md"
    afe.main([str(controls), "--twins", str(twins), "--out", str(tmp_path / "r.json"), "--label", "fp32",
              "--min-cases", "4", "--min-prevented", "1.0", "--protocol", str(protocol),
              "--markdown", str(tmp_path / "r.md")])
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["test_protocol"] == str(protocol) and saved["verdict"] == "shown"
    if (protocol.parents[2] / ".git").exists():  # the commit is read from git: none outside a checkout
        assert len(saved["test_protocol_commit"]) == 40
        assert (tmp_path / "r.md").read_text().startswith(f"Registered in `{protocol}` (commit "
                                                           f"{saved['test_protocol_commit']})")


def _pilot(survivors: int, blowups: int, incomplete: int = 0, short: int = 0, horizon: int = 20_000) -> dict:
    """An 'outcomes' result: ``survivors`` runs to ``horizon`` steps, ``blowups`` confirmed blow-ups,
    ``incomplete`` survivors whose monitoring failed, ``short`` runs without a blow-up cut at 3/4 of it."""
    runs = {}
    for i in range(survivors + blowups + incomplete + short):
        blowup = horizon // 2 if survivors <= i < survivors + blowups else None
        last = horizon * 3 // 4 - 1 if i >= survivors + blowups + incomplete else (
            horizon // 2 + 1000 if blowup else horizon - 1)
        runs[f"s{i}"] = {"seed": i, "outcome": {"blowup": blowup, "confirmed": blowup is not None,
                                                "survivor": blowup is None, "last_step": last},
                         "monitoring": {"complete": not (survivors + blowups <= i < survivors + blowups + incomplete)}}
    return {"kind": "outcomes", "runs": runs}


def test_the_eighth_protocols_pilot_rule_picks_the_rate():
    """The rule written in early-warning-protocol-8.md: 1.25e-3 at once with 3-5 survivors of 8 complete
    runs; else the 1e-3 pilot, then the qualifying rate (>= 2 confirmed blow-ups, >= 2 survivors to
    20,000 steps) nearest one half, a tie to 1.25e-3; none qualifying: no test."""
    from research import early_warning as ew
    from research import pilot

    rule = pilot.RULES[8]
    assert pilot.choose(rule, {1.25e-3: _pilot(4, 4)})["rate"] == 1.25e-3
    assert pilot.choose(rule, {1.25e-3: _pilot(3, 5)})["decision"] == "test"
    nxt = pilot.choose(rule, {1.25e-3: _pilot(1, 7)})
    assert (nxt["decision"], nxt["rate"]) == ("run the next pilot", 1e-3)
    nxt = pilot.choose(rule, {1.25e-3: _pilot(7, 1)})  # too many survivors: the eighth still goes lower
    assert (nxt["decision"], nxt["rate"]) == ("run the next pilot", 1e-3)
    # 6 of 8 survive: not chosen at once; 1e-3 with 4 of 8 is nearer one half
    assert pilot.choose(rule, {1.25e-3: _pilot(6, 2), 1e-3: _pilot(4, 4)})["rate"] == 1e-3
    # a tie (2 of 8 and 6 of 8 are equally far from one half) goes to 1.25e-3
    assert pilot.choose(rule, {1.25e-3: _pilot(2, 6), 1e-3: _pilot(6, 2)})["rate"] == 1.25e-3
    # an incomplete run does not count, and a run cut before 20,000 steps is no survivor
    counts = pilot.counts(_pilot(3, 4, incomplete=1), rule.horizon)
    assert (counts["complete"], counts["survivors"], counts["blowups"]) == (7, 3, 4)
    assert pilot.choose(rule, {1.25e-3: _pilot(3, 4, incomplete=1)})["decision"] == "run the next pilot"
    assert pilot.counts(_pilot(1, 5, short=2), rule.horizon)["survivors"] == 1
    assert pilot.choose(rule, {1.25e-3: _pilot(0, 8), 1e-3: _pilot(8, 0)})["decision"] == "no test"
    assert pilot.choose(rule, {1.25e-3: _pilot(1, 7), 1e-3: _pilot(2, 6)})["rate"] == 1e-3
    with pytest.raises(ValueError, match="runs first"):
        pilot.choose(rule, {1e-3: _pilot(4, 4)})
    with pytest.raises(SystemExit, match="expected RATE=OUTCOMES.json"):
        ew.main(["pilot", "0.00125"])


def test_the_ninth_protocols_pilot_rule_goes_up_or_down_from_its_first_peak():
    """early-warning-protocol-9.md: peak 2.5e-3 first, chosen at once with 3-5 survivors of 8 (no blow-up
    through step 10,000); else 2e-3 when half or fewer survived, 3e-3 when more than half did; then the
    qualifying peak nearest one half, a tie to 2.5e-3."""
    from research import pilot

    rule = pilot.RULES[9]
    p = lambda s, b, **kw: _pilot(s, b, horizon=10_000, **kw)  # noqa: E731
    assert pilot.choose(rule, {2.5e-3: p(3, 5)})["rate"] == 2.5e-3
    assert pilot.choose(rule, {2.5e-3: p(1, 7)})["rate"] == 2e-3
    assert pilot.choose(rule, {2.5e-3: p(6, 2)})["rate"] == 3e-3
    assert pilot.choose(rule, {2.5e-3: p(6, 2)})["decision"] == "run the next pilot"
    assert pilot.choose(rule, {2.5e-3: p(6, 2), 3e-3: p(4, 4)})["rate"] == 3e-3
    assert pilot.choose(rule, {2.5e-3: p(2, 6), 2e-3: p(6, 2)})["rate"] == 2.5e-3  # a tie: the first
    assert pilot.choose(rule, {2.5e-3: p(0, 8), 2e-3: p(1, 7)})["decision"] == "no test"
    # a run cut at 7,500 steps without a blow-up is no survivor of a 10,000-step schedule
    assert pilot.counts(p(2, 4, short=2), rule.horizon)["survivors"] == 2
    with pytest.raises(ValueError, match="not 0.002"):  # the first showed too many survivors: 3e-3 runs next
        pilot.choose(rule, {2.5e-3: p(7, 1), 2e-3: p(4, 4)})
    with pytest.raises(ValueError, match="no pilot at lr 0.001 in protocol 9"):
        pilot.choose(rule, {2.5e-3: p(4, 4), 1e-3: p(4, 4)})


def test_the_eleventh_protocols_pilot_rule_and_its_blocks():
    """early-warning-protocol-11.md: peak 1.5e-3 first (chosen at once with 3-5 survivors of 8), else 1.25e-3
    or 1.75e-3; its test runs blocks of 8 until at least 24 runs with 6 confirmed blow-ups and 6 survivors,
    at most 48 (outcomes only), and its arms are the ninth's schedule at its peaks."""
    from research import early_warning as ew
    from research import pilot
    from research.experiments.scenarios import SEED_SPLIT, SPLIT_PEAKS_11

    rule = pilot.RULES[11]
    p = lambda s, b, **kw: _pilot(s, b, horizon=10_000, **kw)  # noqa: E731
    assert pilot.choose(rule, {1.5e-3: p(4, 4)})["rate"] == 1.5e-3
    assert pilot.choose(rule, {1.5e-3: p(2, 6)})["rate"] == 1.25e-3
    assert pilot.choose(rule, {1.5e-3: p(6, 2)})["rate"] == 1.75e-3
    assert pilot.choose(rule, {1.5e-3: p(2, 6), 1.25e-3: p(5, 3)})["rate"] == 1.25e-3  # 5/8 nearer one half
    block = pilot.BLOCK_RULES[11]

    def blocks(n, *args, **kw):  # n blocks of the same counts, each run under its own name (a run folder)
        return [{"runs": {f"b{i}/{k}": v for k, v in p(*args, **kw)["runs"].items()}} for i in range(n)]

    # blocks of 8 with 2 survivors each: 24 runs leave 6 survivors and 18 blow-ups -> stop
    assert pilot.next_block(block, blocks(2, 2, 6))["decision"] == "run the next block"
    assert pilot.next_block(block, blocks(3, 2, 6))["decision"] == "stop"
    assert pilot.next_block(block, blocks(2, 8, 0))["decision"] == "run the next block"  # 16 runs: too few
    few = pilot.next_block(block, blocks(5, 1, 7))
    assert few["decision"] == "run the next block" and few["counts"]["survivors"] == 5
    assert pilot.next_block(block, blocks(6, 1, 7))["decision"] == "stop"  # 48 runs: the most
    assert pilot.next_block(block, blocks(1, 2, 6) * 3)["counts"]["runs"] == 8  # a block given twice counts once
    # an incomplete run counts toward the runs, not toward a group
    assert pilot.next_block(block, blocks(3, 2, 5, incomplete=1))["counts"] == \
        {"complete": 21, "blowups": 15, "survivors": 6, "qualifies": True, "runs": 24}
    names = {a.name: a for a in SEED_SPLIT.arms}
    for lr in SPLIT_PEAKS_11:
        arm = names[f"sdpa_observe_cos{lr:g}"]
        assert (arm.lr, arm.decay_steps, arm.monitor) == (lr, 10_000, {"mode": "observe"})
        assert f"fp32_cos{lr:g}" in names and (f"auto_fix_cos{lr:g}" in names) == (lr == 1.75e-3)
    fix = names["auto_fix_cos0.00175"]  # the twelfth protocol's arm: the eleventh's chosen peak with auto_fix
    assert (fix.lr, fix.decay_steps, fix.monitor) == (1.75e-3, 10_000, {"mode": "observe", "auto_fix": "fp32_delta"})
    with pytest.raises(SystemExit):
        ew.main(["blocks", "--protocol", "9", "x.json"])  # the ninth's test is not block-wise


def test_the_learning_rate_schedule_warms_up_then_holds_or_decays_by_a_cosine():
    """Recipes without decay keep the rates they always had (the same floats, so recorded runs resume
    unchanged); with decay_steps the rate falls by a cosine to min_lr_ratio x peak there and holds."""
    from research.experiments.scenarios import SEED_SPLIT, learning_rate

    constant = SEED_SPLIT.recipe.to_dict()
    del constant["decay_steps"]  # a recipe recorded before the schedule existed
    for step in (0, 57, 199, 200, 5_000, 19_999):
        assert learning_rate(constant, step) == constant["lr"] * min(1.0, (step + 1) / constant["warmup_steps"])
    cos = {**SEED_SPLIT.recipe.to_dict(), "lr": 2.5e-3, "decay_steps": 10_000}
    assert learning_rate(cos, 199) == 2.5e-3
    assert learning_rate(cos, 5_100) == pytest.approx(2.5e-4 + 2.25e-3 * 0.5)
    assert learning_rate(cos, 10_000) == learning_rate(cos, 12_345) == pytest.approx(2.5e-4)
    rates = [learning_rate(cos, s) for s in range(200, 10_001, 100)]
    assert all(a >= b for a, b in zip(rates, rates[1:]))


def test_the_ninth_protocols_arms_decay_and_a_tiny_run_decays_over_its_own_length(tmp_path):
    from research.experiments.runner import make_plan
    from research.experiments.scenarios import SEED_SPLIT, SPLIT_DECAY_9

    for kind in ("sdpa_observe", "fp32", "fp32_delta"):
        arm = SEED_SPLIT.arm(f"{kind}_cos0.0025")
        assert (arm.lr, arm.decay_steps) == (2.5e-3, SPLIT_DECAY_9)

    def plan(arm, **kw):
        return make_plan([(SEED_SPLIT, [arm])], [520], tmp_path, device=None, max_seconds=None, **kw)[0].recipe

    full = plan("sdpa_observe_cos0.0025", tiny=False, max_steps=10_000)
    assert (full["lr"], full["decay_steps"]) == (2.5e-3, 10_000)
    assert plan("sdpa_observe_cos0.0025", tiny=True, max_steps=30)["decay_steps"] == 30
    assert plan("sdpa_observe", tiny=False, max_steps=None)["decay_steps"] == 0
    with pytest.raises(ValueError, match="decay_steps must be a positive step count"):
        from research.experiments.scenarios import Arm
        Arm("x", "x", "failure", decay_steps=0)


@pytest.mark.skipif(not (ROOT / ".git").exists(), reason="needs the git checkout")
def test_registered_code_copies_a_commit_without_recordings_and_refuses_other_folders(tmp_path):
    """research/registered_code.sh makes the device machine's copy of a protocol's code: the commit's
    files without results/ and docs/gpu-runs/, its full hash in CODE_COMMIT; it replaces an earlier
    copy and refuses a folder that is not one."""
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    copy = tmp_path / "reg"
    for _ in range(2):  # the second run replaces the first copy
        done = subprocess.run(["bash", "research/registered_code.sh", "HEAD", str(copy)], cwd=ROOT, capture_output=True,
                              text=True)
        assert done.returncode == 0, done.stderr
    assert (copy / "CODE_COMMIT").read_text() == head
    assert (copy / "research/split_call.sh").exists() and (copy / "flashwatch/monitor.py").exists()
    assert not (copy / "results").exists() and not (copy / "docs/gpu-runs").exists()
    other = tmp_path / "mine"
    other.mkdir()
    (other / "keep.txt").write_text("x")
    refused = subprocess.run(["bash", "research/registered_code.sh", "HEAD", str(other)], cwd=ROOT, capture_output=True,
                             text=True)
    assert refused.returncode == 2 and "not a registered code copy" in refused.stderr
    assert (other / "keep.txt").exists()


@pytest.mark.parametrize("cut", [False, True])
def test_read_signals_streams_whole_and_cut_recordings(tmp_path, cut):
    """A recording is read a chunk at a time (not held whole); a gzip stream cut short by a killed run
    gives the records it holds, a file of two gzip members both."""
    from flashwatch.replay import records

    lines = [json.dumps({"i": i}).encode() + b"\n" for i in range(3000)]
    data = gzip.compress(b"".join(lines[:2000])) + gzip.compress(b"".join(lines[2000:]))
    if cut:
        data = gzip.compress(b"".join(lines))[:-2000]
    path = tmp_path / "signals.jsonl.gz"
    path.write_bytes(data)
    got = [json.loads(raw) for raw in records._gzip_lines(path, chunk=4096) if raw.strip()[-1:] == b"}"]
    ids = [r["i"] for r in got]
    assert ids == list(range(len(ids)))
    assert len(ids) == 3000 if not cut else 2000 < len(ids) < 3000
