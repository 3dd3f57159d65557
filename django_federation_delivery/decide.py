"""What comes of an attempt: delivered, refused, retried or given up.

:func:`decide` answers it, a plain function of the attempt's result, the
retry policy, the batch's deadline and max attempts, and the time: no
database, no signal, no clock, tested as a table (``tests/test_decide.py``).
The settler (``settling.py``) asks it, then signals and writes.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import enum
import random
from collections.abc import Callable

from django_federation_delivery.attempt import AttemptResult
from django_federation_delivery.retry import LONGEST_WAIT, RetryPolicy, wait_before_retry

__all__ = ["Outcome", "Ruling", "decide"]


class Outcome(enum.StrEnum):
    """What came of a delivery, as the signals and the metrics name it. A
    ``StrEnum``: a receiver comparing ``outcome`` with "delivered" works."""

    #: Accepted by the inbox.
    DELIVERED = "delivered"
    #: Failed for now; tried again later.
    RETRYING = "retrying"
    #: Not sent (an open circuit breaker, a lease spent before a worker was
    #: free); tried again later.
    HELD = "held"
    #: An answer that will not change: not tried again.
    REFUSED = "refused"
    #: Given up: the retry policy's end, max attempts, or the batch's deadline.
    FAILED = "failed"
    #: Dropped unsent by ``SKIP_IF``.
    SKIPPED = "skipped"
    #: Dropped unsent, never attempted: its sender's Delete of what it was
    #: about (or Undo of it) was queued to the same inbox.
    SUPERSEDED = "superseded"


@dataclasses.dataclass(frozen=True)
class Ruling:
    """What an attempt comes to, before anything is sent or written (not the
    verdict on an answer, :class:`~django_federation_delivery.attempt.Verdict`,
    which is one of its inputs)."""

    outcome: Outcome
    #: When a delivery tried again (retrying, held) is next due.
    due_at: dt.datetime | None = None
    #: The error to keep and to tell: the attempt's, or why it was given up.
    error: str = ""
    #: Failed because the batch's deadline passed, not by the retry policy.
    deadline: bool = False


#: How long a delivery held back waits, at the least, under a policy with
#: no wait to give (one try, ``schedule=()``), its hold asking none.
HELD_LEAST = 30.0


def decide(
    result: AttemptResult,
    attempts: int,
    policy: RetryPolicy,
    *,
    now: dt.datetime,
    max_attempts: int | None = None,
    deadline: dt.datetime | None = None,
    sender_gone: bool = False,
    wait_as_asked: bool = True,
    retry_after_max: float = 3600.0,
    holds_spend_tries: bool = True,
    rand: Callable[[], float] = random.random,
) -> Ruling:
    """What ``result`` comes to under ``policy`` and its batch's
    ``max_attempts`` and ``deadline``, ``attempts`` tries having been made
    (this one counted, unless it was held and ``holds_spend_tries`` is False).

    A plain function of its arguments: no database, no signal, no clock
    (``now`` is given; ``rand`` is the policy's jitter). ``sender_gone`` says
    whether the sender is gone and the status is one that then refuses for good.

    A delivery held back without a request (an open breaker, a spent lease)
    is a try like any other for an inbox, so that a backlog to a host that
    stays down is given up in the policy's time; for a webhook, of which only
    the first in line is ever due, it is not (``holds_spend_tries=False``).
    """
    if result.held and not holds_spend_tries:
        return _held(result, attempts, policy, now=now, deadline=deadline, rand=rand)
    if result.delivered:
        return Ruling(Outcome.DELIVERED, error=result.error)
    if result.permanent or sender_gone:
        return Ruling(Outcome.REFUSED, error=result.error)
    wait = None
    if max_attempts is None or attempts < max_attempts:
        wait = policy.delay(attempts, rand)
    if wait is None:
        return Ruling(Outcome.FAILED, error=f"gave up after {attempts} attempts: {result.error}")
    # A hold's time is the package's own (a breaker's cool-off, a probe's
    # time): waited out whatever is said of a server's Retry-After.
    wait = wait_before_retry(
        wait,
        result.retry_after,
        wait_as_asked=wait_as_asked or result.held,
        longest=LONGEST_WAIT if result.held else retry_after_max,
    )
    due = now + dt.timedelta(seconds=wait)
    if deadline is not None and due >= deadline:
        return _past_deadline(result, now, deadline)
    return Ruling(Outcome.HELD if result.held else Outcome.RETRYING, due_at=due, error=result.error)


def _past_deadline(result: AttemptResult, now: dt.datetime, deadline: dt.datetime) -> Ruling:
    """A delivery whose next try would come past its batch's deadline:
    failed, but one held (an open breaker, a paused host) is held until the
    deadline itself, and failed then, unless a reset, a probe's success or a
    resume releases it first: it was never tried and refused."""
    if result.held and now < deadline:
        return Ruling(Outcome.HELD, due_at=deadline, error=result.error)
    error = f"the batch's deadline passed: {result.error}"
    return Ruling(Outcome.FAILED, error=error, deadline=True)


def _held(
    result: AttemptResult,
    attempts: int,
    policy: RetryPolicy,
    *,
    now: dt.datetime,
    deadline: dt.datetime | None,
    rand: Callable[[], float],
) -> Ruling:
    """Held back without a request (an open breaker, a spent lease): no try
    was spent, so no policy gives it up, but its batch's deadline still does.
    It waits out the hold, and at least the policy's wait after the tries
    made so far, so that a long outage does not bring it round every second."""
    made = max(1, min(attempts, policy.max_attempts - 1))
    policy_wait = policy.delay(made, rand)
    wait = wait_before_retry(
        # A policy with no wait at all (one try) would bring it round at once.
        HELD_LEAST if policy_wait is None else policy_wait,
        result.retry_after,
        wait_as_asked=True,
        longest=LONGEST_WAIT,
    )
    due = now + dt.timedelta(seconds=wait)
    if deadline is not None and due >= deadline:
        return _past_deadline(result, now, deadline)
    return Ruling(Outcome.HELD, due_at=due, error=result.error)
