"""Host time of launching flashwatch's Triton kernels: the ordinary ``kernel[grid](...)`` against
the cached launch of ``flashwatch.kernels.launch`` (FLASHWATCH_FAST_LAUNCH=0 / 1).

Part 1 (any machine, no GPU needed): the Python work of one launch of each of the four kernels,
with the argument tuples the launchers build (a (1, 1, 64, 64) BF16 call), both paths ending
in a launcher that does nothing: Triton 3.6's ``JITFunction.run`` (argument binding and
specialisation, cache key, launch metadata) against ``launch.launch`` (specialisation key, one
dictionary lookup). The driver's device and stream queries are stand-ins here.

Part 1b (any machine): a whole forward+backward call on CPU tensors through the Triton path,
every launch ending in a stand-in compiled kernel that does nothing: the host work of a call
(checks, autograd, allocations, launches) without CUDA, with the cache off and on.

Part 2 (CUDA): host microseconds per call at (1, 1, 64, 64) BF16, where the GPU work is a few
microseconds, for a forward, a forward+backward and a forward+backward with statistics, with
the cache off and on, alternated over several rounds (medians).

    PYTHONPATH=$PWD python3 benchmarks/launch_overhead.py [--rounds 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import timeit

import torch


# --- part 1: the Python work of one launch ---------------------------------------------------------

class _FakeDriver:
    class active:
        @staticmethod
        def get_current_device():
            return 0

        @staticmethod
        def get_current_stream(device):
            return 0

        @staticmethod
        def get_current_target():
            from triton.backends.compiler import GPUTarget

            return GPUTarget("cuda", 90, 32)


def _recorded_launches():
    """(name, kernel, grid, args, kwargs) of the four launches, as the launchers build them."""
    from flashwatch.kernels import AttentionStats, triton_attn

    calls = []
    real = triton_attn.launch
    triton_attn.launch = lambda kernel, grid, args, kwargs: calls.append((kernel, grid, args, kwargs))
    try:
        q, k, v, do = (torch.randn(1, 1, 64, 64, dtype=torch.bfloat16) for _ in range(4))
        stats = AttentionStats(1)
        o, lse, r, rowmax = triton_attn._forward(q, k, v, True, 0.125, "plain", 2.0, 1e-3, stats, 0.0)
        triton_attn._backward(do, q, k, v, o, lse, r, rowmax, True, 0.125, 1e-3, stats)
        triton_attn.attention_statistics(q, k, v, o, do, stats)
    finally:
        triton_attn.launch = real
    names = ("forward", "dQ", "dK/dV", "statistics")
    return [(n, *c) for n, c in zip(names, calls)]


def _stand_in_compiled():
    from triton.compiler import CompiledKernel

    c = CompiledKernel.__new__(CompiledKernel)
    c.function, c.packed_metadata, c.module, c.src, c.name = 1, None, object(), None, "stand_in"
    c._run = lambda *args: None
    return c


def python_launch_us(number: int = 3000) -> dict:
    import triton.runtime.jit as jit
    from triton import knobs
    from triton.runtime.jit import JITFunction

    from flashwatch.kernels import launch

    results = {}
    saved = jit.driver, launch.driver, launch.FAST_LAUNCH
    jit.driver = launch.driver = _FakeDriver
    launch.FAST_LAUNCH = True  # the cached side is what this times, whatever FLASHWATCH_FAST_LAUNCH says
    try:
        for name, kernel, grid, args, kwargs in _recorded_launches():
            kernel = JITFunction(kernel.fn)  # a fresh compiled-mode kernel (no GPU compilation happens)
            compiled = _stand_in_compiled()
            # Triton's own cache, filled as its run() would after compiling
            kernel_cache, key_cache, _, _, binder = kernel.device_caches[0]
            opts = dict(kwargs, debug=bool(kernel.debug or knobs.runtime.debug),
                        instrumentation_mode=knobs.compilation.instrumentation_mode)  # as JITFunction.run
            _, spec, options = binder(*args, **opts)
            kernel_cache[jit.compute_cache_key(key_cache, spec, options)] = compiled
            ordinary = lambda: kernel[grid](*args, **kwargs)  # noqa: E731
            # ours, filled by its first (ordinary) launch
            launch.clear_cache()
            launch.launch(kernel, grid, args, kwargs)
            if len(kernel_cache) != 1:
                raise RuntimeError("Triton's cache key differs from the one built here: nothing to compare")
            cached = lambda: launch.launch(kernel, grid, args, kwargs)  # noqa: E731
            before = launch.counts["cached"]
            t_ord = min(timeit.repeat(ordinary, number=number, repeat=5)) / number * 1e6
            t_fast = min(timeit.repeat(cached, number=number, repeat=5)) / number * 1e6
            assert launch.counts["cached"] == before + 5 * number, "the cached path was not taken"
            results[name] = {"arguments": len(args) + len(kwargs), "ordinary_us": t_ord, "cached_us": t_fast}
    finally:
        jit.driver, launch.driver, launch.FAST_LAUNCH = saved
        launch.clear_cache()
    return results


@contextlib.contextmanager
def stand_in_kernels():
    """While the block runs, CPU tensors take the Triton path of ``flashwatch.kernels`` and every
    launch ends in a stand-in compiled kernel that does nothing: fresh compiled-mode copies of
    the four kernels (Triton's compile step replaced by handing out the stand-in), the driver's
    device and stream queries stubbed, TRITON_INTERPRET=1 (so ``uses_triton`` holds for CPU
    tensors; the copies are not interpreted). What is left is the host work of a call: checks,
    autograd, allocations, both launch paths. Everything is restored after the block."""
    import os

    import triton.runtime.jit as jit
    from triton.runtime.jit import JITFunction

    from flashwatch.kernels import launch, triton_attn

    names = ("_attn_fwd_kernel", "_attn_bwd_dq_kernel", "_attn_bwd_dkdv_kernel", "_attn_stats_kernel")
    saved = ({n: getattr(triton_attn, n) for n in names}, jit.driver, launch.driver, os.environ.get("TRITON_INTERPRET"),
             launch.FAST_LAUNCH)

    def copy(kernel):
        fresh = JITFunction(kernel.fn)

        def do_compile(key, signature, device, constexprs, options, attrs, warmup):
            fresh.device_caches[device][0][key] = compiled = _stand_in_compiled()
            return compiled

        fresh._do_compile = do_compile
        return fresh

    try:
        for n in names:
            setattr(triton_attn, n, copy(saved[0][n]))
        jit.driver = launch.driver = _FakeDriver
        os.environ["TRITON_INTERPRET"] = "1"  # CPU tensors take the Triton path (the kernels above are not interpreted)
        launch.clear_cache()  # no plan made with the real kernels replays here
        yield
    finally:
        launch.clear_cache()  # nor one made with the stand-ins after
        for n, kernel in saved[0].items():
            setattr(triton_attn, n, kernel)
        jit.driver, launch.driver = saved[1], saved[2]
        if saved[3] is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = saved[3]
        launch.FAST_LAUNCH = saved[4]
        launch.clear_cache()


def whole_call_us(rounds: int = 5, calls: int = 300) -> dict:
    """Host microseconds of a whole forward+backward call of (1, 1, 64, 64) BF16 CPU tensors
    through the Triton path, every launch ending in a stand-in (``stand_in_kernels``): argument
    checks, autograd, allocations and both launch paths, without CUDA. Ordinary and cached
    launches alternated over ``rounds`` rounds (medians)."""
    from flashwatch.kernels import AttentionStats, flash_attention, launch

    with stand_in_kernels():
        q, k, v = (torch.randn(1, 1, 64, 64, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        g = torch.randn_like(q)
        stats = AttentionStats(1)
        cases = {"forward+backward": lambda: torch.autograd.grad(flash_attention(q, k, v), (q, k, v), g),
                 "forward+backward, stats": lambda: torch.autograd.grad(flash_attention(q, k, v, stats=stats),
                                                                        (q, k, v), g)}
        samples = {(c, p): [] for c in cases for p in ("ordinary", "cached")}
        for _ in range(rounds):
            for path in ("ordinary", "cached"):
                launch.FAST_LAUNCH = path == "cached"
                for case, fn in cases.items():
                    fn()
                    samples[(case, path)].append(min(timeit.repeat(fn, number=calls, repeat=3)) / calls * 1e6)
    return {case: {path: statistics.median(samples[(case, path)]) for path in ("ordinary", "cached")}
            for case in cases}


# --- part 2: host time per call on CUDA --------------------------------------------------------------

def cuda_per_call_us(rounds: int, calls: int = 300) -> dict:
    from host_profile import per_call_us  # benchmarks/ (this script's folder) is on sys.path

    from flashwatch.kernels import AttentionStats, flash_attention, launch

    q, k, v = (torch.randn(1, 1, 64, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    g = torch.randn_like(q)
    stats = AttentionStats(1, "cuda")

    def fwd():
        with torch.no_grad():
            flash_attention(q, k, v, causal=True)

    def fb():
        torch.autograd.grad(flash_attention(q, k, v, causal=True), (q, k, v), g)

    def fb_stats():
        torch.autograd.grad(flash_attention(q, k, v, causal=True, stats=stats), (q, k, v), g)

    cases = {"forward": fwd, "forward+backward": fb, "forward+backward, stats": fb_stats}
    samples = {(c, p): [] for c in cases for p in ("ordinary", "cached")}
    was = launch.FAST_LAUNCH
    for _ in range(rounds):
        for path in ("ordinary", "cached"):
            launch.FAST_LAUNCH = path == "cached"
            for case, fn in cases.items():
                samples[(case, path)].append(per_call_us(fn, calls))
    launch.FAST_LAUNCH = was
    return {case: {path: statistics.median(samples[(case, path)]) for path in ("ordinary", "cached")}
            for case in cases}


def _print_pairs(rows: dict) -> None:
    """One line per case: the ordinary and the cached path's microseconds, and the difference."""
    for case, r in rows.items():
        print(f"  {case:24s} ordinary {r['ordinary']:7.1f}   cached {r['cached']:7.1f}   "
              f"saved {r['ordinary'] - r['cached']:6.1f}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=5, help="alternated rounds of the CUDA timing (default 5)")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    import triton

    report = {"triton": triton.__version__, "torch": torch.__version__}
    report["python_launch_us"] = python_launch_us()
    print(f"Python work of one launch, microseconds (no-op launcher; triton {triton.__version__}):")
    for name, r in report["python_launch_us"].items():
        print(f"  {name:11s} {r['arguments']:3d} arguments   ordinary {r['ordinary_us']:6.1f}   "
              f"cached {r['cached_us']:6.1f}   saved {r['ordinary_us'] - r['cached_us']:6.1f}")
    report["whole_call_us"] = whole_call_us(args.rounds)
    print(f"Python work of a whole call, (1,1,64,64) BF16 CPU tensors, launches ending in stand-ins, microseconds "
          f"(median of {args.rounds} alternated rounds):")
    _print_pairs(report["whole_call_us"])
    if torch.cuda.is_available():
        report["cuda_host_us_per_call"] = cuda_per_call_us(args.rounds)
        print(f"host time per call at (1,1,64,64) BF16 on {torch.cuda.get_device_name()}, microseconds "
              f"(median of {args.rounds} alternated rounds):")
        _print_pairs(report["cuda_host_us_per_call"])
    else:
        print("no CUDA device: the per-call host time (part 2) needs one")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
