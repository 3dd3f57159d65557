"""Ordered deliveries: those of one ordering key reach each inbox in the
order they were queued.

A new delivery waits on the last one still pending in its sequence, with no
due time, and is released, due at once, when that one leaves the queue.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
from collections.abc import Iterable, Sequence

from django.core.exceptions import ImproperlyConfigured

from django_federation_delivery.dialect import (
    aware_now,
    connection_for,
    db_datetime,
    is_postgresql,
)
from django_federation_delivery.models import Delivery
from django_federation_delivery.store import sql
from django_federation_delivery.store.claims import CLAIM_ORDER

#: Deliveries :func:`chain` makes wait in one statement on PostgreSQL.
CHAIN_CHUNK = 500
#: The most inboxes :func:`lock_sequences` locks one by one.
MOST_LOCKED = 64


def sequence_of(ordering_key: str, inbox: str) -> str:
    """The sequence an ordered delivery belongs to: its key, for its inbox."""
    if not ordering_key:
        return ""
    return hashlib.sha256(f"{ordering_key}\n{inbox}".encode()).hexdigest()


def last_of_sequences(
    ordering_key: str,
    batch_id: int | None,
    inboxes: Iterable[str],
    alias: str,
    *,
    lanes: dict[int, str] | None = None,
) -> dict[str, int]:
    """For each inbox, the last pending delivery queued before with the same
    ordering key (not of batch ``batch_id``), which the new one is to wait on;
    on PostgreSQL, each one's lane in ``lanes`` (if given), read as it is locked.

    Found by the highest pending id of each sequence, one indexed look however
    long its backlog (a webhook destination after an outage). On PostgreSQL
    that row is locked until the caller commits, so that its settling
    meanwhile waits and then sees, and releases, its successor; one settled
    between the look and the lock is looked past.
    """
    if not ordering_key:
        return {}
    by_sequence = {sequence_of(ordering_key, inbox): inbox for inbox in inboxes}
    connection = connection_for(alias)
    locks = connection.features.has_select_for_update
    last: dict[str, int] = {}
    sequences = list(by_sequence)
    with sql.on(connection) as db:
        for start in range(0, len(sequences), 500):
            todo = sequences[start : start + 500]
            while todo:
                given = todo if db.postgresql else json.dumps(todo)
                found = {
                    sequence: id
                    for sequence, id in db.all(
                        "last_of_sequences", sequences=given, batch=batch_id or 0
                    )
                    if id is not None
                }
                held = set(found.values())
                if locks and found:
                    locked = dict(
                        Delivery.objects.using(alias)
                        .select_for_update()
                        # Pending as settled_at says it (see queries.sql): as
                        # the status, the due index was read, every pending row.
                        .filter(id__in=list(found.values()), settled_at__isnull=True)
                        # Lowest id first, as every writer of many rows locks
                        # them (a settle's lock_free_deliveries): in the plan's
                        # order, it deadlocked with a settle of the same rows.
                        .order_by("id")
                        .values_list("id", "lane")
                    )
                    held = set(locked)
                    if lanes is not None:
                        lanes.update(locked)
                for sequence, id in found.items():
                    if id in held:
                        last[by_sequence[sequence]] = id
                # What settled in between: look again for what is pending before it.
                todo = [sequence for sequence, id in found.items() if id not in held]
    return last


def release_next(settled: Sequence[int], now: dt.datetime, using: str | None) -> None:
    """Make due the deliveries that waited on ``settled`` ones: one read of
    the index on after_id, however long the sequences (``release_next``); a
    retraction's waits again if what it retracts is still pending there.
    Due ``now``, but no sooner than the end of the lease of one given up
    while its attempt was in flight (``released_due``)."""
    if not settled:
        return
    connection = connection_for(using)
    with sql.on(connection) as db:
        db.release_next(settled, db_datetime(now, connection))


def promote(waited_on: Iterable[int], lane: str, alias: str) -> int:
    """Take the deliveries ``waited_on`` by a new one in ``lane``, and what
    they wait on in turn while pending, into that lane where theirs is
    claimed after it (:data:`~.claims.CLAIM_ORDER`): one claimed later would
    hold the new one back as long, whatever its own lane. A direct message
    sent in the key of a fan-out waits on the fan-out's delivery to its
    inbox, which is then claimed as soon as the message would be. Returns
    how many were taken."""
    ids = sorted(set(waited_on))
    lanes = later_lanes(lane)
    if not ids or not lanes:
        return 0
    connection = connection_for(alias)
    with sql.on(connection) as db:
        given = lanes if db.postgresql else json.dumps(lanes)
        now = db_datetime(aware_now(), connection)
        return db.run("promote", ids=db.ids(ids), lane=str(lane), lanes=given, now=now)


def promote_requeued(ids: Sequence[int], alias: str) -> None:
    """Take each of ``ids`` (requeued, its lane its batch's again) into the
    lane of the soonest pending delivery that now waits on it, if sooner,
    and what each now waits on into its own lane, as a send takes it
    (:func:`promote`): a direct message requeued after the fan-out it waits
    on goes as soon as it would sent again."""
    if not ids:
        return
    connection = connection_for(alias)
    taken: dict[str, set[int]] = {}
    with sql.on(connection) as db:
        for id, lane in db.all("waiters_of", ids=db.ids(ids)):
            taken.setdefault(lane, set()).add(id)
        for after_id, lane in db.all("waited_on_by", ids=db.ids(ids)):
            taken.setdefault(lane, set()).add(after_id)
    # The soonest first: a later lane's takes none of those back.
    for lane in CLAIM_ORDER:
        if lane in taken:
            promote(taken[lane], lane, alias)


def later_lanes(lane: str) -> list[str]:
    """The lanes claimed after ``lane``."""
    return [str(later) for later in CLAIM_ORDER[CLAIM_ORDER.index(lane) + 1 :]]


def chain(batch_ids: Sequence[int], alias: str) -> int:
    """Make each delivery of ``batch_ids`` that has a sequence wait on the
    one written before it in that sequence among them: what each would have
    looked up had it been queued after the other had committed: one
    statement on SQLite; on PostgreSQL a read, then a write a chunk of
    :data:`CHAIN_CHUNK` given lists. Returns how many now wait."""
    if not batch_ids:
        return 0
    connection = connection_for(alias)
    with sql.on(connection) as db:
        if not db.postgresql:
            return db.run("chain", ids=db.ids(batch_ids))
        pairs = db.all("chain_pairs", ids=db.ids(batch_ids))
        for start in range(0, len(pairs), CHAIN_CHUNK):
            ids, befores = zip(*pairs[start : start + CHAIN_CHUNK], strict=True)
            db.run("chain", ids=db.ids(ids), befores=db.ids(befores))
        return len(pairs)


def lock_sequences(ordering_key: str, inboxes: Iterable[str], alias: str) -> None:
    """On PostgreSQL, queue to each of ``inboxes`` in ``ordering_key`` one
    transaction at a time, until commit: two sends at once would otherwise both
    wait on the same earlier delivery, and be sent side by side. (SQLite writes
    one at a time.)

    One statement: the key's own lock, shared, then each inbox's, exclusive;
    or, past :data:`MOST_LOCKED` inboxes, the key's own lock exclusive
    alone, which excludes every send in the key: a fan-out takes one lock,
    not one an inbox (the server's lock table holds a few thousand).
    """
    connection = connection_for(alias)
    if not ordering_key or not is_postgresql(connection):
        return
    inboxes = set(inboxes)
    if not inboxes:
        return
    whole = _lock_key(ordering_key)
    if len(inboxes) > MOST_LOCKED:
        keys, shared = [whole], [False]
    else:
        # In one order, whoever takes them: two sends never deadlock on them.
        each = sorted({_lock_key(sequence_of(ordering_key, inbox)) for inbox in inboxes})
        keys, shared = [whole, *each], [True] + [False] * len(each)
    with sql.on(connection) as db:
        ((isolation, _),) = db.all("lock_sequences", keys=db.ids(keys), shared=shared)
    if isolation not in ("read committed", "read uncommitted"):
        # Set where the check (E021) does not look: ALTER DATABASE … SET,
        # a role's default, SET in the caller's session.
        raise ImproperlyConfigured(
            f"a send with an ordering key needs READ COMMITTED; the queue's database "
            f"{alias!r} runs this transaction at {isolation.upper()}, and sends in one "
            f"sequence at once would not wait on each other"
        )


def lock_sequences_of(ids: Iterable[int], alias: str) -> None:
    """On PostgreSQL, the sequences of the deliveries ``ids`` (requeued)
    locked as a send locks its own (:func:`lock_sequences`), each key in
    turn, before any of their rows is: a send in one of them committing
    meanwhile would otherwise not see them, nor they it, and go beside
    them. (SQLite writes one at a time.)"""
    if not is_postgresql(connection_for(alias)):
        return
    keyed = (
        Delivery.objects.using(alias)
        .filter(id__in=list(ids))
        .exclude(sequence="")
        .values_list("batch__ordering_key", "inbox")
    )
    inboxes: dict[str, set[str]] = {}
    for key, inbox in keyed:
        inboxes.setdefault(key, set()).add(inbox)
    for key in sorted(inboxes):
        lock_sequences(key, inboxes[key], alias)


def _lock_key(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big", signed=True)
