"""Circuit breakers end to end: what a closed breaker held goes at once."""

from __future__ import annotations

import datetime as dt
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
from django.db import OperationalError, connection
from django.utils import timezone

from django_federation_delivery import breakers as breakers_module
from django_federation_delivery import controls, send, send_webhook
from django_federation_delivery.breakers import record_probe
from django_federation_delivery.models import Breaker, Delivery
from django_federation_delivery.store.breakers import count_failures

from .conftest import Inbox, RunningDeliverer, wait_until
from .keys import ALICE
from .operators import NOTE, open_breaker

SECOND = dt.timedelta(seconds=1)


def all_arrive(inbox: Inbox, count: int) -> None:
    """``count`` requests reach ``inbox`` within 8 s; else the rows' due
    times and errors are said."""
    wait_until(
        lambda: len(inbox.received) == count,
        timeout=8,
        state=lambda: list(Delivery.objects.values_list("due_at", "last_error")),
    )


def release_fails_once(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The first release of what a breaker held meets the database away;
    returns the releases tried, one item each."""
    real = breakers_module._release_held
    calls: list[int] = []

    def release_held(keys: Any, alias: str) -> None:
        calls.append(1)
        if len(calls) == 1:
            raise OperationalError("server closed the connection unexpectedly")
        real(keys, alias)

    monkeypatch.setattr(breakers_module, "_release_held", release_held)
    return calls


def probe_answered_at_the_claim(
    monkeypatch: pytest.MonkeyPatch,
    key: str,
    *,
    then: Callable[[], object] | None = None,
    held_hosts_only: bool = False,
) -> threading.Event:
    """Another deliverer holds the breaker ``key``'s probe, under way; its
    success (then ``then``) is written just as this deliverer's claim takes
    rows (with ``held_hosts_only``, its claim of the held hosts'), which it
    holds for the probe. Returns what is set once written."""
    from django_federation_delivery.store import claims

    now = timezone.now()
    Breaker.objects.create(
        key=key,
        failures=10,
        open_until=now - SECOND,
        probe_token="the-other-deliverers",
        probe_until=now + dt.timedelta(seconds=60),
    )
    real = claims.claim
    closed = threading.Event()

    def claim(*args: Any, **kwargs: Any) -> Any:
        got = real(*args, **kwargs)
        if got and (kwargs.get("only_hosts") or not held_hosts_only) and not closed.is_set():
            record_probe(key, "the-other-deliverers", failed=False, cool_off=60)
            if then is not None:
                then()
            closed.set()
        return got

    monkeypatch.setattr(claims, "claim", claim)
    return closed


@pytest.mark.django_db(transaction=True)
def test_a_backlog_held_in_hand_goes_though_a_failure_was_counted_since_the_probe_closed_it(
    inbox: Inbox,
    start_deliverer: Callable[..., RunningDeliverer],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two deliverers: the other holds the host's probe. This one claims ten
    deliveries to the host to hold them; just then the other's probe is
    answered 202 (the breaker closes) and one of its next requests there
    meets a 500 (one failure counted, the breaker closed, under its
    threshold). The ten written held are made due: a closed breaker that
    counts failures again holds nothing (they stayed held a cool-off)."""
    host = inbox.host
    send(ALICE, NOTE, [inbox.url(f"/{n}") for n in range(10)])
    # Then a request of the other's own there met one 500.
    closed = probe_answered_at_the_claim(
        monkeypatch,
        host,
        then=lambda: count_failures(Counter({host: 1}), threshold=10, cool_off=60),
    )
    runner = start_deliverer()
    try:
        wait_until(closed.is_set, timeout=10)
        breaker = Breaker.objects.get(key=host)
        assert breaker.open_until is None, "closed, one failure counted"
        all_arrive(inbox, 10)
    finally:
        runner.stop()


@pytest.mark.django_db(transaction=True)
def test_an_idle_deliverer_sends_a_held_backlog_at_once_when_an_operator_resets_the_breaker(
    inbox: Inbox, start_deliverer: Callable[..., RunningDeliverer]
) -> None:
    """A deliverer runs (on PostgreSQL, idle on its LISTEN); a host's
    breaker is open and its three deliveries are held for the cool-off.
    The host is back; the operator resets the breaker (``reset_breaker``,
    the admin's "reset" action, from the web process). The README: what it
    held "goes at once": the deliverers are woken as by a send (the idle one
    slept until its idle poll, 30 s, or the old hold's end). (SQLite's
    deliverers poll for what came due, and find it.)"""
    if connection.vendor != "postgresql":
        pytest.skip("PostgreSQL's idle deliverers wait on LISTEN; SQLite's poll")
    host = inbox.host
    open_breaker(host, seconds=60)
    send(ALICE, NOTE, [inbox.url(f"/{n}") for n in range(3)])
    runner = start_deliverer()
    try:
        held = Delivery.objects.filter(status="pending", last_error__startswith="held:")
        wait_until(lambda: held.count() == 3, timeout=10)
        time.sleep(1.5)  # idle now
        assert controls.reset_breaker(host) == 1
        all_arrive(inbox, 3)
    finally:
        runner.stop()


SECRET = "whsec_" + "c2VjcmV0LWtleS1vZi1zb21lLWxlbmd0aA=="


@pytest.mark.django_db(transaction=True)
def test_a_probe_s_success_whose_write_met_the_database_away_is_written_by_the_running_loop(
    inbox: Inbox,
    start_deliverer: Callable[..., RunningDeliverer],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A running deliverer; a host's breaker half-open, one delivery due
    (the probe) and five held for the cool-off. The probe is answered 202;
    writing its success meets the database away for a moment. With nothing
    else to settle, the loop writes it all the same once the database is
    back, and frees the backlog (flushed only after a write of its outbox,
    it stayed half-open, the five held the whole hold, 60 s)."""

    from django_federation_delivery.breakers import HELD_BY_BREAKER

    host = inbox.host
    Breaker.objects.create(key=host, failures=10, open_until=timezone.now() - SECOND)
    probe = send(ALICE, NOTE, [inbox.url("/probe")])
    backlog = send(ALICE, NOTE, [inbox.url(f"/{n}") for n in range(5)])
    Delivery.objects.filter(batch=backlog).update(
        due_at=timezone.now() + dt.timedelta(seconds=60),
        last_error=HELD_BY_BREAKER.format(key=host),
        attempts=1,
    )
    assert probe is not None
    calls = release_fails_once(monkeypatch)
    runner = start_deliverer()
    try:
        wait_until(lambda: len(inbox.received) >= 1 and bool(calls), timeout=10)
        wait_until(
            lambda: len(inbox.received) == 6,
            timeout=8,
            state=lambda: (
                list(Breaker.objects.values_list("key", "probe_until")),
                list(Delivery.objects.values_list("due_at", "last_error")),
            ),
        )
    finally:
        runner.stop()


@pytest.mark.django_db(transaction=True)
def test_a_webhook_event_held_in_hand_goes_once_another_deliverers_probe_closed_its_breaker(
    inbox: Inbox,
    settings: Any,
    start_deliverer: Callable[..., RunningDeliverer],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Breakers kept per inbox (a webhook destination keeps its ``<ops>``
    key either way, and a probe's success or a reset frees what it held).
    Two deliverers: the other holds ``<ops>``'s probe; this one claims the
    next event to hold it, and the other's probe is answered just then. The
    event, written held, is made due: what a closed breaker held is looked
    at again for a destination's key in either scope (it was skipped when
    the scope is "inbox", and the destination's later events waited)."""
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "BREAKER": {"THRESHOLD": 10, "COOL_OFF": 60.0, "SCOPE": "inbox"},
        "WEBHOOKS": {"ops": f"http://127.0.0.1:{inbox.port}/hook?secret={SECRET}"},
        "WEBHOOK_ALLOWED_NETWORKS": ["127.0.0.0/8"],
    }
    for n in range(3):
        send_webhook("ops", "alert.raised", {"n": n})
    closed = probe_answered_at_the_claim(monkeypatch, "<ops>")
    runner = start_deliverer()
    try:
        wait_until(closed.is_set, timeout=10)
        assert not Breaker.objects.filter(key="<ops>").exists()
        all_arrive(inbox, 3)
    finally:
        runner.stop()


@pytest.mark.django_db
def test_a_hosts_page_shows_its_open_inbox_breaker_among_many_failing_inboxes() -> None:
    """BREAKER SCOPE "inbox": 600 inboxes of big.example have failed a few
    times each (closed breakers, counting), and one has failed 12 times
    and is open. The host's page (and ``delivery_status --host``) says it is
    open, 12 failures: every inbox breaker of the host is counted, not the
    first 500 read in no order."""
    from django_federation_delivery.models import Host
    from django_federation_delivery.picture import host_picture

    Host.objects.create(name="big.example")
    Breaker.objects.bulk_create(
        Breaker(key=f"https://big.example/users/u{n}/inbox", failures=3) for n in range(600)
    )
    Breaker.objects.create(
        key="https://big.example/users/zed/inbox",
        failures=12,
        open_until=timezone.now() + dt.timedelta(minutes=5),
    )
    picture = host_picture("big.example")
    assert picture is not None
    assert (picture.breaker, picture.failures_in_a_row) == ("open", 12), (
        f"shown {picture.breaker}, {picture.failures_in_a_row} failures"
    )


@pytest.mark.django_db(transaction=True)
def test_a_backlog_held_in_hand_goes_once_another_deliverers_probe_closed_the_breaker(
    inbox: Inbox,
    start_deliverer: Callable[..., RunningDeliverer],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two deliverers: the other holds a host's probe, under way; ten
    deliveries wait for the host. This one claims them to hold them (a
    cool-off, 60 s), and the other's probe is answered 202 just then: its
    success closes the breaker and makes due what was held, but these were
    in this one's hands. Written held, they are made due at once, not left
    for the minute with the host healthy and its breaker closed."""
    send(ALICE, NOTE, [inbox.url(f"/{n}") for n in range(10)])
    closed = probe_answered_at_the_claim(monkeypatch, inbox.host, held_hosts_only=True)
    runner = start_deliverer()
    try:
        wait_until(closed.is_set, timeout=10)
        assert not Breaker.objects.filter(key=inbox.host).exists()
        wait_until(lambda: len(inbox.received) == 10, timeout=6)
    finally:
        runner.stop()
