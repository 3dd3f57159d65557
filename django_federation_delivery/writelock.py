"""The deliverer's way into SQLite's write lock: as soon as it frees.

SQLite lets one connection write at a time. A web process that sends every
few milliseconds takes the lock again as soon as it commits, and a ``BEGIN
IMMEDIATE`` that finds it taken waits in SQLite's busy handler, which sleeps
1, 2, 5, 10 … up to 100 ms between its looks: the deliverer is let in long
after the lock first freed, tens of milliseconds a claim or a settle against
the sender's half millisecond. Python's sqlite3 offers no hook into that
handler, so for the deliverer's own connection the ``BEGIN`` is tried with
no busy timeout and tried again after a short sleep (half a millisecond,
growing to 2 ms), until the connection's busy timeout (``OPTIONS['timeout']``)
has passed; then SQLite's "database is locked" is raised, as before.

Only a ``BEGIN IMMEDIATE`` or ``BEGIN EXCLUSIVE`` is tried again: it either
takes the lock or changes nothing. Every other statement runs once, with the
busy handler as configured; in WAL none of a transaction that holds the lock
meets a busy database. A deferred ``BEGIN`` (Django 4.2, or no
``transaction_mode``) takes no lock: it is left alone, and its first write
waits in the busy handler as before. PostgreSQL is not touched.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable
from typing import Any

from django.db import OperationalError, connections

__all__ = ["PromptWriteLock", "install"]

#: The first sleep between two tries of a BEGIN, in seconds.
FIRST_WAIT = 0.0005
#: Each sleep is this much longer than the one before …
GROWTH = 1.25
#: … up to this: a few looks a millisecond cost little CPU, and a lock held
#: long (a fan-out's enqueue) is taken at most this late once it frees.
LONGEST_WAIT = 0.002

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


def is_busy(exc: BaseException) -> bool:
    """Whether ``exc`` (Django's error or sqlite3's) is SQLITE_BUSY, in any of
    its extended forms: "database is locked"."""
    error = exc if isinstance(exc, sqlite3.Error) else exc.__cause__
    code = getattr(error, "sqlite_errorcode", None)
    return isinstance(code, int) and code & 0xFF == sqlite3.SQLITE_BUSY


class PromptWriteLock:
    """An execute wrapper of one SQLite connection: its locking BEGINs wait
    for the lock in short sleeps instead of SQLite's busy handler."""

    def __init__(
        self,
        connection: Any,
        *,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.connection = connection
        self.sleep = sleep
        self.clock = clock
        #: The raw connection last seen, and its busy timeout in milliseconds.
        self._raw: sqlite3.Connection | None = None
        self._timeout_ms = 0

    def __call__(
        self, execute: Callable[..., Any], sql: str, params: Any, many: bool, context: Any
    ) -> Any:
        if many or params or " ".join(str(sql).split()).upper() not in LOCKING_BEGINS:
            return execute(sql, params, many, context)
        raw = self.connection.connection
        timeout_ms = self._busy_timeout(raw)
        raw.execute("PRAGMA busy_timeout = 0")
        try:
            return self._begin(execute, sql, params, many, context, timeout_ms / 1000)
        finally:
            raw.execute(f"PRAGMA busy_timeout = {timeout_ms:d}")

    def _busy_timeout(self, raw: sqlite3.Connection) -> int:
        # Read once a connection: what OPTIONS['timeout'] (or an init_command)
        # made it. The deliverer reconnects often (CONN_MAX_AGE).
        if raw is not self._raw:
            self._timeout_ms = int(raw.execute("PRAGMA busy_timeout").fetchone()[0])
            self._raw = raw
        return self._timeout_ms

    def _begin(
        self,
        execute: Callable[..., Any],
        sql: str,
        params: Any,
        many: bool,
        context: Any,
        timeout: float,
    ) -> Any:
        deadline = self.clock() + timeout
        wait = FIRST_WAIT
        while True:
            try:
                return execute(sql, params, many, context)
            except (OperationalError, sqlite3.OperationalError) as exc:
                left = deadline - self.clock()
                if not is_busy(exc) or left <= 0:
                    raise
            # A last try at the deadline, as SQLite's own handler makes.
            self.sleep(min(wait, left))
            wait = min(LONGEST_WAIT, wait * GROWTH)
