"""Every host's picture: how it has been doing, in one place.

For one host (:func:`host_picture`): when it was first sent to and last
delivered to, since when it fails and whether it is marked unavailable, its
breaker and failures in a row, a pause, the scheme it accepts, its answer
times, the limit it is sent at and its rest (as the deliverers last wrote
them, see ``hoststats.py``), what is pending for it, what was delivered,
failed and superseded over the last 24 hours, and its last error
(redacted). Read by ``delivery_status --host``, which names a host in any
form, and by the admin's host page, by the row's name exactly as it is kept
(:func:`kept_host_picture`), in a few indexed queries. And the hosts in the
order of their trouble (:data:`TROUBLE`).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from typing import Any

from django.db.models import Case, Count, Max, Q, Value, When

from django_federation_delivery.addresses import host_named, url_prefixes
from django_federation_delivery.conf import database_alias
from django_federation_delivery.dialect import aware, aware_now, orm_datetime
from django_federation_delivery.models import Breaker, Delivery, Host, Status

__all__ = [
    "TROUBLE",
    "TROUBLES",
    "HostPicture",
    "host_picture",
    "kept_host_picture",
    "milliseconds",
    "resting_until",
]

#: The window of the recent counts.
DAY = dt.timedelta(days=1)

#: A host's trouble, worst first, as a number its list is sorted by.
TROUBLE = Case(
    When(unavailable_since__isnull=False, then=Value(0)),
    When(failing_since__isnull=False, then=Value(1)),
    When(paused_at__isnull=False, then=Value(2)),
    default=Value(3),
)
#: What each number says (data, as in the JSON; the admin translates it).
TROUBLES = ("unavailable", "failing", "paused", "ok")


@dataclasses.dataclass(frozen=True)
class HostPicture:
    name: str
    #: "unavailable", "failing", "paused" or "ok": its worst.
    trouble: str
    first_seen_at: dt.datetime | None
    last_delivered_at: dt.datetime | None
    failing_since: dt.datetime | None
    unavailable_since: dt.datetime | None
    paused_at: dt.datetime | None
    #: The signature scheme it last accepted; "" while the first one does.
    scheme: str
    #: "closed", "open" or "half-open"; and its failures in a row.
    breaker: str
    failures_in_a_row: int
    answer_p50_ms: float | None
    answer_p95_ms: float | None
    #: How many it may be sent at once now, as the deliverer that wrote last saw it.
    concurrency_limit: int | None
    #: Until when it is sent nothing, having refused even one at a time
    #: (limits.py); None unless that is still to come.
    resting_until: dt.datetime | None
    #: Pending now, of which held (paused, or waiting on another).
    pending: int
    held: int
    #: Settled in the last 24 hours, by status.
    last_day: dict[str, int]
    last_error: str
    last_error_at: dt.datetime | None

    def as_json(self) -> dict[str, Any]:
        return {
            field.name: _jsonable(getattr(self, field.name)) for field in dataclasses.fields(self)
        }


def _jsonable(value: Any) -> Any:
    if isinstance(value, dt.datetime):
        return aware(value).isoformat()
    return value


def milliseconds(value: float | None) -> str:
    """An answer time as people read it: ``44 ms``, or ``—`` when none is known."""
    return "—" if value is None else f"{value:.0f} ms"


def resting_until(host: Host, now: dt.datetime) -> dt.datetime | None:
    """Until when ``host`` rests, if that is after ``now``: a rest over is none."""
    until = host.resting_until
    # In UTC: two times of one zone compare as wall-clock times.
    return until if until is not None and aware(until) > aware(now).astimezone(dt.UTC) else None


def host_picture(
    name: str, *, now: dt.datetime | None = None, using: str | None = None
) -> HostPicture | None:
    """``name``'s picture, or None for a host never sent to (no row, no
    delivery). ``name`` in any form (``Bücher.Example.``), or a URL on it."""
    name = host_named(name)
    if not name:
        return None
    return kept_host_picture(name, now=now, using=using)


def _breaker_of(name: str, alias: str) -> tuple[str, int]:
    """The state of the host ``name``'s breaker and its failures in a row;
    with breakers kept per inbox (``SCOPE`` "inbox"), the worst of its
    inboxes' (open before half-open before closed) and the most failures,
    each of them counted: those whose key (a canonical inbox) begins with a
    URL on this host, port and all, which no other host's inbox does, and
    those of the portable inboxes whose rows are kept under it."""
    breakers = Breaker.objects.using(alias)
    # Compared in the database, as instants: with USE_TZ off, the times the
    # ORM reads are wall-clock ones, and one in the hour a clock goes back
    # through is read an hour off.
    now = orm_datetime(aware_now(), alias)
    own = (
        breakers.filter(key=name)
        .values_list(
            Case(
                When(open_until__isnull=True, then=Value("closed")),
                When(open_until__gt=now, then=Value("open")),
                default=Value("half-open"),
            ),
            "failures",
        )
        .first()
    )
    if own is not None:
        state, failures = own
        return str(state), int(failures)
    on_host = Q()
    for prefix in url_prefixes(name):
        on_host |= Q(key__startswith=prefix)
    # And a portable inbox's, keyed by its ap:// name, where its rows are
    # kept under this host (its first gateway's).
    on_host |= Q(
        key__in=Delivery.objects.using(alias)
        .filter(host=name, inbox__startswith="ap://")
        .values("inbox")
    )
    found = breakers.filter(on_host).aggregate(
        failures=Max("failures"),
        open=Count("key", filter=Q(open_until__gt=now)),
        half_open=Count("key", filter=Q(open_until__lte=now)),
    )
    state = "open" if found["open"] else "half-open" if found["half_open"] else "closed"
    return state, found["failures"] or 0


def kept_host_picture(
    name: str, *, now: dt.datetime | None = None, using: str | None = None
) -> HostPicture | None:
    """The picture of the host named ``name`` exactly as rows keep it (a
    ``Host`` row's name, whatever it holds), or None as for
    :func:`host_picture`. Never read again as a canonical name: a row an
    older version or a host project wrote (``Victim.Example.``) would be
    pictured with another host's breaker and counts."""
    if "\x00" in name:
        return None  # no row holds it (PostgreSQL's text cannot): never asked
    alias = using or database_alias()
    # In UTC: the last day is 24 hours on the day a clock changes too.
    now = now or aware_now()
    host = Host.objects.using(alias).filter(name=name).annotate(trouble=TROUBLE).first()
    deliveries = Delivery.objects.using(alias).filter(host=name)
    pending = deliveries.filter(status=Status.PENDING).aggregate(
        pending=Count("id"), held=Count("id", filter=Q(due_at__isnull=True))
    )
    last_day = {
        status: count
        for status, count in deliveries.filter(
            status__in=[s for s in Status if s != Status.PENDING],
            settled_at__gte=orm_datetime(now - DAY, alias),
        )
        .values_list("status")
        .annotate(n=Count("id"))
        .order_by()
    }
    if host is None and not pending["pending"] and not last_day:
        return None
    state, failures = _breaker_of(name, alias)
    return HostPicture(
        name=name,
        trouble=TROUBLES[host.trouble] if host is not None else "ok",
        first_seen_at=host.first_seen_at if host else None,
        last_delivered_at=host.last_delivered_at if host else None,
        failing_since=host.failing_since if host else None,
        unavailable_since=host.unavailable_since if host else None,
        paused_at=host.paused_at if host else None,
        scheme=host.scheme if host else "",
        breaker=state,
        failures_in_a_row=failures,
        answer_p50_ms=host.answer_p50_ms if host else None,
        answer_p95_ms=host.answer_p95_ms if host else None,
        concurrency_limit=host.concurrency_limit if host else None,
        resting_until=resting_until(host, now) if host else None,
        pending=pending["pending"],
        held=pending["held"],
        last_day={str(status): last_day.get(status, 0) for status in Status if status != "pending"},
        last_error=host.last_error if host else "",
        last_error_at=host.last_error_at if host else None,
    )
