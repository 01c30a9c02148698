"""Where one training step's device time goes, kernel by kernel, in two arms side by side (CUDA):
GPT-2 small, batch 16 x 1024, bf16, unmonitored steps; torch.profiler over a few steps of each arm,
device time summed per kernel name and divided by the steps, the kernels sorted by how much more
time the second arm spends in them. With ``--host``, the host's side instead: the CPU self time of
every operator and runtime call (custom operators' Python included, launches as cudaLaunchKernel /
cuLaunchKernel rows with their counts) per step, sorted the same way, and the host time to issue a
step (no synchronisation inside the timed steps). With ``--python`` as well, the steps are then run
once more under ``cProfile``, each from an idle device: self time per Python function per step (what the
operators' rows of torch.profiler hold: Inductor's wrapper code, custom operators' implementations,
Triton's launchers), sorted the same way.

    PYTHONPATH=. python benchmarks/step_kernels.py                            # SDPA vs own kernel, compiled
    PYTHONPATH=. python benchmarks/step_kernels.py --eager --json kernels.json
    PYTHONPATH=. python benchmarks/step_kernels.py --compile-mode max-autotune-no-cudagraphs
    PYTHONPATH=. python benchmarks/step_kernels.py --arms sdpa,observe_monitored   # what a monitored step adds
    PYTHONPATH=. python benchmarks/step_kernels.py --arms sdpa,observe             # what an unmonitored step keeps
    PYTHONPATH=. python benchmarks/step_kernels.py --host                     # where the host time goes
    PYTHONPATH=. python benchmarks/step_kernels.py --host --python            # and which Python functions spend it

Arms (``--arms A,B``, default ``sdpa,own_kernel``): ``sdpa`` (the model as it is, torch SDPA),
``own_kernel`` (flashwatch's kernel through a Monitor in own-kernel mode whose only monitored step is
the first warm-up step), ``observe`` (the same in observe mode: what flashwatch leaves in an unmonitored
step of the model's own SDPA), and ``observe_monitored`` / ``own_kernel_monitored`` (a Monitor at
``interval=1``: every profiled step is a monitored one, so against ``sdpa`` / ``own_kernel`` they show
what a monitored step adds, kernel by kernel; its step time includes the step-end read). A kernel's name is
shortened to what identifies it: Triton kernels keep their name without the launch suffixes,
CUDA library kernels their name up to the first template bracket.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import re
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from flashwatch import Monitor, MonitorConfig
from training_step import gpt2_small, make_step


def short_name(name: str) -> str:
    """A kernel's name without template arguments, argument lists or Triton's numeric suffixes."""
    name = name.split("<", 1)[0].split("(", 1)[0].strip()
    return re.sub(r"_\d+(_\d+)*$", "", name) or name


# arm -> the Monitor it attaches: (mode, interval), or None for the model as it is
ARMS = {"sdpa": None, "own_kernel": ("own_kernel", 10**9), "observe": ("observe", 10**9),
        "observe_monitored": ("observe", 1), "own_kernel_monitored": ("own_kernel", 1)}


def profile_arm(arm: str, compiled: bool, args) -> dict:
    """Device time per kernel name per step (ms) and the steps' mean wall time."""
    torch.manual_seed(0)
    model = gpt2_small(args.seq)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    monitor = None
    if ARMS[arm] is not None:  # interval 10**9: step 0 is the only monitored step, the profiled ones are not
        mode, interval = ARMS[arm]
        monitor = Monitor(MonitorConfig(mode=mode, interval=interval))
        monitor.attach(model)
    run = torch.compile(model, mode=args.compile_mode) if compiled else model
    x = torch.randint(0, 256, (args.batch, args.seq), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    step = make_step(run, model, opt, x, x.roll(-1, 1), monitor)

    try:
        for _ in range(args.warmup):
            step()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if args.host else [ProfilerActivity.CUDA]
        issue = 0.0
        with profile(activities=activities) as prof:
            start.record()
            for _ in range(args.steps):
                t0 = time.perf_counter()
                step()
                issue += time.perf_counter() - t0
            end.record()
            torch.cuda.synchronize()
        per_kernel: dict[str, float] = defaultdict(float)
        calls: dict[str, int] = defaultdict(int)
        for e in prof.key_averages():
            # device rows (kernels, copies, fills; CUDA activity only), or with --host the host's: operators
            # and runtime calls (CPU self time)
            spent = e.self_cpu_time_total if args.host else e.self_device_time_total
            if spent > 0:  # device rows have no CPU self time; CPU rows have device time only through kernels
                per_kernel[short_name(e.key)] += spent / 1000 / args.steps  # us -> ms per step
                calls[short_name(e.key)] += e.count
        label = "@compiled" + (f"-{args.compile_mode}" if args.compile_mode else "") if compiled else ""
        result = {"arm": arm + label, "step_ms": start.elapsed_time(end) / args.steps,
                  "issue_ms": 1e3 * issue / args.steps, "device_ms": sum(per_kernel.values()),
                  "kernels": dict(per_kernel), "calls_per_step": {k: v / args.steps for k, v in calls.items()},
                  "host": bool(args.host)}
        if getattr(args, "python", False):
            result["python"] = python_profile(step, args.steps, result["arm"])
        return result
    finally:
        if monitor is not None:
            monitor.detach()
            monitor.close()


def function_name(key: tuple) -> str:
    """A cProfile key (file, line, function) as ``file.py:line(function)``, the file without its folders;
    built-in functions keep their name."""
    file, line, func = key
    if file == "~" or not file:
        return func
    return f"{Path(file).name}:{line}({func})"


def python_profile(step, steps: int, arm: str) -> dict:
    """Self time per Python function per step (ms) and calls per step, ``steps`` steps under cProfile, each
    started on an idle device (the synchronisation before a step is outside the profile)."""
    prof = cProfile.Profile()
    for _ in range(steps):
        torch.cuda.synchronize()
        prof.enable()
        step()
        prof.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(prof).stats  # key -> (primitive calls, calls, self s, cumulative s, callers)
    per_fn: dict[str, float] = defaultdict(float)
    calls: dict[str, float] = defaultdict(float)
    for key, (_, ncalls, self_s, _, _) in stats.items():
        per_fn[function_name(key)] += 1e3 * self_s / steps
        calls[function_name(key)] += ncalls / steps
    return {"arm": arm, "step_ms": 0.0, "issue_ms": sum(per_fn.values()), "device_ms": sum(per_fn.values()),
            "kernels": dict(per_fn), "calls_per_step": dict(calls), "host": True}


def table(a: dict, b: dict, top: int) -> str:
    names = set(a["kernels"]) | set(b["kernels"])
    rows = sorted(names, key=lambda n: abs(b["kernels"].get(n, 0.0) - a["kernels"].get(n, 0.0)), reverse=True)
    what = "host self time" if a.get("host") else "kernels"
    issue = (f"host to issue a step {a['issue_ms']:.2f} / {b['issue_ms']:.2f} ms; " if a.get("host") else "")
    lines = [f"{a['arm']}: step {a['step_ms']:.2f} ms, {what} {a['device_ms']:.2f} ms;  "
             f"{b['arm']}: step {b['step_ms']:.2f} ms, {what} {b['device_ms']:.2f} ms;  {issue}"
             f"difference: step {b['step_ms'] - a['step_ms']:+.2f} ms, {what} {b['device_ms'] - a['device_ms']:+.2f} ms",
             f"{('operator or runtime call' if a.get('host') else 'kernel') + ' (ms per step)':70s} "
             f"{a['arm'][:12]:>12s} {b['arm'][:12]:>12s} {'difference':>11s} {'calls':>11s}"]
    for n in rows[:top]:
        ta, tb = a["kernels"].get(n, 0.0), b["kernels"].get(n, 0.0)
        ca, cb = a["calls_per_step"].get(n, 0), b["calls_per_step"].get(n, 0)
        lines.append(f"{n[:70]:70s} {ta:12.3f} {tb:12.3f} {tb - ta:+11.3f} {ca:5.0f}/{cb:<5.0f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--eager", action="store_true", help="eager arms instead of compiled ones")
    p.add_argument("--host", action="store_true",
                   help="the host's side: CPU self time per operator and runtime call, not device time per kernel")
    p.add_argument("--python", action="store_true",
                   help="with --host: also the Python functions' self time per step (cProfile), arm against arm")
    p.add_argument("--compile-mode", default=None, choices=("max-autotune-no-cudagraphs", "max-autotune"),
                   help="torch.compile's mode for the compiled arms (default: its default mode); the first "
                        "compilation of an autotuning mode takes minutes")
    p.add_argument("--arms", default="sdpa,own_kernel",
                   help=f"two arms, the baseline first, comma-separated, from {', '.join(ARMS)}")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--top", type=int, default=25, help="kernels listed, largest difference first")
    p.add_argument("--json")
    args = p.parse_args(argv)
    for name in ("batch", "seq", "warmup", "steps", "top"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.eager and args.compile_mode:
        p.error("--compile-mode is for the compiled arms; drop it with --eager")
    if args.python and not args.host:
        p.error("--python needs --host (it reads the host's side)")
    arms = args.arms.split(",")
    if len(arms) != 2 or any(a not in ARMS for a in arms):
        p.error(f"--arms takes two of {', '.join(ARMS)} separated by a comma, got {args.arms!r}")
    if not torch.cuda.is_available():
        print("step_kernels.py needs CUDA (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    a, b = (profile_arm(arm, not args.eager, args) for arm in arms)
    print(f"GPT-2 small, batch {args.batch} x {args.seq}, bf16, {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(table(a, b, args.top))
    if args.python:
        print(f"\nPython self time per step under cProfile (ms; the profiler's own cost included), "
              f"{a['arm']} against {b['arm']}:")
        print(table(a["python"], b["python"], args.top))
    if args.json:
        Path(args.json).write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                               "args": vars(args), "arms": [a, b]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
