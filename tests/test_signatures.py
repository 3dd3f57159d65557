"""Tests for the pure signing package, checked against independent verifiers.

draft-cavage output is verified with pyhttpsig and RFC 9421 output with
http-message-signatures, so a bug shared by signer and test cannot hide.
"""

from __future__ import annotations

import base64
import datetime
import hashlib
import os
import subprocess
import sys
from collections.abc import Mapping
from typing import Any
from unittest import mock

import pytest
import requests
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa
from http_message_signatures import (
    HTTPMessageSigner,
    HTTPMessageVerifier,
    InvalidSignature,
    MappingKeyResolver,
    algorithms,
)
from httpsig import HeaderSigner, HeaderVerifier
from httpsig.utils import parse_signature_header

from django_federation_delivery.exceptions import SigningError
from django_federation_delivery.signatures import (
    Scheme,
    SenderKey,
    body_sha256,
    content_digest_header,
    digest_header,
    sign_request,
)
from django_federation_delivery.signatures.rfc9421 import signature_base

BODY = b'{"type":"Create","actor":"https://social.example/users/alice"}'
URL = "https://remote.example/users/bob/inbox"
RSA_KEY_ID = "https://social.example/users/alice#main-key"
ED_KEY_ID = "https://social.example/users/alice#ed25519-key"
FIXED_NOW = 1_700_000_000.75  # Tue, 14 Nov 2023 22:13:20 GMT
CAVAGE_COVERED = "(request-target) host date digest content-type"


@pytest.fixture(scope="module")
def rsa_private() -> rsa.RSAPrivateKey:
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


@pytest.fixture(scope="module")
def rsa_key(rsa_private: rsa.RSAPrivateKey) -> SenderKey:
    return SenderKey(key_id=RSA_KEY_ID, private_key=rsa_private)


@pytest.fixture(scope="module")
def ed_key() -> SenderKey:
    return SenderKey(key_id=ED_KEY_ID, private_key=ed25519.Ed25519PrivateKey.generate())


def pkcs8_pem(key: SenderKey, password: bytes | None = None) -> bytes:
    encryption: serialization.KeySerializationEncryption = (
        serialization.BestAvailableEncryption(password)
        if password
        else serialization.NoEncryption()
    )
    return key.private_key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, encryption
    )


def cavage_verifies(
    headers: Mapping[str, str], key: SenderKey, path: str, method: str = "POST"
) -> bool:
    """What a Mastodon-like receiver does: check the Signature over the listed headers."""
    verifier = HeaderVerifier(
        headers=dict(headers),
        secret=key.public_key_pem(),
        required_headers=CAVAGE_COVERED.split(),
        method=method,
        path=path,
        sign_header="signature",
    )
    return bool(verifier.verify())


def prepared(url: str, headers: Mapping[str, str], body: bytes) -> requests.PreparedRequest:
    return requests.Request("POST", url, headers=dict(headers), data=body).prepare()


def rfc9421_verify(
    message: requests.PreparedRequest, key: SenderKey, body: bytes | None = None
) -> list[Any]:
    algorithm = algorithms.RSA_V1_5_SHA256 if key.algorithm == "rsa" else algorithms.ED25519
    verifier = HTTPMessageVerifier(
        signature_algorithm=algorithm,
        key_resolver=MappingKeyResolver(
            public_keys={key.key_id: key.private_key.public_key()}, private_keys={}
        ),
    )
    return list(verifier.verify(message, body=body))


# --- digests -----------------------------------------------------------------


def test_body_sha256_is_padded_standard_base64_of_the_sha256() -> None:
    assert body_sha256(b"") == "47DEQpj8HBSa+/TImW+5JCeuQeRkm5NMpJWZG3hSuFU="
    assert body_sha256(BODY) == base64.b64encode(hashlib.sha256(BODY).digest()).decode()


def test_digest_headers_have_the_shapes_each_scheme_expects() -> None:
    b64 = body_sha256(BODY)
    assert digest_header(b64) == f"SHA-256={b64}"
    assert content_digest_header(b64) == f"sha-256=:{b64}:"


@pytest.mark.parametrize(
    "bad", ["", "not base64!", body_sha256(BODY)[:-4], base64.b64encode(b"x" * 20).decode()]
)
@pytest.mark.parametrize("scheme", list(Scheme))
def test_a_malformed_stored_digest_is_refused_rather_than_signed(
    scheme: Scheme, bad: str, rsa_key: SenderKey
) -> None:
    with pytest.raises(SigningError, match="body_sha256"):
        sign_request(scheme, url=URL, body_sha256=bad, key=rsa_key)


# --- draft-cavage ------------------------------------------------------------


def test_cavage_headers_verify_with_pyhttpsig(rsa_key: SenderKey) -> None:
    headers = sign_request(Scheme.CAVAGE, url=URL, body_sha256=body_sha256(BODY), key=rsa_key)
    assert cavage_verifies(headers, rsa_key, path="/users/bob/inbox")


def test_cavage_returns_exactly_the_headers_mastodon_needs(rsa_key: SenderKey) -> None:
    headers = sign_request(
        Scheme.CAVAGE, url=URL, body_sha256=body_sha256(BODY), key=rsa_key, now=FIXED_NOW
    )
    assert list(headers) == ["Host", "Date", "Digest", "Content-Type", "Signature"]
    assert headers["Host"] == "remote.example"
    assert headers["Content-Type"] == "application/activity+json"
    assert headers["Date"] == "Tue, 14 Nov 2023 22:13:20 GMT"


def test_cavage_signature_lists_exactly_the_mastodon_headers_and_rsa_sha256(
    rsa_key: SenderKey,
) -> None:
    headers = sign_request(Scheme.CAVAGE, url=URL, body_sha256=body_sha256(BODY), key=rsa_key)
    signature = headers["Signature"]
    assert signature.startswith(
        f'keyId="{RSA_KEY_ID}",algorithm="rsa-sha256",headers="{CAVAGE_COVERED}",signature="'
    )
    params = parse_signature_header(signature)
    assert params["headers"] == CAVAGE_COVERED
    assert params["algorithm"] == "rsa-sha256"
    assert params["keyId"] == RSA_KEY_ID


def test_cavage_digest_matches_the_sha256_of_the_body(rsa_key: SenderKey) -> None:
    headers = sign_request(Scheme.CAVAGE, url=URL, body_sha256=body_sha256(BODY), key=rsa_key)
    expected = base64.b64encode(hashlib.sha256(BODY).digest()).decode()
    assert headers["Digest"] == f"SHA-256={expected}"


def test_cavage_signature_is_byte_identical_to_pyhttpsigs_own_signer(
    rsa_key: SenderKey,
) -> None:
    # RSASSA-PKCS1-v1_5 is deterministic, so an independent signer over the
    # same headers must produce the very same signature (it orders params differently).
    ours = sign_request(
        Scheme.CAVAGE, url=URL + "?page=2", body_sha256=body_sha256(BODY), key=rsa_key
    )
    reference = HeaderSigner(
        key_id=RSA_KEY_ID,
        secret=pkcs8_pem(rsa_key).decode(),
        algorithm="rsa-sha256",
        headers=CAVAGE_COVERED.split(),
        sign_header="signature",
    ).sign(
        {k: v for k, v in ours.items() if k != "Signature"},
        method="POST",
        path="/users/bob/inbox?page=2",
    )
    assert parse_signature_header(ours["Signature"]) == parse_signature_header(
        reference["signature"]
    )


def test_cavage_verification_fails_when_the_digest_is_for_another_body(
    rsa_key: SenderKey,
) -> None:
    headers = sign_request(Scheme.CAVAGE, url=URL, body_sha256=body_sha256(BODY), key=rsa_key)
    tampered = {**headers, "Digest": digest_header(body_sha256(BODY + b" "))}
    assert not cavage_verifies(tampered, rsa_key, path="/users/bob/inbox")


def test_cavage_verification_fails_when_the_date_is_altered(rsa_key: SenderKey) -> None:
    headers = sign_request(
        Scheme.CAVAGE, url=URL, body_sha256=body_sha256(BODY), key=rsa_key, now=FIXED_NOW
    )
    tampered = {**headers, "Date": "Tue, 14 Nov 2023 22:13:21 GMT"}
    assert cavage_verifies(headers, rsa_key, path="/users/bob/inbox")
    assert not cavage_verifies(tampered, rsa_key, path="/users/bob/inbox")


def test_cavage_signature_is_bound_to_the_path_and_method(rsa_key: SenderKey) -> None:
    headers = sign_request(Scheme.CAVAGE, url=URL, body_sha256=body_sha256(BODY), key=rsa_key)
    assert not cavage_verifies(headers, rsa_key, path="/users/carol/inbox")
    assert not cavage_verifies(headers, rsa_key, path="/users/bob/inbox", method="PUT")


@pytest.mark.parametrize(
    ("url", "path"),
    [
        ("https://remote.example/inbox?a=1&b=two", "/inbox?a=1&b=two"),
        ("https://remote.example", "/"),
        ("https://remote.example?x=1", "/?x=1"),
        ("https://remote.example/inbox#fragment", "/inbox"),
    ],
)
def test_cavage_request_target_is_the_path_with_query_and_root_when_empty(
    url: str, path: str, rsa_key: SenderKey
) -> None:
    headers = sign_request(Scheme.CAVAGE, url=url, body_sha256=body_sha256(BODY), key=rsa_key)
    assert cavage_verifies(headers, rsa_key, path=path)


@pytest.mark.parametrize(
    ("url", "host"),
    [
        ("https://Remote.Example/inbox", "remote.example"),
        ("https://remote.example:443/inbox", "remote.example"),
        ("http://remote.example:80/inbox", "remote.example"),
        ("https://remote.example:8443/inbox", "remote.example:8443"),
        ("http://remote.example:443/inbox", "remote.example:443"),
        ("http://[2001:db8::1]:8080/inbox", "[2001:db8::1]:8080"),
    ],
)
def test_host_carries_the_port_only_when_it_is_not_the_schemes_default(
    url: str, host: str, rsa_key: SenderKey
) -> None:
    for scheme in Scheme:
        headers = sign_request(scheme, url=url, body_sha256=body_sha256(BODY), key=rsa_key)
        assert headers["Host"] == host
    cavage = sign_request(Scheme.CAVAGE, url=url, body_sha256=body_sha256(BODY), key=rsa_key)
    assert cavage_verifies(cavage, rsa_key, path="/inbox")


def test_cavage_refuses_an_ed25519_key_naming_the_key_and_the_scheme(ed_key: SenderKey) -> None:
    with pytest.raises(SigningError) as caught:
        sign_request(Scheme.CAVAGE, url=URL, body_sha256=body_sha256(BODY), key=ed_key)
    assert ED_KEY_ID in str(caught.value)
    assert "draft-cavage" in str(caught.value)


# --- RFC 9421 ----------------------------------------------------------------


@pytest.mark.parametrize("key_name", ["rsa_key", "ed_key"])
def test_rfc9421_signature_verifies_with_http_message_signatures(
    key_name: str, request: pytest.FixtureRequest
) -> None:
    key: SenderKey = request.getfixturevalue(key_name)
    headers = sign_request(Scheme.RFC9421, url=URL, body_sha256=body_sha256(BODY), key=key)
    (result,) = rfc9421_verify(prepared(URL, headers, BODY), key, body=BODY)
    assert result.label == "sig1"
    assert result.parameters["keyid"] == key.key_id
    assert result.body == BODY


@pytest.mark.parametrize(
    ("key_name", "alg"), [("rsa_key", "rsa-v1_5-sha256"), ("ed_key", "ed25519")]
)
def test_rfc9421_covers_exactly_the_specified_components_and_params(
    key_name: str, alg: str, request: pytest.FixtureRequest
) -> None:
    key: SenderKey = request.getfixturevalue(key_name)
    headers = sign_request(
        Scheme.RFC9421, url=URL, body_sha256=body_sha256(BODY), key=key, now=FIXED_NOW
    )
    assert headers["Signature-Input"] == (
        'sig1=("@method" "@target-uri" "content-type" "content-digest")'
        f';created=1700000000;keyid="{key.key_id}";alg="{alg}"'
    )
    assert headers["Signature"].startswith("sig1=:")
    assert headers["Signature"].endswith(":")
    assert headers["Content-Digest"] == f"sha-256=:{body_sha256(BODY)}:"
    assert headers["Content-Type"] == "application/activity+json"
    assert headers["Host"] == "remote.example"
    assert headers["Date"] == "Tue, 14 Nov 2023 22:13:20 GMT"


@pytest.mark.parametrize(
    ("key_name", "algorithm"),
    [("rsa_key", algorithms.RSA_V1_5_SHA256), ("ed_key", algorithms.ED25519)],
)
def test_rfc9421_headers_are_byte_identical_to_the_reference_signer(
    key_name: str,
    algorithm: type[algorithms.HTTPSignatureAlgorithm],
    request: pytest.FixtureRequest,
) -> None:
    # Both algorithms are deterministic, so the library signing the same
    # components with the same params must give identical header values.
    key: SenderKey = request.getfixturevalue(key_name)
    url = "https://remote.example:8443/users/bob/inbox?x=1"
    extra = {"Collection-Synchronization": 'collectionId="https://social.example/f"'}
    ours = sign_request(
        Scheme.RFC9421,
        url=url,
        body_sha256=body_sha256(BODY),
        key=key,
        extra_headers=extra,
        now=FIXED_NOW,
    )
    message = prepared(url, {k: v for k, v in ours.items() if not k.startswith("Signature")}, BODY)
    HTTPMessageSigner(
        signature_algorithm=algorithm,
        key_resolver=MappingKeyResolver(public_keys={}, private_keys={key.key_id: key.private_key}),
    ).sign(
        message,
        key_id=key.key_id,
        created=datetime.datetime.fromtimestamp(FIXED_NOW, tz=datetime.UTC),
        label="sig1",
        use_existing_digest=True,
        covered_component_ids=(
            "@method",
            "@target-uri",
            "content-type",
            "content-digest",
            "collection-synchronization",
        ),
    )
    assert ours["Signature-Input"] == message.headers["Signature-Input"]
    assert ours["Signature"] == message.headers["Signature"]


def test_rfc9421_signature_base_follows_section_2_5() -> None:
    base = signature_base(
        [("@method", "POST"), ("@target-uri", "https://r.example/inbox")],
        '("@method" "@target-uri");created=1;keyid="k";alg="ed25519"',
    )
    assert base == (
        '"@method": POST\n'
        '"@target-uri": https://r.example/inbox\n'
        '"@signature-params": ("@method" "@target-uri");created=1;keyid="k";alg="ed25519"'
    )


@pytest.mark.parametrize(
    ("url", "target_uri"),
    [
        ("https://remote.example", "https://remote.example/"),
        ("https://remote.example/in?q=1#frag", "https://remote.example/in?q=1"),
        ("https://remote.example:8443/in", "https://remote.example:8443/in"),
    ],
)
def test_rfc9421_target_uri_is_the_url_as_sent(
    url: str, target_uri: str, ed_key: SenderKey
) -> None:
    headers = sign_request(Scheme.RFC9421, url=url, body_sha256=body_sha256(BODY), key=ed_key)
    (result,) = rfc9421_verify(prepared(url, headers, BODY), ed_key)
    assert result.covered_components['"@target-uri"'] == target_uri


@pytest.mark.parametrize(
    "tamper",
    [
        {"Content-Digest": content_digest_header(body_sha256(b"{}"))},
        {"Content-Type": "application/ld+json"},
    ],
)
@pytest.mark.parametrize("key_name", ["rsa_key", "ed_key"])
def test_rfc9421_verification_fails_when_a_covered_header_is_changed(
    key_name: str, tamper: dict[str, str], request: pytest.FixtureRequest
) -> None:
    key: SenderKey = request.getfixturevalue(key_name)
    headers = sign_request(Scheme.RFC9421, url=URL, body_sha256=body_sha256(BODY), key=key)
    with pytest.raises(InvalidSignature):
        rfc9421_verify(prepared(URL, {**headers, **tamper}, BODY), key)


def test_rfc9421_verification_fails_for_another_body_or_url(rsa_key: SenderKey) -> None:
    headers = sign_request(Scheme.RFC9421, url=URL, body_sha256=body_sha256(BODY), key=rsa_key)
    with pytest.raises(InvalidSignature):
        rfc9421_verify(prepared(URL, headers, b"{}"), rsa_key, body=b"{}")
    with pytest.raises(InvalidSignature):
        rfc9421_verify(prepared(URL + "x", headers, BODY), rsa_key)


# --- extra headers -----------------------------------------------------------

SYNC = {
    "Collection-Synchronization": (
        'collectionId="https://social.example/users/alice/followers", '
        'url="https://social.example/followers_sync", digest="abc123"'
    )
}


def test_an_extra_header_is_sent_and_covered_by_a_cavage_signature(rsa_key: SenderKey) -> None:
    headers = sign_request(
        Scheme.CAVAGE, url=URL, body_sha256=body_sha256(BODY), key=rsa_key, extra_headers=SYNC
    )
    assert headers["Collection-Synchronization"] == SYNC["Collection-Synchronization"]
    params = parse_signature_header(headers["Signature"])
    assert params["headers"] == f"{CAVAGE_COVERED} collection-synchronization"
    assert cavage_verifies(headers, rsa_key, path="/users/bob/inbox")
    changed = {**headers, "Collection-Synchronization": 'collectionId="https://evil.example/"'}
    assert not cavage_verifies(changed, rsa_key, path="/users/bob/inbox")


@pytest.mark.parametrize("key_name", ["rsa_key", "ed_key"])
def test_an_extra_header_is_sent_and_covered_by_an_rfc9421_signature(
    key_name: str, request: pytest.FixtureRequest
) -> None:
    key: SenderKey = request.getfixturevalue(key_name)
    headers = sign_request(
        Scheme.RFC9421, url=URL, body_sha256=body_sha256(BODY), key=key, extra_headers=SYNC
    )
    assert headers["Collection-Synchronization"] == SYNC["Collection-Synchronization"]
    assert headers["Signature-Input"].startswith(
        'sig1=("@method" "@target-uri" "content-type" "content-digest" '
        '"collection-synchronization");'
    )
    (result,) = rfc9421_verify(prepared(URL, headers, BODY), key, body=BODY)
    assert '"collection-synchronization"' in result.covered_components
    changed = {**headers, "Collection-Synchronization": 'collectionId="https://evil.example/"'}
    with pytest.raises(InvalidSignature):
        rfc9421_verify(prepared(URL, changed, BODY), key)


@pytest.mark.parametrize(
    "extra",
    [
        {"X-Smuggle": "a\r\nSignature: forged"},
        {"Bad Name": "value"},
        {"Digest": "SHA-256=forged"},
        {"signature": "forged"},
        {"X-Dup": "1", "x-dup": "2"},
        {"X-Unicode": "caf\u00e9"},
    ],
)
@pytest.mark.parametrize("scheme", list(Scheme))
def test_unsafe_extra_headers_are_refused(
    scheme: Scheme, extra: dict[str, str], rsa_key: SenderKey
) -> None:
    with pytest.raises(SigningError):
        sign_request(
            scheme, url=URL, body_sha256=body_sha256(BODY), key=rsa_key, extra_headers=extra
        )


@pytest.mark.parametrize(
    "url", ["ftp://remote.example/inbox", "/inbox", "https:///inbox", "https://r.example/a b"]
)
@pytest.mark.parametrize("scheme", list(Scheme))
def test_a_url_that_cannot_be_signed_raises_signing_error(
    scheme: Scheme, url: str, rsa_key: SenderKey
) -> None:
    with pytest.raises(SigningError):
        sign_request(scheme, url=url, body_sha256=body_sha256(BODY), key=rsa_key)


# --- keys --------------------------------------------------------------------


def test_sender_key_repr_shows_the_key_id_and_algorithm_but_no_key_material(
    rsa_key: SenderKey, ed_key: SenderKey, rsa_private: rsa.RSAPrivateKey
) -> None:
    for key in (rsa_key, ed_key):
        text = repr(key)
        assert text == f"SenderKey(key_id={key.key_id!r}, algorithm={key.algorithm!r})"
        assert str(key) == text
        pem_lines = pkcs8_pem(key).decode().splitlines()[1:-1]
        assert not any(line in text for line in pem_lines)
    assert str(rsa_private.private_numbers().d) not in repr(rsa_key)


def test_algorithm_names_the_key_type(rsa_key: SenderKey, ed_key: SenderKey) -> None:
    assert rsa_key.algorithm == "rsa"
    assert ed_key.algorithm == "ed25519"


@pytest.mark.parametrize("key_name", ["rsa_key", "ed_key"])
@pytest.mark.parametrize("as_text", [True, False])
def test_from_pem_loads_the_same_key(
    key_name: str, as_text: bool, request: pytest.FixtureRequest
) -> None:
    key: SenderKey = request.getfixturevalue(key_name)
    pem = pkcs8_pem(key)
    loaded = SenderKey.from_pem(key.key_id, pem.decode() if as_text else pem)
    assert loaded.key_id == key.key_id
    assert loaded.algorithm == key.algorithm
    assert loaded.public_key_pem() == key.public_key_pem()
    assert loaded.public_key_pem().startswith("-----BEGIN PUBLIC KEY-----")


def test_from_pem_accepts_a_traditional_pkcs1_rsa_key(rsa_key: SenderKey) -> None:
    pem = rsa_key.private_key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.TraditionalOpenSSL,
        serialization.NoEncryption(),
    )
    assert pem.startswith(b"-----BEGIN RSA PRIVATE KEY-----")
    assert SenderKey.from_pem(RSA_KEY_ID, pem).public_key_pem() == rsa_key.public_key_pem()


def test_from_pem_decrypts_with_the_password_and_fails_safely_without_it(
    ed_key: SenderKey,
) -> None:
    pem = pkcs8_pem(ed_key, password=b"hunter2")
    loaded = SenderKey.from_pem(ED_KEY_ID, pem, password=b"hunter2")
    assert loaded.public_key_pem() == ed_key.public_key_pem()
    for password in (None, b"wrong"):
        with pytest.raises(SigningError) as caught:
            SenderKey.from_pem(ED_KEY_ID, pem, password=password)
        message = str(caught.value)
        assert ED_KEY_ID in message
        assert "hunter2" not in message
        assert not any(line in message for line in pem.decode().splitlines()[1:-1])


def test_from_pem_takes_the_password_as_text_too(ed_key: SenderKey) -> None:
    # As the environment gives it: the right password, refused and called
    # perhaps wrong, sent its user after the wrong cause.
    pem = pkcs8_pem(ed_key, password=b"hunter2")
    loaded = SenderKey.from_pem(ED_KEY_ID, pem, password="hunter2")
    assert loaded.public_key_pem() == ed_key.public_key_pem()


def test_from_pem_given_a_password_for_a_key_not_encrypted_says_so(ed_key: SenderKey) -> None:
    # One password given for every sender, some of whose keys are stored
    # unencrypted: the error asked whether the password was right.
    with pytest.raises(SigningError) as caught:
        SenderKey.from_pem(ED_KEY_ID, pkcs8_pem(ed_key), password=b"hunter2")
    message = str(caught.value)
    assert "a password was given, but the key is not encrypted" in message, message
    assert ED_KEY_ID in message and "hunter2" not in message


def test_from_pem_takes_a_password_that_is_no_utf8_as_the_environment_gives_it(
    ed_key: SenderKey,
) -> None:
    # os.environ gives bytes that are no UTF-8 as surrogates: encoded as
    # UTF-8, the password raised a bare UnicodeEncodeError quoting it.
    secret = "pässwörd".encode("latin-1")
    pem = pkcs8_pem(ed_key, password=secret)
    loaded = SenderKey.from_pem(ED_KEY_ID, pem, password=os.fsdecode(secret))
    assert loaded.public_key_pem() == ed_key.public_key_pem()


@pytest.mark.parametrize("password", ["", b"", 1234], ids=["empty text", "empty bytes", "int"])
def test_from_pem_of_an_encrypted_key_never_says_it_is_not_encrypted(
    ed_key: SenderKey, password: Any
) -> None:
    # cryptography raises the same TypeError for an empty password, one of
    # another type, and one given to a key not encrypted.
    with pytest.raises(SigningError) as caught:
        SenderKey.from_pem(ED_KEY_ID, pkcs8_pem(ed_key, password=b"hunter2"), password=password)
    message = str(caught.value)
    assert "not encrypted" not in message and ED_KEY_ID in message, message
    if isinstance(password, int):
        assert "must be text or bytes, not int" in message, message


def test_from_pem_with_garbage_names_the_key_id_and_not_the_pem() -> None:
    garbage = "-----BEGIN PRIVATE KEY-----\nTOPSECRETbutNotAKey==\n-----END PRIVATE KEY-----\n"
    with pytest.raises(SigningError) as caught:
        SenderKey.from_pem(RSA_KEY_ID, garbage)
    message = str(caught.value)
    assert RSA_KEY_ID in message
    assert "TOPSECRET" not in message
    assert "BEGIN" not in message


@pytest.mark.parametrize(
    "pem",
    [None, 42, "-----BEGIN PRIVATE KEY-----\n\udcff\n-----END PRIVATE KEY-----\n"],
    ids=["none", "int", "undecodable-byte-from-the-environment"],
)
def test_from_pem_of_no_pem_or_an_undecodable_one_names_the_key_id(pem: object) -> None:
    """An actor whose key column is empty gave a bare TypeError ("argument of
    type 'NoneType' is not iterable"), and a PEM from the environment with a
    byte that is no UTF-8 (a lone surrogate, as Python gives it) a
    UnicodeEncodeError: neither named the key, and a delivery whose key
    provider raised them was retried with only the error's type."""
    with pytest.raises(SigningError) as caught:
        SenderKey.from_pem(RSA_KEY_ID, pem)  # type: ignore[arg-type]
    message = str(caught.value)
    assert RSA_KEY_ID in message, message
    if not isinstance(pem, str):
        assert f"not {type(pem).__name__}" in message, message


@pytest.mark.parametrize("form", [str, bytes, bytearray, memoryview])
def test_from_pem_with_its_arguments_swapped_never_shows_the_key(
    rsa_key: SenderKey, form: type
) -> None:
    """``from_pem(actor.private_key_pem, key_id)``: the error quoted its
    "key id", the whole private key, into whatever logs or reports it."""
    pem = pkcs8_pem(rsa_key)
    given = pem.decode() if form is str else form(pem)
    with pytest.raises(SigningError) as caught:
        SenderKey.from_pem(given, RSA_KEY_ID)  # type: ignore[arg-type]
    message = str(caught.value)
    assert "BEGIN" not in message and pem.decode().splitlines()[1][:20] not in message, message
    assert "swapped" in message, message


def test_from_pem_refuses_an_unsupported_key_type_naming_the_key_id() -> None:
    pem = (
        ec.generate_private_key(ec.SECP256R1())
        .private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        .decode()
    )
    with pytest.raises(SigningError) as caught:
        SenderKey.from_pem(RSA_KEY_ID, pem)
    assert RSA_KEY_ID in str(caught.value)
    assert "only RSA and Ed25519" in str(caught.value)
    assert pem.splitlines()[1] not in str(caught.value)


def test_a_signing_failure_in_cryptography_becomes_signing_error(rsa_key: SenderKey) -> None:
    broken = mock.create_autospec(rsa.RSAPrivateKey, instance=True)
    broken.sign.side_effect = ValueError("digest too big for key size")
    key = SenderKey(key_id=RSA_KEY_ID, private_key=broken)
    for scheme in Scheme:
        with pytest.raises(SigningError) as caught:
            sign_request(scheme, url=URL, body_sha256=body_sha256(BODY), key=key)
        assert RSA_KEY_ID in str(caught.value)
        assert isinstance(caught.value.__cause__, ValueError)


def test_a_key_id_that_cannot_be_quoted_is_refused(rsa_key: SenderKey) -> None:
    key = SenderKey(key_id='https://social.example/"x"', private_key=rsa_key.private_key)
    for scheme in Scheme:
        with pytest.raises(SigningError):
            sign_request(scheme, url=URL, body_sha256=body_sha256(BODY), key=key)


# --- schemes and purity ------------------------------------------------------


def test_each_scheme_knows_the_other_for_double_knocking() -> None:
    assert Scheme.CAVAGE.other() is Scheme.RFC9421
    assert Scheme.RFC9421.other() is Scheme.CAVAGE
    assert Scheme("draft-cavage") is Scheme.CAVAGE
    assert Scheme("rfc9421") is Scheme.RFC9421


def test_the_signatures_package_imports_nothing_from_django() -> None:
    code = (
        "import sys, django_federation_delivery.signatures\n"
        "loaded = [m for m in sys.modules if m == 'django' or m.startswith('django.')]\n"
        "assert not loaded, loaded\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
