"""Where a training step with a Monitor waits for the GPU (CUDA): torch's sync debug mode set to
"warn" around every step after the warm-up, each synchronizing call recorded with the Python
frames that led to it, grouped by monitored and unmonitored steps, per mode, eager and compiled.

An unmonitored step must show none (the project's rule: no host synchronisation there). A
monitored step may wait, but every wait drains the GPU's queue: the device idles while the host
catches up, which shows as monitored-step time. This lists where the waits are.

    PYTHONPATH=. python benchmarks/sync_points.py                    # GPT-2 small, batch 16 x 1024
    PYTHONPATH=. python benchmarks/sync_points.py --tiny --json sync_points.json

Torch's sync debug mode sees the synchronizing calls torch itself makes (a device-to-host copy,
``.item()``, ``nonzero``, a stream synchronize); it does not see ``Event.synchronize``, which the
Monitor uses on purpose to collect a monitored step's values one step later.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
import warnings
from collections import Counter
from pathlib import Path

import torch

from flashwatch import Monitor, MonitorConfig
from flashwatch.tinygpt import GPT, GPTConfig
from training_step import make_step

import flashwatch
import flashwatch.kernels

# frames from these folders name a call site (the package, its kernels, this folder); torch's are skipped
OWN = tuple(str(Path(m).resolve().parent) for m in (flashwatch.__file__, flashwatch.kernels.__file__, __file__))


# torch's notice, on first turning the debug mode on, that the mode is a prototype: not a synchronizing call
PROTOTYPE_NOTICE = "Synchronization debug mode is a prototype"


def _site(stack: list[traceback.FrameSummary]) -> str:
    """The innermost frames of our own code that led to a synchronizing call (innermost first)."""
    ours = [f for f in stack if str(Path(f.filename).resolve()).startswith(OWN)]
    return " <- ".join(f"{Path(f.filename).parent.name}/{Path(f.filename).name}:{f.lineno} {f.name}"
                       for f in reversed(ours[-3:])) or "(outside flashwatch)"


def arm(mode: str, compiled: bool, args) -> dict:
    torch.manual_seed(0)
    cfg = (GPTConfig(n_layer=2, n_head=4, n_embd=128, block_size=128) if args.tiny
           else GPTConfig(n_layer=12, n_head=12, n_embd=768, block_size=args.seq))
    model = GPT(cfg).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    monitor = Monitor(MonitorConfig(interval=args.interval, mode=mode))
    monitor.attach(model)
    run = torch.compile(model) if compiled else model
    batch = 4 if args.tiny else args.batch
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randint(0, 256, (batch, cfg.block_size), device="cuda", generator=g)
    y = x.roll(-1, 1)
    found: dict[bool, Counter] = {True: Counter(), False: Counter()}
    steps = {True: 0, False: 0}
    current = {"monitored": False}

    def record(message, category, filename, lineno, file=None, line=None):
        text = str(message)
        if text.startswith(PROTOTYPE_NOTICE):  # any other warning in the window is counted, so none is missed
            return
        found[current["monitored"]][f"{text.splitlines()[0][:80]} at {_site(traceback.extract_stack()[:-1])}"] += 1

    step = make_step(run, model, opt, x, y, monitor, clip=True)

    try:
        for _ in range(args.warmup):  # compilation and the first monitored steps synchronize: not counted
            step()
        torch.cuda.synchronize()
        with warnings.catch_warnings():  # restores warnings.showwarning on the way out
            warnings.simplefilter("always")
            warnings.showwarning = record
            torch.cuda.set_sync_debug_mode("warn")
            try:
                for _ in range(args.steps):
                    current["monitored"] = monitor.monitoring
                    steps[current["monitored"]] += 1
                    step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        monitor.flush()
    finally:
        monitor.detach()
        monitor.close()
    name = f"{mode}{'@compiled' if compiled else ''}"
    return {"arm": name, "monitored_steps": steps[True], "unmonitored_steps": steps[False],
            "monitored": dict(found[True].most_common()), "unmonitored": dict(found[False].most_common())}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="a 2-layer model (a quick check)")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--interval", type=int, default=4)
    p.add_argument("--warmup", type=int, default=9)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--modes", default="observe,own_kernel")
    p.add_argument("--no-compile", action="store_true", help="eager arms only")
    p.add_argument("--json")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("sync_points.py needs CUDA (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    for name, value in (("--interval", args.interval), ("--warmup", args.warmup), ("--steps", args.steps)):
        if value < 1:
            p.error(f"{name} must be >= 1, got {value}")
    rows = []
    for mode in args.modes.split(","):
        for compiled in (False,) if args.no_compile else (False, True):
            try:
                rows.append(arm(mode, compiled, args))
            except Exception as exc:  # one arm failing leaves the others to run
                rows.append({"arm": f"{mode}{'@compiled' if compiled else ''}", "error": repr(exc)})
    bad = False
    for r in rows:
        if "error" in r:
            print(f"{r['arm']}: failed: {r['error']}")
            continue
        print(f"{r['arm']}: {r['unmonitored_steps']} unmonitored steps, {sum(r['unmonitored'].values())} synchronizing "
              f"calls; {r['monitored_steps']} monitored steps, {sum(r['monitored'].values())} synchronizing calls")
        for kind in ("unmonitored", "monitored"):
            for site, n in r[kind].items():
                print(f"  {kind:11s} x{n:<4d} {site}")
        bad |= bool(r["unmonitored"])
    if args.json:
        Path(args.json).write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                               "args": vars(args), "arms": rows}, indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
