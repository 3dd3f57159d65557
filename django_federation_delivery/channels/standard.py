"""Signed JSON, as the Standard Webhooks specification writes it:
``https://receiver.example/hooks?secret=whsec_…`` (``http://`` too)."""

from __future__ import annotations

import base64
import binascii

from django.utils.translation import gettext as _

# Django's own gettext_noop reads USE_I18N: this module is imported while a
# settings file is read (webhooks_from_env), where a setting read would load
# the half-read file again. This one reads nothing.
from django.utils.translation.trans_null import gettext_noop

from django_federation_delivery.channels.base import (
    Channel,
    Destination,
    Parsed,
    Request,
    UnusableURL,
)
from django_federation_delivery.channels.events import Event
from django_federation_delivery.signatures import signature_headers

__all__ = ["StandardWebhooks"]

_SECRET_PREFIX = "whsec_"
# The Standard Webhooks specification asks for keys of 24 to 64 bytes.
_MIN_SECRET_BYTES = 24
_MAX_SECRET_BYTES = 64


class StandardWebhooks(Channel):
    """The event as JSON, ``{"type", "id", "timestamp", "data"}``, with
    ``webhook-id``, ``webhook-timestamp`` and ``webhook-signature``, and its
    type in ``X-Webhook-Event``.

    The ``secret`` parameters are the signing keys, taken out of the URL sent
    (several while rotating: each signs); they, the rest of the query and the
    path (whole and each segment) are secret. Each attempt is signed at its
    own time, while the id and the body stay the event's: a receiver's
    library refuses a timestamp five minutes from its clock, and
    de-duplicates by the id.
    """

    name = "json"
    label = gettext_noop("Signed JSON")
    schemes = ("https", "http")

    def parse(self, url: str, scheme: str) -> Parsed:
        base, _mark, query = url.partition("?")
        kept, keys, raw = [], [], []
        for pair in query.split("&") if query else []:
            if not pair:
                # "?secret=…&", "?&secret=…": nothing between two separators.
                continue
            key, value = self.query_pairs(pair)[0]
            if key != "secret":
                # Any of it may be the receiver's own token, "?t0ken" as "?key=t0ken".
                kept.append(pair)
                raw += [pair, key, value, pair.partition("=")[2]]
                continue
            written = pair.partition("=")[2]
            raw += [written, value, value.removeprefix(_SECRET_PREFIX)]
            keys.append(_signing_key(value))
        if not keys:
            raise UnusableURL(
                _(
                    "a signed JSON URL needs a secret: add ?secret=whsec_… (the key, base64, "
                    "as the Standard Webhooks specification writes it)"
                )
            )
        target = base + ("?" + "&".join(kept) if kept else "")
        path = self.split(target).path
        # A receiver's path may hold its own token, as a hook's does.
        segments = [segment for segment in path.split("/") if segment]
        return Parsed(
            url=target, secrets=(path, *segments, query, *raw), options={"keys": tuple(keys)}
        )

    def request(self, destination: Destination, event: Event, *, now: float) -> Request:
        body = event.as_json()
        headers = {"Content-Type": "application/json", "X-Webhook-Event": event.type}
        headers |= signature_headers(event.id, int(now), body, destination.options["keys"])
        return Request("POST", destination.url, headers, body, destination.display)


def _signing_key(secret: str) -> bytes:
    if not secret.startswith(_SECRET_PREFIX):
        raise UnusableURL(_("a secret must start with 'whsec_', followed by the key in base64"))
    encoded = secret[len(_SECRET_PREFIX) :]
    try:
        key = base64.b64decode(encoded + "=" * (-len(encoded) % 4), validate=True)
    except (binascii.Error, ValueError):
        raise UnusableURL(_("a secret after 'whsec_' is not valid base64")) from None
    if len(key) > _MAX_SECRET_BYTES:
        raise UnusableURL(
            _("a secret's key is %(length)d bytes; at most %(most)d are taken")
            % {"length": len(key), "most": _MAX_SECRET_BYTES}
        )
    if len(key) < _MIN_SECRET_BYTES:
        raise UnusableURL(
            _(
                "a secret's key is %(length)d bytes; use %(least)d to 64 random bytes, "
                "e.g. 'whsec_' + base64 of secrets.token_bytes(32)"
            )
            % {"length": len(key), "least": _MIN_SECRET_BYTES}
        )
    return key
