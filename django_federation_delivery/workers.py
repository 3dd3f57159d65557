"""The worker threads: each makes one attempt at a time, and never touches the database.

The coordinator puts :class:`InFlight` deliveries on the pool's job queue and
takes ``(delivery, result)`` pairs off its result queue. An urgent one (a
webhook event's, a direct message's: ``store.claims.URGENT``) waits in a
queue of its own, which a free worker looks in first: it never waits behind
the fan-out's deliveries queued before it. A worker asks each
delivery's kind for the attempt, with a transport of its own for that kind
over keep-alive connections the pool's threads share (a host's next delivery
reuses the connection its last one left, whichever worker sends it), closes
the connections nobody used for a while when idle, and ends itself when the
pool has more threads than it needs.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import enum
import logging
import queue
import threading
import time
from collections.abc import Callable, Generator
from typing import TYPE_CHECKING, Any

from django_federation_delivery import tracing
from django_federation_delivery.addresses import escaped
from django_federation_delivery.attempt import (
    AttemptResult,
    Job,
    crashed,
    delivered_as_told,
    overtaken,
    readable,
)
from django_federation_delivery.batches import BatchInfo
from django_federation_delivery.store.claims import RANK, URGENT, Claimed
from django_federation_delivery.transport import Connections, Transport, TransportSettings

if TYPE_CHECKING:
    from django_federation_delivery.kinds import DeliveryKind
    from django_federation_delivery.tracing import Begun

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class InFlight:
    """A claimed delivery on its way: waiting for a slot, queued for a worker, or being sent."""

    claimed: Claimed
    batch: BatchInfo
    #: Its kind of delivery, which makes the attempt.
    kind: DeliveryKind
    job: Job
    #: The destination's breaker, and the probe this delivery holds, if any.
    breaker: str = ""
    probe: str = ""
    #: Sent to a portable inbox's later gateways alone, its first gateway's
    #: breaker holding it: what comes back is not its host's to learn from.
    elsewhere: bool = False
    #: When a worker took it (``time.monotonic()``); 0 until then.
    started: float = 0.0
    #: Its way through the loop once it has a slot: the deliverer's
    #: ``perform()``, paused at the attempt until the result comes back.
    path: Generator[None, AttemptResult, None] | None = None
    #: Its attempt's span, with the ``otel`` extra: begun by the worker,
    #: ended by ``perform()`` (``tracing.py``).
    span: Begun | None = None

    @property
    def rank(self) -> int:
        """Its lane's place in the claim's order: the lower, the sooner."""
        return RANK.get(self.lane, len(RANK))

    @property
    def urgent(self) -> bool:
        """Whether it goes before the rest wherever it waits."""
        return self.lane in URGENT

    @property
    def lane(self) -> str:
        """Its lane: its own as claimed (sooner than its batch's when a
        direct message in its sequence waits on it), else its batch's."""
        return self.claimed.lane or self.batch.lane


class _Nudge(enum.Enum):
    #: Put on the job queue with an urgent job: a worker waiting there looks
    #: in the urgent queue.
    URGENT = "urgent"


class Workers:
    """A pool of worker threads that grows on demand and shrinks on its own."""

    def __init__(
        self,
        transport_settings: TransportSettings,
        *,
        wake: threading.Event,
        needed: Callable[[], int],
        longest: float,
        concurrency: int = 1,
        others_at_once: int | None = None,
    ) -> None:
        self.transport_settings = transport_settings
        #: Keep-alive connections to inboxes and webhook destinations, shared by the threads.
        self.connections = Connections(transport_settings)
        #: The longest an attempt of any kind may take: what stopping waits for.
        self.longest = longest
        #: Set when a result is ready, to wake the coordinator.
        self.wake = wake
        #: How many threads the coordinator needs now; one more ends itself.
        self.needed = needed
        #: A result wakes the coordinator when fewer jobs than half its
        #: ``concurrency`` wait in the queue (it may have more to hand out),
        #: or when a quarter as many results wait for it; otherwise the next
        #: one that does, or the coordinator's own timer, brings it. Each wake
        #: is a turn of its loop, taken from the workers' time with the
        #: interpreter.
        self.wake_below = max(1, concurrency // 2)
        #: The fewest threads ever needed: ``needed()`` is never less.
        self.floor = concurrency
        self.wake_at = max(1, concurrency // 4)
        self.jobs: queue.SimpleQueue[InFlight | _Nudge | None] = queue.SimpleQueue()
        #: The urgent jobs, which a free worker takes before any in ``jobs``.
        self.urgent: queue.SimpleQueue[InFlight | None] = queue.SimpleQueue()
        #: The threads that may take the others' jobs (``others_at_once``,
        #: the threads they share; None: every thread): one more, made for
        #: an urgent delivery, takes urgent ones only, and is still free for
        #: the next once the first is done, however long the others' take.
        self._others = None if others_at_once is None else threading.Semaphore(others_at_once)
        self.results: queue.SimpleQueue[tuple[InFlight, AttemptResult]] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._started = 0

    def __len__(self) -> int:
        with self._lock:
            return len(self._threads)

    def grow_to(self, wanted: int) -> None:
        """Have at least ``wanted`` threads; idle ones hold no connections for long."""
        with self._lock:
            while len(self._threads) < wanted:
                worker = threading.Thread(
                    target=self._work, name=f"federation-delivery-{self._started}", daemon=True
                )
                self._started += 1
                worker.start()
                self._threads.append(worker)

    def put(self, item: InFlight) -> None:
        if item.urgent:
            self.urgent.put(item)
            self.jobs.put(_Nudge.URGENT)
        else:
            self.jobs.put(item)

    def take_queued(self) -> list[InFlight]:
        """What waits in the job queues for a free worker, taken back."""
        taken: list[InFlight] = []
        for waiting in (self.urgent, self.jobs):
            while True:
                try:
                    item = waiting.get_nowait()
                except queue.Empty:
                    break
                if isinstance(item, InFlight):
                    taken.append(item)
        return taken

    def _next(self) -> InFlight | None:
        """The next job, an urgent one first, waiting for one at most the
        idle timeout (``queue.Empty``); None to end. Another's job only
        while fewer than ``others_at_once`` threads take them: it holds
        its place until its attempt is over (:meth:`_done`)."""
        idle = self.transport_settings.idle_timeout
        while True:
            try:
                return self.urgent.get_nowait()
            except queue.Empty:
                pass
            if self._others is not None and not self._others.acquire(blocking=False):
                # As many take the others' jobs as may: this one waits for
                # an urgent one (or the end).
                return self.urgent.get(timeout=idle)
            try:
                item = self.jobs.get(timeout=idle)
            except queue.Empty:
                self._done(None)
                raise
            if isinstance(item, InFlight):
                return item
            self._done(None)
            if item is None:
                return None

    def _done(self, item: InFlight | None) -> None:
        """A place among those taking the others' jobs let go: after the
        attempt of ``item``, not urgent, or with None, when no job was taken."""
        if self._others is not None and (item is None or not item.urgent):
            self._others.release()

    def stop(self, *, wait: bool = True) -> None:
        """End every thread once it has finished its attempt: waited for
        (the longest an attempt takes), unless not to ``wait`` (what they
        are sending is left to its lease, their outcomes unwritten)."""
        with self._lock:
            threads = list(self._threads)
        for _ in threads:
            self.jobs.put(None)
            self.urgent.put(None)
        for thread in threads if wait else ():
            thread.join(timeout=self.longest + 5)
        with self._lock:
            self._threads.clear()
        self.connections.close()

    def _surplus(self) -> bool:
        """Whether the calling thread is one more than needed: it then ends,
        and its connections with it."""
        if len(self._threads) <= self.floor:
            return False  # never fewer needed than CONCURRENCY: no need to ask
        with self._lock:
            if len(self._threads) <= self.needed():
                return False
            self._threads.remove(threading.current_thread())
            return True

    def _work(self) -> None:
        # A transport for each kind's settings, made when the first of its
        # deliveries comes.
        transports: dict[TransportSettings, Transport] = {}
        try:
            while True:
                try:
                    item = self._next()
                except queue.Empty:
                    # Idle: let go of connections nobody has used for a while,
                    # and of this thread if it is one more than needed now
                    # (asked after its last attempt, it was needed then: the
                    # loop had not taken that attempt back yet).
                    for transport in transports.values():
                        transport.close_idle()
                    if self._surplus():
                        break
                    continue
                if item is None:
                    break
                item.started = time.monotonic()
                try:
                    self.results.put((item, self._attempt(item, transports)))
                finally:
                    self._done(item)
                # Not kept while this thread waits for the next: its body,
                # job and signing key are the loop's until it settles.
                item = None
                if self.jobs.qsize() < self.wake_below or self.results.qsize() >= self.wake_at:
                    self.wake.set()
                if self._surplus():
                    break
        finally:
            # However it ends, it is counted no longer: a pool that grows
            # makes another in its place, and stopping does not wait for it.
            with self._lock:
                if threading.current_thread() in self._threads:
                    self._threads.remove(threading.current_thread())
            for transport in transports.values():
                transport.close()

    def _attempt(
        self, item: InFlight, transports: dict[TransportSettings, Transport]
    ) -> AttemptResult:
        """What came of ``item``'s attempt: always a result, whatever the
        attempt did, so that the delivery is settled and its slot freed.
        None is made if its batch's deadline passed while it waited in the
        queue (behind a slow attempt, say): it is not sent after it."""
        deadline = item.batch.deadline
        if deadline is not None and dt.datetime.now(dt.UTC) >= deadline:
            return overtaken(item.job)

        def attempt() -> Any:
            settings = item.kind.transport_settings_for(item.job)
            transport = transports.get(settings)
            if transport is None:
                transport = transports[settings] = Transport(settings, self.connections)
            with tracing.attempting(item):
                return item.kind.attempt(item.job, transport)

        what, by = f"delivery {item.claimed.id}", type(item.kind).__name__
        return guarded(item.job, attempt, started=item.started, what=what, by=by)


def guarded(
    job: Job, attempt: Callable[[], Any], *, started: float, what: str, by: str
) -> AttemptResult:
    """What ``attempt()``, an attempt at ``job`` by code the package may not
    hold (a host project's kind), came to: always a result the loop can
    read, whatever it did, so that the delivery is settled and its slot
    freed. ``what`` and ``by`` name the attempt and its kind in the log;
    ``started`` is when it began (``time.monotonic()``)."""
    try:
        result = attempt()
    # A bug must not take a worker down, whatever it raises. A SystemExit
    # (a channel calling sys.exit()) would end this thread silently. And
    # a KeyboardInterrupt here is not an operator's Ctrl-C, which Python
    # raises in the main thread only (the loop's, which stops on it): one
    # in a worker was raised by the attempt's own code, and is its crash.
    except BaseException as exc:
        main = threading.current_thread() is threading.main_thread()
        if isinstance(exc, KeyboardInterrupt) and main:
            raise  # an operator's Ctrl-C: a command's attempt runs in the main thread
        # Only the type: a webhook's message and traceback may hold its
        # URL, a credential.
        logger.error("An attempt at %s raised %s", what, type(exc).__name__)
        # Timed as long as it ran: at nought, its time would drag the
        # attempts' median and mean down.
        took = time.monotonic() - started
        return crashed(job, f"internal error: {type(exc).__name__}", duration=took)
    if not isinstance(result, AttemptResult):
        # A host project's channel that returned something else: told by
        # the kind and the type alone, nothing of the job (its URL, its
        # key) or of what came back.
        logger.error(
            "An attempt at %s by %s returned %s, not an AttemptResult",
            what,
            by,
            type(result).__name__,
        )
        took = time.monotonic() - started
        return crashed(job, f"internal error: {type(result).__name__} returned", duration=took)
    # One the loop could not read (a Retry-After header's text, None for
    # no error) would raise in the loop's own thread as it decides and
    # writes what came of it: told by the field and its type alone.
    try:
        read, fault = readable(job, result)
    except Exception as exc:
        # Its fields read as a kind's code holds them (a number subclass's
        # own comparisons): whatever that raises is this attempt's alone;
        # one that says it was delivered stays delivered, as readable() has it.
        logger.error("Reading the result of an attempt at %s raised %s", what, type(exc).__name__)
        took = time.monotonic() - started
        if getattr(result, "delivered", None) is True:
            return delivered_as_told(job, duration=took)
        return crashed(job, f"internal error: {type(exc).__name__}", duration=took)
    if fault and not read.delivered:
        read = dataclasses.replace(read, duration=time.monotonic() - started)
    if fault:
        logger.error(
            "An attempt at %s by %s returned a result the loop cannot read (%s): %s",
            what,
            by,
            fault,
            "kept as delivered" if read.delivered else "a failed attempt",
        )
    if not read.error.isprintable():
        # A host project's kind may tell what it met as it met it (a
        # binary answer, decoded): kept, told and logged escaped, as an
        # answer's text is: PostgreSQL's text holds no NUL, and a
        # terminal acts on an escape sequence.
        read = dataclasses.replace(read, error=escaped(read.error))
    return read
