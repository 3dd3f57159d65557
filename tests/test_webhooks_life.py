"""A webhook destination's life: disabled by a 410 or by failing too long,
its events held in order, told once, enabled again; and the tools around it."""

from __future__ import annotations

import datetime as dt
import json
import re
from collections.abc import Callable, Iterator
from io import StringIO
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.core.checks import run_checks
from django.core.management import call_command
from django.core.management.base import CommandError
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from django_federation_delivery import controls, hosts, send_webhook, signals
from django_federation_delivery.attempt import AttemptResult
from django_federation_delivery.deliverer import Deliverer
from django_federation_delivery.dialect import aware_now
from django_federation_delivery.models import Delivery, Host, Status
from django_federation_delivery.store import claims
from django_federation_delivery.webhooks import life
from django_federation_delivery.webhooks.destinations import delivery_key
from django_federation_delivery.webhooks.status import destination_status

from .conftest import Inbox, Received, RunningDeliverer, wait_until
from .test_health import delivered_by_another
from .test_limits import answered
from .test_webhooks_deliveries import SECRET, configure, signed

pytestmark = pytest.mark.django_db(transaction=True)


def numbers(inbox: Inbox) -> list[int]:
    return [int(json.loads(request.body)["data"]["n"]) for request in inbox.received]


def check() -> tuple[int, str]:
    """``delivery_status --check``: its exit status and its line."""
    out = StringIO()
    try:
        call_command("delivery_status", "--check", "--max-lag", "0", stdout=out)
    except SystemExit as exit:
        return int(exit.code or 0), out.getvalue()
    return 0, out.getvalue()


@pytest.fixture
def disabled() -> Iterator[list[signals.DestinationDisabled]]:
    told: list[signals.DestinationDisabled] = []

    def receiver(sender: Any, disabled: signals.DestinationDisabled, **kwargs: Any) -> None:
        told.append(disabled)

    signals.webhook_destination_disabled.connect(receiver, weak=False)
    yield told
    signals.webhook_destination_disabled.disconnect(receiver)


def test_a_410_disables_the_destination_holds_its_events_in_order_until_enabled(
    inboxes: Callable[..., Inbox],
    start_deliverer: Callable[..., RunningDeliverer],
    settings: Any,
    disabled: list[signals.DestinationDisabled],
) -> None:
    def gone_once(request: Received) -> tuple[int, dict[str, str], bytes]:
        if len(receiver.received) == 1:
            return 410, {}, b"hook deleted"
        return 204, {}, b""

    receiver = inboxes("127.0.0.1", respond=gone_once)
    configure(settings, {"ops": signed(receiver)})
    for n in range(3):
        send_webhook("ops", "alert.raised", {"n": n})
    runner = start_deliverer(heartbeat=True)
    wait_until(lambda: Host.objects.filter(name=delivery_key("ops"), paused_at__isnull=False))
    # Held, not dropped: every event waits, the first with its tries intact.
    wait_until(lambda: len(disabled) == 1)
    # Told before the attempt's outcome is written (a crash between them
    # tells it again): that is written with the next of the outbox.
    wait_until(lambda: Delivery.objects.filter(last_status=410).exists())
    assert numbers(receiver) == [0]
    rows = list(Delivery.objects.order_by("id"))
    assert [row.status for row in rows] == [Status.PENDING] * 3
    assert rows[0].attempts == 0 and rows[0].last_status == 410
    (told,) = disabled
    assert (told.destination, told.reason) == ("ops", "the receiver answered 410 Gone")
    code, line = check()
    assert code == 2 and line.startswith("CRITICAL: ")
    assert "ops (3 waiting): the receiver answered 410" in line

    out = StringIO()
    call_command("enable_webhook", "ops", stdout=out)
    # Every event waiting goes again, in order: the first now, not it alone.
    assert out.getvalue().strip() == "ops enabled again: 3 events are due now, in order."
    wait_until(lambda: not Delivery.objects.filter(status=Status.PENDING).exists())
    runner.stop()
    assert numbers(receiver) == [0, 0, 1, 2]
    assert len(disabled) == 1, "told once"
    assert check()[0] == 0


def test_a_destination_enabled_before_its_hold_is_written_sends_its_events(
    inboxes: Callable[..., Inbox],
    start_deliverer: Callable[..., RunningDeliverer],
    settings: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Enabled while the attempt its 410 disabled it in was still in hand (a
    # receiver of the signal, an operator at that moment): the enable made
    # due only what no lease held, and the first event's hold, written after,
    # left it due at no time, for ever, and every event behind it.
    monkeypatch.setattr("django_federation_delivery.upkeep.STRANDED_EVERY", 0.2)

    def gone_once(request: Received) -> tuple[int, dict[str, str], bytes]:
        return (410, {}, b"hook deleted") if len(receiver.received) == 1 else (204, {}, b"")

    def enable_at_once(sender: Any, disabled: signals.DestinationDisabled, **kwargs: Any) -> None:
        life.enable(disabled.destination)

    receiver = inboxes("127.0.0.1", respond=gone_once)
    configure(settings, {"ops": signed(receiver)})
    for n in range(2):
        send_webhook("ops", "alert.raised", {"n": n})
    signals.webhook_destination_disabled.connect(enable_at_once, weak=False)
    try:
        runner = start_deliverer()
        wait_until(
            lambda: not Delivery.objects.filter(status=Status.PENDING).exists(),
            state=lambda: (
                list(Delivery.objects.values("id", "status", "due_at", "after_id", "lease_token")),
                list(Host.objects.values("name", "paused_at")),
            ),
        )
        runner.stop()
    finally:
        signals.webhook_destination_disabled.disconnect(enable_at_once)
    assert numbers(receiver) == [0, 0, 1]


def test_failing_without_a_success_for_webhook_disable_after_disables_it(
    inboxes: Callable[..., Inbox],
    start_deliverer: Callable[..., RunningDeliverer],
    settings: Any,
    disabled: list[signals.DestinationDisabled],
) -> None:
    receiver = inboxes("127.0.0.1", respond=lambda request: (503, {}, b"down"))
    configure(settings, {"ops": signed(receiver)}, WEBHOOK_DISABLE_AFTER=0.5)
    send_webhook("ops", "alert.raised", {"n": 0})
    send_webhook("ops", "alert.raised", {"n": 1})
    runner = start_deliverer()
    wait_until(lambda: len(disabled) == 1)
    sent = len(receiver.received)
    runner.stop()
    assert disabled[0].reason == "no success for 0.5 s (WEBHOOK_DISABLE_AFTER)"
    # Tried while it failed, then held: nothing given up, nothing sent since.
    assert 2 <= sent < 9 and len(receiver.received) == sent
    assert list(Delivery.objects.values_list("status", flat=True)) == [Status.PENDING] * 2


def test_a_destination_gone_from_the_settings_fails_no_more(settings: Any) -> None:
    # It failed for a week with an event waiting, then was taken out of the
    # settings, and a deliverer gave the event up. Added back, the week
    # still counted: its first failure disabled it.
    configure(settings, {"ops": "slack+http://127.0.0.1:9/services/T1/B1/x1"})
    send_webhook("ops", "alert.raised", {"n": 0})
    week_ago = timezone.now() - dt.timedelta(days=7)
    Host.objects.create(name=delivery_key("ops"), failing_since=week_ago)
    configure(settings, {})
    Deliverer().run(drain=True, stop_after=10)
    assert Delivery.objects.get().status == Status.FAILED
    assert Host.objects.get(name=delivery_key("ops")).failing_since is None


def failing_since() -> dt.datetime | None:
    """Since when "ops" has failed, as every deliverer and the admin see it."""
    (ops,) = (d for d in destination_status() if d.name == "ops")
    return ops.failing_since


def test_a_success_anywhere_since_counts_before_a_destination_is_disabled(settings: Any) -> None:
    configure(settings, {"ops": f"https://receiver.example/ops?secret={SECRET}"})
    key = delivery_key("ops")
    watch = life.Watch(90.0)
    now = timezone.now()
    failed = AttemptResult(
        job=None,  # type: ignore[arg-type]
        delivered=False,
        status=503,
        error="down",
        permanent=False,
        retry_after=None,
        accepted_scheme=None,
        duration=0.1,
    )
    row = claims.Claimed(1, 1, "ops", key, 0, (), "", 0.0, "ops")
    # It has failed for two minutes, as this deliverer saw it...
    watch(row, failed, now - dt.timedelta(minutes=2))
    assert failing_since() == now - dt.timedelta(minutes=2)
    # ...but another deliverer delivered an event a minute ago.
    from .operators import queue

    batch = queue(hosts=["x.example"])
    Delivery.objects.filter(batch=batch).update(
        host=key, status=Status.DELIVERED, settled_at=now - dt.timedelta(minutes=1)
    )
    watch(row, failed, now)
    assert not Host.objects.filter(name=key, paused_at__isnull=False).exists()
    assert failing_since() == now - dt.timedelta(minutes=1)


def test_a_quiet_destination_failing_once_after_another_deliverer_s_success_stays_enabled(
    settings: Any, disabled: list[signals.DestinationDisabled]
) -> None:
    # One 503, then the next event delivered by another deliverer whose view
    # did not have "ops" failing; no event for two hours, then one 503. It
    # was disabled there, "no success for 3600 s", as if failing all along.
    configure(settings, {"ops": f"https://receiver.example/ops?secret={SECRET}"})
    row = claims.Claimed(1, 1, "ops", delivery_key("ops"), 0, (), "", 0.0, "ops")
    now = timezone.now()
    first = life.Watch(3600.0)
    delivered_by_another(first, life.Watch(3600.0), row, now - dt.timedelta(hours=2), view=row)
    assert first(row, answered(503), now) is False
    assert disabled == []
    assert failing_since() == now


def test_a_success_clears_a_failing_since_another_deliverer_saw_begin(settings: Any) -> None:
    # The one that saw it fail stopped (or is another process): a new
    # deliverer's first success still clears it, and sends nothing again.
    configure(settings, {"ops": f"https://receiver.example/ops?secret={SECRET}"})
    key = delivery_key("ops")
    now = timezone.now()
    Host.objects.create(name=key, failing_since=now - dt.timedelta(minutes=2))
    Host.objects.create(name="inbox.example", failing_since=now - dt.timedelta(minutes=2))
    row = claims.Claimed(1, 1, "ops", key, 0, (), "", 0.0, "ops")
    life.Watch(90.0)(row, answered(200), now)
    assert failing_since() is None
    assert Host.objects.get(name="inbox.example").failing_since is not None, "not a destination"


def test_with_use_tz_off_a_destination_failing_too_long_is_disabled(settings: Any) -> None:
    # The loop's time is aware whatever USE_TZ says: SQLite's backend
    # refused it, and PostgreSQL's naive one read back could not be compared
    # with it; each attempt's error was logged and dropped, nothing disabled.
    settings.USE_TZ = False
    settings.TIME_ZONE = "America/Los_Angeles"
    configure(settings, {"ops": f"https://receiver.example/ops?secret={SECRET}"})
    row = claims.Claimed(1, 1, "ops", delivery_key("ops"), 0, (), "", 0.0, "ops")
    now = aware_now()  # what the loop judges an attempt at (settling.py)
    assert life.Watch(90.0)(row, answered(503), now) is False
    # Another deliverer (or this one, restarted) sees it fail 91 s on.
    assert life.Watch(90.0)(row, answered(503), now + dt.timedelta(seconds=91)) is True
    assert Host.objects.filter(name="<ops>", paused_at__isnull=False).exists()


def test_with_use_tz_off_a_destination_answering_410_is_disabled_and_told(
    settings: Any, disabled: list[signals.DestinationDisabled]
) -> None:
    settings.USE_TZ = False
    settings.TIME_ZONE = "America/Los_Angeles"
    configure(settings, {"ops": f"https://receiver.example/ops?secret={SECRET}"})
    row = claims.Claimed(1, 1, "ops", delivery_key("ops"), 0, (), "", 0.0, "ops")
    assert life.Watch(90.0)(row, answered(410), aware_now()) is True
    assert Host.objects.filter(name="<ops>", paused_at__isnull=False).exists()
    assert life.disable("audit", "by hand") is True  # at its own time: naive, USE_TZ off
    assert [timezone.is_aware(told.disabled_at) for told in disabled] == [True, True]


def test_a_success_clears_a_failing_since_another_deliverer_wrote_after_it_looked(
    settings: Any,
) -> None:
    # It read the failing destinations once, as it first looked: one that
    # another deliverer saw fail since stayed failing, however well it
    # answered this one.
    configure(settings, {"ops": f"https://receiver.example/ops?secret={SECRET}"})
    row = claims.Claimed(1, 1, "ops", delivery_key("ops"), 0, (), "", 0.0, "ops")
    now = timezone.now()
    this, other = life.Watch(90.0), life.Watch(90.0)
    this(row, answered(200), now)
    other(row, answered(503), now + dt.timedelta(seconds=1))
    assert failing_since() == now + dt.timedelta(seconds=1)
    this(row, answered(200), now + dt.timedelta(seconds=20))  # read again: 9 s at most
    assert failing_since() is None


def test_a_destination_enabled_again_is_not_disabled_again_at_its_next_failure(
    settings: Any, disabled: list[signals.DestinationDisabled]
) -> None:
    # A deliverer whose view still had it failing since long ago, from
    # before another disabled it and an operator enabled it, disabled it
    # again at its first failure.
    configure(settings, {"ops": f"https://receiver.example/ops?secret={SECRET}"})
    row = claims.Claimed(1, 1, "ops", delivery_key("ops"), 0, (), "", 0.0, "ops")
    now = timezone.now()
    this, other = life.Watch(90.0), life.Watch(90.0)
    this(row, answered(503), now)
    this(row, answered(503), now + dt.timedelta(seconds=85))  # it looks again
    assert other(row, answered(410), now + dt.timedelta(seconds=86)) is True
    life.enable("ops")
    assert failing_since() is None
    assert this(row, answered(503), now + dt.timedelta(seconds=91)) is False
    assert failing_since() == now + dt.timedelta(seconds=91), "failing again, since then"
    assert len(disabled) == 1


def test_a_destination_failing_for_days_is_never_marked_unavailable_nor_probed(
    settings: Any,
) -> None:
    # Its key was marked as an inbox's host is, after HOST_UNAVAILABLE_AFTER;
    # enabled again, it stayed so: shown unavailable, first in the hosts,
    # and probed daily for ever at https://<ops>/.well-known/nodeinfo.
    from django_federation_delivery.availability import mark_unavailable, probe_due
    from django_federation_delivery.picture import host_picture

    configure(settings, {"ops": f"https://receiver.example/ops?secret={SECRET}"})
    now = timezone.now()
    # What the deliverer left: failing for 8 days, disabled after 5 of them.
    Host.objects.create(name="<ops>", failing_since=now - dt.timedelta(days=8))
    assert life.disable("ops", "no success for 5 days (WEBHOOK_DISABLE_AFTER)") is True
    assert mark_unavailable(7 * 86400.0) == []  # a deliverer's hourly upkeep
    life.enable("ops")  # the operator: the receiver is mended
    picture = host_picture("<ops>")
    assert picture is not None
    assert (picture.trouble, picture.unavailable_since) == ("ok", None)
    assert probe_due() == []


def test_a_destination_enabled_again_is_no_longer_unavailable_if_it_was_marked_so(
    settings: Any,
) -> None:
    from django_federation_delivery.availability import probe_due

    configure(settings, {"ops": f"https://receiver.example/ops?secret={SECRET}"})
    now = timezone.now()
    # Marked before destinations were left out, and disabled.
    week_ago = now - dt.timedelta(days=7)
    Host.objects.create(name="<ops>", failing_since=week_ago, unavailable_since=now)
    assert life.disable("ops", "no success for 5 days (WEBHOOK_DISABLE_AFTER)") is True
    assert probe_due() == [], "no inbox's host: never probed"
    life.enable("ops")
    ops = Host.objects.get(name="<ops>")
    assert (ops.failing_since, ops.unavailable_since, ops.paused_at) == (None, None, None)


# Django's own checks look up the auth app, which a transactional test's flush leaves out.
@pytest.mark.django_db
def test_events_for_a_destination_no_longer_configured_are_warned_of_before_a_deliverer_runs(
    settings: Any,
) -> None:
    configure(settings, {"old": f"https://receiver.example/hook?secret={SECRET}"})
    send_webhook("old", "alert.raised", {"n": 0})
    send_webhook("old", "alert.raised", {"n": 1})
    configure(settings, {})
    # Not due yet, as after a failed try: the queue is not stalled, only waiting.
    Delivery.objects.update(due_at=timezone.now() + dt.timedelta(hours=1))
    warned = [m for m in run_checks(databases=["default"]) if m.id == "federation_delivery.W004"]
    assert len(warned) == 1 and "2 events wait for the webhook destination 'old'" in warned[0].msg
    assert "WEBHOOK_OLD" in warned[0].hint
    code, line = check()
    assert code == 1 and line.startswith("WARNING: ") and "old (2)" in line


def test_delivery_status_shows_each_destination_and_its_state(
    settings: Any, disabled: list[signals.DestinationDisabled]
) -> None:
    configure(
        settings,
        {
            "ops": f"https://receiver.example/ops?secret={SECRET}",
            "audit": f"https://receiver.example/audit?secret={SECRET}",
        },
    )
    send_webhook(["ops", "audit"], "alert.raised", {"n": 0})
    assert life.disable("ops", "the receiver answered 410 Gone")
    assert not life.disable("ops", "again"), "disabled once"
    out = StringIO()
    call_command("delivery_status", stdout=out)
    text = out.getvalue().split("Webhook destinations\n", 1)[1]
    rows = {line.split()[0]: line for line in text.splitlines()[1:3]}
    assert re.search(r"disabled \d+s ago: the receiver answered 410 Gone$", rows["ops"])
    assert rows["audit"].rstrip().endswith("sending")
    out = StringIO()
    call_command("delivery_status", "--json", stdout=out)
    found = {d["name"]: d for d in json.loads(out.getvalue())["webhook_destinations"]}
    assert found["ops"]["disabled"] and not found["audit"]["disabled"]
    assert SECRET not in out.getvalue()
    assert len(disabled) == 1


@pytest.mark.django_db
def test_staff_enable_a_disabled_destination_from_the_admin_and_viewers_cannot(
    settings: Any,
) -> None:
    from django.contrib.auth.models import Permission

    configure(settings, {"ops": f"https://receiver.example/ops?secret={SECRET}"})
    send_webhook("ops", "alert.raised", {"n": 0})
    life.disable("ops", "the receiver answered 410 Gone")
    page = reverse("admin:federation_delivery_delivery_destinations")
    enable = reverse("admin:federation_delivery_delivery_enable_destination")
    viewer = get_user_model().objects.create_user("viewer", password="pw", is_staff=True)
    viewer.user_permissions.add(Permission.objects.get(codename="view_delivery"))
    client = Client()
    client.force_login(viewer)
    html = client.get(page).content.decode()
    assert "disabled" in html and "the receiver answered 410 Gone" in html
    assert "Enable again" not in html
    assert client.post(enable, {"name": "ops"}).status_code == 403
    operator = get_user_model().objects.create_superuser("root", "root@example.com", "pw")
    client.force_login(operator)
    assert "Enable again" in client.get(page).content.decode()
    response = client.post(enable, {"name": "ops"}, follow=True)
    assert [str(m) for m in response.context["messages"]] == [
        "ops enabled again: 1 event is due now."
    ]
    assert not Host.objects.filter(paused_at__isnull=False).exists()
    assert client.post(enable, {"name": "nobody"}).status_code == 403


def test_an_operator_s_pause_keeps_no_reason_a_disabled_destination_had(settings: Any) -> None:
    # A reason left on a row resumed before resuming cleared it: the pause
    # an operator makes now is theirs, not the deliverer's.
    configure(settings, {"ops": f"https://receiver.example/ops?secret={SECRET}"})
    Host.objects.create(name="<ops>", disabled_reason="the receiver answered 410 Gone")
    hosts.pause_host("<ops>")
    [ops] = destination_status()
    assert ops.disabled and ops.disabled_reason == ""
    assert ops.state(timezone.now()).startswith("paused by an operator ")


def test_enable_webhook_names_an_unknown_destination(settings: Any) -> None:
    configure(settings, {"ops": f"https://receiver.example/ops?secret={SECRET}"})
    with pytest.raises(CommandError, match=r"no webhook destination named 'opz' \(known: ops\)"):
        call_command("enable_webhook", "opz")
    out = StringIO()
    call_command("enable_webhook", "ops", stdout=out)
    assert "ops is not disabled" in out.getvalue()


@pytest.mark.parametrize("command", ["enable_webhook", "send_test_webhook"])
def test_a_webhook_url_pasted_for_a_name_is_not_repeated_whole(settings: Any, command: str) -> None:
    configure(settings, {"ops": f"https://receiver.example/ops?secret={SECRET}"})
    pasted = f"slack://hooks.slack.com/services/T0SECRET/B0SECRET/{SECRET}"
    with pytest.raises(CommandError) as refused:
        call_command(command, pasted)
    assert "named 'slack://hooks.slack.com/…'" in str(refused.value)
    assert "T0SECRET" not in str(refused.value) and SECRET not in str(refused.value)
    # Without its scheme, as copied from a browser's address bar.
    with pytest.raises(CommandError) as refused:
        call_command(command, pasted.removeprefix("slack://"))
    assert "named 'hooks.slack.com/…'" in str(refused.value)
    assert "T0SECRET" not in str(refused.value) and SECRET not in str(refused.value)


@pytest.mark.parametrize(("status", "code"), [(204, 0), (503, 1)])
def test_send_test_webhook_pings_now_and_prints_the_answer(
    inboxes: Callable[..., Inbox], settings: Any, status: int, code: int
) -> None:
    receiver = inboxes("127.0.0.1", respond=lambda request: (status, {}, b"busy"))
    configure(settings, {"ops": signed(receiver)})
    out = StringIO()
    try:
        call_command("send_test_webhook", "ops", stdout=out)
        exited = 0
    except SystemExit as exit:
        exited = int(exit.code or 0)
    assert exited == code
    (request,) = receiver.received
    assert json.loads(request.body)["type"] == "ping"
    line = out.getvalue()
    assert line.startswith("ops (Signed JSON): ") and " s: " in line
    if status == 204:
        assert "204 No Content" in line and line.rstrip().endswith("delivered.")
    else:
        assert "not delivered: the receiver answered 503 Service Unavailable: busy" in line
    assert SECRET not in line and str(receiver.port) not in line
    assert not Delivery.objects.exists(), "nothing is queued"


def test_send_test_webhook_pings_with_use_tz_off_stamped_in_utc(
    inboxes: Callable[..., Inbox], settings: Any
) -> None:
    # With USE_TZ off timezone.now() is naive: the command died before any
    # request, "InvalidDelivery: An event's timestamp must be an aware datetime".
    settings.USE_TZ = False
    settings.TIME_ZONE = "Asia/Tokyo"
    receiver = inboxes("127.0.0.1")
    configure(settings, {"ops": signed(receiver)})
    out = StringIO()
    call_command("send_test_webhook", "ops", stdout=out)
    (request,) = receiver.received
    ping = json.loads(request.body)
    assert ping["type"] == "ping" and ping["timestamp"].endswith("Z")
    sent = dt.datetime.fromisoformat(ping["timestamp"])
    assert abs(sent - dt.datetime.now(dt.UTC)) < dt.timedelta(minutes=1)
    assert out.getvalue().rstrip().endswith("delivered.")


def test_send_test_webhook_names_an_unknown_destination(settings: Any) -> None:
    configure(settings, {})
    with pytest.raises(CommandError, match="no webhook destination named 'ops'"):
        call_command("send_test_webhook", "ops")


@pytest.mark.django_db
def test_a_destination_disabled_with_nothing_waiting_is_critical_and_says_none_waits(
    settings: Any,
) -> None:
    # Disabled, it holds whatever is sent it next: the line once said "their
    # events waiting" where none did.
    configure(settings, {"ops": "slack+http://127.0.0.1:9/services/T/B/x"})
    assert life.disable("ops", "the receiver answered 410 Gone")
    code, line = check()
    assert code == 2
    assert "held until enabled again: ops (0 waiting): the receiver answered 410 Gone" in line


@pytest.mark.django_db
def test_an_event_given_up_in_flight_requeued_while_disabled_waits_its_lease_once_enabled(
    settings: Any,
) -> None:
    configure(settings, {"ops": f"https://hooks.example/hook?secret={SECRET}"})
    batch = send_webhook("ops", "alert.raised", {"n": 0})
    assert batch is not None
    # Claimed, its attempt in flight for a few minutes more; the destination
    # is disabled meanwhile, the operator gives the event up and requeues it.
    lease_end = timezone.now() + dt.timedelta(minutes=5)
    Delivery.objects.update(lease_token="t", due_at=lease_end, attempts=1)
    assert life.disable("ops", "the receiver answered 410 Gone")
    assert controls.give_up(Delivery.objects.all()) == 1
    assert controls.requeue(Delivery.objects.all()) == 1
    row = Delivery.objects.get()
    assert (row.due_at, row.not_before) == (None, lease_end), "held, its lease end kept"
    # Enabled while that attempt may still be answered: as resume_host does,
    # not sent beside it.
    assert life.enable("ops") == 1
    row = Delivery.objects.get()
    assert row.due_at is not None and row.due_at >= lease_end, (
        f"enabled: due at {row.due_at}, {lease_end - row.due_at} before the end of the "
        "lease of the attempt still in flight"
    )
