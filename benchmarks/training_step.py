"""The GPT-2-small training step the GPU benchmarks time, profile or watch (CUDA, bf16 autocast).

    from training_step import gpt2_small, make_step
    model = gpt2_small()
    step = make_step(torch.compile(model), model, opt, x, y, monitor, clip=True)
"""

from __future__ import annotations

import torch

from flashwatch.tinygpt import GPT, GPTConfig


def gpt2_small(seq: int = 1024) -> GPT:
    """flashwatch.tinygpt at GPT-2 small size (12 layers, 12 heads, 768), on the current CUDA device."""
    return GPT(GPTConfig(n_layer=12, n_head=12, n_embd=768, block_size=seq)).cuda()


def make_step(run, model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor,
              monitor=None, clip: bool = False):
    """One optimizer step on (x, y): ``run`` (the model, or its compiled form) under bf16 autocast, the
    backward, gradient clipping at 1.0 if ``clip``, the optimizer, then ``monitor.step`` if a Monitor
    is given (with the gradient norm when clipped)."""
    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = run(x, y)[1]
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0) if clip else None
        opt.step()
        opt.zero_grad(set_to_none=True)
        if monitor is not None:
            monitor.step(loss=loss.detach(), grad_norm=norm)
    return step
