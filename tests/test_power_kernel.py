"""The power-iteration kernel (flashwatch.kernels.power) against the PyTorch step it replaces.

On the CPU the kernel runs in Triton's interpreter (the ``triton_interpreter`` fixture); the
tests marked gpu run the compiled kernel. The PyTorch step (``PowerIteration.step`` where Triton
does not run) is the reference, itself checked against float64 SVDs in test_signals.py. Bounds:
both compute W V and W^T (W V) as FP32 sums of C (or D) products in different orders, so they
may differ by a few units of 2^-24 relative to the sums of magnitudes; the vectors are
orthonormal (entries at most 1) and the weights below have a top singular value well apart from
the second, so 1e-5 absolute on vectors and relative on sigma leaves a margin of about ten
over what was seen (1e-7 to 2e-6) while a wrong step (a dropped term, a wrong solve) is off by
far more.
"""

from __future__ import annotations

import math

import pytest
import torch

from flashwatch.chain import top_pair
from flashwatch.signals import PowerIteration, spectral_norm_exact


def _devices():
    return [pytest.param("cpu"), pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.fixture
def power(interpreted_on_cpu):
    """The kernel's module: interpreted for CPU tensors (and PowerIteration routed to it), compiled on CUDA."""
    from flashwatch.kernels import power

    return power


def _weights(n: int, d: int, c: int, device: str, seed: int = 0, dtype=torch.float32) -> torch.Tensor:
    """Gaussian heads with one planted direction three times stronger: a clear top singular value."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, d, c, generator=g) / math.sqrt(c)
    a, b = torch.randn(n, d, 1, generator=g), torch.randn(n, 1, c, generator=g)
    w = w + 3 * (a / a.norm(dim=1, keepdim=True)) * (b / b.norm(dim=2, keepdim=True))
    return w.to(device=device, dtype=dtype)


def _reference_step(w: torch.Tensor, v: torch.Tensor, iters: int):
    """The PyTorch step on the CPU in FP32: (v, sigma, top, (u, v_top))."""
    p = PowerIteration(w[:, :1, :2].float().cpu(), block=1, seed="random")  # any; its vectors are set below
    p.v, p.sigma = v.cpu().clone(), torch.zeros(w.shape[0])
    with pytest.MonkeyPatch.context() as m:
        m.setattr("flashwatch.signals._fused", lambda *args: False)
        sigma = p.step(w.float().cpu(), iters)
    top = p.top_in_block()
    return p.v, sigma, top, top_pair(w.float().cpu(), p.v, top)


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("shape,block,iters", [((3, 20, 300, ), 4, 1), ((2, 16, 64), 1, 1), ((2, 8, 40), 5, 2),
                                               ((2, 64, 96), 3, 3)], ids=["ragged-4", "classic", "block5-2", "3x3"])
@pytest.mark.parametrize("layout", ["rows", "columns", "bf16"])
def test_the_kernel_step_is_the_pytorch_step_to_fp32_rounding(power, device, shape, block, iters, layout):
    n, d, c = shape
    w = _weights(n, d, c, device, dtype=torch.bfloat16 if layout == "bf16" else torch.float32)
    if layout == "columns":  # a Conv1D's query weight: D along memory
        w = w.transpose(1, 2).contiguous().transpose(1, 2)
        assert w.stride(1) == 1
    # vectors as a run has them: the exact ones of the weight a step earlier
    before = w.float().cpu() + 0.05 * torch.randn(n, d, c, generator=torch.Generator().manual_seed(9)) / math.sqrt(c)
    start = PowerIteration(before, block=block, seed="svd").v.to(device)
    want_v, want_sigma, want_top, (want_u, want_vt) = _reference_step(w, start, iters)
    v, sigma, top, (u, vt) = power.power_step(w, start, iters, pair=True)
    assert v.shape == start.shape and sigma.shape == (n,) and top.shape == (n, block)
    assert (v.cpu() - want_v).abs().max() <= 1e-5
    assert ((sigma.cpu() - want_sigma).abs() / want_sigma).max() <= 1e-5
    assert (top.cpu() - want_top).abs().max() <= 1e-5
    assert (u.cpu() - want_u).abs().max() <= 1e-5 and (vt.cpu() - want_vt).abs().max() <= 1e-5
    # and against float64: a Rayleigh-Ritz value never exceeds sigma_max, and a step from the previous weight's
    # vectors tracks it within 1e-3
    exact = spectral_norm_exact(w.double().cpu()).float()
    assert (sigma.cpu() <= exact * (1 + 1e-5)).all() and ((exact - sigma.cpu()) / exact).max() < 1e-3


@pytest.mark.parametrize("device", _devices())
def test_a_non_finite_or_zero_head_keeps_its_vectors_as_in_pytorch(power, device):
    w = _weights(4, 16, 64, device, seed=1)
    w[1] = float("nan")
    w[2] = 0.0
    start = PowerIteration(_weights(4, 16, 64, "cpu", seed=2), block=3, seed="random").v.to(device)
    v, sigma, top, (u, vt) = power.power_step(w, start, 2, pair=True)
    assert torch.equal(v[1], start[1]) and torch.equal(v[2], start[2])  # kept bit for bit
    assert math.isnan(sigma[1].item()) and sigma[2].item() == 0.0
    assert torch.isnan(u[1]).all() and not u[2].any() and not vt[2].any()  # zero weight: zero pair
    want_v, want_sigma, _, _ = _reference_step(w, start, 2)
    assert torch.equal(v.cpu()[1:3], want_v[1:3])
    assert (v.cpu()[[0, 3]] - want_v[[0, 3]]).abs().max() <= 1e-5
    assert ((sigma.cpu()[[0, 3]] - want_sigma[[0, 3]]).abs() / want_sigma[[0, 3]]).max() <= 1e-5


@pytest.mark.parametrize("device", _devices())
def test_the_kernel_gives_the_same_bits_every_run(power, device):
    w = _weights(3, 20, 300, device, seed=3)
    start = PowerIteration(w.cpu(), block=4, seed="random").v.to(device)
    first = power.power_step(w, start, 2, pair=True)
    again = power.power_step(w, start, 2, pair=True)
    for a, b in zip(first[:3] + first[3], again[:3] + again[3]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("device", _devices())
def test_the_power_iteration_and_the_chains_pairs_take_the_kernel_where_triton_runs(power, device, monkeypatch):
    """PowerIteration.step makes its step, and with ``pair`` the top pairs, in one launch; WqNorms hands
    the chain those pairs without computing them again."""
    from flashwatch import wq as wq_module
    from flashwatch.wq import WqNorms

    calls = []
    real = power.power_step
    monkeypatch.setattr(power, "power_step", lambda *a, **k: calls.append(k.get("pair")) or real(*a, **k))
    w = _weights(4, 16, 48, device, seed=4)
    p = PowerIteration(w, block=2)
    sigma = p.step(w, pair=True)
    assert calls == [True] and p.made_pair() is not None and p.top_in_block() is not None
    assert torch.allclose(sigma.cpu(), spectral_norm_exact(w.double().cpu()).float(), rtol=1e-5)
    p.load_state_dict(p.state_dict())
    assert p.made_pair() is None  # the vectors changed since: the pair is made again from them

    class Layer:  # what WqNorms reads of an attached layer
        def __init__(self, index):
            self.index, self.num_heads, self.head_offset, self.total_heads = index, 2, 0, 2
            self.placement_kind, self.placement, self.stats = "whole", None, None

        def query_weight(self):
            return w[2 * self.index: 2 * self.index + 2]

    norms = WqNorms([Layer(0), Layer(1)], block=2)
    monkeypatch.setattr(wq_module, "top_pair", lambda *a: pytest.fail("the kernel's pair was computed again"))
    calls.clear()
    norms.step(exact=False, iters=1, on_error=lambda kind, exc: pytest.fail(str(exc)), pairs=True)
    pairs = norms.pairs()
    assert calls == [True] and set(pairs) == {0, 1}
    made_u, made_v = norms.groups[0].power.made_pair()
    assert torch.equal(pairs[1][0], made_u[2:]) and torch.equal(pairs[1][1], made_v[2:])


def test_power_step_says_what_it_takes():
    from flashwatch.kernels import power

    w, v = torch.randn(2, 8, 32), torch.randn(2, 32, 4)
    with pytest.raises(ValueError, match=r"k <= 16\) FP32 vectors .* got weight \(2, 8, 32\) torch.float64"):
        power.power_step(w.double(), v, 1)
    with pytest.raises(ValueError, match="iters 0"):
        power.power_step(w, v, 0)
    with pytest.raises(ValueError, match=r"v \(2, 32, 17\)"):
        power.power_step(w, torch.randn(2, 32, 17), 1)
    assert not power.supports(w, v.double(), 1) and power.supports(w, v, 1)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_the_kernel_runs_on_the_weights_device_whichever_is_current():
    """Monitor.step may run with cuda:0 current for a model on cuda:1: the launch goes to cuda:1."""
    from flashwatch.kernels import power

    w = _weights(3, 20, 300, "cuda:1")
    start = PowerIteration(w.cpu(), block=4, seed="random").v.to("cuda:1")
    want_v, want_sigma, _, _ = _reference_step(w, start, 1)
    with torch.cuda.device(0):
        v, sigma, _, _ = power.power_step(w, start, 1)
    assert v.device == sigma.device == torch.device("cuda:1")
    assert (v.cpu() - want_v).abs().max() <= 1e-5 and ((sigma.cpu() - want_sigma).abs() / want_sigma).max() <= 1e-5
