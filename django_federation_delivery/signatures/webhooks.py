"""Standard Webhooks signatures (https://www.standardwebhooks.com/).

Pure: a message id, a timestamp, a body and keys in; headers out. A receiver
verifies them with any Standard Webhooks library, e.g. Python's
``standardwebhooks.Webhook("whsec_…").verify(body, headers)``.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
from collections.abc import Sequence

__all__ = ["signature_headers"]


def signature_headers(
    message_id: str, timestamp: int, body: bytes, keys: Sequence[bytes]
) -> dict[str, str]:
    """``webhook-id``, ``webhook-timestamp`` and ``webhook-signature``: one ``v1,``
    signature per key, space-separated, so a receiver holding any one of them
    verifies (keys are rotated by sending with the old and the new for a while)."""
    if not keys:
        raise ValueError("at least one key is needed to sign")
    signed = b"%s.%d.%s" % (message_id.encode(), timestamp, body)
    signatures = (
        "v1," + base64.b64encode(hmac.new(key, signed, hashlib.sha256).digest()).decode()
        for key in keys
    )
    return {
        "webhook-id": message_id,
        "webhook-timestamp": str(timestamp),
        "webhook-signature": " ".join(signatures),
    }
