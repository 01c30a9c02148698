"""flashwatch's attention as PyTorch custom operators, for models run under ``torch.compile``.

Dynamo and Inductor cannot trace a Python ``autograd.Function`` that launches Triton kernels
and adds into statistics held by a Python object; they can trace custom operators
(``torch.library``) with fake implementations, called from ``autograd.Function``s whose
forward and backward Dynamo traces into the compiled graphs. Each operator is opaque to the
compiler: Inductor calls it as it is, and it runs the same launchers (``triton_attn``) or the
same reference (``reference``) as the eager path.

Operators (namespace ``flashwatch``):

- ``attention_with_stats(q, k, v, flag, counts, values, coverage, causal, sm_scale, variant, beta,
  eps, unit_gap, x, rotation, layer, attn_mask)`` -> (out, lse, residual, rowmax, max_logit, pattern_read):
  ``flash_attention``'s forward (one operator: the Python function ``attention`` calls it, through an
  ``autograd.Function`` whose backward is ``attention_grad(do, [q, k, v, out, lse, residual, rowmax, max_logit,
  flag, pattern_read], counts, values, coverage, causal, sm_scale, eps, unit_gap, x, rotation, layer, attn_mask,
  dq, dk, dv)``, which writes the gradients into dq, dk, dv and adds the statistics: for a call with an
  attn_mask by ``masked``'s pass, given the mask's pattern as the forward began to read it on monitored steps).
  Triton on CUDA (or under TRITON_INTERPRET=1), the reference elsewhere.
- ``observe(out, q, k, v, flag, counts, values, coverage, causal, sm_scale, eps, x, rotation, layer)`` -> a view of
  ``out`` (not an operator: an ``autograd.Function`` whose forward the compiler reduces to
  nothing, since an operator's output could not alias its input and would cost a copy of
  ``out`` in every step): marks the output of the model's own attention; its backward passes
  the gradient through unchanged and runs the operator ``observe_statistics``
  (``attention_statistics`` on the saved inputs, output and output gradient). For a
  self-attention mask it first calls ``mask_pattern(attn_mask, flag, reads, n)`` -> the mask's pattern
  read (``masked.read_pattern``, started in the forward on monitored steps), which the backward
  operator takes to choose the plain pass for a mask that is only the causal pattern.
  With ``scores_only=reason`` (a call with attention dropout, with or without a mask), the same
  operator adds rows, repeated maxima and max logit only (its delta error is not measured).
- ``unmeasured_call(flag, coverage, layer, reason)``: counts an attention call the statistics
  cannot take (logged once per layer and reason).

Whether a step is monitored is the CPU tensor ``flag`` (0-d, nonzero: monitored), read by the
operators when they run, so flipping it between steps changes no guard and recompiles nothing.
Statistics go into ``counts`` and ``values``, the two buffers of an ``AttentionStats``
(declared as mutated; ``unit_gap`` is its format's ``AttentionStats.unit_gap``), and ``coverage``, a CPU int64 tensor (2,), counts [attention calls,
measured calls] of monitored steps. Nothing is read back from the device.

The per-row hook of ``AttentionStats.rows_hook`` (the W^Q-gradient error) reaches the operators
through the layer's *key*: a CPU int64 0-d tensor from ``register_layer(label, source)``, which
also names the layer in the operators' log lines, and the tensors the hook needs, ``x`` (the
projection input of the attention call) and, for a rotated query, ``rotation`` (its rotary
position embeddings cos and sin stacked, (2, B or 1, N, D)), all operator arguments. When a
backward operator runs on a monitored step it asks the layer's source for the call's hook,
``source(x, sm_scale, rotation, query)`` (``query``: the query the call received, which the source
compares once with W^Q x), and the statistics pass calls it as in eager mode; no key, no
source or no ``x`` means no hook. The key
is a tensor, not an integer, so that no operator argument differs between layers but tensors:
code compiled once for one transformer block (``torch.compile(block)`` for each block) serves
every block without a recompilation.
"""

from __future__ import annotations

import itertools
import logging
import math
from typing import Callable, Optional

import torch

from . import faults, reference
from .layouts import grads_like, heads_inner_like
from .stats import COUNT_FIELDS, MAX_FIELDS, SUM_FIELDS, AttentionStats, CallMaxLogit, fold_max_logit

log = logging.getLogger("flashwatch")

__all__ = ["attention", "observe", "unmeasured_call", "stats_buffers", "register_layer",
           "unregister_layer"]

_logged: set = set()
_layers: dict = {}  # key (int > 0) -> (label, source(x, sm_scale) -> rows hook or None, or None)
_next_layer = itertools.count(1)


def register_layer(label: str,
                   source: Optional[Callable[[torch.Tensor, float, Optional[torch.Tensor], Optional[torch.Tensor]],
                                             Optional[object]]] = None
                   ) -> torch.Tensor:
    """Register a layer: ``label`` names it in the operators' log lines, ``source(x, sm_scale,
    rotation, query)`` (or None) returns the ``AttentionStats.rows_hook`` of one of its calls given
    the call's projection input ``x``, its query's rotation (None: not rotated) and the query the
    call received (None where not known). Returns its key,
    the tensor the operators take as ``layer``."""
    key = next(_next_layer)
    _layers[key] = (label, source)
    return torch.tensor(key, dtype=torch.int64)


def unregister_layer(key: int) -> None:
    """Forget a layer (calls that still name it get no hook and an unnamed log line). ``key``: the
    integer its tensor holds, read when it was registered (this is called from finalizers, which may
    run while a fake-tensor mode traces, where reading a tensor's value fails)."""
    _layers.pop(int(key), None)


def _label(key: Optional[torch.Tensor]) -> str:
    return _layers.get(int(key), ("(unregistered)", None))[0] if key is not None else "(unregistered)"


def _rows_hook(key: Optional[torch.Tensor], x: Optional[torch.Tensor], sm_scale: float,
               rotation: Optional[torch.Tensor] = None, query: Optional[torch.Tensor] = None):
    """The rows hook of one call: its layer's source's, or None (no layer, no source, no ``x``, or
    the source failed, which it reports itself). ``query``: the query the call received, which
    the source compares once with W^Q x."""
    source = _layers.get(int(key), (None, None))[1] if key is not None and x is not None else None
    if source is None:
        return None
    try:
        return source(x, sm_scale, rotation, query)
    except Exception:
        _log_once(("rows_source",), "flashwatch: the W^Q-error chain of an attention call could not be set up; "
                  "training goes on unchanged", exc_info=True)
        return None


def stats_buffers(stats: AttentionStats) -> tuple[torch.Tensor, torch.Tensor]:
    """The two device buffers every field of ``stats`` is a view of: (counts int64, values float32)."""
    return stats._counts, stats._values


def _view(counts: torch.Tensor, values: torch.Tensor, unit_gap: float) -> AttentionStats:
    """An ``AttentionStats`` whose fields are views of ``counts`` and ``values`` (the buffers an
    operator was given: under functionalization they may be copies of the layer's own), with
    the unit gap of the layer's format (``AttentionStats.unit_gap``; the format's name is not
    known here: ``format`` is None). Allocates nothing."""
    stats = AttentionStats.__new__(AttentionStats)
    stats.num_heads, stats.device, stats.format, stats.unit_gap = counts.shape[1], counts.device, None, unit_gap
    stats._counts, stats._values, stats._rows_hook = counts, values, None
    for i, name in enumerate(COUNT_FIELDS):
        setattr(stats, name, counts[i])
    for i, name in enumerate(MAX_FIELDS + SUM_FIELDS):
        setattr(stats, name, values[i])
    return stats


def _log_once(key: tuple, message: str, *args, exc_info: bool = False) -> None:
    if key not in _logged:
        _logged.add(key)
        log.warning(message, *args, exc_info=exc_info)


def _on(flag: torch.Tensor) -> bool:
    return bool(flag.item())  # a CPU tensor: no device synchronisation


def _uses_triton(device: torch.device) -> bool:
    if device.type == "cuda":  # the common case without an import or an environment read
        return True
    from . import uses_triton

    return uses_triton(device)


def _triton_attn():
    """The Triton launchers (imported on first use: the reference path does not need Triton)."""
    global _TRITON_ATTN
    if _TRITON_ATTN is None:
        from . import triton_attn

        _TRITON_ATTN = triton_attn
    return _TRITON_ATTN


_TRITON_ATTN = None


class _NoAutocast:
    """Autocast off on ``device``: the kernels choose their own precision."""

    def __init__(self, device: torch.device):
        self.ctx = torch.autocast(device_type=device.type, enabled=False)

    def __enter__(self):
        return self.ctx.__enter__()

    def __exit__(self, *exc):
        return self.ctx.__exit__(*exc)


# --- registration ---------------------------------------------------------------------------------

# The operators are registered with ``torch.library`` directly (one implementation for every
# device, a fake one for tracing; autograd through ``autograd.Function``s, no autograd kernel of
# their own, whose Python wrapper would run at every call of a compiled graph) rather than through
# ``torch.library.custom_op``, whose Python wrappers around every call cost more host time than
# the launches (docs/KERNEL_TUNING.md): the output-aliasing check of each call and, for an
# operator that mutates its arguments, a version bump that walks the schema once per argument.
# The implementations return fresh tensors only (no output aliases an input), so the alias check
# has nothing to find. The statistics buffers they write into are saved by autograd only to be
# handed to the backward operator, never to compute a gradient, and the gradients ``attention_grad``
# writes into are made by its caller just before, for it alone, so no version counter needs a bump
# (the compiler learns of the writes from the schema's (a!) annotations, not from the counters).
#
# Code that Inductor cached (on disk, across processes) names the operators it calls, and its cache
# key is the graph's text: it does not see what a fake implementation returns. A change to a fake's
# output shapes, strides or dtypes that kept the operator's name and schema would let a graph cached
# by an earlier flashwatch assert the old strides at its first call. So every operator is the
# overload CONTRACT of its name (``flashwatch::attention_with_stats.v2``), and CONTRACT changes with
# any such change and with any change of a schema (v2: O in (B, N, H, D) memory order; v3: the
# layer's key a tensor, not an integer; v4: the query's rotation an argument; v5: dQ, dK, dV in
# (B, N, heads, D) memory order; v6: score_statistics takes a mask; v7: attention_grad writes dQ, dK, dV into
# tensors it is given; v8: observe_statistics takes the mask's pattern as read in the forward, by mask_pattern,
# and measures the scores of calls with dropout, in the backward, where score_statistics measured them in the forward;
# v9: attention_with_stats and attention_grad take an attn_mask, and the forward returns its pattern read).
CONTRACT = "v9"
_lib = torch.library.Library("flashwatch", "FRAGMENT")


# Every operator is tagged CUDA-graph-unsafe: it reads the CPU flag of the step (a graph replayed
# from CUDA graphs would repeat whichever step it recorded) and hands tensors to the Monitor that
# outlive the call (inside Inductor's CUDA-graph memory pool these made `mode="reduce-overhead"`
# fail with "tensor(s) in the cudagraph pool not tracked as outputs"). With the tag, Inductor runs
# the operators between the graphs it records (graph partitions) instead of inside them.
_TAGS = tuple(t for t in (getattr(torch._C.Tag, "cudagraph_unsafe", None),) if t is not None)


def _operator(schema: str, impl, fake):
    """Define ``flashwatch::<name>.<CONTRACT>(<arguments>) -> <returns>`` from ``schema``
    (``"<name>(<arguments>) -> <returns>"``) with ``impl`` on every device and ``fake`` for tracing;
    returns the operator overload."""
    name, signature = schema[:schema.index("(")], schema[schema.index("("):]
    _lib.define(f"{name}.{CONTRACT}{signature}", tags=_TAGS)
    _lib.impl(f"{name}.{CONTRACT}", impl, "CompositeExplicitAutograd")
    torch.library.register_fake(qualified(name), fake, lib=_lib)
    return getattr(getattr(torch.ops.flashwatch, name), CONTRACT)


def qualified(name: str) -> str:
    """The registered operator's qualified name: ``flashwatch::<name>.<CONTRACT>``."""
    return f"flashwatch::{name}.{CONTRACT}"


# --- own kernel ---------------------------------------------------------------------------------

def _forward(q, k, v, flag, causal, sm_scale, variant, beta, eps, attn_mask):
    """The forward of ``flashwatch::attention_with_stats``: (out, lse, residual, rowmax, max_logit, pattern_read);
    pattern_read: on monitored steps, a mask's pattern read (``masked.start_read``) for the backward's
    statistics pass, else a read of nothing."""
    from . import masked as masked_pass

    B, H, N, _ = q.shape
    monitored = _on(flag)
    stats = CallMaxLogit(H, q.device) if monitored else None
    max_logit = stats.max_logit if stats is not None else torch.empty((H,), dtype=torch.float32, device=q.device)
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    fault = faults.rounding_bias_strength()
    if _uses_triton(q.device):  # allocations and launches only: autocast changes nothing there
        o, lse, r, rowmax = _triton_attn()._forward(q, k, v, causal, sm_scale, variant, beta, eps, stats, fault,
                                                    attn_mask)
    else:
        with _NoAutocast(q.device):
            o, lse, r = reference.forward(q, k, v, causal, sm_scale, variant, beta, eps, stats, fault, attn_mask)
        rowmax = None
    r = r if r is not None else q.new_empty((0,))
    rowmax = rowmax if rowmax is not None else torch.empty((B, H, N), dtype=torch.float32, device=q.device)
    read = masked_pass.start_read(attn_mask, N, N, causal) if monitored and attn_mask is not None else None
    return o, lse, r, rowmax, max_logit, read if read is not None else masked_pass.no_pattern_read()


def _forward_fake(q, k, v, flag, causal, sm_scale, variant, beta, eps, attn_mask):
    from .masked import PATTERN_READ_SHAPE

    B, H, N, D = q.shape
    lse_dtype = torch.float64 if q.dtype == torch.float64 and not _uses_triton(q.device) else torch.float32
    if _uses_triton(q.device):  # the kernels' output order (layouts.heads_inner_like); the reference's is contiguous
        o = heads_inner_like(q)
    else:
        o = q.new_empty((B, H, N, D))
    r = torch.empty_like(o) if variant == "fp32_delta" else q.new_empty((0,))
    return (o, q.new_empty((B, H, N), dtype=lse_dtype), r,
            q.new_empty((B, H, N), dtype=torch.float32), q.new_empty((H,), dtype=torch.float32),
            torch.empty(PATTERN_READ_SHAPE, dtype=torch.int8, device="cpu"))


def _attention_backward_impl(do, saved, counts, values, coverage, causal, sm_scale, eps, unit_gap, x, rotation,
                              layer, attn_mask, dq, dk, dv):
    # saved: [q, k, v, o, lse, r, rowmax, max_logit, flag, pattern_read], as the forward left them
    q, k, v, o, lse, r, rowmax, max_logit, flag, pattern_read = saved
    stats = None
    if _on(flag):
        stats = _view(counts, values, unit_gap)
        stats._rows_hook = _rows_hook(layer, x, sm_scale, rotation, q)
        fold_max_logit(stats, max_logit)  # the forward's, folded in now
        coverage.add_(1)  # one attention call, measured
    residual = r if r.numel() else None
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    if _uses_triton(q.device):  # allocations and launches only: autocast changes nothing there
        _triton_attn()._backward(do, q, k, v, o, lse, residual, rowmax if stats is not None else None, causal,
                                 sm_scale, eps, stats, grads=(dq, dk, dv), attn_mask=attn_mask,
                                 pattern_read=pattern_read)
        return
    with _NoAutocast(q.device):
        grads = reference.backward(do, q, k, v, o, lse, residual, causal, sm_scale, eps, stats, attn_mask,
                                   pattern_read)
    for out, grad in zip((dq, dk, dv), grads):
        out.copy_(grad)


def _attention_backward_fake(do, saved, counts, values, coverage, causal, sm_scale, eps, unit_gap, x, rotation,
                              layer, attn_mask, dq, dk, dv):
    return None


# the backward takes the forward's saved tensors as one list (fewer schema arguments to walk). It writes
# the gradients into tensors its caller made, rather than returning them: Inductor assumes that what an
# operator returns is not 16-byte aligned when any of its inputs may not be (the CPU flag, coverage and key
# always count as such), and so read returned gradients without vector loads in the generated code after
# the operator (the concatenation of the q, k, v gradients into the projection's: 1.6x slower); the
# tensors it allocates itself it knows to be aligned
_attention_backward = _operator(
    "attention_grad(Tensor do, Tensor[] saved, Tensor(a!) counts, Tensor(b!) values, Tensor(c!) coverage, "
    "bool causal, float sm_scale, float eps, float unit_gap, Tensor? x, Tensor? rotation, Tensor? layer, "
    "Tensor? attn_mask, Tensor(d!) dq, Tensor(e!) dk, Tensor(f!) dv) -> ()",
    _attention_backward_impl, _attention_backward_fake)


def _attention_with_stats_impl(q, k, v, flag, counts, values, coverage, causal, sm_scale, variant, beta, eps,
                               unit_gap, x, rotation, layer, attn_mask):
    # the forward operator must be functional: the statistics buffers are inputs here
    # (saved for the backward, which adds into them) and nothing in the forward mutates them; x and
    # rotation are only saved for the backward's rows hook
    return _forward(q, k, v, flag, causal, sm_scale, variant, beta, eps, attn_mask)


def _attention_with_stats_fake(q, k, v, flag, counts, values, coverage, causal, sm_scale, variant, beta, eps,
                               unit_gap, x, rotation, layer, attn_mask):
    return _forward_fake(q, k, v, flag, causal, sm_scale, variant, beta, eps, attn_mask)


_attention_with_stats = _operator(
    "attention_with_stats(Tensor q, Tensor k, Tensor v, Tensor flag, Tensor counts, Tensor values, "
    "Tensor coverage, bool causal, float sm_scale, str variant, float beta, float eps, float unit_gap, Tensor? x, "
    "Tensor? rotation, Tensor? layer, Tensor? attn_mask) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
    _attention_with_stats_impl, _attention_with_stats_fake)


class _Attention(torch.autograd.Function):
    """Autograd of ``flashwatch::attention_with_stats``: its forward calls the operator, its backward
    ``flashwatch::attention_grad``. A Function rather than ``torch.library.register_autograd``: the
    operators then carry no autograd kernel of their own, so a compiled graph that calls them (Dynamo
    traces this Function's forward and backward into its graphs, as ``_Observe``'s) goes through no
    Python autograd wrapper per call."""

    @staticmethod
    def forward(ctx, q, k, v, flag, counts, values, coverage, causal, sm_scale, variant, beta, eps, unit_gap, x,
                rotation, layer, attn_mask):
        o, lse, r, rowmax, max_logit, read = _attention_with_stats(q, k, v, flag, counts, values, coverage, causal,
                                                                   sm_scale, variant, beta, eps, unit_gap, x,
                                                                   rotation, layer, attn_mask)
        # x, rotation, layer and attn_mask may be None
        ctx.save_for_backward(q, k, v, o, lse, r, rowmax, max_logit, flag, read, counts, values, coverage, x,
                              rotation, layer, attn_mask)
        ctx.causal, ctx.sm_scale, ctx.eps, ctx.unit_gap = causal, sm_scale, eps, unit_gap
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse, r, rowmax, max_logit, flag, read, counts, values, coverage, x, rotation, layer, attn_mask = \
            ctx.saved_tensors
        dq, dk, dv = grads_like(q, k, v)  # on every device in the kernels' order
        _attention_backward(do, [q, k, v, o, lse, r, rowmax, max_logit, flag, read], counts, values, coverage,
                            ctx.causal, ctx.sm_scale, ctx.eps, ctx.unit_gap, x, rotation, layer, attn_mask, dq, dk, dv)
        return (dq, dk, dv) + (None,) * 14


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, flag: torch.Tensor, stats: AttentionStats,
              coverage: torch.Tensor, causal: bool = True, sm_scale: Optional[float] = None,
              variant: str = "plain", beta: float = 2.0, eps: float = 1e-3, x: Optional[torch.Tensor] = None,
              rotation: Optional[torch.Tensor] = None, layer: Optional[torch.Tensor] = None,
              attn_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``flash_attention`` as a custom operator: statistics into ``stats`` when ``flag`` is set.

    Args as ``flashwatch.kernels.flash_attention`` (already checked by the caller), and
    ``flag`` (CPU 0-d tensor, nonzero on monitored steps), ``coverage`` (CPU int64 (2,)),
    ``x``, ``rotation`` and ``layer`` (the layer's key: the call's rows hook on monitored steps,
    module docstring), ``attn_mask`` (checked by the caller; its calls are measured by ``masked``'s pass).
    Returns the (B, H, N, D) output. The call's max logit is added with its backward's
    statistics (a forward without backward adds nothing).
    """
    scale = float(sm_scale) if sm_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    counts, values = stats_buffers(stats)
    return _Attention.apply(q, k, v, flag, counts, values, coverage, bool(causal), scale, variant, float(beta),
                            float(eps), float(stats.unit_gap), _detached(x), _detached(rotation), layer,
                            _detached(attn_mask))


# --- observe -----------------------------------------------------------------------------------

# How many mask pattern reads ``mask_pattern`` was asked for (CPU int64, 0-d). It is the
# operator's declared write, and that write keeps the operator in the compiled forward: the
# compiler moves an operator whose output only the backward takes into the backward, where its
# read would wait for all the work queued before it.
pattern_reads = torch.zeros((), dtype=torch.int64)


def _mask_pattern_impl(attn_mask, flag, reads, n):
    from . import masked as masked_pass

    if not _on(flag):
        return masked_pass.no_pattern_read()
    reads.add_(1)
    read = masked_pass.start_read(attn_mask, n, n, False)  # None where it failed: the backward reads the mask
    return read if read is not None else masked_pass.no_pattern_read()


def _mask_pattern_fake(attn_mask, flag, reads, n):
    from .masked import PATTERN_READ_SHAPE

    return torch.empty(PATTERN_READ_SHAPE, dtype=torch.int8, device="cpu")


_mask_pattern = _operator("mask_pattern(Tensor attn_mask, Tensor flag, Tensor(a!) reads, int n) -> Tensor",
                          _mask_pattern_impl, _mask_pattern_fake)


def _observe_statistics_impl(q, k, v, out, grad_out, flag, counts, values, coverage, attn_mask, causal, sm_scale,
                             eps, masked, unit_gap, x, rotation, layer, pattern_read, scores_only) -> None:
    if not _on(flag):
        return
    from . import attention_statistics
    from . import masked as masked_pass

    if scores_only is None:
        coverage.add_(1)  # one attention call, measured here
    else:
        coverage[0] += 1  # an attention call, not measured in full
        label = _label(layer)
        _log_once((label, scores_only), "flashwatch: layer %s: attention calls where %s", label, scores_only)
    dtype = out.dtype  # autocast cast the inputs inside the model's SDPA: measure what it computed with
    try:
        with _NoAutocast(q.device):
            stats = _view(counts, values, unit_gap)
            if scores_only is None:
                stats._rows_hook = _rows_hook(layer, x, sm_scale, rotation, q)
                grad = grad_out.to(dtype)
            else:  # a zero output gradient adds exactly 0 to the delta-error sums: rows, repeated maxima, max logit
                grad = torch.zeros_like(out)
            args = (q.to(dtype), k.to(dtype), v.to(dtype), out, grad, stats)
            if masked:
                masked_pass.attention_statistics(*args, attn_mask=attn_mask, causal=causal, sm_scale=sm_scale, eps=eps,
                                                 pattern_read=pattern_read)
            else:
                attention_statistics(*args, causal=causal, sm_scale=sm_scale, eps=eps)
    except Exception:  # a failing statistics pass never breaks the backward
        if scores_only is None:
            coverage[1] -= 1
        _log_once(("observe_statistics",), "flashwatch: the statistics pass of an observed attention call failed; "
                  "training goes on unchanged", exc_info=True)


def _observe_statistics_fake(q, k, v, out, grad_out, flag, counts, values, coverage, attn_mask, causal, sm_scale,
                             eps, masked, unit_gap, x, rotation, layer, pattern_read, scores_only):
    _warn_if_traced_for_cuda_graphs(q)
    return None


def _warn_if_traced_for_cuda_graphs(q: torch.Tensor) -> None:
    """Observe mode's statistics operators traced for CUDA graphs (``torch.compile(mode="reduce-overhead")``,
    which sets Inductor's ``triton.cudagraphs`` while it traces): say once that the step slows down and
    what avoids it. The operators are CUDA-graph-unsafe (``_TAGS``), so Inductor cuts the backward at
    every attention layer and runs them between the graphs it records."""
    if q.device.type != "cuda":
        return
    from torch._inductor import config as inductor_config

    if getattr(inductor_config.triton, "cudagraphs", False):
        _log_once(("observe_cuda_graphs",),
                  "flashwatch: observe mode under CUDA graphs (torch.compile mode='reduce-overhead'): its "
                  "statistics operator runs between CUDA graphs at every attention layer, which makes each step "
                  "slower (docs/GUIDE.md, torch.compile). Own-kernel mode (MonitorConfig(mode='own_kernel')) or "
                  "torch.compile's default mode avoid this.")


_observe_statistics = _operator(
    "observe_statistics(Tensor q, Tensor k, Tensor v, Tensor out, Tensor grad_out, Tensor flag, Tensor(a!) counts, "
    "Tensor(b!) values, Tensor(c!) coverage, Tensor? attn_mask, bool causal, float sm_scale, float eps, bool masked, "
    "float unit_gap, Tensor? x, Tensor? rotation, Tensor? layer, Tensor? pattern_read, str? scores_only) -> ()",
    _observe_statistics_impl, _observe_statistics_fake)


class _Observe(torch.autograd.Function):
    """The identity on ``out`` whose backward runs ``flashwatch::observe_statistics`` on the
    output gradient. Its forward is a view of ``out`` (no copy: the compiler turns it into
    nothing), which a custom operator could not return (an operator's output may not alias
    its input); Dynamo traces this Function's forward and backward into the compiled graphs."""

    @staticmethod
    def forward(ctx, out, q, k, v, flag, counts, values, coverage, attn_mask, x, rotation, causal, sm_scale, eps,
                masked, unit_gap, layer, pattern_read, scores_only):
        # attn_mask, x, rotation, layer, pattern_read and scores_only may be None
        ctx.save_for_backward(q, k, v, out, flag, counts, values, coverage, attn_mask, x, rotation, layer,
                              pattern_read)
        ctx.causal, ctx.sm_scale, ctx.eps, ctx.masked, ctx.unit_gap = causal, sm_scale, eps, masked, unit_gap
        ctx.scores_only = scores_only
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, flag, counts, values, coverage, attn_mask, x, rotation, layer, pattern_read = ctx.saved_tensors
        _observe_statistics(q, k, v, out, grad_out, flag, counts, values, coverage, attn_mask, ctx.causal,
                            ctx.sm_scale, ctx.eps, ctx.masked, ctx.unit_gap, x, rotation, layer, pattern_read,
                            ctx.scores_only)
        return (grad_out,) + (None,) * 18


def observe(out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, flag: torch.Tensor,
            stats: AttentionStats, coverage: torch.Tensor, causal: bool, sm_scale: Optional[float] = None,
            eps: float = 1e-3, attn_mask: Optional[torch.Tensor] = None, masked: bool = False,
            x: Optional[torch.Tensor] = None, rotation: Optional[torch.Tensor] = None,
            layer: Optional[torch.Tensor] = None, scores_only: Optional[str] = None) -> torch.Tensor:
    """Mark ``out``, the output of the model's own attention of ``q, k, v``: returns a view of it
    whose backward adds the statistics of that call into ``stats`` when ``flag`` is set (with
    ``masked``: the dense pass of ``flashwatch.kernels.masked``, with ``attn_mask``; with ``x``,
    ``rotation`` and ``layer``, the layer's key: the call's rows hook, module docstring). A
    self-attention mask's pattern is read here, on monitored steps, without waiting
    (``masked.read_pattern``), for the backward's choice of pass.

    ``scores_only``: for a call whose delta error cannot be measured (attention dropout), the
    reason, logged once per layer: the backward adds only its rows, repeated maxima and max logit,
    and counts it as a call, not as a measured one."""
    from .masked import has_pattern

    scale = float(sm_scale) if sm_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    counts, values = stats_buffers(stats)
    mask = attn_mask.detach() if isinstance(attn_mask, torch.Tensor) else None
    n = q.shape[2]
    read = _mask_pattern(mask, flag, pattern_reads, n) if masked and has_pattern(mask, n, k.shape[2], causal) else None
    return _Observe.apply(out, q.detach(), k.detach(), v.detach(), flag, counts, values, coverage, mask, _detached(x),
                          _detached(rotation), bool(causal), scale, float(eps), bool(masked), float(stats.unit_gap),
                          layer, read, None if scores_only is None else str(scores_only))


def _detached(x: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return x.detach() if isinstance(x, torch.Tensor) else None


# --- calls that are not measured -----------------------------------------------------------------

def _unmeasured_call_impl(flag, coverage, layer, reason) -> None:
    if not _on(flag):
        return
    coverage[0] += 1
    label = _label(layer)
    _log_once((label, reason), "flashwatch: layer %s: attention calls where %s", label, reason)


def _unmeasured_call_fake(flag, coverage, layer, reason):
    return None


_unmeasured_call = _operator("unmeasured_call(Tensor flag, Tensor(a!) coverage, Tensor layer, str reason) -> ()",
                             _unmeasured_call_impl, _unmeasured_call_fake)


def unmeasured_call(flag: torch.Tensor, coverage: torch.Tensor, layer: torch.Tensor, reason: str) -> None:
    """Count an attention call of ``layer`` (its key, ``register_layer``) that is not measured (on
    monitored steps), and log ``reason`` once per layer and reason (the whole verdict: "<why>: those
    calls are not measured")."""
    _unmeasured_call(flag, coverage, layer, str(reason))
