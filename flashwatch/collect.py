"""The device half of a monitored step: pack every reading, combine over ranks, copy to the host once.

Per layer the readings are one (F, H) float64 device tensor: the rows of
``AttentionStats.packed()`` (``STAT_FIELDS``) then the W^Q-error chain's (``CHAIN_FIELDS``).
All layers side by side, the W^Q norms, the loss and the gradient norm (when they are device
tensors) go to the host in ONE transfer: pinned and asynchronous on CUDA with
``async_transfer`` (a CUDA event marks its end; the Monitor decides one optimizer step later),
a plain ``.cpu()`` otherwise. Under ``torch.distributed`` the packed vector is first combined
over the ranks (``flashwatch.distributed.Reducer``: one SUM all-reduce), so every rank decides
on identical host data.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import numpy as np
import torch

from .attach import AttentionLayer
from .chain import FIELDS as CHAIN_FIELDS
from .distributed import Reducer
from .kernels import STAT_FIELDS

__all__ = ["FIELDS", "CHAIN_MEAN_ROWS", "Pending", "Readings", "Collector"]

FIELDS = tuple(STAT_FIELDS) + tuple(CHAIN_FIELDS)  # rows of a layer's packed readings
# the chain's rows are identical on every rank that holds the head (the Monitor averages the
# accumulators over those ranks first), so their sum over the ranks is divided back by their number
# (the world size, or fewer under tensor parallelism: ``Reducer.owners``)
CHAIN_MEAN_ROWS = tuple(FIELDS.index(n) for n in CHAIN_FIELDS)


@dataclasses.dataclass
class Readings:
    """A monitored step's values on the host: ``values`` (len(FIELDS), total heads) float64 and
    ``sigma`` (total heads,), layers side by side in layer order."""

    values: torch.Tensor
    sigma: torch.Tensor
    loss: float
    grad_norm: float
    loss_given: bool
    grad_norm_given: bool
    grad_units_unknown: bool = False  # the gradients' loss scale is unknown: the scaler skipped the step, ...

    def per_layer(self, heads: list[int]) -> list[tuple[dict[str, np.ndarray], np.ndarray]]:
        """Each layer's readings, ``{field: (H,) float64 array}`` over ``FIELDS``, and W^Q norms
        (H,), for layers of ``heads`` heads side by side: views of ``values`` and ``sigma`` (numpy
        arrays, which the host half computes with)."""
        values = self.values.to(torch.float64).numpy()
        sigma = self.sigma.to(torch.float64).numpy()
        out, offset = [], 0
        for h in heads:
            block = values[:, offset: offset + h]
            out.append((dict(zip(FIELDS, block)), sigma[offset: offset + h]))
            offset += h
        return out


@dataclasses.dataclass
class Pending:
    """A monitored step between its device half and its host half."""

    step: int
    host: torch.Tensor  # the packed values, on the host (being filled while event is set)
    event: Any  # torch.cuda.Event marking the end of the copy, or None when host is already filled
    finish: Callable[[torch.Tensor], "Readings | None"]
    variants: list | None = None  # what each layer ran at this step (the detectors judge delta drift by it)

    def readings(self) -> Readings | None:
        if self.event is not None:
            self.event.synchronize()  # the copy was started a whole optimizer step ago
        return self.finish(self.host)


def start_host_copy(values: torch.Tensor, async_transfer: bool) -> tuple[torch.Tensor, Any]:
    """The step's one device->host transfer: (host tensor, CUDA event or None).

    On CUDA with ``async_transfer`` the copy goes to pinned memory without waiting and an event
    marks its end. Both are put on the current stream of the device that holds ``values`` (the
    stream that produced the statistics), whichever device is current: a device-to-host copy
    runs on its source device's stream, and an event recorded on another device's stream (the
    model on ``cuda:1``, the current device ``cuda:0``) would be reached before the copy is done.
    Otherwise ``.cpu()``."""
    if values.is_cuda and async_transfer:
        with torch.cuda.device(values.device):
            stream = torch.cuda.current_stream(values.device)
            host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            with torch.cuda.stream(stream):
                host.copy_(values, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        return host, event
    return values.cpu(), None


class Collector:
    """Packs, combines and copies monitored steps (see the module docstring).

    Args:
        layers: the attached layers.
        reducer: the ``Reducer`` under ``torch.distributed``, else None.
        async_transfer: ``MonitorConfig.async_transfer``.
        on_error: ``on_error(kind, exc)`` for a failure (logged once per kind, counted).
        on_combined: ``on_combined(reduced, step)``: checks that only a distributed step has
            (ranks at different steps, variants that differ, W^Q norms that differ).
    """

    def __init__(self, layers: list[AttentionLayer], reducer: Reducer | None, async_transfer: bool,
                 on_error: Callable[[str, BaseException], None], on_combined: Callable[[Any, int], bool]):
        self.layers, self.reducer, self.async_transfer = layers, reducer, async_transfer
        self.on_error, self.on_combined = on_error, on_combined

    @property
    def heads(self) -> list[int]:
        return [layer.num_heads for layer in self.layers]

    def collect(self, t: int, read: Callable[[], tuple[torch.Tensor, list[torch.Tensor]]], loss: Any,
                grad_norm: Any, variant_codes: list[int], grad_units_unknown: torch.Tensor | None = None) -> Pending:
        """Start monitored step ``t``'s host copy. ``read()`` gives every layer's device readings
        side by side, (len(FIELDS), total heads) in layer order, and each layer's (H,) W^Q norms;
        under ``torch.distributed`` a failure there still takes part in the collective (as a
        "failed" vector). ``grad_units_unknown``: a 0-d device boolean, whether the gradients'
        loss scale is unknown (``flashwatch.loss_scale``); None without a loss scaler."""
        if self.reducer is not None and self.layers:
            return self._combined(t, read, loss, grad_norm, variant_codes, grad_units_unknown)
        packed, sigmas = read()
        return self._local(t, packed, sigmas, loss, grad_norm, grad_units_unknown)

    def _local(self, t, packed, sigmas, loss, grad_norm, grad_units_unknown=None) -> Pending:
        total, nf = sum(self.heads), len(FIELDS)
        parts: list[torch.Tensor] = []
        device = None
        if self.layers:
            device = packed.device
            parts.append(packed.reshape(-1))  # (F * sum H,)
            parts.append(_side_by_side(sigmas, device))  # (sum H,)
        on_device = []  # names of the scalars that ride in the transfer, in order
        for name, value in (("loss", loss), ("grad_norm", grad_norm), ("grad_units_unknown", grad_units_unknown)):
            if isinstance(value, torch.Tensor):
                if device is None:
                    device = value.device
                parts.append(value.detach().reshape(1).to(device=device, dtype=torch.float64))
                on_device.append(name)
        # the one host transfer of the step
        host, event = start_host_copy(torch.cat(parts), self.async_transfer) if parts \
            else (torch.zeros(0, dtype=torch.float64), None)
        plain = {name: (math.nan if value is None else float(value))
                 for name, value in (("loss", loss), ("grad_norm", grad_norm)) if not isinstance(value, torch.Tensor)}
        given = (loss is not None, grad_norm is not None)

        def finish(h: torch.Tensor) -> Readings:
            values = h[: nf * total].view(nf, total)
            sigma = h[nf * total: nf * total + total]
            tail = dict(zip(on_device, h[nf * total + total:].tolist()))
            tail.update(plain)
            return Readings(values, sigma, tail["loss"], tail["grad_norm"], *given,
                            grad_units_unknown=bool(tail.get("grad_units_unknown", 0.0)))

        return Pending(t, host, event, finish)

    def _combined(self, t, read, loss, grad_norm, variant_codes, grad_units_unknown=None) -> Pending:
        """Combined over the ranks. The collective runs whatever happened on this rank before it (a
        failure sends a "failed" vector), so no rank is left waiting in it; everything after it is
        decided on identical host data, hence identically on every rank."""
        r = self.reducer
        device = self.layers[0].stats.device
        try:
            packed, sigmas = read()
            packed = packed.to(device)
            sigma = _side_by_side(sigmas, device)
            local = r.pack(packed, sigma, loss, grad_norm, t, variant_codes, grad_units_unknown)
        except Exception as exc:
            self.on_error("step", exc)
            local = r.failed_local(device)
        host, event = start_host_copy(r.all_reduce(local), self.async_transfer)
        return Pending(t, host, event, lambda h: self._combined_finish(t, h))

    def _combined_finish(self, t: int, host: torch.Tensor) -> Readings | None:
        red = self.reducer.unpack(host)
        if not self.on_combined(red, t):
            return None
        values = red.stats.clone()
        for row in CHAIN_MEAN_ROWS:
            values[row] /= self.reducer.owners  # each head's readings came from the ranks that hold it
        return Readings(values, red.sigma, red.loss, red.grad_norm, red.loss_given, red.grad_norm_given,
                        grad_units_unknown=red.grad_units_unknown > 0)


def _side_by_side(sigmas: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The layers' (H,) W^Q norms as one float64 vector on ``device``: joined first (float32 and
    float64 parts join as float64, exactly), then converted once."""
    return torch.cat([s.to(device) for s in sigmas]).to(torch.float64)
