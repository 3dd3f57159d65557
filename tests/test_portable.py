from __future__ import annotations

import dataclasses
import re

import pytest

from django_federation_delivery.exceptions import InvalidDelivery
from django_federation_delivery.portable import (
    MAX_GATEWAYS,
    PortableInbox,
    at_gateway,
    canonical,
    is_gateway,
    parse_ap_uri,
    targets,
)

DID = "did:key:z6MkABC"
INBOX = f"ap://{DID}/actor/inbox"


def test_an_ap_uri_parses_into_did_path_and_query() -> None:
    assert parse_ap_uri(INBOX) == (DID, "/actor/inbox", "")
    assert parse_ap_uri(f"ap://{DID}/actor/inbox?page=2#top") == (DID, "/actor/inbox", "page=2")
    assert parse_ap_uri(f"AP://{DID}/x") == (DID, "/x", "")


def test_any_did_method_with_a_plain_id_is_accepted() -> None:
    assert parse_ap_uri("ap://did:web:social.example:users:alice/inbox")[0] == (
        "did:web:social.example:users:alice"
    )
    assert parse_ap_uri("ap://did:plc:ab-c_d.e/inbox")[0] == "did:plc:ab-c_d.e"


def test_a_percent_encoded_did_authority_is_decoded() -> None:
    assert parse_ap_uri("ap://did%3Akey%3Az6MkABC/actor/inbox") == (DID, "/actor/inbox", "")
    assert parse_ap_uri("ap://did%3akey%3az6MkABC/actor/inbox")[0] == DID


def test_the_did_keeps_its_case() -> None:
    assert parse_ap_uri("ap://did:key:z6MkAbCdEf/inbox")[0] == "did:key:z6MkAbCdEf"


def test_what_a_url_path_cannot_carry_is_percent_encoded_and_escapes_are_kept() -> None:
    assert parse_ap_uri(f"ap://{DID}/caf\u00e9/a%20b/x:y@z") == (
        DID,
        "/caf%C3%A9/a%20b/x:y@z",
        "",
    )
    assert parse_ap_uri(f"ap://{DID}/inbox?q=\u00e9&r=1%2F2")[2] == "q=%C3%A9&r=1%2F2"
    assert parse_ap_uri(f"ap://{DID}/100%")[1] == "/100%25"


@pytest.mark.parametrize(
    "uri",
    [
        "https://social.example/actor/inbox",
        "http://social.example/actor/inbox",
        "did:key:z6MkABC/actor/inbox",
        "ap:did:key:z6MkABC/actor/inbox",
        "ap:///actor/inbox",
        "ap://social.example/actor/inbox",
        "ap://did:key/actor/inbox",
        "ap://did::z6MkABC/actor/inbox",
        "ap://DID:key:z6MkABC/actor/inbox",
        "ap://did:KEY:z6MkABC/actor/inbox",
        "ap://did:key:z6Mk%2541/actor/inbox",
        # did:web's port, its colon encoded: decoded, it named another DID
        # (did:web:social.example:8443 is a path on social.example).
        "ap://did:web:social.example%3A8443/actor/inbox",
        "ap://user@did:key:z6MkABC/actor/inbox",
        "ap://did:key:z6MkABC",
        "ap://did:key:z6MkABC/",
        "ap://did:key:z6MkABC?x=1",
        "ap://did:key:z6MkABC/../../admin",
        "ap://did:key:z6MkABC/a/%2E%2E/b",
        "ap://did:key:z6MkABC/a/./b",
        "ap://did:key:z6MkABC/actor\n/inbox",
        "ap://did:key:z6MkABC/actor\x85/inbox",
        "ap://did:key:z6MkABC/actor\u2028/inbox",
        "ap://did:key:z6MkABC/actor\u00a0/inbox",
        "ap://did:key:z6MkABC/actor inbox",
        "ap://did:key:z6Mk[ABC/actor/inbox",
        "ap://did:key:z6MkABC]/actor/inbox",
        "",
    ],
)
def test_anything_but_an_ap_uri_with_a_did_and_a_path_is_refused_by_name(uri: str) -> None:
    with pytest.raises(InvalidDelivery) as caught:
        parse_ap_uri(uri)
    # Whole, but for what may be a credential: a userinfo, a query.
    shown = uri.replace("user@", "…@").replace("?x=1", "…")
    assert repr(shown) in str(caught.value)


def test_canonical_drops_the_query_and_fragment() -> None:
    assert canonical(f"{INBOX}?a=1#frag") == INBOX
    assert canonical(f"{INBOX}?a=1") == canonical(f"{INBOX}?b=2") == canonical(INBOX)


def test_canonical_writes_the_did_decoded_and_the_scheme_lowercase() -> None:
    assert canonical("AP://did%3Akey%3Az6MkABC/actor/inbox") == INBOX


def test_canonical_refuses_what_parse_refuses() -> None:
    with pytest.raises(InvalidDelivery, match=re.escape(repr("https://social.example/inbox"))):
        canonical("https://social.example/inbox")


@pytest.mark.parametrize(
    "url",
    [
        "https://gw.example",
        "https://gw.example/",
        "http://gw.example",
        "HTTPS://GW.example",
        "https://gw.example:8443",
        "https://127.0.0.1:8000/",
        "https://[2001:db8::1]:8443",
    ],
)
def test_a_bare_http_origin_is_a_gateway(url: str) -> None:
    assert is_gateway(url)


@pytest.mark.parametrize(
    "url",
    [
        "https://gw.example/path",
        "https://gw.example//",
        "https://gw.example/.well-known/apgateway",
        "https://gw.example?x=1",
        "https://gw.example/?",
        "https://gw.example#frag",
        "https://gw.example/#",
        "https://user@gw.example",
        "https://user:pw@gw.example/",
        "ftp://gw.example",
        "ap://did:key:z6MkABC",
        "gw.example",
        "https:gw.example",
        "https://",
        "https://gw.example:",
        "https://gw.example:99999",
        "https://gw example",
        "https://gw.example\n",
        "https://gw_\u00e9.example",
        "https://xn--zz.example",
        "",
    ],
)
def test_anything_but_a_bare_http_origin_is_not_a_gateway(url: str) -> None:
    assert not is_gateway(url)


def test_a_gateway_with_an_internationalised_name_is_used_idna_encoded() -> None:
    assert is_gateway("https://gw\u00e9.example")
    assert at_gateway(INBOX, "https://GW\u00c9.example") == (
        "https://xn--gw-cja.example/.well-known/apgateway/did:key:z6MkABC/actor/inbox"
    )


def test_a_gateway_that_is_not_a_string_is_not_a_gateway() -> None:
    assert not is_gateway(None)  # type: ignore[arg-type]
    assert not is_gateway({"id": "https://gw.example"})  # type: ignore[arg-type]


def test_an_inbox_at_a_gateway_keeps_the_dids_colons_literal() -> None:
    assert at_gateway("ap://did:key:z6MkABC/actor/inbox", "https://gw.example") == (
        "https://gw.example/.well-known/apgateway/did:key:z6MkABC/actor/inbox"
    )


def test_an_inbox_at_a_gateway_uses_the_gateways_origin() -> None:
    assert at_gateway(INBOX, "HTTPS://GW.example:443/") == (
        "https://gw.example/.well-known/apgateway/did:key:z6MkABC/actor/inbox"
    )
    assert at_gateway(INBOX, "http://gw.example:8080") == (
        "http://gw.example:8080/.well-known/apgateway/did:key:z6MkABC/actor/inbox"
    )


def test_a_percent_encoded_did_is_written_decoded_at_the_gateway() -> None:
    assert at_gateway("ap://did%3Akey%3Az6MkABC/actor/inbox", "https://gw.example") == (
        "https://gw.example/.well-known/apgateway/did:key:z6MkABC/actor/inbox"
    )


def test_the_query_is_kept_at_the_gateway_and_the_fragment_dropped() -> None:
    assert at_gateway(f"{INBOX}?shared=1#x", "https://gw.example") == (
        "https://gw.example/.well-known/apgateway/did:key:z6MkABC/actor/inbox?shared=1"
    )


def test_characters_a_url_path_cannot_carry_are_percent_encoded_at_the_gateway() -> None:
    assert at_gateway(f"ap://{DID}/caf\u00e9/inbox", "https://gw.example") == (
        "https://gw.example/.well-known/apgateway/did:key:z6MkABC/caf%C3%A9/inbox"
    )


def test_an_inbox_at_something_that_is_not_a_gateway_is_refused_by_name() -> None:
    with pytest.raises(InvalidDelivery, match=re.escape(repr("https://gw.example/path"))):
        at_gateway(INBOX, "https://gw.example/path")


def test_an_inbox_that_is_not_an_ap_uri_is_refused_at_a_gateway_by_name() -> None:
    with pytest.raises(InvalidDelivery, match=re.escape(repr("https://social.example/inbox"))):
        at_gateway("https://social.example/inbox", "https://gw.example")


def test_targets_are_the_inbox_at_each_gateway_in_order() -> None:
    inbox = PortableInbox(INBOX, ["https://gw2.example", "https://gw1.example/"])
    assert targets(inbox) == [
        "https://gw2.example/.well-known/apgateway/did:key:z6MkABC/actor/inbox",
        "https://gw1.example/.well-known/apgateway/did:key:z6MkABC/actor/inbox",
    ]


def test_unusable_gateways_are_skipped() -> None:
    inbox = PortableInbox(
        INBOX,
        [
            "https://gw.example/path",
            "https://gw.example?x=1",
            "https://user@gw.example",
            "ftp://gw.example",
            "https://gw.example#frag",
            "https://good.example",
        ],
    )
    assert targets(inbox) == [
        "https://good.example/.well-known/apgateway/did:key:z6MkABC/actor/inbox"
    ]


def test_no_usable_gateway_gives_no_targets() -> None:
    assert targets(PortableInbox(INBOX, [])) == []
    assert targets(PortableInbox(INBOX, ["ftp://gw.example", "https://gw.example/x"])) == []


def test_the_same_gateway_listed_twice_is_tried_once() -> None:
    inbox = PortableInbox(
        INBOX,
        [
            "https://gw.example",
            "https://GW.example/",
            "https://gw.example:443",
            "https://b.example",
        ],
    )
    assert targets(inbox) == [
        "https://gw.example/.well-known/apgateway/did:key:z6MkABC/actor/inbox",
        "https://b.example/.well-known/apgateway/did:key:z6MkABC/actor/inbox",
    ]


def test_more_than_five_gateways_are_cut_to_the_first_five() -> None:
    gateways = [f"https://gw{n}.example" for n in range(8)]
    urls = targets(PortableInbox(INBOX, gateways))
    assert MAX_GATEWAYS == 5
    assert urls == [
        f"{gw}/.well-known/apgateway/did:key:z6MkABC/actor/inbox" for gw in gateways[:5]
    ]


def test_the_cut_counts_usable_distinct_gateways_only() -> None:
    gateways = ["ftp://x.example", "https://gw0.example", "https://gw0.example/"] + [
        f"https://gw{n}.example" for n in range(1, 8)
    ]
    urls = targets(PortableInbox(INBOX, gateways))
    assert [url.split("/.well-known")[0] for url in urls] == [
        f"https://gw{n}.example" for n in range(5)
    ]


def test_the_query_of_a_portable_inbox_reaches_every_gateway() -> None:
    urls = targets(PortableInbox(f"{INBOX}?a=1", ["https://gw1.example", "https://gw2.example"]))
    assert all(url.endswith("/actor/inbox?a=1") for url in urls)


def test_a_portable_inbox_with_a_bad_inbox_is_refused_when_made() -> None:
    with pytest.raises(InvalidDelivery, match=re.escape(repr("https://social.example/inbox"))):
        PortableInbox("https://social.example/inbox", ["https://gw.example"])


@pytest.mark.parametrize(
    ("uri", "named"),
    [
        (f"{INBOX}\ud800", repr(f"{INBOX}\ud800")),
        # The query may hold a token: it is not repeated.
        (f"{INBOX}?token=t0ken\udcff", repr(f"{INBOX}…")),
    ],
)
def test_an_inbox_holding_text_that_is_not_unicode_is_refused_by_name(uri: str, named: str) -> None:
    # os.environ and a lenient decoder give a byte that is not UTF-8 as a lone surrogate.
    with pytest.raises(InvalidDelivery) as raised:
        PortableInbox(uri, ["https://gw.example"])
    assert named in str(raised.value) and "t0ken" not in str(raised.value)


@pytest.mark.parametrize(
    ("gateways", "named"),
    [
        (None, "None"),
        (5, "5"),
        (b"https://gw.example", "<bytes>"),
        (bytearray(b"https://gw.example"), "<bytearray>"),
        # Once iterated as numbers, each left out: an inbox with no gateway.
        (memoryview(b"https://gw.example"), "<memory at"),
        (object(), "<object object"),
    ],
)
def test_gateways_that_are_no_list_of_urls_are_refused_naming_them(
    gateways: object, named: str
) -> None:
    with pytest.raises(InvalidDelivery) as raised:
        PortableInbox(INBOX, gateways)  # type: ignore[arg-type]
    assert str(raised.value).startswith("gateways must be a list") and named in str(raised.value)


def test_a_single_gateway_string_is_read_as_a_list_of_one() -> None:
    inbox = PortableInbox(INBOX, "https://gw.example")
    assert inbox.gateways == ("https://gw.example",)
    assert targets(inbox) == [
        "https://gw.example/.well-known/apgateway/did:key:z6MkABC/actor/inbox"
    ]


def test_a_portable_inbox_is_frozen_and_hashable() -> None:
    inbox = PortableInbox(INBOX, ["https://gw.example"])
    assert inbox == PortableInbox(INBOX, ("https://gw.example",))
    assert hash(inbox) == hash(PortableInbox(INBOX, ["https://gw.example"]))
    with pytest.raises(dataclasses.FrozenInstanceError):
        inbox.inbox = "ap://did:key:z6MkXYZ/inbox"  # type: ignore[misc]
