"""The baselines flashwatch is compared with, replayed on a run's recorded series.

Each is what a user has today, written from its published rule, and each returns every step
at which it fires (its first one is the "first alert" of the tables):

- ``loss_spike``: Lightning's ``SpikeDetection`` (lightning_fabric/utilities/spike.py, as in
  pytorch-lightning 2.6.6) on every step's loss: mode "min", window 10, warm-up 1 batch, rtol
  2.0, atol None, finite_only True. A step is a spike when its loss is non-finite, or when it is
  not below the last non-spike loss and ``|loss - mean| >= rtol * |mean|``, mean being the
  running mean of the last ``window`` non-spike losses. Lightning raises at the first spike;
  here the detector keeps going (spikes stay out of the mean, as there) to count every firing.
- ``zclip``: ZClip (Kumar et al., 2025, arXiv 2504.02507) on every step's gradient norm (before
  clipping): after ``warmup`` (25) steps whose mean and variance start the statistics, z =
  (g - mu) / sigma with an EMA mean and variance (alpha 0.97); it fires when z > ``z_thresh``
  (2.5). As in ZClip, a spike's norm enters the EMA clipped, here at mu + z_thresh * sigma (the
  "mean" clipping option; ZClip's default "adaptive scaling" clips a little lower, which only
  changes the statistics after a spike). ZClip clips rather than alerts; used as an alarm its
  published threshold fires on ordinary noise, and the tables count those firings on healthy runs.
- ``qk_clip``: Kimi K2's QK-Clip trigger (tau = 100): the largest max logit over all heads of a
  monitored step exceeds tau (Megatron-LM's ``--log-max-attention-logit`` reads the same number).

``BASELINES`` names them in table order.
"""

from __future__ import annotations

import math
from typing import Sequence

__all__ = ["BASELINES", "loss_spike", "zclip", "zclip_scores", "qk_clip", "run_baselines"]

BASELINES = ("loss_spike", "zclip", "qk_clip")


def loss_spike(steps: Sequence[int], losses: Sequence[float], *, window: int = 10, warmup: int = 1,
               rtol: float | None = 2.0, atol: float | None = None) -> list[int]:
    """Steps at which Lightning's SpikeDetection (mode "min") fires."""
    out: list[int] = []
    recent: list[float] = []
    last = 0.0
    for i, (step, loss) in enumerate(zip(steps, losses)):
        spike = False
        if i >= warmup:
            if not math.isfinite(loss):
                spike = True
            elif loss - last > 0.0 and recent:  # not an improvement over the last non-spike loss
                mean = math.fsum(recent) / len(recent)
                ok_a = atol is None or abs(loss - mean) >= abs(atol)
                ok_r = rtol is None or abs(loss - mean) >= abs(rtol * mean)
                spike = ok_a and ok_r
        if spike:
            out.append(int(step))
        elif math.isfinite(loss):
            recent.append(loss)
            if len(recent) > window:
                recent.pop(0)
            last = loss
    return out


def zclip_scores(steps: Sequence[int], grad_norms: Sequence[float], *, alpha: float = 0.97, z_thresh: float = 2.5,
                 warmup: int = 25, eps: float = 1e-6) -> list[tuple[int, float]]:
    """ZClip's z-score of the gradient norm at every step after its warm-up: [(step, z)] (inf for a
    non-finite norm). ``z_thresh`` is where ZClip clips a spike's norm before it enters the EMA."""
    out: list[tuple[int, float]] = []
    buf: list[float] = []
    mu = var = None
    for step, g in zip(steps, grad_norms):
        if not math.isfinite(g):
            out.append((int(step), math.inf))
            continue
        if mu is None:
            buf.append(g)
            if len(buf) == warmup:
                mu = math.fsum(buf) / len(buf)
                var = math.fsum((x - mu) ** 2 for x in buf) / len(buf)
            continue
        sd = math.sqrt(var)
        z = (g - mu) / (sd + eps)
        out.append((int(step), z))
        if z > z_thresh:
            g = mu + z_thresh * sd
        mu = alpha * mu + (1 - alpha) * g
        var = alpha * var + (1 - alpha) * (g - mu) ** 2
    return out


def zclip(steps: Sequence[int], grad_norms: Sequence[float], *, alpha: float = 0.97, z_thresh: float = 2.5,
          warmup: int = 25, eps: float = 1e-6) -> list[int]:
    """Steps at which ZClip's z-score of the gradient norm exceeds ``z_thresh`` (a non-finite norm fires too)."""
    return [s for s, z in zclip_scores(steps, grad_norms, alpha=alpha, z_thresh=z_thresh, warmup=warmup, eps=eps)
            if z > z_thresh]


def qk_clip(steps: Sequence[int], max_logits: Sequence[float], *, tau: float = 100.0) -> list[int]:
    """Monitored steps at which the largest max logit over all heads exceeds ``tau``."""
    return [int(s) for s, m in zip(steps, max_logits) if math.isfinite(m) and m > tau]


def run_baselines(steps, losses, grad_norms, monitored_steps, max_logits) -> dict[str, list[int]]:
    """Every baseline on one run: {name: [steps at which it fires]}.

    Args:
        steps, losses, grad_norms: every optimizer step's values.
        monitored_steps, max_logits: each monitored step and its largest max logit over all heads.
    """
    return {"loss_spike": loss_spike(steps, losses), "zclip": zclip(steps, grad_norms),
            "qk_clip": qk_clip(monitored_steps, max_logits)}
