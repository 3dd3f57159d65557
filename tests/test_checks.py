from __future__ import annotations

import io
import ipaddress
import re
import sys
import textwrap
import types
from pathlib import Path
from typing import Any

import pytest
from django.core.checks import run_checks
from django.core.exceptions import ImproperlyConfigured
from django.core.management import CommandError, call_command
from django.db import connection, connections

from django_federation_delivery.breakers import BreakerSettings, Scope
from django_federation_delivery.checks import (
    check_inbox_networks,
    check_isolation,
    check_settings,
    check_sqlite,
    check_webhooks,
    sqlite_problems,
)
from django_federation_delivery.checks.database import isolation_problems
from django_federation_delivery.conf import DEFAULTS, LEASE_MARGIN_SECONDS
from django_federation_delivery.deliverer import Deliverer
from django_federation_delivery.keys import KeyCache
from django_federation_delivery.transport.networks import allowed

from .conftest import QueueRouter


# Since Django 6.1, run_checks() runs the model checks against every
# database, and on SQLite the one of JSONField asks the database.
@pytest.mark.django_db
def test_the_test_settings_pass(settings: Any) -> None:
    # As manage.py check shows them: the tests' settings silence W003, as
    # their inboxes are on loopback on purpose.
    found = [m.id for m in run_checks() if m.id and m.id.startswith("federation")]
    assert [id for id in found if id not in settings.SILENCED_SYSTEM_CHECKS] == []


@pytest.mark.parametrize(
    ("networks", "warned"),
    [
        (["127.0.0.1/32"], ["127.0.0.1/32"]),
        (["10.1.0.0/16", "203.0.113.0/24"], ["10.1.0.0/16"]),
        (["172.20.0.0/16", "192.168.1.0/24"], ["172.20.0.0/16", "192.168.1.0/24"]),
        (["169.254.169.254/32"], ["169.254.169.254/32"]),
        (["::1/128", "fd00::/8", "2001:db8::/32"], ["::1/128", "fd00::/8"]),
        (["0.0.0.0/0"], ["0.0.0.0/0"]),
        # 0.0.0.0 and :: reach this machine's own listeners on Linux; the
        # shared space of CGNAT is where a tailnet's own services are.
        (["0.0.0.0/32", "::/128", "100.100.0.0/16"], ["0.0.0.0/32", "::/128", "100.100.0.0/16"]),
        (["203.0.113.0/24"], []),
        ([], []),
    ],
)
def test_local_networks_opened_to_inboxes_are_warned_of_pointing_at_the_webhook_setting(
    settings: Any, networks: list[str], warned: list[str]
) -> None:
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "ALLOWED_NETWORKS": networks,
        "WEBHOOK_ALLOWED_NETWORKS": ["127.0.0.0/8"],  # never warned of
    }
    messages = check_inbox_networks()
    assert [m.id for m in messages] == ["federation_delivery.W003"] * len(warned)
    for message, network in zip(messages, warned, strict=True):
        assert f"opens {network} to inboxes" in message.msg
        assert "WEBHOOK_ALLOWED_NETWORKS" in message.hint


@pytest.mark.parametrize(
    ("network", "local"),
    [
        # IPv4-mapped: [::ffff:127.0.0.1] is this machine's loopback.
        ("::ffff:127.0.0.0/104", "::ffff:127.0.0.1"),
        ("::ffff:0:0/96", "::ffff:10.0.0.1"),
        # 6to4: 2002:c0a8:101:: carries 192.168.1.1.
        ("2002:c0a8::/32", "2002:c0a8:101::1"),
        ("2000::/3", "2002:7f00:1::"),
        # NAT64: 64:ff9b::a9fe:a9fe carries 169.254.169.254.
        ("64:ff9b::/96", "64:ff9b::a9fe:a9fe"),
        # Teredo: the client's address, inverted, in the last 32 bits (127.0.0.1).
        ("2001::/32", "2001::80ff:fffe"),
        # The same forms of 203.0.113.0/24, which is no local network.
        ("::ffff:203.0.113.0/120", None),
        ("2002:cb00:7100::/40", None),
        ("64:ff9b::203.0.113.0/120", None),
        ("2001::34ff:8e00/120", None),
    ],
)
def test_local_networks_opened_through_an_ipv6_form_are_warned_of(
    settings: Any, network: str, local: str | None
) -> None:
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "ALLOWED_NETWORKS": [network],
    }
    warned = [m.id for m in check_inbox_networks()]
    assert warned == (["federation_delivery.W003"] if local else [])
    if local:
        # What it warns of: the transport lets an inbox there reach that local address.
        assert allowed(ipaddress.ip_address(local), (ipaddress.ip_network(network),))


@pytest.mark.django_db
def test_manage_py_check_warns_of_loopback_opened_to_inboxes(settings: Any) -> None:
    settings.SILENCED_SYSTEM_CHECKS = []  # the tests' own settings silence it
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "ALLOWED_NETWORKS": ["127.0.0.0/8"],
    }
    ids = [m.id for m in run_checks() if m.id and m.id.startswith("federation")]
    assert ids == ["federation_delivery.W003"]


def takes_nothing() -> None:
    """What no setting naming a callable can be: it takes no argument."""


def takes_three(first: Any, second: Any, third: Any) -> None:
    """What no setting naming a callable can be: it needs three arguments."""


def takes_two_and_more(first: Any, second: Any = None, *rest: Any, **named: Any) -> None:
    """What any of them can be: called with one argument or two."""


async def awaited(inbox: Any, activity: Any) -> bool:
    """What none can be: called, it answers a coroutine, which reads as true
    (it passed, and every delivery was skipped unsent)."""
    return False


INF = float("inf")
NAN = float("nan")
#: Whole, so finite, but past what a float holds: it is compared, not converted.
HUGE = 10**400

#: For every setting, a bad value, the id of the error it gets and what of
#: the value the message names.
BAD: dict[str, list[tuple[Any, str, str]]] = {
    "SENDER_KEYS": [
        (None, "E003", "SENDER_KEYS"),
        ("tests.keys.no_such_thing", "E004", "'tests.keys.no_such_thing'"),
        # A callable it cannot call as it calls it: named, with the call.
        (f"{__name__}.takes_nothing", "E004", f"'{__name__}.takes_nothing' cannot be called"),
    ],
    # Of a value that is not a dotted path, its type alone: it may be the key.
    "SENDER_GONE": [
        (42, "E004", "not int"),
        (f"{__name__}.takes_three", "E004", "as SENDER_GONE(sender): missing a required"),
    ],
    "PERMANENT_STATUS": [
        (42, "E004", "not int"),
        (f"{__name__}.takes_three", "E004", "as PERMANENT_STATUS(status)"),
    ],
    "SKIP_IF": [
        ("tests.keys.no_such_thing", "E004", "no_such_thing"),
        (f"{__name__}.takes_nothing", "E004", "as SKIP_IF(inbox, activity): too many"),
        (f"{__name__}.awaited", "E004", "as SKIP_IF(inbox, activity): it is an async function"),
    ],
    "COLLECTION_SYNCHRONIZATION": [
        (3.5, "E004", "not float"),
        (f"{__name__}.takes_three", "E004", f"'{__name__}.takes_three' cannot be called"),
    ],
    "KEY_CACHE_SECONDS": [(NAN, "E006", "nan"), (10**9, "E006", "1000000000")],
    "PRIORITY_MAX_INBOXES": [(0, "E011", "0"), (10**12, "E011", "1000000000000")],
    "MAX_INBOXES": [(0, "E005", "0"), (10**12, "E005", "1000000000000")],
    "MAX_BODY_BYTES": [(-1, "E005", "-1"), (1 << 40, "E005", str(1 << 40))],
    "PERMANENT_IF_SENDER_GONE": [([1000], "E010", "[1000]"), ([True], "E010", "[True]")],
    "RETRY": [
        ({"SCHEDULE": []}, "E007", "[]"),
        ({"SCHEDULE": [30, INF]}, "E007", "[30, inf]"),
        ({"JITTER": 1.5}, "E007", "1.5"),
        ({"BACKOFF": 2}, "E007", "'BACKOFF'"),
        ({"CAP": INF}, "E007", "inf"),
        ({"BASE": NAN}, "E007", "nan"),
        ({"ATTEMPTS": 10**30}, "E007", str(10**30)),
        ({"BASE": HUGE}, "E007", "BASE must be"),
        ({"SCHEDULE": [HUGE]}, "E007", "SCHEDULE must be"),
        ("often", "E007", "'often'"),
    ],
    "WAIT_AS_ASKED": [("yes", "E013", "'yes'")],
    "RETRY_AFTER_MAX": [(INF, "E006", "inf"), (NAN, "E006", "nan"), (-1, "E006", "-1")],
    "CLAIM_SIZE": [(0, "E005", "0"), (10**9, "E005", "1000000000")],
    "LEASE_SECONDS": [(-1, "E006", "-1"), (INF, "E006", "inf"), (HUGE, "E006", "not 1000")],
    "CONCURRENCY": [(0, "E005", "0"), (10**6, "E005", "1000000")],
    "PER_HOST": [("2", "E005", "'2'")],
    "PER_HOST_MAX": [(0, "E005", "0"), (1001, "E005", "1001")],
    "SLOW_AFTER_SECONDS": [(0, "E006", "0"), (INF, "E006", "inf")],
    "SLOW_CONCURRENCY": [(-1, "E005", "-1"), (2.5, "E005", "2.5")],
    "IDLE_POLL_SECONDS": [(NAN, "E006", "nan")],
    "NEW_WORK_POLL_SECONDS": [(True, "E006", "True")],
    "HEARTBEAT_SECONDS": [
        (0.1, "E034", "0.1"),
        (INF, "E034", "inf"),
        (NAN, "E034", "nan"),
        (601, "E034", "601"),
        ("5", "E034", "'5'"),
        (False, "E034", "False"),
    ],
    "BREAKER": [
        ({"SCOPE": "domain"}, "E012", "'domain'"),
        ({"THRESHOLD": 0}, "E012", "0"),
        ({"THRESHOLD": "10"}, "E012", "'10'"),
        ({"COOL_OFF": INF}, "E012", "inf"),
        ({"COOL_OFF": -5}, "E012", "-5"),
        ({"COOL_OFF": HUGE}, "E012", "not 1000"),
        ({"PROBES": 2}, "E012", "'PROBES'"),
        ("on", "E012", "'on'"),
    ],
    "CONNECT_TIMEOUT": [(INF, "E006", "inf")],
    "ATTEMPT_TIMEOUT": [(0, "E006", "0"), (295, "E015", "295"), (HUGE, "E006", "not 1000")],
    "MAX_ANSWER_BYTES": [(0, "E005", "0"), (1023, "E005", "1023")],
    "ERROR_LENGTH": [(10**9, "E005", "1000000000")],
    "CONNECTIONS_PER_HOST": [(0, "E005", "0")],
    "MAX_IDLE_CONNECTIONS": [(-1, "E005", "-1"), (1.5, "E005", "1.5")],
    "IDLE_CONNECTION_SECONDS": [(NAN, "E006", "nan")],
    "VERIFY_TLS": [("false", "E013", "'false'"), (0, "E013", "0")],
    "ALLOWED_NETWORKS": [
        (["loopback"], "E008", "'loopback'"),
        ("127.0.0.0/8", "E008", "'127"),
        # Which ipaddress takes for the address 0.0.0.1.
        ([True], "E008", "has True,"),
        ([1], "E008", "has 1,"),
    ],
    "WEBHOOK_ALLOWED_NETWORKS": [
        (["localhost"], "E008", "'localhost'"),
        ("127.0.0.0/8", "E008", "'WEBHOOK_ALLOWED_NETWORKS'"),
        ([True], "E008", "has True,"),
        ([1], "E008", "has 1,"),
    ],
    "USER_AGENT": [
        ("", "E014", "''"),
        ("bot/1.0\r\nX-Evil: 1", "E014", "'bot/1.0\\r\\nX-Evil: 1'"),
        ("bot\x00", "E014", "'bot\\x00'"),
        ("bøt/1.0", "E014", "'bøt/1.0'"),
        (None, "E014", "None"),
    ],
    "FIRST_SCHEME": [("cavage", "E009", "'cavage'"), (["rfc9421"], "E009", "['rfc9421']")],
    "WEBHOOKS": [(["ops"], "E030", "'WEBHOOKS'"), ({"ops": "ftp://x"}, "E031", "'ops'")],
    "CHANNELS": [
        ("tests.channels.Pager", "E035", "list of dotted paths"),
        (["tests.channels.Nothing"], "E035", "'tests.channels.Nothing'"),
        (["tests.settings.DEBUG"], "E035", "not a Channel subclass"),
        (["tests.channels.Pager", "tests.channels.Pager"], "E035", "both named 'pager'"),
        (["tests.channels.SlackAgain"], "E035", "scheme 'slack'"),
        (["tests.channels.Configured"], "E035", "missing a required argument: 'api_base'"),
        (["tests.channels.OneScheme"], "E035", "not 'pagery'"),
        (["tests.channels.Unmade"], "E035", "tests.channels.Unmade could not be made"),
    ],
    "WEBHOOK_RETRY": [([], "E032", "[]"), ([30, INF], "E032", "inf"), ([HUGE], "E032", "[1000")],
    "WEBHOOK_RETRY_AFTER_MAX": [(INF, "E032", "inf"), (0, "E032", "0")],
    "WEBHOOK_TIMEOUT": [
        (NAN, "E032", "nan"),
        ("10", "E032", "'10'"),
        (HUGE, "E032", "WEBHOOK_TIMEOUT must be"),
    ],
    "WEBHOOK_MAX_BYTES": [(0, "E005", "0"), (1 << 30, "E005", str(1 << 30))],
    "WEBHOOK_DISABLE_AFTER": [(0, "E006", "0"), (INF, "E006", "inf")],
    "HOST_FAILING_AFTER": [(-1, "E006", "-1"), (NAN, "E006", "nan")],
    "HOST_UNAVAILABLE_AFTER": [(0, "E006", "None or a number"), ("7d", "E006", "'7d'")],
    "RETENTION": [
        ("7d", "E033", "'7d'"),
        ({"DELIVERED": INF}, "E033", "inf"),
        ({"DELIVERED": HUGE}, "E033", "not 1000"),
        ({"FAILED": 0}, "E033", "0"),
        ({"DELIVERED": "7d"}, "E033", "'7d'"),
        ({"PENDING": 3600}, "E033", "'PENDING'"),
    ],
}


def checked() -> list[Any]:
    return [*check_settings(), *check_webhooks()]


def test_every_setting_has_a_check() -> None:
    assert set(BAD) == set(DEFAULTS)


@pytest.mark.parametrize(
    ("name", "bad", "expected", "named"),
    [(name, *case) for name, cases in BAD.items() for case in cases],
    # HUGE's own id would be its 401 digits.
    ids=lambda value: "10**400" if value == HUGE else None,
)
def test_each_misconfiguration_is_an_error_with_its_id_naming_the_value(
    settings: Any, name: str, bad: Any, expected: str, named: str
) -> None:
    settings.FEDERATION_DELIVERY = {**settings.FEDERATION_DELIVERY, name: bad}
    found = [m for m in checked() if m.id == f"federation_delivery.{expected}"]
    assert found, [m.id for m in checked()]
    assert any(named in m.msg for m in found), [m.msg for m in found]
    assert all(m.hint for m in found)


@pytest.mark.parametrize(
    "name",
    ["SENDER_KEYS", "SENDER_GONE", "PERMANENT_STATUS", "SKIP_IF", "COLLECTION_SYNCHRONIZATION"],
)
@pytest.mark.parametrize(
    "function",
    [f"{__name__}.takes_two_and_more", takes_two_and_more, max, None],
    ids=["path", "callable", "builtin", "none"],
)
def test_a_callable_setting_that_takes_its_arguments_passes(
    settings: Any, name: str, function: Any
) -> None:
    # A builtin whose signature cannot be had (max's, on every Python; bool's
    # can, since 3.13): it is taken at its word.
    settings.FEDERATION_DELIVERY = {**settings.FEDERATION_DELIVERY, name: function}
    unset = name == "SENDER_KEYS" and function is None
    assert [m.id for m in check_settings()] == (["federation_delivery.E003"] if unset else [])


def test_a_callable_given_itself_of_the_wrong_signature_is_named_by_its_qualified_name(
    settings: Any,
) -> None:
    def skip_if(inbox: str) -> bool:
        return False

    settings.FEDERATION_DELIVERY = {**settings.FEDERATION_DELIVERY, "SKIP_IF": skip_if}
    (message,) = check_settings()
    assert message.id == "federation_delivery.E004"
    assert message.msg == (
        f"FEDERATION_DELIVERY['SKIP_IF'] = {__name__}.{skip_if.__qualname__} cannot be "
        "called as SKIP_IF(inbox, activity): too many positional arguments."
    )


def test_a_sender_keys_that_takes_no_sender_fails_the_checks_not_each_delivery(
    settings: Any,
) -> None:
    # Let through, every inbox delivery's job would carry "the sender's key
    # could not be looked up: TypeError", retried until it was given up.
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "SENDER_KEYS": f"{__name__}.takes_nothing",
    }
    with pytest.raises(TypeError):
        KeyCache().get("https://social.example/users/alice")
    (message,) = check_settings()
    assert message.id == "federation_delivery.E004"
    assert "SENDER_KEYS(sender)" in (message.hint or "")


def test_an_unknown_setting_is_an_error_naming_it(settings: Any) -> None:
    settings.FEDERATION_DELIVERY = {**settings.FEDERATION_DELIVERY, "SENDR_KEYS": "x"}
    (message,) = check_settings()
    assert message.id == "federation_delivery.E002"
    assert "'SENDR_KEYS'" in message.msg


def test_unknown_keys_of_different_types_are_each_an_error_naming_them(settings: Any) -> None:
    # Keys that do not compare (1 < "Zzz" raises) are still reported, each.
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        1: 2,
        "Zzz": 3,
        "RETRY": {"BASE": 30.0, 1: 2, "X": 3},
        "BREAKER": {"THRESHOLD": 3, 1: 2, "Y": 1},
    }
    found = {(m.id, m.msg) for m in check_settings()}
    assert found == {
        ("federation_delivery.E002", "FEDERATION_DELIVERY has an unknown setting 1."),
        ("federation_delivery.E002", "FEDERATION_DELIVERY has an unknown setting 'Zzz'."),
        ("federation_delivery.E007", "FEDERATION_DELIVERY['RETRY']: unknown keys 'X', 1."),
        ("federation_delivery.E012", "FEDERATION_DELIVERY['BREAKER']: unknown keys 'Y', 1."),
    }


@pytest.mark.parametrize(
    ("setting", "expected"),
    [
        ({"LEASE_SECONDS": HUGE}, "E006"),
        ({"ATTEMPT_TIMEOUT": HUGE}, "E006"),
        ({"HOST_UNAVAILABLE_AFTER": HUGE}, "E006"),
        ({"HEARTBEAT_SECONDS": HUGE}, "E034"),
        ({"RETRY": {"BASE": HUGE}}, "E007"),
        ({"RETRY": {"SCHEDULE": [30, HUGE]}}, "E007"),
        ({"RETENTION": {"DELIVERED": HUGE}}, "E033"),
        ({"BREAKER": {"COOL_OFF": HUGE}}, "E012"),
    ],
)
def test_a_huge_whole_number_of_seconds_is_an_error_shown_cut_short(
    settings: Any, setting: dict[str, Any], expected: str
) -> None:
    # 10**400 is finite (an int), but no float: it is over the bound, and the
    # error names it as far as a line of a terminal shows, not 401 digits.
    settings.FEDERATION_DELIVERY = {**settings.FEDERATION_DELIVERY, **setting}
    (message,) = check_settings()
    assert message.id == f"federation_delivery.{expected}"
    assert "1" + "0" * 60 in message.msg
    assert len(message.msg) < 300, message.msg


@pytest.mark.parametrize(
    "setting",
    [
        {"WEBHOOK_TIMEOUT": HUGE},
        {"WEBHOOK_RETRY_AFTER_MAX": 10**5000},
        {"WEBHOOK_RETRY": [30, HUGE]},
    ],
)
def test_a_huge_whole_number_of_a_webhook_setting_is_an_error_shown_cut_short(
    settings: Any, setting: dict[str, Any]
) -> None:
    settings.FEDERATION_DELIVERY = {**settings.FEDERATION_DELIVERY, **setting}
    (message,) = check_webhooks()
    assert message.id == "federation_delivery.E032"
    assert "1000000000" in message.msg or "bits" in message.msg, message.msg
    assert len(message.msg) < 300, message.msg


@pytest.mark.parametrize(
    ("setting", "expected"),
    [
        ({"WEBHOOK_MAX_BYTES": "1MB"}, "E005"),
        ({"WEBHOOK_MAX_BYTES": 0}, "E005"),
        ({"WEBHOOK_ALLOWED_NETWORKS": ["localhost"]}, "E008"),
        ({"WEBHOOK_TIMEOUT": "10"}, "E032"),
    ],
)
def test_a_bad_webhook_setting_is_its_own_error_alone_not_a_kind_s_policy_too(
    settings: Any, setting: dict[str, Any], expected: str
) -> None:
    # Every kind's policy starts from it: no E036 "…: ImproperlyConfigured"
    # beside the error that names it.
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "WEBHOOKS": {"ops": "slack://hooks.slack.com/services/T0AAAA1/B0BBBB2/s3cretT0ken"},
        **setting,
    }
    assert [m.id for m in checked()] == [f"federation_delivery.{expected}"]


@pytest.mark.django_db
def test_a_deliverer_given_a_huge_whole_number_of_seconds_does_not_start_and_says_why(
    settings: Any,
) -> None:
    settings.FEDERATION_DELIVERY = {**settings.FEDERATION_DELIVERY, "LEASE_SECONDS": HUGE}
    with pytest.raises(CommandError, match=r"federation_delivery\.E006: .*'LEASE_SECONDS'.* 1000"):
        call_command("run_deliverer", "--drain")


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("setting", "expected"),
    [
        ({"CHANNELS": ["tests.channels.Nothing"]}, r"E035: .*'tests\.channels\.Nothing'"),
        ({"CHANNELS": ["tests.channels.Configured"]}, r"E035: .*tests\.channels\.Configured "),
        ({"WEBHOOKS": {"ops": "ftp://x.example/s3cret"}}, r"E031: .*'ops'"),
    ],
)
def test_a_deliverer_started_from_code_with_a_bad_destination_setting_says_why(
    settings: Any, setting: dict[str, Any], expected: str
) -> None:
    # call_command runs no system checks: the deliverer runs those of its own.
    settings.FEDERATION_DELIVERY = {**settings.FEDERATION_DELIVERY, **setting}
    with pytest.raises(CommandError, match=expected) as refused:
        call_command("run_deliverer", "--drain")
    assert "s3cret" not in str(refused.value)


@pytest.mark.parametrize("off", [None, {}])
def test_breakers_are_turned_off_by_none_or_an_empty_dict(settings: Any, off: Any) -> None:
    settings.FEDERATION_DELIVERY = {**settings.FEDERATION_DELIVERY, "BREAKER": off}
    assert check_settings() == []
    assert BreakerSettings.from_settings() is None
    assert Deliverer().breakers is None


def test_a_partial_breaker_takes_the_rest_from_the_defaults(settings: Any) -> None:
    settings.FEDERATION_DELIVERY = {**settings.FEDERATION_DELIVERY, "BREAKER": {"THRESHOLD": 3}}
    assert check_settings() == []
    assert BreakerSettings.from_settings() == BreakerSettings(3, 60.0, Scope.HOST)


@pytest.mark.parametrize("retention", [None, {"DELIVERED": None}, {"FAILED": 86400}])
def test_a_retention_of_none_or_seconds_by_status_passes(settings: Any, retention: Any) -> None:
    settings.FEDERATION_DELIVERY = {**settings.FEDERATION_DELIVERY, "RETENTION": retention}
    assert check_settings() == []


@pytest.mark.parametrize("seconds", [1, 2.5, 600])
def test_a_heartbeat_from_one_second_to_ten_minutes_passes(settings: Any, seconds: float) -> None:
    settings.FEDERATION_DELIVERY = {**settings.FEDERATION_DELIVERY, "HEARTBEAT_SECONDS": seconds}
    assert check_settings() == []


def test_an_attempt_that_fits_in_its_lease_with_the_margin_passes(settings: Any) -> None:
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "ATTEMPT_TIMEOUT": 290.0,
        "LEASE_SECONDS": 290.0 + LEASE_MARGIN_SECONDS,
    }
    assert check_settings() == []


def test_an_error_says_what_to_write_instead(settings: Any) -> None:
    settings.FEDERATION_DELIVERY = {**settings.FEDERATION_DELIVERY, "FIRST_SCHEME": "cavage"}
    (message,) = check_settings()
    assert "'cavage'" in message.msg
    assert "'draft-cavage'" in (message.hint or "")


def test_a_setting_that_is_not_a_dict_is_an_error(settings: Any) -> None:
    settings.FEDERATION_DELIVERY = ["SENDER_KEYS"]
    (message,) = check_settings()
    assert message.id == "federation_delivery.E001"
    assert message.msg == "FEDERATION_DELIVERY must be a dict, not list."
    assert message.hint == "Write FEDERATION_DELIVERY = {...}."


def test_a_setting_that_is_not_a_dict_is_named_by_its_type_alone(settings: Any) -> None:
    # A trailing comma makes a tuple of the dict: its value was repeated, a
    # webhook URL's secret path with it, in a check every command runs.
    hook = "slack://hooks.slack.com/services/T0AAAA1/B0BBBB2/s3cretT0kenV4lue9"
    settings.FEDERATION_DELIVERY = ({"WEBHOOKS": {"ops": hook}},)
    (message,) = check_settings()
    assert message.msg == "FEDERATION_DELIVERY must be a dict, not tuple."
    assert "hooks" not in f"{message.msg} {message.hint}"


@pytest.mark.django_db(transaction=True, databases=["default", "queue"])
@pytest.mark.skipif(connection.vendor != "sqlite", reason="SQLite only")
@pytest.mark.parametrize("routed", [False, True])
def test_only_the_queue_s_sqlite_databases_are_held_to_its_needs(
    monkeypatch: pytest.MonkeyPatch, settings: Any, routed: bool
) -> None:
    # Debian 11's SQLite 3.34, too old for the queue's claims: said of the
    # database the queue is in, never of the project's own, whose migrate it
    # would stop.
    monkeypatch.setattr(
        "django_federation_delivery.checks.database.sqlite3",
        types.SimpleNamespace(sqlite_version_info=(3, 34, 1), sqlite_version="3.34.1"),
    )
    if routed:
        settings.DATABASE_ROUTERS = [QueueRouter()]
    queue_s = "queue" if routed else "default"
    found = {
        alias: {m.id for m in check_sqlite(databases=[alias])} for alias in ("default", "queue")
    }
    assert found == {
        queue_s: {"federation_delivery.E020"},
        ("default" if routed else "queue"): set(),
    }


@pytest.mark.django_db(transaction=True)
@pytest.mark.skipif(connection.vendor != "sqlite", reason="SQLite only")
def test_sqlite_without_wal_or_a_busy_timeout_is_warned_about(settings: Any) -> None:
    conn = connections["default"]
    assert sqlite_problems("default", conn) == [], "the tests run as a deployment should"
    conn.settings_dict["OPTIONS"] = {}
    conn.close()  # the busy timeout is the connection's own, set as it opens
    try:
        with conn.cursor() as cursor:
            cursor.execute("PRAGMA journal_mode=DELETE")
        found = {m.id: m for m in sqlite_problems("default", conn)}
    finally:
        conn.settings_dict["OPTIONS"] = {"timeout": 20}
        conn.close()
        with conn.cursor() as cursor:
            cursor.execute("PRAGMA journal_mode=WAL")
    assert set(found) == {"federation_delivery.W001", "federation_delivery.W002"}
    assert "timeout" in (found["federation_delivery.W001"].hint or "")
    assert "journal_mode=WAL" in (found["federation_delivery.W002"].hint or "")


@pytest.mark.django_db(transaction=True)
@pytest.mark.skipif(connection.vendor != "sqlite", reason="SQLite only")
@pytest.mark.parametrize(("pragma", "warned"), [(30000, False), (2000, True)])
def test_the_busy_timeout_warned_about_is_the_one_the_connection_has(
    pragma: int, warned: bool
) -> None:
    import django
    from django.db.backends.sqlite3.base import DatabaseWrapper

    if django.VERSION < (5, 1):
        pytest.skip("OPTIONS' init_command is Django 5.1's on SQLite")

    options = {"init_command": f"PRAGMA journal_mode=WAL; PRAGMA busy_timeout={pragma}"}
    wrapper = DatabaseWrapper({**connection.settings_dict, "OPTIONS": options}, alias="busy")
    try:
        said = [m.msg for m in sqlite_problems("busy", wrapper) if m.id.endswith("W001")]
    finally:
        wrapper.close()
    assert said == (["The SQLite database 'busy' has a busy timeout of 2 s."] if warned else [])


@pytest.mark.django_db
@pytest.mark.skipif(connection.vendor != "sqlite", reason="SQLite only")
def test_sqlite_in_memory_as_the_test_runner_makes_it_is_not_asked_for_wal() -> None:
    from django.db.backends.sqlite3.base import DatabaseWrapper

    memory = DatabaseWrapper(
        {**connections["default"].settings_dict, "NAME": ":memory:", "OPTIONS": {"timeout": 20}},
        alias="memory",
    )
    try:
        assert memory.is_in_memory_db()
        assert sqlite_problems("memory", memory) == []
    finally:
        # Django's close() keeps a database in memory open, lest it be lost.
        if memory.connection is not None:
            memory.connection.close()


@pytest.mark.parametrize(
    "breaker", [{"SCOPE": "domain"}, {"COOL_OFF": float("inf")}, {"THRESHOLD": "many"}]
)
def test_a_bad_breaker_used_anyway_is_improperly_configured_naming_it(
    settings: Any, breaker: dict[str, Any]
) -> None:
    settings.FEDERATION_DELIVERY = {**settings.FEDERATION_DELIVERY, "BREAKER": breaker}
    with pytest.raises(ImproperlyConfigured, match=re.escape(repr(next(iter(breaker.values()))))):
        BreakerSettings.from_settings()


class MistypedRouter(QueueRouter):
    """Puts the app in "queu", a database DATABASES does not have."""

    def db_for_read(self, model: type[Any], **hints: Any) -> str | None:
        return "queu" if model._meta.app_label == "federation_delivery" else None

    db_for_write = db_for_read


class MigratesElsewhereRouter(QueueRouter):
    """Writes the app's rows to "queue", but lets migrate make its tables in
    "default" alone (an allow_migrate copied from another router)."""

    def allow_migrate(self, db: str, app_label: str, **hints: Any) -> bool | None:
        return db == "default" if app_label == "federation_delivery" else None


@pytest.mark.parametrize(
    ("router", "code", "said"),
    [
        (MistypedRouter(), "E037", "'queu', which is not in DATABASES"),
        (MigratesElsewhereRouter(), "E038", "'queue', but their allow_migrate() keeps"),
    ],
    ids=["no such database", "no tables made there"],
)
def test_a_router_that_puts_the_queue_where_it_cannot_be_is_an_error(
    settings: Any, router: QueueRouter, code: str, said: str
) -> None:
    # A mistyped alias crashed every command with ConnectionDoesNotExist,
    # from the package's own check; a router whose allow_migrate() kept the
    # tables out had migrate record them made, and the deliverer wait for
    # ever on "no such table", taken for an outage.
    settings.DATABASE_ROUTERS = [router]
    ours = [m for m in run_checks() if (m.id or "").startswith("federation_delivery.E")]
    assert [m.id for m in ours] == [f"federation_delivery.{code}"]
    assert said in ours[0].msg


POSTGRESQL = {"ENGINE": "django.db.backends.postgresql", "NAME": "app"}


@pytest.mark.parametrize("level", ["REPEATABLE_READ", "SERIALIZABLE"])
def test_a_postgresql_queue_above_read_committed_is_refused(level: str) -> None:
    # Under it, two sends with one ordering key at once both wait on the
    # same earlier delivery: each transaction's snapshot is older than the
    # commit the other waited for.
    from django.db.backends.postgresql.psycopg_any import IsolationLevel

    database = {**POSTGRESQL, "OPTIONS": {"isolation_level": IsolationLevel[level]}}
    (message,) = isolation_problems("default", database, "postgresql")
    assert message.id == "federation_delivery.E021"
    assert level.replace("_", " ") in message.msg and "'default'" in message.msg


@pytest.mark.parametrize(
    ("options", "level"),
    [
        (r"-c default_transaction_isolation=repeatable\ read", "REPEATABLE READ"),
        ("-c search_path=site -c default_transaction_isolation=serializable", "SERIALIZABLE"),
        (r"--default_transaction_isolation=repeatable\ read", "REPEATABLE READ"),
        # PostgreSQL takes a setting's name with dashes too.
        ("-c default-transaction-isolation=serializable", "SERIALIZABLE"),
        (r"--default-transaction_isolation=repeatable\ read", "REPEATABLE READ"),
    ],
)
def test_a_postgresql_queue_above_read_committed_by_libpq_options_is_refused(
    options: str, level: str
) -> None:
    # Set in the connection's options rather than isolation_level, it is
    # each transaction's default all the same.
    database = {**POSTGRESQL, "OPTIONS": {"options": options}}
    (message,) = isolation_problems("default", database, "postgresql")
    assert message.id == "federation_delivery.E021"
    assert level in message.msg


def test_read_committed_and_other_databases_are_left_alone() -> None:
    from django.db.backends.postgresql.psycopg_any import IsolationLevel

    for level in (IsolationLevel.READ_COMMITTED, IsolationLevel.READ_UNCOMMITTED):
        assert (
            isolation_problems(
                "default", {**POSTGRESQL, "OPTIONS": {"isolation_level": level}}, "postgresql"
            )
            == []
        )
    assert isolation_problems("default", POSTGRESQL, "postgresql") == []
    for options in (r"-c default_transaction_isolation=read\ committed", "-c search_path=a"):
        database = {**POSTGRESQL, "OPTIONS": {"options": options}}
        assert isolation_problems("default", database, "postgresql") == []
    sqlite = {"ENGINE": "django.db.backends.sqlite3", "OPTIONS": {"isolation_level": 3}}
    assert isolation_problems("default", sqlite, "sqlite") == []
    assert check_isolation() == [], "the tests' own database"


# A project's settings module that fails, and values no check expected.

#: A module of the project's that fails as it is imported: an environment
#: variable it reads is missing (KeyError), or it has a syntax error.
BROKEN_MODULES = {
    "keyerror": "import os\nTOKEN = os.environ['R42_MISSING_VARIABLE']\n"
    "def function(a, b=None):\n    return None\n",
    "syntaxerror": "def function(a, b=None):\n    return (\n",
}


def _broken_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, body: str) -> str:
    name = f"broken_settings_{abs(hash(body))}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(body))
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop(name, None)
    return f"{name}.function"


@pytest.mark.parametrize("setting", ["SENDER_KEYS", "SKIP_IF", "PERMANENT_STATUS"])
@pytest.mark.parametrize("broken", sorted(BROKEN_MODULES))
def test_a_callable_setting_whose_module_fails_to_import_is_e004_not_a_traceback(
    settings: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, setting: str, broken: str
) -> None:
    # CHANNELS handles exactly this (registry._imported: "SyntaxError, and
    # what a module raises as it runs, included"); the callable settings do
    # not: manage.py check dies with the module's own traceback.
    path = _broken_module(tmp_path, monkeypatch, BROKEN_MODULES[broken])
    settings.FEDERATION_DELIVERY = {**settings.FEDERATION_DELIVERY, setting: path}
    messages = check_settings()
    found = [m for m in messages if m.id == "federation_delivery.E004"]
    assert found and setting in found[0].msg, [(m.id, m.msg) for m in messages]


@pytest.mark.django_db
def test_run_deliverer_with_a_callable_setting_whose_module_fails_refuses_with_a_command_error(
    settings: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _broken_module(tmp_path, monkeypatch, BROKEN_MODULES["keyerror"])
    settings.FEDERATION_DELIVERY = {**settings.FEDERATION_DELIVERY, "SENDER_KEYS": path}
    with pytest.raises(CommandError, match=r"SENDER_KEYS.*cannot be imported: KeyError"):
        call_command("run_deliverer", "--drain")


@pytest.mark.parametrize(
    "url",
    [
        "telegram://123:ABCs3cret@-100123?api=http://127.0.0.1:99999",
        "telegram://123:ABCs3cret@-100123?api=http://127.0.0.1:abc",
        "telegram://123:ABCs3cret@-100123?api=http://127.0.0.1:0",
        "slack://hooks.slack.com:0/services/T0AAAA1/B0BBBB2/s3cret",
        "discord://discord.com:0/api/webhooks/123/s3cret",
    ],
)
def test_a_webhook_url_with_a_port_the_transport_refuses_is_reported_by_the_checks(
    settings: Any, url: str
) -> None:
    # The destination's own URL with port 99999 or "abc" is E031 ("its URL
    # is not a valid URL"); port 0 there, or any bad port in Telegram's
    # ?api=, passes every check, and each event then fails "not a usable
    # URL: ... has port 0, not from 1 to 65535" (send_test_webhook shows it).
    settings.FEDERATION_DELIVERY = {**settings.FEDERATION_DELIVERY, "WEBHOOKS": {"ops": url}}
    messages = check_webhooks()
    assert [m.id for m in messages] == ["federation_delivery.E031"], [m.msg for m in messages]
    assert "s3cret" not in messages[0].msg


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("RETRY", "often"),  # AttributeError: retry
        ("RETRY", ["BASE", 30]),  # AttributeError: retry
        ("HOST_FAILING_AFTER", float("nan")),  # ValueError: cannot convert float NaN to integer
        ("WEBHOOK_DISABLE_AFTER", float("inf")),  # OverflowError
        ("BREAKER", {"COOL_OFF": 10**400}),  # OverflowError: int too large to convert to float
        ("LEASE_SECONDS", float("inf")),  # built; run() dies with OverflowError
        ("IDLE_CONNECTION_SECONDS", float("nan")),  # built; run(drain=True) never delivers
        ("LEASE_SECONDS", -1),  # built; nothing is ever sent, "its lease ran out"
    ],
    ids=lambda value: str(value)[:20],
)
def test_a_deliverer_built_from_code_with_a_value_the_checks_refuse_is_improperly_configured(
    settings: Any, name: str, value: Any
) -> None:
    # README, Settings: "Code that reads a bad value anyway (a Deliverer built
    # without the checks) raises ImproperlyConfigured naming it."
    settings.FEDERATION_DELIVERY = {**settings.FEDERATION_DELIVERY, name: value}
    assert any(m.id.startswith("federation_delivery.E") for m in check_settings())
    with pytest.raises(ImproperlyConfigured, match=name):
        Deliverer()


TOO_MANY_DIGITS = 10**5000  # past sys.get_int_max_str_digits(): repr() raises ValueError


@pytest.mark.parametrize(
    ("setting", "expected"),
    [
        ({"RETRY": {"SCHEDULE": [30, TOO_MANY_DIGITS]}}, "E007"),
        ({"PERMANENT_IF_SENDER_GONE": [TOO_MANY_DIGITS]}, "E010"),
        ({"ALLOWED_NETWORKS": [TOO_MANY_DIGITS]}, "E008"),
        ({"CONCURRENCY": [TOO_MANY_DIGITS]}, "E005"),
    ],
    ids=["RETRY", "PERMANENT_IF_SENDER_GONE", "ALLOWED_NETWORKS", "CONCURRENCY"],
)
def test_a_huge_int_inside_a_list_is_an_error_not_a_traceback(
    settings: Any, setting: dict[str, Any], expected: str
) -> None:
    # checks.bounds.shown() handles 10**5000 alone ("<int of N bits>"), and
    # the webhook settings handle it in a list; every other setting's check
    # dies with "ValueError: Exceeds the limit (4300 digits) for integer
    # string conversion".
    settings.FEDERATION_DELIVERY = {**settings.FEDERATION_DELIVERY, **setting}
    messages = check_settings()
    assert f"federation_delivery.{expected}" in [m.id for m in messages]


def test_a_retry_schedule_too_long_says_how_long_it_may_be(settings: Any) -> None:
    # 10,000 waits of 30 s each: every wait is within what the message asks
    # for, and the list is not empty; what is wrong (at most 9,999 waits,
    # bounds.MOST_ATTEMPTS) is not said.
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "RETRY": {"SCHEDULE": [30] * 10_000},
    }
    (message,) = check_settings()
    assert message.id == "federation_delivery.E007"
    assert re.search(r"9,?999|10,?000", message.msg), message.msg


@pytest.mark.django_db
def test_run_deliverer_does_not_refuse_an_error_the_project_silenced(settings: Any) -> None:
    # A key the package does not know (one a newer version reads, kept through
    # a rollback) with E002 silenced: manage.py check finds no issue, as
    # Django's SILENCED_SYSTEM_CHECKS says, yet run_deliverer (and a task
    # queue's round: contrib/rounds.py) refuses to start on that very E002.
    settings.SILENCED_SYSTEM_CHECKS = [
        *settings.SILENCED_SYSTEM_CHECKS,
        "federation_delivery.E002",
    ]
    settings.FEDERATION_DELIVERY = {**settings.FEDERATION_DELIVERY, "FROM_A_NEWER_VERSION": 1}
    call_command("check")  # passes: the error is silenced
    call_command("run_deliverer", "--drain", stdout=io.StringIO())


def test_e021_names_a_postgis_queue_above_read_committed() -> None:
    from django.db.backends.postgresql.psycopg_any import IsolationLevel

    database = {"OPTIONS": {"isolation_level": IsolationLevel.SERIALIZABLE}}
    plain = isolation_problems(
        "default", {**database, "ENGINE": "django.db.backends.postgresql"}, "postgresql"
    )
    assert [error.id for error in plain] == ["federation_delivery.E021"]
    # The same PostgreSQL server, through GeoDjango's backend (vendor
    # "postgresql"): sends in one sequence go side by side all the same.
    gis = isolation_problems(
        "default", {**database, "ENGINE": "django.contrib.gis.db.backends.postgis"}, "postgresql"
    )
    assert [error.id for error in gis] == ["federation_delivery.E021"], (
        "a PostGIS queue at SERIALIZABLE passes manage.py check"
    )
