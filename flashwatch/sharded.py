"""W^Q of a sharded model: where each rank's piece of it lies, and power iteration on the pieces.

How a rank holds a layer's query weight is decided once, at attach, from the model's structure
(the same on every rank); ``placement_of`` returns a ``QueryPlacement`` of one of these kinds:

- ``"whole"``: a plain tensor, the whole W^Q on every rank (single process, DDP): measured as
  on one device (``flashwatch.wq``).
- ``"fsdp"``: FSDP2 (``fully_shard``: the parameter is a DTensor sharded on dim 0) or FSDP1
  with ``use_orig_params=True`` (the parameter is a 1-D view of this rank's part of FSDP's
  flat shard). Either way a rank holds one contiguous range of the parameter's row-major
  elements, possibly empty; ``flashwatch.sharded_power`` runs the power iteration on these
  pieces, with all-reduces over the shard group and no weight gathered. FSDP2 over tensor
  parallelism (torchtitan's 2-D mesh) is this kind too, over the heads of this rank's
  tensor-parallel shard: the range lies in that shard, the group is the data-parallel one.
- ``"tensor_parallel"``: a DTensor parameter outside FSDP, the query projection sharded by
  rows (``ColwiseParallel``, torchtitan's layout): each rank holds whole heads
  ``[head_offset, head_offset + local_heads)`` and its attention computes only those. It
  measures its own heads from the local shard (no collective); the Monitor files them under
  their global head indices.
- ``"unsupported"``: anything else (FSDP1 without ``use_orig_params``, DeepSpeed ZeRO-3, a
  DTensor sharded on more dimensions than FSDP2 over tensor parallelism, a fused q/k/v
  projection split across ranks):
  the W^Q norms of such a layer are NaN, with one warning saying why.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn


__all__ = ["QueryPlacement", "QueryWeight", "placement_of", "KINDS"]

KINDS = ("whole", "fsdp", "tensor_parallel", "unsupported")


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
        heads_group: the process group over which the heads are split (tensor parallelism,
            alone or under FSDP2), whose ranks' heads make up the layer; None where every rank
            computes every head.
        locate: ``"fsdp"``: ``locate(module) -> (values (n,), start)``: this rank's elements of
            the parameter (under tensor parallelism: of this rank's tensor-parallel shard of it),
            row-major, from element ``start`` on; ``"tensor_parallel"``:
            ``locate(module) -> (local heads, D, C)``; ``"whole"``: ``locate(module) -> (H, D, C)``.
        transposed: W^Q's rows are the parameter's columns (Hugging Face GPT-2's Conv1D).
        param_shape: the parameter's global (rows, columns); under FSDP2 over tensor
            parallelism, those of this rank's tensor-parallel shard.
    """

    kind: str
    reason: str
    shape: tuple[int, int, int]
    head_offset: int = 0
    local_heads: int = 0
    group: Any = None
    heads_group: Any = None
    locate: Callable[[nn.Module], Any] | None = field(default=None, repr=False)
    transposed: bool = False
    param_shape: tuple[int, int] = (0, 0)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
        if not self.local_heads:
            self.local_heads = self.shape[0]
        if self.kind == "tensor_parallel" and self.heads_group is None:
            self.heads_group = self.group

    @property
    def local_shape(self) -> tuple[int, int, int]:
        """W^Q's (heads on this rank, D, C)."""
        return (self.local_heads, self.shape[1], self.shape[2])


class QueryWeight:
    """``attach(model, attention={name: QueryWeight})`` entry for a sharded model: a query-weight
    function that carries its ``placement``. It returns a zero-stride placeholder of the local
    heads' shape (no memory, no weight read), or, under tensor parallelism, the local heads'
    weight (a view of the local shard). ``family``: the model family the module was recognised
    as (``flashwatch.families``), which the layer keeps."""

    def __init__(self, placement: QueryPlacement, device: torch.device, family: str | None = None):
        self.placement, self.device, self.family = placement, device, family

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
    """How this rank holds ``module``'s W^Q (``family``: a ``flashwatch.families.Family``).

    Never raises: a layout that cannot be read (a torch without the DTensor helpers used here,
    an FSDP internal that moved) is ``"unsupported"``, with the error as its reason."""
    try:
        return _placement(model, module, family, shape)
    except Exception as exc:  # monitoring never stops a run from starting over W^Q
        return QueryPlacement("unsupported", f"the query weight's layout could not be read ({type(exc).__name__}: "
                              f"{exc})", shape)


def _placement(model: nn.Module, module: nn.Module, family: Any, shape: tuple[int, int, int]) -> QueryPlacement:
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


def _is_shard(placement: Any) -> bool:
    """``Shard`` or FSDP2's ``_StridedShard`` (FSDP over tensor parallelism), which is not a
    ``Shard`` subclass in every torch."""
    from torch.distributed.tensor import Shard

    return isinstance(placement, Shard) or (type(placement).__name__ == "_StridedShard" and hasattr(placement, "dim"))


def _chunk(size: int, parts: int, index: int) -> tuple[int, int]:
    """``torch.chunk``'s piece ``index`` of ``size`` rows in ``parts`` (DTensor's ``Shard``): (first, count)."""
    step = -(-size // parts)
    first = min(index * step, size)
    return first, max(0, min(step, size - first))


def _dtensor_placement(model, module, family, shape, param, transposed) -> QueryPlacement:
    from torch.distributed.tensor import Replicate

    mesh, placements = param.device_mesh, tuple(param.placements)
    shards = [(i, p) for i, p in enumerate(placements) if _is_shard(p)]
    if any(not (_is_shard(p) or isinstance(p, Replicate)) for p in placements) or not 1 <= len(shards) <= 2:
        return QueryPlacement("unsupported", f"a DTensor query weight placed {placements} (a shard on one mesh "
                              "dimension, or FSDP2 over tensor parallelism on two, is supported)", shape)
    fsdp2 = _under(model, module, _fsdp2_module_types())
    if len(shards) == 2:
        if not fsdp2:
            return QueryPlacement("unsupported", f"a DTensor query weight placed {placements} outside FSDP2",
                                  shape)
        return _fsdp_over_tensor_parallel(family, shape, param, transposed, shards)
    mesh_dim, shard = shards[0]
    group = mesh.get_group(mesh_dim)
    rows, cols = (int(x) for x in param.shape)
    local_shape, offset = _local_offset(param)
    if fsdp2:
        if shard.dim != 0:
            return QueryPlacement("unsupported", f"FSDP2 sharding the query weight on dim {shard.dim}", shape)

        def locate(m: nn.Module, start=offset[0] * cols):
            p, _ = family.query_param(m)
            return p.to_local().detach().reshape(-1), start

        return QueryPlacement("fsdp", "FSDP2 (fully_shard): W^Q by power iteration on the shards", shape,
                              group=group, locate=locate, transposed=transposed, param_shape=(rows, cols))
    heads = _tensor_parallel_heads(shape, transposed, shard.dim, offset, local_shape)
    if isinstance(heads, str):
        return QueryPlacement("unsupported", heads, shape)
    h0, n = heads
    d, c = shape[1], shape[2]

    def locate_tp(m: nn.Module, n=n):
        p, _ = family.query_param(m)
        local = p.to_local().detach()
        return (local.t() if transposed else local).reshape(n, d, c)

    return QueryPlacement("tensor_parallel", f"tensor parallelism: heads {h0}..{h0 + n - 1} of {shape[0]} on this "
                          "rank", shape, head_offset=h0, local_heads=n, group=group,
                          locate=locate_tp, transposed=transposed, param_shape=(rows, cols))


def _tensor_parallel_heads(shape, transposed: bool, dim: int, offset, local_shape) -> tuple[int, int] | str:
    """The heads ``(first, count)`` of a tensor-parallel shard on ``dim`` at ``offset`` of
    ``local_shape`` (global coordinates), or why the layout is not one of whole heads per rank."""
    h, d, _ = shape
    out_dim = 1 if transposed else 0
    if dim != out_dim:
        return ("tensor parallelism with the query projection split along its input (RowwiseParallel on q): every "
                "rank would compute every head")
    first, count = offset[out_dim], local_shape[out_dim]
    if first % d or count % d or first + count > h * d:
        return ("tensor parallelism that splits a head, or a fused q/k/v projection split across ranks (use "
                "separate q/k/v projections)")
    return first // d, count // d


def _fsdp_over_tensor_parallel(family, shape, param, transposed, shards) -> QueryPlacement:
    """FSDP2 over tensor parallelism (torchtitan's 2-D mesh): the tensor-parallel dimension (the
    last sharded one) gives this rank's heads, as under tensor parallelism alone; FSDP cuts that
    shard (the heads' rows of the parameter) on dim 0 among the data-parallel ranks, whose power
    iteration runs on the pieces as under FSDP alone, over the data-parallel group."""
    h, d, c = shape
    mesh = param.device_mesh
    (dp_dim, dp_shard), (tp_dim, tp_shard) = shards
    rows, cols = (int(x) for x in param.shape)
    if dp_shard.dim != 0:
        return QueryPlacement("unsupported", f"FSDP2 sharding the query weight on dim {dp_shard.dim}", shape)
    # the tensor-parallel shard: this rank's rows (or columns, for a transposed weight) of the parameter
    tp_first, tp_count = _chunk(param.shape[tp_shard.dim], mesh.size(tp_dim), mesh.get_local_rank(tp_dim))
    tp_offset = [0, 0]
    tp_shape = [rows, cols]
    tp_offset[tp_shard.dim], tp_shape[tp_shard.dim] = tp_first, tp_count
    heads = _tensor_parallel_heads(shape, transposed, tp_shard.dim, tp_offset, tp_shape)
    if isinstance(heads, str):
        return QueryPlacement("unsupported", heads, shape)
    h0, n = heads
    # FSDP's piece of that shard: whole rows of the shard, contiguous in its row-major order
    local_shape, offset = _local_offset(param)
    first_row = offset[0] - tp_offset[0]
    if local_shape[1] != tp_shape[1] or offset[1] != tp_offset[1] or not 0 <= first_row <= tp_shape[0] \
            or first_row + local_shape[0] > tp_shape[0]:
        return QueryPlacement("unsupported", f"FSDP2 over tensor parallelism placed {tuple(param.placements)}: "
                              "this rank's piece is not whole rows of its tensor-parallel shard", shape)

    def locate(m: nn.Module, start=first_row * tp_shape[1]):
        p, _ = family.query_param(m)
        return p.to_local().detach().reshape(-1), start

    return QueryPlacement("fsdp", f"FSDP2 over tensor parallelism: heads {h0}..{h0 + n - 1} of {h} on this rank, "
                          "W^Q by power iteration on their FSDP shards", shape, head_offset=h0, local_heads=n,
                          group=mesh.get_group(dp_dim), heads_group=mesh.get_group(tp_dim), locate=locate,
                          transposed=transposed, param_shape=(tp_shape[0], tp_shape[1]))


def _local_offset(param) -> tuple[tuple[int, ...], tuple[int, ...]]:
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return tuple(int(x) for x in shape), tuple(int(x) for x in offset)
