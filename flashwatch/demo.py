"""``flashwatch demo``: the main job on an embedded default, in about a minute on a laptop CPU.

A small byte-level GPT (``flashwatch.tinygpt``: 4 layers x 4 heads, head dim 16, context 64)
learns the Python standard library's own source text in BF16 mixed precision, with
``FlashWatchCallback`` in a Lightning ``Trainer``. While it trains, flashwatch serves its
metrics to Prometheus on 127.0.0.1 (port 9400 by default, the port of
``dashboards/prometheus.yml``), writes the run folder, and shows a live summary; at the end it
prints a short report and renders ``report.html`` (``flashwatch report``).

- CPU (default without CUDA): ``observe`` mode. The model keeps torch's SDPA; on every
  monitored step flashwatch runs its statistics pass (the PyTorch reference) beside it.
- CUDA: ``own_kernel`` mode. Attention runs through flashwatch's Triton kernel (variant
  ``plain``), statistics in-kernel.
- ``--provoke``: the early-warning scenario with an INJECTED fault: ``own_kernel`` mode with
  ``flashwatch.kernels.flash_attention(..., inject_bias=128)``, which, on rows where P_bar
  rounds to exactly 1 at two or more keys, inflates the output by 128 * 2**-8 = 50 % before
  rounding to BF16 (kernels/reference.py ``inject_rounding_bias``). Every output of such a
  run says INJECTED: the console, the log lines, the alert messages in ``metrics.jsonl`` and
  ``alerts.log``, ``demo.json``, the report, the run folder's name, and a constant label
  ``injected="true"`` on every Prometheus series.

Monitoring schedule. The demo monitors every optimizer step (``interval=1``) and scales the
detectors' clocks to the run (``warmup`` = steps/4, ``window`` and ``repeated_max_baseline`` =
steps/8 monitored steps); thresholds are ``MonitorConfig``'s defaults. A training run of
thousands of steps would use the defaults (``interval=10``, warm-up 20 monitored steps).

What to expect (this demo, 400 steps, seeds 0-2, on the 2-core development CPU, 2026-11-30,
with the calibrated defaults of config.py): without the fault no alert fired, the largest |drift
z| of any head at any step was 2.1-2.7 and the max logit stayed below 28. With ``--provoke``
``delta_drift`` (a warning) fired in every seed (first at steps 177, 99 and 221), the largest
|drift z| reached 6.5-7.8, ``repeated_max_rise`` fired in one seed, and the max logit passed 100
in two seeds of three (67-349; the ``max_logit`` rule's bound is 1000). (With the defaults
before the calibration, the warning rules fired 2-14 times on the healthy runs' early training.)

Run folder (default ``runs/demo-<timestamp>/``, ``runs/demo-<timestamp>-INJECTED/`` with
``--provoke``): ``metrics.jsonl`` (one JSON line per monitored step), ``alerts.log``,
``checkpoint.ckpt`` (model, optimizer and flashwatch state: ``trainer.fit(..., ckpt_path=)``
resumes), ``demo.json`` (what ran) and ``report.html``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import logging
import math
import os
import socket
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

DEFAULT_STEPS = 400
DEFAULT_PORT = 9400
PROVOKE_STRENGTH = 128.0  # inject_bias of --provoke: |O| * (1 + 128 * 2**-8) on the selected BF16 rows
INJECTED = "INJECTED"

log = logging.getLogger("flashwatch")


def _say(console, text: str = "", style: str | None = None) -> None:
    """One line of plain text (no markup); wrapped by rich on a terminal, left whole otherwise."""
    console.print(text, markup=False, highlight=False, style=style, soft_wrap=not console.is_terminal)

__all__ = ["DemoModel", "DemoResult", "demo_config", "run", "main", "DEFAULT_STEPS", "DEFAULT_PORT",
           "PROVOKE_STRENGTH"]


@dataclass(frozen=True)
class DemoModel:
    """The demo's model, batch and optimizer (the same on CPU and GPU)."""

    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 64  # head dim 16, the smallest flashwatch's kernels take
    block_size: int = 64  # context length T
    batch_size: int = 16
    lr: float = 3e-3
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    corpus_bytes: int = 2_000_000

    def describe(self) -> str:
        return (f"{self.n_layer}-layer byte-level GPT ({self.n_head} heads per layer, head dim "
                f"{self.n_embd // self.n_head}, context {self.block_size}, batch {self.batch_size})")


def demo_config(steps: int, *, mode: str):
    """The demo's ``MonitorConfig``: every step monitored, detector clocks scaled to ``steps``."""
    from .config import MonitorConfig

    return MonitorConfig(interval=1, mode=mode, warmup=max(10, steps // 4), window=max(10, steps // 8),
                         repeated_max_baseline=max(10, steps // 8))


@dataclass
class DemoResult:
    """What ``run`` did (also summarised in ``run_dir/demo.json``)."""

    run_dir: Path
    device: str
    mode: str
    injected: float  # inject_bias strength; 0 when no fault was injected
    steps: int  # optimizer steps done
    seconds: float
    url: str | None  # where /metrics was served while training
    losses: list[tuple[int, float]] = field(default_factory=list)  # (step, loss) of monitored steps
    snapshot: dict = field(default_factory=dict)  # Monitor.snapshot() at the end
    alerts: list = field(default_factory=list)  # flashwatch.detectors.Alert, in order
    checkpoint: Path | None = None
    report: Path | None = None
    errors: int = 0  # failures inside monitoring (monitor.errors)


class DemoError(RuntimeError):
    """A demo that cannot start (port taken, run folder in use, no CUDA); the message says what to do."""


# --- the model and data ---------------------------------------------------------------------------

def _lightning_parts(model_cfg: DemoModel, steps: int, seed: int):
    """The LightningModule and the DataLoader (imports torch and Lightning: called late)."""
    import pytorch_lightning as pl
    import torch
    from torch.utils.data import DataLoader, IterableDataset

    from .tinygpt import GPT, GPTConfig, sample_batch, stdlib_corpus

    class Windows(IterableDataset):
        """``steps`` random windows of the standard library's source; the same for a seed."""

        def __init__(self) -> None:
            self.data = stdlib_corpus(model_cfg.corpus_bytes)

        def __len__(self) -> int:
            return steps

        def __iter__(self) -> Iterator:
            g = torch.Generator().manual_seed(seed)
            for _ in range(steps):
                yield sample_batch(self.data, model_cfg.batch_size, model_cfg.block_size, generator=g)

    class DemoGPT(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = GPT(GPTConfig(n_layer=model_cfg.n_layer, n_head=model_cfg.n_head,
                                       n_embd=model_cfg.n_embd, block_size=model_cfg.block_size))

        def training_step(self, batch, batch_idx):
            x, y = batch
            _, loss = self.model(x, y)
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=model_cfg.lr, weight_decay=model_cfg.weight_decay)

    torch.manual_seed(seed)
    module = DemoGPT()
    return module, DataLoader(Windows(), batch_size=None)


# --- the injected fault ---------------------------------------------------------------------------

@contextlib.contextmanager
def injected_fault(strength: float) -> Iterator[None]:
    """Every own-kernel attention call of the run passes ``inject_bias=strength`` (INJECTED).

    ``MonitorConfig`` has no fault option: the process-wide INJECTED rounding bias of
    ``flashwatch.kernels.faults`` is set for the run and restored afterwards. The strength is
    the demo's own (``PROVOKE_STRENGTH``, checked on the demo's model and 400 steps); the
    experiments' injection scenario uses 512 on its own model.
    """
    if not strength:
        yield
        return
    from .kernels import faults

    with faults.rounding_bias(strength):
        yield


def _labelled_exporter(inner, label: str):
    """An exporter that prefixes every alert message with ``[label]`` before passing records on."""
    from .exporters.base import Exporter

    class Labelled(Exporter):
        name = getattr(inner, "name", type(inner).__name__)

        def open(self, layout):
            inner.open(layout)

        def export(self, record):
            def mark(alerts):
                return [dataclasses.replace(a, message=f"[{label}] {a.message}") for a in alerts]

            inner.export(dataclasses.replace(record, new_alerts=mark(record.new_alerts),
                                             active_alerts=mark(record.active_alerts)))

        def close(self):
            inner.close()

    return Labelled()


# --- display --------------------------------------------------------------------------------------

def _display_callback(console, *, live: bool, steps: int, title: str, prometheus, label: str = ""):
    """A Lightning callback: rich progress and flashwatch's panel on a terminal, plain lines otherwise."""
    from pytorch_lightning.callbacks import Callback
    from rich.console import Group
    from rich.live import Live
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
    from rich.text import Text

    from .exporters.base import Exporter
    from .exporters.console import ConsoleExporter

    class Latest(Exporter):
        """Keeps the last StepRecord and the loss of every monitored step."""

        name = "demo"

        def __init__(self) -> None:
            self.record = None
            self.losses: list[tuple[int, float]] = []

        def export(self, record) -> None:
            self.record = record
            loss = record.snapshot.get("flashwatch_loss", math.nan)
            self.losses.append((int(record.step), float(loss)))

    class Display(Callback):
        def __init__(self) -> None:
            self.latest = Latest()
            self.panel = ConsoleExporter("print", console=console, top=5)  # used for render()/summary_line()
            self.progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(),
                                     TextColumn("{task.completed}/{task.total} steps"),
                                     TextColumn("loss {task.fields[loss]}"), TimeElapsedColumn(),
                                     TextColumn("eta"), TimeRemainingColumn(), console=console,
                                     auto_refresh=False)
            self.task = self.progress.add_task(title, total=steps, loss="-")
            self.live: Live | None = None
            self.every = max(1, steps // 10)
            self.start = time.monotonic()
            self._shown = -math.inf
            self.url: str | None = None  # /metrics while training (the server stops with the run)

        def _renderable(self):
            parts: list[Any] = [self.progress.get_renderable()]
            if self.latest.record is not None:
                parts.append(self.panel.render(self.latest.record))
            return Group(*parts)

        def on_train_start(self, trainer, pl_module) -> None:
            self.start = time.monotonic()
            self.url = prometheus.url if prometheus is not None else None
            served = f"{self.url} (while it trains)" if self.url else "not served"
            _say(console, f"  {label}Prometheus metrics: {served}")
            if live:
                self.live = Live(self._renderable(), console=console, refresh_per_second=4, transient=False)
                self.live.start()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            n = trainer.global_step
            now = time.monotonic()
            if self.live is not None:
                if now - self._shown >= 0.25 or n >= steps:
                    self._shown = now
                    loss = outputs["loss"] if isinstance(outputs, dict) else outputs
                    self.progress.update(self.task, completed=n, loss=f"{float(loss):.3f}")
                    self.live.update(self._renderable())
            elif n % self.every == 0 or n >= steps:
                rate = n / max(now - self.start, 1e-9)
                record = self.latest.record
                line = self.panel.summary_line(record) if record is not None else f"step {n}"
                _say(console, f"{label}[{100 * n // steps:3d}%] {line} ({rate:.1f} steps/s)")

        def stop(self) -> None:
            if self.live is not None:
                self.live.update(self._renderable())
                self.live.stop()
                self.live = None

        def on_train_end(self, trainer, pl_module) -> None:
            self.progress.update(self.task, completed=trainer.global_step)
            self.stop()

        def on_exception(self, trainer, pl_module, exception) -> None:
            self.stop()

    return Display()


@contextlib.contextmanager
def _quiet_lightning() -> Iterator[None]:
    """Lightning's start-up chatter (GPU available..., tips) and known harmless warnings, off."""
    import pytorch_lightning  # noqa: F401  (its import sets its loggers' levels: set ours after it)

    loggers = [logging.getLogger(n) for n in ("pytorch_lightning", "lightning.pytorch", "lightning_fabric")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.WARNING)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*does not have many workers.*")
        warnings.filterwarnings("ignore", message=".*LeafSpec.*is deprecated.*")
        warnings.filterwarnings("ignore", message=".*`IterableDataset` has `__len__` defined.*")
        warnings.filterwarnings("ignore", message=".*Checkpoint directory .* exists and is not empty.*")
        try:
            yield
        finally:
            for lg, level in zip(loggers, levels):
                lg.setLevel(level)


@contextlib.contextmanager
def _alert_logging(console, *, rich_output: bool, prefix: str) -> Iterator[None]:
    """Show the ``flashwatch`` logger's warnings (alerts, fallbacks) on the demo's console."""
    if rich_output:
        from rich.logging import RichHandler

        handler: logging.Handler = RichHandler(console=console, show_path=False, markup=False,
                                               level=logging.WARNING)
        handler.setFormatter(logging.Formatter(prefix + "%(message)s"))
    else:
        handler = logging.StreamHandler(console.file)
        handler.setLevel(logging.WARNING)
        handler.setFormatter(logging.Formatter("%(levelname)s " + prefix + "%(message)s"))
    log.addHandler(handler)
    try:
        yield
    finally:
        log.removeHandler(handler)


# --- the run --------------------------------------------------------------------------------------

@contextlib.contextmanager
def _cpu_threads(n: int | None) -> Iterator[None]:
    """torch's intra-op threads for the run. The demo's matrices are tiny (64 x 64): one thread is
    as fast as two on an idle 2-core machine, and on a busy one two threads wait on each other
    (measured here: 35-55 ms per step with one thread, 500-800 ms with two while two other
    processes ran)."""
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


def _check_port(host: str, port: int) -> None:
    """Fail before training when ``host:port`` is taken (the exporter would fail at fit start)."""
    if port == 0:
        return
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the exporter's HTTP server
        try:
            s.bind((host, port))
        except OSError as exc:
            if exc.errno in (errno.EADDRINUSE, errno.EACCES):
                raise DemoError(_port_message(host, port)) from None
            raise


def _port_message(host: str, port: int) -> str:
    return (f"port {port} on {host} is taken (another flashwatch demo or training run, or another "
            f"server, listens there), so flashwatch cannot serve its Prometheus metrics on it. Run "
            f"`flashwatch demo --port 0` to pick any free port, or --port N for another one.")


def _default_run_dir(injected: bool) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return Path("runs") / (f"demo-{stamp}" + (f"-{INJECTED}" if injected else ""))


def _device(requested: str | None) -> str:
    import torch

    if requested in (None, "auto"):
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise DemoError("--device cuda: torch sees no CUDA device here (torch.cuda.is_available() is False); "
                        "run without --device to use the CPU")
    if requested not in ("cpu", "cuda"):
        raise DemoError(f"--device must be cpu, cuda or auto, got {requested!r}")
    return requested


def run(*, steps: int = DEFAULT_STEPS, seed: int = 0, device: str | None = None, port: int | None = DEFAULT_PORT,
        run_dir: str | os.PathLike | None = None, provoke: bool = False, console=None,
        live: bool | None = None, report: bool = True, model: DemoModel = DemoModel()) -> DemoResult:
    """Train the demo model with flashwatch watching; return what happened.

    Args:
        steps: optimizer steps (>= 1).
        seed: seed of the model's initialisation and of the batches.
        device: ``"cpu"``, ``"cuda"`` or None/``"auto"`` (CUDA when present).
        port: Prometheus port on 127.0.0.1; 0 picks a free one; None serves nothing.
        run_dir: the run folder (must not hold a run already); default ``runs/demo-<timestamp>``.
        provoke: inject the fault (``PROVOKE_STRENGTH``) in own_kernel mode; labelled INJECTED.
        console: a ``rich.console.Console`` (default: stdout).
        live: live progress and panel (default: when ``console`` is a terminal).
        report: render ``report.html`` in the run folder at the end.

    Raises:
        DemoError: the port is taken, the run folder holds a run, or CUDA was asked for and is
            missing (the message says what to do).
    """
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise DemoError(f"--steps must be a positive integer, got {steps!r}")
    if port is not None and not 0 <= port <= 65535:
        raise DemoError(f"--port must be in 0..65535 (0: any free port), got {port}")
    from rich.console import Console

    console = console or Console(highlight=False)
    live = console.is_terminal if live is None else live
    host = "127.0.0.1"
    if port is not None:
        _check_port(host, port)
    run_dir = Path(run_dir) if run_dir is not None else _default_run_dir(provoke)
    from .exporters.jsonl import METRICS_FILE

    if (run_dir / METRICS_FILE).exists():
        raise DemoError(f"{run_dir} already holds a run ({METRICS_FILE}); pass another --run-dir or remove it")

    dev = _device(device)
    mode = "own_kernel" if (dev == "cuda" or provoke) else "observe"
    strength = PROVOKE_STRENGTH if provoke else 0.0
    label = f"{INJECTED} " if provoke else ""
    config = demo_config(steps, mode=mode)

    with _quiet_lightning():
        import pytorch_lightning as pl
        from pytorch_lightning.callbacks import ModelCheckpoint

        from .exporters.jsonl import JsonlExporter
        from .exporters.prometheus import PortInUseError, PrometheusExporter
        from .lightning import FlashWatchCallback

        module, loader = _lightning_parts(model, steps, seed)
        jsonl = JsonlExporter(run_dir)
        exporters = [_labelled_exporter(jsonl, INJECTED) if provoke else jsonl]
        prometheus = None
        if port is not None:
            # an injected run's series carry injected="true", so a dashboard never mistakes them
            prometheus = PrometheusExporter(port=port, host=host,
                                            const_labels={"injected": "true"} if provoke else None)
            exporters.insert(0, prometheus)
        watch = FlashWatchCallback(config, port=None, run_dir=run_dir, jsonl=False, console=None,
                                   exporters=exporters, log_summaries=False)
        title = f"{INJECTED} FAULT demo" if provoke else "flashwatch demo"
        display = _display_callback(console, live=live, steps=steps, title=title, prometheus=prometheus,
                                    label=label)
        watch.monitor.add_exporter(display.latest)
        checkpoint = ModelCheckpoint(dirpath=run_dir, filename="checkpoint", save_top_k=1,
                                     enable_version_counter=False, save_on_train_epoch_end=True)
        trainer = pl.Trainer(accelerator=dev, devices=1, max_steps=steps, max_epochs=1, precision="bf16-mixed",
                             gradient_clip_val=model.grad_clip, logger=False, enable_progress_bar=False,
                             enable_model_summary=False, callbacks=[watch, display, checkpoint],
                             default_root_dir=run_dir)

        _header(console, model=model, dev=dev, mode=mode, steps=steps, seed=seed, config=config,
                strength=strength, run_dir=run_dir)
        meta = _meta(model=model, dev=dev, mode=mode, steps=steps, seed=seed, config=config, strength=strength,
                     port=port)
        run_dir.mkdir(parents=True, exist_ok=True)
        _write_json(run_dir / "demo.json", meta)

        start = time.monotonic()
        try:
            with _alert_logging(console, rich_output=live, prefix=label), injected_fault(strength), \
                    _cpu_threads(1 if dev == "cpu" else None):
                trainer.fit(module, loader)
        except PortInUseError:
            raise DemoError(_port_message(host, port)) from None
        finally:
            display.stop()
        seconds = time.monotonic() - start

    url = display.url
    ckpt = run_dir / "checkpoint.ckpt"
    result = DemoResult(run_dir=run_dir, device=dev, mode=mode, injected=strength, steps=trainer.global_step,
                        seconds=seconds, url=url, losses=list(display.latest.losses),
                        snapshot=watch.monitor.snapshot(), alerts=list(watch.monitor.alerts),
                        checkpoint=ckpt if ckpt.exists() else None, errors=watch.monitor.errors)
    meta.update(finished=time.strftime("%Y-%m-%dT%H:%M:%S%z"), seconds=round(seconds, 2),
                steps_done=result.steps, prometheus_url=url, alerts=len(result.alerts),
                interrupted=bool(trainer.interrupted))
    _write_json(run_dir / "demo.json", meta)
    if report:
        try:
            from .report import render

            result.report = render(run_dir, run_dir / "report.html")
        except Exception as exc:  # the run is done; a report failure must not hide it
            _say(console, f"report.html not written: {exc}")
    return result


def _meta(*, model: DemoModel, dev: str, mode: str, steps: int, seed: int, config, strength: float,
          port: int | None) -> dict:
    return {
        "command": "flashwatch demo", "argv": sys.argv[1:], "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "injected": bool(strength), "inject_bias": strength,
        "label": (f"{INJECTED} FAULT: flashwatch.kernels.flash_attention(..., inject_bias={strength:g}) "
                  f"inflates |O| by {strength * 2 ** -8:.0%} before BF16 rounding on rows where P_bar rounds "
                  f"to exactly 1 at two or more keys") if strength else None,
        "device": dev, "mode": mode, "variant": "plain" if mode == "own_kernel" else "sdpa",
        "precision": "bf16-mixed", "steps": steps, "seed": seed, "port": port,
        "model": dataclasses.asdict(model), "monitor_config": config.to_dict(),
    }


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


def _header(console, *, model: DemoModel, dev: str, mode: str, steps: int, seed: int, config, strength: float,
            run_dir: Path) -> None:
    how = ("flashwatch's Triton kernel runs the attention, statistics in-kernel" if dev == "cuda" and mode == "own_kernel"
           else "flashwatch's reference kernel runs the attention" if mode == "own_kernel"
           else "torch SDPA runs the attention, flashwatch measures beside it")
    _say(console, f"flashwatch demo: a {model.describe()} learns the Python standard library's source, "
                  f"bf16-mixed on {dev}, {mode} mode ({how}).", style="bold")
    _say(console, f"  {steps} steps, seed {seed}; every step monitored; detectors: warm-up {config.warmup}, "
                  f"window {config.window} steps, default thresholds.")
    if strength:
        _say(console, f"  {INJECTED} FAULT: inject_bias={strength:g}: on rows where P_bar rounds to exactly 1 at two "
                      f"or more keys, |O| is inflated by {strength * 2 ** -8:.0%} before BF16 rounding. Not a real "
                      f"failure: a test of flashwatch's early warning.", style="bold red")
    _say(console, f"  run folder: {run_dir}/")


# --- the final report -----------------------------------------------------------------------------

_SIGNALS = (  # (label, metric, ranked by, format)
    ("|drift z|", "flashwatch_delta_drift_z", abs, "{:+.2f}"),
    ("repeated-max ratio (BF16)", "flashwatch_repeated_max_ratio_bf16", float, "{:.1%}"),
    ("W^Q spectral norm", "flashwatch_wq_spectral_norm", float, "{:.3g}"),
    ("max logit", "flashwatch_max_logit", float, "{:.3g}"),
)


def report_lines(result: DemoResult, *, top: int = 3) -> list[str]:
    """The short report printed at the end of the demo, as plain lines."""
    from collections import Counter

    from .exporters.summary import top_heads

    tag = f" [{INJECTED} FAULT, inject_bias={result.injected:g}]" if result.injected else ""
    lines = [f"flashwatch demo report{tag}"]
    finite = [(s, v) for s, v in result.losses if v == v]
    if finite:
        (s0, l0), (s1, l1) = finite[0], finite[-1]
        loss = f"{l0:.3f} at step {s0} -> {l1:.3f} at step {s1}"
    else:
        loss = "not measured"
    lines.append(f"  steps:   {result.steps} optimizer steps in {result.seconds:.1f} s on {result.device} "
                 f"({result.mode} mode), every step monitored")
    lines.append(f"  loss:    {loss}")
    lines.append("  top heads at the last step (layer.head value):")
    for label, metric, key, fmt in _SIGNALS:
        heads = top_heads(result.snapshot, metric, top, key)
        shown = "   ".join(f"L{l}.H{h} {fmt.format(v)}" for l, h, v in heads if v == v) or "not measured"
        lines.append(f"    {label:<26} {shown}")
    counts = Counter(a.rule for a in result.alerts)
    severities = Counter(a.severity for a in result.alerts)
    if result.alerts:
        by_rule = ", ".join(f"{rule} x{n}" for rule, n in counts.most_common())
        lines.append(f"  alerts:  {len(result.alerts)} ({severities.get('critical', 0)} critical, "
                     f"{severities.get('warning', 0)} warning): {by_rule}")
        firsts = {}
        for a in result.alerts:
            firsts.setdefault(a.rule, a)
        for a in sorted(firsts.values(), key=lambda a: a.step):
            where = f"L{a.layer}.H{a.head}" if a.head >= 0 else (f"L{a.layer}" if a.layer >= 0 else "run")
            lines.append(f"    first {a.rule} at step {a.step} ({a.severity}, {where}, value {a.value:.3g} vs "
                         f"threshold {a.threshold:.3g})")
        if (not result.injected and severities.get("critical", 0) == 0
                and set(counts) & {"repeated_max_rise", "wq_growth", "wq_outlier"}):
            lines.append("    warnings only: repeated-max rise and W^Q growth use thresholds set for runs of "
                         "thousands of steps; early training of a small model can cross them")
    else:
        lines.append("  alerts:  none")
    if result.injected and not counts.get("delta_drift"):
        lines.append(f"    ({INJECTED} run without a delta_drift alert: try more --steps or another --seed)")
    if not result.injected and not any(a.severity == "critical" for a in result.alerts):
        lines.append("    see an early warning: flashwatch demo --provoke (an injected fault)")
    if result.errors:
        lines.append(f"  monitor errors: {result.errors} (see the warnings above)")
    lines.append(f"  metrics: {result.url or 'not served'} served them while training (the server stops with the "
                 f"run); scrape config dashboards/prometheus.yml, Grafana: dashboards/")
    d = result.run_dir
    lines.append(f"  files:   {d}/")
    lines.append(f"    metrics.jsonl    one JSON line per monitored step")
    lines.append(f"    alerts.log       {len(result.alerts)} alert line(s)")
    if result.checkpoint is not None:
        lines.append(f"    {result.checkpoint.name:<16} model, optimizer and flashwatch state (trainer.fit(..., ckpt_path=))")
    lines.append("    demo.json        what ran")
    if result.report is not None:
        lines.append(f"    {result.report.name:<16} loss, alerts and per-head heatmaps (open it in a browser)")
    lines.append(f"  picture: flashwatch report {d} --out {d}/report.png")
    return lines


def main(args) -> int:
    """The ``flashwatch demo`` command (arguments from ``flashwatch.cli``)."""
    from rich.console import Console

    console = Console(highlight=False)
    try:
        result = run(steps=args.steps, seed=args.seed, device=args.device, port=args.port, run_dir=args.run_dir,
                     provoke=args.provoke, console=console)
    except DemoError as exc:
        _say(console, f"flashwatch demo: {exc}", style="bold red")
        return 2
    console.print()
    for i, line in enumerate(report_lines(result)):
        _say(console, line, style="bold" if i == 0 else None)
    return 0
