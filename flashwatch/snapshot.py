"""A monitored step's signals as plain data, and the metric-keyed snapshot built from it.

``host_record(step_signals)`` keeps the last monitored step as plain Python data (it goes into
``Monitor.state_dict()``); ``snapshot(...)`` turns it (and each layer's attention coverage) into the dict keyed by the metric names
of ``flashwatch.metrics.METRICS`` that every exporter reads.
"""

from __future__ import annotations

import itertools
import math
from typing import Any, Iterable

from .detectors import Alert, StepSignals
from .metrics import METRICS, head_keys

__all__ = ["PER_HEAD_METRICS", "EXTRA_SIGNALS", "host_record", "snapshot", "extra_signals"]

# per-head metric -> the LayerSignals attribute it shows
PER_HEAD_METRICS: dict[str, str] = {
    "flashwatch_repeated_max_ratio": "repeated_max_ratio",
    "flashwatch_repeated_max_ratio_bf16": "repeated_max_ratio_bf16",
    "flashwatch_repeated_max_ratio_format": "repeated_max_ratio_format",
    "flashwatch_max_logit": "max_logit",
    "flashwatch_delta_error": "delta_error",
    "flashwatch_delta_error_cumulative": "delta_cumulative",
    "flashwatch_delta_drift_z": "drift_z",
    "flashwatch_wq_spectral_norm": "wq_sigma",
    "flashwatch_wq_error_push": "wq_error_push",
    "flashwatch_wq_error_push_cumulative": "wq_error_push_cumulative",
    "flashwatch_wq_error_push_share": "wq_error_push_share",
    "flashwatch_wq_error_alignment": "wq_error_alignment",
    "flashwatch_wq_error_coherence": "wq_error_coherence",
    "flashwatch_max_logit_growth_rate": "max_logit_growth",
    "flashwatch_wq_spectral_norm_growth_rate": "wq_sigma_growth_rate",
    "flashwatch_repeated_max_ratio_bf16_trend": "repeated_max_bf16_trend",
}
# signals beside the metric table (Monitor.signals()): name -> LayerSignals attribute
EXTRA_SIGNALS: dict[str, str] = {
    "drift_window_z": "drift_window_z",
    "wq_growth": "wq_growth",
    "wq_ratio_to_median": "wq_ratio",
    "rows": "rows",
    "wq_error_push_true": "wq_error_push_true",
}


_ATTRS = sorted(set(PER_HEAD_METRICS.values()) | set(EXTRA_SIGNALS.values()))


def _values(t: Any, heads: int) -> list[float]:
    if t is None:
        return [math.nan] * heads
    values = t.tolist()  # Python floats already for a floating-point tensor (all of one type)
    return values if not values or type(values[0]) is float else [float(x) for x in values]


def host_record(s: StepSignals) -> dict:
    """The monitored step as plain data: step, loss, grad_norm and ``per_head[attr][layer][head]``."""
    per_head: dict[str, list] = {a: [] for a in _ATTRS}
    for ls in s.layers:
        heads = len(ls.rows)
        for a in _ATTRS:
            per_head[a].append(_values(getattr(ls, a), heads))
    return {"step": s.step, "loss": s.loss, "grad_norm": s.grad_norm, "per_head": per_head,
            "coverage": [float(ls.coverage) for ls in s.layers]}


def _per_head(record: dict | None, attr: str) -> dict:
    if record is None:
        return {}
    rows = record["per_head"].get(attr)
    if rows is None:  # a record saved before this signal existed
        rows = [[math.nan] * len(r) for r in record["per_head"]["rows"]]
    keys = head_keys(tuple(len(vals) for vals in rows))
    return dict(zip(keys, map(float, itertools.chain.from_iterable(rows))))


def snapshot(record: dict | None, variants: dict[int, str], variant_labels: Iterable[str],
             alert_counts: dict[str, int], active: Iterable[Alert], ever_active: set) -> dict:
    """The latest values keyed by metric name (see ``Monitor.snapshot``)."""
    snap: dict[str, Any] = {m.name: ({} if m.labels else math.nan) for m in METRICS}
    if record is not None:
        snap["flashwatch_step"] = float(record["step"])
        snap["flashwatch_loss"] = float(record["loss"])
        snap["flashwatch_grad_norm"] = float(record["grad_norm"])
        for metric, attr in PER_HEAD_METRICS.items():
            snap[metric] = _per_head(record, attr)
        # a record saved before coverage was counted: NaN per layer
        coverage = record.get("coverage") or [math.nan] * len(record["per_head"]["rows"])
        snap["flashwatch_attention_coverage"] = {(layer,): float(v) for layer, v in enumerate(coverage)}
    labels = tuple(variant_labels)
    snap["flashwatch_kernel_variant"] = {(layer, v): float(v == current) for layer, current in variants.items()
                                         for v in labels}
    snap["flashwatch_alerts_total"] = {(rule,): float(n) for rule, n in alert_counts.items()}
    active_keys = {(a.rule, a.layer, a.head) for a in active}
    snap["flashwatch_alert_active"] = {key: float(key in active_keys) for key in sorted(ever_active | active_keys)}
    return snap


def extra_signals(record: dict | None) -> dict:
    """``{name: {(layer, head): float}}`` for the signals beside the metric table."""
    return {name: _per_head(record, attr) for name, attr in EXTRA_SIGNALS.items()}
