"""What becomes of a claimed delivery before a worker sends it.

Claimed deliveries are sorted as they come: one whose batch's deadline has
passed is settled unsent, one SKIP_IF drops is settled skipped, one to a
paused host is put back to wait for the host, and a webhook to a destination
no longer configured is given up; one that cannot be sent as it is stored
(its kind or its gateways written by hand), or whose kind fails to make its
job, is failed by itself; the rest are made ready to send. As each is handed
to a worker, its deadline and its host's pause are looked at again, as it
may have waited for its slot (:meth:`Triage.waited`), and the
destination's circuit breaker may hold it (:meth:`Triage.admit`).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import logging

from django_federation_delivery.addresses import host_of
from django_federation_delivery.attempt import AttemptResult, Job, held
from django_federation_delivery.batches import BatchInfo, KnownBatches
from django_federation_delivery.breakers import HELD_BY_BREAKER, Breakers, Decision, Scope
from django_federation_delivery.breakers import admit as breaker_admits
from django_federation_delivery.dialect import aware_now
from django_federation_delivery.hosts import KnownSchemes
from django_federation_delivery.kinds import DeliveryKind, Kinds, unknown_kind
from django_federation_delivery.models import Status
from django_federation_delivery.outages import Runner
from django_federation_delivery.outbox import Outbox
from django_federation_delivery.settling import DEADLINE_PASSED
from django_federation_delivery.store import claims, settlements
from django_federation_delivery.upkeep import Upkeep
from django_federation_delivery.workers import InFlight

__all__ = ["Triage"]

# The loop's logger: where an operator looks for what the loop met.
logger = logging.getLogger("django_federation_delivery.deliverer")


@dataclasses.dataclass(kw_only=True, eq=False)
class Triage:
    """Sorts one deliverer's claimed deliveries, settling through ``outbox``
    those that are not to be sent."""

    db: Runner
    batches: KnownBatches
    schemes: KnownSchemes
    upkeep: Upkeep
    kinds: Kinds
    outbox: Outbox
    breakers: Breakers | None

    def sort(self, claimed: list[claims.Claimed], *, holding: set[int]) -> list[InFlight] | None:
        """Those of ``claimed`` to send (none already ``holding``), each with
        its job; what comes of the others is in the outbox. None, with
        nothing done, when their batches could not be read (the database
        away): they are still held, to be sorted again."""
        known = self.batches.read(claimed)
        if known is None:
            return None
        claimed = known
        hosts = {row.host for row in claimed}
        self.schemes.read(hosts)
        # A portable inbox's later gateways' hosts too: none paused is POSTed.
        gateways = {host_of(gateway) for row in claimed for gateway in row.via[1:]}
        paused = self.upkeep.paused_among(hosts | gateways)
        # What can never be sent (a webhook to a destination no longer
        # configured) is given up, with every other pending delivery there.
        unusable: set[str] = set()
        for kind in self.kinds:
            gone = kind.unusable(claimed)
            if gone:
                self.db(kind.give_up, gone)
                unusable |= gone
        now = aware_now()
        ready = []
        for row in claimed:
            if row.id in holding or row.host in unusable:
                continue
            batch = self.batches[row.batch_id]
            found = self.kinds.get(row)
            if found is None:
                self._fail_alone(row, batch, self.kinds.fallback, unknown_kind(row.kind))
                continue
            kind = found
            if row.problem:
                self._fail_alone(row, batch, kind, row.problem)
                continue
            if batch.deadline is not None and now >= batch.deadline:
                self.outbox.add(kind.settler(row).unsent(row, batch, DEADLINE_PASSED))
                continue
            if kind.skipped(row, batch):
                self.outbox.add(kind.settler(row).skipped(row, batch))
                continue
            if row.host in paused:
                self.outbox.add(kind.settler(row).paused(row))
                continue
            try:
                job = kind.job(row, batch)
            except Exception as exc:
                # Whatever made it fail is this row's: the rows claimed with
                # it go on. Its type alone is told, as the message of an
                # error about a webhook may hold its URL, the credential.
                self._fail_alone(row, batch, kind, _job_failed(exc))
                continue
            if len(row.via) > 1:
                job = _without_paused_gateways(job, paused)
            item = InFlight(claimed=row, batch=batch, kind=kind, job=job)
            if self.breakers is not None:
                item.breaker = self.breakers.settings.key(row.host, row.inbox)
            ready.append(item)
        return ready

    def _fail_alone(
        self, row: claims.Claimed, batch: BatchInfo, kind: DeliveryKind, error: str
    ) -> None:
        """Fail ``row`` for good, unsent: it can never be sent as it is stored
        (a row changed by hand, or one its kind cannot make a job of). It
        alone: the rows claimed with it go on, and it is written under the
        claim's token, so that it leaves the queue rather than come due again
        each lease. ``error`` quotes none of its URLs (which may hold a
        token): it is logged and kept as it is."""
        logger.warning("Delivery %d cannot be sent and is failed: %s", row.id, error)
        settler = kind.settler(row)
        settler.abandoned(row, batch, None, error)
        self.outbox.add(
            settlements.Settlement(
                claimed=row,
                ordered=batch.ordered,
                status=Status.FAILED,
                attempts=row.attempts,
                last_error=error[: settler.error_length],
            )
        )

    def waited(self, item: InFlight) -> settlements.Settlement | None:
        """What a delivery sorted to be sent comes to as it gets its slot,
        which it may have waited for (behind a slow host, a host's rest, a
        full pool): settled unsent if its batch's deadline passed meanwhile,
        put back to wait if its host was paused meanwhile (as read again
        each second); None to go on. One handed to a worker waits in its
        queue no more than CONCURRENCY deliveries, and is sent as it is."""
        row, batch = item.claimed, item.batch
        if batch.deadline is not None and aware_now() >= batch.deadline:
            return item.kind.settler(row).unsent(row, batch, DEADLINE_PASSED)
        if row.host in self.upkeep.paused:
            return item.kind.settler(row).paused(row)
        # Its later gateways paused meanwhile are left out too, as at its sort.
        item.job = _without_paused_gateways(item.job, self.upkeep.paused)
        return None

    def admit(self, item: InFlight) -> AttemptResult | None:
        """Ask the destination's breaker whether the delivery goes now (as
        its probe, perhaps): None if it does, else what its hold comes to,
        an attempt made without a request.

        A portable inbox's later gateways on hosts whose own breaker holds
        everything (open, or its probe under way) are left out of the
        attempt; and when its first gateway's breaker holds the delivery, it
        goes to the later gateways left, as their answers would not count
        for the first's host (:attr:`InFlight.elsewhere`)."""
        if self.breakers is None or not item.breaker:
            return None
        if getattr(item.job, "makes_no_request", False):
            # Failed without a request (attempt): nothing to learn of the
            # host, and a probe taken would hold its other deliveries.
            return None
        now = aware_now()
        if self.breakers.settings.scope is Scope.HOST:
            item.job = _without_held_gateways(item.job, self.breakers, now)
        admitted = self.db(self.breakers.admit, item.breaker, now)
        decision, item.probe, hold_for = admitted or (Decision.HOLD, "", 5.0)
        if decision is not Decision.HOLD:
            return None
        # Kept per host, the breaker is the first gateway's host's: the later
        # gateways are tried instead. Kept per inbox, it is the whole inbox's.
        later = _targets(item.job)[1:] if self.breakers.settings.scope is Scope.HOST else ()
        if later:
            item.job = dataclasses.replace(item.job, targets=later)  # type: ignore[call-arg]
            item.breaker, item.elsewhere = "", True
            return None
        self.breakers.note_held(item.breaker)
        return held(item.job, HELD_BY_BREAKER.format(key=item.breaker), hold_for)


def _targets(job: Job) -> tuple[str, ...]:
    """Where ``job`` is POSTed, in order: a portable inbox's gateways; ()
    for a kind whose job names no targets."""
    targets = getattr(job, "targets", None)
    return targets if isinstance(targets, tuple) else ()


def _without_held_gateways(job: Job, breakers: Breakers, now: dt.datetime) -> Job:
    """``job`` (a portable inbox's) without its later gateways whose host's
    breaker holds everything at ``now``, as last read: looked at, never
    asked, so that no probe is taken that this attempt would not report."""
    targets = _targets(job)
    if len(targets) < 2:
        return job
    kept = targets[:1] + tuple(
        target
        for target in targets[1:]
        if breaker_admits(breakers.view.get(host_of(target)), now)[0] is not Decision.HOLD
    )
    return job if kept == targets else dataclasses.replace(job, targets=kept)  # type: ignore[call-arg]


def _without_paused_gateways(job: Job, paused: frozenset[str]) -> Job:
    """``job`` (a portable inbox's) without its later gateways whose host an
    operator paused: the first stands for the inbox's host, paused or not as
    the row is; a later one was POSTed as if no pause were its host's."""
    targets = _targets(job)
    if len(targets) < 2:
        return job
    kept = targets[:1] + tuple(target for target in targets[1:] if host_of(target) not in paused)
    return job if kept == targets else dataclasses.replace(job, targets=kept)  # type: ignore[call-arg]


def _job_failed(exc: Exception) -> str:
    """Why a row whose kind could not make its job is failed: the error's
    type, never its message (which may quote a webhook's URL)."""
    return f"its job could not be made: {type(exc).__name__}"
