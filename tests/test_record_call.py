"""research.record_call: one device call's returned block filed under results/ as the index names it."""

import json
import shutil
from pathlib import Path

import pytest

from research import record_call

ROOT = Path(__file__).resolve().parent.parent
SPLIT_9 = ROOT / "results" / "seed-split-9"


def _device_call(tmp_path: Path) -> Path:
    """A folder as a call of ``split_call.sh split9 (SPLIT_SEEDS=708-715)`` returns it, made from
    the recorded block (its archives under the names the call gives them)."""
    device = tmp_path / "device"
    device.mkdir()
    for first, last in ((708, 711), (712, 715)):
        shutil.copyfile(SPLIT_9 / f"test-runs-{first}-{last}.tar.xz",
                        device / f"runs-{'-'.join(str(s) for s in range(first, last + 1))}.tar.xz")
    runner = json.loads((SPLIT_9 / "seed-split-test9-708-715.json").read_text())
    extra = dict(next(iter(runner["runs"].values())), seed=699)  # a run of an earlier block on the same machine
    runner["runs"]["seed-split/other/699"] = extra
    (device / "seed-split-test9.json").write_text(json.dumps(runner))
    shutil.copyfile(SPLIT_9 / "test-708-715.log", device / "seed-split-test9.log")
    return device


@pytest.mark.skipif(not (SPLIT_9 / "test-runs-708-711.tar.xz").exists(), reason="the recorded block is not here")
def test_a_returned_test_block_is_filed_with_the_outcomes_already_recorded_for_it(tmp_path, monkeypatch):
    device = _device_call(tmp_path)
    monkeypatch.chdir(tmp_path)  # outcomes name runs by their path from the working folder, as in results/
    result = record_call.record(device, Path("results"), 9, "test", record_call.parse_seeds("708-715"))
    folder = tmp_path / "results" / "seed-split-9"
    assert sorted(p.name for p in folder.glob("test-runs-*.tar.xz")) == ["test-runs-708-711.tar.xz",
                                                                        "test-runs-712-715.tar.xz"]
    assert sorted(p.name for p in (folder / "test").iterdir()) == [f"seed{s}" for s in range(708, 716)]
    runner = json.loads((folder / "seed-split-test9-708-715.json").read_text())
    assert sorted(v["seed"] for v in runner["runs"].values()) == list(range(708, 716))  # not seed 699
    assert (folder / "test-708-715.log").read_text() == (SPLIT_9 / "test-708-715.log").read_text()
    recorded = json.loads((SPLIT_9 / "test-outcomes-708-715.json").read_text())
    assert result["counts"] == recorded["counts"]
    assert result["runs"] == recorded["runs"]  # the same keys (results/seed-split-9/test/seedN) and outcomes
    assert json.loads((folder / "test-outcomes-708-715.json").read_text())["counts"] == recorded["counts"]
    assert (folder / "test-outcomes-708-715.md").read_text().startswith("8 runs: 7 blew up (confirmed)")
    # a second recording of the same block overwrites nothing
    with pytest.raises(ValueError, match="already recorded"):
        record_call.record(device, Path("results"), 9, "test", list(range(708, 716)))


@pytest.mark.skipif(not (SPLIT_9 / "test-runs-708-711.tar.xz").exists(), reason="the recorded block is not here")
def test_a_block_with_runs_missing_or_mixed_or_a_pilot_without_its_peak_is_refused_before_anything_is_written(
        tmp_path):
    device = _device_call(tmp_path)
    results = tmp_path / "results"
    with pytest.raises(ValueError, match=r"seeds \[716\] did not come back finished"):
        record_call.record(device, results, 9, "test", list(range(708, 717)))
    with pytest.raises(ValueError, match="archives hold seeds outside 708-713"):
        record_call.record(device, results, 9, "test", list(range(708, 714)))
    with pytest.raises(ValueError, match="give --peak"):
        record_call.record(device, results, 9, "pilot", list(range(708, 716)))
    assert not results.exists()
    assert record_call.main([str(device), "--protocol", "9", "--stage", "test", "--seeds", "731-724",
                             "--results", str(results)]) == 2
    with pytest.raises(ValueError, match="--peak must be a learning rate such as 1.75e-3"):
        record_call.record(device, results, 9, "pilot", list(range(708, 716)), peak="high")
    assert not results.exists()
    # a pilot's files are named by its peak as the docs write it, however it was given
    assert record_call.peak_label("0.00175") == record_call.peak_label("1.75e-3") == "1.75e-3"
    with pytest.raises(ValueError, match="FIRST-LAST"):
        record_call.parse_seeds("724..731")
