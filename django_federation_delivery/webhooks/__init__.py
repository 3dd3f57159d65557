"""Webhooks: events queued for configured destinations, each sent by its kind.

A destination is a name and a URL, read from the environment with
:func:`webhooks_from_env` into ``FEDERATION_DELIVERY["WEBHOOKS"]``. The URL's
scheme picks the kind (``channels/``: Slack, Discord, Markdown hooks,
Telegram, ntfy, Matrix, signed JSON, or one the project adds), and the URL is
the credential, so only the name and the kind are ever shown.

``send_webhook`` (``webhooks/sending.py``, re-exported by the package) queues
an event; the deliverer sends it (``webhooks/deliveries.py``) through its
destination's kind (``Channel.attempt``), retried as that kind's policy
says (``webhooks/policy.py``).
"""

from __future__ import annotations

from django_federation_delivery.channels import Destination, Event, Request, parse_destination
from django_federation_delivery.webhooks.destinations import (
    WebhookURL,
    configured_destinations,
    webhooks_from_env,
)

__all__ = [
    "Destination",
    "Event",
    "Request",
    "WebhookURL",
    "configured_destinations",
    "parse_destination",
    "webhooks_from_env",
]
