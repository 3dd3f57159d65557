"""The history's statements: counts added to their minute, one upsert for
the minutes a write touched, in the same transaction as the write."""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Mapping
from typing import Any

from django.db import DEFAULT_DB_ALIAS, DatabaseError, transaction

from django_federation_delivery.dialect import connection_for, db_datetime, quoted_table, upsert_sql
from django_federation_delivery.models import DeliveryHistory

__all__ = ["COUNTS", "minute_of", "record", "upsert_counted"]

logger = logging.getLogger("django_federation_delivery.history")

COUNTS = ("delivered", "retried", "refused", "failed", "breakers_opened")


def minute_of(at: dt.datetime) -> dt.datetime:
    """The UTC minute ``at`` falls in."""
    return at.astimezone(dt.UTC).replace(second=0, microsecond=0)


def record(counts: Mapping[dt.datetime, Mapping[str, int]], *, using: str | None = None) -> None:
    """Add ``counts`` ({minute: {count name: how many}}) to the history, in
    one statement, within the caller's transaction if there is one.

    A failure is logged and goes no further: it rolls back only its own
    savepoint, never the settlements written with it.
    """
    rows = []
    for minute, named in sorted(counts.items()):
        unknown = set(named) - set(COUNTS)
        if unknown:
            raise ValueError(f"no such history count: {sorted(unknown)!r}")
        values = [int(named.get(name, 0)) for name in COUNTS]
        if any(values):
            rows.append((minute_of(minute), values))
    if not rows:
        return
    alias = using or DEFAULT_DB_ALIAS
    connection = connection_for(alias)
    table = quoted_table(DeliveryHistory, connection)
    sql = upsert_sql(
        table, ("minute", *COUNTS), key="minute", updates=_added(table), rows=len(rows)
    )
    params: list[Any] = []
    for minute, values in rows:
        params += [db_datetime(minute, connection), *values]
    try:
        with transaction.atomic(using=alias), connection.cursor() as cursor:
            cursor.execute(sql, params)
    except DatabaseError:
        logger.exception("The delivery history could not be recorded; what it counted is settled")


def _added(table: str) -> str:
    """An upsert's update: each count added to the minute's."""
    return ", ".join(f"{name} = {table}.{name} + excluded.{name}" for name in COUNTS)


def upsert_counted(rows: str, connection: Any) -> str:
    """PostgreSQL: an ``INSERT`` into the history of what ``rows`` (a
    statement's CTE with a ``minute`` and a ``counted`` column, the count
    name or NULL) counts, for a statement that settles and counts at once."""
    table = quoted_table(DeliveryHistory, connection)
    sums = ", ".join(f"count(*) FILTER (WHERE counted = '{name}')" for name in COUNTS)
    return (
        f"INSERT INTO {table} (minute, {', '.join(COUNTS)}) "
        f"SELECT minute, {sums} FROM {rows} WHERE counted IS NOT NULL "
        f"GROUP BY minute ORDER BY minute "
        f"ON CONFLICT (minute) DO UPDATE SET {_added(table)}"
    )
