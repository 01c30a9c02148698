"""Exact rounding to the low-precision formats of P_bar V (flashwatch.kernels.formats), against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from flashwatch.kernels.formats import (E2M1_VALUES, FORMATS, get_format, mx_block_scale, round_to_format,
                                        round_to_grid, unit_gap, unit_threshold)


def _r(values, fmt, dtype=torch.float32, dim=-1):
    return round_to_format(torch.tensor(values, dtype=dtype), fmt, dim=dim).tolist()


# ---- FP8 E4M3: 3 mantissa bits, spacing 1/8 in [1, 2), subnormals k * 2**-9, max 448 ----------------

def test_e4m3_ties_to_even_and_nearest():
    # 1.0625 halfway 1 (mantissa 000) / 1.125 (001): even -> 1; 1.1875 halfway 1.125 / 1.25 (010) -> 1.25
    assert _r([1.0625, 1.1875, 1.07, -1.0625, -1.1875], "fp8_e4m3") == [1.0, 1.25, 1.125, -1.0, -1.25]
    # spacing 32 in [256, 448]: 272 halfway 256 / 288 -> 256; 304 halfway 288 / 320 -> 320
    assert _r([272.0, 304.0], "fp8_e4m3") == [256.0, 320.0]


def test_e4m3_subnormals():
    s = 2.0 ** -9  # smallest subnormal
    # s/2 halfway 0 / s -> 0 (even); 3s/2 halfway s (odd) / 2s -> 2s; 5s/2 halfway 2s / 3s -> 2s
    assert _r([s / 2, 3 * s / 2, 5 * s / 2, 0.6 * s], "fp8_e4m3") == [0.0, 2 * s, 2 * s, s]
    # just below the smallest normal 2**-6 = 8s: 7.5s halfway 7s (odd) / 8s -> 8s
    assert _r([7.5 * s, 7.4 * s], "fp8_e4m3") == [2.0 ** -6, 7 * s]


def test_e4m3_saturates():
    out = _r([448.0, 464.0, 500.0, -1e9, float("inf"), float("-inf")], "fp8_e4m3")
    assert out == [448.0, 448.0, 448.0, -448.0, 448.0, -448.0]
    assert math.isnan(_r([float("nan")], "fp8_e4m3")[0])


# ---- FP8 E5M2: 2 mantissa bits, spacing 1/4 in [1, 2), subnormals k * 2**-16, max 57344 -------------

def test_e5m2_ties_subnormals_saturation():
    assert _r([1.125, 1.375, 1.2, -1.375], "fp8_e5m2") == [1.0, 1.5, 1.25, -1.5]
    s = 2.0 ** -16
    assert _r([s / 2, 3 * s / 2, 0.51 * s], "fp8_e5m2") == [0.0, 2 * s, s]
    # 61440 is halfway 57344 / (65536, not finite): saturates, as do larger values and inf
    assert _r([57344.0, 61440.0, 1e6, float("inf")], "fp8_e5m2") == [57344.0] * 4


def test_bf16_matches_the_papers_rounding():
    # the paper's example: the tied terms sum to -4.703125, halfway; ties-to-even gives -4.6875
    assert _r([-4.703125, -4.70399], "bf16") == [-4.6875, -4.71875]


# ---- the generic grid against torch's casts: two independent implementations ------------------------

@pytest.mark.parametrize("fmt", ["bf16", "fp8_e4m3", "fp8_e5m2"])
def test_round_to_grid_equals_torch_cast(fmt):
    f = get_format(fmt)
    g = torch.Generator().manual_seed(0)
    mags = torch.exp2(torch.empty(200_000).uniform_(f.min_exp - f.mantissa_bits - 2, math.log2(f.max_value) + 1,
                                                    generator=g))
    x = mags * torch.where(torch.rand(200_000, generator=g) < 0.5, -1.0, 1.0)
    # exact halfway points too: k + 1/2 units at random binades
    e = torch.randint(f.min_exp, int(math.log2(f.max_value)), (20_000,), generator=g)
    k = torch.randint(0, 2 ** f.mantissa_bits, (20_000,), generator=g)
    half = torch.ldexp(1.0 + (k.double() + 0.5) / 2 ** f.mantissa_bits, e).float()
    x = torch.cat([x, half, -half]).float()
    ours = round_to_grid(x, f.mantissa_bits, f.min_exp, f.max_value)
    cast = round_to_format(x, fmt)
    assert torch.equal(ours, cast), (x[ours != cast][:5], ours[ours != cast][:5], cast[ours != cast][:5])
    assert torch.equal(round_to_format(x.double(), fmt).float(), cast)  # float64 inputs: same grid


# ---- MXFP4: E8M0 block scale 2**(floor(log2 amax) - 2), E2M1 elements, ties to even, clamp to 6 ------

def test_mxfp4_block_scale_and_elements():
    # amax 1: X = 2**(0 - 2) = 1/4; elements 4x: 4, 3.6 -> 4, 3.5 (halfway 3 / 4) -> 4, 3.2 -> 3,
    # 1.2 -> 1, 1.25 (halfway 1 / 1.5) -> 1, 0.25 (halfway 0 / 0.5) -> 0, 0.75 (halfway 0.5 / 1) -> 1
    x = [1.0, 0.9, 0.875, 0.8, 0.3, 0.3125, 0.0625, 0.1875] + [0.0] * 24
    assert _r(x, "mxfp4") == [1.0, 1.0, 1.0, 0.75, 0.25, 0.25, 0.0, 0.25] + [0.0] * 24
    # amax 0.9 (no 1 in the block): X = 2**(-1 - 2) = 1/8, 0.9 / X = 7.2 clamps to 6 -> 0.75
    assert _r([0.9, 0.5] + [0.0] * 30, "mxfp4")[:2] == [0.75, 0.5]
    # amax 7: X = 1, 7 -> 6 (clamp); 5 halfway 4 / 6 -> 4; 2.5 -> 2; amax 3: X = 1/2, exact
    assert _r([7.0, 5.0, 2.5, -5.0] + [0.0] * 28, "mxfp4")[:4] == [6.0, 4.0, 2.0, -4.0]
    # amax 3: X = 1/2; 0.25 -> element 0.5 (exact); 0.125 -> 0.25, halfway 0 / 0.5 -> 0
    assert _r([3.0, -1.5, 0.25, 0.125] + [0.0] * 28, "mxfp4")[:4] == [3.0, -1.5, 0.25, 0.0]


def test_mxfp4_blocks_are_32_along_the_reduction_dim():
    x = torch.zeros(2, 64)
    x[:, 0], x[:, 1] = 1.0, 0.3           # block 0: X = 1/4, 0.3 -> 0.25
    x[:, 32], x[:, 33] = 100.0, 0.3       # block 1: X = 2**(6 - 2) = 16, 0.3 -> 0
    out = round_to_format(x, "mxfp4", dim=-1)
    assert out[0, :2].tolist() == [1.0, 0.25] and out[0, 32:34].tolist() == [96.0, 0.0]
    # along dim 0 (V's key dimension): the same blocks on the transpose
    assert torch.equal(round_to_format(x.t().contiguous(), "mxfp4", dim=0), out.t())
    s = mx_block_scale(x, dim=-1)
    assert s[0, :32].unique().tolist() == [0.25] and s[0, 32:].unique().tolist() == [16.0]


def test_mxfp4_partial_zero_and_extreme_blocks():
    x = torch.tensor([1.0] + [0.0] * 39 + [0.3] + [0.0] * 3)  # 44 elements: a full block and a partial one
    out = round_to_format(x, "mxfp4")
    assert out[0] == 1.0 and out[40] == 0.25 and mx_block_scale(x)[40] == 2.0 ** -4
    assert torch.equal(round_to_format(torch.zeros(32), "mxfp4"), torch.zeros(32))
    # E8M0 floor 2**-127: amax 2**-130 gives X = 2**-127, elements 2**-3 -> 0
    assert round_to_format(torch.full((32,), 2.0 ** -130, dtype=torch.float64), "mxfp4").abs().max() == 0
    nan = round_to_format(torch.tensor([float("inf")] + [1.0] * 31), "mxfp4")
    assert torch.isnan(nan).all()


def _mxfp4_float64_reference(x: list[float]) -> list[float]:
    """Block scaling by hand in float64: math.frexp for the scale, nearest grid point by search."""
    grid = list(E2M1_VALUES)
    out = []
    for start in range(0, len(x), 32):
        block = x[start:start + 32]
        amax = max(abs(v) for v in block)
        exp = 0 if amax == 0 else min(max(math.frexp(amax)[1] - 1 - 2, -127), 127)
        scale = 2.0 ** exp
        for v in block:
            y = min(abs(v) / scale, 6.0)
            best = min(range(8), key=lambda i: (abs(grid[i] - y), i % 2))  # a tie goes to the even code
            out.append(math.copysign(grid[best] * scale, v))
    return out


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_mxfp4_equals_a_float64_block_scaling(dtype):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(40, 96, generator=g, dtype=torch.float64) * torch.exp2(torch.randint(-20, 20, (40, 1), generator=g))
    x[:, 5] = 0.875 * x[:, :32].abs().amax(1)  # some exact halfway points
    x = x.to(dtype)
    ours = round_to_format(x, "mxfp4", dim=-1).to(torch.float64)
    ref = torch.tensor([_mxfp4_float64_reference(row) for row in x.to(torch.float64).tolist()], dtype=torch.float64)
    assert torch.equal(ours, ref)


# ---- where P_bar rounds to 1 -----------------------------------------------------------------------

@pytest.mark.parametrize("fmt,threshold", [("bf16", 1 - 2 ** -9), ("fp8_e4m3", 0.96875), ("fp8_e5m2", 0.9375),
                                           ("mxfp4", 0.875)])
def test_unit_threshold_is_where_p_bar_rounds_to_one(fmt, threshold):
    t = unit_threshold(fmt)
    assert t == threshold and unit_gap(fmt) == pytest.approx(math.log(threshold), rel=1e-15)
    below = math.nextafter(t, 0.0)
    # in MXFP4 the threshold holds in the block of a P_bar of exactly 1 (the row's max key)
    x = torch.tensor([1.0, t, below] + [0.0] * 29, dtype=torch.float64)
    out = round_to_format(x, fmt).tolist()
    assert out[1] == 1.0 and out[2] < 1.0, out[:3]


@pytest.mark.parametrize("fmt", FORMATS)
def test_fixed_offsets_keep_the_largest_p_bar_below_one(fmt):
    f = get_format(fmt)
    top = torch.tensor([math.exp(-f.fixed_min_offset)] + [0.0] * 31, dtype=torch.float64)
    assert round_to_format(top, fmt)[0] < 1.0
    assert f.fixed_min_offset > -unit_gap(fmt) and f.fixed_max_offset > f.fixed_min_offset


def test_bad_inputs_are_clear_errors():
    with pytest.raises(ValueError, match="unknown number format 'fp6'.*accepted: bf16, fp8_e4m3, fp8_e5m2, mxfp4"):
        round_to_format(torch.ones(2), "fp6")
    with pytest.raises(TypeError, match="floating-point"):
        round_to_format(torch.ones(2, dtype=torch.int64), "fp8_e4m3")


# ---- the monitor's count at the format's grid (AttentionStats.repeated_max_rows_format) ----------------

@pytest.mark.parametrize("fmt", ["bf16", "fp8_e4m3", "fp8_e5m2"])
def test_format_count_is_the_rows_where_p_bar_rounds_to_one_twice(fmt):
    """Against a brute force on the rounded P_bar itself: rows with two or more entries that round to 1."""
    from flashwatch.kernels import AttentionStats
    from flashwatch.kernels import reference

    g = torch.Generator().manual_seed(3)
    B, H, N, D = 2, 3, 96, 64
    q = (torch.randn(B, H, N, D, generator=g) * 0.3).to(torch.bfloat16)  # small scores: many near-ties
    k, v = (torch.randn(B, H, N, D, generator=g).to(torch.bfloat16) for _ in range(2))
    k[:, :, 5] = k[:, :, 2]
    stats = AttentionStats(H, "cpu", format=fmt)
    q.requires_grad_(True)
    reference.flash_attention(q, k, v, stats=stats).backward(torch.ones(B, H, N, D, dtype=torch.bfloat16))
    s = reference.scores(q.detach(), k, True, 1 / 8)
    p_bar = torch.exp(s - s.amax(-1, keepdim=True))
    ones = (round_to_format(p_bar, fmt) == 1.0).sum(-1)
    want = (ones >= 2).sum(dim=(0, 2))
    assert stats.repeated_max_rows_format.tolist() == want.tolist()
    assert 0 < want.sum() < B * H * N  # the test sees both kinds of rows


def test_stats_format_is_checked():
    from flashwatch.kernels import AttentionStats

    assert AttentionStats(2).format == "bf16" and "format='bf16'" in repr(AttentionStats(2))
    with pytest.raises(ValueError, match="unknown number format 'fp4'"):
        AttentionStats(2, format="fp4")


def test_the_monitor_reports_the_format_count():
    """MonitorConfig.format reaches every layer's statistics; the metric is the count over rows."""
    from flashwatch import Monitor, MonitorConfig
    from research.experiments.model import ExperimentGPT

    with pytest.raises(ValueError, match="MonitorConfig.format must be one of 'bf16', 'fp8_e4m3'"):
        MonitorConfig(format="fp8")
    torch.manual_seed(0)
    model = ExperimentGPT(n_layer=1, n_head=1, n_embd=64, block_size=32)
    ratios = {}
    for fmt in ("bf16", "mxfp4"):
        torch.manual_seed(0)
        m = Monitor(MonitorConfig(interval=1, mode="own_kernel", format=fmt))
        m.attach(model)
        assert m.layers[0].stats.format == fmt
        x = torch.randint(0, 64, (2, 32))
        loss = model(x, x)
        loss.backward()
        m.step(loss=loss.detach())
        snap = m.snapshot()
        ratios[fmt] = snap["flashwatch_repeated_max_ratio_format"]
        m.detach()
        model.zero_grad()
    # MXFP4's grid ties every key within 0.13 of the max: at least as many rows as BF16's 0.002
    assert all(ratios["mxfp4"][key] >= ratios["bf16"][key] for key in ratios["bf16"])
    assert any(ratios["mxfp4"][key] > 0 for key in ratios["mxfp4"])
