"""A host project's own kind of destination, end to end: as the README
writes one, and in what a send, a replay, the status and the testing
helpers make of it."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from io import StringIO
from typing import Any

import pytest
from django.core.management import call_command

from django_federation_delivery import send_webhook, signals
from django_federation_delivery.channels import (
    Policy,
)
from django_federation_delivery.deliverer import Deliverer
from django_federation_delivery.models import Delivery, Status

from . import channels
from .conftest import Inbox, Received

KEY = "routingKEY4b7c9"
HERE = "tests.test_own_kinds"


class Pager(channels.Pager):
    """The README's example (tests/channels.py), under schemes of its own."""

    name = "rpager"
    schemes = ("rpager", "rpager+http")


def configure(settings: Any, kinds: list[str], webhooks: dict[str, str], **extra: Any) -> None:
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "CHANNELS": [f"{HERE}.{kind}" for kind in kinds],
        "WEBHOOKS": webhooks,
        **extra,
    }


@pytest.mark.django_db(transaction=True)
def test_kind_that_does_not_import_does_not_make_its_destinations_unconfigured(
    settings: Any, inbox: Inbox
) -> None:
    from django_federation_delivery.checks.webhooks import check_removed_destinations
    from django_federation_delivery.webhooks.status import destination_status

    configure(settings, ["Pager"], {"oncall": f"rpager+http://{KEY}@127.0.0.1:{inbox.port}/p"})
    send_webhook("oncall", "alert.raised", {})
    # A deploy whose kind's module fails to import (a dependency missing):
    # E035 says so; the destination is still configured in WEBHOOKS.
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "CHANNELS": [f"{HERE}.Pager", "tests.no_such_module.Pager"],
    }
    (status,) = destination_status()
    warnings = check_removed_destinations(databases=["default"])
    out = StringIO()
    call_command("delivery_status", stdout=out)
    shown = [line for line in out.getvalue().splitlines() if line.startswith("oncall")]
    # It is configured, and its events are held, none sent, until its kind
    # loads again: never "no longer configured", "sending", nor a warning
    # that the next deliverer gives them up (none does: it holds them).
    assert (status.configured, status.misconfigured) == (True, True), (shown, status)
    assert [w.msg for w in warnings] == [], shown


class Feed(Pager):
    """A feed: each event as soon as it can, a failing one holding none
    back, in the low lane (a catch-up never delays the alerts)."""

    name = "feed"
    label = "Feed"
    schemes = ("feed+http",)

    def policy(self) -> Policy:
        return dataclasses.replace(super().policy(), schedule=(5.0,), ordered=False, lane="low")


@pytest.mark.django_db(transaction=True)
def test_a_replay_to_an_unordered_kind_follows_its_policy(
    inboxes: Callable[..., Inbox], settings: Any
) -> None:
    import datetime as dt

    from django_federation_delivery.replay import replay

    lock = threading.Lock()
    replayed: list[str] = []

    def feed(request: Received) -> tuple[int, dict[str, str], bytes]:
        with lock:
            key = request.json()["dedup_key"]
            if len([1 for r in server.received if r.json()["dedup_key"] == key]) == 2:
                replayed.append(key)
                if key == "e0":
                    return 503, {}, b"busy"
        return 202, {}, b'{"status": "success"}'

    server = inboxes("127.0.0.1", respond=feed)
    configure(settings, ["Feed"], {"news": f"feed+http://{KEY}@127.0.0.1:{server.port}/feed"})
    since = dt.datetime.now(dt.UTC) - dt.timedelta(minutes=1)
    for n in range(2):
        send_webhook("news", "post.published", {"n": n}, event_id=f"e{n}")
    Deliverer().run(drain=True, stop_after=10)
    assert set(Delivery.objects.values_list("status", flat=True)) == {Status.DELIVERED}
    batches = replay(destination="news", since=since)
    assert len(batches) == 2
    Deliverer().run(drain=True, stop_after=3)
    copies = list(Delivery.objects.filter(batch__in=batches).order_by("id"))
    # Unordered, as a send to it is: the copy of e1 goes while e0's waits
    # for its retry, 5 s on; and in its kind's lane, as a send's is. It was
    # held behind e0's, in the webhook lane.
    assert sorted(replayed) == ["e0", "e1"], (
        replayed,
        [(d.status, d.attempts, d.sequence, d.after_id) for d in copies],
    )
    assert [b.lane for b in batches] == ["low", "low"]


class TwoStep(Pager):
    """A kind whose attempt is its own (a token fetched, then the page
    posted): its error tells what the service said, which echoes the key."""

    name = "twostep"
    label = "Two-step"
    schemes = ("twostep+http",)

    def attempt(self, job: Any, transport: Any, **kwargs: Any) -> Any:
        from django_federation_delivery.attempt import failed

        key = job.destination.options["key"]
        error = f"the token service answered 403: key {key} is not known"
        return failed(job, error, permanent=False)


@pytest.mark.django_db(transaction=True)
def test_an_own_attempts_error_is_redacted(
    settings: Any, inbox: Inbox, caplog: pytest.LogCaptureFixture
) -> None:
    configure(
        settings,
        ["TwoStep"],
        {"oncall": f"twostep+http://{KEY}@127.0.0.1:{inbox.port}/p"},
        WEBHOOK_RETRY=[60.0],
    )
    told: list[str] = []

    def attempted(sender: Any, attempt: signals.Attempted, **kwargs: Any) -> None:
        told.append(attempt.error)

    signals.delivery_attempted.connect(attempted)
    try:
        send_webhook("oncall", "alert.raised", {})
        Deliverer().run(drain=True, stop_after=5)
    finally:
        signals.delivery_attempted.disconnect(attempted)
    # Written, told and logged redacted, as the built-in kinds' errors are;
    # a kind's own attempt was given back as it came.
    row = Delivery.objects.get()
    shown = {"row": row.last_error, "signal": told, "log": caplog.text}
    assert row.attempts == 1
    assert not any(KEY in str(text) for text in shown.values()), shown


SIGNING = "whsec_" + "MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"


@pytest.mark.django_db(transaction=True)
def test_testing_helpers_with_another_destination_unusable(
    settings: Any, delivery_outbox: Any, fake_inbox: Any
) -> None:
    from django_federation_delivery.testing import deliver_all

    configure(
        settings,
        ["Pager"],
        {
            "signed": f"https://receiver.example/hooks?secret={SIGNING}",
            # Its kind says its URL will not do: that one destination's
            # problem alone (E031), the others sent to as ever.
            "oncall": "rpager://short@events.pager.example/v2/enqueue",
        },
    )
    # The helpers asked for every destination, and raised for the one that
    # does not parse, whichever was sent to.
    send_webhook("signed", "alert.raised", {"n": 1})
    (out,) = delivery_outbox
    problems = []
    try:
        out.headers()
    except Exception as exc:
        problems.append(f"headers(): {exc!r}")
    deliver_all(fake=fake_inbox)
    received = [(r.status, r.problem) for r in fake_inbox.received]
    statuses = list(Delivery.objects.values_list("status", "last_error"))
    assert not problems and received == [(202, "")], (problems, received, statuses)


#: Held by StuckPager's request() until the test lets it go.
STUCK = threading.Event()


class StuckPager(Pager):
    """A pager that fetches a token as it builds each request, with no time
    limit of its own; the token service hangs."""

    name = "stuckpager"
    schemes = ("stuckpager+http",)

    def request(self, destination: Any, event: Any, *, now: float) -> Any:
        STUCK.wait(20)
        return super().request(destination, event, now=now)


@pytest.mark.django_db(transaction=True)
def test_a_stop_waits_for_a_kinds_code_no_longer_than_its_time_limit(
    settings: Any, inbox: Inbox, caplog: pytest.LogCaptureFixture
) -> None:
    # A round "finishes what is in flight (at most its longest attempt)":
    # with a kind whose request() blocks past its 1 s limit, a run stopped
    # after 1 s ran on until the kind returned, past a task queue's limit.
    configure(
        settings,
        ["StuckPager"],
        {"oncall": f"stuckpager+http://{KEY}@127.0.0.1:{inbox.port}/page"},
        WEBHOOK_TIMEOUT=1.0,
        ATTEMPT_TIMEOUT=1.0,
    )
    send_webhook("oncall", "alert.raised", {"n": 1})
    STUCK.clear()
    try:
        deliverer = Deliverer()
        started = time.monotonic()
        deliverer.run(stop_after=1.0)
        took = time.monotonic() - started
    finally:
        STUCK.set()
    # Its bound: the stop, the longest attempt, and a grace.
    assert took < 1.0 + deliverer.kinds.longest + 3.0, took
    row = Delivery.objects.get()
    assert (row.status, row.attempts) == (Status.PENDING, 0), "left to its lease"
    assert inbox.received == []
    assert any("past their time limit" in r.getMessage() for r in caplog.records)
