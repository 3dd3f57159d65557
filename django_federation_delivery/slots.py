"""Where each delivery a deliverer has claimed stands: ready for a slot, or in flight.

``CONCURRENCY`` slots in all, and to one host as many as its limit says
(``limits.py``: from ``PER_HOST``, up to ``PER_HOST_MAX``). A delivery in flight
for longer than ``SLOW_AFTER_SECONDS`` gives its slot up to the next, so that a
silent server holds a worker thread, not a slot. Only the coordinator changes
what is here; workers only count the slow deliveries.
"""

from __future__ import annotations

import collections
import dataclasses
import datetime as dt
import time
from collections.abc import Callable, Iterable, Mapping

from django_federation_delivery.workers import InFlight


@dataclasses.dataclass(frozen=True)
class Delivering:
    """A delivery a deliverer holds, as it stood when looked at."""

    inbox: str
    host: str
    #: When a worker took it (``time.monotonic()``); 0 until one did.
    started: float
    #: Whether it is its breaker's probe.
    probe: bool

    @classmethod
    def of(cls, item: InFlight) -> Delivering:
        return cls(item.claimed.inbox, item.claimed.host, item.started, bool(item.probe))


@dataclasses.dataclass(frozen=True)
class InHand:
    """What a deliverer holds at one moment: deliveries claimed and waiting
    for a slot, and those handed to the workers."""

    ready: tuple[Delivering, ...]
    in_flight: tuple[Delivering, ...]


class Slots:
    def __init__(
        self,
        *,
        concurrency: int,
        per_host: Callable[[str], int],
        slow_after: float,
        resting: Callable[[], Mapping[str, float]] = dict,
        start: int = 1,
        lowered: Callable[[str], bool] | None = None,
        urgent_most: int | None = None,
    ) -> None:
        self.concurrency = concurrency
        #: How many a host may have in flight now (``limits.HostLimits.allowed``).
        self.per_host = per_host
        #: The most urgent ones a host may have in flight beside the others
        #: (``PER_HOST``): its limit again, but no more than where a limit
        #: starts, for one grown under a fan-out (up to ``PER_HOST_MAX``).
        self.urgent_most = urgent_most
        #: Whether a host's limit was lowered (``limits.HostLimits.lowered``):
        #: by default, below where it starts (``start``, ``PER_HOST``). A host
        #: that refused as many at once gives the urgent ones no limit of
        #: their own, which would send it more than it asked for.
        self.lowered = lowered or (lambda host: per_host(host) < start)
        #: The hosts that may have none in flight for now, whatever they hold,
        #: and for how many seconds more (``limits.HostLimits.resting``).
        self.resting = resting
        self.slow_after = slow_after
        #: Claimed and admitted, waiting for a slot (and a slot on its host).
        self.ready: collections.deque[InFlight] = collections.deque()
        self._ready_hosts: collections.Counter[str] = collections.Counter()
        #: Of those, the urgent ones, which have a host's limit again of
        #: their own: a direct message to a host a fan-out keeps at its
        #: limit does not wait for one of the fan-out's attempts there.
        self._ready_urgent: collections.Counter[str] = collections.Counter()
        #: Handed to the workers: queued for one, or being sent.
        self.in_flight: dict[int, InFlight] = {}
        self._host_busy: collections.Counter[str] = collections.Counter()
        self._busy_urgent: collections.Counter[str] = collections.Counter()
        #: How many of those are urgent (a webhook event's, a direct
        #: message's), which hold no slot of the others'.
        self.urgent_in_flight = 0

    def in_hand(self) -> InHand:
        """What it holds now, copied: safe to read from another thread."""
        for _ in range(10):
            try:
                ready = tuple(map(Delivering.of, list(self.ready)))
                in_flight = tuple(map(Delivering.of, list(self.in_flight.values())))
            except RuntimeError:  # changed while copied, by the loop's thread
                continue
            return InHand(ready, in_flight)
        return InHand((), ())

    @property
    def busy(self) -> bool:
        return bool(self.in_flight or self.ready)

    def holding(self) -> set[int]:
        """The ids of every delivery ready or in flight."""
        return set(self.in_flight) | {item.claimed.id for item in self.ready}

    def urgent_ready(self) -> int:
        """How many urgent deliveries are ready: those at its head."""
        count = 0
        for item in self.ready:
            if not item.urgent:
                break
            count += 1
        return count

    def add(self, item: InFlight) -> None:
        """Ready ``item``: after what is ready of its lane and the lanes
        before it, before the rest (a direct message claimed while a
        fan-out's deliveries wait for slots goes first)."""
        ready = self.ready
        rank = item.rank
        if ready and ready[-1].rank > rank:
            index = next(n for n, other in enumerate(ready) if other.rank > rank)
            ready.insert(index, item)
        else:
            ready.append(item)
        self._count(self._ready_hosts, self._ready_urgent, item, 1)

    def take_overdue(self, now: dt.datetime) -> list[InFlight]:
        """The ready deliveries whose batch's deadline has passed by ``now``,
        taken out. One waiting behind a fan-out's (a low lane's, taken by a
        claim whose hosts were at their limit) would be failed only at its
        slot, once the fan-out had gone."""
        overdue = [
            item
            for item in self.ready
            if item.batch.deadline is not None and now >= item.batch.deadline
        ]
        if not overdue:
            return []
        gone = {item.claimed.id for item in overdue}
        kept = [item for item in self.ready if item.claimed.id not in gone]
        self.ready.clear()
        self.ready.extend(kept)
        for item in overdue:
            self._count(self._ready_hosts, self._ready_urgent, item, -1)
        return overdue

    @staticmethod
    def _count(
        every: collections.Counter[str],
        urgent: collections.Counter[str],
        item: InFlight,
        by: int,
    ) -> None:
        """Count ``item`` in (or, ``by`` -1, out of) its host's ``every``,
        and its ``urgent`` too if it is; a host counted down to none goes."""
        host = item.claimed.host
        for counts in (every, urgent) if item.urgent else (every,):
            counts[host] += by
            if counts[host] <= 0:
                del counts[host]

    def _room(self, item: InFlight) -> bool:
        """Whether ``item``'s host may have one more in flight now: of the
        urgent ones if it is one, of the others if not (of all of them, at
        a host whose limit was lowered)."""
        host = item.claimed.host
        if self.lowered(host):
            return self._host_busy[host] < self.per_host(host)
        urgent = self._busy_urgent[host]
        if item.urgent:
            return urgent < self._urgent_limit(host)
        return self._host_busy[host] - urgent < self.per_host(host)

    def _urgent_limit(self, host: str) -> int:
        """How many urgent ones ``host`` may have in flight beside the others."""
        limit = self.per_host(host)
        return limit if self.urgent_most is None else min(limit, self.urgent_most)

    def in_flight_to(self, host: str) -> int:
        """How many are in flight to ``host`` (an attempt that has just
        answered, until it is taken back, among them)."""
        return self._host_busy[host]

    def sendable(self, enough: int) -> bool:
        """Whether at least ``enough`` ready deliveries could go as soon as a
        slot is free: one waiting for a host already at ``PER_HOST`` (a silent
        one, say) cannot."""
        count = 0
        for item in self.ready:
            if self._room(item):
                count += 1
                if count >= enough:
                    return True
        return False

    def saturated_hosts(self, *, urgent: bool = False) -> list[str]:
        """Hosts with as many deliveries in flight or ready as they may have
        at once, and those resting: no use claiming more. With ``urgent``,
        for a claim of the urgent lanes: counting the urgent ones alone,
        which have a host's limit again of their own."""
        held = self._host_busy + self._ready_hosts
        if urgent:
            of_urgent = self._busy_urgent + self._ready_urgent
            full = [
                host
                for host, count in held.items()
                if (
                    count >= self.per_host(host)
                    if self.lowered(host)
                    else of_urgent[host] >= self._urgent_limit(host)
                )
            ]
        else:
            full = [host for host, count in held.items() if count >= self.per_host(host)]
        return full + list(self._resting_empty_handed(held))

    def until_rested(self) -> float | None:
        """Seconds until the first of the resting hosts that hold nothing here
        may be sent to again: until then a claim leaves their deliveries out,
        however due (None: no such host rests)."""
        left = self._resting_empty_handed(self._host_busy + self._ready_hosts).values()
        return min(left, default=None)

    def _resting_empty_handed(self, held: Mapping[str, int]) -> dict[str, float]:
        """The resting hosts with nothing ``held`` here, and their rest left."""
        return {host: left for host, left in self.resting().items() if host not in held}

    def hand_out(
        self, admit: Callable[[InFlight], bool], *, slow: int, queued: int, most: int
    ) -> list[InFlight]:
        """Take ready deliveries into flight while there are free slots, and
        ``queued`` more to wait in the workers' queue, never more than ``most``
        threads' worth: those ``admit`` lets through. ``slow`` deliveries in
        flight hold no slot. Urgent ones (at the head of what is ready) have
        slots of their own, ``concurrency`` of them, beside the others', and
        a thread each past the ``most`` threads the others share, slow or
        not (:meth:`threads_allowed`): a
        webhook event or a direct message never waits for an attempt of a
        fan-out's to end, even when a fan-out's silent servers hold every
        thread until their time limit."""
        out: list[InFlight] = []
        skipped: list[InFlight] = []
        # Slow ones hold no slot, of either kind.
        slow_urgent = self.slow_count(urgent=True)
        urgent_slots = self.concurrency + slow_urgent
        other_slots = self.concurrency + queued + slow - slow_urgent
        while self.ready:
            others = len(self.in_flight) - self.urgent_in_flight
            if self.ready[0].urgent:
                if self.urgent_in_flight >= urgent_slots or slow_urgent >= most:
                    # Its slots are taken (or its slow ones hold as many
                    # threads as the others may): it stays ready, in its
                    # place, and the others' slots are filled all the same.
                    skipped.append(self.ready.popleft())
                    continue
            elif others >= min(other_slots, most + queued):
                break
            item = self.ready.popleft()
            if not self._room(item):
                skipped.append(item)
                continue
            self._count(self._ready_hosts, self._ready_urgent, item, -1)
            if not admit(item):
                continue
            self._count(self._host_busy, self._busy_urgent, item, 1)
            self.in_flight[item.claimed.id] = item
            self.urgent_in_flight += item.urgent
            out.append(item)
        self.ready.extendleft(reversed(skipped))
        return out

    def take_back(self, item: InFlight) -> None:
        """The delivery no longer holds a slot, nor one of its host's."""
        del self.in_flight[item.claimed.id]
        self.urgent_in_flight -= item.urgent
        self._count(self._host_busy, self._busy_urgent, item, -1)

    def release(self, unsent: Iterable[InFlight]) -> list[InFlight]:
        """Stopping: everything not sent, ``unsent`` taken back from the
        workers' queue and every ready one, and nothing left ready."""
        for item in unsent:
            self.take_back(item)
            self.ready.append(item)
        released = list(self.ready)
        self.ready.clear()
        self._ready_hosts.clear()
        self._ready_urgent.clear()
        return released

    def slow_count(self, *, urgent: bool | None = None) -> int:
        """How many in flight have been so longer than ``slow_after`` (of
        the urgent ones, or the others, if ``urgent`` says)."""
        cutoff = time.monotonic() - self.slow_after
        # A copy taken at once: workers ask too, while the coordinator changes it.
        items = list(self.in_flight.values())
        return sum(
            1
            for item in items
            if 0 < item.started <= cutoff and (urgent is None or item.urgent is urgent)
        )

    def threads_wanted(self) -> int:
        """The worker threads its slots may keep busy now: ``concurrency``
        and one for each slow delivery of the others' (or as many as are
        taken by the others' attempts, if more: the threads made while some
        were slow take queued ones as they end), and one for each urgent
        one, slow or not: a thread free for it, whatever the others hold."""
        cutoff = time.monotonic() - self.slow_after
        slow = taken = 0
        # A copy taken at once: workers ask too, while the coordinator changes it.
        for item in list(self.in_flight.values()):
            if item.urgent or not item.started:
                continue
            taken += 1
            if item.started <= cutoff:
                slow += 1
        return max(self.concurrency + slow, taken) + self.urgent_in_flight

    def threads_allowed(self, most: int) -> int:
        """The most worker threads now: ``most`` for the others, and one for
        each urgent delivery, slow or not (at most ``concurrency`` not slow,
        and fewer than ``most`` slow: :meth:`hand_out`), whatever the
        others' slow ones hold."""
        return most + self.urgent_in_flight

    def until_next_slow(self) -> float:
        """Seconds until the next delivery in flight turns slow (at most 1)."""
        cutoff = time.monotonic() - self.slow_after
        fast = [item.started - cutoff for item in self.in_flight.values() if item.started > cutoff]
        return max(0.01, min([1.0, *fast]))
