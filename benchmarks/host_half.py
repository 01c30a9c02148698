"""The host half of a monitored step, timed on the CPU, split by phase.

On every monitored step the Monitor copies the step's device readings to the host and later
decides the step there (``Monitor._decide``): it unpacks the readings, builds the step's
signals (``flashwatch.step_signals.SignalBuilder``, the W^Q-error chain's host side included),
runs the rules (``flashwatch.decisions``, ``flashwatch.detectors``), keeps the step as plain
data (``flashwatch.snapshot.host_record``), makes the metric snapshot and hands it to the
exporters. On a GPU that host time shows in the training step whenever the step is host-bound.

This script builds a real Monitor over a ``flashwatch.tinygpt`` GPT with the given layer and
head counts (head dim 16, a short context: the host half depends on the head count only), trains it on
the CPU with every step monitored, and times each phase of each step's host half with
``time.perf_counter``. The device half (the model's forward and backward, the statistics, the
power iteration) is not timed. Phases:

- ``readings``: the host copy unpacked into per-layer readings (``Readings.per_layer``,
  ``LayerReading``) and the "no call seen" check;
- ``signals``: ``SignalBuilder.build`` (drift, windows, growth, trends, the chain's cumulative push);
- ``decide``: the detectors and the alert history (``Decisions.judge``) and ``auto_fix``;
- ``record``: ``host_record`` (the step as plain data; made when first read, so inside the host
  half only when an exporter reads the snapshot);
- ``snapshot``: ``Monitor.snapshot()`` without ``record`` (the metric-keyed dict the exporters
  read; made only when there is an exporter);
- ``exporters``: ``FanOut.export`` (the exporters of ``--exporters``);
- ``host half``: the whole of ``Monitor._decide``, and ``without exporters`` (the target).

Run:  python benchmarks/host_half.py [--layers 12 --heads 12 --steps 60] [--exporters jsonl] [--json out.json]
      python benchmarks/host_half.py --profile 25     # also the 25 hottest functions (cProfile)
This is a benchmark, not a test: it is never collected by pytest.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import logging
import os
import platform
import pstats
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack

import torch

from flashwatch import Monitor, MonitorConfig
from flashwatch import monitor as monitor_module
from flashwatch.tinygpt import GPT, GPTConfig

PHASES = ("readings", "signals", "decide", "record", "snapshot", "exporters")
TOTAL, WITHOUT_EXPORT = "host half", "without exporters"
EXPORTERS = ("jsonl", "prometheus", "console")


def make_exporters(names: list[str], stack: ExitStack) -> list:
    out = []
    for name in names:
        if name == "jsonl":
            from flashwatch.exporters.jsonl import JsonlExporter
            out.append(JsonlExporter(stack.enter_context(tempfile.TemporaryDirectory())))
        elif name == "prometheus":
            from flashwatch.exporters.prometheus import PrometheusExporter
            out.append(PrometheusExporter(port=0))
        elif name == "console":
            from rich.console import Console

            from flashwatch.exporters.console import ConsoleExporter
            out.append(ConsoleExporter("log", console=Console(file=io.StringIO())))
    return out


class PhaseTimer:
    """Wraps the host half's calls on one Monitor (instance attributes and the monitor module's
    ``host_record``) and records each one's wall time; ``steps`` holds one dict per ``_decide``."""

    def __init__(self, monitor: Monitor):
        self.monitor = monitor
        self.steps: list[dict[str, float]] = []
        self._current: dict[str, float] | None = None
        self._nested: list[float] = []  # time spent in timed calls inside the open ones
        self._saved_host_record = monitor_module.host_record
        m = monitor
        self._wrap(m, "_decide", TOTAL)
        self._wrap(m._signals, "build", "signals")
        self._wrap(m._decisions, "judge", "decide")
        self._wrap(m._decisions, "auto_fix", "decide")
        self._wrap(m, "snapshot", "snapshot")
        self._wrap(m._fan, "export", "exporters")
        monitor_module.host_record = self._timed(self._saved_host_record, "record")

    def _timed(self, fn, phase):
        def timed(*args, **kwargs):
            if self._current is None:  # outside _decide (a snapshot read later): not the host half
                return fn(*args, **kwargs)
            self._nested.append(0.0)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent = (time.perf_counter() - t0) * 1e3
                inner = self._nested.pop()
                # exclusive time: a phase called inside another (host_record inside snapshot) is its own
                self._current[phase] = self._current.get(phase, 0.0) + spent - inner
                if self._nested:
                    self._nested[-1] += spent
        return timed

    def _wrap(self, obj, name, phase):
        fn = getattr(obj, name)
        if phase == TOTAL:
            def decide(*args, **kwargs):
                self._current = {}
                t0 = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    cur, self._current = self._current, None
                    cur[TOTAL] = (time.perf_counter() - t0) * 1e3
                    # the snapshot made for the exporters is timed inside _decide; readings: the rest
                    cur["readings"] = cur[TOTAL] - sum(cur.get(p, 0.0) for p in PHASES if p != "readings")
                    cur[WITHOUT_EXPORT] = cur[TOTAL] - cur.get("exporters", 0.0)
                    self.steps.append(cur)
            setattr(obj, name, decide)
        else:
            setattr(obj, name, self._timed(fn, phase))

    def restore(self) -> None:
        monitor_module.host_record = self._saved_host_record


def summary(values: list[float]) -> dict[str, float]:
    ms = sorted(values)
    return {"median_ms": statistics.median(ms), "p95_ms": ms[min(len(ms) - 1, int(0.95 * len(ms)))],
            "mean_ms": statistics.fmean(ms)}


def monitored_training(layers: int, heads: int, steps: int, warmup: int, exporters: list[str], stack: ExitStack):
    """A Monitor attached to a tiny-width GPT of ``layers`` x ``heads``, every step monitored, and
    ``train_step()``: one CPU training step closed by ``monitor.step``."""
    torch.manual_seed(0)
    torch.set_num_threads(1)
    head_dim, block = 16, 8  # 16: the smallest head dim the statistics measure
    model = GPT(GPTConfig(n_layer=layers, n_head=heads, n_embd=heads * head_dim, block_size=block))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    x = torch.randint(0, 256, (2, block), generator=torch.Generator().manual_seed(0))
    y = torch.roll(x, -1, dims=1)
    # every step monitored; window and warm-up short enough that every rule judges within the run
    config = MonitorConfig(interval=1, window=min(10, max(2, steps // 4)), warmup=min(5, warmup))
    monitor = Monitor(config, make_exporters(exporters, stack))
    monitor.attach(model)
    stack.callback(monitor.close)

    def train_step() -> None:
        _, loss = model(x, y)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        monitor.step(loss=loss.detach(), grad_norm=grad_norm)

    return monitor, train_step


def run(layers: int, heads: int, steps: int, warmup: int, exporters: list[str]) -> dict:
    """Per-phase times of ``steps`` monitored steps' host halves (after ``warmup`` untimed ones)."""
    with ExitStack() as stack:
        monitor, train_step = monitored_training(layers, heads, steps, warmup, exporters, stack)
        timer = PhaseTimer(monitor)
        stack.callback(timer.restore)
        for i in range(warmup + steps):
            if i == warmup:
                timer.steps.clear()
            train_step()
    if monitor.errors:
        raise SystemExit(f"the Monitor counted {monitor.errors} errors: the timing would not be of a working step")
    return {"layers": layers, "heads_per_layer": heads, "heads": layers * heads, "steps": len(timer.steps),
            "exporters": exporters, "alerts": len(monitor.alerts),
            "phases": {p: summary([s.get(p, 0.0) for s in timer.steps]) for p in (*PHASES, WITHOUT_EXPORT, TOTAL)}}


def profile_host_half(layers: int, heads: int, steps: int, warmup: int, exporters: list[str], top: int) -> str:
    """cProfile of ``Monitor._decide`` alone over ``steps`` monitored steps: the ``top`` functions
    by own time."""
    profiler = cProfile.Profile()
    with ExitStack() as stack:
        monitor, train_step = monitored_training(layers, heads, steps, warmup, exporters, stack)
        decide = monitor._decide

        def profiled(*args, **kwargs):
            profiler.enable()
            try:
                return decide(*args, **kwargs)
            finally:
                profiler.disable()

        for i in range(warmup + steps):
            if i == warmup:
                monitor._decide = profiled
            train_step()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(top)
    return text.getvalue()


@contextlib.contextmanager
def quiet_flashwatch_log():
    """The "flashwatch" logger silent while the benchmark runs (its warnings would be timed), as
    it was afterwards."""
    logger = logging.getLogger("flashwatch")
    saved = logger.handlers[:], logger.propagate
    logger.handlers[:] = [logging.NullHandler()]
    logger.propagate = False
    try:
        yield
    finally:
        logger.handlers[:], logger.propagate = saved


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--heads", type=int, default=12, help="heads per layer")
    p.add_argument("--steps", type=int, default=60, help="monitored steps timed (after --warmup untimed ones)")
    p.add_argument("--warmup", type=int, default=10, help="monitored steps run first, not timed")
    p.add_argument("--exporters", nargs="*", default=[], choices=EXPORTERS,
                   help="exporters the Monitor hands each step to (default: none)")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="also print the N hottest functions of the host half (cProfile, by own time)")
    p.add_argument("--json", metavar="PATH", help="also write the numbers as JSON")
    args = p.parse_args(argv)
    for name, value, least in (("--layers", args.layers, 1), ("--heads", args.heads, 1), ("--steps", args.steps, 1),
                               ("--warmup", args.warmup, 0)):
        if value < least:
            p.error(f"{name} must be >= {least}, got {value}")
    with quiet_flashwatch_log():
        result = run(args.layers, args.heads, args.steps, args.warmup, args.exporters)
        if args.profile:
            result["profile"] = profile_host_half(args.layers, args.heads, args.steps, args.warmup,
                                                  args.exporters, args.profile)
    result["machine"] = {"processor": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                         "python": platform.python_version(), "torch": torch.__version__,
                         "system": f"{platform.system()} {platform.release()}"}
    result["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(f"flashwatch host half per monitored step: {args.layers} layers x {args.heads} heads = "
          f"{result['heads']} heads, {result['steps']} monitored steps, exporters: "
          f"{', '.join(args.exporters) or 'none'}, {result['alerts']} alerts raised")
    m = result["machine"]
    print(f"machine: {m['processor']}, {m['cpus']} CPUs, Python {m['python']}, torch {m['torch']}, {m['system']}")
    print(f"{'phase':20s} {'median ms':>10s} {'p95 ms':>10s} {'mean ms':>10s}")
    for phase, s in result["phases"].items():
        print(f"{phase:20s} {s['median_ms']:10.3f} {s['p95_ms']:10.3f} {s['mean_ms']:10.3f}")
    if args.profile:
        print(result["profile"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
