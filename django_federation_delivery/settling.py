"""What comes of an attempt: delivered, refused, retried or given up.

The coordinator asks a :class:`Settler` what to write for each delivery it
is done with; the settler decides by the retry policy, the batch's deadline
and max attempts, sends the signals (before anything is written, so that a
crash in between sends them again), counts, and returns the
:class:`~django_federation_delivery.queue.Settlement` to write.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import logging
import time
from collections.abc import Callable
from typing import Any

from django.utils import timezone

from django_federation_delivery import metrics, queue, signals
from django_federation_delivery.attempt import AttemptResult
from django_federation_delivery.models import Batch, Status
from django_federation_delivery.retry import RetryPolicy, wait_before_retry
from django_federation_delivery.webhooks.destinations import destination_name
from django_federation_delivery.webhooks.rendering import Event

logger = logging.getLogger(__name__)

#: How soon a delivery to a paused host that was not held by the pause
#: itself is looked at again.
PAUSED_RECHECK = 5.0


@dataclasses.dataclass
class Summary:
    """What a run did, counted as it goes."""

    delivered: int = 0
    retrying: int = 0
    refused: int = 0
    failed: int = 0
    skipped: int = 0
    #: Held back without a request: an open breaker, or a paused host.
    held: int = 0
    attempts: int = 0
    started: float = dataclasses.field(default_factory=time.monotonic)
    #: When the run ended, once it has.
    stopped: float | None = None

    @property
    def done(self) -> int:
        """Deliveries dealt with: settled, or put back for later."""
        return (
            self.delivered + self.retrying + self.refused + self.failed + self.skipped + self.held
        )

    @property
    def elapsed(self) -> float:
        return (self.stopped or time.monotonic()) - self.started

    @property
    def rate(self) -> float:
        """Deliveries settled as delivered per second."""
        return self.delivered / self.elapsed if self.elapsed > 0 else 0.0

    def line(self) -> str:
        return (
            f"delivered {self.delivered}, retrying {self.retrying}, refused {self.refused}, "
            f"failed {self.failed}, skipped {self.skipped}, held {self.held} "
            f"in {self.elapsed:.1f}s "
            f"({self.rate:.1f}/s)"
        )


@dataclasses.dataclass(frozen=True)
class BatchInfo:
    """What the loop keeps in memory of a batch while its deliveries are sent."""

    id: int
    sender: str
    body: bytes
    body_sha256: str
    tag: str
    deadline: dt.datetime | None
    max_attempts: int | None
    synchronize_collection: bool
    #: Whether it has an ordering key, whose next delivery its settling releases.
    ordered: bool
    #: The activity, parsed, when SKIP_IF is to be asked about it.
    activity: Any
    #: A webhook event's type ("" for an activity), and the event, read back
    #: from the body (None if it cannot be: see webhooks/deliveries.py).
    event_type: str = ""
    event: Event | None = None

    @classmethod
    def of(cls, batch: Batch, *, parse: bool) -> BatchInfo:
        if batch.event_type:
            return cls._webhook(batch)
        return cls(
            id=batch.id,
            sender=batch.sender,
            body=batch.body.encode(),
            body_sha256=batch.body_sha256,
            tag=batch.tag,
            deadline=batch.deadline,
            max_attempts=batch.max_attempts,
            synchronize_collection=batch.synchronize_collection,
            ordered=bool(batch.ordering_key),
            activity=json.loads(batch.body) if parse else None,
        )

    @classmethod
    def _webhook(cls, batch: Batch) -> BatchInfo:
        try:
            event: Event | None = Event.read(batch.body)
        except ValueError:
            event = None
        return cls(
            id=batch.id,
            sender=batch.sender,
            body=b"",
            body_sha256=batch.body_sha256,
            tag=batch.tag,
            deadline=batch.deadline,
            max_attempts=batch.max_attempts,
            synchronize_collection=False,
            ordered=bool(batch.ordering_key),
            activity=None,
            event_type=batch.event_type,
            event=event,
        )


def ask(setting: str, function: Callable[..., Any], *args: Any) -> Any:
    """Call one of the host project's callables; one that raises is logged and
    taken as no answer, never a reason to stop."""
    try:
        return function(*args)
    except Exception:
        logger.exception("%s raised; taken as no answer", setting)
        return None


@dataclasses.dataclass
class Settler:
    policy: RetryPolicy
    summary: Summary
    wait_as_asked: bool = True
    retry_after_max: float = 3600.0
    error_length: int = 300
    sender_gone: Callable[[str], bool] | None = None
    permanent_if_gone: frozenset[int] = frozenset()

    def attempted(
        self, row: queue.Claimed, batch: BatchInfo, result: AttemptResult
    ) -> queue.Settlement:
        """Decide what comes of an attempt, send the signals, and say what to write."""
        attempts = row.attempts + 1
        self.summary.attempts += 1
        now = timezone.now()
        if result.delivered:
            return self._settle(row, batch, result, Status.DELIVERED, attempts, now)
        permanent = result.permanent or self._gone(batch.sender, result.status)
        if permanent:
            return self._settle(row, batch, result, Status.REFUSED, attempts, now)
        wait = None
        if batch.max_attempts is None or attempts < batch.max_attempts:
            wait = self.policy.delay(attempts)
        if wait is None:
            error = f"gave up after {attempts} attempts: {result.error}"
            return self._fail(row, batch, result, attempts, now, error, deadline=False)
        wait = wait_before_retry(
            wait,
            result.retry_after,
            wait_as_asked=self.wait_as_asked,
            longest=self.retry_after_max,
        )
        due = now + dt.timedelta(seconds=wait)
        if batch.deadline is not None and due >= batch.deadline:
            error = f"the batch's deadline passed: {result.error}"
            return self._fail(row, batch, result, attempts, now, error, deadline=True)
        if result.held:
            self._signal_attempt(row, batch, result, "held")
            self.summary.held += 1
        else:
            self._signal_attempt(row, batch, result, "retrying")
            self.summary.retrying += 1
        return queue.Settlement(
            claimed=row,
            ordered=batch.ordered,
            status=Status.PENDING,
            attempts=attempts,
            due_at=due,
            last_status=result.status,
            last_error=result.error[: self.error_length],
            attempted_at=now,
            retried=not result.held,
        )

    def _gone(self, sender: str, status: int | None) -> bool:
        if status is None or status not in self.permanent_if_gone or self.sender_gone is None:
            return False
        return bool(ask("SENDER_GONE", self.sender_gone, sender))

    def _signal_attempt(
        self, row: queue.Claimed, batch: BatchInfo, result: AttemptResult, outcome: str
    ) -> None:
        metrics.record_attempt(outcome, result.duration)
        signals.send_safely(
            signals.delivery_attempted,
            attempt=signals.Attempted(
                delivery_id=row.id,
                batch_id=row.batch_id,
                inbox=row.inbox,
                sender=batch.sender,
                outcome=outcome,
                status=result.status,
                error=result.error,
                duration=result.duration,
                destination=destination_name(row.inbox),
                event_type=batch.event_type,
            ),
        )

    def _settled_signal(
        self, row: queue.Claimed, batch: BatchInfo, outcome: str, status: int | None
    ) -> None:
        signals.send_safely(
            signals.delivery_settled,
            settled=signals.Settled(
                delivery_id=row.id,
                batch_id=row.batch_id,
                inbox=row.inbox,
                sender=batch.sender,
                tag=batch.tag,
                outcome=outcome,
                status=status,
                destination=destination_name(row.inbox),
                event_type=batch.event_type,
            ),
        )

    def _settle(
        self,
        row: queue.Claimed,
        batch: BatchInfo,
        result: AttemptResult,
        status: Status,
        attempts: int,
        now: dt.datetime,
    ) -> queue.Settlement:
        outcome = str(status)
        self._signal_attempt(row, batch, result, outcome)
        self._settled_signal(row, batch, outcome, result.status)
        if status == Status.REFUSED:
            self.summary.refused += 1
            self._failed_signal(
                row, batch, result.status, result.error, deadline=False, refused=True
            )
        else:
            self.summary.delivered += 1
        return queue.Settlement(
            claimed=row,
            ordered=batch.ordered,
            status=status,
            attempts=attempts,
            last_status=result.status,
            last_error=result.error[: self.error_length],
            attempted_at=now,
        )

    def _fail(
        self,
        row: queue.Claimed,
        batch: BatchInfo,
        result: AttemptResult,
        attempts: int,
        now: dt.datetime,
        error: str,
        *,
        deadline: bool,
    ) -> queue.Settlement:
        self._signal_attempt(row, batch, result, "failed")
        self._failed_signal(row, batch, result.status, error, deadline=deadline, refused=False)
        self.summary.failed += 1
        return queue.Settlement(
            claimed=row,
            ordered=batch.ordered,
            status=Status.FAILED,
            attempts=attempts,
            last_status=result.status,
            last_error=error[: self.error_length],
            attempted_at=now,
        )

    def _failed_signal(
        self,
        row: queue.Claimed,
        batch: BatchInfo,
        status: int | None,
        error: str,
        *,
        deadline: bool,
        refused: bool,
    ) -> None:
        signals.send_safely(
            signals.delivery_failed,
            failure=signals.Failure(
                delivery_id=row.id,
                batch_id=row.batch_id,
                inbox=row.inbox,
                sender=batch.sender,
                tag=batch.tag,
                status=status,
                error=error[: self.error_length],
                deadline=deadline,
                refused=refused,
                destination=destination_name(row.inbox),
                event_type=batch.event_type,
            ),
        )

    def skipped(self, row: queue.Claimed, batch: BatchInfo) -> queue.Settlement:
        """A delivery SKIP_IF dropped unsent."""
        self._settled_signal(row, batch, str(Status.SKIPPED), None)
        self.summary.skipped += 1
        return queue.Settlement(
            claimed=row, status=Status.SKIPPED, attempts=row.attempts, ordered=batch.ordered
        )

    def paused(self, row: queue.Claimed) -> queue.Settlement:
        """A paused host's delivery waits, unsent and not failed. Pausing took
        the due time of what was queued; this one (in flight then, or queued
        since) is looked at again shortly, as the host may be resumed by then."""
        self.summary.held += 1
        return queue.Settlement(
            claimed=row,
            status=Status.PENDING,
            attempts=row.attempts,
            due_at=timezone.now() + dt.timedelta(seconds=PAUSED_RECHECK),
        )

    def abandoned(
        self, row: queue.Claimed, batch: BatchInfo, status: int | None, error: str
    ) -> None:
        """A delivery failed for good, unsent, by whoever writes it (a webhook
        destination no longer configured): its signal and its count."""
        self._failed_signal(row, batch, status, error, deadline=False, refused=False)
        self.summary.failed += 1

    def unsent(self, row: queue.Claimed, batch: BatchInfo, error: str) -> queue.Settlement:
        """Given up before it was sent: the batch's deadline passed."""
        self._failed_signal(row, batch, None, error, deadline=True, refused=False)
        self.summary.failed += 1
        return queue.Settlement(
            claimed=row,
            ordered=batch.ordered,
            status=Status.FAILED,
            attempts=row.attempts,
            last_error=error[: self.error_length],
        )
