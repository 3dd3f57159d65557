"""What a delivery's leaving the queue writes: a settlement of its attempt,
its giving up, or its coming back on an operator's requeue; with it, its
batch's count-down (countdowns.py) and the history's count (history.py).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import logging
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from django.db import DEFAULT_DB_ALIAS, DatabaseError, OperationalError, transaction
from django.db.models import F
from django.utils import timezone

from django_federation_delivery import wakeup
from django_federation_delivery.dialect import (
    connection_for,
    db_datetime,
    id_array,
    is_postgresql,
    json_parameter,
    json_rows,
    lock_for_writing,
    quoted_table,
)
from django_federation_delivery.models import Batch, Delivery, Status
from django_federation_delivery.store import history
from django_federation_delivery.store.claims import Claimed
from django_federation_delivery.store.countdowns import count_down, count_down_set
from django_federation_delivery.store.sequences import release_next

logger = logging.getLogger(__name__)

#: The statuses that take a delivery out of the queue.
FINAL = frozenset({Status.DELIVERED, Status.REFUSED, Status.SKIPPED, Status.FAILED})


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


def settle(
    settlements: Sequence[Settlement],
    *,
    on_finished: Callable[[list[int]], None] | None = None,
    using: str | None = None,
) -> set[int]:
    """Write the outcome of each settlement whose claim is still held, in one
    transaction.

    Returns the ids written; a settlement whose lease lapsed and whose row
    another process now holds is not written. Batches whose last pending
    delivery this settles are stamped finished, and ``on_finished`` is called
    with their ids inside the same transaction.

    On PostgreSQL all of it is one statement (see :func:`_settle_at_once`),
    but for settlements of ordered batches, which release the next of their
    sequences, and for a statement that fails: then it is written a step at
    a time, as on SQLite.
    """
    if not settlements:
        return set()
    connection = connection_for(using)
    now = timezone.now()
    settled_at = db_datetime(now, connection)
    values: list[list[Any]] = []
    for item in settlements:
        final = item.status in FINAL
        values.append(
            [
                item.claimed.id,
                item.claimed.token,
                str(item.status),
                item.attempts,
                None if final else db_datetime(item.due_at, connection),
                item.last_status,
                item.last_error,
                db_datetime(item.attempted_at, connection),
                settled_at if final else None,
            ]
        )
    if is_postgresql(connection) and not any(item.ordered for item in settlements):
        written = _settle_at_once(settlements, values, now, on_finished, using)
        if written is not None:
            return written
    with transaction.atomic(using=using):
        with connection.cursor() as cursor:
            written = _write_settlements(cursor, connection, values)
        final_rows = [s for s in settlements if s.status in FINAL and s.claimed.id in written]
        release_next([s.claimed.id for s in final_rows if s.ordered], now, using)
        # Batches before the history, as the one statement takes their locks.
        finished = count_down(Counter(s.claimed.batch_id for s in final_rows), now, using)
        history.record(_history_of(settlements, written, now), using=using)
        if finished and on_finished is not None:
            on_finished(finished)
    return written


def _settle_at_once(
    settlements: Sequence[Settlement],
    values: list[list[Any]],
    now: dt.datetime,
    on_finished: Callable[[list[int]], None] | None,
    using: str | None,
) -> set[int] | None:
    """PostgreSQL: write the settlements ``values``, count their batches down
    and add them to the history in one statement; then ``on_finished``, in
    the same transaction. Three round trips (with ``BEGIN`` and ``COMMIT``)
    where a step at a time takes eight.

    The rows it writes lock as :func:`settle`'s steps lock them: deliveries,
    then batches in id order, then the history's minute. Returns the ids
    written, or None when the statement failed and wrote nothing (a history
    that cannot be written, say): the caller then goes a step at a time. An
    error after it, or one of a database that is away, is raised.
    """
    connection = connection_for(using)
    rows = [
        [*row, minute, name]
        for row, (minute, name) in zip(values, _counted_rows(settlements, now), strict=True)
    ]
    delivery = quoted_table(Delivery, connection)
    batch = quoted_table(Batch, connection)
    # Every table is read by an index on ids given as arrays, never by a
    # join the planner orders from its statistics: a table emptied and
    # filled since it was last analyzed is "one row" to it, and a join
    # through all of it at every settle then costs ten times the rest.
    # The batches of the final settlements are locked in id order first
    # (``l``, which ``b`` waits for); ``c`` counts those written.
    leaving = id_array(
        sorted({item.claimed.batch_id for item in settlements if item.status in FINAL})
    )
    sql = (
        f"WITH v AS ({json_rows(AT_ONCE, connection)}), "
        f"s AS ({_updated_by_id(delivery)} "
        f"RETURNING {delivery}.id, {delivery}.batch_id, v.settled_at, v.minute, v.counted), "
        f"c AS (SELECT batch_id AS id, count(*) AS n FROM s WHERE settled_at IS NOT NULL "
        f"GROUP BY batch_id), "
        f"l AS MATERIALIZED (SELECT id FROM {batch} WHERE id = ANY(%s::bigint[]) "
        f"ORDER BY id FOR UPDATE), "
        f"b AS (UPDATE {batch} SET {count_down_set(batch, 'c')} FROM c "
        f"WHERE {batch}.id = ANY(%s::bigint[]) AND {batch}.id = c.id "
        f"AND {batch}.finished_at IS NULL AND (SELECT count(*) FROM l) >= 0 "
        f"RETURNING {batch}.id, {batch}.remaining), "
        f"h AS ({history.upsert_counted('s', connection)}) "
        "SELECT ARRAY(SELECT id FROM s), ARRAY(SELECT id FROM b WHERE remaining = 0 ORDER BY id)"
    )
    params = [
        json_parameter(rows),
        id_array(row[0] for row in rows),
        leaving,
        db_datetime(now, connection),
        leaving,
    ]
    written_out = False
    try:
        with transaction.atomic(using=using):
            with connection.cursor() as cursor:
                cursor.execute(sql, params)
                written, finished = cursor.fetchone()
            written_out = True
            if finished and on_finished is not None:
                on_finished(finished)
    except DatabaseError as exc:
        if written_out or isinstance(exc, OperationalError):
            raise
        # Its class and code, not its text: that may quote the statement, tokens and all.
        logger.warning(
            "Settling in one statement failed (%s, SQLSTATE %s); settling a step at a time",
            type(exc).__name__,
            getattr(exc.__cause__, "sqlstate", None),
        )
        return None
    return set(written)


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


#: A settlement's columns, in the order of its values, and their types.
SETTLED = (
    ("id", "bigint"),
    ("token", "varchar"),
    ("status", "varchar"),
    ("attempts", "integer"),
    ("due_at", "timestamptz"),
    ("last_status", "integer"),
    ("last_error", "text"),
    ("attempted_at", "timestamptz"),
    ("settled_at", "timestamptz"),
)
#: What the one statement of :func:`_settle_at_once` takes of each: a
#: settlement's columns, then the minute and name of its history count.
AT_ONCE = (*SETTLED, ("minute", "timestamptz"), ("counted", "varchar"))

#: What a settlement sets (``v`` its values).
_SETTLE_SET = (
    "status = v.status, attempts = v.attempts, due_at = v.due_at, lease_token = NULL, "
    "last_status = v.last_status, last_error = v.last_error, "
    "last_attempt_at = COALESCE(v.attempted_at, last_attempt_at), settled_at = v.settled_at"
)


def _updated_by_id(table: str) -> str:
    """PostgreSQL: the ``UPDATE`` of a settlement's row from ``v``, found by
    its id in the array that is the statement's next parameter. Told only
    that ``v`` has some rows, the planner may hash them against a scan of
    the whole table; an array's length it knows."""
    return (
        f"UPDATE {table} SET {_SETTLE_SET} FROM v WHERE {table}.id = ANY(%s::bigint[]) "
        f"AND {table}.id = v.id AND {table}.lease_token = v.token"
    )


def _write_settlements(cursor: Any, connection: Any, rows: list[list[Any]]) -> set[int]:
    """Write the settlements ``rows`` (SETTLED's columns each); return the ids
    of those whose claim still held.

    The rows are one JSON parameter: the same statement for any number of
    rows, prepared once, with one value to bind. On SQLite the ids that still
    hold their claim are read first, as one value, then written: each row
    ``RETURNING`` gives back is an sqlite3 step of its own, and each step
    hands the interpreter to the worker threads and waits to get it back.
    The transaction holds the write lock, so nothing changes in between.
    """
    table = quoted_table(Delivery, connection)
    given = json_parameter(rows)
    matched = f"{table}.id = v.id AND {table}.lease_token = v.token"
    update = (
        f"WITH v AS ({json_rows(SETTLED, connection)}) UPDATE {table} SET {_SETTLE_SET} "
        f"FROM v WHERE {matched}"
    )
    if is_postgresql(connection):
        cursor.execute(
            f"WITH v AS ({json_rows(SETTLED, connection)}) {_updated_by_id(table)} "
            f"RETURNING {table}.id",
            [given, id_array(row[0] for row in rows)],
        )
        return {row[0] for row in cursor.fetchall()}
    lock_for_writing(cursor, connection, table)
    cursor.execute(
        f"SELECT json_group_array({table}.id) FROM ({json_rows(SETTLED, connection)}) AS v "
        f"CROSS JOIN {table} WHERE {matched}",
        [given],
    )
    written = set(json.loads(cursor.fetchone()[0]))
    if written:
        cursor.execute(update, [given])
    return written


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
) -> list[int]:
    """Fail pending deliveries for good, whoever holds them: a holder's late
    outcome is fenced out, as its token is gone. Returns the ids failed.

    ``on_failing`` is called with exactly the rows this changed, inside the
    transaction, before it commits: a row another process settled in the
    meantime is not among them, and a crash before the commit leaves the
    rows pending, to be given up (and told about) again.
    """
    if not ids:
        return []
    alias = using or DEFAULT_DB_ALIAS
    connection = connection_for(alias)
    table = quoted_table(Delivery, connection)
    now = timezone.now()
    # One statement that both picks and changes the rows: what it returns is
    # what it changed, whatever another process did a moment before.
    sql = (
        f"UPDATE {table} SET status = %s, due_at = NULL, lease_token = NULL, "
        f"settled_at = %s, last_error = %s WHERE status = %s "
        f"AND id IN ({', '.join(['%s'] * len(ids))}) "
        "RETURNING id, batch_id, inbox, last_status, destination"
    )
    params = [str(Status.FAILED), db_datetime(now, connection), reason, str(Status.PENDING)]
    with transaction.atomic(using=alias):
        with connection.cursor() as cursor:
            cursor.execute(sql, [*params, *ids])
            rows = sorted(GivenUp(*row) for row in cursor.fetchall())
        if rows and on_failing is not None:
            on_failing(rows)
        failed = [row.id for row in rows]
        release_next(failed, now, alias)
        finished = count_down(Counter(row.batch_id for row in rows), now, alias)
        history.record({now: {"failed": len(rows)}}, using=alias)
        if finished and on_finished is not None:
            on_finished(finished)
    return failed


def requeue_rows(ids: Sequence[int], *, using: str | None = None) -> int:
    """Put settled deliveries back in the queue, due now; their attempts so far
    are kept. Returns how many."""
    alias = using or DEFAULT_DB_ALIAS
    now = timezone.now()
    manager = Delivery.objects.using(alias)
    with transaction.atomic(using=alias):
        rows = list(
            manager.select_for_update()
            .filter(id__in=list(ids), status__in=list(FINAL - {Status.DELIVERED}))
            .values_list("id", "batch_id")
        )
        manager.filter(id__in=[id for id, _ in rows]).update(
            status=Status.PENDING, due_at=now, lease_token=None, settled_at=None
        )
        for batch_id, count in Counter(batch_id for _, batch_id in rows).items():
            Batch.objects.using(alias).filter(id=batch_id).update(
                remaining=F("remaining") + count, finished_at=None
            )
    transaction.on_commit(wakeup.notify_local, using=alias)
    return len(rows)
