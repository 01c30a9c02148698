"""One run in its own process: train the arm's recipe with the Monitor attached, record, stop.

Started by the runner as ``python -m research.experiments.worker --spec SPEC.json`` (the spec
is a JSON file the runner writes in the run folder); runnable by hand the same way. Exit codes:
0 the run finished (healthy, blown up, or stopped by a bound), 1 it failed (``run.json`` has
the error and traceback), 3 the device it needs is missing.

The loop (a plain PyTorch loop):

    batch (seeded per seed) -> forward (BF16 autocast, or FP32, or FP32 with BF16 attention)
    -> backward -> grad norm (before clipping) -> clip -> AdamW step -> monitor.step(loss, norm)

Every step's loss and gradient norm stay on the device and are read in one transfer every
``flush_every`` steps (no per-step host sync); the blow-up rule (``flashwatch.replay.blowup``)
runs on them then, so a run stops at most ``flush_every`` steps after its blow-up is confirmed.
A monitored step is recorded from the Monitor's public readings once the Monitor has decided it:
right after its own ``monitor.step`` on the CPU, at the next ``monitor.step`` on CUDA (where
``async_transfer`` decides a monitored step one optimizer step later), with the variants its
layers ran at that step and the alerts its decision raised; the last one is decided by
``monitor.flush()`` at the end. (Older recordings held, on CUDA, the previous monitored step's
readings in each line: ``flashwatch.replay.playback.load_records`` corrects them.)

Set-ups done before the Monitor attaches (so it keeps them as "the model's attention"):

- ``attention == "paper"``: ``torch.nn.functional.scaled_dot_product_attention`` is replaced by
  a shim that runs ``flashwatch.kernels.paper.paper_attention`` (the paper's all-BF16 tiled
  numerics, tile 512) for causal self-attention calls; observe mode then measures that kernel.
- ``attention == "format"``: the same with ``research.format_attention`` (P_bar and V in the
  arm's ``format`` for the P_bar V product, variant ``format_variant``).
- ``inject > 0`` (INJECTED fault): the process-wide rounding bias of ``flashwatch.kernels.faults``
  is set to ``inject``, so every own-kernel attention call of this process carries the fault
  (the ``fixed`` variant disarms it by construction: its P_bar stay below 1).

SIGTERM or SIGINT ends the run cleanly at the next step (status "killed"), with its recordings.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import signal
import sys
import time
import traceback
from collections import deque
from pathlib import Path

__all__ = ["main", "run"]

FLUSH_EVERY = 50
CHECKPOINT_FILE = "checkpoint.pt"  # a paused run's state (spec "checkpoint": true), removed when it ends


def _versions() -> dict:
    import torch

    out = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda}
    try:
        import triton

        out["triton"] = triton.__version__
    except Exception:
        out["triton"] = None
    import flashwatch

    out["flashwatch"] = flashwatch.__version__
    out["flashwatch_path"] = str(Path(flashwatch.__file__).resolve().parent)  # which copy of the code ran
    root = Path(__file__).resolve().parents[2]
    pinned = root / "CODE_COMMIT"  # written beside a `git archive` copy (research/gpu_batch.sh), which has no .git
    if pinned.is_file():
        out["git_commit"] = pinned.read_text().strip() or None
        return out
    try:
        import subprocess

        out["git_commit"] = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                                           text=True, timeout=5).stdout.strip() or None
    except Exception:
        out["git_commit"] = None
    return out


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return f"{line.split(':', 1)[1].strip()} ({os.cpu_count()} CPUs)"
    except OSError:
        pass
    return platform.processor() or platform.machine()


def install_paper_sdpa():
    """Replace ``F.scaled_dot_product_attention`` by the paper's all-BF16 attention; returns an undo function.

    Calls the emulation cannot take (a mask, dropout, query and key lengths that differ) go to
    the SDPA that was there before.
    """
    import torch
    import torch.nn.functional as F

    from flashwatch.kernels.paper import paper_attention

    original = F.scaled_dot_product_attention

    def paper_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if attn_mask is not None or dropout_p or query.shape[-2] != key.shape[-2] or query.shape[1] != key.shape[1]:
            return original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                            scale=scale, enable_gqa=enable_gqa)
        dev = query.device.type
        dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else query.dtype
        return paper_attention(query.to(dtype), key.to(dtype), value.to(dtype), causal=bool(is_causal),
                               sm_scale=scale)

    F.scaled_dot_product_attention = paper_sdpa

    def undo():
        if F.scaled_dot_product_attention is paper_sdpa:
            F.scaled_dot_product_attention = original

    return undo


def install_injection(strength: float):
    """INJECTED FAULT: every ``flashwatch.kernels.flash_attention`` call of this process carries
    the rounding bias (``flashwatch.kernels.faults``). Returns an undo function. For experiments only.
    """
    from flashwatch.kernels import faults

    previous = faults.rounding_bias_strength()
    faults.set_rounding_bias(strength)
    return lambda: faults.set_rounding_bias(previous)


def _check_first_monitored_step(monitor) -> None:
    """Fail loudly rather than record a run that measures nothing or silently runs SDPA.

    A failure inside monitoring never stops training (the Monitor counts it and, in own_kernel
    mode, falls back to SDPA): right for a user, wrong for an experiment whose arm is the kernel.
    """
    if monitor.errors:
        raise RuntimeError(f"the Monitor failed {monitor.errors} time(s) in the first monitored step (own kernel "
                           "or statistics pass; the traceback is above in this log): the arm would not measure "
                           "or run what it says")
    rows = monitor.signals()["rows"]
    unseen = sorted({layer for (layer, _), r in rows.items() if not r > 0})
    if unseen:
        raise RuntimeError(f"the Monitor measured no attention call in layers {unseen} at the first monitored step")


class _Stop:
    def __init__(self):
        self.signal: int | None = None

    def __call__(self, signum, frame):
        self.signal = signum


def run(spec: dict) -> int:
    """Train one run described by ``spec`` (a ``runner.RunSpec`` as a dict); returns the exit code."""
    import torch

    from flashwatch import Monitor, MonitorConfig
    from flashwatch.replay.blowup import BlowupTracker
    from flashwatch.replay.records import RUN_FILE, SignalsWriter, StepsWriter, read_run, write_json_atomic
    from flashwatch.tinygpt import stdlib_corpus

    from .model import ExperimentGPT
    from .scenarios import learning_rate

    run_dir = Path(spec["run_dir"])
    run_dir.mkdir(parents=True, exist_ok=True)
    ckpt_path = run_dir / CHECKPOINT_FILE
    resume = bool(spec.get("checkpoint")) and ckpt_path.exists()
    if not resume:
        for stale in ("steps.csv", "signals.jsonl", "signals.jsonl.gz", CHECKPOINT_FILE):
            (run_dir / stale).unlink(missing_ok=True)
    recipe, arm = spec["recipe"], spec["arm"]
    info = {**spec, "status": "starting", "pid": os.getpid(), "started": time.time(), "versions": _versions(),
            "label": spec.get("label", arm["name"])}
    if resume:
        earlier = read_run(run_dir)
        info["pieces"] = earlier.get("pieces", []) + [{k: earlier.get(k) for k in ("started", "steps_done", "wall_s",
                                                                                    "versions", "device_name")}]
    write_json_atomic(run_dir / RUN_FILE, info)

    device = spec["device"]
    if device == "cuda" and not torch.cuda.is_available():
        info.update(status="error", error="this arm needs CUDA and torch.cuda.is_available() is False")
        write_json_atomic(run_dir / RUN_FILE, info)
        print(info["error"], file=sys.stderr)
        return 3
    stop = _Stop()
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    undo = []
    steps_w = signals_w = monitor = None
    t_start = time.monotonic()
    step = 0
    try:
        if spec.get("threads"):
            torch.set_num_threads(int(spec["threads"]))
        fp32 = arm["precision"] == "fp32"
        if device == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = not fp32  # TF32 off in the FP32 control
            torch.backends.cudnn.allow_tf32 = not fp32
            info["device_name"] = torch.cuda.get_device_name(0)
        else:
            info["device_name"] = _cpu_name()
        seed = int(spec["seed"])
        torch.manual_seed(seed)
        data = stdlib_corpus(int(recipe["corpus_bytes"]))
        dev = torch.device(device)
        data_dev = data.to(dev)
        model = ExperimentGPT(recipe["n_layer"], recipe["n_head"], recipe["n_embd"], recipe["block_size"],
                         attn_dtype=torch.bfloat16 if arm["precision"] == "bf16_attention" else None).to(dev)
        if arm["attention"] == "paper":
            undo.append(install_paper_sdpa())
        if arm["attention"] == "format":
            from research.format_attention import install_format_sdpa

            undo.append(install_format_sdpa(arm["format"], arm["format_variant"], arm.get("format_v", "format")))
        if arm.get("inject"):
            undo.append(install_injection(float(arm["inject"])))
        config = MonitorConfig(**{**arm.get("monitor", {}), "interval": int(recipe["interval"]),
                                  **spec.get("monitor_overrides", {})})
        monitor = Monitor(config)
        layers = monitor.attach(model)
        info["monitor_config"] = config.to_dict()
        info["layers"] = [{"name": l.name, "heads": l.num_heads} for l in layers]
        opt = torch.optim.AdamW(model.parameters(), lr=recipe["lr"], betas=(recipe["beta1"], recipe["beta2"]),
                                weight_decay=recipe["weight_decay"], **({"fused": True} if device == "cuda" else {}))
        steps_w = StepsWriter(run_dir, append=resume)
        signals_w = SignalsWriter(run_dir, [l.num_heads for l in layers], append=resume)
        tracker = BlowupTracker()
        gen = torch.Generator().manual_seed(seed)
        first_step, elapsed_before = 0, 0.0
        if resume:  # continue exactly where the last piece stopped
            ckpt = torch.load(ckpt_path, map_location=dev, weights_only=False)
            model.load_state_dict(ckpt["model"])
            opt.load_state_dict(ckpt["optimizer"])
            monitor.load_state_dict(ckpt["monitor"])
            gen.set_state(ckpt["generator"].cpu())  # a CPU generator: map_location moved its state
            tracker.__dict__.update(ckpt["tracker"])
            first_step, elapsed_before = int(ckpt["step"]), float(ckpt["elapsed_s"])
        T, B = int(recipe["block_size"]), int(recipe["batch_size"])
        offsets = torch.arange(T + 1, device=dev)
        autocast = arm["precision"] == "bf16"
        max_steps, max_seconds = int(spec["max_steps"]), float(spec["max_seconds"])
        after_blowup = int(spec.get("after_blowup", 0))  # steps to keep training past a confirmed blow-up
        piece_steps = int(spec.get("piece_steps") or 0)  # stop this piece after so many steps (tests; 0: no bound)
        flush_every = int(spec.get("flush_every", FLUSH_EVERY))
        pending: list = []  # (step, loss tensor, grad-norm tensor, lr, time)
        info["status"] = "running"
        write_json_atomic(run_dir / RUN_FILE, info)
        status = "completed"
        paused_from = None
        t0 = time.monotonic() - elapsed_before

        waiting: deque = deque()  # monitored steps not decided yet: (step, variants, low_precision, errors before)

        def record_decided(decided_before: int, alerts) -> None:
            """Record the monitored steps the last Monitor call decided (0 or 1; in order)."""
            for index in range(decided_before, monitor.monitored_steps):
                t, variants, low_precision, errors = waiting.popleft()
                signals_w.write(t, index, monitor, alerts, monitor.errors != errors, variants, low_precision)
                if index == 0:
                    _check_first_monitored_step(monitor)

        def flush() -> bool:
            """Write the pending steps; True once the blow-up is confirmed."""
            if not pending:
                return tracker.blowup is not None
            vals = torch.stack([torch.stack([l.float(), g.float()]) for _, l, g, _, _ in pending]).cpu().tolist()
            rows = [(s, lv, gv, lr, t) for (s, _, _, lr, t), (lv, gv) in zip(pending, vals)]
            steps_w.write(rows)
            pending.clear()
            for s, lv, *_ in rows:
                if tracker.update(s, lv) is not None:
                    return True
            return False

        step = first_step
        end = max_steps
        for step in range(first_step, 10**9):
            if step >= end:
                step -= 1
                break
            lr = learning_rate(recipe, step)
            for group in opt.param_groups:
                group["lr"] = lr
            ix = torch.randint(data.numel() - T - 1, (B,), generator=gen).to(dev)
            window = data_dev[ix.unsqueeze(1) + offsets].long()  # (B, T+1)
            x, y = window[:, :-1], window[:, 1:]
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=autocast):
                loss = model(x, y)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), recipe["clip"])
            opt.step()
            opt.zero_grad(set_to_none=True)
            if monitor.monitoring:  # what this monitored step runs, recorded once it is decided
                waiting.append((step, [l.variant for l in monitor.layers], [l.low_precision for l in monitor.layers],
                                monitor.errors))
            decided = monitor.monitored_steps
            alerts = monitor.step(loss=loss.detach(), grad_norm=grad_norm)
            record_decided(decided, alerts)
            pending.append((step, loss.detach(), grad_norm.detach(), lr, time.monotonic() - t0))
            last = step == end - 1
            if len(pending) >= flush_every or last:
                if flush() and status != "blown_up":
                    status = "blown_up"
                    # run past it to confirm it is sustained: to confirmation + after_blowup (or stop now)
                    end = max(step + 1, tracker.confirmed_at + after_blowup + 1) if after_blowup else step + 1
                    if step + 1 >= end:
                        break
            piece_over = piece_steps and step + 1 - first_step >= piece_steps
            if stop.signal is not None or time.monotonic() - t_start > max_seconds or piece_over:
                if status != "blown_up" or step + 1 < end:
                    paused_from = status
                    status = "killed" if stop.signal is not None else "time_limit"
                break
        decided = monitor.monitored_steps
        record_decided(decided, monitor.flush())  # the last monitored step, if still on its way
        if flush() and status not in ("blown_up", "killed", "time_limit"):
            status = "blown_up"
        if status in ("killed", "time_limit") and spec.get("checkpoint"):
            # a piece of a longer run: save everything the next piece needs, then say "paused"
            torch.save({"step": step + 1, "model": model.state_dict(), "optimizer": opt.state_dict(),
                        "monitor": monitor.state_dict(), "generator": gen.get_state(),
                        "tracker": dict(tracker.__dict__), "elapsed_s": time.monotonic() - t0,
                        "status_before": paused_from}, ckpt_path.with_suffix(".tmp"))
            os.replace(ckpt_path.with_suffix(".tmp"), ckpt_path)
            status = "paused"
        elif spec.get("checkpoint"):
            ckpt_path.unlink(missing_ok=True)
        wall = time.monotonic() - t0
        info.update(status=status, steps_done=step + 1, wall_s=round(wall, 2),
                    total_s=round(time.monotonic() - t_start, 2),
                    ms_per_step=round(1000 * wall / max(1, step + 1), 2), blowup_step=tracker.blowup,
                    blowup_confirmed_step=tracker.confirmed_at,
                    alerts=[a.to_dict() for a in monitor.alerts], switches=list(monitor.switches),
                    monitor_errors=monitor.errors, variants_final=monitor.variants)
        if device == "cuda":
            info["max_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        code = 0
    except Exception as exc:
        info.update(status="error", error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc(),
                    steps_done=step, total_s=round(time.monotonic() - t_start, 2))
        traceback.print_exc()
        code = 1
    finally:
        for closer in (steps_w, signals_w):
            if closer is not None:
                try:
                    if closer is signals_w:
                        closer.close(compress=info.get("status") != "paused")
                    else:
                        closer.close()
                except Exception:
                    traceback.print_exc()
        if monitor is not None:
            monitor.close()
            monitor.detach()
        for u in reversed(undo):
            u()
    info["finished"] = time.time()
    for a in info.get("alerts", []):
        for k in ("value", "threshold"):
            if not math.isfinite(a[k]):
                a[k] = str(a[k])
    write_json_atomic(run_dir / RUN_FILE, info)
    print(f"{spec['scenario']}/{arm['name']}/{spec['seed']}: {info['status']} after {info.get('steps_done')} steps "
          f"({info.get('ms_per_step')} ms/step), blow-up {info.get('blowup_step')}", flush=True)
    return code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m research.experiments.worker", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--spec", required=True, help="the run's spec (JSON), as the runner writes it")
    args = parser.parse_args(argv)
    with open(args.spec) as f:
        spec = json.load(f)
    return run(spec)


if __name__ == "__main__":
    sys.exit(main())
