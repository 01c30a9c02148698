"""The bias lab (research.lab): the paper's worked example, and `python -m research.lab --quick` on the CPU."""

from __future__ import annotations

import json

import pytest
import torch

from research.lab import main, paper_example


def test_paper_example_reproduces_the_papers_arithmetic():
    ex = paper_example()
    assert ex["terms"] == [-2.40625, -0.00087, -2.296875]
    assert ex["bf16"] == -4.71875
    assert ex["exact"] == pytest.approx(-4.70399, abs=5e-6)
    assert ex["error"] == pytest.approx(-0.0148, abs=5e-5)
    # the mechanism: the two tied BF16 terms sum to exactly halfway between two BF16 numbers,
    # ties-to-even alone would round towards zero, the same-signed remainder tips it away
    assert ex["halfway"] and ex["tied_sum"] == -4.703125 and ex["tied_sum_bf16"] == -4.6875
    assert ex["ulp"] == 2.0 ** -5


def _no_nan(name):
    raise ValueError(f"non-standard JSON constant {name}")


@pytest.fixture(scope="module")
def quick_lab(tmp_path_factory):
    path = tmp_path_factory.mktemp("lab") / "lab.json"
    assert main(["--device", "cpu", "--quick", "--json", str(path)]) == 0
    return json.loads(path.read_text(), parse_constant=_no_nan)


KERNELS = ("flashwatch_plain", "flashwatch_fixed", "flashwatch_fp32_delta", "paper", "paper_fixed", "sdpa_math")
FORMATS = ("fp8_e4m3", "fp8_e5m2", "mxfp4")
FORMAT_KERNELS = tuple(f"{f}_{v}" for f in FORMATS for v in ("plain", "fixed", "fp32_delta", "rounded_sum",
                                                             "plain_pbar_only", "rounded_sum_pbar_only"))


def test_json_structure(quick_lab):
    d = quick_lab
    for key in ("date", "command", "device", "versions", "shape", "dtype", "seed", "paper_example",
                "inputs", "kernels", "do_mean", "paper_tile"):
        assert key in d, key
    assert d["device"]["type"] == "cpu" and d["dtype"] == "bfloat16" and d["seed"] == 0
    assert d["versions"]["torch"] == torch.__version__ and "triton" in d["versions"]
    assert d["command"].startswith("python -m research.lab --device cpu --quick")
    assert d["paper_example"]["bf16"] == -4.71875
    shape = d["shape"]
    assert set(d["inputs"]) == {"dup_q4", "dup_q1", "nodup_q4", "model_quick_s2", "model_quick_s10"}
    assert "--model-size quick" in d["command"]
    for name, entry in d["inputs"].items():
        spec = entry["spec"]
        if spec["source"] == "synthetic":
            assert entry["rows"] == shape["B"] * shape["H"] * shape["N"]
            frac = entry["tie_rows"] / entry["rows"]
            assert frac > 0.9 if spec["duplicate_keys"] else frac < 0.05, (name, frac)
        else:  # recorded from the real-failure recipe's model (quick size: 1 head of 64, context 64, batch 4)
            assert spec["source"] == "recorded" and spec["layer"] == 1 and spec["shape"] == [4, 1, 64, 64]
            assert entry["rows"] == 4 * 64 and spec["step"] in (2, 10) and spec["recipe"]["lr"] == 3e-3
        for kname in KERNELS + FORMAT_KERNELS:
            r = entry["results"][kname]
            assert "error" not in r, (name, kname, r.get("error"))
            for group in ("tie", "other", "all"):
                o = r["out"][group]
                assert set(o) == {"n", "mean", "mean_abs", "z_feat", "max_abs_z_feat", "z_pooled"}
                assert set(r["delta"][group]) == {"n", "mean", "mean_abs", "z", "z_heads"}
                assert set(r["delta_zero_mean_do"][group]) == {"n", "mean", "mean_abs", "z", "z_heads"}
            assert r["out"]["tie"]["n"] + r["out"]["other"]["n"] == entry["rows"]
            assert r["out"]["tie"]["n"] == entry["tie_rows"]
            if kname.startswith("flashwatch"):
                assert r["delta_used_stats"]["rows"] == entry["rows"]
            if kname.startswith("paper"):
                assert "delta_bf16" in r
            if kname in FORMAT_KERNELS:
                assert set(r["delta_used"]["all"]) == {"n", "mean", "mean_abs", "z", "z_heads"}
                assert d["kernels"][kname]["format"] == next(f for f in FORMATS if kname.startswith(f))
    table = {row["kernel"]: row for row in d["formats"]}
    assert set(table) == set(FORMAT_KERNELS)
    for row in table.values():
        assert row["format"] in FORMATS and row["kernel"] == f"{row['format']}_{row['variant']}"
        assert set(row) >= set(d["inputs"])


def test_format_rows_plain_and_fp32_delta_share_the_forward(quick_lab):
    for entry in quick_lab["inputs"].values():
        for fmt in FORMATS:
            plain, fp32 = entry["results"][f"{fmt}_plain"], entry["results"][f"{fmt}_fp32_delta"]
            assert plain["out"] == fp32["out"]
            assert plain["delta_used"] == plain["delta"]  # plain's backward takes delta from its output


def test_rounded_row_sum_removes_the_shrinkage_bias(quick_lab):
    """Dividing round(P_bar) V by the FP32 row sum pulls O towards zero at FP8/MXFP4 (a one-signed delta
    error); dividing by the sum of the rounded P_bar does not. P_bar alone rounded (V in BF16)."""
    for fmt in FORMATS:
        res = quick_lab["inputs"]["nodup_q4"]["results"]
        plain = res[f"{fmt}_plain_pbar_only"]["delta_used"]["all"]
        fixed_sum = res[f"{fmt}_rounded_sum_pbar_only"]["delta_used"]["all"]
        assert plain["z_heads"] > 3 and abs(fixed_sum["z_heads"]) < 3, (fmt, plain, fixed_sum)
        for name in ("dup_q4", "dup_q1", "nodup_q4"):
            res = quick_lab["inputs"][name]["results"]
            plain = res[f"{fmt}_plain_pbar_only"]["delta_used"]["all"]
            fixed_sum = res[f"{fmt}_rounded_sum_pbar_only"]["delta_used"]["all"]
            assert fixed_sum["mean_abs"] < plain["mean_abs"] / 5, (fmt, name, plain, fixed_sum)


# ---- the format emulation (research.format_attention) and the recorded inputs ---------------------------

def _qkv(seed=0, shape=(2, 3, 64, 64), dup=False):
    g = torch.Generator().manual_seed(seed)
    q, k, v, do = (torch.randn(*shape, generator=g) for _ in range(4))
    if dup:
        k[:, :, 1::2] = k[:, :, 0:shape[2] - 1:2]
    return tuple(t.to(torch.bfloat16) for t in (q * 2, k, v - 1, do))


@pytest.mark.parametrize("variant", ["plain", "fp32_delta"])
def test_format_attention_at_bf16_is_flashwatchs_reference_bit_for_bit(variant):
    from flashwatch.kernels.reference import flash_attention
    from research.format_attention import format_attention

    q, k, v, do = _qkv()
    a = [t.clone().requires_grad_(True) for t in (q, k, v)]
    b = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out_a, out_b = format_attention(*a, fmt="bf16", variant=variant), flash_attention(*b, variant=variant)
    out_a.backward(do)
    out_b.backward(do)
    assert torch.equal(out_a, out_b)
    for x, y in zip(a, b):
        assert torch.equal(x.grad, y.grad)


def test_fixed_at_a_format_widens_the_tie_to_the_formats_unit_gap():
    from research.format_attention import format_forward

    # one query, two keys whose scores differ by 0.02: both P_bar round to 1 in E4M3 (gap 0.032), not in BF16
    q = torch.zeros(1, 1, 2, 16, dtype=torch.float32)
    q[..., 0] = 4.0
    k = torch.zeros(1, 1, 2, 16, dtype=torch.float32)
    k[0, 0, 0, 0], k[0, 0, 1, 0] = 1.0, 1.0 - 0.02 / q[0, 0, 1, 0].item()
    v = torch.randn(1, 1, 2, 16)
    row = 1  # the second row sees both keys (causal)
    sm = 1.0
    assert bool(format_forward(q, k, v, fmt="fp8_e4m3", variant="fixed", sm_scale=sm)["tied"][0, 0, row])
    assert not bool(format_forward(q, k, v, fmt="bf16", variant="fixed", sm_scale=sm)["tied"][0, 0, row])
    # the shifted max P_bar rounds below 1 in the format: the fixed output differs from plain's on that row
    plain = format_forward(q, k, v, fmt="fp8_e4m3", variant="plain", sm_scale=sm)["o_fp32"]
    fixed = format_forward(q, k, v, fmt="fp8_e4m3", variant="fixed", sm_scale=sm)["o_fp32"]
    assert not torch.equal(plain[0, 0, row], fixed[0, 0, row]) and torch.equal(plain[0, 0, 0], fixed[0, 0, 0])


def test_v_operand_scaled_rounds_each_heads_v_on_the_format_grid_scaled_to_its_range():
    from research.format_attention import format_forward

    # one key, so O = round(P_bar) V / P_bar = V as the product takes it (P_bar = 1 is exact)
    v = torch.tensor([0.003, -0.0107, 0.5, 0.0], dtype=torch.float64).reshape(1, 1, 1, 4)
    q = k = torch.ones(1, 1, 1, 4, dtype=torch.float64)
    out = {m: format_forward(q, k, v, fmt="fp8_e4m3", v_operand=m)["o_fp32"].flatten().tolist()
           for m in ("format", "scaled", "input")}
    assert out["input"] == v.flatten().tolist()
    # unscaled: 0.003 and -0.0107 are E4M3 subnormals (step 2**-9): 0.00390625 and -0.009765625
    assert out["format"] == [2 ** -8, -5 * 2 ** -9, 0.5, 0.0]
    # scaled by 448 / 0.5 = 896: 2.688 -> 2.75 (step 0.25 in [2, 4)), -9.5872 -> -10 (step 1 in [8, 16))
    assert out["scaled"] == pytest.approx([2.75 / 896, -10 / 896, 0.5, 0.0], rel=0, abs=1e-15)
    # an all-zero head keeps a scale of 1 (no division by zero)
    zero = format_forward(q, k, torch.zeros_like(v), fmt="fp8_e4m3", v_operand="scaled")["o_fp32"]
    assert torch.equal(zero, torch.zeros_like(zero))


def test_format_attention_bad_arguments():
    from research.format_attention import format_attention

    q, k, v, _ = _qkv()
    with pytest.raises(ValueError, match="fmt must be one of"):
        format_attention(q, k, v, fmt="fp6")
    with pytest.raises(ValueError, match="variant must be one of"):
        format_attention(q, k, v, variant="auto")
    with pytest.raises(ValueError, match="v_operand must be one of"):
        format_attention(q, k, v, v_operand="fp8")


def test_recorded_inputs_round_trip(tmp_path):
    from research import lab_inputs

    recs = lab_inputs.record_model_inputs("quick", steps=(1,))
    assert len(recs) == 1 and recs[0].q.dtype == torch.bfloat16 and recs[0].do.shape == recs[0].q.shape
    assert recs[0].do.abs().sum() > 0  # a real gradient reached the attention output
    path = tmp_path / "inputs.pt"
    lab_inputs.save(recs, str(path))
    back = lab_inputs.load(str(path))
    assert torch.equal(back[0].k, recs[0].k) and back[0].describe() == recs[0].describe()
    (tmp_path / "junk.pt").write_text("not a recording")
    with pytest.raises(ValueError, match="not a file of recorded attention inputs"):
        lab_inputs.load(str(tmp_path / "junk.pt"))
