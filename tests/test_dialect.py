"""The SQL that differs between PostgreSQL and SQLite, run on whichever the suite uses."""

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
    skip_locked,
    upsert_sql,
)
from django_federation_delivery.models import DeliveryHistory

# Each test here depends on which database the suite runs on, even one
# that sends it no statement: so each runs on both (see tests/conftest.py).
pytestmark = pytest.mark.django_db

MINUTE = dt.datetime(2025, 1, 2, 3, 4, tzinfo=dt.UTC)


def upsert(delivered: int, failed: int) -> None:
    table = quoted_table(DeliveryHistory, connection)
    sql = upsert_sql(
        table,
        ("minute", "delivered", "failed", "retried", "refused", "breakers_opened"),
        key="minute",
        updates=f"delivered = {table}.delivered + excluded.delivered",
        returning=f"{table}.delivered, {table}.failed",
    )
    with connection.cursor() as cursor:
        cursor.execute(sql, [db_datetime(MINUTE, connection), delivered, failed, 0, 0, 0])
        assert cursor.fetchall() == [
            tuple(DeliveryHistory.objects.values_list("delivered", "failed").get())
        ]


def test_an_upsert_inserts_a_new_key_and_updates_only_what_it_says_of_an_existing_one() -> None:
    upsert(2, 1)
    upsert(3, 7)
    row = DeliveryHistory.objects.get()
    assert (row.minute, row.delivered, row.failed) == (MINUTE, 5, 1)


def test_an_upsert_of_several_rows_has_a_placeholder_a_value() -> None:
    sql = upsert_sql('"t"', ("a", "b"), key="a", updates="b = excluded.b", rows=3)
    assert sql == (
        'INSERT INTO "t" (a, b) VALUES (%s, %s), (%s, %s), (%s, %s) '
        "ON CONFLICT (a) DO UPDATE SET b = excluded.b"
    )


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


def test_only_postgresql_claims_skip_locked_rows() -> None:
    expected = " FOR UPDATE SKIP LOCKED" if connection.vendor == "postgresql" else ""
    assert skip_locked(connection_for(None)) == expected
