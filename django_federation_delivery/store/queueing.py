"""What a send writes: its batch, and a pending delivery an inbox, in the
same few statements whatever the number of inboxes."""

from __future__ import annotations

import dataclasses
import json
import operator
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from django.db import DEFAULT_DB_ALIAS, models, transaction
from django.db.models.signals import post_save, pre_save
from django.utils import timezone

from django_federation_delivery import wakeup
from django_federation_delivery.dialect import (
    connection_for,
    db_datetime,
    is_postgresql,
    quoted_table,
    rows_per_statement,
)
from django_federation_delivery.models import Batch, Delivery, Host, Kind, Status
from django_federation_delivery.store.sequences import last_of_sequences, sequence_of

#: Rows written, or looked up, in one statement.
CHUNK = 500


class Queued(NamedTuple):
    """A delivery about to be queued."""

    inbox: str
    host: str
    #: Where to POST, in order, when not the inbox itself: a portable
    #: inbox's gateways.
    via: tuple[str, ...] = ()
    #: A webhook's destination, by name; "" for an inbox.
    destination: str = ""


def enqueue(batch: Batch, inboxes: Sequence[Queued], *, using: str | None = None) -> Batch:
    """Write ``batch`` and one pending delivery per inbox.

    Run inside the caller's transaction: on commit a deliverer in this process
    is woken at once, and on PostgreSQL every listening process too.

    Written with a few plain statements rather than the ORM's: a send is on
    the caller's request path, and building a model and a compiled query per
    row cost more than the database took to write them.
    """
    alias = using or DEFAULT_DB_ALIAS
    connection = connection_for(alias)
    now = timezone.now()
    batch.size = batch.remaining = len(inboxes)
    batch.created_at = now
    pre_save.send(sender=Batch, instance=batch, raw=False, using=alias, update_fields=None)
    batch_values = _batch_values(batch, connection)
    due = db_datetime(now, connection)
    per_statement = rows_per_statement(
        connection, most=CHUNK, per_row=len(_ROW), constants=_CONSTANTS
    )
    postgres = is_postgresql(connection)
    with _cursor(connection) as cursor:
        if postgres and inboxes:
            # The batch, its first deliveries and the wake-up of every listening
            # process in one round trip. The notification is delivered by
            # PostgreSQL when, and only when, the transaction commits.
            first = inboxes[:per_statement]
            waits_on = last_of_sequences(
                batch.ordering_key, None, (queued.inbox for queued in first), alias
            )
            cursor.execute(
                _first_statement_sql(connection),
                [
                    *batch_values,
                    *_delivery_params(connection, batch, first, waits_on, due),
                    wakeup.NOTIFY_CHANNEL,
                ],
            )
            done = len(first)
        else:
            # Written first: on SQLite the write lock is taken before anything is read.
            cursor.execute(_batch_sql(connection), batch_values)
            done = 0
        batch.id = cursor.fetchone()[0]
        batch._state.adding = False
        batch._state.db = alias
        # A statement at a time, each a bounded chunk: 100,000 rows' values at
        # once is memory a fan-out does not need.
        for start in range(done, len(inboxes), per_statement):
            chunk = inboxes[start : start + per_statement]
            waits_on = last_of_sequences(
                batch.ordering_key, batch.id, (queued.inbox for queued in chunk), alias
            )
            cursor.execute(
                _deliveries_sql(connection, len(chunk), batch="%s"),
                [batch.id, *_delivery_params(connection, batch, chunk, waits_on, due)],
            )
    post_save.send(
        sender=Batch, instance=batch, created=True, update_fields=None, raw=False, using=alias
    )
    transaction.on_commit(wakeup.notify_local, using=alias)
    return batch


#: A delivery's values that differ from one row to the next, as the statements
#: below take them, with the type PostgreSQL is to read each as.
_ROW = (
    ("inbox", "varchar"),
    ("host", "varchar"),
    ("destination", "varchar"),
    ("via", "jsonb"),
    ("sequence", "varchar"),
    ("after_id", "bigint"),
)
#: Values the statement takes once, whatever its rows: batch, kind, lane,
#: status, due.
_CONSTANTS = 5
#: Statements already written out, for the sizes most sends have: a few
#: rows, or a whole chunk. Any other is written when needed, not kept.
_SQL: dict[tuple[str, str, int], str] = {}
_KEPT_ROWS = 16


def _statement(connection: Any, kind: str, rows: int, write: Callable[[], str]) -> str:
    key = (connection.vendor, kind, rows)
    sql = _SQL.get(key)
    if sql is None:
        sql = write()
        if rows <= _KEPT_ROWS or rows == CHUNK:
            _SQL[key] = sql
    return sql


#: Fields whose values every database takes as Python has them (strings,
#: numbers, booleans, None), once the sending side has checked them.
_PLAIN_FIELDS = (
    models.BooleanField,
    models.CharField,
    models.IntegerField,
    models.TextField,
)


@dataclasses.dataclass(frozen=True)
class _BatchColumns:
    """The columns the batch's INSERT writes, read off the model once: every
    value in one ``attrgetter`` call, then the few that need preparing."""

    values: Callable[[Batch], tuple[Any, ...]]
    datetimes: tuple[int, ...]
    prepared: tuple[tuple[int, models.Field[Any, Any]], ...]


_batch_columns: list[_BatchColumns] = []


def _columns() -> _BatchColumns:
    if not _batch_columns:
        fields = [field for field in Batch._meta.concrete_fields if not field.primary_key]
        datetimes = tuple(
            n for n, field in enumerate(fields) if isinstance(field, models.DateTimeField)
        )
        prepared = tuple(
            (n, field)
            for n, field in enumerate(fields)
            if n not in datetimes and not isinstance(field, _PLAIN_FIELDS)
        )
        getter = operator.attrgetter(*(field.attname for field in fields))
        _batch_columns.append(_BatchColumns(getter, datetimes, prepared))
    return _batch_columns[0]


def _batch_values(batch: Batch, connection: Any) -> list[Any]:
    """The batch's columns as the INSERT takes them: what ``Model.save`` would
    write, without the field-by-field preparation a plain value needs none of."""
    columns = _columns()
    values = list(columns.values(batch))
    for n in columns.datetimes:
        values[n] = db_datetime(values[n], connection)
    for n, field in columns.prepared:
        values[n] = field.get_db_prep_save(field.pre_save(batch, True), connection)
    return values


def _delivery_params(
    connection: Any, batch: Batch, chunk: Sequence[Queued], waits_on: dict[str, int], due: Any
) -> list[Any]:
    """What :func:`_deliveries_sql` takes: the constants, then the rows' values,
    row after row on SQLite, and column by column (an array each) on PostgreSQL."""
    key = batch.ordering_key
    rows = [
        (
            inbox,
            host,
            destination,
            json.dumps(list(via)) if via else "[]",
            sequence_of(key, inbox) if key else "",
            waits_on.get(inbox),
        )
        for inbox, host, via, destination in chunk
    ]
    kind = str(Kind.WEBHOOK if batch.event_type else Kind.ACTIVITYPUB)
    constants = [kind, batch.lane, str(Status.PENDING), due]
    if is_postgresql(connection):
        return [*constants, *(list(column) for column in zip(*rows, strict=True))]
    return [*constants, *(value for row in rows for value in row)]


def _deliveries_sql(connection: Any, rows: int, *, batch: str, join: str = "") -> str:
    """``INSERT … SELECT`` of ``rows`` deliveries of one batch.

    One that waits on another has no due time until that settles; one to a
    paused host, until the host is resumed: the host table is read by the
    statement that writes, so that a send costs no query of its own for it.
    """
    postgres = is_postgresql(connection)

    def write() -> str:
        table = quoted_table(Delivery, connection)
        hosts = quoted_table(Host, connection)
        names = ", ".join(name for name, _ in _ROW)
        if postgres:
            # An array a column: one short statement whatever the rows, which
            # psycopg reads once, not a placeholder a value.
            arrays = ", ".join(f"%s::{cast}[]" for _, cast in _ROW)
            rows_from = f"unnest({arrays}) AS v({names})"
        else:
            values = ", ".join(["(" + ", ".join(["%s"] * len(_ROW)) + ")"] * rows)
            # A VALUES list's columns are column1, column2, …: named here.
            named = ", ".join(f"column{n} AS {name}" for n, (name, _) in enumerate(_ROW, 1))
            rows_from = f"(SELECT {named} FROM (VALUES {values})) AS v"
        due = "%s::timestamptz" if postgres else "%s"
        return (
            f"INSERT INTO {table} (batch_id, {names}, kind, lane, status, attempts, due_at, "
            f"last_error) SELECT {batch}, v.inbox, v.host, v.destination, v.via, v.sequence, "
            f"v.after_id, %s, %s, %s, 0, CASE WHEN v.after_id IS NULL AND NOT EXISTS "
            f"(SELECT 1 FROM {hosts} AS h WHERE h.name = v.host AND h.paused_at IS NOT NULL) "
            f"THEN {due} END, '' "
            f"FROM {rows_from}{join}"
        )

    return _statement(connection, f"deliveries {batch}{join}", 0 if postgres else rows, write)


def _batch_sql(connection: Any) -> str:
    def write() -> str:
        fields = [field for field in Batch._meta.concrete_fields if not field.primary_key]
        columns = ", ".join(connection.ops.quote_name(field.column) for field in fields)
        return (
            f"INSERT INTO {quoted_table(Batch, connection)} ({columns}) "
            f"VALUES ({', '.join(['%s'] * len(fields))}) RETURNING id"
        )

    return _statement(connection, "batch", 0, write)


def _first_statement_sql(connection: Any) -> str:
    """PostgreSQL's: the batch, its first deliveries and the notification."""

    def write() -> str:
        deliveries = _deliveries_sql(connection, 0, batch="new_batch.id", join=", new_batch")
        return (
            f"WITH new_batch AS ({_batch_sql(connection)}), new_deliveries AS ({deliveries}) "
            "SELECT id, pg_notify(%s, '') FROM new_batch"
        )

    return _statement(connection, "first", 0, write)


class _SQLiteCursor:
    """The driver's own cursor, for the few statements of a send, when nothing
    logs or wraps queries: what Django's wrapper adds around one of them (the
    ``%s`` to ``?`` rewrite, the checks, the timing) costs more than SQLite
    takes to insert a row. Errors are translated, and a broken transaction
    refused, as Django's cursor does."""

    def __init__(self, connection: Any) -> None:
        self.connection = connection
        connection.validate_thread_sharing()
        self.cursor = connection.connection.cursor()

    def __enter__(self) -> _SQLiteCursor:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.cursor.close()

    def execute(self, sql: str, params: Sequence[Any]) -> None:
        qmark = _QMARK.get(sql)
        if qmark is None:
            # The statements here hold no literal "%": every one is a placeholder.
            qmark = sql.replace("%s", "?")
            if len(_QMARK) < _KEPT_QMARK:
                _QMARK[sql] = qmark
        if self.connection.needs_rollback:
            self.connection.validate_no_broken_transaction()
        with self.connection.wrap_database_errors:
            self.cursor.execute(qmark, params)

    def fetchone(self) -> Any:
        return self.cursor.fetchone()


_QMARK: dict[str, str] = {}
_KEPT_QMARK = 64


def _cursor(connection: Any) -> Any:
    """A cursor for a send's statements: Django's, unless SQLite's own will do."""
    if (
        connection.vendor != "sqlite"
        or connection.queries_logged
        or connection.execute_wrappers
        or connection.connection is None
    ):
        return connection.cursor()
    return _SQLiteCursor(connection)
