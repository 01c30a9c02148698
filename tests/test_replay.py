"""flashwatch.replay and `flashwatch experiment analyze`: blow-up, replay, baselines, records,
calibration, on hand-written recordings (CPU; the experiment harness is tested in test_research)."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import numpy as np
import pytest

from flashwatch.cli import main as flashwatch_main
from flashwatch.config import MonitorConfig
from flashwatch.replay import baselines, blowup, calibration, runs
from flashwatch.replay.records import f32_text, read_f32


# --- blow-up and lead time on synthetic series --------------------------------------------------------

def test_blowup_is_the_start_of_a_sustained_excursion_or_a_non_finite_loss():
    falling = [5.0 - 0.01 * i for i in range(300)]  # the 20-step median ends at ~2.1
    steps = list(range(400))
    assert blowup.blowup_step(steps, falling + [2.5] * 100) is None  # 1.19x the best median: not a blow-up
    assert blowup.blowup_step(steps, falling + [3.5] * 100) == 300  # where the loss left its trend
    spike = falling + [3.5] * 10 + [2.0] * 90  # ten steps up, then back: a spike, not a blow-up
    assert blowup.blowup_step(steps, spike) is None
    noisy = falling + [20.0 if i % 7 == 0 else 2.0 for i in range(100)]  # single bad batches: the median ignores them
    assert blowup.blowup_step(steps, noisy) is None
    assert blowup.blowup_step(steps, falling + [2.0] * 50 + [math.nan] + [2.0] * 49) == 350
    assert blowup.blowup_step(steps, falling + [3.5] * 15 + [math.inf] + [2.0] * 84) == 300  # inside an excursion
    tracker = blowup.BlowupTracker()
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
    s = runs.analyze_run(tmp_path / "run")
    assert s["blowup_step"] == 800
    first = s["flashwatch"]["delta_drift"]["first"]
    # the drift z of a head crosses 4 a few monitored steps after e_t keeps one sign
    assert 300 < first < 700
    assert s["flashwatch"]["delta_drift"]["lead"] == 800 - first == blowup.lead_time(800, first)
    assert s["flashwatch_mechanism_first"] == {"step": first, "rule": "delta_drift", "lead": 800 - first}
    assert s["baselines"]["qk_clip"]["first"] is None  # max logit 5 < 100
    assert s["extremes"]["drift_abs_z"]["max"] >= 4.0
    # a higher threshold fires later: the replay follows MonitorConfig
    later = runs.analyze_run(tmp_path / "run", {"drift_threshold": 8.0})["flashwatch"]["delta_drift"]["first"]
    assert later > first
    cal = calibration.calibrate([tmp_path / "run"], sweeps=[("drift", "drift_threshold", (4.0, 100.0), ("delta_drift",))])
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


# --- the command line ------------------------------------------------------------------------------------

def _analyze(*argv) -> int:
    return flashwatch_main(["experiment", "analyze", *map(str, argv)])


def test_analyze_replays_merges_tabulates_and_calibrates(tmp_path, capsys):
    _synthetic_run(tmp_path / "runs" / "a", drift_from=300, blowup_at=800)
    results, table, cal = tmp_path / "results.json", tmp_path / "table.md", tmp_path / "cal.json"
    assert _analyze(tmp_path / "runs", "--json", results, "--markdown", table, "--calibrate", cal) == 0
    out = capsys.readouterr().out
    assert "synthetic/drift/0" in out and "calibration over 1 runs" in out and "drift_threshold" in out
    data = json.loads(results.read_text())
    run = data["runs"]["synthetic/drift/0"]
    assert run["blowup_step"] == 800
    # the hand-written run.json lists no in-training alerts, which the replay does not reproduce: said so
    assert run["in_training"]["replay_differs_in"] == ["delta_drift", "loss_spike"]
    assert "synthetic/drift/0 (delta_drift, loss_spike)" in out
    assert data["aggregate"]["synthetic"]["drift"]["blown_up"] == 1
    assert data["targets"]["synthetic"]["alert_before_blowup"] == {"runs": 1, "of": 1}
    assert table.read_text().startswith("| run |")
    assert set(json.loads(cal.read_text())) == {"runs", "extremes", "sweeps", "baseline_sweeps", "defaults"}

    # the results JSON names its run folders: analyze reads them back, with other thresholds
    assert _analyze(results, "--set", "drift_threshold=100", "--set", "warmup=1") == 0
    out = capsys.readouterr().out
    assert "replayed with MonitorConfig overrides {'drift_threshold': 100, 'warmup': 1}" in out


def test_a_least_lead_is_the_scenarios_target_and_the_results_json_keeps_it(tmp_path, capsys):
    """The synthetic run's delta_drift leads its blow-up by a few hundred steps: enough for a target
    of 100 steps, not for one of 1,000. The lead a scenario asks for is given at a merge
    (--min-lead, or research's Scenario.min_lead) and kept for later merges."""
    _synthetic_run(tmp_path / "runs" / "a", drift_from=300, blowup_at=800)
    results = tmp_path / "results.json"
    assert _analyze(tmp_path / "runs", "--json", results, "--min-lead", "synthetic=1000") == 0
    data = json.loads(results.read_text())
    assert data["min_lead"] == {"synthetic": 1000}
    assert data["targets"]["synthetic"]["lead_at_least"] == {"steps": 1000, "runs": 0, "of": 1}
    assert "lead >= 1000" in capsys.readouterr().out
    assert _analyze(tmp_path / "runs", "--json", results) == 0  # kept
    assert json.loads(results.read_text())["targets"]["synthetic"]["lead_at_least"]["steps"] == 1000
    assert _analyze(tmp_path / "runs", "--json", results, "--min-lead", "synthetic=100") == 0  # replaced
    assert json.loads(results.read_text())["targets"]["synthetic"]["lead_at_least"] == {"steps": 100, "runs": 1,
                                                                                          "of": 1}
    # a results JSON written before "min_lead" existed: its targets say what it asked for
    data = json.loads(results.read_text())
    del data["min_lead"]
    results.write_text(json.dumps(data))
    assert _analyze(tmp_path / "runs", "--json", results) == 0
    assert json.loads(results.read_text())["min_lead"] == {"synthetic": 100}
    # without a target, none is reported
    assert _analyze(tmp_path / "runs", "--json", tmp_path / "other.json") == 0
    other = json.loads((tmp_path / "other.json").read_text())
    assert "min_lead" not in other and "lead_at_least" not in other["targets"]["synthetic"]


@pytest.mark.parametrize("argv, message", [
    (["--json", "r.json", "--min-lead", "synthetic"], "--min-lead takes SCENARIO=STEPS"),
    (["--json", "r.json", "--min-lead", "synthetic=0"], "--min-lead takes SCENARIO=STEPS"),
    (["--json", "r.json", "--min-lead", "=100"], "--min-lead takes SCENARIO=STEPS"),
    (["--min-lead", "synthetic=100"], "it needs --json PATH"),
])
def test_min_lead_says_what_was_wrong(argv, message, tmp_path):
    with pytest.raises(SystemExit, match=message):
        _analyze(tmp_path, *argv)


def test_analyze_says_what_was_wrong(tmp_path, capsys):
    assert _analyze(tmp_path / "nowhere") == 2
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert _analyze(tmp_path / "empty") == 2
    assert "no run folders" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="--set takes FIELD=VALUE"):
        _analyze(tmp_path, "--set", "drift_threshold")
    with pytest.raises(SystemExit, match="no field no_such_field; fields: .*drift_threshold"):
        _analyze(tmp_path, "--set", "no_such_field=1")
    with pytest.raises(SystemExit, match="drift_threshold"):  # MonitorConfig rejects the value, naming the field
        _analyze(tmp_path, "--set", "drift_threshold=-1")


@pytest.mark.parametrize("argv", [["experiment", "run"], ["experiment", "list"], ["experiment", "early-warning"],
                                  ["lab"]])
def test_research_commands_are_not_product_commands(argv, capsys):
    """Running experiments and the bias lab live in research/ (python -m research.experiments, research.lab)."""
    with pytest.raises(SystemExit) as exc:
        flashwatch_main(argv)
    assert exc.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


def test_experiment_help_is_the_replay_manual(capsys):
    with pytest.raises(SystemExit) as exc:
        flashwatch_main(["experiment", "--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    for words in ("analyze", "Blow-up", "--calibrate", "signals.jsonl.gz"):
        assert words in text


def test_aggregate_leaves_out_paused_pieces():
    # a run stopped by its time limit between pieces has no outcome and none of the per-rule fields
    from flashwatch.replay.results import BASELINES, aggregate
    paused = {"scenario": "s", "arm": "a", "seed": 1, "status": "paused", "steps": 4000}
    done = {"scenario": "s", "arm": "a", "seed": 2, "status": "blown_up", "blowup_step": 10, "last_step": 20,
            "final_loss": 2.0, "flashwatch_first": {"lead": 5}, "flashwatch_mechanism_first": {"lead": 5},
            "baselines": {b: {"lead": None} for b in BASELINES}}
    out = aggregate({"p": paused, "d": done})
    assert out["s"]["a"]["seeds"] == [2] and out["s"]["a"]["blown_up"] == 1 and out["s"]["a"]["healthy_runs"] == 0
