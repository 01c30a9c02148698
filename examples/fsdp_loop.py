"""flashwatch in a plain PyTorch loop with FSDP2 (``fully_shard``), on CPUs (gloo) or GPUs (NCCL).

    torchrun --nproc-per-node 2 examples/fsdp_loop.py                   # CPU, gloo
    torchrun --nproc-per-node 2 examples/fsdp_loop.py --device cuda     # one GPU per rank, NCCL
    torchrun --nproc-per-node 2 examples/fsdp_loop.py --fsdp1           # FSDP1, use_orig_params=True
    torchrun --nproc-per-node 4 examples/fsdp_loop.py --tp 2            # FSDP2 over tensor parallelism, 2 x 2

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


def clip_across_meshes(model: torch.nn.Module, max_norm: float):
    """``clip_grad_norm_`` for gradients on several device meshes (the attention's on the 2-D mesh,
    the rest on the data-parallel one), which torch's cannot stack: each mesh's global norm, their
    total, returned as a replicated DTensor, so the Monitor takes it as the global norm it is."""
    from torch.distributed.tensor import DTensor, Replicate

    by_mesh: dict = {}  # mesh -> its parameters that have gradients
    for p in model.parameters():
        if p.grad is not None:
            by_mesh.setdefault(p.grad.device_mesh, []).append(p)
    norms = [torch.nn.utils.get_total_norm([p.grad for p in ps]).full_tensor() for ps in by_mesh.values()]
    total = torch.linalg.vector_norm(torch.stack(norms))
    for ps in by_mesh.values():  # the scaling, one mesh at a time too
        torch.nn.utils.clip_grads_with_norm_(ps, max_norm, total)
    mesh = max(by_mesh, key=lambda m: m.ndim)
    return DTensor.from_local(total, mesh, [Replicate()] * mesh.ndim, run_check=False)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--fsdp1", action="store_true", help="FullyShardedDataParallel(use_orig_params=True) instead")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks per replica (a (ranks / tp) x tp mesh; "
                   "the model then has separate q, k, v projections)")
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
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.tp < 1 or world % args.tp or (args.tp > 1 and args.fsdp1):
        p.error(f"--tp must divide the number of ranks ({world}) and goes with FSDP2, not --fsdp1; got {args.tp}")
    if args.heads % args.tp:
        p.error(f"--heads ({args.heads}) must be a multiple of --tp ({args.tp}): each rank holds whole heads")
    if rank != 0:
        logging.getLogger("flashwatch").setLevel(logging.WARNING)  # rank 0 tells the story

    torch.manual_seed(0)  # the same initial weights on every rank
    model = GPT(GPTConfig(n_layer=args.layers, n_head=args.heads, n_embd=args.embd, block_size=args.block,
                          split_qkv=args.tp > 1))
    model.to(device)
    replica = rank
    if args.tp > 1:  # torchtitan's composition: tensor parallelism on the inner dimension, then FSDP2 across it
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = init_device_mesh(device.type, (world // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
        for block in model.transformer.h:
            parallelize_module(block.attn, mesh["tp"], {"q_proj": ColwiseParallel(), "k_proj": ColwiseParallel(),
                                                        "v_proj": ColwiseParallel(), "o_proj": RowwiseParallel()})
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        replica = mesh["dp"].get_local_rank()  # the ranks of one replica share its batch
    elif args.fsdp1:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        model = FSDP(model, use_orig_params=True, auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=device)
    else:
        from torch.distributed.fsdp import fully_shard

        for block in model.transformer.h:
            fully_shard(block)
        fully_shard(model)
    # foreach=False under tensor parallelism: the fused multi-tensor kernels take tensors of one device mesh
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0,
                            foreach=False if args.tp > 1 else None)

    exporters = []
    if args.jsonl and rank == 0:
        from flashwatch.exporters import JsonlExporter

        exporters.append(JsonlExporter(args.jsonl))
    monitor = Monitor(MonitorConfig(interval=args.interval), exporters)
    monitor.attach(model)

    data = stdlib_corpus(2_000_000)
    g = torch.Generator().manual_seed(1000 + replica)  # each replica its own batches
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
        elif args.tp > 1:
            grad_norm = clip_across_meshes(model, 1.0)
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
        how = "FSDP1" if args.fsdp1 else f"FSDP2 over tensor parallelism, {world // args.tp} x {args.tp}" \
            if args.tp > 1 else "FSDP2"
        print(f"{args.steps} steps in {time.perf_counter() - start:.1f} s on {world} ranks ({how}, {args.device})")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
