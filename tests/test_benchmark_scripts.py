"""The GPU-only scripts in benchmarks/ say so and exit 2 on a machine without CUDA."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _benchmark(name: str):
    """The module of ``benchmarks/<name>.py`` (the folder is not a package)."""
    import importlib

    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.pop(0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without CUDA")
@pytest.mark.parametrize("script", ["host_overhead.py", "host_profile.py", "dq_stats_sweep.py", "profile_kernels.py",
                                    "profile_monitored_step.py", "sync_points.py", "step_kernels.py",
                                    "stats_sweep.py", "training_equivalence.py", "plain_sweep.py"])
def test_gpu_only_benchmark_scripts_exit_2_and_say_they_need_cuda(script):
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script)], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "needs CUDA" in proc.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without CUDA")
@pytest.mark.parametrize("script", ["kernel_ab.py", "stats_ab.py"])
def test_kernel_ab_exits_2_without_cuda(script):
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), "--before", "kernels"],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "needs CUDA" in proc.stderr


def test_kernel_ab_loads_a_copy_of_the_kernels_beside_the_package(tmp_path):
    """A before version brings its own jitted kernels: a copy of a kernels/ folder (launchers and
    kernels), or a single file from before they were split."""
    kernel_ab = _benchmark("kernel_ab")
    import flashwatch.kernels.triton_attn as current
    import flashwatch.kernels.triton_kernels as current_kernels

    launchers = (ROOT / "kernels" / "triton_attn.py").read_text()
    jitted = (ROOT / "kernels" / "triton_kernels.py").read_text()
    folder = tmp_path / "before"
    folder.mkdir()
    (folder / "triton_attn.py").write_text(launchers)
    (folder / "triton_kernels.py").write_text(jitted)
    module = kernel_ab.load_before(str(folder), 7)
    assert module is not current and module.flash_attention is not current.flash_attention
    assert module._attn_fwd_kernel is not current._attn_fwd_kernel  # its own kernels, not the tree's
    assert sys.modules["flashwatch.kernels.triton_kernels"] is current_kernels  # and the tree's stay in place

    # one file with kernels and launchers, as kernels/triton_attn.py was before the split
    single = tmp_path / "single.py"
    own_launchers = "\n".join(l for l in launchers.splitlines() if not l.startswith("from .triton_kernels import"))
    single.write_text(own_launchers + "\nimport triton.language as tl\n" + jitted.split("import triton.language as tl\n")[1])
    module = kernel_ab.load_before(str(single), 8)
    assert module._attn_fwd_kernel is not current._attn_fwd_kernel

    with pytest.raises(SystemExit, match="holds only the launchers"):
        kernel_ab.load_before(str(folder / "triton_attn.py"))
    (folder / "triton_kernels.py").unlink()
    with pytest.raises(SystemExit, match="must hold triton_attn.py and triton_kernels.py"):
        kernel_ab.load_before(str(folder))
    not_kernels = tmp_path / "other.py"
    not_kernels.write_text("x = 1\n")
    with pytest.raises(SystemExit, match="has no flash_attention"):
        kernel_ab.load_before(str(not_kernels))


def test_sass_loop_counts_compiles_for_hopper_without_a_gpu(tmp_path):
    """The instruction counts quoted in docs/KERNEL_TUNING.md come from this script; it needs
    only Triton's bundled ptxas and cuobjdump (run apart: the tests interpret Triton)."""
    import json
    import os

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    out = tmp_path / "counts.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "sass_loop_counts.py"), "--kernel", "dq",
                           "--head-dim", "64", "--json", str(out)], capture_output=True, text=True, cwd=ROOT,
                          env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    plain = next(r for r in json.loads(out.read_text()) if r["variant"] == "plain")
    assert plain["registers"] and plain["shared_bytes"] > 0
    main_loop = max(plain["loops"], key=lambda loop: loop["instructions"])
    assert main_loop["opcodes"].get("HGMMA", 0) > 0, "the dQ loop should issue Hopper matrix instructions"
    assert main_loop["opcodes"].get("MUFU", 0) > 0, "and exp2 on the special-function unit"


def test_sass_loop_counts_finds_loops_by_their_backward_branch():
    sass_loop_counts = _benchmark("sass_loop_counts")
    listing = "/*0010*/ FADD R1, R2, R3 ;\n/*0020*/ @P0 BRA 0x10 ;\n/*0030*/ BRA 0x40 ;\n"
    assert sass_loop_counts.loop_counts(listing) == [{"instructions": 2, "opcodes": {"FADD": 1, "BRA": 1}}]


@pytest.mark.slow
def test_monitor_overhead_compiled_arms_run_on_the_cpu(tmp_path):
    """The compiled arms of benchmarks/monitor_overhead.py (a tiny model, aot_eager): each runs,
    compiles one graph without a graph break, and its monitored steps are timed."""
    import json

    monitor_overhead = _benchmark("monitor_overhead")
    out = tmp_path / "compiled.json"
    assert monitor_overhead.main(["--device", "cpu", "--tiny", "--seq", "16", "--batch", "2", "--warmup", "2",
                                  "--steps", "4", "--interval", "2", "--compile", "default", "--only-compiled",
                                  "--backend", "aot_eager", "--json", str(out),
                                  "--arms", "sdpa,sdpa+observe,sdpa+observe_no_chain,own_kernel,own_kernel+monitor"]) == 0
    arms = {a["arm"]: a for a in json.loads(out.read_text())["arms"]}
    assert set(arms) == {"sdpa@default", "sdpa+observe@default", "sdpa+observe_no_chain@default", "own_kernel@default",
                         "own_kernel+monitor@default"}
    assert arms["sdpa+observe_no_chain@default"]["monitored_steps"] == 2
    for arm in arms.values():
        assert "error" not in arm and arm["graph_breaks"] == 0 and arm["unique_graphs"] == 1, arm
        assert arm["cudagraph_partitions"] == arm["cudagraph_skips"] == 0, arm  # no CUDA graphs in this mode
    assert arms["sdpa+observe@default"]["monitored_steps"] == 2 and "mean_overhead_vs_baseline" in arms["own_kernel@default"]
    for arm in arms.values():  # per-step device and host times, and the host's cost from an idle device
        assert len(arm["step_ms"]) == len(arm["host_ms"]) == len(arm["step_monitored"]) == 4, arm
        assert sum(arm["step_monitored"]) == arm["monitored_steps"]
        assert arm["host_enqueue_ms"]["unmonitored"] > 0 and isinstance(arm["generated_code"], list)
    assert arms["sdpa+observe@default"]["host_enqueue_ms"]["monitored"] > 0
    observed = arms["sdpa+observe@default"]  # the overheads by the medians too (one slow step moves a mean)
    times = observed["step_ms"]
    mon = sorted(t for t, m in zip(times, observed["step_monitored"]) if m)
    unmon = sorted(t for t, m in zip(times, observed["step_monitored"]) if not m)
    assert observed["monitored_vs_unmonitored_median"] == pytest.approx(
        (mon[0] + mon[1]) / (unmon[0] + unmon[1]) - 1.0)  # two of each: a median is their mean


@pytest.mark.slow
def test_monitor_overhead_times_the_baseline_again_and_compares_with_both_runs(tmp_path, capsys):
    """``--baseline-again``: the sdpa arm runs once more after the others; every arm's overhead is
    against the mean of the two sdpa runs, and their drift is recorded and printed. Fails before:
    the option did not exist, and every arm was compared with the first run alone."""
    import json

    monitor_overhead = _benchmark("monitor_overhead")
    out = tmp_path / "again.json"
    assert monitor_overhead.main(["--device", "cpu", "--tiny", "--seq", "16", "--batch", "2", "--warmup", "2",
                                  "--steps", "4", "--interval", "2", "--compile", "default", "--only-compiled",
                                  "--backend", "aot_eager", "--json", str(out), "--arms", "sdpa,sdpa+observe",
                                  "--baseline-again"]) == 0
    arms = [a for a in json.loads(out.read_text())["arms"]]
    assert [a["arm"] for a in arms] == ["sdpa@default", "sdpa+observe@default", "sdpa@default again"]
    first, observed, again = arms
    both = (first["mean_ms"] + again["mean_ms"]) / 2
    assert observed["baseline_ms"] == pytest.approx(both)
    assert observed["mean_overhead_vs_baseline"] == pytest.approx(observed["mean_ms"] / both - 1.0)
    assert first["drift_of_the_baseline_again"] == pytest.approx(again["mean_ms"] / first["mean_ms"] - 1.0)
    assert "sdpa@default again, after the other arms" in capsys.readouterr().out


@pytest.mark.slow
def test_monitor_overhead_interleaves_the_compiled_arms_in_turns(tmp_path):
    """``--interleave 2``: the compiled arms, built and compiled first, are timed two steps at a time
    in turn, each round starting one arm further on; each arm compiles before the timed steps and
    not in them (one graph for the model without a Monitor, whose class differs from the monitored
    one's), and every attention call of the observed arm's monitored steps is measured. Fails
    before: the option did not exist."""
    import json

    monitor_overhead = _benchmark("monitor_overhead")
    out = tmp_path / "interleaved.json"
    assert monitor_overhead.main(["--device", "cpu", "--tiny", "--seq", "16", "--batch", "2", "--warmup", "2",
                                  "--steps", "6", "--interval", "2", "--compile", "default", "--only-compiled",
                                  "--backend", "aot_eager", "--json", str(out), "--arms", "sdpa,sdpa+observe",
                                  "--interleave", "2", "--stall-stacks", "0.001"]) == 0
    sdpa, observed = json.loads(out.read_text())["arms"]
    assert [sdpa["arm"], observed["arm"]] == ["sdpa@default", "sdpa+observe@default"]
    first = min(sdpa["step_sequence"])
    order = sorted([(i - first, "sdpa") for i in sdpa["step_sequence"]]
                   + [(i - first, "observe") for i in observed["step_sequence"]])
    assert [arm for _, arm in order] == ["sdpa"] * 2 + ["observe"] * 4 + ["sdpa"] * 4 + ["observe"] * 2
    assert [i for i, _ in order] == list(range(12))
    for arm in (sdpa, observed):
        assert arm["steps"] == 6 and arm["interleaved_steps"] == 2 and arm["graph_breaks"] == 0, arm
        assert arm["triton_compiles_timed"] == []  # none on the CPU (the interpreter compiles nothing)
        assert [stall["step"] for stall in arm["host_stalls"]] == list(range(6))  # every step held it 1 us
        assert any(n > 0 and frames for stall in arm["host_stalls"] for n, frames in stall["stacks"])
    assert sdpa["unique_graphs"] == 1 and observed["unique_graphs"] == 1  # none compiled in the timed turns
    assert observed["step_monitored"] == [True, False] * 3 and "mean_overhead_vs_baseline" in observed
    assert observed["min_coverage"] == 1.0 and sdpa["min_coverage"] is None
    with pytest.raises(SystemExit):
        monitor_overhead.main(["--device", "cpu", "--tiny", "--compile", "default", "--interleave", "2",
                               "--baseline-again"])


def test_monitor_overhead_names_the_triton_compilations_of_the_timed_steps(monkeypatch):
    """Triton's compile hook, chained to one already set, records the kernels compiled while an arm's
    timed steps run and nothing outside them (each is a host stall inside a timed step)."""
    knobs = pytest.importorskip("triton").knobs
    monitor_overhead = _benchmark("monitor_overhead")
    earlier = []
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", lambda *a, **kw: earlier.append(kw["repr"]) or False)
    compiles = monitor_overhead._TritonCompiles()
    compiles.install()
    compiles.install()  # a second main() in one process: still one hook, chained once
    hook = knobs.runtime.jit_cache_hook
    timed: list = []
    assert hook(repr="_attn_fwd_kernel[num_warps=4](Q: *bf16)") is False  # warm-up: not recorded
    with compiles.timing(timed):
        hook(repr="_attn_stats_kernel[num_warps=4](Q: *bf16)")
    hook(repr="_add_partials_kernel[num_warps=4](PART_UGV: *fp32)")
    assert timed == ["_attn_stats_kernel"] and len(earlier) == 3


def test_monitor_overhead_records_the_full_garbage_collections_of_the_timed_steps():
    """gc.callbacks, installed once, record each full collection made while an arm's timed steps run,
    with the step it fell in, and nothing outside them."""
    import gc

    monitor_overhead = _benchmark("monitor_overhead")
    pauses = monitor_overhead._GcPauses()
    try:
        pauses.install()
        pauses.install()
        assert gc.callbacks.count(pauses._callback) == 1
        gc.collect()  # not timed: not recorded
        timed: list = []
        with pauses.timing(timed, lambda: 7):
            gc.collect()
        gc.collect()
        assert len(timed) == 1 and timed[0][:2] == [7, 2] and timed[0][2] >= 0
    finally:
        gc.callbacks.remove(pauses._callback)


def _held_in_a_named_function(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def test_monitor_overhead_samples_the_stacks_of_a_stalled_step():
    """The stack sampler keeps the main thread's stacks by host time: those sampled while a function
    held the host name it, most often first; those outside the window are not counted."""
    monitor_overhead = _benchmark("monitor_overhead")
    sampler = monitor_overhead._StackSampler(period=0.002)
    sampler.start()
    try:
        time.sleep(0.05)
        t0 = time.perf_counter()
        _held_in_a_named_function(0.4)
        t1 = time.perf_counter()
        time.sleep(0.05)
    finally:
        sampler.stop()
    stacks = sampler.during(t0, t1)
    counted = sum(n for n, _ in stacks)
    # the sampler needs the GIL, which the busy loop gives up every 5 ms (sys.getswitchinterval)
    assert counted >= 5 and stacks[0][0] >= counted // 2
    assert "_held_in_a_named_function" in stacks[0][1][0]
    assert sum(n for n, _ in sampler.during(0.0, float("inf"))) > counted  # the sleeps were sampled too


@pytest.mark.usefixtures("interpret_dispatch")
@pytest.mark.parametrize("tile", [(256, 16), (16, 256), (8, 512)])
def test_partials_sweep_checks_each_tile_against_float64(tile):
    """benchmarks/partials_sweep.py's check, interpreted: add_partials at each tile (ragged slots and
    columns: T 6, W 24) within FP32's bound of the float64 sum; a wrong sum is caught."""
    from flashwatch.kernels import chain_sums

    partials_sweep = _benchmark("partials_sweep")
    assert partials_sweep.check((2, 3, 3, 4, 6), *tile, "cpu") <= 1.0
    add = chain_sums._add_partials_kernel
    try:  # a kernel that drops its last slot: far over the bound
        chain_sums._add_partials_kernel = _DropsLastSlot(add)
        with pytest.raises(AssertionError, match="times FP32's bound"):
            partials_sweep.check((2, 3, 3, 4, 6), *tile, "cpu")
    finally:
        chain_sums._add_partials_kernel = add


class _DropsLastSlot:
    """``_add_partials_kernel`` told there is one slot fewer than there is."""

    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        def run(part_ugv, part_sketch, ugv, sketch, H, S, T, W, **kwargs):
            return self.kernel[grid](part_ugv, part_sketch, ugv, sketch, H, S, T - 1, W, **kwargs)
        return run


def test_launch_overhead_times_the_cached_path_and_leaves_the_switch_as_it_was():
    """Part 1 of benchmarks/launch_overhead.py runs without a GPU; it turns the opt-in cache on for
    its own timing and restores the switch afterwards (a fresh process: Triton's import state)."""
    pytest.importorskip("triton")
    code = ("import launch_overhead\n"
            "from flashwatch.kernels import launch\n"
            "was = launch.FAST_LAUNCH\n"
            "r = launch_overhead.python_launch_us(number=50)\n"
            "assert launch.FAST_LAUNCH is was, 'switch not restored'\n"
            "assert set(r) == {'forward', 'dQ', 'dK/dV', 'statistics'}, r\n"
            "assert all(x['cached_us'] > 0 and x['ordinary_us'] > 0 for x in r.values()), r\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT / "benchmarks",
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_own_kernel_host_times_eager_and_compiled_calls_on_cpu_stand_ins():
    """benchmarks/own_kernel_host.py runs without a GPU: every case (eager and compiled,
    unmonitored and monitored, ordinary and cached launch) is timed and profiled into phases,
    the launches end in stand-ins (no kernel runs), and the cache switch, the kernels and
    TRITON_INTERPRET are restored afterwards (a fresh process: Triton's import state)."""
    pytest.importorskip("triton")
    code = ("import os, own_kernel_host\n"
            "from flashwatch.kernels import launch, triton_attn\n"
            "was, kernel = launch.FAST_LAUNCH, triton_attn._attn_fwd_kernel\n"
            "r = own_kernel_host.measure((1, 2, 64, 16), layers=2, rounds=1, calls=1, kinds=own_kernel_host.KINDS)\n"
            "assert launch.FAST_LAUNCH is was and triton_attn._attn_fwd_kernel is kernel, 'not restored'\n"
            "assert 'TRITON_INTERPRET' not in os.environ\n"
            "assert len(r) == 6, list(r)\n"
            "for case, row in r.items():\n"
            "    assert row['ordinary'] > 0 and row['cached'] > 0, (case, row)\n"
            "    f = row['profile']['fractions']\n"
            "    assert abs(sum(f.values()) - 1) < 1e-6 and f['Triton launch (JITFunction.run, launch cache)'] > 0, f\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT / "benchmarks",
                          timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_host_half_times_every_phase_of_a_monitored_step_on_the_cpu(tmp_path, capsys):
    """benchmarks/host_half.py: a real Monitor on a tiny GPT, every step monitored and measured
    (no error counted), each phase timed; with an exporter the snapshot and the record are made
    inside the host half, without one they are not; --profile prints the host half's hot spots;
    the "flashwatch" logger is left as it was."""
    import json
    import logging

    host_half = _benchmark("host_half")
    out = tmp_path / "host_half.json"
    handlers, propagate = logging.getLogger("flashwatch").handlers[:], logging.getLogger("flashwatch").propagate
    assert host_half.main(["--layers", "2", "--heads", "3", "--steps", "4", "--warmup", "1", "--exporters", "jsonl",
                           "--profile", "5", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["heads"] == 6 and result["steps"] == 4 and result["exporters"] == ["jsonl"]
    phases = result["phases"]
    assert set(phases) == {*host_half.PHASES, host_half.WITHOUT_EXPORT, host_half.TOTAL}
    for phase in ("signals", "decide", "record", "snapshot", "exporters", host_half.TOTAL):
        assert phases[phase]["median_ms"] > 0, phase
    assert phases[host_half.WITHOUT_EXPORT]["median_ms"] < phases[host_half.TOTAL]["median_ms"]
    assert "function calls" in result["profile"] and "host half" in capsys.readouterr().out

    assert host_half.main(["--layers", "1", "--heads", "2", "--steps", "2", "--warmup", "0", "--json", str(out)]) == 0
    phases = json.loads(out.read_text())["phases"]
    assert phases["signals"]["median_ms"] > 0
    assert phases["snapshot"]["median_ms"] == phases["record"]["median_ms"] == phases["exporters"]["median_ms"] == 0
    with pytest.raises(SystemExit):
        host_half.main(["--heads", "0"])
    logger = logging.getLogger("flashwatch")  # left as it was: later tests read its handlers
    assert (logger.handlers, logger.propagate) == (handlers, propagate)


def test_step_kernels_names_a_kernel_by_what_identifies_it():
    """Template arguments, argument lists and Triton's numeric suffixes go; the rest stays, so one
    kernel's launches in two arms add up under one name."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from step_kernels import short_name
    finally:
        sys.path.pop(0)
    assert short_name("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float> >(int)") == \
        "void at::native::vectorized_elementwise_kernel"
    assert short_name("triton_red_fused__to_copy_native_layer_norm_12") == "triton_red_fused__to_copy_native_layer_norm"
    assert short_name("_attn_fwd_kernel") == "_attn_fwd_kernel"
    assert short_name("Memcpy DtoD (Device -> Device)") == "Memcpy DtoD"


def test_step_kernels_host_table_names_host_time_and_the_issue_time():
    """With --host the table reads CPU self time per operator and runtime call, and heads with each
    arm's time to issue a step; the rows are sorted by the difference between the arms."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from step_kernels import table
    finally:
        sys.path.pop(0)
    a = {"arm": "sdpa@compiled", "step_ms": 35.0, "issue_ms": 26.0, "device_ms": 20.0, "host": True,
         "kernels": {"aten::mm": 5.0, "cudaLaunchKernel": 4.0}, "calls_per_step": {"aten::mm": 98, "cudaLaunchKernel": 400}}
    b = dict(a, arm="own_kernel@compiled", step_ms=37.0, issue_ms=36.0, device_ms=30.0,
             kernels={"aten::mm": 5.0, "cudaLaunchKernel": 4.5, "flashwatch::attention_grad": 6.0},
             calls_per_step={"aten::mm": 98, "cudaLaunchKernel": 436, "flashwatch::attention_grad": 12})
    lines = table(a, b, top=3).splitlines()
    assert "host self time 20.00 ms" in lines[0] and "host to issue a step 26.00 / 36.00 ms" in lines[0]
    assert lines[1].startswith("operator or runtime call (ms per step)")
    assert lines[2].startswith("flashwatch::attention_grad") and lines[3].startswith("cudaLaunchKernel")
    assert lines[3].rstrip().endswith("400/436")


def test_profile_pieces_count_each_host_range_once_with_nesting():
    """The Monitor's pieces are read from the ranges' host-side events: every call counted, a
    nested range inside its parent too, a range never entered reported with no calls."""
    from torch.profiler import ProfilerActivity, profile, record_function

    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import profile_monitored_step as pm
    finally:
        sys.path.pop(0)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with record_function("fw::outer"):
            torch.randn(64, 64) @ torch.randn(64, 64)
            with record_function("fw::inner"):
                torch.randn(8)
        with record_function("fw::inner"):
            pass
    times = pm.piece_times(prof.events(), ["fw::outer", "fw::inner", "fw::never"])
    assert [times[n][0] for n in ("fw::outer", "fw::inner", "fw::never")] == [1, 2, 0]
    assert times["fw::outer"][2] > 0 and times["fw::never"][1:] == (0.0, 0.0)


@pytest.mark.parametrize("script", sorted(p.relative_to(ROOT).as_posix() for p in
                                          [*ROOT.glob("benchmarks/*.sh"), *ROOT.glob("research/*.sh")]))
def test_device_shell_scripts_parse(script):
    """The scripts run on the device machine parse (bash -n): a syntax error there costs a GPU call."""
    proc = subprocess.run(["bash", "-n", str(ROOT / script)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_training_equivalence_finds_observe_mode_leaves_the_eager_step_bit_for_bit(capsys):
    """The CPU smoke of benchmarks/training_equivalence.py: every arm trains from the same weights on the
    same batches; observe mode's losses equal SDPA's bit for bit, own-kernel mode's stay within rounding,
    and every arm's first gradient is near the float64 one."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import training_equivalence as te
    finally:
        sys.path.pop(0)
    torch.manual_seed(0)
    cfg = te._config(True, 32)
    state = {k: v.detach().clone() for k, v in te.GPT(cfg).state_dict().items()}
    batches = te._batches(cfg, 2, 32, "cpu")
    g64 = te.reference_gradient(cfg, state, batches[0])
    arms = [te.run_arm(n, cfg, state, batches, 4, "cpu", g64, interval=2)
            for n in ("sdpa", "sdpa_again", "observe", "own_kernel")]
    te.compare(arms)
    by = {a["arm"]: a for a in arms}
    assert by["sdpa_again"]["bitwise"]  # the premise of a bit-for-bit comparison: one arm run twice agrees
    assert by["observe"]["bitwise"] and by["observe"]["reference"] == "sdpa"
    assert not by["own_kernel"]["bitwise"] and by["own_kernel"]["max_gap"] < 1e-2
    assert all(a["grad_error"] < 2e-2 for a in arms)  # BF16 autocast: ~5e-3 against float64 here
    assert by["own_kernel"]["agree_steps"] == 4 and by["own_kernel"]["median_gap"] <= by["own_kernel"]["max_gap"]


def test_training_equivalence_tells_a_moved_spike_from_a_changed_curve():
    """A spike one step later makes a large max gap but leaves the steps before it agreeing and the
    median gap small; a curve that drifts away agrees for fewer steps."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import training_equivalence as te
    finally:
        sys.path.pop(0)
    base = [10.6] * 20
    arms = [{"arm": "sdpa", "losses": base[:10] + [12.3] + base[11:]},
            {"arm": "observe", "losses": base[:11] + [12.3] + base[12:]},
            {"arm": "own_kernel", "losses": [10.6 + 0.01 * i for i in range(20)]}]
    te.compare(arms)
    moved, drifted = arms[1], arms[2]
    assert (moved["agree_steps"], moved["median_gap"], round(moved["max_gap"], 6)) == (10, 0.0, 1.7)
    assert drifted["agree_steps"] == 1 and drifted["median_gap"] > 0.05 and not drifted["bitwise"]
    assert "reference" not in arms[0]


def test_training_equivalence_reports_a_failing_arm_and_runs_the_rest(monkeypatch, capsys, tmp_path):
    """An arm that raises (say, an operator without a deterministic algorithm on the GPU) is reported
    with its error, in the output and the JSON, the other arms still run, and the exit code says so."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import training_equivalence as te
    finally:
        sys.path.pop(0)
    real = te.run_arm

    def run_arm(name, *args, **kwargs):
        if name == "own_kernel":
            raise RuntimeError("no deterministic implementation")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(te, "run_arm", run_arm)
    out = tmp_path / "eq.json"
    # --nondeterministic: the switch is process-wide (the CPU's kernels are deterministic anyway)
    rc = te.main(["--device", "cpu", "--tiny", "--seq", "16", "--batch", "1", "--steps", "2", "--no-compile",
                  "--nondeterministic", "--json", str(out)])
    text = capsys.readouterr().out
    assert rc == 1 and "own_kernel             failed: RuntimeError: no deterministic implementation" in text
    result = json.loads(out.read_text())
    assert [a["arm"] for a in result["arms"]] == ["sdpa", "sdpa_again", "observe"]
    assert result["failed"] == [{"arm": "own_kernel", "error": "RuntimeError: no deterministic implementation"}]


def test_step_kernels_names_a_python_function_by_file_line_and_name():
    """cProfile's keys become ``file.py:line(function)`` without folders, built-ins keep their name, so
    the two arms' rows of one function add up under one name."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from step_kernels import function_name
    finally:
        sys.path.pop(0)
    assert function_name(("/tmp/torchinductor_x/ab/cabc.py", 812, "call")) == "cabc.py:812(call)"
    assert function_name(("~", 0, "<method 'item' of 'torch._C.TensorBase' objects>")) == \
        "<method 'item' of 'torch._C.TensorBase' objects>"


def test_step_kernels_python_profile_counts_self_time_and_calls_per_step(monkeypatch):
    """Each profiled step's Python functions: calls divided by the steps, self time in ms per step."""
    step_kernels = _benchmark("step_kernels")
    monkeypatch.setattr(step_kernels.torch.cuda, "synchronize", lambda: None)  # no device here

    def leaf():
        return sum(range(2000))

    def step():
        leaf()
        leaf()
        leaf()

    result = step_kernels.python_profile(step, 4, "arm")
    name = next(n for n in result["kernels"] if n.endswith("(leaf)"))
    assert result["calls_per_step"][name] == 3
    assert 0 < result["kernels"][name] <= result["issue_ms"]


@pytest.mark.parametrize("arms", ["sdpa", "sdpa,observe,own_kernel", "sdpa,observed"])
def test_step_kernels_refuses_arms_it_does_not_know_and_lists_the_ones_it_does(arms):
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "step_kernels.py"), "--arms", arms],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "--arms takes two of sdpa, own_kernel, observe, observe_monitored, own_kernel_monitored" in proc.stderr
    assert repr(arms) in proc.stderr


def test_the_wide_statistics_sweep_tries_only_tiles_the_kernel_accepts():
    """``stats_sweep.py --wide``: causal key loops take whole key blocks (BLOCK_M % BLOCK_N == 0), and
    none repeats an autotuner candidate."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import stats_sweep
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    from flashwatch.kernels import tuning

    wide = stats_sweep.wide_candidates()
    assert wide and all(c["BLOCK_M"] % c["BLOCK_N"] == 0 for c in wide)
    assert not [c for c in wide if c in tuning.CANDIDATES["stats_rows"]]
    assert len({tuple(sorted(c.items())) for c in wide}) == len(wide)


@pytest.mark.slow
@pytest.mark.parametrize("mask", ["causal", "causal-dropout"])
def test_monitor_overhead_with_a_causal_mask_tensor_runs_on_the_cpu(tmp_path, mask):
    """``--mask causal`` (the attention given its causal mask as a tensor, as Hugging Face passes it
    under compile), and with attention dropout: the compiled arms run, one graph, no graph break,
    the monitored steps timed."""
    import json

    monitor_overhead = _benchmark("monitor_overhead")
    out = tmp_path / "masked.json"
    assert monitor_overhead.main(["--device", "cpu", "--tiny", "--seq", "16", "--batch", "2", "--warmup", "2",
                                  "--steps", "4", "--interval", "2", "--compile", "default", "--only-compiled",
                                  "--backend", "aot_eager", "--json", str(out), "--arms", "sdpa,sdpa+observe",
                                  "--mask", mask]) == 0
    result = json.loads(out.read_text())
    assert result["args"]["mask"] == mask
    for arm in result["arms"]:
        assert "error" not in arm and arm["graph_breaks"] == 0 and arm["unique_graphs"] == 1, arm
    assert {a["arm"]: a["monitored_steps"] for a in result["arms"]} == {"sdpa@default": 0, "sdpa+observe@default": 2}


def test_masked_statistics_runs_on_the_cpu(tmp_path):
    """benchmarks/masked_statistics.py, tiny on the CPU: the causal mask's shortcut is the plain pass,
    the dense pass counts the same rows, and the dense pass is put back afterwards."""
    import json

    masked_statistics = _benchmark("masked_statistics")
    from flashwatch.kernels import masked

    chosen = masked._plain_equivalent
    out = tmp_path / "masked.json"
    assert masked_statistics.main(["--device", "cpu", "--shape", "1,2,64,16", "--reps", "1", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["shortcut_equals_plain"] and masked._plain_equivalent is chosen
    rows = result["statistics"]["rows"]
    assert rows["shortcut"] == rows["dense"] == [64.0, 64.0]


def test_masked_statistics_compares_counts_exactly_and_sums_to_a_millionth():
    """The comparison allows the FP32 sums' atomic-order bits on CUDA, and nothing more."""
    same = _benchmark("masked_statistics")._same_statistics
    want = {"rows": [64.0], "max_logit": [3.5], "delta_error": [1e-3], "delta_error_abs": [2.0]}
    assert same(dict(want, delta_error=[1e-3 + 1e-7]), want)
    assert not same(dict(want, delta_error=[1e-3 + 1e-5]), want)
    assert not same(dict(want, rows=[63.0]), want)
    assert not same(dict(want, delta_error_abs=[2.0 + 1e-5]), want)


def test_monitored_step_host_stub_reads_as_measured():
    """benchmarks/monitored_step_host.py's stub statistics count the rows the kernel would, so the
    host half it times is a measured step's, without a coverage alert's work (it had one per layer)."""
    from flashwatch.kernels import reference

    host = _benchmark("monitored_step_host")
    real = reference.attention_statistics
    try:
        mon, step = host.build("stub", batch=1, seq=8, n_embd=192)
        for _ in range(2):
            step()
    finally:
        reference.attention_statistics = real
    assert mon.monitored_steps == 1
    assert mon.alert_counts["attention_coverage"] == 0


@pytest.mark.parametrize("kind", ["hf", "padding"])
def test_masked_kernel_arms_compute_one_function(kind):
    """benchmarks/masked_kernel.py's arms on the CPU (flashwatch's reference path): every masked arm is
    SDPA with the same mask, the causal arms each other, so its ratios compare like with like."""
    bench = _benchmark("masked_kernel")
    mask = bench.make_mask(kind, 2, 20, device="cpu")
    assert mask.shape == ((2, 1, 20, 20) if kind == "hf" else (2, 1, 1, 20))
    assert not mask[1].all() and mask[0].any()
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 20, 16, generator=g) for _ in range(3))  # FP32: computed without TF32
    outs = {name: fn(q, k, v, False) for name, fn in bench.arms(mask).items()}
    for name in ("own_masked", "own_masked_fp32_delta"):
        torch.testing.assert_close(outs[name], outs["sdpa_masked"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(outs["own_causal"], outs["sdpa_causal"], rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="hf or padding"):
        bench.make_mask("diagonal", 2, 20, device="cpu")
