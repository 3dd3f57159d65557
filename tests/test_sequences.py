"""Sequences (ordering keys) when one in their middle leaves: who waits on whom then."""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from django.db import connection, connections, transaction
from django.utils import timezone

from django_federation_delivery import controls, send_batch, store
from django_federation_delivery.models import Batch, Delivery, Status

from .conftest import Inbox, Received, RunningDeliverer, wait_until
from .keys import ALICE

A = "https://a.example/inbox"


def settlement(claimed: Any, outcome: str) -> store.Settlement:
    """A claimed delivery's attempt: "delivered" (202), else failed (400)."""
    delivered = outcome == "delivered"
    return store.Settlement(
        claimed=claimed,
        status=Status.DELIVERED if delivered else Status.FAILED,
        attempts=claimed.attempts + 1,
        last_status=202 if delivered else 400,
        attempted_at=timezone.now(),
        ordered=True,
    )


KEY = {"ordering_key": f"{ALICE}/timeline"}


def note(n: int) -> dict[str, Any]:
    return {
        "type": "Create",
        "id": f"{ALICE}/act/{n}",
        "actor": ALICE,
        "object": f"{ALICE}/notes/{n}",
    }


def one(batch: Batch | None) -> Delivery:
    assert batch is not None
    return Delivery.objects.get(batch=batch)


def claim_only(delivery: Delivery) -> Any:
    claimed = store.claim(10, 60, per_host=10)
    assert [c.id for c in claimed] == [delivery.id], [c.id for c in claimed]
    return claimed[0]


@pytest.mark.django_db(transaction=True)
def test_given_up_in_flight_its_next_still_waits_for_the_lease_to_end() -> None:
    """Y, P, X queued in one ordering key to one inbox. Y fails; P is
    claimed (its attempt in flight, lease 60 s); Y is requeued (P, in
    flight, is past ordering, so Y is due beside it). The operator gives P
    up while its attempt is in flight: X must not go before P's lease ends
    (released_due: "after which the row is to go, as one at a time in its
    sequence"). Made to wait on Y instead, X was due once Y was delivered,
    while P's attempt might still be answered: two of one sequence in
    flight together, X possibly ahead of P."""
    y = one(send_batch(ALICE, note(1), [A], KEY))
    (c,) = store.claim(10, 60, per_host=10)
    assert store.settle([settlement(c, "failed")]) == {y.id}
    p = one(send_batch(ALICE, note(2), [A], KEY))
    x = one(send_batch(ALICE, note(3), [A], KEY))
    assert x.after_id == p.id
    claim_only(p)
    assert controls.requeue(Delivery.objects.filter(id=y.id)) == 1
    assert controls.give_up(Delivery.objects.filter(id=p.id)) == 1
    p.refresh_from_db()
    lease_end = p.due_at
    assert lease_end is not None and lease_end > timezone.now()

    cy = claim_only(y)
    assert store.settle([settlement(cy, "delivered")]) == {y.id}

    x.refresh_from_db()
    assert x.after_id is None
    assert x.due_at is not None and x.due_at >= lease_end, (
        f"X due at {x.due_at}, before the end of P's lease {lease_end}"
    )


def lease_of(row: Delivery) -> dt.datetime:
    """The end of the lease of ``row``, given up while its attempt was in
    flight: kept as its due time."""
    row.refresh_from_db()
    assert row.due_at is not None and row.due_at > timezone.now()
    return row.due_at


def due_no_sooner(row: Delivery, lease_end: dt.datetime) -> None:
    row.refresh_from_db()
    assert row.after_id is not None or (row.due_at is not None and row.due_at >= lease_end), (
        f"due at {row.due_at}, before the end of the lease {lease_end} of an attempt in flight"
    )


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("together", [True, False], ids=["together", "one-then-the-other"])
def test_given_up_in_flight_with_its_next_the_third_waits_for_the_lease_to_end(
    together: bool,
) -> None:
    """A, B, C in one ordering key. A's attempt is in flight; the operator
    gives up A and B, together or one after the other. C went at once: one
    step back from it (B) was no lease, and B, released to wait for A's
    lease, kept that only as its due time, which its give-up dropped."""
    a = one(send_batch(ALICE, note(1), [A], KEY))
    b = one(send_batch(ALICE, note(2), [A], KEY))
    c = one(send_batch(ALICE, note(3), [A], KEY))
    claim_only(a)
    if together:
        assert controls.give_up(Delivery.objects.filter(id__in=[a.id, b.id])) == 2
    else:
        assert controls.give_up(Delivery.objects.filter(id=a.id)) == 1
        due_no_sooner(b, lease_of(a))
        assert controls.give_up(Delivery.objects.filter(id=b.id)) == 1
    due_no_sooner(c, lease_of(a))


@pytest.mark.django_db(transaction=True)
def test_released_to_wait_for_a_lease_and_superseded_the_next_still_waits() -> None:
    # A's attempt is in flight when it is given up; B, released to wait for
    # A's lease, is superseded by a Delete of its note: C was due at once.
    a = one(send_batch(ALICE, note(1), [A], KEY))
    b = one(send_batch(ALICE, note(2), [A], KEY))
    c = one(send_batch(ALICE, note(3), [A], KEY))
    claim_only(a)
    assert controls.give_up(Delivery.objects.filter(id=a.id)) == 1
    lease_end = lease_of(a)
    delete = {"type": "Delete", "id": f"{ALICE}/deletes/2", "actor": ALICE}
    send_batch(ALICE, {**delete, "object": f"{ALICE}/notes/2"}, [A])
    b.refresh_from_db()
    assert b.status == Status.SUPERSEDED
    due_no_sooner(c, lease_end)


@pytest.mark.django_db(transaction=True)
def test_released_to_wait_for_a_lease_its_time_outlasts_a_pause_and_resume() -> None:
    # A pause holds B (no due time); the resume made it due now, beside
    # A's attempt, which may still be answered.
    a = one(send_batch(ALICE, note(1), [A], KEY))
    b = one(send_batch(ALICE, note(2), [A], KEY))
    claim_only(a)
    assert controls.give_up(Delivery.objects.filter(id=a.id)) == 1
    lease_end = lease_of(a)
    controls.pause_host("a.example")
    controls.resume_host("a.example")
    due_no_sooner(b, lease_end)


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_the_third_of_a_sequence_reaches_the_inbox_after_the_first_given_up_in_flight(
    inbox: Inbox, start_deliverer: Callable[..., RunningDeliverer]
) -> None:
    """A, B, C in one ordering key to a real inbox, which takes 3 s to
    answer A. While it answers, the operator gives up A and B: C reached the
    inbox before A's answer, against one at a time in the order queued."""
    lock = threading.Lock()
    events: list[str] = []

    def respond(request: Received) -> tuple[int, dict[str, str], bytes]:
        name = request.json()["id"].rsplit("/", 1)[1]
        with lock:
            events.append(f"start {name}")
        if name == "1":
            time.sleep(3)
        with lock:
            events.append(f"end {name}")
        return 202, {}, b""

    inbox.respond = respond
    a, b, c = (one(send_batch(ALICE, note(n), [inbox.url()], KEY)) for n in (1, 2, 3))
    # A 15 s lease: C goes once it ends, 10 s to write an outcome kept.
    runner = start_deliverer(lease=15)
    wait_until(lambda: "start 1" in events)
    assert controls.give_up(Delivery.objects.filter(id__in=[a.id, b.id])) == 2
    wait_until(lambda: Delivery.objects.get(id=c.id).status != Status.PENDING, timeout=40)
    runner.stop()
    with lock:
        seen = list(events)
    assert seen.index("end 1") < seen.index("start 3"), seen
    assert "start 2" not in seen


@pytest.mark.django_db(transaction=True)
def test_an_attempted_ones_next_is_released_alike_on_sqlite_and_postgresql() -> None:
    """e1, e2, e3 in one ordering key. e1 fails, e2 goes and is in flight,
    e3 waits on e2; e1 is requeued (e2, attempted, is past ordering) and
    retries for an hour. e2 is then delivered: "a delivery that was
    attempted waited on nothing, and releases at once" (inherited), so e3
    is due, as it is on PostgreSQL (the settle's own release). On SQLite it
    was made to wait on e1 instead, behind its retries for the hour."""
    e1 = one(send_batch(ALICE, note(1), [A], KEY))
    (c,) = store.claim(10, 60, per_host=10)
    assert store.settle([settlement(c, "failed")]) == {e1.id}
    e2 = one(send_batch(ALICE, note(2), [A], KEY))
    c2 = claim_only(e2)
    e3 = one(send_batch(ALICE, note(3), [A], KEY))
    assert e3.after_id == e2.id
    assert controls.requeue(Delivery.objects.filter(id=e1.id)) == 1
    c1 = claim_only(e1)
    now = timezone.now()
    retry = store.Settlement(
        claimed=c1,
        status=Status.PENDING,
        attempts=c1.attempts + 1,
        due_at=now + dt.timedelta(hours=1),
        last_status=503,
        attempted_at=now,
        retried=True,
        ordered=True,
    )
    assert store.settle([retry]) == {e1.id}

    assert store.settle([settlement(c2, "delivered")]) == {e2.id}

    e3.refresh_from_db()
    assert (e3.after_id, e3.due_at is not None) == (None, True), f"waits on {e3.after_id}"


@pytest.mark.django_db(transaction=True)
def test_a_requeue_while_the_next_one_is_given_up_still_orders_the_sequence() -> None:
    """Y failed; P (never attempted) and X queued after it in the same key,
    X waiting on P. An operator gives P up while another requeues Y. Either
    way round, one after the other, X ends up waiting on Y (give-up first:
    X is released and the requeue's next_in_sequence takes X; requeue first:
    P waits on Y, and X inherits that wait). Run at the same time on
    PostgreSQL, the requeue picks P in its snapshot, waits for its lock, finds
    P settled and re-chains nothing: X and Y are both due, and X can reach
    the inbox before Y."""
    if connection.vendor != "postgresql":
        pytest.skip("SQLite has one writer")
    y = one(send_batch(ALICE, note(1), [A], KEY))
    (c,) = store.claim(10, 60, per_host=10)
    assert store.settle([settlement(c, "failed")]) == {y.id}
    p = one(send_batch(ALICE, note(2), [A], KEY))
    x = one(send_batch(ALICE, note(3), [A], KEY))
    assert (p.after_id, x.after_id) == (None, p.id)

    errors: list[BaseException] = []

    def requeue() -> None:
        try:
            controls.requeue(Delivery.objects.filter(id=y.id))
        except BaseException as exc:  # pragma: no cover
            errors.append(exc)
        finally:
            connections.close_all()

    side = threading.Thread(target=requeue, daemon=True)
    with transaction.atomic():
        assert controls.give_up(Delivery.objects.filter(id=p.id)) == 1
        side.start()
        # It blocks on P's row lock (next_in_sequence); pg_stat_activity
        # cannot be watched from inside this transaction (a snapshot).
        time.sleep(1.0)
        assert side.is_alive(), "the requeue did not wait on the give-up"
    side.join(20)
    assert not side.is_alive() and not errors, errors

    x.refresh_from_db()
    y.refresh_from_db()
    assert y.status == Status.PENDING
    assert x.after_id == y.id, f"X waits on {x.after_id}, due {x.due_at}, beside Y"


@pytest.mark.django_db(transaction=True)
def test_what_a_direct_message_waits_on_in_its_key_is_claimed_as_soon_as_it(settings: Any) -> None:
    """A direct message sent in the key of a fan-out waits there on the
    fan-out's delivery to its inbox, and that one on a low-priority one
    before it: both are taken into the message's lane, and claimed with
    the urgent lanes; the fan-out's other deliveries keep theirs."""
    from django_federation_delivery.models import Lane
    from django_federation_delivery.store import claims

    settings.FEDERATION_DELIVERY = {**settings.FEDERATION_DELIVERY, "PRIORITY_MAX_INBOXES": 1}
    others = [f"https://b{n}.example/inbox" for n in range(5)]
    low = one(send_batch(ALICE, note(0), [A], {**KEY, "low_priority": True}))
    fan_out = send_batch(ALICE, note(1), [*others, A], KEY)
    message = one(send_batch(ALICE, note(2), [A], KEY))
    assert message.lane == Lane.PRIORITY
    lanes = dict(Delivery.objects.filter(batch=fan_out).values_list("inbox", "lane"))
    assert lanes == {**dict.fromkeys(others, Lane.NORMAL), A: Lane.PRIORITY}
    low.refresh_from_db()
    assert low.lane == Lane.PRIORITY
    urgent = store.claim(10, 60, per_host=10, lanes=claims.URGENT)
    assert [c.id for c in urgent] == [low.id]


@pytest.mark.django_db(transaction=True)
def test_a_send_takes_into_its_lane_only_what_waits_later_and_is_pending(settings: Any) -> None:
    """What a send waits on in its key is taken into its lane only from a
    lane claimed after it: a settled delivery keeps its lane, and so does
    one of a sooner lane (a fan-out never slows down a direct message)."""
    from django_federation_delivery.models import Lane

    settings.FEDERATION_DELIVERY = {**settings.FEDERATION_DELIVERY, "PRIORITY_MAX_INBOXES": 1}
    B = "https://b.example/inbox"
    settled = one(send_batch(ALICE, note(0), [A], {**KEY, "low_priority": True}))
    store.settle([settlement(claim_only(settled), "failed")])
    low = one(send_batch(ALICE, note(1), [A], {**KEY, "low_priority": True}))
    normal = send_batch(ALICE, note(2), [A, B], KEY)
    assert normal is not None
    direct = one(send_batch(ALICE, note(3), [A], KEY))
    send_batch(ALICE, note(4), [A, B], KEY)
    lanes = {row.id: row.lane for row in Delivery.objects.filter(inbox=A)}
    normal_to_a = Delivery.objects.get(batch=normal, inbox=A)
    assert lanes[settled.id] == Lane.LOW
    assert lanes[low.id] == Lane.PRIORITY
    assert lanes[normal_to_a.id] == Lane.PRIORITY
    assert lanes[direct.id] == Lane.PRIORITY
    assert Delivery.objects.get(batch=normal, inbox=B).lane == Lane.NORMAL


@pytest.mark.django_db(transaction=True)
def test_a_send_waits_for_no_lock_another_holds_on_what_it_would_take_into_its_lane(
    settings: Any,
) -> None:
    """On PostgreSQL a send holds the last delivery of its sequence; what
    that one waits on may be locked by a settle, which releases it next.
    Waiting for that row to take it into its lane, the send would deadlock
    with the settle: the row is passed, and the send goes on at once."""
    if connection.vendor != "postgresql":
        pytest.skip("SQLite has one writer")
    from django_federation_delivery.models import Lane

    settings.FEDERATION_DELIVERY = {**settings.FEDERATION_DELIVERY, "PRIORITY_MAX_INBOXES": 1}
    first = one(send_batch(ALICE, note(0), [A], {**KEY, "low_priority": True}))
    second = send_batch(ALICE, note(1), [A, "https://b.example/inbox"], KEY)
    locked, release = threading.Event(), threading.Event()
    held_to_the_end: list[bool] = []

    def hold() -> None:
        try:
            with transaction.atomic():
                Delivery.objects.select_for_update().filter(id=first.id).exists()
                locked.set()
                held_to_the_end.append(not release.wait(10))
        finally:
            connections.close_all()

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    assert locked.wait(10)
    try:
        one(send_batch(ALICE, note(2), [A], KEY))
    finally:
        release.set()
        holder.join(15)
    assert held_to_the_end == [False], "the send waited for the row another held"
    first.refresh_from_db()
    # Taken into the normal lane by the second send, and passed by the third.
    assert first.lane == Lane.NORMAL
    assert Delivery.objects.get(batch=second, inbox=A).lane == Lane.PRIORITY


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("level", ["repeatable read", "serializable"])
def test_a_send_in_a_sequence_at_repeatable_read_set_outside_the_settings_is_refused(
    level: str,
) -> None:
    """The queue's database runs REPEATABLE READ by a default the check
    cannot see (``ALTER DATABASE … SET``, a role's, the session's): a send
    with an ordering key there would not wait on another at once, and be
    sent beside it. It is refused, naming the level, and nothing written."""
    from django.core.exceptions import ImproperlyConfigured

    if connection.vendor != "postgresql":
        pytest.skip("SQLite writes one at a time")
    with connection.cursor() as cursor:
        cursor.execute(f"SET default_transaction_isolation = '{level}'")
    try:
        with pytest.raises(ImproperlyConfigured, match=level.upper()), transaction.atomic():
            send_batch(ALICE, note(1), [A], KEY)
        # Without an ordering key a send waits on nothing: it goes.
        assert send_batch(ALICE, note(2), [A]) is not None
    finally:
        with connection.cursor() as cursor:
            cursor.execute("RESET default_transaction_isolation")
    assert Batch.objects.count() == 1 and Delivery.objects.count() == 1


@pytest.fixture
def queue_in_another_schema() -> Any:
    """The alias "queue" pointed at the test database, in a schema of its
    own with a delivery table: a second site's queue beside the first."""
    if connection.vendor != "postgresql":
        pytest.skip("advisory locks are PostgreSQL's")
    with connection.cursor() as cursor:
        cursor.execute("CREATE SCHEMA other_site")
        cursor.execute("CREATE TABLE other_site.federation_delivery_delivery (id bigint)")
    other = connections.settings["queue"]
    kept = {"NAME": other["NAME"], "OPTIONS": dict(other.get("OPTIONS", {}))}
    connections["queue"].close()
    other["NAME"] = connection.settings_dict["NAME"]
    other["OPTIONS"] = {**kept["OPTIONS"], "options": "-c search_path=other_site"}
    try:
        yield
    finally:
        connections["queue"].close()
        other.update(kept)
        with connection.cursor() as cursor:
            cursor.execute("DROP SCHEMA other_site CASCADE")


@pytest.mark.django_db(transaction=True, databases=["default", "queue"])
def test_two_queues_in_two_schemas_of_one_database_hold_their_locks_apart(
    queue_in_another_schema: None,
) -> None:
    """Two sites keep their queues in two schemas of one database (each its
    search_path). An advisory lock is the database's: one site's round held
    the other's off ("another round is running"), and its sends in a key
    waited on the other's in the same key and inbox. Each queue's are its own."""
    from django_federation_delivery.contrib.rounds import round_lock
    from django_federation_delivery.store.sequences import lock_sequences

    with round_lock("default") as first, round_lock("queue") as second:
        assert first and second
    with round_lock("default") as first, round_lock("default") as again:
        assert first and not again
    with transaction.atomic():
        lock_sequences("key", [A], "default")
        with transaction.atomic(using="queue"):
            with connections["queue"].cursor() as cursor:
                cursor.execute("SET LOCAL lock_timeout = '2s'")
            lock_sequences("key", [A], "queue")


@contextlib.contextmanager
def view_holding_the_next_event(
    settings: Any,
    inboxes: Callable[..., Inbox],
    start_deliverer: Callable[..., RunningDeliverer],
) -> Iterator[tuple[RunningDeliverer, Inbox]]:
    """A deliverer that has just had an event answered (in 1 s) by a
    destination, and a view that sent the next event in its sequence and
    keeps its transaction open, holding the first event's row, until the
    block ends: the deliverer, and the destination."""
    from django_federation_delivery import send_webhook

    hook = inboxes("127.0.0.2", delay=1.0)
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "WEBHOOKS": {"ops": f"slack+http://127.0.0.2:{hook.port}/services/T1/B1/x1"},
    }
    runner = start_deliverer()
    send_webhook("ops", "order.created", {"n": 1})
    wait_until(lambda: len(hook.received) == 1, timeout=10)  # in flight for 1 s
    sent, release = threading.Event(), threading.Event()

    def view() -> None:
        try:
            with transaction.atomic():
                send_webhook("ops", "order.updated", {"n": 2})
                sent.set()
                release.wait(20)
        finally:
            connections.close_all()

    thread = threading.Thread(target=view)
    thread.start()
    try:
        assert sent.wait(10)
        time.sleep(1.5)  # the first event's answer has come back, its row held
        yield runner, hook
    finally:
        release.set()
        thread.join(30)


@pytest.mark.django_db(transaction=True)
def test_a_view_holding_its_transaction_after_an_ordered_send_stalls_no_other_delivery(
    settings: Any,
    inboxes: Callable[..., Inbox],
    start_deliverer: Callable[..., RunningDeliverer],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A view sends a webhook event while the one before it to the same
    destination is in flight, then keeps its transaction open. The settle of
    the one in flight waited on the row the send locked, in the loop's own
    thread: nothing else was claimed, sent or written, for any host, until
    the view committed (an unrelated activity waited 13.6 s)."""
    from django_federation_delivery import send
    from django_federation_delivery.deliverer import STOPPING_GRACE

    if connection.vendor != "postgresql":
        pytest.skip("SQLite writes one transaction at a time")
    inbox = inboxes("127.0.0.3")
    with view_holding_the_next_event(settings, inboxes, start_deliverer) as (runner, hook):
        started = time.monotonic()
        send(ALICE, {"type": "Create", "id": f"{ALICE}/1", "actor": ALICE}, [inbox.url()])
        wait_until(lambda: len(inbox.received) == 1, timeout=30)
        took = time.monotonic() - started
        # A stop meanwhile waits for the view's transaction no longer than its grace.
        stopping = time.monotonic()
        runner.stop()
        stop_took = time.monotonic() - stopping
    assert took < 5, f"an unrelated activity waited {took:.1f} s for the view's transaction"
    assert stop_took < STOPPING_GRACE + 2, f"the stop took {stop_took:.1f} s"
    assert "another transaction held their rows" in caplog.text
    # Left to its lease; the next deliverer (the lease cut short here) sends
    # the first event again, then the second after it.
    Delivery.objects.filter(status=Status.PENDING, after__isnull=True).update(due_at=timezone.now())
    start_deliverer()
    wait_until(lambda: len(hook.received) == 3, timeout=20)
    wait_until(lambda: not Delivery.objects.exclude(status=Status.DELIVERED).exists())
    bodies = [json.loads(request.body)["text"] for request in hook.received]
    assert [("order.created" in b, "order.updated" in b) for b in bodies] == [
        (True, False),
        (True, False),
        (False, True),
    ], bodies


@pytest.mark.django_db(transaction=True)
def test_an_idle_deliverer_tries_a_row_a_view_holds_again_now_and_then_not_at_each_turn(
    settings: Any,
    inboxes: Callable[..., Inbox],
    start_deliverer: Callable[..., RunningDeliverer],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A webhook event is answered while a view that sent the next one to the
    same destination keeps its transaction open (3 s here). Nothing else is
    to do: the deliverer should try the held outcome again now and then
    (its outbox writes within 0.1 s), not spin. It wrote again at every
    turn, without a pause: 1,843 settles in 2 s, two statements each, a
    core and the database kept busy for as long as the view stayed open."""
    from django_federation_delivery.store import settlements

    if connection.vendor != "postgresql":
        pytest.skip("rows left busy are PostgreSQL's")
    calls: list[float] = []
    real = settlements.settle

    def settle(*args: Any, **kwargs: Any) -> Any:
        calls.append(time.monotonic())
        return real(*args, **kwargs)

    monkeypatch.setattr(settlements, "settle", settle)
    with view_holding_the_next_event(settings, inboxes, start_deliverer):
        since = time.monotonic()
        time.sleep(2)
        during = [at for at in calls if since <= at < since + 2]
    wait_until(lambda: Delivery.objects.filter(status=Status.DELIVERED).count() == 2)
    assert len(during) <= 40, f"{len(during)} settles in 2 s while the view held the row"


@pytest.mark.django_db(transaction=True)
def test_a_fresh_outcome_is_written_soon_while_a_view_holds_another_row(
    settings: Any,
    inboxes: Callable[..., Inbox],
    start_deliverer: Callable[..., RunningDeliverer],
) -> None:
    """A view keeps open its transaction after sending a webhook event whose
    predecessor was just answered (its outcome left held). An unrelated
    activity sent meanwhile is answered 202 at once, yet its row stays
    PENDING (claimed) for up to IDLE_POLL_SECONDS (30 s): the idle deliverer
    sleeps its idle poll with the outbox deferred, never waking when it is
    due again."""
    from django_federation_delivery import send

    if connection.vendor != "postgresql":
        pytest.skip("rows left busy are PostgreSQL's")
    inbox = inboxes("127.0.0.3")
    with view_holding_the_next_event(settings, inboxes, start_deliverer):
        send(ALICE, {"type": "Create", "id": f"{ALICE}/1", "actor": ALICE}, [inbox.url()])
        wait_until(lambda: len(inbox.received) == 1, timeout=10)
        answered = time.monotonic()
        delivered = Delivery.objects.filter(inbox=inbox.url(), status=Status.DELIVERED)
        while not delivered.exists() and time.monotonic() - answered < 8:
            time.sleep(0.1)
        took = time.monotonic() - answered
    assert took < 5, f"the answered activity was written as delivered only after {took:.1f} s"
