"""Discord webhooks: ``discord://discord.com/api/webhooks/<id>/<token>``."""

from __future__ import annotations

from django_federation_delivery.channels.base import Destination, Request
from django_federation_delivery.channels.events import Event
from django_federation_delivery.channels.hooks import HookChannel
from django_federation_delivery.channels.text import cut, escape_markdown, render_text

__all__ = ["DISCORD_LIMIT", "Discord"]

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

    def request(self, destination: Destination, event: Event, *, now: float) -> Request:
        document = {
            "content": cut(escape_markdown(render_text(destination, event)), DISCORD_LIMIT),
            "allowed_mentions": {"parse": []},
        }
        return self.json_request(destination, document)
