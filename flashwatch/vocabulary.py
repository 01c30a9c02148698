"""flashwatch's vocabulary: the names every part shares, each defined once. Imports no torch.

What lives here, and who reads it:

- The alert rules (``RULE_SPECS``; names in ``RULES``, severities in ``SEVERITY``): the
  detectors (``flashwatch.detectors``) decide them, the Monitor exports their decisions as
  ``flashwatch_alert_active{rule=...}``, ``dashboards/alerts.yml`` turns each into one
  Prometheus alert, and ``docs/ALERTS.md`` is the runbook, one section per rule (its anchor is
  the rule name). ``STOPPED_REPORTING`` is the one alert Prometheus raises on its own (a run
  whose monitored steps stopped coming); ``ALERT_SPECS`` lists every alert, in runbook order.
- The kernel vocabulary: ``MODES`` (how the Monitor attaches), ``VARIANTS`` (what
  flashwatch's kernel runs), ``FIX_VARIANTS`` (what ``auto_fix`` may switch to),
  ``VARIANT_LABELS`` (the ``variant`` label of ``flashwatch_kernel_variant``) and
  ``VARIANT_CODE`` (how ranks compare variants: higher is more fixed).
- ``INJECTED``: the word every output of an injected-fault run carries.
- ``check_port``: the one check of a TCP port argument.

``python -m flashwatch.vocabulary`` prints the alert table (markdown).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["RuleSpec", "RULE_SPECS", "RULES", "SEVERITIES", "SEVERITY", "SCOPES", "STOPPED_REPORTING",
           "ALERT_SPECS", "BY_RULE", "RUNBOOK", "MODES", "VARIANTS", "FIX_VARIANTS", "VARIANT_LABELS",
           "VARIANT_CODE", "INJECTED", "check_port", "markdown_table"]

# --- kernel variants and modes ------------------------------------------------------------------

MODES = ("own_kernel", "observe")  # MonitorConfig.mode: run flashwatch's kernel, or measure beside the model's SDPA
FORMATS = ("bf16", "fp8_e4m3", "fp8_e5m2", "mxfp4")  # MonitorConfig.format: the P_bar V product's number format (kernels.formats)
VARIANTS = ("plain", "fixed", "fp32_delta")  # flashwatch.kernels' variants, in order of how much they fix
FIX_VARIANTS = ("fixed", "fp32_delta")  # what MonitorConfig.auto_fix may switch a flagged layer to
# The `variant` label of flashwatch_kernel_variant: "sdpa" (the model's own attention, observed),
# then VARIANTS. The order is the code ranks compare in a distributed run (the largest wins):
# a layer any rank switched to a fix runs that fix on every rank.
VARIANT_LABELS = ("sdpa",) + VARIANTS
VARIANT_CODE = {label: code for code, label in enumerate(VARIANT_LABELS)}

# --- injected faults ------------------------------------------------------------------------------

INJECTED = "INJECTED"  # every output of a run with an injected fault says so with this word

# --- alert rules ----------------------------------------------------------------------------------

SEVERITIES = ("warning", "critical")
# What an alert is about: one head (labels layer, head >= 0), one layer (layer >= 0, head = -1),
# the whole run (layer = head = -1), or either of head and run (non_finite: the loss or gradient
# norm, or one head's statistics).
SCOPES = ("head", "layer", "run", "head or run")
RUNBOOK = "docs/ALERTS.md"  # the runbook: one section per alert, anchored by its rule name


@dataclass(frozen=True)
class RuleSpec:
    """One alert rule: its name, how serious it is, and what a person should know about it.

    Attributes:
        name: the ``rule`` label (``flashwatch_alerts_total``, ``flashwatch_alert_active``, the
            Prometheus alerts) and the runbook anchor.
        severity: ``"warning"`` (look at it) or ``"critical"`` (the run is failing or wasting
            time: act now).
        summary: one line: what fired.
        meaning: what it means (a paragraph).
        action: what to do (a paragraph).
        scope: one of ``SCOPES``.
        signal: the metric (``flashwatch.metrics``) that shows the rule's statistic, or None.
        settings: the ``MonitorConfig`` fields that decide it.
        decided_by: ``"monitor"`` (a detector decides; Prometheus alerts on the exported
            decision) or ``"prometheus"`` (only Prometheus can see it).
        hysteresis: whether the rule compares a value with a threshold, so that an alert holds
            until the value falls below ``clear_ratio`` of it (False: a yes/no condition).
    """

    name: str
    severity: str
    summary: str
    meaning: str
    action: str
    scope: str = "head"
    signal: str | None = None
    settings: tuple[str, ...] = ()
    decided_by: str = "monitor"
    hysteresis: bool = True

    def __post_init__(self) -> None:
        if self.severity not in SEVERITIES:
            raise ValueError(f"rule {self.name!r}: severity must be one of {SEVERITIES}, got {self.severity!r}")
        if self.scope not in SCOPES:
            raise ValueError(f"rule {self.name!r}: scope must be one of {SCOPES}, got {self.scope!r}")
        if self.decided_by not in ("monitor", "prometheus"):
            raise ValueError(f"rule {self.name!r}: decided_by must be 'monitor' or 'prometheus', "
                             f"got {self.decided_by!r}")

    @property
    def alert(self) -> str:
        """The Prometheus alert name: ``delta_drift`` -> ``FlashwatchDeltaDrift``."""
        return "Flashwatch" + "".join(w.capitalize() for w in self.name.split("_"))

    @property
    def runbook(self) -> str:
        """Where the runbook section is, relative to the repository root."""
        return f"{RUNBOOK}#{self.name}"


RULE_SPECS: tuple[RuleSpec, ...] = (
    RuleSpec(
        "delta_drift", "warning",
        "The delta error of an attention head keeps one sign: BF16 rounding biases its backward.",
        "The error of delta = rowsum(dO * O) that the head's backward used, against the exact "
        "value, has kept one sign over the head's measured monitored steps (|drift z| >= "
        "MonitorConfig.drift_threshold, judged once the head has MonitorConfig.warmup of them). BF16 rounding of the attention output biases W^Q's "
        "gradient the same way at every step (Qiu & Yao's mechanism). It is flashwatch's "
        "earliest signal before a BF16 attention failure, but healthy BF16 runs can raise it too: "
        "it says the mechanism is at work, not that the run will fail. Judged only for layers "
        "whose backward takes delta from the rounded output (observed SDPA, plain, fixed).",
        "Look at repeated_max_rise and max_logit on the same layer: with them the mechanism is "
        "growing, yet tested runs with all three often trained on healthy, so none of them foretells "
        "a failure; checkpoint more often while they hold. To remove the bias, run the layer with the "
        "fp32_delta variant (MonitorConfig(auto_fix=\"fp32_delta\") switches it on this alert) or its "
        "attention in FP32.",
        signal="flashwatch_delta_drift_z",
        settings=("drift_threshold", "warmup", "drift_window_threshold", "drift_include_fp32")),
    RuleSpec(
        "repeated_max_rise", "warning",
        "Rows whose BF16 maximum repeats rose well above the head's own baseline.",
        "The fraction of softmax rows whose largest BF16 score is reached by two or more keys rose "
        "to at least MonitorConfig.repeated_max_factor times its baseline (its mean over the "
        "repeated_max_baseline monitored steps right after warm-up) and repeated_max_margin above it. Ties at the row maximum "
        "make P_bar round to exactly 1 at several keys, which is what makes the BF16 rounding of "
        "P_bar V one-sided. The rise came before every recorded failure, and also in many tested runs "
        "that trained on healthy: it says the mechanism is at work, not that the run will fail.",
        "Read it with delta_drift on the same head: together they are the failure mechanism at "
        "work. Checkpoint now; to remove the bias, switch the layer to fp32_delta (with "
        "MonitorConfig(auto_fix=\"fp32_delta\") set, this alert switches it) or lower the learning rate.",
        signal="flashwatch_repeated_max_ratio_bf16",
        settings=("repeated_max_factor", "repeated_max_margin", "warmup", "repeated_max_baseline")),
    RuleSpec(
        "wq_growth", "warning",
        "A head's W^Q spectral norm grew fast over the last window.",
        "sigma_max(W^Q_h) grew by at least MonitorConfig.wq_growth_factor over the last `window` "
        "monitored steps, judged only once the comparison point lies after warm-up (never against "
        "the weights at initialisation, which grow fast in every run). A persistent one-sided "
        "gradient error piles up along one direction of W^Q. In tested runs it came from a few "
        "hundred to several thousand steps before blow-ups, and also in many runs that survived.",
        "Checkpoint now. Look for delta_drift and max_logit on the same layer; if they hold, switch "
        "the layer to fp32_delta or lower the learning rate (QK-norm or QK-clip bound the growth).",
        signal="flashwatch_wq_spectral_norm", settings=("wq_growth_factor", "window", "warmup")),
    RuleSpec(
        "wq_outlier", "warning",
        "A head's W^Q spectral norm is far above its layer's median head.",
        "sigma_max(W^Q_h) divided by the median over the layer's heads reached "
        "MonitorConfig.wq_outlier_ratio. Qiu & Yao found a few heads with outsized norms in the "
        "failing layer; on its own this separated failing from healthy runs poorly.",
        "No action on its own. Note the head, and look for delta_drift and wq_growth on it.",
        signal="flashwatch_wq_spectral_norm", settings=("wq_outlier_ratio", "warmup")),
    RuleSpec(
        "max_logit", "warning",
        "A head's largest attention score reached the bound.",
        "The largest scaled score sm_scale * q.k of the head reached MonitorConfig.max_logit_bound. "
        "Large logits saturate the softmax (ties at the maximum, P_bar rounding to 1). Healthy runs "
        "pass QK-Clip's 100 early; the default bound was passed before every tested blow-up, but "
        "also in many runs that survived: weak evidence alone.",
        "Checkpoint. If delta_drift or repeated_max_rise hold on the same layer, the mechanism is at "
        "work there: switch the layer to fp32_delta or lower the learning rate; QK-norm or QK-clip "
        "bound the logits.",
        signal="flashwatch_max_logit", settings=("max_logit_bound",)),
    RuleSpec(
        "non_finite", "critical",
        "NaN or infinity in the loss, the gradient norm or a head's statistics.",
        "The loss or the gradient norm (layer and head -1), or a head's statistics (delta error, "
        "max logit, W^Q spectral norm), is NaN or infinite: the run has diverged or is diverging. "
        "The head's cumulative sums skip the value. FP16 with a loss scaler: pass it, "
        "monitor.step(..., grad_scaler=scaler), so that a step the scaler skips (its gradients "
        "overflowed) reads as not measured instead of raising this.",
        "Stop and restore the last good checkpoint (MonitorConfig(stop_on={\"non_finite\"}) stops "
        "the run). The alerts before it name the layer to blame; resume with fp32_delta on it, a "
        "lower learning rate or gradient clipping.",
        scope="head or run", hysteresis=False),
    RuleSpec(
        "loss_spike", "critical",
        "The loss jumped far above its running mean.",
        "The monitored loss is above the last one and above the running mean of the last "
        "MonitorConfig.loss_spike_window monitored losses by loss_spike_rtol times |mean| "
        "(Lightning's SpikeDetection rule, kept for comparison). By the time it fires, a failing "
        "run is failing: it did not warn ahead of the recorded blow-ups.",
        "Check non_finite and the attention alerts before it. Restore a checkpoint from before the "
        "spike and resume with a lower learning rate or fp32_delta on the flagged layer; a single "
        "spike that recovers may be one bad batch.",
        scope="run", signal="flashwatch_loss",
        settings=("loss_spike_rtol", "loss_spike_atol", "loss_spike_window")),
    RuleSpec(
        "attention_coverage", "warning",
        "None of a layer's attention calls at a monitored step could be measured in full.",
        "flashwatch measured none of the layer's attention calls at the monitored step in full "
        "(flashwatch_attention_coverage is 0): every call used something the statistics cannot "
        "take, or its statistics pass failed (logged), or its backward never ran, or flashwatch saw "
        "no call at all (the layer's attention is code other than "
        "torch.nn.functional.scaled_dot_product_attention, such as Hugging Face's eager attention, "
        "or monitor.step() is called more than once per optimizer step, so that a monitored step "
        "had no forward and backward of its own). "
        "With attention dropout the repeated maxima and max logit are still measured, the delta "
        "error is not; with causal attention over query and key lengths that differ, or a head "
        "dimension or dtype outside the kernel's, nothing is. The layer's delta error and drift z "
        "read NaN and the delta_drift rule neither fires nor clears on it (an alert it had holds): "
        "blind, not healthy. The flashwatch log names the reason once per layer.",
        "Make the monitored calls measurable: turn attention dropout off (Hugging Face: "
        "attn_pdrop=0.0), call torch's scaled_dot_product_attention (Hugging Face: "
        "attn_implementation='sdpa'), or leave the layer out with MonitorConfig.layers. Until then, "
        "do not read the layer's silence as health.",
        scope="layer", signal="flashwatch_attention_coverage", hysteresis=False),
)

STOPPED_REPORTING = RuleSpec(
    "stopped_reporting", "warning",
    "A run's endpoint still answers, but no new monitored step came for a long while.",
    "The last monitored step (flashwatch_last_step_timestamp_seconds; before the first, the start of "
    "monitoring) is older than dashboards/alerts.yml allows while Prometheus still scrapes the run's "
    "endpoint: the training loop is hung (in its first forward or compilation, a collective waiting for a rank "
    "that died, a stalled data loader), paused longer than usual (a long evaluation or checkpoint), "
    "stopped calling monitor.step(), or every monitored step fails inside flashwatch (its log says "
    "'the last N monitored steps all failed'). A process that exited is not this rule's: its target is "
    "down (up == 0, Prometheus's own target-down alerts), and a finished run looks the same as a "
    "crashed one. Runs that push to a Pushgateway are not judged (their last values stay after the "
    "job ends).",
    "Look at the training process: its stack (py-spy dump), GPU utilisation, the logs of every "
    "rank. If it is hung, stop it and resume from the last checkpoint. If long pauses are normal "
    "for the run, raise the age in the rule's expression (dashboards/alerts.yml).",
    scope="run", signal="flashwatch_last_step_timestamp_seconds", decided_by="prometheus")

RULES: tuple[str, ...] = tuple(r.name for r in RULE_SPECS)  # the Monitor's rules, in detector order
SEVERITY: dict[str, str] = {r.name: r.severity for r in RULE_SPECS}
ALERT_SPECS: tuple[RuleSpec, ...] = RULE_SPECS + (STOPPED_REPORTING,)  # every alert, in runbook order
BY_RULE: dict[str, RuleSpec] = {r.name: r for r in ALERT_SPECS}

# --- arguments ------------------------------------------------------------------------------------


def check_port(port: Any, name: str = "port", *, allow_none: bool = True) -> int | None:
    """Return ``port`` if flashwatch can serve on it, else raise ``ValueError`` naming ``name``.

    Accepted: an int in 0..65535 (0 picks a free port) and, with ``allow_none``, None (serve
    nothing). Whether the port is free is learnt only by binding it.
    """
    ok = isinstance(port, int) and not isinstance(port, bool) and 0 <= port <= 65535
    if ok or (allow_none and port is None):
        return port
    accepted = "an int in 0..65535 (0: any free port)" + (" or None (no HTTP server)" if allow_none else "")
    raise ValueError(f"{name} must be {accepted}, got {port!r}")


# --- the alert table -----------------------------------------------------------------------------


def markdown_table(link: str | None = "docs/ALERTS.md") -> str:
    """The alert table (rule | severity | what it means | what to do), in ``ALERT_SPECS`` order.

    ``link``: the runbook path each rule name links to (``"#"`` inside the runbook itself), or
    None for plain names.
    """
    rows = ["| rule | severity | what it means | what to do |", "|---|---|---|---|"]
    for r in ALERT_SPECS:
        name = f"`{r.name}`" if link is None else f"[`{r.name}`]({'' if link == '#' else link}#{r.name})"
        rows.append(f"| {name} | {r.severity} | {_cell(r.summary)} | {_cell(r.action)} |")
    return "\n".join(rows)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


if __name__ == "__main__":
    print(markdown_table())
