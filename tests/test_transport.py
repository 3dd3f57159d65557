"""The transport against real HTTP servers on loopback; nothing beyond 127.0.0.0/8 and ::1.

No stand-ins for requests or sockets: only a fake resolver for names that must not
reach real DNS, and one forced verdict to show where the peer check sits.

Needs no Django. Without the project's conftest and settings::

    pytest -p no:django -o addopts="" --noconftest -W ignore::pytest.PytestConfigWarning \
        tests/test_transport.py
"""

from __future__ import annotations

import contextlib
import datetime
import email.utils
import errno
import functools
import gzip
import ipaddress
import logging
import socket
import ssl
import threading
import time
import tracemalloc
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from email.message import Message
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import pytest

from django_federation_delivery.exceptions import (
    AttemptTimeout,
    ConnectionFailed,
    InvalidURL,
    RefusedAddress,
)
from django_federation_delivery.transport import (
    DEFAULT_ACCEPT,
    Connections,
    Transport,
    TransportSettings,
    guard,
    idle,
    is_public_address,
    logs,
    parse_retry_after,
)
from django_federation_delivery.transport import networks as ip_networks
from tests.conftest import LoopbackServer

LOOPBACK = ipaddress.ip_network("127.0.0.0/8")
USER_AGENT = "django-federation-delivery/test (+https://sender.example/)"


# --- A real inbox ------------------------------------------------------------------------------


@dataclass
class Seen:
    path: str
    headers: Message
    body: bytes
    port: int  # the client's port: one per TCP connection


Reply = Callable[["_Handler", Seen], None]


def answer(
    handler: BaseHTTPRequestHandler,
    status: int,
    body: bytes = b"",
    headers: dict[str, str] | None = None,
) -> None:
    handler.send_response(status)
    for name, value in (headers or {}).items():
        handler.send_header(name, value)
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)


def accepted(handler: _Handler, seen: Seen) -> None:
    answer(handler, 202, b'{"ok": true}', {"Content-Type": "application/json", "X-Answer": "yes"})


class Inbox:
    """A ThreadingHTTPServer on 127.0.0.1 that records connections and requests."""

    def __init__(
        self, reply: Reply = accepted, tls: ssl.SSLContext | None = None, host: str = "127.0.0.1"
    ) -> None:
        self.reply = reply
        self.seen: list[Seen] = []
        self.connections: list[int] = []
        self.closed: list[int] = []
        self.stopping = threading.Event()
        self._changed = threading.Condition()
        handler = type("Handler", (_Handler,), {"inbox": self})
        server_class = _IPv6Server if ":" in host else LoopbackServer
        self.server = server_class((host, 0), handler)
        self.host = f"[{host}]" if ":" in host else host
        if tls is not None:
            self.server.socket = tls.wrap_socket(self.server.socket, server_side=True)
        self.port = self.server.server_address[1]
        self.scheme = "https" if tls else "http"
        self._thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()

    def url(self, path: str = "/inbox", host: str | None = None) -> str:
        return f"{self.scheme}://{host or self.host}:{self.port}{path}"

    def note(self, what: list[Any], item: Any) -> None:
        with self._changed:
            what.append(item)
            self._changed.notify_all()

    def wait_until(self, condition: Callable[[], bool], timeout: float = 3.0) -> bool:
        with self._changed:
            return self._changed.wait_for(condition, timeout)

    def wait_closed(self, port: int) -> bool:
        return self.wait_until(lambda: port in self.closed)

    def stop(self) -> None:
        self.stopping.set()
        self.server.shutdown()
        self.server.server_close()  # joins the handler threads
        self._thread.join(5)


class _IPv6Server(LoopbackServer):
    address_family = socket.AF_INET6


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive
    timeout = 5  # no handler thread outlives a test by more than this
    inbox: Inbox

    def setup(self) -> None:
        super().setup()
        self.inbox.note(self.inbox.connections, self.client_address[1])

    def finish(self) -> None:
        try:
            super().finish()
        except OSError:
            pass  # the client went away mid-answer, as some tests make it
        finally:
            self.inbox.note(self.inbox.closed, self.client_address[1])

    def handle(self) -> None:
        try:
            super().handle()
        except OSError:
            self.close_connection = True

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        seen = Seen(self.path, self.headers, body, self.client_address[1])
        self.inbox.note(self.inbox.seen, seen)
        self.inbox.reply(self, seen)

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def inboxes() -> Iterator[Callable[..., Inbox]]:
    started: list[Inbox] = []

    def start(
        reply: Reply = accepted, tls: ssl.SSLContext | None = None, host: str = "127.0.0.1"
    ) -> Inbox:
        inbox = Inbox(reply, tls, host)
        started.append(inbox)
        return inbox

    yield start
    for inbox in started:
        inbox.stop()


@pytest.fixture
def inbox(inboxes: Callable[..., Inbox]) -> Inbox:
    return inboxes()


def transport_settings(**overrides: Any) -> TransportSettings:
    fields: dict[str, Any] = {
        "user_agent": USER_AGENT,
        "connect_timeout": 2.0,
        "attempt_timeout": 5.0,
        "allowed_networks": (LOOPBACK,),
    }
    return TransportSettings(**(fields | overrides))


@pytest.fixture
def transports(inboxes: Callable[..., Inbox]) -> Iterator[Callable[..., Transport]]:
    # Depends on ``inboxes`` so that transports close (and servers see EOF) first.
    made: list[Transport] = []

    def make(connections: Connections | None = None, **overrides: Any) -> Transport:
        made.append(Transport(transport_settings(**overrides), connections))
        return made[-1]

    yield make
    for transport in made:
        transport.close()


@pytest.fixture
def shared(inboxes: Callable[..., Inbox]) -> Iterator[Callable[..., Connections]]:
    """Connections for several transports to share, closed after the test."""
    made: list[Connections] = []

    def make(**overrides: Any) -> Connections:
        made.append(Connections(transport_settings(**overrides)))
        return made[-1]

    yield make
    for connections in made:
        connections.close()


@pytest.fixture
def transport(transports: Callable[..., Transport]) -> Transport:
    return transports()


def drip(data: bytes, every: float = 0.2) -> Reply:
    """An answer written one byte at a time."""

    def reply(handler: _Handler, seen: Seen) -> None:
        handler.close_connection = True
        for byte in data:
            if handler.inbox.stopping.wait(every):
                return
            try:
                handler.wfile.write(bytes([byte]))
            except OSError:
                return  # the client hung up

    return reply


SIGNED = {
    "Host": "inbox.example",
    "Date": "Tue, 07 Jun 2025 20:51:35 GMT",
    "Digest": "SHA-256=X48E9qOokqqrvdts8nOJRJN3OWDUoyWxBf7kbu9DBPE=",
    "Content-Type": "application/activity+json",
    "Signature": 'keyId="https://sender.example/actor#main-key",headers="(request-target) host",'
    'signature="c2lnbmF0dXJl"',
}


# --- Answers -----------------------------------------------------------------------------------


def test_a_202_with_its_headers_and_body(inbox: Inbox, transport: Transport) -> None:
    got = transport.post(inbox.url(), b'{"type": "Create"}', SIGNED)

    assert got.status == 202
    assert got.body == b'{"ok": true}'
    assert got.headers["x-answer"] == "yes"  # case-insensitive
    assert got.headers["Content-Type"] == "application/json"
    assert 0 < got.elapsed < 5
    assert [seen.body for seen in inbox.seen] == [b'{"type": "Create"}']


def test_headers_are_sent_as_given(inbox: Inbox, transport: Transport) -> None:
    transport.post(inbox.url("/users/a/inbox"), b"{}", SIGNED)

    (seen,) = inbox.seen
    assert seen.path == "/users/a/inbox"
    for name, value in SIGNED.items():
        assert seen.headers.get_all(name) == [value], name
    assert seen.headers.get_all("User-Agent") == [USER_AGENT]
    assert seen.headers.get_all("Accept") == [DEFAULT_ACCEPT]
    assert seen.headers.get_all("Content-Length") == ["2"]


def test_given_headers_override_the_defaults(inbox: Inbox, transport: Transport) -> None:
    transport.post(inbox.url(), b"{}", {"Accept": "application/json", "User-Agent": "other"})

    (seen,) = inbox.seen
    assert seen.headers.get_all("Accept") == ["application/json"]
    assert seen.headers.get_all("User-Agent") == ["other"]
    # No Host was given: requests' own, from the URL.
    assert seen.headers.get_all("Host") == [f"127.0.0.1:{inbox.port}"]


def test_a_redirect_is_an_answer_not_followed(
    inboxes: Callable[..., Inbox], transport: Transport
) -> None:
    elsewhere = inboxes()

    def moved(handler: _Handler, seen: Seen) -> None:
        answer(handler, 302, headers={"Location": elsewhere.url()})

    got = transport.post(inboxes(moved).url(), b"{}", SIGNED)

    assert got.status == 302
    assert got.headers["Location"] == elsewhere.url()
    assert elsewhere.seen == []
    assert elsewhere.connections == []


def test_a_huge_body_is_read_only_up_to_the_cap(
    inboxes: Callable[..., Inbox], transports: Callable[..., Transport]
) -> None:
    def huge(handler: _Handler, seen: Seen) -> None:
        size = 5 * 1024 * 1024
        handler.send_response(200)
        handler.send_header("Content-Length", str(size))
        handler.end_headers()
        chunk = b"x" * 65536
        try:
            for _ in range(size // len(chunk)):
                handler.wfile.write(chunk)
        except OSError:
            handler.close_connection = True  # the client stopped reading, as it should

    inbox = inboxes(huge)
    transport = transports(max_answer_bytes=64 * 1024)

    first = transport.post(inbox.url(), b"{}", SIGNED)
    second = transport.post(inbox.url(), b"{}", SIGNED)

    assert len(first.body) == len(second.body) == 64 * 1024
    # Unread data was left: that connection was closed, not pooled for the next post.
    assert len(set(inbox.connections)) == 2


def test_a_chunk_of_negative_size_fails_the_attempt_without_reading_on(
    inboxes: Callable[..., Inbox], transports: Callable[..., Transport]
) -> None:
    # "-1" as a chunk's size: read as "the rest", it would take all the
    # server sends into memory, however much, before the cap is applied.
    block = b"x" * 65536
    written: list[int] = []

    def endless(handler: _Handler, seen: Seen) -> None:
        handler.close_connection = True
        handler.wfile.write(b"HTTP/1.1 400 Bad Request\r\nTransfer-Encoding: chunked\r\n\r\n-1\r\n")
        sent = 0
        try:
            while sent < 64 * 1024 * 1024:
                handler.wfile.write(block)
                sent += len(block)
        except OSError:
            pass  # the client hung up
        inbox.note(written, sent)

    inbox = inboxes(endless)
    transport = transports(max_answer_bytes=64 * 1024)

    with pytest.raises(ConnectionFailed):
        transport.post(inbox.url(), b"{}", SIGNED)
    assert inbox.wait_until(lambda: bool(written), timeout=10)
    # What the kernel's buffers took before the client stopped, not 64 MB.
    assert written[0] < 32 * 1024 * 1024


def test_a_body_its_content_encoding_does_not_fit_leaves_the_status_standing(
    inboxes: Callable[..., Inbox], transport: Transport
) -> None:
    # Identity was asked for; the inbox took the activity all the same. Told
    # as a failure, it would be sent again.
    def plain(handler: _Handler, seen: Seen) -> None:
        answer(handler, 202, b"ok!!", {"Content-Encoding": "gzip"})

    inbox = inboxes(plain)
    got = transport.post(inbox.url(), b"{}", SIGNED)

    assert (got.status, got.body) == (202, b"")
    assert transport.post(inbox.url(), b"{}", SIGNED).status == 202


@pytest.mark.parametrize(
    "status_line",
    [b"400 Bad Request", b"302 Found\r\nLocation: /elsewhere", b"307 Moved\r\nLocation: /x"],
    ids=["400", "302", "307"],
)
def test_a_compressed_body_is_read_decoded_and_inflated_only_up_to_the_cap(
    inboxes: Callable[..., Inbox], transports: Callable[..., Transport], status_line: bytes
) -> None:
    # Sent compressed though identity was asked for, an answer is still
    # readable where an error shows it. 1 GiB of zeros, 1 MB compressed:
    # only what the cap takes of it is inflated. A redirect's too: requests
    # read its body whole, to prepare the redirect it never followed.
    zeros = bytes(1 << 20)
    packer = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)  # gzip
    start = packer.compress(zeros) + packer.flush(zlib.Z_FULL_FLUSH)
    more = packer.compress(zeros) + packer.flush(zlib.Z_FULL_FLUSH)  # the same each time
    bomb = start + more * 1023

    def refusal(handler: _Handler, seen: Seen) -> None:
        answer(handler, 400, gzip.compress(b"no such actor"), {"Content-Encoding": "gzip"})

    def bombed(handler: _Handler, seen: Seen) -> None:
        handler.close_connection = True
        handler.wfile.write(b"HTTP/1.1 %s\r\nContent-Encoding: gzip\r\n\r\n" % status_line)
        with contextlib.suppress(OSError):  # the client hangs up
            handler.wfile.write(bomb)

    transport = transports(max_answer_bytes=64 * 1024)
    assert transport.post(inboxes(refusal).url(), b"{}", SIGNED).body == b"no such actor"
    tracemalloc.start()
    try:
        got = transport.post(inboxes(bombed).url(), b"{}", SIGNED)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()

    assert (got.status, got.body) == (int(status_line[:3]), bytes(64 * 1024))
    assert peak < 16 << 20, f"{peak} bytes at once"


@pytest.mark.parametrize("location", [b"/\xff", b"http://[::1/"], ids=["not-utf-8", "no-url"])
def test_a_redirect_to_a_location_that_does_not_read_is_an_answer(
    inboxes: Callable[..., Inbox], transport: Transport, location: bytes
) -> None:
    # requests worked out where the redirect it never follows would go, and
    # raised a UnicodeDecodeError or a ValueError: the attempt crashed as an
    # internal error, its answer lost.
    def moved(handler: _Handler, seen: Seen) -> None:
        handler.wfile.write(
            b"HTTP/1.1 302 Found\r\nLocation: %s\r\nContent-Length: 0\r\n\r\n" % location
        )

    assert transport.post(inboxes(moved).url(), b"{}", SIGNED).status == 302


EARLY_HINTS = b"HTTP/1.1 103 Early Hints\r\nLink: </a>; rel=preload\r\n\r\n"


@pytest.mark.parametrize(
    "interim",
    [
        pytest.param(EARLY_HINTS, id="103"),
        pytest.param(b"HTTP/1.1 100 Continue\r\n\r\n" + EARLY_HINTS * 3, id="100-103-103-103"),
        pytest.param(b"HTTP/1.1 199 Whatever\r\nX-A: b\r\n\r\n", id="199"),
    ],
)
def test_interim_answers_are_read_past_to_the_final_one(
    inboxes: Callable[..., Inbox], transport: Transport, interim: bytes
) -> None:
    # RFC 9110, 15.2: a 1xx is not the answer, whether or not it was asked for.
    def reply(handler: _Handler, seen: Seen) -> None:
        handler.wfile.write(interim + b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")

    inbox = inboxes(reply)
    answer = transport.post(inbox.url(), b"{}", SIGNED)

    assert (answer.status, answer.body) == (200, b"ok")
    assert "Link" not in answer.headers
    # The connection is whole: the next request on it gets its own answer.
    assert transport.post(inbox.url(), b"{}", SIGNED).status == 200
    assert len(set(inbox.connections)) == 1


@pytest.mark.slow
def test_endless_interim_answers_fail_the_attempt(
    inboxes: Callable[..., Inbox], transports: Callable[..., Transport]
) -> None:
    def endless(handler: _Handler, seen: Seen) -> None:
        handler.close_connection = True
        try:
            while not handler.inbox.stopping.is_set():
                handler.wfile.write(EARLY_HINTS)
        except OSError:
            pass  # the client hung up

    inbox = inboxes(endless)
    transport = transports(attempt_timeout=1.5, connect_timeout=1.0)

    start = time.monotonic()
    with pytest.raises(ConnectionFailed, match="interim") as failed:
        transport.post(inbox.url(), b"{}", SIGNED)
    assert time.monotonic() - start < 1.5
    assert not failed.value.permanent
    # The transport is still good for the next attempt.
    assert transport.post(inboxes().url(), b"{}", SIGNED).status == 202


@pytest.mark.slow
def test_slow_interim_answers_are_cut_off_at_the_attempt_timeout(
    inboxes: Callable[..., Inbox], transports: Callable[..., Transport]
) -> None:
    def slow(handler: _Handler, seen: Seen) -> None:
        handler.close_connection = True
        try:
            while not handler.inbox.stopping.wait(0.2):
                handler.wfile.write(EARLY_HINTS)
        except OSError:
            pass  # the client hung up

    inbox = inboxes(slow)
    transport = transports(attempt_timeout=1.5, connect_timeout=1.0)

    start = time.monotonic()
    with pytest.raises(AttemptTimeout):
        transport.post(inbox.url(), b"{}", SIGNED)
    assert 1.4 < time.monotonic() - start < 8


# --- Where it may connect ----------------------------------------------------------------------


def test_loopback_is_refused_by_default(inbox: Inbox, transports: Callable[..., Transport]) -> None:
    transport = transports(allowed_networks=())

    with pytest.raises(RefusedAddress) as refused:
        transport.post(inbox.url(), b"{}", SIGNED)

    assert "127.0.0.1" in str(refused.value)
    assert refused.value.permanent
    assert inbox.connections == []
    assert inbox.seen == []


def test_a_host_name_is_judged_by_the_address_it_resolves_to(
    inbox: Inbox, transports: Callable[..., Transport]
) -> None:
    transport = transports(allowed_networks=(ipaddress.ip_network("10.0.0.0/8"),))

    with pytest.raises(RefusedAddress) as refused:
        transport.post(inbox.url(host="localhost"), b"{}", SIGNED)

    assert "localhost" in str(refused.value)
    assert inbox.connections == []


def test_loopback_is_allowed_when_allowed(inbox: Inbox, transport: Transport) -> None:
    assert transport.post(inbox.url(host="localhost"), b"{}", SIGNED).status == 202


def test_the_connected_peer_is_checked_before_anything_is_written(
    inbox: Inbox, transport: Transport, monkeypatch: pytest.MonkeyPatch
) -> None:
    # As if DNS had said one thing and the connect had reached another: the resolved
    # address passes, the peer of the connected socket does not.
    verdicts = iter([True, False])
    monkeypatch.setattr(
        guard.GuardedHTTPConnection,
        "_allowed",
        staticmethod(lambda address, attempt: next(verdicts)),
    )

    with pytest.raises(RefusedAddress, match=r"127\.0\.0\.1"):
        transport.post(inbox.url(), b"{}", SIGNED)

    # The server accepts (in its own time) a connection that is closed without a request.
    assert inbox.wait_until(lambda: len(inbox.closed) == 1)
    assert len(inbox.connections) == 1
    assert inbox.seen == []


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as sock:
            sock.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.skipif(not _has_ipv6_loopback(), reason="no IPv6 loopback here")
def test_ipv6_loopback_refused_by_default_allowed_when_allowed(
    inboxes: Callable[..., Inbox], transports: Callable[..., Transport]
) -> None:
    inbox = inboxes(host="::1")

    with pytest.raises(RefusedAddress, match="::1"):
        transports().post(inbox.url(), b"{}", SIGNED)
    allowed = transports(allowed_networks=(ipaddress.ip_network("::1/128"),))

    assert allowed.post(inbox.url(), b"{}", SIGNED).status == 202
    assert len(inbox.seen) == 1


@pytest.mark.parametrize(
    ("address", "public"),
    [
        ("93.184.215.14", True),
        ("2606:2800:21f:cb07:6820:80da:af6b:8b2c", True),
        ("127.0.0.1", False),
        ("127.8.9.10", False),
        ("::1", False),
        ("10.1.2.3", False),
        ("172.16.0.1", False),
        ("192.168.1.1", False),
        ("169.254.169.254", False),
        ("fe80::1%eth0", False),
        ("100.64.0.1", False),
        ("fd12:3456::1", False),
        ("0.0.0.0", False),
        ("::", False),
        ("224.0.0.1", False),
        ("ff02::1", False),
        ("240.0.0.1", False),
        ("255.255.255.255", False),
        ("192.0.2.1", False),
        # Global to Python 3.11 and 3.12, not to 3.13: refused on all.
        ("192.0.0.8", False),
        ("192.0.0.9", False),
        # IPv6 documentation (RFC 9637), global to every Python here.
        ("3fff::1", False),
        ("::ffff:127.0.0.1", False),
        ("::ffff:10.0.0.1", False),
        ("::ffff:93.184.215.14", True),
        ("2002:7f00:1::1", False),
        # 6to4 and IETF protocol assignments in 2001::/23 whatever they carry:
        # global to some Pythons and not to others.
        ("2002:5db8:d822::1", False),
        ("2001:1::1", False),
        ("2001:4:112::1", False),
        ("2001:20::1", False),
        ("64:ff9b::a00:1", False),
        # NAT64 (RFC 6052): 93.184.216.34 as DNS64 gives it to an IPv6-only server.
        ("64:ff9b::5db8:d822", True),
        ("64:ff9b::93.184.216.34", True),
        ("64:ff9b::7f00:1", False),
        ("64:ff9b::c0a8:101", False),
        ("64:ff9b::a9fe:a9fe", False),
        ("64:ff9b::", False),
        # The local-use NAT64 prefix (RFC 8215) is a network's own, whatever it carries.
        ("64:ff9b:1::5db8:d822", False),
        ("64:ff9b:1:ffff::5db8:d822", False),
        ("not an address", False),
        ("", False),
    ],
)
def test_is_public_address(address: str, public: bool) -> None:
    assert is_public_address(address) is public


@pytest.mark.parametrize(
    ("address", "networks", "verdict"),
    [
        ("64:ff9b::5db8:d822", (), True),
        ("64:ff9b::7f00:1", (), False),
        ("64:ff9b::7f00:1", ("127.0.0.0/8",), True),
        ("64:ff9b::7f00:1", ("10.0.0.0/8",), False),
        ("64:ff9b::a00:1", ("10.0.0.0/8",), True),
        ("::ffff:127.0.0.1", ("127.0.0.0/8",), True),
        ("64:ff9b:1::5db8:d822", (), False),
        ("64:ff9b:1::7f00:1", ("127.0.0.0/8",), False),
        ("64:ff9b:1::7f00:1", ("64:ff9b:1::/48",), True),
    ],
)
def test_an_embedded_ipv4_address_is_allowed_by_its_network(
    address: str, networks: tuple[str, ...], verdict: bool
) -> None:
    allowed = tuple(ipaddress.ip_network(network) for network in networks)
    assert ip_networks.allowed(ipaddress.ip_address(address), allowed) is verdict


class _NoNAT64Route(socket.socket):
    """A socket that reaches nothing in 64:ff9b::/96, as on a host without NAT64: what
    the guard tries to connect to is noted, and no packet leaves."""

    tried: list[str] = []

    def connect(self, address: Any) -> None:
        if str(address[0]).startswith("64:ff9b:"):
            self.tried.append(address[0])
            raise OSError(errno.ENETUNREACH, "Network is unreachable")
        super().connect(address)


#: What DNS64 would answer for these names: the IPv4 address of the host inside 64:ff9b::/96.
NAT64_NAMES = {
    "public.nat64.example": "64:ff9b::5db8:d822",  # 93.184.216.34
    "private.nat64.example": "64:ff9b::a00:1",  # 10.0.0.1
    "loopback.nat64.example": "64:ff9b::7f00:1",  # 127.0.0.1
    "local-use.nat64.example": "64:ff9b:1::5db8:d822",  # RFC 8215
}


@pytest.fixture
def nat64(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of ``NAT64_NAMES`` resolve to their NAT64 address alone, as DNS64 answers
    for an IPv4-only host; the addresses the guard tries to connect to are listed."""
    real = socket.getaddrinfo

    def getaddrinfo(host: Any, port: Any, *args: Any, **kwargs: Any) -> Any:
        if host in NAT64_NAMES:
            sockaddr = (NAT64_NAMES[host], port, 0, 0)
            return [(socket.AF_INET6, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", sockaddr)]
        return real(host, port, *args, **kwargs)

    tried: list[str] = []
    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    monkeypatch.setattr(_NoNAT64Route, "tried", tried)
    monkeypatch.setattr(socket, "socket", _NoNAT64Route)
    return tried


def test_a_public_host_through_nat64_is_connected_to(
    nat64: list[str], transports: Callable[..., Transport]
) -> None:
    transport = transports(allowed_networks=())

    with pytest.raises(ConnectionFailed, match="unreachable"):
        transport.post("http://public.nat64.example/inbox", b"{}", SIGNED)

    assert nat64 == ["64:ff9b::5db8:d822"]


@pytest.mark.parametrize(
    "name", ["private.nat64.example", "loopback.nat64.example", "local-use.nat64.example"]
)
def test_a_private_host_through_nat64_is_refused_before_connecting(
    nat64: list[str], transports: Callable[..., Transport], name: str
) -> None:
    transport = transports(allowed_networks=())

    with pytest.raises(RefusedAddress) as refused:
        transport.post(f"http://{name}/inbox", b"{}", SIGNED)

    assert NAT64_NAMES[name] in str(refused.value)
    assert nat64 == []


# --- What goes wrong ---------------------------------------------------------------------------


def test_a_closed_port_is_a_connection_failure(
    transport: Transport, closed_port: Callable[[], int]
) -> None:
    with pytest.raises(ConnectionFailed, match="connection refused") as failed:
        transport.post(f"http://127.0.0.1:{closed_port()}/inbox", b"{}", SIGNED)

    assert not failed.value.permanent


def test_an_answer_with_two_content_lengths_is_a_malformed_answer(
    inboxes: Callable[..., Inbox], transport: Transport
) -> None:
    # requests raises it as the invalid header it also raises for one of ours.
    def framed_twice(handler: _Handler, seen: Seen) -> None:
        handler.close_connection = True
        handler.wfile.write(
            b"HTTP/1.1 202 Accepted\r\nContent-Length: 4\r\nContent-Length: 10\r\n\r\nbody"
        )

    with pytest.raises(ConnectionFailed, match=r"/inbox: malformed answer$") as failed:
        transport.post(inboxes(framed_twice).url(), b"{}", SIGNED)

    assert not failed.value.permanent


def test_a_header_that_cannot_be_sent_is_an_invalid_request_header(
    inbox: Inbox, transport: Transport
) -> None:
    with pytest.raises(ConnectionFailed, match=r"/inbox: invalid request header$"):
        transport.post(inbox.url(), b"{}", {**SIGNED, "X-Note": "two\nlines"})

    assert inbox.seen == []


@pytest.mark.parametrize(
    "url",
    ["ftp://x", "/relative", "http://", "https:///inbox", "http://host:99999/", "mailto:a@b.c"],
)
def test_invalid_urls(transport: Transport, url: str) -> None:
    with pytest.raises(InvalidURL) as invalid:
        transport.post(url, b"{}", SIGNED)

    assert invalid.value.permanent


def test_messages_carry_no_userinfo_or_query(
    inbox: Inbox, transports: Callable[..., Transport], closed_port: Callable[[], int]
) -> None:
    secret = "user:s3cret@"
    urls_and_errors: list[tuple[Transport, str, type[Exception]]] = [
        (
            transports(),
            f"http://{secret}127.0.0.1:{closed_port()}/inbox?token=t0ken",
            ConnectionFailed,
        ),
        (transports(), f"ftp://{secret}inbox.example/?token=t0ken", InvalidURL),
        (transports(), f"http:{secret}inbox.example/?token=t0ken", InvalidURL),
        (transports(), f"http://{secret}[::1/inbox?token=t0ken", InvalidURL),
        (transports(allowed_networks=()), inbox.url().replace("//", f"//{secret}"), RefusedAddress),
    ]
    for transport, url, error in urls_and_errors:
        with pytest.raises(error) as raised:
            transport.post(url, b"{}", SIGNED)
        message = str(raised.value)
        assert "s3cret" not in message, message
        assert "user" not in message, message
        assert "t0ken" not in message, message
        assert "\n" not in message, message


# --- Time --------------------------------------------------------------------------------------

# Dripped at 0.2 s a byte, the answers below take 20 s or more: far past any
# bound the tests assert, however busy the machine.
HEAD = b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n"


@pytest.mark.slow
@pytest.mark.parametrize(
    ("fast", "slow"),
    [
        pytest.param(b"", HEAD + b"x" * 100, id="headers"),
        pytest.param(HEAD, b"x" * 100, id="body"),
        pytest.param(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n", b"x" * 100, id="unsized"),
    ],
)
def test_a_dripping_answer_is_cut_off_at_the_attempt_timeout(
    inboxes: Callable[..., Inbox], transports: Callable[..., Transport], fast: bytes, slow: bytes
) -> None:
    def reply(handler: _Handler, seen: Seen) -> None:
        handler.wfile.write(fast)
        drip(slow)(handler, seen)

    inbox = inboxes(reply)
    transport = transports(attempt_timeout=1.5, connect_timeout=1.0)

    start = time.monotonic()
    with pytest.raises(AttemptTimeout) as late:
        transport.post(inbox.url() + "?token=t0ken", b"{}", SIGNED)
    elapsed = time.monotonic() - start

    assert 1.4 < elapsed < 8
    assert not late.value.permanent
    assert "t0ken" not in str(late.value)
    # The transport is still good for the next attempt.
    assert transport.post(inboxes().url(), b"{}", SIGNED).status == 202


@pytest.mark.slow
def test_a_deadline_sooner_than_the_attempt_timeout_cuts_the_answer_off_there(
    inboxes: Callable[..., Inbox], transports: Callable[..., Transport]
) -> None:
    inbox = inboxes(drip(HEAD + b"x" * 100))
    transport = transports(attempt_timeout=30.0)

    start = time.monotonic()
    with pytest.raises(AttemptTimeout, match=r"within 1\.5s"):
        transport.post(inbox.url(), b"{}", SIGNED, deadline=start + 1.5)

    assert 1.4 < time.monotonic() - start < 8


def test_a_deadline_already_past_is_a_timeout_without_a_connection(
    inbox: Inbox, transport: Transport
) -> None:
    with pytest.raises(AttemptTimeout, match="no time left") as late:
        transport.post(inbox.url(), b"{}", SIGNED, deadline=time.monotonic())

    assert not late.value.permanent
    assert inbox.connections == []


@pytest.mark.slow
@pytest.mark.parametrize("connect_timeout", [1.0, 10.0])
def test_a_server_that_never_reads_is_cut_off_while_sending(
    transports: Callable[..., Transport], connect_timeout: float
) -> None:
    # The kernel completes the handshake; nothing ever reads, so sending blocks once the
    # socket buffers are full.
    with socket.create_server(("127.0.0.1", 0)) as deaf:
        transport = transports(attempt_timeout=1.5, connect_timeout=connect_timeout)
        start = time.monotonic()
        with pytest.raises(AttemptTimeout):
            transport.post(f"http://127.0.0.1:{deaf.getsockname()[1]}/", b"x" * (64 << 20), {})

    assert time.monotonic() - start < 8


@pytest.fixture
def resolver(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Names ending in .example that never resolve: one slowly, one at once. No real DNS."""
    real = socket.getaddrinfo
    release = threading.Event()

    def getaddrinfo(host: Any, *args: Any, **kwargs: Any) -> Any:
        if host == "slow.example":
            release.wait(30)
        if str(host).endswith(".example"):
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    yield
    release.set()


@pytest.mark.slow
@pytest.mark.usefixtures("resolver")
def test_a_slow_name_lookup_is_bounded(transports: Callable[..., Transport]) -> None:
    transport = transports(attempt_timeout=1.5, connect_timeout=1.0)

    start = time.monotonic()
    with pytest.raises(AttemptTimeout, match=r"resolving slow\.example"):
        transport.post("http://slow.example/inbox", b"{}", SIGNED)

    assert time.monotonic() - start < 8


@pytest.mark.usefixtures("resolver")
def test_an_unknown_name_is_a_connection_failure(transport: Transport) -> None:
    with pytest.raises(ConnectionFailed, match=r"could not resolve nowhere\.example"):
        transport.post("https://nowhere.example/inbox", b"{}", SIGNED)


# --- Pooling -----------------------------------------------------------------------------------


def test_keep_alive_reuses_one_connection(inbox: Inbox, transport: Transport) -> None:
    for _ in range(3):
        assert transport.post(inbox.url(), b"{}", SIGNED).status == 202

    assert len(inbox.seen) == 3
    assert len(set(inbox.connections)) == 1


def test_an_idle_connection_is_closed_after_idle_timeout(
    inbox: Inbox, transports: Callable[..., Transport]
) -> None:
    transport = transports(idle_timeout=0.3)
    transport.post(inbox.url(), b"{}", SIGNED)
    transport.close_idle()  # not idle long enough yet
    (first,) = inbox.connections
    assert first not in inbox.closed

    time.sleep(0.5)
    transport.close_idle()

    assert inbox.wait_closed(first)
    transport.post(inbox.url(), b"{}", SIGNED)
    assert len(set(inbox.connections)) == 2


def test_post_itself_closes_idle_connections(
    inbox: Inbox, transports: Callable[..., Transport]
) -> None:
    transport = transports(idle_timeout=0.3)
    transport.post(inbox.url(), b"{}", SIGNED)
    time.sleep(0.5)
    transport.post(inbox.url(), b"{}", SIGNED)

    assert len(set(inbox.connections)) == 2
    assert inbox.wait_closed(inbox.connections[0])


def test_close_closes_pooled_connections(inbox: Inbox, transport: Transport) -> None:
    transport.post(inbox.url(), b"{}", SIGNED)
    transport.close()

    assert inbox.wait_closed(inbox.connections[0])
    assert transport.post(inbox.url(), b"{}", SIGNED).status == 202


def test_idle_connections_past_the_limit_are_closed_least_recently_used_first(
    inboxes: Callable[..., Inbox], transports: Callable[..., Transport]
) -> None:
    transport = transports(max_idle_connections=2)
    first, second, third = (inboxes() for _ in range(3))
    for inbox in (first, second, first, third):
        assert transport.post(inbox.url(), b"{}", SIGNED).status == 202

    # first was used again after second: second goes, first and third stay.
    assert second.wait_closed(second.connections[0])
    assert len(first.connections) == 1, "first's connection was reused, not opened again"
    assert not first.wait_until(lambda: bool(first.closed), timeout=0.3)
    assert third.closed == []
    assert len(idle.IDLE) == 2


def test_the_bound_holds_across_transports_and_a_closed_one_connects_again(
    inboxes: Callable[..., Inbox], transports: Callable[..., Transport]
) -> None:
    # One transport to a worker thread; the bound is the process's.
    one, other = transports(max_idle_connections=1), transports(max_idle_connections=1)
    near, far = inboxes(), inboxes()
    one.post(near.url(), b"{}", SIGNED)
    other.post(far.url(), b"{}", SIGNED)

    assert near.wait_closed(near.connections[0]), "closed although another transport's"
    assert one.post(near.url(), b"{}", SIGNED).status == 202
    assert len(near.connections) == 2
    assert far.wait_closed(far.connections[0])


def test_a_connection_in_use_is_never_closed_as_idle(
    inboxes: Callable[..., Inbox], transports: Callable[..., Transport]
) -> None:
    def second_slowly(handler: _Handler, seen: Seen) -> None:
        if len(handler.inbox.seen) > 1:
            time.sleep(1.0)
        accepted(handler, seen)

    slow = inboxes(second_slowly)
    busy, other = transports(max_idle_connections=1), transports(max_idle_connections=1)
    busy.post(slow.url(), b"{}", SIGNED)  # idle a moment, then taken to send on again
    statuses: list[int] = []
    sending = threading.Thread(
        target=lambda: statuses.append(busy.post(slow.url(), b"{}", SIGNED).status)
    )
    sending.start()
    assert slow.wait_until(lambda: len(slow.seen) == 2)
    fast = inboxes()
    for _ in range(3):
        assert other.post(fast.url(), b"{}", SIGNED).status == 202
    assert len(fast.connections) == 1, "kept: the one in use does not count as idle"
    sending.join(10)

    assert statuses == [202]
    assert len(slow.connections) == 1
    # Put back last, the busy one is kept, and the other, now past the bound, closed.
    assert fast.wait_closed(fast.connections[0])
    assert slow.closed == []
    assert len(idle.IDLE) == 1


@pytest.mark.parametrize("sharing", [False, True], ids=["own connections", "shared"])
def test_threads_sharing_a_small_bound_all_get_their_answers(
    inboxes: Callable[..., Inbox],
    transports: Callable[..., Transport],
    shared: Callable[..., Connections],
    sharing: bool,
) -> None:
    # Each thread's idle connections are closed by the others all the time (and
    # shared, taken and put back by them too); none of them may be closed while
    # a thread has taken it to send on.
    connections = shared(max_idle_connections=1) if sharing else None
    targets = [inboxes() for _ in range(4)]
    statuses: list[int] = []
    errors: list[Exception] = []

    def send(transport: Transport) -> None:
        try:
            for number in range(25):
                inbox = targets[number % len(targets)]
                statuses.append(transport.post(inbox.url(), b"{}", SIGNED).status)
        except Exception as exc:
            errors.append(exc)

    threads = [
        threading.Thread(target=send, args=(transports(connections, max_idle_connections=1),))
        for _ in range(4)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)

    assert errors == []
    assert statuses == [202] * 100
    assert len(idle.IDLE) <= 1


def test_transports_sharing_connections_reuse_the_one_another_left_idle(
    inbox: Inbox, transports: Callable[..., Transport], shared: Callable[..., Connections]
) -> None:
    connections = shared()
    one, other = transports(connections), transports(connections)
    for transport in (one, other, one):
        assert transport.post(inbox.url(), b"{}", SIGNED).status == 202

    assert len(inbox.seen) == 3
    assert len(set(inbox.connections)) == 1

    # Each with connections of its own, each opens one.
    for transport in (transports(), transports()):
        assert transport.post(inbox.url(), b"{}", SIGNED).status == 202
    assert len(set(inbox.connections)) == 3


def test_a_connection_one_transport_may_use_carries_no_request_another_may_not_send(
    inbox: Inbox, transports: Callable[..., Transport], shared: Callable[..., Connections]
) -> None:
    # The deliverer's kinds share connections, and may allow different
    # networks (a webhook on the local network, inboxes only on public
    # addresses): a connection one opened is judged again for the other.
    connections = shared()
    webhooks = transports(connections)  # loopback allowed
    inboxes_only = transports(connections, allowed_networks=())
    assert webhooks.post(inbox.url("/hook"), b"{}", SIGNED).status == 202

    with pytest.raises(RefusedAddress, match="not a public address"):
        inboxes_only.post(inbox.url("/internal/reset"), b"{}", SIGNED)

    assert [seen.path for seen in inbox.seen] == ["/hook"]
    assert webhooks.post(inbox.url("/hook"), b"{}", SIGNED).status == 202


def test_closing_a_transport_leaves_shared_connections_to_their_owner(
    inbox: Inbox, transports: Callable[..., Transport], shared: Callable[..., Connections]
) -> None:
    connections = shared()
    one, other = transports(connections), transports(connections)
    one.post(inbox.url(), b"{}", SIGNED)
    one.close()
    assert other.post(inbox.url(), b"{}", SIGNED).status == 202
    assert len(inbox.connections) == 1

    connections.close()

    assert inbox.wait_closed(inbox.connections[0])
    assert other.post(inbox.url(), b"{}", SIGNED).status == 202
    assert len(inbox.connections) == 2
    assert len(idle.IDLE) == 1


def test_more_at_once_to_a_host_than_it_keeps_idle_are_closed_quietly_after(
    inboxes: Callable[..., Inbox],
    transports: Callable[..., Transport],
    shared: Callable[..., Connections],
    caplog: pytest.LogCaptureFixture,
) -> None:
    def together(handler: _Handler, seen: Seen) -> None:
        # Within the client's 5 s attempt timeout.
        handler.inbox.wait_until(lambda: len(handler.inbox.seen) >= 3, timeout=4)
        accepted(handler, seen)

    inbox = inboxes(together)
    connections = shared(connections_per_host=1)
    statuses: list[int] = []
    threads = [
        threading.Thread(
            target=lambda transport: statuses.append(
                transport.post(inbox.url(), b"{}", SIGNED).status
            ),
            args=(transports(connections),),
        )
        for _ in range(3)
    ]
    with caplog.at_level(logging.DEBUG, logger="urllib3"):
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(10)

    assert statuses == [202] * 3
    assert len(inbox.connections) == 3
    assert inbox.wait_until(lambda: len(inbox.closed) == 2), "one kept idle, two closed"
    assert len(idle.IDLE) == 1
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


@pytest.mark.slow
def test_an_attempt_cut_off_on_shared_connections_leaves_another_thread_s_requests_whole(
    inboxes: Callable[..., Inbox],
    transports: Callable[..., Transport],
    shared: Callable[..., Connections],
) -> None:
    # The late attempt drops the host's pool: the other thread, sending to the
    # same host all along, loses no request to it.
    def reply(handler: _Handler, seen: Seen) -> None:
        if seen.path == "/slow":
            drip(HEAD + b"x" * 100)(handler, seen)
        else:
            accepted(handler, seen)

    inbox = inboxes(reply)
    connections = shared()
    late, other = transports(connections), transports(connections)
    statuses: list[int] = []
    errors: list[Exception] = []
    done = threading.Event()

    def keep_sending() -> None:
        try:
            while not done.is_set():
                statuses.append(other.post(inbox.url("/fast"), b"{}", SIGNED).status)
        except Exception as exc:
            errors.append(exc)

    sending = threading.Thread(target=keep_sending)
    sending.start()
    try:
        with pytest.raises(AttemptTimeout):
            late.post(inbox.url("/slow"), b"{}", SIGNED, deadline=time.monotonic() + 1.0)
        after = len(statuses)
        assert inbox.wait_until(lambda: len(statuses) >= after + 5, timeout=10)
    finally:
        done.set()
        sending.join(10)

    assert errors == []
    assert len(statuses) >= 5 and set(statuses) == {202}


# --- TLS ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tls_server_context(tmp_path_factory: pytest.TempPathFactory) -> ssl.SSLContext:
    """A self-signed certificate for 127.0.0.1."""
    x509 = pytest.importorskip("cryptography.x509")
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .sign(key, hashes.SHA256())
    )
    directory: Path = tmp_path_factory.mktemp("tls")
    (directory / "cert.pem").write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    (directory / "key.pem").write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(directory / "cert.pem", directory / "key.pem")
    return context


def test_tls_is_verified(
    inboxes: Callable[..., Inbox], transport: Transport, tls_server_context: ssl.SSLContext
) -> None:
    inbox = inboxes(tls=tls_server_context)

    with pytest.raises(ConnectionFailed, match="TLS certificate not accepted"):
        transport.post(inbox.url(), b"{}", SIGNED)

    assert inbox.seen == []


@pytest.mark.filterwarnings("ignore::urllib3.exceptions.InsecureRequestWarning")
def test_tls_unverified_when_so_configured_and_kept_alive(
    inboxes: Callable[..., Inbox],
    transports: Callable[..., Transport],
    tls_server_context: ssl.SSLContext,
) -> None:
    inbox = inboxes(tls=tls_server_context)
    transport = transports(verify_tls=False)

    for _ in range(2):
        assert transport.post(inbox.url(), b"{}", SIGNED).status == 202

    assert len(set(inbox.connections)) == 1


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::urllib3.exceptions.InsecureRequestWarning")
def test_a_dripping_tls_answer_on_a_reused_connection_is_cut_off(
    inboxes: Callable[..., Inbox],
    transports: Callable[..., Transport],
    tls_server_context: ssl.SSLContext,
) -> None:
    def second_drips(handler: _Handler, seen: Seen) -> None:
        if len(handler.inbox.seen) == 1:
            accepted(handler, seen)
        else:
            drip(HEAD + b"x" * 100)(handler, seen)

    inbox = inboxes(second_drips, tls=tls_server_context)
    transport = transports(verify_tls=False, attempt_timeout=1.5, connect_timeout=1.0)
    transport.post(inbox.url(), b"{}", SIGNED)

    start = time.monotonic()
    with pytest.raises(AttemptTimeout):
        transport.post(inbox.url(), b"{}", SIGNED)

    assert time.monotonic() - start < 8
    assert len(set(inbox.connections)) == 1  # the pooled connection was the one cut off


# --- Retry-After -------------------------------------------------------------------------------

NOW = 1_750_000_000.0


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        ("120", 120.0),
        (" 0 ", 0.0),
        (email.utils.formatdate(NOW + 90, usegmt=True), 90.0),
        (email.utils.formatdate(NOW - 90, usegmt=True), 0.0),  # in the past: now
        ("-5", None),
        ("1.5", None),
        ("soon", None),
        ("", None),
        (None, None),
        ("9" * 400, 999999999999.0),  # longer than anyone waits: as long as can be said
        ("9" * 5000, 999999999999.0),  # past int()'s own limit on digits
        ("0" * 20 + "7", 7.0),
        ("999999999999", 999999999999.0),
        ("1" + "0" * 12, 999999999999.0),
        ("Mon, 99 Foo 2025 99:99:99 GMT", None),
    ],
)
def test_parse_retry_after(value: str | None, seconds: float | None) -> None:
    assert parse_retry_after(value, now=NOW) == seconds


def test_parse_retry_after_counts_from_now_by_default() -> None:
    later = email.utils.formatdate(time.time() + 60, usegmt=True)
    waited = parse_retry_after(later)
    assert waited is not None
    assert 55 < waited <= 60


def test_urllib3_s_request_lines_keep_no_query_and_no_secret_a_caller_names(
    inbox: Inbox, transport: Transport, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.DEBUG, logger="urllib3"):
        transport.post(inbox.url("/inbox?token=qu3ryS3cret"), b"{}", SIGNED)
        with logs.redacting(lambda text: text.replace("pathS3cret", "[redacted]")):
            transport.post(inbox.url("/hooks/pathS3cret"), b"{}", SIGNED)
        transport.post(inbox.url("/hooks/pathS3cret"), b"{}", SIGNED)
    lines = [record.getMessage() for record in caplog.records if "POST" in record.getMessage()]
    assert len(lines) == 3
    assert "/inbox " in lines[0] and "qu3ryS3cret" not in lines[0]
    assert "/hooks/[redacted]" in lines[1]
    # Only while the caller asks: its own secret, not every path.
    assert "/hooks/pathS3cret" in lines[2]


def formatted(caplog: pytest.LogCaptureFixture) -> str:
    """Every record as a handler writes it, with any traceback or stack."""
    formatter = logging.Formatter("%(name)s %(levelname)s %(message)s")
    return "\n".join(formatter.format(record) for record in caplog.records)


@pytest.mark.parametrize("prefix", ["", "[deliverer 1/2 pid 123] "], ids=["alone", "processes"])
def test_an_answer_s_malformed_header_lines_reach_no_log(
    inboxes: Callable[..., Inbox],
    transport: Transport,
    caplog: pytest.LogCaptureFixture,
    request: pytest.FixtureRequest,
    prefix: str,
) -> None:
    # Past a line that is no header, urllib3 parses none, and warns with the
    # rest and a traceback: where an inbox echoes its target (a
    # Content-Location, a Link), and up to megabytes of a stranger's text.
    # Under --processes, each line begun with its process's name was not
    # taken for that warning, and went out with what the answer echoed.
    from django_federation_delivery.management.running import prefix_log_records

    request.addfinalizer(
        functools.partial(logging.setLogRecordFactory, logging.getLogRecordFactory())
    )
    prefix_log_records(prefix)

    def echo(handler: _Handler, seen: Seen) -> None:
        handler.close_connection = True
        handler.wfile.write(
            b"HTTP/1.1 202 Accepted\r\nX Powered By PHP\r\n"
            b"Content-Location: " + seen.path.encode() + b"\r\n"
            b"X-Padding: " + b"x" * 60_000 + b"\r\n\r\n"
        )

    inbox = inboxes(echo)
    with caplog.at_level(logging.DEBUG, logger="urllib3"):
        got = transport.post(inbox.url("/inbox?token=qu3ryS3cret"), b"{}", SIGNED)
        with logs.redacting(lambda text: text.replace("pathS3cret", "[redacted]")):
            transport.post(inbox.url("/hooks/pathS3cret"), b"{}", SIGNED)

    assert got.status == 202
    text = formatted(caplog)
    assert "qu3ryS3cret" not in text and "pathS3cret" not in text
    assert "Traceback" not in text
    assert len(text) < 2000
    warnings = [record for record in caplog.records if record.levelno == logging.WARNING]
    assert [record.getMessage() for record in warnings] == [
        f"{prefix}Failed to parse headers (url=http://127.0.0.1:{inbox.port}{path}): "
        "malformed header lines in the answer"
        for path in ("/inbox", "/hooks/[redacted]")
    ]


def test_urllib3_s_lines_show_any_value_as_its_text_cut_and_no_traceback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    echoed = ValueError("POST /inbox?token=qu3ryS3cret HTTP/1.1")
    with caplog.at_level(logging.DEBUG, logger="urllib3"):
        try:
            raise echoed
        except ValueError:
            logging.getLogger("urllib3.connectionpool").warning(
                "broken by %r (%d): %s", echoed, 7, "y" * 100_000, exc_info=True, stack_info=True
            )

    text = formatted(caplog)
    assert "qu3ryS3cret" not in text
    assert "Traceback" not in text and "Stack" not in text
    (record,) = caplog.records
    assert record.getMessage() == f"broken by 'POST /inbox' (7): {'y' * 200}..."
