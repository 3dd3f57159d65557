"""What a message may show of a URL, and what of it none may hold."""

from __future__ import annotations

import pytest

from django_federation_delivery.redaction import credentials, redact


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("https://a.example/inbox?token=SECRET#frag", "https://a.example/inbox"),
        ("https://user:SECRET@a.example/inbox", "https://a.example/inbox"),
        ("http:user:SECRET@a.example/inbox", "http:a.example/inbox"),
        # A "?" in the password does not hide the "@" that ends it.
        ("https://user:SE?CRET@a.example/", "https://a.example/"),
        ("https://a.example/@alice/inbox", "https://a.example/@alice/inbox"),
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
