"""The urgent lanes' slots of their own: beside the others', given up by a
slow attempt as any slot is, never keeping a thread past the burst."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from django_federation_delivery import send
from django_federation_delivery.models import Lane

from .conftest import Inbox, Received, RunningDeliverer, wait_until
from .keys import ALICE
from .test_slots import admit_all, item, slots

NOTE = {"type": "Create", "actor": ALICE}


def test_slow_urgent_deliveries_do_not_open_normal_slots_beyond_concurrency() -> None:
    # CONCURRENCY 2: two urgent attempts that turned slow held urgent slots,
    # never a normal one. Each was subtracted twice (once as slow, once as
    # urgent), so four normal deliveries went at once, none of them slow.
    place = slots(concurrency=2, per_host=10)
    for number in range(2):
        place.add(item(number, f"u{number}", Lane.PRIORITY))
    urgent = place.hand_out(admit_all, slow=0, queued=0, most=34)
    assert len(urgent) == 2
    for handed in urgent:
        handed.started = time.monotonic() - 5  # past SLOW_AFTER_SECONDS
    for number in range(2, 12):
        place.add(item(number, "a"))
    normal = place.hand_out(admit_all, slow=place.slow_count(), queued=0, most=34)
    # Slow ones hold no slot: at most their two given up, and CONCURRENCY.
    assert len(normal) <= 2, (
        f"{len(normal)} normal deliveries handed out at once with CONCURRENCY 2, none of them slow"
    )


def test_normal_slots_are_used_while_urgent_ones_wait_for_theirs() -> None:
    # Urgent deliveries have CONCURRENCY slots beside the others': with the
    # urgent slots full and more urgent ready, the normal slots stay empty.
    place = slots(concurrency=2, per_host=10)
    for number in range(4):
        place.add(item(number, f"u{number}", Lane.WEBHOOK))
    for number in range(4, 8):
        place.add(item(number, "a"))
    out = place.hand_out(admit_all, slow=0, queued=0, most=34)
    normal = [handed for handed in out if not handed.urgent]
    assert len(normal) == 2, (
        f"{len(normal)} normal deliveries handed out with their 2 slots free ({len(out)} in all)"
    )


def test_a_slow_urgent_delivery_gives_its_slot_up_to_the_next_urgent_one() -> None:
    # A slow attempt gives its slot up to what comes next, a direct message
    # first; a slow urgent one kept its urgent slot, and the next waited.
    place = slots(concurrency=2, per_host=10)
    for number in range(2):
        place.add(item(number, f"silent{number}", Lane.PRIORITY))
    for handed in place.hand_out(admit_all, slow=0, queued=0, most=34):
        handed.started = time.monotonic() - 5  # past SLOW_AFTER_SECONDS
    place.add(item(2, "fast", Lane.PRIORITY))
    out = place.hand_out(admit_all, slow=place.slow_count(), queued=0, most=34)
    assert [handed.claimed.id for handed in out] == [2], (
        "a direct message waits for two slow urgent attempts to end"
    )


DIRECT = {"type": "Create", "to": "friend"}


def small_sends_first(settings: Any, **options: Any) -> None:
    """A send to five inboxes or fewer goes in the priority lane, urgent."""
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "PRIORITY_MAX_INBOXES": 5,
        **options,
    }


def direct_messages(recipients: list[Inbox]) -> None:
    """One direct message to each of ``recipients``, each received."""
    for inbox in recipients:
        send(ALICE, DIRECT, [inbox.url()])
    wait_until(lambda: all(len(inbox.received) == 1 for inbox in recipients))


@pytest.mark.django_db(transaction=True)
def test_a_direct_message_is_not_held_by_silent_recipients_of_others(
    inboxes: Callable[..., Inbox],
    start_deliverer: Callable[..., RunningDeliverer],
    settings: Any,
) -> None:
    small_sends_first(settings, SLOW_AFTER_SECONDS=0.2, SLOW_CONCURRENCY=4)
    answer = threading.Event()
    silent = [inboxes(f"127.0.0.{10 + n}") for n in range(2)]
    for inbox in silent:
        inbox.respond = lambda request: (answer.wait(20), (202, {}, b""))[1]
    fast = inboxes("127.0.0.3")
    runner = start_deliverer(concurrency=2)
    direct_messages(silent)
    send(ALICE, DIRECT, [fast.url()])
    try:
        # Sent while both silent attempts are in flight: they end only once
        # ``answer`` is set, after this.
        wait_until(lambda: len(fast.received) == 1, timeout=10)
    finally:
        answer.set()
    runner.stop()


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_the_pool_shrinks_back_to_concurrency_after_an_urgent_burst(
    inboxes: Callable[..., Inbox],
    start_deliverer: Callable[..., RunningDeliverer],
    settings: Any,
) -> None:
    # A worker asks whether it is one too many after each attempt, and after
    # each IDLE_CONNECTION_SECONDS idle: asked after its attempt, before the
    # loop took it back, each was needed still, and stayed.
    small_sends_first(settings, IDLE_CONNECTION_SECONDS=0.5)
    targets = [inboxes(f"127.0.0.{10 + n}", delay=0.3) for n in range(6)]
    runner = start_deliverer(concurrency=2)
    direct_messages(targets)
    deliverer = runner.deliverer
    wait_until(lambda: not deliverer.slots.in_flight)
    peak = deliverer.workers._started
    time.sleep(2)  # idle past every attempt, and the idle timeout
    threads = len(deliverer.workers)
    urgent = deliverer.slots.urgent_in_flight
    runner.stop()
    assert urgent == 0
    assert threads <= 2, (
        f"{threads} worker threads left idle with CONCURRENCY 2 and nothing in "
        f"flight ({peak} started)"
    )


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_direct_message_to_a_host_a_fan_out_slowed_goes_beside_its_attempts(
    inboxes: Callable[..., Inbox],
    start_deliverer: Callable[..., RunningDeliverer],
    settings: Any,
) -> None:
    # A host that never refuses, answering in 1.5 s once the fan-out piled
    # up: its limit halved for the slowness made the direct message wait for
    # one of the fan-out's attempts there, 1.5 s on SQLite, 3 s on PostgreSQL.
    settings.FEDERATION_DELIVERY = {**settings.FEDERATION_DELIVERY, "PRIORITY_MAX_INBOXES": 1}
    lock = threading.Lock()
    answered = [0]

    def slows_down(request: Received) -> tuple[int, dict[str, str], bytes]:
        if request.path == "/dm":
            return 202, {}, b""
        with lock:
            answered[0] += 1
            n = answered[0]
        time.sleep(0.02 if n <= 12 else 1.5)  # never a 429 nor a 503
        return 202, {}, b""

    host = inboxes("127.0.0.45", respond=slows_down)
    runner = start_deliverer(concurrency=16, per_host_max=8)
    send(ALICE, NOTE, [host.url(f"/f{n}") for n in range(80)])
    limits = runner.deliverer.limits
    # Halved, for answering three times slower than its fastest.
    wait_until(lambda: getattr(limits._hosts.get(host.host), "ceiling", None), timeout=10)
    send(ALICE, {"type": "Create", "to": "friend"}, [host.url("/dm")])
    start = time.monotonic()
    wait_until(lambda: "/dm" in host.paths(), timeout=10)
    took = time.monotonic() - start
    runner.stop()
    assert took < 0.5, f"the direct message waited {took:.2f} s behind the fan-out's attempts"
