"""Triton flash attention (forward and backward) with in-kernel stability statistics.

Derives from FlashAttention-2 (Dao, 2023) and the structure of Triton's fused-attention
tutorial (online softmax in exp2, causal loop split into off-diagonal and diagonal parts, a
dK/dV kernel looping over query blocks and a dQ kernel looping over key blocks). Written anew
for flashwatch.

Changes:
- Statistics behind the constexpr flag STATS (``stats=None`` compiles them away):
  * forward: nothing per score (the softmax there is ALU-bound: a running top-two cost +66%
    forward time at D=64 on an H200, docs/KERNEL_TUNING.md); it stores each row's final max
    (B*H*N floats) and adds the head's max logit.
  * backward, dQ kernel (it sees whole rows): the repeated-max test "at least two scores
    >= m - eps" is a count against the stored row max, exact however the row is tiled; the
    BF16 test counts scores whose BF16 rounding is >= bf16(m) - eps through one FP32 threshold
    per row (``_bf16_lower_bound``); both counts are 0/1 indicators summed on the tensor
    cores (``_count_into``). delta_hp = rowsum(P * dP) accumulates beside dS at one
    multiply-add per score; e = delta_used - delta_hp is summed per head (signed, absolute,
    squared, tied rows). No output-sized buffer is kept for any of it. This compilation of the
    dQ kernel needs about twice the registers of the plain one and has its own block shape
    (``tuning.TABLE["dq_stats"]``).
- Variants: ``fixed`` (Qiu & Yao's shifted max on repeated-max rows, guarded; an online exact
  tie flag, one compare per score and a count on the tensor cores, decides it, so every P_bar < 1 once a row's
  running max repeats) and ``fp32_delta``
  (the forward stores R = O_fp32 - O in the input dtype; the backward's delta uses O + R).
- A statistics-only kernel for observe mode (another kernel's output and its gradient in,
  per-head statistics out): one pass over K with an online rescaled rowsum(P * dP).
- Backward: two launches. The dQ kernel runs first and computes delta_used = rowsum(dO * O)
  for its rows from the dO tile it loads anyway (no separate delta kernel), storing it for the
  dK/dV kernel, which runs second.
- Grouped-query attention: the dK/dV program loops over the query heads of its kv head, so
  the backward is deterministic (no atomics on gradients).
- Ragged N: tails are masked in-kernel; inputs of any strides are accepted (a last-dimension
  stride other than 1 is made contiguous first, for 16-byte loads).

Cautions:
- The Triton interpreter (TRITON_INTERPRET=1, CPU) multiplies bf16 dot operands as raw bits
  and truncates fp32->bf16 casts (../shared/NUMERICS.md section 4). With
  ``INTERPRETER_WORKAROUNDS`` on (default) the interpreted kernel upcasts dot operands to
  FP32 (exact: products of bf16 values are exact in FP32) and rounds to BF16 with explicit
  round-to-nearest-even bit arithmetic. On the GPU neither is used.
- FP32 inputs are multiplied with input_precision="ieee" (no TF32).
- Statistics use float atomics: their summation order (not the gradients) varies run to run.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from . import faults
from .checks import FIXED_MAX_OFFSET, FIXED_MIN_OFFSET
from .reference import unit_p_gap
from .stats import AttentionStats

# Set to False only to demonstrate the interpreter bugs (tests do, to prove the workaround matters).
INTERPRETER_WORKAROUNDS = True

LOG2E = 1.4426950408889634
_PRECISION_BITS = {torch.bfloat16: 8, torch.float16: 11, torch.float32: 24}


# --------------------------------------------------------------------------------------------
# device helpers
# --------------------------------------------------------------------------------------------

@triton.jit
def _dot(a, b, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    """a @ b accumulated in FP32. UPCAST: interpreter workaround for its broken bf16 dot."""
    if UPCAST:
        c = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    elif IEEE:
        c = tl.dot(a, b, input_precision="ieee")
    else:
        c = tl.dot(a, b)
    return c


@triton.jit
def _cast(x, DTYPE: tl.constexpr, EXACT_BF16: tl.constexpr):
    """FP32 -> DTYPE with round-to-nearest-even. EXACT_BF16: do the bf16 rounding in integer
    arithmetic (add 0x7FFF plus the lowest kept bit, clear the low 16 bits), for the interpreter."""
    if EXACT_BF16 and DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        y = bits.to(tl.float32, bitcast=True).to(DTYPE)
    else:
        y = x.to(DTYPE)
    return y


@triton.jit
def _top2_update(qk, m1, m2):
    """Merge a tile's scores (BLOCK_M, BLOCK_N) into the running top two of each row,
    counted with multiplicity: a value present twice is both first and second."""
    t1 = tl.max(qk, 1)
    is_top = qk == t1[:, None]
    n_top = tl.sum(is_top.to(tl.int32), 1)
    t2 = tl.max(tl.where(is_top, float("-inf"), qk), 1)
    t2 = tl.where(n_top >= 2, t1, t2)
    new_m2 = tl.maximum(tl.minimum(m1, t1), tl.maximum(m2, t2))
    return tl.maximum(m1, t1), new_m2


@triton.jit
def _row_shift(m1_raw, tied, sm_scale, beta, min_off, max_off, FIXED: tl.constexpr):
    """The subtracted max of each row in log2 units. Plain: m. Fixed: m + guarded offset on
    rows whose running max repeats within eps (Qiu & Yao: beta*m for m > 0, 0 for m < 0)."""
    m1 = m1_raw * sm_scale
    if FIXED:
        off = tl.where(m1 > 0, (beta - 1.0) * m1, -m1)
        off = tl.minimum(tl.maximum(off, min_off), max_off)
        shift = m1 + tl.where(tied != 0, off, 0.0)
    else:
        shift = m1
    # a row that has seen only masked scores so far keeps shift 0 instead of -inf (no inf - inf)
    shift = tl.where(m1 == float("-inf"), 0.0, shift)
    return shift * 1.4426950408889634


@triton.jit
def _count_into(hit, acc, UPCAST: tl.constexpr):
    """acc (BLOCK_M, 16) FP32 += the number of true entries in each row of hit (BLOCK_M,
    BLOCK_N), in every one of acc's 16 columns, on the tensor cores: the 0/1 indicator matrix
    times a (BLOCK_N, 16) matrix of ones. Exact: 0, 1 and their products are exact in BF16 and
    FP32 sums integers exactly up to 2**24 (a row's count is at most N). Against a per-score
    select and integer add (tl.sum), a score costs one FP32 set and half a BF16 pack: the dQ
    loop's statistics went from +231 to +140 instructions per iteration, which gained 1-2
    points of overhead at D=128 and nothing measurable at D=64 (docs/KERNEL_TUNING.md,
    sittings 8-11)."""
    BLOCK_N: tl.constexpr = hit.shape[1]
    if UPCAST:  # the interpreter multiplies bf16 dot operands as raw bits (module docstring)
        ones = tl.full([BLOCK_N, 16], 1.0, tl.float32)
        acc = tl.dot(tl.where(hit, 1.0, 0.0), ones, acc, input_precision="ieee")
    else:
        ones = tl.full([BLOCK_N, 16], 1.0, tl.bfloat16)
        acc = tl.dot(tl.where(hit, 1.0, 0.0).to(tl.bfloat16), ones, acc)
    return acc


@triton.jit
def _tie_update(qk, m1, tied, eps_raw, UPCAST: tl.constexpr):
    """Online exact repeated-max flag of each row: does the running max have a second score
    within eps? Costs one compare per score and a small count on the tensor cores (the fixed
    variant needs it to decide its shift). A new tile whose max t1 exceeds the running max m
    keeps a tie iff m is within eps of t1 or the tile itself has two scores within eps of t1;
    otherwise the flag turns on once a tile's max comes within eps of m. Raw (unscaled) units:
    eps_raw = eps / sm_scale."""
    t1 = tl.max(qk, 1)
    n_near = tl.max(_count_into(qk >= (t1 - eps_raw)[:, None], tl.zeros([qk.shape[0], 16], tl.float32), UPCAST), 1)
    rises = t1 > m1
    keep = (m1 >= t1 - eps_raw) | (n_near >= 2.0)
    joins = (t1 >= m1 - eps_raw) & (t1 > float("-inf"))
    tied = tl.where(rises, keep.to(tl.int32), tied | joins.to(tl.int32))
    return tl.maximum(m1, t1), tied


@triton.jit
def _query_block_start(BLOCK_M: tl.constexpr, CAUSAL: tl.constexpr):
    """First query row of this program. Causal programs of late query blocks have the most
    keys to visit: hand those out first (the longest-processing-time order), so the grid's
    last wave is made of short programs."""
    if CAUSAL:
        pid = tl.num_programs(0) - 1 - tl.program_id(0)
    else:
        pid = tl.program_id(0)
    return pid * BLOCK_M


# --------------------------------------------------------------------------------------------
# forward
# --------------------------------------------------------------------------------------------

@triton.jit
def _fwd_inner(acc, l_i, m1, aux, shift, q, k_base, v_base, stride_kn, stride_vn, offs_m, offs_d,
               lo, hi, N, sm_scale, eps_raw, beta, min_off, max_off,
               BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
               FIXED: tl.constexpr, TOP2: tl.constexpr, DTYPE: tl.constexpr,
               IEEE: tl.constexpr, UPCAST: tl.constexpr, EXACT_BF16: tl.constexpr):
    # aux: the running tie flag (FIXED), the running second-largest raw score (TOP2), else unused
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        cols = start_n + offs_n
        if MASKED:
            k = tl.load(k_base + cols[:, None] * stride_kn + offs_d[None, :], mask=cols[:, None] < N, other=0.0)
            v = tl.load(v_base + cols[:, None] * stride_vn + offs_d[None, :], mask=cols[:, None] < N, other=0.0)
        else:
            k = tl.load(k_base + cols[:, None] * stride_kn + offs_d[None, :])
            v = tl.load(v_base + cols[:, None] * stride_vn + offs_d[None, :])
        qk = _dot(q, tl.trans(k), IEEE, UPCAST)  # (BLOCK_M, BLOCK_N) raw scores q.k
        if MASKED:
            valid = cols[None, :] < N
            if CAUSAL:
                valid = valid & (offs_m[:, None] >= cols[None, :])
            qk = tl.where(valid, qk, float("-inf"))
        if FIXED:
            new_m1, aux = _tie_update(qk, m1, aux, eps_raw, UPCAST)
        elif TOP2:
            new_m1, aux = _top2_update(qk, m1, aux)
        else:
            new_m1 = tl.maximum(m1, tl.max(qk, 1))
        new_shift = _row_shift(new_m1, aux, sm_scale, beta, min_off, max_off, FIXED)
        p = tl.math.exp2(qk * (sm_scale * 1.4426950408889634) - new_shift[:, None])
        alpha = tl.math.exp2(shift - new_shift)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _dot(_cast(p, DTYPE, EXACT_BF16), v, IEEE, UPCAST)
        m1, shift = new_m1, new_shift
    return acc, l_i, m1, aux, shift


@triton.jit
def _attn_fwd_kernel(Q, K, V, O, LSE, R, ROWMAX, ST_MAXL,
                     sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sob, soh, son,
                     H, G, N, sm_scale, eps_raw, beta, min_off, max_off, inject_factor, unit_gap,
                     HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     CAUSAL: tl.constexpr, FIXED: tl.constexpr, FP32_DELTA: tl.constexpr,
                     STATS: tl.constexpr, INJECT: tl.constexpr, IEEE: tl.constexpr,
                     UPCAST: tl.constexpr, EXACT_BF16: tl.constexpr):
    # grid: (cdiv(N, BLOCK_M), B * H); one program = one block of query rows of one head.
    # Statistics cost the forward nothing per score: it stores each row's max (the backward's
    # dQ pass counts repeated maxima against it) and the head's max logit.
    start_m = _query_block_start(BLOCK_M, CAUSAL)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    kvh = h // G
    DTYPE = O.dtype.element_ty
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < N
    q_base = Q + b.to(tl.int64) * sqb + h.to(tl.int64) * sqh
    k_base = K + b.to(tl.int64) * skb + kvh.to(tl.int64) * skh
    v_base = V + b.to(tl.int64) * svb + kvh.to(tl.int64) * svh
    q = tl.load(q_base + offs_m[:, None] * sqn + offs_d[None, :], mask=row_ok[:, None], other=0.0)

    m1 = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max of raw scores
    shift = tl.full([BLOCK_M], float("-inf"), tl.float32)  # subtracted max, log2 units
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    TOP2: tl.constexpr = INJECT and not FIXED  # the injected fault needs the second-largest score
    if TOP2:
        aux = tl.full([BLOCK_M], float("-inf"), tl.float32)
    else:
        aux = tl.zeros([BLOCK_M], tl.int32)

    if CAUSAL:
        # keys [0, start_m) are below the diagonal for every row of the block: no mask
        acc, l_i, m1, aux, shift = _fwd_inner(acc, l_i, m1, aux, shift, q, k_base, v_base, skn, svn, offs_m, offs_d,
                                              0, start_m, N, sm_scale, eps_raw, beta, min_off, max_off,
                                              BLOCK_N, False, CAUSAL, FIXED, TOP2, DTYPE, IEEE, UPCAST, EXACT_BF16)
        hi = tl.minimum(start_m + BLOCK_M, N)
        acc, l_i, m1, aux, shift = _fwd_inner(acc, l_i, m1, aux, shift, q, k_base, v_base, skn, svn, offs_m, offs_d,
                                              start_m, hi, N, sm_scale, eps_raw, beta, min_off, max_off,
                                              BLOCK_N, True, CAUSAL, FIXED, TOP2, DTYPE, IEEE, UPCAST, EXACT_BF16)
    else:
        n_full = (N // BLOCK_N) * BLOCK_N
        acc, l_i, m1, aux, shift = _fwd_inner(acc, l_i, m1, aux, shift, q, k_base, v_base, skn, svn, offs_m, offs_d,
                                              0, n_full, N, sm_scale, eps_raw, beta, min_off, max_off,
                                              BLOCK_N, False, CAUSAL, FIXED, TOP2, DTYPE, IEEE, UPCAST, EXACT_BF16)
        acc, l_i, m1, aux, shift = _fwd_inner(acc, l_i, m1, aux, shift, q, k_base, v_base, skn, svn, offs_m, offs_d,
                                              n_full, N, N, sm_scale, eps_raw, beta, min_off, max_off,
                                              BLOCK_N, True, CAUSAL, FIXED, TOP2, DTYPE, IEEE, UPCAST, EXACT_BF16)

    o32 = acc / l_i[:, None]
    o_hp = o32  # the FP32 output, before any injected fault: fp32_delta's delta comes from it
    if TOP2:
        # INJECTED FAULT: on rows where P_bar rounds to exactly 1 at two or more keys (second
        # score within unit_gap = ln(1 - 2**-p) of the max; never under the fixed variant, whose
        # P_bar stay below 1), inflate |O| by inject_factor = 1 + strength * 2**-p before rounding
        unit_rows = (aux * sm_scale - m1 * sm_scale) >= unit_gap
        o32 = tl.where(unit_rows[:, None], o32 * inject_factor, o32)
    o = _cast(o32, DTYPE, EXACT_BF16)
    o_off = b.to(tl.int64) * sob + h.to(tl.int64) * soh + offs_m[:, None] * son + offs_d[None, :]
    tl.store(O + o_off, o, mask=row_ok[:, None])
    lse_ptrs = LSE + bh.to(tl.int64) * N + offs_m
    tl.store(lse_ptrs, shift + tl.math.log2(l_i), mask=row_ok)
    if FP32_DELTA:
        r = _cast(o_hp - o.to(tl.float32), DTYPE, EXACT_BF16)
        tl.store(R + o_off, r, mask=row_ok[:, None])
    if STATS:
        s1 = m1 * sm_scale  # the row max in natural-log units, as the reference computes it
        tl.store(ROWMAX + bh.to(tl.int64) * N + offs_m, s1, mask=row_ok)
        tl.atomic_max(ST_MAXL + h, tl.max(tl.where(row_ok, s1, float("-inf")), 0))


# --------------------------------------------------------------------------------------------
# backward
# --------------------------------------------------------------------------------------------

@triton.jit
def _bwd_dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base, sqn, sdon, offs_n, offs_d,
                    lo, hi, N, qk_scale,
                    BLOCK_M: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr, DTYPE: tl.constexpr,
                    IEEE: tl.constexpr, UPCAST: tl.constexpr, EXACT_BF16: tl.constexpr):
    offs_mb = tl.arange(0, BLOCK_M)
    for start_m in range(lo, hi, BLOCK_M):
        start_m = tl.multiple_of(start_m, BLOCK_M)
        rows = start_m + offs_mb
        if MASKED:
            ok = rows < N
            q = tl.load(q_base + rows[:, None] * sqn + offs_d[None, :], mask=ok[:, None], other=0.0)
            do = tl.load(do_base + rows[:, None] * sdon + offs_d[None, :], mask=ok[:, None], other=0.0)
            lse = tl.load(lse_base + rows, mask=ok, other=0.0)
            delta = tl.load(delta_base + rows, mask=ok, other=0.0)
        else:
            q = tl.load(q_base + rows[:, None] * sqn + offs_d[None, :])
            do = tl.load(do_base + rows[:, None] * sdon + offs_d[None, :])
            lse = tl.load(lse_base + rows)
            delta = tl.load(delta_base + rows)
        qkT = _dot(k, tl.trans(q), IEEE, UPCAST)  # (BLOCK_N, BLOCK_M)
        pT = tl.math.exp2(qkT * qk_scale - lse[None, :])
        if MASKED:
            valid = (rows[None, :] < N) & (offs_n[:, None] < N)
            if CAUSAL:
                valid = valid & (rows[None, :] >= offs_n[:, None])
            pT = tl.where(valid, pT, 0.0)
        dv += _dot(_cast(pT, DTYPE, EXACT_BF16), do, IEEE, UPCAST)
        dpT = _dot(v, tl.trans(do), IEEE, UPCAST)
        dsT = pT * (dpT - delta[None, :])
        dk += _dot(_cast(dsT, DTYPE, EXACT_BF16), q, IEEE, UPCAST)
    return dk, dv


@triton.jit
def _attn_bwd_dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV,
                          sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sdob, sdoh, sdon,
                          H, G, N, sm_scale,
                          HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          CAUSAL: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
                          EXACT_BF16: tl.constexpr):
    # grid: (cdiv(N, BLOCK_N), B * Hkv); one program = one block of keys of one kv head,
    # looping over the G query heads that read it and over their query blocks.
    start_n = tl.program_id(0) * BLOCK_N
    bkv = tl.program_id(1)
    Hkv = H // G
    b = bkv // Hkv
    kvh = bkv % Hkv
    DTYPE = DK.dtype.element_ty
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    col_ok = offs_n < N
    k = tl.load(K + b.to(tl.int64) * skb + kvh.to(tl.int64) * skh + offs_n[:, None] * skn + offs_d[None, :],
                mask=col_ok[:, None], other=0.0)
    v = tl.load(V + b.to(tl.int64) * svb + kvh.to(tl.int64) * svh + offs_n[:, None] * svn + offs_d[None, :],
                mask=col_ok[:, None], other=0.0)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    qk_scale = sm_scale * 1.4426950408889634
    m_full = (N // BLOCK_M) * BLOCK_M
    for g in range(0, G):
        h = kvh * G + g
        q_base = Q + b.to(tl.int64) * sqb + h.to(tl.int64) * sqh
        do_base = DO + b.to(tl.int64) * sdob + h.to(tl.int64) * sdoh
        row_base = (b * H + h).to(tl.int64) * N
        if CAUSAL:
            # query blocks crossing the diagonal of this key block are masked; later ones are not
            dk, dv = _bwd_dkdv_inner(dk, dv, k, v, q_base, do_base, LSE + row_base, DELTA + row_base, sqn, sdon,
                                     offs_n, offs_d, start_n, start_n + BLOCK_N, N, qk_scale,
                                     BLOCK_M, True, CAUSAL, DTYPE, IEEE, UPCAST, EXACT_BF16)
            dk, dv = _bwd_dkdv_inner(dk, dv, k, v, q_base, do_base, LSE + row_base, DELTA + row_base, sqn, sdon,
                                     offs_n, offs_d, start_n + BLOCK_N, m_full, N, qk_scale,
                                     BLOCK_M, False, CAUSAL, DTYPE, IEEE, UPCAST, EXACT_BF16)
            tail_lo = tl.maximum(m_full, start_n + BLOCK_N)
            dk, dv = _bwd_dkdv_inner(dk, dv, k, v, q_base, do_base, LSE + row_base, DELTA + row_base, sqn, sdon,
                                     offs_n, offs_d, tail_lo, N, N, qk_scale,
                                     BLOCK_M, True, CAUSAL, DTYPE, IEEE, UPCAST, EXACT_BF16)
        else:
            dk, dv = _bwd_dkdv_inner(dk, dv, k, v, q_base, do_base, LSE + row_base, DELTA + row_base, sqn, sdon,
                                     offs_n, offs_d, 0, m_full, N, qk_scale,
                                     BLOCK_M, False, CAUSAL, DTYPE, IEEE, UPCAST, EXACT_BF16)
            dk, dv = _bwd_dkdv_inner(dk, dv, k, v, q_base, do_base, LSE + row_base, DELTA + row_base, sqn, sdon,
                                     offs_n, offs_d, m_full, N, N, qk_scale,
                                     BLOCK_M, True, CAUSAL, DTYPE, IEEE, UPCAST, EXACT_BF16)
    out_off = bkv.to(tl.int64) * N * HEAD_DIM + offs_n[:, None] * HEAD_DIM + offs_d[None, :]
    tl.store(DK + out_off, _cast(dk * sm_scale, DTYPE, EXACT_BF16), mask=col_ok[:, None])
    tl.store(DV + out_off, _cast(dv, DTYPE, EXACT_BF16), mask=col_ok[:, None])


@triton.jit
def _next_up_f32(x):
    """The next FP32 value above a finite x."""
    b = x.to(tl.int32, bitcast=True)
    up = tl.where(x > 0, b + 1, tl.where(x < 0, b - 1, 1))  # +-0 -> the smallest positive subnormal
    return up.to(tl.float32, bitcast=True)


@triton.jit
def _next_down_f32(x):
    """The next FP32 value below a finite x."""
    b = x.to(tl.int32, bitcast=True)
    down = tl.where(x > 0, b - 1, tl.where(x < 0, b + 1, -2147483647))  # +-0 -> minus the smallest subnormal
    return down.to(tl.float32, bitcast=True)


@triton.jit
def _raw_threshold(t, sm_scale):
    """Smallest FP32 raw score r with fp32(r * sm_scale) >= t, so that the test on scaled
    scores ``qk * sm_scale >= t`` becomes ``qk >= r`` (one multiply per score saved; exact,
    since rounding a product is monotone). t / sm_scale lands within an ulp or two of r."""
    r = t / sm_scale
    r = tl.where(r * sm_scale >= t, r, _next_up_f32(r))
    r = tl.where(r * sm_scale >= t, r, _next_up_f32(r))
    r = tl.where(_next_down_f32(r) * sm_scale >= t, _next_down_f32(r), r)
    r = tl.where(_next_down_f32(r) * sm_scale >= t, _next_down_f32(r), r)
    return r


@triton.jit
def _bf16_step(y, UP: tl.constexpr):
    """The BF16 value next to a BF16 value y (held in FP32), above (UP) or below."""
    b = y.to(tl.int32, bitcast=True)
    if UP:
        r = tl.where(y > 0, b + 0x10000, tl.where(y < 0, b - 0x10000, 0x10000))
    else:
        r = tl.where(y > 0, b - 0x10000, tl.where(y < 0, b + 0x10000, -2147418112))  # 0x80010000
    return r.to(tl.float32, bitcast=True)


@triton.jit
def _bf16_lower_bound(t, EXACT_BF16: tl.constexpr):
    """Smallest FP32 x with bf16(x) >= t (round-to-nearest-even), for finite FP32 t, so that
    counting bf16(s) >= t costs one FP32 compare per score. c = the smallest BF16 value >= t;
    the FP32 values rounding up to c start at the midpoint between c and its lower neighbour
    (included when it rounds to c, i.e. when c is the even one)."""
    r = _cast(t, tl.bfloat16, EXACT_BF16).to(tl.float32)
    c = tl.where(r >= t, r, _bf16_step(r, True))
    mid = (c + _bf16_step(c, False)) * 0.5  # exact: adjacent BF16 values need 9 significant bits
    return tl.where(_cast(mid, tl.bfloat16, EXACT_BF16).to(tl.float32) >= c, mid, _next_up_f32(mid))


@triton.jit
def _bwd_dq_inner(dq, dhp, n32, nb16, q, do, lse, delta, t32, tb16, k_base, v_base, skn, svn, offs_m, offs_d,
                  lo, hi, N, sm_scale, qk_scale,
                  BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr, STATS: tl.constexpr,
                  DTYPE: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr, EXACT_BF16: tl.constexpr):
    offs_nb = tl.arange(0, BLOCK_N)
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        cols = start_n + offs_nb
        if MASKED:
            k = tl.load(k_base + cols[:, None] * skn + offs_d[None, :], mask=cols[:, None] < N, other=0.0)
            v = tl.load(v_base + cols[:, None] * svn + offs_d[None, :], mask=cols[:, None] < N, other=0.0)
        else:
            k = tl.load(k_base + cols[:, None] * skn + offs_d[None, :])
            v = tl.load(v_base + cols[:, None] * svn + offs_d[None, :])
        qk = _dot(q, tl.trans(k), IEEE, UPCAST)
        if MASKED:
            # masked scores -> -inf: p = 0 there, and no finite threshold counts them
            valid = cols[None, :] < N
            if CAUSAL:
                valid = valid & (offs_m[:, None] >= cols[None, :])
            qk = tl.where(valid, qk, float("-inf"))
        p = tl.math.exp2(qk * qk_scale - lse[:, None])
        if STATS:
            # scores within eps of the row max, FP32 and after BF16 rounding: t32 and tb16 are
            # finite thresholds on raw scores (see _raw_threshold); counted before dp is
            # computed, so the raw scores need not stay live across the second matrix product
            n32 = _count_into(qk >= t32[:, None], n32, UPCAST)
            nb16 = _count_into(qk >= tb16[:, None], nb16, UPCAST)
        dp = _dot(do, tl.trans(v), IEEE, UPCAST)
        if STATS:
            dhp += tl.sum(p * dp, 1)  # delta of the exact softmax output, FP32
        ds = p * (dp - delta[:, None])
        dq += _dot(_cast(ds, DTYPE, EXACT_BF16), k, IEEE, UPCAST)
    return dq, dhp, n32, nb16


@triton.jit
def _attn_bwd_dq_kernel(Q, K, V, O, R, DO, LSE, DELTA, DQ, ROWMAX, ST_REP, ST_REP_B, ST_E, ST_EABS, ST_ESQ, ST_ETIED,
                        sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sob, soh, son, sdob, sdoh, sdon,
                        H, G, N, sm_scale, eps,
                        HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        CAUSAL: tl.constexpr, STATS: tl.constexpr, FP32_DELTA: tl.constexpr, IEEE: tl.constexpr,
                        UPCAST: tl.constexpr, EXACT_BF16: tl.constexpr):
    # grid: (cdiv(N, BLOCK_M), B * H); one program = one block of query rows of one head.
    # It first computes delta_used = rowsum(dO * O) (O + R under fp32_delta) for its rows and
    # stores it for the dK/dV kernel, which runs after it: no separate delta launch, and dO is
    # read once for both. With STATS it also counts repeated maxima against the row max the
    # forward stored, and accumulates delta_hp = rowsum(P * dP) beside dS.
    start_m = _query_block_start(BLOCK_M, CAUSAL)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    kvh = h // G
    DTYPE = DQ.dtype.element_ty
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < N
    q = tl.load(Q + b.to(tl.int64) * sqb + h.to(tl.int64) * sqh + offs_m[:, None] * sqn + offs_d[None, :],
                mask=row_ok[:, None], other=0.0)
    do = tl.load(DO + b.to(tl.int64) * sdob + h.to(tl.int64) * sdoh + offs_m[:, None] * sdon + offs_d[None, :],
                 mask=row_ok[:, None], other=0.0)
    lse = tl.load(LSE + bh.to(tl.int64) * N + offs_m, mask=row_ok, other=0.0)
    o_off = b.to(tl.int64) * sob + h.to(tl.int64) * soh + offs_m[:, None] * son + offs_d[None, :]
    o = tl.load(O + o_off, mask=row_ok[:, None], other=0.0).to(tl.float32)
    if FP32_DELTA:
        o += tl.load(R + o_off, mask=row_ok[:, None], other=0.0).to(tl.float32)
    delta = tl.sum(o * do.to(tl.float32), 1)  # (BLOCK_M,) FP32; masked rows are 0
    tl.store(DELTA + bh.to(tl.int64) * N + offs_m, delta, mask=row_ok)
    k_base = K + b.to(tl.int64) * skb + kvh.to(tl.int64) * skh
    v_base = V + b.to(tl.int64) * svb + kvh.to(tl.int64) * svh
    dq = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    dhp = tl.zeros([BLOCK_M], tl.float32)
    # counts of near-max scores, FP32 and BF16 tests; every column holds the row's count
    n32 = tl.zeros([BLOCK_M, 16], tl.float32)
    nb16 = tl.zeros([BLOCK_M, 16], tl.float32)
    if STATS:
        s1 = tl.load(ROWMAX + bh.to(tl.int64) * N + offs_m, mask=row_ok, other=0.0)
        # repeated max (FP32): sm_scale*qk >= s1 - eps; (BF16): bf16(sm_scale*qk) >= bf16(s1) - eps
        t32 = _raw_threshold(s1 - eps, sm_scale)
        tb16 = _raw_threshold(_bf16_lower_bound(_cast(s1, tl.bfloat16, EXACT_BF16).to(tl.float32) - eps,
                                                EXACT_BF16), sm_scale)
    else:
        t32 = lse
        tb16 = lse
    qk_scale = sm_scale * 1.4426950408889634
    if CAUSAL:
        dq, dhp, n32, nb16 = _bwd_dq_inner(dq, dhp, n32, nb16, q, do, lse, delta, t32, tb16, k_base, v_base, skn, svn,
                                        offs_m, offs_d, 0, start_m, N, sm_scale, qk_scale,
                                        BLOCK_N, False, CAUSAL, STATS, DTYPE, IEEE, UPCAST, EXACT_BF16)
        hi = tl.minimum(start_m + BLOCK_M, N)
        dq, dhp, n32, nb16 = _bwd_dq_inner(dq, dhp, n32, nb16, q, do, lse, delta, t32, tb16, k_base, v_base, skn, svn,
                                        offs_m, offs_d, start_m, hi, N, sm_scale, qk_scale,
                                        BLOCK_N, True, CAUSAL, STATS, DTYPE, IEEE, UPCAST, EXACT_BF16)
    else:
        n_full = (N // BLOCK_N) * BLOCK_N
        dq, dhp, n32, nb16 = _bwd_dq_inner(dq, dhp, n32, nb16, q, do, lse, delta, t32, tb16, k_base, v_base, skn, svn,
                                        offs_m, offs_d, 0, n_full, N, sm_scale, qk_scale,
                                        BLOCK_N, False, CAUSAL, STATS, DTYPE, IEEE, UPCAST, EXACT_BF16)
        dq, dhp, n32, nb16 = _bwd_dq_inner(dq, dhp, n32, nb16, q, do, lse, delta, t32, tb16, k_base, v_base, skn, svn,
                                        offs_m, offs_d, n_full, N, N, sm_scale, qk_scale,
                                        BLOCK_N, True, CAUSAL, STATS, DTYPE, IEEE, UPCAST, EXACT_BF16)
    out_off = bh.to(tl.int64) * N * HEAD_DIM + offs_m[:, None] * HEAD_DIM + offs_d[None, :]
    tl.store(DQ + out_off, _cast(dq * sm_scale, DTYPE, EXACT_BF16), mask=row_ok[:, None])
    if STATS:
        tied = (tl.max(n32, 1) >= 2.0) & row_ok
        tied_b = (tl.max(nb16, 1) >= 2.0) & row_ok
        err = tl.where(row_ok, delta - dhp, 0.0)
        tl.atomic_add(ST_REP + h, tl.sum(tied.to(tl.int64), 0))
        tl.atomic_add(ST_REP_B + h, tl.sum(tied_b.to(tl.int64), 0))
        tl.atomic_add(ST_E + h, tl.sum(err, 0))
        tl.atomic_add(ST_EABS + h, tl.sum(tl.abs(err), 0))
        tl.atomic_add(ST_ESQ + h, tl.sum(err * err, 0))
        tl.atomic_add(ST_ETIED + h, tl.sum(tl.where(tied, err, 0.0), 0))


# --------------------------------------------------------------------------------------------
# statistics-only pass (observe mode)
# --------------------------------------------------------------------------------------------

@triton.jit
def _stats_inner(m1, m2, l_i, d_i, q, do, k_base, v_base, skn, svn, offs_m, offs_d, lo, hi, N, qk_scale,
                 BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
                 IEEE: tl.constexpr, UPCAST: tl.constexpr):
    offs_nb = tl.arange(0, BLOCK_N)
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        cols = start_n + offs_nb
        if MASKED:
            k = tl.load(k_base + cols[:, None] * skn + offs_d[None, :], mask=cols[:, None] < N, other=0.0)
            v = tl.load(v_base + cols[:, None] * svn + offs_d[None, :], mask=cols[:, None] < N, other=0.0)
        else:
            k = tl.load(k_base + cols[:, None] * skn + offs_d[None, :])
            v = tl.load(v_base + cols[:, None] * svn + offs_d[None, :])
        qk = _dot(q, tl.trans(k), IEEE, UPCAST)
        if MASKED:
            valid = cols[None, :] < N
            if CAUSAL:
                valid = valid & (offs_m[:, None] >= cols[None, :])
            qk = tl.where(valid, qk, float("-inf"))
        new_m1, new_m2 = _top2_update(qk, m1, m2)
        safe = tl.where(new_m1 == float("-inf"), 0.0, new_m1)
        p = tl.math.exp2((qk - safe[:, None]) * qk_scale)
        alpha = tl.math.exp2((tl.where(m1 == float("-inf"), safe, m1) - safe) * qk_scale)
        dp = _dot(do, tl.trans(v), IEEE, UPCAST)
        l_i = l_i * alpha + tl.sum(p, 1)
        d_i = d_i * alpha + tl.sum(p * dp, 1)
        m1, m2 = new_m1, new_m2
    return m1, m2, l_i, d_i


@triton.jit
def _attn_stats_kernel(Q, K, V, O, DO, ST_REP, ST_REP_B, ST_MAXL, ST_E, ST_EABS, ST_ESQ, ST_ETIED,
                       sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sob, soh, son, sdob, sdoh, sdon,
                       H, G, N, sm_scale, eps,
                       HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       CAUSAL: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr, EXACT_BF16: tl.constexpr):
    # grid: (cdiv(N, BLOCK_M), B * H). Reads q, k, v, the other kernel's output O and dO;
    # adds per-head counts, max logit and delta-error sums. delta_hp = rowsum(P * dP) is
    # accumulated online like the softmax denominator: d = sum exp(s - m) * dP, then d / l.
    start_m = _query_block_start(BLOCK_M, CAUSAL)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    kvh = h // G
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < N
    q = tl.load(Q + b.to(tl.int64) * sqb + h.to(tl.int64) * sqh + offs_m[:, None] * sqn + offs_d[None, :],
                mask=row_ok[:, None], other=0.0)
    do = tl.load(DO + b.to(tl.int64) * sdob + h.to(tl.int64) * sdoh + offs_m[:, None] * sdon + offs_d[None, :],
                 mask=row_ok[:, None], other=0.0)
    o = tl.load(O + b.to(tl.int64) * sob + h.to(tl.int64) * soh + offs_m[:, None] * son + offs_d[None, :],
                mask=row_ok[:, None], other=0.0)
    k_base = K + b.to(tl.int64) * skb + kvh.to(tl.int64) * skh
    v_base = V + b.to(tl.int64) * svb + kvh.to(tl.int64) * svh
    m1 = tl.full([BLOCK_M], float("-inf"), tl.float32)
    m2 = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    d_i = tl.zeros([BLOCK_M], tl.float32)
    qk_scale = sm_scale * 1.4426950408889634
    if CAUSAL:
        m1, m2, l_i, d_i = _stats_inner(m1, m2, l_i, d_i, q, do, k_base, v_base, skn, svn, offs_m, offs_d,
                                        0, start_m, N, qk_scale, BLOCK_N, False, CAUSAL, IEEE, UPCAST)
        hi = tl.minimum(start_m + BLOCK_M, N)
        m1, m2, l_i, d_i = _stats_inner(m1, m2, l_i, d_i, q, do, k_base, v_base, skn, svn, offs_m, offs_d,
                                        start_m, hi, N, qk_scale, BLOCK_N, True, CAUSAL, IEEE, UPCAST)
    else:
        n_full = (N // BLOCK_N) * BLOCK_N
        m1, m2, l_i, d_i = _stats_inner(m1, m2, l_i, d_i, q, do, k_base, v_base, skn, svn, offs_m, offs_d,
                                        0, n_full, N, qk_scale, BLOCK_N, False, CAUSAL, IEEE, UPCAST)
        m1, m2, l_i, d_i = _stats_inner(m1, m2, l_i, d_i, q, do, k_base, v_base, skn, svn, offs_m, offs_d,
                                        n_full, N, N, qk_scale, BLOCK_N, True, CAUSAL, IEEE, UPCAST)
    s1 = m1 * sm_scale
    s2 = m2 * sm_scale
    tied = (s2 >= s1 - eps) & row_ok
    s1b = _cast(s1, tl.bfloat16, EXACT_BF16).to(tl.float32)
    s2b = _cast(s2, tl.bfloat16, EXACT_BF16).to(tl.float32)
    tied_b = (s2b >= s1b - eps) & row_ok
    delta_used = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    err = tl.where(row_ok, delta_used - d_i / l_i, 0.0)
    tl.atomic_add(ST_REP + h, tl.sum(tied.to(tl.int64), 0))
    tl.atomic_add(ST_REP_B + h, tl.sum(tied_b.to(tl.int64), 0))
    tl.atomic_max(ST_MAXL + h, tl.max(tl.where(row_ok, s1, float("-inf")), 0))
    tl.atomic_add(ST_E + h, tl.sum(err, 0))
    tl.atomic_add(ST_EABS + h, tl.sum(tl.abs(err), 0))
    tl.atomic_add(ST_ESQ + h, tl.sum(err * err, 0))
    tl.atomic_add(ST_ETIED + h, tl.sum(tl.where(tied, err, 0.0), 0))


# --------------------------------------------------------------------------------------------
# launchers
# --------------------------------------------------------------------------------------------

def _workarounds(device: torch.device) -> tuple[bool, bool]:
    """(UPCAST dot operands, EXACT_BF16 rounding): on only in the interpreter, which is the
    only way Triton runs on CPU tensors."""
    on = device.type == "cpu" and INTERPRETER_WORKAROUNDS
    return on, on


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _register_cap(cfg: dict) -> dict:
    """The launch keyword for a configuration's register cap, if it has one."""
    return {"maxnreg": cfg["maxnreg"]} if "maxnreg" in cfg else {}


def _strides(t: torch.Tensor) -> tuple[int, int, int]:
    return t.stride(0), t.stride(1), t.stride(2)


from . import tuning  # noqa: E402


def _launch_fwd(q, k, v, o, lse, r, rowmax, maxlogit, causal, sm_scale, variant, beta, eps, stats_on,
                inject_factor, cfg):
    B, H, N, D = q.shape
    upcast, exact = _workarounds(q.device)
    grid = (triton.cdiv(N, cfg["BLOCK_M"]), B * H)
    _attn_fwd_kernel[grid](
        q, k, v, o, lse, r, rowmax, maxlogit,
        *_strides(q), *_strides(k), *_strides(v), *_strides(o),
        H, H // k.shape[1], N, sm_scale, eps / sm_scale, beta, FIXED_MIN_OFFSET, FIXED_MAX_OFFSET[q.dtype],
        inject_factor, unit_p_gap(q.dtype),
        HEAD_DIM=D, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], CAUSAL=causal,
        FIXED=variant == "fixed", FP32_DELTA=variant == "fp32_delta", STATS=stats_on,
        INJECT=inject_factor != 1.0, IEEE=q.dtype == torch.float32, UPCAST=upcast, EXACT_BF16=exact,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])


def _forward(q, k, v, causal, sm_scale, variant, beta, eps, stats, fault_strength):
    B, H, N, D = q.shape
    o = torch.empty((B, H, N, D), dtype=q.dtype, device=q.device)
    lse = torch.empty((B, H, N), dtype=torch.float32, device=q.device)  # log2 units
    fp32_delta = variant == "fp32_delta"
    r = torch.empty_like(o) if fp32_delta else o  # R = O_fp32 - O, written only under fp32_delta
    # each row's max score, for the backward's repeated-max count (statistics only)
    rowmax = torch.empty((B, H, N), dtype=torch.float32, device=q.device) if stats is not None else lse
    maxlogit = stats.max_logit if stats is not None else lse
    inject_factor = 1.0 + fault_strength * 2.0 ** -_PRECISION_BITS[q.dtype]

    # the fixed variant is its own compilation with its own entry: its tie count's operand of
    # ones takes 2 KB of shared memory, one program per SM fewer at the plain entry (sitting 12)
    kind = "fwd_fixed" if variant == "fixed" else "fwd"

    def bench(cfg):  # statistics off, into scratch outputs: tuning never touches stats
        scratch_o, scratch_lse = torch.empty_like(o), torch.empty_like(lse)
        return lambda: _launch_fwd(q, k, v, scratch_o, scratch_lse, scratch_o, scratch_lse, scratch_lse,
                                   causal, sm_scale, "fixed" if kind == "fwd_fixed" else "plain", beta, eps, False,
                                   1.0, cfg)

    cfg = tuning.choose(kind, q, causal, bench)
    _launch_fwd(q, k, v, o, lse, r, rowmax, maxlogit, causal, sm_scale, variant, beta, eps, stats is not None,
                inject_factor, cfg)
    return o, lse, (r if fp32_delta else None), (rowmax if stats is not None else None)


def _launch_dkdv(q, k, v, do, lse, delta, dk, dv, causal, sm_scale, cfg):
    B, H, N, D = q.shape
    Hkv = k.shape[1]
    upcast, exact = _workarounds(q.device)
    _attn_bwd_dkdv_kernel[(triton.cdiv(N, cfg["BLOCK_N"]), B * Hkv)](
        q, k, v, do, lse, delta, dk, dv, *_strides(q), *_strides(k), *_strides(v), *_strides(do),
        H, H // Hkv, N, sm_scale, HEAD_DIM=D, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], CAUSAL=causal,
        IEEE=q.dtype == torch.float32, UPCAST=upcast, EXACT_BF16=exact,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])


def _launch_dq(q, k, v, o, r, do, lse, delta, dq, rowmax, st, causal, sm_scale, eps, stats_on, cfg):
    # writes delta (B, H, N) as well as dq: launch it before _launch_dkdv, which reads delta
    B, H, N, D = q.shape
    upcast, exact = _workarounds(q.device)
    _attn_bwd_dq_kernel[(triton.cdiv(N, cfg["BLOCK_M"]), B * H)](
        q, k, v, o, r if r is not None else o, do, lse, delta, dq, rowmax, *st,
        *_strides(q), *_strides(k), *_strides(v), *_strides(o), *_strides(do),
        H, H // k.shape[1], N, sm_scale, eps, HEAD_DIM=D, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
        CAUSAL=causal, STATS=stats_on, FP32_DELTA=r is not None, IEEE=q.dtype == torch.float32, UPCAST=upcast,
        EXACT_BF16=exact,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **_register_cap(cfg))


def _backward(do, q, k, v, o, lse, r, rowmax, causal, sm_scale, eps, stats):
    B, H, N, D = q.shape
    do = _last_dim_contiguous(do)
    delta = torch.empty((B, H, N), dtype=torch.float32, device=q.device)  # written by the dQ kernel
    # the kernels write contiguous (B, heads, N, D) gradients; torch.empty_like would keep the
    # dimension order of a strided input (a fused q|k|v projection gives (B, N, heads, D) order)
    dq = torch.empty((B, H, N, D), dtype=q.dtype, device=q.device)
    dk = torch.empty((B, k.shape[1], N, D), dtype=k.dtype, device=k.device)
    dv = torch.empty((B, v.shape[1], N, D), dtype=v.dtype, device=v.device)

    def bench_dkdv(cfg):
        sk, sv = torch.empty_like(dk), torch.empty_like(dv)  # dk, dv are contiguous
        return lambda: _launch_dkdv(q, k, v, do, lse, delta, sk, sv, causal, sm_scale, cfg)

    def bench_dq(cfg, with_stats=False):
        # scratch outputs; with statistics, scratch sums too (tuning never adds into stats)
        sq, sdelta = torch.empty_like(dq), torch.empty_like(delta)
        sst = (torch.zeros(H, dtype=torch.int64, device=q.device),) * 2 + (torch.zeros(H, device=q.device),) * 4
        srowmax = rowmax if rowmax is not None else sdelta
        return lambda: _launch_dq(q, k, v, o, r, do, lse, sdelta, sq, srowmax, sst if with_stats else (sdelta,) * 6,
                                  causal, sm_scale, eps, with_stats, cfg)

    if stats is not None:
        st = (stats.repeated_max_rows, stats.repeated_max_rows_bf16, stats.delta_error, stats.delta_error_abs,
              stats.delta_error_sq, stats.delta_error_tied)
        stats.rows.add_(B * N)
    else:
        st = (delta,) * 6
    if stats is not None:
        dq_cfg = tuning.choose("dq_stats", q, causal, lambda cfg: bench_dq(cfg, with_stats=True))
    else:
        dq_cfg = tuning.choose("dq", q, causal, bench_dq)
    _launch_dq(q, k, v, o, r, do, lse, delta, dq, rowmax if rowmax is not None else delta, st, causal, sm_scale, eps,
               stats is not None, dq_cfg)
    _launch_dkdv(q, k, v, do, lse, delta, dk, dv, causal, sm_scale, tuning.choose("dkdv", q, causal, bench_dkdv))
    return dq, dk, dv


class _FlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, sm_scale, variant, beta, eps, stats, fault_strength):
        q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
        o, lse, r, rowmax = _forward(q, k, v, causal, sm_scale, variant, beta, eps, stats, fault_strength)
        ctx.save_for_backward(q, k, v, o, lse, r, rowmax)
        ctx.causal, ctx.sm_scale, ctx.eps, ctx.stats = causal, sm_scale, eps, stats
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse, r, rowmax = ctx.saved_tensors
        dq, dk, dv = _backward(do, q, k, v, o, lse, r, rowmax, ctx.causal, ctx.sm_scale, ctx.eps, ctx.stats)
        return dq, dk, dv, None, None, None, None, None, None, None


def flash_attention(q, k, v, *, causal=True, sm_scale=None, variant="plain", beta=2.0, eps=1e-3, stats=None):
    """Triton path of ``flashwatch.kernels.flash_attention`` (arguments already checked there).
    The INJECTED rounding bias of ``faults`` is read here, at call time: at 0 (the default) the
    forward compiles with INJECT off and adds nothing."""
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(q.shape[-1])
    return _FlashAttention.apply(q, k, v, causal, float(sm_scale), variant, float(beta), float(eps), stats,
                                 faults.rounding_bias_strength())


def attention_statistics(q, k, v, out, grad_out, stats: AttentionStats, *, causal=True, sm_scale=None, eps=1e-3):
    """Triton path of ``flashwatch.kernels.attention_statistics`` (arguments already checked there)."""
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(q.shape[-1])
    q, k, v, out, grad_out = (_last_dim_contiguous(t.detach()) for t in (q, k, v, out, grad_out))
    B, H, N, D = q.shape
    G = H // k.shape[1]
    upcast, exact = _workarounds(q.device)
    c = tuning.choose("stats", q, causal, None)
    _attn_stats_kernel[(triton.cdiv(N, c["BLOCK_M"]), B * H)](
        q, k, v, out, grad_out, stats.repeated_max_rows, stats.repeated_max_rows_bf16, stats.max_logit,
        stats.delta_error, stats.delta_error_abs, stats.delta_error_sq, stats.delta_error_tied,
        *_strides(q), *_strides(k), *_strides(v), *_strides(out), *_strides(grad_out),
        H, G, N, float(sm_scale), float(eps), HEAD_DIM=D, BLOCK_M=c["BLOCK_M"], BLOCK_N=c["BLOCK_N"],
        CAUSAL=causal, IEEE=q.dtype == torch.float32, UPCAST=upcast, EXACT_BF16=exact,
        num_warps=c["num_warps"], num_stages=c["num_stages"])
    stats.rows.add_(B * N)
