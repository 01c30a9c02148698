"""The INJECTED fault of ``flashwatch demo --provoke``: its strength, its description, and the
exporter wrapper that labels every alert message INJECTED.

The fault is ``flashwatch.kernels.faults.rounding_bias(PROVOKE_STRENGTH)``: while it is on,
every own-kernel attention call biases the BF16 rounding of its output on rows where P_bar
rounds to exactly 1 at two or more keys, inflating |O| there by ``strength * 2**-8`` (128: 50 %).
"""

from __future__ import annotations

import dataclasses

from ..exporters.base import Exporter
from ..vocabulary import INJECTED

__all__ = ["PROVOKE_STRENGTH", "Labelled", "describe"]

PROVOKE_STRENGTH = 128.0  # rounding bias of --provoke: |O| * (1 + 128 * 2**-8) on the selected BF16 rows


def describe(strength: float) -> str:
    """What the fault does, in one sentence."""
    return (f"rounding_bias({strength:g}): on rows where P_bar rounds to exactly 1 at two or more keys, "
            f"|O| is inflated by {strength * 2 ** -8:.0%} before BF16 rounding")


class Labelled(Exporter):
    """Passes records on to ``inner`` with every alert message prefixed by ``[label]``."""

    def __init__(self, inner: Exporter, label: str = INJECTED) -> None:
        self.inner, self.label = inner, label
        self.name = getattr(inner, "name", type(inner).__name__)

    def _mark(self, alerts):
        return [dataclasses.replace(a, message=f"[{self.label}] {a.message}") for a in alerts]

    def open(self, layout) -> None:
        self.inner.open(layout)

    def export(self, record) -> None:
        self.inner.export(dataclasses.replace(record, new_alerts=self._mark(record.new_alerts),
                                              active_alerts=self._mark(record.active_alerts)))

    def close(self) -> None:
        self.inner.close()
