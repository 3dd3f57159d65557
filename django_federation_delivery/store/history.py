"""The history's statements: counts added to their minute, one upsert for
the minutes a write touched (``add_history``), in the same transaction as
the write. Its columns are COUNTS, in order."""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Mapping

from django.db import DatabaseError, transaction

from django_federation_delivery.conf import database_alias
from django_federation_delivery.dialect import (
    aware,
    connection_for,
    db_datetime,
    json_parameter,
)
from django_federation_delivery.store import sql

__all__ = ["COUNTS", "minute_of", "record"]

logger = logging.getLogger("django_federation_delivery.history")

COUNTS = ("delivered", "retried", "refused", "failed", "breakers_opened")


def minute_of(at: dt.datetime) -> dt.datetime:
    """The UTC minute ``at`` falls in (naive, it is read as Django keeps it:
    see :func:`~django_federation_delivery.dialect.aware`)."""
    return aware(at).astimezone(dt.UTC).replace(second=0, microsecond=0)


def record(counts: Mapping[dt.datetime, Mapping[str, int]], *, using: str | None = None) -> None:
    """Add ``counts`` ({minute: {count name: how many}}) to the history, in
    one statement, within the caller's transaction if there is one.

    A failure is logged and goes no further: it rolls back only its own
    savepoint, never the settlements written with it.
    """
    rows = []
    for minute, named in sorted(counts.items()):
        unknown = set(named) - set(COUNTS)
        if unknown:
            raise ValueError(f"no such history count: {sorted(unknown)!r}")
        values = [int(named.get(name, 0)) for name in COUNTS]
        if any(values):
            rows.append((minute_of(minute), values))
    if not rows:
        return
    alias = using or database_alias()
    connection = connection_for(alias)
    given = json_parameter([[db_datetime(minute, connection), *values] for minute, values in rows])
    try:
        with transaction.atomic(using=alias), sql.on(connection) as db:
            db.run("add_history", rows=given)
    except DatabaseError:
        logger.exception("The delivery history could not be recorded; what it counted is settled")
