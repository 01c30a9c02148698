"""What the Monitor costs a real training step (CUDA): GPT-2 small, batch 16 x 1024, bf16.

Five arms on the same model, data and optimizer, one after another in one process:

- ``sdpa``: torch SDPA, no monitor (the user's baseline in observe mode);
- ``sdpa+observe``: the same with ``Monitor(MonitorConfig(mode="observe", interval=10))``;
- ``flashwatch``: attention through flashwatch's plain kernel, no monitor (own-kernel baseline);
- ``flashwatch+own_kernel``: ``Monitor(MonitorConfig(mode="own_kernel", interval=10))``;
- ``sdpa+observe_no_chain``: observe mode with ``wq_error_chain=False`` (the W^Q-gradient error
  chain off), against ``sdpa``.

With ``--compile MODE [MODE ...]`` (torch.compile modes: ``default``,
``max-autotune-no-cudagraphs``, ``reduce-overhead``), four compiled arms per mode follow,
named ``<arm>@<mode>``:

- ``sdpa@MODE``: the compiled model, no monitor (the compiled baseline);
- ``sdpa+observe@MODE``: compiled, observe mode at ``interval``;
- ``own_kernel@MODE``: compiled, own-kernel mode whose only monitored step is step 0 (in the
  warm-up): flashwatch's kernel against ``sdpa@MODE``;
- ``own_kernel+monitor@MODE``: compiled, own-kernel mode at ``interval`` (``--arms`` also takes
  ``sdpa+observe_no_chain``).

An arm that fails (a compile error) is reported with its error and the others still run.
Compiled arms also report the recompilations and graph breaks Dynamo counted and, under CUDA graphs, the pieces
Inductor cut its graphs into (partitions) and the graphs it ran without CUDA graphs (skips).

``--mask causal``: the model's attention is given its causal mask as a boolean tensor
(``is_causal=False``), as Hugging Face models pass it under
``torch.compile``: observe mode's statistics then take the mask's route, where a mask that is only
the causal pattern goes to the plain (Triton) pass. ``--mask causal-dense``: the same, with that
shortcut off (every such call through the dense N x N pass, as before it existed).
``--mask causal-dropout``: the mask with attention dropout 0.1 (Hugging Face GPT-2's default), whose
calls' scores are measured (rows, repeated maxima, max logit) and their delta error not.

The arms run one after another in one process. ``--baseline-again`` times each compiled mode's
``sdpa`` arm once more after the others and compares the arms with the mean of its two runs
(printing how far the second run drifted from the first): a device that slows as the run goes on
would otherwise count against every arm after the first.

Each arm runs ``--warmup`` steps (compilation, first monitored step), then ``--steps`` timed
steps (CUDA events around every step, read once at the end, so timing adds no host sync).
Reported: mean step time, mean monitored / unmonitored step, and the overheads against the
aims: mean step <= 1% above its baseline, monitored step <= 10% above an unmonitored one
(by the means, and by the medians: with 6 monitored steps an arm, one slow step moves the
mean by points). The JSON also keeps, per arm, what tells a device-bound step from a
host-bound one and one arm's compiled code from another's:

- ``step_ms`` / ``step_monitored``: every timed step (device time between CUDA events) and
  whether it was monitored (where a slow unmonitored step sits: right after a monitored one?);
- ``host_ms``: every timed step's host time (the loop's Python, launches included; a step whose
  host time reaches its device time is host-bound);
- ``host_enqueue_ms``: after the timed steps, ``--idle-start-steps`` more steps, each started on an idle
  device (synchronized first), host time to enqueue one whole step (unmonitored and monitored
  means): the host's own cost of a step, to compare with ``unmonitored_ms``;
- ``allocator``: the CUDA caching allocator's retries, device allocations and frees during the
  timed steps, and the peak memory (each arm starts from a collected, emptied cache);
- ``generated_code``: a short hash of each module Inductor generated for the arm (two arms with
  the same hashes ran the same compiled code).

    python benchmarks/monitor_overhead.py --json monitor_overhead.json
    python benchmarks/monitor_overhead.py --compile default max-autotune-no-cudagraphs --json compiled.json
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import hashlib
import json
import statistics
import time

import torch
import torch.nn.functional as F

from flashwatch import Monitor, MonitorConfig
from flashwatch.kernels import flash_attention
from flashwatch.tinygpt import GPT, GPTConfig


@contextlib.contextmanager
def flashwatch_attention():
    """Route every F.scaled_dot_product_attention(q, k, v, is_causal=True) through the plain
    flashwatch kernel, without a monitor: the own-kernel baseline."""
    original = F.scaled_dot_product_attention

    def route(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **kw):
        if attn_mask is None and dropout_p == 0.0 and not kw:
            return flash_attention(q, k, v, causal=is_causal, sm_scale=scale)
        return original(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale, **kw)

    F.scaled_dot_product_attention = route
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original


class _HostEvent:
    """A host-clock stand-in for torch.cuda.Event on the CPU."""

    def record(self):
        self.t = time.perf_counter()

    def elapsed_time(self, end) -> float:
        return (end.t - self.t) * 1e3


def run_arm(name: str, args) -> dict:
    """One arm; a compiled arm that raises is reported with its error instead of stopping the run."""
    if "@" not in name:
        return _run_arm(name, args)
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    try:
        with _generated_modules() as paths:
            result = _run_arm(name, args)
    except Exception as exc:  # noqa: BLE001 - a benchmark reports what failed and goes on
        return {"arm": name, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"}
    result["arm"] = name
    result["generated_code"] = _code_hashes(paths)
    result["graph_breaks"] = sum(counters["graph_break"].values())
    result["unique_graphs"] = counters["stats"]["unique_graphs"]
    # under CUDA graphs (mode="reduce-overhead"): the pieces Inductor cut its graphs into around operators that
    # must run outside a graph, and the graphs it ran without CUDA graphs (0 and 0 in the other modes)
    result["cudagraph_partitions"] = counters["inductor"]["cudagraph_partitions"]
    result["cudagraph_skips"] = counters["inductor"]["cudagraph_skips"]
    return result


@contextlib.contextmanager
def _generated_modules():
    """Collect the paths of the Python modules Inductor loads while the block runs (fresh
    compilations and cache hits alike; nothing where this torch loads them another way)."""
    paths: set = set()
    try:
        from torch._inductor.codecache import PyCodeCache
        original = PyCodeCache.__dict__["load_by_key_path"]
    except (ImportError, KeyError):
        yield paths
        return

    def load_by_key_path(cls, key, path, *rest, **kw):
        paths.add(path)
        return original.__func__(cls, key, path, *rest, **kw)

    PyCodeCache.load_by_key_path = classmethod(load_by_key_path)
    try:
        yield paths
    finally:
        PyCodeCache.load_by_key_path = original


def _code_hashes(paths) -> list[str]:
    """A short hash of each generated module's source, sorted: equal lists, equal compiled code."""
    hashes = []
    for path in paths:
        try:
            with open(path, "rb") as f:
                hashes.append(hashlib.sha256(f.read()).hexdigest()[:12])
        except OSError:
            continue
    return sorted(hashes)


def _allocator_counts(dev: str) -> dict:
    if dev != "cuda":
        return {}
    stats = torch.cuda.memory_stats()
    return {k: stats.get(k, 0) for k in ("num_alloc_retries", "num_device_alloc", "num_device_free")}


def _pass_causal_mask(model: GPT, dropout_p: float = 0.0) -> None:
    """Make ``model``'s attention calls pass their causal mask as a (T, T) boolean tensor with
    ``is_causal=False`` (Hugging Face's calls under compile, which make the mask once a forward;
    compiled, the layers' identical masks are one buffer too), with attention dropout ``dropout_p``
    in training."""
    import types

    import torch.nn.functional as F

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (z.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
                   for z in self.c_attn(x).split(self.n_embd, dim=2))
        mask = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask,  # F looked up at call time: routed
                                           dropout_p=dropout_p if self.training else 0.0)
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C)))

    for block in model.transformer.h:
        block.attn.forward = types.MethodType(forward, block.attn)


def _run_arm(name: str, args) -> dict:
    name, _, compile_mode = name.partition("@")
    dev = args.device
    gc.collect()  # the previous arm's model, optimizer and compiled code: freed before this one starts
    if dev == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    torch.manual_seed(0)
    if args.tiny:  # a CPU smoke test of this script
        cfg = GPTConfig(block_size=args.seq, vocab_size=256, n_layer=2, n_head=2, n_embd=128, bias=True)
    else:
        cfg = GPTConfig(block_size=args.seq, vocab_size=50304, n_layer=12, n_head=12, n_embd=768, bias=True)
    model = GPT(cfg).to(dev)
    if args.mask != "none":
        _pass_causal_mask(model, dropout_p=0.1 if args.mask == "causal-dropout" else 0.0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=dev == "cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    batches = [torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), device=dev, generator=g)
               for _ in range(8)]
    monitor = None
    route = contextlib.nullcontext()
    if name == "sdpa+observe":
        monitor = Monitor(MonitorConfig(mode="observe", interval=args.interval))
    elif name == "sdpa+observe_no_chain":
        monitor = Monitor(MonitorConfig(mode="observe", interval=args.interval, wq_error_chain=False))
    elif name == "flashwatch":
        route = flashwatch_attention()
    elif name == "flashwatch+own_kernel" or name == "own_kernel+monitor":
        monitor = Monitor(MonitorConfig(mode="own_kernel", interval=args.interval))
    elif name == "own_kernel":  # flashwatch's kernel; step 0 (warm-up) is its only monitored step
        monitor = Monitor(MonitorConfig(mode="own_kernel", interval=10**9))
    if monitor is not None:
        monitor.attach(model)
    run = model
    if compile_mode:
        run = torch.compile(model, mode=None if compile_mode == "default" else compile_mode, backend=args.backend)
    total = args.warmup + args.steps
    if dev == "cuda":
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(total)]
    else:
        events = [(_HostEvent(), _HostEvent()) for _ in range(total)]
    monitored, host = [], []

    def one_step(step: int, event_pair=None):
        xb = batches[step % len(batches)]
        if event_pair is not None:
            event_pair[0].record()
        with torch.autocast(dev, dtype=torch.bfloat16):
            _, loss = run(xb[:, :-1], xb[:, 1:])
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if monitor is not None:
            monitor.step(loss=loss.detach(), grad_norm=norm)
        if event_pair is not None:
            event_pair[1].record()
        return loss

    allocator_before: dict = {}
    with route:
        for step in range(total):
            if step == args.warmup:
                if dev == "cuda":
                    torch.cuda.synchronize()
                allocator_before = _allocator_counts(dev)
            monitored.append(monitor is not None and monitor.monitoring)
            t0 = time.perf_counter()
            loss = one_step(step, events[step])
            host.append((time.perf_counter() - t0) * 1e3)
        if dev == "cuda":
            torch.cuda.synchronize()
        allocator = {k: v - allocator_before.get(k, 0) for k, v in _allocator_counts(dev).items()}
        if dev == "cuda":
            allocator["peak_allocated_gb"] = torch.cuda.max_memory_allocated() / 2**30
        # the host's own cost of a step: each of these steps starts on an idle device
        idle = {True: [], False: []}
        for step in range(total, total + args.idle_start_steps):
            is_monitored = monitor is not None and monitor.monitoring
            if dev == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            one_step(step)
            idle[is_monitored].append((time.perf_counter() - t0) * 1e3)
        if dev == "cuda":
            torch.cuda.synchronize()
    times = [s.elapsed_time(e) for s, e in events][args.warmup:]
    flags = monitored[args.warmup:]
    mon = [t for t, f in zip(times, flags) if f]
    unmon = [t for t, f in zip(times, flags) if not f]
    if monitor is not None:
        monitor.detach()
        monitor.close()
    return {"arm": name, "mean_ms": statistics.mean(times), "median_ms": statistics.median(times),
            "monitored_ms": statistics.mean(mon) if mon else None,
            "unmonitored_ms": statistics.mean(unmon) if unmon else None,
            "monitored_median_ms": statistics.median(mon) if mon else None,
            "unmonitored_median_ms": statistics.median(unmon) if unmon else None, "steps": len(times),
            "monitored_steps": len(mon), "final_loss": float(loss.detach()),
            "step_ms": times, "step_monitored": flags, "host_ms": host[args.warmup:],
            "host_enqueue_ms": {"unmonitored": statistics.mean(idle[False]) if idle[False] else None,
                                "monitored": statistics.mean(idle[True]) if idle[True] else None},
            "allocator": allocator}


def _fmt(ms) -> str:
    return "" if ms is None else f"{ms:.2f}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--interval", type=int, default=10)
    p.add_argument("--warmup", type=int, default=15)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--json", default=None)
    p.add_argument("--idle-start-steps", type=int, default=10,
                   help="steps after the timed ones, each started on an idle device, whose host time is reported")
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="a 2-layer model: a smoke test of this script on the CPU")
    p.add_argument("--compile", nargs="*", default=[], metavar="MODE",
                   help="also run the compiled arms under these torch.compile modes (default, "
                        "max-autotune-no-cudagraphs, reduce-overhead)")
    p.add_argument("--only-compiled", action="store_true", help="skip the four eager arms")
    p.add_argument("--backend", default="inductor", help="torch.compile backend of the compiled arms")
    p.add_argument("--arms", default="sdpa,sdpa+observe,own_kernel,own_kernel+monitor",
                   help="the compiled arms to run, comma-separated (a run under the 10-minute limit of one call)")
    p.add_argument("--baseline-again", action="store_true",
                   help="time each compiled mode's sdpa arm again after its other arms: the arms run one after "
                        "another, so a device that slows as the run goes on counts against every arm after the "
                        "first; overheads are then against the mean of the two sdpa runs, and their drift is printed")
    p.add_argument("--mask", choices=("none", "causal", "causal-dense", "causal-dropout"), default="none",
                   help="causal: the attention is given its causal mask as a tensor (Hugging Face under compile); "
                        "causal-dense: the same, with the statistics' plain-pass shortcut for such masks off; "
                        "causal-dropout: the mask with attention dropout 0.1")
    args = p.parse_args(argv)
    if args.mask == "causal-dense":  # every masked call through the dense pass, as before the shortcut
        from flashwatch.kernels import masked

        masked._plain_equivalent = lambda attn_mask, n, read=None: None
    if args.device == "cuda" and not torch.cuda.is_available():
        print("needs CUDA (or --device cpu --tiny for a smoke test)")
        return 2
    names = [] if args.only_compiled else ["sdpa", "sdpa+observe", "sdpa+observe_no_chain", "flashwatch",
                                           "flashwatch+own_kernel"]
    pairs = [] if args.only_compiled else [("sdpa+observe", "sdpa"), ("sdpa+observe_no_chain", "sdpa"),
                                           ("flashwatch+own_kernel", "flashwatch")]
    chosen = [a for a in args.arms.split(",") if a]
    known = ("sdpa", "sdpa+observe", "sdpa+observe_no_chain", "own_kernel", "own_kernel+monitor")
    unknown = set(chosen) - set(known)
    if unknown:
        p.error(f"--arms: unknown {sorted(unknown)}; choose from {', '.join(known)}")
    for mode in args.compile:
        names += [f"{arm}@{mode}" for arm in chosen]
        pairs += [(f"{arm}@{mode}", f"sdpa@{mode}") for arm in chosen if arm != "sdpa"]
        if args.baseline_again and "sdpa" in chosen:
            names.append(f"sdpa@{mode}")
    arms = []
    for name in names:
        arm = run_arm(name, args)
        if any(a["arm"] == name for a in arms):
            arm["arm"] = f"{name} again"
        arms.append(arm)
    by = {a["arm"]: a for a in arms}
    baseline_ms = {}  # baseline arm -> the mean step its arms are compared with
    for name, arm in by.items():
        again = by.get(f"{name} again")
        if again is None or "error" in arm:
            continue
        if "error" not in again:
            arm["drift_of_the_baseline_again"] = again["mean_ms"] / arm["mean_ms"] - 1.0
            baseline_ms[name] = (arm["mean_ms"] + again["mean_ms"]) / 2
    for monitored, base in pairs:
        if monitored not in by or base not in by:
            continue
        a, b = by[monitored], by[base]
        if "error" in a or "error" in b:
            continue
        a["mean_overhead_vs_baseline"] = a["mean_ms"] / baseline_ms.get(base, b["mean_ms"]) - 1.0
        a["baseline_ms"] = baseline_ms.get(base, b["mean_ms"])
        if a["monitored_ms"] and a["unmonitored_ms"] and a["monitored_steps"] < a["steps"]:
            a["monitored_vs_unmonitored"] = a["monitored_ms"] / a["unmonitored_ms"] - 1.0
            a["monitored_vs_unmonitored_median"] = a["monitored_median_ms"] / a["unmonitored_median_ms"] - 1.0
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    mask = "" if args.mask == "none" else f", attention given a causal mask tensor ({args.mask})"
    print(f"{'tiny GPT' if args.tiny else 'GPT-2 small'}, batch {args.batch} x {args.seq}, bf16, {device_name}, "
          f"torch {torch.__version__}{mask}")
    print(f"{'arm':28s} {'mean ms':>8s} {'median':>8s} {'monitored':>10s} {'unmonitored':>12s} "
          f"{'vs baseline':>12s} {'mon vs unmon':>13s} {'(medians)':>10s} {'host/step':>10s}")
    for a in arms:
        if "error" in a:
            print(f"{a['arm']:28s} failed: {a['error']}")
            continue
        over = a.get("mean_overhead_vs_baseline")
        rel = a.get("monitored_vs_unmonitored")
        rel_median = a.get("monitored_vs_unmonitored_median")
        print(f"{a['arm']:28s} {a['mean_ms']:8.2f} {a['median_ms']:8.2f} "
              f"{a['monitored_ms'] or float('nan'):10.2f} {a['unmonitored_ms'] or float('nan'):12.2f} "
              f"{'' if over is None else f'{100 * over:+.2f}%':>12s} {'' if rel is None else f'{100 * rel:+.1f}%':>13s}"
              f" {'' if rel_median is None else f'{100 * rel_median:+.1f}%':>10s}"
              f" {_fmt(a['host_enqueue_ms']['unmonitored']):>10s}"
              + (f"  graphs {a['unique_graphs']}, graph breaks {a['graph_breaks']}" if "unique_graphs" in a else "")
              + (f", CUDA-graph partitions {a['cudagraph_partitions']}, skipped {a['cudagraph_skips']}"
                 if a.get("cudagraph_partitions") or a.get("cudagraph_skips") else ""))
    for name, arm in by.items():
        if "drift_of_the_baseline_again" in arm:
            print(f"{name} again, after the other arms: {100 * arm['drift_of_the_baseline_again']:+.2f}% against its "
                  f"first run; 'vs baseline' is against the mean of the two ({baseline_ms[name]:.2f} ms)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "device": device_name, "torch": torch.__version__,
                       "arms": arms}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
