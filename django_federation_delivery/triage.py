"""What becomes of a claimed delivery before a worker sends it.

Claimed deliveries are sorted as they come: one whose batch's deadline has
passed is settled unsent, one SKIP_IF drops is settled skipped, one to a
paused host is put back to wait for the host, and a webhook to a destination
no longer configured is given up; the rest are made ready to send. As each
is handed to a worker, the destination's circuit breaker may hold it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from django.utils import timezone

from django_federation_delivery.attempt import held
from django_federation_delivery.batches import BatchInfo, KnownBatches
from django_federation_delivery.breakers import Breakers, Decision
from django_federation_delivery.hosts import KnownSchemes
from django_federation_delivery.jobs import Jobs
from django_federation_delivery.outages import Runner
from django_federation_delivery.outbox import Outbox
from django_federation_delivery.settling import Settler, ask
from django_federation_delivery.store import claims
from django_federation_delivery.upkeep import Upkeep
from django_federation_delivery.webhooks.deliveries import WebhookDeliveries
from django_federation_delivery.workers import InFlight

__all__ = ["Triage"]


@dataclasses.dataclass(kw_only=True, eq=False)
class Triage:
    """Sorts one deliverer's claimed deliveries, settling through ``outbox``
    those that are not to be sent."""

    db: Runner
    batches: KnownBatches
    schemes: KnownSchemes
    upkeep: Upkeep
    webhooks: WebhookDeliveries
    jobs: Jobs
    outbox: Outbox
    settler: Settler
    webhook_settler: Settler
    breakers: Breakers | None
    #: SKIP_IF, when set.
    skip_if: Callable[..., Any] | None

    def settler_for(self, batch: BatchInfo) -> Settler:
        """Webhook deliveries are retried and judged by the webhook policy."""
        return self.webhook_settler if batch.event_type else self.settler

    def sort(self, claimed: list[claims.Claimed], *, holding: set[int]) -> list[InFlight]:
        """Those of ``claimed`` to send (none already ``holding``), each with
        its job; what comes of the others is in the outbox."""
        known = self.batches.read(claimed)
        if known is None:
            return []  # the claim's lease lapses and they come due again
        claimed = known
        hosts = {row.host for row in claimed}
        self.schemes.read(hosts)
        paused = self.upkeep.paused_among(hosts)
        # Webhooks to a destination no longer configured: given up, with every
        # other pending event to it.
        removed = self.webhooks.removed(claimed)
        if removed:
            self.db(self.webhooks.give_up, removed)
        now = timezone.now()
        ready = []
        for row in claimed:
            if row.id in holding or row.host in removed:
                continue
            batch = self.batches[row.batch_id]
            if batch.deadline is not None and now >= batch.deadline:
                error = "the batch's deadline passed before it was sent"
                self.outbox.add(self.settler.unsent(row, batch, error))
                continue
            if (
                self.skip_if is not None
                and not batch.event_type
                and ask("SKIP_IF", self.skip_if, row.inbox, batch.activity)
            ):
                self.outbox.add(self.settler.skipped(row, batch))
                continue
            if row.host in paused:
                self.outbox.add(self.settler.paused(row))
                continue
            item = InFlight(claimed=row, batch=batch, job=self.jobs.make(row, batch))
            if self.breakers is not None:
                item.breaker = self.breakers.settings.key(row.host, row.inbox)
            ready.append(item)
        return ready

    def admitted(self, item: InFlight) -> bool:
        """Whether the destination's breaker lets the delivery through now
        (as the probe, perhaps); one it holds is settled as held."""
        if self.breakers is None or not item.breaker:
            return True
        now = timezone.now()
        admitted = self.db(self.breakers.admit, item.breaker, now)
        decision, item.probe, hold_for = admitted or (Decision.HOLD, "", 5.0)
        if decision is not Decision.HOLD:
            return True
        error = f"held: the circuit breaker for {item.breaker} is open"
        self.outbox.add(
            self.settler_for(item.batch).attempted(
                item.claimed, item.batch, held(item.job, error, hold_for)
            )
        )
        return False
