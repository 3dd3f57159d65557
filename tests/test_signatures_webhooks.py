"""Standard Webhooks signatures, checked against the reference library."""

from __future__ import annotations

import base64
import datetime
import time

import pytest
from standardwebhooks import Webhook
from standardwebhooks.webhooks import WebhookVerificationError

from django_federation_delivery.signatures import signature_headers

KEY = b"k" * 32
SECRET = "whsec_" + base64.b64encode(KEY).decode()
BODY = b'{"type":"alert.raised","data":{"text":"\xc3\xa9t\xc3\xa9"}}'


def test_the_signature_is_what_the_reference_library_computes() -> None:
    now = int(time.time())
    headers = signature_headers("msg_1", now, BODY, [KEY])
    expected = Webhook(SECRET).sign(
        "msg_1", datetime.datetime.fromtimestamp(now, datetime.UTC), BODY.decode()
    )
    assert headers == {
        "webhook-id": "msg_1",
        "webhook-timestamp": str(now),
        "webhook-signature": expected,
    }
    assert Webhook(SECRET).verify(BODY, headers)["data"] == {"text": "été"}


def test_each_key_signs_and_any_one_verifies() -> None:
    other = b"o" * 32
    headers = signature_headers("msg_1", int(time.time()), BODY, [KEY, other])
    first, second = headers["webhook-signature"].split(" ")
    assert first.startswith("v1,")
    assert second.startswith("v1,")
    for key in (KEY, other):
        Webhook(key).verify(BODY, headers)
    with pytest.raises(WebhookVerificationError):
        Webhook(b"w" * 32).verify(BODY, headers)


def test_the_id_and_timestamp_are_signed_too() -> None:
    now = int(time.time())
    headers = signature_headers("msg_1", now, BODY, [KEY])
    for changed in ({"webhook-id": "msg_2"}, {"webhook-timestamp": str(now - 1)}):
        with pytest.raises(WebhookVerificationError):
            Webhook(KEY).verify(BODY, {**headers, **changed})


def test_signing_without_a_key_is_an_error() -> None:
    with pytest.raises(ValueError, match="key"):
        signature_headers("msg_1", 0, BODY, [])
