"""flashwatch.vocabulary: each shared name defined once, consistent, and importable without torch."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys

import pytest

from flashwatch import vocabulary as v
from flashwatch.config import MonitorConfig
from flashwatch.metrics import BY_NAME


def test_imports_without_torch_and_prints_the_alert_table():
    code = "import sys, flashwatch.vocabulary; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
    out = subprocess.run([sys.executable, "-m", "flashwatch.vocabulary"], check=True, capture_output=True,
                         text=True).stdout
    lines = out.strip().splitlines()
    assert lines[0] == "| rule | severity | what it means | what to do |"
    assert len(lines) == 2 + len(v.ALERT_SPECS)
    for line, spec in zip(lines[2:], v.ALERT_SPECS):
        assert line.startswith(f"| [`{spec.name}`](docs/ALERTS.md#{spec.name}) | {spec.severity} | ")
        assert line.count(" | ") == 3  # no stray | inside a cell


def test_rule_table_is_consistent():
    names = [r.name for r in v.ALERT_SPECS]
    assert len(names) == len(set(names)) and all(re.fullmatch(r"[a-z][a-z0-9_]*", n) for n in names)
    assert v.RULES == tuple(r.name for r in v.RULE_SPECS) and v.ALERT_SPECS[-1] is v.STOPPED_REPORTING
    assert v.STOPPED_REPORTING.name not in v.RULES and v.STOPPED_REPORTING.decided_by == "prometheus"
    assert all(r.decided_by == "monitor" for r in v.RULE_SPECS)
    assert v.BY_RULE == {r.name: r for r in v.ALERT_SPECS}
    config_fields = {f.name for f in dataclasses.fields(MonitorConfig)}
    for r in v.ALERT_SPECS:
        assert r.severity in v.SEVERITIES and r.scope in v.SCOPES, r.name
        for text in (r.summary, r.meaning, r.action):
            assert text.endswith(".") and "\n" not in text and "  " not in text, (r.name, text)
        assert len(r.summary) <= 100, r.name  # one line
        assert r.signal is None or r.signal in BY_NAME, r.name
        assert set(r.settings) <= config_fields, r.name
        assert r.runbook == f"docs/ALERTS.md#{r.name}"
    assert v.BY_RULE["delta_drift"].alert == "FlashwatchDeltaDrift"
    assert v.STOPPED_REPORTING.alert == "FlashwatchStoppedReporting"


def test_a_bad_rule_entry_is_refused():
    with pytest.raises(ValueError, match="severity must be one of"):
        v.RuleSpec("x", "info", "s.", "m.", "a.")
    with pytest.raises(ValueError, match="scope must be one of"):
        v.RuleSpec("x", "warning", "s.", "m.", "a.", scope="model")


def test_variants_and_their_codes():
    assert v.VARIANTS == ("plain", "fixed", "fp32_delta") and set(v.FIX_VARIANTS) < set(v.VARIANTS)
    assert v.VARIANT_LABELS == ("sdpa", *v.VARIANTS)
    # higher is more fixed: a distributed run keeps the largest code any rank runs
    assert [v.VARIANT_CODE[x] for x in v.VARIANT_LABELS] == list(range(len(v.VARIANT_LABELS)))
    assert min(v.VARIANT_CODE[x] for x in v.FIX_VARIANTS) > v.VARIANT_CODE["plain"] > v.VARIANT_CODE["sdpa"]
    assert v.MODES == ("own_kernel", "observe")


def test_the_kernels_read_the_same_variants():
    import flashwatch.kernels as kernels
    from flashwatch.kernels import checks

    assert kernels.VARIANTS is v.VARIANTS and checks.VARIANTS is v.VARIANTS


@pytest.mark.parametrize("port", [0, 1, 9400, 65535, None])
def test_check_port_accepts(port):
    assert v.check_port(port) == port


@pytest.mark.parametrize("port", [-1, 65536, "9400", True, 9400.0])
def test_check_port_refuses_with_what_is_accepted(port):
    with pytest.raises(ValueError, match=r"^port must be an int in 0\.\.65535 \(0: any free port\) or None"):
        v.check_port(port)
    with pytest.raises(ValueError, match=r"^--port must be an int in 0\.\.65535 \(0: any free port\), got"):
        v.check_port(port, "--port", allow_none=False)
    with pytest.raises(ValueError, match="got None"):
        v.check_port(None, allow_none=False)


def test_injected_label():
    assert v.INJECTED == "INJECTED"
