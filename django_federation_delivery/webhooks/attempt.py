"""One attempt at one webhook delivery, in a worker thread.

The destination's kind builds the request for this attempt, at this
attempt's time (signed JSON is signed now), and judges the answer; what came
of it is an :class:`~django_federation_delivery.attempt.AttemptResult` like
any other, sent with no HTTP signature and no double knocking, within the
webhook time limit.

The URL is the credential, so every text that leaves here has been through
the destination's :meth:`~Destination.redact` (and the transport's
``scheme://host/path`` cut to ``scheme://host``), a receiver echoing the URL
included; urllib3's debug log lines are redacted while a webhook is sent.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from http import HTTPStatus

from django_federation_delivery.attempt import AttemptResult, Job, failed, judged
from django_federation_delivery.channels import Destination, Event, Verdict
from django_federation_delivery.exceptions import TransportError
from django_federation_delivery.transport import Transport, TransportSettings, logs, status_text
from django_federation_delivery.transport.failures import check_url
from django_federation_delivery.webhooks.policy import WebhookPolicy

__all__ = [
    "WebhookCall",
    "WebhookJob",
    "attempt_webhook",
    "safe_text",
    "webhook_transport_settings",
]

logger = logging.getLogger(__name__)

#: What a webhook receiver is asked to answer in: anything, it is only read
#: for an error.
ACCEPT = "application/json, */*;q=0.5"


@dataclasses.dataclass(frozen=True)
class WebhookCall:
    """What a worker needs to send one event to one destination."""

    destination: Destination | None
    event: Event | None
    #: Why it cannot be sent as it is (a destination that does not parse, an
    #: event that cannot be read back), and whether that can pass.
    problem: str = ""
    permanent: bool = False


@dataclasses.dataclass(frozen=True, kw_only=True)
class WebhookJob(Job):
    """A webhook delivery's job, sent by :func:`attempt_webhook`."""

    call: WebhookCall


def attempt_webhook(
    job: WebhookJob,
    transport: Transport,
    policy: WebhookPolicy,
    *,
    clock: Callable[[], float] = time.monotonic,
    now: Callable[[], float] = time.time,
) -> AttemptResult:
    """Make one attempt at the webhook ``job`` carries, at ``now()``."""
    call = job.call
    started = clock()
    if call.problem or call.destination is None or call.event is None:
        return failed(job, call.problem, permanent=call.permanent, requests=0)
    destination = call.destination
    try:
        request = destination.request(call.event, now=now())
    except Exception as exc:
        # The project's template, most likely; fixed, the retry sends it.
        logger.warning(
            "The event %s for %s could not be written: %s",
            call.event.type,
            destination.display,
            type(exc).__name__,
        )
        error = f"the event could not be written for {destination.name}: {type(exc).__name__}"
        return failed(job, error, permanent=False, requests=0)
    headers = {"Accept": ACCEPT, **request.headers}
    try:
        with logs.redacting(destination.redact):
            answer = transport.post(request.url, request.body, headers, method=request.method)
    except TransportError as exc:
        error = safe_text(destination, request.url, str(exc))[: policy.message_length]
        result = failed(job, error, permanent=False)
    else:
        verdict = destination.channel.judge(answer)
        result = _result(job, answer.status, verdict, destination, policy)
    return dataclasses.replace(result, duration=clock() - started)


def _result(
    job: Job, status: int, verdict: Verdict, destination: Destination, policy: WebhookPolicy
) -> AttemptResult:
    # The whole of what was read is redacted before any of it is cut: a cut
    # secret would no longer be recognised.
    text = " ".join(destination.redact(verdict.detail).split())
    error = f"the receiver answered {status_text(status)}"
    if text:
        error = f"{error}: {text[: policy.body_length].rstrip()}"
    result = judged(job, status, verdict, error)
    if status == HTTPStatus.GONE:
        # Not this event's refusal: the destination is gone, and disabled
        # for it (life.py). The event waits with the others, its tries kept.
        result = dataclasses.replace(result, permanent=False, held=True, retry_after=None)
    return result


def safe_text(destination: Destination, url: str, text: str) -> str:
    """``text`` (a transport's error) in one line with nothing of the URL but
    its scheme and host: the path of a Slack or Discord hook, and a bot
    token, are the credential."""
    try:
        target = check_url(url)
    except TransportError:
        pass
    else:
        origin = target.display.split("://", 1)
        host = origin[1].split("/", 1)[0] if len(origin) == 2 else ""
        if host:
            text = text.replace(target.display, f"{origin[0]}://{host}")
    return " ".join(destination.redact(text).split())


def webhook_transport_settings(
    settings: TransportSettings, policy: WebhookPolicy
) -> TransportSettings:
    """The transport's settings for webhooks: the webhook time limit, and
    the networks opened to destinations in place of those opened to inboxes."""
    return dataclasses.replace(
        settings,
        allowed_networks=policy.allowed_networks,
        attempt_timeout=policy.timeout,
        connect_timeout=min(settings.connect_timeout, policy.timeout),
    )
