"""Matrix rooms: ``matrix://<access token>@<homeserver>/<room id>``, the room
id as Matrix writes it (``!AbCdEf:example.org``, or ``!`` and a hash since
room version 12)."""

from __future__ import annotations

import hashlib
from urllib.parse import quote, unquote

from django.utils.translation import gettext as _

from django_federation_delivery.channels.base import (
    Channel,
    Destination,
    Parsed,
    Request,
    UnusableURL,
)
from django_federation_delivery.channels.events import Event, compact_json
from django_federation_delivery.channels.text import cut_bytes, cut_json, render_text

__all__ = ["MATRIX_CONTENT_LIMIT", "MATRIX_LIMIT", "Matrix"]

#: The longest text sent, in bytes of UTF-8.
MATRIX_LIMIT = 32_768
#: The most the content sent may take as JSON, in bytes: a homeserver refuses
#: for good (413, ``M_TOO_LARGE``) an event past 64 KiB, and the envelope it
#: writes around the content (sender, room, ids, signatures, hashes) is part
#: of it. JSON writes a text longer than it is: a ``"`` or ``\`` in two
#: bytes, a control character in six.
MATRIX_CONTENT_LIMIT = 60 * 1024
#: The content's JSON around its text. Its empty ``m.mentions`` says it
#: mentions nobody: without it, a homeserver applies the legacy push rules to
#: the body, and an "@room", or a member's name, in an event's data would
#: notify the room or that member (Matrix 1.7, MSC3952).
_MESSAGE: dict[str, object] = {"msgtype": "m.text", "body": "", "m.mentions": {}}


class Matrix(Channel):
    """``PUT /_matrix/client/v3/rooms/<room>/send/m.room.message/<transaction id>``
    with ``{"msgtype": "m.text", "body": …, "m.mentions": {}}`` (the text cut to 32 KiB, and to
    what keeps the content within 60 KiB of JSON), the access token as a bearer
    token. The transaction id is the event's id and a digest of the
    destination's name and room (:func:`transaction_id`), so a homeserver
    that got an attempt whose answer was lost takes the retry as the same
    message, and one event sent to two rooms by one bot is two messages. The
    token is secret; the room is not."""

    name = "matrix"
    label = "Matrix"
    schemes = ("matrix", "matrix+http")
    # A homeserver that limits the rate says how long to wait in its body,
    # and not always in Retry-After.
    wait_in_body = (("retry_after_ms",), 0.001)

    def parse(self, url: str, scheme: str) -> Parsed:
        parts = self.split(self.over(url, scheme))
        token = parts.userinfo
        if not token or ":" in token:
            raise UnusableURL(_("a Matrix URL is matrix://<access token>@<homeserver>/<room id>"))
        room = unquote(parts.path.strip("/"))
        # "!opaque:server", or since room version 12 (Matrix 1.16, MSC4291)
        # "!" and the hash of the room's create event, with no server.
        if not room.startswith("!") or len(room) < 2 or "/" in room:
            raise UnusableURL(
                _("a Matrix room is its id, such as !AbCdEf:example.org, not an alias")
            )
        if parts.query:
            raise UnusableURL(_("a Matrix URL takes no parameters"))
        return Parsed(
            url=parts.origin,
            secrets=(token,),
            options={"token": token, "room": room},
        )

    def request(self, destination: Destination, event: Event, *, now: float) -> Request:
        room = quote(destination.options["room"], safe="")
        txn = quote(transaction_id(destination, event), safe="")
        url = f"{destination.url}/_matrix/client/v3/rooms/{room}/send/m.room.message/{txn}"
        text = cut_bytes(render_text(destination, event), MATRIX_LIMIT)
        # Measured as it is sent: a text within MATRIX_LIMIT may be six times
        # as long in JSON.
        text = cut_json(text, MATRIX_CONTENT_LIMIT - len(compact_json(_MESSAGE)))
        return self.json_request(
            destination,
            {**_MESSAGE, "body": text},
            method="PUT",
            url=url,
            headers={"Authorization": f"Bearer {destination.options['token']}"},
        )


def transaction_id(destination: Destination, event: Event) -> str:
    """The transaction id of ``event``'s message to ``destination``: its id,
    and a digest of the destination's name and room. A homeserver keeps a
    transaction id per access token and device, not per room (Conduit and
    its forks), so the event's id alone sent to two rooms by one bot posted
    in one of them only, and told both delivered."""
    where = f"{destination.name}\n{destination.options['room']}"
    return f"{event.id}.{hashlib.sha256(where.encode()).hexdigest()[:16]}"
