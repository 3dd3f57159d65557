"""One delivery attempt over HTTP: a single signed POST and what came of it.

Nothing here imports Django or touches a database. A :class:`Transport` makes
one POST at a time on a pooled ``requests`` session and returns an
:class:`Answer`, or raises one of the :class:`TransportError` subclasses; every
lower-level error (requests, urllib3, socket, ssl) is translated here.

Two guarantees need more than plain ``requests``:

* **Only public addresses.** The connections are made by our own urllib3
  connection class, which resolves the host itself, connects only to allowed
  addresses and checks the peer of the connected socket again before a byte is
  written. The address judged is the one actually used, so DNS rebinding (a
  public answer to a check, a private one to the connect) gains nothing.
* **A bound on the whole attempt.** Socket timeouts bound each ``recv``, not
  their sum: a server that drips one byte a second would hold a worker for
  ever. Every socket an attempt uses is registered with a watchdog thread that
  shuts it down at the attempt's deadline, which unblocks whatever is waiting
  on it; DNS and TCP connects are bounded by the time left.
"""

from __future__ import annotations

import contextlib
import datetime
import email.utils
import http.client
import ipaddress
import os
import re
import socket
import ssl
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from http.cookiejar import DefaultCookiePolicy
from types import TracebackType
from typing import Any, Self
from urllib.parse import urlsplit

import requests
import requests.adapters
import urllib3.exceptions
from urllib3.connection import HTTPConnection, HTTPSConnection
from urllib3.connectionpool import HTTPConnectionPool, HTTPSConnectionPool
from urllib3.poolmanager import PoolKey, PoolManager
from urllib3.util.connection import allowed_gai_family

from django_federation_delivery.exceptions import (
    AttemptTimeout,
    ConnectionFailed,
    InvalidURL,
    RefusedAddress,
    TransportError,
)

__all__ = [
    "DEFAULT_ACCEPT",
    "Answer",
    "Transport",
    "TransportSettings",
    "is_public_address",
    "parse_retry_after",
]

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

#: What an ActivityPub inbox is asked to answer in, unless the caller says otherwise.
DEFAULT_ACCEPT = (
    "application/activity+json, "
    'application/ld+json; profile="https://www.w3.org/ns/activitystreams"'
)

#: How many per-host pools a transport keeps; urllib3 evicts the least recently used.
POOLS_PER_TRANSPORT = 64

_READ_CHUNK = 64 * 1024
_NAT64 = ipaddress.ip_network("64:ff9b::/96")


@dataclass(frozen=True)
class TransportSettings:
    """How a :class:`Transport` behaves; built once from the app's settings."""

    user_agent: str
    connect_timeout: float = 10.0
    #: The whole attempt: DNS, connect, TLS, sending, the answer's headers and body.
    attempt_timeout: float = 30.0
    #: At most this much of an answer's body is read; the rest is dropped.
    max_answer_bytes: int = 1 << 20
    #: Non-public networks deliveries may go to all the same (tests, intranets).
    allowed_networks: tuple[IPNetwork, ...] = ()
    #: Idle keep-alive connections kept per host.
    connections_per_host: int = 2
    #: An idle pooled connection unused this long is closed.
    idle_timeout: float = 10.0
    verify_tls: bool = True


@dataclass(frozen=True)
class Answer:
    """What the inbox answered. A 3xx is an answer like any other: never followed."""

    status: int
    #: Case-insensitive.
    headers: Mapping[str, str]
    #: At most ``max_answer_bytes`` of it.
    body: bytes
    #: Seconds from the start of the attempt to the end of reading the body.
    elapsed: float


# --- Addresses -------------------------------------------------------------------------------


def _parse_ip(address: str) -> IPAddress | None:
    try:
        # getaddrinfo and getpeername may add an IPv6 zone ("fe80::1%eth0").
        return ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return None


def _embedded_ipv4(ip: IPAddress) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 one leads to, where the prefix says it does."""
    if not isinstance(ip, ipaddress.IPv6Address):
        return None
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    if ip.sixtofour is not None:
        return ip.sixtofour
    if ip.teredo is not None:
        return ip.teredo[1]
    if ip in _NAT64:
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return None


def _is_public(ip: IPAddress) -> bool:
    embedded = _embedded_ipv4(ip)
    if embedded is not None and not _is_public(embedded):
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        # ::ffff:0:0/96 is "private" as a block, but only says "this IPv4 address".
        return embedded is not None
    return ip.is_global and not (
        ip.is_multicast
        or ip.is_private
        or ip.is_loopback
        or ip.is_link_local
        or ip.is_reserved
        or ip.is_unspecified
        or (isinstance(ip, ipaddress.IPv6Address) and ip.is_site_local)
    )


def is_public_address(address: str) -> bool:
    """Whether ``address`` (an IP literal) is a public unicast address.

    Loopback, RFC 1918, link-local, CGNAT, unique-local, unspecified,
    multicast, reserved and documentation addresses are not; nor is an IPv6
    address that embeds one of those (IPv4-mapped, 6to4, Teredo, NAT64). A
    string that is not an IP address is not.
    """
    ip = _parse_ip(address)
    return ip is not None and _is_public(ip)


def _allowed(ip: IPAddress, networks: tuple[IPNetwork, ...]) -> bool:
    if _is_public(ip):
        return True
    embedded = _embedded_ipv4(ip)
    return any(ip in net or (embedded is not None and embedded in net) for net in networks)


# --- Retry-After -------------------------------------------------------------------------------


def parse_retry_after(value: str | None, *, now: float | None = None) -> float | None:
    """Seconds to wait that a ``Retry-After`` value asks for, never below 0.

    Takes delay-seconds (``"120"``) or an HTTP-date (a date in the past means
    0). ``None`` when the header is absent or not understood, including a
    negative number of seconds. ``now`` is the Unix time to count from.
    """
    if value is None:
        return None
    value = value.strip()
    if not value:
        return None
    if value.isdigit() and value.isascii():
        seconds = int(value)
        # float() of a thousand-digit number overflows; nobody means it.
        return float(seconds) if seconds < 10**12 else None
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


# --- URLs in messages --------------------------------------------------------------------------

# Everything up to the last "@" of the authority, "//" or not ("http:user:pw@host").
_USERINFO = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*:)?(//)?[^/?#]*@")
_CONTROL_OR_SPACE = re.compile(r"[\x00-\x20\x7f]")
_MESSAGE_URL_LENGTH = 200


def _redact(url: str) -> str:
    """The URL as it may appear in a message: no userinfo, no query, one line, short."""
    text = _CONTROL_OR_SPACE.sub("", url)  # as urlsplit ignores them
    text = _USERINFO.sub(r"\1\2", text.split("?", 1)[0].split("#", 1)[0])
    text = "".join(c if c.isprintable() else "?" for c in text)
    if len(text) > _MESSAGE_URL_LENGTH:
        text = text[: _MESSAGE_URL_LENGTH - 3] + "..."
    return text


@dataclass(frozen=True)
class _Target:
    display: str  # scheme://host[:port]/path: safe for messages
    scheme: str
    host: str


def _check_url(url: str) -> _Target:
    try:
        parts = urlsplit(url)
        port = parts.port  # raises ValueError for a bad port
    except ValueError as exc:
        raise InvalidURL(f"not a valid URL: {_redact(url)!r}") from exc
    scheme = parts.scheme.lower()
    host = parts.hostname
    if scheme not in ("http", "https") or not host:
        raise InvalidURL(f"not an absolute http(s) URL with a host: {_redact(url)!r}")
    netloc = f"[{host}]" if ":" in host else host
    if port is not None:
        netloc = f"{netloc}:{port}"
    return _Target(display=_redact(f"{scheme}://{netloc}{parts.path}"), scheme=scheme, host=host)


# --- The attempt and its watchdog -------------------------------------------------------------


@dataclass(eq=False)
class _Attempt:
    """One ``post``: its deadline, where it may connect, and the sockets it uses."""

    deadline: float
    allowed_networks: tuple[IPNetwork, ...]
    # Duplicates of the attempt's socket descriptors, owned by the watchdog: shutting one down
    # shuts the shared socket down, and as only we close them, a descriptor number can never
    # have been reused for something else when the watchdog acts.
    sockets: list[socket.socket] = field(default_factory=list)
    expired: bool = False

    def remaining(self) -> float:
        return self.deadline - time.monotonic()


class _Watchdog:
    """One daemon thread for the process that shuts down the sockets of late attempts."""

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self._cond = threading.Condition()
        self._active: set[_Attempt] = set()
        self._thread: threading.Thread | None = None
        #: When the thread wakes next on its own (None: only when notified).
        self._wakes_at: float | None = None

    def start(self, attempt: _Attempt) -> None:
        with self._cond:
            self._active.add(attempt)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="federation-delivery-watchdog", daemon=True
                )
                self._thread.start()
            # Attempts share one timeout, so a new deadline is rarely the
            # earliest: wake the thread only when it is.
            if self._wakes_at is None or attempt.deadline < self._wakes_at:
                self._cond.notify()

    def register(self, attempt: _Attempt, sock: socket.socket) -> bool:
        """Watch ``sock`` for ``attempt``; ``False`` if the attempt is already late."""
        with self._cond:
            if attempt.expired or attempt not in self._active:
                return False
            attempt.sockets.append(
                socket.socket(sock.family, sock.type, sock.proto, os.dup(sock.fileno()))
            )
            return True

    def finish(self, attempt: _Attempt) -> None:
        with self._cond:
            self._active.discard(attempt)
            sockets, attempt.sockets = attempt.sockets, []
        for dup in sockets:
            dup.close()

    def _run(self) -> None:
        with self._cond:
            while True:
                now = time.monotonic()
                late = [a for a in self._active if a.deadline <= now]
                for attempt in late:
                    self._active.discard(attempt)
                    attempt.expired = True
                    for dup in attempt.sockets:
                        # OSError: already closed by the peer, so nothing is blocked on it.
                        with contextlib.suppress(OSError):
                            dup.shutdown(socket.SHUT_RDWR)
                self._wakes_at = min((a.deadline for a in self._active), default=None)
                self._cond.wait(None if self._wakes_at is None else self._wakes_at - now)


_WATCHDOG = _Watchdog()
# The thread does not survive a fork, and its lock may have been held when it happened.
os.register_at_fork(after_in_child=_WATCHDOG._reset)

_local = threading.local()


def _current_attempt() -> _Attempt:
    attempt: _Attempt | None = getattr(_local, "attempt", None)
    if attempt is None:
        # Only Transport.post opens connections; anything else is a bug, and must not
        # get past the address check by accident.
        raise RuntimeError("a federation delivery connection was used outside Transport.post")
    return attempt


# --- Connections that check where they go ------------------------------------------------------


def _resolve(host: str, port: int, timeout: float) -> list[tuple[Any, ...]]:
    """getaddrinfo, bounded: it cannot be interrupted, so a slow lookup runs in a thread."""
    family = allowed_gai_family()
    if _parse_ip(host) is not None:
        try:
            return socket.getaddrinfo(
                host, port, family, socket.SOCK_STREAM, 0, socket.AI_NUMERICHOST
            )
        except OSError as exc:
            raise ConnectionFailed(f"cannot connect to {host}") from exc
    results: list[tuple[Any, ...]] = []
    errors: list[BaseException] = []
    done = threading.Event()

    def lookup() -> None:
        try:
            results.extend(socket.getaddrinfo(host, port, family, socket.SOCK_STREAM))
        except Exception as exc:
            errors.append(exc)
        finally:
            done.set()

    threading.Thread(target=lookup, name="federation-delivery-dns", daemon=True).start()
    if not done.wait(max(timeout, 0.0)):
        raise AttemptTimeout(f"timed out resolving {host}")
    if errors:
        raise ConnectionFailed(f"could not resolve {host}") from errors[0]
    return results


class _GuardedHTTPConnection(HTTPConnection):
    """Connects only to allowed addresses, and only within the attempt's time."""

    # The attempt this connection's socket is registered with, if any.
    _watched_by: _Attempt | None = None

    def _new_conn(self) -> socket.socket:
        attempt = _current_attempt()
        host = self._dns_host.strip("[]")
        port = self.port
        limit = self.timeout if isinstance(self.timeout, int | float) else None
        where = f"{host}:{port}"

        remaining = attempt.remaining()
        infos = _resolve(host, port, remaining if limit is None else min(limit, remaining))
        usable = [info for info in infos if self._allowed(info[4][0], attempt)]
        if not usable:
            addresses = ", ".join(dict.fromkeys(str(info[4][0]) for info in infos))
            raise RefusedAddress(
                f"refused to connect to {host} ({addresses}): not a public address"
            )

        error: OSError | None = None
        for family, type_, proto, _name, sockaddr in usable:
            remaining = attempt.remaining()
            if remaining <= 0:
                break
            sock = socket.socket(family, type_, proto)
            try:
                for option in self.socket_options or ():
                    sock.setsockopt(*option)
                sock.settimeout(min(limit, remaining) if limit is not None else remaining)
                if self.source_address:
                    sock.bind(self.source_address)
                sock.connect(sockaddr)
                # Judge the peer of the connected socket too, before anything is written.
                peer = sock.getpeername()[0]
                if not self._allowed(peer, attempt):
                    raise RefusedAddress(
                        f"refused to connect to {host} ({peer}): not a public address"
                    )
                if not _WATCHDOG.register(attempt, sock):
                    raise AttemptTimeout(f"timed out connecting to {where}")
            except OSError as exc:
                sock.close()
                error = exc
                continue
            except BaseException:
                sock.close()
                raise
            self._watched_by = attempt
            sys.audit("http.client.connect", self, self.host, self.port)
            return sock

        if error is None or isinstance(error, TimeoutError):
            raise AttemptTimeout(f"timed out connecting to {where}") from error
        raise ConnectionFailed(f"could not connect to {where}: {_reason(error)}") from error

    @staticmethod
    def _allowed(address: str, attempt: _Attempt) -> bool:
        ip = _parse_ip(address)
        return ip is not None and _allowed(ip, attempt.allowed_networks)

    def putrequest(
        self,
        method: str,
        url: str,
        skip_host: bool = False,
        skip_accept_encoding: bool = False,
    ) -> None:
        # A pooled connection's socket is watched for this attempt too. (A new one was
        # registered by _new_conn; over plain HTTP it is only connected later, on send.)
        attempt = _current_attempt()
        if self.sock is not None and self._watched_by is not attempt:
            if not _WATCHDOG.register(attempt, self.sock):
                raise AttemptTimeout("timed out before sending")
            self._watched_by = attempt
        super().putrequest(
            method, url, skip_host=skip_host, skip_accept_encoding=skip_accept_encoding
        )

    def close(self) -> None:
        self._watched_by = None
        super().close()


class _GuardedHTTPSConnection(_GuardedHTTPConnection, HTTPSConnection):
    """The same, for TLS: the socket is checked and watched before the handshake."""


class _GuardedHTTPConnectionPool(HTTPConnectionPool):
    ConnectionCls = _GuardedHTTPConnection


class _GuardedHTTPSConnectionPool(HTTPSConnectionPool):
    ConnectionCls = _GuardedHTTPSConnection


class _PoolManager(PoolManager):
    """Guarded pools, and when each was last used, so idle ones can be closed."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.pool_classes_by_scheme = {
            "http": _GuardedHTTPConnectionPool,
            "https": _GuardedHTTPSConnectionPool,
        }
        self.last_used: dict[PoolKey, float] = {}
        self.current: PoolKey | None = None

    def connection_from_pool_key(
        self, pool_key: PoolKey, request_context: dict[str, Any]
    ) -> HTTPConnectionPool:
        self.current = pool_key
        self.last_used[pool_key] = time.monotonic()
        return super().connection_from_pool_key(pool_key, request_context)

    def touch(self) -> None:
        if self.current is not None:
            self.last_used[self.current] = time.monotonic()
            self.current = None

    def drop(self, key: PoolKey) -> None:
        """Close the pool for ``key`` and every idle connection in it."""
        self.last_used.pop(key, None)
        with contextlib.suppress(KeyError):  # already evicted
            del self.pools[key]  # disposing of a pool closes it

    def drop_idle(self, idle_timeout: float) -> None:
        cutoff = time.monotonic() - idle_timeout
        for key in [k for k, used in self.last_used.items() if used <= cutoff]:
            self.drop(key)


class _Adapter(requests.adapters.HTTPAdapter):
    poolmanager: _PoolManager

    def init_poolmanager(
        self, connections: int, maxsize: int, block: bool = False, **pool_kwargs: Any
    ) -> None:
        self._pool_connections = connections
        self._pool_maxsize = maxsize
        self._pool_block = block
        self.poolmanager = _PoolManager(
            num_pools=connections, maxsize=maxsize, block=block, **pool_kwargs
        )

    def proxy_manager_for(self, proxy: str, **proxy_kwargs: Any) -> Any:
        # Through a proxy, the address checked would be the proxy's, not the inbox's.
        raise ConnectionFailed("proxies are not supported")


# --- Errors ------------------------------------------------------------------------------------

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


def _reason(exc: BaseException) -> str:
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


def _translate(
    exc: BaseException, attempt: _Attempt, target: _Target, limit: float
) -> TransportError:
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
    return ConnectionFailed(f"{target.display}: {_reason(exc)}")


# --- The transport -----------------------------------------------------------------------------


class Transport:
    """One per worker thread: owns a pooled requests.Session. Not thread-safe by design."""

    def __init__(self, settings: TransportSettings) -> None:
        self.settings = settings
        session = requests.Session()
        # No proxies, .netrc or CA bundle from the environment: what is sent where must
        # not depend on the worker's shell.
        session.trust_env = False
        # Nor cookies: an inbox's Set-Cookie must not follow later deliveries around.
        session.cookies.set_policy(DefaultCookiePolicy(allowed_domains=[]))
        # Replaces requests' defaults (python-requests UA, gzip): a plain body is all we
        # read, and a compressed one could inflate far past max_answer_bytes.
        session.headers = requests.structures.CaseInsensitiveDict(
            {
                "User-Agent": settings.user_agent,
                "Accept": DEFAULT_ACCEPT,
                "Accept-Encoding": "identity",
            }
        )
        self._adapter = _Adapter(
            pool_connections=POOLS_PER_TRANSPORT,
            pool_maxsize=settings.connections_per_host,
            max_retries=0,
            pool_block=False,
        )
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

    def post(self, url: str, body: bytes, headers: Mapping[str, str]) -> Answer:
        """POST ``body`` to ``url`` with ``headers`` (sent as given, Host included).

        Returns whatever status came back, redirects included. Raises
        ``InvalidURL``, ``RefusedAddress``, ``AttemptTimeout`` or
        ``ConnectionFailed``.
        """
        target = _check_url(url)
        self.close_idle()
        settings = self.settings
        pools = self._adapter.poolmanager
        start = time.monotonic()
        attempt = _Attempt(start + settings.attempt_timeout, settings.allowed_networks)
        _WATCHDOG.start(attempt)
        _local.attempt = attempt
        response: requests.Response | None = None
        try:
            response = self._session.post(
                url,
                data=body,
                headers=dict(headers),
                allow_redirects=False,
                stream=True,
                verify=settings.verify_tls,
                # Per connect and per recv; the watchdog bounds their sum.
                timeout=(
                    min(settings.connect_timeout, settings.attempt_timeout),
                    settings.attempt_timeout,
                ),
            )
            content = _read_at_most(response, settings.max_answer_bytes)
        except TransportError as exc:
            if attempt.expired and not isinstance(exc, AttemptTimeout):
                raise _translate(exc, attempt, target, settings.attempt_timeout) from exc
            raise
        except (
            requests.exceptions.RequestException,
            urllib3.exceptions.HTTPError,
            http.client.HTTPException,
            OSError,
            UnicodeEncodeError,  # a header value http.client cannot send as Latin-1
        ) as exc:
            raise _translate(exc, attempt, target, settings.attempt_timeout) from exc
        finally:
            if response is not None:
                # Unread data left: this closes the connection instead of pooling it.
                response.close()
            _local.attempt = None
            _WATCHDOG.finish(attempt)
            key = pools.current
            pools.touch()
            if attempt.expired and key is not None:
                # The socket was shut down under it: no connection to that host is trusted.
                pools.drop(key)
        if attempt.expired:
            # Late, if only just: a close-delimited body may have been cut short silently.
            raise AttemptTimeout(
                f"{target.display}: no complete answer within {settings.attempt_timeout:g}s"
            )
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
        """Close every pooled connection. The transport may still be used afterwards."""
        self._session.close()
        self._adapter.poolmanager.last_used.clear()


def _read_at_most(response: requests.Response, limit: int) -> bytes:
    if limit <= 0:
        return b""
    body = bytearray()
    for chunk in response.iter_content(chunk_size=min(limit, _READ_CHUNK)):
        body += chunk
        if len(body) >= limit:
            break  # the rest stays unread; closing the response discards the connection
    return bytes(body[:limit])
