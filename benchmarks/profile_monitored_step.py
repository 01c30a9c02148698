"""Where a monitored step's extra device time goes (CUDA): GPT-2 small, batch 16 x 1024, bf16,
the Monitor in observe mode at interval 2; torch.profiler over one monitored and one
unmonitored step, the top kernels and ops by CUDA time.

    PYTHONPATH=. python benchmarks/profile_monitored_step.py
"""

import sys

import torch
from torch.profiler import ProfilerActivity, profile

from flashwatch import Monitor, MonitorConfig
from training_step import gpt2_small, make_step


def main() -> int:
    if not torch.cuda.is_available():
        print("profile_monitored_step.py needs CUDA (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
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
        if name == "monitored":
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60))
        totals[name] = sum(e.self_device_time_total for e in prof.key_averages()) / 1e3
    print(f"self CUDA time: monitored step {totals['monitored']:.2f} ms, unmonitored {totals['unmonitored']:.2f} ms")
    monitor.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
