"""Finding attention layers and W^Q per head, and routing their SDPA calls (CPU)."""

from __future__ import annotations

import logging
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from flashwatch import Monitor, MonitorConfig
from flashwatch.attach import AttentionLayer, find_attention, select_layers
from flashwatch.routing import Router
from flashwatch.kernels import AttentionStats, attention_statistics
from flashwatch.tinygpt import GPT, GPTConfig

SDPA = F.scaled_dot_product_attention  # torch's own, captured at import


@pytest.fixture(autouse=True)
def _one_thread():
    # two OpenMP threads fighting another process on a 2-core machine are 100x slower than one
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def tiny_gpt(n_layer=2, seed=0):
    torch.manual_seed(seed)
    return GPT(GPTConfig(n_layer=n_layer, n_head=4, n_embd=64, block_size=32))


def hf_gpt2():
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=32, vocab_size=256, attn_pdrop=0.0,
                                  resid_pdrop=0.0, embd_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    cfg._attn_implementation = "sdpa"
    return transformers.GPT2LMHeadModel(cfg)


def hf_llama():
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=128, vocab_size=256,
                                   max_position_embeddings=32, bos_token_id=0, eos_token_id=0)
    cfg._attn_implementation = "sdpa"
    return transformers.LlamaForCausalLM(cfg)


def _scale_heads(rows_of_head, heads, layer):
    """Give every (layer, head) its own scale so that a wrong slice shows as a wrong norm."""
    with torch.no_grad():
        for h in range(heads):
            rows_of_head(h).mul_(1.0 + 0.5 * h + 3.0 * layer)


def _expected_norms(model, family):
    """W^Q_h sliced by hand from the model's own parameters: {(layer, head): sigma}."""
    out = {}
    if family == "nanogpt":
        for l, block in enumerate(model.transformer.h):
            w, H = block.attn.c_attn.weight, block.attn.n_head
            D = w.shape[1] // H
            for h in range(H):
                out[(l, h)] = torch.linalg.matrix_norm(w[h * D:(h + 1) * D, :], ord=2).item()
    elif family == "hf_gpt2":
        for l, block in enumerate(model.transformer.h):
            w, H = block.attn.c_attn.weight, block.attn.num_heads  # Conv1D weight (C, 3C)
            D = w.shape[0] // H
            for h in range(H):
                out[(l, h)] = torch.linalg.matrix_norm(w[:, h * D:(h + 1) * D].T, ord=2).item()
    else:
        for l, dec in enumerate(model.model.layers):
            w, D = dec.self_attn.q_proj.weight, dec.self_attn.head_dim
            for h in range(w.shape[0] // D):
                out[(l, h)] = torch.linalg.matrix_norm(w[h * D:(h + 1) * D], ord=2).item()
    return out


def _distinct_heads(model, family):
    if family == "nanogpt":
        for l, block in enumerate(model.transformer.h):
            w, D = block.attn.c_attn.weight, 16
            _scale_heads(lambda h: w[h * D:(h + 1) * D], 4, l)
    elif family == "hf_gpt2":
        for l, block in enumerate(model.transformer.h):
            w, D = block.attn.c_attn.weight, 16
            _scale_heads(lambda h: w[:, h * D:(h + 1) * D], 4, l)
    else:
        for l, dec in enumerate(model.model.layers):
            w, D = dec.self_attn.q_proj.weight, 16
            _scale_heads(lambda h: w[h * D:(h + 1) * D], 4, l)


@pytest.mark.parametrize("family, build", [("nanogpt", tiny_gpt), ("hf_gpt2", hf_gpt2), ("hf_llama", hf_llama)])
def test_wq_attribution_per_head_matches_the_right_slice(family, build):
    model = build()
    _distinct_heads(model, family)
    found = find_attention(model)
    assert [f[4] for f in found] == [family, family] and [f[2] for f in found] == [4, 4]
    monitor = Monitor(MonitorConfig(interval=1))
    layers = monitor.attach(model)
    try:
        assert [l.index for l in layers] == [0, 1]
        expected = _expected_norms(model, family)
        got = monitor.wq_spectral_norms(exact=True)
        assert got.keys() == expected.keys()
        for key in expected:
            assert got[key] == pytest.approx(expected[key], rel=1e-5), key
        # and through a monitored training step (power iteration, the snapshot's metric)
        x = torch.randint(0, 256, (2, 16))
        out = model(x, x) if family == "nanogpt" else model(input_ids=x, labels=x)
        loss = out[1] if family == "nanogpt" else out.loss
        loss.backward()
        monitor.step(loss=loss.detach())
        snap = monitor.snapshot()["flashwatch_wq_spectral_norm"]
        for key in expected:
            assert snap[key] == pytest.approx(expected[key], rel=1e-2), key
        assert monitor.errors == 0
    finally:
        monitor.detach()


@pytest.mark.parametrize("build", [hf_gpt2, hf_llama], ids=["gpt2", "llama_gqa"])
def test_hf_own_kernel_matches_sdpa_and_measures(build):
    model = build()
    x = torch.randint(0, 256, (2, 16))
    ref = model(input_ids=x).logits
    monitor = Monitor(MonitorConfig(mode="own_kernel", interval=1))
    monitor.attach(model)
    try:
        out = model(input_ids=x, labels=x)
        torch.testing.assert_close(out.logits, ref, rtol=1e-4, atol=1e-4)
        out.loss.backward()
        stats = monitor.layers[0].stats.as_dict()
        assert stats["rows"] == [2 * 16] * 4  # per query head: batch x rows
        assert monitor.layers[0].calls == 1 and monitor.errors == 0
    finally:
        monitor.detach()


def test_a_dispatcher_kept_after_detach_still_works():
    from flashwatch.routing import _sdpa_dispatch

    monitor = Monitor()
    monitor.attach(tiny_gpt())
    held = F.scaled_dot_product_attention  # e.g. `from torch.nn.functional import ...` while attached
    monitor.detach()
    assert held is _sdpa_dispatch
    q = torch.randn(1, 2, 4, 16)
    assert torch.equal(held(q, q, q), SDPA(q, q, q))


class WqAttention(nn.Module):
    """Attention no family recognises: separate wq/wk/wv, 2 heads of 16."""

    def __init__(self, c=32, heads=2):
        super().__init__()
        self.wq, self.wk, self.wv = nn.Linear(c, c), nn.Linear(c, c), nn.Linear(c, c)
        self.heads = heads

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (p(x).view(B, T, self.heads, C // self.heads).transpose(1, 2) for p in (self.wq, self.wk, self.wv))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)


class Custom(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([WqAttention(), WqAttention()])

    def forward(self, x):
        for b in self.blocks:
            x = x + b(x)
        return x


def test_explicit_attention_for_other_models():
    torch.manual_seed(0)
    model = Custom()
    with pytest.raises(ValueError, match="no attention layer found.*attention="):
        find_attention(model)
    fn = lambda m: m.wq.weight.view(2, 16, 32)  # noqa: E731
    with pytest.raises(ValueError, match=r"attention names \['blocks.9'\] are not modules of the model"):
        find_attention(model, {"blocks.9": fn})
    with pytest.raises(ValueError, match=r"query weight of 'blocks.0' must be a tensor \(heads, head_dim, model_dim\)"):
        find_attention(model, {"blocks.0": lambda m: m.wq.weight})
    with pytest.raises(ValueError, match="must be a function"):
        find_attention(model, {"blocks.0": "wq"})
    monitor = Monitor(MonitorConfig(interval=1))
    layers = monitor.attach(model, attention={"blocks.1": fn, "blocks.0": fn})
    try:
        assert [l.name for l in layers] == ["blocks.0", "blocks.1"]  # module order, not dict order
        assert layers[0].family == "explicit" and layers[0].num_heads == 2
        model(torch.randn(2, 8, 32)).sum().backward()
        assert layers[1].stats.as_dict()["rows"] == [16, 16]
    finally:
        monitor.detach()


def test_layer_selection_by_regex_names_and_indices():
    found = find_attention(tiny_gpt(n_layer=3))
    names = [f[0] for f in found]
    assert [f[0] for f in select_layers(found, r"h\.[12]\.")] == names[1:]
    assert [f[0] for f in select_layers(found, (2, names[0]))] == [names[0], names[2]]
    with pytest.raises(ValueError, match="matched none of the attention layers"):
        select_layers(found, "decoder")
    with pytest.raises(ValueError, match="index 3 out of range; the model has 3 attention layers"):
        select_layers(found, (3,))
    with pytest.raises(ValueError, match="'h.0.attn' is not an attention layer; found"):
        select_layers(found, ("h.0.attn",))
    monitor = Monitor(MonitorConfig(layers=[1]))
    layers = monitor.attach(tiny_gpt(n_layer=3))
    assert [(l.index, l.name) for l in layers] == [(0, "transformer.h.1.attn")]  # labels renumber from 0
    monitor.detach()


def _hooks(model):
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


@pytest.mark.parametrize("mode", ["observe", "own_kernel"])
def test_detach_restores_the_model_exactly(mode):
    model = tiny_gpt()
    x = torch.randint(0, 256, (2, 32))
    before = model(x)[0]
    hooks = _hooks(model)
    monitor = Monitor(MonitorConfig(mode=mode, interval=1))
    monitor.attach(model)
    assert F.scaled_dot_product_attention is not SDPA and _hooks(model) == hooks + 5  # a pair per layer, and the model's pre-hook
    with pytest.raises(RuntimeError, match="already attached"):
        monitor.attach(model)
    model(x)[0].sum().backward()
    monitor.detach()
    assert F.scaled_dot_product_attention is SDPA and _hooks(model) == hooks
    assert torch.equal(model(x)[0], before)
    monitor.attach(model)  # attach again after detach works
    monitor.detach()
    assert F.scaled_dot_product_attention is SDPA


def test_two_monitors_share_one_wrapper():
    a_model, b_model = tiny_gpt(), tiny_gpt(seed=1)
    a, b = Monitor(MonitorConfig(interval=1)), Monitor(MonitorConfig(interval=1, mode="own_kernel"))
    a.attach(a_model)
    b.attach(b_model)
    x = torch.randint(0, 256, (1, 32))
    a.detach()
    assert F.scaled_dot_product_attention is not SDPA  # b still routes
    b_model(x)[0].sum().backward()
    assert b.layers[0].calls == 1 and b.layers[0].stats.as_dict()["rows"] == [32] * 4
    b.detach()
    assert F.scaled_dot_product_attention is SDPA


def test_calls_outside_attached_layers_and_after_an_exception_are_untouched():
    model = tiny_gpt()
    monitor = Monitor(MonitorConfig(mode="own_kernel", interval=1))
    monitor.attach(model)
    try:
        q = torch.randn(1, 2, 8, 48)  # head dim 48: the kernel would reject it
        assert torch.equal(F.scaled_dot_product_attention(q, q, q), SDPA(q, q, q))
        attn = model.transformer.h[0].attn
        with pytest.raises(RuntimeError):
            attn(torch.randn(1, 8, 63))  # fails inside the attention module's forward
        assert torch.equal(F.scaled_dot_product_attention(q, q, q), SDPA(q, q, q))  # not routed any more
        assert monitor.layers[0].calls == 0
    finally:
        monitor.detach()


class OneAttention(nn.Module):
    """Holds q, k, v as parameters and calls SDPA once; a nanoGPT-looking module for routing tests."""

    def __init__(self, B=2, H=2, N=16, D=16, dtype=torch.float32, mask=None, dropout=0.0):
        super().__init__()
        self.c_attn = nn.Linear(H * D, 3 * H * D, bias=False)
        self.n_head = H
        g = torch.Generator().manual_seed(0)
        self.q = nn.Parameter(torch.randn(B, H, N, D, generator=g).to(dtype))
        self.k = nn.Parameter(torch.randn(B, H, N, D, generator=g).to(dtype))
        self.v = nn.Parameter(torch.randn(B, H, N, D, generator=g).to(dtype))
        self.mask, self.dropout = mask, dropout

    def forward(self):
        return F.scaled_dot_product_attention(self.q, self.k, self.v, attn_mask=self.mask, dropout_p=self.dropout,
                                              is_causal=self.mask is None)


def test_observe_statistics_equal_a_direct_statistics_pass():
    torch.manual_seed(0)
    mod = OneAttention(dtype=torch.bfloat16)
    monitor = Monitor(MonitorConfig(interval=1))
    monitor.attach(mod)
    try:
        out = mod()
        grad = torch.randn_like(out)
        out.backward(grad)
        expected = AttentionStats(2)
        attention_statistics(mod.q.detach(), mod.k.detach(), mod.v.detach(), out.detach(), grad, expected)
        assert monitor.layers[0].stats.as_dict() == expected.as_dict()
        assert monitor.layers[0].low_precision is True
        # the model's own output is untouched: SDPA's, bit for bit
        assert torch.equal(out, SDPA(mod.q, mod.k, mod.v, is_causal=True))
    finally:
        monitor.detach()


def test_own_kernel_routes_to_the_kernel_with_stats_only_on_monitored_steps(monkeypatch):
    import flashwatch.kernels as kernels

    calls = []
    real = kernels.flash_attention

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(kernels, "flash_attention", spy)
    mod = OneAttention()
    monitor = Monitor(MonitorConfig(mode="own_kernel", variant="fixed", beta=3.0, eps=0.01, interval=2))
    monitor.attach(mod)
    try:
        out = mod()
        torch.testing.assert_close(out, SDPA(mod.q, mod.k, mod.v, is_causal=True), rtol=1e-5, atol=1e-5)
        assert calls[-1]["variant"] == "fixed" and calls[-1]["beta"] == 3.0 and calls[-1]["eps"] == 0.01
        assert calls[-1]["causal"] is True and calls[-1]["stats"] is monitor.layers[0].stats
        out.sum().backward()
        monitor.step()
        assert not monitor.monitoring
        mod()
        assert calls[-1]["stats"] is None  # unmonitored step: no statistics
        with torch.no_grad():
            monitor.step()
            mod()
        assert calls[-1]["stats"] is None  # monitored step but no autograd (evaluation): not counted
    finally:
        monitor.detach()


@pytest.mark.parametrize("kwargs, reason, mode", [
    (dict(mask=torch.ones(16, 16, dtype=torch.bool).tril()), "an attn_mask is given", "observe"),
    (dict(dropout=0.1), "attention dropout is on", "observe"),
    (dict(dropout=0.1), "attention dropout is on", "own_kernel"),
    (dict(D=8), "head dim 8 is not one of", "observe"),
    (dict(D=8), "head dim 8 is not one of", "own_kernel"),
])
def test_unsupported_calls_fall_back_to_sdpa_and_log_once(kwargs, reason, mode, caplog):
    mod = OneAttention(**kwargs)
    monitor = Monitor(MonitorConfig(mode=mode, interval=1))
    monitor.attach(mod)
    try:
        with caplog.at_level(logging.INFO, logger="flashwatch"):
            torch.manual_seed(1)
            out = mod()
            torch.manual_seed(1)
            assert torch.equal(out, SDPA(mod.q, mod.k, mod.v, attn_mask=mod.mask, dropout_p=mod.dropout,
                                         is_causal=mod.mask is None))
            out.sum().backward()
            mod().sum().backward()
        # once per layer and reason (own-kernel mode: its fallback, then what the observation measures)
        assert sum(reason in r.getMessage() for r in caplog.records) == (2 if mode == "own_kernel" else 1)
        # what the statistics make of the call: information where it is measured in full (the mask's
        # dense pass), a warning where it is not
        (observed,) = [r for r in caplog.records if reason in r.getMessage() and "instead of" not in r.getMessage()]
        assert observed.levelno == (logging.INFO if "mask" in kwargs else logging.WARNING)
        stats = monitor.layers[0].stats.as_dict()
        assert monitor.errors == 0
        if "mask" in kwargs:  # measured by the dense pass beside SDPA (tests/test_masks.py checks the values)
            assert monitor.layers[0].coverage.tolist() == [2, 2] and stats["rows"] == [64, 64]
            return
        assert monitor.layers[0].coverage.tolist() == [2, 0]  # two calls, none measured in full
        if "dropout" in kwargs:  # the scores are measured; the delta error adds nothing
            assert stats["rows"] == [64, 64] and stats["max_logit"][0] > float("-inf")
            assert all(stats[f] == [0.0, 0.0] for f in ("delta_error", "delta_error_abs", "delta_error_sq"))
        else:
            assert stats["rows"] == [0, 0]
    finally:
        monitor.detach()


def test_own_kernel_under_bf16_autocast():
    model = tiny_gpt()
    x = torch.randint(0, 256, (2, 32))
    monitor = Monitor(MonitorConfig(mode="own_kernel", interval=1))
    monitor.attach(model)
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits, loss = model(x, x)
        loss.backward()
        assert monitor.layers[0].low_precision is True and monitor.errors == 0
        assert monitor.layers[0].stats.as_dict()["rows"] == [64] * 4
    finally:
        monitor.detach()


def test_a_failing_statistics_pass_never_breaks_the_backward(monkeypatch):
    import flashwatch.kernels as kernels

    def broken(*args, **kwargs):
        raise RuntimeError("statistics kernel exploded")

    monkeypatch.setattr(kernels, "attention_statistics", broken)
    mod = OneAttention()
    monitor = Monitor(MonitorConfig(interval=1))
    monitor.attach(mod)
    try:
        mod().sum().backward()
        mod().sum().backward()
        assert mod.q.grad is not None and monitor.errors == 2
    finally:
        monitor.detach()


def test_router_alone():
    mod = OneAttention()
    layer = AttentionLayer(index=0, name="", module=mod, num_heads=2, query_weight_fn=lambda m: torch.zeros(2, 1, 1),
                           family="explicit", mode="own_kernel", variant="plain")
    router = Router([layer])
    router.install()
    router.install()  # idempotent
    try:
        router.monitoring = True
        mod().sum().backward()
        assert layer.calls == 1 and layer.stats.as_dict()["rows"] == [32, 32]
    finally:
        router.remove()
        router.remove()
    assert F.scaled_dot_product_attention is SDPA


def test_a_monitor_dropped_without_detach_gives_sdpa_back_at_garbage_collection():
    import gc

    model = tiny_gpt()
    Monitor().attach(model)
    assert F.scaled_dot_product_attention is not SDPA
    del model
    gc.collect()
    assert F.scaled_dot_product_attention is SDPA


def test_observe_mode_under_torch_compile_measures_every_layer_as_its_own(caplog):
    """A compiled graph replays without the layer hooks: the layer is an argument of the traced
    operator, so each layer's attention lands on that layer (tests/test_compile.py compares the
    values with an eager run)."""
    import logging

    from flashwatch import Monitor, MonitorConfig
    from flashwatch.tinygpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16))
    monitor = Monitor(MonitorConfig(interval=1, mode="observe"))
    monitor.attach(model)
    try:
        compiled = torch.compile(model, backend="aot_eager")
        x = torch.randint(0, 256, (2, 17))
        with caplog.at_level(logging.WARNING, logger="flashwatch"):
            for _ in range(2):
                _, loss = compiled(x[:, :-1], x[:, 1:])
                loss.backward()
                monitor.step(loss=loss.detach())
        rows = monitor.signals()["rows"]
        assert rows == {(layer, head): 32.0 for layer in range(2) for head in range(2)}, rows
        assert "torch.compile" not in caplog.text
    finally:
        monitor.detach()


def test_unmeasured_attention_reads_nan_not_a_healthy_zero():
    """Hugging Face GPT-2 with its default attention dropout: observe mode cannot measure those calls,
    so the drift z and the delta error read NaN (not measured), never 0 (which would look healthy)."""
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=32, vocab_size=256,
                                  bos_token_id=0, eos_token_id=0)  # attn_pdrop=0.1, the default
    cfg._attn_implementation = "sdpa"
    model = transformers.GPT2LMHeadModel(cfg).train()
    monitor = Monitor(MonitorConfig(interval=1))
    monitor.attach(model)
    try:
        for _ in range(3):
            ids = torch.randint(0, 256, (2, 16))
            model(ids, labels=ids).loss.backward()
            monitor.step()
        snap = monitor.snapshot()
        for metric in ("flashwatch_delta_drift_z", "flashwatch_delta_error", "flashwatch_delta_error_cumulative"):
            assert snap[metric] and all(math.isnan(v) for v in snap[metric].values()), metric
        assert all(math.isnan(v) for v in monitor.signals()["drift_window_z"].values())
    finally:
        monitor.detach()


def test_the_split_qkv_gpt_is_the_fused_one_and_is_found_with_its_chain():
    """``GPTConfig(split_qkv=True)`` (separate q, k, v, o projections, for tensor parallelism) draws its
    weights as the fused model does, so it computes the same function; attach finds its layers as
    Llama-style attention, with a W^Q-error chain."""
    from flashwatch.tinygpt import GPT, GPTConfig, sample_batch, stdlib_corpus

    cfg = dict(n_layer=2, n_head=4, n_embd=32, block_size=16)
    torch.manual_seed(0)
    fused = GPT(GPTConfig(**cfg))
    torch.manual_seed(0)
    split = GPT(GPTConfig(**cfg, split_qkv=True))
    x, y = sample_batch(stdlib_corpus(50_000), 2, 16, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(split(x, y)[1], fused(x, y)[1], rtol=1e-6, atol=1e-6)
    monitor = Monitor(MonitorConfig(interval=1))
    monitor.attach(split)
    assert [(l.name, l.family, l.num_heads, l.chain is not None) for l in monitor.layers] == \
        [(f"transformer.h.{i}.attn", "hf_llama", 4, True) for i in range(2)]
    monitor.detach()


class FullyShardedDataParallel(torch.nn.Module):
    """Stands in for FSDP1's wrapper (which needs a process group): it holds the module it wraps as
    ``_fsdp_wrapped_module`` and adds that step to every name below it."""

    def __init__(self, module):
        super().__init__()
        self._fsdp_wrapped_module = module

    def forward(self, *args, **kwargs):
        return self._fsdp_wrapped_module(*args, **kwargs)


@pytest.mark.parametrize("wrapping", ["DataParallel around the model", "FSDP1 around each block",
                                      "checkpoint_wrapper around each block"])
def test_a_wrapped_model_s_layers_keep_their_own_names(wrapping):
    """A model attached through DDP-style (``module.``), FSDP1 (``_fsdp_wrapped_module.``) or
    activation-checkpoint wrappers: its layers are named as the unwrapped model's, so a state saved
    from one resumes the other and ``MonitorConfig.layers`` applies; W^Q is read through the wrappers.
    Fail before: ``module.transformer.h.0.attn`` and the like, and an unwrapped run's state refused."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    from flashwatch.tinygpt import GPT, GPTConfig

    def model():
        torch.manual_seed(0)
        return GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16))

    plain = Monitor(MonitorConfig(interval=1))
    plain.attach(model())
    names, state = [layer.name for layer in plain.layers], plain.state_dict()
    plain.close()
    inner = model()
    if wrapping.startswith("DataParallel"):
        run = torch.nn.DataParallel(inner)
    else:
        wrap = FullyShardedDataParallel if wrapping.startswith("FSDP1") else checkpoint_wrapper
        for i, block in enumerate(inner.transformer.h):
            inner.transformer.h[i] = wrap(block)
        run = inner
    monitor = Monitor(MonitorConfig(interval=1, layers=["transformer.h.1.attn"]))
    monitor.attach(run)
    assert [layer.name for layer in monitor.layers] == ["transformer.h.1.attn"]
    monitor.close()
    monitor = Monitor(MonitorConfig(interval=1))
    monitor.attach(run)
    assert [layer.name for layer in monitor.layers] == names
    monitor.load_state_dict(state)
    x = torch.randint(0, 256, (2, 16))
    run(x, x)[1].backward()
    monitor.step()
    assert all(v == v for v in monitor.snapshot()["flashwatch_wq_spectral_norm"].values())  # read, not NaN
    assert monitor.errors == 0
    monitor.close()
