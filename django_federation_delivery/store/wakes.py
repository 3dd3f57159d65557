"""Deliverers of this process woken when new work is queued: a send, a
requeue or a host resumed wakes each at once, on commit.

Here, and not in ``wakeup.py``, which listens across processes through the
store's statements: what the store's own writes call on commit is the
store's, and ``wakeup.py`` hands these on.
"""

from __future__ import annotations

import threading
import weakref

__all__ = ["notify_local", "register", "unregister"]

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
