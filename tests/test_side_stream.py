"""The observe-mode statistics pass on a side CUDA stream (``FLASHWATCH_SIDE_STREAM=1``,
``flashwatch.kernels.side_stream``): the same readings as on the current stream, and nothing
changes where no side stream may be used."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from flashwatch import Monitor, MonitorConfig
from flashwatch.kernels import side_stream
from flashwatch.kernels.checks import switch
from flashwatch.tinygpt import GPT, GPTConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("value", ["yes", "2", "on"])
def test_a_bad_switch_value_is_refused_with_what_is_accepted(value):
    env = {**os.environ, "FLASHWATCH_SIDE_STREAM": value}
    proc = subprocess.run([sys.executable, "-c", "import flashwatch.kernels.side_stream"], capture_output=True,
                          text=True, env=env, cwd=ROOT, timeout=120)
    assert proc.returncode != 0
    assert f"FLASHWATCH_SIDE_STREAM={value!r}: accepted are 1" in proc.stderr


def test_off_by_default_and_on_the_current_stream_where_no_side_stream_may_be_used(monkeypatch):
    monkeypatch.delenv("FLASHWATCH_SIDE_STREAM", raising=False)
    assert switch("FLASHWATCH_SIDE_STREAM") is False
    monkeypatch.setattr(side_stream, "SIDE_STREAM", True)
    ran = []
    with side_stream.statistics_stream(torch.device("cpu"), [torch.zeros(1)]):  # the CPU: no stream
        ran.append(1)
    assert ran == [1] and not side_stream._streams


def _readings(mode_side: bool, compiled: bool, monkeypatch) -> list[dict]:
    monkeypatch.setattr(side_stream, "SIDE_STREAM", mode_side)
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=4, n_embd=128, block_size=256, vocab_size=64)).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    monitor = Monitor(MonitorConfig(interval=1, async_transfer=False))
    monitor.attach(model)
    run = torch.compile(model) if compiled else model
    g = torch.Generator(device="cuda").manual_seed(1)
    out = []
    try:
        for _ in range(3):
            x = torch.randint(0, 64, (4, 256), device="cuda", generator=g)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = run(x, x)[1]
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            monitor.step(loss=loss.detach())
            out.append(monitor.snapshot())
    finally:
        monitor.detach()
    return out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("compiled", [False, True])
def test_the_side_stream_reads_what_the_current_stream_reads(compiled, monkeypatch):
    """Three monitored steps of the same run, the pass on the current stream and on the side stream:
    every reading agrees to 1e-4 relative. The statistics' float atomics add in any order, so two
    runs on the current stream differ too: by up to 2.0e-5 relative (the delta-drift z of a head
    whose errors nearly cancel, compiled, on one H200), the side stream's run from them by 2.6e-5."""
    serial = _readings(False, compiled, monkeypatch)
    beside = _readings(True, compiled, monkeypatch)
    assert side_stream._streams  # the side stream was used
    for a, b in zip(serial, beside):
        for name, values in a.items():
            if isinstance(values, dict) and name.startswith("flashwatch_"):
                for key, v in values.items():
                    w = b[name][key]
                    if isinstance(v, float) and v == v:
                        assert w == pytest.approx(v, rel=1e-4, abs=1e-9), (name, key)
