from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Any

import pytest

from django_federation_delivery import metrics
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
