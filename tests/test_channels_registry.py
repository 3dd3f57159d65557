"""The kinds a project sends to: found by scheme, and added from outside the
package with ``CHANNELS`` (``tests/channels.py`` is such a project's code)."""

from __future__ import annotations

import ipaddress
import json
import re
import threading
import time
import uuid
from collections.abc import Callable
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.core.management import call_command
from django.core.management.base import CommandError, SystemCheckError

from django_federation_delivery import send, send_webhook, signals
from django_federation_delivery.attempt import readable_detail
from django_federation_delivery.channels import (
    Parsed,
    Policy,
    PolicyError,
    UnusableURL,
    Verdict,
    parse_destination,
    registry,
)
from django_federation_delivery.checks import check_webhooks
from django_federation_delivery.deliverer import Deliverer
from django_federation_delivery.exceptions import InvalidDelivery
from django_federation_delivery.models import Delivery, Status

from .conftest import Inbox, Received, RunningDeliverer, wait_until
from .keys import ALICE
from .test_admin import html, login, url

KEY = "routingKEY4b7c9"
NOTE = {"@context": "https://www.w3.org/ns/activitystreams", "type": "Create", "actor": ALICE}


def with_pager(settings: Any, **extra: Any) -> None:
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "CHANNELS": ["tests.channels.Pager"],
        **extra,
    }


def test_every_built_in_kind_has_its_schemes() -> None:
    assert registry().schemes == sorted(
        [
            "discord",
            "discord+http",
            "http",
            "https",
            "markdown",
            "markdown+http",
            "matrix",
            "matrix+http",
            "ntfy",
            "ntfy+http",
            "slack",
            "slack+http",
            "telegram",
        ]
    )


def test_an_unknown_scheme_lists_those_known_and_never_shows_the_url() -> None:
    with pytest.raises(ImproperlyConfigured) as raised:
        parse_destination("ops", "slak://hooks.slack.com/services/T1/B2/tokenSECRET99")
    message = str(raised.value)
    assert "'ops'" in message and "'slak'" in message
    assert "slack, slack+http" in message and "telegram" in message
    assert "SECRET" not in message and "hooks.slack.com" not in message


def test_a_scheme_that_is_no_scheme_is_not_shown() -> None:
    with pytest.raises(ImproperlyConfigured) as raised:
        parse_destination("ops", "hooks.slack.com/services/tokenSECRET99://x")
    assert "SECRET" not in str(raised.value) and "(not shown)" in str(raised.value)


def test_what_a_kind_quotes_of_a_query_is_shown_only_if_it_is_a_word(settings: Any) -> None:
    with_pager(settings, CHANNELS=["tests.channels.Quoting"])
    with pytest.raises(ImproperlyConfigured) as raised:
        parse_destination("ops", f"quoting://{KEY}@pager.example/x?tk_TOKEN9secret&level=tokenTWO7")
    message = str(raised.value)
    assert message == (
        "Webhook destination 'ops': a quoting URL takes no '(not shown)' (given '')."
    ), message
    with pytest.raises(ImproperlyConfigured) as raised:
        parse_destination("ops", f"quoting://{KEY}@pager.example/x?level=high")
    assert str(raised.value) == (
        "Webhook destination 'ops': a quoting URL takes no 'level' (given 'high')."
    )


def test_the_check_names_the_variable_of_a_url_with_an_unknown_scheme(settings: Any) -> None:
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "WEBHOOKS": {"oncall": "pagr://routingKEYsecret1@pager.example/x"},
    }
    (message,) = check_webhooks()
    assert message.id == "federation_delivery.E031"
    assert "WEBHOOK_ONCALL" in (message.hint or "")
    assert "pager" not in message.msg  # not known until CHANNELS adds it
    assert "routingKEY" not in message.msg + (message.hint or "")
    with_pager(settings, WEBHOOKS={"oncall": "pager://routingKEYsecret1@pager.example/x"})
    assert check_webhooks() == []


@pytest.mark.django_db
def test_a_url_holding_text_that_is_not_utf8_is_its_destinations_problem_alone(
    settings: Any,
) -> None:
    # os.environ gives a byte that is not UTF-8 as a lone surrogate.
    bad = "slack://hooks.slack.com/services/T0/B0/tokenSECRET\udcff"
    with pytest.raises(ImproperlyConfigured) as raised:
        parse_destination("ops", bad)
    message = str(raised.value)
    assert "'ops'" in message and "not UTF-8" in message
    assert "SECRET" not in message and "hooks.slack.com" not in message
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "WEBHOOKS": {"ops": bad, "chat": "slack+http://127.0.0.1:9/services/T/B/C"},
    }
    (error,) = check_webhooks()
    assert error.id == "federation_delivery.E031" and "'ops'" in error.msg
    assert "SECRET" not in error.msg + (error.hint or "")
    # The other destination is sent to as ever.
    batch = send_webhook("chat", "alert.raised", {})
    assert batch is not None and batch.size == 1
    with pytest.raises(ImproperlyConfigured, match="not UTF-8"):
        send_webhook("ops", "alert.raised", {})


#: What a destination's URL holds that must be shown nowhere.
FRAGILE = "fragile://routingKEYsecret1@pager.example/x"
EMPTY_PAIR = "http://127.0.0.4:9/h?secret=whsec_" + "QUJD" * 8 + "&"


@pytest.mark.django_db
@pytest.mark.parametrize("url", [FRAGILE, EMPTY_PAIR], ids=["a kind's own error", "empty pair"])
def test_a_kind_whose_parse_fails_is_its_destinations_problem_alone(
    settings: Any, url: str, caplog: pytest.LogCaptureFixture
) -> None:
    with_pager(settings, CHANNELS=["tests.channels.Fragile"])
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "WEBHOOKS": {"ops": url, "chat": "slack+http://127.0.0.1:9/services/T/B/C"},
    }
    shown = []
    if url == FRAGILE:
        with pytest.raises(ImproperlyConfigured) as raised:
            parse_destination("ops", url)
        assert str(raised.value) == (
            "Webhook destination 'ops': its kind fragile could not parse its URL: RuntimeError."
        )
        (error,) = check_webhooks()
        assert error.id == "federation_delivery.E031" and "'ops'" in error.msg
        shown += [error.msg, error.hint or ""]
        # Sent to every destination, the event goes to the other alone: it
        # raised, and was queued for none.
        every = send_webhook("*", "alert.raised", {})
        assert every is not None and every.size == 1
        assert "not queued for it" in caplog.text
        shown.append(caplog.text)
        # Reported, not raised through: it crashed with the kind's error.
        with pytest.raises(SystemCheckError, match=r"federation_delivery\.E031") as checked:
            call_command("check")
        shown.append(str(checked.value))
    else:
        assert parse_destination("ops", url).url == "http://127.0.0.4:9/h"
        assert check_webhooks() == []
        call_command("check")
    for options in ([], ["--json"]):
        out = StringIO()
        call_command("delivery_status", *options, stdout=out)
        shown.append(out.getvalue())
    # The other destination is sent to as ever, and the loop goes on.
    batch = send_webhook("chat", "alert.raised", {})
    assert batch is not None and batch.size == 1
    Deliverer().run(drain=True, stop_after=10)
    for text in shown:
        assert "routingKEY" not in text and "pager.example" not in text, text


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("kind", "says"),
    [
        ("Configured", "cannot be made with no arguments, as CHANNELS makes it"),
        ("OneScheme", "schemes must be a tuple of lowercase URL schemes"),
        ("Unmade", "could not be made: RuntimeError"),
    ],
)
def test_a_kind_that_cannot_be_registered_is_a_check_error_and_crashes_nothing(
    settings: Any, kind: str, says: str
) -> None:
    # A kind that took an argument crashed the checks, every send and the
    # deliverer with a TypeError; schemes written as a string were taken
    # letter by letter.
    with_pager(
        settings,
        CHANNELS=[f"tests.channels.{kind}"],
        WEBHOOKS={"chat": "slack+http://127.0.0.1:9/services/T/B/C"},
    )
    with pytest.raises(SystemCheckError, match=r"federation_delivery\.E035") as checked:
        call_command("check")
    assert f"tests.channels.{kind}" in str(checked.value)
    assert says in str(checked.value)
    with pytest.raises(ImproperlyConfigured, match=f"tests.channels.{kind}"):
        send_webhook("chat", "alert.raised", {})
    with pytest.raises(ImproperlyConfigured, match=f"tests.channels.{kind}"):
        registry()
    Deliverer().run(drain=True, stop_after=10)
    assert "t0kenS3CRET" not in str(checked.value), "a kind's error named by its type alone"


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("source", "error"),
    [
        ("import os\nTOKEN = os.environ['PAGER_T0KEN_S3CRET']\n", "KeyError"),
        ("def broken(:\n", "SyntaxError"),
    ],
    ids=["an error as it runs", "no Python"],
)
def test_a_kind_whose_module_fails_as_it_is_imported_is_a_check_error_never_a_traceback(
    settings: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str, error: str
) -> None:
    # Only an ImportError was caught: a module that raised anything else as
    # it ran (a variable it reads missing) crashed manage.py check, every
    # send and the deliverer with a traceback.
    module = f"pagerkind_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{module}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    with_pager(
        settings,
        CHANNELS=[f"{module}.Pager"],
        WEBHOOKS={"chat": "slack+http://127.0.0.1:9/services/T/B/C"},
    )
    (message,) = check_webhooks()
    assert message.id == "federation_delivery.E035"
    assert f"'{module}.Pager', which cannot be imported: {error}" in message.msg
    assert "S3CRET" not in message.msg, "the error is named by its type alone"
    with pytest.raises(SystemCheckError, match=r"federation_delivery\.E035"):
        call_command("check")
    with pytest.raises(ImproperlyConfigured, match=module):
        send_webhook("chat", "alert.raised", {})


@pytest.mark.parametrize(
    ("secrets", "says"),
    [
        ("k3Y9zSECRET", "its kind declares its secrets as str, not a tuple of strings"),
        ((b"k3Y9zSECRET",), "its kind declares a secret that is bytes, not a string"),
    ],
)
def test_secrets_a_kind_declares_as_no_list_of_strings_are_refused_never_shown(
    secrets: object, says: str
) -> None:
    # A string was taken letter by letter, each letter too short to redact:
    # nothing was.
    with pytest.raises(UnusableURL, match=says) as raised:
        Parsed(url="https://pager.example/page", secrets=secrets)  # type: ignore[arg-type]
    assert "k3Y9z" not in str(raised.value)


@pytest.mark.django_db(transaction=True)
def test_a_kind_declaring_its_secrets_as_a_string_is_its_destinations_problem_alone(
    settings: Any,
) -> None:
    with_pager(
        settings,
        CHANNELS=["tests.channels.Unlisted"],
        WEBHOOKS={
            "oncall": f"unlisted://{KEY}@pager.example/page",
            "chat": "slack+http://127.0.0.1:9/services/T/B/C",
        },
    )
    says = (
        "Webhook destination 'oncall': its kind declares its secrets as str, "
        "not a tuple of strings."
    )
    (message,) = check_webhooks()
    assert (message.id, message.msg) == ("federation_delivery.E031", says)
    with pytest.raises(ImproperlyConfigured, match=re.escape(says)):
        send_webhook("oncall", "alert.raised", {})
    assert send_webhook("chat", "alert.raised", {}) is not None


@pytest.mark.django_db(transaction=True)
def test_a_declared_secret_shorter_than_most_is_redacted_all_the_same(
    settings: Any, inboxes: Callable[..., Inbox], caplog: pytest.LogCaptureFixture
) -> None:
    # Below six characters, a declared secret no longer one holds was
    # never redacted: a receiver that repeated it had it shown.
    pin = "k3Y9z"

    def echo(request: Received) -> tuple[int, dict[str, str], bytes]:
        return 500, {}, f"bad key {request.json()['routing_key']}".encode()

    server = inboxes("127.0.0.1", respond=echo)
    with_pager(
        settings,
        CHANNELS=["tests.channels.PinPager"],
        WEBHOOKS={"oncall": f"pinpager+http://{pin}@127.0.0.1:{server.port}/page"},
        WEBHOOK_RETRY=[0.05],
    )
    send_webhook("oncall", "alert.raised", {})
    deadline = time.monotonic() + 15
    while Delivery.objects.filter(status=Status.PENDING).exists() and time.monotonic() < deadline:
        Deliverer().run(drain=True)
        threading.Event().wait(0.05)
    (error,) = Delivery.objects.values_list("last_error", flat=True)
    assert error.endswith("the receiver answered 500 Internal Server Error: bad key [redacted]")
    assert pin not in caplog.text
    # Where a longer one holds it (a hook's segment, in its path), it is
    # that one that is taken out, not each "T" of a text.
    slack = parse_destination("chat", "slack://hooks.slack.com/services/T/B/C0ffeeT0ken")
    assert slack.redact("Try /services/T/B/C0ffeeT0ken") == "Try [redacted]"


#: A webhook's URL written where its destination's name goes.
URL_AS_NAME = "https://hooks.slack.com/services/T0SECRETA/B0SECRETB/xTOKENxSECRETx"


@pytest.mark.django_db
def test_a_url_written_as_a_destinations_name_is_shown_nowhere(
    settings: Any, caplog: pytest.LogCaptureFixture
) -> None:
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "WEBHOOKS": {"ops": "slack://hooks.slack.com/services/T1/B1/okTOKEN", URL_AS_NAME: "x"},
    }
    shown = []
    (error,) = check_webhooks()
    assert error.id == "federation_delivery.E031"
    assert "'https://hooks.slack.com/…'" in error.msg, "the name is named, cut to its host"
    shown += [error.msg, error.hint or ""]
    with pytest.raises(InvalidDelivery) as raised:
        send_webhook("opz", "alert.raised", {})
    assert "configured:" in str(raised.value)
    shown.append(str(raised.value))
    every = send_webhook("*", "alert.raised", {})
    assert every is not None and every.size == 1, "the other destination's"
    shown.append(caplog.text)
    for options in ([], ["--json"]):
        out = StringIO()
        call_command("delivery_status", *options, stdout=out)
        shown.append(out.getvalue())
    from django_federation_delivery import metrics

    shown += metrics.read_queue().destinations_disabled
    for text in shown:
        assert "SECRET" not in text and "services/" not in text, text
    assert "lowercase letters" in (error.hint or ""), "the hint says how to name it"


def test_a_kind_from_outside_parses_shows_and_redacts_by_its_declaration(settings: Any) -> None:
    with_pager(settings)
    destination = parse_destination("oncall", f"pager://{KEY}@pager.example/v2/enqueue")
    assert destination.display == "oncall (Pager)"
    assert destination.kind == "pager"
    assert destination.url == "https://pager.example/v2/enqueue"
    assert destination.redact(f"bad key {KEY}") == "bad key [redacted]"
    assert "pager" in registry().schemes


@pytest.mark.django_db(transaction=True)
def test_a_kind_from_outside_is_ordered_retried_redacted_and_shown_like_a_built_in_one(
    inboxes: Callable[..., Inbox], settings: Any, caplog: pytest.LogCaptureFixture
) -> None:
    lock = threading.Lock()
    refused_once: list[str] = []

    def pager(request: Received) -> tuple[int, dict[str, str], bytes]:
        # The first page is not taken, said inside a 200 (echoing the key), once.
        with lock:
            page = request.json()
            if page["dedup_key"] == "e0" and not refused_once:
                refused_once.append(page["dedup_key"])
                answer = {"status": "error", "message": f"busy, key {page['routing_key']}"}
                return 200, {}, json.dumps(answer).encode()
        return 202, {}, b'{"status": "success"}'

    server = inboxes("127.0.0.1", respond=pager)
    with_pager(
        settings,
        WEBHOOKS={"oncall": f"pager+http://{KEY}@127.0.0.1:{server.port}/v2/enqueue"},
        WEBHOOK_RETRY=[0.2] * 8,
    )
    attempts: list[signals.Attempted] = []

    def attempted(sender: Any, attempt: signals.Attempted, **kwargs: Any) -> None:
        attempts.append(attempt)

    for n in range(3):
        send_webhook("oncall", "alert.raised", {"n": n}, event_id=f"e{n}")
    signals.delivery_attempted.connect(attempted)
    try:
        for _ in range(40):
            Deliverer().run(drain=True)
            if not Delivery.objects.filter(status=Status.PENDING).exists():
                break
            threading.Event().wait(0.2)
    finally:
        signals.delivery_attempted.disconnect(attempted)

    # Ordered: the refused first page held the others until it went through.
    assert [r.json()["dedup_key"] for r in server.received] == ["e0", "e0", "e1", "e2"]
    assert [r.path for r in server.received] == ["/v2/enqueue"] * 4
    rows = list(Delivery.objects.order_by("id"))
    assert [(d.status, d.attempts) for d in rows] == [
        (Status.DELIVERED, 2),
        (Status.DELIVERED, 1),
        (Status.DELIVERED, 1),
    ]
    # The failure it retried was told without the key the pager echoed.
    first = attempts[0]
    assert (first.destination, first.outcome, first.status) == ("oncall", "retrying", 200)
    assert first.error == (
        'the receiver answered 200 OK: {"status": "error", "message": "busy, key [redacted]"}'
    )
    status = StringIO()
    call_command("delivery_status", stdout=status)
    operator = login("operator")
    queues = html(operator, url("delivery", "queues"))
    deliveries = html(operator, url("delivery"))
    assert "Pager" in queues and 'data-destination="oncall"' in queues
    for text in (status.getvalue(), queues, deliveries, caplog.text):
        assert KEY not in text


def with_siren(settings: Any, webhooks: dict[str, str], **extra: Any) -> None:
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "CHANNELS": ["tests.channels.Pager", "tests.channels.Siren", "tests.channels.Broken"],
        "WEBHOOKS": webhooks,
        **extra,
    }


@pytest.mark.django_db(transaction=True)
def test_a_kind_with_a_policy_of_its_own_is_laned_sized_and_retried_by_it(
    inboxes: Callable[..., Inbox], settings: Any
) -> None:
    server = inboxes("127.0.0.1", respond=lambda request: (503, {}, b"down"))
    with_siren(
        settings,
        {
            "siren": f"siren+http://{KEY}@127.0.0.1:{server.port}/page",
            "oncall": f"pager+http://{KEY}@127.0.0.1:{server.port}/page",
        },
        WEBHOOK_RETRY=[0.05] * 5,
        # Twelve failures in a row to a destination: no breaker in the way.
        BREAKER={"THRESHOLD": 100, "COOL_OFF": 60.0, "SCOPE": "host"},
    )
    # Its lane; with a destination of the settings' policy, the more urgent one.
    siren_only = send_webhook("siren", "alert.raised", {"n": 1})
    both = send_webhook(["siren", "oncall"], "alert.raised", {"n": 2})
    assert siren_only is not None and both is not None
    assert (siren_only.lane, both.lane) == ("priority", "webhook")
    # Its size: larger than it takes, nothing is written, to either.
    with pytest.raises(InvalidDelivery, match=r"the 300 bytes the siren kind of 'siren' takes"):
        send_webhook(["oncall", "siren"], "alert.raised", {"text": "x" * 400})
    assert Delivery.objects.count() == 3
    assert send_webhook("oncall", "alert.raised", {"text": "x" * 400}) is not None

    deadline = time.monotonic() + 30
    while Delivery.objects.filter(status=Status.PENDING).exists() and time.monotonic() < deadline:
        Deliverer().run(drain=True)
        threading.Event().wait(0.05)
    # Its schedule: two waits, three tries; the settings' five waits, six.
    tries = sorted(Delivery.objects.values_list("destination", "status", "attempts"))
    assert tries == [
        ("oncall", Status.FAILED, 6),
        ("oncall", Status.FAILED, 6),
        ("siren", Status.FAILED, 3),
        ("siren", Status.FAILED, 3),
    ]


def test_a_policy_the_queue_cannot_follow_is_a_check_error_naming_the_value(
    settings: Any,
) -> None:
    with_siren(settings, {"broken": f"broken://{KEY}@pager.example/x"})
    (message,) = check_webhooks()
    assert message.id == "federation_delivery.E036"
    assert "'broken'" in message.msg and "'urgent'" in message.msg and "priority" in message.msg
    assert KEY not in message.msg
    with pytest.raises(ValueError, match="its max_bytes is at least 1, not 0"):
        Policy(max_bytes=0)
    with pytest.raises(ValueError, match=r"its schedule .* not \(0\.0,\)"):
        Policy(schedule=(0.0,))
    assert Policy(schedule=()).retry.max_attempts == 1


@pytest.mark.parametrize(
    ("kind", "says"),
    [
        ("Unsettled", " could not be had: ImproperlyConfigured."),
        ("Misvalued", " could not be had: ValueError."),
        ("Forgetful", ": its policy() returned NoneType, not a Policy."),
    ],
)
def test_a_policy_that_cannot_be_had_is_a_check_error_naming_the_kind_never_its_message(
    settings: Any, kind: str, says: str
) -> None:
    # A ValueError of the kind's own was quoted, and a policy() that
    # returned None passed the check.
    name = kind.lower()
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "CHANNELS": [f"tests.channels.{kind}"],
        "WEBHOOKS": {"oncall": f"{name}://{KEY}@pager.example/page"},
    }
    (message,) = check_webhooks()
    assert message.id == "federation_delivery.E036"
    assert message.msg == f"The policy of the {name!r} kind of webhook destination{says}"
    assert "t0kenS3CRET" not in message.msg
    with pytest.raises(CommandError) as raised:
        call_command("send_test_webhook", "oncall")
    assert str(raised.value) == message.msg


@pytest.mark.django_db(transaction=True)
def test_a_policy_opening_networks_as_text_is_followed(settings: Any, inbox: Inbox) -> None:
    # Every attempt crashed (TypeError, no request), the check silent.
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "CHANNELS": ["tests.channels.LocalPager"],
        "WEBHOOKS": {"oncall": f"localpager+http://{KEY}@127.0.0.1:{inbox.port}/page"},
        # Opened by the kind alone.
        "WEBHOOK_ALLOWED_NETWORKS": [],
        "WEBHOOK_RETRY": [0.05],
    }
    assert check_webhooks() == []
    send_webhook("oncall", "alert.raised", {})
    Deliverer().run(drain=True, stop_after=10)
    assert list(Delivery.objects.values_list("status", "attempts")) == [(Status.DELIVERED, 1)]
    assert inbox.paths() == ["/page"]
    network = ipaddress.ip_network("10.0.0.0/8")
    opened = Policy(allowed_networks=("127.0.0.1/8", network)).allowed_networks
    assert opened == (ipaddress.ip_network("127.0.0.0/8"), network)
    for bad, shown in [("127.0.0.0/8", "'127.0.0.0/8'"), (("localhost",), "('localhost',)")]:
        with pytest.raises(PolicyError, match=rf"its allowed_networks .* not {re.escape(shown)}"):
            Policy(allowed_networks=bad)  # type: ignore[arg-type]


@pytest.mark.django_db(transaction=True)
def test_a_kind_whose_policy_returns_none_stops_no_other_delivery(
    settings: Any, inbox: Inbox
) -> None:
    # The deliverer asked it for its policy as it was made, and raised
    # AttributeError: no delivery was sent, an activity's neither.
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "CHANNELS": ["tests.channels.Forgetful"],
        "WEBHOOKS": {
            "oncall": f"forgetful+http://{KEY}@127.0.0.1:{inbox.port}/page",
            "chat": f"slack+http://127.0.0.1:{inbox.port}/services/T/B/C",
        },
    }
    send_webhook("chat", "alert.raised", {})
    send(ALICE, NOTE, [inbox.url("/a")])
    Deliverer().run(drain=True, stop_after=10)
    assert set(Delivery.objects.values_list("status", flat=True)) == {Status.DELIVERED}
    assert sorted(inbox.paths()) == ["/a", "/services/T/B/C"]


@pytest.mark.django_db(transaction=True)
def test_a_kind_that_is_not_ordered_lets_an_event_pass_one_that_failed(
    inboxes: Callable[..., Inbox], settings: Any
) -> None:
    lock = threading.Lock()
    failed_once: list[str] = []

    def feed(request: Received) -> tuple[int, dict[str, str], bytes]:
        with lock:
            if request.json()["dedup_key"] == "e0" and not failed_once:
                failed_once.append("e0")
                return 503, {}, b"busy"
        return 202, {}, b'{"status": "success"}'

    server = inboxes("127.0.0.1", respond=feed)
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "CHANNELS": ["tests.channels.Pager", "tests.channels.Feed"],
        "WEBHOOKS": {"news": f"feed+http://{KEY}@127.0.0.1:{server.port}/v2/enqueue"},
    }
    for n in range(2):
        send_webhook("news", "post.published", {"n": n}, event_id=f"e{n}")
    assert set(Delivery.objects.values_list("sequence", "after_id")) == {("", None)}
    deadline = time.monotonic() + 30
    while Delivery.objects.filter(status=Status.PENDING).exists() and time.monotonic() < deadline:
        Deliverer().run(drain=True)
        threading.Event().wait(0.1)
    # The second went while the first waited for its retry (with the first's
    # first try, in either order: nothing holds one behind the other).
    received = [r.json()["dedup_key"] for r in server.received]
    assert sorted(received) == ["e0", "e0", "e1"] and received[-1] == "e0", received
    assert set(Delivery.objects.values_list("status", flat=True)) == {Status.DELIVERED}


@pytest.mark.django_db(transaction=True)
def test_a_verdict_whose_detail_is_bytes_is_read_and_a_delivered_one_not_sent_again(
    inboxes: Callable[..., Inbox], settings: Any, caplog: pytest.LogCaptureFixture
) -> None:
    # Its detail was redacted as text before anything else was read of it:
    # every attempt crashed, one the judge said was delivered too, and the
    # event was sent again at every try.
    answers = [(500, b"bad \x1b[2J key"), (200, b'{"status": "success"}')]

    def respond(request: Received) -> tuple[int, dict[str, str], bytes]:
        status, body = answers.pop(0)
        return status, {}, body

    server = inboxes("127.0.0.1", respond=respond)
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "CHANNELS": ["tests.channels.RawPager"],
        "WEBHOOKS": {"oncall": f"rawpager+http://{KEY}@127.0.0.1:{server.port}/page"},
        "WEBHOOK_RETRY": [0.05] * 3,
    }
    send_webhook("oncall", "alert.raised", {})
    deadline = time.monotonic() + 15
    while Delivery.objects.filter(status=Status.PENDING).exists() and time.monotonic() < deadline:
        Deliverer().run(drain=True)
        threading.Event().wait(0.05)
    assert len(server.received) == 2 and not answers
    assert list(Delivery.objects.values_list("status", "attempts")) == [(Status.DELIVERED, 2)]
    # The refusal's body, decoded and escaped as an answer's text is.
    assert "Internal Server Error: bad \\x1b[2J key; tried again" in caplog.text
    assert "internal error" not in caplog.text
    # Anything else is left out, named by its type alone.
    assert readable_detail(Verdict(False, detail=7)) == ("", "detail (int) is not a str")  # type: ignore[arg-type]


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("kind", ["headerpager", "noerrorpager"])
def test_a_kinds_result_the_loop_cannot_read_is_its_deliverys_problem_alone(
    inboxes: Callable[..., Inbox],
    start_deliverer: Callable[..., RunningDeliverer],
    settings: Any,
    caplog: pytest.LogCaptureFixture,
    kind: str,
) -> None:
    # A kind whose result holds what AttemptResult does not name (the text
    # of a Retry-After header, None for no error) raised in the loop's own
    # thread as it decided and wrote what came of it: run() ended, every
    # delivery it held left leased and sent again once the lease lapsed.
    answered: list[str] = []

    def busy_once(request: Received) -> tuple[int, dict[str, str], bytes]:
        answered.append(request.json()["dedup_key"])
        if len(answered) == 1:
            return 503, {"Retry-After": "0"}, b""
        return 202, {}, b'{"status": "success"}'

    server = inboxes("127.0.0.1", respond=busy_once)
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "CHANNELS": ["tests.channels.HeaderPager", "tests.channels.NoErrorPager"],
        "WEBHOOKS": {"oncall": f"{kind}+http://{KEY}@127.0.0.1:{server.port}/page"},
        "WEBHOOK_RETRY": [0.1] * 8,
    }
    inbox = inboxes()
    send_webhook("oncall", "alert.raised", {"n": 1}, event_id="e1")
    runner = start_deliverer()
    wait_until(lambda: bool(answered), timeout=10)
    # Sent after it: the loop is still there to send it.
    batch = send(ALICE, NOTE, [inbox.url("/after")])
    assert batch is not None
    wait_until(
        lambda: (
            not runner.thread.is_alive()
            or not Delivery.objects.filter(status=Status.PENDING).exists()
        ),
        timeout=10,
    )
    assert runner.thread.is_alive(), f"the loop stopped on {runner.error!r}"
    runner.stop()
    assert set(Delivery.objects.values_list("status", flat=True)) == {Status.DELIVERED}
    # Refused once, then taken, and never sent again: the page the
    # no-error pager delivered (its result's error None) was kept delivered.
    assert answered == ["e1", "e1"]
    assert inbox.paths() == ["/after"]
    assert Delivery.objects.get(destination="oncall").attempts == 2
    fault = {
        "headerpager": "retry_after (str) is not seconds (finite, not negative) or None",
        "noerrorpager": "error (NoneType) is not a str",
    }[kind]
    logged = [r.getMessage() for r in caplog.records if "the loop cannot read" in r.getMessage()]
    assert len(logged) == 1 and fault in logged[0], logged
    assert KEY not in caplog.text
