"""The demo's model and data: a small byte-level GPT (``flashwatch.tinygpt``) as a LightningModule,
and random windows of the Python standard library's source as its batches."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, IterableDataset

from ..tinygpt import GPT, GPTConfig, sample_batch, stdlib_corpus

__all__ = ["DemoModel", "DemoGPT", "Windows", "build"]


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


class Windows(IterableDataset):
    """``steps`` batches of random windows of the standard library's source; the same for a seed.

    Each batch is ``(x, y)``, int64 ``(batch_size, block_size)``, ``y`` being ``x`` shifted by one byte.
    """

    def __init__(self, cfg: DemoModel, steps: int, seed: int) -> None:
        self.cfg, self.steps, self.seed = cfg, steps, seed
        self.data = stdlib_corpus(cfg.corpus_bytes)

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Iterator:
        g = torch.Generator().manual_seed(self.seed)
        for _ in range(self.steps):
            yield sample_batch(self.data, self.cfg.batch_size, self.cfg.block_size, generator=g)


class DemoGPT(pl.LightningModule):
    """The GPT of ``cfg`` trained with AdamW on next-byte cross-entropy."""

    def __init__(self, cfg: DemoModel) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = GPT(GPTConfig(n_layer=cfg.n_layer, n_head=cfg.n_head, n_embd=cfg.n_embd,
                                   block_size=cfg.block_size))

    def training_step(self, batch, batch_idx):
        x, y = batch
        _, loss = self.model(x, y)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.cfg.lr, weight_decay=self.cfg.weight_decay)


def build(cfg: DemoModel, steps: int, seed: int) -> tuple[DemoGPT, DataLoader]:
    """The LightningModule (initialised from ``seed``) and a DataLoader of ``steps`` batches."""
    torch.manual_seed(seed)
    return DemoGPT(cfg), DataLoader(Windows(cfg, steps, seed), batch_size=None)
