"""``send_webhook``: an event queued for configured destinations, strictly in order.

One batch an event: its body is the event as JSON (type, id, timestamp,
data), written once, so that every retry sends and signs the same bytes. One
delivery a destination, of kind ``webhook``, whose destination and inbox are
the destination's name: the URL is the credential and is never written, only
looked up in the settings when the delivery is sent. Its host is the
destination's key (``delivery_key``), so that per-host slots, breakers and
pauses apply per destination. Its lane is the webhook lane, claimed before
every other: an event never waits behind an activity's fan-out.

All webhook deliveries to one destination share one sequence of the queue's
ordering: each waits until the one queued before it is delivered or given up,
so "resolved" never overtakes "raised", and a failing event holds the later
ones to its destination, and nothing else.
"""

from __future__ import annotations

import datetime
import logging
import uuid
from collections.abc import Iterable
from typing import Any

from asgiref.sync import sync_to_async
from django.core.exceptions import ImproperlyConfigured
from django.db import transaction

from django_federation_delivery import tracing
from django_federation_delivery.addresses import BINARY, quoted, quoted_name
from django_federation_delivery.channels import Event
from django_federation_delivery.channels.base import policy_of
from django_federation_delivery.channels.policy import LANES
from django_federation_delivery.conf import SETTING, app_settings, database_alias
from django_federation_delivery.exceptions import InvalidDelivery
from django_federation_delivery.models import Batch, Kind, Lane
from django_federation_delivery.sending import checked_idempotency_key
from django_federation_delivery.signatures import body_sha256
from django_federation_delivery.store import queueing
from django_federation_delivery.webhooks.destinations import Destination, configured, delivery_key
from django_federation_delivery.webhooks.policy import settings_policy

__all__ = ["EVERY_DESTINATION", "ORDERING_KEY", "asend_webhook", "event_time", "send_webhook"]

logger = logging.getLogger(__name__)

#: ``send_webhook(EVERY_DESTINATION, …)``: each configured destination
#: subscribed to the event's type.
EVERY_DESTINATION = "*"

#: The ordering key of every webhook batch: with the destination as the
#: "inbox", one sequence a destination.
ORDERING_KEY = "webhook"


def send_webhook(
    destination: str | Iterable[str],
    event_type: str,
    data: Any,
    *,
    event_id: str | uuid.UUID | None = None,
    idempotency_key: str = "",
    using: str | None = None,
) -> Batch | None:
    """Queue the event ``event_type`` with ``data`` (anything JSON can write)
    for ``destination``, a configured destination's name or a list of them,
    or ``"*"`` (:data:`EVERY_DESTINATION`) for every configured one. Only
    those subscribed to ``event_type`` get it (a destination's ``events``;
    every event if it names none).

    Written in the caller's transaction: rolled back, nothing is queued. An
    unknown destination, an empty or path-like event type, or data JSON
    cannot write, or an event larger than ``WEBHOOK_MAX_BYTES`` as JSON, raises
    ``InvalidDelivery`` naming it, with nothing written.
    ``event_id`` (a new UUID by default) is the ``webhook-id`` a receiver
    de-duplicates by. Returns the batch, or None when no destination named
    is subscribed (or none is named). With an ``idempotency_key`` a batch
    was sent with already and is kept under, nothing is queued and that batch
    is returned, whatever the destinations subscribed this time; when an
    activity's batch holds the key, ``InvalidDelivery`` naming it.
    """
    alias = database_alias(using)
    idempotency_key = checked_idempotency_key(idempotency_key)
    # None alone is "a new one": "" or 0 is a bad id, refused as Event.of refuses it.
    if event_id is None:
        event_id = str(uuid.uuid4())
    event = Event.of(event_type, event_id, event_time(), data)
    try:
        found = [(name, d) for name, d in _destinations(destination) if d.receives(event.type)]
    except (InvalidDelivery, _Unusable) as refusal:
        # A retry to a destination taken out of the settings since, or whose
        # URL no longer parses (not settings broken for every destination).
        return _kept_or(refusal, idempotency_key, alias)
    if not found:
        # A retry to destinations no longer subscribed still returns the
        # batch kept under its key, as send()'s does.
        return queueing.kept_batch(idempotency_key, kind=Kind.WEBHOOK, using=alias)
    names = [name for name, _ in found]
    # The settings every kind's policy starts from: a bad one raises the
    # package's own error, naming it, before any kind's policy is asked.
    settings_policy()
    policies = {name: policy_of(d.channel) for name, d in found}
    encoded = event.as_json()
    for name, found_at in found:
        limit = policies[name].max_bytes
        if len(encoded) > limit:
            taken = (
                f"WEBHOOK_MAX_BYTES ({limit})"
                if limit == app_settings.webhook_max_bytes
                else f"the {limit} bytes the {found_at.channel.name} kind of {name!r} takes"
            )
            too_big = InvalidDelivery(
                f"the event {event.type!r} is {len(encoded)} bytes as JSON, more than {taken}"
            )
            # A retry after the limit was lowered: its batch, if kept.
            return _kept_or(too_big, idempotency_key, alias)
    # The most urgent lane any of its destinations' kinds asks for.
    lane = min((policy.lane for policy in policies.values()), key=LANES.index)
    body = encoded.decode()
    # No savepoint, as send()'s.
    with transaction.atomic(using=alias, savepoint=False):
        batch = queueing.enqueue(
            Batch(
                sender="",
                body=body,
                body_sha256=body_sha256(body.encode()),
                ordering_key=ORDERING_KEY,
                lane=Lane(lane),
                event_type=event.type,
                event_id=event.id,
                idempotency_key=idempotency_key,
                # Each attempt's span is a child of the caller's (tracing.py).
                trace_context=tracing.carried(),
            ),
            [
                queueing.Queued(
                    name, delivery_key(name), destination=name, ordered=policies[name].ordered
                )
                for name in names
            ],
            kind=Kind.WEBHOOK,
            using=alias,
        )
    # Out of the transaction: refused, the caller's is left as it was.
    return queueing.of_kind(batch, Kind.WEBHOOK)


async def asend_webhook(
    destination: str | Iterable[str],
    event_type: str,
    data: Any,
    *,
    event_id: str | uuid.UUID | None = None,
    idempotency_key: str = "",
    using: str | None = None,
) -> Batch | None:
    """:func:`send_webhook`, awaited from async code: run in the thread
    Django's async ORM runs its queries in (see ``sending.asend``)."""
    return await sync_to_async(send_webhook, thread_sensitive=True)(
        destination,
        event_type,
        data,
        event_id=event_id,
        idempotency_key=idempotency_key,
        using=using,
    )


def event_time() -> datetime.datetime:
    """An event's time, now: aware and in UTC whatever USE_TZ says (a sent
    event's, a test ping's). With it off, ``timezone.now()`` is naive, which
    ``Event.of`` refuses, and an event's time is UTC on the wire."""
    return datetime.datetime.now(datetime.UTC)


class _Unusable(ImproperlyConfigured):
    """A destination named whose URL its kind cannot use."""


def _kept_or(refusal: Exception, idempotency_key: str, alias: str) -> Batch:
    """The batch kept under ``idempotency_key``, for a retry that would be
    refused as it is given now; ``refusal`` raised if none is kept."""
    kept = queueing.kept_batch(idempotency_key, kind=Kind.WEBHOOK, using=alias)
    if kept is None:
        raise refusal
    return kept


def _destinations(destination: object) -> list[tuple[str, Destination]]:
    """The destinations named, each once, each configured (its URL parsed, so
    that a bad one is reported now by its name). Under ``"*"``, one whose URL
    does not parse is left out, and logged: the caller named it not, and the
    others are sent to as ever."""
    found = configured()
    every = destination == EVERY_DESTINATION
    if every:
        given: list[object] = list(found.names)
    elif isinstance(destination, str):
        given = [destination]
    elif isinstance(destination, BINARY) or not isinstance(destination, Iterable):
        raise InvalidDelivery(
            "destination must be a destination's name or a list of names, "
            f"not {quoted(destination)}"
        )
    else:
        given = list(destination)
    destinations: dict[str, Destination] = {}
    for name in given:
        if not isinstance(name, str):
            raise InvalidDelivery(f"a destination is named by a string, not {quoted(name)}")
        destination = found.lookup(name)
        if destination is None:
            raise InvalidDelivery(
                f"no webhook destination named {quoted_name(name)} is configured in "
                f"{SETTING}['WEBHOOKS'] (configured: {', '.join(found.names) or 'none'})"
            )
        if isinstance(destination, str) and every:
            # Its message names it as an error does (a URL pasted as a name cut).
            logger.warning(
                "%s An event sent to every destination is not queued for it.", destination
            )
            continue
        if isinstance(destination, str):
            raise _Unusable(destination)
        destinations.setdefault(name, destination)
    return list(destinations.items())
