"""Does monitoring change training? The same model, data and optimizer under each way of running it.

Each arm starts from the same weights and trains on the same batches (by default GPT-2 small,
batch 16 x 1024 random tokens, bf16 autocast, AdamW lr 3e-4: ``benchmarks/monitor_overhead.py``'s
loop, whose final losses differ between arms). Per arm:

- ``grad_error``: the first step's gradient (every parameter, flattened) against a float64
  reference of the same step (float64 weights and inputs, math SDPA, no autocast):
  ||g - g64|| / ||g64||. Rounding of one step, free of any trajectory's growth;
- ``losses``: the loss at every step, against a reference arm (``sdpa`` for eager arms,
  ``sdpa@compiled`` for compiled ones): ``agree_steps``, the steps before |loss gap| first
  exceeds 0.001; ``median_gap`` and ``max_gap`` over all steps; ``bitwise``: every loss equal.

On random tokens this loop's loss spikes now and then (to ~12 from ~10.6), and rounding moves a
spike by a step or two, so one step's gap (the final loss's too) can be as large as the spike
while the curves agree everywhere else: read ``agree_steps`` and ``median_gap``. The spread that
rounding alone makes is read from arms that change nothing but a kernel choice:
``sdpa_efficient`` (torch's memory-efficient SDPA backend) and, compiled, ``sdpa@compiled``
against ``sdpa``. A monitored arm whose step-0 gradient error is near SDPA's and whose gaps
stay within that spread trains as SDPA does; one outside it changes training.

On CUDA the arms run under torch's deterministic algorithms (``--nondeterministic`` turns them
off: FlashAttention's backward then adds dQ's parts with atomics, and two runs of one arm
differ in the last bits). ``sdpa_again`` repeats ``sdpa``: bit for bit when deterministic. Then
observe mode must not change the eager step at all: ``observe`` against ``sdpa`` is compared bit
for bit.

    python benchmarks/training_equivalence.py --json training_equivalence.json
    python benchmarks/training_equivalence.py --device cpu --tiny --no-compile   # a smoke test
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import sys

import torch

from flashwatch import Monitor, MonitorConfig
from flashwatch.tinygpt import GPT, GPTConfig

EAGER = ("sdpa", "sdpa_again", "sdpa_efficient", "observe", "own_kernel")
AGREE = 1e-3  # |loss gap| up to which two arms' losses count as agreeing (agree_steps)
COMPILED = ("sdpa@compiled", "observe@compiled", "own_kernel@compiled")


def _config(tiny: bool, seq: int) -> GPTConfig:
    if tiny:
        return GPTConfig(block_size=seq, vocab_size=256, n_layer=2, n_head=2, n_embd=128, bias=True)
    return GPTConfig(block_size=seq, vocab_size=50304, n_layer=12, n_head=12, n_embd=768, bias=True)


def _batches(cfg: GPTConfig, batch: int, seq: int, dev: str) -> list[torch.Tensor]:
    g = torch.Generator(device=dev).manual_seed(0)
    return [torch.randint(0, cfg.vocab_size, (batch, seq + 1), device=dev, generator=g) for _ in range(8)]


def _flat_grad(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1).double() for p in model.parameters() if p.grad is not None])


def reference_gradient(cfg: GPTConfig, state: dict, batch: torch.Tensor) -> torch.Tensor:
    """The first step's gradient in float64 (math SDPA, no autocast): the yardstick of every arm."""
    model = GPT(cfg).to(batch.device).double()
    model.load_state_dict(state)
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        _, loss = model(batch[:, :-1], batch[:, 1:])
        loss.backward()
    return _flat_grad(model)


def run_arm(name: str, cfg: GPTConfig, state: dict, batches: list, steps: int, dev: str, g64: torch.Tensor,
            interval: int) -> dict:
    gc.collect()
    torch._dynamo.reset()
    model = GPT(cfg).to(dev)
    model.load_state_dict(state)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=dev == "cuda")
    kind, _, compiled = name.partition("@")
    kind = "sdpa" if kind == "sdpa_again" else kind
    monitor = None
    if kind == "observe":
        monitor = Monitor(MonitorConfig(mode="observe", interval=interval))
    elif kind == "own_kernel":
        monitor = Monitor(MonitorConfig(mode="own_kernel", interval=interval))
    if monitor is not None:
        monitor.attach(model)
    run = torch.compile(model) if compiled else model
    backend = (torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.EFFICIENT_ATTENTION)
               if kind == "sdpa_efficient" else contextlib.nullcontext())
    losses, grad_error = [], None
    try:
        with backend:
            for step in range(steps):
                xb = batches[step % len(batches)]
                with torch.autocast(dev, dtype=torch.bfloat16):
                    _, loss = run(xb[:, :-1], xb[:, 1:])
                loss.backward()
                if step == 0:
                    g = _flat_grad(model)
                    grad_error = float((g - g64).norm() / g64.norm())
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                opt.zero_grad(set_to_none=True)
                if monitor is not None:
                    monitor.step(loss=loss.detach(), grad_norm=norm)
                losses.append(loss.detach())
    finally:
        if monitor is not None:
            monitor.detach()
            monitor.close()
    return {"arm": name, "grad_error": grad_error, "losses": [float(x) for x in torch.stack(losses).cpu()]}


def compare(arms: list[dict]) -> None:
    """Adds ``reference`` (sdpa, or sdpa@compiled for compiled arms), ``agree_steps``,
    ``median_gap``, ``max_gap`` and ``bitwise`` to each arm but the references themselves."""
    by = {a["arm"]: a for a in arms}
    for a in arms:
        ref = by.get("sdpa@compiled" if a["arm"].endswith("@compiled") and a["arm"] != "sdpa@compiled" else "sdpa")
        if ref is None or ref is a:
            continue
        gaps = [abs(x - y) for x, y in zip(a["losses"], ref["losses"])]
        agree = next((i for i, gap in enumerate(gaps) if gap > AGREE), len(gaps))
        a.update(reference=ref["arm"], agree_steps=agree, median_gap=statistics.median(gaps), max_gap=max(gaps),
                 bitwise=a["losses"] == ref["losses"])


def deterministic() -> None:
    """torch's deterministic algorithms for the rest of the process (cuBLAS's workspace setting
    first: it is read when cuBLAS is first used)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--steps", type=int, default=75, help="training steps per arm (monitor_overhead.py's 15 + 60)")
    p.add_argument("--interval", type=int, default=10, help="the Monitor's interval in the monitored arms")
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="a 2-layer model: a smoke test of this script on the CPU")
    p.add_argument("--no-compile", action="store_true", help="the eager arms only")
    p.add_argument("--nondeterministic", action="store_true",
                   help="leave torch's deterministic algorithms off (two runs of one arm then differ on CUDA)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("needs CUDA (or --device cpu --tiny --no-compile for a smoke test)", file=sys.stderr)
        return 2
    if args.steps < 1 or args.batch < 1 or args.seq < 2:
        p.error("--steps and --batch must be >= 1 and --seq >= 2")
    if not args.nondeterministic:
        deterministic()
    torch.manual_seed(0)
    cfg = _config(args.tiny, args.seq)
    state = {k: v.detach().clone() for k, v in GPT(cfg).to(args.device).state_dict().items()}
    batches = _batches(cfg, args.batch, args.seq, args.device)
    g64 = reference_gradient(cfg, state, batches[0])
    names = list(EAGER) + ([] if args.no_compile else list(COMPILED))
    if args.device != "cuda":
        names.remove("sdpa_efficient")  # a CUDA backend
    arms, failed = [], []
    for name in names:  # an arm that fails (say, an operator without a deterministic algorithm) is reported, not fatal
        try:
            arms.append(run_arm(name, cfg, state, batches, args.steps, args.device, g64, args.interval))
        except Exception as exc:
            failed.append({"arm": name, "error": f"{type(exc).__name__}: {exc}"})
    compare(arms)
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"{'tiny GPT' if args.tiny else 'GPT-2 small'}, batch {args.batch} x {args.seq}, {args.steps} steps, bf16, "
          f"{device_name}, torch {torch.__version__}, deterministic algorithms {'off' if args.nondeterministic else 'on'}")
    print(f"{'arm':22s} {'step-0 grad error':>18s} {'final loss':>11s} {'steps agreeing':>15s} {'median |gap|':>13s} "
          f"{'max |gap|':>10s} {'against':>14s}")
    for a in arms:
        if "reference" not in a:
            cells = ("", "", "")
        elif a["bitwise"]:
            cells = ("all (bitwise)", "0", "0")
        else:
            cells = (f"{a['agree_steps']} of {len(a['losses'])}", f"{a['median_gap']:.2e}", f"{a['max_gap']:.4f}")
        print(f"{a['arm']:22s} {a['grad_error']:18.3e} {a['losses'][-1]:11.4f} {cells[0]:>15s} {cells[1]:>13s} "
              f"{cells[2]:>10s} {a.get('reference', ''):>14s}")
    for f in failed:
        print(f"{f['arm']:22s} failed: {f['error'][:300]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "device": device_name, "torch": torch.__version__,
                       "deterministic": not args.nondeterministic, "arms": arms, "failed": failed}, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
