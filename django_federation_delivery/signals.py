"""Signals the host project receives, with what each carries.

What the loop tells of an attempt (``delivery_attempted``,
``delivery_settled``, ``delivery_failed``) is sent before the row it is about
leaves the queue, so a process that stops in between sends it again:
receivers must be safe to repeat. The rest (``batch_finished``, an
operator's give-up, a retraction's supersedings, and the host and destination
signals) are sent once the write that records them has committed, never
inside the package's own transaction, where a receiver's database error
(even one it catches) would undo the write. A receiver that raises (anything
but ``KeyboardInterrupt``) is logged with its traceback, the receivers after
it are called, and the loop goes on.

Each is sent with ``sender=Delivery`` (the model class) and one keyword:

- ``delivery_attempted``: ``attempt`` (:class:`Attempted`), after every attempt,
  and for a delivery held back without a request (outcome "held").
- ``delivery_settled``: ``settled`` (:class:`Settled`): delivered, refused or
  skipped; or superseded by a retraction, sent on commit of its send.
- ``delivery_failed``: ``failure`` (:class:`Failure`): refused or given up;
  given up by an operator (``controls.give_up``), sent once that is committed.
- ``batch_finished``: ``batch`` (the ``Batch``), when its last delivery leaves
  the queue, once that is committed: after its deliveries' signals.
- ``webhook_destination_disabled``: ``disabled`` (:class:`DestinationDisabled`),
  once, when the deliverer disables a webhook destination (a ``410 Gone``, or
  no success for ``WEBHOOK_DISABLE_AFTER``): its events wait until it is
  enabled again.
- ``host_failing``: ``failing`` (:class:`HostFailing`), once, when an inbox's
  host has had no answer but 5xx and 429 (or none) for ``HOST_FAILING_AFTER``;
  ``host_recovered``: ``recovered`` (:class:`HostRecovered`), once, when such
  a host answers again, or is seen again (``mark_host_seen``, a probe). Sent
  on commit of the write that records the change.

An ``outcome`` is an :class:`Outcome`, a ``StrEnum``: it compares equal to
its string ("delivered", "retrying", "held", "refused", "failed", "skipped",
"superseded").

They are sent for webhook deliveries too: then ``destination`` and
``event_type`` say which destination (by name) and which event, ``inbox`` is
the destination's name too (never the URL, which is the credential),
``sender`` is blank, and ``error`` has been through the destination's redaction. A
delivery given up because its destination is no longer configured sends
``delivery_failed`` alone, with no attempt.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import functools
import logging
import threading
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from asgiref.sync import async_to_sync
from django.db import transaction
from django.dispatch import Signal

# Receivers compare an ``outcome`` with it, by this name.
from django_federation_delivery.decide import Outcome as Outcome
from django_federation_delivery.exceptions import raised_at

delivery_attempted = Signal()
delivery_settled = Signal()
delivery_failed = Signal()
batch_finished = Signal()
webhook_destination_disabled = Signal()
host_failing = Signal()
host_recovered = Signal()


@dataclasses.dataclass(frozen=True)
class DestinationDisabled:
    """A webhook destination the deliverer disabled: named, never its URL."""

    destination: str
    #: Why, in words an operator reads ("the receiver answered 410 Gone").
    reason: str
    disabled_at: dt.datetime


@dataclasses.dataclass(frozen=True)
class HostFailing:
    """An inbox's host failing for ``HOST_FAILING_AFTER``."""

    host: str
    failing_since: dt.datetime
    #: What the last attempt met, redacted as ``delivery_failed``'s error is.
    error: str


@dataclasses.dataclass(frozen=True)
class HostRecovered:
    """A host that was told failing, answering again."""

    host: str
    failing_since: dt.datetime
    recovered_at: dt.datetime


@dataclasses.dataclass(frozen=True)
class Attempted:
    """One attempt, whatever came of it."""

    delivery_id: int
    batch_id: int
    inbox: str
    sender: str
    #: "delivered", "retrying", "refused" or "failed"; "held" when no request
    #: was made (an open circuit breaker, or a lease that ran out before a
    #: worker was free) and it will be tried again.
    outcome: str
    status: int | None
    error: str
    duration: float
    #: A webhook delivery's destination (its name: never the URL) and event
    #: type; "" for an activity, whose ``inbox`` is then a URL.
    destination: str = ""
    event_type: str = ""


@dataclasses.dataclass(frozen=True)
class Settled:
    """A delivery that is done with: ``outcome`` is "delivered", "refused",
    "skipped" or "superseded"."""

    delivery_id: int
    batch_id: int
    inbox: str
    sender: str
    tag: str
    outcome: str
    #: The status the inbox last answered with; 410 says it is gone for good.
    status: int | None
    #: A webhook delivery's destination (its name: never the URL) and event
    #: type; "" for an activity, whose ``inbox`` is then a URL.
    destination: str = ""
    event_type: str = ""


@dataclasses.dataclass(frozen=True)
class Failure:
    """A delivery that will not be tried again without having been delivered."""

    delivery_id: int
    batch_id: int
    inbox: str
    sender: str
    tag: str
    #: The status the inbox last answered with, if it answered.
    status: int | None
    error: str
    #: Whether the batch's deadline ended it, rather than the retry policy
    #: or an answer that will not change.
    deadline: bool
    #: Whether an answer that will not change ended it ("refused").
    refused: bool
    #: A webhook delivery's destination (its name: never the URL) and event
    #: type; "" for an activity, whose ``inbox`` is then a URL.
    destination: str = ""
    event_type: str = ""


def listened(signal: Signal) -> bool:
    """Whether a receiver is connected to ``signal``: a payload nobody
    receives is not made (two for each delivery the loop settles)."""
    if not signal.receivers:  # the usual case, without Django's look at each receiver
        return False
    from django_federation_delivery.models import Delivery

    return signal.has_listeners(Delivery)


def send_safely(signal: Signal, **kwargs: Any) -> None:
    """Send ``signal`` to every receiver, one by one. One that raises does
    not stop the others or the loop: it is logged, with its traceback, on
    the ``django.dispatch`` logger, and the next is called.

    Not Django's ``send_robust``, which called no receiver after one that
    raised what is no ``Exception`` (a ``SystemExit``: a receiver calling
    ``sys.exit()``) and let it through, stopping the loop with the delivery
    sent and left pending; nor after one with no ``__qualname__`` (a
    ``functools.partial``, an object with ``__call__``), the
    ``AttributeError`` of its log line let through. A ``KeyboardInterrupt``
    in the main thread is let through: it is the operator's Ctrl-C, raised
    wherever that thread was; in any other (a deliverer run in a thread of
    its own, an async receiver's event loop), Python raises none, and one
    is the receiver's own error."""
    from django_federation_delivery.models import Delivery

    if not signal.receivers:  # the usual case
        return
    synchronous, asynchronous = _live_receivers(signal, Delivery)
    for receiver in synchronous:
        try:
            receiver(signal=signal, sender=Delivery, **kwargs)
        except BaseException as error:
            if _operators(error):
                raise
            _failed(signal, _name_of(receiver), error)
    if asynchronous:
        try:
            async_to_sync(_send_async)(signal, asynchronous, Delivery, kwargs)
        except asyncio.CancelledError:
            # The caller's, its receivers awaited to their end all the same
            # (_send_async): no receiver's error. The caller's task is
            # cancelled as it was asked to be.
            pass
        except BaseException as error:  # called from an event loop's own thread, say
            if _operators(error):
                raise
            _failed(signal, " and ".join(map(_name_of, asynchronous)), error)


def _operators(error: BaseException) -> bool:
    """Whether ``error`` is an operator's Ctrl-C: a ``KeyboardInterrupt`` in
    the main thread, the only one Python raises it in."""
    return isinstance(error, KeyboardInterrupt) and (
        threading.current_thread() is threading.main_thread()
    )


def _live_receivers(
    signal: Signal, sender: type[Any]
) -> tuple[list[Callable[..., Any]], list[Callable[..., Any]]]:
    """The receivers of ``signal`` for ``sender``, those to call and those to
    await, in the order they were connected. Django has no public way to
    ask; its own ``_live_receivers`` returns a list on Django 4.2 (which
    has no async receivers), and from 5.0 a pair of lists."""
    live = signal._live_receivers(sender)
    if isinstance(live, tuple):
        synchronous, asynchronous = live
        return list(synchronous), list(asynchronous)
    return list(live), []


async def _send_async(
    signal: Signal,
    receivers: Sequence[Callable[..., Any]],
    sender: type[Any],
    kwargs: dict[str, Any],
) -> None:
    """Await each async receiver, all at once as Django does; one that
    raises is logged, the others awaited all the same. A cancellation of
    the caller's (an async view awaiting ``asend``, its client gone once
    the send committed) reaches no receiver: each is awaited to its end,
    then the cancellation is raised."""

    async def called(receiver: Callable[..., Any]) -> None:
        # In the event loop's thread, never the main one: no Ctrl-C reaches it.
        try:
            await receiver(signal=signal, sender=sender, **kwargs)
        except BaseException as error:
            _failed(signal, _name_of(receiver), error)

    told = asyncio.gather(*(called(receiver) for receiver in receivers))
    try:
        await asyncio.shield(told)
    except asyncio.CancelledError:
        await told
        raise


def _failed(signal: Signal, receiver: str, error: BaseException) -> None:
    """Log that ``receiver`` (named) of ``signal`` raised ``error``: its type,
    where it was raised and the calls that led there, not its message, which
    may quote what the receiver was given (an inbox's query, its token)."""
    _dispatch_logger.error(
        "Error calling %s, a receiver of %s: %s raised%s\nTraceback (most recent call last):\n%s",
        receiver,
        # The name it has here: a Signal knows none.
        next((name for name, value in globals().items() if value is signal), "a signal"),
        type(error).__name__,
        raised_at(error),
        "".join(traceback.format_tb(error.__traceback__)).rstrip(),
    )


def _name_of(receiver: object) -> str:
    """What a log line names ``receiver`` by: its qualified name, and for an
    object that has none (a ``functools.partial``, an instance with
    ``__call__``) a repr that cannot raise and shows none of its state,
    where its arguments may be a token."""
    if isinstance(receiver, functools.partial):
        return f"functools.partial({_name_of(receiver.func)})"
    try:
        name = getattr(receiver, "__qualname__", None)
        module = getattr(receiver, "__module__", None)
    except Exception:  # a property of its own that raises
        name = module = None
    if isinstance(name, str) and name:
        return f"{module}.{name}" if isinstance(module, str) and module else name
    return object.__repr__(receiver)


#: Where Django's ``send_robust`` logs a receiver that raised: where an
#: operator already looks for one.
_dispatch_logger = logging.getLogger("django.dispatch")


def send_batches_finished(ids: Sequence[int], *, using: str | None = None) -> None:
    """``batch_finished`` for each batch of ``ids``, in id order.

    The batches are read (whole, with their bodies) only when a receiver is
    connected: a stream of one-inbox sends finishes a batch with every
    delivery, and nobody listening is the usual case.
    """
    _batches_told(ids, using)()


def batches_finished_on_commit(ids: Sequence[int], *, using: str | None = None) -> None:
    """Inside the transaction that finishes the batches of ``ids``: read them
    now, and tell ``batch_finished`` of each once it commits. A read that
    fails fails the transaction, before anything is written; after the
    commit, a database away can no longer lose the signal."""
    tell = _batches_told(ids, using)
    transaction.on_commit(tell, using=using)


def _batches_told(ids: Sequence[int], using: str | None) -> Callable[[], None]:
    """The batches of ``ids`` read now, and what tells each of them."""
    from django_federation_delivery.store.countdowns import finished_batches

    if not ids or not listened(batch_finished):
        return lambda: None
    batches = finished_batches(ids, using=using)

    def tell() -> None:
        for batch in batches:
            send_safely(batch_finished, batch=batch)

    return tell
