"""ntfy topics: ``ntfy://[<access token>@]ntfy.sh/<topic>[?tags=…&priority=…]``."""

from __future__ import annotations

import re

from django.utils.translation import gettext as _

from django_federation_delivery.channels.base import (
    Channel,
    Destination,
    Parsed,
    Request,
    UnusableURL,
    word_shown,
)
from django_federation_delivery.channels.events import Event
from django_federation_delivery.channels.text import cut_bytes, render_text

__all__ = ["NTFY_LIMIT", "Ntfy"]

#: The longest message ntfy shows as a message: past it, it makes an attachment.
NTFY_LIMIT = 4096

_TOPIC = re.compile(r"[-_A-Za-z0-9]{1,64}")
_TOKEN = re.compile(r"[-_.A-Za-z0-9]+")
_TAGS = re.compile(r"[-_A-Za-z0-9]+(?:,[-_A-Za-z0-9]+)*")
_PRIORITIES = frozenset({"1", "2", "3", "4", "5", "min", "low", "default", "high", "urgent", "max"})


class Ntfy(Channel):
    """POST the template's text, as plain text cut to 4,096 bytes, to
    ``https://<server>/<topic>``, titled with the event's type and tagged as
    the URL says (``?tags=warning,db`` shows emoji for known tags;
    ``?priority=high``). The access token, sent as a bearer token, is secret,
    and so is the topic: on a public server, its name is all that guards it."""

    name = "ntfy"
    label = "ntfy"
    schemes = ("ntfy", "ntfy+http")

    def parse(self, url: str, scheme: str) -> Parsed:
        parts = self.split(self.over(url, scheme))
        userinfo = parts.userinfo
        if userinfo and not _TOKEN.fullmatch(userinfo):
            raise UnusableURL(
                _("an ntfy URL takes an access token (tk_…) before the @, not a user and password")
            )
        topic = parts.path.strip("/")
        if not _TOPIC.fullmatch(topic):
            raise UnusableURL(
                _("an ntfy URL names one topic after the host: letters, digits, '-' or '_'")
            )
        options: dict[str, str] = {"token": userinfo}
        for key, value in self.query_pairs(parts.query):
            if key == "tags" and _TAGS.fullmatch(value):
                options["tags"] = value
            elif key == "priority" and value in _PRIORITIES:
                options["priority"] = value
            else:
                raise UnusableURL(
                    _(
                        "an ntfy URL takes tags=<tag>,<tag> and priority=1…5 (or min, low, "
                        "default, high, max), not %(key)s"
                    )
                    % {"key": word_shown(key)}
                )
        return Parsed(
            url=f"{parts.origin}/{topic}",
            secrets=tuple(part for part in (userinfo, topic) if part),
            options=options,
        )

    def request(self, destination: Destination, event: Event, *, now: float) -> Request:
        options = destination.options
        headers = {"Content-Type": "text/plain; charset=utf-8", "Title": event.type}
        if "tags" in options:
            headers["Tags"] = options["tags"]
        if "priority" in options:
            headers["Priority"] = options["priority"]
        if options["token"]:
            headers["Authorization"] = f"Bearer {options['token']}"
        text = cut_bytes(render_text(destination, event), NTFY_LIMIT)
        return Request("POST", destination.url, headers, text.encode(), destination.display)
