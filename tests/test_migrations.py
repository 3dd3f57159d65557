"""The one migration: undone and done again, it leaves the tables the models
describe, and on PostgreSQL the batch table's pages half empty; not done,
the commands say to run it."""

from __future__ import annotations

import io
from collections.abc import Iterator

import pytest
from django.core.management import CommandError, call_command
from django.db import connection
from django.db.migrations.executor import MigrationExecutor
from django.db.migrations.loader import MigrationLoader

from django_federation_delivery import send
from django_federation_delivery.models import Batch, Delivery, Host

from .keys import ALICE

APP = "federation_delivery"


def test_the_unreleased_migrations_are_one() -> None:
    loader = MigrationLoader(None, ignore_no_migrations=True)
    assert sorted(name for app, name in loader.disk_migrations if app == APP) == ["0001_initial"]


@pytest.fixture
def migrated_again() -> None:
    """The app's tables dropped by undoing its migration, then made again."""
    executor = MigrationExecutor(connection)
    executor.migrate([(APP, None)])
    tables = connection.introspection.table_names()
    assert Delivery._meta.db_table not in tables and Batch._meta.db_table not in tables
    executor.loader.build_graph()
    executor.migrate(executor.loader.graph.leaf_nodes(APP))


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("migrated_again")
def test_undone_and_done_again_the_tables_take_a_send() -> None:
    send(ALICE, {"type": "Note"}, ["https://a.example/inbox"])
    assert Delivery.objects.get().host == "a.example"
    Host.objects.create(name="<ops>", disabled_reason="gone")
    assert Host.objects.get().disabled_reason == "gone"
    with connection.cursor() as cursor:
        indexes = connection.introspection.get_constraints(cursor, Delivery._meta.db_table)
    assert {"fd_delivery_due", "fd_delivery_destination", "fd_delivery_once_per_inbox"} <= set(
        indexes
    )


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("migrated_again")
def test_the_batch_table_leaves_half_of_each_page_free_on_postgresql() -> None:
    if connection.vendor != "postgresql":
        pytest.skip("a PostgreSQL storage parameter")
    with connection.cursor() as cursor:
        cursor.execute("SELECT reloptions FROM pg_class WHERE relname = %s", [Batch._meta.db_table])
        (options,) = cursor.fetchone()
    assert options == ["fillfactor=50"]


@pytest.mark.django_db(transaction=True)
def test_sqlmigrate_prints_the_batch_table_s_fillfactor_on_postgresql_alone() -> None:
    # What a DBA applies by hand (where the app's user may not ALTER) makes
    # the tables migrate makes; SQLite has no such setting.
    out = io.StringIO()
    call_command("sqlmigrate", APP, "0001", stdout=out)
    sql = out.getvalue()
    assert "CANNOT BE WRITTEN AS SQL" not in sql
    table = connection.ops.quote_name(Batch._meta.db_table)
    altered = f"ALTER TABLE {table} SET (fillfactor = 50);"
    assert (altered in sql) is (connection.vendor == "postgresql"), sql[-500:]
    out = io.StringIO()
    call_command("sqlmigrate", APP, "0001", backwards=True, stdout=out)
    reset = f"ALTER TABLE {table} RESET (fillfactor);"
    assert (reset in out.getvalue()) is (connection.vendor == "postgresql")


@pytest.fixture
def unmigrated() -> Iterator[None]:
    """The app's tables dropped by undoing its migration; made again after."""
    executor = MigrationExecutor(connection)
    executor.migrate([(APP, None)])
    yield
    executor.loader.build_graph()
    executor.migrate(executor.loader.graph.leaf_nodes(APP))


LACKS = (
    r"The database 'default' lacks a migration of the package's "
    r"\(federation_delivery\.0001_initial\): run manage\.py migrate first\."
)


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("unmigrated")
@pytest.mark.parametrize(
    "command",
    [
        ["run_deliverer", "--drain"],
        ["delivery_status"],
        ["delivery_status", "--host", "a.example"],
        ["delivery_replay", "--host", "a.example", "--since", "1h"],
        ["purge_deliveries", "--dry-run"],
        ["enable_webhook", "ops"],
    ],
    ids=" ".join,
)
def test_a_command_on_a_database_not_migrated_says_to_migrate(command: list[str]) -> None:
    with pytest.raises(CommandError, match=LACKS):
        call_command(*command, stdout=io.StringIO())


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("unmigrated")
def test_a_health_check_on_a_database_not_migrated_is_critical() -> None:
    out = io.StringIO()
    with pytest.raises(SystemExit) as exited:
        call_command("delivery_status", "--check", stdout=out)
    assert exited.value.code == 2
    assert out.getvalue().startswith("CRITICAL: the queue cannot be read (")
    assert "federation_delivery_" in out.getvalue(), "the table it could not read"
