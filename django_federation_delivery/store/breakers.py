"""What the breakers write with SQL of their own: failures counted by every
process together, one upsert a destination (``count_failures``)."""

from __future__ import annotations

import datetime as dt
from collections import Counter

from django.db import transaction

from django_federation_delivery.dialect import aware_now, connection_for, db_datetime, read_datetime
from django_federation_delivery.store import history, sql

__all__ = ["count_failures"]


def count_failures(
    failures: Counter[str], *, threshold: int, cool_off: float, using: str | None = None
) -> dict[str, tuple[int, dt.datetime | None]]:
    """Count failures in a row, opening a breaker that reaches ``threshold``:
    one upsert a destination, so that processes count together. Returns each
    destination's count and open time as they now stand, all processes' together."""
    if not failures:
        return {}
    connection = connection_for(using)
    # Aware: what it reads back is (read_datetime), and a cool-off across a
    # clock change is as long as it says.
    now = aware_now()
    opens_at = now + dt.timedelta(seconds=cool_off)
    opens = db_datetime(opens_at, connection)
    standing: dict[str, tuple[int, dt.datetime | None]] = {}
    opened = 0
    with transaction.atomic(using=using), sql.on(connection) as db:
        for key, count in sorted(failures.items()):
            row = db.one(
                "count_failures",
                key=key,
                count=count,
                threshold=threshold,
                opens=opens,
                now=db_datetime(now, connection),
            )
            if row is not None:
                standing[key] = (int(row[0]), read_datetime(row[1], connection))
                # Opened by this statement: open until the time it wrote.
                opened += standing[key][1] == opens_at
        history.record({now: {"breakers_opened": opened}}, using=using)
    return standing
