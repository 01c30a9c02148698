"""The host work a monitored step adds to an unmonitored one, on the CPU: GPT-2 small's structure
(12 layers x 12 heads, d 768: ``flashwatch.tinygpt``) at a tiny batch and sequence, so that the
CPU's arithmetic is small and Python and dispatcher work dominate, observe mode, eager.

Two measurements, each over monitored and unmonitored steps alike (``interval=2``):

- time: the median wall time of a whole training step (forward, backward, optimizer, ``Monitor.step``)
  and of each phase of the monitored step's extra work, timed by wrapping the functions that do it;
- dispatched torch ops: a ``TorchDispatchMode`` counts every op per phase (each op dispatched is a
  kernel launch, or a few, on a GPU: fewer ops is what cuts the host time there too).

``--statistics stub`` (default) replaces the CPU reference of the statistics pass with what the
Triton path does on the host besides its launch (the W^Q-error chain's ``reduction`` factors), so
the counts are those of a CUDA step in eager mode; ``--statistics none`` runs no statistics pass and
feeds no W^Q-error chain: the Monitor's own step-end work alone (under ``torch.compile`` the
statistics and the chain's rows come from custom operators inside the compiled graph, which this
eager count does not see); ``--statistics reference`` runs the CPU reference (many more ops, none of
them on a GPU).

    PYTHONPATH=. python benchmarks/monitored_step_host.py [--steps 20] [--n-embd 192] [--json out.json]
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from flashwatch import Monitor, MonitorConfig, chain, collect, monitor, routing, wq
from flashwatch.kernels import reference, stats as kstats
from flashwatch.tinygpt import GPT, GPTConfig

# (label, owner, attribute): the functions a monitored step runs beyond an unmonitored one
PHASES = (
    ("observe hook (forward, per call)", routing.Router, "_observe"),
    ("chain hooks (forward, per call)", routing.Router, "_chain_hooks"),
    ("statistics pass (backward, per call)", reference, "attention_statistics"),
    ("chain rows/reduction (backward, per call)", chain.LayerChain, "reduction"),
    ("W^Q gradient push (backward, per layer)", chain.LayerChain, "add_weight_grad"),
    ("Monitor._collect (whole)", monitor.Monitor, "_collect"),
    ("  chains.average", chain.Chains, "average"),
    ("  stats packing", kstats.AttentionStats, "packed"),
    ("  stats packing", kstats.AttentionStats, "packed_all"),
    ("  chains.reading", chain.Chains, "reading"),
    ("  chains.reading", chain.Chains, "readings"),
    ("  wq.step", wq.WqNorms, "step"),
    ("  chains.update_pairs", chain.Chains, "update_pairs"),
    ("  collector packing + host copy", collect.Collector, "_local"),
    ("Monitor._reset_stats", monitor.Monitor, "_reset_stats"),
    ("host half (Monitor._decide)", monitor.Monitor, "_decide"),
)


class _Phases:
    """Times and op counts per phase; the innermost phase running owns an op."""

    def __init__(self):
        self.stack: list[str] = []
        self.seconds: Counter = Counter()
        self.ops: Counter = Counter()
        self.op_names: dict[str, Counter] = {}
        self.counting = False

    def wrap(self, label: str, fn):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            self.stack.append(label)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[label] += time.perf_counter() - t0
                self.stack.pop()
        return timed


class _CountOps(TorchDispatchMode):
    def __init__(self, phases: _Phases):
        super().__init__()
        self.phases = phases

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        label = self.phases.stack[-1] if self.phases.stack else "model, optimizer (rest of the step)"
        self.phases.ops[label] += 1
        self.phases.op_names.setdefault(label, Counter())[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


def _stub_statistics(q, k, v, out, grad_out, stats, *, causal=True, sm_scale=None, eps=1e-3):
    """What the Triton statistics path does on the host besides its launch: the chain's factors. The
    rows the kernel counts are written outside the op count (the kernel writes them, no op of its own),
    so that the call reads as measured (no coverage alert's host work in the count)."""
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():
        stats.rows.add_(q.shape[0] * q.shape[2])
    hook = stats.rows_hook
    if hook is not None and hasattr(hook, "reduction"):
        found = hook.reduction(q)
        if found is not None:
            found.done()


def _no_statistics(*args, **kwargs):
    """A compiled step's chain: nothing fed."""


def build(statistics: str, batch: int, seq: int, n_embd: int = 768):
    torch.manual_seed(0)
    if statistics != "reference":
        reference.attention_statistics = _stub_statistics if statistics == "stub" else _no_statistics
    if statistics == "none":
        routing.Router._chain_hooks = lambda self, *args: None  # as compiled code: the chain is not fed
    model = GPT(GPTConfig(n_layer=12, n_head=12, n_embd=n_embd, block_size=seq))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    mon = Monitor(MonitorConfig(interval=2, mode="observe"))
    mon.attach(model)
    x = torch.randint(0, 256, (batch, seq))
    y = x.roll(-1, 1)

    def step():
        loss = model(x, y)[1]
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        mon.step(loss=loss.detach())

    return mon, step


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=20, help="timed steps of each kind (default 20)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=16)
    ap.add_argument("--n-embd", type=int, default=768,
                    help="model width (default 768, GPT-2 small; 192, head dim 16, leaves the CPU almost no "
                         "arithmetic, so the times are host overhead)")
    ap.add_argument("--statistics", choices=("stub", "none", "reference"), default="stub")
    ap.add_argument("--json", help="write the numbers here")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    phases = _Phases()
    for label, owner, name in PHASES:
        if not hasattr(owner, name):  # an older version of the code (comparisons)
            continue
        original = getattr(owner, name)
        if isinstance(owner, type) and isinstance(owner.__dict__.get(name), staticmethod):
            setattr(owner, name, staticmethod(phases.wrap(label, original)))
        else:
            setattr(owner, name, phases.wrap(label, original))
    # reference.attention_statistics is replaced first, then wrapped: rebuild the wrapper after build()
    mon, step = build(a.statistics, a.batch, a.seq, a.n_embd)
    reference.attention_statistics = phases.wrap("statistics pass (backward, per call)",
                                                 reference.attention_statistics)
    for _ in range(6):  # warm-up, ends before a monitored step
        step()
    assert mon.monitoring
    times = {"monitored": [], "unmonitored": []}
    per_phase: dict[str, list[float]] = {}
    for _ in range(a.steps):
        for kind in ("monitored", "unmonitored"):
            phases.seconds.clear()
            t0 = time.perf_counter()
            step()
            times[kind].append(time.perf_counter() - t0)
            if kind == "monitored":
                for label, s in phases.seconds.items():
                    per_phase.setdefault(label, []).append(s)
    # ops: one monitored and one unmonitored step under the counting mode
    counts = {}
    for kind in ("monitored", "unmonitored"):
        phases.ops.clear()
        phases.op_names.clear()
        with _CountOps(phases):
            step()
        counts[kind] = dict(phases.ops)
        if kind == "monitored":
            names = {k: dict(v.most_common(8)) for k, v in phases.op_names.items()}
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    phase_ms = {k: statistics.median(v) * 1e3 for k, v in per_phase.items()}
    total_ops = {k: sum(v.values()) for k, v in counts.items()}
    print(f"12 layers x 12 heads, d {a.n_embd}, batch {a.batch} x {a.seq}, observe mode, eager, CPU, statistics {a.statistics}")
    print(f"step (median of {a.steps}): unmonitored {med['unmonitored']:.2f} ms, monitored {med['monitored']:.2f} ms, "
          f"extra {med['monitored'] - med['unmonitored']:.2f} ms")
    print(f"torch ops dispatched: unmonitored {total_ops['unmonitored']}, monitored {total_ops['monitored']}, "
          f"extra {total_ops['monitored'] - total_ops['unmonitored']}")
    print(f"{'phase of the monitored step':44s} {'ms':>8s} {'ops':>6s}")
    for label in dict.fromkeys(label for label, _, _ in PHASES):
        if label in phase_ms or label in counts["monitored"]:
            print(f"{label:44s} {phase_ms.get(label, 0.0):8.3f} {counts['monitored'].get(label, 0):6d}")
    rest = "model, optimizer (rest of the step)"
    print(f"{rest:44s} {'':8s} {counts['monitored'].get(rest, 0):6d} (unmonitored: {counts['unmonitored'].get(rest, 0)})")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"config": vars(a), "step_ms": med, "phase_ms": phase_ms, "ops": counts,
                       "top_ops": names}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
