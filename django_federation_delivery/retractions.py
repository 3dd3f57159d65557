"""Retractions overtake: a ``Delete`` of an object, or an ``Undo`` of an
activity, supersedes its sender's deliveries about it that were never tried.

Someone posts to 20,000 followers and deletes the post a minute later: the
``Create`` is still queued for most inboxes. When ``send()`` is given the
``Delete``, the ``Create``'s deliveries to the same inboxes that were never
attempted are settled ``superseded`` instead of sent. The ``Delete`` itself
is still sent everywhere (the receiver may know the object another way),
and to an inbox where the ``Create`` was already attempted it goes only
once that has left the queue, and every other delivery about the object
attempted there with it (``wait_again`` in ``store/queries.sql``). To an
inbox it leaves out, its host marked unavailable, it is not sent (a host
gone for good costs nothing more), but the ``Create``'s delivery never
attempted there is superseded all the same: otherwise it would go once the
host is seen again, and the ``Delete`` never. Where something it retracts
is still pending there, attempted or not, it is queued there after all
(:func:`pending_at`): what was attempted would otherwise be delivered by
its retries once the host answers, unretracted.

What a batch is about is kept when it is sent (:func:`about`): the
activity's ``id``, and its object's (``object`` as a string, or an object
with an ``id``). A ``Delete`` overtakes the batches about its object; an
``Undo``, those of the activity it undoes. Only the retraction's own
sender's: an ``Announce`` of the post by someone else goes as it was queued.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from django.db import transaction

from django_federation_delivery import signals
from django_federation_delivery.conf import database_alias
from django_federation_delivery.decide import Outcome
from django_federation_delivery.dialect import aware_now
from django_federation_delivery.models import Batch, Delivery, Retracts
from django_federation_delivery.settling import settled
from django_federation_delivery.store import retractions, settlements

__all__ = ["Retraction", "about", "overtake", "retraction_of"]

#: An id longer than this, in UTF-8, is not kept: what it identifies cannot
#: be overtaken (an index entry has its limits; no server mints such ids).
#: Nor is one holding a NUL, which no URL does and PostgreSQL cannot store.
MAX_ID_BYTES = 2000


def about(activity: Mapping[str, Any]) -> tuple[str, str]:
    """The activity's id and the id of its object, each "" when it has none
    (or one too long to keep, or holding a NUL)."""
    obj = activity.get("object")
    if isinstance(obj, Mapping):
        obj = obj.get("id")
    return _kept(activity.get("id")), _kept(obj)


def _kept(value: Any) -> str:
    if isinstance(value, str) and "\x00" not in value and len(value.encode()) <= MAX_ID_BYTES:
        return value
    return ""


@dataclasses.dataclass(frozen=True)
class Retraction:
    """What an activity takes back: an object (a ``Delete``'s) or an
    activity (an ``Undo``'s)."""

    object_id: str = ""
    activity_id: str = ""

    @property
    def retracts(self) -> Retracts:
        """What its batch is kept as retracting (its ``object_id`` says which)."""
        return Retracts.OBJECT if self.object_id else Retracts.ACTIVITY

    @property
    def reason(self) -> str:
        """The superseded deliveries' last error, as the admin shows it."""
        return retractions.REASONS[self.retracts]


def retraction_of(activity: Mapping[str, Any], object_id: str) -> Retraction | None:
    """What ``activity``, about ``object_id`` (see :func:`about`), retracts;
    None for any other activity."""
    if not object_id:
        return None
    kind = activity.get("type")
    # Only a type written as text is one: what else a sender wrote there
    # (an object, a number) names none, and is sent as it was given.
    given = kind if isinstance(kind, list | tuple) else [kind]
    types = {item for item in given if isinstance(item, str)}
    if "Delete" in types:
        return Retraction(object_id=object_id)
    if "Undo" in types:
        return Retraction(activity_id=object_id)
    return None


def overtake(
    sender: str,
    retraction: Retraction,
    *,
    batch: Batch | None,
    left_out: Sequence[str] = (),
    using: str | None = None,
) -> int:
    """In the caller's transaction, just after ``batch`` (the retraction,
    ``sender``'s) is written: supersede what it overtakes, and make it wait
    on what was already attempted. What it overtakes at ``left_out``, the
    inboxes it was given but not queued to (their host marked unavailable),
    is superseded too; with no ``batch``, when it was queued to none, that
    alone. Returns how many deliveries it superseded.

    ``delivery_settled`` (outcome "superseded") is sent for each, and
    ``batch_finished`` for each batch that finishes so, once the caller's
    transaction commits: rolled back, nothing was superseded.
    """
    overtaken = retractions.overtake(
        None if batch is None else batch.id,
        sender,
        object_id=retraction.object_id,
        activity_id=retraction.activity_id,
        left_out=left_out,
        reason=retraction.reason,
        now=aware_now(),
        using=using,
    )
    if overtaken.superseded and signals.listened(signals.delivery_settled):
        transaction.on_commit(lambda: _tell(sender, overtaken), using=using)
    if overtaken.finished:
        signals.batches_finished_on_commit(overtaken.finished, using=using)
    if retraction.activity_id and batch is not None:
        _restore_undone(sender, retraction.activity_id, batch, using=using)
    return len(overtaken.superseded)


def _restore_undone(sender: str, undone: str, batch: Batch, *, using: str | None) -> int:
    """An ``Undo`` (``batch``) of ``sender``'s ``Undo`` (``undone``): what
    that ``Undo`` superseded at the inboxes ``batch`` goes to (a ``Like``
    it took back before it was sent) is queued again, as the sender's state
    has it once more: the inner ``Undo`` itself was just superseded where
    it was never sent (or will be, claimed now and held back: the settle
    does the same then). One indexed query for any other ``Undo``."""
    alias = using or database_alias()
    taken_back = list(
        Batch.objects.using(alias)
        .filter(activity_id=undone, sender=sender, retracts=Retracts.ACTIVITY)
        .exclude(object_id="")
        .values_list("object_id", flat=True)
    )
    if not taken_back:
        return 0
    inboxes = Delivery.objects.using(alias).filter(batch=batch).values("inbox")
    return settlements.requeue_undone(sender, taken_back, inboxes, using=alias)


def lock_retracted(
    sender: str, retraction: Retraction, inboxes: Sequence[str], *, using: str | None = None
) -> None:
    """In the caller's transaction, before ``retraction`` (``sender``'s) is
    queued to ``inboxes``: lock what it will supersede there, lowest id
    first (PostgreSQL; see ``store.retractions.lock_retracted``)."""
    retractions.lock_retracted(
        sender,
        inboxes,
        object_id=retraction.object_id,
        activity_id=retraction.activity_id,
        now=aware_now(),
        using=using,
    )


def pending_at(
    sender: str, retraction: Retraction, inboxes: Sequence[str], *, using: str | None = None
) -> set[str]:
    """Which of ``inboxes`` something ``retraction`` (``sender``'s) takes
    back is still pending at: a retraction left out of them is queued there
    all the same (see ``send()``), or what was attempted there would be sent
    by its retries, once the host answers, and the retraction never."""
    return retractions.pending_at(
        sender,
        inboxes,
        object_id=retraction.object_id,
        activity_id=retraction.activity_id,
        using=using,
    )


def _tell(sender: str, overtaken: retractions.Overtaken) -> None:
    for row in overtaken.superseded:
        signals.send_safely(
            signals.delivery_settled,
            settled=settled(
                row,
                sender=sender,
                tag=overtaken.tags.get(row.batch_id, ""),
                event_type="",
                outcome=Outcome.SUPERSEDED,
                status=None,
            ),
        )
