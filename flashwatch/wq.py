"""W^Q spectral norms of every attached head: batched power iteration on the weights' device.

Layers whose W^Q have one shape and device are stacked into one batched iteration, so a
monitored step's kernel launches do not grow with the depth of the model; a stacked FP32 copy
is capped at ``GROUP_BYTES`` (large models get several groups). Each step returns one (H,)
device tensor per layer that joins the monitored step's single host transfer. The top
singular pair (u, v) of every head is also kept for the W^Q-error chain (``flashwatch.chain``).
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from .attach import AttentionLayer
from .chain import top_pair
from .signals import PowerIteration

__all__ = ["WqNorms", "GROUP_BYTES"]

GROUP_BYTES = 256 * 2**20  # cap on one stacked FP32 copy of query weights


class _Group:
    """Layers whose W^Q share one (D, C) and device: one batched power iteration."""

    def __init__(self, layers: list[AttentionLayer], block: int):
        self.layers = layers
        self.power = PowerIteration(self.weight(), block=block, seed="svd")

    def weight(self) -> torch.Tensor:
        ws = [layer.query_weight() for layer in self.layers]
        return ws[0] if len(ws) == 1 else torch.cat(ws)  # (sum H, D, C)

    def split(self, t: torch.Tensor) -> list[torch.Tensor]:
        return list(t.split([layer.num_heads for layer in self.layers]))

    def state_of(self, i: int) -> dict:
        """Layer ``self.layers[i]``'s slice of the vectors, as plain CPU tensors."""
        state = self.power.state_dict()
        return {"v": self.split(state["v"])[i].clone(), "sigma": self.split(state["sigma"])[i].clone()}

    def load(self, states: list[dict]) -> None:
        self.power.load_state_dict({"v": torch.cat([s["v"] for s in states]),
                                    "sigma": torch.cat([s["sigma"] for s in states])})


class WqNorms:
    """The W^Q spectral norm of every head of ``layers`` (all of them, or none when ``skip``).

    Args:
        layers: the attached layers.
        block: vectors per head (``MonitorConfig.power_block``).
        skip: why W^Q is not read (a sharded model), or None.
    """

    def __init__(self, layers: list[AttentionLayer], block: int, skip: str | None = None):
        self.layers = layers
        self.skip = skip
        self.groups: list[_Group] = [] if skip is not None else _groups(layers, block)

    def step(self, exact: bool, iters: int, on_error: Callable[[str, BaseException], None]) -> list[torch.Tensor]:
        """This step's norms, one (H,) device tensor per layer in layer order (NaN on failure or skip)."""
        if self.skip is not None:
            return [torch.full((layer.num_heads,), math.nan, dtype=torch.float64, device=layer.stats.device)
                    for layer in self.layers]
        out: dict[int, torch.Tensor] = {}
        for group in self.groups:
            try:
                weight = group.weight()
                sigma = group.power.exact(weight) if exact else group.power.step(weight, iters)
            except Exception as exc:
                on_error("wq_spectral_norm", exc)
                sigma = torch.full((sum(layer.num_heads for layer in group.layers),), float("nan"))
            for layer, s in zip(group.layers, group.split(sigma)):
                out[layer.index] = s
        return [out[layer.index] for layer in self.layers]

    @torch.no_grad()
    def pairs(self) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """Layer index -> (u (H, D), v (H, C)): each head's top singular pair from the current vectors."""
        out = {}
        for group in self.groups:
            u, v = top_pair(group.weight(), group.power.v)
            for layer, ul, vl in zip(group.layers, group.split(u), group.split(v)):
                out[layer.index] = (ul, vl)
        return out

    def exact_now(self) -> dict[tuple[int, int], float]:
        """Exact norms per (layer, head), restarting the vectors (a host sync: on request only)."""
        out = {}
        for group in self.groups:
            sigma = group.power.exact(group.weight())
            for layer, s in zip(group.layers, group.split(sigma)):
                out.update({(layer.index, h): v for h, v in enumerate(s.tolist())})
        return dict(sorted(out.items()))

    def current(self) -> dict[tuple[int, int], float]:
        """The estimates as of the last step, per (layer, head) (a host sync)."""
        out = {}
        for group in self.groups:
            for layer, s in zip(group.layers, group.split(group.power.sigma)):
                out.update({(layer.index, h): v for h, v in enumerate(s.tolist())})
        return dict(sorted(out.items()))

    def state_of(self, layer: AttentionLayer) -> dict | None:
        for group in self.groups:
            if layer in group.layers:
                return group.state_of(group.layers.index(layer))
        if self.skip is not None:
            return None  # W^Q skipped: no power iteration
        raise KeyError(layer.index)

    def load(self, powers: list[dict | None]) -> None:
        """Per-layer saved vectors in layer order (None where a sharded run saved none)."""
        for group in self.groups:
            mine = [powers[layer.index] for layer in group.layers]
            if all(p is not None for p in mine):
                group.load(mine)


def _groups(layers: list[AttentionLayer], block: int) -> list[_Group]:
    groups: list[list] = []  # [(head shape, device), members, FP32 bytes]
    for layer in layers:
        w = layer.query_weight()
        key, size = (tuple(w.shape[1:]), w.device), w.numel() * 4
        group = next((g for g in reversed(groups) if g[0] == key), None)
        if group is None or group[2] + size > GROUP_BYTES:
            groups.append([key, [layer], size])
        else:
            group[1].append(layer)
            group[2] += size
    return [_Group(members, block) for _, members, _ in groups]
