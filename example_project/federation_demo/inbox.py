"""Local inbox servers for the demo, which check signatures as a real inbox would.

Each :class:`InboxServer` is a stdlib ``ThreadingHTTPServer`` on a loopback
address, serving in a thread of its own. For every POST it checks the
draft-cavage ``Signature`` (with pyhttpsig, against the public key the key id
names) and the ``Digest`` of the body, answers 401 when either is wrong, and
otherwise answers as its :class:`Behaviour` says.
"""

from __future__ import annotations

import base64
import collections
import dataclasses
import enum
import hashlib
import threading
import time
from collections.abc import Callable
from email.utils import parsedate_to_datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from httpsig import HeaderVerifier
from httpsig.utils import parse_signature_header

#: What every signature must cover for the inbox to trust the request.
REQUIRED_HEADERS = ["(request-target)", "host", "date", "digest"]
#: How far the signed Date may be from the inbox's clock.
MAX_SKEW_SECONDS = 300


#: How many requests a server that is down for a while refuses: more than a
#: breaker's threshold, so that the demo shows one open, hold and close.
DOWN_FOR = 12


class Behaviour(enum.StrEnum):
    """How an inbox answers a request whose signature verified."""

    #: 202 Accepted.
    ACCEPT = "accept"
    #: Down for a while: 503 with ``Retry-After: 1`` to its first
    #: ``DOWN_FOR`` requests, then 202.
    UNAVAILABLE_ONCE = "unavailable-once"
    #: 410 Gone: the inbox will never take anything again.
    GONE = "gone"
    #: 400 Bad Request, always.
    BAD_REQUEST = "bad-request"


def check_request(
    method: str,
    path: str,
    headers: dict[str, str],
    body: bytes,
    public_key: Callable[[str], str | None],
    host: str | None = None,
) -> str | None:
    """Why the request is not properly signed, or None when it is; ``public_key``
    gives a key id's public key PEM, or None for a key it does not know."""
    lower = {name.lower(): value for name, value in headers.items()}
    signature = lower.get("signature")
    if "signature-input" in lower:
        return "an RFC 9421 signature: this inbox checks draft-cavage ones only"
    if not signature:
        return "no draft-cavage Signature header"
    # pyhttpsig's dict lowercases its keys, and only [] lowercases the name asked for.
    key_id = parse_signature_header(signature).get("keyid")
    if not key_id:
        return "the Signature has no keyId"
    pem = public_key(key_id)
    if pem is None:
        return f"unknown key {key_id}"
    if host is not None and lower.get("host") != host:
        return f"Host {lower.get('host')!r} is not this server ({host})"
    problem = _check_digest(lower.get("digest", ""), body) or _check_date(lower.get("date", ""))
    if problem:
        return problem
    try:
        verifier = HeaderVerifier(
            headers=lower,
            secret=pem,
            required_headers=REQUIRED_HEADERS,
            method=method,
            path=path,
            sign_header="signature",
        )
        valid = verifier.verify()
    except Exception as exc:  # pyhttpsig raises plain Exceptions for bad input
        return f"the signature cannot be checked: {exc}"
    return None if valid else "the signature does not verify"


def _check_digest(digest: str, body: bytes) -> str | None:
    expected = base64.b64encode(hashlib.sha256(body).digest()).decode("ascii")
    for item in digest.split(","):
        algorithm, _, value = item.strip().partition("=")
        if algorithm.lower() == "sha-256":
            return None if value == expected else "the Digest does not match the body"
    return "no SHA-256 Digest header"


def _check_date(date: str) -> str | None:
    try:
        signed = parsedate_to_datetime(date).timestamp()
    except (TypeError, ValueError):
        return f"the Date {date!r} cannot be read"
    if abs(time.time() - signed) > MAX_SKEW_SECONDS:
        return f"the Date {date!r} is too far from now"
    return None


@dataclasses.dataclass
class InboxStats:
    """What one server saw, counted under its lock."""

    received: int = 0
    verified: int = 0
    answers: collections.Counter[int] = dataclasses.field(default_factory=collections.Counter)
    #: Why signatures were refused, and how often.
    refusals: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)


class InboxServer:
    """An inbox server on ``host``, on a free port, until :meth:`stop`, which
    knows the senders' public keys ``public_keys`` (by key id)."""

    def __init__(
        self, host: str, public_keys: dict[str, str], behaviour: Behaviour = Behaviour.ACCEPT
    ) -> None:
        self.behaviour = behaviour
        # A copy: a real server fetches a key once and keeps it, and the
        # request threads never touch the database.
        self._public_keys = dict(public_keys)
        self.stats = InboxStats()
        self._lock = threading.Lock()
        self._seen: set[str] = set()
        self._httpd = ThreadingHTTPServer((host, 0), _Handler)
        self._httpd.inbox = self  # type: ignore[attr-defined]
        self.host = host
        self.port: int = self._httpd.server_address[1]
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, name=f"inbox-{host}:{self.port}", daemon=True
        )
        self._thread.start()

    @property
    def netloc(self) -> str:
        return f"{self.host}:{self.port}"

    def url(self, path: str) -> str:
        return f"http://{self.netloc}{path}"

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    def answer(self, method: str, path: str, headers: dict[str, str], body: bytes) -> int:
        """The status to answer a POST with, counting what came in."""
        problem = check_request(
            method, path, headers, body, self._public_keys.get, host=self.netloc
        )
        with self._lock:
            self.stats.received += 1
            if problem is not None:
                self.stats.refusals[problem] += 1
                status = 401
            else:
                self.stats.verified += 1
                status = self._status_for(path)
            self.stats.answers[status] += 1
        return status

    def _status_for(self, path: str) -> int:
        if self.behaviour is Behaviour.GONE:
            return 410
        if self.behaviour is Behaviour.BAD_REQUEST:
            return 400
        if self.behaviour is Behaviour.UNAVAILABLE_ONCE and len(self._seen) < DOWN_FOR:
            self._seen.add(len(self._seen))
            return 503
        return 202


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as a real inbox would
    timeout = 30
    server: Any

    def do_POST(self) -> None:
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            self._reply(411)
            return
        body = self.rfile.read(int(length))
        status = self.server.inbox.answer("POST", self.path, dict(self.headers.items()), body)
        self._reply(status)

    def _reply(self, status: int) -> None:
        self.send_response(status)
        if status == 503:
            self.send_header("Retry-After", "1")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        pass  # the demo reports the counts instead
