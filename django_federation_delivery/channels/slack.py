"""Slack incoming webhooks: ``slack://hooks.slack.com/services/T…/B…/…``."""

from __future__ import annotations

import re

from django_federation_delivery.channels.base import Destination, Request
from django_federation_delivery.channels.events import Event
from django_federation_delivery.channels.hooks import HookChannel
from django_federation_delivery.channels.text import (
    WORD_JOINER,
    break_links,
    escape_entities,
    render_text,
)

__all__ = ["Slack"]

#: Where a line's ">", escaped as mrkdwn asks, would start a quote: before it
#: (and its indentation), a word joiner makes it a character.
_QUOTE = re.compile(r"^(?=[ \t]*&gt;)", re.MULTILINE)


class Slack(HookChannel):
    """``{"text": …}`` in mrkdwn, with ``& < >`` escaped so that nothing in an
    event's data makes a link or a mention (``<!channel>``), a word joiner in
    each ``://`` and ``www.`` so that no URL of it is made a link, and no
    line of it a quote."""

    name = "slack"
    label = "Slack"
    schemes = ("slack", "slack+http")
    public_segments = frozenset({"services"})

    def request(self, destination: Destination, event: Event, *, now: float) -> Request:
        # Slack makes a link of a URL by itself (a message's text is not verbatim).
        text = break_links(escape_entities(render_text(destination, event)))
        return self.json_request(destination, {"text": _QUOTE.sub(WORD_JOINER, text)})
