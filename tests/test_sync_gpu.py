"""No host synchronisation on unmonitored steps, on CUDA: torch's sync debug mode set to "error"
around every unmonitored training step (forward, backward, optimizer, ``Monitor.step``) of a
small GPT with a Monitor attached, both modes, eager and compiled. Skipped without CUDA.

    python -m pytest -q tests/test_sync_gpu.py

Torch's sync debug mode sees the synchronizing calls torch makes (device-to-host copies,
``.item()``, ``nonzero``, stream synchronizes), not ``Event.synchronize``, with which the step after
a monitored one collects its values (started a whole step before; by design).
"""

from __future__ import annotations

import pytest
import torch

from flashwatch import Monitor, MonitorConfig
from flashwatch.tinygpt import GPT, GPTConfig

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("mode", ["observe", "own_kernel"])
def test_unmonitored_steps_never_wait_for_the_gpu(mode, compiled):
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=4, n_embd=128, block_size=64)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    monitor = Monitor(MonitorConfig(interval=4, mode=mode))  # async_transfer: on by default on CUDA
    monitor.attach(model)
    run = torch.compile(model) if compiled else model
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randint(0, 256, (4, 64), device="cuda", generator=g)
    checked = 0
    try:
        for t in range(14):  # monitored: 0, 4, 8, 12; steps 0-4 warm up (compilation synchronizes)
            monitored = monitor.monitoring
            if t > 4 and not monitored:
                torch.cuda.set_sync_debug_mode("error")
                checked += 1
            try:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = run(x, x)[1]
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                monitor.step(loss=loss.detach())
            finally:
                torch.cuda.set_sync_debug_mode("default")
        monitor.flush()
        assert checked == 7 and monitor.errors == 0 and monitor.monitored_steps == 4
    finally:
        monitor.detach()
        monitor.close()


def test_with_a_loss_scaler_monitor_step_never_waits_on_unmonitored_steps():
    """FP16 with a GradScaler: Monitor.step(grad_scaler=...) on unmonitored steps (the one before each
    monitored step copies the scale the next backward uses) dispatches no synchronizing call. The
    scaler's own step() waits for its overflow check by design, so only monitor.step is checked."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=4, n_embd=128, block_size=64)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cuda", growth_interval=3)
    monitor = Monitor(MonitorConfig(interval=4))
    monitor.attach(model)
    x = torch.randint(0, 256, (4, 64), device="cuda", generator=torch.Generator(device="cuda").manual_seed(1))
    checked = 0
    try:
        for t in range(14):
            monitored = monitor.monitoring
            with torch.autocast("cuda", dtype=torch.float16):
                loss = model(x, x)[1]
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            if t > 4 and not monitored:
                torch.cuda.set_sync_debug_mode("error")
                checked += 1
            try:
                monitor.step(loss=loss.detach(), grad_scaler=scaler)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        monitor.flush()
        assert checked == 7 and monitor.errors == 0 and monitor.monitored_steps == 4
        assert monitor.alert_counts["non_finite"] == 0  # a step the scaler skipped is not a divergence
    finally:
        monitor.detach()
        monitor.close()


@pytest.mark.parametrize("block", [1, 4])
def test_the_power_step_and_the_top_pair_never_wait_for_the_gpu(block):
    """The monitored step's W^Q work on CUDA: Cholesky QR (``cholesky_ex``, ``solve_triangular``), the
    top eigenvector and the top pair dispatch without a host wait, also when a head's block has no
    independent columns (its NaN stays on the device)."""
    from flashwatch.chain import top_pair
    from flashwatch.signals import PowerIteration

    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(12, 64, 768, device="cuda", generator=g)
    power = PowerIteration(w, block=block)  # the SVD seed synchronizes: before the check
    w[3] = 0.0  # a head whose block collapses
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        sigma = power.step(w)
        u, v = top_pair(w, power.v, power.top_in_block())
        power.step(w, pair=True)  # with the pairs made in the same launch
        assert power.made_pair() is not None
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(sigma[torch.arange(12, device="cuda") != 3]).all()
    assert u.shape == (12, 64) and v.shape == (12, 768)
