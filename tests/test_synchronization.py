from __future__ import annotations

import hashlib
import re

import pytest

from django_federation_delivery.exceptions import InvalidDelivery
from django_federation_delivery.synchronization import (
    collection_synchronization,
    followers_digest,
    followers_on_origin,
    header_value,
    origin,
)

ALICE = "https://remote.example/users/alice"
BOB = "https://remote.example/users/bob"
COLLECTION = "https://local.example/users/zoe/followers"
PARTIAL = "https://local.example/users/zoe/followers_synchronization"


def sha256_int(uri: str) -> int:
    return int(hashlib.sha256(uri.encode("utf-8")).hexdigest(), 16)


def test_an_origin_is_scheme_host_and_port_lowercased_without_a_default_port() -> None:
    assert origin("HTTPS://Remote.Example/users/alice?x=1#y") == "https://remote.example"
    assert origin("https://remote.example:443/inbox") == "https://remote.example"
    assert origin("http://remote.example:80/inbox") == "http://remote.example"
    assert origin("https://remote.example:8443/inbox") == "https://remote.example:8443"
    assert origin("http://remote.example:443/") == "http://remote.example:443"
    assert origin("https://user:pw@remote.example/") == "https://remote.example"
    assert origin("https://[2001:DB8::1]:8443/inbox") == "https://[2001:db8::1]:8443"


@pytest.mark.parametrize(
    "url",
    [
        "ftp://remote.example/",
        "remote.example/inbox",
        "/inbox",
        "https:///inbox",
        "https://remote.example:99999/",
        "https://remote.example:port/",
        "https://remote\n.example/",
        "",
    ],
)
def test_an_origin_is_refused_for_anything_but_an_absolute_http_url(url: str) -> None:
    with pytest.raises(InvalidDelivery) as caught:
        origin(url)
    assert repr(url) in str(caught.value)


def test_the_digest_of_no_followers_is_64_zeros() -> None:
    assert followers_digest([]) == "0" * 64


def test_the_digest_of_one_follower_is_the_sha256_of_its_uri() -> None:
    assert followers_digest([ALICE]) == hashlib.sha256(ALICE.encode()).hexdigest()


def test_the_digest_of_two_followers_is_the_xor_of_their_sha256() -> None:
    expected = bytes(
        a ^ b
        for a, b in zip(
            hashlib.sha256(ALICE.encode()).digest(),
            hashlib.sha256(BOB.encode()).digest(),
            strict=True,
        )
    )
    assert followers_digest([ALICE, BOB]) == expected.hex()


def test_the_digest_matches_a_vector_worked_out_by_hand_from_hashlib() -> None:
    uris = ["https://b.example/u/1", "https://b.example/u/2", "https://b.example/u/ü"]
    expected = 0
    for uri in uris:
        expected ^= sha256_int(uri)
    assert followers_digest(uris) == f"{expected:064x}"
    assert len(followers_digest(uris)) == 64


def test_the_digest_does_not_depend_on_order() -> None:
    assert followers_digest([ALICE, BOB]) == followers_digest([BOB, ALICE])
    assert followers_digest(iter([BOB, ALICE])) == followers_digest((ALICE, BOB))


def test_a_follower_listed_twice_is_counted_once_not_cancelled_out() -> None:
    assert followers_digest([ALICE, ALICE]) == followers_digest([ALICE])
    assert followers_digest([ALICE, BOB, ALICE]) == followers_digest([ALICE, BOB])
    assert followers_digest([ALICE, ALICE]) != "0" * 64


def test_the_digest_is_lowercase_hex() -> None:
    digest = followers_digest([ALICE, BOB])
    assert digest == digest.lower()
    int(digest, 16)


@pytest.mark.parametrize("kind", [str, bytes, bytearray, memoryview])
def test_a_single_string_is_refused_rather_than_read_as_its_characters(kind: type) -> None:
    one = ALICE if kind is str else kind(ALICE.encode())
    with pytest.raises(InvalidDelivery, match="got one string"):
        followers_digest(one)
    with pytest.raises(InvalidDelivery, match="got one string"):
        followers_on_origin(one, "https://remote.example/inbox")


def test_a_follower_uri_that_is_not_a_string_is_refused_by_name() -> None:
    with pytest.raises(InvalidDelivery, match=re.escape("b'https://x.example/u'")):
        followers_digest([ALICE, b"https://x.example/u"])  # type: ignore[list-item]


@pytest.mark.parametrize(
    "follower",
    [
        # What values_list("uri") gives without flat=True: a row, not a URI.
        (BOB,),
        # What values("uri") gives: a dict, which cannot even be hashed.
        {"uri": BOB},
    ],
    ids=["values_list row", "values dict"],
)
def test_follower_uris_that_are_not_strings_are_refused_by_name_never_dropped(
    follower: object,
) -> None:
    for followers in ([follower], [ALICE, follower]):
        with pytest.raises(InvalidDelivery, match=re.escape(repr(follower))):
            collection_synchronization(
                COLLECTION, PARTIAL, followers, "https://remote.example/inbox"
            )
        with pytest.raises(InvalidDelivery, match="users/bob"):
            followers_on_origin(followers, "https://remote.example/inbox")


def test_a_follower_named_in_an_error_is_shown_without_its_credentials() -> None:
    row = ("https://u:s3cret@remote.example/users/bob?token=s3cret",)
    with pytest.raises(InvalidDelivery) as caught:
        followers_digest([row])  # type: ignore[list-item]
    assert "users/bob" in str(caught.value)
    assert "s3cret" not in str(caught.value)


def test_only_followers_on_the_inboxs_origin_are_kept_in_order() -> None:
    followers = [
        BOB,
        "https://other.example/users/carol",
        "https://remote.example:8443/users/dave",
        "http://remote.example/users/erin",
        ALICE,
        "https://remote.example.evil/users/frank",
        "https://sub.remote.example/users/gus",
    ]
    assert followers_on_origin(followers, "https://remote.example/inbox") == [BOB, ALICE]


def test_origin_filtering_compares_normalised_origins() -> None:
    followers = ["https://REMOTE.example/users/a", "https://remote.example:443/users/b"]
    assert followers_on_origin(followers, "https://remote.example/inbox") == followers


def test_another_port_is_another_origin() -> None:
    followers = ["https://remote.example:8443/users/a", ALICE]
    assert followers_on_origin(followers, "https://remote.example:8443/inbox") == [followers[0]]


def test_followers_that_are_not_http_urls_are_on_no_origin() -> None:
    followers = ["ap://did:key:z6MkABC/actor", "not a url", ALICE]
    assert followers_on_origin(followers, "https://remote.example/inbox") == [ALICE]


def test_a_follower_listed_twice_is_kept_once() -> None:
    assert followers_on_origin([ALICE, ALICE], "https://remote.example/inbox") == [ALICE]


def test_an_inbox_that_is_not_an_http_url_is_refused() -> None:
    with pytest.raises(InvalidDelivery, match="ap://"):
        followers_on_origin([ALICE], "ap://did:key:z6MkABC/inbox")


def test_the_header_is_written_exactly_as_fep_8fcf_shows_it() -> None:
    digest = "b08ab6951c7d6cc2b91e17ebd9557da7fae02489728e9332fcb3a97748244d50"
    assert header_value(COLLECTION, PARTIAL, digest) == (
        'collectionId="https://local.example/users/zoe/followers", '
        'url="https://local.example/users/zoe/followers_synchronization", '
        'digest="b08ab6951c7d6cc2b91e17ebd9557da7fae02489728e9332fcb3a97748244d50"'
    )


def test_an_uppercase_digest_is_written_lowercase() -> None:
    assert header_value(COLLECTION, PARTIAL, "AB" * 32).endswith(f'digest="{"ab" * 32}"')


@pytest.mark.parametrize(
    ("collection_id", "url", "named"),
    [
        ('https://local.example/a"b', PARTIAL, "collectionId"),
        ("https://local.example/a\\b", PARTIAL, "collectionId"),
        ("https://local.example/a\r\nX-Evil: 1", PARTIAL, "collectionId"),
        ("https://local.example/a\x00", PARTIAL, "collectionId"),
        ("https://local.example/ü", PARTIAL, "collectionId"),
        ("", PARTIAL, "collectionId"),
        (COLLECTION, 'https://local.example/", evil="1', "url"),
        (COLLECTION, "https://local.example/\t", "url"),
        (COLLECTION, "https://local.example/\x7f", "url"),
    ],
)
def test_a_value_a_quoted_header_cannot_carry_is_refused_by_name(
    collection_id: str, url: str, named: str
) -> None:
    with pytest.raises(InvalidDelivery) as caught:
        header_value(collection_id, url, "0" * 64)
    message = str(caught.value)
    assert named in message
    assert repr(collection_id if named == "collectionId" else url) in message


def test_a_collection_or_url_that_is_not_an_http_url_is_refused() -> None:
    with pytest.raises(InvalidDelivery, match="followers"):
        header_value("/users/zoe/followers", PARTIAL, "0" * 64)
    with pytest.raises(InvalidDelivery, match="sync"):
        header_value(COLLECTION, "ftp://local.example/sync", "0" * 64)


@pytest.mark.parametrize(
    "digest", ["", "0" * 63, "0" * 65, "g" * 64, "0" * 63 + "\n", " " + "0" * 63]
)
def test_a_digest_that_is_not_64_hex_characters_is_refused_by_name(digest: str) -> None:
    with pytest.raises(InvalidDelivery) as caught:
        header_value(COLLECTION, PARTIAL, digest)
    assert "digest" in str(caught.value)
    assert repr(digest) in str(caught.value)


def test_the_header_for_one_inbox_digests_only_the_followers_on_its_origin() -> None:
    followers = [ALICE, "https://other.example/users/carol", BOB, ALICE]
    value = collection_synchronization(
        COLLECTION, PARTIAL, followers, "https://remote.example/inbox"
    )
    expected = f"{sha256_int(ALICE) ^ sha256_int(BOB):064x}"
    assert value == f'collectionId="{COLLECTION}", url="{PARTIAL}", digest="{expected}"'


def test_the_header_for_an_inbox_with_no_followers_there_has_a_zero_digest() -> None:
    value = collection_synchronization(COLLECTION, PARTIAL, [ALICE], "https://nobody.example/inbox")
    assert value.endswith(f'digest="{"0" * 64}"')


def test_a_partial_collection_on_another_server_than_the_collection_is_refused() -> None:
    # FEP-8fcf: the url is on the actor's own server, or Mastodon ignores
    # the header. It was signed and sent with every delivery, doing nothing.
    with pytest.raises(InvalidDelivery) as refused:
        header_value(
            "https://social.example/users/alice/followers",
            "https://elsewhere.example/users/alice/followers_synchronization",
            "0" * 64,
        )
    assert "elsewhere.example" in str(refused.value) and "social.example" in str(refused.value)
