"""The queues at a glance: what the admin's queues page and ``delivery_status`` show.

Every query here is bounded whatever the size of the table. Pending rows are
counted, as they are the live queue and the partial index ``fd_delivery_due``
holds only them; settled rows are only ever counted within a recent window of
``settled_at``, and the hosts failing most come with a LIMIT.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import Mapping
from typing import Any

from django.db import connections
from django.db.models import Case, Count, Max, Min, OuterRef, Q, Subquery, When
from django.db.models.functions import Coalesce
from django.utils import timezone
from django.utils.translation import gettext, ngettext
from django.utils.translation import gettext_lazy as _

from django_federation_delivery import heartbeats
from django_federation_delivery.conf import database_alias
from django_federation_delivery.dialect import aware
from django_federation_delivery.heartbeats import SeenDeliverer
from django_federation_delivery.hosts import paused_hosts
from django_federation_delivery.models import Breaker, Delivery, Host, Lane, Status
from django_federation_delivery.store.queueing import CHUNK

__all__ = [
    "BREAKER_STATES",
    "FailingHost",
    "LaneStats",
    "OpenBreaker",
    "Overview",
    "SeenDeliverer",
    "format_duration",
    "lag",
    "open_breakers",
    "overview",
    "stalled",
]

#: A breaker's state, as people read it: the states themselves ("closed",
#: "open", "half-open") are data, in the JSON of ``delivery_status --json`` too.
BREAKER_STATES = {"closed": _("closed"), "open": _("open"), "half-open": _("half-open")}

DELIVERED_WINDOW = dt.timedelta(hours=1)
FAILED_WINDOW = dt.timedelta(days=1)


@dataclasses.dataclass(frozen=True)
class LaneStats:
    """One lane of the queue, or all of them (``lane`` "all")."""

    lane: str
    #: Pending and due now, a lapsed lease included: waiting for a deliverer.
    due: int
    #: Pending and due later: retries waiting out their backoff.
    scheduled: int
    #: Claimed by a deliverer whose lease has not lapsed.
    in_flight: int
    #: Pending with no due time: to a paused host, or waiting on an ordered predecessor.
    held: int
    #: When the longest-waiting due delivery came due.
    oldest_due_at: dt.datetime | None
    #: Seconds since then: how far behind the deliverers are (0 when nothing is due).
    lag: float
    delivered_last_hour: int
    failed_last_day: int
    #: Overtaken by their sender's retraction (a Delete, an Undo), unsent.
    superseded_last_day: int = 0

    @property
    def pending(self) -> int:
        return self.due + self.scheduled + self.in_flight + self.held


@dataclasses.dataclass(frozen=True)
class FailingHost:
    host: str
    #: Pending deliveries to it that have failed at least once.
    retrying: int
    #: The highest status among those (None: no answer, such as a timeout).
    last_status: int | None
    #: Its breaker's state ("closed", "open", "half-open"), or "" with no breaker row.
    breaker: str
    #: Failures in a row its breaker counts.
    failures: int
    open_until: dt.datetime | None
    paused: bool


@dataclasses.dataclass(frozen=True)
class OpenBreaker:
    """A breaker that is open or half-open: its destination's deliveries are held."""

    key: str
    state: str
    failures: int
    open_until: dt.datetime
    #: Whether a probe is under way.
    probing: bool


@dataclasses.dataclass(frozen=True)
class Overview:
    at: dt.datetime
    lanes: tuple[LaneStats, ...]
    failing_hosts: tuple[FailingHost, ...]
    open_breakers: tuple[OpenBreaker, ...]
    #: How many breakers are open, when there are more than are listed.
    open_breaker_count: int
    #: The first paused hosts by name, and how many are paused in all (an
    #: operator may pause tens of thousands with "select all").
    paused_hosts: tuple[str, ...]
    paused_host_count: int = 0
    #: The deliverers alive (see heartbeats.py: the first 100), how many
    #: are, and when any last beat.
    deliverers: tuple[SeenDeliverer, ...] = ()
    deliverer_last_seen: dt.datetime | None = None
    deliverer_count: int = 0

    @property
    def stalled(self) -> str:
        """Why nothing is being delivered although work is due ("" when it is)."""
        seen = heartbeats.Seen(
            live=self.deliverers, last_seen=self.deliverer_last_seen, alive=self.deliverer_count
        )
        return stalled(seen, self.total.due, self.at)

    @property
    def total(self) -> LaneStats:
        due_times = [lane.oldest_due_at for lane in self.lanes if lane.oldest_due_at]
        return LaneStats(
            lane="all",
            due=sum(lane.due for lane in self.lanes),
            scheduled=sum(lane.scheduled for lane in self.lanes),
            in_flight=sum(lane.in_flight for lane in self.lanes),
            held=sum(lane.held for lane in self.lanes),
            oldest_due_at=min(due_times) if due_times else None,
            lag=max((lane.lag for lane in self.lanes), default=0.0),
            delivered_last_hour=sum(lane.delivered_last_hour for lane in self.lanes),
            failed_last_day=sum(lane.failed_last_day for lane in self.lanes),
            superseded_last_day=sum(lane.superseded_last_day for lane in self.lanes),
        )

    def as_json(self) -> dict[str, Any]:
        """A JSON-ready dict: datetimes as ISO 8601 strings."""
        return {
            "at": aware(self.at).isoformat(),
            "lanes": [_jsonable(lane) for lane in self.lanes],
            "total": _jsonable(self.total),
            "failing_hosts": [_jsonable(host) for host in self.failing_hosts],
            "open_breakers": [_jsonable(breaker) for breaker in self.open_breakers],
            "open_breaker_count": self.open_breaker_count,
            "paused_hosts": list(self.paused_hosts),
            "paused_host_count": self.paused_host_count,
            "deliverers": [_jsonable(deliverer) for deliverer in self.deliverers],
            "deliverer_last_seen": _iso(self.deliverer_last_seen),
            "deliverer_count": self.deliverer_count,
            "stalled": self.stalled,
        }


def _jsonable(item: Any) -> dict[str, Any]:
    fields = dataclasses.asdict(item)
    if isinstance(item, LaneStats):
        fields["pending"] = item.pending
    return {
        name: aware(value).isoformat() if isinstance(value, dt.datetime) else value
        for name, value in fields.items()
    }


def _iso(value: dt.datetime | None) -> str | None:
    return aware(value).isoformat() if value is not None else None


def format_duration(seconds: float) -> str:
    """A duration for people: "42s", "4m 12s", "3h 5m", "2d 1h"."""
    whole = int(seconds)
    days, rest = divmod(whole, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return gettext("%(days)dd %(hours)dh") % {"days": days, "hours": hours}
    if hours:
        return gettext("%(hours)dh %(minutes)dm") % {"hours": hours, "minutes": minutes}
    if minutes:
        return gettext("%(minutes)dm %(seconds)ds") % {"minutes": minutes, "seconds": secs}
    return gettext("%(seconds)ds") % {"seconds": secs}


def stalled(deliverers: heartbeats.Seen, due: int, now: dt.datetime, *, where: str = "") -> str:
    """Why the queue is stalled, for people: work is due and no deliverer
    (``where``, such as " on web-1") is alive, nor was seen for
    ``heartbeats.NO_DELIVERER_AFTER``; else ""."""
    if due <= 0 or deliverers.live:
        return ""
    work = ngettext("%(count)d delivery is due", "%(count)d deliveries are due", due) % {
        "count": due
    }
    # As instants, whatever USE_TZ says: with it off, a beat just before a
    # clock went back reads as later than now.
    quiet = None
    if deliverers.last_seen is not None:
        # In UTC: two times of one zone subtract as wall-clock times.
        utc = (aware(now).astimezone(dt.UTC), aware(deliverers.last_seen).astimezone(dt.UTC))
        quiet = (utc[0] - utc[1]).total_seconds()
    if quiet is None or quiet < -heartbeats.NO_DELIVERER_AFTER:
        # None seen, or only by a clock that ran ahead: no telling when.
        return gettext("No deliverer%(where)s has been seen in the last day while %(work)s") % {
            "where": where,
            "work": work,
        }
    if quiet < heartbeats.NO_DELIVERER_AFTER:
        return ""  # one restarting, most likely
    return gettext("No deliverer%(where)s seen for %(quiet)s while %(work)s") % {
        "where": where,
        "quiet": format_duration(quiet),
        "work": work,
    }


def overview(
    *,
    hosts: int = 10,
    breakers: int = 50,
    paused: int = 50,
    now: dt.datetime | None = None,
    using: str | None = None,
) -> Overview:
    """The queues as of ``now``, with the ``hosts`` failing most, up to
    ``breakers`` open breakers and ``paused`` paused hosts (with how many of
    each there are), and the live deliverers. A fixed number of queries,
    each bounded."""
    now = now or timezone.now()
    alias = using or database_alias()
    all_paused = Host.objects.using(alias).filter(paused_at__isnull=False)
    paused_list = tuple(all_paused.order_by("name").values_list("name", flat=True)[:paused])
    paused_count = all_paused.count() if len(paused_list) >= paused else len(paused_list)
    open_list, open_count = _open_breakers(now, breakers, alias)
    seen = heartbeats.seen(now=now, using=alias)
    return Overview(
        at=now,
        lanes=_lanes(now, alias),
        failing_hosts=_failing_hosts(
            now,
            hosts,
            alias,
            any_open=open_count > 0,
            # Every paused host when all are listed: none to look up again.
            paused=set(paused_list) if paused_count == len(paused_list) else None,
        ),
        open_breakers=open_list,
        open_breaker_count=open_count,
        paused_hosts=paused_list,
        paused_host_count=paused_count,
        deliverers=seen.live,
        deliverer_last_seen=seen.last_seen,
        deliverer_count=seen.alive,
    )


def lag(*, now: dt.datetime | None = None, using: str | None = None) -> float:
    """Seconds the longest-waiting due delivery has waited: one index read a lane."""
    return max(lane_lags(now=now, using=using).values(), default=0.0)


def lane_lags(*, now: dt.datetime | None = None, using: str | None = None) -> dict[str, float]:
    """Each lane's lag: seconds its longest-waiting due delivery has waited
    (0 when none is due), one index read a lane."""
    now = now or timezone.now()
    due = Delivery.objects.using(using or database_alias()).filter(
        status=Status.PENDING, due_at__lte=now
    )
    lags = {}
    for lane in Lane:
        oldest = due.filter(lane=lane).aggregate(at=Min("due_at"))["at"]
        lags[lane.value] = waited_since(oldest, now, using=due.db)
    return lags


def waited_since(due: dt.datetime | None, now: dt.datetime, *, using: str | None = None) -> float:
    """Seconds from ``due`` to ``now`` (0 if none or later), as instants: with
    ``USE_TZ`` off both are the wall clock of ``TIME_ZONE``, and across the
    hour it skips a delivery due a few minutes before had "waited" an hour.
    A naive ``due`` read from SQLite (``using``), which keeps no offset, in
    the hour the clock goes back through is read as its second pass when
    that is past too: the nearer of the two readings, not an hour too long
    a wait. (PostgreSQL's reads carry the pass they are of.)"""
    if due is None:
        return 0.0
    at = aware(now).astimezone(dt.UTC)
    then = aware(due).astimezone(dt.UTC)
    if timezone.is_naive(due) and using is not None and connections[using].vendor == "sqlite":
        second = aware(due.replace(fold=1)).astimezone(dt.UTC)
        if then < second <= at:
            then = second
    return max((at - then).total_seconds(), 0.0)


def open_breakers(*, using: str | None = None) -> int:
    """How many breakers are open or half-open: not closed either way."""
    return Breaker.objects.using(using or database_alias()).filter(open_until__isnull=False).count()


def _lanes(now: dt.datetime, alias: str) -> tuple[LaneStats, ...]:
    manager = Delivery.objects.using(alias)
    leased = Q(lease_token__isnull=False)
    due = Q(due_at__lte=now)
    later = Q(due_at__gt=now)
    # status = pending: the partial index fd_delivery_due holds exactly these rows.
    pending = {
        row["lane"]: row
        for row in manager.filter(status=Status.PENDING)
        .values("lane")
        .annotate(
            due=Count("id", filter=due),
            scheduled=Count("id", filter=later & ~leased),
            in_flight=Count("id", filter=later & leased),
            held=Count("id", filter=Q(due_at__isnull=True)),
            oldest=Min("due_at", filter=due),
        )
        .order_by()
    }
    hour_ago, day_ago = now - DELIVERED_WINDOW, now - FAILED_WINDOW
    delivered = Q(status=Status.DELIVERED, settled_at__gte=hour_ago)
    failed = Q(status=Status.FAILED, settled_at__gte=day_ago)
    superseded = Q(status=Status.SUPERSEDED, settled_at__gte=day_ago)
    # Settled rows are never counted over the whole table, only in their window.
    settled = {
        row["lane"]: row
        for row in manager.filter(delivered | failed | superseded)
        .values("lane")
        .annotate(
            delivered=Count("id", filter=delivered),
            failed=Count("id", filter=failed),
            superseded=Count("id", filter=superseded),
        )
        .order_by()
    }
    lanes = []
    for lane in Lane:
        counts: Mapping[str, Any] = pending.get(lane.value, {})
        done: Mapping[str, Any] = settled.get(lane.value, {})
        oldest = counts.get("oldest")
        lanes.append(
            LaneStats(
                lane=lane.value,
                due=counts.get("due", 0),
                scheduled=counts.get("scheduled", 0),
                in_flight=counts.get("in_flight", 0),
                held=counts.get("held", 0),
                oldest_due_at=oldest,
                lag=waited_since(oldest, now, using=alias),
                delivered_last_hour=done.get("delivered", 0),
                failed_last_day=done.get("failed", 0),
                superseded_last_day=done.get("superseded", 0),
            )
        )
    return tuple(lanes)


def _open_breakers(now: dt.datetime, limit: int, alias: str) -> tuple[tuple[OpenBreaker, ...], int]:
    manager = Breaker.objects.using(alias).filter(open_until__isnull=False)
    rows = list(manager.order_by("open_until", "key")[:limit])
    count = manager.count()
    return (
        tuple(
            OpenBreaker(
                key=row.key,
                state=_state(row, now),
                failures=row.failures,
                open_until=row.open_until,
                probing=row.probe_until is not None and row.probe_until > now,
            )
            for row in rows
            if row.open_until is not None
        ),
        count,
    )


def _failing_hosts(
    now: dt.datetime,
    limit: int,
    alias: str,
    *,
    any_open: bool = True,
    paused: set[str] | None = None,
) -> tuple[FailingHost, ...]:
    """The ``limit`` hosts failing most, as they are shown: those whose
    breaker is open first, then the most retrying, then the most failures.
    Its candidates are the first ``limit`` by each part of that order, so
    that the first ``limit`` of them are the first of all. ``any_open``:
    whether any breaker is open; ``paused``: every paused host, when known
    (else the candidates are looked up)."""
    if limit < 1:
        return ()
    deliveries = Delivery.objects.using(alias).filter(status=Status.PENDING, attempts__gt=0)
    # A key with "://" is an inbox (SCOPE "inbox"), not a host.
    host_breakers = Breaker.objects.using(alias).exclude(key__contains="://")
    by_retrying = (
        deliveries.values("host")
        .annotate(
            retrying=Count("id"),
            last_status=Max("last_status"),
            # Ties broken as the list is: by the failures its breaker counts.
            failures=Coalesce(
                Subquery(host_breakers.filter(key=OuterRef("host")).values("failures")[:1]), 0
            ),
        )
        .order_by("-retrying", "-failures", "host")
    )
    open_keys = host_breakers.filter(open_until__isnull=False).values("key")
    # The hosts whose breakers count the most failures, open ones first.
    worst_breakers = (
        host_breakers.annotate(closed=Case(When(open_until__isnull=True, then=1), default=0))
        .order_by("closed", "-failures", "key")
        .values("key")[:limit]
    )
    # Three to six queries whatever the data, for a limit up to a CHUNK:
    # the hosts with the most retrying deliveries (pending rows, LIMITed),
    # and, if any breaker is open, those whose breaker is; the breakers of
    # the worst, and of those;
    # the retrying deliveries of the worst breakers' hosts; which of them
    # are paused, unless every paused host is known.
    retrying = {row["host"]: (row["retrying"], row["last_status"]) for row in by_retrying[:limit]}
    if any_open:
        retrying.update(
            (row["host"], (row["retrying"], row["last_status"]))
            for row in by_retrying.filter(host__in=open_keys)[:limit]
        )
    # The retrying hosts' a CHUNK at a time, the first with the worst: a
    # ``limit`` may name more than a statement takes parameters.
    candidates = sorted(retrying)
    chunks = [
        Q(key__in=candidates[start : start + CHUNK])
        for start in range(CHUNK, len(candidates), CHUNK)
    ]
    by_host: dict[str, Breaker] = {}
    for which in [Q(key__in=worst_breakers) | Q(key__in=candidates[:CHUNK]), *chunks]:
        by_host.update((row.key, row) for row in Breaker.objects.using(alias).filter(which))
    retrying.update(
        (row["host"], (row["retrying"], row["last_status"]))
        for row in by_retrying.filter(host__in=worst_breakers).order_by()
    )
    if paused is None:
        paused = paused_hosts(set(retrying) | set(by_host), using=alias)
    found = []
    for host in set(retrying) | set(by_host):
        count, last_status = retrying.get(host, (0, None))
        breaker = by_host.get(host)
        found.append(
            FailingHost(
                host=host,
                retrying=count,
                last_status=last_status,
                breaker=_state(breaker, now) if breaker else "",
                failures=breaker.failures if breaker else 0,
                open_until=breaker.open_until if breaker else None,
                paused=host in paused,
            )
        )
    found.sort(
        key=lambda item: (item.open_until is None, -item.retrying, -item.failures, item.host)
    )
    return tuple(found[:limit])


def _state(breaker: Breaker, now: dt.datetime) -> str:
    # Breaker.state, as of the overview's now rather than the clock's.
    if breaker.open_until is None:
        return "closed"
    return "open" if now < breaker.open_until else "half-open"
