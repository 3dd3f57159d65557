"""What a retraction writes: the deliveries it overtakes settled superseded,
and its own waiting on those already attempted.

A sender's ``Delete`` of an object, or ``Undo`` of an activity, is queued
like any activity (``queueing``); then, in the same transaction, the
deliveries of that sender's batches about the object (or of the activity)
to the retraction's inboxes are looked at. One never attempted and not held
by a claim is settled ``superseded``, unsent. One already attempted is left
to its fate, and the retraction's delivery to that inbox waits on it (the
last of them, if several), with no due time until it leaves the queue
(:func:`release_stranded` frees it if it left while the retraction was
being written). Released, it waits on the next of them still pending, if
any: the retraction's batch is kept with what it retracts (``retracts``),
every statement that releases a delivery says what its batch retracts
(``released_rows``), and a retraction's waits again (``wait_again``). A
retraction queued again, not sent (a replay's copy), overtakes nothing; it
waits as a requeued one does (:func:`wait_on_retracted`).

The inboxes the retraction was given but left out, their host marked
unavailable, are looked at first (:func:`pending_at`): where something it
retracts is still pending, it is queued all the same, and there it
supersedes and waits as anywhere, or what was attempted would go,
unretracted, by its retries once the host answers. At the others, what was
never attempted is superseded all the same, should any have been queued
since they were looked at.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import NamedTuple

from django.db import transaction

from django_federation_delivery.conf import database_alias
from django_federation_delivery.dialect import connection_for, db_datetime
from django_federation_delivery.models import Delivery, Retracts, Status
from django_federation_delivery.store import sql
from django_federation_delivery.store.countdowns import count_down
from django_federation_delivery.store.sequences import release_next

#: Stranded deliveries released by one statement.
STRANDED_CHUNK = 500

#: What a delivery a retraction superseded says it was (its last error,
#: as the admin shows it), by what the retraction takes back.
REASONS = {
    Retracts.OBJECT: "superseded: its object was deleted",
    Retracts.ACTIVITY: "superseded: the activity was undone",
}


class SupersededRow(NamedTuple):
    """A delivery a retraction superseded: an inbox's (retractions are
    activities), so of no webhook destination."""

    id: int
    batch_id: int
    inbox: str
    destination: str = ""


@dataclasses.dataclass(frozen=True)
class Overtaken:
    """What a retraction changed in the queue."""

    #: The deliveries it superseded, in id order.
    superseded: list[SupersededRow]
    #: The tags of the batches they were of, by id.
    tags: dict[int, str]
    #: How many of its own deliveries wait on one already attempted.
    waiting: int
    #: The batches it finished (their last pending delivery superseded).
    finished: list[int]


def overtake(
    batch_id: int | None,
    sender: str,
    *,
    object_id: str = "",
    activity_id: str = "",
    left_out: Sequence[str] = (),
    reason: str,
    now: dt.datetime,
    using: str | None = None,
) -> Overtaken:
    """In the caller's transaction, after batch ``batch_id`` (the retraction)
    is written: supersede the deliveries of ``sender``'s batches about
    ``object_id`` (or of ``activity_id``) to its inboxes that were never
    attempted, and make its deliveries wait on those that were. The same
    deliveries to ``left_out``, inboxes it was not queued to, are superseded
    too; ``batch_id`` is None when it was queued to none."""
    connection = connection_for(using or database_alias())
    when = db_datetime(now, connection)
    with sql.on(connection) as db:
        if batch_id is None:
            # Nothing was written first: on SQLite the write lock is taken
            # before the batches are read.
            db.lock_for_writing()
        # What it overtakes is every batch but its own; queued to none, it
        # has none, and no batch has the id 0.
        own = 0 if batch_id is None else batch_id
        if object_id:
            found = db.all("batches_about", about=object_id, sender=sender, batch=own)
        else:
            found = db.all("batches_of_activity", about=activity_id, sender=sender, batch=own)
        if not found:
            return Overtaken([], {}, 0, [])
        tags = {id: tag for id, tag in found}
        batches = db.ids(tags)
        superseding = {
            "batches": batches,
            "superseded": str(Status.SUPERSEDED),
            "now": when,
            "reason": reason,
        }
        found_rows: list[tuple[int, int, str]] = []
        if left_out:
            given = list(left_out)
            if db.postgresql:
                db.all("lock_superseded", batches=batches, now=when, inboxes=given)
            found_rows += db.all(
                "supersede_left_out",
                inboxes=given if db.postgresql else json.dumps(given),
                **superseding,
            )
        # On PostgreSQL the retraction's inboxes (and its deliveries' ids)
        # are read first and given as lists (see supersede in queries.sql);
        # SQLite reads them in each statement.
        mine: dict[str, int] = {}
        inboxes: dict[str, object] = {"batch": batch_id}
        if batch_id is not None:
            if db.postgresql:
                mine = {inbox: id for id, inbox in db.all("inboxes_of", batch=batch_id)}
                inboxes = {"inboxes": list(mine)}
                db.all("lock_superseded", batches=batches, now=when, **inboxes)
            found_rows += db.all("supersede", **superseding, **inboxes)
        rows = sorted(SupersededRow(*row) for row in found_rows)
        # Those queued after a superseded one in its sequence go on without
        # it (the retraction's own among them), before the retraction is
        # made to wait on what was attempted.
        release_next([row.id for row in rows], now, using)
        # Queued to none, it has nothing to make wait.
        waiting = 0
        if batch_id is not None and not db.postgresql:
            waiting = db.run("wait_for_attempted", batches=batches, batch=batch_id)
        elif batch_id is not None:
            # Each of its deliveries, by id, with the one it is to wait on.
            waits = [
                (mine[inbox], last)
                for inbox, last in db.all("attempted_before", batches=batches, **inboxes)
            ]
            if waits:
                waiting = db.run(
                    "wait_for_attempted",
                    ids=db.ids(id for id, _ in waits),
                    lasts=db.ids(last for _, last in waits),
                )
    finished = count_down(Counter(row.batch_id for row in rows), now, using)
    return Overtaken(rows, tags, waiting, finished)


def lock_retracted(
    sender: str,
    inboxes: Sequence[str],
    *,
    object_id: str = "",
    activity_id: str = "",
    now: dt.datetime,
    using: str | None = None,
) -> None:
    """On PostgreSQL, in the caller's transaction, before the retraction is
    queued: lock, lowest id first, what :func:`overtake` will supersede at
    ``inboxes``. Queued first, the retraction would lock the last delivery
    of its sequence (an ``Update`` waiting on the ``Create``) before the
    ``Create``, the opposite of an operator's give-up of that ``Create``,
    which then releases the ``Update``: a deadlock, the send ended."""
    connection = connection_for(using or database_alias())
    with sql.on(connection) as db:
        if not db.postgresql or not inboxes:
            return
        if object_id:
            found = db.all("batches_about", about=object_id, sender=sender, batch=0)
        else:
            found = db.all("batches_of_activity", about=activity_id, sender=sender, batch=0)
        if found:
            db.all(
                "lock_superseded",
                batches=db.ids(id for id, _ in found),
                now=db_datetime(now, connection),
                inboxes=list(inboxes),
            )


def pending_at(
    sender: str,
    inboxes: Sequence[str],
    *,
    object_id: str = "",
    activity_id: str = "",
    using: str | None = None,
) -> set[str]:
    """Which of ``inboxes`` a delivery of ``sender``'s batches about
    ``object_id`` (or of ``activity_id``) is still pending at, attempted or
    not: where a retraction left out of them still has something to retract."""
    connection = connection_for(using or database_alias())
    with sql.on(connection) as db:
        # Read in the caller's transaction, which then writes the retraction:
        # on SQLite, it takes the write lock first (a read before it would
        # let a web process's write in between, and its own write fail).
        db.lock_for_writing()
        if object_id:
            found = db.all("batches_about", about=object_id, sender=sender, batch=0)
        else:
            found = db.all("batches_of_activity", about=activity_id, sender=sender, batch=0)
        if not found:
            return set()
        given = list(inboxes)
        rows = db.all(
            "retracted_pending_at",
            batches=db.ids(id for id, _ in found),
            inboxes=given if db.postgresql else json.dumps(given),
        )
    return {inbox for (inbox,) in rows}


REPLAY_KEY_PREFIX = sql.REPLAY_KEY_PREFIX
REPLAY_TAG_PREFIX = sql.REPLAY_TAG_PREFIX


def retracted_since(rows: Sequence[tuple[int, int, str]], *, using: str | None = None) -> set[int]:
    """Of ``rows`` (each a delivery's id, batch and inbox), those a later
    retraction of their batch's sender took back: a Delete of its object,
    an Undo of it, whether it went to their inbox or left it out (a host
    unavailable then, an audience narrowed), unless it was taken back
    itself there: superseded there (undone before it went), or, leaving
    it out, undone since. Sent again, a deleted post's ``Create`` would
    land after its ``Delete``, or bring back a post its inbox never had.
    Read as lists, a few statements however many rows: looked up a row at
    a time, statistics of many small batches had each row read the
    retraction's whole batch."""
    if not rows:
        return set()
    connection = connection_for(using or database_alias())
    with sql.on(connection) as db:
        later, retractions, undone = _later_retractions(db, {batch for _, batch, _ in rows})
        if not later:
            return set()
        inboxes = sorted({inbox for _, batch, inbox in rows if batch in later})
        superseded = {
            (batch, inbox): bool(gone)
            for batch, inbox, gone in db.all(
                "retraction_rows_at",
                batches=db.ids(retractions),
                inboxes=inboxes if db.postgresql else json.dumps(inboxes),
                superseded=str(Status.SUPERSEDED),
            )
        }
    return {
        id
        for id, batch, inbox in rows
        if any(
            not superseded.get((retraction, inbox), retraction in undone)
            for retraction in later.get(batch, ())
        )
    }


def retracted_at_host(batches: Iterable[int], host: str, *, using: str | None = None) -> set[int]:
    """Of ``batches``, those a later retraction of their sender took back at
    ``host`` (as :func:`retracted_since` says it of an inbox: sent there or
    not, unless superseded at every inbox of the host it went to, or,
    leaving the host out, undone since). A few statements however many."""
    connection = connection_for(using or database_alias())
    with sql.on(connection) as db:
        later, retractions, undone = _later_retractions(db, set(batches))
        if not later:
            return set()
        superseded = {
            id: bool(gone)
            for id, gone in db.all(
                "retraction_rows_at_host",
                batches=db.ids(retractions),
                host=host,
                superseded=str(Status.SUPERSEDED),
            )
        }
    return {
        batch
        for batch, ids in later.items()
        if any(not superseded.get(id, id in undone) for id in ids)
    }


def _later_retractions(
    db: sql.Statements, batches: set[int]
) -> tuple[dict[int, list[int]], list[int], set[int]]:
    """For each of ``batches`` that has any, the later batches of its
    sender that take it back (``retractions_since``); all of those, in id
    order; and those of them a later Undo of their sender took back."""
    later: dict[int, list[int]] = {}
    if batches:
        for batch, retraction in db.all(
            "retractions_since", batches=db.ids(sorted(batches)), **_NOT_REPLAYS
        ):
            later.setdefault(batch, []).append(retraction)
    if not later:
        return later, [], set()
    retractions = sorted({id for ids in later.values() for id in ids})
    undone = {id for (id,) in db.all("undone_retractions", ids=db.ids(retractions), **_NOT_REPLAYS)}
    return later, retractions, undone


#: What the statements that look for retractions leave out: a replay's copies.
_NOT_REPLAYS = {"replay_key": f"{REPLAY_KEY_PREFIX}%", "replay_tag": f"{REPLAY_TAG_PREFIX}%"}


def wait_on_retracted(batch_ids: Sequence[int], *, using: str | None = None) -> int:
    """In the caller's transaction, make the new deliveries of ``batch_ids``
    (retractions queued again, not sent: a replay's copies, which overtake
    nothing) that wait on nothing wait, as a requeued retraction's do, on
    the last delivery still pending to their inbox of what they retract
    (``wait_again``, as a release makes a retraction's wait). Two
    statements however many. Returns how many now wait."""
    if not batch_ids:
        return 0
    alias = using or database_alias()
    ids = list(
        Delivery.objects.using(alias)
        .filter(batch_id__in=batch_ids, settled_at__isnull=True, after__isnull=True)
        .values_list("id", flat=True)
    )
    if not ids:
        return 0
    with sql.on(connection_for(alias)) as db:
        return db.wait_again(ids)


def retracted_held(db: sql.Statements, ids: Sequence[int]) -> dict[int, str]:
    """Of the deliveries ``ids``, held back without a request by the
    deliverer that claims them, those never attempted that a retraction
    queued since waits to follow (see ``retracted_held`` in queries.sql),
    each with the reason it is superseded for. A retraction leaves what a
    deliverer has claimed to it: one the deliverer then sent would go
    before the retraction, and one it held back, unsent, is superseded as
    the retraction would have.

    Read with ``db`` in the transaction that settles them, after the write
    lock is taken on SQLite. On PostgreSQL, a retraction that commits while
    this is read is not seen: the delivery it left to its claim then goes
    before it. Locking one against the other was tried: a retraction that
    waits for a settle's row lock while holding a key-share lock on a row
    that settle locks next (its delivery waiting on it) deadlocks."""
    if not ids:
        return {}
    db.lock_for_writing()
    rows = db.all("retracted_held", ids=db.ids(ids))
    return {id: REASONS[Retracts(retracts)] for id, retracts in rows}


def release_stranded(*, now: dt.datetime, using: str | None = None) -> int:
    """Release the pending deliveries waiting on one no longer pending: a
    retraction may have made one wait on a delivery whose settle was being
    written at that moment, and so did not see it. Returns how many.

    A chunk is released in one transaction: a retraction's is made to wait
    again (``Statements.released``) before anyone else can see it due."""
    alias = using or database_alias()
    connection = connection_for(alias)
    released = 0
    while True:
        with transaction.atomic(using=alias), sql.on(connection) as db:
            db.lock_for_writing()  # on SQLite, before its read: see pending_at
            ids = [id for (id,) in db.all("stranded", limit=STRANDED_CHUNK)]
            if ids:
                released += len(db.release("release", db.ids(ids), db_datetime(now, connection)))
        if len(ids) < STRANDED_CHUNK:
            return released
