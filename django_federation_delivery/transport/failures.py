"""What went wrong, as a :class:`TransportError` with a short, secret-free message."""

from __future__ import annotations

import http.client
import socket
import ssl
from collections.abc import Iterator
from dataclasses import dataclass

import requests
import requests.adapters
import urllib3.exceptions

from django_federation_delivery import addresses
from django_federation_delivery.addresses import redact
from django_federation_delivery.exceptions import (
    AttemptTimeout,
    ConnectionFailed,
    InvalidURL,
    TransportError,
)

__all__ = ["Target", "TooManyInterimAnswers", "check_url", "reason", "redact", "translate"]


@dataclass(frozen=True)
class Target:
    display: str  # scheme://host[:port]/path: safe for messages
    scheme: str
    host: str


def check_url(url: str) -> Target:
    try:
        parts = addresses.split(url, userinfo=True)
    except addresses.UnusableURL as exc:
        raise InvalidURL(f"not a usable URL: '{exc.redacted}' {exc.reason}") from None
    return Target(display=redact(parts.origin + parts.path), scheme=parts.scheme, host=parts.host)


class TooManyInterimAnswers(http.client.HTTPException):
    """A server sent interim (1xx) answers past the number read past
    (``guard.MAX_INTERIM_ANSWERS``), and no final one."""


_MALFORMED = "malformed answer"

_REASONS: tuple[tuple[type[BaseException], str], ...] = (
    (ssl.SSLCertVerificationError, "TLS certificate not accepted"),
    (ssl.SSLError, "TLS failed"),
    (http.client.RemoteDisconnected, "connection closed without an answer"),
    (ConnectionRefusedError, "connection refused"),
    (ConnectionResetError, "connection reset"),
    (BrokenPipeError, "connection closed while sending"),
    (socket.gaierror, "could not resolve the host"),
    (http.client.IncompleteRead, "answer cut short"),
    (TooManyInterimAnswers, "too many interim (1xx) answers"),
    (http.client.HTTPException, _MALFORMED),
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


#: What urllib3 finds wrong in an answer's headers (two Content-Length
#: values that differ), which requests raises as the ``InvalidHeader`` it
#: also raises for a header of ours it will not send.
_ANSWER_HEADER_FAULTS = (urllib3.exceptions.InvalidHeader,)


def reason(exc: BaseException) -> str:
    """A short, one-line, secret-free description of a low-level error."""
    causes = list(_causes(exc))
    if any(isinstance(cause, _ANSWER_HEADER_FAULTS) for cause in causes):
        return _MALFORMED
    for cause in causes:
        for kind, text in _REASONS:
            if isinstance(cause, kind):
                if isinstance(cause, ssl.SSLCertVerificationError) and cause.verify_message:
                    return f"{text}: {cause.verify_message}"
                if isinstance(cause, ssl.SSLError) and cause.reason:
                    return f"{text}: {cause.reason}"
                return text
    for cause in causes:
        if isinstance(cause, OSError) and cause.strerror:
            return cause.strerror
    return "connection failed"


def translate(exc: BaseException, *, expired: bool, target: Target, limit: float) -> TransportError:
    """``exc`` as the error the transport raises; ``expired``: the attempt's
    time limit cut it short."""
    if expired:
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
