"""flashwatch demo, in-process on the CPU with a few steps: run folder, report lines, --provoke alerts."""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flashwatch.cli import main as cli_main
from flashwatch.demo import model as demo_model
from flashwatch.demo import summary, training
from flashwatch.exporters.jsonl import ALERTS_FILE, METRICS_FILE, read_jsonl, validate_record


def _demo(capsys, *args: str) -> tuple[int, str]:
    code = cli_main(["demo", "--device", "cpu", "--port", "0", *args])
    out = capsys.readouterr()
    return code, out.out + out.err


def test_demo_writes_the_run_folder_and_reports(tmp_path, capsys):
    run_dir = tmp_path / "run"
    code, out = _demo(capsys, "--steps", "24", "--run-dir", str(run_dir))
    assert code == 0, out

    # the run folder: JSONL (one record per step: every step is monitored), alerts, checkpoint, report
    records = list(read_jsonl(run_dir / METRICS_FILE, kinds=None))
    for r in records:
        validate_record(r)
    assert [r["step"] for r in records if r["kind"] == "step"] == list(range(24))
    assert records[0]["kind"] == "open" and records[-1]["kind"] == "close"
    assert (run_dir / ALERTS_FILE).exists()
    ckpt = torch.load(run_dir / "checkpoint.ckpt", map_location="cpu", weights_only=False)
    state = next(v for k, v in ckpt["callbacks"].items() if "FlashWatchCallback" in k)
    assert state["monitor"]["global_step"] == 24 and len(state["monitor"]["layers"]) == 4
    meta = json.loads((run_dir / "demo.json").read_text())
    assert meta["mode"] == "observe" and not meta["injected"] and meta["steps_done"] == 24
    assert "<svg" in (run_dir / "report.html").read_text()

    # what a person reads: progress lines, the served URL, and the final report
    assert "Prometheus metrics: http://127.0.0.1:" in out
    assert "[100%] flashwatch step 23" in out
    report = out.split("flashwatch demo report", 1)[1]
    for line in ("steps:   24 optimizer steps", "loss:", "|drift z|", "repeated-max ratio (BF16)",
                 "W^Q spectral norm", "max logit", "alerts:", "metrics: http://127.0.0.1:", "checkpoint.ckpt",
                 "report.html", f"files:   {run_dir}/"):
        assert line in report, line
    assert "INJECTED" not in out

    # the hint at the end is a command that works as printed
    picture = next(l for l in out.splitlines() if l.startswith("  picture: "))
    argv = shlex.split(picture.split(": ", 1)[1])
    assert argv[1:] == ["report", str(run_dir), "--out", str(run_dir / "report.png")]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert (run_dir / "report.png").exists() and f"wrote {run_dir / 'report.png'}" in done.stdout


def test_the_printed_command_is_one_the_shell_finds(monkeypatch, tmp_path):
    script = Path(sys.executable).parent / "flashwatch"
    assert script.is_file()  # this interpreter's environment has the console script
    monkeypatch.setenv("PATH", str(tmp_path))  # not on PATH (make demo): its absolute path
    assert summary.flashwatch_command() == str(script.absolute())
    monkeypatch.setenv("PATH", f"{script.parent}{os.pathsep}{tmp_path}")  # on PATH: the bare name
    assert summary.flashwatch_command() == "flashwatch"
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python3"))  # no script: python -m
    assert summary.flashwatch_command() == f"{tmp_path / 'python3'} -m flashwatch.cli"


def test_a_taken_default_port_gives_way_to_a_free_one(tmp_path, capsys, monkeypatch):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        monkeypatch.setattr(training, "DEFAULT_PORT", port)  # this taken port plays the default
        code = cli_main(["demo", "--device", "cpu", "--steps", "2", "--port", str(port),
                         "--run-dir", str(tmp_path / "r")])
    out = capsys.readouterr().out
    assert code == 0, out
    assert f"port {port} on 127.0.0.1 is taken" in out and "free port instead" in out
    url = json.loads((tmp_path / "r" / "demo.json").read_text())["prometheus_url"]
    served = int(url.split(":")[2].split("/")[0])
    assert served not in (0, port)
    assert f"Prometheus metrics: {url} (while it trains; port {port} was taken)" in out


def test_ctrl_c_ends_with_the_summary_and_the_report(tmp_path, capsys, monkeypatch):
    step = demo_model.DemoGPT.training_step

    def interrupted_at_5(self, batch, batch_idx):
        if batch_idx == 5:
            raise KeyboardInterrupt
        return step(self, batch, batch_idx)

    monkeypatch.setattr(demo_model.DemoGPT, "training_step", interrupted_at_5)
    handler = signal.getsignal(signal.SIGINT)
    run_dir = tmp_path / "run"
    code, out = _demo(capsys, "--steps", "20", "--run-dir", str(run_dir))
    assert code == 0, out
    assert signal.getsignal(signal.SIGINT) is handler  # Ctrl-C works again afterwards
    report = out.split("flashwatch demo report", 1)[1]
    assert "steps:   5 of 20 optimizer steps (stopped by Ctrl-C)" in report
    assert "loss:    " in report and "at step 4" in report
    meta = json.loads((run_dir / "demo.json").read_text())
    assert meta["interrupted"] is True and meta["steps_done"] == 5
    assert [r["step"] for r in read_jsonl(run_dir)] == list(range(5))
    assert "interrupted" in (run_dir / "report.html").read_text()


def test_provoke_raises_alerts_labelled_injected(tmp_path, capsys):
    run_dir = tmp_path / "provoked"
    code, out = _demo(capsys, "--steps", "100", "--provoke", "--run-dir", str(run_dir))
    assert code == 0, out
    meta = json.loads((run_dir / "demo.json").read_text())
    assert meta["injected"] and meta["inject_bias"] > 0 and meta["mode"] == "own_kernel"

    records = list(read_jsonl(run_dir))
    alerts = [a for r in records for a in r["new_alerts"]]
    assert alerts, out
    # the fault shows in the signals too: without it the demo's max logit stays below 30 over
    # 400 steps (seeds 0-2); with it, it passed 100 within 100 steps here
    max_logit = max(v for r in records for row in r["metrics"]["flashwatch_max_logit"] for v in row if v == v)
    assert max_logit > 60, max_logit
    # every alert, in every output, says INJECTED
    assert all(a["message"].startswith("[INJECTED] ") for a in alerts)
    lines = (run_dir / ALERTS_FILE).read_text().splitlines()
    assert len(lines) == len(alerts) and all("[INJECTED]" in l for l in lines)
    assert "flashwatch demo report [INJECTED FAULT" in out
    assert "INJECTED FAULT: rounding_bias(" in out
    assert "INJECTED [100%] flashwatch step 99" in out
    warnings = [l for l in out.splitlines() if l.startswith(("WARNING", "ERROR"))]
    assert warnings and all(l.split(" ", 1)[1].startswith("INJECTED") for l in warnings)
    assert "INJECTED FAULT" in (run_dir / "report.html").read_text()
    # the caveat about warning rules on a small model's early training is for healthy runs only
    assert "warnings only" not in out


def test_port_in_use_says_to_use_port_0(tmp_path, capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        code = cli_main(["demo", "--steps", "2", "--port", str(port), "--run-dir", str(tmp_path / "r")])
    out = capsys.readouterr().err  # errors go to stderr
    assert code == 2
    assert f"port {port} on 127.0.0.1 is taken" in out and "--port 0" in out
    assert not (tmp_path / "r").exists()


def test_refuses_a_run_folder_that_holds_a_run(tmp_path, capsys):
    (tmp_path / METRICS_FILE).write_text("")
    code, out = _demo(capsys, "--steps", "2", "--run-dir", str(tmp_path))
    assert code == 2 and "already holds a run" in out


@pytest.mark.parametrize("args, message", [(["--steps", "0"], "--steps must be a positive integer"),
                                           (["--port", "70000"], "--port must be an int in 0..65535 (0: any free port), got 70000")])
def test_bad_arguments(args, message, tmp_path, capsys):
    code, out = _demo(capsys, *args, "--run-dir", str(tmp_path / "r"))
    assert code == 2 and message in " ".join(out.split()), out
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("make", ["file", "under_a_file"])
def test_a_run_folder_that_cannot_be_made_is_a_clear_error(tmp_path, capsys, make):
    (tmp_path / "f").write_text("x")
    run_dir = tmp_path / "f" if make == "file" else tmp_path / "f" / "run"
    code, out = _demo(capsys, "--steps", "2", "--port", "0", "--run-dir", str(run_dir))
    assert code == 2 and "cannot use" in out and "pass a writable folder as --run-dir" in " ".join(out.split()), out
