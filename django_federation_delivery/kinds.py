"""What the loop asks of a kind of delivery, and which kind a delivery is.

The loop sends an inbox delivery and a webhook delivery alike: it asks the
delivery's kind whether a claimed delivery is to go (``skipped``, ``unusable``),
for its job (in the loop's thread, which owns the database), for the attempt
at it (in a worker thread, which owns the sockets), and for the settler that
judges what came of it. There are two: inboxes (``inboxes.py``) and webhooks
(``webhooks/deliveries.py``), whose destinations are each of a
:class:`~django_federation_delivery.channels.Channel`'s kind.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, Protocol

from django_federation_delivery.addresses import quoted
from django_federation_delivery.attempt import AttemptResult
from django_federation_delivery.batches import BatchInfo
from django_federation_delivery.models import Kind
from django_federation_delivery.settling import Settler
from django_federation_delivery.store import claims
from django_federation_delivery.transport import Transport, TransportSettings

__all__ = ["DeliveryKind", "Kinds", "unknown_kind"]


class DeliveryKind(Protocol):
    """A kind of delivery, as the loop sees it."""

    @property
    def timeout(self) -> float:
        """The longest one attempt may take."""
        ...

    def skipped(self, row: claims.Claimed, batch: BatchInfo) -> bool:
        """Whether ``row`` is dropped unsent as it comes due."""
        ...

    def unusable(self, claimed: Iterable[claims.Claimed]) -> set[str]:
        """The hosts among ``claimed`` that can never be sent to (a webhook
        destination no longer configured): given up with :meth:`give_up`."""
        ...

    def give_up(self, hosts: Iterable[str]) -> int:
        """Fail every pending delivery to ``hosts`` for good; how many."""
        ...

    def give_up_unusable(self) -> int:
        """Fail every pending delivery that can never be sent, as a loop
        starts; how many."""
        ...

    def release_stuck(self) -> int:
        """Make due what nothing else ever would (a sweep of the upkeep's,
        every 30 s); how many."""
        ...

    def job(self, row: claims.Claimed, batch: BatchInfo) -> Any:
        """What a worker needs for an attempt at ``row``."""
        ...

    def settler(self, row: claims.Claimed) -> Settler:
        """What retries and judges ``row``, and sends its signals."""
        ...

    def transport_settings_for(self, job: Any) -> TransportSettings:
        """How the transport of an attempt at ``job`` behaves (its time
        limits, the networks it may reach): one transport a worker for each."""
        ...

    def attempt(self, job: Any, transport: Transport) -> AttemptResult:
        """One attempt at ``job``, in a worker thread."""
        ...

    def forget(self, batch_ids: Iterable[int]) -> None:
        """Let go of what was read of the batches ``batch_ids`` (a parsed
        body): none of their deliveries is in hand any more."""
        ...


class Kinds:
    """The kinds of one deliverer, by the ``kind`` a delivery is written with."""

    def __init__(self, inboxes: DeliveryKind, webhooks: DeliveryKind) -> None:
        self._by_kind: dict[str, DeliveryKind] = {Kind.ACTIVITYPUB: inboxes, Kind.WEBHOOK: webhooks}

    def of(self, row: claims.Claimed) -> DeliveryKind:
        """The kind that sends ``row``; a KeyError for a kind none is (see
        :meth:`get`)."""
        return self._by_kind[row.kind]

    def get(self, row: claims.Claimed) -> DeliveryKind | None:
        """The kind that sends ``row``, or None when it is none of them: a
        ``kind`` written by hand (the column has choices, not a constraint)."""
        return self._by_kind.get(row.kind)

    @property
    def fallback(self) -> DeliveryKind:
        """The kind whose settler fails a row of no kind (:meth:`get`): the
        inboxes'. It only sends that row's ``delivery_failed`` and counts it."""
        return self._by_kind[Kind.ACTIVITYPUB]

    def __iter__(self) -> Iterator[DeliveryKind]:
        return iter(self._by_kind.values())

    def forget(self, batch_ids: Iterable[int]) -> None:
        """:meth:`DeliveryKind.forget` of each kind."""
        ids = list(batch_ids)
        for kind in self:
            kind.forget(ids)

    @property
    def longest(self) -> float:
        """The longest any attempt may take."""
        return max(kind.timeout for kind in self)


def unknown_kind(kind: str) -> str:
    """Why a row of ``kind``, none that a deliverer knows, is failed unsent:
    the value quoted, escaped and cut, as an error repeats a stored value."""
    return f"its kind {quoted(kind)} is not one this deliverer sends"
