"""The loop's side of webhook deliveries: the job for a claimed one, its
attempt, and giving up on destinations no longer configured.

A delivery names its destination (its ``destination`` column); the URL is
looked up in ``FEDERATION_DELIVERY["WEBHOOKS"]`` when it is sent. One whose
destination was removed is given up in writing, with every other pending
event to that destination and ``delivery_failed`` for each, rather than left
pending where it would read as "still trying": when the loop starts, and
when one is claimed.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Iterable

from django.core.exceptions import ImproperlyConfigured
from django.db import transaction
from django.db.models import Exists, OuterRef

from django_federation_delivery.addresses import escaped
from django_federation_delivery.attempt import AttemptResult, failed, held
from django_federation_delivery.batches import BatchInfo
from django_federation_delivery.channels import Call, Channel, Event, Policy
from django_federation_delivery.channels.base import policy_of
from django_federation_delivery.conf import app_settings, database_alias
from django_federation_delivery.decide import HELD_LEAST
from django_federation_delivery.dialect import aware_now, orm_datetime
from django_federation_delivery.models import Delivery, Host, Kind, Status
from django_federation_delivery.settling import Settler, Summary
from django_federation_delivery.store import claims, settlements
from django_federation_delivery.transport import Transport, TransportSettings
from django_federation_delivery.webhooks.destinations import (
    Destination,
    configured,
    delivery_key,
)
from django_federation_delivery.webhooks.life import Watch
from django_federation_delivery.webhooks.policy import WebhookPolicy

__all__ = ["WebhookDeliveries", "removed_reason", "webhook_transport_settings"]

logger = logging.getLogger(__name__)

CHUNK = 500
#: Past this many events read, they are read again as needed.
MOST_EVENTS = 1000


def removed_reason(name: str) -> str:
    # The name is a row's: escaped, as anything stored is when shown.
    return f"no destination named `{escaped(name)}` is configured any more"


@dataclasses.dataclass(frozen=True)
class Way:
    """How the deliveries to one kind of destination are tried and retried:
    its policy, the settler that follows it, and its transport's settings."""

    policy: WebhookPolicy
    settler: Settler
    transport_settings: TransportSettings


class WebhookDeliveries:
    """What a deliverer does for its webhook deliveries, beside its activities:
    each sent by its destination's kind, and retried and judged by that
    kind's policy (``policy``, as the ``WEBHOOK_*`` settings say, for every
    kind that says no other)."""

    def __init__(
        self,
        policy: WebhookPolicy,
        settler: Settler,
        transport_settings: TransportSettings,
        *,
        using: str | None = None,
        on_finished: Callable[[list[int]], None] | None = None,
    ) -> None:
        self.transport_base = transport_settings
        #: Every kind's whose policy is the settings'.
        self.default = Way(
            policy, settler, webhook_transport_settings(transport_settings, policy.policy)
        )
        self.using = using or database_alias()
        self.on_finished = on_finished
        #: The way of each kind met so far, by the kind's name; written in the
        #: loop's thread only (as its jobs are made), read by the workers.
        self._ways: dict[str, Way] = {}
        #: The events of the batches in hand, by batch id.
        self._events: dict[int, Event | None] = {}

    @classmethod
    def from_settings(
        cls,
        summary: Summary,
        transport_settings: TransportSettings,
        *,
        using: str | None = None,
        on_finished: Callable[[list[int]], None] | None = None,
    ) -> WebhookDeliveries:
        """Retried and judged as the WEBHOOK_* settings say."""
        policy = WebhookPolicy.from_settings()
        watch = Watch(app_settings.webhook_disable_after, using=using)
        return cls(
            policy,
            policy.settler(summary, watch),
            transport_settings,
            using=using,
            on_finished=on_finished,
        )

    @property
    def policy(self) -> WebhookPolicy:
        """The policy of every kind that says no other."""
        return self.default.policy

    def way(self, channel: Channel) -> Way:
        """How deliveries to ``channel``'s destinations are tried: as its
        policy says, or as the settings do if that cannot be had."""
        found = self._ways.get(channel.name)
        if found is not None:
            return found
        try:
            found = self._way_of(WebhookPolicy.of(policy_of(channel)))
        except Exception as exc:
            # The host project's kind: one whose policy cannot be had or
            # followed (E036, which run_deliverer refuses to start on) is
            # sent all the same, as the settings say, and the deliverer with
            # every other delivery goes on.
            logger.warning(
                "%s; the WEBHOOK_* settings apply",
                exc if isinstance(exc, ImproperlyConfigured) else type(exc).__name__,
            )
            found = self.default
        self._ways[channel.name] = found
        return found

    def _way_of(self, policy: WebhookPolicy) -> Way:
        if policy == self.policy:
            return self.default
        default = self.default.settler
        return Way(
            policy,
            policy.settler(default.summary, default.watch),
            webhook_transport_settings(self.transport_base, policy.policy),
        )

    def way_to(self, name: str) -> Way:
        """How deliveries to the destination ``name`` are tried."""
        destination = self.lookup(name)
        return (
            self.way(destination.channel) if isinstance(destination, Destination) else self.default
        )

    def settler(self, row: claims.Claimed) -> Settler:
        return self.way_to(row.destination).settler

    @property
    def timeout(self) -> float:
        """The longest one attempt may take, whatever its kind."""
        ways = [self.way(found.channel) for found in self._configured().values()]
        return max(way.policy.policy.timeout for way in [self.default, *ways])

    def skipped(self, row: claims.Claimed, batch: BatchInfo) -> bool:
        """SKIP_IF is asked about activities, not events."""
        return False

    def transport_settings_for(self, job: Call) -> TransportSettings:
        """A transport's settings for ``job``: its kind's time limit and networks."""
        if job.destination is None:
            return self.default.transport_settings
        return self._ways.get(job.destination.channel.name, self.default).transport_settings

    def attempt(self, job: Call, transport: Transport) -> AttemptResult:
        """The attempt the destination's kind makes; none for a job that
        cannot be sent as it is."""
        if job.problem and not job.permanent:
            # Fixed in the settings, the next try sends: till then it waits,
            # in order, spending no try, as a paused destination's do.
            return held(job, job.problem, retry_after=0.0)
        if job.problem or job.destination is None or job.event is None:
            return failed(job, job.problem, permanent=job.permanent, requests=0)
        result = job.destination.attempted(job, transport)
        if result.refused_address:
            # An address the settings do not open (WEBHOOK_ALLOWED_NETWORKS):
            # the operator's to fix, no request made. It waits, in order,
            # spending no try; failing so for WEBHOOK_DISABLE_AFTER, its
            # destination is disabled (webhooks/life.py), its events kept.
            # Not brought round sooner than HELD_LEAST, whatever the
            # schedule's first wait: the settings change at an operator's pace.
            return dataclasses.replace(result, held=True, permanent=False, retry_after=HELD_LEAST)
        return result

    def _configured(self) -> dict[str, Destination]:
        try:
            return dict(configured().destinations)
        except ImproperlyConfigured:
            return {}

    def lookup(self, name: str) -> Destination | str | None:
        """The destination ``name``: None when it is not configured (any more),
        text saying what is wrong when it does not parse (held, spending no
        try: fixed, the next try sends)."""
        try:
            return configured().lookup(name)
        except ImproperlyConfigured as exc:
            return str(exc)

    def job(self, row: claims.Claimed, batch: BatchInfo) -> Call:
        """The job for a claimed webhook delivery: the destination as configured
        now, and the event as queued."""
        name = row.destination
        destination = self.lookup(name)
        if destination is None:
            return self._unsendable(row, removed_reason(name), permanent=True)
        if isinstance(destination, str):
            return self._unsendable(row, destination, permanent=False)
        event = self._event(batch)
        if event is None:
            problem = f"the stored event of batch {batch.id} cannot be read"
            return self._unsendable(row, problem, permanent=True)
        way = self.way(destination.channel)  # made here, in the loop's thread
        return Call(
            delivery_id=row.id,
            destination=destination,
            event=event,
            body_length=way.policy.body_length,
            # Over before the claim's lease lapses, as an inbox's attempt is:
            # after, another process may take the row and send it again.
            lease_deadline=claims.lease_deadline(row),
        )

    def _unsendable(self, row: claims.Claimed, problem: str, *, permanent: bool) -> Call:
        return Call(
            delivery_id=row.id, destination=None, event=None, problem=problem, permanent=permanent
        )

    def _event(self, batch: BatchInfo) -> Event | None:
        """The event ``batch`` stores, read once for all its destinations."""
        if batch.id not in self._events:
            if len(self._events) > MOST_EVENTS:
                self._events.clear()
            try:
                self._events[batch.id] = Event.read(batch.body)
            except ValueError:
                self._events[batch.id] = None
        return self._events[batch.id]

    def forget(self, batch_ids: Iterable[int]) -> None:
        """The events read of ``batch_ids``, none of whose deliveries is in hand."""
        for id in batch_ids:
            self._events.pop(id, None)

    def unusable(self, claimed: Iterable[claims.Claimed]) -> set[str]:
        """The hosts among ``claimed`` whose destination is no longer configured."""
        return {
            row.host for row in claimed if row.destination and self.lookup(row.destination) is None
        }

    def give_up_unusable(self) -> int:
        """Give up every pending delivery to a destination no longer configured.
        Returns how many."""
        pending = (
            Delivery.objects.using(self.using)
            .filter(status=Status.PENDING, kind=Kind.WEBHOOK)
            .values_list("destination", flat=True)
            .distinct()
        )
        return self.give_up({delivery_key(name) for name in pending if self.lookup(name) is None})

    def release_stuck(self) -> int:
        """Make due the first pending event of each configured destination
        that is not paused, when it waits on nothing, is due at no time and
        no lease holds it: one held as its destination was disabled, its
        hold written after an enable that came while its attempt was in
        flight (the enable makes due only the events not then leased).
        Nothing else would ever make it, nor the events behind it, due. One
        index look a destination; returns how many were made due."""
        manager = Delivery.objects.using(self.using)
        now = orm_datetime(aware_now(), self.using)
        paused = Host.objects.using(self.using).filter(
            name=OuterRef("host"), paused_at__isnull=False
        )
        released = 0
        for name in self._configured():
            head = (
                manager.filter(destination=name, status=Status.PENDING, kind=Kind.WEBHOOK)
                .order_by("id")
                .values("id", "due_at", "after_id", "lease_token")
                .first()
            )
            if head is None or head["due_at"] or head["after_id"] or head["lease_token"]:
                continue
            released += (
                manager.filter(
                    id=head["id"],
                    status=Status.PENDING,
                    due_at__isnull=True,
                    after__isnull=True,
                    lease_token__isnull=True,
                )
                .exclude(Exists(paused))
                .update(due_at=now)
            )
        if released:
            logger.warning(
                "%d webhook event(s) held with no due time for a destination no longer "
                "disabled made due",
                released,
            )
        return released

    def give_up(self, hosts: Iterable[str]) -> int:
        """Fail every pending delivery to ``hosts`` for good, whoever holds
        them. Returns how many. ``delivery_failed`` and the WARNING line are
        for exactly the rows this call failed, once written: not for one
        another process (another deliverer giving them up at its start too)
        settled in the meantime. A destination gone from the settings fails
        no more: added back, it is failing from its next failure, not since
        before it went (and disabled by the first); nor is it disabled still
        (a 410 of the hook it had then), which no one could undo while it was
        gone. An operator's pause (no reason) is left to the operator."""
        failed = 0
        manager = Delivery.objects.using(self.using)
        named = Host.objects.using(self.using).filter(name__in=sorted(hosts))
        named.filter(failing_since__isnull=False).update(failing_since=None)
        named.filter(paused_at__isnull=False).exclude(disabled_reason="").update(
            paused_at=None, disabled_reason=""
        )
        for host in sorted(hosts):
            ids = list(
                manager.filter(host=host, status=Status.PENDING)
                .order_by("id")
                .values_list("id", flat=True)
            )
            for start in range(0, len(ids), CHUNK):
                rows = {row.id: row for row in manager.filter(id__in=ids[start : start + CHUNK])}
                if not rows:
                    continue
                reason = removed_reason(next(iter(rows.values())).destination)
                failed += len(
                    settlements.give_up_rows(
                        list(rows),
                        reason,
                        on_failing=functools.partial(self._tell_given_up, rows, reason),
                        on_finished=self._finished_on_commit,
                        using=self.using,
                    )
                )
        return failed

    def _tell_given_up(
        self, rows: dict[int, Delivery], reason: str, given_up: list[settlements.GivenUp]
    ) -> None:
        """The WARNING line and ``delivery_failed`` of each row given up: its
        batch read in the give-up's transaction, told once it commits."""
        batches = claims.batches({row.batch_id for row in given_up}, using=self.using)

        def tell() -> None:
            for each in given_up:
                row, batch = rows[each.id], batches.get(each.batch_id)
                if batch is None:
                    continue  # deleted since, with its deliveries: nobody to tell
                claimed = _claimed(row)
                way = self.way_to(row.destination)
                way.policy.given_up(claimed, batch.event_type, reason)
                way.settler.abandoned(claimed, batch, each.last_status, reason)

        transaction.on_commit(tell, using=self.using)

    def _finished_on_commit(self, ids: list[int]) -> None:
        """The batches a give-up finished, handed on once it commits."""
        if self.on_finished is not None:
            on_finished = self.on_finished
            transaction.on_commit(lambda: on_finished(ids), using=self.using)


def _claimed(row: Delivery) -> claims.Claimed:
    """A delivery as the settler's signals read it, held by nobody."""
    return claims.Claimed(
        id=row.id,
        batch_id=row.batch_id,
        inbox=row.inbox,
        host=row.host,
        attempts=row.attempts,
        via=(),
        token="",
        leased_until=0.0,
        destination=row.destination,
        kind=row.kind,
    )


def webhook_transport_settings(settings: TransportSettings, policy: Policy) -> TransportSettings:
    """The transport's settings for a kind of destination: its time limit,
    and the networks opened to its destinations in place of those opened to
    inboxes."""
    return dataclasses.replace(
        settings,
        allowed_networks=policy.allowed_networks,
        attempt_timeout=policy.timeout,
        connect_timeout=min(settings.connect_timeout, policy.timeout),
    )
