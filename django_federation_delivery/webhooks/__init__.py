"""Webhook destinations, what each receives, and Standard Webhooks signing.

A destination is a name and a URL, read from the environment with
:func:`webhooks_from_env` into ``FEDERATION_DELIVERY["WEBHOOKS"]``. The URL is
the credential, so only the name and the kind are ever shown. One form a kind:

``slack://hooks.slack.com/services/T000/B000/XXXX``
    A Slack incoming webhook: POST ``https://hooks.slack.com/services/…`` with
    ``{"text": …}`` in mrkdwn, ``& < >`` escaped.
``discord://discord.com/api/webhooks/<id>/<token>``
    A Discord webhook: ``{"content": …}`` cut to 2,000 characters, mentions off.
``markdown://chat.example/hooks/<key>``
    Mattermost, Rocket.Chat and other hooks taking ``{"text": markdown}``.
``telegram://<bot token>@<chat id>``
    A Telegram bot posting to a chat (a number such as ``-1001234567890`` or an
    ``@username``): POST ``https://api.telegram.org/bot<token>/sendMessage``
    with ``chat_id``, ``text`` (Telegram HTML, ``& < >`` escaped, cut to 4,096
    characters) and ``parse_mode: "HTML"``. ``?api=http://127.0.0.1:8081``
    sends to another Bot API server (a local one, or a test's).
``https://receiver.example/hooks?secret=whsec_…``
    The event as JSON, ``{"type", "id", "timestamp", "data"}``, signed as the
    Standard Webhooks specification says (``webhook-id``,
    ``webhook-timestamp``, ``webhook-signature``). The ``secret`` parameters
    are taken out of the URL sent; give several while rotating keys, and each
    signs. A key is ``whsec_`` and 24 to 64 random bytes in base64.

``slack+http://``, ``discord+http://``, ``markdown+http://`` and ``http://``
send over plain HTTP, for development and tests. No address is refused here:
the transport refuses private ones unless ``ALLOWED_NETWORKS`` allows them.

:func:`build_request` turns a destination and an :class:`Event` into the exact
POST to make. ``send_webhook`` (``webhooks/sending.py``, re-exported by the
package) queues an event; the deliverer sends it (``webhooks/deliveries.py``,
``webhooks/attempt.py``) by the rules of ``webhooks/policy.py``.
"""

from __future__ import annotations

from django_federation_delivery.webhooks.destinations import (
    Destination,
    Kind,
    configured_destinations,
    parse_destination,
    webhooks_from_env,
)
from django_federation_delivery.webhooks.rendering import Event, WebhookRequest, build_request

__all__ = [
    "Destination",
    "Event",
    "Kind",
    "WebhookRequest",
    "build_request",
    "configured_destinations",
    "parse_destination",
    "webhooks_from_env",
]
