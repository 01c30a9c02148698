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

The cache is on by default; the environment variable FLASHWATCH_FAST_LAUNCH=0 (read at import)
or ``launch.FAST_LAUNCH = False`` turns it off, 1 or unset leaves it on. Outputs are the same
either way (tests/test_launch_cache.py: bit-identical against the ordinary launch).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
from triton import knobs
from triton.knobs import HookChain
from triton.runtime.driver import driver

from .checks import switch_on_by_default

__all__ = ["launch", "specialization_key", "clear_cache", "FAST_LAUNCH", "UnsupportedArgument", "counts"]

# On: cached launches where eligible; off: every launch through kernel[grid](...) (benchmarks
# flip it to time both paths).
FAST_LAUNCH = switch_on_by_default("FLASHWATCH_FAST_LAUNCH", "the cached launch", "every launch through Triton's own")

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
    (key -> (CompiledKernel, the values of the parameters after the positional arguments)).
    Held on the kernel object itself: no hashing of the kernel per launch (a JITFunction
    hashes its source digest under a lock), and a reloaded kernel starts empty."""

    def __init__(self, eligible: bool):
        self.eligible = eligible
        self.cache: dict = {}


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


def launch(kernel, grid: tuple, args: tuple, kwargs: dict) -> None:
    """``kernel[grid](*args, **kwargs)``: ``args`` the non-constexpr arguments, in parameter
    order; ``kwargs`` the constexprs and launch options (num_warps, num_stages, maxnreg)."""
    state = getattr(kernel, _STATE, None) or _state(kernel)
    if not (FAST_LAUNCH and state.eligible):
        _ordinary(kernel, grid, args, kwargs)
        return
    runtime = knobs.runtime
    if kernel.pre_run_hooks or not _hooks_idle(runtime):
        _ordinary(kernel, grid, args, kwargs)
        return
    try:
        spec = specialization_key(args)
    except UnsupportedArgument:
        _ordinary(kernel, grid, args, kwargs)
        return
    active = driver.active
    device = active.get_current_device()
    key = (device, spec, tuple(kwargs.items()), tuple(map(type, kwargs.values())), runtime.debug,
           kernel.debug, knobs.compilation.instrumentation_mode)
    entry = state.cache.get(key)
    if entry is None or (kernel.used_global_vals and not _globals_unchanged(kernel)):
        compiled = _ordinary(kernel, grid, args, kwargs)
        _remember(state, key, kernel, compiled, args, kwargs)
        return
    compiled, trailing = entry
    counts["cached"] += 1
    # JITFunction.run with no hooks: launch_metadata is None and the hook arguments are None
    compiled.run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1,
                 active.get_current_stream(device), compiled.function, compiled.packed_metadata, None, None, None,
                 *args, *trailing)


def _remember(state, key, kernel, compiled, args, kwargs) -> None:
    """Keep the CompiledKernel the ordinary launch returned (a finished compilation only), with
    the values of the parameters after ``args`` (constexprs, defaults) in parameter order."""
    from triton.compiler import CompiledKernel

    if type(compiled) is not CompiledKernel or compiled.function is None:
        return
    trailing = []
    for p in kernel.params[len(args):]:
        if p.name in kwargs:
            trailing.append(kwargs[p.name])
        elif p.has_default:
            trailing.append(p.default)
        else:
            return
    if len(state.cache) >= _MAX_ENTRIES:
        state.cache.clear()
    state.cache[key] = (compiled, tuple(trailing))


def clear_cache() -> None:
    """Forget every kept compilation (the next launch of each goes through the ordinary path)."""
    for state in _states:
        state.cache.clear()
