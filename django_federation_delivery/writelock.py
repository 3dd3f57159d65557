"""The deliverer's way into SQLite's write lock: as soon as it frees.

SQLite lets one connection write at a time. A web process that sends every
few milliseconds takes the lock again as soon as it commits, and a ``BEGIN
IMMEDIATE`` that finds it taken waits in SQLite's busy handler, which looks
again after 1, 2, 5, 10 … up to 100 ms: the deliverer is let in long after
the lock first freed (10 to 130 ms a claim or a settle in
``benchmarks/steady.py``, against the sender's half millisecond). Python's
sqlite3 offers no hook into that handler, so for the deliverer's own
connection the ``BEGIN`` is given a busy timeout of a millisecond (growing to
10, where the handler's looks are still 1 to 5 ms apart) and is tried again
each time that runs out, until the connection's own busy timeout
(``OPTIONS['timeout']``) has passed; then SQLite's "database is locked" is
raised, as before. The looks are SQLite's, made without the GIL: a sleep in
Python would wait for the GIL after each one, behind the worker threads.

Only a ``BEGIN IMMEDIATE`` or ``BEGIN EXCLUSIVE`` is tried again: it either
takes the lock or changes nothing. Every other statement runs once, with the
busy handler as configured; in WAL none of a transaction that holds the lock
meets a busy database. A deferred ``BEGIN`` (Django 4.2, or no
``transaction_mode``) takes no lock: it is left alone, and its first write
waits in the busy handler as before. PostgreSQL is not touched.
"""

from __future__ import annotations

import math
import sqlite3
import time
from collections.abc import Callable
from typing import Any

from django.db import OperationalError, connections

from django_federation_delivery.store import sql as statements

__all__ = ["PromptWriteLock", "bound_waits", "install"]

#: The busy timeout of a BEGIN's first try, in milliseconds: SQLite looks at
#: the lock at once and after 1 ms, and the next try looks again at once.
FIRST_TRY_MS = 1.0
#: Each try's is this much longer than the one before …
GROWTH = 1.25
#: … up to this: looks at 0, 1, 3, 8 and 10 ms, so that a lock held long (a
#: fan-out's enqueue) costs a try every 10 ms, and is taken within 5 ms of
#: its freeing.
LONGEST_TRY_MS = 10.0

#: The BEGINs that take the write lock (Django writes ``BEGIN <mode>``).
LOCKING_BEGINS = frozenset({"BEGIN IMMEDIATE", "BEGIN EXCLUSIVE"})


def install(using: str) -> Callable[[], None]:
    """Has this thread's connection to ``using`` take SQLite's write lock as
    soon as it frees (nothing on another database); returns what undoes it."""
    connection = connections[using]
    if connection.vendor != "sqlite":
        return lambda: None
    wrapper = PromptWriteLock(connection)
    connection.execute_wrappers.append(wrapper)

    def remove() -> None:
        # By identity: another wrapper may have been added after this one.
        if wrapper in connection.execute_wrappers:
            connection.execute_wrappers.remove(wrapper)

    return remove


def _lock_for_writing() -> str:
    """The package's statement that takes the write lock in a transaction
    begun deferred and writes nothing: tried again as a locking BEGIN is,
    in short waits a stop can bound, not one busy timeout long."""
    return " ".join(statements.statements_of("sqlite")["lock_for_writing"].text.split())


#: SQLITE_BUSY_SNAPSHOT: a transaction that has read asks for the write
#: lock after another wrote; no wait lets it have it (its snapshot is stale).
BUSY_SNAPSHOT = 517


def _stale(exc: BaseException) -> bool:
    """Whether ``exc`` is SQLITE_BUSY_SNAPSHOT, which no try again cures: the
    transaction must begin again. (Tried again, it spun for the busy timeout.)"""
    error = exc if isinstance(exc, sqlite3.Error) else exc.__cause__
    return getattr(error, "sqlite_errorcode", None) == BUSY_SNAPSHOT


def installed(using: str) -> PromptWriteLock | None:
    """The write lock :func:`install` installed on this thread's connection
    to ``using``, if it did."""
    for wrapper in connections[using].execute_wrappers:
        if isinstance(wrapper, PromptWriteLock):
            return wrapper
    return None


def is_busy(exc: BaseException) -> bool:
    """Whether ``exc`` (Django's error or sqlite3's) is SQLITE_BUSY, in any of
    its extended forms: "database is locked"."""
    error = exc if isinstance(exc, sqlite3.Error) else exc.__cause__
    code = getattr(error, "sqlite_errorcode", None)
    return isinstance(code, int) and code & 0xFF == sqlite3.SQLITE_BUSY


def bound_waits(using: str, until: float | None) -> None:
    """Have this thread's connection to ``using`` wait for the write lock no
    later than ``until``, a ``time.monotonic()``, whatever its own busy
    timeout (a stopping deliverer's, which has a grace to keep); with None,
    its own again. Nothing where :func:`install` installed nothing."""
    connection = connections[using]
    for wrapper in connection.execute_wrappers:
        if isinstance(wrapper, PromptWriteLock):
            wrapper.bound(until)


class PromptWriteLock:
    """An execute wrapper of one SQLite connection: its locking BEGINs wait
    for the lock in short busy timeouts, tried again, instead of one long one;
    and, while :meth:`bound`, every statement waits no later than its bound."""

    def __init__(self, connection: Any) -> None:
        self.connection = connection
        #: The raw connection last seen, and its busy timeout in milliseconds.
        self._raw: sqlite3.Connection | None = None
        self._timeout_ms = 0
        #: No wait for the lock past this ``time.monotonic()``; None: none.
        self.until: float | None = None

    def end_by(self, until: float) -> None:
        """From another thread (a stop): no wait for the lock past ``until``,
        the one under way at its next try, within ``LONGEST_TRY_MS``. Nothing
        is asked of the connection, which the waiting thread is using."""
        if self.until is None or until < self.until:
            self.until = until

    def bound(self, until: float | None) -> None:
        self.until = until
        raw = self.connection.connection
        if raw is not None:
            statements.set_busy_timeout(raw, self._bounded(self._busy_timeout(raw)))

    def __call__(
        self, execute: Callable[..., Any], sql: str, params: Any, many: bool, context: Any
    ) -> Any:
        written = " ".join(str(sql).split())
        locking = not (many or params) and (
            written.upper() in LOCKING_BEGINS or written == _lock_for_writing()
        )
        if not locking and self.until is None:
            return execute(sql, params, many, context)
        raw = self.connection.connection
        timeout_ms = self._bounded(self._busy_timeout(raw))
        if not locking:
            # Bounded: a deferred transaction's write waits in the busy handler.
            statements.set_busy_timeout(raw, timeout_ms)
            return execute(sql, params, many, context)
        try:
            return self._begin(raw, lambda: execute(sql, params, many, context), timeout_ms)
        finally:
            statements.set_busy_timeout(raw, timeout_ms)

    def _bounded(self, timeout_ms: int) -> int:
        if self.until is None:
            return timeout_ms
        return max(0, min(timeout_ms, math.ceil((self.until - time.monotonic()) * 1000)))

    def _busy_timeout(self, raw: sqlite3.Connection) -> int:
        # Read once a connection: what OPTIONS['timeout'] (or an init_command)
        # made it. The deliverer reconnects often (CONN_MAX_AGE).
        if raw is not self._raw:
            self._timeout_ms = statements.busy_timeout(raw)
            self._raw = raw
        return self._timeout_ms

    def _begin(self, raw: sqlite3.Connection, begin: Callable[[], Any], timeout_ms: int) -> Any:
        deadline = time.monotonic() + timeout_ms / 1000
        try_ms = FIRST_TRY_MS
        set_ms = None
        while True:
            # Never past the deadline (rounded up: the last try is made at
            # it), nor past a bound set since (a stop's, from another thread).
            if self.until is not None:
                deadline = min(deadline, self.until)
            left_ms = math.ceil((deadline - time.monotonic()) * 1000)
            this_ms = max(0, min(int(try_ms), left_ms))
            if this_ms != set_ms:  # the first few tries are of 1 ms each: set once
                statements.set_busy_timeout(raw, this_ms)
                set_ms = this_ms
            try:
                return begin()
            except (OperationalError, sqlite3.OperationalError) as exc:
                if not is_busy(exc) or _stale(exc) or time.monotonic() >= deadline:
                    raise
            try_ms = min(LONGEST_TRY_MS, try_ms * GROWTH)
