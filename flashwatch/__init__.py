"""flashwatch: a training-time stability monitor for BF16 flash attention.

See README.md. The kernels live in ``flashwatch.kernels``.

Public API::

    from flashwatch import Monitor, MonitorConfig, Alert, TrainingStopped, RULES

These names are imported on first use, so ``flashwatch --version`` does not import torch.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_LAZY = {
    "MonitorConfig": ".config",
    "Monitor": ".monitor",
    "TrainingStopped": ".monitor",
    "Alert": ".detectors",
    "RULES": ".vocabulary",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
