"""What a delivery's leaving the queue writes: a settlement of its attempt,
its giving up, or its coming back on an operator's requeue; with it, its
batch's count-down (countdowns.py) and the history's count (history.py).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import logging
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from django.db import DatabaseError, OperationalError, transaction
from django.db.models import Exists, OuterRef, QuerySet

from django_federation_delivery.conf import database_alias
from django_federation_delivery.dialect import (
    aware,
    aware_now,
    connection_for,
    db_datetime,
    orm_datetime,
)
from django_federation_delivery.models import Batch, Delivery, Retracts, Status
from django_federation_delivery.store import history, retractions, sql, wakes
from django_federation_delivery.store.claims import Claimed
from django_federation_delivery.store.countdowns import count_down, count_up
from django_federation_delivery.store.locks import again_on_deadlock, lock_hosts, write_first
from django_federation_delivery.store.queueing import CHUNK
from django_federation_delivery.store.sequences import (
    lock_sequences_of,
    promote_requeued,
    release_next,
)

logger = logging.getLogger(__name__)

#: The statuses that take a delivery out of the queue.
FINAL = frozenset(
    {Status.DELIVERED, Status.REFUSED, Status.SKIPPED, Status.FAILED, Status.SUPERSEDED}
)


#: The statuses whose ``delivery_failed`` the loop tells before it writes.
TOLD_FAILED = frozenset({Status.REFUSED, Status.FAILED})


@dataclasses.dataclass(frozen=True)
class Settlement:
    """What to write for a claimed delivery once an attempt is over.

    ``status`` pending with a ``due_at`` is a retry; any other status takes
    the delivery out of the queue.
    """

    claimed: Claimed
    status: Status
    attempts: int
    due_at: dt.datetime | None = None
    last_status: int | None = None
    last_error: str = ""
    attempted_at: dt.datetime | None = None
    #: Whether its batch has an ordering key, so that settling it may
    #: release the next of its sequence.
    ordered: bool = False
    #: A pending one's attempt failed and is to be tried again: counted as
    #: retried in the history (one held unsent by a breaker or a pause is not).
    retried: bool = False
    #: What the deliverer's summary counted it as ("held", "retrying", …;
    #: "" for none): what it is taken off if it is written otherwise.
    counted: str = ""


#: For each delivery whose write met a database that could not write (an
#: error :func:`cannot_write_now` knows), the times that write wrote: it may
#: have committed, its answer lost with the connection.
Tried = dict[int, list[dt.datetime]]


def settle(
    settlements: Sequence[Settlement],
    *,
    on_finished: Callable[[list[int]], None] | None = None,
    on_failed_instead: Callable[[Settlement], None] | None = None,
    on_superseded: Callable[[list[Settlement]], None] | None = None,
    on_busy: Callable[[list[Settlement]], None] | None = None,
    using: str | None = None,
    tried: Tried | None = None,
) -> set[int]:
    """Write the outcome of each settlement whose claim still is held, in one
    transaction.

    Returns the ids written; a settlement whose lease lapsed and whose row
    another process now holds is not written. The deliveries that waited on
    one written final are released (the next of its sequence, a retraction
    overtaking it); batches whose last pending delivery this settles are
    stamped finished, and ``on_finished`` is called with their ids once the
    transaction has committed, never inside it: a receiver of the signal it
    sends that meets a database error (and marks the transaction for
    rollback, even if it catches the error) would otherwise undo the whole
    settle, which would still be reported written. The rows lock in one
    order whatever the database: deliveries, those released, then batches in
    id order (on PostgreSQL, those of more than one delivery: the one
    delivery of any other is locked already), then the history's minute
    (see :meth:`~.sql.Statements.settle` for what each database runs).

    On PostgreSQL the statement adds to the history too, and fails as a
    whole when that cannot be written: the settle is then written again,
    its history added in a savepoint of its own, whose failure is logged.

    A settlement the database refuses (a value it cannot store: any
    :class:`~django.db.DatabaseError` but one of a database that cannot
    write now, :func:`cannot_write_now`, which is raised) holds back none
    of those written with it: they are then written one by one, and the one refused is
    written failed, with an error that names the refusal, not the value;
    refused again, it is logged and left to its lease. Once that failure is
    committed, ``on_failed_instead`` is given it (the settlement as
    written), unless what was refused was a failure already: its
    ``delivery_failed`` was told before the write.

    A write that meets the database unable to write is raised, and, with
    ``tried`` (the caller's, kept between its writes), noted there: it may
    have committed, its answer lost; so is one interrupted (any other
    exception, a ``KeyboardInterrupt``). Written again, such a settlement finds
    its claim gone; if it was the earlier write that committed (its rows
    settled, their batch finished, at the time it wrote), the batches it
    finished are given to ``on_finished`` then, which that write could not.

    A delivery held back without a request (pending again, its attempt
    made none) that was never attempted and that a retraction sent since
    waits to follow is written superseded instead (the retraction left it
    to its claim: :func:`.retractions.retracted_held`); once committed,
    ``on_superseded`` is given those, as written.

    On PostgreSQL, an ordered delivery that another transaction holds (a
    send making its next wait on it, in a view's transaction still open) is
    not written, nor waited for: ``on_busy`` is given those, to be written
    again later, while their claim holds.
    """
    if not settlements:
        return set()
    now = aware_now()
    superseded: list[Settlement] = []
    try:
        settled, superseded = _written(settlements, now, using)
    except DatabaseError as exc:
        if cannot_write_now(exc):
            if tried is not None:
                for item in settlements:
                    tried.setdefault(item.claimed.id, []).append(now)
            raise
        if len(settlements) == 1:
            settled, instead = _refused(settlements[0], exc, now, using)
            if instead is not None and on_failed_instead is not None:
                on_failed_instead(instead)
        else:
            logger.warning(
                "Settling %d deliveries together was refused (%s); settling them one by one",
                len(settlements),
                _named(exc),
            )
            written: set[int] = set()
            for item in settlements:
                written |= settle(
                    [item],
                    on_finished=on_finished,
                    on_failed_instead=on_failed_instead,
                    on_superseded=on_superseded,
                    on_busy=on_busy,
                    using=using,
                    tried=tried,
                )
            return written
    except BaseException:
        # Interrupted (an error of the caller's, not the database's): it may
        # have committed too, and is noted as a write whose answer was lost.
        if tried is not None:
            for item in settlements:
                tried.setdefault(item.claimed.id, []).append(now)
        raise
    # Committed: what is told now cannot undo it.
    superseded = [item for item in superseded if item.claimed.id in settled.written]
    if settled.busy and on_busy is not None:
        on_busy([item for item in settlements if item.claimed.id in settled.busy])
    try:
        if superseded and on_superseded is not None:
            on_superseded(superseded)
    finally:
        # Even when what it tells is interrupted (a receiver let a
        # KeyboardInterrupt through): written again, it would find its claim
        # gone, and the batches it finished would never be told.
        if settled.finished and on_finished is not None:
            on_finished(settled.finished)
    if any(_due_again(item, now) for item in settlements if item.claimed.id in settled.written):
        # Put back due now (a stopping deliverer's hand-back): for any
        # deliverer to take, each woken as by a send.
        wakes.wake_all(using or database_alias())
    if tried:
        for id in settled.written:
            tried.pop(id, None)
        unanswered = {
            item.claimed.id: tried[item.claimed.id]
            for item in settlements
            if item.claimed.id in tried
        }
        if unanswered:
            # A read the database may fail: raised, what it was to read is
            # kept in ``tried`` for the write tried again to read.
            found = finished_unanswered(unanswered, using)
            for id in unanswered:
                tried.pop(id, None)
            if found and on_finished is not None:
                on_finished(found)
    return settled.written


def finished_unanswered(unanswered: Tried, using: str | None) -> list[int]:
    """The batches an earlier write of the deliveries ``unanswered`` finished
    and committed, its answer lost: their rows settled, and their batch
    finished, at one of the times that write was tried."""
    alias = using or database_alias()
    rows = Delivery.objects.using(alias).filter(
        id__in=list(unanswered), lease_token__isnull=True, settled_at__isnull=False
    )
    times: dict[int, set[dt.datetime]] = {}
    for id, batch_id, settled_at in rows.values_list("id", "batch_id", "settled_at"):
        if settled_at is not None and aware(settled_at) in unanswered[id]:
            times.setdefault(batch_id, set()).add(aware(settled_at))
    if not times:
        return []
    batches = Batch.objects.using(alias).filter(id__in=list(times), finished_at__isnull=False)
    return sorted(
        id
        for id, finished_at in batches.values_list("id", "finished_at")
        if finished_at is not None and aware(finished_at) in times[id]
    )


def _due_again(item: Settlement, now: dt.datetime) -> bool:
    return item.status == Status.PENDING and item.due_at is not None and item.due_at <= now


def _written(
    settlements: Sequence[Settlement], now: dt.datetime, using: str | None
) -> tuple[sql.Settled, list[Settlement]]:
    """Write ``settlements``, adding to the history in the same statement
    where the database can, and apart from it when that fails. Returns
    what was written, and the settlements written superseded instead."""
    try:
        return _settle(settlements, now, using, count=True)
    except _NotWritten as failed:
        logger.warning(
            "Settling in one statement failed (%s); settling without the history",
            _named(failed.__cause__),
        )
        return _settle(settlements, now, using, count=False)


def _refused(
    item: Settlement, error: DatabaseError, now: dt.datetime, using: str | None
) -> tuple[sql.Settled, Settlement | None]:
    """Write failed the settlement the database refused to store: its
    attempts kept, its error and status told no more (the value refused
    may be either). Not written if that is refused too: left to its lease.
    Returns what was written, and the failure written instead of an outcome
    that was no failure (None if there is none to tell)."""
    failed = dataclasses.replace(
        item,
        status=Status.FAILED,
        due_at=None,
        last_status=None,
        last_error=f"the database refused its outcome ({_named(error)})",
        retried=False,
    )
    try:
        settled, _ = _written([failed], now, using)
    except DatabaseError as again:
        if cannot_write_now(again):
            raise
        logger.error(
            "Delivery %d could not be settled (%s), nor failed (%s): left to its lease",
            item.claimed.id,
            _named(error),
            _named(again),
        )
        return sql.Settled(set(), [], False), None
    if item.claimed.id not in settled.written:
        return settled, None
    logger.error(
        "Delivery %d could not be settled (%s): failed instead", item.claimed.id, _named(error)
    )
    return settled, None if item.status in TOLD_FAILED else failed


#: The SQLSTATE classes of a database that can write nothing now, whatever
#: the values: its connection (08), its transaction's state (25: a server
#: that takes no writes, as one does for a moment in a failover), a
#: transaction rolled back (40), its resources (53), an operator (57), the
#: system (58). Only some are OperationalErrors; 25006 is an InternalError.
CANNOT_WRITE_NOW = frozenset({"08", "25", "40", "53", "57", "58"})


def cannot_write_now(error: DatabaseError) -> bool:
    """Whether ``error`` says the database cannot write now (to be written
    again once it can), not that it refused a value."""
    if isinstance(error, OperationalError):
        return True
    code = getattr(error.__cause__, "sqlstate", None)
    return isinstance(code, str) and code[:2] in CANNOT_WRITE_NOW


def _named(error: BaseException | None) -> str:
    """A database's error by its class and SQLSTATE, not its text: that may
    quote the statement, tokens and all, or the value refused."""
    code = getattr(getattr(error, "__cause__", None), "sqlstate", None)
    return type(error).__name__ if code is None else f"{type(error).__name__}, SQLSTATE {code}"


class _NotWritten(Exception):
    """A settle's statement failed, and wrote nothing; not for want of a
    database (:func:`cannot_write_now`)."""


def _settle(
    settlements: Sequence[Settlement],
    now: dt.datetime,
    using: str | None,
    *,
    count: bool,
) -> tuple[sql.Settled, list[Settlement]]:
    connection = connection_for(using)
    # In id order, the order every other writer of many rows (a give-up, a
    # requeue) locks them in: the outbox's order is the order answers came.
    settlements = sorted(settlements, key=lambda item: item.claimed.id)
    settled_at = db_datetime(now, connection)
    superseded: list[Settlement] = []
    with transaction.atomic(using=using):
        with sql.on(connection) as db:
            try:
                held = [item.claimed.id for item in settlements if _held_unsent(item)]
                if held:
                    reasons = retractions.retracted_held(db, held)
                    settlements = [_superseded(item, reasons) for item in settlements]
                    superseded = [item for item in settlements if item.claimed.id in reasons]
                final = {s.claimed.id: s.claimed.batch_id for s in settlements if s.status in FINAL}
                ordered = sorted(
                    s.claimed.id for s in settlements if s.ordered and s.status in FINAL
                )
                settled = db.settle(
                    _rows(settlements, now, settled_at, connection),
                    final=final,
                    ordered=ordered,
                    now=settled_at,
                    count=count,
                )
            except DatabaseError as exc:
                # A database that is away is no reason to write it again.
                if cannot_write_now(exc) or not count:
                    raise
                if not sql.counts_while_settling(connection):
                    raise
                raise _NotWritten from exc
            if superseded:
                _undone_held(superseded, using)
        if not settled.counted:
            history.record(_history_of(settlements, settled.written, now), using=using)
    return settled, superseded


def _undone_held(superseded: Sequence[Settlement], using: str | None) -> None:
    """Of the held-back deliveries just superseded, the ``Undo``'s (an
    ``Undo`` of it waits to follow): what each took back at its inbox is
    queued again, as when that ``Undo`` is superseded as it is sent
    (:func:`requeue_undone`). One query, none but when one was superseded."""
    alias = using or database_alias()
    undos = {
        id: (sender, object_id)
        for id, sender, object_id in Batch.objects.using(alias)
        .filter(id__in={item.claimed.batch_id for item in superseded}, retracts=Retracts.ACTIVITY)
        .values_list("id", "sender", "object_id")
    }
    for item in superseded:
        # Only an Undo undone (superseded by an Undo of it): one a Delete of
        # what it undid superseded takes nothing back to send again.
        undone = item.last_error == retractions.REASONS[Retracts.ACTIVITY]
        if undone and item.claimed.batch_id in undos:
            sender, taken_back = undos[item.claimed.batch_id]
            requeue_undone(sender, [taken_back], [item.claimed.inbox], using=alias)


def requeue_undone(
    sender: str, taken_back: Sequence[str], inboxes: Any, *, using: str | None = None
) -> int:
    """What ``sender``'s ``Undo`` of each of ``taken_back`` (activities' ids)
    superseded at ``inboxes`` (a list, or a query of them), never sent,
    queued again, in the caller's transaction: that ``Undo`` was itself
    undone (an ``Undo`` of the ``Undo``) before it was sent, and the
    receiver would otherwise never hear of what the sender has again (a
    ``Like``). Returns how many."""
    alias = using or database_alias()
    rows = Delivery.objects.using(alias).filter(
        batch__sender=sender,
        batch__activity_id__in=list(taken_back),
        status=Status.SUPERSEDED,
        last_error=retractions.REASONS[Retracts.ACTIVITY],
        inbox__in=inboxes,
    )
    ids = sorted(rows.values_list("id", flat=True))
    return sum(
        requeue_rows(ids[start : start + CHUNK], using=alias) for start in range(0, len(ids), CHUNK)
    )


def _held_unsent(item: Settlement) -> bool:
    """Whether ``item`` is an inbox's delivery put back without a request."""
    return (
        item.status == Status.PENDING and item.attempted_at is None and not item.claimed.destination
    )


def _superseded(item: Settlement, reasons: dict[int, str]) -> Settlement:
    """``item`` written superseded, if ``reasons`` gives it a reason to be."""
    reason = reasons.get(item.claimed.id)
    if reason is None:
        return item
    return dataclasses.replace(
        item, status=Status.SUPERSEDED, due_at=None, last_error=reason, retried=False
    )


def _rows(
    settlements: Sequence[Settlement], now: dt.datetime, settled_at: Any, connection: Any
) -> list[list[Any]]:
    """The values :meth:`.sql.Statements.settle` writes, a row a settlement."""
    rows: list[list[Any]] = []
    for item, (minute, name) in zip(settlements, _counted_rows(settlements, now), strict=True):
        leaves = item.status in FINAL
        rows.append(
            [
                item.claimed.id,
                item.claimed.token,
                str(item.status),
                item.attempts,
                None if leaves else db_datetime(item.due_at, connection),
                item.last_status,
                item.last_error,
                db_datetime(item.attempted_at, connection),
                settled_at if leaves else None,
                db_datetime(minute, connection),
                name,
            ]
        )
    return rows


def _counted_rows(
    settlements: Sequence[Settlement], now: dt.datetime
) -> list[tuple[dt.datetime, str | None]]:
    """For each settlement, the history's minute and count it adds to if it
    is written (the count None for one that adds nothing)."""
    return [
        (
            history.minute_of(item.attempted_at or now),
            "retried" if item.retried else _COUNTED.get(item.status),
        )
        for item in settlements
    ]


#: The history's count of each status a settlement leaves a delivery in.
_COUNTED = {
    Status.DELIVERED: "delivered",
    Status.REFUSED: "refused",
    Status.FAILED: "failed",
}


def _history_of(
    settlements: Sequence[Settlement], written: set[int], now: dt.datetime
) -> dict[dt.datetime, dict[str, int]]:
    """What the written settlements add to the history, in the minute of
    each attempt (or of the write, for one given up unsent)."""
    counts: dict[dt.datetime, dict[str, int]] = {}
    for item, (minute, name) in zip(settlements, _counted_rows(settlements, now), strict=True):
        if name is not None and item.claimed.id in written:
            counted = counts.setdefault(minute, {})
            counted[name] = counted.get(name, 0) + 1
    return counts


class GivenUp(NamedTuple):
    """A delivery :func:`give_up_rows` failed: what its signal tells."""

    id: int
    batch_id: int
    inbox: str
    last_status: int | None
    destination: str


def give_up_rows(
    ids: Sequence[int],
    reason: str,
    *,
    on_failing: Callable[[list[GivenUp]], None] | None = None,
    on_finished: Callable[[list[int]], None] | None = None,
    using: str | None = None,
    unheld: bool = False,
) -> list[int]:
    """Fail pending deliveries for good, whoever holds them: a holder's late
    outcome is fenced out, as its token is gone (``unheld``: those no claim
    holds as this writes, alone). Returns the ids failed.

    ``on_failing`` is called with exactly the rows this changed, and
    ``on_finished`` with the batches this finished, inside the transaction
    once they are written: a row another process settled in the meantime is
    not among them. Each reads there what it tells, and tells it once the
    transaction commits (``transaction.on_commit``): never inside it, where
    a receiver's database error would undo the write; and a read that meets
    the database away fails the give-up, not the telling of what it wrote.
    """
    if not ids:
        return []
    alias = using or database_alias()
    return again_on_deadlock(
        alias, lambda: _give_up_rows(ids, reason, on_failing, on_finished, alias, unheld)
    )


def _give_up_rows(
    ids: Sequence[int],
    reason: str,
    on_failing: Callable[[list[GivenUp]], None] | None,
    on_finished: Callable[[list[int]], None] | None,
    alias: str,
    unheld: bool,
) -> list[int]:
    connection = connection_for(alias)
    now = aware_now()
    with transaction.atomic(using=alias):
        # Their sequences before their rows, as a requeue and a send take
        # them: a requeue of the one before at that moment otherwise chained
        # the next to one this gave up, and left the next beside it.
        lock_sequences_of(ids, alias)
        with sql.on(connection) as db:
            if db.postgresql:
                # Lowest id first, as every writer of many rows locks them:
                # its UPDATE locks them in its plan's order, and deadlocked
                # with a Delete superseding the same rows.
                db.all("lock_deliveries", ids=db.ids(sorted(ids)))
            # One statement that both picks and changes the rows: what it
            # returns is what it changed, whatever another process did a
            # moment before.
            given_up = db.all(
                "give_up",
                failed=str(Status.FAILED),
                now=db_datetime(now, connection),
                reason=reason,
                ids=db.ids(ids),
                unheld=unheld,
            )
            rows = sorted(GivenUp(*row) for row in given_up)
        failed = [row.id for row in rows]
        release_next(failed, now, alias)
        finished = count_down(Counter(row.batch_id for row in rows), now, alias)
        history.record({now: {"failed": len(rows)}}, using=alias)
        if rows and on_failing is not None:
            on_failing(rows)
        if finished and on_finished is not None:
            on_finished(finished)
    return failed


def requeue_rows(ids: Sequence[int], *, using: str | None = None) -> int:
    """Put settled deliveries back in the queue, due now; their attempts so far
    are kept. Returns how many. One given up while an attempt was in flight
    is due no sooner than that attempt's lease ends: never sent twice at once.
    One to a paused host is held, as a send to it is, until the host is
    resumed (and then, no sooner than that lease ends either).

    What a later retraction of its sender, queued to the same inbox, took
    back is left as it is: sent again, a deleted post's ``Create`` would
    land after its ``Delete``. What a requeued delivery waited on before is
    forgotten (it left, or is left to its fate), but one with an ordering
    key waits again on the last delivery of its sequence queued before it
    still pending (``wait_in_sequence``), and a retraction's on what it
    retracts still pending there (``wait_again``), keeping the time it was
    due to be released no sooner (``not_before``). It takes its place
    again: the next of its sequence, unless attempted already, waits on
    it, no longer on the one before it (``next_in_sequence``).

    One whose batch's deadline has passed is left as it is too: requeued,
    it would be failed again at once, unsent."""
    alias = using or database_alias()
    return again_on_deadlock(alias, lambda: _requeue_rows(ids, alias))


def _requeue_rows(ids: Sequence[int], alias: str) -> int:
    now = aware_now()
    manager = Delivery.objects.using(alias)
    with transaction.atomic(using=alias):
        write_first(alias)  # SQLite locks no row a read selects for update
        # Before the rows, as a send takes them before it writes its own.
        lock_sequences_of(ids, alias)
        found = list(
            manager.select_for_update()
            .filter(id__in=list(ids), status__in=list(FINAL - {Status.DELIVERED}))
            .exclude(Exists(_overdue(now, alias)))
            # Locked lowest first, as every other writer of many rows locks them.
            .order_by("id")
            .values_list("id", "batch_id", "host", "inbox")
        )
        # Not one a later retraction of its sender was sent to its inbox.
        retracted = retractions.retracted_since(
            [(id, batch_id, inbox) for id, batch_id, _, inbox in found], using=alias
        )
        rows = [(id, batch_id, host) for id, batch_id, host, _ in found if id not in retracted]
        requeued = [id for id, _, _ in rows]
        if requeued:
            # Their paused hosts locked, as a resume locks them: one resuming
            # meanwhile is waited for, and seen resumed (requeued reads the
            # pause); one resuming after waits, then releases what is held.
            lock_hosts({host for _, _, host in rows}, alias, paused=True)
            connection = connection_for(alias)
            with sql.on(connection) as db:
                db.run("requeue", ids=db.ids(requeued), now=db_datetime(now, connection))
                # The next of each one's sequence, which took its place when it
                # left, waits on it again, or on one requeued with it after it.
                after = [id for (id,) in db.all("next_in_sequence", ids=db.ids(requeued))]
                db.run("wait_in_sequence", ids=db.ids([*requeued, *after]))
                db.wait_again(requeued)
            # Back in their batch's lane, but for one that a delivery of a
            # sooner lane now waits on again (a direct message in its key);
            # and what one of a sooner lane waits on again taken into it.
            promote_requeued(requeued, alias)
        count_up(Counter(batch_id for _, batch_id, _ in rows), alias)
    wakes.wake_all(alias)
    return len(rows)


def _overdue(now: dt.datetime, alias: str) -> QuerySet[Batch]:
    """The outer delivery's batch, if its deadline has passed by ``now``."""
    return Batch.objects.filter(pk=OuterRef("batch_id"), deadline__lte=orm_datetime(now, alias))
