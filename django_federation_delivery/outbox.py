"""The settlements the loop has decided and not yet written, written many at once.

Every statement gives the worker threads the interpreter, and getting it
back costs more than the statement itself: so outcomes are written together,
a few at a time or once the first has waited a moment. Their signals were
sent before; their leases outlast the wait many times over.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from django_federation_delivery.store.settlements import Settlement

__all__ = ["WRITE_WITHIN", "Outbox"]

#: The longest an outcome waits to be written with others.
WRITE_WITHIN = 0.1


class Outbox:
    """Settlements waiting to be written by ``write``, which returns whether
    it wrote them (False: the database was away)."""

    def __init__(
        self,
        write: Callable[[list[Settlement]], bool],
        *,
        size: int,
        within: float = WRITE_WITHIN,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        if size < 1:
            raise ValueError(f"an outbox holds at least one settlement, not {size!r}")
        self._write = write
        #: How many are written together at the most: what a crash would send again.
        self.size = size
        self.within = within
        self._clock = clock
        self._wall_clock = wall_clock
        self._waiting: list[Settlement] = []
        self._since = 0.0
        #: Not written again before this (the clock's): what another
        #: transaction held, tried again a moment later, not at every turn.
        self._not_before = 0.0

    def __len__(self) -> int:
        return len(self._waiting)

    def add(self, settlement: Settlement) -> None:
        if not self._waiting:
            self._since = self._clock()
        self._waiting.append(settlement)

    def full(self) -> bool:
        """Whether a write's worth waits."""
        return len(self._waiting) >= self.size

    def due(self) -> bool:
        """Whether to write now: a write's worth waits, or the first has
        waited ``within`` seconds; never before what another transaction
        held may be tried again (:meth:`deferred`)."""
        if not self._waiting or self.deferred():
            return False
        return self.full() or self._clock() - self._since >= self.within

    def deferred(self) -> bool:
        """Whether what waits is not to be written yet, whatever else: a
        write left some that another transaction held, a moment ago."""
        return self._clock() < self._not_before

    def until_due(self) -> float:
        """Seconds until :meth:`due` turns true by time alone (1 with nothing waiting)."""
        if not self._waiting:
            return 1.0
        now = self._clock()
        return max(0.0, self._since + self.within - now, self._not_before - now)

    def flush(self) -> bool:
        """Write everything waiting. Returns whether anything was written.

        What is not written (the database away) waits for the next flush
        while its lease holds; after that the row is another claim's to take,
        and is sent again: never lost.
        """
        settlements, self._waiting = self._waiting, []
        if not settlements:
            return False
        try:
            written = self._write(settlements)
        except BaseException:
            # Not the database away, which the write says by returning False,
            # but an error of the loop's (an interrupt) as it wrote: kept, for
            # the write the loop makes as it leaves (a settle whose claim no
            # longer holds writes nothing, should this one have committed).
            self.keep(settlements)
            raise
        if written:
            return True
        self.keep(settlements)
        return False

    def keep(self, settlements: list[Settlement]) -> None:
        """Those of ``settlements`` whose lease still holds, waiting again
        for the next flush."""
        now = self._wall_clock()
        for settlement in settlements:
            if settlement.claimed.leased_until > now:
                self.add(settlement)

    def keep_held(self, settlements: list[Settlement]) -> None:
        """``settlements``, which a write left as another transaction holds
        their rows (a send in their sequence, a view's, not yet committed),
        waiting again, to be written ``within`` seconds from now at the
        soonest; past their lease too: no claim takes a row while it is
        held, and once it is let go the write finds its claim still there,
        or, taken since, gone (written then by none)."""
        if not settlements:
            return
        for settlement in settlements:
            self.add(settlement)
        self._not_before = self._clock() + self.within
