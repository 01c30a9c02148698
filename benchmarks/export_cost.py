"""Export cost per monitored step on the CPU, for 32 layers x 32 heads (1,024 heads).

What the training thread pays when the Monitor hands one step to its exporters: the
Prometheus exporter's checked copy of the snapshot (``PrometheusExporter.export``), writing
the JSONL line, the console's log line or live panel, and all three through ``FanOut``. Also
the cost of one Prometheus scrape after a new step (building and rendering ``/metrics``),
which runs on the server thread but holds the GIL. Target: <= 50 ms per
monitored step for 1,024 heads (docs/PERFORMANCE.md).

Run:  python benchmarks/export_cost.py [--layers 32 --heads 32 --steps 50]
This is a benchmark, not a test: it is never collected by pytest.
"""

from __future__ import annotations

import argparse
import io
import logging
import platform
import statistics
import tempfile
import time

from rich.console import Console

from flashwatch.exporters import FanOut
from flashwatch.exporters.console import ConsoleExporter
from flashwatch.exporters.jsonl import JsonlExporter
from flashwatch.exporters.prometheus import PrometheusExporter
from flashwatch.exporters.testing import synthetic_layout, synthetic_record


def timed(fn, records) -> list[float]:
    out = []
    for r in records:
        t = time.perf_counter()
        fn(r)
        out.append((time.perf_counter() - t) * 1e3)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--steps", type=int, default=50, help="monitored steps timed per exporter")
    args = p.parse_args()

    layout = synthetic_layout(args.layers, args.heads)
    records = [synthetic_record(layout, step=i, seed=1) for i in range(args.steps)]
    logging.getLogger("flashwatch").setLevel(logging.INFO)
    logging.getLogger("flashwatch").addHandler(logging.StreamHandler(io.StringIO()))
    logging.getLogger("flashwatch").propagate = False

    results: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        prom = PrometheusExporter(port=0)
        jsonl = JsonlExporter(tmp)
        console = ConsoleExporter("log", console=Console(file=io.StringIO()))
        live = ConsoleExporter("live", console=Console(file=io.StringIO(), force_terminal=True))
        for e in (prom, jsonl, console, live):
            e.open(layout)
            e.export(records[0])  # warm-up: label caches, file creation
        results["prometheus export"] = timed(prom.export, records)
        def export_and_scrape(r):
            prom.export(r)
            prom.render()
        results["prometheus export + one scrape (server thread)"] = timed(export_and_scrape, records[:20])
        results["jsonl export"] = timed(jsonl.export, records)
        results["console export (log mode)"] = timed(console.export, records)
        results["console export (live mode)"] = timed(live.export, records)
        live.close()
        fan = FanOut([prom, jsonl, console])
        results["FanOut(prometheus, jsonl, console)"] = timed(fan.export, records)
        size = len(prom.render())
        for e in (prom, jsonl, console):
            e.close()

    print(f"flashwatch export cost: {args.layers} layers x {args.heads} heads = "
          f"{layout.num_heads} heads, {args.steps} monitored steps")
    print(f"machine: {platform.processor() or platform.machine()}, Python {platform.python_version()}, "
          f"{platform.system()} {platform.release()}")
    print(f"/metrics size: {size / 1e3:.0f} kB")
    print(f"{'what':48s} {'median ms':>10s} {'p95 ms':>10s}")
    for name, ms in results.items():
        ms = sorted(ms)
        p95 = ms[min(len(ms) - 1, int(0.95 * len(ms)))]
        print(f"{name:48s} {statistics.median(ms):10.2f} {p95:10.2f}")
    total = statistics.median(results["FanOut(prometheus, jsonl, console)"])
    verdict = "meets" if total <= 50 else "MISSES"
    print(f"per monitored step, all exporters: {total:.1f} ms ({verdict} the 50 ms target)")


if __name__ == "__main__":
    main()
