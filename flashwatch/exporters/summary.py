"""Small summaries of a ``Monitor.snapshot()``: the top heads by a signal and a few scalars.

Shared by the console exporter (what a person sees) and the Lightning callback (what goes to
the trainer's loggers), so both say the same thing.
"""

from __future__ import annotations

import heapq
import math
from typing import Any, Callable, Mapping

# (scalar name, metric, how a head's value is ranked) of ``scalar_summary``; units in the table.
SUMMARIES: tuple[tuple[str, str, Callable[[float], float]], ...] = (
    ("max_abs_drift_z", "flashwatch_delta_drift_z", abs),
    ("max_repeated_max_ratio", "flashwatch_repeated_max_ratio", float),
    ("max_repeated_max_ratio_bf16", "flashwatch_repeated_max_ratio_bf16", float),
    ("max_wq_spectral_norm", "flashwatch_wq_spectral_norm", float),
    ("max_logit", "flashwatch_max_logit", float),
)


def _rank(key: Callable[[float], float]) -> Callable[[tuple[Any, float]], float]:
    # NaN ranks last: in a snapshot it means "not measured at this step" (a layer whose
    # attention was not seen); a head that went non-finite raises the non_finite alert.
    def rank(item: tuple[Any, float]) -> float:
        v = float(item[1])
        return -math.inf if v != v else key(v)
    return rank


def top_heads(snapshot: Mapping[str, Any], metric: str, k: int = 5,
              key: Callable[[float], float] = float) -> list[tuple[int, int, float]]:
    """The ``k`` heads with the largest ``key(value)`` of a per-head metric, as (layer, head, value)."""
    values = snapshot.get(metric) or {}
    best = heapq.nlargest(k, values.items(), key=_rank(key))
    return [(int(layer), int(head), float(v)) for (layer, head), v in best]


def scalar_summary(snapshot: Mapping[str, Any], measured: bool = True) -> dict[str, float]:
    """A handful of scalars for trainer loggers (names without prefix; missing metrics left out).

    ``max_abs_drift_z`` (none), ``max_repeated_max_ratio`` and ``max_repeated_max_ratio_bf16``
    (fraction of rows), ``max_wq_spectral_norm`` (none), ``max_logit`` (natural-log units),
    ``grad_norm`` (none), ``alerts_total`` (count, all rules), ``alerts_active`` (count).
    ``measured=False`` (the latest monitored steps failed, so ``snapshot`` is an older step's):
    every value but the alert counts is NaN, not measured.
    """
    if not measured:
        return {k: (v if k in ("alerts_total", "alerts_active") else math.nan)
                for k, v in scalar_summary(snapshot).items()}
    out: dict[str, float] = {}
    for name, metric, key in SUMMARIES:
        top = top_heads(snapshot, metric, 1, key)
        if top:
            out[name] = key(top[0][2]) if top[0][2] == top[0][2] else math.nan
    if "flashwatch_grad_norm" in snapshot:
        out["grad_norm"] = float(snapshot["flashwatch_grad_norm"])
    if "flashwatch_alerts_total" in snapshot:
        out["alerts_total"] = float(sum(snapshot["flashwatch_alerts_total"].values()))
    if "flashwatch_alert_active" in snapshot:
        out["alerts_active"] = float(sum(1 for v in snapshot["flashwatch_alert_active"].values() if v))
    return out


def active_variants(snapshot: Mapping[str, Any]) -> dict[int, str]:
    """Layer -> the variant whose ``flashwatch_kernel_variant`` is 1."""
    out: dict[int, str] = {}
    for (layer, variant), v in (snapshot.get("flashwatch_kernel_variant") or {}).items():
        if v:
            out[int(layer)] = str(variant)
    return out


def variant_counts(snapshot: Mapping[str, Any]) -> dict[str, list[int]]:
    """Variant -> the layers that run it, e.g. ``{"plain": [0, 1, 3], "fp32_delta": [2]}``."""
    out: dict[str, list[int]] = {}
    for layer, variant in sorted(active_variants(snapshot).items()):
        out.setdefault(variant, []).append(layer)
    return out
