"""Locks held in the database, for work that one process at a time may do;
and a statement stuck on another session's lock, cancelled (a stop's)."""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

from django.db import Error, OperationalError, connections
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.models import F, Model, QuerySet
from django.db.models.functions import Collate

from django_federation_delivery.conf import database_alias
from django_federation_delivery.dialect import connection_for
from django_federation_delivery.models import Host
from django_federation_delivery.store import sql

__all__ = [
    "SessionLock",
    "again_on_deadlock",
    "cancel_stuck",
    "in_id_order",
    "in_name_order",
    "lock_hosts",
    "session_lock",
    "write_first",
]

T = TypeVar("T")
M = TypeVar("M", bound=Model)

#: PostgreSQL's SQLSTATE for a transaction it ended to undo a deadlock.
DEADLOCK = "40P01"
#: How many times a write ended so is made.
DEADLOCK_TRIES = 5
#: The longest wait before the first try again, in seconds: each try waits
#: up to as much again, at random, so that the writer the database let go
#: on finishes first (made again at once, the write met it again, still
#: holding the same rows, and was ended again).
DEADLOCK_PAUSE = 0.05


def write_first(using: str | None = None) -> None:
    """In a transaction on SQLite, take the write lock now, before anything
    is read: a read first would let another connection's write in between,
    and this transaction's own write then fail at once ("database is
    locked") instead of waiting its turn. Nothing elsewhere, nor where the
    transaction was begun ``IMMEDIATE``."""
    with sql.on(connection_for(using or database_alias())) as db:
        db.lock_for_writing()


def transaction_lock(using: str, key: int) -> None:
    """On PostgreSQL, the advisory lock ``key``, waited for and held until
    the transaction ends: the key alone, not mixed with this queue's table,
    for a database that may hold none (django-q2's schedules, routed
    elsewhere). Nothing elsewhere."""
    connection = connections[using]
    if connection.vendor == "postgresql":
        with sql.on(connection) as db:
            db.value("advisory_transaction_lock", key=key)


def lock_hosts(names: Iterable[str], using: str, *, paused: bool = False) -> None:
    """Lock the rows of the hosts ``names`` (those paused alone, if
    ``paused``) until the transaction ends, in name order: a resume locks
    the hosts it resumes, a requeue the paused hosts of what it requeues,
    and neither deadlocks the other. On SQLite the write lock does, taken
    here (write_first): a read first would let another connection's write
    in between, and this transaction's own write fail with "database is
    locked"."""
    if connections[using].vendor == "sqlite":
        write_first(using)
        return
    rows = Host.objects.using(using).select_for_update(no_key=True).filter(name__in=list(names))
    if paused:
        rows = rows.filter(paused_at__isnull=False)
    list(rows.order_by(in_name_order(using)).values_list("name", flat=True))


def in_name_order(using: str, field: str = "name") -> F | Collate:
    """The order every writer of many hosts locks them in (or of many rows
    keyed by text, ``field``: breakers): the names' code points, as
    Python's ``sorted()`` orders them (a deliverer's ``record_hosts``, a
    pause's upsert), whatever the database's collation
    (en_US puts ``a.example:8443`` before ``a.example.net``, where the code
    points put it after: two orders, a deadlock). SQLite compares text by
    its bytes, in that order already."""
    if connections[using].vendor == "postgresql":
        return Collate(field, "C")
    return F(field)


def in_id_order(rows: QuerySet[M]) -> QuerySet[M]:
    """``rows``, for one UPDATE in the caller's transaction that locks them
    lowest id first on PostgreSQL, as every writer of many deliveries does
    (a settle, a give-up, a supersede): an UPDATE alone locks its rows in
    the order its plan reads them, which is the table's as often as not (a
    row rewritten since is read last), and two writers of the same rows in
    two orders deadlock. One statement still: the rows are chosen and
    locked by a subquery that sorts them. (SQLite writes one at a time.)"""
    if connections[rows.db].vendor != "postgresql":
        return rows
    locked = rows.select_for_update().order_by("pk").values("pk")
    return rows.model._default_manager.using(rows.db).filter(pk__in=locked)


def again_on_deadlock(using: str, write: Callable[[], T]) -> T:
    """``write()``, a transaction of its own, made again when PostgreSQL ended
    it to undo a deadlock with another writer (an operator's action and a
    purge, or a deliverer's settle, each locking rows the other holds): the
    database chooses which of the two ends, and the other goes on. Inside
    a transaction of the caller's, ended with it, it is raised."""
    outer = connection_for(using).in_atomic_block
    tried = 1
    while True:
        try:
            return write()
        except OperationalError as exc:
            code = getattr(exc.__cause__, "sqlstate", None)
            if outer or code != DEADLOCK or tried >= DEADLOCK_TRIES:
                raise
            time.sleep(random.uniform(0, DEADLOCK_PAUSE * tried))
            tried += 1


class SessionLock:
    """PostgreSQL's advisory lock ``key``, held on a session of its own.

    A session lock lasts as long as its session: one the database ends (a
    restart, a failover, ``pg_terminate_backend``) took the lock with it,
    and another session may have it now. :meth:`alive` asks."""

    def __init__(self, using: str, key: int) -> None:
        self.using = using
        self.key = key
        #: The session that holds it; None while none does.
        self._connection: BaseDatabaseWrapper | None = None

    def take(self) -> bool:
        """Try to take it on a new session: whether it was had. A database
        that cannot be reached raises, as any statement does."""
        self.release()
        connection = connections.create_connection(self.using)
        try:
            with sql.on(connection) as db:
                held = bool(db.value("try_advisory_lock", key=self.key))
        except BaseException:
            connection.close()
            raise
        if held:
            self._connection = connection
        else:
            connection.close()
        return held

    def alive(self) -> bool:
        """Whether its session still holds it: one round trip, on the lock's
        own connection (which also keeps the session from being idle long)."""
        if self._connection is None:
            return False
        try:
            with sql.on(self._connection) as db:
                return bool(db.value("holds_advisory_lock", key=self.key))
        except Error:
            return False  # the session ended, and the lock with it

    def release(self) -> None:
        """Let it go, if held. The unlock's error is no error: a session that
        ended released the lock as it ended, and closing it does the same."""
        connection, self._connection = self._connection, None
        if connection is None:
            return
        try:
            with sql.on(connection) as db:
                db.value("advisory_unlock", key=self.key)
        except Error:
            pass
        finally:
            connection.close()


@contextlib.contextmanager
def session_lock(using: str, key: int) -> Iterator[SessionLock | None]:
    """PostgreSQL's advisory lock ``key``, tried on a connection of its own
    and held until the block ends: the lock, or None when another holds it."""
    lock = SessionLock(using, key)
    if not lock.take():
        yield None
        return
    try:
        yield lock
    finally:
        lock.release()


def cancel_stuck(pid: int, seconds: float, using: str) -> bool:
    """PostgreSQL: cancel the statement the session of the backend ``pid``
    has been running for ``seconds`` or more (one waiting on a lock another
    session holds, say), from this thread's own connection; whether one was."""
    with sql.on(connection_for(using)) as db:
        return bool(db.value("cancel_stuck", pid=pid, seconds=seconds))
