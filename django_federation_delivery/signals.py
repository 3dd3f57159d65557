"""Signals the host project receives, with what each carries.

What the loop tells of an attempt (``delivery_attempted``,
``delivery_settled``, ``delivery_failed``) is sent before the row it is about
leaves the queue, so a process that stops in between sends it again:
receivers must be safe to repeat. The rest (``batch_finished``, an
operator's give-up, a retraction's supersedings, and the host and destination
signals) are sent once the write that records them has committed, never
inside the package's own transaction, where a receiver's database error
(even one it catches) would undo the write. A receiver that raises (anything
but ``KeyboardInterrupt``) is logged with its traceback and the loop goes on.

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

import dataclasses
import datetime as dt
import logging
import os
from collections.abc import Sequence
from typing import Any

from django.dispatch import Signal

# Receivers compare an ``outcome`` with it, by this name.
from django_federation_delivery.decide import Outcome as Outcome

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
    """Send ``signal`` to every receiver. One that raises an exception does
    not stop the others or the loop: Django logs it, with its traceback, on
    the ``django.dispatch`` logger.

    One that raises what is no ``Exception`` (a ``SystemExit``: a receiver
    calling ``sys.exit()``) goes past ``send_robust``, which then calls no
    receiver after it; it is logged here, and the loop goes on, where it
    stopped the loop with the delivery sent and left pending, to be sent
    again after its lease. A ``KeyboardInterrupt`` is let through: in the
    loop's thread it is the operator's Ctrl-C, raised wherever that thread
    was."""
    from django_federation_delivery.models import Delivery

    try:
        signal.send_robust(sender=Delivery, **kwargs)
    except KeyboardInterrupt:
        raise
    except BaseException as error:
        _dispatch_logger.error(
            "%s raised %r, which is no exception: the receivers after it were not called",
            _receiver_of(error),
            error,
            exc_info=error,
        )


def _receiver_of(error: BaseException) -> str:
    """The name of the receiver ``error`` came from: the function Django's
    dispatcher called, as the traceback has it."""
    traceback = error.__traceback__
    while traceback is not None:
        code = traceback.tb_frame.f_code
        if code.co_filename.endswith(_DISPATCHER) and traceback.tb_next is not None:
            return traceback.tb_next.tb_frame.f_code.co_qualname
        traceback = traceback.tb_next
    return "A receiver"


_DISPATCHER = os.path.join("django", "dispatch", "dispatcher.py")


#: Where Django's ``send_robust`` logs a receiver that raised: where an
#: operator already looks for one.
_dispatch_logger = logging.getLogger("django.dispatch")


def send_batches_finished(ids: Sequence[int], *, using: str | None = None) -> None:
    """``batch_finished`` for each batch of ``ids``, in id order.

    The batches are read (whole, with their bodies) only when a receiver is
    connected: a stream of one-inbox sends finishes a batch with every
    delivery, and nobody listening is the usual case.
    """
    from django_federation_delivery.store.countdowns import finished_batches

    if not ids or not listened(batch_finished):
        return
    for batch in finished_batches(ids, using=using):
        send_safely(batch_finished, batch=batch)
