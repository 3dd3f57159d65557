"""Locks held in the database, for work that one process at a time may do."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from django.db import connections

__all__ = ["session_lock"]


@contextlib.contextmanager
def session_lock(using: str, key: int) -> Iterator[bool]:
    """PostgreSQL's advisory lock ``key``, tried on a connection of its own
    and held until the block ends: whether it was had."""
    connection = connections.create_connection(using)
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_try_advisory_lock(%s)", [key])
            held = bool(cursor.fetchone()[0])
        try:
            yield held
        finally:
            if held:
                with connection.cursor() as cursor:
                    cursor.execute("SELECT pg_advisory_unlock(%s)", [key])
    finally:
        # Closing the session releases the lock too, should the unlock fail.
        connection.close()
