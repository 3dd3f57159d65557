"""The queue's store: every query of the queue — enqueue, claim, settle, and
what is due when. (Not ``queue``: the standard library has that name.)

What tells PostgreSQL from SQLite for every raw statement is in dialect.py;
what each database is asked here differs only where it must. On PostgreSQL a
claim locks with ``FOR UPDATE SKIP LOCKED``, so any number of processes share
one queue; on SQLite the same claim is a single ``UPDATE … RETURNING``
statement, which SQLite runs under its one write lock.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import hashlib
import json
import operator
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

from django.db import DEFAULT_DB_ALIAS, models, transaction
from django.db.models import F, Max, Min
from django.db.models.signals import post_save, pre_save
from django.utils import timezone

from django_federation_delivery import history, wakeup
from django_federation_delivery.dialect import (
    connection_for,
    db_datetime,
    is_postgresql,
    quoted_table,
    rows_per_statement,
    skip_locked,
)
from django_federation_delivery.models import Batch, Delivery, Host, Lane, Status

#: Lanes in the order they are claimed; the low lane only when nothing else is due.
CLAIM_ORDER = (Lane.PRIORITY, Lane.NORMAL, Lane.LOW)
#: How many due rows a claim looks at for each it takes, so that a few hosts
#: at the head of the queue do not leave it short.
CANDIDATES = 4
#: Rows written, or looked up, in one statement.
CHUNK = 500
FINAL = frozenset({Status.DELIVERED, Status.REFUSED, Status.SKIPPED, Status.FAILED})


class Queued(NamedTuple):
    """A delivery about to be queued."""

    inbox: str
    host: str
    #: Where to POST, in order, when not the inbox itself: a portable
    #: inbox's gateways.
    via: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Claimed:
    """A delivery this process holds, until its lease lapses."""

    id: int
    batch_id: int
    inbox: str
    host: str
    attempts: int
    via: tuple[str, ...]
    token: str
    #: When the lease lapses, as ``time.time()``.
    leased_until: float


@dataclasses.dataclass(frozen=True)
class Settlement:
    """What to write for a claimed delivery once an attempt is over.

    ``status`` pending with a ``due_at`` is a retry; any other status takes
    the delivery out of the queue.
    """

    claimed: Claimed
    status: Status
    attempts: int
    due_at: dt.datetime | None = None
    last_status: int | None = None
    last_error: str = ""
    attempted_at: dt.datetime | None = None
    #: Whether its batch has an ordering key, so that settling it may
    #: release the next of its sequence.
    ordered: bool = False
    #: A pending one's attempt failed and is to be tried again: counted as
    #: retried in the history (one held unsent by a breaker or a pause is not).
    retried: bool = False


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
            waits_on = _last_of_sequences(batch.ordering_key, None, first, alias)
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
            waits_on = _last_of_sequences(batch.ordering_key, batch.id, chunk, alias)
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
    ("via", "jsonb"),
    ("sequence", "varchar"),
    ("after_id", "bigint"),
)
#: Values the statement takes once, whatever its rows: batch, lane, status, due.
_CONSTANTS = 4
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
            json.dumps(list(via)) if via else "[]",
            sequence_of(key, inbox) if key else "",
            waits_on.get(inbox),
        )
        for inbox, host, via in chunk
    ]
    constants = [batch.lane, str(Status.PENDING), due]
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
            f"INSERT INTO {table} (batch_id, {names}, lane, status, attempts, due_at, "
            f"last_error) SELECT {batch}, v.inbox, v.host, v.via, v.sequence, v.after_id, "
            f"%s, %s, 0, CASE WHEN v.after_id IS NULL AND NOT EXISTS (SELECT 1 FROM {hosts} "
            f"AS h WHERE h.name = v.host AND h.paused_at IS NOT NULL) THEN {due} END, '' "
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


def sequence_of(ordering_key: str, inbox: str) -> str:
    """The sequence an ordered delivery belongs to: its key, for its inbox."""
    if not ordering_key:
        return ""
    return hashlib.sha256(f"{ordering_key}\n{inbox}".encode()).hexdigest()


def _last_of_sequences(
    ordering_key: str, batch_id: int | None, inboxes: Sequence[Queued], alias: str
) -> dict[str, int]:
    """For each inbox, the last pending delivery queued before with the same
    ordering key (not of batch ``batch_id``), which the new one is to wait on.

    Found by the highest pending id of each sequence, one indexed look however
    long its backlog (a webhook destination after an outage). On PostgreSQL
    that row is locked until the caller commits, so that its settling
    meanwhile waits and then sees, and releases, its successor; one settled
    between the look and the lock is looked past.
    """
    if not ordering_key:
        return {}
    by_sequence = {sequence_of(ordering_key, queued.inbox): queued.inbox for queued in inboxes}
    pending = Delivery.objects.using(alias).filter(status=Status.PENDING)
    if batch_id is not None:
        pending = pending.exclude(batch_id=batch_id)
    locks = connection_for(alias).features.has_select_for_update
    last: dict[str, int] = {}
    sequences = list(by_sequence)
    for start in range(0, len(sequences), 500):
        todo = sequences[start : start + 500]
        while todo:
            found = dict(
                pending.filter(sequence__in=todo)
                .values("sequence")
                .annotate(last=Max("id"))
                .values_list("sequence", "last")
            )
            held = set(found.values())
            if locks and found:
                held = set(
                    pending.select_for_update()
                    .filter(id__in=list(found.values()))
                    .values_list("id", flat=True)
                )
            for sequence, id in found.items():
                if id in held:
                    last[by_sequence[sequence]] = id
            # What settled in between: look again for what is pending before it.
            todo = [sequence for sequence, id in found.items() if id not in held]
    return last


def claim(
    limit: int,
    lease: float,
    *,
    per_host: int | None = None,
    exclude_hosts: Iterable[str] = (),
    using: str | None = None,
) -> list[Claimed]:
    """Take up to ``limit`` due deliveries for ``lease`` seconds, lane by lane,
    in one transaction, and at most ``per_host`` to any one host.

    The claim pushes each row's due time forward by the lease and stamps it
    with a fresh token: only the holder of the token may settle it, and a row
    whose holder died comes due again when the lease lapses. Taking no more
    to a host than can be sent to it soon keeps one busy host's backlog from
    waiting out its lease in a single process, and leaves it to the others.
    """
    connection = connection_for(using)
    table = quoted_table(Delivery, connection)
    excluded = sorted(set(exclude_hosts))[:200]
    lock = skip_locked(connection)
    hosts = f" AND host NOT IN ({', '.join(['%s'] * len(excluded))})" if excluded else ""
    # The oldest due rows of the lane, then the first few of each host among them.
    candidates = (
        f"SELECT id, host, due_at FROM {table} WHERE status = %s AND lane = %s "
        f"AND due_at <= %s{hosts} ORDER BY due_at LIMIT %s{lock}"
    )
    ranked = (
        "SELECT id, due_at, ROW_NUMBER() OVER (PARTITION BY host ORDER BY due_at, id) AS turn "
        f"FROM ({candidates}) AS candidates"
    )
    sql = (
        f"UPDATE {table} SET due_at = %s, lease_token = %s WHERE id IN ("
        f"SELECT id FROM ({ranked}) AS ranked WHERE turn <= %s ORDER BY due_at, id LIMIT %s) "
        "RETURNING id, batch_id, inbox, host, attempts, via"
    )
    now = timezone.now()
    token = uuid.uuid4().hex
    until = db_datetime(now + dt.timedelta(seconds=lease), connection)
    cap = per_host or limit
    rows: list[Any] = []
    with transaction.atomic(using=using), connection.cursor() as cursor:
        for lane in CLAIM_ORDER:
            if len(rows) >= limit:
                break
            wanted = limit - len(rows)
            params = [until, token, Status.PENDING, lane, db_datetime(now, connection), *excluded]
            cursor.execute(sql, [*params, wanted * CANDIDATES, cap, wanted])
            # RETURNING gives no order; keep the queue's within each lane.
            rows.extend(sorted(cursor.fetchall(), key=lambda row: row[0]))
    # The lease as written (from before the claim), not from now: never later.
    expires = now.timestamp() + lease
    return [
        Claimed(row[0], row[1], row[2], row[3], row[4], _json_list(row[5]), token, expires)
        for row in rows
    ]


def _json_list(value: Any) -> tuple[str, ...]:
    # SQLite hands JSON back as text, psycopg as the value itself.
    if isinstance(value, str | bytes):
        value = json.loads(value)
    return tuple(value or ())


def settle(
    settlements: Sequence[Settlement],
    *,
    on_finished: Callable[[list[Batch]], None] | None = None,
    using: str | None = None,
) -> set[int]:
    """Write the outcome of each settlement whose claim is still held, in one
    statement.

    Returns the ids written; a settlement whose lease lapsed and whose row
    another process now holds is not written. Batches whose last pending
    delivery this settles are stamped finished, and ``on_finished`` is called
    with them inside the same transaction.
    """
    if not settlements:
        return set()
    connection = connection_for(using)
    now = timezone.now()
    settled_at = db_datetime(now, connection)
    values: list[Any] = []
    for item in settlements:
        final = item.status in FINAL
        values += [
            item.claimed.id,
            item.claimed.token,
            str(item.status),
            item.attempts,
            None if final else db_datetime(item.due_at, connection),
            item.last_status,
            item.last_error,
            db_datetime(item.attempted_at, connection),
            settled_at if final else None,
        ]
    with transaction.atomic(using=using):
        with connection.cursor() as cursor:
            cursor.execute(_settle_sql(connection, len(settlements)), values)
            written = {row[0] for row in cursor.fetchall()}
        final_rows = [s for s in settlements if s.status in FINAL and s.claimed.id in written]
        history.record(_history_of(settlements, written, now), using=using)
        _release_next([s.claimed.id for s in final_rows if s.ordered], now, using)
        finished = _count_down(Counter(s.claimed.batch_id for s in final_rows), now, using)
        if finished and on_finished is not None:
            on_finished(finished)
    return written


#: The history's count of each status a settlement leaves a delivery in.
_COUNTED = {
    Status.DELIVERED: "delivered",
    Status.REFUSED: "refused",
    Status.FAILED: "failed",
}


def _history_of(
    settlements: Sequence[Settlement], written: set[int], now: dt.datetime
) -> dict[dt.datetime, dict[str, int]]:
    """What the written settlements add to the history, in the minute of
    each attempt (or of the write, for one given up unsent)."""
    return history.counted(
        (item.attempted_at or now, "retried" if item.retried else _COUNTED[item.status])
        for item in settlements
        if item.claimed.id in written and (item.retried or item.status in _COUNTED)
    )


def _settle_sql(connection: Any, rows: int) -> str:
    table = quoted_table(Delivery, connection)
    # PostgreSQL types a VALUES list by its values, and a column of NULLs
    # would be text: say what each is.
    casts = (
        (
            "::bigint",
            "::varchar",
            "::varchar",
            "::integer",
            "::timestamptz",
            "::integer",
            "::text",
            "::timestamptz",
            "::timestamptz",
        )
        if is_postgresql(connection)
        else ("",) * 9
    )
    row = "(" + ", ".join(f"%s{cast}" for cast in casts) + ")"
    return (
        "WITH v(id, token, status, attempts, due_at, last_status, last_error, attempted_at, "
        f"settled_at) AS (VALUES {', '.join([row] * rows)}) "
        f"UPDATE {table} SET status = v.status, attempts = v.attempts, due_at = v.due_at, "
        "lease_token = NULL, last_status = v.last_status, last_error = v.last_error, "
        f"last_attempt_at = COALESCE(v.attempted_at, {table}.last_attempt_at), "
        f"settled_at = v.settled_at FROM v WHERE {table}.id = v.id "
        f"AND {table}.lease_token = v.token RETURNING {table}.id"
    )


def _release_next(settled: Sequence[int], now: dt.datetime, using: str | None) -> None:
    """Make due the deliveries that waited on ``settled`` ones: one indexed
    update, however long the sequences."""
    if not settled:
        return
    manager = Delivery.objects.using(using or DEFAULT_DB_ALIAS)
    for start in range(0, len(settled), 500):
        manager.filter(after_id__in=settled[start : start + 500], status=Status.PENDING).update(
            due_at=now, after=None
        )


#: Batches counted down by one statement at most (two parameters each).
COUNT_DOWN_CHUNK = 400


def _count_down(leaving: Counter[int], now: dt.datetime, using: str | None) -> list[Batch]:
    """Take the settled deliveries off their batches' counts; the batches
    that reach nought are finished now, and returned.

    One statement for every batch at once (a stream of one-inbox sends
    settles as many batches as deliveries). On PostgreSQL the batches'
    rows are locked first, in id order: deliverers counting down the same
    batches at once then wait on each other rather than deadlock.
    """
    if not leaving:
        return []
    connection = connection_for(using)
    table = quoted_table(Batch, connection)
    finished_at = db_datetime(now, connection)
    postgres = is_postgresql(connection)
    cast = ("::bigint", "::integer") if postgres else ("", "")
    done: list[int] = []
    items = sorted(leaving.items())
    with connection.cursor() as cursor:
        for start in range(0, len(items), COUNT_DOWN_CHUNK):
            chunk = items[start : start + COUNT_DOWN_CHUNK]
            ids = [batch_id for batch_id, _ in chunk]
            if postgres:
                cursor.execute(
                    f"SELECT id FROM {table} WHERE id = ANY(%s) ORDER BY id FOR UPDATE", [ids]
                )
            row = f"(%s{cast[0]}, %s{cast[1]})"
            # Every right-hand side reads the row as it was: ``remaining``
            # in finished_at's CASE is the count before this update.
            cursor.execute(
                f"WITH v(id, n) AS (VALUES {', '.join([row] * len(chunk))}) "
                f"UPDATE {table} SET "
                f"remaining = CASE WHEN {table}.remaining > v.n "
                f"THEN {table}.remaining - v.n ELSE 0 END, "
                f"finished_at = CASE WHEN {table}.remaining > v.n THEN NULL ELSE %s END "
                f"FROM v WHERE {table}.id = v.id AND {table}.finished_at IS NULL "
                f"RETURNING {table}.id, {table}.remaining",
                [*(value for pair in chunk for value in pair), finished_at],
            )
            done += [batch_id for batch_id, remaining in cursor.fetchall() if remaining == 0]
    if not done:
        return []
    manager = Batch.objects.using(using or DEFAULT_DB_ALIAS).order_by("id")
    return list(manager.filter(id__in=sorted(done)))


def batches(ids: Iterable[int], *, using: str | None = None) -> dict[int, Batch]:
    return {
        batch.id: batch
        for batch in Batch.objects.using(using or DEFAULT_DB_ALIAS).filter(id__in=list(ids))
    }


def next_due(*, using: str | None = None) -> dt.datetime | None:
    """When the next pending delivery comes due, in any lane (one index read a lane)."""
    manager = Delivery.objects.using(using or DEFAULT_DB_ALIAS)
    times = [
        manager.filter(status=Status.PENDING, lane=lane).aggregate(at=Min("due_at"))["at"]
        for lane in CLAIM_ORDER
    ]
    known = [at for at in times if at is not None]
    return min(known) if known else None


def count_due(*, using: str | None = None) -> int:
    """How many pending deliveries are due now (the partial index, lane by lane)."""
    manager = Delivery.objects.using(using or DEFAULT_DB_ALIAS)
    now = timezone.now()
    return sum(
        manager.filter(status=Status.PENDING, lane=lane, due_at__lte=now).count()
        for lane in CLAIM_ORDER
    )


def has_due(*, using: str | None = None) -> bool:
    """Whether anything is due now: the cheap check for work queued elsewhere."""
    manager = Delivery.objects.using(using or DEFAULT_DB_ALIAS)
    now = timezone.now()
    return any(
        manager.filter(status=Status.PENDING, lane=lane, due_at__lte=now).exists()
        for lane in CLAIM_ORDER
    )


class GivenUp(NamedTuple):
    """A delivery :func:`give_up_rows` failed: what its signal tells."""

    id: int
    batch_id: int
    inbox: str
    last_status: int | None


def give_up_rows(
    ids: Sequence[int],
    reason: str,
    *,
    on_failing: Callable[[list[GivenUp]], None] | None = None,
    on_finished: Callable[[list[Batch]], None] | None = None,
    using: str | None = None,
) -> list[int]:
    """Fail pending deliveries for good, whoever holds them: a holder's late
    outcome is fenced out, as its token is gone. Returns the ids failed.

    ``on_failing`` is called with exactly the rows this changed, inside the
    transaction, before it commits: a row another process settled in the
    meantime is not among them, and a crash before the commit leaves the
    rows pending, to be given up (and told about) again.
    """
    if not ids:
        return []
    alias = using or DEFAULT_DB_ALIAS
    connection = connection_for(alias)
    table = quoted_table(Delivery, connection)
    now = timezone.now()
    # One statement that both picks and changes the rows: what it returns is
    # what it changed, whatever another process did a moment before.
    sql = (
        f"UPDATE {table} SET status = %s, due_at = NULL, lease_token = NULL, "
        f"settled_at = %s, last_error = %s WHERE status = %s "
        f"AND id IN ({', '.join(['%s'] * len(ids))}) "
        "RETURNING id, batch_id, inbox, last_status"
    )
    params = [str(Status.FAILED), db_datetime(now, connection), reason, str(Status.PENDING)]
    with transaction.atomic(using=alias):
        with connection.cursor() as cursor:
            cursor.execute(sql, [*params, *ids])
            rows = sorted(GivenUp(*row) for row in cursor.fetchall())
        if rows and on_failing is not None:
            on_failing(rows)
        history.record({now: {"failed": len(rows)}}, using=alias)
        failed = [row.id for row in rows]
        _release_next(failed, now, alias)
        finished = _count_down(Counter(row.batch_id for row in rows), now, alias)
        if finished and on_finished is not None:
            on_finished(finished)
    return failed


def requeue_rows(ids: Sequence[int], *, using: str | None = None) -> int:
    """Put settled deliveries back in the queue, due now; their attempts so far
    are kept. Returns how many."""
    alias = using or DEFAULT_DB_ALIAS
    now = timezone.now()
    manager = Delivery.objects.using(alias)
    with transaction.atomic(using=alias):
        rows = list(
            manager.select_for_update()
            .filter(id__in=list(ids), status__in=list(FINAL - {Status.DELIVERED}))
            .values_list("id", "batch_id")
        )
        manager.filter(id__in=[id for id, _ in rows]).update(
            status=Status.PENDING, due_at=now, lease_token=None, settled_at=None
        )
        for batch_id, count in Counter(batch_id for _, batch_id in rows).items():
            Batch.objects.using(alias).filter(id=batch_id).update(
                remaining=F("remaining") + count, finished_at=None
            )
    transaction.on_commit(wakeup.notify_local, using=alias)
    return len(rows)
