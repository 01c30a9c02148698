"""Block shapes, warps and pipeline stages of the Triton kernels.

``TABLE`` holds the configuration each kernel uses per head dim on CUDA; the values were
chosen by ``flashwatch bench --tune`` and, for the two compilations that differ most from the
plain ones (``fwd_fixed``: the fixed forward; ``dq_stats``: the dQ kernel with statistics), by
device-time sweeps, on an H200 (docs/KERNEL_TUNING.md has the runs). With FLASHWATCH_AUTOTUNE=1
the launchers time every candidate of ``CANDIDATES`` on the first call of each (kernel, head
dim, dtype, causal, N) and keep the fastest for the process; the timing runs into scratch
outputs and scratch statistics, so tuning never adds into an ``AttentionStats``. Under the
Triton interpreter small blocks are used, so tests at small N still cross several tiles.

Constraints: fwd, fwd_fixed, fwd_hopper(_ws), dq, dq_stats, dq_rows, stats and stats_rows need
BLOCK_M % BLOCK_N == 0 (the causal off-diagonal loop takes whole key blocks below the query
block); dkdv and dkdv_hopper(_ws) need BLOCK_N % BLOCK_M == 0.

The Hopper variants of the forward and of the dK/dV kernel (``kernels/hopper.py``) are opt-in:
FLASHWATCH_HOPPER (or ``set_hopper``) names them and their features (``parse_hopper``); unset,
the plain kernels run. Their entries are ``fwd_hopper``, ``dkdv_hopper`` and, warp-specialised,
``fwd_hopper_ws``, ``dkdv_hopper_ws``.
"""

from __future__ import annotations

import os

import torch

from .checks import switch


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
# the observe-mode statistics kernel with the W^Q-error chain's rows (monitored steps of a layer with
# a chain) is its own compilation too: P K's accumulator and the reduction's epilogue take it from
# 168 to 186 registers at the stats entry's 64x64 tiles, two programs an SM instead of three
# (benchmarks/sass_loop_counts.py). Its entry is the device-time sweep's choice
# (benchmarks/stats_sweep.py, docs/KERNEL_TUNING.md): 64x32 tiles at D <= 64, 64x64 at two stages at D=128
TABLE["stats_rows"] = {**{d: _cfg(64, 32, 4, 3) for d in (16, 32, 64)}, 128: _cfg(64, 64, 4, 2)}
# the fixed forward is its own compilation too: its tie count's (BLOCK_N, 16) operand of ones
# sits in shared memory (2 KB), which at the plain D=64 entry (57,344 B, exactly four programs'
# worth on an H200) leaves room for three: two pipeline stages keep four
TABLE["fwd_fixed"] = {**TABLE["fwd"], **{d: _cfg(64, 64, 4, 2) for d in (16, 32, 64)}}

CANDIDATES = {
    "fwd": [_cfg(128, 64, 4, 3), _cfg(128, 64, 8, 3), _cfg(128, 128, 8, 3), _cfg(128, 32, 4, 4),
            _cfg(64, 64, 4, 3), _cfg(128, 64, 4, 4), _cfg(128, 128, 8, 2), _cfg(128, 64, 8, 4), _cfg(128, 64, 8, 2)],
    "dkdv": [_cfg(32, 128, 4, 3), _cfg(64, 128, 8, 3), _cfg(32, 128, 8, 3), _cfg(64, 64, 4, 3),
             _cfg(32, 64, 4, 4), _cfg(64, 128, 4, 2), _cfg(32, 64, 4, 3), _cfg(16, 64, 4, 4),
             # a deeper pipeline: within 5% of the entry at D 128 (the 8-warp 32x64 and 64x64 tiles timed
             # beside it, 27-89% slower, are left out: docs/KERNEL_TUNING.md, 2026-12-04)
             _cfg(32, 64, 4, 5)],
    "dq": [_cfg(128, 32, 4, 3), _cfg(128, 64, 8, 3), _cfg(128, 32, 8, 3), _cfg(64, 64, 4, 3),
           _cfg(64, 32, 4, 4), _cfg(128, 64, 4, 2), _cfg(128, 64, 8, 2)],
    "stats": [_cfg(128, 64, 4, 3), _cfg(128, 64, 8, 3), _cfg(64, 64, 4, 3)],
    "fwd_fixed": [_cfg(64, 64, 4, 2), _cfg(64, 64, 4, 3), _cfg(64, 32, 4, 3), _cfg(128, 64, 8, 3),
                  _cfg(128, 64, 8, 2), _cfg(128, 32, 4, 4)],
    "dq_rows": [_cfg(64, 32, 4, 3), _cfg(128, 32, 8, 3), _cfg(64, 64, 4, 3), _cfg(128, 64, 8, 3)],
    "stats_rows": [_cfg(64, 64, 4, 3), _cfg(64, 32, 4, 3), _cfg(64, 32, 4, 4), _cfg(128, 32, 8, 3),
                   _cfg(128, 64, 8, 3), _cfg(64, 64, 4, 2)],
    "dq_stats": [_cfg(64, 64, 4, 3), _cfg(64, 64, 4, 3, maxnreg=168), _cfg(64, 32, 4, 3), _cfg(64, 32, 4, 4),
                 _cfg(128, 32, 8, 3), _cfg(128, 64, 8, 3), _cfg(128, 64, 8, 3, maxnreg=128), _cfg(64, 64, 4, 2),
                 _cfg(32, 32, 4, 3)],
}

# Opt-in Hopper variants (``kernels/hopper.py``), off unless ``hopper_features`` names the kernel.
# Chosen offline for sm_90 (registers and spills, ``benchmarks/sass_loop_counts.py``), not yet
# timed: the forward keeps the plain entry's tiles, so an A/B isolates TMA; with warp
# specialisation (Triton 3.6 specialises Hopper loops at 4 warps only) 128x64 tiles at 4 warps.
# dK/dV at D=128: 32x64 at 3 stages spills 56 bytes with TMA (the plain entry: 576 without);
# warp-specialised, 2 stages: no spill and two programs per SM.
TABLE["fwd_hopper"] = dict(TABLE["fwd"])
TABLE["fwd_hopper_ws"] = {16: _cfg(64, 64, 4, 3), 32: _cfg(64, 64, 4, 3), 64: _cfg(128, 64, 4, 3),
                          128: _cfg(128, 64, 4, 3)}
TABLE["dkdv_hopper"] = {**TABLE["dkdv"], 128: _cfg(32, 64, 4, 3)}
TABLE["dkdv_hopper_ws"] = {d: _cfg(32, 64, 4, 2) for d in (16, 32, 64, 128)}
CANDIDATES["fwd_hopper"] = [_cfg(128, 64, 8, 3), _cfg(128, 128, 8, 2), _cfg(128, 128, 8, 3), _cfg(64, 64, 4, 3),
                            _cfg(128, 64, 4, 3)]
CANDIDATES["fwd_hopper_ws"] = [_cfg(128, 64, 4, 3), _cfg(128, 64, 4, 2), _cfg(128, 128, 4, 2), _cfg(64, 64, 4, 3)]
CANDIDATES["dkdv_hopper"] = [_cfg(32, 64, 4, 3), _cfg(32, 64, 4, 4), _cfg(16, 64, 4, 4), _cfg(64, 64, 8, 3),
                             _cfg(32, 128, 8, 3)]
CANDIDATES["dkdv_hopper_ws"] = [_cfg(32, 64, 4, 2), _cfg(32, 64, 4, 3), _cfg(64, 64, 4, 2)]

INTERPRETER = {name: _cfg(16, 16, 4, 1) for name in TABLE}
INTERPRETER["dkdv"] = _cfg(16, 32, 4, 1)  # BLOCK_N > BLOCK_M: exercises the diagonal segment
# BLOCK_M > BLOCK_N: several key tiles per diagonal
INTERPRETER["fwd"] = INTERPRETER["fwd_fixed"] = INTERPRETER["fwd_hopper"] = INTERPRETER["fwd_hopper_ws"] = \
    _cfg(32, 16, 4, 1)
INTERPRETER["dkdv_hopper"] = INTERPRETER["dkdv_hopper_ws"] = INTERPRETER["dkdv"]

HOPPER_ENV = "FLASHWATCH_HOPPER"
HOPPER_KERNELS = ("fwd", "dkdv")
HOPPER_FEATURES = ("tma", "ws")
WS_UNVERIFIED_ENV = "FLASHWATCH_HOPPER_WS_UNVERIFIED"  # "1": accept 'ws', which fails its GPU tests
_hopper_override: list = []  # [spec] while set_hopper holds one


def parse_hopper(spec: str) -> dict[str, frozenset]:
    """The Hopper variants a specification asks for: {kernel: features}. A specification is a
    comma-separated list of kernels (``fwd``, ``dkdv``; none named: both) and features (``tma``:
    tiles through TMA descriptors; ``ws``: warp specialisation, which implies ``tma``); ``1``
    or ``on`` is ``fwd,dkdv,tma``; empty, ``0`` or ``off``: none (the plain kernels)."""
    tokens = [t.strip().lower() for t in spec.split(",") if t.strip()]
    if tokens in ([], ["0"], ["off"]):
        return {}
    if tokens in (["1"], ["on"]):
        tokens = ["fwd", "dkdv", "tma"]
    bad = [t for t in tokens if t not in HOPPER_KERNELS + HOPPER_FEATURES]
    if bad:
        raise ValueError(f"{HOPPER_ENV}: unknown {', '.join(map(repr, bad))} in {spec!r}; accepted: a comma-separated "
                         f"list of kernels {HOPPER_KERNELS} and features {HOPPER_FEATURES}, or 1/on, 0/off")
    features = {t for t in tokens if t in HOPPER_FEATURES}
    if "ws" in features and not switch(WS_UNVERIFIED_ENV):
        raise ValueError(f"{HOPPER_ENV}: 'ws' (warp specialisation) is refused in {spec!r}: its forward gave wrong "
                         "outputs with the causal mask on an H200 (docs/KERNEL_TUNING.md); accepted: the kernels "
                         f"{HOPPER_KERNELS} with 'tma' or without it. To debug it, set {WS_UNVERIFIED_ENV}=1")
    if "ws" in features:
        features.add("tma")  # Triton 3.6 specialises Hopper loops only when their tiles come through TMA
    kernels = [t for t in tokens if t in HOPPER_KERNELS] or list(HOPPER_KERNELS)
    return {kernel: frozenset(features) for kernel in kernels}


def set_hopper(spec: str | None) -> None:
    """Use the Hopper variants of ``spec`` (``parse_hopper``) in this process instead of the
    environment variable FLASHWATCH_HOPPER; None: back to the environment variable."""
    if spec is not None:
        parse_hopper(spec)  # a bad specification fails here, not at the next launch
    _hopper_override[:] = [] if spec is None else [spec]


def _hopper_spec() -> str:
    """The Hopper specification in force: ``set_hopper``'s, else FLASHWATCH_HOPPER's ("" where neither)."""
    return _hopper_override[0] if _hopper_override else os.environ.get(HOPPER_ENV, "")


def hopper_features(kernel: str) -> frozenset | None:
    """The features of the Hopper variant of ``kernel`` (``fwd`` or ``dkdv``) that is asked for
    (``set_hopper``, else FLASHWATCH_HOPPER), or None: the plain kernel (the default)."""
    spec = _hopper_spec()
    if not spec:  # the default, asked at every launch: no parsing
        return None
    return parse_hopper(spec).get(kernel)


def in_force_is_the_table() -> bool:
    """Whether every kernel's configuration comes from ``TABLE`` now: no override (``set_override``),
    no autotuning (FLASHWATCH_AUTOTUNE), no Hopper variant asked for (``set_hopper``, FLASHWATCH_HOPPER).
    Then a call's configurations depend on its shapes and options alone (what a launch plan may assume)."""
    if _override or switch("FLASHWATCH_AUTOTUNE"):
        return False
    spec = _hopper_spec()
    return not spec or not parse_hopper(spec)  # unset (the default, asked at every call: no parsing), or "off"


def hopper_entry(kernel: str, features: frozenset) -> str:
    """The ``TABLE`` entry of a Hopper variant: warp-specialised compilations have their own."""
    return f"{kernel}_hopper_ws" if "ws" in features else f"{kernel}_hopper"

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
    if bench is None or not switch("FLASHWATCH_AUTOTUNE"):
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
