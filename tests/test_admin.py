"""The admin: pages, actions through ``controls``, permissions, and bounded queries."""

from __future__ import annotations

import datetime as dt
import json
import re
from html import unescape
from typing import Any

import pytest
from django.contrib.admin.helpers import ACTION_CHECKBOX_NAME
from django.contrib.admin.utils import quote
from django.db import connection
from django.http import HttpResponse
from django.test import Client, TestCase, override_settings
from django.test.utils import CaptureQueriesContext
from django.urls import reverse
from django.utils import timezone

from django_federation_delivery import (
    controls,
    history,
    send,
    send_batch,
    send_portable,
    send_webhook,
    signals,
)
from django_federation_delivery.admin import hosts as hosts_admin
from django_federation_delivery.admin import next_due
from django_federation_delivery.breakers import BreakerSettings, Scope
from django_federation_delivery.models import (
    Batch,
    Breaker,
    DelivererHeartbeat,
    Delivery,
    DeliveryHistory,
    Host,
    Lane,
    Status,
)
from django_federation_delivery.portable import PortableInbox

from . import operators
from .keys import ALICE
from .operators import NOTE, open_breaker, queue, settle

pytestmark = pytest.mark.django_db

#: The queues page's queries, whatever the row count: the session, the user
#: and their permissions, the overview's own (about eight), one of them
#: the live deliverers' heartbeats, and one for the history's charts.
QUEUES_QUERY_BOUND = 17

#: A key no 64-bit integer column can hold: a number, so ``to_python`` takes it.
PAST_BIGINT = "99999999999999999999"


def url(model: str, view: str = "changelist", *args: Any) -> str:
    return reverse(f"admin:federation_delivery_{model}_{view}", args=args)


def login(username: str, actions: tuple[str, ...] = ("view", "change")) -> Client:
    client = Client()
    client.force_login(operators.user(username, actions))
    return client


@pytest.fixture
def operator() -> Client:
    """Staff with view and change permissions on every model of the app."""
    return login("operator")


@pytest.fixture
def viewer() -> Client:
    """Staff with view permissions only."""
    return login("viewer", ("view",))


def act(client: Client, model: str, action: str, ids: list[Any]) -> list[str]:
    """Run an admin action on rows, as its form does; the messages it left."""
    response = client.post(
        url(model),
        {"action": action, ACTION_CHECKBOX_NAME: [str(id) for id in ids], "index": "0"},
        follow=True,
    )
    # Back on the list, which shows (and so consumes) the messages.
    assert response.redirect_chain == [(url(model), 302)], response.content[:500]
    return [str(message) for message in response.context["messages"]]


def act_on_all(client: Client, model: str, action: str, selected: Any) -> HttpResponse:
    """Run an admin action on every row of the list ("select all"), as its
    form does, with ``selected`` ticked: its answer, not followed."""
    return client.post(
        url(model),
        {
            "action": action,
            "select_across": "1",
            "index": "0",
            ACTION_CHECKBOX_NAME: [str(selected)],
        },
    )


def html(client: Client, address: str) -> str:
    response = client.get(address)
    assert response.status_code == 200, address
    return response.content.decode()


# Pages.


def test_every_page_shows_for_an_operator(operator: Client) -> None:
    batch = queue(tag="greeting")
    delivery = batch.deliveries.order_by("id").first()
    assert delivery is not None
    open_breaker("a.example")
    controls.pause_host("b.example")
    for model, key in (
        ("batch", batch.pk),
        ("delivery", delivery.pk),
        ("breaker", "a.example"),
        ("host", "b.example"),
    ):
        html(operator, url(model))
        page = html(operator, url(model, "change", key))
        # Read-only: nothing to save, add or delete.
        assert 'name="_save"' not in page
        assert "deletelink" not in page
    assert html(operator, url("delivery", "queues")).count('<div class="module" id="fd-') == 7
    assert url("delivery", "queues") in html(operator, url("delivery"))


def test_a_delivery_shows_its_body_pretty_printed_and_read_only(operator: Client) -> None:
    delivery = queue().deliveries.first()
    assert delivery is not None
    page = html(operator, url("delivery", "change", delivery.pk))
    assert '<pre class="fd-body">{\n  &quot;@context&quot;' in page
    assert "<textarea" not in page
    # The list shows no body.
    assert "fd-body" not in html(operator, url("delivery"))


@pytest.mark.parametrize(
    "via",
    [5, {"https://gw.example/?token=s3cret": 1}, [1, 2], "https://gw.example/?token=s3cret"],
    ids=["a number", "an object", "a list of numbers", "a string"],
)
def test_a_delivery_whose_stored_gateways_are_not_a_list_of_urls_shows_its_page(
    operator: Client, via: Any
) -> None:
    # Written by hand: the loop fails it alone, saying so; its page says the same.
    delivery = queue(hosts=["a.example"], per_host=1).deliveries.get()
    Delivery.objects.filter(pk=delivery.pk).update(via=via)
    page = html(operator, url("delivery", "change", delivery.pk))
    shown = page.split("field-shown_via")[1].split("</div>\n")[0]
    assert "its stored gateways (via) are not a list of URLs" in shown
    assert "s3cret" not in page


def test_a_delivery_shows_its_gateways_redacted(operator: Client) -> None:
    delivery = queue(hosts=["a.example"], per_host=1).deliveries.get()
    gateways = ["https://gw.example/inbox?token=s3cret", "https://gw2.example/inbox"]
    Delivery.objects.filter(pk=delivery.pk).update(via=gateways)
    page = html(operator, url("delivery", "change", delivery.pk))
    assert "https://gw.example/inbox, https://gw2.example/inbox" in page
    assert "s3cret" not in page


def test_the_change_form_of_a_row_cannot_be_posted(operator: Client) -> None:
    delivery = queue().deliveries.first()
    assert delivery is not None
    response = operator.post(url("delivery", "change", delivery.pk), {"status": "delivered"})
    assert response.status_code == 403
    assert Delivery.objects.get(pk=delivery.pk).status == Status.PENDING


def test_next_due_is_relative() -> None:
    now = timezone.now()
    batch = Batch(sender="s", body="{}")
    minute = dt.timedelta(minutes=1)
    assert next_due(Delivery(batch=batch, due_at=now), now) == "due now"
    assert next_due(Delivery(batch=batch, due_at=now - 5 * minute), now) == "due 5\xa0minutes ago"
    assert next_due(Delivery(batch=batch, due_at=now + 5 * minute), now) == "in 5\xa0minutes"
    leased = Delivery(batch=batch, due_at=now + 5 * minute, lease_token="t")
    assert next_due(leased, now) == "in flight (lease ends in 5\xa0minutes)"
    assert next_due(Delivery(batch=batch, due_at=None), now) == "held: host paused"
    assert next_due(Delivery(batch=batch, due_at=None, after_id=7), now) == "held: waits on #7"
    assert next_due(Delivery(batch=batch, status=Status.DELIVERED), now) == "—"


def test_a_batch_shows_its_progress_from_one_query_for_the_page(operator: Client) -> None:
    first = queue(per_host=3)
    rows = list(first.deliveries.order_by("id"))
    settle(rows[0], Status.DELIVERED, last_status=202)
    settle(rows[1], Status.DELIVERED, last_status=202)
    settle(rows[2], Status.REFUSED, last_status=403)
    settle(rows[3], Status.FAILED, last_status=500)
    settle(rows[4], Status.SKIPPED)
    page = html(operator, url("batch"))
    assert "2 delivered · 1 refused · 1 failed · 1 skipped · 1 pending" in page
    with CaptureQueriesContext(connection) as few:
        html(operator, url("batch"))
    for _ in range(10):
        queue()
    with CaptureQueriesContext(connection) as many:
        html(operator, url("batch"))
    assert len(many) == len(few), "one query for the page's progress, not one a batch"


def test_a_batch_partly_purged_shows_what_was_purged(operator: Client) -> None:
    # Drawn from the deliveries kept alone, a batch whose delivered rows a
    # purge deleted showed as all failed.
    batch = queue(per_host=2)
    rows = list(batch.deliveries.order_by("id"))
    for row in rows[:3]:
        settle(row, Status.DELIVERED, last_status=202)
    settle(rows[3], Status.FAILED, last_status=500)
    Delivery.objects.filter(id__in=[row.id for row in rows[:3]]).delete()
    assert "1 failed · 3 purged" in html(operator, url("batch", "change", batch.pk))
    assert "1 failed · 3 purged" in html(operator, url("batch"))


# The queues page.


def test_the_queues_page_shows_the_overview(operator: Client) -> None:
    batch = queue(hosts=["a.example", "b.example", "c.example"], per_host=2)
    rows = list(batch.deliveries.order_by("id"))
    now = timezone.now()
    Delivery.objects.filter(pk=rows[0].pk).update(due_at=now - dt.timedelta(minutes=5))
    Delivery.objects.filter(pk=rows[1].pk).update(
        due_at=now + dt.timedelta(minutes=5), attempts=1, last_status=503
    )
    Delivery.objects.filter(pk=rows[2].pk).update(
        due_at=now + dt.timedelta(minutes=5), lease_token="held-by-a-deliverer"
    )
    settle(rows[3], Status.DELIVERED, last_status=202)
    settle(rows[4], Status.FAILED, last_status=500, ago=dt.timedelta(hours=3))
    open_breaker(rows[1].host)
    controls.pause_host("c.example")
    page = html(operator, url("delivery", "queues"))
    assert "Queues at a glance" in page
    normal = page.split('data-lane="normal"')[1].split("</tr>")[0]
    cells = {
        column: normal.split(f'data-column="{column}">')[1].split("</td>")[0]
        for column in (
            "due",
            "scheduled",
            "in_flight",
            "held",
            "lag",
            "delivered_last_hour",
            "failed_last_day",
        )
    }
    assert ">1</a>" in cells["due"] and "queue=due" in cells["due"]
    assert ">1</a>" in cells["scheduled"]
    assert ">1</a>" in cells["in_flight"]
    assert ">1</a>" in cells["held"]
    assert cells["lag"].startswith("5m ")
    assert cells["delivered_last_hour"] == "1"
    assert cells["failed_last_day"] == "1"
    assert rows[1].host in page.split('id="fd-failing-hosts"')[1].split("</table>")[0]
    assert rows[1].host in page.split('id="fd-open-breakers"')[1].split("</table>")[0]
    assert "c.example" in page.split('id="fd-paused-hosts"')[1]


@pytest.mark.django_db(databases=["default", "queue"])
@pytest.mark.usefixtures("default_refuses_the_app")
def test_under_a_router_the_pages_read_the_database_the_app_is_routed_to(
    operator: Client, settings: Any
) -> None:
    # "default" refuses the app's tables (conftest), as where migrate made
    # them in "queue" alone; the users and their sessions stay in "default".
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "WEBHOOKS": {"ops": "slack://hooks.slack.com/services/T0AAAA1/B0BBBB2/s3cretT0ken"},
    }
    queue(hosts=["a.example"])
    send_webhook("ops", "alert.raised", {})
    controls.pause_host("a.example")
    page = html(operator, url("delivery", "queues"))
    assert "a.example" in page.split('id="fd-paused-hosts"')[1]
    ops = page.split('data-destination="ops"')[1].split("</tr>")[0]
    pending = ops.split('data-column="pending">')[1].split("</td>")[0]
    assert re.sub(r"<[^>]+>", "", pending) == "1"
    assert 'data-destination="ops"' in html(operator, url("delivery", "destinations"))
    assert "2 (2 held)" in html(operator, url("host", "change", "a.example"))
    for model in ("batch", "delivery", "breaker", "host"):
        html(operator, url(model))


def record_history(minutes: int) -> None:
    """A minute of history for each of the last ``minutes``, a breaker opened in the latest."""
    now = history.minute_of(timezone.now())
    DeliveryHistory.objects.bulk_create(
        DeliveryHistory(
            minute=now - dt.timedelta(minutes=n),
            delivered=20 + n % 7,
            retried=n % 5,
            refused=n % 2,
            failed=n % 3,
            breakers_opened=2 if n == 0 else 0,
        )
        for n in range(minutes)
    )


def test_the_queues_page_draws_the_last_hour_and_the_last_two_days(operator: Client) -> None:
    record_history(3)
    page = html(operator, url("delivery", "queues"))
    section = page.split('id="fd-history"')[1].split("</div>\n\n")[0]
    for chart, title in (
        ("fd-history-minutes", "Last hour, by minute"),
        ("fd-history-hours", "Last two days, by hour"),
    ):
        svg = section.split(f'id="{chart}"')[1].split("</svg>")[0]
        assert 'role="img"' in section.split(f'id="{chart}"')[0].rsplit("<svg", 1)[1]
        summary = svg.split("</title>")[0]
        # Three minutes: 20 + 21 + 22 delivered, 0 + 1 + 2 retried, and so on.
        assert f"{title}: 63 delivered, 3 retried, 1 refused, 3 failed; 2 breakers opened" in (
            summary
        )
        for series in ("delivered", "retried", "refused", "failed", "breakers_opened"):
            assert f'data-series="{series}"' in svg
        assert "2 breakers opened at " in svg
    assert "history is kept for 7 days" in section


def test_the_queues_page_draws_empty_charts_with_no_history(operator: Client) -> None:
    page = html(operator, url("delivery", "queues"))
    assert "Last hour, by minute: 0 delivered, 0 retried, 0 refused, 0 failed; " in page
    assert "fd-breaker-mark" not in page


def heartbeat(seconds_ago: float, *, pid: int, host: str = "worker-1") -> DelivererHeartbeat:
    seen = timezone.now() - dt.timedelta(seconds=seconds_ago)
    return DelivererHeartbeat.objects.create(
        host=host,
        pid=pid,
        version="1.2.3",
        started_at=seen - dt.timedelta(hours=2),
        last_seen=seen,
        interval=5.0,
        in_flight=7,
        rate=12.345,
    )


def test_the_queues_page_lists_the_live_deliverers(operator: Client) -> None:
    queue(hosts=["a.example"], per_host=3)
    heartbeat(2, pid=1111)
    heartbeat(3, pid=2222, host="worker-2")
    heartbeat(240, pid=3333)  # killed four minutes ago
    page = html(operator, url("delivery", "queues"))
    table = page.split('id="fd-deliverers"')[1].split("</table>")[0]
    assert "<caption>Deliverers (2)</caption>" in table
    first = table.split('data-pid="1111">')[1].split("</tr>")[0]
    cells = re.findall(r"<t[hd][^>]*>(.*?)</t[hd]>", first)
    assert cells[:3] == ["worker-1", "1111", "1.2.3"]
    assert cells[5:] == ["7", "12.3"]
    assert 'data-pid="2222"' in table and "worker-2" in table
    assert ">3333<" not in table, "a dead deliverer is not listed"
    assert 'id="fd-stalled"' not in page


@override_settings(USE_THOUSAND_SEPARATOR=True)
def test_a_deliverer_s_pid_is_shown_as_a_process_id_whatever_the_number_format(
    operator: Client,
) -> None:
    # It was "48,213", in its cell and its row's data-pid: no process's id.
    heartbeat(2, pid=48213)
    table = html(operator, url("delivery", "queues")).split('id="fd-deliverers"')[1]
    row = table.split('data-pid="48213">')[1].split("</tr>")[0]
    assert re.findall(r"<t[hd][^>]*>(.*?)</t[hd]>", row)[1] == "48213"


def test_the_queues_page_warns_in_words_when_work_is_due_and_no_deliverer_was_seen(
    operator: Client,
) -> None:
    queue(hosts=["a.example", "b.example"], per_host=60)
    page = html(operator, url("delivery", "queues"))
    warning = page.split('id="fd-stalled"')[1].split("</p>")[0]
    assert "No deliverer has been seen in the last day while 120 deliveries are due" in warning
    assert 'class="fd-stalled"' in page.split('id="fd-stalled"')[0][-60:]
    assert "No deliverer is running." in page
    heartbeat(252, pid=1111)
    page = html(operator, url("delivery", "queues"))
    # 252 s before the row was written, and however long this machine took since.
    assert re.search(r"No deliverer seen for 4m 1\d+s while 120 deliveries are due", page)
    assert "(one was last seen at " in page
    heartbeat(1, pid=2222)
    assert 'id="fd-stalled"' not in html(operator, url("delivery", "queues"))


def test_the_queues_page_does_not_warn_with_nothing_due(operator: Client) -> None:
    assert 'id="fd-stalled"' not in html(operator, url("delivery", "queues"))


def _fill(count: int) -> None:
    """``count`` deliveries in every state the page counts, over many hosts."""
    hosts = [f"h{n}.example" for n in range(8)]
    inboxes = [f"https://{hosts[n % len(hosts)]}/u{n}/inbox" for n in range(count)]
    send(ALICE, NOTE, inboxes)
    now = timezone.now()
    ids = list(Delivery.objects.order_by("id").values_list("id", flat=True))
    quarter = len(ids) // 4
    Delivery.objects.filter(id__in=ids[:quarter]).update(
        status=Status.DELIVERED, due_at=None, settled_at=now, last_status=202, attempts=1
    )
    Delivery.objects.filter(id__in=ids[quarter : 2 * quarter]).update(
        status=Status.FAILED, due_at=None, settled_at=now, last_status=500, attempts=5
    )
    Delivery.objects.filter(id__in=ids[2 * quarter : 3 * quarter]).update(
        due_at=now + dt.timedelta(minutes=10), attempts=2, last_status=502
    )
    Delivery.objects.filter(id__in=ids[3 * quarter :][:3]).update(lease_token="t", lane=Lane.LOW)
    retrying = Delivery.objects.filter(id__in=ids[2 * quarter : 3 * quarter])
    for host in sorted(set(retrying.values_list("host", flat=True)))[:2]:
        open_breaker(host)
    open_breaker(inboxes[-1])  # SCOPE "inbox"
    controls.pause_host(hosts[-1])
    heartbeat(1, pid=count)
    heartbeat(600, pid=count + 1)
    if not DeliveryHistory.objects.exists():
        record_history(2 * 24 * 60)


@pytest.mark.parametrize("rows", [10, 2000])
def test_the_queues_page_makes_a_bounded_number_of_queries(
    operator: Client, rows: int, django_assert_max_num_queries: Any
) -> None:
    _fill(rows)
    assert Delivery.objects.count() == rows
    html(operator, url("delivery", "queues"))  # the session and such, settled once
    with django_assert_max_num_queries(QUEUES_QUERY_BOUND) as captured:
        html(operator, url("delivery", "queues"))
    # Nothing reads the whole table: pending rows (the live queue, in the
    # partial index) or settled ones within a window of settled_at.
    for query in captured.captured_queries:
        sql = query["sql"]
        if 'FROM "federation_delivery_delivery"' in sql:
            where = sql.partition(" WHERE ")[2]
            assert "'pending'" in where or '"settled_at" >=' in where, sql


def test_the_queues_page_makes_as_many_queries_for_2000_rows_as_for_10(
    operator: Client,
) -> None:
    counts = []
    for rows in (10, 1990):
        _fill(rows)
        html(operator, url("delivery", "queues"))
        with CaptureQueriesContext(connection) as captured:
            html(operator, url("delivery", "queues"))
        counts.append([query["sql"] for query in captured])
    assert len(counts[0]) == len(counts[1]) <= QUEUES_QUERY_BOUND, counts


# Actions, each through controls, each reporting what it did.


def test_requeue_puts_failed_refused_and_skipped_back_due_now_keeping_attempts(
    operator: Client,
) -> None:
    rows = list(queue(per_host=2).deliveries.order_by("id"))
    settle(rows[0], Status.FAILED, last_status=500, attempts=12)
    settle(rows[1], Status.REFUSED, last_status=403, attempts=1)
    settle(rows[2], Status.DELIVERED, last_status=202, attempts=1)
    before = timezone.now()
    messages = act(operator, "delivery", "requeue", [row.pk for row in rows])
    assert messages == [
        "Requeued 2 deliveries, due now, after what they wait on, or once their paused host "
        "is resumed; pending or delivered ones, those past their batch's deadline, and "
        "those a later Delete or Undo of their sender took back, are left alone."
    ]
    requeued = Delivery.objects.filter(pk__in=[rows[0].pk, rows[1].pk]).order_by("id")
    assert [(row.status, row.attempts) for row in requeued] == [
        (Status.PENDING, 12),
        (Status.PENDING, 1),
    ]
    assert all(row.due_at is not None and row.due_at >= before for row in requeued)
    assert Delivery.objects.get(pk=rows[2].pk).status == Status.DELIVERED
    assert Delivery.objects.get(pk=rows[3].pk).attempts == 0, "a pending one is left alone"


def test_give_up_fails_only_the_pending_ones(operator: Client) -> None:
    rows = list(queue().deliveries.order_by("id"))
    settle(rows[0], Status.DELIVERED, last_status=202)
    messages = act(operator, "delivery", "give_up", [rows[0].pk, rows[1].pk])
    assert messages == ["Gave up 1 pending delivery; settled ones are left alone."]
    assert Delivery.objects.get(pk=rows[0].pk).status == Status.DELIVERED
    failed = Delivery.objects.get(pk=rows[1].pk)
    assert (failed.status, failed.last_error) == (Status.FAILED, "given up by an operator")


def test_pausing_the_hosts_of_deliveries_holds_them(operator: Client) -> None:
    rows = list(queue().deliveries.filter(host="a.example"))
    messages = act(operator, "delivery", "pause_hosts", [rows[0].pk])
    assert messages == ["Paused 1 host: 2 pending deliveries held until resumed."]
    assert Host.objects.get(name="a.example").paused_at is not None
    assert all(row.due_at is None for row in Delivery.objects.filter(host="a.example"))
    assert Delivery.objects.filter(host="b.example", due_at__isnull=True).count() == 0


def test_a_batch_requeues_its_failed_deliveries_and_cancels_what_is_pending(
    operator: Client,
) -> None:
    batch = queue()
    other = queue()
    rows = list(batch.deliveries.order_by("id"))
    settle(rows[0], Status.FAILED, last_status=500)
    settle(rows[1], Status.REFUSED, last_status=410)
    messages = act(operator, "batch", "requeue_failed", [batch.pk])
    assert messages == [
        "Requeued 1 failed delivery of 1 batch, due now, after what they wait on, or once "
        "their paused host is resumed."
    ]
    assert Delivery.objects.get(pk=rows[0].pk).status == Status.PENDING
    assert Delivery.objects.get(pk=rows[1].pk).status == Status.REFUSED, "refused is final"

    messages = act(operator, "batch", "cancel_pending", [batch.pk])
    assert messages == ["Cancelled 3 pending deliveries of 1 batch."]
    assert set(batch.deliveries.values_list("status", flat=True)) == {
        Status.FAILED,
        Status.REFUSED,
    }
    batch.refresh_from_db()
    assert (batch.remaining, batch.finished_at is not None) == (0, True)
    assert set(other.deliveries.values_list("status", flat=True)) == {Status.PENDING}

    messages = act(operator, "batch", "cancel_pending", [batch.pk])
    assert messages == ["Cancelled 0 pending deliveries of 1 batch."]


def test_breaker_actions_reset_pause_and_give_up_the_host(operator: Client) -> None:
    queue(hosts=["a.example", "b.example", "c.example"])
    open_breaker("a.example")
    open_breaker("https://b.example/users/u0/inbox")  # SCOPE "inbox"
    open_breaker("c.example")

    assert act(operator, "breaker", "reset", ["c.example"]) == ["Reset 1 breaker."]
    assert not Breaker.objects.filter(key="c.example").exists()

    messages = act(operator, "breaker", "pause_hosts", ["https://b.example/users/u0/inbox"])
    assert messages == ["Paused 1 host: 2 pending deliveries held until resumed."]
    assert Host.objects.get(name="b.example").paused_at is not None

    messages = act(operator, "breaker", "pause_hosts", ["https://b.example/users/u0/inbox"])
    assert messages == [
        "Paused 0 hosts: 0 pending deliveries held until resumed. 1 host was paused already."
    ]

    messages = act(operator, "breaker", "resume_hosts", ["https://b.example/users/u0/inbox"])
    assert messages == ["Resumed 1 host: 2 held deliveries due now."]
    assert Host.objects.get(name="b.example").paused_at is None
    assert not Delivery.objects.filter(due_at__isnull=True).exists()

    messages = act(operator, "breaker", "give_up_hosts", ["a.example"])
    assert messages == ["Gave up 2 pending deliveries to 1 host."]
    assert set(Delivery.objects.filter(host="a.example").values_list("status", flat=True)) == {
        Status.FAILED
    }
    assert Delivery.objects.filter(host="c.example", status=Status.PENDING).count() == 2


def test_host_actions_pause_resume_and_give_up(operator: Client) -> None:
    queue()
    controls.pause_host("a.example")
    Host.objects.create(name="b.example", scheme="rfc9421")

    messages = act(operator, "host", "resume", ["a.example", "b.example"])
    assert messages == ["Resumed 1 host: 2 held deliveries due now."]
    assert Delivery.objects.filter(due_at__isnull=True).count() == 0

    messages = act(operator, "host", "pause", ["b.example"])
    assert messages == ["Paused 1 host: 2 pending deliveries held until resumed."]
    assert "2 (2 held)" in html(operator, url("host"))

    messages = act(operator, "host", "pause", ["a.example", "b.example"])
    assert messages == [
        "Paused 1 host: 2 pending deliveries held until resumed. 1 host was paused already."
    ]
    act(operator, "host", "resume", ["a.example"])

    messages = act(operator, "host", "give_up", ["b.example"])
    assert messages == ["Gave up 2 pending deliveries to 1 host."]
    assert Delivery.objects.filter(status=Status.PENDING).count() == 2


def test_an_action_that_applies_to_nothing_says_so_as_a_warning(operator: Client) -> None:
    row = queue().deliveries.first()
    assert row is not None
    response = operator.post(
        url("delivery"),
        {"action": "requeue", ACTION_CHECKBOX_NAME: [str(row.pk)], "index": "0"},
        follow=True,
    )
    [message] = list(response.context["messages"])
    assert message.level_tag == "warning"
    assert str(message).startswith("Requeued 0 deliveries")


@pytest.mark.django_db(databases=["default", "queue"])
@pytest.mark.usefixtures("queue_router")
def test_under_a_router_the_actions_act_on_the_database_the_rows_are_read_from(
    operator: Client,
) -> None:
    # The app is routed to "queue"; "default" holds rows of its own, which no
    # action on the rows read from "queue" may touch.
    inboxes = ["https://a.example/inbox", "https://b.example/inbox"]
    for using in ("default", "queue"):
        send_batch(ALICE, NOTE, inboxes, using=using)
        Breaker.objects.using(using).create(key="a.example", failures=10)
        Host.objects.using(using).create(name="b.example")
    a, b = Delivery.objects.using("queue").order_by("host")

    def queued() -> list[tuple[str, str, bool]]:
        rows = Delivery.objects.using("queue").order_by("host")
        return [(row.host, row.status, row.due_at is None) for row in rows]

    assert act(operator, "delivery", "give_up", [a.pk]) == [
        "Gave up 1 pending delivery; settled ones are left alone."
    ]
    assert queued() == [("a.example", Status.FAILED, True), ("b.example", Status.PENDING, False)]
    act(operator, "delivery", "requeue", [a.pk])
    act(operator, "delivery", "pause_hosts", [b.pk])
    assert queued() == [("a.example", Status.PENDING, False), ("b.example", Status.PENDING, True)]
    assert act(operator, "host", "resume", ["b.example"]) == [
        "Resumed 1 host: 1 held delivery due now."
    ]
    act(operator, "host", "give_up", ["b.example"])
    assert act(operator, "breaker", "reset", ["a.example"]) == ["Reset 1 breaker."]
    act(operator, "batch", "cancel_pending", [a.batch_id])
    assert queued() == [("a.example", Status.FAILED, True), ("b.example", Status.FAILED, True)]
    assert not Breaker.objects.using("queue").exists()

    untouched = Delivery.objects.using("default").values_list("host", "status", "due_at")
    assert sorted((host, status, due is None) for host, status, due in untouched) == [
        ("a.example", Status.PENDING, False),
        ("b.example", Status.PENDING, False),
    ]
    assert Breaker.objects.using("default").count() == 1
    assert Host.objects.using("default").get().paused_at is None


# Permissions.


def test_a_viewer_sees_everything_and_is_offered_no_action(viewer: Client) -> None:
    batch = queue()
    open_breaker("a.example")
    controls.pause_host("b.example")
    for model in ("batch", "delivery", "breaker", "host"):
        page = html(viewer, url(model))
        assert 'name="action"' not in page, model
    page = html(viewer, url("delivery", "change", batch.deliveries.values_list("pk")[0][0]))
    assert "&quot;Create&quot;" in page
    assert 'name="_save"' not in page
    assert "Queues at a glance" in html(viewer, url("delivery", "queues"))


@pytest.mark.parametrize(
    ("model", "action", "key"),
    [
        ("delivery", "requeue", None),
        ("delivery", "give_up", None),
        ("delivery", "pause_hosts", None),
        ("batch", "cancel_pending", None),
        ("breaker", "reset", "a.example"),
        ("breaker", "pause_hosts", "a.example"),
        ("breaker", "resume_hosts", "a.example"),
        ("breaker", "give_up_hosts", "a.example"),
        ("batch", "requeue_failed", None),
        ("host", "pause", "b.example"),
        ("host", "resume", "b.example"),
        ("host", "give_up", "b.example"),
    ],
)
def test_a_viewer_is_refused_every_action(
    viewer: Client, model: str, action: str, key: str | None
) -> None:
    batch = queue()
    open_breaker("a.example")
    Host.objects.create(name="b.example")
    row = batch.deliveries.first()
    assert row is not None
    settle(row, Status.FAILED, last_status=500)
    ids = {"delivery": row.pk, "batch": batch.pk}
    response = viewer.post(
        url(model),
        {"action": action, ACTION_CHECKBOX_NAME: [str(key or ids[model])], "index": "0"},
    )
    assert response.status_code == 403
    assert Delivery.objects.filter(status=Status.PENDING).count() == 3
    assert Breaker.objects.filter(key="a.example").exists()
    assert Host.objects.get(name="b.example").paused_at is None


def test_each_action_needs_the_change_permission_of_what_it_changes() -> None:
    queue()
    client = login("deliveries_only", ("view", "change_delivery"))
    page = html(client, url("delivery"))
    assert 'value="requeue"' in page and 'value="give_up"' in page
    assert 'value="pause_hosts"' not in page, "pausing needs change_host"
    assert 'value="reset"' not in html(client, url("breaker"))
    host_page = html(client, url("host"))
    assert 'value="give_up"' in host_page and 'value="pause"' not in host_page


def test_the_queues_page_needs_the_view_permission() -> None:
    client = login("nobody", ())
    assert client.get(url("delivery", "queues")).status_code == 403
    anonymous = Client().get(url("delivery", "queues"))
    assert anonymous.status_code == 302 and "/login/" in anonymous["Location"]


#: Permissions beside the view permission on deliveries, and what of the
#: breakers', hosts' and batches' the pages may show with them: the change
#: permission alone lets one view a list, as the admin has it.
SEEN_WITH = [
    (("view_delivery",), set()),
    (("view_delivery", "view_breaker"), {"breakers"}),
    (("view_delivery", "change_host"), {"hosts"}),
    (("view",), {"batches", "breakers", "hosts"}),
]


@pytest.mark.parametrize(("permissions", "seen"), SEEN_WITH)
def test_the_queues_page_shows_breakers_hosts_and_batches_only_to_who_may_view_them(
    permissions: tuple[str, ...], seen: set[str]
) -> None:
    # view_delivery opens the queues page: its breakers' and paused hosts'
    # rows, and its links to their lists and the batches', were shown to a
    # user those lists answer 403.
    row = queue().deliveries.filter(host="a.example").first()
    assert row is not None
    Delivery.objects.filter(pk=row.pk).update(attempts=2, last_status=503)
    open_breaker("a.example", failures=7)
    controls.pause_host("b.example")
    client = login("someone", permissions)
    page = html(client, url("delivery", "queues"))
    links = {
        link.replace("&amp;", "&")
        for link in re.findall(r'href="(/admin/federation_delivery/[^"]*)"', page)
    }
    refused = sorted(link for link in links if client.get(link).status_code != 200)
    failing = page.split('id="fd-failing-hosts"')[1].split("</table>")[0]
    shown = {
        "batches": url("batch") in links,
        "breakers": 'id="fd-open-breakers"' in page and "Failures in a row" in failing,
        "hosts": 'id="fd-paused-hosts"' in page and "Paused" in failing,
    }
    assert (refused, {name for name, yes in shown.items() if yes}) == ([], seen)
    assert ("/breaker/a.example/" in page) == ("breakers" in seen)
    # The host failing most is the deliveries': shown to all who see them.
    assert "a.example" in failing


@pytest.mark.parametrize(("permissions", "seen"), SEEN_WITH)
def test_the_host_filter_offers_paused_hosts_and_breakers_only_to_who_may_view_them(
    permissions: tuple[str, ...], seen: set[str]
) -> None:
    queue(hosts=["c.example"])
    open_breaker("a.example", failures=7)
    controls.pause_host("b.example")
    page = html(login("someone", permissions), url("delivery"))
    offered = {name for name in ("a.example", "b.example") if f'?host={name}"' in page}
    expected = {"a.example": "breakers", "b.example": "hosts"}
    assert offered == {name for name, model in expected.items() if model in seen}


@pytest.mark.parametrize("model", ["delivery", "batch", "host", "breaker"])
def test_each_page_of_a_model_links_only_to_pages_the_user_may_view(model: str) -> None:
    # A user who may view one model alone: each of its pages (its list and a
    # row's) links to no page that answers 403, such as a delivery's batch.
    batch = queue()
    delivery = batch.deliveries.order_by("id").first()
    assert delivery is not None
    settle(delivery, Status.FAILED, last_status=503)
    open_breaker("a.example")
    controls.pause_host("a.example")
    row = {"delivery": delivery.pk, "batch": batch.pk, "host": "a.example", "breaker": "a.example"}
    client = login("someone", (f"view_{model}",))
    pages = [url(model), url(model, "change", row[model])]
    links = {
        link.replace("&amp;", "&")
        for page in pages
        for link in re.findall(r'href="(/admin/federation_delivery/[^"]*)"', html(client, page))
    }
    assert links
    assert sorted(link for link in links if client.get(link).status_code != 200) == []


# Filters and search.


def test_filters_and_search(operator: Client) -> None:
    batch = queue(tag="welcome")
    queue(hosts=["c.example"], sender="https://social.example/users/bob", tag="boost")
    rows = list(batch.deliveries.order_by("id"))
    settle(rows[0], Status.DELIVERED, last_status=202)
    settle(rows[1], Status.FAILED, last_status=503)
    settle(rows[2], Status.REFUSED, last_status=404)
    Delivery.objects.filter(pk=rows[3].pk).update(last_status=None)
    controls.pause_host("c.example")

    def listed(query: str) -> int:
        response = operator.get(f"{url('delivery')}?{query}")
        assert response.status_code == 200
        return int(response.context["cl"].result_count)

    assert listed("status__exact=failed") == 1
    assert listed(f"lane__exact={Lane.NORMAL}") == 6
    assert listed("last_status_class=2xx") == 1
    assert listed("last_status_class=4xx") == 1
    assert listed("last_status_class=5xx") == 1
    assert listed("last_status_class=none") == 3
    assert listed("host=c.example") == 2
    assert listed("queue=held") == 2
    assert listed("queue=due") == 1
    assert listed("q=users/bob") == 2
    assert listed("q=welcome") == 4
    assert listed("q=c.example") == 2  # a host
    assert listed("q=C.Example.") == 2  # in any form, or a URL on it
    assert listed("q=https%3A%2F%2Fc.example%2Fusers%2Fcarol") == 2

    def found(query: str) -> set[int]:
        response = operator.get(f"{url('delivery')}?{query}")
        return {row.pk for row in response.context["cl"].result_list}

    # A number: a delivery's id, or its batch's.
    assert found(f"q={rows[1].pk}") >= {rows[1].pk}
    assert found(f"q={batch.pk}") >= {row.pk for row in rows}
    assert found("q=999999") == set()
    # Never the inbox: its query may be a credential, told a character at a time.
    assert listed("q=users/u1") == 0
    assert listed(f"batch__id__exact={batch.pk}") == 4
    assert "c.example" in html(operator, url("delivery"))  # offered: it is paused

    def batches(query: str) -> int:
        return int(operator.get(f"{url('batch')}?{query}").context["cl"].result_count)

    assert batches("tag=boost") == 1
    assert batches("state=failures") == 1
    assert batches("state=pending") == 2
    assert batches("state=finished") == 0

    open_breaker("a.example")
    Breaker.objects.create(key="d.example", failures=3)
    breakers = operator.get(f"{url('breaker')}?state=open").context["cl"]
    assert [row.key for row in breakers.result_list] == ["a.example"]
    assert operator.get(f"{url('host')}?paused=yes").context["cl"].result_count == 1
    assert operator.get(f"{url('host')}?q=C.EXAMPLE.").context["cl"].result_count == 1


# Lookups: only the filters' and the pages' own.


def test_a_viewer_cannot_tell_an_inbox_s_query_a_character_at_a_time(viewer: Client) -> None:
    # Django allows any lookup on a model's own fields: with "1 delivery" or
    # "0 deliveries" answering, ?inbox__startswith= would tell the token.
    send(ALICE, NOTE, ["https://a.example/inbox?token=s3cret"])
    for lookup in ("inbox__startswith", "inbox__contains", "inbox__gt", "via__icontains"):
        for guess in "st":
            response = viewer.get(
                url("delivery"), {lookup: f"https://a.example/inbox?token={guess}"}
            )
            assert response.status_code == 400, (lookup, guess)
            assert b"deliver" not in response.content


def test_the_inbox_column_does_not_sort_by_the_secret_query(viewer: Client) -> None:
    # Sorted by inbox, an inbox one can have queued (any remote actor's)
    # would show whether another's token sorts before or after its own.
    send(ALICE, NOTE, ["https://a.example/inbox?token=a"])
    send(ALICE, NOTE, ["https://a.example/inbox?token=b"])
    newest_first = list(Delivery.objects.order_by("-id").values_list("pk", flat=True))
    response = viewer.get(url("delivery"), {"o": "2"})  # the inbox column
    assert [row.pk for row in response.context["cl"].result_list] == newest_first
    assert "sortable column-shown_inbox" not in response.content.decode()


@pytest.mark.parametrize(
    ("model", "lookup"),
    [
        ("delivery", "host__regex"),
        ("delivery", "inbox__iregex"),
        ("batch", "tag__regex"),
        ("batch", "body__regex"),
        ("host", "name__regex"),
        ("host", "last_error__regex"),
        ("breaker", "key__regex"),
    ],
)
def test_a_lookup_no_page_makes_is_refused_not_a_database_error(
    viewer: Client, model: str, lookup: str
) -> None:
    queue()
    open_breaker("a.example")
    Host.objects.create(name="a.example")
    assert viewer.get(url(model), {lookup: "("}).status_code == 400


def test_every_link_and_filter_the_pages_make_lists_rows(operator: Client, settings: Any) -> None:
    # Each lookup the pages link to (the queues page, the destinations page,
    # a batch's deliveries, each list's filters) is one the lists allow.
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "WEBHOOKS": {"ops": "slack://hooks.slack.com/services/T0/B0/token"},
    }
    batch = queue(tag="greeting")
    send_webhook("ops", "alert.raised", {"n": 1})
    rows = list(batch.deliveries.order_by("id"))
    settle(rows[0], Status.FAILED, last_status=500)
    Delivery.objects.filter(pk=rows[1].pk).update(attempts=2, last_status=503)
    open_breaker(rows[1].host)
    controls.pause_host("b.example")
    pages = [
        url("delivery", "queues"),
        url("delivery", "destinations"),
        url("batch", "change", batch.pk),
        url("delivery", "change", rows[0].pk),
        *(url(model) for model in ("delivery", "batch", "breaker", "host")),
    ]
    followed = set()
    for page in pages:
        for href in re.findall(r'href="([^"]*\?[^"]*)"', html(operator, page)):
            link = page.split("?")[0] + href if href.startswith("?") else href
            link = link.replace("&amp;", "&")
            if link.startswith("/admin/federation_delivery/") and link not in followed:
                followed.add(link)
                html(operator, link)
    linked = {re.sub(r"=[^&]*", "", link.partition("?")[2]) for link in followed}
    for made in ("batch__id__exact", "host&status__exact", "destination&status__exact", "queue"):
        assert any(made in lookups for lookups in linked), made


def test_a_body_that_is_not_json_is_shown_as_it_is(operator: Client) -> None:
    batch = queue()
    Batch.objects.filter(pk=batch.pk).update(body="<not json>")
    page = html(operator, url("batch", "change", batch.pk))
    assert '<pre class="fd-body">&lt;not json&gt;</pre>' in page


def test_a_retractions_batch_says_what_it_retracts(operator: Client) -> None:
    post = f"{ALICE}/notes/1"
    send(ALICE, {"type": "Create", "id": f"{ALICE}/1", "object": post}, ["https://a.example/i"])
    deleted = send(
        ALICE, {"type": "Delete", "id": f"{ALICE}/2", "object": post}, ["https://b.example/i"]
    )
    assert deleted is not None
    page = html(operator, url("batch", "change", deleted.pk))
    assert re.search(r"Retracts:</label>\s*<div class=\"readonly\">its object</div>", page), page


HOSTILE_NAMES = ["evil\x1b[2J.example", "\u202eelpmaxe.a", ""]


@pytest.mark.parametrize("action", ["pause", "resume", "give_up", "replay_day", "mark_seen"])
def test_every_host_action_acts_on_names_no_send_would_write(operator: Client, action: str) -> None:
    # Rows a host project (or an older version) wrote as they came: each is
    # acted on by its name as kept, and the list shows them all.
    since = timezone.now() - dt.timedelta(days=8)
    for name in HOSTILE_NAMES:
        Host.objects.create(
            name=name,
            failing_since=since,
            unavailable_since=since,
            paused_at=since if action == "resume" else None,
        )
    # One delivery to the first: pending to be given up, delivered to be replayed.
    (row,) = queue(hosts=["a.example"], per_host=1).deliveries.all()
    replayed = action == "replay_day"
    Delivery.objects.filter(pk=row.pk).update(
        host=HOSTILE_NAMES[0],
        status=Status.DELIVERED if replayed else Status.PENDING,
        settled_at=timezone.now() if replayed else None,
    )
    assert_shown_as_text(html(operator, url("host")))
    act(operator, "host", action, HOSTILE_NAMES)
    hosts = Host.objects.filter(name__in=HOSTILE_NAMES)
    pending = Delivery.objects.filter(host=HOSTILE_NAMES[0], status=Status.PENDING)
    match action:
        case "pause":
            assert hosts.filter(paused_at__isnull=False).count() == len(HOSTILE_NAMES)
        case "resume":
            assert not hosts.filter(paused_at__isnull=False).exists()
        case "mark_seen":
            assert not hosts.filter(unavailable_since__isnull=False).exists()
        case "give_up":
            assert Delivery.objects.get(pk=row.pk).status == Status.FAILED
        case "replay_day":
            assert pending.exclude(pk=row.pk).count() == 1


@pytest.mark.parametrize(
    ("model", "action"),
    [
        ("host", "pause"),
        ("host", "resume"),
        ("host", "give_up"),
        ("host", "replay_day"),
        ("host", "mark_seen"),
        ("breaker", "pause_hosts"),
        ("breaker", "resume_hosts"),
        ("breaker", "give_up_hosts"),
        ("delivery", "pause_hosts"),
    ],
)
def test_an_action_on_every_host_selected_across_pages_acts_on_them_all(
    operator: Client, parameters_a_statement: int, model: str, action: str
) -> None:
    # "Select all" on a list of more hosts than SQLite takes parameters in a
    # statement ("too many SQL variables", a 500): each acts on them all,
    # in a few statements for each chunk of names, not a transaction a host.
    names = [f"h{n}.example" for n in range(parameters_a_statement + 1)]
    resuming = action.startswith("resume")
    Host.objects.bulk_create(
        Host(name=name, paused_at=timezone.now() if resuming else None) for name in names
    )
    Breaker.objects.bulk_create(Breaker(key=name, failures=5) for name in names)
    # One delivery to each: held if its host is paused, else due; the first
    # one delivered, for the day's replay.
    batch = queue(hosts=names[:1], per_host=1)
    Delivery.objects.bulk_create(
        Delivery(batch=batch, inbox=f"https://{name}/inbox", host=name) for name in names[1:]
    )
    Delivery.objects.update(due_at=None if resuming else timezone.now())
    first = Delivery.objects.get(host=names[0])
    if action == "replay_day":
        settle(first, Status.DELIVERED)
    if action == "mark_seen":
        marked = timezone.now() - dt.timedelta(days=8)
        Host.objects.update(unavailable_since=marked, failing_since=marked, failing_told_at=marked)
    selected = first.pk if model == "delivery" else names[0]
    recovered: list[str] = []

    def told(sender: Any, recovered: signals.HostRecovered, **kwargs: Any) -> None:
        told.hosts.append(recovered.host)  # type: ignore[attr-defined]

    told.hosts = recovered  # type: ignore[attr-defined]
    signals.host_recovered.connect(told)
    try:
        # host_recovered is sent once the action's transaction commits.
        with (
            TestCase.captureOnCommitCallbacks(execute=True),
            CaptureQueriesContext(connection) as queries,
        ):
            response = act_on_all(operator, model, action, selected)
    finally:
        signals.host_recovered.disconnect(told)
    assert response.status_code == 302
    assert len(queries) < len(names) / 10, f"{len(queries)} queries for {len(names)} hosts"
    pending = Delivery.objects.filter(status=Status.PENDING)
    paused = Host.objects.filter(paused_at__isnull=False).count()
    match action:
        case "pause" | "pause_hosts":
            assert (paused, pending.filter(due_at__isnull=True).count()) == (len(names),) * 2
        case "resume" | "resume_hosts":
            assert (paused, pending.filter(due_at__isnull=True).count()) == (0, 0)
        case "give_up" | "give_up_hosts":
            assert Delivery.objects.filter(status=Status.FAILED).count() == len(names)
        case "replay_day":
            assert pending.exclude(batch=batch).count() == 1
        case "mark_seen":
            still = Host.objects.exclude(unavailable_since=None, failing_since=None)
            assert (still.count(), len(recovered)) == (0, len(names))


def test_the_pages_show_a_breaker_and_a_host_with_a_blank_name(operator: Client) -> None:
    open_breaker("")
    Host.objects.create(name="", paused_at=timezone.now())
    for page in (url("delivery", "queues"), url("breaker"), url("host")):
        html(operator, page)


@pytest.mark.parametrize(
    "query",
    [
        "delivery/?host=a%00b",
        "delivery/?destination=a%00b",
        "delivery/?status__exact=a%00b",
        "delivery/?lane__exact=a%00b",
        "delivery/?q=a%00b",
        "batch/?tag=a%00b",
        "batch/?q=a%00b",
        "host/?q=a%00b",
        "breaker/?q=a%00b",
    ],
)
def test_a_filter_or_search_holding_a_nul_goes_back_to_the_list(
    operator: Client, query: str
) -> None:
    # PostgreSQL's text holds no NUL: a query with one must not reach it. It
    # is refused as the admin refuses a bad lookup, on either database.
    queue(tag="greeting")
    path, _, _ = query.partition("?")
    response = operator.get(f"/admin/federation_delivery/{query}")
    assert response.status_code == 302, response.status_code
    assert response["Location"] == f"/admin/federation_delivery/{path}?e=1"


@pytest.mark.parametrize("field", ["after", "batch"])
def test_the_autocomplete_s_search_holding_a_nul_finds_nothing(
    operator: Client, field: str
) -> None:
    # Django's autocomplete (through Delivery.after and Delivery.batch)
    # searches with no list around it: PostgreSQL refused the text, a 500.
    queue(tag="greeting")
    response = operator.get(
        reverse("admin:autocomplete"),
        {
            "app_label": "federation_delivery",
            "model_name": "delivery",
            "field_name": field,
            "term": "a\x00b",
        },
    )
    assert response.status_code == 200, response.status_code
    assert response.json()["results"] == []


@pytest.mark.parametrize(
    "body",
    ['{"content": "\\ud83d"}', "[" * 900 + "]" * 900],
    ids=["half-a-surrogate-pair", "nested-900-deep"],
)
def test_a_body_that_cannot_be_shown_pretty_is_shown_as_stored(operator: Client, body: str) -> None:
    # Nested deeper than json.loads reads again, or escaping half a
    # surrogate pair (each a row written by hand; a send refuses both): a
    # 500 on the batch's and the delivery's page.
    batch = queue()
    Batch.objects.filter(pk=batch.pk).update(body=body)
    for model, pk in (("batch", batch.pk), ("delivery", batch.deliveries.first().pk)):
        response = operator.get(url(model, "change", pk))
        assert response.status_code == 200, (model, response.status_code)
        # As stored, or pretty where this Python reads it again after all.
        assert 'class="fd-body"' in response.content.decode()


@pytest.mark.parametrize("model", ["delivery", "batch", "host", "breaker"])
def test_a_search_of_a_thousand_words_looks_for_the_first_few(operator: Client, model: str) -> None:
    # Each word is a condition on every search field: 1,200 of them made a
    # statement SQLite cannot run ("Expression tree is too large"), a 500.
    queue(tag="greeting")
    words = " ".join(["greeting", *(f"w{n}" for n in range(1200))])
    response = operator.get(url(model), {"q": words})
    assert response.status_code == 200


@pytest.mark.parametrize(
    ("model", "action", "selected"),
    [
        ("host", "pause", ["b.example\x00"]),
        ("host", "give_up", ["a.example", "b.example\x00"]),
        ("breaker", "reset", ["x\x00"]),
        ("breaker", "pause_hosts", ["a.example\x00"]),
        # A delivery's and a batch's key is a number, and one its column holds.
        ("delivery", "requeue", ["abc"]),
        ("batch", "cancel_pending", ["1\x00"]),
        ("delivery", "give_up", [PAST_BIGINT]),
        ("delivery", "requeue", [PAST_BIGINT]),
        ("batch", "cancel_pending", [PAST_BIGINT]),
        ("batch", "requeue_failed", [f"-{PAST_BIGINT}"]),
    ],
)
@pytest.mark.parametrize("forms", [1, 2], ids=["one-action-field", "actions-above-and-below"])
def test_an_action_on_a_selection_no_row_can_have_changes_nothing_and_says_so(
    operator: Client, model: str, action: str, selected: list[str], forms: int
) -> None:
    # PostgreSQL's text holds no NUL: a selection with one must not reach it,
    # on either database; nor a number past 64 bits, which SQLite's driver
    # cannot bind (a 500). It is refused as an action with nothing selected is.
    # A list with its actions above and below posts two action fields, the
    # unused one empty: read alone, that one let the selection through.
    queue()
    open_breaker("a.example")
    before = list(Delivery.objects.values_list("pk", "status", "due_at"))
    posted = [action, ""][:forms]
    response = operator.post(
        url(model), {"action": posted, ACTION_CHECKBOX_NAME: selected, "index": "0"}, follow=True
    )
    assert response.redirect_chain == [(url(model), 302)]
    [message] = list(response.context["messages"])
    assert message.level_tag == "warning"
    assert "no items have been changed" in str(message)
    assert list(Delivery.objects.values_list("pk", "status", "due_at")) == before
    assert not Host.objects.filter(paused_at__isnull=False).exists()
    assert Breaker.objects.filter(key="a.example").exists()


@pytest.mark.parametrize("model", ["host", "breaker"])
@pytest.mark.parametrize("view", ["change", "history"])
def test_a_row_named_with_a_nul_does_not_exist(operator: Client, model: str, view: str) -> None:
    # A host's and a breaker's key is text: "b.example\0" names no row, as
    # the admin says of any such, rather than a database error.
    Host.objects.create(name="b.example")
    open_breaker("b.example")
    response = operator.get(f"{url(model)}b.example%00/{view}/", follow=True)
    assert response.redirect_chain == [(reverse("admin:index"), 302)]
    [message] = list(response.context["messages"])
    assert "doesn’t exist" in str(message)


def assert_shown_as_text(page: str) -> None:
    """A page's text (not its tags, whose attributes may carry a row's key to
    act on it) holds nothing that reads as something else or as nothing."""
    text = re.sub(r"<[^>]*>", "", page)
    hidden = {char for char in text if not char.isprintable() and char not in "\n\t\r"}
    assert not hidden, re.findall(r".{0,200}[\u202e\x1b].{0,40}", text)


def test_every_page_shows_text_rows_keep_as_it_came_escaped(operator: Client) -> None:
    # What a host project gave (a tag, a sender, an event) and what a row no
    # send wrote holds (a host): a bidi override would reorder what is shown.
    bidi, escape = "\u202e", "\x1b[2J"
    batch = queue(tag=f"tag{bidi}", hosts=["h.example"], per_host=1)
    Batch.objects.filter(pk=batch.pk).update(
        sender=f"https://a.example/{escape}actor",
        activity_id=f"https://a.example/{bidi}1",
        object_id=f"https://a.example/{bidi}2",
        ordering_key=f"key{bidi}",
        idempotency_key=f"idem{bidi}",
        # And those the package writes only as hex or a scheme's name.
        body_sha256=f"sha{bidi}",
    )
    delivery = batch.deliveries.get()
    Delivery.objects.filter(pk=delivery.pk).update(
        host=f"h{bidi}.example",
        last_error=f"boom{bidi}",
        attempts=1,
        last_status=503,
        sequence=f"seq{escape}",
    )
    Host.objects.create(name=f"h{bidi}.example", last_error=f"boom{escape}", scheme=f"rfc{bidi}")
    Host.objects.create(name=f"p{bidi}.example", paused_at=timezone.now())
    open_breaker(f"h{bidi}.example")
    now = timezone.now()
    DelivererHeartbeat.objects.create(
        host=f"machine{bidi}", pid=1, version=f"1{bidi}", started_at=now, last_seen=now, interval=5
    )
    for page in (
        url("delivery"),
        url("delivery", "change", delivery.pk),
        url("batch"),
        url("batch", "change", batch.pk),
        f"{url('batch')}?tag=tag{bidi}",
        url("host"),
        url("host", "change", f"h{bidi}.example"),
        url("breaker"),
        url("delivery", "queues"),
    ):
        assert_shown_as_text(html(operator, page))


@pytest.mark.parametrize("via", [5, {"https://gw.example/": 1}], ids=["a-number", "an-object"])
def test_sending_a_host_again_leaves_out_a_row_whose_gateways_are_no_list(
    operator: Client, via: Any
) -> None:
    # Gateways written by hand as no list of URLs: the loop fails such a row
    # alone; a replay neither breaks on it nor reads an object's keys as them.
    batch = queue(hosts=["a.example"], per_host=2)
    rows = list(batch.deliveries.order_by("id"))
    for row in rows:
        settle(row, Status.DELIVERED, last_status=202)
    Delivery.objects.filter(pk=rows[0].pk).update(via=via)
    Host.objects.create(name="a.example")
    assert act(operator, "host", "replay_day", ["a.example"]) == [
        "Queued again: 1 delivery, in 1 new batch."
    ]
    (copy,) = Delivery.objects.exclude(batch=batch)
    assert (copy.inbox, copy.via) == (rows[1].inbox, [])


def per_inbox(settings: Any, **more: Any) -> None:
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "BREAKER": {"THRESHOLD": 2, "COOL_OFF": 60.0, "SCOPE": "inbox"},
        **more,
    }


@pytest.mark.parametrize("action", ["pause_hosts", "give_up_hosts"])
def test_a_destination_s_breaker_kept_per_inbox_acts_on_the_destination(
    operator: Client, settings: Any, action: str
) -> None:
    per_inbox(settings, WEBHOOKS={"ops": "slack://hooks.slack.com/services/T0/B0/token"})
    send_webhook("ops", "alert.raised", {"n": 1})
    delivery = Delivery.objects.get()
    key = BreakerSettings(scope=Scope.INBOX).key(delivery.host, delivery.inbox)
    assert key == delivery.host == "<ops>"
    open_breaker(key)
    act(operator, "breaker", action, [key])
    delivery.refresh_from_db()
    if action == "pause_hosts":
        assert delivery.due_at is None
    else:
        assert delivery.status == Status.FAILED
    assert not Host.objects.exclude(name="<ops>").exists()


@pytest.mark.parametrize("action", ["pause_hosts", "give_up_hosts"])
@pytest.mark.parametrize(
    "did",
    # An Ed25519 did:key, and an RSA one, about 400 characters: its breaker's
    # key was the inbox cut short as a message shows it, which named no
    # delivery ("Paused 0 hosts", the gateway sent to still).
    ["did:key:z6Mk", "did:key:z4MXj1wBzi9jUstyP" + "Mq" * 190],
    ids=["short", "RSA"],
)
def test_a_portable_inbox_s_breaker_acts_on_the_host_its_deliveries_go_to(
    operator: Client, settings: Any, did: str, action: str
) -> None:
    per_inbox(settings)
    inbox = PortableInbox(f"ap://{did}/actor/inbox", ("https://gw.example",))
    send_portable(ALICE, NOTE, [inbox])
    delivery = Delivery.objects.get()
    key = BreakerSettings(scope=Scope.INBOX).key(delivery.host, delivery.inbox)
    open_breaker(key)
    said = act(operator, "breaker", action, [key])
    delivery.refresh_from_db()
    if action == "pause_hosts":
        assert said[0].startswith("Paused 1 host"), said
        assert delivery.due_at is None
    else:
        assert delivery.status == Status.FAILED, said


def test_a_destination_s_page_shows_its_open_breaker_kept_per_inbox(
    operator: Client, settings: Any
) -> None:
    per_inbox(settings, WEBHOOKS={"ops": "slack://hooks.slack.com/services/T0/B0/token"})
    send_webhook("ops", "alert.raised", {"n": 1})
    delivery = Delivery.objects.get()
    open_breaker(BreakerSettings(scope=Scope.INBOX).key(delivery.host, delivery.inbox), failures=7)
    Host.objects.create(name=delivery.host, failing_since=timezone.now())
    page = operator.get(url("host", "change", quote(delivery.host))).content.decode()
    field = page.split("Breaker (failures in a row)")[1]
    shown = re.sub(r"\s+", " ", re.sub(r"<[^>]*>", " ", field))[:40]
    assert "(7)" in shown, shown


def test_an_activity_s_text_is_shown_with_what_a_page_would_act_on_escaped(
    operator: Client,
) -> None:
    # A bidi override quoted in a post's content would reorder the line.
    content = "\u202egnp.exe\u2028next"
    batch = send(ALICE, {**NOTE, "content": content}, ["https://a.example/inbox"])
    assert batch is not None
    for model, pk in (("batch", batch.pk), ("delivery", batch.deliveries.get().pk)):
        page = operator.get(url(model, "change", pk)).content.decode()
        body = unescape(page.split('class="fd-body">')[1].split("</pre>")[0])
        assert [char for char in body if not char.isprintable() and char != "\n"] == []
        assert json.loads(body)["content"] == content


def test_pausing_the_hosts_of_breakers_leaves_out_a_key_no_host_can_have(
    operator: Client,
) -> None:
    queue(hosts=["a.example"])
    open_breaker("a.example")
    open_breaker("k" * 300)  # a row no deliverer wrote
    assert act(operator, "breaker", "pause_hosts", ["a.example", "k" * 300])[0].startswith(
        "Paused 1 host"
    )
    assert list(Host.objects.filter(paused_at__isnull=False).values_list("name", flat=True)) == [
        "a.example"
    ]


def test_sending_a_host_again_twice_in_a_minute_queues_once(
    operator: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A page posted twice (a double click, a reload): the same moment.
    batch = queue(hosts=["a.example"], per_host=2)
    for row in batch.deliveries.all():
        settle(row, Status.DELIVERED, last_status=202)
    Host.objects.create(name="a.example")
    start = timezone.now().replace(second=5, microsecond=0)
    for clicked in (start, start + dt.timedelta(seconds=50)):
        monkeypatch.setattr(hosts_admin, "aware_now", lambda clicked=clicked: clicked)
        said = act(operator, "host", "replay_day", ["a.example"])
    assert said == [
        "Queued again: 0 deliveries, in 0 new batches. "
        "1 batch was queued by an earlier replay of the same moment."
    ]
    assert Delivery.objects.exclude(batch=batch).count() == 2


@pytest.mark.django_db
def test_the_admin_says_what_it_requeued_to_a_paused_host_is_held_not_due_now() -> None:
    batch = send(ALICE, NOTE, ["https://a.example/inbox"])
    assert batch is not None
    assert controls.give_up(Delivery.objects.all()) == 1
    controls.pause_host("a.example")
    (message,) = act(login("operator"), "delivery", "requeue", [Delivery.objects.get().pk])
    assert Delivery.objects.get().due_at is None, "held until the host is resumed"
    assert "due now" not in message or "paused" in message, (
        f"the operator is told {message!r} of a delivery held for its paused host"
    )


@pytest.mark.django_db
def test_the_tag_filter_offers_a_tag_behind_many_untagged_sends() -> None:
    tagged = send_batch(ALICE, NOTE, ["https://a.example/inbox"], {"tag": "move"})
    assert tagged is not None
    # An instance's every post, reply and like: sends without a tag.
    for n in range(500):
        send(ALICE, NOTE, [f"https://b.example/users/u{n}/inbox"])
    page = login("operator").get(reverse("admin:federation_delivery_batch_changelist"))
    assert page.status_code == 200
    specs = [
        f for f in page.context["cl"].filter_specs if getattr(f, "parameter_name", "") == "tag"
    ]
    offered = [value for spec in specs for value, _label in spec.lookup_choices]
    assert "move" in offered, f"the batches' tag filter offers {offered}"


def advisory_locks_held() -> int:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()"
        )
        return int(cursor.fetchone()[0])


@pytest.mark.skipif(connection.vendor != "postgresql", reason="PostgreSQL's advisory locks")
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("action", ["give_up", "requeue", "replay_day"])
def test_an_action_under_atomic_requests_holds_no_chunk_s_locks_past_it(
    monkeypatch: pytest.MonkeyPatch, action: str
) -> None:
    # With ATOMIC_REQUESTS, the request's transaction held every chunk's
    # sequence locks (a replay every host's) to its end: "select all" on
    # thousands of ordered deliveries, or a day's replay of thousands of
    # hosts, filled the server's lock table, "out of shared memory", a 500
    # and nothing done.
    from django_federation_delivery import replay
    from django_federation_delivery.store import settlements

    for n in range(3):
        inboxes = [f"https://h{n}.example/users/u{i}/inbox" for i in range(2)]
        send_batch(ALICE, NOTE, inboxes, {"ordering_key": f"note-{n}"})
    if action == "requeue":
        Delivery.objects.update(status=Status.FAILED, due_at=None, settled_at=timezone.now())
    if action == "replay_day":
        Delivery.objects.update(status=Status.DELIVERED, due_at=None, settled_at=timezone.now())
        Host.objects.bulk_create([Host(name=f"h{n}.example") for n in range(3)])
    held: list[int] = []
    if action == "replay_day":
        wrapped, module, name = replay.replay_host, hosts_admin, "replay_host"
    else:
        # A chunk of two rows: three chunks.
        monkeypatch.setattr(controls, "CHUNK", 2)
        wrapped, module, name = settlements.lock_sequences_of, settlements, "lock_sequences_of"

    def counting(*args: Any, **kwargs: Any) -> Any:
        held.append(advisory_locks_held())
        return wrapped(*args, **kwargs)

    monkeypatch.setattr(module, name, counting)
    monkeypatch.setitem(connection.settings_dict, "ATOMIC_REQUESTS", True)
    client = Client()
    client.force_login(operators.user("operator"))
    model = "host" if action == "replay_day" else "delivery"
    first = Host.objects.first() if action == "replay_day" else Delivery.objects.first()
    assert first is not None
    assert act_on_all(client, model, action, first.pk).status_code == 302
    assert held == [0, 0, 0]
