"""flashwatch in a plain PyTorch loop with FSDP2 (``fully_shard``), on CPUs (gloo) or GPUs (NCCL).

    torchrun --nproc-per-node 2 examples/fsdp_loop.py                   # CPU, gloo
    torchrun --nproc-per-node 2 examples/fsdp_loop.py --device cuda     # one GPU per rank, NCCL
    torchrun --nproc-per-node 2 examples/fsdp_loop.py --fsdp1           # FSDP1, use_orig_params=True

Every rank attaches a ``Monitor`` to its sharded model and calls ``step()`` once per optimizer
step; the ranks' statistics are combined on monitored steps, and each head's W^Q spectral norm
is computed by power iteration on the shards (no weight gathered), so every rank sees, decides
and switches the same. Only rank 0 exports (here: the console log and optional JSONL).

What differs from a single-process loop::

    dist.init_process_group(backend)                    # torchrun sets RANK, WORLD_SIZE, ...
    for block in model.transformer.h:
        fully_shard(block)
    fully_shard(model)
    monitor = Monitor(config, exporters if rank == 0 else [])
    monitor.attach(model)                               # on every rank
    ...
    grad_norm = clip_grad_norm_(model.parameters(), 1.0)   # DTensor: the global norm
    monitor.step(loss=loss.detach(), grad_norm=grad_norm)  # on every rank, every step
"""

from __future__ import annotations

import argparse
import logging
import os
import time

import torch
import torch.distributed as dist

from flashwatch import Monitor, MonitorConfig
from flashwatch.tinygpt import GPT, Block, GPTConfig, sample_batch, stdlib_corpus


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--fsdp1", action="store_true", help="FullyShardedDataParallel(use_orig_params=True) instead")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--interval", type=int, default=5)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--embd", type=int, default=64)
    p.add_argument("--block", type=int, default=64)
    p.add_argument("--batch", type=int, default=8, help="sequences per rank")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--jsonl", default=None, help="folder for rank 0's JSONL metrics")
    args = p.parse_args(argv)
    if "RANK" not in os.environ:
        p.error("run it with torchrun, e.g. torchrun --nproc-per-node 2 examples/fsdp_loop.py")
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        torch.set_num_threads(1)
        device = torch.device("cpu")
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    rank = dist.get_rank()
    if rank != 0:
        logging.getLogger("flashwatch").setLevel(logging.WARNING)  # rank 0 tells the story

    torch.manual_seed(0)  # the same initial weights on every rank
    model = GPT(GPTConfig(n_layer=args.layers, n_head=args.heads, n_embd=args.embd, block_size=args.block))
    model.to(device)
    if args.fsdp1:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        model = FSDP(model, use_orig_params=True, auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=device)
    else:
        from torch.distributed.fsdp import fully_shard

        for block in model.transformer.h:
            fully_shard(block)
        fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)

    exporters = []
    if args.jsonl and rank == 0:
        from flashwatch.exporters import JsonlExporter

        exporters.append(JsonlExporter(args.jsonl))
    monitor = Monitor(MonitorConfig(interval=args.interval), exporters)
    monitor.attach(model)

    data = stdlib_corpus(2_000_000)
    g = torch.Generator().manual_seed(1000 + rank)  # each rank its own batches
    start = time.perf_counter()
    for step in range(args.steps):
        x, y = sample_batch(data, args.batch, args.block, generator=g)
        loss = model(x.to(device), y.to(device))[1]
        loss.backward()
        if args.fsdp1:
            # this rank's shard's norm (a plain tensor is taken as a shard's norm: the ranks' norms
            # combine as sqrt of the sum of squares); FSDP1 clips with the global norm
            grads = [q.grad for q in model.parameters() if q.grad is not None and q.grad.numel()]
            grad_norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(gr) for gr in grads])) \
                if grads else torch.zeros((), device=device)
            model.clip_grad_norm_(1.0)
        else:  # FSDP2: a DTensor, already the global norm
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        monitored = monitor.monitoring
        monitor.step(loss=loss.detach(), grad_norm=grad_norm)
        if monitored and rank == 0:
            monitor.flush()
            snap = monitor.snapshot()
            wq = snap["flashwatch_wq_spectral_norm"]
            print(f"step {step:4d}  loss {snap['flashwatch_loss']:.3f}  grad norm {snap['flashwatch_grad_norm']:.3f}  "
                  f"max W^Q sigma {max(wq.values()):.4f}  max logit {max(snap['flashwatch_max_logit'].values()):.2f}"
                  f"  alerts {len(monitor.alerts)}", flush=True)
    monitor.close()
    if rank == 0:
        print(f"{args.steps} steps in {time.perf_counter() - start:.1f} s on {dist.get_world_size()} ranks "
              f"({'FSDP1' if args.fsdp1 else 'FSDP2'}, {args.device})")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
