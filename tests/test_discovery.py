"""Finding attention layers: a head count taken from the attention call itself, and an error
for an unrecognised model that lists what was found and writes the ``attention=`` argument
with the model's own module names.

Fail before: a nanoGPT-layout module that kept its head count anywhere but ``n_head``/``h``
was not found, and the error named one module with a generic placeholder.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from flashwatch import Monitor, MonitorConfig
from flashwatch.attach import find_attention

SDPA = F.scaled_dot_product_attention


class HeadsInAConfig(nn.Module):
    """nanoGPT's layout with the head count in a dict: only the call shows it."""

    def __init__(self, c=64, heads=4, needs_mask=False):
        super().__init__()
        self.c_attn = nn.Linear(c, 3 * c)
        self.c_proj = nn.Linear(c, c)
        self.settings = {"heads": heads}
        self.needs_mask = needs_mask

    def forward(self, x, mask=None):
        if self.needs_mask and mask is None:
            raise TypeError("forward() needs a mask")
        b, t, c = x.shape
        h = self.settings["heads"]
        q, k, v = (z.view(b, t, h, c // h).transpose(1, 2) for z in self.c_attn(x).split(c, 2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(b, t, c))


def test_head_count_from_the_attention_call():
    model = nn.Sequential(HeadsInAConfig(heads=4), HeadsInAConfig(heads=2))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    found = find_attention(model)
    assert [(name, heads, family) for name, _, heads, _, family in found] == [("0", 4, "nanogpt"), ("1", 2, "nanogpt")]
    w = found[1][3](model[1])
    assert w.shape == (2, 32, 64) and torch.equal(w.reshape(64, 64), model[1].c_attn.weight[:64])
    # the trial call changed nothing
    assert F.scaled_dot_product_attention is SDPA and model.training
    assert all(torch.equal(p, before[n]) and p.grad is None for n, p in model.named_parameters())

    monitor = Monitor(MonitorConfig(interval=1, async_transfer=False))
    monitor.attach(model)
    try:
        model(torch.randn(2, 8, 64)).sum().backward()
        monitor.step()
        rows = monitor.signals()["rows"]
        assert rows == {**{(0, h): 16.0 for h in range(4)}, **{(1, h): 16.0 for h in range(2)}}
    finally:
        monitor.detach()


class HeadsInAConfigWithDropout(HeadsInAConfig):
    """The same with attention dropout in training mode: the trial call must not draw from the
    random generator (nor run in training mode), or attaching would change the run."""

    def forward(self, x, mask=None):
        b, t, c = x.shape
        h = self.settings["heads"]
        q, k, v = (z.view(b, t, h, c // h).transpose(1, 2) for z in self.c_attn(x).split(c, 2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=0.1 if self.training else 0.0)
        return self.c_proj(F.dropout(y.transpose(1, 2).reshape(b, t, c), 0.1, self.training))


def test_the_trial_call_leaves_the_random_generator_and_training_mode_as_they_were():
    model = nn.Sequential(HeadsInAConfigWithDropout(heads=4))
    model[0].c_proj.eval()  # a mixed state, restored as it was
    torch.manual_seed(7)
    state = torch.get_rng_state()
    found = find_attention(model)
    assert [(name, heads) for name, _, heads, _, _ in found] == [("0", 4)]
    assert torch.equal(torch.get_rng_state(), state)
    assert model.training and model[0].training and not model[0].c_proj.training


class HeadsInAConfigWithSideEffects(HeadsInAConfig):
    """The same with a BatchNorm (running statistics in training mode) and noise drawn from the
    random generator in every mode."""

    def __init__(self, c=64, heads=4):
        super().__init__(c, heads)
        self.norm = nn.BatchNorm1d(c)

    def forward(self, x, mask=None):
        x = self.norm(x.transpose(1, 2)).transpose(1, 2) + 1e-3 * torch.rand(x.shape, dtype=x.dtype)
        return super().forward(x, mask)


def test_the_trial_call_draws_nothing_and_updates_no_running_statistics():
    """Guards the trial call's fork_rng (a forward that draws even in eval mode) and its eval()
    (a BatchNorm's running statistics, and training mode restored). Catches: either removed."""
    model = nn.Sequential(HeadsInAConfigWithSideEffects(heads=4))
    norm = model[0].norm
    stats = {n: b.clone() for n, b in norm.named_buffers()}
    torch.manual_seed(7)
    state = torch.get_rng_state()
    found = find_attention(model)
    assert [(name, heads) for name, _, heads, _, _ in found] == [("0", 4)]
    assert torch.equal(torch.get_rng_state(), state)
    assert int(norm.num_batches_tracked) == 0
    assert all(torch.equal(b, stats[n]) for n, b in norm.named_buffers())
    assert model.training and model[0].training and norm.training


class TwoHeadCounts(HeadsInAConfig):
    """Two SDPA calls in one forward with different query head counts (4, then 2): no one head
    count to read."""

    def forward(self, x, mask=None):
        b, t, c = x.shape
        for h in (4, 2):
            q, k, v = (z.view(b, t, h, c // h).transpose(1, 2) for z in self.c_attn(x).split(c, 2))
            x = self.c_proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c))
        return x


def test_a_forward_whose_calls_disagree_on_the_head_count_is_not_recognised():
    """Guards the single-head-count check of the trial call. Catches: calls with 4 and 2 query
    heads accepted (the first count taken)."""
    model = nn.Sequential(TwoHeadCounts())
    with pytest.raises(ValueError, match=r"no attention layer found.*0 \(TwoHeadCounts; c_attn: Linear\(64, 192\)") as err:
        find_attention(model)
    assert "no single head count dividing 64 (query heads seen: [4, 2])" in str(err.value)
    assert F.scaled_dot_product_attention is SDPA


class SelfAttention(nn.Module):
    def __init__(self, c=64):
        super().__init__()
        self.qkv = nn.Linear(c, 3 * c)
        self.out = nn.Linear(c, c)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = SelfAttention()
        self.mlp = nn.Linear(64, 64)


def test_unrecognised_model_error_lists_what_was_found_and_writes_the_attention_argument():
    model = nn.ModuleDict({"blocks": nn.ModuleList(Block() for _ in range(4))})
    with pytest.raises(ValueError) as err:
        find_attention(model)
    message = str(err.value)
    assert "blocks.0.attn (SelfAttention; qkv: Linear(64, 192), out: Linear(64, 64))" in message
    assert "query_weight = lambda m: m.qkv.weight[:64].view(H, 64 // H, 64)" in message
    assert ("monitor.attach(model, attention={'blocks.0.attn': query_weight, 'blocks.1.attn': query_weight, "
            "'blocks.2.attn': query_weight, ...})") in message
    # the argument it writes works once H is filled in
    H = 4
    query_weight = lambda m: m.qkv.weight[:64].view(H, 64 // H, 64)  # noqa: E731
    found = find_attention(model, attention={f"blocks.{i}.attn": query_weight for i in range(4)})
    assert [f[2] for f in found] == [4] * 4


def test_multihead_attention_error_writes_its_packed_query_weight():
    """nn.MultiheadAttention holds W^Q in its packed in_proj_weight (no query Linear): the error's
    expression reads it there, and that expression attaches. Fail before: m.<query projection>.weight."""

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = nn.MultiheadAttention(32, 2, batch_first=True)

    model = Model()
    with pytest.raises(ValueError) as err:
        find_attention(model)
    assert "query_weight = lambda m: m.in_proj_weight[:32].view(H, 32 // H, 32)" in str(err.value)
    H = 2
    query_weight = lambda m: m.in_proj_weight[:32].view(H, 32 // H, 32)  # noqa: E731
    found = find_attention(model, attention={"attn": query_weight})
    assert [f[2] for f in found] == [2]


def test_a_forward_that_needs_more_than_x_is_named_in_the_error():
    model = nn.Sequential(HeadsInAConfig(needs_mask=True))
    with pytest.raises(ValueError, match=r"0 \(HeadsInAConfig; c_attn: Linear\(64, 192\)") as err:
        find_attention(model)
    assert "m.c_attn.weight[:64].view(H, 64 // H, 64)" in str(err.value)
    # and why the trial call did not recognise it (fail before: the forward's error was swallowed)
    assert ("0: its forward, called on a (1, 2, 64) input to read the head count, raised TypeError: forward() "
            "needs a mask") in str(err.value)
    assert F.scaled_dot_product_attention is SDPA


def test_a_model_without_anything_like_attention():
    with pytest.raises(ValueError, match="no module's name or class mentions attention.*attention=") as err:
        find_attention(nn.Sequential(nn.Linear(3, 3)))
    assert "['0']" in str(err.value)
