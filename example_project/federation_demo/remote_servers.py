"""Signal receivers that keep :class:`~federation_demo.models.RemoteServer`
up to date: a host project's record of the servers it delivers to.

Connected in ``FederationDemoConfig.ready``. Each is one statement in the
usual case (an UPDATE of the host's row; its first time, an INSERT too): the
deliverer sends the signals from its loop, so a receiver must be cheap. One
that raises is logged by the package and the loop goes on all the same.
Webhook deliveries (``destination`` set) are not about a remote server, and
are left out.
"""

from __future__ import annotations

from typing import Any

from django.db import IntegrityError, transaction
from django.db.models import F, Value
from django.db.models.functions import Coalesce
from django.utils import timezone

from django_federation_delivery.addresses import host_of
from django_federation_delivery.models import Delivery
from django_federation_delivery.signals import Failure, Settled
from federation_demo.models import RemoteServer

GONE = 410


def count_delivered(sender: Any, settled: Settled, **kwargs: Any) -> None:
    """``delivery_settled``: a delivery that got through counts as delivered."""
    if settled.destination or settled.outcome != "delivered":
        return
    _update(_host(settled.inbox, settled.delivery_id), delivered=F("delivered") + 1)


def count_failure(sender: Any, failure: Failure, **kwargs: Any) -> None:
    """``delivery_failed``: counts against the server; a 410 refusal marks it
    gone, from the first time on."""
    if failure.destination:
        return
    now = timezone.now()
    changes: dict[str, Any] = {
        "failures": F("failures") + 1,
        "last_failure_status": failure.status,
        "last_failure_at": now,
    }
    if failure.refused and failure.status == GONE:
        changes["gone"] = True
        changes["gone_at"] = Coalesce(F("gone_at"), Value(now))
    _update(_host(failure.inbox, failure.delivery_id), **changes)


def _host(inbox: str, delivery_id: int) -> str:
    """The host the package names the delivery's (``Delivery.host``): the
    inbox's, or, for a portable inbox (``ap://``), its gateway's, read from
    the delivery, still in the queue when its signal is sent ("" if gone)."""
    host = host_of(inbox)
    if host:
        return host
    found = Delivery.objects.filter(pk=delivery_id).values_list("host", flat=True).first()
    return found or ""


def _update(host: str, **changes: Any) -> None:
    if not host:
        return
    if RemoteServer.objects.filter(host=host).update(**changes):
        return
    try:
        # A savepoint: a row made meanwhile by another process leaves the
        # caller's transaction usable for the update below.
        with transaction.atomic():
            RemoteServer.objects.create(host=host)
    except IntegrityError:
        pass
    RemoteServer.objects.filter(host=host).update(**changes)
