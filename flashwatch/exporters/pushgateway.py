"""Pushes to a Prometheus Pushgateway, off the training thread.

:class:`Pusher` owns one background thread and a bounded queue. ``submit()`` (on the training
thread) only enqueues what to push and returns at once; when the queue is full the oldest
waiting push is dropped (``dropped`` counts them: the Pushgateway keeps only the last push of a
group anyway). A gateway that is slow, down, or accepts the connection and never answers costs
the training thread nothing; each push waits at most ``timeout_s``. Failures are counted
(``failed``) and the first is logged at WARNING with the gateway's address. ``close()`` pushes
what is queued (the last state last) and waits at most ``close_timeout_s`` for it.

Example::

    pusher = Pusher("http://localhost:9091", job="flashwatch", grouping_key={"run": "exp-17"})
    pusher.submit(registry)     # anything with collect(): a CollectorRegistry or a collector
    pusher.close()
"""

from __future__ import annotations

import collections
import logging
import os
import secrets
import socket
import threading
import time
import urllib.parse
from typing import Any, Callable, Mapping

from prometheus_client.exposition import basic_auth_handler, default_handler, push_to_gateway

log = logging.getLogger("flashwatch.exporters.prometheus")

__all__ = ["Pusher", "check_gateway_url", "new_run_id", "basic_auth"]


def check_gateway_url(url: Any) -> str:
    """``url`` if it is a Pushgateway address: ``http(s)://host[:port][/path]`` (or ``host:port``).

    Raises:
        ValueError: what is wrong and what is accepted.
    """
    accepted = "an http(s) address of a Pushgateway such as 'http://localhost:9091'"
    if not isinstance(url, str) or not url.strip():
        raise ValueError(f"pushgateway must be {accepted}, or None; got {url!r}")
    full = url if "://" in url else "http://" + url  # prometheus_client reads host:port as http
    try:
        parts = urllib.parse.urlsplit(full)
        port = parts.port  # raises on a port that is not a number in 0-65535
    except ValueError as exc:
        raise ValueError(f"pushgateway {url!r} is not a valid address ({exc}); expected {accepted}") from None
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"pushgateway {url!r}: scheme {parts.scheme!r} is not http or https; expected {accepted}")
    if not parts.hostname or any(c.isspace() for c in url):
        raise ValueError(f"pushgateway {url!r} names no host; expected {accepted}")
    if parts.query or parts.fragment or port == 0:
        raise ValueError(f"pushgateway {url!r}: no query, fragment or port 0 allowed; expected {accepted}")
    return url


def new_run_id() -> str:
    """A run id unique across concurrent runs: ``<host>-<pid>-<start time, UTC>-<6 random hex digits>``."""
    host = socket.gethostname().split(".")[0] or "host"
    return f"{host}-{os.getpid()}-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{secrets.token_hex(3)}"


def basic_auth(username: str, password: str) -> Callable:
    """A push handler that sends HTTP basic authentication (pass as ``push_handler=``)."""
    if not isinstance(username, str) or not isinstance(password, str):
        raise ValueError("basic_auth(username, password) takes two strings")

    def handler(url, method, timeout, headers, data):
        return basic_auth_handler(url, method, timeout, headers, data, username, password)

    return handler


class Pusher:
    """Push to a Pushgateway from a background thread.

    Args:
        url: the gateway (checked by :func:`check_gateway_url`).
        job: the ``job`` grouping label.
        grouping_key: further grouping labels.
        timeout_s: timeout of one push.
        handler: prometheus-client push handler (authentication, TLS); default plain HTTP.
        max_queue: pushes waiting at most; beyond it the oldest waiting one is dropped.
        close_timeout_s: longest ``close()`` waits for the queued pushes.
    """

    def __init__(self, url: str, *, job: str, grouping_key: Mapping[str, str] | None = None,
                 timeout_s: float = 5.0, handler: Callable | None = None, max_queue: int = 4,
                 close_timeout_s: float = 2.0) -> None:
        self.url = check_gateway_url(url)
        self.job = job
        self.grouping_key = dict(grouping_key or {})
        self.timeout_s = float(timeout_s)
        self.handler = handler or default_handler
        self.max_queue = int(max_queue)
        self.close_timeout_s = float(close_timeout_s)
        self.pushed = 0  # pushes the gateway accepted
        self.failed = 0  # pushes that raised (gateway down, refused, timed out)
        self.dropped = 0  # pushes dropped from a full queue (the gateway keeps the last push only)
        self.last_error: BaseException | None = None
        self._queue: collections.deque = collections.deque()
        self._cond = threading.Condition()
        self._busy = False
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="flashwatch-pushgateway", daemon=True)
        self._thread.start()

    def submit(self, collector: Any) -> None:
        """Queue a push of ``collector`` (anything with ``collect()``); never blocks on the network."""
        with self._cond:
            if self._closing:
                return
            while len(self._queue) >= self.max_queue:
                self._queue.popleft()
                self.dropped += 1
            self._queue.append(collector)
            self._cond.notify()

    def close(self, last: Any = None) -> bool:
        """Queue ``last`` (if given), then wait at most ``close_timeout_s`` for the queue to empty.

        Returns:
            True when every queued push was made (or failed) in time; False when some were left
            (they are dropped and counted; the thread ends with the process).
        """
        if last is not None:
            self.submit(last)
        deadline = time.monotonic() + self.close_timeout_s
        with self._cond:
            self._closing = True
            self._cond.notify_all()
            while self._queue or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    self.dropped += len(self._queue)
                    self._queue.clear()
                    log.warning("flashwatch: Pushgateway %s did not take the last push within %.3g s; "
                                "closing without it", self.url, self.close_timeout_s)
                    return False
                self._cond.wait(left)
        return True

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closing:
                    self._cond.wait()
                if not self._queue:
                    return
                item = self._queue.popleft()
                self._busy = True
            try:
                push_to_gateway(self.url, job=self.job, registry=item, grouping_key=self.grouping_key or None,
                                timeout=self.timeout_s, handler=self.handler)
            except Exception as exc:  # the network's failures are counted, never raised into training
                self.failed += 1
                self.last_error = exc
                if self.failed == 1:
                    log.warning("flashwatch: push to the Pushgateway %s failed (%s: %s); training goes on, "
                                "later failures are counted (exporter.push_failed)",
                                self.url, type(exc).__name__, exc)
                else:
                    log.debug("flashwatch: push to %s failed again: %r", self.url, exc)
            else:
                self.pushed += 1
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()
