"""The metric table is the one place metric names are defined."""

from __future__ import annotations

import re

from flashwatch.metrics import ALL_METRICS, BY_NAME, LABEL_VALUES, METRICS, SERVICE_METRICS, markdown_table
from flashwatch.vocabulary import RULES, VARIANT_LABELS


def test_names_follow_prometheus_conventions():
    for m in ALL_METRICS:
        assert re.fullmatch(r"flashwatch_[a-z0-9_]+", m.name), m.name
        assert m.kind in ("gauge", "counter"), m.name
        assert (m.kind == "counter") == m.name.endswith("_total"), m.name
        assert "step" not in m.labels, f"{m.name}: the step is never a label"
        assert m.help.endswith("."), m.name


def test_markdown_table_lists_every_metric():
    table = markdown_table()
    for m in ALL_METRICS:
        assert f"`{m.name}`" in table


def test_readme_table_is_the_generated_one():
    import pathlib

    readme = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "SIGNALS.md").read_text()
    start, end = "<!-- metric-table:start -->\n", "<!-- metric-table:end -->"
    assert start in readme and end in readme
    block = readme.split(start, 1)[1].split(end, 1)[0].strip()
    assert block == markdown_table(), "README metric table is stale: regenerate with `flashwatch metrics`"


def test_label_vocabularies_are_the_vocabularys():
    assert LABEL_VALUES == {"rule": RULES, "variant": VARIANT_LABELS}
    for label in LABEL_VALUES:
        assert any(label in m.labels for m in METRICS), label
    assert BY_NAME["flashwatch_kernel_variant"].labels == ("layer", "variant")
    assert set(BY_NAME["flashwatch_alert_active"].labels) == {"rule", "layer", "head"}


def test_synthetic_snapshots_use_the_label_vocabularies():
    from flashwatch.exporters.testing import synthetic_layout, synthetic_snapshot

    snap = synthetic_snapshot(synthetic_layout(2, 3))
    assert {v for _, v in snap["flashwatch_kernel_variant"]} == set(VARIANT_LABELS)
    assert {r for (r,) in snap["flashwatch_alerts_total"]} == set(RULES)


def test_service_metrics_follow_the_conventions_and_stay_out_of_a_steps_record():
    names = [m.name for m in ALL_METRICS]
    assert len(names) == len(set(names))
    assert [m.name for m in SERVICE_METRICS] == ["flashwatch_build_info", "flashwatch_last_step_timestamp_seconds"]
    info, stamp = SERVICE_METRICS
    assert info.kind == "gauge" and info.labels == ("version",)  # the *_info convention: value 1, labels
    assert stamp.kind == "gauge" and stamp.name.endswith("_seconds") and stamp.labels == ()  # base unit
    from flashwatch.exporters.jsonl import STEP_SCHEMA

    assert not set(STEP_SCHEMA["properties"]["metrics"]["properties"]) & {m.name for m in SERVICE_METRICS}


def test_the_metrics_command_stops_quietly_when_its_reader_does():
    """``flashwatch metrics | head -1``: no BrokenPipeError traceback (fail before: one on stderr)."""
    import subprocess
    import sys

    cmd = subprocess.Popen([sys.executable, "-m", "flashwatch.cli", "metrics"], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE)
    cmd.stdout.close()  # the reader is gone before the table is written (Python takes longer to start)
    err = cmd.stderr.read().decode()
    assert cmd.wait(timeout=60) == 0 and "Traceback" not in err and "BrokenPipe" not in err, err
