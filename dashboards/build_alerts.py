"""Build the Prometheus alert rules and the alert runbook from flashwatch's rule table.

    python dashboards/build_alerts.py           # rewrite alerts.yml and docs/ALERTS.md
    python dashboards/build_alerts.py --check   # exit 1 if a committed file is stale

(``python dashboards/build_dashboard.py`` rebuilds these and the Grafana dashboard at once.)

Every alert comes from ``flashwatch.vocabulary``: one Prometheus rule per Monitor rule
(``RULE_SPECS``), firing on the Monitor's exported decision
``flashwatch_alert_active{rule="..."} == 1``, so Prometheus and the Monitor agree by
construction: thresholds, warm-up and hysteresis are decided once, in the Monitor, and there is
no PromQL copy of them to drift apart. Plus ``FlashwatchStoppedReporting``, the one thing only
Prometheus can see: a run whose endpoint still answers but whose last monitored step
(``flashwatch_last_step_timestamp_seconds``) is long past.

Annotations follow the monitoring-mixins convention: ``summary`` one line from the table,
``description`` templated with the series' labels and the rule's signal now (read with a
``query`` in the template), ``runbook_url`` the rule's section of docs/ALERTS.md
(``--runbook-base URL`` prints a copy whose links point at URL#<rule>, for a deployment).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import fields
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if str(ROOT) not in sys.path:  # run from a clone without installing; last, so that the clone's kernels/
    sys.path.append(str(ROOT))  # folder never shadows an installed `kernels` package (Hugging Face's)

from flashwatch.config import MonitorConfig  # noqa: E402
from flashwatch.metrics import BY_NAME  # noqa: E402
from flashwatch.vocabulary import ALERT_SPECS, RULE_SPECS, RUNBOOK, STOPPED_REPORTING, RuleSpec, markdown_table  # noqa: E402

ALERTS = HERE / "alerts.yml"
RUNBOOK_DOC = ROOT / RUNBOOK

# Monitor rules fire as soon as Prometheus sees the decision: the Monitor already waited out
# warm-up and holds an alert with hysteresis, so a `for:` would only delay it.
DECISION_FOR = "0m"
# A run stopped reporting: its last monitored step (flashwatch_last_step_timestamp_seconds, the
# trainer's clock) is more than STALL_MIN minutes before Prometheus's now. A slow run monitors a
# step every few minutes (one every `interval` optimizer steps: at the default 10 and 30 s a step,
# every 5 minutes); evaluation, checkpoint writes and compilation pause it for minutes more. 20
# minutes is past those, and still early for a hung job that would otherwise hold its GPUs for
# hours. The age is exact at every evaluation, so the rule needs no `for:` to smooth it.
STALL_MIN = 20
STALL_FOR = "0m"


def _expr(spec: RuleSpec) -> str:
    if spec is STOPPED_REPORTING:
        # the value is the age in seconds; `up == 1`: only while Prometheus still reaches the endpoint
        return (f"time() - flashwatch_last_step_timestamp_seconds > {STALL_MIN * 60} "
                "and on(job, instance) up == 1")
    return f'flashwatch_alert_active{{rule="{spec.name}"}} == 1'


def _for(spec: RuleSpec) -> str:
    return STALL_FOR if spec is STOPPED_REPORTING else DECISION_FOR


_RUN = "{{ $labels.job }}/{{ $labels.instance }}"
_HEAD = "layer {{ $labels.layer }} head {{ $labels.head }}"


def _now(spec: RuleSpec) -> str:
    """Template text ``; <signal> is <value> now``, the signal read back with a query (empty if none)."""
    if spec.signal is None:
        return ""
    labels = {"head": ["layer", "head"], "layer": ["layer"]}.get(spec.scope, [])
    matchers = ["job=%q", "instance=%q"] + [f"{label}=%q" for label in labels]
    args = "$labels.job $labels.instance" + "".join(f" $labels.{label}" for label in labels)
    fmt = "humanizePercentage" if BY_NAME[spec.signal].unit == "percentunit" else 'printf "%.4g"'
    selector = f"{spec.signal}{{{', '.join(matchers)}}}"
    return (f"{{{{ with printf `{selector}` {args} | query }}}}"
            f"; {spec.signal} is {{{{ . | first | value | {fmt} }}}} now{{{{ end }}}}")


def _description(spec: RuleSpec) -> str:
    if spec is STOPPED_REPORTING:
        last_step = ("{{ with printf `flashwatch_step{job=%q, instance=%q}` $labels.job $labels.instance "
                     "| query }} (the last was step {{ . | first | value | printf \"%.0f\" }}){{ end }}")
        return (f"{_RUN}: no new monitored step for {{{{ $value | humanizeDuration }}}}{last_step}, "
                "while its endpoint still answers.")
    where = {"head": f"{_RUN} {_HEAD}",
             "layer": f"{_RUN} layer {{{{ $labels.layer }}}}",
             "run": _RUN,
             "head or run": f'{_RUN} {{{{ if eq $labels.layer "-1" }}}}(loss or gradient norm)'
                            f"{{{{ else }}}}{_HEAD}{{{{ end }}}}"}[spec.scope]
    return f"{where}: the Monitor's {spec.name} alert holds{_now(spec)}."


def alert_rules(runbook_base: str = RUNBOOK) -> list[dict]:
    """One Prometheus alerting rule per entry of ``ALERT_SPECS``, in that order."""
    return [{"alert": spec.alert, "expr": _expr(spec), "for": _for(spec),
             "labels": {"rule": spec.name, "severity": spec.severity},
             "annotations": {"summary": spec.summary, "description": _description(spec),
                             "runbook_url": f"{runbook_base}#{spec.name}"}}
            for spec in ALERT_SPECS]


def alerts_yaml(runbook_base: str = RUNBOOK) -> str:
    header = [
        "# Prometheus alerting rules of flashwatch: one per Monitor rule, firing on the Monitor's exported",
        '# decision flashwatch_alert_active{rule="..."} == 1 (thresholds, warm-up and hysteresis are the',
        "# Monitor's, MonitorConfig), plus FlashwatchStoppedReporting (no new monitored step for "
        f"{STALL_MIN} minutes).",
        "# GENERATED by dashboards/build_alerts.py from flashwatch/vocabulary.py: edit those, then run",
        "# `python dashboards/build_dashboard.py`; tests/test_dashboards.py checks this copy.",
        f"# Runbook: {RUNBOOK}. Load with rule_files in prometheus.yml; test: promtool test rules alerts_test.yml",
        "",
    ]
    body = {"groups": [{"name": "flashwatch", "rules": alert_rules(runbook_base)}]}
    return "\n".join(header) + yaml.safe_dump(body, sort_keys=False, width=1000, allow_unicode=True)


# --- the runbook ----------------------------------------------------------------------------------

def _settings(spec: RuleSpec) -> str:
    defaults = MonitorConfig()
    known = {f.name for f in fields(MonitorConfig)}
    missing = [s for s in spec.settings if s not in known]
    if missing:
        raise ValueError(f"rule {spec.name}: settings {missing} are not MonitorConfig fields")
    if spec.decided_by != "monitor":
        return ""
    # how an alert ends: below clear_ratio of its threshold (a value's rule), for clear_steps monitored
    # steps in a row, and not again for alert_gap steps (warnings; a critical alert ends at once)
    shown = [*spec.settings, *(["clear_ratio"] if spec.hysteresis else []),
             *(["clear_steps", "alert_gap"] if spec.severity == "warning" else [])]
    return ", ".join(f"`{s}={getattr(defaults, s)!r}`" for s in shown)


def runbook_markdown() -> str:
    """docs/ALERTS.md: the alert table, then one section per alert (anchor: the rule name)."""
    lines = [
        "# Alerts: what each means and what to do",
        "",
        "<!-- GENERATED by dashboards/build_alerts.py from flashwatch/vocabulary.py; "
        "tests/test_dashboards.py checks it. -->",
        "",
        "flashwatch's Monitor decides every rule but the last once per monitored step "
        "(`flashwatch/detectors.py`; thresholds, warm-up and hysteresis are `MonitorConfig`'s, "
        "`flashwatch/config.py`). It logs each alert once "
        "when it starts, counts it in `flashwatch_alerts_total` and exports its state as "
        "`flashwatch_alert_active{rule, layer, head}`. The Prometheus alerts of "
        "`dashboards/alerts.yml` fire on that exported decision, so Prometheus and the Monitor "
        "agree by construction. `stopped_reporting` is Prometheus's own. Layer and head -1: the "
        "alert concerns no single layer or head. Counts of steps in the settings are monitored "
        "steps (one every `interval` optimizer steps). Where each default comes from, and on which "
        "recordings it was set: `docs/CALIBRATION.md`.",
        "",
        markdown_table(link="#"),
    ]
    for spec in ALERT_SPECS:
        expr, for_ = _expr(spec), _for(spec)
        lines += ["", f"## {spec.name}", "",
                  f"**{spec.severity}** · Prometheus alert `{spec.alert}`: `{expr}`, for {for_}"
                  + (" (decided by the Monitor)" if spec.decided_by == "monitor" else ""),
                  "", spec.summary, "",
                  f"**What it means.** {spec.meaning}", "",
                  f"**What to do.** {spec.action}"]
        settings = _settings(spec)
        if settings:
            lines += ["", f"**Settings** (`MonitorConfig`, defaults): {settings}"]
        if spec is STOPPED_REPORTING:
            lines += ["", f"**Timing.** It fires when the last monitored step "
                          f"(`flashwatch_last_step_timestamp_seconds`, unix time on the training machine) is "
                          f"more than {STALL_MIN} minutes old by Prometheus's clock. A slow run monitors a step "
                          "every few minutes (at `interval=10` and 30 s a step, every 5 minutes), and "
                          "evaluation, checkpoint writes and compilation pause it for minutes more; "
                          f"{STALL_MIN} minutes is past those, and still early for a hung job that would hold "
                          "its GPUs for hours. Keep the clocks of the training machines and Prometheus in "
                          "step (NTP): their difference adds to the age."]
    assert len(RULE_SPECS) + 1 == len(ALERT_SPECS)
    return "\n".join(lines) + "\n"


def outputs() -> dict[Path, str]:
    """The committed files this script generates: path -> text."""
    return {ALERTS: alerts_yaml(), RUNBOOK_DOC: runbook_markdown()}


def write(files: dict[Path, str], check: bool) -> int:
    """Write ``files`` (path -> text), or with ``check`` report the stale ones; the exit status."""
    stale = []
    for path, text in files.items():
        if check:
            if not path.exists() or path.read_text() != text:
                stale.append(path.name)
        else:
            path.write_text(text)
            print(f"wrote {path}")
    if stale:
        print(f"stale: {', '.join(stale)}; run python dashboards/build_dashboard.py", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="exit 1 if a committed file differs")
    p.add_argument("--runbook-base", metavar="URL",
                   help="print alerts.yml with runbook_url pointing at URL#<rule> (e.g. the web page of "
                        "docs/ALERTS.md in your repository) instead of writing the committed files")
    args = p.parse_args(argv)
    if args.runbook_base:
        sys.stdout.write(alerts_yaml(args.runbook_base))
        return 0
    return write(outputs(), args.check)


if __name__ == "__main__":
    sys.exit(main())
