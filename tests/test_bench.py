"""flashwatch bench's arithmetic and its CPU behaviour (the timings themselves need CUDA)."""

from __future__ import annotations

import json

import pytest
import torch

from flashwatch import bench
from flashwatch.cli import main


def test_flops_follow_the_flash_attention_convention():
    # causal attention counts half the dense 4*B*H*N^2*D forward FLOPs
    assert bench.attention_flops((16, 12, 1024, 64), causal=True) == 0.5 * 4 * 16 * 12 * 1024 ** 2 * 64
    assert bench.attention_flops((1, 1, 8, 16), causal=False) == 4 * 8 * 8 * 16


def test_shape_parsing_names_what_is_accepted():
    assert bench.parse_shape("16,12,1024,64") == (16, 12, 1024, 64)
    with pytest.raises(ValueError, match="four positive integers B,H,N,D"):
        bench.parse_shape("16,12,1024")
    with pytest.raises(ValueError, match="four positive integers"):
        bench.parse_shape("16,12,0,64")


def test_rounds_take_the_median_and_keep_the_spread():
    rounds = [{"fwd_ms": 1.0, "fwd_bwd_ms": 2.0}, {"fwd_ms": 3.0, "fwd_bwd_ms": 2.5}, {"fwd_ms": 2.0, "fwd_bwd_ms": 2.2}]
    t = bench._median_of_rounds(rounds)
    assert t["fwd_ms"] == 2.0 and t["fwd_bwd_ms"] == 2.2 and t["rounds"] == 3
    assert t["fwd_bwd_spread"] == pytest.approx(0.25)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without CUDA")
def test_without_cuda_it_says_so_and_fails(capsys):
    assert main(["bench", "--quick"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err  # errors go to stderr


def _row(device: dict) -> dict:
    k = lambda fwd, fb: {"fwd_ms": fwd, "fwd_bwd_ms": fb, "fwd_tflops": 1.0, "fwd_bwd_tflops": 1.0,
                         "peak_extra_mib": 1.0}
    row = {"shape": [1, 2, 64, 16], "kernels": {"sdpa_flash": k(1.0, 4.0), "plain": k(0.5, 5.0),
                                                 "plain_stats": k(0.6, 6.0)}}
    for name, ms in device.items():
        if isinstance(ms, str):
            row["kernels"][name]["fwd_bwd_device_error"] = ms
        else:
            row["kernels"][name]["fwd_bwd_device_ms"] = ms
    return row


def test_ratios_for_event_and_device_timings():
    row = _row({"sdpa_flash": 3.0, "plain": 2.0, "plain_stats": 2.5})
    bench.add_ratios(row)
    plain, stats = row["kernels"]["plain"], row["kernels"]["plain_stats"]
    assert plain["fwd_speed_vs_sdpa_flash"] == 2.0 and plain["fwd_bwd_speed_vs_sdpa_flash"] == pytest.approx(0.8)
    assert plain["fwd_bwd_device_speed_vs_sdpa_flash"] == 1.5  # faster on the device, slower by the events
    assert stats["fwd_bwd_overhead_vs_plain"] == pytest.approx(0.2)
    assert stats["fwd_bwd_device_overhead_vs_plain"] == pytest.approx(0.25)
    bare = _row({})  # without --device-time: no device keys at all
    bench.add_ratios(bare)
    assert not any(key.startswith("fwd_bwd_device") for t in bare["kernels"].values() for key in t)


def test_device_table_is_printed_only_when_measured():
    from rich.console import Console

    def render(row):
        console = Console(record=True, width=200)
        bench.add_ratios(row)
        bench.print_table({"environment": {"gpu": "G", "torch": "t", "triton": "tr", "date": "d"},
                           "results": [row]}, console)
        return console.export_text()

    text = render(_row({"sdpa_flash": 3.0, "plain": 2.0, "plain_stats": "RuntimeError: capture failed"}))
    assert "GPU time alone" in text and "1.50" in text and "RuntimeError: capture" in text
    assert "GPU time alone" not in render(_row({}))


def test_device_time_is_an_option_of_the_cli():
    from flashwatch.cli import build_parser

    args = build_parser().parse_args(["bench", "--quick", "--device-time"])
    assert args.device_time and args.quick
    assert not build_parser().parse_args(["bench"]).device_time


def _fake_timing(monkeypatch):
    """bench with the GPU parts replaced: every kernel 'takes' 1 ms; returns the cases timed."""
    seen = []

    def fake_time(fn, shape, causal, dtype, rep_ms=100):
        seen.append((tuple(shape), causal, dtype))
        return {"fwd_ms": 1.0, "fwd_bwd_ms": 2.0, "peak_extra_mib": 0.0}
    monkeypatch.setattr(bench, "time_kernel", fake_time)
    monkeypatch.setattr(bench, "kernel_functions", lambda: {name: None for name in bench.KERNELS})
    monkeypatch.setattr(bench, "environment", lambda: {"date": "d", "gpu": "g", "torch": "t", "triton": "tr"})
    return seen


def test_the_default_run_adds_a_non_causal_and_an_fp16_row(monkeypatch):
    seen = _fake_timing(monkeypatch)
    report = bench.run_bench(rounds=1, extra_cases=bench.EXTRA_CASES)
    cases = [(tuple(r["shape"]), r["causal"], r["dtype"]) for r in report["results"]]
    first = bench.DEFAULT_SHAPES[0]
    assert cases == [(s, True, "bfloat16") for s in bench.DEFAULT_SHAPES] + \
        [(first, False, "bfloat16"), (first, True, "float16")]
    assert (first, True, torch.float16) in seen and (first, False, torch.bfloat16) in seen
    labels = [bench.case_label(r) for r in report["results"]]
    assert labels[-2:] == ["16,12,1024,64 non-causal", "16,12,1024,64 float16"]
    assert labels[0] == "16,12,1024,64"


@pytest.mark.parametrize("argv, extra", [([], True), (["--shape", "1,2,64,16"], False), (["--dtype", "fp16"], False),
                                         (["--no-causal"], False)])
def test_a_named_shape_mask_or_dtype_times_only_that(monkeypatch, argv, extra):
    _fake_timing(monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    captured = {}
    real = bench.run_bench

    def spy(*a, **k):
        captured.update(k)
        return real(*a, **k)
    monkeypatch.setattr(bench, "run_bench", spy)
    monkeypatch.setattr(bench, "print_table", lambda report: None)
    assert main(["bench", *argv]) == 0
    assert bool(captured["extra_cases"]) is extra


def test_sweep_configurations_times_each_candidate_under_its_override(monkeypatch, capsys):
    """Each candidate is the kind's override while it is timed (and only then); one that fails is
    reported, not fatal; the fastest is returned and marked."""
    from flashwatch.kernels import tuning

    cands = [tuning._cfg(64, 64, 4, 3), tuning._cfg(64, 32, 4, 3), tuning._cfg(128, 32, 8, 3)]
    monkeypatch.setitem(tuning.CANDIDATES, "stats_rows", cands)
    seen = []

    def time_ms():
        cfg = tuning.choose("stats_rows", torch.zeros(1, 1, 16, 64, device="meta"), True, None)
        seen.append(cfg)
        if cfg["BLOCK_M"] == 128:
            raise RuntimeError("out of shared memory")
        return 2.0 if cfg["BLOCK_N"] == 64 else 1.5

    results, best = bench.sweep_configurations("stats_rows", time_ms, base_ms=1.0)
    assert seen == cands and "stats_rows" not in tuning._override
    assert [r.get("ms") for r in results] == [2.0, 1.5, None] and "out of shared memory" in results[2]["error"]
    assert best is results[1] and results[1]["over_base"] == pytest.approx(0.5)
    bench.print_sweep(results, best, cands[0], unit="us")
    out = capsys.readouterr().out.splitlines()
    assert out[0].endswith("(table)") and out[1].endswith("<- best") and "1500.000 us" in out[1]
    assert "failed: RuntimeError" in out[2]
    bench.print_sweep(results, best, cands[0], peer_ms=3.0)  # against a peer: its time over each candidate's
    out = capsys.readouterr().out.splitlines()
    assert "1.50x" in out[0] and out[1].endswith("2.00x <- best") and "failed" in out[2]


def test_a_sweeps_json_holds_its_rows_and_environment(tmp_path, monkeypatch):
    """write_sweep_json writes the rows with the environment they were measured in, and nothing
    without a path."""
    monkeypatch.setattr(bench, "environment", lambda: {"gpu": "test"})
    path = tmp_path / "sweep.json"
    bench.write_sweep_json(str(path), [{"shape": [1, 2, 3, 4]}])
    assert json.loads(path.read_text()) == {"environment": {"gpu": "test"}, "rows": [{"shape": [1, 2, 3, 4]}]}
    bench.write_sweep_json(None, [{"shape": [1]}])
    assert list(tmp_path.iterdir()) == [path]


def test_the_chain_column_times_the_kernels_reduction_against_plain(monkeypatch):
    """plain_stats_chain is timed against plain like the statistics, and its kernel function gives
    the statistics a rows hook that offers the chain's reduction (factors shaped like q's)."""
    row = _row({})
    row["kernels"]["plain_stats_chain"] = dict(row["kernels"]["plain_stats"], fwd_bwd_ms=7.0)
    bench.add_ratios(row)
    assert row["kernels"]["plain_stats_chain"]["fwd_bwd_overhead_vs_plain"] == pytest.approx(0.4)
    assert "plain_stats_chain" in bench.KERNELS and "plain_stats_chain" in bench.OVER_PLAIN
    from flashwatch.chain import SKETCH_DIM

    seen = []
    import flashwatch.kernels as fk
    monkeypatch.setattr(fk, "flash_attention", lambda q, k, v, stats=None, **kw: seen.append(stats) or q)
    run = bench.kernel_functions()["plain_stats_chain"]
    q = torch.zeros(2, 3, 16, 8)
    run(q, q, q, True)
    run(q, q, q, True)
    stats = seen[0]
    assert stats is seen[1]  # kept across calls, as a Monitor keeps its layers'
    r = stats.rows_hook.reduction(q)
    r.check(q)
    assert r.xo.shape == (2, 16, SKETCH_DIM)
    with pytest.raises(RuntimeError, match="stored the rows"):
        stats.rows_hook(None, None)


def test_a_wrong_shape_is_said_before_the_missing_gpu(capsys):
    """The argument is checked first (fail before: "needs a CUDA GPU" for --shape 1,2,3)."""
    assert main(["bench", "--shape", "1,2,3"]) == 2
    err = capsys.readouterr().err
    assert "shape must be four positive integers B,H,N,D" in err and "CUDA" not in err
