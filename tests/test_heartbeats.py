"""Heartbeats: a deliverer that records itself, ages out when killed, and is
marked stopped when it stops."""

from __future__ import annotations

import datetime as dt
import itertools
import os
import socket
import threading
from collections.abc import Callable
from typing import Any

import pytest
from django.db import OperationalError
from django.utils import timezone

from django_federation_delivery import __version__, heartbeats, send
from django_federation_delivery.heartbeats import Heartbeat, Seen
from django_federation_delivery.models import DelivererHeartbeat, Delivery, Status
from django_federation_delivery.overview import stalled

from .conftest import Inbox, RunningDeliverer, wait_until
from .keys import ALICE

pytestmark = pytest.mark.django_db(transaction=True)

NOTE = {"type": "Create", "actor": ALICE}
SECOND = dt.timedelta(seconds=1)


@pytest.fixture
def every_second(settings: Any) -> None:
    settings.FEDERATION_DELIVERY = {**settings.FEDERATION_DELIVERY, "HEARTBEAT_SECONDS": 1.0}


@pytest.fixture
def beats(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The monotonic times every heartbeat was begun at, as they are."""
    import time

    written: list[float] = []
    beat = Heartbeat.beat

    def counted(self: Heartbeat, **kwargs: Any) -> None:
        written.append(time.monotonic())
        beat(self, **kwargs)

    monkeypatch.setattr(Heartbeat, "beat", counted)
    return written


def row(
    seconds_ago: float, *, interval: float = 5.0, pid: int = 4242, host: str = "old.host"
) -> Any:
    seen = timezone.now() - seconds_ago * SECOND
    return DelivererHeartbeat.objects.create(
        host=host,
        pid=pid,
        version="0.1",
        started_at=seen - 3600 * SECOND,
        last_seen=seen,
        interval=interval,
    )


# The writer.


@pytest.mark.slow
@pytest.mark.usefixtures("every_second")
def test_a_deliverer_beats_at_its_interval_idle_or_busy_and_marks_its_row_when_it_stops(
    inbox: Inbox, start_deliverer: Callable[..., RunningDeliverer], beats: list[float]
) -> None:
    running = start_deliverer(heartbeat=True)
    wait_until(lambda: DelivererHeartbeat.objects.exists())
    [found] = DelivererHeartbeat.objects.all()
    assert (found.host, found.pid, found.version) == (
        socket.gethostname(),
        os.getpid(),
        __version__,
    )
    assert found.interval == 1.0
    first_seen = found.last_seen
    # Idle (nothing is due): it beats all the same, on PostgreSQL's LISTEN too.
    wait_until(lambda: len(beats) >= 3, timeout=30)
    send(ALICE, NOTE, [inbox.url(f"/{n}") for n in range(5)])
    wait_until(lambda: Delivery.objects.filter(status=Status.DELIVERED).count() == 5)
    wait_until(lambda: len(beats) >= 5, timeout=30)
    assert DelivererHeartbeat.objects.get().last_seen > first_seen, "one row, brought up to date"
    before_stop = timezone.now()
    running.stop()
    # Never more than one a second, however many rounds the loop made.
    gaps = [later - earlier for earlier, later in itertools.pairwise(beats)]
    assert min(gaps) >= 1.0, gaps
    # A clean stop: no longer alive, and seen last at the stop.
    [stopped] = DelivererHeartbeat.objects.all()
    assert (stopped.interval, stopped.in_flight) == (0.0, 0)
    found = heartbeats.seen()
    assert found.live == () and found.last_seen == stopped.last_seen >= before_stop


def test_a_deliverer_made_in_code_records_no_heartbeat_unless_asked(
    inbox: Inbox, start_deliverer: Callable[..., RunningDeliverer]
) -> None:
    running = start_deliverer()
    send(ALICE, NOTE, [inbox.url("/1")])
    wait_until(lambda: Delivery.objects.filter(status=Status.DELIVERED).exists())
    running.stop()
    assert not DelivererHeartbeat.objects.exists()


@pytest.mark.usefixtures("every_second")
def test_a_heartbeat_the_database_refuses_does_not_stop_the_loop(
    inbox: Inbox,
    start_deliverer: Callable[..., RunningDeliverer],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    refused = threading.Event()
    beat = Heartbeat.beat

    def once_refused(self: Heartbeat, **kwargs: Any) -> None:
        if not refused.is_set():
            refused.set()
            self.next_at = 0.0  # as beat() does first: the next one at its interval
            raise OperationalError("the database is away")
        beat(self, **kwargs)

    monkeypatch.setattr(Heartbeat, "beat", once_refused)
    running = start_deliverer(heartbeat=True)
    wait_until(refused.is_set)
    send(ALICE, NOTE, [inbox.url("/1")])
    wait_until(lambda: Delivery.objects.filter(status=Status.DELIVERED).exists())
    wait_until(lambda: DelivererHeartbeat.objects.exists())
    running.stop()
    assert heartbeats.seen().live == ()


def test_a_beat_records_what_is_in_flight_and_the_rate_since_the_last() -> None:
    heartbeat = Heartbeat(5.0)
    heartbeat.beat(in_flight=3, delivered=0)
    [found] = DelivererHeartbeat.objects.all()
    assert (found.in_flight, found.rate) == (3, 0.0)
    heartbeat._counted_at -= 2.0  # two seconds since that beat
    heartbeat.beat(in_flight=1, delivered=10)
    found.refresh_from_db()
    assert found.in_flight == 1
    assert 4.0 <= found.rate <= 5.0
    assert DelivererHeartbeat.objects.count() == 1, "an UPDATE, not a row a beat"


def test_a_row_deleted_meanwhile_is_written_again() -> None:
    heartbeat = Heartbeat(5.0)
    heartbeat.beat(in_flight=0, delivered=0)
    DelivererHeartbeat.objects.all().delete()
    heartbeat.beat(in_flight=0, delivered=0)
    assert DelivererHeartbeat.objects.count() == 1
    heartbeat.remove()
    assert DelivererHeartbeat.objects.get().interval == heartbeats.STOPPED


def test_an_insert_that_went_through_and_raised_is_found_again_not_written_twice(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from django.db.models import QuerySet

    create = QuerySet.create

    def answer_lost(self: QuerySet[Any], **fields: Any) -> Any:
        create(self, **fields)
        raise OperationalError("server closed the connection unexpectedly")

    heartbeat = Heartbeat(5.0)
    with monkeypatch.context() as patched:
        patched.setattr(QuerySet, "create", answer_lost)
        with pytest.raises(OperationalError):
            heartbeat.beat(in_flight=0, delivered=0)
    heartbeat.beat(in_flight=2, delivered=0)
    [found] = DelivererHeartbeat.objects.all()
    assert (found.in_flight, found.interval) == (2, 5.0)
    heartbeat.remove()
    assert DelivererHeartbeat.objects.get().interval == heartbeats.STOPPED


def test_a_deliverer_run_again_is_alive_again_in_its_one_row() -> None:
    heartbeat = Heartbeat(5.0)
    heartbeat.beat(in_flight=0, delivered=0)
    heartbeat.remove()
    heartbeat.begin()
    heartbeat.beat(in_flight=1, delivered=0)
    [found] = DelivererHeartbeat.objects.all()
    assert (found.interval, found.in_flight) == (5.0, 1)
    assert [d.pid for d in heartbeats.seen().live] == [os.getpid()]


def test_rows_a_day_old_are_deleted_by_the_next_deliverer_to_beat() -> None:
    forgotten = row(86400 + 60)
    dead = row(600, pid=4343)
    Heartbeat(5.0).beat(in_flight=0, delivered=0)
    pids = set(DelivererHeartbeat.objects.values_list("pid", flat=True))
    assert forgotten.pid not in pids
    assert pids == {dead.pid, os.getpid()}


# The reader.


def test_a_killed_deliverer_ages_out_after_three_of_its_intervals() -> None:
    alive = row(14, interval=5.0, pid=1)
    row(16, interval=5.0, pid=2)  # three intervals and a second: dead
    row(100, interval=60.0, pid=3)  # a slower one, still within its three
    found = heartbeats.seen()
    assert [deliverer.pid for deliverer in found.live] == [1, 3]
    assert found.last_seen == alive.last_seen


def test_a_daily_rounds_process_is_alive_for_three_of_its_periods_and_kept() -> None:
    # contrib.tasks' promise for a period of up to a day: dead three periods
    # after its last round. Its row was read, and deleted by any beat, once
    # a day old: the next day's round ten minutes late was a dead deliverer.
    daily = row(86400 + 600, interval=86400.0, pid=1)
    row(86400 + 600, interval=5.0, pid=2)  # a run_deliverer's, forgotten
    Heartbeat(5.0).beat(in_flight=0, delivered=0)
    assert set(DelivererHeartbeat.objects.values_list("pid", flat=True)) == {1, os.getpid()}
    assert {deliverer.pid for deliverer in heartbeats.seen().live} == {os.getpid(), daily.pid}


def test_with_use_tz_off_a_deliverer_killed_before_the_clock_goes_back_is_dead(
    settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # New York, 1 November 2026: 01:50 EDT is 05:50 UTC; 01:10 EST, the
    # repeated hour's second pass, is 06:10 UTC, twenty minutes later. Its
    # naive last beat, 01:50, was read as ahead of 01:10: alive, for an hour.
    settings.USE_TZ = False
    settings.TIME_ZONE = "America/New_York"
    monkeypatch.setattr(timezone, "now", lambda: dt.datetime(2026, 11, 1, 1, 50))
    Heartbeat(5.0).beat(in_flight=0, delivered=0)
    assert heartbeats.seen().alive == 1
    monkeypatch.setattr(timezone, "now", lambda: dt.datetime(2026, 11, 1, 1, 10, fold=1))
    found = heartbeats.seen()
    assert found.alive == 0
    assert heartbeats.seen(now=timezone.now()).alive == 0
    # Nor does the stall warning take it for one restarting.
    told = stalled(found, 3, timezone.now())
    assert told == "No deliverer seen for 20m 0s while 3 deliveries are due"


def test_a_beat_from_a_clock_an_hour_ahead_is_no_deliverer_nor_silences_the_stall() -> None:
    now = timezone.now()
    row(-3600, pid=1)
    found = heartbeats.seen(now=now)
    assert found.alive == 0
    assert stalled(found, 3, now) == (
        "No deliverer has been seen in the last day while 3 deliveries are due"
    )


def test_a_clean_stop_and_a_restart_within_a_minute_is_no_stall() -> None:
    from django_federation_delivery.overview import stalled

    beat = Heartbeat(5.0)
    beat.beat(in_flight=2, delivered=10)
    beat.remove()
    stop = DelivererHeartbeat.objects.get().last_seen
    found = heartbeats.seen()
    assert found == Seen(live=(), last_seen=stop)
    assert stalled(found, 3, stop + 59 * SECOND) == ""
    assert stalled(found, 3, stop + 61 * SECOND) == (
        "No deliverer seen for 1m 1s while 3 deliveries are due"
    )
    # The restart beats: alive, beside the row of the one stopped.
    row(0, pid=7)
    assert [d.pid for d in heartbeats.seen().live] == [7]


def test_a_start_deletes_its_machines_stopped_rows_and_keeps_the_rest() -> None:
    # A cron job running --drain each minute: one stopped row, not 1,440 a day.
    machine = socket.gethostname()[:255]
    for _ in range(3):
        run = Heartbeat(5.0)
        run.beat(in_flight=0, delivered=0)
        run.remove()
    (last_run,) = DelivererHeartbeat.objects.all()
    assert last_run.interval == heartbeats.STOPPED and last_run.pid == os.getpid()
    elsewhere = row(30, interval=heartbeats.STOPPED, host="other.host", pid=8)
    killed = row(30, host=machine, pid=9)  # not stopped: it ages out as before
    latest = Heartbeat(5.0)
    latest.beat(in_flight=0, delivered=0)
    assert set(DelivererHeartbeat.objects.values_list("pk", flat=True)) == {
        elsewhere.pk,
        killed.pk,
        latest.pk,
    }
    latest.beat(in_flight=1, delivered=1)  # later beats delete nothing
    assert DelivererHeartbeat.objects.count() == 3


def test_a_row_written_again_keeps_the_row_of_one_that_stopped_beside_it() -> None:
    # Two deliverers of one machine (--processes 2), the second stopped; the
    # first's row, deleted meanwhile, is written again: the second's stays.
    first, second = Heartbeat(5.0), Heartbeat(5.0)
    first.beat(in_flight=0, delivered=0)
    second.beat(in_flight=0, delivered=0)
    [stopped] = DelivererHeartbeat.objects.filter(pk=second.pk)
    second.remove()
    DelivererHeartbeat.objects.filter(pk=first.pk).delete()
    first.beat(in_flight=0, delivered=0)
    assert dict(DelivererHeartbeat.objects.values_list("pk", "interval")) == {
        first.pk: 5.0,
        stopped.pk: heartbeats.STOPPED,
    }


def test_this_host_counts_only_its_own_deliverers() -> None:
    row(1, host="a.host", pid=1)
    row(1, host="b.host", pid=2)
    assert [d.pid for d in heartbeats.seen(host="b.host").live] == [2]
    assert heartbeats.seen(host="c.host") == Seen(live=(), last_seen=None)


def test_a_beat_from_a_clock_ahead_hides_not_when_the_others_were_last_seen() -> None:
    # The latest beat of every row: a stopped one's from a clock an hour
    # ahead said none was seen in the last day, where one was 10 minutes ago.
    row(-3600, interval=heartbeats.STOPPED, pid=1)
    row(600, interval=10.0, pid=2)
    now = timezone.now()
    told = stalled(heartbeats.seen(now=now), 5, now)
    assert told == "No deliverer seen for 10m 0s while 5 deliveries are due"
