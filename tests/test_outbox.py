from __future__ import annotations

import pytest

from django_federation_delivery import store
from django_federation_delivery.models import Status
from django_federation_delivery.outbox import Outbox


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def settlement(id: int, leased_until: float = 2000.0) -> store.Settlement:
    claimed = store.Claimed(
        id=id,
        batch_id=1,
        inbox=f"https://a.example/{id}",
        host="a.example",
        attempts=0,
        via=(),
        token="t",
        leased_until=leased_until,
    )
    return store.Settlement(claimed=claimed, status=Status.DELIVERED, attempts=1)


def outbox(written: list[list[store.Settlement]], clock: Clock, *, works: bool = True) -> Outbox:
    def write(settlements: list[store.Settlement]) -> bool:
        written.append(settlements)
        return works

    return Outbox(write, size=3, within=0.5, clock=clock, wall_clock=clock)


def test_an_empty_outbox_is_never_due_and_writes_nothing() -> None:
    written: list[list[store.Settlement]] = []
    box = outbox(written, Clock())
    assert not box
    assert not box.due()
    assert box.until_due() == 1.0
    assert box.flush() is False
    assert written == []


def test_it_is_due_once_a_writes_worth_waits() -> None:
    box = outbox([], Clock())
    box.add(settlement(1))
    box.add(settlement(2))
    assert not box.due() and not box.full()
    box.add(settlement(3))
    assert box.due() and box.full()


def test_it_is_due_once_the_first_has_waited_a_moment() -> None:
    clock = Clock()
    box = outbox([], clock)
    box.add(settlement(1))
    clock.now += 0.25
    box.add(settlement(2))
    assert not box.due()
    assert box.until_due() == 0.25
    clock.now += 0.25
    assert box.due()
    assert box.until_due() == 0.0


def test_a_flush_writes_everything_waiting_in_one_write() -> None:
    written: list[list[store.Settlement]] = []
    box = outbox(written, Clock())
    box.add(settlement(1))
    box.add(settlement(2))
    assert box.flush() is True
    assert [[s.claimed.id for s in batch] for batch in written] == [[1, 2]]
    assert len(box) == 0


def test_what_the_database_did_not_take_waits_while_its_lease_holds() -> None:
    clock = Clock(now=1000.0)
    written: list[list[store.Settlement]] = []
    box = outbox(written, clock, works=False)
    box.add(settlement(1, leased_until=999.0))
    box.add(settlement(2, leased_until=1500.0))
    clock.now += 5
    assert box.flush() is False
    assert [s.claimed.id for s in written[0]] == [1, 2]
    assert len(box) == 1, "a lapsed lease is another claim's to take: not written by this one"
    assert not box.due(), "kept as if just added: it waits a moment again"


def test_an_outbox_holds_at_least_one() -> None:
    with pytest.raises(ValueError, match="not 0"):
        Outbox(lambda settlements: True, size=0)
