"""Host time of flashwatch's own-kernel attention call, eager and under torch.compile (no GPU needed).

CPU tensors of one GPT-2-small layer (default (16, 12, 1024, 64) BF16) go through the Triton
path of ``flashwatch.kernels`` with every launch ending in a stand-in compiled kernel that does
nothing (``launch_overhead.stand_in_kernels``), so what is timed is the Python and dispatcher
work of a call: argument handling, custom-operator dispatch, autograd, allocations, launch
preparation and Triton's launch path. A stack of ``--layers`` calls (each layer's output is the
next layer's query; every layer has its own k, v, so no gradient is accumulated) runs forward
and backward; per call = the whole stack's time / layers. Cases:

- ``eager flash_attention``: the autograd Function the eager Router calls (``stats`` None /
  an ``AttentionStats``: unmonitored / monitored);
- ``eager ops.attention``: the custom operators the compiled Router calls, run eagerly;
- ``compiled ops.attention``: the same stack under ``torch.compile`` (inductor, on the CPU;
  the operators stay opaque), one graph whose flag tensor says monitored or not.

Each case with Triton's ordinary launch and with the cached one (``launch.FAST_LAUNCH``),
alternated over rounds; reported: the best round (other work on the machine only adds time;
medians in the JSON). Then a cProfile of each case (cached launch off), its self time grouped
into phases and scaled to the unprofiled per-call time (the profiler slows Python calls more
than C calls: a phase split, not exact microseconds).

    PYTHONPATH=$PWD python3 benchmarks/own_kernel_host.py [--rounds 3] [--json out.json]
    PYTHONPATH=$PWD python3 benchmarks/own_kernel_host.py --device cuda   # real launches

Allocations on the CPU are ``malloc``s of the layer's size (not the CUDA caching allocator's).
With ``--device cuda`` the launches are real, at (1, 12, 128, 64) by default, where the GPU
work is small enough that the host's time is what is timed (synchronised per timing).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from launch_overhead import stand_in_kernels  # noqa: E402  (benchmarks/ is this script's folder)

PHASES = (
    # (phase, predicate on (file, function name)); the first that matches takes the entry
    ("Triton launch (JITFunction.run, launch cache)",
     lambda f, n: "/triton/" in f or "libtriton" in n or f.endswith(os.path.join("kernels", "launch.py"))),
    ("flashwatch launchers (triton_attn, tuning, rows, hopper_attn)",
     lambda f, n: any(f.endswith(os.path.join("kernels", m)) for m in
                      ("triton_attn.py", "tuning.py", "rows.py", "hopper_attn.py", "checks.py", "__init__.py",
                       "reference.py"))),
    ("flashwatch operators (ops, faults, stats)",
     lambda f, n: any(f.endswith(os.path.join("kernels", m)) for m in ("ops.py", "faults.py", "stats.py"))),
    ("custom-op machinery (torch._library, torch._ops)",
     lambda f, n: "/torch/_library/" in f or f.endswith("/torch/_ops.py")),
    ("tensor allocation (empty, new_empty, empty_like, zeros, fill_)",
     lambda f, n: f == "~" and any(a in n for a in ("empty", "zeros", "fill_", "full"))),
    ("autograd (Function, engine)",
     lambda f, n: "/torch/autograd/" in f or "run_backward" in n or "_engine_run_backward" in n),
    ("compiled wrappers (dynamo, AOT autograd, inductor, generated code)",
     lambda f, n: any(s in f for s in ("/torch/_dynamo/", "/torch/_functorch/", "/torch/_inductor/",
                                       "torchinductor", "<eval_with_key>"))),
    ("other torch Python", lambda f, n: "/torch/" in f),
    ("other (builtins, C calls)", lambda f, n: True),
)


def _stack(layers: int, shape: tuple, monitored: bool, kind: str, device: str = "cpu"):
    """``fn()``: ``layers`` calls forward and backward. ``flag`` and ``coverage`` stay on the
    CPU whatever the device (as the Router's)."""
    from flashwatch.kernels import AttentionStats, flash_attention, ops

    B, H, N, D = shape
    gen = torch.Generator().manual_seed(0)
    make = lambda: torch.randn(shape, generator=gen, dtype=torch.bfloat16).to(device).requires_grad_()  # noqa: E731
    q = make()
    kv = [(make(), make()) for _ in range(layers)]
    leaves = [q] + [t for pair in kv for t in pair]
    # the output's gradient in the output's memory order, (B, N, H, D) (``layouts.heads_inner_like``), as a
    # model's next operation gives it: a contiguous one would be copied to that order by the compiled
    # backward (AOT autograd matches a tangent to its output's strides), a copy training does not make
    grad = torch.randn((B, N, H, D), generator=gen, dtype=torch.bfloat16).to(device).transpose(1, 2)
    stats = [AttentionStats(H, device) for _ in range(layers)]
    flag = torch.full((), int(monitored), dtype=torch.int32)
    coverage = [torch.zeros(2, dtype=torch.int64) for _ in range(layers)]

    if kind == "eager flash_attention":
        def forward(x, *kvs):
            for i in range(layers):
                x = flash_attention(x, kvs[2 * i], kvs[2 * i + 1], causal=True, stats=stats[i] if monitored else None)
            return x
    else:
        def forward(x, *kvs):
            for i in range(layers):
                x = ops.attention(x, kvs[2 * i], kvs[2 * i + 1], flag=flag, stats=stats[i], coverage=coverage[i],
                                  causal=True)
            return x
        if kind == "compiled ops.attention":
            forward = torch.compile(forward, backend="inductor", fullgraph=True)

    def fn():
        out = forward(*leaves)
        torch.autograd.grad(out, leaves, grad)

    return fn


KINDS = ("eager flash_attention", "eager ops.attention", "compiled ops.attention")
DEFAULT_KINDS = ("eager flash_attention", "compiled ops.attention")  # the Router's eager and compiled paths


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _per_call_us(fn, layers: int, calls: int, device: str = "cpu") -> float:
    best = float("inf")
    for _ in range(3):
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        _sync(device)
        best = min(best, (time.perf_counter() - t0) / calls)
    return best / layers * 1e6


def phase_split(fn, layers: int, calls: int, device: str = "cpu") -> dict:
    """Self time per phase (``PHASES``) as a fraction of the profiled total, and the top entries."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    _sync(device)
    prof.disable()
    st = pstats.Stats(prof)
    phases = {name: 0.0 for name, _ in PHASES}
    entries = []
    for (file, line, name), (cc, nc, tt, ct, callers) in st.stats.items():
        for phase, match in PHASES:
            if match(file, name):
                phases[phase] += tt
                break
        entries.append((tt, nc, f"{os.path.basename(file)}:{line}({name})"))
    total = sum(phases.values()) or 1.0
    entries.sort(reverse=True)
    return {"fractions": {k: v / total for k, v in phases.items()},
            "top": [{"self_fraction": tt / total, "calls_per_layer_call": nc / calls / layers, "where": where}
                    for tt, nc, where in entries[:15]]}


def measure(shape: tuple, layers: int, rounds: int, calls: int, profile: bool = True, kinds=DEFAULT_KINDS,
            device: str = "cpu") -> dict:
    """Per-call host microseconds of each case; on "cpu" the launches end in stand-ins, on
    "cuda" they are real (at a shape whose GPU work is small, the host's time is what is timed)."""
    import contextlib

    from flashwatch.kernels import launch

    report = {}
    with stand_in_kernels() if device == "cpu" else contextlib.nullcontext():
        was = launch.FAST_LAUNCH
        fns = {(kind, mon): _stack(layers, shape, mon, kind, device) for kind in kinds for mon in (False, True)}
        for fn in fns.values():  # compile, warm every cache
            fn()
            fn()
        samples = {(key, path): [] for key in fns for path in ("ordinary", "cached")}
        for _ in range(rounds):
            for path in ("ordinary", "cached"):
                launch.FAST_LAUNCH = path == "cached"
                for key, fn in fns.items():
                    fn()
                    samples[(key, path)].append(_per_call_us(fn, layers, calls, device))
        launch.FAST_LAUNCH = False
        for (kind, mon), fn in fns.items():
            # the least disturbed round: other work on the machine only ever adds time
            row = {path: min(samples[((kind, mon), path)]) for path in ("ordinary", "cached")}
            row["median"] = {path: statistics.median(samples[((kind, mon), path)]) for path in ("ordinary", "cached")}
            if profile:
                row["profile"] = phase_split(fn, layers, calls, device)
            report[f"{kind}, {'monitored' if mon else 'unmonitored'}"] = row
        launch.FAST_LAUNCH = was
    return report


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cpu: launches end in stand-ins (default); cuda: real launches")
    p.add_argument("--shape", type=int, nargs=4, default=None, metavar=("B", "H", "N", "D"),
                   help="default (16, 12, 1024, 64) on cpu (a GPT-2-small layer), (1, 12, 128, 64) on cuda "
                        "(small GPU work: the host's time is what is timed)")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--rounds", type=int, default=3, help="alternated rounds of ordinary and cached launches")
    p.add_argument("--calls", type=int, default=5, help="stack forward+backward runs per timing")
    p.add_argument("--kinds", nargs="+", choices=KINDS, default=DEFAULT_KINDS, metavar="KIND",
                   help=f"cases to time, of {KINDS} (default: the first and the last)")
    p.add_argument("--no-profile", action="store_true")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda needs CUDA", file=sys.stderr)
        return 2
    shape = tuple(args.shape) if args.shape else (16, 12, 1024, 64) if args.device == "cpu" else (1, 12, 128, 64)
    import triton

    report = {"torch": torch.__version__, "triton": triton.__version__, "shape": list(shape), "device": args.device,
              "layers": args.layers, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "cases": measure(shape, args.layers, args.rounds, args.calls, not args.no_profile, tuple(args.kinds),
                               args.device)}
    where = "CPU tensors, launches ending in stand-ins" if args.device == "cpu" else \
        f"on {torch.cuda.get_device_name()}, real launches"
    print(f"host us per attention call (forward+backward), {shape} BF16 {where}, stack of {args.layers}, best of "
          f"{args.rounds} rounds; torch {torch.__version__}, triton {triton.__version__}")
    for case, r in report["cases"].items():
        print(f"  {case:44s} ordinary {r['ordinary']:7.1f}   cached {r['cached']:7.1f}")
    for case, r in report["cases"].items():
        if "profile" not in r:
            continue
        print(f"\n{case}: phases (cProfile self time, scaled to the ordinary launch's {r['ordinary']:.0f} us)")
        for phase, frac in r["profile"]["fractions"].items():
            if frac >= 0.005:
                print(f"  {phase:66s} {frac * r['ordinary']:7.1f} us  {100 * frac:5.1f}%")
        print("  top self time:")
        for e in r["profile"]["top"][:10]:
            print(f"    {100 * e['self_fraction']:5.1f}%  x{e['calls_per_layer_call']:5.2f}/call  {e['where']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
