from __future__ import annotations

import dataclasses
import datetime as dt
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from django.db import connection
from django.utils import timezone

from django_federation_delivery import metrics, send_batch
from django_federation_delivery.availability import probe_due
from django_federation_delivery.conf import app_settings
from django_federation_delivery.deliverer import Deliverer
from django_federation_delivery.hosts import pause_host, resume_host
from django_federation_delivery.models import Batch, Delivery, Status
from django_federation_delivery.outages import Database
from django_federation_delivery.settling import Summary
from django_federation_delivery.slots import Slots
from django_federation_delivery.upkeep import GAUGES_EVERY, Upkeep

from .conftest import Inbox, wait_until
from .keys import ALICE
from .operators import NOTE, unavailable_and_due_a_probe

DAY = dt.timedelta(days=1)

pytestmark = pytest.mark.django_db


def upkeep() -> Upkeep:
    return Upkeep(
        db=Database("default", threading.Event(), logger=logging.getLogger(__name__)),
        using="default",
        slots=Slots(concurrency=2, per_host=1, slow_after=2.0),
        summary=Summary(),
        breakers=None,
        heartbeat=None,
        metrics=False,
    )


def test_the_paused_hosts_are_read_at_most_about_once_a_second(
    django_assert_num_queries: Any,
) -> None:
    chores = upkeep()
    pause_host("a.example")
    # The first refresh also looks for what waits past its deadline (one
    # query, every OVERDUE_EVERY) and for what was left waiting on a settled
    # delivery (a savepoint of its own, every STRANDED_EVERY: one query, and
    # on SQLite the write lock first); the second reads nothing.
    with django_assert_num_queries(6 if connection.vendor == "sqlite" else 5):
        chores.refresh()
        chores.refresh()
    assert chores.paused == {"a.example"}


def test_each_look_for_what_waits_past_its_deadline_reads_only_the_deadlines_passed_since(
    django_assert_num_queries: Any,
) -> None:
    # Waiting behind its ordering key (no due time), past its deadline.
    now = timezone.now()
    first = send_batch(ALICE, NOTE, ["https://a.example/i"], {"ordering_key": "k"})
    waiting = send_batch(
        ALICE, NOTE, ["https://a.example/i"], {"ordering_key": "k", "deadline": now + DAY}
    )
    assert first is not None and waiting is not None
    Batch.objects.filter(pk=waiting.pk).update(deadline=now - dt.timedelta(days=2))
    chores = upkeep()
    # A run's first look goes back a day: a deadline older than that is left
    # to the claim that takes the row once it is released.
    chores.give_up_overdue()
    assert Delivery.objects.get(batch=waiting).status == Status.PENDING
    Batch.objects.filter(pk=waiting.pk).update(deadline=now - dt.timedelta(seconds=1))
    # The next looks from a little before the last: still in reach.
    chores.give_up_overdue()
    assert Delivery.objects.get(batch=waiting).status == Status.FAILED
    assert Delivery.objects.get(batch=first).status == Status.PENDING
    # With nothing passed since, a look is one query.
    with django_assert_num_queries(1):
        chores.give_up_overdue()


def test_claimed_hosts_are_looked_up_again_only_when_one_seemed_paused(
    django_assert_num_queries: Any,
) -> None:
    chores = upkeep()
    pause_host("a.example")
    chores.refresh()
    with django_assert_num_queries(0):
        assert chores.paused_among({"b.example"}) == frozenset()
    resume_host("a.example")
    with django_assert_num_queries(1):
        assert chores.paused_among({"a.example", "b.example"}) == frozenset()
    assert chores.paused == frozenset()


def test_an_idle_deliverer_reads_the_gauges_as_it_beats(monkeypatch: pytest.MonkeyPatch) -> None:
    # Waiting for work, the loop only beats: the gauges are read there, every
    # GAUGES_EVERY, not only when it turns.
    read: list[str] = []
    monkeypatch.setattr(metrics, "observe_queue", lambda *, using: read.append(using))
    chores = dataclasses.replace(upkeep(), metrics=True)
    chores.beat()
    chores.beat()
    assert read == ["default"]
    monkeypatch.setattr(chores, "_gauges_read", time.monotonic() - GAUGES_EVERY)
    chores.beat()
    assert read == ["default", "default"]


@pytest.mark.parametrize("served", [True, False])
def test_an_idle_deliverer_woken_only_by_sends_reads_its_gauges_on_time(
    settings: Any, monkeypatch: pytest.MonkeyPatch, served: bool
) -> None:
    # Idle on PostgreSQL, only a send wakes it: its heartbeat and its idle
    # poll rare, it still reads its gauges every GAUGES_EVERY while it serves
    # them (else an alert takes it for dead), and wakes no more often when not.
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "HEARTBEAT_SECONDS": 180,
        "IDLE_POLL_SECONDS": 600,
    }
    monkeypatch.setattr("django_federation_delivery.upkeep.GAUGES_EVERY", 0.1)
    read: list[str] = []
    monkeypatch.setattr(metrics, "observe_queue", lambda *, using: read.append(using))
    deliverer = Deliverer(metrics=served, heartbeat=True)
    beats = 0
    beat = deliverer.upkeep.beat

    def counted() -> None:
        nonlocal beats
        beats += 1
        beat()

    monkeypatch.setattr(deliverer.upkeep, "beat", counted)
    deliverer.upkeep.refresh()  # its first, as the loop's first turn makes it
    stopper = threading.Timer(0.5, deliverer.stop)
    stopper.start()
    deliverer.intake.idle(listening=True)
    stopper.join()
    if served:
        assert len(read) >= 3, "about every 0.1 s for 0.5 s, not once"
    else:
        assert (read, beats) == ([], 1)


@pytest.mark.slow
def test_an_idle_round_asks_after_its_lock_and_stops_once_another_has_it(
    settings: Any,
) -> None:
    # Idle, woken only by sends, its heartbeat and idle poll minutes apart:
    # it still asks after its lock every second, and stops claiming once lost.
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "HEARTBEAT_SECONDS": 180,
        "IDLE_POLL_SECONDS": 600,
    }
    asked: list[float] = []

    def holding() -> bool:
        asked.append(time.monotonic())
        return len(asked) < 2

    deliverer = Deliverer(holding=holding)
    started = time.monotonic()
    deliverer.intake.idle(listening=True)
    assert deliverer.stopping, "lost at the second look"
    assert 1 <= time.monotonic() - started < 5
    assert len(asked) == 2


@pytest.mark.django_db(transaction=True)
def test_a_stopping_loop_starts_no_probe_and_leaves_the_hosts_it_did_not_reach_due(
    inboxes: Callable[..., Inbox],
) -> None:
    now = timezone.now()
    silent = [inboxes(address, delay=30) for address in ("127.0.0.2", "127.0.0.3", "127.0.0.4")]
    for server in silent:
        unavailable_and_due_a_probe(server.url(), server.host, now)
    probing = dataclasses.replace(app_settings.transport_settings(), attempt_timeout=1.0)
    chores = dataclasses.replace(upkeep(), probe_settings=probing)
    chores.look_after_hosts()
    wait_until(lambda: sum(len(server.received) for server in silent) == 1)
    chores.stopping.set()
    started = time.monotonic()
    chores.finish(30)
    # The probe under way, out of time after 1 s; none started after it.
    assert time.monotonic() - started < 5
    assert sum(len(server.received) for server in silent) == 1
    # Those not reached are due still, for the next loop: not taken unprobed.
    assert len(probe_due()) == 2


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_an_idle_deliverer_fails_what_waits_for_a_paused_host_past_its_deadline(
    inbox: Inbox, start_deliverer: Callable[..., Any]
) -> None:
    # Nothing else due: an idle loop slept to its idle poll (30 s), and the
    # deadline sweep, which it alone runs, with it.
    pause_host(inbox.host)
    deadline = timezone.now() + dt.timedelta(seconds=1)
    batch = send_batch(ALICE, NOTE, [inbox.url()], {"deadline": deadline})
    runner = start_deliverer()
    try:
        wait_until(lambda: Delivery.objects.get(batch=batch).status == Status.FAILED, timeout=15)
    finally:
        runner.stop()
    assert inbox.received == []


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_drained_run_starts_no_probe_once_it_has_returned(
    inboxes: Callable[..., Inbox], settings: Any
) -> None:
    # A drain ends without a stop: its prober went on taking hosts after the
    # run returned, as the process exits, each left unprobed for a day.
    settings.FEDERATION_DELIVERY = {**settings.FEDERATION_DELIVERY, "ATTEMPT_TIMEOUT": 1.0}
    silent = [inboxes(f"127.0.0.{n}", delay=2.0) for n in (2, 3, 4)]
    now = timezone.now()
    for box in silent:
        unavailable_and_due_a_probe(box.url(), box.host, now)

    def probes() -> int:
        return sum(len(box.received) for box in silent)

    Deliverer().run(drain=True)
    at_return = probes()
    time.sleep(2.5)
    assert probes() == at_return < len(silent)
