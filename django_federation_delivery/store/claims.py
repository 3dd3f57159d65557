"""The claim and its lease, and what is due when.

On PostgreSQL a claim locks with ``FOR UPDATE SKIP LOCKED``, so any number of
processes share one queue; on SQLite the same claim is a single ``UPDATE …
RETURNING`` statement, which SQLite runs under its one write lock.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import uuid
from collections.abc import Iterable
from typing import Any, NamedTuple

from django.db import DEFAULT_DB_ALIAS, transaction
from django.db.models import Min
from django.utils import timezone

from django_federation_delivery.dialect import (
    connection_for,
    db_datetime,
    quoted_table,
    skip_locked,
)
from django_federation_delivery.models import Batch, Delivery, Lane, Status

#: Lanes in the order they are claimed; the low lane only when nothing else is due.
CLAIM_ORDER = (Lane.PRIORITY, Lane.NORMAL, Lane.LOW)
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
    table = quoted_table(Delivery, connection)
    excluded = sorted(set(exclude_hosts))[:MOST_HOSTS]
    only = sorted(set(only_hosts) - set(excluded))[:MOST_HOSTS]
    if only_hosts and not only:
        return []
    lock = skip_locked(connection)
    hosts = f" AND host NOT IN ({', '.join(['%s'] * len(excluded))})" if excluded else ""
    if only:
        hosts += f" AND host IN ({', '.join(['%s'] * len(only))})"
    # The oldest due rows of the lane, then the first few of each host among them.
    candidates = (
        f"SELECT id, host, due_at FROM {table} WHERE status = %s AND lane = %s "
        f"AND due_at <= %s{hosts} ORDER BY due_at LIMIT %s{lock}"
    )
    ranked = (
        "SELECT id, due_at, ROW_NUMBER() OVER (PARTITION BY host ORDER BY due_at, id) AS turn "
        f"FROM ({candidates}) AS candidates"
    )
    sql = (
        f"UPDATE {table} SET due_at = %s, lease_token = %s WHERE id IN ("
        f"SELECT id FROM ({ranked}) AS ranked WHERE turn <= %s ORDER BY due_at, id LIMIT %s) "
        "RETURNING id, batch_id, inbox, host, attempts, via"
    )
    now = timezone.now()
    token = uuid.uuid4().hex
    until = db_datetime(now + dt.timedelta(seconds=lease), connection)
    cap = per_host or limit
    rows: list[Any] = []
    with transaction.atomic(using=using), connection.cursor() as cursor:
        for lane in CLAIM_ORDER:
            if len(rows) >= limit:
                break
            wanted = limit - len(rows)
            params = [until, token, Status.PENDING, lane, db_datetime(now, connection)]
            params += [*excluded, *only]
            cursor.execute(sql, [*params, wanted * CANDIDATES, cap, wanted])
            # RETURNING gives no order; keep the queue's within each lane.
            rows.extend(sorted(cursor.fetchall(), key=lambda row: row[0]))
    # The lease as written (from before the claim), not from now: never later.
    expires = now.timestamp() + lease
    return [
        Claimed(row[0], row[1], row[2], row[3], row[4], _json_list(row[5]), token, expires)
        for row in rows
    ]


def _json_list(value: Any) -> tuple[str, ...]:
    # SQLite hands JSON back as text, psycopg as the value itself.
    if isinstance(value, str | bytes):
        value = json.loads(value)
    return tuple(value or ())


class BatchRow(NamedTuple):
    """What the loop reads of a claimed delivery's batch: the columns it
    sends and settles by, not a model (a stream of one-inbox sends reads a
    batch for every delivery)."""

    id: int
    sender: str
    body: str
    body_sha256: str
    tag: str
    deadline: dt.datetime | None
    max_attempts: int | None
    synchronize_collection: bool
    ordering_key: str
    event_type: str


def batches(ids: Iterable[int], *, using: str | None = None) -> dict[int, BatchRow]:
    """The batches of claimed deliveries, by id; one deleted meanwhile is missing."""
    rows = (
        Batch.objects.using(using or DEFAULT_DB_ALIAS)
        .filter(id__in=list(ids))
        .values_list(*BatchRow._fields)
    )
    return {row[0]: BatchRow(*row) for row in rows}


def next_due(*, using: str | None = None) -> dt.datetime | None:
    """When the next pending delivery comes due, in any lane (one index read a lane)."""
    manager = Delivery.objects.using(using or DEFAULT_DB_ALIAS)
    times = [
        manager.filter(status=Status.PENDING, lane=lane).aggregate(at=Min("due_at"))["at"]
        for lane in CLAIM_ORDER
    ]
    known = [at for at in times if at is not None]
    return min(known) if known else None


def count_due(*, using: str | None = None) -> int:
    """How many pending deliveries are due now (the partial index, lane by lane)."""
    manager = Delivery.objects.using(using or DEFAULT_DB_ALIAS)
    now = timezone.now()
    return sum(
        manager.filter(status=Status.PENDING, lane=lane, due_at__lte=now).count()
        for lane in CLAIM_ORDER
    )


def has_due(*, using: str | None = None) -> bool:
    """Whether anything is due now: the cheap check for work queued elsewhere."""
    manager = Delivery.objects.using(using or DEFAULT_DB_ALIAS)
    now = timezone.now()
    return any(
        manager.filter(status=Status.PENDING, lane=lane, due_at__lte=now).exists()
        for lane in CLAIM_ORDER
    )
