"""Metric families of flashwatch's metric table, built from a ``Monitor.snapshot()`` when a scrape or
a push asks for them (``flashwatch.exporters.prometheus`` re-exports the public names)."""

from __future__ import annotations

import threading
from typing import Any, Callable, Iterable, Mapping

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.samples import Sample

from .. import __version__
from ..metrics import ALL_METRICS, BY_NAME, present

__all__ = ["build_families", "checked_copy", "service_families"]


class _SnapshotCollector:
    """Builds metric families from the last exported snapshot when a scrape asks for them."""

    def __init__(self, created: float, rules: tuple[str, ...], const_labels: Mapping[str, str] | None = None) -> None:
        self._lock = threading.Lock()  # the state: set() (training thread) and the HTTP server's scrapes
        self._build_lock = threading.Lock()  # one scrape builds the families at a time
        self._created = created
        self._rules = rules
        self._labels = _LabelCache(const_labels)
        self._snapshot: dict | None = None
        self._step_time: float | None = None
        self._version = 0
        self._built: tuple[Metric, ...] = ()
        self._built_version = -1  # served before the first step too (_state)

    def set(self, snapshot: dict, step_time: float) -> None:
        with self._lock:
            self._snapshot = snapshot
            self._step_time = step_time
            self._version += 1

    def _state(self) -> tuple[dict, float]:
        """The snapshot and step time to serve. Before the first step: every rule's alert counter at 0
        (so that increase() sees an alert of the first monitored step) and, as the last step's
        time, the time monitoring started (so that a run hung before its first monitored step
        stops reporting too)."""
        if self._snapshot is None:
            return {"flashwatch_alerts_total": {}}, self._created
        return self._snapshot, self._step_time

    def frozen(self, final: bool = False) -> "_FrozenCollector":
        """The current state, for a push made later on another thread: its families are built
        there, at the push, not on the training thread that queues it. ``final``: the run's last
        push, without ``flashwatch_alert_active`` (an ended run holds no alert)."""
        with self._lock:
            snapshot, step_time = self._state()
        if final:
            snapshot = {k: v for k, v in snapshot.items() if k != "flashwatch_alert_active"}
        labels = self._labels
        return _FrozenCollector(lambda: build_families(snapshot, created=self._created, rules=self._rules,
                                                       cache=labels) + service_families(step_time, labels.const))

    @property
    def has_data(self) -> bool:
        return self._snapshot is not None

    def collect(self) -> Iterable[Metric]:
        # built outside the lock that set() takes: a scrape of many heads (tens of ms) never holds up the
        # training thread's export; scrapes build one at a time (_build_lock), each state once
        with self._build_lock:
            with self._lock:
                if self._built_version == self._version:
                    return self._built
                (snapshot, step_time), version = self._state(), self._version
            built = (build_families(snapshot, created=self._created, rules=self._rules, cache=self._labels)
                     + service_families(step_time, self._labels.const))
            with self._lock:
                self._built, self._built_version = built, version
            return built

    def describe(self) -> Iterable[Metric]:
        # the table's names, without samples (the registry must not call collect() at registration):
        # a registry that already holds one of them refuses this collector (prometheus_client's
        # "Duplicated timeseries"), as it would refuse two of a user's own metrics of one name
        return tuple((CounterMetricFamily if spec.kind == "counter" else GaugeMetricFamily)(spec.name, spec.help)
                     for spec in ALL_METRICS)


class _FrozenCollector:
    """One state's metric families, built when ``collect()`` is called (by a push, on its thread)."""

    def __init__(self, build: Callable[[], tuple[Metric, ...]]) -> None:
        self._build = build

    def collect(self) -> Iterable[Metric]:
        return self._build()


def service_families(step_time: float | None, const_labels: Mapping[str, str] | None = None) -> tuple[Metric, ...]:
    """``flashwatch_build_info`` (always) and ``flashwatch_last_step_timestamp_seconds`` (unless None)."""
    const = dict(const_labels or {})
    info = BY_NAME["flashwatch_build_info"]
    fam = GaugeMetricFamily(info.name, info.help, labels=(*info.labels, *const))
    fam.add_metric([__version__, *const.values()], 1.0)
    out = [fam]
    if step_time is not None:
        stamp = BY_NAME["flashwatch_last_step_timestamp_seconds"]
        fam = GaugeMetricFamily(stamp.name, stamp.help, labels=tuple(const))
        fam.add_metric(list(const.values()), float(step_time))
        out.append(fam)
    return tuple(out)


def checked_copy(snapshot: Mapping[str, Any], known_keys: dict[str, Any] | None = None) -> dict:
    """A copy of the table's metrics in ``snapshot``, checked as ``build_families`` would.

    ``known_keys`` (metric name -> key set seen before) makes the check of unchanged label
    sets a set comparison instead of a walk over every key.

    Raises:
        ValueError: as ``build_families``.
    """
    known_keys = known_keys if known_keys is not None else {}
    out: dict[str, Any] = {}
    for spec, value in present(snapshot):
        if not spec.labels:
            out[spec.name] = _number(spec.name, value)
            continue
        if not isinstance(value, Mapping):
            raise ValueError(
                f"snapshot[{spec.name!r}] must be a dict keyed by ({', '.join(spec.labels)}) "
                f"tuples, got {type(value).__name__}"
            )
        value = dict(value)
        keys = value.keys()
        if known_keys.get(spec.name) != keys:
            n = len(spec.labels)
            for key in keys:
                if not isinstance(key, tuple) or len(key) != n:
                    raise ValueError(
                        f"snapshot[{spec.name!r}] keys must be ({', '.join(spec.labels)}) "
                        f"tuples of {n} values, got {key!r}"
                    )
            known_keys[spec.name] = set(keys)
        if not {type(v) for v in value.values()} <= _PLAIN_NUMBERS:
            value = {k: _number(spec.name, v) for k, v in value.items()}
        out[spec.name] = value
    return out


_PLAIN_NUMBERS = {float, int}


class _LabelCache:
    """Label dicts per label-value tuple, built once and shared by every export.

    Rebuilding ``{"layer": "3", "head": "7"}`` for 1,024 heads x 8 metrics on every monitored
    step was half of the export time; the dicts are never mutated, so sharing them is safe.
    """

    def __init__(self, const_labels: Mapping[str, str] | None = None) -> None:
        self._by_names: dict[tuple[str, ...], dict[tuple, dict[str, str]]] = {}
        self.const = dict(const_labels or {})  # added to every label dict (e.g. {"rank": "1"})

    def get(self, metric: str, names: tuple[str, ...], key: Any) -> dict[str, str]:
        table = self._by_names.setdefault(names, {})
        labels = table.get(key) if isinstance(key, tuple) else None
        if labels is None:
            if not isinstance(key, tuple) or len(key) != len(names):
                raise ValueError(
                    f"snapshot[{metric!r}] keys must be ({', '.join(names)}) tuples of "
                    f"{len(names)} values, got {key!r}"
                )
            labels = table[key] = {**{n: str(k) for n, k in zip(names, key)}, **self.const}
        return labels


def build_families(snapshot: Mapping[str, Any], *, created: float = 0.0,
                   rules: Iterable[str] = (), cache: _LabelCache | None = None,
                   const_labels: Mapping[str, str] | None = None) -> tuple[Metric, ...]:
    """Metric families of a ``Monitor.snapshot()``, in the order of the metric table.

    Metrics missing from the snapshot are left out (Prometheus marks their series stale);
    names not in the table are ignored. ``flashwatch_alerts_total`` gets a 0 for every rule
    of ``rules`` that has not fired, so that ``increase()`` sees a rule's first alert.
    ``const_labels`` (or the ``cache``'s) are added to every sample.

    Raises:
        ValueError: a value is not a number, or a labelled metric is not a dict keyed by
            tuples of as many label values as the table gives it.
    """
    cache = cache if cache is not None else _LabelCache(const_labels)
    const_names = tuple(cache.const)
    families = []
    for spec, value in present(snapshot):
        counter = spec.kind == "counter"
        fam = (CounterMetricFamily if counter else GaugeMetricFamily)(spec.name, spec.help,
                                                                       labels=spec.labels + const_names)
        if not spec.labels:
            items: Iterable[tuple[Any, Any]] = [((), value)]
        elif isinstance(value, Mapping):
            items = value.items()
            if spec.name == "flashwatch_alerts_total":
                items = list(items) + [((r,), 0.0) for r in rules if (r,) not in value]
        else:
            raise ValueError(
                f"snapshot[{spec.name!r}] must be a dict keyed by ({', '.join(spec.labels)}) "
                f"tuples, got {type(value).__name__}"
            )
        # Samples are built directly (not with add_metric) so label dicts can be shared.
        samples = fam.samples
        if counter:
            for key, v in items:
                labels = cache.get(spec.name, spec.labels, key)
                samples.append(Sample(fam.name + "_total", labels, _number(spec.name, v), None))
                samples.append(Sample(fam.name + "_created", labels, created, None))
        else:
            name = fam.name
            for key, v in items:
                samples.append(Sample(name, cache.get(spec.name, spec.labels, key),
                                      _number(spec.name, v), None))
        families.append(fam)
    return tuple(families)


def _number(name: str, value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"snapshot[{name!r}] values must be numbers, got {value!r}") from None
