"""FP16 training with a loss scaler: the monitored step's gradient-unit readings in true units.

A ``torch.amp.GradScaler`` multiplies the loss by its scale S before the backward, so every
gradient the statistics see is S times the true one: the δ error sums (``delta_error``,
``delta_error_abs``, ``delta_error_tied``; ``delta_error_sq`` by S²) and the W^Q-error
chain's accumulators (push, true push, sketch). ``Monitor.step(grad_scaler=...)`` divides them
by the S the step's backward used, on the device, before the one host transfer.

Which S. ``scaler.update()`` ends a step by lowering S (``backoff_factor`` < 1) when the
step's gradients overflowed (the scaler then skipped the optimizer step) or raising it
(``growth_factor``) after ``growth_interval`` clean steps. So the S a step's backward uses is the
one left by the previous step's update: ``LossScale.remember`` keeps a device copy of it at the
``step()`` call before each monitored step. At the monitored step the update has run: a scale
now below it, or equal to it with the growth tracker reset to 0, says the step was skipped (the
update backs off and resets the tracker; a floor applied after it with ``update(new_scale=...)``
can bring the scale back). With nothing remembered (the first step seen with this scaler, a
resumed run), the update left S as it was when its growth tracker is above 0 (a clean step that
did not grow S); otherwise S is unknown. A skipped step, or one of unknown S, reads its
gradient-unit values as not measured, not as a divergence: its gradients were not used. Not
seen: a skipped step whose scale was then set by hand at or above the one it used, without the
update's own back-off first.

Everything here reads the scaler's device tensors (its scale and growth tracker) without a host
synchronisation; ``remember`` adds one small device copy to the step before a monitored one.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

from .kernels import STAT_FIELDS
from .kernels.stats import GRADIENT_POWER

__all__ = ["LossScale", "unscale_statistics", "check_grad_scaler", "why_unreadable"]

_SCALER_STATE = ("_scale", "_init_scale", "_growth_tracker", "_per_optimizer_states")  # what this module reads
WRONG_ORDER = ("flashwatch: Monitor.step(grad_scaler=...) was called before scaler.update(): the loss scale of "
               "the step is not known there, so its delta error and W^Q-gradient error read as not measured; call "
               "monitor.step() after scaler.update()")


def check_grad_scaler(scaler: Any) -> Any:
    """``scaler`` if it is an enabled ``torch.amp.GradScaler`` (``torch.cuda.amp.GradScaler`` and
    FSDP's ``ShardedGradScaler`` are ones), None for None or a disabled one (it scales nothing).

    Raises:
        TypeError: anything else (the message says what to pass).
    """
    if scaler is None:
        return None
    if not isinstance(scaler, torch.amp.GradScaler):
        hint = ""
        if isinstance(scaler, type):
            hint = " (a class: pass the instance that scaled the loss)"
        elif isinstance(getattr(scaler, "scaler", None), torch.amp.GradScaler):
            hint = f" (its .scaler is one: pass {type(scaler).__name__}.scaler)"
        raise TypeError(f"grad_scaler must be the torch.amp.GradScaler that scaled this step's loss, or None; "
                        f"got {type(scaler).__name__}{hint}")
    return scaler if scaler.is_enabled() else None


def why_unreadable(scaler: Any) -> str | None:
    """Why flashwatch cannot read this GradScaler's scale (its torch keeps it elsewhere), or None."""
    missing = [name for name in _SCALER_STATE if not hasattr(scaler, name)]
    if missing:
        return f"this torch's GradScaler has no {', '.join(missing)} (torch {torch.__version__})"
    return None


def unscale_statistics(packed: torch.Tensor, inverse_scale: torch.Tensor) -> torch.Tensor:
    """``packed`` (len(STAT_FIELDS), heads) float64, as ``AttentionStats.packed_all``, with each sum
    multiplied by ``inverse_scale`` = 1/S (0-d float64 on its device; NaN makes them NaN) to the
    power of the output gradient it is homogeneous in (``kernels.stats.GRADIENT_POWER``); the
    counts and the max logit as they are."""
    powers = [torch.ones_like(inverse_scale), inverse_scale, inverse_scale * inverse_scale]
    rows = [powers[GRADIENT_POWER.get(name, 0)] for name in STAT_FIELDS]
    return packed * torch.stack(rows)[:, None]


class LossScale:
    """The loss scale of each monitored step, from the ``GradScaler`` passed to ``Monitor.step``.

    Args:
        warn_once: ``warn_once(key, message)``, the Monitor's: logs a message once (on the reporting rank).
    """

    def __init__(self, warn_once: Callable[[Any, str], None]) -> None:
        # (step, id(scaler) or None for a scale loaded from a checkpoint, its S)
        self._remembered: tuple[int, int | None, torch.Tensor | float] | None = None
        self._warn_once = warn_once

    def state_dict(self) -> dict | None:
        """The remembered scale as plain data ({"step", "scale"}), or None: a checkpoint saved between
        the ``step()`` that remembers it and the monitored step keeps it (one host read of a 0-d tensor)."""
        if self._remembered is None:
            return None
        step, _, scale = self._remembered
        return {"step": step, "scale": float(scale)}

    def load_state_dict(self, state: dict | None) -> None:
        """Continue from ``state_dict()``: the resumed run's scaler (another object) takes the remembered
        scale at its step."""
        self._remembered = None if state is None else (int(state["step"]), None, float(state["scale"]))

    def remember(self, scaler: Any, step: int) -> None:
        """At the ``step()`` call before monitored step ``step`` (after ``scaler.update()``): the S
        that step's backward will use, copied on the device (no sync)."""
        scale = scaler._scale
        # no loss scaled yet: the first scale() starts from init_scale (a number: no host-to-device copy)
        used = float(scaler._init_scale) if scale is None else scale.detach().to(torch.float64, copy=True)
        self._remembered = (step, id(scaler), used)

    def inverse_scale(self, scaler: Any, step: int) -> torch.Tensor | None:
        """1/S of monitored step ``step``'s backward, a 0-d float64 tensor on the scaler's device;
        NaN where the scaler skipped the step or S is unknown (gradient units unknown). None: the
        scaler never scaled a loss (its gradients are in true units)."""
        remembered, self._remembered = self._remembered, None
        scale = scaler._scale
        if scale is None:
            return None
        now = scale.detach().to(torch.float64)
        if scaler._per_optimizer_states:  # scaler.step() ran, scaler.update() not yet
            self._warn_once("grad_scaler_order", WRONG_ORDER)
            return torch.full_like(now, math.nan)
        counted = scaler._growth_tracker.detach() > 0  # the update counted a clean step (0: it grew S or backed off)
        if remembered is not None and remembered[0] == step and remembered[1] in (None, id(scaler)):
            used = remembered[2]
            used = used.to(now.device) if isinstance(used, torch.Tensor) else torch.full_like(now, used)
            known = (now > used) | ((now == used) & counted)  # below, or back at a floor after a back-off: skipped
        else:
            used = now
            known = counted  # the update left S unchanged
        known = known & (used > 0)  # a scale that underflowed to 0 scaled nothing measurable
        return torch.where(known, 1.0 / used, torch.full_like(used, math.nan))
