"""W^Q is read from the live model: a replaced attention module is reported as NaN with a warning
(never the old module's value), a replaced query projection is followed from its exact norms."""

from __future__ import annotations

import logging
import math

import torch
from torch import nn

from flashwatch import Monitor, MonitorConfig
from flashwatch.signals import spectral_norm_exact
from flashwatch.tinygpt import GPT, GPTConfig, CausalSelfAttention, sample_batch, stdlib_corpus


def _step(model, monitor, data, t):
    x, y = sample_batch(data, 2, 32, generator=torch.Generator().manual_seed(t))
    model(x, y)[1].backward()
    model.zero_grad()
    return monitor.step()


def test_replaced_modules_are_never_reported_stale(caplog):
    torch.manual_seed(0)
    config = GPTConfig(n_layer=3, n_head=4, n_embd=64, block_size=32)
    model = GPT(config)
    data = stdlib_corpus(50_000)
    monitor = Monitor(MonitorConfig(interval=1))
    monitor.attach(model)
    _step(model, monitor, data, 0)

    # layer 0: the whole attention module replaced (a new module object, larger weights)
    new_attn = CausalSelfAttention(config)
    with torch.no_grad():
        new_attn.c_attn.weight.normal_(0, 0.5)
    model.transformer.h[0].attn = new_attn
    # layer 1: only its query/key/value projection replaced, inside the attached module
    new_proj = nn.Linear(64, 192, bias=False)
    with torch.no_grad():
        new_proj.weight.normal_(0, 0.5)
    model.transformer.h[1].attn.c_attn = new_proj

    with caplog.at_level(logging.WARNING, logger="flashwatch"):
        alerts = _step(model, monitor, data, 1)
        _step(model, monitor, data, 2)
    sigma = monitor.snapshot()["flashwatch_wq_spectral_norm"]
    assert all(math.isnan(sigma[(0, h)]) for h in range(4))  # not the old module's value
    warned = [r.getMessage() for r in caplog.records if "no longer the module attached" in r.getMessage()]
    assert len(warned) == 1 and "layer 0 (transformer.h.0.attn)" in warned[0]
    assert not [a for a in alerts if a.rule == "non_finite"]  # a weight not measured is no non-finite value
    true1 = spectral_norm_exact(new_proj.weight[:64].view(4, 16, 64))
    for h in range(4):
        assert math.isclose(sigma[(1, h)], float(true1[h]), rel_tol=1e-5), (h, sigma[(1, h)], float(true1[h]))
    true2 = spectral_norm_exact(model.transformer.h[2].attn.c_attn.weight[:64].view(4, 16, 64))
    assert all(math.isclose(sigma[(2, h)], float(true2[h]), rel_tol=1e-3) for h in range(4))  # untouched layer
    monitor.detach()
