"""An attempt at an ActivityPub inbox, HTTP faked by ``responses``: signing, knocking, judging."""

from __future__ import annotations

import ipaddress
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import pytest
import responses
from cryptography.hazmat.primitives.asymmetric import rsa

from django_federation_delivery.attempt import AttemptResult, permanent_status
from django_federation_delivery.channels import Channel, Destination, UnusableURL
from django_federation_delivery.channels.activitypub import ActivityPub, InboxJob
from django_federation_delivery.conf import DEFAULTS, app_settings
from django_federation_delivery.exceptions import SigningError
from django_federation_delivery.health import is_failure
from django_federation_delivery.signatures import Scheme, SenderKey, body_sha256
from django_federation_delivery.transport import (
    LONGEST_ASKED,
    Answer,
    Transport,
    TransportSettings,
    status_text,
)

from .conftest import HOSTILE_ANSWER, HOSTILE_ANSWER_ESCAPED, Inbox
from .keys import ed25519_key, rsa_key

INBOX = "https://remote.example/users/bob/inbox"
BODY = b'{"type":"Create"}'


@pytest.fixture
def transport() -> Iterator[Transport]:
    transport = Transport(TransportSettings(user_agent="tests"))
    yield transport
    transport.close()


@pytest.fixture
def mocked() -> Iterator[responses.RequestsMock]:
    with responses.RequestsMock(assert_all_requests_are_fired=False) as mock:
        yield mock


ALICE_KEY = object()


def job(key: object = ALICE_KEY, **fields: object) -> InboxJob:
    if key is ALICE_KEY:
        key = SenderKey("https://social.example/users/alice#main-key", rsa_key())
    values: dict[str, object] = {
        "delivery_id": 1,
        "targets": (INBOX,),
        "body": BODY,
        "body_sha256": body_sha256(BODY),
        "key": key,
        "sender": "https://social.example/users/alice",
        "scheme": Scheme.CAVAGE,
    }
    values.update(fields)
    return InboxJob(**values)  # type: ignore[arg-type]


def attempt(job: InboxJob, transport: Transport, *, error_length: int = 300) -> AttemptResult:
    return ActivityPub(error_length=error_length).attempt(job, transport)


def schemes_used(mocked: responses.RequestsMock) -> list[str]:
    return [
        "rfc9421" if "Signature-Input" in call.request.headers else "draft-cavage"
        for call in mocked.calls
    ]


def test_a_2xx_is_delivered_and_the_scheme_remembered(
    mocked: responses.RequestsMock, transport: Transport
) -> None:
    mocked.post(INBOX, status=202)
    result = attempt(job(), transport)
    assert (result.delivered, result.status, result.accepted_scheme) == (True, 202, Scheme.CAVAGE)
    sent = mocked.calls[0].request
    assert sent.body == BODY
    assert sent.headers["Digest"].startswith("SHA-256=")
    assert sent.headers["Content-Type"] == "application/activity+json"


@pytest.mark.parametrize(
    ("status", "permanent"),
    [
        (400, True),
        (403, True),
        (404, True),
        (410, True),
        (422, True),
        (408, False),
        (429, False),
        (500, False),
        (502, False),
        (503, False),
    ],
)
def test_4xx_but_408_and_429_is_final_and_the_rest_is_worth_another_try(
    mocked: responses.RequestsMock, transport: Transport, status: int, permanent: bool
) -> None:
    mocked.post(INBOX, status=status, body="nope")
    result = attempt(job(), transport)
    assert (result.delivered, result.status, result.permanent) == (False, status, permanent)
    assert result.error == f"the inbox answered {status_text(status)}: nope"
    assert permanent_status(status) is permanent


def test_retry_after_is_read_from_the_answer(
    mocked: responses.RequestsMock, transport: Transport
) -> None:
    mocked.post(INBOX, status=503, headers={"Retry-After": "90"})
    assert attempt(job(), transport).retry_after == 90


@pytest.mark.parametrize("status", [202, 503])
def test_a_retry_after_of_thousands_of_digits_is_the_longest_ask_and_no_error(
    mocked: responses.RequestsMock, transport: Transport, status: int
) -> None:
    # Past 4,300 digits int() raises: an accepted answer read as a crash
    # would be sent again. Not understood, the longest ask would be retried
    # soonest: it asks as long as can be said, cut to the policy's longest.
    mocked.post(INBOX, status=status, headers={"Retry-After": "9" * 5000})
    result = attempt(job(), transport)
    asked = None if status == 202 else LONGEST_ASKED
    assert (result.delivered, result.retry_after) == (status == 202, asked)


def test_an_inboxs_escape_sequences_are_kept_escaped_never_raw(
    mocked: responses.RequestsMock, transport: Transport
) -> None:
    mocked.post(INBOX, status=500, body=HOSTILE_ANSWER)
    result = attempt(job(), transport)
    assert result.error == (
        "the inbox answered 500 Internal Server Error: " + HOSTILE_ANSWER_ESCAPED
    )


def test_only_the_start_of_a_long_answer_is_kept_as_the_error(
    mocked: responses.RequestsMock, transport: Transport
) -> None:
    mocked.post(INBOX, status=500, body="<html>" + "x" * 10_000)
    result = attempt(job(), transport, error_length=300)
    assert len(result.error) == 300
    assert result.error.startswith("the inbox answered 500 Internal Server Error: <html>xxx")


def test_a_401_in_one_scheme_is_tried_at_once_in_the_other(
    mocked: responses.RequestsMock, transport: Transport
) -> None:
    mocked.post(INBOX, status=401)
    mocked.post(INBOX, status=202)
    result = attempt(job(), transport)
    assert schemes_used(mocked) == ["draft-cavage", "rfc9421"]
    assert (result.delivered, result.accepted_scheme, result.requests) == (True, Scheme.RFC9421, 2)


def test_a_host_that_refuses_both_schemes_is_knocked_on_twice_only(
    mocked: responses.RequestsMock, transport: Transport
) -> None:
    mocked.post(INBOX, status=401)
    result = attempt(job(scheme=Scheme.RFC9421), transport)
    assert schemes_used(mocked) == ["rfc9421", "draft-cavage"]
    assert (result.delivered, result.permanent, result.status) == (False, True, 401)


def test_a_503_is_not_knocked_on_again(
    mocked: responses.RequestsMock, transport: Transport
) -> None:
    mocked.post(INBOX, status=503)
    attempt(job(), transport)
    assert len(mocked.calls) == 1


def test_an_ed25519_key_signs_with_rfc9421_only(
    mocked: responses.RequestsMock, transport: Transport
) -> None:
    mocked.post(INBOX, status=401)
    key = SenderKey("https://social.example/users/edna#ed25519-key", ed25519_key())
    result = attempt(job(key=key), transport)
    assert schemes_used(mocked) == ["rfc9421"], "draft-cavage cannot carry Ed25519"
    assert 'alg="ed25519"' in mocked.calls[0].request.headers["Signature-Input"]
    assert result.permanent


def test_no_key_is_refused_and_a_key_store_failure_is_retried(
    mocked: responses.RequestsMock, transport: Transport
) -> None:
    gone = attempt(job(key=None), transport)
    assert (gone.permanent, gone.error) == (
        True,
        "no key for sender https://social.example/users/alice",
    )
    # A sender written before a send refused control characters in it.
    odd = attempt(job(key=None, sender="https://social.example/\x1b[2Jalice"), transport)
    assert odd.error == "no key for sender https://social.example/\\x1b[2Jalice"
    away = attempt(job(key_error="the sender's key could not be looked up: OSError"), transport)
    assert (away.permanent, away.delivered) == (False, False)
    assert len(mocked.calls) == 0, "nothing is sent unsigned"


class ServiceKey(rsa.RSAPrivateKey):
    """A key kept by a key service (a cloud KMS's, an HSM's), as its binding
    gives one: its ``sign()`` calls the service, which may be away."""

    def __init__(self) -> None:
        self._key = rsa_key()

    def sign(self, data: Any, padding: Any, algorithm: Any) -> bytes:
        raise ConnectionError("kms.internal:443 unreachable, token=s3cr3t-kms-token")

    def public_key(self) -> rsa.RSAPublicKey:
        return self._key.public_key()

    @property
    def key_size(self) -> int:
        return self._key.key_size

    def decrypt(self, *args: Any) -> bytes:
        raise NotImplementedError

    def private_numbers(self) -> Any:
        raise NotImplementedError

    def private_bytes(self, *args: Any) -> bytes:
        raise NotImplementedError

    def __copy__(self) -> ServiceKey:
        return self

    def __deepcopy__(self, memo: Any) -> ServiceKey:
        return self


def test_a_key_service_away_is_tried_again_and_says_nothing_of_the_inbox_s_host(
    mocked: responses.RequestsMock, transport: Transport
) -> None:
    # It crashed the attempt, counted as the host's failure (no answer): its
    # breaker opened, holding other senders' deliveries to a healthy host.
    key = SenderKey("https://social.example/users/alice#main-key", ServiceKey())
    result = attempt(job(key=key), transport)
    assert (result.delivered, result.permanent, result.requests) == (False, False, 0)
    assert result.error == "the sender's key could not sign: ConnectionError"
    assert is_failure(result) is None
    assert len(mocked.calls) == 0


@pytest.mark.parametrize(
    "fields",
    [
        {"key": SenderKey("https://social.example/users/zo\u00eb#main-key", rsa_key())},
        {"extra_headers": {"Collection-Synchronization": "a\nb"}},
        {"targets": ("ftp://remote.example/inbox",)},
    ],
    ids=["key id", "header", "target"],
)
def test_what_cannot_be_signed_is_refused_for_good_with_no_request_counted(
    mocked: responses.RequestsMock, transport: Transport, fields: dict[str, Any]
) -> None:
    result = attempt(job(**fields), transport)
    assert (result.delivered, result.permanent, result.requests) == (False, True, 0)
    assert len(mocked.calls) == 0


@pytest.mark.parametrize(
    ("raised", "final"),
    [
        (SigningError("cannot be signed in draft-cavage"), True),
        # Its key's service away a moment: the draft-cavage knock may yet be
        # taken, so the 401 is not final (the delivery was failed for good).
        (ConnectionError("kms.internal:443 unreachable"), False),
    ],
    ids=["for good", "for now"],
)
def test_a_second_knock_that_cannot_be_signed_leaves_the_first_answer_standing(
    mocked: responses.RequestsMock,
    transport: Transport,
    monkeypatch: pytest.MonkeyPatch,
    raised: Exception,
    final: bool,
) -> None:
    from django_federation_delivery.channels import activitypub

    signed = activitypub.signed_request

    def rfc9421_only(job: InboxJob, key: SenderKey, target: str, scheme: Scheme) -> Any:
        if scheme is Scheme.CAVAGE:
            raise raised
        return signed(job, key, target, scheme)

    monkeypatch.setattr(activitypub, "signed_request", rfc9421_only)
    mocked.post(INBOX, status=401)
    result = attempt(job(scheme=Scheme.RFC9421), transport)
    assert (result.status, result.requests, result.permanent) == (401, 1, final)
    assert schemes_used(mocked) == ["rfc9421"]


def test_a_connection_failure_is_worth_another_try(
    mocked: responses.RequestsMock, transport: Transport
) -> None:
    import requests

    mocked.post(INBOX, body=requests.ConnectionError("reset by peer"))
    result = attempt(job(), transport)
    assert (result.delivered, result.status, result.permanent) == (False, None, False)
    assert result.error


def test_an_invalid_url_is_refused_for_good(transport: Transport) -> None:
    result = attempt(job(targets=("ftp://remote.example/inbox",)), transport)
    assert (result.delivered, result.permanent) == (False, True)


def test_an_inbox_not_sent_to_for_its_url_or_its_signature_says_nothing_of_its_host(
    mocked: responses.RequestsMock, transport: Transport
) -> None:
    # A key id that cannot be quoted in a signature: the sender's fault, not the inbox's.
    unquotable = SenderKey('https://social.example/"x"', rsa_key())
    for result in (
        attempt(job(targets=("ftp://remote.example/inbox",)), transport),
        attempt(job(key=unquotable), transport),
    ):
        assert (result.delivered, result.permanent, result.requests) == (False, True, 0)
        # No request, so nothing of its host's health (nor a time for the metrics).
        assert is_failure(result) is None
    assert len(mocked.calls) == 0


def test_an_inbox_refused_for_its_address_says_nothing_of_its_host(inbox: Inbox) -> None:
    # The guard refused it before connecting: no request was made, though
    # one was counted, and its host was counted failing.
    with Transport(TransportSettings(user_agent="tests")) as transport:
        result = attempt(job(targets=(inbox.url(),)), transport)
    assert "not a public address" in result.error
    assert (result.delivered, result.permanent, result.requests) == (False, True, 0)
    assert is_failure(result) is None
    assert inbox.connections == 0


def test_a_later_gateway_refused_for_its_address_leaves_the_first_one_s_failure_standing(
    inboxes: Callable[..., Inbox],
) -> None:
    # The first gateway, which stands for the delivery's host, answered 503;
    # a later one (anyone may list one) on a refused address made the attempt
    # "answered elsewhere", its error the refusal: the host's 503 counted
    # nowhere (its breaker, health, limit, rest).
    first = inboxes("127.0.0.2", respond=lambda request: (503, {}, b"busy"))
    refused = inboxes("127.0.0.3")
    opened = (ipaddress.ip_network("127.0.0.2/32"),)
    settings = TransportSettings(user_agent="tests", allowed_networks=opened)
    with Transport(settings) as transport:
        result = attempt(job(targets=(first.url(), refused.url())), transport)
    assert (result.status, result.elsewhere, result.requests) == (503, False, 1)
    assert is_failure(result) is True and not result.permanent
    assert refused.connections == 0


# --- One deadline for the whole attempt, within the lease: real servers on loopback ---


class Recording(Transport):
    """A transport that notes the deadline each request is given, and may take
    its time after an answer (as a slow close would) where told to."""

    def __init__(self, settings: TransportSettings, linger: Mapping[str, float] = {}) -> None:
        super().__init__(settings)
        self.deadlines: list[float | None] = []
        self.linger = linger

    def post(
        self,
        url: str,
        body: bytes,
        headers: Mapping[str, str],
        *,
        deadline: float | None = None,
    ) -> Answer:
        self.deadlines.append(deadline)
        answer = super().post(url, body, headers, deadline=deadline)
        time.sleep(self.linger.get(url, 0.0))
        return answer


@pytest.fixture
def loopback() -> Iterator[Callable[..., Recording]]:
    made: list[Recording] = []

    def make(attempt_timeout: float = 30.0, **options: Any) -> Recording:
        settings = TransportSettings(
            user_agent="tests",
            attempt_timeout=attempt_timeout,
            allowed_networks=(ipaddress.ip_network("127.0.0.0/8"),),
        )
        made.append(Recording(settings, **options))
        return made[-1]

    yield make
    for transport in made:
        transport.close()


@pytest.fixture
def silent() -> Iterator[Callable[[], str]]:
    """Servers that accept connections (the kernel does) and never answer."""
    servers: list[socket.socket] = []

    def make() -> str:
        servers.append(socket.create_server(("127.0.0.1", 0)))
        return f"http://127.0.0.1:{servers[-1].getsockname()[1]}/inbox"

    yield make
    for server in servers:
        server.close()


@pytest.mark.slow
def test_a_portable_inbox_whose_gateways_are_all_silent_ends_within_one_attempt_timeout(
    silent: Callable[[], str], loopback: Callable[..., Recording]
) -> None:
    gateways = tuple(silent() for _ in range(5))
    transport = loopback(attempt_timeout=2.0)

    start = time.monotonic()
    result = attempt(job(targets=gateways), transport)
    elapsed = time.monotonic() - start

    assert 1.9 < elapsed < 7, "one attempt timeout for all five, not one each"
    assert (result.delivered, result.permanent, result.status) == (False, False, None)
    assert len(set(transport.deadlines)) == 1


def test_both_knocks_are_given_the_attempt_s_one_deadline(
    inbox: Inbox, loopback: Callable[..., Recording]
) -> None:
    inbox.respond = lambda request: (401 if len(inbox.received) == 1 else 202, {}, b"")
    transport = loopback(attempt_timeout=30.0)

    before = time.monotonic()
    result = attempt(job(targets=(inbox.url(),)), transport)
    after = time.monotonic()

    assert (result.delivered, result.requests) == (True, 2)
    first, second = transport.deadlines
    assert first == second
    assert first is not None and before + 30.0 <= first <= after + 30.0


def test_a_202_whose_body_its_content_encoding_does_not_fit_is_delivered(
    inbox: Inbox, loopback: Callable[..., Recording]
) -> None:
    # Identity was asked for, and the body is not needed for a 2xx: told as
    # a failure, the activity would be sent again.
    inbox.respond = lambda request: (202, {"Content-Encoding": "gzip"}, b"ok!!")
    result = attempt(job(targets=(inbox.url(),)), loopback())
    assert (result.delivered, result.status, result.requests) == (True, 202, 1)


@pytest.mark.slow
def test_a_second_knock_has_only_what_the_first_left_and_ends_a_passing_failure(
    loopback: Callable[..., Recording],
) -> None:
    released = threading.Event()
    server = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        # A 401 after 3 s to the first knock; silence to the second (on this
        # connection, kept alive, or on another the kernel accepts for it).
        connection, _ = server.accept()
        with connection:
            connection.recv(65536)
            time.sleep(3.0)
            connection.sendall(b"HTTP/1.1 401 Unauthorized\r\nContent-Length: 0\r\n\r\n")
            released.wait(30)

    threading.Thread(target=serve, daemon=True).start()
    transport = loopback(attempt_timeout=4.0)
    try:
        start = time.monotonic()
        result = attempt(job(targets=(f"http://127.0.0.1:{server.getsockname()[1]}/",)), transport)
        elapsed = time.monotonic() - start
    finally:
        released.set()
        server.close()

    assert len(transport.deadlines) == 2, "knocked twice"
    assert elapsed < 6.5, "the second knock had an attempt timeout of its own"
    assert (result.delivered, result.permanent, result.status) == (False, False, None)


def test_a_job_whose_lease_is_spent_is_not_sent(
    inbox: Inbox, loopback: Callable[..., Recording]
) -> None:
    result = attempt(
        job(targets=(inbox.url(),), lease_deadline=time.monotonic() - 0.01), loopback()
    )

    assert inbox.received == []
    assert (result.delivered, result.permanent, result.held, result.requests) == (
        False,
        False,
        True,
        0,
    )
    assert result.error == "not sent: its lease ran out before a worker was free"


@pytest.mark.slow
def test_an_attempt_ends_when_its_lease_does_however_long_the_attempt_timeout(
    silent: Callable[[], str], loopback: Callable[..., Recording]
) -> None:
    transport = loopback(attempt_timeout=30.0)

    start = time.monotonic()
    result = attempt(job(targets=(silent(),), lease_deadline=start + 1.5), transport)
    elapsed = time.monotonic() - start

    assert 1.4 < elapsed < 8
    assert (result.delivered, result.permanent, result.status) == (False, False, None)
    # The time the request had, the lease's rest when it began: not the attempt timeout.
    given = re.search(r"no complete answer within ([0-9.]+)s$", result.error)
    assert given is not None, result.error
    assert 1.2 <= float(given.group(1)) <= 1.5


GATEWAYS = (
    "https://gw1.example/.well-known/apgateway/did:key:z6MkABC/actor/inbox",
    "https://gw2.example/.well-known/apgateway/did:key:z6MkABC/actor/inbox",
)


@pytest.mark.parametrize("first", [503, 429, 307, ConnectionError("reset")], ids=str)
def test_a_later_gateway_refusing_ends_nothing_an_earlier_one_only_put_off(
    mocked: responses.RequestsMock, transport: Transport, first: int | Exception
) -> None:
    # The actor's own gateway is down a moment; another it lists (anyone's)
    # answers 410: the first may yet accept, as a gateway left untried may.
    if isinstance(first, Exception):
        mocked.post(GATEWAYS[0], body=first)
    else:
        mocked.post(GATEWAYS[0], status=first)
    mocked.post(GATEWAYS[1], status=410, body="gone")
    result = attempt(job(targets=GATEWAYS), transport)
    assert [call.request.url for call in mocked.calls] == list(GATEWAYS)
    assert not result.delivered and not result.permanent, result.error


def test_gateways_that_all_refuse_end_the_delivery_for_good(
    mocked: responses.RequestsMock, transport: Transport
) -> None:
    mocked.post(GATEWAYS[0], status=410)
    mocked.post(GATEWAYS[1], status=404)
    result = attempt(job(targets=GATEWAYS), transport)
    assert not result.delivered and result.permanent, result.error


def test_gateways_left_untried_for_want_of_time_make_a_passing_failure(
    inboxes: Callable[..., Inbox], loopback: Callable[..., Recording]
) -> None:
    gone, other = inboxes(respond=lambda request: (410, {}, b"gone")), inboxes()
    # The first answers at once, then takes the rest of the lease to let go.
    transport = loopback(linger={gone.url(): 0.6})

    result = attempt(
        job(targets=(gone.url(), other.url()), lease_deadline=time.monotonic() + 0.5),
        transport,
    )

    assert len(gone.received) == 1
    assert other.received == [], "no time left for it"
    assert (result.status, result.permanent) == (410, False), "the other might have accepted"


def test_an_inbox_is_a_kind_of_destination_with_its_credentials_declared() -> None:
    channel = ActivityPub()
    assert isinstance(channel, Channel) and channel.name == "activitypub"
    url = "https://Remote.Example:443/inbox?token=t0kenVALUE9"
    parsed = channel.parse(url, "https")
    assert parsed.url == "https://remote.example/inbox?token=t0kenVALUE9"
    destination = Destination.of("remote", channel, parsed)
    said = destination.redact(f"denied with t0kenVALUE9 at {parsed.url}")
    assert said == "denied with [redacted] at https://remote.example/inbox?[redacted]"
    with pytest.raises(UnusableURL, match="its URL carries a user or password"):
        channel.parse("https://user:pa55w0rdXYZ@remote.example/inbox", "https")


@pytest.mark.parametrize(
    "retry",
    [
        {"BASE": 30.0, "CAP": 3600.0, "ATTEMPTS": 12, "JITTER": 0.25},
        {"BASE": 1.0, "CAP": 5.0, "ATTEMPTS": 6, "JITTER": 0.5},
        {"SCHEDULE": [10.0, 20.0], "JITTER": 0.25},
    ],
)
def test_its_policy_retries_as_the_retry_setting_says(settings: Any, retry: dict[str, Any]) -> None:
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "RETRY": {**DEFAULTS["RETRY"], **retry},
        "ATTEMPT_TIMEOUT": 12.0,
    }
    policy = ActivityPub().policy()
    written = app_settings.retry
    assert policy.retry.max_attempts == written.max_attempts
    for made in range(1, written.max_attempts + 1):
        for rand in (0.0, 0.5, 1.0):
            assert policy.retry.delay(made, lambda r=rand: r) == written.delay(
                made, lambda r=rand: r
            )
    assert (policy.timeout, policy.lane) == (12.0, "normal")
