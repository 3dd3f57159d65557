"""What tells PostgreSQL from SQLite, for the few statements written by hand.

The queue, the breakers, the history and retention write some SQL
themselves, where the ORM would take a query a row or cannot say it (``ON
CONFLICT … DO UPDATE`` with arithmetic, ``RETURNING`` from an ``UPDATE``).
What differs between the two databases for those statements is here, once:
how a table and a datetime are written, how a datetime comes back, how many
rows one statement may carry, the upsert, and how a list of rows is passed as
one JSON parameter. The SQL is otherwise the same on both: SQLite 3.35 has
``RETURNING`` and ``ON CONFLICT … DO UPDATE`` (``checks/database.py``
refuses an older one).
"""

from __future__ import annotations

import datetime as dt
import json
import sqlite3
from collections.abc import Iterable, Sequence
from typing import Any

from django.db import DEFAULT_DB_ALIAS, connections
from django.utils import timezone

__all__ = [
    "connection_for",
    "db_datetime",
    "id_array",
    "is_postgresql",
    "json_parameter",
    "json_rows",
    "lock_for_writing",
    "quoted_table",
    "read_datetime",
    "rows_per_statement",
    "skip_locked",
    "upsert_sql",
]


def connection_for(using: str | None) -> Any:
    return connections[using or DEFAULT_DB_ALIAS]


def is_postgresql(connection: Any) -> bool:
    return connection.vendor == "postgresql"  # type: ignore[no-any-return]


def quoted_table(model: type[Any], connection: Any) -> str:
    return str(connection.ops.quote_name(model._meta.db_table))


def db_datetime(value: dt.datetime | None, connection: Any) -> Any:
    """``value`` as a raw statement's parameter: SQLite stores text in UTC."""
    if (
        connection.vendor == "sqlite"
        and value is not None
        and value.utcoffset() is not None
        and connection.timezone is not None
    ):
        # What Django's adapter writes for an aware datetime, without its
        # checks, on the path of every send: naive in the connection's zone.
        return str(value.astimezone(connection.timezone).replace(tzinfo=None))
    return connection.ops.adapt_datetimefield_value(value)


def read_datetime(value: Any, connection: Any = None) -> dt.datetime | None:
    """A datetime a raw statement returned, as the ORM reads it: SQLite's is
    text, naive in the ``connection``'s time zone (UTC, Django's default for
    it, when none is given); PostgreSQL's is aware already."""
    if value is None:
        return None
    if isinstance(value, str):
        value = dt.datetime.fromisoformat(value)
    if timezone.is_naive(value):
        zone = getattr(connection, "timezone", None) or dt.UTC
        value = value.replace(tzinfo=zone)
    return value  # type: ignore[no-any-return]


def json_rows(columns: Sequence[tuple[str, str]], connection: Any) -> str:
    """A ``SELECT`` of the rows of one JSON parameter (a list of lists, as
    :func:`json_parameter` writes it), with ``columns`` (name, PostgreSQL
    type) in order. One statement's text for any number of rows, which the
    database prepares once, and one parameter to bind rather than one a
    value."""
    if is_postgresql(connection):
        # jsonb: parsed once, where each ->> of a json value parses its text again.
        picks = ", ".join(
            f"(value->>{n})::{kind} AS {name}" for n, (name, kind) in enumerate(columns)
        )
        return f"SELECT {picks} FROM jsonb_array_elements(%s::jsonb)"
    picks = ", ".join(
        f"json_extract(value, '$[{n}]') AS {name}" for n, (name, _) in enumerate(columns)
    )
    return f"SELECT {picks} FROM json_each(%s)"


def json_parameter(rows: Any) -> str:
    """``rows`` as :func:`json_rows` reads them: a datetime as ISO 8601 (with
    its offset; SQLite's are text already, from :func:`db_datetime`)."""
    return json.dumps(rows, default=_iso)


def id_array(ids: Iterable[int]) -> str:
    """``ids`` as a PostgreSQL array literal, for ``= ANY(%s::bigint[])``: one
    string for psycopg to quote, where a list is adapted an element at a time."""
    return "{" + ",".join(str(int(id)) for id in ids) + "}"


def _iso(value: Any) -> str:
    if isinstance(value, dt.datetime):
        return value.isoformat()
    raise TypeError(f"{type(value).__name__} is not a JSON value")


def lock_for_writing(cursor: Any, connection: Any, table: str) -> None:
    """SQLite: have the transaction hold the write lock from now on, for a
    read whose rows it then writes. A deferred ``BEGIN`` (Django 4.2, or no
    ``transaction_mode``) takes it at the first write: a read before that
    sees rows another connection may change before the write, which then
    fails at once ("database is locked") instead of waiting. A write that
    changes nothing takes it, waiting as any write does; a transaction begun
    ``IMMEDIATE`` holds it already."""
    if connection.vendor == "sqlite" and connection.in_atomic_block:
        mode = getattr(connection, "transaction_mode", None)
        if mode not in ("IMMEDIATE", "EXCLUSIVE"):
            cursor.execute(f"UPDATE {table} SET id = id WHERE 0")


def skip_locked(connection: Any) -> str:
    """What a claim's SELECT ends with: on PostgreSQL it passes rows another
    process holds; SQLite has one writer at a time, and no such clause."""
    return " FOR UPDATE SKIP LOCKED" if is_postgresql(connection) else ""


def ids_among(subquery: str, connection: Any) -> str:
    """``id IN (subquery)``, written so that PostgreSQL runs the subquery once
    and looks its ids up by primary key, whatever its statistics say: as a
    join, a subquery of thousands of ids may be hashed against a scan of the
    whole table, and a purge scan the table once a chunk."""
    if is_postgresql(connection):
        return f"id = ANY(ARRAY({subquery}))"
    return f"id IN ({subquery})"


def rows_per_statement(connection: Any, *, most: int, per_row: int, constants: int = 0) -> int:
    """How many rows of ``per_row`` parameters one statement may carry, with
    ``constants`` parameters besides: ``most``, or fewer where SQLite takes
    fewer parameters in a statement (an SQLite built with the old default
    takes 999). PostgreSQL's statements here take an array a column,
    whatever their rows."""
    if connection.vendor != "sqlite":
        return most
    if connection.connection is None:
        connection.ensure_connection()
    limit: int = connection.connection.getlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER)
    return max(1, min(most, (limit - constants) // per_row))


def upsert_sql(
    table: str,
    columns: Sequence[str],
    *,
    key: str,
    updates: str,
    rows: int = 1,
    row: str = "",
    returning: str = "",
) -> str:
    """``INSERT`` of ``rows`` rows, each one that meets a row with the same
    ``key`` updating it by ``updates`` instead (``excluded.<column>`` is the
    value that was to be inserted): one statement, on PostgreSQL and SQLite
    alike. ``row`` is one row's values, a placeholder a column by default."""
    row = row or f"({', '.join(['%s'] * len(columns))})"
    sql = (
        f"INSERT INTO {table} ({', '.join(columns)}) VALUES {', '.join([row] * rows)} "
        f"ON CONFLICT ({key}) DO UPDATE SET {updates}"
    )
    return f"{sql} RETURNING {returning}" if returning else sql


def journal_mode(connection: Any) -> str:
    """SQLite's journal mode, lowercase ("wal", "delete", …)."""
    with connection.cursor() as cursor:
        cursor.execute("PRAGMA journal_mode")
        return str(cursor.fetchone()[0]).lower()
