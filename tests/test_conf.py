from __future__ import annotations

import ipaddress
import re
from typing import Any

import pytest
from django.core.exceptions import ImproperlyConfigured

from django_federation_delivery.conf import AppSettings, Typed, app_settings, database_alias
from django_federation_delivery.retry import RetryPolicy
from django_federation_delivery.signatures import Scheme

from .conftest import QueueRouter

#: For each typed accessor, a value to write in its setting and what it then
#: reads, unlike what it reads while the setting is left alone.
WRITTEN_AND_READ: dict[str, tuple[Any, Any]] = {
    "key_cache_seconds": (61, 61.0),
    "max_inboxes": (1001, 1001),
    "priority_max_inboxes": (3, 3),
    "max_body_bytes": (1002, 1002),
    "permanent_if_sender_gone": ([401, "410"], frozenset({401, 410})),
    "retry": ({"ATTEMPTS": 4}, RetryPolicy(base=30.0, cap=3600.0, attempts=4, jitter=0.25)),
    "wait_as_asked": (0, False),
    "retry_after_max": (62, 62.0),
    "claim_size": (1003, 1003),
    "lease_seconds": (600, 600.0),
    "concurrency": ("1004", 1004),
    "per_host": (1005, 1005),
    "per_host_max": (1012, 1012),
    "slow_after_seconds": (63, 63.0),
    "slow_concurrency": (1006, 1006),
    "idle_poll_seconds": (64, 64.0),
    "new_work_poll_seconds": (0.65, 0.65),
    "heartbeat_seconds": (66, 66.0),
    "connect_timeout": (7, 7.0),
    "attempt_timeout": (68, 68.0),
    "max_answer_bytes": (1007, 1007),
    "error_length": (1008, 1008),
    "connections_per_host": (1009, 1009),
    "idle_connection_seconds": (69, 69.0),
    "max_idle_connections": (1010, 1010),
    "verify_tls": (0, False),
    "user_agent": ("tests/1.0", "tests/1.0"),
    "first_scheme": ("rfc9421", Scheme.RFC9421),
    "webhook_retry": ([1, 2], (1.0, 2.0)),
    "webhook_retry_after_max": (70, 70.0),
    "webhook_timeout": (71, 71.0),
    "webhook_max_bytes": (1011, 1011),
    "webhook_disable_after": (72, 72.0),
    "host_failing_after": (73, 73.0),
    "host_unavailable_after": (None, None),
    "channels": (["tests.channels.Pager"], ("tests.channels.Pager",)),
}


def test_each_typed_accessor_reads_its_own_setting_and_no_other(settings: Any) -> None:
    typed = {name for name, value in vars(AppSettings).items() if isinstance(value, Typed)}
    assert typed == set(WRITTEN_AND_READ)
    suite = settings.FEDERATION_DELIVERY
    for name, (written, read) in WRITTEN_AND_READ.items():
        settings.FEDERATION_DELIVERY = suite
        left_alone = getattr(app_settings, name)
        # Its setting written, and no other: an accessor that reads another
        # setting reads what it read before, whatever the values.
        settings.FEDERATION_DELIVERY = {**suite, name.upper(): written}
        assert getattr(app_settings, name) == read, name
        assert left_alone != read, f"{name} read {read!r} before its setting was written"


def test_a_typed_accessor_converts_what_is_written(settings: Any) -> None:
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "CONCURRENCY": "3",
        "LEASE_SECONDS": 60,
        "FIRST_SCHEME": "rfc9421",
        "PERMANENT_IF_SENDER_GONE": [401, "410"],
        "WEBHOOK_RETRY": [1, 2],
    }
    assert app_settings.concurrency == 3
    assert isinstance(app_settings.lease_seconds, float)
    assert app_settings.first_scheme is Scheme.RFC9421
    assert app_settings.permanent_if_sender_gone == frozenset({401, 410})
    assert app_settings.webhook_retry == (1.0, 2.0)


def test_a_typed_accessor_reads_the_defaults_merged_with_what_is_written(settings: Any) -> None:
    settings.FEDERATION_DELIVERY = {**settings.FEDERATION_DELIVERY, "RETRY": {"ATTEMPTS": 3}}
    assert app_settings.retry == RetryPolicy(base=30.0, cap=3600.0, attempts=3, jitter=0.25)


def test_a_typed_accessor_follows_override_settings(settings: Any) -> None:
    settings.FEDERATION_DELIVERY = {**settings.FEDERATION_DELIVERY, "PER_HOST": 5}
    assert app_settings.per_host == 5
    settings.FEDERATION_DELIVERY = {**settings.FEDERATION_DELIVERY, "PER_HOST": 7}
    assert app_settings.per_host == 7


@pytest.mark.parametrize(
    ("name", "bad", "named"),
    [
        ("CONCURRENCY", "many", "'many'"),
        ("ATTEMPT_TIMEOUT", None, "None"),
        ("FIRST_SCHEME", "hmac", "'hmac'"),
        ("RETRY", {"BASE": "soon"}, "'BASE': 'soon'"),
        # Whole numbers past what a float holds (OverflowError, converted).
        ("LEASE_SECONDS", 10**400, "= 1000"),
        ("WEBHOOK_TIMEOUT", 10**400, "= 1000"),
        ("WEBHOOK_RETRY", [10**400], "= [1000"),
        # What no policy takes: an event of no byte.
        ("WEBHOOK_MAX_BYTES", 0, "= 0 cannot be used: an event takes at least 1 byte"),
        ("RETRY", {"BASE": 10**400}, "'BASE': 1000"),
        ("RETRY", {"SCHEDULE": [10**400]}, "'SCHEDULE': [1000"),
        # Of a setting of dotted paths, a value that is not one by its type alone.
        ("CHANNELS", None, "not NoneType (not shown: it is not a dotted path)"),
        ("CHANNELS", "tests.channels.Pager", "'tests.channels.Pager'"),
    ],
    # 10**400's id would be 401 digits.
    ids=lambda value: "10**400" if value == 10**400 else None,
)
def test_a_value_a_typed_accessor_cannot_use_is_an_error_naming_it(
    settings: Any, name: str, bad: Any, named: str
) -> None:
    settings.FEDERATION_DELIVERY = {**settings.FEDERATION_DELIVERY, name: bad}
    with pytest.raises(ImproperlyConfigured) as caught:
        getattr(app_settings, name.lower())
    assert f"[{name!r}]" in str(caught.value)
    assert named in str(caught.value)


@pytest.mark.parametrize("name", ["ALLOWED_NETWORKS", "WEBHOOK_ALLOWED_NETWORKS"])
def test_networks_are_text_or_networks_never_a_number_or_bytes_taken_for_an_address(
    settings: Any, name: str
) -> None:
    written = ["10.0.0.0/8", ipaddress.ip_network("fd00::/8")]
    settings.FEDERATION_DELIVERY = {**settings.FEDERATION_DELIVERY, name: written}
    assert app_settings.allowed_networks(name) == tuple(map(ipaddress.ip_network, written))
    # ip_network() would take each for one address: 0.0.0.1, or 127.0.0.1.
    for bad in (True, 1, b"\x7f\x00\x00\x01"):
        settings.FEDERATION_DELIVERY = {**settings.FEDERATION_DELIVERY, name: [bad]}
        with pytest.raises(ImproperlyConfigured, match=f"has {re.escape(repr(bad))}, which is not"):
            app_settings.allowed_networks(name)


def test_unknown_keys_of_any_types_are_listed_in_a_stable_order(settings: Any) -> None:
    settings.FEDERATION_DELIVERY = {**settings.FEDERATION_DELIVERY, 1: 2, "Zzz": 3, None: 4}
    assert app_settings.unknown_keys() == ["Zzz", 1, None]


def test_a_typed_accessor_for_no_such_setting_cannot_be_declared() -> None:
    # Python 3.11 wraps what __set_name__ raises in a RuntimeError; 3.12 does not.
    with pytest.raises((TypeError, RuntimeError)) as caught:

        class Wrong(AppSettings):
            no_such = Typed(int)

    assert "'NO_SUCH'" in str(caught.value.__cause__ or caught.value)


class Elsewhere:
    """A router that says nothing of the app: others decide."""

    def db_for_write(self, model: type[Any], **hints: Any) -> str | None:
        return None if model._meta.app_label == "federation_delivery" else "elsewhere"


def test_no_database_named_is_the_one_the_routers_write_the_app_to(settings: Any) -> None:
    assert database_alias() == database_alias(None) == "default"
    settings.DATABASE_ROUTERS = [Elsewhere()]
    assert database_alias() == "default", "no router chose one"
    settings.DATABASE_ROUTERS = [Elsewhere(), QueueRouter()]
    assert database_alias() == "queue"
    assert database_alias("default") == "default", "one named is that one"
