"""INJECTED faults for tests, the demo's ``--provoke`` and experiments: never in training you care about.

One process-wide knob, kept off the public kernel signature: while a rounding bias is set,
every ``flash_attention`` call of this process biases the rounding of its output on rows
where P_bar is exactly 1 at two or more keys (``reference.inject_rounding_bias``), which is
where and when the paper's error enters. The ``fixed`` variant keeps every P_bar below 1, so
the fault never triggers there; ``fp32_delta`` takes delta from the FP32 output before the
bias, so the fault reaches O but not the gradient. With the strength at 0 (the default) the
kernels compile and run exactly as without this module.

Example::

    from flashwatch.kernels import faults

    with faults.rounding_bias(3.0):   # INJECTED
        loss = model(x).backward()
"""

from __future__ import annotations

import contextlib
import math
import numbers
from typing import Iterator

__all__ = ["rounding_bias", "set_rounding_bias", "rounding_bias_strength"]

_strength = 0.0


def _checked(strength: object) -> float:
    if isinstance(strength, bool) or not isinstance(strength, numbers.Real) or not math.isfinite(strength) \
            or strength < 0:
        raise ValueError(f"rounding-bias strength must be a finite number >= 0 (units of 2**-8 of |O|), "
                         f"got {strength!r}")
    return float(strength)


def set_rounding_bias(strength: float) -> None:
    """Set the process-wide INJECTED rounding bias (0 turns it off)."""
    global _strength
    _strength = _checked(strength)


def rounding_bias_strength() -> float:
    """The strength in force now (0.0: no fault)."""
    return _strength


@contextlib.contextmanager
def rounding_bias(strength: float) -> Iterator[None]:
    """Inject the rounding bias inside the ``with`` block; the previous strength comes back after it."""
    global _strength
    previous, _strength = _strength, _checked(strength)
    try:
        yield
    finally:
        _strength = previous
