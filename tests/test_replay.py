"""Replay: what a host was sent since a moment, queued again once, in order,
in new batches with the bodies and ids they had."""

from __future__ import annotations

import datetime as dt
import hashlib
import re
import threading
import zoneinfo
from collections.abc import Callable
from io import StringIO
from typing import Any

import pytest
from django.core.management import CommandError, call_command
from django.db import OperationalError, close_old_connections, connection
from django.db.models.signals import post_save, pre_save
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from django_federation_delivery import (
    BatchOptions,
    availability,
    controls,
    send,
    send_batch,
    send_webhook,
    store,
)
from django_federation_delivery import replay as replaying
from django_federation_delivery.deliverer import Deliverer
from django_federation_delivery.models import Batch, Delivery, Host, Lane, Retracts, Status
from django_federation_delivery.replay import replay
from django_federation_delivery.replay import replayed as replayed_message
from django_federation_delivery.store import sequences

from .conftest import Inbox
from .keys import ALICE

SLACK = "slack://hooks.slack.com/services/T0AAAA1/B0BBBB2/s3cretT0kenV4lue9"


def settle(batch: Batch, status: Status, at: dt.datetime) -> None:
    Delivery.objects.filter(batch=batch).update(status=status, settled_at=at, due_at=None)


def note(n: int) -> dict[str, Any]:
    return {"type": "Create", "id": f"{ALICE}/activities/{n}", "actor": ALICE}


@pytest.fixture(params=[500, 1], ids=["one step", "a step a batch"])
def step(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> int:
    """A replay in one step, and in as many steps as batches: each chained
    to the one before it, as within one."""
    monkeypatch.setattr(replaying, "STEP", request.param)
    return int(request.param)


@pytest.mark.django_db
@pytest.mark.usefixtures("step")
def test_what_a_host_was_sent_since_a_moment_is_queued_again_once_in_order() -> None:
    now = timezone.now()
    old = send(ALICE, note(0), ["https://a.example/u1/inbox"])
    assert old is not None
    settle(old, Status.DELIVERED, now - dt.timedelta(days=3))
    sent = []
    for n in range(1, 4):
        batch = send(ALICE, note(n), ["https://a.example/u1/inbox", "https://a.example/u2/inbox"])
        assert batch is not None
        settle(batch, Status.FAILED if n == 2 else Status.DELIVERED, now - dt.timedelta(hours=n))
        sent.append(batch)
    elsewhere = send(ALICE, note(9), ["https://b.example/inbox"])
    assert elsewhere is not None
    settle(elsewhere, Status.DELIVERED, now)
    pending = send(ALICE, note(10), ["https://a.example/u3/inbox"])

    replayed = replay(host="a.example", since=now - dt.timedelta(days=1))

    assert [b.body for b in replayed] == [b.body for b in sent], "the same bodies, oldest first"
    assert {b.lane for b in replayed} == {Lane.LOW}
    rows = list(Delivery.objects.filter(batch__in=replayed).order_by("id"))
    assert len(rows) == 6 and {row.status for row in rows} == {Status.PENDING}
    # Each inbox's replays wait one on the other, in the order first sent.
    for inbox in ("https://a.example/u1/inbox", "https://a.example/u2/inbox"):
        chain = [row for row in rows if row.inbox == inbox]
        assert chain[0].after_id is None and chain[0].due_at is not None
        assert [row.after_id for row in chain[1:]] == [row.id for row in chain[:-1]]
    # Once: again, the same batches and nothing more.
    again = replay(host="a.example", since=now - dt.timedelta(days=1))
    assert [b.pk for b in again] == [b.pk for b in replayed]
    assert Delivery.objects.count() == 1 + 6 + 1 + 1 + 6
    assert replayed_message(again) == (
        "Queued again: 0 deliveries, in 0 new batches. 3 batches were queued by an "
        "earlier replay of the same moment."
    )
    assert pending is not None


@pytest.mark.django_db
def test_one_moment_written_with_another_offset_is_the_same_replay(settings: Any) -> None:
    batch = send(ALICE, note(1), ["https://a.example/inbox"])
    assert batch is not None
    settle(batch, Status.DELIVERED, timezone.now())
    since = (timezone.now() - dt.timedelta(hours=1)).replace(microsecond=0)
    (first,) = replay(host="a.example", since=since)
    # A key a replay made before moments were read in UTC is the one made now.
    written = f"{batch.pk}\na.example\n{since.isoformat()}"
    assert since.isoformat().endswith("+00:00")
    assert first.idempotency_key == ("replay-" + hashlib.sha256(written.encode()).hexdigest()[:40])
    paris = dt.timezone(dt.timedelta(hours=1))
    again = replay(host="a.example", since=since.astimezone(paris))
    assert [b.pk for b in again] == [first.pk] and not again[0].created
    # And as an operator writes it: in TIME_ZONE without an offset, then in UTC.
    settings.TIME_ZONE = "Europe/Paris"
    local = since.astimezone(zoneinfo.ZoneInfo("Europe/Paris")).replace(tzinfo=None)
    for written_since in (local.isoformat(), since.strftime("%Y-%m-%dT%H:%M:%SZ")):
        out = StringIO()
        call_command("delivery_replay", "--host=a.example", f"--since={written_since}", stdout=out)
        assert "Queued again: 0 deliveries" in out.getvalue()
    assert Delivery.objects.count() == 2


@pytest.mark.django_db
def test_a_replay_whose_batches_were_delivered_is_not_itself_replayed_again() -> None:
    now = timezone.now()
    since = now - dt.timedelta(days=1)
    batch = send(ALICE, note(1), ["https://a.example/inbox"])
    assert batch is not None
    settle(batch, Status.DELIVERED, now - dt.timedelta(hours=1))
    (first,) = replay(host="a.example", since=since)
    settle(first, Status.DELIVERED, timezone.now())
    # Its delivery is the host's since the moment too: the body went twice,
    # and goes no third time however often the replay is run.
    for _ in range(2):
        again = replay(host="a.example", since=since)
        assert [(b.pk, b.created) for b in again] == [(first.pk, False)]
    assert Delivery.objects.count() == 2
    # And the admin counts what it would replay so.
    assert replaying.to_replay(["a.example"], since=since) == {"a.example": 1}
    # A send whose own key begins as a replay's is still replayed (by a
    # replay of another moment: run again, one replays what it did at first).
    mine = send(ALICE, note(2), ["https://a.example/inbox"], idempotency_key="replay-mine")
    assert mine is not None
    settle(mine, Status.DELIVERED, timezone.now())
    earlier = since - dt.timedelta(seconds=1)
    assert [b.tag for b in replay(host="a.example", since=earlier) if b.created] == [
        f"replay of batch {batch.pk}",
        f"replay of batch {mine.pk}",
    ]


@pytest.mark.django_db
def test_a_delete_sent_after_a_replay_overtakes_the_replayed_create() -> None:
    def about(kind: str, n: int) -> dict[str, Any]:
        return {**note(n), "type": kind, "object": f"{ALICE}/notes/1"}

    created = send(ALICE, about("Create", 1), ["https://a.example/inbox"])
    assert created is not None
    settle(created, Status.DELIVERED, timezone.now())
    (again,) = replay(host="a.example", since=timezone.now() - dt.timedelta(hours=1))
    deleted = send(ALICE, about("Delete", 2), ["https://a.example/inbox"])
    assert deleted is not None and deleted.superseded == 1
    # Never tried, the replayed Create lands after the Delete nowhere: it is
    # about what the Create it came from was about.
    assert Delivery.objects.get(batch=again).status == Status.SUPERSEDED
    again.refresh_from_db()
    assert (again.activity_id, again.object_id) == (created.activity_id, created.object_id)


@pytest.mark.django_db
@pytest.mark.parametrize("deleted_as", [Status.PENDING, Status.DELIVERED])
def test_what_a_retraction_sent_before_a_replay_took_back_is_not_replayed(
    deleted_as: Status,
) -> None:
    inbox = "https://a.example/inbox"
    post = f"{ALICE}/notes/1"
    created = send(ALICE, {**note(1), "object": post}, [inbox])
    like = {"type": "Like", "id": f"{ALICE}/likes/1", "actor": ALICE, "object": post}
    liked = send(ALICE, like, [inbox])
    kept = send(ALICE, {**note(3), "object": f"{ALICE}/notes/3"}, [inbox])
    for batch in (created, liked, kept):
        assert batch is not None
        settle(batch, Status.DELIVERED, timezone.now())
    undone = send(ALICE, {"type": "Undo", "id": f"{ALICE}/undo/1", "object": like}, [inbox])
    deleted = send(ALICE, {**note(2), "type": "Delete", "object": post}, [inbox])
    assert undone is not None and deleted is not None
    settle(undone, Status.DELIVERED, timezone.now())
    if deleted_as == Status.PENDING:
        # Tried while the host was down, and waiting for its retry.
        Delivery.objects.filter(batch=deleted).update(
            attempts=1, last_status=503, last_attempt_at=timezone.now()
        )
    else:
        settle(deleted, Status.DELIVERED, timezone.now())
    since = timezone.now() - dt.timedelta(hours=1)

    counted = replaying.to_replay(["a.example"], since=since)
    again = replay(host="a.example", since=since)

    # The Create of the deleted post, and the undone Like, would land after
    # their retractions (or, the Delete still pending, before it): left out.
    expected = [kept.pk, undone.pk] + ([deleted.pk] if deleted_as == Status.DELIVERED else [])
    assert [b.tag for b in again] == [f"replay of batch {pk}" for pk in expected]
    assert counted == {"a.example": len(expected)}


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("step")
@pytest.mark.parametrize("behind", [False, True], ids=["first", "behind another"])
def test_a_replayed_delete_waits_on_the_create_still_retrying_at_the_inbox(behind: bool) -> None:
    # The Delete given up while its Create still retried, then replayed: its
    # copy was due at once and reached the inbox before the Create, where
    # the same Delete requeued waits on it. Behind another replayed batch,
    # it waits its turn first, then on the Create.
    inbox = "https://a.example/inbox"
    post = f"{ALICE}/notes/1"
    since = timezone.now() - dt.timedelta(hours=1)
    if behind:
        earlier = send(ALICE, note(0), [inbox])
        assert earlier is not None
        settle(earlier, Status.DELIVERED, timezone.now())
    created = send(ALICE, {**note(1), "object": post}, [inbox])
    retrying = Delivery.objects.filter(batch=created)
    retrying.update(
        attempts=1,
        last_status=503,
        last_attempt_at=timezone.now(),
        due_at=timezone.now() + dt.timedelta(hours=1),
    )
    deleted = send(ALICE, {**note(2), "type": "Delete", "object": post}, [inbox])
    assert deleted is not None and deleted.superseded == 0
    assert controls.give_up(Delivery.objects.filter(batch=deleted)) == 1

    replayed = replay(host="a.example", since=since)

    assert [b.tag for b in replayed][-1] == f"replay of batch {deleted.pk}"
    copy = Delivery.objects.filter(batch=replayed[-1])
    if behind:
        # Its turn first: the batch replayed before it goes, then it waits.
        assert copy.get().after_id == Delivery.objects.get(batch=replayed[0]).pk
        (turn,) = store.claim(10, 60, per_host=10)
        assert turn.batch_id == replayed[0].pk
        done = store.Settlement(claimed=turn, status=Status.DELIVERED, attempts=1, ordered=True)
        assert store.settle([done]) == {turn.id}
    assert (copy.get().after_id, copy.get().due_at) == (retrying.get().pk, None)
    assert store.claim(10, 60, per_host=10) == [], "the Delete goes before its Create"
    # The Create delivered at its retry, the Delete goes.
    retrying.update(due_at=timezone.now())
    (retried,) = store.claim(10, 60, per_host=10)
    assert store.settle([store.Settlement(claimed=retried, status=Status.DELIVERED, attempts=2)])
    assert [c.batch_id for c in store.claim(10, 60, per_host=10)] == [replayed[-1].pk]


@pytest.mark.django_db
def test_a_later_delete_of_the_same_post_keeps_an_earlier_one_replayed() -> None:
    # Three hosts restored from one backup, which had the post's Create:
    # each missed its Delete. A second Delete went to c alone, later.
    post = f"{ALICE}/notes/1"
    a, b, c = (f"https://{name}.example/inbox" for name in "abc")
    now = timezone.now()
    since = now - dt.timedelta(hours=1)
    created = send(ALICE, {**note(1), "object": post}, [a, b, c])
    deleted = send(ALICE, {**note(2), "type": "Delete", "object": post}, [a, b])
    again = send(ALICE, {**note(3), "type": "Delete", "object": post}, [c])
    assert created is not None and deleted is not None and again is not None
    settle(created, Status.DELIVERED, now - dt.timedelta(days=1))
    settle(deleted, Status.DELIVERED, now - dt.timedelta(minutes=30))
    settle(again, Status.DELIVERED, now - dt.timedelta(minutes=10))

    # a's Delete is not hidden by the one sent to c alone; b's is not hidden
    # by a's replay of it.
    for host in ("a.example", "b.example"):
        replayed = replay(host=host, since=since)
        assert [batch.tag for batch in replayed] == [f"replay of batch {deleted.pk}"], host
        assert replaying.to_replay([host], since=since) == {host: 1}


@pytest.mark.django_db
def test_a_replay_of_a_host_a_delete_left_out_does_not_send_the_deleted_post() -> None:
    """A post's Create to h failed; h was marked unavailable, and the post
    deleted: its Delete left h out (nothing of it pending there). h back,
    and replayed: the deleted post is not sent to it, with no Delete after."""
    post = f"{ALICE}/notes/1"
    a, h = "https://a.example/inbox", "https://h.example/inbox"
    now = timezone.now()
    created = send(ALICE, {**note(1), "object": post}, [a, h])
    assert created is not None
    settle(created, Status.FAILED, now - dt.timedelta(minutes=30))
    Host.objects.create(name="h.example", failing_since=now, unavailable_since=now)
    availability.forget_known()
    deleted = send(ALICE, {**note(2), "type": "Delete", "object": post}, [a, h])
    assert deleted is not None
    assert not Delivery.objects.filter(batch=deleted, host="h.example").exists()
    controls.mark_host_seen("h.example")
    since = now - dt.timedelta(hours=1)
    assert replay(host="h.example", since=since) == []
    assert replaying.to_replay(["h.example"], since=since).get("h.example", 0) == 0


@pytest.mark.django_db
def test_a_replay_sends_a_like_whose_undo_was_undone_before_it_went() -> None:
    """A Like delivered to h; its Undo undone itself before it went (an Undo
    of the Undo: superseded, never sent). h restored from a backup is
    replayed: the Like goes again, with the Undo of the Undo."""
    like = {"type": "Like", "id": f"{ALICE}/likes/1", "actor": ALICE, "object": f"{ALICE}/n"}
    h = "https://h.example/inbox"
    now = timezone.now()
    liked = send(ALICE, like, [h])
    assert liked is not None
    settle(liked, Status.DELIVERED, now - dt.timedelta(minutes=30))
    undo = {"type": "Undo", "id": f"{ALICE}/undos/1", "actor": ALICE, "object": like["id"]}
    undone = send(ALICE, undo, [h])
    redo = {"type": "Undo", "id": f"{ALICE}/undos/2", "actor": ALICE, "object": undo["id"]}
    again = send(ALICE, redo, [h])
    assert undone is not None and again is not None
    assert Delivery.objects.get(batch=undone).status == Status.SUPERSEDED
    settle(again, Status.DELIVERED, now - dt.timedelta(minutes=10))
    since = now - dt.timedelta(hours=1)
    replayed = replay(host="h.example", since=since)
    assert sorted(batch.tag for batch in replayed) == sorted(
        [f"replay of batch {liked.pk}", f"replay of batch {again.pk}"]
    )


@pytest.mark.django_db
def test_with_use_tz_off_a_host_is_replayed_since_a_span_or_a_moment(settings: Any) -> None:
    # The command's span was a naive time then, refused as "names no host";
    # an aware moment was refused by SQLite's backend.
    settings.USE_TZ = False
    settings.TIME_ZONE = "America/Los_Angeles"
    batch = send(ALICE, note(1), ["https://a.example/inbox"])
    assert batch is not None
    settle(batch, Status.DELIVERED, timezone.now())
    out = StringIO()
    call_command("delivery_replay", "--host=a.example", "--since=1h", stdout=out)
    assert "1 delivery, in 1 new batch" in out.getvalue()
    since = dt.datetime.now(dt.UTC) - dt.timedelta(minutes=5)
    assert replaying.to_replay(["a.example"], since=since) == {"a.example": 1}
    assert len(replay(host="a.example", since=since)) == 1


@pytest.mark.django_db
def test_a_webhook_destination_is_sent_its_events_again_with_their_ids(settings: Any) -> None:
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "WEBHOOKS": {"ops": "slack://hooks.slack.com/services/T0AAAA1/B0BBBB2/s3cretT0kenV4lue9"},
    }
    first = send_webhook("ops", "deploy.done", {"n": 1}, event_id="evt-1")
    assert first is not None
    settle(first, Status.DELIVERED, timezone.now())
    (again,) = replay(destination="ops", since=timezone.now() - dt.timedelta(hours=1))
    assert (again.event_id, again.body, again.lane) == ("evt-1", first.body, Lane.WEBHOOK)
    row = Delivery.objects.get(batch=again)
    assert (row.kind, row.destination, row.host) == ("webhook", "ops", "<ops>")


@pytest.mark.django_db
@pytest.mark.usefixtures("step")
def test_replayed_events_wait_behind_a_destinations_pending_one_each_on_the_last(
    settings: Any,
) -> None:
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "WEBHOOKS": {"ops": "slack://hooks.slack.com/services/T0AAAA1/B0BBBB2/s3cretT0kenV4lue9"},
    }
    now = timezone.now()
    sent = []
    for n in range(4):
        event = send_webhook("ops", "deploy.done", {"n": n}, event_id=f"evt-{n}")
        assert event is not None
        settle(event, Status.DELIVERED, now - dt.timedelta(minutes=10 - n))
        sent.append(event)
    waiting = send_webhook("ops", "deploy.done", {"n": 9}, event_id="evt-9")
    assert waiting is not None
    (pending,) = Delivery.objects.filter(batch=waiting)

    replayed = replay(destination="ops", since=now - dt.timedelta(hours=1))

    assert [b.event_id for b in replayed] == [f"evt-{n}" for n in range(4)]
    chain = list(Delivery.objects.filter(batch__in=replayed).order_by("id"))
    # Behind the one pending, then each on the one before it: none due.
    assert [row.after_id for row in chain] == [pending.pk] + [row.pk for row in chain[:-1]]
    assert {row.due_at for row in chain} == {None}
    # The next event sent waits on the last of them.
    after = send_webhook("ops", "deploy.done", {"n": 10}, event_id="evt-10")
    assert after is not None
    assert Delivery.objects.get(batch=after).after_id == chain[-1].pk


@pytest.mark.django_db(transaction=True)
def test_a_restored_inbox_receives_what_it_missed_again(inboxes: Callable[..., Inbox]) -> None:
    inbox = inboxes("127.0.0.1")
    for n in range(3):
        send(ALICE, note(n), [inbox.url("/inbox")])
    Deliverer().run(drain=True)
    assert len(inbox.received) == 3
    host = Delivery.objects.values_list("host", flat=True).first()
    out = StringIO()
    call_command("delivery_replay", f"--host={host}", "--since=1h", stdout=out)
    said = out.getvalue()
    assert "Queued again: 3 deliveries, in 3 new batches." in said and said.startswith("Since ")
    Deliverer().run(drain=True)
    ids = [request.json()["id"] for request in inbox.received]
    # Sent at first side by side, in any order; again one after the other,
    # in the order they were queued.
    assert sorted(ids[:3]) == [note(n)["id"] for n in range(3)]
    assert ids[3:] == [note(n)["id"] for n in range(3)]


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--host=a.example", "--since=yesterday"], "--since 'yesterday' is neither"),
        (["--host=a.example", "--since=2026-13-01"], "--since '2026-13-01' is neither"),
        (["--host=a.example", "--destination=ops", "--since=1h"], "not allowed with argument"),
        (["--since=1h"], "one of the arguments --host --destination is required"),
        (["--host=", "--since=1h"], "--host '' names nothing"),
        (["--destination= ", "--since=1h"], "--destination ' ' names nothing"),
        (["--host=a.example", "--since=99999999d"], "'99999999d' reaches back before the year 1"),
        (["--host=a.example", "--since=0h"], "--since '0h' is not in the past"),
        (["--host=a.example", "--since=00d"], "--since '00d' is not in the past"),
        (["--host=a.example", "--since=2999-01-01T00:00"], "'2999-01-01T00:00' is not in the past"),
        (["--host=http://", "--since=1h"], "--host 'http://' names no host"),
        (["--host=nowhere.example", "--since=1h"], "no host named 'nowhere.example' has been"),
        (
            ["--host=https://u:pw@nowhere.example/inbox?token=t0ken", "--since=1h"],
            "^no host named 'https://nowhere.example/…' has been sent to$",
        ),
        (["--destination=o\x1bps", "--since=1h"], r"'o\\x1bps' holds a character no name"),
        (["--destination=nope", "--since=1h"], "no webhook destination named 'nope' is configured"),
        (["--host=a.example", "--since=²h"], "--since '²h' is neither"),
        (["--host=a.example", f"--since={'1' * 10_000}h"], "'1{80}…' reaches back before"),
        (["--host=a.example", f"--since={'1' * 10_000}"], "'1{80}…' is neither"),
        (
            ["--host=a.example", "--since=9999-12-31T23:59:59-23:59"],
            "'9999-12-31T23:59:59-23:59' falls outside the calendar in UTC",
        ),
        (
            ["--host=a.example", "--since=0001-01-01T00:30+01:00"],
            "'0001-01-01T00:30\\+01:00' falls outside the calendar in UTC",
        ),
    ],
)
def test_a_bad_replay_is_refused_naming_what_is_wrong(args: list[str], said: str) -> None:
    with pytest.raises(CommandError, match=said):
        call_command("delivery_replay", *args)
    assert not Batch.objects.exists()


@pytest.mark.django_db
@pytest.mark.parametrize(
    "named", ["Bücher.Example.", "https://BÜCHER.example/users/bob", "xn--bcher-kva.example"]
)
def test_a_host_is_replayed_however_it_is_written(named: str) -> None:
    now = timezone.now()
    batch = send(ALICE, note(1), ["https://bücher.example/inbox"])
    assert batch is not None
    settle(batch, Status.DELIVERED, now - dt.timedelta(hours=1))
    out = StringIO()
    call_command("delivery_replay", f"--host={named}", "--since=1d", stdout=out)
    assert "Queued again: 1 delivery, in 1 new batch." in out.getvalue()
    (again,) = Delivery.objects.exclude(batch=batch)
    assert (again.host, again.inbox) == (
        "xn--bcher-kva.example",
        "https://xn--bcher-kva.example/inbox",
    )


def test_a_naive_moment_or_no_host_is_refused() -> None:
    with pytest.raises(ValueError, match="a host or a destination"):
        replay(since=timezone.now())
    with pytest.raises(ValueError, match="time zone"):
        replay(host="a.example", since=dt.datetime(2026, 12, 1))
    with pytest.raises(ValueError, match=r"replay needs a host name .* not 'https://…'"):
        replay(host="https:///inbox", since=timezone.now())


@pytest.mark.parametrize("since", [None, "2026-12-01", 1764547200, dt.date(2026, 12, 1)])
def test_a_moment_that_is_no_datetime_is_refused_naming_it(since: Any) -> None:
    with pytest.raises(ValueError, match=f"since must be a datetime, not {re.escape(repr(since))}"):
        replay(host="a.example", since=since)


@pytest.mark.django_db
@pytest.mark.parametrize("named", ["o\x00ps", "o\nps", b"ops", 7])
def test_a_destination_no_name_can_be_is_refused_naming_it(named: Any) -> None:
    # A NUL reached PostgreSQL, which refuses it in a query's text.
    with pytest.raises(ValueError, match="replay needs a webhook destination's name, not"):
        replay(destination=named, since=timezone.now())


@pytest.mark.django_db
@pytest.mark.parametrize("use_tz", [True, False])
def test_an_operator_sends_a_host_its_last_day_again_from_the_admin(
    settings: Any, use_tz: bool
) -> None:
    from django_federation_delivery.models import Host

    from .test_admin import act, login

    # With USE_TZ off the action's moment was naive, which replay() refuses.
    settings.USE_TZ = use_tz
    settings.TIME_ZONE = "America/Los_Angeles"
    batch = send(ALICE, note(1), ["https://a.example/u1/inbox", "https://a.example/u2/inbox"])
    assert batch is not None
    settle(batch, Status.DELIVERED, timezone.now() - dt.timedelta(hours=2))
    Host.objects.create(name="a.example")
    said = act(login("operator"), "host", "replay_day", ["a.example"])
    assert said == ["Queued again: 2 deliveries, in 1 new batch."]
    assert Delivery.objects.filter(status=Status.PENDING).count() == 2


@pytest.mark.django_db
def test_the_admin_leaves_a_replay_too_big_for_one_request_to_the_command(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from django_federation_delivery.admin import hosts
    from django_federation_delivery.models import Host

    from .test_admin import act, login

    monkeypatch.setattr(hosts, "MOST_REPLAYED", 1)
    batch = send(ALICE, note(1), ["https://a.example/u1/inbox", "https://a.example/u2/inbox"])
    assert batch is not None
    settle(batch, Status.DELIVERED, timezone.now() - dt.timedelta(hours=2))
    Host.objects.create(name="a.example")
    said = act(login("operator"), "host", "replay_day", ["a.example"])
    assert said == [
        "2 deliveries to replay are more than one page's request should write (1): "
        "nothing was queued. Run manage.py delivery_replay --host NAME --since 24h "
        "for each host instead."
    ]
    assert not Delivery.objects.filter(status=Status.PENDING).exists()
    call_command("delivery_replay", "--host=a.example", "--since=24h", stdout=StringIO())
    assert Delivery.objects.filter(status=Status.PENDING).count() == 2


@pytest.mark.django_db(transaction=True)
def test_a_replay_while_another_connection_writes_is_not_refused_database_locked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # On SQLite a replay read what it replays, then wrote: another
    # connection's write in between (a deliverer settling, a view sending)
    # made its first write fail at once, "database is locked".
    now = timezone.now()
    batch = send(ALICE, note(1), ["https://a.example/inbox"])
    assert batch is not None
    Delivery.objects.filter(batch=batch).update(
        status=Status.DELIVERED, settled_at=now - dt.timedelta(hours=1), due_at=None
    )
    real = sequences.lock_sequences
    wrote: list[object] = []
    others: list[threading.Thread] = []

    def meanwhile(*args: Any, **kwargs: Any) -> None:
        # Another connection writes while the replay has read what it
        # replays and not yet written: it now waits its turn.
        def other() -> None:
            try:
                wrote.append(send(ALICE, note(2), ["https://b.example/inbox"]))
            finally:
                close_old_connections()

        if not others:
            others.append(threading.Thread(target=other))
            others[0].start()
            others[0].join(0.5)
        real(*args, **kwargs)

    monkeypatch.setattr(sequences, "lock_sequences", meanwhile)
    replayed = replay(host="a.example", since=now - dt.timedelta(days=1))
    others[0].join(20)
    assert [b.created for b in replayed] == [True]
    assert len(wrote) == 1 and wrote[0] is not None, "the other write went after it"


@pytest.mark.django_db(transaction=True)
def test_two_replays_at_once_both_finish_and_queue_once() -> None:
    # An operator's command and the admin's action at once, on SQLite: one
    # failed "database is locked" rather than waiting its turn.
    now = timezone.now()
    for n in range(30):
        batch = send(ALICE, note(n), [f"https://a.example/u{i}/inbox" for i in range(3)])
        Delivery.objects.filter(batch=batch).update(
            status=Status.DELIVERED, settled_at=now, due_at=None
        )
    since = now - dt.timedelta(hours=1)
    results: list[list[Batch]] = []
    errors: list[BaseException] = []
    together = threading.Barrier(2)

    def run() -> None:
        try:
            together.wait(10)
            results.append(replay(host="a.example", since=since))
        except Exception as exc:
            errors.append(exc)
        finally:
            close_old_connections()

    threads = [threading.Thread(target=run) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors, errors
    assert Batch.objects.count() == 60 and Delivery.objects.count() == 180


def _delivered_to_host(batches: int, inboxes: int, now: dt.datetime) -> list[Batch]:
    """``batches`` one-inbox batches delivered to a.example within the last
    hour, to ``inboxes`` inboxes there in turn, written in bulk: one in ten
    an ``Undo`` of a ``Like`` the host was never sent."""
    made = Batch.objects.bulk_create(
        [
            Batch(
                sender=ALICE,
                body=f'{{"type":"{"Undo" if n % 10 == 5 else "Create"}",'
                f'"id":"{ALICE}/activities/{n}"}}',
                activity_id=f"{ALICE}/activities/{n}",
                object_id=f"{ALICE}/likes/{n}" if n % 10 == 5 else "",
                retracts=Retracts.ACTIVITY if n % 10 == 5 else Retracts.NOTHING,
                size=1,
                remaining=0,
                created_at=now - dt.timedelta(hours=1),
                finished_at=now - dt.timedelta(minutes=30),
            )
            for n in range(batches)
        ],
        batch_size=1000,
    )
    Delivery.objects.bulk_create(
        [
            Delivery(
                batch=batch,
                inbox=f"https://a.example/u{n % inboxes}/inbox",
                host="a.example",
                status=Status.DELIVERED,
                attempts=1,
                settled_at=now - dt.timedelta(minutes=30),
            )
            for n, batch in enumerate(made)
        ],
        batch_size=1000,
    )
    return made


@pytest.mark.django_db
def test_thousands_of_one_inbox_batches_are_replayed_in_a_few_statements_a_step() -> None:
    # A host's share of ordinary sends: replies, follows, small fan-outs.
    now = timezone.now()
    originals = _delivered_to_host(3000, 2, now)
    saved: list[tuple[str, Batch]] = []

    def pre(instance: Batch, **kwargs: Any) -> None:
        saved.append(("pre", instance))

    def post(instance: Batch, created: bool, **kwargs: Any) -> None:
        assert created and instance.pk
        saved.append(("post", instance))

    since = now - dt.timedelta(days=1)
    pre_save.connect(pre, sender=Batch)
    post_save.connect(post, sender=Batch)
    try:
        with CaptureQueriesContext(connection) as queries:
            replayed = replay(host="a.example", since=since)
    finally:
        pre_save.disconnect(pre, sender=Batch)
        post_save.disconnect(post, sender=Batch)
    # 6 steps of 500 batches: each its reads, its locks, a statement of
    # batches, one of deliveries, its chain and its retractions' wait.
    assert len(queries) <= 80, f"{len(queries)} statements to replay 3,000 batches"
    assert [b.tag for b in replayed] == [f"replay of batch {b.pk}" for b in originals]
    assert all(b.created and (b.size, b.remaining) == (1, 1) for b in replayed)
    # Each batch's pre_save before it is written, its post_save once its step is.
    assert [kind for kind, _ in saved] == (["pre"] * 500 + ["post"] * 500) * 6
    assert {id(batch) for _, batch in saved} == {id(batch) for batch in replayed}
    # Each inbox is sent them once, in their first order, each waiting on the one before.
    for inbox in ("https://a.example/u0/inbox", "https://a.example/u1/inbox"):
        chain = list(Delivery.objects.filter(inbox=inbox, status=Status.PENDING).order_by("id"))
        assert [row.batch_id for row in chain] == [b.pk for b in replayed[inbox[-7] == "1" :: 2]]
        assert [row.after_id for row in chain] == [None] + [row.pk for row in chain[:-1]]
        assert chain[0].due_at is not None and {row.due_at for row in chain[1:]} == {None}

    with CaptureQueriesContext(connection) as queries:
        again = replay(host="a.example", since=since)
    assert len(queries) <= 80
    assert [b.pk for b in again] == [b.pk for b in replayed]
    assert not any(b.created for b in again)
    assert Delivery.objects.filter(status=Status.PENDING).count() == 3000


@pytest.mark.django_db
def test_a_replay_run_again_for_the_same_moment_queues_nothing_more() -> None:
    # The host restored at 08:00; the operator replays since then, and the
    # host, back, is delivered live what is sent meanwhile. Run again for the
    # same host and moment (README: "it queues nothing more"), the replay
    # sends the host again what it got live after the first run.
    since = (timezone.now() - dt.timedelta(hours=2)).replace(microsecond=0)
    missed = send(ALICE, note(1), ["https://a.example/inbox"])
    assert missed is not None
    settle(missed, Status.DELIVERED, since + dt.timedelta(minutes=10))
    first = replay(host="a.example", since=since)
    assert [b.created for b in first] == [True]
    settle(first[0], Status.DELIVERED, timezone.now())
    # Sent live after the replay, and delivered: the host has it.
    live = send(ALICE, note(2), ["https://a.example/inbox"])
    assert live is not None
    settle(live, Status.DELIVERED, timezone.now())

    again = replay(host="a.example", since=since)

    new = [b.tag for b in again if b.created]
    assert new == [], f"the same replay run again queued {new}: sent live after the first run"


@pytest.mark.django_db
@pytest.mark.parametrize("before", [dt.timedelta(seconds=1), dt.timedelta(hours=1)])
def test_a_replay_run_again_leaves_out_what_it_did_not_replay_whenever_it_settled(
    before: dt.timedelta,
) -> None:
    # What the first run replayed was told by time: a delivery settled by a
    # deliverer as the first run wrote (its time taken before its commit),
    # or, read naive, in the hour a clock goes back through, fell before the
    # first run's batches, and was queued again: the host got it twice.
    since = (timezone.now() - dt.timedelta(hours=3)).replace(microsecond=0)
    missed = send(ALICE, note(1), ["https://a.example/inbox"])
    assert missed is not None
    settle(missed, Status.DELIVERED, since + dt.timedelta(minutes=10))
    live = send(ALICE, note(2), ["https://a.example/inbox"])
    assert live is not None
    first = replay(host="a.example", since=since)
    assert [b.tag for b in first] == [f"replay of batch {missed.pk}"]
    settle(live, Status.DELIVERED, first[0].created_at - before)

    again = replay(host="a.example", since=since)

    assert [(b.pk, b.created) for b in again] == [(first[0].pk, False)]


@pytest.mark.django_db
def test_a_replay_to_a_destination_no_longer_configured_is_refused(settings: Any) -> None:
    # Queued, each copy was given up unattempted by the deliverer ("no
    # destination named `old` is configured any more"), its failure signalled.
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "WEBHOOKS": {"ops": SLACK, "old": SLACK},
    }
    event = send_webhook("old", "deploy.done", {"n": 1}, event_id="evt-1")
    assert event is not None
    settle(event, Status.DELIVERED, timezone.now())
    # Never sent to: a name that has not been, refused as such.
    with pytest.raises(CommandError, match=r"^no webhook destination named 'ops' has been sent"):
        call_command("delivery_replay", "--destination=ops", "--since=1h")
    settings.FEDERATION_DELIVERY = {**settings.FEDERATION_DELIVERY, "WEBHOOKS": {"ops": SLACK}}

    with pytest.raises(CommandError, match=r"^no webhook destination named 'old' is configured"):
        call_command("delivery_replay", "--destination=old", "--since=1h")
    # Nor is it replayed as the host it was (the admin's action on its row).
    assert replaying.to_replay(["<old>"], since=timezone.now() - dt.timedelta(hours=1)) == {}
    assert replaying.replay_host("<old>", since=timezone.now() - dt.timedelta(hours=1)) == []
    assert Batch.objects.count() == 1


@pytest.mark.django_db
def test_a_moment_off_the_calendar_in_time_zone_is_refused_with_use_tz_off(settings: Any) -> None:
    if connection.vendor == "postgresql":
        pytest.skip("PostgreSQL takes an aware moment with USE_TZ off")
    settings.USE_TZ = False
    settings.TIME_ZONE = "America/Los_Angeles"
    batch = send(ALICE, note(1), ["https://a.example/inbox"])
    assert batch is not None
    settle(batch, Status.DELIVERED, timezone.now())
    with pytest.raises(CommandError, match="falls outside the calendar"):
        call_command("delivery_replay", "--host=a.example", "--since=0001-01-01T05:00Z")


@pytest.mark.django_db
def test_a_replayed_batch_keeps_its_deadline_and_max_attempts() -> None:
    # "A batch that must finish: tagged, given up on at its deadline."
    deadline = dt.timedelta(hours=6)
    moved = send_batch(
        ALICE,
        note(1),
        ["https://a.example/inbox"],
        BatchOptions(tag="move", deadline=deadline, max_attempts=2),
    )
    assert moved is not None and moved.deadline is not None
    settle(moved, Status.DELIVERED, timezone.now())

    (again,) = replay(host="a.example", since=timezone.now() - dt.timedelta(hours=1))

    again.refresh_from_db()
    assert (again.deadline, again.max_attempts) == (moved.deadline, 2), (
        f"the replayed copy has deadline {again.deadline} and max_attempts "
        f"{again.max_attempts}; the batch it copies, {moved.deadline} and 2"
    )


@pytest.mark.django_db
def test_a_batch_whose_deadline_passed_is_not_sent_again_by_a_replay() -> None:
    # Requeued, such a delivery is left as it is (README); replayed, it was
    # queued again with no deadline at all, and sent late.
    expired = send_batch(
        ALICE, note(1), ["https://a.example/inbox"], BatchOptions(deadline=dt.timedelta(minutes=5))
    )
    assert expired is not None
    Batch.objects.filter(pk=expired.pk).update(deadline=timezone.now() - dt.timedelta(minutes=1))
    settle(expired, Status.FAILED, timezone.now() - dt.timedelta(minutes=1))

    replay(host="a.example", since=timezone.now() - dt.timedelta(hours=1))

    due = list(
        Delivery.objects.filter(status=Status.PENDING, due_at__isnull=False).values_list(
            "batch__tag", "batch__deadline"
        )
    )
    assert due == [], f"past its deadline, the batch is queued to be sent again: {due}"


class Deadlocked(Exception):
    """The driver's error for a transaction PostgreSQL ended to undo a deadlock."""

    sqlstate = "40P01"


def delivered_an_hour_ago(count: int) -> list[Batch]:
    """``count`` batches to a.example, delivered an hour ago."""
    sent = []
    for n in range(count):
        batch = send(ALICE, note(n), ["https://a.example/u1/inbox"])
        assert batch is not None
        settle(batch, Status.DELIVERED, timezone.now() - dt.timedelta(hours=1))
        sent.append(batch)
    return sent


def ended_once_for_a_deadlock(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A replay's first write of its batches ended as PostgreSQL ends one to
    undo a deadlock, once written: what that try wrote, as it is told."""
    real = replaying.queueing.enqueue_all
    ended: list[int] = []

    def ended_once(items: Any, **kwargs: Any) -> Any:
        written = real(items, **kwargs)
        if not ended:
            ended.append(len(written))
            raise OperationalError("deadlock detected") from Deadlocked()
        return written

    monkeypatch.setattr(replaying.queueing, "enqueue_all", ended_once)
    return ended


@pytest.mark.django_db(transaction=True)
def test_a_replay_the_database_ended_to_undo_a_deadlock_is_made_again_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A replay locks the last delivery of each sequence it adds to, step
    after step, not lowest id first over the whole replay; writers at once
    (a deliverer settling, operators pausing and giving up) met it in a
    deadlock, and when PostgreSQL ended the replay's side, its operator
    got ``deadlock detected`` (a 500 in the admin, or ``delivery_replay``
    failing), nothing queued. It is made again: each batch replayed once,
    nothing of the ended try left. (The deadlock is told as the driver
    tells it, here on either database.)"""
    now = timezone.now()
    sent = delivered_an_hour_ago(3)
    ended = ended_once_for_a_deadlock(monkeypatch)
    replayed = replay(host="a.example", since=now - dt.timedelta(days=1))
    assert ended == [3]
    assert [b.tag for b in replayed] == [f"replay of batch {b.pk}" for b in sent]
    assert Batch.objects.filter(tag__startswith="replay of batch ").count() == 3
    assert Delivery.objects.filter(batch__in=replayed, status=Status.PENDING).count() == 3


@pytest.mark.django_db
def test_a_replay_run_again_from_the_moment_its_line_printed_queues_nothing_more() -> None:
    """``delivery_replay --since 6h`` prints the moment it replayed from, and
    the README's way to run a replay twice is to give that moment. The
    moment had microseconds the line left out: given again, it was another
    replay, and the host was sent each activity a third time."""
    inbox = "https://a.example/inbox"
    batch = send(ALICE, note(1), [inbox])
    assert batch is not None
    settle(batch, Status.DELIVERED, timezone.now() - dt.timedelta(hours=1))
    first = StringIO()
    call_command("delivery_replay", "--host", "a.example", "--since", "6h", stdout=first)
    assert "Queued again: 1 delivery" in first.getvalue(), first.getvalue()
    (moment,) = re.findall(r"^Since (\S+)\. ", first.getvalue())
    again = StringIO()
    call_command("delivery_replay", "--host", "a.example", "--since", moment, stdout=again)
    assert Delivery.objects.filter(inbox=inbox).count() == 2, again.getvalue()


@pytest.mark.django_db(transaction=True)
def test_the_hosts_lists_replay_ended_to_undo_a_deadlock_is_made_again(
    admin_client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The hosts list's "Send again ... the last 24 hours" runs every
    host's replay in one transaction, where a replay ended for a deadlock
    is raised, not made again: the operator got a 500, nothing queued.
    The whole action is made again."""
    from django.urls import reverse

    delivered_an_hour_ago(3)
    Host.objects.get_or_create(name="a.example")
    ended = ended_once_for_a_deadlock(monkeypatch)
    changelist = reverse("admin:federation_delivery_host_changelist")
    try:
        response = admin_client.post(
            changelist,
            {"action": "replay_day", "_selected_action": ["a.example"], "index": "0"},
        )
    except OperationalError as exc:
        pytest.fail(f"the action raised (a 500): {exc!r}")
    assert response.status_code == 302
    assert ended == [3], "ended once, then made again"
    assert Batch.objects.filter(tag__startswith="replay of batch ").count() == 3
    assert Delivery.objects.filter(batch__tag__startswith="replay of batch ").count() == 3


@pytest.mark.django_db(transaction=True)
def test_a_hosts_replay_reads_the_retractions_sent_there_once_not_once_a_row() -> None:
    # A host away a while: each post given up there, half of them then
    # deleted by a Delete that left it out (and taken back there all the
    # same). Asked of each row replayed, "did a later retraction go to this
    # host" read the Delete's whole batch through
    # the index on (batch, status): 2,000 rows, each about a post later
    # deleted by a Delete to 10,000 inboxes, took 2 s.
    from .conftest import (
        reads_a_batch_once_a_row,
        run_explained,
        statements_of_undone,
        statistics_of_a_server,
    )

    statistics_of_a_server()
    away = [f"https://restored.example/u{n}/inbox" for n in range(20)]
    others = [f"https://h{n % 100}.example/u{n}/inbox" for n in range(2000)]
    posts = [f"{ALICE}/notes/p{n}" for n in range(10)]
    for post in posts:
        send(
            ALICE,
            {"type": "Create", "id": f"{post}/c", "actor": ALICE, "object": post},
            others + away,
        )
    for post in posts[:5]:
        send(ALICE, {"type": "Delete", "id": f"{post}/d", "actor": ALICE, "object": post}, others)
    Delivery.objects.update(
        status=Status.DELIVERED, settled_at=timezone.now(), due_at=None, after=None
    )
    Delivery.objects.filter(host="restored.example").update(status=Status.FAILED)
    since = timezone.now() - dt.timedelta(days=1)
    with statements_of_undone() as executed:
        assert len(replay(host="restored.example", since=since)) == 5
    for text, plan in run_explained(executed):
        assert not reads_a_batch_once_a_row(plan), f"{text}\n{plan}"


@pytest.mark.django_db
def test_a_replay_run_again_once_what_it_replayed_was_taken_back_queues_nothing() -> None:
    """A host replayed since a moment; what it was then sent live was
    delivered, and the post the replay sent again was deleted since (the
    Delete delivered live). Run again for the same moment, the replay finds
    the first run all the same: it queues nothing more, not what went live
    since (which it sent again as if missed)."""
    since = (timezone.now() - dt.timedelta(hours=2)).replace(microsecond=0)
    post = f"{ALICE}/notes/1"
    missed = send(ALICE, {**note(1), "object": post}, ["https://a.example/inbox"])
    assert missed is not None
    settle(missed, Status.DELIVERED, since + dt.timedelta(minutes=10))
    (first,) = replay(host="a.example", since=since)
    assert first.created
    settle(first, Status.DELIVERED, timezone.now())
    live = send(ALICE, note(2), ["https://a.example/inbox"])
    assert live is not None
    settle(live, Status.DELIVERED, timezone.now())
    deleted = {**note(3), "type": "Delete", "object": post}
    delete = send(ALICE, deleted, ["https://a.example/inbox"])
    assert delete is not None
    settle(delete, Status.DELIVERED, timezone.now())
    assert [b for b in replay(host="a.example", since=since) if b.created] == []


@pytest.mark.django_db
def test_delivery_replay_names_an_ipv6_host_whole() -> None:
    """``delivery_replay --host fd00::dead:beef:cafe:1`` for a host never sent
    to says "no host named 'fd00:…' has been sent to": the IPv6 address
    the operator typed is cut, as if it held a token."""
    with pytest.raises(CommandError) as raised:
        call_command("delivery_replay", "--host", "fd00::dead:beef:cafe:1", "--since", "2h")
    assert "fd00::dead:beef:cafe:1" in str(raised.value)
