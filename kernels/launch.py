"""Launching the jitted kernels of ``triton_kernels`` with less host work per call.

``launch(kernel, grid, args, kwargs)`` does what ``kernel[grid](*args, **kwargs)`` does. On
CUDA, with the Triton version whose launch path this module mirrors (3.6), it keeps the
``CompiledKernel`` that the ordinary launch returned for each specialisation of the arguments
and launches it directly on later calls with the same specialisation. That skips, per launch,
Triton's binding of every argument (one specialisation call each), its string cache key of the
options, the launch-metadata dictionary and two calls of empty launch-hook chains.

What Triton 3.6 compiles a kernel for, besides the keyword arguments (constexprs and options
such as num_warps) and the device, is per non-constexpr argument (``specialization_key``):

- a tensor: its dtype, and whether ``data_ptr() % 16 == 0`` (16-byte alignment);
- an int: whether it equals 1 (then it becomes a constant of the compilation), whether it is a
  multiple of 16, and its integer type (i32 in [-2**31, 2**31), u64 from 2**63, i64 otherwise);
- a float: nothing (fp32); a bool: nothing (u1); None: a constant.

The cache key holds all of these, the keyword arguments with their types, the current device,
``knobs.runtime.debug``, the kernel's own ``debug`` and the instrumentation mode, so a cached
launch never runs a compilation made for another specialisation. A new key goes through the
ordinary launch, which compiles (or finds) the kernel, launches it, and hands it over.

The ordinary launch is used whenever the fast one cannot be shown to be equivalent: the
Triton interpreter (CPU tensors, TRITON_INTERPRET=1), another Triton version, a kernel with
annotated or unspecialised parameters or pre-run hooks, launch hooks attached (a profiler),
an argument of another type, a changed global the kernel reads, ``FAST_LAUNCH`` off.

A kept compilation whose CUDA launcher needs no scratch memory is launched through the launcher's
C function directly (what the launcher's ``__call__`` does when it has no scratch to allocate), and
the current device is read from torch's C binding where Triton's driver reads it through
``torch.cuda.current_device``: a few Python calls fewer per launch.

Plans go one step further, for a whole call of several launches: a caller records the launches
of one call (``recording``), makes a ``Plan`` of them (``make_plan``: per launch, the kept
compilation, the grid, which of the call's tensors went where, the other arguments) and keeps it
under a key of its own (``keep_plan``) that fixes everything the launches depend on but the
tensors' storage. A later call with an equal key runs the plan with its own tensors: the kept
compilations launched with the arguments the caller would have built, without building them,
choosing configurations or computing specialisation keys again. ``Plan.run`` declines, launching
nothing, where the launch path is not the one the plan was made on (the switch below off, a hook
attached, Triton's debug or instrumentation setting changed, another current device); the caller
then launches as usual. (``triton_attn`` plans its calls without statistics.)

The cache is on by default; the environment variable FLASHWATCH_FAST_LAUNCH=0 (read at import)
or ``launch.FAST_LAUNCH = False`` turns it off (plans with it), 1 or unset leaves it on. Outputs
are the same either way (tests/test_launch_cache.py: bit-identical against the ordinary launch;
tests/test_launch_plans.py: a replayed call's launches are the ones its launchers build).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator

import torch
import triton
from triton import knobs
from triton.knobs import HookChain
from triton.runtime.driver import driver

from .checks import switch

__all__ = ["launch", "on_device", "specialization_key", "clear_cache", "FAST_LAUNCH", "UnsupportedArgument", "counts",
           "Plan", "recording", "make_plan", "plan", "keep_plan", "plans_possible"]

# On: cached launches where eligible; off: every launch through kernel[grid](...) (benchmarks
# flip it to time both paths).
FAST_LAUNCH = switch("FLASHWATCH_FAST_LAUNCH")

# The Triton versions whose JITFunction.run this module mirrors (read its source before adding one).
SUPPORTED_TRITON = ("3.6.",)

# How many launches took each path since import (tests read it).
counts = {"cached": 0, "ordinary": 0}

_INT32_MIN, _INT32_MAX, _UINT64_START = -2 ** 31, 2 ** 31 - 1, 2 ** 63

_STATE = "_flashwatch_launch_state"  # the attribute of a kernel object holding its _KernelState
_MAX_ENTRIES = 4096  # a kernel launched with more specialisations than this starts its cache over
_states: list = []   # every _KernelState made (clear_cache empties them)


class _KernelState:
    """Per kernel object: whether the fast path applies to it, and its kept compilations
    (key -> ``_Kept``).
    Held on the kernel object itself: no hashing of the kernel per launch (a JITFunction
    hashes its source digest under a lock), and a reloaded kernel starts empty."""

    def __init__(self, eligible: bool):
        self.eligible = eligible
        self.cache: dict = {}


class _Kept:
    """One kept compilation: the CompiledKernel, the values of the parameters after the positional
    arguments (``trailing``), and, where the direct call applies (``_direct_launch``), the launcher's C
    function with its cooperative-grid and PDL flags (else ``direct`` is None)."""

    __slots__ = ("compiled", "function", "metadata", "trailing", "direct")

    def __init__(self, compiled, trailing: tuple):
        self.compiled, self.trailing = compiled, trailing
        self.function, self.metadata = compiled.function, compiled.packed_metadata
        self.direct = _direct_launch(compiled.run)


def _direct_launch(launcher):
    """(C launch function, cooperative grid, PDL) of a Triton 3.6 CUDA launcher that has no scratch
    memory to allocate, whose ``__call__`` then only forwards to that function with two None scratch
    pointers; None for any other launcher (it is called as it is)."""
    if type(launcher).__name__ != "CudaLauncher":
        return None
    try:
        if launcher.global_scratch_size or launcher.profile_scratch_size:
            return None
        return launcher.launch, launcher.launch_cooperative_grid, launcher.launch_pdl
    except AttributeError:  # not the launcher this mirrors
        return None


def _current_device(active) -> int:
    """The current device as Triton's driver ``active`` gives it; its ``torch.cuda.current_device``
    (a Python function checking initialisation each call) read through torch's C binding instead."""
    get = active.get_current_device
    return torch._C._cuda_getDevice() if get is torch.cuda.current_device else get()


class UnsupportedArgument(Exception):
    """An argument whose specialisation this module does not reproduce (the ordinary launch is used)."""


def _other_key(a: Any):
    """Key of an argument that is neither a plain int, tensor nor float (rare types)."""
    if isinstance(a, bool):
        return ("u1",)
    if isinstance(a, float):
        return "fp32"
    if a is None:
        return ("none",)
    if isinstance(a, torch.Tensor):  # a subclass
        return a.dtype if a.data_ptr() % 16 == 0 else (a.dtype,)
    raise UnsupportedArgument(type(a).__name__)


def specialization_key(args: tuple, _tensor=torch.Tensor, _int=int, _float=float) -> tuple:
    """What Triton specialises a compilation on, for the non-constexpr arguments ``args``
    (module docstring), one entry per argument:

    - an int: True if it equals 1; else 2 + (multiple of 16) in i32 range, 4 + (...) in i64
      range, 6 + (...) from 2**63 (u64);
    - a tensor: its dtype if ``data_ptr() % 16 == 0``, else the 1-tuple (dtype,);
    - a float: "fp32"; a bool: ("u1",); None: ("none",).

    Two argument tuples with equal keys get the same compilation, and the other way round.
    Raises UnsupportedArgument for other types. (Small values rather than tuples of flags:
    this runs at every launch.)"""
    return tuple([
        (a == 1 or (a & 15 == 0) + (2 if _INT32_MIN <= a <= _INT32_MAX else 4 if a < _UINT64_START else 6))
        if type(a) is _int else
        (a.dtype if a.data_ptr() & 15 == 0 else (a.dtype,)) if type(a) is _tensor else
        "fp32" if type(a) is _float else
        _other_key(a)
        for a in args])


def _triton_supported() -> bool:
    return triton.__version__.startswith(SUPPORTED_TRITON)


def _eligible(kernel) -> bool:
    """A compiled-mode JITFunction whose parameters Triton specialises by the rules above."""
    from triton.runtime.jit import JITFunction

    try:
        return _triton_supported() and type(kernel) is JITFunction and all(
            not p.do_not_specialize and not p.do_not_specialize_on_alignment and not p.is_const
            and not p.annotation_type for p in kernel.params if not p.is_constexpr)
    except AttributeError:  # a Triton without these attributes: not the version mirrored here
        return False


def _state(kernel) -> _KernelState:
    state = getattr(kernel, _STATE, None)
    if state is None:
        state = _KernelState(_eligible(kernel))
        try:
            setattr(kernel, _STATE, state)
        except AttributeError:  # an object without attributes of its own: ordinary launches only
            return _KernelState(False)
        _states.append(state)
    return state


def _kernel_eligible(kernel) -> bool:
    """Whether launches of ``kernel`` may take the cached path (checked once per kernel object)."""
    return _state(kernel).eligible


def _hooks_idle(runtime) -> bool:
    """No launch hook attached: Triton 3.6 would call two empty hook chains, i.e. nothing."""
    enter, exit_ = runtime.launch_enter_hook, runtime.launch_exit_hook
    return (enter is None or (type(enter) is HookChain and not enter.calls)) and \
        (exit_ is None or (type(exit_) is HookChain and not exit_.calls))


def _globals_unchanged(kernel) -> bool:
    """The globals the compiled kernel read still hold their values (else the ordinary launch
    raises Triton's error about it)."""
    missing = object()
    for (name, _), (value, globals_dict) in kernel.used_global_vals.items():
        if globals_dict.get(name, missing) != value:
            return False
    return True


def _ordinary(kernel, grid, args, kwargs):
    counts["ordinary"] += 1
    return kernel[grid](*args, **kwargs)


_NOTHING_TO_DO = contextlib.nullcontext()  # reusable: it holds no state


def on_device(t: torch.Tensor):
    """A context in which ``t``'s CUDA device is the current one (Triton launches on the current
    device): ``torch.cuda.device`` where another one is current, else nothing to do (CPU tensors too).
    It runs on every attention call, so it makes nothing where there is nothing to do."""
    if t.is_cuda:
        index = t.get_device()
        if index != torch._C._cuda_getDevice():
            return torch.cuda.device(index)
    return _NOTHING_TO_DO


def launch(kernel, grid: tuple, args: tuple, kwargs: dict) -> None:
    """``kernel[grid](*args, **kwargs)``: ``args`` the non-constexpr arguments, in parameter
    order; ``kwargs`` the constexprs and launch options (num_warps, num_stages, maxnreg)."""
    kept = _launch(kernel, grid, args, kwargs)
    records = _recording.records
    if records is not None:
        records.append((kernel, grid, args, kept))


def _launch(kernel, grid: tuple, args: tuple, kwargs: dict):
    """``launch``; returns the kept compilation the launch ran or made (None: not kept)."""
    state = getattr(kernel, _STATE, None) or _state(kernel)
    if not (FAST_LAUNCH and state.eligible):
        _ordinary(kernel, grid, args, kwargs)
        return None
    runtime = knobs.runtime
    if kernel.pre_run_hooks or not _hooks_idle(runtime):
        _ordinary(kernel, grid, args, kwargs)
        return None
    try:
        spec = specialization_key(args)
    except UnsupportedArgument:
        _ordinary(kernel, grid, args, kwargs)
        return None
    active = driver.active
    device = _current_device(active)
    key = (device, spec, tuple(kwargs.items()), tuple(map(type, kwargs.values())), runtime.debug,
           kernel.debug, knobs.compilation.instrumentation_mode)
    kept = state.cache.get(key)
    if kept is None or (kernel.used_global_vals and not _globals_unchanged(kernel)):
        compiled = _ordinary(kernel, grid, args, kwargs)
        return _remember(state, key, kernel, compiled, args, kwargs)
    counts["cached"] += 1
    _run_kept(kept, grid, active.get_current_stream(device), args)
    return kept


def _run_kept(kept: _Kept, grid: tuple, stream, args: tuple) -> None:
    """Launch a kept compilation: JITFunction.run with no hooks (launch metadata and the hook arguments None)."""
    grid_x, grid_y, grid_z = grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1
    if kept.direct is not None:  # the launcher's __call__ without scratch: its C function, scratch pointers None
        c_launch, cooperative, pdl = kept.direct
        c_launch(grid_x, grid_y, grid_z, stream, kept.function, cooperative, pdl, None, None, kept.metadata, None, None,
                 None, *args, *kept.trailing)
    else:
        kept.compiled.run(grid_x, grid_y, grid_z, stream, kept.function, kept.metadata, None, None, None, *args,
                          *kept.trailing)


def _remember(state, key, kernel, compiled, args, kwargs):
    """Keep the CompiledKernel the ordinary launch returned (a finished compilation only), with
    the values of the parameters after ``args`` (constexprs, defaults) in parameter order; returns
    the kept entry (None: not kept)."""
    from triton.compiler import CompiledKernel

    if type(compiled) is not CompiledKernel or compiled.function is None:
        return None
    trailing = []
    for p in kernel.params[len(args):]:
        if p.name in kwargs:
            trailing.append(kwargs[p.name])
        elif p.has_default:
            trailing.append(p.default)
        else:
            return None
    if len(state.cache) >= _MAX_ENTRIES:
        state.cache.clear()
    kept = state.cache[key] = _Kept(compiled, tuple(trailing))
    return kept


def clear_cache() -> None:
    """Forget every kept compilation and every plan (the next launch of each goes through the ordinary path)."""
    for state in _states:
        state.cache.clear()
    _plans.clear()


# --- plans: the launches of a whole call, replayed ---------------------------------------------------

class _Recording(threading.local):
    records = None  # while recording: [(kernel, grid, args, kept or None)] of this thread's launches


_recording = _Recording()
_plans: dict = {}  # the callers' keys -> Plan


@contextlib.contextmanager
def recording() -> Iterator[list]:
    """Collect this thread's launches inside the block: (kernel, grid, args, kept compilation or None)."""
    previous, _recording.records = _recording.records, []
    try:
        yield _recording.records
    finally:
        _recording.records = previous


def _launch_state() -> tuple:
    """What a kept compilation was made for besides its arguments: Triton's debug knob and
    instrumentation mode (``launch``'s key)."""
    return knobs.runtime.debug, knobs.compilation.instrumentation_mode


class Plan:
    """The launches one call made, replayable with the next call's tensors: per launch, the kept
    compilation, its grid, which of the call's tensors it took where, and its other arguments.

    A caller keeps a plan under a key that fixes everything its launches depend on but the
    tensors' storage (shapes, strides, dtypes, the inputs' 16-byte alignment, scalar arguments,
    the tuning in force); ``run`` then launches what the caller's own code would have launched,
    without building the arguments, the configuration or the specialisation key again. The
    tensors it allocates itself come from torch's allocators, whose blocks are aligned to at
    least 64 bytes, so their alignment is what it was when the plan was made."""

    __slots__ = ("steps", "device", "state")

    def __init__(self, steps: tuple, device: int, state: tuple):
        self.steps, self.device, self.state = steps, device, state

    def run(self, tensors: tuple) -> bool:
        """Launch with ``tensors`` (in the order the plan was made with); False, launching nothing,
        where the launch path is no longer the one the plan was made on (cached launch off, a
        launch hook attached, another debug or instrumentation setting, another current device)."""
        runtime = knobs.runtime
        if not FAST_LAUNCH or not _hooks_idle(runtime) or _launch_state() != self.state:
            return False
        active = driver.active
        device = _current_device(active)
        if device != self.device:
            return False
        stream = active.get_current_stream(device)
        get = tensors.__getitem__
        for kept, grid, slots, scalars in self.steps:
            _run_kept(kept, grid, stream, tuple(map(get, slots)) + scalars)
        counts["cached"] += len(self.steps)
        return True


def make_plan(records: list, tensors: tuple) -> Plan | None:
    """The plan of a call that made the launches ``records`` (``recording``) with ``tensors``, or
    None where one cannot stand for the call: a launch not kept (an ordinary launch), a kernel
    with pre-run hooks or globals it reads, an argument tensor that is not one of ``tensors``
    (or ``tensors`` holding one object twice: its slot would be ambiguous), a tensor after the
    first non-tensor argument."""
    if not records or len({id(t) for t in tensors}) != len(tensors):
        return None
    slot_of = {id(t): i for i, t in enumerate(tensors)}
    steps = []
    for kernel, grid, args, kept in records:
        if kept is None or kernel.pre_run_hooks or kernel.used_global_vals:
            return None
        count = next((i for i, a in enumerate(args) if not isinstance(a, torch.Tensor)), len(args))
        if any(isinstance(a, torch.Tensor) for a in args[count:]) or any(id(a) not in slot_of for a in args[:count]):
            return None
        steps.append((kept, tuple(grid), tuple(slot_of[id(a)] for a in args[:count]), tuple(args[count:])))
    return Plan(tuple(steps), _current_device(driver.active), _launch_state())


def plans_possible(kernel) -> bool:
    """Whether a call launching ``kernel`` can be planned now: the cached launch on and the kernel
    eligible for it (not where every launch is an ordinary one, the Triton interpreter's for one)."""
    return FAST_LAUNCH and _kernel_eligible(kernel)


def plan(key):
    """The plan kept under ``key`` (None: none)."""
    return _plans.get(key)


def keep_plan(key, made: Plan) -> None:
    """Keep ``made`` under ``key`` (``make_plan``; ``clear_cache`` forgets every plan)."""
    if len(_plans) >= _MAX_ENTRIES:
        _plans.clear()
    _plans[key] = made
