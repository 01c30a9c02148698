"""Blow-up of a training run, read from its loss series, and the lead time of an alert.

With m_t the median of the last ``BLOWUP_WINDOW`` (20) losses and b_t the lowest m_s so far
(s < t), a run blew up when either

- a loss is not finite (the blow-up step is that step), or
- m_t >= ``BLOWUP_FACTOR`` (1.25) x b_t at ``BLOWUP_PATIENCE`` (20) consecutive steps; the
  blow-up step is the first step of the 20-loss window where that began whose own loss is
  >= 1.25 x b_t (where the loss left its trend), so a run is stopped (confirmed) 20 steps or
  more after its blow-up step.

A run that never does this within its budget is "healthy through step S" (censored: it could
fail later). Why the median and not a ratio to the running minimum: the running minimum of
single-batch losses sits a few noise widths below the trend (small batches on the CPU: 5-10%
noise), so a ratio to it measures noise as much as failure; the median of 20 steps ignores
single spikes and that noise. Why 1.25: it lies between the largest rise of a healthy run's
20-step median and the smallest collapse of a failing one in the recordings
(docs/CALIBRATION.md). A lower factor dates a blow-up earlier, which shortens lead times: it
cannot flatter a detector.

``BlowupTracker`` is online (the experiment worker stops a run with it); ``blowup_step`` reads a
whole series. Lead time = blow-up step - first alert step (positive: before the blow-up).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from typing import Sequence

__all__ = ["BLOWUP_FACTOR", "BLOWUP_PATIENCE", "BLOWUP_WINDOW", "BlowupTracker", "blowup_step", "lead_time"]

BLOWUP_FACTOR = 1.25
BLOWUP_PATIENCE = 20
BLOWUP_WINDOW = 20


class BlowupTracker:
    """Online blow-up detection: ``update(step, loss)`` once per step, in order.

    ``blowup`` is the blow-up step once confirmed, else None; ``confirmed_at`` the step at
    which it was confirmed. See the module docstring.
    """

    def __init__(self, factor: float = BLOWUP_FACTOR, patience: int = BLOWUP_PATIENCE, window: int = BLOWUP_WINDOW):
        self.factor, self.patience, self.window = factor, patience, window
        self.recent: deque = deque(maxlen=window)  # (step, loss) of the last `window` finite steps
        self.best = math.inf  # lowest median so far
        self.start: int | None = None  # blow-up step candidate of the current streak
        self.count = 0
        self.blowup: int | None = None
        self.confirmed_at: int | None = None

    def update(self, step: int, loss: float) -> int | None:
        if self.blowup is not None:
            return self.blowup
        if not math.isfinite(loss):
            self.blowup = self.start if self.start is not None else int(step)
            self.confirmed_at = int(step)
            return self.blowup
        self.recent.append((int(step), float(loss)))
        if len(self.recent) < self.window:
            return None
        median = statistics.median(v for _, v in self.recent)
        threshold = self.factor * self.best
        if math.isfinite(self.best) and median >= threshold:
            if self.start is None:
                self.start = next((s for s, v in self.recent if v >= threshold), int(step))
            self.count += 1
            if self.count >= self.patience:
                self.blowup, self.confirmed_at = self.start, int(step)
        else:
            self.start, self.count = None, 0
        self.best = min(self.best, median)
        return self.blowup


def blowup_step(steps: Sequence[int], losses: Sequence[float], factor: float = BLOWUP_FACTOR,
                patience: int = BLOWUP_PATIENCE, window: int = BLOWUP_WINDOW) -> int | None:
    """The blow-up step of a loss series, or None (see the module docstring)."""
    tracker = BlowupTracker(factor, patience, window)
    for s, loss in zip(steps, losses):
        if tracker.update(int(s), float(loss)) is not None:
            break
    return tracker.blowup


def lead_time(blowup: int | None, first_alert: int | None) -> int | None:
    """blow-up step - first alert step (positive: the alert came first); None if either is None."""
    if blowup is None or first_alert is None:
        return None
    return int(blowup) - int(first_alert)
