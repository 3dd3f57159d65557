"""Retention: what a purge deletes, and above all what it keeps."""

from __future__ import annotations

import contextlib
import datetime as dt
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.db import connection, connections, transaction
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from django_federation_delivery import availability, controls, retention, send
from django_federation_delivery.dialect import quoted_table
from django_federation_delivery.models import Batch, Breaker, Delivery, Host, Status
from django_federation_delivery.replay import replay

from .conftest import reads_by_primary_key, statements_run, wait_until, waiting_on_locks
from .keys import ALICE
from .operators import NOTE
from .test_purge_deliveries import settled

pytestmark = pytest.mark.django_db(transaction=True)

DAY = 86400.0
STATUSES = [Status.DELIVERED, Status.SKIPPED, Status.FAILED, Status.REFUSED]
#: Ages of the settled rows, in days: past every default retention, past
#: only the 7 days of delivered and skipped, within every one.
AGES = [40, 10, 1]
DEFAULT_DAYS = {Status.DELIVERED: 7, Status.SKIPPED: 7, Status.FAILED: 30, Status.REFUSED: 30}
PER_BATCH = 5_000


def fill(count: int, now: dt.datetime, *, first_batch: int) -> None:
    """``count`` settled rows in one statement: row i has status STATUSES[i % 4];
    the first half is 40 days old, the rest AGES[i % 3] days old; PER_BATCH
    rows to a batch, from ``first_batch`` on."""
    table = quoted_table(Delivery, connection)
    adapt = connection.ops.adapt_datetimefield_value
    status = "CASE i %% 4 " + " ".join(f"WHEN {n} THEN %s" for n in range(4)) + " END"
    settled = (
        f"CASE WHEN i <= {count // 2} THEN %s ELSE CASE i %% 3 "
        + " ".join(f"WHEN {n} THEN %s" for n in range(3))
        + " END END"
    )
    ages = [adapt(now - dt.timedelta(days=days)) for days in AGES]
    with connection.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {table} (batch_id, kind, destination, inbox, host, via, lane, "
            "status, attempts, due_at, lease_token, last_attempt_at, last_status, last_error, "
            "settled_at, sequence, after_id) "
            f"WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < {count}) "
            f"SELECT {first_batch} + (i - 1) / {PER_BATCH}, 'activitypub', '', "
            "'https://h' || (i %% 50) || "
            "'.example/inbox/' || i, 'h' || (i %% 50) || '.example', '[]', 'normal', "
            f"{status}, 1, NULL, NULL, NULL, 200, '', {settled}, '', NULL FROM n",
            [*map(str, STATUSES), ages[0], *ages],
        )


def expected(count: int, days: dict[Status, int]) -> dict[str, int]:
    """What a purge keeping each status ``days`` deletes of :func:`fill`'s rows."""
    gone = dict.fromkeys((s.value for s in retention.SETTLED), 0)
    for i in range(1, count + 1):
        status = STATUSES[i % 4]
        age = AGES[0] if i <= count // 2 else AGES[i % 3]
        if age > days[status]:
            gone[status.value] += 1
    return gone


def batches(count: int, now: dt.datetime) -> list[Batch]:
    created = now - dt.timedelta(days=41)
    return Batch.objects.bulk_create(
        [Batch(sender="https://a.example/u", body="{}", created_at=created) for _ in range(count)]
    )


def pending(batch: Batch, count: int, **fields: Any) -> list[Delivery]:
    return Delivery.objects.bulk_create(
        [
            Delivery(batch=batch, inbox=f"https://p.example/{n}", host="p.example", **fields)
            for n in range(count)
        ]
    )


@pytest.mark.slow
def test_a_purge_deletes_exactly_the_settled_rows_past_retention_in_chunks_keeping_pending_ones(
    settings: Any,
) -> None:
    count = 30_000
    now = timezone.now()
    made = batches(count // PER_BATCH + 1, now)
    fill(count, now, first_batch=made[0].id)
    # Pending rows, in a batch of their own and among old settled ones; one
    # carries a stray old settled_at, which must not make it purgeable.
    alone, mixed = made[-1], made[0]
    pending(alone, 300)
    (stray,) = pending(mixed, 1, settled_at=now - dt.timedelta(days=400))
    before = Delivery.objects.count()

    steps: list[int] = []
    with CaptureQueriesContext(connection) as queries:
        purged = retention.purge_by_setting(on_progress=lambda deleted, _: steps.append(deleted))

    assert purged.deliveries == expected(count, DEFAULT_DAYS)
    assert Delivery.objects.count() == before - purged.deleted
    assert Delivery.objects.filter(status=Status.PENDING).count() == 301
    assert Delivery.objects.filter(id=stray.id).exists()
    # What is left is what is within its retention.
    for status in STATUSES:
        oldest = now - dt.timedelta(days=DEFAULT_DAYS[status])
        assert not Delivery.objects.filter(status=status, settled_at__lt=oldest).exists()
    # In chunks of at most PURGE_CHUNK rows, each a statement of its own.
    sizes = [b - a for a, b in zip([0, *steps], steps, strict=False)]
    assert max(sizes) == retention.PURGE_CHUNK
    assert purged.chunks == len(steps) >= purged.deleted // retention.PURGE_CHUNK
    deletes = [q for q in queries.captured_queries if q["sql"].startswith("DELETE")]
    assert len([q for q in deletes if "settled_at" in q["sql"]]) == purged.chunks
    # The first half of the batches held only 40-day-old rows: emptied, and gone.
    emptied = {b.id for b in made[: count // 2 // PER_BATCH]} - {mixed.id}
    assert purged.batches == len(emptied)
    assert not Batch.objects.filter(id__in=emptied).exists()
    assert Batch.objects.filter(id__in=[alone.id, mixed.id]).count() == 2
    assert Delivery.objects.filter(batch=alone).count() == 300


def test_a_dry_run_counts_what_would_go_and_deletes_nothing() -> None:
    now = timezone.now()
    made = batches(2, now)
    fill(2 * PER_BATCH, now, first_batch=made[0].id)
    Host.objects.create(name="gone.example")
    Host.objects.filter(name="gone.example").update(updated_at=now - dt.timedelta(days=90))
    before = Delivery.objects.count()

    dry = retention.purge_by_setting(dry_run=True)

    assert Delivery.objects.count() == before
    assert Batch.objects.count() == 2 and Host.objects.count() == 1
    done = retention.purge_by_setting()
    assert dry.deliveries == done.deliveries == expected(2 * PER_BATCH, DEFAULT_DAYS)
    assert (dry.batches, dry.hosts) == (done.batches, done.hosts) == (1, 1)


def test_a_status_set_to_none_is_kept_and_none_keeps_everything(settings: Any) -> None:
    now = timezone.now()
    made = batches(1, now)
    fill(400, now, first_batch=made[0].id)
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "RETENTION": {"DELIVERED": None, "FAILED": DAY},
    }
    purged = retention.purge_by_setting()
    # SKIPPED and REFUSED keep their defaults (7 and 30 days).
    days = {**DEFAULT_DAYS, Status.DELIVERED: 10**6, Status.FAILED: 0}
    assert purged.deliveries == {
        s: n for s, n in expected(400, days).items() if s != Status.DELIVERED
    }
    settings.FEDERATION_DELIVERY = {**settings.FEDERATION_DELIVERY, "RETENTION": None}
    assert retention.purge_by_setting().deleted == 0
    assert Delivery.objects.count() == 400 - purged.deleted


def test_a_row_others_wait_on_is_purged_the_wait_cleared_a_pending_one_released() -> None:
    now = timezone.now()
    (batch,) = batches(1, now)
    old = Delivery.objects.create(
        batch=batch,
        inbox="https://a.example/1",
        host="a.example",
        status=Status.DELIVERED,
        settled_at=now - dt.timedelta(days=40),
    )
    # Settled within its retention, and once after the old one.
    kept = Delivery.objects.create(
        batch=batch,
        inbox="https://a.example/2",
        host="a.example",
        status=Status.FAILED,
        settled_at=now - dt.timedelta(days=1),
        after=old,
    )
    # Pending, made to wait on it as it settled (a retraction's, a
    # requeue's): the deliverer's sweep would release it. Its wait cleared
    # with no due time given, it would be neither claimed nor swept.
    (waiting,) = pending(batch, 1, due_at=None, after=old)
    assert retention.purge_by_setting().deliveries[Status.DELIVERED] == 1
    kept.refresh_from_db()
    assert kept.after_id is None
    assert not Delivery.objects.filter(id=old.id).exists()
    waiting.refresh_from_db()
    assert (waiting.status, waiting.after_id) == (Status.PENDING, None)
    assert waiting.due_at is not None and waiting.due_at <= timezone.now()


@pytest.mark.parametrize("retraction", ["Delete", "Undo"])
def test_a_retraction_is_kept_while_what_it_took_back_is_so_a_replay_never_sends_that_again(
    settings: Any, retraction: str
) -> None:
    inbox = "https://a.example/inbox"
    post = f"{ALICE}/notes/1"
    now = timezone.now()
    create = {**NOTE, "id": f"{ALICE}/activities/1", "actor": ALICE, "object": post}
    created = send(ALICE, create, [inbox])
    assert created is not None
    took_back = {
        "type": retraction,
        "id": f"{ALICE}/activities/2",
        "actor": ALICE,
        "object": post if retraction == "Delete" else create,
    }
    retracted = send(ALICE, took_back, [inbox])
    like = {"type": "Like", "id": f"{ALICE}/likes/1", "actor": ALICE, "object": f"{ALICE}/x"}
    liked = send(ALICE, like, [inbox])
    assert retracted is not None and liked is not None
    # The Create tried while the host was down and given up, its retraction
    # waiting on it then delivered; a Like delivered beside them.
    for batch, status, days in (
        (created, Status.FAILED, 10),
        (retracted, Status.DELIVERED, 9),
        (liked, Status.DELIVERED, 9),
    ):
        Batch.objects.filter(pk=batch.pk).update(created_at=now - dt.timedelta(days=days))
        Delivery.objects.filter(batch=batch).update(
            status=status, settled_at=now - dt.timedelta(days=days), due_at=None, attempts=1
        )

    dry = retention.purge_by_setting(dry_run=True)
    purged = retention.purge_by_setting()

    # Past the 7 days of what is delivered, the retraction is kept as long
    # as the Create given up (30 days): the Like is not.
    assert dry.deliveries == purged.deliveries
    assert purged.deliveries[Status.DELIVERED] == 1
    assert not Delivery.objects.filter(batch=liked).exists()
    since = now - dt.timedelta(days=11)
    again = replay(host="a.example", since=since)
    assert [batch.tag for batch in again] == [f"replay of batch {retracted.pk}"]
    Batch.objects.filter(pk__in=[b.pk for b in again]).delete()

    # A retraction's delivery goes with the longest retention of what a
    # replay or a requeue sends again (any settled status), and never while
    # one is kept for ever.
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "RETENTION": {"DELIVERED": DAY, "FAILED": None},
    }
    assert retention.purge_by_setting().deleted == 0
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "RETENTION": {"DELIVERED": DAY, "FAILED": 8.5 * DAY, "REFUSED": 8.5 * DAY},
    }
    purged = retention.purge_by_setting()
    assert purged.deliveries[Status.FAILED] == purged.deliveries[Status.DELIVERED] == 1
    assert replay(host="a.example", since=since) == []


def test_only_hosts_not_seen_since_and_neither_paused_nor_broken_are_deleted() -> None:
    now = timezone.now()
    long_ago = now - dt.timedelta(days=90)
    (batch,) = batches(1, now)
    names = ["gone", "paused", "broken-host", "broken-inbox", "sending", "recent"]
    Host.objects.bulk_create([Host(name=f"{name}.example") for name in names])
    Host.objects.exclude(name="recent.example").update(updated_at=long_ago)
    Host.objects.filter(name="recent.example").update(updated_at=now - dt.timedelta(days=1))
    Host.objects.filter(name="paused.example").update(paused_at=long_ago)
    Breaker.objects.create(key="broken-host.example", failures=3)
    Breaker.objects.create(key="https://broken-inbox.example/users/a/inbox", failures=3)
    Delivery.objects.create(batch=batch, inbox="https://sending.example/i", host="sending.example")

    purged = retention.purge_by_setting()

    assert purged.hosts == 1
    assert set(Host.objects.values_list("name", flat=True)) == {
        f"{name}.example" for name in names if name != "gone"
    }


def test_a_host_marked_unavailable_or_failing_is_kept_however_long_ago_it_was() -> None:
    # Marked unavailable 40 days ago and probed daily since, a probe writing
    # its own time alone: forgotten, its inboxes would be sent to again. A
    # host told failing, forgotten, would never be told recovered; one
    # failing, its clock to unavailable started again at its next failure.
    now = timezone.now()
    long_ago = now - dt.timedelta(days=40)
    Host.objects.create(name="gone.example", failing_since=long_ago - dt.timedelta(days=7))
    Host.objects.create(name="failing.example", failing_since=long_ago, failing_told_at=long_ago)
    Host.objects.create(name="forgotten.example")
    Host.objects.update(updated_at=long_ago)
    assert availability.mark_unavailable(7 * DAY, now=long_ago) == ["gone.example"]
    assert [name for name, _url in availability.probe_due(now=now)] == ["gone.example"]

    assert retention.purge_by_setting(dry_run=True).hosts == 1
    assert retention.purge_by_setting().hosts == 1

    assert set(Host.objects.values_list("name", flat=True)) == {"gone.example", "failing.example"}
    availability.forget_known()
    assert availability.unavailable_hosts() == {"gone.example"}
    assert send(ALICE, NOTE, ["https://gone.example/inbox"]) is None


def test_a_purge_asked_to_stop_stops_between_chunks() -> None:
    now = timezone.now()
    made = batches(1, now)
    fill(1_000, now, first_batch=made[0].id)
    cutoffs = retention.cutoffs_for(dict.fromkeys(STATUSES, DAY), now)
    purged = retention.purge(cutoffs, chunk=100, should_stop=lambda: True)
    assert (purged.chunks, purged.deleted, purged.batches) == (1, 100, 0)


def test_pending_deliveries_cannot_be_asked_for() -> None:
    with pytest.raises(ValueError, match="pending"):
        retention.purge({Status.PENDING: timezone.now()})


@pytest.mark.parametrize("bad", ["weekly", {"DELIVERED": -1}, {"PENDING": DAY}])
def test_a_bad_retention_used_anyway_is_improperly_configured_naming_it(
    settings: Any, bad: Any
) -> None:
    settings.FEDERATION_DELIVERY = {**settings.FEDERATION_DELIVERY, "RETENTION": bad}
    with pytest.raises(ImproperlyConfigured, match="RETENTION"):
        retention.retention_seconds()


def test_each_chunk_of_a_purge_finds_its_rows_by_primary_key_not_by_a_scan() -> None:
    # With the table's statistics up to date: as a join, a PostgreSQL chunk's
    # ids were hashed against a scan of the whole table, every chunk.
    count, chunk = 5_000, 250
    now = timezone.now()
    made = batches(count // PER_BATCH + 1, now)
    fill(count, now, first_batch=made[0].id)
    table = quoted_table(Delivery, connection)
    with connection.cursor() as cursor:
        cursor.execute(f"ANALYZE {table}")
    with statements_run() as executed:
        purged = retention.purge({Status.DELIVERED: now - dt.timedelta(days=7)}, chunk=chunk)
    assert purged.chunks > 2
    chunks = [run for run in executed if run[0].startswith("DELETE") and "settled_at" in run[0]]
    assert len(chunks) == purged.chunks
    explain = "EXPLAIN" if connection.vendor == "postgresql" else "EXPLAIN QUERY PLAN"
    with connection.cursor() as cursor:
        for sql, params in chunks:
            cursor.execute(f"{explain} {sql}", params)
            plan = "\n".join(str(row[-1]) for row in cursor.fetchall())
            if connection.vendor == "postgresql":
                assert reads_by_primary_key(plan, Delivery._meta.db_table), plan
                # The few batches a chunk's retractions are looked up in may
                # be scanned, the table being small here; its deliveries never.
                assert f"Seq Scan on {Delivery._meta.db_table}" not in plan, plan
                assert "Join" not in plan, plan
            else:
                assert "USING INTEGER PRIMARY KEY" in plan, plan
                assert "SCAN federation_delivery_delivery" not in plan, plan


def test_a_delivery_requeued_while_a_purge_waits_for_its_row_is_kept() -> None:
    if connection.vendor != "postgresql":
        pytest.skip("SQLite has one writer: a purge's DELETE and a requeue never overlap")
    now = timezone.now()
    (batch,) = batches(1, now)
    old = now - dt.timedelta(days=40)
    requeued, *others = pending(batch, 3, status=Status.DELIVERED, settled_at=old)
    # An operator's requeue, committed only once the purge waits for its row.
    requeue = Delivery.objects.filter(id=requeued.id)
    with purge_waiting_on(
        lambda: requeue.update(status=Status.PENDING, settled_at=None),
        {Status.DELIVERED: now - dt.timedelta(days=7)},
    ) as purged:
        pass
    # The purge found the row delivered and 40 days old, and waited for it;
    # by then it was pending again, and is kept.
    assert purged and purged[0].deliveries == {Status.DELIVERED.value: len(others)}
    assert list(Delivery.objects.values_list("id", "status")) == [(requeued.id, Status.PENDING)]


@contextlib.contextmanager
def purge_waiting_on(
    holding: Callable[[], object], cutoffs: dict[Status, dt.datetime]
) -> Iterator[list[retention.Purged]]:
    """A purge of ``cutoffs``, in a thread of its own, waiting for a row that
    another transaction holds: ``holding`` runs in that transaction, whose
    locks are kept until the block ends. Yields, once the purge waits, what
    it returns (there once the block has ended)."""
    held, release = threading.Event(), threading.Event()
    purged: list[retention.Purged] = []

    def hold() -> None:
        try:
            with transaction.atomic():
                holding()
                held.set()
                release.wait(30)
        finally:
            connections.close_all()

    def purge() -> None:
        try:
            purged.append(retention.purge(cutoffs))
        finally:
            connections.close_all()

    threads = [threading.Thread(target=hold), threading.Thread(target=purge)]
    threads[0].start()
    assert held.wait(10)
    threads[1].start()
    try:
        wait_until(lambda: waiting_on_locks() > 0, timeout=10)
        yield purged
    finally:
        release.set()
        for thread in threads:
            thread.join(30)


def test_use_tz_off_with_a_replayed_status_kept_for_ever_purges(settings: Any) -> None:
    """USE_TZ = False (the README documents it as supported) and FAILED kept
    for ever, DELIVERED 7 days: the purge should delete the old delivered rows."""
    settings.USE_TZ = False
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "RETENTION": {"FAILED": None},
    }
    settled(10, count=2)
    purged = retention.purge_by_setting()
    assert purged.deliveries[Status.DELIVERED] == 2
    # Given naive cutoffs by a caller, as timezone.now() is with USE_TZ off.
    settled(10, count=2)
    naive = {Status.DELIVERED: timezone.now() - dt.timedelta(days=7)}
    assert retention.purge(naive).deliveries[Status.DELIVERED] == 2


def test_a_refused_retraction_is_kept_as_long_as_the_create_it_took_back(settings: Any) -> None:
    """A Create given up at a.example (FAILED, kept 30 days), its Delete then
    refused there (REFUSED, kept 7 days by this project's RETENTION). A replay
    leaves the Create out while the Delete is kept; once the purge deleted the
    Delete but kept the Create, the replay sends the deleted post's Create
    again, with no Delete after it."""
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "RETENTION": {"REFUSED": 7 * DAY},
    }
    inbox = "https://a.example/inbox"
    post = f"{ALICE}/notes/1"
    now = timezone.now()
    create = {**NOTE, "id": f"{ALICE}/activities/1", "actor": ALICE, "object": post}
    created = send(ALICE, create, [inbox])
    deleted = send(
        ALICE,
        {"type": "Delete", "id": f"{ALICE}/activities/2", "actor": ALICE, "object": post},
        [inbox],
    )
    assert created is not None and deleted is not None
    for batch, status, days in ((created, Status.FAILED, 10), (deleted, Status.REFUSED, 9)):
        Batch.objects.filter(pk=batch.pk).update(created_at=now - dt.timedelta(days=days))
        Delivery.objects.filter(batch=batch).update(
            status=status, settled_at=now - dt.timedelta(days=days), due_at=None, attempts=1
        )
    since = now - dt.timedelta(days=11)
    # Before any purge: the Create is not replayed (the Delete took it back).
    assert replay(host="a.example", since=since) == []

    retention.purge_by_setting()

    assert Delivery.objects.filter(batch=created).exists()  # FAILED: 30 days
    again = replay(host="a.example", since=since)
    assert [b.tag for b in again] == [], (
        f"after the purge a replay re-sends the deleted post's Create: {[b.tag for b in again]}"
    )


def test_a_superseded_create_kept_longer_than_its_delete_is_never_requeued(
    settings: Any,
) -> None:
    # Superseded deliveries kept for ever (an audit trail): the Delete that
    # took the Create back is kept as long, or a requeue would send the
    # deleted post's Create with no Delete after it.
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "RETENTION": {"SUPERSEDED": None},
    }
    inbox, post = "https://a.example/inbox", f"{ALICE}/notes/1"
    created = send(ALICE, {**NOTE, "id": f"{ALICE}/activities/1", "object": post}, [inbox])
    deleted = send(
        ALICE,
        {"type": "Delete", "id": f"{ALICE}/activities/2", "actor": ALICE, "object": post},
        [inbox],
    )
    assert created is not None and deleted is not None
    then = timezone.now() - dt.timedelta(days=40)
    Batch.objects.filter(pk__in=[created.pk, deleted.pk]).update(created_at=then)
    Delivery.objects.filter(batch=created).update(settled_at=then)
    Delivery.objects.filter(batch=deleted).update(
        status=Status.DELIVERED, settled_at=then, due_at=None, attempts=1
    )
    assert Delivery.objects.get(batch=created).status == Status.SUPERSEDED

    retention.purge_by_setting()

    assert Delivery.objects.filter(batch=deleted).exists()
    assert controls.requeue(Delivery.objects.filter(batch=created)) == 0


def test_a_delivery_requeued_and_given_up_again_while_a_chunk_runs_is_kept() -> None:
    """PostgreSQL. A chunk's DELETE read its ids (two FAILED rows 40 days old)
    and is held at the first by another transaction's lock. Meanwhile the
    second is requeued by an operator and given up again (FAILED, settled
    now): a delivery settled a moment ago, within its 30 days. The DELETE
    checked only ``status`` again on the changed row, and deleted it."""
    if connection.vendor != "postgresql":
        pytest.skip("SQLite has one writer")
    now = timezone.now()
    (batch,) = batches(1, now)
    old = now - dt.timedelta(days=40)
    first, second = pending(batch, 2, status=Status.FAILED, settled_at=old, attempts=1)
    with purge_waiting_on(
        lambda: list(Delivery.objects.select_for_update().filter(id=first.id)),
        {Status.FAILED: now - dt.timedelta(days=30)},
    ) as purged:
        # The operator's requeue, then a give-up: each committed on its own.
        assert controls.requeue(Delivery.objects.filter(id=second.id)) == 1
        assert controls.give_up(Delivery.objects.filter(id=second.id)) == 1
        settled_again = Delivery.objects.get(id=second.id).settled_at
        assert settled_again is not None and settled_again > now - dt.timedelta(minutes=1)
    assert purged
    assert Delivery.objects.filter(id=second.id).exists(), (
        f"a delivery settled {settled_again} (seconds ago) was purged as 40 days old: "
        f"{purged[0].deliveries}"
    )


def test_use_tz_off_a_retention_is_a_span_of_real_time_across_a_clock_change(
    settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """New York, USE_TZ = False, now 2024-03-15 12:00 EDT (16:00 UTC). A
    delivery settled 2024-03-08 11:30 EST (16:30 UTC) is 6 days 23.5 hours
    old: within the 7 days of DELIVERED, it must be kept."""
    settings.USE_TZ = False
    settings.TIME_ZONE = "America/New_York"
    now_local = dt.datetime(2024, 3, 15, 12, 0)
    batch = Batch.objects.create(sender="https://a.example/u", body="{}")
    Batch.objects.filter(id=batch.id).update(created_at=dt.datetime(2024, 3, 8, 11, 0))
    Delivery.objects.create(
        batch=batch,
        inbox="https://a.example/1",
        host="a.example",
        status=Status.DELIVERED,
        settled_at=dt.datetime(2024, 3, 8, 11, 30),
    )
    monkeypatch.setattr(timezone, "now", lambda: now_local)
    purged = retention.purge_by_setting()
    assert purged.deliveries[Status.DELIVERED] == 0, (
        "a delivery 6 d 23.5 h old was purged under a 7-day retention"
    )
