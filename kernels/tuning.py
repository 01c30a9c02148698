"""Block shapes, warps and pipeline stages of the Triton kernels.

``TABLE`` holds the configuration each kernel uses per head dim on CUDA; the values were
chosen by ``flashwatch bench --tune`` and, for the two compilations that differ most from the
plain ones (``fwd_fixed``: the fixed forward; ``dq_stats``: the dQ kernel with statistics), by
device-time sweeps, on an H200 (docs/KERNEL_TUNING.md has the runs). With FLASHWATCH_AUTOTUNE=1
the launchers time every candidate of ``CANDIDATES`` on the first call of each (kernel, head
dim, dtype, causal, N) and keep the fastest for the process; the timing runs into scratch
outputs and scratch statistics, so tuning never adds into an ``AttentionStats``. Under the
Triton interpreter small blocks are used, so tests at small N still cross several tiles.

Constraints: fwd, fwd_fixed, dq, dq_stats, dq_rows and stats need BLOCK_M % BLOCK_N == 0 (the
causal off-diagonal loop takes whole key blocks below the query block); dkdv needs
BLOCK_N % BLOCK_M == 0.
"""

from __future__ import annotations

import os

import torch


def _cfg(bm, bn, warps, stages, maxnreg=None):
    cfg = {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": warps, "num_stages": stages}
    if maxnreg is not None:  # cap on registers per thread (ptxas spills above it): buys occupancy
        cfg["maxnreg"] = maxnreg
    return cfg


# CUDA defaults per kernel and head dim, from `flashwatch bench --tune` on an H200
# (docs/KERNEL_TUNING.md): the autotuner's choice at the benchmark's shapes
# (``flashwatch.bench.DEFAULT_SHAPES``: D=64 at N=1024 and 2048, D=128 at N=4096 and 16384;
# where the D=128 forward's choice differed between the two, the table keeps the long-sequence
# one). D=16 and 32 reuse the D=64 shapes.
TABLE = {
    "fwd": {16: _cfg(64, 64, 4, 3), 32: _cfg(64, 64, 4, 3), 64: _cfg(64, 64, 4, 3), 128: _cfg(128, 64, 8, 3)},
    "dkdv": {16: _cfg(32, 64, 4, 4), 32: _cfg(32, 64, 4, 4), 64: _cfg(32, 64, 4, 4), 128: _cfg(32, 64, 4, 4)},
    "dq": {16: _cfg(64, 64, 4, 3), 32: _cfg(64, 64, 4, 3), 64: _cfg(64, 64, 4, 3), 128: _cfg(128, 64, 8, 3)},
    "stats": {16: _cfg(64, 64, 4, 3), 32: _cfg(64, 64, 4, 3), 64: _cfg(64, 64, 4, 3), 128: _cfg(128, 64, 8, 3)},
}
# the dQ kernel with statistics on is its own compilation: its counts and sums need about twice
# the registers of the plain one at the same tiles, which cuts the programs an SM holds; it gets
# its own entry and candidates, chosen by a device-time sweep (benchmarks/dq_stats_sweep.py,
# docs/KERNEL_TUNING.md): smaller 64x32 tiles at D <= 64, the dq entry at D=128
TABLE["dq_stats"] = {**TABLE["dq"], **{d: _cfg(64, 32, 4, 3) for d in (16, 32, 64)}}
# the dQ kernel with the per-row outputs of AttentionStats.rows_hook (monitored steps only) adds a
# (BLOCK_M, D) FP32 accumulator for P K: at D=128 the dq_stats tiles spill it to local memory
# in the loop, 128x32 tiles do not (benchmarks/sass_loop_counts.py, docs/KERNEL_TUNING.md)
TABLE["dq_rows"] = {**TABLE["dq_stats"], 128: _cfg(128, 32, 8, 3)}
# the fixed forward is its own compilation too: its tie count's (BLOCK_N, 16) operand of ones
# sits in shared memory (2 KB), which at the plain D=64 entry (57,344 B, exactly four programs'
# worth on an H200) leaves room for three: two pipeline stages keep four
TABLE["fwd_fixed"] = {**TABLE["fwd"], **{d: _cfg(64, 64, 4, 2) for d in (16, 32, 64)}}

CANDIDATES = {
    "fwd": [_cfg(128, 64, 4, 3), _cfg(128, 64, 8, 3), _cfg(128, 128, 8, 3), _cfg(128, 32, 4, 4),
            _cfg(64, 64, 4, 3), _cfg(128, 64, 4, 4), _cfg(128, 128, 8, 2)],
    "dkdv": [_cfg(32, 128, 4, 3), _cfg(64, 128, 8, 3), _cfg(32, 128, 8, 3), _cfg(64, 64, 4, 3),
             _cfg(32, 64, 4, 4), _cfg(64, 128, 4, 2), _cfg(32, 64, 4, 3), _cfg(16, 64, 4, 4)],
    "dq": [_cfg(128, 32, 4, 3), _cfg(128, 64, 8, 3), _cfg(128, 32, 8, 3), _cfg(64, 64, 4, 3),
           _cfg(64, 32, 4, 4), _cfg(128, 64, 4, 2)],
    "stats": [_cfg(128, 64, 4, 3), _cfg(128, 64, 8, 3), _cfg(64, 64, 4, 3)],
    "fwd_fixed": [_cfg(64, 64, 4, 2), _cfg(64, 64, 4, 3), _cfg(64, 32, 4, 3), _cfg(128, 64, 8, 3),
                  _cfg(128, 64, 8, 2), _cfg(128, 32, 4, 4)],
    "dq_rows": [_cfg(64, 32, 4, 3), _cfg(128, 32, 8, 3), _cfg(64, 64, 4, 3), _cfg(128, 64, 8, 3)],
    "dq_stats": [_cfg(64, 64, 4, 3), _cfg(64, 64, 4, 3, maxnreg=168), _cfg(64, 32, 4, 3), _cfg(64, 32, 4, 4),
                 _cfg(128, 32, 8, 3), _cfg(128, 64, 8, 3), _cfg(128, 64, 8, 3, maxnreg=128), _cfg(64, 64, 4, 2),
                 _cfg(32, 32, 4, 3)],
}

INTERPRETER = {name: _cfg(16, 16, 4, 1) for name in TABLE}
INTERPRETER["dkdv"] = _cfg(16, 32, 4, 1)  # BLOCK_N > BLOCK_M: exercises the diagonal segment
# BLOCK_M > BLOCK_N: several key tiles per diagonal
INTERPRETER["fwd"] = INTERPRETER["fwd_fixed"] = _cfg(32, 16, 4, 1)

_chosen: dict[tuple, dict] = {}
_override: dict[str, dict] = {}


def set_override(kind: str, cfg: dict | None) -> None:
    """Force a configuration for one kernel kind (bench --tune uses this); None clears it."""
    if cfg is None:
        _override.pop(kind, None)
    else:
        _override[kind] = dict(cfg)


def choose(kind: str, q: torch.Tensor, causal: bool, bench) -> dict:
    """The configuration for kernel ``kind`` at q's shape. ``bench(cfg)`` returns a
    zero-argument launcher used only for autotuning (None: never autotune this kind)."""
    if kind in _override:
        return _override[kind]
    if q.device.type != "cuda":
        return INTERPRETER[kind]
    D = q.shape[-1]
    if bench is None or os.environ.get("FLASHWATCH_AUTOTUNE") != "1":
        return TABLE[kind][D]
    key = (kind, D, q.dtype, causal, q.shape[2])
    if key not in _chosen:
        import triton.testing

        timings = []
        for cfg in CANDIDATES[kind]:
            try:
                timings.append((triton.testing.do_bench(bench(cfg), warmup=5, rep=20), cfg))
            except Exception:  # a configuration that does not fit (shared memory, registers) is skipped
                continue
        _chosen[key] = min(timings, key=lambda t: t[0])[1] if timings else TABLE[kind][D]
    return _chosen[key]
