"""A stranger's URL must not reach private addresses (SSRF), under the
DEFAULT settings (no private network allowed).

Every connect() any socket makes is recorded; one to anything but loopback is
refused on the spot (ENETUNREACH), so nothing leaves the machine. Loopback
servers count the connections they accept.
"""

from __future__ import annotations

import base64
import errno
import ipaddress
import socket
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from django_federation_delivery import send, send_webhook
from django_federation_delivery.exceptions import RefusedAddress, TransportError
from django_federation_delivery.models import Delivery, Host, Status
from django_federation_delivery.transport import Transport, TransportSettings

from .conftest import Inbox, RunningDeliverer, wait_until
from .keys import ALICE

NOTE = {"type": "Create", "object": {"type": "Note", "content": "hi"}}
PUBLIC = "93.184.215.14"  # never reached: its connect is refused by the fixture


def is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address.split("%")[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


@pytest.fixture
def connects(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Each address any socket tries to connect to; only loopback gets through."""
    tried: list[str] = []
    real = socket.socket.connect

    def connect(self: socket.socket, address: Any) -> None:
        if self.family in (socket.AF_INET, socket.AF_INET6):
            tried.append(str(address[0]))
            if not is_loopback(str(address[0])):
                raise OSError(errno.ENETUNREACH, "Network is unreachable")
        real(self, address)

    monkeypatch.setattr(socket.socket, "connect", connect)
    return tried


def answers(monkeypatch: pytest.MonkeyPatch, names: dict[str, list[list[str]]]) -> list[str]:
    """Fake DNS: each name in ``names`` answers its lists of addresses in turn (the
    last one again and again); the names asked are listed."""
    real = socket.getaddrinfo
    asked: list[str] = []
    turns: dict[str, int] = {}

    def getaddrinfo(host: Any, port: Any, *args: Any, **kwargs: Any) -> Any:
        if host in names:
            asked.append(host)
            turn = turns.get(host, 0)
            turns[host] = turn + 1
            found = names[host][min(turn, len(names[host]) - 1)]
            infos = []
            for address in found:
                if ":" in address:
                    infos.append(
                        (socket.AF_INET6, socket.SOCK_STREAM, 6, "", (address, int(port), 0, 0))
                    )
                else:
                    infos.append((socket.AF_INET, socket.SOCK_STREAM, 6, "", (address, int(port))))
            return infos
        return real(host, port, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    return asked


@pytest.fixture
def default_transport() -> Iterator[Transport]:
    transport = Transport(
        TransportSettings(
            user_agent="tests", connect_timeout=2.0, attempt_timeout=4.0, allowed_networks=()
        )
    )
    yield transport
    transport.close()


def post(transport: Transport, url: str) -> BaseException | int:
    try:
        return transport.post(url, b"{}", {"Content-Type": "application/activity+json"}).status
    except TransportError as exc:
        return exc


# --- Numeric forms -----------------------------------------------------------------------------

NUMERIC = [
    "http://2130706433:{port}/",
    "http://0x7f000001:{port}/",
    "http://0177.0.0.1:{port}/",
    "http://127.1:{port}/",
    "http://127.0.1:{port}/",
    "http://0x7f.1:{port}/",
    "http://127.0.0.1:{port}/",
    "http://127.0.0.1.:{port}/",
    "http://0.0.0.0:{port}/",
    "http://0:{port}/",
    "http://[::]:{port}/",
    "http://[::1]:{port}/",
    "http://[::ffff:127.0.0.1]:{port}/",
    "http://[::ffff:7f00:1]:{port}/",
    "http://[::127.0.0.1]:{port}/",
    "http://[64:ff9b::127.0.0.1]:{port}/",
    "http://[64:ff9b::a00:1]:{port}/",
    "http://[2002:7f00:1::1]:{port}/",
    "http://[2002:a9fe:a9fe::1]:{port}/",
    "http://169.254.169.254:{port}/latest/meta-data/",
    "http://[::ffff:169.254.169.254]:{port}/",
    "http://100.64.0.1:{port}/",
    "http://10.0.0.1:{port}/",
    "http://192.168.1.1:{port}/",
    "http://172.16.0.1:{port}/",
    "http://224.0.0.1:{port}/",
    "http://255.255.255.255:{port}/",
    "http://10.255.255.255:{port}/",
    "http://[fd00:ec2::254]:{port}/",
    "http://[fe80::1]:{port}/",
    "http://[ff02::1]:{port}/",
    "http://allowed.example@127.0.0.1:{port}/",
    "http://allowed.example\\@127.0.0.1:{port}/",
    "http://127.0.0.1:{port}\\@allowed.example/",
    "http://127.0.0.1\t:{port}/",
    "http://127.0.0.1:{port}#@allowed.example/",
    "https://127.0.0.1:{port}/",
]


@pytest.mark.parametrize("template", NUMERIC)
def test_a_private_address_in_any_form_is_refused_without_a_connection(
    template: str,
    inboxes: Callable[..., Inbox],
    connects: list[str],
    default_transport: Transport,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    inbox = inboxes("127.0.0.1")
    answers(monkeypatch, {"allowed.example": [[PUBLIC]], "127.0.0.1.": [["127.0.0.1"]]})
    outcome = post(default_transport, template.format(port=inbox.port))
    assert not isinstance(outcome, int), outcome
    assert all(address == PUBLIC for address in connects), connects
    assert inbox.connections == 0


# --- Names -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "found",
    [["127.0.0.1"], ["10.0.0.1"], ["169.254.169.254"], ["::1"], ["::ffff:127.0.0.1"], ["0.0.0.0"]],
)
def test_a_name_resolving_to_a_private_address_is_refused_without_a_connection(
    found: list[str],
    inboxes: Callable[..., Inbox],
    connects: list[str],
    default_transport: Transport,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    inbox = inboxes("127.0.0.1")
    answers(monkeypatch, {"evil.example": [found]})
    outcome = post(default_transport, f"http://evil.example:{inbox.port}/inbox")
    assert isinstance(outcome, RefusedAddress), outcome
    assert "not a public address" in str(outcome)
    assert connects == []
    assert inbox.connections == 0


@pytest.mark.parametrize("order", [[PUBLIC, "127.0.0.1"], ["127.0.0.1", PUBLIC]])
def test_a_name_resolving_to_public_and_private_connects_to_the_public_one_only(
    order: list[str],
    inboxes: Callable[..., Inbox],
    connects: list[str],
    default_transport: Transport,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    inbox = inboxes("127.0.0.1")
    answers(monkeypatch, {"mixed.example": [order]})
    post(default_transport, f"http://mixed.example:{inbox.port}/inbox")
    assert connects == [PUBLIC]
    assert inbox.connections == 0


def test_dns_rebinding_connects_to_the_address_checked(
    inboxes: Callable[..., Inbox],
    connects: list[str],
    default_transport: Transport,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    inbox = inboxes("127.0.0.1")
    asked = answers(monkeypatch, {"rebind.example": [[PUBLIC], ["127.0.0.1"]]})
    post(default_transport, f"http://rebind.example:{inbox.port}/inbox")
    post(default_transport, f"http://rebind.example:{inbox.port}/inbox")
    assert connects == [PUBLIC]
    assert len(asked) == 2
    assert inbox.connections == 0


# --- Environment proxies -----------------------------------------------------------------------


def test_an_environment_proxy_is_not_used(
    inboxes: Callable[..., Inbox],
    connects: list[str],
    default_transport: Transport,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    proxy = inboxes("127.0.0.1")
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"):
        monkeypatch.setenv(name.lower(), f"http://127.0.0.1:{proxy.port}")
        monkeypatch.setenv(name, f"http://127.0.0.1:{proxy.port}")
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    answers(monkeypatch, {"public.example": [[PUBLIC]]})
    for scheme in ("http", "https"):
        outcome = post(default_transport, f"{scheme}://public.example/inbox")
        assert "prox" not in str(outcome)
    assert proxy.connections == 0
    assert set(connects) == {PUBLIC}


# --- Redirects ---------------------------------------------------------------------------------


@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
def test_a_redirect_to_a_private_address_is_not_followed(
    status: int,
    inboxes: Callable[..., Inbox],
    connects: list[str],
) -> None:
    internal = inboxes("127.0.0.3")
    redirecting = inboxes(
        "127.0.0.2",
        respond=lambda request: (status, {"Location": internal.url("/admin")}, b""),
    )
    # The redirecting host alone is allowed, as an intranet inbox would be.
    with Transport(
        TransportSettings(
            user_agent="tests",
            attempt_timeout=4.0,
            allowed_networks=(ipaddress.ip_network("127.0.0.2/32"),),
        )
    ) as transport:
        assert post(transport, redirecting.url("/inbox")) == status
    assert internal.connections == 0


# --- Through send() and the deliverer, on the default settings ---------------------------------


def defaults(settings: Any, **extra: Any) -> None:
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "ALLOWED_NETWORKS": [],
        "WEBHOOK_ALLOWED_NETWORKS": [],
        **extra,
    }


@pytest.mark.django_db(transaction=True)
def test_inboxes_a_stranger_names_on_private_addresses_are_refused_and_say_why(
    inboxes: Callable[..., Inbox],
    start_deliverer: Callable[..., RunningDeliverer],
    settings: Any,
    connects: list[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    defaults(settings)
    inbox = inboxes("127.0.0.1")
    answers(monkeypatch, {"evil.example": [["127.0.0.1"]], "meta.example": [["169.254.169.254"]]})
    secret = "tok3n-SECRET-value"
    urls = [
        inbox.url(f"/inbox?token={secret}"),
        f"http://evil.example:{inbox.port}/inbox?token={secret}",
        f"http://meta.example:{inbox.port}/inbox",
        f"http://[::ffff:7f00:1]:{inbox.port}/inbox",
        f"http://100.64.0.1:{inbox.port}/inbox",
    ]
    batch = send(ALICE, NOTE, urls)
    assert batch is not None
    runner = start_deliverer()
    wait_until(lambda: not Delivery.objects.filter(status=Status.PENDING).exists(), timeout=20)
    runner.stop()
    rows = list(Delivery.objects.all())
    assert len(rows) == len(urls)
    for row in rows:
        assert row.status == Status.REFUSED, (row.inbox, row.status, row.last_error)
        assert "not a public address" in row.last_error
        assert secret not in row.last_error
        # Refused before a request: never attempted, and nothing of its host.
        assert row.last_attempt_at is None
    assert not Host.objects.filter(failing_since__isnull=False).exists()
    assert inbox.connections == 0
    assert connects == []


@pytest.mark.django_db(transaction=True)
def test_a_portable_inbox_whose_gateways_are_private_is_refused(
    inboxes: Callable[..., Inbox],
    start_deliverer: Callable[..., RunningDeliverer],
    settings: Any,
    connects: list[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from django_federation_delivery import PortableInbox, send_portable

    defaults(settings)
    gateway = inboxes("127.0.0.1")
    answers(monkeypatch, {"gw.example": [["10.1.2.3"]]})
    did = "did:key:z6MkhaXgBZDvotDkL5257faiztiGiC2QtKLGpbnnEGta2doK"
    batch = send_portable(
        ALICE,
        NOTE,
        [
            PortableInbox(
                f"ap://{did}/actor/inbox",
                [gateway.url(""), "http://gw.example", f"http://[::ffff:7f00:1]:{gateway.port}"],
            )
        ],
    )
    assert batch is not None
    runner = start_deliverer()
    wait_until(lambda: not Delivery.objects.filter(status=Status.PENDING).exists(), timeout=20)
    runner.stop()
    (row,) = Delivery.objects.all()
    assert row.status == Status.REFUSED, (row.status, row.last_error)
    assert "not a public address" in row.last_error
    assert gateway.connections == 0
    assert connects == []


@pytest.mark.django_db(transaction=True)
def test_a_webhook_destination_on_loopback_is_refused_by_default(
    inboxes: Callable[..., Inbox],
    start_deliverer: Callable[..., RunningDeliverer],
    settings: Any,
    connects: list[str],
) -> None:
    receiver = inboxes("127.0.0.1")
    secret = "whsec_" + base64.b64encode(b"k" * 32).decode()
    defaults(
        settings,
        WEBHOOKS={"ops": f"http://127.0.0.1:{receiver.port}/hook?secret={secret}"},
        WEBHOOK_RETRY=[0.1],
    )
    send_webhook("ops", "alert.raised", {"n": 1})
    runner = start_deliverer()
    wait_until(lambda: Delivery.objects.exclude(last_error="").exists(), timeout=20)
    runner.stop()
    (row,) = Delivery.objects.all()
    # Held, the operator's to open (WEBHOOK_ALLOWED_NETWORKS): no try spent.
    assert (row.status, row.attempts) == (Status.PENDING, 0)
    assert "not a public address" in row.last_error
    assert secret not in row.last_error
    assert receiver.connections == 0
    assert connects == []
