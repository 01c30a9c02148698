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
would otherwise count against every arm after the first. ``--interleave STEPS`` instead builds and
compiles each mode's arms first and then times them side by side, STEPS steps of one arm, then of the
next, the first arm of each round one further on, so that such a drift weighs on every arm alike
(``allocator`` is then the whole interleaved run's, marked ``all_arms``).

Each arm runs ``--warmup`` steps (compilation, first monitored step), then ``--steps`` timed
steps (CUDA events around every step, read once at the end, so timing adds no host sync).
Reported: mean step time, mean monitored / unmonitored step, and the overheads against the
aims: mean step <= 1% above its baseline, monitored step <= 10% above an unmonitored one
(by the means, and by the medians: with 6 monitored steps an arm, one slow step moves the
mean by points). The JSON also keeps, per arm, what tells a device-bound step from a
host-bound one and one arm's compiled code from another's:

- ``step_ms`` / ``step_monitored``: every timed step (device time between CUDA events) and
  whether it was monitored (where a slow unmonitored step sits: right after a monitored one?);
- ``min_coverage``: the lowest attention coverage of any layer at the arm's last monitored step
  (1.0: every attention call measured; None without a Monitor);
- ``step_sequence``: each timed step's place among all the timed steps of the process (which arm
  ran when: the device's drift over the run, the blocks of ``--interleave``);
- ``host_ms``: every timed step's host time (the loop's Python, launches included; a step whose
  host time reaches its device time is host-bound);
- ``host_enqueue_ms``: after the timed steps, ``--idle-start-steps`` more steps, each started on an idle
  device (synchronized first), host time to enqueue one whole step (unmonitored and monitored
  means): the host's own cost of a step, to compare with ``unmonitored_ms``;
- ``allocator``: the CUDA caching allocator's retries, device allocations and frees during the
  timed steps, and the peak memory (each arm starts from a collected, emptied cache);
- ``generated_code``: a short hash of each module Inductor generated for the arm (two arms with
  the same hashes ran the same compiled code); ``unique_graphs``: the graphs Dynamo compiled for
  it (0 for an arm served by code compiled for another arm of the same model class, as the two
  own-kernel arms are side by side: their steps differ only in the Monitor's flag, read at run time);
- ``triton_compiles_timed``: the Triton kernels compiled (for a specialisation not seen before) while the
  arm's timed steps ran, each a host stall of up to a second in its step; listed under the table too;
- ``gc_pauses_timed``: Python's garbage collections during the arm's timed steps, [step, generation, ms]
  for every full (generation 2) collection and every one of 1 ms or more (those of 10 ms or more listed
  under the table): a full collection in a process holding a compiler's caches stalls the host;
- ``host_stalls`` (with ``--stall-stacks MS``): for every timed step whose host time reached MS, the
  main thread's Python stacks sampled every 5 ms while it ran (a thread beside the loop), the most
  frequent first, [count, innermost frames]: where the host was when a step stalled.

    python benchmarks/monitor_overhead.py --json monitor_overhead.json
    python benchmarks/monitor_overhead.py --compile default max-autotune-no-cudagraphs --json compiled.json
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import hashlib
import itertools
import json
import statistics
import sys
import threading
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


class _Unattached(GPT):
    """The same model under its own class, for the arms without a Monitor. Compiled in one process
    beside a GPT a Monitor is attached to (``--interleave``), the two could share compiled code where
    flashwatch cannot tell its attention modules apart for Dynamo: ``--mask`` gives every arm's
    attention modules a ``forward`` of their own (the same function), which flashwatch leaves as it
    is (``routing._OwnForward``). Another class is guarded apart (the compiled code is the same)."""


class _HostEvent:
    """A host-clock stand-in for torch.cuda.Event on the CPU."""

    def record(self):
        self.t = time.perf_counter()

    def elapsed_time(self, end) -> float:
        return (end.t - self.t) * 1e3


def run_arm(name: str, args) -> dict:
    """One arm alone: warm-up, timed steps, then steps from an idle device. A compiled arm that
    raises is reported with its error instead of stopping the run."""
    compiled = "@" in name
    if compiled:
        torch._dynamo.reset()
    try:
        arm = _Arm(name, args)
        with arm.route, _Compiled(arm):
            arm.run(args.warmup, timed=False)
            allocator_before = _allocator_counts(args.device)
            arm.run(args.steps)
            arm.allocator = _allocator_delta(args.device, allocator_before)
            arm.enqueue_from_idle(args.idle_start_steps)
        return arm.result()
    except Exception as exc:  # noqa: BLE001 - a benchmark reports what failed and goes on
        if not compiled:
            raise
        return _failed(name, exc)


def run_interleaved(names: list[str], args) -> list[dict]:
    """The compiled arms ``names`` side by side in one process: each built and compiled first, then
    timed ``args.interleave`` steps at a time in turn, the first arm of each round one further on
    (round r starts with arm r mod n), until each has run ``args.steps``. A device that speeds up or
    slows down during the run then weighs on every arm alike. An arm that fails is reported with its
    error and left out of the rounds."""
    torch._dynamo.reset()
    arms, failed = [], {}
    for name in names:  # every Monitor attached before anything compiles: a later attach would recompile the others
        try:
            arms.append(_Arm(name, args))
        except Exception as exc:  # noqa: BLE001
            failed[name] = _failed(name, exc)
    for arm in arms:
        try:
            with _Compiled(arm):
                arm.run(args.warmup, timed=False)
        except Exception as exc:  # noqa: BLE001
            arm.error = exc
    allocator_before = _allocator_counts(args.device)
    done = 0
    for r in range(-(-args.steps // args.interleave)):
        block = min(args.interleave, args.steps - done)
        for i in range(len(arms)):
            arm = arms[(r + i) % len(arms)]
            if arm.error is None:
                try:
                    with _Compiled(arm):
                        arm.run(block)
                except Exception as exc:  # noqa: BLE001
                    arm.error = exc
        done += block
    allocator = _allocator_delta(args.device, allocator_before)
    results = dict(failed)
    for arm in arms:
        if arm.error is not None:
            results[arm.label] = _failed(arm.label, arm.error)
            continue
        arm.allocator = {**allocator, "all_arms": True}  # one allocator for the arms that ran side by side
        arm.enqueue_from_idle(args.idle_start_steps)
        results[arm.label] = arm.result()
        results[arm.label]["interleaved_steps"] = args.interleave
    return [results[name] for name in names]


def _failed(name: str, exc: BaseException) -> dict:
    return {"arm": name, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"}


class _Compiled:
    """Around a block of a compiled arm's steps: what Dynamo and Inductor did in it, added to the
    arm's own counts (graph breaks, graphs, CUDA-graph partitions and skips) and generated modules,
    so that arms run side by side each get their own."""

    def __init__(self, arm: "_Arm"):
        self.arm = arm

    def __enter__(self):
        from torch._dynamo.utils import counters

        self.before = _compile_counts(counters)
        self.modules = _generated_modules()
        self.paths = self.modules.__enter__()
        return self

    def __exit__(self, *exc):
        from torch._dynamo.utils import counters

        self.modules.__exit__(*exc)
        after = _compile_counts(counters)
        for key, value in after.items():
            self.arm.compile_counts[key] = self.arm.compile_counts.get(key, 0) + value - self.before[key]
        self.arm.generated.update(self.paths)
        return False


def _compile_counts(counters) -> dict:
    # under CUDA graphs (mode="reduce-overhead"): the pieces Inductor cut its graphs into around operators that
    # must run outside a graph, and the graphs it ran without CUDA graphs (0 and 0 in the other modes)
    return {"graph_breaks": sum(counters["graph_break"].values()), "unique_graphs": counters["stats"]["unique_graphs"],
            "cudagraph_partitions": counters["inductor"]["cudagraph_partitions"],
            "cudagraph_skips": counters["inductor"]["cudagraph_skips"]}


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


_TIMED = itertools.count()  # the process's timed steps, in the order they ran (every arm's)


class _TritonCompiles:
    """Triton's compilations while timed steps run: the JIT's hook for a kernel it has no compilation
    of in this process (``knobs.runtime.jit_cache_hook``), chained to any hook already set."""

    def __init__(self):
        self.into: list | None = None  # the timed arm's list while its steps run
        self.chained = None

    def install(self) -> None:
        try:
            from triton import knobs
        except ImportError:  # no Triton: nothing compiles
            return
        if knobs.runtime.jit_cache_hook != self._hook:  # once: main() may run again in one process
            self.chained = knobs.runtime.jit_cache_hook
            knobs.runtime.jit_cache_hook = self._hook

    def _hook(self, *args, **kwargs):
        if self.into is not None:
            self.into.append(str(kwargs.get("repr", "?")).split("[")[0])
        return self.chained(*args, **kwargs) if self.chained is not None else False

    @contextlib.contextmanager
    def timing(self, into: list):
        self.into = into
        try:
            yield
        finally:
            self.into = None


_TRITON_COMPILES = _TritonCompiles()


class _GcPauses:
    """Python's garbage collections while timed steps run (``gc.callbacks``): [timed step of the arm,
    generation, ms] for every collection of generation 2 or of 1 ms or more; a full collection of a
    process holding a compiler's caches can stall the host for a large part of a second."""

    def __init__(self):
        self.into: list | None = None  # the timed arm's list while its steps run
        self.step = lambda: -1  # the timed arm's current step
        self.started = 0.0

    def install(self) -> None:
        if self._callback not in gc.callbacks:  # once: main() may run again in one process
            gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self.started = time.perf_counter()
        elif self.into is not None:
            ms = (time.perf_counter() - self.started) * 1e3
            if info["generation"] == 2 or ms >= 1.0:
                self.into.append([self.step(), info["generation"], round(ms, 3)])

    @contextlib.contextmanager
    def timing(self, into: list, step):
        self.into, self.step = into, step
        try:
            yield
        finally:
            self.into, self.step = None, lambda: -1


_GC_PAUSES = _GcPauses()


class _StackSampler:
    """The main thread's Python stack every ``period`` seconds, from a daemon thread, kept for the
    last few seconds: ``during(t0, t1)`` gives the stacks sampled between two host times, counted
    (a stalled step's host time is where to look). Off until ``start``."""

    def __init__(self, period: float = 0.005, keep: float = 5.0, depth: int = 12):
        self.period, self.keep, self.depth = period, keep, depth
        self.samples: list = []  # (host time, innermost frames first), appended by the sampler thread
        self.lock = threading.Lock()
        self.stopped = threading.Event()
        self.thread = None

    def start(self) -> None:
        if self.thread is None or not self.thread.is_alive():
            self.stopped.clear()
            main = threading.main_thread().ident
            self.thread = threading.Thread(target=self._run, args=(main,), daemon=True, name="stack-sampler")
            self.thread.start()

    def stop(self) -> None:
        self.stopped.set()
        if self.thread is not None:
            self.thread.join()

    def _run(self, main: int) -> None:
        while not self.stopped.wait(self.period):
            frame = sys._current_frames().get(main)
            now, stack = time.perf_counter(), []
            while frame is not None and len(stack) < self.depth:
                code = frame.f_code
                stack.append(f"{code.co_filename.rsplit('/', 2)[-1]}:{frame.f_lineno} {code.co_name}")
                frame = frame.f_back
            with self.lock:
                self.samples.append((now, tuple(stack)))
                if self.samples[0][0] < now - self.keep:
                    self.samples = [x for x in self.samples if x[0] >= now - self.keep]

    def during(self, t0: float, t1: float) -> list:
        """[count, frames] of the stacks sampled between host times t0 and t1, the most frequent first."""
        with self.lock:
            stacks = [stack for t, stack in self.samples if t0 <= t <= t1]
        counts: dict = {}
        for stack in stacks:
            counts[stack] = counts.get(stack, 0) + 1
        return sorted(([n, list(stack)] for stack, n in counts.items()), key=lambda x: -x[0])


_STACKS = _StackSampler()


class _Arm:
    """One arm's model, optimizer, data and Monitor (``label``: ``<arm>`` or ``<arm>@<compile mode>``),
    run a block of steps at a time: ``run`` times each step with a pair of CUDA events (read once, in
    ``result``: timing adds no host sync) and its host time."""

    def __init__(self, label: str, args):
        self.label = label
        name, _, compile_mode = label.partition("@")
        dev = self.dev = args.device
        gc.collect()  # the previous arm's model, optimizer and compiled code: freed before this one starts
        if dev == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        torch.manual_seed(0)
        if args.tiny:  # a CPU smoke test of this script
            cfg = GPTConfig(block_size=args.seq, vocab_size=256, n_layer=2, n_head=2, n_embd=128, bias=True)
        else:
            cfg = GPTConfig(block_size=args.seq, vocab_size=50304, n_layer=12, n_head=12, n_embd=768, bias=True)
        self.model = model = (_Unattached if name in ("sdpa", "flashwatch") else GPT)(cfg).to(dev)
        if args.mask != "none":
            _pass_causal_mask(model, dropout_p=0.1 if args.mask == "causal-dropout" else 0.0)
        self.opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1,
                                     fused=dev == "cuda")
        g = torch.Generator(device=dev).manual_seed(0)
        self.batches = [torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), device=dev, generator=g)
                        for _ in range(8)]
        monitor = None
        self.route = contextlib.nullcontext()
        if name == "sdpa+observe":
            monitor = Monitor(MonitorConfig(mode="observe", interval=args.interval))
        elif name == "sdpa+observe_no_chain":
            monitor = Monitor(MonitorConfig(mode="observe", interval=args.interval, wq_error_chain=False))
        elif name == "flashwatch":
            self.route = flashwatch_attention()
        elif name == "flashwatch+own_kernel" or name == "own_kernel+monitor":
            monitor = Monitor(MonitorConfig(mode="own_kernel", interval=args.interval))
        elif name == "own_kernel":  # flashwatch's kernel; step 0 (warm-up) is its only monitored step
            monitor = Monitor(MonitorConfig(mode="own_kernel", interval=10**9))
        if monitor is not None:
            monitor.attach(model)
        self.monitor = monitor
        self.run_model = model
        if compile_mode:
            self.run_model = torch.compile(model, mode=None if compile_mode == "default" else compile_mode,
                                           backend=args.backend)
        self.steps_run = 0
        self.events: list = []  # (start, end) of every timed step
        self.monitored: list[bool] = []
        self.sequence: list[int] = []  # each timed step's place among the process's timed steps
        self.triton_compiles: list[str] = []  # Triton kernels compiled during the timed steps (_TritonCompiles)
        self.gc_pauses: list[list] = []  # garbage collections during the timed steps (_GcPauses)
        self.stall_ms = args.stall_stacks  # a timed step's host time from which its stacks are kept (0: off)
        self.stalls: list[dict] = []  # such steps: their host time and stacks (_StackSampler)
        self.host: list[float] = []
        self.idle: dict[bool, list[float]] = {True: [], False: []}
        self.allocator: dict = {}
        self.compile_counts: dict = {}
        self.generated: set = set()
        self.error: BaseException | None = None
        self.loss = None

    def _event_pair(self):
        if self.dev == "cuda":
            return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        return _HostEvent(), _HostEvent()

    def _one_step(self, event_pair=None):
        xb = self.batches[self.steps_run % len(self.batches)]
        self.steps_run += 1
        if event_pair is not None:
            event_pair[0].record()
        with torch.autocast(self.dev, dtype=torch.bfloat16):
            _, loss = self.run_model(xb[:, :-1], xb[:, 1:])
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if self.monitor is not None:
            self.monitor.step(loss=loss.detach(), grad_norm=norm)
        if event_pair is not None:
            event_pair[1].record()
        self.loss = loss
        return loss

    def run(self, steps: int, timed: bool = True) -> None:
        """``steps`` training steps, each timed (``timed``) or not (the warm-up)."""
        pairs = [self._event_pair() for _ in range(steps)] if timed else [None] * steps
        with contextlib.ExitStack() as during:
            if timed:
                during.enter_context(_TRITON_COMPILES.timing(self.triton_compiles))
                during.enter_context(_GC_PAUSES.timing(self.gc_pauses, lambda: len(self.host)))
            self._steps(pairs, timed)
        if not timed and self.dev == "cuda":
            torch.cuda.synchronize()

    def _steps(self, pairs: list, timed: bool) -> None:
        for pair in pairs:
            monitored = self.monitor is not None and self.monitor.monitoring
            t0 = time.perf_counter()
            self._one_step(pair)
            if timed:
                t1 = time.perf_counter()
                self.host.append((t1 - t0) * 1e3)
                if self.stall_ms and (t1 - t0) * 1e3 >= self.stall_ms:
                    self.stalls.append({"step": len(self.host) - 1, "monitored": monitored,
                                        "host_ms": round((t1 - t0) * 1e3, 2), "stacks": _STACKS.during(t0, t1)})
                self.monitored.append(monitored)
                self.events.append(pair)
                self.sequence.append(next(_TIMED))

    def enqueue_from_idle(self, steps: int) -> None:
        """The host's own cost of a step: ``steps`` more, each started on an idle device."""
        for _ in range(steps):
            is_monitored = self.monitor is not None and self.monitor.monitoring
            if self.dev == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            self._one_step()
            self.idle[is_monitored].append((time.perf_counter() - t0) * 1e3)
        if self.dev == "cuda":
            torch.cuda.synchronize()

    def result(self) -> dict:
        """The arm's timings (see the module docstring); detaches and closes its Monitor."""
        if self.dev == "cuda":
            torch.cuda.synchronize()
            self.allocator["peak_allocated_gb"] = torch.cuda.max_memory_allocated() / 2**30
        times = [s.elapsed_time(e) for s, e in self.events]
        flags = self.monitored
        mon = [t for t, f in zip(times, flags) if f]
        unmon = [t for t, f in zip(times, flags) if not f]
        coverage = None
        if self.monitor is not None:
            self.monitor.flush()
            coverage = min(self.monitor.snapshot().get("flashwatch_attention_coverage", {}).values(), default=None)
            self.monitor.detach()
            self.monitor.close()
        idle = self.idle
        out = {"arm": self.label, "mean_ms": statistics.mean(times), "median_ms": statistics.median(times),
               "monitored_ms": statistics.mean(mon) if mon else None,
               "unmonitored_ms": statistics.mean(unmon) if unmon else None,
               "monitored_median_ms": statistics.median(mon) if mon else None,
               "unmonitored_median_ms": statistics.median(unmon) if unmon else None, "steps": len(times),
               "monitored_steps": len(mon), "final_loss": float(self.loss.detach()),
               "step_ms": times, "step_monitored": flags, "step_sequence": self.sequence, "host_ms": self.host,
               "host_enqueue_ms": {"unmonitored": statistics.mean(idle[False]) if idle[False] else None,
                                   "monitored": statistics.mean(idle[True]) if idle[True] else None},
               "allocator": self.allocator, "min_coverage": coverage, "triton_compiles_timed": self.triton_compiles,
               "gc_pauses_timed": self.gc_pauses}
        if self.stall_ms:
            out["host_stalls"] = self.stalls
        if "@" in self.label:
            out["generated_code"] = _code_hashes(self.generated)
            out.update(self.compile_counts)
        return out


def _allocator_delta(dev: str, before: dict) -> dict:
    """The allocator's retries, device allocations and frees since ``before`` (after a sync)."""
    if dev == "cuda":
        torch.cuda.synchronize()
    return {k: v - before.get(k, 0) for k, v in _allocator_counts(dev).items()}


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
    p.add_argument("--interleave", type=int, default=0, metavar="STEPS",
                   help="run each compiled mode's arms side by side, STEPS timed steps at a time in turn (a multiple "
                        "of --interval keeps each block's share of monitored steps equal): a device that drifts "
                        "during the run then weighs on every arm alike; 0 (default): one arm after another")
    p.add_argument("--mask", choices=("none", "causal", "causal-dense", "causal-dropout"), default="none",
                   help="causal: the attention is given its causal mask as a tensor (Hugging Face under compile); "
                        "causal-dense: the same, with the statistics' plain-pass shortcut for such masks off; "
                        "causal-dropout: the mask with attention dropout 0.1")
    p.add_argument("--stall-stacks", type=float, default=0.0, metavar="MS",
                   help="sample the main thread's Python stack every 5 ms and keep, for every timed step whose host "
                        "time reaches MS, the stacks sampled during it (JSON host_stalls; 0, the default: off)")
    args = p.parse_args(argv)
    if args.stall_stacks < 0:
        p.error(f"--stall-stacks takes a host time in ms >= 0 (0: off), got {args.stall_stacks}")
    if args.interleave < 0:
        p.error(f"--interleave takes a number of steps >= 0, got {args.interleave}")
    if args.interleave and args.baseline_again:
        p.error("--interleave and --baseline-again: choose one (arms run side by side need no second baseline)")
    if args.mask == "causal-dense":  # every masked call through the dense pass, as before the shortcut
        from flashwatch.kernels import masked

        masked._plain_equivalent = lambda attn_mask, n, read=None: None
    if args.device == "cuda" and not torch.cuda.is_available():
        print("needs CUDA (or --device cpu --tiny for a smoke test)")
        return 2
    _TRITON_COMPILES.install()
    _GC_PAUSES.install()
    if args.stall_stacks:
        _STACKS.start()
    try:
        return _run(args, p)
    finally:
        _STACKS.stop()


def _run(args, p) -> int:
    names = [] if args.only_compiled else ["sdpa", "sdpa+observe", "sdpa+observe_no_chain", "flashwatch",
                                           "flashwatch+own_kernel"]
    pairs = [] if args.only_compiled else [("sdpa+observe", "sdpa"), ("sdpa+observe_no_chain", "sdpa"),
                                           ("flashwatch+own_kernel", "flashwatch")]
    chosen = [a for a in args.arms.split(",") if a]
    known = ("sdpa", "sdpa+observe", "sdpa+observe_no_chain", "own_kernel", "own_kernel+monitor")
    unknown = set(chosen) - set(known)
    if unknown:
        p.error(f"--arms: unknown {sorted(unknown)}; choose from {', '.join(known)}")
    side_by_side = []  # per compile mode, its arms when they run interleaved
    for mode in args.compile:
        these = [f"{arm}@{mode}" for arm in chosen]
        pairs += [(f"{arm}@{mode}", f"sdpa@{mode}") for arm in chosen if arm != "sdpa"]
        if args.interleave:
            side_by_side.append(these)
            continue
        names += these
        if args.baseline_again and "sdpa" in chosen:
            names.append(f"sdpa@{mode}")
    arms = []
    for name in names:
        arm = run_arm(name, args)
        if any(a["arm"] == name for a in arms):
            arm["arm"] = f"{name} again"
        arms.append(arm)
    for these in side_by_side:
        arms += run_interleaved(these, args)
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
                 if a.get("cudagraph_partitions") or a.get("cudagraph_skips") else "")
              + (f", LOWEST LAYER COVERAGE {a['min_coverage']:.2f}"
                 if a.get("min_coverage") not in (None, 1.0) else ""))
    for a in arms:
        if a.get("triton_compiles_timed"):
            print(f"{a['arm']}: Triton compiled {len(a['triton_compiles_timed'])} kernel(s) during its timed steps "
                  f"({', '.join(sorted(set(a['triton_compiles_timed'])))}): a host stall in each step it fell in")
        long = [p for p in a.get("gc_pauses_timed", []) if p[2] >= 10]
        if long:
            print(f"{a['arm']}: Python's garbage collection paused the host 10 ms or more during its timed steps: "
                  + ", ".join(f"step {step} (generation {gen}, {ms:.0f} ms)" for step, gen, ms in long))
        for stall in a.get("host_stalls", []):
            top = stall["stacks"][0] if stall["stacks"] else [0, ["(no sample)"]]
            print(f"{a['arm']}: step {stall['step']}{' (monitored)' if stall['monitored'] else ''} held the host "
                  f"{stall['host_ms']:.0f} ms; most sampled ({top[0]} of {sum(n for n, _ in stall['stacks'])}): "
                  + " < ".join(top[1][:4]))
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
