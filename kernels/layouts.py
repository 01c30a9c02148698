"""The memory order of the tensors the attention kernels write: O and dQ, dK, dV.

The kernels take any strides with the last one 1; these are the orders they are given, those of
torch SDPA's flash and cuDNN paths, so that a model's reshapes around its attention copy nothing.
Triton is not imported here: the compiled graphs allocate the gradients on every device.
"""

from __future__ import annotations

import torch

from . import tuning


def heads_inner_like(t: torch.Tensor) -> torch.Tensor:
    """An empty tensor of t's (B, heads, N, D) shape and dtype with its memory in (B, N, heads, D)
    order, as torch SDPA's flash and cuDNN paths give their output and gradients: the order of the
    projections the model made q, k, v from, so a model's ``o.transpose(1, 2)`` followed by
    ``.contiguous()`` or ``.view(B, N, heads * D)`` copies nothing, nor does the backward of its
    ``.view(B, N, heads, D).transpose(1, 2)`` of a projection (the kernels take these strides)."""
    B, H, N, D = t.shape
    if torch.compiler.is_compiling():
        # traced into a graph: aten.empty, which the compiler's common-subexpression pass leaves apart; it
        # merges equal empty_strided calls, so every layer's gradients of one shape would be one tensor,
        # which Inductor copies before each operator writes into it
        return torch.empty((B, N, H, D), dtype=t.dtype, device=t.device).transpose(1, 2)
    # torch.empty((B, N, H, D)).transpose(1, 2) in one call
    return torch.empty_strided((B, H, N, D), (N * H * D, D, H * D, 1), dtype=t.dtype, device=t.device)


def grads_like(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward's dQ, dK, dV for q, k, v (B, heads, N, D), in (B, N, heads, D) memory order
    (``heads_inner_like``); dK and dV contiguous where the opt-in Hopper dK/dV kernel runs (it
    stores whole rows through TMA descriptors)."""
    if tuning.hopper_features("dkdv") is not None:
        return heads_inner_like(q), torch.empty(k.shape, dtype=k.dtype, device=k.device), \
            torch.empty(v.shape, dtype=v.dtype, device=v.device)
    return heads_inner_like(q), heads_inner_like(k), heads_inner_like(v)
