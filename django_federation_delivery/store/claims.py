"""The claim and its lease, and what is due when.

On PostgreSQL a claim locks with ``FOR UPDATE SKIP LOCKED``, so any number of
processes share one queue, and takes every lane's share in one ``UPDATE …
RETURNING``, a transaction of its own. On SQLite one write lock serves
instead: the claim reads each lane's candidates, picks among them, and takes
what it picked, the reads coming back as one JSON value each (see
``_take_sqlite``).
"""

from __future__ import annotations

import collections
import dataclasses
import datetime as dt
import json
import time
import uuid
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

from django.db import OperationalError, transaction

from django_federation_delivery.conf import LEASE_MARGIN_SECONDS, database_alias
from django_federation_delivery.dialect import (
    aware_now,
    connection_for,
    db_datetime,
    orm_datetime,
    read_datetime,
)
from django_federation_delivery.models import Batch, Delivery, Lane, Status
from django_federation_delivery.store import sql

#: Lanes in the order they are claimed; the low lane only when nothing else is due.
CLAIM_ORDER = (Lane.WEBHOOK, Lane.PRIORITY, Lane.NORMAL, Lane.LOW)
#: How many due rows a claim looks at for each it takes, so that a few hosts
#: at the head of the queue do not leave it short.
CANDIDATES = 4
#: The most hosts a claim names to take alone.
MOST_HOSTS = 200
#: The most hosts a claim leaves out: every host whose breaker holds all of
#: it, which on a large instance may be hundreds; past this many, the rest's
#: due rows are claimed and held back again.
MOST_EXCLUDED = 10_000


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
    #: A webhook's destination, by name; "" for an inbox.
    destination: str = ""
    #: How it is sent (``models.Kind``): what the loop asks for its job.
    kind: str = "activitypub"
    #: Why it cannot be sent as it is stored (its gateways not a list of
    #: URLs: a row written by hand), in words that quote none of its URLs;
    #: "" for one to send. Such a row is failed by itself (``triage.py``).
    problem: str = ""
    #: The status its last attempt was answered with, if any: what a failure
    #: without an attempt (its batch's deadline passed) tells.
    last_status: int | None = None
    #: Its lane (``models.Lane``): its batch's, or a sooner one that a
    #: delivery waiting on it in its sequence took it into
    #: (``sequences.promote``); "" for its batch's.
    lane: str = ""


def lease_deadline(row: Claimed) -> float:
    """When an attempt at ``row`` must be over, as ``time.monotonic()``: while
    the claim's lease holds, with time to spare to write what came of it;
    after that the row is any process's to take and send again. Whatever its
    kind: an inbox's job and a webhook's carry it alike."""
    return time.monotonic() + (row.leased_until - time.time()) - LEASE_MARGIN_SECONDS


def claim(
    limit: int,
    lease: float,
    *,
    per_host: int | None = None,
    exclude_hosts: Iterable[str] = (),
    only_hosts: Iterable[str] = (),
    lanes: Iterable[str] | None = None,
    using: str | None = None,
) -> list[Claimed]:
    """Take up to ``limit`` due deliveries for ``lease`` seconds, lane by lane
    (those of ``lanes`` alone, if given), in one transaction, and at most
    ``per_host`` to any one host; none to ``exclude_hosts``, and, if
    ``only_hosts`` names any, to those alone.

    The claim pushes each row's due time forward by the lease and stamps it
    with a fresh token: only the holder of the token may settle it, and a row
    whose holder died comes due again when the lease lapses. Taking no more
    to a host than can be sent to it soon keeps one busy host's backlog from
    waiting out its lease in a single process, and leaves it to the others.
    """
    connection = connection_for(using)
    excluded = sorted(set(exclude_hosts))[:MOST_EXCLUDED]
    only = sorted(set(only_hosts) - set(excluded))[:MOST_HOSTS]
    if only_hosts and not only:
        return []
    now = aware_now()
    token = uuid.uuid4().hex
    wanted = _Wanted(
        limit=limit,
        cap=per_host or limit,
        now=db_datetime(now, connection),
        until=db_datetime(now + dt.timedelta(seconds=lease), connection),
        token=token,
        excluded=excluded,
        only=only,
        lanes=_lanes(lanes),
    )
    with sql.on(connection) as db:
        if db.postgresql:
            # One statement: a transaction by itself (or a part of the caller's).
            rows = _take_postgresql(db, wanted)
        else:
            with transaction.atomic(using=using):
                rows = _take_sqlite(db, wanted)
    # The lease as written (from before the claim), not from now: never later.
    expires = now.timestamp() + lease
    claimed = []
    for row in rows:
        # Its gateways as their JSON text: PostgreSQL's as Django reads it,
        # SQLite's a text inside the claim's one JSON value (claimed_rows).
        via = stored_gateways(row[5])
        claimed.append(
            Claimed(
                row[0],
                row[1],
                row[2],
                row[3],
                row[4],
                () if via is None else via,
                token,
                expires,
                row[6],
                row[7],
                "" if via is not None else BAD_GATEWAYS,
                row[8],
                row[9] if row[9] in RANK else "",
            )
        )
    return claimed


#: Each lane's parameter of the statements that read every lane (``claim``,
#: ``next_due``, ``has_due``), in the claim's order.
LANES: dict[str, str] = {f"lane{rank}": lane for rank, lane in enumerate(CLAIM_ORDER)}
#: What must never wait behind a fan-out: the lanes a busy deliverer looks
#: in for what came due while it had enough in hand (``Intake``).
URGENT = (Lane.WEBHOOK, Lane.PRIORITY)
#: Each lane's place in the claim's order, the first first.
RANK: dict[str, int] = {lane: rank for rank, lane in enumerate(CLAIM_ORDER)}
#: A lane's parameter for a lane left out: no row has it.
_NO_LANE = ""


def _lanes(only: Iterable[str] | None) -> dict[str, str]:
    """The lanes' parameters, with those not in ``only`` (if given) left out."""
    if only is None:
        return LANES
    kept = set(only)
    return {name: lane if lane in kept else _NO_LANE for name, lane in LANES.items()}


class _Wanted(NamedTuple):
    """What a claim asks for, as its statements' parameters."""

    limit: int
    #: The most to one host.
    cap: int
    now: Any
    #: The lease's end, the rows' due time once taken.
    until: Any
    token: str
    excluded: list[str]
    only: list[str]
    #: The lanes' parameters (``LANES``, or some left out: ``_lanes``).
    lanes: dict[str, str]


def _take_postgresql(db: sql.Statements, wanted: _Wanted) -> list[Any]:
    """Every lane's share in one statement (``claim``): each lane's
    candidates locked (passing those another process holds), in the room
    the lanes before it leave of ``limit × CANDIDATES``, so that a later
    lane's rows are not even locked while an earlier one has enough; then
    the first ``cap`` of each host among them taken, lane by lane. One round
    trip, where a statement a lane in a transaction made five."""
    rows = db.all(
        "claim",
        **wanted.lanes,
        now=wanted.now,
        excluded=wanted.excluded,
        only=wanted.only or None,
        budget=wanted.limit * CANDIDATES,
        until=wanted.until,
        token=wanted.token,
        cap=wanted.cap,
        limit=wanted.limit,
    )
    # RETURNING gives no order: the lanes' and, within each, the queue's.
    return sorted(rows, key=lambda row: (RANK.get(row[-1], len(RANK)), row[0]))


def _take_sqlite(db: sql.Statements, wanted: _Wanted) -> list[Any]:
    """Each lane's candidates read as one value (``claim_candidates``), the
    first ``cap`` of each host among them picked here, then the rows picked
    read and taken, each in one statement for every lane.

    SQLite ranks by a window function several times slower than this picks.
    The transaction holds the write lock from the start, so what is read is
    still due when it is taken.
    """
    db.lock_for_writing()
    excluded = json.dumps(wanted.excluded)
    only = json.dumps(wanted.only) if wanted.only else None
    picked: list[int] = []
    # PER_HOST holds across the lanes of one claim, as on PostgreSQL.
    taken: collections.Counter[str] = collections.Counter()
    for lane in wanted.lanes.values():
        if lane == _NO_LANE:
            continue
        if len(picked) >= wanted.limit:
            break
        room = wanted.limit - len(picked)
        candidates = db.json(
            "claim_candidates",
            lane=lane,
            now=wanted.now,
            excluded=excluded,
            only=only,
            candidates=room * CANDIDATES,
        )
        lane_picked = []
        for id, host in candidates:
            if taken[host] < wanted.cap:
                taken[host] += 1
                lane_picked.append(id)
                if len(lane_picked) >= room:
                    break
        # The queue's order within each lane.
        picked += sorted(lane_picked)
    if not picked:
        return []
    ids = db.ids(picked)
    order = {id: n for n, id in enumerate(picked)}
    rows = sorted(db.json("claimed_rows", ids=ids), key=lambda row: order[row[0]])
    db.run("take", until=wanted.until, token=wanted.token, ids=ids)
    return rows


#: A claimed row's ``problem`` when its ``via`` is not a list of URLs.
BAD_GATEWAYS = "its stored gateways (via) are not a list of URLs"


def stored_gateways(value: Any) -> tuple[str, ...] | None:
    """A row's gateways (``via``): a list of URLs, stored as JSON and read as
    text to parse. None when it is anything else (no JSON, a number, an
    object, a list of anything but text: written by hand), which no attempt
    can use, nor is it to be read as something it is not (an object's keys
    as gateways)."""
    if value is None or value == "[]" or value == b"[]":
        return ()  # the usual inbox, with no gateways: nothing to parse
    if isinstance(value, str | bytes):
        try:
            value = json.loads(value)
        except ValueError:
            return None
        if value is None:
            return ()  # JSON's null, as SQL's: no gateways
    if not isinstance(value, list) or not all(isinstance(url, str) for url in value):
        return None
    return tuple(value)


class BatchInfo(NamedTuple):
    """What the loop keeps of a claimed delivery's batch while its deliveries
    are sent: the columns it sends and settles by, not a model (a stream of
    one-inbox sends reads a batch for every delivery)."""

    id: int
    sender: str
    #: The activity, or a webhook's event, as sent.
    body: bytes
    body_sha256: str
    tag: str
    deadline: dt.datetime | None
    max_attempts: int | None
    synchronize_collection: bool
    #: Whether it has an ordering key, whose next delivery its settling releases.
    ordered: bool
    #: A webhook event's type; "" for an activity.
    event_type: str = ""
    #: The lane it was sent in (``models.Lane``).
    lane: str = Lane.NORMAL
    #: The trace context of the span that sent it, "" for none (``tracing.py``).
    trace_context: str = ""


def batches(ids: Iterable[int], *, using: str | None = None) -> dict[int, BatchInfo]:
    """The batches of claimed deliveries, by id; one deleted meanwhile is
    missing. (``claimed_batches``: on SQLite read as one value, as a claim's
    rows are.)"""
    wanted = sorted(set(ids))
    if not wanted:
        return {}
    connection = connection_for(using)
    with sql.on(connection) as db:
        if db.postgresql:
            found = db.all("claimed_batches", ids=db.ids(wanted))
        else:
            try:
                found = db.json("claimed_batches", ids=db.ids(wanted))
            except OperationalError as exc:
                if BLOB_IN_JSON not in str(exc):
                    raise
                # A body written as a BLOB (by hand: send() writes text), which
                # SQLite's JSON cannot hold: the same columns read without
                # JSON, through the ORM, the body as its bytes. Failing here
                # would read as the database being away, every claim, for good.
                found = _batches_by_orm(wanted, using)
    return {row[0]: _batch(row, connection) for row in found}


#: What SQLite's JSON functions say of a BLOB value.
BLOB_IN_JSON = "JSON cannot hold BLOB values"
#: The columns of ``claimed_batches``, in its order.
BATCH_COLUMNS = (
    "id",
    "sender",
    "body",
    "body_sha256",
    "tag",
    "deadline",
    "max_attempts",
    "synchronize_collection",
    "ordering_key",
    "event_type",
    "lane",
    "trace_context",
)


def _batches_by_orm(ids: list[int], using: str | None) -> list[Any]:
    """The rows ``claimed_batches`` reads, read by the ORM: one claim's
    batches, a few hundred at most."""
    manager = Batch.objects.using(using or database_alias())
    return list(manager.filter(id__in=ids).values_list(*BATCH_COLUMNS))


def _batch(row: Sequence[Any], connection: Any) -> BatchInfo:
    (
        id,
        sender,
        body,
        digest,
        tag,
        deadline,
        most,
        synchronize,
        ordering_key,
        event_type,
        lane,
        trace_context,
    ) = row
    return BatchInfo(
        id,
        sender,
        body if isinstance(body, bytes) else body.encode(),
        digest,
        tag,
        read_datetime(deadline, connection),
        most,
        bool(synchronize),
        bool(ordering_key),
        event_type,
        lane,
        trace_context,
    )


def next_due(*, using: str | None = None) -> dt.datetime | None:
    """When the next pending delivery comes due, in any lane (one index read a
    lane, in one statement)."""
    connection = connection_for(using)
    with sql.on(connection) as db:
        times = db.one("next_due", **LANES)
    known = [at for at in (read_datetime(value, connection) for value in times) if at]
    return min(known) if known else None


def count_due(*, using: str | None = None) -> int:
    """How many pending deliveries are due now (the partial index, lane by lane)."""
    alias = using or database_alias()
    manager = Delivery.objects.using(alias)
    now = orm_datetime(aware_now(), alias)  # as the ORM takes it, USE_TZ off too
    return sum(
        manager.filter(status=Status.PENDING, lane=lane, due_at__lte=now).count()
        for lane in CLAIM_ORDER
    )


def has_due(
    *,
    since: dt.datetime | None = None,
    lanes: Iterable[str] | None = None,
    using: str | None = None,
) -> bool:
    """Whether anything is due now (that came due after ``since``, if given;
    in ``lanes``, if given): the cheap check for work queued elsewhere, an
    index look a lane in one statement, asked every NEW_WORK_POLL_SECONDS by
    an idle deliverer that has no LISTEN."""
    connection = connection_for(using)
    with sql.on(connection) as db:
        return bool(
            db.value(
                "has_due",
                **_lanes(lanes),
                now=db_datetime(aware_now(), connection),
                since=db_datetime(since or EARLIEST, connection),
            )
        )


def has_claimable(
    *,
    exclude_hosts: Iterable[str] = (),
    lanes: Iterable[str] | None = None,
    using: str | None = None,
) -> bool:
    """Whether anything is due now, in ``lanes`` if given, that a claim
    leaving out ``exclude_hosts`` would take (a few hosts: those at their
    limit, or held; the urgent lanes' rows are few): exact where
    :func:`has_due` given a ``since`` misses what a transaction committed
    late had written due before it."""
    connection = connection_for(using)
    excluded = sorted(set(exclude_hosts))[:MOST_EXCLUDED]
    with sql.on(connection) as db:
        return bool(
            db.value(
                "has_due_claimable",
                **_lanes(lanes),
                now=db_datetime(aware_now(), connection),
                excluded=excluded if db.postgresql else json.dumps(excluded),
                only=None,
            )
        )


def claimable_due_hosts(
    *,
    exclude_hosts: Iterable[str] = (),
    lanes: Iterable[str] | None = None,
    most: int = 100,
    using: str | None = None,
) -> list[str]:
    """The hosts of up to ``most`` rows due now, in ``lanes`` if given, that
    a claim leaving out ``exclude_hosts`` would take: asked after a claim
    that took none of them, the hosts of the rows another transaction holds."""
    connection = connection_for(using)
    excluded = sorted(set(exclude_hosts))[:MOST_EXCLUDED]
    with sql.on(connection) as db:
        rows = db.all(
            "claimable_due_hosts",
            **_lanes(lanes),
            now=db_datetime(aware_now(), connection),
            excluded=excluded if db.postgresql else json.dumps(excluded),
            only=None,
            most=most,
        )
    return sorted(host for (host,) in rows)


#: Before any due time: what ``has_due`` looks after when not told.
EARLIEST = dt.datetime(1, 1, 2, tzinfo=dt.UTC)
