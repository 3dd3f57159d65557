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


class SeenHost(NamedTuple):
    """What one deliverer saw of a host since it last wrote; None: not seen."""

    name: str
    last_delivered_at: dt.datetime | None
    last_error: str
    last_error_at: dt.datetime | None
    answer_p50_ms: float | None
    answer_p95_ms: float | None
    concurrency_limit: int | None


def record_hosts(seen: Sequence[SeenHost], *, now: dt.datetime, using: str | None = None) -> int:
    """Add each host not yet known (first seen ``now``) and bring each up to
    date with what was seen, keeping the later of two successes or errors.
    Returns how many were written."""
    if not seen:
        return 0
    connection = connection_for(using)

    def at(value: dt.datetime | None) -> object:
        return db_datetime(value, connection) if value is not None else None

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
        ]
        for host in sorted(seen)
    ]
    with transaction.atomic(using=using), sql.on(connection) as db:
        db.run("record_hosts", rows=json_parameter(rows))  # a write, first
    return len(rows)
