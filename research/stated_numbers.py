"""The early-warning numbers the README and docs/EXPERIMENTS.md state, made from the result files.

    python -m research.stated_numbers          # check: exit 1 and say what differs
    python -m research.stated_numbers --write  # rewrite the stated blocks from the result files

Each block is generated from a file in results/ (``research.early_warning``'s test result) and
held equal to it by tests/test_stated_numbers.py, so no number about the early warning is typed
by hand.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import textwrap
from pathlib import Path

from research.early_warning import MIN_DETECTED, MIN_GROUP, MIN_LEAD, RULES, landmark_claims

ROOT = Path(__file__).resolve().parents[1]
TEST_1 = ROOT / "results/seed-split-2026-12-01/test.json"
TEST_1_TABLE = ROOT / "results/seed-split-2026-12-01/test.md"
TEST_2 = ROOT / "results/seed-split-2/test.json"
TEST_2_TABLE = ROOT / "results/seed-split-2/test.md"
TEST_4 = ROOT / "results/seed-split-4/test.json"  # the fourth protocol's test (lr 1.5e-3, complete monitoring)
TEST_2_SEEDS = 24  # the second protocol's test seeds (300-323)
AUTO_FIX = ROOT / "results/seed-split-6/auto-fix.json"  # the sixth protocol's result (research.auto_fix_effect)
AUTO_FIX_10 = ROOT / "results/seed-split-10/auto-fix.json"  # the tenth's (cosine schedule), once it has run
AUTO_FIX_12 = ROOT / "results/seed-split-12/auto-fix.json"  # the twelfth's (cosine, peak 1.75e-3), once it has run
# the twelfth protocol's claim on what auto_fix costs the runs that would have survived, as its file registers
# it (research/preregistration/early-warning-protocol-12.md, "Claim 2"): enough survivors, their mean final-loss
# ratio (fix over twin) and their largest
COST_MIN_SURVIVORS, COST_MAX_MEAN, COST_MAX_ANY = 6, 1.01, 1.03
LANDMARK = ROOT / "results/seed-split-5/landmark.json"  # the fifth protocol's test (research.early_warning landmark)
LANDMARK_TABLE = ROOT / "results/seed-split-5/landmark.md"
README_ANCHOR = "**What the early warning predicts:"  # where the paragraph starts, whatever its verdict
TEST_4_TABLE = ROOT / "results/seed-split-4/test.md"
PILOT_8 = {1.25e-3: ROOT / "results/seed-split-8/pilot-outcomes-1.25e-3.json",  # the eighth protocol's pilots
           1e-3: ROOT / "results/seed-split-8/pilot-outcomes-1e-3.json"}
PILOT_9 = {2.5e-3: ROOT / "results/seed-split-9/pilot-outcomes-2.5e-3.json",  # the ninth protocol's pilots
           2e-3: ROOT / "results/seed-split-9/pilot-outcomes-2e-3.json"}
PILOT_9_DECISION = ROOT / "results/seed-split-9/pilot-decision.json"  # research.pilot's choice of the test's peak
TEST_9 = ROOT / "results/seed-split-9/test.json"  # the ninth protocol's test, once its analysis has run
TEST_9_OUTCOMES = ROOT / "results/seed-split-9"  # its blocks' outcomes before it: test-outcomes-*.json
SPLIT_11 = ROOT / "results/seed-split-11"  # the eleventh protocol's pilots (pilot-outcomes-<peak>.json) and test
TEST_11 = SPLIT_11 / "test.json"  # the eleventh protocol's test (cosine, a lower peak), once its analysis has run
# every outcome at a constant rate, by rate: (the files holding the runs, the steps they ran to)
RATE_OUTCOMES = {
    2e-3: ((TEST_1,), 10_000), 1.75e-3: ((TEST_2,), 10_000),
    1.5e-3: ((TEST_4, ROOT / "results/seed-split-5/outcomes-432-439.json",
              ROOT / "results/seed-split-5/outcomes-440-447.json"), 20_000),
    1.25e-3: ((PILOT_8[1.25e-3],), 20_000), 1e-3: ((PILOT_8[1e-3],), 20_000)}
TABLE_END = "<!-- end test.md -->"


def _early(row: dict) -> int:
    return row[f"lead_ge_{MIN_LEAD}"]


def _monitoring_sentence(*results: dict) -> str:
    """How much of the tests' runs the Monitor measured (runs resumed from a checkpoint lost their
    monitoring until the resume defect was fixed), from each run's ``monitoring`` field."""
    runs = [v for r in results for v in r["runs"].values()]
    cut = sorted(v["monitoring"]["measured_through"] for v in runs if not v["monitoring"]["complete"])
    if not cut:
        return "every run measured at every monitored step"
    return f"{len(cut)} of these {len(runs)} measured only to steps {cut[0]:,}-{cut[-1]:,}: lower bounds"


def _alarm_sentence(r1: dict, r2: dict, t4: dict, passed: list[str]) -> str:
    """The alarm tests at constant rates (the first, second and fourth protocols' results) and why
    they could not settle it (the eighth protocol's pilots)."""
    t1, t2, t3 = r1["table"], r2["table"], t4["table"]
    b1, s1 = t1["chain"]["blowups"], t1["chain"]["survivors"]
    b2, s2 = t2["chain"]["blowups"], t2["chain"]["survivors"]
    b3, s3 = t3["chain"]["blowups"], t3["chain"]["survivors"]
    so_far = "" if b2 + s2 >= TEST_2_SEEDS else f" so far (of {TEST_2_SEEDS})"
    verdicts = {t3[r]["verdict"] for r in RULES}
    third = ("undecided" if verdicts <= {"undecided", "fail"} and s3 < MIN_GROUP else "see `docs/EXPERIMENTS.md` §12")
    head = (f"*As an alarm: passed by {', '.join(f'`{r}`' for r in passed)}* ({len(RULES)} rules judged). " if passed
            else "*As an alarm: not passed.* ")
    return (head + f"Its bar: warned {MIN_LEAD:,}+ steps before {MIN_DETECTED:.0%} of the blow-ups, false "
            f"alarms in at most 1 of 7 survivors. Constant lr (table): 2e-3, {b1} of {b1 + s1} blew up "
            f"by step 10,000; 1.75e-3, {b2} of {b2 + s2}{so_far} ({_monitoring_sentence(r1, r2)}); 1.5e-3, "
            f"{b3} of {b3 + s3} by step 20,000, {third}; {_pilot_sentence()}. {_schedule_sentence()}")


def _landmark_claims(result: dict) -> tuple[bool, bool]:
    """The fifth protocol's two claims about its primary rule, made or not: (separates, beats the
    max logit), from ``research.early_warning.landmark_claims``."""
    first, second = landmark_claims(result)
    return first == "separates", second == "made"


def _pct(x: float) -> str:
    return f"{100 * x:.0f}%"


def _landmark_sentence(result: dict) -> str:
    """The fifth protocol's test (threshold-free: which runs are nearer their blow-up), from its result."""
    row, base = result["table"][result["primary"]], result["table"][result["baseline"]]
    separates, beats = _landmark_claims(result)
    gap = result["lead"] + result["margin"]
    verdict = {(True, True): "shown", (True, False): "shown, but not better than the max logit"}.get(
        (separates, beats), "not shown")
    return (f"*As a ranking: {verdict}* ({result['evaluated']}, lr 1.5e-3, {result['runs']} new runs): "
            f"{result['lead']:,} steps before each of {result['cases']} blow-ups, `chain`'s score was above that of runs "
            f"still {gap:,} steps from theirs in {_pct(row['auc'])} of {result['pairs']} pairs (95% interval "
            f"{_pct(row['low'])}-{_pct(row['high'])}), the max logit's in {_pct(base['auc'])} ({_pct(base['low'])}-"
            f"{_pct(base['high'])}): `chain` {'does' if beats else 'is not shown to do'} better (difference "
            f"{row['minus_baseline']:+.2f}, {row['minus_baseline_low']:+.2f} to {row['minus_baseline_high']:+.2f})."
            + _cosine_landmark_sentence())


def _cosine_landmark_sentence() -> str:
    """The same ranking on the cosine schedule's tests, their registered secondary analysis (``landmark.json``
    beside each test result), with its verdict: empty before any has run."""
    clauses = []
    for peak, test in _cosine_tests():
        path = test.with_name("landmark.json")
        if not path.exists():
            continue
        result = json.loads(path.read_text())
        row, base = result["table"][result["primary"]], result["table"][result["baseline"]]
        first, second = landmark_claims(result)
        clauses.append(f"peak {_rate(peak)} ({result['cases']} blow-ups) {_pct(row['auc'])} against "
                       f"{_pct(base['auc'])}")
    # registered as secondary analyses, reported whatever they show: no claim, so no verdict
    return (f" On the cosine schedule (secondary analyses, registered without a claim): {'; '.join(clauses)}."
            if clauses else "")


def _auto_fix_sentence(result: dict) -> str:
    """What auto_fix did on the seeds of the sixth protocol, from ``research.auto_fix_effect``'s result."""
    pairs = result["pairs"]
    first = [p["first_switch"] for p in pairs if p["first_switch"] is not None]
    layers = sorted({p["switches"][0]["layer"] for p in pairs if p["switches"]})
    healthy = sum(1 for p in pairs if p["fix"]["survivor"])
    ratios = [p["loss_ratio"] for p in pairs if p["loss_ratio"] is not None]
    where = f"layer {layers[0]}" if len(layers) == 1 else f"layers {', '.join(map(str, layers))}"
    return (f"*Acting on them* ({len(pairs)} of the lr 1.5e-3 seeds): "
            f"`auto_fix=\"fp32_delta\"` switched {where} in {len(first)} of {len(pairs)} runs (steps "
            f"{min(first):,}-{max(first):,}); {len(pairs) - healthy} of {len(pairs)} blew up in "
            f"{result['definitions']['min_steps']:,} steps, their SDPA twins {result['cases']} (confirmed); loss "
            f"{min(ratios):.3f}-{max(ratios):.3f}x theirs.")


def cost_verdict(result: dict) -> str:
    """The twelfth protocol's claim 2 ("auto_fix costs a run that would have survived at most 1% of its
    final loss") read from an ``auto_fix_effect`` result as registered: "made", "not made" or
    "undecided" (fewer than ``COST_MIN_SURVIVORS`` survivors)."""
    if result["survivors"] < COST_MIN_SURVIVORS:
        return "undecided"
    low, high = result["survivor_loss_ratio_range"]
    return "made" if result["survivor_loss_ratio_mean"] <= COST_MAX_MEAN and high <= COST_MAX_ANY else "not made"


def _tenth_clause(tenth: dict) -> tuple[str, str]:
    """The tenth protocol's switches and prevented blow-ups, and what its surviving twins' runs paid."""
    pairs = tenth["pairs"]
    first = [p["first_switch"] for p in pairs if p["first_switch"] is not None]
    rng = tenth["survivor_loss_ratio_range"]
    if not rng:
        loss = ""
    elif tenth["survivors"] == 1:
        how = "switched" if tenth["switched_survivors"] else "never switched"
        loss = f"; the 1 surviving twin's run, {how}, ended at {rng[0]:.3f}x its loss"
    else:
        loss = (f"; the {tenth['survivors']} surviving twins' runs ({tenth['switched_survivors']} switched) ended "
                f"at {rng[0]:.3f}-{rng[1]:.3f}x their loss")
    switched = f"all {len(pairs)}" if len(first) == len(pairs) else f"{len(first)} of {len(pairs)}"
    return (f"switched {switched} (steps {min(first):,}-{max(first):,}) and prevented {tenth['prevented']} of "
            f"{tenth['cases']} confirmed blow-ups ({tenth['verdict']})"), loss


def _switched_of(result: dict) -> str:
    """How many of the runs whose twin survived were switched, where not all of them were."""
    n = result["switched_survivors"]
    return "" if n == result["survivors"] else f" ({n} switched)"


def _acting_sentence() -> str:
    """The README's point on acting on the warnings: the sixth protocol's auto_fix result; once the
    tenth has run, its result on the cosine schedule (prevented blow-ups and what the survivors it
    switched paid) with the sixth's counts beside it; once the twelfth has run too, its result at the
    lower peak first (prevented blow-ups and its registered claim on the survivors' cost), then the
    tenth's, then the sixth's."""
    sixth = json.loads(AUTO_FIX.read_text())
    if not AUTO_FIX_10.exists():
        return _auto_fix_sentence(sixth)
    tenth = json.loads(AUTO_FIX_10.read_text())
    fix_blew = sum(1 for p in sixth["pairs"] if not p["fix"]["survivor"])
    sixth_clause = f"(constant lr 1.5e-3: {fix_blew} of {len(sixth['pairs'])}, twins {sixth['cases']})"
    if not AUTO_FIX_12.exists():
        did, loss = _tenth_clause(tenth)
        return (f"*Acting on them* (peak {_rate(_peak_9())}, {len(tenth['pairs'])} seeds beside their SDPA twins): "
                f"`auto_fix=\"fp32_delta\"` {did}{loss}; {len(tenth['harmed'])} blew up where the twin did not "
                f"{sixth_clause}.")
    twelfth = json.loads(AUTO_FIX_12.read_text())
    first = [p["first_switch"] for p in twelfth["pairs"] if p["first_switch"] is not None]
    runs = len(twelfth["pairs"])
    switched = f"all {runs} runs" if len(first) == runs else f"{len(first)} of {runs} runs"
    low, high = twelfth["survivor_loss_ratio_range"] or (float("nan"), float("nan"))
    harmed = len(twelfth["harmed"]) + len(tenth["harmed"])
    twin_survived = sum(1 for p in twelfth["pairs"] + tenth["pairs"] if p["twin"]["survivor"])
    blew = [sum(1 for p in r["pairs"] if not p["fix"]["survivor"]) for r in (twelfth, tenth)]
    # pooled: a seed does not fix the outcome (its reruns differ), so each protocol's fix runs are read
    # against its twins as groups; "prevented" is the registered claim's word for the confirmed cases
    return (f"*Acting on them* (cosine schedule, seeds beside their SDPA twins): `auto_fix=\"fp32_delta\"` at peak "
            f"{_rate(_peak_11())} switched {switched} (steps {min(first):,}-{max(first):,}); {blew[0]} of {runs} blew "
            f"up, their twins {twelfth['cases']} (confirmed; prevented: {twelfth['verdict']}), and the "
            f"{twelfth['survivors']} that would have survived{_switched_of(twelfth)} ended at "
            f"{twelfth['survivor_loss_ratio_mean']:.3f}x their twins' loss ({low:.3f}-{high:.3f}; at most 1% cost: "
            f"{cost_verdict(twelfth)}); at peak {_rate(_peak_9())}, {blew[1]} of {len(tenth['pairs'])}, twins "
            f"{tenth['cases']} ({tenth['verdict']}). {harmed} of the {twin_survived} whose twin survived blew up "
            f"{sixth_clause}.")


# the rules the README's table shows: the chain candidate, the Monitor's own alerts, the baselines
# (every rule's row: docs/EXPERIMENTS.md sections 9-10)
README_RULES = ("chain", "repeated_max_bf16_trend", "repeated_max_rise", "max_logit", "delta_drift", "qk_clip_100",
                "zclip_2.5")
README_NAMES = {"chain": "`chain`",
                "qk_clip_100": "QK-Clip, max logit > 100 (baseline)", "zclip_2.5": "ZClip, gradient-norm z > 2.5 (baseline)"}


def readme_block() -> str:
    """The README's early-warning paragraph, its three points (ranking, alarm, acting) and the table
    (the registered tests); every number read from their result files, wrapped at 118 columns as
    the README's prose."""
    r1, r2 = json.loads(TEST_1.read_text()), json.loads(TEST_2.read_text())
    t1, t2 = r1["table"], r2["table"]
    b1, b2 = t1["chain"]["blowups"], t2["chain"]["blowups"]
    s2 = t2["chain"]["survivors"]
    t4 = json.loads(TEST_4.read_text())
    tables = [res["table"] for res in alarm_results()]
    passed = [r for r in RULES if any(t[r]["verdict"] == "pass" for t in tables)]
    # the tests where both groups were large enough for a verdict either way, and those every rule failed
    decisive = [t for t in tables if min(t["chain"]["blowups"], t["chain"]["survivors"]) >= MIN_GROUP]
    all_failed = [t for t in decisive if all(t[r]["verdict"] == "fail" for r in RULES)]
    failed = (f" (in the {len(decisive)} tests with {MIN_GROUP} or more blow-ups and survivors, every rule failed)"
              if decisive and len(all_failed) == len(decisive) else "")
    verdict = (f"Passed: {', '.join(f'`{r}`' for r in passed)} (now critical)." if passed else
               f"No rule passed as an alarm{failed}: every alert is a warning that the rounding mechanism is at work, "
               "not that the run will blow up.")
    landmark = json.loads(LANDMARK.read_text())
    ranks = _landmark_claims(landmark)[0]
    head = (f"**What the early warning predicts: {'a ranking is shown' if ranks else 'not proven'}"
            f"{', an alarm is not' if ranks and not passed else ''}.** ")
    intro = (head + f"{verdict} Pre-registered tests (one H200, `docs/EXPERIMENTS.md` §9-16) on runs differing by "
             "seed alone (GPT 6x384, BF16 SDPA; thresholds from 8 other seeds; `chain`: `delta_drift` with "
             "W^Q-error coherence):")
    items = [_landmark_sentence(landmark), _alarm_sentence(r1, r2, t4, passed),
             _acting_sentence()]
    t3 = t4["table"]
    b3, s3 = t3["chain"]["blowups"], t3["chain"]["survivors"]
    cosine = _cosine_results()  # the cosine schedule's tests, once analysed: their columns last
    heads = "".join(f" | cosine {_rate(peak)}" for peak, _ in cosine)
    rows = [f"| rule or score | warned >= {MIN_LEAD:,} steps ahead, lr 2e-3 | lr 1.75e-3 | lr 1.5e-3{heads} | false alarms, "
            f"lr 1.75e-3 | lr 1.5e-3{heads} |", "|---|---|---|---|---|---|" + "---|---|" * len(cosine)]
    for r in README_RULES:
        early = "".join(f" {_early(res['table'][r])}/{res['table'][r]['blowups']} |" for _, res in cosine)
        false = "".join(f" {res['table'][r]['false_alarms']}/{res['table'][r]['survivors']} |" for _, res in cosine)
        rows.append(f"| {README_NAMES.get(r, f'`{r}`')} | {_early(t1[r])}/{b1} | {_early(t2[r])}/{b2} | "
                    f"{_early(t3[r])}/{b3} |{early} {t2[r]['false_alarms']}/{s2} | {t3[r]['false_alarms']}/{s3} |{false}")
    wrap = dict(width=118, break_on_hyphens=False, break_long_words=False)
    block = [textwrap.fill(intro, **wrap)] + [textwrap.fill(item, initial_indent="- ", subsequent_indent="  ", **wrap)
                                              for item in items]
    return "\n".join(block) + "\n\n" + "\n".join(rows)


def _rate(lr: float) -> str:
    """A learning rate as the docs write it: 1.75e-3."""
    return f"{lr * 1e3:g}e-3"


def _blowups(files: tuple[Path, ...]) -> tuple[int, list[int], int]:
    """Runs counted, their confirmed blow-up steps and survivors, from ``research.early_warning``
    results (a test's or an ``outcomes``'); runs a test left out are not counted."""
    runs = [v for f in files for v in json.loads(f.read_text())["runs"].values()]
    steps = sorted(v["outcome"]["blowup"] for v in runs if v["outcome"]["blowup"] is not None and v["outcome"]["confirmed"])
    return len(runs), steps, sum(1 for v in runs if v["outcome"]["survivor"])


def rate_table() -> str:
    """Outcomes at each constant learning rate of the seed-split configuration: how many runs blew
    up, when, and the product of rate and median blow-up step (docs/EXPERIMENTS.md section 14)."""
    rows = ["| constant lr after warm-up | runs to | runs | confirmed blow-ups | survivors | blow-up steps | median "
            "| lr x median (1e-3 x 1,000 steps) |", "|---|---|---|---|---|---|---|---|"]
    for lr, (files, horizon) in RATE_OUTCOMES.items():
        n, steps, survivors = _blowups(files)
        median = statistics.median(steps)
        rows.append(f"| {_rate(lr)} | {horizon:,} steps | {n} | {len(steps)} | {survivors} | {steps[0]:,}-{steps[-1]:,} | "
                    f"{median:,.0f} | {lr * median:.1f} |")
    return "\n".join(rows)


def _pilot_sentence() -> str:
    """The eighth protocol's pilots at lower constant rates, from their ``outcomes`` results."""
    counted = [_blowups((path,)) for path in PILOT_8.values()]
    n, survivors = sum(c[0] for c in counted), sum(c[2] for c in counted)
    steps = sorted(s for c in counted for s in c[1])
    rates = " and ".join(_rate(lr) for lr in PILOT_8)
    if survivors:
        return f"{rates}, {len(steps)} of {n} by step 20,000, {survivors} survived"
    return f"{rates}, all {n} by step 20,000 ({steps[0]:,}-{steps[-1]:,})"


def _peak_9() -> float:
    """The peak the ninth protocol's pilot chose for its test (``pilot-decision.json``)."""
    return json.loads(PILOT_9_DECISION.read_text())["rate"]


def _test_9_blocks() -> list[Path]:
    """The ninth protocol's test blocks run so far (their ``outcomes`` results), in seed order."""
    return sorted(TEST_9_OUTCOMES.glob("test-outcomes-*.json"))


def alarm_results() -> list[dict]:
    """The registered alarm tests' results (``research.early_warning test``): the first, second and
    fourth protocols' at constant rates, and the ninth's and eleventh's on a cosine schedule once run."""
    return [json.loads(path.read_text()) for path in (TEST_1, TEST_2, TEST_4, TEST_9, TEST_11) if path.exists()]


def _peak_11() -> float:
    """The peak the eleventh protocol's pilots chose for its test (``pilot-decision.json``)."""
    return json.loads((SPLIT_11 / "pilot-decision.json").read_text())["rate"]


def _cosine_tests() -> list[tuple[float, Path]]:
    """(peak, test result file) of the tests on the cosine schedule, the ninth protocol's and the eleventh's."""
    return [(_peak_9(), TEST_9), (_peak_11(), TEST_11)]


def _cosine_results() -> list[tuple[float, dict]]:
    """(peak, result) of each analysed test on the cosine schedule."""
    return [(peak, json.loads(path.read_text())) for peak, path in _cosine_tests() if path.exists()]


def _cosine_clause(peak: float, table: dict) -> str:
    """One cosine test's counts and the verdicts it recorded (``research.early_warning``), not derived
    again here."""
    b, s = table["chain"]["blowups"], table["chain"]["survivors"]
    verdicts = [table[r]["verdict"] for r in RULES]
    passed = [r for r, v in zip(RULES, verdicts) if v == "pass"]
    undecided = verdicts.count("undecided")
    if passed:
        verdict = f"passed by {', '.join(f'`{r}`' for r in passed)}"
    elif verdicts.count("fail") == len(RULES):
        false = sorted(table[r]["false_alarms"] for r in RULES)
        verdict = f"all {len(RULES)} rules failed, warning in {false[0]}-{false[-1]} of {s} survivors"
    elif undecided:
        verdict = f"no rule passed, {undecided} of {len(RULES)} undecided"
    else:
        verdict = "no rule passed"
    return f"peak {_rate(peak)}, {b} of {b + s} blew up: {verdict}"


def _schedule_sentence() -> str:
    """Where the tests on a cosine schedule that ends at step 10,000 stand: the ninth protocol's outcomes
    so far, or, once analysed, its counts and verdict and the eleventh's beside them."""
    if TEST_9.exists():
        clauses = [_cosine_clause(peak, result["table"]) for peak, result in _cosine_results()]
        return "Cosine to step 10,000 (last columns): " + "; ".join(clauses) + "."
    n, steps, survivors = _blowups(tuple(_test_9_blocks()))
    unconfirmed = n - len(steps) - survivors
    so_far = (f": {len(steps)} of {n} blew up" + (f", {unconfirmed} unconfirmed" if unconfirmed else "")
              + (f", {survivors} survived" if survivors else "") if n else "")
    return f"A cosine schedule ending at step 10,000 is under test{so_far}."


def schedule_table() -> str:
    """Outcomes of the runs on a cosine schedule, by peak rate (docs/EXPERIMENTS.md section 14): the
    ninth protocol's pilots and, before its analysis, its test blocks; the eleventh protocol's pilots and
    test blocks."""
    rows = ["| cosine peak (to a tenth at step 10,000) | runs | seeds | confirmed blow-ups | not confirmed | survivors "
            "| blow-up steps |", "|---|---|---|---|---|---|---|"]
    groups = [(f"{_rate(lr)} (pilot)", (path,)) for lr, path in PILOT_9.items()]
    groups += [(f"{_rate(_peak_9())} (test)", (path,)) for path in _test_9_blocks()]
    groups += [(f"{path.stem.removeprefix('pilot-outcomes-')} (eleventh protocol's pilot)", (path,))
               for path in sorted(SPLIT_11.glob("pilot-outcomes-*.json"))]
    tests_11 = sorted(SPLIT_11.glob("test-outcomes-*.json"))
    if tests_11:  # its test blocks, at the peak its pilots chose (pilot-decision.json)
        peak = _rate(_peak_11())
        groups += [(f"{peak} (eleventh protocol's test)", (path,)) for path in tests_11]
    for name, files in groups:
        by_run = {k: v for f in files for k, v in json.loads(f.read_text())["runs"].items()}
        runs = list(by_run.values())
        seeds = sorted(int(k.rsplit("/", 1)[-1].removeprefix("seed")) for k in by_run)
        n, steps, survivors = _blowups(files)
        unconfirmed = sum(1 for v in runs if v["outcome"]["blowup"] is not None and not v["outcome"]["confirmed"])
        span = f"{steps[0]:,}-{steps[-1]:,}" if steps else "-"
        rows.append(f"| {name} | {n} | {seeds[0]}-{seeds[-1]} | {len(steps)} | {unconfirmed} | {survivors} | {span} |")
    return "\n".join(rows)


def _first_table(path: Path) -> str:
    """The first markdown table of a result's ``.md`` (the rules' rows, without the per-run table after);
    empty while the result does not exist."""
    if not path.exists():
        return ""
    lines = path.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    return "\n".join(lines[start:end])


def post_hoc_table(path: Path, most: int = 2) -> str:
    """Computed after, from a test result's ``post_hoc_threshold_table``: each rule and baseline at the
    thresholds that give 0, 1, ... ``most`` false alarms on the test's survivors, and how many of the
    confirmed blow-ups its score had exceeded by the blow-up (any lead: the peak before it). Empty while
    the result does not exist."""
    if not path.exists():
        return ""
    result = json.loads(path.read_text())
    table = result["post_hoc_threshold_table"]
    blowups = result["table"]["chain"]["blowups"]
    ks = range(min(most, result["table"]["chain"]["survivors"]) + 1)
    rows = ["| rule | " + " | ".join(f"{k} false alarm{'s' if k != 1 else ''}: threshold, detected" for k in ks) + " |",
            "|---|" + "---|" * len(ks)]
    for name, steps in table.items():
        cells = []
        for k in ks:
            row = steps[k]
            cells.append(f"> {row['threshold_above']:.4g}, {row['detected']}/{blowups}")
        rows.append(f"| `{name}` | " + " | ".join(cells) + " |")
    return "\n".join(rows)


# the generated blocks of docs/EXPERIMENTS.md: section -> (the marker line before the block, its text)
TABLES = {"9": ("<!-- test.md: generated", TEST_1_TABLE.read_text),
          "10": ("<!-- test-2.md: generated", TEST_2_TABLE.read_text),
          "12": ("<!-- test-4.md: generated", TEST_4_TABLE.read_text),
          "14": ("<!-- landmark.md: generated", LANDMARK_TABLE.read_text),
          "14 (1e-3 pilot)": ("<!-- pilot-outcomes-1e-3.md: generated", PILOT_8[1e-3].with_suffix(".md").read_text),
          "14 (rates)": ("<!-- rates: generated", rate_table),
          "14 (cosine)": ("<!-- cosine: generated", schedule_table),
          "15 (ninth)": ("<!-- test-9.md: generated", lambda: _first_table(TEST_9.with_suffix(".md"))),
          "15 (eleventh)": ("<!-- test-11.md: generated", lambda: _first_table(TEST_11.with_suffix(".md"))),
          "15 (ninth landmark)": ("<!-- landmark-9.md: generated",
                                  lambda: _first_table(TEST_9.with_name("landmark.md"))),
          "15 (eleventh landmark)": ("<!-- landmark-11.md: generated",
                                     lambda: _first_table(TEST_11.with_name("landmark.md"))),
          "15 (eleventh, computed after)": ("<!-- post-hoc-11: generated", lambda: post_hoc_table(TEST_11)),
          "16 (tenth)": ("<!-- auto-fix-10.md: generated", lambda: _first_table(AUTO_FIX_10.with_suffix(".md"))),
          "16 (twelfth)": ("<!-- auto-fix-12.md: generated", lambda: _first_table(AUTO_FIX_12.with_suffix(".md")))}


def _readme_span(readme: str) -> tuple[int, int]:
    """From the paragraph's first words to the end of the table after it."""
    start = readme.index(README_ANCHOR)
    table = readme.index("\n\n", start) + 2
    return start, readme.index("\n\n", table)


def _table_span(doc: str, marker: str) -> tuple[int, int]:
    start = doc.index("\n", doc.index(marker)) + 1
    return start, doc.index(TABLE_END, start)


def differences() -> list[str]:
    """What the files state that the result files do not say (empty: all equal)."""
    out = []
    readme = (ROOT / "README.md").read_text()
    a, b = _readme_span(readme)
    if readme[a:b] != readme_block():
        out.append("README.md: the early-warning paragraph differs from research.stated_numbers.readme_block()")
    doc = (ROOT / "docs/EXPERIMENTS.md").read_text()
    for section, (marker, text) in TABLES.items():
        a, b = _table_span(doc, marker)
        if doc[a:b].strip() != text().strip():
            out.append(f"docs/EXPERIMENTS.md: the generated table of section {section} differs from its source")
    return out


def write() -> None:
    readme_path = ROOT / "README.md"
    readme = readme_path.read_text()
    a, b = _readme_span(readme)
    readme_path.write_text(readme[:a] + readme_block() + readme[b:])
    doc_path = ROOT / "docs/EXPERIMENTS.md"
    for marker, text in TABLES.values():
        doc = doc_path.read_text()
        a, b = _table_span(doc, marker)
        doc_path.write_text(doc[:a] + text().strip() + "\n" + doc[b:])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m research.stated_numbers", description=__doc__.split("\n\n")[0])
    p.add_argument("--write", action="store_true", help="rewrite the stated blocks from the result files")
    args = p.parse_args(argv)
    if args.write:
        write()
    diff = differences()
    for line in diff:
        print(line)
    return 1 if diff else 0


if __name__ == "__main__":
    sys.exit(main())
