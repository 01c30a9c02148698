"""Replay and calibration of recorded training runs: what would the Monitor have said?

A recorded run is a folder of exact per-step and per-monitored-step readings (``records``).
From it, without training again: the blow-up step, every detector's alerts under any
``MonitorConfig``, the baselines' alerts, lead times, and the evidence for the default
thresholds. ``flashwatch experiment analyze --help`` is the command-line manual.

Modules:
    records      the run folder's files: written exactly, read back
    blowup       when a run blew up (median-of-20 rule), lead time
    playback     the Monitor's detectors replayed on a recording
    baselines    Lightning-style loss spike, ZClip, QK-Clip, replayed on the same recording
    runs         one run analysed: first alerts per rule, baselines, leads, final loss
    results      the results JSON: runs merged by key, aggregate per arm, targets
    calibration  margins and threshold sweeps over many runs
    tables       the text of the above (run table, targets, calibration)
    cli          ``flashwatch experiment analyze``

The common entry points are importable from here::

    from flashwatch.replay import analyze_run, calibrate
"""

from __future__ import annotations

import importlib

_LAZY = {
    "analyze_run": ".runs",
    "find_runs": ".runs",
    "calibrate": ".calibration",
    "replay": ".playback",
    "load_records": ".playback",
    "config_for": ".playback",
    "blowup_step": ".blowup",
    "merge_results": ".results",
}

__all__ = list(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
