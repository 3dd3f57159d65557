"""What comes of an attempt, signalled and counted, and what to write.

The coordinator asks a :class:`Settler` what to write for each delivery it
is done with; the settler asks :func:`~django_federation_delivery.decide.decide`
(``decide.py``: pure, tested as a table), sends the signals (before anything
is written, so that a crash in between sends them again), counts, and returns
the :class:`~django_federation_delivery.store.settlements.Settlement` to
write.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import inspect
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

from django.db import DatabaseError
from django.utils.translation import gettext as _

from django_federation_delivery import metrics, signals
from django_federation_delivery.attempt import AttemptResult
from django_federation_delivery.batches import BatchInfo
from django_federation_delivery.channels.policy import Policy
from django_federation_delivery.decide import Outcome, Ruling, decide
from django_federation_delivery.dialect import aware_now
from django_federation_delivery.exceptions import raised_at
from django_federation_delivery.models import Status
from django_federation_delivery.retry import RetryPolicy
from django_federation_delivery.store import claims, settlements

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
    #: Held back without a request, and then superseded by a retraction
    #: sent meanwhile (counted held no more).
    superseded: int = 0
    attempts: int = 0
    started: float = dataclasses.field(default_factory=time.monotonic)
    #: When the run ended, once it has.
    stopped: float | None = None

    def count(self, outcome: Outcome, by: int = 1) -> None:
        """One more delivery that came to ``outcome`` (each has its field)."""
        # A StrEnum is its value: no look-up of ``.value`` a delivery.
        setattr(self, outcome, getattr(self, outcome) + by)

    @property
    def done(self) -> int:
        """Deliveries dealt with: settled, or put back for later."""
        return (
            self.delivered
            + self.retrying
            + self.refused
            + self.failed
            + self.skipped
            + self.held
            + self.superseded
        )

    @property
    def elapsed(self) -> float:
        return (self.stopped or time.monotonic()) - self.started

    @property
    def rate(self) -> float:
        """Deliveries settled as delivered per second."""
        return self.delivered / self.elapsed if self.elapsed > 0 else 0.0

    def line(self) -> str:
        """What was done, in the active language (English in a log line)."""
        return _(
            "delivered %(delivered)d, retrying %(retrying)d, refused %(refused)d, "
            "failed %(failed)d, skipped %(skipped)d, held %(held)d, "
            "superseded %(superseded)d in %(elapsed).1fs (%(rate).1f/s)"
        ) % {
            "delivered": self.delivered,
            "retrying": self.retrying,
            "refused": self.refused,
            "failed": self.failed,
            "skipped": self.skipped,
            "held": self.held,
            "superseded": self.superseded,
            "elapsed": self.elapsed,
            "rate": self.rate,
        }


#: Why a delivery its batch's deadline overtook before it was sent is failed.
DEADLINE_PASSED = "the batch's deadline passed before it was sent"


def ask(setting: str, function: Callable[..., Any], *args: Any) -> Any:
    """Call one of the host project's callables; one that raises is logged and
    taken as no answer, never a reason to stop. Logged by the error's type
    and where it was raised, never its message or traceback: given an inbox,
    the callable's error may quote its query (a token)."""
    try:
        answer = function(*args)
    except Exception as error:
        _raised(setting, error)
        return None
    if inspect.isawaitable(answer):
        # A plain function wrapping an async one (the checks refuse an async
        # one itself): its coroutine, never awaited, would read as true.
        if inspect.iscoroutine(answer):
            answer.close()
        logger.error(
            "%s answered %s, which is awaited nowhere; taken as no answer",
            setting,
            type(answer).__name__,
        )
        return None
    return answer


def _raised(what: str, error: Exception) -> None:
    """Log that ``what`` raised ``error``, taken as no answer: by its type and
    where it was raised."""
    logger.error("%s raised %s%s; taken as no answer", what, type(error).__name__, raised_at(error))


#: The status an attempt's outcome writes.
WRITTEN = {
    Outcome.DELIVERED: Status.DELIVERED,
    Outcome.REFUSED: Status.REFUSED,
    Outcome.FAILED: Status.FAILED,
    Outcome.RETRYING: Status.PENDING,
    Outcome.HELD: Status.PENDING,
}


class Row(Protocol):
    """A delivery as its signals name it: a claimed one, or one given up."""

    @property
    def id(self) -> int: ...
    @property
    def batch_id(self) -> int: ...
    @property
    def inbox(self) -> str: ...
    @property
    def destination(self) -> str: ...


def failure(
    row: Row,
    *,
    sender: str,
    tag: str,
    event_type: str,
    status: int | None,
    error: str,
    deadline: bool = False,
    refused: bool = False,
) -> signals.Failure:
    """The ``delivery_failed`` payload for ``row``: a webhook delivery's is named
    by its destination, never its URL."""
    return signals.Failure(
        delivery_id=row.id,
        batch_id=row.batch_id,
        inbox=row.inbox,
        sender=sender,
        tag=tag,
        status=status,
        error=error,
        deadline=deadline,
        refused=refused,
        destination=row.destination,
        event_type=event_type,
    )


def tell_settled(row: Row, batch: BatchInfo, outcome: Outcome, status: int | None) -> None:
    """Send ``delivery_settled`` for ``row`` of ``batch``, if it is listened to."""
    if not signals.listened(signals.delivery_settled):
        return
    signals.send_safely(
        signals.delivery_settled,
        settled=settled(
            row,
            sender=batch.sender,
            tag=batch.tag,
            event_type=batch.event_type,
            outcome=outcome,
            status=status,
        ),
    )


def tell_failed(
    row: Row,
    batch: BatchInfo,
    status: int | None,
    error: str,
    *,
    deadline: bool = False,
    refused: bool = False,
) -> None:
    """Send ``delivery_failed`` for ``row`` of ``batch``."""
    signals.send_safely(
        signals.delivery_failed,
        failure=failure(
            row,
            sender=batch.sender,
            tag=batch.tag,
            event_type=batch.event_type,
            status=status,
            error=error,
            deadline=deadline,
            refused=refused,
        ),
    )


def settled(
    row: Row,
    *,
    sender: str,
    tag: str,
    event_type: str,
    outcome: Outcome,
    status: int | None,
) -> signals.Settled:
    """The ``delivery_settled`` payload for ``row``, as :func:`failure` is
    ``delivery_failed``'s."""
    return signals.Settled(
        delivery_id=row.id,
        batch_id=row.batch_id,
        inbox=row.inbox,
        sender=sender,
        tag=tag,
        outcome=outcome,
        status=status,
        destination=row.destination,
        event_type=event_type,
    )


@dataclasses.dataclass
class Settler:
    """Sends the signals of what :func:`decide` says, counts, and says what to write."""

    policy: RetryPolicy
    summary: Summary
    wait_as_asked: bool = True
    retry_after_max: float = 3600.0
    error_length: int = 300
    sender_gone: Callable[[str], bool] | None = None
    permanent_if_gone: frozenset[int] = frozenset()
    #: Whether a delivery held back without a request spends a try (see decide()).
    holds_spend_tries: bool = True
    #: Told what came of each attempt, before anything is decided (an inbox
    #: host's health: ``health.py``; a webhook destination's life:
    #: ``webhooks/life.py``); it says whether the destination stopped taking
    #: deliveries with it: the delivery then waits, unsent, until the
    #: destination takes them again.
    watch: Callable[[claims.Claimed, AttemptResult, dt.datetime], bool] | None = None
    #: Told each ruling with the try it came of, to tell an operator as the
    #: kind sees fit (a webhook's retries and give-ups: ``webhooks/policy.py``).
    tell: Callable[[claims.Claimed, BatchInfo, Ruling, int, dt.datetime], None] | None = None
    #: Whether the watch last met the database away (said once).
    _watch_away: bool = dataclasses.field(default=False, init=False, repr=False, compare=False)

    @classmethod
    def from_settings(cls, summary: Summary, policy: Policy) -> Settler:
        """The settler of ActivityPub deliveries: retried as ``policy`` (the
        inbox kind's) says, and as ``FEDERATION_DELIVERY`` says of senders."""
        from django_federation_delivery.conf import app_settings

        return cls(
            policy=policy.retry,
            summary=summary,
            wait_as_asked=app_settings.wait_as_asked,
            retry_after_max=policy.retry_after_max,
            error_length=app_settings.error_length,
            sender_gone=app_settings.callable_setting("SENDER_GONE"),
            permanent_if_gone=app_settings.permanent_if_sender_gone,
        )

    def attempted(
        self,
        row: claims.Claimed,
        batch: BatchInfo,
        result: AttemptResult,
        now: dt.datetime | None = None,
    ) -> settlements.Settlement:
        """Decide what comes of an attempt, send the signals, and say what to
        write; ``now`` is the time it is judged at (the clock's, if not given)."""
        # Held back (an open breaker, a spent lease), it may spend no try.
        tried = 0 if result.held and not self.holds_spend_tries else 1
        attempts = row.attempts + tried
        self.summary.attempts += tried
        if now is None:
            now = aware_now()
        disabled = self.watch is not None and self._watched(row, result, now)
        ruling = decide(
            result,
            attempts,
            self.policy,
            now=now,
            max_attempts=batch.max_attempts,
            deadline=batch.deadline,
            # Asked only when it could change the outcome: it is the host project's.
            sender_gone=not result.delivered
            and not result.permanent
            and self._gone(batch.sender, result.status),
            wait_as_asked=self.wait_as_asked,
            retry_after_max=self.retry_after_max,
            holds_spend_tries=self.holds_spend_tries,
        )
        waits = ruling.outcome in (Outcome.RETRYING, Outcome.HELD, Outcome.FAILED)
        if disabled and waits and not ruling.deadline:
            # Its destination takes no more deliveries now: it waits with the
            # others, never given up, due again only once the destination is
            # enabled (the loop's view of paused hosts may be a second old).
            ruling = Ruling(Outcome.HELD, due_at=None, error=ruling.error)
        outcome = ruling.outcome
        if self.tell is not None:
            ask("the settler's tell", self.tell, row, batch, ruling, attempts, now)
        self._signal_attempt(row, batch, result, outcome)
        if outcome in (Outcome.DELIVERED, Outcome.REFUSED):
            self._settled_signal(row, batch, outcome, result.status)
        if outcome in (Outcome.REFUSED, Outcome.FAILED):
            self._failed_signal(
                row,
                batch,
                result.status,
                ruling.error,
                deadline=ruling.deadline,
                refused=outcome is Outcome.REFUSED,
            )
        self.summary.count(outcome)
        return settlements.Settlement(
            claimed=row,
            ordered=batch.ordered,
            status=WRITTEN[outcome],
            attempts=attempts,
            due_at=ruling.due_at,
            last_status=result.status,
            last_error=ruling.error[: self.error_length],
            # Only a request is an attempt a receiver may have seen: what made
            # none (held back, unsigned) is still never attempted, which a
            # retraction supersedes.
            attempted_at=now if result.requests else None,
            retried=outcome is Outcome.RETRYING,
            counted=outcome,
        )

    def _watched(self, row: claims.Claimed, result: AttemptResult, now: dt.datetime) -> bool:
        """Tell the watch what came of an attempt: whether it stopped the
        destination taking deliveries. The database away there is said once
        until the watch is told again, as a warning: what it would have
        written is written at a later attempt."""
        assert self.watch is not None
        try:
            disabled = self.watch(row, result, now) is True
        except DatabaseError as error:
            if not self._watch_away:
                self._watch_away = True
                logger.warning(
                    "The database is unavailable to note what came of attempts at their "
                    "hosts (%s): noted at a later attempt",
                    type(error).__name__,
                )
            return False
        except Exception as error:
            _raised("the watch of hosts and destinations", error)
            return False
        self._watch_away = False
        return disabled

    def _gone(self, sender: str, status: int | None) -> bool:
        if status is None or status not in self.permanent_if_gone or self.sender_gone is None:
            return False
        return bool(ask("SENDER_GONE", self.sender_gone, sender))

    def _signal_attempt(
        self, row: claims.Claimed, batch: BatchInfo, result: AttemptResult, outcome: Outcome
    ) -> None:
        metrics.record_attempt(
            outcome, result.duration, status=result.status, requests=result.requests
        )
        if not signals.listened(signals.delivery_attempted):
            return
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
                destination=row.destination,
                event_type=batch.event_type,
            ),
        )

    def _settled_signal(
        self, row: claims.Claimed, batch: BatchInfo, outcome: Outcome, status: int | None
    ) -> None:
        tell_settled(row, batch, outcome, status)

    def _failed_signal(
        self,
        row: claims.Claimed,
        batch: BatchInfo,
        status: int | None,
        error: str,
        *,
        deadline: bool,
        refused: bool,
    ) -> None:
        tell_failed(
            row, batch, status, error[: self.error_length], deadline=deadline, refused=refused
        )

    def skipped(self, row: claims.Claimed, batch: BatchInfo) -> settlements.Settlement:
        """A delivery SKIP_IF dropped unsent."""
        self._settled_signal(row, batch, Outcome.SKIPPED, None)
        self.summary.count(Outcome.SKIPPED)
        return settlements.Settlement(
            claimed=row, status=Status.SKIPPED, attempts=row.attempts, ordered=batch.ordered
        )

    def paused(self, row: claims.Claimed) -> settlements.Settlement:
        """A paused host's delivery waits, unsent and not failed. Pausing took
        the due time of what was queued; this one (in flight then, or queued
        since) is looked at again shortly, as the host may be resumed by then."""
        self.summary.count(Outcome.HELD)
        return settlements.Settlement(
            claimed=row,
            status=Status.PENDING,
            attempts=row.attempts,
            due_at=aware_now() + dt.timedelta(seconds=PAUSED_RECHECK),
            counted=Outcome.HELD,
        )

    def abandoned(
        self, row: claims.Claimed, batch: BatchInfo, status: int | None, error: str
    ) -> None:
        """A delivery failed for good, unsent, by whoever writes it (a webhook
        destination no longer configured): its signal and its count."""
        self._failed_signal(row, batch, status, error, deadline=False, refused=False)
        self.summary.count(Outcome.FAILED)

    def unsent(self, row: claims.Claimed, batch: BatchInfo, error: str) -> settlements.Settlement:
        """Given up before it was sent: the batch's deadline passed. What
        its last attempt was answered with, if any, is told and kept."""
        self._failed_signal(row, batch, row.last_status, error, deadline=True, refused=False)
        self.summary.count(Outcome.FAILED)
        return settlements.Settlement(
            claimed=row,
            ordered=batch.ordered,
            status=Status.FAILED,
            attempts=row.attempts,
            last_error=error[: self.error_length],
        )
