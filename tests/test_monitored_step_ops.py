"""The monitored step's device half in few operations: every layer packed and reset at once, the
W^Q-error chain's next pairs from the power step's own work, an unfed chain read without arithmetic;
each bit-identical to the per-layer way."""

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from flashwatch import Monitor, MonitorConfig, routing
from flashwatch.chain import LayerChain, top_pair
from flashwatch.kernels import STAT_FIELDS, AttentionStats, reference
from flashwatch.signals import PowerIteration
from flashwatch.tinygpt import GPT, GPTConfig


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _filled(h: int, seed: int) -> AttentionStats:
    g = torch.Generator().manual_seed(seed)
    s = AttentionStats(h)
    s._counts.copy_(torch.randint(0, 1000, s._counts.shape, generator=g))
    s._values.copy_(torch.randn(s._values.shape, generator=g))
    return s


def test_packed_all_is_each_layers_packed_side_by_side():
    stats = [_filled(h, i) for i, h in enumerate((4, 2, 3))]
    # built here, not by packed() (which is packed_all of one layer): counts rows, then values rows
    want = torch.cat([torch.cat([s._counts.double(), s._values.double()]) for s in stats], dim=1)
    got = AttentionStats.packed_all(stats)
    assert got.dtype == torch.float64 and got.shape == want.shape
    assert torch.equal(_bits(got), _bits(want))


def test_reset_all_is_each_layers_reset():
    a, b = [_filled(h, i) for i, h in enumerate((4, 2))], [_filled(h, i) for i, h in enumerate((4, 2))]
    AttentionStats.reset_all(a)
    for s in b:
        s.reset()
    for x, y in zip(a, b):
        assert torch.equal(_bits(x.packed()), _bits(y.packed()))
        assert not x._counts.any() and torch.equal(x.max_logit, torch.full_like(x.max_logit, float("-inf")))
        assert not torch.cat([v for name, v in zip(STAT_FIELDS, x.packed()) if name != "max_logit"]).any()
    assert math.isinf(a[0].max_logit[0].item()) and a[0].max_logit[0].item() < 0
    AttentionStats.reset_all([])  # nothing to reset: no error


def test_top_pair_from_the_power_steps_direction_is_bit_identical():
    w = torch.randn(6, 8, 32, generator=torch.Generator().manual_seed(1))
    power = PowerIteration(w, block=4, seed="random")
    assert power.top_in_block() is None  # no step yet
    power.step(w, 1)
    top = power.top_in_block()
    assert top is not None and top.shape == (6, 4)
    for got, want in zip(top_pair(w, power.v, top), top_pair(w, power.v)):
        assert torch.equal(_bits(got), _bits(want))
    power.exact(w)  # new vectors: the step's direction no longer applies
    assert power.top_in_block() is None


@pytest.fixture
def monitors():
    """Monitors made by a test, detached at its end (torch's SDPA given back)."""
    made = []
    yield made
    for mon in made:
        mon.detach()


def _monitor(n_layer: int, feed_chain: bool, monkeypatch, made: list):
    if not feed_chain:  # as under torch.compile: no statistics pass feeds the chain
        monkeypatch.setattr(reference, "attention_statistics", lambda *a, **k: None)
        monkeypatch.setattr(routing.Router, "_chain_hooks", lambda self, *a: None)
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=n_layer, n_head=2, n_embd=32, block_size=8))
    mon = Monitor(MonitorConfig(interval=1, mode="observe"))
    mon.attach(model)
    made.append(mon)
    x = torch.randint(0, 256, (1, 8))
    return mon, model, x


def test_pairs_after_the_step_equal_pairs_read_again(monkeypatch, monitors):
    mon, model, x = _monitor(2, True, monkeypatch, monitors)
    model(x, x)[1].backward()
    wq = mon._wq
    wq.step(False, 1, lambda kind, exc: None, pairs=True)
    fresh = wq.pairs()  # the pairs the step made
    again = wq.pairs()  # read and computed again
    assert fresh.keys() == again.keys()
    for i in fresh:
        for got, want in zip(fresh[i], again[i]):
            assert torch.equal(_bits(got), _bits(want))


def test_an_unfed_chain_reads_nan_and_keeps_its_window():
    g = torch.Generator().manual_seed(3)
    chains = [LayerChain(2, 4, 16, torch.device("cpu")) for _ in range(2)]
    for c in chains:
        c.set_pair(torch.randn(2, 4, generator=g), torch.randn(2, 16, generator=g))
    state = {k: v.clone() for k, v in chains[0].state_dict().items()}
    for c in chains[1:]:
        c.load_state_dict(state)
    chains[1]._touched = True  # the full computation, for comparison
    quick, full = chains[0].reading(0.9), chains[1].reading(0.9)
    assert quick.shape == full.shape == (4, 2) and torch.isnan(quick).all()
    assert torch.equal(_bits(quick), _bits(full))
    for k, v in chains[0].state_dict().items():
        assert torch.equal(_bits(v), _bits(state[k])) and torch.equal(_bits(v), _bits(chains[1].state_dict()[k]))


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def _collect_ops(n_layer: int, monkeypatch, made: list) -> int:
    """Torch ops of a monitored step's device half (``_collect``, ``_reset_stats``), chain unfed."""
    mon, model, x = _monitor(n_layer, False, monkeypatch, made)
    for _ in range(2):
        model(x, x)[1].backward()
        mon.step()
    model(x, x)[1].backward()
    counter = _Count()
    for name in ("_collect", "_reset_stats"):
        original = getattr(mon, name)

        def counted(*args, _original=original, **kwargs):
            with counter:
                return _original(*args, **kwargs)
        monkeypatch.setattr(mon, name, counted)
    mon.step()
    return counter.ops


def test_the_device_half_adds_few_ops_per_layer(monkeypatch, monitors):
    """Per layer the device half reads W^Q (a few views), one NaN reading of the unfed chain and
    the splits of the batched results; packing, resetting and the power iteration are batched. The
    per-layer way dispatched about 70 ops per layer here."""
    two, six = _collect_ops(2, monkeypatch, monitors), _collect_ops(6, monkeypatch, monitors)
    per_layer = (six - two) / 4
    assert per_layer <= 16, f"{per_layer} torch ops per layer ({two} at 2 layers, {six} at 6)"


def test_the_benchmark_runs_and_counts_the_device_half(tmp_path):
    """benchmarks/monitored_step_host.py (in a process of its own: it replaces functions while it
    measures) on a narrow model: it times both kinds of step and counts the phases' ops."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "host.json"
    subprocess.run([sys.executable, str(root / "benchmarks" / "monitored_step_host.py"), "--steps", "1",
                    "--n-embd", "48", "--seq", "8", "--statistics", "none", "--json", str(out)],
                   check=True, cwd=root, capture_output=True, timeout=300)
    got = json.loads(out.read_text())
    ops = got["ops"]
    assert sum(ops["monitored"].values()) > sum(ops["unmonitored"].values())
    assert ops["monitored"]["  chains.reading"] <= 3  # unfed chains: one NaN fill per group
    assert set(got["step_ms"]) == {"monitored", "unmonitored"}


@pytest.mark.parametrize("block", [2, 4, 8])
def test_the_power_step_dispatches_few_ops_whatever_the_block(block):
    """One power-iteration step (all heads of all layers of one shape at once) is a fixed, small
    number of torch ops: the orthonormalisation does not loop over the block's columns (Gram-Schmidt
    dispatched about 10 ops a column, 189 in all at block 4), and products are bmm calls, not
    matmul's views around them. Each op is host work the monitored step enqueues."""
    w = torch.randn(24, 16, 64, generator=torch.Generator().manual_seed(0))
    power = PowerIteration(w, block=block)
    power.step(w)
    with _Count() as counter:
        power.step(w)
    assert counter.ops <= 70, f"{counter.ops} torch ops for one step at block {block}"
    with _Count() as counter:
        top_pair(w, power.v, power.top_in_block())
    assert counter.ops <= 16, f"{counter.ops} torch ops for the top pairs"
