"""What the breakers write with SQL of their own: failures counted by every
process together, one upsert a destination."""

from __future__ import annotations

import datetime as dt
from collections import Counter

from django.db import transaction
from django.utils import timezone

from django_federation_delivery.dialect import (
    connection_for,
    db_datetime,
    quoted_table,
    read_datetime,
    upsert_sql,
)
from django_federation_delivery.models import Breaker
from django_federation_delivery.store import history

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
    table = quoted_table(Breaker, connection)
    now = timezone.now()
    opens = db_datetime(now + dt.timedelta(seconds=cool_off), connection)
    sql = upsert_sql(
        table,
        ("key", "failures", "open_until", "probe_token", "probe_until", "updated_at"),
        row="(%s, %s, CASE WHEN %s >= %s THEN %s ELSE NULL END, '', NULL, %s)",
        key="key",
        updates=(
            f"failures = {table}.failures + excluded.failures, "
            f"open_until = CASE WHEN {table}.open_until IS NULL "
            f"AND {table}.failures + excluded.failures >= %s THEN %s ELSE {table}.open_until END, "
            "updated_at = excluded.updated_at"
        ),
        returning=f"{table}.failures, {table}.open_until",
    )
    standing: dict[str, tuple[int, dt.datetime | None]] = {}
    opened = 0
    with transaction.atomic(using=using), connection.cursor() as cursor:
        for key, count in sorted(failures.items()):
            cursor.execute(
                sql,
                [
                    key,
                    count,
                    count,
                    threshold,
                    opens,
                    db_datetime(now, connection),
                    threshold,
                    opens,
                ],
            )
            row = cursor.fetchone()
            if row is not None:
                standing[key] = (int(row[0]), read_datetime(row[1], connection))
                # Opened by this statement: open until the time it wrote.
                opened += standing[key][1] == now + dt.timedelta(seconds=cool_off)
        history.record({now: {"breakers_opened": opened}}, using=using)
    return standing
