"""flashwatch under Lightning DDP on two GPUs (or two CPU processes): one view, one decision.

Trains the byte-level tiny GPT (GPT-2 small shape on CUDA: 12 layers x 12 heads, d=768, T=1024,
batch 8 per rank, bf16-mixed) with ``Trainer(strategy="ddp", devices=2)`` and
``FlashWatchCallback`` for a bounded number of steps, then prints what a person needs to see:

- the reduction: how many collectives per monitored step and how many bytes;
- every rank's view (loss, gradient norm, cumulative delta error, drift z, alerts, switches,
  variants) and whether the ranks' snapshots and Monitor states are identical;
- an alert seen by ONE rank: at ``--inject-step`` rank 1 alone writes a max logit of 1e4 into
  layer 0 head 0's statistics (real logits stay far below the bound of 1,000); after the
  all-reduce both ranks raise the same ``max_logit`` alert and ``auto_fix`` switches layer 0 to
  ``fp32_delta`` on both ranks at the same step;
- the endpoint: rank 0 serves ``/metrics`` (scraped), rank 1 serves nothing (unless
  ``--per-rank-endpoints``: every rank on base port + local rank with a ``rank`` label);
- step time (CUDA events on CUDA, no synchronisation added): unmonitored and monitored steps,
  before and after the switch.

Run from the repository root without installing (as benchmarks/gpu_session.sh does)::

    [ -e flashwatch/kernels ] || ln -s ../kernels flashwatch/kernels
    PYTHONPATH=$PWD timeout 170 python3 benchmarks/ddp_demo.py --json $OUT/ddp_demo.json 2>&1 | tee $OUT/ddp_demo.log
    PYTHONPATH=$PWD python3 benchmarks/ddp_demo.py --device cpu      # the same with gloo on the CPU

Exit status 0 when every check passed, 1 otherwise (the failed checks are printed).
"""

from __future__ import annotations

import time

_T0 = time.perf_counter()

import argparse
import json
import math
import os
import socket
import statistics
import sys
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run from a checkout without installing; last, so that the checkout's
    sys.path.append(str(ROOT))  # kernels/ folder never shadows an installed `kernels` package

import torch  # noqa: E402

try:
    import flashwatch.kernels  # noqa: F401,E402
except ImportError as exc:  # pragma: no cover - a checkout without the link
    sys.exit(f"flashwatch.kernels is not importable ({exc}): from the repository root run "
             "`ln -s ../kernels flashwatch/kernels` (or pip install .) and set PYTHONPATH=$PWD")

from pytorch_lightning import Callback, LightningModule, Trainer  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

from flashwatch.lightning import FlashWatchCallback  # noqa: E402
from flashwatch.tinygpt import GPT, GPTConfig, stdlib_corpus  # noqa: E402

PORT_ENV = "FLASHWATCH_DDP_DEMO_PORT"  # the launching process picks the port; the ranks it starts read it
BOUND = 1000.0  # max_logit bound: far above real logits, below the injected 1e4


class Windows(Dataset):
    """Windows of the corpus; item i depends only on i, so every rank agrees on the data set."""

    def __init__(self, data: torch.Tensor, block: int, n: int):
        self.data, self.block, self.n = data, block, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        g = torch.Generator().manual_seed(i)
        start = int(torch.randint(self.data.numel() - self.block - 1, (1,), generator=g))
        w = self.data[start: start + self.block + 1].to(torch.int64)
        return w[:-1], w[1:]


class LitGPT(LightningModule):
    def __init__(self, config: GPTConfig, lr: float):
        super().__init__()
        torch.manual_seed(0)
        self.model = GPT(config)
        self.lr = lr

    def training_step(self, batch, batch_idx):
        x, y = batch
        return self.model(x, y)[1]

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr, betas=(0.9, 0.95), weight_decay=0.1)


class Inject(Callback):
    """Before the Monitor reads step ``step``: rank 1 alone sees a max logit of 1e4 (layer 0, head 0)."""

    def __init__(self, watch: FlashWatchCallback, step: int):
        self.watch, self.step = watch, step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        monitor = self.watch.monitor
        if trainer.global_rank == 1 and monitor.global_step == self.step and monitor.monitoring:
            monitor.layers[0].stats.max_logit[0] = 1e4


class Report(Callback):
    """Times every step on every rank; at the end gathers every rank's view to rank 0."""

    def __init__(self, watch: FlashWatchCallback, cuda: bool, inject_step: int):
        self.watch, self.cuda, self.inject_step = watch, cuda, inject_step
        self.own_max_logit: float | None = None  # this rank's own max logit, layer 0 head 0, at inject_step
        self.events: list = []
        self.monitored: list[bool] = []
        self.t0 = self.t1 = 0.0
        self.result: dict | None = None

    def _event(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def on_train_start(self, trainer, pl_module):
        self.t0 = time.perf_counter()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.monitored.append(self.watch.monitor.monitoring)
        self.events.append([self._event(), None])

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.events[-1][1] = self._event()  # after FlashWatchCallback's monitor.step (callback order)
        monitor = self.watch.monitor
        if monitor.global_step == self.inject_step + 1 and monitor._reducer is not None:
            own = monitor._reducer.split_local(monitor._reducer.last_local)  # before the reduce
            self.own_max_logit = float(own["stats"][monitor.layers[0].stats.max_rows()[0], 0])

    def on_train_end(self, trainer, pl_module):
        import torch.distributed as dist

        if self.cuda:
            torch.cuda.synchronize()
        self.t1 = time.perf_counter()
        times = [(e.elapsed_time(f) if self.cuda else (f - e) * 1e3) for e, f in self.events]
        monitor, watch = self.watch.monitor, self.watch
        text, closed_next = None, None
        if watch.url is not None:
            with urllib.request.urlopen(watch.url, timeout=10) as r:
                text = r.read().decode()
        if trainer.global_rank == 0 and not watch.per_rank_endpoints and watch.port:
            with socket.socket() as s:  # where rank 1 would serve in per-rank mode: nothing listens
                s.settimeout(1.0)
                closed_next = s.connect_ex(("127.0.0.1", watch.port + 1)) != 0
        snap = monitor.snapshot()
        view = {
            "rank": trainer.global_rank, "monitor_rank": monitor.rank, "world_size": monitor.world_size,
            "global_step": monitor.global_step, "monitored_steps": monitor.monitored_steps, "errors": monitor.errors,
            "loss": snap["flashwatch_loss"], "grad_norm": snap["flashwatch_grad_norm"],
            "cum_delta_sum": math.fsum(snap["flashwatch_delta_error_cumulative"].values()),
            "max_abs_drift_z": max((abs(v) for v in snap["flashwatch_delta_drift_z"].values() if math.isfinite(v)),
                                   default=math.nan),
            "alerts": [(a.rule, a.step, a.layer, a.head, round(a.value, 3)) for a in monitor.alerts],
            "switches": [(s["step"], s["layer"], s["from"], s["to"]) for s in monitor.switches],
            "variants": monitor.variants, "url": watch.url, "port": watch.port,
            "own_max_logit_at_inject": self.own_max_logit,
            "scraped_series": None if text is None else sum(1 for l in text.splitlines() if l and l[0] != "#"),
            "scraped_ranks": None if text is None else sorted({l.split('rank="')[1].split('"')[0]
                                                                for l in text.splitlines() if 'rank="' in l}),
            "closed_next_port": closed_next,
            "reduction": None if monitor._reducer is None else monitor._reducer.describe(),
            "backend": str(dist.get_backend()),
            "snapshot": _plain(snap), "state": _plain(monitor.state_dict()),
            "times": times, "monitored": self.monitored, "wall_s": self.t1 - self.t0,
        }
        views = [None] * trainer.world_size
        dist.all_gather_object(views, view)  # the process group is still up in on_train_end
        self.result = views if trainer.global_rank == 0 else None


def _plain(x):
    """Snapshots and states as JSON-able data with NaN spelled out, for exact comparison across ranks."""
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if isinstance(x, torch.Tensor):
        return _plain(x.tolist())
    if isinstance(x, float) and math.isnan(x):
        return "NaN"
    return x


def _free_base_port() -> int:
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", base + 1))
            return base
        except OSError:
            continue
    raise RuntimeError("no two consecutive free ports")


def _ms(values: list[float]) -> str:
    return f"{statistics.median(values):8.1f}" if values else "       -"


def summarize(views: list[dict], args, elapsed: float) -> tuple[list[str], list[str], dict]:
    lines, failed = [], []

    def check(ok: bool, what: str) -> None:
        lines.append(f"  [{'ok' if ok else 'FAIL'}] {what}")
        if not ok:
            failed.append(what)

    v0 = views[0]
    lines.append(f"reduction per monitored step: {v0['reduction']}")
    lines.append("")
    lines.append(f"{'':24}" + "".join(f"{'rank ' + str(v['rank']):>22}" for v in views))
    for key, fmt in (("global_step", "{}"), ("monitored_steps", "{}"), ("loss", "{:.6f}"), ("grad_norm", "{:.6f}"),
                     ("cum_delta_sum", "{:.6e}"), ("max_abs_drift_z", "{:.4f}"), ("errors", "{}")):
        lines.append(f"  {key:22}" + "".join(f"{fmt.format(v[key]):>22}" for v in views))
    lines.append(f"  {'alerts':22}" + "".join(f"{len(v['alerts']):>22}" for v in views))
    lines.append(f"  {'switches':22}" + "".join(f"{len(v['switches']):>22}" for v in views))
    lines.append(f"  {'own max logit @inject':22}" + "".join(f"{v['own_max_logit_at_inject']:>22.4g}" for v in views))
    lines.append(f"  {'/metrics port':22}" + "".join(f"{(v['port'] or 'none'):>22}" for v in views))
    lines.append("")
    for v in views:
        lines.append(f"rank {v['rank']} alerts: {v['alerts']}")
        lines.append(f"rank {v['rank']} switches: {v['switches']}  variants now: {v['variants']}")
    lines.append("")
    lines.append("checks:")
    check(all(v["world_size"] == len(views) for v in views), f"every rank's Monitor reduces over {len(views)} ranks")
    check(all(v["errors"] == 0 for v in views), "no monitoring errors on any rank")
    check(all(v["snapshot"] == v0["snapshot"] for v in views),
          "snapshots identical on every rank (all metrics: cumulative delta error, drift z, W^Q, loss, ...)")
    check(all(v["state"] == v0["state"] for v in views), "Monitor states identical on every rank (detectors too)")
    injected = [a for a in v0["alerts"] if a[0] == "max_logit" and a[1] == args.inject_step and a[2:4] == (0, 0)]
    alone = v0["own_max_logit_at_inject"] is not None and v0["own_max_logit_at_inject"] < BOUND \
        and views[1]["own_max_logit_at_inject"] == 1e4
    check(all(v["alerts"] == v0["alerts"] for v in views) and len(injected) == 1 and alone,
          f"the max_logit alert rank 1 alone saw at step {args.inject_step} was raised by every rank")
    check(all(v["switches"] == v0["switches"] for v in views)
          and (args.inject_step, 0, "sdpa", "fp32_delta") in [tuple(s) for s in v0["switches"]],
          f"auto_fix switched layer 0 to fp32_delta on every rank at step {args.inject_step}")
    if args.per_rank_endpoints:
        check(all(v["url"] and v["scraped_ranks"] == [str(v["rank"])] for v in views),
              "every rank serves /metrics on base port + local rank, labelled with its rank")
    else:
        check(bool(v0["url"]) and v0["scraped_series"] and v0["scraped_ranks"] == [],
              f"rank 0 serves {v0['url']} ({v0['scraped_series']} series, no rank label)")
        check(all(v["url"] is None for v in views[1:]) and v0["closed_next_port"] is not False,
              "no other rank serves an endpoint")

    lines.append("")
    lines.append("step time, ms (median; rank 0; first 5 steps left out as warm-up; CUDA events" +
                 (")" if args.device == "cuda" else " replaced by host clocks on the CPU)"))
    times, flags = v0["times"], v0["monitored"]
    switch = args.inject_step + 1
    phases = (("before the switch", range(5, min(switch, len(times)))),
              ("after the switch (first 2 steps out)", range(switch + 2, len(times))))
    lines.append(f"  {'':40}{'unmonitored':>12}{'monitored':>12}{'steps':>8}")
    timing = {}
    for name, idx in phases:
        un = [times[i] for i in idx if not flags[i]]
        mo = [times[i] for i in idx if flags[i]]
        timing[name] = {"unmonitored_ms": statistics.median(un) if un else None,
                        "monitored_ms": statistics.median(mo) if mo else None, "steps": len(un) + len(mo)}
        lines.append(f"  {name:40}{_ms(un):>12}{_ms(mo):>12}{len(un) + len(mo):>8}")
    lines.append(f"training wall time {v0['wall_s']:.1f} s for {v0['global_step']} steps; whole script {elapsed:.1f} s")
    lines.append("")
    lines.append("RESULT: " + ("PASS" if not failed else f"FAIL ({len(failed)} checks)"))
    return lines, failed, timing


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--devices", type=int, default=2, help="GPUs (CUDA) or processes (CPU)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default 200 CUDA, 40 CPU)")
    p.add_argument("--interval", type=int, default=None, help="monitor every N steps (default 10 CUDA, 5 CPU)")
    p.add_argument("--inject-step", type=int, default=None,
                   help="monitored step at which rank 1 alone sees a huge max logit (default: steps/2 rounded "
                        "to the interval)")
    p.add_argument("--port", type=int, default=None, help="Prometheus base port (default: a free one)")
    p.add_argument("--per-rank-endpoints", action="store_true", help="one endpoint per rank, rank label")
    p.add_argument("--json", default=None, help="write the report (and every rank's view) here")
    args = p.parse_args(argv)
    cuda = args.device == "cuda"
    if cuda and torch.cuda.device_count() < args.devices:
        print(f"needs {args.devices} CUDA devices, found {torch.cuda.device_count()} (or use --device cpu)")
        return 2
    if args.steps is None:
        args.steps = 200 if cuda else 40
    if args.interval is None:
        args.interval = 10 if cuda else 5
    if args.inject_step is None:
        args.inject_step = (args.steps // 2) // args.interval * args.interval
    if args.inject_step % args.interval or not 0 <= args.inject_step < args.steps:
        p.error("--inject-step must be a monitored step (a multiple of --interval) below --steps")
    if PORT_ENV not in os.environ:  # the launching process (rank 0): Lightning's ddp launcher copies the env
        os.environ[PORT_ENV] = str(args.port if args.port is not None else _free_base_port())
    base_port = int(os.environ[PORT_ENV])

    if cuda:
        config = GPTConfig(n_layer=12, n_head=12, n_embd=768, block_size=1024)
        batch, corpus, precision, lr = 8, 4_000_000, "bf16-mixed", 6e-4
    else:
        torch.set_num_threads(1)
        config = GPTConfig(n_layer=2, n_head=4, n_embd=64, block_size=64)
        batch, corpus, precision, lr = 4, 200_000, "bf16-mixed", 3e-3
    data = Windows(stdlib_corpus(corpus), config.block_size, args.steps * batch * args.devices)
    watch = FlashWatchCallback(interval=args.interval, port=base_port, console=None, jsonl=False,
                               per_rank_endpoints=args.per_rank_endpoints, max_logit_bound=BOUND,
                               auto_fix="fp32_delta", auto_fix_on={"delta_drift", "repeated_max_rise", "max_logit"})
    report = Report(watch, cuda, args.inject_step)
    trainer = Trainer(accelerator="gpu" if cuda else "cpu", devices=args.devices, strategy="ddp",
                      precision=precision, max_steps=args.steps, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                      callbacks=[Inject(watch, args.inject_step), watch, report])
    trainer.fit(LitGPT(config, lr), DataLoader(data, batch_size=batch, num_workers=0))
    if trainer.global_rank != 0:
        return 0
    views = report.result
    header = (f"flashwatch DDP demo: {len(views)} ranks ({args.device}, {views[0]['backend']}), "
              f"GPT {config.n_layer} layers x {config.n_head} heads, d={config.n_embd}, T={config.block_size}, "
              f"batch {batch}/rank, {precision}, {args.steps} steps, interval {args.interval}, "
              f"rank 1 alone sees max logit 1e4 at step {args.inject_step} (bound {BOUND:g})")
    if cuda:
        header += "\n" + ", ".join(f"cuda:{i} {torch.cuda.get_device_name(i)}" for i in range(args.devices)) + \
                  f"; torch {torch.__version__}"
    lines, failed, timing = summarize(views, args, time.perf_counter() - _T0)
    print("\n" + header + "\n" + "\n".join(lines), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"header": header, "lines": lines, "failed": failed, "timing": timing,
                                               "args": vars(args), "views": [{k: v for k, v in view.items()
                                                                              if k not in ("snapshot", "state")}
                                                                             for view in views]}, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
