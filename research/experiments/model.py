"""The GPT of the experiments: the byte-level model whose BF16 training fails (docs/EXPERIMENTS.md).

Layout: token and learned position embeddings, pre-LN
blocks (LayerNorm with its default affine bias, Linear layers without bias), GELU MLP of 4x,
a final LayerNorm and an untied output head over 256 bytes; PyTorch's default initialisation
(Embedding N(0, 1), Linear uniform +-1/sqrt(fan_in)), unlike ``flashwatch.tinygpt`` (GPT-2's
0.02 init and tied weights), because the real BF16 failure was first seen with this model.

Attention lives in its own module (``c_attn`` of 3C outputs and an int ``n_head``: the
nanoGPT family that ``Monitor.attach`` finds) and calls
``torch.nn.functional.scaled_dot_product_attention`` through the module attribute at call
time, so the Monitor's router (and an SDPA shim installed before it) reach every call.

``attn_dtype``: when set (e.g. ``torch.bfloat16``), q, k, v are cast to it for the attention
call and the output back to the model's dtype: BF16 attention inside an FP32 model. The CPU
injection scenario uses it (CPU autocast would put every matmul in BF16, slow on most CPUs);
CUDA runs use BF16 autocast instead, and leave it None.

Example::

    model = ExperimentGPT(n_layer=2, n_head=4, n_embd=64, block_size=64)
    loss = model(x, y)          # x, y (B, T) int64
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["ExperimentGPT", "Attention"]


class Attention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, attn_dtype: torch.dtype | None = None):
        super().__init__()
        if n_embd % n_head:
            raise ValueError(f"n_embd={n_embd} must be a multiple of n_head={n_head}")
        self.c_attn = nn.Linear(n_embd, 3 * n_embd, bias=False)  # rows: q | k | v
        self.c_proj = nn.Linear(n_embd, n_embd, bias=False)
        self.n_head = n_head
        self.attn_dtype = attn_dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
        dtype = q.dtype
        if self.attn_dtype is not None:
            q, k, v = q.to(self.attn_dtype), k.to(self.attn_dtype), v.to(self.attn_dtype)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # looked up at call time: routable
        y = y.to(dtype).transpose(1, 2).reshape(B, T, C)
        return self.c_proj(y)


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, attn_dtype: torch.dtype | None):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = Attention(n_embd, n_head, attn_dtype)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.fc = nn.Linear(n_embd, 4 * n_embd, bias=False)
        self.proj = nn.Linear(4 * n_embd, n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.proj(F.gelu(self.fc(self.ln_2(x))))


class ExperimentGPT(nn.Module):
    """Byte-level GPT: ``model(idx, targets) -> loss`` (FP32 cross entropy); idx (B, T) int64."""

    def __init__(self, n_layer: int = 6, n_head: int = 6, n_embd: int = 384, block_size: int = 512,
                 attn_dtype: torch.dtype | None = None):
        super().__init__()
        self.block_size = block_size
        self.wte = nn.Embedding(256, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, attn_dtype) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, 256, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]
        if T > self.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.block_size}")
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.float().reshape(-1, 256), targets.reshape(-1))
