"""Detectors decide only: warm-up, thresholds, hysteresis, state; one test per rule."""

from __future__ import annotations

import math

import pytest
import torch

from flashwatch import MonitorConfig, vocabulary
from flashwatch.detectors import (RULES, Alert, DeltaDriftDetector, LayerSignals, LossSpikeDetector,
                                  MaxLogitDetector, NonFiniteDetector, RepeatedMaxRiseDetector, StepSignals,
                                  WqGrowthDetector, WqOutlierDetector, build_detectors)

H = 3


def _t(values, default=0.0):
    if values is None:
        values = [default] * H
    return torch.tensor(values, dtype=torch.float64)


def layer(index=0, *, seen=True, ratio_bf16=None, max_logit=None, e=None, cum=None, z=None, zw=None, count=None,
          sigma=None, growth=None, wq_ratio=None, low_precision=True, variant=None):
    return LayerSignals(
        layer=index, seen=seen, rows=_t(None, 100.0), repeated_max_ratio=_t(None, 0.01),
        repeated_max_ratio_bf16=_t(ratio_bf16, 0.02), max_logit=_t(max_logit, 5.0), delta_error=_t(e),
        delta_cumulative=_t(cum), drift_z=_t(z), drift_window_z=_t(zw),
        drift_count=torch.tensor(count if count is not None else [100] * H, dtype=torch.int64),
        wq_sigma=_t(sigma, 1.0), wq_growth=_t(growth, float("nan")), wq_ratio=_t(wq_ratio, 1.0),
        low_precision=low_precision, variant=variant)


def step(t, *layers, index=None, loss=None, grad_norm=None):
    return StepSignals(step=t, index=t if index is None else index, loss=math.nan if loss is None else loss,
                       grad_norm=math.nan if grad_norm is None else grad_norm, layers=list(layers),
                       loss_given=loss is not None, grad_norm_given=grad_norm is not None)


def test_rules_and_alert_contract():
    assert RULES == ("delta_drift", "repeated_max_rise", "wq_growth", "wq_outlier", "max_logit", "non_finite",
                     "loss_spike", "attention_coverage")
    assert RULES is vocabulary.RULES  # re-exported, not copied
    detectors = build_detectors(MonitorConfig())
    assert [d.rule for d in detectors] == list(RULES)
    assert {d.rule: d.severity for d in detectors} == vocabulary.SEVERITY
    assert vocabulary.SEVERITY == {"delta_drift": "warning", "repeated_max_rise": "warning", "wq_growth": "warning",
                                   "wq_outlier": "warning", "max_logit": "warning", "non_finite": "critical",
                                   "loss_spike": "critical", "attention_coverage": "warning"}
    a = Alert(rule="max_logit", step=3, layer=1, head=2, value=120.0, threshold=100.0, severity="warning",
              message="m")
    assert a.to_dict() == {"rule": "max_logit", "step": 3, "layer": 1, "head": 2, "value": 120.0,
                           "threshold": 100.0, "severity": "warning", "message": "m"}
    assert Alert.from_dict(a.to_dict()) == a
    with pytest.raises(Exception):
        a.step = 4  # frozen


def test_delta_drift_fires_once_after_warmup_then_holds_and_clears_with_hysteresis():
    d = DeltaDriftDetector(threshold=4.0, warmup=5)
    # before warm-up nothing fires, however large z
    assert d.update(step(0, layer(z=[9.0, 0, 0], count=[4, 4, 4]))) == []
    new = d.update(step(1, layer(z=[-4.5, 1.0, 0], cum=[-0.3, 0, 0], count=[5, 5, 5])))
    assert [(a.rule, a.layer, a.head, a.value, a.threshold, a.severity) for a in new] == \
        [("delta_drift", 0, 0, -4.5, 4.0, "warning")]
    assert "drift z=-4.50" in new[0].message and "fp32_delta" in new[0].message
    assert d.update(step(2, layer(z=[-3.7, 0, 0]))) == []  # still holds above 0.9 * 4
    assert [a.head for a in d.active] == [0]
    d.update(step(3, layer(z=[-3.5, 0, 0])))  # below 3.6: cleared
    assert d.active == [] and [a.head for a in d.cleared] == [0]
    assert len(d.update(step(4, layer(z=[-4.1, 0, 0])))) == 1  # fires again after clearing


def test_delta_drift_windowed_threshold_and_fp32_gate():
    d = DeltaDriftDetector(threshold=4.0, window_threshold=3.0, warmup=0)
    new = d.update(step(0, layer(z=[1.0, 0, 0], zw=[0, -3.2, 0])))
    assert [(a.head, a.value, a.threshold) for a in new] == [(1, -3.2, 3.0)] and "windowed z" in new[0].message
    d = DeltaDriftDetector(threshold=4.0, warmup=0)
    assert d.update(step(0, layer(z=[5.0, 0, 0], low_precision=False))) == []  # FP32 output: rounding noise only
    d = DeltaDriftDetector(threshold=4.0, warmup=0, include_fp32=True)
    assert len(d.update(step(0, layer(z=[5.0, 0, 0], low_precision=False)))) == 1
    assert d.update(step(1, layer(seen=False, z=[0.0, 0, 0]))) == [] and len(d.active) == 1  # unseen: unchanged


def test_delta_drift_judges_only_layers_whose_delta_comes_from_the_rounded_output():
    """fp32_delta takes delta from the FP32 output: its e_t is the residue of rounding P_bar for
    P_bar V, which kept one sign in healthy GPU runs (|z| up to 8.8); an alert there would fire
    on the remedy auto_fix switches to. Observed SDPA, plain and fixed are judged."""
    for variant in ("sdpa", "plain", "fixed", None):
        d = DeltaDriftDetector(threshold=4.0, warmup=0)
        assert len(d.update(step(0, layer(z=[5.0, 0, 0], variant=variant)))) == 1, variant
    d = DeltaDriftDetector(threshold=4.0, warmup=0)
    assert d.update(step(0, layer(z=[9.0, -6.0, 0], variant="fp32_delta"))) == []
    assert layer(variant="fp32_delta").delta_from_rounded_output is False
    assert layer(variant="plain", low_precision=False).delta_from_rounded_output is False
    d = DeltaDriftDetector(threshold=4.0, warmup=0, include_fp32=True)  # opt in: judged like the others
    assert len(d.update(step(0, layer(z=[9.0, 0, 0], variant="fp32_delta")))) == 1
    # a layer switched to fp32_delta keeps the alert it had (it drifted before the fix), and no new one
    d = DeltaDriftDetector(threshold=4.0, warmup=0)
    assert len(d.update(step(0, layer(z=[4.2, 0, 0], variant="sdpa")))) == 1
    assert d.update(step(1, layer(z=[1.0, 7.0, 0], variant="fp32_delta"))) == []
    assert [(a.step, a.head) for a in d.active] == [(0, 0)]


def test_repeated_max_rise_against_its_own_baseline():
    d = RepeatedMaxRiseDetector(factor=3.0, margin=0.1, warmup=2, baseline_steps=3)
    for t in range(2):  # warm-up: the high early values are not the baseline
        assert d.update(step(t, layer(ratio_bf16=[0.5, 0.5, 0.5]))) == []
    for t in range(2, 5):
        assert d.update(step(t, layer(ratio_bf16=[0.02, 0.2, 0.02]))) == []
    assert d.baseline(0) == pytest.approx([0.02, 0.2, 0.02])
    # head 0: 0.09 is 4.5x its baseline but only +0.07 above it (a healthy FP32 run's rise): no alert
    assert d.update(step(5, layer(ratio_bf16=[0.09, 0.5, 0.02]))) == []
    new = d.update(step(6, layer(ratio_bf16=[0.13, 0.61, 0.02])))
    assert [(a.head, a.threshold) for a in new] == [(0, pytest.approx(0.12)), (1, pytest.approx(0.6))]
    assert all(a.severity == "warning" for a in new)


def test_repeated_max_state_round_trip():
    a = RepeatedMaxRiseDetector(warmup=1, baseline_steps=2)
    for t in range(3):
        a.update(step(t, layer(ratio_bf16=[0.01, 0.02, 0.03])))
    b = RepeatedMaxRiseDetector(warmup=1, baseline_steps=2)
    b.load_state_dict(a.state_dict())
    assert b.baseline(0) == a.baseline(0) == pytest.approx([0.01, 0.02, 0.03])
    s = step(3, layer(ratio_bf16=[0.5, 0.02, 0.03]))
    assert a.update(s) == b.update(s) and len(b.active) == 1


def test_wq_growth_and_outlier():
    g = WqGrowthDetector(2.0, warmup=3, window=4)
    # growth at index t compares with index t - 4: judged only once that lies after warm-up (t >= 7),
    # never against the weights at initialisation
    for t in (4, 5, 6):
        assert g.update(step(t, layer(growth=[5.0, 1.0, 1.0]))) == []
    new = g.update(step(7, layer(growth=[2.5, float("nan"), 1.0])))
    assert [(a.rule, a.head, a.value) for a in new] == [("wq_growth", 0, 2.5)]
    assert [d for d in build_detectors(MonitorConfig(warmup=20, window=50)) if d.rule == "wq_growth"][0].warmup == 70
    o = WqOutlierDetector(3.0, warmup=0)
    new = o.update(step(0, layer(wq_ratio=[1.0, 3.5, 0.9]), layer(1, wq_ratio=[1.0, 1.0, 1.0])))
    assert [(a.rule, a.layer, a.head) for a in new] == [("wq_outlier", 0, 1)]
    assert "median head" in new[0].message


def test_max_logit_is_a_warning_and_a_zero_bound_fires_at_once():
    d = MaxLogitDetector(100.0)
    new = d.update(step(0, layer(max_logit=[150.0, 20.0, 100.0])))
    assert [(a.head, a.severity) for a in new] == [(0, "warning"), (2, "warning")]
    assert "weak evidence" in new[0].message
    assert MaxLogitDetector(0.0).update(step(0, layer(max_logit=[0.5, -1.0, 2.0])))[0].head == 0
    # hysteresis with a bound of 0 holds while the value stays >= 0
    d0 = MaxLogitDetector(0.0)
    d0.update(step(0, layer(max_logit=[0.5, -1.0, -1.0])))
    d0.update(step(1, layer(max_logit=[0.0, -1.0, -1.0])))
    assert len(d0.active) == 1


def test_non_finite_loss_grad_norm_and_statistics():
    d = NonFiniteDetector()
    new = d.update(step(0, layer(e=[0.0, float("nan"), 0.0], sigma=[1.0, 1.0, float("inf")]),
                        loss=float("nan"), grad_norm=1.0))
    assert sorted((a.layer, a.head) for a in new) == [(-1, -1), (0, 1), (0, 2)]
    by_key = {(a.layer, a.head): a for a in new}
    assert "loss" in by_key[(-1, -1)].message and "grad_norm" not in by_key[(-1, -1)].message
    assert "delta_error" in by_key[(0, 1)].message and "wq_spectral_norm" in by_key[(0, 2)].message
    assert all(a.severity == "critical" for a in new)
    assert d.update(step(1, layer(e=[0.0, float("nan"), 0.0]), loss=float("nan"))) == []  # holds, no repeat
    d.update(step(2, layer(), loss=1.0))
    assert d.active == []


def test_loss_spike_as_lightning():
    d = LossSpikeDetector(rtol=2.0, window=3)
    for t, loss in enumerate([2.0, 1.9, 1.8]):
        assert d.update(step(t, loss=loss)) == []
    new = d.update(step(3, loss=6.0))  # mean 1.9: 6.0 - 1.9 >= 2 * 1.9
    assert [(a.rule, a.layer, a.value, a.severity) for a in new] == [("loss_spike", -1, 6.0, "critical")]
    assert d.update(step(4, loss=float("nan"))) == []  # non-finite is the other rule's
    assert d.update(step(5, loss=5.5)) == []  # still spiking (hysteresis at 0.9): holds, no new alert
    assert len(d.active) == 1 and list(d.losses) == [2.0, 1.9, 1.8]  # spikes stay out of the mean
    d.update(step(6, loss=1.7))
    assert d.active == []
    e = LossSpikeDetector(rtol=2.0, window=3)
    e.load_state_dict(d.state_dict())
    assert list(e.losses) == list(d.losses) and e.last == d.last
    assert LossSpikeDetector(rtol=None, atol=0.5).update(step(0, loss=1.0)) == []


def test_detector_state_round_trip_keeps_active_alerts():
    d = MaxLogitDetector(10.0)
    d.update(step(7, layer(max_logit=[11.0, 0.0, 0.0])))
    e = MaxLogitDetector(10.0)
    e.load_state_dict(d.state_dict())
    assert e.active == d.active and e.active[0].step == 7
    assert e.update(step(8, layer(max_logit=[12.0, 0.0, 0.0]))) == []
