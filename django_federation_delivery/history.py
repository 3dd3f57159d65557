"""The queue's history: what came of deliveries, a UTC minute at a time.

Whoever settles deliveries adds its counts here in the same transaction, one
upsert for the minutes it touched (``INSERT … ON CONFLICT (minute) DO
UPDATE``, on SQLite ≥ 3.24 and PostgreSQL), never a statement a delivery. The
queues page reads back at most two days of minutes by the unique index on
``minute``, whatever the size of the deliveries' table. A minute that saw
nothing has no row, and is read as zeros.

What each count is:

- delivered, refused, failed: deliveries settled so in that minute, whoever
  settled them (a deliverer, or an operator giving up);
- retried: attempts that failed and were rescheduled. A delivery held
  unsent by an open breaker or a paused host is not counted: no request was
  made, and a held backlog looked at again every few seconds would drown
  the real retries;
- breakers opened: a destination's failures in a row reached the threshold
  (a failed probe, which keeps an open breaker open, is not counted again).
"""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Iterable, Mapping
from typing import Any

from django.db import DEFAULT_DB_ALIAS, DatabaseError, transaction
from django.utils import timezone

from django_federation_delivery.charts import Bucket
from django_federation_delivery.dialect import connection_for, db_datetime, quoted_table, upsert_sql
from django_federation_delivery.models import DeliveryHistory

logger = logging.getLogger(__name__)

#: How long history is kept: ``purge`` deletes older minutes.
KEPT = dt.timedelta(days=7)
#: What the queues page shows: the last hour by minute, the last two days by hour.
MINUTES = 60
HOURS = 48
COUNTS = ("delivered", "retried", "refused", "failed", "breakers_opened")


def minute_of(at: dt.datetime) -> dt.datetime:
    """The UTC minute ``at`` falls in."""
    return at.astimezone(dt.UTC).replace(second=0, microsecond=0)


def hour_of(at: dt.datetime) -> dt.datetime:
    return minute_of(at).replace(minute=0)


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


def counted(items: Iterable[tuple[dt.datetime, str]]) -> dict[dt.datetime, dict[str, int]]:
    """(when, count name) pairs as :func:`record` takes them, by minute."""
    counts: dict[dt.datetime, dict[str, int]] = {}
    for at, name in items:
        minute = counts.setdefault(minute_of(at), {})
        minute[name] = minute.get(name, 0) + 1
    return counts


def recent(
    *, now: dt.datetime | None = None, using: str | None = None
) -> tuple[list[Bucket], list[Bucket]]:
    """The last ``MINUTES`` minutes, and the last ``HOURS`` hours, up to and
    including ``now``'s, oldest first, a bucket each whether or not anything
    happened in it. One query, of at most ``HOURS`` × 60 rows."""
    now = now or timezone.now()
    this_minute = minute_of(now)
    first_hour = hour_of(now) - dt.timedelta(hours=HOURS - 1)
    rows = (
        DeliveryHistory.objects.using(using or DEFAULT_DB_ALIAS)
        .filter(minute__gte=first_hour, minute__lte=this_minute)
        .values_list("minute", *COUNTS)
    )
    first_minute = this_minute - dt.timedelta(minutes=MINUTES - 1)
    # Summed as plain lists, a bucket an index: 2,880 rows in a few milliseconds.
    by_minute = [[0] * len(COUNTS) for _ in range(MINUTES)]
    by_hour = [[0] * len(COUNTS) for _ in range(HOURS)]
    for minute, *values in rows:
        at = minute_of(minute)
        sums = [by_hour[int((at - first_hour).total_seconds()) // 3600]]
        if at >= first_minute:
            sums.append(by_minute[int((at - first_minute).total_seconds()) // 60])
        for counts in sums:
            for n, value in enumerate(values):
                counts[n] += value
    return (
        [Bucket(first_minute + dt.timedelta(minutes=n), *by_minute[n]) for n in range(MINUTES)],
        [Bucket(first_hour + dt.timedelta(hours=n), *by_hour[n]) for n in range(HOURS)],
    )


def purge(
    *, now: dt.datetime | None = None, dry_run: bool = False, using: str | None = None
) -> int:
    """Delete (or, dry, count) the minutes older than ``KEPT``: how many."""
    cutoff = (now or timezone.now()) - KEPT
    old = DeliveryHistory.objects.using(using or DEFAULT_DB_ALIAS).filter(minute__lt=cutoff)
    if dry_run:
        return old.count()
    return int(old.delete()[0])
