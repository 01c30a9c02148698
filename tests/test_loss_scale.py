"""FP16-style training with a loss scaler: ``Monitor.step(grad_scaler=...)`` reads true units, and a
step the scaler skipped is not measured rather than a divergence.

A GradScaler's scale is a power of two, and multiplying by one is exact in floating point, so a
run with a scaler that never overflows takes the very same optimizer steps as the run without
one: every signal of the two must agree. The runs are on the CPU in FP32 with BF16 autocast
(``torch.amp.GradScaler("cpu")``)."""

from __future__ import annotations

import copy
import logging
import math

import pytest
import torch

from flashwatch import Monitor, MonitorConfig
from flashwatch.loss_scale import LossScale, check_grad_scaler, unscale_statistics
from flashwatch.kernels import STAT_FIELDS
from flashwatch.kernels.stats import GRADIENT_POWER, SUM_FIELDS
from flashwatch.tinygpt import GPT, GPTConfig

CONFIG = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=64)
# the signals in gradient units, and those built on them
GRADIENT_SIGNALS = ("flashwatch_delta_error", "flashwatch_delta_error_cumulative", "flashwatch_delta_drift_z",
                    "drift_window_z", "flashwatch_wq_error_push", "wq_error_push_true",
                    "flashwatch_wq_error_push_cumulative", "flashwatch_wq_error_push_share",
                    "flashwatch_wq_error_coherence", "flashwatch_wq_error_alignment")


def _run(steps: int, scaler: torch.amp.GradScaler | None, pass_scaler: bool = True, lr: float = 1e-2,
         update_first: bool = True, overflow_at: tuple[int, ...] = ()) -> tuple[list[dict], Monitor]:
    """Train ``steps`` steps, every one monitored; each step's ``Monitor.snapshot()`` and ``signals()``.
    At the steps ``overflow_at`` one gradient entry is made inf before the scaler's step (an overflow
    outside attention: the attention statistics are finite, the scaler skips the step)."""
    torch.manual_seed(0)
    model = GPT(CONFIG)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    monitor = Monitor(MonitorConfig(interval=1, warmup=1))
    monitor.attach(model)
    g = torch.Generator().manual_seed(1)
    out = []
    try:
        for _ in range(steps):
            x = torch.randint(0, CONFIG.vocab_size, (2, CONFIG.block_size), generator=g)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(x, x)[1]
            if scaler is None:
                loss.backward()
                opt.step()
            else:
                scaler.scale(loss).backward()
                if len(out) in overflow_at:
                    model.lm_head.weight.grad[0, 0] = math.inf
                scaler.step(opt)
                if update_first:
                    scaler.update()
            opt.zero_grad(set_to_none=True)
            monitor.step(loss=loss.detach(), grad_scaler=scaler if pass_scaler else None)
            if scaler is not None and not update_first:
                scaler.update()
            out.append({**monitor.snapshot(), **monitor.signals()})
    finally:
        monitor.detach()
    return out, monitor


def _values(record: dict, name: str) -> torch.Tensor:
    """A per-head (or per-layer) value of every head, in label order."""
    return torch.tensor([v for _, v in sorted(record[name].items())], dtype=torch.float64)


def test_a_scaled_run_reads_what_the_unscaled_run_reads():
    plain, _ = _run(6, None)
    # growth every 2 steps: the scale a step's backward used is not the one left after its update
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=2)
    scaled, monitor = _run(6, scaler)
    assert scaler.get_scale() == 2.0 ** 13  # grew three times: no step overflowed
    assert monitor.errors == 0
    for t, (a, b) in enumerate(zip(plain, scaled)):
        for name in GRADIENT_SIGNALS:
            x, y = _values(a, name), _values(b, name)
            assert torch.equal(x.isnan(), y.isnan()), (t, name)
            torch.testing.assert_close(y, x, rtol=1e-9, atol=0, equal_nan=True, msg=f"step {t}: {name}")
    errors = _values(plain[-1], "flashwatch_delta_error")  # the comparison compares something: a head's sum
    assert errors.isfinite().all() and (errors != 0).any()  # of rounding residues may cancel to exactly 0.0
    assert not _values(plain[-1], "flashwatch_wq_error_coherence").isnan().any()


def test_without_the_scaler_the_readings_are_scaled():
    """What the argument changes: without it the delta error is S times the true one."""
    plain, _ = _run(2, None)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    scaled, _ = _run(2, scaler, pass_scaler=False)
    torch.testing.assert_close(_values(scaled[0], "flashwatch_delta_error"),
                               _values(plain[0], "flashwatch_delta_error") * 2.0 ** 10, rtol=1e-9, atol=0)


def test_a_skipped_step_is_not_measured_and_raises_no_alert():
    """A scale so large that the gradients overflow: the scaler skips the steps and halves the scale
    until it fits. Those steps' delta error and W^Q-gradient error read NaN (not measured), no
    non_finite alert is raised, and the cumulative delta error sums only the steps whose gradients
    were used."""
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 126, growth_interval=1000)
    steps, monitor = _run(8, scaler)
    assert monitor.alert_counts["non_finite"] == 0
    unmeasured = [_values(s, "flashwatch_delta_error").isnan().all().item() for s in steps]
    # one halving of the scale per skipped step: exactly the steps read as not measured
    assert 1 <= sum(unmeasured) == round(math.log2(2.0 ** 126 / scaler.get_scale())) < 8
    total = torch.zeros(4, dtype=torch.float64)
    for t, s in enumerate(steps):
        e = _values(s, "flashwatch_delta_error")
        if unmeasured[t]:
            assert e.isnan().all() and _values(s, "flashwatch_wq_error_push").isnan().all(), t
            assert not _values(s, "flashwatch_max_logit").isnan().any()  # the forward's statistics are measured
            assert (_values(s, "flashwatch_attention_coverage") == 1.0).all()  # no attention_coverage alert
        else:
            assert not e.isnan().any() and not _values(s, "flashwatch_wq_error_push").isnan().any(), t
            total += e
    torch.testing.assert_close(_values(steps[-1], "flashwatch_delta_error_cumulative"), total, rtol=1e-12, atol=0)


def test_grad_norm_of_a_skipped_step_is_not_measured():
    """Step 0 clean, step 1 overflows (its scale remembered at step 0's call): step 1's inf gradient
    norm is the overflow the scaler skipped the step for, not a divergence."""
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    torch.manual_seed(0)
    model = GPT(CONFIG)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    monitor = Monitor(MonitorConfig(interval=1))
    monitor.attach(model)
    norms = []
    for t in range(2):
        x = torch.randint(0, CONFIG.vocab_size, (2, CONFIG.block_size))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x, x)[1]
        scaler.scale(loss).backward()
        if t == 1:
            model.lm_head.weight.grad[0, 0] = math.inf
        scaler.unscale_(opt)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        assert monitor.step(loss=loss.detach(), grad_norm=norm, grad_scaler=scaler) == []
        norms.append(monitor.snapshot()["flashwatch_grad_norm"])
    assert math.isfinite(norms[0]) and math.isnan(norms[1]) and not torch.isfinite(norm)
    assert scaler.get_scale() == 2.0 ** 9
    # the same step without the scaler: the overflow raises non_finite, as it must when nothing says why
    other = Monitor(MonitorConfig(interval=1))
    assert [a.rule for a in other.step(loss=1.0, grad_norm=norm)] == ["non_finite"]
    monitor.detach()


def test_step_before_update_is_warned_and_not_measured(caplog):
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    with caplog.at_level(logging.WARNING, logger="flashwatch"):
        steps, monitor = _run(3, scaler, update_first=False)
    assert sum("before scaler.update()" in r.getMessage() for r in caplog.records) == 1
    assert all(_values(s, "flashwatch_delta_error").isnan().all() for s in steps)
    assert monitor.alert_counts["non_finite"] == 0


def test_bad_grad_scaler_is_refused():
    monitor = Monitor()
    with pytest.raises(TypeError, match="grad_scaler must be the torch.amp.GradScaler"):
        monitor.step(grad_scaler=2.0 ** 16)
    with pytest.raises(TypeError, match="a class: pass the instance"):
        monitor.step(grad_scaler=torch.amp.GradScaler)

    class Plugin:  # a precision plugin that holds the scaler
        scaler = torch.amp.GradScaler("cpu")

    with pytest.raises(TypeError, match=r"pass Plugin.scaler"):
        monitor.step(grad_scaler=Plugin())
    assert check_grad_scaler(torch.amp.GradScaler("cpu", enabled=False)) is None  # scales nothing


def test_a_scaler_whose_scale_cannot_be_read_is_warned_about_and_training_goes_on(caplog, monkeypatch):
    """A torch whose GradScaler keeps its state under other names: one warning, scaled units."""
    import flashwatch.loss_scale

    monkeypatch.setattr(flashwatch.loss_scale, "_SCALER_STATE", ("_scale", "_growth_tracker_renamed"))
    plain, _ = _run(2, None)
    with caplog.at_level(logging.WARNING, logger="flashwatch"):
        scaled, monitor = _run(2, torch.amp.GradScaler("cpu", init_scale=2.0 ** 10))
    assert sum("cannot read the loss scale" in r.getMessage() for r in caplog.records) == 1
    assert monitor.global_step == 2 and monitor.errors == 0
    torch.testing.assert_close(_values(scaled[0], "flashwatch_delta_error"),
                               _values(plain[0], "flashwatch_delta_error") * 2.0 ** 10, rtol=1e-9, atol=0)


def test_a_skip_brought_back_to_a_floor_is_still_a_skip():
    """A floor on the scale (update(), then update(new_scale=floor) when below it): an overflow at the
    floor leaves the scale where it was, but the update's back-off reset the growth tracker."""
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 126, growth_interval=1000)
    floor = 2.0 ** 126
    torch.manual_seed(0)
    model = GPT(CONFIG)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    monitor = Monitor(MonitorConfig(interval=1))
    monitor.attach(model)
    for _ in range(3):
        x = torch.randint(0, CONFIG.vocab_size, (2, CONFIG.block_size))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x, x)[1]
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        if scaler.get_scale() < floor:
            scaler.update(new_scale=floor)
        opt.zero_grad()
        assert monitor.step(loss=loss.detach(), grad_scaler=scaler) == []
        assert all(math.isnan(v) for v in monitor.snapshot()["flashwatch_delta_error"].values())
    assert scaler.get_scale() == floor
    monitor.detach()


def test_a_remembered_scale_is_used_only_for_its_step():
    """The scale remembered for step t is not taken for another step (a step() without the scaler
    between): there the growth tracker decides, and a tracker of 0 reads as unknown."""
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0, growth_interval=1)
    scaler._lazy_init_scale_growth_tracker(torch.device("cpu"))
    ls = LossScale(lambda key, message: None)
    ls.remember(scaler, 5)
    scaler._growth_tracker.fill_(1)  # a clean step counted, the scale as it was
    assert ls.inverse_scale(scaler, 5).item() == 0.25
    ls.remember(scaler, 5)
    scaler._growth_tracker.fill_(0)  # the same scale, the tracker reset: backed off, then set back (a floor)
    assert math.isnan(ls.inverse_scale(scaler, 5).item())
    ls.remember(scaler, 5)
    scaler._scale.fill_(8.0)  # grew at the update after step 5's backward
    assert ls.inverse_scale(scaler, 5).item() == 0.25
    ls.remember(scaler, 5)
    scaler._scale.fill_(2.0)  # backed off: step 5 was skipped
    assert math.isnan(ls.inverse_scale(scaler, 5).item())
    ls.remember(scaler, 5)
    scaler._growth_tracker.fill_(3)
    assert ls.inverse_scale(scaler, 6).item() == 0.5  # not step 6's: the tracker says the update left S as it was
    scaler._growth_tracker.fill_(0)
    assert math.isnan(ls.inverse_scale(scaler, 6).item())  # grown or backed off: unknown


def test_unscale_statistics_scales_only_the_gradient_rows():
    packed = torch.arange(1.0, len(STAT_FIELDS) + 1, dtype=torch.float64)[:, None].repeat(1, 3)
    out = unscale_statistics(packed, torch.tensor(0.5, dtype=torch.float64))
    want = {"delta_error": 0.5, "delta_error_abs": 0.5, "delta_error_tied": 0.5, "delta_error_sq": 0.25}
    for i, name in enumerate(STAT_FIELDS):
        assert torch.equal(out[i], packed[i] * want.get(name, 1.0)), name


def test_a_failure_reading_the_scale_is_counted_and_the_step_reads_not_measured(monkeypatch):
    """Under torch.distributed a rank that raised before the collective would leave the others
    waiting in it: the failure is reported, the step goes on with its gradient units unknown."""
    def broken(self, scaler, step):
        raise RuntimeError("scale unreadable")

    monkeypatch.setattr(LossScale, "inverse_scale", broken)
    steps, monitor = _run(2, torch.amp.GradScaler("cpu", init_scale=2.0 ** 10))
    assert monitor.errors == 2 and monitor.global_step == 2 and monitor.failed_in_a_row == 0
    assert all(_values(s, "flashwatch_delta_error").isnan().all() for s in steps)
    assert not _values(steps[-1], "flashwatch_max_logit").isnan().any()  # the rest is measured
    assert monitor.alert_counts["non_finite"] == 0


def test_a_skip_in_the_middle_of_a_run_leaves_the_window_as_it_was():
    """A step the scaler skips mid-run: its readings are NaN, and the next measured steps read the
    same coherence and alignment as if the skipped step had not fed the window (its sketch would
    otherwise put NaN into the window state for good)."""
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=1000)
    steps, monitor = _run(8, scaler, overflow_at=(4,))
    assert monitor.alert_counts["non_finite"] == 0
    assert _values(steps[4], "flashwatch_delta_error").isnan().all()
    assert _values(steps[4], "flashwatch_wq_error_coherence").isnan().all()
    for s in steps[5:]:
        for name in ("flashwatch_delta_error", "flashwatch_wq_error_coherence", "flashwatch_wq_error_alignment",
                     "flashwatch_delta_drift_z"):
            assert not _values(s, name).isnan().any(), name


def test_a_scaler_that_skips_every_step_is_logged(caplog):
    """Every monitored step skipped (gradients that always overflow): not only a run of NaN."""
    with caplog.at_level(logging.WARNING, logger="flashwatch"):
        _, monitor = _run(12, torch.amp.GradScaler("cpu", init_scale=2.0 ** 10), overflow_at=tuple(range(12)))
    said = [r.getMessage() for r in caplog.records if "skipped the last" in r.getMessage()]
    assert len(said) == 1 and "the last 10 monitored steps" in said[0]
    assert monitor.alert_counts["non_finite"] == 0


def test_every_sum_says_how_a_loss_scale_enters_it():
    assert set(GRADIENT_POWER) == set(SUM_FIELDS)


def test_a_checkpoint_between_remembering_and_the_monitored_step_keeps_the_scale():
    """The scale the next monitored step's backward uses is remembered at the step() before it; a run
    saved there and resumed (a new Monitor, a new scaler loaded from the old one's state) reads that
    step in true units, as the run that went on does. With growth_interval=1 every clean update grows
    the scale and resets the growth tracker, so without the remembered scale the step would read as
    not measured."""
    def train(steps, model, opt, scaler, monitor, g):
        for _ in range(steps):
            x = torch.randint(0, CONFIG.vocab_size, (2, CONFIG.block_size), generator=g)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(x, x)[1]
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            monitor.step(loss=loss.detach(), grad_scaler=scaler)
        return monitor.snapshot()["flashwatch_delta_error"]

    def start():
        torch.manual_seed(0)
        model = GPT(CONFIG)
        return model, torch.optim.SGD(model.parameters(), lr=1e-2), torch.amp.GradScaler("cpu", init_scale=2.0 ** 8,
                                                                                        growth_interval=1)

    model, opt, scaler = start()
    monitor = Monitor(MonitorConfig(interval=3, warmup=1))
    monitor.attach(model)
    g = torch.Generator().manual_seed(1)
    train(3, model, opt, scaler, monitor, g)  # steps 0-2; the third step() remembers the scale for step 3, monitored
    saved = copy.deepcopy((monitor.state_dict(), scaler.state_dict(), model.state_dict(), opt.state_dict(),
                           g.get_state()))  # copies: the run that goes on updates its tensors in place
    assert saved[0]["loss_scale"] == {"step": 3, "scale": 2.0 ** 11}  # grown at each of the three updates
    went_on = train(1, model, opt, scaler, monitor, g)
    monitor.detach()

    def resume(monitor_state):
        """The monitored step 3 of a run resumed from ``saved``, its Monitor from ``monitor_state``."""
        model, opt, scaler = start()
        model.load_state_dict(saved[2])
        opt.load_state_dict(saved[3])
        scaler.load_state_dict(saved[1])
        g.set_state(saved[4])
        monitor = Monitor(MonitorConfig(interval=3, warmup=1))
        monitor.load_state_dict(monitor_state)
        monitor.attach(model)
        try:
            return train(1, model, opt, scaler, monitor, g)
        finally:
            monitor.detach()

    assert all(math.isfinite(v) for v in went_on.values())
    assert resume(saved[0]) == pytest.approx(went_on, rel=1e-6)
    # the same resume without the saved scale: not measured
    assert all(math.isnan(v) for v in resume({**saved[0], "loss_scale": None}).values())
