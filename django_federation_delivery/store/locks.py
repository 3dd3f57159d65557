"""Locks held in the database, for work that one process at a time may do."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from django.db import connections

from django_federation_delivery.store import sql

__all__ = ["session_lock"]


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
