"""The values that differ between PostgreSQL and SQLite, run on whichever the suite uses."""

from __future__ import annotations

import datetime as dt
import sqlite3

import pytest
from django.db import connection

from django_federation_delivery.dialect import (
    connection_for,
    db_datetime,
    quoted_table,
    read_datetime,
    rows_per_statement,
)
from django_federation_delivery.models import DeliveryHistory

# Each test here depends on which database the suite runs on, even one
# that sends it no statement: so each runs on both (see tests/conftest.py).
pytestmark = pytest.mark.django_db

MINUTE = dt.datetime(2025, 1, 2, 3, 4, tzinfo=dt.UTC)


def test_a_datetime_written_raw_reads_back_as_the_same_aware_datetime() -> None:
    table = quoted_table(DeliveryHistory, connection)
    with connection.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {table} (minute, delivered, retried, refused, failed, breakers_opened) "
            "VALUES (%s, 0, 0, 0, 1, 0) RETURNING minute",
            [db_datetime(MINUTE, connection)],
        )
        (value,) = cursor.fetchone()
    assert read_datetime(value) == MINUTE
    assert read_datetime(None) is None


@pytest.mark.parametrize(
    "value",
    [
        MINUTE,
        dt.datetime(2025, 1, 2, 3, 4, 5, 678, tzinfo=dt.UTC),
        dt.datetime(2025, 6, 1, 23, 30, tzinfo=dt.timezone(dt.timedelta(hours=-5))),
        dt.datetime(9999, 12, 31, 23, 59, 59, 999999, tzinfo=dt.UTC),
        None,
    ],
)
def test_a_datetime_is_written_as_djangos_own_adapter_writes_it(value: dt.datetime | None) -> None:
    connection = connection_for(None)
    assert db_datetime(value, connection) == connection.ops.adapt_datetimefield_value(value)


def test_sqlite_text_reads_as_utc() -> None:
    assert read_datetime("2025-01-02 03:04:00") == MINUTE


def test_sqlite_text_reads_in_the_connections_time_zone() -> None:
    # DATABASES' TIME_ZONE: SQLite's naive text is in that zone, as Django
    # writes and reads it.
    import types
    import zoneinfo

    paris = types.SimpleNamespace(timezone=zoneinfo.ZoneInfo("Europe/Paris"))
    assert read_datetime("2025-01-02 04:04:00", paris) == MINUTE
    assert read_datetime(MINUTE, paris) == MINUTE  # aware already (PostgreSQL's)


def test_a_statement_carries_no_more_rows_than_the_database_takes_parameters() -> None:
    rows = rows_per_statement(connection, most=500, per_row=5, constants=4)
    if connection.vendor == "sqlite":
        limit = connection.connection.getlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER)
        assert 1 <= rows <= 500 and rows * 5 + 4 <= limit
    else:
        assert rows == 500
    assert rows_per_statement(connection, most=500, per_row=10**6) == (
        1 if connection.vendor == "sqlite" else 500
    )
