"""Idle keep-alive connections, bounded for the whole process.

Each worker thread has a transport of its own, and each transport a pool for
every host it sent to lately: left alone, the idle connections would grow as
threads times hosts, past the process's limit on open files (and then a
database connect fails too). Every open connection put back into a pool is
noted here, least recently used first, and past the limit the oldest are
closed, whichever thread's pool holds them.

Closing another thread's connection is safe because it is idle, and stays so:
the guarded pools take connections out, put them back and close themselves
under :attr:`IdleConnections.lock`, so an idle connection is either taken by
its owner or closed here, never both. A closed one left in its pool is seen by
urllib3 as dropped, and connects again (guarded, as ever) when next used. A
connection in use is not noted here, and is never closed from here.
"""

from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict

from urllib3.connection import HTTPConnection


class IdleConnections:
    """The open connections lying idle in every guarded pool of the process."""

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        #: Held while a pool hands out, takes back or closes connections. Reentrant:
        #: closing a connection forgets it, under the lock already held.
        self.lock = threading.RLock()
        # Least recently used first, each with when it was put back
        # (``time.monotonic()``).
        self._idle: OrderedDict[HTTPConnection, float] = OrderedDict()

    def __len__(self) -> int:
        with self.lock:
            return len(self._idle)

    def pooled(self, connection: HTTPConnection, limit: int) -> None:
        """``connection`` lies open in its pool: note it, then close the least
        recently used idle ones past ``limit``."""
        with self.lock:
            self._idle[connection] = time.monotonic()
            self._idle.move_to_end(connection)
            while len(self._idle) > max(0, limit):
                oldest, _ = self._idle.popitem(last=False)
                oldest.close()

    def close_unused(self, idle_timeout: float) -> None:
        """Close the connections idle for ``idle_timeout``, whichever pool
        holds them: a pool hands out its most recently used first, so while
        its host is sent to, those below are never taken, and never closed
        with the pool."""
        cutoff = time.monotonic() - idle_timeout
        with self.lock:
            while self._idle:
                oldest, since = next(iter(self._idle.items()))
                if since > cutoff:
                    return
                self._idle.popitem(last=False)
                oldest.close()

    def taken(self, connection: HTTPConnection) -> None:
        """``connection`` is in use, or closed: no longer idle."""
        with self.lock:
            self._idle.pop(connection, None)


IDLE = IdleConnections()
# A child process starts with none of its own, and the lock may have been held at the fork.
os.register_at_fork(after_in_child=IDLE._reset)
