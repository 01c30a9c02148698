"""The Triton path of ``flashwatch.kernels``: launchers and autograd of the kernels in ``triton_kernels``.

``flash_attention`` and ``attention_statistics`` are the Triton paths of the package's functions
of the same names (their arguments are checked there). Here: the output, gradient and per-row
buffers, each launch's grid and tuned block shapes (``tuning``), the backward's order (the dQ
kernel first: it writes delta, which the dK/dV kernel reads), ``AttentionStats.rows_hook``, the
INJECTED rounding bias of ``faults`` (read at every call), and the interpreter workarounds
(``INTERPRETER_WORKAROUNDS``: CPU tensors run only under Triton's interpreter, whose bf16 dot and
cast are wrong; the kernels then upcast dot operands and round to BF16 explicitly). Every launch
goes through ``launch.launch`` (on CUDA: the compiled kernel kept per argument specialisation), and
a call without statistics is a ``launch.Plan`` after its first time: its outputs are allocated as
always, then its launches replayed, keyed by the inputs' layouts (``_plan_key``) and its options.
The kernel design is described in ``triton_kernels``.
"""

from __future__ import annotations

import contextlib
import math
from typing import NamedTuple

import torch
import triton  # noqa: F401  (the Triton path: fail at import where Triton is missing)

from . import faults, hopper_attn, masked, tuning
from . import launch as launching
from .checks import FIXED_MAX_OFFSET, FIXED_MIN_OFFSET
from .launch import launch, on_device
from .layouts import grads_like, heads_inner_like
from .reference import unit_p_gap
from .rows import RowOutputs, row_args, row_flags
from .stats import AttentionStats, CallMaxLogit, fold_max_logit
from .triton_kernels import _attn_bwd_dkdv_kernel, _attn_bwd_dq_kernel, _attn_fwd_kernel, _attn_stats_kernel

# Set to False only to demonstrate the interpreter bugs (tests do, to prove the workaround matters).
INTERPRETER_WORKAROUNDS = True

_PRECISION_BITS = {torch.bfloat16: 8, torch.float16: 11, torch.float32: 24}


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
    return t.stride()[:3]


def _cdiv(a: int, b: int) -> int:
    """ceil(a / b) for positive ints (``triton.cdiv`` is a constexpr function: several µs a host call)."""
    return -(-a // b)


class MaskOperand(NamedTuple):
    """An attn_mask as the kernels read it: ``tensor`` broadcast to (B, H, N, N) (stride 0 where the
    mask broadcasts; a boolean mask viewed as uint8, no copy), its four strides, and the kernels'
    MASK_KIND (1: boolean, True = attend; 2: added to the scaled scores)."""
    tensor: torch.Tensor
    strides: tuple
    kind: int


def mask_operand(attn_mask: torch.Tensor | None, q: torch.Tensor) -> MaskOperand | None:
    """The kernels' operand of an attn_mask (checked by the caller) for queries q (B, H, N, D), or None."""
    if attn_mask is None:
        return None
    B, H, N, _ = q.shape
    m = torch.broadcast_to(attn_mask, (B, H, N, N))
    if m.dtype == torch.bool:
        return MaskOperand(m.view(torch.uint8), tuple(m.stride()), 1)
    return MaskOperand(m, tuple(m.stride()), 2)


def _mask_args(mask: MaskOperand | None, q: torch.Tensor) -> tuple[tuple, tuple, dict]:
    """(the MASK pointer, its four strides, the MASK_KIND keyword) of a launch; q stands in for no mask."""
    if mask is None:
        return (q,), (0, 0, 0, 0), {}
    return (mask.tensor,), mask.strides, {"MASK_KIND": mask.kind}


def _launch_fwd(q, k, v, o, lse, r, rowmax, maxlogit, causal, sm_scale, variant, beta, eps, stats_on,
                inject_factor, cfg, mask=None):
    B, H, N, D = q.shape
    upcast, exact = _workarounds(q.device)
    if mask is None and hopper_attn.launch_fwd(q, k, v, o, lse, r, rowmax, maxlogit, causal, sm_scale, variant,
                                               stats_on, inject_factor, upcast, exact):
        return  # the opt-in Hopper variant ran (tuning.hopper_features; it takes no attn_mask)
    mask_ptr, mask_strides, mask_kind = _mask_args(mask, q)
    grid = (_cdiv(N, cfg["BLOCK_M"]), B * H)
    launch(_attn_fwd_kernel, grid, (
        q, k, v, o, lse, r, rowmax, maxlogit, *mask_ptr,
        *_strides(q), *_strides(k), *_strides(v), *_strides(o), *mask_strides,
        H, H // k.shape[1], N, sm_scale, eps / sm_scale, beta, FIXED_MIN_OFFSET, FIXED_MAX_OFFSET[q.dtype],
        inject_factor, unit_p_gap(q.dtype)), dict(
        HEAD_DIM=D, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], CAUSAL=causal,
        FIXED=variant == "fixed", FP32_DELTA=variant == "fp32_delta", STATS=stats_on,
        INJECT=inject_factor != 1.0, IEEE=q.dtype == torch.float32, UPCAST=upcast, EXACT_BF16=exact,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **mask_kind))


def _layout(t: torch.Tensor) -> tuple:
    """What a launch plan's key holds of an input tensor: shape, strides, dtype, device, 16-byte alignment."""
    return t.shape, t.stride(), t.dtype, t.device, t.data_ptr() & 15


def _plan_key(kind: str, tensors: tuple, *options) -> tuple | None:
    """The key of a call's launch plan (``launch.Plan``): its inputs' layouts and its options, or None where
    the call takes no plan (launches that are not cached: the cached launch off, the interpreter; a
    configuration not from ``tuning.TABLE``: override, autotuning, Hopper variant)."""
    if not (launching.plans_possible(_attn_fwd_kernel) and tuning.in_force_is_the_table()):
        return None
    return (kind, *map(_layout, tensors), *options)


def _replayed(key: tuple | None, tensors: tuple) -> bool:
    """Whether the plan kept under ``key`` launched the call with ``tensors``."""
    made = launching.plan(key) if key is not None else None
    return made is not None and made.run(tensors)


def _keep(key: tuple | None, records: list | None, tensors: tuple) -> None:
    """After a call with ``tensors`` that made the launches ``records``: keep its plan under ``key``."""
    if key is not None:
        made = launching.make_plan(records, tensors)
        if made is not None:
            launching.keep_plan(key, made)


def _recording(key: tuple | None):
    return launching.recording() if key is not None else contextlib.nullcontext()


def _forward(q, k, v, causal, sm_scale, variant, beta, eps, stats, fault_strength, attn_mask=None):
    """(o, lse, r or None, rowmax or None). With an ``attn_mask`` the kernel takes no statistics (``stats``
    is not used; ``_backward`` measures the call with ``masked``'s pass) and returns no rowmax."""
    B, H, N, D = q.shape
    o = heads_inner_like(q)  # O in the order SDPA gives it
    lse = torch.empty((B, H, N), dtype=torch.float32, device=q.device)  # log2 units
    fp32_delta = variant == "fp32_delta"
    r = torch.empty_like(o) if fp32_delta else o  # R = O_fp32 - O, written only under fp32_delta
    mask = mask_operand(attn_mask, q)
    if mask is not None:
        stats = None
    masks = (mask.tensor,) if mask is not None else ()
    # without statistics or an injected fault, repeats of a call replay its launches (launch.Plan)
    key = _plan_key("fwd", (q, k, v) + masks, causal, sm_scale, variant, beta, eps) \
        if stats is None and fault_strength == 0 else None
    tensors = ((q, k, v, o, lse, r) if fp32_delta else (q, k, v, o, lse)) + masks
    # Triton launches on the current device, and a plan keeps the device it was made on: both must be
    # q's (a model on cuda:1 with cuda:0 current)
    with on_device(q):
        if _replayed(key, tensors):
            return o, lse, (r if fp32_delta else None), None
        with _recording(key) as records:
            rowmax = _forward_launches(q, k, v, o, lse, r, causal, sm_scale, variant, beta, eps, stats,
                                       fault_strength, mask)
        _keep(key, records, tensors)
    return o, lse, (r if fp32_delta else None), rowmax


def _forward_launches(q, k, v, o, lse, r, causal, sm_scale, variant, beta, eps, stats, fault_strength, mask=None):
    """The forward's configuration and launch into o, lse, r; returns rowmax (statistics on) or None."""
    B, H, N, D = q.shape
    # each row's max score, for the backward's repeated-max count (statistics only)
    rowmax = torch.empty((B, H, N), dtype=torch.float32, device=q.device) if stats is not None else lse
    maxlogit = stats.max_logit if stats is not None else lse
    inject_factor = 1.0 + fault_strength * 2.0 ** -_PRECISION_BITS[q.dtype]

    # the fixed variant is its own compilation with its own entry: its tie count's operand of
    # ones takes 2 KB of shared memory, one program per SM fewer at the plain entry
    kind = "fwd_fixed" if variant == "fixed" else "fwd"

    def bench(cfg):  # statistics off, into scratch outputs: tuning never touches stats
        scratch_o, scratch_lse = torch.empty_like(o), torch.empty_like(lse)
        return lambda: _launch_fwd(q, k, v, scratch_o, scratch_lse, scratch_o, scratch_lse, scratch_lse,
                                   causal, sm_scale, "fixed" if kind == "fwd_fixed" else "plain", beta, eps, False,
                                   1.0, cfg, mask)

    cfg = tuning.choose(kind, q, causal, bench)
    _launch_fwd(q, k, v, o, lse, r, rowmax, maxlogit, causal, sm_scale, variant, beta, eps, stats is not None,
                inject_factor, cfg, mask)
    return rowmax if stats is not None else None


def _launch_dkdv(q, k, v, do, lse, delta, dk, dv, causal, sm_scale, cfg, mask=None):
    # dk and dv: one layout (grads_like), the kernel takes dk's strides for both
    B, H, N, D = q.shape
    Hkv = k.shape[1]
    upcast, exact = _workarounds(q.device)
    if mask is None and hopper_attn.launch_dkdv(q, k, v, do, lse, delta, dk, dv, causal, sm_scale, upcast, exact):
        return  # the opt-in Hopper variant ran (tuning.hopper_features; it takes no attn_mask)
    mask_ptr, mask_strides, mask_kind = _mask_args(mask, q)
    launch(_attn_bwd_dkdv_kernel, (_cdiv(N, cfg["BLOCK_N"]), B * Hkv), (
        q, k, v, do, lse, delta, dk, dv, *mask_ptr, *_strides(q), *_strides(k), *_strides(v), *_strides(do),
        *_strides(dk), *mask_strides, H, H // Hkv, N, sm_scale), dict(
        HEAD_DIM=D, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], CAUSAL=causal,
        IEEE=q.dtype == torch.float32, UPCAST=upcast, EXACT_BF16=exact,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **mask_kind))


def _row_outputs(q: torch.Tensor, hook, cfg: dict) -> RowOutputs:
    """Per-row outputs for AttentionStats.rows_hook (``rows.RowOutputs``: buffers or a reduction)
    of a launch at the tiles ``cfg``."""
    return RowOutputs(q, hook, cfg["BLOCK_M"])


def _launch_dq(q, k, v, o, r, do, lse, delta, dq, rowmax, st, causal, sm_scale, eps, stats_on, cfg, rows=None,
               gap=0.0, mask=None):
    # writes delta (B, H, N) as well as dq: launch it before _launch_dkdv, which reads delta.
    # rows: None, or the RowOutputs to fill (statistics on; never with a mask)
    B, H, N, D = q.shape
    upcast, exact = _workarounds(q.device)
    mask_ptr, mask_strides, mask_kind = _mask_args(mask, q)
    launch(_attn_bwd_dq_kernel, (_cdiv(N, cfg["BLOCK_M"]), B * H), (
        q, k, v, o, r if r is not None else o, do, lse, delta, dq, rowmax, *st, *row_args(rows, delta), *mask_ptr,
        *_strides(q), *_strides(k), *_strides(v), *_strides(o), *_strides(do), *_strides(dq), *mask_strides,
        H, H // k.shape[1], N, sm_scale, eps, float(gap)), dict(
        HEAD_DIM=D, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
        CAUSAL=causal, STATS=stats_on, **row_flags(rows), FP32_DELTA=r is not None,
        IEEE=q.dtype == torch.float32, UPCAST=upcast, EXACT_BF16=exact,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **_register_cap(cfg), **mask_kind))


def _backward(do, q, k, v, o, lse, r, rowmax, causal, sm_scale, eps, stats, grads=None, attn_mask=None,
              pattern_read=None):
    """dQ, dK, dV of one call, written into ``grads`` (dq, dk, dv: q's, k's and v's shapes and dtype, any
    strides with the last one 1) where given, else into new tensors (``grads_like``). A call with an
    ``attn_mask`` adds its statistics (``stats`` given) by ``masked``'s pass, after the gradients
    (``masked.measure_call``; ``pattern_read``: the mask's pattern read, started in the forward)."""
    B, H, N, D = q.shape
    do = _last_dim_contiguous(do)
    delta = torch.empty((B, H, N), dtype=torch.float32, device=q.device)  # written by the dQ kernel
    given = grads is not None
    dq, dk, dv = grads if given else grads_like(q, k, v)  # the kernels take their strides
    mask = mask_operand(attn_mask, q)
    kernel_stats = stats if mask is None else None
    masks = (mask.tensor,) if mask is not None else ()
    # without statistics, repeats of a call replay its launches (launch.Plan); given gradients are
    # inputs of the plan's key (their strides and alignment are the caller's)
    inputs = ((do, q, k, v, o, lse) if r is None else (do, q, k, v, o, lse, r)) + masks
    keyed = inputs + (dq, dk, dv) if given else inputs
    key = _plan_key("bwd", keyed, causal, sm_scale, eps) if kernel_stats is None else None
    tensors = inputs + (delta, dq, dk, dv)
    with on_device(q):  # as in _forward
        if not _replayed(key, tensors):
            with _recording(key) as records:
                _backward_launches(do, q, k, v, o, lse, r, rowmax, delta, dq, dk, dv, causal, sm_scale, eps,
                                   kernel_stats, mask)
            _keep(key, records, tensors)
        if mask is not None and stats is not None:
            masked.measure_call(q, k, v, o, r, do, stats, attn_mask, causal, sm_scale, eps, pattern_read)
    return dq, dk, dv


def _backward_launches(do, q, k, v, o, lse, r, rowmax, delta, dq, dk, dv, causal, sm_scale, eps, stats, mask=None):
    """The backward's configurations and launches into delta, dq, dk, dv (and the statistics: never with
    a mask)."""
    B, H, N, D = q.shape

    def bench_dkdv(cfg):
        sk, sv = torch.empty_like(dk), torch.empty_like(dv)  # dense: the same strides
        return lambda: _launch_dkdv(q, k, v, do, lse, delta, sk, sv, causal, sm_scale, cfg, mask)

    def bench_dq(cfg, with_stats=False, with_rows=False):
        # scratch outputs; with statistics, scratch sums and rows too (tuning never adds into stats)
        sq, sdelta = torch.empty_like(dq), torch.empty_like(delta)
        sst = (torch.zeros(H, dtype=torch.int64, device=q.device),) * 3 + (torch.zeros(H, device=q.device),) * 4
        srowmax = rowmax if rowmax is not None else sdelta
        srows = _row_outputs(q, None, cfg) if with_rows else None
        return lambda: _launch_dq(q, k, v, o, r, do, lse, sdelta, sq, srowmax, sst if with_stats else (sdelta,) * 7,
                                  causal, sm_scale, eps, with_stats, cfg, srows, mask=mask)

    if stats is not None:
        st = (stats.repeated_max_rows, stats.repeated_max_rows_bf16, stats.repeated_max_rows_format,
              stats.delta_error, stats.delta_error_abs, stats.delta_error_sq, stats.delta_error_tied)
        stats.rows.add_(B * N)
    else:
        st = (delta,) * 7
    hook = stats.rows_hook if stats is not None else None  # looked up now, when the backward runs
    if hook is not None:
        dq_cfg = tuning.choose("dq_rows", q, causal, lambda cfg: bench_dq(cfg, with_stats=True, with_rows=True))
    elif stats is not None:
        dq_cfg = tuning.choose("dq_stats", q, causal, lambda cfg: bench_dq(cfg, with_stats=True))
    else:
        dq_cfg = tuning.choose("dq", q, causal, bench_dq)
    rows = _row_outputs(q, hook, dq_cfg) if hook is not None else None
    _launch_dq(q, k, v, o, r, do, lse, delta, dq, rowmax if rowmax is not None else delta, st, causal, sm_scale, eps,
               stats is not None, dq_cfg, rows, stats.unit_gap if stats is not None else 0.0, mask)
    _launch_dkdv(q, k, v, do, lse, delta, dk, dv, causal, sm_scale, tuning.choose("dkdv", q, causal, bench_dkdv),
                 mask)
    if rows is not None:
        rows.finish()


class _FlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, sm_scale, variant, beta, eps, stats, fault_strength, attn_mask):
        q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
        call = CallMaxLogit(q.shape[1], q.device) if stats is not None else None  # folded in at the backward
        o, lse, r, rowmax = _forward(q, k, v, causal, sm_scale, variant, beta, eps, call, fault_strength, attn_mask)
        ctx.save_for_backward(q, k, v, o, lse, r, rowmax, attn_mask)
        ctx.causal, ctx.sm_scale, ctx.eps, ctx.stats, ctx.call = causal, sm_scale, eps, stats, call
        # a masked call's pattern, read without waiting now, for the backward's choice of pass
        ctx.pattern_read = masked.start_read(attn_mask, q.shape[2], q.shape[2], causal) \
            if stats is not None and attn_mask is not None else None
        return o

    @staticmethod
    def backward(ctx, do):
        if ctx.stats is not None:
            fold_max_logit(ctx.stats, ctx.call.max_logit)  # -inf where masked: the masked pass adds it
        q, k, v, o, lse, r, rowmax, attn_mask = ctx.saved_tensors
        dq, dk, dv = _backward(do, q, k, v, o, lse, r, rowmax, ctx.causal, ctx.sm_scale, ctx.eps, ctx.stats,
                               attn_mask=attn_mask, pattern_read=ctx.pattern_read)
        return dq, dk, dv, None, None, None, None, None, None, None, None


def flash_attention(q, k, v, *, causal=True, sm_scale=None, variant="plain", beta=2.0, eps=1e-3, stats=None,
                    attn_mask=None):
    """Triton path of ``flashwatch.kernels.flash_attention`` (arguments already checked there).
    The INJECTED rounding bias of ``faults`` is read here, at call time: at 0 (the default) the
    forward compiles with INJECT off and adds nothing."""
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(q.shape[-1])
    return _FlashAttention.apply(q, k, v, causal, float(sm_scale), variant, float(beta), float(eps), stats,
                                 faults.rounding_bias_strength(), attn_mask)


def attention_statistics(q, k, v, out, grad_out, stats: AttentionStats, *, causal=True, sm_scale=None, eps=1e-3):
    """Triton path of ``flashwatch.kernels.attention_statistics`` (arguments already checked there)."""
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(q.shape[-1])
    with on_device(q):  # Triton launches on the current device
        _statistics(q, k, v, out, grad_out, stats, causal, float(sm_scale), float(eps))


def _statistics(q, k, v, out, grad_out, stats: AttentionStats, causal: bool, sm_scale: float, eps: float) -> None:
    q, k, v, out, grad_out = (_last_dim_contiguous(t.detach()) for t in (q, k, v, out, grad_out))
    B, H, N, D = q.shape
    G = H // k.shape[1]
    upcast, exact = _workarounds(q.device)
    hook = stats.rows_hook
    c = tuning.choose("stats" if hook is None else "stats_rows", q, causal, None)
    rows = _row_outputs(q, hook, c) if hook is not None else None
    launch(_attn_stats_kernel, (_cdiv(N, c["BLOCK_M"]), B * H), (
        q, k, v, out, grad_out, stats.repeated_max_rows, stats.repeated_max_rows_bf16,
        stats.repeated_max_rows_format, stats.max_logit,
        stats.delta_error, stats.delta_error_abs, stats.delta_error_sq, stats.delta_error_tied,
        *row_args(rows, stats.delta_error),
        *_strides(q), *_strides(k), *_strides(v), *_strides(out), *_strides(grad_out),
        H, G, N, float(sm_scale), float(eps), float(stats.unit_gap)), dict(
        HEAD_DIM=D, BLOCK_M=c["BLOCK_M"], BLOCK_N=c["BLOCK_N"],
        CAUSAL=causal, **row_flags(rows), IEEE=q.dtype == torch.float32, UPCAST=upcast, EXACT_BF16=exact,
        num_warps=c["num_warps"], num_stages=c["num_stages"]))
    stats.rows.add_(B * N)
    if rows is not None:
        rows.finish()
