"""An operator's controls, where they meet the deliverers working at the same time."""

from __future__ import annotations

import base64
import datetime as dt
import re
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from django.db import OperationalError, connection, connections, transaction
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from django_federation_delivery import controls, send, send_batch, send_webhook, signals, store
from django_federation_delivery.models import Batch, Breaker, Delivery, Host, Status
from django_federation_delivery.outbox import Outbox
from django_federation_delivery.store import settlements

from .conftest import Inbox, Overlap, RunningDeliverer, Unprintable, away_at, wait_until
from .keys import ALICE
from .lockholder import Holder

pytestmark = pytest.mark.django_db

NOTE = {"type": "Note"}
HOUR = dt.timedelta(hours=1)


def test_give_up_tells_only_of_what_it_changed_not_of_what_was_settled_meanwhile(
    monkeypatch: pytest.MonkeyPatch, failures: list[Any], django_capture_on_commit_callbacks: Any
) -> None:
    batch = send(ALICE, NOTE, [f"https://a.example/u{n}" for n in range(3)])
    assert batch is not None
    first, *others = batch.deliveries.order_by("id")
    give_up_rows = settlements.give_up_rows

    def delivered_meanwhile(ids: list[int], *args: Any, **kwargs: Any) -> list[int]:
        # A deliverer's outcome lands between the operator's look at what is
        # pending and the write.
        Delivery.objects.filter(pk=first.pk).update(
            status=Status.DELIVERED, due_at=None, lease_token=None, settled_at=timezone.now()
        )
        return give_up_rows(ids, *args, **kwargs)

    monkeypatch.setattr(settlements, "give_up_rows", delivered_meanwhile)
    with django_capture_on_commit_callbacks(execute=True):
        assert controls.give_up(Delivery.objects.filter(batch=batch)) == 2
        assert failures == [], "told once committed"
    assert sorted(f.delivery_id for f in failures) == [row.pk for row in others]
    assert {(f.sender, f.error) for f in failures} == {(ALICE, "given up by an operator")}
    first.refresh_from_db()
    assert first.status == Status.DELIVERED and first.last_error == ""


def test_give_up_of_a_sliced_or_combined_queryset_gives_up_its_pending_rows() -> None:
    # "The oldest two of a host", as requeue takes it: give_up raised
    # Django's "Cannot filter a query once a slice has been taken."
    batch = send(ALICE, NOTE, [f"https://a.example/u{n}" for n in range(4)])
    assert batch is not None
    rows = list(batch.deliveries.order_by("id"))
    Delivery.objects.filter(pk=rows[0].pk).update(
        status=Status.DELIVERED, due_at=None, settled_at=timezone.now()
    )
    assert controls.give_up(Delivery.objects.filter(batch=batch).order_by("id")[:3]) == 2
    statuses = [Delivery.objects.get(pk=row.pk).status for row in rows]
    assert statuses == [Status.DELIVERED, Status.FAILED, Status.FAILED, Status.PENDING]
    # A union takes no filter either.
    last = Delivery.objects.filter(pk=rows[3].pk)
    assert controls.give_up(last.union(Delivery.objects.filter(pk=rows[1].pk))) == 1
    assert Delivery.objects.get(pk=rows[3].pk).status == Status.FAILED


def test_a_host_is_read_in_any_form_as_a_send_reads_an_inboxs(
    failures: list[Any], django_capture_on_commit_callbacks: Any
) -> None:
    send(ALICE, NOTE, ["https://bücher.example/inbox", "https://b.example/inbox"])
    assert controls.pause_host("Bücher.Example.") == 1
    # A URL on a host pauses the host, and its query (a token) is not kept.
    assert controls.pause_host("https://b.example/hook?token=s3cret") == 1
    assert set(Host.objects.values_list("name", flat=True)) == {
        "xn--bcher-kva.example",
        "b.example",
    }
    assert controls.resume_host("https://BÜCHER.example/") == 1
    with django_capture_on_commit_callbacks(execute=True):
        assert controls.give_up_host("b.example.") == 1
    assert [failure.inbox for failure in failures] == ["https://b.example/inbox"]


def test_a_host_on_another_port_is_named_with_it(failures: list[Any]) -> None:
    send(ALICE, NOTE, ["https://c.example/inbox", "https://C.example:8443/inbox"])
    assert controls.pause_host("c.example:8443") == 1
    assert controls.resume_host("https://c.example:8443/users/bob") == 1
    assert controls.pause_host("https://c.example:443/") == 1, "the default port is the host's"
    assert set(Host.objects.values_list("name", flat=True)) == {"c.example:8443", "c.example"}


@pytest.mark.parametrize(
    "bad", ["", "https:///inbox?token=s3cret", "a\x1b[2Jb", "a\x00b", "x" * 300, Unprintable()]
)
@pytest.mark.parametrize("control", ["pause_host", "resume_host", "give_up_host"])
def test_a_host_that_names_none_is_refused_naming_it_with_nothing_changed(
    control: str, bad: Any
) -> None:
    send(ALICE, NOTE, ["https://a.example/inbox"])
    with pytest.raises(ValueError, match=f"{control} needs a host name") as raised:
        getattr(controls, control)(bad)
    assert "s3cret" not in str(raised.value) and "\x1b" not in str(raised.value)
    assert not Host.objects.exists()
    assert Delivery.objects.get().status == Status.PENDING


def test_a_breaker_is_reset_by_its_host_or_its_inbox_in_any_spelling() -> None:
    from .operators import open_breaker

    open_breaker("xn--bcher-kva.example")
    open_breaker("https://b.example/users/bob/inbox")
    assert controls.reset_breaker("Bücher.Example.") == 1
    # A per-inbox breaker is keyed by the inbox without its query (a token).
    assert controls.reset_breaker("HTTPS://B.example:443/users/bob/inbox?token=s3cret") == 1
    assert not Breaker.objects.exists()
    assert controls.reset_breaker("c.example") == 0
    # A URL on a host whose breaker is the host's (the default scope).
    open_breaker("example.com:8443")
    assert controls.reset_breaker("https://example.com:8443/users/a/inbox") == 1
    assert not Breaker.objects.exists()


@pytest.mark.parametrize(
    "bad", ["", "https:///inbox?token=s3cret", "ftp://a.example/x", "a\x1bb", Unprintable()]
)
def test_a_breaker_named_by_neither_is_refused_naming_it(bad: Any) -> None:
    from .operators import open_breaker

    open_breaker("a.example")
    with pytest.raises(ValueError, match="reset_breaker needs a host name") as raised:
        controls.reset_breaker(bad)
    assert "s3cret" not in str(raised.value) and "\x1b" not in str(raised.value)
    assert Breaker.objects.count() == 1


@pytest.mark.parametrize(
    ("reason", "said"),
    [
        (None, "reason must be a string, not None"),
        (404, "reason must be a string, not 404"),
        ("r" * 301, "reason is longer than 300 characters"),
        ("gone\x00", "reason must not contain NUL characters"),
        ("gone\ud800", "reason holds text that is not valid Unicode"),
    ],
)
def test_a_reason_no_row_can_keep_is_refused_with_nothing_given_up(
    reason: Any, said: str, failures: list[Any]
) -> None:
    send(ALICE, NOTE, ["https://a.example/inbox"])
    with pytest.raises(ValueError, match=said):
        controls.give_up_host("a.example", reason)
    with pytest.raises(ValueError, match=said):
        controls.give_up(Delivery.objects.all(), reason)
    assert Delivery.objects.get().status == Status.PENDING
    assert failures == []


# A queue kept in another database than "default": each control acts on the
# rows' own database, never on the rows with the same ids in "default".

BOB = "https://social.example/users/bob"


def kept(using: str) -> list[tuple[str, str]]:
    return list(Delivery.objects.using(using).order_by("id").values_list("host", "status"))


@pytest.mark.django_db(databases=["default", "queue"])
def test_giving_up_deliveries_of_another_database_leaves_the_default_ones_alone(
    failures: list[Any], django_capture_on_commit_callbacks: Any
) -> None:
    send_batch(ALICE, NOTE, ["https://a.example/inbox"], using="queue")
    send(BOB, NOTE, ["https://b.example/inbox"])
    with django_capture_on_commit_callbacks(using="queue", execute=True):
        assert controls.give_up(Delivery.objects.using("queue").all()) == 1
    assert kept("queue") == [("a.example", Status.FAILED)]
    assert kept("default") == [("b.example", Status.PENDING)]
    # Told with what its own batch says, not a batch of "default"'s.
    assert [(f.inbox, f.sender) for f in failures] == [("https://a.example/inbox", ALICE)]
    assert Batch.objects.using("queue").get().remaining == 0
    assert Batch.objects.get().remaining == 1


@pytest.mark.django_db(databases=["default", "queue"])
def test_requeueing_deliveries_of_another_database_requeues_those() -> None:
    send_batch(ALICE, NOTE, ["https://a.example/inbox"], using="queue")
    send(BOB, NOTE, ["https://b.example/inbox"])
    controls.give_up(Delivery.objects.all())
    controls.give_up(Delivery.objects.using("queue").all())
    assert controls.requeue(Delivery.objects.using("queue").all()) == 1
    assert kept("queue") == [("a.example", Status.PENDING)]
    assert kept("default") == [("b.example", Status.FAILED)]
    # Rows rather than a queryset: each in the database it was read from.
    controls.give_up(Delivery.objects.using("queue").all())
    assert controls.requeue(list(Delivery.objects.using("queue").all())) == 1
    assert kept("queue") == [("a.example", Status.PENDING)]
    assert kept("default") == [("b.example", Status.FAILED)]


@pytest.mark.django_db(databases=["default", "queue"])
def test_the_host_controls_act_on_the_database_named(failures: list[Any]) -> None:
    for using in ("default", "queue"):
        send_batch(ALICE, NOTE, ["https://a.example/inbox"], using=using)
        Breaker.objects.using(using).create(key="a.example", failures=10)
    assert controls.pause_host("a.example", using="queue") == 1
    assert Host.objects.using("queue").get().paused_at is not None
    assert not Host.objects.exists()
    assert controls.resume_host("a.example", using="queue") == 1
    assert Host.objects.using("queue").get().paused_at is None
    assert controls.reset_breaker("https://a.example/", using="queue") == 1
    assert not Breaker.objects.using("queue").exists()
    assert Breaker.objects.exists()
    assert controls.give_up_host("a.example", using="queue") == 1
    assert kept("queue") == [("a.example", Status.FAILED)]
    assert kept("default") == [("a.example", Status.PENDING)]
    with pytest.raises(ValueError, match="no database named 'elsewhere' in DATABASES"):
        controls.pause_host("a.example", using="elsewhere")


def test_giving_up_and_requeueing_many_rows_runs_a_bounded_number_of_statements() -> None:
    # One-inbox sends (a reply, a follow, a direct message): a batch a row.
    for n in range(600):
        send(ALICE, NOTE, [f"https://h{n}.example/inbox"])
    with CaptureQueriesContext(connection) as queries:
        assert controls.give_up(Delivery.objects.all()) == 600
    assert len(queries) < 40, f"{len(queries)} statements to give up 600 rows"
    assert Batch.objects.filter(remaining=0, finished_at__isnull=False).count() == 600
    with CaptureQueriesContext(connection) as queries:
        assert controls.requeue(Delivery.objects.all()) == 600
    assert len(queries) < 40, f"{len(queries)} statements to requeue 600 rows"
    assert Batch.objects.filter(remaining=1, finished_at=None).count() == 600


def test_requeue_leaves_alone_what_its_batch_deadline_ended() -> None:
    late = send_batch(ALICE, NOTE, ["https://a.example/inbox"], {"deadline": HOUR})
    send_batch(ALICE, NOTE, ["https://b.example/inbox"], {"deadline": HOUR})
    assert controls.give_up(Delivery.objects.all()) == 2
    Batch.objects.filter(pk=late.pk).update(deadline=timezone.now() - dt.timedelta(minutes=1))
    # Requeued, it was failed again at its claim, unsent, and told as failed
    # at its deadline once more.
    assert controls.requeue(Delivery.objects.all()) == 1
    assert kept("default") == [("a.example", Status.FAILED), ("b.example", Status.PENDING)]
    assert Batch.objects.get(pk=late.pk).finished_at is not None


@pytest.mark.django_db(transaction=True)
def test_what_waits_past_its_deadline_is_told_once_though_the_database_went_away(
    failures: list[Any],
) -> None:
    # An Update waits behind its Create past its batch's deadline. The
    # give-up committed, then read its batches to tell it: that read
    # failing lost delivery_failed and batch_finished for good, as the next
    # look found nothing pending.
    finished: list[int] = []

    def done(batch: Batch, **kwargs: Any) -> None:
        finished.append(batch.pk)

    key = {"ordering_key": f"{ALICE}/timeline"}
    send_batch(ALICE, NOTE, ["https://a.example/inbox"], key)
    update = send_batch(ALICE, NOTE, ["https://a.example/inbox"], {**key, "deadline": HOUR})
    now = timezone.now()
    Batch.objects.filter(pk=update.pk).update(deadline=now - dt.timedelta(seconds=1))
    since = now - dt.timedelta(minutes=1)
    signals.batch_finished.connect(done, weak=False)
    try:
        with away_at('"event_type" FROM') as failed, pytest.raises(OperationalError):
            controls.give_up_overdue(since=since, now=now)
        assert failed, "the database went away as the give-up was told"
        assert (failures, finished) == ([], [])
        assert controls.give_up_overdue(since=since, now=now) == 1
    finally:
        signals.batch_finished.disconnect(done)
    waiting = Delivery.objects.get(batch=update)
    assert waiting.status == Status.FAILED
    assert [(f.delivery_id, f.deadline) for f in failures] == [(waiting.pk, True)]
    assert finished == [update.pk]


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_delivery_given_up_in_flight_then_requeued_is_never_sent_twice_at_once(
    inboxes: Callable[..., Inbox], start_deliverer: Callable[..., RunningDeliverer]
) -> None:
    overlap = Overlap(202, 4.0)
    slow = inboxes(respond=overlap)
    batch = send(ALICE, NOTE, [slow.url("/a")])
    assert batch is not None
    # Two deliverers (run_deliverer --processes 2, or two machines), one
    # request at a time to a host each: the one with the attempt in flight
    # claims nothing more of the host, the other claims whatever is due.
    runners = [start_deliverer(per_host=1), start_deliverer(per_host=1)]
    wait_until(lambda: len(slow.received) == 1, timeout=20)
    # The batch's "Cancel pending", then its "Requeue failed", while the
    # inbox is still answering the first attempt.
    assert controls.give_up(Delivery.objects.filter(batch=batch), "cancelled") == 1
    assert controls.requeue(Delivery.objects.filter(batch=batch)) == 1
    requeued = Delivery.objects.get(batch=batch)
    assert requeued.status == Status.PENDING and requeued.lease_token is None
    # Due when the lease of the attempt in flight ends, not now.
    assert requeued.due_at is not None
    assert requeued.due_at > timezone.now() + dt.timedelta(seconds=60)
    started = time.monotonic()
    while time.monotonic() - started < 3.0 and len(slow.received) < 2:
        time.sleep(0.05)
    for runner in runners:
        runner.stop()
    assert overlap.most == 1, f"{len(slow.received)} requests, {overlap.most} at once"
    # The first attempt's outcome, fenced out, left the requeued row as it was.
    assert Delivery.objects.get(batch=batch).status == Status.PENDING


def given_up_in_flight() -> dt.datetime:
    """A delivery sent, claimed, and given up while its attempt is in flight
    for five minutes more: the end of that attempt's lease."""
    assert send(ALICE, NOTE, ["https://a.example/inbox"]) is not None
    lease_end = timezone.now() + dt.timedelta(minutes=5)
    Delivery.objects.update(lease_token="t", due_at=lease_end, attempts=1)
    assert controls.give_up(Delivery.objects.all()) == 1
    return lease_end


def test_what_is_requeued_to_a_paused_host_is_held_until_it_is_resumed() -> None:
    batch = send(ALICE, NOTE, ["https://a.example/inbox", "https://b.example/inbox"])
    assert batch is not None
    assert controls.give_up(Delivery.objects.filter(batch=batch)) == 2
    controls.pause_host("a.example")
    # The operator requeues what failed while the host is paused: to go once
    # it is resumed, not claimed and put back every few seconds meanwhile.
    assert controls.requeue(Delivery.objects.filter(batch=batch)) == 2
    rows = dict(Delivery.objects.values_list("host", "due_at"))
    assert rows["a.example"] is None, "held: no due time"
    assert rows["b.example"] is not None, "the other host's is due"
    before = timezone.now()
    assert controls.resume_host("a.example") == 1
    due = Delivery.objects.get(host="a.example").due_at
    assert due is not None and before <= due <= timezone.now()


def test_one_given_up_in_flight_requeued_while_paused_is_due_no_sooner_than_its_lease() -> None:
    # Claimed, its attempt in flight for a few minutes more, and given up.
    lease_end = given_up_in_flight()
    controls.pause_host("a.example")
    assert controls.requeue(Delivery.objects.all()) == 1
    assert Delivery.objects.get().due_at is None, "held for its paused host"
    # Resumed while that attempt may still be answered: not sent beside it.
    assert controls.resume_host("a.example") == 1
    row = Delivery.objects.get()
    assert row.due_at == lease_end
    assert row.not_before is None


def test_one_requeued_while_paused_waiting_in_its_sequence_keeps_its_lease_end() -> None:
    first = send_batch(ALICE, NOTE, ["https://a.example/inbox"], {"ordering_key": "k"})
    second = send_batch(ALICE, NOTE, ["https://a.example/inbox"], {"ordering_key": "k"})
    assert first is not None and second is not None
    lease_end = timezone.now() + dt.timedelta(minutes=5)
    # The first was retried meanwhile (requeued, say) while the second was
    # in flight; the second is given up in flight.
    Delivery.objects.filter(batch=second).update(
        after=None, lease_token="t", due_at=lease_end, attempts=1
    )
    assert controls.give_up(Delivery.objects.filter(batch=second)) == 1
    controls.pause_host("a.example")
    assert controls.requeue(Delivery.objects.filter(batch=second)) == 1
    row = Delivery.objects.get(batch=second)
    # It waits its turn behind the first, still pending, and keeps the time
    # its attempt in flight may still be answered until.
    assert row.after_id == Delivery.objects.get(batch=first).id
    assert (row.due_at, row.not_before) == (None, lease_end)


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_webhook_event_given_up_in_flight_holds_the_next_until_its_attempt_ends(
    inboxes: Callable[..., Inbox],
    start_deliverer: Callable[..., RunningDeliverer],
    settings: Any,
) -> None:
    overlap = Overlap(200, 3.0)
    receiver = inboxes(respond=overlap)
    secret = "whsec_" + base64.b64encode(b"k" * 32).decode()
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "WEBHOOKS": {"ops": f"http://127.0.0.1:{receiver.port}/hook?secret={secret}"},
    }
    first = send_webhook("ops", "alert.raised", {"n": 0})
    assert send_webhook("ops", "alert.raised", {"n": 1}) is not None
    runner = start_deliverer()
    wait_until(lambda: len(receiver.received) == 1, timeout=20)
    # The operator cancels the first event while the receiver is still
    # answering it. The next was made due at once, and sent beside it: two
    # at once to a destination that takes its events one at a time.
    assert controls.give_up(Delivery.objects.filter(batch=first)) == 1
    started = time.monotonic()
    while time.monotonic() - started < 2.5 and len(receiver.received) < 2:
        time.sleep(0.05)
    runner.stop()
    assert overlap.most == 1, f"{len(receiver.received)} events, {overlap.most} at once"


def test_one_given_up_in_flight_requeued_then_paused_is_due_no_sooner_than_its_lease() -> None:
    # Claimed, its attempt in flight for a few minutes more, given up and
    # requeued: due when that lease ends, as requeue promises.
    lease_end = given_up_in_flight()
    assert controls.requeue(Delivery.objects.all()) == 1
    assert Delivery.objects.get().due_at == lease_end
    # The operator then pauses the host, and resumes it a minute later,
    # while that attempt may still be answered.
    controls.pause_host("a.example")
    assert controls.resume_host("a.example") == 1
    due = Delivery.objects.get().due_at
    assert due is not None and due >= lease_end, (
        f"due at {due}, {lease_end - due} before the end of the lease of the attempt "
        "still in flight: sent beside it"
    )


def test_one_given_up_in_flight_requeued_given_up_and_requeued_again_waits_for_its_lease() -> None:
    """Given up while in flight, requeued (due when that lease ends), given
    up again, requeued again: the second give-up forgot the lease's end (a
    row no claim holds kept one only while it had no due time), and the
    second requeue made it due at once, claimed and sent beside the
    attempt still in flight."""
    lease_end = given_up_in_flight()
    assert controls.requeue(Delivery.objects.all()) == 1
    assert controls.give_up(Delivery.objects.all()) == 1
    assert controls.requeue(Delivery.objects.all()) == 1
    due = Delivery.objects.get().due_at
    assert due is not None and due >= lease_end, f"due at {due}, before {lease_end}"
    assert store.claim(10, lease=300) == [], "claimed again beside the attempt in flight"


@pytest.mark.django_db(transaction=True)
def test_a_host_resumed_while_a_requeue_to_it_commits_leaves_nothing_held_for_ever(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if connection.vendor != "postgresql":
        pytest.skip("SQLite's write lock puts the resume after the requeue's commit")
    batch = send(ALICE, NOTE, ["https://a.example/inbox"])
    assert batch is not None
    assert controls.give_up(Delivery.objects.all()) == 1
    controls.pause_host("a.example")
    resumed: list[int] = []
    count_up = settlements.count_up

    def resume() -> None:
        try:
            resumed.append(controls.resume_host("a.example"))
        finally:
            connection.close()  # this thread's own

    thread = threading.Thread(target=resume)

    def operator_resumes_meanwhile(*args: Any, **kwargs: Any) -> Any:
        # Another operator resumes the host while the requeue's transaction,
        # its rows written held, is still to commit (given a moment: it may
        # wait for that commit instead).
        thread.start()
        thread.join(1.5)
        return count_up(*args, **kwargs)

    monkeypatch.setattr(settlements, "count_up", operator_resumes_meanwhile)
    assert controls.requeue(Delivery.objects.all()) == 1
    thread.join(10)
    assert len(resumed) == 1
    assert not Host.objects.filter(paused_at__isnull=False).exists(), "the host is resumed"
    row = Delivery.objects.get()
    assert row.status == Status.PENDING
    assert row.due_at is not None, (
        "pending to a host that is not paused, with no due time and waiting on nothing: "
        "no claim, resume or sweep will ever make it due"
    )


@pytest.mark.django_db(transaction=True)
@pytest.mark.skipif(connection.vendor != "sqlite", reason="SQLite's one write lock")
def test_a_resume_while_another_process_writes_waits_its_turn() -> None:
    controls.pause_host("a.example")
    send(ALICE, NOTE, ["https://a.example/inbox"])
    holder = Holder(connection.settings_dict["NAME"], hold=lambda: 0.3, gap=lambda: 0.05)

    def between(execute: Any, sql: str, *args: Any) -> Any:
        result = execute(sql, *args)
        if not holder.is_alive() and not sql.startswith(("BEGIN", "SAVEPOINT")):
            # A web process's send takes the write lock right after the
            # resume's first statement, for a moment.
            holder.start()
            holder.holding.wait(0.5)
        return result

    try:
        with connection.execute_wrapper(between):
            # Read first, the resume's own write would then fail at once with
            # "database is locked", not wait its turn.
            assert controls.resume_host("a.example") == 1
    finally:
        holder.stopping.set()
        holder.join(5)
    assert holder.committed >= 1 and holder.error is None
    assert Delivery.objects.get().due_at is not None


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_the_deadline_sweep_leaves_a_row_claimed_after_its_read_to_its_claimer(
    inbox: Inbox,
    start_deliverer: Callable[..., RunningDeliverer],
    failures: list[Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Two deliverers (run_deliverer --processes 2, or a round beside one).
    # A's sweep (Upkeep.give_up_overdue, every 5 s) reads the pending rows
    # no one holds of the batches whose deadline passed; B's claim takes one
    # of them (a retry that came due after the deadline) right after that
    # read. A's write must leave it to B, which fails it unsent and tells
    # it: once, not by both.
    batch = send_batch(ALICE, NOTE, [inbox.url()], {"deadline": dt.timedelta(seconds=1)})
    assert batch is not None
    # A retry due a moment after the batch's deadline.
    Delivery.objects.update(due_at=timezone.now() + dt.timedelta(seconds=1.6))
    gate = threading.Event()
    flush = Outbox.flush

    def held_flush(self: Outbox) -> bool:
        # B writes what came of its claim once A's write is done (B's outbox
        # is written at most 0.1 s after: the race is A's write landing first).
        gate.wait(5)
        return flush(self)

    monkeypatch.setattr(Outbox, "flush", held_flush)
    runner = start_deliverer()  # B: its first sweep finds no deadline passed yet
    time.sleep(1.2)  # the deadline has passed; the row is not due yet
    give_up_rows = settlements.give_up_rows

    def racing(ids: Any, reason: str, **options: Any) -> Any:
        # Between A's read and A's write: B claims the row as it comes due.
        wait_until(lambda: Delivery.objects.filter(lease_token__isnull=False).exists(), timeout=8)
        try:
            return give_up_rows(ids, reason, **options)
        finally:
            gate.set()

    monkeypatch.setattr(settlements, "give_up_rows", racing)
    try:
        swept = controls.give_up_overdue(since=timezone.now() - dt.timedelta(hours=1))
    finally:
        gate.set()
    wait_until(lambda: Delivery.objects.get().status != Status.PENDING, timeout=8)
    time.sleep(0.5)
    runner.stop()
    row = Delivery.objects.get()
    told = [f.deadline for f in failures if f.delivery_id == row.id]
    assert inbox.received == []
    assert (swept, told) == (0, [True]), (
        f"the sweep failed {swept} row(s) another deliverer had claimed after its read: "
        f"delivery_failed told {len(told)} times for one delivery ({told}), row "
        f"{row.status} {row.last_error!r}"
    )


def test_a_whole_refused_sequence_requeued_newest_first_goes_again_in_one_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Requeued a chunk at a time in the order given (the admin lists the
    # newest first), the lowest of the newest chunk found nothing pending
    # before it and was made due, beside the first of the sequence.
    monkeypatch.setattr(controls, "CHUNK", 3)
    inbox = "https://a.example/inbox"
    options = {"ordering_key": f"{ALICE}/timeline"}
    for n in range(7):
        send_batch(ALICE, {"type": "Create", "id": f"{ALICE}/activities/{n}"}, [inbox], options)
    for _ in range(7):
        (claimed,) = store.claim(10, 60, per_host=10)
        refused = store.Settlement(
            claimed=claimed,
            status=Status.REFUSED,
            attempts=1,
            last_status=400,
            attempted_at=timezone.now(),
            ordered=True,
        )
        assert store.settle([refused]) == {claimed.id}

    assert controls.requeue(Delivery.objects.order_by("-id")) == 7

    rows = list(Delivery.objects.order_by("id").values_list("id", "after_id", "due_at"))
    assert [row[0] for row in rows if row[2] is not None] == [rows[0][0]]
    assert [after for _, after, _ in rows[1:]] == [id for id, _, _ in rows[:-1]]


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("held_open", ["requeue", "send"])
def test_a_send_committing_while_a_requeue_in_its_sequence_commits_waits_on_it(
    held_open: str,
) -> None:
    # The first of a sequence refused, requeued by an operator while a web
    # process sends the next of it, one of the two in a transaction still
    # open as the other commits: the new one waited on nothing, and one
    # claim took both.
    if connection.vendor != "postgresql":
        pytest.skip("SQLite writes one at a time")
    inbox = "https://a.example/inbox"
    options = {"ordering_key": f"{ALICE}/timeline"}
    first = send_batch(ALICE, {"type": "Create", "id": f"{ALICE}/activities/1"}, [inbox], options)
    (claimed,) = store.claim(10, 60, per_host=10)
    refused = store.Settlement(
        claimed=claimed,
        status=Status.REFUSED,
        attempts=1,
        attempted_at=timezone.now(),
        ordered=True,
    )
    assert store.settle([refused]) == {claimed.id}
    opened, other_done = threading.Event(), threading.Event()
    errors: list[BaseException] = []
    sent: list[Batch | None] = []

    def requeue() -> None:
        assert controls.requeue(Delivery.objects.filter(batch=first)) == 1

    def send_next() -> None:
        activity = {"type": "Create", "id": f"{ALICE}/activities/2"}
        sent.append(send_batch(ALICE, activity, [inbox], options))

    def in_a_thread() -> None:
        try:
            other()
        except BaseException as exc:
            errors.append(exc)
        finally:
            connections.close_all()

    held, other = (requeue, send_next) if held_open == "requeue" else (send_next, requeue)

    def in_open_transaction() -> None:
        try:
            with transaction.atomic():
                held()
                opened.set()
                other_done.wait(10)
        except BaseException as exc:
            errors.append(exc)
        finally:
            opened.set()
            connections.close_all()

    thread = threading.Thread(target=in_open_transaction)
    thread.start()
    opened.wait(10)
    waiter = threading.Thread(target=in_a_thread)
    waiter.start()
    time.sleep(0.3)  # the other blocked on the sequence's lock, or done
    other_done.set()
    waiter.join(20)
    thread.join(20)
    assert not errors, errors
    (second,) = sent
    assert second is not None
    one = Delivery.objects.get(batch=first)
    two = Delivery.objects.get(batch=second)
    assert one.status == Status.PENDING and one.due_at is not None
    assert (two.after_id, two.due_at) == (one.id, None)


@pytest.mark.django_db(transaction=True)
def test_a_give_up_reads_its_rows_by_key_whatever_the_statistics() -> None:
    # Pending said as the status, the rows given up were found through the
    # due index under statistics of a queue long settled: every pending
    # row read, twice. 10,000 of a backlog of 50,000 given up took 2.4 to
    # 4.0 s (7 to 11 s prepared), 0.5 s by key.
    from .conftest import run_explained, statements_of_undone, statistics_of_a_server

    statistics_of_a_server()
    urls = [f"https://h{n % 100}.example/u{n}/inbox" for n in range(20_000)]
    batch = send(ALICE, {"type": "Note"}, urls)
    first = Delivery.objects.filter(batch=batch).order_by("id").values_list("id", flat=True)[:10]
    with statements_of_undone() as executed:
        assert controls.give_up(Delivery.objects.filter(id__in=list(first))) == 10
    for text, plan in run_explained(executed):
        assert "fd_delivery_due" not in plan, f"{text}\n{plan}"


@pytest.mark.parametrize("call", ["an ordered send", "the deadline sweep"])
@pytest.mark.django_db(transaction=True)
def test_what_finds_its_rows_by_id_or_batch_reads_no_other_pending_row(call: str) -> None:
    # Said as the status, "pending" had these read through the due index
    # under statistics of a queue long settled: every pending row of every
    # host, at every ordered send (every webhook event) and every sweep.
    from .conftest import run_explained, statements_of_undone, statistics_of_a_server

    statistics_of_a_server()
    backlog = 20_000
    send(
        ALICE, {"type": "Note"}, [f"https://h{n % 100}.example/u{n}/inbox" for n in range(backlog)]
    )
    inbox = ["https://target.example/inbox"]
    send_batch(ALICE, {"type": "Note"}, inbox, {"ordering_key": "k"})
    if call == "the deadline sweep":
        Batch.objects.filter(ordering_key="k").update(
            deadline=timezone.now() - dt.timedelta(seconds=1)
        )
    with statements_of_undone() as executed:
        if call == "an ordered send":
            send_batch(ALICE, {"type": "Note"}, inbox, {"ordering_key": "k"})
        else:
            assert controls.give_up_overdue(since=timezone.now() - dt.timedelta(minutes=1)) == 1
    for text, plan in run_explained(executed):
        removed = [int(n) for n in re.findall(r"Rows Removed by Filter: (\d+)", plan)]
        assert not any(n >= backlog for n in removed), f"{text}\n{plan}"
