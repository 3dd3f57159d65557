"""Kinds of destination, one :class:`Channel` each: inboxes and webhook kinds.

A kind says how its URL parses (and which parts of it are secret), how the
request for one attempt is built, what an answer means, and its policy. The
loop calls that interface only. A webhook kind is found by its URL's scheme.
Built in: Slack, Discord, Markdown hooks, Telegram, ntfy,
Matrix and signed JSON (Standard Webhooks); a project adds its own with
``FEDERATION_DELIVERY["CHANNELS"]``. An ActivityPub inbox is a kind too
(``activitypub.py``: signed, double-knocked, gateway by gateway), named by
``send()`` rather than configured, so it is chosen by no scheme.
"""

from __future__ import annotations

from django_federation_delivery.channels.activitypub import ActivityPub
from django_federation_delivery.channels.base import (
    Call,
    Channel,
    Destination,
    Parsed,
    Policy,
    Request,
    UnusableURL,
    Verdict,
)
from django_federation_delivery.channels.events import Event
from django_federation_delivery.channels.policy import PolicyError
from django_federation_delivery.channels.registry import parse_destination, registry
from django_federation_delivery.channels.text import render_text

__all__ = [
    "ActivityPub",
    "Call",
    "Channel",
    "Destination",
    "Event",
    "Parsed",
    "Policy",
    "PolicyError",
    "Request",
    "UnusableURL",
    "Verdict",
    "parse_destination",
    "registry",
    "render_text",
]
