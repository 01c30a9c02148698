"""The chain's step-end reading kernel (flashwatch.kernels.chain_reading) against the PyTorch
reading it replaces (``LayerChain.read_all`` where Triton does not run).

On the CPU the kernel runs in Triton's interpreter; the tests marked gpu run it compiled. Bounds:
- push and push_true are copies: equal;
- alignment and coherence lie in [-1, 1]. Both paths take the sketch's norms and dot product as
  FP32 sums of D r = 512 products here, in different orders: runs of at most 32 terms a thread,
  then trees (PyTorch's reductions, Triton's, numpy's pairwise sums in the interpreter), each off
  by at most about (32 + 9) 2^-24 of the sum of the terms' magnitudes, which Cauchy-Schwarz
  bounds by |g| |prev|: at most about 5e-6 between the two paths' ratios; 1e-5 absolute. The
  sketches below are correlated from step to step, so the ratios are large (0.5-1) and a
  relative error of 1e-4 in them fails;
- the window's sum lam s + g is one fused multiply-add on a GPU and two roundings in PyTorch: the
  same to 2^-24 of |lam s| + |g|, so entries near a cancellation differ relatively by more;
  compared to 1e-5 of the tensor's largest entry. Its norm sum is a sum of positives: 1e-5
  relative;
- NaN must be NaN in the same places, and the window's flags exactly equal.
"""

from __future__ import annotations

import pytest
import torch

from flashwatch import chain as chain_module
from flashwatch.chain import LayerChain


def _devices():
    return [pytest.param("cpu"), pytest.param("cuda", marks=pytest.mark.gpu)]


def _chains(device: str, n: int = 3, h: int = 2, d: int = 8, c: int = 24) -> list[LayerChain]:
    return [LayerChain(h, d, c, device) for _ in range(n)]


def _feed(chains: list[LayerChain], step: int, rows: list[bool], grads: list[bool]) -> None:
    """This step's accumulators, as the statistics pass and the weight hook would leave them."""
    g = torch.Generator().manual_seed(100 + step)
    for i, (c, r, gr) in enumerate(zip(chains, rows, grads)):
        c.ugv.copy_(torch.randn(c.ugv.shape, generator=g))
        c.push_true.copy_(torch.randn(c.push_true.shape, generator=g, dtype=torch.float64))
        lasting = torch.randn(c.sketch.shape, generator=torch.Generator().manual_seed(7 + i))  # the same each step
        c.sketch.copy_((lasting + 0.5 * torch.randn(c.sketch.shape, generator=g)) * (step + 1))
        if step == 1:
            c.sketch[0].zero_()  # a head with no error this step: coherence NaN, alignment NaN
        c.rows_calls, c.grad_calls, c._touched = int(r), int(gr), True


def _same(a: torch.Tensor, b: torch.Tensor, rtol: float = 0.0, atol: float = 0.0) -> bool:
    """NaN in the same places, and |a - b| <= rtol |b| + atol elsewhere."""
    a, b = a.cpu().double(), b.cpu().double()
    nan = torch.isnan(a)
    return torch.equal(nan, torch.isnan(b)) and bool(((a - b).abs() <= rtol * b.abs() + atol)[~nan].all())


def _read_both(kernel: list[LayerChain], reference: list[LayerChain], lam: float, monkeypatch) -> None:
    got = LayerChain.read_all(kernel, lam)
    with monkeypatch.context() as m:
        m.setattr(chain_module, "uses_triton", lambda device: False)
        want = LayerChain.read_all(reference, lam)
    assert got.shape == want.shape == (len(kernel), 4, kernel[0].num_heads)
    assert _same(got[:, :2], want[:, :2]), (got, want)  # push, push_true: copies
    assert _same(got[:, 2:], want[:, 2:], atol=1e-5), (got, want)  # alignment, coherence
    for a, b in zip(kernel, reference):
        assert _same(a.ew_sum, b.ew_sum, atol=1e-5 * b.ew_sum.abs().max().item())
        assert _same(a.ew_norm, b.ew_norm, rtol=1e-5) and torch.equal(a.prev, b.prev)
        assert torch.equal(a.has_prev, b.has_prev)
        for name in ("ugv", "push_true", "sketch"):  # the next step's accumulators
            assert not getattr(a, name).any()
        assert a.rows_calls == a.grad_calls == 0


@pytest.mark.parametrize("device", _devices())
def test_the_kernel_reading_is_the_pytorch_reading_step_after_step(interpreted_on_cpu, device, monkeypatch):
    kernel, reference = _chains(device), _chains(device)
    plan = [([True, True, True], [True, True, True]),
            ([True, False, True], [False, True, True]),  # a chain fed no rows, one no gradient
            ([True, True, False], [True, True, True]),
            ([True, True, True], [True, False, True])]
    for step, (rows, grads) in enumerate(plan):
        _feed(kernel, step, rows, grads)
        _feed(reference, step, rows, grads)
        _read_both(kernel, reference, 0.9, monkeypatch)
    # the kernel's chains hold their state as rows of one stack per field, the reference's do not
    assert kernel[1].sketch.untyped_storage().data_ptr() == kernel[0].sketch.untyped_storage().data_ptr()
    assert reference[1].sketch.untyped_storage().data_ptr() != reference[0].sketch.untyped_storage().data_ptr()


@pytest.mark.parametrize("device", _devices())
def test_a_chain_whose_state_was_replaced_is_read_from_its_new_state(interpreted_on_cpu, device, monkeypatch):
    """load_state_dict (a resume) and set_flat (a ranks' mean) give a chain new tensors: the next
    reading takes them, and the stack is made again from them."""
    kernel, reference = _chains(device), _chains(device)
    for step in range(2):
        _feed(kernel, step, [True] * 3, [True] * 3)
        _feed(reference, step, [True] * 3, [True] * 3)
        _read_both(kernel, reference, 0.75, monkeypatch)
    saved = reference[2].state_dict()
    saved["ew_sum"] = saved["ew_sum"] * 3  # a different window, as from another run's checkpoint
    kernel[2].load_state_dict(saved)
    reference[2].load_state_dict(saved)
    _feed(kernel, 2, [True] * 3, [True] * 3)
    _feed(reference, 2, [True] * 3, [True] * 3)
    flat = kernel[1].flat()
    kernel[1].set_flat(flat * 2, owners=2.0)  # the mean of two ranks that added the same values
    reference[1].set_flat(reference[1].flat() * 2, owners=2.0)
    _read_both(kernel, reference, 0.75, monkeypatch)
    assert all(c.sketch.untyped_storage().data_ptr() == kernel[0].sketch.untyped_storage().data_ptr()
               for c in kernel)


def test_read_chains_says_what_it_takes():
    from flashwatch.kernels.chain_reading import read_chains

    c = LayerChain(2, 4, 8, "cpu")
    state = {name: torch.stack([getattr(c, name)]) for name in chain_module._StackedState.FIELDS}
    state["prev"] = state["prev"].transpose(2, 3)
    flags = torch.ones(1, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"prev must be a contiguous \(1, 2, \.\.\.\) tensor"):
        read_chains(state, flags, flags, 0.9)


@pytest.mark.gpu
def test_the_reading_never_waits_for_the_gpu():
    """The first reading (which stacks the chains' state) and later ones (one launch) dispatch without
    a host wait."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    chains = _chains("cuda", n=12, h=12, d=64, c=768)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for step in range(3):
            for c in chains:
                c.rows_calls, c.grad_calls, c._touched = 1, 1, True
            out = LayerChain.read_all(chains, 0.9)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out.shape == (12, 4, 12)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_the_reading_runs_on_the_chains_device_whichever_is_current(monkeypatch):
    """Monitor.step may run with cuda:0 current for a model on cuda:1: the launch goes to cuda:1."""
    kernel, reference = _chains("cuda:1"), _chains("cuda:1")
    _feed(kernel, 0, [True] * 3, [True] * 3)
    _feed(reference, 0, [True] * 3, [True] * 3)
    with torch.cuda.device(0):
        _read_both(kernel, reference, 0.9, monkeypatch)


def test_a_launch_goes_to_the_tensors_device():
    import contextlib

    from flashwatch.kernels.launch import on_device

    assert isinstance(on_device(torch.zeros(1)), contextlib.nullcontext)  # CPU: nothing to switch
    if torch.cuda.device_count() >= 2:
        with torch.cuda.device(0), on_device(torch.zeros(1, device="cuda:1")):
            assert torch.cuda.current_device() == 1
