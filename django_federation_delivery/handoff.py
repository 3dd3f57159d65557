"""Where the coordinator and the workers meet: ready deliveries are handed
out while slots are free, what came of each attempt is taken back and
settled, and on stopping what was not sent is put back for another
deliverer."""

from __future__ import annotations

import dataclasses
import logging
import queue
from collections.abc import Callable, Generator

from django_federation_delivery.attempt import AttemptResult, crashed
from django_federation_delivery.dialect import aware_now
from django_federation_delivery.exceptions import raised_at
from django_federation_delivery.intake import Intake
from django_federation_delivery.models import Status
from django_federation_delivery.outages import Database
from django_federation_delivery.outbox import Outbox
from django_federation_delivery.slots import Slots
from django_federation_delivery.store import settlements
from django_federation_delivery.workers import InFlight, Workers

__all__ = ["Handoff", "Perform"]

# The loop's logger: where an operator looks for what the loop met.
logger = logging.getLogger("django_federation_delivery.deliverer")


#: One delivery's way from its slot to its settlement: started when it gets
#: a slot, it pauses at the attempt (yielding nothing) if it is to be sent,
#: and takes the attempt's result when that comes back.
Perform = Callable[[InFlight], Generator[None, AttemptResult, None]]


@dataclasses.dataclass(kw_only=True, eq=False)
class Handoff:
    """One deliverer's exchange with its workers: each delivery that gets a
    slot goes through ``perform``, which its attempt's result resumes;
    ``write`` writes the outbox when it holds a write's worth. A delivery
    whose way raises is settled by ``conclude`` as an attempt that crashed,
    a passing failure: one delivery never ends the loop."""

    db: Database
    workers: Workers
    slots: Slots
    intake: Intake
    outbox: Outbox
    perform: Perform
    #: What came of an attempt, decided and put to be written, without its
    #: way through ``perform``.
    conclude: Callable[[InFlight, AttemptResult], None]
    concurrency: int
    slow_concurrency: int
    write: Callable[[], None]
    #: Gives back a probe of a breaker (its key, its token) that made no request.
    give_back: Callable[[str, str], None] | None = None

    def dispatch(self) -> None:
        """Hand ready deliveries to the workers while there are free slots."""
        most = self.concurrency + self.slow_concurrency
        slow = self.slots.slow_count()
        # A thread for each slow delivery beyond CONCURRENCY, for what is
        # queued behind them, and one for each urgent one, which holds a
        # slot of its own, past the threads the others may take.
        self.workers.grow_to(min(self.slots.threads_allowed(most), self.slots.threads_wanted()))
        if not self.slots.ready:
            return
        # As many again as there are slots wait in the workers' queue, so
        # that a worker that is done takes the next at once rather than
        # when this thread next gets to run.
        urgent = self.slots.urgent_in_flight
        for item in self.slots.hand_out(self._start, slow=slow, queued=self.concurrency, most=most):
            self.workers.put(item)
        if self.slots.urgent_in_flight > urgent:
            self.workers.grow_to(min(self.slots.threads_allowed(most), self.slots.threads_wanted()))

    def collect(self) -> None:
        """Take in what came of the attempts that finished since the last look."""
        while True:
            try:
                item, result = self.workers.results.get_nowait()
            except queue.Empty:
                break
            self._finish(item, result)
            self.slots.take_back(item)
            # A retry may have come due since the last claim, and a slot at
            # its host is free.
            self.intake.look_again(item.claimed.host)
            if self.outbox.full() and not self.db.failing:
                # Never more unwritten than a write's worth: what a crash
                # would send again is bounded by it.
                self.write()

    def _start(self, item: InFlight) -> bool:
        """Start the delivery's way: whether it is to be attempted now (or
        was settled without a request)."""
        item.path = self.perform(item)
        try:
            next(item.path)
        except StopIteration:
            return False
        except Exception as exc:
            self._crashed(item, exc, sent=False)
            return False
        return True

    def _finish(self, item: InFlight, result: AttemptResult) -> None:
        """Resume the delivery's way with what came of its attempt, to its end."""
        assert item.path is not None
        try:
            item.path.send(result)
        except StopIteration:
            return
        except Exception as exc:
            self._crashed(item, exc, sent=True)
            return
        item.path.close()
        self._crashed(item, RuntimeError("perform() paused twice"), sent=True)

    def _crashed(self, item: InFlight, exc: Exception, *, sent: bool) -> None:
        """The delivery's way raised ``exc`` (a bug, not the receiver's
        doing): settled as an attempt that crashed, a passing failure tried
        again by the retry policy, with no request when it was not ``sent``;
        the loop goes on. Told by the error's type and where it was raised,
        never its message, which may quote a webhook's URL."""
        logger.error(
            "Delivery %s raised %s%s in the loop: settled as a failed attempt",
            item.claimed.id,
            type(exc).__name__,
            raised_at(exc),
        )
        result = crashed(item.job, f"internal error: {type(exc).__name__}")
        if not sent:
            result = dataclasses.replace(result, requests=0)
        try:
            self.conclude(item, result)
        except Exception as again:
            # Left to its lease: once it lapses the row comes due again.
            logger.error(
                "Delivery %s could not be settled either (%s): it comes due again "
                "when its lease ends",
                item.claimed.id,
                type(again).__name__,
            )

    def release_ready(self) -> None:
        """Stopping: put back what was claimed and not sent, due now, for
        another deliverer to take without waiting out the lease: what is
        ready, what waits in the workers' queue for one to be free, and
        what the intake holds unsorted (its batches not read yet)."""
        released = self.slots.release(self.workers.take_queued())
        for item in released:
            if item.path is not None:
                item.path.close()
            if item.probe and self.give_back is not None:
                # Unsent, its probe taught nothing: given back, or every
                # other deliverer would hold its host a whole cool-off.
                self.db(self.give_back, item.breaker, item.probe)
        for claimed in [*(item.claimed for item in released), *self.intake.take_unsorted()]:
            self.outbox.add(
                settlements.Settlement(
                    claimed=claimed,
                    status=Status.PENDING,
                    attempts=claimed.attempts,
                    due_at=aware_now(),
                )
            )
