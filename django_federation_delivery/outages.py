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
        #: Whether the outage is a write lock another process holds (SQLite's
        #: "database is locked"): reads go on meanwhile, and prove nothing.
        self._locked = False
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
                self._locked = _locked(exc)
                self.logger.warning("The database is unavailable (%s); waiting it out", exc)
            connections[self.using].close()
            self._wait(min(LONGEST_WAIT, 0.2 + (now - self._failing_since) / 4), now)
            return None
        if self._failing_since is not None and (reached.wrote if self._locked else reached.ran):
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


def _locked(error: BaseException) -> bool:
    """Whether ``error`` is SQLite's write lock held past the busy timeout."""
    return "database is locked" in str(error) or "database table is locked" in str(error)


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
