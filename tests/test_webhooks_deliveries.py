"""Webhook deliveries end to end: real receivers on loopback, the real loop and database."""

from __future__ import annotations

import base64
import contextlib
import datetime
import json
import logging
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator
from io import StringIO
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from django.core.management import call_command
from django.utils import timezone
from standardwebhooks import Webhook
from standardwebhooks.webhooks import WebhookVerificationError

from django_federation_delivery import send, send_webhook, signals
from django_federation_delivery.channels import Verdict
from django_federation_delivery.conf import LEASE_MARGIN_SECONDS
from django_federation_delivery.deliverer import Deliverer
from django_federation_delivery.models import Batch, Delivery, Host, Status
from django_federation_delivery.store import wakes
from django_federation_delivery.transport import Answer
from django_federation_delivery.webhooks import sending as webhook_sending
from django_federation_delivery.webhooks.destinations import delivery_key

from .channels import Pager, queued_then_kind_removed
from .conftest import Inbox, Received, RunningDeliverer, away_at, wait_until
from .keys import ALICE

pytestmark = pytest.mark.django_db(transaction=True)

SECRET = "whsec_" + base64.b64encode(b"k" * 32).decode()
NOTE = {"@context": "https://www.w3.org/ns/activitystreams", "type": "Create", "actor": ALICE}


def configure(settings: Any, webhooks: dict[str, str], **extra: Any) -> None:
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "WEBHOOKS": webhooks,
        "WEBHOOK_RETRY": [0.1] * 8,
        **extra,
    }


def signed(inbox: Inbox, path: str = "/hook") -> str:
    return f"http://{inbox.address}:{inbox.port}{path}?secret={SECRET}"


def event_n(request: Received) -> int:
    document = request.json()
    if "data" in document:  # signed JSON
        return int(document["data"]["n"])
    text = document.get("text") or document["content"]  # a chat message: "type\nn: 3"
    return int(text.rsplit("n: ", 1)[1])


def deliveries(host: str) -> list[Delivery]:
    return list(Delivery.objects.filter(host=host).order_by("id"))


def all_settled(host: str) -> Callable[[], bool]:
    return lambda: not Delivery.objects.filter(host=host, status=Status.PENDING).exists()


@pytest.fixture
def caught() -> Iterator[list[tuple[str, Any]]]:
    """Every signal's payload, by signal name."""
    seen: list[tuple[str, Any]] = []
    lock = threading.Lock()
    receivers = []
    for name in ("delivery_attempted", "delivery_settled", "delivery_failed", "batch_finished"):

        def receive(sender: Any, name: str = name, **kwargs: Any) -> None:
            with lock:
                seen.extend((name, value) for key, value in kwargs.items() if key != "signal")

        getattr(signals, name).connect(receive, weak=False)
        receivers.append((name, receive))
    yield seen
    for name, receive in receivers:
        getattr(signals, name).disconnect(receive)


def test_a_failing_destination_gets_its_events_strictly_in_order_and_holds_nothing_else(
    inboxes: Callable[..., Inbox], start_deliverer: Callable[..., RunningDeliverer], settings: Any
) -> None:
    others_done = threading.Event()
    failed: list[int] = []

    def down_for_a_while(request: Received) -> tuple[int, dict[str, str], bytes]:
        # Down until the other destination and the inbox have everything, and
        # at least twice: their deliveries cannot have waited on this one.
        if len(failed) < 2 or not others_done.is_set():
            failed.append(event_n(request))
            return 503, {}, b"down"
        return 200, {}, b""

    flaky = inboxes("127.0.0.1", respond=down_for_a_while)
    healthy = inboxes("127.0.0.2")
    inbox = inboxes("127.0.0.3")
    configure(
        settings,
        {
            "flaky": signed(flaky),
            "healthy": f"markdown+http://127.0.0.2:{healthy.port}/hooks/k3y",
        },
        WEBHOOK_RETRY=[0.5] * 8,
    )
    for n in range(5):
        send_webhook(["flaky", "healthy"], "alert.raised", {"n": n})
    send(ALICE, NOTE, [inbox.url()])
    runner = start_deliverer()
    wait_until(lambda: len(healthy.received) == 5 and len(inbox.received) == 1)
    others_done.set()
    wait_until(all_settled("<flaky>"))
    runner.stop()

    assert [event_n(request) for request in healthy.received] == [0, 1, 2, 3, 4]
    sent = [event_n(request) for request in flaky.received]
    assert len(failed) >= 2 and failed == [0] * len(failed)
    assert sent == [0] * len(failed) + [0, 1, 2, 3, 4]
    assert {d.status for d in deliveries("<flaky>")} == {Status.DELIVERED}
    assert deliveries("<flaky>")[0].attempts == len(failed) + 1


def test_signed_json_verifies_at_the_receiver_and_is_signed_alike_on_every_retry(
    inboxes: Callable[..., Inbox], settings: Any
) -> None:
    verified: list[Any] = []

    def verify(request: Received) -> tuple[int, dict[str, str], bytes]:
        verified.append(Webhook(SECRET).verify(request.body, request.headers))
        return (503 if len(verified) == 1 else 204), {}, b""

    receiver = inboxes("127.0.0.1", respond=verify)
    configure(settings, {"audit": signed(receiver)})
    batch = send_webhook("audit", "user.created", {"name": "Zoë"}, event_id="evt_1")
    assert batch is not None
    wait_for_drains(lambda: len(verified) == 2)
    first, second = receiver.received
    assert verified[0] == {
        "type": "user.created",
        "id": "evt_1",
        "timestamp": json.loads(Batch.objects.get().body)["timestamp"],
        "data": {"name": "Zoë"},
    }
    assert first.path == "/hook"  # the secret is taken out of the URL sent
    # The same event, byte for byte, for the receiver to de-duplicate; each
    # signed when it was sent.
    assert first.body == second.body and first.headers["X-Webhook-Event"] == "user.created"
    assert first.headers["webhook-id"] == second.headers["webhook-id"] == "evt_1"
    assert int(first.headers["webhook-timestamp"]) <= int(second.headers["webhook-timestamp"])
    assert Delivery.objects.get().status == Status.DELIVERED


def test_with_use_tz_off_an_event_is_sent_signed_at_the_attempts_time_and_delivered(
    inboxes: Callable[..., Inbox], settings: Any, caught: list[tuple[str, Any]]
) -> None:
    settings.USE_TZ = False
    # Naive times are local ones then: a zone far from UTC shows one taken for the other.
    settings.TIME_ZONE = "Asia/Kathmandu"
    verified: list[Any] = []

    def verify(request: Received) -> tuple[int, dict[str, str], bytes]:
        verified.append(Webhook(SECRET).verify(request.body, request.headers))
        return (503 if len(verified) == 1 else 204), {}, b""

    receiver = inboxes("127.0.0.1", respond=verify)
    inbox = inboxes("127.0.0.2")
    configure(settings, {"audit": signed(receiver)})
    before = datetime.datetime.now(datetime.UTC)
    # Refused with a timestamp the caller never gave ("must be an aware datetime").
    batch = send_webhook("audit", "user.created", {"name": "Zoë"}, event_id="evt_1")
    assert batch is not None
    # And the settle of any delivery, an activity's too, was refused by
    # SQLite's adapter: an aware time with USE_TZ off.
    send(ALICE, NOTE, [inbox.url()])
    wait_for_drains(all_settled("<audit>"))
    wait_for_drains(lambda: len(inbox.received) == 1)

    # The event's time is UTC, whatever USE_TZ says, and each try verifies.
    stamped = datetime.datetime.fromisoformat(verified[0]["timestamp"])
    assert stamped.utcoffset() == datetime.timedelta(0)
    assert before <= stamped <= datetime.datetime.now(datetime.UTC)
    assert len(verified) == 2 and verified[0] == verified[1]
    for request in receiver.received:
        signed_at = int(request.headers["webhook-timestamp"])
        assert abs(signed_at - datetime.datetime.now(datetime.UTC).timestamp()) < 60
    delivery = Delivery.objects.get(kind="webhook")
    assert (delivery.status, delivery.attempts, delivery.last_status) == (
        Status.DELIVERED,
        2,
        204,
    )
    assert Delivery.objects.get(kind="activitypub").status == Status.DELIVERED
    assert [name for name, _ in caught].count("batch_finished") == 2
    for options in ([], ["--json"]):
        call_command("delivery_status", *options, stdout=StringIO())


@pytest.mark.parametrize("opened", ["ALLOWED_NETWORKS", "WEBHOOK_ALLOWED_NETWORKS"])
def test_each_allow_list_opens_loopback_to_its_own_kind_alone(
    inboxes: Callable[..., Inbox],
    start_deliverer: Callable[..., RunningDeliverer],
    settings: Any,
    opened: str,
) -> None:
    inbox = inboxes("127.0.0.1")
    receiver = inboxes("127.0.0.1")
    networks = {"ALLOWED_NETWORKS": [], "WEBHOOK_ALLOWED_NETWORKS": [], opened: ["127.0.0.0/8"]}
    configure(settings, {"local": signed(receiver)}, **networks)
    send(ALICE, NOTE, [inbox.url("/inbox")])
    send_webhook("local", "alert.raised", {"n": 1})
    runner = start_deliverer()
    wait_until(
        lambda: (
            not Delivery.objects.filter(status=Status.PENDING, last_error="").exists()
            and not Delivery.objects.filter(kind="activitypub", status=Status.PENDING).exists()
        )
    )
    runner.stop()
    outcomes = dict(Delivery.objects.values_list("kind", "status"))
    if opened == "WEBHOOK_ALLOWED_NETWORKS":
        # A loopback receiver a project configured works, while an inbox a
        # stranger names on loopback stays out of reach.
        assert (len(receiver.received), len(inbox.received)) == (1, 0)
        assert outcomes == {"webhook": Status.DELIVERED, "activitypub": Status.REFUSED}
    else:
        assert (len(receiver.received), len(inbox.received)) == (0, 1)
        assert outcomes["activitypub"] == Status.DELIVERED
        # The operator's to open: it waits, in order, spending no try (it
        # was given up, every try spent with no request made), and counts
        # towards its destination's disabling, which keeps its events.
        event = Delivery.objects.get(kind="webhook")
        assert (event.status, event.attempts) == (Status.PENDING, 0)
        assert "not a public address" in event.last_error
        assert Host.objects.get(name=delivery_key("local")).failing_since is not None


def test_an_event_whose_own_url_is_unusable_spends_its_tries(inbox: Inbox, settings: Any) -> None:
    # Its kind made an ftp:// URL of it: held as an address the settings
    # could open, it spent no try, never given up, and every later event
    # to the destination waited behind it.
    configure(
        settings,
        {"cb": f"callback+http://ROUTINGkey42@{inbox.address}:{inbox.port}/p"},
        CHANNELS=["tests.channels.Callback"],
        WEBHOOK_RETRY=[0.05],
    )
    send_webhook("cb", "alert.raised", {"callback": "ftp://127.0.0.1/nowhere"})
    Deliverer().run(drain=True, stop_after=8)
    (row,) = Delivery.objects.all()
    assert row.attempts >= 1, row.last_error  # a try spent: WEBHOOK_RETRY gives it up


@pytest.mark.parametrize("schedule", ["tried once", "short"])
def test_an_address_refused_is_held_not_tried_again_and_again(
    inbox: Inbox, settings: Any, schedule: str
) -> None:
    # Held with the schedule's first wait, none for a kind tried once: it was
    # attempted again at once, hundreds of times a second (with a 0.1 s
    # first wait, ten times a second), each a row written and a signal.
    if schedule == "tried once":
        url = f"once+http://ROUTINGkey42@{inbox.address}:{inbox.port}/p"
        configure(settings, {"ops": url}, CHANNELS=["tests.channels.Once"])
    else:
        configure(settings, {"ops": signed(inbox)}, WEBHOOK_ALLOWED_NETWORKS=[])
    attempted: list[Any] = []

    def count(sender: Any, **kwargs: Any) -> None:
        attempted.append(kwargs)

    signals.delivery_attempted.connect(count, weak=False)
    try:
        send_webhook("ops", "alert.raised", {"n": 1})
        Deliverer().run(stop_after=1.5)
    finally:
        signals.delivery_attempted.disconnect(count)
    row = Delivery.objects.get()
    assert (row.status, row.attempts, len(attempted)) == (Status.PENDING, 0, 1)
    assert "not a public address" in row.last_error


@pytest.mark.slow
def test_a_breakers_hold_spends_no_try_so_nine_tries_are_nine_requests(
    inboxes: Callable[..., Inbox],
    start_deliverer: Callable[..., RunningDeliverer],
    settings: Any,
) -> None:
    failures = 5

    def down_then_up(request: Received) -> tuple[int, dict[str, str], bytes]:
        return (503 if len(receiver.received) <= failures else 204), {}, b""

    receiver = inboxes("127.0.0.1", respond=down_then_up)
    # The breaker opens after two failures and holds the event until it
    # cools off (0.4 s), while the schedule would bring it round every
    # 0.05 s: each hold spent a try before.
    configure(
        settings,
        {"ops": signed(receiver)},
        WEBHOOK_RETRY=[0.05] * 8,
        BREAKER={"THRESHOLD": 2, "COOL_OFF": 0.4, "SCOPE": "host"},
    )
    send_webhook("ops", "alert.raised", {"n": 1})
    runner = start_deliverer()
    wait_until(all_settled(Delivery.objects.get().host), timeout=30)
    runner.stop()
    row = Delivery.objects.get()
    assert row.status == Status.DELIVERED, row.last_error
    assert row.attempts == len(receiver.received) == failures + 1


def test_every_retry_refusal_and_give_up_is_one_warning_naming_the_destination_not_its_url(
    inboxes: Callable[..., Inbox],
    start_deliverer: Callable[..., RunningDeliverer],
    settings: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    answers = {"/refusing": [503, 404], "/failing": [503, 503, 503]}

    def scripted(request: Received) -> tuple[int, dict[str, str], bytes]:
        return answers[request.path].pop(0), {}, b"nope"

    receiver = inboxes("127.0.0.1", respond=scripted)
    webhooks = {"refusing": signed(receiver, "/refusing"), "failing": signed(receiver, "/failing")}
    configure(settings, webhooks, WEBHOOK_RETRY=[0.05, 0.05])
    caplog.set_level(logging.WARNING, logger="django_federation_delivery")
    send_webhook(["refusing", "failing"], "alert.raised", {"n": 1})
    runner = start_deliverer()
    wait_until(lambda: not Delivery.objects.filter(status=Status.PENDING).exists())
    runner.stop()
    ids = dict(Delivery.objects.values_list("destination", "id"))
    lines = sorted(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    refusing = f"Webhook event alert.raised (delivery {ids['refusing']}) to 'refusing'"
    failing = f"Webhook event alert.raised (delivery {ids['failing']}) to 'failing'"
    assert [line.split(":")[0] for line in lines] == sorted(
        [
            f"{failing} failed, attempt 1 of 3",
            f"{failing} failed, attempt 2 of 3",
            f"{failing} given up",
            f"{refusing} failed, attempt 1 of 3",
            f"{refusing} refused for good",
        ]
    )
    retried = [line for line in lines if "failed, attempt" in line]
    assert all(re.search(r"; tried again in \d+\.\d s, at 20\d\d-", line) for line in retried)
    (given_up,) = (line for line in lines if line.startswith(f"{failing} given up"))
    (refused,) = (line for line in lines if line.startswith(f"{refusing} refused"))
    assert given_up.endswith(
        "given up: gave up after 3 attempts: the receiver answered 503 Service Unavailable: nope"
    )
    assert refused.endswith("refused for good: the receiver answered 404 Not Found: nope")
    for line in lines:
        assert SECRET not in line and str(receiver.port) not in line


def test_an_event_sent_long_ago_is_signed_when_it_is_sent_and_verifies(
    inboxes: Callable[..., Inbox], settings: Any
) -> None:
    """A Standard Webhooks library refuses a timestamp five minutes from its
    clock: an event that waited (behind a failing one, for a stopped
    deliverer, for its ninth try) must be signed at its attempt, not when
    it was queued."""
    refused: list[str] = []

    def verify(request: Received) -> tuple[int, dict[str, str], bytes]:
        try:
            Webhook(SECRET).verify(request.body, request.headers)
        except WebhookVerificationError as exc:
            refused.append(str(exc))
            return 401, {}, b""
        return 204, {}, b""

    receiver = inboxes("127.0.0.1", respond=verify)
    configure(settings, {"audit": signed(receiver)})
    six_minutes_ago = timezone.now() - datetime.timedelta(minutes=6)
    with mock.patch.object(webhook_sending, "event_time", return_value=six_minutes_ago):
        send_webhook("audit", "user.created", {"name": "Zoë"}, event_id="evt_6")
    Deliverer().run(drain=True)

    (request,) = receiver.received
    assert refused == []
    assert Delivery.objects.get().status == Status.DELIVERED
    assert json.loads(request.body)["timestamp"] == six_minutes_ago.isoformat().replace(
        "+00:00", "Z"
    )
    assert request.headers["webhook-id"] == "evt_6"
    assert int(request.headers["webhook-timestamp"]) > six_minutes_ago.timestamp() + 300


def wait_for_drains(condition: Callable[[], bool], rounds: int = 40) -> None:
    """Drain the queue again and again (each until nothing is due) until ``condition``."""
    for _ in range(rounds):
        Deliverer().run(drain=True)
        if condition():
            return
        threading.Event().wait(0.1)  # the retry's 0.1 s
    raise AssertionError(f"not after {rounds} drains: {condition}")


@pytest.mark.parametrize(
    ("schedule", "retry_after", "waited"),
    [
        ([30], None, 30),
        ([30], "5", 30),  # never sooner than the schedule
        ([30], "600", 600),  # as long as asked
        ([30], "99999", 3600),  # but no more than an hour
        ([7200], "99999", 7200),  # or the schedule's own wait, when longer
    ],
)
def test_retry_after_is_waited_within_the_schedule_and_an_hour(
    inboxes: Callable[..., Inbox],
    settings: Any,
    schedule: list[float],
    retry_after: str | None,
    waited: float,
) -> None:
    headers = {} if retry_after is None else {"Retry-After": retry_after}
    receiver = inboxes("127.0.0.1", respond=lambda request: (429, headers, b"slow down"))
    configure(settings, {"chat": f"slack+http://127.0.0.1:{receiver.port}/services/T1/B1/x1"})
    settings.FEDERATION_DELIVERY["WEBHOOK_RETRY"] = schedule
    send_webhook("chat", "alert.raised", {"n": 0})
    Deliverer().run(drain=True)
    delivery = Delivery.objects.get()
    assert delivery.status == Status.PENDING and delivery.attempts == 1
    assert delivery.last_status == 429
    assert delivery.last_error == "the receiver answered 429 Too Many Requests: slow down"
    assert delivery.due_at is not None and delivery.last_attempt_at is not None
    assert (delivery.due_at - delivery.last_attempt_at).total_seconds() == pytest.approx(
        waited, abs=1
    )


def test_a_4xx_is_refused_for_good_and_the_next_event_goes(
    inboxes: Callable[..., Inbox], settings: Any, caught: list[tuple[str, Any]]
) -> None:
    def gone_then_back(request: Received) -> tuple[int, dict[str, str], bytes]:
        return (404, {}, b"no_service") if event_n(request) == 0 else (200, {}, b"ok")

    receiver = inboxes("127.0.0.1", respond=gone_then_back)
    configure(settings, {"ops": f"slack+http://127.0.0.1:{receiver.port}/services/T1/B1/x1"})
    send_webhook("ops", "alert.raised", {"n": 0})
    send_webhook("ops", "alert.resolved", {"n": 1})
    Deliverer().run(drain=True)
    refused, delivered = deliveries("<ops>")
    assert (refused.status, refused.attempts, refused.last_status) == (Status.REFUSED, 1, 404)
    assert refused.last_error == "the receiver answered 404 Not Found: no_service"
    assert delivered.status == Status.DELIVERED
    assert [event_n(request) for request in receiver.received] == [0, 1]
    failures = [value for name, value in caught if name == "delivery_failed"]
    assert len(failures) == 1
    failure = failures[0]
    assert (failure.destination, failure.event_type, failure.inbox) == (
        "ops",
        "alert.raised",
        "ops",
    )
    assert failure.refused and failure.status == 404 and failure.sender == ""
    settled = [value for name, value in caught if name == "delivery_settled"]
    assert [(s.destination, s.event_type, s.outcome) for s in settled] == [
        ("ops", "alert.raised", "refused"),
        ("ops", "alert.resolved", "delivered"),
    ]
    attempted = [value for name, value in caught if name == "delivery_attempted"]
    assert {(a.destination, a.outcome) for a in attempted} == {
        ("ops", "refused"),
        ("ops", "delivered"),
    }


def test_after_nine_tries_an_event_is_given_up_and_the_next_goes(
    inboxes: Callable[..., Inbox],
    start_deliverer: Callable[..., RunningDeliverer],
    settings: Any,
    caught: list[tuple[str, Any]],
) -> None:
    # A 500, not a 503: a destination refusing one at a time with a 503 also
    # rests, twice as long each time, which this test of tries is not about.
    def failing_for_the_first(request: Received) -> tuple[int, dict[str, str], bytes]:
        return (500, {}, b"busy") if event_n(request) == 0 else (200, {}, b"")

    receiver = inboxes("127.0.0.1", respond=failing_for_the_first)
    configure(
        settings,
        {"ops": f"discord+http://127.0.0.1:{receiver.port}/api/webhooks/1/t0ken"},
        WEBHOOK_RETRY=[0.05] * 8,
    )
    send_webhook("ops", "alert.raised", {"n": 0})
    send_webhook("ops", "alert.raised", {"n": 1})
    runner = start_deliverer()
    wait_until(all_settled("<ops>"))
    runner.stop()
    failed, delivered = deliveries("<ops>")
    assert (failed.status, failed.attempts, failed.last_status) == (Status.FAILED, 9, 500)
    assert (
        failed.last_error
        == "gave up after 9 attempts: the receiver answered 500 Internal Server Error: busy"
    )
    assert delivered.status == Status.DELIVERED
    assert [event_n(request) for request in receiver.received] == [0] * 9 + [1]
    (failure,) = [value for name, value in caught if name == "delivery_failed"]
    assert failure.error == failed.last_error and not failure.refused


@pytest.mark.parametrize("away", [False, True], ids=["", "the-database-away-as-it-tells"])
def test_a_removed_destinations_events_are_given_up_in_writing_when_the_loop_starts(
    inboxes: Callable[..., Inbox],
    settings: Any,
    caught: list[tuple[str, Any]],
    caplog: pytest.LogCaptureFixture,
    away: bool,
) -> None:
    receiver = inboxes("127.0.0.1")
    kept = f"slack+http://127.0.0.1:{receiver.port}/services/T1/B1/x1"
    configure(settings, {"kept": kept, "gone": kept.replace("x1", "x2")})
    for n in range(3):
        send_webhook(["gone", "kept"], "alert.raised", {"n": n})
    configure(settings, {"kept": kept})
    caplog.set_level(logging.WARNING, logger="django_federation_delivery")
    # Away, as the batches of what it gave up were read to tell it, once the
    # give-up had committed: nothing was told, nor the batches finished.
    with away_at("id, sender, body, body_sha256" if away else "nothing runs this") as failed:
        Deliverer().run(drain=True)
    assert bool(failed) == away
    gone = deliveries("<gone>")
    assert {d.status for d in gone} == {Status.FAILED}
    # One WARNING each, as for any give-up.
    assert sorted(r.getMessage() for r in caplog.records if "given up" in r.getMessage()) == sorted(
        f"Webhook event alert.raised (delivery {d.id}) to 'gone' given up: "
        "no destination named `gone` is configured any more"
        for d in gone
    )
    assert {d.last_error for d in gone} == {"no destination named `gone` is configured any more"}
    assert {d.status for d in deliveries("<kept>")} == {Status.DELIVERED}
    assert [request.path for request in receiver.received] == ["/services/T1/B1/x1"] * 3
    failures = [value for name, value in caught if name == "delivery_failed"]
    assert sorted(f.delivery_id for f in failures) == [d.id for d in gone]
    assert {(f.destination, f.error) for f in failures} == {
        ("gone", "no destination named `gone` is configured any more")
    }
    assert Batch.objects.filter(finished_at__isnull=True).count() == 0
    finished = sorted(batch.pk for name, batch in caught if name == "batch_finished")
    assert finished == sorted(Batch.objects.values_list("pk", flat=True))


def test_a_destination_removed_while_its_event_waits_to_be_retried_is_given_up_when_it_comes_due(
    inboxes: Callable[..., Inbox],
    start_deliverer: Callable[..., RunningDeliverer],
    settings: Any,
    caught: list[tuple[str, Any]],
) -> None:
    receiver = inboxes("127.0.0.1", respond=lambda request: (503, {}, b""))
    configure(
        settings,
        {"ops": f"slack+http://127.0.0.1:{receiver.port}/services/T1/B1/x1"},
        WEBHOOK_RETRY=[1.0] * 8,
    )
    send_webhook("ops", "alert.raised", {"n": 0})
    send_webhook("ops", "alert.raised", {"n": 1})
    runner = start_deliverer()
    wait_until(lambda: deliveries("<ops>")[0].attempts == 1)
    configure(settings, {}, WEBHOOK_RETRY=[1.0] * 8)
    wait_until(all_settled("<ops>"))
    runner.stop()
    assert {d.last_error for d in deliveries("<ops>")} == {
        "no destination named `ops` is configured any more"
    }
    assert len(receiver.received) == 1
    failures = [value for name, value in caught if name == "delivery_failed"]
    assert len(failures) == 2 and {f.destination for f in failures} == {"ops"}


def test_no_failure_path_leaves_a_secret_in_rows_logs_signals_or_the_status(
    inboxes: Callable[..., Inbox],
    start_deliverer: Callable[..., RunningDeliverer],
    settings: Any,
    caught: list[tuple[str, Any]],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    closed_port: Callable[[], int],
) -> None:
    real_getaddrinfo = socket.getaddrinfo

    def no_such_host(host: Any, *args: Any, **kwargs: Any) -> Any:
        # A name that does not resolve, answered here: no query leaves the machine.
        if host == "hooks.nowhere.invalid":
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return real_getaddrinfo(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", no_such_host)
    plain = socket.create_server(("127.0.0.1", 0))
    plain.settimeout(30)

    def answer_in_plain_text() -> None:
        # What a TLS client meets at a port that does not speak TLS.
        with plain, contextlib.suppress(OSError):
            while True:
                peer, _ = plain.accept()
                with peer:
                    peer.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")

    threading.Thread(target=answer_in_plain_text, daemon=True).start()

    def echo(status: int) -> Callable[[Received], tuple[int, dict[str, str], bytes]]:
        def answer(request: Received) -> tuple[int, dict[str, str], bytes]:
            url = f"http://{request.host}{request.path}"
            text = f"no hook at {url} ({request.path}); {json.dumps({'url': url})}"
            return status, {}, text.encode()

        return answer

    slow = inboxes("127.0.0.1", delay=5.0)
    echo404 = inboxes("127.0.0.1", respond=echo(404))
    echo500 = inboxes("127.0.0.1", respond=echo(500))
    # Numbers long enough never to turn up inside another number (a float in
    # a signal's payload held "998877" once).
    bot = "4815162342:ABCsecretBotToken_x"
    webhooks = {
        "refused": f"slack+http://127.0.0.1:{closed_port()}/services/T0SECRETA/B0SECRETB/rTOKEN1",
        "slow": f"slack+http://127.0.0.1:{slow.port}/services/T0SECRETC/B0SECRETD/sTOKEN2",
        "echo4xx": f"discord+http://127.0.0.1:{echo404.port}/api/webhooks/9988776655443322/eTOKEN3",
        "echo5xx": f"telegram://{bot}@-1001?api=http://127.0.0.1:{echo500.port}",
        "private": f"http://127.0.0.9:{echo404.port}/hook?secret={SECRET}",
        # TLS to a server that speaks plain HTTP: the handshake fails.
        "tls": f"slack://127.0.0.1:{plain.getsockname()[1]}/services/T0SECRETE/B0SECRETF/tTOKEN4",
        "dns": "slack://hooks.nowhere.invalid/services/T0SECRETG/B0SECRETH/dTOKEN5",
    }
    secrets = [
        "T0SECRET",
        "B0SECRET",
        "TOKEN1",
        "TOKEN2",
        "TOKEN3",
        "TOKEN4",
        "TOKEN5",
        "9988776655443322",
        "ABCsecretBotToken",
        "4815162342",
        SECRET[6:20],
        "/services/",
        "/api/webhooks/",
    ]
    configure(
        settings,
        webhooks,
        # Three tries: each of the slow one's waits its whole timeout.
        WEBHOOK_RETRY=[0.05] * 2,
        # Long enough for the local servers to answer on a machine busy past
        # its cores (the TLS one answers a handshake: at 0.6 s it once timed
        # out nine times running), short of the slow one's 5 s.
        WEBHOOK_TIMEOUT=1.5,
        WEBHOOK_ALLOWED_NETWORKS=["127.0.0.1/32"],
    )
    caplog.set_level(logging.DEBUG)
    send_webhook(list(webhooks), "alert.raised", {"n": 0})
    runner = start_deliverer()
    # The private one waits for its address to be opened, its error said.
    waiting = Delivery.objects.filter(status=Status.PENDING).exclude(
        inbox="private", last_error__contains="not a public address"
    )
    wait_until(lambda: not waiting.exists(), timeout=60)
    runner.stop()

    errors = dict(Delivery.objects.values_list("inbox", "last_error"))
    assert "connection refused" in errors["refused"]
    assert "1.5s" in errors["slow"] or "timed out" in errors["slow"]
    # What each kind declares secret is taken out; the receiver's address is not.
    assert errors["echo4xx"].startswith(
        f"the receiver answered 404 Not Found: no hook at http://127.0.0.1:{echo404.port}[redacted]"
    )
    assert errors["echo5xx"].startswith(
        f"gave up after 3 attempts: the receiver answered 500 Internal Server Error: no hook at "
        f"http://127.0.0.1:{echo500.port}/[redacted]/sendMessage"
    )
    assert "not a public address" in errors["private"]
    assert "TLS" in errors["tls"], errors["tls"]
    assert "resolve" in errors["dns"], errors["dns"]
    status = StringIO()
    call_command("delivery_status", stdout=status)
    places = {
        "rows": json.dumps([*Delivery.objects.values(), *Batch.objects.values()], default=str),
        "logs": caplog.text + "".join(str(record.args) for record in caplog.records),
        "signals": repr(caught),
        "delivery_status": status.getvalue(),
    }
    assert caplog.records and caught
    for place, text in places.items():
        leaked = [secret for secret in secrets if secret in text]
        assert not leaked, f"{leaked} in the {place}"


def test_ntfy_and_matrix_destinations_are_sent_by_the_loop_a_retry_as_the_same_message(
    inboxes: Callable[..., Inbox], settings: Any
) -> None:
    answered: list[str] = []

    def busy_once(request: Received) -> tuple[int, dict[str, str], bytes]:
        answered.append(request.path)
        if len(answered) == 1:
            return 429, {}, b'{"errcode": "M_LIMIT_EXCEEDED", "retry_after_ms": 100}'
        return 200, {}, b'{"event_id": "$x"}'

    phone = inboxes("127.0.0.1")
    room = inboxes("127.0.0.2", respond=busy_once)
    configure(
        settings,
        {
            "phone": f"ntfy+http://tk_phoneToken9@127.0.0.1:{phone.port}/alerts-db?tags=warning",
            "room": f"matrix+http://syt_roomToken42@127.0.0.2:{room.port}/!Room1:example.org",
        },
    )
    send_webhook(["phone", "room"], "alert.raised", {"host": "db-1"}, event_id="evt-9")
    wait_for_drains(lambda: len(room.received) == 2 and len(phone.received) == 1)

    (sent,) = phone.received
    assert (sent.method, sent.path) == ("POST", "/alerts-db")
    assert sent.body == b"alert.raised\nhost: db-1"
    assert sent.headers["Title"] == "alert.raised" and sent.headers["Tags"] == "warning"
    assert sent.headers["Authorization"] == "Bearer tk_phoneToken9"
    first, retry = room.received
    # The same transaction, waited as the homeserver asked: one message.
    assert (first.method, retry.method) == ("PUT", "PUT")
    room_path = "/_matrix/client/v3/rooms/%21Room1%3Aexample.org/send/m.room.message/evt-9."
    assert first.path == retry.path and first.path.startswith(room_path)
    assert json.loads(retry.body) == {
        "msgtype": "m.text",
        "body": "alert.raised\nhost: db-1",
        "m.mentions": {},
    }
    assert retry.headers["Authorization"] == "Bearer syt_roomToken42"
    assert {d.status for d in Delivery.objects.all()} == {Status.DELIVERED}
    assert "syt_roomToken42" not in json.dumps(list(Delivery.objects.values()), default=str)


@pytest.mark.slow
def test_a_slow_receivers_attempt_ends_with_its_lease_however_long_the_webhook_timeout(
    inboxes: Callable[..., Inbox],
    start_deliverer: Callable[..., RunningDeliverer],
    settings: Any,
) -> None:
    # Answering in 14 s, within WEBHOOK_TIMEOUT but past the lease: an attempt
    # that outlasted its lease was taken again by another deliverer, sent
    # again with the same webhook-id, and could never be settled by either.
    sink = inboxes(delay=14.0)
    configure(settings, {"ops": signed(sink)}, WEBHOOK_TIMEOUT=25.0, WEBHOOK_RETRY=[600.0] * 3)
    send_webhook("ops", "alert.raised", {"n": 1})
    # The lease less the margin to write the outcome: 1.5 s to attempt.
    runner = start_deliverer(lease=LEASE_MARGIN_SECONDS + 1.5)

    wait_until(
        lambda: Delivery.objects.filter(attempts=1).exists(),
        timeout=8,
        state=lambda: list(Delivery.objects.values_list("status", "attempts", "last_error")),
    )
    runner.stop()

    row = Delivery.objects.get()
    assert (row.status, row.attempts) == (Status.PENDING, 1), "settled while its lease held"
    assert re.search(r"no complete answer within 1\.[0-5]s$", row.last_error), row.last_error
    assert len(sink.received) == 1


@pytest.mark.django_db(transaction=True)
def test_an_event_to_a_destination_that_no_longer_parses_waits_spending_no_try(
    settings: Any, inbox: Inbox
) -> None:
    # Its kind taken out of CHANNELS while it waited: each try was a failed
    # attempt without a request, until the event was given up.
    kept = queued_then_kind_removed(settings, inbox.port, WEBHOOK_RETRY=[0.05])
    for _ in range(3):
        Deliverer().run(drain=True, stop_after=1)
    row = Delivery.objects.get()
    assert (row.status, row.attempts, inbox.received) == (Status.PENDING, 0, [])
    assert "its scheme 'pager+http' is not one of those known" in row.last_error
    # Put back, the next try sends it.
    settings.FEDERATION_DELIVERY = kept
    deadline = time.monotonic() + 10
    while Delivery.objects.filter(status=Status.PENDING).exists() and time.monotonic() < deadline:
        Deliverer().run(drain=True, stop_after=1)
    row.refresh_from_db()
    assert (row.status, row.attempts, len(inbox.received)) == (Status.DELIVERED, 1, 1)


@pytest.mark.django_db(transaction=True)
def test_a_destination_on_a_refused_address_is_disabled_in_its_time(
    start_deliverer: Callable[..., RunningDeliverer],
    settings: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Its URL names an address no network opened: refused before any
    # request, it says nothing of a host, but the URL is its operator's.
    # Counted as no request, it was never failing, never disabled. (Its
    # events come round every 30 s at the soonest: a tenth of a second here.)
    from django_federation_delivery.webhooks import deliveries as webhook_deliveries

    monkeypatch.setattr(webhook_deliveries, "HELD_LEAST", 0.1)
    told: list[Any] = []

    def receiver(sender: Any, disabled: Any, **kwargs: Any) -> None:
        told.append(disabled)

    secret = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
    configure(
        settings, {"ops": f"http://10.255.255.1:9/hook?secret={secret}"}, WEBHOOK_DISABLE_AFTER=0.5
    )
    signals.webhook_destination_disabled.connect(receiver, weak=False)
    try:
        send_webhook("ops", "alert.raised", {"n": 0})
        send_webhook("ops", "alert.raised", {"n": 1})
        runner = start_deliverer()
        try:
            wait_until(lambda: bool(told), timeout=20)
        finally:
            runner.stop()
    finally:
        signals.webhook_destination_disabled.disconnect(receiver)
    assert [disabled.destination for disabled in told] == ["ops"]
    assert Delivery.objects.filter(last_attempt_at__isnull=False).count() == 0


@pytest.mark.django_db(transaction=True)
def test_a_destination_removed_then_added_back_starts_fresh_not_disabled(
    inboxes: Callable[..., Inbox], settings: Any
) -> None:
    """A destination disabled by a 410 (its hook deleted) is taken out of
    WEBHOOKS, its events given up; set up again later with a new hook under
    the same name, its new events were held for ever behind the old 410,
    a disable no one could undo while it was gone."""
    gone = inboxes("127.0.0.1", respond=lambda request: (410, {}, b"hook deleted"))
    configure(settings, {"ops": signed(gone)})
    send_webhook("ops", "alert.raised", {"n": 0})
    Deliverer().run(drain=True, stop_after=10)
    assert Host.objects.filter(name=delivery_key("ops"), paused_at__isnull=False).exists()

    configure(settings, {})
    Deliverer().run(drain=True, stop_after=10)
    assert Delivery.objects.get().status == Status.FAILED

    working = inboxes("127.0.0.1")
    configure(settings, {"ops": signed(working)})
    send_webhook("ops", "alert.raised", {"n": 1})
    Deliverer().run(drain=True, stop_after=10)
    assert len(working.received) == 1, "the destination added back sends its new event"


class Ledger(Pager):
    """A kind of the host project's whose service answers 410 Gone to an
    event it has recorded already (a retry whose first answer was lost):
    delivered, as its judge() says."""

    name = "ledger"
    label = "Ledger"
    schemes = ("ledger+http",)

    def judge(self, answer: Answer) -> Verdict:
        if answer.status == 410:
            return Verdict(delivered=True)
        return super().judge(answer)


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_410_its_kind_judges_delivered_stays_delivered(
    inboxes: Callable[..., Inbox],
    start_deliverer: Callable[..., RunningDeliverer],
    settings: Any,
) -> None:
    """A kind's judge() "that says the event was delivered stays delivered,
    and is not sent again" (README). One that read a 410 as delivered had
    its event kept pending with no try spent, sent again at every retry
    wait for ever, and every later event to the destination behind it."""
    receiver = inboxes("127.0.0.1", respond=lambda request: (410, {}, b"already recorded"))
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "CHANNELS": [f"{__name__}.Ledger"],
        "WEBHOOKS": {"ledger": f"ledger+http://routingKEY4b7c9@127.0.0.1:{receiver.port}/in"},
        "WEBHOOK_RETRY": [0.1] * 8,
    }
    send_webhook("ledger", "alert.raised", {"n": 0})
    send_webhook("ledger", "alert.raised", {"n": 1})
    runner = start_deliverer()
    time.sleep(2)
    runner.stop()
    statuses = list(Delivery.objects.order_by("id").values_list("status", flat=True))
    assert statuses == [Status.DELIVERED, Status.DELIVERED], (statuses, len(receiver.received))
    assert len(receiver.received) == 2


@pytest.mark.django_db(transaction=True)
def test_the_readmes_third_retry_log_line_waits_what_the_default_schedule_waits(
    inboxes: Callable[..., Inbox],
    start_deliverer: Callable[..., RunningDeliverer],
    settings: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The README's example of a webhook event's third failed try, as the
    # deliverer logs it under the default WEBHOOK_RETRY (30 s, 2 min, 10 min,
    # 30 min, ...): it once said 1800 s, the wait after the fourth.
    text = (Path(__file__).resolve().parent.parent / "README.rst").read_text(encoding="utf-8")
    documented = re.search(r"failed, attempt 3 of 9: (.*); tried again in ([\d.]+) s, at", text)
    assert documented is not None
    error, wait = documented.group(1), documented.group(2)

    def down(request: Received) -> tuple[int, dict[str, str], bytes]:
        return 503, {}, b"upstream timeout"

    receiver = inboxes("127.0.0.1", respond=down)
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "WEBHOOKS": {"ops": signed(receiver)},
    }  # WEBHOOK_RETRY left at its default, as the README's example has it
    caplog.set_level(logging.WARNING, logger="django_federation_delivery")
    send_webhook("ops", "alert.raised", {"host": "db1"})
    runner = start_deliverer()
    for made in (1, 2, 3):
        wait_until(lambda made=made: Delivery.objects.get().attempts >= made, timeout=30)
        if made < 3:
            # Bring the retry forward rather than wait the schedule out, and
            # wake the deliverer (on PostgreSQL idle on its listener until
            # the retry it knows of).
            Delivery.objects.update(due_at=timezone.now())
            wakes.wake_all("default")
    wait_until(lambda: any("attempt 3 of 9" in r.getMessage() for r in caplog.records), timeout=10)
    runner.stop()
    (line,) = (r.getMessage() for r in caplog.records if "attempt 3 of 9" in r.getMessage())
    assert f"attempt 3 of 9: {error}; tried again in {wait} s, at" in line, line
