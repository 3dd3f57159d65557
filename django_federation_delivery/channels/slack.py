"""Slack incoming webhooks: ``slack://hooks.slack.com/services/T…/B…/…``."""

from __future__ import annotations

from django_federation_delivery.channels.base import Destination, Request
from django_federation_delivery.channels.events import Event
from django_federation_delivery.channels.hooks import HookChannel
from django_federation_delivery.channels.text import escape_entities, render_text

__all__ = ["Slack"]


class Slack(HookChannel):
    """``{"text": …}`` in mrkdwn, with ``& < >`` escaped so that nothing in an
    event's data makes a link or a mention (``<!channel>``)."""

    name = "slack"
    label = "Slack"
    schemes = ("slack", "slack+http")
    public_segments = frozenset({"services"})

    def request(self, destination: Destination, event: Event, *, now: float) -> Request:
        return self.json_request(
            destination, {"text": escape_entities(render_text(destination, event))}
        )
