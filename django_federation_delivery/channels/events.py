"""An event: what ``send_webhook`` queues and every kind renders.

Stored as its JSON (:meth:`Event.as_json`) once, in its batch, and read back
(:meth:`Event.read`) byte for byte at each attempt, so that every retry sends
the same body and a receiver de-duplicates by the id.
"""

from __future__ import annotations

import datetime
import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from django_federation_delivery.addresses import quoted
from django_federation_delivery.exceptions import InvalidDelivery

__all__ = ["Event", "compact_json"]

# An event type names a template, so it is a plain dotted name: "alert.raised".
_EVENT_TYPE = re.compile(r"[A-Za-z0-9_]+(?:[.-][A-Za-z0-9_]+)*")
_EVENT_TYPE_LENGTH = 100
# The id travels in a header and in the signed content.
_EVENT_ID = re.compile(r"[\x21-\x7e]{1,200}")


@dataclass(frozen=True)
class Event:
    """One event for a destination. Built with :meth:`of`, which checks it."""

    type: str
    id: str
    timestamp: datetime.datetime
    data: Any

    @classmethod
    def of(
        cls, event_type: str, event_id: str | uuid.UUID, timestamp: datetime.datetime, data: Any
    ) -> Event:
        """The event, or ``InvalidDelivery`` naming what is wrong with it."""
        if not isinstance(event_type, str) or not event_type:
            raise InvalidDelivery(
                f"An event type must be a non-empty string, not {quoted(event_type)}."
            )
        if len(event_type) > _EVENT_TYPE_LENGTH or not _EVENT_TYPE.fullmatch(event_type):
            raise InvalidDelivery(
                f"The event type {quoted(event_type)} is not a simple name: letters, digits and "
                f"'_', parts joined by '.' or '-' (e.g. 'alert.raised'), at most "
                f"{_EVENT_TYPE_LENGTH} characters."
            )
        if isinstance(event_id, uuid.UUID):
            event_id = str(event_id)
        if not isinstance(event_id, str) or not _EVENT_ID.fullmatch(event_id):
            raise InvalidDelivery(
                f"An event id must be 1 to 200 printable ASCII characters without spaces, "
                f"not {quoted(event_id)}."
            )
        if not isinstance(timestamp, datetime.datetime) or timestamp.utcoffset() is None:
            raise InvalidDelivery(
                f"An event's timestamp must be an aware datetime, not {quoted(timestamp)}."
            )
        try:
            compact_json(data)
        # ValueError: NaN or infinity, a circular reference, a lone surrogate.
        except (TypeError, ValueError, RecursionError) as exc:
            raise InvalidDelivery(
                f"The data of event {event_type!r} cannot be written as JSON: {exc}"
            ) from None
        return cls(event_type, event_id, timestamp.astimezone(datetime.UTC), data)

    @classmethod
    def read(cls, body: str | bytes) -> Event:
        """The event :meth:`as_json` wrote, exactly: sent again, and signed
        again, it gives the same bytes. ``InvalidDelivery`` if it is not one."""
        try:
            document = json.loads(body)
            timestamp = datetime.datetime.fromisoformat(document["timestamp"])
            return cls.of(document["type"], document["id"], timestamp, document["data"])
        except (ValueError, TypeError, KeyError) as exc:
            if isinstance(exc, InvalidDelivery):
                raise
            raise InvalidDelivery(f"not a stored event: {type(exc).__name__}") from None

    def as_json(self) -> bytes:
        """The body of a signed JSON delivery, in the shape Standard Webhooks suggests."""
        document = {
            "type": self.type,
            "id": self.id,
            "timestamp": self.timestamp.isoformat().replace("+00:00", "Z"),
            "data": self.data,
        }
        return compact_json(document)


def compact_json(value: Any) -> bytes:
    """``value`` as compact JSON in UTF-8, refusing NaN and infinity."""
    return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()
