"""The one table of flashwatch's metrics: names, kinds, labels, units and meanings.

Everything that shows a number reads this table (``METRICS``, a step's metrics; ``SERVICE_METRICS``,
the two the Prometheus exporter adds; ``ALL_METRICS``, both): the Prometheus exporter, the JSONL writer's
schema, the README's metric table (``python -m flashwatch.metrics`` prints it), the Grafana
dashboard and the Prometheus alert rules. ``tests/test_metric_table.py`` holds them together.
The values a ``rule`` or ``variant`` label takes are the vocabulary's (``LABEL_VALUES``, from
``flashwatch.vocabulary``).

Conventions (Prometheus): one prefix ``flashwatch_``, base units, counters end in ``_total``.
Labels never include the step. ``layer`` and ``head`` are integers counted from 0.

``Monitor.snapshot()`` returns a dict keyed by these names: a float for a metric without
labels, and for a labelled metric a dict keyed by the tuple of its label values in the
order of ``labels`` (``(layer, head)`` for per-head metrics, ``(layer, variant)`` for the
kernel variant, ``(layer,)`` for the attention coverage, ``(rule,)`` for the alert counter, ``(rule, layer, head)`` for active alerts;
``layer``/``head`` are ints, ``-1`` where an alert concerns no single layer or head).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

from .vocabulary import RULES, VARIANT_LABELS

PREFIX = "flashwatch_"
PER_HEAD = ("layer", "head")


@dataclass(frozen=True)
class MetricSpec:
    """One metric: what it is called, what kind of Prometheus metric it is, and what it means."""

    name: str
    kind: str  # "gauge" | "counter"
    labels: tuple[str, ...]
    unit: str  # Grafana unit id: "none", "percentunit", ...
    help: str

    @property
    def per_head(self) -> bool:
        return self.labels == PER_HEAD


METRICS: tuple[MetricSpec, ...] = (
    MetricSpec("flashwatch_step", "gauge", (), "none", "Last monitored optimizer step."),
    MetricSpec("flashwatch_loss", "gauge", (), "none", "Training loss at the last monitored step."),
    MetricSpec("flashwatch_grad_norm", "gauge", (), "none",
               "Global gradient L2 norm before clipping at the last monitored step (NaN if not given)."),
    MetricSpec("flashwatch_repeated_max_ratio", "gauge", PER_HEAD, "percentunit",
               "Fraction of softmax rows whose maximum is reached within eps by two or more keys "
               "(FP32 scores)."),
    MetricSpec("flashwatch_repeated_max_ratio_bf16", "gauge", PER_HEAD, "percentunit",
               "The same fraction on scores rounded to BF16 (what an all-BF16 kernel sees)."),
    MetricSpec("flashwatch_repeated_max_ratio_format", "gauge", PER_HEAD, "percentunit",
               "Fraction of softmax rows where P_bar = exp(s - max) rounds to exactly 1 at two or more keys in the "
               "P_bar V format of MonitorConfig.format (bf16, fp8_e4m3, fp8_e5m2, mxfp4)."),
    MetricSpec("flashwatch_max_logit", "gauge", PER_HEAD, "none",
               "Largest scaled attention score sm_scale*q.k in the head (natural-log units)."),
    MetricSpec("flashwatch_delta_error", "gauge", PER_HEAD, "none",
               "Signed delta error e_t: sum over rows of (delta_used - delta_hp) at this step."),
    MetricSpec("flashwatch_delta_error_cumulative", "gauge", PER_HEAD, "none",
               "Cumulative signed delta error C_T: the sum of e_t over monitored steps."),
    MetricSpec("flashwatch_delta_drift_z", "gauge", PER_HEAD, "none",
               "Drift z = C_T / sqrt(sum e_t^2): about N(0,1) while the sign of e_t is a coin toss, "
               "growing like sqrt(T) under a persistent sign."),
    MetricSpec("flashwatch_wq_spectral_norm", "gauge", PER_HEAD, "none",
               "Largest singular value of the head's query projection W^Q_h (d_head x d_model)."),
    MetricSpec("flashwatch_wq_error_push", "gauge", PER_HEAD, "none",
               "Push of the delta error on the head's W^Q spectral norm at this step: -u^T dG v for the top "
               "singular pair (u, v) of W^Q_h and dG the W^Q-gradient error (positive: pushes sigma_max up). "
               "NaN where not measured."),
    MetricSpec("flashwatch_wq_error_push_cumulative", "gauge", PER_HEAD, "none",
               "Sum of flashwatch_wq_error_push over monitored steps."),
    MetricSpec("flashwatch_wq_error_push_share", "gauge", PER_HEAD, "none",
               "Cumulative error push over the absolute cumulative push of the true W^Q gradient."),
    MetricSpec("flashwatch_wq_error_alignment", "gauge", PER_HEAD, "none",
               "Cosine between the head's W^Q-gradient error at this monitored step and at the previous one "
               "(about 0 when its direction is random, 1 when it keeps one direction)."),
    MetricSpec("flashwatch_wq_error_coherence", "gauge", PER_HEAD, "none",
               "||sum dG|| / sum ||dG|| of the W^Q-gradient error over an exponential window of MonitorConfig.window "
               "monitored steps (1: one fixed direction; about 0.1 at window 50 when random)."),
    MetricSpec("flashwatch_max_logit_growth_rate", "gauge", PER_HEAD, "none",
               "Slope of log(max logit) per 1,000 optimizer steps over the last window of monitored steps; NaN "
               "while a max logit in the window is <= 0 (its log is not defined)."),
    MetricSpec("flashwatch_wq_spectral_norm_growth_rate", "gauge", PER_HEAD, "none",
               "Slope of log(W^Q spectral norm) per 1,000 optimizer steps over the last window of monitored steps."),
    MetricSpec("flashwatch_repeated_max_ratio_bf16_trend", "gauge", PER_HEAD, "none",
               "Slope of the BF16 repeated-max ratio per 1,000 optimizer steps over the last window of monitored "
               "steps."),
    MetricSpec("flashwatch_attention_coverage", "gauge", ("layer",), "percentunit",
               "Fraction of the layer's attention calls at the last monitored step measured in full, delta error "
               "included (calls with attention dropout: repeated maxima and max logit only); 0 also where no "
               "attention call of the layer was seen."),
    MetricSpec("flashwatch_kernel_variant", "gauge", ("layer", "variant"), "none",
               "1 for the attention variant a layer runs now (sdpa where its calls run torch SDPA: observed, "
               "or falling back from flashwatch's kernel), 0 for the others."),
    MetricSpec("flashwatch_alerts_total", "counter", ("rule",), "none", "Alerts raised, by rule."),
    MetricSpec("flashwatch_alert_active", "gauge", ("rule", "layer", "head"), "none",
               "1 while an alert of this rule holds for this layer and head."),
)

#: Metrics the Prometheus exporter serves beside a step's (not part of ``Monitor.snapshot()`` nor of
#: the JSONL records): which flashwatch serves, and when the last monitored step came (a run that
#: hangs keeps its endpoint answering; this timestamp is what stops).
SERVICE_METRICS: tuple[MetricSpec, ...] = (
    MetricSpec("flashwatch_build_info", "gauge", ("version",), "none",
               "Always 1; the version label is the flashwatch version serving these metrics (Prometheus only)."),
    MetricSpec("flashwatch_last_step_timestamp_seconds", "gauge", (), "dateTimeAsIso",
               "Unix time in seconds when the last monitored step was recorded, or when monitoring started "
               "before the first (Prometheus only)."),
)

#: Every metric name flashwatch exports: the step's metrics, then the service metrics.
ALL_METRICS: tuple[MetricSpec, ...] = METRICS + SERVICE_METRICS

BY_NAME: dict[str, MetricSpec] = {m.name: m for m in ALL_METRICS}


def present(snapshot: Mapping[str, Any]) -> Iterator[tuple[MetricSpec, Any]]:
    """The table's metrics that ``snapshot`` (``Monitor.snapshot()``) holds, with their values, in
    table order; names outside the table are left out."""
    for spec in METRICS:
        if spec.name in snapshot:
            yield spec, snapshot[spec.name]

# Labels whose values are a fixed vocabulary (``layer`` and ``head`` are integers from 0).
LABEL_VALUES: dict[str, tuple[str, ...]] = {"rule": RULES, "variant": VARIANT_LABELS}


def exported_names(spec: MetricSpec) -> tuple[str, ...]:
    """Sample names Prometheus sees for a metric (counters gain ``_total``/``_created``)."""
    if spec.kind == "counter":
        base = spec.name[: -len("_total")] if spec.name.endswith("_total") else spec.name
        return (base + "_total", base + "_created")
    return (spec.name,)


def markdown_table() -> str:
    """The metric table of docs/SIGNALS.md, generated from ``ALL_METRICS``."""
    rows = ["| name | kind | labels | meaning |", "|---|---|---|---|"]
    for m in ALL_METRICS:
        rows.append(f"| `{m.name}` | {m.kind} | {', '.join(m.labels)} | {m.help} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(markdown_table())


@functools.lru_cache(maxsize=8)
def head_keys(heads: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """The (layer, head) labels of layers of ``heads`` heads, layer by layer: the order of a
    record's and a snapshot's per-head values (made once per shape)."""
    return tuple((layer, head) for layer, n in enumerate(heads) for head in range(n))
