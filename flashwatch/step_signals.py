"""One monitored step's readings -> the signals the detectors judge: the one builder.

The Monitor (live) and the replay of a recording (``flashwatch.replay``) both turn a
monitored step's raw readings into ``StepSignals`` here, so a replay sees what the Monitor saw.

Raw readings of one layer (``LayerReading``), every tensor (H,) float64 on the host:

- ``stats``: the rows of ``AttentionStats.packed()`` by field name (rows, repeated-max counts,
  max logit, delta-error sums);
- ``sigma``: the W^Q spectral norm per head;
- ``chain``: the W^Q-gradient error readings by field name (``flashwatch.chain.FIELDS``), or
  None where they were not measured;
- ``low_precision`` and ``variant``: what the layer ran at that step;
- ``calls``: (attention calls, measured calls) of the layer at that step, or None where not
  counted; the layer's coverage is their ratio (NaN without a call).

Host state kept across steps (``SignalBuilder``; ``state_dict`` for an exact resume): per
layer the drift sums (``DriftTracker``), the last W+1 spectral norms (``SigmaHistory``), the
cumulative W^Q-error push, and the last W values of the series whose windowed trends are
reported (log max logit, log sigma, BF16 repeated-max ratio).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .detectors import LayerSignals, StepSignals
from .signals import DriftTracker, Ring, SigmaHistory, host_tensor, linear_slope, ratio_to_median

__all__ = ["LayerReading", "SignalBuilder", "TREND_SERIES"]

F64 = torch.float64
# trends: least-squares slope over the last `window` monitored steps, per 1,000 optimizer steps
TREND_SERIES = ("log_max_logit", "log_wq_sigma", "repeated_max_ratio_bf16")


@dataclass
class LayerReading:
    """One layer's raw readings at one monitored step (see the module docstring)."""

    stats: dict[str, torch.Tensor]
    sigma: torch.Tensor
    chain: dict[str, torch.Tensor] | None = None
    low_precision: bool | None = None
    variant: str | None = None
    calls: tuple[int, int] | None = None


def _coverage(calls: tuple[int, int] | None) -> float:
    """Measured calls / attention calls; NaN without a call (nothing to cover)."""
    if calls is None or not calls[0]:
        return math.nan
    return calls[1] / calls[0]


def _nan(h: int) -> torch.Tensor:
    return torch.full((h,), math.nan, dtype=F64)


class _LayerState:
    """Host-side state of one layer's signals."""

    def __init__(self, num_heads: int, window: int):
        self.num_heads = num_heads
        self.drift = DriftTracker(num_heads, window)
        self.sigma = SigmaHistory(num_heads, window)
        self.push_cumulative = torch.zeros(num_heads, dtype=F64)
        self.push_true_cumulative = torch.zeros(num_heads, dtype=F64)
        self.trend = {name: Ring(window, num_heads) for name in TREND_SERIES}
        self.trend_steps = Ring(window, 1)

    def state_dict(self) -> dict:
        return {"drift": self.drift.state_dict(), "sigma": self.sigma.state_dict(),
                "push_cumulative": self.push_cumulative.clone(),
                "push_true_cumulative": self.push_true_cumulative.clone(),
                "trend": {k: r.state_dict() for k, r in self.trend.items()},
                "trend_steps": self.trend_steps.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.drift.load_state_dict(state["drift"])
        self.sigma.load_state_dict(state["sigma"])
        if "push_cumulative" in state:  # states saved before the W^Q-error chain existed have none
            self.push_cumulative = host_tensor(state["push_cumulative"], F64)
            self.push_true_cumulative = host_tensor(state["push_true_cumulative"], F64)
            for k, r in self.trend.items():
                r.load_state_dict(state["trend"][k])
            self.trend_steps.load_state_dict(state["trend_steps"])


class SignalBuilder:
    """Builds ``StepSignals`` from raw readings, keeping the host state between monitored steps.

    Args:
        heads: query heads of each layer, in layer order.
        window: W, monitored steps of the windowed drift z, the W^Q growth and the trends.
    """

    def __init__(self, heads: list[int], window: int):
        self.heads = list(heads)
        self.window = window
        self.layers = [_LayerState(h, window) for h in heads]

    def build(self, *, step: int, index: int, loss: float, grad_norm: float, readings: list[LayerReading],
              loss_given: bool = True, grad_norm_given: bool = True) -> StepSignals:
        """The signals of monitored step ``step`` (``index`` monitored steps came before it)."""
        if len(readings) != len(self.layers):
            raise ValueError(f"{len(readings)} layer readings for {len(self.layers)} layers")
        layers = [self._layer(i, step, r) for i, r in enumerate(readings)]
        return StepSignals(step=step, index=index, loss=loss, grad_norm=grad_norm, layers=layers,
                           loss_given=loss_given, grad_norm_given=grad_norm_given)

    def _layer(self, i: int, step: int, r: LayerReading) -> LayerSignals:
        state, h = self.layers[i], self.heads[i]
        f = r.stats
        rows = f["rows"].to(F64)
        seen = bool(rows.sum() > 0)
        safe_rows = torch.where(rows > 0, rows, torch.ones_like(rows))
        nan = _nan(h)

        def ratio(name: str) -> torch.Tensor:
            if name not in f:  # a recording made before this count existed: not measured
                return nan.clone()
            return torch.where(rows > 0, f[name].to(F64) / safe_rows, nan)

        # calls counted and none measured in full (attention dropout: scores measured, delta error
        # not): the delta error is not measured at this step
        delta_seen = seen and (r.calls is None or r.calls[1] > 0)
        if delta_seen:
            state.drift.update(f["delta_error"].to(F64))
        drift_measured = state.drift.count > 0  # heads with at least one measured delta error
        sigma = r.sigma.to(F64)
        state.sigma.update(sigma)
        max_logit = torch.where(rows > 0, f["max_logit"].to(F64), nan)
        rm16 = ratio("repeated_max_rows_bf16")

        chain = r.chain
        if chain is not None and seen:
            push, push_true = chain["push"].to(F64), chain["push_true"].to(F64)
            state.push_cumulative += torch.nan_to_num(push, nan=0.0)
            state.push_true_cumulative += torch.nan_to_num(push_true, nan=0.0)
            push_measured = torch.isfinite(push)
            push_cum = torch.where(push_measured, state.push_cumulative, nan)
            share_den = state.push_true_cumulative.abs()
            push_share = torch.where(push_measured & (share_den > 0), state.push_cumulative / share_den.clamp_min(1e-300),
                                     nan)
            alignment, coherence = chain["alignment"].to(F64), chain["coherence"].to(F64)
        else:
            push = push_true = push_cum = push_share = alignment = coherence = nan.clone()

        trends = self._trends(state, step, seen, {
            "log_max_logit": max_logit.clamp_min(1e-30).log(),
            "log_wq_sigma": sigma.clamp_min(1e-30).log(),
            "repeated_max_ratio_bf16": rm16,
        })
        return LayerSignals(
            layer=i, seen=seen, rows=rows, coverage=_coverage(r.calls), delta_measured=delta_seen,
            repeated_max_ratio=ratio("repeated_max_rows"), repeated_max_ratio_bf16=rm16,
            repeated_max_ratio_format=ratio("repeated_max_rows_format"),
            max_logit=max_logit, delta_error=f["delta_error"].to(F64) if delta_seen else nan.clone(),
            # a head whose delta error was never measured (no call it could measure: dropout, a mask,
            # ...) reads NaN, not a z of 0 that would look healthy
            delta_cumulative=torch.where(drift_measured, state.drift.cumulative, nan),
            drift_z=torch.where(drift_measured, state.drift.z, nan),
            drift_window_z=torch.where(drift_measured, state.drift.window_z, nan),
            drift_count=state.drift.count.clone(), wq_sigma=sigma.clone(), wq_growth=state.sigma.growth,
            wq_ratio=ratio_to_median(sigma),
            low_precision=True if r.low_precision is None else bool(r.low_precision),
            variant=r.variant,
            wq_error_push=push, wq_error_push_true=push_true, wq_error_push_cumulative=push_cum, wq_error_push_share=push_share,
            wq_error_alignment=alignment, wq_error_coherence=coherence,
            max_logit_growth=trends["log_max_logit"], wq_sigma_growth_rate=trends["log_wq_sigma"],
            repeated_max_bf16_trend=trends["repeated_max_ratio_bf16"],
        )

    def _trends(self, state: _LayerState, step: int, seen: bool, values: dict[str, torch.Tensor]
                ) -> dict[str, torch.Tensor]:
        """Least-squares slope of each series over the last W monitored steps, per 1,000 optimizer
        steps (NaN until the window holds W points). Unseen steps are not pushed (no reading)."""
        h = len(next(iter(values.values())))
        if seen:
            for name, v in values.items():
                state.trend[name].push(v)
            state.trend_steps.push(torch.tensor([float(step)], dtype=F64))
        out = {}
        full = state.trend_steps.full
        if not full:
            return {name: _nan(h) for name in values}
        steps = state.trend_steps.values()[:, 0]
        span = float(steps[-1] - steps[0])
        per_point = span / (len(steps) - 1) if span > 0 else math.nan  # optimizer steps between monitored points
        for name in values:
            slope = linear_slope(state.trend[name].values())  # per monitored point
            out[name] = slope * (1000.0 / per_point)
        return out

    def state_dict(self) -> list[dict]:
        return [s.state_dict() for s in self.layers]

    def load_state_dict(self, states: list[dict]) -> None:
        if len(states) != len(self.layers):
            raise ValueError(f"saved signal state has {len(states)} layers, this model {len(self.layers)}")
        for s, st in zip(self.layers, states):
            s.load_state_dict(st)
