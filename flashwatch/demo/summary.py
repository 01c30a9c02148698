"""The short report printed at the end of the demo, and the ``flashwatch`` command line its hints use."""

from __future__ import annotations

import os
import shlex
import shutil
import sys
from collections import Counter
from importlib.util import find_spec
from pathlib import Path

from ..exporters.summary import top_heads
from ..vocabulary import INJECTED
from .training import DemoResult

__all__ = ["report_lines", "flashwatch_command"]

_SIGNALS = (  # (label, metric, ranked by, format)
    ("|drift z|", "flashwatch_delta_drift_z", abs, "{:+.2f}"),
    ("repeated-max ratio (BF16)", "flashwatch_repeated_max_ratio_bf16", float, "{:.1%}"),
    ("W^Q spectral norm", "flashwatch_wq_spectral_norm", float, "{:.3g}"),
    ("max logit", "flashwatch_max_logit", float, "{:.3g}"),
)
_SMALL_MODEL_RULES = {"repeated_max_rise", "wq_growth", "wq_outlier"}  # thresholds set for long runs


def flashwatch_command() -> str:
    """``flashwatch`` as a shell command that runs this installation from here.

    The bare name when the shell finds this interpreter's ``flashwatch`` script on PATH; the
    script's absolute path when it is not on PATH (``make demo`` runs ``.venv/bin/flashwatch``
    without activating the environment); ``python -m flashwatch.cli`` with this interpreter when
    there is no script.
    """
    script = Path(sys.executable).parent / "flashwatch"
    if script.is_file() and os.access(script, os.X_OK):
        found = shutil.which("flashwatch")
        if found is not None and Path(found).resolve() == script.resolve():
            return "flashwatch"
        return shlex.quote(str(script.absolute()))
    return f"{shlex.quote(sys.executable)} -m flashwatch.cli"


def _alert_lines(result: DemoResult) -> list[str]:
    if not result.alerts:
        return ["  alerts:  none"]
    counts = Counter(a.rule for a in result.alerts)
    severities = Counter(a.severity for a in result.alerts)
    by_rule = ", ".join(f"{rule} x{n}" for rule, n in counts.most_common())
    lines = [f"  alerts:  {len(result.alerts)} ({severities.get('critical', 0)} critical, "
             f"{severities.get('warning', 0)} warning): {by_rule}"]
    firsts: dict = {}
    for a in result.alerts:
        firsts.setdefault(a.rule, a)
    for a in sorted(firsts.values(), key=lambda a: a.step):
        where = f"L{a.layer}.H{a.head}" if a.head >= 0 else (f"L{a.layer}" if a.layer >= 0 else "run")
        lines.append(f"    first {a.rule} at step {a.step} ({a.severity}, {where}, value {a.value:.3g} vs "
                     f"threshold {a.threshold:.3g})")
    if not result.injected and severities.get("critical", 0) == 0 and set(counts) & _SMALL_MODEL_RULES:
        lines.append("    warnings only: repeated-max rise and W^Q growth use thresholds set for runs of "
                     "thousands of steps; early training of a small model can cross them")
    return lines


def report_lines(result: DemoResult, *, top: int = 3) -> list[str]:
    """The short report printed at the end of the demo, as plain lines."""
    cmd = flashwatch_command()
    tag = f" [{INJECTED} FAULT, rounding bias {result.injected:g}]" if result.injected else ""
    lines = [f"flashwatch demo report{tag}"]
    finite = [(s, v) for s, v in result.losses if v == v]
    if finite:
        (s0, l0), (s1, l1) = finite[0], finite[-1]
        loss = f"{l0:.3f} at step {s0} -> {l1:.3f} at step {s1}"
    else:
        loss = "not measured"
    done = f"{result.steps} optimizer steps"
    if result.interrupted:
        done = f"{result.steps} of {result.steps_asked} optimizer steps (stopped by Ctrl-C)"
    lines.append(f"  steps:   {done} in {result.seconds:.1f} s on {result.device} ({result.mode} mode), "
                 f"every step monitored")
    lines.append(f"  loss:    {loss}")
    lines.append("  top heads at the last step (layer.head value):")
    for label, metric, key, fmt in _SIGNALS:
        heads = top_heads(result.snapshot, metric, top, key)
        shown = "   ".join(f"L{l}.H{h} {fmt.format(v)}" for l, h, v in heads if v == v) or "not measured"
        lines.append(f"    {label:<26} {shown}")
    lines += _alert_lines(result)
    if result.injected and not any(a.rule == "delta_drift" for a in result.alerts):
        lines.append(f"    ({INJECTED} run without a delta_drift alert: try more --steps or another --seed)")
    if not result.injected and not any(a.severity == "critical" for a in result.alerts):
        lines.append(f"    see an early warning: {cmd} demo --provoke (an injected fault)")
    if result.errors:
        lines.append(f"  monitor errors: {result.errors} (see the warnings above)")
    lines.append(f"  metrics: {result.url or 'not served'} served them while training (the server stops with the "
                 f"run); scrape config dashboards/prometheus.yml, Grafana: dashboards/")
    d = result.run_dir
    lines.append(f"  files:   {d}/")
    lines.append("    metrics.jsonl    one JSON line per monitored step")
    lines.append(f"    alerts.log       {len(result.alerts)} alert line(s)")
    if result.checkpoint is not None:
        lines.append(f"    {result.checkpoint.name:<16} model, optimizer and flashwatch state "
                     f"(trainer.fit(..., ckpt_path=) resumes)")
    lines.append("    demo.json        what ran")
    if result.report is not None:
        lines.append(f"    {result.report.name:<16} loss, alerts and per-head heatmaps (open it in a browser)")
    q = shlex.quote(str(d))
    if find_spec("matplotlib") is not None:
        lines.append(f"  picture: {cmd} report {q} --out {shlex.quote(str(d / 'report.png'))}")
    else:
        lines.append(f"  picture: {cmd} report {q} (HTML; a PNG needs matplotlib: pip install matplotlib)")
    return lines
