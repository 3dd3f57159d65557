"""Signing for outgoing deliveries: body digest, target and key in, headers out;
draft-cavage and RFC 9421 for inboxes, Standard Webhooks for signed JSON.

Pure on purpose: nothing here imports Django, so it can be tested and reused
without settings, and the transport can sign without touching the database.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Mapping

from .cavage import sign_cavage
from .digest import body_sha256, content_digest_header, digest_header
from .keys import SenderKey
from .rfc9421 import sign_rfc9421
from .webhooks import signature_headers

__all__ = [
    "Scheme",
    "SenderKey",
    "body_sha256",
    "content_digest_header",
    "digest_header",
    "sign_request",
    "signature_headers",
]


class Scheme(enum.StrEnum):
    """The two signature schemes servers in the fediverse accept."""

    CAVAGE = "draft-cavage"
    RFC9421 = "rfc9421"

    def other(self) -> Scheme:
        """The scheme to retry with when an inbox refuses this one ("double knocking")."""
        return Scheme.RFC9421 if self is Scheme.CAVAGE else Scheme.CAVAGE


def sign_request(
    scheme: Scheme,
    *,
    url: str,
    body_sha256: str,
    key: SenderKey,
    content_type: str = "application/activity+json",
    extra_headers: Mapping[str, str] | None = None,
    now: float | None = None,
    method: str = "POST",
) -> dict[str, str]:
    """Every header the request must carry for its signature to verify.

    Takes the body's digest rather than the body, so a batch hashes its body
    once however many inboxes it goes to. Extra headers are both returned and
    covered by the signature. Raises ``SigningError`` for anything unsignable.
    """
    signer = sign_cavage if Scheme(scheme) is Scheme.CAVAGE else sign_rfc9421
    return signer(
        url=url,
        body_sha256=body_sha256,
        key=key,
        content_type=content_type,
        extra_headers=extra_headers,
        now=time.time() if now is None else now,
        method=method,
    )
