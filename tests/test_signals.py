"""Pure statistics: drift z, power iteration, windows, growth, ratios, trends."""

from __future__ import annotations

import math

import pytest
import torch

from flashwatch.signals import (DriftTracker, PowerIteration, Ring, SigmaHistory, drift_z, linear_slope,
                                next_vectors, orthonormalize, ratio_to_median, spectral_norm_exact, top_eigenvalue)

F64 = torch.float64


def test_drift_z_grows_like_sqrt_t_under_a_persistent_sign():
    d = DriftTracker(num_heads=3, window=4)
    for _ in range(16):
        d.update(torch.tensor([0.5, -2.0, 0.0], dtype=F64))
    assert d.z[0].item() == pytest.approx(4.0)  # C/sqrt(S) = 16*0.5 / sqrt(16*0.25) = sqrt(16)
    assert d.z[1].item() == pytest.approx(-4.0)
    assert d.z[2].item() == 0.0  # no error seen (e.g. fp32_delta): z is 0, not NaN
    assert d.window_z[0].item() == pytest.approx(2.0)  # sqrt(W)
    assert d.cumulative.tolist() == [8.0, -32.0, 0.0] and d.count.tolist() == [16, 16, 16]


def test_drift_z_of_a_coin_toss_stays_small():
    g = torch.Generator().manual_seed(0)
    d = DriftTracker(num_heads=64, window=50)
    for _ in range(400):
        d.update(torch.randn(64, generator=g, dtype=F64))
    z = d.z
    assert z.abs().max().item() < 4.0  # about N(0, 1) per head
    assert 0.6 < z.std().item() < 1.5


def test_windowed_z_sees_a_recent_change_the_cumulative_hides():
    d = DriftTracker(num_heads=1, window=10)
    for _ in range(10):
        d.update(torch.tensor([1.0], dtype=F64))
    for _ in range(10):
        d.update(torch.tensor([-1.0], dtype=F64))
    assert d.z.item() == 0.0
    assert d.window_z.item() == pytest.approx(-math.sqrt(10))


def test_non_finite_error_skips_only_that_head():
    d = DriftTracker(num_heads=2, window=3)
    d.update(torch.tensor([1.0, 1.0], dtype=F64))
    finite = d.update(torch.tensor([1.0, float("nan")], dtype=F64))
    assert finite.tolist() == [True, False]
    d.update(torch.tensor([1.0, float("inf")], dtype=F64))
    assert d.cumulative.tolist() == [3.0, 1.0] and d.sum_sq.tolist() == [3.0, 1.0]
    assert d.count.tolist() == [3, 1]
    assert torch.isfinite(d.z).all() and torch.isfinite(d.window_z).all()


def test_drift_state_round_trip_is_exact():
    g = torch.Generator().manual_seed(1)
    a, b = DriftTracker(4, 5), DriftTracker(4, 5)
    series = torch.randn(12, 4, generator=g, dtype=F64)
    for e in series[:7]:
        a.update(e)
    b.load_state_dict(a.state_dict())
    for e in series[7:]:
        a.update(e)
        b.update(e)
    assert torch.equal(a.z, b.z) and torch.equal(a.window_z, b.window_z) and torch.equal(a.cumulative, b.cumulative)
    with pytest.raises(ValueError, match="saved drift has 4 heads, this layer 3"):
        DriftTracker(3, 5).load_state_dict(a.state_dict())


def test_a_loaded_drift_state_is_a_host_copy_whatever_the_saved_tensors_were():
    """The state is copied into CPU float64/int64 tensors of its own (the GPU half, a state loaded
    with map_location="cuda", is tests/test_resume_gpu.py): later updates never touch the saved
    tensors, and saved float32 sums come back as float64."""
    a, b = DriftTracker(3, 4), DriftTracker(3, 4)
    a.update(torch.tensor([1.0, -2.0, 0.5], dtype=F64))
    saved = a.state_dict()
    saved["cumulative"] = saved["cumulative"].float()
    b.load_state_dict(saved)
    b.update(torch.tensor([1.0, 1.0, 1.0], dtype=F64))
    assert saved["cumulative"].tolist() == [1.0, -2.0, 0.5]
    for t, dtype in ((b.cumulative, F64), (b.sum_sq, F64), (b.count, torch.int64), (b.ring.buffer, F64)):
        assert t.device.type == "cpu" and t.dtype == dtype
    assert b.cumulative.tolist() == [2.0, -1.0, 1.5] and b.count.tolist() == [2, 2, 2]


def test_drift_z_function():
    z = drift_z(torch.tensor([3.0, 0.0], dtype=F64), torch.tensor([9.0, 0.0], dtype=F64))
    assert z.tolist() == [1.0, 0.0]


def test_ring_keeps_the_last_rows_in_order():
    r = Ring(3, 1)
    for i in range(5):
        r.push(torch.tensor([float(i)], dtype=F64))
    assert r.values()[:, 0].tolist() == [2.0, 3.0, 4.0] and r.full
    with pytest.raises(ValueError, match="length >= 1"):
        Ring(0, 1)


def _slowly_changing(seed=0, heads=4, d=16, c=64, steps=12, rate=0.01):
    g = torch.Generator().manual_seed(seed)
    w0 = torch.randn(heads, d, c, generator=g)
    drift = torch.randn(heads, d, c, generator=g)
    return [w0 + rate * t * drift for t in range(steps)]


@pytest.mark.parametrize("block", [1, 4])
def test_power_iteration_tracks_a_slowly_changing_weight_within_1_percent(block):
    weights = _slowly_changing()
    pi = PowerIteration(weights[0], block=block)  # seeded from the exact SVD
    assert torch.allclose(pi.sigma, spectral_norm_exact(weights[0]), rtol=1e-5)
    for w in weights[1:]:
        est, exact = pi.step(w), spectral_norm_exact(w)
        assert ((est - exact).abs() / exact).max().item() < 0.01
        assert (est <= exact * (1 + 1e-5)).all()  # a Rayleigh-Ritz value never exceeds sigma_max


def test_power_iteration_from_a_random_start_converges_in_a_few_steps():
    # a Gaussian 16 x 64 matrix has close top singular values (a hard case): 2 iterations a step
    weights = _slowly_changing(seed=3, steps=8)
    pi = PowerIteration(weights[0], block=4, seed="random")
    for w in weights:
        est = pi.step(w, iters=2)
    exact = spectral_norm_exact(weights[-1])
    assert ((est - exact).abs() / exact).max().item() < 0.01


def test_power_iteration_exact_on_request_and_nan_recovery():
    w = _slowly_changing(seed=2, steps=1)[0]
    pi = PowerIteration(w, block=2)
    bad = w.clone()
    bad[1] = float("nan")
    sigma = pi.step(bad)
    assert not math.isfinite(sigma[1].item()) and math.isfinite(sigma[0].item())
    assert torch.isfinite(pi.v).all()  # the bad head kept its previous vectors
    est = pi.step(w)
    assert torch.allclose(est, spectral_norm_exact(w), rtol=1e-3)
    # two float32 routes to sigma_max (the batched SVD and matrix_norm): about 6 ulp apart on one CPU
    # (69% of 1e-6), a few more with another LAPACK build or instruction set
    assert torch.allclose(pi.exact(w * 2), spectral_norm_exact(w * 2), rtol=1e-5)


def test_power_iteration_state_round_trip_and_errors():
    ws = _slowly_changing(seed=4, steps=4)
    a = PowerIteration(ws[0])
    a.step(ws[1])
    b = PowerIteration(ws[0])
    b.load_state_dict(a.state_dict())
    assert torch.equal(a.step(ws[2]), b.step(ws[2])) and torch.equal(a.v, b.v)
    with pytest.raises(ValueError, match="saved power-iteration vectors have shape"):
        PowerIteration(ws[0][:2]).load_state_dict(a.state_dict())
    with pytest.raises(ValueError, match=r"weight must be \(heads, head_dim, model_dim\)"):
        PowerIteration(ws[0][0])
    with pytest.raises(ValueError, match="seed must be 'svd' or 'random'"):
        PowerIteration(ws[0], seed="zeros")


def test_orthonormalize_and_top_eigenvalue():
    g = torch.Generator().manual_seed(5)
    z = torch.randn(3, 20, 4, generator=g, dtype=F64)
    q = orthonormalize(z)
    eye = torch.eye(4, dtype=F64).expand(3, 4, 4)
    assert torch.allclose(q.transpose(1, 2) @ q, eye, atol=1e-12)
    r = q.transpose(1, 2) @ z  # z = q r with r upper triangular, positive diagonal: Gram-Schmidt's q
    assert torch.allclose(q @ r, z, atol=1e-12) and torch.allclose(r.tril(-1), torch.zeros_like(r), atol=1e-12)
    assert (r.diagonal(dim1=1, dim2=2) > 0).all() and q.is_contiguous()
    # float32 in, float32 out; columns of very different lengths (cond 1e5) still come out orthonormal
    z32 = (torch.randn(2, 64, 4, generator=g) * torch.tensor([1e5, 1.0, 10.0, 1e-0])).float()
    q32 = orthonormalize(z32)
    assert q32.dtype == torch.float32 and q32.is_contiguous()
    assert torch.allclose(q32.transpose(1, 2) @ q32, torch.eye(4).expand(2, 4, 4), atol=1e-6)
    # dependent columns (a zero column, a repeated one): no basis, NaN; next_vectors keeps the old vectors
    bad = z.clone()
    bad[0, :, 2] = 0.0
    bad[1, :, 3] = bad[1, :, 1]
    out = orthonormalize(bad)
    assert torch.isnan(out[:2]).all() and torch.allclose(out[2], q[2])
    kept = next_vectors(bad, q)
    assert torch.equal(kept[:2], q[:2]) and torch.allclose(kept[2], q[2])
    a = torch.randn(6, 5, 5, generator=g, dtype=F64)
    gram = a.transpose(1, 2) @ a
    gram[0] = torch.diag(torch.tensor([2.0, 2.0, 1.0, 0.5, 0.0], dtype=F64))  # a repeated top eigenvalue
    assert torch.allclose(top_eigenvalue(gram), torch.linalg.eigvalsh(gram)[:, -1], rtol=1e-6)


def test_sigma_history_growth_over_the_window():
    h = SigmaHistory(num_heads=2, window=3)
    for s in ([1.0, 2.0], [1.5, 2.0], [2.0, 2.0]):
        h.update(torch.tensor(s))
        assert torch.isnan(h.growth).all()  # not W+1 values yet
    h.update(torch.tensor([3.0, 2.0]))
    assert h.growth.tolist() == [3.0, 1.0]
    h.update(torch.tensor([6.0, 1.0]))
    assert h.growth.tolist() == [4.0, 0.5]


def test_ratio_to_median():
    r = ratio_to_median(torch.tensor([1.0, 2.0, 3.0, 10.0]))  # median of an even count: (2 + 3) / 2
    assert r.tolist() == pytest.approx([0.4, 0.8, 1.2, 4.0])
    r = ratio_to_median(torch.tensor([1.0, float("nan"), 3.0]))
    assert r[0].item() == 0.5 and math.isnan(r[1].item())
    assert torch.isnan(ratio_to_median(torch.tensor([float("nan")]))).all()


def test_linear_slope():
    t = torch.arange(5, dtype=F64)
    series = torch.stack([2 * t + 1, -t, torch.zeros(5, dtype=F64)], dim=1)
    assert linear_slope(series).tolist() == pytest.approx([2.0, -1.0, 0.0])
    assert torch.isnan(linear_slope(series[:1])).all()


def test_signal_builder_gives_each_layer_what_it_would_get_alone():
    """Layers of one head count are computed together; each layer's signals and saved state are
    bit for bit those of a builder of that layer alone, also when the layers' windows fill at
    different steps (a layer unseen at some steps, a step without a measured delta error, no chain),
    with NaN and inf readings, and across a save and load."""
    import dataclasses

    from flashwatch.step_signals import LayerReading, SignalBuilder

    heads, window = [12, 12, 12, 3], 24  # a window long enough for torch to sum it in blocks
    g = torch.Generator().manual_seed(5)

    def draw(h, scale=1.0):
        return torch.randn(h, generator=g, dtype=F64) * scale

    together = SignalBuilder(heads, window)
    alone = [SignalBuilder([h], window) for h in heads]
    for step in range(0, 270, 3):
        readings = []
        for layer, h in enumerate(heads):
            rows = torch.full((h,), 0.0 if (step // 3 + layer) % 7 == 0 else 32.0, dtype=F64)
            stats = {"rows": rows, "repeated_max_rows": draw(h).abs().round(), "repeated_max_rows_bf16": draw(h).abs(),
                     "repeated_max_rows_format": draw(h).abs(), "max_logit": draw(h).abs() * 4,
                     "delta_error": draw(h, 1e-3)}
            if step % 11 == layer:
                stats["delta_error"][0], stats["max_logit"][-1] = math.nan, math.inf
            chain = None if (step + layer) % 5 == 0 else {"push": draw(h, 1e-4), "push_true": draw(h, 1e-3),
                                                          "alignment": draw(h), "coherence": draw(h).abs()}
            calls = (2, 0) if (step + layer) % 9 == 0 else (2, 2)
            readings.append(LayerReading(stats=stats, sigma=1.0 + draw(h).abs() + 0.01 * step, chain=chain,
                                         low_precision=True, variant="sdpa", calls=calls))
        got = together.build(step=step, index=step // 3, loss=1.0, grad_norm=1.0, readings=readings).layers
        for layer, (builder, reading) in enumerate(zip(alone, readings)):
            want = builder.build(step=step, index=step // 3, loss=1.0, grad_norm=1.0, readings=[reading]).layers[0]
            for f in dataclasses.fields(want):
                a, b = getattr(got[layer], f.name), getattr(want, f.name)
                if f.name == "layer":
                    assert a == layer and b == 0
                elif isinstance(b, torch.Tensor):
                    assert a.dtype == b.dtype and torch.equal(a.isnan(), b.isnan()), (step, layer, f.name)
                    assert torch.equal(a.nan_to_num(), b.nan_to_num()), (step, layer, f.name)
                else:
                    assert a == b or (a != a and b != b), (step, layer, f.name)
        if step == 120:  # a resume: the state goes out and back in, layer by layer
            saved = together.state_dict()
            together = SignalBuilder(heads, window)
            together.load_state_dict(saved)
    for saved, builder in zip(together.state_dict(), alone):
        mine = builder.state_dict()[0]

        def flat(d, prefix=""):
            for k, v in d.items():
                yield from (flat(v, prefix + k + ".") if isinstance(v, dict) else [(prefix + k, v)])
        assert [k for k, _ in flat(saved)] == [k for k, _ in flat(mine)]
        for (k, a), (_, b) in zip(flat(saved), flat(mine)):  # bit for bit, NaN where NaN (an inf max logit's ratios)
            assert (torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())
                    if isinstance(a, torch.Tensor) else a == b), k


def test_max_logit_growth_rate_is_nan_while_the_window_holds_a_max_logit_at_or_below_zero():
    """log(max logit) is not defined at or below 0: a window holding such a step reads NaN, never a
    slope of a clamped log (which swung by 10^4 per 1,000 steps as a max logit crossed 0); once the
    window holds positive max logits only, the rate is the slope of their log."""
    from flashwatch.step_signals import LayerReading, SignalBuilder

    window = 3
    builder = SignalBuilder([1], window)
    rates = []
    for step, max_logit in enumerate((-3.0, 2.0, 4.0, 8.0, 16.0)):
        stats = {"rows": torch.tensor([8.0], dtype=F64), "repeated_max_rows": torch.zeros(1, dtype=F64),
                 "repeated_max_rows_bf16": torch.zeros(1, dtype=F64), "repeated_max_rows_format": torch.zeros(1, dtype=F64),
                 "max_logit": torch.tensor([max_logit], dtype=F64), "delta_error": torch.zeros(1, dtype=F64)}
        reading = LayerReading(stats=stats, sigma=torch.ones(1, dtype=F64), calls=(1, 1))
        layer = builder.build(step=step, index=step, loss=1.0, grad_norm=1.0, readings=[reading]).layers[0]
        rates.append(float(layer.max_logit_growth[0]))
    assert all(math.isnan(r) for r in rates[:3])  # steps 0-2: the window is not full, then holds -3
    assert rates[3] == pytest.approx(1000 * math.log(2)) and rates[4] == pytest.approx(1000 * math.log(2))
