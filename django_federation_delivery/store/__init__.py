"""The queue's store: every statement the package runs outside the ORM —
enqueue, claim, settle, what is due when, and the rest. (Not ``queue``: the
standard library has that name.)

Every statement is a named block of ``queries.sql``, with a variant for each
database where PostgreSQL and SQLite differ, run by ``sql``: the one module
that holds a cursor (``tests/test_store.py`` says so). The other modules, one
a concept, say what each statement is for and run it by its name:

- ``queueing``: what a send writes, its batch and a delivery an inbox;
- ``sequences``: ordered deliveries, which wait on the one before and are
  released when it settles;
- ``retractions``: what a Delete or an Undo overtakes (superseded), and
  what it waits on;
- ``claims``: the claim and its lease, and what is due when;
- ``settlements``: what leaving the queue writes (settled, given up, or
  requeued);
- ``countdowns``: each batch's count of deliveries remaining, which
  finishes it at nought, and which a requeue adds to again;
- ``breakers``: failures counted by every process together;
- ``history``: counts added to their minute;
- ``purges``: settled deliveries and empty batches deleted a chunk at a time;
- ``locks``: PostgreSQL's advisory locks, for work one process at a time does;
- ``wakes``: deliverers of this process woken when a write commits.

The names the commands and scripts call are re-exported here, so that
``store.claim`` and the like stay where they were; the package's own
modules import from each concept's module.
"""

from __future__ import annotations

from django_federation_delivery.store.claims import (
    CLAIM_ORDER,
    Claimed,
    batches,
    claim,
    count_due,
    has_due,
    next_due,
)
from django_federation_delivery.store.queueing import CHUNK, Queued, enqueue
from django_federation_delivery.store.sequences import sequence_of
from django_federation_delivery.store.settlements import (
    FINAL,
    GivenUp,
    Settlement,
    give_up_rows,
    requeue_rows,
    settle,
)

__all__ = [
    "CHUNK",
    "CLAIM_ORDER",
    "FINAL",
    "Claimed",
    "GivenUp",
    "Queued",
    "Settlement",
    "batches",
    "claim",
    "count_due",
    "enqueue",
    "give_up_rows",
    "has_due",
    "next_due",
    "requeue_rows",
    "sequence_of",
    "settle",
]
