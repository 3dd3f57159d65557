"""Discord webhooks: ``discord://discord.com/api/webhooks/<id>/<token>``."""

from __future__ import annotations

import dataclasses
from urllib.parse import urlsplit, urlunsplit

from django_federation_delivery.channels.base import Destination, Parsed, Request
from django_federation_delivery.channels.events import Event
from django_federation_delivery.channels.hooks import HookChannel
from django_federation_delivery.channels.text import cut_markdown, escape_markdown, render_text

__all__ = ["DISCORD_LIMIT", "Discord", "versioned"]

#: The longest ``content`` Discord takes.
DISCORD_LIMIT = 2000


class Discord(HookChannel):
    """``{"content": …}`` cut to 2,000 characters, its Markdown escaped as for
    a Markdown hook, with every mention turned off besides: no @everyone,
    role or user ping from what an event's data says."""

    name = "discord"
    label = "Discord"
    schemes = ("discord", "discord+http")
    public_segments = frozenset({"api", "webhooks"})
    # A 429 says its wait in its body, in seconds with decimals (a
    # Retry-After with decimals, or none, is not read as one).
    wait_in_body = (("retry_after",), 1.0)

    def request(self, destination: Destination, event: Event, *, now: float) -> Request:
        document = {
            "content": cut_markdown(
                escape_markdown(render_text(destination, event)), DISCORD_LIMIT
            ),
            "allowed_mentions": {"parse": []},
        }
        return self.json_request(destination, document)

    def parse(self, url: str, scheme: str) -> Parsed:
        parsed = super().parse(url, scheme)
        target = versioned(parsed.url)
        if target == parsed.url:
            return parsed
        # Sent there: its path is a credential, whole, as the given one is.
        secrets = (urlsplit(target).path, *parsed.secrets)
        return dataclasses.replace(parsed, url=target, secrets=secrets)


#: Where an unversioned webhook URL's path begins (Discord's "Copy Webhook
#: URL" gives one), and a version that counts a 429's wait in seconds.
UNVERSIONED = "/api/webhooks/"
VERSIONED = "/api/v10/webhooks/"


def versioned(url: str) -> str:
    """``url`` on a versioned path. Unversioned, Discord answers as its API v6,
    whose 429 says ``Retry-After`` in milliseconds: 6457 (6.5 s) was read as
    6,457 s, an hour once capped, every later event to the channel waiting."""
    parts = urlsplit(url)
    if not parts.path.startswith(UNVERSIONED):
        return url
    return urlunsplit(parts._replace(path=VERSIONED + parts.path.removeprefix(UNVERSIONED)))
