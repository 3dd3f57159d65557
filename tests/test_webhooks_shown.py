"""What is shown of a webhook destination: its errors, with every secret part
its kind declares taken out and nothing else, and its state."""

from __future__ import annotations

import base64
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from django_federation_delivery import send_webhook
from django_federation_delivery.deliverer import Deliverer
from django_federation_delivery.models import Delivery, Status

from .channels import queued_then_kind_removed
from .conftest import Inbox, Received

#: A signing key whose base64 holds no "/".
SECRET = "whsec_" + base64.b64encode(bytes(range(32))).decode()


def _last_error(settings: Any, url: str) -> str:
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "WEBHOOKS": {"audit": url},
        "WEBHOOK_RETRY": [30.0],
    }
    send_webhook("audit", "alert.raised", {})
    deadline = time.monotonic() + 10
    while not Delivery.objects.filter(attempts__gt=0).exists() and time.monotonic() < deadline:
        Deliverer().run(drain=True, stop_after=1)
        threading.Event().wait(0.05)
    return Delivery.objects.get().last_error


@pytest.mark.django_db(transaction=True)
def test_a_signed_json_destination_at_the_root_path_keeps_its_errors_readable(
    settings: Any, inboxes: Callable[..., Inbox]
) -> None:
    # The Signed JSON kind declares its path secret: at "/", that is "/",
    # one character no longer declared part holds (the key's base64 has no
    # "/"): every "/" of every error was "[redacted]".
    def not_found(request: Received) -> tuple[int, dict[str, str], bytes]:
        return 404, {}, b"<html><body>No route for POST here</body></html>"

    server = inboxes("127.0.0.1", respond=not_found)
    error = _last_error(settings, f"http://127.0.0.1:{server.port}/?secret={SECRET}")
    assert error.endswith("<html><body>No route for POST here</body></html>"), (
        f"nothing secret was in the answer, yet last_error is {error!r}"
    )


@pytest.mark.django_db(transaction=True)
def test_a_five_character_declared_path_is_redacted_as_a_shorter_one_is(
    settings: Any, inboxes: Callable[..., Inbox]
) -> None:
    # The path is declared secret, whole. "/k3Y" (4 characters) is
    # redacted; "/k3Y9" (5) was not, as its own JSON-escaped form "\/k3Y9"
    # (6) "held" it: a receiver that repeated the path had it shown.
    def echo(request: Received) -> tuple[int, dict[str, str], bytes]:
        return 404, {}, f"Cannot POST {request.path}".encode()

    server = inboxes("127.0.0.1", respond=echo)
    shown = {}
    for path in ("/k3Y", "/k3Y9"):
        Delivery.objects.all().delete()
        error = _last_error(settings, f"http://127.0.0.1:{server.port}{path}?secret={SECRET}")
        shown[path] = error.rpartition(": ")[2]
    assert shown == {"/k3Y": "Cannot POST [redacted]", "/k3Y9": "Cannot POST [redacted]"}, (
        f"the receiver repeated the secret path, and last_error ends {shown}"
    )


@pytest.mark.django_db(transaction=True)
def test_a_destination_whose_events_are_held_as_it_no_longer_parses_is_not_said_to_be_sending(
    settings: Any, inbox: Inbox
) -> None:
    # Its events are held, spending no try, for as long as it does not
    # parse: nothing is or can be sent, yet its state said "sending".
    from django.utils import timezone

    from django_federation_delivery.webhooks.status import destination_status

    queued_then_kind_removed(settings, inbox.port)
    Deliverer().run(drain=True, stop_after=1)
    row = Delivery.objects.get()
    assert (row.status, row.attempts, inbox.received) == (Status.PENDING, 0, [])
    assert "is not one of those known" in row.last_error
    (status,) = destination_status()
    state = status.state(timezone.now())
    assert state != "sending", (
        f"'oncall' ({status.kind}) has {status.pending} event held, never sent, and its "
        f"state is {state!r}"
    )


def test_a_short_secret_part_is_taken_out_where_it_stands_alone_only() -> None:
    # An ntfy topic of three letters is declared secret: taken out of every
    # word that held it, an error was unreadable ("O[redacted]").
    from django_federation_delivery.channels import parse_destination

    destination = parse_destination("alerts", "ntfy://ntfy.sh/ops")
    assert destination.redact("Oops: topic ops is full (ops)") == (
        "Oops: topic [redacted] is full ([redacted])"
    )
