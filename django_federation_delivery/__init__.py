"""Signed ActivityPub and webhook deliveries from a queue in the Django database.

The public API is importable from here::

    from django_federation_delivery import send, send_batch, BatchOptions, SenderKey
    from django_federation_delivery import send_webhook
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# Re-exported lazily: this package is imported while Django loads its apps,
# before models may be.
_EXPORTS = {
    "send": "django_federation_delivery.sending",
    "asend": "django_federation_delivery.sending",
    "asend_batch": "django_federation_delivery.sending",
    "asend_portable": "django_federation_delivery.sending",
    "asend_webhook": "django_federation_delivery.webhooks.sending",
    "send_batch": "django_federation_delivery.sending",
    "send_portable": "django_federation_delivery.sending",
    "send_webhook": "django_federation_delivery.webhooks.sending",
    "PortableInbox": "django_federation_delivery.portable",
    "BatchOptions": "django_federation_delivery.sending",
    "SenderKey": "django_federation_delivery.signatures",
    "Scheme": "django_federation_delivery.signatures",
    "InvalidDelivery": "django_federation_delivery.exceptions",
    "SigningError": "django_federation_delivery.exceptions",
    "mark_host_seen": "django_federation_delivery.availability",
    "normalize_inbox": "django_federation_delivery.addresses",
    "validate_inbox": "django_federation_delivery.addresses",
}

if TYPE_CHECKING:
    from django_federation_delivery.addresses import normalize_inbox, validate_inbox
    from django_federation_delivery.availability import mark_host_seen
    from django_federation_delivery.exceptions import InvalidDelivery, SigningError
    from django_federation_delivery.portable import PortableInbox
    from django_federation_delivery.sending import (
        BatchOptions,
        asend,
        asend_batch,
        asend_portable,
        send,
        send_batch,
        send_portable,
    )
    from django_federation_delivery.signatures import Scheme, SenderKey
    from django_federation_delivery.webhooks.sending import asend_webhook, send_webhook

__all__ = [
    "BatchOptions",
    "InvalidDelivery",
    "PortableInbox",
    "Scheme",
    "SenderKey",
    "SigningError",
    "__version__",
    "asend",
    "asend_batch",
    "asend_portable",
    "asend_webhook",
    "mark_host_seen",
    "normalize_inbox",
    "send",
    "send_batch",
    "send_portable",
    "send_webhook",
    "validate_inbox",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from importlib import import_module

    return getattr(import_module(module), name)
