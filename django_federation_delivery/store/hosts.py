"""What the deliverers write of each host they sent to: one upsert for all
of them (``record_hosts``), every few seconds, not one a delivery."""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from typing import NamedTuple

from django.db import transaction

from django_federation_delivery.dialect import connection_for, db_datetime, json_parameter
from django_federation_delivery.store import sql

__all__ = ["SeenHost", "record_hosts"]

#: Hosts one statement writes. A deliverer that sent to 10,000 hosts since
#: its last write would otherwise build one value of them all: some 9 MB
#: of memory at once, which the process then keeps.
CHUNK = 500


class SeenHost(NamedTuple):
    """What one deliverer saw of a host since it last wrote; None: not seen."""

    name: str
    #: When it was first sent a request: what its row's "first seen" is, if
    #: no deliverer saw it earlier.
    first_seen_at: dt.datetime | None
    last_delivered_at: dt.datetime | None
    last_error: str
    last_error_at: dt.datetime | None
    answer_p50_ms: float | None
    answer_p95_ms: float | None
    concurrency_limit: int | None
    #: Until when it rests (limits.py), if it does.
    resting_until: dt.datetime | None


def record_hosts(seen: Sequence[SeenHost], *, now: dt.datetime, using: str | None = None) -> int:
    """Add each host not yet known and bring each up to date with what was
    seen, keeping the earlier of two first sightings (``now`` for one that
    gives none) and the later of two successes or errors. Returns how many
    were written."""
    if not seen:
        return 0
    connection = connection_for(using)

    def at(value: dt.datetime | None) -> object:
        return db_datetime(value, connection) if value is not None else None

    # In name order, chunk after chunk: processes writing the same hosts
    # lock them in one order.
    ordered = sorted(seen)
    with transaction.atomic(using=using), sql.on(connection) as db:
        for start in range(0, len(ordered), CHUNK):
            rows = [
                [
                    host.name,
                    at(now),
                    at(host.last_delivered_at),
                    host.last_error if host.last_error_at is not None else None,
                    at(host.last_error_at),
                    host.answer_p50_ms,
                    host.answer_p95_ms,
                    host.concurrency_limit,
                    at(host.resting_until),
                    at(host.first_seen_at or now),
                ]
                for host in ordered[start : start + CHUNK]
            ]
            db.run("record_hosts", rows=json_parameter(rows))  # a write, first
    return len(ordered)
