"""Shared check of the kernels' in-epilogue reduction of the W^Q-gradient error rows (``RowReduction``).

Used by tests/test_chain_kernel_reduction.py, interpreted on the CPU and compiled on a GPU.
"""

from __future__ import annotations

import torch
from kernel_cases import RowsRecorder, output_gradient, output_used_by_backward, rows_oracle

from flashwatch.kernels import AttentionStats, attention_statistics, flash_attention, reference
from flashwatch.kernels.stats import COUNT_FIELDS, FIELDS, MAX_FIELDS, SUM_FIELDS, RowReduction

F64 = torch.float64
U = 2.0 ** -24  # FP32 unit roundoff


class ReducingHook:
    """A rows hook that offers a reduction into fresh buffers and must not be called with rows.

    ``in_place``: x . v and x Omega offered as views of one product read in place
    (``RowReduction.layout``), y (B * N, 2 H + r + 3) [x . v hi | x Omega | x . v lo | 3 unused
    columns] read along its rows ("rows", a layout the kernels refuse) or along its columns, i.e.
    rows of its transpose (2 H + r + 3, B * N) ("columns", as the chain offers them); ``xv`` and
    ``xo`` hold their values (hi + lo) for the oracle."""

    def __init__(self, q: torch.Tensor, r: int, seed: int, in_place: str | None = None):
        B, H, N, D = q.shape
        g = torch.Generator().manual_seed(seed)
        self.u = torch.randn(H, D, generator=g).to(q.device)
        self.views = None
        if in_place:
            y = torch.randn(B, N, 2 * H + r + 3, generator=g).to(q.device)
            if in_place == "columns":
                y = y.permute(2, 0, 1).contiguous().permute(1, 2, 0)  # the same values, the product transposed
            hi, xo, lo = y[..., :H].transpose(1, 2), y[..., H: H + r], y[..., H + r: 2 * H + r].transpose(1, 2)
            self.views = (hi, xo, lo)
            self.xv, self.xo = hi + lo, xo.contiguous()
        else:
            self.xv = torch.randn(B, H, N, generator=g).to(q.device)
            self.xo = torch.randn(B, N, r, generator=g).to(q.device)
        self.ugv = torch.zeros(H, device=q.device)
        self.sketch = torch.zeros(H, D, r, device=q.device)
        self.done = 0
        self.offered = 0

    def reduction(self, q):
        self.offered += 1
        if self.views is not None:
            hi, xo, lo = self.views
            return RowReduction(self.u, hi, xo, self.ugv, self.sketch, self._done, xv_lo=lo)
        return RowReduction(self.u, self.xv, self.xo, self.ugv, self.sketch, self._done)

    def _done(self):
        self.done += 1

    def __call__(self, e_rows, pk):
        raise AssertionError("a hook whose reduction ran in the kernel is not called with rows")


def expected(err, pk, err_scale, p_tol, hook: ReducingHook, sm_scale: float):
    """float64 u^T dG v (H,) and dG Omega (H, D, r) of the call from rows_oracle's rows, and
    their bounds: the rows' own error bounds (``kernel_cases.assert_rows_match``: (D + N) 2**-24
    of err_scale, ``p_tol`` for P K) carried through the products, plus FP32 arithmetic (a D-term
    dot, three products, a sum over the B * N rows: (D + B N + 4) 2**-24 of the sum of |terms|;
    2**-9 more for the sketch's TF32 product)."""
    B, H, N, D = pk.shape
    u, xv, xo = (t.detach().cpu().to(F64) for t in (hook.u, hook.xv, hook.xo))
    c = -sm_scale * err
    pu = torch.einsum("bhnd,hd->bhn", pk, u)
    ugv = (c * pu * xv).sum(dim=(0, 2))
    sketch = torch.einsum("bhn,bhnd,bnr->hdr", c, pk, xo)
    e_tol = (D + N) * U * err_scale  # (B, H, N)
    pu_abs = torch.einsum("bhnd,hd->bhn", pk.abs(), u.abs())
    pu_tol = torch.einsum("bhnd,hd->bhn", p_tol, u.abs())
    arith = (D + B * N + 4) * U
    ugv_tol = sm_scale * ((e_tol * pu_abs + err.abs() * pu_tol + e_tol * pu_tol) * xv.abs()).sum(dim=(0, 2))
    ugv_tol = ugv_tol + arith * sm_scale * (err.abs() * pu_abs * xv.abs()).sum(dim=(0, 2))
    sk_tol = sm_scale * (torch.einsum("bhn,bhnd,bnr->hdr", e_tol, pk.abs() + p_tol, xo.abs())
                         + torch.einsum("bhn,bhnd,bnr->hdr", err.abs(), p_tol, xo.abs()))
    # the kernels form the sketch's product on tensor cores in TF32: each factor keeps 10 explicit
    # bits (2**-11 if rounded, 2**-10 if the tensor cores truncate), so a term is within
    # 2 * 2**-10 + 2**-20 of its value; the product's FP32 accumulation is in ``arith``
    sk_arith = arith + 2 * 2.0 ** -10 + 2.0 ** -20
    sk_tol = sk_tol + sk_arith * sm_scale * torch.einsum("bhn,bhnd,bnr->hdr", err.abs(), pk.abs(), xo.abs())
    return ugv, sketch, ugv_tol, sk_tol


def _run(q, k, v, causal, mode, variant, stats):
    """One call of the kernel under test with ``stats``: (dq, dk, dv) or None, O used, dO."""
    if mode == "observe":
        q, k, v = (t.detach() for t in (q, k, v))
        out = reference.flash_attention(q.cpu(), k.cpu(), v.cpu(), causal=causal).to(q.device)
        g = output_gradient(out)
        attention_statistics(q, k, v, out, g, stats, causal=causal)
        return None, out, g
    qq, kk, vv = (t.detach().requires_grad_(True) for t in (q, k, v))
    out = flash_attention(qq, kk, vv, causal=causal, variant=variant, stats=stats)
    g = output_gradient(out)
    o_used = output_used_by_backward(out, variant)
    out.backward(g)
    return (qq.grad, kk.grad, vv.grad), o_used, g


def assert_same_statistics(got: torch.Tensor, want: torch.Tensor, terms: int) -> None:
    """Two calls' packed statistics (``AttentionStats.packed()``, (fields, H)) are the same
    statistics: counts and the max logit bitwise; the FP32 sums up to their summation order, which
    float atomics leave free on a GPU (any two orders of ``terms`` FP32 terms differ by at most
    2 (terms - 1) 2^-24 times the sum of the terms' magnitudes: the sum of |e| bounds that for the
    signed sums, the sum itself for the non-negative ones)."""
    got, want = got.cpu(), want.cpu()
    row = {name: i for i, name in enumerate(FIELDS)}
    for name in COUNT_FIELDS + MAX_FIELDS:
        assert torch.equal(got[row[name]], want[row[name]]), f"the reduction changed {name}"
    order = 2 * (terms - 1) * 2.0 ** -24
    magnitude = {"delta_error": "delta_error_abs", "delta_error_tied": "delta_error_abs",
                 "delta_error_abs": "delta_error_abs", "delta_error_sq": "delta_error_sq"}
    for name in SUM_FIELDS:
        bound = order * want[row[magnitude[name]]].abs()
        off = (got[row[name]] - want[row[name]]).abs()
        assert (off <= bound).all(), f"the reduction changed {name} by {off.max():.3g} (summation order allows {bound.max():.3g})"


def check_reduction(q, k, v, causal=True, mode="observe", r=16, variant="plain", seed=0, in_place=None):
    """One call with a reducing hook, checked twice: against float64 from the inputs (within the
    rows' own error bounds carried through), and against the float64 reduction of the rows the
    same kernel stores for a plain hook (within FP32 arithmetic alone: the tight check). Nothing
    else the call computes (statistics, gradients) changes. ``in_place`` ("columns"): the
    factors offered as views of one product (``ReducingHook``); x . v's two terms are then added in FP32, one more
    rounding of 2**-24 (within the bound's ``+ 4``)."""
    B, H, N, D = q.shape
    sm_scale = D ** -0.5
    hook = ReducingHook(q, r, seed, in_place)
    stats, plain = AttentionStats(H, q.device), AttentionStats(H, q.device)
    stats.rows_hook = hook
    plain.rows_hook = recorder = RowsRecorder()
    grads, o_used, g = _run(q, k, v, causal, mode, variant, stats)
    grads_plain, _, _ = _run(q, k, v, causal, mode, variant, plain)
    if grads is not None:  # the gradients do not depend on what is done with the rows
        for a, b in zip(grads, grads_plain):
            assert torch.equal(a, b)
    assert hook.offered == 1 and hook.done == 1 and len(recorder.calls) == 1
    assert_same_statistics(stats.packed(), plain.packed(), terms=B * N)  # rows summed into each head
    tag = f"{mode} {tuple(q.shape)} Hkv={k.shape[1]} causal={causal} r={r} {variant} in_place={in_place}"
    got_ugv, got_sketch = hook.ugv.cpu().to(F64), hook.sketch.cpu().to(F64)

    err, pk, err_scale, pk_tol = rows_oracle(q, k, v, o_used, g, causal)
    ugv, sketch, ugv_tol, sk_tol = expected(err, pk, err_scale, pk_tol, hook, sm_scale)
    bad = (got_ugv - ugv).abs() - ugv_tol
    assert bad.max() <= 1e-12, f"{tag}: u^T dG v off by {bad.max():.3g} beyond the bound"
    bad = (got_sketch - sketch).abs() - sk_tol
    assert bad.max() <= 1e-12, f"{tag}: dG Omega off by {bad.max():.3g} beyond the bound"

    e_k, pk_k = (t.cpu().to(F64) for t in recorder.calls[0])
    zeros = torch.zeros_like(e_k)
    ugv_k, sketch_k, ugv_tol_k, sk_tol_k = expected(e_k, pk_k, zeros, torch.zeros_like(pk_k), hook, sm_scale)
    bad = (got_ugv - ugv_k).abs() - ugv_tol_k
    assert bad.max() <= 1e-12, f"{tag}: u^T dG v off the stored rows' by {bad.max():.3g} beyond FP32 arithmetic"
    bad = (got_sketch - sketch_k).abs() - sk_tol_k
    assert bad.max() <= 1e-12, f"{tag}: dG Omega off the stored rows' by {bad.max():.3g} beyond FP32 arithmetic"
    if N > 1:  # one key: O is v itself, exact in the input dtype, and the error is 0
        # most heads, not every head: a head's push is a signed sum over rows and can cancel to near
        # zero by chance (own-kernel cases at N 300 and 1025 had such a head on an H200)
        assert (ugv_k.abs() > 10 * ugv_tol_k).float().mean() > 0.5, f"{tag}: the signal does not stand above the bound"
        assert (sketch_k.abs() > 10 * sk_tol_k).float().mean() > 0.5, f"{tag}: the sketch does not stand above"
    return hook


def check_reduction_repeats(q, k, v, causal=True, mode="observe", r=16, seed=0):
    """The reduction's sums are the same, bit for bit, in two identical calls: each program stores
    its share and the shares are summed in one fixed order (float atomics would leave the order
    to the GPU's scheduling)."""
    sums = []
    for _ in range(2):
        hook = ReducingHook(q, r, seed)
        stats = AttentionStats(q.shape[1], q.device)
        stats.rows_hook = hook
        _run(q, k, v, causal, mode, "plain", stats)
        assert hook.done == 1
        sums.append((hook.ugv.clone(), hook.sketch.clone()))
    assert torch.equal(sums[0][0], sums[1][0]) and torch.equal(sums[0][1], sums[1][1])
