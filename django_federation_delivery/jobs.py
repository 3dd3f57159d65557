"""The job a worker is handed for a claimed delivery: the body and the
sender's key, the headers the host project adds, the scheme to knock in
first, and when the claim's lease leaves no time to send it."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from django_federation_delivery.attempt import Job
from django_federation_delivery.batches import BatchInfo
from django_federation_delivery.conf import LEASE_MARGIN_SECONDS
from django_federation_delivery.hosts import KnownSchemes
from django_federation_delivery.keys import KeyCache
from django_federation_delivery.settling import ask
from django_federation_delivery.store import claims
from django_federation_delivery.webhooks.deliveries import WebhookDeliveries

__all__ = ["Jobs"]

# The loop's logger: where an operator looks for what the loop met.
logger = logging.getLogger("django_federation_delivery.deliverer")


class Jobs:
    """Makes the jobs of one deliverer, with its sender keys cached."""

    def __init__(
        self,
        schemes: KnownSchemes,
        webhooks: WebhookDeliveries,
        *,
        synchronization: Callable[..., Any] | None = None,
    ) -> None:
        self.schemes = schemes
        self.webhooks = webhooks
        #: COLLECTION_SYNCHRONIZATION: the header for a sender and an inbox.
        self.synchronization = synchronization
        self.keys = KeyCache()

    def make(self, row: claims.Claimed, batch: BatchInfo) -> Job:
        """The job for ``row``, a claimed delivery of ``batch``."""
        if batch.event_type:
            return self.webhooks.job(row, batch)
        key_error = ""
        key = None
        try:
            key = self.keys.get(batch.sender)
        except Exception as exc:
            # The key store is the host project's; it being away for a
            # moment does not make the delivery wrong.
            logger.warning("Looking up the key of %s failed: %s", batch.sender, type(exc).__name__)
            key_error = f"the sender's key could not be looked up: {type(exc).__name__}"
        extra: dict[str, str] = {}
        if batch.synchronize_collection and self.synchronization is not None and key is not None:
            header = ask(
                "COLLECTION_SYNCHRONIZATION", self.synchronization, batch.sender, row.inbox
            )
            if isinstance(header, str) and header:
                extra["Collection-Synchronization"] = header
        # The attempt ends, or is not made, while the claim's lease holds, with
        # time to spare to write what came of it: after that the row is any
        # process's to take and send again.
        lease_left = row.leased_until - time.time()
        return Job(
            delivery_id=row.id,
            extra_headers=extra,
            targets=row.via or (row.inbox,),
            body=batch.body,
            body_sha256=batch.body_sha256,
            key=key,
            sender=batch.sender,
            scheme=self.schemes.scheme_for(row.host),
            key_error=key_error,
            lease_deadline=time.monotonic() + lease_left - LEASE_MARGIN_SECONDS,
        )
