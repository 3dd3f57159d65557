"""A busy sender on SQLite: another connection, in a thread of its own, that
takes the write lock again and again, as a web process sending one post
after another would. Used by tests/test_writelock.py and by
benchmarks/writelock.py."""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Callable


class Holder(threading.Thread):
    """Takes the write lock for ``hold`` seconds each time (a callable: drawn
    each time), ``gap`` seconds apart; until stopped, which also ends a hold.
    ``committed`` counts the transactions it has committed."""

    def __init__(self, path: str, hold: Callable[[], float], gap: Callable[[], float]) -> None:
        super().__init__(daemon=True)
        self.path, self.hold, self.gap = path, hold, gap
        self.committed = 0
        self.holding = threading.Event()
        self.stopping = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        raw = sqlite3.connect(self.path, timeout=20, isolation_level=None)
        try:
            while not self.stopping.is_set():
                raw.execute("BEGIN IMMEDIATE")
                self.holding.set()
                self.stopping.wait(self.hold())
                self.holding.clear()
                raw.execute("COMMIT")
                self.committed += 1
                time.sleep(self.gap())
        except BaseException as exc:
            self.error = exc
        finally:
            raw.close()
