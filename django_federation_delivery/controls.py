"""An operator's controls: pause, resume, give up, requeue, reset.

A host project's code calls these, and the admin's actions do the same:
each sends the signals a delivery leaving the queue sends, and returns how
many rows it changed. A host given here is read in any form and made
canonical; the admin acts on names as its rows keep them.

Each acts on one database: the one its rows come from (a queryset's, as its
``update()`` would write: the one named with ``using()``, else the routers'
choice), or the one named with ``using``; ``None``, as everywhere in the
package, for the default.
"""

from __future__ import annotations

import datetime as dt
import functools
from collections.abc import Iterable
from typing import Any

from django.db import router, transaction
from django.db.models import QuerySet

from django_federation_delivery import breakers, hosts, portable, signals
from django_federation_delivery.addresses import host_of, normalize_inbox, quoted, required_host
from django_federation_delivery.availability import mark_host_seen
from django_federation_delivery.conf import app_settings, database_alias
from django_federation_delivery.dialect import aware_now, orm_datetime
from django_federation_delivery.exceptions import InvalidDelivery
from django_federation_delivery.models import Batch, Delivery, Status
from django_federation_delivery.sending import checked_text
from django_federation_delivery.settling import DEADLINE_PASSED, failure
from django_federation_delivery.store import settlements

__all__ = [
    "REQUEUED_FROM",
    "database_of",
    "give_up",
    "give_up_host",
    "give_up_overdue",
    "mark_host_seen",
    "pause_host",
    "requeue",
    "reset_breaker",
    "resume_host",
]

CHUNK = 500
#: What :func:`requeue` puts back: every way of leaving the queue undelivered.
REQUEUED_FROM = sorted(settlements.FINAL - {Status.DELIVERED})


def database_of(rows: QuerySet[Any]) -> str:
    """The database a write of ``rows`` goes to, as their ``update()`` or
    ``delete()`` would: the one named with ``using()``, else the one the
    routers choose to write their model to (``"default"`` with none)."""
    # Marked for writing (never run), a query tells that database; unmarked,
    # the one it would read, which a router may send to a replica.
    return rows.select_for_update().db


def pause_host(host: str, *, using: str | None = None) -> int:
    """Hold every delivery to ``host``, unsent and not failed, until
    :func:`resume_host`. Returns how many were held.

    ``host``, here and in :func:`resume_host` and :func:`give_up_host`, is
    read as :func:`mark_host_seen` reads it: a host name in any form
    (``Bücher.Example.``) or a URL on it, in its canonical form; a webhook
    destination's ``<ops>`` as it is. ``ValueError`` naming it if it names
    no host, or if ``using`` names no database in ``DATABASES``, with
    nothing changed."""
    named = required_host(host, "pause_host")
    return hosts.pause_host(named, using=database_alias(using))


def resume_host(host: str, *, using: str | None = None) -> int:
    """Make a paused host's held deliveries due now. Returns how many."""
    named = required_host(host, "resume_host")
    return hosts.resume_host(named, using=database_alias(using))


def reset_breaker(key: str, *, using: str | None = None) -> int:
    """Forget a breaker: closed, its count at nought. Returns how many were
    forgotten (0 or 1). ``key`` is a host, read as :func:`pause_host` reads
    it, or a URL in any spelling: an inbox's, for a breaker kept per inbox
    (``BREAKER = {"SCOPE": "inbox"}``), else any URL on the host, for its
    host's. ``ValueError`` naming it if it is neither, with nothing changed."""
    if isinstance(key, str) and key[:5].lower() == "ap://":
        # A portable inbox's own breaker (kept per inbox): keyed by its name.
        try:
            name = portable.canonical(key)
        except InvalidDelivery:
            raise ValueError(
                f"reset_breaker needs a host name or an inbox's URL, not {quoted(key)}"
            ) from None
        return breakers.reset_breaker(breakers.inbox_key(name), using=database_alias(using))
    if isinstance(key, str) and "://" in key:
        try:
            url = normalize_inbox(key)
        except InvalidDelivery:
            raise ValueError(
                f"reset_breaker needs a host name or an inbox's URL, not {quoted(key)}"
            ) from None
        alias = database_alias(using)
        return breakers.reset_breaker(breakers.inbox_key(url), using=alias) or (
            breakers.reset_breaker(host_of(url), using=alias)
        )
    named = required_host(key, "reset_breaker")
    return breakers.reset_breaker(named, using=database_alias(using))


def give_up_host(
    host: str, reason: str = "given up by an operator", *, using: str | None = None
) -> int:
    """Fail every pending delivery to ``host`` at once, as for a server that is gone."""
    named = required_host(host, "give_up_host")
    pending = Delivery.objects.using(database_alias(using)).filter(
        host=named, status=Status.PENDING
    )
    return give_up(pending, reason)


def give_up(deliveries: QuerySet[Delivery], reason: str = "given up by an operator") -> int:
    """Fail the pending ones of ``deliveries`` for good, telling
    ``delivery_failed`` receivers once it is committed (inside a transaction
    of the caller's, once that commits: rolled back, nothing is told).
    Returns how many.

    Only what this call changed is told about: a delivery another process
    settled in the meantime keeps its outcome and sends no signal here.
    ``reason`` is kept as each one's last error: ``InvalidDelivery`` (a
    ``ValueError``) naming it, and nothing changed, unless it is text of at
    most ``ERROR_LENGTH`` characters that a database can store.

    The rows are read from, and failed in, the database ``deliveries``
    writes to (:func:`database_of`).
    """
    reason = checked_text("reason", reason, app_settings.ERROR_LENGTH)
    return _give_up(deliveries, reason, database_of(deliveries))


def give_up_overdue(
    *, since: dt.datetime, now: dt.datetime | None = None, using: str | None = None
) -> int:
    """Fail for good the pending deliveries no deliverer holds, of the
    batches whose deadline passed after ``since`` (and by ``now``): those
    that wait with no due time (on the one before them in their sequence, on
    what a retraction retracts, or for their paused host), which no claim
    takes, and those due that no claim took in time (a low-priority lane
    behind a busy one, a host whose breaker holds them): a claim would give
    them up, but it may not come. The deliverer calls this every few
    seconds, each time from a little before where it last looked
    (:class:`~.upkeep.Upkeep`); one in hand then is given up by whoever
    settles it. ``delivery_failed`` is told with ``deadline`` true. Returns
    how many. One index read of the batches whose deadline passed in that
    span, and one of their pending rows."""
    alias = database_alias(using)
    batches = Batch.objects.using(alias).filter(
        deadline__gt=orm_datetime(since, alias),
        deadline__lte=orm_datetime(now or aware_now(), alias),
        finished_at__isnull=True,
    )
    ids = list(batches.values_list("id", flat=True))
    if not ids:
        return 0
    # Pending as settled_at says it: by the batches' rows, not the due index.
    overdue = Delivery.objects.using(alias).filter(
        batch_id__in=ids, settled_at__isnull=True, lease_token__isnull=True
    )
    # Those claimed since this read are their claimers' to settle, and tell.
    return _give_up(overdue, DEADLINE_PASSED, alias, deadline=True, unheld=True)


def _give_up(
    deliveries: QuerySet[Delivery],
    reason: str,
    alias: str,
    *,
    deadline: bool = False,
    unheld: bool = False,
) -> int:
    # Pending as settled_at says it: as the status, the rows were found
    # through the due index, every pending row read (see queries.sql).
    if deliveries.query.can_filter() and not deliveries.query.combinator:
        pending = deliveries.using(alias).filter(settled_at__isnull=True)
        ids = list(pending.values_list("id", flat=True))
    else:
        # Sliced ("the first 100") or combined (a union), which takes no
        # filter: its ids first.
        given = list(deliveries.using(alias).values_list("id", flat=True))
        ids = [
            id
            for start in range(0, len(given), CHUNK)
            for id in Delivery.objects.using(alias)
            .filter(id__in=given[start : start + CHUNK], settled_at__isnull=True)
            .values_list("id", flat=True)
        ]
    failed = 0
    for start in range(0, len(ids), CHUNK):
        failed += len(
            settlements.give_up_rows(
                ids[start : start + CHUNK],
                reason,
                on_failing=lambda rows: _tell_failed(rows, reason, alias, deadline=deadline),
                on_finished=functools.partial(signals.batches_finished_on_commit, using=alias),
                using=alias,
                unheld=unheld,
            )
        )
    return failed


def _tell_failed(
    rows: list[settlements.GivenUp], reason: str, using: str, *, deadline: bool = False
) -> None:
    """``delivery_failed`` of each of ``rows``, read now and told on commit."""
    batches = {
        id: (sender, tag, event_type)
        for id, sender, tag, event_type in Batch.objects.using(using)
        .filter(id__in={row.batch_id for row in rows})
        .values_list("id", "sender", "tag", "event_type")
    }
    failures = []
    for row in rows:
        sender, tag, event_type = batches.get(row.batch_id, ("", "", ""))
        failures.append(
            failure(
                row,
                sender=sender,
                tag=tag,
                event_type=event_type,
                status=row.last_status,
                error=reason,
                deadline=deadline,
            )
        )

    def tell() -> None:
        for each in failures:
            signals.send_safely(signals.delivery_failed, failure=each)

    transaction.on_commit(tell, using=using)


def requeue(deliveries: QuerySet[Delivery] | Iterable[Delivery]) -> int:
    """Put failed, refused, skipped or superseded deliveries back in the queue, due now
    (held, if their host is paused, until it is resumed); their attempts so
    far are kept. Others are left alone, and so is one
    whose batch's deadline has passed (:func:`~.store.settlements.requeue_rows`
    says what else). Returns how many.

    Each is requeued in the database it came from: a queryset's as it writes
    (:func:`database_of`); a row's as its ``save()`` would write it. In id
    order, whatever the order given, a chunk at a time: each of a sequence
    waits on the one requeued before it, though that one is in the chunk
    before (the admin lists the newest first)."""
    if isinstance(deliveries, QuerySet):
        alias = database_of(deliveries)
        found = {alias: list(deliveries.using(alias).values_list("id", flat=True))}
    else:
        found = {}
        for delivery in deliveries:
            written = router.db_for_write(Delivery, instance=delivery)
            found.setdefault(written, []).append(delivery.id)
    ordered = {alias: sorted(set(ids)) for alias, ids in found.items()}
    return sum(
        settlements.requeue_rows(ids[start : start + CHUNK], using=alias)
        for alias, ids in ordered.items()
        for start in range(0, len(ids), CHUNK)
    )
