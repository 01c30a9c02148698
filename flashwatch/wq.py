"""W^Q spectral norms of every attached head: batched power iteration on the weights' device.

Layers whose W^Q have one shape and device are stacked into one batched iteration, so a
monitored step's kernel launches do not grow with the depth of the model; a stacked FP32 copy
is capped at ``GROUP_BYTES`` (large models get several groups). Each step returns one (H,)
device tensor per layer that joins the monitored step's single host transfer. The top
singular pair (u, v) of every head is also kept for the W^Q-error chain (``flashwatch.chain``).

Sharded models (``flashwatch.sharded``): an FSDP-sharded layer's W^Q is measured by power
iteration on the shards (collectives over the shard group, on every rank alike); a
tensor-parallel layer's local heads are measured as a whole weight; a layer whose layout is
not supported reads NaN.

W^Q is read from the live model: on every monitored step each layer's module is looked up
again by name; a module replaced since ``attach`` is reported as NaN, with one warning (its
attention calls are not routed either: ``detach()`` and ``attach()`` again to follow it). A
query weight replaced inside the module (a new parameter, or the model moved to another
device) is followed: that layer's group restarts from the exact singular vectors.
"""

from __future__ import annotations

import logging
import math
from typing import Callable

import torch
from torch import nn

from .attach import AttentionLayer, submodule
from .chain import top_pair
from .sharded_power import ShardedPowerIteration
from .signals import PowerIteration

log = logging.getLogger("flashwatch")

__all__ = ["WqNorms", "GROUP_BYTES"]

GROUP_BYTES = 256 * 2**20  # cap on one stacked FP32 copy of query weights


class _Group:
    """Layers whose W^Q share one (D, C) and device: one batched power iteration."""

    def __init__(self, layers: list[AttentionLayer], block: int):
        self.layers = layers
        self.power = PowerIteration(self.weight(), block=block, seed="svd")
        self.storage = self.storages()

    def storages(self) -> list[int]:
        """Where each layer's query weight lives now (a new parameter, or a move, changes it)."""
        return self.read()[1]

    def weight(self) -> torch.Tensor:
        return self.read()[0]

    def read(self) -> tuple[torch.Tensor, list[int]]:
        """The layers' query weights stacked, (sum H, D, C), and where each lives now (``storages``),
        each layer's weight looked up once."""
        ws = [layer.query_weight() for layer in self.layers]
        return (ws[0] if len(ws) == 1 else torch.cat(ws)), [w.untyped_storage().data_ptr() for w in ws]

    def split(self, t: torch.Tensor) -> list[torch.Tensor]:
        return list(t.split([layer.num_heads for layer in self.layers]))

    def state_of(self, i: int) -> dict:
        """Layer ``self.layers[i]``'s slice of the vectors, as plain CPU tensors."""
        state = self.power.state_dict()
        return {"v": self.split(state["v"])[i].clone(), "sigma": self.split(state["sigma"])[i].clone()}


class WqNorms:
    """The W^Q spectral norm of every head of ``layers`` (all of them, or none when ``skip``).

    Args:
        layers: the attached layers (``layer.placement`` says how a sharded rank holds W^Q).
        block: vectors per head (``MonitorConfig.power_block``).
        skip: why W^Q is not read at all, or None.
        model: the model the layers were found in: each step checks that ``layer.name`` still
            names ``layer.module`` there (None: no check).
        on_error: ``on_error(kind, exc)`` for failures while starting the sharded iteration.
    """

    def __init__(self, layers: list[AttentionLayer], block: int, skip: str | None = None,
                 model: nn.Module | None = None, on_error: Callable[[str, BaseException], None] | None = None):
        self.layers = layers
        self.skip = skip
        self.model = model
        self.replaced: set[int] = set()  # indices of layers whose module was replaced after attach
        self._fresh_pairs = None  # pairs made by the last step(pairs=True), until pairs() returns them
        kinds = {layer.index: layer.placement_kind for layer in layers}
        self.unsupported = {i for i, k in kinds.items() if k == "unsupported"} if skip is None else set(kinds)
        if skip is not None:
            self.groups: list[_Group] = []
            self.sharded = ShardedPowerIteration([], block, _raise)
            return
        self.groups = _groups([layer for layer in layers if kinds[layer.index] in ("whole", "tensor_parallel")], block)
        self.sharded = ShardedPowerIteration([layer for layer in layers if kinds[layer.index] == "fsdp"], block,
                                             on_error or _raise)
        self.sharded.start()

    def log_placements(self, sharding: str) -> None:
        """One line on how each kind of layer's W^Q is measured; a warning for layers it is not."""
        kinds: dict[str, list[str]] = {}
        for layer in self.layers:
            kinds.setdefault(layer.placement_kind, []).append(f"{layer.index}={layer.name}")
        how = {"whole": "the whole weight on this rank", "fsdp": "power iteration on the FSDP shards (all-reduces "
               "over the shard group on monitored steps, no weight gathered)",
               "tensor_parallel": "each rank its own heads (tensor parallelism)"}
        for kind, names in kinds.items():
            if kind in how:
                log.info("flashwatch (%s): W^Q spectral norms of layers %s: %s", sharding, ", ".join(names), how[kind])
        bad = [layer for layer in self.layers if layer.index in self.unsupported]
        if bad:
            log.warning("flashwatch: W^Q spectral norms are skipped for layers %s: %s; flashwatch_wq_spectral_norm "
                        "is NaN there and the wq_growth and wq_outlier rules are off for them. Attention statistics, "
                        "loss and gradient norm are monitored as usual.",
                        ", ".join(f"{l.index}={l.name}" for l in bad),
                        bad[0].placement.reason if bad[0].placement is not None else sharding)
        if bad:
            log.info("flashwatch: the W^Q-error metrics (flashwatch_wq_error_*) are NaN for layouts whose W^Q "
                     "cannot be read")

    @property
    def unmeasured(self) -> set[int]:
        """Indices of the layers whose W^Q is not measured (NaN): unsupported layouts, replaced modules."""
        return self.unsupported | self.replaced

    def _check_live(self) -> None:
        if self.model is None:
            return
        for layer in self.layers:
            if layer.index in self.replaced:
                continue
            try:  # through wrappers: compiled in place after attach, it is the same module
                live = submodule(self.model, layer.name)
            except AttributeError:
                live = None
            if live is not layer.module:
                self.replaced.add(layer.index)
                log.warning("flashwatch: layer %d (%s) is no longer the module attached (it was replaced or removed "
                            "after attach): its W^Q spectral norms read NaN and its attention calls are not measured; "
                            "call monitor.detach() and monitor.attach(model) to follow the new module",
                            layer.index, layer.name)

    def step(self, exact: bool, iters: int, on_error: Callable[[str, BaseException], None],
             pairs: bool = False) -> list[torch.Tensor]:
        """This step's norms, one (H,) device tensor per layer in layer order (NaN on failure or skip).

        ``pairs``: also make the top singular pairs of the weights just read, which the next
        ``pairs()`` call returns (call it before the weights change: the W^Q-error chain's next
        pairs), without reading the weights again.

        Collectives for FSDP-sharded layers: every rank of their shard group calls this alike."""
        self._check_live()
        self._fresh_pairs = None
        out: dict[int, torch.Tensor] = {}
        weights = []
        for group in self.groups:
            try:
                weight = None
                weight, storage = group.read()
                renewed = storage != group.storage  # a new query weight (or a move): restart exactly
                group.storage = storage
                sigma = group.power.exact(weight) if exact or renewed else group.power.step(weight, iters, pair=pairs)
            except Exception as exc:
                on_error("wq_spectral_norm", exc)
                sigma = torch.full((sum(layer.num_heads for layer in group.layers),), float("nan"),
                                   device=group.power.v.device)  # made where it is used: no copy from the host
            weights.append(weight)
            for layer, s in zip(group.layers, group.split(sigma)):
                out[layer.index] = s
        if pairs:
            try:
                self._fresh_pairs = self._pairs(weights)
            except Exception:  # pairs() computes them again and its caller reports the failure
                self._fresh_pairs = None
        if self.sharded.members:
            out.update({layer.index: s for layer, s in
                        (self.sharded.exact() if exact else self.sharded.step(iters)).items()})
        return [self._nan(layer) if layer.index in self.unmeasured else out[layer.index] for layer in self.layers]

    @staticmethod
    def _nan(layer: AttentionLayer) -> torch.Tensor:
        device = layer.stats.device if layer.stats is not None else torch.device("cpu")
        return torch.full((layer.num_heads,), math.nan, dtype=torch.float64, device=device)

    @torch.no_grad()
    def pairs(self) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """Layer index -> (u (H, D), v (H, C)): each head's top singular pair from the current vectors
        (layers held whole on this rank, and FSDP-sharded layers from their power iteration's products)."""
        fresh, self._fresh_pairs = self._fresh_pairs, None
        out = fresh if fresh is not None else self._pairs([None] * len(self.groups))
        out.update({layer.index: pair for layer, pair in self.sharded.pairs().items()})
        return out

    def _pairs(self, weights: list) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """``pairs()`` from each group's weight as read (None: read now)."""
        out = {}
        for group, weight in zip(self.groups, weights):
            made = group.power.made_pair() if weight is not None else None
            if made is not None:  # made by the step's kernel, from the step's own weight
                u, v = made
            elif weight is None:
                u, v = top_pair(group.weight(), group.power.v)
            else:  # the step's own weight: its power step already knows the pair's direction
                u, v = top_pair(weight, group.power.v, group.power.top_in_block())
            for layer, ul, vl in zip(group.layers, group.split(u), group.split(v)):
                out[layer.index] = (ul, vl)
        return out

    def _heads(self, layer: AttentionLayer, values: list[float]) -> dict[tuple[int, int], float]:
        if layer.index in self.unmeasured:
            values = [math.nan] * len(values)
        return {(layer.index, layer.head_offset + h): v for h, v in enumerate(values)}

    def exact_now(self) -> dict[tuple[int, int], float]:
        """Exact norms per (layer, head), restarting the vectors (a host sync: on request only;
        collectives for FSDP-sharded layers: call it on every rank)."""
        out = {}
        for group in self.groups:
            sigma = group.power.exact(group.weight())
            for layer, s in zip(group.layers, group.split(sigma)):
                out.update(self._heads(layer, s.tolist()))
        for layer, s in self.sharded.exact().items():
            out.update(self._heads(layer, s.tolist()))
        return dict(sorted(out.items()))

    def current(self) -> dict[tuple[int, int], float]:
        """The estimates as of the last step, per (layer, head) (a host sync); under tensor
        parallelism this rank's heads only."""
        out = {}
        for group in self.groups:
            for layer, s in zip(group.layers, group.split(group.power.sigma)):
                out.update(self._heads(layer, s.tolist()))
        for m in self.sharded.members:
            out.update(self._heads(m.layer, m.power.sigma.tolist()))
        return dict(sorted(out.items()))

    def state_of(self, layer: AttentionLayer) -> dict | None:
        """The layer's vectors as plain CPU tensors, every head's. Under tensor parallelism (alone
        or under FSDP2) this gathers the ranks' heads (one all-reduce over the tensor-parallel
        group): call it on every rank of that group (``Monitor.state_dict()`` and ``detach()`` do)."""
        for group in self.groups:
            if layer in group.layers:
                return _all_heads(layer, group.state_of(group.layers.index(layer)))
        if layer in self.sharded:
            state = self.sharded.power_of(layer).state_dict()
            return _all_heads(layer, {"v": state["v"], "sigma": state["sigma"]})
        if self.skip is not None or layer.index in self.unsupported:
            return None  # W^Q not measured: no power iteration
        raise KeyError(layer.index)

    def load(self, powers: list[dict | None]) -> None:
        """Per-layer saved vectors in layer order (None where a run saved none). Nothing is loaded
        unless every part fits (ValueError otherwise)."""
        todo = []  # (power iteration, its state)
        for group in self.groups:
            mine = [_own_heads(layer, powers[layer.index]) for layer in group.layers]
            if all(p is not None for p in mine):
                todo.append((group.power, {"v": torch.cat([s["v"] for s in mine]),
                                           "sigma": torch.cat([s["sigma"] for s in mine])}))
        todo += [(m.power, _own_heads(m.layer, powers[m.layer.index])) for m in self.sharded.members
                 if powers[m.layer.index] is not None]
        for power, state in todo:
            power.check_state(state)
        for power, state in todo:
            power.load_state_dict(state)


def _raise(kind: str, exc: BaseException) -> None:
    raise exc


def _all_heads(layer: AttentionLayer, state: dict) -> dict:
    """The layer's state with every head: as it is, or under tensor parallelism every rank's heads
    (zeros elsewhere, summed over the tensor-parallel group)."""
    from .sharded_power import all_reduce_sum

    off, n, h = layer.head_offset, layer.num_heads, layer.total_heads
    if n == h:
        return state
    v = state["v"].new_zeros((h, *state["v"].shape[1:]))
    sigma = state["sigma"].new_zeros(h)
    v[off: off + n], sigma[off: off + n] = state["v"], state["sigma"]
    v, sigma = all_reduce_sum([v, sigma], layer.placement.heads_group)
    return {"v": v.cpu().clone(), "sigma": sigma.cpu().clone()}


def _own_heads(layer: AttentionLayer, state: dict | None) -> dict | None:
    """This rank's heads of a saved state that holds every head (tensor parallelism)."""
    if state is None or layer.num_heads == layer.total_heads or state["v"].shape[0] != layer.total_heads:
        return state
    off, n = layer.head_offset, layer.num_heads
    return {"v": state["v"][off: off + n], "sigma": state["sigma"][off: off + n]}


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
