"""A pooled connection is handed to the next delivery only as HTTP left it.

Servers written on raw sockets, on 127.0.0.1, answer what no HTTP server
library would: a switch of protocols, then frames of another. Each is
stopped by its test; every attempt is bounded by a short ``attempt_timeout``.
"""

from __future__ import annotations

import contextlib
import ipaddress
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from django_federation_delivery.transport import Transport, TransportSettings

LOOPBACK = ipaddress.ip_network("127.0.0.0/8")


class RawServer:
    """Accepts connections on 127.0.0.1 and reads HTTP/1.1 requests off each;
    ``reply(connection, nth request on it, nth connection)`` writes what it
    likes, and says whether to go on reading that connection."""

    def __init__(self, reply: Callable[[socket.socket, int, int], bool]) -> None:
        self.reply = reply
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(16)
        self.listener.settimeout(0.1)
        self.port = self.listener.getsockname()[1]
        self.stopping = threading.Event()
        self.lock = threading.Lock()
        self.connections = 0
        #: (nth connection, request line) for every request read.
        self.requests: list[tuple[int, bytes]] = []
        self._threads: list[threading.Thread] = []
        self._sockets: list[socket.socket] = []
        self._accepting = threading.Thread(target=self._accept, daemon=True)
        self._accepting.start()

    def url(self, path: str = "/inbox") -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def _accept(self) -> None:
        while not self.stopping.is_set():
            try:
                sock, _ = self.listener.accept()
            except OSError:
                continue
            with self.lock:
                self.connections += 1
                index = self.connections
            thread = threading.Thread(target=self._serve, args=(sock, index), daemon=True)
            self._threads.append(thread)
            thread.start()

    def _serve(self, sock: socket.socket, index: int) -> None:
        # Blocking reads: stop() shuts the connection down under them.
        sock.settimeout(None)
        with self.lock:
            self._sockets.append(sock)
        reader = sock.makefile("rb")
        count = 0
        try:
            while not self.stopping.is_set():
                line = reader.readline()
                if not line:
                    return
                length = 0
                while True:
                    header = reader.readline()
                    if header in (b"\r\n", b"\n", b""):
                        break
                    name, _, value = header.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                reader.read(length)
                count += 1
                with self.lock:
                    self.requests.append((index, line))
                if not self.reply(sock, count, index):
                    return
        except OSError:
            pass
        finally:
            reader.close()
            sock.close()

    def stop(self) -> None:
        self.stopping.set()
        self._accepting.join(5)
        self.listener.close()
        with self.lock:
            for sock in self._sockets:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
        for thread in self._threads:
            thread.join(5)


@pytest.fixture
def raw_servers() -> Iterator[Callable[..., RawServer]]:
    started: list[RawServer] = []

    def start(reply: Callable[[socket.socket, int, int], bool]) -> RawServer:
        started.append(RawServer(reply))
        return started[-1]

    yield start
    for server in started:
        server.stop()


@pytest.fixture
def transports() -> Iterator[Callable[..., Transport]]:
    made: list[Transport] = []

    def make(**overrides: Any) -> Transport:
        fields: dict[str, Any] = {
            "user_agent": "fd-tests",
            "connect_timeout": 1.0,
            "attempt_timeout": 2.0,
            "allowed_networks": (LOOPBACK,),
        }
        made.append(Transport(TransportSettings(**(fields | overrides))))
        return made[-1]

    yield make
    for transport in made:
        transport.close()


ACCEPTED = b"HTTP/1.1 202 Accepted\r\nContent-Length: 0\r\n\r\n"


def test_a_connection_switched_to_another_protocol_by_a_101_is_not_reused_for_the_next_delivery(
    raw_servers: Callable[..., RawServer], transports: Callable[..., Transport]
) -> None:
    # A server answers one delivery "101 Switching Protocols" (a WebSocket
    # or h2c endpoint, say) and from then on speaks that protocol on the
    # connection: it is no HTTP/1.1 connection any more. The next delivery
    # to the host, on a connection of its own, is accepted.
    def reply(sock: socket.socket, nth: int, connection: int) -> bool:
        if connection == 1 and nth == 1:
            sock.sendall(
                b"HTTP/1.1 101 Switching Protocols\r\n"
                b"Upgrade: websocket\r\nConnection: Upgrade\r\n\r\n"
            )
            return True
        if connection == 1:
            sock.sendall(b"\x81\x05hello")  # a WebSocket frame, not an answer
            return True
        sock.sendall(ACCEPTED)
        return True

    server = raw_servers(reply)
    transport = transports()

    first = transport.post(server.url(), b"{}", {})
    assert first.status == 101
    started = time.monotonic()
    try:
        second: object = transport.post(server.url(), b"{}", {}).status
    except Exception as exc:
        second = f"{type(exc).__name__}: {exc}"
    took = time.monotonic() - started

    assert second == 202, (
        f"the next delivery got {second!r} after {took:.1f}s: it was sent on the "
        f"connection the 101 switched away from HTTP (requests per connection: "
        f"{[index for index, _line in server.requests]})"
    )


def test_a_late_attempt_s_watchdog_never_shuts_the_connection_another_delivery_now_uses(
    raw_servers: Callable[..., RawServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Delivery A's answer is read whole, and urllib3 puts its connection
    # back in the pool as the last byte is read; A's exchange is finished
    # (its sockets unwatched) only a few statements later. A thread that is
    # not scheduled for a moment there, while A's deadline passes, and the
    # watchdog shuts down A's socket: by then delivery B, to the same host on
    # another worker, has taken that very connection from the pool.
    from django_federation_delivery import transport as transport_module
    from django_federation_delivery.transport import Connections

    def reply(sock: socket.socket, nth: int, connection: int) -> bool:
        if nth == 2:
            time.sleep(0.6)  # B's answer takes a moment, as any may
        sock.sendall(ACCEPTED)
        return True

    server = raw_servers(reply)
    settings = TransportSettings(
        user_agent="fd-tests",
        connect_timeout=1.0,
        attempt_timeout=2.0,
        allowed_networks=(LOOPBACK,),
    )
    connections = Connections(settings)
    a_read = threading.Event()
    b_done = threading.Event()
    a_deadline = time.monotonic() + 0.3
    original = transport_module._read_at_most

    def read_then_lag(response: Any, limit: int) -> bytes:
        body = original(response, limit)
        if threading.current_thread().name == "delivery-a":
            a_read.set()
            # Descheduled past its deadline before the exchange is finished.
            b_done.wait(3)
        return body

    monkeypatch.setattr(transport_module, "_read_at_most", read_then_lag)
    outcomes: dict[str, object] = {}

    def deliver(name: str, deadline: float | None) -> None:
        with Transport(settings, connections) as transport:
            try:
                outcomes[name] = transport.post(server.url(), b"{}", {}, deadline=deadline).status
            except Exception as exc:
                outcomes[name] = f"{type(exc).__name__}: {exc}"

    a = threading.Thread(target=deliver, args=("a", a_deadline), name="delivery-a")
    a.start()
    try:
        assert a_read.wait(3)
        deliver("b", None)
    finally:
        b_done.set()
        a.join(5)
        connections.close()

    assert [index for index, _line in server.requests] == [1, 1], "B went on A's connection"
    assert outcomes["b"] == 202, (
        f"delivery B, answered 202 by its server, came to {outcomes['b']!r}: "
        "delivery A's watchdog shut down the connection B had taken from the pool"
    )
