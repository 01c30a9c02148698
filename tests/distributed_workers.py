"""Helpers of tests/test_distributed.py: the plain-PyTorch rank workers and the comparisons.

A module of its own, without Lightning, so that the processes the plain-PyTorch test spawns
import only torch and flashwatch (a few seconds less per process on a 2-core machine).
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import sys
import time
import traceback

import pytest
import torch

from same import assert_same
from flashwatch import Monitor, MonitorConfig
from flashwatch.kernels import STAT_FIELDS, AttentionStats
from flashwatch.tinygpt import GPT, GPTConfig, sample_batch, stdlib_corpus

LAYERS, HEADS = 2, 4
MAX_ROWS = AttentionStats.max_rows()
SUM_ROWS = [i for i in range(len(STAT_FIELDS)) if i not in MAX_ROWS]


def _free_ports(n: int = 1) -> int:
    """A base port p with p .. p+n-1 free now (for one endpoint per rank)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n > 65535:
            continue
        try:
            socks = []
            for i in range(n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", base + i))
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
        return base
    raise RuntimeError("no free ports")


def _rank_main(rank, fn, *args):
    """One rank: ``fn(rank, *args)``, then leave without the interpreter's shutdown. The CPU gloo
    backend can abort a rank in the C++ runtime at process exit, after all of its work ("terminate
    called without an active exception", SIGABRT; seen about once in three full test runs on a
    loaded 2-core machine, in different tests): the workers have saved what the tests read by then,
    so the exit code says only whether ``fn`` raised."""
    code = 1
    try:
        fn(rank, *args)
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        try:
            if torch.distributed.is_available() and torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()
        except Exception:
            traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _run_ranks(fn, args, *, nprocs=2, timeout=90.0):
    """Spawn ``fn(rank, *args)`` in ``nprocs`` processes; fail the test if one raises or they outlive
    ``timeout``."""
    import torch.multiprocessing as mp

    ctx = mp.start_processes(_rank_main, args=(fn, *args), nprocs=nprocs, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
        if time.monotonic() >= deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            pytest.fail(f"the {nprocs} ranks did not finish within {timeout:.0f} s (a hang in a collective?)")


def _tiny_gpt() -> GPT:
    torch.manual_seed(0)  # the same weights on every rank, as DDP makes them
    return GPT(GPTConfig(n_layer=LAYERS, n_head=HEADS, n_embd=64, block_size=32))


class _Messages(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


# --- plain PyTorch: the workers ------------------------------------------------------------------

def _reduced(monitor: Monitor) -> dict:
    r = monitor._reducer
    red = r.unpack(r.last_host)
    return {"local": r.split_local(r.last_local), "stats": red.stats, "sigma": red.sigma, "loss": red.loss,
            "grad_norm": red.grad_norm}


def _crafted(rank: int, scheme: str) -> dict:
    """Hand-made statistics: rank 1 alone sees a logit above the bound; its alert and switch must be everyone's."""
    model = _tiny_gpt()
    monitor = Monitor(MonitorConfig(interval=1, max_logit_bound=100.0, auto_fix="fp32_delta",
                                    auto_fix_on={"max_logit"}))
    monitor.attach(model)
    if scheme == "two":
        monitor._reducer.slot_bytes_limit = 0
    g = torch.Generator().manual_seed(100 + rank)
    for layer in monitor.layers:  # what the kernels would have added up on this rank
        st = layer.stats
        st.rows += 1000 * (rank + 1)
        st.repeated_max_rows += torch.randint(0, 50, (HEADS,), generator=g)
        st.repeated_max_rows_bf16 += torch.randint(0, 200, (HEADS,), generator=g)
        st.max_logit.copy_(torch.rand(HEADS, generator=g) * 10)
        for name in ("delta_error", "delta_error_abs", "delta_error_sq", "delta_error_tied"):
            getattr(st, name).copy_(torch.randn(HEADS, generator=g) * 1e-3)
    if rank == 1:
        monitor.layers[1].stats.max_logit[2] = 150.0
    alerts = monitor.step(loss=torch.tensor(1.0 + 2.0 * rank), grad_norm=torch.tensor(0.5))
    out = {"collectives": monitor._reducer.collectives, "alerts": [a.to_dict() for a in alerts],
           "switches": monitor.switches, "variants": monitor.variants, "snapshot": monitor.snapshot(),
           "errors": monitor.errors, **_reduced(monitor)}
    monitor.detach()
    return out


def _ddp_run(rank: int) -> dict:
    """A real DDP run, different data on each rank; the Monitor attached to the DDP wrapper."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    data = stdlib_corpus(100_000)
    model = DDP(_tiny_gpt())
    monitor = Monitor(MonitorConfig(interval=2, warmup=1, max_logit_bound=-1e3))
    monitor.attach(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    records = []
    for t in range(6):
        x, y = sample_batch(data, 4, 32, generator=torch.Generator().manual_seed(1000 * t + rank))
        loss = model(x, y)[1]
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        monitored = monitor.monitoring
        monitor.step(loss=loss.detach(), grad_norm=grad_norm)
        if monitored:
            records.append({"step": t, "snapshot": monitor.snapshot(), **_reduced(monitor)})
    out = {"records": records, "alerts": [a.to_dict() for a in monitor.alerts], "state": monitor.state_dict(),
           "errors": monitor.errors, "world_size": monitor.world_size, "rank": monitor.rank,
           "describe": monitor._reducer.describe()}
    monitor.detach()
    return out


def _ddp_scaled(rank: int) -> dict:
    """DDP with a loss scaler whose scale first overflows the gradients: the skipped steps are not
    measured on either rank (the skip is combined over the ranks), and nothing raises non_finite."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(_tiny_gpt())
    monitor = Monitor(MonitorConfig(interval=1, warmup=1))
    monitor.attach(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 126)
    delta = []
    for t in range(5):
        x = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(1000 * t + rank))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x, x)[1]
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        monitor.step(loss=loss.detach(), grad_scaler=scaler)
        delta.append(monitor.snapshot()["flashwatch_delta_error"])
    out = {"delta": delta, "scale": scaler.get_scale(), "non_finite": monitor.alert_counts["non_finite"],
           "errors": monitor.errors}
    monitor.detach()
    return out


def _repair(rank: int) -> dict:
    """Variants that differ between ranks (they cannot, short of a bug): every rank adopts the switched one."""
    monitor = Monitor(MonitorConfig(interval=1))
    monitor.attach(_tiny_gpt())
    if rank == 1:
        monitor.layers[0].mode, monitor.layers[0].variant = "own_kernel", "fixed"
    monitor.step()
    out = {"variants": monitor.variants, "modes": [layer.mode for layer in monitor.layers]}
    monitor.detach()
    return out


def _layout_mismatch(rank: int) -> str:
    """Rank 1 monitors one layer, rank 0 two: attach fails on both ranks, at attach, not at a later step."""
    monitor = Monitor(MonitorConfig(layers=[0] if rank == 1 else None))
    try:
        monitor.attach(_tiny_gpt())
    except ValueError as exc:
        assert monitor.layers == [] and monitor._reducer is None
        return str(exc)
    return "attached"


def _attach_refusals(rank: int) -> dict:
    """What makes every rank refuse to attach, alike: another layer selected on each rank (same head
    counts), another interval, an exporter that cannot open on rank 1 only, a saved state that rank 0
    alone resumes (the ranks at different steps). Each returns
    (exception type, message) per scenario; nothing stays attached."""
    from flashwatch.exporters.base import Exporter

    class Broken(Exporter):
        name = "broken"

        def open(self, layout):
            raise OSError("injected: cannot open on rank 1")

    lone = Monitor(MonitorConfig(), process_group=None)  # a state saved at step 7, which rank 0 alone resumes
    lone.attach(_tiny_gpt())
    for _ in range(7):
        lone.step()
    saved = lone.state_dict()
    lone.close()
    out = {}
    for name, config, exporters in (
            ("layers", MonitorConfig(layers=[rank]), []),
            ("interval", MonitorConfig(interval=2 + 2 * rank), []),
            ("exporter", MonitorConfig(), [Broken()] if rank == 1 else []),
            ("resumed on rank 0 alone", MonitorConfig(), [])):
        monitor = Monitor(config, exporters)
        if name.startswith("resumed") and rank == 0:
            monitor.load_state_dict(saved)
        try:
            monitor.attach(_tiny_gpt())
            out[name] = ("attached", "")
        except Exception as exc:
            assert monitor.layers == [] and monitor._reducer is None and monitor._router is None
            out[name] = (type(exc).__name__, str(exc))
    return out


def _fsdp2_failure(rank: int) -> dict:
    """Under FSDP2 rank 1 cannot read its statistics at step 0: the power iteration on the shards still
    runs its collectives on every rank, both ranks skip the step, and step 1 works (before: rank 1
    skipped those collectives and gloo aborted the job on the mismatch)."""
    from torch.distributed.fsdp import fully_shard

    data = stdlib_corpus(100_000)
    model = _tiny_gpt()
    for block in model.transformer.h:
        fully_shard(block)
    fully_shard(model)
    monitor = Monitor(MonitorConfig(interval=1))
    monitor.attach(model)
    for t in range(2):
        x, y = sample_batch(data, 2, 32, generator=torch.Generator().manual_seed(t + 10 * rank))
        model(x, y)[1].backward()
        _step_failing_on_rank_1_at_step_0(monitor, rank, t)
    out = {"errors": monitor.errors, "step": monitor.snapshot()["flashwatch_step"],
           "sigma": monitor.snapshot()["flashwatch_wq_spectral_norm"]}
    monitor.detach()
    return out


def _step_failing_on_rank_1_at_step_0(monitor: Monitor, rank: int, t: int) -> list:
    """``monitor.step()``, where rank 1 cannot read its statistics at step 0 (an injected error)."""
    saved = AttentionStats.__dict__["packed_all"]
    if rank == 1 and t == 0:
        def broken(stats):
            raise RuntimeError("injected failure on rank 1")
        AttentionStats.packed_all = staticmethod(broken)
    try:
        return monitor.step()
    finally:
        AttentionStats.packed_all = saved


def _failure(rank: int) -> dict:
    """Rank 1 cannot read its statistics at step 0: every rank skips that step, nobody hangs, step 1 works."""
    data = stdlib_corpus(100_000)
    model = _tiny_gpt()
    monitor = Monitor(MonitorConfig(interval=1, max_logit_bound=-1e3))
    monitor.attach(model)
    steps = []
    for t in range(2):
        x, y = sample_batch(data, 2, 32, generator=torch.Generator().manual_seed(t + 10 * rank))
        model(x, y)[1].backward()
        steps.append(len(_step_failing_on_rank_1_at_step_0(monitor, rank, t)))
    out = {"new_alerts": steps, "errors": monitor.errors, "step": monitor.snapshot()["flashwatch_step"]}
    monitor.detach()
    return out


def _fsdp2(rank: int, messages: _Messages) -> dict:
    """FSDP2 (fully_shard) on the CPU: attached by structure, W^Q measured on the shards, no warning."""
    from torch.distributed.fsdp import fully_shard

    data = stdlib_corpus(100_000)
    model = _tiny_gpt()
    for block in model.transformer.h:
        fully_shard(block)
    fully_shard(model)
    before = len(messages.messages)
    monitor = Monitor(MonitorConfig(interval=1))
    monitor.attach(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    records = []
    for t in range(2):
        x, y = sample_batch(data, 4, 32, generator=torch.Generator().manual_seed(1000 * t + rank))
        loss = model(x, y)[1]
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        monitor.step(loss=loss.detach(), grad_norm=grad_norm)
        records.append(_reduced(monitor))
    skipped = [m for m in messages.messages[before:] if "W^Q spectral norms are skipped" in m]
    out = {"records": records, "sharding": monitor.sharding, "errors": monitor.errors, "skip_warnings": skipped,
           "alerts": [a.to_dict() for a in monitor.alerts], "snapshot": monitor.snapshot()}
    monitor.detach()
    return out


def _exporters_on_every_rank(rank: int, out: str) -> None:
    """Every rank passes a JSONL exporter (of one shared run folder): rank 1 says that it writes
    what rank 0 writes."""
    from flashwatch.exporters import JsonlExporter

    monitor = Monitor(MonitorConfig(interval=1), exporters=[JsonlExporter(os.path.join(out, "shared_run"))])
    monitor.attach(_tiny_gpt())
    monitor.close()


def _plain_worker(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    messages = _Messages()
    logging.getLogger("flashwatch").addHandler(messages)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    try:
        result = {"slots": _crafted(rank, "slots"), "two": _crafted(rank, "two"), "ddp": _ddp_run(rank), "ddp_scaled": _ddp_scaled(rank),
                  "repair": _repair(rank), "layout": _layout_mismatch(rank), "failure": _failure(rank), "fsdp2": _fsdp2(rank, messages),
                  "refusals": _attach_refusals(rank), "fsdp2_failure": _fsdp2_failure(rank)}
        _exporters_on_every_rank(rank, out)
        result["messages"] = messages.messages
        torch.save(result, os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


# --- comparisons -------------------------------------------------------------------------------------



def _assert_combined(r0: dict, r1: dict, where: str) -> None:
    """Each rank's combined statistics are the sum (counts, delta sums) and max (max logit) of both ranks' own."""
    l0, l1 = r0["local"]["stats"], r1["local"]["stats"]
    assert_same(r0["stats"], r1["stats"], f"{where}: combined stats differ between ranks")
    assert torch.equal(r0["stats"][SUM_ROWS], l0[SUM_ROWS] + l1[SUM_ROWS]), where
    assert torch.equal(r0["stats"][MAX_ROWS], torch.maximum(l0[MAX_ROWS], l1[MAX_ROWS])), where
    assert r0["loss"] == r1["loss"] == (r0["local"]["loss"] + r1["local"]["loss"]) / 2, where


def _raising_worker(rank: int) -> None:
    """Rank 1 raises: what ``_run_ranks`` must not hide."""
    if rank == 1:
        raise ValueError("rank 1 failed on purpose")


def _pipeline_worker(rank: int, port: int, out: str) -> None:
    """Four ranks as two pipeline stages of two data-parallel replicas: stage = rank % 2 holds block
    `stage` of the model; each stage's Monitor reduces over its replicas (``process_group=`` the
    stage's group). Saves each rank's snapshot and layer names."""
    import torch.distributed as dist
    from torch import nn

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=4,
                            timeout=datetime.timedelta(seconds=60))
    stage = rank % 2
    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]  # every rank creates every group, in order
    block = _tiny_gpt().transformer.h[stage]
    monitor = Monitor(MonitorConfig(interval=1), process_group=groups[stage])
    monitor.attach(nn.ModuleDict({f"h{stage}": block}))
    for t in range(2):
        x = torch.randn(2, 32, 64, generator=torch.Generator().manual_seed(100 * t + rank))
        block(x).pow(2).mean().backward()
        for p in block.parameters():  # the replicas' mean gradient, as DDP within a stage would
            dist.all_reduce(p.grad, group=groups[stage])
            p.grad /= 2
        torch.optim.SGD(block.parameters(), lr=0.1).step()
        block.zero_grad()
        monitor.step()
    torch.save({"snapshot": monitor.snapshot(), "layers": [layer.name for layer in monitor.layers],
                "world": monitor.world_size, "errors": monitor.errors}, os.path.join(out, f"rank{rank}.pt"))
    monitor.detach()
