"""Rank worker of tests/test_chain_true_gradient.py: the W^Q-error chain's push_true under DDP (gloo, CPU).

A module of its own so that the spawned processes import only torch, flashwatch and this file.
"""

from __future__ import annotations

import datetime
import os

import torch

from flashwatch import Monitor, MonitorConfig
from flashwatch.tinygpt import GPT, GPTConfig, sample_batch, stdlib_corpus

HEADS, WIDTH = 4, 64


def ddp_push_true_worker(rank: int, port: int, out: str) -> None:
    """One monitored step of two micro-batches (the first under no_sync), different data per rank.
    Saves this rank's reading, its own float64 -sum_rows (dQ . u)(x . v) and the pairs used."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from flashwatch import routing

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    try:
        torch.manual_seed(0)  # the same weights on every rank
        inner = GPT(GPTConfig(n_layer=2, n_head=HEADS, n_embd=WIDTH, block_size=32))
        model = DDP(inner)
        monitor = Monitor(MonitorConfig(interval=1))
        monitor.attach(model)
        pairs = [(layer.chain.u.clone().double(), layer.chain.v.clone().double()) for layer in monitor.layers]
        xs, qs = [], []
        for i, block in enumerate(inner.transformer.h):
            block.attn.register_forward_pre_hook(lambda m, args, i=i: xs.append((i, args[0].detach().clone())))
        real = routing.original_sdpa()

        def spy(q, k, v, **kw):
            q.retain_grad()
            qs.append(q)
            return real(q, k, v, **kw)

        routing._original_sdpa = spy
        data = stdlib_corpus(50_000)
        for micro in range(2):
            x, y = sample_batch(data, 2, 32, generator=torch.Generator().manual_seed(100 * rank + micro))
            if micro == 0:
                with model.no_sync():
                    model(x, y)[1].backward()
            else:
                model(x, y)[1].backward()
        local = torch.zeros(2, HEADS, dtype=torch.float64)
        mag = torch.zeros(2, HEADS, dtype=torch.float64)
        for (i, x), q in zip(xs, qs):
            u, v = pairs[i]
            terms = torch.einsum("bhnd,hd->bhn", q.grad.double(), u) * torch.einsum("bnc,hc->bhn", x.double(), v)
            local[i] -= terms.sum(dim=(0, 2))
            mag[i] += terms.abs().sum(dim=(0, 2))
        # the gradient DDP leaves in W^Q: the ranks' mean
        applied = torch.stack([-torch.einsum("hd,hdc,hc->h", u, b.attn.c_attn.weight.grad[:WIDTH].view(HEADS, -1, WIDTH)
                                             .double(), v) for (u, v), b in zip(pairs, inner.transformer.h)])
        monitor.step()
        sig = monitor.signals()["wq_error_push_true"]
        got = torch.tensor([[sig[(i, h)] for h in range(HEADS)] for i in range(2)], dtype=torch.float64)
        routing._original_sdpa = real
        torch.save({"got": got, "local": local, "mag": mag, "applied": applied, "errors": monitor.errors},
                   os.path.join(out, f"rank{rank}.pt"))
        monitor.detach()
    finally:
        dist.destroy_process_group()
