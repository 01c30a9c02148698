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
an argument of another type, a changed global the kernel reads, ``FAST_LAUNCH`` off. Setting
the environment variable FLASHWATCH_FAST_LAUNCH=0 (read at import) or
``launch.FAST_LAUNCH = False`` turns the cache off; outputs are the same either way.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import triton
from triton import knobs
from triton.runtime.driver import driver

# Off: every launch goes through kernel[grid](...). Benchmarks flip it to time both paths.
FAST_LAUNCH = os.environ.get("FLASHWATCH_FAST_LAUNCH", "1") != "0"

# The Triton versions whose JITFunction.run this module mirrors (read its source before adding one).
SUPPORTED_TRITON = ("3.6.",)

# How many launches took each path since import (tests read it).
counts = {"cached": 0, "ordinary": 0}

_INT32_MIN, _INT32_MAX, _UINT64_START = -2 ** 31, 2 ** 31 - 1, 2 ** 63

_cache: dict = {}           # key -> (CompiledKernel, trailing argument values in parameter order)
_eligible: dict = {}        # kernel -> whether its parameters allow the fast path
_MAX_ENTRIES = 4096         # a process launching more specialisations than this starts over


class UnsupportedArgument(Exception):
    """An argument whose specialisation this module does not reproduce (the ordinary launch is used)."""


def _other_key(a: Any) -> tuple:
    """Key of an argument that is neither a plain int nor a plain tensor (rare types)."""
    if isinstance(a, bool):
        return ("u1",)
    if isinstance(a, float):
        return ("fp32",)
    if a is None:
        return ("none",)
    if isinstance(a, torch.Tensor):  # a subclass
        return (a.dtype, a.data_ptr() % 16 == 0)
    raise UnsupportedArgument(type(a).__name__)


def specialization_key(args: tuple) -> tuple:
    """What Triton specialises a compilation on, for the non-constexpr arguments ``args``
    (module docstring): per tensor (dtype, 16-byte aligned); per int (== 1, % 16 == 0, in
    i32 range, from 2**63); per float, bool or None a type tag. Two argument tuples with
    equal keys get the same compilation. Raises UnsupportedArgument for other types."""
    return tuple([
        (a == 1, a % 16 == 0, _INT32_MIN <= a <= _INT32_MAX, a >= _UINT64_START) if type(a) is int else
        (a.dtype, a.data_ptr() % 16 == 0) if type(a) is torch.Tensor else
        ("fp32",) if type(a) is float else
        _other_key(a)
        for a in args])


def _triton_supported() -> bool:
    return triton.__version__.startswith(SUPPORTED_TRITON)


def _kernel_eligible(kernel) -> bool:
    """A compiled-mode JITFunction whose parameters Triton specialises by the rules above."""
    ok = _eligible.get(kernel)
    if ok is None:
        from triton.runtime.jit import JITFunction

        try:
            ok = (_triton_supported() and type(kernel) is JITFunction and all(
                not p.do_not_specialize and not p.do_not_specialize_on_alignment and not p.is_const
                and not p.annotation_type for p in kernel.params if not p.is_constexpr))
        except AttributeError:  # a Triton without these attributes: not the version mirrored here
            ok = False
        _eligible[kernel] = ok
    return ok


def _hooks_idle(runtime) -> bool:
    """No launch hook attached: Triton 3.6 would call two empty hook chains, i.e. nothing."""
    from triton.knobs import HookChain

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
    if not (FAST_LAUNCH and _kernel_eligible(kernel)):
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
    key = (kernel, device, spec, tuple(kwargs.items()), tuple(map(type, kwargs.values())), runtime.debug,
           kernel.debug, knobs.compilation.instrumentation_mode)
    entry = _cache.get(key)
    if entry is None or not _globals_unchanged(kernel):
        compiled = _ordinary(kernel, grid, args, kwargs)
        _remember(key, kernel, compiled, args, kwargs)
        return
    compiled, trailing = entry
    counts["cached"] += 1
    # JITFunction.run with no hooks: launch_metadata is None and the hook arguments are None
    compiled.run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1,
                 active.get_current_stream(device), compiled.function, compiled.packed_metadata, None, None, None,
                 *args, *trailing)


def _remember(key, kernel, compiled, args, kwargs) -> None:
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
    if len(_cache) >= _MAX_ENTRIES:
        _cache.clear()
    _cache[key] = (compiled, tuple(trailing))


def clear_cache() -> None:
    """Forget every kept compilation (the next launch of each goes through the ordinary path)."""
    _cache.clear()
    _eligible.clear()
