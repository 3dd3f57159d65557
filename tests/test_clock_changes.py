"""Times across a clock change, with ``USE_TZ = False`` in a zone whose clock
goes forward and back (New York): a retry, a lease, a deadline and a
replay's window are spans of real time, not of the wall clock."""

from __future__ import annotations

import dataclasses
import datetime as dt
import os
import threading
from collections.abc import Callable, Iterator
from io import StringIO
from typing import Any

import pytest
from django.contrib import admin as django_admin
from django.contrib.admin.utils import display_for_value
from django.core.management import call_command
from django.db import connection, connections
from django.utils import timezone

from django_federation_delivery import (
    controls,
    metrics,
    overview,
    retention,
    send,
    send_batch,
    send_webhook,
    signals,
    store,
)
from django_federation_delivery.admin.hosts import BreakerAdmin
from django_federation_delivery.attempt import failed
from django_federation_delivery.breakers import Breakers, BreakerSettings, take_probe
from django_federation_delivery.channels.activitypub import InboxJob
from django_federation_delivery.controls import pause_host, resume_host
from django_federation_delivery.deliverer import Deliverer
from django_federation_delivery.dialect import aware_now
from django_federation_delivery.hoststats import HostStats
from django_federation_delivery.models import Breaker, Delivery, DeliveryHistory, Host, Status
from django_federation_delivery.picture import host_picture
from django_federation_delivery.retry import RetryPolicy
from django_federation_delivery.settling import Settler, Summary
from django_federation_delivery.signatures import Scheme
from django_federation_delivery.store.claims import batches

from .conftest import Inbox, Received, RunningDeliverer, wait_until
from .keys import ALICE

NOTE = {"type": "Note"}
ON_POSTGRESQL = os.environ.get("DATABASE_URL", "").startswith("postgres")
#: SQLite keeps a naive time as text: what PostgreSQL reads as a moment there compares as text.
sqlite_only = pytest.mark.skipif(ON_POSTGRESQL, reason="SQLite's text times")
#: PostgreSQL reads a naive parameter of the repeated hour as standard time.
postgresql_only = pytest.mark.skipif(
    not ON_POSTGRESQL, reason="PostgreSQL's reading of a naive time"
)
NEW_YORK = "America/New_York"
UTC = dt.UTC


def freeze(monkeypatch: pytest.MonkeyPatch, local: dt.datetime) -> None:
    """``timezone.now()`` as Django gives it with ``USE_TZ = False``: the
    naive wall-clock time in ``TIME_ZONE`` (its ``fold`` telling the repeated
    hour's second pass, as ``datetime.now()`` does)."""
    monkeypatch.setattr(timezone, "now", lambda: local)


def job(delivery_id: int) -> InboxJob:
    return InboxJob(
        delivery_id=delivery_id,
        targets=("https://social.example/inbox",),
        body=b"{}",
        body_sha256="",
        key=None,
        sender=ALICE,
        scheme=Scheme.CAVAGE,
    )


def eastern(*args: int, fold: int = 0) -> dt.datetime:
    """A New York wall-clock time, naive, as Django keeps it with USE_TZ off."""
    return dt.datetime(*args, fold=fold)  # type: ignore[misc]


def in_utc(*args: int) -> dt.datetime:
    return dt.datetime(*args, tzinfo=UTC)  # type: ignore[misc]


def new_york_without_use_tz(settings: Any) -> None:
    settings.USE_TZ = False
    settings.TIME_ZONE = NEW_YORK


def settle_a_503(row: store.Claimed) -> Any:
    """What the settler makes of an inbox's 503 for ``row``, at the clock's time."""
    settler = Settler(policy=RetryPolicy(base=30.0, jitter=0.0), summary=Summary())
    result = dataclasses.replace(
        failed(job(row.id), "the inbox answered 503", permanent=False), status=503
    )
    return settler.attempted(row, batches([row.batch_id])[row.batch_id], result)


@pytest.mark.django_db
def test_a_30_second_retry_across_the_fall_back_is_due_30_seconds_later(
    settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """New York, ``USE_TZ = False``, 2024-11-03 01:59:50 EDT: an inbox answers
    503 and the policy waits 30 s. The retry is due at 01:00:20 EST, 30 s
    later; it is written due at 02:00:20 EST, an hour and 30 s later, since
    the settler's ``now`` (``dialect.aware_now()``) is aware in ``TIME_ZONE``
    and Python adds a timedelta to it on the wall clock."""
    new_york_without_use_tz(settings)
    freeze(monkeypatch, eastern(2024, 11, 3, 1, 59, 50))  # EDT, the first 01:59:50
    send(ALICE, NOTE, ["https://social.example/inbox"])
    (row,) = store.claim(1, lease=300)
    settlement = settle_a_503(row)
    assert settlement.due_at is not None
    assert settlement.due_at.astimezone(UTC) == in_utc(2024, 11, 3, 6, 0, 20)
    store.settle([settlement])
    # As Django reads it with USE_TZ off: the wall-clock time in New York.
    assert Delivery.objects.get().due_at == eastern(2024, 11, 3, 1, 0, 20)


@sqlite_only
@pytest.mark.django_db
def test_a_claims_lease_across_the_spring_forward_holds_for_its_length(
    settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """New York, ``USE_TZ = False``, 2024-03-10 01:58 EST: a claim takes a
    delivery for a 300 s lease, until 03:03 EDT. Three minutes later (03:01
    EDT) another claim takes the same delivery again, while the first
    holder may be sending it: the lease was written as the naive 02:03 (the
    naive ``timezone.now()`` plus 300 s on the wall clock, a time that does
    not exist), before 03:01 on SQLite's text. It is sent twice."""
    new_york_without_use_tz(settings)
    freeze(monkeypatch, eastern(2024, 3, 10, 1, 58))  # EST
    send(ALICE, NOTE, ["https://social.example/inbox"])
    (first,) = store.claim(1, lease=300)
    freeze(monkeypatch, eastern(2024, 3, 10, 3, 1))  # EDT: 3 minutes later
    again = [row.id for row in store.claim(1, lease=300)]
    assert first.id not in again, "taken again while the first claim's lease holds"


@pytest.mark.django_db
def test_a_claims_lease_across_the_fall_back_lapses_after_its_length(
    settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """New York, ``USE_TZ = False``, 2024-11-03 01:58 EDT: a claim takes a
    delivery for 300 s, until 01:03 EST. Its holder dies; at 01:04 EST the
    delivery is not due again: its lease was written as 02:03 (wall-clock
    arithmetic on the naive ``timezone.now()``), and it waits 65 minutes
    instead of 5."""
    new_york_without_use_tz(settings)
    freeze(monkeypatch, eastern(2024, 11, 3, 1, 58))  # EDT
    send(ALICE, NOTE, ["https://social.example/inbox"])
    (first,) = store.claim(1, lease=300)
    freeze(monkeypatch, eastern(2024, 11, 3, 1, 4, fold=1))  # EST: 6 minutes later
    again = store.claim(1, lease=300)
    assert [row.id for row in again] == [first.id], "the first claim's lease lapsed"


@postgresql_only
@pytest.mark.django_db
def test_a_purge_in_chunks_through_the_repeated_hour_deletes_all_it_counts(
    settings: Any,
) -> None:
    """PostgreSQL, New York, ``USE_TZ = False``: five delivered rows, weeks
    past their retention, settled around 2024-11-03 01:00-02:00. Each chunk
    starts from the last one's latest time, read back naive: 01:20 EDT was
    read as 01:20 EST, an hour on, and the purge deleted 3 of the 5 its
    dry run counted."""
    from django_federation_delivery import retention
    from django_federation_delivery.models import Batch

    new_york_without_use_tz(settings)
    batch = Batch.objects.create(sender="https://a.example/u", body="{}")
    Batch.objects.filter(id=batch.id).update(created_at=in_utc(2024, 11, 1))
    # 01:10, 01:20 and 01:50 EDT, 01:10 EST, 02:00 EST.
    for n, (hour, minute) in enumerate([(5, 10), (5, 20), (5, 50), (6, 10), (7, 0)]):
        row = Delivery.objects.create(
            batch=batch, inbox=f"https://a.example/{n}", host="a.example", status=Status.DELIVERED
        )
        Delivery.objects.filter(id=row.id).update(settled_at=in_utc(2024, 11, 3, hour, minute))
    cutoffs = {Status.DELIVERED: in_utc(2024, 11, 10)}
    dry = retention.purge(cutoffs, chunk=2, dry_run=True)
    done = retention.purge(cutoffs, chunk=2)
    assert dry.deliveries == done.deliveries == {Status.DELIVERED.value: 5}
    assert not Delivery.objects.exists()


@postgresql_only
@pytest.mark.django_db
def test_a_retry_due_in_25_minutes_is_not_claimed_in_the_repeated_hour(
    settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PostgreSQL, New York, ``USE_TZ = False``, 2024-11-03 at 01:30 EDT: a
    retry is due at 01:55 EDT (an inbox asked for 25 minutes). The claim
    takes it at once: its ``now`` is the naive 01:30, which PostgreSQL reads
    in the repeated hour as 01:30 EST, an hour later. The inbox is sent it
    25 minutes before it asked."""
    new_york_without_use_tz(settings)
    freeze(monkeypatch, eastern(2024, 11, 3, 1, 0))  # EDT
    send(ALICE, NOTE, ["https://social.example/inbox"])
    (row,) = store.claim(1, lease=300)
    due = in_utc(2024, 11, 3, 5, 55)  # 01:55 EDT
    store.settle([store.Settlement(claimed=row, status=Status.PENDING, attempts=1, due_at=due)])
    freeze(monkeypatch, eastern(2024, 11, 3, 1, 30))  # EDT, 25 minutes before it is due
    assert store.claim(1, lease=300) == []


@pytest.mark.django_db
def test_a_retry_past_the_batchs_deadline_in_the_repeated_hour_is_given_up(
    settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """New York, ``USE_TZ = False``: a batch's deadline is 01:50 EDT on
    2024-11-03 (05:50 UTC). At 01:10 EST (06:10 UTC, 20 minutes past it) an
    attempt fails: the delivery should be given up, its deadline passed.
    It is retried instead, and sent after its deadline: ``decide`` compares
    ``now`` (aware in New York) with the deadline (read in New York too) as
    wall-clock times, 01:10:30 before 01:50."""
    new_york_without_use_tz(settings)
    freeze(monkeypatch, eastern(2024, 11, 3, 0, 59))  # EDT
    send_batch(
        ALICE, NOTE, ["https://social.example/inbox"], {"deadline": in_utc(2024, 11, 3, 5, 50)}
    )
    freeze(monkeypatch, eastern(2024, 11, 3, 1, 10, fold=1))  # EST
    (row,) = store.claim(1, lease=300)
    settlement = settle_a_503(row)
    assert settlement.status == Status.FAILED
    assert settlement.last_error.startswith("the batch's deadline passed")


def delivered_at(monkeypatch: pytest.MonkeyPatch, local: dt.datetime) -> None:
    """One delivery to social.example, sent and delivered at ``local``."""
    freeze(monkeypatch, local)
    send(ALICE, NOTE, ["https://social.example/inbox"])
    (row,) = store.claim(1, lease=300)
    store.settle(
        [store.Settlement(claimed=row, status=Status.DELIVERED, attempts=1, last_status=202)]
    )


def replayed_since(since: str) -> str:
    """What ``delivery_replay --since`` says it queued again."""
    out = StringIO()
    call_command("delivery_replay", "--host=social.example", f"--since={since}", stdout=out)
    return out.getvalue().rpartition("Queued again: ")[2].strip().rstrip(".")


@pytest.mark.django_db
def test_replay_since_2h_on_the_spring_forward_reaches_two_hours_back(
    settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """New York, ``USE_TZ = False``, 2024-03-10 at 03:30 EDT (07:30 UTC):
    ``delivery_replay --since 2h`` should send again what was delivered
    since 05:30 UTC, such as a delivery at 01:15 EST (06:15 UTC). It says
    "Queued again: 0 deliveries": the span was taken off the wall clock
    (03:30 - 2h = 01:30 EST, one hour back), and the restored host never
    gets what it lost."""
    new_york_without_use_tz(settings)
    delivered_at(monkeypatch, eastern(2024, 3, 10, 1, 15))  # EST, 06:15 UTC
    freeze(monkeypatch, eastern(2024, 3, 10, 3, 30))  # EDT, 07:30 UTC
    assert replayed_since("2h") == "1 delivery, in 1 new batch"


@pytest.mark.django_db
def test_replay_since_a_local_moment_of_the_repeated_hour_already_past_is_taken(
    settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """New York, ``USE_TZ = False``, 2024-11-03 at 01:10 EST (06:10 UTC):
    ``--since 2024-11-03T01:40`` (read in TIME_ZONE: 01:40 EDT, 05:40 UTC,
    half an hour ago) is refused "is not in the past": the command compares
    it with ``aware_now()``, both in New York, as wall-clock times."""
    new_york_without_use_tz(settings)
    delivered_at(monkeypatch, eastern(2024, 11, 3, 1, 45))  # EDT, 05:45 UTC
    freeze(monkeypatch, eastern(2024, 11, 3, 1, 10, fold=1))  # EST, 06:10 UTC
    assert replayed_since("2024-11-03T01:40") == "1 delivery, in 1 new batch"


@pytest.mark.django_db
def test_a_hosts_last_24_hours_on_a_23_hour_day_are_24_hours(
    settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """New York, ``USE_TZ = False``, 2024-03-10 at 12:00 EDT (16:00 UTC): a
    delivery at 11:30 EST the day before (16:30 UTC) is within the last 24
    hours. The wall clock's day before began at 12:00 EST, an hour later:
    the host's picture counted nothing (on PostgreSQL, it had none)."""
    new_york_without_use_tz(settings)
    delivered_at(monkeypatch, eastern(2024, 3, 9, 11, 30))  # EST, 16:30 UTC
    freeze(monkeypatch, eastern(2024, 3, 10, 12, 0))  # EDT, 16:00 UTC
    picture = host_picture("social.example")
    assert picture is not None and picture.last_day["delivered"] == 1


@pytest.mark.django_db
def test_the_lag_across_the_spring_forward_is_how_long_it_waited(
    settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """New York, ``USE_TZ = False``, 2024-03-10: a delivery due at 01:58 EST
    still waits at 03:01 EDT, 3 minutes later. ``delivery_status --check``
    (``--max-lag``), the queues page and the ``lag_seconds`` gauge said it
    had waited 63 minutes, the wall clock's difference: CRITICAL for a queue
    3 minutes behind."""
    new_york_without_use_tz(settings)
    freeze(monkeypatch, eastern(2024, 3, 10, 1, 58))  # EST: queued, due now
    send(ALICE, NOTE, ["https://social.example/inbox"])
    freeze(monkeypatch, eastern(2024, 3, 10, 3, 1))  # EDT, 3 minutes later
    lags = (overview.lag(), overview.overview().total.lag, metrics.read_queue().lag)
    assert all(abs(lag - 180) < 5 for lag in lags), lags


@pytest.mark.django_db
def test_a_webhook_destinations_age_and_pause_across_the_spring_forward_are_real_time(
    settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """New York, ``USE_TZ = False``, 2024-03-10: an event for "ops" queued
    at 01:58 EST, and "ops" paused then; at 03:01 EDT, 3 minutes later, the
    destinations page and ``delivery_status`` said its oldest event was
    1h 3m old, "paused by an operator 1h 3m ago": the wall clock's
    difference."""
    from django_federation_delivery import send_webhook
    from django_federation_delivery.webhooks.destinations import delivery_key
    from django_federation_delivery.webhooks.status import destination_status

    from .test_webhooks_status import WEBHOOKS, configure

    new_york_without_use_tz(settings)
    configure(settings, {"ops": WEBHOOKS["ops"]})
    freeze(monkeypatch, eastern(2024, 3, 10, 1, 58))  # EST
    send_webhook(["ops"], "alert.fired", {"n": 1}, event_id="e1")
    pause_host(delivery_key("ops"))
    freeze(monkeypatch, eastern(2024, 3, 10, 3, 1))  # EDT, 3 minutes later
    now = timezone.now()
    (ops,) = destination_status(now=now)
    said = (ops.age, ops.state(now))
    assert abs(ops.age - 180) < 5 and ops.state(now) == "paused by an operator 3m 0s ago", said


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("due", "now", "said"),
    [
        # Spring forward: due 01:58 EST, looked at 03:03 EDT, 5 minutes later.
        (dt.datetime(2024, 3, 10, 1, 58), dt.datetime(2024, 3, 10, 3, 3), "due 5\xa0minutes ago"),
        # The same clock, a retry due at 03:03 EDT seen at 01:58 EST.
        (dt.datetime(2024, 3, 10, 3, 3), dt.datetime(2024, 3, 10, 1, 58), "in 5\xa0minutes"),
    ],
)
def test_the_deliveries_list_says_when_across_the_spring_forward_in_real_time(
    settings: Any, due: dt.datetime, now: dt.datetime, said: str
) -> None:
    """New York, ``USE_TZ = False``: the deliveries list's "next due" column
    (and a webhook destination's next try) across the hour the clock skips
    said "due 1 hour, 5 minutes ago" of a delivery due 5 minutes ago, and
    "in 1 hour, 5 minutes" of a retry 5 minutes away."""
    from django_federation_delivery.admin.base import next_due

    new_york_without_use_tz(settings)
    delivery = Delivery(status=Status.PENDING, due_at=due)
    assert next_due(delivery, now) == said


@sqlite_only
@pytest.mark.django_db
def test_the_lag_in_the_repeated_hour_on_sqlite_is_how_long_it_waited(
    settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SQLite, New York, ``USE_TZ = False``, 2024-11-03: a delivery due at
    the second 01:50 (EST) still waits at 01:55 EST, 5 minutes later. The
    stored naive 01:50 was read as the first (EDT), and the lag said 1h 5m:
    CRITICAL by ``delivery_status --check --max-lag``."""
    new_york_without_use_tz(settings)
    freeze(monkeypatch, eastern(2024, 11, 3, 1, 50, fold=1))  # EST, the second 01:50
    send(ALICE, NOTE, ["https://social.example/inbox"])
    freeze(monkeypatch, eastern(2024, 11, 3, 1, 55, fold=1))  # EST, 5 minutes later
    lags = (overview.lag(), overview.overview().total.lag)
    assert all(abs(lag - 300) < 5 for lag in lags), lags


@postgresql_only
@pytest.mark.django_db
def test_a_first_pass_due_time_still_waiting_in_the_second_pass_lags_65_minutes(
    settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PostgreSQL, New York, ``USE_TZ = False``, 2024-11-03: a delivery due
    at the first 01:50 (EDT) still waits at the second 01:55 (EST), 65
    minutes later: PostgreSQL's read carries its pass, and is not to be
    re-read as the second one, as SQLite's text is (the lag said 5
    minutes, and a queue stuck an hour passed ``--max-lag 3600``)."""
    new_york_without_use_tz(settings)
    freeze(monkeypatch, eastern(2024, 11, 3, 1, 50))  # EDT, the first 01:50
    send(ALICE, NOTE, ["https://social.example/inbox"])
    freeze(monkeypatch, eastern(2024, 11, 3, 1, 55, fold=1))  # EST, 65 minutes later
    lags = (overview.lag(), overview.overview().total.lag)
    assert all(abs(lag - 3900) < 5 for lag in lags), lags


POST = f"{ALICE}/notes/1"
A = "https://a.example/inbox"


def create(obj: Any = POST, n: int = 1) -> dict[str, Any]:
    return {"type": "Create", "id": f"{ALICE}/activities/{n}", "actor": ALICE, "object": obj}


def delete(obj: Any = POST) -> dict[str, Any]:
    return {"type": "Delete", "id": f"{ALICE}/activities/d", "actor": ALICE, "object": obj}


def due_in_utc(delivery_id: int) -> dt.datetime:
    """A delivery's due time as the instant PostgreSQL keeps."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT extract(epoch FROM due_at) FROM federation_delivery_delivery WHERE id = %s",
            [delivery_id],
        )
        (epoch,) = cursor.fetchone()
    return dt.datetime.fromtimestamp(float(epoch), UTC)


@postgresql_only
@pytest.mark.django_db(transaction=True)
def test_a_delete_in_the_repeated_hour_leaves_a_create_being_attempted_to_its_claim(
    settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """2024-11-03 01:30 EDT: the Create to A is claimed for 300 s (until
    05:35 UTC); at 01:31 EDT the Delete is sent. Its naive 01:31 was read
    by PostgreSQL as 01:31 EST (06:31 UTC): the lease looked lapsed, the
    Create being sent was superseded and the Delete went at once, beside it."""
    new_york_without_use_tz(settings)
    freeze(monkeypatch, eastern(2024, 11, 3, 1, 30))
    first = send(ALICE, create(), [A])
    (held,) = store.claim(10, 300)
    freeze(monkeypatch, eastern(2024, 11, 3, 1, 31))
    retraction = send(ALICE, delete(), [A])
    assert first is not None and retraction is not None
    assert Delivery.objects.get(batch=first).status == Status.PENDING, "superseded while held"
    assert retraction.superseded == 0
    assert Delivery.objects.get(batch=retraction).after_id == held.id


@postgresql_only
@pytest.mark.django_db(transaction=True)
def test_what_waited_on_a_superseded_create_in_the_repeated_hour_is_due_at_once(
    settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 2024-11-03 01:31 EDT (05:31 UTC): made due at 06:31 UTC, an hour late.
    new_york_without_use_tz(settings)
    freeze(monkeypatch, eastern(2024, 11, 3, 1, 31))
    send_batch(ALICE, create(), [A], {"ordering_key": "timeline"})
    after = send_batch(ALICE, create(f"{ALICE}/notes/9", n=9), [A], {"ordering_key": "timeline"})
    send(ALICE, delete(), [A])
    assert after is not None
    assert due_in_utc(Delivery.objects.get(batch=after).pk) == in_utc(2024, 11, 3, 5, 31)


@postgresql_only
@pytest.mark.django_db(transaction=True)
def test_a_host_resumed_in_the_repeated_hour_is_due_at_once(
    settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 2024-11-03 01:31 EDT (05:31 UTC): resumed due at 06:31 UTC, an hour late.
    new_york_without_use_tz(settings)
    freeze(monkeypatch, eastern(2024, 11, 3, 1, 31))
    send(ALICE, NOTE, [A])
    pause_host("a.example")
    assert resume_host("a.example") == 1
    assert due_in_utc(Delivery.objects.get().pk) == in_utc(2024, 11, 3, 5, 31)


# A queue kept in SQLite beside a PostgreSQL "default", with USE_TZ off: each
# time the package hands the ORM is naive or aware as the queue's database
# takes it, not as the routers' takes it.


@pytest.fixture
def sqlite_queue(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A queue kept in an SQLite file beside a PostgreSQL "default": a
    database alias made for the test, migrated, and forgotten after."""
    if connections["default"].vendor != "postgresql":
        pytest.skip("a PostgreSQL 'default' (DATABASE_URL) beside an SQLite queue")
    from django.db.backends.base.base import BaseDatabaseWrapper

    alias = "sqlite_queue"
    connections.settings[alias] = {
        **connections.settings["queue"],
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": str(tmp_path / "queue.sqlite3"),
        "OPTIONS": {"timeout": 20},
        "HOST": "",
        "PORT": "",
        "USER": "",
        "PASSWORD": "",
        "TEST": {},
    }
    # The test case lets no connection be made, in any thread, to an alias
    # it was not given: this one, made during the test, is let through.
    guarded = BaseDatabaseWrapper.ensure_connection

    def ensure_connection(self: Any) -> None:
        if self.alias != alias:
            return guarded(self)  # type: ignore[no-any-return]
        if self.connection is None:
            with self.wrap_database_errors:
                self.connect()
        return None

    monkeypatch.setattr(BaseDatabaseWrapper, "ensure_connection", ensure_connection)
    try:
        call_command("migrate", "federation_delivery", database=alias, verbosity=0)
        yield alias
    finally:
        connections[alias].close()
        del connections[alias]
        del connections.settings[alias]


@pytest.mark.django_db(transaction=True)
def test_mark_host_seen_on_an_sqlite_queue_beside_postgresql_with_use_tz_off(
    sqlite_queue: str, settings: Any
) -> None:
    # The package keeps its own times aware and hands them to the ORM
    # through dialect.orm_datetime(value, using), naive for SQLite with
    # USE_TZ off; availability.seen asks it of no database, so of the
    # routers' ("default", PostgreSQL), and gives SQLite an aware one.
    settings.USE_TZ = False
    Host.objects.using(sqlite_queue).create(name="a.example", failing_since=timezone.now())
    try:
        seen = controls.mark_host_seen("a.example", using=sqlite_queue)
    except ValueError as exc:
        pytest.fail(f"mark_host_seen(using={sqlite_queue!r}) raised {exc!r}")
    assert seen is True
    assert Host.objects.using(sqlite_queue).get().failing_since is None


@pytest.mark.django_db(transaction=True)
def test_a_deliverer_on_an_sqlite_queue_beside_postgresql_with_use_tz_off_disables_a_410(
    sqlite_queue: str, settings: Any, inboxes: Any
) -> None:
    # The same slip in webhooks/life.disable (and health's failing watch,
    # hosts.failing_since, controls.give_up_overdue, availability's marks):
    # a destination answering 410 Gone is never disabled, its event retried
    # for ever; each attempt logs "the watch of hosts and destinations
    # raised" with SQLite's ValueError.
    from .test_webhooks_deliveries import SECRET

    settings.USE_TZ = False
    hook = inboxes("127.0.0.5", respond=lambda request: (410, {}, b"hook gone"))
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "WEBHOOKS": {"ops": f"http://127.0.0.5:{hook.port}/hook?secret={SECRET}"},
        "WEBHOOK_RETRY": [0.1] * 8,
    }
    disabled: list[Any] = []
    lock = threading.Lock()

    def told(sender: Any, **kwargs: Any) -> None:
        with lock:
            disabled.append(kwargs["disabled"])

    signals.webhook_destination_disabled.connect(told, weak=False, dispatch_uid="sqlite-queue")
    try:
        send_webhook("ops", "alert.raised", {"n": 1}, using=sqlite_queue)
        Deliverer(using=sqlite_queue).run(stop_after=1.5)
    finally:
        signals.webhook_destination_disabled.disconnect(dispatch_uid="sqlite-queue")
    row = Host.objects.using(sqlite_queue).filter(name="<ops>").first()
    assert [d.destination for d in disabled] == ["ops"], (
        f"a 410 did not disable the destination ({len(hook.received)} attempts made); "
        f"its row: {None if row is None else (row.paused_at, row.disabled_reason)}"
    )


@pytest.mark.django_db(transaction=True)
def test_a_deliverer_with_use_tz_off_survives_a_breaker_opening(
    inboxes: Callable[..., Inbox],
    start_deliverer: Callable[..., RunningDeliverer],
    settings: Any,
) -> None:
    """USE_TZ = False, a BREAKER set: a host answers 503 until its breaker
    opens, then recovers. Every delivery arrives, the loop running: it died
    of comparing a naive time with an aware one."""
    settings.USE_TZ = False
    settings.TIME_ZONE = NEW_YORK
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "BREAKER": {"THRESHOLD": 2, "COOL_OFF": 0.5, "SCOPE": "host"},
        "RETRY": {"BASE": 0.2, "CAP": 0.2, "ATTEMPTS": 50, "JITTER": 0},
    }
    healthy = {"now": False}

    def respond(request: Received) -> tuple[int, dict[str, str], bytes]:
        return (202, {}, b"") if healthy["now"] else (503, {}, b"")

    down = inboxes("127.0.0.2", respond=respond)
    send(ALICE, NOTE, [down.url(f"/{n}") for n in range(6)])
    runner = start_deliverer(concurrency=2, per_host=2)
    wait_until(lambda: Breaker.objects.filter(open_until__isnull=False).exists())
    healthy["now"] = True
    try:
        wait_until(
            lambda: (
                not runner.thread.is_alive()
                or not Delivery.objects.filter(status=Status.PENDING).exists()
            ),
            timeout=20,
        )
    finally:
        alive = runner.thread.is_alive()
        error = runner.error
        if alive:
            runner.stop()
        else:
            runner.error = None
    assert error is None, f"the deliverer died: {error!r}"
    assert not Delivery.objects.filter(status=Status.PENDING).exists()


@pytest.mark.django_db(transaction=True)
def test_a_deliverer_with_use_tz_off_writes_what_it_saw_of_hosts_at_instants(
    inbox: Inbox, settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # It gave its picture of the hosts the wall-clock time: on PostgreSQL a
    # delivery at 01:20 EDT was written 06:20 UTC (read as EST), later than
    # failures that followed it, and every read of the failing hosts took the
    # host for up since (hosts.UP_SINCE_FAILING): never told failing.
    new_york_without_use_tz(settings)
    seen: list[dt.datetime] = []
    learn, write = HostStats.learn, HostStats.write

    def learned(stats: HostStats, host: str, result: Any, now: dt.datetime) -> None:
        seen.append(now)
        learn(stats, host, result, now)

    def written(stats: HostStats, *, now: dt.datetime, using: str | None = None) -> int:
        seen.append(now)
        return write(stats, now=now, using=using)

    monkeypatch.setattr(HostStats, "learn", learned)
    monkeypatch.setattr(HostStats, "write", written)
    send(ALICE, NOTE, [inbox.url()])
    assert Deliverer().run(drain=True, stop_after=10).delivered == 1
    assert seen and all(now.utcoffset() is not None for now in seen), seen


@pytest.mark.django_db(transaction=True)
def test_a_breaker_opened_with_use_tz_off_is_counted_in_the_history(settings: Any) -> None:
    """USE_TZ = False (even TIME_ZONE = UTC): the history's breakers_opened
    counts it. The time written was naive, the one read back aware: 0."""
    settings.USE_TZ = False
    breakers = Breakers(BreakerSettings(threshold=2, cool_off=60.0))
    breakers.refresh()
    for _ in range(2):
        breakers.record("a.example", failed=True, probe="", now=aware_now())
    breakers.flush()
    assert Breaker.objects.get().open_until is not None
    opened = sum(DeliveryHistory.objects.values_list("breakers_opened", flat=True))
    assert opened == 1, f"breakers opened in the history: {opened}"


@pytest.mark.django_db(transaction=True)
def test_a_60_second_cool_off_across_the_fall_back_lasts_60_seconds(
    settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """New York, USE_TZ = False, 2024-11-03 01:59:30 EDT: a breaker opens for
    60 s (until 06:00:30 UTC). At 01:01 EST (06:01 UTC) its probe is due;
    it was held an hour longer, the cool-off added to the wall clock."""
    settings.USE_TZ = False
    settings.TIME_ZONE = NEW_YORK
    freeze(monkeypatch, eastern(2024, 11, 3, 1, 59, 30))
    breakers = Breakers(BreakerSettings(threshold=2, cool_off=60.0))
    breakers.refresh()
    for _ in range(2):
        breakers.record("a.example", failed=True, probe="", now=aware_now())
    breakers.flush()
    freeze(monkeypatch, eastern(2024, 11, 3, 1, 1, fold=1))  # EST, 90 s later
    token = store_take_probe()
    assert token is not None, "the breaker is still held open an hour longer"


def store_take_probe() -> str | None:
    return take_probe("a.example", cool_off=60.0)


@postgresql_only
@pytest.mark.django_db(transaction=True)
def test_the_deadline_sweep_in_the_repeated_hour_gives_up_nothing_before_its_deadline(
    settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """New York, USE_TZ = False, 2024-11-03 01:20 EDT (05:20 UTC): a batch
    with a deadline 64.5 minutes ahead (06:24:30 UTC, 01:24:30 EST), held
    (its host paused). At 01:25 EDT (05:25 UTC) the upkeep's sweep (its
    ``since`` a minute back) gives up what is overdue: nothing is, the
    deadline being an hour away. Its times were naive, which PostgreSQL
    reads in the repeated hour as the later one: given up 59.5 minutes
    early."""
    settings.USE_TZ = False
    settings.TIME_ZONE = NEW_YORK
    freeze(monkeypatch, eastern(2024, 11, 3, 1, 20))
    deadline = dt.timedelta(minutes=64, seconds=30)
    send_batch(ALICE, NOTE, ["https://social.example/inbox"], {"deadline": deadline})
    pause_all()
    freeze(monkeypatch, eastern(2024, 11, 3, 1, 25))  # EDT, 59.5 minutes before the deadline
    controls.give_up_overdue(since=aware_now() - dt.timedelta(seconds=60))
    row = Delivery.objects.get()
    assert row.status == Status.PENDING, f"given up 59.5 minutes early: {row.last_error!r}"


def pause_all() -> None:
    # Held with no due time, as a paused host's are: only the sweep gives it up.
    controls.pause_host("social.example")


@postgresql_only
@pytest.mark.django_db(transaction=True)
def test_what_waited_on_a_purged_delivery_in_the_repeated_hour_is_due_at_once(
    settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """New York, USE_TZ = False, 2024-11-03 01:31 EDT (05:31 UTC): a purge
    deletes a delivered row that a pending one still waits on; that one is
    released, due now (05:31 UTC), as the sweep would release it."""
    settings.USE_TZ = False
    settings.TIME_ZONE = NEW_YORK
    freeze(monkeypatch, eastern(2024, 11, 3, 1, 31))
    first = send(ALICE, NOTE, ["https://social.example/a"])
    second = send(ALICE, NOTE, ["https://social.example/b"])
    assert first is not None and second is not None
    done = Delivery.objects.get(batch=first)
    Delivery.objects.filter(pk=done.pk).update(
        status=Status.DELIVERED, settled_at=eastern(2024, 10, 1, 12, 0)
    )
    Delivery.objects.filter(batch=second).update(after=done, due_at=None)
    purged = retention.purge({Status.DELIVERED: in_utc(2024, 10, 15)})
    assert purged.deleted == 1
    waiting = Delivery.objects.get(batch=second)
    assert waiting.after_id is None
    assert due_in_utc(waiting.pk) == in_utc(2024, 11, 3, 5, 31), "released due an hour late"


@pytest.mark.django_db
def test_the_admin_shows_a_probes_time_in_time_zone_as_its_other_times(settings: Any) -> None:
    """USE_TZ = True, TIME_ZONE New York: the breakers' list shows "open
    until" in New York (Django's way); its "probe" column says the probe is
    waited for until a time that should be New York's too, not UTC's
    unmarked."""
    settings.TIME_ZONE = NEW_YORK
    timezone.activate(NEW_YORK)
    try:
        now = timezone.now()
        breaker = Breaker.objects.create(
            key="a.example",
            failures=10,
            open_until=now - dt.timedelta(seconds=5),
            probe_until=now + dt.timedelta(hours=1),
        )
        shown = BreakerAdmin(Breaker, django_admin.site).probe(breaker)
        # As "open until" is shown: in TIME_ZONE. It was UTC's, unmarked.
        assert str(display_for_value(breaker.probe_until, "")) in shown, shown
        assert f"{breaker.probe_until:%H:%M:%S}" not in shown, shown
    finally:
        timezone.deactivate()
