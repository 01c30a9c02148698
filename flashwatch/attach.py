"""Find a model's attention layers and their query weights.

``find_attention(model, attention=None)``: every attention module in module order, with its
number of query heads and a function returning its query weight per head, W^Q as an
(H, D, C) tensor (head h's D rows of the query projection, d_model C columns). The families
found automatically (nanoGPT-style, Hugging Face GPT-2, Llama-style) are described in
``flashwatch.families``. Anything else: ``attention={module_name: query_weight_fn}`` with
``query_weight_fn(module) -> Tensor (H, D, C)``.

``select_layers`` keeps what ``MonitorConfig.layers`` selects. Routing the attention calls of
the found layers is ``flashwatch.routing``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn

from .families import Family, describe, match

QueryWeightFn = Callable[[nn.Module], torch.Tensor]  # module -> (H, D, C)

__all__ = ["AttentionLayer", "find_attention", "known_attention", "select_layers", "QueryWeightFn"]


@dataclass(eq=False)  # identity: a layer is one module
class AttentionLayer:
    """One attached attention layer.

    Attributes:
        index: the ``layer`` label (position in ``Monitor.layers``).
        name: the module's name in ``model.named_modules()``.
        module: the attention module.
        num_heads: query heads H.
        family: ``"nanogpt"``, ``"hf_gpt2"``, ``"hf_llama"`` or ``"explicit"``.
        mode: ``"own_kernel"`` or ``"observe"`` (auto_fix can move an observed layer to own_kernel).
        variant: the kernel variant in own_kernel mode; ``"sdpa"`` while observed.
        stats: the layer's ``AttentionStats`` (device tensors; reset after every monitored step).
        calls: attention calls measured during the current monitored step.
        coverage: CPU int64 tensor [attention calls, measured calls] of the current monitored
            step (counted by the router, also inside compiled graphs; reset by the Monitor).
        low_precision: whether the last measured call's output was BF16/FP16 (None before any).
        chain: the layer's W^Q-error accumulators (``flashwatch.chain.LayerChain``), None where
            that chain is not defined (rotary queries, explicitly named modules, sharded weights).
        chain_input: the module's input at the current monitored call (the projection input X).
    """

    index: int
    name: str
    module: nn.Module
    num_heads: int
    query_weight_fn: QueryWeightFn = field(repr=False)
    family: str
    mode: str = "observe"
    variant: str = "sdpa"
    stats: Any = field(default=None, repr=False)
    calls: int = 0
    coverage: torch.Tensor = field(default_factory=lambda: torch.zeros(2, dtype=torch.int64), repr=False)
    low_precision: bool | None = None
    chain: Any = field(default=None, repr=False)
    chain_input: Any = field(default=None, repr=False)

    def query_weight(self) -> torch.Tensor:
        """W^Q per head, (H, D, C), detached (a view of the parameter where the layout allows)."""
        w = self.query_weight_fn(self.module)
        return w.detach()

    def ensure_stats(self, device: torch.device):
        """The layer's stats on ``device`` (recreated if the model moved since attach)."""
        from flashwatch.kernels import AttentionStats

        if self.stats is None or self.stats.device != device:
            self.stats = AttentionStats(self.num_heads, device)
        return self.stats


# --- finding attention modules --------------------------------------------------------------

def _family_weight_fn(family: Family, shape: tuple[int, int, int]) -> QueryWeightFn:
    h, d, c = shape
    return lambda m: family.query_weight(m, h, d, c)


def _check_weight(name: str, w: Any, heads: int | None = None) -> int:
    if not isinstance(w, torch.Tensor) or w.dim() != 3:
        shape = tuple(w.shape) if isinstance(w, torch.Tensor) else type(w).__name__
        raise ValueError(f"query weight of {name!r} must be a tensor (heads, head_dim, model_dim), got {shape}")
    if heads is not None and w.shape[0] != heads:
        raise ValueError(f"query weight of {name!r} has {w.shape[0]} heads, expected {heads}")
    return w.shape[0]


def find_attention(model: nn.Module, attention: Mapping[str, QueryWeightFn] | None = None
                   ) -> list[tuple[str, nn.Module, int, QueryWeightFn, str]]:
    """Attention modules of ``model`` in module order: (name, module, heads, query_weight_fn, family).

    Args:
        model: any ``nn.Module``.
        attention: optional ``{module_name: query_weight_fn}``; when given, exactly these
            modules are used (``query_weight_fn(module) -> (H, D, C)``).

    Raises:
        ValueError: no attention found (with what to do), an unknown module name, or a query
            weight function that does not return an (H, D, C) tensor.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    modules = dict(model.named_modules())
    found = []
    if attention is not None:
        if not isinstance(attention, Mapping) or not attention:
            raise ValueError("attention must be a non-empty dict {module_name: query_weight_fn}, got "
                             f"{attention!r}")
        unknown = [n for n in attention if n not in modules]
        if unknown:
            raise ValueError(f"attention names {unknown} are not modules of the model; some module names: "
                             f"{[n for n in modules if n][:12]}")
        order = {n: i for i, n in enumerate(modules)}
        for name in sorted(attention, key=order.__getitem__):
            fn = attention[name]
            if not callable(fn):
                raise ValueError(f"attention[{name!r}] must be a function module -> (H, D, C) query weight, "
                                 f"got {type(fn).__name__}")
            heads = _check_weight(name, fn(modules[name]))
            found.append((name, modules[name], heads, fn, "explicit"))
        return found
    for name, module, family, shape in known_attention(model):
        fn = _family_weight_fn(family, shape)
        _check_weight(name, fn(module), shape[0])
        found.append((name, module, shape[0], fn, family.name))
    if not found:
        raise ValueError(_not_found_message(modules))
    return found


def known_attention(model: nn.Module) -> list[tuple[str, nn.Module, Family, tuple[int, int, int]]]:
    """Modules of a known family in module order, by structure alone (no weight is read):
    (name, module, family, (H, D, C)). Children of an attention module are skipped."""
    out = []
    skip_prefix: str | None = None
    for name, module in model.named_modules():
        if skip_prefix is not None and name.startswith(skip_prefix):
            continue  # children of an attention module are not attention modules themselves
        hit = match(module)
        if hit is not None:
            out.append((name, module, *hit))
            skip_prefix = name + "."
    return out


def _not_found_message(modules: dict) -> str:
    attention_like = [n for n, m in modules.items() if n and "attn" in type(m).__name__.lower() + n.split(".")[-1]]
    seen = ", ".join(attention_like[:6]) if attention_like else "none whose name or class mentions attention"
    example = attention_like[0] if attention_like else "blocks.0.attn"
    return (f"no attention layer found: flashwatch recognises {describe()}. Modules that look like attention: "
            f"{seen}. Name yours with attach(model, attention={{{example!r}: lambda m: "
            "m.<query projection>.weight.view(H, D, C), ...}}), one entry per attention module")


def select_layers(found: Sequence[tuple], layers: Any) -> list[tuple]:
    """Keep the entries of ``find_attention`` that ``MonitorConfig.layers`` selects.

    Args:
        found: ``find_attention``'s list.
        layers: None (all), a regex searched in the module names, or a list of module names and
            indices into ``found``.

    Raises:
        ValueError: nothing matched, or a listed name/index does not exist (the message lists
            what exists).
    """
    if layers is None:
        return list(found)
    names = [f[0] for f in found]
    if isinstance(layers, str):
        pattern = re.compile(layers)
        keep = [f for f in found if pattern.search(f[0])]
        if not keep:
            raise ValueError(f"MonitorConfig.layers={layers!r} matched none of the attention layers {names}")
        return keep
    chosen: set[int] = set()
    for item in layers:
        if isinstance(item, int):
            if item >= len(found):
                raise ValueError(f"MonitorConfig.layers: index {item} out of range; the model has {len(found)} "
                                 f"attention layers {names}")
            chosen.add(item)
        else:
            if item not in names:
                raise ValueError(f"MonitorConfig.layers: {item!r} is not an attention layer; found {names}")
            chosen.add(names.index(item))
    return [found[i] for i in sorted(chosen)]
