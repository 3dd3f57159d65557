"""ActivityPub inboxes: how one is sent to, and how its answer is judged.

An attempt signs the activity in the scheme the host last accepted, POSTs
it, and on a 400 or 401 knocks once more at once in the other scheme
("double knocking"); a portable inbox's gateways are tried in turn, all
within one deadline. The answer is judged by ``PERMANENT_STATUS`` (every 4xx
but 408 and 429 by default), and what the inbox said is kept with the
target's credentials taken out.

Runs in a worker thread and never touches the database: the loop's side of
it, the job's key and scheme, is ``inboxes.py``.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping

from django_federation_delivery import addresses
from django_federation_delivery.attempt import (
    AttemptResult,
    Job,
    Verdict,
    failed,
    judged,
    lapsed,
    permanent_status,
)
from django_federation_delivery.exceptions import SigningError, TransportError
from django_federation_delivery.signatures import Scheme, SenderKey, sign_request
from django_federation_delivery.transport import Answer, Transport, parse_retry_after, status_text

__all__ = ["KNOCK_AGAIN", "InboxJob", "attempt", "describe"]

#: The answers that mean a knock in the wrong scheme, worth one more in the other.
KNOCK_AGAIN = frozenset({400, 401})


@dataclasses.dataclass(frozen=True, kw_only=True)
class InboxJob(Job):
    """An attempt at an inbox: what to sign, with what, and where to POST."""

    #: Where to POST, in order: the inbox, or a portable inbox's gateways.
    targets: tuple[str, ...]
    body: bytes
    body_sha256: str
    key: SenderKey | None
    sender: str
    #: The scheme to knock in first (the one the host last accepted).
    scheme: Scheme
    extra_headers: Mapping[str, str] = dataclasses.field(default_factory=dict)
    #: Set when the key could not be had for a reason that may pass.
    key_error: str = ""


def attempt(
    job: InboxJob,
    transport: Transport,
    *,
    is_permanent: Callable[[int], bool] = permanent_status,
    error_length: int = 300,
    clock: Callable[[], float] = time.monotonic,
) -> AttemptResult:
    """Make one attempt at ``job``: each target in turn until one accepts.

    The whole attempt, every gateway of a portable inbox and both knocks of
    double knocking, is over within the transport's ``attempt_timeout``, and
    before the job's lease ends: another process may take the delivery then.
    """
    started = clock()
    now = time.monotonic()
    if job.lease_deadline is not None and now >= job.lease_deadline:
        return lapsed(job)
    deadline = now + transport.settings.attempt_timeout
    if job.lease_deadline is not None:
        deadline = min(deadline, job.lease_deadline)
    if job.key_error:
        return failed(job, job.key_error, permanent=False, requests=0)
    if job.key is None:
        return failed(job, f"no key for sender {job.sender}", permanent=True, requests=0)
    last: AttemptResult | None = None
    requests = 0
    for target in job.targets:
        if last is not None and time.monotonic() >= deadline:
            # Out of time with gateways untried: one of them may yet accept,
            # whatever the last one said.
            return dataclasses.replace(last, permanent=False)
        outcome, made = _knock(
            job, job.key, target, transport, is_permanent, error_length, deadline
        )
        requests += made
        last = dataclasses.replace(outcome, duration=clock() - started, requests=requests)
        if last.delivered:
            return last
    assert last is not None, "a job has at least one target"
    return last


def _knock(
    job: InboxJob,
    key: SenderKey,
    target: str,
    transport: Transport,
    is_permanent: Callable[[int], bool],
    error_length: int,
    deadline: float,
) -> tuple[AttemptResult, int]:
    """POST to ``target`` in the job's scheme, and once more in the other
    when the first is answered 400 or 401 ("double knocking"), both by
    ``deadline``: a second knock with no time left is a passing failure, never
    the first one's refusal."""
    scheme = job.scheme
    if key.algorithm == "ed25519" and scheme is Scheme.CAVAGE:
        # draft-cavage as Mastodon verifies it has no Ed25519: go straight to RFC 9421.
        scheme = Scheme.RFC9421
    made = 0
    outcome = _post(job, key, target, scheme, transport, is_permanent, error_length, deadline)
    made += 1
    other = scheme.other()
    can_sign_other = not (key.algorithm == "ed25519" and other is Scheme.CAVAGE)
    if outcome.status in KNOCK_AGAIN and can_sign_other:
        outcome = _post(job, key, target, other, transport, is_permanent, error_length, deadline)
        made += 1
    return outcome, made


def _post(
    job: InboxJob,
    key: SenderKey,
    target: str,
    scheme: Scheme,
    transport: Transport,
    is_permanent: Callable[[int], bool],
    error_length: int,
    deadline: float,
) -> AttemptResult:
    try:
        # Signed and sent in one spelling: the signature covers the very target requested.
        url = addresses.split(target).url
    except addresses.UnusableURL as exc:
        error = f"cannot deliver to '{exc.redacted}': it {exc.reason}"
        return failed(job, error[:error_length], permanent=True, requests=0)
    try:
        headers = sign_request(
            scheme,
            url=url,
            body_sha256=job.body_sha256,
            key=key,
            extra_headers=job.extra_headers,
        )
    except SigningError as exc:
        return failed(job, str(exc)[:error_length], permanent=True)
    try:
        answer = transport.post(url, job.body, headers, deadline=deadline)
    except TransportError as exc:
        return failed(job, str(exc)[:error_length], permanent=exc.permanent)
    verdict = Verdict(
        delivered=200 <= answer.status < 300,
        refused=is_permanent(answer.status),
        retry_after=parse_retry_after(answer.headers.get("Retry-After")),
    )
    error = "" if verdict.delivered else describe(answer, error_length, target)
    return judged(job, answer.status, verdict, error, accepted_scheme=scheme)


def describe(answer: Answer, length: int, target: str = "") -> str:
    """ "the inbox answered 503 Service Unavailable: <the start of its body>",
    cut to ``length``, with the target's userinfo and query (which an inbox
    may echo) replaced."""
    secrets = addresses.credentials(target) if target else []
    longest = max(map(len, secrets), default=0)
    window = answer.body[: (length + longest) * 4]
    text = addresses.replace_secrets(window.decode("utf-8", "replace"), secrets)
    if longest and len(window) < len(answer.body):
        # Cut short: a secret may begin near the end without ending there.
        text = text[:-longest]
    text = text.strip()
    error = f"the inbox answered {status_text(answer.status)}"
    if text:
        error = f"{error}: {' '.join(text.split())}"
    return error[:length]
