"""FEP-8fcf followers collection synchronization: the ``Collection-Synchronization`` header.

A delivery to a server's inbox may carry a digest of the sender's followers that live on that
server; when the receiver's own count differs it fetches the partial collection at ``url`` and
drops follows it no longer shares. Pure functions: no Django, no database, no network.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable

from .addresses import BINARY, origin, quoted
from .exceptions import InvalidDelivery

__all__ = [
    "collection_synchronization",
    "followers_digest",
    "followers_on_origin",
    "header_value",
    "origin",
]

# What a quoted header parameter can carry without escaping: printable ASCII but '"' and '\'.
_QUOTABLE = re.compile(r"[\x20\x21\x23-\x5b\x5d-\x7e]+")
_HEX_DIGEST = re.compile(r"[0-9a-fA-F]{64}")
_SHOWN_LENGTH = 200


def _shown(value: object) -> str:
    """``value`` as an error message may name it: quoted, one line, not too long."""
    text = repr(value)
    return text if len(text) <= _SHOWN_LENGTH else text[: _SHOWN_LENGTH - 3] + "..."


def _each(follower_uris: Iterable[str]) -> dict[str, None]:
    """The follower URIs, once each, in the order given. One that is not a
    string (a row of ``values_list()`` without ``flat=True``, a dict of
    ``values()``) is refused by name: left out, it would make a digest of
    fewer followers, which the receiver takes as follows to drop; a dict,
    which cannot be counted once, would raise a bare ``TypeError``."""
    if isinstance(follower_uris, str | BINARY):
        raise InvalidDelivery(
            f"expected follower URIs, got one string: {quoted(follower_uris, path=True)}"
        )
    uris: dict[str, None] = {}
    for uri in follower_uris:
        if not isinstance(uri, str):
            # An actor's URI is public: named with its path, and so are the
            # URIs of a row a query gave in its place.
            raise InvalidDelivery(f"a follower URI must be a string, not {quoted(uri, path=True)}")
        uris[uri] = None
    return uris


def followers_digest(follower_uris: Iterable[str]) -> str:
    """The XOR of the SHA-256 of each follower URI, hex-encoded, as Mastodon computes it.

    XOR makes it independent of order; each URI is counted once, since a URI listed twice would
    otherwise cancel itself out and the digest would miss a follower the receiver has.
    """
    digest = 0
    for uri in _each(follower_uris):
        digest ^= int.from_bytes(hashlib.sha256(uri.encode("utf-8")).digest(), "big")
    return digest.to_bytes(32, "big").hex()


def followers_on_origin(follower_uris: Iterable[str], inbox: str) -> list[str]:
    """The followers whose URI is on the inbox's origin, once each, in the order given.

    A receiving server can only check the followers it hosts, so the digest sent to it covers
    those alone. A follower URI that is not an http(s) URL is on no origin and is left out; one
    that is not a string is refused.
    """
    uris = _each(follower_uris)
    wanted = origin(inbox)
    on_origin: list[str] = []
    for uri in uris:
        try:
            if origin(uri) == wanted:
                on_origin.append(uri)
        except InvalidDelivery:
            continue
    return on_origin


def _quotable(name: str, value: str) -> str:
    if not isinstance(value, str) or not _QUOTABLE.fullmatch(value):
        raise InvalidDelivery(
            f"{name} must be non-empty printable ASCII without '\"' or '\\': {_shown(value)}"
        )
    return value


def header_value(collection_id: str, url: str, digest: str) -> str:
    """The ``Collection-Synchronization`` header value, refusing what would not parse back.

    Values go out as quoted strings without escapes, so a quote, a backslash, a control or a
    non-ASCII character is refused rather than sent as a header the receiver misreads.
    """
    _quotable("collectionId", collection_id)
    _quotable("url", url)
    if origin(url) != origin(collection_id):
        # FEP-8fcf: the partial collection is on the actor's own server, or
        # a receiver (Mastodon) ignores the header.
        raise InvalidDelivery(
            f"url {quoted(url, path=True)} is not on the server of the collection "
            f"{quoted(collection_id, path=True)}"
        )
    if not isinstance(digest, str) or not _HEX_DIGEST.fullmatch(digest):
        raise InvalidDelivery(f"digest must be 64 hex characters: {_shown(digest)}")
    # Receivers compare the digest as a string with their own, which is lowercase.
    return f'collectionId="{collection_id}", url="{url}", digest="{digest.lower()}"'


def collection_synchronization(
    collection_id: str, partial_url: str, follower_uris: Iterable[str], inbox: str
) -> str:
    """The header value for a delivery to ``inbox``: the digest of the followers on its origin."""
    digest = followers_digest(followers_on_origin(follower_uris, inbox))
    return header_value(collection_id, partial_url, digest)
