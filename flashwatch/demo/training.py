"""The demo's run: check the arguments, build the model, exporters and trainer, train, record what
happened (``DemoResult``, ``demo.json``) and render ``report.html``."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from rich.console import Console

from ..config import MonitorConfig
from ..exporters.jsonl import METRICS_FILE
from ..kernels import faults
from ..vocabulary import INJECTED, check_port
from .fault import PROVOKE_STRENGTH, Labelled, describe
from .live import DemoConsole, LossHistory, alert_logging, quiet_lightning, say
from .model import DemoModel, build

__all__ = ["DemoResult", "DemoError", "demo_config", "run", "DEFAULT_STEPS", "DEFAULT_PORT", "HOST"]

DEFAULT_STEPS = 400
DEFAULT_PORT = 9400  # the port of dashboards/prometheus.yml
HOST = "127.0.0.1"


def demo_config(steps: int, *, mode: str) -> MonitorConfig:
    """The demo's ``MonitorConfig``: every step monitored, detector clocks scaled to ``steps``."""
    return MonitorConfig(interval=1, mode=mode, warmup=max(10, steps // 4), window=max(10, steps // 8),
                         repeated_max_baseline=max(10, steps // 8))


@dataclass
class DemoResult:
    """What ``run`` did (also summarised in ``run_dir/demo.json``)."""

    run_dir: Path
    device: str
    mode: str
    injected: float  # rounding-bias strength; 0 when no fault was injected
    steps: int  # optimizer steps done
    seconds: float
    url: str | None  # where /metrics was served while training
    losses: list[tuple[int, float]] = field(default_factory=list)  # (step, loss) of monitored steps
    snapshot: dict = field(default_factory=dict)  # Monitor.snapshot() at the end
    alerts: list = field(default_factory=list)  # flashwatch.detectors.Alert, in order
    checkpoint: Path | None = None
    report: Path | None = None
    errors: int = 0  # failures inside monitoring (monitor.errors)
    steps_asked: int = 0  # --steps
    interrupted: bool = False  # stopped early by Ctrl-C


class DemoError(RuntimeError):
    """A demo that cannot start (port taken, run folder in use, no CUDA); the message says what to do."""


# --- checks before training -----------------------------------------------------------------------

def _port_taken(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the exporter's HTTP server
        try:
            s.bind((host, port))
        except OSError as exc:
            if exc.errno in (errno.EADDRINUSE, errno.EACCES):
                return True
            raise
    return False


def _port_message(host: str, port: int) -> str:
    return (f"port {port} on {host} is taken (another flashwatch demo or training run, or another "
            f"server, listens there), so flashwatch cannot serve its Prometheus metrics on it. Run "
            f"`flashwatch demo --port 0` to pick any free port, or --port N for another one.")


def _choose_port(console: Console, host: str, port: int | None) -> tuple[int | None, str]:
    """The port to serve on and a note for the address line. The default port, when taken, gives
    way to a free one (the demo says so); another taken port is an error."""
    if port is None or port == 0 or not _port_taken(host, port):
        return port, ""
    if port != DEFAULT_PORT:
        raise DemoError(_port_message(host, port))
    say(console, f"  port {port} on {host} is taken (another flashwatch demo or training run, or another server): "
                 f"serving the Prometheus metrics on a free port instead (dashboards/prometheus.yml scrapes "
                 f"{port}; pass --port N to choose).")
    return 0, f"; port {port} was taken"


def _device(requested: str | None) -> str:
    import torch

    if requested in (None, "auto"):
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested not in ("cpu", "cuda"):
        raise DemoError(f"--device must be cpu, cuda or auto, got {requested!r}")
    if requested == "cuda" and not torch.cuda.is_available():
        raise DemoError("--device cuda: torch sees no CUDA device here (torch.cuda.is_available() is False); "
                        "run without --device to use the CPU")
    return requested


def _default_run_dir(injected: bool) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return Path("runs") / (f"demo-{stamp}" + (f"-{INJECTED}" if injected else ""))


# --- while training -------------------------------------------------------------------------------

@contextlib.contextmanager
def _cpu_threads(n: int | None) -> Iterator[None]:
    """torch's intra-op threads for the run. The demo's matrices are tiny (64 x 64): one thread is
    as fast as several on an idle machine, and on a busy one several threads wait on each other."""
    import torch

    if n is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@contextlib.contextmanager
def _sigint_restored() -> Iterator[None]:
    """Lightning ignores Ctrl-C after the first one (while it shuts down): give it back afterwards."""
    main = threading.current_thread() is threading.main_thread()
    before = signal.getsignal(signal.SIGINT) if main else None
    try:
        yield
    finally:
        if main and before is not None and signal.getsignal(signal.SIGINT) is not before:
            signal.signal(signal.SIGINT, before)


def _fit(trainer, module, loader) -> bool:
    """``trainer.fit``; True when Ctrl-C stopped it (Lightning then shuts down and calls sys.exit(1))."""
    with _sigint_restored():
        try:
            trainer.fit(module, loader)
        except KeyboardInterrupt:  # outside Lightning's own handling (before its loop took over)
            return True
        except SystemExit:
            if not trainer.interrupted:
                raise
            return True
    return False


# --- the run --------------------------------------------------------------------------------------

def run(*, steps: int = DEFAULT_STEPS, seed: int = 0, device: str | None = None, port: int | None = DEFAULT_PORT,
        run_dir: str | os.PathLike | None = None, provoke: bool = False, console: Console | None = None,
        live: bool | None = None, report: bool = True, model: DemoModel = DemoModel()) -> DemoResult:
    """Train the demo model with flashwatch watching; return what happened.

    Args:
        steps: optimizer steps (>= 1).
        seed: seed of the model's initialisation and of the batches.
        device: ``"cpu"``, ``"cuda"`` or None/``"auto"`` (CUDA when present).
        port: Prometheus port on 127.0.0.1; 0 picks a free one; None serves nothing. The
            default port (9400), when taken, gives way to a free one.
        run_dir: the run folder (must not hold a run already); default ``runs/demo-<timestamp>``.
        provoke: inject the fault (``PROVOKE_STRENGTH``) in own_kernel mode; labelled INJECTED.
        console: a ``rich.console.Console`` (default: stdout).
        live: live panel (default: when ``console`` is a terminal).
        report: render ``report.html`` in the run folder at the end.

    Ctrl-C stops the training; the result (``interrupted=True``), ``demo.json`` and the report
    cover the steps done.

    Raises:
        DemoError: a port other than the default is taken, the run folder holds a run, or CUDA
            was asked for and is missing (the message says what to do).
    """
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise DemoError(f"--steps must be a positive integer, got {steps!r}")
    if port is not None:
        try:
            check_port(port, "--port", allow_none=False)
        except ValueError as exc:
            raise DemoError(str(exc)) from None
    console = console or Console(highlight=False)
    live = console.is_terminal if live is None else live
    run_dir = Path(run_dir) if run_dir is not None else _default_run_dir(provoke)
    if (run_dir / METRICS_FILE).exists():
        raise DemoError(f"{run_dir} already holds a run ({METRICS_FILE}); pass another --run-dir or remove it")
    dev = _device(device)
    port, port_note = _choose_port(console, HOST, port)
    try:  # after the checks above, which leave no folder behind
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # a file of that name, a read-only or impossible path
        raise DemoError(f"cannot use {run_dir} as the run folder ({exc.strerror or exc}); pass a writable folder "
                        "as --run-dir") from None

    mode = "own_kernel" if (dev == "cuda" or provoke) else "observe"
    strength = PROVOKE_STRENGTH if provoke else 0.0
    label = f"{INJECTED} " if provoke else ""
    config = demo_config(steps, mode=mode)

    with quiet_lightning():
        import pytorch_lightning as pl
        from pytorch_lightning.callbacks import ModelCheckpoint

        from ..exporters.jsonl import JsonlExporter
        from ..exporters.prometheus import PortInUseError, PrometheusExporter
        from ..lightning import FlashWatchCallback

        module, loader = build(model, steps, seed)
        jsonl = JsonlExporter(run_dir)
        prometheus = None
        if port is not None:
            # an injected run's series carry injected="true", so a dashboard never mistakes them
            prometheus = PrometheusExporter(port=port, host=HOST,
                                            const_labels={"injected": "true"} if provoke else None)
        view = DemoConsole(console, live=live, steps=steps, label=label, prometheus=prometheus, port_note=port_note)
        history = LossHistory()
        exporters = [e for e in (prometheus, Labelled(jsonl) if provoke else jsonl, history, view) if e is not None]
        watch = FlashWatchCallback(config, port=None, run_dir=run_dir, jsonl=False, console=None,
                                   exporters=exporters, log_summaries=False)
        checkpoint = ModelCheckpoint(dirpath=run_dir, filename="checkpoint", save_top_k=1,
                                     enable_version_counter=False, save_on_train_epoch_end=True)
        trainer = pl.Trainer(accelerator=dev, devices=1, max_steps=steps, max_epochs=1, precision="bf16-mixed",
                             gradient_clip_val=model.grad_clip, logger=False, enable_progress_bar=False,
                             enable_model_summary=False, callbacks=[watch, checkpoint], default_root_dir=run_dir)

        _header(console, model=model, dev=dev, mode=mode, steps=steps, seed=seed, config=config,
                strength=strength, run_dir=run_dir)
        meta = _meta(model=model, dev=dev, mode=mode, steps=steps, seed=seed, config=config, strength=strength,
                     port=port)
        run_dir.mkdir(parents=True, exist_ok=True)
        _write_json(run_dir / "demo.json", meta)

        start = time.monotonic()
        try:
            with alert_logging(console, rich_output=live, prefix=label), faults.rounding_bias(strength), \
                    _cpu_threads(1 if dev == "cpu" else None):
                interrupted = _fit(trainer, module, loader)
        except PortInUseError:
            raise DemoError(_port_message(HOST, port)) from None
        finally:
            view.close()
        seconds = time.monotonic() - start

    ckpt = run_dir / "checkpoint.ckpt"
    result = DemoResult(run_dir=run_dir, device=dev, mode=mode, injected=strength, steps=trainer.global_step,
                        seconds=seconds, url=view.url, losses=list(history.losses),
                        snapshot=watch.monitor.snapshot(), alerts=list(watch.monitor.alerts),
                        checkpoint=ckpt if ckpt.exists() else None, errors=watch.monitor.errors,
                        steps_asked=steps, interrupted=interrupted)
    meta.update(finished=time.strftime("%Y-%m-%dT%H:%M:%S%z"), seconds=round(seconds, 2),
                steps_done=result.steps, prometheus_url=view.url, alerts=len(result.alerts),
                interrupted=interrupted)
    _write_json(run_dir / "demo.json", meta)
    if report:
        try:
            from ..report import render

            result.report = render(run_dir, run_dir / "report.html")
        except Exception as exc:  # the run is done; a report failure must not hide it
            say(console, f"report.html not written: {exc}")
    return result


def _meta(*, model: DemoModel, dev: str, mode: str, steps: int, seed: int, config: MonitorConfig,
          strength: float, port: int | None) -> dict:
    """``demo.json``: what ran (the report shows it)."""
    return {
        "command": "flashwatch demo", "argv": sys.argv[1:], "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "injected": bool(strength), "inject_bias": strength,
        "label": f"{INJECTED} FAULT: flashwatch.kernels.faults.{describe(strength)}" if strength else None,
        "device": dev, "mode": mode, "variant": "plain" if mode == "own_kernel" else "sdpa",
        "precision": "bf16-mixed", "steps": steps, "seed": seed, "port": port,
        "model": dataclasses.asdict(model), "monitor_config": config.to_dict(),
    }


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


def _header(console: Console, *, model: DemoModel, dev: str, mode: str, steps: int, seed: int,
            config: MonitorConfig, strength: float, run_dir: Path) -> None:
    how = ("flashwatch's Triton kernel runs the attention, statistics in-kernel" if dev == "cuda" and mode == "own_kernel"
           else "flashwatch's reference kernel runs the attention" if mode == "own_kernel"
           else "torch SDPA runs the attention, flashwatch measures beside it")
    say(console, f"flashwatch demo: a {model.describe()} learns the Python standard library's source, "
                 f"bf16-mixed on {dev}, {mode} mode ({how}).", style="bold")
    say(console, f"  {steps} steps, seed {seed}; every step monitored; detectors: warm-up {config.warmup}, "
                 f"window {config.window} steps, default thresholds. Ctrl-C stops early, with the summary.")
    if strength:
        say(console, f"  {INJECTED} FAULT: {describe(strength)}. Not a real failure: a test of flashwatch's "
                     f"early warning.", style="bold red")
    say(console, f"  run folder: {run_dir}/")
