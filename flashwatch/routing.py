"""Routing: make the model's attention calls inside attached layers go where the Monitor wants.

``Router``: makes the model's ``torch.nn.functional.scaled_dot_product_attention`` calls
inside attached modules go where the Monitor wants. A forward pre-hook / forward hook pair
on each attached module sets and clears the "current layer" (per thread; compiled code reads a
shared copy); one dispatching
wrapper replaces ``torch.nn.functional.scaled_dot_product_attention`` (installed once for
all routers, the original kept; ``Router.remove`` restores it and removes the hooks, so the
model is exactly as before). The wrapper:

- outside attached layers: the original SDPA, untouched;
- ``own_kernel`` layers: ``flashwatch.kernels.flash_attention`` with the layer's variant (and the
  call's attn_mask), and ``stats`` only on monitored steps; calls the kernel does not take
  (``unsupported_reason``: dropout, head dims outside (16, 32, 64, 128), query and key lengths that
  differ, ...) run the original SDPA, are measured beside it as in observe mode where the
  statistics can, and the reason is logged once per layer;
- ``observe`` layers: the original SDPA; on monitored steps only, q, k, v and the output
  are kept (detached; SDPA keeps them for its backward anyway) and a hook on the output
  gets dO and runs the statistics pass beside the model's kernel, the one
  ``statistics_route`` picks (the plain pass; the dense pass of ``flashwatch.kernels.masked``
  for masks and unequal lengths; scores only for attention dropout).

On unmonitored steps an observed layer costs one Python check per call.

Under ``torch.compile`` the same routing is traced into the compiled graph as custom operators
(``flashwatch.kernels.ops``): observe mode marks the model's SDPA output with ``ops.observe``
(a view of it, no copy; its backward runs ``flashwatch::observe_statistics``), own-kernel mode calls
``flashwatch::attention_with_stats``; each call carries its layer's statistics buffers, and whether the
step is monitored is the Router's ``flag`` tensor, read when the operators run, so monitored
and unmonitored steps share one compiled graph (no recompilation, no graph break). Calls
measured in part are marked too (``ops.observe(..., scores_only=reason)``: their scores are
measured in the backward); calls not measured at all are counted by ``flashwatch::unmeasured_call``.
For the W^Q-gradient error chain, compiled code carries each call's projection input X (on every
step: the graph is the same for monitored ones) and the layer's key (``ops.register_layer``: a
tensor, so that a block compiled once serves every block), whose rows source the backward
operators ask for the call's rows hook on monitored steps; the source also puts W^Q's gradient
hook in place, before that backward accumulates W^Q's gradient.

Every layer counts its attention calls on monitored steps (``AttentionLayer.coverage``:
[calls, calls measured in full]), so a layer whose calls cannot be measured reads coverage 0. An
observed call counts once its backward comes (a forward recomputed under activation checkpointing
is not a second call, and a forward without backward is none), and as measured once its statistics
pass has run there: a pass that failed leaves the call unmeasured.

Cautions:

- The model calls ``torch.nn.functional.scaled_dot_product_attention`` through the module
  attribute at call time (``F.scaled_dot_product_attention(...)``, as nanoGPT and Hugging Face
  SDPA attention do), or by a name its attention class's module bound at import
  (``from torch.nn.functional import scaled_dot_product_attention``): while a router is
  installed, such names in the modules that define the attached layers' classes and their
  ``forward`` are bound to the wrapper too, and given back with torch's SDPA. A name bound
  elsewhere (a helper module the forward calls) is not reached: a layer whose calls are never
  seen at a monitored step reads coverage 0 (the ``attention_coverage`` alert), and the Monitor
  logs once that it saw no call.
- Activation checkpointing re-runs the forward in the backward; that adds nothing: the
  statistics are taken in the backward, and the forward's max logit is a maximum.
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
import math
import sys
import threading
import types
import weakref
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F

from .attach import AttentionLayer
from .call_support import MEASURED, statistics_route, unsupported_reason
from .chain import QUERY_TOLERANCE, check_rotation, query_residual
from .families import FAMILIES

log = logging.getLogger("flashwatch")

__all__ = ["Router", "original_sdpa", "unsupported_reason", "statistics_route", "clear_routing_state"]

class _Current:
    """The layer whose forward is running: ``current`` (Router, AttentionLayer, its projection input
    X or None, its query's rotation (cos and sin stacked) or None; the last two in compiled code
    only) | None, and ``stack``, the saved outer values. Both exist from the start, so compiled code reads them
    without a guard on whether they were created yet (which would recompile at the second call)."""

    def __init__(self):
        self.current = None
        self.stack: list = []


class _ThreadCurrent(_Current, threading.local):
    """The same per thread (threads running replicas of a model each have their own)."""


# Eager calls read the per-thread state. Code torch.compile traces reads the shared one: Dynamo
# replays attribute writes of a plain object that a traced hook made, and reads one that a hook
# run outside the compiled frame (the hooks of the compiled top-level module) made.
_local = _ThreadCurrent()
_shared = _Current()


def _state() -> _Current:
    return _shared if _compiling() else _local


def clear_routing_state() -> None:
    """Forget which layer is running: called between optimizer steps, when no forward runs, and
    (``_begin_forward``) when the model's forward starts. The exit hook is not called when a
    forward raises (it is not registered with ``always_call``: that would make Dynamo guard on each
    module's hook id and compile a model compiled block by block once per block), so a forward that
    raised inside an attached layer leaves that layer pushed, in this thread's state and, where
    the exception came out of code torch.compile traced, in the shared one: a later attention
    call outside the attached layers would be routed as that layer's."""
    _clear((_local, _shared))


def _clear(states) -> None:
    for state in states:
        state.stack = []  # a new list, not list.clear(): an attribute write Dynamo replays as such
        state.current = None


def _counted_at_backward(coverage: torch.Tensor) -> Callable[[torch.Tensor], None]:
    """A hook on an own-kernel call's output: the call counts as one measured call when its
    backward comes (the kernel's backward adds its statistics), as an observed call does; a
    forward without backward (a frozen layer's, an evaluation with gradients on) counts nothing."""
    def count(grad: torch.Tensor) -> None:
        coverage.add_(1)
        return None  # the gradient goes on unchanged
    return count


def _begin_forward(module, args) -> None:
    """Forward pre-hook of the attached model: its forward starts with no layer routed."""
    if _compiling():
        _allowed_under_checkpoint(_clear, (_shared,))
    else:
        clear_routing_state()


_install_lock = threading.Lock()
_original_sdpa: Callable | None = None  # what _install replaced (torch's SDPA unless someone wrapped it first)
_import_time_sdpa = F.scaled_dot_product_attention  # for a dispatcher still held after every router left
_users = 0
# module -> weak reference to the installed router routing it (neither is kept alive by this)
_routers: "weakref.WeakKeyDictionary[torch.nn.Module, weakref.ref]" = weakref.WeakKeyDictionary()


def _router_of(module: torch.nn.Module) -> "Router | None":
    ref = _routers.get(module)
    return ref() if ref is not None else None


_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_SDPA_DEFAULTS = (None, None, None, None, 0.0, False, None, False)


def _sdpa_dispatch(*args, **kwargs):
    """Stand-in for ``torch.nn.functional.scaled_dot_product_attention`` while flashwatch is attached."""
    current = _state().current
    if current is None:
        return original_sdpa()(*args, **kwargs)
    router, layer, x, rotation = current
    return router.call(layer, args, kwargs, x, rotation)


# (Python module, name) -> what the name was bound to before the wrapper: SDPA bound at import
_rebound: dict = {}


def _defining_modules(layers: Sequence[AttentionLayer]) -> list:
    """The Python modules that define the layers' classes and their ``forward`` (not torch's own)."""
    names = set()
    for layer in layers:
        cls = type(layer.module)
        names.update({cls.__module__, getattr(getattr(cls, "forward", None), "__module__", None)})
    return [sys.modules[n] for n in sorted(n for n in names if n) if n in sys.modules
            and n != "torch" and not n.startswith("torch.")]


def _rebind(modules: Sequence[Any]) -> None:
    """Bind names of ``modules`` that hold torch's SDPA (bound at import) to the wrapper."""
    for module in modules:
        for name, value in list(vars(module).items()):
            if value is _original_sdpa or value is _import_time_sdpa:
                _rebound[(module, name)] = value
                setattr(module, name, _sdpa_dispatch)


def _install(modules: Sequence[Any] = ()) -> None:
    """Route torch's SDPA, and the names of ``modules`` bound to it at import."""
    global _original_sdpa, _users
    with _install_lock:
        if _users == 0:
            _original_sdpa = F.scaled_dot_product_attention
            F.scaled_dot_product_attention = _sdpa_dispatch
        _users += 1
        _rebind(modules)


class _OwnForward:
    """An attached attention module's ``forward`` as an attribute of the module itself (the class's
    own function, bound: it runs the same code), removed again by ``remove()``.

    torch.compile must tell an attached module from an unattached one of the same class: the hooks
    that route its calls are not guarded by Dynamo (``torch._dynamo.config.skip_nnmodule_hook_guards``),
    so code compiled for a model nobody attached (a second model of the same class in the process)
    would otherwise be run for the attached one, which then goes unmeasured. Dynamo does guard a
    module whose ``forward`` is its own attribute, so each gets its own compiled code. A module that
    already has its own ``forward`` (set by a library or the user) is left as it is: it is told apart
    already. Holds the module weakly (a router's finalizer keeps its handles)."""

    def __init__(self, module: torch.nn.Module):
        self._module = weakref.ref(module)
        self._bound_id = None
        if "forward" not in vars(module):
            bound = types.MethodType(type(module).forward, module)
            module.forward = bound
            self._bound_id = id(bound)

    def remove(self) -> None:
        module = self._module()
        if module is None or self._bound_id is None:
            return
        current = vars(module).get("forward")
        if id(current) == self._bound_id and getattr(current, "__self__", None) is module:  # not replaced since
            del module.forward
        self._bound_id = None


def _uninstall(keys: Sequence[int] = (), handles: Sequence[Any] = ()) -> None:
    """Take a router's hooks off, forget its layers' keys (the integers), and give torch's SDPA back
    when no router is left. Runs from a finalizer too (at any time, even while a fake-tensor mode
    traces): what fails here is logged, and the count of routers is kept right whatever happens."""
    global _original_sdpa, _users
    try:
        for handle in handles:  # the router's module hooks
            handle.remove()
        if keys:
            from flashwatch.kernels import ops

            for key in keys:
                ops.unregister_layer(key)
    except Exception:
        log.warning("flashwatch: taking a Monitor's hooks off failed", exc_info=True)
    with _install_lock:
        _users -= 1
        if _users > 0:
            return
        if F.scaled_dot_product_attention is _sdpa_dispatch:
            F.scaled_dot_product_attention = _original_sdpa
        else:
            log.warning("torch.nn.functional.scaled_dot_product_attention was replaced by someone else after "
                        "flashwatch attached; leaving that replacement in place")
        for (module, name), value in _rebound.items():
            if getattr(module, name, None) is _sdpa_dispatch:  # else rebound by someone since: left as it is
                setattr(module, name, value)
        _rebound.clear()
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


def _compiling() -> bool:
    """True while torch.compile traces (the Python of an attention call then runs once, at trace time)."""
    compiler = getattr(torch, "compiler", None)
    return bool(compiler is not None and hasattr(compiler, "is_compiling") and compiler.is_compiling())


# Dynamo's name for the reason it gives up a frame when code inside activation checkpointing
# (torch.utils.checkpoint under torch.compile) changes state from outside it, as the layer hooks'
# routing state does: the frame then runs eagerly (measured, but not compiled)
CHECKPOINT_SIDE_EFFECT = "HOP: Unsafe side effect"
CHECKPOINT_FLAG = "torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint"


def checkpoint_fallbacks() -> int:
    """How many times Dynamo gave up compiling code under activation checkpointing because of a
    side effect in it (its own counter; 0 where torch has none). The hooks' routing state is such
    a side effect; it needs no replay in the recomputed forward (compiled code carries the layer
    to the operators), so ``CHECKPOINT_FLAG = True`` lets Dynamo compile those frames."""
    try:
        from torch._dynamo.utils import counters
    except Exception:  # a torch without Dynamo
        return 0
    return sum(n for reason, n in counters["unimplemented"].items() if str(reason).startswith(CHECKPOINT_SIDE_EFFECT))


def _push(states, current) -> None:
    for state in states:
        state.stack.append(state.current)
        state.current = current


def _pop(states) -> None:
    for state in states:
        state.current = state.stack.pop() if state.stack else None


def _allowed_under_checkpoint(change, *args) -> None:
    """Make ``change`` (of the hooks' routing state) while torch.compile traces, such that Dynamo
    accepts it inside activation checkpointing, which otherwise refuses code that changes outside
    state and runs the whole frame eagerly. The change needs no replay when the checkpointed
    forward is recomputed: compiled code carries the layer to the operators as an argument.
    Where this torch has no such allowance, the frame runs eagerly (measured, not compiled) and
    the Monitor says so (``checkpoint_fallbacks``)."""
    import torch._dynamo.utils  # imported already while torch.compile traces, the only time this runs

    allow = getattr(torch._dynamo.utils, "_disable_side_effect_safety_checks_for_current_subtracer", None)
    if allow is None:
        change(*args)
    else:
        allow(change, *args)


def _set_sdpa_fallback(layer: AttentionLayer, reason: str | None) -> None:
    layer.sdpa_fallback = reason


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


def _as_projected(x: Any) -> torch.Tensor | None:
    """The projection input X as the query projection computes with it: in autocast's dtype where
    autocast is on (the W^Q gradient is formed from that copy; compiled code then keeps one copy
    for both, not the higher-precision X as well); None if it is not a tensor."""
    if not isinstance(x, torch.Tensor):
        return None
    device = x.device.type
    if x.is_floating_point() and torch.is_autocast_enabled(device):
        return x.to(torch.get_autocast_dtype(device))
    return x


class _ChainRows:
    """The rows hook of one monitored call (``AttentionStats.rows_hook``): the PyTorch paths call
    it with the rows (``LayerChain.add_rows``); the Triton kernels take its ``reduction`` and
    reduce the rows in-kernel. Failures are reported and never reach the backward."""

    def __init__(self, chain: Any, x: torch.Tensor, scale: float, on_error: Callable,
                 rotation: tuple[torch.Tensor, torch.Tensor] | None = None):
        self.chain, self.x, self.scale, self.on_error, self.rotation = chain, x, scale, on_error, rotation

    def __call__(self, e_rows, pk):
        try:
            self.chain.add_rows(self.x, e_rows, pk, self.scale, self.rotation)
        except Exception as exc:
            self.on_error("wq_error_chain", exc)

    def reduction(self, q):
        if self.rotation is not None:
            return None  # the kernels reduce unrotated rows only: they store the rows for __call__
        try:
            found = self.chain.reduction(self.x, q)
            found.check(q)  # a mismatch (a model moved since attach) is reported here, not in the backward
            return found
        except Exception as exc:  # then the kernel stores the rows and calls the hook, which reports again
            self.on_error("wq_error_chain", exc)
            return None


class _PendingRows:
    """Own-kernel mode: each backward takes the newest pending call's rows hook (reverse order of
    the forwards), whether it reduces in-kernel (``reduction``) or is called with the rows."""

    def __init__(self, stack: list):
        self.stack = stack

    def __call__(self, e_rows, pk):
        if self.stack:
            self.stack.pop()(e_rows, pk)

    def reduction(self, q):
        if not self.stack:
            return None
        hook = self.stack.pop()
        found = hook.reduction(q)
        if found is None:
            self.stack.append(hook)  # the kernel stores the rows and calls this hook with them
        return found


class Router:
    """Routes the attention calls of attached layers (see the module docstring).

    Args:
        layers: the attached layers (their ``mode``/``variant`` are read at every call, so a
            switch takes effect at the next call).
        beta, eps: kernel options (``MonitorConfig.beta``, ``.eps``).
        on_error: ``on_error(kind, exception)``, called for a failure inside monitoring (the
            Monitor logs once per kind and counts); training goes on with the original SDPA.

    ``monitoring`` (a bool the Monitor sets between steps) says whether the current step is a
    monitored one; ``flag`` is the same as a CPU tensor (0-d int32), which compiled graphs read.
    """

    def __init__(self, layers: Sequence[AttentionLayer], *, beta: float = 2.0, eps: float = 1e-3,
                 on_error: Callable[[str, BaseException], None] | None = None, root: Any = None):
        self.layers = list(layers)
        self.root = root  # the attached model: its forward starts with no layer routed (None: not hooked)
        self.beta, self.eps = beta, eps
        self.on_error = on_error or (lambda kind, exc: log.warning("flashwatch %s failed", kind, exc_info=exc))
        self.flag = torch.zeros((), dtype=torch.int32)  # read by compiled graphs at run time
        self.monitoring = False
        self._handles: list = []
        self._logged: set = set()
        self._keys: list[int] = []  # the layers' keys of the compiled operators (ops.register_layer), as integers
        self.installed = False
        self.on_taken_over: Any = None  # a weak reference to call when another router takes the modules over

    @property
    def monitoring(self) -> bool:
        return self._monitoring

    @monitoring.setter
    def monitoring(self, value: bool) -> None:
        self._monitoring = bool(value)
        self.flag.fill_(int(self._monitoring))

    # hooks ------------------------------------------------------------------------------------
    def install(self) -> None:
        """Put the hooks in place and route torch's SDPA. A module routed by another installed
        router (a Monitor attached earlier and never detached, as when a notebook cell that
        attaches runs again) is taken over: that router is removed, with a warning, so that one
        Monitor measures a module and the earlier one stops costing anything."""
        if self.installed:
            return
        self._take_over([layer.module for layer in self.layers])
        if self.root is not None:  # first, and before any hook of the root itself (an attached layer may be the root)
            self._handles.append(self.root.register_forward_pre_hook(_begin_forward, prepend=True))
        for layer in self.layers:
            self._handles.append(layer.module.register_forward_pre_hook(self._enter_hook(layer), with_kwargs=True))
            self._handles.append(layer.module.register_forward_hook(self._exit_hook))
            self._handles.append(_OwnForward(layer.module))
        self._keys = self._register_layers()
        _install(_defining_modules(self.layers))
        # the hooks hold the router weakly: a router dropped without remove() (its Monitor dropped,
        # the model still training) takes its hooks off and gives torch's SDPA back once the
        # garbage collector frees it
        self._finalizer = weakref.finalize(self, _uninstall, list(self._keys), list(self._handles))
        self.installed = True

    def remove(self) -> None:
        """Remove the hooks and, when no other router is installed, restore torch's SDPA."""
        if not self.installed:
            return
        for layer in self.layers:
            if _router_of(layer.module) is self:
                del _routers[layer.module]
        self._handles.clear()
        for layer in self.layers:
            if layer.chain is not None:
                layer.chain.unwatch()
        self._finalizer()  # removes the hooks and runs _uninstall once (never again at garbage collection)
        self._keys = []
        for layer in self.layers:
            layer.key = None
        self.installed = False

    def _take_over(self, modules: list) -> None:
        earlier = {id(r): r for r in map(_router_of, modules) if r is not None and r is not self and r.installed}
        for other in earlier.values():
            names = ", ".join(layer.name for layer in other.layers)
            log.warning("flashwatch: attention layers of this model were still attached by an earlier Monitor (%s); "
                        "it is detached from them now, since one Monitor measures a model (call monitor.detach() "
                        "when replacing a Monitor)", names)
            other.remove()
            tell = other.on_taken_over() if other.on_taken_over is not None else None
            if tell is not None:
                tell()
        for m in modules:
            _routers[m] = weakref.ref(self)

    def _register_layers(self) -> list:
        """For compiled code: each layer's key (``ops.register_layer``), a tensor the operators
        take, so that no argument differs between layers but tensors (one compilation serves every
        block of a model compiled block by block); with it the layer's name for the operators'
        logs and, where the layer has a W^Q-error chain, the source of its calls' rows hooks, which
        the operators' backward asks on monitored steps. The source holds the router weakly and
        the layer by its position (the registry is global: a strong reference would keep the model
        and the Monitor alive). Returns the keys."""
        from flashwatch.kernels import ops

        ref = weakref.ref(self)

        def source_for(position: int):
            def source(x: torch.Tensor, scale: float, rotation: torch.Tensor | None = None,
                       query: torch.Tensor | None = None):
                router = ref()
                layer = router.layers[position] if router is not None else None
                if layer is None or layer.chain is None:
                    return None
                if layer.rotary and rotation is None:
                    router._log_rotation_missing(layer)
                    return None
                turn = (rotation[0], rotation[1]) if rotation is not None else None  # (cos, sin), as eager
                if not router._query_is_projection(layer, query, x, turn):
                    return None
                # the true gradient's push: W^Q's gradient hook, registered here, before this
                # backward accumulates W^Q's gradient (none where W^Q is not a parameter)
                router._watch_query_weight(layer)
                return _ChainRows(layer.chain, x, scale, router.on_error, turn)
            return source

        for position, layer in enumerate(self.layers):
            layer.key = ops.register_layer(f"{layer.index} ({layer.name})",
                                           source_for(position) if layer.chain is not None else None)
        return [int(layer.key) for layer in self.layers]  # read now: _uninstall may run while a fake mode traces

    def _enter_hook(self, layer: AttentionLayer):
        ref = weakref.ref(self)  # weakly: the model's hooks must not keep a dropped Monitor alive

        def enter(module, args, kwargs):
            router = ref()  # None only while its finalizer takes these hooks off: the call is not routed
            compiling = _compiling()
            if router is not None and not compiling and _router_of(module) is not router:
                router = None  # a copy of the module (copy.deepcopy carries its hooks): not an attached layer
            x = None
            # the projection's input X (B, N, C): the module's first input (nanoGPT's x, Hugging
            # Face's hidden_states). Compiled code carries it to the operators on every step
            # (whether a step is monitored is read when they run: no guard on it); eager code
            # takes it on monitored steps only
            if router is not None and layer.chain is not None and (
                    compiling or (router.monitoring and torch.is_grad_enabled())):
                x = _as_projected(args[0] if args else kwargs.get("hidden_states", kwargs.get("x")))
            # a rotated query (RoPE): the call's rotation, which the rows are turned back through
            # (compiled code carries it to the operators, cos and sin stacked; where the call names
            # none, the operators' rows source says so when it runs)
            rotation = None
            if layer.rotary and x is not None:
                rotation = check_rotation(kwargs.get("position_embeddings", args[1] if len(args) > 1 else None), x,
                                          layer.chain.head_dim)
                if rotation is None and not compiling:
                    router._log_rotation_missing(layer)
                    x = None
            # pushed whatever the router: the exit hook pops once per forward
            carried = (x, torch.stack(rotation) if rotation is not None else None) if compiling else (None, None)
            current = (router, layer) + carried if router is not None else None
            if compiling:
                _allowed_under_checkpoint(_push, (_shared,), current)
            else:
                _push((_local, _shared), current)
            if layer.chain is not None and not compiling:
                layer.chain_input = x.detach() if x is not None else None
                layer.chain_rotation = rotation
            return None
        return enter

    @staticmethod
    def _exit_hook(module, args, output):
        if _compiling():
            _allowed_under_checkpoint(_pop, (_shared,))
        else:
            current = _local.current
            _pop((_local, _shared))
            if current is not None:
                # the call has taken X (its rows hook holds it until the backward): keeping it here
                # would hold the activation past the backward that frees it
                current[1].chain_input = current[1].chain_rotation = None

    # the call -----------------------------------------------------------------------------------
    def _log_once(self, key: tuple, message: str, *args, level: int = logging.WARNING) -> None:
        if key not in self._logged:
            self._logged.add(key)
            log.log(level, message, *args)

    def log_fallback(self, layer: AttentionLayer) -> None:
        """Say once per layer and reason that an own-kernel layer's calls run torch SDPA
        (``layer.sdpa_fallback``). Compiled code cannot log where it decides (a log call would break
        the graph): the Monitor calls this for it at each monitored step."""
        reason = layer.sdpa_fallback
        if reason is None:
            return
        self._log_once(("fallback", layer.index, reason),
                       "flashwatch: layer %d (%s) runs torch SDPA instead of flashwatch's kernel for calls where %s, "
                       "so its variant %s (an auto_fix switch too) is not in effect on them; it reports variant sdpa, "
                       "and its statistics come from observe mode's pass where that pass can take the call "
                       "(attention_coverage says how many)", layer.index, layer.name, reason, layer.variant)

    def _log_rotation_missing(self, layer: AttentionLayer) -> None:
        self._log_once(("rotation", layer.index),
                       "flashwatch: layer %d (%s): the W^Q-error metrics of a rotary layer need the call's "
                       "position_embeddings=(cos, sin), each (batch or 1, positions, head dim); this call names "
                       "none: they read NaN", layer.index, layer.name)

    def call(self, layer: AttentionLayer, args: tuple, kwargs: dict, x: Any = None, rotation: Any = None):
        if _compiling():
            return self._compiled_call(layer, args, kwargs, x, rotation)
        sdpa = original_sdpa()
        if layer.mode != "own_kernel":
            out = sdpa(*args, **kwargs)
            if self.monitoring and torch.is_grad_enabled():  # observe, monitored step
                self._observe(layer, args, kwargs, out)
            return out
        q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa = _bind(args, kwargs)
        query = q  # the model's own query tensor (its gradient is dQ for the W^Q-error chain)
        q, k, v, cast = _autocast_inputs(q, k, v) if isinstance(q, torch.Tensor) else (q, k, v, False)
        reason = unsupported_reason(q, k, v, attn_mask, dropout_p, enable_gqa, layer.num_heads, bool(is_causal))
        layer.sdpa_fallback = reason
        if reason is not None:
            self.log_fallback(layer)
            out = sdpa(*args, **kwargs)
            if self.monitoring and torch.is_grad_enabled():
                self._observe(layer, args, kwargs, out)
            return out
        monitored = False
        try:
            from flashwatch.kernels import flash_attention

            # statistics where a backward can come: autograd records and an input needs a gradient
            monitored = self.monitoring and torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
            stats = layer.ensure_stats(q.device) if monitored else None
            if monitored:
                layer.calls += 1
                layer.low_precision = q.dtype in (torch.bfloat16, torch.float16)
                # the kernel's backward reports its rows through stats.rows_hook, once per call,
                # in reverse order of the forwards: each call leaves its hook on a stack
                hook = self._chain_hooks(layer, query, q.shape[-1], scale)
                stack = layer.chain.pending_hooks if layer.chain is not None else None
                if hook is not None:
                    stack.append(hook)
                stats.rows_hook = self._pop_rows_hook(layer) if hook is not None else None
            with torch.autocast(q.device.type, enabled=False) if cast else contextlib.nullcontext():
                out = flash_attention(q, k, v, causal=bool(is_causal), sm_scale=scale, variant=layer.variant,
                                      beta=self.beta, eps=self.eps, stats=stats, attn_mask=attn_mask)
            if monitored:
                out.register_hook(_counted_at_backward(layer.coverage))
            return out
        except Exception as exc:  # never break training: fall back to the model's own attention
            self.on_error("own_kernel", exc)
            if monitored:
                layer.coverage[0] += 1  # an attention call, not measured
            return sdpa(*args, **kwargs)

    def _chain_hooks(self, layer: AttentionLayer, query: Any, head_dim: int, scale: Any):
        """For a monitored call of a layer with a W^Q-error chain: make sure the true gradient's
        push is read (W^Q's gradient hook, once per step; else a hook on this call's query
        gradient) and return the rows hook of the statistics pass; None otherwise. Failures
        are reported and never reach the backward."""
        chain, x, rotation = layer.chain, layer.chain_input, layer.chain_rotation
        if chain is None or x is None or not isinstance(query, torch.Tensor) or not query.requires_grad:
            return None
        if not self._query_is_projection(layer, query, x, rotation):
            return None
        s = float(scale) if scale is not None else head_dim ** -0.5
        on_error = self.on_error

        def on_query_grad(dq):
            try:
                chain.add_query_grad(x, dq, rotation)
            except Exception as exc:
                on_error("wq_error_chain", exc)
            return None

        if not self._watch_query_weight(layer):
            query.register_hook(on_query_grad)
        return _ChainRows(chain, x, s, on_error, rotation)

    def _query_is_projection(self, layer: AttentionLayer, query: Any, x: torch.Tensor, rotation: Any) -> bool:
        """Whether the layer's W^Q-error chain may take this call: False once its query was found not
        to be W^Q x. The comparison runs once per layer, at its first monitored call with a query
        (eager: in the forward; compiled: when the statistics operator runs), on the call's query
        turned back by its rotation; a mismatch makes the layer's W^Q-error readings NaN from then
        on, and the log says why. Only a rank's whole weight, or its heads under tensor parallelism,
        is compared (a shard would need a collective); the decision changes readings only, never a
        collective."""
        if not layer.query_checked and isinstance(query, torch.Tensor):
            self._compare_query(layer, query, x, rotation)
        return not layer.query_mismatch

    def _compare_query(self, layer: AttentionLayer, query: torch.Tensor, x: torch.Tensor, rotation: Any) -> None:
        layer.query_checked = True
        if layer.placement_kind not in ("whole", "tensor_parallel"):
            return
        try:
            residual = query_residual(query.detach(), x, layer.query_weight().detach(), rotation)
        except Exception as exc:
            self.on_error("wq_error_chain", exc)
            return
        if not math.isfinite(residual):  # a non-finite query or weight tells nothing: compared again next time
            layer.query_checked = False
            self._log_once(("query_nan", layer.index),
                           "flashwatch: layer %d (%s): its query or W^Q is not finite at this monitored call; whether "
                           "the query is W^Q x is checked again at the next one", layer.index, layer.name,
                           level=logging.INFO)
            return
        if residual > QUERY_TOLERANCE:
            layer.query_mismatch = True
            self._log_once(("query", layer.index),
                           "flashwatch: layer %d (%s): the query its attention receives is not W^Q x (relative "
                           "residual %.3g > %g: a QK-norm, a query scale or a rotation flashwatch was not given); "
                           "its W^Q-error metrics read NaN, every other statistic is measured", layer.index,
                           layer.name, residual, QUERY_TOLERANCE)

    def _watch_query_weight(self, layer: AttentionLayer) -> bool:
        """W^Q's gradient hook for this monitored step (``LayerChain.watch_weight``); False where
        it cannot apply (the query's gradient is read instead: so also for a sharded weight, whose
        gradient a rank sees in pieces)."""
        family = next((f for f in FAMILIES if f.name == layer.family), None)
        if family is None or layer.placement is not None:
            return False
        try:
            param, transposed = family.query_param(layer.module)
        except Exception:  # a module without the family's parameter: the query's gradient instead
            return False
        # the hook lives on the model's parameter: it holds the router weakly, so that a router
        # dropped without remove() is still freed (and gives torch's SDPA back) at once
        ref = weakref.ref(self)

        def active() -> bool:
            router = ref()
            return router is not None and router.monitoring

        def report(kind: str, exc: BaseException) -> None:
            router = ref()
            if router is not None:
                router.on_error(kind, exc)
        return layer.chain.watch_weight(param, transposed, active, report)

    @staticmethod
    def _pop_rows_hook(layer: AttentionLayer):
        """One rows hook for the layer's statistics: each backward takes the newest pending call's."""
        return _PendingRows(layer.chain.pending_hooks)

    def _measure_scores(self, layer: AttentionLayer, q, k, v, out, causal, scale, attn_mask=None,
                        masked: bool = False, pattern_read=None) -> None:
        """What a call with attention dropout still shows: rows, repeated maxima and the max logit
        (functions of the scores alone; ``masked``: by the dense pass, with ``attn_mask``). Its
        delta error is not measured: the statistics pass runs with a zero output gradient, which
        adds exactly 0 to the delta-error sums, and the call is not counted as measured
        (``coverage``), so the layer's drift reads NaN."""
        try:
            from flashwatch.kernels import attention_statistics, masked as masked_pass

            stats = layer.ensure_stats(q.device)
            stats.rows_hook = None
            dtype = out.dtype
            layer.low_precision = dtype in (torch.bfloat16, torch.float16)
            args = (q.detach().to(dtype), k.detach().to(dtype), v.detach().to(dtype), out.detach(),
                    torch.zeros_like(out, dtype=dtype), stats)
            with torch.autocast(q.device.type, enabled=False):
                if masked:
                    masked_pass.attention_statistics(*args, attn_mask=attn_mask, causal=bool(causal),
                                                     sm_scale=scale if scale is not None else q.shape[-1] ** -0.5,
                                                     eps=self.eps, pattern_read=pattern_read)
                else:
                    attention_statistics(*args, causal=bool(causal), sm_scale=scale, eps=self.eps)
        except Exception as exc:
            self.on_error("observe", exc)

    def _observe(self, layer: AttentionLayer, args: tuple, kwargs: dict, out) -> None:
        try:
            from flashwatch.kernels import attention_statistics, masked

            q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa = _bind(args, kwargs)
            if not isinstance(out, torch.Tensor) or not out.requires_grad:
                return  # no backward will come: nothing to measure
            if isinstance(q, torch.Tensor) and q.dtype != out.dtype:
                # autocast cast the inputs inside SDPA: measure what the kernel computed with
                q, k, v = q.to(out.dtype), k.to(out.dtype), v.to(out.dtype)
            route, reason = statistics_route(q, k, v, attn_mask, dropout_p, is_causal, enable_gqa, layer.num_heads)
            if route != "plain":  # measured in full by the dense pass: information; in part or not at all: a warning
                self._log_once(("observe", layer.index, reason),
                               "flashwatch: layer %d (%s): calls where %s: %s", layer.index, layer.name, reason,
                               MEASURED[route], level=logging.INFO if route == "masked" else logging.WARNING)
            if route in (None, "scores", "masked_scores"):
                # counted (and its scores measured) when its backward comes, as a measured call is: a
                # forward recomputed under activation checkpointing is the same call
                coverage, measure = layer.coverage, self._measure_scores
                saved = (q.detach(), k.detach(), v.detach(), out.detach()) if route is not None else None
                mask = attn_mask if route == "masked_scores" else None
                # a self-attention mask's pattern, read now without waiting, for the backward's choice of pass
                pattern_read = masked.start_read(mask, q.shape[2], k.shape[2], bool(is_causal)) \
                    if mask is not None else None

                def on_grad(grad_out):
                    coverage[0] += 1  # an attention call, not measured in full
                    if saved is not None:
                        measure(layer, *saved, is_causal, scale, mask, route == "masked_scores", pattern_read)
                    return None

                out.register_hook(on_grad)
                return
            stats = layer.ensure_stats(q.device)
            layer.calls += 1
            # counted when its backward comes (below), not here: a forward recomputed under activation
            # checkpointing is the same call, and a forward without backward has nothing to measure
            coverage = layer.coverage
            layer.low_precision = out.dtype in (torch.bfloat16, torch.float16)
            # k, v with fewer heads (grouped-query attention) are passed as they are: the
            # statistics pass maps query head h to kv head h // (H // Hkv), as SDPA's enable_gqa
            saved = (q.detach(), k.detach(), v.detach(), out.detach())
            causal, eps, on_error = bool(is_causal), self.eps, self.on_error
            mask_route = route == "masked"
            pattern_read = masked.start_read(attn_mask, q.shape[2], k.shape[2], bool(is_causal)) if mask_route else None
            rows_hook = self._chain_hooks(layer, args[0] if args else kwargs.get("query"), q.shape[-1], scale)

            def on_grad(grad_out):
                coverage[0] += 1  # one attention call; measured once its statistics pass ran
                try:
                    stats.rows_hook = rows_hook
                    with torch.autocast(grad_out.device.type, enabled=False):
                        if mask_route:
                            masked.attention_statistics(*saved, grad_out.to(saved[3].dtype), stats,
                                                        attn_mask=attn_mask, causal=causal,
                                                        sm_scale=scale if scale is not None else saved[0].shape[-1] ** -0.5,
                                                        eps=eps, pattern_read=pattern_read)
                        else:
                            attention_statistics(*saved, grad_out.to(saved[3].dtype), stats, causal=causal,
                                                 sm_scale=scale, eps=eps)
                    coverage[1] += 1
                except Exception as exc:  # a failing statistics pass never breaks the backward
                    on_error("observe_stats", exc)
                finally:
                    stats.rows_hook = None
                return None

            out.register_hook(on_grad)
        except Exception as exc:
            self.on_error("observe", exc)

    def _compiled_call(self, layer: AttentionLayer, args: tuple, kwargs: dict, x: Any = None, rotation: Any = None):
        """The call as torch.compile traces it: custom operators, no Python hooks, no guard on
        whether the step is monitored (``flag`` is read when the operators run). ``x``: the
        layer's projection input where it has a W^Q-error chain (the operators' rows hook)."""
        from flashwatch.kernels import ops

        sdpa = original_sdpa()
        if not torch.is_grad_enabled():  # statistics are collected only where autograd records
            return sdpa(*args, **kwargs)
        q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa = _bind(args, kwargs)
        stats = layer.ensure_stats(q.device) if isinstance(q, torch.Tensor) else None
        if layer.mode == "own_kernel":
            qc, kc, vc, cast = _autocast_inputs(q, k, v) if stats is not None else (q, k, v, False)
            reason = unsupported_reason(qc, kc, vc, attn_mask, dropout_p, enable_gqa, layer.num_heads, bool(is_causal))
            # at tracing: the compiled call runs what is decided here (a write to outside state, which
            # activation checkpointing accepts only so)
            _allowed_under_checkpoint(_set_sdpa_fallback, layer, reason)
            if reason is None:
                with torch.autocast(q.device.type, enabled=False) if cast else contextlib.nullcontext():
                    return ops.attention(qc, kc, vc, flag=self.flag, stats=stats, coverage=layer.coverage,
                                         causal=bool(is_causal), sm_scale=scale, variant=layer.variant,
                                         beta=self.beta, eps=self.eps, attn_mask=attn_mask,
                                         **self._layer_arguments(layer, x, rotation))
            return self._compiled_observe(layer, sdpa(*args, **kwargs), q, k, v, attn_mask, dropout_p, is_causal,
                                          scale, enable_gqa, x, rotation)
        return self._compiled_observe(layer, sdpa(*args, **kwargs), q, k, v, attn_mask, dropout_p, is_causal, scale,
                                      enable_gqa, x, rotation)

    def _layer_arguments(self, layer: AttentionLayer, x: Any, rotation: Any) -> dict:
        """The operators' arguments naming the layer (its key, ``ops.register_layer``) and the call's
        projection input and query rotation for its rows hook (None where the layer has no W^Q-error
        chain: the enter hook takes X only for such layers; the rotation only for rotary ones)."""
        return {"x": x, "rotation": rotation, "layer": layer.key}

    def _compiled_observe(self, layer, out, q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, x=None,
                          rotation=None):
        """The model's own SDPA output, marked for the statistics (``ops.observe``), or the
        call counted as not measured in full."""
        from flashwatch.kernels import ops

        if not isinstance(out, torch.Tensor) or not out.requires_grad:
            return out  # no backward will come: nothing to measure, nothing counted
        if not isinstance(q, torch.Tensor):
            route, reason = None, "query is not a tensor"
        else:
            # autocast casts the inputs inside SDPA: the statistics take them in the output's dtype
            # (cast when the statistics pass runs, on monitored steps only)
            route, reason = statistics_route(q.to(out.dtype), k.to(out.dtype), v.to(out.dtype), attn_mask,
                                             dropout_p, is_causal, enable_gqa, layer.num_heads)
        if route in ("plain", "masked"):
            return ops.observe(out, q, k, v, flag=self.flag, stats=layer.ensure_stats(q.device),
                               coverage=layer.coverage, causal=bool(is_causal), sm_scale=scale, eps=self.eps,
                               attn_mask=attn_mask if route == "masked" else None, masked=route == "masked",
                               **self._layer_arguments(layer, x, rotation))
        message = f"{reason}: {MEASURED[route]}"
        if route in ("scores", "masked_scores"):  # measured in the backward, as in eager mode
            masked = route == "masked_scores"
            return ops.observe(out, q, k, v, flag=self.flag, stats=layer.ensure_stats(q.device),
                               coverage=layer.coverage, causal=bool(is_causal), sm_scale=scale, eps=self.eps,
                               attn_mask=attn_mask if masked else None, masked=masked, layer=layer.key,
                               scores_only=message)
        ops.unmeasured_call(self.flag, layer.coverage, layer.key, message)
        return out
