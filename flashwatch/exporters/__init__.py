"""Exporters: where a monitored step's snapshot goes (Prometheus, JSONL, console).

``from flashwatch.exporters import PrometheusExporter, JsonlExporter, ConsoleExporter`` works;
each backend module is imported only when its name is first used, so a program that only
writes JSONL never imports the HTTP server or rich.
"""

from __future__ import annotations

import importlib

from .base import Exporter, FanOut, Layout, StepRecord

_LAZY = {
    "PrometheusExporter": ".prometheus",
    "PortInUseError": ".prometheus",
    "JsonlExporter": ".jsonl",
    "read_jsonl": ".jsonl",
    "ConsoleExporter": ".console",
}

__all__ = ["Exporter", "FanOut", "Layout", "StepRecord", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
