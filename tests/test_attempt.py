"""One attempt, with HTTP faked by ``responses``: signing, knocking, classifying."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import responses

from django_federation_delivery.attempt import Job, attempt, permanent_status
from django_federation_delivery.signatures import Scheme, SenderKey, body_sha256
from django_federation_delivery.transport import Transport, TransportSettings

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


def job(key: object = ALICE_KEY, **fields: object) -> Job:
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
    return Job(**values)  # type: ignore[arg-type]


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
    assert result.error == f"the inbox answered {status}: nope"
    assert permanent_status(status) is permanent


def test_retry_after_is_read_from_the_answer(
    mocked: responses.RequestsMock, transport: Transport
) -> None:
    mocked.post(INBOX, status=503, headers={"Retry-After": "90"})
    assert attempt(job(), transport).retry_after == 90


def test_only_the_start_of_a_long_answer_is_kept_as_the_error(
    mocked: responses.RequestsMock, transport: Transport
) -> None:
    mocked.post(INBOX, status=500, body="<html>" + "x" * 10_000)
    result = attempt(job(), transport, error_length=300)
    assert len(result.error) == 300
    assert result.error.startswith("the inbox answered 500: <html>xxx")


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
    away = attempt(job(key_error="the sender's key could not be looked up: OSError"), transport)
    assert (away.permanent, away.delivered) == (False, False)
    assert len(mocked.calls) == 0, "nothing is sent unsigned"


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
