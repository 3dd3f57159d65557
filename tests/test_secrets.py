"""No secret of an inbox URL in any message, row, log, signal or admin page.

An inbox's userinfo is refused when queued; its query (``?token=...``) is queued,
and then driven through every failure reachable on loopback by a real deliverer.
The query may be in the inbox column (and the signals' ``inbox``, which names the
delivery to the host project): nowhere else. Nor is a private key written where
a setting's dotted path goes repeated by a check or a refused deliverer.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import socket
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from cryptography.hazmat.primitives import serialization
from django.contrib.auth import get_user_model
from django.core.checks import run_checks
from django.core.exceptions import ImproperlyConfigured
from django.core.management import CommandError, call_command
from django.db.models import CharField, JSONField, TextField
from django.test import Client
from django.urls import reverse

from django_federation_delivery import send, send_batch, signals
from django_federation_delivery.conf import app_settings
from django_federation_delivery.models import Batch, Delivery, Status
from django_federation_delivery.signatures import SenderKey, body_sha256

from .conftest import Inbox, Received, RunningDeliverer, wait_until
from .keys import ALICE, rsa_key

SECRET = "t0ken-S3CRET-value"
QUERY = f"?token={SECRET}"
#: Its key id cannot be put between a signature's quotes: every scheme refuses it.
UNSIGNABLE = "https://social.example/users/unsignable"


def sender_key(sender: str) -> SenderKey | None:
    if sender == UNSIGNABLE:
        return SenderKey('https://social.example/users/"unsignable"', rsa_key())
    return SenderKey(f"{sender}#main-key", rsa_key())


def echo(status: int) -> Callable[[Received], tuple[int, dict[str, str], bytes]]:
    """An inbox that answers ``status`` and echoes the URL it was sent to, query and all."""

    def respond(request: Received) -> tuple[int, dict[str, str], bytes]:
        url = f"http://{request.host}{request.path}"
        return status, {}, f"<p>no inbox at {url} ({request.path})</p>".encode()

    return respond


@pytest.fixture
def silent() -> Iterator[int]:
    """A port that takes connections and never answers."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        yield listener.getsockname()[1]


@pytest.fixture
def received() -> Iterator[list[tuple[str, dict[str, Any]]]]:
    """What the four signals carry."""
    payloads: list[tuple[str, dict[str, Any]]] = []
    names = ("delivery_attempted", "delivery_settled", "delivery_failed", "batch_finished")
    receivers = []
    for name in names:

        def receiver(sender: Any, name: str = name, **kwargs: Any) -> None:
            payloads.append((name, kwargs))

        getattr(signals, name).connect(receiver, weak=False)
        receivers.append((name, receiver))
    yield payloads
    for name, receiver in receivers:
        getattr(signals, name).disconnect(receiver)


def without_inbox(payload: Any) -> str:
    if dataclasses.is_dataclass(payload) and not isinstance(payload, type):
        return repr(dataclasses.replace(payload, inbox=""))  # type: ignore[type-var]
    if isinstance(payload, Batch):
        return repr([getattr(payload, field.attname) for field in Batch._meta.fields])
    return repr(payload)


def text_fields(model: type[Any]) -> list[str]:
    return [
        field.attname
        for field in model._meta.fields
        if isinstance(field, CharField | TextField | JSONField)
    ]


@pytest.mark.django_db(transaction=True)
def test_an_inbox_secret_is_in_no_message_row_log_signal_or_admin_page(
    settings: Any,
    inboxes: Callable[..., Inbox],
    start_deliverer: Callable[..., RunningDeliverer],
    silent: int,
    received: list[tuple[str, dict[str, Any]]],
    caplog: pytest.LogCaptureFixture,
    closed_port: Callable[[], int],
) -> None:
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "SENDER_KEYS": f"{__name__}.sender_key",
        # 127.0.0.5 is loopback but not allowed: a refused address.
        "ALLOWED_NETWORKS": ["127.0.0.1/32"],
        # Long enough for every answering inbox's to come on a machine busy
        # past its cores (at 1 s, a 503 was once two timeouts instead).
        "ATTEMPT_TIMEOUT": 3.0,
        "CONNECT_TIMEOUT": 3.0,
        "RETRY": {"BASE": 0.1, "CAP": 0.1, "ATTEMPTS": 2, "JITTER": 0},
    }
    refusing = inboxes(respond=echo(403))
    failing = inboxes(respond=echo(503))
    accepting = inboxes()
    targets = {
        "connection refused": f"http://127.0.0.1:{closed_port()}/inbox{QUERY}",
        "refused address": f"http://127.0.0.5:{accepting.port}/inbox{QUERY}",
        "timeout": f"http://127.0.0.1:{silent}/inbox{QUERY}",
        "4xx echoing the URL": refusing.url(f"/inbox{QUERY}"),
        "5xx echoing the URL": failing.url(f"/inbox{QUERY}"),
    }
    with caplog.at_level(logging.DEBUG):
        batch = send(
            ALICE,
            {"type": "Create"},
            [*targets.values(), f"http://user:{SECRET}@127.0.0.1:{accepting.port}/inbox"],
        )
        assert batch is not None
        assert [skipped.reason for skipped in batch.skipped] == ["carries a user or password"]
        unsignable = send(UNSIGNABLE, {"type": "Create"}, [accepting.url(f"/inbox{QUERY}")])
        assert unsignable is not None
        # Queued before inboxes were canonical: refused when it comes due.
        stale = Batch.objects.create(
            sender=ALICE, body="{}", body_sha256=body_sha256(b"{}"), size=1, remaining=1
        )
        Delivery.objects.create(
            batch=stale, inbox=accepting.url(f"/in box{QUERY}"), host="127.0.0.1"
        )
        runner = start_deliverer()
        wait_until(lambda: not Delivery.objects.filter(status=Status.PENDING).exists())
        runner.stop()

    # Every failure path was taken, and each says what went wrong.
    errors = dict(Delivery.objects.values_list("inbox", "last_error"))
    assert "connection refused" in errors[targets["connection refused"]]
    assert "127.0.0.5" in errors[targets["refused address"]]
    # The watchdog or the socket's own timeout, whichever fires first on a busy machine.
    assert re.search("no complete answer|timed out", errors[targets["timeout"]])
    assert "answered 403" in errors[targets["4xx echoing the URL"]]
    assert "[redacted]" in errors[targets["4xx echoing the URL"]]
    assert "answered 503" in errors[targets["5xx echoing the URL"]]
    assert "key id" in errors[accepting.url(f"/inbox{QUERY}")]
    assert "cannot deliver to" in errors[accepting.url(f"/in box{QUERY}")]
    assert set(Delivery.objects.values_list("status", flat=True)) <= {
        Status.REFUSED,
        Status.FAILED,
    }
    assert accepting.received == [], "nothing reached the accepting inbox"

    # Rows: the secret is in the inbox column and nowhere else.
    for delivery in Delivery.objects.all():
        for name in text_fields(Delivery):
            if name != "inbox":
                assert SECRET not in str(getattr(delivery, name)), (name, delivery.id)
    for stored in Batch.objects.all():
        for name in text_fields(Batch):
            assert SECRET not in str(getattr(stored, name)), name

    # Logs, from every thread, at DEBUG.
    assert caplog.records
    for record in caplog.records:
        assert SECRET not in record.getMessage(), record.getMessage()
        assert SECRET not in (record.exc_text or "")

    # Signals: all four were sent, and none carries it outside ``inbox``.
    assert {name for name, _ in received} == {
        "delivery_attempted",
        "delivery_settled",
        "delivery_failed",
        "batch_finished",
    }
    for name, payload in received:
        for value in payload.values():
            assert SECRET not in without_inbox(value), name

    # The admin's delivery pages.
    user = get_user_model().objects.create_superuser("root", "root@example.com", "pw")
    client = Client()
    client.force_login(user)
    pages = [reverse("admin:federation_delivery_delivery_changelist")]
    pages += [
        reverse("admin:federation_delivery_delivery_change", args=[pk])
        for pk in Delivery.objects.values_list("pk", flat=True)
    ]
    pages.append(reverse("admin:federation_delivery_batch_changelist"))
    for page in pages:
        response = client.get(page)
        assert response.status_code == 200, page
        assert SECRET not in response.content.decode(), page


def test_an_answer_echoing_the_query_is_kept_without_it_even_when_cut_short() -> None:
    from django_federation_delivery.channels.activitypub import describe
    from django_federation_delivery.transport import Answer

    target = f"https://remote.example/inbox{QUERY}&page=2"
    for body in [
        f"unknown inbox {target}",
        f"unknown: token={SECRET}&page=2 and {SECRET}",
        " " * 1200 + f"token={SECRET}",
        "x" * 1190 + " " + SECRET,
    ]:
        error = describe(Answer(404, {}, body.encode(), 0.0), 300, target)
        assert error.startswith("the inbox answered 404")
        for cut in range(6, len(SECRET) + 1):
            assert SECRET[:cut] not in error, (body[:40], error)


@pytest.mark.django_db(transaction=True)
def test_breakers_kept_per_inbox_show_no_inbox_secret(
    settings: Any,
    inboxes: Callable[..., Inbox],
    start_deliverer: Callable[..., RunningDeliverer],
) -> None:
    from io import StringIO

    from django.core.management import call_command

    from django_federation_delivery.models import Breaker

    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "SENDER_KEYS": f"{__name__}.sender_key",
        "BREAKER": {"THRESHOLD": 1, "COOL_OFF": 600, "SCOPE": "inbox"},
        "RETRY": {"BASE": 0.1, "CAP": 0.1, "ATTEMPTS": 1, "JITTER": 0},
    }
    failing = inboxes(respond=echo(503))
    send(ALICE, {"type": "Create"}, [failing.url(f"/inbox{QUERY}")])
    runner = start_deliverer()
    wait_until(lambda: Breaker.objects.exists() and not Delivery.objects.filter(status="pending"))
    runner.stop()
    # Its key, shown and in the admin's URLs, is the inbox without its query.
    assert list(Breaker.objects.values_list("key", flat=True)) == [failing.url("/inbox")]
    for options in ([], ["--json"]):
        out = StringIO()
        call_command("delivery_status", *options, stdout=out)
        assert failing.url("/inbox") in out.getvalue() and SECRET not in out.getvalue()
    user = get_user_model().objects.create_superuser("root", "root@example.com", "pw")
    client = Client()
    client.force_login(user)
    changelist = reverse("admin:federation_delivery_breaker_changelist")
    page = client.get(changelist).content.decode()
    assert SECRET not in page
    (link,) = re.findall(r'href="([^"]*/breaker/[^"]+/change/)"', page)
    assert SECRET not in link
    assert client.get(link).status_code == 200


def private_pem() -> str:
    return (
        rsa_key()
        .private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        .decode()
    )


def written_key(form: str) -> Any:
    """The key as a project may write it where the path to its provider goes:
    the PEM, its bytes, or a dict of actors' keys."""
    pem = private_pem()
    return {"str": pem, "bytes": pem.encode(), "dict": {ALICE: pem}}[form]


def shows_the_key(text: str) -> bool:
    """Whether ``text`` holds any line of the key's base64, even cut short."""
    lines = [line for line in private_pem().splitlines() if not line.startswith("-----")]
    return any(line[:16] in text for line in lines)


#: The settings that name a callable, and CHANNELS, which lists classes.
DOTTED_PATH_SETTINGS = [
    "SENDER_KEYS",
    "SENDER_GONE",
    "PERMANENT_STATUS",
    "SKIP_IF",
    "COLLECTION_SYNCHRONIZATION",
]


@pytest.mark.django_db
@pytest.mark.parametrize("form", ["str", "bytes", "dict"])
@pytest.mark.parametrize("name", [*DOTTED_PATH_SETTINGS, "CHANNELS"])
def test_a_private_key_written_where_a_dotted_path_goes_is_in_no_check_message(
    settings: Any, name: str, form: str
) -> None:
    # SENDER_KEYS = the key itself, not the path to the function that returns
    # it: manage.py check says the setting is wrong without repeating it.
    settings.FEDERATION_DELIVERY = {**settings.FEDERATION_DELIVERY, name: written_key(form)}
    found = [m for m in run_checks() if m.id and m.id.startswith("federation_delivery")]
    assert any(f"[{name!r}]" in m.msg for m in found), [m.msg for m in found]
    for message in found:
        for text in (message.msg, message.hint or ""):
            assert not shows_the_key(text), text


@pytest.mark.django_db
def test_a_private_key_written_in_the_list_of_channels_is_in_no_check_message(
    settings: Any,
) -> None:
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "CHANNELS": ["tests.channels.Pager", private_pem()],
    }
    found = [m for m in run_checks() if m.id and m.id.startswith("federation_delivery")]
    assert any("['CHANNELS']" in m.msg for m in found), [m.msg for m in found]
    for message in found:
        for text in (message.msg, message.hint or ""):
            assert not shows_the_key(text), text


@pytest.mark.django_db
@pytest.mark.parametrize("form", ["str", "bytes", "dict"])
@pytest.mark.parametrize("name", DOTTED_PATH_SETTINGS)
def test_a_private_key_written_where_a_dotted_path_goes_is_not_in_the_deliverers_refusal(
    settings: Any, name: str, form: str
) -> None:
    settings.FEDERATION_DELIVERY = {**settings.FEDERATION_DELIVERY, name: written_key(form)}
    with pytest.raises(CommandError) as refused:
        call_command("run_deliverer", "--drain")
    assert f"[{name!r}]" in str(refused.value)
    assert not shows_the_key(str(refused.value)), str(refused.value)


@pytest.mark.parametrize("form", ["str", "bytes", "dict"])
def test_a_setting_naming_a_callable_used_anyway_names_no_key_written_there(
    settings: Any, form: str
) -> None:
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "SENDER_KEYS": written_key(form),
    }
    with pytest.raises(ImproperlyConfigured) as refused:
        app_settings.callable_setting("SENDER_KEYS")
    assert "not shown: it is not a dotted path" in str(refused.value)
    # Nor in the traceback, which would show the error of its import.
    shown = "".join(traceback.format_exception(refused.value))
    assert not shows_the_key(shown), shown


def skip_if_raising(inbox: str, activity: Any) -> bool:
    # As a project's SKIP_IF may fail: a lookup by the inbox it was given.
    blocked: dict[str, bool] = {}
    return blocked[inbox]


def synchronization_raising(sender: str, inbox: str) -> str:
    raise ValueError(f"no followers collection known for {inbox}")


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    ("setting", "path", "synchronize"),
    [
        ("SKIP_IF", "skip_if_raising", False),
        ("COLLECTION_SYNCHRONIZATION", "synchronization_raising", True),
    ],
)
def test_an_inbox_query_is_not_logged_when_a_project_callable_given_it_raises(
    settings: Any,
    inbox: Inbox,
    start_deliverer: Callable[..., RunningDeliverer],
    caplog: pytest.LogCaptureFixture,
    setting: str,
    path: str,
    synchronize: bool,
) -> None:
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        setting: f"{__name__}.{path}",
    }
    # Logged by the error's type and where it was raised: the message and
    # the traceback, which quoted the inbox's query, are the project's own.
    target = inbox.url(f"/inbox{QUERY}")
    with caplog.at_level(logging.DEBUG):
        options = {"synchronize_collection": True} if synchronize else {}
        send_batch(ALICE, {"type": "Create"}, [target], options)
        runner = start_deliverer()
        wait_until(lambda: not Delivery.objects.filter(status=Status.PENDING).exists())
        runner.stop()
    # Taken as no answer, and delivered: the callable's failure was logged.
    assert Delivery.objects.get().status == Status.DELIVERED
    assert any(setting in record.getMessage() for record in caplog.records)
    for record in caplog.records:
        shown = caplog.handler.format(record)
        assert SECRET not in shown, shown


@pytest.mark.django_db
@pytest.mark.parametrize(
    "inbox",
    [
        # Pasted with a space, or between <> as Markdown and mail write a link.
        " https://bot:S3CRETpw@remote.example/inbox",
        "<https://bot:S3CRETpw@remote.example/inbox>",
        # A password written unencoded with a "/" in it (base64 often has one).
        "https://bot:ab/cdS3CRETpw@remote.example/inbox",
    ],
    ids=["leading space", "angle brackets", "slash in password"],
)
def test_the_password_of_an_inbox_skipped_is_not_shown_in_skipped_or_the_log(
    caplog: pytest.LogCaptureFixture, inbox: str
) -> None:
    # An inbox skipped is listed in batch.skipped, and logged, without its
    # password. It was shown whole when the text did not start with the
    # scheme, or when the password held an unencoded "/".
    with caplog.at_level(logging.DEBUG):
        batch = send(ALICE, {"type": "Create"}, [inbox, "https://remote.example/inbox"])
    assert batch is not None and len(batch.skipped) == 1
    shown = [repr(batch.skipped), *(record.getMessage() for record in caplog.records)]
    for text in shown:
        assert "S3CRETpw" not in text, text
