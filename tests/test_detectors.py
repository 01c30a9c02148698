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


# --- one alert per episode -------------------------------------------------------------------------

def _flap(det, values, start=0):
    """Feed head 0 of layer 0 a max logit per monitored step; (step, value) of each alert raised."""
    out = []
    for i, v in enumerate(values):
        t = start + i
        out += [(a.step, a.value) for a in det.update(step(t, layer(max_logit=[v, 0.0, 0.0])))]
    return out


# the provoked demo's flap, in shape: above the threshold (10), dips, above again ...
FLAP = [12, 12, 5, 5, 9.5, 5, 11, 9.5, 9.5] + [5] * 8 + [11, 11, 11, 9.5] + [5] * 7 + [9.5, 5, 5, 11] + [5] * 30


def test_a_flapping_value_raises_one_alert_per_episode():
    assert len(_flap(MaxLogitDetector(10.0, clear_steps=1, alert_gap=0), FLAP)) == 4  # what flapped before
    det = MaxLogitDetector(10.0, clear_steps=10, alert_gap=20)
    assert _flap(det, FLAP) == [(0, 12.0)]
    # the episode ended at the 10th clear step after the last value that held (FLAP[31] = 11)
    assert det.active == [] and det._ended_at == {(0, 0): 41}


def test_an_episode_continues_through_short_dips_and_ends_after_clear_steps():
    det = MaxLogitDetector(10.0, clear_steps=3, alert_gap=0)
    assert _flap(det, [11, 5, 5, 11]) == [(0, 11.0)]  # two clear steps: the same episode
    assert len(det.active) == 1
    assert _flap(det, [5, 5], start=4) == [] and len(det.active) == 1
    det.update(step(6, layer(max_logit=[5.0, 0, 0])))  # the third clear step ends it
    assert det.active == [] and [a.step for a in det.cleared] == [0]
    assert _flap(det, [11], start=7) == [(7, 11.0)]  # no gap: a new episode at once


def test_a_new_warning_waits_for_the_gap_after_an_episode_ended():
    det = MaxLogitDetector(10.0, clear_steps=1, alert_gap=5)
    assert _flap(det, [11, 5]) == [(0, 11.0)]  # ended at index 1
    assert _flap(det, [11] * 5, start=2) == []  # indices 2..6: within 5 of the end
    assert _flap(det, [11], start=7) == [(7, 11.0)]  # still above once the gap has passed: raised


@pytest.mark.parametrize("rule", ["non_finite", "loss_spike"])
def test_critical_rules_are_never_held_back(rule):
    c = MonitorConfig(clear_steps=10, alert_gap=50)
    det = next(d for d in build_detectors(c) if d.rule == rule)
    raised = []
    for t in range(12):
        bad = t in (3, 6)  # two NaN losses / two spikes, two steps of calm between them
        loss = (math.nan if bad else 1.0) if rule == "non_finite" else (10.0 if bad else 1.0)
        raised += [a.step for a in det.update(step(t, loss=loss))]
    assert raised == [3, 6]


def test_episodes_resume_exactly_from_a_state():
    values = [11, 5, 5, 11, 5, 5, 5, 5, 11, 5, 11, 11, 5, 5, 5, 5, 5, 5, 11]
    whole = MaxLogitDetector(10.0, clear_steps=3, alert_gap=4)
    want = _flap(whole, values)
    for cut in range(1, len(values)):
        first = MaxLogitDetector(10.0, clear_steps=3, alert_gap=4)
        got = _flap(first, values[:cut])
        second = MaxLogitDetector(10.0, clear_steps=3, alert_gap=4)
        second.load_state_dict(first.state_dict())
        got += _flap(second, values[cut:], start=cut)
        assert got == want, cut
    assert want == [(0, 11.0), (11, 11.0)]  # ended at 6, held back to 10; ended at 14, held back at 18


def test_the_replay_decides_episodes_as_the_monitor_does():
    """flashwatch.replay builds its detectors from the same MonitorConfig: same episodes."""
    from flashwatch.replay.playback import replay

    signals = [step(t, layer(max_logit=[v, 0.0, 0.0])) for t, v in enumerate(FLAP)]
    cfg = MonitorConfig(max_logit_bound=10.0)
    live = next(d for d in build_detectors(cfg) if d.rule == "max_logit")
    assert [(a.step, a.rule) for a in replay(signals, cfg, rules=["max_logit"])] == \
        [(s, "max_logit") for s, _ in _flap(live, FLAP)] == [(0, "max_logit")]


def test_a_recording_made_before_episodes_is_replayed_as_its_monitor_decided():
    """A recorded MonitorConfig without clear_steps / alert_gap came from a Monitor whose alerts
    ended at the first clear step: its own-configuration replay uses that, so it still gives the
    alerts raised in training; a recording with the fields keeps them."""
    from flashwatch.replay.playback import config_from_dict

    recorded = MonitorConfig(max_logit_bound=10.0).to_dict()
    old = {k: v for k, v in recorded.items() if k not in ("clear_steps", "alert_gap")}
    assert (config_from_dict(old).clear_steps, config_from_dict(old).alert_gap) == (1, 0)
    assert (config_from_dict(recorded).clear_steps, config_from_dict(recorded).alert_gap) == (10, 20)
    det = next(d for d in build_detectors(config_from_dict(old)) if d.rule == "max_logit")
    assert len(_flap(det, FLAP)) == 4
