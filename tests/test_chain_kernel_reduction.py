"""The Triton kernels reduce the W^Q-gradient error rows in their epilogue (``RowReduction``).

Both kernels (the statistics pass of observe mode, the dQ kernel of own-kernel mode), causal or
not, ragged N, grouped-query heads: the per-head sums u^T dG v and dG Omega against float64
from the same inputs, and nothing else the call computes changes. Interpreted on the CPU;
the same checks compiled on a GPU (marker ``gpu``).
"""

from __future__ import annotations

import pytest
import torch
from chain_reduction_cases import ReducingHook, assert_same_statistics, check_reduction, check_reduction_repeats
from kernel_cases import random_qkv
from switch_cases import read_at_import

@pytest.fixture(autouse=True)
def kernel_reduction_on(monkeypatch):
    """These tests are about the reducing kernels: on, whatever FLASHWATCH_KERNEL_REDUCTION says."""
    from flashwatch.kernels import rows

    monkeypatch.setattr(rows, "KERNEL_REDUCTION", True)


@pytest.mark.parametrize("value, expected", [(None, "True"), ("1", "True"), ("0", "False"),
                                             ("yes", "FLASHWATCH_KERNEL_REDUCTION='yes': accepted are")])
def test_the_kernel_reduction_is_on_unless_switched_off(value, expected):
    ok, said = read_at_import("FLASHWATCH_KERNEL_REDUCTION", value, "rows", "KERNEL_REDUCTION")
    assert ok == (value != "yes") and expected in said, said


SHAPES = [  # (B, H, Hkv, N, D)
    (1, 2, 2, 1, 16),
    (2, 2, 1, 37, 16),
    (1, 4, 2, 33, 32),
    (1, 2, 2, 97, 64),
]


@pytest.mark.usefixtures("interpret_dispatch")
@pytest.mark.parametrize("mode", ["observe", "own_kernel"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda c: "B{}H{}Hkv{}N{}D{}".format(*c))
def test_reduction_matches_float64_interpreted(shape, causal, mode):
    B, H, Hkv, N, D = shape
    if N == 1 and causal:
        pytest.skip("one row: causal and not are the same call")
    check_reduction(*random_qkv(B, H, N, D, Hkv=Hkv, seed=N + D), causal=causal, mode=mode, r=16, seed=N)


@pytest.mark.usefixtures("interpret_dispatch")
@pytest.mark.parametrize("variant", ["fixed", "fp32_delta"])
def test_reduction_in_the_variants_interpreted(variant):
    check_reduction(*random_qkv(1, 2, 37, 32, Hkv=1, seed=5), mode="own_kernel", variant=variant, r=16, seed=5)


@pytest.mark.usefixtures("interpret_dispatch")
@pytest.mark.parametrize("mode", ["observe", "own_kernel"])
def test_reduction_at_the_chain_sketch_width_and_fp32_interpreted(mode):
    from flashwatch.chain import SKETCH_DIM

    check_reduction(*random_qkv(1, 2, 20, 16, dtype=torch.float32, seed=3), mode=mode, r=SKETCH_DIM, seed=3)


@pytest.mark.usefixtures("interpret_dispatch")
@pytest.mark.parametrize("mode", ["observe", "own_kernel"])
@pytest.mark.parametrize("shape", [(2, 2, 1, 37, 16), (1, 2, 2, 1, 16)], ids=["B2H2N37", "B1H2N1"])
def test_reduction_reads_the_chains_product_in_place_interpreted(shape, mode):
    """x . v (two terms) and x Omega as views of the transposed product, as the chain offers them."""
    B, H, Hkv, N, D = shape
    check_reduction(*random_qkv(B, H, N, D, Hkv=Hkv, seed=8), causal=N > 1, mode=mode, r=16, seed=8,
                    in_place="columns")


@pytest.mark.usefixtures("interpret_dispatch")
def test_views_of_the_product_read_along_its_rows_are_refused():
    """Only contiguous factors or rows of the transposed product are read in place; views of the
    product read along its rows get a ValueError that says what is accepted."""
    from flashwatch.kernels import AttentionStats, attention_statistics

    q, k, v = (t.detach() for t in random_qkv(2, 2, 37, 16, seed=8))
    stats = AttentionStats(2)
    stats.rows_hook = ReducingHook(q, 16, 8, in_place="rows")
    with pytest.raises(ValueError, match=r"neither contiguous nor rows of one \(width, B \* N\) product"):
        attention_statistics(q, k, v, q, q, stats)


@pytest.fixture
def folds(monkeypatch):
    """Set the statistics kernel's FOLD (row blocks per program in reduce mode) and record each
    launch's FOLD and grid."""
    from flashwatch.kernels import triton_attn

    seen = []
    launch = triton_attn.launch

    def recording(kernel, grid, args, kwargs):
        if kernel is triton_attn._attn_stats_kernel:
            seen.append((kwargs["FOLD"], grid))
        return launch(kernel, grid, args, kwargs)

    monkeypatch.setattr(triton_attn, "launch", recording)

    def use(fold):
        monkeypatch.setattr(triton_attn, "statistics_fold", lambda blocks, pairs, device: fold)
        return seen

    return use


@pytest.mark.usefixtures("interpret_dispatch")
@pytest.mark.parametrize("fold", [2, 3, 4])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("shape", [(2, 2, 1, 97, 16), (1, 2, 2, 70, 32)], ids=["B2H2Hkv1N97", "B1H2N70"])
def test_folded_statistics_reduction_matches_float64_interpreted(shape, causal, fold, folds):
    """The statistics kernel's programs each taking ``fold`` row blocks (the last program fewer where the
    blocks do not divide) and summing their shares in one slot: the same sums as float64."""
    B, H, Hkv, N, D = shape
    seen = folds(fold)
    check_reduction(*random_qkv(B, H, N, D, Hkv=Hkv, seed=N + fold), causal=causal, mode="observe", r=16,
                    seed=fold)
    # the reducing call ran folded (the plain hook's call stores rows: FOLD 1), over fewer programs
    (got_fold, grid), (plain_fold, plain_grid) = seen
    assert (got_fold, plain_fold) == (fold, 1)
    assert grid[0] == -(-plain_grid[0] // fold) and plain_grid[0] > fold and plain_grid[0] % fold
    assert grid[1] == plain_grid[1] == B * H


@pytest.mark.usefixtures("interpret_dispatch")
def test_folded_statistics_reduction_repeats_bit_for_bit_interpreted(folds):
    folds(4)
    check_reduction_repeats(*random_qkv(2, 2, 70, 16, Hkv=1, seed=6), mode="observe", r=16, seed=6)


def test_the_statistics_kernel_folds_only_where_the_launch_keeps_the_gpu_full(monkeypatch):
    """4 row blocks a program, else 2, where 4 programs per SM remain; else none (and none off CUDA)."""
    from flashwatch.kernels import triton_attn

    monkeypatch.setattr(triton_attn, "_sm_count", lambda index: 132)
    cuda = torch.device("cuda", 0)
    assert triton_attn.statistics_fold(16, 192, cuda) == 4  # GPT-2 small, batch 16: 768 programs
    assert triton_attn.statistics_fold(16, 96, cuda) == 2  # batch 8: 384 programs at 4, 768 at 2
    assert triton_attn.statistics_fold(16, 12, cuda) == 1  # batch 1
    assert triton_attn.statistics_fold(16, 192, torch.device("cpu")) == 1


@pytest.mark.usefixtures("interpret_dispatch")
@pytest.mark.parametrize("mode", ["observe", "own_kernel"])
def test_reduction_repeats_bit_for_bit_interpreted(mode):
    check_reduction_repeats(*random_qkv(2, 2, 70, 16, Hkv=1, seed=6), mode=mode, r=16, seed=6)


@pytest.mark.usefixtures("interpret_dispatch")
def test_reduction_none_falls_back_to_the_rows():
    """A hook whose ``reduction`` returns None is called with the rows, as a plain hook."""
    from kernel_cases import RowsRecorder

    from flashwatch.kernels import AttentionStats, attention_statistics

    class Declines(RowsRecorder):
        def reduction(self, q):
            return None

    q, k, v = (t.detach() for t in random_qkv(1, 2, 20, 16, seed=4))
    stats = AttentionStats(2)
    stats.rows_hook = hook = Declines()
    attention_statistics(q, k, v, q, q, stats)
    assert len(hook.calls) == 1 and hook.calls[0][1].shape == (1, 2, 20, 16)


@pytest.mark.usefixtures("interpret_dispatch")
def test_reduction_of_the_wrong_shape_is_refused():
    from flashwatch.kernels import AttentionStats, attention_statistics
    from flashwatch.kernels.stats import RowReduction

    q, k, v = (t.detach() for t in random_qkv(1, 2, 20, 16, seed=4))

    class Bad:
        def reduction(self, q):
            return RowReduction(torch.zeros(2, 16), torch.zeros(1, 2, 20), torch.zeros(1, 20, 12), torch.zeros(2),
                                torch.zeros(2, 16, 12), lambda: None)

        def __call__(self, e, pk):
            pass

    stats = AttentionStats(2)
    stats.rows_hook = Bad()
    with pytest.raises(ValueError, match="RowReduction.xo: sketch width must be a power of two >= 16, got 12"):
        attention_statistics(q, k, v, q, q, stats)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["observe", "own_kernel"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("N, D, Hkv", [(1025, 64, 2), (300, 128, 4), (1, 64, 4)])
def test_reduction_matches_float64_on_the_gpu(N, D, Hkv, causal, mode):
    from flashwatch.chain import SKETCH_DIM

    check_reduction(*random_qkv(2, 4, N, D, Hkv=Hkv, device="cuda", seed=N + D), causal=causal, mode=mode,
                    r=SKETCH_DIM, seed=N)


@pytest.mark.gpu
@pytest.mark.parametrize("fold", [2, 3, 4])
@pytest.mark.parametrize("causal", [True, False])
def test_folded_statistics_reduction_matches_float64_on_the_gpu(causal, fold, folds):
    from flashwatch.chain import SKETCH_DIM

    seen = folds(fold)
    check_reduction(*random_qkv(2, 4, 1025, 64, Hkv=2, device="cuda", seed=fold), causal=causal, mode="observe",
                    r=SKETCH_DIM, seed=fold)
    assert [f for f, _ in seen] == [fold, 1]


@pytest.mark.gpu
def test_the_statistics_reduction_at_gpt2_small_folds_and_matches_float64_on_the_gpu(monkeypatch):
    """GPT-2 small's call at batch 16 (12 heads, 1024, 64): the fold the launcher picks there (4 on an
    H100 or H200), checked with the factors read in place as the chain offers them."""
    from flashwatch.chain import SKETCH_DIM
    from flashwatch.kernels import triton_attn

    seen = []
    launch = triton_attn.launch

    def recording(kernel, grid, args, kwargs):
        if kernel is triton_attn._attn_stats_kernel:
            seen.append(kwargs["FOLD"])
        return launch(kernel, grid, args, kwargs)

    monkeypatch.setattr(triton_attn, "launch", recording)
    check_reduction(*random_qkv(16, 12, 1024, 64, device="cuda", seed=16), mode="observe", r=SKETCH_DIM, seed=16,
                    in_place="columns")
    assert seen[0] > 1 and seen[1] == 1, seen


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["observe", "own_kernel"])
def test_reduction_reads_the_chains_product_in_place_on_the_gpu(mode):
    from flashwatch.chain import SKETCH_DIM

    check_reduction(*random_qkv(2, 12, 1025, 64, device="cuda", seed=12), mode=mode, r=SKETCH_DIM, seed=12,
                    in_place="columns")


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["observe", "own_kernel"])
def test_reduction_repeats_bit_for_bit_on_the_gpu(mode):
    """Many programs per head (B 8, N 2048): with float atomics the sums' order would vary."""
    from flashwatch.chain import SKETCH_DIM

    check_reduction_repeats(*random_qkv(8, 4, 2048, 64, Hkv=4, device="cuda", seed=7), mode=mode, r=SKETCH_DIM,
                            seed=7)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_reduction_other_dtypes_on_the_gpu(dtype):
    for mode in ("observe", "own_kernel"):
        check_reduction(*random_qkv(1, 4, 300, 64, Hkv=1, dtype=dtype, device="cuda", seed=9), mode=mode, r=64)


@pytest.mark.usefixtures("interpret_dispatch")
@pytest.mark.parametrize("mode", ["observe", "own_kernel"])
def test_monitor_chain_readings_through_the_kernel_reduction(mode, monkeypatch):
    """The Monitor's chain readings against float64 (tests/test_chain.py's checks) with the kernels
    interpreted: every call's rows reduced in the kernel, none handed over as tensors."""
    import test_chain

    from flashwatch.chain import LayerChain

    counts = {"reduction": 0, "add_rows": 0}
    real_reduction, real_add = LayerChain.reduction, LayerChain.add_rows

    def reduction(self, x, q):
        counts["reduction"] += 1
        return real_reduction(self, x, q)

    def add_rows(self, *args):
        counts["add_rows"] += 1
        return real_add(self, *args)

    monkeypatch.setattr(LayerChain, "reduction", reduction)
    monkeypatch.setattr(LayerChain, "add_rows", add_rows)
    if mode == "observe":
        test_chain.test_chain_readings_match_float64_in_observe_mode(torch.bfloat16, monkeypatch)
    else:
        test_chain.test_chain_readings_match_float64_in_own_kernel_mode(monkeypatch)
    assert counts == {"reduction": 2, "add_rows": 0}


@pytest.mark.usefixtures("interpret_dispatch")
@pytest.mark.parametrize("mode", ["observe", "own_kernel"])
def test_a_reduction_that_does_not_fit_is_reported_and_never_breaks_the_backward(mode):
    from flashwatch import Monitor, MonitorConfig
    from flashwatch.tinygpt import GPT, GPTConfig, sample_batch, stdlib_corpus

    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=16))
    monitor = Monitor(MonitorConfig(interval=1, mode=mode))
    monitor.attach(model)
    chain = monitor.layers[0].chain
    chain.u = chain.u.double()  # not the FP32 the kernel takes
    x, y = sample_batch(stdlib_corpus(20_000), 2, 16, generator=torch.Generator().manual_seed(0))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(x, y)[1]
    loss.backward()  # no exception
    assert model.transformer.h[0].attn.c_attn.weight.grad is not None
    monitor.step()
    assert monitor.errors > 0
    push = monitor.snapshot()["flashwatch_wq_error_push"]
    assert all(v != v for v in push.values())  # NaN: not measured, never 0
    monitor.detach()


def test_statistics_compare_counts_bitwise_and_sums_up_to_their_summation_order():
    """The comparison the GPU cases use: a sum moved within the reordering bound passes; a sum
    moved beyond it, or a count or max logit moved at all, fails."""
    from flashwatch.kernels.stats import FIELDS
    row = {name: i for i, name in enumerate(FIELDS)}
    want = torch.zeros(len(FIELDS), 2, dtype=torch.float64)
    want[row["rows"]] = 100.0
    want[row["max_logit"]] = 7.5
    want[row["delta_error"]], want[row["delta_error_abs"]] = 0.25, 4.0
    want[row["delta_error_sq"]] = 0.5
    bound = 2 * 99 * 2.0 ** -24 * 4.0  # 100 terms, sum of |e| = 4
    near = want.clone()
    near[row["delta_error"]] += 0.9 * bound
    assert_same_statistics(near, want, terms=100)
    for name, delta in (("delta_error", 1.1 * bound), ("rows", 1.0), ("max_logit", 2.0 ** -20)):
        far = want.clone()
        far[row[name]] += delta
        with pytest.raises(AssertionError, match=f"changed {name}"):
            assert_same_statistics(far, want, terms=100)


@pytest.mark.usefixtures("interpret_dispatch")
def test_the_statistics_kernel_with_rows_takes_its_own_tiles(monkeypatch):
    """With a rows hook the observe-mode kernel runs at ``tuning.TABLE["stats_rows"]`` (without,
    at ``stats``), and the reduction is right at other tiles than the interpreter's default."""
    from flashwatch.kernels import tuning

    kinds = []
    real = tuning.choose
    monkeypatch.setattr(tuning, "choose", lambda kind, *a: kinds.append(kind) or real(kind, *a))
    qkv = random_qkv(1, 2, 70, 16, Hkv=1, seed=8)
    check_reduction(*qkv, mode="observe", r=16, seed=8)
    assert "stats_rows" in kinds
    tuning.set_override("stats_rows", tuning._cfg(32, 16, 4, 1))  # BLOCK_M 32: twice the default here
    try:
        check_reduction(*qkv, mode="observe", r=16, seed=8)
    finally:
        tuning.set_override("stats_rows", None)
