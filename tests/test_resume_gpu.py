"""A CUDA run resumed from a checkpoint loaded with ``map_location="cuda"`` keeps monitoring:
the Monitor's host-side state (delta drift, rings, cumulative sums) comes back to the CPU, so no
monitored step after the resume fails. Skipped without CUDA.

    python -m pytest -q tests/test_resume_gpu.py
"""

from __future__ import annotations

import pytest
import torch

from flashwatch import Monitor, MonitorConfig
from flashwatch.tinygpt import GPT, GPTConfig

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _train(model, opt, monitor, first: int, steps: int) -> None:
    for t in range(first, first + steps):
        g = torch.Generator(device="cuda").manual_seed(t)
        x = torch.randint(0, 256, (4, 64), device="cuda", generator=g)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x, x)[1]
        loss.backward()
        opt.step()
        opt.zero_grad()
        monitor.step(loss=loss.detach())


@pytest.mark.parametrize("map_location", ["cuda", "cpu"])
def test_resume_from_a_checkpoint_mapped_to_the_gpu_keeps_monitoring(tmp_path, map_location):
    cfg = MonitorConfig(interval=2, async_transfer=False)
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=4, n_embd=128, block_size=64)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    monitor = Monitor(cfg)
    monitor.attach(model)
    _train(model, opt, monitor, 0, 8)
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "monitor": monitor.state_dict()},
               tmp_path / "ckpt.pt")
    monitor.detach()

    ckpt = torch.load(tmp_path / "ckpt.pt", map_location=map_location, weights_only=True)
    resumed = Monitor(cfg)
    resumed.attach(model)
    resumed.load_state_dict(ckpt["monitor"])
    before = resumed.monitored_steps
    _train(model, opt, resumed, 8, 8)
    resumed.state_dict()  # decides the last monitored step
    try:
        assert resumed.errors == 0, "a monitored step failed after the resume"
        assert resumed.monitored_steps == before + 4
        assert resumed.last_decided_step == 14
        for layer in resumed.state_dict()["layers"]:
            drift = layer["signals"]["drift"]
            assert drift["cumulative"].device.type == "cpu" and drift["ring"]["buffer"].device.type == "cpu"
    finally:
        resumed.detach()
