"""MonitorConfig: frozen, keyword-only, every bad value named in its error."""

from __future__ import annotations

import dataclasses

import pytest

from flashwatch import MonitorConfig
from flashwatch.vocabulary import RULES


def test_defaults_follow_the_design():
    c = MonitorConfig()
    assert (c.interval, c.mode, c.variant, c.auto_fix, c.beta, c.eps) == (10, "observe", "plain", None, 2.0, 1e-3)
    # calibrated on the recorded experiments (docs/EXPERIMENTS.md, config.py's docstring)
    assert (c.drift_threshold, c.repeated_max_factor, c.repeated_max_margin, c.wq_growth_factor, c.max_logit_bound) \
        == (4.5, 3.0, 0.3, 3.0, 1000.0)
    assert c.drift_window_threshold is None and not c.drift_include_fp32 and c.loss_spike_rtol == 2.0
    assert c.stop_on == frozenset() and c.layers is None


def test_every_field_is_documented_in_the_source():
    import inspect

    import flashwatch.config as mod

    src = inspect.getsource(mod.MonitorConfig)
    for f in dataclasses.fields(MonitorConfig):
        line = next(l for l in src.splitlines() if l.strip().startswith(f"{f.name}:"))
        assert "#" in line, f"field {f.name} has no comment"


def test_frozen_and_keyword_only():
    c = MonitorConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.interval = 3
    with pytest.raises(TypeError, match="keywords only"):
        MonitorConfig(5)


def test_an_unknown_field_is_named_with_the_nearest_one_and_the_list():
    """Fail before: Python's "unexpected keyword argument 'intervall'", without the fields."""
    with pytest.raises(TypeError, match=r"no field 'intervall' \(did you mean 'interval'\?\); its fields: interval, "):
        MonitorConfig(intervall=10)
    with pytest.raises(TypeError, match=r"no field 'xyz'; its fields: .*wq_error_chain"):
        MonitorConfig(xyz=1)
    assert dataclasses.replace(MonitorConfig(interval=3), window=7) == MonitorConfig(interval=3, window=7)


def test_normalises_sets_and_lists():
    c = MonitorConfig(stop_on=["non_finite"], layers=["blocks.0.attn", 1], interval=3)
    assert c.stop_on == frozenset({"non_finite"}) and c.layers == ("blocks.0.attn", 1)
    assert hash(c) == hash(MonitorConfig(stop_on={"non_finite"}, layers=("blocks.0.attn", 1), interval=3))
    d = c.to_dict()
    assert d["stop_on"] == ["non_finite"] and d["layers"] == ["blocks.0.attn", 1]


@pytest.mark.parametrize("kwargs, match", [
    (dict(interval=0), r"MonitorConfig\.interval must be an int >= 1, got 0"),
    (dict(interval=2.0), r"MonitorConfig\.interval must be an int"),
    (dict(interval=True), r"MonitorConfig\.interval"),
    (dict(mode="own"), r"MonitorConfig\.mode must be one of 'own_kernel', 'observe', got 'own'"),
    (dict(variant="exact"), r"MonitorConfig\.variant must be one of 'plain', 'fixed', 'fp32_delta'"),
    (dict(auto_fix="plain"), r"MonitorConfig\.auto_fix must be one of 'fixed', 'fp32_delta' or None"),
    (dict(auto_fix_on={"nope"}), r"MonitorConfig\.auto_fix_on: unknown rule\(s\) nope; accepted: delta_drift"),
    (dict(auto_fix="fp32_delta", auto_fix_on=set()),
     r"MonitorConfig\.auto_fix='fp32_delta' with an empty auto_fix_on would never switch a layer"),
    (dict(beta=1.0), r"MonitorConfig\.beta must be a finite number > 1"),
    (dict(beta=float("inf")), r"MonitorConfig\.beta"),
    (dict(eps=-1e-3), r"MonitorConfig\.eps must be a finite number >= 0"),
    (dict(layers="(unclosed"), r"MonitorConfig\.layers: '\(unclosed' is not a valid regular expression"),
    (dict(layers=[1.5]), r"MonitorConfig\.layers: entry 1\.5 must be a module name \(str\) or a layer index"),
    (dict(layers=[-1]), r"MonitorConfig\.layers: entry -1"),
    (dict(layers=[]), r"MonitorConfig\.layers must not be an empty list"),
    (dict(layers=""), r"MonitorConfig\.layers must not be an empty string"),
    (dict(layers=3), r"MonitorConfig\.layers must be None, a regex string, or a list"),
    (dict(warmup=-1), r"MonitorConfig\.warmup must be an int >= 0"),
    (dict(window=1), r"MonitorConfig\.window must be an int >= 2"),
    (dict(drift_threshold=-1.0), r"MonitorConfig\.drift_threshold must be a finite number >= 0"),
    (dict(drift_window_threshold=float("nan")), r"MonitorConfig\.drift_window_threshold must be None or"),
    (dict(drift_include_fp32=1), r"MonitorConfig\.drift_include_fp32 must be True or False"),
    (dict(wq_error_chain="no"), r"MonitorConfig\.wq_error_chain must be True or False"),
    (dict(repeated_max_factor=0.5), r"MonitorConfig\.repeated_max_factor must be a finite number >= 1"),
    (dict(repeated_max_margin=-0.1), r"MonitorConfig\.repeated_max_margin must be a number in \[0, 1\]"),
    (dict(repeated_max_margin=5), r"MonitorConfig\.repeated_max_margin must be a number in \[0, 1\] \(a fraction"),
    (dict(variant="fp32_delta"), r"MonitorConfig\.variant='fp32_delta' needs mode='own_kernel'.*auto_fix='fp32_delta'"),
    (dict(repeated_max_baseline=0), r"MonitorConfig\.repeated_max_baseline must be an int >= 1"),
    (dict(wq_growth_factor=1.0), r"MonitorConfig\.wq_growth_factor must be a finite number > 1"),
    (dict(wq_outlier_ratio=0.5), r"MonitorConfig\.wq_outlier_ratio must be a finite number > 1"),
    (dict(max_logit_bound="100"), r"MonitorConfig\.max_logit_bound must be a finite number"),
    (dict(loss_spike_rtol=-2.0), r"MonitorConfig\.loss_spike_rtol must be a finite number >= 0"),
    (dict(loss_spike_atol=-1.0), r"MonitorConfig\.loss_spike_atol must be None or a finite number >= 0"),
    (dict(loss_spike_window=0), r"MonitorConfig\.loss_spike_window must be an int >= 1"),
    (dict(clear_ratio=0.0), r"MonitorConfig\.clear_ratio must be a number in \(0, 1\]"),
    (dict(clear_ratio=1.5), r"MonitorConfig\.clear_ratio"),
    (dict(stop_on="non_finite"), r"MonitorConfig\.stop_on must be a set of rule names out of delta_drift"),
    (dict(stop_on={"nan"}), r"MonitorConfig\.stop_on: unknown rule\(s\) nan; accepted: " + ", ".join(RULES)),
    (dict(stop_on=[["non_finite"]]), r"MonitorConfig\.stop_on must be a set of rule names \(strings\) out of delta_drift"),
    (dict(power_iters=0), r"MonitorConfig\.power_iters must be an int >= 1"),
    (dict(power_block=0), r"MonitorConfig\.power_block must be an int >= 1"),
    (dict(power_exact_every=-1), r"MonitorConfig\.power_exact_every must be an int >= 0"),
])
def test_bad_values_name_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MonitorConfig(**kwargs)


def test_config_and_rules_import_without_torch():
    import subprocess
    import sys

    code = ("import sys, flashwatch.config, flashwatch.detectors, flashwatch.vocabulary; "
            "assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_choices_are_the_vocabularys():
    import flashwatch.config as config
    from flashwatch import vocabulary

    # one home: config re-exports the vocabulary's tuples, it does not copy them
    assert config.MODES is vocabulary.MODES and config.VARIANTS is vocabulary.VARIANTS
    assert config.FIX_VARIANTS is vocabulary.FIX_VARIANTS and config.RULES is vocabulary.RULES
    for mode in vocabulary.MODES:
        assert MonitorConfig(mode=mode).mode == mode
    for variant in vocabulary.VARIANTS:
        assert MonitorConfig(mode="own_kernel", variant=variant).variant == variant
    for fix in vocabulary.FIX_VARIANTS:
        assert MonitorConfig(auto_fix=fix).auto_fix == fix
    assert MonitorConfig(stop_on=set(vocabulary.RULES)).stop_on == frozenset(vocabulary.RULES)
    with pytest.raises(ValueError, match="unknown rule"):
        MonitorConfig(stop_on={vocabulary.STOPPED_REPORTING.name})  # Prometheus's own, not the Monitor's
