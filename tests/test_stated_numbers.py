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


@pytest.mark.parametrize("name", ["TEST_1", "TEST_2", "TEST_4"])
def test_the_result_file_records_the_frozen_thresholds_it_used(name):
    result = json.loads(getattr(stated_numbers, name).read_text())
    frozen = json.loads((ROOT / "research/preregistration/early-warning-thresholds.json").read_text())
    assert result["thresholds_commit"] == frozen["commit"]
    assert {k: v["threshold"] for k, v in result["table"].items() if k in frozen["thresholds"]} == \
        {k: v for k, v in frozen["thresholds"].items() if k in result["table"]}


def test_the_alarm_point_follows_its_result_files(tmp_path, monkeypatch):
    """The README's alarm point reads the fourth protocol's counts and verdict from its result: a changed
    count changes the README, a passing rule turns the point to "passed by" (with the number of rules
    judged) and is not called undecided; the pilots' outcomes give the constant-rate sentence."""
    result = json.loads(stated_numbers.TEST_4.read_text())
    result["table"]["chain"]["lead_ge_1000"] = 17
    changed = tmp_path / "test.json"
    changed.write_text(json.dumps(result))
    monkeypatch.setattr(stated_numbers, "TEST_4", changed)
    n_b, n_s = result["table"]["chain"]["blowups"], result["table"]["chain"]["survivors"]
    block = " ".join(stated_numbers.readme_block().split())
    assert f"| `chain` | 17/23 | 17/18 | 17/{n_b} |" in stated_numbers.readme_block()
    assert f"1.5e-3, {n_b} of {n_b + n_s} by step 20,000, undecided" in block
    assert "*As an alarm: not passed.*" in block and "1.25e-3 and 1e-3, all 16 by step 20,000" in block
    assert stated_numbers.differences()
    r1, r2 = json.loads(stated_numbers.TEST_1.read_text()), json.loads(stated_numbers.TEST_2.read_text())
    result["table"]["chain"]["verdict"] = "pass"
    sentence = stated_numbers._alarm_sentence(r1, r2, result, ["chain"])
    assert "by step 20,000, undecided" not in sentence and sentence.startswith("*As an alarm: passed by `chain`* (11 rules judged)")


def test_the_auto_fix_sentence_follows_its_result_file(tmp_path, monkeypatch):
    """The README's auto_fix sentence reads the sixth protocol's result (beside the tenth's, or alone
    before the tenth has run): a run that blew up in the file shows in the sentence."""
    result = json.loads(stated_numbers.AUTO_FIX.read_text())
    flat = " ".join(stated_numbers.readme_block().split())
    assert "(constant lr 1.5e-3: 0 of 8, twins 6)" in flat
    result["pairs"][0]["fix"]["survivor"] = False
    changed = tmp_path / "auto-fix.json"
    changed.write_text(json.dumps(result))
    monkeypatch.setattr(stated_numbers, "AUTO_FIX", changed)
    assert "(constant lr 1.5e-3: 1 of 8, twins 6)" in " ".join(stated_numbers.readme_block().split())
    assert stated_numbers.differences()
    monkeypatch.setattr(stated_numbers, "AUTO_FIX_10", tmp_path / "missing.json")
    assert "1 of 8 blew up in 13,000 steps" in " ".join(stated_numbers.readme_block().split())


def test_the_ranking_sentence_follows_the_fifth_protocols_result(tmp_path, monkeypatch):
    """The README's ranking sentence and heading are read from the landmark result: a changed AUC
    shows, and a primary rule that does not separate turns the heading back to 'not proven'."""
    result = json.loads(stated_numbers.LANDMARK.read_text())
    assert "a ranking is shown" in stated_numbers.readme_block()
    result["table"]["chain"]["auc"] = 0.81
    changed = tmp_path / "landmark.json"
    changed.write_text(json.dumps(result))
    monkeypatch.setattr(stated_numbers, "LANDMARK", changed)
    block = " ".join(stated_numbers.readme_block().split())
    assert "in 81% of" in block and stated_numbers.differences()
    result["table"]["chain"]["verdict"], result["table"]["chain"]["beats_baseline"] = "does not separate", False
    changed.write_text(json.dumps(result))
    block = " ".join(stated_numbers.readme_block().split())
    assert block.startswith("**What the early warning predicts: not proven.**")
    assert "*As a ranking: not shown*" in block and "`chain` is not shown to do better" in block


def test_the_monitors_severities_follow_the_registered_alarm_tests():
    """An early-warning rule of the Monitor is critical if and only if it passed a registered
    alarm test (lead and false-alarm bar, frozen threshold); the baselines (the loss spike among
    them) say a blow-up is under way and are not judged as warnings ahead of it."""
    from flashwatch.vocabulary import SEVERITY
    from research.early_warning import RULES

    results = stated_numbers.alarm_results()
    judged = {r for res in results for r in res["table"]} & set(RULES) & set(SEVERITY)
    passed = {r for res in results for r, row in res["table"].items() if row["verdict"] == "pass"}
    assert judged >= {"max_logit", "repeated_max_rise", "delta_drift", "wq_growth"}
    assert {r: SEVERITY[r] for r in judged} == {r: "critical" if r in passed else "warning" for r in judged}


def test_the_schedule_sentence_and_table_follow_the_ninth_protocols_files(tmp_path, monkeypatch):
    """Before its analysis the README says how many of the ninth protocol's test runs blew up so far,
    read from its blocks' outcomes; a survivor in a block file changes both the sentence and the
    generated table; once its test result exists the sentence points to it."""
    blocks = stated_numbers._test_9_blocks()
    assert blocks, "the ninth protocol's first test block is recorded"
    result = json.loads(blocks[0].read_text())
    first = next(iter(result["runs"].values()))
    first["outcome"].update(blowup=None, confirmed=False, survivor=True)
    (tmp_path / blocks[0].name).write_text(json.dumps(result))
    n = len(result["runs"])
    monkeypatch.setattr(stated_numbers, "TEST_9_OUTCOMES", tmp_path)
    monkeypatch.setattr(stated_numbers, "TEST_9", tmp_path / "test.json")
    assert f"under test: {n - 1} of {n} blew up, 1 survived." in stated_numbers._schedule_sentence()
    assert f"| 2.5e-3 (test) | {n} | 700-707 | {n - 1} | 0 | 1 |" in stated_numbers.schedule_table()
    assert stated_numbers.differences()
    # a blow-up that was not confirmed counts in neither group, and the sentence says so
    second = list(result["runs"].values())[1]
    second["outcome"].update(confirmed=False)
    (tmp_path / blocks[0].name).write_text(json.dumps(result))
    assert f"under test: {n - 2} of {n} blew up, 1 unconfirmed, 1 survived." in stated_numbers._schedule_sentence()
    assert f"| 2.5e-3 (test) | {n} | 700-707 | {n - 2} | 1 | 1 |" in stated_numbers.schedule_table()


def test_the_schedule_table_has_a_row_for_each_pilot_of_the_eleventh_protocol(tmp_path, monkeypatch):
    """The eleventh protocol's pilots join the cosine table, one row a peak, read from their files."""
    pilot = json.loads(stated_numbers.PILOT_9[2.5e-3].read_text())  # an outcomes file's shape
    (tmp_path / "pilot-outcomes-1.75e-3.json").write_text(json.dumps(pilot))
    monkeypatch.setattr(stated_numbers, "SPLIT_11", tmp_path)
    n, steps, survivors = stated_numbers._blowups((tmp_path / "pilot-outcomes-1.75e-3.json",))
    assert (f"| 1.75e-3 (eleventh protocol's pilot) | {n} | 520-527 | {len(steps)} | 0 | {survivors} |"
            in stated_numbers.schedule_table())
    # its test blocks join once recorded, under the peak its pilots chose
    (tmp_path / "pilot-decision.json").write_text(json.dumps({"decision": "test", "rate": 0.00175}))
    (tmp_path / "test-outcomes-800-807.json").write_text(json.dumps(pilot))
    assert (f"| 1.75e-3 (eleventh protocol's test) | {n} | 520-527 | {len(steps)} | 0 | {survivors} |"
            in stated_numbers.schedule_table())


def test_the_ninth_protocols_result_enters_the_readme_once_it_exists(tmp_path, monkeypatch):
    """Once the ninth protocol's test has run, its counts and verdict replace the outcomes sentence,
    its columns join the README's table, and a rule it passes is named as passed (and must then be
    critical: the severity test reads every alarm result)."""
    result = json.loads(stated_numbers.TEST_4.read_text())  # a test result's shape, with chosen counts
    for row in result["table"].values():
        row.update(blowups=20, survivors=7, lead_ge_1000=10, false_alarms=3, verdict="fail")
    result["table"]["chain"].update(lead_ge_1000=18, false_alarms=1, verdict="pass")
    path = tmp_path / "test.json"
    path.write_text(json.dumps(result))
    monkeypatch.setattr(stated_numbers, "TEST_9", path)
    monkeypatch.setattr(stated_numbers, "TEST_11", tmp_path / "absent.json")  # the ninth's alone
    assert len(stated_numbers.alarm_results()) == 4
    block = stated_numbers.readme_block()
    flat = " ".join(block.split())
    assert "(last columns): peak 2.5e-3, 20 of 27 blew up: passed by `chain`." in flat
    assert "| lr 1.5e-3 | cosine 2.5e-3 | false alarms," in block
    assert "| 18/20 |" in block and "| 1/7 |" in block
    assert "*As an alarm: passed by `chain`*" in flat
    result["table"]["chain"]["verdict"] = "fail"
    result["table"]["chain"]["survivors"] = 4
    path.write_text(json.dumps(result))
    # the verdicts the file records are read, not derived again from the group sizes
    assert stated_numbers._schedule_sentence().endswith("20 of 24 blew up: all 11 rules failed, warning in 1-3 of 4 "
                                                        "survivors.")
    result["table"]["delta_drift"]["verdict"] = "undecided"
    path.write_text(json.dumps(result))
    assert stated_numbers._schedule_sentence().endswith("20 of 24 blew up: no rule passed, 1 of 11 undecided.")
    for row in result["table"].values():
        row["verdict"] = "undecided"
    path.write_text(json.dumps(result))
    assert "no rule passed, 11 of 11 undecided" in stated_numbers._schedule_sentence()


def test_the_eleventh_protocols_result_joins_the_ninths_in_the_readme(tmp_path, monkeypatch):
    """The eleventh protocol's test (the cosine schedule at the peak its pilots chose) adds its columns and
    its clause after the ninth's, its verdicts count in the headline and in the severities, and its
    secondary landmark result joins the ranking point."""
    assert stated_numbers.TEST_11.exists() and len(stated_numbers.alarm_results()) == 5
    result = json.loads(stated_numbers.TEST_11.read_text())
    block = stated_numbers.readme_block()
    assert "| cosine 2.5e-3 | cosine 1.75e-3 | false alarms," in block
    chain = result["table"]["chain"]
    assert block.count(f"| {chain['false_alarms']}/{chain['survivors']} |") >= 1
    result["table"]["chain"].update(verdict="pass", lead_ge_1000=chain["blowups"], false_alarms=0)
    path = tmp_path / "test.json"
    path.write_text(json.dumps(result))
    monkeypatch.setattr(stated_numbers, "TEST_11", path)
    flat = " ".join(stated_numbers.readme_block().split())
    assert "*As an alarm: passed by `chain`*" in flat and flat.rstrip(" |").count("`chain`") >= 2
    assert f"peak 1.75e-3, {chain['blowups']} of {chain['blowups'] + chain['survivors']} blew up: passed by `chain`" in flat
    # the landmark beside it: none yet, then its verdict
    assert "peak 1.75e-3" not in stated_numbers._cosine_landmark_sentence()
    landmark = json.loads((stated_numbers.SPLIT_11 / "landmark.json").read_text())
    (tmp_path / "landmark.json").write_text(json.dumps(landmark))
    assert f"peak 1.75e-3 ({landmark['cases']} blow-ups)" in stated_numbers._cosine_landmark_sentence()


def test_the_headline_says_every_rule_failed_only_where_each_decisive_test_failed_them_all(tmp_path, monkeypatch):
    """'every rule failed' stands only while every test with both groups at 6 or more failed every rule."""
    assert "every rule failed" in stated_numbers.readme_block()
    result = json.loads(stated_numbers.TEST_11.read_text())
    result["table"]["max_logit"]["verdict"] = "undecided"
    path = tmp_path / "test.json"
    path.write_text(json.dumps(result))
    monkeypatch.setattr(stated_numbers, "TEST_11", path)
    assert "every rule failed" not in stated_numbers.readme_block()


def test_the_tenth_protocols_result_replaces_the_acting_point_once_it_exists(tmp_path, monkeypatch):
    """Once the tenth protocol (auto_fix on the cosine schedule) has a result, the README's acting
    point reads its switches, prevented blow-ups, the survivors it switched, their loss and the harm,
    with the sixth's counts beside; before, the sixth's sentence stands (the twelfth's not yet run)."""
    monkeypatch.setattr(stated_numbers, "AUTO_FIX_12", tmp_path / "missing-12.json")
    monkeypatch.setattr(stated_numbers, "AUTO_FIX_10", tmp_path / "missing.json")
    assert stated_numbers._acting_sentence() == stated_numbers._auto_fix_sentence(
        json.loads(stated_numbers.AUTO_FIX.read_text()))
    pairs = [{"first_switch": 1200 + 10 * i} for i in range(15)] + [{"first_switch": None}]
    tenth = {"pairs": pairs, "prevented": 9, "cases": 10, "verdict": "shown", "survivors": 6,
             "switched_survivors": 4, "survivor_loss_ratio_range": [0.991, 1.012], "harmed": [709]}
    path = tmp_path / "auto-fix.json"
    path.write_text(json.dumps(tenth))
    monkeypatch.setattr(stated_numbers, "AUTO_FIX_10", path)
    flat = " ".join(stated_numbers.readme_block().split())
    assert ("(peak 2.5e-3, 16 seeds beside their SDPA twins): `auto_fix=\"fp32_delta\"` switched 15 of 16 (steps "
            "1,200-1,340) and prevented 9 of 10 confirmed blow-ups (shown); the 6 surviving twins' runs (4 switched) "
            "ended at 0.991-1.012x their loss; 1 blew up where the twin did not (constant lr 1.5e-3: 0 of 8, twins "
            "6).") in flat
    assert stated_numbers.differences()
    tenth.update(pairs=[{"first_switch": 1500}] * 16, survivors=1, switched_survivors=1,
                 survivor_loss_ratio_range=[1.004, 1.004], harmed=[])
    path.write_text(json.dumps(tenth))
    flat = " ".join(stated_numbers.readme_block().split())
    assert ("switched all 16 (steps 1,500-1,500) and prevented 9 of 10 confirmed blow-ups (shown); the 1 surviving "
            "twin's run, switched, ended at 1.004x its loss; 0 blew up") in flat


def test_the_twelfth_protocols_result_leads_the_acting_point_with_its_registered_cost_claim(tmp_path, monkeypatch):
    """Once the twelfth protocol has a result, the acting point states its fix runs' blow-ups beside
    their twins' (pooled: a seed does not fix the outcome), the registered "prevented" verdict, and
    its claim on the survivors' loss as registered: made within the bars, not made above either
    bar, undecided below 6 survivors; the harm counts the runs of both cosine protocols whose twin
    survived."""
    flat = " ".join(stated_numbers.readme_block().split())
    assert "0 of 24 blew up, their twins 6 (confirmed; prevented: shown)" in flat and "at most 1% cost: made" in flat
    result = json.loads(stated_numbers.AUTO_FIX_12.read_text())
    assert stated_numbers.cost_verdict(result) == "made"
    path = tmp_path / "auto-fix.json"
    monkeypatch.setattr(stated_numbers, "AUTO_FIX_12", path)
    for change, verdict in (({"survivor_loss_ratio_mean": 1.0101}, "not made"),
                            ({"survivor_loss_ratio_range": [0.99, 1.031]}, "not made"),
                            ({"survivors": 5}, "undecided")):
        changed = {**result, **change}
        assert stated_numbers.cost_verdict(changed) == verdict
        path.write_text(json.dumps(changed))
        assert f"at most 1% cost: {verdict})" in " ".join(stated_numbers.readme_block().split())
        assert stated_numbers.differences()
    path.write_text(json.dumps({**result, "harmed": [804, 810]}))
    assert "2 of the 18 whose twin survived blew up" in " ".join(stated_numbers.readme_block().split())
