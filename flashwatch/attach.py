"""Find a model's attention layers and their query weights; route their attention calls.

Two jobs, both about the model and nothing about statistics:

1. ``find_attention(model, attention=None)``: every attention module in module order, with
   its number of query heads and a function returning its query weight per head,
   W^Q as an (H, D, C) tensor (head h's D rows of the query projection, d_model C columns).
   Families found automatically:

   - nanoGPT-style: a module with an ``nn.Linear`` ``c_attn`` of out_features 3*C and an int
     ``n_head``; W^Q_h = c_attn.weight[:C].view(H, D, C)[h].
   - Hugging Face GPT-2 (``GPT2Attention``): ``c_attn`` is a ``Conv1D`` whose weight is
     (C, 3C), so W^Q = weight[:, :C].T.
   - Hugging Face Llama-style (``q_proj`` Linear of (H*D, C) beside ``k_proj``/``o_proj``;
     Llama, Mistral, Qwen2, ...): W^Q = q_proj.weight.view(H, D, C); H from the module or its
     config; grouped-query attention is fine (only the query side is needed).

   Anything else: ``attention={module_name: query_weight_fn}`` with
   ``query_weight_fn(module) -> Tensor (H, D, C)``.

2. ``Router``: makes the model's ``torch.nn.functional.scaled_dot_product_attention`` calls
   inside attached modules go where the Monitor wants. A forward pre-hook / forward hook pair
   on each attached module sets and clears a thread-local "current layer"; one dispatching
   wrapper replaces ``torch.nn.functional.scaled_dot_product_attention`` (installed once for
   all routers, the original kept; ``Router.remove`` restores it and removes the hooks, so the
   model is exactly as before). The wrapper:

   - outside attached layers: the original SDPA, untouched;
   - ``own_kernel`` layers: ``flashwatch.kernels.flash_attention`` with the layer's variant,
     and ``stats`` only on monitored steps; calls using what the kernel does not support (an
     attn_mask, dropout, head dims outside (16, 32, 64, 128), query and key lengths that
     differ, ...) fall back to the original SDPA, and the reason is logged once per layer;
   - ``observe`` layers: the original SDPA; on monitored steps only, q, k, v and the output
     are kept (detached; SDPA keeps them for its backward anyway) and a hook on the output
     gets dO and runs ``flashwatch.kernels.attention_statistics`` beside the model's kernel.

   On unmonitored steps an observed layer costs one Python check per call.

Cautions:

- The model must call ``torch.nn.functional.scaled_dot_product_attention`` through the module
  attribute at call time (``F.scaled_dot_product_attention(...)``, as nanoGPT and Hugging Face
  SDPA attention do); a name imported earlier with ``from torch.nn.functional import ...``
  is not reached. The Monitor warns when an attached layer saw no call on a monitored step.
- Activation checkpointing re-runs the forward in the backward: statistics of such layers
  are counted twice (the ratios stay right; sums double).
- Statistics are collected only where autograd records (``torch.is_grad_enabled()``), so
  evaluation passes under ``no_grad`` never count.
- In ``own_kernel`` mode a failure of flashwatch's kernel in the forward falls back to SDPA
  (logged, counted); one in its backward cannot be caught there and surfaces as the backward's
  error, as any attention kernel's would. Observe mode never runs flashwatch code in the
  model's own forward or backward math.
"""

from __future__ import annotations

import contextlib
import logging
import re
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger("flashwatch")

QueryWeightFn = Callable[[nn.Module], torch.Tensor]  # module -> (H, D, C)

__all__ = ["AttentionLayer", "find_attention", "select_layers", "Router", "QueryWeightFn"]


@dataclass(eq=False)  # identity: a layer is one module
class AttentionLayer:
    """One attached attention layer.

    Attributes:
        index: the ``layer`` label (position in ``Monitor.layers``).
        name: the module's name in ``model.named_modules()``.
        module: the attention module.
        num_heads: query heads H.
        family: ``"nanogpt"``, ``"hf_gpt2"``, ``"hf_llama"`` or ``"explicit"``.
        mode: ``"own_kernel"`` or ``"observe"`` (auto_fix can move an observed layer to own_kernel).
        variant: the kernel variant in own_kernel mode; ``"sdpa"`` while observed.
        stats: the layer's ``AttentionStats`` (device tensors; reset after every monitored step).
        calls: attention calls measured during the current monitored step.
        low_precision: whether the last measured call's output was BF16/FP16 (None before any).
    """

    index: int
    name: str
    module: nn.Module
    num_heads: int
    query_weight_fn: QueryWeightFn = field(repr=False)
    family: str
    mode: str = "observe"
    variant: str = "sdpa"
    stats: Any = field(default=None, repr=False)
    calls: int = 0
    low_precision: bool | None = None

    def query_weight(self) -> torch.Tensor:
        """W^Q per head, (H, D, C), detached (a view of the parameter where the layout allows)."""
        w = self.query_weight_fn(self.module)
        return w.detach()

    def ensure_stats(self, device: torch.device):
        """The layer's stats on ``device`` (recreated if the model moved since attach)."""
        from flashwatch.kernels import AttentionStats

        if self.stats is None or self.stats.device != device:
            self.stats = AttentionStats(self.num_heads, device)
        return self.stats


# --- finding attention modules --------------------------------------------------------------

def _nanogpt(module: nn.Module):
    c_attn, n_head = getattr(module, "c_attn", None), getattr(module, "n_head", None)
    if not isinstance(c_attn, nn.Linear) or not isinstance(n_head, int) or isinstance(n_head, bool):
        return None
    c = c_attn.in_features
    if c_attn.out_features != 3 * c or n_head < 1 or c % n_head:
        return None
    d = c // n_head
    # q = x @ c_attn.weight[:C].T, then .view(B, T, H, D): head h owns rows h*D:(h+1)*D
    return n_head, lambda m: m.c_attn.weight[:c].view(n_head, d, c)


def _hf_gpt2(module: nn.Module):
    c_attn = getattr(module, "c_attn", None)
    if c_attn is None or type(c_attn).__name__ != "Conv1D" or getattr(module, "is_cross_attention", False):
        return None
    w = getattr(c_attn, "weight", None)
    heads = getattr(module, "num_heads", None)
    if w is None or w.dim() != 2 or w.shape[1] != 3 * w.shape[0] or not isinstance(heads, int):
        return None
    c = w.shape[0]
    if c % heads:
        return None
    d = c // heads
    # Conv1D computes x @ weight + bias with weight (C, 3C): query columns [:C], transposed to (C_out, C_in)
    return heads, lambda m: m.c_attn.weight[:, :c].t().reshape(heads, d, c)


def _hf_llama(module: nn.Module):
    q_proj = getattr(module, "q_proj", None)
    if not isinstance(q_proj, nn.Linear) or not hasattr(module, "k_proj") or not hasattr(module, "o_proj"):
        return None
    config = getattr(module, "config", None)
    heads = getattr(module, "num_heads", None) or getattr(config, "num_attention_heads", None)
    head_dim = getattr(module, "head_dim", None)
    if not heads and head_dim:
        heads = q_proj.out_features // head_dim
    if not isinstance(heads, int) or heads < 1 or q_proj.out_features % heads:
        return None
    d, c = q_proj.out_features // heads, q_proj.in_features
    return heads, lambda m: m.q_proj.weight.view(heads, d, c)


_FAMILIES = (("nanogpt", _nanogpt), ("hf_gpt2", _hf_gpt2), ("hf_llama", _hf_llama))


def _check_weight(name: str, w: Any, heads: int | None = None) -> int:
    if not isinstance(w, torch.Tensor) or w.dim() != 3:
        shape = tuple(w.shape) if isinstance(w, torch.Tensor) else type(w).__name__
        raise ValueError(f"query weight of {name!r} must be a tensor (heads, head_dim, model_dim), got {shape}")
    if heads is not None and w.shape[0] != heads:
        raise ValueError(f"query weight of {name!r} has {w.shape[0]} heads, expected {heads}")
    return w.shape[0]


def find_attention(model: nn.Module, attention: Mapping[str, QueryWeightFn] | None = None
                   ) -> list[tuple[str, nn.Module, int, QueryWeightFn, str]]:
    """Attention modules of ``model`` in module order: (name, module, heads, query_weight_fn, family).

    Args:
        model: any ``nn.Module``.
        attention: optional ``{module_name: query_weight_fn}``; when given, exactly these
            modules are used (``query_weight_fn(module) -> (H, D, C)``).

    Raises:
        ValueError: no attention found (with what to do), an unknown module name, or a query
            weight function that does not return an (H, D, C) tensor.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    modules = dict(model.named_modules())
    found = []
    if attention is not None:
        if not isinstance(attention, Mapping) or not attention:
            raise ValueError("attention must be a non-empty dict {module_name: query_weight_fn}, got "
                             f"{attention!r}")
        unknown = [n for n in attention if n not in modules]
        if unknown:
            raise ValueError(f"attention names {unknown} are not modules of the model; some module names: "
                             f"{[n for n in modules if n][:12]}")
        order = {n: i for i, n in enumerate(modules)}
        for name in sorted(attention, key=order.__getitem__):
            fn = attention[name]
            if not callable(fn):
                raise ValueError(f"attention[{name!r}] must be a function module -> (H, D, C) query weight, "
                                 f"got {type(fn).__name__}")
            heads = _check_weight(name, fn(modules[name]))
            found.append((name, modules[name], heads, fn, "explicit"))
        return found
    skip_prefix: str | None = None
    for name, module in modules.items():
        if skip_prefix is not None and name.startswith(skip_prefix):
            continue  # children of an attention module are not attention modules themselves
        for family, probe in _FAMILIES:
            hit = probe(module)
            if hit is not None:
                heads, fn = hit
                _check_weight(name, fn(module), heads)
                found.append((name, module, heads, fn, family))
                skip_prefix = name + "."
                break
    if not found:
        raise ValueError(
            "no attention layer found: flashwatch recognises nanoGPT-style modules (c_attn Linear of 3*C "
            "outputs and n_head), Hugging Face GPT-2 (c_attn Conv1D) and Llama-style (q_proj/k_proj/o_proj) "
            "attention; name yours with attach(model, attention={'blocks.0.attn': lambda m: "
            "m.wq.weight.view(H, D, C), ...})")
    return found


def select_layers(found: Sequence[tuple], layers: Any) -> list[tuple]:
    """Keep the entries of ``find_attention`` that ``MonitorConfig.layers`` selects.

    Args:
        found: ``find_attention``'s list.
        layers: None (all), a regex searched in the module names, or a list of module names and
            indices into ``found``.

    Raises:
        ValueError: nothing matched, or a listed name/index does not exist (the message lists
            what exists).
    """
    if layers is None:
        return list(found)
    names = [f[0] for f in found]
    if isinstance(layers, str):
        pattern = re.compile(layers)
        keep = [f for f in found if pattern.search(f[0])]
        if not keep:
            raise ValueError(f"MonitorConfig.layers={layers!r} matched none of the attention layers {names}")
        return keep
    chosen: set[int] = set()
    for item in layers:
        if isinstance(item, int):
            if item >= len(found):
                raise ValueError(f"MonitorConfig.layers: index {item} out of range; the model has {len(found)} "
                                 f"attention layers {names}")
            chosen.add(item)
        else:
            if item not in names:
                raise ValueError(f"MonitorConfig.layers: {item!r} is not an attention layer; found {names}")
            chosen.add(names.index(item))
    return [found[i] for i in sorted(chosen)]


# --- routing -----------------------------------------------------------------------------------

_local = threading.local()  # .current: (Router, AttentionLayer) | None; .stack: saved outer values
_install_lock = threading.Lock()
_original_sdpa: Callable | None = None  # what _install replaced (torch's SDPA unless someone wrapped it first)
_import_time_sdpa = F.scaled_dot_product_attention  # for a dispatcher still held after every router left
_users = 0

_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_SDPA_DEFAULTS = (None, None, None, None, 0.0, False, None, False)


def _sdpa_dispatch(*args, **kwargs):
    """Stand-in for ``torch.nn.functional.scaled_dot_product_attention`` while flashwatch is attached."""
    current = getattr(_local, "current", None)
    if current is None:
        return original_sdpa()(*args, **kwargs)
    router, layer = current
    return router.call(layer, args, kwargs)


def _install() -> None:
    global _original_sdpa, _users
    with _install_lock:
        if _users == 0:
            _original_sdpa = F.scaled_dot_product_attention
            F.scaled_dot_product_attention = _sdpa_dispatch
        _users += 1


def _uninstall() -> None:
    global _original_sdpa, _users
    with _install_lock:
        _users -= 1
        if _users > 0:
            return
        if F.scaled_dot_product_attention is _sdpa_dispatch:
            F.scaled_dot_product_attention = _original_sdpa
        else:
            log.warning("torch.nn.functional.scaled_dot_product_attention was replaced by someone else after "
                        "flashwatch attached; leaving that replacement in place")
        _original_sdpa = None


def original_sdpa() -> Callable:
    """The SDPA function flashwatch wraps (torch's own when nothing else wrapped it first)."""
    return _original_sdpa if _original_sdpa is not None else _import_time_sdpa


def _bind(args: tuple, kwargs: dict) -> list:
    vals = list(_SDPA_DEFAULTS)
    for i, a in enumerate(args[: len(vals)]):
        vals[i] = a
    for i, name in enumerate(_SDPA_ARGS):
        if name in kwargs:
            vals[i] = kwargs[name]
    return vals


def unsupported_reason(q, k, v, attn_mask, dropout_p, enable_gqa, num_heads: int) -> str | None:
    """Why flashwatch's kernel cannot take this SDPA call (None if it can). Python checks only."""
    from flashwatch.kernels import DTYPES, HEAD_DIMS

    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
        return "query, key and value are not all tensors"
    if attn_mask is not None:
        return "an attn_mask is given (padding or a custom mask; the kernel takes causal or full attention only)"
    if dropout_p:
        return f"attention dropout is on (dropout_p={dropout_p})"
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return f"inputs are not (B, heads, N, D) (q has shape {tuple(q.shape)})"
    if k.shape != v.shape or k.shape[0] != q.shape[0]:
        return f"key/value shapes {tuple(k.shape)}, {tuple(v.shape)} do not match the query {tuple(q.shape)}"
    if q.shape[2] != k.shape[2]:
        return f"query and key lengths differ ({q.shape[2]} vs {k.shape[2]}: a KV cache or cross attention)"
    if q.shape[-1] not in HEAD_DIMS:
        return f"head dim {q.shape[-1]} is not one of {HEAD_DIMS}"
    if q.shape[1] != k.shape[1] and (not enable_gqa or q.shape[1] % k.shape[1]):
        return f"{q.shape[1]} query heads and {k.shape[1]} key heads without enable_gqa"
    if q.shape[1] != num_heads:
        return f"the call has {q.shape[1]} query heads, the layer was attached with {num_heads}"
    if q.dtype not in DTYPES or not (q.dtype == k.dtype == v.dtype):
        return f"dtypes {q.dtype}, {k.dtype}, {v.dtype} (accepted: one of {DTYPES})"
    return None


def _compiling() -> bool:
    """True while torch.compile traces (the Python of an attention call then runs once, at trace time)."""
    compiler = getattr(torch, "compiler", None)
    return bool(compiler is not None and hasattr(compiler, "is_compiling") and compiler.is_compiling())


def _autocast_inputs(q, k, v):
    """Cast q, k, v as autocast would for SDPA (to the autocast dtype) when autocast is on."""
    dev = q.device.type
    try:
        if torch.is_autocast_enabled(dev):
            dt = torch.get_autocast_dtype(dev)
            return q.to(dt), k.to(dt), v.to(dt), True
    except (RuntimeError, TypeError):  # a device type autocast does not know
        pass
    return q, k, v, False


class Router:
    """Routes the attention calls of attached layers (see the module docstring).

    Args:
        layers: the attached layers (their ``mode``/``variant`` are read at every call, so a
            switch takes effect at the next call).
        beta, eps: kernel options (``MonitorConfig.beta``, ``.eps``).
        on_error: ``on_error(kind, exception)``, called for a failure inside monitoring (the
            Monitor logs once per kind and counts); training goes on with the original SDPA.

    ``monitoring`` (a bool the Monitor sets between steps) says whether the current step is a
    monitored one.
    """

    def __init__(self, layers: Sequence[AttentionLayer], *, beta: float = 2.0, eps: float = 1e-3,
                 on_error: Callable[[str, BaseException], None] | None = None):
        self.layers = list(layers)
        self.beta, self.eps = beta, eps
        self.on_error = on_error or (lambda kind, exc: log.warning("flashwatch %s failed", kind, exc_info=exc))
        self.monitoring = False
        self._handles: list = []
        self._logged: set = set()
        self.installed = False

    # hooks ------------------------------------------------------------------------------------
    def install(self) -> None:
        if self.installed:
            return
        for layer in self.layers:
            self._handles.append(layer.module.register_forward_pre_hook(self._enter_hook(layer)))
            self._handles.append(layer.module.register_forward_hook(self._exit_hook, always_call=True))
        _install()
        # a router dropped without remove() (model and monitor garbage-collected) still gives
        # torch's SDPA back once the garbage collector frees it
        self._finalizer = weakref.finalize(self, _uninstall)
        self.installed = True

    def remove(self) -> None:
        """Remove the hooks and, when no other router is installed, restore torch's SDPA."""
        if not self.installed:
            return
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._finalizer()  # runs _uninstall once (and never again at garbage collection)
        self.installed = False

    def _enter_hook(self, layer: AttentionLayer):
        def enter(module, args):
            stack = getattr(_local, "stack", None)
            if stack is None:
                stack = _local.stack = []
            stack.append(getattr(_local, "current", None))
            _local.current = (self, layer)
        return enter

    @staticmethod
    def _exit_hook(module, args, output):
        stack = getattr(_local, "stack", None)
        _local.current = stack.pop() if stack else None

    # the call -----------------------------------------------------------------------------------
    def _log_once(self, key: tuple, message: str, *args) -> None:
        if key not in self._logged:
            self._logged.add(key)
            log.warning(message, *args)

    def call(self, layer: AttentionLayer, args: tuple, kwargs: dict):
        sdpa = original_sdpa()
        if layer.mode != "own_kernel":
            out = sdpa(*args, **kwargs)
            if self.monitoring and torch.is_grad_enabled():  # observe, monitored step
                if _compiling():
                    # a compiled graph replays without our hooks setting the current layer, so
                    # what it measured would land on the wrong layer: measure nothing instead
                    self._log_once(("compile", layer.index),
                                   "flashwatch: layer %d (%s) runs inside torch.compile; observe mode cannot "
                                   "attribute its attention there and does not measure it (attach to the "
                                   "uncompiled model, or use mode='own_kernel')", layer.index, layer.name)
                    return out
                self._observe(layer, args, kwargs, out)
            return out
        q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa = _bind(args, kwargs)
        q, k, v, cast = _autocast_inputs(q, k, v) if isinstance(q, torch.Tensor) else (q, k, v, False)
        reason = unsupported_reason(q, k, v, attn_mask, dropout_p, enable_gqa, layer.num_heads)
        if reason is not None:
            self._log_once(("fallback", layer.index, reason),
                           "flashwatch: layer %d (%s) runs torch SDPA instead of flashwatch's kernel for calls "
                           "where %s; those calls are not measured", layer.index, layer.name, reason)
            return sdpa(*args, **kwargs)
        try:
            from flashwatch.kernels import flash_attention

            monitored = self.monitoring and torch.is_grad_enabled()
            stats = layer.ensure_stats(q.device) if monitored else None
            if monitored:
                layer.calls += 1
                layer.low_precision = q.dtype in (torch.bfloat16, torch.float16)
            with torch.autocast(q.device.type, enabled=False) if cast else contextlib.nullcontext():
                return flash_attention(q, k, v, causal=bool(is_causal), sm_scale=scale, variant=layer.variant,
                                       beta=self.beta, eps=self.eps, stats=stats)
        except Exception as exc:  # never break training: fall back to the model's own attention
            self.on_error("own_kernel", exc)
            return sdpa(*args, **kwargs)

    def _observe(self, layer: AttentionLayer, args: tuple, kwargs: dict, out) -> None:
        try:
            q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa = _bind(args, kwargs)
            if not isinstance(out, torch.Tensor) or not out.requires_grad:
                return  # no backward will come: nothing to measure
            if isinstance(q, torch.Tensor) and q.dtype != out.dtype:
                # autocast cast the inputs inside SDPA: measure what the kernel computed with
                q, k, v = q.to(out.dtype), k.to(out.dtype), v.to(out.dtype)
            reason = unsupported_reason(q, k, v, attn_mask, dropout_p, enable_gqa, layer.num_heads)
            if reason is not None:
                self._log_once(("observe", layer.index, reason),
                               "flashwatch: layer %d (%s): calls where %s are not measured", layer.index,
                               layer.name, reason)
                return
            stats = layer.ensure_stats(q.device)
            layer.calls += 1
            layer.low_precision = out.dtype in (torch.bfloat16, torch.float16)
            # k, v with fewer heads (grouped-query attention) are passed as they are: the
            # statistics pass maps query head h to kv head h // (H // Hkv), as SDPA's enable_gqa
            saved = (q.detach(), k.detach(), v.detach(), out.detach())
            causal, eps, on_error = bool(is_causal), self.eps, self.on_error

            def on_grad(grad_out):
                try:
                    from flashwatch.kernels import attention_statistics

                    with torch.autocast(grad_out.device.type, enabled=False):
                        attention_statistics(*saved, grad_out.to(saved[3].dtype), stats, causal=causal,
                                             sm_scale=scale, eps=eps)
                except Exception as exc:  # a failing statistics pass never breaks the backward
                    on_error("observe_stats", exc)
                return None

            out.register_hook(on_grad)
        except Exception as exc:
            self.on_error("observe", exc)
