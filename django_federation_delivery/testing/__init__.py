"""Deliveries in a host project's own tests, as ``mail.outbox`` is for email.

In a test, what ``send()``, ``send_portable()`` and ``send_webhook()`` queue
is listed in :data:`outbox`, one :class:`Outgoing` a delivery: its inbox (or
destination), kind, activity (or event), and the headers its request would
carry, signed as the deliverer signs them. Sending only queues: nothing
touches the network until a deliverer runs, and :func:`deliver_all` runs
the real loop once, against a :class:`~.fake.FakeInbox` that verifies every
signature as a real receiver does, so that a test sees outcomes and signals.

With pytest, installing the app is enough: its plugin (``pytest_plugin.py``)
gives the fixtures ``delivery_outbox`` and ``fake_inbox``. With Django's
runner, mix :class:`DeliveryTestMixin` into a ``TransactionTestCase``.

Needs the ``testing`` extra (``responses`` and the three verifiers).
"""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any

from django.db.models.signals import post_save

from django_federation_delivery.models import Batch, Delivery, Kind

__all__ = [
    "DeliveryTestMixin",
    "Outgoing",
    "capture",
    "deliver_all",
    "outbox",
    "stop_capturing",
]


@dataclasses.dataclass(frozen=True)
class Outgoing:
    """A delivery a send queued, as a test looks at it."""

    delivery_id: int
    batch_id: int
    #: "activitypub" or "webhook".
    kind: str
    #: The inbox's URL; a webhook's destination name.
    inbox: str
    #: A webhook's destination name; "" for an inbox.
    destination: str
    #: The activity's sender; "" for a webhook event.
    sender: str
    #: The bytes the request carries.
    body: bytes
    #: Where a portable inbox is POSTed, in order; () for the inbox itself.
    via: tuple[str, ...] = ()
    #: Whether its batch was sent with ``synchronize_collection``: an inbox's
    #: request then carries the ``Collection-Synchronization`` header.
    synchronize_collection: bool = False

    @property
    def activity(self) -> Any:
        """The activity (or, for a webhook, the event) as JSON reads it."""
        return json.loads(self.body)

    @property
    def event(self) -> Any:
        return self.activity

    def headers(self, *, scheme: str | None = None) -> dict[str, str]:
        """The headers a delivery attempt made now would send: for an inbox,
        signed in ``scheme`` ("draft-cavage" or "rfc9421"; by default the
        first a deliverer tries, ``FIRST_SCHEME``) with the sender's key (in
        RFC 9421 whatever ``scheme`` says for an Ed25519 key, as an attempt
        signs), ``Collection-Synchronization`` included when its batch asks
        for it; for a webhook, its destination's (Standard Webhooks
        signatures included)."""
        if self.kind == Kind.WEBHOOK:
            return _webhook_headers(self)
        return _inbox_headers(self, scheme)


#: What the sends of the test under way queued, in order; emptied by
#: :func:`capture`, which the fixtures and the mixin call before each test.
outbox: list[Outgoing] = []


def _captured(sender: type[Batch], instance: Batch, created: bool, **kwargs: Any) -> None:
    if not created:
        return
    rows = (
        Delivery.objects.using(kwargs.get("using") or "default")
        .filter(batch_id=instance.pk)
        .order_by("id")
        .values_list("id", "kind", "inbox", "destination", "via")
    )
    body = instance.body.encode()
    outbox.extend(
        Outgoing(
            delivery_id=id,
            batch_id=instance.pk,
            kind=kind,
            inbox=inbox,
            destination=destination,
            sender=instance.sender,
            body=body,
            via=tuple(via or ()),
            synchronize_collection=instance.synchronize_collection,
        )
        for id, kind, inbox, destination, via in rows
    )


_UID = "django_federation_delivery.testing.outbox"


def capture() -> list[Outgoing]:
    """Empty :data:`outbox` and list in it what each send queues from now on.
    Returns the outbox."""
    outbox.clear()
    post_save.connect(_captured, sender=Batch, dispatch_uid=_UID, weak=False)
    return outbox


def stop_capturing() -> None:
    post_save.disconnect(sender=Batch, dispatch_uid=_UID)


def deliver_all(*, fake: Any = None, **options: Any) -> Any:
    """Run the real deliverer until nothing is due, against ``fake`` (a
    :class:`~.fake.FakeInbox`; a new one accepting everything if None): every
    request it makes is answered by the fake, which verifies its signature.
    Returns the deliverer's summary (delivered, retrying, refused, failed…).

    Retries are due later (their backoff): they stay queued, as they would.
    ``options`` are the deliverer's (``concurrency``, ``per_host``…)."""
    from django_federation_delivery.deliverer import Deliverer
    from django_federation_delivery.testing.fake import FakeInbox

    if fake is not None and fake.active:
        return Deliverer(**options).run(drain=True)
    with fake or FakeInbox():
        return Deliverer(**options).run(drain=True)


class DeliveryTestMixin:
    """For a Django ``TransactionTestCase`` (the deliverer commits as it
    goes): :data:`outbox` captured in each test, as ``self.delivery_outbox``,
    and ``self.fake_inbox`` answering every request :meth:`deliver_all`
    makes."""

    delivery_outbox: list[Outgoing]

    def setUp(self) -> None:
        from django_federation_delivery.testing.fake import FakeInbox

        super().setUp()  # type: ignore[misc]
        self.delivery_outbox = capture()
        self.addCleanup(stop_capturing)  # type: ignore[attr-defined]
        self.fake_inbox = FakeInbox()
        self.fake_inbox.start()
        self.addCleanup(self.fake_inbox.stop)  # type: ignore[attr-defined]

    def deliver_all(self, **options: Any) -> Any:
        return deliver_all(fake=self.fake_inbox, **options)


def _inbox_headers(outgoing: Outgoing, scheme: str | None) -> dict[str, str]:
    # Made as an attempt makes its first knock's (inboxes.py, channels/activitypub.py).
    from django_federation_delivery.channels.activitypub import (
        InboxJob,
        signed_request,
        signing_scheme,
    )
    from django_federation_delivery.conf import app_settings
    from django_federation_delivery.inboxes import synchronization_headers
    from django_federation_delivery.keys import KeyCache
    from django_federation_delivery.signatures import Scheme, body_sha256

    key = KeyCache().get(outgoing.sender)
    if key is None:
        raise LookupError(f"SENDER_KEYS has no key for {outgoing.sender!r}")
    synchronization = app_settings.callable_setting("COLLECTION_SYNCHRONIZATION")
    job = InboxJob(
        delivery_id=outgoing.delivery_id,
        targets=outgoing.via or (outgoing.inbox,),
        body=outgoing.body,
        body_sha256=body_sha256(outgoing.body),
        key=key,
        sender=outgoing.sender,
        scheme=Scheme(scheme) if scheme else app_settings.first_scheme,
        extra_headers=(
            synchronization_headers(synchronization, outgoing.sender, outgoing.inbox)
            if outgoing.synchronize_collection
            else {}
        ),
    )
    _, headers = signed_request(job, key, job.targets[0], signing_scheme(key, job.scheme))
    return headers


def _webhook_headers(outgoing: Outgoing) -> dict[str, str]:
    from django_federation_delivery.channels import Event
    from django_federation_delivery.webhooks.destinations import configured_destinations

    destination = configured_destinations()[outgoing.destination]
    request = destination.request(Event.read(outgoing.body.decode()), now=time.time())
    return dict(request.headers)
