"""draft-cavage HTTP Signatures, in the exact shape Mastodon sends and accepts.

The request facts both schemes sign (where the POST goes, its Host and Date, the
extra headers a caller adds) are worked out here too: the RFC 9421 signer reuses
them, so the two schemes can never disagree about what request they describe.
"""

from __future__ import annotations

import base64
import string
from collections.abc import Mapping
from dataclasses import dataclass
from email.utils import formatdate

from django_federation_delivery import urls
from django_federation_delivery.exceptions import SigningError

from .digest import check_sha256_b64, digest_header
from .keys import SenderKey

__all__ = [
    "CAVAGE_ALGORITHM",
    "CAVAGE_COVERED",
    "Target",
    "check_header_fields",
    "check_key_id",
    "check_method",
    "http_date",
    "parse_target",
    "sign_cavage",
]

#: The only algorithm name Mastodon accepts in a draft-cavage ``Signature``.
CAVAGE_ALGORITHM = "rsa-sha256"
#: Headers every draft-cavage signature covers, in this order.
CAVAGE_COVERED = ("(request-target)", "host", "date", "digest", "content-type")

# RFC 9110 "tchar": what a header name or method may be made of.
_TCHARS = frozenset(string.ascii_letters + string.digits + "!#$%&'*+-.^_`|~")
# Headers the signers set themselves; an extra header must not shadow them.
_RESERVED = frozenset(
    {"host", "date", "digest", "content-type", "content-digest", "signature", "signature-input"}
)


@dataclass(frozen=True)
class Target:
    """Where a request goes, split the way signatures need it."""

    scheme: str
    #: The ``Host`` value: lowercase host, ``:port`` only when not the default.
    host: str
    #: The path (``/`` when empty) plus ``?query`` when there is one.
    path_query: str

    @property
    def uri(self) -> str:
        """The absolute URI the server will reconstruct: scheme, Host, path and query."""
        return f"{self.scheme}://{self.host}{self.path_query}"


def parse_target(url: str) -> Target:
    """Split an absolute http(s) URL into what a signature covers, in its canonical
    form (:func:`django_federation_delivery.urls.split`).

    The canonical form is what the transport sends (``requests`` leaves it as it is),
    so the signed target is the one on the wire; a URL with no canonical form is
    refused rather than signed for something else than will be requested.
    """
    try:
        parts = urls.split(url)
    except urls.UnusableURL as exc:
        raise SigningError(f"cannot sign for '{exc.redacted}': it {exc.reason}") from None
    return Target(scheme=parts.scheme, host=parts.hostport, path_query=parts.target)


def http_date(now: float) -> str:
    """RFC 7231 IMF-fixdate in GMT, the only ``Date`` form servers must accept."""
    return formatdate(now, usegmt=True)


def check_method(method: str) -> str:
    """Return the method uppercased (as HTTP clients send it), refusing a non-token."""
    if not method or not set(method) <= _TCHARS:
        raise SigningError(f"cannot sign a request with method {method!r}")
    return method.upper()


def check_key_id(key: SenderKey) -> None:
    """Refuse a key id that cannot be put between the quotes of either scheme."""
    key_id = key.key_id
    if (
        not key_id
        or not key_id.isascii()
        or not key_id.isprintable()
        or '"' in key_id
        or "\\" in key_id
    ):
        raise SigningError(f"key id {key_id!r} must be non-empty printable ASCII without quotes")


def _check_value(name: str, value: str) -> str:
    # Trim as HTTP does on receipt, so the signed value is the one received.
    value = value.strip(" \t")
    if not value.isascii() or not all(ch == "\t" or " " <= ch <= "~" for ch in value):
        raise SigningError(f"header {name!r} has characters that cannot be signed or sent")
    return value


def check_header_fields(
    content_type: str, extra_headers: Mapping[str, str] | None
) -> tuple[str, list[tuple[str, str]]]:
    """Validate Content-Type and the extra headers, returning them as they will be sent.

    A value with a newline would let a caller smuggle headers past the
    signature, and a name clash would make the sent header differ from the
    signed one, so both are refused up front.
    """
    checked_type = _check_value("Content-Type", content_type)
    if not checked_type:
        raise SigningError("Content-Type must not be empty")
    extras: list[tuple[str, str]] = []
    seen: set[str] = set()
    for name, value in (extra_headers or {}).items():
        lowered = name.lower()
        if not name or not set(name) <= _TCHARS:
            raise SigningError(f"{name!r} is not a valid header name")
        if lowered in _RESERVED:
            raise SigningError(f"extra header {name!r} would replace one the signer sets")
        if lowered in seen:
            raise SigningError(f"extra header {name!r} is given more than once")
        seen.add(lowered)
        extras.append((name, _check_value(name, value)))
    return checked_type, extras


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
            f"key {key.key_id!r} is an Ed25519 key, which the draft-cavage scheme cannot use "
            f"(only {CAVAGE_ALGORITHM} is accepted there); use rfc9421 or an RSA key"
        )
    check_key_id(key)
    check_sha256_b64(body_sha256)
    target = parse_target(url)
    verb = check_method(method)
    checked_type, extras = check_header_fields(content_type, extra_headers)

    headers = {
        "Host": target.host,
        "Date": http_date(now),
        "Digest": digest_header(body_sha256),
        "Content-Type": checked_type,
    }
    lines = [
        f"(request-target): {verb.lower()} {target.path_query}",
        f"host: {headers['Host']}",
        f"date: {headers['Date']}",
        f"digest: {headers['Digest']}",
        f"content-type: {checked_type}",
    ]
    covered = list(CAVAGE_COVERED)
    for name, value in extras:
        headers[name] = value
        lines.append(f"{name.lower()}: {value}")
        covered.append(name.lower())

    signature = base64.b64encode(key.sign("\n".join(lines).encode("ascii"))).decode("ascii")
    headers["Signature"] = (
        f'keyId="{key.key_id}",algorithm="{CAVAGE_ALGORITHM}",'
        f'headers="{" ".join(covered)}",signature="{signature}"'
    )
    return headers
