"""Where a monitored step's extra device time goes (CUDA): GPT-2 small, batch 16 x 1024, bf16,
the Monitor in observe mode at interval 2; torch.profiler over one monitored and one
unmonitored step: the top kernels and ops by CUDA time, then the device time of the Monitor's
own pieces (each wrapped in a ``torch.profiler.record_function`` range here, in this script only:
the statistics pass, the W^Q-error chain's per-call and per-step work, the W^Q power iteration,
the packing of the statistics; nested ranges count inside their parent too).

    PYTHONPATH=. python benchmarks/profile_monitored_step.py
"""

import functools
import sys

import torch
from torch.profiler import ProfilerActivity, profile, record_function

import flashwatch.kernels
from flashwatch import Monitor, MonitorConfig
from flashwatch.chain import LayerChain
from flashwatch.kernels import AttentionStats
from flashwatch.wq import WqNorms
from training_step import gpt2_small, make_step

PREFIX = "fw::"
# (owner, attribute, label): what the ranges wrap; a staticmethod stays one
PIECES = (
    (flashwatch.kernels, "attention_statistics", "statistics pass (observe)"),
    (LayerChain, "_project", "chain: x.v and x Omega per call"),
    (LayerChain, "add_rows", "chain: the rows' reductions per call (store path)"),
    (LayerChain, "reduction", "chain: factors for the in-kernel reduction per call"),
    (LayerChain, "add_weight_grad", "chain: push_true from W^Q's gradient"),
    (LayerChain, "add_query_grad", "chain: push_true from dQ"),
    (LayerChain, "read_all", "chain: readings and window per step"),
    (WqNorms, "step", "W^Q power iteration"),
    (AttentionStats, "packed_all", "statistics packed"),
    (AttentionStats, "reset_all", "statistics reset"),
    (Monitor, "step", "Monitor.step (all of the above that runs there)"),
)


def annotate() -> list[str]:
    """Wrap every piece of ``PIECES`` in a record_function range; returns the range names."""
    names = []
    for owner, attr, label in PIECES:
        raw = owner.__dict__.get(attr, getattr(owner, attr))
        static = isinstance(raw, staticmethod)
        fn = raw.__func__ if static else raw
        name = PREFIX + label

        def wrapped(*args, _fn=fn, _name=name, **kwargs):
            with record_function(_name):
                return _fn(*args, **kwargs)

        wrapped = functools.wraps(fn)(wrapped)
        setattr(owner, attr, staticmethod(wrapped) if static else wrapped)
        names.append(name)
    return names


def piece_times(events, names: list[str]) -> dict[str, tuple[int, float, float]]:
    """Per range name: (calls, device us, host us), from the ranges' host-side events only.

    A host-side range's device time is the sum of the kernels launched inside it (``FunctionEvent.
    device_time_total``), without the idle gaps between them. The profiler also records each range
    on the GPU's timeline (a user annotation of the same name, from its first kernel's start to its
    last kernel's end): a span that counts the gaps, left out here (``key_averages`` merges the two)."""
    from torch.autograd import DeviceType

    out = {n: [0, 0.0, 0.0] for n in names}
    for e in events:
        if e.name in out and e.device_type == DeviceType.CPU:
            entry = out[e.name]
            entry[0] += 1
            entry[1] += e.device_time_total
            entry[2] += e.cpu_time_total
    return {n: tuple(v) for n, v in out.items()}


def main() -> int:
    if not torch.cuda.is_available():
        print("profile_monitored_step.py needs CUDA (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    names = annotate()
    torch.manual_seed(0)
    model = gpt2_small()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    monitor = Monitor(MonitorConfig(interval=2, mode="observe"))
    monitor.attach(model)
    x = torch.randint(0, 256, (16, 1024), device="cuda")
    step = make_step(model, model, opt, x, x.roll(-1, 1), monitor)

    for _ in range(6):  # warm-up; ends before a monitored step
        step()
    torch.cuda.synchronize()
    totals = {}
    for name in ("monitored", "unmonitored"):
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        events = prof.key_averages()
        if name == "monitored":
            print(events.table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60))
            print("the Monitor's pieces on the monitored step (device time of the kernels each launched):")
            for n, (calls, device_us, host_us) in piece_times(prof.events(), names).items():
                if calls:
                    print(f"  {n[len(PREFIX):]:58s} {calls:4d} calls  {device_us / 1e3:8.3f} ms device"
                          f"  {host_us / 1e3:8.3f} ms host")
        totals[name] = sum(e.self_device_time_total for e in events if not e.key.startswith(PREFIX)) / 1e3
    print(f"self CUDA time: monitored step {totals['monitored']:.2f} ms, unmonitored {totals['unmonitored']:.2f} ms")
    monitor.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
