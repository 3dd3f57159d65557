"""What a send writes: its batch, and a pending delivery an inbox, in the
same few statements whatever the number of inboxes; and what a replay
writes, many batches in the same few statements a step."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

from django.conf import settings
from django.db import models, transaction
from django.db.models.signals import post_save, pre_save
from django.utils import timezone

from django_federation_delivery.addresses import quoted
from django_federation_delivery.conf import database_alias
from django_federation_delivery.dialect import (
    aware_now,
    connection_for,
    db_datetime,
    is_postgresql,
    json_parameter,
    rows_per_statement,
)
from django_federation_delivery.exceptions import InvalidDelivery
from django_federation_delivery.models import Batch, Kind
from django_federation_delivery.store import sql, wakes
from django_federation_delivery.store.sequences import (
    chain,
    last_of_sequences,
    later_lanes,
    lock_sequences,
    promote,
    sequence_of,
)

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
    #: Whether it waits for the one queued before it with the batch's ordering
    #: key to the same inbox (none without an ordering key).
    ordered: bool = True


#: How many times a send inserts its batch when the batch kept under its
#: idempotency key is purged each time between the insert and its read.
KEPT_TRIES = 3


def enqueue(
    batch: Batch,
    inboxes: Sequence[Queued],
    *,
    kind: str = Kind.ACTIVITYPUB,
    using: str | None = None,
    waits_on: Mapping[str, int] | None = None,
) -> Batch:
    """Write ``batch`` and one pending delivery per inbox, each of ``kind``;
    or, when a batch with its ``idempotency_key`` is kept, write nothing and
    return that one, whichever kind of send wrote it: the caller refuses one
    of the other kind (:func:`of_kind`) once out of its transaction.

    With an ordering key, each delivery waits on the last one pending in its
    sequence, looked up; ``waits_on`` ({inbox: delivery id}) instead says
    which, for a caller that knows (a replay, chaining its own batches).

    Run inside the caller's transaction: on commit a deliverer in this process
    is woken at once, and on PostgreSQL every listening process too.

    Written with a few plain statements rather than the ORM's: a send is on
    the caller's request path, and building a model and a compiled query per
    row cost more than the database took to write them. When nothing logs
    or wraps queries they run on the driver's own cursor (see
    :class:`~.sql.Statements`).
    """
    alias = using or database_alias()
    connection = connection_for(alias)
    now = aware_now()
    _prepare(batch, inboxes, now, alias)
    batch_values = _batch_values(batch, connection)
    due = db_datetime(now, connection)
    per_statement = rows_per_statement(
        connection, most=CHUNK, per_row=len(_COLUMNS), constants=_CONSTANTS
    )
    # The lanes of those it waits on, where they are read with them.
    lanes: dict[int, str] = {}
    if waits_on is None:
        # Whoever else queues in these sequences waits until this commits,
        # and then sees what it queued.
        lock_sequences(batch.ordering_key, _ordered(inboxes), alias)
        if is_postgresql(connection):
            # Each looked up before any delivery of this send is written:
            # looked up a chunk at a time after the chunks before it, a
            # planner whose statistics call the table small walks the send's
            # own rows, every chunk (minutes for 50,000 inboxes). (SQLite's
            # are looked up once the batch's write has taken the lock.)
            waits_on = _last_of(batch, inboxes, alias, lanes)
    with sql.on(connection, driver=True) as db:
        # A batch kept under its idempotency key that a purge deletes between
        # the insert that met it and the read of it frees the key: inserted
        # again, it is written (or meets a newer one, sent meanwhile).
        for _ in range(KEPT_TRIES):
            if db.postgresql and inboxes:
                # The batch, its first deliveries and the wake-up of every
                # listening process in one round trip.
                first = inboxes[:per_statement]
                one = len(first) == 1
                batch.id = db.value(
                    "insert_batch_and_delivery" if one else "insert_batch_and_deliveries",
                    batch=batch_values,
                    **_delivery_params(
                        connection,
                        batch,
                        first,
                        waits_on or {},
                        due,
                        kind,
                        one_row=one,
                    ),
                )
                done = len(first)
            else:
                # Written first: on SQLite the write lock is taken before anything is read.
                batch.id = db.value("insert_batch", batch=batch_values)
                done = 0
            if batch.id is not None:
                break
            # Sent before with this idempotency key, and kept: nothing is queued.
            kept = _kept(batch.idempotency_key, alias)
            if kept is not None:
                return kept
        else:
            raise Batch.DoesNotExist("the batch kept under this idempotency key is gone")
        _written(batch, alias)
        if waits_on is None:
            waits_on = _last_of(batch, inboxes, alias, lanes)
        # A statement at a time, each a bounded chunk: 100,000 rows' values at
        # once is memory a fan-out does not need.
        for start in range(done, len(inboxes), per_statement):
            chunk = inboxes[start : start + per_statement]
            db.run(
                "insert_deliveries",
                batch_id=batch.id,
                **_delivery_params(connection, batch, chunk, waits_on, due, kind),
            )
    if waits_on and (not lanes or not set(lanes.values()).isdisjoint(later_lanes(batch.lane))):
        # What it waits on is claimed as soon as it would be. (Where their
        # lanes were read as they were locked, only if one of them is
        # claimed later: what each waits on in turn was taken into its lane
        # when it was queued.)
        promote(waits_on.values(), batch.lane, alias)
    _saved(batch, alias)
    transaction.on_commit(wakes.notify_local, using=alias)
    return batch


class Enqueued(NamedTuple):
    """A batch about to be queued with others (:func:`enqueue_all`)."""

    batch: Batch
    inboxes: Sequence[Queued]
    kind: str = Kind.ACTIVITYPUB


def enqueue_all(
    items: Sequence[Enqueued],
    *,
    waits_on: Mapping[str, Mapping[str, int]],
    using: str | None = None,
) -> list[Batch]:
    """Write each of ``items`` as :func:`enqueue` writes one batch, in a few
    statements for all of them, however many: their batches one multi-row
    ``INSERT`` a chunk, then their deliveries a chunk at a time, as a
    fan-out's are. Returns the batches in the order given.

    Each batch has an idempotency key of its own, which tells the rows the
    database returns apart: one kept under it is returned instead, marked
    not created, and nothing of it is written.

    Each inbox's first new delivery in an ordering key waits on the one
    ``waits_on`` ({ordering key: {inbox: delivery id}}) names, if any; the
    others on the one written before them in their sequence
    (:func:`~.sequences.chain`). The caller has locked the sequences and
    looked those up. Run inside the caller's transaction, waking the
    deliverers on commit as :func:`enqueue` does.
    """
    if not items:
        return []
    keys = [item.batch.idempotency_key for item in items]
    if not all(keys) or len(set(keys)) < len(keys):
        raise ValueError("enqueue_all needs an idempotency key of its own for each batch")
    alias = using or database_alias()
    connection = connection_for(alias)
    now = aware_now()
    for item in items:
        _prepare(item.batch, item.inboxes, now, alias)
    ids: dict[str, int] = {}
    columns = [field.column for field in _batch_fields()]
    per_statement = rows_per_statement(connection, most=CHUNK, per_row=len(columns))
    with sql.on(connection, driver=True) as db:
        for start in range(0, len(items), per_statement):
            chunk = items[start : start + per_statement]
            values = [_batch_values(item.batch, connection) for item in chunk]
            batches: Any = values
            if db.postgresql:
                batches = json_parameter([dict(zip(columns, row, strict=True)) for row in values])
            ids.update((key, id) for id, key, *_ in db.all("insert_batches", batches=batches))
        kept = _kept_all([key for key in keys if key not in ids], alias)
        created = []
        for item in items:
            if item.batch.idempotency_key in ids:
                item.batch.id = ids[item.batch.idempotency_key]
                _written(item.batch, alias)
                created.append(item)
        _write_deliveries(db, created, waits_on, db_datetime(now, connection))
    if any(item.batch.ordering_key for item in created):
        chain([item.batch.id for item in created], alias)
    for item in created:
        _saved(item.batch, alias)
    if created:
        transaction.on_commit(wakes.notify_local, using=alias)
    return [kept.get(item.batch.idempotency_key, item.batch) for item in items]


def _write_deliveries(
    db: sql.Statements,
    created: Sequence[Enqueued],
    waits_on: Mapping[str, Mapping[str, int]],
    due: Any,
) -> None:
    """The pending deliveries of the batches ``created`` (written, with
    their ids), those of a kind and lane a chunk at a time, in the order
    given: each inbox's first of an ordering key waiting on what
    ``waits_on`` names."""
    first: set[tuple[str, str]] = set()
    rows: dict[tuple[str, str], list[tuple[Any, ...]]] = {}
    for batch, inboxes, kind in created:
        key = batch.ordering_key
        waiting = waits_on.get(key, {})
        after = {}
        for item in inboxes:
            if key and item.ordered and (key, item.inbox) not in first:
                first.add((key, item.inbox))
                if item.inbox in waiting:
                    after[item.inbox] = waiting[item.inbox]
        rows.setdefault((str(kind), batch.lane), []).extend(
            (batch.id, *row) for row in _delivery_rows(key, inboxes, after)
        )
    connection = db.connection
    per_statement = rows_per_statement(
        connection, most=CHUNK, per_row=len(_COLUMNS) + 1, constants=len(_SHARED)
    )
    for (kind, lane), written in rows.items():
        for start in range(0, len(written), per_statement):
            chunk = written[start : start + per_statement]
            constants = dict(zip(_SHARED, (kind, lane, due), strict=True))
            if not db.postgresql:
                db.run("insert_batches_deliveries", **constants, rows=chunk)
                continue
            columns = [list(column) for column in zip(*chunk, strict=True)]
            named = dict(zip(("batch_ids", *_COLUMNS), columns, strict=True))
            db.run("insert_batches_deliveries", **constants, **named)


def _prepare(batch: Batch, inboxes: Sequence[Queued], now: Any, alias: str) -> None:
    """``batch`` made ready to be written with ``inboxes``: its counts and
    time set, and ``pre_save`` sent as ``Model.save`` sends it."""
    batch.size = batch.remaining = len(inboxes)
    batch.created_at = now
    pre_save.send(sender=Batch, instance=batch, raw=False, using=alias, update_fields=None)


#: A batch's date and time fields, by their attribute names.
_DATETIME_FIELDS = [
    field.attname
    for field in Batch._meta.concrete_fields
    if isinstance(field, models.DateTimeField)
]


def _written(batch: Batch, alias: str) -> None:
    """``batch``, its row written, known as saved to ``alias``."""
    batch._state.adding = False
    batch._state.db = alias


def _saved(batch: Batch, alias: str) -> None:
    """``post_save`` for ``batch``, once it and its deliveries are written,
    its times as the ORM reads them back: with ``USE_TZ`` off, naive in
    ``TIME_ZONE`` (written by hand, they were the package's, aware in UTC,
    which a project's ``timezone.now() - batch.created_at`` cannot take)."""
    if not settings.USE_TZ:
        zone = timezone.get_default_timezone()
        for field in _DATETIME_FIELDS:
            value = getattr(batch, field)
            if value is not None and timezone.is_aware(value):
                setattr(batch, field, timezone.make_naive(value, zone))
    post_save.send(
        sender=Batch, instance=batch, created=True, update_fields=None, raw=False, using=alias
    )


def kept_batch(idempotency_key: str, *, kind: str, using: str | None = None) -> Batch | None:
    """The batch kept under ``idempotency_key``, marked not created, or None
    (and no query) without a key: for a send of ``kind`` retried with nothing
    left to queue, which writes no batch for the key to meet.
    ``InvalidDelivery`` when the other kind of send wrote it (:func:`of_kind`)."""
    if not idempotency_key:
        return None
    kept = _kept(idempotency_key, using or database_alias())
    return None if kept is None else of_kind(kept, kind)


def of_kind(batch: Batch, kind: str) -> Batch:
    """``batch``, written by a send of ``kind`` or kept under its idempotency
    key, as that send returns it: ``InvalidDelivery`` naming the key when it
    is kept and the other kind of send wrote it.

    An activity's batches and a webhook event's share their keys (one unique
    index): a view that keys both by what it made (``post-1``) would
    otherwise be given the activity's batch for its event, and the event
    never queued. Raised once out of the send's transaction, so that, as any
    bad argument, it leaves the caller's as it was; nothing was written.
    """
    webhook = kind == Kind.WEBHOOK
    if batch.created or bool(batch.event_type) == webhook:
        return batch
    held_by, sent = (
        ("an activity's", "a webhook event") if webhook else ("a webhook event's", "an activity")
    )
    raise InvalidDelivery(
        f"idempotency_key {quoted(batch.idempotency_key)} is held by {held_by} batch "
        f"(id {batch.pk}): give {sent} a key of its own"
    )


def _kept_all(keys: Sequence[str], alias: str) -> dict[str, Batch]:
    """The batches kept under ``keys``, by key, marked not created:
    ``Batch.DoesNotExist`` if one is gone (purged since its key was met)."""
    kept: dict[str, Batch] = {}
    for start in range(0, len(keys), CHUNK):
        chunk = keys[start : start + CHUNK]
        for batch in Batch.objects.using(alias).filter(idempotency_key__in=chunk):
            batch.created = False
            kept[batch.idempotency_key] = batch
    if len(kept) < len(keys):
        raise Batch.DoesNotExist("a batch kept under its idempotency key is gone")
    return kept


def _kept(idempotency_key: str, alias: str) -> Batch | None:
    """The batch kept under ``idempotency_key``, of whichever kind, marked
    not created."""
    kept = Batch.objects.using(alias).filter(idempotency_key=idempotency_key).first()
    if kept is not None:
        kept.created = False
    return kept


def writing(
    count: int, *, ordering_key: str = "", alone: bool = True, using: str | None = None
) -> contextlib.AbstractContextManager[Any]:
    """The transaction a send of ``count`` deliveries writes in.

    On PostgreSQL, outside any transaction (autocommit), a send whose
    batch and deliveries are one statement (``alone``: nothing else to
    write with them; no ordering key, whose last deliveries are locked
    until the commit; ``count`` within a statement's rows) needs none of
    its own: that statement is atomic by itself, and a ``BEGIN`` and a
    ``COMMIT`` are two round trips more. Otherwise an atomic block, without
    a savepoint: inside the caller's transaction the send's statements are
    the caller's, and one that fails leaves it to roll back.
    """
    connection = connection_for(using or database_alias())
    if (
        alone
        and not ordering_key
        and 0 < count <= CHUNK
        and is_postgresql(connection)
        and connection.get_autocommit()
        and not connection.in_atomic_block
    ):
        return contextlib.nullcontext()
    return transaction.atomic(using=using, savepoint=False)


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
        fields = _batch_fields()
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


def _batch_fields() -> list[models.Field[Any, Any]]:
    """The columns a batch's INSERT writes: all of the model's but its id."""
    return [field for field in Batch._meta.concrete_fields if not field.primary_key]


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


def _last_of(
    batch: Batch, inboxes: Sequence[Queued], alias: str, lanes: dict[int, str]
) -> dict[str, int]:
    """What each of ``inboxes`` that waits its turn waits on: the last
    delivery pending in its sequence, none of this send's own (their lanes
    in ``lanes``, where they are read: see ``last_of_sequences``)."""
    return last_of_sequences(batch.ordering_key, batch.id, _ordered(inboxes), alias, lanes=lanes)


def _ordered(chunk: Sequence[Queued]) -> list[str]:
    """The inboxes of ``chunk`` that wait their turn in a sequence."""
    return [queued.inbox for queued in chunk if queued.ordered]


def _delivery_params(
    connection: Any,
    batch: Batch,
    chunk: Sequence[Queued],
    waits_on: Mapping[str, int],
    due: Any,
    kind: str,
    *,
    one_row: bool = False,
) -> dict[str, Any]:
    """What ``insert_deliveries`` takes: the values every row has, then the
    rows, row after row on SQLite and an array a column on PostgreSQL; or
    there, for ``insert_batch_and_delivery``, the ``one_row``'s values."""
    constants = {"kind": str(kind), "lane": batch.lane, "due": due}
    rows = _delivery_rows(batch.ordering_key, chunk, waits_on)
    if not is_postgresql(connection):
        return {**constants, "rows": rows}
    if one_row:
        (row,) = rows
        return {**constants, **dict(zip(_ONE_ROW, row, strict=True))}
    columns = [list(column) for column in zip(*rows, strict=True)]
    return {**constants, **dict(zip(_COLUMNS, columns, strict=True))}


def _delivery_rows(
    key: str, chunk: Sequence[Queued], waits_on: Mapping[str, int]
) -> list[tuple[Any, ...]]:
    """The rows of ``chunk``, with ordering key ``key``, as a statement
    writes them: inbox, host, destination, gateways, sequence, what it waits on."""
    return [
        (
            inbox,
            host,
            destination,
            json.dumps(list(via)) if via else "[]",
            sequence_of(key, inbox) if key and ordered else "",
            waits_on.get(inbox),
        )
        for inbox, host, via, destination, ordered in chunk
    ]


#: PostgreSQL's names of a chunk's columns, in a row's order.
_COLUMNS = ("inboxes", "hosts", "destinations", "vias", "sequences", "after_ids")
#: And of a row's values, when it is the one row of a send.
_ONE_ROW = ("inbox", "host", "destination", "via", "sequence", "after_id")
#: Values the statement takes once, whatever its rows: batch, kind, lane, due.
_CONSTANTS = 4
#: And those a chunk of several batches' deliveries takes once.
_SHARED = ("kind", "lane", "due")
