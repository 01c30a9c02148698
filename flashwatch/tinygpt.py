"""A small nanoGPT-style byte-level GPT, its corpus and a batch sampler, for demos and tests.

The model is nanoGPT's layout (byte vocabulary, no biases by default, LayerNorm, fused
``c_attn``, attention through ``torch.nn.functional.scaled_dot_product_attention(q, k, v,
is_causal=True)``), at whatever size you ask, or with separate q, k, v projections
(``GPTConfig(split_qkv=True)``, for tensor parallelism); the corpus is the Python standard library's own
source text, so it is on every machine and needs no download.

Example::

    data = stdlib_corpus(2_000_000)                      # uint8 (N,)
    model = GPT(GPTConfig(n_layer=2, n_head=4, n_embd=64, block_size=32))
    x, y = sample_batch(data, batch_size=8, block_size=32, generator=torch.Generator().manual_seed(0))
    logits, loss = model(x, y)
"""

from __future__ import annotations

import math
import os
import sysconfig
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GPTConfig", "GPT", "CausalSelfAttention", "SplitQKVAttention", "stdlib_corpus", "sample_batch"]


@dataclass
class GPTConfig:
    block_size: int = 256  # context length T
    vocab_size: int = 256  # bytes
    n_layer: int = 6
    n_head: int = 6
    n_embd: int = 384
    dropout: float = 0.0
    bias: bool = False  # biases in Linear and LayerNorm
    split_qkv: bool = False  # separate q, k, v, o projections (SplitQKVAttention): tensor-parallel ready


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with a fused q, k, v projection (nanoGPT's layout)."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        if config.n_embd % config.n_head:
            raise ValueError(f"n_embd={config.n_embd} must be a multiple of n_head={config.n_head}")
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)  # rows: q | k | v
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.dropout = config.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        # looked up on the module at call time, so flashwatch's router reaches it
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0,
                                           is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class SplitQKVAttention(nn.Module):
    """Multi-head causal self-attention with separate q, k, v and output projections (the Llama
    layout, without rotary embeddings). Heads are read from the projections' width
    (``view(B, T, -1, head_dim)``), so the module runs unchanged on a tensor-parallel rank that holds
    some of the heads (``ColwiseParallel`` on q, k, v; ``RowwiseParallel`` on o)."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        if config.n_embd % config.n_head:
            raise ValueError(f"n_embd={config.n_embd} must be a multiple of n_head={config.n_head}")
        c = config.n_embd
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(c, c, bias=config.bias) for _ in range(3))
        self.o_proj = nn.Linear(c, c, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.num_heads, self.head_dim = config.n_head, c // config.n_head
        self.dropout = config.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = (p(x).view(B, T, -1, self.head_dim).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        return self.resid_dropout(self.o_proj(y.transpose(1, 2).reshape(B, T, -1)))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = SplitQKVAttention(config) if config.split_qkv else CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Byte-level GPT: ``model(idx, targets=None) -> (logits, loss)``; idx (B, T) int64."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying, as nanoGPT
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith(("c_proj.weight", "o_proj.weight")):  # scaled residual init (GPT-2)
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        B, T = idx.shape
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.config.block_size}")
        pos = torch.arange(T, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))  # (B, T, vocab)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.reshape(-1))
        return logits, loss


def stdlib_corpus(max_bytes: int = 4_000_000) -> torch.Tensor:
    """The Python standard library's own ``.py`` source text as a uint8 tensor (max_bytes,) at most.

    Files are read in sorted path order (``site-packages`` and ``__pycache__`` left out), so
    the result is the same on every run of the same Python version.

    Raises:
        ValueError: max_bytes < 1.
        RuntimeError: no standard-library source found (an installation without .py files).
    """
    if not isinstance(max_bytes, int) or max_bytes < 1:
        raise ValueError(f"max_bytes must be a positive int, got {max_bytes!r}")
    root = sysconfig.get_paths()["stdlib"]
    chunks, size = [], 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__"))
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            try:
                with open(os.path.join(dirpath, name), "rb") as f:
                    data = f.read(max_bytes - size)
            except OSError:
                continue
            chunks.append(data)
            size += len(data)
            if size >= max_bytes:
                return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8).clone()
    if not chunks:
        raise RuntimeError(f"no Python source found under {root}")
    return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8).clone()


def sample_batch(data: torch.Tensor, batch_size: int, block_size: int, *, generator: torch.Generator | None = None,
                 device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows of ``data``: inputs x and next-byte targets y, both (batch_size, block_size) int64.

    Pass a seeded ``generator`` (e.g. ``torch.Generator().manual_seed(seed + step)``) for a
    batch that depends only on the step, which makes resumed runs reproduce exactly.
    """
    if data.dim() != 1 or data.numel() <= block_size + 1:
        raise ValueError(f"data must be 1-D and longer than block_size+1={block_size + 1}, got shape "
                         f"{tuple(data.shape)}")
    ix = torch.randint(data.numel() - block_size - 1, (batch_size,), generator=generator)
    offsets = torch.arange(block_size + 1)
    windows = data[ix.unsqueeze(1) + offsets].to(torch.int64)  # (B, T+1)
    return windows[:, :-1].to(device), windows[:, 1:].to(device)
