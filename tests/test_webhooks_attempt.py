"""One webhook attempt, with HTTP faked by ``responses``: what is sent, and how
each answer is judged and told without the URL."""

from __future__ import annotations

import base64
import datetime as dt
import ipaddress
import json
import logging
import re
import socket
import time
from collections.abc import Iterator

import pytest
import requests
import responses

from django_federation_delivery.attempt import AttemptResult
from django_federation_delivery.channels import Call
from django_federation_delivery.channels.base import is_refusal, safe_text
from django_federation_delivery.channels.slack import Slack
from django_federation_delivery.settling import Summary
from django_federation_delivery.transport import Transport, TransportSettings, status_text
from django_federation_delivery.webhooks import Event, parse_destination
from django_federation_delivery.webhooks.deliveries import WebhookDeliveries
from django_federation_delivery.webhooks.policy import WebhookPolicy

from .conftest import HOSTILE_ANSWER, HOSTILE_ANSWER_ESCAPED, Inbox

SLACK = "slack://hooks.slack.com/services/T0AAAA1/B0BBBB2/s3cretT0kenV4lue9"
SENT_TO = "https://hooks.slack.com/services/T0AAAA1/B0BBBB2/s3cretT0kenV4lue9"
SECRETS = ("T0AAAA1", "B0BBBB2", "s3cretT0kenV4lue9", "/services/")
EVENT = Event.of("alert.raised", "evt-1", dt.datetime(2026, 1, 2, tzinfo=dt.UTC), {"host": "db1"})


@pytest.fixture
def transport() -> Iterator[Transport]:
    transport = Transport(TransportSettings(user_agent="tests"))
    yield transport
    transport.close()


@pytest.fixture
def mocked() -> Iterator[responses.RequestsMock]:
    with responses.RequestsMock(assert_all_requests_are_fired=False) as mock:
        yield mock


def job(url: str = SLACK, **call: object) -> Call:
    values: dict[str, object] = {"destination": parse_destination("ops", url), "event": EVENT}
    values.update(call)
    return Call(delivery_id=1, **values)  # type: ignore[arg-type]


def attempt(job: Call, transport: Transport) -> AttemptResult:
    """The attempt the loop has made: by the destination's kind, none for a
    job with a problem."""
    policy = WebhookPolicy()
    deliveries = WebhookDeliveries(policy, policy.settler(Summary()), transport.settings)
    return deliveries.attempt(job, transport)


def no_secret(text: str) -> bool:
    return not any(secret in text for secret in SECRETS)


def test_a_2xx_is_delivered_with_the_destinations_request_unsigned(
    mocked: responses.RequestsMock, transport: Transport
) -> None:
    mocked.post(SENT_TO, status=200, body="ok")
    result = attempt(job(), transport)
    assert result.delivered and result.status == 200 and result.error == ""
    request = mocked.calls[0].request
    assert json.loads(request.body) == {"text": "alert.raised\nhost: db1"}
    assert "Signature" not in request.headers and "Signature-Input" not in request.headers
    assert len(mocked.calls) == 1


@pytest.mark.parametrize("status", [400, 401, 403, 404, 422])
def test_a_4xx_is_refused_for_good_and_its_body_kept_without_the_url(
    mocked: responses.RequestsMock, transport: Transport, status: int
) -> None:
    mocked.post(SENT_TO, status=status, body=f"no_service\n  at {SENT_TO}\n")
    result = attempt(job(), transport)
    assert not result.delivered and result.permanent and result.status == status
    # The hook's path is its credential; the host is not.
    assert result.error == (
        f"the receiver answered {status_text(status)}: no_service at https://hooks.slack.com[redacted]"
    )
    assert len(mocked.calls) == 1  # no double knocking


def test_a_410_is_not_the_events_refusal_but_a_hold_its_destination_is_disabled_for(
    mocked: responses.RequestsMock, transport: Transport
) -> None:
    mocked.post(SENT_TO, status=410, body="hook deleted")
    result = attempt(job(), transport)
    assert (result.delivered, result.permanent, result.held) == (False, False, True)
    assert (result.status, result.requests) == (410, 1)
    assert result.error == "the receiver answered 410 Gone: hook deleted"


@pytest.mark.parametrize("status", [408, 429, 500, 502, 503, 504, 301, 302])
def test_408_429_5xx_and_redirects_are_retried(
    mocked: responses.RequestsMock, transport: Transport, status: int
) -> None:
    mocked.post(SENT_TO, status=status, headers={"Location": "https://elsewhere.example/"})
    result = attempt(job(), transport)
    assert not result.delivered and not result.permanent
    assert result.error == f"the receiver answered {status_text(status)}"
    assert len(mocked.calls) == 1


def test_refusals_are_4xx_but_408_and_429() -> None:
    assert [code for code in range(100, 600) if is_refusal(code)] == [
        code for code in range(400, 500) if code not in (408, 429)
    ]


def test_the_first_300_characters_of_a_refusals_body_are_kept_in_one_line(
    mocked: responses.RequestsMock, transport: Transport
) -> None:
    mocked.post(SENT_TO, status=404, body="word\n" * 200)
    result = attempt(job(), transport)
    kept = " ".join(["word"] * 200)[:300]
    assert len(kept) == 300
    assert result.error == "the receiver answered 404 Not Found: " + kept.rstrip()
    assert "\n" not in result.error


def test_a_receivers_escape_sequences_are_kept_escaped_never_raw(
    mocked: responses.RequestsMock, transport: Transport
) -> None:
    mocked.post(SENT_TO, status=500, body=HOSTILE_ANSWER)
    result = attempt(job(), transport)
    assert result.error == (
        "the receiver answered 500 Internal Server Error: " + HOSTILE_ANSWER_ESCAPED
    )
    assert result.error.isprintable()


@pytest.mark.parametrize(
    ("header", "expected"), [("120", 120.0), (" 0 ", 0.0), ("-5", None), ("soon", None)]
)
def test_retry_after_is_taken_in_seconds_only(
    mocked: responses.RequestsMock, transport: Transport, header: str, expected: float | None
) -> None:
    mocked.post(SENT_TO, status=429, headers={"Retry-After": header})
    assert attempt(job(), transport).retry_after == expected


def test_an_http_date_in_retry_after_is_not_taken(
    mocked: responses.RequestsMock, transport: Transport
) -> None:
    mocked.post(SENT_TO, status=503, headers={"Retry-After": "Wed, 21 Oct 2099 07:28:00 GMT"})
    assert attempt(job(), transport).retry_after is None


def test_a_network_error_is_retried_and_told_with_the_scheme_and_host_only(
    mocked: responses.RequestsMock, transport: Transport
) -> None:
    mocked.post(SENT_TO, body=requests.ConnectionError(f"boom talking to {SENT_TO}"))
    result = attempt(job(), transport)
    assert not result.delivered and not result.permanent and result.status is None
    assert result.error.startswith("https://hooks.slack.com: ")
    assert no_secret(result.error)


def test_a_hook_s_path_its_receiver_echoes_after_a_malformed_header_reaches_no_log(
    inbox: Inbox, caplog: pytest.LogCaptureFixture
) -> None:
    # "X Powered By PHP" is no header's name: urllib3 parses no line past it,
    # and warns with them, the echoed path among them, and a traceback.
    inbox.respond = lambda request: (
        200,
        {"Connection": "close", "X Powered By PHP": "yes", "Content-Location": request.path},
        b"ok",
    )
    url = f"slack+http://{inbox.host}/services/T0AAAA1/B0BBBB2/s3cretT0kenV4lue9"
    settings = TransportSettings(
        user_agent="tests", allowed_networks=(ipaddress.ip_network("127.0.0.0/8"),)
    )
    with caplog.at_level(logging.DEBUG), Transport(settings) as transport:
        result = attempt(job(url), transport)

    assert result.delivered
    assert any("Failed to parse headers" in record.getMessage() for record in caplog.records)
    formatter = logging.Formatter("%(message)s")
    assert all(no_secret(formatter.format(record)) for record in caplog.records)


def test_safe_text_leaves_scheme_and_host_of_a_telegram_bot_url() -> None:
    destination = parse_destination("tg", "telegram://123456:ABCdefSECRET_tok@-1001")
    url = destination.url
    text = safe_text(destination, url, f"{url.split('/sendMessage')[0]}/sendMessage: timed out")
    assert text == "https://api.telegram.org: timed out"


def test_a_destination_that_does_not_parse_is_retried_without_a_request(
    mocked: responses.RequestsMock, transport: Transport
) -> None:
    result = attempt(
        job(destination=None, problem="Webhook destination 'ops': its URL has no host."), transport
    )
    assert not result.permanent and result.requests == 0 and not mocked.calls
    assert result.error == "Webhook destination 'ops': its URL has no host."


def test_a_template_that_raises_is_retried_and_named_by_its_type_only(
    mocked: responses.RequestsMock, transport: Transport, settings: object
) -> None:
    from unittest import mock

    with mock.patch.object(Slack, "request", side_effect=RuntimeError(SENT_TO)):
        result = attempt(job(), transport)
    assert result.error == "the event could not be written for ops: RuntimeError"
    assert not result.permanent and result.requests == 0 and not mocked.calls


MATRIX = "matrix://syt_matrixAccessToken42@matrix.example/!RoomIdAbc:example.org"
MATRIX_SENT_TO = re.compile(
    re.escape(
        "https://matrix.example/_matrix/client/v3/rooms/%21RoomIdAbc%3Aexample.org"
        "/send/m.room.message/evt-1."
    )
    + "[0-9a-f]{16}$"
)


def test_a_matrix_message_is_put_and_delivered(
    mocked: responses.RequestsMock, transport: Transport
) -> None:
    mocked.put(MATRIX_SENT_TO, status=200, json={"event_id": "$abc"})
    result = attempt(job(MATRIX), transport)
    assert result.delivered and result.status == 200
    (call,) = mocked.calls
    assert call.request.method == "PUT"


def test_a_homeserver_s_rate_limit_is_waited_as_its_body_asks(
    mocked: responses.RequestsMock, transport: Transport
) -> None:
    body = {"errcode": "M_LIMIT_EXCEEDED", "retry_after_ms": 2500}
    mocked.put(MATRIX_SENT_TO, status=429, json=body)
    result = attempt(job(MATRIX), transport)
    assert not result.delivered and not result.permanent
    assert result.retry_after == 2.5
    assert "syt_matrixAccessToken42" not in result.error


DISCORD = "discord://discord.com/api/webhooks/1234/token-token-token"
DISCORD_SENT_TO = "https://discord.com/api/v10/webhooks/1234/token-token-token"


@pytest.mark.parametrize(
    "headers",
    [{"Retry-After": "45.5", "X-RateLimit-Reset-After": "45.5"}, {}],
    ids=["decimal-retry-after", "no-retry-after"],
)
def test_discord_s_rate_limit_is_waited_as_its_body_asks(
    mocked: responses.RequestsMock, transport: Transport, headers: dict[str, str]
) -> None:
    # Its wait is in its body, in seconds with decimals; a Retry-After with
    # decimals, or none, was read as no wait, and the retry met a 429 again.
    body = {"message": "You are being rate limited.", "retry_after": 45.5, "global": False}
    mocked.post(DISCORD_SENT_TO, status=429, json=body, headers=headers)
    result = attempt(job(DISCORD), transport)
    assert not result.delivered and not result.permanent
    assert result.retry_after == 45.5
    assert "token-token" not in result.error


TELEGRAM = "telegram://123456:ABCdefSECRETtok_en@-1001234567890"
TELEGRAM_SENT_TO = "https://api.telegram.org/bot123456:ABCdefSECRETtok_en/sendMessage"


def test_telegram_s_rate_limit_is_waited_as_its_body_asks(
    mocked: responses.RequestsMock, transport: Transport
) -> None:
    # The Bot API says how long to wait in its body, and sends no Retry-After.
    body = {
        "ok": False,
        "error_code": 429,
        "description": "Too Many Requests: retry after 41",
        "parameters": {"retry_after": 41},
    }
    mocked.post(TELEGRAM_SENT_TO, status=429, json=body)
    result = attempt(job(TELEGRAM), transport)
    assert not result.delivered and not result.permanent
    assert result.retry_after == 41.0
    assert "SECRETtok_en" not in result.error


@pytest.mark.parametrize(
    ("body", "refused", "retry_after"),
    [
        ({"ok": False, "error_code": 400, "description": "chat not found"}, True, None),
        ({"ok": False, "error_code": 429, "parameters": {"retry_after": 7}}, False, 7.0),
        ({"ok": False, "error_code": 502}, False, None),
        ("<html>a proxy's page</html>", False, None),
        ([{"ok": True}], False, None),
    ],
    ids=["chat not found", "rate limited", "bad gateway", "no json", "a list"],
)
def test_a_telegram_2xx_that_does_not_say_ok_is_not_delivered(
    mocked: responses.RequestsMock,
    transport: Transport,
    body: object,
    refused: bool,
    retry_after: float | None,
) -> None:
    # The Bot API says whether it sent the message in its body's "ok": a Bot
    # API server or a proxy (?api=) that answered 200 with "ok": false (the
    # chat not found) had the event settled delivered, the alert lost unsaid.
    text = body if isinstance(body, str) else json.dumps(body)
    mocked.post(TELEGRAM_SENT_TO, status=200, body=text)
    result = attempt(job(TELEGRAM), transport)
    assert not result.delivered
    assert result.permanent is refused and result.retry_after == retry_after
    assert text[:20] in result.error and "SECRETtok_en" not in result.error


def test_a_telegram_ok_cut_to_the_answer_s_most_bytes_is_delivered(
    mocked: responses.RequestsMock,
) -> None:
    # The Bot API's answer repeats the message sent: cut to MAX_ANSWER_BYTES
    # it was no JSON, the message taken as not sent, and sent again and again.
    answer = {"ok": True, "result": {"message_id": 1, "text": "y" * 3000}}
    mocked.post(TELEGRAM_SENT_TO, status=200, json=answer)
    transport = Transport(TransportSettings(user_agent="tests", max_answer_bytes=1024))
    try:
        assert attempt(job(TELEGRAM), transport).delivered
    finally:
        transport.close()


def test_a_telegram_2xx_that_says_ok_is_delivered(
    mocked: responses.RequestsMock, transport: Transport
) -> None:
    mocked.post(TELEGRAM_SENT_TO, status=200, json={"ok": True, "result": {"message_id": 1}})
    assert attempt(job(TELEGRAM), transport).delivered


@pytest.mark.parametrize(
    "body",
    [
        {"parameters": {"retry_after": -5}},
        {"parameters": {"retry_after": "41"}},
        {"parameters": {"retry_after": True}},
        {"parameters": {"retry_after": 10**400}},
        {"parameters": {"retry_after": 86_400 * 365}},
        {"parameters": [41]},
        {"retry_after": 41},
    ],
    ids=["negative", "text", "bool", "huge", "a year", "a list", "elsewhere"],
)
def test_a_rate_limit_whose_body_asks_no_wait_it_can_mean_is_retried_as_any_429(
    mocked: responses.RequestsMock, transport: Transport, body: object
) -> None:
    mocked.post(TELEGRAM_SENT_TO, status=429, body=json.dumps(body))
    result = attempt(job(TELEGRAM), transport)
    assert not result.delivered and not result.permanent
    assert result.retry_after is None


def test_a_retry_after_header_is_what_a_rate_limit_waits_when_both_say(
    mocked: responses.RequestsMock, transport: Transport
) -> None:
    body = {"ok": False, "parameters": {"retry_after": 41}}
    mocked.post(TELEGRAM_SENT_TO, status=429, json=body, headers={"Retry-After": "7"})
    assert attempt(job(TELEGRAM), transport).retry_after == 7.0


@pytest.mark.parametrize(
    "body",
    [
        b'{"retry_after_ms": 1' + b"0" * 400 + b"}",  # too big for a float
        b"[" * 100_000 + b"]" * 100_000,  # deeper than the parser goes
    ],
    ids=["huge number", "deep nesting"],
)
def test_a_homeserver_s_unreadable_rate_limit_is_retried_as_any_429(
    mocked: responses.RequestsMock, transport: Transport, body: bytes
) -> None:
    mocked.put(MATRIX_SENT_TO, status=429, body=body)
    result = attempt(job(MATRIX), transport)
    assert not result.delivered and not result.permanent
    assert result.retry_after is None


def test_a_kind_that_fails_inside_a_200_is_retried_with_what_it_said(
    mocked: responses.RequestsMock, transport: Transport, settings: object
) -> None:
    settings.FEDERATION_DELIVERY = {  # type: ignore[attr-defined]
        **settings.FEDERATION_DELIVERY,  # type: ignore[attr-defined]
        "CHANNELS": ["tests.channels.Pager"],
    }
    mocked.post("https://pager.example/v2/enqueue", status=200, json={"status": "error"})
    result = attempt(job("pager://routingKEY123@pager.example/v2/enqueue"), transport)
    assert not result.delivered and not result.permanent
    assert result.error == 'the receiver answered 200 OK: {"status": "error"}'


def test_an_attempt_whose_lease_is_spent_is_not_made(
    mocked: responses.RequestsMock, transport: Transport
) -> None:
    # Made now, it could still be in flight when the lease lapses and another
    # deliverer takes the event and sends it again, with the same webhook-id.
    mocked.post(SENT_TO, status=200, body="ok")
    result = attempt(job(lease_deadline=time.monotonic() - 0.01), transport)
    assert len(mocked.calls) == 0
    assert (result.delivered, result.permanent, result.held, result.requests) == (
        False,
        False,
        True,
        0,
    )
    assert result.error == "not sent: its lease ran out before a worker was free"


@pytest.mark.slow
def test_an_attempt_ends_when_its_lease_does_however_long_the_webhook_timeout() -> None:
    # Accepts connections (the kernel does) and never answers.
    with socket.create_server(("127.0.0.1", 0)) as silent:
        secret = "whsec_" + base64.b64encode(b"k" * 32).decode()
        url = f"http://127.0.0.1:{silent.getsockname()[1]}/hook?secret={secret}"
        settings = TransportSettings(
            user_agent="tests",
            attempt_timeout=25.0,
            allowed_networks=(ipaddress.ip_network("127.0.0.0/8"),),
        )
        transport = Transport(settings)
        try:
            start = time.monotonic()
            result = attempt(job(url, lease_deadline=start + 1.5), transport)
            elapsed = time.monotonic() - start
        finally:
            transport.close()

    assert 1.4 < elapsed < 8, "over with the lease, not WEBHOOK_TIMEOUT"
    assert (result.delivered, result.permanent, result.status) == (False, False, None)
    # The time the request had, the lease's rest when it began.
    given = re.search(r"no complete answer within ([0-9.]+)s$", result.error)
    assert given is not None, result.error
    assert 1.2 <= float(given.group(1)) <= 1.5


PASSWORD = "hunter2Passw0rdXY"
BASIC = base64.b64encode(f"alice:{PASSWORD}".encode()).decode()
SIGNING_KEY = "whsec_" + "QUJDREVGR0hJSktMTU5PUFFSU1RVVldYWVo0NTY3ODk="


@pytest.mark.parametrize(
    ("url", "sent_to"),
    [
        (
            f"https://alice:{PASSWORD}@receiver.example/hooks?secret={SIGNING_KEY}",
            f"https://alice:{PASSWORD}@receiver.example/hooks",
        ),
        (
            f"markdown://alice:{PASSWORD}@chat.example/hooks/abcdefkey123",
            f"https://alice:{PASSWORD}@chat.example/hooks/abcdefkey123",
        ),
    ],
)
def test_a_password_in_a_destinations_url_is_sent_but_never_redacted(
    mocked: responses.RequestsMock, transport: Transport, url: str, sent_to: str
) -> None:
    """A receiver behind HTTP basic auth, https://user:password@host/...: the
    password is sent (``Authorization: Basic``), and when the receiver's
    refusal echoed it, plain or in its Basic form, it was kept whole in the
    delivery's last error, the WARNING line and ``delivery_failed``."""
    mocked.post(
        sent_to,
        status=401,
        body=f"bad credentials alice:{PASSWORD} (Authorization: Basic {BASIC})",
    )
    policy = WebhookPolicy()
    deliveries = WebhookDeliveries(policy, policy.settler(Summary()), transport.settings)
    destination = parse_destination("ops", url)
    call = Call(delivery_id=1, destination=destination, event=EVENT)
    result = deliveries.attempt(call, transport)
    assert mocked.calls[0].request.headers["Authorization"] == f"Basic {BASIC}", "it is sent"
    assert result.error.startswith("the receiver answered 401")
    assert PASSWORD not in result.error, result.error
    assert BASIC not in result.error, result.error


def test_a_non_ascii_password_echoed_in_its_sent_basic_form_is_redacted(
    mocked: responses.RequestsMock, transport: Transport
) -> None:
    """A receiver behind basic auth whose password has an accented letter
    (``https://alice:p%C3%A4sswort42@…``): requests sends it in Latin-1,
    ``Authorization: Basic YWxpY2U6cORzc3dvcnQ0Mg==``, and a refusal echoing
    that header is kept whole in the delivery's error (the redaction
    encoded its Basic form in UTF-8, a text never sent)."""
    url = "markdown://alice:p%C3%A4sswort42@receiver.example/hooks/abcdefkey123"
    mocked.add_callback(
        responses.POST,
        "https://alice:p%C3%A4sswort42@receiver.example/hooks/abcdefkey123",
        callback=lambda request: (
            401,
            {},
            f"bad credentials (Authorization: {request.headers['Authorization']})",
        ),
    )
    policy = WebhookPolicy()
    deliveries = WebhookDeliveries(policy, policy.settler(Summary()), transport.settings)
    destination = parse_destination("ops", url)
    call = Call(delivery_id=1, destination=destination, event=EVENT)
    result = deliveries.attempt(call, transport)
    sent = mocked.calls[0].request.headers["Authorization"]
    assert sent == "Basic " + base64.b64encode("alice:pässwort42".encode("latin-1")).decode()
    assert result.error.startswith("the receiver answered 401")
    assert sent.split()[1] not in result.error, result.error


def test_a_short_password_echoed_alone_is_redacted(
    mocked: responses.RequestsMock, transport: Transport
) -> None:
    """A receiver behind basic auth with a short password (a PIN,
    ``https://alice:4821@…``) that echoes it alone ("wrong password 4821")
    had it kept whole in the delivery's error: a short secret is taken out
    where it stands alone, but not one a longer declared form holds, and
    ``alice:4821`` was declared too."""
    url = "markdown://alice:4821@receiver.example/hooks/abcdefkey123"
    mocked.add(
        responses.POST,
        "https://alice:4821@receiver.example/hooks/abcdefkey123",
        status=401,
        body="wrong password 4821 for this hook",
    )
    policy = WebhookPolicy()
    deliveries = WebhookDeliveries(policy, policy.settler(Summary()), transport.settings)
    destination = parse_destination("ops", url)
    call = Call(delivery_id=1, destination=destination, event=EVENT)
    result = deliveries.attempt(call, transport)
    assert result.error.startswith("the receiver answered 401"), result.error
    assert "4821" not in result.error, result.error
