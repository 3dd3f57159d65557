"""Hosts: those an operator paused, and the signature scheme each last accepted.

A paused host's deliveries have no due time, so the claim never sees them;
resuming makes them due now. The scheme a host accepted is kept here so that
every process, and the next start, knocks in it first.
"""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Iterable
from typing import NamedTuple

from django.db import transaction
from django.db.models import Case, F, Q, Value, When
from django.utils import timezone

from django_federation_delivery import wakeup
from django_federation_delivery.conf import database_alias
from django_federation_delivery.dialect import aware, aware_now, orm_datetime
from django_federation_delivery.models import Delivery, Host, Status
from django_federation_delivery.outages import Runner
from django_federation_delivery.signatures import Scheme
from django_federation_delivery.store.locks import in_id_order, lock_hosts, write_first
from django_federation_delivery.store.queueing import CHUNK

#: How long a host's remembered scheme is trusted before it is read again,
#: so that what another process learnt reaches this one.
SCHEME_TTL = 60.0
#: The soonest and the latest a deliverer reads the failing hosts again
#: (:func:`read_failing_every`).
FAILING_READ_LEAST = dt.timedelta(seconds=1)
FAILING_READ_MOST = dt.timedelta(minutes=1)
_SCHEMES = frozenset(scheme.value for scheme in Scheme)


def paused_hosts(among: Iterable[str] | None = None, *, using: str | None = None) -> set[str]:
    """The names of the hosts an operator paused (of ``among`` only, if
    given): one query of a small table, whoever asks (the deliverer, the
    admin, the overview); of ``among``, one a :data:`CHUNK` of its names, as
    the admin's "select all" may name more hosts than SQLite takes
    parameters in a statement."""
    paused = Host.objects.using(using or database_alias()).filter(paused_at__isnull=False)
    if among is None:
        return set(paused.values_list("name", flat=True))
    names = list(among)
    return {
        name
        for start in range(0, len(names), CHUNK)
        for name in paused.filter(name__in=names[start : start + CHUNK]).values_list(
            "name", flat=True
        )
    }


def pause_host(host: str, *, using: str | None = None) -> int:
    """Hold a host's deliveries, unsent and not failed: they have no due time
    until :func:`resume_host`. Returns how many were held now; those in
    flight finish, and any retry of theirs is held when it comes due.

    An operator's pause, with no reason: a webhook destination's reason for
    being disabled (``webhooks/life.py``) is not kept beside it, so that the
    pause never reads as the deliverer's."""
    return pause_hosts([host], using=using)


def pause_hosts(names: Iterable[str], *, using: str | None = None) -> int:
    """:func:`pause_host` of each of ``names``, a :data:`CHUNK` of them a
    transaction of a few statements: the admin's "select all" may name tens
    of thousands of hosts (a transaction each took 75 s for 32,767 on
    SQLite). Returns how many deliveries were held now."""
    alias = using or database_alias()
    # One row a name (PostgreSQL's upsert needs it), in name order: the
    # order the upsert locks them in, as every writer of many hosts does
    # (lock_hosts, a deliverer's record_hosts); the admin's hosts list
    # gives them by trouble, and two orders crossing deadlock.
    unique = sorted(set(names))
    held = 0
    for start in range(0, len(unique), CHUNK):
        chunk = unique[start : start + CHUNK]
        now = timezone.now()
        with transaction.atomic(using=alias):
            # An upsert, a write first: on SQLite, no read before it.
            Host.objects.using(alias).bulk_create(
                [Host(name=name, paused_at=now, disabled_reason="") for name in chunk],
                update_conflicts=True,
                unique_fields=["name"],
                update_fields=["paused_at", "disabled_reason", "updated_at"],
            )
            held += hold(*chunk, using=alias)
    return held


def no_sooner_than_kept(due: dt.datetime) -> Case:
    """``due``, or the row's ``not_before`` if later: the end of the lease
    of an attempt of it still in flight when it was given up, then
    requeued (``requeued`` in ``store/queries.sql``), so that it is never
    sent beside that attempt."""
    return Case(When(not_before__gt=due, then=F("not_before")), default=Value(due))


def hold(*hosts: str, using: str | None = None) -> int:
    """Take the due time of the pending deliveries to paused ``hosts`` that
    no deliverer holds: the claim no longer sees them. Returns how many. In
    the caller's transaction."""
    due = (
        Delivery.objects.using(using or database_alias())
        .filter(host__in=hosts, status=Status.PENDING, lease_token__isnull=True)
        .exclude(due_at__isnull=True)
    )
    return int(in_id_order(due).update(due_at=None))


def resume_host(host: str, *, using: str | None = None) -> int:
    """Make a paused host's held deliveries due now. Returns how many.

    A disabled webhook destination's reason goes with its pause, however it
    is resumed (enabled again, or from the hosts' list): kept, it would be
    read as the reason of any later pause."""
    return resume_hosts([host], using=using)


def resume_hosts(names: Iterable[str], *, using: str | None = None) -> int:
    """:func:`resume_host` of each of ``names``, a :data:`CHUNK` of them a
    transaction, as :func:`pause_hosts` pauses them. Returns how many
    deliveries are due now."""
    alias = using or database_alias()
    # In name order over all the chunks, as pause_hosts writes them.
    names = sorted(set(names))
    released = 0
    for start in range(0, len(names), CHUNK):
        chunk = names[start : start + CHUNK]
        now = timezone.now()
        # Due at this instant, as the claims read it, whatever USE_TZ says.
        due = orm_datetime(aware_now(), alias)
        with transaction.atomic(using=alias):
            # Its rows locked first: a requeue to one of them waits, or is waited for.
            lock_hosts(chunk, alias)
            Host.objects.using(alias).filter(name__in=chunk).update(
                paused_at=None, disabled_reason="", updated_at=now
            )
            held = Delivery.objects.using(alias).filter(
                host__in=chunk, status=Status.PENDING, due_at__isnull=True, after__isnull=True
            )
            released += in_id_order(held).update(due_at=no_sooner_than_kept(due), not_before=None)
    wakeup.wake_all(alias)
    return int(released)


def failing_since(host: str, now: dt.datetime, *, using: str | None = None) -> dt.datetime:
    """When ``host`` (an inbox's host, or a destination's key) started
    failing, as every deliverer knows it: ``now``, written, if it was not.
    Aware, as ``now`` is (the loop's), whatever ``USE_TZ`` says."""
    alias = using or database_alias()
    # The ORM takes a naive time with USE_TZ off (SQLite's backend refuses
    # an aware one), and gives one back (PostgreSQL's too).
    at = orm_datetime(now, alias)
    with transaction.atomic(using=alias):
        write_first(alias)  # on SQLite, before get_or_create reads the row
        found, _created = Host.objects.using(alias).get_or_create(
            name=host, defaults={"failing_since": at}
        )
        if found.failing_since is None:
            Host.objects.using(alias).filter(name=host).update(failing_since=at)
            return now
        return aware(found.failing_since)


#: A failing host delivered to since it began failing (:attr:`Failing.up`).
UP_SINCE_FAILING = Q(last_delivered_at__gt=F("failing_since"))
#: When such a host was last delivered to; None for any other. Compared in
#: the database, as instants: with USE_TZ off, the times the ORM reads are
#: wall-clock ones, an hour off in the hour a clock goes back through.
UP_AT = Case(When(UP_SINCE_FAILING, then=F("last_delivered_at")), default=None)


class Failing(NamedTuple):
    """A host's failing, as its row has it: aware, whatever ``USE_TZ`` says."""

    #: Since when it fails.
    since: dt.datetime
    #: When ``host_failing`` was sent for it; None if not yet.
    told: dt.datetime | None
    #: When it was last delivered to, if it was since it began failing: by a
    #: deliverer whose view (:func:`read_failing_every`) did not have it
    #: failing, so that its success cleared nothing. It was up then.
    up: dt.datetime | None


def failing_hosts(*, destinations: bool = False, using: str | None = None) -> dict[str, Failing]:
    """Each host failing, as every deliverer knows it. With ``destinations``,
    the webhook destinations' keys alone (a name in angle brackets:
    ``delivery_key``)."""
    hosts = Host.objects.using(using or database_alias()).filter(failing_since__isnull=False)
    if destinations:
        hosts = hosts.filter(name__startswith="<")
    rows = hosts.values_list("name", "failing_since", "failing_told_at", UP_AT)
    return {
        name: Failing(
            aware(since),
            aware(told) if told is not None else None,
            aware(delivered) if delivered is not None else None,
        )
        for name, since, told, delivered in rows
        if since is not None
    }


def read_failing_every(span: dt.timedelta) -> dt.timedelta:
    """How long a deliverer keeps what it read of the failing hosts (health.py)
    or destinations (webhooks/life.py), judged failing after ``span``
    (``HOST_FAILING_AFTER``, ``WEBHOOK_DISABLE_AFTER``), before it reads them
    again: a tenth of ``span``, between a second and a minute. Read once
    only, a host another deliverer saw fail since would never be cleared by
    this one's successes, and one cleared since (seen again, enabled, or up
    through another deliverer) would stay failing here; read again this
    often, what this one judges is never more than that late, for one query
    of the few failing rows (a partial index), never one a delivery."""
    return min(max(span / 10, FAILING_READ_LEAST), FAILING_READ_MOST)


def host_schemes(hosts: Iterable[str], *, using: str | None = None) -> dict[str, str]:
    """The scheme each of ``hosts`` last accepted, for those that have one."""
    manager = Host.objects.using(using or database_alias())
    return dict(
        manager.filter(name__in=list(hosts)).exclude(scheme="").values_list("name", "scheme")
    )


def remember_schemes(schemes: dict[str, str], *, using: str | None = None) -> int:
    """Record the scheme each host accepted, for every process and the next start."""
    if not schemes:
        return 0
    Host.objects.using(using or database_alias()).bulk_create(
        # Upserted in name order, as every writer of many hosts locks them
        # (store.locks.in_name_order): a deliverer's record_hosts, a pause.
        [
            Host(name=name, scheme=scheme, updated_at=timezone.now())
            for name, scheme in sorted(schemes.items())
        ],
        update_conflicts=True,
        unique_fields=["name"],
        update_fields=["scheme", "updated_at"],
    )
    return len(schemes)


class KnownSchemes:
    """The scheme each host last accepted, as one deliverer knows it: read from
    the table every process shares, trusted for ``SCHEME_TTL``, and what this
    process learns written back with its outcomes.

    ``db`` runs a query and returns None when the database is away, so that a
    scheme not written now is written next time.
    """

    def __init__(self, first: Scheme, db: Runner, *, using: str) -> None:
        self.first = first
        self._db = db
        self.using = using
        #: host -> (when read or learnt, the scheme; None: never told).
        self._known: dict[str, tuple[float, Scheme | None]] = {}
        #: Learnt since last written.
        self._learned: dict[str, str] = {}

    def scheme_for(self, host: str) -> Scheme:
        """The scheme to knock on ``host`` in first: the one it last accepted."""
        known = self._known.get(host)
        if known is None or known[1] is None:
            return self.first
        return known[1]

    def read(self, hosts: set[str]) -> None:
        """Read what is not known of ``hosts``, or known too long ago."""
        stale = time.monotonic() - SCHEME_TTL
        unknown = {host for host in hosts if self._known.get(host, (stale, None))[0] <= stale}
        if not unknown:
            return
        found = self._db(host_schemes, unknown, using=self.using)
        if found is None:
            return
        if len(self._known) > 50_000:
            self._known.clear()
        now = time.monotonic()
        for host in unknown:
            scheme = found.get(host)
            self._known[host] = (now, Scheme(scheme) if scheme in _SCHEMES else None)

    def learn(self, host: str, accepted: Scheme | None) -> None:
        if accepted is not None and accepted != self.scheme_for(host):
            self._known[host] = (time.monotonic(), accepted)
            # Back on the first: "" as for a host never told otherwise (the
            # host's picture and the admin say "—", no scheme learned).
            self._learned[host] = "" if accepted == self.first else accepted.value

    def write(self) -> None:
        if self._learned:
            learned, self._learned = self._learned, {}
            if self._db(remember_schemes, learned, using=self.using) is None:
                self._learned = {**learned, **self._learned}  # written next time
