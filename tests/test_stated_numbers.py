"""Every number the README and docs/EXPERIMENTS.md state about the early-warning test comes from the
result file in results/ (research.stated_numbers makes the blocks; these tests hold them equal)."""
import json
from pathlib import Path

import pytest

from research import stated_numbers

ROOT = Path(__file__).resolve().parents[1]


def test_the_stated_early_warning_numbers_are_the_recorded_ones():
    assert stated_numbers.differences() == []


def test_the_readme_paragraph_follows_the_result_file(tmp_path, monkeypatch):
    """A changed count in the result file changes the paragraph: the check can fail."""
    result = json.loads(stated_numbers.TEST_1.read_text())
    result["table"]["repeated_max_bf16_trend"]["lead_ge_1000"] = 19
    changed = tmp_path / "test.json"
    changed.write_text(json.dumps(result))
    monkeypatch.setattr(stated_numbers, "TEST_1", changed)
    assert "| `repeated_max_bf16_trend` | 19/23 |" in stated_numbers.readme_block()
    assert stated_numbers.differences()


@pytest.mark.parametrize("name", ["TEST_1", "TEST_2"])
def test_the_result_file_records_the_frozen_thresholds_it_used(name):
    result = json.loads(getattr(stated_numbers, name).read_text())
    frozen = json.loads((ROOT / "research/preregistration/early-warning-thresholds.json").read_text())
    assert result["thresholds_commit"] == frozen["commit"]
    assert {k: v["threshold"] for k, v in result["table"].items() if k in frozen["thresholds"]} == \
        {k: v for k, v in frozen["thresholds"].items() if k in result["table"]}


def test_the_runs_under_way_add_an_interim_result_and_later_outcomes():
    """The under-way sentence counts both kinds of file: an interim test (unconfirmed blow-ups listed
    apart) and an outcomes file (runs monitored incompletely counted in the total, not as blow-ups)."""
    interim = {"runs": {"a": {"outcome": {"survivor": True}}, "b": {"outcome": {"survivor": False}}},
               "excluded_unconfirmed": [{"seed": 3}], "excluded_incomplete": [{"seed": 4}]}
    later = {"kind": "outcomes", "runs": {
        "c": {"outcome": {"survivor": False}, "monitoring": {"complete": True}},
        "d": {"outcome": {"survivor": True}, "monitoring": {"complete": True}},
        "e": {"outcome": {"survivor": False}, "monitoring": {"complete": False}}}}
    assert stated_numbers._under_way_sentence(interim, later).endswith("3 of 7 runs blew up so far, 2 survived.")


def test_the_auto_fix_sentence_follows_its_result_file(tmp_path, monkeypatch):
    """The README's auto_fix sentence is read from the sixth protocol's result: a run that blew up
    in the file shows in the sentence."""
    result = json.loads(stated_numbers.AUTO_FIX.read_text())
    assert "0 of 8 blew up" in stated_numbers.readme_block()
    result["pairs"][0]["fix"]["survivor"] = False
    changed = tmp_path / "auto-fix.json"
    changed.write_text(json.dumps(result))
    monkeypatch.setattr(stated_numbers, "AUTO_FIX", changed)
    assert "1 of 8 blew up" in stated_numbers.readme_block()
    assert stated_numbers.differences()
