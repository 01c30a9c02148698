"""Training a small GPT with and without a Monitor: the gradients both give, for the tests that hold
monitoring to changing nothing of training."""

from __future__ import annotations

import contextlib
import os

import torch

from flashwatch import Monitor, MonitorConfig
from flashwatch.tinygpt import GPT, GPTConfig


@contextlib.contextmanager
def deterministic():
    """torch's deterministic algorithms for the block, restored after. Without them two runs of the
    same CUDA step differ in the last bits (FlashAttention's backward adds the parts of dQ with
    atomics, in whatever order its programs finish), so "bit for bit" could not be asked of a
    monitored run. cuBLAS needs its workspace setting for this (read when it is first used)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    before, warn_only = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before, warn_only=warn_only)


def gradients(config: GPTConfig, device: str, monitored: bool, compile_backend: str | None, steps: int = 3,
              batch: int = 2, autocast: bool = True, dtype: torch.dtype = torch.float32) -> list[list[torch.Tensor]]:
    """Every parameter's gradient at each of ``steps`` steps (BF16 autocast, or the weights' ``dtype``
    throughout with ``autocast=False``; the same seeds whatever the arguments), with ``Monitor(MonitorConfig(interval=2, mode="observe"))`` attached or not, compiled
    with ``compile_backend`` (None: eager; "inductor" is torch.compile's default). Steps 0 and 2 are
    monitored. Runs under ``deterministic()``: the same arguments give the same bits."""
    with deterministic():
        return _gradients(config, device, monitored, compile_backend, steps, batch, autocast, dtype)


def _gradients(config: GPTConfig, device: str, monitored: bool, compile_backend: str | None, steps: int,
               batch: int, autocast: bool, dtype: torch.dtype = torch.float32) -> list[list[torch.Tensor]]:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = GPT(config).to(device=device, dtype=dtype)
    monitor = Monitor(MonitorConfig(interval=2, mode="observe")) if monitored else None
    if monitor is not None:
        monitor.attach(model)
    run = model if compile_backend is None else torch.compile(model, backend=compile_backend)
    g = torch.Generator(device=device).manual_seed(1)
    out = []
    try:
        for _ in range(steps):
            x = torch.randint(0, config.vocab_size, (batch, config.block_size), device=device, generator=g)
            with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
                loss = run(x, x)[1]
            loss.backward()
            out.append([p.grad.clone() for p in model.parameters()])
            model.zero_grad(set_to_none=True)
            if monitor is not None:
                monitor.step(loss=loss.detach())
        if monitor is not None:
            monitor.flush()
            assert monitor.monitored_steps == (steps + 1) // 2 and monitor.errors == 0
    finally:
        if monitor is not None:
            monitor.detach()
            monitor.close()
    return out


def first_difference(plain: list[list[torch.Tensor]], observed: list[list[torch.Tensor]]) -> str | None:
    """Where two runs' gradients first differ: the step, how many parameters differ there, the first
    of them and its largest difference, absolute and relative to that gradient's largest entry (for
    telling last-bit rounding from a changed computation); None if equal bit for bit."""
    for t, (a_step, b_step) in enumerate(zip(plain, observed)):
        differ = [i for i, (a, b) in enumerate(zip(a_step, b_step)) if not torch.equal(a, b)]
        if differ:
            a, b = a_step[differ[0]], b_step[differ[0]]
            gap = (a - b).abs().max().item()
            scale = a.abs().max().item()
            return (f"step {t}: {len(differ)} of {len(a_step)} parameters differ; parameter {differ[0]}: max |difference| "
                    f"{gap:.3g} ({gap / scale if scale else float('inf'):.2g} of its largest entry)")
    return None
