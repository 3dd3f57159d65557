"""Locks held in the database, for work that one process at a time may do."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from django.db import connections

from django_federation_delivery.conf import database_alias
from django_federation_delivery.dialect import connection_for
from django_federation_delivery.store import sql

__all__ = ["session_lock", "write_first"]


def write_first(using: str | None = None) -> None:
    """In a transaction on SQLite, take the write lock now, before anything
    is read: a read first would let another connection's write in between,
    and this transaction's own write then fail at once ("database is
    locked") instead of waiting its turn. Nothing elsewhere, nor where the
    transaction was begun ``IMMEDIATE``."""
    with sql.on(connection_for(using or database_alias())) as db:
        db.lock_for_writing()


@contextlib.contextmanager
def session_lock(using: str, key: int) -> Iterator[bool]:
    """PostgreSQL's advisory lock ``key``, tried on a connection of its own
    and held until the block ends: whether it was had."""
    connection = connections.create_connection(using)
    try:
        with sql.on(connection) as db:
            held = bool(db.value("try_advisory_lock", key=key))
        try:
            yield held
        finally:
            if held:
                with sql.on(connection) as db:
                    db.value("advisory_unlock", key=key)
    finally:
        # Closing the session releases the lock too, should the unlock fail.
        connection.close()
