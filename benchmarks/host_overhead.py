"""Where the forward+backward time of a small attention call goes: device or host (CUDA).

`flashwatch bench` times each call with CUDA events around it (``triton.testing.do_bench``), so a
call whose Python-side launch work outlasts the GPU work queued ahead of it is timed partly on
the host. This script separates the two, per kernel of `flashwatch bench`:

- ``event_ms``: forward+backward as the bench times it (do_bench median);
- ``device_ms``: the same call captured once in a CUDA graph and replayed (do_bench median of the
  replay; ``flashwatch.bench.device_fwd_bwd_ms``, also behind `flashwatch bench --device-time`):
  kernel time alone, no Python in the timed region;
- ``host_us``: wall time per call of 200 back-to-back calls at a tiny shape (1,1,64,D), where the
  GPU work is a few microseconds, so the CPU's launch path is what is timed.

    PYTHONPATH=$PWD python3 benchmarks/host_overhead.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from flashwatch.bench import attention_inputs, device_fwd_bwd_ms, environment, kernel_functions

SHAPES = ((16, 12, 1024, 64), (8, 16, 2048, 64))


def _fwd_bwd(fn, q, k, v, g):
    out = fn(q, k, v, True)
    return torch.autograd.grad(out, (q, k, v), g)


def event_ms(fn, shape) -> float:
    import triton.testing

    q, k, v, g = attention_inputs(shape, torch.bfloat16)
    _fwd_bwd(fn, q, k, v, g)
    return triton.testing.do_bench(lambda: _fwd_bwd(fn, q, k, v, g), warmup=25, rep=100, return_mode="median")


def device_ms(fn, shape) -> float:
    return device_fwd_bwd_ms(fn, shape, True, torch.bfloat16)


def host_us(fn, head_dim: int, calls: int = 200) -> float:
    q, k, v, g = attention_inputs((1, 1, 64, head_dim), torch.bfloat16)
    for _ in range(20):
        _fwd_bwd(fn, q, k, v, g)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        _fwd_bwd(fn, q, k, v, g)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e6


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("host_overhead.py needs CUDA", file=sys.stderr)
        return 2
    fns = kernel_functions()
    report = {"environment": environment(), "host_us_at_1x1x64": {}, "shapes": []}
    for name, fn in fns.items():
        try:
            report["host_us_at_1x1x64"][name] = host_us(fn, 64)
        except Exception as exc:
            report["host_us_at_1x1x64"][name] = f"{type(exc).__name__}: {str(exc)[:160]}"
    for shape in SHAPES:
        row = {"shape": list(shape), "kernels": {}}
        for name, fn in fns.items():
            entry = {}
            for key, measure in (("event_ms", event_ms), ("device_ms", device_ms)):
                try:
                    entry[key] = measure(fn, shape)
                except Exception as exc:
                    entry[key] = f"{type(exc).__name__}: {str(exc)[:160]}"
            row["kernels"][name] = entry
        report["shapes"].append(row)
    print("host time per forward+backward call at (1,1,64,64), microseconds:")
    for name, us in report["host_us_at_1x1x64"].items():
        print(f"  {name:12s} {us:8.1f}" if isinstance(us, float) else f"  {name:12s} {us}")
    for row in report["shapes"]:
        print(f"shape {tuple(row['shape'])}: forward+backward ms, event-timed (as the bench) vs graph-replayed (device)")
        ref = row["kernels"].get("sdpa_flash", {})
        for name, e in row["kernels"].items():
            ev, dv = e.get("event_ms"), e.get("device_ms")
            ratio = (f"  device x flash {ref['device_ms'] / dv:5.2f}"
                     if isinstance(dv, float) and isinstance(ref.get("device_ms"), float) else "")
            fmt = lambda x: f"{x:8.3f}" if isinstance(x, float) else str(x)[:60]
            print(f"  {name:12s} event {fmt(ev)}  device {fmt(dv)}{ratio}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
