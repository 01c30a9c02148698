"""The W^Q-gradient error chain against a float64 computation from recorded q, k, v, O, dO and X."""

from __future__ import annotations

import math
import weakref

import pytest
import torch

from flashwatch import Monitor, MonitorConfig
from flashwatch.chain import SKETCH_DIM, LayerChain, top_pair
from flashwatch.signals import spectral_norm_exact
from flashwatch.tinygpt import GPT, GPTConfig, sample_batch, stdlib_corpus

DATA = stdlib_corpus(100_000)
F64 = torch.float64


def _record(model: GPT, real):
    """Per layer: the attention module's input X, and q, k, v, O of its SDPA call (grads kept)."""
    rec = {i: {} for i in range(len(model.transformer.h))}
    handles = []
    for i, block in enumerate(model.transformer.h):
        def pre(module, args, i=i):
            rec[i]["x"] = args[0].detach().clone()
        handles.append(block.attn.register_forward_pre_hook(pre))
    calls = []

    def spy(q, k, v, **kw):
        out = real(q, k, v, **kw)
        q.retain_grad()
        out.retain_grad()
        calls.append((q, k, v, out))
        return out

    return rec, handles, spy, calls


def _train_one_monitored_step(model, monitor, handles, dtype, seed: int) -> dict:
    """One autocast forward and backward, the recording hooks removed, the step monitored: the snapshot."""
    x, y = sample_batch(DATA, 3, 32, generator=torch.Generator().manual_seed(seed))
    with torch.autocast("cpu", dtype=dtype):
        loss = model(x, y)[1]
    loss.backward()
    for h in handles:
        h.remove()
    monitor.step(loss=loss.detach())
    return monitor.snapshot()


def _expected(x, q, k, v, out, dout, dq, u, vv):
    """float64: delta_used from the rounded output, delta_hp from the exact softmax, the error's
    push -u^T dG v, the true gradient's push -u^T (dQ^T X) v and the sketch-free dG."""
    qd, kd, vd, od, dod, xd = (t.to(F64) for t in (q, k, v, out, dout, x))
    s = q.shape[-1] ** -0.5
    n = q.shape[2]
    scores = s * qd @ kd.transpose(-1, -2)
    mask = torch.ones(n, n, dtype=torch.bool).tril()
    p = torch.softmax(scores.masked_fill(~mask, -math.inf), dim=-1)
    delta_used = (dod * od).sum(-1)
    delta_hp = (p * (dod @ vd.transpose(-1, -2))).sum(-1)
    dq_err = -s * (delta_used - delta_hp)[..., None] * (p @ kd)  # (B, H, N, D)
    dg = torch.einsum("bhnd,bnc->hdc", dq_err, xd)  # (H, D, C)
    push = -torch.einsum("hd,hdc,hc->h", u.to(F64), dg, vv.to(F64))
    g_true = torch.einsum("bhnd,bnc->hdc", dq.to(F64), xd)
    push_true = -torch.einsum("hd,hdc,hc->h", u.to(F64), g_true, vv.to(F64))
    return push, push_true, dg


@pytest.mark.parametrize("dtype", [torch.bfloat16])
def test_chain_readings_match_float64_in_observe_mode(dtype, monkeypatch):
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=4, n_embd=64, block_size=32))
    monitor = Monitor(MonitorConfig(interval=1, mode="observe"))
    monitor.attach(model)
    pairs = {i: (layer.chain.u.clone(), layer.chain.v.clone()) for i, layer in enumerate(monitor.layers)}
    from flashwatch import routing

    rec, handles, spy, calls = _record(model, routing.original_sdpa())
    monkeypatch.setattr(routing, "_original_sdpa", spy)
    snap = _train_one_monitored_step(model, monitor, handles, dtype, seed=1)
    assert len(calls) == 2
    for i, (q, k, v, out) in enumerate(calls):
        u, vv = pairs[i]
        # X as the query projection computes with it: rounded to autocast's dtype
        push, push_true, _ = _expected(rec[i]["x"].to(dtype), q.detach(), k.detach(), v.detach(), out.detach(),
                                       out.grad, q.grad, u, vv)
        got = torch.tensor([snap["flashwatch_wq_error_push"][(i, h)] for h in range(4)], dtype=F64)
        got_true = torch.tensor([snap["flashwatch_wq_error_push_cumulative"][(i, h)] for h in range(4)], dtype=F64)
        assert torch.allclose(got, push, rtol=2e-3, atol=1e-12 + 2e-3 * push.abs().max()), (i, got, push)
        assert torch.equal(got, got_true)  # one monitored step: the cumulative push is this step's
        # push_true is read from W^Q's gradient, which autocast forms in BF16 (the gradient the
        # optimizer applies); the float64 dQ^T X from the BF16 dQ differs from it by that rounding
        g = model.transformer.h[i].attn.c_attn.weight.grad[:64].view(4, 16, 64).to(F64)
        push_true_w = -torch.einsum("hd,hdc,hc->h", u.to(F64), g, vv.to(F64))
        assert torch.allclose(push_true_w, push_true, rtol=0.05, atol=0.05 * push_true.abs().max())
        share = torch.tensor([snap["flashwatch_wq_error_push_share"][(i, h)] for h in range(4)], dtype=F64)
        # the share is the push over |push_true|: its error is the push's (checked above) over |push_true|
        assert torch.allclose(share * push_true_w.abs(), push, rtol=5e-3, atol=1e-12 + 2e-3 * push.abs().max())
        assert push.abs().max() > 0  # BF16 rounding leaves a measurable error to compare
    monkeypatch.undo()  # the spy out first, so detach gives torch's own SDPA back
    monitor.detach()


def test_alignment_and_coherence_follow_the_direction_of_the_error():
    """One fixed dG -> alignment 1, coherence 1; independent random dG -> alignment ~ N(0, 1/r), low coherence."""
    torch.manual_seed(0)
    h, d, c, b, n = 2, 8, 16, 2, 5

    def drive(chain, fixed: bool, steps: int, lam: float):
        g = torch.Generator().manual_seed(3)
        x = torch.randn(b, n, c, generator=g)
        e = torch.randn(b, h, n, generator=g)
        pk = torch.randn(b, h, n, d, generator=g)
        out = []
        for _ in range(steps):
            if not fixed:
                x = torch.randn(b, n, c, generator=g)
                e = torch.randn(b, h, n, generator=g)
                pk = torch.randn(b, h, n, d, generator=g)
            chain.add_rows(x, e, pk, 0.5)
            out.append(chain.reading(lam))
        return torch.stack(out)  # (steps, 4, H)

    lam = 1 - 1 / 50
    fixed = drive(LayerChain(h, d, c, "cpu"), True, 10, lam)
    assert torch.isnan(fixed[0, 2]).all()  # no previous step yet
    assert torch.allclose(fixed[1:, 2], torch.ones(9, h, dtype=F64), atol=1e-6)
    assert torch.isnan(fixed[0, 3]).all()  # one sample: 1 by definition, so not a reading
    assert torch.allclose(fixed[1:, 3], torch.ones(9, h, dtype=F64), atol=1e-6)
    # a first step whose error is exactly zero is no sample: head 1 reads no coherence until its second
    chain = LayerChain(h, d, c, "cpu")
    g = torch.Generator().manual_seed(4)
    x, pk = torch.randn(b, n, c, generator=g), torch.randn(b, h, n, d, generator=g)
    e = torch.randn(b, h, n, generator=g)
    chain.add_rows(x, e * torch.tensor([1.0, 0.0])[:, None], pk, 0.5)
    chain.reading(lam)
    chain.add_rows(x, torch.randn(b, h, n, generator=g), pk, 0.5)
    second = chain.reading(lam)[3]
    assert not torch.isnan(second[0]) and torch.isnan(second[1])
    # nor does a step whose error is exactly zero read the window of one earlier sample (head 1: 1 by definition)
    chain.add_rows(x, torch.zeros(b, h, n), pk, 0.5)
    assert torch.isnan(chain.reading(lam)[3]).all()
    rand = drive(LayerChain(h, d, c, "cpu"), False, 400, lam)
    align = rand[1:, 2].flatten()
    assert align.abs().mean() < 0.2  # random directions: near 0 (sketch noise ~ 1/sqrt(r))
    assert rand[-1, 3].max() < 0.35  # ~ sqrt((1 - lam) / (1 + lam)) = 0.1, plus sketch noise
    assert SKETCH_DIM >= 32


def test_tensor_parallel_chains_combine_to_the_data_parallel_chain():
    """Two data-parallel replicas, each split into two tensor-parallel ranks of 2 of 4 heads: the
    ranks' ``flat()`` summed (as the all-reduce does) and each head divided by its owners (2
    replicas) give every rank its heads' readings of the replicas' mean error (one chain fed both
    replicas' rows at half weight: the sums are linear in the rows), over several steps of window
    state; a saved state of every head resumes a rank."""
    h, d, c, b, n, lam = 4, 8, 16, 2, 5, 1 - 1 / 5
    g = torch.Generator().manual_seed(7)
    u, v = torch.randn(h, d, generator=g), torch.randn(h, c, generator=g)
    mean = LayerChain(h, d, c, "cpu")
    split = [[LayerChain(2, d, c, "cpu", head_offset=o, total_heads=h) for o in (0, 2)] for _ in range(2)]
    mean.set_pair(u, v)
    for ranks in split:
        for o, chain in zip((0, 2), ranks):
            chain.set_pair(u[o: o + 2], v[o: o + 2])
    for step in range(4):
        for r in range(2):
            x = torch.randn(b, n, c, generator=g)
            e, pk = torch.randn(b, h, n, generator=g), torch.randn(b, h, n, d, generator=g)
            mean.add_rows(x, e / 2, pk, 0.5)
            for o, chain in zip((0, 2), split[r]):
                chain.add_rows(x, e[:, o: o + 2], pk[:, o: o + 2], 0.5)
        tp = sum(chain.flat() for ranks in split for chain in ranks)
        for ranks in split:
            for chain in ranks:
                chain.set_flat(tp.clone(), torch.full((h,), 2.0, dtype=F64))
        expected = mean.reading(lam)
        for ranks in split:
            got = torch.cat([chain.reading(lam) for chain in ranks], dim=1)
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=0, equal_nan=True)
            assert torch.isfinite(got[0]).all() and bool(torch.isfinite(got[3]).all()) == (step > 0)
    saved = mean.state_dict()
    resumed = LayerChain(2, d, c, "cpu", head_offset=2, total_heads=h)
    resumed.load_state_dict(saved)
    for key, t in resumed.state_dict().items():
        assert torch.equal(t, saved[key][2:4]), key
    with pytest.raises(ValueError, match="do not fit a layer of 4 heads"):
        LayerChain(2, d, c, "cpu", head_offset=3, total_heads=h)


def test_sketch_estimates_inner_products_of_the_error_matrices():
    """<dG Omega, dG' Omega> estimates <dG, dG'>: the cosine of two recorded errors within sketch noise."""
    torch.manual_seed(1)
    h, d, c = 1, 8, 256
    chain = LayerChain(h, d, c, "cpu")
    a = torch.randn(h, d, c, dtype=F64)
    bmat = 0.8 * a + 0.6 * torch.randn(h, d, c, dtype=F64)
    true_cos = (a * bmat).sum() / (a.norm() * bmat.norm())
    om = chain.omega.to(F64)
    sa, sb = a @ om, bmat @ om
    est = (sa * sb).sum() / (sa.norm() * sb.norm())
    assert abs(float(est - true_cos)) < 4 / math.sqrt(SKETCH_DIM)


def test_top_pair_is_the_top_singular_pair():
    torch.manual_seed(2)
    w = torch.randn(3, 16, 48)
    from flashwatch.signals import PowerIteration

    power = PowerIteration(w, block=4, seed="svd")
    u, v = top_pair(w, power.v)
    sigma = spectral_norm_exact(w)
    got = torch.einsum("nd,ndc,nc->n", u, w, v)
    assert torch.allclose(got.abs(), sigma, rtol=1e-4)


def _llama(layers: int = 2):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=100,
                                   attn_implementation="sdpa")
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def _spy_on_sdpa(monkeypatch) -> list:
    """SDPA as the router calls it, keeping q's and the output's gradients: the list it returns
    fills with each call's (q, k, v, out)."""
    from flashwatch import routing

    calls, real = [], routing.original_sdpa()

    def spy(q, k, v, *args, **kw):
        q.retain_grad()
        out = real(q, k, v, *args, **kw)
        out.retain_grad()
        calls.append((q, k, v, out))
        return out

    monkeypatch.setattr(routing, "_original_sdpa", spy)
    return calls


def _unrotate64(g, cos, sin):
    """float64 transpose of Hugging Face's RoPE (q cos + rotate_half(q) sin) applied to a gradient g
    (B, H, N, D), written as the explicit matrix J = diag(cos) + diag(sin) M, M = rotate_half."""
    d = g.shape[-1]
    m = torch.zeros(d, d, dtype=F64)
    m[: d // 2, d // 2:] = -torch.eye(d // 2, dtype=F64)  # rotate_half(q) = [-q2, q1] = M q
    m[d // 2:, : d // 2] = torch.eye(d // 2, dtype=F64)
    cos, sin = cos.to(F64)[:, None, :, :], sin.to(F64)[:, None, :, :]  # (B, 1, N, D)
    # J^T g = cos g + M^T (sin g)
    return cos * g + (sin * g) @ m


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("mode", ["observe", "own_kernel"])
def test_rotary_queries_chain_matches_float64(mode, device, monkeypatch):
    """Llama-style attention (RoPE, grouped-query): the error rows are turned back through the
    call's rotation before they meet X; push and the true gradient's push match a float64
    computation from the recorded q, k, v, O, dO, X and (cos, sin). Fail before: NaN. On CUDA the
    rows come from the Triton kernels (stored, then turned back)."""
    model = _llama().to(device)
    monitor = Monitor(MonitorConfig(interval=1, mode=mode, async_transfer=False))
    monitor.attach(model)
    assert all(layer.chain is not None and layer.rotary for layer in monitor.layers)
    pairs = {i: (layer.chain.u.cpu().clone(), layer.chain.v.cpu().clone()) for i, layer in enumerate(monitor.layers)}
    rec, handles = {}, []
    for i, layer in enumerate(model.model.layers):
        def pre(module, args, kwargs, i=i):
            cos, sin = kwargs["position_embeddings"]
            rec[i] = {"x": kwargs["hidden_states"].detach().clone().cpu(), "cos": cos.detach().clone().cpu(),
                      "sin": sin.detach().clone().cpu()}
        handles.append(layer.self_attn.register_forward_pre_hook(pre, with_kwargs=True))
    calls = _spy_on_sdpa(monkeypatch)
    ids = torch.randint(0, 100, (3, 24), generator=torch.Generator().manual_seed(1)).to(device)
    with torch.autocast(device, dtype=torch.bfloat16):
        loss = model(ids, labels=ids).loss
    loss.backward()
    for h in handles:
        h.remove()
    monitor.step(loss=loss.detach())
    snap = monitor.snapshot()
    if mode == "own_kernel":  # the kernel runs the attention: its inputs are recorded by the rows, not the spy
        assert not calls
        assert all(not math.isnan(snap["flashwatch_wq_error_push"][(i, h)]) for i in range(2) for h in range(4))
    for i, recorded in enumerate(calls):
        qgrad, ograd = recorded[0].grad.cpu(), recorded[3].grad.cpu()
        q, k, v, out = (t.detach().cpu() for t in recorded)
        u, vv = pairs[i]
        rep = q.shape[1] // k.shape[1]
        # the rotated q, k are FP32 (cos, sin are); autocast rounds them inside SDPA, and the
        # statistics take them as the kernel did: in the output's dtype
        qb = q.detach().to(out.dtype)
        kd, vd = (t.detach().to(out.dtype).repeat_interleave(rep, dim=1) for t in (k, v))
        push, _, dg_rot = _expected(rec[i]["x"].to(torch.bfloat16), qb, kd, vd, out, ograd, qgrad, u, vv)
        # _expected maps the rotated rows straight onto X; turn them back first, as the chain must
        s = q.shape[-1] ** -0.5
        qd, kd64, vd64, od, dod = (t.to(F64) for t in (qb, kd, vd, out, ograd))
        n = q.shape[2]
        p = torch.softmax((s * qd @ kd64.transpose(-1, -2)).masked_fill(
            ~torch.ones(n, n, dtype=torch.bool).tril(), -math.inf), dim=-1)
        err = (dod * od).sum(-1) - (p * (dod @ vd64.transpose(-1, -2))).sum(-1)
        dq_err = _unrotate64(-s * err[..., None] * (p @ kd64), rec[i]["cos"], rec[i]["sin"])
        dg = torch.einsum("bhnd,bnc->hdc", dq_err, rec[i]["x"].to(torch.bfloat16).to(F64))
        push = -torch.einsum("hd,hdc,hc->h", u.to(F64), dg, vv.to(F64))
        got = torch.tensor([snap["flashwatch_wq_error_push"][(i, h)] for h in range(4)], dtype=F64)
        assert torch.allclose(got, push, rtol=2e-3, atol=1e-12 + 2e-3 * push.abs().max()), (i, got, push)
        # without turning the rows back the reading would differ: the test can tell
        push_rot = -torch.einsum("hd,hdc,hc->h", u.to(F64), dg_rot, vv.to(F64))
        assert not torch.allclose(push_rot, push, rtol=2e-3, atol=2e-3 * push.abs().max())
        # the true gradient's push from W^Q's own gradient equals the float64 one from dQ turned back
        g = model.model.layers[i].self_attn.q_proj.weight.grad.cpu().view(4, 16, 64).to(F64)
        push_true_w = -torch.einsum("hd,hdc,hc->h", u.to(F64), g, vv.to(F64))
        g64 = torch.einsum("bhnd,bnc->hdc", _unrotate64(qgrad.to(F64), rec[i]["cos"], rec[i]["sin"]),
                           rec[i]["x"].to(torch.bfloat16).to(F64))
        push_true = -torch.einsum("hd,hdc,hc->h", u.to(F64), g64, vv.to(F64))
        assert torch.allclose(push_true_w, push_true, rtol=0.05, atol=0.05 * push_true.abs().max())
        share = torch.tensor([snap["flashwatch_wq_error_push_share"][(i, h)] for h in range(4)], dtype=F64)
        # the share is the push over |push_true|: its error is the push's (checked above) over |push_true|
        assert torch.allclose(share * push_true_w.abs(), push, rtol=5e-3, atol=1e-12 + 2e-3 * push.abs().max())
    if mode == "observe":
        assert len(calls) == 2
    monkeypatch.undo()
    monitor.detach()


def test_a_rotary_call_without_its_rotation_reads_nan(caplog):
    """A rotary layer called without position_embeddings: its W^Q-error metrics read NaN (not
    measured, not 0), the other statistics are measured, and the log says why once."""
    model = _llama(layers=1)
    monitor = Monitor(MonitorConfig(interval=1))
    monitor.attach(model)
    attn = model.model.layers[0].self_attn
    real_forward = attn.forward
    # a model whose attention takes its rotation under another name (rope=), renamed before
    # flashwatch's hook sees the call
    attn.forward = lambda hidden_states, rope=None, **kw: real_forward(hidden_states, position_embeddings=rope, **kw)
    attn.register_forward_pre_hook(
        lambda m, args, kwargs: (args, {**{k: v for k, v in kwargs.items() if k != "position_embeddings"},
                                        "rope": kwargs["position_embeddings"]}), with_kwargs=True, prepend=True)
    ids = torch.randint(0, 100, (2, 16))
    with caplog.at_level("WARNING", logger="flashwatch"):
        model(ids, labels=ids).loss.backward()
    assert sum("need the call's position_embeddings" in r.getMessage() for r in caplog.records) == 1
    monitor.step()
    snap = monitor.snapshot()
    assert all(math.isnan(v) for v in snap["flashwatch_wq_error_push"].values())
    assert not math.isnan(snap["flashwatch_max_logit"][(0, 0)])
    monitor.detach()


class _UnrotatedLlamaAttention(torch.nn.Module):
    """Llama's module layout (q_proj, k_proj, v_proj, o_proj, num_heads, head_dim) without RoPE: its
    forward takes no position_embeddings, so its queries are the projection's output as is."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (torch.nn.Linear(width, width, bias=False)
                                                              for _ in range(4))
        self.num_heads, self.head_dim = heads, width // heads

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


def test_a_llama_layout_without_rotary_is_measured_unrotated(monkeypatch, caplog):
    """A module with Llama's layout whose forward takes no rotation (torchtitan-style toy models,
    benchmarks/sharded_check.py) is not rotary: its W^Q-gradient error is measured, equal to the
    float64 one from the recorded call, with no note about a missing rotation. Fail before: NaN."""
    torch.manual_seed(0)
    attn = torch.nn.ModuleList([_UnrotatedLlamaAttention(64, 4)])
    monitor = Monitor(MonitorConfig(interval=1, async_transfer=False))
    monitor.attach(attn)
    layer = monitor.layers[0]
    assert layer.family == "hf_llama" and not layer.rotary and layer.chain is not None
    u, vv = layer.chain.u.clone(), layer.chain.v.clone()
    calls = _spy_on_sdpa(monkeypatch)
    x = torch.randn(3, 24, 64, generator=torch.Generator().manual_seed(1))
    with caplog.at_level("WARNING", logger="flashwatch"), torch.autocast("cpu", dtype=torch.bfloat16):
        y = attn[0](x)
    y.float().square().mean().backward()
    monitor.step()
    snap = monitor.snapshot()
    assert not any("position_embeddings" in r.getMessage() for r in caplog.records)
    (q, k, v, out), = calls
    push, _, _ = _expected(x.to(torch.bfloat16), q.detach(), k.detach(), v.detach(), out.detach(), out.grad,
                           q.grad, u, vv)
    got = torch.tensor([snap["flashwatch_wq_error_push"][(0, h)] for h in range(4)], dtype=F64)
    assert torch.allclose(got, push, rtol=2e-3, atol=1e-12 + 2e-3 * push.abs().max()), (got, push)
    assert push.abs().max() > 0
    monkeypatch.undo()
    monitor.detach()


def test_a_llama_layout_that_could_take_a_rotation_unnamed_counts_as_rotary():
    """A forward that takes ``*args``/``**kwargs`` could be handed a rotation: flashwatch cannot tell, so
    it counts the layer as rotary (NaN with a note where no rotation comes, never an unrotated error)."""
    from flashwatch.attach import _rotates_queries

    class Wrapped(_UnrotatedLlamaAttention):
        def forward(self, x, **kwargs):
            return super().forward(x)

    assert not _rotates_queries(_UnrotatedLlamaAttention(64, 4))
    assert _rotates_queries(Wrapped(64, 4))
    held = _UnrotatedLlamaAttention(64, 4)
    held.rotary_emb = torch.nn.Identity()  # Hugging Face's Llama before position_embeddings
    assert _rotates_queries(held)


def test_chain_readings_match_float64_in_own_kernel_mode(monkeypatch):
    """Own-kernel mode: the rows come from the kernel's backward (one hook per call, in reverse order)."""
    import flashwatch.kernels as kernels

    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=4, n_embd=64, block_size=32))
    monitor = Monitor(MonitorConfig(interval=1, mode="own_kernel"))
    monitor.attach(model)
    pairs = {i: (layer.chain.u.clone(), layer.chain.v.clone()) for i, layer in enumerate(monitor.layers)}
    real = kernels.flash_attention
    calls = []

    def spy(q, k, v, **kw):
        out = real(q, k, v, **kw)
        out.retain_grad()
        calls.append((q, k, v, out))
        return out

    monkeypatch.setattr(kernels, "flash_attention", spy)
    rec, handles, _, _ = _record(model, None)
    snap = _train_one_monitored_step(model, monitor, handles, torch.bfloat16, seed=2)
    assert len(calls) == 2
    for i, (q, k, v, out) in enumerate(calls):
        u, vv = pairs[i]
        qd = q.detach().to(F64).requires_grad_(True)
        s = q.shape[-1] ** -0.5
        n = q.shape[2]
        scores_ = s * qd @ k.detach().to(F64).transpose(-1, -2)
        p = torch.softmax(scores_.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), -math.inf), -1)
        (p @ v.detach().to(F64)).backward(out.grad.to(F64))
        push, push_true, _ = _expected(rec[i]["x"].to(torch.bfloat16), q.detach(), k.detach(), v.detach(),
                                       out.detach(), out.grad, qd.grad, u, vv)
        got = torch.tensor([snap["flashwatch_wq_error_push"][(i, h)] for h in range(4)], dtype=F64)
        true = torch.tensor([monitor.signals()["wq_error_push_true"][(i, h)] for h in range(4)], dtype=F64)
        assert torch.allclose(got, push, rtol=2e-3, atol=2e-3 * push.abs().max()), (i, got, push)
        # the kernel's dQ carries the BF16 rounding of delta; the float64 one does not: close, not equal
        assert torch.allclose(true, push_true, rtol=0.05, atol=0.05 * push_true.abs().max())
        assert push.abs().max() > 0
    monitor.detach()


def test_eager_unmonitored_steps_take_no_copy_of_the_projection_input(monkeypatch):
    """Eager mode takes X (cast to autocast's dtype: a copy) for the chain on monitored steps only;
    an unmonitored step's forward makes none."""
    from flashwatch import routing

    taken = []
    real = routing._as_projected
    monkeypatch.setattr(routing, "_as_projected", lambda x: taken.append(1) or real(x))
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=4, n_embd=64, block_size=32))
    monitor = Monitor(MonitorConfig(interval=2))
    monitor.attach(model)
    per_step = []
    for step in range(4):
        x, y = sample_batch(DATA, 2, 32, generator=torch.Generator().manual_seed(step))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x, y)[1]
        loss.backward()
        per_step.append((monitor.monitoring, len(taken)))
        taken.clear()
        monitor.step(loss=loss.detach())
    assert per_step == [(True, 2), (False, 0), (True, 2), (False, 0)]
    monitor.detach()


def test_only_a_rotation_of_the_calls_shape_is_read():
    """check_rotation takes (cos, sin) of (B or 1, N, D) for the call's X (B, N, C) and head dim D;
    complex frequencies, a rotation of part of the head, another batch or positions: None."""
    from flashwatch.chain import check_rotation

    x = torch.zeros(3, 5, 8)
    cos, sin = torch.randn(3, 5, 4), torch.randn(3, 5, 4)
    assert check_rotation((cos, sin), x, 4) is not None
    assert check_rotation((cos[:1], sin[:1]), x, 4) is not None  # one rotation for every sequence
    assert check_rotation(torch.polar(torch.ones(3, 5, 2), torch.zeros(3, 5, 2)), x, 4) is None
    assert check_rotation((torch.randn(3, 5, 2), torch.randn(3, 5, 2)), x, 4) is None  # part of the head
    assert check_rotation((torch.randn(2, 5, 4), torch.randn(2, 5, 4)), x, 4) is None  # another batch
    assert check_rotation((torch.randn(3, 6, 4), torch.randn(3, 6, 4)), x, 4) is None  # other positions
    assert check_rotation((cos, sin), x, 3) is None and check_rotation(None, x, 4) is None
    c64 = torch.complex(cos, sin)
    assert check_rotation((c64, c64), x, 4) is None


def test_unrotate_inverts_hugging_faces_rotary_embedding():
    """RoPE turns each pair of a row by an angle, so its transpose turns it back: unrotate of a
    rotated row is the row (float64, random angles, half-split layout as Hugging Face's)."""
    from flashwatch.chain import unrotate

    g = torch.Generator().manual_seed(5)
    b, h, n, d = 2, 3, 7, 8
    angles = torch.rand(b, n, d // 2, generator=g, dtype=F64) * 2 * math.pi
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)  # (B, N, D), halves repeated
    q = torch.randn(b, h, n, d, generator=g, dtype=F64)
    half = d // 2
    rotated = q * cos[:, None] + torch.cat([-q[..., half:], q[..., :half]], -1) * sin[:, None]
    assert torch.allclose(unrotate(rotated, (cos, sin)).double(), q, atol=1e-6)  # unrotate computes in float32
    assert not torch.allclose(rotated, q, atol=1e-3)


def test_the_pair_from_the_products_is_the_pair_from_the_weight():
    """Where W is held in pieces (FSDP), the pair comes from y = W V and V alone: the same unit
    vectors as top_pair from W (up to a shared sign), and W v = sigma u."""
    from flashwatch.chain import pair_from_products
    from flashwatch.signals import PowerIteration

    torch.manual_seed(4)
    w = torch.randn(3, 16, 48)
    v_block = PowerIteration(w, block=4, seed="svd").v
    u1, v1 = top_pair(w, v_block)
    u2, v2 = pair_from_products(w @ v_block, v_block)
    sign = torch.sign((v1 * v2).sum(1, keepdim=True))
    assert torch.allclose(v2 * sign, v1, atol=1e-5) and torch.allclose(u2 * sign, u1, atol=1e-5)
    sigma = spectral_norm_exact(w)
    assert torch.allclose(torch.einsum("nd,ndc,nc->n", u2, w, v2).abs(), sigma, rtol=1e-4)


def test_a_query_behind_qk_norm_has_no_w_q_error_reading(caplog):
    """Qwen3-style attention normalises the query after its projection (q_norm): the query the
    attention sees is not W^Q x, so the W^Q-gradient error is not defined there. It reads NaN with a
    note at attach (it used to be computed as if the norm were not there); every other statistic is
    measured."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "Qwen3Config"):
        pytest.skip("this transformers has no Qwen3")
    cfg = transformers.Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=16, vocab_size=100, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(cfg)
    monitor = Monitor(MonitorConfig(interval=1))
    with caplog.at_level("WARNING", logger="flashwatch"):
        monitor.attach(model)
    assert [layer.family for layer in monitor.layers] == ["hf_llama"] * 2
    assert all(layer.chain is None for layer in monitor.layers)
    assert sum("q_norm (QK-norm)" in r.getMessage() for r in caplog.records) == 2
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(ids, labels=ids).loss
    loss.backward()
    monitor.step(loss=loss.detach())
    snap = monitor.snapshot()
    assert all(math.isnan(v) for v in snap["flashwatch_wq_error_push"].values())
    assert all(math.isfinite(v) for v in snap["flashwatch_max_logit"].values())
    assert all(math.isfinite(v) for v in snap["flashwatch_wq_spectral_norm"].values())
    monitor.detach()
    # the structural test itself: Llama's attention has no query norm
    from flashwatch.families import query_norm

    assert query_norm(_llama(layers=1).model.layers[0].self_attn) is None
    assert query_norm(model.model.layers[0].self_attn) == "q_norm"


@pytest.mark.parametrize("change", ["rms_norm", "scale"])
def test_a_query_changed_by_plain_code_reads_nan(change, caplog):
    """A query normalised or scaled by function calls between its projection and the attention (no
    module to see at attach) is caught at the first monitored call: the query SDPA receives is
    compared with W^Q X once; it is not, so the W^Q-error metrics read NaN, with one note, and
    every other statistic is measured. The unchanged module passes the same comparison."""
    import torch.nn.functional as F

    class Changed(_UnrotatedLlamaAttention):
        def forward(self, x):
            b, t, _ = x.shape
            q, k, v = (p(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
                       for p in (self.q_proj, self.k_proj, self.v_proj))
            q = F.rms_norm(q, (self.head_dim,)) if change == "rms_norm" else q * 0.5
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))

    torch.manual_seed(0)
    model = torch.nn.ModuleList([Changed(64, 4), _UnrotatedLlamaAttention(64, 4)])
    monitor = Monitor(MonitorConfig(interval=1, async_transfer=False))
    monitor.attach(model)
    x = torch.randn(3, 24, 64, generator=torch.Generator().manual_seed(1))
    for step in range(2):
        with caplog.at_level("WARNING", logger="flashwatch"), torch.autocast("cpu", dtype=torch.bfloat16):
            y = model[1](model[0](x))
        y.float().square().mean().backward()
        monitor.step()
    changed, plain = monitor.layers
    assert changed.query_checked and changed.query_mismatch
    assert plain.query_checked and not plain.query_mismatch
    assert sum("is not W^Q x" in r.getMessage() for r in caplog.records) == 1
    snap = monitor.snapshot()
    for name in ("flashwatch_wq_error_push", "flashwatch_wq_error_push_share", "flashwatch_wq_error_coherence"):
        assert all(math.isnan(snap[name][(0, h)]) for h in range(4)), name
    assert all(math.isfinite(snap["flashwatch_wq_error_push"][(1, h)]) for h in range(4))
    assert all(math.isfinite(snap["flashwatch_max_logit"][(0, h)]) for h in range(4))
    monitor.detach()


def test_a_non_finite_first_call_does_not_decide_the_query_is_changed(caplog):
    """A NaN in W^Q at a layer's first monitored call (a bad batch, then repaired): the comparison
    of the query with W^Q X tells nothing and runs again at the next monitored call, so the chain
    is measured from then on. Fail before: the NaN residual was taken for a changed query (a
    QK-norm, a scale) and every later W^Q-error reading was NaN."""
    import logging

    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=4, n_embd=64, block_size=32))
    monitor = Monitor(MonitorConfig(interval=1))
    monitor.attach(model)
    weight = model.transformer.h[0].attn.c_attn.weight
    kept = float(weight[0, 0])
    with caplog.at_level(logging.INFO, logger="flashwatch"):
        for step in range(3):
            with torch.no_grad():
                weight[0, 0] = math.nan if step == 0 else kept
            x, y = sample_batch(DATA, 2, 32, generator=torch.Generator().manual_seed(step))
            model(x, y)[1].backward()
            model.zero_grad()
            monitor.step()
    push = monitor.snapshot()["flashwatch_wq_error_push"]
    assert all(math.isfinite(push[(layer, h)]) for layer in (0, 1) for h in range(4)), push
    assert not any("is not W^Q x" in r.getMessage() for r in caplog.records)
    assert any("is not finite at this monitored call" in r.getMessage() for r in caplog.records)
    monitor.detach()


def test_query_residual_against_exact_constructions():
    """chain.query_residual on queries built from W^Q x exactly (float64 inputs): a bias is a
    constant residual (0), a query rotated by Hugging Face's RoPE reads 0 when the rotation is given
    and not when it is not, a scale c reads |1 - c| exactly, a per-row norm reads far above the
    tolerance."""
    from flashwatch.chain import QUERY_TOLERANCE, query_residual

    g = torch.Generator().manual_seed(0)
    b_, n, h, d, c = 2, 12, 3, 8, 16
    x = torch.randn(b_, n, c, generator=g, dtype=F64)
    w = torch.randn(h, d, c, generator=g, dtype=F64)
    bias = torch.randn(1, h, 1, d, generator=g, dtype=F64)
    lin = torch.einsum("bnc,hdc->bhnd", x, w)
    assert query_residual(lin + bias, x, w) < 1e-6
    assert query_residual(0.5 * lin, x, w) == pytest.approx(0.5, rel=1e-6)
    normed = (lin + bias) / (lin + bias).norm(dim=-1, keepdim=True)
    assert query_residual(normed, x, w) > 10 * QUERY_TOLERANCE
    # RoPE as Hugging Face applies it: q cos + rotate_half(q) sin, rotate_half(q) = [-q2, q1]
    angle = torch.rand(1, n, d // 2, generator=g, dtype=F64) * 6.3
    cos, sin = torch.cat([angle.cos()] * 2, -1), torch.cat([angle.sin()] * 2, -1)
    q = lin + bias
    rotated = q * cos[:, None] + torch.cat([-q[..., d // 2:], q[..., : d // 2]], -1) * sin[:, None]
    assert query_residual(rotated, x, w, (cos, sin)) < 1e-6
    assert query_residual(rotated, x, w) > 10 * QUERY_TOLERANCE


def test_a_bias_dominated_bf16_query_is_still_w_q_x():
    """A BF16 query W^Q x + b whose bias is 100 times its spread over tokens (seen when training at a
    large learning rate) carries rounding of |b| 2^-9, a tenth of the spread: within the query's own
    rounding, so still W^Q x. A scale or a per-row norm of such a query still reads as not W^Q x."""
    from flashwatch.chain import QUERY_TOLERANCE, query_residual

    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 12, 16, generator=g).bfloat16()
    w = torch.randn(3, 8, 16, generator=g)
    lin = torch.einsum("bnc,hdc->bhnd", x.float(), w)
    spread = (lin - lin.mean(dim=(0, 2), keepdim=True)).norm() / lin.numel() ** 0.5
    bias = 100 * spread * torch.randn(1, 3, 1, 8, generator=g).sign()
    q = (lin + bias).bfloat16()
    r = q.float() - lin
    r = r - r.mean(dim=(0, 2), keepdim=True)
    assert r.norm() / (lin - lin.mean(dim=(0, 2), keepdim=True)).norm() > QUERY_TOLERANCE  # the old test failed here
    assert query_residual(q, x, w) == 0.0
    assert query_residual((2 * lin + bias).bfloat16(), x, w) > QUERY_TOLERANCE
    normed = (lin + bias) / (lin + bias).norm(dim=-1, keepdim=True)
    assert query_residual(normed.bfloat16(), x, w) > QUERY_TOLERANCE


def _factor_case(device: str, split: int | None = None):
    """A BF16 activation x (B, N, C) and a float32 factor m (C, H + r) shaped like the chain's;
    with ``split``, m's columns from ``split`` on exact in BF16 (as the chain's Omega is)."""
    g = torch.Generator().manual_seed(11)
    x = (torch.randn(3, 50, 96, generator=g) * 3).to(torch.bfloat16).to(device)
    m = torch.cat([torch.randn(96, 4, generator=g) / 96 ** 0.5, torch.randn(96, SKETCH_DIM, generator=g) / 8], 1)
    if split is not None:
        m[:, split:] = m[:, split:].to(torch.bfloat16).float()
    return x, m.to(device)


def _times(factor, x, h=4):
    """The factor's product as ``LayerChain._project`` takes it, checked for its layouts (views of one
    product, as the kernels read them: ``RowReduction.layout``), put back together as x @ m (B, N, k)."""
    from flashwatch.kernels.stats import RowReduction

    p = factor.times(x, h)
    B, N = x.shape[:2]
    r = factor.k - h
    for t, lo, shape in ((p.xv, p.xv_lo, (B, h, N)), (p.xo, p.xo_lo, (B, N, r))):
        assert t.shape == shape and t.dtype == torch.float32 and (lo is None or lo.shape == shape)
    rows = B * N  # the product is made transposed, (k [+ split], B N): a view's rows run along memory
    assert p.xo.data_ptr() == p.xv.data_ptr() + 4 * h * rows  # one product, read in place
    split = p.xv_lo is not None
    assert (p.xo_lo is not None) == (split and factor.split == factor.k)
    assert p.xv.stride() == (N, rows, 1) and p.xo.stride() == (N, 1, rows)
    if split:
        assert p.xv_lo.stride() == p.xv.stride() and p.xv_lo.data_ptr() == p.xv.data_ptr() + 4 * factor.k * rows
    if p.xo_lo is None:  # the kernels' layout (the chain's: Omega in one term)
        zeros = lambda *shape: torch.zeros(*shape, device=x.device)  # noqa: E731
        reduction = RowReduction(zeros(h, 8), p.xv, p.xo, zeros(h), zeros(h, 8, r), lambda: None, xv_lo=p.xv_lo)
        reduction.check(zeros(B, h, N, 8))
        assert reduction.layout() == dict(X_STRIDE=-1, XV_LO=factor.k if split else 0)
    return torch.cat([p.along_v().transpose(1, 2), p.along_omega()], dim=-1)


def test_omega_is_exact_in_bf16_and_has_variance_one_over_r():
    """The sketch's Omega is rounded to BF16 once (one BF16 term in the projection), fixed by the
    width alone, with entries of variance about 1/r."""
    from flashwatch.chain import _omega

    om = _omega(768, torch.device("cpu"))
    assert om.shape == (768, SKETCH_DIM) and om.dtype == torch.float32
    assert torch.equal(om, om.to(torch.bfloat16).float())
    assert torch.equal(om, _omega(768, torch.device("cpu"))) and not torch.equal(om[:64], _omega(64, torch.device("cpu")))
    assert abs(om.var().item() * SKETCH_DIM - 1) < 0.05


def test_the_factors_bf16_parts_sum_to_it_within_2_to_the_minus_16():
    from flashwatch.chain import _Factor

    _, m = _factor_case("cpu")
    parts = _Factor(m).parts()
    hi, lo = parts[:, : m.shape[1]].to(F64), parts[:, m.shape[1]:].to(F64)
    assert parts.dtype == torch.bfloat16
    err = (hi + lo - m.to(F64)).abs()
    assert (err <= 2.0 ** -16 * m.to(F64).abs()).all()
    assert err.max() > 0  # the case has entries that BF16 twice does not hold exactly


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_the_factors_made_together_are_those_made_one_by_one(device):
    """``LayerChain.make_factors``: the first call of a monitored step that needs a factor makes every
    chain's whose pair was set with it (one stack, not one set of launches per layer), bit for bit
    the factor and BF16 parts each chain would make alone; a chain whose factor exists keeps it."""
    from flashwatch.chain import _Factor, _split_parts

    torch.manual_seed(5)
    chains = [LayerChain(3, 4, 16, device) for _ in range(3)]
    for c in chains:
        c.set_pair(torch.randn(3, 4, device=device), torch.randn(3, 16, device=device))
        c._siblings = [weakref.ref(s) for s in chains]
    x = torch.randn(2, 5, 16, device=device)
    chains[1]._project(x, torch.zeros(2, 3, 5, 4, device=device))
    assert all(c._both is not None for c in chains)
    for c in chains:
        alone = _Factor(torch.cat([c.v.T, c.omega], dim=1), split=3)
        assert torch.equal(c._both.m, alone.m) and c._both.split == 3
        assert torch.equal(c._both.parts(), alone.parts())
    kept = chains[0]._both
    chains[2].set_pair(torch.randn(3, 4, device=device), torch.randn(3, 16, device=device))
    chains[2]._project(x, torch.zeros(2, 3, 5, 4, device=device))
    assert chains[0]._both is kept and torch.equal(chains[2]._both.m, torch.cat([chains[2].v.T, chains[2].omega], dim=1))
    ms = torch.randn(3, 16, 7, device=device)
    assert torch.equal(_split_parts(ms, 3), torch.stack([_split_parts(m, 3) for m in ms]))
    gone = weakref.ref(chains[1])
    del chains, c, kept
    assert gone() is None  # the chains do not hold one another alive


@pytest.mark.parametrize("split", [None, 4], ids=["all-split", "omega-exact"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_the_projection_of_a_bf16_activation_matches_float64(device, split):
    """x @ [v^T | Omega] as the chain computes it (on CUDA: BF16 x against the factor's BF16 parts,
    FP32 accumulation; with ``split``, Omega's BF16-exact columns in one term) against float64:
    within the parts' 2^-16 and FP32 accumulation over C terms, of each entry's absolute sum of terms."""
    from flashwatch.chain import _Factor

    x, m = _factor_case(device, split)
    factor = _Factor(m, split)
    got = _times(factor, x)
    want = x.to(F64) @ m.to(F64)
    assert got.dtype == torch.float32 and got.shape == (3, 50, m.shape[1])
    scale = x.to(F64).abs() @ m.to(F64).abs()  # the sum of |terms| of each entry
    assert ((got.to(F64) - want).abs() <= (2.0 ** -16 + x.shape[-1] * 2.0 ** -24) * scale + 1e-30).all()
    if device == "cuda":  # the split product ran (torch's mm has out_dtype on this torch)
        assert _Factor.split_product


def test_the_split_product_adds_the_halves_and_falls_back_without_out_dtype(monkeypatch):
    """The split path's arithmetic on the CPU (mm with out_dtype emulated in float64), all columns
    split, then only the first h = 4 (the rest exact in BF16: one term, as the chain's Omega), and a
    split the reading cannot take refused; then a torch whose mm lacks or refuses out_dtype: the FP32 product from then on, the same values;
    running out of memory is not taken for a refusal."""
    from flashwatch import chain

    monkeypatch.setattr(chain, "_split_applies", lambda t: True)
    calls = []

    def mm(a, b, out_dtype=None):
        calls.append((out_dtype, a.shape[0]))  # the product's width: it is made transposed
        return (a.to(F64) @ b.to(F64)).to(out_dtype)

    monkeypatch.setattr(torch, "mm", mm)
    monkeypatch.setattr(chain._Factor, "split_product", True)
    for split, h in [(None, 4), (4, 4)]:
        x, m = _factor_case("cpu", split)
        calls.clear()
        got = _times(chain._Factor(m, split), x, h)
        want = x.to(F64) @ m.to(F64)
        k = m.shape[1]
        assert calls == [(torch.float32, k + (k if split is None else split))] and got.shape == (3, 50, k)
        assert ((got.to(F64) - want).abs() <= 2.0 ** -15 * (x.to(F64).abs() @ m.to(F64).abs())).all(), split
    for split, h in [(2, 4), (6, 2)]:
        with pytest.raises(ValueError, match=f"split must be {h} or {k}"):
            chain._Factor(m, split).times(x, h)
    with pytest.raises(ValueError, match="split must be between"):
        chain._Factor(m, k + 1)
    x, m = _factor_case("cpu")

    def old_mm(a, b):  # a torch before out_dtype: the keyword is a TypeError
        return a @ b

    monkeypatch.setattr(torch, "mm", old_mm)
    again = _times(chain._Factor(m), x)
    assert chain._Factor.split_product is False
    assert torch.equal(again, x.float() @ m)

    def refusing_mm(a, b, out_dtype=None):  # a build whose mm refuses the BF16 -> FP32 product
        raise RuntimeError("out_dtype is not supported for this device")

    monkeypatch.setattr(chain._Factor, "split_product", True)
    monkeypatch.setattr(torch, "mm", refusing_mm)
    assert torch.equal(_times(chain._Factor(m), x), x.float() @ m) and chain._Factor.split_product is False

    def out_of_memory(a, b, out_dtype=None):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(chain._Factor, "split_product", True)
    monkeypatch.setattr(torch, "mm", out_of_memory)
    with pytest.raises(torch.cuda.OutOfMemoryError):  # not hidden by a fallback that needs more memory
        _times(chain._Factor(m), x)


@pytest.mark.parametrize("mode", ["observe", "own_kernel"])
def test_the_chain_switched_off_reads_nan_and_leaves_the_rest_measured(mode, monkeypatch, caplog):
    """MonitorConfig(wq_error_chain=False): no layer has a chain, the W^Q-error metrics read NaN
    (not measured, never 0) with a note at attach, and every other statistic of the same step is
    what it is with the chain on."""
    def run(chain_on: bool):
        torch.manual_seed(0)
        model = GPT(GPTConfig(n_layer=2, n_head=4, n_embd=64, block_size=32))
        monitor = Monitor(MonitorConfig(interval=1, mode=mode, wq_error_chain=chain_on))
        with caplog.at_level("INFO", logger="flashwatch"):
            monitor.attach(model)
        snap = _train_one_monitored_step(model, monitor, [], torch.bfloat16, seed=1)
        chains = [layer.chain for layer in monitor.layers]
        monitor.detach()
        return snap, chains

    on, on_chains = run(True)
    caplog.clear()
    off, off_chains = run(False)
    assert all(c is not None for c in on_chains) and all(c is None for c in off_chains)
    assert any("wq_error_chain=False" in r.getMessage() for r in caplog.records)
    for name in ("flashwatch_wq_error_push", "flashwatch_wq_error_alignment", "flashwatch_wq_error_coherence"):
        assert off[name] and all(math.isnan(v) for v in off[name].values()), name
    assert any(math.isfinite(v) and v != 0 for v in on["flashwatch_wq_error_push"].values())
    for name in ("flashwatch_max_logit", "flashwatch_repeated_max_ratio_bf16", "flashwatch_wq_spectral_norm",
                 "flashwatch_delta_error"):
        assert off[name] == on[name], name  # the same step, measured the same without the chain
