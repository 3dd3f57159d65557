"""draft-cavage HTTP Signatures, in the exact shape Mastodon sends and accepts.

The request itself is checked and worked out by ``request.prepare``, which
the RFC 9421 signer shares.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping

from django_federation_delivery.exceptions import SigningError

from .digest import digest_header
from .keys import SenderKey, shown
from .request import prepare

__all__ = ["CAVAGE_ALGORITHM", "CAVAGE_COVERED", "sign_cavage"]

#: The only algorithm name Mastodon accepts in a draft-cavage ``Signature``.
CAVAGE_ALGORITHM = "rsa-sha256"
#: Headers every draft-cavage signature covers, in this order.
CAVAGE_COVERED = ("(request-target)", "host", "date", "digest", "content-type")


def sign_cavage(
    *,
    url: str,
    body_sha256: str,
    key: SenderKey,
    content_type: str,
    extra_headers: Mapping[str, str] | None,
    now: float,
    method: str,
) -> dict[str, str]:
    """Headers for a draft-cavage signed request: Host, Date, Digest, Content-Type, Signature.

    Mastodon only verifies ``rsa-sha256`` here, so an Ed25519 key is refused
    instead of producing a signature every Mastodon inbox would reject.
    """
    if key.algorithm != "rsa":
        raise SigningError(
            f"key {shown(key.key_id)} is an Ed25519 key, which the draft-cavage scheme cannot use "
            f"(only {CAVAGE_ALGORITHM} is accepted there); use rfc9421 or an RSA key"
        )
    request = prepare(
        url=url,
        body_sha256=body_sha256,
        key=key,
        content_type=content_type,
        extra_headers=extra_headers,
        now=now,
        method=method,
    )
    headers = {
        "Host": request.target.host,
        "Date": request.date,
        "Digest": digest_header(body_sha256),
        "Content-Type": request.content_type,
    }
    lines = [
        f"(request-target): {request.method.lower()} {request.target.path_query}",
        f"host: {headers['Host']}",
        f"date: {headers['Date']}",
        f"digest: {headers['Digest']}",
        f"content-type: {request.content_type}",
    ]
    covered = list(CAVAGE_COVERED)
    for name, value in request.extras:
        headers[name] = value
        lines.append(f"{name.lower()}: {value}")
        covered.append(name.lower())

    signature = base64.b64encode(key.sign("\n".join(lines).encode("ascii"))).decode("ascii")
    headers["Signature"] = (
        f'keyId="{key.key_id}",algorithm="{CAVAGE_ALGORITHM}",'
        f'headers="{" ".join(covered)}",signature="{signature}"'
    )
    return headers
