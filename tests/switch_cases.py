"""Switches read from the environment when a kernels module is imported: the value each setting gives."""

from __future__ import annotations

import os
import subprocess
import sys


def read_at_import(variable: str, value: str | None, module: str, attribute: str) -> tuple[bool, str]:
    """Import ``flashwatch.kernels.<module>`` in a fresh interpreter with ``variable`` set to ``value``
    (None: unset) and print ``<module>.<attribute>``: (whether the import succeeded, its output)."""
    env = {k: v for k, v in os.environ.items() if k != variable}
    if value is not None:
        env[variable] = value
    out = subprocess.run([sys.executable, "-c", f"from flashwatch.kernels import {module}; print({module}.{attribute})"],
                         env=env, capture_output=True, text=True, timeout=120)
    return out.returncode == 0, out.stdout + out.stderr
