"""A protocol's pilot: which learning rate its alarm test runs at, chosen from outcomes only.

    python -m research.early_warning pilot [--protocol 8|9|11] RATE=OUTCOMES.json [RATE=OUTCOMES.json]
    python -m research.early_warning blocks --protocol 11 OUTCOMES.json [OUTCOMES.json ...]

An alarm test needs runs that blow up and runs that survive in one configuration. A pilot trains
eight runs at a first rate and counts, from ``research.early_warning outcomes`` alone (no rule's
firing is read), confirmed blow-ups and survivors; a rule fixed in the protocol's file before any
pilot run picks the rate:

- the first rate is chosen at once if its eight runs are complete and 3-5 of them survived;
- otherwise a second pilot runs at the rate the rule names (the eighth protocol: always its lower
  rate; the ninth and the eleventh: a higher peak when more than half of the first's complete runs
  survived, else a lower one);
- then, of the rates that qualify (at least 2 confirmed blow-ups and 2 survivors), the one whose
  share of survivors among its complete runs is nearest one half; a tie goes to the first rate;
  none qualifying: no test under that protocol.

A survivor ran to the protocol's horizon without a blow-up, with its monitoring complete.

The eleventh protocol's test also runs in blocks of eight until its groups are large enough
(``BlockRule``, ``next_block``): after each block, from the test runs' outcomes alone, it stops
once it has its minimum of runs and both groups (confirmed blow-ups, survivors) reach the alarm
bar's minimum, or at its maximum of runs.
"""

from __future__ import annotations

from dataclasses import dataclass

from research.experiments.scenarios import SPLIT_DECAY_9, SPLIT_LRS_8, SPLIT_PEAKS_9, SPLIT_PEAKS_11

__all__ = ["PilotRule", "RULES", "counts", "choose", "BlockRule", "BLOCK_RULES", "next_block"]

MIN_GROUP = 2  # a rate qualifies with at least this many confirmed blow-ups and survivors
AT_ONCE = (3, 4, 5)  # survivors of 8 complete first-rate runs that choose the first rate at once
PILOT_RUNS = 8


@dataclass(frozen=True)
class PilotRule:
    """One protocol's pilot rule.

    Attributes:
        protocol: the protocol's number (its file: research/preregistration/early-warning-protocol-N.md).
        first: the rate whose pilot runs first.
        lower: the second pilot's rate, unless ``higher`` applies.
        higher: the second pilot's rate when more than half of the first's complete runs survived
            (None: ``lower`` whatever the first showed).
        horizon: the steps a survivor ran without a blow-up.
    """

    protocol: int
    first: float
    lower: float
    higher: float | None
    horizon: int

    @property
    def rates(self) -> tuple[float, ...]:
        return tuple(r for r in (self.first, self.lower, self.higher) if r is not None)

    def second(self, first_counts: dict) -> float:
        """The second pilot's rate after the first's counts: the higher rate when more than half of
        the first's complete runs survived (if the protocol has one), else the lower."""
        done = first_counts["complete"]
        if self.higher is not None and done and first_counts["survivors"] / done > 0.5:
            return self.higher
        return self.lower


RULES = {
    # the eighth: constant rates to 20,000 steps; the second pilot runs at 1e-3 whatever the first showed
    8: PilotRule(protocol=8, first=SPLIT_LRS_8[0], lower=SPLIT_LRS_8[1], higher=None, horizon=20_000),
    # the ninth: peak rates of a cosine decay ending at step SPLIT_DECAY_9, the end of its runs
    9: PilotRule(protocol=9, first=SPLIT_PEAKS_9[0], lower=SPLIT_PEAKS_9[1], higher=SPLIT_PEAKS_9[2],
                 horizon=SPLIT_DECAY_9),
    # the eleventh: lower peaks of the ninth's schedule
    11: PilotRule(protocol=11, first=SPLIT_PEAKS_11[0], lower=SPLIT_PEAKS_11[1], higher=SPLIT_PEAKS_11[2],
                  horizon=SPLIT_DECAY_9),
}


def counts(result: dict, horizon: int) -> dict:
    """From an ``outcomes`` result: complete runs, their confirmed blow-ups and their survivors (no
    blow-up through ``horizon`` steps)."""
    done = [v for v in result["runs"].values() if v["monitoring"]["complete"]]
    blowups = sum(1 for v in done if v["outcome"]["blowup"] is not None and v["outcome"]["confirmed"])
    survivors = sum(1 for v in done if v["outcome"]["survivor"] and v["outcome"]["last_step"] >= horizon - 1)
    return {"complete": len(done), "blowups": blowups, "survivors": survivors,
            "qualifies": blowups >= MIN_GROUP and survivors >= MIN_GROUP}


def choose(rule: PilotRule, pilots: dict[float, dict]) -> dict:
    """The rule on the pilots' ``outcomes`` results by rate: ``{"decision": "test", "rate": r}``,
    ``{"decision": "run the next pilot", "rate": r}`` or ``{"decision": "no test"}``, with each
    rate's counts and why."""
    if rule.first not in pilots:
        raise ValueError(f"the pilot at lr {rule.first:g} runs first; got pilots at {sorted(pilots)}")
    unknown = sorted(set(pilots) - set(rule.rates))
    if unknown:
        raise ValueError(f"no pilot at lr {', '.join(f'{r:g}' for r in unknown)} in protocol {rule.protocol}; "
                         f"its rates: {', '.join(f'{r:g}' for r in rule.rates)}")
    by_rate = {r: counts(pilots[r], rule.horizon) for r in pilots}
    first = by_rate[rule.first]
    if first["qualifies"] and first["complete"] == PILOT_RUNS and first["survivors"] in AT_ONCE:
        return {"decision": "test", "rate": rule.first, "counts": by_rate,
                "why": "the first rate left 3-5 survivors of 8"}
    second = rule.second(first)
    extra = sorted(set(pilots) - {rule.first, second})
    if extra:
        raise ValueError(f"after the first pilot the protocol runs lr {second:g}, not {', '.join(f'{r:g}' for r in extra)}")
    if second not in pilots:
        return {"decision": "run the next pilot", "rate": second, "counts": by_rate}
    qualifying = [r for r in (rule.first, second) if by_rate[r]["qualifies"]]
    if not qualifying:
        return {"decision": "no test", "counts": by_rate, "why": "no rate had 2 confirmed blow-ups and 2 survivors"}
    # nearest share of survivors to one half; a tie goes to the first rate (min keeps the first of equals)
    rate = min(qualifying, key=lambda r: abs(by_rate[r]["survivors"] / by_rate[r]["complete"] - 0.5))
    return {"decision": "test", "rate": rate, "counts": by_rate, "why": "the qualifying rate nearest one half"}


@dataclass(frozen=True)
class BlockRule:
    """A test that runs in blocks until its groups are large enough (outcomes only).

    Attributes:
        protocol: the protocol's number.
        min_runs: finished test runs (blown up or at the horizon) it has at least before it may stop.
        max_runs: finished test runs after which it stops whatever its groups.
        min_group: confirmed blow-ups and survivors each needs to stop early (the alarm bar's).
        horizon: the steps a survivor ran without a blow-up.
    """

    protocol: int
    min_runs: int
    max_runs: int
    min_group: int
    horizon: int


BLOCK_RULES = {11: BlockRule(protocol=11, min_runs=24, max_runs=48, min_group=6, horizon=SPLIT_DECAY_9)}


def next_block(rule: BlockRule, blocks: list[dict]) -> dict:
    """The rule on the test blocks' ``outcomes`` results so far: ``{"decision": "stop"}`` or
    ``{"decision": "run the next block"}``, with the counts over all blocks and why. Runs that
    are not complete (monitoring cut) or neither a confirmed blow-up nor a survivor count toward
    the runs, not toward a group."""
    merged = {"runs": {k: v for b in blocks for k, v in b["runs"].items()}}
    total = counts(merged, rule.horizon)
    total["runs"] = len(merged["runs"])
    if total["runs"] >= rule.max_runs:
        return {"decision": "stop", "counts": total, "why": f"{rule.max_runs} runs, the most the protocol runs"}
    if total["runs"] >= rule.min_runs and min(total["blowups"], total["survivors"]) >= rule.min_group:
        return {"decision": "stop", "counts": total,
                "why": f"at least {rule.min_runs} runs and both groups at {rule.min_group} or more"}
    return {"decision": "run the next block", "counts": total,
            "why": f"fewer than {rule.min_runs} runs or a group below {rule.min_group}"}
