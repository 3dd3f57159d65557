"""The batches of the deliveries a loop has in hand, read once each and kept
in memory while their deliveries are sent."""

from __future__ import annotations

import logging

from django_federation_delivery.outages import Runner
from django_federation_delivery.store import claims
from django_federation_delivery.store.claims import BatchInfo

__all__ = ["BatchInfo", "KnownBatches"]

# The loop's logger: where an operator looks for what the loop met.
logger = logging.getLogger("django_federation_delivery.deliverer")

#: Past this many, what is known is forgotten at the next read.
MOST_KNOWN = 1000


class KnownBatches:
    """The batches of claimed deliveries, by id, read from the database when
    one is not known yet."""

    def __init__(self, db: Runner, *, using: str) -> None:
        self._db = db
        self.using = using
        self._known: dict[int, BatchInfo] = {}

    def __getitem__(self, id: int) -> BatchInfo:
        return self._known[id]

    def known(self, id: int) -> BatchInfo | None:
        """The batch ``id`` if it is known, else None: nothing is read."""
        return self._known.get(id)

    def read(self, claimed: list[claims.Claimed]) -> list[claims.Claimed] | None:
        """Know the batch of each of ``claimed``. Returns those whose batch
        still exists, or None when the database was away: then the claim's
        lease lapses and they come due again."""
        if len(self._known) > MOST_KNOWN:
            # Forgotten before the look-up, not after: what this claim needs
            # stays. Those in flight keep their own.
            self._known.clear()
        missing = {row.batch_id for row in claimed} - set(self._known)
        if not missing:
            return claimed
        found = self._db(claims.batches, missing, using=self.using)
        if found is None:
            return None
        self._known.update(found)
        vanished = missing - set(found)
        if not vanished:
            return claimed
        # Deleted since the claim (by an operator, or a purge), and its
        # deliveries with it by the cascade: nothing is left to send or to
        # settle. Dropped, not settled: a settle would match no row, and a
        # signal would speak of a delivery that no longer exists.
        logger.warning(
            "Batch(es) %s were deleted after their deliveries were claimed; "
            "those deliveries are dropped",
            ", ".join(map(str, sorted(vanished))),
        )
        return [row for row in claimed if row.batch_id not in vanished]

    def forget(self, id: int) -> None:
        """A finished batch: none of its deliveries is in hand any more."""
        self._known.pop(id, None)

    def keep_only(self, ids: set[int]) -> list[int]:
        """Forget every batch but ``ids`` (those with a delivery in hand):
        one whose deliveries wait for a retry, or were settled by another
        deliverer, need not be kept, body and all, until it finishes.
        Returns the ids forgotten."""
        gone = [id for id in self._known if id not in ids]
        for id in gone:
            del self._known[id]
        return gone
