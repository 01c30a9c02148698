"""Model families: how an attention module of a known architecture holds its query projection.

The one place that knows architectures. Each family answers two questions about a module:

- ``shape(module)``: (heads H, head dim D, model dim C) of its query projection W^Q, read from
  the module's structure alone (attribute types and sizes, never a weight's values or shape:
  a sharded weight has the wrong shape, or none, between steps); None if the module is not of
  this family;
- ``query_weight(module, H, D, C)``: W^Q as an (H, D, C) tensor, a view of the parameter where
  the layout allows (head h owns D rows of the query projection);
- ``query_param(module)``: ``(parameter, transposed)``: W^Q's H*D rows are the first H*D rows of
  the parameter (``transposed`` False) or of its transpose (True); a sharded model's W^Q is
  read from the parameter's local shard through this (``flashwatch.sharded``).

Families:

- ``nanogpt``: an ``nn.Linear`` ``c_attn`` of out_features 3*C and the head count as an int
  ``n_head`` (nanoGPT) or ``h``; W^Q = c_attn.weight[:C].view(H, D, C). A module of this
  layout that names no head count is recognised by ``flashwatch.attach.find_attention`` from
  its attention call (``nanogpt_width``).
- ``hf_gpt2``: Hugging Face GPT-2 (``GPT2Attention``): ``c_attn`` is a ``Conv1D`` whose weight
  is (C, 3C) (x @ weight + bias), so W^Q = weight[:, :C].T.
- ``hf_llama``: Llama-style (``q_proj`` Linear of (H*D, C) beside ``k_proj``/``o_proj``; Llama,
  Mistral, Qwen2, ...): W^Q = q_proj.weight.view(H, D, C); H from the module or its config;
  grouped-query attention is fine (only the query side is needed). Its queries are rotated
  (RoPE) before attention, so ``rotary`` is True.

``rotary`` says whether the query the attention sees is the projection's output turned by a
position-dependent rotation; quantities that map the query gradient back onto W^Q through
the projection's input (the W^Q-gradient error) turn it back first, with the rotation the call
names (``flashwatch.chain.unrotate``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

__all__ = ["Family", "FAMILIES", "match", "nanogpt_width"]

Shape = tuple[int, int, int]  # (heads H, head dim D, model dim C)


def _int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _nanogpt_shape(module: nn.Module) -> Shape | None:
    c_attn = getattr(module, "c_attn", None)
    heads = getattr(module, "n_head", None)
    if heads is None:
        heads = getattr(module, "h", None)
    if not isinstance(c_attn, nn.Linear) or not _int(heads):
        return None
    c = c_attn.in_features
    if c_attn.out_features != 3 * c or heads < 1 or c % heads:
        return None
    return heads, c // heads, c


def nanogpt_width(module: nn.Module) -> int | None:
    """C for a module of nanoGPT's layout (a ``c_attn`` Linear of C inputs and 3*C outputs) that
    does not name its head count; None otherwise. The head count then comes from a call."""
    c_attn = getattr(module, "c_attn", None)
    if not isinstance(c_attn, nn.Linear) or c_attn.out_features != 3 * c_attn.in_features:
        return None
    if _nanogpt_shape(module) is not None:
        return None
    return c_attn.in_features


def _nanogpt_weight(module: nn.Module, h: int, d: int, c: int) -> torch.Tensor:
    # q = x @ c_attn.weight[:C].T, then .view(B, T, H, D): head h owns rows h*D:(h+1)*D
    return module.c_attn.weight[:c].view(h, d, c)


def _hf_gpt2_shape(module: nn.Module) -> Shape | None:
    c_attn = getattr(module, "c_attn", None)
    if c_attn is None or type(c_attn).__name__ != "Conv1D" or getattr(module, "is_cross_attention", False):
        return None
    nf, nx, heads = getattr(c_attn, "nf", None), getattr(c_attn, "nx", None), getattr(module, "num_heads", None)
    if not (_int(nf) and _int(nx) and _int(heads)) or nf != 3 * nx or heads < 1 or nx % heads:
        return None
    return heads, nx // heads, nx


def _hf_gpt2_weight(module: nn.Module, h: int, d: int, c: int) -> torch.Tensor:
    # Conv1D computes x @ weight + bias with weight (C, 3C): query columns [:C], transposed to (C_out, C_in)
    return module.c_attn.weight[:, :c].t().reshape(h, d, c)


def _hf_llama_shape(module: nn.Module) -> Shape | None:
    q_proj = getattr(module, "q_proj", None)
    if not isinstance(q_proj, nn.Linear) or not hasattr(module, "k_proj") or not hasattr(module, "o_proj"):
        return None
    config = getattr(module, "config", None)
    heads = getattr(module, "num_heads", None) or getattr(config, "num_attention_heads", None)
    head_dim = getattr(module, "head_dim", None)
    if not heads and _int(head_dim) and head_dim > 0:
        heads = q_proj.out_features // head_dim
    if not _int(heads) or heads < 1 or q_proj.out_features % heads:
        return None
    return heads, q_proj.out_features // heads, q_proj.in_features


def _hf_llama_weight(module: nn.Module, h: int, d: int, c: int) -> torch.Tensor:
    return module.q_proj.weight.view(h, d, c)


@dataclass(frozen=True)
class Family:
    """One architecture's attention layout (see the module docstring)."""

    name: str
    shape: Callable[[nn.Module], Shape | None]
    query_weight: Callable[[nn.Module, int, int, int], torch.Tensor]
    rotary: bool
    query_param: Callable[[nn.Module], tuple[torch.Tensor, bool]]


FAMILIES: tuple[Family, ...] = (
    Family("nanogpt", _nanogpt_shape, _nanogpt_weight, rotary=False,
           query_param=lambda m: (m.c_attn.weight, False)),
    Family("hf_gpt2", _hf_gpt2_shape, _hf_gpt2_weight, rotary=False,
           query_param=lambda m: (m.c_attn.weight, True)),  # Conv1D weight (C, 3C): W^Q rows are its columns
    Family("hf_llama", _hf_llama_shape, _hf_llama_weight, rotary=True,
           query_param=lambda m: (m.q_proj.weight, False)),
)


# names under which attention modules keep a normalisation of the query after its projection
# (QK-norm: Hugging Face's Qwen3, Gemma 3, OLMo 2, Cohere; nanoGPT variants)
QUERY_NORM_NAMES = ("q_norm", "q_layernorm", "query_norm", "q_ln", "qk_norm")


def query_norm(module: nn.Module) -> str | None:
    """The name of a module that normalises the query between its projection and the attention
    (QK-norm), or None. With one, the query the attention sees is not W^Q x (or its rotation), so
    the W^Q-gradient error, which maps the query's gradient straight onto W^Q, is not defined.
    Known at attach from the module alone, so it holds for sharded weights too, where the run-time
    comparison of the query with W^Q x (``Router._query_is_projection``) does not run."""
    return next((n for n in QUERY_NORM_NAMES if isinstance(getattr(module, n, None), nn.Module)), None)


def match(module: nn.Module) -> tuple[Family, Shape] | None:
    """The first family that recognises ``module``, with its (H, D, C); None if none does."""
    for family in FAMILIES:
        shape = family.shape(module)
        if shape is not None:
            return family, shape
    return None


def describe() -> str:
    """One line per family, for error messages."""
    return ("nanoGPT-style modules (a c_attn Linear of 3*C outputs and the head count as n_head or h), "
            "Hugging Face GPT-2 (c_attn Conv1D) and Llama-style (q_proj/k_proj/o_proj) attention")
