"""One launch for a monitored step's W^Q power iteration, where PyTorch takes about fifty.

``power_step`` does what ``flashwatch.signals.PowerIteration.step`` computes with PyTorch
operations (the reference: the CPU path and the tests' oracle), one program per head:

1. ``iters`` times: z = W^T (W V), its Gram z^T z in float64, the Cholesky factor R of the Gram
   (R^T R = z^T z), the new vectors Q = z R^-1 rounded to FP32; a head whose Q is not finite, or
   whose Gram is not positive definite, keeps its vectors;
2. Rayleigh-Ritz: Y = W V, the top eigenvector a of Y^T Y (float64 repeated squaring, as
   ``signals.top_eigenvector``), sigma = sqrt(a^T Y^T Y a / a^T a);
3. with ``pair``: the top singular pair v = unit(V a), u = unit(W v) (``chain.top_pair``).

W is read four times a step (twice an iteration, once each for 2 and 3), the later reads mostly
from L2; z goes through a scratch buffer of 12 kB a head at GPT-2 small's 768 x 4. Products
and sums of W are FP32, as PyTorch's batched products of the reference, in another order:
results agree with it to FP32 rounding, not bit for bit. Every run gives the same bits (no
atomics; each output written by its head's program).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import launch, on_device

__all__ = ["power_step", "supports", "MAX_BLOCK", "MAX_HEAD_DIM"]

MAX_BLOCK = 16  # vectors per head the kernel takes (its (k, k) matrices live in registers)
MAX_HEAD_DIM = 256  # a head's rows of W^Q, held in one tile
_TILE = 16384  # entries of one W tile (BLOCK_D x BLOCK_C): 64 kB of FP32 loads in flight a program
_SQUARINGS = 6  # as signals.top_eigenvector's default
_NUM_WARPS = 8


@triton.jit
def _column(x, kk, j):
    """Column j of x (rows, KP): (rows,)."""
    return tl.sum(tl.where(kk[None, :] == j, x, 0.0), axis=1)


@triton.jit
def _entry(x, kk, j):
    """Entry j of x (KP,)."""
    return tl.sum(tl.where(kk == j, x, 0.0), axis=0)


@triton.jit
def _cholesky(g, kk, K: tl.constexpr, KP: tl.constexpr):
    """Upper R with R^T R = g for g (KP, KP) float64 whose first K rows and columns are the Gram
    (the padding gets R's identity). ``good``: every pivot > 0 (else the Gram is not positive
    definite, where ``torch.linalg.cholesky_ex`` reports a failure)."""
    r = tl.zeros([KP, KP], dtype=tl.float64)
    good = tl.full([], 1, tl.int1)
    for j in tl.static_range(KP):
        if j < K:
            g_row = tl.sum(tl.where(kk[:, None] == j, g, 0.0), axis=0)  # g[j, :]
            r_col = tl.sum(tl.where(kk[None, :] == j, r, 0.0), axis=1)  # r[:, j], zero from row j on
            s = g_row - tl.sum(r_col[:, None] * r, axis=0)  # g[j, i] - sum_{p<j} r[p, j] r[p, i]
            pivot = _entry(s, kk, j)
            good = good & (pivot > 0)
            r_jj = tl.sqrt(pivot)
            row = tl.where(kk == j, r_jj, tl.where(kk > j, s / r_jj, 0.0))
            r = tl.where(kk[:, None] == j, row[None, :], r)
        else:
            r = tl.where((kk[:, None] == j) & (kk[None, :] == j), 1.0, r)
    return r, good


@triton.jit
def _solve_right(z, r, kk, KP: tl.constexpr):
    """q with q r = z, for z (rows, KP) and upper r (KP, KP), float64: column by column."""
    q = tl.zeros(z.shape, dtype=tl.float64)
    for j in tl.static_range(KP):
        r_col = tl.sum(tl.where(kk[None, :] == j, r, 0.0), axis=1)  # r[:, j]
        acc = _column(z, kk, j) - tl.sum(q * r_col[None, :], axis=1)  # q's columns >= j are still 0
        q = tl.where(kk[None, :] == j, (acc / _entry(r_col, kk, j))[:, None], q)
    return q


@triton.jit
def _w_tile(w_head, d, d_ok, c, c_ok, stride_wd, stride_wc):
    """Rows d and columns c of one head's W, (BLOCK_D, BLOCK_C) in FP32 (zero outside D and C)."""
    return tl.load(w_head + d[:, None] * stride_wd + c[None, :] * stride_wc,
                   mask=d_ok[:, None] & c_ok[None, :], other=0.0).to(tl.float32)


@triton.jit
def _times_v(w_head, src, d, d_ok, kk, C, K, stride_wd, stride_wc,
             KP: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_C: tl.constexpr):
    """W V for one head: (BLOCK_D, KP) FP32, V (C, K) contiguous FP32 at ``src``."""
    y = tl.zeros([BLOCK_D, KP], dtype=tl.float32)
    for c0 in range(0, C, BLOCK_C):
        c = c0 + tl.arange(0, BLOCK_C)
        c_ok = c < C
        w = _w_tile(w_head, d, d_ok, c, c_ok, stride_wd, stride_wc)
        vv = tl.load(src + c[:, None] * K + kk[None, :], mask=c_ok[:, None] & (kk < K)[None, :], other=0.0)
        for j in tl.static_range(KP):
            y = tl.where(kk[None, :] == j, y + tl.sum(w * _column(vv, kk, j)[None, :], axis=1)[:, None], y)
    return y


@triton.jit
def _power_kernel(W, V, V_OUT, Z, SIGMA, TOP, U, VP, D, C, stride_wn, stride_wd, stride_wc, iters,
                  K: tl.constexpr, KP: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_C: tl.constexpr,
                  SQUARINGS: tl.constexpr, PAIR: tl.constexpr):
    # grid (N,): one program a head. V, V_OUT (N, C, K) and Z (N, C, KP) contiguous FP32.
    n = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    kk = tl.arange(0, KP)
    k_ok = kk < K
    w_head = W + n * stride_wn
    v_in = V + n * C * K
    v_out = V_OUT + n * C * K
    z_head = Z + n * C * KP
    src = v_in
    for it in range(iters):
        y = _times_v(w_head, src, d, d_ok, kk, C, K, stride_wd, stride_wc, KP, BLOCK_D, BLOCK_C)
        # z = W^T y, stored; its Gram in float64
        g = tl.zeros([KP, KP], dtype=tl.float64)
        for c0 in range(0, C, BLOCK_C):
            c = c0 + tl.arange(0, BLOCK_C)
            c_ok = c < C
            w = _w_tile(w_head, d, d_ok, c, c_ok, stride_wd, stride_wc)
            z = tl.zeros([BLOCK_C, KP], dtype=tl.float32)
            for j in tl.static_range(KP):
                z = tl.where(kk[None, :] == j, tl.sum(w * _column(y, kk, j)[:, None], axis=0)[:, None], z)
            tl.store(z_head + c[:, None] * KP + kk[None, :], z, mask=c_ok[:, None])
            z64 = z.to(tl.float64)
            for j in tl.static_range(KP):  # row j of the Gram: (BLOCK_C, KP) temporaries only
                g = tl.where(kk[:, None] == j, g + tl.sum(z64 * _column(z64, kk, j)[:, None], axis=0)[None, :], g)
        r, good = _cholesky(g, kk, K, KP)
        tl.debug_barrier()  # z, stored by the program's other threads, is read back
        # the new vectors only if every entry is finite (the reference's masked select)
        finite = good
        for c0 in range(0, C, BLOCK_C):
            c = c0 + tl.arange(0, BLOCK_C)
            c_ok = c < C
            z = tl.load(z_head + c[:, None] * KP + kk[None, :], mask=c_ok[:, None], other=0.0).to(tl.float64)
            q = _solve_right(z, r, kk, KP).to(tl.float32)
            bad = ((q != q) | (tl.abs(q) == float("inf"))) & c_ok[:, None] & k_ok[None, :]
            finite = finite & (tl.sum(bad.to(tl.int32)) == 0)
        for c0 in range(0, C, BLOCK_C):
            c = c0 + tl.arange(0, BLOCK_C)
            c_ok = c < C
            out = v_out + c[:, None] * K + kk[None, :]
            mask = c_ok[:, None] & k_ok[None, :]
            if finite:
                z = tl.load(z_head + c[:, None] * KP + kk[None, :], mask=c_ok[:, None], other=0.0).to(tl.float64)
                tl.store(out, _solve_right(z, r, kk, KP).to(tl.float32), mask=mask)
            elif it == 0:  # kept: the step's input vectors (later iterations' are in V_OUT already)
                tl.store(out, tl.load(v_in + c[:, None] * K + kk[None, :], mask=mask), mask=mask)
        tl.debug_barrier()  # V_OUT, written by the program's other threads, is read next
        src = v_out
    # Rayleigh-Ritz in the new block: Y = W V, the top eigenvector of Y^T Y
    y = _times_v(w_head, v_out, d, d_ok, kk, C, K, stride_wd, stride_wc, KP, BLOCK_D, BLOCK_C)
    gram = tl.sum(y[:, :, None] * y[:, None, :], axis=0)  # (KP, KP) FP32
    if K == 1:
        top = tl.where(k_ok, 1.0, 0.0)
    else:
        a = gram.to(tl.float64)
        trace = tl.sum(tl.sum(tl.where(kk[:, None] == kk[None, :], a, 0.0), axis=1), axis=0)
        a = a / tl.maximum(trace, 1e-30, propagate_nan=tl.PropagateNan.ALL)
        for _ in tl.static_range(SQUARINGS):
            a = tl.sum(a[:, :, None] * a[None, :, :], axis=1)
        diag = tl.sum(tl.where(kk[:, None] == kk[None, :], a, 0.0), axis=1)
        j = tl.argmax(tl.where(k_ok, diag, -1.0), axis=0)
        col = _column(a, kk, j)
        col_norm = tl.maximum(tl.sqrt(tl.sum(col * col, axis=0)), 1e-300, propagate_nan=tl.PropagateNan.ALL)
        top = (col / col_norm).to(tl.float32)
    num = tl.sum(tl.sum(top[:, None] * gram * top[None, :], axis=1), axis=0)
    den = tl.maximum(tl.sum(top * top, axis=0), 1e-30, propagate_nan=tl.PropagateNan.ALL)
    tl.store(SIGMA + n, tl.sqrt(tl.maximum(num / den, 0.0, propagate_nan=tl.PropagateNan.ALL)))
    tl.store(TOP + n * K + kk, top, mask=k_ok)
    if PAIR:  # v = unit(V a), u = unit(W v)
        sq = tl.zeros([BLOCK_C], dtype=tl.float32)
        for c0 in range(0, C, BLOCK_C):
            c = c0 + tl.arange(0, BLOCK_C)
            c_ok = c < C
            vv = tl.load(v_out + c[:, None] * K + kk[None, :], mask=c_ok[:, None] & k_ok[None, :], other=0.0)
            va = tl.sum(vv * top[None, :], axis=1)
            sq += va * va
        v_norm = tl.maximum(tl.sqrt(tl.sum(sq, axis=0)), 1e-30, propagate_nan=tl.PropagateNan.ALL)
        u = tl.zeros([BLOCK_D], dtype=tl.float32)
        for c0 in range(0, C, BLOCK_C):
            c = c0 + tl.arange(0, BLOCK_C)
            c_ok = c < C
            vv = tl.load(v_out + c[:, None] * K + kk[None, :], mask=c_ok[:, None] & k_ok[None, :], other=0.0)
            va = tl.sum(vv * top[None, :], axis=1) / v_norm
            tl.store(VP + n * C + c, va, mask=c_ok)
            w = _w_tile(w_head, d, d_ok, c, c_ok, stride_wd, stride_wc)
            u += tl.sum(w * va[None, :], axis=1)
        u = u / tl.maximum(tl.sqrt(tl.sum(u * u, axis=0)), 1e-30, propagate_nan=tl.PropagateNan.ALL)
        tl.store(U + n * D + d, u, mask=d_ok)


def supports(weight: torch.Tensor, v: torch.Tensor, iters: int) -> bool:
    """Whether ``power_step`` takes this step (else the caller runs the PyTorch reference)."""
    return (weight.dim() == 3 and weight.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and weight.shape[1] <= MAX_HEAD_DIM and v.dtype == torch.float32 and v.shape[-1] <= MAX_BLOCK
            and v.device == weight.device and isinstance(iters, int) and iters >= 1 and weight.shape[0] > 0)


def power_step(weight: torch.Tensor, v: torch.Tensor, iters: int, pair: bool = False):
    """``iters`` block power iterations of every head's W^Q and the Rayleigh-Ritz estimate.

    Args:
        weight: (N, D, C) query weights, any strides; FP32, BF16 or FP16 (products in FP32).
        v: (N, C, k) FP32 orthonormal vectors per head (``PowerIteration.v``), k <= ``MAX_BLOCK``.
        iters: iterations, >= 1.
        pair: also return each head's top singular pair.

    Returns:
        (v_new (N, C, k), sigma (N,), top (N, k), pair) all FP32 on weight's device: the new
        vectors (a head whose iteration failed keeps ``v``), the estimates, the top eigenvector of
        (W v_new)^T (W v_new) (``PowerIteration.top_in_block``) and, with ``pair``, (u (N, D),
        v (N, C)) unit vectors, else None.
    """
    if not supports(weight, v, iters):
        raise ValueError(f"power_step takes (N, D <= {MAX_HEAD_DIM}, C) FP32/BF16/FP16 weights and (N, C, "
                         f"k <= {MAX_BLOCK}) FP32 vectors on one device with iters >= 1; got weight "
                         f"{tuple(weight.shape)} {weight.dtype}, v {tuple(v.shape)} {v.dtype}, iters {iters!r}")
    n, d, c = weight.shape
    k = v.shape[-1]
    kp = max(2, triton.next_power_of_2(k))
    block_d = max(16, triton.next_power_of_2(d))
    block_c = max(16, min(triton.next_power_of_2(c), _TILE // block_d))
    v = v.contiguous()
    v_new = torch.empty_like(v)
    z = torch.empty((n, c, kp), dtype=torch.float32, device=v.device)
    sigma = torch.empty(n, dtype=torch.float32, device=v.device)
    top = torch.empty((n, k), dtype=torch.float32, device=v.device)
    u = torch.empty((n, d), dtype=torch.float32, device=v.device) if pair else sigma
    vp = torch.empty((n, c), dtype=torch.float32, device=v.device) if pair else sigma
    with on_device(weight):  # Monitor.step may run with another device current than the model's
        launch(_power_kernel, (n,), (weight, v, v_new, z, sigma, top, u, vp, d, c, *weight.stride(), iters),
               dict(K=k, KP=kp, BLOCK_D=block_d, BLOCK_C=block_c, SQUARINGS=_SQUARINGS, PAIR=pair,
                    num_warps=_NUM_WARPS))
    return v_new, sigma, top, ((u, vp) if pair else None)
