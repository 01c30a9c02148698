"""The true gradient's push (``push_true``) read from W^Q's own gradient, against the query-gradient definition.

push_true_h = -u_h^T G_h v_h with G_h head h's rows of the query projection's weight gradient
equals, in float64, the sum over the step's attention calls of -sum_rows (dQ . u_h)(x . v_h):
micro-batches of one monitored step add up, nothing is counted twice (also when the gradient
was not zeroed since an earlier step), unmonitored steps add nothing, and a W^Q that is not a
trainable parameter falls back to the query's gradient (never 0).
"""

from __future__ import annotations

import math

import pytest
import torch

from flashwatch import Monitor, MonitorConfig
from flashwatch.chain import LayerChain
from flashwatch.tinygpt import GPT, GPTConfig, sample_batch, stdlib_corpus

DATA = stdlib_corpus(100_000)
F64 = torch.float64
HEADS = 4


def _model() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=2, n_head=HEADS, n_embd=64, block_size=32))  # FP32: the kernels' widest dtype


class _Spy:
    """Records every attention module's input X and its SDPA call's q (gradient kept), per call."""

    def __init__(self, model: GPT, real):
        self.real, self.calls, self.handles, self.xs = real, [], [], []
        for i, block in enumerate(model.transformer.h):
            self.handles.append(block.attn.register_forward_pre_hook(
                lambda module, args, i=i: self.xs.append((i, args[0].detach().clone()))))

    def __call__(self, q, k, v, **kw):
        q.retain_grad()
        self.calls.append(q)
        return self.real(q, k, v, **kw)

    def remove(self):
        for h in self.handles:
            h.remove()


def _old_definition(spy: _Spy, pairs: dict, start: int = 0) -> tuple[dict, dict]:
    """Per layer, float64 from the recorded FP32 tensors: the sum over the recorded calls (from
    ``start``) of -sum_rows (dQ . u)(x . v), and the sum of its terms' magnitudes (the scale of
    the FP32 rounding in the weight gradient torch computes)."""
    out = {i: torch.zeros(HEADS, dtype=F64) for i in pairs}
    mag = {i: torch.zeros(HEADS, dtype=F64) for i in pairs}
    for (i, x), q in list(zip(spy.xs, spy.calls))[start:]:
        u, v = (t.to(F64) for t in pairs[i])
        dq = q.grad.to(F64)  # (B, H, N, D)
        xv = torch.einsum("bnc,hc->bhn", x.to(F64), v)
        terms = torch.einsum("bhnd,hd->bhn", dq, u) * xv
        out[i] -= terms.sum(dim=(0, 2))
        mag[i] += terms.abs().sum(dim=(0, 2))
    return out, mag


def _push_true(monitor: Monitor, layer: int) -> torch.Tensor:
    sig = monitor.signals()["wq_error_push_true"]
    return torch.tensor([sig[(layer, h)] for h in range(HEADS)], dtype=F64)


def _micro_batch(model, seed):
    x, y = sample_batch(DATA, 2, 32, generator=torch.Generator().manual_seed(seed))
    model(x, y)[1].backward()


@pytest.mark.parametrize("mode", ["observe", "own_kernel"])
def test_push_true_from_the_weight_gradient_equals_the_query_gradient_definition(mode, monkeypatch):
    """Two monitored steps of two micro-batches each, the gradient never zeroed in between (an
    unmonitored step's backward also lands in it): each monitored step reads exactly its own calls."""
    from flashwatch import routing

    model = _model()
    monitor = Monitor(MonitorConfig(interval=2, mode=mode))
    monitor.attach(model)
    if mode == "own_kernel":  # the calls reach the package's kernel
        import flashwatch.kernels as kernels

        spy = _Spy(model, kernels.flash_attention)
        monkeypatch.setattr(kernels, "flash_attention", spy)
    else:
        spy = _Spy(model, routing.original_sdpa())
        monkeypatch.setattr(routing, "_original_sdpa", spy)
    seen = 0
    for step in range(4):
        pairs = {i: (layer.chain.u.clone(), layer.chain.v.clone()) for i, layer in enumerate(monitor.layers)}
        monitored = monitor.monitoring
        for micro in range(2):
            _micro_batch(model, 10 * step + micro)
        if monitored:
            assert all(layer.chain.weight_hook is not None for layer in monitor.layers)  # W^Q's hook, not dQ's
        want, mag = _old_definition(spy, pairs, seen)
        seen = len(spy.calls)
        monitor.step()
        if monitored:
            assert all(layer.chain.weight_hook is None for layer in monitor.layers)  # removed at the reading
            for i in range(2):
                got = _push_true(monitor, i)
                # torch forms the weight gradient in FP32: sums of B*N products, each rounded at 2**-24
                assert ((got - want[i]).abs() <= 1e-5 * mag[i]).all(), (step, i, got, want[i])
                assert want[i].abs().min() > 0
    assert all(c.grad is not None for c in spy.calls)
    monkeypatch.undo()
    spy.remove()
    monitor.detach()


def test_frozen_query_weight_falls_back_to_the_query_gradient(monkeypatch):
    from flashwatch import routing

    model = _model()
    for block in model.transformer.h:
        block.attn.c_attn.weight.requires_grad_(False)  # no W^Q gradient; dQ still flows to the input
    monitor = Monitor(MonitorConfig(interval=1))
    monitor.attach(model)
    pairs = {i: (layer.chain.u.clone(), layer.chain.v.clone()) for i, layer in enumerate(monitor.layers)}
    spy = _Spy(model, routing.original_sdpa())
    monkeypatch.setattr(routing, "_original_sdpa", spy)
    _micro_batch(model, 5)
    assert all(layer.chain.weight_hook is None for layer in monitor.layers)
    want, mag = _old_definition(spy, pairs)
    monitor.step()
    for i in range(2):
        got = _push_true(monitor, i)
        assert ((got - want[i]).abs() <= 1e-5 * mag[i]).all(), (i, got, want[i])  # FP32 arithmetic
        assert not torch.isnan(got).any() and got.abs().min() > 0
    monkeypatch.undo()
    spy.remove()
    monitor.detach()


def test_step_without_backward_reads_nan_and_leaves_no_hook():
    model = _model()
    monitor = Monitor(MonitorConfig(interval=1))
    monitor.attach(model)
    x, y = sample_batch(DATA, 2, 32, generator=torch.Generator().manual_seed(1))
    model(x, y)  # forward only: the hook is set, no gradient arrives
    assert monitor.layers[0].chain.weight_hook is not None
    monitor.step()
    assert torch.isnan(_push_true(monitor, 0)).all()
    assert all(layer.chain.weight_hook is None for layer in monitor.layers)
    monitor.detach()


def test_weight_hook_outside_a_monitored_step_adds_nothing_and_removes_itself():
    chain = LayerChain(2, 3, 5, "cpu")
    w = torch.randn(6, 5, requires_grad=True)
    active = [True]
    assert chain.watch_weight(w, False, lambda: active[0], lambda kind, exc: pytest.fail(str(exc)))
    assert chain.watch_weight(w, False, lambda: True, None)  # once per step
    active[0] = False
    (w * 2).sum().backward()
    assert chain.weight_hook is None and chain.grad_calls == 0 and torch.equal(chain.push_true, torch.zeros(2, dtype=F64))
    assert torch.equal(w.grad, torch.full((6, 5), 2.0))  # the gradient itself untouched


@pytest.mark.parametrize("transposed", [False, True])
def test_add_weight_grad_is_minus_u_g_v_per_head(transposed):
    """The rows of the parameter's gradient (first H*D rows, of the transpose for Conv1D layouts)."""
    torch.manual_seed(3)
    h, d, c = 2, 3, 5
    chain = LayerChain(h, d, c, "cpu")
    u, v = torch.randn(h, d), torch.randn(h, c)
    chain.set_pair(u, v)
    w = torch.randn(3 * c, c, dtype=F64, requires_grad=True)  # rows: q | k | v (h * d = 6 of 15 rows are W^Q)
    param = w.detach().t().clone().requires_grad_(True) if transposed else w
    assert chain.watch_weight(param, transposed, lambda: True, lambda kind, exc: pytest.fail(str(exc)))
    g = torch.randn(3 * c, c, dtype=F64)
    (param * (g.t() if transposed else g)).sum().backward()
    (param * (g.t() if transposed else g)).sum().backward()  # a second micro-batch adds the same again
    gq = g[: h * d].view(h, d, c)
    want = -2 * torch.einsum("hd,hdc,hc->h", u.double(), gq, v.double())
    assert torch.allclose(chain.push_true, want, rtol=1e-12)
    assert chain.grad_calls == 2


def test_weight_of_unexpected_size_is_not_watched():
    chain = LayerChain(2, 3, 5, "cpu")
    assert not chain.watch_weight(torch.randn(6, 4, requires_grad=True), False, lambda: True, None)
    assert not chain.watch_weight(torch.randn(6, 5), False, lambda: True, None)  # no gradient
    assert not chain.watch_weight(torch.randn(6, 5, requires_grad=True) * 1, False, lambda: True, None)  # not a leaf
    assert chain.weight_hook is None
    assert math.isnan(float(chain.reading(0.9)[1, 0]))


@pytest.mark.timeout(120)
def test_push_true_under_ddp_is_the_mean_of_the_ranks_readings(tmp_path):
    """The hook sees each rank's own contribution (before DDP's all-reduce, also under no_sync);
    the ranks' mean is the push of the gradient DDP applies, the same on every rank."""
    from chain_workers import ddp_push_true_worker
    from distributed_workers import _free_ports, _run_ranks

    _run_ranks(ddp_push_true_worker, (_free_ports(), str(tmp_path)))
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1))
    assert r0["errors"] == r1["errors"] == 0
    assert torch.equal(r0["got"], r1["got"])
    mean = (r0["local"] + r1["local"]) / 2
    tol = 1e-5 * (r0["mag"] + r1["mag"])  # FP32 weight gradients and all-reduce
    assert ((r0["got"] - mean).abs() <= tol).all(), (r0["got"], mean)
    assert ((r0["applied"] - mean).abs() <= tol).all(), (r0["applied"], mean)
    assert (r0["local"] - r1["local"]).abs().max() > 100 * tol.max()  # the ranks' own readings differ


def test_a_loaded_or_new_pair_is_used_from_the_next_call_on():
    """x . v is made once per call from the current v: a pair set or loaded later is not shadowed."""
    torch.manual_seed(4)
    h, d, c = 2, 3, 5
    x, e, pk = torch.randn(1, 4, c), torch.randn(1, h, 4), torch.randn(1, h, 4, d)
    a, b = LayerChain(h, d, c, "cpu"), LayerChain(h, d, c, "cpu")
    a.set_pair(torch.randn(h, d), torch.randn(h, c))
    b.set_pair(torch.randn(h, d), torch.randn(h, c))
    a.add_rows(x, e, pk, 0.5)
    a.reading(0.9)
    a.load_state_dict(b.state_dict())
    a.add_rows(x, e, pk, 0.5)
    b.add_rows(x, e, pk, 0.5)
    assert torch.equal(a.ugv, b.ugv) and torch.equal(a.sketch, b.sketch)


def test_hf_gpt2_conv1d_weight_gradient_columns(monkeypatch):
    """Hugging Face GPT-2 keeps W^Q as the first C columns of a Conv1D weight (C, 3C): the hook
    reads the transposed layout; against the query-gradient definition."""
    transformers = pytest.importorskip("transformers")
    from flashwatch import routing

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, n_positions=16, vocab_size=50,
                                  attn_implementation="sdpa", attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(cfg)
    monitor = Monitor(MonitorConfig(interval=1))
    monitor.attach(model)
    layer = monitor.layers[0]
    assert layer.family == "hf_gpt2" and layer.chain is not None
    u, v = layer.chain.u.double(), layer.chain.v.double()
    xs, qs = [], []
    model.transformer.h[0].attn.register_forward_pre_hook(lambda m, args, kwargs: xs.append(
        (args[0] if args else kwargs["hidden_states"]).detach().clone()), with_kwargs=True)
    real = routing.original_sdpa()

    def spy(q, k, v_, **kw):
        q.retain_grad()
        qs.append(q)
        return real(q, k, v_, **kw)

    monkeypatch.setattr(routing, "_original_sdpa", spy)
    ids = torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(1))
    model(ids, labels=ids).loss.backward()
    assert layer.chain.weight_hook is not None
    (x,), (q,) = xs, qs
    terms = torch.einsum("bhnd,hd->bhn", q.grad.double(), u) * torch.einsum("bnc,hc->bhn", x.double(), v)
    want, mag = -terms.sum(dim=(0, 2)), terms.abs().sum(dim=(0, 2))
    monitor.step()
    got = torch.tensor([monitor.signals()["wq_error_push_true"][(0, h)] for h in range(2)], dtype=F64)
    assert ((got - want).abs() <= 1e-5 * mag).all(), (got, want)
    assert want.abs().min() > 1e-3 * mag.max()
    monkeypatch.undo()
    monitor.detach()



def test_a_parameter_kept_elsewhere_does_not_keep_a_dropped_monitor():
    """W^Q's hook stays on the parameter until the step's reading; a parameter that outlives its
    model (an optimizer's, a compiled graph's cache) must not keep the Monitor and its SDPA
    interception alive."""
    import gc

    import torch.nn.functional as F

    sdpa = F.scaled_dot_product_attention
    model = _model()
    monitor = Monitor(MonitorConfig(interval=1))
    monitor.attach(model)
    x, y = sample_batch(DATA, 2, 32, generator=torch.Generator().manual_seed(1))
    model(x, y)[1].backward()  # a monitored step's backward; its reading never comes
    kept = model.transformer.h[0].attn.c_attn.weight
    assert monitor.layers[0].chain.weight_hook is not None
    del model, monitor
    gc.collect()
    assert F.scaled_dot_product_attention is sdpa, "the dropped Monitor still intercepts SDPA"
    assert kept.grad is not None
