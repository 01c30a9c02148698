"""Data-parallel training: every rank sees the same statistics, decides the same, acts the same.

How (docs/DISTRIBUTED.md is the user's guide):

- On a monitored step each rank packs what it measured into one float64 vector on its device
  and the ranks combine it in ONE collective, an all-reduce with ``SUM``: counts, delta-error
  sums and the loss add up; values that must be combined with MAX (the max logit, the W^Q
  spectral norm, the gradient norm, and the step and kernel variants that are checked for
  agreement) travel in *slots*: rank r writes its values at offset r of a block of
  ``world_size`` slots and zeros elsewhere, so the sum hands every rank every rank's values
  exactly (x + 0 == x, also for inf and NaN) and each rank takes the max (and min) itself, in
  the same order on the same numbers. Only the small MAX part grows with the world size (one
  row of heads per rank); the SUM part is the size of one rank's statistics.
- When the slots would exceed ``SLOT_BYTES_LIMIT`` (many ranks, many heads) the Reducer uses
  two collectives instead: the SUM all-reduce, then one MAX all-reduce of ``[x, -x]`` for the
  max and min of the MAX part (NaN is sent as +inf there, so a non-finite value stays non-finite).
- All-reduce results are bitwise identical on every rank (DDP relies on that to keep its
  replicas identical), so every rank's detectors get identical inputs, hence identical alerts
  and identical ``auto_fix`` switches at the same step, without a broadcast.
- A second, separate all-reduce carries the W^Q-gradient error chain's accumulators where the
  chain is on (``flashwatch.chain.Chains.average``): they must be combined before the chain's
  readings are computed.
- Checks that cost nothing more (they ride in the same collective): a rank whose local
  measurement failed (every rank then skips the step, instead of one rank skipping the
  collective and the others hanging in it); ranks at different steps; kernel variants that
  differ between ranks (every rank then adopts the highest: a switch made anywhere is made
  everywhere); W^Q norms that differ between replicas (they should not under DDP).

Sharded models (FSDP, FSDP2 / DTensor, tensor parallelism, DeepSpeed ZeRO-3; ``sharding_of``):
the attention layers are found by module structure alone (``structural_attention``), without
reading a weight, and each layer's ``placement`` says how this rank holds W^Q
(``flashwatch.sharded``): FSDP shards are measured by power iteration on the shards,
tensor-parallel heads by the rank that holds them. The attention statistics, loss and gradient
norm are reduced as above. Under tensor parallelism (``heads=`` with local head ranges) each
rank packs its own heads into their global columns (zeros in the SUM part and -inf in the MAX
part elsewhere), so the one SUM all-reduce hands every rank every head under its global index.
"""

from __future__ import annotations

import json
import logging
import math
import os
import zlib
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import nn

log = logging.getLogger("flashwatch")

__all__ = ["AUTO", "SLOT_BYTES_LIMIT", "Reducer", "Reduced", "resolve_process_group", "sharding_of",
           "structural_attention"]

AUTO = "auto"  # Monitor(process_group="auto"): the default group when torch.distributed is initialized
SLOT_BYTES_LIMIT = 256 * 2**10  # above this many bytes of MAX slots, two collectives instead of one
_SUM_TAIL = ("loss_sum", "grad_norm_sq_sum", "loss_n", "grad_norm_n", "grad_norm_global", "grad_units_unknown",
             "failed")  # "failed" last: failed_local() sets it
_SPREAD_RTOL = 1e-6  # W^Q norms of replicas differing more than this are reported


def _dist():
    import torch.distributed as dist

    return dist


def resolve_process_group(process_group: Any) -> tuple[Any, int, int] | None:
    """The group to reduce over as ``(group, rank in it, its size)``, or None for no reduction.

    Args:
        process_group: ``"auto"`` (the default group when ``torch.distributed`` is initialized
            with more than one process, else None; a warning where the launcher's ``WORLD_SIZE``
            says there are more but nothing is initialized yet), None (never reduce), or a process
            group.

    Raises:
        ValueError: a group was given but torch.distributed is not initialized, or this
            process is not a member of it.
    """
    dist = _dist()
    ready = dist.is_available() and dist.is_initialized()
    if process_group is None:
        if ready and dist.get_world_size() > 1:
            log.warning("flashwatch: this process is one of %d (torch.distributed) and its Monitor combines nothing "
                        "(process_group=None): it measures its own batch alone. Give each process its own run_dir "
                        "and port, or exporters on one process only (their files and ports are not shared)",
                        dist.get_world_size())
        return None
    if isinstance(process_group, str):
        if process_group != AUTO:
            raise ValueError(f"process_group must be 'auto', None or a torch.distributed process group, "
                             f"got {process_group!r}")
        if not ready:
            launched = os.environ.get("WORLD_SIZE", "1")
            if launched.isdigit() and int(launched) > 1:  # torchrun and the like set it for every process
                log.warning("flashwatch: WORLD_SIZE=%s, but torch.distributed is not initialized when the Monitor "
                            "attaches: it combines nothing and measures this process's batch alone, and every "
                            "process decides on its own. Attach after torch.distributed.init_process_group (or pass "
                            "process_group=None where one Monitor per process is meant)", launched)
            return None
        group = None  # the default (world) group
    else:
        if not ready:
            raise ValueError("process_group was given but torch.distributed is not initialized; call "
                             "torch.distributed.init_process_group first, or pass process_group=None")
        group = process_group
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("this process is not a member of the process_group given to the Monitor")
    if world < 2:
        return None
    return group, rank, world


# --- sharded models -----------------------------------------------------------------------------

def sharding_of(model: nn.Module) -> str | None:
    """Why this rank does not hold ``model``'s weights whole between steps, or None.

    Recognised: ``torch.distributed.fsdp.FullyShardedDataParallel`` (FSDP1, also its flattened
    parameters when the wrapper sits above ``model``, as Lightning's FSDPStrategy does),
    FSDP2 ``fully_shard`` and tensor parallelism (DTensor parameters), DeepSpeed ZeRO-3
    (partitioned parameters). Cheap: nothing is imported or read unless torch.distributed is
    initialized.
    """
    dist = _dist()
    if not (dist.is_available() and dist.is_initialized()):
        return None
    fsdp1 = fsdp2 = dtensor = None
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel as fsdp1
    except Exception:  # pragma: no cover - builds without FSDP
        pass
    try:
        from torch.distributed.fsdp import FSDPModule as fsdp2
    except Exception:  # pragma: no cover - torch < 2.6
        pass
    try:
        from torch.distributed.tensor import DTensor as dtensor
    except Exception:  # pragma: no cover
        pass
    for m in model.modules():
        if fsdp1 is not None and isinstance(m, fsdp1):
            return "FSDP (FullyShardedDataParallel) shards the weights"
        if fsdp2 is not None and isinstance(m, fsdp2):
            return "FSDP2 (fully_shard) shards the weights"
    for p in model.parameters():
        if dtensor is not None and isinstance(p, dtensor):
            return "the weights are DTensors (FSDP2 fully_shard or tensor parallelism)"
        if getattr(p, "_fsdp_flattened", False):
            return "FSDP (FullyShardedDataParallel) shards the weights"
        if hasattr(p, "ds_id"):
            return "DeepSpeed ZeRO-3 partitions the weights"
    return None


def _device_of(module: nn.Module) -> torch.device:
    for t in list(module.parameters()) + list(module.buffers()):
        local = getattr(t, "to_local", None)
        return local().device if callable(local) else t.device
    return torch.device("cpu")


def structural_attention(model: nn.Module) -> dict[str, Any]:
    """``{module name: query_weight_fn}`` for ``attach(model, attention=...)`` on a sharded model.

    Modules are found as ``find_attention`` finds them (module order, children of an
    attention module skipped), by structure alone. Each function is a
    ``flashwatch.sharded.QueryWeight`` carrying the layer's ``placement`` (how this rank holds
    W^Q: FSDP shards, tensor-parallel heads, ...); it returns a placeholder of the local heads'
    shape (a zero-stride view of one zero: no memory, no weight read), or under tensor
    parallelism the local heads' weight.
    """
    from .attach import known_attention
    from .sharded import QueryWeight, placement_of

    found: dict[str, Any] = {}
    for name, module, family, shape in known_attention(model):
        found[name] = QueryWeight(placement_of(model, module, family, shape), _device_of(module), family.name)
    return found


# --- the reduction --------------------------------------------------------------------------------

@dataclass
class Reduced:
    """One monitored step combined over every rank (host data, identical on every rank).

    ``stats`` is (len(STAT_FIELDS), total heads) float64 as ``AttentionStats.packed()``;
    ``sigma`` the W^Q norms (max over ranks) and ``sigma_min`` their min; ``variants`` and
    ``variants_min`` the per-layer variant codes' max and min; ``steps`` (min, max) of the
    ranks' step counters; ``failed`` how many ranks could not measure the step;
    ``grad_units_unknown`` on how many the gradients' loss scale was unknown (the scaler skipped
    the step, ``flashwatch.loss_scale``).
    """

    stats: torch.Tensor
    sigma: torch.Tensor
    sigma_min: torch.Tensor
    loss: float
    loss_given: bool
    grad_norm: float
    grad_norm_given: bool
    variants: list[int]
    variants_min: list[int]
    steps: tuple[int, int]
    failed: int
    grad_units_unknown: int = 0


def _all_reduce(dist: Any, t: torch.Tensor, op: Any, group: Any) -> None:
    """A monitored step's all-reduce; a failure (a timeout, a peer gone) says what it likely means."""
    try:
        dist.all_reduce(t, op=op, group=group)
    except Exception as exc:
        raise RuntimeError(f"flashwatch's all-reduce of a monitored step failed ({type(exc).__name__}: {exc}). Every "
                           "rank must call monitor.step() on the same steps: has another rank stopped calling it, or "
                           "stopped?") from exc


def check_owners(owners: torch.Tensor, heads: Sequence[int]) -> None:
    """Raise ``ValueError`` unless every head (``owners``: ranks holding each head, layers' heads side by
    side) has a rank in the group."""
    missing, start = [], 0
    for layer, h in enumerate(heads):
        absent = [i for i in range(h) if owners[start + i] < 1]
        if absent:
            missing.append(f"layer {layer} heads {absent}")
        start += h
    if missing:
        raise ValueError("under tensor parallelism the Monitor's process group must hold every head's rank: "
                         f"{'; '.join(missing)} have no rank in it (pass the default group, process_group='auto', "
                         "or a group that holds all the tensor-parallel ranks)")


class Reducer:
    """Packs one rank's monitored step, combines it over the group, unpacks the result.

    Args:
        group, rank, world_size: from ``resolve_process_group``.
        heads: heads per attached layer, in layer order (all ranks' heads under tensor parallelism).
        local: per layer, ``(head_offset, local_heads)``: the heads this rank measured (tensor
            parallelism); None: every rank measures every head. ``pack`` then takes this rank's
            heads only and files them under their global columns.
        n_fields: rows of ``AttentionStats.packed()``.
        max_rows: the rows combined with max (``AttentionStats.max_rows()``).
        grad_norm: ``"max"`` when every rank passes the same global gradient norm (DDP: the
            gradients are all-reduced before the optimizer step; the max of equal values is
            that value), ``"l2"`` when each rank passes the norm of its own shard (FSDP):
            sqrt of the sum of squares. A DTensor norm (``clip_grad_norm_`` on DTensor
            gradients: already the global norm) is taken as it is (max) in either mode.
        slot_bytes_limit: largest MAX-slot block (bytes) for the one-collective scheme.
        names: the attached layers' names, in layer order (``check_layout`` compares them); None:
            only the head counts are compared.

    Layout of the local vector (float64): the SUM part, ``sum rows x heads`` then
    ``loss_sum, grad_norm^2, loss_n, grad_norm_n, grad_norm_global, grad_units_unknown, failed`` (``_SUM_TAIL``); then the MAX part,
    ``max rows x heads, sigma (heads), grad_norm, variant codes (layers), step``.
    """

    def __init__(self, group: Any, rank: int, world_size: int, heads: Sequence[int], *, n_fields: int,
                 max_rows: Sequence[int], grad_norm: str = "max", slot_bytes_limit: int = SLOT_BYTES_LIMIT,
                 local: Sequence[tuple[int, int]] | None = None, names: Sequence[str] | None = None):
        if grad_norm not in ("max", "l2"):
            raise ValueError(f"grad_norm must be 'max' or 'l2', got {grad_norm!r}")
        self.group, self.rank, self.world_size = group, rank, world_size
        self.heads = list(heads)
        self.names = None if names is None else list(names)
        self.local = None if local is None else [(int(o), int(n)) for o, n in local]
        if self.local is not None and (len(self.local) != len(self.heads) or any(
                o < 0 or n < 0 or o + n > h for (o, n), h in zip(self.local, self.heads))):
            raise ValueError(f"local head ranges {self.local} do not fit the layers' heads {self.heads}")
        self.local_heads = sum(n for _, n in self.local) if self.local is not None else sum(self.heads)
        self.num_heads, self.num_layers = sum(self.heads), len(self.heads)
        self.n_fields = n_fields
        self.max_rows = sorted(max_rows)
        self.sum_rows = [i for i in range(n_fields) if i not in self.max_rows]
        self.grad_norm = grad_norm
        h = self.num_heads
        self.sum_size = len(self.sum_rows) * h + len(_SUM_TAIL)
        self.max_size = len(self.max_rows) * h + h + 1 + self.num_layers + 1
        self.slot_bytes_limit = slot_bytes_limit
        # how many ranks measure each head (sum heads,), host float64: the divisor of the values that
        # are means over the ranks (the W^Q-error chain's); every rank, unless tensor parallelism
        # splits the heads (then counted by ``check_layout``)
        self.owners = torch.full((h,), float(world_size), dtype=torch.float64)
        self._owners_on: dict[torch.device, torch.Tensor] = {}
        self.last_local: torch.Tensor | None = None  # this rank's vector of the last monitored step (device)
        self.last_host: torch.Tensor | None = None  # the combined vector as read to the host
        backend = str(_dist().get_backend(group))
        self._backend = backend

    # layout -----------------------------------------------------------------------------------
    @property
    def slots(self) -> bool:
        """True: one collective (MAX values in per-rank slots); False: two (SUM, then MAX)."""
        return self.world_size * self.max_size * 8 <= self.slot_bytes_limit

    @property
    def collectives(self) -> int:
        return 1 if self.slots else 2

    @property
    def local_size(self) -> int:
        return self.sum_size + self.max_size

    def describe(self) -> str:
        """What crosses the wire per monitored step, for logs and reports."""
        if self.slots:
            n = self.sum_size + self.world_size * self.max_size
            return f"1 all-reduce (SUM) of {n} float64 ({n * 8 / 1024:.1f} KiB)"
        return (f"2 all-reduces: SUM of {self.sum_size} float64 and MAX of {2 * self.max_size} float64 "
                f"({(self.sum_size + 2 * self.max_size) * 8 / 1024:.1f} KiB)")

    # packing ----------------------------------------------------------------------------------
    def pack(self, stats: torch.Tensor, sigma: torch.Tensor, loss: Any, grad_norm: Any, step: int,
             variant_codes: Sequence[int], grad_units_unknown: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's local vector, on ``stats.device`` (no host synchronisation).

        ``stats`` (n_fields, heads) and ``sigma`` (heads,) are device tensors; ``loss`` and
        ``grad_norm`` floats, one-element tensors or None; ``grad_units_unknown`` a 0-d device
        boolean (the gradients' loss scale is unknown: ``flashwatch.loss_scale``) or None.
        """
        dev, f64 = stats.device, torch.float64
        if stats.shape != (self.n_fields, self.local_heads) or sigma.shape != (self.local_heads,):
            raise ValueError(f"statistics of shape {tuple(stats.shape)} / {tuple(sigma.shape)} do not match the "
                             f"layout ({self.n_fields}, {self.local_heads}) the Reducer was built for")
        if self.local is not None:
            stats, sigma = self._global_columns(stats.to(f64), sigma.to(device=dev, dtype=f64))
        if len(variant_codes) != self.num_layers:
            raise ValueError(f"{len(variant_codes)} variant codes for {self.num_layers} layers")

        # what the host knows (Python numbers, counts, variants, step) in one small copy, pinned
        # and asynchronous on CUDA so that packing adds no synchronisation of its own
        global_norm = callable(getattr(grad_norm, "full_tensor", None))  # a DTensor norm: the global one
        # the SUM tail's slots, then the MAX tail's codes and step; the first two slots carry the loss
        # and the gradient norm themselves (the norm is squared on the device below)
        slots = {"loss_sum": 0.0 if loss is None else math.nan,
                 "grad_norm_sq_sum": -math.inf if grad_norm is None else math.nan,
                 "loss_n": float(loss is not None), "grad_norm_n": float(grad_norm is not None),
                 "grad_norm_global": float(global_norm), "grad_units_unknown": 0.0, "failed": 0.0}
        host = [slots[name] for name in _SUM_TAIL] + [*map(float, variant_codes), float(step)]
        for i, v in ((0, loss), (1, grad_norm)):
            if v is not None and not isinstance(v, torch.Tensor):
                host[i] = float(v)
        h = torch.tensor(host, dtype=f64)
        h = h.pin_memory().to(dev, non_blocking=True) if dev.type == "cuda" else h.to(dev)

        def one(v: Any, i: int) -> torch.Tensor:
            if not isinstance(v, torch.Tensor):
                return h[i: i + 1]
            v = v.detach()
            full = getattr(v, "full_tensor", None)  # a DTensor scalar (FSDP2): its value
            if callable(full):
                v = full()
            return v.reshape(1).to(device=dev, dtype=f64)

        loss_t, gn_t = one(loss, 0), one(grad_norm, 1)
        n, u = len(_SUM_TAIL), _SUM_TAIL.index("grad_units_unknown")
        units_t = h[u: u + 1] if grad_units_unknown is None else \
            grad_units_unknown.detach().reshape(1).to(device=dev, dtype=f64)
        gn_sq = gn_t * gn_t if grad_norm is not None else torch.zeros_like(gn_t)
        s = stats.to(f64)
        # rows picked one by one (views): indexing a CUDA tensor with a list of rows would copy
        # the list to the device synchronously, a host sync on every monitored step
        local = torch.cat([
            *(s[i] for i in self.sum_rows), loss_t, gn_sq, h[2:u], units_t, h[u + 1: n],   # SUM part
            *(s[i] for i in self.max_rows), sigma.to(device=dev, dtype=f64), gn_t, h[n:],  # MAX part
        ])
        self.last_local = local
        return local

    def _global_columns(self, stats: torch.Tensor, sigma: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's heads (n_fields, local heads) in their global columns (n_fields, heads): zeros
        elsewhere in the summed rows, -inf in the max-combined rows and the W^Q norms (slices
        only: no host synchronisation)."""
        full = torch.zeros(self.n_fields, self.num_heads, dtype=stats.dtype, device=stats.device)
        for i in self.max_rows:
            full[i].fill_(-math.inf)
        sig = torch.full((self.num_heads,), -math.inf, dtype=sigma.dtype, device=sigma.device)
        src = dst = 0
        for (offset, n), h in zip(self.local, self.heads):
            full[:, dst + offset: dst + offset + n] = stats[:, src: src + n]
            sig[dst + offset: dst + offset + n] = sigma[src: src + n]
            src, dst = src + n, dst + h
        return full, sig

    def failed_local(self, device: torch.device) -> torch.Tensor:
        """The vector of a rank that could not measure the step: zeros, -inf maxima, and 1 in ``failed``."""
        local = torch.zeros(self.local_size, dtype=torch.float64, device=device)
        local[self.sum_size - 1] = 1.0  # "failed"
        local[self.sum_size:] = -math.inf  # leaves every other rank's maxima alone
        self.last_local = local
        return local

    def check_layout(self, *, config: dict | None = None, failed: bool = False, step: int = 0) -> None:
        """Once, at attach: every rank attached the same layers (names and heads) with the same
        ``config`` (``MonitorConfig.to_dict()``: the settings decide when collectives run and what
        every rank decides) at the same optimizer ``step`` (a resumed Monitor's: ranks resumed from
        different states, or some from none, would monitor different steps), and no rank failed to
        attach (``failed``: this rank's exporters or saved state could not be opened; it raises its
        own error). One small MAX all-reduce (a
        second one, of the configs, only when they differ); every rank raises alike, so no rank
        goes on into a collective the others never reach. Under tensor parallelism a SUM
        all-reduce then counts each head's ranks (``owners``).

        Raises:
            ValueError: the ranks' layouts, configs or steps differ, or a head has no rank in the group.
            RuntimeError: another rank failed to attach, or the all-reduce failed (a rank that
                never attaches: its message says what that likely means).
        """
        dist = _dist()
        names = zlib.crc32("\0".join(self.names).encode()) if self.names is not None else 0.0
        settings = zlib.crc32(json.dumps(config, sort_keys=True, default=str).encode()) if config is not None else 0.0
        mine = [float(self.num_layers), float(self.num_heads), float(sum((i + 1) * h for i, h in enumerate(self.heads))),
                float(names), float(settings), float(failed), float(step)]
        t = torch.tensor(mine + [-v for v in mine], dtype=torch.float64)
        t = t.to(self._comm_device(t))
        try:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        except Exception as exc:
            raise RuntimeError(f"flashwatch's attach could not reach every rank of its group ({self.world_size} ranks; "
                               f"{type(exc).__name__}: {exc}). Every rank of the group must attach a Monitor: for a "
                               "Monitor on some ranks only, pass process_group=None") from exc
        n = len(mine)
        hi, lo = t[:n].tolist(), [-v for v in t[n:].tolist()]
        if hi[5] > 0:  # a rank could not attach
            if failed:
                return  # this rank raises its own error
            raise RuntimeError(f"flashwatch: another rank of the group ({self.world_size} ranks) could not attach its "
                               "Monitor (an exporter that could not open, a saved state that does not fit: that rank's "
                               "error says which); every rank stops attaching, so that none waits for it in a "
                               "monitored step's collective")
        if hi[:4] != lo[:4]:
            raise ValueError(f"the ranks attached different attention layouts (layers {lo[0]:.0f} to {hi[0]:.0f}, "
                             f"heads {lo[1]:.0f} to {hi[1]:.0f}; this rank: {self.heads}"
                             f"{', ' + str(self.names) if self.names is not None else ''}): every rank must attach "
                             "the same model with the same MonitorConfig.layers (pipeline stages: one Monitor per "
                             "stage, process_group= the stage's data-parallel group; docs/DISTRIBUTED.md)")
        if hi[4] != lo[4]:
            configs = [None] * self.world_size
            dist.all_gather_object(configs, config, group=self.group)  # every rank is here: the same MAX said so
            differ = sorted(k for k in configs[0] if any(c.get(k) != configs[0].get(k) for c in configs))
            raise ValueError(f"the ranks attached with different MonitorConfig settings ({', '.join(differ)}; this "
                             f"rank: {', '.join(f'{k}={config.get(k)!r}' for k in differ)}): every rank must use the "
                             "same MonitorConfig (the settings decide when the ranks' collectives run and what "
                             "every rank decides)")
        if hi[6] != lo[6]:
            raise ValueError(f"the ranks attached at different optimizer steps ({lo[6]:.0f} to {hi[6]:.0f}; this rank: "
                             f"{step}): they resumed from different Monitor states, or some from none. Load the same "
                             "checkpoint's Monitor state on every rank (monitor.load_state_dict)")
        if self.local is not None:
            self._count_owners()

    def _count_owners(self) -> None:
        """Under tensor parallelism: how many ranks hold each head (one SUM all-reduce, at attach).
        1 under tensor parallelism alone; the data-parallel replicas' count where both are in the
        group. A head that no rank of the group holds (a group without some tensor-parallel ranks,
        such as the data-parallel group of a 2-D mesh) raises ``ValueError``."""
        mine = torch.zeros(self.num_heads, dtype=torch.float64)
        start = 0
        for (offset, n), h in zip(self.local, self.heads):
            mine[start + offset: start + offset + n] = 1.0
            start += h
        dist = _dist()
        t = mine.to(self._comm_device(mine))
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)
        self.owners = t.cpu()
        self._owners_on = {}
        check_owners(self.owners, self.heads)

    def owners_on(self, device: torch.device) -> torch.Tensor:
        """``owners`` on ``device``, copied there once (no copy on a monitored step)."""
        device = torch.device(device)
        if device not in self._owners_on:
            self._owners_on[device] = self.owners.to(device)
        return self._owners_on[device]

    # the collective -----------------------------------------------------------------------------
    def _comm_device(self, t: torch.Tensor) -> torch.device:
        backend = self._backend
        if backend == "nccl" and t.device.type != "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        if backend == "gloo" and t.device.type != "cpu":
            return torch.device("cpu")
        return t.device

    def all_reduce(self, local: torch.Tensor) -> torch.Tensor:
        """Combine over the group: one SUM all-reduce (slots), or SUM then MAX. Every rank must call it."""
        dist = _dist()
        x = local.to(self._comm_device(local))
        s, m = self.sum_size, self.max_size
        if self.slots:
            buf = x.new_zeros(s + self.world_size * m)
            buf[:s] = x[:s]
            buf[s + self.rank * m: s + (self.rank + 1) * m] = x[s:]
            _all_reduce(dist, buf, dist.ReduceOp.SUM, self.group)
            return buf
        head = x[:s].clone()
        _all_reduce(dist, head, dist.ReduceOp.SUM, self.group)
        g = torch.nan_to_num(x[s:], nan=math.inf, posinf=math.inf, neginf=-math.inf)
        both = torch.cat([g, -g])
        _all_reduce(dist, both, dist.ReduceOp.MAX, self.group)
        return torch.cat([head, both])

    def sum_(self, t: torch.Tensor) -> None:
        """In place: the sum of ``t`` over the group (one SUM all-reduce). Every rank must call it,
        with a tensor of the same size. Used for the W^Q-error accumulators, which must be combined
        before their alignment and coherence are computed (each head's sum then divided by
        ``owners``)."""
        dist = _dist()
        x = t.to(self._comm_device(t))
        _all_reduce(dist, x, dist.ReduceOp.SUM, self.group)
        if x is not t:
            t.copy_(x.to(t.device))

    # unpacking ----------------------------------------------------------------------------------
    def _max_min(self, host: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s, m = self.sum_size, self.max_size
        if self.slots:
            slots = host[s:].view(self.world_size, m)
            return slots.amax(0), slots.amin(0)  # NaN propagates, the same on every rank
        return host[s: s + m], -host[s + m: s + 2 * m]

    def unpack(self, host: torch.Tensor) -> Reduced:
        """The combined step from ``all_reduce``'s result, read to the host (float64, CPU)."""
        self.last_host = host
        h, nsum, nmax = self.num_heads, len(self.sum_rows), len(self.max_rows)
        head = host[: self.sum_size]
        tail = dict(zip(_SUM_TAIL, head[nsum * h:].tolist()))
        loss_sum, gn_sq, loss_n, gn_n = (tail[k] for k in ("loss_sum", "grad_norm_sq_sum", "loss_n", "grad_norm_n"))
        gn_global, units, failed = tail["grad_norm_global"], tail["grad_units_unknown"], tail["failed"]
        mx, mn = self._max_min(host)
        stats = torch.empty(self.n_fields, h, dtype=torch.float64)
        stats[self.sum_rows] = head[: nsum * h].view(nsum, h)
        stats[self.max_rows] = mx[: nmax * h].view(nmax, h)
        o = nmax * h
        sigma, sigma_min = mx[o: o + h].clone(), mn[o: o + h].clone()
        gn_max = float(mx[o + h])
        codes = slice(o + h + 1, o + h + 1 + self.num_layers)
        variants = [int(v) if math.isfinite(v) else 0 for v in mx[codes].tolist()]
        variants_min = [int(v) if math.isfinite(v) else 0 for v in mn[codes].tolist()]
        steps = (int(mn[-1]) if math.isfinite(mn[-1]) else -1, int(mx[-1]) if math.isfinite(mx[-1]) else -1)
        l2 = self.grad_norm == "l2" and gn_global < gn_n  # some rank passed its shard's norm
        grad_norm = (math.sqrt(gn_sq) if l2 else gn_max) if gn_n > 0 else math.nan
        return Reduced(stats=stats, sigma=sigma, sigma_min=sigma_min,
                       loss=loss_sum / loss_n if loss_n > 0 else math.nan, loss_given=loss_n > 0,
                       grad_norm=grad_norm, grad_norm_given=gn_n > 0, variants=variants, variants_min=variants_min,
                       steps=steps, failed=int(failed) if math.isfinite(failed) else self.world_size,
                       grad_units_unknown=int(units) if math.isfinite(units) else 0)

    def split_local(self, local: torch.Tensor) -> dict:
        """One rank's own values from its local vector (host copy): for tests and debugging."""
        local = local.detach().to("cpu", torch.float64)
        h, nsum, nmax = self.num_heads, len(self.sum_rows), len(self.max_rows)
        stats = torch.empty(self.n_fields, h, dtype=torch.float64)
        stats[self.sum_rows] = local[: nsum * h].view(nsum, h)
        tail = dict(zip(_SUM_TAIL, local[nsum * h: self.sum_size].tolist()))
        loss_sum, loss_n, gn_n = tail["loss_sum"], tail["loss_n"], tail["grad_norm_n"]
        mx = local[self.sum_size:]
        stats[self.max_rows] = mx[: nmax * h].view(nmax, h)
        o = nmax * h
        return {"stats": stats, "sigma": mx[o: o + h].clone(), "loss": loss_sum if loss_n else math.nan,
                "grad_norm": float(mx[o + h]) if gn_n else math.nan, "step": int(mx[-1]),
                "variants": [int(v) for v in mx[o + h + 1: o + h + 1 + self.num_layers].tolist()]}

    @staticmethod
    def sigma_spread(reduced: Reduced) -> float:
        """Largest relative difference of a head's W^Q norm between ranks (0 for identical replicas)."""
        hi, lo = reduced.sigma, reduced.sigma_min
        ok = torch.isfinite(hi) & torch.isfinite(lo) & (hi > 0)
        if not bool(ok.any()):
            return 0.0
        return float(((hi - lo)[ok] / hi[ok]).max())
