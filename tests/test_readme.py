"""The README says true things about the code: defaults it quotes, commands and files it names."""

from __future__ import annotations

import dataclasses
import pathlib
import re

from flashwatch.cli import build_parser
from flashwatch.config import MonitorConfig
from flashwatch.detectors import RULES

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _value(text: str):
    return {"None": None, "True": True, "False": False}.get(text, text)


def test_quoted_config_defaults_are_the_code_defaults():
    fields = {f.name for f in dataclasses.fields(MonitorConfig)}
    defaults = MonitorConfig()
    quoted = re.findall(r"`([a-z_0-9]+)=([^`]+)`", README)
    checked = 0
    for name, text in quoted:
        if name not in fields or text.startswith(('"', "{", "'")):
            continue  # a keyword example (auto_fix="fp32_delta"), not a default
        want = getattr(defaults, name)
        got = _value(text.strip().strip('"'))
        if isinstance(want, float):
            assert float(got) == want, f"README says {name}={text}, MonitorConfig has {want}"
        elif isinstance(want, (frozenset, tuple)) or want is None or isinstance(want, bool):
            assert got == want or str(got) == str(want), f"README says {name}={text}, MonitorConfig has {want!r}"
        else:
            assert str(got) == str(want), f"README says {name}={text}, MonitorConfig has {want!r}"
        checked += 1
    assert checked >= 15


def test_every_rule_is_in_the_alert_table():
    table = README.split("## Alerts", 1)[1].split("\n## ", 1)[0]
    for rule in RULES:
        assert f"| `{rule}` |" in table, rule


def test_named_commands_and_files_exist():
    commands = set(build_parser()._subparsers._group_actions[0].choices)
    for name in re.findall(r"`flashwatch ([a-z]+)", README):
        assert name in commands, f"README names `flashwatch {name}`"
    paths = re.findall(r"`((?:examples|dashboards|docs|flashwatch|benchmarks)/[\w./-]*\.(?:py|md|yml|json|sh))`", README)
    assert len(paths) >= 10
    for path in paths:
        if path == "docs/EXPERIMENTS.md":  # being written alongside the experiments
            continue
        assert (ROOT / path).exists(), f"README names {path}"
    for target in ("demo:", "test:"):
        assert target in (ROOT / "Makefile").read_text()
    assert "make test" in (ROOT / ".ci" / "run").read_text()
