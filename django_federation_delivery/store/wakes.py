"""Deliverers woken when new work is queued: a send, a requeue or a host
resumed wakes each of this process at once, on commit, and (but for a send,
whose own statement notifies) every listening process's on PostgreSQL.

Here, and not in ``wakeup.py``, which listens across processes through the
store's statements: what the store's own writes call on commit is the
store's, and ``wakeup.py`` hands these on.
"""

from __future__ import annotations

import logging
import threading
import weakref

from django.db import DatabaseError, connections, transaction

from django_federation_delivery.dialect import is_postgresql
from django_federation_delivery.store import sql

__all__ = ["notify_local", "register", "unregister", "wake_all"]

logger = logging.getLogger(__name__)

_waiters: weakref.WeakSet[threading.Event] = weakref.WeakSet()
_lock = threading.Lock()


def register(event: threading.Event) -> None:
    with _lock:
        _waiters.add(event)


def unregister(event: threading.Event) -> None:
    with _lock:
        _waiters.discard(event)


def notify_local() -> None:
    """Wake every deliverer running in this process."""
    with _lock:
        waiters = list(_waiters)
    for event in waiters:
        event.set()


def wake_all(alias: str) -> None:
    """Wake every deliverer once the caller's transaction commits (at once,
    outside one): this process's, and on PostgreSQL every process's that
    listens, as a send wakes them. For a write that made deliveries due now
    outside a send: without it, a deliverer of another process idle on its
    listener would find them only at its next idle poll, 30 s on."""
    transaction.on_commit(lambda: _wake_all_now(alias), using=alias)


def _wake_all_now(alias: str) -> None:
    notify_local()
    connection = connections[alias]
    if not is_postgresql(connection):
        return  # every SQLite deliverer polls
    try:
        with sql.on(connection) as db:
            db.run("notify")
    except DatabaseError as exc:
        # What was written is written: deliverers find it at their next poll.
        logger.warning("Other processes' deliverers could not be woken: %s", type(exc).__name__)
