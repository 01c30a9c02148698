"""Per-row outputs of one Triton launch (``AttentionStats.rows_hook``): buffers, arguments, the hook's call.

The launchers (``triton_attn``) pass ``RowOutputs.args`` and ``RowOutputs.flags`` to the dQ and
statistics kernels, and call ``finish()`` after the launch. Two modes:

- store (a plain hook): fresh (delta_error_rows (B, H, N), pk (B, H, N, D)) FP32 buffers that
  the kernel fills, then ``hook(delta_error_rows, pk)``;
- reduce (the hook's ``reduction(q)`` returns a ``stats.RowReduction``): the kernel reduces the
  rows into the reduction's per-head sums in its epilogue; no per-row buffer exists.

Where reduce mode is used (``KERNEL_REDUCTION``, from the environment variable
FLASHWATCH_KERNEL_REDUCTION at import): "1" everywhere, "0" nowhere, unset: in Triton's CPU
interpreter only. On CUDA it is opt-in: the compiled reducing kernels have not yet passed their
GPU tests (tests/test_chain_kernel_reduction.py -m gpu); the store mode they replace has. The
readings are the same in both modes (float64 tests); only the cost differs.
"""

from __future__ import annotations

import os
from typing import Optional

import torch

from .stats import RowReduction, RowsHook


_SWITCH = os.environ.get("FLASHWATCH_KERNEL_REDUCTION", "")
if _SWITCH not in ("", "0", "1"):
    raise ValueError(f"FLASHWATCH_KERNEL_REDUCTION={_SWITCH!r}: accepted are 1 (reduce in the kernels), "
                     "0 (store the rows) or unset (reduce in the CPU interpreter only)")
KERNEL_REDUCTION: Optional[bool] = {"": None, "0": False, "1": True}[_SWITCH]


def reduction_enabled(q: torch.Tensor) -> bool:
    """Whether launches on ``q``'s device reduce the rows in the kernel (see the module docstring)."""
    return KERNEL_REDUCTION if KERNEL_REDUCTION is not None else q.device.type != "cuda"


class RowOutputs:
    """What a launch with per-row outputs needs; ``hook`` None: store buffers only (tuning)."""

    def __init__(self, q: torch.Tensor, hook: Optional[RowsHook] = None):
        self.hook = hook
        offer = getattr(hook, "reduction", None) if reduction_enabled(q) else None
        self.reduction: Optional[RowReduction] = offer(q) if callable(offer) else None
        if self.reduction is not None:
            self.reduction.check(q)
            r = self.reduction
            # ERR_ROWS and PK are never written in reduce mode: any FP32 pointer will do
            self.args = (r.ugv, r.ugv, r.u, r.xv, r.xo, r.ugv, r.sketch)
            self.flags = dict(ROWS=True, REDUCE=True, SKETCH_R=r.xo.shape[-1])
        else:
            B, H, N, D = q.shape
            self.err = torch.empty((B, H, N), dtype=torch.float32, device=q.device)
            self.pk = torch.empty((B, H, N, D), dtype=torch.float32, device=q.device)
            self.args = (self.err, self.pk) + (self.err,) * 5
            self.flags = dict(ROWS=True, REDUCE=False)

    def finish(self) -> None:
        """After the launch: the hook's call (store mode) or the reduction's ``done()``."""
        if self.reduction is not None:
            self.reduction.done()
        elif self.hook is not None:
            self.hook(self.err, self.pk)


def row_args(rows: Optional[RowOutputs], dummy: torch.Tensor) -> tuple:
    """The kernels' seven per-row pointer arguments (ERR_ROWS, PK, U, XV, XO, UGV, SKETCH)."""
    return rows.args if rows is not None else (dummy,) * 7


def row_flags(rows: Optional[RowOutputs]) -> dict:
    """The kernels' per-row constexpr flags (ROWS, REDUCE, SKETCH_R)."""
    return rows.flags if rows is not None else dict(ROWS=False, REDUCE=False)
