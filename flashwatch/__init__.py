"""flashwatch: a training-time stability monitor for BF16 flash attention.

See README.md. The kernels live in ``flashwatch.kernels``.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__"]
