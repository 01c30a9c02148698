"""The Prometheus exporter beside the training run: pushes off the training thread, one group per
run, checked addresses, authentication; an application's own registry; build info and the last
step's timestamp."""

from __future__ import annotations

import base64
import http.server
import socket
import threading
import time

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from flashwatch import __version__
from flashwatch.exporters.prometheus import PrometheusExporter
from flashwatch.exporters.pushgateway import basic_auth
from flashwatch.exporters.testing import synthetic_layout, synthetic_record

LAYOUT = synthetic_layout(num_layers=2, num_heads=3)


@pytest.fixture
def silent_gateway():
    """A TCP server that accepts every connection and never answers (a hung Pushgateway)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    accepted, stop = [], threading.Event()

    def accept():
        server.settimeout(0.1)
        while not stop.is_set():
            try:
                accepted.append(server.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.getsockname()[1]}", accepted
    stop.set()
    thread.join(5)
    for conn in accepted:
        conn.close()
    server.close()


@pytest.fixture
def gateway():
    """A Pushgateway stand-in that records (path, headers, body) of every push."""
    received = []

    class Gateway(http.server.BaseHTTPRequestHandler):
        def do_PUT(self):
            body = self.rfile.read(int(self.headers["Content-Length"]))
            received.append((self.path, dict(self.headers), body.decode()))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Gateway)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}", received
    server.shutdown()
    server.server_close()


def families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def test_a_gateway_that_never_answers_does_not_stall_the_training_thread(silent_gateway, caplog):
    url, accepted = silent_gateway
    exporter = PrometheusExporter(port=None, pushgateway=url, push_timeout_s=30, push_close_timeout_s=0.5)
    exporter.open(LAYOUT)
    records = [synthetic_record(LAYOUT, step=s) for s in range(20)]
    start = time.monotonic()
    for record in records:
        exporter.export(record)  # every step pushes (push_interval_s=0)
    exporting = time.monotonic() - start
    start = time.monotonic()
    exporter.close()
    closing = time.monotonic() - start
    assert exporting < 1.0, f"20 exports took {exporting:.2f} s with a silent gateway"
    assert closing < 2.0, f"close() took {closing:.2f} s (bounded at 0.5 s)"
    deadline = time.monotonic() + 5
    while not accepted and time.monotonic() < deadline:
        time.sleep(0.01)
    assert accepted, "no push reached the gateway"
    # the first push hangs; the others wait in the bounded queue, the oldest dropped and counted
    assert exporter.pushed == 0 and exporter.push_dropped >= 20 - 4 - 1
    assert "did not take the last push" in caplog.text


def test_pushes_and_failures_are_counted(gateway):
    url, received = gateway
    exporter = PrometheusExporter(port=None, pushgateway=url)
    exporter.open(LAYOUT)
    exporter.export(synthetic_record(LAYOUT, step=1))
    exporter.close()
    assert exporter.pushed >= 1 and exporter.push_failed == 0
    assert families(received[-1][2])["flashwatch_step"].samples[0].value == 1  # the last state, last

    refused = socket.socket()
    refused.bind(("127.0.0.1", 0))  # bound, not listening: connection refused
    try:
        down = PrometheusExporter(port=None, pushgateway=f"http://127.0.0.1:{refused.getsockname()[1]}")
        down.open(LAYOUT)
        down.export(synthetic_record(LAYOUT, step=1))  # never raises into training
        down.close()
    finally:
        refused.close()
    assert down.push_failed >= 1 and down.pushed == 0


def test_concurrent_runs_push_to_groups_of_their_own(gateway):
    url, received = gateway
    runs = [PrometheusExporter(port=None, pushgateway=url) for _ in range(2)]
    assert runs[0].run_id != runs[1].run_id
    for i, exporter in enumerate(runs):
        exporter.open(LAYOUT)
        exporter.export(synthetic_record(LAYOUT, step=10 + i))
    for exporter in runs:
        exporter.close()
    paths = {path for path, _, _ in received}
    assert paths == {f"/metrics/job/flashwatch/instance/{e.run_id}/run/{e.run_id}" for e in runs}  # keys sorted
    named = PrometheusExporter(port=None, pushgateway=url, run_id="exp-17")
    assert named.grouping_key == {"run": "exp-17", "instance": "exp-17"}


def test_a_pushing_run_serves_nothing_unless_a_port_is_named_and_its_last_push_holds_no_alert(gateway):
    """A batch job that pushes binds no port by default (concurrent jobs on one host would collide
    on 9400); its last push, at close(), leaves out flashwatch_alert_active, so that the gateway
    does not keep an ended run's alerts firing; the counts stay."""
    url, received = gateway
    exporter = PrometheusExporter(pushgateway=url)
    assert exporter.requested_port is None
    exporter.open(LAYOUT)
    assert exporter.port is None
    record = synthetic_record(LAYOUT, step=3)
    record.snapshot["flashwatch_alert_active"] = {("max_logit", 0, 1): 1.0}
    exporter.export(record)
    exporter.close()
    during, last = families(received[0][2]), families(received[-1][2])
    assert len(received) == 2 and "flashwatch_alert_active" in during
    assert "flashwatch_alert_active" not in last and "flashwatch_alerts" in last
    assert last["flashwatch_step"].samples[0].value == 3
    assert PrometheusExporter().requested_port == 9400  # serving, without a gateway


def test_push_handler_authenticates(gateway):
    url, received = gateway
    exporter = PrometheusExporter(port=None, pushgateway=url, push_handler=basic_auth("trainer", "s3cret"))
    exporter.open(LAYOUT)
    exporter.export(synthetic_record(LAYOUT, step=3))
    exporter.close()
    assert received and all(h.get("Authorization") == "Basic " + base64.b64encode(b"trainer:s3cret").decode()
                            for _, h, _ in received)


def test_joins_an_applications_own_registry_and_leaves_it_at_close():
    app = CollectorRegistry()
    requests = Counter("app_requests", "Requests served.", registry=app)
    requests.inc()
    exporter = PrometheusExporter(port=None, registry=app)
    assert exporter.registry is app
    exporter.open(LAYOUT)
    exporter.export(synthetic_record(LAYOUT, step=7))
    served = families(generate_latest(app).decode())
    assert "app_requests" in served and served["flashwatch_step"].samples[0].value == 7
    assert "flashwatch_max_logit" in served
    exporter.close()
    after = families(generate_latest(app).decode())
    assert "app_requests" in after and not any(name.startswith("flashwatch_") for name in after)


def test_an_application_registry_that_holds_a_name_refuses_the_exporter_and_a_reopened_one_serves_again():
    """An application metric of one of flashwatch's names in the registry: the exporter is refused
    when made (prometheus_client's duplicate error), so /metrics never serves two families of one
    name (which Prometheus rejects); a second exporter on one registry likewise. Opened again after
    close() (a later fit), the exporter serves again. Fail before: both were accepted and /metrics
    held two flashwatch_loss families; after a reopen nothing of flashwatch was served."""
    app = CollectorRegistry()
    Gauge("flashwatch_loss", "The application's own loss.", registry=app)
    with pytest.raises(ValueError, match="Duplicated timeseries.*flashwatch_loss"):
        PrometheusExporter(port=None, registry=app)
    shared = CollectorRegistry()
    exporter = PrometheusExporter(port=None, registry=shared)
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        PrometheusExporter(port=None, registry=shared)
    for step in (3, 5):  # one run, closed, then another fit with the same exporter
        exporter.open(LAYOUT)
        exporter.export(synthetic_record(LAYOUT, step=step))
        assert families(generate_latest(shared).decode())["flashwatch_step"].samples[0].value == step
        exporter.close()
        assert not any(name.startswith("flashwatch_") for name in families(generate_latest(shared).decode()))
    exporter.close()  # twice: nothing to take out


def test_build_info_and_the_last_steps_timestamp():
    exporter = PrometheusExporter(port=None, const_labels={"rank": "0"})
    exporter.open(LAYOUT)
    before = families(exporter.render().decode())
    (info,) = before["flashwatch_build_info"].samples
    assert info.labels == {"version": __version__, "rank": "0"} and info.value == 1
    (started,) = before["flashwatch_last_step_timestamp_seconds"].samples  # no step yet: the start's time
    assert abs(started.value - time.time()) < 600 and started.labels == {"rank": "0"}
    record = synthetic_record(LAYOUT, step=4)
    record.time = 1764480001.25
    exporter.export(record)
    (stamp,) = families(exporter.render().decode())["flashwatch_last_step_timestamp_seconds"].samples
    assert stamp.value == 1764480001.25 and stamp.labels == {"rank": "0"}
    exporter.close()


def test_pushed_families_are_built_on_the_push_thread(gateway, monkeypatch):
    from flashwatch.exporters import prometheus_families

    built_on = []
    original = prometheus_families.build_families

    def recording(*args, **kwargs):
        built_on.append(threading.current_thread().name)
        return original(*args, **kwargs)

    monkeypatch.setattr(prometheus_families, "build_families", recording)
    url, received = gateway
    exporter = PrometheusExporter(port=None, pushgateway=url)
    exporter.open(LAYOUT)
    for step in range(3):
        exporter.export(synthetic_record(LAYOUT, step=step))
    exporter.close()
    assert received and built_on
    assert set(built_on) == {"flashwatch-pushgateway"}  # never on the training thread


def test_a_slow_scrape_does_not_hold_up_the_training_threads_export(monkeypatch):
    """A scrape builds the metric families (tens of ms for a model of many heads) without the lock the
    training thread's export() takes: an export during a scrape returns at once, and the scrape serves
    the state it started from. Fail before: export() waited for the whole build."""
    import time

    from flashwatch.exporters import prometheus_families

    original = prometheus_families.build_families
    building = threading.Event()

    def slow(*args, **kwargs):
        building.set()
        time.sleep(0.5)
        return original(*args, **kwargs)

    exporter = PrometheusExporter(port=None)
    exporter.open(LAYOUT)
    exporter.export(synthetic_record(LAYOUT, step=1))
    monkeypatch.setattr(prometheus_families, "build_families", slow)
    scraped = []
    scrape = threading.Thread(target=lambda: scraped.append(exporter.render().decode()))
    scrape.start()
    assert building.wait(5)
    t0 = time.perf_counter()
    exporter.export(synthetic_record(LAYOUT, step=2))
    waited = time.perf_counter() - t0
    scrape.join(5)
    assert waited < 0.25, waited
    assert families(scraped[0])["flashwatch_step"].samples[0].value == 1  # the state it started from
    monkeypatch.setattr(prometheus_families, "build_families", original)
    assert families(exporter.render().decode())["flashwatch_step"].samples[0].value == 2
    exporter.close()


def test_an_exporter_reopened_for_a_second_fit_pushes_again(gateway):
    url, received = gateway
    exporter = PrometheusExporter(port=None, pushgateway=url)
    for step in (1, 2):  # the Lightning callback reopens its exporters on a later fit
        exporter.open(LAYOUT)
        exporter.export(synthetic_record(LAYOUT, step=step))
        exporter.close()
    assert families(received[-1][2])["flashwatch_step"].samples[0].value == 2
    assert exporter.pushed == len(received) >= 2 and exporter.push_failed == 0


def test_prometheus_pushes_to_a_pushgateway(gateway):
    url, received = gateway
    exporter = PrometheusExporter(port=None, pushgateway=url, job="train", grouping_key={"run": "r1"},
                                  push_interval_s=3600)
    exporter.open(LAYOUT)
    exporter.export(synthetic_record(LAYOUT, step=5))
    exporter.export(synthetic_record(LAYOUT, step=6))  # within push_interval_s: not pushed
    exporter.close()  # the last state is always pushed
    assert [path for path, _, _ in received] == ["/metrics/job/train/run/r1"] * 2
    steps = [{f.name: f for f in text_string_to_metric_families(body)}["flashwatch_step"].samples[0].value
             for _, _, body in received]
    assert steps == [5, 6]
