"""FlashWatchCallback under Lightning's sharded strategies, against an unsharded run of the same batches.

    export PYTHONPATH=$PWD; [ -e flashwatch/kernels ] || ln -s ../kernels flashwatch/kernels
    torchrun --nproc-per-node 2 benchmarks/sharded_lightning_check.py --strategy fsdp --device cuda
    torchrun --nproc-per-node 2 benchmarks/sharded_lightning_check.py --strategy model_parallel --device cpu

``--strategy fsdp``: ``FSDPStrategy(auto_wrap_policy={Block})`` (FSDP1, Lightning's default
``use_orig_params=True``; Lightning refuses it on the CPU). ``--strategy model_parallel``:
``ModelParallelStrategy`` with ``fully_shard`` in ``configure_model``. Each rank trains a small
nanoGPT-style model (FP32, SGD, TF32 off) for ``--steps`` steps with the callback at
``interval=1`` and records every snapshot and the batch it saw; rank 0 then trains the unsharded
model on both ranks' batches with a plain ``Monitor`` and compares every head's W^Q spectral
norm and max logit (relative 1e-4) and repeated-max ratios (0.01 absolute). The ranks' snapshots
must be identical. Prints ``RESULT: PASS`` (exit 0) or ``FAIL`` (exit 1).
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import sys

import torch
import torch.distributed as dist

from flashwatch import Monitor, MonitorConfig
from flashwatch.tinygpt import GPT, Block, GPTConfig, sample_batch, stdlib_corpus

METRICS = ("flashwatch_wq_spectral_norm", "flashwatch_max_logit", "flashwatch_repeated_max_ratio",
           "flashwatch_repeated_max_ratio_bf16")
CFG = GPTConfig(n_layer=2, n_head=4, n_embd=128, block_size=64)


def model() -> GPT:
    torch.manual_seed(0)
    return GPT(CFG)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--strategy", choices=("fsdp", "model_parallel"), default="fsdp")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    p.add_argument("--steps", type=int, default=4)
    args = p.parse_args(argv)
    if "RANK" not in os.environ:
        p.error("run it with torchrun --nproc-per-node 2")
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    if args.device == "cpu":
        torch.set_num_threads(1)
    from pytorch_lightning import Callback, LightningModule, Trainer
    from torch.utils.data import DataLoader, TensorDataset

    from flashwatch.lightning import FlashWatchCallback

    class Lit(LightningModule):
        def __init__(self):
            super().__init__()
            self.model = model()

        def configure_model(self):
            if args.strategy == "model_parallel":
                from torch.distributed.fsdp import fully_shard

                mesh = self.device_mesh["data_parallel"]
                for block in self.model.transformer.h:
                    fully_shard(block, mesh=mesh)
                fully_shard(self.model, mesh=mesh)

        def training_step(self, batch, batch_idx):
            return self.model(*batch)[1]

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    class Record(Callback):
        def __init__(self):
            self.snapshots, self.batches, self.kinds = [], [], None

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.kinds = [layer.placement_kind for layer in watch.monitor.layers]
            self.snapshots.append({m: dict(watch.monitor.snapshot()[m]) for m in METRICS})
            self.batches.append([t.detach().cpu() for t in batch])

    if args.strategy == "fsdp":
        from pytorch_lightning.strategies import FSDPStrategy

        strategy = FSDPStrategy(auto_wrap_policy={Block}, timeout=datetime.timedelta(seconds=120))
    else:
        from pytorch_lightning.strategies import ModelParallelStrategy

        strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1,
                                         timeout=datetime.timedelta(seconds=120))
    watch = FlashWatchCallback(interval=1, port=None, console=None, jsonl=False)
    record = Record()
    x, y = sample_batch(stdlib_corpus(200_000), 4 * args.steps, CFG.block_size,
                        generator=torch.Generator().manual_seed(3))
    trainer = Trainer(accelerator="gpu" if args.device == "cuda" else "cpu", devices=2, strategy=strategy,
                      max_steps=args.steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, callbacks=[watch, record])
    trainer.fit(Lit(), DataLoader(TensorDataset(x, y), batch_size=2))
    rank = dist.get_rank()
    gathered = [None, None]
    dist.all_gather_object(gathered, {"snapshots": record.snapshots, "batches": record.batches,
                                      "kinds": record.kinds, "errors": watch.monitor.errors})
    ok = True
    if rank == 0:
        a, b = gathered
        device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
        whole = model().to(device)
        monitor = Monitor(MonitorConfig(interval=1), process_group=None)
        monitor.attach(whole)
        opt = torch.optim.SGD(whole.parameters(), lr=0.05)
        worst = {m: 0.0 for m in METRICS}
        same = all(_equal(s, t) for s, t in zip(a["snapshots"], b["snapshots"]))
        for step, (ba, bb, snap) in enumerate(zip(a["batches"], b["batches"], a["snapshots"])):
            loss = whole(torch.cat([ba[0], bb[0]]).to(device), torch.cat([ba[1], bb[1]]).to(device))[1]
            loss.backward()
            opt.step()
            opt.zero_grad()
            monitor.step(loss=loss.detach())
            monitor.flush()
            ref = monitor.snapshot()
            for m in METRICS:
                for key, v in ref[m].items():
                    mine = snap[m][key]
                    diff = abs(mine - v) if "ratio" in m else \
                        (abs(mine - v) / max(abs(v), 1e-30) if math.isfinite(mine) and math.isfinite(v) else math.inf)
                    worst[m] = max(worst[m], diff)
        ok = (same and a["kinds"] == ["fsdp"] * CFG.n_layer and a["errors"] == b["errors"] == 0 and worst[METRICS[0]] <= 1e-4 and worst[METRICS[1]] <= 1e-4
              and worst[METRICS[2]] <= 0.01 and worst[METRICS[3]] <= 0.01)
        print(f"{args.strategy} on {args.device}: placements {a['kinds']}, ranks identical {same}, errors "
              f"{a['errors']}/{b['errors']}, worst rel W^Q {worst[METRICS[0]]:.1e}, max logit {worst[METRICS[1]]:.1e}, "
              f"repeated-max abs {max(worst[METRICS[2]], worst[METRICS[3]]):.1e}")
        print("RESULT:", "PASS" if ok else "FAIL", flush=True)
        monitor.close()
    flag = [ok]
    dist.broadcast_object_list(flag, src=0)
    # the process group's threads must end before the interpreter does: left to exit, they can abort a
    # process whose check passed ("terminate called without an active exception")
    dist.destroy_process_group()
    return 0 if flag[0] else 1


def _equal(a: dict, b: dict) -> bool:
    return all(all((x == y) or (math.isnan(x) and math.isnan(y)) for x, y in zip(a[m].values(), b[m].values()))
               for m in METRICS)


if __name__ == "__main__":
    code = main()
    # Lightning's ModelParallelStrategy over gloo on the CPU can abort a rank in the C++ runtime while
    # the interpreter shuts down, after all of the work above ("terminate called without an active
    # exception", exit code -6; on a loaded 2-core machine in about one full test run in three, even
    # with the group destroyed): the verdict is printed, so leave without that shutdown
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
