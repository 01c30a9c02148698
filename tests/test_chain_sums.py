"""The chain's two sum kernels (flashwatch.kernels.chain_sums) against float64 sums.

On the CPU they run in Triton's interpreter (the ``triton_interpreter`` fixture); the tests
marked gpu run the compiled kernels. Bounds: FP32 products are exact to 2^-24 of each term,
so the float64 sum of u G v may err by 2^-24 of the sum of the terms' magnitudes (a little more
for the rounding of the result to float64: 2^-23 is allowed); the partial sums are FP32
additions, T + 1 of them per output, each erring by at most 2^-24 of the running magnitude.
"""

from __future__ import annotations

import pytest
import torch

from flashwatch.chain import LayerChain

F64 = torch.float64


def _devices():
    return [pytest.param("cpu"), pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.fixture
def sums(interpreted_on_cpu):
    """The chain_sums module: interpreted for CPU tensors, compiled on CUDA."""
    from flashwatch.kernels import chain_sums

    return chain_sums


def _push_reference(g: torch.Tensor, u: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum u G v per head, sum |u G v| per head), float64."""
    terms = u.double()[:, :, None] * g.double() * v.double()[:, None, :]
    return terms.sum((1, 2)), terms.abs().sum((1, 2))


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("transposed", [False, True], ids=["C-along-memory", "D-along-memory"])
def test_subtract_push_is_minus_u_g_v(sums, device, dtype, transposed):
    # D and C not multiples of the tiles (16, 128): ragged tiles in both directions, 6 tiles a head
    # over 16 programs (some with none)
    torch.manual_seed(1)
    h, d, c = 3, 20, 300
    if transposed:  # Conv1D's gradient: (C, H*D) stored, read as (H, D, C)
        g = torch.randn(c, 2 * h * d, dtype=dtype, device=device).t()[: h * d].reshape(h, d, c)
        assert g.stride(1) == 1
    else:
        g = torch.randn(h * d, c, dtype=dtype, device=device).view(h, d, c)
    u, v = torch.randn(h, d, device=device), torch.randn(h, c, device=device)
    push = torch.tensor([0.5, -1.0, 2.0], dtype=F64, device=device)
    sums.subtract_push(g, u, v, push, sums.PushScratch())
    want, size = _push_reference(g, u, v)
    want = torch.tensor([0.5, -1.0, 2.0], dtype=F64, device=device) - want
    bound = (1e-13 if dtype == torch.float64 else 2.0**-23) * size + 1e-15
    assert torch.all((push - want).abs() <= bound), (push - want).abs() / size


@pytest.mark.parametrize("device", _devices())
def test_the_chain_reads_the_same_push_through_the_kernel_and_pytorch(sums, device, monkeypatch):
    """LayerChain.add_weight_grad: the kernel where Triton runs, the PyTorch sums elsewhere; one value."""
    torch.manual_seed(2)
    h, d, c = 4, 16, 96
    chains = [LayerChain(h, d, c, device) for _ in range(2)]
    u, v = torch.randn(h, d), torch.randn(h, c)
    for ch in chains:
        ch.set_pair(u, v)
    g = torch.randn(h, d, c, device=device)
    chains[0].add_weight_grad(g)  # the kernel (interpreted on the CPU)
    monkeypatch.setattr("flashwatch.chain.uses_triton", lambda dev: False)
    chains[1].add_weight_grad(g)  # PyTorch
    _, size = _push_reference(g, chains[0].u, chains[0].v)
    assert torch.all((chains[0].push_true - chains[1].push_true).abs() <= 2.0**-22 * size)
    assert chains[0].grad_calls == chains[1].grad_calls == 1


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("B,H,S,D,r", [(2, 3, 5, 4, 16), (3, 2, 16, 8, 16), (1, 1, 40, 2, 32), (16, 2, 17, 3, 16)])
def test_add_partials_sums_over_batch_and_row_blocks(sums, device, B, H, S, D, r):
    # slots B*S of 10, 48, 40 and 272 (tiles of 16, 64, 64 and 256 slots, each slot count ragged, the last
    # over two tiles) by sketch widths D*r of 64, 128, 64 and 48 (tiles of 64, 64, 64 and 16 columns)
    torch.manual_seed(3)
    part_ugv = torch.randn(B, H, S, device=device)
    part_sketch = torch.randn(B, H, S, D, r, device=device)
    ugv0, sketch0 = torch.randn(H, device=device), torch.randn(H, D, r, device=device)
    ugv, sketch = ugv0.clone(), sketch0.clone()
    sums.add_partials(part_ugv, part_sketch, ugv, sketch)
    for got, start, part in ((ugv, ugv0, part_ugv), (sketch, sketch0, part_sketch)):
        want = start.double() + part.double().sum((0, 2))
        size = start.double().abs() + part.double().abs().sum((0, 2))
        assert torch.all((got.double() - want).abs() <= (B * S + 1) * 2.0**-24 * size)


@pytest.mark.parametrize("device", _devices())
def test_add_partials_with_a_sketch_narrower_than_a_block(sums, device):
    """D*r = 48 columns: the masked tail of the only column block leaves nothing else written."""
    torch.manual_seed(4)
    part_ugv, part_sketch = torch.randn(2, 2, 3, device=device), torch.randn(2, 2, 3, 3, 16, device=device)
    backing = torch.zeros(2 * 48 + 7, device=device)  # the sketch, then 7 entries that must stay 0
    ugv, sketch = torch.zeros(2, device=device), backing[: 2 * 48].view(2, 3, 16)
    sums.add_partials(part_ugv, part_sketch, ugv, sketch)
    assert torch.allclose(sketch, part_sketch.sum((0, 2)), rtol=1e-5, atol=1e-5)
    assert torch.allclose(ugv, part_ugv.sum((0, 2)), rtol=1e-5, atol=1e-5)
    assert torch.equal(backing[2 * 48:], torch.zeros(7, device=device))


def test_subtract_push_refuses_a_strided_push(sums=None):
    from flashwatch.kernels import chain_sums

    with pytest.raises(ValueError, match="contiguous"):
        chain_sums.subtract_push(torch.zeros(2, 3, 4), torch.zeros(2, 3), torch.zeros(2, 4),
                                 torch.zeros(4, dtype=F64)[::2], chain_sums.PushScratch())


@pytest.mark.parametrize("device", _devices())
def test_subtract_push_gives_the_same_bits_every_time_and_leaves_its_counts_at_zero(sums, device):
    """Many tiles a head over the programs (D 128, C 1000: 64 tiles over 16 programs): the shares
    are combined in one order whichever program finishes last; the same scratch serves the next
    launch (its arrival counts back at 0), and launches add up."""
    torch.manual_seed(5)
    h, d, c = 4, 128, 1000
    g, u, v = torch.randn(h, d, c, device=device), torch.randn(h, d, device=device), torch.randn(h, c, device=device)
    scratch = sums.PushScratch()
    pushes = []
    for _ in range(3):
        push = torch.zeros(h, dtype=F64, device=device)
        sums.subtract_push(g, u, v, push, scratch)
        pushes.append(push)
        arrived = scratch.buffers(h, torch.device(device))[1]
        assert torch.equal(arrived, torch.zeros(h, dtype=torch.int32, device=device))
    assert torch.equal(pushes[0], pushes[1]) and torch.equal(pushes[0], pushes[2])
    want, size = _push_reference(g, u, v)
    assert torch.all((pushes[0] + want).abs() <= 2.0**-23 * size)
    sums.subtract_push(g, u, v, pushes[0], scratch)  # a second backward adds its push
    assert torch.all((pushes[0] + 2 * want).abs() <= 2.0**-22 * size)
