"""What tells PostgreSQL from SQLite in the values of the statements written
by hand (their texts, and what differs between the two in them, are in
``store/queries.sql``): how a datetime is written and how it comes back, how
many rows one statement may carry, and how a list of rows or of ids is
passed as one parameter. SQLite 3.35 has ``RETURNING`` and ``ON CONFLICT …
DO UPDATE`` (``checks/database.py`` refuses an older one).
"""

from __future__ import annotations

import datetime as dt
import json
import sqlite3
from collections.abc import Iterable
from typing import Any

from django.conf import settings
from django.db import connections
from django.utils import timezone

from django_federation_delivery.conf import database_alias

__all__ = [
    "aware",
    "aware_now",
    "connection_for",
    "db_datetime",
    "id_array",
    "is_postgresql",
    "json_parameter",
    "orm_datetime",
    "quoted_table",
    "read_datetime",
    "rows_per_statement",
]


def connection_for(using: str | None) -> Any:
    return connections[using or database_alias()]


def is_postgresql(connection: Any) -> bool:
    return connection.vendor == "postgresql"  # type: ignore[no-any-return]


def quoted_table(model: type[Any], connection: Any) -> str:
    return str(connection.ops.quote_name(model._meta.db_table))


def naive_zone(connection: Any = None) -> dt.tzinfo:
    """The zone a naive datetime in the database is in: the ``connection``'s
    (UTC, Django's default, with ``USE_TZ``); with ``USE_TZ = False``,
    ``TIME_ZONE``, the one Django writes every naive time in."""
    zone = getattr(connection, "timezone", None)
    if zone is not None:
        return zone  # type: ignore[no-any-return]
    return dt.UTC if settings.USE_TZ else timezone.get_default_timezone()


def aware(value: dt.datetime) -> dt.datetime:
    """``value`` with its zone: a naive one (``timezone.now()`` with
    ``USE_TZ = False``, or what the ORM reads then) is in :func:`naive_zone`."""
    if timezone.is_naive(value):
        return value.replace(tzinfo=naive_zone())
    return value


def aware_now() -> dt.datetime:
    """The time now, aware whatever ``USE_TZ`` says, to compare with the
    times the package reads (:func:`read_datetime`) and keeps: in UTC, where
    adding 30 s is 30 s and two times compare as instants, as they do not
    in a zone whose clock goes back an hour once a year (``TIME_ZONE`` with
    ``USE_TZ = False``, which ``timezone.now()`` is in then)."""
    return aware(timezone.now()).astimezone(dt.UTC)


def orm_datetime(value: dt.datetime, using: str | None = None) -> dt.datetime:
    """``value`` as the ORM takes it for the database ``using``: on SQLite
    with ``USE_TZ = False``, naive in ``TIME_ZONE`` (its backend refuses an
    aware one); as it is otherwise. The package's own times are aware
    whatever ``USE_TZ`` says, and PostgreSQL takes one as the instant it is,
    where a naive time in the hour a clock goes back through twice is read
    as the later of the two."""
    if (
        not settings.USE_TZ
        and timezone.is_aware(value)
        and connection_for(using).vendor != "postgresql"
    ):
        return timezone.make_naive(value, timezone.get_default_timezone())
    return value


def db_datetime(value: dt.datetime | None, connection: Any) -> Any:
    """``value`` as a raw statement's parameter: SQLite stores text, naive in
    :func:`naive_zone` (what Django's adapter writes for an aware datetime,
    without its checks, on the path of every send; with ``USE_TZ = False``
    the adapter refuses one, and the loop's times are aware whatever
    ``USE_TZ`` says)."""
    if connection.vendor == "sqlite" and value is not None and value.utcoffset() is not None:
        return str(value.astimezone(naive_zone(connection)).replace(tzinfo=None))
    return connection.ops.adapt_datetimefield_value(value)


def read_datetime(value: Any, connection: Any = None) -> dt.datetime | None:
    """A datetime a raw statement returned, as the ORM reads it, but aware:
    SQLite's is text, naive in :func:`naive_zone`; PostgreSQL's is aware
    already (naive in ``TIME_ZONE`` with ``USE_TZ = False``)."""
    if value is None:
        return None
    if isinstance(value, str):
        value = dt.datetime.fromisoformat(value)
    if timezone.is_naive(value):
        value = value.replace(tzinfo=naive_zone(connection))
    return value  # type: ignore[no-any-return]


def json_parameter(rows: Any) -> str:
    """``rows`` as one JSON parameter, a list of lists: a datetime as ISO 8601
    (with its offset; SQLite's are text already, from :func:`db_datetime`)."""
    return json.dumps(rows, default=_iso)


def id_array(ids: Iterable[int]) -> str:
    """``ids`` as a PostgreSQL array literal, for ``= ANY(%s::bigint[])``: one
    string for psycopg to quote, where a list is adapted an element at a time."""
    return "{" + ",".join(str(int(id)) for id in ids) + "}"


def _iso(value: Any) -> str:
    if isinstance(value, dt.datetime):
        return value.isoformat()
    raise TypeError(f"{type(value).__name__} is not a JSON value")


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
