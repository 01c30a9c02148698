"""Numbers where numbers are meant: numbers.Integral / numbers.Real (numpy scalars included) are
accepted, bools are not; window sizes are capped with an error that says what they cost."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flashwatch import Monitor, MonitorConfig
from flashwatch.config import MAX_WINDOW, WINDOW_BYTES_PER_HEAD
from flashwatch.kernels import reference


def test_numpy_scalars_are_accepted_and_stored_as_python_numbers():
    c = MonitorConfig(interval=np.int64(5), window=np.int32(40), eps=np.float32(0.25), beta=np.float64(3.0),
                      drift_threshold=np.int64(4), async_transfer=np.bool_(False), drift_include_fp32=np.bool_(True),
                      layers=[np.int64(1)])
    assert (c.interval, c.window, c.eps, c.beta, c.drift_threshold) == (5, 40, 0.25, 3.0, 4.0)
    assert type(c.interval) is int and type(c.window) is int and type(c.eps) is float
    assert c.async_transfer is False and c.drift_include_fp32 is True
    assert c.layers == (1,) and type(c.layers[0]) is int
    assert c == MonitorConfig(interval=5, window=40, eps=0.25, beta=3.0, drift_threshold=4.0, async_transfer=False,
                              drift_include_fp32=True, layers=[1])


@pytest.mark.parametrize("field", ["eps", "drift_threshold", "repeated_max_margin", "max_logit_bound",
                                   "loss_spike_rtol", "clear_ratio"])
@pytest.mark.parametrize("flag", [True, np.bool_(True)], ids=["bool", "np.bool_"])
def test_a_bool_is_not_a_number(field, flag):
    with pytest.raises(ValueError, match=rf"MonitorConfig\.{field} must be"):
        MonitorConfig(**{field: flag})


@pytest.mark.parametrize("field", ["interval", "warmup", "window", "power_iters", "clear_steps"])
@pytest.mark.parametrize("flag", [True, np.bool_(True)], ids=["bool", "np.bool_"])
def test_a_bool_is_not_a_count(field, flag):
    with pytest.raises(ValueError, match=rf"MonitorConfig\.{field} must be an int"):
        MonitorConfig(**{field: flag})


def test_window_sizes_are_capped_with_what_they_cost():
    assert MonitorConfig(window=MAX_WINDOW).window == MAX_WINDOW
    with pytest.raises(ValueError, match=rf"MonitorConfig\.window must be an int >= 2 and <= 10,000; each monitored "
                                         rf"step of the window costs {WINDOW_BYTES_PER_HEAD} bytes of host memory per "
                                         r"attention head .*, got 100000000"):
        MonitorConfig(window=10 ** 8)
    assert MonitorConfig(loss_spike_window=MAX_WINDOW).loss_spike_window == MAX_WINDOW
    with pytest.raises(ValueError, match=r"MonitorConfig\.loss_spike_window must be an int >= 1 and <= 10,000"):
        MonitorConfig(loss_spike_window=MAX_WINDOW + 1)


def test_the_window_cost_stated_is_what_the_monitor_keeps():
    """40 bytes per head per step of the window: the host series the signal builder keeps."""
    from flashwatch.step_signals import SignalBuilder

    heads, window = 3, 64
    state = SignalBuilder([heads], window).state_dict()[0]

    def nbytes(x):
        if isinstance(x, torch.Tensor):
            return x.numel() * x.element_size()
        if isinstance(x, dict):
            return sum(nbytes(v) for v in x.values())
        return 0

    # per head: W rows of 5 float64 series (40 W bytes); per layer: the W step numbers of the trends
    # (8 W); per head outside the window: one more sigma, the drift sums and counts, the push sums (48)
    assert nbytes(state) == WINDOW_BYTES_PER_HEAD * heads * window + 8 * window + 48 * heads


@pytest.mark.parametrize("kwargs, match", [
    (dict(sm_scale=True), r"sm_scale must be None \(1/sqrt\(D\)\) or a finite number > 0 \(not a bool\), got True"),
    (dict(eps=True), r"eps must be a finite number >= 0"),
    (dict(beta=np.bool_(True)), r"beta must be a finite number > 1"),
])
def test_kernel_options_refuse_bools(kwargs, match):
    q = torch.randn(1, 1, 4, 16)
    with pytest.raises(ValueError, match=match):
        reference.flash_attention(q, q, q, **kwargs)


def test_kernel_options_accept_numpy_scalars():
    q = torch.randn(1, 2, 5, 16, dtype=torch.float64)
    want = reference.flash_attention(q, q, q, sm_scale=0.25, eps=0.001)
    got = reference.flash_attention(q, q, q, sm_scale=np.float32(0.25), eps=np.float64(0.001))
    assert torch.equal(got, want)


def test_step_accepts_numpy_scalars_and_refuses_bools():
    monitor = Monitor(MonitorConfig(interval=1))
    monitor.step(loss=np.float32(2.5), grad_norm=np.int64(3))
    snap = monitor.snapshot()
    assert (snap["flashwatch_loss"], snap["flashwatch_grad_norm"]) == (2.5, 3.0)
    for bad in (True, np.bool_(True)):
        with pytest.raises(TypeError, match="loss must be None, a float or a one-element tensor"):
            monitor.step(loss=bad)
        with pytest.raises(TypeError, match="grad_norm must be None, a float or a one-element tensor"):
            monitor.step(grad_norm=bad)
    assert monitor.global_step == 1
