"""Slots: CONCURRENCY in all, PER_HOST to one host, and none held by a slow delivery."""

from __future__ import annotations

import time

import pytest

from django_federation_delivery.models import Lane
from django_federation_delivery.slots import Slots
from django_federation_delivery.store import Claimed
from django_federation_delivery.store.claims import BatchInfo
from django_federation_delivery.workers import InFlight


def item(number: int, host: str, lane: str = Lane.NORMAL) -> InFlight:
    claimed = Claimed(
        id=number,
        batch_id=1,
        inbox=f"https://{host}/inbox",
        host=host,
        attempts=0,
        via=(),
        token="t",
        leased_until=time.time() + 300,
    )
    batch = BatchInfo(1, "", b"{}", "", "", None, None, False, False, lane=lane)
    return InFlight(claimed=claimed, batch=batch, kind=None, job=None)  # type: ignore[arg-type]


def slots(concurrency: int = 4, per_host: int = 2) -> Slots:
    return Slots(concurrency=concurrency, per_host=lambda host: per_host, slow_after=2.0)


def admit_all(item: InFlight) -> bool:
    return True


def hosts(items: list[InFlight]) -> list[str]:
    return [i.claimed.host for i in items]


def test_no_more_than_per_host_go_to_one_host_and_the_others_keep_their_place() -> None:
    place = slots(concurrency=10)
    for number, host in enumerate(["a", "a", "a", "b", "a", "c"]):
        place.add(item(number, host))

    handed = place.hand_out(admit_all, slow=0, queued=0, most=10)

    assert hosts(handed) == ["a", "a", "b", "c"]
    assert [i.claimed.id for i in place.ready] == [2, 4]  # in the order claimed
    assert place.saturated_hosts() == ["a"]
    assert not place.sendable(1)

    place.take_back(handed[0])
    assert place.sendable(1)
    assert hosts(place.hand_out(admit_all, slow=0, queued=0, most=10)) == ["a"]


def test_each_host_has_the_limit_it_has_now() -> None:
    limits = {"a": 3, "b": 1}
    place = Slots(concurrency=10, per_host=lambda host: limits[host], slow_after=2.0)
    for number, host in enumerate(["a", "a", "a", "a", "b", "b"]):
        place.add(item(number, host))

    assert hosts(place.hand_out(admit_all, slow=0, queued=0, most=10)) == ["a", "a", "a", "b"]
    assert sorted(place.saturated_hosts()) == ["a", "b"]
    limits["b"] = 2  # it answered well
    assert hosts(place.hand_out(admit_all, slow=0, queued=0, most=10)) == ["b"]
    assert place.saturated_hosts() == ["a", "b"]


def test_concurrency_and_the_workers_queue_bound_what_is_handed_out() -> None:
    place = slots(concurrency=2, per_host=10)
    for number in range(10):
        place.add(item(number, "a"))

    assert len(place.hand_out(admit_all, slow=0, queued=0, most=2)) == 2
    assert len(place.hand_out(admit_all, slow=0, queued=0, most=2)) == 0
    assert len(place.hand_out(admit_all, slow=0, queued=2, most=2)) == 2
    assert len(place.in_flight) == 4


def test_urgent_deliveries_have_as_many_slots_again_of_their_own_within_the_threads() -> None:
    # With every slot held by a fan-out's attempts, a direct message waited
    # for one of them to end.
    place = slots(concurrency=2, per_host=10)
    for number in range(4):
        place.add(item(number, "a"))
    assert len(place.hand_out(admit_all, slow=0, queued=0, most=6)) == 2
    for number in range(4, 8):
        place.add(item(number, f"u{number}", Lane.PRIORITY))
    out = place.hand_out(admit_all, slow=0, queued=0, most=6)
    assert [handed.claimed.id for handed in out] == [4, 5], "two urgent ones, no more"
    assert place.urgent_in_flight == 2
    assert place.hand_out(admit_all, slow=0, queued=0, most=6) == []
    # One ended: its slot is taken by the next urgent one, not by a normal one.
    place.take_back(out[0])
    assert [
        handed.claimed.id for handed in place.hand_out(admit_all, slow=0, queued=0, most=6)
    ] == [6]
    # Never past the threads: four in flight, a fifth at most with most=5.
    place.take_back(place.in_flight[6])
    place.take_back(place.in_flight[5])
    assert len(place.hand_out(admit_all, slow=0, queued=0, most=3)) == 1
    assert len(place.in_flight) == 3


def test_a_slow_delivery_gives_up_its_slot_but_not_past_the_most_threads() -> None:
    place = slots(concurrency=2, per_host=10)
    for number in range(10):
        place.add(item(number, "a"))
    first = place.hand_out(admit_all, slow=0, queued=0, most=3)
    for slow in first:
        slow.started = time.monotonic() - 5  # in flight past SLOW_AFTER_SECONDS

    assert place.slow_count() == 2
    # Two slow ones hold no slot; three threads at most: one more goes.
    assert len(place.hand_out(admit_all, slow=place.slow_count(), queued=0, most=3)) == 1


def test_one_the_breaker_holds_leaves_the_ready_deliveries_without_a_slot() -> None:
    place = slots()
    place.add(item(1, "down"))
    place.add(item(2, "up"))

    handed = place.hand_out(lambda i: i.claimed.host != "down", slow=0, queued=0, most=4)

    assert hosts(handed) == ["up"]
    assert not place.ready
    assert place.saturated_hosts() == []


def test_stopping_releases_what_is_ready_and_what_the_workers_had_not_taken() -> None:
    place = slots()
    for number, host in enumerate(["a", "b", "c"]):
        place.add(item(number, host))
    queued = place.hand_out(admit_all, slow=0, queued=0, most=4)[1:]  # b and c never started
    place.add(item(3, "d"))

    released = place.release(queued)

    assert hosts(released) == ["d", "b", "c"]
    assert hosts(list(place.in_flight.values())) == ["a"]
    assert not place.ready
    assert place.holding() == {0}


def test_a_resting_host_gets_no_slot_and_is_left_out_of_claims_holding_nothing() -> None:
    from django_federation_delivery.limits import REST, HostLimits

    from .test_limits import Clock, answered, known

    clock = Clock()
    limits = known(HostLimits(1, 8, clock=clock), "a", "b")
    place = Slots(concurrency=10, per_host=limits.allowed, slow_after=2.0, resting=limits.resting)
    limits.learn("a", answered(503))  # refused at one: "a" rests
    limits.learn("b", answered(503))
    place.add(item(1, "a"))
    place.add(item(2, "c"))
    assert hosts(place.hand_out(admit_all, slow=0, queued=0, most=10)) == ["c"]
    # "c" has its one in flight; "b" holds nothing, and rests.
    assert sorted(place.saturated_hosts()) == ["a", "b", "c"]
    assert not place.sendable(1)
    clock.now += REST / 4
    # What is due to "b" is claimable again when its rest ends ("a" holds its
    # own delivery already).
    assert place.until_rested() == pytest.approx(REST * 3 / 4)
    clock.now += 1.0
    assert sorted(place.saturated_hosts()) == ["a", "c"], "each at its one, and none rests"
    assert place.until_rested() is None
    assert hosts(place.hand_out(admit_all, slow=0, queued=0, most=10)) == ["a"]


def test_a_more_urgent_lane_is_ready_before_the_rest_and_each_keeps_its_order() -> None:
    # A direct message claimed while a fan-out's deliveries wait for slots
    # goes first: it was put behind them.
    held = slots(concurrency=1)
    for number, lane in enumerate(
        [Lane.NORMAL, Lane.LOW, Lane.NORMAL, Lane.PRIORITY, Lane.WEBHOOK, Lane.PRIORITY, Lane.LOW]
    ):
        held.add(item(number, f"h{number}.example", lane))
    assert [ready.claimed.id for ready in held.ready] == [4, 3, 5, 0, 2, 1, 6]


def test_urgent_deliveries_have_a_hosts_limit_again_unless_it_was_lowered() -> None:
    limits = {"a": 2, "slow": 1}
    place = Slots(concurrency=10, per_host=limits.__getitem__, slow_after=2.0, start=2)
    for number in range(3):
        place.add(item(number, "a"))
        place.add(item(10 + number, "slow"))
    handed = place.hand_out(admit_all, slow=0, queued=0, most=10)
    assert sorted(hosts(handed)) == ["a", "a", "slow"]
    assert sorted(place.saturated_hosts(urgent=True)) == ["slow"]
    # A direct message to each: to "a", at its limit with a fan-out's, it
    # goes beside them; "slow" asked for one at a time, and has it.
    place.add(item(20, "a", Lane.PRIORITY))
    place.add(item(21, "slow", Lane.PRIORITY))
    assert hosts(place.hand_out(admit_all, slow=0, queued=0, most=10)) == ["a"]
    assert place.ready[0].claimed.id == 21


def test_an_urgent_delivery_has_a_thread_free_when_the_others_take_more_than_their_share() -> None:
    """Threads made while the others' attempts were slow take queued ones
    as they end: once as many are busy with the others' as exist, an urgent
    delivery handed out wants a thread more, not one of theirs to end."""
    place = slots(concurrency=4, per_host=20)
    for number in range(8):
        place.add(item(number, f"h{number}"))
    handed = place.hand_out(admit_all, slow=0, queued=4, most=8)
    assert len(handed) == 8
    for each in handed:
        each.started = time.monotonic()  # taken by 8 threads, none slow yet
    place.add(item(99, "friend", Lane.PRIORITY))
    (urgent,) = place.hand_out(admit_all, slow=0, queued=4, most=8)
    assert urgent.urgent
    assert place.threads_wanted() == 9
    assert place.threads_allowed(8) == 9


def test_urgent_deliveries_to_a_host_grown_past_per_host_have_per_host_again() -> None:
    """A host answering well grew to 8 at once under a fan-out (PER_HOST 2,
    PER_HOST_MAX 8). Direct messages to it go beside the fan-out's, PER_HOST
    of them at once: 8 + 2 in flight, not twice its grown limit."""
    place = Slots(concurrency=40, per_host=lambda host: 8, slow_after=2.0, start=2, urgent_most=2)
    for number in range(8):
        place.add(item(number, "big"))
    assert len(place.hand_out(admit_all, slow=0, queued=0, most=40)) == 8
    for number in range(10, 16):
        place.add(item(number, "big", Lane.PRIORITY))
    assert len(place.hand_out(admit_all, slow=0, queued=0, most=40)) == 2
    assert place.saturated_hosts(urgent=True) == ["big"]
    assert place.in_flight_to("big") == 10
