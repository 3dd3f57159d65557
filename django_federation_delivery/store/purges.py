"""What a purge deletes, a chunk at a time: settled deliveries past their
retention, and the batches left with none.

Each chunk is its own transaction, short enough that a send waiting for
SQLite's write lock waits no longer than one chunk.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Iterator
from typing import Any

from django.db import transaction

from django_federation_delivery.dialect import (
    connection_for,
    db_datetime,
    ids_among,
    quoted_table,
)
from django_federation_delivery.models import Batch, Delivery, Status
from django_federation_delivery.store.queueing import CHUNK

__all__ = ["delete_empty_batches", "delete_settled"]


def delete_settled(status: Status, cutoff: dt.datetime, chunk: int, alias: str) -> Iterator[int]:
    """Delete, a chunk at a time, the deliveries of ``status`` settled before
    ``cutoff``; yields each chunk's count, the last one short."""
    connection = connection_for(alias)
    table = quoted_table(Delivery, connection)
    cutoff_value = db_datetime(cutoff, connection)
    # The chunks walk the (status, settled_at) index from the oldest up,
    # each starting where the last ended, rather than from the start again
    # past the index entries of rows just deleted (PostgreSQL keeps them
    # until vacuum).
    since: Any = None
    while True:
        floor = "" if since is None else "AND settled_at >= %s "
        params = [str(status), cutoff_value, *([] if since is None else [since]), chunk]
        oldest = (
            f"SELECT id FROM {table} WHERE status = %s AND settled_at < %s {floor}"
            "ORDER BY settled_at LIMIT %s"
        )
        # The status is named in the DELETE itself, not only where the ids
        # were found: a row requeued in between is pending, and kept
        # (PostgreSQL checks the DELETE's own conditions again on a row
        # changed since the statement began, not its subquery's).
        sql = (
            f"DELETE FROM {table} WHERE {ids_among(oldest, connection)} AND status = %s "
            "RETURNING id, settled_at"
        )
        params.append(str(status))
        with transaction.atomic(using=alias), connection.cursor() as cursor:
            # The DELETE comes first in the transaction: on SQLite it takes
            # the write lock at once, waiting its turn under the busy timeout,
            # rather than read first and find the lock taken.
            cursor.execute(sql, params)
            rows = cursor.fetchall()
            ids = sorted(row[0] for row in rows)
            # A delivery waiting on (or, settled, once waiting on) one of
            # these would point at nothing: the foreign key is checked at
            # commit, by then cleared. The range is what makes SQLite use
            # the index on after_id: once ANALYZE has seen a column of NULLs
            # (no ordering used), it takes "after_id IN (…)" alone for a
            # full scan of the table, every chunk.
            for start in range(0, len(ids), CHUNK):
                part = ids[start : start + CHUNK]
                cursor.execute(
                    f"UPDATE {table} SET after_id = NULL WHERE after_id >= %s AND after_id <= %s "
                    f"AND after_id IN ({', '.join(['%s'] * len(part))})",
                    [part[0], part[-1], *part],
                )
        if rows:
            since = max(row[1] for row in rows)
        yield len(rows)
        if len(rows) < chunk:
            return


def delete_empty_batches(
    cutoff: dt.datetime, chunk: int, alias: str, should_stop: Callable[[], bool]
) -> int:
    """Delete the batches created before ``cutoff`` that have no delivery
    left, walking them by id a chunk at a time."""
    connection = connection_for(alias)
    batches = quoted_table(Batch, connection)
    deliveries = quoted_table(Delivery, connection)
    cutoff_value = db_datetime(cutoff, connection)
    deleted, last = 0, 0
    while not should_stop():
        ids = list(
            Batch.objects.using(alias)
            .filter(id__gt=last, created_at__lt=cutoff)
            .order_by("id")
            .values_list("id", flat=True)[:chunk]
        )
        if not ids:
            return deleted
        # Whether a delivery is left is asked by the DELETE itself, so that
        # one queued since the page was read keeps its batch.
        with connection.cursor() as cursor:
            cursor.execute(
                f"DELETE FROM {batches} WHERE id > %s AND id <= %s AND created_at < %s "
                f"AND NOT EXISTS (SELECT 1 FROM {deliveries} d WHERE d.batch_id = {batches}.id)",
                [last, ids[-1], cutoff_value],
            )
            deleted += max(cursor.rowcount, 0)
        last = ids[-1]
    return deleted
