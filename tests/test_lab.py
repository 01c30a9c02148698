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
    assert set(d["inputs"]) == {"dup_q4", "dup_q1", "nodup_q4"}
    for name, entry in d["inputs"].items():
        assert entry["rows"] == shape["B"] * shape["H"] * shape["N"]
        frac = entry["tie_rows"] / entry["rows"]
        assert frac > 0.9 if entry["spec"]["duplicate_keys"] else frac < 0.05, (name, frac)
        for kname in KERNELS:
            r = entry["results"][kname]
            assert "error" not in r, (name, kname, r.get("error"))
            for group in ("tie", "other", "all"):
                o = r["out"][group]
                assert set(o) == {"n", "mean", "mean_abs", "z_feat", "max_abs_z_feat", "z_pooled"}
                assert set(r["delta"][group]) == {"n", "mean", "mean_abs", "z"}
                assert set(r["delta_zero_mean_do"][group]) == {"n", "mean", "mean_abs", "z"}
            assert r["out"]["tie"]["n"] + r["out"]["other"]["n"] == entry["rows"]
            assert r["out"]["tie"]["n"] == entry["tie_rows"]
            if kname.startswith("flashwatch"):
                assert r["delta_used_stats"]["rows"] == entry["rows"]
            if kname.startswith("paper"):
                assert "delta_bf16" in r


def test_paper_emulation_is_biased_negative_on_tie_rows(quick_lab):
    for name in ("dup_q4", "dup_q1"):
        tie = quick_lab["inputs"][name]["results"]["paper"]["out"]["tie"]
        assert tie["z_feat"] < 0 and tie["z_pooled"] < 0, (name, tie)
    tie = quick_lab["inputs"]["dup_q1"]["results"]["paper"]["out"]["tie"]
    assert tie["z_feat"] < -2 and tie["z_pooled"] < -2, tie


def test_fp32_delta_uses_the_fp32_output(quick_lab):
    """Same forward as plain, but the delta its backward uses is closer to delta_hp."""
    for entry in quick_lab["inputs"].values():
        plain = entry["results"]["flashwatch_plain"]
        fp32 = entry["results"]["flashwatch_fp32_delta"]
        assert plain["out"] == fp32["out"]
        assert fp32["delta_used_stats"]["sum_abs"] < plain["delta_used_stats"]["sum_abs"]


def test_cuda_without_cuda_is_a_clear_error(capsys):
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    assert main(["--device", "cuda", "--quick"]) == 2
    assert "torch.cuda.is_available() is False" in capsys.readouterr().err
