"""One monitored step's readings -> the signals the detectors judge: the one builder.

The Monitor (live) and the replay of a recording (``flashwatch.replay``) both turn a
monitored step's raw readings into ``StepSignals`` here, so a replay sees what the Monitor saw.

Raw readings of one layer (``LayerReading``), every tensor (H,) float64 on the host (or a
float64 numpy array):

- ``stats``: the rows of ``AttentionStats.packed()`` by field name (rows, repeated-max counts,
  max logit, delta-error sums);
- ``sigma``: the W^Q spectral norm per head;
- ``chain``: the W^Q-gradient error readings by field name (``flashwatch.chain.FIELDS``), or
  None where they were not measured;
- ``low_precision`` and ``variant``: what the layer ran at that step;
- ``calls``: (attention calls, measured calls) of the layer at that step, or None where not
  counted; the layer's coverage is their ratio (0 without a call: nothing of the layer's
  attention was measured).

Host state kept across steps (``SignalBuilder``; ``state_dict`` for an exact resume): per
layer the drift sums (``DriftTracker``), the last W+1 spectral norms (``SigmaHistory``), the
cumulative W^Q-error push, and the last W values of the series whose windowed trends are
reported (log max logit, log sigma, BF16 repeated-max ratio). Consecutive layers with the same
head count keep it as (layers, heads) arrays and are computed together, one numpy or torch
call per quantity for all of them (a monitored step's host half is a few hundred such calls,
and a call on a small array costs its dispatch, not its arithmetic); ``state_dict`` gives it
per layer in the formats of ``DriftTracker``, ``SigmaHistory`` and ``Ring``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from .detectors import LayerSignals, StepSignals
from .signals import (DriftTracker, Ring, SigmaHistory, drift_z_array, host_tensor, linear_slope_array,
                      ratio_to_median_array)

__all__ = ["LayerReading", "SignalBuilder", "TREND_SERIES"]

F64 = torch.float64
# trends: least-squares slope over the last `window` monitored steps, per 1,000 optimizer steps
TREND_SERIES = ("log_max_logit", "log_wq_sigma", "repeated_max_ratio_bf16")


@dataclass
class LayerReading:
    """One layer's raw readings at one monitored step (see the module docstring); a reading may
    also be a float64 numpy array (H,)."""

    stats: dict[str, torch.Tensor]
    sigma: torch.Tensor
    chain: dict[str, torch.Tensor] | None = None
    low_precision: bool | None = None
    variant: str | None = None
    calls: tuple[int, int] | None = None


def _coverage(calls: tuple[int, int] | None) -> float:
    """Measured calls / attention calls; 0 where no attention call of the layer was seen at the
    monitored step (attention code flashwatch does not reach measures nothing); NaN where calls
    were not counted (recordings made before coverage was)."""
    if calls is None:
        return math.nan
    return calls[1] / calls[0] if calls[0] else 0.0


def _array(t: torch.Tensor | np.ndarray) -> np.ndarray:
    """A reading as a float64 array (a view of a float64 CPU tensor's memory)."""
    if isinstance(t, np.ndarray):
        return t.astype(np.float64, copy=False)
    return t.detach().to(device="cpu", dtype=F64).numpy()


def _stack(rows: list, h: int) -> np.ndarray:
    """(L, H) float64 from L readings of (H,), None for one not measured (NaN)."""
    parts = [np.full(h, np.nan) if r is None else _array(r) for r in rows]
    if any(p.shape != (h,) for p in parts):
        raise ValueError(f"readings of shapes {sorted({p.shape for p in parts})} for layers of {h} heads")
    return np.concatenate(parts).reshape(len(parts), h)


def _add(target: np.ndarray, rows: np.ndarray, layers: np.ndarray) -> None:
    """target[l] += rows[l] for the layers of the (L,) mask, in place."""
    if layers.all():
        target += rows
    elif layers.any():
        target[layers] += rows[layers]


class _Rings:
    """The last ``length`` rows of L layers' (length, width) series, each layer with its own
    write position (a layer that is not pushed at a step keeps its rows): the batched ``Ring``."""

    def __init__(self, layers: int, length: int, width: int):
        self.buffer = np.zeros((layers, length, width))
        self.pos = np.zeros(layers, dtype=np.int64)
        self.filled = np.zeros(layers, dtype=np.int64)

    def push(self, rows: np.ndarray, layers: np.ndarray) -> None:
        """Write rows[l] (L, width) for the layers of the (L,) mask."""
        length = self.buffer.shape[1]
        if layers.all() and (self.pos == self.pos[0]).all():
            self.buffer[:, self.pos[0]] = rows
        else:
            idx = np.flatnonzero(layers)
            self.buffer[idx, self.pos[idx]] = rows[idx]
        if layers.all():
            self.pos = (self.pos + 1) % length
            self.filled = np.minimum(self.filled + 1, length)
        else:
            self.pos = np.where(layers, (self.pos + 1) % length, self.pos)
            self.filled = np.where(layers, np.minimum(self.filled + 1, length), self.filled)

    @property
    def full(self) -> np.ndarray:
        return self.filled == self.buffer.shape[1]

    def newest(self) -> np.ndarray:
        """(L, width): each layer's row pushed last (a layer must hold one)."""
        return self.buffer[np.arange(len(self.pos)), self.pos - 1]

    def oldest(self) -> np.ndarray:
        """(L, width): each layer's oldest row kept (a layer must hold one)."""
        return self.buffer[np.arange(len(self.pos)), np.where(self.full, self.pos, 0)]

    def groups(self, layers: np.ndarray):
        """(layer indices, (n, filled, width) rows in chronological order) for the layers of the mask,
        in groups of layers at the same position (one group while they were pushed alike)."""
        keys: dict[tuple[int, int], list[int]] = {}
        for i in np.flatnonzero(layers).tolist():
            keys.setdefault((int(self.pos[i]), int(self.filled[i])), []).append(i)
        length = self.buffer.shape[1]
        for (pos, filled), idx in keys.items():
            b = self.buffer if len(idx) == len(self.pos) else self.buffer[idx]
            if filled < length:
                yield idx, np.ascontiguousarray(b[:, :filled])  # torch sums a contiguous block as the Ring's
            else:
                yield idx, np.concatenate([b[:, pos:], b[:, :pos]], axis=1)

    def layer(self, i: int, ring: Ring) -> Ring:
        """Layer i's rows as a ``Ring`` (``ring``, filled in place)."""
        ring.buffer = torch.from_numpy(self.buffer[i].copy())
        ring.pos, ring.filled = int(self.pos[i]), int(self.filled[i])
        return ring

    def load_layer(self, i: int, ring: Ring) -> None:
        self.buffer[i] = ring.buffer.numpy()
        self.pos[i], self.filled[i] = ring.pos, ring.filled


class _Block:
    """Host-side state of consecutive layers of one head count, kept as (L, H) arrays so that a
    step's signals of all of them are computed at once."""

    def __init__(self, first: int, layers: int, heads: int, window: int):
        self.first, self.num_layers, self.heads, self.window = first, layers, heads, window
        shape = (layers, heads)
        self.drift_cumulative, self.drift_sum_sq = np.zeros(shape), np.zeros(shape)
        self.drift_count = np.zeros(shape, dtype=np.int64)
        self.drift_ring = _Rings(layers, window, heads)
        self.sigma = _Rings(layers, window + 1, heads)
        self.push_cumulative, self.push_true_cumulative = np.zeros(shape), np.zeros(shape)
        self.trend = {name: _Rings(layers, window, heads) for name in TREND_SERIES}
        self.trend_steps = _Rings(layers, window, 1)

    # --- state, per layer in the format of DriftTracker / SigmaHistory / Ring -------------------
    def state_dict(self, i: int) -> dict:
        h, w = self.heads, self.window
        drift = DriftTracker(h, w)
        drift.cumulative = torch.from_numpy(self.drift_cumulative[i].copy())
        drift.sum_sq = torch.from_numpy(self.drift_sum_sq[i].copy())
        drift.count = torch.from_numpy(self.drift_count[i].copy())
        self.drift_ring.layer(i, drift.ring)
        sigma = SigmaHistory(h, w)
        self.sigma.layer(i, sigma.ring)
        return {"drift": drift.state_dict(), "sigma": sigma.state_dict(),
                "push_cumulative": torch.from_numpy(self.push_cumulative[i].copy()),
                "push_true_cumulative": torch.from_numpy(self.push_true_cumulative[i].copy()),
                "trend": {k: r.layer(i, Ring(w, h)).state_dict() for k, r in self.trend.items()},
                "trend_steps": self.trend_steps.layer(i, Ring(w, 1)).state_dict()}

    def load_state_dict(self, i: int, state: dict) -> None:
        h, w = self.heads, self.window
        # loaded into the per-layer classes first: they check the shapes and bring tensors saved on
        # another device or dtype back to CPU float64
        drift = DriftTracker(h, w)
        drift.load_state_dict(state["drift"])
        sigma = SigmaHistory(h, w)
        sigma.load_state_dict(state["sigma"])
        self.drift_cumulative[i], self.drift_sum_sq[i] = drift.cumulative.numpy(), drift.sum_sq.numpy()
        self.drift_count[i] = drift.count.numpy()
        self.drift_ring.load_layer(i, drift.ring)
        self.sigma.load_layer(i, sigma.ring)
        if "push_cumulative" in state:  # states saved before the W^Q-error chain existed have none
            self.push_cumulative[i] = host_tensor(state["push_cumulative"], F64).numpy()
            self.push_true_cumulative[i] = host_tensor(state["push_true_cumulative"], F64).numpy()
            for k, r in self.trend.items():
                ring = Ring(w, h)
                ring.load_state_dict(state["trend"][k])
                r.load_layer(i, ring)
            ring = Ring(w, 1)
            ring.load_state_dict(state["trend_steps"])
            self.trend_steps.load_layer(i, ring)

    # --- one step ---------------------------------------------------------------------------------
    def build(self, step: int, readings: list[LayerReading], grad_units_unknown: bool = False) -> list[LayerSignals]:
        h, nl = self.heads, self.num_layers
        names = {name for r in readings for name in r.stats}
        f = {name: _stack([r.stats.get(name) for r in readings], h) for name in names}
        rows = f["rows"]
        seen = rows.sum(axis=1) > 0  # (L,)
        counted = rows > 0
        safe_rows = np.where(counted, rows, 1.0)
        nan = np.full((nl, h), np.nan)

        # a head whose scores were not finite (NaN or inf: its max logit says so) has no repeated
        # maxima to count: a comparison with NaN is false, so its rows would read as none repeated.
        # (Not the delta error's NaN: a NaN loss makes every head's NaN, scores finite or not.)
        scored = counted & np.isfinite(f["max_logit"])

        def ratio(name: str) -> np.ndarray:
            if name not in f:  # a recording made before this count existed: not measured
                return nan
            return np.where(scored, f[name] / safe_rows, nan)

        # the delta error is not measured at this step where calls were counted and none measured in
        # full (attention dropout: scores measured, delta error not), or where the gradients' loss
        # scale is unknown (a step the loss scaler skipped)
        delta_seen = seen & np.array([r.calls is None or r.calls[1] > 0 for r in readings]) & (not grad_units_unknown)
        e = f["delta_error"]
        finite = np.isfinite(e)
        e0 = np.where(finite, e, 0.0)
        _add(self.drift_cumulative, e0, delta_seen)
        _add(self.drift_sum_sq, e0 * e0, delta_seen)
        _add(self.drift_count, finite.astype(np.int64), delta_seen)
        self.drift_ring.push(e0, delta_seen)
        # heads with a measured delta error at this step and a sum of them so far
        now_measured = (self.drift_count > 0) & delta_seen[:, None]
        sigma = _stack([r.sigma for r in readings], h)
        self.sigma.push(sigma, np.ones(nl, dtype=bool))
        growth = np.where(self.sigma.full[:, None], self.sigma.newest() / self.sigma.oldest(), np.nan)
        max_logit = np.where(counted, f["max_logit"], nan)
        rm16 = ratio("repeated_max_rows_bf16")

        measured_chain = seen & np.array([r.chain is not None for r in readings])
        chain = {name: _stack([r.chain[name] if r.chain is not None else None for r in readings], h)
                 for name in ("push", "push_true", "alignment", "coherence")}
        push, push_true = chain["push"], chain["push_true"]
        _add(self.push_cumulative, np.nan_to_num(push, nan=0.0), measured_chain)
        _add(self.push_true_cumulative, np.nan_to_num(push_true, nan=0.0), measured_chain)
        push_measured = np.isfinite(push)
        share_den = np.abs(self.push_true_cumulative)
        push_share = np.where(push_measured & (share_den > 0),
                              self.push_cumulative / np.maximum(share_den, 1e-300), nan)
        on_chain = measured_chain[:, None]
        wq_error = {"push": push, "push_true": push_true,
                    "push_cumulative": np.where(push_measured, self.push_cumulative, nan), "push_share": push_share,
                    "alignment": chain["alignment"], "coherence": chain["coherence"]}
        wq_error = {k: np.where(on_chain, v, nan) for k, v in wq_error.items()}

        # torch's log (numpy's may differ in the last bit), one call for both series; the log of a
        # max logit <= 0 (a head's scores all negative) is not defined: NaN, so the growth rate of a
        # window holding one reads NaN, not a slope of log(1e-30) against log(30)
        both = np.stack([max_logit, sigma])
        logs = torch.from_numpy(np.where(both > 0, both, np.nan)).log().numpy()
        trends = self._trends(step, seen, {"log_max_logit": logs[0], "log_wq_sigma": logs[1],
                                           "repeated_max_ratio_bf16": rm16})
        window_z = np.full((nl, h), np.nan)
        for idx, w in self.drift_ring.groups(self.drift_ring.filled > 0):
            window_z[idx] = drift_z_array(_torch_sum_time(w), _torch_sum_time(w * w))
        window_z[self.drift_ring.filled == 0] = 0.0  # no row yet: sums of 0
        z = drift_z_array(self.drift_cumulative, self.drift_sum_sq)

        out = {
            "rows": rows, "repeated_max_ratio": ratio("repeated_max_rows"), "repeated_max_ratio_bf16": rm16,
            "repeated_max_ratio_format": ratio("repeated_max_rows_format"), "max_logit": max_logit,
            "delta_error": np.where(delta_seen[:, None], e, nan),
            # a head whose delta error is not measured at this step (no call it could measure: dropout,
            # a failed statistics pass, ...) or never was reads NaN: not an older z passing for current,
            # nor a z of 0 that would look healthy (the sums keep going at its next measured step)
            "delta_cumulative": np.where(now_measured, self.drift_cumulative, nan),
            "drift_z": np.where(now_measured, z, nan),
            "drift_window_z": np.where(now_measured, window_z, nan),
            "drift_count": self.drift_count.copy(), "wq_sigma": sigma, "wq_growth": growth,
            "wq_ratio": ratio_to_median_array(sigma),
            "wq_error_push": wq_error["push"], "wq_error_push_true": wq_error["push_true"],
            "wq_error_push_cumulative": wq_error["push_cumulative"], "wq_error_push_share": wq_error["push_share"],
            "wq_error_alignment": wq_error["alignment"], "wq_error_coherence": wq_error["coherence"],
            "max_logit_growth": trends["log_max_logit"], "wq_sigma_growth_rate": trends["log_wq_sigma"],
            "repeated_max_bf16_trend": trends["repeated_max_ratio_bf16"],
        }
        # (H,) tensors per layer, views of fresh (L, H) arrays (a copy where one is reused)
        per_layer = {k: torch.from_numpy(v if v is not nan else nan.copy()).unbind(0) for k, v in out.items()}
        return [LayerSignals(layer=self.first + i, seen=bool(seen[i]), coverage=_coverage(r.calls),
                             calls=r.calls[0] if r.calls is not None else None,
                             delta_measured=bool(delta_seen[i]),
                             low_precision=True if r.low_precision is None else bool(r.low_precision),
                             variant=r.variant, **{k: v[i] for k, v in per_layer.items()})
                for i, r in enumerate(readings)]

    def _trends(self, step: int, seen: np.ndarray, values: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Least-squares slope of each series over the last W monitored steps, per 1,000 optimizer
        steps (NaN until the window holds W points). Unseen steps are not pushed (no reading)."""
        for name, v in values.items():
            self.trend[name].push(v, seen)
        self.trend_steps.push(np.full((self.num_layers, 1), float(step)), seen)
        out = {name: np.full((self.num_layers, self.heads), np.nan) for name in values}
        full = self.trend_steps.full
        if not full.any():
            return out
        span = (self.trend_steps.newest() - self.trend_steps.oldest())[:, 0]  # (L,)
        with np.errstate(divide="ignore", invalid="ignore"):
            # optimizer steps between monitored points; NaN for a zero span
            per_point = np.where(span > 0, span / (self.window - 1), np.nan)
            scale = 1000.0 / per_point  # per monitored point -> per 1,000 optimizer steps
        names = list(values)
        for idx, _ in self.trend_steps.groups(full):
            # the series of a group side by side: (n * series, W, H), each slope over its own (W, H)
            series = np.concatenate([self._chronological(self.trend[name], idx) for name in names])
            slopes = linear_slope_array(series).reshape(len(names), len(idx), self.heads)
            for k, name in enumerate(names):
                out[name][idx] = slopes[k] * scale[idx, None]
        return out

    @staticmethod
    def _chronological(rings: _Rings, idx: list[int]) -> np.ndarray:
        """(len(idx), W, H): the full rings of layers idx (all at one position), oldest row first."""
        pos = int(rings.pos[idx[0]])
        b = rings.buffer if len(idx) == len(rings.pos) else rings.buffer[idx]
        return np.concatenate([b[:, pos:], b[:, :pos]], axis=1)


def _torch_sum_time(w: np.ndarray) -> np.ndarray:
    """Sums over the time axis of (L, T, H) by torch: each (T, H) as torch sums it alone."""
    return torch.from_numpy(w).sum(1).numpy()


class SignalBuilder:
    """Builds ``StepSignals`` from raw readings, keeping the host state between monitored steps.

    Args:
        heads: query heads of each layer, in layer order.
        window: W, monitored steps of the windowed drift z, the W^Q growth and the trends.

    Consecutive layers with the same head count are computed together, as (layers, heads)
    arrays; every value is the one a layer computed alone would have.
    """

    def __init__(self, heads: list[int], window: int):
        self.heads = list(heads)
        self.window = window
        self.blocks: list[_Block] = []
        first = 0
        while first < len(self.heads):
            n = 1
            while first + n < len(self.heads) and self.heads[first + n] == self.heads[first]:
                n += 1
            self.blocks.append(_Block(first, n, self.heads[first], window))
            first += n

    def build(self, *, step: int, index: int, loss: float, grad_norm: float, readings: list[LayerReading],
              loss_given: bool = True, grad_norm_given: bool = True, grad_units_unknown: bool = False) -> StepSignals:
        """The signals of monitored step ``step`` (``index`` monitored steps came before it);
        ``grad_units_unknown``: the step's gradients are in units not known (a step the loss scaler
        skipped, ``flashwatch.loss_scale``): its delta error is not measured."""
        if len(readings) != len(self.heads):
            raise ValueError(f"{len(readings)} layer readings for {len(self.heads)} layers")
        layers: list[LayerSignals] = []
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):  # NaN and inf are values here
            for block in self.blocks:
                layers.extend(block.build(step, readings[block.first: block.first + block.num_layers],
                                          grad_units_unknown))
        return StepSignals(step=step, index=index, loss=loss, grad_norm=grad_norm, layers=layers,
                           loss_given=loss_given, grad_norm_given=grad_norm_given)

    def _where(self, i: int) -> tuple[_Block, int]:
        for block in self.blocks:
            if i < block.first + block.num_layers:
                return block, i - block.first
        raise IndexError(i)

    def state_dict(self) -> list[dict]:
        return [block.state_dict(i) for block in self.blocks for i in range(block.num_layers)]

    def load_state_dict(self, states: list[dict]) -> None:
        if len(states) != len(self.heads):
            raise ValueError(f"saved signal state has {len(states)} layers, this model {len(self.heads)}")
        for i, st in enumerate(states):
            block, j = self._where(i)
            block.load_state_dict(j, st)
