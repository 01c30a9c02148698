"""Distributed data parallel on the CPU (gloo, 2 processes): one consistent view of every rank.

- Plain PyTorch (no Lightning): the Monitor's packed all-reduce on hand-made statistics (both
  schemes: one SUM all-reduce with per-rank MAX slots, and SUM then MAX), a real DDP run, the
  repair of variants that differ between ranks, a rank whose measurement fails, FSDP2.
- Lightning's DDP strategy (``ddp_spawn``) with FlashWatchCallback: aggregated statistics are
  the sum (max) of what each rank saw, identical snapshots, alerts and auto-fix switches on
  both ranks, one Prometheus endpoint (or one per rank with a ``rank`` label).

Every rank writes what it saw to a file; the test process compares the ranks. Processes are
spawned (not forked: a fork after the parent used OpenMP threads can hang), each run is
bounded by a timeout, and the process group's own timeout turns a mismatch into an error.
"""

from __future__ import annotations

import datetime
import logging
import math
import os
import pickle
import urllib.request
from pathlib import Path

import pytest
import torch
from distributed_workers import (HEADS, LAYERS, MAX_ROWS, SUM_ROWS, _assert_combined, _free_ports, _Messages,
                                 _plain_worker, _reduced, _run_ranks, assert_same, _tiny_gpt)

from flashwatch import Monitor
from flashwatch.distributed import Reducer
from flashwatch.kernels import STAT_FIELDS
from flashwatch.tinygpt import sample_batch, stdlib_corpus

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"),  # Lightning's few-workers hints
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]


@pytest.mark.timeout(120)
def test_monitor_reduces_across_two_gloo_processes(tmp_path):
    _run_ranks(_plain_worker, (_free_ports(), str(tmp_path)))
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1))
    # exporters given on every rank: rank 1 says it writes the records rank 0 writes; rank 0 says nothing
    assert sum("this rank has exporters that write files" in m for m in r1["messages"]) == 1
    assert not any("this rank has exporters that write files" in m for m in r0["messages"])

    for scheme, collectives in (("slots", 1), ("two", 2)):
        a, b = r0[scheme], r1[scheme]
        assert a["collectives"] == b["collectives"] == collectives
        _assert_combined(a, b, scheme)
        assert a["grad_norm"] == b["grad_norm"] == 0.5 and a["loss"] == 2.0
        # rank 0 alone saw no logit above 100; after the reduce both ranks alert, and switch, at step 0
        assert float(a["local"]["stats"][MAX_ROWS].max()) < 100
        expected = [("max_logit", 0, 1, 2, 150.0)]
        for r in (a, b):
            assert [(x["rule"], x["step"], x["layer"], x["head"], x["value"]) for x in r["alerts"]] == expected, scheme
            assert [(s["step"], s["layer"], s["to"]) for s in r["switches"]] == [(0, 1, "fp32_delta")], scheme
            assert r["variants"] == {0: "sdpa", 1: "fp32_delta"} and r["errors"] == 0
        assert_same(a["snapshot"], b["snapshot"], f"{scheme} snapshot")

    a, b = r0["ddp_scaled"], r1["ddp_scaled"]
    assert_same(a, b, "ddp_scaled")
    assert a["non_finite"] == 0 and a["errors"] == 0
    unmeasured = [all(math.isnan(v) for v in d.values()) for d in a["delta"]]
    assert all(u or all(math.isfinite(v) for v in d.values()) for u, d in zip(unmeasured, a["delta"]))
    # one halving of the scale per skipped step: exactly the steps read as not measured
    assert 1 <= sum(unmeasured) == round(math.log2(2.0 ** 126 / a["scale"])) < 5

    a, b = r0["ddp"], r1["ddp"]
    assert (a["rank"], b["rank"], a["world_size"]) == (0, 1, 2) and a["errors"] == b["errors"] == 0
    assert a["describe"].startswith("1 all-reduce (SUM) of ")
    assert [x["step"] for x in a["records"]] == [0, 2, 4]
    for x, y in zip(a["records"], b["records"]):
        _assert_combined(x, y, f"ddp step {x['step']}")
        assert not torch.equal(x["local"]["stats"], y["local"]["stats"])  # the ranks saw different data
        assert x["local"]["grad_norm"] == y["local"]["grad_norm"] == x["grad_norm"]  # DDP: one global norm
        assert torch.equal(x["local"]["sigma"], y["local"]["sigma"])  # replicated W^Q, identical norms
        assert_same(x["snapshot"], y["snapshot"], f"ddp snapshot at step {x['step']}")
    assert a["alerts"] and a["alerts"] == b["alerts"]
    assert_same(a["state"], b["state"], "ddp state_dict")  # cumulative sums, detectors' state, variants

    assert r0["repair"] == r1["repair"] == {"variants": {0: "fixed", 1: "sdpa"}, "modes": ["own_kernel", "observe"]}
    assert any("ran different variants on different ranks" in m for m in r0["messages"])
    for r in (r0, r1):
        assert "the ranks attached different attention layouts" in r["layout"]

    # every rank refuses alike: other layers (same head counts), another interval, an exporter that
    # could not open on rank 1 alone (rank 0 is told; before, it attached and would wait for rank 1)
    a, b = r0["refusals"], r1["refusals"]
    for r in (a, b):
        assert r["layers"][0] == "ValueError" and "different attention layouts" in r["layers"][1]
        assert r["interval"][0] == "ValueError" and "different MonitorConfig settings (interval" in r["interval"][1]
    assert a["exporter"][0] == "RuntimeError" and "another rank of the group" in a["exporter"][1]
    assert b["exporter"] == ("OSError", "injected: cannot open on rank 1")
    # before: attached, then the ranks monitored different steps (collectives mismatched, or combined
    # statistics of different steps and decisions that differed)
    for r in (a, b):
        assert r["resumed on rank 0 alone"][0] == "ValueError"
        assert "the ranks attached at different optimizer steps (0 to 7" in r["resumed on rank 0 alone"][1]
    f0, f1 = r0["fsdp2_failure"], r1["fsdp2_failure"]
    assert (f0["errors"], f1["errors"]) == (0, 1) and f0["step"] == f1["step"] == 1.0
    assert f0["sigma"] == f1["sigma"] and all(math.isfinite(v) and v > 0 for v in f0["sigma"].values())

    assert r0["failure"]["new_alerts"] == r1["failure"]["new_alerts"] == [0, LAYERS * HEADS]
    assert (r0["failure"]["errors"], r1["failure"]["errors"]) == (0, 1)
    assert r0["failure"]["step"] == r1["failure"]["step"] == 1.0
    assert any("1 of 2 ranks could not measure monitored step 0" in m for m in r0["messages"])

    a, b = r0["fsdp2"], r1["fsdp2"]
    assert "FSDP2" in a["sharding"] or "DTensor" in a["sharding"]
    assert a["errors"] == b["errors"] == 0 and a["alerts"] == b["alerts"] == []
    assert a["skip_warnings"] == b["skip_warnings"] == []  # W^Q measured on the shards: nothing skipped
    for x, y in zip(a["records"], b["records"]):
        _assert_combined(x, y, "fsdp2")
        # clip_grad_norm_ on DTensor gradients returns the global norm: taken as it is, not summed in squares
        assert x["grad_norm"] == y["grad_norm"] == x["local"]["grad_norm"] and math.isfinite(x["grad_norm"])
    assert all(math.isfinite(v) and v > 0 for v in a["snapshot"]["flashwatch_wq_spectral_norm"].values())
    assert all(math.isfinite(v) for v in a["snapshot"]["flashwatch_delta_error_cumulative"].values())
    assert_same(a["snapshot"], b["snapshot"], "fsdp2 snapshot")


# --- Lightning's DDP strategy ---------------------------------------------------------------------------

from pytorch_lightning import Callback, LightningModule, Trainer  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from flashwatch.exporters.jsonl import read_jsonl  # noqa: E402
from flashwatch.lightning import FlashWatchCallback  # noqa: E402


class LitGPT(LightningModule):
    def __init__(self):
        super().__init__()
        self.model = _tiny_gpt()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return self.model(x, y)[1]

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


class RankRecorder(Callback):
    """Runs after FlashWatchCallback on every rank: what this rank saw before and after the reduce."""

    def __init__(self, watch: FlashWatchCallback, out: str):
        self.watch, self.out = watch, out
        self.records: list[dict] = []
        self._seen = 0
        self.messages = None

    def setup(self, trainer, pl_module, stage):
        self.messages = _Messages()  # this rank's "flashwatch" log
        logging.getLogger("flashwatch").addHandler(self.messages)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        monitor = self.watch.monitor
        if monitor.monitored_steps != self._seen:
            self._seen = monitor.monitored_steps
            self.records.append({"step": monitor.global_step - 1, "snapshot": monitor.snapshot(),
                                 "variants": monitor.variants, **_reduced(monitor)})

    def on_train_end(self, trainer, pl_module):
        monitor, text = self.watch.monitor, None
        if self.watch.url is not None:
            with urllib.request.urlopen(self.watch.url, timeout=10) as r:
                text = r.read().decode()
        torch.save({"records": self.records, "alerts": [a.to_dict() for a in monitor.alerts],
                    "switches": monitor.switches, "variants": monitor.variants, "errors": monitor.errors,
                    "state": monitor.state_dict(), "url": self.watch.url, "port": self.watch.port, "text": text,
                    "rank": monitor.rank, "world_size": monitor.world_size, "global_step": monitor.global_step,
                    "messages": self.messages.messages},
                   os.path.join(self.out, f"rank{trainer.global_rank}.pt"))


def _loader() -> DataLoader:
    data = stdlib_corpus(100_000)
    g = torch.Generator().manual_seed(0)
    xs, ys = zip(*(sample_batch(data, 4, 32, generator=g) for _ in range(8)))
    return DataLoader(TensorDataset(torch.cat(xs), torch.cat(ys)), batch_size=4)  # 8 batches; 4 per rank


def _fit_ddp(tmp_path: Path, *, per_rank: bool, base_port: int, max_steps: int) -> tuple[dict, dict]:
    from pytorch_lightning.strategies import DDPStrategy

    torch.set_num_threads(1)
    watch = FlashWatchCallback(interval=2, port=base_port, run_dir=tmp_path / "run", console=None,
                               per_rank_endpoints=per_rank, max_logit_bound=-1e3,
                               auto_fix="fp32_delta", auto_fix_on={"max_logit"})
    pickle.dumps(watch)  # ddp_spawn sends the callback to its processes
    strategy = DDPStrategy(start_method="spawn", timeout=datetime.timedelta(seconds=60))
    trainer = Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=max_steps, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      callbacks=[watch, RankRecorder(watch, str(tmp_path))])
    trainer.fit(LitGPT(), _loader())
    return tuple(torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1))


def _samples(text: str) -> list:
    from prometheus_client.parser import text_string_to_metric_families

    return [s for f in text_string_to_metric_families(text) for s in f.samples]


@pytest.mark.timeout(150)
@pytest.mark.parametrize("per_rank", [False, True], ids=["one_endpoint", "per_rank_endpoints"])
def test_lightning_ddp_two_ranks_one_view(per_rank, tmp_path):
    base = _free_ports(2)
    steps = 24 if not per_rank else 8
    r0, r1 = _fit_ddp(tmp_path, per_rank=per_rank, base_port=base, max_steps=steps)

    assert (r0["rank"], r1["rank"], r0["world_size"], r1["world_size"]) == (0, 1, 2, 2)
    assert r0["global_step"] == r1["global_step"] == steps and r0["errors"] == r1["errors"] == 0
    monitored = list(range(0, steps, 2))
    assert [x["step"] for x in r0["records"]] == [x["step"] for x in r1["records"]] == monitored
    for x, y in zip(r0["records"], r1["records"]):
        _assert_combined(x, y, f"step {x['step']}")  # aggregated = sum (max) of what each rank saw
        assert not torch.equal(x["local"]["stats"], y["local"]["stats"])  # the ranks saw different batches
        assert x["local"]["grad_norm"] == pytest.approx(y["local"]["grad_norm"], rel=1e-6)
        assert x["grad_norm"] == y["grad_norm"]
        assert_same(x["snapshot"], y["snapshot"], f"snapshot at step {x['step']}")  # cumulative values, alerts, variants
    assert_same(r0["state"], r1["state"], "state_dict")

    # forced alert at step 0 on every head, decided and acted on identically by both ranks
    assert r0["alerts"] == r1["alerts"] and len(r0["alerts"]) == LAYERS * HEADS
    assert {(a["rule"], a["step"]) for a in r0["alerts"]} == {("max_logit", 0)}
    assert r0["switches"] == r1["switches"] and [(s["step"], s["layer"]) for s in r0["switches"]] == [(0, 0), (0, 1)]
    assert r0["variants"] == r1["variants"] == {0: "fp32_delta", 1: "fp32_delta"}
    assert [x["variants"] for x in r0["records"]] == [x["variants"] for x in r1["records"]]

    # logs from rank 0 only: each alert and each switch once
    logged = lambda r, what: [m for m in r["messages"] if m.startswith(what)]
    assert len(logged(r0, "flashwatch alert [max_logit]")) == LAYERS * HEADS and logged(r1, "flashwatch alert") == []
    assert len(logged(r0, "flashwatch auto_fix")) == LAYERS and logged(r1, "flashwatch auto_fix") == []

    # JSONL from rank 0 only: one record per monitored step
    assert [rec["step"] for rec in read_jsonl(tmp_path / "run")] == monitored

    if not per_rank:  # one endpoint, on rank 0, no rank label
        assert r0["port"] == base and r1["url"] is None and r1["port"] is None
        samples = _samples(r0["text"])
        assert samples and all("rank" not in s.labels for s in samples)
        assert next(s.value for s in samples if s.name == "flashwatch_step") == monitored[-1]
    else:  # one endpoint per rank on base + local rank, each series labelled with the rank
        for rank, r in ((0, r0), (1, r1)):
            assert r["port"] == base + rank and r["text"]
            samples = _samples(r["text"])
            assert samples and all(s.labels.get("rank") == str(rank) for s in samples)
            assert next(s.value for s in samples if s.name == "flashwatch_step") == monitored[-1]
        # NaN (a value not measured yet, e.g. a trend before its window is full) reads as "nan" so it compares equal
        drop = lambda t: sorted((s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "rank")),
                                 "nan" if s.value != s.value else s.value)
                                for s in _samples(t) if not s.name.endswith("_created")
                                and s.name != "flashwatch_last_step_timestamp_seconds")  # each rank's own clock
        assert drop(r0["text"]) == drop(r1["text"])  # the same view on both endpoints


# --- in-process checks ---------------------------------------------------------------------------------

def test_monitor_and_callback_pickle_and_validate_process_group():
    watch = pickle.loads(pickle.dumps(FlashWatchCallback(port=None, per_rank_endpoints=True)))
    assert watch.per_rank_endpoints and watch.monitor.world_size == 1
    with pytest.raises(ValueError, match="process_group must be 'auto', None or a torch.distributed"):
        Monitor(process_group="world")
    with pytest.raises(ValueError, match="per_rank_endpoints must be True or False"):
        FlashWatchCallback(per_rank_endpoints="yes")
    model = _tiny_gpt()
    with pytest.raises(ValueError, match="torch.distributed is not initialized"):
        Monitor(process_group=object()).attach(model)
    monitor = Monitor()  # "auto" without torch.distributed: a lone process, nothing reduced
    monitor.attach(model)
    assert monitor._reducer is None and (monitor.rank, monitor.world_size) == (0, 1) and monitor.sharding is None
    monitor.detach()


def test_reducer_layout_and_schemes_without_processes():
    import torch.distributed as dist

    class FakeReducer(Reducer):  # no process group: the layout and the local combination only
        def __init__(self, world, **kw):
            orig = dist.get_backend
            dist.get_backend = lambda group=None: "gloo"
            try:
                super().__init__(None, 0, world, [4, 4], n_fields=len(STAT_FIELDS), max_rows=MAX_ROWS, **kw)
            finally:
                dist.get_backend = orig

    r = FakeReducer(2)
    assert r.sum_size == (len(STAT_FIELDS) - 1) * 8 + 7 and r.max_size == 8 + 8 + 1 + 2 + 1
    assert r.slots and r.collectives == 1 and r.describe().startswith("1 all-reduce (SUM) of ")
    assert FakeReducer(2, slot_bytes_limit=0).collectives == 2
    assert FakeReducer(4096).collectives == 2  # many ranks: the slots would pass the limit
    stats = torch.randn(len(STAT_FIELDS), 8, dtype=torch.float64)
    local = r.pack(stats, torch.ones(8, dtype=torch.float64), 2.5, None, 7, [0, 3])
    back = r.split_local(local)
    assert torch.equal(back["stats"], stats) and back["loss"] == 2.5 and math.isnan(back["grad_norm"])
    assert back["step"] == 7 and back["variants"] == [0, 3]
    # two ranks' slots summed by hand: what the SUM all-reduce computes
    other = r.pack(stats * 2, torch.full((8,), 3.0, dtype=torch.float64), torch.tensor(4.5), None, 7, [1, 3])
    buf = torch.zeros(r.sum_size + 2 * r.max_size, dtype=torch.float64)
    buf[: r.sum_size] = local[: r.sum_size] + other[: r.sum_size]
    buf[r.sum_size: r.sum_size + r.max_size] = local[r.sum_size:]
    buf[r.sum_size + r.max_size:] = other[r.sum_size:]
    red = r.unpack(buf)
    assert torch.equal(red.stats[SUM_ROWS], 3 * stats[SUM_ROWS])
    assert torch.equal(red.stats[MAX_ROWS], torch.maximum(stats[MAX_ROWS], 2 * stats[MAX_ROWS]))
    assert red.loss == 3.5 and red.loss_given and not red.grad_norm_given and math.isnan(red.grad_norm)
    assert red.variants == [1, 3] and red.variants_min == [0, 3] and red.steps == (7, 7) and red.failed == 0
    assert red.grad_units_unknown == 0
    # the loss scaler skipped the step on one rank: counted, the rest as before
    skipped = r.pack(stats * 2, torch.full((8,), 3.0, dtype=torch.float64), torch.tensor(4.5), None, 7, [1, 3],
                     torch.tensor(True))
    buf[: r.sum_size] = local[: r.sum_size] + skipped[: r.sum_size]
    red = r.unpack(buf)
    assert red.grad_units_unknown == 1 and red.failed == 0 and red.loss == 3.5
    assert torch.equal(red.stats[SUM_ROWS], 3 * stats[SUM_ROWS])
    assert float(red.sigma.max()) == 3.0 and Reducer.sigma_spread(red) == pytest.approx(2 / 3)
    failed = r.failed_local(torch.device("cpu"))
    buf[: r.sum_size] = local[: r.sum_size] + failed[: r.sum_size]
    buf[r.sum_size + r.max_size:] = failed[r.sum_size:]
    assert r.unpack(buf).failed == 1


def test_an_attach_that_cannot_reach_every_rank_says_what_that_means(monkeypatch):
    """A Monitor attached on some ranks only (the default process group) waits at attach for the others
    until the group's timeout: the error then says that every rank must attach, or process_group=None.
    Fail before: the bare backend error ("Timed out waiting ... for recv")."""
    import torch.distributed as dist

    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    reducer = Reducer(None, 0, 2, [4, 4], n_fields=len(STAT_FIELDS), max_rows=MAX_ROWS)

    def timed_out(*args, **kwargs):
        raise RuntimeError("Timed out waiting 8000ms for recv")

    monkeypatch.setattr(dist, "all_reduce", timed_out)
    with pytest.raises(RuntimeError, match=r"attach could not reach every rank of its group \(2 ranks; "
                                           r"RuntimeError: Timed out.*pass process_group=None"):
        reducer.check_layout(config={"interval": 10})


def test_a_monitor_attached_before_the_process_group_under_a_launcher_says_it_is_alone(monkeypatch, caplog):
    """torchrun set WORLD_SIZE=2, but attach() came before init_process_group: the Monitor combines
    nothing and each process decides alone; it says so once, at attach. Fail before: silence."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monitor = Monitor()
    with caplog.at_level(logging.WARNING, logger="flashwatch"):
        monitor.attach(_tiny_gpt())
    monitor.close()
    assert monitor.world_size == 1
    assert "WORLD_SIZE=2, but torch.distributed is not initialized when the Monitor attaches" in caplog.text


def test_reducer_pack_uses_no_advanced_indexing(monkeypatch):
    """On CUDA, indexing with a list of rows copies the list to the device synchronously: a host
    sync on every monitored step of a distributed run. pack() must pick rows as views."""
    import torch.distributed as dist

    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    r = Reducer(None, 0, 2, [4, 4], n_fields=len(STAT_FIELDS), max_rows=MAX_ROWS)
    advanced = []
    real = torch.Tensor.__getitem__

    def spy(self, index):
        parts = index if isinstance(index, tuple) else (index,)
        if any(isinstance(p, (list, torch.Tensor)) for p in parts):
            advanced.append(type(index).__name__)
        return real(self, index)

    monkeypatch.setattr(torch.Tensor, "__getitem__", spy)
    stats = torch.randn(len(STAT_FIELDS), 8, dtype=torch.float64)
    local = r.pack(stats, torch.ones(8, dtype=torch.float64), torch.tensor(2.5), torch.tensor(1.0), 7, [0, 3])
    assert advanced == []
    monkeypatch.setattr(torch.Tensor, "__getitem__", real)
    assert torch.equal(r.split_local(local)["stats"], stats)


def test_a_rank_that_raises_fails_the_test():
    """The ranks leave through os._exit (the gloo exit abort); a worker's exception still fails."""
    from distributed_workers import _raising_worker

    with pytest.raises(Exception, match="exit code 1"):
        _run_ranks(_raising_worker, ())


def test_a_head_without_a_rank_in_the_group_is_refused():
    """Tensor parallelism with a Monitor group that lacks some tensor-parallel ranks (the data-parallel
    group of a 2-D mesh): heads that no rank of the group holds are refused at attach (before: read
    -inf W^Q and 0 delta error, with non_finite alerts that differed between the ranks)."""
    from flashwatch.distributed import check_owners

    check_owners(torch.tensor([1.0, 1.0, 2.0, 2.0]), [4])
    with pytest.raises(ValueError, match=r"layer 1 heads \[2, 3\] have no rank in it"):
        check_owners(torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0]), [4, 4])


def test_pipeline_stages_each_with_a_monitor_over_its_replicas(tmp_path):
    """Pipeline parallelism, as docs/DISTRIBUTED.md says to monitor it: one Monitor per stage over the
    stage's data-parallel replicas (ranks 0 and 2 hold block 0, ranks 1 and 3 block 1): each stage's
    replicas see one combined view of their own layer, and the stages stay apart."""
    from distributed_workers import _pipeline_worker

    _run_ranks(_pipeline_worker, (_free_ports(), str(tmp_path)), nprocs=4, timeout=120)
    r = [torch.load(tmp_path / f"rank{i}.pt", weights_only=False) for i in range(4)]
    assert [x["layers"] for x in r] == [["h0.attn"], ["h1.attn"], ["h0.attn"], ["h1.attn"]]
    assert all(x["world"] == 2 and x["errors"] == 0 for x in r)
    assert_same(r[0]["snapshot"], r[2]["snapshot"], "stage 0's replicas")
    assert_same(r[1]["snapshot"], r[3]["snapshot"], "stage 1's replicas")
    assert r[0]["snapshot"]["flashwatch_max_logit"] != r[1]["snapshot"]["flashwatch_max_logit"]
