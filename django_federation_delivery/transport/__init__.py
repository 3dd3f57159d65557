"""One HTTP exchange: a single POST (or PUT) and what came of it.

Nothing here imports Django or touches a database. A :class:`Transport` makes
one POST at a time on a pooled ``requests`` session and returns an
:class:`Answer`, or raises one of the :class:`TransportError` subclasses; every
lower-level error (requests, urllib3, socket, ssl) is translated here.

What plain ``requests`` does not give, and this module adds:

* **Only public addresses.** The connections are made by our own urllib3
  connection class, which resolves the host itself, connects only to allowed
  addresses and checks the peer of the connected socket again before a byte is
  written. The address judged is the one actually used, so DNS rebinding (a
  public answer to a check, a private one to the connect) gains nothing.
* **A bound on open sockets.** Idle keep-alive connections are bounded for the
  whole process, across every transport, least recently used closed first
  (``idle.py``); the others are those of the attempts in flight.
* **Connections shared by threads.** The transports of a deliverer's worker
  threads draw on one set of :class:`Connections`, a pool a host: the next
  delivery to a host reuses the connection the last one left idle, whichever
  thread sends it, instead of each thread opening its own to every host.
* **A bound on the whole exchange.** Socket timeouts bound each ``recv``, not
  their sum: a server that drips one byte a second would hold a worker for
  ever. Every socket an exchange uses is registered with a watchdog thread that
  shuts it down at the attempt's deadline, which unblocks whatever is waiting
  on it; DNS and TCP connects are bounded by the time left.
* **The final answer.** http.client reads past a ``100 Continue`` alone; the
  guard's responses read past any 1xx but 101 (a ``103 Early Hints``), a
  bounded number of them, so that the status judged is the one that ends
  the exchange.
"""

from __future__ import annotations

import datetime
import email.utils
import http.client
import time
from collections.abc import Mapping
from dataclasses import dataclass
from http import HTTPStatus
from http.cookiejar import DefaultCookiePolicy
from types import TracebackType
from typing import Self

import requests
import requests.adapters
import urllib3.exceptions

from django_federation_delivery.addresses import escaped
from django_federation_delivery.exceptions import (
    AttemptTimeout,
    TransportError,
)
from django_federation_delivery.transport import logs
from django_federation_delivery.transport.failures import check_url, translate
from django_federation_delivery.transport.guard import (
    WATCHDOG,
    Exchange,
    GuardedAdapter,
    this_thread,
)
from django_federation_delivery.transport.networks import IPNetwork, is_public_address

__all__ = [
    "DEFAULT_ACCEPT",
    "LONGEST_ASKED",
    "Answer",
    "Connections",
    "Transport",
    "TransportSettings",
    "answer_text",
    "default_headers",
    "is_public_address",
    "logs",
    "parse_retry_after",
    "status_text",
]

#: What an ActivityPub inbox is asked to answer in, unless the caller says otherwise.
DEFAULT_ACCEPT = (
    "application/activity+json, "
    'application/ld+json; profile="https://www.w3.org/ns/activitystreams"'
)

#: How many per-host pools a transport keeps at least; urllib3 evicts the least
#: recently used. Their idle connections are bounded for the whole process by
#: ``max_idle_connections``, and a set of :class:`Connections` keeps as many pools.
POOLS_PER_TRANSPORT = 64

_READ_CHUNK = 64 * 1024


@dataclass(frozen=True)
class TransportSettings:
    """How a :class:`Transport` behaves; built once from the app's settings."""

    user_agent: str
    connect_timeout: float = 10.0
    #: The whole exchange: DNS, connect, TLS, sending, the answer's headers and body.
    attempt_timeout: float = 30.0
    #: At most this much of an answer's body is read; the rest is dropped.
    max_answer_bytes: int = 1 << 20
    #: Non-public networks deliveries may go to all the same (tests, intranets).
    allowed_networks: tuple[IPNetwork, ...] = ()
    #: Idle keep-alive connections kept per host.
    connections_per_host: int = 2
    #: Idle keep-alive connections kept in the whole process, across every transport;
    #: past it the least recently used are closed (see ``idle.py``).
    max_idle_connections: int = 256
    #: An idle pooled connection unused this long is closed.
    idle_timeout: float = 10.0
    verify_tls: bool = True


def default_headers(settings: TransportSettings) -> dict[str, str]:
    """What every request a transport makes carries under its caller's own
    headers (which win): one definition, for the transport and for what
    ``testing.Outgoing.headers()`` says an attempt sends.

    Replaces requests' defaults (python-requests UA, gzip): a plain body is
    all we read, and a compressed one could inflate far past
    ``max_answer_bytes``."""
    return {
        "User-Agent": settings.user_agent,
        "Accept": DEFAULT_ACCEPT,
        "Accept-Encoding": "identity",
    }


@dataclass(frozen=True)
class Answer:
    """What the inbox answered. A 3xx is an answer like any other: never followed."""

    status: int
    #: Case-insensitive.
    headers: Mapping[str, str]
    #: At most ``max_answer_bytes`` of it.
    body: bytes
    #: Seconds from the start of the exchange to the end of reading the body.
    elapsed: float


def answer_text(text: str) -> str:
    """What a receiver wrote, as an error may carry it into a row, a log and
    a terminal: one line, each run of whitespace one space, the rest
    :func:`escaped`. The receiver is a stranger, and its words may be made
    to move a cursor or reverse the text around them."""
    return escaped(" ".join(text.split()))


def status_text(status: int) -> str:
    """``404 Not Found``: the status with its standard reason phrase, or the
    number alone when it has none (a server's own phrase is never shown)."""
    try:
        return f"{status} {HTTPStatus(status).phrase}"
    except ValueError:
        return str(status)


#: The seconds a ``Retry-After`` of more than a dozen digits is read as
#: asking for: some 31,700 years, past any wait a policy keeps.
LONGEST_ASKED = 999_999_999_999.0


def parse_retry_after(
    value: str | None, *, now: float | None = None, dates: bool = True
) -> float | None:
    """Seconds to wait that a ``Retry-After`` value asks for, never below 0.

    Takes delay-seconds (``"120"``) or, unless ``dates`` is False, an
    HTTP-date (a date in the past means 0). ``None`` when the header is absent
    or not understood, including a negative number of seconds. A number of
    more digits than ``LONGEST_ASKED`` has asks for that long: longer than any
    wait, it is cut to the caller's longest like any other. ``now`` is the
    Unix time to count from.
    """
    if value is None:
        return None
    value = value.strip()
    if not value:
        return None
    if value.isdigit() and value.isascii():
        # Past 4,300 digits int() itself refuses a number, and past 308
        # float() overflows: what a dozen digits cannot say is as long.
        digits = value.lstrip("0")
        return float(int(digits or "0")) if len(digits) <= 12 else LONGEST_ASKED
    if not dates:
        return None
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    if when.tzinfo is None:  # "-0000": UTC, by RFC 5322
        when = when.replace(tzinfo=datetime.UTC)
    try:
        target = when.timestamp()
    except (OverflowError, OSError, ValueError):
        return None
    return max(0.0, target - (time.time() if now is None else now))


class Connections:
    """Keep-alive connections to any number of hosts, a pool a host, that the
    transports of several threads share (urllib3's pools are thread-safe).

    Up to ``connections_per_host`` idle connections are kept to a host and, as
    everywhere, ``max_idle_connections`` in the whole process; as many hosts'
    pools are kept, the least recently used evicted past that."""

    def __init__(self, settings: TransportSettings) -> None:
        self.adapter = GuardedAdapter(
            pool_connections=max(POOLS_PER_TRANSPORT, settings.max_idle_connections),
            pool_maxsize=settings.connections_per_host,
            max_retries=0,
            pool_block=False,
            max_idle=settings.max_idle_connections,
        )

    def close(self) -> None:
        """Close every idle connection; those in use are closed when put back.
        The connections may still be used afterwards."""
        self.adapter.close()
        self.adapter.poolmanager.forget()


class _Unredirected(requests.Session):
    """A session that never reads a redirect: a 3xx is an answer like any
    other. Without ``allow_redirects``, ``requests`` still prepares the
    request a redirect would make (``Response.next``), reading the answer's
    body whole, past the size its reading is bound to (a gzip bomb on a
    302), and parsing its ``Location``, raising on one that does not parse,
    before the answer comes back."""

    def get_redirect_target(self, resp: requests.Response) -> str | None:
        return None


class Transport:
    """One per thread: a requests.Session of its own, not thread-safe by design,
    over connections of its own or ``connections`` shared with other threads."""

    def __init__(self, settings: TransportSettings, connections: Connections | None = None) -> None:
        self.settings = settings
        session = _Unredirected()
        # No proxies, .netrc or CA bundle from the environment: what is sent where must
        # not depend on the worker's shell.
        session.trust_env = False
        # Nor cookies: an inbox's Set-Cookie must not follow later deliveries around.
        session.cookies.set_policy(DefaultCookiePolicy(allowed_domains=[]))
        session.headers = requests.structures.CaseInsensitiveDict(default_headers(settings))
        #: Closed with the transport when they are its own.
        self._own = connections is None
        self._connections = connections or Connections(settings)
        self._adapter = self._connections.adapter
        session.mount("http://", self._adapter)
        session.mount("https://", self._adapter)
        self._session = session

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def post(
        self,
        url: str,
        body: bytes,
        headers: Mapping[str, str],
        *,
        deadline: float | None = None,
        method: str = "POST",
    ) -> Answer:
        """POST ``body`` to ``url`` with ``headers`` (sent as given, Host included),
        or send it with another ``method`` (PUT, for a Matrix message).

        Over within ``attempt_timeout``, and by ``deadline`` (a ``time.monotonic()``
        value) when that is sooner: one deadline shared by the requests of one
        delivery attempt. Returns whatever status came back, redirects included.
        Raises ``InvalidURL``, ``RefusedAddress``, ``AttemptTimeout`` (at once,
        without a connection, when the deadline has passed) or ``ConnectionFailed``.
        """
        target = check_url(url)
        settings = self.settings
        start = time.monotonic()
        ends = start + settings.attempt_timeout
        if deadline is not None and deadline < ends:
            ends = deadline
        # For messages: the time this request had, to a tenth of a second.
        limit = max(0.1, round(ends - start, 1))
        if ends <= start:
            raise AttemptTimeout(f"{target.display}: no time left for the request")
        pools = self._adapter.poolmanager
        # Each look reads every pool: among many threads, not at every request.
        pools.drop_idle(settings.idle_timeout, every=min(1.0, settings.idle_timeout / 4))
        exchange = Exchange(ends, settings.allowed_networks)
        WATCHDOG.start(exchange)
        this_thread.exchange = exchange
        response: requests.Response | None = None
        try:
            # The session's headers under the caller's, prepared here: what
            # Session.request adds besides (cookies, .netrc, environment) is
            # nothing for this session, and merging it cost about 0.06 ms a request.
            sent = requests.structures.CaseInsensitiveDict(self._session.headers)
            sent.update(headers)
            response = self._session.send(
                requests.Request(method, url, data=body, headers=sent).prepare(),
                allow_redirects=False,
                stream=True,
                verify=settings.verify_tls,
                # Per connect and per recv; the watchdog bounds their sum.
                timeout=(min(settings.connect_timeout, ends - start), ends - start),
            )
            content = _read_at_most(response, settings.max_answer_bytes)
        except TransportError as exc:
            if exchange.expired and not isinstance(exc, AttemptTimeout):
                raise translate(exc, expired=True, target=target, limit=limit) from exc
            raise
        except (
            requests.exceptions.RequestException,
            urllib3.exceptions.HTTPError,
            http.client.HTTPException,
            OSError,
            UnicodeEncodeError,  # a header value http.client cannot send as Latin-1
        ) as exc:
            # The socket's own timeout may fire at the deadline just before the watchdog does.
            expired = exchange.expired or time.monotonic() >= ends
            raise translate(exc, expired=expired, target=target, limit=limit) from exc
        finally:
            if response is not None:
                # Unread data left: this closes the connection instead of pooling it.
                response.close()
            this_thread.exchange = None
            WATCHDOG.finish(exchange)
            key = pools.current
            pools.touch()
            if exchange.expired and key is not None:
                # The socket was shut down under it: no connection to that host is trusted.
                pools.drop(key)
        if exchange.expired:
            # Late, if only just: a close-delimited body may have been cut short silently.
            raise AttemptTimeout(f"{target.display}: no complete answer within {limit:g}s")
        return Answer(
            status=response.status_code,
            headers=response.headers,
            body=content,
            elapsed=time.monotonic() - start,
        )

    def close_idle(self) -> None:
        """Close the pools of hosts not used for ``idle_timeout``; call it while idle."""
        self._adapter.poolmanager.drop_idle(self.settings.idle_timeout)

    def close(self) -> None:
        """Close every pooled connection of its own; shared ones are closed by
        their owner. The transport may still be used afterwards."""
        if self._own:
            self._connections.close()


def _read_at_most(response: requests.Response, limit: int) -> bytes:
    """Up to ``limit`` bytes of the body, decoded as its ``Content-Encoding``
    says (urllib3 inflates no more than is asked of it at a time); what
    cannot be decoded ends it, and the status stands."""
    if limit <= 0:
        return b""
    body = bytearray()
    try:
        for chunk in response.iter_content(chunk_size=min(limit, _READ_CHUNK)):
            body += chunk
            if len(body) >= limit:
                break  # the rest stays unread; closing the response discards the connection
    except requests.exceptions.ContentDecodingError:
        # Identity was asked for: a body its encoding does not fit (a plain
        # one said to be gzip) is the server's mistake, and the status is its
        # answer all the same. What is left unread closes the connection.
        pass
    return bytes(body[:limit])
