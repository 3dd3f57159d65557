"""Body digests, computed once per batch so the body is not needed at send time."""

from __future__ import annotations

import base64
import binascii
import hashlib

from django_federation_delivery.exceptions import SigningError

__all__ = ["body_sha256", "check_sha256_b64", "content_digest_header", "digest_header"]

_SHA256_SIZE = 32


def body_sha256(body: bytes) -> str:
    """Standard padded base64 of the body's SHA-256: the one value both headers share."""
    return base64.b64encode(hashlib.sha256(body).digest()).decode("ascii")


def digest_header(sha256_b64: str) -> str:
    """The draft-cavage ``Digest`` value (RFC 3230 style), as Mastodon expects it."""
    return f"SHA-256={sha256_b64}"


def content_digest_header(sha256_b64: str) -> str:
    """The RFC 9530 ``Content-Digest`` value: a structured-field byte sequence."""
    return f"sha-256=:{sha256_b64}:"


def check_sha256_b64(sha256_b64: str) -> None:
    """Refuse a stored digest that is not base64 of 32 bytes.

    The value is read back from the database, so a truncated or hand-edited one
    must fail loudly rather than be signed and rejected by every inbox.
    """
    try:
        raw = base64.b64decode(sha256_b64.encode("ascii"), validate=True)
    except (UnicodeEncodeError, binascii.Error) as exc:
        raise SigningError("body_sha256 is not valid base64") from exc
    if len(raw) != _SHA256_SIZE or base64.b64encode(raw).decode("ascii") != sha256_b64:
        raise SigningError("body_sha256 is not the padded base64 of a SHA-256 digest")
