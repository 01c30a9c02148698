"""Power iteration on the shards of an FSDP-sharded W^Q (layouts: ``flashwatch.sharded``).

A rank holds one contiguous range of the query projection's row-major elements (FSDP2's dim-0
shard, FSDP1's ``use_orig_params`` view), possibly empty or cutting a row or a head.
``query_blocks`` cuts it into at most three dense blocks over whole heads. Each iteration
V <- orth(W^T W V) then runs as two partial products, y = W V (H, D, k) and z = W^T y (H, C, k),
each completed by one SUM all-reduce over the shard group, batched over every layer of the
group; the Rayleigh-Ritz estimate needs one more y: 2 * ``power_iters`` + 1 all-reduces of
sum_layers H * (D + C) * k float32 per monitored step. No rank gathers a weight; the vectors
and norms are bitwise identical on every rank (they are computed from all-reduce results), and
equal to an unsharded run's up to float32 summation order. Under FSDP2 over tensor parallelism
the same runs on the heads of each rank's tensor-parallel shard, over the data-parallel group.

The exact norms (``power_exact_every``, ``Monitor.wq_spectral_norms(exact=True)``) and the
start vectors at attach need each head's SVD: there, and only there, a layer's W^Q is
assembled on every rank (one all-reduce of a zero-filled (H, D, C) buffer per layer, one layer
at a time), as a forward pass assembles it anyway.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

from .chain import pair_from_products
from .sharded import QueryPlacement
from .signals import PowerIteration, next_vectors, top_eigenvalue

__all__ = ["ShardedPowerIteration", "query_blocks", "all_reduce_sum"]


def _dist():
    import torch.distributed as dist

    return dist


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
    pos, end = start, start + values.numel()
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


def all_reduce_sum(parts: list[torch.Tensor], group: Any) -> list[torch.Tensor]:
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
        self.h, self.d, self.c = self.placement.local_shape  # this rank's heads (all, unless tensor parallel)
        self.power: PowerIteration | None = None
        self.y: torch.Tensor | None = None  # W V (H, D, k) for the current vectors: the W^Q-error chain's pair

    def blocks(self) -> list[Block]:
        p = self.placement
        values, start = p.locate(self.layer.module)
        return query_blocks(values, start, p.param_shape, p.transposed, p.local_shape)

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
            out.append(all_reduce_sum([buf], group)[0])
        return out

    def start(self) -> None:
        """At attach: start vectors from each head's exact top singular vectors (as unsharded)."""
        for group, members in self._groups:
            for m, w in zip(members, self._full(members, group)):
                m.power = PowerIteration(w, block=self.block, seed="svd")
                m.y = w @ m.power.v

    def exact(self) -> dict[Any, torch.Tensor]:
        """Exact norms by SVD of the assembled weights; the vectors restart from them."""
        out = {}
        for group, members in self._groups:
            for m, w in zip(members, self._full(members, group)):
                out[m.layer] = m.power.exact(w)
                m.y = w.to(m.power.v.device) @ m.power.v
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
                ys = all_reduce_sum([self._part(lambda b, m=m, v=v: _matvec(b, v, m.d), bl, m, m.d, v.shape[2], device)
                                  for m, v, bl in zip(members, vs, blocks)], group)
                zs = all_reduce_sum([self._part(lambda b, m=m, y=y: _rmatvec(b, y, m.c), bl, m, m.c, y.shape[2], device)
                                  for m, y, bl in zip(members, ys, blocks)], group)
                vs = [next_vectors(z, v) for z, v in zip(zs, vs)]
            ys = all_reduce_sum([self._part(lambda b, m=m, v=v: _matvec(b, v, m.d), bl, m, m.d, v.shape[2], device)
                              for m, v, bl in zip(members, vs, blocks)], group)
            for m, v, y in zip(members, vs, ys):
                m.power.v = v
                m.power.sigma = top_eigenvalue(y.transpose(1, 2) @ y).clamp_min(0).sqrt()
                m.y = y
                out[m.layer] = m.power.sigma
        return out

    def pairs(self) -> dict[Any, tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's top singular pairs (u (H, D), v (H, C)) from its current vectors and their
        products (``flashwatch.chain.pair_from_products``), identical on every rank; no collective."""
        return {m.layer: pair_from_products(m.y, m.power.v) for m in self.members if m.y is not None}

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
