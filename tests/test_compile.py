"""torch.compile: both modes traced into one graph, every layer measured, no recompilation.

Compiled with the ``aot_eager`` backend (AOT autograd, no code generation: the compiled step
computes exactly what the eager one does) and ``inductor`` (generated code). On the CPU the
own-kernel mode runs the reference kernel through the ``flashwatch::attention_with_stats`` operator.

Fail before: observe mode measured nothing inside torch.compile (and recompiled per layer on
its guard on the layer), own-kernel mode's autograd.Function broke the graph.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._dynamo.utils import counters

from flashwatch import Monitor, MonitorConfig
from flashwatch.kernels import STAT_FIELDS

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.usefixtures("fresh_dynamo")]

BACKENDS = ("aot_eager", "inductor")
MODES = ("observe", "own_kernel")


class Attention(nn.Module):
    """nanoGPT's attention without dropout: c_attn -> SDPA -> c_proj (one matrix product each)."""

    def __init__(self, c: int, heads: int):
        super().__init__()
        self.c_attn = nn.Linear(c, 3 * c, bias=False)
        self.c_proj = nn.Linear(c, c, bias=False)
        self.n_head = heads

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))


class Stack(nn.Module):
    """Attention layers one after the other: no normalisation or activation whose fused code
    could round differently from the eager one, so compiled and eager steps see the same q, k, v."""

    def __init__(self, layers: int = 3, c: int = 32, heads: int = 2):
        super().__init__()
        self.blocks = nn.ModuleList(Attention(c, heads) for _ in range(layers))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def _run(mode: str, backend: str | None, steps: int = 4, interval: int = 2, dtype=torch.float32,
         format: str = "bf16"):
    """Train ``steps`` steps; per step: every layer's statistics and coverage after the backward."""
    torch.manual_seed(0)
    model = Stack().to(dtype)
    monitor = Monitor(MonitorConfig(interval=interval, mode=mode, async_transfer=False, format=format))
    monitor.attach(model)
    run = model if backend is None else torch.compile(model, backend=backend)
    g = torch.Generator().manual_seed(1)
    seen = []
    for _ in range(steps):
        x = torch.randn(2, 16, 32, generator=g).to(dtype)
        w = torch.randn(2, 16, 32, generator=g).to(dtype)
        (run(x) * w).sum().backward()
        seen.append({"monitored": monitor.monitoring,
                     "stats": [layer.stats.as_dict() for layer in monitor.layers],
                     "coverage": [layer.coverage.tolist() for layer in monitor.layers]})
        model.zero_grad(set_to_none=True)
        monitor.step()
        if seen[-1]["monitored"]:  # the W^Q-error chain's readings of that step
            snap = monitor.snapshot()
            seen[-1]["chain"] = {name: dict(snap[name]) for name in CHAIN_METRICS}
    monitor.detach()
    monitor.close()
    return seen


def _eager_then_compiled(run, mode: str, backend: str, **kwargs) -> tuple[list, list]:
    """``run(mode, None)`` then ``run(mode, backend)`` from a fresh Dynamo: the compiled run must
    make one graph, break it nowhere and never recompile (a guard on the monitored flag or on a
    layer would raise)."""
    eager = run(mode, None, **kwargs)
    torch._dynamo.reset()
    counters.clear()
    with torch._dynamo.config.patch(error_on_recompile=True):
        compiled = run(mode, backend, **kwargs)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1
    return eager, compiled


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", MODES)
def test_compiled_step_measures_every_layer_as_eager(mode, backend):
    eager, compiled = _eager_then_compiled(_run, mode, backend)
    for step, (e, c) in enumerate(zip(eager, compiled)):
        assert e["monitored"] == c["monitored"] == (step % 2 == 0)
        for layer, (se, sc) in enumerate(zip(e["stats"], c["stats"])):
            if not c["monitored"]:  # an unmonitored step adds nothing
                assert sc["rows"] == [0.0, 0.0] and sc["max_logit"] == [float("-inf")] * 2, (step, layer)
                continue
            assert sc["rows"] == [32.0, 32.0], (step, layer)  # B * N rows per head: every layer measured
            for name in STAT_FIELDS:
                # the same q, k, v, dO reach the statistics (matrix products run the same BLAS
                # call compiled or not; no fused normalisation); inductor may still reorder the
                # FP32 sums of the observed SDPA's backward, which moves the delta error sums by
                # a few units in the last place of the FP32 per-row values
                exact = backend == "aot_eager" or mode == "own_kernel" or name not in (
                    "delta_error", "delta_error_abs", "delta_error_sq", "delta_error_tied")
                if exact:
                    assert sc[name] == se[name], (step, layer, name, se[name], sc[name])
                else:
                    torch.testing.assert_close(torch.tensor(sc[name]), torch.tensor(se[name]), rtol=1e-3, atol=1e-12)
        expected = [[1, 1]] * 3 if c["monitored"] else [[0, 0]] * 3
        assert c["coverage"] == e["coverage"] == expected, step


@pytest.mark.parametrize("mode", MODES)
def test_compiled_step_counts_format_ties_on_the_configured_format(mode):
    """The format-tie count (rows whose P_bar rounds to 1 at two keys on the grid of
    ``MonitorConfig.format``) is the eager step's under compile too. Fail before: the operators
    rebuilt the layer's statistics with the default BF16 format, so a compiled step counted
    ties on the BF16 grid whatever the configured format."""
    eager = _run(mode, None, steps=1, format="fp8_e4m3")
    assert sum(sum(layer["repeated_max_rows_format"]) for layer in eager[0]["stats"]) > 0  # ties to count
    torch._dynamo.reset()
    compiled = _run(mode, "aot_eager", steps=1, format="fp8_e4m3")
    for e, c in zip(eager[0]["stats"], compiled[0]["stats"]):
        assert c["repeated_max_rows_format"] == e["repeated_max_rows_format"]


CHAIN_METRICS = ("flashwatch_wq_error_push", "flashwatch_wq_error_push_cumulative", "flashwatch_wq_error_push_share",
                 "flashwatch_wq_error_alignment", "flashwatch_wq_error_coherence")


def _run_chain(mode: str, backend: str | None, steps: int = 5) -> list[dict]:
    """A small GPT (LayerNorm, GELU: the W^Q-error chain's nanoGPT family) trained under BF16 autocast,
    monitored at interval 2; per monitored step the snapshot's W^Q-error metrics {(layer, head): value}."""
    from flashwatch.tinygpt import GPT, GPTConfig, sample_batch, stdlib_corpus

    data = stdlib_corpus(20_000)
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=4, n_embd=64, block_size=32, dropout=0.0))
    monitor = Monitor(MonitorConfig(interval=2, mode=mode, async_transfer=False))
    monitor.attach(model)
    assert all(layer.chain is not None for layer in monitor.layers)
    run = model if backend is None else torch.compile(model, backend=backend)
    seen = []
    for step in range(steps):
        x, y = sample_batch(data, 3, 32, generator=torch.Generator().manual_seed(step))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = run(x, y)[1]
        loss.backward()
        model.zero_grad(set_to_none=True)
        monitored = monitor.monitoring
        monitor.step(loss=loss.detach())
        if monitored:
            snap = monitor.snapshot()
            seen.append({name: dict(snap[name]) for name in CHAIN_METRICS})
    monitor.detach()
    monitor.close()
    return seen


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", MODES)
def test_compiled_step_measures_the_wq_error_chain(mode, backend):
    """The W^Q-gradient error chain (push, the true gradient's push and their share, alignment,
    coherence) is measured under compile, every layer and head, with no graph break and no
    recompile across monitored and unmonitored steps: with ``aot_eager`` (the eager step's
    arithmetic) equal to the eager readings; with ``inductor`` (fused code that rounds q, k, v
    differently) finite wherever the eager readings are. Fail before: every reading was NaN
    under compile."""
    eager, compiled = _eager_then_compiled(_run_chain, mode, backend)
    assert len(eager) == len(compiled) == 3
    assert any(v != 0 for v in eager[0]["flashwatch_wq_error_push"].values())  # an error to measure
    for step, (e, c) in enumerate(zip(eager, compiled)):
        for name in CHAIN_METRICS:
            assert set(c[name]) == set(e[name]) == {(layer, h) for layer in range(2) for h in range(4)}
            for key, want in e[name].items():
                got = c[name][key]
                if backend == "aot_eager":
                    assert got == pytest.approx(want, rel=1e-5, abs=0, nan_ok=True), (step, name, key)
                else:
                    assert math.isnan(got) == math.isnan(want), (step, name, key, want, got)


def _hf_chain_eager_and_compiled(make_model, mode: str, length: int, autocast: bool) -> tuple[list, list]:
    """A Hugging Face model from ``make_model()`` (seeded), trained two monitored steps on (2,
    ``length``) token batches, eager and compiled with ``aot_eager``: (the eager W^Q-error readings,
    the compiled ones). The compiled run adds no graph break to those of the model's own code
    (compiled without the Monitor) and runs under Dynamo's error on recompilation."""

    def run(attach: bool, backend: str | None) -> list[dict]:
        torch.manual_seed(0)
        model = make_model()
        monitor = Monitor(MonitorConfig(interval=1, mode=mode, async_transfer=False))
        if attach:
            monitor.attach(model)
        compiled = model if backend is None else torch.compile(model, backend=backend)
        seen = []
        for step in range(2):
            ids = torch.randint(0, 100, (2, length), generator=torch.Generator().manual_seed(step))
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                loss = compiled(ids, labels=ids).loss
            loss.backward()
            model.zero_grad(set_to_none=True)
            monitor.step(loss=loss.detach())
            snap = monitor.snapshot()
            seen.append({name: dict(snap[name]) for name in CHAIN_METRICS})
        monitor.detach()
        monitor.close()
        return seen

    counters.clear()
    run(False, "aot_eager")  # the model's own graph breaks
    own_breaks = sum(counters["graph_break"].values())
    eager = run(True, None)
    torch._dynamo.reset()
    counters.clear()
    with torch._dynamo.config.patch(error_on_recompile=True):
        compiled = run(True, "aot_eager")
    assert sum(counters["graph_break"].values()) == own_breaks
    return eager, compiled


def _assert_chain_as_eager(eager: list, compiled: list) -> None:
    push = compiled[0]["flashwatch_wq_error_push"].values()  # a rounding residue: one head's may cancel to 0.0
    assert all(math.isfinite(v) for v in push) and any(v != 0 for v in push)
    for e, c in zip(eager, compiled):
        for name in CHAIN_METRICS:
            assert c[name] == pytest.approx(e[name], rel=1e-5, abs=0, nan_ok=True), name


def test_compiled_hugging_face_gpt2_measures_the_wq_error_chain():
    """Hugging Face GPT-2 (its Conv1D query projection, hidden_states as the attention's input)
    compiled with ``aot_eager``: the W^Q-error readings equal the eager ones, and the Monitor adds
    no graph break to those of the model's own code (a logging call in its forward)."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=2, n_head=4, n_embd=64, vocab_size=100, n_positions=64, attn_pdrop=0.0,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_implementation="sdpa")
    eager, compiled = _hf_chain_eager_and_compiled(lambda: transformers.GPT2LMHeadModel(cfg), "observe", 32, True)
    _assert_chain_as_eager(eager, compiled)


@pytest.mark.parametrize("mode", MODES)
def test_compiled_rotary_attention_measures_the_chain_as_eager(mode):
    """Llama-style attention (RoPE, grouped-query) compiled with ``aot_eager``: the call's rotation
    reaches the operators, and the W^Q-error readings (rows turned back through it) equal the
    eager ones, with no graph break added to the model's own and no recompile. Fail before: NaN."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=100, attn_implementation="sdpa")
    eager, compiled = _hf_chain_eager_and_compiled(lambda: transformers.LlamaForCausalLM(cfg), mode, 16, False)
    _assert_chain_as_eager(eager, compiled)


def _saved_activation_bytes(mode: str | None) -> int:
    """Bytes of the distinct storages the inductor-compiled small GPT saves for its backward (one
    BF16-autocast step, ``saved_tensors_hooks``), with a Monitor in ``mode`` or none."""
    from flashwatch.tinygpt import GPT, GPTConfig, sample_batch, stdlib_corpus

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=4, n_embd=64, block_size=32, dropout=0.0))
    monitor = None
    if mode is not None:
        monitor = Monitor(MonitorConfig(interval=2, mode=mode, async_transfer=False))
        monitor.attach(model)
    x, y = sample_batch(stdlib_corpus(20_000), 3, 32, generator=torch.Generator().manual_seed(0))
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16):
        loss = torch.compile(model, backend="inductor")(x, y)[1]
    loss.backward()
    if monitor is not None:
        monitor.detach()
        monitor.close()
    return sum(storages.values())


def test_compiled_observe_mode_keeps_no_more_activations_than_the_model():
    """Compiled observe mode keeps the projection input X of each layer for the W^Q-error chain on
    every step; taken in autocast's dtype, it is the copy the query projection keeps anyway, so the
    saved activations grow only by the Monitor's few scalar tensors. Fail before (X in FP32, as the
    layer received it): +49,152 bytes here, 3 x 32 x 64 x 4 per layer."""
    extra = _saved_activation_bytes("observe") - _saved_activation_bytes(None)
    assert 0 <= extra < 1024, extra


def test_flipping_the_monitored_flag_recompiles_nothing():
    """Monitored and unmonitored steps alternate at interval 1..3; the forward compiles once."""
    torch._dynamo.config.recompile_limit  # exists (the limit a guard on the flag would hit)
    with torch._dynamo.config.patch(error_on_recompile=True):
        seen = _run("observe", "aot_eager", steps=6, interval=3)
    assert [s["monitored"] for s in seen] == [True, False, False, True, False, False]
    assert counters["stats"]["unique_graphs"] == 1
    assert sum(1 for s in seen if s["stats"][0]["rows"][0] > 0) == 2


@pytest.mark.parametrize("mode", MODES)
def test_a_model_of_the_same_class_compiled_first_does_not_stand_in_for_the_attached_one(mode):
    """Two models of one class in one process, both compiled (aot_eager) with gradients: the one
    without a Monitor runs first, then the attached one, and each once more. Every monitored step
    of the attached model reads its own statistics, those of the same model alone and eager (its
    calls, not the other's: the other's steps add nothing), and ``detach()`` leaves it without a
    ``forward`` of its own. Fails before: Dynamo does not guard a module's hooks, so the attached
    model ran the code compiled for the other, and none of its calls was measured."""

    def one_step(run, x, w, monitor=None):
        (run(x) * w).sum().backward()
        if monitor is None:
            return None
        seen = ([layer.stats.as_dict() for layer in monitor.layers],
                [layer.coverage.tolist() for layer in monitor.layers])
        monitor.step()
        return seen

    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(2, 16, 32, generator=g), torch.randn(2, 16, 32, generator=g)
    torch.manual_seed(1)
    alone = Stack()
    reference = Monitor(MonitorConfig(interval=1, mode=mode, async_transfer=False))
    reference.attach(alone)
    expected = one_step(alone, x, w, reference)
    reference.detach()
    torch.manual_seed(0)
    other = Stack()
    torch.manual_seed(1)
    attached = Stack()
    monitor = Monitor(MonitorConfig(interval=1, mode=mode, async_transfer=False))
    monitor.attach(attached)
    run_other, run_attached = torch.compile(other, backend="aot_eager"), torch.compile(attached, backend="aot_eager")
    for _ in range(2):
        one_step(run_other, x, w)
        stats, coverage = one_step(run_attached, x, w, monitor)
        assert coverage == [[1, 1]] * 3
        for layer, (got, want) in enumerate(zip(stats, expected[0])):
            for name in STAT_FIELDS:
                assert got[name] == want[name], (layer, name, got[name], want[name])
    monitor.detach()
    assert not any("forward" in vars(block) for block in attached.blocks)


def test_a_fresh_thread_compiles_once():
    """The router's per-thread state exists from the start: a first compiled step in a new
    thread (a data-parallel worker, a Lightning thread) adds no guard on its creation."""
    import threading

    result = {}

    def work():
        try:
            with torch._dynamo.config.patch(error_on_recompile=True):
                result["seen"] = _run("observe", "aot_eager", steps=3, interval=2)
        except BaseException as exc:  # reported below, in the test's thread
            result["error"] = exc

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert "error" not in result, result.get("error")
    assert counters["stats"]["unique_graphs"] == 1
    assert [s["stats"][2]["rows"][0] for s in result["seen"]] == [32.0, 0.0, 32.0]


@pytest.mark.parametrize("mode", MODES)
def test_compiled_triton_path_under_the_interpreter(mode, interpret_dispatch):
    """The operators' Triton path (the launchers of triton_attn, as on CUDA), run by Triton's CPU
    interpreter: the compiled step reports exactly the eager step's statistics and W^Q-error chain
    (reduced in the kernels' epilogues there)."""
    eager, compiled = _eager_then_compiled(_run, mode, "aot_eager", steps=2, dtype=torch.bfloat16)
    assert compiled[0]["stats"][0]["rows"] == [32.0, 32.0]
    for e, c in zip(eager, compiled):
        assert c["stats"] == e["stats"] and c["coverage"] == e["coverage"]
    push = compiled[0]["chain"]["flashwatch_wq_error_push"]
    assert all(math.isfinite(v) for v in push.values()) and any(v != 0 for v in push.values())
    for name, readings in eager[0]["chain"].items():  # exactly (the first step's alignment is NaN in both)
        assert compiled[0]["chain"][name] == pytest.approx(readings, rel=0, abs=0, nan_ok=True), name


def _generated_calls(mode: str | None) -> dict[str, dict[str, int]]:
    """Inductor's code for one step of ``Stack`` (observe mode, an unmonitored step; or no
    Monitor): per graph ("forward", "backward"), the calls its wrapper makes: generated kernels,
    extern kernels and ATen/custom operators, and flashwatch's operators among them."""
    import re

    from torch._inductor.utils import run_and_get_code

    torch.manual_seed(0)
    model = Stack()
    monitor = None
    if mode is not None:
        monitor = Monitor(MonitorConfig(interval=2, mode=mode, async_transfer=False))
        monitor.attach(model)
        monitor.step()  # step 1: unmonitored
    run = torch.compile(model, backend="inductor")
    x = torch.randn(2, 16, 32)
    _, codes = run_and_get_code(lambda: run(x).sum().backward())
    if monitor is not None:
        monitor.detach()
    found = {}
    for code in codes:
        body = code[code.index("def call("):]
        lines = [line.strip() for line in body.splitlines()]
        lines = [line for line in lines if not line.startswith(("#", "assert_"))]  # comments, checks
        graph = "backward" if any("tangents_" in line for line in lines) else "forward"
        found[graph] = {
            "kernels": sum(1 for line in lines if re.match(r"(cpp_fused|triton_)\w*(\.run)?\(", line)),
            "operators": sum(1 for line in lines if re.search(r"\b(extern_kernels|torch\.ops)\.", line)),
            "flashwatch": sum(1 for line in lines if "torch.ops.flashwatch." in line),
        }
    return found


def test_observe_adds_no_forward_work_to_the_compiled_step():
    """Observe mode marks SDPA's output with a view (no copy): Inductor's forward makes exactly the
    calls of the model without a Monitor, and the backward one statistics operator per layer
    (which returns at once on unmonitored steps). Fail before: the marking operator copied the
    output (one opaque call and a full-size copy per layer in every step's forward)."""
    base = _generated_calls(None)
    torch._dynamo.reset()
    observed = _generated_calls("observe")
    assert observed["forward"] == base["forward"], (observed, base)
    assert observed["forward"]["flashwatch"] == 0
    layers = len(Stack().blocks)
    assert observed["backward"]["flashwatch"] == layers
    assert observed["backward"]["kernels"] == base["backward"]["kernels"]
    assert observed["backward"]["operators"] == base["backward"]["operators"] + layers


def _unaligned_computed_buffers(mode: str) -> dict[str, list[str]]:
    """Per graph of Inductor's code for one step of ``Stack`` in ``mode`` ("forward", "backward"): the
    buffers the graph computes (not its inputs) that Inductor assumes may not be 16-byte aligned, so
    that the generated code reading them does without vector loads."""
    from torch._inductor.graph import GraphLowering

    seen = []
    compile_to_module = GraphLowering.compile_to_module

    def recording(self):
        module = compile_to_module(self)
        seen.append((any(name.startswith("tangents_") for name in self.graph_inputs),
                     sorted(name for name in self.unaligned_buffers if name not in self.graph_inputs)))
        return module

    torch.manual_seed(0)
    model = Stack()
    monitor = Monitor(MonitorConfig(interval=2, mode=mode, async_transfer=False))
    monitor.attach(model)
    monitor.step()  # step 1: unmonitored
    try:
        with torch._inductor.config.patch(force_disable_caches=True), \
                pytest.MonkeyPatch.context() as patch:
            patch.setattr(GraphLowering, "compile_to_module", recording)
            torch.compile(model, backend="inductor")(torch.randn(2, 16, 32)).sum().backward()
    finally:
        monitor.detach()
    return {"backward" if backward else "forward": names for backward, names in seen}


def test_the_compiled_backward_reads_the_attention_gradients_as_aligned():
    """Own-kernel mode's backward operator writes dQ, dK, dV into tensors the compiled backward
    allocates, so Inductor knows them aligned. Fail before: the operator returned them, and Inductor
    assumes an operator's outputs unaligned when any input may be (its CPU flag always counts as one,
    on every device), so the concatenation of the three gradients into the projection's ran without
    vector loads (1.6x slower on an H200: docs/PERFORMANCE.md)."""
    unaligned = _unaligned_computed_buffers("own_kernel")
    assert set(unaligned) == {"forward", "backward"}
    assert unaligned["backward"] == []


def test_each_compiled_attention_backward_writes_into_gradients_of_its_own():
    """Every layer's backward operator writes dQ, dK, dV into three allocations of its own, each
    used by that operator alone, so Inductor writes them in place. Fail before: the allocations
    traced as ``empty_strided``, which the compiler's common-subexpression pass merges across
    layers (all of one shape), so Inductor copied the shared tensor before each operator wrote into
    it (three copies a layer in every step's backward)."""
    from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd

    graphs = []

    def keep_backward(gm, _):
        graphs.append(gm.graph)
        return make_boxed_func(gm.forward)

    torch.manual_seed(0)
    model = Stack()
    monitor = Monitor(MonitorConfig(interval=2, mode="own_kernel", async_transfer=False))
    monitor.attach(model)
    monitor.step()  # step 1: unmonitored
    try:
        # Inductor's partition, which runs the common-subexpression pass
        backend = aot_autograd(fw_compiler=lambda gm, _: make_boxed_func(gm.forward), bw_compiler=keep_backward,
                               partition_fn=min_cut_rematerialization_partition)
        torch.compile(model, backend=backend)(torch.randn(2, 16, 32)).sum().backward()
    finally:
        monitor.detach()
    [graph] = graphs
    writes = [[a for a in node.all_input_nodes if "empty" in str(a.target)] for node in graph.nodes
              if node.op == "call_function" and node.args and "attention_grad" in str(node.args[0])]
    assert len(writes) == len(model.blocks)
    allocations = [a for each in writes for a in each]
    assert all(len(each) == 3 for each in writes) and len(set(allocations)) == 3 * len(model.blocks), writes
    assert all(len(a.users) == 1 for a in allocations), [list(a.users) for a in allocations]


@pytest.mark.parametrize("mode", MODES)
def test_every_monitor_operator_is_left_out_of_cuda_graphs(mode):
    """Under CUDA graphs (``mode="reduce-overhead"``) Inductor must run flashwatch's operators
    between the graphs it records: they read the step's CPU flag and hand tensors to the Monitor
    that outlive the call. Checked with Inductor's own test for a node it keeps out of CUDA graphs,
    on every flashwatch node of the forward and backward graphs AOT autograd makes. Fail before:
    untagged, the operators went into the graphs, and training stopped with "tensor(s) in the
    cudagraph pool not tracked as outputs" (both modes, one H200)."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._inductor.utils import is_cudagraph_unsafe_fx_node

    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return gm

    def flashwatch_op(target):
        return isinstance(target, torch._ops.OpOverload) and target.namespace == "flashwatch"

    _run(mode, aot_autograd(fw_compiler=keep, bw_compiler=keep), steps=2)
    nodes = [n for gm in graphs for n in gm.graph.nodes if n.op == "call_function"]
    direct = [n for n in nodes if flashwatch_op(n.target)]
    # an operator that writes into its arguments comes wrapped (auto_functionalized); Inductor
    # unwraps it before it looks, so the wrapped operator is the one to check
    wrapped = [n.args[0] for n in nodes if "auto_functionalized" in str(n.target) and flashwatch_op(n.args[0])]
    assert len(graphs) == 2 and direct + wrapped, [str(gm.graph) for gm in graphs]
    assert all(is_cudagraph_unsafe_fx_node(n) for n in direct), [str(n.target) for n in direct]
    assert all(torch._C.Tag.cudagraph_unsafe in op.tags for op in wrapped), [str(op) for op in wrapped]


@pytest.mark.parametrize("scores_only", [None, "dropout"], ids=["measured in full", "scores only"])
def test_observe_mode_traced_for_cuda_graphs_says_once_what_it_costs(scores_only, monkeypatch, caplog):
    """Traced for CUDA graphs (``mode="reduce-overhead"`` sets Inductor's ``triton.cudagraphs`` while it
    traces), observe mode's statistics operators cut the compiled backward at every layer: the user is
    told once, with what avoids it. Not on the CPU, nor without CUDA graphs. Fake CUDA tensors, so
    this runs without a GPU. Fails before: nothing was said."""
    import logging

    from torch._inductor import config as inductor_config
    from torch._subclasses.fake_tensor import FakeTensorMode

    from flashwatch.kernels import ops

    def trace(device: str) -> None:
        with FakeTensorMode():
            q = torch.empty(1, 2, 8, 4, device=device)
            counts, values = torch.zeros(2, 3, device=device), torch.zeros(2, 5, device=device)
            coverage, flag, layer = torch.zeros(2, device=device), torch.ones((), dtype=torch.bool), torch.zeros(())
            getattr(torch.ops.flashwatch.observe_statistics, ops.CONTRACT)(
                q, q, q, q, q, flag, counts, values, coverage, None, True, 0.5, 1e-3, False, 1.0, None, None, layer,
                None, scores_only)

    def said() -> list:
        return [r.getMessage() for r in caplog.records if "CUDA graphs" in r.getMessage()]

    monkeypatch.setattr(ops, "_logged", set())
    caplog.set_level(logging.WARNING, logger="flashwatch")
    trace("cuda")
    with inductor_config.patch({"triton.cudagraphs": True}):
        trace("cpu")
    assert said() == []
    with inductor_config.patch({"triton.cudagraphs": True}):
        trace("cuda")
        trace("cuda")
    assert len(said()) == 1, said()
    assert "mode='own_kernel'" in said()[0] and "default mode" in said()[0]


def _reachable_tensors(root) -> list:
    """Every tensor reachable from ``root`` through object references (modules, classes and module
    namespaces not entered: they reach the whole process)."""
    import gc
    import types

    seen, stack, found = set(), [root], []
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, (types.ModuleType, type)) or (
                isinstance(obj, dict) and "__builtins__" in obj):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            found.append(obj)
        stack.extend(gc.get_referents(obj))
    return found


@pytest.mark.parametrize("backend", (None,) + BACKENDS)
@pytest.mark.parametrize("mode", MODES)
def test_the_monitor_keeps_no_activation_alive_after_the_backward(mode, backend, monkeypatch):
    """The projection inputs the W^Q-error chain reads on a monitored step (the model's
    activations) are freed when the model's backward frees them, not when the Monitor's step ends:
    CUDA graphs (``mode="reduce-overhead"``) refuse to replay a graph recorded on an unmonitored
    step when a tensor that died during its recording is still alive. Fail before: the chain kept
    the last call's input until ``Monitor.step`` (own-kernel mode stopped training under
    reduce-overhead on one H200: "graph recording observed an input tensor deallocate during graph
    recording that did not occur during replay")."""
    import gc
    import weakref

    from flashwatch import routing
    from flashwatch.tinygpt import GPT, GPTConfig, sample_batch, stdlib_corpus

    seen = []

    class Recorded(routing._ChainRows):
        def __init__(self, chain, x, *args):
            seen.append(weakref.ref(x))
            super().__init__(chain, x, *args)

    monkeypatch.setattr(routing, "_ChainRows", Recorded)
    data = stdlib_corpus(20_000)
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=4, n_embd=64, block_size=32, dropout=0.0))
    monitor = Monitor(MonitorConfig(interval=1, mode=mode, async_transfer=False))
    monitor.attach(model)
    run = model if backend is None else torch.compile(model, backend=backend)
    for step in range(3):
        x, y = sample_batch(data, 3, 32, generator=torch.Generator().manual_seed(step))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = run(x, y)[1]
        loss.backward()
        measured = loss.detach()
        del loss
        gc.collect()
        assert len(seen) == 2 * (step + 1), "every layer's call of a monitored step has a rows hook"
        assert all(ref() is None for ref in seen), f"step {step}: an activation outlived the backward"
        # nor any other tensor of the model's activation shapes (batch 3, 32 positions: q, k, v, the
        # attention output, its gradient) that the Monitor reaches; the chain's own products of the
        # last call's X (x . v, x Omega: made by the Monitor, kept for the query's gradient hook) aside
        own = {id(t) for layer in monitor.layers if layer.chain._projected
               for t in layer.chain._projected[1] if t is not None}  # the _Projection's views
        alive = [tuple(t.shape) for t in _reachable_tensors(monitor) if t.dim() >= 3 and t.shape[0] == 3
                 and 32 in t.shape[1:] and id(t) not in own]
        assert not alive, f"step {step}: tensors of activation shape alive after the backward: {alive}"
        model.zero_grad(set_to_none=True)
        monitor.step(loss=measured)
    assert monitor.snapshot()["flashwatch_wq_error_push"], "the chain was measured"
    monitor.detach()
    monitor.close()


@pytest.mark.parametrize("mode", MODES)
def test_dynamic_shapes_compile_once_and_count_each_steps_rows(mode):
    """``torch.compile(dynamic=True)`` with a sequence length that changes from step to step (as
    in packed or bucketed batches): one graph, no break, and each monitored step counts the rows
    of its own batch (B x T per head)."""
    torch.manual_seed(0)
    model = Stack()
    monitor = Monitor(MonitorConfig(interval=2, mode=mode, async_transfer=False))
    monitor.attach(model)
    run = torch.compile(model, backend="aot_eager", dynamic=True)
    g = torch.Generator().manual_seed(1)
    rows = []
    with torch._dynamo.config.patch(error_on_recompile=True):
        for T in (16, 24, 8, 32, 24, 8):
            run(torch.randn(2, T, 32, generator=g)).sum().backward()
            rows.append((T, monitor.monitoring, [layer.stats.as_dict()["rows"] for layer in monitor.layers]))
            model.zero_grad(set_to_none=True)
            monitor.step()
    monitor.detach()
    monitor.close()
    assert not counters["graph_break"] and counters["stats"]["unique_graphs"] == 1
    for T, monitored, per_layer in rows:
        expected = [2.0 * T] * 2 if monitored else [0.0] * 2
        assert per_layer == [expected] * 3, (T, monitored, per_layer)


class CheckpointedStack(Stack):
    """The same layers under activation checkpointing: each block's forward runs again in the backward."""

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        return x


def _readings(model_class, mode: str, backend: str | None) -> list:
    """Every layer's statistics and every metric of the snapshot after two monitored steps."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = model_class()
    monitor = Monitor(MonitorConfig(interval=1, mode=mode, async_transfer=False))
    monitor.attach(model)
    run = model if backend is None else torch.compile(model, backend=backend)
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        run(torch.randn(2, 16, 32, generator=g)).sum().backward()
        stats = [layer.stats.as_dict() for layer in monitor.layers]
        model.zero_grad(set_to_none=True)
        monitor.step()
    snapshot = {k: dict(v) for k, v in monitor.snapshot().items() if isinstance(v, dict)}
    monitor.detach()
    monitor.close()
    return [stats, snapshot]


@pytest.mark.parametrize("backend", [None, "aot_eager"])
@pytest.mark.parametrize("mode", MODES)
def test_activation_checkpointing_is_measured_as_without_it(mode, backend):
    """The recomputed forward adds nothing: the statistics are taken in the backward (the forward's
    max logit is a maximum), so every reading equals the run without checkpointing. Compiled, the
    checkpointed model is one graph, as without the Monitor. Fail before: the hooks' routing state
    is outside state, which Dynamo does not let checkpointed code change: it ran the whole frame
    eagerly (no graph)."""
    plain = _readings(Stack, mode, backend)
    counters.clear()
    checkpointed = _readings(CheckpointedStack, mode, backend)
    if backend is not None:
        assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
        assert not counters["unimplemented"], dict(counters["unimplemented"])
    assert checkpointed[0] == plain[0]
    assert checkpointed[1].keys() == plain[1].keys()
    for name, per_head in plain[1].items():
        assert checkpointed[1][name] == pytest.approx(per_head, rel=1e-6, abs=1e-12, nan_ok=True), name


def test_own_kernel_mode_writes_the_layer_state_it_traces_through_the_checkpoint_allowance(monkeypatch):
    """Own-kernel mode records at tracing time whether a layer's call falls back to SDPA
    (``AttentionLayer.sdpa_fallback``): a write to state outside the traced code, which Dynamo
    (torch 2.11) refuses inside activation checkpointing unless it goes through the allowance the
    routing state uses; the CPU build tested here accepts it either way, so the allowance's calls
    are recorded. Fail before: the attribute was written plainly, and on CUDA the checkpointed
    frame ran eagerly."""
    from flashwatch import routing

    allowed = []
    plain = routing._allowed_under_checkpoint

    def recording(change, *args):
        def change_and_record(*state):  # recorded inside the allowance: the record is a side effect too
            allowed.append(change.__name__)
            change(*state)
        plain(change_and_record, *args)

    monkeypatch.setattr(routing, "_allowed_under_checkpoint", recording)
    counters.clear()
    _readings(CheckpointedStack, "own_kernel", "aot_eager")
    assert not counters["unimplemented"], dict(counters["unimplemented"])
    assert "_set_sdpa_fallback" in allowed, allowed


@pytest.mark.parametrize("mode", MODES)
def test_where_dynamo_runs_a_checkpointed_frame_eagerly_the_monitor_says_so(mode, caplog, monkeypatch):
    """A torch whose Dynamo has no allowance for the hooks' state under activation checkpointing
    (simulated: the change made plainly) runs the checkpointed frame eagerly: the readings are
    still right, and the Monitor says once why the model is not compiled and what lets it be."""
    from flashwatch import routing
    from flashwatch.routing import CHECKPOINT_FLAG

    plain = _readings(Stack, mode, None)
    monkeypatch.setattr(routing, "_allowed_under_checkpoint", lambda change, *args: change(*args))
    counters.clear()
    with caplog.at_level("WARNING", logger="flashwatch"):
        checkpointed = _readings(CheckpointedStack, mode, "aot_eager")
    assert counters["stats"]["unique_graphs"] == 0
    assert checkpointed[0] == plain[0]
    said = [r.getMessage() for r in caplog.records if CHECKPOINT_FLAG in r.getMessage()]
    assert len(said) == 1 and "ran a frame of this model eagerly" in said[0], said


@pytest.mark.parametrize("mode", MODES)
def test_a_model_compiled_block_by_block_compiles_once(mode):
    """``torch.compile`` applied to each transformer block (as torchtitan does): the blocks share
    one compilation, as without the Monitor, and every block is measured as in eager mode. Fail
    before: a guard on each layer's index (an integer operator argument) and on each module's
    exit-hook id compiled every block apart, and past Dynamo's recompile limit (8) the remaining
    blocks ran uncompiled."""
    from flashwatch.tinygpt import GPT, GPTConfig

    def run(compiled: bool):
        torch._dynamo.reset()
        counters.clear()
        torch.manual_seed(0)
        model = GPT(GPTConfig(n_layer=10, n_head=2, n_embd=32, block_size=32, dropout=0.0))
        monitor = Monitor(MonitorConfig(interval=2, mode=mode, async_transfer=False))
        monitor.attach(model)
        if compiled:
            for i, block in enumerate(model.transformer.h):
                model.transformer.h[i] = torch.compile(block, backend="aot_eager")
        g = torch.Generator().manual_seed(0)
        seen = []
        for _ in range(3):
            x = torch.randint(0, 256, (2, 32), generator=g)
            model(x, x)[1].backward()
            seen.append([layer.stats.as_dict()["repeated_max_rows"] for layer in monitor.layers])
            model.zero_grad(set_to_none=True)
            monitor.step()
        snapshot = {k: dict(v) for k, v in monitor.snapshot().items() if k.startswith("flashwatch_wq_error")}
        monitor.detach()
        monitor.close()
        return seen, snapshot, counters["stats"]["unique_graphs"]

    eager, eager_chain, _ = run(False)
    compiled, compiled_chain, graphs = run(True)
    assert graphs == 1, graphs
    assert compiled == eager
    for name, per_head in eager_chain.items():
        assert compiled_chain[name] == pytest.approx(per_head, rel=1e-5, abs=1e-12, nan_ok=True), name


@pytest.mark.parametrize("what", ["blocks", "attention modules"])
@pytest.mark.parametrize("when", ["before attach", "after attach"])
@pytest.mark.parametrize("mode", MODES)
def test_modules_compiled_in_place_are_the_modules_they_wrap(mode, when, what):
    """Blocks or attention modules replaced by their ``torch.compile`` wrappers, before or after
    ``attach``: the layers keep the model's own names (``MonitorConfig.layers`` and a state saved
    from an eager run apply), and the W^Q norms and the W^Q-error chain read as in eager mode. Fail
    before: compiled before attach, the names carried ``_orig_mod`` (the eager state did not load)
    and attention modules lost the chain (NaN, the hooks ran outside the compiled code); compiled
    after attach, attention modules read as replaced (W^Q norms NaN, a false warning)."""
    from flashwatch.tinygpt import GPT, GPTConfig

    def run(compiled: bool):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=32, dropout=0.0))
        monitor = Monitor(MonitorConfig(interval=1, mode=mode, async_transfer=False,
                                        layers=["transformer.h.0.attn", "transformer.h.1.attn"]))

        def compile_in_place():
            for block_index, block in enumerate(model.transformer.h):
                if what == "blocks":
                    model.transformer.h[block_index] = torch.compile(block, backend="aot_eager")
                else:
                    block.attn = torch.compile(block.attn, backend="aot_eager")
        if compiled and when == "before attach":
            compile_in_place()
        monitor.attach(model)
        if compiled and when == "after attach":
            compile_in_place()
        x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
        for _ in range(2):
            model(x, x)[1].backward()
            model.zero_grad(set_to_none=True)
            monitor.step()
        names, state = [layer.name for layer in monitor.layers], monitor.state_dict()
        snapshot = {k: dict(v) for k, v in monitor.snapshot().items()
                    if k.startswith(("flashwatch_wq_error", "flashwatch_wq_spectral"))}
        monitor.detach()
        monitor.close()
        return names, state, snapshot

    eager_names, eager_state, eager = run(False)
    names, _, compiled = run(True)
    assert names == eager_names == ["transformer.h.0.attn", "transformer.h.1.attn"]
    assert all(math.isfinite(v) for v in eager["flashwatch_wq_spectral_norm"].values())
    assert any(v != 0 for v in eager["flashwatch_wq_error_push"].values())
    for name, per_head in eager.items():
        assert compiled[name] == pytest.approx(per_head, rel=1e-5, abs=1e-12, nan_ok=True), name
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=32, dropout=0.0))
    model.transformer.h[0] = torch.compile(model.transformer.h[0], backend="aot_eager")
    monitor = Monitor(MonitorConfig(interval=1, mode=mode))
    monitor.attach(model)
    monitor.load_state_dict(eager_state)  # the eager run's state: the same layer names
    monitor.close()


def test_a_forward_that_raised_leaves_no_layer_routed_after_the_step():
    """The exit hook does not run when a forward raises; the next ``Monitor.step()`` forgets the
    layer the failed forward left pushed, so later attention calls outside it are not counted
    as its."""
    from flashwatch import routing

    class Failing(Attention):
        def forward(self, x):
            super().forward(x)
            raise RuntimeError("the model's own error")

    model = nn.Sequential(Failing(32, 2))
    monitor = Monitor(MonitorConfig(interval=1, async_transfer=False))
    monitor.attach(model)
    with pytest.raises(RuntimeError, match="the model's own error"):
        model(torch.randn(2, 16, 32))
    assert routing._local.current is not None  # left pushed by the failed forward
    monitor.step()
    assert routing._local.current is None and routing._local.stack == []
    monitor.detach()
    monitor.close()


def test_a_compiled_query_changed_by_plain_code_reads_nan(caplog):
    """Compiled code compares the query too: the statistics operator hands the call's query to the
    layer's rows source, which compares it once with W^Q X. A functional RMS norm on the query reads
    NaN with one note; the unchanged module beside it keeps its readings (one graph, as eager)."""
    from test_chain import _UnrotatedLlamaAttention

    class Normed(_UnrotatedLlamaAttention):
        def forward(self, x):
            b, t, _ = x.shape
            q, k, v = (p(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
                       for p in (self.q_proj, self.k_proj, self.v_proj))
            y = F.scaled_dot_product_attention(F.rms_norm(q, (self.head_dim,)), k, v, is_causal=True)
            return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))

    torch.manual_seed(0)
    model = torch.nn.Sequential(Normed(64, 4), _UnrotatedLlamaAttention(64, 4))
    monitor = Monitor(MonitorConfig(interval=1, async_transfer=False))
    monitor.attach(model)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    x = torch.randn(3, 24, 64, generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        with caplog.at_level("WARNING", logger="flashwatch"), torch.autocast("cpu", dtype=torch.bfloat16):
            y = compiled(x)
        y.float().square().mean().backward()
        monitor.step()
    normed, plain = monitor.layers
    assert normed.query_mismatch and plain.query_checked and not plain.query_mismatch
    assert sum("is not W^Q x" in r.getMessage() for r in caplog.records) == 1
    snap = monitor.snapshot()
    assert all(math.isnan(snap["flashwatch_wq_error_push"][(0, h)]) for h in range(4))
    assert all(math.isfinite(snap["flashwatch_wq_error_push"][(1, h)]) for h in range(4))
    monitor.detach()
    torch._dynamo.reset()


@pytest.mark.parametrize("backend", BACKENDS)
def test_compiled_observe_mode_leaves_the_gradients_of_the_compiled_model(backend):
    """Observe mode must not change training under torch.compile either (a GPT with layer norms and
    MLPs, whose fused code is where a changed graph would round apart, under BF16 autocast). With
    aot_eager every parameter's gradient, at monitored and unmonitored steps, equals that of the same
    model compiled without a Monitor bit for bit. Inductor may compile the model's own layer norms
    otherwise beside the Monitor's backward operator: on some CPUs (an AMD EPYC with AVX2) it keeps the
    embeddings and the first layer norm's statistics for the backward where without the Monitor it keeps
    that norm's normalised input (sets of one size), and the embeddings' and the second block's
    layer-norm gradients differ by about a unit in the last place of their largest entry (up to 1.1e-7 of
    it measured); so there each gradient is held within 4 units in the last place of its largest entry
    (FP32), which any change of what is computed exceeds."""
    from flashwatch.tinygpt import GPTConfig
    from training_cases import first_difference, gradients

    config = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16)
    plain = gradients(config, "cpu", monitored=False, compile_backend=backend)
    observed = gradients(config, "cpu", monitored=True, compile_backend=backend)
    if backend == "aot_eager":
        assert first_difference(plain, observed) is None
        return
    eps = torch.finfo(torch.float32).eps
    for t, (a_step, b_step) in enumerate(zip(plain, observed)):
        for i, (a, b) in enumerate(zip(a_step, b_step)):
            assert (a - b).abs().max() <= 4 * eps * a.abs().max(), (t, i, first_difference(plain, observed))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16 weights"])
def test_compiled_observe_mode_without_autocast_differs_at_most_in_the_last_bits_of_a_tied_weight(backend, dtype):
    """In FP32 or with BF16 weights (no autocast), compiled: every gradient equals the unmonitored
    model's bit for bit but that of the weight the GPT uses twice (token embedding and output head):
    without the Monitor Inductor folds the embedding's part into the head's matrix product (addmm),
    with the Monitor's operators in the graph it adds the two parts after the product. Only rounding
    may differ there, a few units in the last place of that gradient's largest entry. What the GUIDE
    states."""
    from flashwatch.tinygpt import GPT, GPTConfig
    from training_cases import gradients

    config = GPTConfig(n_layer=2, n_head=4, n_embd=64, block_size=64)
    plain = gradients(config, "cpu", monitored=False, compile_backend=backend, batch=8, autocast=False, dtype=dtype)
    observed = gradients(config, "cpu", monitored=True, compile_backend=backend, batch=8, autocast=False, dtype=dtype)
    names = [n for n, _ in GPT(config).named_parameters()]
    for a_step, b_step in zip(plain, observed):
        for name, a, b in zip(names, a_step, b_step):
            if name == "transformer.wte.weight":
                assert (a - b).abs().max() <= 8 * torch.finfo(dtype).eps * a.abs().max(), name
            else:
                assert torch.equal(a, b), name


def _run_switched(mode: str, backend: str | None, target: str, steps: int = 4, switch_at: int = 2):
    """Train ``steps`` steps in BF16 (where the variants round differently), layer 0 switched to
    ``target`` before step ``switch_at`` (as auto_fix's switch sets it: own-kernel mode, the
    variant); per step, every parameter's gradient."""
    torch.manual_seed(0)
    model = Stack().to(torch.bfloat16)
    monitor = Monitor(MonitorConfig(interval=1, mode=mode, async_transfer=False))
    monitor.attach(model)
    run = model if backend is None else torch.compile(model, backend=backend)
    g = torch.Generator().manual_seed(1)
    grads = []
    for step in range(steps):
        if step == switch_at:
            monitor.layers[0].mode, monitor.layers[0].variant = "own_kernel", target
        x, w = (torch.randn(2, 16, 32, generator=g).to(torch.bfloat16) for _ in range(2))
        (run(x) * w).sum().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        model.zero_grad(set_to_none=True)
        monitor.step()
    variants = monitor.variants
    monitor.detach()
    monitor.close()
    return grads, variants


@pytest.mark.parametrize("target", ["fixed", "fp32_delta"])
@pytest.mark.parametrize("mode", MODES)
def test_a_layer_switched_mid_run_trains_compiled_as_eager(mode, target):
    """auto_fix's switch under torch.compile: the compiled model takes the new variant (one
    recompilation at the switch, no graph break), and every gradient before and after the switch
    is the eager run's, bit for bit (aot_eager: the same kernels)."""
    eager, eager_variants = _run_switched(mode, None, target)
    torch._dynamo.reset()
    counters.clear()
    compiled, compiled_variants = _run_switched(mode, "aot_eager", target)
    assert compiled_variants == eager_variants and compiled_variants[0] == target
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 2  # the graph before the switch, and the one after it
    for step, (e, c) in enumerate(zip(eager, compiled)):
        for a, b in zip(e, c):
            assert torch.equal(a, b), step
    if target == "fp32_delta" or mode == "observe":
        # the switch changed what layer 0 computes (fixed differs from plain only on tied rows, none here)
        unswitched, _ = _run_switched(mode, None, target, switch_at=99)
        assert any(not torch.equal(a, b) for a, b in zip(eager[3], unswitched[3]))


def test_attaching_the_compiled_wrapper_names_the_layers_as_the_model_does():
    """``monitor.attach(torch.compile(model))``: the layers are named as in the model itself (fail
    before: "_orig_mod.blocks.0", which a dashboard then showed and ``MonitorConfig.layers``
    had to spell), also where ``attention=`` names them through the wrapper; the run is measured."""
    torch.manual_seed(0)
    model = Stack()
    compiled = torch.compile(model, backend="aot_eager")
    monitor = Monitor(MonitorConfig(interval=1, async_transfer=False))
    assert [layer.name for layer in monitor.attach(compiled)] == ["blocks.0", "blocks.1", "blocks.2"]
    (compiled(torch.randn(2, 16, 32)) * 1.0).sum().backward()
    monitor.step()
    assert monitor.snapshot()["flashwatch_attention_coverage"] == {(0,): 1.0, (1,): 1.0, (2,): 1.0}
    monitor.detach()
    query = lambda m: m.c_attn.weight[:32].view(2, 16, 32)  # noqa: E731
    named = monitor.attach(compiled, attention={"_orig_mod.blocks.1": query})
    assert [layer.name for layer in named] == ["blocks.1"]
    monitor.detach()


@pytest.mark.parametrize("backend", [None, "aot_eager"], ids=["eager", "aot_eager"])
def test_after_a_forward_that_raised_inside_a_layer_training_goes_on_as_without_it(backend):
    """A forward raises inside the monitored layer 0 (``MonitorConfig(layers=[0])``; the user's
    loop catches it), and training goes on at once: the next forward starts with no layer routed,
    so layer 1's attention is not routed as layer 0's, and losses and layer 0's rows equal those
    of the same run without the failure. Fail before: layer 0 stayed routed until the next
    ``step()`` in eager code (rows doubled), and compiled, its shared state was never cleared:
    every later backward failed ("modified by an inplace operation")."""
    from flashwatch.tinygpt import GPT, GPTConfig

    def run(fail: bool):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16))
        monitor = Monitor(MonitorConfig(interval=1, layers=[0], async_transfer=False))
        monitor.attach(model)
        boom = {"on": False}

        def raise_once(module, args, out):
            if boom["on"]:
                raise RuntimeError("out of memory (simulated)")
        model.transformer.h[0].attn.c_proj.register_forward_hook(raise_once)
        run_model = model if backend is None else torch.compile(model, backend=backend)
        seen = []
        for step in range(3):
            x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(step))
            if fail and step == 1:
                boom["on"] = True
                with pytest.raises(RuntimeError, match="simulated"):
                    run_model(x, x)
                boom["on"] = False
            _, loss = run_model(x, x)
            loss.backward()
            model.zero_grad(set_to_none=True)
            monitor.step(loss=loss.detach())
            seen.append((loss.item(), monitor.signals()["rows"][(0, 0)]))
        monitor.close()
        return seen

    assert run(True) == run(False)
