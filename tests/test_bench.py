"""flashwatch bench's arithmetic and its CPU behaviour (the timings themselves need CUDA)."""

from __future__ import annotations

import pytest
import torch

from flashwatch import bench
from flashwatch.cli import main


def test_flops_follow_the_anchor_convention():
    # ../shared/ANCHORS.md: causal = half of 4*B*H*N^2*D
    assert bench.attention_flops((16, 12, 1024, 64), causal=True) == 0.5 * 4 * 16 * 12 * 1024 ** 2 * 64
    assert bench.attention_flops((1, 1, 8, 16), causal=False) == 4 * 8 * 8 * 16


def test_shape_parsing_names_what_is_accepted():
    assert bench.parse_shape("16,12,1024,64") == (16, 12, 1024, 64)
    with pytest.raises(ValueError, match="four positive integers B,H,N,D"):
        bench.parse_shape("16,12,1024")
    with pytest.raises(ValueError, match="four positive integers"):
        bench.parse_shape("16,12,0,64")


def test_rounds_take_the_median_and_keep_the_spread():
    rounds = [{"fwd_ms": 1.0, "fwd_bwd_ms": 2.0}, {"fwd_ms": 3.0, "fwd_bwd_ms": 2.5}, {"fwd_ms": 2.0, "fwd_bwd_ms": 2.2}]
    t = bench._median_of_rounds(rounds)
    assert t["fwd_ms"] == 2.0 and t["fwd_bwd_ms"] == 2.2 and t["rounds"] == 3
    assert t["fwd_bwd_spread"] == pytest.approx(0.25)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without CUDA")
def test_without_cuda_it_says_so_and_fails(capsys):
    assert main(["bench", "--quick"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().out
