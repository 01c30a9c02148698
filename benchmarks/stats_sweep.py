"""Configurations of the observe-mode statistics kernel with the W^Q-error chain's rows, by device time.

    python benchmarks/stats_sweep.py [--shape B,H,N,D ...] [--wide] [--json sweep.json]     (needs CUDA)

On a monitored step in observe mode the statistics kernel of a layer with a W^Q-error chain also
accumulates P K and reduces each row's delta error onto the chain's sums in its epilogue
(``tuning.TABLE["stats_rows"]``): more registers than the statistics alone at the same tiles, so
fewer programs an SM, and its best tiles need not be the statistics kernel's. For each shape
(default: GPT-2 small's call, 16 x 12 x 1024 x 64, then the bench's four) this times one
``attention_statistics`` call with a reducing rows hook (the chain's factors, random, sketch
width ``chain.SKETCH_DIM``), once per candidate of ``tuning.CANDIDATES["stats_rows"]``, and the
same call without rows (the ``stats`` entry) for reference: median device time of repeated calls
(``triton.testing.do_bench``). The fastest candidate per shape is marked; one that does not
compile or launch is reported and skipped.
"""

from __future__ import annotations

import argparse
import sys

import torch

GPT2_SMALL_CALL = (16, 12, 1024, 64)


def wide_candidates() -> list[dict]:
    """``--wide``: tiles beyond ``tuning.CANDIDATES["stats_rows"]`` (stages, warps, 16- and 32-row tiles,
    register caps), none of which the autotuner tries."""
    from flashwatch.kernels.tuning import _cfg

    return [_cfg(64, 32, 4, 2), _cfg(64, 64, 4, 4), _cfg(128, 32, 4, 3), _cfg(128, 64, 4, 3), _cfg(128, 32, 8, 4),
            _cfg(32, 32, 4, 3), _cfg(64, 32, 8, 3), _cfg(64, 64, 8, 3), _cfg(32, 32, 2, 3), _cfg(64, 16, 4, 3),
            _cfg(128, 16, 8, 3), _cfg(64, 32, 4, 3, maxnreg=96), _cfg(64, 32, 4, 3, maxnreg=112)]


def shapes(given: list[str] | None) -> list[tuple[int, int, int, int]]:
    """The shapes given as B,H,N,D strings, else GPT-2 small's call, then the bench's four."""
    from flashwatch import bench

    return [bench.parse_shape(s) for s in given] if given else [GPT2_SMALL_CALL, *bench.DEFAULT_SHAPES]


def statistics_inputs(shape) -> tuple[torch.Tensor, ...]:
    """q, k, v, out, dout (B, H, N, D) BF16 on CUDA, random from a fixed seed: a statistics call's inputs."""
    B, H, N, D = shape
    g = torch.Generator(device="cuda").manual_seed(1)
    return tuple(torch.randn(B, H, N, D, generator=g, device="cuda").to(torch.bfloat16) for _ in range(5))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", action="append", metavar="B,H,N,D",
                    help="shape(s) (default: GPT-2 small's call, then the bench's four)")
    ap.add_argument("--json", metavar="PATH", help="write every number as JSON")
    ap.add_argument("--wide", action="store_true", help="also time the tiles of wide_candidates()")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("stats_sweep needs CUDA", file=sys.stderr)
        return 2
    import triton.testing

    from flashwatch import bench
    from flashwatch.chain import SKETCH_DIM
    from flashwatch.kernels import AttentionStats, attention_statistics, tuning

    if args.wide:  # this process only: the sweep reads the candidates from tuning
        tuning.CANDIDATES["stats_rows"] = tuning.CANDIDATES["stats_rows"] + [
            c for c in wide_candidates() if c not in tuning.CANDIDATES["stats_rows"]]
    rows = []
    for shape in shapes(args.shape):
        B, H, N, D = shape
        q, k, v, out, dout = statistics_inputs(shape)
        stats = AttentionStats(H, "cuda")
        hook = bench.ReducingHook(q, SKETCH_DIM)

        def call(with_rows: bool):
            stats.rows_hook = hook if with_rows else None
            return lambda: attention_statistics(q, k, v, out, dout, stats, causal=True)

        plain_ms = triton.testing.do_bench(call(False), warmup=10, rep=50, return_mode="median")
        table = tuning.TABLE["stats_rows"][D]
        results, best = bench.sweep_configurations(
            "stats_rows", lambda: triton.testing.do_bench(call(True), warmup=10, rep=50, return_mode="median"),
            plain_ms)
        rows.append({"shape": list(shape), "no_rows_ms": plain_ms, "no_rows_config": tuning.TABLE["stats"][D],
                     "table_config": table, "candidates": results, "best": best["config"] if best else None})
        print(f"\nshape {shape}: statistics without rows {1e3 * plain_ms:.1f} us ({bench.config_label(tuning.TABLE['stats'][D])});"
              " with the chain's rows reduced, by configuration (over the call without rows):")
        bench.print_sweep(results, best, table, unit="us")
    bench.write_sweep_json(args.json, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
