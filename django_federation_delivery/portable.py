"""FEP-ef61 portable inboxes: from an ``ap://`` inbox to the gateway URLs to POST to.

A portable actor's objects are named by ``ap://<did>/<path>`` URIs, which no HTTP client can
reach; they are served by the gateways the actor lists, each at
``<gateway>/.well-known/apgateway/<did>/<path>``. Pure functions: no Django, no network.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

from . import addresses
from .addresses import origin, quoted
from .exceptions import InvalidDelivery

__all__ = [
    "MAX_GATEWAYS",
    "PortableInbox",
    "at_gateway",
    "canonical",
    "is_gateway",
    "parse_ap_uri",
    "targets",
]

#: The most gateways one delivery is sent to: an actor may list many, and each is a POST.
MAX_GATEWAYS = 5

_GATEWAY_PATH = "/.well-known/apgateway/"
# did:<method>:<id>, with the DID Core characters but no percent-encoding: did:key and most
# methods never need it, and refusing it keeps one DID from having two spellings.
_DID = re.compile(r"did:[a-z0-9]+:[A-Za-z0-9._-]+(?::[A-Za-z0-9._-]+)*")


def parse_ap_uri(uri: str) -> tuple[str, str, str]:
    """``(did, path, query)`` of an ``ap://`` URI, the path with its leading "/".

    The DID may be written percent-encoded in the authority (``did%3Akey%3A...``), as RFC 3986
    allows no ":" in a host; either spelling gives the same DID. The path and query come back
    with what a URL cannot carry percent-encoded. The fragment is dropped: it names a part of the
    object, not another one.
    """
    # urlsplit silently drops tabs and newlines, so a URI carrying them would
    # pass for another; and no URL holds any other control or space as it is.
    if not isinstance(uri, str) or addresses.control_or_space(uri) is not None:
        raise InvalidDelivery(f"not an ap:// URI: {quoted(uri, path=True)}")
    try:
        uri.encode()
    except UnicodeEncodeError:
        # A byte that was not UTF-8, decoded leniently: no URL can carry it.
        raise InvalidDelivery(
            "an ap:// URI holds text that is not valid Unicode (a lone surrogate): "
            f"{quoted(uri, path=True)}"
        ) from None
    try:
        parts = urlsplit(uri)
    except ValueError:  # a "[" or "]" in the authority, read as an IPv6 literal
        raise InvalidDelivery(f"not an ap:// URI: {quoted(uri, path=True)}") from None
    if parts.scheme.lower() != "ap":
        raise InvalidDelivery(f"not an ap:// URI: {quoted(uri, path=True)}")
    # Decoded only when written encoded whole: a "%3A" in a DID written with
    # its colons (did:web's port) is part of the DID, and decoded it would
    # name another (did:web:host:8443 is a path on host), so it is refused.
    did = parts.netloc if ":" in parts.netloc else unquote(parts.netloc)
    if not _DID.fullmatch(did):
        raise InvalidDelivery(
            f"the authority of an ap:// URI must be a DID: {quoted(uri, path=True)}"
        )
    path = parts.path
    if path in ("", "/"):
        raise InvalidDelivery(
            f"an ap:// inbox needs a path after the DID: {quoted(uri, path=True)}"
        )
    # A gateway URL is resolved like any other: "/did/../../x" would leave the apgateway prefix.
    if any(unquote(segment) in (".", "..") for segment in path.split("/")):
        raise InvalidDelivery(
            f"an ap:// path may not have '.' or '..' segments: {quoted(uri, path=True)}"
        )
    return did, addresses.encode_path(path), addresses.encode_query(parts.query)


def canonical(uri: str) -> str:
    """``ap://<did><path>`` without query or fragment, the DID decoded: the one name of an inbox,
    so that an inbox listed twice in different spellings is delivered to once."""
    did, path, _query = parse_ap_uri(uri)
    return f"ap://{did}{path}"


def is_gateway(url: str) -> bool:
    """Whether ``url`` is a bare http(s) origin, as FEP-ef61 requires of an actor's gateways.

    Only ``scheme://host[:port]`` with an optional "/" is accepted: a gateway with a path, a
    query, a fragment or userinfo is not one the FEP describes, and is not guessed at.
    """
    if not isinstance(url, str) or "?" in url or "#" in url:  # "x?" parses as "x"
        return False
    try:
        parts = addresses.split(url)
    except addresses.UnusableURL:
        return False
    # Nothing after the "/" that ends the authority, not even "." or another "/".
    return parts.path == "/" and not url.partition("//")[2].partition("/")[2]


def at_gateway(uri: str, gateway: str) -> str:
    """The URL of the ``ap://`` resource ``uri`` at ``gateway``.

    The DID's colons stay literal, as in FEP-ef61's examples (":" is allowed in a URL path);
    the query is kept, since the gateway passes it on.
    """
    did, path, query = parse_ap_uri(uri)
    if not is_gateway(gateway):
        raise InvalidDelivery(
            f"not a gateway (a bare http(s) origin): {quoted(gateway, path=True)}"
        )
    url = f"{origin(gateway)}{_GATEWAY_PATH}{did}{path}"
    # In canonical form, as every URL delivered to (see addresses.py); raises when too long.
    return addresses.split(f"{url}?{query}" if query else url).url


@dataclass(frozen=True)
class PortableInbox:
    """A portable inbox and the gateways its actor lists, in the actor's order.

    The inbox is checked when made. A single string for ``gateways`` is taken as a list of one,
    as JSON-LD compaction writes a one-item list; ``gateways`` is kept as a tuple. What is no
    string and no iterable of them is refused, naming it (a gateway in it that is no string is
    left out when the inbox is sent to, as one that is not a bare origin is).
    """

    inbox: str
    gateways: Sequence[str]

    def __post_init__(self) -> None:
        parse_ap_uri(self.inbox)
        gateways = self.gateways
        if isinstance(gateways, str):
            gateways = (gateways,)
        elif isinstance(gateways, addresses.BINARY) or not isinstance(gateways, Iterable):
            raise InvalidDelivery(
                "gateways must be a list of gateway URLs (or one as a string), "
                f"not {quoted(gateways)}"
            )
        object.__setattr__(self, "gateways", tuple(gateways))


def targets(inbox: PortableInbox) -> list[str]:
    """The URLs to deliver to, in the actor's order: one per usable gateway origin, at most
    ``MAX_GATEWAYS``. Unusable gateways are skipped; none usable gives an empty list."""
    seen: set[str] = set()
    found: list[str] = []
    for gateway in inbox.gateways:
        if len(found) >= MAX_GATEWAYS:
            break
        if not is_gateway(gateway):
            continue
        gateway_origin = origin(gateway)
        if gateway_origin in seen:
            continue
        seen.add(gateway_origin)
        try:
            found.append(at_gateway(inbox.inbox, gateway_origin))
        except InvalidDelivery:
            continue  # too long at this gateway
    return found
