from __future__ import annotations

from typing import Any

import pytest
from django.core.checks import run_checks
from django.db import connection, connections

from django_federation_delivery.checks import check_settings, sqlite_problems


def ids(settings: Any, **overrides: Any) -> list[str]:
    settings.FEDERATION_DELIVERY = {**settings.FEDERATION_DELIVERY, **overrides}
    return [message.id for message in check_settings()]


# Since Django 6.1, run_checks() runs the model checks against every
# database, and on SQLite the one of JSONField asks the database.
@pytest.mark.django_db
def test_the_test_settings_pass() -> None:
    assert [m.id for m in run_checks() if m.id and m.id.startswith("federation")] == []


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({"SENDR_KEYS": "x"}, "federation_delivery.E002"),
        ({"SENDER_KEYS": None}, "federation_delivery.E003"),
        ({"SENDER_KEYS": "tests.keys.no_such_thing"}, "federation_delivery.E004"),
        ({"PERMANENT_STATUS": 42}, "federation_delivery.E004"),
        ({"CONCURRENCY": 0}, "federation_delivery.E005"),
        ({"PER_HOST": "2"}, "federation_delivery.E005"),
        ({"LEASE_SECONDS": -1}, "federation_delivery.E006"),
        ({"RETRY": {"SCHEDULE": []}}, "federation_delivery.E007"),
        ({"RETRY": {"JITTER": 1.5}}, "federation_delivery.E007"),
        ({"RETRY": {"BACKOFF": 2}}, "federation_delivery.E007"),
        ({"ALLOWED_NETWORKS": ["loopback"]}, "federation_delivery.E008"),
        ({"FIRST_SCHEME": "cavage"}, "federation_delivery.E009"),
        ({"PERMANENT_IF_SENDER_GONE": [1000]}, "federation_delivery.E010"),
        ({"PRIORITY_MAX_INBOXES": 0}, "federation_delivery.E011"),
    ],
)
def test_each_misconfiguration_is_an_error_with_its_own_id(
    settings: Any, overrides: dict[str, Any], expected: str
) -> None:
    assert expected in ids(settings, **overrides)


def test_an_error_says_what_to_write_instead(settings: Any) -> None:
    settings.FEDERATION_DELIVERY = {**settings.FEDERATION_DELIVERY, "FIRST_SCHEME": "cavage"}
    (message,) = check_settings()
    assert "'cavage'" in message.msg
    assert "'draft-cavage'" in (message.hint or "")


def test_a_setting_that_is_not_a_dict_is_an_error(settings: Any) -> None:
    settings.FEDERATION_DELIVERY = ["SENDER_KEYS"]
    assert [m.id for m in check_settings()] == ["federation_delivery.E001"]


@pytest.mark.django_db(transaction=True)
@pytest.mark.skipif(connection.vendor != "sqlite", reason="SQLite only")
def test_sqlite_without_wal_or_a_busy_timeout_is_warned_about(settings: Any) -> None:
    conn = connections["default"]
    assert sqlite_problems("default", conn) == [], "the tests run as a deployment should"
    conn.settings_dict["OPTIONS"] = {}
    try:
        with conn.cursor() as cursor:
            cursor.execute("PRAGMA journal_mode=DELETE")
        found = {m.id: m for m in sqlite_problems("default", conn)}
    finally:
        conn.settings_dict["OPTIONS"] = {"timeout": 20}
        with conn.cursor() as cursor:
            cursor.execute("PRAGMA journal_mode=WAL")
    assert set(found) == {"federation_delivery.W001", "federation_delivery.W002"}
    assert "timeout" in (found["federation_delivery.W001"].hint or "")
    assert "journal_mode=WAL" in (found["federation_delivery.W002"].hint or "")
