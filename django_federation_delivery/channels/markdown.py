"""Hooks that take ``{"text": markdown}``: Mattermost, Rocket.Chat and their
kin, ``markdown://chat.example/hooks/<key>``."""

from __future__ import annotations

# Django's own gettext_noop reads USE_I18N: this module is imported while a
# settings file is read (webhooks_from_env), where a setting read would load
# the half-read file again. This one reads nothing.
from django.utils.translation.trans_null import gettext_noop

from django_federation_delivery.channels.base import Destination, Request
from django_federation_delivery.channels.events import Event
from django_federation_delivery.channels.hooks import HookChannel
from django_federation_delivery.channels.text import cut_markdown, escape_markdown, render_text

__all__ = ["MARKDOWN_LIMIT", "Markdown"]

#: The text's most characters, escaped: Rocket.Chat refuses more than 5,000
#: (``Message_MaxAllowedSize``, by default), and Mattermost splits a longer
#: text into posts wherever they fall, so that an escaping backslash could
#: end one and the "#" it escaped start the next.
MARKDOWN_LIMIT = 4000


class Markdown(HookChannel):
    """``{"text": …}``, the template's text shown as written: no markup, mention,
    link or image is made of what an event's data says; cut to
    :data:`MARKDOWN_LIMIT` characters."""

    name = "markdown"
    label = gettext_noop("Markdown hook")
    schemes = ("markdown", "markdown+http")
    public_segments = frozenset({"hooks"})

    def request(self, destination: Destination, event: Event, *, now: float) -> Request:
        text = cut_markdown(escape_markdown(render_text(destination, event)), MARKDOWN_LIMIT)
        return self.json_request(destination, {"text": text})
