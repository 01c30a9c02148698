"""Opt-in Hopper (sm_90) variants of the plain forward and of the dK/dV backward kernel.

Off by default: the launchers of ``triton_attn`` use them only where ``tuning.hopper_features``
names the kernel (environment variable FLASHWATCH_HOPPER, or ``tuning.set_hopper``), so that a
device-time A/B (``benchmarks/kernel_ab.py --hopper``) decides before any user gets them.

What differs from ``triton_kernels``' kernels (the arithmetic per score is the same: the same
device helpers, the same order of operations and, for a given block shape, the same order of
accumulation; the forward's row max, and so the statistics' thresholds, are exact maxima):
- tiles come through TMA tensor descriptors (constexpr TMA; one descriptor per head and tensor,
  shape (N, D), so rows >= N read as 0 and are never written, as the masked pointer loads and
  stores of the plain kernels do). TMA needs 16-byte aligned head bases and row strides:
  ``tma_ok`` checks, and the launcher turns TMA off for a call whose inputs are not aligned;
- the key and query loops are ``tl.range`` loops with their own pipeline depth (the
  configuration's num_stages) and, with constexpr WARP_SPECIALIZE, Triton's automatic warp
  specialisation (producer warps issue the TMA loads, consumer warps the matrix products and
  the softmax, as FlashAttention-3 does by hand);
- the block shapes come from their own tuning entries (``tuning.TABLE["fwd_hopper"]`` and
  ``["dkdv_hopper"]``), chosen offline for sm_90 so that neither spills at D=128.
The forward covers the plain and fp32_delta variants with or without statistics (the row max
and the max logit); ``fixed`` and an injected fault keep the plain kernel. The causal schedule
is the plain kernels': query blocks with the most keys first, the masked diagonal blocks last
in the forward; in the dK/dV kernel the diagonal blocks come first, as in the plain kernel, so
that both sum dK and dV in the same order.

The Triton interpreter runs both with TMA on or off (it emulates descriptors) and ignores the
warp specialisation and pipeline hints, so the CPU tests check the same math.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .triton_kernels import (_cast, _dkdv_block, _dot, _head, _key_program, _keys_end, _load_rows, _mask_scores,
                             _online_softmax_step, _query_program, _row_shift, _store_rows, _unmasked_keys_end)


# --------------------------------------------------------------------------------------------
# device helpers: tiles through a descriptor or through pointers
# --------------------------------------------------------------------------------------------

@triton.jit
def _rows_descriptor(base, N, stride, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, TMA: tl.constexpr):
    """A TMA descriptor of one head's (N, HEAD_DIM) rows at ``base`` (row stride ``stride``),
    in blocks of (ROWS, HEAD_DIM); without TMA, the base pointer itself (the pointer path)."""
    if TMA:
        d = tl.make_tensor_descriptor(base, shape=[N, HEAD_DIM], strides=[stride, 1],
                                      block_shape=[ROWS, HEAD_DIM])
    else:
        d = base
    return d


@triton.jit
def _tile(desc, start, rows, stride, offs_d, N, MASKED: tl.constexpr, TMA: tl.constexpr):
    """The (len(rows), D) tile of rows ``rows`` = start + arange: through the descriptor
    (rows >= N are zero-filled) or as ``_load_rows`` reads it (rows >= N read as 0 when MASKED)."""
    if TMA:
        x = desc.load([start, 0])
    else:
        x = _load_rows(desc, rows, stride, offs_d, N, MASKED)
    return x


@triton.jit
def _put_tile(desc, start, rows, stride, offs_d, N, x, TMA: tl.constexpr):
    """Store the tile x at rows start + arange < N (the descriptor clips rows >= N)."""
    if TMA:
        desc.store([start, 0], x)
    else:
        _store_rows(desc, rows, stride, offs_d, N, x)


# --------------------------------------------------------------------------------------------
# forward (plain shift; statistics: row max and max logit only)
# --------------------------------------------------------------------------------------------

@triton.jit
def _fwd_hopper_inner(acc, l_i, m1, shift, q, k_desc, v_desc, skn, svn, offs_m, offs_d, lo, hi, N, sm_scale,
                      BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr, DTYPE: tl.constexpr,
                      IEEE: tl.constexpr, UPCAST: tl.constexpr, EXACT_BF16: tl.constexpr, TMA: tl.constexpr,
                      STAGES: tl.constexpr, WARP_SPECIALIZE: tl.constexpr):
    # the plain branch of triton_kernels._fwd_inner, its block update shared (_online_softmax_step)
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in tl.range(lo, hi, BLOCK_N, num_stages=STAGES, warp_specialize=WARP_SPECIALIZE):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        cols = start_n + offs_n
        k = _tile(k_desc, start_n, cols, skn, offs_d, N, MASKED, TMA)
        v = _tile(v_desc, start_n, cols, svn, offs_d, N, MASKED, TMA)
        qk = _dot(q, tl.trans(k), IEEE, UPCAST)  # (BLOCK_M, BLOCK_N) raw scores q.k
        if MASKED:
            qk = _mask_scores(qk, offs_m, cols, N, CAUSAL)
        new_m1 = tl.maximum(m1, tl.max(qk, 1))
        new_shift = _row_shift(new_m1, 0, sm_scale, 0.0, 0.0, 0.0, False)
        acc, l_i = _online_softmax_step(acc, l_i, shift, new_shift, qk, v, sm_scale, DTYPE, IEEE, UPCAST, EXACT_BF16)
        m1, shift = new_m1, new_shift
    return acc, l_i, m1, shift


@triton.jit
def _attn_fwd_hopper_kernel(Q, K, V, O, LSE, R, ROWMAX, ST_MAXL,
                            sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sob, soh, son,
                            H, G, N, sm_scale,
                            HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            CAUSAL: tl.constexpr, FP32_DELTA: tl.constexpr, STATS: tl.constexpr,
                            IEEE: tl.constexpr, UPCAST: tl.constexpr, EXACT_BF16: tl.constexpr,
                            TMA: tl.constexpr, STAGES: tl.constexpr, WARP_SPECIALIZE: tl.constexpr):
    # grid: (cdiv(N, BLOCK_M), B * H), as triton_kernels._attn_fwd_kernel (plain variant, no
    # injected fault): one program = one block of query rows of one head, longest first (causal)
    start_m, bh, b, h, kvh = _query_program(H, G, BLOCK_M, CAUSAL)
    DTYPE = O.dtype.element_ty
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < N
    k_desc = _rows_descriptor(_head(K, b, kvh, skb, skh), N, skn, BLOCK_N, HEAD_DIM, TMA)
    v_desc = _rows_descriptor(_head(V, b, kvh, svb, svh), N, svn, BLOCK_N, HEAD_DIM, TMA)
    q_desc = _rows_descriptor(_head(Q, b, h, sqb, sqh), N, sqn, BLOCK_M, HEAD_DIM, TMA)
    q = _tile(q_desc, start_m, offs_m, sqn, offs_d, N, True, TMA)

    m1 = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max of raw scores
    shift = tl.full([BLOCK_M], float("-inf"), tl.float32)  # subtracted max, log2 units
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    # unmasked key blocks first, then the masked ones (diagonal and ragged tail) last. Under
    # WARP_SPECIALIZE one loop masks every block (the same values where a score is valid, a
    # compare and a select more per score): Triton 3.6 specialises one loop of a kernel on Hopper
    split = 0 if WARP_SPECIALIZE else _unmasked_keys_end(start_m, N, BLOCK_N, CAUSAL)
    if not WARP_SPECIALIZE:
        acc, l_i, m1, shift = _fwd_hopper_inner(acc, l_i, m1, shift, q, k_desc, v_desc, skn, svn, offs_m, offs_d,
                                                0, split, N, sm_scale, BLOCK_N, False, CAUSAL, DTYPE, IEEE, UPCAST,
                                                EXACT_BF16, TMA, STAGES, False)
    hi = _keys_end(start_m, N, BLOCK_M, CAUSAL)
    acc, l_i, m1, shift = _fwd_hopper_inner(acc, l_i, m1, shift, q, k_desc, v_desc, skn, svn, offs_m, offs_d,
                                            split, hi, N, sm_scale, BLOCK_N, True, CAUSAL, DTYPE, IEEE, UPCAST,
                                            EXACT_BF16, TMA, STAGES, WARP_SPECIALIZE)

    o32 = acc / l_i[:, None]
    o = _cast(o32, DTYPE, EXACT_BF16)
    _put_tile(_rows_descriptor(_head(O, b, h, sob, soh), N, son, BLOCK_M, HEAD_DIM, TMA), start_m, offs_m, son,
              offs_d, N, o, TMA)
    row_base = bh.to(tl.int64) * N  # (B * H, N) arrays: this head's row 0
    tl.store(LSE + row_base + offs_m, shift + tl.math.log2(l_i), mask=row_ok)
    if FP32_DELTA:  # R has O's strides (the launcher allocates it like O)
        r = _cast(o32 - o.to(tl.float32), DTYPE, EXACT_BF16)
        _put_tile(_rows_descriptor(_head(R, b, h, sob, soh), N, son, BLOCK_M, HEAD_DIM, TMA), start_m, offs_m,
                  son, offs_d, N, r, TMA)
    if STATS:
        s1 = m1 * sm_scale  # the row max in natural-log units, as the reference computes it
        tl.store(ROWMAX + row_base + offs_m, s1, mask=row_ok)
        tl.atomic_max(ST_MAXL + h, tl.max(tl.where(row_ok, s1, float("-inf")), 0))


# --------------------------------------------------------------------------------------------
# backward: dK and dV
# --------------------------------------------------------------------------------------------

@triton.jit
def _bwd_dkdv_hopper_inner(dk, dv, k, v, q_desc, do_desc, lse_base, delta_base, sqn, sdon, offs_n, offs_d,
                           lo, hi, N, qk_scale,
                           BLOCK_M: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr, DTYPE: tl.constexpr,
                           IEEE: tl.constexpr, UPCAST: tl.constexpr, EXACT_BF16: tl.constexpr, TMA: tl.constexpr,
                           STAGES: tl.constexpr, WARP_SPECIALIZE: tl.constexpr):
    # triton_kernels._bwd_dkdv_inner with tile loads by descriptor; the block's work is shared (_dkdv_block)
    offs_mb = tl.arange(0, BLOCK_M)
    for start_m in tl.range(lo, hi, BLOCK_M, num_stages=STAGES, warp_specialize=WARP_SPECIALIZE):
        start_m = tl.multiple_of(start_m, BLOCK_M)
        rows = start_m + offs_mb
        q = _tile(q_desc, start_m, rows, sqn, offs_d, N, MASKED, TMA)
        do = _tile(do_desc, start_m, rows, sdon, offs_d, N, MASKED, TMA)
        dk, dv = _dkdv_block(dk, dv, k, v, q, do, lse_base, delta_base, rows, offs_n, N, qk_scale, lse_base, 0, 0,
                             1.0, MASKED, CAUSAL, 0, DTYPE, IEEE, UPCAST, EXACT_BF16)  # no attn_mask (MASK_KIND 0)
    return dk, dv


@triton.jit
def _attn_bwd_dkdv_hopper_kernel(Q, K, V, DO, LSE, DELTA, DK, DV,
                                 sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sdob, sdoh, sdon,
                                 H, G, N, sm_scale,
                                 HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                                 CAUSAL: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
                                 EXACT_BF16: tl.constexpr, TMA: tl.constexpr, STAGES: tl.constexpr,
                                 WARP_SPECIALIZE: tl.constexpr):
    # grid: (cdiv(N, BLOCK_N), B * Hkv), as triton_kernels._attn_bwd_dkdv_kernel: one program =
    # one block of keys of one kv head, looping over the G query heads that read it and over
    # their query blocks, in the same order (diagonal blocks, unmasked blocks, ragged tail)
    start_n, bkv, b, kvh = _key_program(H, G, BLOCK_N)
    DTYPE = DK.dtype.element_ty
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    k = _tile(_rows_descriptor(_head(K, b, kvh, skb, skh), N, skn, BLOCK_N, HEAD_DIM, TMA), start_n, offs_n, skn,
              offs_d, N, True, TMA)
    v = _tile(_rows_descriptor(_head(V, b, kvh, svb, svh), N, svn, BLOCK_N, HEAD_DIM, TMA), start_n, offs_n, svn,
              offs_d, N, True, TMA)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    qk_scale = sm_scale * 1.4426950408889634
    m_full = (N // BLOCK_M) * BLOCK_M
    for g in range(0, G):
        h = kvh * G + g
        q_desc = _rows_descriptor(_head(Q, b, h, sqb, sqh), N, sqn, BLOCK_M, HEAD_DIM, TMA)
        do_desc = _rows_descriptor(_head(DO, b, h, sdob, sdoh), N, sdon, BLOCK_M, HEAD_DIM, TMA)
        lse_base = LSE + (b * H + h).to(tl.int64) * N
        delta_base = DELTA + (b * H + h).to(tl.int64) * N
        if WARP_SPECIALIZE:
            # one loop, every block masked (see the forward): from the diagonal on when causal
            dk, dv = _bwd_dkdv_hopper_inner(dk, dv, k, v, q_desc, do_desc, lse_base, delta_base, sqn, sdon, offs_n,
                                            offs_d, start_n if CAUSAL else 0, N, N, qk_scale, BLOCK_M, True, CAUSAL,
                                            DTYPE, IEEE, UPCAST, EXACT_BF16, TMA, STAGES, True)
        else:
            if CAUSAL:
                # query blocks crossing the diagonal of this key block are masked; later ones are not
                dk, dv = _bwd_dkdv_hopper_inner(dk, dv, k, v, q_desc, do_desc, lse_base, delta_base, sqn, sdon,
                                                offs_n, offs_d, start_n, start_n + BLOCK_N, N, qk_scale, BLOCK_M, True,
                                                CAUSAL, DTYPE, IEEE, UPCAST, EXACT_BF16, TMA, STAGES, False)
                dk, dv = _bwd_dkdv_hopper_inner(dk, dv, k, v, q_desc, do_desc, lse_base, delta_base, sqn, sdon,
                                                offs_n, offs_d, start_n + BLOCK_N, m_full, N, qk_scale, BLOCK_M, False,
                                                CAUSAL, DTYPE, IEEE, UPCAST, EXACT_BF16, TMA, STAGES, False)
                tail_lo = tl.maximum(m_full, start_n + BLOCK_N)
            else:
                dk, dv = _bwd_dkdv_hopper_inner(dk, dv, k, v, q_desc, do_desc, lse_base, delta_base, sqn, sdon,
                                                offs_n, offs_d, 0, m_full, N, qk_scale, BLOCK_M, False, CAUSAL,
                                                DTYPE, IEEE, UPCAST, EXACT_BF16, TMA, STAGES, False)
                tail_lo = m_full
            dk, dv = _bwd_dkdv_hopper_inner(dk, dv, k, v, q_desc, do_desc, lse_base, delta_base, sqn, sdon, offs_n,
                                            offs_d, tail_lo, N, N, qk_scale, BLOCK_M, True, CAUSAL,
                                            DTYPE, IEEE, UPCAST, EXACT_BF16, TMA, STAGES, False)
    out_base = bkv.to(tl.int64) * N * HEAD_DIM  # dK, dV: contiguous (B, Hkv, N, D)
    _put_tile(_rows_descriptor(DK + out_base, N, HEAD_DIM, BLOCK_N, HEAD_DIM, TMA), start_n, offs_n, HEAD_DIM, offs_d,
              N, _cast(dk * sm_scale, DTYPE, EXACT_BF16), TMA)
    _put_tile(_rows_descriptor(DV + out_base, N, HEAD_DIM, BLOCK_N, HEAD_DIM, TMA), start_n, offs_n, HEAD_DIM, offs_d,
              N, _cast(dv, DTYPE, EXACT_BF16), TMA)
