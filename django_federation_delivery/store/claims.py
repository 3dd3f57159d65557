"""The claim and its lease, and what is due when.

On PostgreSQL a claim locks with ``FOR UPDATE SKIP LOCKED``, so any number of
processes share one queue, and takes every lane's share in one ``UPDATE …
RETURNING``, a transaction of its own. On SQLite one write lock serves
instead: the claim reads each lane's candidates, picks among them, and takes
what it picked, the reads coming back as one JSON value each (see
``_take_sqlite``).
"""

from __future__ import annotations

import collections
import dataclasses
import datetime as dt
import json
import uuid
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

from django.db import DEFAULT_DB_ALIAS, transaction
from django.utils import timezone

from django_federation_delivery.dialect import (
    connection_for,
    db_datetime,
    id_array,
    ids_among,
    is_postgresql,
    lock_for_writing,
    quoted_table,
    read_datetime,
    skip_locked,
)
from django_federation_delivery.models import Batch, Delivery, Lane, Status

#: Lanes in the order they are claimed; the low lane only when nothing else is due.
CLAIM_ORDER = (Lane.WEBHOOK, Lane.PRIORITY, Lane.NORMAL, Lane.LOW)
#: How many due rows a claim looks at for each it takes, so that a few hosts
#: at the head of the queue do not leave it short.
CANDIDATES = 4
#: The most hosts a claim names, to leave out or to take alone.
MOST_HOSTS = 200


@dataclasses.dataclass(frozen=True)
class Claimed:
    """A delivery this process holds, until its lease lapses."""

    id: int
    batch_id: int
    inbox: str
    host: str
    attempts: int
    via: tuple[str, ...]
    token: str
    #: When the lease lapses, as ``time.time()``.
    leased_until: float
    #: A webhook's destination, by name; "" for an inbox.
    destination: str = ""


def claim(
    limit: int,
    lease: float,
    *,
    per_host: int | None = None,
    exclude_hosts: Iterable[str] = (),
    only_hosts: Iterable[str] = (),
    using: str | None = None,
) -> list[Claimed]:
    """Take up to ``limit`` due deliveries for ``lease`` seconds, lane by lane,
    in one transaction, and at most ``per_host`` to any one host; none to
    ``exclude_hosts``, and, if ``only_hosts`` names any, to those alone.

    The claim pushes each row's due time forward by the lease and stamps it
    with a fresh token: only the holder of the token may settle it, and a row
    whose holder died comes due again when the lease lapses. Taking no more
    to a host than can be sent to it soon keeps one busy host's backlog from
    waiting out its lease in a single process, and leaves it to the others.
    """
    connection = connection_for(using)
    excluded = sorted(set(exclude_hosts))[:MOST_HOSTS]
    only = sorted(set(only_hosts) - set(excluded))[:MOST_HOSTS]
    if only_hosts and not only:
        return []
    now = timezone.now()
    token = uuid.uuid4().hex
    take = _take_postgresql if is_postgresql(connection) else _take_sqlite
    wanted = _Wanted(
        limit=limit,
        cap=per_host or limit,
        now=db_datetime(now, connection),
        until=db_datetime(now + dt.timedelta(seconds=lease), connection),
        token=token,
        excluded=excluded,
        only=only,
    )
    if take is _take_postgresql:
        # One statement: a transaction by itself (or a part of the caller's).
        with connection.cursor() as cursor:
            rows = take(cursor, connection, wanted)
    else:
        with transaction.atomic(using=using), connection.cursor() as cursor:
            rows = take(cursor, connection, wanted)
    # The lease as written (from before the claim), not from now: never later.
    expires = now.timestamp() + lease
    return [
        Claimed(row[0], row[1], row[2], row[3], row[4], _json_list(row[5]), token, expires, row[6])
        for row in rows
    ]


#: What a claim gives back of each row.
CLAIMED_COLUMNS = "id, batch_id, inbox, host, attempts, via, destination"


def _due(connection: Any, columns: str, *, only: bool, limit: str = "%s") -> str:
    """A lane's oldest due rows, none to the hosts left out (a parameter) and,
    with ``only``, to the hosts named (another), as many as ``limit`` says.
    The hosts are one parameter each, so that the statement's text is the
    same whatever their number."""
    if is_postgresql(connection):
        hosts = " AND NOT (host = ANY(%s))" + (" AND host = ANY(%s)" if only else "")
    else:
        hosts = " AND host NOT IN (SELECT value FROM json_each(%s))"
        hosts += " AND host IN (SELECT value FROM json_each(%s))" if only else ""
    # The status is written out, not a parameter: the statement is then the
    # partial index's to use whatever is bound, and SQLite need not prepare
    # it again each time to find that out. The index's own order: SQLite's
    # ends with the id, PostgreSQL's with where the row is (sorting by id as
    # well there made a million pending rows cost a third more a claim).
    order = "due_at" if is_postgresql(connection) else "due_at, id"
    return (
        f"SELECT {columns} FROM {quoted_table(Delivery, connection)} "
        f"WHERE status = '{Status.PENDING}' AND lane = %s AND due_at <= %s{hosts} "
        f"ORDER BY {order} LIMIT {limit}{skip_locked(connection)}"
    )


class _Wanted(NamedTuple):
    """What a claim asks for, as its statements' parameters."""

    limit: int
    #: The most to one host.
    cap: int
    now: Any
    #: The lease's end, the rows' due time once taken.
    until: Any
    token: str
    excluded: list[str]
    only: list[str]


def _take_postgresql(cursor: Any, connection: Any, wanted: _Wanted) -> list[Any]:
    """Every lane's share in one statement: each lane's candidates locked
    (passing those another process holds), in the room the lanes before it
    leave of ``limit × CANDIDATES``, so that a later lane's rows are not even
    locked while an earlier one has enough; then the first ``cap`` of each
    host among them taken, lane by lane. One round trip, where a statement a
    lane in a transaction made five."""
    table = quoted_table(Delivery, connection)
    only = bool(wanted.only)
    hosts: list[Any] = [wanted.excluded, wanted.only] if only else [wanted.excluded]
    budget = wanted.limit * CANDIDATES
    lanes: list[str] = []
    params: list[Any] = []  # the CTEs', which come first in the text
    for rank, lane in enumerate(CLAIM_ORDER):
        earlier = "".join(f" - (SELECT COUNT(*) FROM lane{n})" for n in range(rank))
        limit = f"GREATEST(0, %s{earlier})"
        columns = f"id, host, due_at, {rank} AS rank"
        lanes.append(f"lane{rank} AS ({_due(connection, columns, only=only, limit=limit)})")
        params += [lane, wanted.now, *hosts, budget]
    candidates = " UNION ALL ".join(f"SELECT * FROM lane{n}" for n in range(len(CLAIM_ORDER)))
    taken = (
        "SELECT id FROM (SELECT id, rank, due_at, ROW_NUMBER() OVER (PARTITION BY host "
        f"ORDER BY rank, due_at, id) AS turn FROM ({candidates}) AS candidates) AS ranked "
        "WHERE turn <= %s ORDER BY rank, due_at, id LIMIT %s"
    )
    # The rows taken are looked up by id: as a join, the planner may hash
    # its guess of their number against a scan of the table.
    sql = (
        f"WITH {', '.join(lanes)} "
        f"UPDATE {table} SET due_at = %s, lease_token = %s WHERE {ids_among(taken, connection)} "
        f"RETURNING {CLAIMED_COLUMNS}, lane"
    )
    cursor.execute(sql, [*params, wanted.until, wanted.token, wanted.cap, wanted.limit])
    order = {lane: rank for rank, lane in enumerate(CLAIM_ORDER)}
    # RETURNING gives no order: the lanes' and, within each, the queue's.
    return [row[:-1] for row in sorted(cursor.fetchall(), key=lambda row: (order[row[-1]], row[0]))]


def _take_sqlite(cursor: Any, connection: Any, wanted: _Wanted) -> list[Any]:
    """Each lane's candidates read as one value, the first ``cap`` of each
    host among them picked here, then the rows picked read and taken, each
    in one statement for every lane.

    Each row a statement gives back is a step of its own, and each step hands
    the interpreter to the worker threads and waits to get it back; SQLite
    ranks by a window function several times slower than this picks. The
    transaction holds the write lock from the start, so what is read is still
    due when it is taken.
    """
    table = quoted_table(Delivery, connection)
    lock_for_writing(cursor, connection, table)
    candidates = (
        "SELECT json_group_array(json_array(id, host)) "
        f"FROM ({_due(connection, 'id, host', only=bool(wanted.only))})"
    )
    hosts = [json.dumps(wanted.excluded)]
    if wanted.only:
        hosts.append(json.dumps(wanted.only))
    picked: list[int] = []
    # PER_HOST holds across the lanes of one claim, as on PostgreSQL.
    taken: collections.Counter[str] = collections.Counter()
    for lane in CLAIM_ORDER:
        if len(picked) >= wanted.limit:
            break
        room = wanted.limit - len(picked)
        cursor.execute(candidates, [lane, wanted.now, *hosts, room * CANDIDATES])
        lane_picked = []
        for id, host in json.loads(cursor.fetchone()[0]):
            if taken[host] < wanted.cap:
                taken[host] += 1
                lane_picked.append(id)
                if len(lane_picked) >= room:
                    break
        # The queue's order within each lane.
        picked += sorted(lane_picked)
    if not picked:
        return []
    ids = json.dumps(picked)
    cursor.execute(
        f"SELECT json_group_array(json_array({CLAIMED_COLUMNS.replace('via', 'json(via)')})) "
        f"FROM {table} WHERE id IN (SELECT value FROM json_each(%s))",
        [ids],
    )
    order = {id: n for n, id in enumerate(picked)}
    rows = sorted(json.loads(cursor.fetchone()[0]), key=lambda row: order[row[0]])
    cursor.execute(
        f"UPDATE {table} SET due_at = %s, lease_token = %s "
        "WHERE id IN (SELECT value FROM json_each(%s))",
        [wanted.until, wanted.token, ids],
    )
    return rows


def _json_list(value: Any) -> tuple[str, ...]:
    # Text on both (Django reads PostgreSQL's JSON as text too), or the value itself.
    if value is None or value == "[]" or value == b"[]":
        return ()  # the usual inbox, with no gateways: nothing to parse
    if isinstance(value, str | bytes):
        value = json.loads(value)
    return tuple(value or ())


class BatchInfo(NamedTuple):
    """What the loop keeps of a claimed delivery's batch while its deliveries
    are sent: the columns it sends and settles by, not a model (a stream of
    one-inbox sends reads a batch for every delivery)."""

    id: int
    sender: str
    #: The activity, or a webhook's event, as sent.
    body: bytes
    body_sha256: str
    tag: str
    deadline: dt.datetime | None
    max_attempts: int | None
    synchronize_collection: bool
    #: Whether it has an ordering key, whose next delivery its settling releases.
    ordered: bool
    #: A webhook event's type; "" for an activity.
    event_type: str = ""


#: What :func:`batches` reads, in :class:`BatchInfo`'s order.
BATCH_COLUMNS = (
    "id, sender, body, body_sha256, tag, deadline, max_attempts, synchronize_collection, "
    "ordering_key, event_type"
)


def batches(ids: Iterable[int], *, using: str | None = None) -> dict[int, BatchInfo]:
    """The batches of claimed deliveries, by id; one deleted meanwhile is missing."""
    wanted = sorted(set(ids))
    if not wanted:
        return {}
    connection = connection_for(using)
    table = quoted_table(Batch, connection)
    with connection.cursor() as cursor:
        if is_postgresql(connection):
            cursor.execute(
                f"SELECT {BATCH_COLUMNS} FROM {table} WHERE id = ANY(%s::bigint[])",
                [id_array(wanted)],
            )
            return {row[0]: _batch(row, connection) for row in cursor.fetchall()}
        # SQLite: read as one value, as a claim's rows are (see _take_sqlite).
        cursor.execute(
            f"SELECT json_group_array(json_array({BATCH_COLUMNS})) FROM {table} "
            "WHERE id IN (SELECT value FROM json_each(%s))",
            [json.dumps(wanted)],
        )
        found = json.loads(cursor.fetchone()[0])
    return {row[0]: _batch(row, connection) for row in found}


def _batch(row: Sequence[Any], connection: Any) -> BatchInfo:
    id, sender, body, digest, tag, deadline, most, synchronize, ordering_key, event_type = row
    return BatchInfo(
        id,
        sender,
        body.encode(),
        digest,
        tag,
        read_datetime(deadline, connection),
        most,
        bool(synchronize),
        bool(ordering_key),
        event_type,
    )


def next_due(*, using: str | None = None) -> dt.datetime | None:
    """When the next pending delivery comes due, in any lane (one index read a
    lane, in one statement)."""
    connection = connection_for(using)
    table = quoted_table(Delivery, connection)
    earliest = ", ".join(
        f"(SELECT MIN(due_at) FROM {table} WHERE status = '{Status.PENDING}' AND lane = %s)"
        for _ in CLAIM_ORDER
    )
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT {earliest}", list(CLAIM_ORDER))
        times = cursor.fetchone()
    known = [at for at in (read_datetime(value, connection) for value in times) if at]
    return min(known) if known else None


def count_due(*, using: str | None = None) -> int:
    """How many pending deliveries are due now (the partial index, lane by lane)."""
    manager = Delivery.objects.using(using or DEFAULT_DB_ALIAS)
    now = timezone.now()
    return sum(
        manager.filter(status=Status.PENDING, lane=lane, due_at__lte=now).count()
        for lane in CLAIM_ORDER
    )


def has_due(*, since: dt.datetime | None = None, using: str | None = None) -> bool:
    """Whether anything is due now (that came due after ``since``, if given):
    the cheap check for work queued elsewhere, an index look a lane in one
    statement, asked every NEW_WORK_POLL_SECONDS by an idle deliverer that
    has no LISTEN."""
    connection = connection_for(using)
    table = quoted_table(Delivery, connection)
    after = " AND due_at > %s" if since is not None else ""
    any_due = " OR ".join(
        f"EXISTS (SELECT 1 FROM {table} WHERE status = '{Status.PENDING}' AND lane = %s "
        f"AND due_at <= %s{after})"
        for _ in CLAIM_ORDER
    )
    now = db_datetime(timezone.now(), connection)
    bounds = [now] if since is None else [now, db_datetime(since, connection)]
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT {any_due}", [v for lane in CLAIM_ORDER for v in (lane, *bounds)])
        return bool(cursor.fetchone()[0])
