"""Webhook destinations at a glance: names and kinds only, the first in line, two queries."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from django_federation_delivery import controls, send, send_webhook
from django_federation_delivery.models import Batch, Delivery, Status
from django_federation_delivery.webhooks.status import MISCONFIGURED, destination_status

pytestmark = pytest.mark.django_db

SECRET = "whsec_" + "QUJDREVGR0hJSktMTU5PUFFSU1RVVldYWVo0NTY3ODk="
WEBHOOKS = {
    "ops": "slack://hooks.slack.com/services/T0AAAA1/B0BBBB2/s3cretT0kenV4lue9",
    "audit": f"https://receiver.example/hooks?secret={SECRET}",
    "chat": "telegram://123456:ABCsecretBotToken@-1001",
}


def configure(settings: Any, webhooks: dict[str, str]) -> None:
    settings.FEDERATION_DELIVERY = {**settings.FEDERATION_DELIVERY, "WEBHOOKS": webhooks}


def fail(delivery: Delivery, error: str, *, status: int | None = 503, attempts: int = 2) -> None:
    """As the deliverer leaves a delivery it will retry in ten minutes."""
    Delivery.objects.filter(pk=delivery.pk).update(
        attempts=attempts,
        last_status=status,
        last_error=error,
        last_attempt_at=timezone.now(),
        due_at=timezone.now() + dt.timedelta(minutes=10),
    )


def test_each_configured_destination_is_listed_by_name_and_kind_with_nothing_pending(
    settings: Any,
) -> None:
    configure(settings, WEBHOOKS)
    found = destination_status()
    assert [(d.name, d.kind, d.configured, d.pending, d.head) for d in found] == [
        ("audit", "Signed JSON", True, 0, None),
        ("chat", "Telegram", True, 0, None),
        ("ops", "Slack", True, 0, None),
    ]
    assert (found[0].oldest_queued_at, found[0].age) == (None, 0.0)
    shown = repr(found)
    for secret in ("hooks.slack.com", "s3cretT0ken", "receiver.example", SECRET[6:], "ABCsecret"):
        assert secret not in shown


def test_the_first_in_line_is_the_oldest_pending_event_that_the_others_wait_on(
    settings: Any,
) -> None:
    configure(settings, WEBHOOKS)
    for n in range(3):
        send_webhook(["ops", "audit"], f"alert.n{n}", {"n": n}, event_id=f"e{n}")
    # The first event was queued five minutes ago and fails; the rest wait on it.
    Batch.objects.filter(event_id="e0").update(created_at=timezone.now() - dt.timedelta(minutes=5))
    first = Delivery.objects.get(host="<ops>", batch__event_id="e0")
    fail(first, "the receiver answered 503 Service Unavailable: busy")
    now = timezone.now()
    by_name = {d.name: d for d in destination_status(now=now)}

    ops = by_name["ops"]
    assert ops.pending == 3
    assert 5 * 60 <= ops.age < 5 * 60 + 30
    assert ops.head is not None
    assert (ops.head.delivery_id, ops.head.event_type, ops.head.event_id) == (
        first.pk,
        "alert.n0",
        "e0",
    )
    assert (ops.head.attempts, ops.head.last_status) == (2, 503)
    assert ops.head.last_error == "the receiver answered 503 Service Unavailable: busy"
    assert ops.head.due_at is not None and ops.head.due_at > now
    assert not ops.head.in_flight
    assert by_name["audit"].pending == 3
    assert by_name["audit"].head is not None and by_name["audit"].head.attempts == 0
    assert by_name["chat"].pending == 0

    # Given up, it holds nothing: the next one is first in line.
    controls.give_up(Delivery.objects.filter(pk=first.pk))
    ops = {d.name: d for d in destination_status()}["ops"]
    assert ops.pending == 2
    assert ops.head is not None and ops.head.event_id == "e1"


def test_a_requeued_event_is_first_in_line_again(settings: Any) -> None:
    configure(settings, WEBHOOKS)
    for n in range(2):
        send_webhook("ops", "alert.raised", {"n": n}, event_id=f"e{n}")
    first = Delivery.objects.get(batch__event_id="e0")
    controls.give_up(Delivery.objects.filter(pk=first.pk))
    controls.requeue(Delivery.objects.filter(pk=first.pk))
    ops = {d.name: d for d in destination_status()}["ops"]
    assert ops.pending == 2
    assert ops.head is not None and ops.head.delivery_id == first.pk


def test_a_destination_configured_no_more_is_listed_while_it_has_pending_events(
    settings: Any,
) -> None:
    configure(settings, WEBHOOKS)
    send_webhook(["ops", "chat"], "alert.raised", {})
    configure(settings, {"ops": WEBHOOKS["ops"]})
    found = destination_status()
    assert [(d.name, d.kind, d.configured, d.pending) for d in found] == [
        ("ops", "Slack", True, 1),
        ("chat", "", False, 1),
    ]
    controls.give_up(Delivery.objects.filter(host="<chat>"))
    assert [d.name for d in destination_status()] == ["ops"]


def test_a_destination_whose_url_does_not_parse_says_so_and_not_why(settings: Any) -> None:
    configure(
        settings, {"ops": "slack://hooks.slack.com/", "audit": "https://r.example/x?secret=no"}
    )
    assert [(d.name, d.kind) for d in destination_status()] == [
        ("audit", MISCONFIGURED),
        ("ops", MISCONFIGURED),
    ]


def test_the_first_in_line_shows_its_error_with_the_destination_s_secrets_taken_out(
    settings: Any,
) -> None:
    configure(settings, WEBHOOKS)
    send_webhook("ops", "alert.raised", {})
    # Stored errors are redacted when written; the status takes them out again.
    fail(
        Delivery.objects.get(),
        "answered 404 Not Found: "
        "no hook at hooks.slack.com/services/T0AAAA1/B0BBBB2/s3cretT0kenV4lue9",
    )
    head = destination_status()[-1].head
    assert head is not None
    assert "s3cretT0ken" not in head.last_error and "[redacted]" in head.last_error


def test_in_flight_is_a_lease_not_yet_lapsed(settings: Any) -> None:
    configure(settings, WEBHOOKS)
    send_webhook("ops", "alert.raised", {})
    Delivery.objects.update(
        lease_token="a-deliverer", due_at=timezone.now() + dt.timedelta(minutes=5)
    )
    head = destination_status()[-1].head
    assert head is not None and head.in_flight


def test_no_webhooks_setting_lists_nothing_and_activities_are_not_destinations(
    settings: Any,
) -> None:
    from .operators import queue

    queue()
    assert destination_status() == ()


@pytest.mark.parametrize("destinations", [1, 20])
def test_three_queries_whatever_the_number_of_destinations(
    settings: Any, destinations: int, django_assert_max_num_queries: Any
) -> None:
    names = [f"d{n}" for n in range(destinations)]
    configure(settings, {name: WEBHOOKS["ops"] for name in names})
    for n in range(3):
        send_webhook(names, "alert.raised", {"n": n})
    for delivery in Delivery.objects.filter(batch__event_type="alert.raised").order_by("id")[
        :destinations
    ]:
        fail(delivery, "the receiver answered 503")
    with django_assert_max_num_queries(3) as captured:
        found = destination_status()
    assert len(found) == destinations
    assert all(d.pending == 3 and d.head is not None for d in found)
    # Of deliveries, pending rows only (by their status, or settled_at as
    # the statements say it): the live queue, never the whole table.
    for query in captured.captured_queries:
        if "federation_delivery_delivery" in query["sql"].partition(" WHERE ")[0]:
            where = query["sql"].partition(" WHERE ")[2]
            assert "'pending'" in where or '"settled_at" IS NULL' in where, query["sql"]


def test_as_many_queries_for_20_destinations_as_for_1(settings: Any) -> None:
    counts = []
    for destinations in (1, 20):
        names = [f"d{n}" for n in range(destinations)]
        configure(settings, {name: WEBHOOKS["ops"] for name in names})
        send_webhook(names, "alert.raised", {})
        with CaptureQueriesContext(connection) as captured:
            destination_status()
        counts.append(len(captured))
    assert counts == [3, 3]


def test_status_ignores_settled_events(settings: Any) -> None:
    configure(settings, WEBHOOKS)
    send_webhook("ops", "alert.raised", {})
    Delivery.objects.update(status=Status.DELIVERED, due_at=None)
    ops = {d.name: d for d in destination_status()}["ops"]
    assert (ops.pending, ops.head, ops.oldest_queued_at) == (0, None, None)


@pytest.mark.django_db(transaction=True)
def test_a_destinations_head_event_is_read_by_key_whatever_the_statistics() -> None:
    # Looked up by id with its status, a destination's head event was found
    # through the due index under statistics of a queue long settled: every
    # pending row of every host read at each look at the status page.
    from django_federation_delivery.models import Kind

    from .conftest import run_explained, statements_of_undone, statistics_of_a_server
    from .keys import ALICE

    statistics_of_a_server()
    send(ALICE, {"type": "Note"}, [f"https://h{n % 100}.example/u{n}/inbox" for n in range(5000)])
    held = Delivery.objects.order_by("-id").values_list("id", flat=True)[:100]
    Delivery.objects.filter(id__in=list(held)).update(
        host="hook.webhook", kind=Kind.WEBHOOK, destination="hook"
    )
    with statements_of_undone() as executed:
        destination_status()
    heads = [(text, plan) for text, plan in run_explained(executed) if '"lease_token"' in text]
    assert heads, executed
    for text, plan in heads:
        assert "fd_delivery_due" not in plan, f"{text}\n{plan}"
