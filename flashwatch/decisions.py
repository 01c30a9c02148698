"""The host half's deciding: run the detectors on a step's signals, keep the alert history,
switch flagged layers (auto_fix). Logging of alerts and switches is rank 0's (``reporting``)."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable

import torch

from .attach import AttentionLayer
from .config import MonitorConfig
from .detectors import Alert, StepSignals, build_detectors
from .vocabulary import RULES

log = logging.getLogger("flashwatch")

__all__ = ["Decisions"]


class Decisions:
    """Detectors and the alert history of one Monitor.

    Attributes:
        detectors: the rule objects, in ``RULES`` order.
        alerts: every alert raised so far, in order.
        alert_counts: alerts raised per rule.
        ever_active: every (rule, layer, head) that was ever active (its series stays exported).
        switches: auto-fix switches, dicts with step, layer, name, from, to, rule.
        due_switches: switches decided but not yet applied (see ``auto_fix``).
    """

    def __init__(self, config: MonitorConfig, on_error: Callable[[str, BaseException], None]):
        self.config = config
        self.on_error = on_error
        self.detectors = build_detectors(config)
        self.alerts: list[Alert] = []
        self.alert_counts: dict[str, int] = {rule: 0 for rule in RULES}
        self.ever_active: set[tuple[str, int, int]] = set()
        self.switches: list[dict] = []
        self.due_switches: list[dict] = []  # decided by auto_fix(defer=True), applied by apply_due()

    @property
    def active(self) -> list[Alert]:
        return [a for d in self.detectors for a in d.active]

    def judge(self, t: int, signals: StepSignals, unmeasured: Any, reporting: bool) -> list[Alert]:
        """Run the detectors on monitored step ``t``; record, count and log the alerts that start.

        ``unmeasured``: True (every layer) or the indices of the layers whose W^Q is not measured:
        their NaN norms are no non-finite values."""
        judged = signals
        if unmeasured:
            judged = dataclasses.replace(signals, layers=[
                dataclasses.replace(ls, wq_sigma=torch.zeros_like(ls.wq_sigma)) if unmeasured is True or i in unmeasured
                else ls for i, ls in enumerate(signals.layers)])
        new: list[Alert] = []
        for det in self.detectors:
            try:
                new.extend(det.update(judged))
            except Exception as exc:
                self.on_error(f"detector {det.rule}", exc)
            if reporting:
                for a in det.cleared:
                    log.info("flashwatch alert cleared [%s] layer %d head %d at step %d", a.rule, a.layer, a.head, t)
        for a in new:
            self.alerts.append(a)
            self.alert_counts[a.rule] += 1
            self.ever_active.add((a.rule, a.layer, a.head))
            if reporting:
                log.log(logging.ERROR if a.severity == "critical" else logging.WARNING,
                        "flashwatch alert [%s] step %d: %s", a.rule, a.step, a.message)
        return new

    def auto_fix(self, t: int, next_step: int, layers: list[AttentionLayer], alerts: list[Alert],
                 reporting: bool, defer: bool = False) -> None:
        """Switch each layer flagged by an alert of ``config.auto_fix_on`` to ``config.auto_fix``.

        With ``defer`` the switches are recorded and logged now but the layers change only at
        ``apply_due`` (the next ``Monitor.step``): a monitored step decided early, by a flush
        between optimizer steps, switches at the same optimizer step as one decided in order.
        """
        target = self.config.auto_fix
        if target is None:
            return
        for a in alerts:
            if a.rule not in self.config.auto_fix_on or a.layer < 0:
                continue
            layer = layers[a.layer]
            if self.decided_variant(layer) == ("own_kernel", target):
                continue
            before = self.decided_variant(layer)[1]
            switch = {"step": t, "layer": layer.index, "name": layer.name, "from": before, "to": target,
                      "rule": a.rule}
            self.switches.append(switch)
            if defer:
                self.due_switches.append(dict(switch))
            else:
                layer.mode, layer.variant = "own_kernel", target
            if reporting:
                log.warning("flashwatch auto_fix: layer %d (%s) switched from %s to %s from step %d on (%s at step %d)",
                            layer.index, layer.name, before, target, next_step, a.rule, t)

    def decided_variant(self, layer: AttentionLayer) -> tuple[str, str]:
        """(mode, variant) of ``layer`` once the switches decided so far have applied."""
        for switch in reversed(self.due_switches):
            if switch["layer"] == layer.index:
                return "own_kernel", switch["to"]
        return layer.mode, layer.variant

    def apply_due(self, layers: list[AttentionLayer]) -> None:
        """Apply the switches ``auto_fix(defer=True)`` decided (at the next optimizer step)."""
        if not layers:  # detached: they wait for the layers (attach continues the detached state)
            return
        due, self.due_switches = self.due_switches, []
        for switch in due:
            layer = layers[switch["layer"]]
            layer.mode, layer.variant = "own_kernel", switch["to"]

    def state_dict(self) -> dict:
        return {"detectors": {d.rule: d.state_dict() for d in self.detectors},
                "alerts": [a.to_dict() for a in self.alerts],
                "alert_counts": dict(self.alert_counts),
                "ever_active": sorted(list(k) for k in self.ever_active),
                "switches": [dict(s) for s in self.switches],
                "due_switches": [dict(s) for s in self.due_switches]}

    def load_state_dict(self, state: dict) -> None:
        for d in self.detectors:
            if d.rule in state["detectors"]:
                d.load_state_dict(state["detectors"][d.rule])
        self.alerts = [Alert.from_dict(a) for a in state["alerts"]]
        self.alert_counts = {rule: int(state["alert_counts"].get(rule, 0)) for rule in RULES}
        self.ever_active = {tuple(k) for k in state["ever_active"]}
        self.switches = [dict(s) for s in state["switches"]]
        self.due_switches = [dict(s) for s in state.get("due_switches", [])]
