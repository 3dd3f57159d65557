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
from collections.abc import Iterable

from django.utils import timezone

from django_federation_delivery.charts import Bucket
from django_federation_delivery.conf import database_alias
from django_federation_delivery.dialect import orm_datetime
from django_federation_delivery.models import DeliveryHistory
from django_federation_delivery.store.history import COUNTS, minute_of, record

#: How long history is kept: ``purge`` deletes older minutes.
KEPT = dt.timedelta(days=7)
#: What the queues page shows: the last hour by minute, the last two days by hour.
MINUTES = 60
HOURS = 48

__all__ = ["COUNTS", "KEPT", "counted", "minute_of", "purge", "recent", "record"]


def hour_of(at: dt.datetime) -> dt.datetime:
    return minute_of(at).replace(minute=0)


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
    alias = using or database_alias()
    now = now or timezone.now()
    this_minute = minute_of(now)
    first_hour = hour_of(now) - dt.timedelta(hours=HOURS - 1)
    rows = (
        DeliveryHistory.objects.using(alias)
        .filter(
            minute__gte=orm_datetime(first_hour, alias),
            minute__lte=orm_datetime(this_minute, alias),
        )
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
    alias = using or database_alias()
    old = DeliveryHistory.objects.using(alias).filter(minute__lt=orm_datetime(cutoff, alias))
    if dry_run:
        return old.count()
    return int(old.delete()[0])
