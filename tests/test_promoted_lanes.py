"""What a delivery waits on in its key, taken into its lane: requeued, behind
a backlog, and at the urgent look."""

from __future__ import annotations

from typing import Any

import pytest

from django_federation_delivery import controls, send_batch, store
from django_federation_delivery.models import Batch, Delivery, Lane, Status
from django_federation_delivery.store import claims

from .conftest import sqlite_steps
from .keys import ALICE
from .test_sequences import KEY, A, note, settlement

B = "https://b.example/inbox"


def one(batch: Batch | None, inbox: str = A) -> Delivery:
    assert batch is not None
    return Delivery.objects.get(batch=batch, inbox=inbox)


@pytest.fixture
def priority_of_one(settings: Any) -> None:
    settings.FEDERATION_DELIVERY = {**settings.FEDERATION_DELIVERY, "PRIORITY_MAX_INBOXES": 1}


@pytest.mark.django_db(transaction=True)
def test_a_requeued_delivery_a_direct_message_now_waits_on_is_claimed_in_its_lane(
    priority_of_one: None,
) -> None:
    """A fan-out's delivery to A failed; the next fan-out's delivery there was
    taken into a direct message's lane as the message waited on it. The
    operator requeues the failed one: the next waits on it again (it takes
    its place), so the message waits on it too, and it is taken into the
    message's lane."""
    first = send_batch(ALICE, note(0), [A, B], KEY)
    rows = {c.inbox: c for c in store.claim(10, 60, per_host=10)}
    store.settle([settlement(rows[A], "failed")])
    second = send_batch(ALICE, note(1), [A, B], KEY)
    message = one(send_batch(ALICE, note(2), [A], KEY))
    assert message.lane == Lane.PRIORITY
    assert one(second).lane == Lane.PRIORITY
    assert controls.requeue(Delivery.objects.filter(id=one(first).id)) == 1
    assert one(second).after_id == one(first).id  # it took its place again
    assert one(first).lane == Lane.PRIORITY, (
        "the message waits on it through the next, which it did not take into its lane"
    )
    urgent = store.claim(10, 60, per_host=10, lanes=claims.URGENT)
    assert [c.id for c in urgent] == [one(first).id]


def _backlog(size: int) -> None:
    """``size`` pending deliveries to A in KEY, each waiting on the one
    before it (a host down for a while), written directly."""
    from django.db.models import F

    first = one(send_batch(ALICE, note(0), [A], KEY))
    batch = Batch.objects.get(id=first.batch_id)
    fields = {
        f.attname: getattr(batch, f.attname)
        for f in Batch._meta.concrete_fields
        if not f.primary_key and f.attname != "idempotency_key"
    }
    batches = Batch.objects.bulk_create([Batch(**fields) for _ in range(size)], batch_size=500)
    row = {
        f.attname: getattr(first, f.attname)
        for f in Delivery._meta.concrete_fields
        if not f.primary_key and f.attname not in ("batch_id", "after_id", "due_at")
    }
    Delivery.objects.bulk_create(
        [Delivery(**row, batch_id=b.id, due_at=None) for b in batches], batch_size=500
    )
    Delivery.objects.filter(inbox=A).exclude(id=first.id).update(after_id=F("id") - 1)
    assert Delivery.objects.filter(inbox=A, after__isnull=True).count() == 1


def _steps_of_one_send(n: int) -> int:
    """SQLite virtual-machine steps (in hundreds) that one ordered send runs."""
    return sqlite_steps(lambda: send_batch(ALICE, note(n), [A], KEY), 100)


@pytest.mark.django_db(transaction=True)
def test_an_ordered_send_costs_the_same_however_long_its_sequences_backlog() -> None:
    """A webhook destination or an inbox down for a while builds a backlog
    in its sequence. An ordered send walked the whole pending chain to take
    it into its lane, even one of the backlog's own lane: 0.3 ms a send, 11
    ms behind 8,000. The walk stops at a row of a lane as soon."""
    from django.db import connection

    if connection.vendor != "sqlite":
        pytest.skip("PostgreSQL reads the lanes as it locks, and walks only for a sooner lane")
    _backlog(5)
    short = _steps_of_one_send(10_001)
    Delivery.objects.all().delete()
    Batch.objects.all().delete()
    _backlog(2_000)
    long = _steps_of_one_send(10_002)
    assert long < 3 * short, f"{long} vs {short} (hundreds of VM steps)"


@pytest.mark.django_db(transaction=True)
def test_a_requeued_fan_out_delivery_nothing_waits_on_goes_back_in_its_batchs_lane(
    priority_of_one: None,
) -> None:
    """A fan-out's delivery to A was taken into a direct message's lane; it
    failed, and the message, released, was delivered. Requeued with the
    fan-out's other failed delivery, nothing waiting on it now, it goes in
    its batch's lane again, not as an urgent one ahead of the other."""
    fan_out = send_batch(ALICE, note(1), [A, B], KEY)
    message = one(send_batch(ALICE, note(2), [A], KEY))
    assert one(fan_out).lane == Lane.PRIORITY
    (urgent,) = store.claim(10, 60, per_host=10, lanes=claims.URGENT)
    assert urgent.id == one(fan_out).id
    store.settle([settlement(urgent, "failed")])
    rows = {c.id: c for c in store.claim(10, 60, per_host=10)}
    store.settle(
        [settlement(rows[message.id], "delivered"), settlement(rows[one(fan_out, B).id], "failed")]
    )
    assert controls.requeue(Delivery.objects.filter(batch=fan_out)) == 2
    lanes = dict(Delivery.objects.filter(batch=fan_out).values_list("inbox", "lane"))
    assert lanes == {A: Lane.NORMAL, B: Lane.NORMAL}, lanes


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_what_a_direct_message_waits_on_is_claimed_at_the_next_urgent_look(
    inboxes: Any, start_deliverer: Any, settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A deliverer busy with a fan-out (its urgent claims finding nothing, a
    slow host's direct messages left out at its limit) looks every 0.1 s
    only for urgent work that came due since its last empty urgent claim,
    and for all of it a pass later. A direct message is sent from a web
    process (no wake) in the fan-out's key to an inbox whose fan-out
    delivery is due but not yet claimed: that delivery, taken into the
    priority lane, is made due as it is, and claimed at the next look, not
    a pass later (here made 3 s)."""
    import time

    from django_federation_delivery import intake as intake_module
    from django_federation_delivery.store import wakes

    from .conftest import wait_until

    settings.FEDERATION_DELIVERY = {**settings.FEDERATION_DELIVERY, "PRIORITY_MAX_INBOXES": 1}
    slow = inboxes("127.0.0.41", delay=8.0)
    fast = inboxes("127.0.0.42")
    fan = [inboxes(f"127.0.0.{50 + n}", delay=8.0) for n in range(30)]
    for n in range(3):
        send_batch(ALICE, {"type": "Create", "to": f"s{n}"}, [slow.url(f"/s{n}")])
    # The fan-out's delivery to the fast host last: claimed last.
    send_batch(
        ALICE,
        note(1),
        [*(sink.url(f"/u{n}") for sink in fan for n in range(2)), fast.url("/f")],
        KEY,
    )
    empty_urgent: list[float] = []
    claimed_at: list[float] = []
    real_claim = claims.claim

    def claim(*args: Any, **kwargs: Any) -> Any:
        got = real_claim(*args, **kwargs)
        if kwargs.get("lanes") == claims.URGENT and got == []:
            empty_urgent.append(time.monotonic())
        if any(row.inbox.endswith("/f") for row in got or []):
            claimed_at.append(time.monotonic())
        return got

    monkeypatch.setattr(claims, "claim", claim)
    monkeypatch.setattr(intake_module, "HOLD_PASS_SECONDS", 3.0)
    monkeypatch.setattr(wakes, "notify_local", lambda: None)  # another process
    runner = start_deliverer(concurrency=4, claim_size=8)
    wait_until(lambda: len(slow.received) == 2 and bool(empty_urgent), timeout=20)
    time.sleep(0.3)
    assert not claimed_at, "the fan-out's delivery to the fast host was claimed already"
    sent = time.monotonic()
    send_batch(ALICE, note(2), [fast.url("/f")], KEY)
    waited_on = Delivery.objects.filter(inbox=fast.url("/f")).order_by("id").first()
    assert waited_on is not None and waited_on.lane == Lane.PRIORITY
    wait_until(lambda: bool(claimed_at), timeout=15)
    took = claimed_at[0] - sent
    runner.stop()
    assert took < 1.0, f"claimed {took:.2f} s after the direct message that waits on it"


@pytest.mark.django_db(transaction=True)
def test_a_requeued_direct_message_takes_what_it_waits_on_again_into_its_lane(
    priority_of_one: None,
) -> None:
    """A fan-out's delivery to A and a direct message to A after it, in one
    ordering key, both failed. Requeued one after the other (the fan-out's
    failed deliveries, then the message), the message waits on the fan-out's
    delivery again, which is taken into the message's lane, as a send of the
    message would take it: not left behind the fan-out's backlog."""
    fan_out = send_batch(ALICE, note(1), [A, B], KEY)
    rows = {c.inbox: c for c in store.claim(10, 60, per_host=10)}
    store.settle([settlement(rows[A], "failed"), settlement(rows[B], "delivered")])
    message = one(send_batch(ALICE, note(2), [A], KEY))
    assert message.lane == Lane.PRIORITY and message.after_id is None
    (claimed,) = store.claim(10, 60, per_host=10)
    store.settle([settlement(claimed, "failed")])
    assert controls.requeue(Delivery.objects.filter(batch=fan_out, status=Status.FAILED)) == 1
    assert one(fan_out).lane == Lane.NORMAL
    assert controls.requeue(Delivery.objects.filter(id=message.id)) == 1
    assert one(Batch.objects.get(id=message.batch_id)).after_id == one(fan_out).id
    assert one(fan_out).lane == Lane.PRIORITY
