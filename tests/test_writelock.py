"""The deliverer's BEGIN on SQLite: tried again in short sleeps, not left to
SQLite's busy handler; within the busy timeout, and nothing but the BEGIN.

Real SQLite files: the lock is held by another connection, in a thread of
its own, as a web process sending would hold it.
"""

from __future__ import annotations

import datetime as dt
import itertools
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import django
import pytest
from django.db import OperationalError, connection, connections, transaction
from django.utils import timezone

from django_federation_delivery import availability, send, send_batch, writelock
from django_federation_delivery.controls import requeue
from django_federation_delivery.deliverer import FINAL_WRITES_WAIT, STOPPING_GRACE
from django_federation_delivery.hosts import failing_since, pause_host
from django_federation_delivery.models import Delivery, Status
from django_federation_delivery.store import claims
from django_federation_delivery.store.retractions import release_stranded
from django_federation_delivery.writelock import PromptWriteLock, is_busy

from .conftest import Inbox, wait_until
from .keys import ALICE
from .lockholder import Holder
from .operators import NOTE

sqlite_only = pytest.mark.skipif(connection.vendor != "sqlite", reason="SQLite's lock only")


@pytest.fixture
def immediate(monkeypatch: pytest.MonkeyPatch) -> None:
    """This thread's transactions begin with ``BEGIN IMMEDIATE``, as the
    example project's do (``transaction_mode``, Django 5.1+)."""
    if django.VERSION < (5, 1):
        pytest.skip("Django 4.2 has no transaction_mode: its BEGIN takes no lock")
    # Set when the connection opens (from OPTIONS): open it first.
    connections["default"].ensure_connection()
    monkeypatch.setattr(connections["default"], "transaction_mode", "IMMEDIATE")


@pytest.fixture
def holder() -> Iterator[Callable[..., Holder]]:
    started: list[Holder] = []

    def start(hold: Callable[[], float], gap: Callable[[], float] = lambda: 0.0) -> Holder:
        thread = Holder(str(connection.settings_dict["NAME"]), hold, gap)
        started.append(thread)
        thread.start()
        assert thread.holding.wait(10)
        return thread

    yield start
    for thread in started:
        thread.stopping.set()
        thread.join(30)
        assert thread.error is None


@pytest.fixture
def prompt_lock() -> Iterator[None]:
    remove = writelock.install("default")
    try:
        yield
    finally:
        remove()


def busy_timeout_ms() -> int:
    connection.ensure_connection()
    return int(connection.connection.execute("PRAGMA busy_timeout").fetchone()[0])


def set_busy_timeout(ms: int) -> None:
    connection.ensure_connection()
    connection.connection.execute(f"PRAGMA busy_timeout = {ms:d}")


@sqlite_only
@pytest.mark.django_db(transaction=True)
def test_a_lock_held_past_the_busy_timeout_still_raises_database_is_locked(
    immediate: None, holder: Callable[..., Holder], prompt_lock: None
) -> None:
    set_busy_timeout(300)
    sender = holder(lambda: 60.0)
    started = time.monotonic()
    with pytest.raises(OperationalError, match="database is locked"):
        claims.claim(1, 60)
    waited = time.monotonic() - started
    assert 0.3 <= waited < 3.0
    # As it was: the busy timeout, and no transaction left open.
    assert busy_timeout_ms() == 300
    assert not connection.in_atomic_block
    assert not connection.connection.in_transaction
    sender.stopping.set()
    sender.join(10)
    assert claims.claim(1, 60) == []


@sqlite_only
@pytest.mark.django_db(transaction=True)
def test_nothing_but_the_begin_is_tried_again(
    holder: Callable[..., Holder], prompt_lock: None
) -> None:
    delete = f"DELETE FROM {Delivery._meta.db_table}"
    executed: list[str] = []

    def count(execute: Callable[..., Any], sql: str, *rest: Any) -> Any:
        executed.append(sql)
        return execute(sql, *rest)

    # Room for a dozen tries on a machine busy past its cores.
    set_busy_timeout(1000)
    # Inside the prompt lock's wrapper: each try is seen.
    connection.execute_wrappers.append(count)
    try:
        holder(lambda: 60.0)
        with connection.cursor() as cursor:
            # A write in autocommit mode meets the lock: once, in SQLite's handler.
            with pytest.raises(OperationalError, match="database is locked"):
                cursor.execute(delete)
            assert executed == [delete]
            executed.clear()
            # A deferred BEGIN takes no lock: run once, as it is.
            cursor.execute("BEGIN")
            cursor.execute("ROLLBACK")
            assert executed == ["BEGIN", "ROLLBACK"]
            executed.clear()
            with pytest.raises(OperationalError, match="database is locked"):
                cursor.execute("BEGIN IMMEDIATE")
    finally:
        connection.execute_wrappers.remove(count)
    assert len(executed) > 10
    assert set(executed) == {"BEGIN IMMEDIATE"}


@sqlite_only
def test_each_try_of_the_begin_waits_a_few_milliseconds_until_the_busy_timeout(
    tmp_path: Path,
) -> None:
    path = str(tmp_path / "lock.sqlite3")
    other = sqlite3.connect(path, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")
    # A second: on a machine busy past its cores a try can take several
    # times its own busy timeout, and with 0.1 s the last ones were cut short.
    raw = sqlite3.connect(path, timeout=1.0, isolation_level=None)
    timeouts: list[int] = []

    def execute(sql: str, *rest: Any) -> Any:
        timeouts.append(raw.execute("PRAGMA busy_timeout").fetchone()[0])
        return raw.execute(sql)

    statements: list[str] = []
    raw.set_trace_callback(statements.append)
    try:
        lock = PromptWriteLock(_Wrapping(raw))
        started = time.monotonic()
        with pytest.raises(sqlite3.OperationalError, match="database is locked"):
            lock(execute, "BEGIN IMMEDIATE", None, False, {})
        assert time.monotonic() - started >= 1.0
        # 1 ms, a quarter longer each time up to 10, and none past the 1,000.
        assert timeouts[:12] == [1, 1, 1, 1, 2, 3, 3, 4, 5, 7, 9, 10]
        assert max(timeouts) == 10 and sum(timeouts) <= 1001
        # Each timeout set once, not again for a try that keeps it.
        sets = [sql for sql in statements if sql.startswith("PRAGMA busy_timeout =")]
        assert sets[:8] == [f"PRAGMA busy_timeout = {ms}" for ms in (1, 2, 3, 4, 5, 7, 9, 10)]
        assert all(a != b for a, b in itertools.pairwise(sets))
        raw.set_trace_callback(None)
        assert raw.execute("PRAGMA busy_timeout").fetchone()[0] == 1000
        # Freed: taken at the next try.
        other.execute("COMMIT")
        timeouts.clear()
        lock(execute, "BEGIN IMMEDIATE", None, False, {})
        assert raw.in_transaction and timeouts == [1]
        raw.execute("COMMIT")
        assert raw.execute("PRAGMA busy_timeout").fetchone()[0] == 1000
    finally:
        other.close()
        raw.close()


class _Wrapping:
    """What the prompt lock reads of Django's connection: the raw one."""

    def __init__(self, raw: sqlite3.Connection) -> None:
        self.connection = raw


def test_only_sqlite_busy_is_busy() -> None:
    locked = sqlite3.OperationalError("database is locked")
    locked.sqlite_errorcode = sqlite3.SQLITE_BUSY  # type: ignore[attr-defined]
    snapshot = sqlite3.OperationalError("database is locked")
    snapshot.sqlite_errorcode = sqlite3.SQLITE_BUSY | (2 << 8)  # type: ignore[attr-defined]
    table = sqlite3.OperationalError("database table is locked")
    table.sqlite_errorcode = sqlite3.SQLITE_LOCKED  # type: ignore[attr-defined]
    wrapped = OperationalError("database is locked")
    wrapped.__cause__ = locked
    assert is_busy(locked) and is_busy(snapshot) and is_busy(wrapped)
    assert not is_busy(table)
    assert not is_busy(OperationalError("database is locked"))


@pytest.mark.django_db
def test_it_is_installed_on_sqlite_only_and_removed_as_it_was() -> None:
    before = list(connection.execute_wrappers)
    remove = writelock.install("default")
    added = [w for w in connection.execute_wrappers if w not in before]
    if connection.vendor == "sqlite":
        assert [type(w) for w in added] == [PromptWriteLock]
    else:
        assert added == []
    remove()
    remove()
    assert connection.execute_wrappers == before


class Writer(threading.Thread):
    """Another connection that writes, and commits, a row every millisecond
    or so: a web process sending one post after another."""

    def __init__(self, path: str) -> None:
        super().__init__(daemon=True)
        self.raw = sqlite3.connect(path, timeout=20, isolation_level=None, check_same_thread=False)
        self.raw.execute("CREATE TABLE fd_test_writes (n INTEGER)")
        self.stopping = threading.Event()
        self.committed = 0
        self.writing = threading.Event()

    def run(self) -> None:
        try:
            while not self.stopping.is_set():
                self.raw.execute("INSERT INTO fd_test_writes VALUES (?)", (self.committed,))
                self.committed += 1
                self.writing.set()
                time.sleep(0.001)
        finally:
            self.raw.close()


@sqlite_only
@pytest.mark.django_db(transaction=True)
def test_what_reads_a_row_before_writing_it_takes_the_lock_first_while_others_write() -> None:
    # With a deferred BEGIN (Django 4.2, or no transaction_mode: these
    # tests' settings), a transaction that reads first and writes after
    # fails at once, "database is locked", if another connection wrote in
    # between: no busy timeout is waited. A host found failing (in the
    # deliverer's loop), a pause and a requeue (an operator's) read first.
    send(ALICE, {"type": "Note"}, [f"https://r{n}.example/inbox" for n in range(5)])
    rows = Delivery.objects.all()
    writer = Writer(connection.settings_dict["NAME"])
    writer.start()
    assert writer.writing.wait(10)
    errors: list[BaseException] = []
    try:
        for n in range(15):
            try:
                failing_since(f"f{n}.example", timezone.now())
                pause_host(f"p{n}.example")
                rows.update(status=Status.FAILED)
                assert requeue(rows) == 5
            except OperationalError as exc:
                errors.append(exc)
    finally:
        writer.stopping.set()
        writer.join(10)
    assert writer.committed > 1, "the other connection wrote meanwhile"
    assert not errors, f"{len(errors)} of 15: {errors[0]}"


class Interleaver:
    """An execute wrapper: right after each read a transaction of this
    connection makes before it holds the write lock, another connection (a
    web process sending) commits a write: what a busy sender does at some
    moment, here at the worst one, every time."""

    def __init__(self, path: str) -> None:
        # A busy timeout of 0: while this transaction holds the lock, the
        # other's write gives up at once, and nothing comes in between.
        self.raw = sqlite3.connect(path, timeout=0, isolation_level=None, check_same_thread=False)
        self.raw.execute("CREATE TABLE IF NOT EXISTS interleaved_writes (n INTEGER)")
        self.between: list[str] = []

    def __call__(
        self, execute: Callable[..., Any], sql: str, params: Any, many: bool, context: Any
    ) -> Any:
        result = execute(sql, params, many, context)
        wrapper = context["connection"]
        read = str(sql).lstrip().upper().startswith(("SELECT", "WITH"))
        if read and wrapper.in_atomic_block and wrapper.connection.in_transaction:
            try:
                self.raw.execute("INSERT INTO interleaved_writes VALUES (1)")
            except sqlite3.OperationalError:
                pass  # this transaction holds the write lock
            else:
                self.between.append(str(sql)[:70])
        return result


@pytest.fixture
def interleaved() -> Iterator[Interleaver]:
    if connection.vendor != "sqlite":
        pytest.skip("SQLite's lock only")
    connection.ensure_connection()
    interleaver = Interleaver(str(connection.settings_dict["NAME"]))
    try:
        with connection.execute_wrapper(interleaver):
            yield interleaver
    finally:
        interleaver.raw.close()


@pytest.mark.django_db(transaction=True)
def test_the_sweep_of_stranded_deliveries_takes_the_lock_before_it_reads(
    interleaved: Interleaver,
) -> None:
    url = "https://a.example/inbox"
    first = send_batch(ALICE, {"type": "Note"}, [url], {"ordering_key": "k"})
    second = send_batch(ALICE, {"type": "Note", "n": 2}, [url], {"ordering_key": "k"})
    assert first is not None and second is not None
    # What it waits on settled without releasing it: for the sweep.
    Delivery.objects.filter(batch=first).update(status=Status.DELIVERED, settled_at=timezone.now())
    assert release_stranded(now=timezone.now()) == 1, interleaved.between


@pytest.mark.django_db(transaction=True)
def test_a_retraction_sent_in_the_caller_s_transaction_takes_the_lock_before_it_reads(
    interleaved: Interleaver,
) -> None:
    post = f"{ALICE}/notes/1"
    gone, here = "https://gone.example/inbox", "https://here.example/inbox"
    send(ALICE, {"type": "Create", "id": f"{ALICE}/c/1", "object": post}, [gone, here])
    failing_since("gone.example", timezone.now() - dt.timedelta(days=8))
    assert availability.mark_unavailable(60) == ["gone.example"]
    # Read within the minute the hosts marked unavailable are kept for.
    send(ALICE, {"type": "Note"}, [here])
    with transaction.atomic():
        batch = send(ALICE, {"type": "Delete", "id": f"{ALICE}/d/1", "object": post}, [gone, here])
    assert batch is not None and batch.size == 2


@sqlite_only
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("mode", [None, "IMMEDIATE"])
def test_a_stop_while_a_view_holds_the_write_lock_waits_the_grace_not_each_timeout(
    mode: str | None,
    inbox: Inbox,
    start_deliverer: Callable[..., Any],
    holder: Callable[..., Holder],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Each of the stopped loop's last writes waited the connection's whole
    # busy timeout for a lock a view held: 5 s each here, 20 s each with the
    # README's settings, past a container's 10 s to stop.
    if mode and django.VERSION < (5, 1):
        pytest.skip("Django 4.2 has no transaction_mode")
    options = connections.settings["default"]["OPTIONS"]
    monkeypatch.setitem(options, "timeout", 5)
    if mode:
        monkeypatch.setitem(options, "transaction_mode", mode)
    send(ALICE, {"type": "Note"}, [inbox.url("/1")])
    runner = start_deliverer(heartbeat=True)
    wait_until(lambda: Delivery.objects.filter(status=Status.DELIVERED).exists())
    holder(lambda: 50.0)
    started = time.monotonic()
    runner.stop(timeout=50)
    assert time.monotonic() - started < STOPPING_GRACE + FINAL_WRITES_WAIT + 2.5


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_sqlite_locked_by_another_process_a_stop_returns_within_the_grace(
    inboxes: Callable[..., Inbox],
    start_deliverer: Callable[..., Any],
) -> None:
    """Another process holds SQLite's write lock (a long migration, a backup)
    while answers come back; the deliverer is asked to stop, in a claim's
    wait for the lock. That wait ends at the stop's grace, and the writes'
    tries at theirs (3 s each), not at the busy timeout (20 s here, 22.5 s
    before)."""
    import sqlite3

    from django.db import connection

    from django_federation_delivery.deliverer import FINAL_WRITES_WAIT, STOPPING_GRACE

    if connection.vendor != "sqlite":
        pytest.skip("SQLite's write lock")
    inbox = inboxes(delay=1.0)
    send(ALICE, NOTE, [inbox.url(f"/{n}") for n in range(4)])
    runner = start_deliverer(lease=60)
    wait_until(lambda: len(inbox.received) >= 2, timeout=10)
    other = sqlite3.connect(connection.settings_dict["NAME"], timeout=5, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")
    try:
        time.sleep(1.5)  # the answers come back, their write waits for the lock
        asked = time.monotonic()
        runner.deliverer.stop()
        runner.thread.join(25)
        took = time.monotonic() - asked
    finally:
        other.execute("ROLLBACK")
        other.close()
    assert not runner.thread.is_alive()
    assert took < 2 * STOPPING_GRACE + FINAL_WRITES_WAIT + 2.5, f"stopped {took:.1f} s after"


@pytest.mark.django_db(transaction=True)
def test_a_write_lock_asked_for_on_a_stale_snapshot_fails_at_once_not_after_a_spin() -> None:
    """On SQLite (WAL, deferred BEGIN: these settings), on the deliverer's loop
    connection (its prompt write lock installed, as in ``run()``: a signal
    receiver runs there), a transaction reads, another connection (a web
    process) commits a write, then sends a ``Delete`` (whose retraction takes
    the write lock first, ``lock_for_writing``; so do ``requeue`` and
    ``pause_host``). SQLite answers SQLITE_BUSY_SNAPSHOT, which no wait can
    cure: it fails at once ("database is locked"), not after a busy timeout
    (20 s here) of tries again on the loop's thread."""
    import sqlite3
    import time

    from django.db import OperationalError, connection, transaction

    from django_federation_delivery import send, writelock
    from django_federation_delivery.models import Delivery

    from .keys import ALICE

    if connection.vendor != "sqlite":
        pytest.skip("SQLite's write lock")
    connection.ensure_connection()
    other = sqlite3.connect(str(connection.settings_dict["NAME"]), timeout=5, isolation_level=None)
    other.execute("CREATE TABLE IF NOT EXISTS r122_writes (n INTEGER)")
    remove = writelock.install("default")
    raised: list[BaseException] = []
    try:
        with transaction.atomic():
            list(Delivery.objects.all()[:1])  # a read: the snapshot is taken
            other.execute("INSERT INTO r122_writes VALUES (1)")  # committed
            started, cpu = time.monotonic(), time.thread_time()
            try:
                send(
                    ALICE,
                    {"type": "Delete", "actor": ALICE, "object": f"{ALICE}/notes/1"},
                    ["https://a.example/inbox"],
                )
            except OperationalError as exc:
                raised.append(exc)
            took, cpu = time.monotonic() - started, time.thread_time() - cpu
    finally:
        remove()
        other.close()
    assert raised, "SQLite refuses the write on a stale snapshot"
    assert took < 1.0, (
        f"the write lock asked for on a stale snapshot failed after {took:.1f} s of retries "
        f"({cpu:.1f} s of CPU)"
    )
