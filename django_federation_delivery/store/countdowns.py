"""Each batch's count of deliveries remaining: what leaves the queue is
taken off it, and a batch that reaches nought is finished; what a requeue
puts back is added to it again.
"""

from __future__ import annotations

import datetime as dt
from collections import Counter
from collections.abc import Sequence

from django_federation_delivery.conf import database_alias
from django_federation_delivery.dialect import connection_for, db_datetime
from django_federation_delivery.models import Batch
from django_federation_delivery.store import sql


def count_down(leaving: Counter[int], now: dt.datetime, using: str | None) -> list[int]:
    """Take the settled deliveries off their batches' counts; the batches
    that reach nought are finished now, and their ids returned, in order.

    The batches are one JSON parameter, however many (a stream of one-inbox
    sends settles as many batches as deliveries). On PostgreSQL their rows
    are locked first, in id order: deliverers counting down the same batches
    at once then wait on each other rather than deadlock. On SQLite the
    batches it finishes are read first, as one value (see
    :meth:`~.sql.Statements.count_down`).
    """
    if not leaving:
        return []
    connection = connection_for(using)
    with sql.on(connection) as db:
        return db.count_down(leaving, db_datetime(now, connection))


def count_up(arriving: Counter[int], using: str | None) -> None:
    """Add the requeued deliveries back to their batches' counts, none of
    them finished any more: one statement for every batch, as
    :func:`count_down` takes them off."""
    if not arriving:
        return
    with sql.on(connection_for(using)) as db:
        db.count_up(arriving)


def finished_batches(ids: Sequence[int], *, using: str | None = None) -> list[Batch]:
    """The batches of ``ids`` (finished ones, as ``on_finished`` names them),
    whole and in id order: what ``batch_finished`` carries."""
    manager = Batch.objects.using(using or database_alias()).order_by("id")
    return list(manager.filter(id__in=sorted(ids)))
