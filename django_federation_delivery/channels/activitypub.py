"""ActivityPub inboxes: the :class:`ActivityPub` kind of destination.

An attempt signs the activity in the scheme the host last accepted, POSTs
it, and on a 400 or 401 knocks once more at once in the other scheme
("double knocking"); a portable inbox's gateways are tried in turn, all
within one deadline. The answer is judged by ``PERMANENT_STATUS`` (every 4xx
but 408 and 429 by default), and what the inbox said is kept with the
target's credentials (declared by :meth:`ActivityPub.parse`) taken out.

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
    deadline_of,
    failed,
    is_host_failure,
    judged,
    lapsed,
    permanent_status,
)
from django_federation_delivery.channels.base import Channel, Parsed, UnusableURL
from django_federation_delivery.channels.policy import Policy
from django_federation_delivery.exceptions import SigningError, TransportError
from django_federation_delivery.signatures import Scheme, SenderKey, sign_request
from django_federation_delivery.transport import (
    Answer,
    Transport,
    answer_text,
    parse_retry_after,
    status_text,
)

__all__ = [
    "KNOCK_AGAIN",
    "ActivityPub",
    "InboxJob",
    "describe",
    "signed_request",
    "signing_scheme",
]

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

    @property
    def makes_no_request(self) -> bool:
        return self.key is None or bool(self.key_error)


class ActivityPub(Channel):
    """An ActivityPub inbox: an activity signed by its sender, POSTed, and
    knocked again in the other signature scheme when the first is refused.

    Unlike a webhook kind it is not configured by name, nor chosen by a
    scheme: ``send()`` names its inboxes, and the deliverer makes one for
    them, as ``PERMANENT_STATUS`` and ``ERROR_LENGTH`` say. Its attempt is its
    own (:meth:`attempt`): more than one request, each signed for its knock,
    so it builds no :meth:`~Channel.request` of an event.
    """

    name = "activitypub"
    label = "ActivityPub inbox"
    schemes = ("https", "http")

    def __init__(
        self,
        *,
        is_permanent: Callable[[int], bool] = permanent_status,
        error_length: int = 300,
    ) -> None:
        self.is_permanent = is_permanent
        self.error_length = error_length

    def parse(self, url: str, scheme: str) -> Parsed:
        """An inbox URL in its canonical form, its userinfo and query (which an
        inbox may echo) declared secret."""
        try:
            parts = addresses.split(url)
        except addresses.UnusableURL as exc:
            raise UnusableURL(f"its URL {exc.reason}") from None
        return Parsed(url=parts.url, secrets=tuple(addresses.credentials(url)))

    def policy(self) -> Policy:
        """As the settings say: ``RETRY`` (its backoff written out as waits,
        with its jitter), ``RETRY_AFTER_MAX``, ``ATTEMPT_TIMEOUT``,
        ``ALLOWED_NETWORKS`` and ``MAX_BODY_BYTES`` (which ``send()`` checks);
        the lane of a send that names none."""
        from django.core.exceptions import ImproperlyConfigured

        from django_federation_delivery.conf import SETTING, app_settings

        retry = app_settings.retry
        try:
            return Policy(
                schedule=retry.waits,
                jitter=retry.jitter,
                retry_after_max=app_settings.retry_after_max,
                timeout=app_settings.attempt_timeout,
                allowed_networks=app_settings.allowed_networks(),
                max_bytes=app_settings.max_body_bytes,
                lane="normal",
            )
        except ValueError as exc:  # settings the checks refuse, read all the same
            raise ImproperlyConfigured(
                f"{SETTING}: the inbox policy its settings make: {exc}."
            ) from None

    def judge(self, answer: Answer) -> Verdict:
        """A 2xx is delivered; what ``PERMANENT_STATUS`` says is refused for
        good; anything else is tried again, after the ``Retry-After`` the
        inbox gave, in seconds or as a date."""
        delivered = 200 <= answer.status < 300
        return Verdict(
            delivered=delivered,
            # A project's PERMANENT_STATUS may answer any truthy value.
            refused=bool(self.is_permanent(answer.status)),
            retry_after=None if delivered else parse_retry_after(answer.headers.get("Retry-After")),
        )

    def attempt(
        self,
        job: InboxJob,
        transport: Transport,
        *,
        clock: Callable[[], float] = time.monotonic,
        now: Callable[[], float] = time.time,
    ) -> AttemptResult:
        """Make one attempt at ``job``: each target in turn until one accepts.

        The whole attempt, every gateway of a portable inbox and both knocks of
        double knocking, is over within the transport's ``attempt_timeout``, and
        before the job's lease ends: another process may take the delivery then.
        Signatures are made as each request is, at its own time.
        """
        started = clock()
        deadline = deadline_of(job, transport.settings.attempt_timeout)
        if deadline is None:
            return lapsed(job)
        if job.key_error:
            return failed(job, job.key_error, permanent=False, requests=0)
        if job.key is None:
            # Escaped as an answer is: a row written before senders were
            # checked as they are now may hold a control character.
            error = f"no key for sender {addresses.escaped(job.sender)}"
            return failed(job, error, permanent=True, requests=0)
        last: AttemptResult | None = None
        requests = 0
        # Whether a gateway said "not now" (a 5xx, a 429, no answer): it may
        # yet accept, whatever a later one (anyone may list one) refuses.
        put_off = False
        first_failed = True
        for number, target in enumerate(job.targets):
            if last is not None and time.monotonic() >= deadline:
                # Out of time with gateways untried: one of them may yet accept,
                # whatever the last one said.
                return dataclasses.replace(last, permanent=False)
            outcome, made = self._knock(job, job.key, target, transport, deadline)
            requests += made
            if number == 0:
                # What the first gateway's host said of itself, for its
                # breaker, whoever answers last (a 404: up, if no gateway).
                first_failed = not made or is_host_failure(outcome.status)
            elif not made:
                # A later gateway not asked (its address refused, its URL
                # unusable: anyone may list one) says nothing, and leaves
                # what the one before said standing for its host.
                put_off = put_off or not outcome.permanent
                continue
            last = dataclasses.replace(
                outcome,
                duration=clock() - started,
                requests=requests,
                elsewhere=number > 0
                and addresses.host_of(target) != addresses.host_of(job.targets[0]),
                first_failed=first_failed,
            )
            if last.delivered:
                return last
            put_off = put_off or not last.permanent
        assert last is not None, "a job has at least one target"
        return dataclasses.replace(last, permanent=False) if put_off else last

    def _knock(
        self,
        job: InboxJob,
        key: SenderKey,
        target: str,
        transport: Transport,
        deadline: float,
    ) -> tuple[AttemptResult, int]:
        """POST to ``target`` in the job's scheme, and once more in the other
        when the first is answered 400 or 401 ("double knocking"), both by
        ``deadline``: a second knock with no time left is a passing failure, never
        the first one's refusal. A knock that could not be signed made no
        request: the count says so, and a second one's leaves the first
        answer standing."""
        scheme = signing_scheme(key, job.scheme)
        outcome = self._post(job, key, target, scheme, transport, deadline)
        made = outcome.requests
        other = scheme.other()
        if outcome.status in KNOCK_AGAIN and signing_scheme(key, other) is other:
            again = self._post(job, key, target, other, transport, deadline)
            if again.requests:
                outcome = again
                made += again.requests
            elif not again.permanent:
                # Not signed for now (its key's service away): the other
                # scheme may yet be taken, so the refusal is not final.
                outcome = dataclasses.replace(outcome, permanent=False)
        return outcome, made

    def _post(
        self,
        job: InboxJob,
        key: SenderKey,
        target: str,
        scheme: Scheme,
        transport: Transport,
        deadline: float,
    ) -> AttemptResult:
        length = self.error_length
        try:
            url, headers = signed_request(job, key, target, scheme)
        except addresses.UnusableURL as exc:
            error = f"cannot deliver to '{exc.redacted}': it {exc.reason}"
            return failed(job, error[:length], permanent=True, requests=0)
        except SigningError as exc:
            # Ours, not the inbox's: no request was made, so nothing is
            # learned of its host (its health, its limit, its breaker).
            return failed(job, str(exc)[:length], permanent=True, requests=0)
        except Exception as exc:
            # A key of the host project's own whose signing calls a service
            # (a KMS's, an HSM's), away a moment: ours too, and maybe not for
            # good. Named by its type alone: its message may hold anything.
            error = f"the sender's key could not sign: {type(exc).__name__}"
            return failed(job, error[:length], permanent=False, requests=0)
        try:
            answer = transport.post(url, job.body, headers, deadline=deadline)
        except TransportError as exc:
            return failed(job, str(exc)[:length], permanent=exc.permanent, sent=exc.sent)
        verdict = self.judge(answer)
        error = "" if verdict.delivered else describe(answer, length, target)
        return judged(job, answer.status, verdict, error, accepted_scheme=scheme)


def signing_scheme(key: SenderKey, scheme: Scheme) -> Scheme:
    """The scheme a knock in ``scheme`` is signed in with ``key``: RFC 9421
    for an Ed25519 key, which draft-cavage (as Mastodon verifies it) cannot
    carry, so that no knock is made that every inbox would refuse."""
    if key.algorithm == "ed25519" and scheme is Scheme.CAVAGE:
        return Scheme.RFC9421
    return scheme


def signed_request(
    job: InboxJob, key: SenderKey, target: str, scheme: Scheme
) -> tuple[str, dict[str, str]]:
    """Where a request of ``job`` to ``target`` goes and the headers it
    carries, signed now in ``scheme``, the job's extra headers among them
    and covered. The URL is the target's canonical form, the very one signed:
    signed and sent in one spelling. An attempt's knocks and a test's
    ``Outgoing.headers()`` are both made here, so that a test sees what an
    attempt sends. Raises ``UnusableURL`` for a target with no canonical
    form, ``SigningError`` for what cannot be signed."""
    url = addresses.split(target).url
    headers = sign_request(
        scheme,
        url=url,
        body_sha256=job.body_sha256,
        key=key,
        extra_headers=job.extra_headers,
    )
    return url, headers


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
        error = f"{error}: {answer_text(text)}"
    return error[:length]
