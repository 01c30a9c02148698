"""The JSONL files never lose or glue records silently: a full disk, a deleted run folder, a
crash-cut line; and the alert log and the per-head grids hold exactly what they should."""

from __future__ import annotations

import errno
import io
import logging
import shutil

import pytest

from flashwatch.detectors import Alert
from flashwatch.exporters import FanOut
from flashwatch.exporters import appendfile
from flashwatch.exporters.jsonl import ALERTS_FILE, METRICS_FILE, JsonlExporter, encode_metrics, read_jsonl
from flashwatch.exporters.testing import synthetic_layout, synthetic_record, synthetic_snapshot

LAYOUT = synthetic_layout(num_layers=2, num_heads=3)


class FillingDisk(io.FileIO):
    """A real file whose writes fail like a full disk while ``full`` is set: half the bytes
    reach the file, then OSError(ENOSPC), as a write that runs out of room mid-line."""

    full = False

    def write(self, data):
        if FillingDisk.full:
            data = bytes(data)
            super().write(data[: len(data) // 2])
            raise OSError(errno.ENOSPC, "No space left on device")
        return super().write(data)


@pytest.fixture
def filling_disk(monkeypatch):
    monkeypatch.setattr(appendfile, "open_raw", lambda path: FillingDisk(path, "a+"))
    FillingDisk.full = False
    yield FillingDisk
    FillingDisk.full = False


def steps_of(path, strict=True):
    return [r["step"] for r in read_jsonl(path, strict=strict)]


def test_a_full_disk_leaves_no_partial_record_and_is_counted_and_logged(tmp_path, filling_disk, caplog):
    exporter = JsonlExporter(tmp_path / "run")
    errors = []
    fan = FanOut([exporter], on_error=lambda e, phase, exc: errors.append((phase, exc)))
    fan.open(LAYOUT)
    fan.export(synthetic_record(LAYOUT, step=0))
    with caplog.at_level(logging.WARNING, logger="flashwatch.exporters"):
        filling_disk.full = True
        fan.export(synthetic_record(LAYOUT, step=1))
        fan.export(synthetic_record(LAYOUT, step=2))
        filling_disk.full = False  # room again
    fan.export(synthetic_record(LAYOUT, step=3))
    fan.close()

    path = tmp_path / "run" / METRICS_FILE
    # strict: every line is a whole record; the two failed steps are missing, nothing is glued
    assert steps_of(path) == [0, 3]
    assert [r["kind"] for r in read_jsonl(path, kinds=None, strict=True)] == ["open", "step", "step", "close"]
    assert path.read_bytes().endswith(b"\n")
    assert exporter.errors == 2 and fan.errors == 2 and fan.failures == {"jsonl": 2}
    assert all(phase == "export" and exc.errno == errno.ENOSPC for phase, exc in errors)
    assert str(path) in str(errors[0][1]) and "partial line was removed" in str(errors[0][1])
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1  # the first failure; the second is counted
    assert str(path) in (warnings[0].exc_text or "") + warnings[0].getMessage() + str(warnings[0].exc_info[1])


def test_a_full_disk_while_writing_the_alert_log_leaves_it_whole(tmp_path, filling_disk):
    exporter = JsonlExporter(tmp_path)
    exporter.open(LAYOUT)
    alert = Alert(rule="delta_drift", step=1, layer=0, head=1, value=5.0, threshold=4.5,
                  severity="warning", message="m")
    exporter.export(synthetic_record(LAYOUT, step=1, alerts=[alert]))
    log_before = (tmp_path / ALERTS_FILE).read_bytes()
    filling_disk.full = True
    with pytest.raises(OSError, match="No space left"):
        exporter.export(synthetic_record(LAYOUT, step=2, alerts=[alert]))
    filling_disk.full = False
    exporter.close()
    assert (tmp_path / ALERTS_FILE).read_bytes() == log_before
    assert steps_of(tmp_path) == [1]


def test_a_deleted_run_folder_is_recreated_with_a_warning_and_no_record_is_dropped(tmp_path, caplog):
    run = tmp_path / "run"
    exporter = JsonlExporter(run)
    fan = FanOut([exporter])
    fan.open(LAYOUT)
    fan.export(synthetic_record(LAYOUT, step=0))
    shutil.rmtree(run)  # for real: the open files now point at deleted inodes
    with caplog.at_level(logging.WARNING, logger="flashwatch.exporters.jsonl"):
        for step in (1, 2):
            fan.export(synthetic_record(LAYOUT, step=step, alerts=[
                Alert(rule="loss_spike", step=step, layer=-1, head=-1, value=9.0, threshold=6.0,
                      severity="critical", message="m")]))
    fan.close()
    assert steps_of(run) == [1, 2]  # every record after the deletion is in the new file
    kinds = [r["kind"] for r in read_jsonl(run, kinds=None, strict=True)]
    assert kinds == ["open", "step", "step", "close"]  # the new file starts with the layout
    assert len((run / ALERTS_FILE).read_text().splitlines()) == 2
    assert exporter.recreated == 1
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and str(run / METRICS_FILE) in warned[0] and "vanished" in warned[0]


def test_a_run_folder_that_cannot_be_recreated_is_an_error_each_step(tmp_path):
    run = tmp_path / "run"
    exporter = JsonlExporter(run)
    fan = FanOut([exporter])
    fan.open(LAYOUT)
    shutil.rmtree(run)
    run.write_text("a file where the folder was")
    fan.export(synthetic_record(LAYOUT, step=1))
    fan.export(synthetic_record(LAYOUT, step=2))
    assert fan.errors == 2  # never silent


def test_a_run_folder_recreated_on_a_full_disk_is_tried_again_until_it_works(tmp_path, monkeypatch):
    """The folder deleted while the disk is full: each step tries to create it again (an error each
    time), and once there is room the run writes on there, closing with its close record."""
    run = tmp_path / "run"
    exporter = JsonlExporter(run)
    fan = FanOut([exporter])
    fan.open(LAYOUT)
    fan.export(synthetic_record(LAYOUT, step=0))
    shutil.rmtree(run)
    real_mkdir = type(run).mkdir

    def full(self, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(type(run), "mkdir", full)
    fan.export(synthetic_record(LAYOUT, step=1))
    fan.export(synthetic_record(LAYOUT, step=2))
    assert fan.errors == 2 and exporter.errors == 2 and not run.exists()
    monkeypatch.setattr(type(run), "mkdir", real_mkdir)
    fan.export(synthetic_record(LAYOUT, step=3))
    fan.export(synthetic_record(LAYOUT, step=4))
    fan.close()
    assert fan.errors == 2 and exporter.recreated == 1
    assert [(r["kind"], r.get("step")) for r in read_jsonl(run / METRICS_FILE, kinds=None)] == [
        ("open", None), ("step", 3), ("step", 4), ("close", None)]


def test_a_line_cut_by_a_crash_is_moved_aside_when_the_run_resumes(tmp_path):
    exporter = JsonlExporter(tmp_path)
    exporter.open(LAYOUT)
    for s in (0, 10, 20):
        exporter.export(synthetic_record(LAYOUT, step=s))
    path = tmp_path / METRICS_FILE
    data = path.read_bytes()
    exporter._f.close()  # the process dies here: no close record
    exporter._f = None
    whole = data.rindex(b"\n", 0, len(data) - 1) + 1
    path.write_bytes(data[: whole + 40])  # step 20's line cut
    assert steps_of(path, strict=False) == [0, 10]

    resumed = JsonlExporter(tmp_path)
    resumed.open(LAYOUT)
    resumed.export(synthetic_record(LAYOUT, step=20))
    resumed.close()
    assert steps_of(path) == [0, 10, 20]  # strict: the half line is not left mid-file
    assert [r["kind"] for r in read_jsonl(path, kinds=None)] == ["open", "step", "step", "open", "step", "close"]
    assert (tmp_path / (METRICS_FILE + ".cut")).read_bytes() == data[whole: whole + 40] + b"\n"  # nothing lost


def test_lines_another_program_left_without_a_newline_are_kept(tmp_path, caplog):
    """A run folder whose metrics file ends in a whole JSON record without its newline, and an alert
    log of one line without one (both written by another program): opening keeps every byte and
    writes on after a newline (before, both last lines were removed as if a crash had cut them)."""
    path, alerts = tmp_path / METRICS_FILE, tmp_path / ALERTS_FILE
    path.write_bytes(b'{"epoch": 1, "val_loss": 2.5}\n{"epoch": 2, "val_loss": 2.1}')
    alerts.write_bytes(b"my own notes about this run")
    exporter = JsonlExporter(tmp_path)
    with caplog.at_level(logging.WARNING, logger="flashwatch"):
        exporter.open(LAYOUT)
    exporter.export(synthetic_record(LAYOUT, step=0, alerts=[Alert(rule="max_logit", step=0, layer=0, head=1,
                                                                   value=1200.0, threshold=1000.0,
                                                                   severity="warning", message="m")]))
    exporter.close()
    lines = path.read_bytes().split(b"\n")
    assert lines[:2] == [b'{"epoch": 1, "val_loss": 2.5}', b'{"epoch": 2, "val_loss": 2.1}']
    assert [r.get("kind") for r in read_jsonl(path, kinds=None, strict=True)] == [None, None, "open", "step", "close"]
    text = alerts.read_text().splitlines()
    assert text[0] == "my own notes about this run" and "max_logit layer=0 head=1" in text[1]
    assert not (tmp_path / (METRICS_FILE + ".cut")).exists()
    assert sum("had no newline" in r.getMessage() for r in caplog.records) == 2


def test_the_alert_log_gets_the_new_alerts_only(tmp_path):
    old = Alert(rule="delta_drift", step=5, layer=0, head=1, value=5.0, threshold=4.5, severity="warning",
                message="old")
    new = Alert(rule="max_logit", step=6, layer=1, head=2, value=1200.0, threshold=1000.0, severity="warning",
                message="new")
    exporter = JsonlExporter(tmp_path)
    exporter.open(LAYOUT)
    record = synthetic_record(LAYOUT, step=6, alerts=[new])
    record.active_alerts = [old, new]  # the old one still holds
    exporter.export(record)
    exporter.export(synthetic_record(LAYOUT, step=7))  # both still hold, nothing new
    exporter.close()
    lines = (tmp_path / ALERTS_FILE).read_text().splitlines()
    assert len(lines) == 1 and "step=6 warning max_logit layer=1 head=2" in lines[0]


def test_encode_metrics_without_a_layout_sizes_each_layer_from_its_heads():
    layout = synthetic_layout(num_layers=3, num_heads=4)
    snap = synthetic_snapshot(layout, step=1)
    encoded = encode_metrics(snap)  # no layout: the grid's shape comes from the keys
    assert encoded == encode_metrics(snap, layout)
    for name in ("flashwatch_delta_drift_z", "flashwatch_wq_spectral_norm"):
        grid = encoded[name]
        assert [len(row) for row in grid] == [4, 4, 4], name
        assert grid[2][3] == snap[name][(2, 3)]
    # a head missing from the snapshot is null, its layer keeps its width from the layout
    del snap["flashwatch_max_logit"][(1, 3)]
    assert encode_metrics(snap, layout)["flashwatch_max_logit"][1][3] is None


def test_read_jsonl_reads_a_line_at_a_time(tmp_path):
    """A reader holds one line, not the file: lines written after reading began are read too, and a
    damaged line and a cut last line are told apart by the newline the writer ends every line with."""
    path = tmp_path / METRICS_FILE
    path.write_bytes(b'{"kind": "step", "step": 0}\n')
    records = read_jsonl(path)
    assert next(records)["step"] == 0
    with open(path, "ab") as f:
        f.write(b'{"kind": "step", "step": 1}\n{"kind": "st\n{"kind": "step", "step": 2}\n{"kind": "st')
    assert [r["step"] for r in records] == [1, 2]
    with pytest.raises(ValueError, match=":3: not a flashwatch JSONL record"):
        list(read_jsonl(path, strict=True))
