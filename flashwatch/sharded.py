"""W^Q of a sharded model: where each rank's piece of it lies, and power iteration on the pieces.

How a rank holds a layer's query weight is decided once, at attach, from the model's structure
(the same on every rank); ``placement_of`` returns a ``QueryPlacement`` of one of these kinds:

- ``"whole"``: a plain tensor, the whole W^Q on every rank (single process, DDP): measured as
  on one device (``flashwatch.wq``).
- ``"fsdp"``: FSDP2 (``fully_shard``: the parameter is a DTensor sharded on dim 0) or FSDP1
  with ``use_orig_params=True`` (the parameter is a 1-D view of this rank's part of FSDP's
  flat shard). Either way a rank holds one contiguous range of the parameter's row-major
  elements, possibly empty. ``ShardedPowerIteration`` runs the power iteration on these
  pieces: each rank multiplies its elements into partial products y = W v (H, D, k) and
  z = W^T y (H, C, k), and one all-reduce (SUM) over the shard group per product completes
  them, batched over every layer of the group: 2 * ``power_iters`` + 1 all-reduces of
  sum_layers H * (D + C) * k float32 per monitored step. No rank gathers a weight; the
  vectors and norms are bitwise identical on every rank (they are computed from all-reduce
  results), and equal to an unsharded run's up to float32 summation order.
- ``"tensor_parallel"``: a DTensor parameter outside FSDP, the query projection sharded by
  rows (``ColwiseParallel``, torchtitan's layout): each rank holds whole heads
  ``[head_offset, head_offset + local_heads)`` and its attention computes only those. It
  measures its own heads from the local shard (no collective); the Monitor files them under
  their global head indices.
- ``"unsupported"``: anything else (FSDP1 without ``use_orig_params``, DeepSpeed ZeRO-3, a
  mesh of more than one sharded dimension, a fused q/k/v projection split across ranks):
  the W^Q norms of such a layer are NaN, with one warning saying why.

The exact norms (``power_exact_every``, ``Monitor.wq_spectral_norms(exact=True)``) and the
start vectors at attach need each head's SVD: there, and only there, a layer's W^Q is
assembled on every rank (one all-reduce of a zero-filled (H, D, C) buffer per layer, one layer
at a time), as a forward pass assembles it anyway.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from .signals import PowerIteration, orthonormalize, top_eigenvalue

__all__ = ["QueryPlacement", "QueryWeight", "placement_of", "ShardedPowerIteration", "query_blocks"]

KINDS = ("whole", "fsdp", "tensor_parallel", "unsupported")


def _dist():
    import torch.distributed as dist

    return dist


@dataclass(eq=False)
class QueryPlacement:
    """How this rank holds one layer's W^Q (see the module docstring).

    Attributes:
        kind: one of ``"whole"``, ``"fsdp"``, ``"tensor_parallel"``, ``"unsupported"``.
        reason: what was recognised (or why unsupported), for logs.
        shape: W^Q's global (H, D, C).
        head_offset, local_heads: the heads this rank's attention computes (all of them
            except under tensor parallelism).
        group: the process group over which the pieces are summed (``"fsdp"``) or the heads
            are split (``"tensor_parallel"``); None otherwise.
        locate: ``"fsdp"``: ``locate(module) -> (values (n,), start)``: this rank's elements of
            the parameter, row-major, from element ``start`` on; ``"tensor_parallel"``:
            ``locate(module) -> (local heads, D, C)``; ``"whole"``: ``locate(module) -> (H, D, C)``.
        transposed: W^Q's rows are the parameter's columns (Hugging Face GPT-2's Conv1D).
        param_shape: the parameter's global (rows, columns).
    """

    kind: str
    reason: str
    shape: tuple[int, int, int]
    head_offset: int = 0
    local_heads: int = 0
    group: Any = None
    locate: Callable[[nn.Module], Any] | None = field(default=None, repr=False)
    transposed: bool = False
    param_shape: tuple[int, int] = (0, 0)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
        if not self.local_heads:
            self.local_heads = self.shape[0]


class QueryWeight:
    """``attach(model, attention={name: QueryWeight})`` entry for a sharded model: a query-weight
    function that carries its ``placement``. It returns a zero-stride placeholder of the local
    heads' shape (no memory, no weight read), or, under tensor parallelism, the local heads'
    weight (a view of the local shard)."""

    def __init__(self, placement: QueryPlacement, device: torch.device):
        self.placement, self.device = placement, device

    def __call__(self, module: nn.Module) -> torch.Tensor:
        p = self.placement
        if p.kind in ("tensor_parallel", "whole"):
            return p.locate(module)
        _, d, c = p.shape
        return torch.zeros((), device=self.device).expand(p.local_heads, d, c)


# --- recognising the layout ------------------------------------------------------------------------

def _fsdp2_module_types() -> tuple:
    try:
        from torch.distributed.fsdp import FSDPModule
        return (FSDPModule,)
    except Exception:  # pragma: no cover - torch < 2.6
        return ()


def _dtensor_type():
    try:
        from torch.distributed.tensor import DTensor
        return DTensor
    except Exception:  # pragma: no cover
        return None


def _under(model: nn.Module, module: nn.Module, types: tuple) -> bool:
    """Whether ``module`` or one of its ancestors in ``model`` is an instance of ``types``."""
    if not types:
        return False
    for _, m in model.named_modules():
        if isinstance(m, types) and any(sub is module for sub in m.modules()):
            return True
    return False


def _fsdp1_entry(model: nn.Module, param: torch.Tensor) -> tuple[Any, int] | None:
    """FSDP1 (use_orig_params): (the unit's FSDP module, index of ``param`` in its flat parameter)."""
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    except Exception:  # pragma: no cover
        return None
    for m in model.modules():
        if isinstance(m, FSDP):
            handle = getattr(m, "_handle", None)
            flat = getattr(handle, "flat_param", None)
            params = getattr(flat, "_params", None) or []
            for i, p in enumerate(params):
                if p is param:
                    return m, i
    return None


def placement_of(model: nn.Module, module: nn.Module, family: Any, shape: tuple[int, int, int]) -> QueryPlacement:
    """How this rank holds ``module``'s W^Q (``family``: a ``flashwatch.families.Family``)."""
    h, d, c = shape
    param, transposed = family.query_param(module)
    dtensor = _dtensor_type()
    if dtensor is not None and isinstance(param, dtensor):
        return _dtensor_placement(model, module, family, shape, param, transposed)
    if getattr(param, "_fsdp_flattened", False):
        entry = _fsdp1_entry(model, param)
        if entry is None:
            return QueryPlacement("unsupported", "FSDP (FullyShardedDataParallel): the FSDP unit holding the query "
                                  "weight is not inside the attached model (wrap the transformer blocks, e.g. "
                                  "auto_wrap_policy={Block}, or attach the FSDP wrapper itself) or use_orig_params "
                                  "is False", shape)
        fsdp, index = entry
        flat = fsdp._handle.flat_param
        rows, cols = (int(x) for x in flat._shapes[index]) if len(flat._shapes[index]) == 2 else (0, 0)
        if rows * cols == 0:
            return QueryPlacement("unsupported", "FSDP: the query projection's weight is not a matrix", shape)
        info = flat._shard_param_infos[index]
        start = int(info.intra_param_start_idx) if info.in_shard else 0

        def locate(m: nn.Module, start=start, n=int(info.numel_in_shard or 0) if info.in_shard else 0):
            p, _ = family.query_param(m)
            values = p.detach().reshape(-1)
            if values.numel() != n:
                raise RuntimeError(f"FSDP's local view of the query weight has {values.numel()} elements, its shard "
                                   f"{n}: read between steps (after optimizer.step()), not inside forward/backward")
            return values, start

        return QueryPlacement("fsdp", "FSDP (use_orig_params=True): W^Q by power iteration on the shards", shape,
                              group=fsdp.process_group, locate=locate, transposed=transposed,
                              param_shape=(rows, cols))
    if not isinstance(param, nn.Parameter) and _fsdp1_flat_only(model):
        return QueryPlacement("unsupported", "FSDP (FullyShardedDataParallel) with use_orig_params=False: the query "
                              "weight exists only inside FSDP's flat parameter (pass use_orig_params=True)", shape)
    if hasattr(param, "ds_id"):
        return QueryPlacement("unsupported", "DeepSpeed ZeRO-3 partitions the weights", shape)
    return QueryPlacement("whole", "the whole weight on this rank", shape,
                          locate=lambda m: family.query_weight(m, h, d, c))


def _fsdp1_flat_only(model: nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    except Exception:  # pragma: no cover
        return False
    return any(isinstance(m, FSDP) and not getattr(m, "_use_orig_params", True) for m in model.modules())


def _dtensor_placement(model, module, family, shape, param, transposed) -> QueryPlacement:
    from torch.distributed.tensor import Replicate, Shard

    h, d, c = shape
    mesh, placements = param.device_mesh, tuple(param.placements)
    shards = [(i, p) for i, p in enumerate(placements) if isinstance(p, Shard)]
    if any(not isinstance(p, (Shard, Replicate)) for p in placements) or len(shards) != 1:
        return QueryPlacement("unsupported", f"a DTensor query weight placed {placements} (one sharded mesh "
                              "dimension is supported)", shape)
    mesh_dim, shard = shards[0]
    group = mesh.get_group(mesh_dim)
    rows, cols = (int(x) for x in param.shape)
    local_shape, offset = _local_offset(param)
    if _under(model, module, _fsdp2_module_types()):
        if shard.dim != 0:
            return QueryPlacement("unsupported", f"FSDP2 sharding the query weight on dim {shard.dim}", shape)

        def locate(m: nn.Module, start=offset[0] * cols):
            p, _ = family.query_param(m)
            return p.to_local().detach().reshape(-1), start

        return QueryPlacement("fsdp", "FSDP2 (fully_shard): W^Q by power iteration on the shards", shape,
                              group=group, locate=locate, transposed=transposed, param_shape=(rows, cols))
    # tensor parallelism: this rank's attention computes the heads of its rows of the query projection
    out_dim = 1 if transposed else 0
    if shard.dim != out_dim:
        return QueryPlacement("unsupported", "tensor parallelism with the query projection split along its input "
                              "(RowwiseParallel on q): every rank would compute every head", shape)
    first, count = offset[out_dim], local_shape[out_dim]
    if first % d or count % d or first + count > h * d:
        return QueryPlacement("unsupported", "tensor parallelism that splits a head, or a fused q/k/v projection "
                              "split across ranks (use separate q/k/v projections)", shape)
    h0, n = first // d, count // d

    def locate_tp(m: nn.Module, n=n):
        p, _ = family.query_param(m)
        local = p.to_local().detach()
        return (local.t() if transposed else local).reshape(n, d, c)

    return QueryPlacement("tensor_parallel", f"tensor parallelism: heads {h0}..{h0 + n - 1} of {h} on this rank",
                          shape, head_offset=h0, local_heads=n, group=group, locate=locate_tp,
                          transposed=transposed, param_shape=(rows, cols))


def _local_offset(param) -> tuple[tuple[int, ...], tuple[int, ...]]:
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return tuple(int(x) for x in shape), tuple(int(x) for x in offset)


# --- the local pieces --------------------------------------------------------------------------------

Block = tuple[int, int, int, int, torch.Tensor]  # (h0, h1, c0, c1, (h1 - h0, D, c1 - c0) float32)


def query_blocks(values: torch.Tensor, start: int, param_shape: tuple[int, int], transposed: bool,
                 shape: tuple[int, int, int]) -> list[Block]:
    """This rank's elements of W^Q as dense blocks over whole heads.

    Args:
        values: (n,) the parameter's row-major elements ``start .. start + n - 1``.
        param_shape: the parameter's (rows, columns).
        transposed: W^Q's rows are the parameter's columns.
        shape: W^Q's (H, D, C).

    Returns:
        blocks ``(h0, h1, c0, c1, B)`` with ``B`` (h1 - h0, D, c1 - c0) float32: W^Q[h0:h1, :, c0:c1]
        where this rank holds the element, 0 where it does not. A contiguous range is at most a
        partial row, a block of whole rows and a partial row, so at most three blocks.
    """
    h, d, c = shape
    rows, cols = param_shape
    n, pos, end = values.numel(), start, start + values.numel()
    out: list[Block] = []
    while pos < end:
        r, k0 = divmod(pos, cols)
        if k0 == 0 and end - pos >= cols:
            nr, k1 = (end - pos) // cols, cols
        else:
            nr, k1 = 1, min(cols, k0 + end - pos)
        seg = values[pos - start: pos - start + nr * (k1 - k0)].view(nr, k1 - k0)
        pos += nr * (k1 - k0)
        # in W^Q coordinates: output rows o (head h = o // D) and input columns
        if transposed:
            o0, o1, c0, c1, t = k0, min(k1, h * d), r, r + nr, seg.t()
        else:
            o0, o1, c0, c1, t = r, min(r + nr, h * d), k0, k1, seg
        if o1 <= o0:
            continue  # the key / value part of a fused projection
        t = t[: o1 - o0]
        h0, h1 = o0 // d, -(-o1 // d)
        if o0 == h0 * d and o1 == h1 * d:
            blk = t.float().reshape(h1 - h0, d, c1 - c0)
        else:
            blk = t.new_zeros((h1 - h0) * d, c1 - c0, dtype=torch.float32)
            blk[o0 - h0 * d: o1 - h0 * d] = t.float()
            blk = blk.view(h1 - h0, d, c1 - c0)
        out.append((h0, h1, c0, c1, blk))
    return out


def _matvec(blocks: list[Block], v: torch.Tensor, d: int) -> torch.Tensor:
    """Partial y = W v over this rank's blocks: v (H, C, k) -> (H, D, k)."""
    y = v.new_zeros(v.shape[0], d, v.shape[2])
    for h0, h1, c0, c1, b in blocks:
        y[h0:h1] += b @ v[h0:h1, c0:c1]
    return y


def _rmatvec(blocks: list[Block], y: torch.Tensor, c: int) -> torch.Tensor:
    """Partial z = W^T y over this rank's blocks: y (H, D, k) -> (H, C, k)."""
    z = y.new_zeros(y.shape[0], c, y.shape[2])
    for h0, h1, c0, c1, b in blocks:
        z[h0:h1, c0:c1] += b.transpose(1, 2) @ y[h0:h1]
    return z


def _comm_device(group: Any, t: torch.Tensor) -> torch.device:
    backend = str(_dist().get_backend(group))
    if backend == "nccl" and t.device.type != "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    if backend == "gloo" and t.device.type != "cpu":
        return torch.device("cpu")
    return t.device


def _all_reduce(parts: list[torch.Tensor], group: Any) -> list[torch.Tensor]:
    """SUM over ``group`` of each tensor, in one all-reduce of their concatenation."""
    dist = _dist()
    flat = torch.cat([p.reshape(-1) for p in parts])
    device = flat.device
    flat = flat.to(_comm_device(group, flat))
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    flat = flat.to(device)
    out, o = [], 0
    for p in parts:
        out.append(flat[o: o + p.numel()].view(p.shape))
        o += p.numel()
    return out


# --- the iteration ---------------------------------------------------------------------------------

class _Member:
    """One FSDP-sharded layer: its placement, module and power-iteration state (replicated)."""

    def __init__(self, layer: Any):
        self.layer = layer
        self.placement: QueryPlacement = layer.placement
        self.h, self.d, self.c = self.placement.shape
        self.power: PowerIteration | None = None

    def blocks(self) -> list[Block]:
        p = self.placement
        values, start = p.locate(self.layer.module)
        return query_blocks(values, start, p.param_shape, p.transposed, p.shape)

    def nan(self, *shape: int, device: torch.device) -> torch.Tensor:
        return torch.full(shape, math.nan, dtype=torch.float32, device=device)


class ShardedPowerIteration:
    """The W^Q power iteration of every FSDP-sharded layer, on the shards (module docstring).

    Every rank of a layer's shard group must call ``start``, ``step``, ``exact`` and
    ``full_weight`` together (they run collectives): the Monitor does, on every monitored step.

    Args:
        layers: attached layers whose ``placement.kind`` is ``"fsdp"``, in layer order.
        block: vectors per head (``MonitorConfig.power_block``).
        on_error: ``on_error(kind, exc)``; a rank whose local part fails still joins every
            collective (sending NaN), so no rank waits and the layer reads NaN everywhere.
    """

    def __init__(self, layers: list, block: int, on_error: Callable[[str, BaseException], None]):
        self.members = [_Member(layer) for layer in layers]
        self.block, self.on_error = block, on_error
        groups: dict[int, list[_Member]] = {}
        self._groups: list[tuple[Any, list[_Member]]] = []
        for m in self.members:
            key = id(m.placement.group)
            if key not in groups:
                groups[key] = []
                self._groups.append((m.placement.group, groups[key]))
            groups[key].append(m)

    def __contains__(self, layer: Any) -> bool:
        return any(m.layer is layer for m in self.members)

    def _member(self, layer: Any) -> _Member:
        return next(m for m in self.members if m.layer is layer)

    def _device(self, members: list[_Member]) -> torch.device:
        return members[0].layer.stats.device if members[0].layer.stats is not None else torch.device("cpu")

    # whole weights, on request only -------------------------------------------------------------
    def _full(self, members: list[_Member], group: Any) -> list[torch.Tensor]:
        """Each member's whole W^Q (H, D, C) float32 on every rank: one all-reduce per layer."""
        device = self._device(members)
        out = []
        for m in members:
            buf = torch.zeros(m.h, m.d, m.c, dtype=torch.float32, device=device)
            try:
                for h0, h1, c0, c1, b in m.blocks():
                    buf[h0:h1, :, c0:c1] += b.to(device)
            except Exception as exc:
                self.on_error("wq_spectral_norm", exc)
                buf.fill_(math.nan)
            out.append(_all_reduce([buf], group)[0])
        return out

    def start(self) -> None:
        """At attach: start vectors from each head's exact top singular vectors (as unsharded)."""
        for group, members in self._groups:
            for m, w in zip(members, self._full(members, group)):
                m.power = PowerIteration(w, block=self.block, seed="svd")

    def exact(self) -> dict[Any, torch.Tensor]:
        """Exact norms by SVD of the assembled weights; the vectors restart from them."""
        out = {}
        for group, members in self._groups:
            for m, w in zip(members, self._full(members, group)):
                out[m.layer] = m.power.exact(w)
        return out

    # the monitored step --------------------------------------------------------------------------
    def step(self, iters: int) -> dict[Any, torch.Tensor]:
        """``iters`` iterations on the shards; each layer's sigma (H,) float32, identical on every rank."""
        out = {}
        for group, members in self._groups:
            device = self._device(members)
            blocks = []
            for m in members:
                try:
                    blocks.append([(h0, h1, c0, c1, b.to(device)) for h0, h1, c0, c1, b in m.blocks()])
                except Exception as exc:
                    self.on_error("wq_spectral_norm", exc)
                    blocks.append(None)  # sends NaN: every rank reads NaN for this layer
            vs = [m.power.v.to(device) for m in members]
            for _ in range(iters):
                ys = _all_reduce([self._part(lambda b, m=m, v=v: _matvec(b, v, m.d), bl, m, m.d, v.shape[2], device)
                                  for m, v, bl in zip(members, vs, blocks)], group)
                zs = _all_reduce([self._part(lambda b, m=m, y=y: _rmatvec(b, y, m.c), bl, m, m.c, y.shape[2], device)
                                  for m, y, bl in zip(members, ys, blocks)], group)
                vs = [_next_vectors(z, v) for z, v in zip(zs, vs)]
            ys = _all_reduce([self._part(lambda b, m=m, v=v: _matvec(b, v, m.d), bl, m, m.d, v.shape[2], device)
                              for m, v, bl in zip(members, vs, blocks)], group)
            for m, v, y in zip(members, vs, ys):
                m.power.v = v
                m.power.sigma = top_eigenvalue(y.transpose(1, 2) @ y).clamp_min(0).sqrt()
                out[m.layer] = m.power.sigma
        return out

    def _part(self, fn, blocks, m: _Member, rows: int, k: int, device: torch.device) -> torch.Tensor:
        if blocks is not None:
            try:
                return fn(blocks)
            except Exception as exc:
                self.on_error("wq_spectral_norm", exc)
        return m.nan(m.h, rows, k, device=device)

    # state ------------------------------------------------------------------------------------------
    def power_of(self, layer: Any) -> PowerIteration:
        return self._member(layer).power


def _next_vectors(z: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """One power-iteration update from z = W^T W v, as ``PowerIteration.step`` does it."""
    q = orthonormalize(z)
    ok = torch.isfinite(q).all(dim=2).all(dim=1) & (q.abs().sum(dim=(1, 2)) > 0)
    return torch.where(ok[:, None, None], q, v)
