"""FlashWatchCallback under Lightning's ModelParallelStrategy on the CPU (gloo, 2 processes): FSDP2
(``fully_shard`` in ``configure_model``, data-parallel size 2) and tensor parallelism (tensor-parallel
size 2), each equal per head to an unsharded plain-loop run on the same batches.

Lightning's FSDPStrategy (FSDP1) refuses the CPU ("requires a GPU accelerator"), so it is not run
here; FSDP1 itself (``use_orig_params=True``) is tested in tests/test_sharded.py, and the
GPU script benchmarks/sharded_check.py runs the strategy on two GPUs.

The ranks are started as torchrun would start them (environment variables), so Lightning
launches nothing itself. Tolerances as in tests/test_sharded.py: relative 1e-5 for W^Q norms and
max logits (float32 summation order), exact for the repeated-max counts.
"""

from __future__ import annotations

import datetime
import math
import os

import pytest
import torch
from distributed_workers import _free_ports, _run_ranks, assert_same
from sharded_workers import LlamaStyleLM, close, nanogpt, per_head, train

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.filterwarnings("ignore::FutureWarning"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]

STEPS, BATCH = 3, 2


def _sequences() -> tuple[torch.Tensor, torch.Tensor]:
    from flashwatch.tinygpt import sample_batch, stdlib_corpus

    return sample_batch(stdlib_corpus(100_000), 2 * BATCH * STEPS, 32, generator=torch.Generator().manual_seed(7))


def _worker(rank: int, port: int, out: str, mode: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", RANK=str(rank),
                      LOCAL_RANK=str(rank), NODE_RANK="0")
    torch.set_num_threads(1)
    from pytorch_lightning import Callback, LightningModule, Trainer
    from pytorch_lightning.strategies import ModelParallelStrategy
    from torch.utils.data import DataLoader, TensorDataset

    from flashwatch.lightning import FlashWatchCallback

    class Lit(LightningModule):
        def __init__(self):
            super().__init__()
            self.model = nanogpt() if mode == "fsdp2" else LlamaStyleLM(width=64, heads=4)

        def configure_model(self):
            if mode == "fsdp2":
                from torch.distributed.fsdp import fully_shard

                mesh = self.device_mesh["data_parallel"]
                for block in self.model.transformer.h:
                    fully_shard(block, mesh=mesh)
                fully_shard(self.model, mesh=mesh)
            else:
                from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

                for block in self.model.h:
                    parallelize_module(block.attn, self.device_mesh["tensor_parallel"],
                                       {"q_proj": ColwiseParallel(), "k_proj": ColwiseParallel(),
                                        "v_proj": ColwiseParallel(), "o_proj": RowwiseParallel()})

        def training_step(self, batch, batch_idx):
            return self.model(*batch)[1]

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.5)

    class Record(Callback):
        def __init__(self):
            self.snapshots, self.batches = [], []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.snapshots.append(watch.monitor.snapshot())
            self.batches.append([t.clone() for t in batch])

    watch = FlashWatchCallback(interval=1, warmup=1, window=2, port=None, console=None, jsonl=False)
    record = Record()
    x, y = _sequences()
    if mode == "tp":  # tensor-parallel ranks share each batch
        x, y = x[: BATCH * STEPS], y[: BATCH * STEPS]
    loader = DataLoader(TensorDataset(x, y), batch_size=BATCH)
    dp, tp = (2, 1) if mode == "fsdp2" else (1, 2)
    strategy = ModelParallelStrategy(data_parallel_size=dp, tensor_parallel_size=tp,
                                     timeout=datetime.timedelta(seconds=60))
    trainer = Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=STEPS, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      callbacks=[watch, record], use_distributed_sampler=mode == "fsdp2")
    trainer.fit(Lit(), loader)
    torch.save({"snapshots": record.snapshots, "batches": record.batches, "errors": watch.monitor.errors}, os.path.join(out, f"rank{rank}.pt"))
    # the rank leaves through os._exit (distributed_workers._run_ranks): gloo's exit abort


def _unsharded(mode: str, r0: dict, r1: dict) -> list[dict]:
    """The same model on each step's global batch: both ranks' batches (FSDP2), or the one batch the
    tensor-parallel ranks shared."""
    if mode == "tp":
        assert all(torch.equal(a[0], b[0]) for a, b in zip(r0["batches"], r1["batches"]))
        data = [tuple(b) for b in r0["batches"]]
        model = LlamaStyleLM(width=64, heads=4)
    else:
        data = [(torch.cat([a[0], b[0]]), torch.cat([a[1], b[1]])) for a, b in zip(r0["batches"], r1["batches"])]
        model = nanogpt()
    from flashwatch import Monitor, MonitorConfig

    return train(model, Monitor(MonitorConfig(interval=1, warmup=1, window=2), process_group=None), data,
                 clip=False)["records"]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", ["fsdp2", "tp"])
def test_model_parallel_strategy_equals_unsharded_run(mode, tmp_path):
    _run_ranks(_worker, (_free_ports(), str(tmp_path), mode), timeout=200)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1))
    assert r0["errors"] == r1["errors"] == 0
    reference = _unsharded(mode, r0, r1)
    assert len(r0["snapshots"]) == len(reference) == STEPS
    for t, (a, b, ref) in enumerate(zip(r0["snapshots"], r1["snapshots"], reference)):
        assert_same(a, b, f"{mode} step {t}")
        mine, theirs = per_head(a), per_head(ref["snapshot"])
        for name in ("flashwatch_max_logit", "flashwatch_wq_spectral_norm", "flashwatch_repeated_max_ratio",
                     "flashwatch_repeated_max_ratio_bf16"):
            assert mine[name].keys() == theirs[name].keys() and len(theirs[name]) == 8
            rtol = 0.0 if "ratio" in name else 1e-5
            for key, v in theirs[name].items():
                assert math.isfinite(v) and close(mine[name][key], v, rtol), (mode, t, name, key, mine[name][key], v)
        # the callback's gradient norm is the global one: under tensor parallelism a replicated
        # parameter's gradient counts once, not once per rank (before: 1.3x too large here)
        assert close(a["flashwatch_grad_norm"], ref["grad_norm"], 1e-5), (mode, t, a["flashwatch_grad_norm"],
                                                                          ref["grad_norm"])
