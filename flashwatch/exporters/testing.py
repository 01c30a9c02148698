"""Synthetic step records with the exact shape of ``Monitor.snapshot()``, for tests and benchmarks.

Nothing here is used in a training run. The values are random but plausible (ratios in [0, 1],
positive norms, a drift z around N(0, 1)), so an exporter, a dashboard or a benchmark can be
exercised at any size (32 layers x 32 heads) without training a model.
"""

from __future__ import annotations

import random
import time
from typing import Any

from ..metrics import METRICS
from ..vocabulary import RULES, VARIANT_LABELS
from .base import Layout, StepRecord


def synthetic_layout(num_layers: int = 2, num_heads: int = 4) -> Layout:
    """A layout of ``num_layers`` layers named like a GPT's, each with ``num_heads`` heads."""
    return Layout(layers=[(f"transformer.h.{i}.attn", num_heads) for i in range(num_layers)])


def synthetic_snapshot(layout: Layout, step: int = 0, *, seed: int = 0,
                       alerts: list[Any] = ()) -> dict:
    """A ``Monitor.snapshot()``-shaped dict for ``layout``: every metric of the table present."""
    rng = random.Random(seed * 1_000_003 + step)
    heads = [(layer, head) for layer, (_, n) in enumerate(layout.layers) for head in range(n)]
    snap: dict[str, Any] = {
        "flashwatch_step": float(step),
        "flashwatch_loss": 4.0 / (1.0 + 0.01 * step) + 0.05 * rng.random(),
        "flashwatch_grad_norm": 1.0 + rng.random(),
    }
    per_head = {
        "flashwatch_repeated_max_ratio": lambda: 0.02 * rng.random(),
        "flashwatch_repeated_max_ratio_bf16": lambda: 0.05 * rng.random(),
        "flashwatch_repeated_max_ratio_format": lambda: 0.1 * rng.random(),
        "flashwatch_max_logit": lambda: 5.0 + 5.0 * rng.random(),
        "flashwatch_delta_error": lambda: rng.gauss(0.0, 1e-3),
        "flashwatch_delta_error_cumulative": lambda: rng.gauss(0.0, 1e-2),
        "flashwatch_delta_drift_z": lambda: rng.gauss(0.0, 1.0),
        "flashwatch_wq_spectral_norm": lambda: 1.0 + rng.random(),
        "flashwatch_wq_error_push": lambda: rng.gauss(0.0, 1e-4),
        "flashwatch_wq_error_push_cumulative": lambda: rng.gauss(0.0, 1e-3),
        "flashwatch_wq_error_push_share": lambda: rng.gauss(0.0, 1e-2),
        "flashwatch_wq_error_alignment": lambda: rng.uniform(-0.3, 0.3),
        "flashwatch_wq_error_coherence": lambda: 0.1 + 0.1 * rng.random(),
        "flashwatch_max_logit_growth_rate": lambda: rng.gauss(0.0, 0.1),
        "flashwatch_wq_spectral_norm_growth_rate": lambda: rng.gauss(0.0, 0.05),
        "flashwatch_repeated_max_ratio_bf16_trend": lambda: rng.gauss(0.0, 0.01),
    }
    for spec in METRICS:
        if spec.per_head:
            draw = per_head[spec.name]
            snap[spec.name] = {key: draw() for key in heads}
    snap["flashwatch_attention_coverage"] = {(layer,): 1.0 for layer in range(layout.num_layers)}
    snap["flashwatch_kernel_variant"] = {
        (layer, v): float(v == "sdpa") for layer in range(layout.num_layers) for v in VARIANT_LABELS}
    totals = {(rule,): 0.0 for rule in RULES}
    active = {}
    for a in alerts:
        totals[(a.rule,)] = totals.get((a.rule,), 0.0) + 1.0
        active[(a.rule, a.layer, a.head)] = 1.0
    snap["flashwatch_alerts_total"] = totals
    snap["flashwatch_alert_active"] = active
    return snap


def synthetic_record(layout: Layout, step: int = 0, *, seed: int = 0,
                     alerts: list[Any] = ()) -> StepRecord:
    """A :class:`StepRecord` whose alerts (if any) are both new and active at ``step``."""
    return StepRecord(step=step, time=time.time(),
                      snapshot=synthetic_snapshot(layout, step, seed=seed, alerts=alerts),
                      new_alerts=list(alerts), active_alerts=list(alerts))
