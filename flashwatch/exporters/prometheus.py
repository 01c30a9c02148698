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
(``close()`` takes them out again, ``open()`` puts them back).

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
from typing import Any, Callable, Mapping

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest, push_to_gateway, start_http_server

from ..metrics import ALL_METRICS
from ..vocabulary import RULES, check_port
from .base import Exporter, Layout, StepRecord
from .prometheus_families import _SnapshotCollector, build_families, checked_copy, service_families
from .pushgateway import Pusher, check_gateway_url, new_run_id

log = logging.getLogger("flashwatch.exporters.prometheus")


def known_rules() -> tuple[str, ...]:
    """Alert rule names (``flashwatch.vocabulary.RULES``): each gets a ``flashwatch_alerts_total`` series."""
    return RULES


class PortInUseError(OSError):
    """The exporter's HTTP port is taken (another run or exporter listens on it)."""


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


class _DefaultPort:
    """The default of ``PrometheusExporter(port=...)``: 9400, or no server when a Pushgateway is given."""

    def __repr__(self) -> str:  # what help() shows in the signature
        return "9400 (None with a pushgateway)"


_DEFAULT_PORT = _DefaultPort()


class PrometheusExporter(Exporter):
    """Serve flashwatch's metrics to Prometheus (HTTP ``/metrics``) and optionally push them.

    Args:
        port: TCP port of the ``/metrics`` endpoint; ``0`` picks a free one (read it back from
            ``.port``); ``None`` serves nothing (use ``.registry`` or the Pushgateway). Default
            9400, or None when ``pushgateway`` is given (a batch job that pushes serves nothing
            unless a port is named).
        host: address to bind, ``127.0.0.1`` by default so that nothing outside the machine
            can read the metrics unless you ask for it (``"0.0.0.0"`` or an interface address).
        pushgateway: Pushgateway address (``"http://host:9091"``) for batch jobs, or ``None``.
        job: the Pushgateway ``job`` label.
        grouping_key: the Pushgateway grouping labels; default ``{"run": run_id, "instance": run_id}``
            (scraped with ``honor_labels: true``, each run is an instance of its own on the
            dashboard, and ``stopped_reporting`` leaves pushed runs alone).
        run_id: the run's id in the default grouping key; default ``<host>-<pid>-<start time>-<random>``,
            unique across concurrent runs (set it to replace a run's group when it restarts).
        push_interval_s: least seconds between pushes from ``export()`` (0: every monitored
            step). The last state is always pushed at ``close()``, without
            ``flashwatch_alert_active``: an ended run holds no alert (the gateway would keep it
            firing for ever).
        push_timeout_s: timeout of one push (on the background thread).
        push_close_timeout_s: longest ``close()`` waits for the last push (2 s; a gateway that
            answers at all answers in milliseconds).
        push_handler: a prometheus-client push handler, e.g. for authentication:
            ``flashwatch.exporters.pushgateway.basic_auth(user, password)``.
        registry: a ``prometheus_client.CollectorRegistry`` to add flashwatch's metrics to
            (an application's own ``/metrics``); default a registry of flashwatch's own. One
            that already serves a metric of one of flashwatch's names (another flashwatch
            exporter's too) refuses it: ``ValueError`` ("Duplicated timeseries") here.
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
        port: int | None | object = _DEFAULT_PORT,
        host: str = "127.0.0.1",
        *,
        pushgateway: str | None = None,
        job: str = "flashwatch",
        grouping_key: Mapping[str, str] | None = None,
        run_id: str | None = None,
        push_interval_s: float = 0.0,
        push_timeout_s: float = 5.0,
        push_close_timeout_s: float = 2.0,
        push_handler: Callable | None = None,
        const_labels: Mapping[str, Any] | None = None,
        registry: CollectorRegistry | None = None,
    ):
        if port is _DEFAULT_PORT:
            port = None if pushgateway is not None else 9400
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
        self.grouping_key = (dict(grouping_key) if grouping_key is not None
                             else {"run": self.run_id, "instance": self.run_id})
        self.push_interval_s = float(push_interval_s)
        self.push_timeout_s = float(push_timeout_s)
        self.push_close_timeout_s = float(push_close_timeout_s)
        self.push_handler = push_handler
        self._pusher: Pusher | None = None
        self._push_totals = {"pushed": 0, "failed": 0, "dropped": 0}  # of pushers already closed

        self._own_registry = registry is None
        self.registry = CollectorRegistry(auto_describe=False) if registry is None else registry
        self._collector = _SnapshotCollector(created=time.time(), rules=known_rules(),
                                             const_labels=self.const_labels)
        self.registry.register(self._collector)  # a user's registry holding one of its names raises here
        self._registered = True
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
        if not self._own_registry and not self._registered:  # opened again after close() (a later fit)
            self.registry.register(self._collector)
            self._registered = True
        self.start()

    def export(self, record: StepRecord) -> None:
        self._collector.set(checked_copy(record.snapshot, self._known_keys), float(record.time))
        if self.pushgateway is not None:
            now = time.monotonic()
            if now - self._last_push >= self.push_interval_s:
                self._last_push = now
                self._push_later()

    def resume(self, record: StepRecord) -> None:
        """Serve the resumed run's last step (its alert counters, active alerts and values) until
        the next monitored step, not a fresh run's zeros: a counter that dropped to 0 and came back
        would read as a reset followed by new alerts (pushed too, where a Pushgateway is named)."""
        if not self._collector.has_data:
            self.export(record)

    def close(self) -> None:
        try:
            if self.pushgateway is not None and (self._pusher is not None or self._collector.has_data):
                # the last state, pushed last; close() waits at most push_close_timeout_s
                pusher = self._pusher_now()
                pusher.close(self._collector.frozen(final=True) if self._collector.has_data else None)
                self._pusher = None  # a later open() (another fit) pushes through a new one
                for what in self._push_totals:
                    self._push_totals[what] += getattr(pusher, what)
        finally:
            self._stop()
            if not self._own_registry and self._registered:
                self.registry.unregister(self._collector)  # a user's registry: its scrapes stop serving the run
                self._registered = False

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
        return self._push_totals[what] + (0 if self._pusher is None else getattr(self._pusher, what))

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


__all__ = ["PrometheusExporter", "PortInUseError", "build_families", "checked_copy", "service_families",
           "known_rules"]
