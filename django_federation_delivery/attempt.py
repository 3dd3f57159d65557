"""One attempt at one delivery, whatever its kind: the :class:`Job` a worker
is given, the :class:`Verdict` on an answer, and the :class:`AttemptResult`
it reports; each kind makes its attempt with these (``channels/``).

Runs in a worker thread and never touches the database.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from typing import Any

from django_federation_delivery.signatures import Scheme


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What an answer means for the delivery."""

    delivered: bool
    #: Refused for good: the same request would be refused again.
    refused: bool = False
    #: Seconds the receiver asked to be left alone, if it said.
    retry_after: float | None = None
    #: What went wrong, in the receiver's words (redacted and cut by the
    #: caller): the start of a refusal's body, or what a 200 body said. Bytes
    #: are decoded (:func:`readable_detail`).
    detail: str = ""


def is_refusal(status: int) -> bool:
    """A 4xx says the request itself is wrong and will be wrong in an hour too;
    408 and 429 only say "not now"."""
    return 400 <= status < 500 and status not in (408, 429)


def is_host_failure(status: int | None) -> bool:
    """Whether an answer (``None``: none came) counts against its host's
    breaker: a 5xx, 408, 429 or no answer. A redirect or another 4xx came
    from a server that is up, whatever becomes of the delivery."""
    return status is None or status >= 500 or status in (408, 429)


#: The default judgement of an answer: every 4xx but 408 (timeout) and 429
#: (too many requests) says the same request will be refused again; the same
#: rule as every kind of webhook's.
permanent_status = is_refusal


@dataclasses.dataclass(frozen=True)
class Job:
    """What a worker needs for one attempt, whatever the kind: which delivery,
    and by when the attempt must be over."""

    delivery_id: int
    #: When its lease ends, less ``LEASE_MARGIN_SECONDS`` to write the outcome, as
    #: ``time.monotonic()``: the attempt is over by then, or not made. None: no lease.
    lease_deadline: float | None = dataclasses.field(default=None, kw_only=True)

    @property
    def makes_no_request(self) -> bool:
        """Whether the attempt is known, before it is made, to fail without
        a request (an inbox's sender with no key): no breaker's probe is
        spent on it."""
        return False


@dataclasses.dataclass(frozen=True)
class AttemptResult:
    job: Job
    delivered: bool
    #: The status the inbox answered with, if it answered.
    status: int | None
    error: str
    #: Whether trying again cannot help.
    permanent: bool
    retry_after: float | None
    #: The scheme the inbox accepted, when it accepted one.
    accepted_scheme: Scheme | None
    duration: float
    #: How many requests it took (two when it knocked twice; none when it
    #: could not be signed or was held).
    requests: int = 1
    #: Not sent: the destination's circuit breaker is open, or the lease ran out first.
    held: bool = False
    #: Answered by a gateway on a host other than the delivery's (a portable
    #: inbox's later one, which anyone may list): what its answer says of a
    #: host is not learned as the delivery's host's.
    elsewhere: bool = False
    #: Answered elsewhere: whether the delivery's own host (its first
    #: gateway) failed as a host fails (:func:`is_host_failure`), or made no
    #: request; a probe of its breaker is failed only then.
    first_failed: bool = True
    #: Not sent: its batch's deadline passed while it waited for a worker.
    #: Settled unsent, as one whose deadline passed at its slot: no attempt.
    overtaken: bool = False
    #: Not sent: its URL, or the address it resolved to, was refused before
    #: any request. Nothing of its host; but a webhook destination's URL is
    #: its operator's, and counts against it (``webhooks/life.py``).
    refused_address: bool = False


def _flag(value: Any) -> bool:
    return isinstance(value, bool)


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _seconds(value: Any) -> bool:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value) and value >= 0
    except OverflowError:
        return False  # an int past any float (a hostile body's 400 digits)


def _status(value: Any) -> bool:
    return value is None or (_count(value) and 100 <= value <= 999)


#: The longest an attempt is taken to have lasted: far past any timeout,
#: and within what a time stamp, a timedelta and the answer times' float32
#: samples hold (a kind's 1e39 s was infinity there, 1e11 s past timedelta).
LONGEST_DURATION = 86_400.0


def _duration(value: Any) -> bool:
    return _seconds(value) and value <= LONGEST_DURATION


#: What the loop reads of a result, field by field: whether a value will do,
#: what it should have been, and what stands for it in a delivered result
#: (what a delivered result of the package's own says there).
_FIELDS: tuple[tuple[str, Callable[[Any], bool], str, Any], ...] = (
    ("delivered", _flag, "True or False", True),
    ("status", _status, "an HTTP status (100 to 999) or None", None),
    ("error", lambda value: isinstance(value, str), "a str", ""),
    ("permanent", _flag, "True or False", False),
    (
        "retry_after",
        lambda value: value is None or _seconds(value),
        "seconds (finite, not negative) or None",
        None,
    ),
    (
        "accepted_scheme",
        lambda value: value is None or isinstance(value, Scheme),
        "a Scheme or None",
        None,
    ),
    ("duration", _duration, "seconds (not negative, at most a day)", 0.0),
    ("requests", _count, "a count (not negative)", 1),
    ("held", _flag, "True or False", False),
    ("elsewhere", _flag, "True or False", False),
    ("first_failed", _flag, "True or False", True),
    ("overtaken", _flag, "True or False", False),
    ("refused_address", _flag, "True or False", False),
)


def readable(job: Job, result: AttemptResult) -> tuple[AttemptResult, str]:
    """``result``, handed back by code the package does not hold (a host
    project's kind: its ``attempt()``, or the :class:`Verdict` of its
    ``judge()``), as the loop can decide and write what came of it, and
    what was wrong with it ("" when nothing was): each field of a type or a
    value the loop cannot read (a ``Retry-After`` header's text, None for
    no error), named with the type of what it holds, never the value, which
    may hold a secret.

    A result that says it was delivered (``delivered`` is True) stays
    delivered, what it holds that cannot be read replaced by what a
    delivered one says there: it was sent, and taken, and sending it again
    would deliver it twice. Any other is an attempt that crashed, a passing
    failure."""
    wrong = [
        (name, f"{name} ({type(getattr(result, name)).__name__}) is not {expected}", neutral)
        for name, fits, expected, neutral in _FIELDS
        if not fits(getattr(result, name))
    ]
    if not wrong:
        return result, ""
    fault = "; ".join(text for _name, text, _neutral in wrong)
    if result.delivered is True:
        neutral = {name: value for name, _text, value in wrong}
        return dataclasses.replace(result, **neutral), fault
    return crashed(job, f"internal error: the result's {fault}"), fault


def delivered_as_told(job: Job, *, duration: float) -> AttemptResult:
    """A result that says it was delivered, and whose fields could not even
    be read (their own comparisons raised): delivered, as :func:`readable`
    keeps one, each other field as a delivered one says it."""
    neutral = {name: value for name, _fits, _expected, value in _FIELDS}
    return AttemptResult(job=job, **{**neutral, "duration": duration})


def readable_detail(verdict: Verdict) -> tuple[str, str]:
    """``verdict``'s ``detail`` as text, and what was wrong with it ("" when
    nothing was), as :func:`readable` reads a result: bytes (an answer's
    body handed on as it was read) decoded, for the caller to redact and
    escape as an answer's text is; anything else but a str left out, named
    by its type alone, never its value."""
    detail: Any = verdict.detail
    if isinstance(detail, str):
        return detail, ""
    if isinstance(detail, bytes | bytearray):
        return bytes(detail).decode("utf-8", "replace"), ""
    return "", f"detail ({type(detail).__name__}) is not a str"


def judged(
    job: Job,
    status: int,
    verdict: Verdict,
    error: str,
    *,
    accepted_scheme: Scheme | None = None,
) -> AttemptResult:
    """What came of an attempt whose answer, ``status``, was judged ``verdict``
    (by the inbox's rule or a destination's kind): ``error`` told, and the
    scheme remembered, as the verdict has it."""
    delivered = verdict.delivered
    return AttemptResult(
        job=job,
        delivered=delivered,
        status=status,
        error="" if delivered else error,
        permanent=not delivered and verdict.refused,
        retry_after=None if delivered else verdict.retry_after,
        accepted_scheme=accepted_scheme if delivered else None,
        duration=0.0,
    )


def held(job: Job, error: str, retry_after: float) -> AttemptResult:
    """A delivery held back, without a request, by an open circuit breaker."""
    return dataclasses.replace(
        failed(job, error, permanent=False, requests=0), retry_after=retry_after, held=True
    )


def lapsed(job: Job) -> AttemptResult:
    """A delivery not sent because its lease was spent (but for the margin to
    write the outcome) before a worker took it."""
    # Sent now, it could still be in flight when the lease lapses and another
    # process takes the row and sends it too. Not sent, it can never arrive
    # twice: handed back as a passing failure without a request, it is written
    # under the claim's token, which a process that took the row since has
    # replaced, so the write changes nothing there; otherwise the retry policy
    # brings it round again.
    error = "not sent: its lease ran out before a worker was free"
    return dataclasses.replace(failed(job, error, permanent=False, requests=0), held=True)


def overtaken(job: Job) -> AttemptResult:
    """A delivery not sent because its batch's deadline passed while it
    waited for a worker: no request, held back, settled unsent as past its
    deadline (``overtaken``)."""
    error = "not sent: a worker was free only after it"
    result = failed(job, error, permanent=False, requests=0)
    return dataclasses.replace(result, held=True, overtaken=True)


def deadline_of(job: Job, timeout: float) -> float | None:
    """When an attempt at ``job`` begun now must be over, as
    ``time.monotonic()``: after ``timeout``, and before its lease ends.
    None when the lease is spent already: the attempt is not made, but
    :func:`lapsed`."""
    at = time.monotonic()
    lease = job.lease_deadline
    if lease is None:
        return at + timeout
    if at >= lease:
        return None
    return min(at + timeout, lease)


def crashed(job: Job, error: str, *, duration: float = 0.0) -> AttemptResult:
    """An attempt that raised (a bug, not the inbox's doing) after
    ``duration`` seconds: a passing failure, tried again by the retry policy."""
    return dataclasses.replace(failed(job, error, permanent=False), duration=duration)


def failed(
    job: Job, error: str, *, permanent: bool, requests: int = 1, sent: bool = True
) -> AttemptResult:
    """An attempt that got no answer from the inbox; not ``sent``, none was
    asked for: its URL or address was refused before any request."""
    return AttemptResult(
        job=job,
        delivered=False,
        status=None,
        error=error,
        permanent=permanent,
        retry_after=None,
        accepted_scheme=None,
        duration=0.0,
        requests=requests if sent else 0,
        refused_address=not sent,
    )
