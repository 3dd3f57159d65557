"""The one home of a URL: its canonical form (a table of spellings, its
properties, and the wire), and what a message may show of it.

End to end, a URL is either refused when queued, with a reason, or sent to a real
local inbox whose received path is the one both independent verifiers (pyhttpsig
for draft-cavage, http-message-signatures for RFC 9421) accept.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import itertools
import json
import logging
import time
from collections.abc import Iterator

import pytest
import requests.utils

import django_federation_delivery
from django_federation_delivery import addresses, send
from django_federation_delivery.addresses import (
    credentials,
    host_of,
    normalize_inbox,
    origin,
    redact,
    replace_secrets,
    url_prefixes,
    validate_inbox,
)
from django_federation_delivery.attempt import AttemptResult
from django_federation_delivery.channels.activitypub import ActivityPub, InboxJob
from django_federation_delivery.exceptions import InvalidDelivery
from django_federation_delivery.models import Batch, Delivery
from django_federation_delivery.signatures import Scheme, SenderKey
from django_federation_delivery.transport import Transport, TransportSettings

from .conftest import Inbox, Received, Unprintable
from .keys import ALICE, rsa_key
from .test_signatures import cavage_verifies, prepared, rfc9421_verify

DID = "did:key:z6MkhaXgBZDvotDkL5257faiztiGiC2QtKLGpbnnEGta2doK"

CANONICAL = [
    ("https://a.example/inbox", "https://a.example/inbox"),
    ("HTTPS://A.Example:443/inbox", "https://a.example/inbox"),
    ("http://a.example:80", "http://a.example/"),
    ("http://a.example:443/", "http://a.example:443/"),
    ("https://a.example:08443/x", "https://a.example:8443/x"),
    ("https://a.example./inbox", "https://a.example/inbox"),
    ("https://a.example?x=1", "https://a.example/?x=1"),
    ("https://a.example/inbox?", "https://a.example/inbox"),
    ("https://a.example/inbox#frag", "https://a.example/inbox"),
    ("https://a.example/inbox?q=1#frag", "https://a.example/inbox?q=1"),
    # IDNA (UTS #46): mapped, lowercased, punycoded.
    ("https://exämple.com/inbox", "https://xn--exmple-cua.com/inbox"),
    ("https://EXÄMPLE.com/inbox", "https://xn--exmple-cua.com/inbox"),
    ("https://xn--exmple-cua.com/inbox", "https://xn--exmple-cua.com/inbox"),
    ("https://faß.de/", "https://xn--fa-hia.de/"),
    ("https://ｅｘａｍｐｌｅ。com/", "https://example.com/"),
    ("https://ex_ample.com/", "https://ex_ample.com/"),
    # IP literals.
    ("http://127.0.0.1:8080/inbox", "http://127.0.0.1:8080/inbox"),
    ("http://127.0.0.1./inbox", "http://127.0.0.1/inbox"),
    ("http://１２７.０.０.１/", "http://127.0.0.1/"),
    ("https://[2001:DB8:0:0::1]:8443/inbox", "https://[2001:db8::1]:8443/inbox"),
    # IPv4-mapped in hexadecimal groups, as a WHATWG URL (Node's) writes it.
    ("https://[::FFFF:127.0.0.1]/", "https://[::ffff:7f00:1]/"),
    ("https://[::ffff:7f00:1]/", "https://[::ffff:7f00:1]/"),
    ("http://[::ffff:1.2.3.4]:8080/inbox", "http://[::ffff:102:304]:8080/inbox"),
    ("https://[::ffff:0.0.0.0]/", "https://[::ffff:0:0]/"),
    # Path and query, percent-encoded exactly once.
    ("https://a.example/ïnbox/é", "https://a.example/%C3%AFnbox/%C3%A9"),
    ("https://a.example/%c3%a9", "https://a.example/%C3%A9"),
    ("https://a.example/%7e%41%2D", "https://a.example/~A-"),
    ("https://a.example/%2f%3F", "https://a.example/%2F%3F"),
    ("https://a.example/%zz/100%", "https://a.example/%25zz/100%25"),
    ("https://a.example/%4", "https://a.example/%254"),
    ('https://a.example/|<>"{}^\\`', "https://a.example/%7C%3C%3E%22%7B%7D%5E%5C%60"),
    ("https://a.example/[x]", "https://a.example/%5Bx%5D"),
    ("https://a.example/~u/!$&'()*+,;=:@", "https://a.example/~u/!$&'()*+,;=:@"),
    ("https://a.example/@alice/inbox", "https://a.example/@alice/inbox"),
    ("https://a.example/a/../b/./c", "https://a.example/b/c"),
    ("https://a.example/a/%2E%2E/b", "https://a.example/b"),
    ("https://a.example/../..", "https://a.example/"),
    ("https://a.example/a/b/..", "https://a.example/a/"),
    ("https://a.example//x//", "https://a.example//x//"),
    ("https://a.example/x?a=1&b=|é&c=%zz?/", "https://a.example/x?a=1&b=%7C%C3%A9&c=%25zz?/"),
    ("https://a.example/x?a[]=1", "https://a.example/x?a%5B%5D=1"),
    # An apostrophe is kept in a path and encoded in a query, as WHATWG does.
    ("https://a.example/it's?q='x'", "https://a.example/it's?q=%27x%27"),
    ("https://a.example/x?q=%27", "https://a.example/x?q=%27"),
    ("https://a.example/\u202eevil", "https://a.example/%E2%80%AEevil"),
]

REFUSED = [
    ("", "is empty"),
    ("/inbox", "not an absolute http(s) URL"),
    ("a.example/inbox", "not an absolute http(s) URL"),
    ("https:a.example/inbox", "not an absolute http(s) URL"),
    ("https:/a.example/inbox", "not an absolute http(s) URL"),
    ("ftp://a.example/inbox", "has scheme 'ftp'"),
    ("javascript://a.example/%0Aalert(1)", "has scheme 'javascript'"),
    ("https://", "has no host"),
    ("https:///inbox", "has no host"),
    ("https://u:p@a.example/inbox", "carries a user or password"),
    ("https://u@a.example/inbox", "carries a user or password"),
    ("https://@a.example/inbox", "carries a user or password"),
    ("https://a.example\\@b.example/", "carries a user or password"),
    ("https://a.example\\b.example/", "DNS name cannot carry"),
    ("https://a.example:0/inbox", "port 0"),
    ("https://a.example:99999/inbox", "port 99999"),
    ("https://a.example:123456/inbox", "not a number from 1 to 65535"),
    ("https://a.example:/inbox", "not a number"),
    ("https://a.example:+80/inbox", "not a number"),
    ("https://a.example:http/inbox", "not a number"),
    ("https://a.example/in\r\nX-Injected: 1", "(U+000D)"),
    ("https://a.example/in\tbox", "(U+0009)"),
    ("https://a.example/in box", "(U+0020)"),
    (" https://a.example/inbox", "(U+0020)"),
    ("https://a.example/inbox\n", "(U+000A)"),
    ("https://a.example/\x00", "(U+0000)"),
    ("https://a.example/\x7f", "(U+007F)"),
    ("https://a.example/\x85", "(U+0085)"),
    ("https://a.example/\u00a0", "(U+00A0)"),
    ("https://a.example/\u2028", "(U+2028)"),
    ("https://a.example/\u3000", "(U+3000)"),
    ("https://a.example/\ud800", "(U+D800)"),
    ("https://a..example/", "empty label"),
    ("https://.a.example/", "empty label"),
    ("https://a.example../", "empty label"),
    ("https://a%2Eexample/", "percent-encoded host"),
    ("https://a*.example/", "DNS name cannot carry"),
    ("https://xn--zz.example/", "not a valid IDNA name"),
    ("https://a\u200db.example/", "not a valid IDNA name"),
    ("https://" + "a" * 64 + ".example/", "label longer than 63"),
    ("https://" + ("a" * 60 + ".") * 5 + "example/", "host longer than 253"),
    # 251 characters, and a port: longer than a delivery's host may be.
    ("https://" + ("a" * 62 + ".") * 3 + "a" * 62 + ":8443/", "host and port longer than 255"),
    ("https://127.1/", "dotted-quad"),
    ("https://2130706433/", "dotted-quad"),
    ("https://0x7f.0.0.1/", "dotted-quad"),
    ("https://127.000.000.001/", "dotted-quad"),
    ("https://a.example.1/", "dotted-quad"),
    ("https://[::1/inbox", "malformed IPv6"),
    ("https://[::1]x/inbox", "malformed IPv6"),
    ("https://[::1%25eth0]/", "IPv6 address with a zone"),
    ("https://[1:2:3]/", "invalid IPv6"),
    ("https://a.example/" + "x" * 2100, "longer than 2048 characters"),
    ("https://a.example/" + "é" * 400, "longer than 2048 characters once encoded"),
]


@pytest.mark.parametrize(("url", "canonical"), CANONICAL)
def test_a_url_has_one_canonical_form(url: str, canonical: str) -> None:
    assert normalize_inbox(url) == canonical


@pytest.mark.parametrize(("url", "reason"), REFUSED)
def test_a_url_without_one_is_refused_naming_it_and_why(url: str, reason: str) -> None:
    with pytest.raises(InvalidDelivery) as refused:
        normalize_inbox(url)
    assert reason in refused.value.reason  # type: ignore[attr-defined]
    message = str(refused.value)
    assert message.startswith(f"inbox '{redact(url)}' ")
    assert message.isprintable(), message


@pytest.mark.parametrize("value", [None, 42, b"https://a.example/inbox", ["https://a.example/"]])
def test_only_a_string_is_a_url(value: object) -> None:
    with pytest.raises(InvalidDelivery, match=f"not a string but {type(value).__name__}"):
        validate_inbox(value)


@pytest.mark.parametrize("url", [canonical for _, canonical in CANONICAL])
def test_the_canonical_form_is_a_fixed_point_and_left_alone_by_requests(url: str) -> None:
    assert normalize_inbox(url) == url
    assert requests.utils.requote_uri(url) == url
    request = requests.Request("POST", url).prepare()
    assert request.url == url
    assert request.path_url == addresses.split(url).target


def spellings() -> Iterator[str]:
    """URLs put together from parts, each canonical or near it in one way."""
    schemes = ["https", "http", "HTTPS"]
    hosts = [
        "a.example",
        "A.example",
        "a.example.",
        "a_b-c.d-.example",
        "xn--exmple-cua.com",
        "xn--zz.example",
        "127.0.0.1",
        "255.255.255.255",
        "256.1.1.1",
        "1.2.3.04",
        "1.2.3",
        "a.example.1",
        "a.0x1f",
        "a..example",
        "a" * 63 + ".example",
        "a" * 64 + ".example",
        ("a" * 62 + ".") * 3 + "a" * 61,
        ("a" * 62 + ".") * 3 + "a" * 62,
        "[::1]",
        "u@a.example",
    ]
    ports = ["", ":443", ":80", ":08443", ":65535", ":65536"]
    paths = [
        "",
        "/",
        "/users/Alice/inbox",
        "/a/../b",
        "/.well-known/x",
        "/a/.",
        "/a/..",
        "/a.b/.c/..d",
        "/%41",
        "/é",
        "/~u/!$&'()*+,;=:@-_",
        "//x//",
        "/[x]",
        "/a\\b",
    ]
    queries = ["", "?", "?a=1&b=2?/:@", "?a=%zz", "?a[]=1"]
    fragments = ["", "#f"]
    for parts in itertools.product(schemes, hosts, ports, paths, queries, fragments):
        yield parts[0] + "://" + "".join(parts[1:])


# Some 50,000 URLs, each split both ways: the same under every Django, so run once.
@pytest.mark.slow
def test_the_short_way_for_a_canonical_url_gives_what_the_whole_way_gives(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    short, canonical_and_host = addresses._already_canonical, addresses.canonical_and_host
    cases = [*spellings(), *(url for url, _ in CANONICAL), *(url for url, _ in REFUSED)]
    taken = 0
    with monkeypatch.context() as patched:
        patched.setattr(addresses, "_canonical_match", lambda url: None)
        patched.setattr(addresses, "_already_canonical", lambda url: None)
        whole = {}
        for url in cases:
            try:
                # The whole way, not what an earlier split kept.
                whole[url] = addresses._split.__wrapped__(url, False)
            except addresses.UnusableURL as exc:
                whole[url] = exc.reason
    for url in cases:
        expected = whole[url]
        try:
            got: object = canonical_and_host(url)
        except addresses.UnusableURL as exc:
            got = exc.reason
        if isinstance(expected, str):
            assert got == expected, url
            continue
        assert got == (expected.url, expected.host_key), url
        # split() refuses what is too long before it looks for the short way.
        parts = short(url) if len(url) <= addresses.MAX_URL_LENGTH else None
        if parts is not None:
            taken += 1
            assert parts == expected, url
            assert parts.url == url, "only what is canonical already"
    assert taken > 300, "every plain spelling takes the short way"
    assert short("https://a.example/users/alice/inbox") is not None
    assert short("http://127.0.0.2:8000/users/alice/inbox") is not None, "a dotted quad too"


def test_validate_inbox_and_normalize_inbox_are_the_packages_own() -> None:
    assert django_federation_delivery.validate_inbox is validate_inbox
    assert django_federation_delivery.normalize_inbox is normalize_inbox
    assert {"validate_inbox", "normalize_inbox"} <= set(django_federation_delivery.__all__)
    assert validate_inbox("https://a.example/inbox") is None


def test_host_and_origin_are_canonical_and_ignore_userinfo() -> None:
    # A port is another server: it is kept, but for HTTPS's, 443, whatever
    # the scheme (the same socket).
    assert host_of("https://U:P@EXÄMPLE.com:8443/x?y") == "xn--exmple-cua.com:8443"
    assert host_of("https://EXÄMPLE.com:443/x") == "xn--exmple-cua.com"
    assert host_of("http://EXÄMPLE.com:443/x") == "xn--exmple-cua.com"
    assert host_of("http://EXÄMPLE.com/x") == "xn--exmple-cua.com:80"
    assert host_of("https://EXÄMPLE.com:80/x") == "xn--exmple-cua.com:80"
    assert host_of("https://[2001:DB8::1]/") == "2001:db8::1"
    assert host_of("https://[2001:DB8::1]:8443/") == "[2001:db8::1]:8443"
    assert host_of("not a url") == ""
    assert origin("https://U:P@EXÄMPLE.com:8443/x?y") == "https://xn--exmple-cua.com:8443"
    assert origin("http://[2001:DB8::1]:80/") == "http://[2001:db8::1]"


@pytest.mark.parametrize(
    ("named", "key"),
    [
        ("example.com", "example.com"),
        ("Example.COM.", "example.com"),
        ("example.com:443", "example.com"),
        ("example.com:80", "example.com:80"),
        ("http://example.com/inbox", "example.com:80"),
        ("http://example.com:443/inbox", "example.com"),
        ("2001:DB8::1", "2001:db8::1"),
        ("2001:0db8:0::1", "2001:db8::1"),
        ("[2001:DB8::1]:8443", "[2001:db8::1]:8443"),
        ("::FFFF:1.2.3.4", "::ffff:102:304"),
        ("[::ffff:102:304]:8443", "[::ffff:102:304]:8443"),
        ("<ops>", "<ops>"),
    ],
)
def test_a_host_named_in_any_form_is_the_key_its_deliveries_have(named: str, key: str) -> None:
    assert addresses.host_named(named) == key


# --- On the wire ---------------------------------------------------------------------------

KEY = SenderKey(f"{ALICE}#main-key", rsa_key())
LOOPBACK = ipaddress.ip_network("127.0.0.0/8")


@pytest.fixture
def transport() -> Iterator[Transport]:
    transport = Transport(
        TransportSettings(
            user_agent="tests", connect_timeout=2, attempt_timeout=5, allowed_networks=(LOOPBACK,)
        )
    )
    yield transport
    transport.close()


def verified(request: Received, scheme: Scheme) -> bool:
    """Whether the request's signature verifies for the path the server received."""
    if scheme is Scheme.CAVAGE:
        return cavage_verifies(request.headers, KEY, path=request.path)
    url = f"http://{request.host}{request.path}"
    message = prepared(url, request.headers, request.body)
    assert message.url == url, "the verifier sees the received URL as it is"
    (result,) = rfc9421_verify(message, KEY, body=request.body)
    return result.covered_components['"@target-uri"'] == url


def attempt_once(
    delivery: Delivery, batch: Batch, scheme: Scheme, transport: Transport
) -> AttemptResult:
    """One attempt at a queued delivery, signed by ALICE in ``scheme``."""
    job = InboxJob(
        delivery_id=delivery.id,
        targets=(delivery.inbox,),
        body=batch.body.encode(),
        body_sha256=batch.body_sha256,
        key=KEY,
        sender=ALICE,
        scheme=scheme,
    )
    return ActivityPub().attempt(job, transport)


def sent_once(url: object, inbox: Inbox, transport: Transport, scheme: Scheme) -> str:
    """Queue ``url`` with send() and make one attempt at it: "verified", or the skip reason."""
    Batch.objects.all().delete()
    before = len(inbox.received)
    batch = send(ALICE, {"type": "Create"}, [url])  # type: ignore[list-item]
    if batch is None:
        # Not queued: there must be a reason, and no row.
        assert not Delivery.objects.exists()
        return "skipped"
    if batch.skipped:
        (skipped,) = batch.skipped
        assert skipped.reason
        return "skipped"
    delivery = Delivery.objects.get()
    result = attempt_once(delivery, batch, scheme, transport)
    assert result.delivered, (url, result.error)
    (request,) = inbox.received[before:]
    assert verified(request, scheme), (url, request.path)
    assert request.path == addresses.split(delivery.inbox).target
    return "verified"


# Each case of what strangers' inboxes carry, on a real local server.
WIRE_CASES = [
    ("/in\r\nX-Injected: 1", "skipped"),
    ("/in\tbox", "skipped"),
    ("/in box", "skipped"),
    ("/in\x00box", "skipped"),
    ("/in\x1bbox", "skipped"),
    ("/ïnbox/é?q=ü", "verified"),
    ('/|<>"{}^\\`', "verified"),
    ("/%zz?x=%zz", "verified"),
    ("/%7e%41%2f", "verified"),
    ("/a/../b/./c", "verified"),
    ("/x?a[]=1&b=|", "verified"),
    ("/\u202eevil", "verified"),
]


@pytest.mark.django_db
@pytest.mark.parametrize("scheme", list(Scheme))
@pytest.mark.parametrize(("path", "outcome"), WIRE_CASES)
def test_what_is_signed_is_what_goes_on_the_wire_or_it_is_refused_when_queued(
    path: str, outcome: str, scheme: Scheme, inbox: Inbox, transport: Transport
) -> None:
    assert sent_once(inbox.url(path), inbox, transport, scheme) == outcome


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("host", "outcome"),
    [
        ("127.0.0.1.", "verified"),
        ("１２７.０.０.１", "verified"),
        ("127.1", "skipped"),
        ("127.000.0.1", "skipped"),
    ],
)
def test_a_host_spelt_otherwise_is_sent_to_as_its_canonical_self(
    host: str, outcome: str, inbox: Inbox, transport: Transport
) -> None:
    url = f"http://{host}:{inbox.port}/inbox"
    assert sent_once(url, inbox, transport, Scheme.RFC9421) == outcome


@pytest.mark.django_db
def test_a_port_of_0_or_a_host_too_long_for_its_column_is_skipped(
    inbox: Inbox, transport: Transport
) -> None:
    assert sent_once("http://127.0.0.1:0/inbox", inbox, transport, Scheme.CAVAGE) == "skipped"
    long_host = ("a" * 60 + ".") * 5 + "example"
    assert len(long_host) == 312
    assert sent_once(f"http://{long_host}/", inbox, transport, Scheme.CAVAGE) == "skipped"


# --- Fuzz ----------------------------------------------------------------------------------

SECRET = "S3CRET"
SCHEMES = ["http", "HTTP", "hTtP", "https:", "ftp", "", "h ttp", "http\n"]
USERINFO = ["", f"u:{SECRET}@", f"{SECRET}@", ":@", f"u:{SECRET}?x@", f"u%40:{SECRET}@"]
HOSTS = [
    "127.0.0.1",
    "127.0.0.1.",
    "１２７.０.０.１",
    "127.1",
    "127.000.000.001",
    "0x7f.0.0.1",
    "2130706433",
    "xn--zz",
    "a..b",
    "a" * 64 + ".example",
    ("a" * 60 + ".") * 5 + "example",
    "ex ample",
    "exa\x00mple",
    "[::1%25lo]",
    "[::1",
    "ex%41mple",
    "exa\\mple",
]
PORTS = ["{port}", "0{port}", "0", "99999", "", "-1", "+80", "{port}x", "{port}:{port}"]
PATHS = [
    "",
    "/",
    "/inbox",
    "/in box",
    "/in\r\nX-Injected: 1",
    "/in\tbox",
    "/ïnbox/é",
    "/%zz",
    "/%7e%41%7E",
    "/%C3%a9",
    '/|<>"{}^\\`',
    "/a/../b",
    "/./%2E%2E/c",
    "/%2F%2f",
    "//double//",
    "/@alice/inbox",
    "/\u202eevil",
    "/\x7f",
    "/\x85",
    "/\u2028",
    "/\ud800",
    "/" + "x" * 2100,
    "/" + "é" * 500,
    "/;p=1",
    "/~u/!$&'()*+,;=:@",
    "/%",
    "/%%41",
    "/\u3000",
]
QUERIES = [
    "",
    "?",
    f"?token={SECRET}",
    f"?token={SECRET}&a=%zz|",
    "?q=é",
    "?q=é ",
    "?x=%41%2541",
    "?a[]=1",
    "??",
    "?/?:@",
]
FRAGMENTS = ["", "#frag", "#a b", "#\r\n", f"#{SECRET}"]


def corpus(port: int) -> list[str]:
    """A few hundred hostile URLs, the same every run: each path with each query, on a
    good authority; then each other piece in turn with a few paths."""
    good = f"http://127.0.0.1:{port}"
    cases = [good + path + query for path, query in itertools.product(PATHS, QUERIES)]
    some_paths = ["/inbox", "/ïnbox?token=" + SECRET, "/%zz|"]
    for path in some_paths:
        cases += [f"{scheme}://127.0.0.1:{port}{path}" for scheme in SCHEMES]
        cases += [f"http://{userinfo}127.0.0.1:{port}{path}" for userinfo in USERINFO]
        cases += [f"http://{host}:{port}{path}" for host in HOSTS]
        cases += [f"http://127.0.0.1:{p.format(port=port)}{path}" for p in PORTS]
        cases += [good + path + fragment for fragment in FRAGMENTS]
    return cases


@pytest.mark.slow
# What comes of a URL is the same whatever database queued it.
@pytest.mark.any_database
@pytest.mark.django_db
def test_a_corpus_of_hostile_urls_is_either_delivered_verified_or_skipped_with_a_reason(
    inbox: Inbox, transport: Transport, caplog: pytest.LogCaptureFixture
) -> None:
    cases = corpus(inbox.port)
    assert len(cases) > 300
    outcomes: dict[str, int] = {"verified": 0, "skipped": 0}
    with caplog.at_level(logging.DEBUG):
        for number, url in enumerate(cases):
            scheme = (Scheme.CAVAGE, Scheme.RFC9421)[number % 2]
            outcomes[sent_once(url, inbox, transport, scheme)] += 1
    assert outcomes["verified"] > 100 and outcomes["skipped"] > 100, outcomes
    for record in caplog.records:
        assert SECRET not in record.getMessage()
    # The secret reaches the inbox only as the inbox's own query, never a message.
    assert any(SECRET in request.path for request in inbox.received)


def test_the_skip_reasons_of_the_corpus_hold_no_secret() -> None:
    messages = []
    for url in corpus(8080):
        try:
            normalize_inbox(url)
        except InvalidDelivery as exc:
            messages.append(str(exc))
    assert len(messages) > 100
    for message in messages:
        assert SECRET not in message
        assert message.isprintable(), message


def test_normalizing_is_a_fixed_point_over_the_corpus() -> None:
    for url in corpus(8080):
        try:
            canonical = normalize_inbox(url)
        except InvalidDelivery:
            continue
        assert normalize_inbox(canonical) == canonical, url
        assert requests.utils.requote_uri(canonical) == canonical, url


def deep(depth: int) -> object:
    value: object = "x"
    for _ in range(depth):
        value = {"a": [value]}
    return value


# What a remote document can put in an activity that is forwarded or quoted.
HOSTILE_ACTIVITIES: list[object] = [
    {"type": "Create", "content": "\x00\x1b[31m\r\n\u202e\u2028"},
    {"type": "Create", "content": "é" * 1000, "emoji": "\U0001f600" * 100},
    {"type": "Create", "content": "\ud800"},
    {"\udfff": "key"},
    {"type": "Create", "n": float("nan")},
    {"type": "Create", "n": float("inf")},
    {"type": "Create", "b": b"bytes"},
    {"type": "Create", "s": {1, 2}},
    {"type": "Create", "when": dt.datetime(2026, 1, 1)},
    {1: "int key", None: "none key"},
    # 99 levels: within the 100 an activity may have, one inside another.
    {"type": "Create", "deep": deep(49)},
    {"type": "Create", "deep": deep(100_000)},
    {"type": "Create", "big": "x" * (2 << 20)},
    ["not", "an", "object"],
    "a string",
    None,
    42,
]


@pytest.mark.django_db
def test_a_corpus_of_hostile_activities_is_either_delivered_verified_or_refused_by_name(
    inbox: Inbox, transport: Transport
) -> None:
    outcomes: list[str] = []
    for number, activity in enumerate(HOSTILE_ACTIVITIES):
        Batch.objects.all().delete()
        before = len(inbox.received)
        try:
            batch = send(ALICE, activity, [inbox.url(f"/a{number}")])  # type: ignore[arg-type]
        except InvalidDelivery as exc:
            message = str(exc)
            assert message and message.isprintable(), repr(exc)  # noqa: PT017
            assert not Batch.objects.exists() and not Delivery.objects.exists()
            outcomes.append("refused")
            continue
        assert batch is not None
        delivery = Delivery.objects.get()
        scheme = (Scheme.CAVAGE, Scheme.RFC9421)[number % 2]
        result = attempt_once(delivery, batch, scheme, transport)
        assert result.delivered, (number, result.error)
        (request,) = inbox.received[before:]
        assert verified(request, scheme), number
        assert request.body == batch.body.encode(), "the body as stored is the body as sent"
        assert json.loads(request.body) == json.loads(json.dumps(activity)), number
        outcomes.append("verified")
    assert outcomes.count("verified") == 4 and outcomes.count("refused") == 13, outcomes


# What a message may show of a URL, and what of it none may hold.


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("https://a.example/inbox?token=SECRET#frag", "https://a.example/inbox"),
        ("https://user:SECRET@a.example/inbox", "https://a.example/inbox"),
        ("http:user:SECRET@a.example/inbox", "http:a.example/inbox"),
        # One slash, or three: a browser still reads a user and a password.
        ("https:/user:SECRET@a.example/inbox", "https:/a.example/inbox"),
        ("https:///user:SECRET@a.example/inbox", "https:///a.example/inbox"),
        # A "?" in the password does not hide the "@" that ends it.
        ("https://user:SE?CRET@a.example/", "https://a.example/"),
        ("https://a.example/@alice/inbox", "https://a.example/@alice/inbox"),
        # No userinfo: a port before a query, and a portable inbox's DID,
        # colons and all, with an "@" in its path.
        ("https://a.example:8443?next=/@alice", "https://a.example:8443"),
        ("https://a.example?token=s3cret:x/@y", "https://a.example"),
        ("https://a.example#s3cret:x/@y", "https://a.example"),
        # A password holding a "?" and a "/".
        ("https://user:SE?C/RET@a.example/", "https://a.example/"),
        (f"ap://{DID}/users/@alice/inbox", f"ap://{DID}/users/@alice/inbox"),
        ("https://a.example/in\r\nX: 1", "https://a.example/in\\r\\nX: 1"),
        ("https://a.example/\u202e\x00\ud800", "https://a.example/\\u202e\\x00\\ud800"),
        ("https://a.example/" + "x" * 300, "https://a.example/" + "x" * 179 + "..."),
    ],
)
def test_redact_shows_no_userinfo_query_or_fragment_on_one_short_line(url: str, shown: str) -> None:
    assert redact(url) == shown


def test_redact_can_keep_only_the_origin() -> None:
    url = "https://user:pw@hooks.example:8443/services/T000/B000/SECRET?x=1"
    assert redact(url, whole_path=True) == "https://hooks.example:8443"
    assert redact("https://hooks.example?SECRET", whole_path=True) == "https://hooks.example"


def test_credentials_are_the_userinfo_and_query_whole_in_parts_and_decoded() -> None:
    found = credentials("https://u:pa%20ss@a.example/x?token=SE%2BCRET&a=1#f")
    assert found == sorted(found, key=lambda secret: -len(secret))
    for secret in ("u:pa%20ss", "pa ss", "token=SE%2BCRET&a=1", "SE+CRET", "SE%2BCRET"):
        assert secret in found
    assert "a=1" not in found, "too short to be worth hiding on its own"
    assert credentials("https://a.example/inbox") == []


@pytest.mark.parametrize(
    "echo",
    [
        "bad signature for https://inbox.example/inbox?token=Zk9vL2Jhcj1iYXo/cXV4K3k=",
        # PHP's json_encode escapes "/".
        "bad signature for https:\\/\\/inbox.example\\/inbox?token=Zk9vL2Jhcj1iYXo\\/cXV4K3k=",
        # A login page's ?next= holds the whole URL percent-encoded.
        "see https://inbox.example/login?next=https%3A%2F%2Finbox.example%2Finbox%3Ftoken%3DZk9vL2Jhcj1iYXo%2FcXV4K3k%3D",
        "unknown token Zk9vL2Jhcj1iYXo%2FcXV4K3k%3D",
    ],
    ids=["as sent", "json", "percent-encoded", "value alone"],
)
def test_a_query_token_is_redacted_however_the_server_repeats_it(echo: str) -> None:
    url = "https://inbox.example/inbox?token=Zk9vL2Jhcj1iYXo/cXV4K3k="
    text = replace_secrets(echo, credentials(url))
    assert "Zk9vL2Jhcj1iYXo" not in text and "cXV4K3k" not in text, text


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        (None, "None"),
        (42, "42"),
        (list(range(100)), "[0, 1, 2, 3, ...]"),
        ("x" * 100_000, repr("x" * 80 + "…")),
        # A credential in a value that is no text is never repeated.
        (b"https://hooks.slack.com/services/T0/B0/s3cret", "<bytes>"),
        ({"url": "https://hooks.slack.com/services/T0/B0/s3cret"}, "<dict>"),
        ("https://hooks.slack.com/services/T0/B0/s3cret", "'https://hooks.slack.com/…'"),
        ("https://u:s3cret@a.example/x?token=s3cret", "'https://a.example/…'"),
        # A slash lost, or backslashes: a URL still, its userinfo and all.
        ("https:/u:s3cret@a.example:99999/inbox", "'https:/a.example:99999/…'"),
        ("https:\\\\u:s3cret@a.example/inbox", "'https:\\\\\\\\a.example/…'"),
        ("slack:/hooks.slack.com/services/T0/B0/s3cret", "'slack:/hooks.slack.com/…'"),
        # No slash at all: https: is a URL's whatever follows, and any
        # scheme before a user and a password.
        ("https:u:s3cret@hooks.example/x", "'https:hooks.example/…'"),
        ("https:hooks.example?token=s3cret", "'https:hooks.example/…'"),
        ("telegram:4815:s3cret@-1001", "'telegram:-1001/…'"),
    ],
)
def test_an_error_names_a_value_short_and_without_its_credential(value: object, shown: str) -> None:
    assert addresses.quoted(value) == shown


@pytest.mark.parametrize(
    "value",
    [
        "https:u:s3cret@a.example/x",
        "https:/u:s3cret@a.example/x",
        "telegram:4:s3cret@-1",
        # Pasted with what a link may come in: brackets, quotes.
        "<https:/u:s3cret@a.example/inbox>",
        "<https:u:s3cret@a.example/x>",
        '"https:u:s3cret@a.example/x"',
        "(telegram:4815:s3cret@-1001)",
        "[https:u:s3cret@a.example]",
    ],
)
@pytest.mark.parametrize("path", [False, True])
def test_a_url_quoted_shows_no_userinfo_however_few_slashes_or_pasted(
    value: str, path: bool
) -> None:
    assert "s3cret" not in addresses.quoted(value, path=path)


@pytest.mark.parametrize("value", ["order:created@v1", "note: see alice@example.com"])
def test_a_word_with_a_colon_and_an_at_is_quoted_as_given(value: str) -> None:
    # Taken for a URL with a user, it was named as another value.
    assert addresses.quoted(value) == repr(value)


def test_a_value_whose_repr_raises_is_named_by_its_type() -> None:
    assert addresses.quoted(Unprintable()).startswith("<Unprintable instance at ")


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        ("https://a.example/users/alice", "'https://a.example/users/alice'"),
        (
            "https://u:s3cret@a.example/users/alice?token=s3cret",
            "'https://…@a.example/users/alice…'",
        ),
        ("ap://did:key:z6Mk/actor\x1b[2J", "'ap://did:key:z6Mk/actor\\x1b[2J'"),
    ],
)
def test_a_public_url_is_named_with_its_path(value: str, shown: str) -> None:
    assert addresses.quoted(value, path=True) == shown


class Holder:
    def __repr__(self) -> str:
        return "Holder('https://u:s3cret@a.example/x?token=s3cret')"


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        # A row of values_list() without flat=True, a dict of values(): what
        # a query gives where public URLs were meant.
        (("https://a.example/users/alice",), "('https://a.example/users/alice',)"),
        (
            {"uri": "https://u:s3cret@a.example/users/alice?token=s3cret"},
            "{'uri': 'https://…@a.example/users/alice…'}",
        ),
        (
            b"https://u:s3cret@a.example/users/alice?token=s3cret",
            "b'https://...@a.example/users/alice...'",
        ),
        (
            [("https://a.example/x?s3cret", 1)] * 9,
            "[" + "('https://a.example/x…', 1), " * 4 + "...]",
        ),
        ([[["https://a.example/x?s3cret"]]], "[[[...]]]"),
        # What it cannot tell public is never shown, whatever it holds.
        ([Holder()], "<list>"),
        (Holder(), "<Holder>"),
    ],
)
def test_a_row_of_public_urls_is_named_with_their_paths(value: object, shown: str) -> None:
    assert addresses.quoted(value, path=True) == shown


@pytest.mark.django_db
def test_a_remote_inbox_full_of_colons_is_skipped_at_once_not_after_seconds_of_redacting() -> None:
    # A remote actor chooses its inbox. One of 1.8 kB (under MAX_URL_LENGTH),
    # a host full of ":" and a path, is unusable and skipped: its redaction,
    # for the skip's message, held the send 4.6 s (a pattern trying every
    # way to split the colons); it is read in one pass.
    evil = "https://x.example:" + "a:" * 900 + "/inbox"
    started = time.monotonic()
    batch = send(ALICE, {"type": "Note"}, ["https://a.example/inbox", evil])
    took = time.monotonic() - started
    assert batch is not None and batch.size == 1
    assert list(Delivery.objects.values_list("inbox", flat=True)) == ["https://a.example/inbox"]
    assert took < 3.0, f"a send with one 1.8 kB inbox took {took:.1f} s"


def test_redacting_a_long_url_with_colons_is_linear() -> None:
    # 1.4 kB took 1.9 s, 4 kB of ":" 97 s: the time grew as the cube of
    # the length. In one pass, 110 kB takes milliseconds.
    started = time.monotonic()
    shown = addresses.redact("https://" + "a:" * 1500 + "/")
    took = time.monotonic() - started
    assert shown.startswith("https://a:a:")
    assert took < 3.0, f"redacting 3 kB took {took:.1f} s"


@pytest.mark.parametrize(
    "key",
    [
        "x.example",
        "x.example:80",
        "x.example:8443",
        "2001:db8::1",
        "::1",
        "[::1]:80",
        "127.0.0.1:80",
    ],
)
def test_the_urls_on_a_host_key_begin_with_its_prefixes_and_name_it_again(key: str) -> None:
    # What finds a host's inbox breakers by their keys (canonical inboxes):
    # each prefix, made a URL, is on that host and no other.
    prefixes = url_prefixes(key)
    assert len(prefixes) == 2
    assert [host_of(f"{prefix}inbox") for prefix in prefixes] == [key, key]
