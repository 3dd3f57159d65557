"""A host's health: failing since when, and host_failing / host_recovered
sent once each way, however many attempts and deliverers see it."""

from __future__ import annotations

import datetime as dt
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from django.db import OperationalError, connection
from django.utils import timezone

from django_federation_delivery import (
    SenderKey,
    availability,
    health,
    mark_host_seen,
    send,
    send_batch,
    signals,
)
from django_federation_delivery.attempt import AttemptResult, Job, failed, held
from django_federation_delivery.availability import mark_unavailable
from django_federation_delivery.deliverer import Deliverer
from django_federation_delivery.dialect import aware_now
from django_federation_delivery.health import HostWatch
from django_federation_delivery.hoststats import HostStats
from django_federation_delivery.limits import HostLimits
from django_federation_delivery.models import Batch, Delivery, Host, Status
from django_federation_delivery.store import claims

from . import keys
from .conftest import Inbox, Received, RunningDeliverer, wait_until
from .keys import ALICE

HOST = "remote.example"
ROW = claims.Claimed(1, 1, f"https://{HOST}/inbox", HOST, 0, (), "t", 0.0)
JOB = Job(delivery_id=1)
T0 = dt.datetime(2026, 12, 4, 8, 0, tzinfo=dt.UTC)


def answered(status: int) -> AttemptResult:
    return AttemptResult(
        job=JOB,
        delivered=200 <= status < 300,
        status=status,
        error="" if status < 300 else f"the inbox answered {status}",
        permanent=False,
        retry_after=None,
        accepted_scheme=None,
        duration=0.05,
    )


@pytest.fixture
def told() -> Iterator[list[Any]]:
    heard: list[Any] = []

    def failing(sender: Any, failing: signals.HostFailing, **kwargs: Any) -> None:
        heard.append(failing)

    def recovered(sender: Any, recovered: signals.HostRecovered, **kwargs: Any) -> None:
        heard.append(recovered)

    signals.host_failing.connect(failing)
    signals.host_recovered.connect(recovered)
    yield heard
    signals.host_failing.disconnect(failing)
    signals.host_recovered.disconnect(recovered)


@pytest.mark.django_db(transaction=True)
def test_a_host_failing_for_long_enough_is_told_once_and_its_recovery_once(
    told: list[Any],
) -> None:
    watch = HostWatch(3600.0)
    timeout = failed(JOB, "timed out", permanent=False)
    assert watch(ROW, answered(503), T0) is False
    assert Host.objects.get(name=HOST).failing_since == T0
    watch(ROW, timeout, T0 + dt.timedelta(minutes=30))
    assert told == []
    for minutes in (60, 61, 90):
        watch(ROW, answered(429), T0 + dt.timedelta(minutes=minutes))
    assert told == [
        signals.HostFailing(host=HOST, failing_since=T0, error="the inbox answered 429")
    ]
    # A refusal is an answer: the host is up.
    watch(ROW, answered(404), T0 + dt.timedelta(minutes=95))
    assert told[1:] == [
        signals.HostRecovered(
            host=HOST, failing_since=T0, recovered_at=T0 + dt.timedelta(minutes=95)
        )
    ]
    host = Host.objects.get(name=HOST)
    assert host.failing_since is None and host.failing_told_at is None
    watch(ROW, answered(202), T0 + dt.timedelta(minutes=96))
    assert len(told) == 2


@pytest.mark.django_db(transaction=True)
def test_a_host_up_within_the_span_is_never_told_and_no_request_says_nothing(
    told: list[Any],
) -> None:
    watch = HostWatch(3600.0)
    watch(ROW, answered(500), T0)
    watch(ROW, answered(202), T0 + dt.timedelta(minutes=10))
    assert Host.objects.get(name=HOST).failing_since is None
    for minutes in (120, 240):
        watch(ROW, held(JOB, "its breaker is open", 60.0), T0 + dt.timedelta(minutes=minutes))
        watch(ROW, failed(JOB, "no key", permanent=True, requests=0), T0)
    assert told == [] and Host.objects.get(name=HOST).failing_since is None


@pytest.mark.django_db(transaction=True)
def test_two_deliverers_seeing_one_host_fail_tell_it_once(told: list[Any]) -> None:
    first, second = HostWatch(60.0), HostWatch(60.0)
    first(ROW, answered(503), T0)
    second(ROW, answered(503), T0 + dt.timedelta(seconds=30))
    first(ROW, answered(503), T0 + dt.timedelta(seconds=61))
    second(ROW, answered(503), T0 + dt.timedelta(seconds=62))
    assert [type(event) for event in told] == [signals.HostFailing]
    assert told[0].failing_since == T0, "the first failure any deliverer saw"


@pytest.mark.django_db(transaction=True)
def test_the_deliverer_tells_a_failing_host_and_its_recovery(
    inboxes: Callable[..., Inbox], settings: Any, told: list[Any]
) -> None:
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "HOST_FAILING_AFTER": 0.3,
        "RETRY": {"BASE": 0.1, "CAP": 0.2, "ATTEMPTS": 40, "JITTER": 0.0},
        "BREAKER": {},
    }
    down = threading.Event()
    down.set()

    def respond(request: Received) -> tuple[int, dict[str, str], bytes]:
        return (503, {}, b"") if down.is_set() else (202, {}, b"")

    inbox = inboxes("127.0.0.1", respond=respond)
    send(ALICE, {"type": "Note"}, [inbox.url()])
    deadline = timezone.now() + dt.timedelta(seconds=30)
    while not told and timezone.now() < deadline:
        Deliverer().run(stop_after=0.5)
    down.clear()
    while Delivery.objects.filter(status=Status.PENDING).exists() and timezone.now() < deadline:
        Deliverer().run(drain=True)
    host = inbox.host  # with its port: a port is another server
    assert [(type(event), event.host) for event in told] == [
        (signals.HostFailing, host),
        (signals.HostRecovered, host),
    ]
    assert told[0].error == "the inbox answered 503 Service Unavailable"


@pytest.mark.django_db(transaction=True)
def test_with_use_tz_off_a_failing_host_is_kept_failing_and_told_once(
    settings: Any, told: list[Any]
) -> None:
    # The loop's time is aware whatever USE_TZ says: handed to the ORM as it
    # is, SQLite's backend refused it; compared with the naive one read back,
    # on PostgreSQL, it raised. Each attempt's error was logged and dropped.
    settings.USE_TZ = False
    settings.TIME_ZONE = "America/Los_Angeles"
    now = aware_now()  # what the loop judges an attempt at (settling.py)
    HostWatch(3600.0)(ROW, answered(503), now)
    assert Host.objects.filter(name=HOST, failing_since__isnull=False).exists()
    # Another deliverer (or this one, restarted) sees it fail an hour on.
    HostWatch(3600.0)(ROW, answered(503), now + dt.timedelta(minutes=61))
    assert [type(event) for event in told] == [signals.HostFailing]
    assert told[0].failing_since == now and timezone.is_aware(told[0].failing_since)


@pytest.mark.django_db(transaction=True)
def test_with_use_tz_off_the_deliverer_tells_a_failing_host(
    inboxes: Callable[..., Inbox], settings: Any, told: list[Any], caplog: Any
) -> None:
    settings.USE_TZ = False
    settings.TIME_ZONE = "America/Los_Angeles"
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "HOST_FAILING_AFTER": 0.3,
        "RETRY": {"BASE": 0.05, "CAP": 0.1, "ATTEMPTS": 10_000, "JITTER": 0.0},
        "BREAKER": {},
    }
    inbox = inboxes("127.0.0.1", respond=lambda request: (503, {}, b""))
    send(ALICE, {"type": "Note"}, [inbox.url()])
    Deliverer().run(stop_after=2.0)
    assert len(inbox.received) > 3, "503 after 503, for several times HOST_FAILING_AFTER"
    raised = [r.getMessage() for r in caplog.records if "watch" in r.getMessage()]
    assert [type(event) for event in told] == [signals.HostFailing], raised[:1]


def kinds(told: list[Any]) -> list[str]:
    return [type(event).__name__ for event in list(told)]


@pytest.mark.django_db(transaction=True)
def test_a_host_seen_again_then_failing_again_is_told_failing_again(told: list[Any]) -> None:
    # The deliverer's memory once kept "failing since T0, told" for good: the
    # host, seen again, was never written failing again (so never marked
    # unavailable again) nor told failing again.
    watch = HostWatch(3600.0)  # one deliverer, running all along
    watch(ROW, answered(503), T0)
    watch(ROW, answered(503), T0 + dt.timedelta(minutes=61))
    assert kinds(told) == ["HostFailing"]
    assert mark_host_seen(HOST) is True  # the host project heard from it
    assert kinds(told) == ["HostFailing", "HostRecovered"]
    again = T0 + dt.timedelta(hours=5)
    watch(ROW, answered(503), again)
    assert Host.objects.get(name=HOST).failing_since == again, "failing again, since then"
    watch(ROW, answered(503), again + dt.timedelta(hours=2))
    assert kinds(told) == ["HostFailing", "HostRecovered", "HostFailing"]
    assert told[2].failing_since == again


@pytest.mark.django_db(transaction=True)
def test_a_running_deliverer_tells_a_host_failing_again_after_it_was_seen(
    inboxes: Callable[..., Inbox],
    start_deliverer: Callable[..., RunningDeliverer],
    settings: Any,
    told: list[Any],
) -> None:
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "HOST_FAILING_AFTER": 0.3,
        "RETRY": {"BASE": 0.05, "CAP": 0.1, "ATTEMPTS": 10_000, "JITTER": 0.0},
        "BREAKER": {},
    }
    inbox = inboxes("127.0.0.1", respond=lambda request: (503, {}, b""))
    send(ALICE, NOTE, [inbox.url()])
    runner = start_deliverer()
    wait_until(lambda: kinds(told) == ["HostFailing"])
    assert mark_host_seen(inbox.host) is True
    assert kinds(told) == ["HostFailing", "HostRecovered"]
    # Still answering 503: known within a second (a tenth of
    # HOST_FAILING_AFTER, a second at the least), failing again, told again.
    wait_until(
        lambda: len(told) >= 3,
        state=lambda: (kinds(told), Host.objects.values("failing_since").get(name=inbox.host)),
    )
    runner.stop()
    assert kinds(told) == ["HostFailing", "HostRecovered", "HostFailing"]


@pytest.mark.django_db(transaction=True)
def test_a_deliverer_tells_no_host_failing_that_another_saw_up_since_it_looked(
    told: list[Any],
) -> None:
    first, second = HostWatch(3600.0), HostWatch(3600.0)
    first(ROW, answered(503), T0)
    first(ROW, answered(503), T0 + dt.timedelta(minutes=59, seconds=30))  # it looks again
    second(ROW, answered(202), T0 + dt.timedelta(minutes=59, seconds=40))  # up: cleared
    assert Host.objects.get(name=HOST).failing_since is None
    # Read 36 s ago, its view has the host failing since T0: the table says
    # it was up since, and this failure is its first.
    late = T0 + dt.timedelta(minutes=60, seconds=6)
    first(ROW, answered(503), late)
    assert told == []
    assert Host.objects.get(name=HOST).failing_since == late


NOTE = {"type": "Create", "id": f"{ALICE}/activities/health", "actor": ALICE}


def one_503_then_answers_through_another(
    inboxes: Callable[..., Inbox], settings: Any, **limits: float
) -> tuple[Inbox, Deliverer]:
    """Two deliverers, both running. The second one sends first (elsewhere);
    then the first meets one 503 at the host; then, past ``limits``' spans,
    the host accepts all the second sends it. The second, returned."""
    settings.FEDERATION_DELIVERY = {**settings.FEDERATION_DELIVERY, **limits, "BREAKER": {}}
    status = [503]
    inbox = inboxes("127.0.0.1", respond=lambda request: (status[0], {}, b""))
    elsewhere = inboxes("127.0.0.2")
    first, second = Deliverer(), Deliverer()
    send(ALICE, NOTE, [elsewhere.url()])
    second.run(drain=True)  # it has been running a while: it read the failing hosts
    send_batch(ALICE, NOTE, [inbox.url()], {"max_attempts": 1})
    first.run(drain=True)  # one 503
    assert Host.objects.get(name=inbox.host).failing_since is not None
    time.sleep(max(limits.values()) + 0.2)
    status[0] = 202
    for n in range(3):
        send(ALICE, {**NOTE, "id": f"{NOTE['id']}/{n}"}, [inbox.url()])
    second.run(drain=True)
    assert len(inbox.received) == 4, "the host accepted the three just now"
    status[0] = 503
    return inbox, second


@pytest.mark.django_db(transaction=True)
def test_a_host_that_answered_through_another_deliverer_is_not_told_failing_at_one_failure(
    inboxes: Callable[..., Inbox], settings: Any, told: list[Any]
) -> None:
    # The second deliverer read the failing hosts once, before the first saw
    # this one fail: its successes never cleared it, and its next failure
    # told it failing since the first's old 503.
    inbox, second = one_503_then_answers_through_another(inboxes, settings, HOST_FAILING_AFTER=1.0)
    assert Host.objects.get(name=inbox.host).failing_since is None, "up: cleared"
    # One 503, a moment after three 202s: failing for no time at all.
    send_batch(ALICE, {**NOTE, "id": f"{NOTE['id']}/x"}, [inbox.url()], {"max_attempts": 1})
    second.run(drain=True)
    assert len(inbox.received) == 5
    assert told == [], "told failing since the first deliverer's 503, answered well since"


@pytest.mark.django_db(transaction=True)
def test_a_host_answering_well_through_another_deliverer_is_not_marked_unavailable(
    inboxes: Callable[..., Inbox], settings: Any
) -> None:
    inbox, _second = one_503_then_answers_through_another(
        inboxes, settings, HOST_FAILING_AFTER=1.0, HOST_UNAVAILABLE_AFTER=1.0
    )
    # The hourly upkeep: no success for HOST_UNAVAILABLE_AFTER? Three just now.
    assert mark_unavailable(1.0) == []
    assert send(ALICE, {**NOTE, "id": f"{NOTE['id']}/y"}, [inbox.url()]) is not None


ZOE = "https://social.example/users/zo\u00eb"


def unsignable_key(sender: str) -> SenderKey | None:
    if sender == ZOE:
        # A key id neither scheme can carry (not ASCII): no request is made.
        return SenderKey(f"{ZOE}#main-key", keys.rsa_key())
    return keys.sender_key(sender)


@pytest.mark.django_db(transaction=True)
def test_a_delivery_that_cannot_be_signed_says_nothing_of_its_host(
    inbox: Inbox, settings: Any, told: list[Any]
) -> None:
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "SENDER_KEYS": f"{__name__}.unsignable_key",
        "HOST_FAILING_AFTER": 0.001,
    }
    for n in range(2):
        send(ZOE, {"type": "Create", "id": f"{ZOE}/{n}", "actor": ZOE}, [inbox.url()])
        Deliverer().run(drain=True)
    assert inbox.received == [], "no request was made"
    assert set(Delivery.objects.values_list("status", flat=True)) == {Status.REFUSED}
    host = Host.objects.filter(name=inbox.host).first()
    assert host is None or (host.failing_since, host.last_error) == (None, "")
    assert told == [], "its host was never asked anything"


@pytest.mark.django_db
def test_an_operator_sees_since_when_a_host_fails() -> None:
    from .test_admin import html, login, url

    Host.objects.create(name=HOST, failing_since=T0)
    Host.objects.create(name="fine.example")
    listing = html(login("operator"), url("host"))
    assert '<td class="field-failing_since nowrap">Dec. 4, 2026, 8 a.m.</td>' in listing
    assert '<td class="field-failing_since nowrap">-</td>' in listing


Watch = Callable[[claims.Claimed, AttemptResult, dt.datetime], object]
OTHER = claims.Claimed(2, 2, "https://other.example/inbox", "other.example", 0, (), "t", 0.0)


def delivered_at(host: str, when: dt.datetime) -> None:
    """A deliverer's picture of the hosts, written: it delivered to ``host``
    at ``when``."""
    stats = HostStats(HostLimits(2, 8))
    stats.learn(host, answered(202), when)
    stats.write(now=when + dt.timedelta(seconds=5))


def delivered_by_another(
    first: Watch,
    second: Watch,
    row: claims.Claimed,
    failed_at: dt.datetime,
    *,
    view: claims.Claimed,
) -> dt.datetime:
    """run_deliverer --processes 2. The second reads what is failing (at an
    attempt at ``view``) a moment before the first meets one 503 at
    ``row``'s host; 20 s later the second delivers there, and writes it
    (last delivered) with its picture of the hosts, but its view (a minute
    old at most) does not have the host failing, so nothing is cleared.
    When it delivered."""
    second(view, answered(202), failed_at - dt.timedelta(seconds=10))
    first(row, answered(503), failed_at)
    delivered = failed_at + dt.timedelta(seconds=20)
    second(row, answered(202), delivered)
    delivered_at(row.host, delivered)
    host = Host.objects.get(name=row.host)
    assert host.last_delivered_at is not None and host.last_delivered_at > host.failing_since
    return delivered


@pytest.mark.django_db(transaction=True)
def test_a_host_delivered_to_by_another_deliverer_after_its_one_failure_is_not_told_failing(
    told: list[Any],
) -> None:
    # Two hours on, the next attempt there meets a 503: one failure after a
    # success, yet host_failing said "failing since" the first 503.
    first = HostWatch(3600.0)
    delivered = delivered_by_another(first, HostWatch(3600.0), ROW, T0, view=OTHER)
    first(ROW, answered(503), T0 + dt.timedelta(hours=2))
    assert told == [], (
        f"told failing since {told[0].failing_since:%H:%M:%S} though delivered to at "
        f"{delivered:%H:%M:%S}, and failing only since now"
    )


@pytest.mark.django_db(transaction=True)
def test_a_host_failing_without_a_break_after_another_deliverer_s_success_is_told_an_hour_on(
    told: list[Any],
) -> None:
    # From 30 s on every attempt meets a 503, ten minutes apart, seen by the
    # first deliverer and the second by turns. Its clock was restarted when
    # found an hour old (09:00:30): told failing two hours in, "since" an
    # hour after its failures began.
    first, second = HostWatch(3600.0), HostWatch(3600.0)
    delivered = delivered_by_another(first, second, ROW, T0, view=OTHER)
    at = T0 + dt.timedelta(seconds=30)
    while at < T0 + dt.timedelta(hours=1, minutes=40) and not told:
        watch = first if (at - T0) % dt.timedelta(minutes=20) < dt.timedelta(minutes=10) else second
        watch(ROW, answered(503), at)
        at += dt.timedelta(minutes=10)
    assert [type(signal) for signal in told] == [signals.HostFailing], (
        f"not told failing after 1 h 10 min of 503s; failing since "
        f"{Host.objects.get(name=HOST).failing_since}"
    )
    # Counted from the first failure after the success that either read of
    # the table (a minute apart at most) saw: never from before it.
    assert delivered < told[0].failing_since <= T0 + dt.timedelta(minutes=11)


@pytest.mark.django_db(transaction=True)
def test_a_read_racing_another_deliverer_does_not_clear_a_failure_begun_after_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Both read HOST as delivered to since it began failing; the second
    # clears it, then meets a 503 there: failing from now. The first, clearing
    # what it had read, wiped that new failure too.
    first, second = HostWatch(3600.0), HostWatch(3600.0)
    first(ROW, answered(503), T0)
    delivered_at(HOST, T0 + dt.timedelta(seconds=20))
    new_failure = T0 + dt.timedelta(minutes=5)
    read = health.failing_hosts

    def read_while_the_second_works(**kwargs: Any) -> Any:
        rows = read(**kwargs)
        monkeypatch.setattr(health, "failing_hosts", read)
        second(ROW, answered(503), new_failure)  # reads, clears, fails again
        return rows

    monkeypatch.setattr(health, "failing_hosts", read_while_the_second_works)
    first(OTHER, answered(202), new_failure + dt.timedelta(seconds=1))  # reads again
    assert Host.objects.get(name=HOST).failing_since == new_failure


@pytest.mark.skipif(
    connection.vendor != "postgresql",
    reason="PostgreSQL keeps the instant; SQLite's naive text cannot tell the two 01:50s",
)
@pytest.mark.django_db(transaction=True)
def test_with_use_tz_off_a_host_failing_after_the_clocks_go_back_is_told_failing(
    settings: Any, told: list[Any]
) -> None:
    # New York: delivered to at 01:50 EDT; the clocks go back; every attempt
    # from 01:10 EST, 20 minutes on, meets a 503. Each read of the failing
    # hosts compared the wall-clock times (01:50 > 01:10), found it up since,
    # and cleared it: never told failing.
    settings.USE_TZ = False
    settings.TIME_ZONE = "America/New_York"
    connection.close()  # its time zone as the settings now say
    began = dt.datetime(2026, 11, 1, 6, 10, tzinfo=dt.UTC)  # 01:10 EST
    delivered_at(HOST, began - dt.timedelta(minutes=20))  # 01:50 EDT
    watch = HostWatch(600.0)
    at = began
    while at < began + dt.timedelta(minutes=30) and not told:
        watch(ROW, answered(503), at)
        at += dt.timedelta(minutes=2)
    # The instant (told in the time zone, 01:10 with fold, never equal to
    # one in another zone: PEP 495).
    assert [(type(event), event.failing_since.timestamp()) for event in told] == [
        (signals.HostFailing, began.timestamp())
    ]


def _statuses(batch: Batch | None) -> list[str]:
    assert batch is not None
    return list(
        Delivery.objects.filter(batch=batch).order_by("id").values_list("status", flat=True)
    )


@pytest.mark.django_db(transaction=True)
def test_a_recovery_the_database_missed_for_a_moment_is_written_by_the_next_success(
    inbox: Inbox,
    start_deliverer: Callable[..., RunningDeliverer],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A host failing and told so answers again just as the database is
    # away for a moment: its next success writes the recovery. It did not:
    # the watch forgot the host before the write, so no later success wrote
    # it, host_recovered was never sent, and in time the host was marked
    # unavailable.
    now = timezone.now()
    Host.objects.create(
        name=inbox.host,
        failing_since=now - dt.timedelta(hours=3),
        failing_told_at=now - dt.timedelta(hours=2),
    )
    real = availability.seen
    blinked: list[str] = []

    def seen(host: str, **kwargs: Any) -> Any:
        if not blinked:
            blinked.append(host)
            raise OperationalError("server closed the connection unexpectedly")
        return real(host, **kwargs)

    monkeypatch.setattr(availability, "seen", seen)
    heard: list[Any] = []

    def recovered(sender: Any, recovered: signals.HostRecovered, **kwargs: Any) -> None:
        heard.append(recovered.host)

    signals.host_recovered.connect(recovered, weak=False)
    try:
        runner = start_deliverer()
        first = send(ALICE, NOTE, [inbox.url("/1")])
        wait_until(lambda: _statuses(first) == [Status.DELIVERED], timeout=15)
        assert blinked == [inbox.host]
        # The database is back: the next deliveries there succeed too.
        for n in range(2, 5):
            sent = send(ALICE, NOTE, [inbox.url(f"/{n}")])
            wait_until(lambda: _statuses(sent) == [Status.DELIVERED], timeout=15)  # noqa: B023
        runner.stop()
    finally:
        signals.host_recovered.disconnect(recovered)
    host = Host.objects.get(name=inbox.host)
    assert (host.failing_since, host.failing_told_at, heard) == (None, None, [inbox.host]), (
        f"after 4 deliveries accepted, the host is still failing since {host.failing_since}, "
        f"host_recovered told for {heard}"
    )


@pytest.mark.django_db(transaction=True)
def test_a_moment_s_outage_met_by_the_host_watch_is_one_warning_not_an_error_traceback(
    inbox: Inbox, caplog: pytest.LogCaptureFixture
) -> None:
    # The watch of a host's health reads and writes the database outside the
    # loop's runner: an outage met there is a warning, as the loop's are. It
    # was an ERROR with a traceback, as a bug in a host project's callable
    # is, for each attempt that met it.
    batch = send(ALICE, NOTE, [inbox.url(f"/{n}") for n in range(3)])
    failed: list[str] = []

    def away_once(execute: Callable[..., Any], sql: str, *args: Any) -> Any:
        if not failed and "failing_told_at" in sql and "IS NOT NULL" in sql:
            failed.append(sql)
            raise OperationalError("server closed the connection unexpectedly")
        return execute(sql, *args)

    with (
        connection.execute_wrapper(away_once),
        caplog.at_level(logging.WARNING, logger="django_federation_delivery"),
    ):
        summary = Deliverer().run(drain=True, stop_after=20)
    assert failed, "the database went away as the watch read the failing hosts"
    assert summary.delivered == 3
    assert _statuses(batch) == [Status.DELIVERED] * 3
    errors = [
        (record.levelname, record.getMessage(), bool(record.exc_info))
        for record in caplog.records
        if record.levelno >= logging.ERROR
    ]
    assert not errors, f"a moment's outage logged as {errors}"
