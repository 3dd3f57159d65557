"""Deliveries in a host project's own tests, as ``mail.outbox`` is for email.

In a test, what ``send()``, ``send_portable()`` and ``send_webhook()`` queue
(and no rollback undid) is listed in :data:`outbox`, one :class:`Outgoing` a
delivery: its inbox (or destination), kind, activity (or event), and the
headers its request would carry, signed as the deliverer signs them, with
the transport's own. Sending only queues: nothing
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
import sys
import time
from collections.abc import Iterator, Mapping
from typing import Any, SupportsIndex, overload

from django.db import connections, transaction
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.models.signals import post_save

from django_federation_delivery.models import Batch, Delivery, Kind

__all__ = [
    "DeliveryTestMixin",
    "Outgoing",
    "capture",
    "deliver_all",
    "forget_kept",
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
        """The headers a delivery attempt made now would send: the
        transport's own (``User-Agent`` from ``USER_AGENT``, ``Accept``,
        ``Accept-Encoding``) under, for an inbox, those signed in ``scheme``
        ("draft-cavage" or "rfc9421"; by default the first a deliverer
        tries, ``FIRST_SCHEME``) with the sender's key (in RFC 9421 whatever
        ``scheme`` says for an Ed25519 key, as an attempt signs),
        ``Collection-Synchronization`` included when its batch asks for it;
        for a webhook, its destination's (Standard Webhooks signatures
        included)."""
        if self.kind == Kind.WEBHOOK:
            return _as_sent(_webhook_headers(self))
        return _as_sent(_inbox_headers(self, scheme))


class _Send:
    """Where one send's rows stand in the transaction that wrote them:
    committed, or still to be, or undone by a rollback.

    Registered as an on-commit callback of the connection the send used, so
    that Django's own bookkeeping tells: a rollback of the transaction, or of
    a savepoint the send was made in, discards the callback; a commit calls
    it. So it is right under Django's ``TestCase`` (and pytest-django's
    ``db``), whose transaction never commits and keeps the callbacks pending,
    as under ``TransactionTestCase`` (and ``transactional_db``), read from
    any thread and without a query. Reading whether the rows are still
    there would not do: SQLite gives a rolled-back row's id to the next one
    written, and a connection may not be used outside its thread (an
    ``asend``'s). A project's test capturing on-commit callbacks
    (``captureOnCommitCallbacks``) sees one of these a send."""

    __slots__ = ("committed", "connection")

    def __init__(self, connection: BaseDatabaseWrapper) -> None:
        self.connection = connection
        self.committed = False

    def __call__(self) -> None:
        self.committed = True

    @property
    def undone(self) -> bool:
        # Each pending callback is (savepoint ids, callback, robust).
        return not self.committed and all(
            pending[1] is not self for pending in self.connection.run_on_commit
        )


class Outbox(list[Outgoing]):
    """:data:`outbox`: a list, but for the sends a rollback undid, left out
    whenever it is read (a send is listed as it is made, inside its
    transaction, which may roll back later)."""

    def __init__(self) -> None:
        super().__init__()
        #: id() of each listed Outgoing not yet committed -> it, and its send.
        self._pending: dict[int, tuple[Outgoing, _Send]] = {}

    def _list(self, sent: list[Outgoing], send: _Send) -> None:
        super().extend(sent)
        if not send.committed:
            self._pending.update((id(outgoing), (outgoing, send)) for outgoing in sent)

    def _forget_undone(self) -> None:
        undone = set()
        for key, (_, send) in list(self._pending.items()):
            if send.committed:
                del self._pending[key]
            elif send.undone:
                del self._pending[key]
                undone.add(key)
        if undone:
            kept = [outgoing for outgoing in super().__iter__() if id(outgoing) not in undone]
            super().__setitem__(slice(None), kept)

    def clear(self) -> None:
        super().clear()
        self._pending.clear()

    # Every way of reading it reads what is left.

    def __iter__(self) -> Iterator[Outgoing]:
        self._forget_undone()
        return super().__iter__()

    def __reversed__(self) -> Iterator[Outgoing]:
        self._forget_undone()
        return super().__reversed__()

    def __len__(self) -> int:
        self._forget_undone()
        return super().__len__()

    @overload
    def __getitem__(self, index: SupportsIndex) -> Outgoing: ...
    @overload
    def __getitem__(self, index: slice) -> list[Outgoing]: ...
    def __getitem__(self, index: SupportsIndex | slice) -> Outgoing | list[Outgoing]:
        self._forget_undone()
        return super().__getitem__(index)

    def __contains__(self, value: object) -> bool:
        self._forget_undone()
        return super().__contains__(value)

    def __eq__(self, other: object) -> bool:
        self._forget_undone()
        return super().__eq__(other)

    def __ne__(self, other: object) -> bool:
        return not self == other

    def __repr__(self) -> str:
        self._forget_undone()
        return super().__repr__()

    def index(self, value: Outgoing, *args: SupportsIndex) -> int:
        self._forget_undone()
        return super().index(value, *args)

    def count(self, value: Outgoing) -> int:
        self._forget_undone()
        return super().count(value)

    def copy(self) -> list[Outgoing]:
        self._forget_undone()
        return super().copy()

    def __add__(self, other: list[Outgoing]) -> list[Outgoing]:  # type: ignore[override]
        self._forget_undone()
        return super().__add__(other)

    def __radd__(self, other: list[Outgoing]) -> list[Outgoing]:
        # Taken before list's own + as the right operand: a subclass's.
        self._forget_undone()
        return [*other, *super().__iter__()]

    def __mul__(self, times: SupportsIndex) -> list[Outgoing]:
        self._forget_undone()
        return super().__mul__(times)

    __rmul__ = __mul__

    def __lt__(self, other: list[Outgoing]) -> bool:
        self._forget_undone()
        return super().__lt__(other)

    def __le__(self, other: list[Outgoing]) -> bool:
        self._forget_undone()
        return super().__le__(other)

    def __gt__(self, other: list[Outgoing]) -> bool:
        self._forget_undone()
        return super().__gt__(other)

    def __ge__(self, other: list[Outgoing]) -> bool:
        self._forget_undone()
        return super().__ge__(other)


#: What the sends of the test under way queued, in order, but for those a
#: rollback undid; emptied by :func:`capture`, which the fixtures and the
#: mixin call before each test.
outbox: Outbox = Outbox()


def _captured(sender: type[Batch], instance: Batch, created: bool, **kwargs: Any) -> None:
    if not created:
        return
    alias = kwargs.get("using") or "default"
    rows = (
        Delivery.objects.using(alias)
        .filter(batch_id=instance.pk)
        .order_by("id")
        .values_list("id", "kind", "inbox", "destination", "via")
    )
    body = instance.body.encode()
    # post_save comes inside the send's transaction: whether it commits is
    # told later (at once in autocommit).
    send = _Send(connections[alias])
    transaction.on_commit(send, using=alias)
    outbox._list(
        [
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
        ],
        send,
    )


_UID = "django_federation_delivery.testing.outbox"


def capture() -> list[Outgoing]:
    """Empty :data:`outbox` and list in it what each send queues from now on.
    Returns the outbox. What the process kept from a test before is
    forgotten too (:func:`forget_kept`)."""
    forget_kept()
    outbox.clear()
    post_save.connect(_captured, sender=Batch, dispatch_uid=_UID, weak=False)
    return outbox


def forget_kept() -> None:
    """Forget what this process keeps from one test to the next, so that a
    test passes or fails whatever ran before it: the hosts marked
    unavailable, which a send reads once a minute (``availability.py``),
    read again from the test's own database at its first send; and the host
    limits and rests a task queue's rounds keep from one to the next
    (``contrib.rounds``, if a round ran) (a fake a
    test left started is stopped as it ends, by the pytest plugin and by
    :class:`DeliveryTestMixin`; not by this). The helpers
    call it as each test starts (:func:`capture`, the mixin, the pytest
    plugin). The rest a process keeps is a deliverer's own (senders' keys,
    paused hosts, learned schemes), gone with it at the end of
    :func:`deliver_all`."""
    from django_federation_delivery import availability

    availability.forget_known()
    # Not imported here if no round was: only the commands import contrib.
    rounds = sys.modules.get("django_federation_delivery.contrib.rounds")
    if rounds is not None:
        rounds.forget_limits()


def stop_capturing() -> None:
    post_save.disconnect(sender=Batch, dispatch_uid=_UID)


def deliver_all(*, fake: Any = None, **options: Any) -> Any:
    """Run the real deliverer until nothing is due, against ``fake`` (a
    :class:`~.fake.FakeInbox`; if None, the one started already, such as
    the ``fake_inbox`` fixture's, else a new one accepting everything): every
    request it makes is answered by the fake, which verifies its signature.
    Returns the deliverer's summary (delivered, retrying, refused, failed…).

    Retries are due later (their backoff): they stay queued, as they would.
    ``options`` are the deliverer's (``concurrency``, ``per_host``…).

    The deliverer commits as it goes, and closes the connections of the
    thread it runs in once done: called inside a transaction (a test that
    is not transactional, a ``TestCase``, an ``atomic`` block), it is
    refused with a ``RuntimeError`` saying so, before anything is sent."""
    from django_federation_delivery.conf import database_alias
    from django_federation_delivery.deliverer import Deliverer, transaction_open
    from django_federation_delivery.testing.fake import FakeInbox

    alias = database_alias(options.get("using"))
    # Any of the thread's: the deliverer closes them all once done.
    if (atomic := transaction_open()) is not None:
        raise RuntimeError(
            f"deliver_all() runs the deliverer, which commits as it goes and closes "
            f"its thread's connections, and was called inside a transaction on the "
            f"database {atomic!r}: run it in a transactional test "
            "(@pytest.mark.django_db(transaction=True), a TransactionTestCase), outside "
            "any atomic block"
        )
    fake = fake or FakeInbox.current() or FakeInbox()
    fake.using = alias
    if fake.active:
        # It answers, though another was started after it.
        with fake.answering():
            return Deliverer(**options).run(drain=True)
    with fake:
        return Deliverer(**options).run(drain=True)


class DeliveryTestMixin:
    """For a Django ``TransactionTestCase`` (the deliverer commits as it
    goes): :data:`outbox` captured in each test, as ``self.delivery_outbox``,
    and ``self.fake_inbox`` answering every request :meth:`deliver_all`
    makes."""

    delivery_outbox: list[Outgoing]

    def setUp(self) -> None:
        from django_federation_delivery.testing import fake

        super().setUp()  # type: ignore[misc]
        # What an earlier test left in the process forgotten too (forget_kept).
        self.delivery_outbox = capture()
        self.addCleanup(stop_capturing)  # type: ignore[attr-defined]
        # A fake the test leaves started (it failed before its stop()) is
        # stopped as it ends; one setUpClass started is left to its class.
        self.addCleanup(fake.stop_started_since, fake.started_mark())  # type: ignore[attr-defined]
        self.fake_inbox = fake.FakeInbox()
        self.fake_inbox.start()
        self.addCleanup(self.fake_inbox.stop)  # type: ignore[attr-defined]

    def deliver_all(self, **options: Any) -> Any:
        return deliver_all(fake=self.fake_inbox, **options)


def _as_sent(headers: Mapping[str, str]) -> dict[str, str]:
    """``headers`` under the transport's own, merged as an attempt merges
    them (``Transport.post``): a name the caller gives, in any case, wins."""
    from requests.structures import CaseInsensitiveDict

    from django_federation_delivery.conf import app_settings
    from django_federation_delivery.transport import default_headers

    sent = CaseInsensitiveDict(default_headers(app_settings.transport_settings()))
    sent.update(headers)
    return dict(sent.items())


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
            synchronization_headers(
                synchronization, outgoing.sender, outgoing.inbox, via=outgoing.via
            )
            if outgoing.synchronize_collection
            else {}
        ),
    )
    _, headers = signed_request(job, key, job.targets[0], signing_scheme(key, job.scheme))
    return headers


def _webhook_headers(outgoing: Outgoing) -> dict[str, str]:
    from django.core.exceptions import ImproperlyConfigured

    from django_federation_delivery.channels import Destination, Event
    from django_federation_delivery.webhooks.destinations import configured

    # This destination's problem alone: another's that does not parse is not.
    destination = configured().lookup(outgoing.destination)
    if not isinstance(destination, Destination):
        raise ImproperlyConfigured(
            destination or f"no webhook destination {outgoing.destination!r} is configured"
        )
    request = destination.request(Event.read(outgoing.body.decode()), now=time.time())
    return request.sent_headers
