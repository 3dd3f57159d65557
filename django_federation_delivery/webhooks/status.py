"""Webhook destinations at a glance: what the admin shows of each, in three queries.

A destination is not a row but a name and a URL in the settings, and the URL
is the credential: what is shown here is the name and the kind, never the
URL. Each configured destination is listed, and so is each one that still
has pending deliveries but is configured no more (the loop gives those up).

Three queries whatever the number of destinations or rows: the counts and
the oldest of each destination, grouped, and the head of each (the delivery
the others wait on), each over pending rows only; then what is remembered of
each destination (disabled, paused, failing since), one small table.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import Mapping
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.db.models import Count, Min, Q
from django.utils import timezone
from django.utils.translation import gettext, gettext_noop

from django_federation_delivery.channels.registry import is_name
from django_federation_delivery.conf import app_settings, database_alias
from django_federation_delivery.dialect import aware
from django_federation_delivery.models import Delivery, Host, Kind, Status
from django_federation_delivery.overview import format_duration, waited_since
from django_federation_delivery.webhooks.destinations import (
    Destination,
    configured,
    delivery_key,
)

__all__ = ["DestinationHead", "DestinationStatus", "destination_status"]

#: What the list says of a destination whose URL does not parse; never why, in
#: case the reason quotes part of it: ``manage.py check`` says.
MISCONFIGURED = gettext_noop("misconfigured (see manage.py check)")


@dataclasses.dataclass(frozen=True)
class DestinationHead:
    """The oldest pending event to a destination: the one the others wait on."""

    delivery_id: int
    event_type: str
    event_id: str
    attempts: int
    last_status: int | None
    #: Its last error, with the destination's secret parts taken out.
    last_error: str
    #: When it is next tried; None while its destination is paused.
    due_at: dt.datetime | None
    #: Claimed by a deliverer whose lease has not lapsed.
    in_flight: bool


@dataclasses.dataclass(frozen=True)
class DestinationStatus:
    name: str
    #: Its kind's label ("Slack", "Signed JSON"), :data:`MISCONFIGURED`, or ""
    #: when it is configured no more.
    kind: str
    configured: bool
    pending: int
    #: When the oldest pending event was queued.
    oldest_queued_at: dt.datetime | None
    #: How long ago, in seconds (0 with nothing pending).
    age: float
    head: DestinationHead | None
    #: Disabled by the deliverer (a 410, or failing too long) or paused by an
    #: operator: its events wait until it is enabled again.
    paused_at: dt.datetime | None = None
    #: Configured with a URL that does not parse: its events are held.
    misconfigured: bool = False
    #: Why the deliverer disabled it; "" when an operator paused it, or it is not.
    disabled_reason: str = ""
    #: Since when it has failed without a success, if it has.
    failing_since: dt.datetime | None = None

    @property
    def disabled(self) -> bool:
        return self.paused_at is not None

    def state(self, now: dt.datetime) -> str:
        """What it is doing, in words for people: "sending", "failing for 3h
        5m", "disabled 2m 4s ago: the receiver answered 410 Gone", or "paused
        by an operator 1h 2m ago"."""
        if self.paused_at is not None:
            ago = format_duration(waited_since(self.paused_at, now))
            if self.disabled_reason:
                return gettext("disabled %(ago)s ago: %(reason)s") % {
                    "ago": ago,
                    "reason": self.disabled_reason,
                }
            return gettext("paused by an operator %(ago)s ago") % {"ago": ago}
        if self.misconfigured:
            # Its events are held, none sent, until its URL parses again.
            return gettext("held: its URL does not parse (see manage.py check)")
        if self.failing_since is not None:
            failing = waited_since(self.failing_since, now)
            return gettext("failing for %(time)s") % {"time": format_duration(failing)}
        return gettext("sending")

    def as_json(self) -> dict[str, Any]:
        """What ``delivery_status --json`` gives of it: never a URL."""
        return {
            "name": self.name,
            "kind": self.kind,
            "configured": self.configured,
            "pending": self.pending,
            "disabled": self.disabled,
            "disabled_reason": self.disabled_reason,
            # With their zone, as every time of the document, USE_TZ off too.
            "paused_at": aware(self.paused_at).isoformat() if self.paused_at else None,
            "failing_since": (
                aware(self.failing_since).isoformat() if self.failing_since else None
            ),
        }


def destination_status(
    *, now: dt.datetime | None = None, using: str | None = None
) -> tuple[DestinationStatus, ...]:
    """Every configured destination, then those configured no more that still
    have pending deliveries; each by name."""
    now = now or timezone.now()
    alias = using or database_alias()
    configured = _configured()
    pending = Delivery.objects.using(alias).filter(status=Status.PENDING, kind=Kind.WEBHOOK)
    groups = {
        row["destination"]: row
        for row in pending.values("destination")
        .annotate(
            count=Count("id"),
            oldest=Min("batch__created_at"),
            # The head: of those waiting on nothing, the first queued. (A
            # requeued one waits on nothing either, and is older.)
            head=Min("id", filter=Q(after__isnull=True)),
            first=Min("id"),
        )
        .order_by()
    }
    head_ids = [row["head"] or row["first"] for row in groups.values()]
    heads = (
        {
            row["destination"]: row
            for row in Delivery.objects.using(alias)
            .filter(id__in=head_ids, settled_at__isnull=True)
            .values(
                "id",
                "destination",
                "attempts",
                "last_status",
                "last_error",
                "due_at",
                "lease_token",
                "batch__event_type",
                "batch__event_id",
            )
        }
        if head_ids
        else {}
    )
    names = sorted(configured) + sorted(name for name in groups if name not in configured)
    remembered = {
        row["name"]: row
        for row in Host.objects.using(alias)
        .filter(name__in=[delivery_key(name) for name in names])
        .values("name", "paused_at", "disabled_reason", "failing_since")
    }
    found = []
    for name in names:
        destination = configured.get(name)
        group: Mapping[str, Any] = groups.get(name, {})
        oldest = group.get("oldest")
        head = heads.get(name)
        host: Mapping[str, Any] = remembered.get(delivery_key(name), {})
        found.append(
            DestinationStatus(
                name=name,
                kind=_kind(name, configured),
                configured=name in configured,
                pending=group.get("count", 0),
                oldest_queued_at=oldest,
                age=waited_since(oldest, now),
                head=_head(head, destination, now) if head else None,
                paused_at=host.get("paused_at"),
                disabled_reason=host.get("disabled_reason", ""),
                failing_since=host.get("failing_since"),
                misconfigured=name in configured and destination is None,
            )
        )
    return tuple(found)


def _configured() -> dict[str, Destination | None]:
    """The configured destinations by name; None for one whose URL does not parse."""
    try:
        found = configured()
    except ImproperlyConfigured:
        # CHANNELS cannot be loaded (E035): every destination written is
        # still configured, and none usable until that is fixed; WEBHOOKS is
        # no dict (E030): none is.
        webhooks = app_settings.get("WEBHOOKS")
        if not isinstance(webhooks, Mapping):
            return {}
        return {name: None for name in webhooks if is_name(name)}
    return {name: found.destinations.get(name) for name in found.names}


def _kind(name: str, configured: Mapping[str, Destination | None]) -> str:
    if name not in configured:
        return ""
    destination = configured[name]
    # Labels are kept in English, and shown in the active language.
    return gettext(destination.channel.label if destination is not None else MISCONFIGURED)


def _head(
    row: Mapping[str, Any], destination: Destination | None, now: dt.datetime
) -> DestinationHead:
    error: str = row["last_error"]
    # Stored errors hold no credential already; this is a second lock.
    if destination is not None:
        error = destination.redact(error)
    due_at: dt.datetime | None = row["due_at"]
    return DestinationHead(
        delivery_id=row["id"],
        event_type=row["batch__event_type"],
        event_id=row["batch__event_id"],
        attempts=row["attempts"],
        last_status=row["last_status"],
        last_error=error,
        due_at=due_at,
        in_flight=bool(row["lease_token"]) and due_at is not None and due_at > now,
    )
