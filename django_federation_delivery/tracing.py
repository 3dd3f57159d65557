"""OpenTelemetry traces of the deliverer, with the optional ``otel`` extra.

One span an attempt, the child of the span that sent its batch:

* :func:`carried` is read as a send makes its batch (``sending.py``,
  ``webhooks/sending.py``, ``replay.py``): the W3C trace context of the span
  current then, if there is one, kept on the batch (``Batch.trace_context``),
  so that a deliverer in another process carries on its trace;
* :func:`attempting` wraps the attempt in a worker thread (``workers.py``):
  the span begins there and is current there while the attempt is made, so
  that what the attempt logs, and the spans of an instrumented HTTP client,
  are its own;
* :func:`attempted` ends it once the loop has decided what came of the
  attempt (``Deliverer.perform()``), at the time the attempt itself ended:
  its duration is the attempt's. A delivery held without a request (an open
  breaker) has its span made and ended there.

What a span holds never names a URL: an inbox's host, a webhook
destination's name, and the error the delivery keeps (``last_error``,
redacted). Without ``opentelemetry-api`` installed, each function does
nothing; without a tracer provider, the API's spans record nothing.
"""

from __future__ import annotations

import json
import re
import time
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol
from urllib.parse import unquote, urlsplit

from django_federation_delivery import __version__, addresses
from django_federation_delivery.channels.base import Call
from django_federation_delivery.decide import Outcome
from django_federation_delivery.models import Status

if TYPE_CHECKING:
    from django_federation_delivery.attempt import AttemptResult, Job
    from django_federation_delivery.batches import BatchInfo
    from django_federation_delivery.store.claims import Claimed
    from django_federation_delivery.store.settlements import Settlement

try:
    from opentelemetry import context, trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
except ImportError:  # pragma: no cover - exercised where the extra is not installed
    trace = None  # type: ignore[assignment]

__all__ = ["attempted", "attempting", "available", "carried"]

#: The attributes of this package's own, beside OpenTelemetry's
#: semantic conventions (``server.address``, ``http.response.status_code``).
PREFIX = "federation_delivery"
#: The outcomes an attempt's span marks as an error.
FAILURES = frozenset({Outcome.RETRYING, Outcome.REFUSED, Outcome.FAILED})

if trace is not None:
    _tracer: trace.Tracer | None = trace.get_tracer("django_federation_delivery", __version__)
    # W3C's, whatever propagator the host project set for its requests: the
    # column holds a traceparent, read back by a deliverer that may be set
    # up otherwise.
    _propagator = TraceContextTextMapPropagator()
else:  # pragma: no cover - exercised where the extra is not installed
    _tracer = None


def available() -> bool:
    """Whether ``opentelemetry-api`` is installed."""
    return trace is not None


def carried() -> str:
    """The trace context of the span current in this thread, as a batch
    keeps it: JSON of its ``traceparent`` (and ``tracestate``), or "" when
    no span is current (or OpenTelemetry is not installed)."""
    if trace is None:
        return ""
    if not trace.get_current_span().get_span_context().is_valid:
        return ""
    carrier: dict[str, str] = {}
    _propagator.inject(carrier)
    return json.dumps(carrier, separators=(",", ":"))


class Begun(NamedTuple):
    """An attempt's span, begun by the worker that made the attempt, and
    when the attempt ended (``time.time_ns()``)."""

    span: trace.Span
    ended: int


class Traced(Protocol):
    """What an attempt's span is made of, and kept on: the loop's
    ``InFlight`` (``workers.py``), named by what it holds, so that this
    module, which the workers use, need not import theirs."""

    claimed: Claimed
    batch: BatchInfo
    job: Job
    span: Begun | None

    @property
    def lane(self) -> str: ...


class _Attempting:
    """The worker's side of an attempt's span: begun as the attempt starts,
    current in the worker's thread while it is made, left on the delivery
    (``InFlight.span``) for the loop to end."""

    __slots__ = ("item", "span", "token")

    def __init__(self, item: Traced) -> None:
        self.item = item

    def __enter__(self) -> None:
        self.span = _begin(self.item)
        self.token = context.attach(trace.set_span_in_context(self.span))

    def __exit__(self, *exc_info: object) -> None:
        context.detach(self.token)
        self.item.span = Begun(self.span, time.time_ns())


class _Untraced:
    """The attempt as it is, without OpenTelemetry."""

    def __enter__(self) -> None:
        pass

    def __exit__(self, *exc_info: object) -> None:
        pass


_UNTRACED = _Untraced()


def attempting(item: Traced) -> _Attempting | _Untraced:
    """What a worker makes ``item``'s attempt in: its span, or (without
    OpenTelemetry) nothing at all."""
    if _tracer is None:
        return _UNTRACED
    return _Attempting(item)


def attempted(item: Traced, result: AttemptResult, settlement: Settlement) -> None:
    """End ``item``'s span with what came of its attempt: ``result``, decided
    and about to be written as ``settlement``."""
    if _tracer is None:
        return
    begun = item.span
    # Held without a request (an open breaker), it had no worker: its span
    # begins and ends here.
    span, ended = (_begin(item), None) if begun is None else begun
    if span.is_recording():
        outcome = outcome_of(settlement)
        span.set_attribute(f"{PREFIX}.outcome", outcome)
        span.set_attribute(f"{PREFIX}.requests", result.requests)
        if result.status is not None:
            span.set_attribute("http.response.status_code", result.status)
        if outcome in FAILURES:
            told = _unplaced(item, no_urls(settlement.last_error))
            span.set_status(trace.Status(trace.StatusCode.ERROR, told))
    span.end(end_time=ended)


#: A URL in an error's text: the transport names the one it sent to.
URL = re.compile(r"\b[a-z][a-z0-9+.-]*://[^\s]*", re.IGNORECASE)


def no_urls(error: str) -> str:
    """``error`` with each URL in it taken out: a span names none, neither an
    inbox's path nor anything of a webhook's (its host and port included),
    whatever the transport's message said ("http://host/path: no complete
    answer within 0.5s")."""
    return URL.sub(_unnamed, error)


def _unplaced(item: Traced, error: str) -> str:
    """``error`` naming nothing of where ``item`` was sent, whatever the
    transport said or an answer echoed: a webhook's host (and port), as
    written or as DNS was asked for it, written ``[host]``; an inbox's path
    (each gateway's, for a portable inbox), encoded or not, ``[path]``,
    where it stands alone (not the "/1" of "HTTP/1.1")."""
    places: list[tuple[str, str]] = []
    job = item.job
    if item.claimed.destination:
        if isinstance(job, Call) and job.destination is not None:
            url = job.destination.url
            parts = urlsplit(url)
            hostport = parts.netloc.rpartition("@")[2]
            places += [(hostport, "[host]"), (parts.hostname or "", "[host]")]
            try:
                canonical = addresses.split(url, userinfo=True)
            except addresses.UnusableURL:
                pass
            else:
                places += [(canonical.hostport, "[host]"), (canonical.host, "[host]")]
    else:
        for target in getattr(job, "targets", ()):
            try:
                path = addresses.split(target).path
            except addresses.UnusableURL:
                continue
            if len(path) > 1:  # "/" alone names nothing
                places += [(path, "[path]"), (unquote(path), "[path]")]
    # The longest first: a host and port before the host alone.
    for place, instead in sorted(set(places), key=lambda found: -len(found[0])):
        if place.count("/") > 1:
            # A path of two segments or more is no word of another text.
            error = error.replace(place, instead)
        elif place:
            # Standing alone: not the "/1" of "HTTP/1.1", nor a host in a name.
            error = re.sub(rf"(?<![\w/.%-]){re.escape(place)}(?![\w%-])", instead, error)
    return error


def _unnamed(match: re.Match[str]) -> str:
    url = match.group()
    named = url.rstrip(":;,.)")
    return "[url]" + url[len(named) :]  # what followed it ("…: no answer") kept


def outcome_of(settlement: Settlement) -> Outcome:
    """What an attempt came to, as ``delivery_attempted`` names it, read off
    what is written for it (``settling.WRITTEN``, turned round): a pending one
    was retried, or held."""
    if settlement.status == Status.PENDING:
        return Outcome.RETRYING if settlement.retried else Outcome.HELD
    return Outcome(settlement.status)


def _begin(item: Traced) -> trace.Span:
    assert _tracer is not None
    row = item.claimed
    attributes: dict[str, Any] = {
        f"{PREFIX}.kind": row.kind,
        f"{PREFIX}.lane": item.lane,
        # The try this is, counted as the delivery's attempts are: a hold
        # that spends none is followed by one of the same number.
        f"{PREFIX}.attempt": row.attempts + 1,
        f"{PREFIX}.delivery_id": row.id,
        f"{PREFIX}.batch_id": row.batch_id,
    }
    if row.destination:
        # A webhook: its destination's name and kind, never its URL (a
        # credential), nor the URL's host.
        attributes[f"{PREFIX}.host"] = row.destination
        job = item.job
        if isinstance(job, Call) and job.destination is not None:
            attributes[f"{PREFIX}.channel"] = job.destination.channel.name
    else:
        # The host key (with a port that is not the scheme's default);
        # server.address is the host alone, as OpenTelemetry has it.
        attributes[f"{PREFIX}.host"] = row.host
        attributes["server.address"] = row.host
        # A portable inbox's name is no URL: its first gateway's is.
        targets = getattr(item.job, "targets", ())
        for url in (row.inbox, *targets[:1]):
            try:
                parts = addresses.split(url)
            except addresses.UnusableURL:
                continue
            attributes["server.address"] = parts.host
            attributes["server.port"] = parts.port or addresses.DEFAULT_PORTS[parts.scheme]
            break
    return _tracer.start_span(
        f"deliver {row.kind}",
        context=_parent(item.batch.trace_context),
        kind=trace.SpanKind.CLIENT,
        attributes=attributes,
    )


def _parent(trace_context: str) -> context.Context:
    """The context of the span that sent the batch, as the batch kept it: an
    empty one (the attempt's span a root) when it kept none, never the
    context the loop's thread happens to be in."""
    empty = context.Context()
    if not trace_context:
        return empty
    try:
        carrier = json.loads(trace_context)
    except ValueError:
        return empty
    if not isinstance(carrier, dict):
        return empty
    # Only text: what the propagator parses (a column edited by hand must
    # not fail the attempt).
    headers = {name: value for name, value in carrier.items() if isinstance(value, str)}
    return _propagator.extract(headers, context=empty)
