"""What a later retraction took back, as a requeue and a replay ask it: a
retraction undone since, or a replay's copy of one, takes nothing back."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest
from django.utils import timezone

from django_federation_delivery import availability, controls, send
from django_federation_delivery.models import Batch, Delivery, Host, Status
from django_federation_delivery.replay import replay

from .keys import ALICE

POST = f"{ALICE}/notes/1"
A = "https://a.example/inbox"
H = "https://h.example/inbox"


def settle(batch: Batch, status: Status, at: dt.datetime, **more: Any) -> None:
    Delivery.objects.filter(batch=batch, **more).update(
        status=status, settled_at=at, due_at=None, after=None, attempts=1
    )


def delivered(batch: Batch, inbox: str, at: dt.datetime) -> None:
    """``batch`` delivered to ``inbox`` at ``at``, with its one attempt then."""
    Delivery.objects.filter(batch=batch, inbox=inbox).update(
        status=Status.DELIVERED, settled_at=at, last_attempt_at=at, due_at=None, attempts=1
    )


def mark_unavailable(name: str) -> None:
    now = timezone.now()
    Host.objects.update_or_create(
        name=name, defaults={"failing_since": now, "unavailable_since": now}
    )
    availability.forget_known()


LIKE = {"type": "Like", "id": f"{ALICE}/likes/1", "actor": ALICE, "object": POST}
UNLIKE = {"type": "Undo", "id": f"{ALICE}/undos/1", "actor": ALICE, "object": LIKE["id"]}
RELIKE = {"type": "Undo", "id": f"{ALICE}/undos/2", "actor": ALICE, "object": UNLIKE["id"]}


@pytest.mark.django_db
def test_a_like_whose_undo_left_its_inbox_out_and_was_undone_is_requeued() -> None:
    """A Like failed at h; h was marked unavailable; the Like was undone
    (the Undo left h out, nothing of the Like pending there), then the Undo
    undone once h was back. The sender has the Like again and h never heard
    of the Undo: the failed Like is requeued, as it is where the Undo was
    queued at h and superseded."""
    now = timezone.now()
    liked = send(ALICE, LIKE, [H])
    assert liked is not None
    settle(liked, Status.FAILED, now - dt.timedelta(minutes=30))
    mark_unavailable("h.example")
    undone = send(ALICE, UNLIKE, [A, H])
    assert undone is not None
    assert not Delivery.objects.filter(batch=undone, inbox=H).exists()
    controls.mark_host_seen("h.example")
    again = send(ALICE, RELIKE, [A, H])
    assert again is not None
    assert Delivery.objects.get(batch=undone, inbox=A).status == Status.SUPERSEDED
    assert controls.requeue(Delivery.objects.filter(batch=liked)) == 1
    assert Delivery.objects.get(batch=liked).status == Status.PENDING


@pytest.mark.django_db
def test_a_replay_sends_a_like_whose_undo_left_the_host_out_and_was_undone() -> None:
    """A Like delivered to h; h then marked unavailable, the Like undone
    (the Undo left h out) and the Undo undone (its Undo went to h once it
    was back). h, restored from a backup, is replayed: the Like goes again,
    with the Undo of the Undo."""
    now = timezone.now()
    liked = send(ALICE, LIKE, [H])
    assert liked is not None
    settle(liked, Status.DELIVERED, now - dt.timedelta(minutes=30))
    mark_unavailable("h.example")
    undone = send(ALICE, UNLIKE, [A, H])
    assert undone is not None
    controls.mark_host_seen("h.example")
    again = send(ALICE, RELIKE, [A, H])
    assert again is not None
    settle(again, Status.DELIVERED, now - dt.timedelta(minutes=10))
    since = now - dt.timedelta(hours=1)
    replayed = replay(host="h.example", since=since)
    assert sorted(batch.tag for batch in replayed) == sorted(
        [f"replay of batch {liked.pk}", f"replay of batch {again.pk}"]
    )


@pytest.mark.django_db
def test_replaying_another_host_does_not_take_a_restored_like_back_here() -> None:
    """A Like went to a (delivered) and failed at h; its Undo was delivered
    to a and still waited at h. a, restored from a backup, was replayed
    (the Undo copied for a). Then the Undo was undone, superseding it at h
    and the copy at a. The failed Like at h is requeued, as without that
    replay: the copy, written for a alone, is no retraction of its own."""
    now = timezone.now()
    liked = send(ALICE, LIKE, [A, H])
    assert liked is not None
    settle(liked, Status.DELIVERED, now - dt.timedelta(minutes=50), inbox=A)
    settle(liked, Status.FAILED, now - dt.timedelta(minutes=50), inbox=H)
    undone = send(ALICE, UNLIKE, [A, H])
    assert undone is not None
    delivered(undone, A, now - dt.timedelta(minutes=40))
    (copy,) = replay(host="a.example", since=now - dt.timedelta(hours=1))
    assert copy.activity_id == UNLIKE["id"]
    again = send(ALICE, RELIKE, [A, H])
    assert again is not None
    assert Delivery.objects.get(batch=undone, inbox=H).status == Status.SUPERSEDED
    assert Delivery.objects.get(batch=copy, inbox=A).status == Status.SUPERSEDED
    assert controls.requeue(Delivery.objects.filter(batch=liked, inbox=H)) == 1
    assert Delivery.objects.get(batch=liked, inbox=H).status == Status.PENDING


@pytest.mark.django_db
def test_an_undo_of_an_undo_queues_the_like_again_after_another_hosts_replay() -> None:
    """A Like to a (delivered) and h (never tried); its Undo superseded it
    at h and was delivered to a. a, restored from a backup, was replayed
    (the Undo copied for a). Then the Undo was undone: the Like it took
    back at h goes again, as it does with no replay of a."""
    now = timezone.now()
    liked = send(ALICE, LIKE, [A, H])
    assert liked is not None
    delivered(liked, A, now - dt.timedelta(minutes=50))
    undone = send(ALICE, UNLIKE, [A, H])
    assert undone is not None
    assert Delivery.objects.get(batch=liked, inbox=H).status == Status.SUPERSEDED
    delivered(undone, A, now - dt.timedelta(minutes=40))
    (copy,) = replay(host="a.example", since=now - dt.timedelta(hours=1))
    assert copy.activity_id == UNLIKE["id"]
    again = send(ALICE, RELIKE, [A, H])
    assert again is not None
    assert Delivery.objects.get(batch=undone, inbox=H).status == Status.SUPERSEDED
    assert Delivery.objects.get(batch=liked, inbox=H).status == Status.PENDING


B = "https://b.example/inbox"


@pytest.mark.django_db
def test_an_update_sent_after_a_delete_is_not_taken_back_by_another_hosts_replay() -> None:
    """An account suspended (a Delete of the actor) then unsuspended (an
    Update of the actor, sent after it). The Update failed at a. b,
    restored from a backup, is replayed: its copies of the Delete and the
    Update are queued there. The Update at a is still requeued: the copy
    of the Delete, written after the Update for b alone, takes nothing back."""
    now = timezone.now()
    actor_delete = {"type": "Delete", "id": f"{ALICE}#delete", "actor": ALICE, "object": ALICE}
    actor_update = {
        "type": "Update",
        "id": f"{ALICE}#updates/1",
        "actor": ALICE,
        "object": {"id": ALICE, "type": "Person"},
    }
    deleted = send(ALICE, actor_delete, [A, B])
    assert deleted is not None
    settle(deleted, Status.DELIVERED, now - dt.timedelta(minutes=50))
    updated = send(ALICE, actor_update, [A, B])
    assert updated is not None
    settle(updated, Status.DELIVERED, now - dt.timedelta(minutes=40), inbox=B)
    settle(updated, Status.FAILED, now - dt.timedelta(minutes=40), inbox=A)
    assert len(replay(host="b.example", since=now - dt.timedelta(hours=1))) == 2
    assert controls.requeue(Delivery.objects.filter(batch=updated, inbox=A)) == 1
