"""Each batch's count of deliveries remaining: what leaves the queue is
taken off it, and a batch that reaches nought is finished.
"""

from __future__ import annotations

import datetime as dt
import json
from collections import Counter
from collections.abc import Sequence

from django.db import DEFAULT_DB_ALIAS

from django_federation_delivery.dialect import (
    connection_for,
    db_datetime,
    id_array,
    is_postgresql,
    json_parameter,
    json_rows,
    quoted_table,
)
from django_federation_delivery.models import Batch

#: A count-down's columns: a batch, and how many of its deliveries leave.
LEAVING = (("id", "bigint"), ("n", "integer"))


def count_down_set(table: str, v: str) -> str:
    """What a count-down sets: ``{v}.n`` fewer remaining, and finished at the
    statement's one parameter once none are. Every right-hand side reads the
    row as it was: ``remaining`` in ``finished_at``'s CASE is the count before."""
    fewer = f"{table}.remaining > {v}.n"
    return (
        f"remaining = CASE WHEN {fewer} THEN {table}.remaining - {v}.n ELSE 0 END, "
        f"finished_at = CASE WHEN {fewer} THEN NULL ELSE %s END"
    )


def count_down(leaving: Counter[int], now: dt.datetime, using: str | None) -> list[int]:
    """Take the settled deliveries off their batches' counts; the batches
    that reach nought are finished now, and their ids returned, in order.

    The batches are one JSON parameter, however many (a stream of one-inbox
    sends settles as many batches as deliveries). On PostgreSQL their rows
    are locked first, in id order: deliverers counting down the same batches
    at once then wait on each other rather than deadlock. On SQLite the
    batches it finishes are read first, as one value (see
    ``settlements._write_settlements``).
    """
    if not leaving:
        return []
    connection = connection_for(using)
    table = quoted_table(Batch, connection)
    finished_at = db_datetime(now, connection)
    items = sorted(leaving.items())
    given = json_parameter(items)
    rows = json_rows(LEAVING, connection)
    update = (
        f"WITH v AS ({rows}) UPDATE {table} SET {count_down_set(table, 'v')} "
        f"FROM v WHERE {table}.id = v.id AND {table}.finished_at IS NULL"
    )
    with connection.cursor() as cursor:
        if is_postgresql(connection):
            ids = [batch_id for batch_id, _ in items]
            cursor.execute(
                f"SELECT id FROM {table} WHERE id = ANY(%s::bigint[]) ORDER BY id FOR UPDATE",
                [id_array(ids)],
            )
            cursor.execute(
                f"{update} RETURNING {table}.id, {table}.remaining", [given, finished_at]
            )
            return sorted(batch_id for batch_id, remaining in cursor.fetchall() if remaining == 0)
        cursor.execute(
            f"SELECT json_group_array({table}.id) FROM ({rows}) AS v CROSS JOIN {table} "
            f"WHERE {table}.id = v.id AND {table}.finished_at IS NULL AND {table}.remaining <= v.n",
            [given],
        )
        done = sorted(json.loads(cursor.fetchone()[0]))
        cursor.execute(update, [given, finished_at])
    return done


def finished_batches(ids: Sequence[int], *, using: str | None = None) -> list[Batch]:
    """The batches of ``ids`` (finished ones, as ``on_finished`` names them),
    whole and in id order: what ``batch_finished`` carries."""
    manager = Batch.objects.using(using or DEFAULT_DB_ALIAS).order_by("id")
    return list(manager.filter(id__in=sorted(ids)))
