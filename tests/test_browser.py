"""The admin in a real browser: Playwright driving Debian's Chromium.

Each test saves screenshots to tests/var/screenshots/, from which those in
docs/ are taken. Only a missing Chromium skips these tests; ``scripts/test``
installs it.
"""

from __future__ import annotations

import datetime as dt
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.utils import timezone
from playwright.sync_api import Browser, Page, expect, sync_playwright

from django_federation_delivery import controls, history, send_webhook
from django_federation_delivery.models import Delivery, DeliveryHistory, Host, Status

from .conftest import ROOT
from .operators import PASSWORD, open_breaker, queue, settle, user

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    # Containers often have a small /dev/shm, which crashes tabs otherwise.
    "--disable-dev-shm-usage",
]
SCREENSHOTS = ROOT / "tests" / "var" / "screenshots"

pytestmark = [
    pytest.mark.slow,
    # One process of their own, where one Chromium serves them all.
    pytest.mark.browser,
    # What the pages show is tested on both databases without a browser.
    pytest.mark.any_database,
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(
        CHROMIUM is None, reason="no Chromium: apt-get install chromium (scripts/test does)"
    ),
]


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    # Playwright's sync API runs an event loop in this thread, which Django
    # takes for async code and refuses ORM calls in: the documented way out.
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            yield browser
            browser.close()


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    # Wide enough for the lists' columns, with the admin's nav sidebar closed.
    context = browser.new_context(viewport={"width": 1600, "height": 900})
    context.add_init_script("localStorage.setItem('django.admin.navSidebarIsOpen', 'false')")
    context.set_default_timeout(15_000)
    yield context.new_page()
    context.close()


def log_in(page: Page, server: Any, person: User) -> None:
    page.goto(f"{server.url}/admin/login/?next=/admin/")
    page.fill("#id_username", person.username)
    page.fill("#id_password", PASSWORD)
    page.click("input[type=submit]")
    expect(page.locator("#user-tools")).to_contain_text(person.username)


def screenshot(page: Page, name: str) -> Path:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    path = SCREENSHOTS / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    return path


def run_action(page: Page, row_text: str, action: str) -> None:
    """Tick the row showing ``row_text``, pick ``action`` and press Go."""
    row = page.locator("#result_list tbody tr", has_text=row_text)
    row.locator("input.action-select").check()
    page.select_option("select[name=action]", action)
    page.click("button[name=index]")


def fill_queue() -> dict[str, Any]:
    """A queue to look at: a few hosts, one failing, one paused, some settled."""
    welcome = queue(hosts=["mastodon.example", "pixelfed.example"], per_host=3, tag="welcome")
    batch = queue(hosts=["down.example", "mastodon.example", "lemmy.example"], tag="post")
    rows = {row.inbox: row for row in batch.deliveries.all()}
    now = timezone.now()
    # Down: retried in a while. One due for two minutes: the lag. One in flight.
    Delivery.objects.filter(host="down.example").update(
        attempts=4, last_status=503, last_error="HTTP 503", due_at=now + dt.timedelta(minutes=10)
    )
    Delivery.objects.filter(inbox="https://lemmy.example/users/u1/inbox").update(
        due_at=now - dt.timedelta(minutes=2)
    )
    welcome.deliveries.filter(inbox="https://mastodon.example/users/u0/inbox").update(
        lease_token="a-deliverer", due_at=now + dt.timedelta(minutes=5)
    )
    settle(rows["https://mastodon.example/users/u0/inbox"], Status.DELIVERED, last_status=202)
    settle(rows["https://lemmy.example/users/u0/inbox"], Status.FAILED, last_status=500)
    open_breaker("down.example", failures=10)
    controls.pause_host("pixelfed.example")
    fill_history()
    return {"batch": batch, "failed": rows["https://lemmy.example/users/u0/inbox"]}


def fill_history() -> None:
    """Two days of a server's history: busier by day, an outage of down.example
    three hours ago (retries, then failures, and its breaker opening), and a
    few refusals."""
    now = history.minute_of(timezone.now())
    rows = []
    for n in range(2 * 24 * 60):
        minute = now - dt.timedelta(minutes=n)
        busy = 30 if 8 <= minute.hour < 22 else 12
        outage = 170 <= n < 200
        rows.append(
            DeliveryHistory(
                minute=minute,
                delivered=busy + n % 7,
                retried=(6 if outage else 0) + n % 3,
                refused=1 if n % 11 == 0 else 0,
                failed=2 if outage and n % 4 == 0 else 0,
                breakers_opened=1 if n in (5, 190) else 0,
            )
        )
    DeliveryHistory.objects.bulk_create(rows)


def fill_webhooks(settings: Any) -> None:
    """Two webhook destinations: one whose first event keeps failing, holding
    two more; and one with an event due now. Nothing is sent: no deliverer runs.
    Events go in the webhook lane, apart from the activities."""
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "WEBHOOKS": {
            "alerts": "slack://hooks.slack.com/services/T0BROWSER/B0BROWSER/notARealToken1",
            "audit": "https://receiver.example/hooks?secret=whsec_"
            "QUJDREVGR0hJSktMTU5PUFFSU1RVVldYWVo0NTY3ODk=",
        },
    }
    for n, event in enumerate(("alert.raised", "alert.updated", "alert.resolved")):
        send_webhook("alerts", event, {"host": "db1", "n": n})
    send_webhook("audit", "user.created", {"name": "Zoë"})
    first = Delivery.objects.filter(host="<alerts>").order_by("id").first()
    assert first is not None
    Delivery.objects.filter(pk=first.pk).update(
        attempts=3,
        last_status=503,
        last_error="the receiver answered 503 Service Unavailable: upstream timeout",
        due_at=timezone.now() + dt.timedelta(minutes=8),
    )


def test_staff_open_the_queues_page_and_every_list(
    page: Page, live_server: Any, settings: Any
) -> None:
    fill_queue()
    fill_webhooks(settings)
    log_in(page, live_server, user("operator"))
    page.goto(f"{live_server.url}/admin/federation_delivery/delivery/")
    page.click("text=Queues at a glance")
    expect(page.get_by_role("heading", name="Queues at a glance")).to_be_visible()
    normal = page.locator('tr[data-lane="normal"]')
    expect(normal.locator('[data-column="due"]')).to_have_text("4")
    expect(normal.locator('[data-column="scheduled"]')).to_have_text("2")
    expect(normal.locator('[data-column="in_flight"]')).to_have_text("1")
    expect(normal.locator('[data-column="lag"]')).to_contain_text("2m")
    expect(normal.locator('[data-column="held"]')).to_have_text("3")
    expect(normal.locator('[data-column="failed_last_day"]')).to_have_text("1")
    expect(page.locator("#fd-failing-hosts")).to_contain_text("down.example")
    expect(page.locator("#fd-open-breakers")).to_contain_text("down.example")
    expect(page.locator("#fd-paused-hosts")).to_contain_text("pixelfed.example")
    alerts = page.locator('#fd-destinations tr[data-destination="alerts"]')
    expect(alerts.locator('[data-column="kind"]')).to_have_text("Slack")
    expect(alerts.locator('[data-column="pending"]')).to_have_text("3")
    expect(alerts.locator('[data-column="head"]')).to_have_text("alert.raised")
    expect(alerts.locator('[data-column="last_error"]')).to_contain_text(
        "the receiver answered 503"
    )
    expect(page.locator("#fd-destinations")).not_to_contain_text("hooks.slack.com")
    for chart, title in (
        ("#fd-history-minutes", "Last hour, by minute"),
        ("#fd-history-hours", "Last two days, by hour"),
    ):
        svg = page.locator(chart)
        expect(svg).to_be_visible()
        expect(svg).to_have_attribute("role", "img")
        expect(svg.locator("title").first).to_contain_text(title)
        for label in ("delivered", "retried", "refused", "failed", "breaker opened"):
            expect(svg.locator(".fd-legend-item", has_text=label)).to_be_visible()
        expect(svg.locator(".fd-breaker-mark").first).to_be_visible()
        box = svg.bounding_box()
        assert box is not None and box["width"] > 600 and box["height"] > 200, box
    screenshot(page, "queues")

    for model, text in (
        ("batch", "1 delivered · 1 failed · 4 pending"),
        ("breaker", "down.example"),
        ("host", "pixelfed.example"),
    ):
        page.goto(f"{live_server.url}/admin/federation_delivery/{model}/")
        expect(page.locator("#result_list")).to_contain_text(text)
        screenshot(page, "batches" if model == "batch" else f"{model}s")

    page.goto(f"{live_server.url}/admin/federation_delivery/delivery/?host=down.example")
    page.locator("#result_list tbody tr a", has_text="down.example").first.click()
    expect(page.locator("pre.fd-body")).to_contain_text('"type": "Create"')
    screenshot(page, "delivery")


def test_staff_follow_a_webhook_destination_to_its_deliveries(
    page: Page, live_server: Any, settings: Any
) -> None:
    fill_queue()
    fill_webhooks(settings)
    log_in(page, live_server, user("operator"))
    page.goto(f"{live_server.url}/admin/federation_delivery/delivery/")
    page.click("text=Webhook destinations")
    expect(page.get_by_role("heading", name="Webhook destinations")).to_be_visible()
    audit = page.locator('tr[data-destination="audit"]')
    expect(audit.locator('[data-column="kind"]')).to_have_text("Signed JSON")
    expect(audit.locator('[data-column="next_try"]')).to_have_text("due now")
    expect(page.locator("#content-main")).not_to_contain_text("receiver.example")
    screenshot(page, "destinations")

    page.locator('tr[data-destination="alerts"] th a').click()
    rows = page.locator("#result_list tbody tr")
    expect(rows).to_have_count(3)
    expect(rows.locator("td.field-event")).to_have_text(
        ["alert.resolved", "alert.updated", "alert.raised"]
    )
    expect(rows.last.locator("td.field-next_due")).to_contain_text("in 7")
    expect(rows.first.locator("td.field-next_due")).to_contain_text("held: waits on #")
    rows.last.locator("th a, td a").first.click()
    expect(page.locator("div.field-destination")).to_contain_text("alerts")
    expect(page.locator("pre.fd-body")).to_contain_text('"type": "alert.raised"')
    expect(page.locator("#content-main")).not_to_contain_text("hooks.slack.com")


def test_staff_requeue_a_failed_delivery_and_see_it_pending(page: Page, live_server: Any) -> None:
    failed = fill_queue()["failed"]
    log_in(page, live_server, user("operator"))
    page.goto(f"{live_server.url}/admin/federation_delivery/delivery/?status__exact=failed")
    expect(page.locator("#result_list tbody tr")).to_have_count(1)
    run_action(page, failed.inbox, "requeue")
    expect(page.locator(".messagelist")).to_contain_text("Requeued 1 delivery, due now")
    page.goto(f"{live_server.url}/admin/federation_delivery/delivery/?q=lemmy.example")
    row = page.locator("#result_list tbody tr", has_text=failed.inbox)
    expect(row.locator("td.field-status")).to_have_text("pending")
    expect(row.locator("td.field-next_due")).to_have_text("due now")
    expect(row.locator("td.field-attempts")).to_have_text("3")
    screenshot(page, "deliveries")
    assert Delivery.objects.get(pk=failed.pk).status == Status.PENDING


def test_staff_pause_a_host_and_see_its_deliveries_held(page: Page, live_server: Any) -> None:
    fill_queue()
    log_in(page, live_server, user("operator"))
    page.goto(f"{live_server.url}/admin/federation_delivery/breaker/")
    run_action(page, "down.example", "pause_hosts")
    expect(page.locator(".messagelist")).to_contain_text(
        "Paused 1 host: 2 pending deliveries held until resumed."
    )
    page.goto(f"{live_server.url}/admin/federation_delivery/delivery/?host=down.example")
    expect(page.locator("td.field-next_due")).to_have_text(["held: host paused"] * 2)
    page.goto(f"{live_server.url}/admin/federation_delivery/host/?paused=yes")
    expect(page.locator("#result_list")).to_contain_text("down.example")
    assert Host.objects.get(name="down.example").paused_at is not None


def test_a_viewer_sees_but_is_refused_an_action(page: Page, live_server: Any) -> None:
    failed = fill_queue()["failed"]
    log_in(page, live_server, user("viewer", ("view",)))
    page.goto(f"{live_server.url}/admin/federation_delivery/delivery/?status__exact=failed")
    expect(page.locator("#result_list")).to_contain_text(failed.inbox)
    expect(page.locator("select[name=action]")).to_have_count(0)
    # Forge the action the page does not offer: the admin answers 403.
    page.evaluate(
        """(id) => {
            const form = document.getElementById("changelist-form");
            for (const [name, value] of [
                ["action", "requeue"], ["_selected_action", id], ["index", "0"],
            ]) {
                const input = document.createElement("input");
                Object.assign(input, {type: "hidden", name, value});
                form.appendChild(input);
            }
            form.submit();
        }""",
        str(failed.pk),
    )
    expect(page.get_by_role("heading", name="403 Forbidden")).to_be_visible()
    screenshot(page, "refused")
    assert Delivery.objects.get(pk=failed.pk).status == Status.FAILED
    page.goto(f"{live_server.url}/admin/federation_delivery/delivery/{failed.pk}/change/")
    expect(page.locator("pre.fd-body")).to_be_visible()
    expect(page.locator("input[name=_save]")).to_have_count(0)
