"""Prometheus metrics: what the deliverer records, and the endpoint that serves it."""

from __future__ import annotations

import contextlib
import datetime as dt
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from io import StringIO
from typing import Any

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.core.management import call_command
from django.utils import timezone
from prometheus_client import REGISTRY

from django_federation_delivery import metrics, send
from django_federation_delivery.deliverer import Deliverer
from django_federation_delivery.models import DelivererHeartbeat, Delivery, Host, Lane

from .conftest import ROOT, Inbox, wait_until
from .keys import ALICE
from .operators import open_breaker, queue
from .test_webhooks_status import WEBHOOKS, configure


def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_attempts_are_counted_by_outcome_and_timed() -> None:
    delivered = sample("federation_delivery_attempts_total", outcome="delivered")
    retrying = sample("federation_delivery_attempts_total", outcome="retrying")
    timed = sample("federation_delivery_attempt_duration_seconds_count")
    fast = sample("federation_delivery_attempt_duration_seconds_bucket", le="0.1")
    metrics.record_attempt("delivered", 0.08)
    metrics.record_attempt("delivered", 0.3)
    metrics.record_attempt("retrying", 12.0)
    assert sample("federation_delivery_attempts_total", outcome="delivered") == delivered + 2
    assert sample("federation_delivery_attempts_total", outcome="retrying") == retrying + 1
    assert sample("federation_delivery_attempt_duration_seconds_count") == timed + 3
    assert sample("federation_delivery_attempt_duration_seconds_bucket", le="0.1") == fast + 1


@pytest.mark.parametrize(
    ("status", "requests", "reason"),
    [
        (None, 1, "no_answer"),
        (429, 1, "status_429"),
        (410, 2, "status_4xx"),
        (503, 1, "status_5xx"),
        (302, 1, "status_other"),
        (None, 0, "not_sent"),
    ],
)
def test_an_attempt_that_did_not_deliver_is_counted_by_why(
    status: int | None, requests: int, reason: str
) -> None:
    def failures() -> float:
        return sum(
            sample("federation_delivery_failed_attempts_total", reason=r) for r in metrics.REASONS
        )

    before = sample("federation_delivery_failed_attempts_total", reason=reason)
    metrics.record_attempt("retrying", 1.0, status=status, requests=requests)
    assert sample("federation_delivery_failed_attempts_total", reason=reason) == before + 1
    total = failures()
    metrics.record_attempt("delivered", 0.1, status=202)
    metrics.record_attempt("held", 0.0, status=None, requests=0)
    assert failures() == total, "delivered and held attempts are no failures"


def test_an_attempt_that_made_no_request_is_counted_but_not_timed() -> None:
    held = sample("federation_delivery_attempts_total", outcome="held")
    failed = sample("federation_delivery_attempts_total", outcome="failed")
    timed = sample("federation_delivery_attempt_duration_seconds_count")
    # A breaker's hold, and a sender's key that could not be read: no request.
    metrics.record_attempt("held", 0.0, requests=0)
    metrics.record_attempt("failed", 0.001, requests=0)
    assert sample("federation_delivery_attempts_total", outcome="held") == held + 1
    assert sample("federation_delivery_attempts_total", outcome="failed") == failed + 1
    assert sample("federation_delivery_attempt_duration_seconds_count") == timed
    # A webhook destination answering 410 Gone: its event is held, the request timed.
    metrics.record_attempt("held", 0.4, status=410)
    assert sample("federation_delivery_attempt_duration_seconds_count") == timed + 1


def test_every_outcome_is_exposed_from_the_start() -> None:
    for outcome in metrics.OUTCOMES:
        assert (
            REGISTRY.get_sample_value("federation_delivery_attempts_total", {"outcome": outcome})
            is not None
        )


def test_an_unknown_outcome_is_an_error_not_a_new_series() -> None:
    with pytest.raises(ValueError, match="unknown outcome 'deliverd'"):
        metrics.record_attempt("deliverd", 0.1)
    assert (
        REGISTRY.get_sample_value("federation_delivery_attempts_total", {"outcome": "deliverd"})
        is None
    )


def test_the_gauges_are_set() -> None:
    metrics.set_lag(12.5)
    metrics.set_open_breakers(3)
    assert sample("federation_delivery_lag_seconds") == 12.5
    assert sample("federation_delivery_open_breakers") == 3
    metrics.set_lag(-1)  # a clock step: never negative
    assert sample("federation_delivery_lag_seconds") == 0


@pytest.mark.django_db
def test_observe_queue_reads_the_gauges_from_the_database() -> None:
    queue()
    first = Delivery.objects.order_by("id")[0]
    Delivery.objects.filter(pk=first.pk).update(due_at=timezone.now() - dt.timedelta(minutes=2))
    open_breaker("a.example")
    open_breaker("https://b.example/inbox")
    metrics.observe_queue()
    assert 120 <= sample("federation_delivery_lag_seconds") < 150
    assert sample("federation_delivery_open_breakers") == 2


@pytest.fixture
def endpoint() -> Iterator[str]:
    server = metrics.start_server(0, addr="127.0.0.1")
    yield f"http://127.0.0.1:{server.server_port}/metrics"
    server.shutdown()
    server.server_close()


def test_the_endpoint_serves_the_metrics(endpoint: str) -> None:
    metrics.record_attempt("refused", 0.2)
    metrics.set_open_breakers(1)
    with urllib.request.urlopen(endpoint, timeout=10) as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/plain")
        text = response.read().decode()
    assert 'federation_delivery_attempts_total{outcome="refused"}' in text
    assert "# TYPE federation_delivery_attempt_duration_seconds histogram" in text
    assert "federation_delivery_lag_seconds " in text
    assert "federation_delivery_open_breakers 1.0" in text


@pytest.mark.slow
def test_clients_that_send_half_a_request_hold_a_bounded_few_threads_for_a_while(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # With --metrics-addr 0.0.0.0, anyone who reaches the port held a thread
    # of the deliverer's for each connection that sent half a request, for
    # as long as it liked: 50 connections, 50 threads, all there 15 s on.
    # Long enough that none is let go (and its place taken by a later one,
    # both counted a moment) before they are counted, on a busy machine.
    monkeypatch.setattr(metrics, "CLIENT_TIMEOUT", 3.0)
    server = metrics.start_server(0, addr="127.0.0.1")

    # Its request threads only: one of an earlier test's inbox, answering a
    # connection kept alive, is named as they are.
    earlier = set(threading.enumerate())

    def answering() -> int:
        return sum(
            "process_request" in thread.name and thread not in earlier
            for thread in threading.enumerate()
        )

    held = []
    try:
        for _ in range(50):
            client = socket.create_connection(("127.0.0.1", server.server_port), timeout=5)
            client.sendall(b"GET /metrics HTTP/1.1\r\n")  # and never the rest
            held.append(client)
        time.sleep(0.5)
        assert 0 < answering() <= metrics.MOST_CLIENTS
        # Each let go once it has sent nothing more for CLIENT_TIMEOUT.
        wait_until(lambda: answering() == 0, timeout=15)
        url = f"http://127.0.0.1:{server.server_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as response:
            assert response.status == 200
    finally:
        for client in held:
            client.close()
        server.shutdown()
        server.server_close()


def test_clients_that_trickle_half_a_request_are_let_go_all_the_same(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A byte of a header every 0.3 s, each within CLIENT_TIMEOUT: the
    # MOST_CLIENTS such connections were never let go, every scrape refused.
    monkeypatch.setattr(metrics, "CLIENT_TIMEOUT", 2.0)
    server = metrics.start_server(0, addr="127.0.0.1")
    stop = threading.Event()
    held: list[socket.socket] = []

    def trickle() -> None:
        while not stop.wait(0.3):
            for client in list(held):
                with contextlib.suppress(OSError):
                    client.sendall(b"a")

    threading.Thread(target=trickle, daemon=True).start()
    try:
        for _ in range(metrics.MOST_CLIENTS):
            client = socket.create_connection(("127.0.0.1", server.server_port), timeout=5)
            client.sendall(b"GET /metrics HTTP/1.1\r\nX-Slow: ")
            held.append(client)
        time.sleep(3 * metrics.CLIENT_TIMEOUT)
        url = f"http://127.0.0.1:{server.server_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as response:
            assert response.status == 200
    finally:
        stop.set()
        for client in held:
            client.close()
        metrics.stop_server(server)


@pytest.mark.django_db(transaction=True)
def test_a_drain_serving_metrics_lets_its_port_go_when_it_returns() -> None:
    # Run again in the process (a periodic job), a drain was refused its
    # port: "Address already in use", the first still serving.
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = int(probe.getsockname()[1])
    for _ in range(2):
        call_command("run_deliverer", "--drain", f"--metrics-port={port}", stdout=StringIO())
        with socket.socket() as probe:
            assert probe.connect_ex(("127.0.0.1", port)) != 0, "still served"


@pytest.mark.django_db(transaction=True)
def test_an_answer_that_disables_a_destination_is_counted_among_the_failures(
    inboxes: Any, start_deliverer: Any, settings: Any
) -> None:
    # A 410 is held (the destination disabled) after its request: counted as
    # an attempt and timed, but among the failures by reason it was not.
    from django_federation_delivery import send_webhook

    from .test_webhooks_deliveries import configure as configure_signed
    from .test_webhooks_deliveries import signed

    receiver = inboxes("127.0.0.1", respond=lambda request: (410, {}, b"hook deleted"))
    configure_signed(settings, {"ops": signed(receiver)})
    send_webhook("ops", "alert.raised", {"n": 1})
    failed = sample("federation_delivery_failed_attempts_total", reason="status_4xx")
    held = sample("federation_delivery_attempts_total", outcome="held")
    runner = start_deliverer()
    wait_until(lambda: Delivery.objects.filter(last_status=410).exists())
    runner.stop()
    assert sample("federation_delivery_attempts_total", outcome="held") == held + 1
    assert sample("federation_delivery_failed_attempts_total", reason="status_4xx") == failed + 1


def test_the_endpoint_listens_on_this_machine_only_by_default() -> None:
    server = metrics.start_server(0)
    try:
        assert server.server_address[0] == "127.0.0.1"
    finally:
        server.shutdown()
        server.server_close()


def test_without_prometheus_client_recording_does_nothing_and_serving_says_why() -> None:
    # A fresh interpreter in which prometheus_client cannot be imported.
    script = "\n".join(
        [
            "import sys",
            "sys.modules['prometheus_client'] = None",
            "from django_federation_delivery import metrics",
            "assert not metrics.available()",
            "metrics.record_attempt('delivered', 0.1)",
            "metrics.set_lag(1.0)",
            "metrics.set_open_breakers(1)",
            "metrics.observe_queue()",
            "try:",
            "    metrics.start_server(0)",
            "except Exception as exc:",
            "    print(type(exc).__name__, exc)",
        ]
    )
    result = subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert result.stdout.strip() == (
        "ImproperlyConfigured Serving metrics needs prometheus_client: "
        "pip install 'django-federation-delivery[prometheus]'."
    )


def test_the_error_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(metrics, "prometheus_client", None)
    with pytest.raises(ImproperlyConfigured, match=r"django-federation-delivery\[prometheus\]"):
        metrics.start_server(0)


def heartbeat(seen_ago: float, interval: float = 5.0) -> None:
    now = timezone.now()
    DelivererHeartbeat.objects.create(
        host="worker-1",
        pid=1000 + int(seen_ago),
        started_at=now - dt.timedelta(hours=1),
        last_seen=now - dt.timedelta(seconds=seen_ago),
        interval=interval,
    )


@pytest.mark.django_db
def test_observe_queue_reads_each_lane_the_deliverers_hosts_and_destinations(
    settings: Any,
) -> None:
    configure(settings, {"ops": WEBHOOKS["ops"], "audit": WEBHOOKS["audit"]})
    now = timezone.now()
    queue(per_host=1)
    a, b = Delivery.objects.order_by("id")
    Delivery.objects.filter(pk=a.pk).update(lane=Lane.NORMAL, due_at=now - dt.timedelta(minutes=1))
    Delivery.objects.filter(pk=b.pk).update(lane=Lane.LOW, due_at=now - dt.timedelta(minutes=5))
    # Due later (a retry waiting), and held: neither is waited on.
    queue(("c.example",), per_host=1)
    queue(("d.example",), per_host=1)
    c, d = Delivery.objects.order_by("-id")[:2]
    Delivery.objects.filter(pk=c.pk).update(lane=Lane.PRIORITY, due_at=now + dt.timedelta(hours=1))
    Delivery.objects.filter(pk=d.pk).update(lane=Lane.PRIORITY, due_at=None)
    hour = dt.timedelta(hours=1)
    Host.objects.bulk_create(
        [
            Host(name="a.example", failing_since=now - dt.timedelta(minutes=10)),
            Host(name="b.example", failing_since=now - 2 * hour, failing_told_at=now - hour),
            Host(
                name="gone.example",
                failing_since=now - 200 * hour,
                failing_told_at=now - 199 * hour,
                unavailable_since=now - 30 * hour,
            ),
            Host(name="up.example"),
            # A destination's row, disabled: not a host.
            Host(
                name="<ops>",
                failing_since=now - 130 * hour,
                paused_at=now - 10 * hour,
                disabled_reason="no success for 5 days",
            ),
            # Disabled, then taken out of the settings: it has no series.
            Host(name="<chat>", paused_at=now - hour, disabled_reason="410 Gone"),
        ]
    )
    heartbeat(seen_ago=2)
    heartbeat(seen_ago=600)  # dead
    before = time.time()
    metrics.observe_queue()
    assert sample("federation_delivery_lane_lag_seconds", lane="webhook") == 0
    assert sample("federation_delivery_lane_lag_seconds", lane="priority") == 0
    assert 60 <= sample("federation_delivery_lane_lag_seconds", lane="normal") < 90
    assert 300 <= sample("federation_delivery_lane_lag_seconds", lane="low") < 330
    assert sample("federation_delivery_lag_seconds") == sample(
        "federation_delivery_lane_lag_seconds", lane="low"
    )
    assert sample("federation_delivery_deliverers_alive") == 1
    assert sample("federation_delivery_hosts_failing") == 2
    assert sample("federation_delivery_hosts_told_failing") == 1
    assert sample("federation_delivery_hosts_unavailable") == 1
    assert sample("federation_delivery_webhook_destination_disabled", destination="ops") == 1
    assert (
        REGISTRY.get_sample_value(
            "federation_delivery_webhook_destination_disabled", {"destination": "audit"}
        )
        == 0
    )
    assert (
        REGISTRY.get_sample_value(
            "federation_delivery_webhook_destination_disabled", {"destination": "chat"}
        )
        is None
    )
    assert before <= sample("federation_delivery_gauges_refreshed_timestamp_seconds") <= time.time()


@pytest.mark.django_db
def test_a_destination_taken_out_of_the_settings_loses_its_series(settings: Any) -> None:
    configure(settings, {"ops": WEBHOOKS["ops"], "audit": WEBHOOKS["audit"]})
    metrics.observe_queue()
    configure(settings, {"ops": WEBHOOKS["ops"]})
    metrics.observe_queue()
    found = {
        sample.labels["destination"]
        for family in REGISTRY.collect()
        if family.name == "federation_delivery_webhook_destination_disabled"
        for sample in family.samples
    }
    assert found == {"ops"}


@pytest.mark.django_db
def test_the_gauges_cost_the_same_few_queries_whatever_the_queue(
    settings: Any, django_assert_num_queries: Any
) -> None:
    # One a lane, the breakers, the heartbeats (and their live rows, when
    # any beat in the last day), the hosts; the destinations' rows when some
    # are configured.
    with django_assert_num_queries(7):
        metrics.read_queue()
    configure(settings, WEBHOOKS)
    queue(per_host=50)
    Host.objects.bulk_create(
        Host(name=f"h{n}.example", failing_since=timezone.now()) for n in range(50)
    )
    heartbeat(seen_ago=1)
    with django_assert_num_queries(9):
        reading = metrics.read_queue()
    assert reading.hosts_failing == 50
    assert reading.destinations_disabled == {"audit": False, "chat": False, "ops": False}


@pytest.mark.django_db(transaction=True)
def test_an_attempt_that_crashed_is_not_timed_at_nought(
    inbox: Inbox, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The dashboard's "Attempt duration" (median, p95, mean) is of attempts
    # that made a request: one whose code raised is timed at 0 s, whatever
    # it took, and drags every figure down.
    from django_federation_delivery.inboxes import InboxDeliveries

    def raising(self: Any, job: Any, transport: Any) -> Any:
        time.sleep(0.3)  # it took a while, then raised
        raise RuntimeError("a bug")

    monkeypatch.setattr(InboxDeliveries, "attempt", raising)
    timed = sample("federation_delivery_attempt_duration_seconds_count")
    fast = sample("federation_delivery_attempt_duration_seconds_bucket", le="0.05")
    retrying = sample("federation_delivery_attempts_total", outcome="retrying")
    send(ALICE, {"type": "Create", "actor": ALICE}, [inbox.url()])
    Deliverer().run(drain=True)
    assert sample("federation_delivery_attempts_total", outcome="retrying") == retrying + 1
    observed = sample("federation_delivery_attempt_duration_seconds_count") - timed
    at_nought = sample("federation_delivery_attempt_duration_seconds_bucket", le="0.05") - fast
    assert not (observed == 1 and at_nought == 1), (
        "an attempt that raised after 0.3 s was timed in the 0.05 s bucket"
    )
