"""OpenTelemetry traces: a span an attempt, the child of the span that sent it.

Real inboxes on loopback and the real loop; the spans are recorded by an
SDK tracer provider of the test's own, put in the place of the package's
tracer for the test alone (a process has one global provider, set once).
"""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import unquote

import pytest
from asgiref.sync import async_to_sync
from django.utils import timezone
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from django_federation_delivery import (
    PortableInbox,
    asend,
    send,
    send_batch,
    send_portable,
    send_webhook,
    tracing,
)
from django_federation_delivery.deliverer import Deliverer
from django_federation_delivery.models import Batch, Delivery, Lane, Status

from .conftest import ROOT, Inbox, Received
from .keys import ALICE
from .operators import open_breaker

#: The deliverer's threads read what the test wrote: committed.
in_the_queue = pytest.mark.django_db(transaction=True)

NOTE = {"@context": "https://www.w3.org/ns/activitystreams", "type": "Create", "actor": ALICE}
TOKEN = "t0psecr3t"
SECRET = "whsec_" + base64.b64encode(b"s" * 32).decode()
#: A request's trace context, as the sending process got it from upstream.
UPSTREAM = {
    "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
    "tracestate": "vendor=opaque",
}


@dataclasses.dataclass
class Traces:
    exporter: InMemorySpanExporter
    tracer: trace.Tracer

    def attempts(self) -> list[ReadableSpan]:
        """The attempts' spans, in the order they ended."""
        return [
            span for span in self.exporter.get_finished_spans() if span.name.startswith("deliver ")
        ]


@pytest.fixture
def traces(monkeypatch: pytest.MonkeyPatch) -> Iterator[Traces]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(tracing, "_tracer", provider.get_tracer("django_federation_delivery"))
    yield Traces(exporter, provider.get_tracer("tests"))
    provider.shutdown()


def drain_again() -> None:
    """Whatever waits to be retried, due now, and the queue drained."""
    Delivery.objects.filter(status=Status.PENDING).update(due_at=timezone.now())
    Deliverer().run(drain=True)


def attributes(span: ReadableSpan) -> dict[str, Any]:
    return dict(span.attributes or {})


def everything_told(span: ReadableSpan) -> str:
    """Every text a span holds: its name, attributes and status."""
    return json.dumps(
        [span.name, attributes(span), span.status.description or ""], ensure_ascii=False
    )


@in_the_queue
def test_each_attempt_is_a_span_child_of_the_span_that_sent_it(
    inboxes: Callable[..., Inbox], traces: Traces
) -> None:
    answers = iter([503, 202])
    inbox = inboxes("127.0.0.1", respond=lambda request: (next(answers), {}, b"busy"), delay=0.05)
    upstream = TraceContextTextMapPropagator().extract(UPSTREAM)
    with traces.tracer.start_as_current_span("POST /notes", context=upstream) as request:
        batch = send(ALICE, NOTE, [inbox.url(f"/inbox?token={TOKEN}")])
    assert batch is not None
    sender = request.get_span_context()

    Deliverer().run(drain=True)
    drain_again()

    first, second = traces.attempts()
    for span in (first, second):
        assert span.parent is not None
        assert (span.parent.trace_id, span.parent.span_id) == (sender.trace_id, sender.span_id)
        assert span.context.trace_id == sender.trace_id
        assert span.context.trace_state.to_header() == "vendor=opaque", "tracestate carried"
        assert span.kind is SpanKind.CLIENT
        assert span.name == "deliver activitypub"
        assert span.end_time is not None and span.start_time is not None
        assert span.end_time - span.start_time >= 50_000_000, "as long as the attempt"
        assert TOKEN not in everything_told(span)
        assert "/inbox" not in everything_told(span)
    delivery = Delivery.objects.get()
    assert attributes(first) == {
        "federation_delivery.kind": "activitypub",
        "federation_delivery.lane": Batch.objects.get().lane,
        "federation_delivery.attempt": 1,
        "federation_delivery.delivery_id": delivery.id,
        "federation_delivery.batch_id": batch.id,
        "federation_delivery.host": inbox.host,
        "server.address": "127.0.0.1",
        "server.port": inbox.port,
        "federation_delivery.outcome": "retrying",
        "federation_delivery.requests": 1,
        "http.response.status_code": 503,
    }
    assert first.status.status_code is StatusCode.ERROR
    assert first.status.description == "the inbox answered 503 Service Unavailable: busy"
    assert attributes(second)["federation_delivery.attempt"] == 2
    assert attributes(second)["federation_delivery.outcome"] == "delivered"
    assert attributes(second)["http.response.status_code"] == 202
    assert second.status.status_code is StatusCode.UNSET
    assert delivery.status == Status.DELIVERED


@in_the_queue
def test_without_a_span_at_its_send_an_attempt_is_a_root(inbox: Inbox, traces: Traces) -> None:
    send(ALICE, NOTE, [inbox.url()])
    assert Batch.objects.get().trace_context == ""
    Deliverer().run(drain=True)
    (span,) = traces.attempts()
    assert span.parent is None
    assert attributes(span)["federation_delivery.outcome"] == "delivered"


@in_the_queue
def test_an_awaited_send_carries_the_span_it_was_awaited_in(inbox: Inbox, traces: Traces) -> None:
    with traces.tracer.start_as_current_span("async view") as view:
        async_to_sync(asend)(ALICE, NOTE, [inbox.url()])
    Deliverer().run(drain=True)
    (span,) = traces.attempts()
    assert span.parent is not None and span.parent.span_id == view.get_span_context().span_id


@in_the_queue
def test_an_attempt_that_knocks_twice_is_one_span_of_two_requests(
    inboxes: Callable[..., Inbox], traces: Traces
) -> None:
    def rfc9421_only(request: Received) -> tuple[int, dict[str, str], bytes]:
        return (202 if "Signature-Input" in request.headers else 401), {}, b""

    inbox = inboxes("127.0.0.1", respond=rfc9421_only)
    send(ALICE, NOTE, [inbox.url()])
    Deliverer().run(drain=True)
    (span,) = traces.attempts()
    assert len(inbox.received) == 2
    assert attributes(span)["federation_delivery.requests"] == 2
    assert attributes(span)["federation_delivery.outcome"] == "delivered"
    assert attributes(span)["http.response.status_code"] == 202


@in_the_queue
@pytest.mark.parametrize(
    ("status", "options", "outcome"),
    [(410, {}, "refused"), (503, {"max_attempts": 1}, "failed")],
)
def test_an_attempt_that_ends_a_delivery_unsent_is_an_error_with_its_kept_error(
    inboxes: Callable[..., Inbox],
    traces: Traces,
    status: int,
    options: dict[str, Any],
    outcome: str,
) -> None:
    # The inbox tells its own URL back: the kept error has it redacted, and
    # the span's its path taken out too ("Cannot POST /users/alice/inbox").
    inbox = inboxes(
        "127.0.0.1", respond=lambda request: (status, {}, f"no: {request.path}".encode())
    )
    with traces.tracer.start_as_current_span("job"):
        send_batch(ALICE, NOTE, [inbox.url(f"/inbox?token={TOKEN}")], options)
    Deliverer().run(drain=True)
    (span,) = traces.attempts()
    delivery = Delivery.objects.get()
    assert delivery.status == outcome
    assert attributes(span)["federation_delivery.outcome"] == outcome
    assert attributes(span)["http.response.status_code"] == status
    assert span.status.status_code is StatusCode.ERROR
    assert "/inbox" in delivery.last_error
    assert span.status.description == delivery.last_error.replace("/inbox", "[path]")
    assert TOKEN not in everything_told(span)
    assert "/inbox" not in everything_told(span)


@in_the_queue
def test_a_delivery_held_by_an_open_breaker_has_a_span_without_a_request(
    inbox: Inbox, traces: Traces
) -> None:
    with traces.tracer.start_as_current_span("job") as job:
        send(ALICE, NOTE, [inbox.url()])
    open_breaker(inbox.host)
    Deliverer().run(drain=True)
    (span,) = traces.attempts()
    assert inbox.received == []
    assert span.parent is not None and span.parent.span_id == job.get_span_context().span_id
    assert attributes(span)["federation_delivery.outcome"] == "held"
    assert attributes(span)["federation_delivery.requests"] == 0
    assert "http.response.status_code" not in attributes(span)
    assert span.status.status_code is StatusCode.UNSET


@in_the_queue
def test_a_webhook_span_names_its_destination_and_kind_never_its_url(
    inboxes: Callable[..., Inbox], traces: Traces, settings: Any
) -> None:
    answers = iter([500, 204])

    # The receiver tells the URL it was sent to back, secret and all.
    def respond(request: Received) -> tuple[int, dict[str, str], bytes]:
        return next(answers), {}, f"failed at {request.path}".encode()

    receiver = inboxes("127.0.0.1", respond=respond)
    url = f"http://127.0.0.1:{receiver.port}/hooks/{TOKEN}?secret={SECRET}"
    settings.FEDERATION_DELIVERY = {**settings.FEDERATION_DELIVERY, "WEBHOOKS": {"ops": url}}
    with traces.tracer.start_as_current_span("signup") as signup:
        send_webhook("ops", "user.created", {"name": "Zoë"})

    Deliverer().run(drain=True)
    drain_again()

    # The signing key is its URL's query, never sent; the token in the path is.
    assert [request.path for request in receiver.received] == [f"/hooks/{TOKEN}"] * 2
    first, second = traces.attempts()
    for span in (first, second):
        assert span.parent is not None and span.parent.span_id == signup.get_span_context().span_id
        assert span.name == "deliver webhook"
        told = everything_told(span)
        for secret in (TOKEN, SECRET, SECRET[6:], str(receiver.port), "/hooks"):
            assert secret not in told
    assert attributes(first) == {
        "federation_delivery.kind": "webhook",
        "federation_delivery.lane": Lane.WEBHOOK,
        "federation_delivery.attempt": 1,
        "federation_delivery.delivery_id": Delivery.objects.get().id,
        "federation_delivery.batch_id": Batch.objects.get().id,
        "federation_delivery.host": "ops",
        "federation_delivery.channel": "json",
        "federation_delivery.outcome": "retrying",
        "federation_delivery.requests": 1,
        "http.response.status_code": 500,
    }
    assert first.status.status_code is StatusCode.ERROR
    assert "[redacted]" in (first.status.description or "")
    assert attributes(second)["federation_delivery.outcome"] == "delivered"


@in_the_queue
def test_a_webhook_span_names_not_its_host_when_its_connection_fails(
    traces: Traces, settings: Any
) -> None:
    # "could not connect to 127.0.0.1:PORT" names no URL, and went in whole.
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    url = f"http://127.0.0.1:{port}/hooks/{TOKEN}?secret={SECRET}"
    settings.FEDERATION_DELIVERY = {**settings.FEDERATION_DELIVERY, "WEBHOOKS": {"ops": url}}
    send_webhook("ops", "user.created", {"name": "Zoë"})
    Deliverer().run(drain=True)
    (span,) = traces.attempts()
    assert attributes(span)["federation_delivery.outcome"] == "retrying"
    assert "[host]" in (span.status.description or "")
    assert "127.0.0.1" not in everything_told(span) and str(port) not in everything_told(span)


@in_the_queue
def test_a_span_takes_out_an_inbox_path_echoed_decoded_and_no_text_that_contains_it(
    inboxes: Callable[..., Inbox], traces: Traces
) -> None:
    # "/users/zo%C3%AB/inbox" echoed decoded was left in; an inbox at "/1"
    # had the proxy's "HTTP/1.1" written "HTTP[path].1".
    def respond(request: Received) -> tuple[int, dict[str, str], bytes]:
        text = f"upstream sent no HTTP/1.1 answer; Cannot POST {unquote(request.path)}"
        return 502, {}, text.encode()

    inbox = inboxes("127.0.0.1", respond=respond)
    send_batch(ALICE, NOTE, [inbox.url("/1"), inbox.url("/users/zoë/inbox")], {"max_attempts": 1})
    Deliverer().run(drain=True)
    told = sorted(span.status.description or "" for span in traces.attempts())
    answer = "the inbox answered 502 Bad Gateway: upstream sent no HTTP/1.1 answer"
    assert told == [f"gave up after 1 attempts: {answer}; Cannot POST [path]"] * 2


@in_the_queue
def test_a_span_takes_out_an_inbox_path_echoed_with_a_trailing_slash_or_after_its_host(
    inboxes: Callable[..., Inbox], traces: Traces
) -> None:
    def respond(request: Received) -> tuple[int, dict[str, str], bytes]:
        return 404, {}, f"no route for {request.path}/; try 127.0.0.1{request.path}".encode()

    inbox = inboxes("127.0.0.1", respond=respond)
    send_batch(ALICE, NOTE, [inbox.url("/users/alice/inbox")], {"max_attempts": 1})
    Deliverer().run(drain=True)
    (span,) = traces.attempts()
    assert (span.status.description or "").endswith("no route for [path]/; try 127.0.0.1[path]")


@in_the_queue
def test_a_webhook_span_names_not_its_host_when_the_host_is_an_idn(
    traces: Traces, settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The transport names the host as DNS was asked for it, in punycode.
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    real = socket.getaddrinfo

    def getaddrinfo(host: Any, *args: Any, **kwargs: Any) -> Any:
        return real("127.0.0.1" if host == "xn--bcher-kva.invalid" else host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    url = f"http://bücher.invalid:{port}/hooks/{TOKEN}?secret={SECRET}"
    settings.FEDERATION_DELIVERY = {**settings.FEDERATION_DELIVERY, "WEBHOOKS": {"ops": url}}
    send_webhook("ops", "user.created", {"name": "Zoë"})
    Deliverer().run(drain=True)
    (span,) = traces.attempts()
    told = span.status.description or ""
    assert "[host]" in told and "bcher" not in told and str(port) not in told


@in_the_queue
def test_a_portable_inbox_span_has_its_gateways_host_and_port_apart(
    inbox: Inbox, traces: Traces
) -> None:
    did = "did:key:z6MkhaXgBZDvotDkL5257faiztiGiC2QtKLGpbnnEGta2doK"
    send_portable(ALICE, NOTE, [PortableInbox(f"ap://{did}/actor/inbox", [inbox.url("")])])
    Deliverer().run(drain=True)
    (span,) = traces.attempts()
    assert Delivery.objects.get().status == Status.DELIVERED
    found = attributes(span)
    assert (found["server.address"], found["server.port"]) == ("127.0.0.1", inbox.port)


@pytest.mark.slow
def test_without_opentelemetry_nothing_is_carried_or_traced() -> None:
    # A fresh interpreter in which opentelemetry cannot be imported.
    script = "\n".join(
        [
            "import sys",
            "sys.modules['opentelemetry'] = None",
            "import django",
            "django.setup()",
            "from django_federation_delivery import tracing",
            "assert not tracing.available()",
            "assert tracing.carried() == ''",
            "with tracing.attempting(None):",
            "    pass",
            "tracing.attempted(None, None, None)",
            "print('untraced')",
        ]
    )
    result = subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "DJANGO_SETTINGS_MODULE": "tests.settings"},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert result.stdout.strip() == "untraced"


@in_the_queue
@pytest.mark.parametrize("kind", ["inbox", "webhook"])
def test_the_error_of_an_attempt_that_timed_out_names_no_url_in_its_span(
    inboxes: Callable[..., Inbox], traces: Traces, settings: Any, kind: str
) -> None:
    # The transport names the URL it sent to in a timeout's error, which
    # became the span's status: an inbox's path, a webhook's scheme, host
    # and port ("http://127.0.0.1:45769: no complete answer within 0.5s").
    receiver = inboxes("127.0.0.1", delay=1.5)
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "ATTEMPT_TIMEOUT": 0.5,
        "WEBHOOK_TIMEOUT": 0.5,
        "WEBHOOKS": {"ops": f"http://127.0.0.1:{receiver.port}/hooks/{TOKEN}?secret={SECRET}"},
    }
    if kind == "inbox":
        send(ALICE, NOTE, [receiver.url(f"/users/alice/inbox?token={TOKEN}")])
    else:
        send_webhook("ops", "user.created", {"name": "Zoë"})
    Deliverer().run(drain=True)
    (span,) = traces.attempts()
    assert attributes(span)["federation_delivery.outcome"] == "retrying"
    told = everything_told(span)
    assert "[url]: no complete answer within 0.5s" in told, told
    # An inbox's host is its span's, as its attributes say; a webhook's never.
    named = [TOKEN, "/users/alice/inbox"] + ([f"{receiver.port}"] if kind == "webhook" else [])
    for secret in named:
        assert secret not in told, f"{secret!r} in {told}"
