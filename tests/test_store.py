from __future__ import annotations

import collections
import contextlib
import dataclasses
import datetime as dt
import json
import logging
import re
import threading
import tracemalloc
from collections.abc import Iterator
from typing import Any

import pytest
from django.db import IntegrityError, OperationalError, connection, connections, transaction
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from django_federation_delivery import history, send, send_batch, send_webhook, signals, store
from django_federation_delivery.models import Batch, Delivery, DeliveryHistory, Lane, Status
from django_federation_delivery.store import queueing
from django_federation_delivery.store.claims import CANDIDATES

from .conftest import reads_by_primary_key, statements_run
from .keys import ALICE

NOTE = {"type": "Note"}


def inboxes(count: int, host: str = "a.example") -> list[str]:
    return [f"https://{host}/u{n}/inbox" for n in range(count)]


@pytest.mark.django_db
def test_a_claim_takes_due_deliveries_for_a_lease_with_a_token() -> None:
    send(ALICE, NOTE, inboxes(5))
    before = timezone.now()
    claimed = store.claim(3, lease=300)
    assert len(claimed) == 3
    assert len({row.token for row in claimed}) == 1
    rows = Delivery.objects.filter(id__in=[row.id for row in claimed])
    for row in rows:
        assert row.lease_token == claimed[0].token
        assert row.due_at is not None and row.due_at >= before + dt.timedelta(seconds=299)
    # Held rows are not due: the next claim takes the other two only.
    assert {row.id for row in store.claim(10, lease=300)}.isdisjoint(r.id for r in claimed)
    assert store.claim(10, lease=300) == []


@pytest.mark.django_db
def test_a_lapsed_lease_comes_due_again_and_fences_out_its_old_holder() -> None:
    send(ALICE, NOTE, inboxes(1))
    first = store.claim(1, lease=300)[0]
    Delivery.objects.update(due_at=timezone.now() - dt.timedelta(seconds=1))  # the lease lapses
    second = store.claim(1, lease=300)[0]
    assert second.id == first.id and second.token != first.token
    late = store.Settlement(claimed=first, status=Status.DELIVERED, attempts=1, last_status=202)
    assert store.settle([late]) == set(), "the old holder cannot settle what another holds"
    assert Delivery.objects.get().status == Status.PENDING
    current = store.Settlement(claimed=second, status=Status.DELIVERED, attempts=1, last_status=202)
    assert store.settle([current]) == {second.id}
    row = Delivery.objects.get()
    assert (row.status, row.attempts, row.lease_token, row.due_at) == (
        Status.DELIVERED,
        1,
        None,
        None,
    )
    assert row.settled_at is not None


@pytest.mark.django_db
def test_a_retry_stays_pending_until_its_due_time() -> None:
    send(ALICE, NOTE, inboxes(1))
    row = store.claim(1, lease=300)[0]
    due = timezone.now() + dt.timedelta(seconds=60)
    store.settle(
        [
            store.Settlement(
                claimed=row,
                status=Status.PENDING,
                attempts=1,
                due_at=due,
                last_status=503,
                last_error="the inbox answered 503",
            )
        ]
    )
    stored = Delivery.objects.get()
    assert (stored.status, stored.attempts, stored.last_status) == (Status.PENDING, 1, 503)
    assert stored.due_at == due and stored.lease_token is None
    assert store.claim(1, lease=300) == []
    assert store.next_due() == due


@pytest.mark.django_db
def test_what_is_due_is_found_in_every_lane_in_one_statement() -> None:
    # The idle loop's looks: has_due every NEW_WORK_POLL_SECONDS, next_due
    # before each idle sleep. A low-lane delivery due in a minute, then a
    # priority one due now.
    assert not store.has_due() and store.next_due() is None
    later = timezone.now() + dt.timedelta(minutes=1)
    send_batch(ALICE, NOTE, inboxes(1, "low.example"), {"low_priority": True})
    Delivery.objects.update(due_at=later)
    assert Delivery.objects.get().lane == Lane.LOW
    with CaptureQueriesContext(connection) as queries:
        assert not store.has_due()
        assert store.next_due() == later
    assert len(queries) == 2
    send(ALICE, NOTE, inboxes(1, "now.example"))
    assert store.has_due()
    assert store.next_due() <= timezone.now()
    # Only what came due after a moment, when asked: a held host's due
    # delivery, left out of the claims, says nothing of new work.
    sent = Delivery.objects.get(host="now.example").due_at
    assert store.has_due(since=sent - dt.timedelta(seconds=1))
    assert not store.has_due(since=sent)


@pytest.mark.django_db
def test_a_batch_finishes_when_its_last_delivery_leaves_the_queue() -> None:
    batch = send(ALICE, NOTE, inboxes(3))
    assert batch is not None
    finished: list[int] = []
    rows = store.claim(3, lease=300)
    store.settle(
        [store.Settlement(claimed=r, status=Status.DELIVERED, attempts=1) for r in rows[:2]],
        on_finished=finished.extend,
    )
    assert finished == []
    store.settle(
        [store.Settlement(claimed=rows[2], status=Status.FAILED, attempts=1)],
        on_finished=finished.extend,
    )
    assert finished == [batch.id]
    batch.refresh_from_db()
    assert batch.remaining == 0 and batch.finished_at is not None


@pytest.mark.django_db
@pytest.mark.parametrize("batches", [5, 120])
def test_many_batches_are_counted_down_in_one_statement(batches: int) -> None:
    # A stream of one-inbox sends: each delivery settles a batch of its own.
    # One of them also keeps a delivery pending, and is not finished.
    made = [send(ALICE, NOTE, inboxes(1, f"h{n}.example")) for n in range(batches)]
    unfinished = send(ALICE, NOTE, inboxes(2, "two.example"))
    assert unfinished is not None
    rows = store.claim(batches + 2, lease=300)
    settling = [r for r in rows if r.inbox != inboxes(2, "two.example")[1]]
    finished: list[int] = []
    with CaptureQueriesContext(connection) as queries:
        store.settle(
            [store.Settlement(claimed=r, status=Status.DELIVERED, attempts=1) for r in settling],
            on_finished=finished.extend,
        )
    assert finished == sorted(b.id for b in made if b is not None)
    # The batches come as one parameter, whatever their number.
    countdowns = [q for q in queries.captured_queries if "SET remaining = CASE" in q["sql"]]
    assert len(countdowns) == 1
    assert not Batch.objects.filter(finished_at__isnull=True).exclude(id=unfinished.id).exists()
    assert Batch.objects.filter(remaining=0, finished_at__isnull=False).count() == batches
    unfinished.refresh_from_db()
    assert (unfinished.remaining, unfinished.finished_at) == (1, None)


@pytest.mark.django_db
def test_finished_batches_are_read_for_batch_finished_only_when_a_receiver_listens() -> None:
    made = [send(ALICE, NOTE, inboxes(1, f"h{n}.example")) for n in range(4)]
    rows = sorted(store.claim(4, lease=300), key=lambda row: row.batch_id)
    batches = Batch._meta.db_table

    def settle(claimed: list[store.Claimed]) -> list[str]:
        with CaptureQueriesContext(connection) as queries:
            store.settle(
                [store.Settlement(claimed=r, status=Status.DELIVERED, attempts=1) for r in claimed],
                on_finished=signals.send_batches_finished,
            )
        return [q["sql"] for q in queries.captured_queries if q["sql"].startswith("SELECT")]

    # Nobody listens: the finished batches are stamped, and not read back
    # (the count-down looks only at their ids and counts).
    read = [sql for sql in settle(rows[:2]) if f'"{batches}"."body"' in sql]
    assert not read
    assert Batch.objects.filter(finished_at__isnull=False).count() == 2
    received: list[Batch] = []

    def receiver(sender: object, batch: Batch, **kwargs: object) -> None:
        received.append(batch)

    signals.batch_finished.connect(receiver)
    try:
        read = [sql for sql in settle(rows[2:]) if f'"{batches}"."body"' in sql]
    finally:
        signals.batch_finished.disconnect(receiver)
    assert len(read) == 1
    # A receiver gets each batch whole, as it is once finished, in id order.
    assert [b.id for b in received] == [b.id for b in made[2:] if b is not None]
    assert all(b.finished_at is not None and b.remaining == 0 for b in received)
    assert all(json.loads(b.body) == NOTE for b in received)


@pytest.mark.django_db
def test_the_priority_lane_is_claimed_first_and_the_low_lane_last(settings: object) -> None:
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,  # type: ignore[attr-defined]
        "PRIORITY_MAX_INBOXES": 1,
    }
    send_batch(ALICE, NOTE, inboxes(2, "low.example"), {"low_priority": True})
    send(ALICE, NOTE, inboxes(3, "fanout.example"))
    send(ALICE, NOTE, inboxes(1, "dm.example"))
    order = [row.host for row in store.claim(6, lease=300)]
    assert order == ["dm.example"] + ["fanout.example"] * 3 + ["low.example"] * 2
    assert set(Delivery.objects.values_list("lane", flat=True)) == {
        Lane.PRIORITY,
        Lane.NORMAL,
        Lane.LOW,
    }


@pytest.mark.django_db
def test_a_claim_can_leave_out_busy_hosts() -> None:
    send(ALICE, NOTE, inboxes(3, "busy.example") + inboxes(2, "idle.example"))
    hosts = {row.host for row in store.claim(10, lease=300, exclude_hosts=["busy.example"])}
    assert hosts == {"idle.example"}


def emptied_for_the_planner() -> None:
    """On PostgreSQL, the table emptied with its indexes: the rows earlier
    tests wrote and rolled back leave index pages behind, and a swollen index
    can cost the planner more than another, and be passed over."""
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute(f"TRUNCATE {Delivery._meta.db_table} CASCADE")


def analyze() -> None:
    """Statistics for the planner, so that its choice is the one it makes on a
    real table and not a guess about an empty one; on PostgreSQL also the
    vacuum autovacuum gives a table in use."""
    command = "VACUUM ANALYZE" if connection.vendor == "postgresql" else "ANALYZE"
    with connection.cursor() as cursor:
        cursor.execute(f"{command} {Delivery._meta.db_table}")


@pytest.mark.django_db(transaction=True)
def test_the_claim_reads_pending_rows_through_the_partial_index() -> None:
    # A queue as it looks in use: most rows settled long ago, a few pending.
    emptied_for_the_planner()
    send(ALICE, NOTE, inboxes(2000, "settled.example"))
    Delivery.objects.update(status=Status.DELIVERED, settled_at=timezone.now())
    send(ALICE, NOTE, inboxes(20))
    analyze()
    # The statements the claim itself runs, explained as run: one a lane,
    # until the claim has its two (none from the webhook and priority lanes,
    # two from the normal). Its candidates (CANDIDATES for each wanted) are fewer than the
    # pending rows, as in a backlog: were they more, reading every pending row
    # through any index on status would do as well, and PostgreSQL may.
    with statements_run() as executed:
        assert len(store.claim(2, lease=300)) == 2
    # On SQLite a statement a lane reads its candidates (and one more takes
    # every lane's); on PostgreSQL one statement reads each lane's, and takes them.
    claims = [(sql, params) for sql, params in executed if "lane = %s" in sql]
    lanes = [[p for p in params if isinstance(p, str) and p in Lane.values] for _, params in claims]
    if connection.vendor == "postgresql":
        assert lanes == [[Lane.WEBHOOK, Lane.PRIORITY, Lane.NORMAL, Lane.LOW]], executed
    else:
        assert lanes == [[Lane.WEBHOOK], [Lane.PRIORITY], [Lane.NORMAL]], executed
    explain = "EXPLAIN" if connection.vendor == "postgresql" else "EXPLAIN QUERY PLAN"
    with connection.cursor() as cursor:
        for (sql, params), read in zip(claims, lanes, strict=True):
            cursor.execute(f"{explain} {sql}", params)
            plan = " ".join(str(row) for row in cursor.fetchall())
            assert plan.count("fd_delivery_due") == len(read), plan


@contextlib.contextmanager
def prepared_statements(threshold: int | None, mode: str = "auto") -> Iterator[None]:
    """PostgreSQL: psycopg preparing statements as ``OPTIONS["prepare_threshold"]``
    has it (None: never), the server planning them as its ``plan_cache_mode``;
    none prepared on the connection to begin with (psycopg forgets its own
    when it sees them deallocated)."""
    connection.ensure_connection()
    raw = connection.connection
    before = raw.prepare_threshold
    raw.prepare_threshold = threshold
    with connection.cursor() as cursor:
        cursor.execute("DEALLOCATE ALL")
        cursor.execute("SELECT set_config('plan_cache_mode', %s, false)", [mode])
    try:
        yield
    finally:
        raw.prepare_threshold = before
        with connection.cursor() as cursor:
            cursor.execute("RESET plan_cache_mode")


def prepared_names() -> dict[str, str]:
    """The statements prepared on this connection: each one's name by its text."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT statement, name FROM pg_prepared_statements")
        return dict(cursor.fetchall())


def numbered(sql: str) -> str:
    """A statement as psycopg sends it bound on the server: $1, $2… for %s."""
    counter = iter(range(1, sql.count("%s") + 1))
    return re.sub("%s", lambda _: f"${next(counter)}", sql).replace("%%", "%")


@pytest.mark.django_db(transaction=True)
def test_on_postgresql_the_statements_are_prepared_when_the_project_asks_and_only_then() -> None:
    if connection.vendor != "postgresql":
        pytest.skip("prepared statements are PostgreSQL's")
    send(ALICE, NOTE, inboxes(40))

    def claim_and_settle() -> None:
        rows = store.claim(4, lease=300, per_host=4)
        store.settle([store.Settlement(row, Status.DELIVERED, 1) for row in rows])

    with prepared_statements(None):
        for _ in range(4):
            claim_and_settle()
            send(ALICE, NOTE, inboxes(1, "b.example"))
        assert not [text for text in prepared_names() if "federation_delivery" in text]
    with prepared_statements(2), statements_run() as executed:
        for _ in range(3):
            claim_and_settle()
            send(ALICE, NOTE, inboxes(1, "b.example"))
    prepared = prepared_names()
    ran = {sql for sql, _ in executed if "federation_delivery" in sql}
    # The claim, the settle and a one-inbox send, each its one statement.
    assert len(ran) >= 3, ran
    for sql in ran:
        assert numbered(sql) in prepared, sql


@pytest.mark.django_db(transaction=True)
def test_on_postgresql_statements_asked_prepared_are_logged_whole_while_django_logs() -> None:
    if connection.vendor != "postgresql":
        pytest.skip("prepared statements are PostgreSQL's")
    send(ALICE, NOTE, inboxes(8))
    # Prepared at their first run, were psycopg given them to prepare; a
    # debug toolbar, a DEBUG log or assertNumQueries reads each one's text.
    with prepared_statements(0), CaptureQueriesContext(connection) as logged:
        for _ in range(2):
            rows = store.claim(2, lease=300, per_host=2)
            store.settle([store.Settlement(row, Status.DELIVERED, 1) for row in rows])
    texts = [query["sql"] for query in logged.captured_queries]
    assert len(texts) >= 4, texts
    assert all(texts), texts
    assert sum("SKIP LOCKED" in text for text in texts) == 2, texts


@pytest.mark.parametrize("plan", ["custom", "generic"])
@pytest.mark.django_db(transaction=True)
def test_a_claim_and_a_settle_find_their_rows_by_id_however_few_the_planner_guesses(
    plan: str,
) -> None:
    if connection.vendor != "postgresql":
        pytest.skip("SQLite's claim and settle read the rows they write by id, as written")
    # A table small enough that, told only that the rows taken or settled
    # are "some rows", the planner would hash them against a scan of all of it.
    emptied_for_the_planner()
    send(ALICE, NOTE, inboxes(2000, "settled.example"))
    analyze()
    # Generic: the plan a prepared statement is given once for all the values
    # it will be run with, which the server may keep after five runs.
    threshold, mode = (0, "force_generic_plan") if plan == "generic" else (None, "auto")
    with prepared_statements(threshold, mode), statements_run() as executed:
        rows = store.claim(64, lease=300, per_host=64)
        store.settle([store.Settlement(row, Status.DELIVERED, 1) for row in rows])
        # The claim's statement (its lanes' CTEs first), then the settle's.
        statements = [(sql, params) for sql, params in executed if sql.startswith("WITH")]
        assert len(statements) == 2, executed
        names = prepared_names()
        plans = []
        with connection.cursor() as cursor:
            for sql, params in statements:
                if plan == "generic":
                    marks = ", ".join(["%s"] * len(params))
                    cursor.execute(f"EXPLAIN EXECUTE {names[numbered(sql)]}({marks})", params)
                else:
                    cursor.execute(f"EXPLAIN {sql}", params)
                plans.append([row for (row,) in cursor.fetchall()])
    for plan in plans:
        text = "\n".join(plan)
        assert f"Seq Scan on {Delivery._meta.db_table}" not in text, text
        assert reads_by_primary_key(text, Delivery._meta.db_table), text
    # The settle's batches, however read, are read for the ids it was given:
    # never all of the table, in a join the planner's guesses put first. A
    # delivery it releases looks its own batch up by its key, and a
    # retraction's the batches about its object by their index
    # (next_retracted in queries.sql): a lookup a row released.
    batch_scans = [
        n
        for n, line in enumerate(plans[1])
        if re.search(rf"Scan .*on {Batch._meta.db_table}\b", line)
    ]
    assert batch_scans, plans[1]
    for n in batch_scans:
        condition = next(line for line in plans[1][n + 1 :] if "Cond:" in line or "Filter:" in line)
        looked_up = "Index Scan" in plans[1][n] and "Index Cond:" in condition
        assert "ANY" in condition or looked_up, "\n".join(plans[1])


@pytest.mark.django_db
def test_on_postgresql_a_settle_counts_its_batches_down_in_place() -> None:
    if connection.vendor != "postgresql":
        pytest.skip("a page's room for updates (fillfactor) is PostgreSQL's")
    # One-inbox sends, a batch a delivery, with bodies the size of a post's.
    for n in range(30):
        send(ALICE, {"type": "Note", "content": "x" * 1000}, [f"https://h{n}.example/inbox"])
    rows = store.claim(30, lease=300)

    def updates() -> tuple[int, int]:
        """The batch table's updates in this transaction so far, and those in place."""
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_xact_user_tables WHERE relname = %s",
                [Batch._meta.db_table],
            )
            return cursor.fetchone()  # type: ignore[no-any-return]

    before = updates()
    store.settle([store.Settlement(row, Status.DELIVERED, 1) for row in rows])
    after = updates()
    # Each batch's row updated once, on its own page: no index of the table touched.
    assert (after[0] - before[0], after[1] - before[1]) == (30, 30)


@pytest.mark.django_db(transaction=True)
def test_on_postgresql_a_settle_locks_first_only_the_batches_of_more_than_one_delivery() -> None:
    # Batches counted down by several settles at once are locked first, in id
    # order, so that those settles wait on each other rather than deadlock. A
    # batch of one delivery (a one-inbox send's) has one writer at a time,
    # whoever holds that delivery: locking it first is a write for nothing.
    # Another transaction's FOR KEY SHARE (what a foreign key's check takes)
    # waits out a lock taken first (FOR UPDATE), not the count's UPDATE.
    if connection.vendor != "postgresql":
        pytest.skip("on SQLite a settle holds the database's write lock, not rows'")
    single = send(ALICE, NOTE, ["https://one.example/inbox"])
    pair = send(ALICE, NOTE, inboxes(2, "two.example"))
    claimed = {row.batch_id: row for row in store.claim(3, lease=300)}
    assert len(claimed) == 2
    other = connections.create_connection("default")
    try:
        with other.cursor() as cursor:
            cursor.execute("BEGIN")
            cursor.execute(
                f"SELECT id FROM {Batch._meta.db_table} WHERE id IN (%s, %s) FOR KEY SHARE",
                [single.id, pair.id],
            )
            with connection.cursor() as ours:
                ours.execute("SET lock_timeout = '2s'")
            try:
                one = store.Settlement(claimed[single.id], Status.DELIVERED, 1)
                assert store.settle([one]) == {claimed[single.id].id}
                of_two = store.Settlement(claimed[pair.id], Status.DELIVERED, 1)
                with pytest.raises(OperationalError):
                    store.settle([of_two])
            finally:
                with connection.cursor() as ours:
                    ours.execute("RESET lock_timeout")
            cursor.execute("COMMIT")
    finally:
        other.close()
    # The one that waited wrote nothing; once the lock is gone it is written.
    assert Delivery.objects.get(id=claimed[pair.id].id).status == Status.PENDING
    assert store.settle([of_two]) == {claimed[pair.id].id}
    assert list(Batch.objects.order_by("id").values_list("remaining", flat=True)) == [0, 1]
    assert Batch.objects.get(id=single.id).finished_at is not None


def at_once(target: Any, threads: int) -> None:
    """Run ``target`` in that many threads at once, and wait for them all."""
    started = [threading.Thread(target=target) for _ in range(threads)]
    for thread in started:
        thread.start()
    for thread in started:
        thread.join(60)


@pytest.mark.django_db(transaction=True)
def test_waiting_and_settled_deliveries_are_found_through_indexes_of_those_rows_alone() -> None:
    # Most rows neither wait on another nor are settled recently: the indexes
    # on after_id and settled_at hold only the rows where those are set, and
    # what looks for those rows reads them there.
    from django_federation_delivery import retention
    from django_federation_delivery.store import sequences

    emptied_for_the_planner()
    long_ago = timezone.now() - dt.timedelta(days=40)
    send(ALICE, NOTE, inboxes(2000, "settled.example"))
    Delivery.objects.update(status=Status.DELIVERED, settled_at=long_ago)
    send(ALICE, NOTE, inboxes(500, "pending.example"))
    first = send_batch(ALICE, NOTE, inboxes(3), {"ordering_key": "note-1"})
    send_batch(ALICE, {"type": "Delete"}, inboxes(3), {"ordering_key": "note-1"})
    assert first is not None
    waited_on = list(Delivery.objects.filter(batch=first).values_list("id", flat=True))
    # Given up: they left their sequences, which release_next goes on without.
    Delivery.objects.filter(id__in=waited_on).update(
        status=Status.FAILED, settled_at=timezone.now(), due_at=None
    )
    analyze()
    with statements_run() as executed:
        sequences.release_next(waited_on, timezone.now(), None)
        retention.purge({Status.DELIVERED: long_ago + dt.timedelta(days=1)}, chunk=100)
    released = [run for run in executed if "after_id = NULL WHERE" in run[0]]
    oldest = [run for run in executed if "ORDER BY settled_at" in run[0]]
    assert released and oldest, executed
    explain = "EXPLAIN" if connection.vendor == "postgresql" else "EXPLAIN QUERY PLAN"
    with connection.cursor() as cursor, transaction.atomic():
        for (sql, params), index in [
            (released[0], "fd_delivery_after"),
            (oldest[0], "fd_delivery_settled"),
        ]:
            cursor.execute(f"{explain} {sql}", params)
            plan = " ".join(str(row) for row in cursor.fetchall())
            assert index in plan, plan
    assert Delivery.objects.filter(after__isnull=False).count() == 0, "released"
    assert not Delivery.objects.filter(status=Status.DELIVERED).exists(), "purged"


@pytest.mark.django_db(transaction=True)
def test_an_ordered_send_finds_what_it_waits_on_by_its_index_whatever_the_statistics() -> None:
    # Statistics of a queue long settled (few pending rows, many small
    # batches) had each inbox's last pending delivery read through the due
    # index, every pending row read and sorted: an ordered post to 10,000
    # inboxes behind another took 15.7 s, 0.44 s by the sequences' index.
    from .conftest import run_explained, statements_of_undone, statistics_of_a_server

    statistics_of_a_server()
    urls = [f"https://h{n % 100}.example/u{n}/inbox" for n in range(10_000)]
    send_batch(ALICE, NOTE, urls, {"ordering_key": "timeline"})
    with statements_of_undone() as executed:
        send_batch(ALICE, NOTE, urls, {"ordering_key": "timeline"})
    # Planned as they were as the send ran (the table grows as it writes).
    looked = [plan for sql, plan in run_explained(executed) if "ORDER BY d.id DESC LIMIT 1" in sql]
    assert looked, executed
    for plan in looked:
        assert "fd_delivery_sequence" in plan and "fd_delivery_due" not in plan, plan


@pytest.mark.django_db(transaction=True)
def test_what_an_ordered_send_waits_on_is_found_in_the_sequences_index() -> None:
    # A webhook destination down for a day has thousands of events pending:
    # each new event finds the last of its sequence in the partial index on
    # (sequence, id), never by reading every pending row.
    from django_federation_delivery.store import sequences

    emptied_for_the_planner()
    send(ALICE, NOTE, inboxes(2000, "pending.example"))
    send_batch(ALICE, NOTE, inboxes(3), {"ordering_key": "note-1"})
    analyze()
    with statements_run() as executed, transaction.atomic():
        found = sequences.last_of_sequences("note-1", None, inboxes(3), "default")
    assert len(found) == 3
    looked = [(sql, params) for sql, params in executed if "ORDER BY d.id DESC" in sql]
    assert len(looked) == 1, executed
    explain = "EXPLAIN" if connection.vendor == "postgresql" else "EXPLAIN QUERY PLAN"
    with connection.cursor() as cursor:
        cursor.execute(f"{explain} {looked[0][0]}", looked[0][1])
        plan = " ".join(str(row) for row in cursor.fetchall())
    # A step back in the index a sequence, never a read of all its entries.
    assert "fd_delivery_sequence" in plan, plan
    assert "GROUP BY" not in plan and "Aggregate" not in plan, plan


@pytest.mark.django_db(transaction=True)
def test_concurrent_claims_never_take_the_same_delivery() -> None:
    send(ALICE, NOTE, inboxes(200))
    taken: list[list[int]] = []
    errors: list[BaseException] = []

    def claim_all() -> None:
        mine: list[int] = []
        try:
            while rows := store.claim(7, lease=300):
                mine.extend(row.id for row in rows)
        except BaseException as exc:
            errors.append(exc)
        finally:
            taken.append(mine)
            connections.close_all()

    at_once(claim_all, 4)
    assert not errors, errors
    every = [id for ids in taken for id in ids]
    assert len(every) == len(set(every)) == 200


@pytest.mark.django_db(transaction=True)
def test_concurrent_claims_and_settles_wait_for_each_other_rather_than_fail() -> None:
    # On SQLite a claim and a settle read rows before they write them: each
    # must hold the write lock from the start, even where a transaction
    # begins deferred (as in these tests), or a write between the two fails.
    # Eight batches, which the four threads' settles count down at once.
    for n in range(8):
        send(ALICE, NOTE, inboxes(5, f"a{n}.example") + inboxes(5, f"b{n}.example"))
    errors: list[BaseException] = []

    def claim_and_settle() -> None:
        try:
            while rows := store.claim(3, lease=300):
                store.settle(
                    [store.Settlement(claimed=r, status=Status.DELIVERED, attempts=1) for r in rows]
                )
        except BaseException as exc:
            errors.append(exc)
        finally:
            connections.close_all()

    at_once(claim_and_settle, 4)
    assert not errors, errors
    assert Delivery.objects.filter(status=Status.DELIVERED, attempts=1).count() == 80
    assert list(Batch.objects.values_list("remaining", flat=True)) == [0] * 8
    assert not Batch.objects.filter(finished_at__isnull=True).exists()


@pytest.mark.django_db
def test_a_claim_and_a_settle_run_the_same_statements_whatever_their_number_of_rows() -> None:
    # The same text each time: the database prepares each statement once
    # (SQLite keeps what it prepared by the text), whatever the number of
    # hosts left out of the claim or of rows settled.
    send(ALICE, NOTE, inboxes(20, "a.example") + inboxes(20, "b.example"))

    def statements(claim: Any) -> tuple[list[str], list[str]]:
        with statements_run() as executed:
            rows = claim()
            claiming = [sql for sql, _ in executed]
            executed.clear()
            store.settle(
                [store.Settlement(claimed=r, status=Status.DELIVERED, attempts=1) for r in rows]
            )
        assert rows
        return claiming, [sql for sql, _ in executed]

    one = statements(lambda: store.claim(1, lease=300, exclude_hosts=["x.example"]))
    many = statements(
        lambda: store.claim(
            12, lease=300, exclude_hosts=[f"x{n}.example" for n in range(30)], per_host=6
        )
    )
    assert one == many


@pytest.mark.django_db
def test_a_settle_writes_counts_down_and_adds_to_the_history_what_held_its_claim() -> None:
    fan_out = send(ALICE, NOTE, inboxes(3, "a.example"))
    single = send(ALICE, NOTE, ["https://b.example/inbox"])
    lapsed = send(ALICE, NOTE, ["https://c.example/inbox"])
    assert fan_out and single and lapsed
    rows = {row.inbox: row for row in store.claim(10, lease=300)}
    assert len(rows) == 5
    now = timezone.now()
    a0, a1, a2 = (rows[f"https://a.example/u{n}/inbox"] for n in range(3))
    b, c = rows["https://b.example/inbox"], rows["https://c.example/inbox"]
    finished: list[list[int]] = []
    with statements_run() as executed:
        written = store.settle(
            [
                store.Settlement(a0, Status.DELIVERED, 1, attempted_at=now),
                store.Settlement(a1, Status.REFUSED, 1, last_status=410, attempted_at=now),
                store.Settlement(
                    a2,
                    Status.PENDING,
                    1,
                    due_at=now + dt.timedelta(minutes=5),
                    last_status=503,
                    attempted_at=now,
                    retried=True,
                ),
                store.Settlement(b, Status.DELIVERED, 1, attempted_at=now),
                # Its lease lapsed and another holds it: nothing of it is written or counted.
                store.Settlement(
                    dataclasses.replace(c, token="not-the-holders"), Status.DELIVERED, 1
                ),
            ],
            on_finished=finished.append,
        )
    assert written == {a0.id, a1.id, a2.id, b.id}
    if connection.vendor == "postgresql":
        assert len(executed) == 1, executed
    states = dict(Delivery.objects.values_list("inbox", "status"))
    assert [states[row.inbox] for row in (a0, a1, a2, b, c)] == [
        Status.DELIVERED,
        Status.REFUSED,
        Status.PENDING,
        Status.DELIVERED,
        Status.PENDING,
    ]
    assert Delivery.objects.get(id=a2.id).lease_token is None
    fan_out.refresh_from_db()
    single.refresh_from_db()
    lapsed.refresh_from_db()
    assert (fan_out.remaining, fan_out.finished_at) == (1, None)
    assert single.remaining == 0 and single.finished_at is not None
    assert (lapsed.remaining, lapsed.finished_at) == (1, None)
    assert finished == [[single.id]]
    (minute,) = DeliveryHistory.objects.all()
    assert minute.minute == history.minute_of(now)
    assert (minute.delivered, minute.refused, minute.retried, minute.failed) == (2, 1, 1, 0)


@pytest.mark.django_db
@pytest.mark.parametrize(
    "refused",
    [{"last_status": -1}, {"last_error": "answered: \x00"}],
    ids=["a status below zero", "a NUL"],
)
def test_a_settlement_the_database_refuses_is_failed_alone_the_others_written(
    refused: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    # Refused, the settle of all three was taken for the database away: none
    # was written, all were tried again while their lease held, then sent again.
    if "last_error" in refused and connection.vendor != "postgresql":
        pytest.skip("SQLite's text holds a NUL")
    batch = send(ALICE, NOTE, inboxes(3))
    assert batch is not None
    a, b, c = sorted(store.claim(10, lease=300), key=lambda row: row.id)
    now = timezone.now()
    finished: list[list[int]] = []
    instead: list[store.Settlement] = []
    with caplog.at_level(logging.WARNING, logger="django_federation_delivery"):
        written = store.settle(
            [
                store.Settlement(a, Status.DELIVERED, 1, last_status=202, attempted_at=now),
                store.Settlement(
                    b,
                    Status.PENDING,
                    1,
                    due_at=now + dt.timedelta(minutes=5),
                    attempted_at=now,
                    retried=True,
                    **refused,
                ),
                store.Settlement(c, Status.DELIVERED, 1, last_status=202, attempted_at=now),
            ],
            on_finished=finished.append,
            on_failed_instead=instead.append,
        )
    assert written == {a.id, b.id, c.id}
    # A retry written failed: to be told delivery_failed, as written.
    assert [(i.claimed.id, i.status, i.last_error) for i in instead] == [
        (b.id, Status.FAILED, Delivery.objects.get(id=b.id).last_error)
    ]
    rows = {row.id: row for row in Delivery.objects.all()}
    assert [rows[row.id].status for row in (a, b, c)] == [
        Status.DELIVERED,
        Status.FAILED,
        Status.DELIVERED,
    ]
    failed = rows[b.id]
    assert (failed.attempts, failed.last_status, failed.lease_token, failed.due_at) == (
        1,
        None,
        None,
        None,
    )
    assert failed.last_error.startswith("the database refused its outcome (")
    assert "answered" not in failed.last_error, "the value refused is not repeated"
    assert finished == [[batch.id]]
    (minute,) = DeliveryHistory.objects.all()
    assert (minute.delivered, minute.retried, minute.failed) == (2, 0, 1)
    assert f"Delivery {b.id} could not be settled (" in caplog.text
    assert "failed instead" in caplog.text


@pytest.mark.django_db
@pytest.mark.parametrize("status", [Status.FAILED, Status.REFUSED])
def test_a_failure_the_database_refuses_is_failed_and_not_told_again(status: Status) -> None:
    # Its delivery_failed was told before the write.
    send(ALICE, NOTE, inboxes(1))
    (row,) = store.claim(10, lease=300)
    instead: list[store.Settlement] = []
    written = store.settle(
        [store.Settlement(row, status, 1, last_status=-1, attempted_at=timezone.now())],
        on_failed_instead=instead.append,
    )
    assert written == {row.id}
    assert Delivery.objects.get(id=row.id).status == Status.FAILED
    assert instead == []


@pytest.mark.django_db
def test_a_settlement_refused_even_as_failed_is_left_to_its_lease_the_others_written(
    caplog: pytest.LogCaptureFixture,
) -> None:
    send(ALICE, NOTE, inboxes(2))
    a, b = sorted(store.claim(10, lease=300), key=lambda row: row.id)
    with caplog.at_level(logging.ERROR, logger="django_federation_delivery"):
        written = store.settle(
            [
                store.Settlement(a, Status.DELIVERED, 1),
                # Its attempts are what is refused, and kept when it is failed.
                store.Settlement(b, Status.DELIVERED, -1),
            ]
        )
    assert written == {a.id}
    assert Delivery.objects.get(id=a.id).status == Status.DELIVERED
    left = Delivery.objects.get(id=b.id)
    assert (left.status, left.lease_token) == (Status.PENDING, b.token)
    assert f"Delivery {b.id} could not be settled (" in caplog.text
    assert "left to its lease" in caplog.text


@pytest.mark.django_db
def test_an_ordered_delivery_waits_until_the_one_before_it_to_that_inbox_settles() -> None:
    first = send_batch(
        ALICE,
        {"type": "Create"},
        ["https://a.example/inbox", "https://b.example/inbox"],
        {"ordering_key": "note-1"},
    )
    second = send_batch(
        ALICE, {"type": "Delete"}, ["https://a.example/inbox"], {"ordering_key": "note-1"}
    )
    other_key = send_batch(
        ALICE, {"type": "Like"}, ["https://a.example/inbox"], {"ordering_key": "note-2"}
    )
    assert first is not None and second is not None and other_key is not None
    held = Delivery.objects.get(batch=second)
    assert held.due_at is None and held.after is not None
    assert held.after.batch_id == first.id
    claimed = store.claim(10, lease=300)
    assert {row.batch_id for row in claimed} == {first.id, other_key.id}, "a's Delete waits"
    for_a = next(row for row in claimed if row.batch_id == first.id and "a.example" in row.inbox)
    store.settle([store.Settlement(claimed=for_a, status=Status.FAILED, attempts=12, ordered=True)])
    held.refresh_from_db()
    assert held.due_at is not None and held.after is None, "released by its predecessor's end"
    assert [row.batch_id for row in store.claim(10, lease=300)] == [second.id]


@pytest.mark.django_db
def test_a_requeued_delivery_waits_again_on_the_one_before_it_still_pending() -> None:
    key = {"ordering_key": "note-1"}
    create = send_batch(ALICE, {"type": "Create"}, ["https://a.example/inbox"], key)
    update = send_batch(ALICE, {"type": "Update"}, ["https://a.example/inbox"], key)
    like = send_batch(ALICE, {"type": "Like"}, ["https://a.example/inbox"], key)
    assert create is not None and update is not None and like is not None
    # The Create was attempted and is retrying; the Update waits on it, the Like on that.
    Delivery.objects.filter(batch=create).update(
        attempts=1, due_at=timezone.now() + dt.timedelta(minutes=5)
    )
    first = Delivery.objects.get(batch=create)
    second, third = Delivery.objects.get(batch=update), Delivery.objects.get(batch=like)
    assert (second.after_id, third.after_id) == (first.id, second.id)
    # Both given up, then requeued: each waits again on the one before it,
    # still pending (the Like on the Update, requeued with it), not due now.
    assert store.give_up_rows([second.id, third.id], "cancelled") == [second.id, third.id]
    assert store.requeue_rows([third.id, second.id]) == 2
    second.refresh_from_db()
    third.refresh_from_db()
    assert (second.status, second.after_id, second.due_at) == (Status.PENDING, first.id, None)
    assert (third.status, third.after_id, third.due_at) == (Status.PENDING, second.id, None)
    update.refresh_from_db()
    assert (update.remaining, update.finished_at) == (1, None)
    # What has nothing pending before it in its sequence is due at once.
    Delivery.objects.filter(id=first.id).update(
        status=Status.DELIVERED, settled_at=timezone.now(), due_at=None
    )
    store.give_up_rows([second.id, third.id], "cancelled")
    assert store.requeue_rows([second.id]) == 1
    second.refresh_from_db()
    assert second.after_id is None and second.due_at is not None


@pytest.mark.django_db(transaction=True)
def test_a_settle_leaves_a_row_a_send_holds_for_later_then_releases_what_the_send_queued() -> None:
    # It waited for the send's transaction, a view's, open as long as the
    # view liked, and every delivery of the deliverer's with it.
    if connection.vendor != "postgresql":
        pytest.skip("SQLite writes one at a time: a send and a settle never overlap")
    key = {"ordering_key": "note-1"}
    first = send_batch(ALICE, {"type": "Create"}, ["https://a.example/inbox"], key)
    assert first is not None
    (claimed,) = store.claim(1, lease=300)
    queued = threading.Event()
    settling = threading.Event()
    errors: list[BaseException] = []

    def send_and_hold() -> None:
        # A send that makes its delivery wait on the claimed one, which it
        # locks until it commits, a moment after the settle has begun.
        try:
            with transaction.atomic():
                send_batch(ALICE, {"type": "Delete"}, ["https://a.example/inbox"], key)
                queued.set()
                settling.wait(10)
                threading.Event().wait(0.3)
        except BaseException as exc:
            errors.append(exc)
        finally:
            queued.set()
            connections.close_all()

    sender = threading.Thread(target=send_and_hold)
    sender.start()
    queued.wait(10)
    busy: list[store.Settlement] = []
    written = store.settle(
        [store.Settlement(claimed, Status.DELIVERED, 1, ordered=True)], on_busy=busy.extend
    )
    settling.set()
    sender.join(10)
    assert not errors, errors
    assert written == set() and [item.claimed.id for item in busy] == [claimed.id]
    # Written again once the send has committed, as the deliverer's outbox does.
    assert store.settle(busy) == {claimed.id}
    waiting = Delivery.objects.exclude(batch=first).get()
    assert waiting.after_id is None and waiting.due_at is not None, "released by the settle"


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("fan_out", [1, 100], ids=["one-inbox", "beside-a-fan-out"])
def test_ordered_sends_at_once_with_one_key_still_make_one_line_of_waits(fan_out: int) -> None:
    # Web processes sending about one object at once: each delivery waits on
    # the one queued before it to its inbox, never two on the same one (they
    # would then be released, and sent, side by side). One of them sends to
    # ``fan_out`` inboxes, more than are locked one by one.
    errors: list[BaseException] = []
    key = {"ordering_key": "note-1"}
    shared = "https://a.example/inbox"
    many = [shared, *(f"https://h{n}.example/inbox" for n in range(fan_out - 1))]
    send_batch(ALICE, {"type": "Create"}, many, key)

    def sender(inboxes: list[str]) -> None:
        try:
            for n in range(8):
                send_batch(ALICE, {"type": "Update", "n": n}, inboxes, key)
        except BaseException as exc:
            errors.append(exc)
        finally:
            connections.close_all()

    threads = [
        threading.Thread(target=sender, args=(inboxes,)) for inboxes in (many, [shared], [shared])
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors, errors
    waits = list(Delivery.objects.filter(inbox=shared).values_list("after_id", flat=True))
    assert len(waits) == 25
    assert waits.count(None) == 1
    assert len(set(waits)) == 25
    for inbox in many[1:]:
        line = list(Delivery.objects.filter(inbox=inbox).values_list("after_id", flat=True))
        assert line.count(None) == 1 and len(set(line)) == 9


@pytest.mark.django_db
def test_an_ordered_send_waits_on_the_last_of_a_long_backlog() -> None:
    def queued(type: str) -> Batch:
        batch = send_batch(
            ALICE, {"type": type}, ["https://a.example/inbox"], {"ordering_key": "alerts"}
        )
        assert batch is not None
        return batch

    def statements(type: str) -> tuple[int, int | None]:
        with CaptureQueriesContext(connection) as queries:
            batch = queued(type)
        return len(queries), Delivery.objects.get(batch=batch).after_id

    for _ in range(3):
        queued("Backlog")
    few, _ = statements("Fourth")
    for _ in range(200):
        last = queued("Backlog")
    many, after = statements("Last")
    assert after == Delivery.objects.get(batch=last).id, "it waits on the one queued just before"
    assert many == few, "no statement more for a longer backlog"


@pytest.mark.django_db
def test_a_claim_takes_no_more_than_per_host_of_one_host() -> None:
    send(ALICE, NOTE, inboxes(50, "busy.example") + inboxes(3, "quiet.example"))
    hosts = collections.Counter(row.host for row in store.claim(64, lease=300, per_host=2))
    assert hosts == {"busy.example": 2, "quiet.example": 2}


@pytest.mark.django_db(transaction=True)
def test_per_host_holds_across_the_lanes_of_one_claim(settings: object) -> None:
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,  # type: ignore[attr-defined]
        "PRIORITY_MAX_INBOXES": 1,
    }
    for number in range(2):  # two direct messages to the host: the priority lane
        send(
            ALICE, {**NOTE, "id": f"https://social.example/dm/{number}"}, inboxes(1, "busy.example")
        )
    send(ALICE, NOTE, inboxes(3, "busy.example") + inboxes(1, "quiet.example"))
    claimed = store.claim(64, lease=300, per_host=2)
    lanes = Delivery.objects.in_bulk([row.id for row in claimed])
    # Two to the busy host in all, the priority lane's; not two more from the normal lane.
    assert [(row.host, lanes[row.id].lane) for row in claimed] == [
        ("busy.example", Lane.PRIORITY),
        ("busy.example", Lane.PRIORITY),
        ("quiet.example", Lane.NORMAL),
    ]


@pytest.mark.django_db(transaction=True)
def test_a_webhook_event_is_claimed_before_activities_queued_earlier(settings: object) -> None:
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,  # type: ignore[attr-defined]
        "PRIORITY_MAX_INBOXES": 1,
        "WEBHOOKS": {
            "ops": "http://127.0.0.1:9/hook?secret=whsec_QUJDREVGR0hJSktMTU5PUFFSU1RVVldYWVo0NTY3ODk="
        },
    }
    send(ALICE, NOTE, inboxes(200))  # a fan-out, due first
    send(ALICE, {**NOTE, "id": "https://social.example/dm"}, inboxes(1, "dm.example"))
    send_webhook("ops", "alert.raised", {"disk": "full"})
    claimed = store.claim(2, lease=300, per_host=2)
    # The event, then the direct message: neither behind the fan-out, and
    # the event before the activity sent before it.
    assert [(row.destination, row.host) for row in claimed] == [
        ("ops", Delivery.objects.get(kind="webhook").host),
        ("", "dm.example"),
    ]
    assert Delivery.objects.get(kind="webhook").lane == Lane.WEBHOOK


@pytest.mark.django_db(transaction=True)
def test_a_later_lanes_rows_are_not_locked_while_the_earlier_lanes_fill_the_claim() -> None:
    if connection.vendor != "postgresql":
        pytest.skip("row locks are PostgreSQL's; SQLite's claim holds the write lock")
    send(ALICE, NOTE, inboxes(20, "normal.example"))
    send_batch(ALICE, NOTE, inboxes(3, "low.example"), {"low_priority": True})
    other = connections.create_connection(connection.alias)
    try:
        with transaction.atomic():
            # Two wanted: 2 × CANDIDATES of the normal lane are locked, all of the
            # budget, and the low lane's are not even read.
            assert len(store.claim(2, lease=300, per_host=2)) == 2
            with other.cursor() as cursor:
                cursor.execute(
                    f"SELECT lane FROM {Delivery._meta.db_table} WHERE status = 'pending' "
                    "FOR UPDATE SKIP LOCKED"
                )
                free = collections.Counter(lane for (lane,) in cursor.fetchall())
    finally:
        other.close()
    assert free == {Lane.NORMAL: 20 - 2 * CANDIDATES, Lane.LOW: 3}


def a_batch() -> Batch:
    return Batch(sender=ALICE, body="{}", body_sha256="x")


@pytest.mark.django_db
def test_a_fan_out_is_inserted_a_bounded_chunk_at_a_time(monkeypatch: Any) -> None:
    monkeypatch.setattr(queueing, "CHUNK", 100)
    sizes: list[int] = []
    delivery_params = queueing._delivery_params

    def counting(connection: Any, batch: Batch, chunk: Any, *args: Any, **kwargs: Any) -> Any:
        sizes.append(len(chunk))
        return delivery_params(connection, batch, chunk, *args, **kwargs)

    monkeypatch.setattr(queueing, "_delivery_params", counting)
    targets = [store.Queued(inbox, "a.example") for inbox in inboxes(250)]
    with transaction.atomic(), CaptureQueriesContext(connection) as captured:
        batch = store.enqueue(a_batch(), targets)
    assert sizes == [100, 100, 50]
    insert = f'INSERT INTO "{Delivery._meta.db_table}"'
    assert sum(query["sql"].count(insert) for query in captured) == 3, "a statement a chunk"
    assert Delivery.objects.filter(batch=batch).count() == batch.size == 250


@pytest.mark.django_db
@pytest.mark.parametrize("logged", [False, True], ids=["plain", "queries logged"])
def test_a_statement_of_a_send_that_fails_raises_djangos_error_and_writes_nothing(
    logged: bool,
) -> None:
    # The same inbox twice breaks the one-delivery-an-inbox constraint.
    targets = [store.Queued("https://a.example/inbox", "a.example")] * 2
    logging = CaptureQueriesContext(connection) if logged else contextlib.nullcontext()
    with logging, pytest.raises(IntegrityError), transaction.atomic():
        store.enqueue(a_batch(), targets)
    assert not Batch.objects.exists() and not Delivery.objects.exists()
    send(ALICE, NOTE, ["https://a.example/inbox"])
    assert Delivery.objects.count() == 1, "the caller's transaction goes on"


def peak_of_enqueue(count: int) -> int:
    targets = [store.Queued(inbox, "a.example") for inbox in inboxes(count)]
    tracemalloc.start()
    try:
        with transaction.atomic():
            store.enqueue(a_batch(), targets)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.slow
@pytest.mark.django_db
def test_the_memory_a_fan_out_takes_does_not_grow_with_it() -> None:
    peak_of_enqueue(600)  # what is allocated once: compiled queries, caches
    # Each the least of two: tracemalloc counts every thread's, and a thread
    # an earlier test left winding down in this process may allocate meanwhile.
    small = min(peak_of_enqueue(1_500) for _ in range(2))
    large = min(peak_of_enqueue(6_000) for _ in range(2))
    # One chunk of rows at a time: four times the inboxes, not twice the peak
    # (all the rows at once would be over three times).
    assert large < small * 2, (small, large)


@pytest.mark.django_db
def test_a_delivery_to_a_paused_host_is_queued_with_no_due_time_in_every_chunk(
    monkeypatch: Any,
) -> None:
    from django_federation_delivery.controls import pause_host

    monkeypatch.setattr(queueing, "CHUNK", 3)
    pause_host("paused.example")
    send(ALICE, NOTE, inboxes(4, "paused.example") + inboxes(4, "open.example"))
    held = Delivery.objects.filter(host="paused.example")
    assert [row.due_at for row in held] == [None] * 4
    assert Delivery.objects.filter(host="open.example", due_at__isnull=False).count() == 4
    assert {row.host for row in store.claim(10, lease=300)} == {"open.example"}


@pytest.mark.django_db
def test_a_send_runs_the_same_few_statements_for_one_inbox_as_for_a_whole_chunk() -> None:
    def statements(count: int) -> list[str]:
        with CaptureQueriesContext(connection) as captured:
            send(ALICE, NOTE, inboxes(count, f"h{count}.example"))
        return [query["sql"].split(" ", 1)[0] for query in captured]

    # The hosts marked unavailable are read once a minute, not at each send.
    statements(2)
    one, chunk = statements(1), statements(store.CHUNK)
    assert one == chunk
    if connection.vendor == "postgresql":
        # The batch, its deliveries and the notification in one round trip.
        assert one == ["WITH"]
    else:
        assert one == ["INSERT", "INSERT"]
    assert len(statements(store.CHUNK + 1)) == len(one) + 1


@pytest.mark.django_db
def test_what_a_row_holds_is_written_as_it_is_whatever_its_characters() -> None:
    # PostgreSQL takes a statement's rows as arrays: nothing in a value may
    # be read as the array's own syntax.
    odd = ["https://a.example/a,b{c}\"d'e\\f", "NULL", "", "{}", "é\u202e"]
    targets = [
        store.Queued(inbox, "a.example", (f"https://g.example/{inbox}", "NULL")) for inbox in odd
    ]
    with transaction.atomic():
        batch = store.enqueue(a_batch(), targets)
    stored = Delivery.objects.filter(batch=batch).order_by("id")
    assert [(row.inbox, row.via) for row in stored] == [
        (target.inbox, list(target.via)) for target in targets
    ]


#: The one module that holds a cursor and runs statements, all of them named
#: in the one file it reads (migrations aside: they are Django's to run).
STATEMENTS = "store/sql.py"
#: How a statement's text begins.
STATEMENT = re.compile(r"\s*(SELECT|INSERT|UPDATE|DELETE|WITH|PRAGMA|LISTEN|UNLISTEN)\s")


def package_modules() -> Iterator[tuple[str, Any]]:
    import ast
    from pathlib import Path

    import django_federation_delivery

    package = Path(django_federation_delivery.__file__).parent
    for path in sorted(package.rglob("*.py")):
        name = path.relative_to(package).as_posix()
        if not name.startswith("migrations/"):
            yield name, ast.parse(path.read_text("utf-8"))


# Both read the package's source, the same under every Django: run once.
@pytest.mark.slow
def _calls_super(node: Any) -> bool:
    import ast

    return (
        isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super"
    )


def test_only_the_statements_module_touches_a_cursor() -> None:
    import ast

    found = []
    for name, tree in package_modules():
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("cursor", "execute", "executemany", "raw")
                # A command's own execute(), which BaseCommand's runs: no cursor's.
                and not _calls_super(node.func.value)
            ):
                found.append(f"{name}:{node.lineno} .{node.func.attr}()")
    assert found, "the statements module runs them"
    assert {place.split(":")[0] for place in found} == {STATEMENTS}, found


@pytest.mark.slow
def test_no_statement_is_written_outside_the_statements_file() -> None:
    import ast

    found = [
        f"{name}:{node.lineno} {node.value[:40]!r}"
        for name, tree in package_modules()
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and STATEMENT.match(node.value)
    ]
    assert found == []


@pytest.mark.parametrize("vendor", ["postgresql", "sqlite"])
def test_every_statement_is_written_out_whole_for_each_database(vendor: str) -> None:
    from django_federation_delivery.store import sql

    named = sql.statements_of(vendor)
    # Those of one database only, and some of both.
    assert {"claim", "settle", "take", "insert_batch"} & set(named) == (
        {"claim", "settle", "insert_batch"} if vendor == "postgresql" else {"take", "insert_batch"}
    )
    for statement in named.values():
        left = statement.text.replace("%s", "").replace("%(milliseconds)d", "")
        assert "{" not in left and "%" not in left, statement.name


def test_a_statement_is_given_exactly_the_parameters_it_names() -> None:
    from django_federation_delivery.store import sql

    take = sql.statements_of("sqlite")["take"]
    assert take.bind({"ids": "[1]", "token": "t", "until": "u"}) == ["u", "t", "[1]"]
    with pytest.raises(TypeError, match="takes"):
        take.bind({"ids": "[1]", "token": "t"})
    with pytest.raises(TypeError, match="takes"):
        take.bind({"ids": "[1]", "token": "t", "until": "u", "now": "n"})


@pytest.mark.django_db
@pytest.mark.parametrize(
    "via",
    [5, {"a": 1}, "https://gw.example/inbox", ["https://gw.example/inbox", 7]],
    ids=["a number", "an object", "a string", "a list of more than text"],
)
def test_a_row_whose_stored_gateways_are_not_a_list_of_urls_is_claimed_with_its_problem(
    via: Any,
) -> None:
    # Written by hand: send() writes a list of URLs or none.
    send(ALICE, NOTE, inboxes(3))
    bad, portable, plain = Delivery.objects.order_by("id")
    Delivery.objects.filter(id=bad.id).update(via=via)
    Delivery.objects.filter(id=portable.id).update(via=["https://gw.example/inbox"])

    claimed = {row.id: row for row in store.claim(10, lease=300)}

    assert len(claimed) == 3, "claimed with the others, not left in the way of a claim"
    assert claimed[bad.id].problem == "its stored gateways (via) are not a list of URLs"
    assert claimed[bad.id].via == (), "an object's keys are not read as gateways"
    assert (claimed[portable.id].via, claimed[portable.id].problem) == (
        ("https://gw.example/inbox",),
        "",
    )
    assert (claimed[plain.id].via, claimed[plain.id].problem) == ((), "")


@pytest.mark.django_db
def test_on_sqlite_a_batch_whose_body_is_a_blob_is_read_with_its_bytes() -> None:
    if connection.vendor != "sqlite":
        pytest.skip("only SQLite keeps a BLOB in a text column")
    blob, plain = send(ALICE, NOTE, inboxes(1)), send(ALICE, NOTE, inboxes(1, "b.example"))
    # Written by hand: send() writes text. SQLite's JSON functions refuse a BLOB.
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE federation_delivery_batch SET body = %s WHERE id = %s",
            [b'{"type": "Note"}', blob.id],
        )

    found = store.claims.batches([blob.id, plain.id])

    assert found[blob.id].body == b'{"type": "Note"}'
    assert found[plain.id].body == Batch.objects.get(id=plain.id).body.encode()
    assert found[blob.id].sender == found[plain.id].sender == ALICE


@pytest.mark.django_db(transaction=True)
def test_a_keyed_fan_out_looks_its_sequences_up_before_writing_them() -> None:
    # Statistics taken while the table was small (a fresh install, or
    # autovacuum after a purge): looked up a chunk at a time after the
    # chunks before it, each sequence's last pending delivery was found by
    # walking the primary key back through every row the send had written,
    # a chunk costing more than the one before (about 0.04 s more each).
    if connection.vendor != "postgresql":
        pytest.skip("PostgreSQL's planner")
    send(ALICE, NOTE, inboxes(20, "small.example"))
    Delivery.objects.all().delete()
    with connection.cursor() as cursor:
        cursor.execute(f"ANALYZE {Delivery._meta.db_table}")
    many = [f"https://h{n % 3000}.example/users/u{n}/inbox" for n in range(10_000)]
    with transaction.atomic():
        with connection.cursor() as cursor:
            # A statement that walks the send's own rows outlasts this.
            cursor.execute("SET LOCAL statement_timeout = '300ms'")
        batch = send_batch(ALICE, NOTE, many, {"ordering_key": f"{ALICE}/notes/1"})
    assert batch is not None and batch.size == 10_000


@pytest.mark.django_db(transaction=True)
def test_a_settle_of_an_ordered_row_deleted_since_its_claim_leaves_nothing_for_later() -> None:
    # Gone (its batch deleted by an operator) was taken for held by another
    # transaction: kept, and tried again every moment, for ever.
    batch = send_batch(
        ALICE, {"type": "Create"}, ["https://a.example/inbox"], {"ordering_key": "k"}
    )
    assert batch is not None
    (claimed,) = store.claim(1, lease=300)
    Batch.objects.filter(pk=batch.pk).delete()
    busy: list[store.Settlement] = []
    written = store.settle(
        [store.Settlement(claimed, Status.DELIVERED, 1, ordered=True)], on_busy=busy.extend
    )
    assert (written, busy) == (set(), [])
