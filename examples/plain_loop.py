"""flashwatch in a plain PyTorch training loop (runs in seconds on a CPU).

A small byte-level GPT learns the Python standard library's source text; a ``Monitor`` watches
its attention: every ``--interval`` optimizer steps it measures repeated-max rows, the max
logit, the signed delta error and W^Q's spectral norm per head, and raises alerts.

    python examples/plain_loop.py                       # observe mode, FP32, 60 steps
    python examples/plain_loop.py --mode own_kernel --bf16 --auto-fix fp32_delta
    python examples/plain_loop.py --jsonl runs/plain    # also write one JSON line per monitored step
    python examples/plain_loop.py --compile             # torch.compile(model): measured the same way
    python examples/plain_loop.py --fp16                # FP16 with a loss scaler, passed to the Monitor

The four lines that matter::

    monitor = Monitor(MonitorConfig(interval=5))
    monitor.attach(model)                                   # before the first forward
    ...                                                     # forward, backward, clip, optimizer.step()
    alerts = monitor.step(loss=loss.detach(), grad_norm=grad_norm)   # once per optimizer step
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import time

import torch

from flashwatch import Monitor, MonitorConfig, TrainingStopped
from flashwatch.tinygpt import GPT, GPTConfig, sample_batch, stdlib_corpus


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--steps", type=int, default=60, help="optimizer steps")
    p.add_argument("--interval", type=int, default=5, help="monitor every N optimizer steps")
    p.add_argument("--mode", choices=("observe", "own_kernel"), default="observe", help="MonitorConfig.mode")
    p.add_argument("--auto-fix", choices=("fixed", "fp32_delta"), default=None, help="MonitorConfig.auto_fix")
    precision = p.add_mutually_exclusive_group()
    precision.add_argument("--bf16", action="store_true", help="train under BF16 autocast (else FP32, where ties are rarer)")
    precision.add_argument("--fp16", action="store_true",
                           help="train under FP16 autocast with a loss scaler (torch.amp.GradScaler), passed to the Monitor")
    p.add_argument("--compile", action="store_true", help="train torch.compile(model) (attach the Monitor first)")
    p.add_argument("--layers", type=int, default=2, help="transformer blocks")
    p.add_argument("--heads", type=int, default=4, help="attention heads per block")
    p.add_argument("--embd", type=int, default=64, help="model width")
    p.add_argument("--block", type=int, default=64, help="context length")
    p.add_argument("--batch", type=int, default=8, help="sequences per step")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate")
    p.add_argument("--seed", type=int, default=0, help="seed of the model and the batches")
    p.add_argument("--jsonl", default=None, help="folder for flashwatch's JSONL metrics")
    p.add_argument("--threads", type=int, default=1,
                   help="CPU threads (a model this small runs fastest on one, and stays fast on a busy machine)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    torch.manual_seed(args.seed)
    data = stdlib_corpus(2_000_000)
    model = GPT(GPTConfig(n_layer=args.layers, n_head=args.heads, n_embd=args.embd, block_size=args.block))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)

    exporters = []
    if args.jsonl:
        from flashwatch.exporters import JsonlExporter

        exporters.append(JsonlExporter(args.jsonl))
    # warm-up and window are counted in monitored steps; shortened here for a 60-step demo
    config = MonitorConfig(interval=args.interval, mode=args.mode, auto_fix=args.auto_fix, warmup=4, window=5)
    monitor = Monitor(config, exporters=exporters)
    monitor.attach(model)
    run = torch.compile(model) if args.compile else model  # after attach: compiled code is measured too

    dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else None
    autocast = (lambda: torch.autocast("cpu", dtype=dtype)) if dtype is not None else contextlib.nullcontext
    # FP16 gradients need a loss scale; the Monitor is told it, to read the delta error in true units
    scaler = torch.amp.GradScaler("cpu", enabled=args.fp16)
    start = time.perf_counter()
    try:
        for step in range(args.steps):
            x, y = sample_batch(data, args.batch, args.block, generator=torch.Generator().manual_seed(step))
            with autocast():
                _, loss = run(x, y)
            scaler.scale(loss).backward()  # without --fp16 the scaler is off: a plain backward
            scaler.unscale_(opt)
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # before clipping
            scaler.step(opt)  # without --fp16: opt.step()
            scaler.update()
            opt.zero_grad(set_to_none=True)
            # alerts are logged by the monitor; after scaler.update(), so it knows this step's loss scale
            monitor.step(loss=loss.detach(), grad_norm=grad_norm, grad_scaler=scaler)
            if step % 10 == 0:
                print(f"step {step:4d}  loss {loss.item():.3f}")
    except TrainingStopped as stop:
        print(f"stopped: {stop}")
    finally:
        monitor.close()
    elapsed = time.perf_counter() - start

    snap = monitor.snapshot()
    print(f"\n{args.steps} steps in {elapsed:.1f} s; monitored steps: {monitor.monitored_steps}; "
          f"alerts: {len(monitor.alerts)}; monitoring errors: {monitor.errors}")
    for layer in monitor.layers:
        def peak(metric: str, fmt: str, absolute: bool = False) -> str:
            """The layer's largest head value, or "not measured" (never a 0 standing in for no value)."""
            values = [snap[metric].get((layer.index, h), math.nan) for h in range(layer.num_heads)]
            finite = [abs(v) if absolute else v for v in values if math.isfinite(v)]
            return format(max(finite), fmt) if finite else "not measured"

        print(f"layer {layer.index} ({layer.name}, {layer.running_variant}): max |z| "
              f"{peak('flashwatch_delta_drift_z', '.2f', absolute=True)}, BF16 repeated-max "
              f"{peak('flashwatch_repeated_max_ratio_bf16', '.1%')}, max logit {peak('flashwatch_max_logit', '.2f')}, "
              f"W^Q norm {peak('flashwatch_wq_spectral_norm', '.3f')}")
    monitor.detach()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
