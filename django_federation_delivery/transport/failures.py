"""What went wrong, as a :class:`TransportError` with a short, secret-free message."""

from __future__ import annotations

import http.client
import re
import socket
import ssl
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import requests
import requests.adapters
import urllib3.exceptions

from django_federation_delivery.exceptions import (
    AttemptTimeout,
    ConnectionFailed,
    InvalidURL,
    TransportError,
)

if TYPE_CHECKING:
    from django_federation_delivery.transport.guard import Attempt

# Everything up to the last "@" of the authority, "//" or not ("http:user:pw@host").
_USERINFO = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*:)?(//)?[^/?#]*@")
_CONTROL_OR_SPACE = re.compile(r"[\x00-\x20\x7f]")
_MESSAGE_URL_LENGTH = 200


def redact(url: str) -> str:
    """The URL as it may appear in a message: no userinfo, no query, one line, short."""
    text = _CONTROL_OR_SPACE.sub("", url)  # as urlsplit ignores them
    text = _USERINFO.sub(r"\1\2", text.split("?", 1)[0].split("#", 1)[0])
    text = "".join(c if c.isprintable() else "?" for c in text)
    if len(text) > _MESSAGE_URL_LENGTH:
        text = text[: _MESSAGE_URL_LENGTH - 3] + "..."
    return text


@dataclass(frozen=True)
class Target:
    display: str  # scheme://host[:port]/path: safe for messages
    scheme: str
    host: str


def check_url(url: str) -> Target:
    try:
        parts = urlsplit(url)
        port = parts.port  # raises ValueError for a bad port
    except ValueError as exc:
        raise InvalidURL(f"not a valid URL: {redact(url)!r}") from exc
    scheme = parts.scheme.lower()
    host = parts.hostname
    if scheme not in ("http", "https") or not host:
        raise InvalidURL(f"not an absolute http(s) URL with a host: {redact(url)!r}")
    netloc = f"[{host}]" if ":" in host else host
    if port is not None:
        netloc = f"{netloc}:{port}"
    return Target(display=redact(f"{scheme}://{netloc}{parts.path}"), scheme=scheme, host=host)


_REASONS: tuple[tuple[type[BaseException], str], ...] = (
    (ssl.SSLCertVerificationError, "TLS certificate not accepted"),
    (ssl.SSLError, "TLS failed"),
    (http.client.RemoteDisconnected, "connection closed without an answer"),
    (ConnectionRefusedError, "connection refused"),
    (ConnectionResetError, "connection reset"),
    (BrokenPipeError, "connection closed while sending"),
    (socket.gaierror, "could not resolve the host"),
    (http.client.IncompleteRead, "answer cut short"),
    (http.client.HTTPException, "malformed answer"),
    (requests.exceptions.ChunkedEncodingError, "answer cut short"),
    (requests.exceptions.ContentDecodingError, "answer body could not be decoded"),
    (urllib3.exceptions.DecodeError, "answer body could not be decoded"),
    (requests.exceptions.InvalidHeader, "invalid request header"),
    (UnicodeEncodeError, "request header not encodable"),
    (TimeoutError, "timed out"),
)


def _causes(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and what it wraps, outermost first: requests and urllib3 wrap errors in
    ``args``, ``reason`` and ``__cause__`` alike."""
    queue, seen = [exc], set()
    while queue:
        current = queue.pop(0)
        if id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        inner = [*current.args, getattr(current, "reason", None)]
        inner += [current.__cause__, current.__context__]
        queue.extend(e for e in inner if isinstance(e, BaseException))


def reason(exc: BaseException) -> str:
    """A short, one-line, secret-free description of a low-level error."""
    for cause in _causes(exc):
        for kind, text in _REASONS:
            if isinstance(cause, kind):
                if isinstance(cause, ssl.SSLCertVerificationError) and cause.verify_message:
                    return f"{text}: {cause.verify_message}"
                if isinstance(cause, ssl.SSLError) and cause.reason:
                    return f"{text}: {cause.reason}"
                return text
    for cause in _causes(exc):
        if isinstance(cause, OSError) and cause.strerror:
            return cause.strerror
    return "connection failed"


def translate(exc: BaseException, attempt: Attempt, target: Target, limit: float) -> TransportError:
    if attempt.expired:
        return AttemptTimeout(f"{target.display}: no complete answer within {limit:g}s")
    invalid = (
        requests.exceptions.InvalidURL,
        requests.exceptions.InvalidSchema,
        requests.exceptions.MissingSchema,
        urllib3.exceptions.LocationValueError,
        http.client.InvalidURL,
    )
    if isinstance(exc, invalid):
        return InvalidURL(f"not a usable URL: {target.display!r}")
    # Also a socket timeout requests reports as a ConnectionError (e.g. while sending).
    timeouts = (requests.exceptions.Timeout, urllib3.exceptions.TimeoutError, TimeoutError)
    if any(isinstance(cause, timeouts) for cause in _causes(exc)):
        return AttemptTimeout(f"{target.display}: timed out")
    return ConnectionFailed(f"{target.display}: {reason(exc)}")
