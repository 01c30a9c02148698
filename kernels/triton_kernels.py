"""The jitted Triton kernels of flash attention (forward and backward) with in-kernel statistics.

The Python side (output and gradient buffers, grids, tuned block shapes, the backward's launch
order, autograd, the interpreter workarounds' switch) is ``triton_attn``; this module holds only
``@triton.jit`` code.

Derives from FlashAttention-2 (Dao, 2023) and the structure of Triton's fused-attention
tutorial (online softmax in exp2, causal loop split into off-diagonal and diagonal parts, a
dK/dV kernel looping over query blocks and a dQ kernel looping over key blocks). Written anew
for flashwatch.

Changes:
- Statistics behind the constexpr flag STATS (``stats=None`` compiles them away):
  * forward: nothing per score (the softmax there is ALU-bound: a running top-two per score
    costs a large share of the forward, docs/KERNEL_TUNING.md); it stores each row's final max
    (B*H*N floats) and adds the head's max logit.
  * backward, dQ kernel (it sees whole rows): the repeated-max test "at least two scores
    >= m - eps" is a count against the stored row max, exact however the row is tiled; the
    BF16 test counts scores whose BF16 rounding is >= bf16(m) - eps through one FP32 threshold
    per row (``_bf16_lower_bound``); the format test counts scores >= m + gap, where P_bar rounds
    to exactly 1 in the statistics' format (``AttentionStats.unit_gap``); the counts are 0/1
    indicators summed on the tensor cores (``_count_into``). delta_hp = rowsum(P * dP) accumulates beside dS at one
    multiply-add per score; e = delta_used - delta_hp is summed per head (signed, absolute,
    squared, tied rows). No output-sized buffer is kept for any of it. This compilation of the
    dQ kernel needs about twice the registers of the plain one and has its own block shape
    (``tuning.TABLE["dq_stats"]``).
- Variants: ``fixed`` (Qiu & Yao's shifted max on repeated-max rows, guarded; an online exact
  tie flag, one compare per score and a count on the tensor cores, decides it, so every
  P_bar < 1 once a row's running max repeats) and ``fp32_delta`` (the forward stores
  R = O_fp32 - O in the input dtype; the backward's delta uses O + R).
- A statistics-only kernel for observe mode (another kernel's output and its gradient in,
  per-head statistics out): one pass over K with an online rescaled rowsum(P * dP).
- Per-row outputs behind the constexpr flag ROWS (``AttentionStats.rows_hook`` set; off, the
  kernels compile as without it): the dQ kernel and the statistics kernel also store each
  row's delta error and P K, one tensor-core product a key tile accumulated in FP32
  (``_probabilities_dot``: P rounded once to the input dtype); the statistics kernel rescales
  P K online like rowsum(P * dP). The dQ kernel then runs at its own tiles
  (``tuning.TABLE["dq_rows"]``). With REDUCE as well (the hook offers a ``RowReduction``), each
  row block's epilogue reduces its rows into the W^Q-error chain's per-head sums
  (``_reduce_rows``: a scalar and a D x r sketch per program, summed over the programs after
  the launch) and stores nothing per row.
- Backward: two launches. The dQ kernel runs first and computes delta_used = rowsum(dO * O)
  for its rows from the dO tile it loads anyway (no separate delta kernel), storing it for the
  dK/dV kernel, which runs second.
- Grouped-query attention: the dK/dV program loops over the query heads of its kv head, so
  the backward is deterministic (no atomics on gradients).
- Ragged N: tails are masked in-kernel; inputs of any strides are accepted (a last-dimension
  stride other than 1 is made contiguous first, for 16-byte loads).

Layout: the kernels share their prologue and tile code through small device helpers:
``_query_program`` (program id -> query block, batch, head, kv head), ``_key_program`` (the same
for a key block and its kv head), ``_head`` (a head's base
pointer), ``_load_rows`` / ``_store_rows`` / ``_load_row_values`` (masked tiles and row values),
``_mask_scores``, one step of a query block's key loop ``_key_tile`` (k, v and the masked scores),
the key ranges ``_unmasked_keys_end`` / ``_keys_end``, and the per-head sums
``_add_row_statistics``.

Cautions:
- The Triton interpreter (TRITON_INTERPRET=1, CPU; triton 3.6) multiplies bf16 dot operands as
  raw uint16 bit patterns and truncates fp32->bf16 casts instead of rounding them. With
  ``triton_attn.INTERPRETER_WORKAROUNDS`` on (default) the interpreted kernel upcasts dot operands to
  FP32 (exact: products of bf16 values are exact in FP32) and rounds to BF16 with explicit
  round-to-nearest-even bit arithmetic. On the GPU neither is used.
- FP32 inputs are multiplied with input_precision="ieee" (no TF32).
- Statistics use float atomics: their summation order (not the gradients) varies run to run.
"""

from __future__ import annotations

import triton
import triton.language as tl


# --------------------------------------------------------------------------------------------
# device helpers: arithmetic
# --------------------------------------------------------------------------------------------

@triton.jit
def _dot(a, b, IEEE: tl.constexpr, UPCAST: tl.constexpr, acc=None):
    """a @ b (+ acc, an FP32 accumulator) in FP32. UPCAST: interpreter workaround for its
    broken bf16 dot."""
    if UPCAST:
        c = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    elif IEEE:
        c = tl.dot(a, b, acc, input_precision="ieee")
    else:
        c = tl.dot(a, b, acc)
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
def _top2_combine(a1, a2, b1, b2):
    """The top two of the union of two multisets, each given by its top two (a1 >= a2, b1 >= b2):
    a value present in both tops is both first and second."""
    return tl.maximum(a1, b1), tl.maximum(tl.minimum(a1, b1), tl.maximum(a2, b2))


@triton.jit
def _top2_update(qk, m1, m2):
    """Merge a tile's scores (BLOCK_M, BLOCK_N) into the running top two of each row,
    counted with multiplicity: a value present twice is both first and second. Neighbouring
    columns (held by one thread) pair up as (max, min), then one tree reduction of those pairs
    (``_top2_combine``): about three max/min a score, and no per-score compare, count or select
    (instruction counts: docs/KERNEL_TUNING.md)."""
    a, b = tl.split(tl.reshape(qk, [qk.shape[0], qk.shape[1] // 2, 2]))
    t1, t2 = tl.reduce((tl.maximum(a, b), tl.minimum(a, b)), 1, _top2_combine)
    return _top2_combine(m1, m2, t1, t2)


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
    select and integer add (tl.sum), a score costs one FP32 set and half a BF16 pack
    (instruction counts and timings: docs/KERNEL_TUNING.md)."""
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
def _probabilities_dot(p, k, acc, DTYPE: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
                       EXACT_BF16: tl.constexpr):
    """acc + p @ k: (BLOCK_M, BLOCK_N) FP32 probabilities in [0, 1] times a (BLOCK_N, D) tile in
    the input dtype, for the W^Q-error chain's P K: p rounded once to the input dtype (BF16: within
    2**-8 of p; FP16: 2**-11, or 2**-25 absolutely below 2**-14) and multiplied by k as loaded, on
    the tensor cores, exactly in FP32 and accumulated there. P K only scales each row's delta
    error (the measured effect), so its readings move by as much, 2**-8 at most, and less in sums
    whose terms round independently. (An FP16 product of BF16 inputs would need a converted copy
    of the key tile, which costs more than it saves: docs/KERNEL_TUNING.md.) FP32 inputs take the
    IEEE product the kernels use for them anyway."""
    if IEEE:
        acc = _dot(p, k, True, UPCAST, acc)
    else:
        acc = _dot(_cast(p, DTYPE, EXACT_BF16), k, False, UPCAST, acc)
    return acc


# --------------------------------------------------------------------------------------------
# device helpers: programs, pointers, tiles
# --------------------------------------------------------------------------------------------

@triton.jit
def _query_program(H, G, BLOCK_M: tl.constexpr, CAUSAL: tl.constexpr):
    """Where a program of a (cdiv(N, BLOCK_M), B * H) grid works: (start_m, bh, b, h, kvh), its
    first query row, its (batch, query head) index bh = b * H + h, and the kv head h // G that
    query head reads. Causal programs of late query blocks have the most keys to visit: they
    are handed out first (the longest-processing-time order), so the grid's last wave is made
    of short programs."""
    if CAUSAL:
        pid = tl.num_programs(0) - 1 - tl.program_id(0)
    else:
        pid = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    return pid * BLOCK_M, bh, b, h, h // G


@triton.jit
def _key_program(H, G, BLOCK_N: tl.constexpr):
    """Where a program of a (cdiv(N, BLOCK_N), B * Hkv) grid works: (start_n, bkv, b, kvh), its
    first key, its (batch, kv head) index bkv = b * Hkv + kvh, with Hkv = H // G kv heads."""
    bkv = tl.program_id(1)
    Hkv = H // G
    return tl.program_id(0) * BLOCK_N, bkv, bkv // Hkv, bkv % Hkv


@triton.jit
def _head(base, b, h, stride_b, stride_h):
    """Pointer to head h of batch entry b of a (B, heads, N, D) tensor, in 64-bit offsets
    (B * H * N * D may pass 2**31)."""
    return base + b.to(tl.int64) * stride_b + h.to(tl.int64) * stride_h


@triton.jit
def _load_rows(base, rows, stride, offs_d, N, MASKED: tl.constexpr):
    """The (len(rows), D) tile of one head at ``base``: rows ``rows`` (row stride ``stride``),
    columns ``offs_d`` (unit stride). MASKED: rows >= N read as 0."""
    ptrs = base + rows[:, None] * stride + offs_d[None, :]
    if MASKED:
        x = tl.load(ptrs, mask=rows[:, None] < N, other=0.0)
    else:
        x = tl.load(ptrs)
    return x


@triton.jit
def _store_rows(base, rows, stride, offs_d, N, x):
    """Store the (len(rows), D) tile x at rows ``rows`` < N of one head (``_load_rows``'s layout)."""
    tl.store(base + rows[:, None] * stride + offs_d[None, :], x, mask=rows[:, None] < N)


@triton.jit
def _load_row_values(base, rows, N, MASKED: tl.constexpr):
    """One value per row (lse, delta, row max) of a (B * H, N) array at ``base`` (the head's
    row 0). MASKED: rows >= N read as 0."""
    if MASKED:
        x = tl.load(base + rows, mask=rows < N, other=0.0)
    else:
        x = tl.load(base + rows)
    return x


@triton.jit
def _mask_scores(qk, rows, cols, N, CAUSAL: tl.constexpr):
    """Scores (len(rows), len(cols)) of keys >= N and, when causal, of keys after their query
    -> -inf (so that exp gives 0 there and no finite threshold counts them)."""
    valid = cols[None, :] < N
    if CAUSAL:
        valid = valid & (rows[:, None] >= cols[None, :])
    return tl.where(valid, qk, float("-inf"))


@triton.jit
def _attention_mask(qk, mask_base, rows, cols, smq, smk, N, sm_scale, MASK_KIND: tl.constexpr):
    """The caller's attn_mask applied to raw scores qk (len(rows), len(cols)): ``mask_base`` points at
    its (b, h) plane, element (i, j) at i * smq + j * smk (stride 0 where the mask broadcasts).
    MASK_KIND 1: a boolean mask (as uint8, nonzero = attend): masked scores -> -inf. MASK_KIND 2: an
    additive float mask, added as SDPA adds it to the scaled scores, here in raw units (divided by
    sm_scale). A finite entry at or below -1e4 (``masked.MASKED_AT``: finfo.min, -1e9, as models mask
    with) makes the score one constant, -1e6 scaled: such a key gets no weight beside any other, and
    a row masked so everywhere averages its values evenly, as SDPA's scores, where the score is
    absorbed by the mask's magnitude (kept finite in raw units, finfo.min / sm_scale would overflow
    and break the row's exponentials). 0: no mask. Entries outside the N x N block read as masked."""
    if MASK_KIND == 0:
        out = qk
    else:
        inside = (rows[:, None] < N) & (cols[None, :] < N)
        ptrs = mask_base + rows[:, None] * smq + cols[None, :] * smk
        if MASK_KIND == 1:
            allowed = tl.load(ptrs, mask=inside, other=0)
            out = tl.where(allowed != 0, qk, float("-inf"))
        else:
            bias = tl.load(ptrs, mask=inside, other=float("-inf")).to(tl.float32)
            floor = tl.where(bias == float("-inf"), float("-inf"), -1.0e6 / sm_scale)
            out = tl.where(bias > -1.0e4, qk + tl.maximum(bias, -1.0e4) / sm_scale, floor)
    return out


@triton.jit
def _unmasked_keys_end(start_m, N, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    """End of the keys [0, end) that a query block visits without a mask. Causal: keys
    [0, start_m) are below the diagonal for every row of the block (whole key blocks, since
    BLOCK_M % BLOCK_N == 0). Otherwise: the whole key blocks; the ragged tail is masked."""
    if CAUSAL:
        end = start_m
    else:
        end = (N // BLOCK_N) * BLOCK_N
    return end


@triton.jit
def _keys_end(start_m, N, BLOCK_M: tl.constexpr, CAUSAL: tl.constexpr):
    """End of the keys a query block visits: the block's last row when causal, else N."""
    if CAUSAL:
        end = tl.minimum(start_m + BLOCK_M, N)
    else:
        end = N
    return end


@triton.jit
def _sum7(a0, a1, a2, a3, a4, a5, a6, b0, b1, b2, b3, b4, b5, b6):
    return a0 + b0, a1 + b1, a2 + b2, a3 + b3, a4 + b4, a5 + b5, a6 + b6


@triton.jit
def _add_row_statistics(ST_REP, ST_REP_B, ST_REP_F, ST_E, ST_EABS, ST_ESQ, ST_ETIED, h, tied, tied_b, tied_f, err):
    """Add a block of rows' statistics into the per-head sums of query head h: the repeated-max
    flags ((BLOCK_M,) bool, False on rows >= N; tied: on FP32 scores, tied_b: on BF16-rounded
    scores, tied_f: P_bar rounds to 1 at two or more keys in the statistics' format) into the
    counts, the delta errors err ((BLOCK_M,) FP32, 0 on rows >= N) into the signed, absolute,
    squared and repeated-max-row sums. One reduction of the seven columns (one exchange between
    the program's warps, not seven), then one atomic add each."""
    n, nb, nf, e, ea, esq, et = tl.reduce((tied.to(tl.int32), tied_b.to(tl.int32), tied_f.to(tl.int32), err,
                                           tl.abs(err), err * err, tl.where(tied, err, 0.0)), 0, _sum7)
    tl.atomic_add(ST_REP + h, n.to(tl.int64))
    tl.atomic_add(ST_REP_B + h, nb.to(tl.int64))
    tl.atomic_add(ST_REP_F + h, nf.to(tl.int64))
    tl.atomic_add(ST_E + h, e)
    tl.atomic_add(ST_EABS + h, ea)
    tl.atomic_add(ST_ESQ + h, esq)
    tl.atomic_add(ST_ETIED + h, et)


@triton.jit
def _reduce_rows(pk, err, row_ok, offs_m, offs_d, b, h, H, row_base, part, N, sm_scale, U, XV, XO, UGV, SKETCH,
                 HEAD_DIM: tl.constexpr, SKETCH_R: tl.constexpr, X_STRIDE: tl.constexpr, XV_LO: tl.constexpr):
    """The W^Q-gradient error of a block of rows, reduced in place of storing it (``REDUCE``).

    pk (BLOCK_M, D) FP32 (0 on rows >= N), err (BLOCK_M,) FP32 (0 on rows >= N); the call's
    factors: U (H, D) the head's u, XV (B, H, N) x . v_h, XO (B, N, SKETCH_R) x Omega, all FP32:
    contiguous (X_STRIDE 0), or X_STRIDE -1: rows of one (width, B * N) product, x . v_h at
    XV[h * B N + row] (plus XV[(XV_LO + h) * B N + row], its low part, where XV_LO > 0) and
    x Omega at XO[j * B N + row], row = b * N + n (the product as the chain makes it, read in
    place: coalesced along the rows).
    With c = -sm_scale * err, the error's rows dQ_err = c pk give this block's share
    of query head h's sums: UGV[part] = sum_rows c (pk . u_h)(x . v_h) (of u_h^T dG_h v_h) and
    SKETCH[part] (D, SKETCH_R) = pk^T (c x Omega) (of dG_h Omega), FP32 (the sketch's product on
    tensor cores in TF32, each factor kept to 10 explicit bits: within 2^-9 of each term, far
    below the sketch's own spread, which only cosines read), with
    ``part`` the program's index in (B * H, cdiv(N, BLOCK_M)) order: plain stores, one slot per
    program, summed over batch and blocks after the launch (``rows.RowOutputs.finish``; no
    atomics: no contention, and the same sum in every run)."""
    c = -sm_scale * err
    u = tl.load(U + h * HEAD_DIM + offs_d)
    x_cols = (tl.num_programs(1) // H).to(tl.int64) * N  # B * N: a column of y's transpose (X_STRIDE -1)
    rows = b.to(tl.int64) * N + offs_m
    if X_STRIDE == 0:
        xv = tl.load(XV + row_base + offs_m, mask=row_ok, other=0.0)
    else:  # X_STRIDE -1
        xv = tl.load(XV + h * x_cols + rows, mask=row_ok, other=0.0)
        if XV_LO != 0:
            xv += tl.load(XV + (XV_LO + h) * x_cols + rows, mask=row_ok, other=0.0)
    pu = tl.sum(pk * u[None, :], 1)  # (BLOCK_M,)
    tl.store(UGV + part, tl.sum(c * pu * xv, 0))
    # the (D, SKETCH_R) product at once, on tensor cores in TF32 (neither kernel spills at D 64: 127 and 244
    # registers; in column blocks of 16 the transposed P K was read back from shared memory once a block:
    # docs/KERNEL_TUNING.md)
    offs_r = tl.arange(0, SKETCH_R)
    if X_STRIDE == 0:
        xo = tl.load(XO + b.to(tl.int64) * N * SKETCH_R + offs_m[:, None] * SKETCH_R + offs_r[None, :],
                     mask=row_ok[:, None], other=0.0)
    else:  # X_STRIDE -1
        xo = tl.load(XO + offs_r[None, :] * x_cols + rows[:, None], mask=row_ok[:, None], other=0.0)
    sk = tl.dot(tl.trans(pk), c[:, None] * xo, input_precision="tf32")  # (D, SKETCH_R)
    tl.store(SKETCH + part * HEAD_DIM * SKETCH_R + offs_d[:, None] * SKETCH_R + offs_r[None, :], sk)


@triton.jit
def _block_part(bh, start_m, N, BLOCK_M: tl.constexpr):
    """A program's slot in the (B * H, cdiv(N, BLOCK_M)) partial sums of ``_reduce_rows`` (int64)."""
    return bh.to(tl.int64) * tl.cdiv(N, BLOCK_M) + start_m // BLOCK_M


# --------------------------------------------------------------------------------------------
# forward
# --------------------------------------------------------------------------------------------

@triton.jit
def _online_softmax_step(acc, l_i, shift, new_shift, qk, v, sm_scale, DTYPE: tl.constexpr, IEEE: tl.constexpr,
                         UPCAST: tl.constexpr, EXACT_BF16: tl.constexpr):
    """One key block of the forward: P = exp(S - shift) of the raw scores qk (BLOCK_M, BLOCK_N), the
    running row sums l_i and output acc (BLOCK_M, D) rescaled from the old shift to the new one
    (log2 units), then P V added with P rounded to the output's dtype."""
    p = tl.math.exp2(qk * (sm_scale * 1.4426950408889634) - new_shift[:, None])
    alpha = tl.math.exp2(shift - new_shift)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + _dot(_cast(p, DTYPE, EXACT_BF16), v, IEEE, UPCAST)
    return acc, l_i


@triton.jit
def _key_tile(q, k_base, v_base, stride_kn, stride_vn, offs_m, offs_d, start_n, N, mask_base, smq, smk, sm_scale,
              BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr,
              IEEE: tl.constexpr, UPCAST: tl.constexpr):
    """One step of a query block's loop over keys: k and v (BLOCK_N, D) of the keys from start_n
    (a multiple of BLOCK_N) on, and the raw scores q.k (BLOCK_M, BLOCK_N); MASKED: keys >= N, and
    with CAUSAL keys after the query, masked (``_mask_scores``); the caller's attn_mask, if any,
    applied on every tile (``_attention_mask``)."""
    cols = tl.multiple_of(start_n, BLOCK_N) + tl.arange(0, BLOCK_N)
    k = _load_rows(k_base, cols, stride_kn, offs_d, N, MASKED)
    v = _load_rows(v_base, cols, stride_vn, offs_d, N, MASKED)
    qk = _dot(q, tl.trans(k), IEEE, UPCAST)  # (BLOCK_M, BLOCK_N) raw scores q.k
    qk = _attention_mask(qk, mask_base, offs_m, cols, smq, smk, N, sm_scale, MASK_KIND)  # before -inf is set
    if MASKED:
        qk = _mask_scores(qk, offs_m, cols, N, CAUSAL)
    return k, v, qk


@triton.jit
def _fwd_inner(acc, l_i, m1, aux, shift, q, k_base, v_base, stride_kn, stride_vn, offs_m, offs_d,
               lo, hi, N, sm_scale, eps_raw, beta, min_off, max_off, mask_base, smq, smk,
               BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr,
               FIXED: tl.constexpr, TOP2: tl.constexpr, DTYPE: tl.constexpr,
               IEEE: tl.constexpr, UPCAST: tl.constexpr, EXACT_BF16: tl.constexpr):
    # aux: the running tie flag (FIXED), the running second-largest raw score (TOP2), else unused
    for start_n in range(lo, hi, BLOCK_N):
        k, v, qk = _key_tile(q, k_base, v_base, stride_kn, stride_vn, offs_m, offs_d, start_n, N, mask_base, smq, smk,
                             sm_scale, BLOCK_N, MASKED, CAUSAL, MASK_KIND, IEEE, UPCAST)
        if FIXED:
            new_m1, aux = _tie_update(qk, m1, aux, eps_raw, UPCAST)
        elif TOP2:
            new_m1, aux = _top2_update(qk, m1, aux)
        else:
            new_m1 = tl.maximum(m1, tl.max(qk, 1))
        new_shift = _row_shift(new_m1, aux, sm_scale, beta, min_off, max_off, FIXED)
        acc, l_i = _online_softmax_step(acc, l_i, shift, new_shift, qk, v, sm_scale, DTYPE, IEEE, UPCAST, EXACT_BF16)
        m1, shift = new_m1, new_shift
    return acc, l_i, m1, aux, shift


@triton.jit
def _attn_fwd_kernel(Q, K, V, O, LSE, R, ROWMAX, ST_MAXL, MASK,
                     sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sob, soh, son, smb, smh, smq, smk,
                     H, G, N, sm_scale, eps_raw, beta, min_off, max_off, inject_factor, unit_gap,
                     HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     CAUSAL: tl.constexpr, FIXED: tl.constexpr, FP32_DELTA: tl.constexpr,
                     STATS: tl.constexpr, INJECT: tl.constexpr, IEEE: tl.constexpr,
                     UPCAST: tl.constexpr, EXACT_BF16: tl.constexpr, MASK_KIND: tl.constexpr = 0):
    # grid: (cdiv(N, BLOCK_M), B * H); one program = one block of query rows of one head.
    # Statistics cost the forward nothing per score: it stores each row's max (the backward's
    # dQ pass counts repeated maxima against it) and the head's max logit.
    # MASK (MASK_KIND 1 or 2, else unused): the caller's attn_mask, strides smb, smh, smq, smk
    # (_attention_mask). A row it masks everywhere gets O = 0 and LSE = +inf (P = 0 in the backward),
    # as torch SDPA gives such a row 0 and no gradient.
    start_m, bh, b, h, kvh = _query_program(H, G, BLOCK_M, CAUSAL)
    mask_base = _head(MASK, b, h, smb, smh)
    DTYPE = O.dtype.element_ty
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < N
    k_base = _head(K, b, kvh, skb, skh)
    v_base = _head(V, b, kvh, svb, svh)
    q = _load_rows(_head(Q, b, h, sqb, sqh), offs_m, sqn, offs_d, N, True)

    m1 = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max of raw scores
    shift = tl.full([BLOCK_M], float("-inf"), tl.float32)  # subtracted max, log2 units
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    TOP2: tl.constexpr = INJECT and not FIXED  # the injected fault needs the second-largest score
    if TOP2:
        aux = tl.full([BLOCK_M], float("-inf"), tl.float32)
    else:
        aux = tl.zeros([BLOCK_M], tl.int32)

    split = _unmasked_keys_end(start_m, N, BLOCK_N, CAUSAL)
    acc, l_i, m1, aux, shift = _fwd_inner(acc, l_i, m1, aux, shift, q, k_base, v_base, skn, svn, offs_m, offs_d,
                                          0, split, N, sm_scale, eps_raw, beta, min_off, max_off, mask_base, smq, smk,
                                          BLOCK_N, False, CAUSAL, MASK_KIND, FIXED, TOP2, DTYPE, IEEE, UPCAST,
                                          EXACT_BF16)
    hi = _keys_end(start_m, N, BLOCK_M, CAUSAL)
    acc, l_i, m1, aux, shift = _fwd_inner(acc, l_i, m1, aux, shift, q, k_base, v_base, skn, svn, offs_m, offs_d,
                                          split, hi, N, sm_scale, eps_raw, beta, min_off, max_off, mask_base, smq,
                                          smk, BLOCK_N, True, CAUSAL, MASK_KIND, FIXED, TOP2, DTYPE, IEEE, UPCAST,
                                          EXACT_BF16)

    o32 = acc / l_i[:, None]
    if MASK_KIND != 0:  # rows the mask leaves no key: l_i 0, O 0 (not 0 / 0) and LSE +inf; the same division as
        o32 = tl.where((l_i > 0.0)[:, None], o32, 0.0)  # without a mask, so fp32_delta's R is the same too
    o_hp = o32  # the FP32 output, before any injected fault: fp32_delta's delta comes from it
    if TOP2:
        # INJECTED FAULT: on rows where P_bar rounds to exactly 1 at two or more keys (second
        # score within unit_gap = ln(1 - 2**-p) of the max; never under the fixed variant, whose
        # P_bar stay below 1), inflate |O| by inject_factor = 1 + strength * 2**-p before rounding
        unit_rows = (aux * sm_scale - m1 * sm_scale) >= unit_gap
        o32 = tl.where(unit_rows[:, None], o32 * inject_factor, o32)
    o = _cast(o32, DTYPE, EXACT_BF16)
    _store_rows(_head(O, b, h, sob, soh), offs_m, son, offs_d, N, o)
    row_base = bh.to(tl.int64) * N  # (B * H, N) arrays: this head's row 0
    lse = shift + tl.math.log2(l_i)
    if MASK_KIND != 0:
        lse = tl.where(l_i > 0.0, lse, float("inf"))
    tl.store(LSE + row_base + offs_m, lse, mask=row_ok)
    if FP32_DELTA:  # R has O's strides (the launcher allocates it like O)
        r = _cast(o_hp - o.to(tl.float32), DTYPE, EXACT_BF16)
        _store_rows(_head(R, b, h, sob, soh), offs_m, son, offs_d, N, r)
    if STATS:
        s1 = m1 * sm_scale  # the row max in natural-log units, as the reference computes it
        tl.store(ROWMAX + row_base + offs_m, s1, mask=row_ok)
        tl.atomic_max(ST_MAXL + h, tl.max(tl.where(row_ok, s1, float("-inf")), 0))


# --------------------------------------------------------------------------------------------
# backward
# --------------------------------------------------------------------------------------------

@triton.jit
def _dkdv_block(dk, dv, k, v, q, do, lse_base, delta_base, rows, offs_n, N, qk_scale, mask_base, smq, smk, sm_scale,
                MASKED: tl.constexpr, CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, DTYPE: tl.constexpr,
                IEEE: tl.constexpr, UPCAST: tl.constexpr, EXACT_BF16: tl.constexpr):
    """One query block of the dK/dV pass: with the block's q, dO (BLOCK_M, D) loaded and its rows'
    LSE and delta read here, add P^T dO to dv and dS^T q to dk (BLOCK_N, D) for the keys offs_n
    (the caller's attn_mask applied with MASK_KIND, transposed: ``_attention_mask``)."""
    lse = _load_row_values(lse_base, rows, N, MASKED)
    delta = _load_row_values(delta_base, rows, N, MASKED)
    qkT = _dot(k, tl.trans(q), IEEE, UPCAST)  # (BLOCK_N, BLOCK_M)
    # the mask's (i, j) is at i * smq + j * smk: its transpose swaps the strides
    qkT = _attention_mask(qkT, mask_base, offs_n, rows, smk, smq, N, sm_scale, MASK_KIND)
    pT = tl.math.exp2(qkT * qk_scale - lse[None, :])
    if MASKED:
        # query rows >= N read lse 0 and would get p = 1: they are masked here, with keys >= N
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
def _bwd_dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base, sqn, sdon, offs_n, offs_d,
                    lo, hi, N, qk_scale, mask_base, smq, smk, sm_scale,
                    BLOCK_M: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr,
                    DTYPE: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr, EXACT_BF16: tl.constexpr):
    offs_mb = tl.arange(0, BLOCK_M)
    for start_m in range(lo, hi, BLOCK_M):
        start_m = tl.multiple_of(start_m, BLOCK_M)
        rows = start_m + offs_mb
        q = _load_rows(q_base, rows, sqn, offs_d, N, MASKED)
        do = _load_rows(do_base, rows, sdon, offs_d, N, MASKED)
        dk, dv = _dkdv_block(dk, dv, k, v, q, do, lse_base, delta_base, rows, offs_n, N, qk_scale, mask_base, smq,
                             smk, sm_scale, MASKED, CAUSAL, MASK_KIND, DTYPE, IEEE, UPCAST, EXACT_BF16)
    return dk, dv


@triton.jit
def _attn_bwd_dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, MASK,
                          sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sdob, sdoh, sdon, sgb, sgh, sgn,
                          smb, smh, smq, smk, H, G, N, sm_scale,
                          HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          CAUSAL: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
                          EXACT_BF16: tl.constexpr, MASK_KIND: tl.constexpr = 0):
    # grid: (cdiv(N, BLOCK_N), B * Hkv); one program = one block of keys of one kv head,
    # looping over the G query heads that read it and over their query blocks. MASK: as the forward's.
    start_n, bkv, b, kvh = _key_program(H, G, BLOCK_N)
    DTYPE = DK.dtype.element_ty
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    k = _load_rows(_head(K, b, kvh, skb, skh), offs_n, skn, offs_d, N, True)
    v = _load_rows(_head(V, b, kvh, svb, svh), offs_n, svn, offs_d, N, True)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    qk_scale = sm_scale * 1.4426950408889634
    m_full = (N // BLOCK_M) * BLOCK_M
    for g in range(0, G):
        h = kvh * G + g
        q_base = _head(Q, b, h, sqb, sqh)
        do_base = _head(DO, b, h, sdob, sdoh)
        mask_base = _head(MASK, b, h, smb, smh)
        row_base = (b * H + h).to(tl.int64) * N
        if CAUSAL:
            # query blocks crossing the diagonal of this key block are masked; later ones are not
            dk, dv = _bwd_dkdv_inner(dk, dv, k, v, q_base, do_base, LSE + row_base, DELTA + row_base, sqn, sdon,
                                     offs_n, offs_d, start_n, start_n + BLOCK_N, N, qk_scale, mask_base, smq, smk,
                                     sm_scale, BLOCK_M, True, CAUSAL, MASK_KIND, DTYPE, IEEE, UPCAST, EXACT_BF16)
            dk, dv = _bwd_dkdv_inner(dk, dv, k, v, q_base, do_base, LSE + row_base, DELTA + row_base, sqn, sdon,
                                     offs_n, offs_d, start_n + BLOCK_N, m_full, N, qk_scale, mask_base, smq, smk,
                                     sm_scale, BLOCK_M, False, CAUSAL, MASK_KIND, DTYPE, IEEE, UPCAST, EXACT_BF16)
            tail_lo = tl.maximum(m_full, start_n + BLOCK_N)
        else:
            dk, dv = _bwd_dkdv_inner(dk, dv, k, v, q_base, do_base, LSE + row_base, DELTA + row_base, sqn, sdon,
                                     offs_n, offs_d, 0, m_full, N, qk_scale, mask_base, smq, smk,
                                     sm_scale, BLOCK_M, False, CAUSAL, MASK_KIND, DTYPE, IEEE, UPCAST, EXACT_BF16)
            tail_lo = m_full
        dk, dv = _bwd_dkdv_inner(dk, dv, k, v, q_base, do_base, LSE + row_base, DELTA + row_base, sqn, sdon,
                                 offs_n, offs_d, tail_lo, N, N, qk_scale, mask_base, smq, smk,
                                 sm_scale, BLOCK_M, True, CAUSAL, MASK_KIND, DTYPE, IEEE, UPCAST, EXACT_BF16)
    # dK, dV (B, Hkv, N, D) of one layout, strides sgb, sgh, sgn (kernels.layouts.grads_like)
    _store_rows(_head(DK, b, kvh, sgb, sgh), offs_n, sgn, offs_d, N, _cast(dk * sm_scale, DTYPE, EXACT_BF16))
    _store_rows(_head(DV, b, kvh, sgb, sgh), offs_n, sgn, offs_d, N, _cast(dv, DTYPE, EXACT_BF16))


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
def _bwd_dq_inner(dq, dhp, psum, n32, nb16, nfmt, pk, q, do, lse, delta, t32, tb16, tfmt, k_base, v_base, skn, svn,
                  offs_m, offs_d,
                  lo, hi, N, sm_scale, qk_scale, mask_base, smq, smk,
                  BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr,
                  STATS: tl.constexpr, ROWS: tl.constexpr, DTYPE: tl.constexpr, IEEE: tl.constexpr,
                  UPCAST: tl.constexpr, EXACT_BF16: tl.constexpr):
    for start_n in range(lo, hi, BLOCK_N):
        k, v, qk = _key_tile(q, k_base, v_base, skn, svn, offs_m, offs_d, start_n, N, mask_base, smq, smk, sm_scale,
                             BLOCK_N, MASKED, CAUSAL, MASK_KIND, IEEE, UPCAST)
        p = tl.math.exp2(qk * qk_scale - lse[:, None])
        if STATS:
            # scores within eps of the row max, FP32 and after BF16 rounding: t32 and tb16 are
            # finite thresholds on raw scores (see _raw_threshold); counted before dp is
            # computed, so the raw scores need not stay live across the second matrix product
            n32 = _count_into(qk >= t32[:, None], n32, UPCAST)
            nb16 = _count_into(qk >= tb16[:, None], nb16, UPCAST)
            nfmt = _count_into(qk >= tfmt[:, None], nfmt, UPCAST)  # P_bar rounds to 1 in the format
        dp = _dot(do, tl.trans(v), IEEE, UPCAST)
        if STATS:
            # delta of the exact softmax output, FP32: sum P dP over sum P at the end, which takes
            # out lse's rounding (|lse| 2**-24 of every P, common to the row)
            dhp += tl.sum(p * dp, 1)
            psum += tl.sum(p, 1)
        if ROWS:
            pk = _probabilities_dot(p, k, pk, DTYPE, IEEE, UPCAST, EXACT_BF16)  # P is final: no rescaling
        ds = p * (dp - delta[:, None])
        dq += _dot(_cast(ds, DTYPE, EXACT_BF16), k, IEEE, UPCAST)
    return dq, dhp, psum, n32, nb16, nfmt, pk


@triton.jit
def _attn_bwd_dq_kernel(Q, K, V, O, R, DO, LSE, DELTA, DQ, ROWMAX, ST_REP, ST_REP_B, ST_REP_F, ST_E, ST_EABS, ST_ESQ,
                        ST_ETIED, ERR_ROWS, PK, U, XV, XO, UGV, SKETCH, MASK,
                        sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sob, soh, son, sdob, sdoh, sdon,
                        sdqb, sdqh, sdqn, smb, smh, smq, smk, H, G, N, sm_scale, eps, gap,
                        HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        CAUSAL: tl.constexpr, STATS: tl.constexpr, ROWS: tl.constexpr, FP32_DELTA: tl.constexpr,
                        IEEE: tl.constexpr, UPCAST: tl.constexpr, EXACT_BF16: tl.constexpr,
                        REDUCE: tl.constexpr = False, SKETCH_R: tl.constexpr = 16, X_STRIDE: tl.constexpr = 0,
                        XV_LO: tl.constexpr = 0, MASK_KIND: tl.constexpr = 0):
    # grid: (cdiv(N, BLOCK_M), B * H); one program = one block of query rows of one head.
    # It first computes delta_used = rowsum(dO * O) (O + R under fp32_delta) for its rows and
    # stores it for the dK/dV kernel, which runs after it: no separate delta launch, and dO is
    # read once for both. With STATS it also counts repeated maxima against the row max the
    # forward stored, and accumulates delta_hp = rowsum(P * dP) / rowsum(P) beside dS. With ROWS (needs
    # STATS) it also stores each row's delta error and P K ((B, H, N) and (B, H, N, D) FP32,
    # contiguous), the per-row outputs of AttentionStats.rows_hook; with REDUCE (needs ROWS) it
    # reduces them into the W^Q-error chain's sums instead (_reduce_rows): nothing per row stored.
    # MASK: as the forward's (the launcher never sets STATS with it: the masked pass measures those calls).
    start_m, bh, b, h, kvh = _query_program(H, G, BLOCK_M, CAUSAL)
    mask_base = _head(MASK, b, h, smb, smh)
    DTYPE = DQ.dtype.element_ty
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < N
    row_base = bh.to(tl.int64) * N  # (B * H, N) arrays: this head's row 0
    q = _load_rows(_head(Q, b, h, sqb, sqh), offs_m, sqn, offs_d, N, True)
    do = _load_rows(_head(DO, b, h, sdob, sdoh), offs_m, sdon, offs_d, N, True)
    lse = _load_row_values(LSE + row_base, offs_m, N, True)
    o = _load_rows(_head(O, b, h, sob, soh), offs_m, son, offs_d, N, True).to(tl.float32)
    if FP32_DELTA:  # R has O's strides (the launcher allocates it like O)
        o += _load_rows(_head(R, b, h, sob, soh), offs_m, son, offs_d, N, True).to(tl.float32)
    delta = tl.sum(o * do.to(tl.float32), 1)  # (BLOCK_M,) FP32; masked rows are 0
    tl.store(DELTA + row_base + offs_m, delta, mask=row_ok)
    k_base = _head(K, b, kvh, skb, skh)
    v_base = _head(V, b, kvh, svb, svh)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    dhp = tl.zeros([BLOCK_M], tl.float32)
    psum = tl.zeros([BLOCK_M], tl.float32)  # sum of P: 1 up to lse's rounding
    # counts of near-max scores, FP32 and BF16 tests; every column holds the row's count
    n32 = tl.zeros([BLOCK_M, 16], tl.float32)
    nb16 = tl.zeros([BLOCK_M, 16], tl.float32)
    nfmt = tl.zeros([BLOCK_M, 16], tl.float32)
    pk = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)  # sum_j P_ij k_j (ROWS only)
    if STATS:
        s1 = _load_row_values(ROWMAX + row_base, offs_m, N, True)
        # repeated max (FP32): sm_scale*qk >= s1 - eps; (BF16): bf16(sm_scale*qk) >= bf16(s1) - eps
        t32 = _raw_threshold(s1 - eps, sm_scale)
        tb16 = _raw_threshold(_bf16_lower_bound(_cast(s1, tl.bfloat16, EXACT_BF16).to(tl.float32) - eps,
                                                EXACT_BF16), sm_scale)
        tfmt = _raw_threshold(s1 + gap, sm_scale)  # gap < 0: exp(s - s1) rounds to 1 in the format
    else:
        t32 = lse
        tb16 = lse
        tfmt = lse
    qk_scale = sm_scale * 1.4426950408889634
    split = _unmasked_keys_end(start_m, N, BLOCK_N, CAUSAL)
    dq, dhp, psum, n32, nb16, nfmt, pk = _bwd_dq_inner(dq, dhp, psum, n32, nb16, nfmt, pk, q, do, lse, delta, t32,
                                                       tb16, tfmt, k_base, v_base, skn, svn, offs_m, offs_d, 0, split,
                                                       N, sm_scale, qk_scale, mask_base, smq, smk, BLOCK_N, False,
                                                       CAUSAL, MASK_KIND, STATS, ROWS, DTYPE, IEEE, UPCAST, EXACT_BF16)
    hi = _keys_end(start_m, N, BLOCK_M, CAUSAL)
    dq, dhp, psum, n32, nb16, nfmt, pk = _bwd_dq_inner(dq, dhp, psum, n32, nb16, nfmt, pk, q, do, lse, delta, t32,
                                                       tb16, tfmt, k_base, v_base, skn, svn, offs_m, offs_d, split, hi,
                                                       N, sm_scale, qk_scale, mask_base, smq, smk, BLOCK_N, True,
                                                       CAUSAL, MASK_KIND, STATS, ROWS, DTYPE, IEEE, UPCAST, EXACT_BF16)
    # dQ (B, H, N, D), strides sdqb, sdqh, sdqn (kernels.layouts.grads_like)
    _store_rows(_head(DQ, b, h, sdqb, sdqh), offs_m, sdqn, offs_d, N, _cast(dq * sm_scale, DTYPE, EXACT_BF16))
    if STATS:
        tied = (tl.max(n32, 1) >= 2.0) & row_ok
        tied_b = (tl.max(nb16, 1) >= 2.0) & row_ok
        tied_f = (tl.max(nfmt, 1) >= 2.0) & row_ok
        err = tl.where(row_ok, delta - dhp / tl.where(psum > 0.0, psum, 1.0), 0.0)
        _add_row_statistics(ST_REP, ST_REP_B, ST_REP_F, ST_E, ST_EABS, ST_ESQ, ST_ETIED, h, tied, tied_b, tied_f, err)
        if ROWS:
            if REDUCE:  # pk is 0 on rows >= N: their q, dO (so P's dP) and err are 0
                _reduce_rows(tl.where(row_ok[:, None], pk, 0.0), err, row_ok, offs_m, offs_d, b, h, H, row_base,
                             _block_part(bh, start_m, N, BLOCK_M), N, sm_scale, U, XV, XO, UGV, SKETCH, HEAD_DIM,
                             SKETCH_R, X_STRIDE, XV_LO)
            else:
                tl.store(ERR_ROWS + row_base + offs_m, err, mask=row_ok)
                _store_rows(PK + bh.to(tl.int64) * N * HEAD_DIM, offs_m, HEAD_DIM, offs_d, N, pk)


# --------------------------------------------------------------------------------------------
# statistics-only pass (observe mode)
# --------------------------------------------------------------------------------------------

@triton.jit
def _stats_inner(m1, m2, l_i, d_i, pk, q, do, k_base, v_base, skn, svn, offs_m, offs_d, lo, hi, N, qk_scale,
                 BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr, ROWS: tl.constexpr,
                 DTYPE: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr, EXACT_BF16: tl.constexpr):
    for start_n in range(lo, hi, BLOCK_N):
        k, v, qk = _key_tile(q, k_base, v_base, skn, svn, offs_m, offs_d, start_n, N, q, 0, 0, 1.0, BLOCK_N, MASKED,
                             CAUSAL, 0, IEEE, UPCAST)
        new_m1, new_m2 = _top2_update(qk, m1, m2)
        safe = tl.where(new_m1 == float("-inf"), 0.0, new_m1)  # a row that saw only masked scores: no inf - inf
        p = tl.math.exp2(tl.fma(qk, qk_scale, -(safe * qk_scale)[:, None]))  # one FMA a score
        alpha = tl.math.exp2((tl.where(m1 == float("-inf"), safe, m1) - safe) * qk_scale)
        dp = _dot(do, tl.trans(v), IEEE, UPCAST)
        l_i = l_i * alpha + tl.sum(p, 1)
        d_i = d_i * alpha + tl.sum(p * dp, 1)
        if ROWS:  # rescaled like d_i: sum exp(s - m) k, divided by l at the end
            pk = _probabilities_dot(p, k, pk * alpha[:, None], DTYPE, IEEE, UPCAST, EXACT_BF16)
        m1, m2 = new_m1, new_m2
    return m1, m2, l_i, d_i, pk


@triton.jit
def _attn_stats_kernel(Q, K, V, O, DO, ST_REP, ST_REP_B, ST_REP_F, ST_MAXL, ST_E, ST_EABS, ST_ESQ, ST_ETIED, ERR_ROWS,
                       PK, U, XV, XO, UGV, SKETCH, sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sob, soh, son, sdob,
                       sdoh, sdon, H, G, N, sm_scale, eps, gap,
                       HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       CAUSAL: tl.constexpr, ROWS: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
                       EXACT_BF16: tl.constexpr, REDUCE: tl.constexpr = False, SKETCH_R: tl.constexpr = 16,
                       X_STRIDE: tl.constexpr = 0, XV_LO: tl.constexpr = 0):
    # grid: (cdiv(N, BLOCK_M), B * H). Reads q, k, v, the other kernel's output O and dO;
    # adds per-head counts, max logit and delta-error sums. delta_hp = rowsum(P * dP) is
    # accumulated online like the softmax denominator: d = sum exp(s - m) * dP, then d / l.
    # With ROWS it also stores each row's delta error and P K, accumulated the same way; with
    # REDUCE (needs ROWS) it reduces them into the W^Q-error chain's sums instead (_reduce_rows).
    start_m, bh, b, h, kvh = _query_program(H, G, BLOCK_M, CAUSAL)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < N
    q = _load_rows(_head(Q, b, h, sqb, sqh), offs_m, sqn, offs_d, N, True)
    do = _load_rows(_head(DO, b, h, sdob, sdoh), offs_m, sdon, offs_d, N, True)
    o = _load_rows(_head(O, b, h, sob, soh), offs_m, son, offs_d, N, True)
    if ROWS:  # delta_used first, so O's tile is not held through the key loop beside P K's accumulator
        # (255 -> 168 registers at D 64); without ROWS the later sum compiles to a shorter loop
        delta_used = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    k_base = _head(K, b, kvh, skb, skh)
    v_base = _head(V, b, kvh, svb, svh)
    m1 = tl.full([BLOCK_M], float("-inf"), tl.float32)
    m2 = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    d_i = tl.zeros([BLOCK_M], tl.float32)
    pk = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)  # sum_j exp(s_ij - m_i) k_j (ROWS only)
    DTYPE = Q.dtype.element_ty
    qk_scale = sm_scale * 1.4426950408889634
    split = _unmasked_keys_end(start_m, N, BLOCK_N, CAUSAL)
    m1, m2, l_i, d_i, pk = _stats_inner(m1, m2, l_i, d_i, pk, q, do, k_base, v_base, skn, svn, offs_m, offs_d,
                                        0, split, N, qk_scale, BLOCK_N, False, CAUSAL, ROWS, DTYPE, IEEE, UPCAST,
                                        EXACT_BF16)
    hi = _keys_end(start_m, N, BLOCK_M, CAUSAL)
    m1, m2, l_i, d_i, pk = _stats_inner(m1, m2, l_i, d_i, pk, q, do, k_base, v_base, skn, svn, offs_m, offs_d,
                                        split, hi, N, qk_scale, BLOCK_N, True, CAUSAL, ROWS, DTYPE, IEEE, UPCAST,
                                        EXACT_BF16)
    s1 = m1 * sm_scale
    s2 = m2 * sm_scale
    tied = (s2 >= s1 - eps) & row_ok
    s1b = _cast(s1, tl.bfloat16, EXACT_BF16).to(tl.float32)
    s2b = _cast(s2, tl.bfloat16, EXACT_BF16).to(tl.float32)
    tied_b = (s2b >= s1b - eps) & row_ok
    tied_f = (s2 >= s1 + gap) & row_ok  # gap < 0: P_bar rounds to 1 at two keys in the format
    if not ROWS:
        delta_used = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    err = tl.where(row_ok, delta_used - d_i / l_i, 0.0)
    _add_row_statistics(ST_REP, ST_REP_B, ST_REP_F, ST_E, ST_EABS, ST_ESQ, ST_ETIED, h, tied, tied_b, tied_f, err)
    tl.atomic_max(ST_MAXL + h, tl.max(tl.where(row_ok, s1, float("-inf")), 0))
    if ROWS:
        row_base = bh.to(tl.int64) * N
        if REDUCE:
            pk = tl.where(row_ok[:, None], pk / l_i[:, None], 0.0)  # no 0/0 of an empty row
            _reduce_rows(pk, err, row_ok, offs_m, offs_d, b, h, H, row_base, _block_part(bh, start_m, N, BLOCK_M), N,
                         sm_scale, U, XV, XO, UGV, SKETCH, HEAD_DIM, SKETCH_R, X_STRIDE, XV_LO)
        else:
            tl.store(ERR_ROWS + row_base + offs_m, err, mask=row_ok)
            _store_rows(PK + row_base * HEAD_DIM, offs_m, HEAD_DIM, offs_d, N, pk / l_i[:, None])
