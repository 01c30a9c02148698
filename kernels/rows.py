"""Per-row outputs of one Triton launch (``AttentionStats.rows_hook``): buffers, arguments, the hook's call.

The launchers (``triton_attn``) pass ``RowOutputs.args`` and ``RowOutputs.flags`` to the dQ and
statistics kernels, and call ``finish()`` after the launch. Two modes:

- store (a plain hook): fresh (delta_error_rows (B, H, N), pk (B, H, N, D)) FP32 buffers that
  the kernel fills, then ``hook(delta_error_rows, pk)``;
- reduce (the hook's ``reduction(q)`` returns a ``stats.RowReduction``): each program of the
  kernel reduces its block of rows in its epilogue into one slot of two partial-sum buffers, a
  scalar and a (D, r) sketch per (batch, head, row block): 4 * B * H * cdiv(N, BLOCK_M) * (D r + 1)
  bytes, against 4 * B * H * N * (D + 1) for the rows; ``finish()`` sums them over batch and
  blocks into the reduction's per-head sums (plain stores, then one launch of
  ``chain_sums.add_partials``: no float atomics, no contention between programs, the same order
  in every run); no per-row buffer exists.

Where reduce mode is used (``KERNEL_REDUCTION``, from the environment variable
FLASHWATCH_KERNEL_REDUCTION at import): unset or "1": everywhere, "0": nowhere (every launch
stores the rows, the hook reduces them in PyTorch). A rotated query's rows are always stored (its
hook offers no reduction). The readings are the same in both modes (float64 tests); only the cost
differs: reduce mode takes less device time on a monitored step (docs/KERNEL_TUNING.md).
"""

from __future__ import annotations

from typing import Optional

import torch

from . import chain_sums
from .checks import switch
from .stats import RowReduction, RowsHook


KERNEL_REDUCTION: bool = switch("FLASHWATCH_KERNEL_REDUCTION")


class RowOutputs:
    """What a launch with per-row outputs needs; ``hook`` None: store buffers only (tuning).

    ``block_m``: the launch's BLOCK_M (rows per program), which sizes reduce mode's partial sums.
    ``fold``: in reduce mode, row blocks per program (the statistics kernel's FOLD; the launch's
    grid then has cdiv(cdiv(N, block_m), fold) programs along the rows, one slot each); ``self.fold``
    is the fold the launch must use: ``fold`` in reduce mode, 1 in store mode."""

    def __init__(self, q: torch.Tensor, hook: Optional[RowsHook], block_m: int, fold: int = 1):
        self.hook = hook
        B, H, N, D = q.shape
        offer = getattr(hook, "reduction", None) if KERNEL_REDUCTION else None
        self.reduction: Optional[RowReduction] = offer(q) if callable(offer) else None
        self.fold = fold if self.reduction is not None else 1
        if self.reduction is not None:
            layout = self.reduction.check(q)  # xv and xo contiguous, or read in place from the chain's product
            r = self.reduction
            blocks = -(-N // block_m)
            slots = -(-blocks // fold)  # programs along the rows
            # one slot per program, (B, H, slots) order; every slot is written by its program
            self.part_ugv = torch.empty((B, H, slots), dtype=torch.float32, device=q.device)
            self.part_sketch = torch.empty((B, H, slots) + tuple(r.sketch.shape[1:]), dtype=torch.float32,
                                           device=q.device)
            # ERR_ROWS and PK are never written in reduce mode: any FP32 pointer will do
            self.args = (self.part_ugv,) * 2 + (r.u, r.xv, r.xo, self.part_ugv, self.part_sketch)
            self.flags = dict(ROWS=True, REDUCE=True, SKETCH_R=r.xo.shape[-1], **layout)
        else:
            self.err = torch.empty((B, H, N), dtype=torch.float32, device=q.device)
            self.pk = torch.empty((B, H, N, D), dtype=torch.float32, device=q.device)
            self.args = (self.err, self.pk) + (self.err,) * 5
            self.flags = dict(ROWS=True, REDUCE=False)

    def finish(self) -> None:
        """After the launch: the hook's call (store mode), or the partial sums added into the
        reduction's per-head sums and its ``done()``."""
        if self.reduction is not None:
            r = self.reduction
            chain_sums.add_partials(self.part_ugv, self.part_sketch, r.ugv, r.sketch)  # one launch
            r.done()
        elif self.hook is not None:
            self.hook(self.err, self.pk)


def row_args(rows: Optional[RowOutputs], dummy: torch.Tensor) -> tuple:
    """The kernels' seven per-row pointer arguments (ERR_ROWS, PK, U, XV, XO, UGV, SKETCH)."""
    return rows.args if rows is not None else (dummy,) * 7


def row_flags(rows: Optional[RowOutputs]) -> dict:
    """The kernels' per-row constexpr flags (ROWS, REDUCE, SKETCH_R, X_STRIDE, XV_LO)."""
    return rows.flags if rows is not None else dict(ROWS=False, REDUCE=False)
