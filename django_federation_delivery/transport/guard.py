"""Connections that go only where they may, and only for as long as an exchange may last.

Each ``Transport.post`` is an :class:`Exchange`. Its connections resolve the host
themselves, connect only to allowed addresses, check the connected peer again, and
register their sockets with the watchdog, which shuts them down at the deadline.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import requests
import requests.adapters
from urllib3.connection import HTTPConnection, HTTPSConnection
from urllib3.connectionpool import HTTPConnectionPool, HTTPSConnectionPool
from urllib3.poolmanager import PoolKey, PoolManager
from urllib3.util.connection import allowed_gai_family

from django_federation_delivery.exceptions import (
    AttemptTimeout,
    ConnectionFailed,
    RefusedAddress,
)
from django_federation_delivery.transport.failures import TooManyInterimAnswers, reason
from django_federation_delivery.transport.idle import IDLE
from django_federation_delivery.transport.networks import IPNetwork, allowed, parse_ip

if TYPE_CHECKING:
    from urllib3._base_connection import BaseHTTPConnection


@dataclass(eq=False)
class Exchange:
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
        self._active: set[Exchange] = set()
        self._thread: threading.Thread | None = None
        #: When the thread wakes next on its own (None: only when notified).
        self._wakes_at: float | None = None

    def start(self, exchange: Exchange) -> None:
        with self._cond:
            self._active.add(exchange)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="federation-delivery-watchdog", daemon=True
                )
                self._thread.start()
            # Attempts share one timeout, so a new deadline is rarely the
            # earliest: wake the thread only when it is.
            if self._wakes_at is None or exchange.deadline < self._wakes_at:
                self._cond.notify()

    def register(self, exchange: Exchange, sock: socket.socket) -> socket.socket | None:
        """Watch ``sock`` for ``exchange``: the duplicate watched, or None if
        the exchange is already late."""
        with self._cond:
            if exchange.expired or exchange not in self._active:
                return None
            dup = socket.socket(sock.family, sock.type, sock.proto, os.dup(sock.fileno()))
            exchange.sockets.append(dup)
            return dup

    def release(self, exchange: Exchange, dup: socket.socket) -> bool:
        """Watch no more the socket ``dup`` stands for: its connection goes
        back to the pool, for another exchange to take. ``False`` if the
        exchange ran late first: the socket may be shut down."""
        with self._cond:
            if exchange.expired:
                return False
            if dup not in exchange.sockets:
                return True  # finish() took it, and closes it
            exchange.sockets.remove(dup)
        dup.close()
        return True

    def finish(self, exchange: Exchange) -> None:
        with self._cond:
            self._active.discard(exchange)
            sockets, exchange.sockets = exchange.sockets, []
        for dup in sockets:
            dup.close()

    def _run(self) -> None:
        with self._cond:
            while True:
                now = time.monotonic()
                late = [a for a in self._active if a.deadline <= now]
                for exchange in late:
                    self._active.discard(exchange)
                    exchange.expired = True
                    for dup in exchange.sockets:
                        # OSError: already closed by the peer, so nothing is blocked on it.
                        with contextlib.suppress(OSError):
                            dup.shutdown(socket.SHUT_RDWR)
                self._wakes_at = min((a.deadline for a in self._active), default=None)
                self._cond.wait(None if self._wakes_at is None else self._wakes_at - now)


WATCHDOG = _Watchdog()
# The thread does not survive a fork, and its lock may have been held when it happened.
os.register_at_fork(after_in_child=WATCHDOG._reset)

this_thread = threading.local()


def current_exchange() -> Exchange:
    exchange: Exchange | None = getattr(this_thread, "exchange", None)
    if exchange is None:
        # Only Transport.post opens connections; anything else is a bug, and must not
        # get past the address check by accident.
        raise RuntimeError("a federation delivery connection was used outside Transport.post")
    return exchange


def _resolve(host: str, port: int, timeout: float) -> list[tuple[Any, ...]]:
    """getaddrinfo, bounded: it cannot be interrupted, so a slow lookup runs in a thread."""
    family = allowed_gai_family()
    if parse_ip(host) is not None:
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


#: Interim (1xx) answers read past before the final one, at most. A server
#: has no cause to send more than a few (a 100 Continue, an Early Hints or
#: two); one that sends them without end fails the attempt here, and one that
#: drips them at the deadline, as any slow answer does.
MAX_INTERIM_ANSWERS = 16


class _BoundedHTTPResponse(http.client.HTTPResponse):
    """http.client's answer, which never reads "the rest, however long", and
    is the final answer, not an interim one.

    urllib3 reads a chunked body a chunk at a time, ``_safe_read`` of the
    size its line gave, and takes a negative size ("-1") as it comes: a read
    of -1 is everything until the server closes, into memory, before
    MAX_ANSWER_BYTES is looked at. Such an answer is broken, and fails its
    attempt like any other cut short.

    http.client reads past a ``100 Continue`` alone: a ``103 Early Hints``
    before a 200 was taken for the answer, and the delivery retried (sent
    twice, then failed). RFC 9110 (15.2) asks a client to read past any
    1xx it did not expect; 101 alone ends the exchange (a switch of
    protocols, which is never asked for here: it stays the answer, and is
    not a delivery)."""

    def begin(self) -> None:
        super().begin()
        if self.status == 101:
            # The connection speaks another protocol now: never pooled again.
            self.will_close = True

    def _read_status(self) -> tuple[str, int, str]:
        # begin() loops on 100 only; past this, it sees the final status.
        for _skipped in range(MAX_INTERIM_ANSWERS + 1):
            version, status, reason = super()._read_status()  # type: ignore[misc]
            if not 100 <= status < 200 or status == 101:
                return version, status, reason
            # Its header lines, bounded in length and number as a final answer's are.
            http.client.parse_headers(self.fp)
        raise TooManyInterimAnswers(f"more than {MAX_INTERIM_ANSWERS} interim answers")

    def _safe_read(self, amt: int) -> bytes:
        if amt < 0:
            raise http.client.IncompleteRead(b"", None)
        read: bytes = super()._safe_read(amt)  # type: ignore[misc]
        return read


class GuardedHTTPConnection(HTTPConnection):
    """Connects only to allowed addresses, and only within the attempt's time."""

    response_class = _BoundedHTTPResponse

    # The exchange this connection's socket is registered with, if any, and
    # the duplicate of it the watchdog holds.
    _watched_by: Exchange | None = None
    _watched_dup: socket.socket | None = None

    def _new_conn(self) -> socket.socket:
        exchange = current_exchange()
        host = self._dns_host.strip("[]")
        port = self.port
        limit = self.timeout if isinstance(self.timeout, int | float) else None
        where = f"{host}:{port}"

        remaining = exchange.remaining()
        infos = _resolve(host, port, remaining if limit is None else min(limit, remaining))
        usable = [info for info in infos if self._allowed(info[4][0], exchange)]
        if not usable:
            addresses = ", ".join(dict.fromkeys(str(info[4][0]) for info in infos))
            raise RefusedAddress(
                f"refused to connect to {host} ({addresses}): not a public address"
            )

        error: OSError | None = None
        for family, type_, proto, _name, sockaddr in usable:
            remaining = exchange.remaining()
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
                if not self._allowed(peer, exchange):
                    raise RefusedAddress(
                        f"refused to connect to {host} ({peer}): not a public address"
                    )
                dup = WATCHDOG.register(exchange, sock)
                if dup is None:
                    raise AttemptTimeout(f"timed out connecting to {where}")
            except OSError as exc:
                sock.close()
                error = exc
                continue
            except BaseException:
                sock.close()
                raise
            self._watched_by, self._watched_dup = exchange, dup
            sys.audit("http.client.connect", self, self.host, self.port)
            return sock

        if error is None or isinstance(error, TimeoutError):
            raise AttemptTimeout(f"timed out connecting to {where}") from error
        raise ConnectionFailed(f"could not connect to {where}: {reason(error)}") from error

    @staticmethod
    def _allowed(address: str, exchange: Exchange) -> bool:
        ip = parse_ip(address)
        return ip is not None and allowed(ip, exchange.allowed_networks)

    def putrequest(
        self,
        method: str,
        url: str,
        skip_host: bool = False,
        skip_accept_encoding: bool = False,
    ) -> None:
        # A pooled connection's socket is watched for this exchange too. (A new one was
        # registered by _new_conn; over plain HTTP it is only connected later, on send.)
        exchange = current_exchange()
        if self.sock is not None and self._watched_by is not exchange:
            # Its peer is judged again, by this exchange's networks: pools are
            # shared by kinds that may allow different ones (a webhook's
            # WEBHOOK_ALLOWED_NETWORKS, an inbox's ALLOWED_NETWORKS), and
            # one kind's connection must not carry another's request past them.
            peer = _peer(self.sock)
            if peer is None:
                self.close()  # gone meanwhile: connected again, and judged, on send
            elif not self._allowed(peer, exchange):
                raise RefusedAddress(
                    f"refused to connect to {self._dns_host.strip('[]')} ({peer}): "
                    "not a public address"
                )
            elif (dup := WATCHDOG.register(exchange, self.sock)) is None:
                raise AttemptTimeout("timed out before sending")
            else:
                self._watched_by, self._watched_dup = exchange, dup
        super().putrequest(
            method, url, skip_host=skip_host, skip_accept_encoding=skip_accept_encoding
        )

    def unwatch(self) -> bool:
        """Stop its exchange's watch of this connection, put back in the pool
        for another exchange to take: a late exchange's watchdog must not
        shut down a socket another delivery is using. ``False`` if that
        exchange ran late first (its socket may be shut down)."""
        exchange, dup = self._watched_by, self._watched_dup
        self._watched_by = self._watched_dup = None
        return exchange is None or dup is None or WATCHDOG.release(exchange, dup)

    def close(self) -> None:
        IDLE.taken(self)
        self._watched_by = self._watched_dup = None
        super().close()


def _peer(sock: socket.socket) -> str | None:
    """The address ``sock`` is connected to; None once it is not."""
    try:
        return str(sock.getpeername()[0])
    except OSError:
        return None


class GuardedHTTPSConnection(GuardedHTTPConnection, HTTPSConnection):
    """The same, for TLS: the socket is checked and watched before the handshake."""


class GuardedHTTPConnectionPool(HTTPConnectionPool):
    """Guarded connections, whose idle ones count against the process's bound
    (see ``idle.py``): taken out, put back and closed under its lock."""

    ConnectionCls = GuardedHTTPConnection
    #: Idle connections kept in the whole process; set by the pool manager.
    max_idle = 256

    def _get_conn(self, timeout: float | None = None) -> BaseHTTPConnection:
        with IDLE.lock:
            conn = super()._get_conn(timeout)
            if isinstance(conn, HTTPConnection):
                IDLE.taken(conn)
        return conn

    def _put_conn(self, conn: BaseHTTPConnection | None) -> None:
        if isinstance(conn, GuardedHTTPConnection) and not conn.unwatch():
            conn.close()  # shut down, perhaps, by its late exchange's watchdog
        with IDLE.lock:
            if conn is not None and self.pool is not None and self.pool.full():
                # More were in use at once than are kept idle (threads sharing the
                # pool): past the bound this one is closed, which is no news.
                conn.close()
                return
            super()._put_conn(conn)
            # Closed instead when the pool is full or closed, or the answer left unread.
            if isinstance(conn, HTTPConnection) and conn.sock is not None:
                IDLE.pooled(conn, self.max_idle)

    def close(self) -> None:
        with IDLE.lock:
            super().close()


class GuardedHTTPSConnectionPool(GuardedHTTPConnectionPool, HTTPSConnectionPool):
    ConnectionCls = GuardedHTTPSConnection


class GuardedPoolManager(PoolManager):
    """Guarded pools, and when each was last used, so idle ones can be closed."""

    def __init__(self, *args: Any, max_idle: int = 256, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.pool_classes_by_scheme = {
            "http": GuardedHTTPConnectionPool,
            "https": GuardedHTTPSConnectionPool,
        }
        self.max_idle = max_idle
        self.last_used: dict[PoolKey, float] = {}
        # Several threads may share the manager: each has its own pool in use,
        # and when a pool was last used is read and written under the lock, so
        # that a pool is never dropped as idle just as another thread takes it.
        self._lock = threading.Lock()
        self._local = threading.local()
        self._swept = 0.0

    @property
    def current(self) -> PoolKey | None:
        """The key of the pool the calling thread took last, until :meth:`touch`."""
        key: PoolKey | None = getattr(self._local, "key", None)
        return key

    def _new_pool(
        self,
        scheme: str,
        host: str,
        port: int,
        request_context: dict[str, Any] | None = None,
    ) -> HTTPConnectionPool:
        pool = super()._new_pool(scheme, host, port, request_context)
        if isinstance(pool, GuardedHTTPConnectionPool):
            pool.max_idle = self.max_idle
        return pool

    def connection_from_pool_key(
        self, pool_key: PoolKey, request_context: dict[str, Any]
    ) -> HTTPConnectionPool:
        self._local.key = pool_key
        with self._lock:
            self.last_used[pool_key] = time.monotonic()
            return super().connection_from_pool_key(pool_key, request_context)

    def touch(self) -> None:
        """The calling thread is done with its pool: it counts as used now."""
        key = self.current
        if key is not None:
            self._local.key = None
            with self._lock:
                self.last_used[key] = time.monotonic()

    def drop(self, key: PoolKey) -> None:
        """Close the pool for ``key`` and every idle connection in it."""
        with self._lock:
            self._drop(key)

    def _drop(self, key: PoolKey) -> None:
        self.last_used.pop(key, None)
        with contextlib.suppress(KeyError):  # already evicted
            del self.pools[key]  # disposing of a pool closes it

    def drop_idle(self, idle_timeout: float, *, every: float = 0.0) -> None:
        """Drop the pools unused for ``idle_timeout``, and close the idle
        connections unused that long in the others; with ``every``, only if
        the last look was at least that long ago (a look reads every pool)."""
        now = time.monotonic()
        with self._lock:
            if now < self._swept + every:
                return
            self._swept = now
            cutoff = now - idle_timeout
            for key in [k for k, used in self.last_used.items() if used <= cutoff]:
                self._drop(key)
        # And the connections unused that long in the pools still used.
        IDLE.close_unused(idle_timeout)

    def forget(self) -> None:
        """Every pool closed (``clear()``): none is left to drop."""
        with self._lock:
            self.last_used.clear()


class GuardedAdapter(requests.adapters.HTTPAdapter):
    poolmanager: GuardedPoolManager

    def __init__(self, *args: Any, max_idle: int = 256, **kwargs: Any) -> None:
        self._max_idle = max_idle  # read by init_poolmanager, called by the base's __init__
        super().__init__(*args, **kwargs)

    def init_poolmanager(
        self, connections: int, maxsize: int, block: bool = False, **pool_kwargs: Any
    ) -> None:
        self._pool_connections = connections
        self._pool_maxsize = maxsize
        self._pool_block = block
        self.poolmanager = GuardedPoolManager(
            num_pools=connections,
            maxsize=maxsize,
            block=block,
            max_idle=self._max_idle,
            **pool_kwargs,
        )

    def proxy_manager_for(self, proxy: str, **proxy_kwargs: Any) -> Any:
        # Through a proxy, the address checked would be the proxy's, not the inbox's.
        raise ConnectionFailed("proxies are not supported")
