"""Rounds of the deliverer, and the purge, as a task queue's worker runs them.

A round is the claim-and-send loop of ``run_deliverer`` for a bounded time:
it claims for its bound only, then finishes what is in flight (an attempt
lasts at most ``ATTEMPT_TIMEOUT``, or ``WEBHOOK_TIMEOUT``, or a webhook
kind's own time limit; the probes of unavailable hosts it started, as long)
before it returns what it did. Nothing is lost if its worker is killed all
the same: what it had claimed comes due again when its lease lapses.

Two rounds never run at once, whoever runs them (a round still going when
the next is due, two workers, a task handed on after a timeout, a round of
django-q2's beside one of Django's tasks): a round takes a lock first, and
returns at once if another holds it. A round asks after its lock as it goes:
on PostgreSQL the database may end the lock's session (a restart, a
failover), and the lock with it; the round takes it again, or, if another
round has it by then, stops claiming.

What the queue's own rules ask of a round (how long it may take, how often
it comes) is its integration's: ``contrib.django_q`` for django-q2's
``qcluster``, ``contrib.tasks`` for Django's tasks.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.db import Error, connections
from django.db.transaction import TransactionManagementError
from django.utils import translation
from django.utils.translation import gettext as _

from django_federation_delivery.addresses import quoted
from django_federation_delivery.checks import deliverer_problems, lacking_migrations
from django_federation_delivery.conf import app_settings, database_alias
from django_federation_delivery.deliverer import (
    Deliverer,
    host_limits,
    longest_attempt,
    transaction_open,
)
from django_federation_delivery.heartbeats import Heartbeat
from django_federation_delivery.limits import HostLimits
from django_federation_delivery.retention import purge_by_setting
from django_federation_delivery.store import locks

logger = logging.getLogger(__name__)

#: A round's bound when none is given (and its integration leaves room).
ROUND_SECONDS = 50.0
#: Beyond the longest attempt, what finishing a round takes: writing the
#: outcomes, ending the threads.
FINISH_MARGIN = 5.0
#: The most seconds a round, its period or a purge may be given: a day. A
#: round is the loop for a while, between others; and a bound past what a
#: timer can wait (``threading.TIMEOUT_MAX``) is none: the round never stopped.
MOST_SECONDS = 86400.0
ANOTHER_ROUND = "another round is running"

#: The PostgreSQL advisory lock a round holds: a fixed 64-bit key from a name.
#: The name is where rounds began; every integration's rounds take this one
#: key, so that they exclude each other.
ADVISORY_KEY = int.from_bytes(
    hashlib.sha256(b"django_federation_delivery.contrib.django_q.round").digest()[:8],
    "big",
    signed=True,
)
#: Beside an SQLite database, the file whose lock a round holds.
LOCK_SUFFIX = "-delivery-round.lock"


def positive(value: object, message: str) -> float:
    """``value`` as seconds, or a ValueError with ``message`` (which says
    ``%(value)s`` and ``%(most)g``) if it is not a number above 0 and at
    most MOST_SECONDS."""
    # Compared, never made a float first: JSON holds an int of any size, and
    # one past a float's range would raise OverflowError, naming nothing.
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not 0 < value <= MOST_SECONDS
    ):
        # quoted(): an int of hundreds of digits is cut, not repeated.
        raise ValueError(message % {"value": quoted(value), "most": MOST_SECONDS})
    return float(value)


def finish_seconds() -> float:
    """The longest a round takes to finish once it stops claiming: the
    longest attempt of any kind (a webhook kind's own policy may give one
    longer than the settings), which is also the longest a probe of an
    unavailable host started before the stop takes (none starts after it),
    and a margin to write what came of them."""
    return longest_attempt() + FINISH_MARGIN


def refuse_bad_settings() -> None:
    """What ``run_deliverer`` refuses to start on, raised: a round sends
    nothing under settings it would refuse (a kind of destination removed
    from ``CHANNELS`` while its events wait, say)."""
    problems = deliverer_problems()
    if problems:
        raise ImproperlyConfigured(problems)


@contextlib.contextmanager
def round_lock(using: str | None = None) -> Iterator[bool]:
    """Held by one round at a time, across processes and machines; gives
    whether this one holds it. Released when the round ends, or at once
    when its process dies (killed by its worker's timeout, say): nothing to
    expire.

    PostgreSQL: a session advisory lock, on a connection of its own (the
    loop closes and reopens its connections as it goes). SQLite: a lock on
    a file beside the database, which only processes of one machine share,
    as they share the database itself.
    """
    with _held_lock(using) as kept:
        yield kept is not None


@contextlib.contextmanager
def _held_lock(using: str | None = None) -> Iterator[Callable[[], bool] | None]:
    """:func:`round_lock`, giving what says whether it is still held (see
    :class:`_Kept`), or None when another round holds it."""
    using = using or database_alias()
    connection = connections[using]
    if connection.vendor == "postgresql":
        with locks.session_lock(using, ADVISORY_KEY) as lock:
            yield None if lock is None else _Kept(lock)
    elif connection.vendor == "sqlite":
        with _file_lock(connection.settings_dict["NAME"]) as held:
            # Held by the open file: nothing but this process's end takes it.
            yield (lambda: True) if held else None
    else:
        raise ImproperlyConfigured(
            _("Rounds need PostgreSQL or SQLite, not %(vendor)s (database %(alias)r).")
            % {"vendor": connection.vendor, "alias": using}
        )


class _Kept:
    """Whether a round still holds its advisory lock, asked as its loop goes.

    The database ends the lock's session in a restart or a failover, and
    the lock with it, which the next round may then take: the lock is taken
    again on a new session, and the round told to stop claiming (False) only
    if another round has it by then. While the database cannot be reached,
    True: the round's own statements wait for it, and the lock is asked for
    again at the next look."""

    def __init__(self, lock: locks.SessionLock) -> None:
        self.lock = lock
        #: Lost and not taken again yet: said once, not at every look.
        self._lost = False

    def __call__(self) -> bool:
        if self.lock.alive():
            return True
        try:
            taken = self.lock.take()
        except Error as exc:
            if not self._lost:
                logger.warning(
                    "The round's lock went with its database session, and cannot "
                    "be taken again yet (%s)",
                    type(exc).__name__,
                )
            self._lost = True
            return True
        self._lost = False
        if taken:
            logger.warning("The round's lock went with its database session: taken again")
            return True
        logger.warning(
            "The round's lock went with its database session, and another round has "
            "taken it: this one stops claiming and finishes what is in flight"
        )
        return False


@contextlib.contextmanager
def _file_lock(name: Any) -> Iterator[bool]:
    path = str(name)
    if not path or path == ":memory:" or "mode=memory" in path:
        raise ImproperlyConfigured(
            _(
                "Rounds need an SQLite database in a file, which the processes "
                "running them share, not one in memory."
            )
        )
    try:
        import fcntl
    except ImportError:
        raise ImproperlyConfigured(_("Rounds on SQLite need fcntl (Linux, macOS, BSD).")) from None
    lock_path = Path(path.removeprefix("file:").split("?")[0] + LOCK_SUFFIX)
    # flock, not fcntl's record locks: it is held by the open file, so two
    # rounds in one process exclude each other too, and SQLite's own record
    # locks on the database are left alone.
    with open(lock_path, "a+b") as file:
        try:
            fcntl.flock(file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(file.fileno(), fcntl.LOCK_UN)


def kept_heartbeat(kept: dict[str, Heartbeat], using: str, *, period: float) -> Heartbeat:
    """The heartbeat this process's rounds keep in ``kept``, by database (a
    new one in a forked child, or for another period): beating every
    HEARTBEAT_SECONDS while a round runs, and left in place between rounds,
    alive for three of ``period``, the time between two rounds, after the last."""
    heartbeat = kept.get(using)
    if heartbeat is None or heartbeat.pid != os.getpid():
        heartbeat = Heartbeat(
            app_settings.heartbeat_seconds, using=using, alive_for=period, kept=True
        )
        kept[using] = heartbeat
    else:
        # Another period (two schedules, or one changed): the same row, which
        # its next beat writes alive for the new one. A new one would leave
        # the old row alive, one more deliverer shown.
        heartbeat.alive_for = max(heartbeat.interval, period)
    return heartbeat


#: Each database's host limits in this process, kept from one round to the
#: next, by pid: a rest a host asked for (a 429's or 503's Retry-After) and a
#: limit it was halved to outlast the round that heard them, as they outlast
#: an attempt in run_deliverer.
_limits: dict[str, tuple[int, HostLimits]] = {}


def kept_limits(using: str) -> HostLimits:
    """This process's host limits for ``using``'s rounds: new in a forked
    child, or once ``PER_HOST`` or ``PER_HOST_MAX`` say otherwise."""
    kept = _limits.get(using)
    wanted = host_limits()
    if (
        kept is None
        or kept[0] != os.getpid()
        or (kept[1].start, kept[1].most) != (wanted.start, wanted.most)
    ):
        kept = _limits[using] = (os.getpid(), wanted)
    return kept[1]


def forget_limits() -> None:
    """Forget every kept host limit and rest: the next round starts anew
    (``testing.forget_kept``, between a project's tests)."""
    _limits.clear()


def run_round(bound: float, *, using: str, heartbeat: Heartbeat) -> dict[str, Any]:
    """Claim and send for ``bound`` seconds, then finish what is in flight,
    holding the round's lock; what was done, as a task's result keeps it.
    Returns at once, saying so, when another round holds the lock.

    ``TransactionManagementError`` in a transaction of the caller's (a round
    a task backend runs at once, as Django's ImmediateBackend does, enqueued
    in a view's ``atomic()``): the loop writes in transactions of its own,
    and closes its thread's connections, which would roll the caller's back,
    its send included, with no error told."""
    if transaction_open() is not None:
        raise TransactionManagementError(
            _(
                "A round cannot run inside a transaction: it would roll it back. Enqueue it "
                "once the transaction commits: "
                "transaction.on_commit(lambda: deliver_round.enqueue())."
            )
        )
    # As run_deliverer refuses to start: every claim would fail, each
    # waited out as an outage for the whole bound, the round told a success.
    lacking = lacking_migrations(using)
    if lacking:
        raise ImproperlyConfigured(lacking)
    with _held_lock(using) as kept:
        if kept is None:
            logger.info("A round was not started: %s", ANOTHER_ROUND)
            return {"ran": False, "reason": ANOTHER_ROUND}
        # The lock asked after as the loop goes: a round that lost it to
        # another stops claiming, so that two never claim at once.
        deliverer = Deliverer(
            using=using, heartbeat=heartbeat, holding=kept, limits=kept_limits(using)
        )
        summary = deliverer.run(stop_after=bound)
    # Log lines stay English: operators grep them.
    with translation.override(None):
        logger.info("Round: %s", summary.line())
    return {
        "ran": True,
        "delivered": summary.delivered,
        "retrying": summary.retrying,
        "refused": summary.refused,
        "failed": summary.failed,
        "skipped": summary.skipped,
        "held": summary.held,
        "superseded": summary.superseded,
        "attempts": summary.attempts,
        "seconds": round(summary.elapsed, 1),
    }


def run_purge(*, using: str, seconds: float | None) -> dict[str, Any]:
    """:func:`retention.purge_by_setting`, a chunk at a time, stopped between
    chunks once ``seconds`` have passed (None: when nothing is left); the
    next purge goes on where it stopped. What it deleted, as a task's result
    keeps it."""
    deadline = None if seconds is None else time.monotonic() + seconds

    def out_of_time() -> bool:
        return deadline is not None and time.monotonic() >= deadline

    sqlite = connections[using].vendor == "sqlite"
    # On SQLite the pause leaves the one write lock to a round between chunks.
    purged = purge_by_setting(using=using, pause=0.05 if sqlite else 0.0, should_stop=out_of_time)
    with translation.override(None):
        logger.info("Purge: %s", purged.line())
    return {
        "deliveries": dict(purged.deliveries),
        "batches": purged.batches,
        "hosts": purged.hosts,
        "history": purged.history,
        "seconds": round(purged.seconds, 1),
        "finished": not out_of_time(),
    }
