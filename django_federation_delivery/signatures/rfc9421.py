"""RFC 9421 HTTP Message Signatures, built by hand from the signature base up.

The base is assembled here (RFC 9421 section 2.5) rather than through a
library, so the package stays small and the exact bytes signed are visible.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping, Sequence

from .digest import content_digest_header
from .keys import SenderKey
from .request import prepare

__all__ = [
    "RFC9421_ALGORITHMS",
    "RFC9421_COVERED",
    "RFC9421_LABEL",
    "sign_rfc9421",
    "signature_base",
    "signature_params",
]

#: The signature label; receivers look the signature up by it.
RFC9421_LABEL = "sig1"
#: Components every signature covers, in this order; extra headers follow.
RFC9421_COVERED = ("@method", "@target-uri", "content-type", "content-digest")
#: The ``alg`` parameter for each ``SenderKey.algorithm``.
RFC9421_ALGORITHMS = {"rsa": "rsa-v1_5-sha256", "ed25519": "ed25519"}


def _sf_string(value: str) -> str:
    # Structured-field string (RFC 8941 section 3.3.3): quote, escaping \ and ".
    escaped = value.replace("\\", "\\\\").replace('"', '\\"')
    return f'"{escaped}"'


def signature_params(components: Sequence[str], *, created: int, key_id: str, alg: str) -> str:
    """The ``@signature-params`` value, also sent verbatim after ``sig1=`` in Signature-Input."""
    inner = " ".join(_sf_string(name) for name in components)
    return f"({inner});created={created};keyid={_sf_string(key_id)};alg={_sf_string(alg)}"


def signature_base(components: Sequence[tuple[str, str]], params: str) -> str:
    """The exact text signed: one ``"name": value`` line per component, then the params.

    Lines are joined with a bare LF and there is no trailing newline.
    """
    lines = [f"{_sf_string(name)}: {value}" for name, value in components]
    lines.append(f'"@signature-params": {params}')
    return "\n".join(lines)


def sign_rfc9421(
    *,
    url: str,
    body_sha256: str,
    key: SenderKey,
    content_type: str,
    extra_headers: Mapping[str, str] | None,
    now: float,
    method: str,
) -> dict[str, str]:
    """Headers for an RFC 9421 signed request, Content-Digest included.

    Host and Date are sent as well though not covered: harmless, and some
    servers refuse a request without a Date.
    """
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
        "Content-Type": request.content_type,
        "Content-Digest": content_digest_header(body_sha256),
    }
    components = [
        ("@method", request.method),
        ("@target-uri", request.target.uri),
        ("content-type", request.content_type),
        ("content-digest", headers["Content-Digest"]),
    ]
    for name, value in request.extras:
        headers[name] = value
        components.append((name.lower(), value))

    params = signature_params(
        [name for name, _ in components],
        created=int(now),
        key_id=key.key_id,
        alg=RFC9421_ALGORITHMS[key.algorithm],
    )
    base = signature_base(components, params)
    signature = base64.b64encode(key.sign(base.encode("ascii"))).decode("ascii")
    headers["Signature-Input"] = f"{RFC9421_LABEL}={params}"
    headers["Signature"] = f"{RFC9421_LABEL}=:{signature}:"
    return headers
