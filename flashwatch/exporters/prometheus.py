"""Prometheus exporter: the last monitored step's metrics on an HTTP ``/metrics`` endpoint.

Every metric name, kind, label set and help text comes from ``flashwatch.metrics.METRICS``;
nothing else is exported (no process or Python metrics: the registry is flashwatch's own,
not prometheus-client's global one, so creating several exporters in one process, as tests
do, has no side effects).

How it works: ``export()`` (on the training thread, once per monitored step) checks the
snapshot's shape and keeps a copy of it: about half a millisecond for 1,024 heads. A scrape
turns the copy it finds into metric families (``collect()`` of a custom collector, on the
server thread) and reuses them until the next ``export()``. Building the ~8,000 samples of
1,024 heads on every monitored step instead would allocate that many objects on the training
thread, and the garbage collections they trigger cost up to 80 ms on the step that pays them.

Server: ``open()`` (or ``start()``) binds ``host:port`` (default ``127.0.0.1:9400``; pass
``host="0.0.0.0"`` only when another machine must scrape). ``port=0`` picks a free port; the
port actually bound is ``exporter.port``. A port already in use raises :class:`PortInUseError`
at ``open()``, before training starts. ``close()`` shuts the server down.

Constant labels: ``const_labels={"rank": "1"}`` adds the same labels to every series (the
Lightning callback's one-endpoint-per-rank mode labels each rank's endpoint so). They are not
in the metric table, which defines what a series *is*; a constant label says which process
serves it, as Prometheus's own ``instance`` and ``job`` target labels do.

Pushgateway (batch jobs that end before a scrape): ``pushgateway="http://host:9091"`` pushes
the same metrics under ``job`` and a grouping key at most every ``push_interval_s`` seconds, and
once more at ``close()``. Pushes leave the training thread: ``export()`` queues the step and a
background thread pushes it (``flashwatch.exporters.pushgateway.Pusher``); a gateway that is
down or never answers costs the training run nothing. The queue is bounded (oldest dropped,
counted in ``push_dropped``), failures are counted in ``push_failed`` (the first logged at
WARNING), and ``close()`` waits at most ``push_close_timeout_s``. The default grouping key is
``{"run": <host>-<pid>-<start time>-<random>}``, so concurrent runs never overwrite each other's group.

An application's own registry: ``PrometheusExporter(port=None, registry=app_registry)`` adds
flashwatch's metrics to the registry the application already serves on its ``/metrics``
(``close()`` takes them out again).

Beside a step's metrics the exporter serves ``flashwatch_build_info{version}`` and
``flashwatch_last_step_timestamp_seconds`` (``SERVICE_METRICS``): a hung run keeps its
endpoint answering, and the timestamp is what stops (the ``FlashwatchStoppedReporting`` rule).

Example::

    exporter = PrometheusExporter(port=0)
    exporter.open(Layout(layers=[("h.0.attn", 12)]))
    print(exporter.url)          # http://127.0.0.1:40213/metrics
    exporter.export(record)      # a StepRecord from the Monitor
    exporter.close()
"""

from __future__ import annotations

import errno
import logging
import math
import re
import threading
import time
from typing import Any, Callable, Iterable, Mapping

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import generate_latest, push_to_gateway, start_http_server
from prometheus_client.samples import Sample

from .. import __version__
from ..metrics import ALL_METRICS, BY_NAME, present
from ..vocabulary import RULES, check_port
from .base import Exporter, Layout, StepRecord
from .pushgateway import Pusher, check_gateway_url, new_run_id

log = logging.getLogger("flashwatch.exporters.prometheus")


def known_rules() -> tuple[str, ...]:
    """Alert rule names (``flashwatch.vocabulary.RULES``): each gets a ``flashwatch_alerts_total`` series."""
    return RULES


class PortInUseError(OSError):
    """The exporter's HTTP port is taken (another run or exporter listens on it)."""


class _SnapshotCollector:
    """Builds metric families from the last exported snapshot when a scrape asks for them."""

    def __init__(self, created: float, rules: tuple[str, ...], const_labels: Mapping[str, str] | None = None) -> None:
        self._lock = threading.Lock()  # the HTTP server scrapes from several threads
        self._created = created
        self._rules = rules
        self._labels = _LabelCache(const_labels)
        self._snapshot: dict | None = None
        self._step_time: float | None = None
        self._version = 0
        self._built: tuple[Metric, ...] = ()
        self._built_version = -1  # build_info is served before the first step

    def set(self, snapshot: dict, step_time: float) -> None:
        with self._lock:
            self._snapshot = snapshot
            self._step_time = step_time
            self._version += 1

    def frozen(self) -> "_FrozenCollector":
        """The families of the current state, for a push made later on another thread."""
        return _FrozenCollector(tuple(self.collect()))

    @property
    def has_data(self) -> bool:
        return self._snapshot is not None

    def collect(self) -> Iterable[Metric]:
        with self._lock:
            if self._built_version != self._version:
                self._built = (build_families(self._snapshot or {}, created=self._created,
                                              rules=self._rules, cache=self._labels)
                               + service_families(self._step_time, self._labels.const))
                self._built_version = self._version
            return self._built

    def describe(self) -> Iterable[Metric]:
        # No fixed descriptions: the registry must not call collect() at registration.
        return ()


class _FrozenCollector:
    """Fixed metric families (what a queued push sends)."""

    def __init__(self, families: tuple[Metric, ...]) -> None:
        self._families = families

    def collect(self) -> Iterable[Metric]:
        return self._families


def service_families(step_time: float | None, const_labels: Mapping[str, str] | None = None) -> tuple[Metric, ...]:
    """``flashwatch_build_info`` (always) and ``flashwatch_last_step_timestamp_seconds`` (once a step came)."""
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


_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")


def _check_const_labels(const_labels: Mapping[str, Any] | None) -> dict[str, str]:
    if const_labels is None:
        return {}
    if not isinstance(const_labels, Mapping):
        raise ValueError(f"const_labels must be a dict of label name -> value, got {type(const_labels).__name__}")
    taken = {label for spec in ALL_METRICS for label in spec.labels}
    out = {}
    for name, value in const_labels.items():
        if not isinstance(name, str) or not _LABEL_NAME.fullmatch(name) or name.startswith("__"):
            raise ValueError(f"const_labels: {name!r} is not a valid Prometheus label name")
        if name in taken:
            raise ValueError(f"const_labels: {name!r} is a label of the metric table ({', '.join(sorted(taken))}); "
                             "choose another name")
        out[name] = str(value)
    return out


def _number(name: str, value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"snapshot[{name!r}] values must be numbers, got {value!r}") from None


class PrometheusExporter(Exporter):
    """Serve flashwatch's metrics to Prometheus (HTTP ``/metrics``) and optionally push them.

    Args:
        port: TCP port of the ``/metrics`` endpoint; ``0`` picks a free one (read it back from
            ``.port``); ``None`` serves nothing (use ``.registry`` or the Pushgateway).
        host: address to bind, ``127.0.0.1`` by default so that nothing outside the machine
            can read the metrics unless you ask for it (``"0.0.0.0"`` or an interface address).
        pushgateway: Pushgateway address (``"http://host:9091"``) for batch jobs, or ``None``.
        job: the Pushgateway ``job`` label.
        grouping_key: further Pushgateway grouping labels; default ``{"run": run_id}``.
        run_id: the run's id in the default grouping key; default ``<host>-<pid>-<start time>-<random>``,
            unique across concurrent runs (set it to replace a run's group when it restarts).
        push_interval_s: least seconds between pushes from ``export()`` (0: every monitored
            step). The last state is always pushed at ``close()``.
        push_timeout_s: timeout of one push (on the background thread).
        push_close_timeout_s: longest ``close()`` waits for the last push.
        push_handler: a prometheus-client push handler, e.g. for authentication:
            ``flashwatch.exporters.pushgateway.basic_auth(user, password)``.
        registry: a ``prometheus_client.CollectorRegistry`` to add flashwatch's metrics to
            (an application's own ``/metrics``); default a registry of flashwatch's own.
        const_labels: labels added to every series, e.g. ``{"rank": "1"}`` for one endpoint
            per rank; names must be valid Prometheus label names and none of the metric
            table's labels (``layer``, ``head``, ``variant``, ``rule``).

    Raises:
        ValueError: a bad port, host, Pushgateway address, push setting, registry or constant
            label (the message names it).
        PortInUseError: at ``open()``/``start()``, when ``host:port`` is already taken.
        OSError: at ``open()``/``start()``, when the address cannot be bound otherwise.
    """

    name = "prometheus"

    def __init__(
        self,
        port: int | None = 9400,
        host: str = "127.0.0.1",
        *,
        pushgateway: str | None = None,
        job: str = "flashwatch",
        grouping_key: Mapping[str, str] | None = None,
        run_id: str | None = None,
        push_interval_s: float = 0.0,
        push_timeout_s: float = 5.0,
        push_close_timeout_s: float = 5.0,
        push_handler: Callable | None = None,
        const_labels: Mapping[str, Any] | None = None,
        registry: CollectorRegistry | None = None,
    ):
        check_port(port)
        if not isinstance(host, str) or not host:
            raise ValueError(f"host must be a non-empty address string such as '127.0.0.1', got {host!r}")
        if pushgateway is not None:
            check_gateway_url(pushgateway)
        if not isinstance(job, str) or not job:
            raise ValueError(f"job must be a non-empty string, got {job!r}")
        if not (isinstance(push_interval_s, (int, float)) and push_interval_s >= 0):
            raise ValueError(f"push_interval_s must be a number >= 0, got {push_interval_s!r}")
        for name, value in (("push_timeout_s", push_timeout_s), ("push_close_timeout_s", push_close_timeout_s)):
            if not (isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0):
                raise ValueError(f"{name} must be a number of seconds > 0, got {value!r}")
        if push_handler is not None and not callable(push_handler):
            raise ValueError(f"push_handler must be a prometheus-client push handler (a callable), got {push_handler!r}")
        if run_id is not None and (not isinstance(run_id, str) or not run_id):
            raise ValueError(f"run_id must be a non-empty string, got {run_id!r}")
        if registry is not None and not callable(getattr(registry, "register", None)):
            raise ValueError(f"registry must be a prometheus_client.CollectorRegistry, got {type(registry).__name__}")
        self.const_labels = _check_const_labels(const_labels)
        self.requested_port = port
        self.host = host
        self.pushgateway = pushgateway
        self.job = job
        self.run_id = run_id or new_run_id()
        self.grouping_key = dict(grouping_key) if grouping_key is not None else {"run": self.run_id}
        self.push_interval_s = float(push_interval_s)
        self.push_timeout_s = float(push_timeout_s)
        self.push_close_timeout_s = float(push_close_timeout_s)
        self.push_handler = push_handler
        self._pusher: Pusher | None = None

        self._own_registry = registry is None
        self.registry = CollectorRegistry(auto_describe=False) if registry is None else registry
        self._collector = _SnapshotCollector(created=time.time(), rules=known_rules(),
                                             const_labels=self.const_labels)
        self.registry.register(self._collector)
        self._known_keys: dict[str, Any] = {}
        self._server = None
        self._thread: threading.Thread | None = None
        self._last_push = -math.inf
        self.layout: Layout | None = None

    # -- server -------------------------------------------------------------------------

    @property
    def port(self) -> int | None:
        """The port the server listens on (the free one picked for ``port=0``), or None."""
        return None if self._server is None else self._server.server_port

    @property
    def url(self) -> str | None:
        """``http://host:port/metrics`` while serving, else None."""
        if self._server is None:
            return None
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def start(self) -> None:
        """Bind and serve now (``open()`` calls this). Idempotent.

        Raises:
            PortInUseError: the port is taken.
            OSError: the address cannot be bound (unknown host, privileged port, ...).
        """
        if self._server is not None or self.requested_port is None:
            return
        where = f"{self.host}:{self.requested_port}"
        try:
            self._server, self._thread = start_http_server(
                self.requested_port, addr=self.host, registry=self.registry)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise PortInUseError(
                    errno.EADDRINUSE,
                    f"flashwatch cannot serve Prometheus metrics on {where}: the port is already "
                    f"in use (another training run or exporter?). Choose another port "
                    f"(port=0 picks a free one) or disable the server with port=None",
                ) from None
            raise OSError(
                exc.errno,
                f"flashwatch cannot serve Prometheus metrics on {where}: {exc.strerror or exc}. "
                f"Check host (an address of this machine, e.g. 127.0.0.1) and port "
                f"(ports below 1024 need root)",
            ) from exc
        log.info("flashwatch Prometheus metrics at %s", self.url)

    def _stop(self) -> None:
        server, thread = self._server, self._thread
        self._server = self._thread = None
        if server is not None:
            server.shutdown()
            server.server_close()
        if thread is not None:
            thread.join(timeout=5.0)

    # -- Exporter -----------------------------------------------------------------------

    def open(self, layout: Layout) -> None:
        self.layout = layout
        self.start()

    def export(self, record: StepRecord) -> None:
        self._collector.set(checked_copy(record.snapshot, self._known_keys), float(record.time))
        if self.pushgateway is not None:
            now = time.monotonic()
            if now - self._last_push >= self.push_interval_s:
                self._last_push = now
                self._push_later()

    def close(self) -> None:
        try:
            if self.pushgateway is not None and (self._pusher is not None or self._collector.has_data):
                # the last state, pushed last; close() waits at most push_close_timeout_s
                self._pusher_now().close(self._collector.frozen() if self._collector.has_data else None)
        finally:
            self._stop()
            if not self._own_registry:
                try:
                    self.registry.unregister(self._collector)
                except KeyError:  # closed twice
                    pass

    # -- Pushgateway --------------------------------------------------------------------

    def _pusher_now(self) -> Pusher:
        if self._pusher is None:
            self._pusher = Pusher(self.pushgateway, job=self.job, grouping_key=self.grouping_key,
                                  timeout_s=self.push_timeout_s, handler=self.push_handler,
                                  close_timeout_s=self.push_close_timeout_s)
        return self._pusher

    def _push_later(self) -> None:
        self._pusher_now().submit(self._collector.frozen())

    @property
    def push_dropped(self) -> int:
        """Pushes dropped: the queue was full (a slow gateway), or left at ``close()``."""
        return self._pushes("dropped")

    @property
    def push_failed(self) -> int:
        """Pushes that failed (gateway down, refused, timed out)."""
        return self._pushes("failed")

    @property
    def pushed(self) -> int:
        """Pushes the gateway accepted."""
        return self._pushes("pushed")

    def _pushes(self, what: str) -> int:
        return 0 if self._pusher is None else getattr(self._pusher, what)

    def push(self) -> None:
        """Push the current metrics to the Pushgateway now, on this thread (no-op without one).

        Raises:
            OSError and what prometheus-client raises: the push failed.
        """
        if self.pushgateway is None:
            return
        push_to_gateway(self.pushgateway, job=self.job, registry=self._collector.frozen(),
                        grouping_key=self.grouping_key or None, timeout=self.push_timeout_s,
                        **({"handler": self.push_handler} if self.push_handler else {}))

    # -- helpers ------------------------------------------------------------------------

    def render(self) -> bytes:
        """The text a scrape of ``/metrics`` returns now (Prometheus text format 0.0.4)."""
        return generate_latest(self.registry)

    def __repr__(self) -> str:
        where = self.url or ("not serving" if self.requested_port is not None else "no server")
        return f"PrometheusExporter({where})"


__all__ = ["PrometheusExporter", "PortInUseError", "build_families", "checked_copy", "known_rules"]
