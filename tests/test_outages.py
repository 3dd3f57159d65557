"""The loop's way to the database: outages said once, and their end only once seen."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from django.db import OperationalError, connection, connections

from django_federation_delivery import send, signals
from django_federation_delivery.models import Batch, Delivery, Status
from django_federation_delivery.outages import Database
from django_federation_delivery.store import settlements

from .conftest import Inbox, RunningDeliverer, wait_until
from .keys import ALICE
from .test_deliverer import wait_until_idle

NOTE = {"type": "Create", "id": f"{ALICE}/activities/outage", "actor": ALICE}

pytestmark = pytest.mark.django_db(transaction=True)


def select_one() -> int:
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1")
        return int(cursor.fetchone()[0])


def refused() -> None:
    raise OperationalError("terminating connection due to administrator command")


def test_an_outage_ends_with_a_statement_that_ran_not_with_a_call_that_needed_none(
    caplog: pytest.LogCaptureFixture,
) -> None:
    stopping = threading.Event()
    stopping.set()  # each wait between tries slept, by a sleep that returns at once
    logger = logging.getLogger("tests.outages")
    database = Database("default", stopping, logger=logger, sleep=lambda seconds: None)
    with caplog.at_level(logging.WARNING, logger="tests.outages"):
        assert database(refused) is None
        assert database.failing
        # Nothing reached the database: that says nothing of whether it is back.
        assert database(lambda: "nothing to write") == "nothing to write"
        assert database.failing
        assert database(refused) is None
        said = [record.getMessage() for record in caplog.records]
        assert said == [
            "The database is unavailable (terminating connection due to administrator "
            "command); waiting it out"
        ]
        assert database(select_one) == 1
        assert not database.failing
        assert database(lambda: "nothing") == "nothing"
    said = [record.getMessage() for record in caplog.records]
    assert said[1:] == ["The database is back"]


def test_stopping_each_wait_is_waited_whole_but_none_past_its_bound() -> None:
    # A stop that has come cut every wait to nothing: the loop, writing what
    # it held before it stopped, tried again flat out for the whole lease.
    stopping = threading.Event()
    stopping.set()
    slept: list[float] = []
    database = Database(
        "default", stopping, logger=logging.getLogger("tests.outages"), sleep=slept.append
    )
    assert database(refused) is None
    assert database(refused) is None
    assert len(slept) == 2 and all(0.2 <= seconds <= 0.3 for seconds in slept), slept
    database.end_waits_by(time.monotonic() + 0.1)
    assert database(refused) is None
    assert 0 < slept[-1] <= 0.1
    database.end_waits_by(time.monotonic())
    assert database(refused) is None
    assert len(slept) == 3, "none once its bound has passed: the query is tried once"
    database.end_waits_by(None)
    assert database(refused) is None
    assert len(slept) == 4 and slept[-1] >= 0.2


def _end_other_sessions(exclude: int) -> int:
    other = connections.create_connection("default")
    try:
        with other.cursor() as cursor:
            cursor.execute(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                "WHERE datname = current_database() AND pid <> pg_backend_pid() "
                "AND pid <> %s AND backend_type = 'client backend'",
                [exclude],
            )
            return int(cursor.fetchone()[0])
    finally:
        other.close()


def test_a_settle_met_by_a_read_only_database_for_a_moment_is_written_when_it_is_back(
    inboxes: Callable[..., Inbox],
    start_deliverer: Callable[..., RunningDeliverer],
    caplog: pytest.LogCaptureFixture,
) -> None:
    # A failover: for a moment the deliverer's sessions reach a server that
    # takes no writes (SQLSTATE 25006, an InternalError, not an
    # OperationalError). The outcome is kept and written once it can be.
    # It was taken for a value the database refused: failed instead, refused
    # again, "left to its lease", and dropped from the outbox; once the lease
    # lapsed, the delivery its inbox had accepted was sent and told again.
    if connection.vendor != "postgresql":
        pytest.skip("PostgreSQL: a database that takes no writes for a moment")
    inbox = inboxes(delay=1.0)
    told: list[int] = []

    def on_settled(sender: Any, settled: Any, **kwargs: Any) -> None:
        told.append(settled.delivery_id)

    name = connection.settings_dict["NAME"]
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        mine = int(cursor.fetchone()[0])
    signals.delivery_settled.connect(on_settled, weak=False)
    caplog.set_level(logging.WARNING, logger="django_federation_delivery")
    try:
        send(ALICE, NOTE, [inbox.url("/a")])
        runner = start_deliverer(lease=15)
        wait_until(lambda: bool(inbox.received), timeout=10)
        # While the inbox answers, the deliverer's sessions end, and its next
        # ones reach a database that takes no writes...
        with connection.cursor() as cursor:
            cursor.execute(f'ALTER DATABASE "{name}" SET default_transaction_read_only = on')
        try:
            _end_other_sessions(mine)
            time.sleep(2.5)
        finally:
            # ...then the failover is over: a writable database again.
            with connection.cursor() as cursor:
                cursor.execute(f'ALTER DATABASE "{name}" RESET default_transaction_read_only')
            _end_other_sessions(mine)
        wait_until(
            lambda: list(Delivery.objects.values_list("status", flat=True)) == [Status.DELIVERED],
            timeout=30,
        )
        time.sleep(1.0)
        runner.stop()
    finally:
        signals.delivery_settled.disconnect(on_settled)
    refused = [r.getMessage() for r in caplog.records if "could not be settled" in r.getMessage()]
    assert inbox.paths() == ["/a"] and len(told) == 1, (
        f"the inbox got {inbox.paths()}, delivery_settled told {len(told)} times; logged: {refused}"
    )


def lose_the_first_commits_answer(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The first settle commits, and its answer is lost with the connection:
    what it wrote, noted in the list returned once it has."""
    real = settlements._written
    lost: list[Any] = []

    def written(items: Any, now: Any, using: Any) -> Any:
        answer = real(items, now, using)
        if not lost:
            lost.append(answer)
            raise OperationalError("server closed the connection unexpectedly")
        return answer

    monkeypatch.setattr(settlements, "_written", written)
    return lost


@contextlib.contextmanager
def finished_told() -> Iterator[list[int]]:
    """The ids of the batches ``batch_finished`` tells of, while it lasts."""
    told: list[int] = []

    def finished(sender: Any, batch: Batch, **kwargs: Any) -> None:
        told.append(batch.id)

    signals.batch_finished.connect(finished, weak=False)
    try:
        yield told
    finally:
        signals.batch_finished.disconnect(finished)


def test_a_settle_committed_whose_answer_was_lost_still_tells_batch_finished(
    inbox: Inbox,
    start_deliverer: Callable[..., RunningDeliverer],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The connection drops as the COMMIT's answer comes back: the server has
    # committed the settle (the batch finished), the deliverer sees the
    # database away and writes it again, which finds the claim gone. The
    # batches the first write finished are told then. They were never told.
    lost = lose_the_first_commits_answer(monkeypatch)
    with finished_told() as told:
        batch = send(ALICE, NOTE, [inbox.url("/a")])
        assert batch is not None
        runner = start_deliverer()
        wait_until(lambda: bool(lost) and told == [batch.id], timeout=15)
        runner.stop()
    assert inbox.paths() == ["/a"], "sent once"
    assert Batch.objects.get(id=batch.id).finished_at is not None
    assert runner.deliverer._tried == {}


def test_a_lost_commits_finished_batch_is_told_when_the_read_of_it_fails_once(
    inbox: Inbox,
    start_deliverer: Callable[..., RunningDeliverer],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The write tried again reads what the lost one finished, and meets the
    # database away: what it was to read was dropped before the read, and
    # batch_finished never told.
    lose_the_first_commits_answer(monkeypatch)
    real_read = settlements.finished_unanswered
    reads: list[str] = []

    def read(unanswered: Any, using: Any) -> list[int]:
        reads.append("failed" if not reads else "read")
        if reads == ["failed"]:
            raise OperationalError("server closed the connection unexpectedly")
        return real_read(unanswered, using)

    monkeypatch.setattr(settlements, "finished_unanswered", read)
    with finished_told() as told:
        batch = send(ALICE, NOTE, [inbox.url("/a")])
        assert batch is not None
        runner = start_deliverer()
        try:
            wait_until(lambda: "read" in reads and bool(told), timeout=15)
        finally:
            runner.stop()
    assert told == [batch.id] and reads[:2] == ["failed", "read"]
    assert inbox.paths() == ["/a"], "sent once"
    assert runner.deliverer._tried == {}


@pytest.mark.slow
def test_a_stop_with_the_database_away_exits_after_the_grace_not_the_attempts_in_flight(
    inboxes: Callable[..., Inbox],
    start_deliverer: Callable[..., RunningDeliverer],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # It said it left the attempt in flight to its lease, then waited for
    # that attempt to end (up to ATTEMPT_TIMEOUT + 5 s), its outcome then
    # dropped all the same.
    from django_federation_delivery.deliverer import STOPPING_GRACE

    away = threading.Event()
    away.set()
    tried: list[float] = []
    real = settlements.settle

    def settle(*args: Any, **kwargs: Any) -> Any:
        if away.is_set():
            tried.append(time.monotonic())
            raise OperationalError("server closed the connection unexpectedly")
        return real(*args, **kwargs)

    monkeypatch.setattr(settlements, "settle", settle)
    quick, slow = inboxes(), inboxes("127.0.0.2", delay=10.0)
    send(ALICE, NOTE, [quick.url("/a"), slow.url("/b")])
    runner = start_deliverer(lease=60)
    wait_until(lambda: bool(tried) and len(slow.received) == 1, timeout=10)
    asked = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="django_federation_delivery.deliverer"):
        runner.deliverer.stop()
        runner.thread.join(20)
    took = time.monotonic() - asked
    away.clear()
    assert "outcomes unwritten and 1 attempts in flight" in caplog.text
    assert took < STOPPING_GRACE + 2, f"returned {took:.1f} s after the stop"


@pytest.mark.slow
def test_a_stop_with_the_database_away_and_nothing_to_write_exits_after_the_grace(
    inboxes: Callable[..., Inbox],
    start_deliverer: Callable[..., RunningDeliverer],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Away while one slow attempt is in flight, nothing waiting to be
    # written: the stop waited for the attempt (up to ATTEMPT_TIMEOUT), then
    # the grace again for a write it could not make.
    from django_federation_delivery.deliverer import STOPPING_GRACE

    away = threading.Event()
    real = Database.__call__

    def call(self: Database, function: Any, /, *args: Any, **kwargs: Any) -> Any:
        if away.is_set():
            return real(self, refused)
        return real(self, function, *args, **kwargs)

    monkeypatch.setattr(Database, "__call__", call)
    slow = inboxes("127.0.0.2", delay=10.0)
    send(ALICE, NOTE, [slow.url("/b")])
    runner = start_deliverer(lease=60)
    wait_until(lambda: len(slow.received) == 1, timeout=10)
    away.set()
    wait_until(lambda: runner.deliverer._db.failing, timeout=10)
    asked = time.monotonic()
    runner.deliverer.stop()
    runner.thread.join(20)
    took = time.monotonic() - asked
    away.clear()
    assert took < STOPPING_GRACE + 2, f"returned {took:.1f} s after the stop"


@pytest.mark.slow
class ReadOnly(Exception):
    """psycopg's error under Django's: a transaction that may not write."""

    sqlstate = "25006"


def refused_a_write(words: str, sqlstate: str | None) -> Callable[[], None]:
    def write() -> None:
        error = OperationalError(words)
        if sqlstate is not None:
            error.__cause__ = ReadOnly()
            error.__cause__.sqlstate = sqlstate  # type: ignore[attr-defined]
        raise error

    return write


@pytest.mark.parametrize(
    ("words", "sqlstate"),
    [
        ("cannot execute UPDATE in a read-only transaction", "25006"),
        ("could not extend file: No space left on device", "53100"),
        ("attempt to write a readonly database", None),
        ("database or disk is full", None),
    ],
    ids=["read-only server", "full disk", "read-only file", "full file"],
)
def test_an_outage_that_refuses_writes_alone_ends_with_a_write(
    caplog: pytest.LogCaptureFixture, words: str, sqlstate: str | None
) -> None:
    # A failover's old primary, or a file system remounted read-only: the
    # loop's reads went on, each ended the outage, and the next write began
    # another: a pair of lines at each try, and no longer waits between them.
    stopping = threading.Event()
    stopping.set()
    waits: list[float] = []
    logger = logging.getLogger("tests.outages")
    database = Database("default", stopping, logger=logger, sleep=waits.append)
    with caplog.at_level(logging.WARNING, logger="tests.outages"):
        for _ in range(3):
            assert database(refused_a_write(words, sqlstate)) is None
            assert database(select_one) == 1
            assert database.failing, "a read proves nothing"
        assert waits == sorted(waits) and waits[-1] > waits[0]
        database(lambda: Batch.objects.filter(id=-1).update(tag="x"))
        assert not database.failing
    said = [record.getMessage() for record in caplog.records]
    assert [line.split(" (")[0] for line in said] == [
        "The database is unavailable",
        "The database is back",
    ]


def test_a_write_lock_held_past_the_busy_timeout_is_one_outage_in_the_log(
    inboxes: Callable[..., Inbox],
    start_deliverer: Callable[..., RunningDeliverer],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """SQLite: another process (a backup, a migration) holds the write lock
    for 4 s, past a busy timeout of 0.5 s. A read between two tries of the
    write, which WAL lets through, ended the outage: "unavailable" and
    "back" were logged again at every busy timeout, each "back" while the
    lock was still held."""
    import sqlite3

    if connection.vendor != "sqlite":
        pytest.skip("SQLite's write lock")
    monkeypatch.setitem(connection.settings_dict["OPTIONS"], "timeout", 0.5)
    slow = inboxes(delay=1.0)
    batch = send(ALICE, NOTE, [slow.url("/a")])
    with caplog.at_level(logging.WARNING, logger="django_federation_delivery.deliverer"):
        runner = start_deliverer()
        wait_until(lambda: len(slow.received) == 1, timeout=10)
        other = sqlite3.connect(connection.settings_dict["NAME"], isolation_level=None)
        try:
            other.execute("BEGIN IMMEDIATE")  # before the answer comes, and its write
            time.sleep(4.0)
            other.execute("COMMIT")
        finally:
            other.close()
        wait_until(lambda: Batch.objects.get(id=batch.id).finished_at is not None, timeout=20)
        runner.stop()
    said = [record.getMessage() for record in caplog.records]
    went = [line for line in said if line.startswith("The database is unavailable")]
    back = [line for line in said if line == "The database is back"]
    assert (len(went), len(back)) == (1, 1), said


def test_a_connection_lost_while_the_deliverer_idles_is_replaced_not_an_outage(
    start_deliverer: Callable[..., RunningDeliverer],
    settings: Any,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Idle, it beat with a connection the server had ended, and waited out
    # an "outage": an idle loop never closed a connection found broken.
    from django.db.backends.signals import connection_created

    if connection.vendor != "postgresql":
        pytest.skip("a server that drops a connection: PostgreSQL")
    monkeypatch.setitem(connection.settings_dict, "CONN_MAX_AGE", 600)
    monkeypatch.setitem(connection.settings_dict, "CONN_HEALTH_CHECKS", True)
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "IDLE_POLL_SECONDS": 60,
        "HEARTBEAT_SECONDS": 1,
    }
    caplog.set_level(logging.DEBUG, logger="django_federation_delivery")
    opened: list[tuple[int, Any]] = []

    def note(sender: Any, connection: Any, **kwargs: Any) -> None:
        opened.append((threading.get_ident(), connection))

    connection_created.connect(note, weak=False)
    try:
        runner = start_deliverer(heartbeat=True)
        wait_until_idle(caplog)
        time.sleep(0.5)
    finally:
        connection_created.disconnect(note)
    (theirs, *_) = [wrapper for ident, wrapper in reversed(opened) if ident == runner.thread.ident]
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_terminate_backend(%s)", [theirs.connection.info.backend_pid])
    time.sleep(2.5)  # idle, beating each second
    runner.stop()
    assert not [m for m in caplog.messages if "database is unavailable" in m]


@pytest.mark.slow
def test_a_commit_whose_answer_was_lost_still_tells_batch_finished_after_an_outage_past_the_lease(
    inbox: Inbox,
    start_deliverer: Callable[..., Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The settle of a one-inbox send commits and its answer is lost with the
    connection; the database then stays away a little longer than the
    claim's lease, and the outbox lets the settlement go. Once the database
    is back, what that first write finished is read, and ``batch_finished``
    told: it was never told."""
    from django_federation_delivery import signals
    from django_federation_delivery.models import Batch
    from django_federation_delivery.store import settlements

    real = settlements._written
    lost: list[float] = []

    def written(items: Any, now: Any, using: Any) -> Any:
        if not lost:
            real(items, now, using)
            lost.append(max(item.claimed.leased_until for item in items))
            raise OperationalError("server closed the connection unexpectedly")
        if time.time() < lost[0] + 1.0:
            raise OperationalError("could not connect to server")
        return real(items, now, using)

    monkeypatch.setattr(settlements, "_written", written)
    told: list[int] = []

    def finished(sender: Any, batch: Any, **kwargs: Any) -> None:
        told.append(batch.id)

    signals.batch_finished.connect(finished, weak=False)
    try:
        batch = send(ALICE, NOTE, [inbox.url("/a")])
        runner = start_deliverer(lease=12)
        wait_until(lambda: bool(lost), timeout=10)
        # Told once the database is back, a second past the lease.
        wait_until(lambda: bool(told), timeout=60)
        time.sleep(0.5)  # and no more than once
        runner.stop()
    finally:
        signals.batch_finished.disconnect(finished)
    assert inbox.paths() == ["/a"], "sent once"
    assert Batch.objects.get(id=batch.id).finished_at is not None, "finished by that write"
    assert told == [batch.id], f"batch_finished told {told}"


@pytest.mark.django_db(transaction=True)
def test_a_stop_on_postgresql_waits_no_longer_than_its_grace_on_a_lock_another_holds(
    start_deliverer: Callable[..., RunningDeliverer],
    settings: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Another session (a migration, an operator's LOCK TABLE) holds the
    # deliveries' table: the loop's next look waits on it, and a stop waited
    # as long as that session liked, out of reach of the stop's grace.
    from django_federation_delivery.deliverer import STOPPING_GRACE

    if connection.vendor != "postgresql":
        pytest.skip("PostgreSQL: a statement waiting on another session's lock")
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "NEW_WORK_POLL_SECONDS": 0.05,
        "IDLE_POLL_SECONDS": 0.2,
    }
    caplog.set_level(logging.WARNING, logger="django_federation_delivery")
    runner = start_deliverer()
    time.sleep(0.5)
    holder = connections.create_connection("default")
    table = connection.ops.quote_name(Delivery._meta.db_table)
    try:
        with holder.cursor() as cursor:
            cursor.execute("BEGIN")
            cursor.execute(f"LOCK TABLE {table} IN ACCESS EXCLUSIVE MODE")

        def waiting() -> bool:
            with holder.cursor() as cursor:
                cursor.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                    "AND datname = current_database()"
                )
                return int(cursor.fetchone()[0]) > 0

        wait_until(waiting, timeout=10)
        started = time.monotonic()
        runner.deliverer.stop()
        runner.thread.join(20)
        took = time.monotonic() - started
    finally:
        with holder.cursor() as cursor:
            cursor.execute("ROLLBACK")
        holder.close()
    runner.thread.join(20)
    assert took < STOPPING_GRACE + 3.0, f"the stop took {took:.1f} s"
    assert runner.error is None, runner.error
    assert any("cancelled" in record.getMessage() for record in caplog.records)
