"""The queue's history: recorded as deliveries settle, read back a minute or an hour a bucket."""

from __future__ import annotations

import base64
import datetime as dt
import logging
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.urls import reverse
from django.utils import timezone

from django_federation_delivery import history, retention, send, send_webhook, store
from django_federation_delivery.deliverer import Deliverer
from django_federation_delivery.models import Delivery, DeliveryHistory, Status

from .conftest import Inbox, Received, RunningDeliverer, wait_until
from .keys import ALICE

SECRET = "whsec_" + base64.b64encode(b"k" * 32).decode()
NOTE = {"@context": "https://www.w3.org/ns/activitystreams", "type": "Create", "actor": ALICE}
NOW = dt.datetime(2026, 3, 1, 12, 30, 40, tzinfo=dt.UTC)


def totals() -> dict[str, int]:
    rows = DeliveryHistory.objects.values_list(*history.COUNTS)
    return {name: sum(row[n] for row in rows) for n, name in enumerate(history.COUNTS)}


def inserts(captured: CaptureQueriesContext) -> list[str]:
    return [q["sql"] for q in captured.captured_queries if q["sql"].startswith("INSERT")]


# Recording.


@pytest.mark.django_db
def test_counts_are_added_to_their_minute_in_one_statement_for_all_the_minutes() -> None:
    history.record({NOW: {"delivered": 2}}, using=None)
    later = NOW + dt.timedelta(minutes=1)
    with CaptureQueriesContext(connection) as captured:
        history.record(
            {NOW.replace(second=5): {"delivered": 3, "failed": 1}, later: {"retried": 4}}
        )
    assert len(inserts(captured)) == 1
    rows = {
        row.minute: (row.delivered, row.retried, row.refused, row.failed, row.breakers_opened)
        for row in DeliveryHistory.objects.all()
    }
    assert rows == {
        dt.datetime(2026, 3, 1, 12, 30, tzinfo=dt.UTC): (5, 0, 0, 1, 0),
        dt.datetime(2026, 3, 1, 12, 31, tzinfo=dt.UTC): (0, 4, 0, 0, 0),
    }


@pytest.mark.django_db
def test_nothing_to_count_writes_nothing() -> None:
    with CaptureQueriesContext(connection) as captured:
        history.record({})
        history.record({NOW: {"delivered": 0, "breakers_opened": 0}})
    assert captured.captured_queries == []


@pytest.mark.django_db
def test_an_unknown_count_is_refused_naming_it_and_nothing_is_written() -> None:
    with pytest.raises(ValueError, match="'skipped'"):
        history.record({NOW: {"delivered": 1, "skipped": 1}})
    assert not DeliveryHistory.objects.exists()


@pytest.mark.django_db
def test_a_history_that_cannot_be_written_is_logged_and_the_settlements_stand(
    caplog: pytest.LogCaptureFixture,
) -> None:
    batch = send(ALICE, NOTE, ["https://a.example/inbox", "https://b.example/inbox"])
    assert batch is not None
    claimed = store.claim(10, 60)
    with connection.cursor() as cursor:
        cursor.execute(f"DROP TABLE {connection.ops.quote_name(DeliveryHistory._meta.db_table)}")
    with caplog.at_level(logging.ERROR, logger="django_federation_delivery.history"):
        written = store.settle(
            [
                store.Settlement(row, Status.DELIVERED, 1, attempted_at=timezone.now())
                for row in claimed
            ]
        )
    assert written == {row.id for row in claimed}
    assert set(Delivery.objects.values_list("status", flat=True)) == {Status.DELIVERED}
    batch.refresh_from_db()
    assert batch.finished_at is not None, "the rest of the settling went on"
    assert "The delivery history could not be recorded" in caplog.text


@pytest.mark.django_db
def test_deliveries_given_up_are_counted_as_failed_in_their_minute() -> None:
    send(ALICE, NOTE, [f"https://a.example/u{n}/inbox" for n in range(3)])
    ids = list(Delivery.objects.values_list("id", flat=True))
    assert store.give_up_rows(ids[:2], "given up by an operator") == ids[:2]
    assert store.give_up_rows(ids[:2], "again") == []
    (row,) = DeliveryHistory.objects.all()
    assert (row.failed, row.delivered) == (2, 0)
    assert row.minute == history.minute_of(timezone.now()) or row.minute == history.minute_of(
        timezone.now() - dt.timedelta(minutes=1)
    )


# Recording by a real deliverer.


@pytest.mark.django_db(transaction=True)
def test_a_deliverer_counts_what_came_of_each_attempt_in_its_minute(
    inboxes: Callable[..., Inbox],
    settings: Any,
    start_deliverer: Callable[..., RunningDeliverer],
) -> None:
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "RETRY": {"BASE": 0.1, "CAP": 0.2, "ATTEMPTS": 3, "JITTER": 0},
        "NEW_WORK_POLL_SECONDS": 0.05,
        "BREAKER": {"THRESHOLD": 3, "COOL_OFF": 60.0, "SCOPE": "host"},
    }
    flaky_calls: list[int] = []

    def flaky(request: Received) -> tuple[int, dict[str, str], bytes]:
        flaky_calls.append(1)
        return (503, {}, b"") if len(flaky_calls) == 1 else (202, {}, b"")

    ok = inboxes("127.0.0.1")
    gone = inboxes("127.0.0.2", respond=lambda request: (410, {}, b"gone"))
    back = inboxes("127.0.0.3", respond=flaky)
    down = inboxes("127.0.0.4", respond=lambda request: (503, {}, b"down"))
    started = timezone.now()
    send(ALICE, NOTE, [ok.url("/a"), ok.url("/b"), gone.url(), back.url(), down.url()])
    runner = start_deliverer()
    wait_until(lambda: not Delivery.objects.filter(status=Status.PENDING).exists())
    runner.stop()
    # Delivered 3 (one after a retry), refused 1, failed 1 after two retries,
    # whose third failure in a row opened its host's breaker.
    assert totals() == {
        "delivered": 3,
        "retried": 3,
        "refused": 1,
        "failed": 1,
        "breakers_opened": 1,
    }
    # Each settled delivery in the minute of its last attempt.
    settled = Counter(
        (history.minute_of(row.last_attempt_at), row.status)
        for row in Delivery.objects.exclude(status=Status.PENDING)
        if row.last_attempt_at is not None
    )
    recorded = Counter[tuple[dt.datetime, str]]()
    for row in DeliveryHistory.objects.all():
        for status in (Status.DELIVERED, Status.REFUSED, Status.FAILED):
            if getattr(row, str(status)):
                recorded[(row.minute, status)] = getattr(row, str(status))
    assert recorded == settled
    opened = DeliveryHistory.objects.get(breakers_opened=1).minute
    assert history.minute_of(started) <= opened <= history.minute_of(timezone.now())

    # Now open, the breaker holds the next delivery to that host unsent: not a retry.
    send(ALICE, NOTE, [down.url("/later")])
    runner = start_deliverer()
    wait_until(lambda: runner.deliverer.summary.held >= 1)
    runner.stop()
    assert runner.deliverer.summary.retrying == 0
    assert len(down.received) == 3
    assert totals()["retried"] == 3


@pytest.mark.django_db(transaction=True)
def test_webhook_deliveries_are_counted_as_activities_are(
    inboxes: Callable[..., Inbox], settings: Any
) -> None:
    receiver = inboxes(
        "127.0.0.1",
        respond=lambda request: (404, {}, b"") if "/gone" in request.path else (200, {}, b""),
    )
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "WEBHOOKS": {
            "ops": f"http://127.0.0.1:{receiver.port}/hook?secret={SECRET}",
            "old": f"http://127.0.0.1:{receiver.port}/gone?secret={SECRET}",
        },
    }
    send_webhook("ops", "alert.raised", {"n": 0})
    send_webhook("ops", "alert.resolved", {"n": 1})
    send_webhook("old", "alert.raised", {"n": 2})
    Deliverer().run(drain=True)
    assert totals() == {
        "delivered": 2,
        "retried": 0,
        "refused": 1,
        "failed": 0,
        "breakers_opened": 0,
    }


# Reading.


@pytest.mark.django_db
def test_the_last_hour_by_minute_and_two_days_by_hour_with_zeros_where_nothing_happened() -> None:
    def at(ago: dt.timedelta, **counts: int) -> None:
        DeliveryHistory.objects.create(minute=history.minute_of(NOW - ago), **counts)

    at(dt.timedelta(0), delivered=5, breakers_opened=1)
    at(dt.timedelta(minutes=59), retried=2)
    at(dt.timedelta(minutes=60), failed=7)  # an hour ago: in the hours only
    at(dt.timedelta(minutes=61), failed=1)
    at(dt.timedelta(hours=47, minutes=30), refused=3)  # the first hour shown
    at(dt.timedelta(hours=48, minutes=31), refused=100)  # before it
    at(dt.timedelta(minutes=-1), delivered=100)  # after now
    with CaptureQueriesContext(connection) as captured:
        minutes, hours = history.recent(now=NOW)
    assert len(captured.captured_queries) == 1
    assert len(minutes) == history.MINUTES and len(hours) == history.HOURS
    assert minutes[-1].start == dt.datetime(2026, 3, 1, 12, 30, tzinfo=dt.UTC)
    assert minutes[0].start == dt.datetime(2026, 3, 1, 11, 31, tzinfo=dt.UTC)
    assert (minutes[-1].delivered, minutes[-1].breakers_opened) == (5, 1)
    assert minutes[0].retried == 2
    assert sum(bucket.failed for bucket in minutes) == 0
    assert sum(bucket.delivered + bucket.refused for bucket in minutes[:-1]) == 0
    assert hours[-1].start == dt.datetime(2026, 3, 1, 12, 0, tzinfo=dt.UTC)
    assert hours[0].start == dt.datetime(2026, 2, 27, 13, 0, tzinfo=dt.UTC)
    assert (hours[-1].delivered, hours[-1].breakers_opened) == (5, 1)
    assert (hours[-2].failed, hours[-2].retried) == (8, 2)
    assert hours[0].refused == 3
    assert sum(bucket.refused for bucket in hours) == 3
    assert all(bucket.delivered == 0 for bucket in hours[:-1])


@pytest.mark.django_db
def test_with_no_history_every_bucket_is_zero() -> None:
    minutes, hours = history.recent(now=NOW)
    assert len(minutes) == 60 and len(hours) == 48
    assert all(getattr(bucket, name) == 0 for bucket in minutes + hours for name in history.COUNTS)


# Retention.


@pytest.mark.django_db
def test_the_purge_deletes_minutes_older_than_a_week_whatever_retention_says(
    settings: Any,
) -> None:
    now = timezone.now()
    for days in (1, 6.9, 7.1, 30):
        DeliveryHistory.objects.create(
            minute=history.minute_of(now - dt.timedelta(days=days)), delivered=1
        )
    settings.FEDERATION_DELIVERY = {**settings.FEDERATION_DELIVERY, "RETENTION": None}
    assert retention.purge_by_setting(dry_run=True).history == 2
    assert DeliveryHistory.objects.count() == 4
    purged = retention.purge_by_setting()
    assert purged.history == 2
    assert "2 history minutes" in purged.line()
    kept = sorted(DeliveryHistory.objects.values_list("minute", flat=True))
    assert kept == [history.minute_of(now - dt.timedelta(days=days)) for days in (6.9, 1)]


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("zone", ["Asia/Kathmandu", "America/Los_Angeles"])
def test_with_use_tz_off_a_delivery_is_counted_in_the_minute_it_was_made(
    settings: Any, zone: str, inboxes: Callable[..., Inbox], admin_client: Any
) -> None:
    # Naive times are the zone's then, as Django writes them. The minutes
    # were written in UTC on SQLite: 8 hours ahead of Los Angeles, past the
    # end of what the queues page reads, and read with an aware bound that
    # SQLite's backend refuses with USE_TZ off (a 500).
    settings.USE_TZ = False
    settings.TIME_ZONE = zone
    inbox = inboxes("127.0.0.1")
    send(ALICE, NOTE, [inbox.url()])
    Deliverer(concurrency=1).run(drain=True)

    (row,) = DeliveryHistory.objects.all()
    assert row.delivered == 1
    assert abs((row.minute - timezone.now()).total_seconds()) < 120
    # Read as of the minute it was counted in (a minute may end between the
    # attempt and the read), a naive time as the rows' are.
    by_minute, by_hour = history.recent(now=row.minute)
    assert by_minute[-1].delivered == by_hour[-1].delivered == 1
    assert admin_client.get(reverse("admin:federation_delivery_delivery_queues")).status_code == 200
    assert history.purge(dry_run=True) == 0
