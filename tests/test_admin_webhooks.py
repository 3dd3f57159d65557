"""The admin's webhook side: destinations beside the lanes, webhook deliveries, and no secret."""

from __future__ import annotations

import base64
import datetime as dt
import json
import re
import threading
from collections.abc import Callable
from typing import Any

import pytest
from django.contrib.admin.helpers import ACTION_CHECKBOX_NAME
from django.contrib.auth.models import User
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.urls import reverse
from django.utils import timezone

from django_federation_delivery import send_webhook, signals
from django_federation_delivery.deliverer import Deliverer
from django_federation_delivery.management.commands.delivery_status import destinations_check
from django_federation_delivery.models import Batch, Delivery, Host, Status
from django_federation_delivery.webhooks import life
from django_federation_delivery.webhooks.status import destination_status

from .conftest import Inbox, Received
from .operators import queue, settle
from .test_admin import QUEUES_QUERY_BOUND, act, html, login, url

SECRET = "whsec_" + base64.b64encode(b"admin-test-signing-key-32-bytes!").decode()
SLACK = "slack://hooks.slack.com/services/T0ADMIN1/B0ADMIN2/adminS3cretToken"


def configure(settings: Any, webhooks: dict[str, str], **extra: Any) -> None:
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "WEBHOOKS": webhooks,
        **extra,
    }


@pytest.fixture
def operator() -> Client:
    return login("operator")


def later(delivery: Delivery, error: str, status: int = 503) -> None:
    """As the deliverer leaves a delivery it retries in ten minutes."""
    Delivery.objects.filter(pk=delivery.pk).update(
        attempts=2,
        last_status=status,
        last_error=error,
        last_attempt_at=timezone.now(),
        due_at=timezone.now() + dt.timedelta(minutes=10),
    )


def row_of(page: str, name: str) -> str:
    return page.split(f'data-destination="{name}"')[1].split("</tr>")[0]


def cell(row: str, column: str) -> str:
    return re.sub(r"<[^>]+>", "", row.split(f'data-column="{column}">')[1].split("</td>")[0])


# Destinations, on the queues page and their own.


@pytest.mark.django_db
def test_the_queues_page_shows_each_destination_beside_the_lanes(
    operator: Client, settings: Any
) -> None:
    configure(settings, {"ops": SLACK, "audit": f"https://r.example/h?secret={SECRET}"})
    for n in range(3):
        send_webhook("ops", "alert.raised", {"n": n}, event_id=f"e{n}")
    Batch.objects.filter(event_id="e0").update(created_at=timezone.now() - dt.timedelta(minutes=7))
    first = Delivery.objects.get(batch__event_id="e0")
    later(first, "the receiver answered 503 Service Unavailable: busy")
    page = html(operator, url("delivery", "queues"))
    # Beside the lanes: the table right after theirs.
    assert page.index('id="fd-lanes"') < page.index('id="fd-destinations"')
    assert page.index('id="fd-destinations"') < page.index('id="fd-failing-hosts"')

    ops = row_of(page, "ops")
    assert cell(ops, "kind") == "Slack"
    assert cell(ops, "pending") == "3"
    assert cell(ops, "age").startswith("7m ")
    assert cell(ops, "head") == "alert.raised"
    assert f'href="{url("delivery", "change", first.pk)}"' in ops
    assert cell(ops, "attempts") == "2"
    assert cell(ops, "last_error") == "the receiver answered 503 Service Unavailable: busy"
    assert cell(ops, "next_try").startswith("in 9\xa0minutes") or cell(ops, "next_try").startswith(
        "in 10\xa0minutes"
    )
    assert f'href="{url("delivery")}?destination=ops"' in ops
    assert f'href="{url("delivery")}?destination=ops&amp;status__exact=pending"' in ops

    audit = row_of(page, "audit")
    assert (cell(audit, "kind"), cell(audit, "pending"), cell(audit, "head")) == (
        "Signed JSON",
        "0",
        "—",
    )


@pytest.mark.django_db
def test_a_destination_configured_no_more_is_shown_as_given_up_by_the_loop(
    operator: Client, settings: Any
) -> None:
    configure(settings, {"ops": SLACK, "old": SLACK})
    send_webhook(["ops", "old"], "alert.raised", {})
    configure(settings, {"ops": SLACK})
    for page in (
        html(operator, url("delivery", "queues")),
        html(operator, url("delivery", "destinations")),
    ):
        old = row_of(page, "old")
        assert "no longer configured" in cell(old, "kind")
        assert "gives up its pending events" in cell(old, "kind")
        assert cell(old, "pending") == "1"


@pytest.mark.django_db
def test_the_destinations_page_lists_them_and_links_to_their_deliveries(
    operator: Client, settings: Any
) -> None:
    configure(settings, {"ops": SLACK, "chat": "telegram://1234:SecretBotTok@-1001"})
    send_webhook(["ops", "chat"], "deploy.finished", {})
    page = html(operator, url("delivery", "destinations"))
    assert "<h1>Webhook destinations</h1>" in page
    assert [cell(row_of(page, name), "kind") for name in ("chat", "ops")] == ["Telegram", "Slack"]
    assert url("delivery", "destinations") in html(operator, url("delivery"))
    assert url("delivery", "destinations") in html(operator, url("delivery", "queues"))
    # The link lists that destination's deliveries, and only them.
    response = operator.get(f"{url('delivery')}?destination=chat")
    assert [row.inbox for row in response.context["cl"].result_list] == ["chat"]


@pytest.mark.django_db
def test_with_no_destination_the_table_says_so(operator: Client) -> None:
    page = html(operator, url("delivery", "destinations"))
    assert "No webhook destination is configured" in page


@pytest.mark.django_db
def test_the_destinations_page_needs_the_view_permission(settings: Any) -> None:
    configure(settings, {"ops": SLACK})
    assert login("nobody", ()).get(url("delivery", "destinations")).status_code == 403
    anonymous = Client().get(url("delivery", "destinations"))
    assert anonymous.status_code == 302 and "/login/" in anonymous["Location"]
    assert "ops" in html(login("viewer", ("view",)), url("delivery", "destinations"))


def _destinations(settings: Any, count: int) -> None:
    """``count`` destinations, each with three events, the first failing."""
    names = [f"d{n:02}" for n in range(count)]
    configure(settings, {name: SLACK for name in names})
    for n in range(3):
        send_webhook(names, "alert.raised", {"n": n})
    for delivery in Delivery.objects.order_by("id")[:count]:
        later(delivery, "the receiver answered 503")


@pytest.mark.parametrize("count", [1, 20])
@pytest.mark.django_db
def test_the_pages_make_a_bounded_number_of_queries_whatever_the_destinations(
    operator: Client, settings: Any, count: int, django_assert_max_num_queries: Any
) -> None:
    _destinations(settings, count)
    html(operator, url("delivery", "queues"))  # the session and such, settled once
    with django_assert_max_num_queries(QUEUES_QUERY_BOUND):
        page = html(operator, url("delivery", "queues"))
    assert page.count("data-destination=") == count
    # The session, the user and their permissions (two), the destinations' three.
    with django_assert_max_num_queries(7):
        page = html(operator, url("delivery", "destinations"))
    assert page.count("data-destination=") == count


@pytest.mark.django_db
def test_as_many_queries_for_20_destinations_as_for_1(operator: Client, settings: Any) -> None:
    counts = []
    for count in (1, 20):
        Delivery.objects.all().delete()
        Batch.objects.all().delete()
        _destinations(settings, count)
        for page in ("queues", "destinations"):
            html(operator, url("delivery", page))
            with CaptureQueriesContext(connection) as captured:
                html(operator, url("delivery", page))
            counts.append((page, count, len(captured)))
    assert [n for *_, n in counts[:2]] == [n for *_, n in counts[2:]], counts


# Webhook deliveries in the deliveries list and pages.


@pytest.mark.django_db
def test_a_webhook_delivery_shows_its_destination_and_event_never_a_url(
    operator: Client, settings: Any
) -> None:
    configure(settings, {"ops": SLACK})
    send_webhook("ops", "alert.raised", {"host": "db1"}, event_id="evt-42")
    delivery = Delivery.objects.get()
    listing = html(operator, url("delivery"))
    assert "&lt;ops&gt;" in listing
    assert '<td class="field-event">alert.raised</td>' in listing
    page = html(operator, url("delivery", "change", delivery.pk))
    for field, value in (("destination", "ops"), ("event", "alert.raised"), ("event_id", "evt-42")):
        assert re.search(rf'field-{field}">.*?<div class="readonly">{value}</div>', page, re.S), (
            field
        )
    assert "&quot;host&quot;: &quot;db1&quot;" in page
    assert "hooks.slack.com" not in listing + page
    # The batch's pages, too.
    batch_list = html(operator, url("batch"))
    assert '<td class="field-event">alert.raised</td>' in batch_list
    batch_page = html(operator, url("batch", "change", delivery.batch_id))
    assert re.search(
        r'field-shown_event_id">.*?<div class="readonly">evt-42</div>', batch_page, re.S
    )


@pytest.mark.django_db
def test_deliveries_filter_by_kind_and_by_destination(operator: Client, settings: Any) -> None:
    configure(settings, {"ops": SLACK, "audit": f"https://r.example/h?secret={SECRET}"})
    queue()  # four activities
    send_webhook(["ops", "audit"], "alert.raised", {})
    send_webhook("ops", "alert.resolved", {})

    def listed(query: str) -> list[str]:
        response = operator.get(f"{url('delivery')}?{query}")
        assert response.status_code == 200
        return sorted(row.inbox for row in response.context["cl"].result_list)

    assert len(listed("kind=activitypub")) == 4
    assert listed("kind=webhook") == ["audit", "ops", "ops"]
    assert listed("destination=ops") == ["ops", "ops"]
    assert listed("destination=gone") == []
    assert listed("q=alert.resolved") == ["ops"]
    page = html(operator, url("delivery"))
    assert "?destination=audit" in page and "?kind=webhook" in page


@pytest.mark.django_db
def test_giving_up_a_webhook_delivery_tells_its_destination_and_event_and_frees_the_next(
    operator: Client, settings: Any, django_capture_on_commit_callbacks: Any
) -> None:
    configure(settings, {"ops": SLACK})
    send_webhook("ops", "alert.raised", {}, event_id="e0")
    send_webhook("ops", "alert.resolved", {}, event_id="e1")
    first, second = Delivery.objects.order_by("id")
    assert second.due_at is None and second.after_id == first.pk
    failures: list[signals.Failure] = []

    def receive(sender: Any, failure: signals.Failure, **kwargs: Any) -> None:
        failures.append(failure)

    signals.delivery_failed.connect(receive, weak=False)
    try:
        with django_capture_on_commit_callbacks(execute=True):
            messages = act(operator, "delivery", "give_up", [first.pk])
    finally:
        signals.delivery_failed.disconnect(receive)
    assert messages == ["Gave up 1 pending delivery; settled ones are left alone."]
    [failure] = failures
    assert (failure.destination, failure.event_type, failure.inbox) == (
        "ops",
        "alert.raised",
        "ops",
    )
    assert Delivery.objects.get(pk=first.pk).status == Status.FAILED
    second.refresh_from_db()
    assert second.due_at is not None, "the next event to ops no longer waits"


# With a deliverer and a real receiver on loopback.


@pytest.fixture
def receiver(inboxes: Callable[..., Inbox]) -> tuple[Inbox, threading.Event]:
    """A receiver that answers 503 until ``up`` is set, then 204."""
    up = threading.Event()

    def answer(request: Received) -> tuple[int, dict[str, str], bytes]:
        return (204 if up.is_set() else 503), {}, b"down for now"

    return inboxes("127.0.0.1", respond=answer), up


def drain_until(condition: Callable[[], bool], rounds: int = 40) -> None:
    for _ in range(rounds):
        Deliverer().run(drain=True)
        if condition():
            return
        threading.Event().wait(0.1)
    raise AssertionError(f"not after {rounds} drains: {condition}")


@pytest.mark.django_db(transaction=True)
def test_a_failed_webhook_delivery_requeued_is_pending_then_delivered(
    operator: Client, settings: Any, receiver: tuple[Inbox, threading.Event]
) -> None:
    inbox, up = receiver
    configure(
        settings,
        {"ops": f"markdown+http://127.0.0.1:{inbox.port}/hooks/k3y"},
        WEBHOOK_RETRY=[0.05],
    )
    send_webhook("ops", "alert.raised", {"n": 1})
    drain_until(lambda: Delivery.objects.get().status == Status.FAILED)
    failed = Delivery.objects.get()
    assert (failed.attempts, failed.last_status) == (2, 503)

    messages = act(operator, "delivery", "requeue", [failed.pk])
    assert messages == [
        "Requeued 1 delivery, due now, after what it waits on, or once its paused host is "
        "resumed; pending or delivered ones, those past their batch's deadline, and those a "
        "later Delete or Undo of their sender took back, are left alone."
    ]
    failed.refresh_from_db()
    assert failed.status == Status.PENDING
    row = row_of(html(operator, url("delivery", "destinations")), "ops")
    assert (cell(row, "pending"), cell(row, "next_try")) == ("1", "due now")

    up.set()
    drain_until(lambda: Delivery.objects.get().status == Status.DELIVERED)
    assert len(inbox.received) == 3
    assert json.loads(inbox.received[-1].body)["text"].startswith("alert.raised")


@pytest.mark.django_db(transaction=True)
def test_no_admin_page_shows_a_destination_s_url_path_token_or_secret(
    inboxes: Callable[..., Inbox], settings: Any, closed_port: Callable[[], int]
) -> None:
    def echo(status: int) -> Callable[[Received], tuple[int, dict[str, str], bytes]]:
        # A receiver that quotes the URL it was sent to in its answer.
        def answer(request: Received) -> tuple[int, dict[str, str], bytes]:
            where = f"http://{request.host}{request.path}"
            return status, {}, f"no hook at {where}; {json.dumps({'url': where})}".encode()

        return answer

    echo404 = inboxes("127.0.0.1", respond=echo(404))
    echo500 = inboxes("127.0.0.1", respond=echo(500))
    # Numbers long enough never to turn up inside another (an id, a time).
    bot = "9876543210:AAtelegramAdminTokenZ"
    webhooks = {
        "slack": f"slack+http://127.0.0.1:{echo500.port}/services/T0ADMSEC/B0ADMSEC/sLackTOKEN7",
        "telegram": f"telegram://{bot}@-1001?api=http://127.0.0.1:{echo404.port}",
        "signed": f"http://127.0.0.1:{echo500.port}/rcv-path-9f3k/hook?secret={SECRET}",
        "down": f"markdown+http://127.0.0.1:{closed_port()}/hooks/mdTOKEN8",
        "gone": f"discord+http://127.0.0.1:{closed_port()}/api/webhooks/5566778899001122/dTOKEN9",
    }
    secrets = [
        "T0ADMSEC",
        "B0ADMSEC",
        "sLackTOKEN7",
        "/services/",
        "AAtelegramAdminToken",
        "9876543210",
        "rcv-path-9f3k",
        SECRET,
        SECRET[6:30],
        "mdTOKEN8",
        "/hooks/",
        "5566778899001122",
        "dTOKEN9",
        "/api/webhooks/",
    ]
    # Retried in ten minutes: pending, with their first errors to show.
    configure(settings, webhooks, WEBHOOK_RETRY=[600] * 8)
    for n in range(2):
        send_webhook(list(webhooks), "alert.raised", {"n": n})
    Deliverer().run(drain=True)
    # "gone" is configured no more: its events are still pending, until the loop starts.
    configure(settings, {k: v for k, v in webhooks.items() if k != "gone"}, WEBHOOK_RETRY=[600] * 8)

    errors = dict(
        Delivery.objects.filter(attempts__gt=0).order_by("-id").values_list("inbox", "last_error")
    )
    # What each kind declares secret is taken out; the receiver's address is not.
    assert errors["slack"].startswith(
        f"the receiver answered 500 Internal Server Error: no hook at http://127.0.0.1:{echo500.port}[redacted]"
    )
    assert errors["telegram"].startswith(
        f"the receiver answered 404 Not Found: no hook at http://127.0.0.1:{echo404.port}/[redacted]"
    )
    assert "connection refused" in errors["down"]
    assert Delivery.objects.filter(status=Status.REFUSED).exists()
    assert Delivery.objects.filter(status=Status.PENDING, attempts__gt=0).exists()

    admin = User.objects.create_superuser("root", password="not-a-secret-here")
    client = Client()
    client.force_login(admin)
    pages = [
        url("delivery", "queues"),
        url("delivery", "destinations"),
        url("delivery"),
        f"{url('delivery')}?kind=webhook",
        f"{url('delivery')}?status__exact=refused",
        url("batch"),
        url("breaker"),
        url("host"),
        *(f"{url('delivery')}?destination={name}" for name in webhooks),
        *(url("delivery", "change", pk) for pk in Delivery.objects.values_list("pk", flat=True)),
        *(url("batch", "change", pk) for pk in Batch.objects.values_list("pk", flat=True)),
    ]
    for address in pages:
        text = html(client, address)
        leaked = [secret for secret in secrets if secret in text]
        assert not leaked, f"{leaked} in {address}"
    queues_page = html(client, url("delivery", "queues"))
    assert "[redacted]" in cell(row_of(queues_page, "slack"), "last_error")
    assert "no longer configured" in cell(row_of(queues_page, "gone"), "kind")


@pytest.mark.django_db
def test_an_activity_delivery_shows_no_destination_or_event(operator: Client) -> None:
    delivery = queue().deliveries.order_by("id").first()
    assert delivery is not None
    settle(delivery, Status.FAILED, last_status=500)
    page = html(operator, url("delivery", "change", delivery.pk))
    assert "field-destination" not in page and "field-event_id" not in page
    assert '<td class="field-event">—</td>' in html(operator, url("delivery"))


@pytest.mark.django_db
def test_enabling_a_destination_again_needs_the_change_permission_on_hosts(
    settings: Any,
) -> None:
    # Enabling resumes the destination's Host row, as the hosts' Resume
    # action does: it needs what that action needs.
    configure(settings, {"ops": SLACK})
    send_webhook("ops", "alert.raised", {"n": 0})
    life.disable("ops", "the receiver answered 410 Gone")
    pages = (url("delivery", "queues"), url("delivery", "destinations"))
    enable = reverse("admin:federation_delivery_delivery_enable_destination")
    deliveries_only = login("deliveries_only", ("view", "change_delivery"))
    resume = {"action": "resume", ACTION_CHECKBOX_NAME: ["<ops>"], "index": "0"}
    assert deliveries_only.post(url("host"), resume).status_code == 403
    for page in pages:
        assert "Enable again" not in html(deliveries_only, page), page
    assert deliveries_only.post(enable, {"name": "ops"}).status_code == 403
    assert Host.objects.get(name="<ops>").paused_at is not None
    hosts = login("hosts", ("view", "change_host"))
    for page in pages:
        assert "Enable again" in html(hosts, page), page
    assert hosts.post(enable, {"name": "ops"}).status_code == 302
    assert Host.objects.get(name="<ops>").paused_at is None


@pytest.mark.django_db
def test_enabling_a_destination_no_longer_disabled_changes_nothing_and_says_so(
    operator: Client, settings: Any
) -> None:
    # The page was loaded while "ops" was disabled; since, it was enabled
    # (enable_webhook, another operator) and fails again: its first event
    # waits out a retry, and its failing clock runs. The stale button's POST
    # cleared the clock, made the event due now and said "ops enabled again".
    configure(settings, {"ops": SLACK})
    send_webhook("ops", "alert.raised", {"n": 0})
    failing_since = timezone.now() - dt.timedelta(days=2)
    Host.objects.create(name="<ops>", failing_since=failing_since)
    later(Delivery.objects.get(), "HTTP 503")
    retry_at = Delivery.objects.get().due_at
    response = operator.post(
        reverse("admin:federation_delivery_delivery_enable_destination"),
        {"name": "ops"},
        follow=True,
    )
    [message] = list(response.context["messages"])
    assert (message.level_tag, str(message)) == ("warning", "ops is not disabled: nothing to do.")
    assert Host.objects.get(name="<ops>").failing_since == failing_since
    assert Delivery.objects.get().due_at == retry_at


@pytest.mark.django_db
def test_a_destination_resumed_from_the_hosts_list_and_paused_again_reads_as_paused(
    operator: Client, settings: Any
) -> None:
    # Resumed as any host is, a disabled destination keeps no reason of its
    # own: an operator's pause later is no 410.
    configure(settings, {"ops": SLACK})
    send_webhook("ops", "alert.raised", {"n": 0})
    life.disable("ops", "the receiver answered 410 Gone")
    act(operator, "host", "resume", ["<ops>"])
    [ops] = destination_status()
    assert (ops.disabled, ops.disabled_reason) == (False, "")
    act(operator, "host", "pause", ["<ops>"])
    [ops] = destination_status()
    assert ops.state(timezone.now()).startswith("paused by an operator ")
    code, line = destinations_check(using="default")
    assert code == 2 and "ops (1 waiting): paused" in line and "410" not in line


@pytest.mark.django_db
def test_a_disabled_destination_s_reason_is_shown_escaped(settings: Any, operator: Client) -> None:
    # The state cell ("disabled 2m ago: <reason>") showed a reason a row
    # holds (one written by hand) with its bidi override and escape as they
    # are; every other cell, and delivery_status, escape them.
    from .test_admin import assert_shown_as_text

    configure(settings, {"ops": SLACK})
    send_webhook("ops", "alert.raised", {"n": 1})
    Host.objects.update_or_create(
        name="<ops>", defaults={"paused_at": timezone.now(), "disabled_reason": "gone\u202e\x1b[2J"}
    )
    for page in (url("delivery", "queues"), url("delivery", "destinations")):
        assert_shown_as_text(html(operator, page))
