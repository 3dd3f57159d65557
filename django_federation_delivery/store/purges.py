"""What a purge deletes, a chunk at a time: settled deliveries past their
retention, and the batches left with none.

Each chunk is its own transaction, short enough that a send waiting for
SQLite's write lock waits no longer than one chunk.
"""

from __future__ import annotations

import datetime as dt
import functools
from collections.abc import Callable, Iterator
from typing import Any

from django.db import transaction

from django_federation_delivery.dialect import aware_now, connection_for, db_datetime, orm_datetime
from django_federation_delivery.models import Batch, Status
from django_federation_delivery.store import sql
from django_federation_delivery.store.locks import again_on_deadlock

__all__ = ["delete_empty_batches", "delete_settled"]


def delete_settled(
    status: Status,
    cutoff: dt.datetime,
    chunk: int,
    alias: str,
    *,
    retractions_cutoff: dt.datetime | None = None,
) -> Iterator[int]:
    """Delete, a chunk at a time, the deliveries of ``status`` settled before
    ``cutoff``, those of a retraction's batch only if settled before
    ``retractions_cutoff`` too (None: ``cutoff``); yields each chunk's
    count, the last one short."""
    connection = connection_for(alias)
    cutoff_value = db_datetime(cutoff, connection)
    retractions_value = db_datetime(retractions_cutoff or cutoff, connection)
    # The chunks walk the (status, settled_at) index from the oldest up,
    # each starting where the last ended, rather than from the start again
    # past the index entries of rows just deleted (PostgreSQL keeps them
    # until vacuum).
    since: Any = db_datetime(EARLIEST, connection)
    while True:
        params = {
            "status": str(status),
            "cutoff": cutoff_value,
            "retractions_cutoff": retractions_value,
            "since": since,
            "chunk": chunk,
        }
        rows = again_on_deadlock(alias, functools.partial(_delete_chunk, params, alias))
        if rows:
            since = max(row[1] for row in rows)
            if connection.vendor == "postgresql":
                since = since.replace(tzinfo=dt.UTC)  # returned in UTC
        yield len(rows)
        if len(rows) < chunk:
            return


def _delete_chunk(params: dict[str, Any], alias: str) -> list[Any]:
    """One chunk of :func:`delete_settled`, a transaction: the rows deleted."""
    connection = connection_for(alias)
    with transaction.atomic(using=alias), sql.on(connection) as db:
        # The DELETE comes first in the transaction: on SQLite it takes
        # the write lock at once, waiting its turn under the busy timeout,
        # rather than read first and find the lock taken.
        rows: list[Any] = db.all("delete_settled", **params)
        ids = sorted(row[0] for row in rows)
        # A delivery waiting on (or, settled, once waiting on) one of
        # these would point at nothing: the foreign key is checked at
        # commit, by then cleared. One still pending is released first,
        # as the deliverer's sweep would have released it.
        if ids:
            span = {"first": ids[0], "last": ids[-1], "ids": db.ids(ids)}
            waiting = [id for (id,) in db.all("waiting_on", **span)]
            if waiting:
                now = db_datetime(aware_now(), connection)
                db.release("release", db.ids(waiting), now)
            db.run("forget_deleted", **span)
    return rows


#: Before any settle: where the first chunk of a purge starts.
EARLIEST = dt.datetime(1, 1, 2, tzinfo=dt.UTC)


def delete_empty_batches(
    cutoff: dt.datetime, chunk: int, alias: str, should_stop: Callable[[], bool]
) -> int:
    """Delete the batches created before ``cutoff`` that have no delivery
    left, walking them by id a chunk at a time (``delete_empty_batches``)."""
    connection = connection_for(alias)
    cutoff_value = db_datetime(cutoff, connection)
    deleted, last = 0, 0
    while not should_stop():
        ids = list(
            Batch.objects.using(alias)
            .filter(id__gt=last, created_at__lt=orm_datetime(cutoff, alias))
            .order_by("id")
            .values_list("id", flat=True)[:chunk]
        )
        if not ids:
            return deleted
        with sql.on(connection) as db:
            deleted += max(
                db.run("delete_empty_batches", after=last, last=ids[-1], cutoff=cutoff_value), 0
            )
        last = ids[-1]
    return deleted
