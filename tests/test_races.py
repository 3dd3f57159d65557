"""Races between processes acting on the same rows at once, on PostgreSQL:
SQLite has one writer, and there these statements never overlap."""

from __future__ import annotations

import datetime as dt
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from django.core.management import call_command
from django.db import OperationalError, connection, connections, transaction
from django.db.models import QuerySet
from django.utils import timezone

from django_federation_delivery import (
    availability,
    controls,
    hosts,
    retention,
    send,
    send_batch,
    store,
)
from django_federation_delivery.models import Batch, Delivery, Host, Status
from django_federation_delivery.replay import replay
from django_federation_delivery.store import settlements
from django_federation_delivery.store.hosts import SeenHost, record_hosts

from .conftest import wait_until, waiting_on_locks
from .keys import ALICE

DAY = dt.timedelta(days=1)


def postgresql_only() -> None:
    if connection.vendor != "postgresql":
        pytest.skip("SQLite has one writer: these statements never overlap there")


def note(n: int) -> dict[str, Any]:
    return {"type": "Create", "id": f"{ALICE}/activities/{n}", "actor": ALICE}


class Side(threading.Thread):
    """One process's work, on a connection of its own: its result or error."""

    def __init__(self, work: Callable[[], Any]) -> None:
        super().__init__(daemon=True)
        self.work = work
        self.result: Any = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.result = self.work()
        except BaseException as exc:
            self.error = exc
        finally:
            connections.close_all()


def in_other_thread(work: Callable[[], Any], timeout: float = 20) -> list[Any]:
    """Run ``work`` to its end on a connection of its own; its result or error."""
    side = Side(work)
    side.start()
    side.join(timeout)
    assert not side.is_alive(), "the other side is stuck"
    return [side.result if side.error is None else side.error]


@pytest.mark.django_db(transaction=True)
def test_a_replay_meeting_a_purge_of_what_it_read_replays_the_rest_without_a_keyerror() -> None:
    """A replay reads the deliveries it replays, then their batches (their
    bodies). A purge (``run_deliverer --purge``, a periodic task) deleting
    one of those batches, old and emptied, in between made the whole replay
    fail with a bare ``KeyError: <batch id>`` and queue nothing. It replays
    what is still there."""
    postgresql_only()
    now = timezone.now()
    old = send(ALICE, note(1), ["https://a.example/inbox"])
    recent = send(ALICE, note(2), ["https://a.example/inbox"])
    assert old is not None and recent is not None
    Batch.objects.filter(pk=old.pk).update(created_at=now - 10 * DAY)
    Delivery.objects.filter(batch=old).update(
        status=Status.DELIVERED, settled_at=now - 10 * DAY, due_at=None
    )
    Delivery.objects.filter(batch=recent).update(
        status=Status.DELIVERED, settled_at=now - DAY, due_at=None
    )
    purged: list[Any] = []
    seen_rows = []

    def purge_meanwhile(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        # Once the replay has read its rows, and before it reads their batches.
        if (
            seen_rows
            and not purged
            and sql.lstrip().startswith("SELECT")
            and ('FROM "federation_delivery_batch"' in sql)
        ):
            purged.extend(
                in_other_thread(lambda: retention.purge({Status.DELIVERED: now - 7 * DAY}))
            )
        if '"federation_delivery_delivery"."via"' in sql:
            seen_rows.append(sql)
        return execute(sql, params, many, context)

    with connection.execute_wrapper(purge_meanwhile):
        replayed = replay(host="a.example", since=now - 30 * DAY)
    assert purged and purged[0].deleted == 1 and purged[0].batches == 1, purged
    assert [b.body for b in replayed if b.created] == [recent.body]


def hold_row(held: int | QuerySet[Any], holding: threading.Event, release: threading.Event) -> Side:
    """A transaction of its own holding the delivery ``held`` (an id), or
    the rows of ``held`` (a query), until ``release``."""
    rows = Delivery.objects.filter(id=held) if isinstance(held, int) else held

    def work() -> None:
        with transaction.atomic():
            list(rows.select_for_update().values_list("pk"))
            holding.set()
            release.wait(20)

    side = Side(work)
    side.start()
    assert holding.wait(10)
    return side


def crossed(held: int | QuerySet[Any], first: Callable[[], Any], second: Callable[[], Any]) -> None:
    """``first``, then ``second``, each on a connection of its own, while a
    third holds the row ``held`` (a delivery's id, or a query's rows): let
    go once both wait (or one has ended without waiting: a settle leaves a
    row another holds for later), past PostgreSQL's deadlock_timeout (1 s),
    so that a cycle between them is found. Neither may fail."""
    holding, release = threading.Event(), threading.Event()
    blocker = hold_row(held, holding, release)
    sides = [Side(first), Side(second)]
    waiting = 0
    for side in sides:
        side.start()
        wait_until(
            lambda side=side, waiting=waiting: (
                waiting_on_locks() == waiting + 1 or not side.is_alive()
            ),
            timeout=10,
        )
        waiting += side.is_alive()
    time.sleep(1.2)
    release.set()
    for side in (blocker, *sides):
        side.join(20)
    errors = [side.error for side in sides]
    assert errors == [None, None], errors


@pytest.mark.django_db(transaction=True)
def test_an_operators_give_up_while_a_deliverer_settles_the_same_rows_never_deadlocks() -> None:
    """An operator cancels a batch ("give up") while a deliverer writes the
    outcomes of its attempts at the same rows. The give-up locks the rows in
    id order; the settle in the order its outcomes came back (the outbox's
    JSON list drove its UPDATE). Two orders, one cycle: PostgreSQL aborted
    one with ``deadlock detected`` (40P01): the operator's give-up raised
    ``OperationalError`` (a 500 in the admin), or the deliverer logged "The
    database is unavailable (deadlock detected ...)" and waited it out. The
    settle now locks in id order too, and each waits for the other."""
    postgresql_only()
    from django_federation_delivery import store

    batch = send(ALICE, note(1), [f"https://a.example/u{n}/inbox" for n in range(3)])
    r1, r2, r3 = sorted(store.claim(10, lease=300), key=lambda r: r.id)
    # Another statement holds r2 a moment (a claim, a pause): the give-up
    # has locked r1 and waits for it. Then the deliverer's outcomes, r3's
    # answer first: it locks r3, and waits for r1.
    crossed(
        r2.id,
        lambda: controls.give_up(Delivery.objects.filter(batch=batch), "cancelled"),
        lambda: store.settle(
            [store.Settlement(claimed=r, status=Status.DELIVERED, attempts=1) for r in (r3, r1)]
        ),
    )
    # Whichever went first, every row is out of the queue, the batch finished once.
    assert not Delivery.objects.filter(batch=batch, status=Status.PENDING).exists()
    assert Batch.objects.get(pk=batch.pk).remaining == 0


@pytest.mark.django_db(transaction=True)
def test_a_send_retried_while_a_purge_deletes_its_kept_batch_queues_it_again() -> None:
    """README: a send with an idempotency key returns the batch kept under
    it, and "once the batch is purged, the key sends again". A retried send
    whose INSERT meets the kept batch just before a purge deletes it
    (``run_deliverer --purge`` deletes old batches left with no delivery)
    raised ``Batch.DoesNotExist: the batch kept under this idempotency key
    is gone`` and queued nothing: the view's retry failed with a 500. It
    writes the batch anew (the key is free again), as a send a moment later
    would."""
    postgresql_only()
    now = timezone.now()
    inbox = "https://a.example/inbox"
    first = send(ALICE, note(1), [inbox], idempotency_key="post-1")
    assert first is not None
    Batch.objects.filter(pk=first.pk).update(created_at=now - 10 * DAY)
    Delivery.objects.filter(batch=first).update(
        status=Status.DELIVERED, settled_at=now - 10 * DAY, due_at=None
    )
    purged: list[Any] = []

    def purge_meanwhile(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        answer = execute(sql, params, many, context)
        if not purged and "ON CONFLICT" in sql:
            # The INSERT met the kept batch; the purge deletes it now.
            purged.extend(
                in_other_thread(lambda: retention.purge({Status.DELIVERED: now - 7 * DAY}))
            )
        return answer

    with connection.execute_wrapper(purge_meanwhile):
        again = send(ALICE, note(1), [inbox], idempotency_key="post-1")
    assert purged and purged[0].batches == 1, purged
    assert again is not None and again.created
    assert Delivery.objects.filter(batch=again, status=Status.PENDING).count() == 1


@pytest.mark.django_db(transaction=True)
def test_a_requeue_while_a_purge_deletes_some_of_its_rows_never_deadlocks() -> None:
    """An operator requeues failed deliveries ("select all", "Requeue")
    while a purge (``run_deliverer --purge``) deletes the oldest of them. The
    requeue locks its rows (``select_for_update``, in id order); the purge
    deletes its chunk, then clears ``after_id`` on every row that once
    waited on one deleted (``forget_deleted``): among them a failed row the
    requeue holds, while the requeue waits for a row the purge deleted.
    PostgreSQL aborts one with ``deadlock detected``: the operator's requeue
    raised ``OperationalError`` (or the purge failed: "The purge failed").
    The one aborted is done again: the requeued row is kept, the other
    purged."""
    postgresql_only()
    now = timezone.now()
    batch = send(ALICE, note(1), [f"https://a.example/u{n}/inbox" for n in range(3)])
    assert batch is not None
    # d and x failed 40 days ago (past FAILED's 30 days); y, failed a day
    # ago, had waited on d (its sequence's turn) when it was given up.
    d, y, x = Delivery.objects.filter(batch=batch).order_by("id")
    Delivery.objects.filter(batch=batch).update(
        status=Status.FAILED, settled_at=now - 40 * DAY, due_at=None
    )
    Delivery.objects.filter(pk=y.pk).update(settled_at=now - DAY, after_id=d.pk)
    Delivery.objects.filter(pk=x.pk).update(last_error="gone")
    Batch.objects.filter(pk=batch.pk).update(remaining=0, finished_at=now - DAY)
    # Something holds y a moment (a statement of the admin's, another
    # requeue), while the requeue waits for it and the purge comes.
    crossed(
        y.pk,
        lambda: controls.requeue(Delivery.objects.filter(id__in=[y.pk, x.pk])),
        lambda: retention.purge({Status.FAILED: now - 30 * DAY}),
    )
    # y is never the purge's (failed a day ago): requeued whichever went first.
    assert Delivery.objects.get(pk=y.pk).status == Status.PENDING


def _emptied(compact: bool) -> None:
    """The queue emptied, its table compacted, or left with the dead rows of
    what was deleted, as a live table has them until vacuum: the layout
    decides the order a statement that names none locks its rows in."""
    Delivery.objects.all().delete()
    Batch.objects.all().delete()
    if compact:
        with connection.cursor() as cursor:
            cursor.execute(f"VACUUM FULL {Delivery._meta.db_table}")


#: Whether the table was compacted, which rows were rewritten since they
#: were queued (a claim, a hold: each moves its row in the table), and
#: which one another statement holds a moment.
LAYOUTS = [
    (compact, moved, held) for compact in (True, False) for moved in ((0,), (1,)) for held in (0, 1)
]


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_delete_superseding_what_an_operator_gives_up_at_once_never_deadlocks() -> None:
    """The Delete's ``supersede`` UPDATE locked its rows in the order its
    plan read them, the give-up lowest id first: PostgreSQL ended one with
    ``deadlock detected``, the send's when it lost (a 500, nothing queued).
    The rows are locked in id order first."""
    postgresql_only()
    urls = [f"https://a{n}.example/inbox" for n in range(3)]
    create = {"type": "Create", "id": f"{ALICE}/activities/1", "object": f"{ALICE}/notes/1"}
    delete = {"type": "Delete", "id": f"{ALICE}/activities/d", "object": f"{ALICE}/notes/1"}
    for compact, moved, held in LAYOUTS:
        _emptied(compact)
        first = send(ALICE, create, urls)
        assert first is not None
        rows = list(Delivery.objects.filter(batch=first).order_by("id"))
        for n in moved:
            Delivery.objects.filter(pk=rows[n].pk).update(due_at=timezone.now())
        crossed(
            rows[held].pk,
            lambda: send(ALICE, delete, urls),
            lambda first=first: controls.give_up(Delivery.objects.filter(batch=first)),
        )


def in_table_order(work: Callable[[], Any]) -> Callable[[], Any]:
    """``work``, its statements planned as scans of the table: what a
    statement that names no order locks its rows in is then the table's,
    where a row rewritten since comes last (an index's order may be that
    too, or not: whichever the planner picks)."""

    def planned() -> Any:
        with connection.cursor() as cursor:
            cursor.execute("SET enable_indexscan = off")
            cursor.execute("SET enable_bitmapscan = off")
        return work()

    return planned


def locked_now(ids: list[int]) -> list[int]:
    """Which of the deliveries ``ids`` another transaction holds locked now."""

    def probe() -> list[int]:
        locked = []
        for id in ids:
            try:
                with transaction.atomic():
                    list(Delivery.objects.select_for_update(nowait=True).filter(id=id))
            except OperationalError:
                locked.append(id)
        return locked

    [found] = in_other_thread(probe)
    return found  # type: ignore[no-any-return]


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("action", ["pause", "resume"])
def test_a_pause_or_resume_of_a_host_locks_its_rows_lowest_id_first(action: str) -> None:
    """A pause takes the due time of a host's pending deliveries, a resume
    gives it back, each in one UPDATE that locked its rows in the order its
    plan read them: the table's, where a row rewritten since comes last.
    Every other writer of many deliveries (a settle, an operator's give-up,
    a Delete's supersede) locks them lowest id first; crossing one of them,
    PostgreSQL ended one of the two with ``deadlock detected`` (a 500 in the
    admin). Held up on the lowest, the pause now holds none of the others."""
    postgresql_only()
    if action == "resume":
        hosts.pause_host("a.example")
    batch = send(ALICE, note(1), [f"https://a.example/u{n}/inbox" for n in range(3)])
    assert batch is not None
    first, *others = Delivery.objects.filter(batch=batch).order_by("id")
    # The first rewritten (a claim, a retry): last in the table.
    Delivery.objects.filter(pk=first.pk).update(due_at=timezone.now())
    if action == "resume":
        Delivery.objects.filter(pk=first.pk).update(due_at=None)
    change = hosts.pause_host if action == "pause" else hosts.resume_host
    holding, release = threading.Event(), threading.Event()
    blocker = hold_row(first.pk, holding, release)
    side = Side(in_table_order(lambda: change("a.example")))
    side.start()
    wait_until(lambda: waiting_on_locks() == 1, timeout=10)
    locked = locked_now([row.pk for row in others])
    release.set()
    for thread in (blocker, side):
        thread.join(20)
    assert locked == [], "it held later rows while it waited for the first"
    assert side.error is None and side.result == 3, (side.result, side.error)


def seen_host(name: str) -> SeenHost:
    now = timezone.now()
    return SeenHost(name, now, now, "", None, 12.0, 30.0, None, None)


def record(*names: str) -> None:
    record_hosts([seen_host(name) for name in names], now=timezone.now())


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("other", ["a deliverer", "another operator"])
def test_a_pause_of_hosts_in_the_hosts_lists_order_never_deadlocks(other: str) -> None:
    """The hosts list's "Pause" gives its names by trouble (a failing
    ``z.example`` before ``a.example``), and the pause upserted their rows
    in that order; a deliverer writing what it saw of them (every few
    seconds), and a pause from the deliveries list, lock them in name
    order. PostgreSQL ended one with ``deadlock detected``: the
    operator's pause (a 500) or the deliverer's write."""
    postgresql_only()
    record("a.example", "z.example")
    crossed(
        Host.objects.filter(name="z.example"),
        lambda: hosts.pause_hosts(["z.example", "a.example"]),
        (lambda: record("a.example", "z.example"))
        if other == "a deliverer"
        else (lambda: hosts.pause_hosts(["a.example", "z.example"])),
    )


@pytest.mark.django_db(transaction=True)
def test_a_purge_forgetting_hosts_while_an_operator_pauses_them_never_deadlocks() -> None:
    """The purge forgot old hosts in one DELETE, locking their rows in the
    order its plan read them (the table's: z, b, a); a pause of them from
    the hosts list locks them in name order. PostgreSQL ended one: the
    purge ("The purge failed") or the operator's pause (a 500)."""
    postgresql_only()
    for name in ("z.example", "b.example", "a.example"):
        Host.objects.create(name=name)
    Host.objects.update(updated_at=timezone.now() - 90 * DAY)
    crossed(
        Host.objects.filter(name="b.example"),
        lambda: retention.purge({Status.DELIVERED: timezone.now() - 7 * DAY}),
        lambda: hosts.pause_hosts(["a.example", "b.example", "z.example"]),
    )


@pytest.mark.django_db(transaction=True)
def test_marking_hosts_seen_while_a_deliverer_writes_them_never_deadlocks() -> None:
    """ "Mark the selected hosts as seen" locked the marked hosts in the
    order its plan read them (a host rewritten since last), a deliverer's
    write of what it saw of them in name order: PostgreSQL ended one."""
    postgresql_only()
    record("z.example")
    record("a.example")
    long_ago = timezone.now() - 3 * DAY
    Host.objects.update(failing_since=long_ago, unavailable_since=long_ago)
    Host.objects.filter(name="a.example").update(updated_at=timezone.now())  # last in the table
    crossed(
        Host.objects.filter(name="z.example"),
        in_table_order(lambda: availability.seen_all(["a.example", "z.example"], using="default")),
        lambda: record("a.example", "z.example"),
    )


#: A host on a port of its own and its neighbour: Python's sorted() puts
#: "a.example.net" first ("." before ":"), a database collated for people
#: (en_US, the official Docker image's; ICU's en-US) puts the port first.
PORTED, NEIGHBOUR = "a.example:8443", "a.example.net"


@pytest.fixture
def hosts_collated_en_us() -> Iterator[None]:
    """The host table's names collated as a database made in an en_US
    locale collates them (ICU's en-US here: the test server is made
    without a locale, where ORDER BY is Python's order)."""
    postgresql_only()
    table = Host._meta.db_table
    with connection.cursor() as cursor:
        cursor.execute(
            f'ALTER TABLE "{table}" ALTER COLUMN "name" TYPE varchar(255) COLLATE "en-US-x-icu"'
        )
        cursor.execute(
            f'SELECT name FROM "{table}" WHERE false UNION ALL '
            "SELECT name FROM (VALUES (%s), (%s)) AS v(name) ORDER BY 1",
            [NEIGHBOUR, PORTED],
        )
        assert [row[0] for row in cursor.fetchall()] == [PORTED, NEIGHBOUR]
    try:
        yield
    finally:
        with connection.cursor() as cursor:
            cursor.execute(
                f'ALTER TABLE "{table}" ALTER COLUMN "name" TYPE varchar(255) COLLATE "default"'
            )


@pytest.mark.django_db(transaction=True)
def test_marking_hosts_seen_while_a_deliverer_writes_them_never_deadlocks_in_en_us(
    hosts_collated_en_us: None,
) -> None:
    """ "Mark seen" locked the hosts ``ORDER BY name``, in the database's
    collation; a deliverer's record_hosts upserts them in Python's sorted()
    order. On a database made in an en_US locale the two orders differ for
    a host with a port beside its neighbour (``a.example:8443``,
    ``a.example.net``), and PostgreSQL ended one side with ``deadlock
    detected``. Every writer locks them by their code points."""
    record(PORTED, NEIGHBOUR)
    long_ago = timezone.now() - 3 * DAY
    Host.objects.update(failing_since=long_ago, unavailable_since=long_ago)
    crossed(
        Host.objects.filter(name=PORTED),
        lambda: availability.seen_all([NEIGHBOUR, PORTED], using="default"),
        lambda: record(PORTED, NEIGHBOUR),
    )


@pytest.mark.django_db(transaction=True)
def test_a_pause_of_hosts_while_they_are_resumed_never_deadlocks_in_en_us(
    hosts_collated_en_us: None,
) -> None:
    """A pause upserts its hosts in Python's sorted() order; a resume of the
    same hosts locked them ``ORDER BY name``, in the database's collation:
    on a database made in an en_US locale, PostgreSQL ended one of the two
    operators' actions with ``deadlock detected`` (a 500)."""
    hosts.pause_hosts([PORTED, NEIGHBOUR])
    crossed(
        Host.objects.filter(name=NEIGHBOUR),
        lambda: hosts.pause_hosts([PORTED, NEIGHBOUR]),
        lambda: hosts.resume_hosts([PORTED, NEIGHBOUR]),
    )


@pytest.mark.django_db(transaction=True)
def test_marking_more_than_a_chunk_of_hosts_seen_while_they_are_written_never_deadlocks() -> None:
    """ "Select all", then "Mark seen", on 501 hosts listed by trouble: the
    action, one transaction, locked its names a chunk of 500 at a time in
    the order given, each chunk in name order, so ``h000.example`` came
    after ``h500.example``; a deliverer's record_hosts locks them in name
    order over all: PostgreSQL ended one with ``deadlock detected``."""
    from django_federation_delivery.store.queueing import CHUNK

    postgresql_only()
    names = [f"h{n:03}.example" for n in range(CHUNK + 1)]
    long_ago = timezone.now() - 3 * DAY
    Host.objects.bulk_create(
        [Host(name=name, unavailable_since=long_ago, failing_since=long_ago) for name in names]
    )
    listed = names[1:] + names[:1]  # by trouble: h000.example last

    def mark_seen() -> int:
        with transaction.atomic():  # as the admin's action runs it
            return availability.seen_all(listed, using="default")

    crossed(
        Host.objects.filter(name=names[-1]),
        mark_seen,
        lambda: record(names[0], names[-1]),
    )


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_send_in_an_ordering_key_while_the_last_of_its_sequences_settle_never_deadlocks() -> None:
    """A send in an ordering key locked the last pending delivery of each
    of its sequences in no order, while a deliverer settled them, locked
    lowest id first: one of the two was ended with ``deadlock detected``."""
    postgresql_only()
    from django_federation_delivery import send_batch, store

    key = {"ordering_key": "timeline"}
    urls = [f"https://a{n}.example/inbox" for n in range(2)]
    for compact, moved, held in LAYOUTS:
        for send_first in (True, False):
            _emptied(compact)
            send_batch(ALICE, note(1), urls, key)
            rows = sorted(store.claim(10, lease=300), key=lambda r: r.id)
            for n in moved:
                Delivery.objects.filter(pk=rows[n].id).update(
                    due_at=timezone.now() + dt.timedelta(seconds=299)
                )
            works = [
                lambda: send_batch(ALICE, note(2), urls, key),
                lambda rows=rows: store.settle(
                    [
                        store.Settlement(
                            claimed=r, status=Status.DELIVERED, attempts=1, ordered=True
                        )
                        for r in rows
                    ]
                ),
            ]
            crossed(rows[held].id, *(works if send_first else reversed(works)))


@pytest.mark.django_db(transaction=True)
def test_a_delete_and_another_send_in_its_key_at_once_never_deadlock(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two views send at once in the object's ordering key: a Delete, and an
    Update, while an earlier Create to the inbox is pending. The Delete
    locked the Create's row (what it supersedes) before its sequence; the
    Update took the sequence, then waited on that row (the check of what
    it waits on): PostgreSQL ended one, its activity not queued (a 500).
    The Delete takes its sequence first, as every writer in a key does."""
    postgresql_only()
    from django_federation_delivery import retractions

    obj = f"{ALICE}/notes/1"
    url = "https://a.example/inbox"
    key = {"ordering_key": obj}
    assert send_batch(ALICE, {"type": "Create", "id": f"{ALICE}/a/1", "object": obj}, [url], key)
    locked, go = threading.Event(), threading.Event()
    real = retractions.lock_retracted

    def paused(*args: Any, **kwargs: Any) -> None:
        real(*args, **kwargs)  # what it supersedes locked
        locked.set()
        go.wait(10)

    monkeypatch.setattr(retractions, "lock_retracted", paused)
    delete = {"type": "Delete", "id": f"{ALICE}/a/d", "object": obj}
    update = {"type": "Update", "id": f"{ALICE}/a/2", "object": {"id": obj, "type": "Note"}}
    deleter = Side(lambda: send_batch(ALICE, delete, [url], key))
    deleter.start()
    assert locked.wait(10)
    updater = Side(lambda: send_batch(ALICE, update, [url], key))
    updater.start()
    wait_until(lambda: waiting_on_locks() == 1, timeout=10)
    time.sleep(0.3)
    go.set()
    for side in (deleter, updater):
        side.join(20)
    assert (deleter.error, updater.error) == (None, None)


@pytest.mark.django_db(transaction=True)
def test_a_delete_in_its_key_while_an_operator_gives_up_what_it_supersedes_never_deadlocks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A Delete sent with the object's ordering key locked the last delivery
    of the sequence (the Update's, a high id), and only then what it
    supersedes (the Create's, a lower id): an operator's give-up of the
    Create (which locks it, then releases the Update) crossed it, and the
    send was ended. It locks what it supersedes first."""
    postgresql_only()
    obj = f"{ALICE}/notes/1"
    url = "https://a.example/inbox"
    key = {"ordering_key": obj}
    create = send_batch(ALICE, {"type": "Create", "id": f"{ALICE}/a/1", "object": obj}, [url], key)
    update = send_batch(
        ALICE,
        {"type": "Update", "id": f"{ALICE}/a/2", "object": {"id": obj, "type": "Note"}},
        [url],
        key,
    )
    assert create is not None and update is not None
    c = Delivery.objects.get(batch=create)
    u = Delivery.objects.get(batch=update)
    assert u.after_id == c.id and u.id > c.id

    giver: dict[str, int] = {}
    locked, go = threading.Event(), threading.Event()
    real = settlements.release_next

    def paused(*args: Any, **kwargs: Any) -> Any:
        # The give-up has locked and failed c; a moment before it releases u.
        if threading.get_ident() == giver.get("ident") and not locked.is_set():
            locked.set()
            go.wait(10)
        return real(*args, **kwargs)

    monkeypatch.setattr(settlements, "release_next", paused)

    def give_up() -> int:
        giver["ident"] = threading.get_ident()
        return controls.give_up(Delivery.objects.filter(pk=c.pk))

    delete = {"type": "Delete", "id": f"{ALICE}/a/d", "object": obj}
    operator = Side(give_up)
    operator.start()
    assert locked.wait(10)
    sender = Side(lambda: send_batch(ALICE, delete, [url], key))
    sender.start()
    wait_until(lambda: waiting_on_locks() == 1, timeout=10)  # the Delete waits on c
    time.sleep(0.3)
    go.set()
    operator.join(20)
    sender.join(20)
    assert sender.error is None, f"the Delete's send failed: {sender.error!r}"
    assert operator.error is None, operator.error


@pytest.mark.django_db(transaction=True)
def test_a_deliverer_remembering_schemes_while_another_writes_its_hosts_never_deadlocks() -> None:
    """Two deliverers: one writes what it learnt of the schemes hosts accept
    (``KnownSchemes.write``, after each outbox flush) in the order it learnt
    them, the other what it saw of the same hosts (``record_hosts``, every
    10 s) in name order. PostgreSQL ends one with ``deadlock detected``: the
    deliverer logs "The database is unavailable" and drops its connection."""
    postgresql_only()
    record("a.example", "z.example")
    crossed(
        Host.objects.filter(name="z.example"),
        lambda: hosts.remember_schemes(
            {"z.example": "rfc9421", "a.example": "rfc9421"}, using="default"
        ),
        lambda: record("a.example", "z.example"),
    )


@pytest.mark.django_db(transaction=True)
def test_a_deliverer_closing_breakers_while_another_counts_their_failures_never_deadlocks() -> None:
    """Two deliverers flush their breakers at once: one saw the hosts answer
    (``record_successes``: one DELETE, its rows locked in the order its plan
    reads them, the table's for a small table), the other saw them fail
    (``count_failures``: upserts in key order, in one transaction).
    PostgreSQL ends one with ``deadlock detected``: that deliverer logs
    "The database is unavailable" and waits."""
    postgresql_only()
    from django_federation_delivery.breakers import record_successes
    from django_federation_delivery.models import Breaker
    from django_federation_delivery.store.breakers import count_failures

    for key in ("z.example", "m.example", "a.example"):  # in the table: z, m, a
        Breaker.objects.create(key=key, failures=1)
    crossed(
        Breaker.objects.filter(key="m.example"),
        lambda: count_failures(
            Counter({"a.example": 1, "m.example": 1, "z.example": 1}),
            threshold=100,
            cool_off=60,
            using="default",
        ),
        lambda: record_successes(["a.example", "m.example", "z.example"], using="default"),
    )


@pytest.fixture
def en_us_database(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A second database, made as the official PostgreSQL image makes one
    in an en_US locale (ICU's en-US here): its default collation orders a
    host with a port before its neighbour (``a.example:8443`` before
    ``a.example.net``), where Python's sorted() and ``COLLATE "C"`` put the
    neighbour first. Its alias is yielded."""
    postgresql_only()
    name = f"fd_en_us_{os.getpid()}"
    with connection.cursor() as cursor:
        cursor.execute(f'DROP DATABASE IF EXISTS "{name}"')
        cursor.execute(
            f'CREATE DATABASE "{name}" TEMPLATE template0 '
            "LOCALE_PROVIDER icu ICU_LOCALE 'en-US' LOCALE 'C'"
        )
    alias = "en_us"
    # Django's test case refuses a connection to an alias it was not given
    # (this one is made here, after it started): its own ensure_connection.
    from django.db.backends.base.base import BaseDatabaseWrapper

    patched = BaseDatabaseWrapper.ensure_connection
    cells = dict(zip(patched.__code__.co_freevars, patched.__closure__ or (), strict=False))
    if "real_ensure_connection" in cells:
        monkeypatch.setattr(
            BaseDatabaseWrapper, "ensure_connection", cells["real_ensure_connection"].cell_contents
        )
    connections.settings[alias] = {
        **connections.settings["default"],
        "NAME": name,
        "TEST": {**connections.settings["default"]["TEST"], "NAME": name},
    }
    try:
        call_command("migrate", database=alias, verbosity=0)
        connections[alias].close()
        yield alias
    finally:
        connections[alias].close()
        del connections.settings[alias]
        with connection.cursor() as cursor:
            cursor.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _waiting_on_locks(alias: str) -> int:
    with connections[alias].cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity "
            "WHERE datname = current_database() AND wait_event_type = 'Lock'"
        )
        return int(cursor.fetchone()[0])


@pytest.mark.django_db(transaction=True)
def test_a_deliverer_writing_hosts_while_an_operator_pauses_them_never_deadlocks_in_en_us(
    en_us_database: str,
) -> None:
    """On a database made in an en_US locale (the official Docker image's),
    a deliverer's ``record_hosts`` (every 10 s) upserts its hosts ``ORDER BY
    value->>0``, in the database's collation: ``a.example:8443`` before
    ``a.example.net``. An operator's pause of the same hosts upserts them
    in Python's sorted() order, the other way round. PostgreSQL ends one
    with ``deadlock detected``: the admin's pause is a 500, or the deliverer
    logs "The database is unavailable"."""
    alias = en_us_database
    ported, neighbour = "a.example:8443", "a.example.net"
    now = timezone.now()

    def record() -> None:
        record_hosts(
            [
                SeenHost(name, now, now, "", None, 12.0, 30.0, None, None)
                for name in (ported, neighbour)
            ],
            now=now,
            using=alias,
        )
        connections[alias].close()

    def pause() -> None:
        hosts.pause_hosts([ported, neighbour], using=alias)
        connections[alias].close()

    record()
    holding, release = threading.Event(), threading.Event()

    def hold() -> None:
        with transaction.atomic(using=alias):
            list(Host.objects.using(alias).select_for_update().filter(name=ported))
            holding.set()
            release.wait(20)
        connections[alias].close()

    blocker = Side(hold)
    blocker.start()
    assert holding.wait(10)
    sides = [Side(record), Side(pause)]
    try:
        for waiting, side in enumerate(sides, 1):
            side.start()
            wait_until(lambda waiting=waiting: _waiting_on_locks(alias) == waiting, timeout=10)
        time.sleep(1.2)  # past deadlock_timeout
    finally:
        release.set()
        for side in (blocker, *sides):
            side.join(20)
        connections[alias].close()
    errors = [side.error for side in sides]
    assert errors == [None, None], errors


# A deliverer's settle beside a send, each on a connection of its own.


def side(results: dict[str, Any], name: str, work: Callable[[], Any]) -> threading.Thread:
    """``work`` in a thread with a connection of its own; its result or error in ``results``."""

    def run() -> None:
        try:
            results[name] = work()
        except BaseException as exc:
            results[name] = exc
        finally:
            connections.close_all()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def delivered(rows: list[Any]) -> list[Any]:
    """What a deliverer writes for ``rows`` (claimed, of ordered batches) once answered 202."""
    return [
        settlements.Settlement(
            claimed=r,
            status=Status.DELIVERED,
            attempts=1,
            ordered=True,
            attempted_at=timezone.now(),
        )
        for r in rows
    ]


def settle_crossed_by(rows: list[Any], other: Callable[[], Any]) -> dict[str, Any]:
    """A deliverer settles ``rows`` (delivered), held a moment once its first
    statement (``lock_free_deliveries``) has locked them, as a busy server holds it;
    meanwhile ``other`` runs until it waits on a lock (or ends). Then the settle
    goes on. Returns each side's result or error."""
    locked, go = threading.Event(), threading.Event()

    def pause_after_lock(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        answer = execute(sql, params, many, context)
        if "WHERE id = ANY(" in sql and "ORDER BY id FOR" in sql and not locked.is_set():
            locked.set()
            go.wait(10)
        return answer

    def settle() -> Any:
        with connection.execute_wrapper(pause_after_lock):
            return settlements.settle(delivered(rows))

    results: dict[str, Any] = {}
    deliverer = side(results, "settle", settle)
    assert locked.wait(10)
    sender = side(results, "send", other)
    wait_until(lambda: waiting_on_locks() >= 1 or not sender.is_alive(), timeout=10)
    time.sleep(0.2)
    go.set()
    deliverer.join(30)
    sender.join(30)
    assert not deliverer.is_alive() and not sender.is_alive(), "stuck"
    return results


@pytest.mark.django_db(transaction=True)
def test_an_ordered_send_while_a_settle_releases_the_last_of_a_sequence_never_deadlocks() -> None:
    """Posts in one ordering key (the object): a Create to inbox A, its Update
    to A (waiting on it), a Create to inbox B; the deliverer has both Creates
    in flight and settles them together, while another Update is sent to A
    and B. The send locks the last pending delivery of each sequence lowest
    id first: A's Update (a waiter), then B's Create, which the settle holds;
    the settle, holding B's Create, goes on to release A's Update, which the
    send holds. PostgreSQL ends the send: the Update is not queued and the
    view raises ``OperationalError: deadlock detected``."""
    postgresql_only()
    key = {"ordering_key": f"{ALICE}/notes/1"}
    a, b = "https://a.example/inbox", "https://b.example/inbox"
    send_batch(ALICE, {"type": "Create", "id": f"{ALICE}/a/1"}, [a], key)
    (a1,) = store.claim(10, lease=300)
    send_batch(ALICE, {"type": "Update", "id": f"{ALICE}/a/2"}, [a], key)
    send_batch(ALICE, {"type": "Create", "id": f"{ALICE}/a/3"}, [b], key)
    (b1,) = store.claim(10, lease=300)
    a2 = Delivery.objects.get(inbox=a, after_id=a1.id)
    assert a1.id < a2.id < b1.id

    results = settle_crossed_by(
        [a1, b1],
        lambda: send_batch(ALICE, {"type": "Update", "id": f"{ALICE}/a/4"}, [a, b], key),
    )
    errors = {name: error for name, error in results.items() if isinstance(error, BaseException)}
    assert not errors, errors


def create_in_flight_and_its_update() -> tuple[Any, str, dict[str, str], dict[str, Any]]:
    """A post's Create claimed (in flight) to an inbox, its Update waiting on
    it in the post's ordering key; the claimed row, the inbox, the key, and
    the post's Delete, to be sent."""
    obj = f"{ALICE}/notes/1"
    inbox = "https://a.example/inbox"
    key = {"ordering_key": obj}
    create = {"type": "Create", "id": f"{ALICE}/a/1", "actor": ALICE, "object": {"id": obj}}
    send_batch(ALICE, create, [inbox], key)
    (c,) = store.claim(10, lease=300)
    update = {"type": "Update", "id": f"{ALICE}/a/2", "actor": ALICE, "object": {"id": obj}}
    send_batch(ALICE, update, [inbox], key)
    delete = {"type": "Delete", "id": f"{ALICE}/a/3", "actor": ALICE, "object": obj}
    return c, inbox, key, delete


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("delete_key", [f"{ALICE}/notes/1", ""], ids=["in_its_key", "no_key"])
def test_a_delete_while_the_create_in_flight_settles_never_deadlocks(delete_key: str) -> None:
    """The README's case for ordering keys: a post's Create to an inbox is in
    flight, its Update waits on it, and the author deletes the post. The
    Delete supersedes the Update (locking its row) and waits on the Create
    (``after_id``), whose row it does not lock: PostgreSQL checks that
    foreign key at COMMIT with a key-share lock on the Create's row. The
    deliverer settling the Create meanwhile locked that row ``FOR UPDATE``
    (``lock_deliveries``, as it was), then went to release the Update, which
    the Delete holds. The Delete's COMMIT is ended: ``send()`` raises ``OperationalError:
    deadlock detected`` and the Delete is never queued (and a view in
    ATOMIC_REQUESTS rolls the deletion back)."""
    postgresql_only()
    c, inbox, _key, delete = create_in_flight_and_its_update()

    results = settle_crossed_by(
        [c], lambda: send_batch(ALICE, delete, [inbox], {"ordering_key": delete_key})
    )
    errors = {name: error for name, error in results.items() if isinstance(error, BaseException)}
    assert not errors, errors


@pytest.mark.django_db(transaction=True)
def test_an_ordered_send_to_more_than_500_inboxes_while_a_settle_never_deadlocks() -> None:
    """An Update sent in its object's key to 501 followers: the send locks the
    last pending delivery of each sequence 500 at a time, each chunk lowest id
    first, but not across chunks (the 501st inbox's row has the lowest id).
    A deliverer settling two of those rows (the Create in flight to the 501st
    inbox and to the 500th) locks them lowest id first: each holds what the
    other waits for, and PostgreSQL ends one (here the settle, which the
    deliverer logs as the database being unavailable; the send as likely)."""
    postgresql_only()
    key = {"ordering_key": f"{ALICE}/notes/1"}
    x = "https://x.example/inbox"
    many = [f"https://m{n}.example/inbox" for n in range(500)]
    send_batch(ALICE, {"type": "Create", "id": f"{ALICE}/a/1"}, [x], key)
    send_batch(ALICE, {"type": "Create", "id": f"{ALICE}/a/2"}, many, key)
    low = Delivery.objects.get(inbox=x)
    high = Delivery.objects.get(inbox=many[-1])
    assert low.id < high.id
    rows = store.claim(10, lease=300, only_hosts=["x.example", "m499.example"])
    assert {r.id for r in rows} == {low.id, high.id}

    first_chunk, go = threading.Event(), threading.Event()

    def pause_after_first_chunk(execute: Any, sql: str, params: Any, many_: bool, ctx: Any) -> Any:
        answer = execute(sql, params, many_, ctx)
        if "FOR UPDATE" in sql and not first_chunk.is_set():
            first_chunk.set()
            go.wait(10)
        return answer

    def sending() -> Any:
        with connection.execute_wrapper(pause_after_first_chunk):
            return send_batch(ALICE, {"type": "Update", "id": f"{ALICE}/a/3"}, [*many, x], key)

    results: dict[str, Any] = {}
    sender = side(results, "send", sending)
    assert first_chunk.wait(10)
    deliverer = side(results, "settle", lambda: settlements.settle(delivered(rows)))
    wait_until(lambda: waiting_on_locks() >= 1 or not deliverer.is_alive(), timeout=10)
    go.set()
    sender.join(30)
    deliverer.join(30)
    assert not deliverer.is_alive() and not sender.is_alive(), "stuck"
    errors = {name: error for name, error in results.items() if isinstance(error, BaseException)}
    assert not errors, errors


@pytest.mark.django_db(transaction=True)
def test_a_delete_in_a_views_open_transaction_while_its_create_settles_never_deadlocks() -> None:
    """The same with nothing held by the test but the view's own transaction
    (ATOMIC_REQUESTS): the Delete is sent, the view goes on (deletes the
    post), and meanwhile the deliverer answers the Create in flight and
    settles it, which waits on the Update the Delete superseded. The view's
    COMMIT then needs a key-share lock on the Create's row, which the settle
    held ``FOR UPDATE``: PostgreSQL ended one of them. Here the settle (the
    deliverer logs "The database is unavailable (deadlock detected ...)" and
    writes it again); with the waits the other way round (the test above),
    the view's COMMIT: the post is not deleted and the Delete not queued."""
    postgresql_only()
    from django.db import transaction

    c, inbox, key, delete = create_in_flight_and_its_update()
    sent, settling = threading.Event(), threading.Event()

    def view() -> Any:
        with transaction.atomic():
            batch = send_batch(ALICE, delete, [inbox], key)
            sent.set()
            settling.wait(10)  # the rest of the view
        return batch

    results: dict[str, Any] = {}
    request = side(results, "view", view)
    assert sent.wait(10)
    deliverer = side(results, "settle", lambda: settlements.settle(delivered([c])))
    wait_until(lambda: waiting_on_locks() >= 1 or not deliverer.is_alive(), timeout=10)
    settling.set()
    request.join(30)
    deliverer.join(30)
    assert not deliverer.is_alive() and not request.is_alive(), "stuck"
    errors = {name: error for name, error in results.items() if isinstance(error, BaseException)}
    assert not errors, errors
