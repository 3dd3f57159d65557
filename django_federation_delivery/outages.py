"""The loop's way to the database: an outage is logged and waited out,
never a reason to stop.

A query run through :class:`Database` answers what the query answers, or
None when the database was away; the caller goes on with what it has, and
asks again next round. A query whose failure its caller must tell apart
(a claim, a settle) answers something other than None.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable
from typing import Any, ParamSpec, Protocol, TypeVar

from django.db import DatabaseError, InterfaceError, connections

from django_federation_delivery.store.locks import cancel_stuck

__all__ = ["Database", "Runner"]

P = ParamSpec("P")
T = TypeVar("T")

#: The longest wait after a failed query, in seconds.
LONGEST_WAIT = 5.0


class Runner(Protocol):
    """Runs ``function``: its answer, or None when the database was away."""

    def __call__(
        self, function: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs
    ) -> T | None: ...


class Database:
    """Runs queries on ``using``; a failure closes the connection and waits a
    little longer each time (up to 5 s), or until ``stopping`` is set.

    Once ``stopping`` is set, a wait is waited whole: cut short by a stop
    that has come already, it would be none, and a loop writing what it
    holds before it stops would try again flat out. What bounds it then is
    :meth:`end_waits_by`.
    """

    def __init__(
        self,
        using: str,
        stopping: threading.Event,
        *,
        logger: logging.Logger,
        sleep: Callable[[float], object] = time.sleep,
    ) -> None:
        self.using = using
        self.stopping = stopping
        self.logger = logger
        self._sleep = sleep
        self._failing_since: float | None = None
        #: Whether the outage refuses writes alone (SQLite's write lock held
        #: by another process, a database turned read-only or a full disk):
        #: reads go on meanwhile, and prove nothing.
        self._writes_refused = False
        self._waits_end: float | None = None

    @property
    def failing(self) -> bool:
        """Whether the last query failed."""
        return self._failing_since is not None

    def __call__(self, function: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T | None:
        reached = _Reached()
        try:
            if self._failing_since is None:
                value = function(*args, **kwargs)
            else:
                # Back only once a statement has run: a call that needed none
                # (closing old connections, nothing to write) proves nothing.
                with connections[self.using].execute_wrapper(reached):
                    value = function(*args, **kwargs)
        except (DatabaseError, InterfaceError) as exc:
            now = time.monotonic()
            if self._failing_since is None:
                self._failing_since = now
                self._writes_refused = _writes_refused(exc)
                self.logger.warning("The database is unavailable (%s); waiting it out", exc)
            connections[self.using].close()
            self._wait(min(LONGEST_WAIT, 0.2 + (now - self._failing_since) / 4), now)
            return None
        if self._failing_since is not None and (
            reached.wrote if self._writes_refused else reached.ran
        ):
            self.logger.warning("The database is back")
            self._failing_since = None
        return value

    def end_waits_by(self, at: float | None) -> None:
        """End every wait after a failure by ``at``, a ``time.monotonic()``
        (no wait once it has passed: each query is tried once); with None,
        each is waited whole again."""
        self._waits_end = at

    def _wait(self, seconds: float, now: float) -> None:
        if self._waits_end is not None:
            seconds = min(seconds, self._waits_end - now)
        if seconds <= 0:
            return
        if self.stopping.is_set():
            self._sleep(seconds)
        else:
            # Until a stop: what is held is then written at once.
            self.stopping.wait(seconds)


def _writes_refused(error: BaseException) -> bool:
    """Whether ``error`` refuses writes alone, reads going on: SQLite's
    write lock held past the busy timeout, a database file or server that
    has turned read-only (a failover's old primary, a file system remounted
    so), a full disk."""
    cause = error.__cause__
    # psycopg 3's sqlstate, psycopg2's pgcode.
    code = getattr(cause, "sqlstate", None) or getattr(cause, "pgcode", None)
    if code in _WRITES_REFUSED_SQLSTATES:
        return True
    text = str(error)
    return any(words in text for words in _WRITES_REFUSED_SQLITE)


#: read_only_sql_transaction, disk_full.
_WRITES_REFUSED_SQLSTATES = frozenset({"25006", "53100"})
_WRITES_REFUSED_SQLITE = (
    "database is locked",
    "database table is locked",
    "attempt to write a readonly database",
    "database or disk is full",
)


#: A statement that writes, or takes the write lock first (writelock.py).
_WRITES = re.compile(r"\s*BEGIN\s+IMMEDIATE\b|.*\b(?:INSERT|UPDATE|DELETE|REPLACE)\b", re.I | re.S)


class _Reached:
    """An execute wrapper that notes whether a statement ran through to its
    end, and whether one that writes did."""

    ran = False
    wrote = False

    def __call__(self, execute: Callable[..., Any], sql: Any, *args: Any) -> Any:
        answer = execute(sql, *args)
        self.ran = True
        if not self.wrote and isinstance(sql, str) and _WRITES.match(sql):
            self.wrote = True
        return answer


#: How long a statement of a stopping loop past its grace may run before it
#: is cancelled, and how often that is looked at, in seconds.
STUCK_AFTER = 1.0
STUCK_LOOK = 0.5


class Unblocker:
    """A stop past its grace, on PostgreSQL: a statement the loop's session
    runs that long (waiting on a lock another session holds: a migration's
    ``ACCESS EXCLUSIVE``, an operator's ``LOCK TABLE``) would hold the stop
    for as long as that session likes, out of reach of any grace. From
    another thread, it is cancelled (``pg_cancel_backend``), and each one
    after it that runs as long, until the loop has left: the loop meets it
    as the database away, and leaves what it holds to the leases.

    :meth:`watch` takes the loop's connection, in the loop's thread;
    :meth:`start` begins (once), at a stop; :meth:`done` ends it."""

    def __init__(self, using: str, *, logger: logging.Logger) -> None:
        self.using = using
        self.logger = logger
        self._loop: Any = None
        self._left = threading.Event()
        self._thread: threading.Thread | None = None

    def watch(self) -> None:
        """The calling thread's connection is the loop's, from now on."""
        connection = connections[self.using]
        self._loop = connection if connection.vendor == "postgresql" else None
        self._left.clear()
        self._thread = None

    def start(self, by: float) -> None:
        """At a stop: from ``by`` (a ``time.monotonic()``) on, cancel what
        the loop is stuck in."""
        if self._loop is None or self._thread is not None or self._left.is_set():
            return
        self._thread = threading.Thread(
            target=self._run, args=(by,), name="federation-delivery-unblocker", daemon=True
        )
        self._thread.start()

    def done(self) -> None:
        """The loop has left: nothing more is cancelled."""
        self._left.set()
        self._loop = None

    def _run(self, by: float) -> None:
        try:
            if self._left.wait(max(0.0, by - time.monotonic())):
                return
            while not self._left.is_set():
                loop = self._loop
                raw = None if loop is None else loop.connection
                pid = getattr(getattr(raw, "info", None), "backend_pid", None)
                if pid:
                    try:
                        cancelled = cancel_stuck(pid, STUCK_AFTER, self.using)
                    except DatabaseError:
                        cancelled = False
                    if cancelled and not self._left.is_set():
                        self.logger.warning(
                            "Stopping: a statement of the loop's still ran %g s past the "
                            "grace (waiting on a lock another session holds?): cancelled",
                            STUCK_AFTER,
                        )
                self._left.wait(STUCK_LOOK)
        finally:
            connections.close_all()  # this thread's
