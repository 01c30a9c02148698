"""Detectors: rules that look at one monitored step's signals and decide; they never act.

Each detector's ``update(signals) -> list[Alert]`` returns the alerts that *start* at this step.
An alert is keyed by (layer, head) and stands for one episode of its condition: raised once when
the episode starts, active (``detector.active``) while it lasts, cleared once when it ends.

- In value, an "above threshold" condition holds while the value stays above ``threshold -
  (1 - clear_ratio) * |threshold|`` (``clear_ratio``).
- In time (warning rules), an episode ends only after its condition has been clear at
  ``clear_steps`` consecutive monitored steps (of its layer): a value dipping below and coming
  back sooner continues the episode and raises nothing; and after an episode ended, the same
  (rule, layer, head) starts no new alert for ``alert_gap`` monitored steps. Critical rules
  (``non_finite``, ``loss_spike``) are never held back: each recurrence is raised, and an
  episode ends at its first clear step.

Warm-up and thresholds come from ``MonitorConfig`` (docs/CALIBRATION.md has the evidence behind
the defaults). Logging, counting, exporting, switching variants and stopping are the Monitor's
job.

Rules (``RULES``; the ``rule`` label of ``flashwatch_alerts_total`` and ``flashwatch_alert_active``).
Their names, severities, meaning and what to do when one fires live in ``flashwatch.vocabulary``
(the runbook: docs/ALERTS.md); here is how each is decided:

- ``delta_drift``: |z| of the signed delta error >= ``drift_threshold`` after
  ``warmup`` monitored steps of that head; optionally the windowed |z| too. It says the BF16
  bias of delta (the mechanism) is at work, not that the run will fail: it comes long before a
  blow-up, and healthy BF16 runs can raise it too. Read it with ``repeated_max_rise`` and
  ``max_logit``, which tell the two apart (docs/CALIBRATION.md). Judged only for
  layers whose backward takes delta from the rounded (BF16/FP16) output: observed SDPA/FA2 and
  flashwatch's ``plain`` and ``fixed``; not for FP32 attention nor for layers running
  ``fp32_delta`` (the remedy), unless ``drift_include_fp32``.
- ``repeated_max_rise``: the BF16 repeated-max ratio >= ``repeated_max_factor`` x its
  own baseline (mean over ``repeated_max_baseline`` monitored steps after warm-up) and at least
  ``repeated_max_margin`` above it.
- ``wq_growth``: sigma_t / sigma_{t-W} >= ``wq_growth_factor``, judged only once the
  comparison point t-W lies after warm-up (monitored step >= ``warmup + window``), never
  against the weights at initialisation.
- ``wq_outlier``: sigma_h / median over the layer's heads >= ``wq_outlier_ratio``.
- ``max_logit``: max logit >= ``max_logit_bound`` (weak evidence alone).
- ``non_finite``: NaN/inf in the loss, the gradient norm or a head's statistics.
- ``loss_spike``: as Lightning's ``SpikeDetection`` (running mean of the last
  ``loss_spike_window`` monitored losses; loss above the last one and above the mean by
  ``loss_spike_rtol`` x |mean| (and ``loss_spike_atol``)), for comparison.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from .vocabulary import RULES, SEVERITIES, SEVERITY

if TYPE_CHECKING:  # tensors arrive from the Monitor; deciding needs no torch import
    import torch

__all__ = ["RULES", "SEVERITIES", "Alert", "LayerSignals", "StepSignals", "Detector", "DeltaDriftDetector",
           "RepeatedMaxRiseDetector", "WqGrowthDetector", "WqOutlierDetector", "MaxLogitDetector",
           "NonFiniteDetector", "LossSpikeDetector", "build_detectors"]


@dataclass(frozen=True)
class Alert:
    """One alert event (docs/INTERFACES.md).

    Attributes:
        rule: one of ``RULES``.
        step: the optimizer step at which it started.
        layer: layer index (the ``layer`` label), -1 if not about one layer.
        head: head index, -1 if not about one head.
        value: the value that crossed the threshold (e.g. z, a ratio, the loss).
        threshold: the threshold it crossed.
        severity: ``"warning"`` or ``"critical"`` (the rule's, ``flashwatch.vocabulary.SEVERITY``).
        message: one line for humans.
    """

    rule: str
    step: int
    layer: int
    head: int
    value: float
    threshold: float
    severity: str
    message: str

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Alert":
        return cls(**{k: d[k] for k in ("rule", "step", "layer", "head", "value", "threshold", "severity",
                                        "message")})


@dataclass
class LayerSignals:
    """One layer's host-side signals at a monitored step; every tensor is (H,) float64 on the CPU.

    ``seen`` is False when no attention call of this layer was measured at this step (then the
    detectors leave the layer's alerts as they are).
    """

    layer: int
    seen: bool
    rows: torch.Tensor
    repeated_max_ratio: torch.Tensor
    repeated_max_ratio_bf16: torch.Tensor
    max_logit: torch.Tensor
    delta_error: torch.Tensor
    delta_cumulative: torch.Tensor
    drift_z: torch.Tensor
    drift_window_z: torch.Tensor
    drift_count: torch.Tensor  # monitored steps with a finite e_t, per head (int64)
    wq_sigma: torch.Tensor
    wq_growth: torch.Tensor
    wq_ratio: torch.Tensor
    low_precision: bool = True  # attention output was BF16/FP16 (delta error is meaningful)
    variant: str | None = None  # what the layer ran at this step: "sdpa" (observed), "plain", "fixed", "fp32_delta"
    # the W^Q-gradient error chain (flashwatch.chain; NaN where not measured) and windowed trends
    wq_error_push: torch.Tensor | None = None
    wq_error_push_true: torch.Tensor | None = None  # the true W^Q gradient's push at this step
    wq_error_push_cumulative: torch.Tensor | None = None
    wq_error_push_share: torch.Tensor | None = None
    wq_error_alignment: torch.Tensor | None = None
    wq_error_coherence: torch.Tensor | None = None
    max_logit_growth: torch.Tensor | None = None  # d log(max logit) per 1,000 optimizer steps over the window
    wq_sigma_growth_rate: torch.Tensor | None = None  # d log(sigma) per 1,000 optimizer steps over the window
    repeated_max_bf16_trend: torch.Tensor | None = None  # d(BF16 repeated-max ratio) per 1,000 optimizer steps
    repeated_max_ratio_format: torch.Tensor | None = None  # rows whose P_bar rounds to 1 at 2+ keys in MonitorConfig.format
    coverage: float = math.nan  # attention calls measured in full / attention calls at this step (0: no call seen)
    calls: int | None = None  # attention calls of the layer seen at this step (None: not counted)
    delta_measured: bool = True  # whether this step's delta error was measured (False: NaN, not a failure)

    @property
    def delta_from_rounded_output(self) -> bool:
        """Whether the backward took delta from the rounded (BF16/FP16) output at this step: a
        low-precision output and not ``fp32_delta`` (which takes delta from the FP32 output)."""
        return self.low_precision and self.variant != "fp32_delta"


@dataclass
class StepSignals:
    """Everything the detectors see at one monitored step (host data).

    Attributes:
        step: the optimizer step.
        index: how many monitored steps came before this one (warm-up counts these).
        loss, grad_norm: floats, NaN if not given.
        layers: one ``LayerSignals`` per attached layer, in layer order.
    """

    step: int
    index: int
    loss: float = math.nan
    grad_norm: float = math.nan
    layers: list[LayerSignals] = field(default_factory=list)
    loss_given: bool = False
    grad_norm_given: bool = False


def _hold_threshold(threshold: float, clear_ratio: float) -> float:
    """Below this an active "above threshold" alert clears (also right for thresholds <= 0)."""
    return threshold - (1.0 - clear_ratio) * abs(threshold)


class Detector:
    """Base class: per-(layer, head) episodes (hysteresis) and state. Subclasses implement ``update``.

    Args:
        clear_ratio: hysteresis factor in (0, 1] (see the module docstring).
        clear_steps: monitored steps the condition must be clear before an episode ends (>= 1;
            1: at the first clear step); warning rules only.
        alert_gap: monitored steps after an episode ended before the same key may start a new
            one (0: at once); warning rules only.
    """

    rule = ""

    def __init__(self, clear_ratio: float = 0.9, clear_steps: int = 1, alert_gap: int = 0):
        self.clear_ratio = clear_ratio
        self.clear_steps, self.alert_gap = clear_steps, alert_gap
        self._active: dict[tuple[int, int], Alert] = {}
        self._clear_for: dict[tuple[int, int], int] = {}  # active keys: consecutive clear monitored steps
        self._ended_at: dict[tuple[int, int], int] = {}  # key -> monitored step index its last episode ended
        self._now = 0  # the monitored step index being judged (StepSignals.index)
        self.cleared: list[Alert] = []  # alerts whose episode ended at the last update

    def update(self, signals: StepSignals) -> list[Alert]:
        raise NotImplementedError

    @property
    def severity(self) -> str:
        """The rule's severity (``flashwatch.vocabulary.SEVERITY``)."""
        return SEVERITY[self.rule]

    @property
    def active(self) -> list[Alert]:
        """Alerts holding now, ordered by (layer, head)."""
        return [self._active[k] for k in sorted(self._active)]

    def _begin(self, signals: StepSignals) -> list[Alert]:
        self.cleared = []
        self._now = signals.index
        return []

    def _judge(self, key: tuple[int, int], fires: bool, holds: bool, make) -> Alert | None:
        """One episode per alert: a new alert when ``fires``, none is active and the gap after
        the last episode has passed; the active one ends after ``clear_steps`` steps not ``holds``."""
        if key in self._active:
            if holds:
                self._clear_for.pop(key, None)
                return None
            clear = self._clear_for.get(key, 0) + 1
            if clear < (1 if self.severity == "critical" else self.clear_steps):
                self._clear_for[key] = clear
                return None
            self._clear_for.pop(key, None)
            self.cleared.append(self._active.pop(key))
            self._ended_at[key] = self._now
            return None
        if fires and not self._held_back(key):
            alert = make()
            self._active[key] = alert
            return alert
        return None

    def _held_back(self, key: tuple[int, int]) -> bool:
        """Within ``alert_gap`` monitored steps of the end of this key's last episode (warnings only)."""
        if self.severity == "critical" or key not in self._ended_at:
            return False
        return self._now - self._ended_at[key] <= self.alert_gap

    def _alert(self, step: int, layer: int, head: int, value: float, threshold: float, message: str) -> Alert:
        return Alert(rule=self.rule, step=step, layer=layer, head=head, value=float(value), threshold=float(threshold),
                     severity=self.severity, message=message)

    def state_dict(self) -> dict:
        return {"active": [a.to_dict() for a in self.active],
                "clear_for": [[*k, n] for k, n in sorted(self._clear_for.items())],
                "ended_at": [[*k, i] for k, i in sorted(self._ended_at.items())]}

    def load_state_dict(self, state: dict) -> None:
        self._active = {}
        for d in state.get("active", []):
            a = Alert.from_dict(d)
            self._active[(a.layer, a.head)] = a
        self._clear_for = {(int(l), int(h)): int(n) for l, h, n in state.get("clear_for", [])}
        self._ended_at = {(int(l), int(h)): int(i) for l, h, i in state.get("ended_at", [])}


def _where(layer: int, head: int) -> str:
    return f"layer {layer} head {head}"


class DeltaDriftDetector(Detector):
    """``delta_drift``: the signed delta error keeps one sign (|z| >= threshold after warm-up).

    Judged only for layers whose backward takes delta from the rounded output
    (``LayerSignals.delta_from_rounded_output``): the error the rule is about. Not judged:

    - FP32 attention: e_t is rounding noise of the statistics pass.
    - ``fp32_delta``: delta comes from the FP32 output, so e_t is only the residue of rounding
      P_bar to BF16 for the P_bar V product (e_t compares with delta_hp = rowsum(P * dP) of the
      exact softmax). That residue can keep one sign too, in runs that train fine
      (docs/CALIBRATION.md), and fp32_delta is what ``auto_fix`` switches a flagged layer to:
      an alert on the remedy is not actionable.

    A layer switched to ``fp32_delta`` keeps the alert it had (it records that the layer
    drifted; ``flashwatch_kernel_variant`` shows the fix); its drift z is still computed and
    exported. ``include_fp32`` judges every layer.

    Args:
        threshold: on |z| (cumulative).
        window_threshold: on the windowed |z|, or None to judge the cumulative z only.
        warmup: finite e_t a head must have had before it can fire.
        include_fp32: judge FP32-attention and ``fp32_delta`` layers too.
    """

    rule = "delta_drift"

    def __init__(self, threshold: float = 4.5, window_threshold: float | None = None, warmup: int = 20,
                 include_fp32: bool = False, clear_ratio: float = 0.9, clear_steps: int = 1, alert_gap: int = 0):
        super().__init__(clear_ratio, clear_steps, alert_gap)
        self.threshold, self.window_threshold = threshold, window_threshold
        self.warmup, self.include_fp32 = warmup, include_fp32

    def update(self, signals: StepSignals) -> list[Alert]:
        out = self._begin(signals)
        hold = _hold_threshold(self.threshold, self.clear_ratio)
        whold = None if self.window_threshold is None else _hold_threshold(self.window_threshold, self.clear_ratio)
        for ls in signals.layers:
            if not ls.seen or not ls.delta_measured or not (ls.delta_from_rounded_output or self.include_fp32):
                continue  # not measured at this step: nothing to judge, an alert holds as it was
            z, zw = ls.drift_z.tolist(), ls.drift_window_z.tolist()
            cum, count = ls.delta_cumulative.tolist(), ls.drift_count.tolist()
            for h in range(len(z)):
                ready = count[h] >= self.warmup
                on_cum = abs(z[h]) >= self.threshold
                on_win = self.window_threshold is not None and abs(zw[h]) >= self.window_threshold
                fires = ready and (on_cum or on_win)
                if not fires and (ls.layer, h) not in self._active:
                    continue  # nothing to start or to hold: _judge would do nothing
                holds = abs(z[h]) >= hold or (whold is not None and abs(zw[h]) >= whold)
                value, thr, which = (z[h], self.threshold, "z") if on_cum or not on_win else \
                    (zw[h], self.window_threshold, "windowed z")

                def make(h=h, value=value, thr=thr, which=which):
                    return self._alert(
                        signals.step, ls.layer, h, value, thr,
                        f"{_where(ls.layer, h)}: delta error keeps one sign, drift {which}={value:+.2f} "
                        f"(C_T={cum[h]:+.3g} over {count[h]} monitored steps) >= {thr:g}: BF16 rounding of "
                        "the attention output biases delta = rowsum(dO*O) and W^Q's gradient (Qiu & Yao); "
                        "a failure is likelier if repeated_max_rise or max_logit follow; "
                        "remedy: variant 'fp32_delta'")

                alert = self._judge((ls.layer, h), fires, holds, make)
                if alert:
                    out.append(alert)
        return out


class RepeatedMaxRiseDetector(Detector):
    """``repeated_max_rise``: the BF16 repeated-max ratio rose well above its own early baseline.

    Args:
        factor: fire when ratio >= factor * baseline ...
        margin: ... and ratio >= baseline + margin.
        warmup: monitored steps (with data) of a layer before its baseline starts.
        baseline_steps: monitored steps averaged into the baseline.
    """

    rule = "repeated_max_rise"

    def __init__(self, factor: float = 3.0, margin: float = 0.3, warmup: int = 20, baseline_steps: int = 20,
                 clear_ratio: float = 0.9, clear_steps: int = 1, alert_gap: int = 0):
        super().__init__(clear_ratio, clear_steps, alert_gap)
        self.factor, self.margin, self.warmup, self.baseline_steps = factor, margin, warmup, baseline_steps
        self.seen: dict[int, int] = {}  # layer -> monitored steps with data
        self.baseline_sum: dict[int, list[float]] = {}  # layer -> per-head sum of ratios in the baseline span

    def baseline(self, layer: int) -> list[float] | None:
        """The layer's per-head baselines once complete, else None."""
        if self.seen.get(layer, 0) < self.warmup + self.baseline_steps:
            return None
        return [s / self.baseline_steps for s in self.baseline_sum[layer]]

    def update(self, signals: StepSignals) -> list[Alert]:
        out = self._begin(signals)
        for ls in signals.layers:
            if not ls.seen:
                continue
            ratio = ls.repeated_max_ratio_bf16.tolist()
            n = self.seen.get(ls.layer, 0)
            if self.warmup <= n < self.warmup + self.baseline_steps:
                sums = self.baseline_sum.setdefault(ls.layer, [0.0] * len(ratio))
                for h, r in enumerate(ratio):
                    sums[h] += r if math.isfinite(r) else 0.0
            self.seen[ls.layer] = n + 1
            base = self.baseline(ls.layer) if n >= self.warmup + self.baseline_steps else None
            if base is None:
                continue
            for h, r in enumerate(ratio):
                thr = max(self.factor * base[h], base[h] + self.margin)
                fires = math.isfinite(r) and r >= thr
                if not fires and (ls.layer, h) not in self._active:
                    continue  # nothing to start or to hold: _judge would do nothing
                hold = _hold_threshold(thr, self.clear_ratio)

                def make(h=h, r=r, thr=thr):
                    return self._alert(
                        signals.step, ls.layer, h, r, thr,
                        f"{_where(ls.layer, h)}: BF16 repeated-max rows rose to {r:.1%} from a baseline of "
                        f"{base[h]:.1%} (threshold {thr:.1%}): ties at the row max are what make BF16 "
                        "rounding of P_bar V one-sided")

                alert = self._judge((ls.layer, h), fires, math.isfinite(r) and r >= hold, make)
                if alert:
                    out.append(alert)
        return out

    def state_dict(self) -> dict:
        return {**super().state_dict(), "seen": dict(self.seen),
                "baseline_sum": {k: list(v) for k, v in self.baseline_sum.items()}}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.seen = {int(k): int(v) for k, v in state.get("seen", {}).items()}
        self.baseline_sum = {int(k): [float(x) for x in v] for k, v in state.get("baseline_sum", {}).items()}


class _PerHeadAbove(Detector):
    """Shared shape of the simple "value >= threshold" per-head rules."""

    def __init__(self, threshold: float, warmup: int = 0, clear_ratio: float = 0.9, clear_steps: int = 1,
                 alert_gap: int = 0):
        super().__init__(clear_ratio, clear_steps, alert_gap)
        self.threshold, self.warmup = threshold, warmup

    def _values(self, ls: LayerSignals) -> torch.Tensor:
        raise NotImplementedError

    def _message(self, layer: int, head: int, value: float) -> str:
        raise NotImplementedError

    def update(self, signals: StepSignals) -> list[Alert]:
        out = self._begin(signals)
        if signals.index < self.warmup:
            return out
        hold = _hold_threshold(self.threshold, self.clear_ratio)
        for ls in signals.layers:
            if not ls.seen:
                continue
            active = self._active
            for h, v in enumerate(self._values(ls).tolist()):
                if not v >= self.threshold and (ls.layer, h) not in active:
                    continue  # below the threshold or NaN, no alert to hold: _judge would do nothing
                finite = math.isfinite(v)
                alert = self._judge((ls.layer, h), finite and v >= self.threshold, finite and v >= hold,
                                    lambda h=h, v=v: self._alert(signals.step, ls.layer, h, v, self.threshold,
                                                                 self._message(ls.layer, h, v)))
                if alert:
                    out.append(alert)
        return out


class WqGrowthDetector(_PerHeadAbove):
    """``wq_growth``: a head's W^Q spectral norm grew by ``threshold`` x over the window.

    Growth is sigma_t / sigma_(t - window). It is judged only once the comparison point t - window
    lies after warm-up (monitored step index >= ``warmup + window``): W^Q grows fastest from its
    initialisation, in healthy runs as much as in failing ones, which says nothing about a
    failure.

    Args:
        threshold: growth factor over the window.
        warmup: monitored steps before the comparison point may lie.
        window: monitored steps between sigma_t and the sigma it is compared with.
    """

    rule = "wq_growth"

    def __init__(self, threshold: float, warmup: int = 0, window: int = 50, clear_ratio: float = 0.9,
                 clear_steps: int = 1, alert_gap: int = 0):
        super().__init__(threshold, warmup + window, clear_ratio, clear_steps, alert_gap)
        self.window = window

    def _values(self, ls):
        return ls.wq_growth

    def _message(self, layer, head, value):
        return (f"{_where(layer, head)}: W^Q spectral norm grew x{value:.2f} over the window "
                f"(threshold x{self.threshold:g}); a persistent one-sided gradient error piles up along one "
                "direction of W^Q")


class WqOutlierDetector(_PerHeadAbove):
    """``wq_outlier``: a head's W^Q spectral norm is ``threshold`` x its layer's median head."""

    rule = "wq_outlier"

    def _values(self, ls):
        return ls.wq_ratio

    def _message(self, layer, head, value):
        return (f"{_where(layer, head)}: W^Q spectral norm is x{value:.2f} the layer's median head "
                f"(threshold x{self.threshold:g})")


class MaxLogitDetector(_PerHeadAbove):
    """``max_logit``: a head's largest scaled score reached the bound (``max_logit_bound``)."""

    rule = "max_logit"

    def _values(self, ls):
        return ls.max_logit

    def _message(self, layer, head, value):
        return (f"{_where(layer, head)}: max logit {value:.4g} >= {self.threshold:g}; weak evidence alone "
                "(healthy runs can hold large logits): read it with delta drift and repeated-max rows")


class NonFiniteDetector(Detector):
    """``non_finite``: NaN/inf in the loss, the gradient norm or a head's statistics.

    Keys: (-1, -1) for the loss and gradient norm, (layer, head) for statistics (delta error,
    max logit, W^Q norm). Holds while the value stays non-finite.
    """

    rule = "non_finite"

    def update(self, signals: StepSignals) -> list[Alert]:
        out = self._begin(signals)
        bad = [(name, v) for name, v, given in (("loss", signals.loss, signals.loss_given),
                                                ("grad_norm", signals.grad_norm, signals.grad_norm_given))
               if given and not math.isfinite(v)]
        if signals.loss_given or signals.grad_norm_given:
            value = bad[0][1] if bad else 0.0
            alert = self._judge((-1, -1), bool(bad), bool(bad), lambda: self._alert(
                signals.step, -1, -1, value, math.inf,
                f"non-finite {' and '.join(n for n, _ in bad)} ({', '.join(f'{n}={v}' for n, v in bad)}) at step "
                f"{signals.step}"))
            if alert:
                out.append(alert)
        for ls in signals.layers:
            if not ls.seen:
                continue
            fields = {"delta_error": ls.delta_error.tolist(), "max_logit": ls.max_logit.tolist(),
                      "wq_spectral_norm": ls.wq_sigma.tolist()}
            if not ls.delta_measured:  # NaN there means "not measured" (attention dropout), not divergence
                fields["delta_error"] = [0.0] * len(fields["delta_error"])
            if not any(key[0] == ls.layer for key in self._active) and \
                    all(math.isfinite(v) for vals in fields.values() for v in vals):
                continue  # every value finite, no alert to hold: _judge would do nothing
            for h in range(len(fields["delta_error"])):
                names = [n for n, vals in fields.items() if not math.isfinite(vals[h])]
                value = fields[names[0]][h] if names else 0.0
                alert = self._judge((ls.layer, h), bool(names), bool(names), lambda h=h, names=names, value=value:
                                    self._alert(signals.step, ls.layer, h, value, math.inf,
                                                f"{_where(ls.layer, h)}: non-finite {', '.join(names)} "
                                                f"({value}); this head's cumulative sums skip the value"))
                if alert:
                    out.append(alert)
        return out


class LossSpikeDetector(Detector):
    """``loss_spike``: as Lightning's ``SpikeDetection`` (mode "min"), on monitored losses.

    A loss is a spike when it is above the last non-spike loss, and above the running mean of
    the last ``window`` non-spike finite losses by at least ``rtol`` x |mean| (and ``atol`` if
    set). Spikes, and losses while a spike alert holds, stay out of the mean. Non-finite losses
    are the ``non_finite`` rule's.
    """

    rule = "loss_spike"

    def __init__(self, rtol: float | None = 2.0, atol: float | None = None, window: int = 10,
                 clear_ratio: float = 0.9, clear_steps: int = 1, alert_gap: int = 0):
        super().__init__(clear_ratio, clear_steps, alert_gap)
        self.rtol, self.atol, self.window = rtol, atol, window
        self.losses: deque[float] = deque(maxlen=window)
        self.last: float | None = None

    def _excess(self, loss: float, mean: float, scale: float) -> bool:
        diff = loss - mean
        ok_r = self.rtol is None or diff >= scale * self.rtol * abs(mean)
        ok_a = self.atol is None or diff >= scale * self.atol
        return ok_r and ok_a

    def update(self, signals: StepSignals) -> list[Alert]:
        out = self._begin(signals)
        loss = signals.loss
        if not signals.loss_given or not math.isfinite(loss):
            return out
        if not self.losses:
            self.losses.append(loss)
            self.last = loss
            return out
        mean = math.fsum(self.losses) / len(self.losses)
        spike = loss > self.last and self._excess(loss, mean, 1.0)
        holds = loss > self.last and self._excess(loss, mean, self.clear_ratio)
        thr = mean + (self.rtol or 0.0) * abs(mean)
        alert = self._judge((-1, -1), spike, holds, lambda: self._alert(
            signals.step, -1, -1, loss, thr,
            f"loss spike: {loss:.4g} against a running mean of {mean:.4g} over {len(self.losses)} monitored steps "
            f"(rtol {self.rtol})"))
        if alert:
            out.append(alert)
        if (-1, -1) not in self._active:  # spikes, and losses while one holds, stay out of the mean
            self.losses.append(loss)
            self.last = loss
        return out

    def state_dict(self) -> dict:
        return {**super().state_dict(), "losses": list(self.losses), "last": self.last}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.losses = deque((float(x) for x in state.get("losses", [])), maxlen=self.window)
        self.last = state.get("last")


class CoverageDetector(Detector):
    """``attention_coverage``: none of a layer's attention calls at a monitored step was measured
    in full (coverage 0), or flashwatch saw no attention call of the layer at all (its attention
    is code flashwatch does not reach, or no backward ran). Key (layer, -1); clears by the episode
    rules (``clear_steps`` monitored steps in a row that measure the layer); a step whose calls
    were not counted (coverage NaN: an old recording) changes nothing."""

    rule = "attention_coverage"

    def update(self, signals: StepSignals) -> list[Alert]:
        out = self._begin(signals)
        for ls in signals.layers:
            if math.isnan(ls.coverage):
                continue
            blind = ls.coverage == 0.0
            alert = self._judge((ls.layer, -1), blind, blind, lambda ls=ls: self._alert(
                signals.step, ls.layer, -1, ls.coverage, 0.0, self._message(signals.step, ls)))
            if alert:
                out.append(alert)
        return out

    @staticmethod
    def _message(step: int, ls: LayerSignals) -> str:
        if ls.calls == 0:
            return (f"layer {ls.layer}: flashwatch saw no attention call of it at step {step} (coverage 0): nothing "
                    "of its attention is measured. Does it call torch.nn.functional.scaled_dot_product_attention "
                    "(Hugging Face: attn_implementation='sdpa'), with a backward at monitored steps?")
        return (f"layer {ls.layer}: none of its attention calls at step {step} was measured in full (coverage 0): its "
                "delta error and drift are blind, not healthy (the flashwatch log names the reason)")


def build_detectors(config: Any) -> list[Detector]:
    """One detector per rule of ``RULES``, in that order, configured from a ``MonitorConfig``."""
    c = config
    ep = dict(clear_ratio=c.clear_ratio, clear_steps=c.clear_steps, alert_gap=c.alert_gap)  # episodes
    return [
        DeltaDriftDetector(c.drift_threshold, c.drift_window_threshold, c.warmup, c.drift_include_fp32, **ep),
        RepeatedMaxRiseDetector(c.repeated_max_factor, c.repeated_max_margin, c.warmup, c.repeated_max_baseline, **ep),
        WqGrowthDetector(c.wq_growth_factor, c.warmup, c.window, **ep),
        WqOutlierDetector(c.wq_outlier_ratio, c.warmup, **ep),
        MaxLogitDetector(c.max_logit_bound, 0, **ep),
        NonFiniteDetector(**ep),
        LossSpikeDetector(c.loss_spike_rtol, c.loss_spike_atol, c.loss_spike_window, **ep),
        CoverageDetector(**ep),
    ]
