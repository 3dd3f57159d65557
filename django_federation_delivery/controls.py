"""An operator's controls: pause, resume, give up, requeue, reset.

A host project's code calls these, and the admin's actions do the same:
each sends the signals a delivery leaving the queue sends, and returns how
many rows it changed. A host given here is read in any form and made
canonical; the admin acts on names as its rows keep them.
"""

from __future__ import annotations

from collections.abc import Iterable

from django.db.models import QuerySet

from django_federation_delivery import breakers, hosts, signals
from django_federation_delivery.addresses import host_of, normalize_inbox, quoted, required_host
from django_federation_delivery.availability import mark_host_seen
from django_federation_delivery.conf import app_settings
from django_federation_delivery.exceptions import InvalidDelivery
from django_federation_delivery.models import Batch, Delivery, Status
from django_federation_delivery.sending import checked_text
from django_federation_delivery.settling import failure
from django_federation_delivery.store import settlements

__all__ = [
    "REQUEUED_FROM",
    "give_up",
    "give_up_host",
    "mark_host_seen",
    "pause_host",
    "requeue",
    "reset_breaker",
    "resume_host",
]

CHUNK = 500
#: What :func:`requeue` puts back: every way of leaving the queue undelivered.
REQUEUED_FROM = sorted(settlements.FINAL - {Status.DELIVERED})


def pause_host(host: str) -> int:
    """Hold every delivery to ``host``, unsent and not failed, until
    :func:`resume_host`. Returns how many were held.

    ``host``, here and in :func:`resume_host` and :func:`give_up_host`, is
    read as :func:`mark_host_seen` reads it: a host name in any form
    (``Bücher.Example.``) or a URL on it, in its canonical form; a webhook
    destination's ``<ops>`` as it is. ``ValueError`` naming it if it names
    no host, with nothing changed."""
    return hosts.pause_host(required_host(host, "pause_host"))


def resume_host(host: str) -> int:
    """Make a paused host's held deliveries due now. Returns how many."""
    return hosts.resume_host(required_host(host, "resume_host"))


def reset_breaker(key: str) -> int:
    """Forget a breaker: closed, its count at nought. Returns how many were
    forgotten (0 or 1). ``key`` is a host, read as :func:`pause_host` reads
    it, or a URL in any spelling: an inbox's, for a breaker kept per inbox
    (``BREAKER = {"SCOPE": "inbox"}``), else any URL on the host, for its
    host's. ``ValueError`` naming it if it is neither, with nothing changed."""
    if isinstance(key, str) and "://" in key:
        try:
            url = normalize_inbox(key)
        except InvalidDelivery:
            raise ValueError(
                f"reset_breaker needs a host name or an inbox's URL, not {quoted(key)}"
            ) from None
        return breakers.reset_breaker(breakers.inbox_key(url)) or breakers.reset_breaker(
            host_of(url)
        )
    return breakers.reset_breaker(required_host(key, "reset_breaker"))


def give_up_host(host: str, reason: str = "given up by an operator") -> int:
    """Fail every pending delivery to ``host`` at once, as for a server that is gone."""
    named = required_host(host, "give_up_host")
    return give_up(Delivery.objects.filter(host=named, status=Status.PENDING), reason)


def give_up(deliveries: QuerySet[Delivery], reason: str = "given up by an operator") -> int:
    """Fail the pending ones of ``deliveries`` for good, telling
    ``delivery_failed`` receivers once it is committed (inside a transaction
    of the caller's, once this call's part is written). Returns how many.

    Only what this call changed is told about: a delivery another process
    settled in the meantime keeps its outcome and sends no signal here.
    ``reason`` is kept as each one's last error: ``InvalidDelivery`` (a
    ``ValueError``) naming it, and nothing changed, unless it is text of at
    most ``ERROR_LENGTH`` characters that a database can store.
    """
    reason = checked_text("reason", reason, app_settings.ERROR_LENGTH)
    ids = list(deliveries.filter(status=Status.PENDING).values_list("id", flat=True))
    failed = 0
    for start in range(0, len(ids), CHUNK):
        failed += len(
            settlements.give_up_rows(
                ids[start : start + CHUNK],
                reason,
                on_failing=lambda rows: _tell_failed(rows, reason),
                on_finished=signals.send_batches_finished,
            )
        )
    return failed


def _tell_failed(rows: list[settlements.GivenUp], reason: str) -> None:
    batches = {
        id: (sender, tag, event_type)
        for id, sender, tag, event_type in Batch.objects.filter(
            id__in={row.batch_id for row in rows}
        ).values_list("id", "sender", "tag", "event_type")
    }
    for row in rows:
        sender, tag, event_type = batches.get(row.batch_id, ("", "", ""))
        signals.send_safely(
            signals.delivery_failed,
            failure=failure(
                row,
                sender=sender,
                tag=tag,
                event_type=event_type,
                status=row.last_status,
                error=reason,
            ),
        )


def requeue(deliveries: QuerySet[Delivery] | Iterable[Delivery]) -> int:
    """Put failed, refused, skipped or superseded deliveries back in the queue, due now;
    their attempts so far are kept. Others are left alone. Returns how many."""
    ids = [delivery.id for delivery in deliveries]
    return sum(
        settlements.requeue_rows(ids[start : start + CHUNK]) for start in range(0, len(ids), CHUNK)
    )
