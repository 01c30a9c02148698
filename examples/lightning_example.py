"""flashwatch in a PyTorch Lightning run: one callback (runs in seconds on a CPU).

A small byte-level GPT learns the Python standard library's source text. ``FlashWatchCallback``
watches its attention: Prometheus metrics on http://127.0.0.1:PORT/metrics while it trains,
one JSON line per monitored step and an alert log in the run folder, a summary on the console,
scalar summaries in the trainer's logger (CSV here), and its state in the checkpoint.

    python examples/lightning_example.py                          # FP32, 2 epochs, port 9400
    python examples/lightning_example.py --precision bf16-mixed --port 0 --accumulate 2
    python examples/lightning_example.py --auto-fix fp32_delta --mode own_kernel

The lines that matter::

    from flashwatch.lightning import FlashWatchCallback

    watch = FlashWatchCallback(interval=5, port=9400, run_dir="runs/lightning/flashwatch")
    trainer = Trainer(callbacks=[watch], precision="bf16-mixed")
    trainer.fit(model, loader)
    print(watch.monitor.alerts)
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

import torch
from pytorch_lightning import LightningModule, Trainer
from pytorch_lightning.loggers import CSVLogger
from torch.utils.data import DataLoader, TensorDataset

from flashwatch.exporters import PortInUseError
from flashwatch.exporters.jsonl import read_jsonl
from flashwatch.lightning import FlashWatchCallback
from flashwatch.tinygpt import GPT, GPTConfig, sample_batch, stdlib_corpus


class LitGPT(LightningModule):
    """nanoGPT-style byte-level GPT; attention through torch's SDPA, which flashwatch watches."""

    def __init__(self, layers: int, heads: int, embd: int, block: int, lr: float):
        super().__init__()
        self.model = GPT(GPTConfig(n_layer=layers, n_head=heads, n_embd=embd, block_size=block))
        self.lr = lr

    def training_step(self, batch, batch_idx):
        x, y = batch
        _, loss = self.model(x, y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.1)


def make_loader(batches: int, batch_size: int, block: int, seed: int) -> DataLoader:
    """``batches`` fixed random windows of the standard library's source (the same every epoch)."""
    data = stdlib_corpus(1_000_000)
    g = torch.Generator().manual_seed(seed)
    xs, ys = zip(*(sample_batch(data, batch_size, block, generator=g) for _ in range(batches)))
    return DataLoader(TensorDataset(torch.cat(xs), torch.cat(ys)), batch_size=batch_size)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--precision", default="32", help='Lightning precision: "32" or "bf16-mixed"')
    p.add_argument("--epochs", type=int, default=2, help="training epochs")
    p.add_argument("--batches", type=int, default=30, help="batches per epoch")
    p.add_argument("--accumulate", type=int, default=1, help="accumulate_grad_batches")
    p.add_argument("--interval", type=int, default=5, help="monitor every N optimizer steps")
    p.add_argument("--mode", choices=("observe", "own_kernel"), default="observe", help="MonitorConfig.mode")
    p.add_argument("--auto-fix", choices=("fixed", "fp32_delta"), default=None, help="MonitorConfig.auto_fix")
    p.add_argument("--port", type=int, default=9400, help="Prometheus port (0: any free port)")
    p.add_argument("--out", default=None,
                   help="run folder (logs, JSONL, checkpoint); default runs/lightning-<timestamp>, a new one each run "
                        "(the callback refuses to start a new run in a folder that already holds one)")
    p.add_argument("--seed", type=int, default=0, help="seed of the model and the batches")
    args = p.parse_args(argv)

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    torch.manual_seed(args.seed)
    # head dim 16: the smallest flashwatch's statistics kernel measures
    module = LitGPT(layers=2, heads=4, embd=64, block=64, lr=3e-3)
    loader = make_loader(args.batches, batch_size=8, block=64, seed=args.seed)

    out = Path(args.out or f"runs/lightning-{time.strftime('%Y%m%d-%H%M%S')}")
    watch = FlashWatchCallback(interval=args.interval, mode=args.mode, auto_fix=args.auto_fix,
                               port=args.port, run_dir=out / "flashwatch")
    trainer = Trainer(accelerator="cpu", devices=1, max_epochs=args.epochs, precision=args.precision,
                      accumulate_grad_batches=args.accumulate, gradient_clip_val=1.0, log_every_n_steps=5,
                      logger=CSVLogger(out, name="logs"), default_root_dir=out, callbacks=[watch],
                      enable_model_summary=False)
    start = time.time()
    try:
        trainer.fit(module, loader)
    except PortInUseError as exc:  # raised at fit start, before any step
        print(f"error: {exc}", file=sys.stderr)
        return 2

    snap = watch.monitor.snapshot()
    records = list(read_jsonl(out / "flashwatch"))
    print(f"\n{trainer.global_step} optimizer steps in {time.time() - start:.1f} s, "
          f"{len(records)} monitored steps written to {out / 'flashwatch' / 'metrics.jsonl'}")
    print(f"last monitored step {snap['flashwatch_step']:.0f}: loss {snap['flashwatch_loss']:.3f}, "
          f"max |drift z| {max(abs(v) for v in snap['flashwatch_delta_drift_z'].values()):.2f}")
    print(f"alerts: {len(watch.monitor.alerts)}" + "".join(f"\n  {a.message}" for a in watch.monitor.alerts[:5]))
    print(f"trainer-logger summaries (flashwatch/*): {trainer.logger.log_dir}/metrics.csv")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
