"""Sharded training on the CPU (gloo, 2 processes; 4 for FSDP2 over tensor parallelism): FSDP2, FSDP1,
tensor parallelism and the two on a 2 x 2 mesh give the per-head values of an unsharded run of
the same model on the same global batch.

Cases (tests/sharded_workers.py): FSDP2 on nanoGPT (fused q/k/v rows: the query rows all on rank
0, rank 1 holds none), FSDP2 on a Llama-style model with 3 heads of 16 (the shard boundary cuts
head 1 in half), FSDP1 ``use_orig_params=True`` with the model as one unit (the boundary falls
mid-row in layer 0's query rows), tensor parallelism (torchtitan's layout: colwise q/k/v,
rowwise output projection; 2 of 4 heads per rank), and where transformers is installed FSDP2 on
Hugging Face GPT-2 (its Conv1D weight is (C, 3C): the shard splits every head's input columns).
Each runs 3 monitored SGD steps.

Tolerances, and why:
- W^Q spectral norms and max logits: relative 1e-5. The sharded power iteration sums partial
  products across ranks and FSDP averages gradients in another order than one process does, so
  the weights and vectors differ in float32 rounding (observed ~1e-7).
- repeated-max counts: exact.
- delta error: only at step 0, where every attention input is bitwise the unsharded run's; from
  step 1 on the weights differ in rounding and a delta error, itself a rounding residue, is a
  different sample. Under data parallelism (FSDP) each rank's backward carries the gradient of
  its local mean loss, twice the unsharded run's per row with 2 ranks, so the summed delta error
  is 2x the unsharded one (exactly: a power-of-two scale).
"""

from __future__ import annotations

import math

import pytest
import torch
from distributed_workers import _free_ports, _run_ranks, assert_same
from sharded_workers import AUTO_FIX, CASES, UNSUPPORTED, close, mesh_worker, per_head, worker

from flashwatch.sharded_power import _matvec, _rmatvec, query_blocks

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.filterwarnings("ignore::FutureWarning")]

STABLE = ("flashwatch_wq_spectral_norm", "flashwatch_max_logit")
COUNTS = ("flashwatch_repeated_max_ratio", "flashwatch_repeated_max_ratio_bf16")
DELTA = ("flashwatch_delta_error", "flashwatch_delta_error_cumulative")
CHAIN = ("flashwatch_wq_error_push", "flashwatch_wq_error_push_share")


def _tensor_parallel_chain_as_unsharded(record: dict, ref: dict, t: int) -> None:
    """The W^Q-gradient error of a step under tensor parallelism (``record``) against the unsharded
    run's (``ref``): the true gradient's push within 1e-4; the readings finite where its are."""
    true, ref_true = record["signals"]["wq_error_push_true"], ref["signals"]["wq_error_push_true"]
    assert true.keys() == ref_true.keys()
    for key, v in ref_true.items():
        assert v != 0 and close(true[key], v, 1e-4), (t, key, true[key], v)
    mine, theirs = per_head(record["snapshot"]), per_head(ref["snapshot"])
    for name in CHAIN + ("flashwatch_wq_error_alignment", "flashwatch_wq_error_coherence"):
        for key, v in theirs[name].items():
            assert math.isfinite(mine[name][key]) == math.isfinite(v), (t, name, key, mine[name][key], v)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("sharded")
    _run_ranks(worker, (_free_ports(), str(out), CASES), timeout=240)
    return tuple(torch.load(out / f"rank{r}.pt", weights_only=False) for r in (0, 1))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", CASES)
def test_sharded_run_equals_unsharded_run(ranks, case):
    r0, r1 = ranks
    a, b, whole = r0[case], r1[case], r0["unsharded"][case]
    expected = {"tp": "tensor_parallel"}.get(case, "fsdp")
    assert a["kinds"] == b["kinds"] == [expected, expected] and whole["kinds"] == ["whole", "whole"]
    assert a["errors"] == b["errors"] == 0
    for t, (x, y, ref) in enumerate(zip(a["records"], b["records"], whole["records"])):
        assert_same(x["snapshot"], y["snapshot"], f"{case} step {t}: the ranks' snapshots")  # one view, bitwise
        mine, theirs = per_head(x["snapshot"]), per_head(ref["snapshot"])
        assert mine.keys() == theirs.keys()
        for name in STABLE + COUNTS:
            assert mine[name].keys() == theirs[name].keys(), (case, name)  # global (layer, head) indices
            for key, v in theirs[name].items():
                assert math.isfinite(v)
                rtol = 0.0 if name in COUNTS else 1e-5
                assert close(mine[name][key], v, rtol), (case, t, name, key, mine[name][key], v)
        if case == "tp":
            # the W^Q-gradient error under tensor parallelism: each rank its own heads' rows, pairs
            # and window state, filed under the global indices. The true gradient's push (from the
            # query's gradient here, W^Q's own there) is no rounding residue: the unsharded run's.
            # The error's readings are functions of the delta error, a float32 rounding residue that
            # the ranks' smaller products round otherwise (as DELTA above): measured, not compared.
            _tensor_parallel_chain_as_unsharded(x, ref, t)
        if t == 0 and case != "tp":
            for name in DELTA:
                # a head's sum of rounding residues can cancel to exactly 0.0 (layer 1 head 2 of fsdp1 on
                # one CPU); the sharded run's must then be 0.0 too. Some heads' must not be 0.
                assert any(v != 0 for v in theirs[name].values()), (case, name, theirs[name])
                for key, v in theirs[name].items():
                    assert close(mine[name][key], 2 * v, 1e-6), (case, name, key, mine[name][key], v)
            # the W^Q-gradient error under FSDP: each rank's rows (twice the unsharded run's per-row
            # gradient), averaged over the ranks, with the pair from the power iteration on the
            # shards, equal the unsharded run's; the true gradient's push comes from the query's
            # gradient here and from W^Q's own there (float32 sums in another order). The
            # Llama-layout model of these cases takes no rotation: measured as it is, unrotated.
            # A head whose push nearly cancels (10^4 below the layer's others) magnifies the pair's
            # float32 rounding in relative terms: the absolute slack is 1e-6 of the step's largest.
            for name in CHAIN:
                scale = max(abs(v) for v in theirs[name].values())
                for key, v in theirs[name].items():
                    assert math.isfinite(v), (case, name, key, v)
                    assert close(mine[name][key], v, 1e-4, 1e-6 * scale), (case, name, key, mine[name][key], v)
    # the power-iteration state: every head's vectors, identical on both ranks (FSDP: replicated;
    # tensor parallelism: gathered), so that a checkpoint written by one rank resumes every rank
    assert_same(a["state"]["layers"], b["state"]["layers"], f"{case} state")
    for mine, ref in zip(a["state"]["layers"], whole["state"]["layers"]):
        assert mine["power"]["v"].shape == ref["power"]["v"].shape
        assert torch.allclose(mine["power"]["sigma"], ref["power"]["sigma"], rtol=1e-5)
        assert torch.allclose(mine["power"]["v"], ref["power"]["v"], atol=1e-4)
    # exact norms on request: FSDP assembles the weights on every rank; tensor parallelism gives
    # each rank its own heads, under their global indices
    exact = {**a["exact"], **b["exact"]}
    assert exact.keys() == whole["exact"].keys()
    for key, v in whole["exact"].items():
        assert close(exact[key], v, 1e-5), (case, key)
    if case == "tp":
        assert sorted(a["exact"]) == [(layer, head) for layer in (0, 1) for head in (0, 1)]
    else:
        assert a["exact"] == b["exact"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", CASES)
def test_sharded_monitor_resumes_exactly(ranks, case):
    """A Monitor replaced after step 0 by one loaded from rank 0's state_dict() (every rank loads
    rank 0's, as from a checkpoint written by rank 0) continues bitwise as the uninterrupted one:
    the power-iteration vectors (FSDP: replicated; tensor parallelism: every rank's heads) resume."""
    for r in ranks:
        whole, resumed = r[case]["records"], r["resumed"][case]["records"]
        assert r["resumed"][case]["errors"] == 0
        for t, (x, y) in enumerate(zip(whole, resumed)):
            assert_same(x["snapshot"], y["snapshot"], f"{case} step {t}")
        assert_same(r[case]["state"], r["resumed"][case]["state"], f"{case} state")


def test_unsupported_layout_reads_nan_and_measures_the_rest(ranks):
    """FSDP1 with use_orig_params=False: W^Q is NaN (no non-finite alert, no error), the attention
    statistics are still combined and equal on both ranks."""
    a, b = (r[UNSUPPORTED] for r in ranks)
    assert a["kinds"] == b["kinds"] == ["unsupported", "unsupported"] and a["errors"] == b["errors"] == 0
    for x, y in zip(a["records"], b["records"]):
        assert_same(x["snapshot"], y["snapshot"], "snapshots")
        assert all(math.isnan(v) for v in x["snapshot"]["flashwatch_wq_spectral_norm"].values())
        assert all(math.isfinite(v) for v in x["snapshot"]["flashwatch_max_logit"].values())
        assert x["snapshot"]["flashwatch_alerts_total"][("non_finite",)] == 0
    assert all(p["power"] is None for p in a["state"]["layers"])


def test_tensor_parallel_ranks_decide_alike_under_global_head_indices(ranks):
    """Tensor parallelism with an alert on every head at step 0 and auto_fix: both ranks raise the
    unsharded run's alerts (heads 2 and 3 measured by rank 1 only) and switch the same layers."""
    r0, r1 = ranks
    a, b, whole = r0[AUTO_FIX], r1[AUTO_FIX], r0["unsharded"][AUTO_FIX]
    assert a["errors"] == b["errors"] == 0
    assert a["decisions"] == b["decisions"] == whole["decisions"]
    assert sorted((layer, head) for _, step, layer, head in a["decisions"]["alerts"] if step == 0) == \
        [(layer, head) for layer in (0, 1) for head in range(4)]
    assert [(step, layer) for step, layer, _ in a["decisions"]["switches"]] == [(0, 0), (0, 1)]
    for x, y in zip(a["records"], b["records"]):
        assert_same(x["snapshot"], y["snapshot"], "tensor-parallel snapshots with auto_fix")


@pytest.fixture(scope="module")
def mesh_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("mesh")
    _run_ranks(mesh_worker, (_free_ports(), str(out)), nprocs=4, timeout=240)
    return tuple(torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(4))


@pytest.mark.timeout(300)
def test_fsdp_over_tensor_parallel_equals_unsharded_run(mesh_ranks):
    """FSDP2 over tensor parallelism (2 x 2 mesh): every head measured under its global index, the
    four ranks' snapshots bitwise one view, equal to the unsharded run's within the tolerances of
    FSDP and tensor parallelism alone (module docstring); the W^Q norms from the power iteration
    on each tensor-parallel shard's FSDP pieces."""
    records = [r["mesh"] for r in mesh_ranks]
    whole = mesh_ranks[0]["unsharded"]
    for r in records:
        assert r["kinds"] == ["fsdp", "fsdp"] and r["errors"] == 0
    for t, ref in enumerate(whole["records"]):
        for other in records[1:]:
            assert_same(records[0]["records"][t]["snapshot"], other["records"][t]["snapshot"], f"step {t}: snapshots")
        mine, theirs = per_head(records[0]["records"][t]["snapshot"]), per_head(ref["snapshot"])
        for name in STABLE + COUNTS:
            assert mine[name].keys() == theirs[name].keys() and len(theirs[name]) == 8, name
            for key, v in theirs[name].items():
                assert math.isfinite(v)
                assert close(mine[name][key], v, 0.0 if name in COUNTS else 1e-5), (t, name, key, mine[name][key], v)
        _tensor_parallel_chain_as_unsharded(records[0]["records"][t], ref, t)
    for r in records[1:]:  # every head's vectors on every rank: one rank's checkpoint resumes all
        assert_same(records[0]["state"]["layers"], r["state"]["layers"], "state")
    for mine, ref in zip(records[0]["state"]["layers"], whole["state"]["layers"]):
        assert mine["power"]["v"].shape == ref["power"]["v"].shape
        assert torch.allclose(mine["power"]["sigma"], ref["power"]["sigma"], rtol=1e-5)
    exact = {k: v for r in records for k, v in r["exact"].items()}  # each rank its own heads
    assert exact.keys() == whole["exact"].keys()
    for key, v in whole["exact"].items():
        assert close(exact[key], v, 1e-5), key


@pytest.mark.timeout(300)
def test_fsdp_over_tensor_parallel_resumes_exactly(mesh_ranks):
    for r in mesh_ranks:
        assert r["resumed"]["errors"] == 0
        for t, (x, y) in enumerate(zip(r["mesh"]["records"], r["resumed"]["records"])):
            assert_same(x["snapshot"], y["snapshot"], f"step {t}")
        assert_same(r["mesh"]["state"], r["resumed"]["state"], "state")


def _dense(blocks, shape):
    h, d, c = shape
    w = torch.zeros(h, d, c)
    for h0, h1, c0, c1, blk in blocks:
        w[h0:h1, :, c0:c1] += blk
    return w


@pytest.mark.parametrize("transposed", [False, True], ids=["rows", "columns"])
def test_query_blocks_cover_every_element_once(transposed):
    """Any split of the parameter's elements into contiguous ranges: the blocks add up to W^Q, and
    the partial products to W v and W^T y (float64 reference)."""
    h, d, c = 3, 5, 7
    g = torch.Generator().manual_seed(0)
    rows, cols = (c, 3 * h * d) if transposed else (3 * h * d, c)  # a fused q/k/v projection
    param = torch.randn(rows, cols, generator=g)
    wq = (param[:, : h * d].t() if transposed else param[: h * d]).reshape(h, d, c)
    flat = param.reshape(-1)
    for cuts in ([0, flat.numel()], [0, 1, 40, 41, 60, flat.numel()], [0, 17, 18, 150, flat.numel()],
                 [0, 0, 100, 100, flat.numel()]):
        pieces = [query_blocks(flat[s:e], s, (rows, cols), transposed, (h, d, c)) for s, e in zip(cuts, cuts[1:])]
        assert all(len(p) <= 3 for p in pieces)
        assert torch.equal(sum(_dense(p, (h, d, c)) for p in pieces), wq)
        v = torch.randn(h, c, 2, generator=g)
        y = sum(_matvec(p, v, d) for p in pieces)
        assert torch.allclose(y.double(), wq.double() @ v.double(), atol=1e-5)
        z = sum(_rmatvec(p, y, c) for p in pieces)
        assert torch.allclose(z.double(), wq.double().transpose(1, 2) @ y.double(), atol=1e-5)


def test_sharding_declared_over_whole_weights_measures_them():
    """An adapter may declare sharding (Lightning's FSDPStrategy) while a rank holds a layer's W^Q
    whole: that layer is measured from its weight, never from the structural placeholder (zeros)."""
    from flashwatch import Monitor, MonitorConfig
    from flashwatch.signals import spectral_norm_exact
    from sharded_workers import batches, nanogpt

    model = nanogpt()
    monitor = Monitor(MonitorConfig(interval=1), process_group=None)
    monitor.set_sharding("declared by the adapter")
    monitor.attach(model)
    assert [layer.placement_kind for layer in monitor.layers] == ["whole", "whole"]
    x, y = batches(0)[0]
    model(x, y)[1].backward()
    monitor.step()
    sigma = monitor.snapshot()["flashwatch_wq_spectral_norm"]
    for i, block in enumerate(model.transformer.h):
        true = spectral_norm_exact(block.attn.c_attn.weight[:64].view(4, 16, 64))
        assert all(close(sigma[(i, h)], float(true[h]), 1e-5) for h in range(4)), (i, sigma)
    monitor.detach()


def test_a_layout_that_cannot_be_read_is_unsupported_not_an_attach_failure(monkeypatch):
    import flashwatch.sharded as sharded
    from sharded_workers import nanogpt

    from flashwatch import Monitor, MonitorConfig

    def broken(*args):
        raise AttributeError("an FSDP internal moved")

    monkeypatch.setattr(sharded, "_placement", broken)
    model = nanogpt()
    monitor = Monitor(MonitorConfig(interval=1), process_group=None)
    monitor.set_sharding("declared")
    monitor.attach(model)
    assert [layer.placement_kind for layer in monitor.layers] == ["unsupported", "unsupported"]
    assert "an FSDP internal moved" in monitor.layers[0].placement.reason
    monitor.step()
    assert all(math.isnan(v) for v in monitor.snapshot()["flashwatch_wq_spectral_norm"].values())
    assert monitor.errors == 0 and monitor.alert_counts["non_finite"] == 0
    monitor.detach()
