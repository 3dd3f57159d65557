"""From an event to the exact HTTP request a destination receives.

Chat kinds get text from a template per event type,
``django_federation_delivery/webhooks/<event type>.txt``, falling back to
``django_federation_delivery/webhooks/default.txt``; a project overrides
either in its own templates. A template writes plain text: each kind then
escapes what its markup would read as markup (Slack's and Telegram's
``& < >``), so an event's data can neither break the message nor mention
anyone, and cuts it to what the service accepts.
"""

from __future__ import annotations

import datetime
import json
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from django.template import Context
from django.template.backends.django import Template as DjangoTemplate
from django.template.loader import select_template

from django_federation_delivery.exceptions import InvalidDelivery
from django_federation_delivery.webhooks.destinations import Destination, Kind
from django_federation_delivery.webhooks.signing import signature_headers

__all__ = ["DISCORD_LIMIT", "TELEGRAM_LIMIT", "Event", "WebhookRequest", "build_request"]

TEMPLATES = "django_federation_delivery/webhooks"

#: The longest message each service takes (Discord's ``content``, Telegram's
#: ``text`` once its entities are parsed); counted in UTF-16 code units, which
#: is never fewer than what they count. Slack cuts long messages itself, and
#: Mattermost splits them.
DISCORD_LIMIT = 2000
TELEGRAM_LIMIT = 4096
ELLIPSIS = "…"

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
            raise InvalidDelivery(f"An event type must be a non-empty string, not {event_type!r}.")
        if len(event_type) > _EVENT_TYPE_LENGTH or not _EVENT_TYPE.fullmatch(event_type):
            raise InvalidDelivery(
                f"The event type {event_type!r} is not a simple name: letters, digits and "
                f"'_', parts joined by '.' or '-' (e.g. 'alert.raised'), at most "
                f"{_EVENT_TYPE_LENGTH} characters."
            )
        if isinstance(event_id, uuid.UUID):
            event_id = str(event_id)
        if not isinstance(event_id, str) or not _EVENT_ID.fullmatch(event_id):
            raise InvalidDelivery(
                f"An event id must be 1 to 200 printable ASCII characters without spaces, "
                f"not {event_id!r}."
            )
        if not isinstance(timestamp, datetime.datetime) or timestamp.utcoffset() is None:
            raise InvalidDelivery(
                f"An event's timestamp must be an aware datetime, not {timestamp!r}."
            )
        try:
            _json(data)
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
        return _json(document)


@dataclass(frozen=True)
class WebhookRequest:
    """The POST to make: ``url`` is the destination's credential, never shown."""

    url: str = field(repr=False)
    headers: dict[str, str]
    body: bytes = field(repr=False)
    #: The destination's name and kind, safe to show.
    display: str


def build_request(
    destination: Destination, event: Event, *, now: float | None = None
) -> WebhookRequest:
    """The request that delivers ``event`` to ``destination``, made for an
    attempt at ``now`` (the current time by default).

    Signed JSON is signed at ``now``, not at the event's time: a receiver's
    Standard Webhooks library refuses a ``webhook-timestamp`` more than five
    minutes from its clock, and a retry may come a day after the event. The
    id and the body stay the event's, byte for byte, so that a receiver
    de-duplicates the attempts."""
    headers = {"Content-Type": "application/json"}
    if destination.kind is Kind.SIGNED_JSON:
        body = event.as_json()
        headers["X-Webhook-Event"] = event.type
        signed_at = int(time.time() if now is None else now)
        headers |= signature_headers(event.id, signed_at, body, destination.secrets)
        return WebhookRequest(destination.url, headers, body, destination.display)
    text = render_text(destination, event)
    document: dict[str, Any]
    if destination.kind is Kind.SLACK:
        document = {"text": _escape(text)}
    elif destination.kind is Kind.MARKDOWN:
        document = {"text": text}
    elif destination.kind is Kind.DISCORD:
        # No @everyone, role or user pings from what an event's data says.
        document = {"content": _cut(text, DISCORD_LIMIT), "allowed_mentions": {"parse": []}}
    else:
        document = {
            "chat_id": destination.chat_id,
            # Cut before escaping: Telegram counts the text its entities stand for.
            "text": _escape(_cut(text, TELEGRAM_LIMIT)),
            "parse_mode": "HTML",
        }
    return WebhookRequest(destination.url, headers, _json(document), destination.display)


def render_text(destination: Destination, event: Event) -> str:
    """The event's template rendered as plain text (no HTML escaping), stripped."""
    template = select_template(
        [f"{TEMPLATES}/{event.type}.txt", f"{TEMPLATES}/default.txt"],
    )
    context = {
        "event_type": event.type,
        "event_id": event.id,
        "timestamp": event.timestamp,
        "data": event.data,
        "fields": _fields(event.data),
        "data_json": "" if isinstance(event.data, dict) else _json(event.data).decode(),
        "destination": {"name": destination.name, "kind": destination.kind.value},
    }
    if isinstance(template, DjangoTemplate):
        # Plain text: Django's autoescaping would write "&amp;" into a chat message.
        text = template.template.render(Context(context, autoescape=False))
    else:
        text = template.render(context)
    return str(text).strip() or event.type


def _fields(data: Any) -> list[tuple[str, str]]:
    """A JSON object's members as (name, text): strings as they are, the rest as JSON."""
    if not isinstance(data, dict):
        return []
    return [
        (str(name), value if isinstance(value, str) else _json(value).decode())
        for name, value in data.items()
    ]


def _escape(text: str) -> str:
    """``& < >`` as entities: what Slack's mrkdwn and Telegram's HTML both ask for."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def _cut(text: str, limit: int) -> str:
    """``text`` in at most ``limit`` UTF-16 code units, cut between characters and
    ended with an ellipsis when too long."""
    if _utf16_length(text) <= limit:
        return text
    room = limit - _utf16_length(ELLIPSIS)
    kept = []
    for character in text:
        room -= _utf16_length(character)
        if room < 0:
            break
        kept.append(character)
    return "".join(kept).rstrip() + ELLIPSIS


def _utf16_length(text: str) -> int:
    return len(text.encode("utf-16-le", "surrogatepass")) // 2


def _json(value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()
