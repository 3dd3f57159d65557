from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Any

import pytest

from django_federation_delivery import metrics
from django_federation_delivery.deliverer import Deliverer
from django_federation_delivery.hosts import pause_host, resume_host
from django_federation_delivery.outages import Database
from django_federation_delivery.settling import Summary
from django_federation_delivery.slots import Slots
from django_federation_delivery.upkeep import GAUGES_EVERY, Upkeep

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
    with django_assert_num_queries(1):
        chores.refresh()
        chores.refresh()
    assert chores.paused == {"a.example"}


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
    deliverer.upkeep.beat()  # its first, as the loop's first turn makes it
    stopper = threading.Timer(0.5, deliverer.stop)
    stopper.start()
    deliverer.intake.idle(listening=True)
    stopper.join()
    if served:
        assert len(read) >= 3, "about every 0.1 s for 0.5 s, not once"
    else:
        assert (read, beats) == ([], 1)
