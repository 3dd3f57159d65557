"""The request both signature schemes sign, checked once before either signs it.

Where the POST goes, its Host and Date, its method, Content-Type and extra
headers, the key id and the body's digest: each scheme describes the same
request, so :func:`prepare` checks and works them out for both, and the two
can never disagree about what they sign.
"""

from __future__ import annotations

import string
from collections.abc import Mapping
from dataclasses import dataclass
from email.utils import formatdate

from django_federation_delivery import addresses
from django_federation_delivery.exceptions import SigningError

from .digest import check_sha256_b64
from .keys import SenderKey, shown

__all__ = [
    "Prepared",
    "Target",
    "check_header_fields",
    "check_header_value",
    "check_key_id",
    "check_method",
    "http_date",
    "parse_target",
    "prepare",
]

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
    form (:func:`django_federation_delivery.addresses.split`).

    The canonical form is what the transport sends (``requests`` leaves it as it is),
    so the signed target is the one on the wire; a URL with no canonical form is
    refused rather than signed for something else than will be requested.
    """
    try:
        parts = addresses.split(url)
    except addresses.UnusableURL as exc:
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
    if not isinstance(key_id, str):
        # A SenderKey built by hand with an actor's pk, or bytes.
        raise SigningError(f"key id is a {type(key_id).__name__}: it must be text")
    if (
        not key_id
        or not key_id.isascii()
        or not key_id.isprintable()
        or '"' in key_id
        or "\\" in key_id
    ):
        raise SigningError(
            f"key id {shown(key_id)} must be non-empty printable ASCII without quotes"
        )


def check_header_value(name: str, value: str) -> str:
    """``value`` as header ``name`` carries it, signed and sent, or
    ``SigningError`` when it cannot be (a character that is not printable
    ASCII): the error does not repeat the value, which may be a secret."""
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
    checked_type = check_header_value("Content-Type", content_type)
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
        extras.append((name, check_header_value(name, value)))
    return checked_type, extras


@dataclass(frozen=True)
class Prepared:
    """A request as it is to be signed and sent."""

    target: Target
    #: The method, uppercased.
    method: str
    #: The ``Date`` value.
    date: str
    content_type: str
    #: The extra headers, in order, as they will be sent.
    extras: tuple[tuple[str, str], ...]


def prepare(
    *,
    url: str,
    body_sha256: str,
    key: SenderKey,
    content_type: str,
    extra_headers: Mapping[str, str] | None,
    now: float,
    method: str,
) -> Prepared:
    """Check what a signer is given, refusing with ``SigningError`` what
    cannot be signed, and return the request it describes."""
    check_key_id(key)
    check_sha256_b64(body_sha256)
    target = parse_target(url)
    verb = check_method(method)
    checked_type, extras = check_header_fields(content_type, extra_headers)
    return Prepared(target, verb, http_date(now), checked_type, tuple(extras))
