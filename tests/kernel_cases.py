"""Input builders and checks shared by the interpreted (CPU) and GPU kernel tests."""

from __future__ import annotations

import torch

from attention_oracles import assert_tolerance_rule, attention64, attention_same_dtype, expand_kv
from flashwatch.kernels import AttentionStats, flash_attention, reference


def random_qkv(B, H, N, D, Hkv=None, dtype=torch.bfloat16, device="cpu", seed=0, scale=1.0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    Hkv = Hkv or H
    q = torch.randn(B, H, N, D, generator=g) * scale
    k = torch.randn(B, Hkv, N, D, generator=g) * scale
    v = torch.randn(B, Hkv, N, D, generator=g)
    return [t.to(device=device, dtype=dtype).requires_grad_(True) for t in (q, k, v)]


def output_gradient(out: torch.Tensor, seed: int = 17) -> torch.Tensor:
    """A seeded random output gradient: the same whatever ran before in the process (the global
    generator is not, and a tolerance test must not depend on the test order)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(out.shape, generator=gen).to(device=out.device, dtype=out.dtype)


def check_against_float64(q, k, v, causal, variant, factor=2.0, floor=1e-5, attn_mask=None, unread_rows=None):
    """Output and dq, dk, dv of flash_attention within the tolerance rule of float64. ``unread_rows``
    ((B, 1 or H, N) bool): rows whose output gradient is 0, as no loss reads a padding row."""
    out = flash_attention(q, k, v, causal=causal, variant=variant, attn_mask=attn_mask)
    g = output_gradient(out)
    if unread_rows is not None:
        g = g.masked_fill(unread_rows[..., None], 0.0)
    grads = torch.autograd.grad(out, (q, k, v), g)
    exact, leaves = attention64(q, k, v, causal, attn_mask=attn_mask)
    same = attention_same_dtype(q, k, v, causal, attn_mask=attn_mask)
    base = torch.autograd.grad(same, (q, k, v), g)
    ex = torch.autograd.grad(exact, leaves, g.detach().cpu().double())
    tag = f"{tuple(q.shape)} Hkv={k.shape[1]} {q.dtype} causal={causal} {variant}"
    assert_tolerance_rule(f"out {tag}", out, same, exact, factor, floor)
    for name, a, b, c in zip("qkv", grads, base, ex):
        assert_tolerance_rule(f"d{name} {tag}", a, b, c, factor, floor)


def planted_ties(B=2, H=3, N=70, D=64, dtype=torch.bfloat16, device="cpu", eps=1e-3, seed=0):
    """Keys with exact duplicates inside a tile and across tiles, and near-ties at the eps
    boundary: k_far = k + t * q_dir chosen so the score gap is eps/2 (inside) or 2*eps (outside)
    for a chosen query row. Returns q, k, v in dtype."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(B, H, N, D, generator=g)
    k = torch.randn(B, H, N, D, generator=g)
    v = torch.randn(B, H, N, D, generator=g)
    k[:, :, 5] = k[:, :, 2]  # same tile
    k[:, :, 40] = k[:, :, 9]  # different tiles at any block size <= 32
    k[:, :, 66] = k[:, :, 1]  # far apart, last (ragged) tile
    # make the duplicated keys the row max for many rows: align queries with them
    for src, rows in ((2, range(10, 20)), (9, range(45, 55)), (1, range(67, 70))):
        for r in rows:
            q[:, :, r] = 3.0 * k[:, :, src] + 0.1 * q[:, :, r]
    return [t.to(device=device, dtype=dtype) for t in (q, k, v)]


def check_statistics(q, k, v, causal=True, eps=1e-3, variant="plain", fmt="fp8_e4m3"):
    """Counts equal the reference's exactly (the format count at ``fmt``); the max logit to FP32
    rounding; the delta-error sums equal their definition evaluated in float64 on the kernel's own output."""
    H = q.shape[1]
    q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    stats = AttentionStats(H, q.device, format=fmt)
    out = flash_attention(q, k, v, causal=causal, eps=eps, stats=stats, variant=variant)
    g = output_gradient(out)
    out.backward(g)
    ref = AttentionStats(H, "cpu", format=fmt)
    qc, kc, vc = (t.detach().cpu().requires_grad_(True) for t in (q, k, v))
    reference.flash_attention(qc, kc, vc, causal=causal, eps=eps, stats=ref).backward(g.detach().cpu())
    qc, kc, vc = (t.detach() for t in (qc, kc, vc))
    assert stats.rows.tolist() == ref.rows.tolist()
    assert stats.repeated_max_rows.tolist() == ref.repeated_max_rows.tolist()
    assert stats.repeated_max_rows_bf16.tolist() == ref.repeated_max_rows_bf16.tolist()
    assert stats.repeated_max_rows_format.tolist() == ref.repeated_max_rows_format.tolist()
    torch.testing.assert_close(stats.max_logit.cpu(), ref.max_logit, rtol=1e-6, atol=1e-6)
    exact, _ = attention64(q, k, v, causal)
    g64 = g.detach().cpu().double()
    delta_used = (g64 * out.detach().cpu().double()).sum(-1)
    err = delta_used - (g64 * exact.detach()).sum(-1)  # (B, H, N)
    scale = err.abs().sum(dim=(0, 2))
    got = stats.delta_error.cpu().double()
    want = err.sum(dim=(0, 2))
    # FP32 inputs have no rounding of O to speak of: the delta error is FP32 noise there
    if variant != "fp32_delta" and q.dtype != torch.float32:
        assert ((got - want).abs() <= 1e-3 * scale + 1e-6).all(), (got, want, scale)
        torch.testing.assert_close(stats.delta_error_abs.cpu().double(), scale, rtol=1e-3, atol=1e-6)
        torch.testing.assert_close(stats.delta_error_sq.cpu().double(), (err ** 2).sum(dim=(0, 2)), rtol=2e-3, atol=1e-9)
        tied = _tied_rows(qc, kc, causal, eps)
        want_tied = torch.where(tied, err, torch.zeros_like(err)).sum(dim=(0, 2))
        assert ((stats.delta_error_tied.cpu().double() - want_tied).abs() <= 1e-3 * scale + 1e-6).all()
    return stats, ref


def _tied_rows(q, k, causal, eps):
    s = reference.scores(q, k, causal, q.shape[-1] ** -0.5)
    m1, m2 = reference.row_top2(s)
    return reference.tie_flags(m1, m2, eps)[0]


def planted_near_ties(B=1, H=2, N=48, D=64, device="cpu", eps=1e-3, seed=1):
    """FP32 inputs where row 30 has its max at key 3 and key 20 exactly eps/2 below it (a
    repeated max), and row 31 its max at key 7 and key 21 at 2*eps below (not one). The near
    keys sit in other tiles than the max keys."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(B, H, N, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, H, N, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, H, N, D, generator=g, dtype=torch.float64)
    scale = D ** -0.5
    for row, top, key, gap in ((30, 3, 20, eps / 2), (31, 7, 21, 2 * eps)):
        q[:, :, row] = 4.0 * k[:, :, top]
        qr = q[:, :, row]
        # k_key = k_top - gap / scale * qr / |qr|^2  =>  s[row, key] = s[row, top] - gap
        k[:, :, key] = k[:, :, top] - (gap / scale) * qr / (qr * qr).sum(-1, keepdim=True)
    return [t.to(device=device, dtype=torch.float32) for t in (q, k, v)]


def fused_projection_qkv(B, H, N, D, dtype=torch.bfloat16, device="cpu", seed=0):
    """q, k, v as a nanoGPT-style model makes them: views of one (B, N, 3*H*D) projection,
    (B, H, N, D) with strides (N*3C, D, 3C, 1): neither contiguous nor dense."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(B, N, 3 * H * D, generator=g).to(device=device, dtype=dtype).requires_grad_(True)
    q, k, v = (t.view(B, N, H, D).transpose(1, 2) for t in x.split(H * D, dim=2))
    return x, q, k, v


def check_fused_projection_gradients(device="cpu"):
    """The gradient reaching the projection through flash_attention equals the reference's."""
    B, H, N, D = 2, 3, 40, 64
    x, q, k, v = fused_projection_qkv(B, H, N, D, device=device)
    out = flash_attention(q, k, v)
    g = output_gradient(out)
    (got,) = torch.autograd.grad(out, x, g)
    x2, q2, k2, v2 = fused_projection_qkv(B, H, N, D, device="cpu")
    out2 = reference.flash_attention(q2, k2, v2)
    (want,) = torch.autograd.grad(out2, x2, g.cpu())
    err = (got.float().cpu() - want.float()).abs().max().item()
    scale = want.float().abs().max().item()
    assert err <= 0.02 * scale, f"gradient through a fused q|k|v projection off by {err:.3g} (scale {scale:.3g})"


# --- per-row outputs (AttentionStats.rows_hook) ------------------------------------------------

def rows_oracle(q, k, v, o_used, grad_out, causal, sm_scale=None):
    """The per-row outputs in float64 from the same inputs: (delta_used - delta_hp (B, H, N),
    P K (B, H, N, D)), with P the exact softmax, delta_used = rowsum(dO * O_used) and
    delta_hp = rowsum(P * dO V^T); the scale of the delta error's tolerance, rowsum|dO * O_used| +
    rowsum(P * |dO V^T|) (B, H, N); and P K's tolerance (B, H, N, D), ``pk_tolerance``."""
    q, k, v, o_used, do = (t.detach().cpu().double() for t in (q, k, v, o_used, grad_out))
    H, N, D = q.shape[1], q.shape[2], q.shape[3]
    kk, vv = expand_kv(k, H), expand_kv(v, H)
    s = q @ kk.transpose(-1, -2) * (D ** -0.5 if sm_scale is None else sm_scale)
    if causal:
        s = s.masked_fill(torch.ones(N, N, dtype=torch.bool).triu(1), float("-inf"))
    p = torch.softmax(s, dim=-1)
    dp = do @ vv.transpose(-1, -2)
    used = do * o_used
    err = used.sum(-1) - (p * dp).sum(-1)
    return err, p @ kk, used.abs().sum(-1) + (p * dp.abs()).sum(-1), pk_tolerance(p, kk)


def pk_tolerance(p: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """How far the kernels' P K (B, H, N, D) may be from float64, from the exact P (B, H, N, N)
    and K (B, H, N, D) in float64. The kernels multiply P rounded once to the input dtype (BF16:
    2**-8 of each P; FP16: 2**-11, or 2**-25 absolutely below 2**-14) by K as it is, exactly in
    FP32; P carries its own FP32 rounding of the scores and exp2 (about 2**-20, 2**-16 taken) and
    the FP32 sum over N keys at most N * 2**-24: within (2**-8 + 2**-16 + N * 2**-24) of
    sum_j P_j |k_j|, plus 2**-25 sum_j |k_j| for FP16's subnormal P. A P rounded more coarsely
    (truncated to BF16: 2**-7) would not be."""
    n = p.shape[-1]
    return (2.0 ** -8 + 2.0 ** -16 + n * 2.0 ** -24) * (p @ k.abs()) + 2.0 ** -25 * k.abs().sum(-2, keepdim=True)


def output_used_by_backward(out: torch.Tensor, variant: str) -> torch.Tensor:
    """The output whose delta the backward takes: O, or O + R under fp32_delta. R = O_fp32 - O
    (input dtype) is the sixth tensor both implementations save for their backward. Read it
    before the backward frees it."""
    o = out.detach().double()
    if variant == "fp32_delta":
        o = o + out.grad_fn.saved_tensors[5].double()
    return o


def assert_rows_match(err, pk, want_err, want_pk, err_scale, pk_tol, where=""):
    """err, pk: the per-row outputs; want_*, err_scale, pk_tol: rows_oracle's float64 values and bounds.

    delta error per row: FP32 sums of D terms (rowsum(dO * O)) and N terms (rowsum(P * dP)),
    each within its count times 2**-24 of the sum of its |terms| (the classic bound of recursive
    summation), plus P's own FP32 error (about 2**-20 relative): within (D + N) * 2**-24 of
    err_scale for D + N >= 16, against a signal of about 2**-9 of that scale (O rounded to BF16).
    P K per element: within ``pk_tolerance``.
    """
    assert err.dtype == pk.dtype == torch.float32
    err, pk = err.detach().cpu().double(), pk.detach().cpu().double()
    assert err.shape == want_err.shape and pk.shape == want_pk.shape, (err.shape, pk.shape)
    N, D = pk.shape[2], pk.shape[3]
    bad_err = (err - want_err).abs() - (D + N) * 2.0 ** -24 * err_scale
    assert bad_err.max() <= 1e-12, f"{where} delta error rows off by {bad_err.max():.3g} beyond the tolerance"
    bad_pk = (pk - want_pk).abs() - pk_tol
    assert bad_pk.max() <= 1e-12, f"{where} P K off by {bad_pk.max():.3g} beyond the tolerance"


class RowsRecorder:
    """A rows_hook that keeps every call's tensors."""

    def __init__(self):
        self.calls: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __call__(self, delta_error_rows, pk):
        self.calls.append((delta_error_rows, pk))


def check_rows_hook(q, k, v, causal=True, variant="plain"):
    """flash_attention with statistics and a rows_hook: one call from the backward, on q's
    device, whose outputs match float64 and whose row sums are what delta_error received."""
    H = q.shape[1]
    q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    stats = AttentionStats(H, q.device)
    stats.rows_hook = hook = RowsRecorder()
    out = flash_attention(q, k, v, causal=causal, variant=variant, stats=stats)
    assert not hook.calls, "the hook is called by the backward"
    g = output_gradient(out)
    o_used = output_used_by_backward(out, variant)
    out.backward(g)
    assert len(hook.calls) == 1
    err, pk = hook.calls[0]
    assert err.device == q.device and pk.device == q.device
    tag = f"{tuple(q.shape)} Hkv={k.shape[1]} causal={causal} {variant}"
    assert_rows_match(err, pk, *rows_oracle(q, k, v, o_used, g, causal), where=tag)
    _check_row_sums(err, stats)
    return hook


def check_rows_hook_observe(q, k, v, causal=True):
    """attention_statistics with a rows_hook, fed another kernel's output (the reference's)."""
    from flashwatch.kernels import attention_statistics

    H = q.shape[1]
    q, k, v = (t.detach() for t in (q, k, v))
    out = reference.flash_attention(q.cpu(), k.cpu(), v.cpu(), causal=causal).to(q.device)
    g = output_gradient(out)
    stats = AttentionStats(H, q.device)
    stats.rows_hook = hook = RowsRecorder()
    attention_statistics(q, k, v, out, g, stats, causal=causal)
    assert len(hook.calls) == 1
    err, pk = hook.calls[0]
    assert err.device == q.device and pk.device == q.device
    tag = f"observe {tuple(q.shape)} Hkv={k.shape[1]} causal={causal}"
    assert_rows_match(err, pk, *rows_oracle(q, k, v, out, g, causal), where=tag)
    _check_row_sums(err, stats)


def _check_row_sums(err, stats):
    """The rows' sum per head is what the call added to delta_error (FP32, another order)."""
    got = err.double().sum(dim=(0, 2))
    want = stats.delta_error.double()
    assert ((got - want).abs() <= 1e-5 * err.double().abs().sum(dim=(0, 2)) + 1e-9).all(), (got, want)
    torch.testing.assert_close(err.double().abs().sum(dim=(0, 2)), stats.delta_error_abs.double(), rtol=1e-5,
                               atol=1e-9)


def delta_error_at_scale(scale: float, attention=flash_attention, statistics=None, seed: int = 7):
    """The delta-error sums per head of the own kernel (``attention``, its backward's statistics) and,
    with ``statistics``, of observe mode's pass fed its output, with float64's (delta_used from the
    BF16 output, delta_hp of the exact softmax) and the max logit: (own, observed or None, truth,
    max logit). Queries scaled by ``scale`` (max logit ~3.8 at 1, ~1,150 at 300); causal, GQA."""
    B, H, Hkv, N, D = 2, 4, 2, 33, 64
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, h, N, D, generator=g) for h in (H, Hkv, Hkv))
    q = (q * scale).bfloat16().requires_grad_(True)
    k, v = k.bfloat16(), v.bfloat16()
    own = AttentionStats(H, "cpu")
    out = attention(q, k, v, stats=own)
    grad = torch.randn(out.shape, generator=g).bfloat16()
    out.backward(grad)
    seen = None
    if statistics is not None:
        seen = AttentionStats(H, "cpu")
        statistics(q.detach(), k, v, out.detach(), grad, seen)
    s = q.detach().double() @ expand_kv(k.double(), H).transpose(-1, -2) / D ** 0.5
    p = torch.softmax(s.masked_fill(torch.ones(N, N, dtype=torch.bool).triu(1), float("-inf")), -1)
    dp = grad.double() @ expand_kv(v.double(), H).transpose(-1, -2)
    rows = (grad.double() * out.detach().double()).sum(-1) - (p * dp).sum(-1)  # (B, H, N)
    return own, seen, (rows.sum((0, 2)), rows.abs().sum((0, 2))), float(own.max_logit.max())


def worst_relative_error(stats: AttentionStats, truth: tuple[torch.Tensor, torch.Tensor]) -> float:
    """The largest error of a head's delta-error sum against float64's, relative to float64's sum of
    |row errors| (a head's sum can cancel to near 0, where a plain relative error means nothing)."""
    total, scale = truth
    return float(((stats.delta_error.double() - total).abs() / scale).max())
