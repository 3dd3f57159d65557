"""System checks for the ``FEDERATION_DELIVERY`` settings and the database."""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence
from typing import Any

from django.conf import settings
from django.core.checks import CheckMessage, Error, Tags, Warning, register
from django.core.exceptions import ImproperlyConfigured

from django_federation_delivery.conf import DEFAULTS, SETTING, app_settings
from django_federation_delivery.signatures import Scheme

PREFIX = "federation_delivery"


@register()
def check_settings(app_configs: Sequence[Any] | None = None, **kwargs: Any) -> list[CheckMessage]:
    errors: list[CheckMessage] = []
    value = getattr(settings, SETTING, {})
    if not isinstance(value, dict):
        return [
            Error(
                f"{SETTING} must be a dict.", hint="Write {SETTING} = {{...}}.", id=f"{PREFIX}.E001"
            )
        ]
    for name in app_settings.unknown_keys():
        errors.append(
            Error(
                f"{SETTING} has an unknown setting {name!r}.",
                hint=f"Known settings: {', '.join(sorted(DEFAULTS))}.",
                id=f"{PREFIX}.E002",
            )
        )
    if app_settings.get("SENDER_KEYS") is None:
        errors.append(
            Error(
                f"{SETTING}['SENDER_KEYS'] is not set: nothing can be signed.",
                hint="Name a callable that takes a sender and returns a SenderKey or None, "
                "e.g. 'myapp.federation.sender_key'.",
                id=f"{PREFIX}.E003",
            )
        )
    for name in (
        "SENDER_KEYS",
        "SENDER_GONE",
        "PERMANENT_STATUS",
        "SKIP_IF",
        "COLLECTION_SYNCHRONIZATION",
    ):
        try:
            app_settings.callable_setting(name)
        except ImproperlyConfigured as exc:
            errors.append(Error(str(exc), id=f"{PREFIX}.E004"))
    for name in (
        "CLAIM_SIZE",
        "CONCURRENCY",
        "PER_HOST",
        "MAX_ANSWER_BYTES",
        "ERROR_LENGTH",
        "CONNECTIONS_PER_HOST",
    ):
        number = app_settings.get(name)
        if isinstance(number, bool) or not isinstance(number, int) or number < 1:
            errors.append(
                Error(
                    f"{SETTING}[{name!r}] must be a whole number of 1 or more, not {number!r}.",
                    id=f"{PREFIX}.E005",
                )
            )
    for name in (
        "KEY_CACHE_SECONDS",
        "RETRY_AFTER_MAX",
        "LEASE_SECONDS",
        "IDLE_POLL_SECONDS",
        "NEW_WORK_POLL_SECONDS",
        "CONNECT_TIMEOUT",
        "ATTEMPT_TIMEOUT",
        "IDLE_CONNECTION_SECONDS",
    ):
        number = app_settings.get(name)
        if isinstance(number, bool) or not isinstance(number, int | float) or number <= 0:
            errors.append(
                Error(
                    f"{SETTING}[{name!r}] must be a number of seconds above 0, not {number!r}.",
                    id=f"{PREFIX}.E006",
                )
            )
    errors += _check_retry(app_settings.get("RETRY"))
    try:
        app_settings.allowed_networks()
    except ImproperlyConfigured as exc:
        errors.append(Error(str(exc), id=f"{PREFIX}.E008"))
    if app_settings.get("FIRST_SCHEME") not in {scheme.value for scheme in Scheme}:
        errors.append(
            Error(
                f"{SETTING}['FIRST_SCHEME'] is {app_settings.get('FIRST_SCHEME')!r}.",
                hint=f"Use one of {', '.join(repr(s.value) for s in Scheme)}.",
                id=f"{PREFIX}.E009",
            )
        )
    gone = app_settings.get("PERMANENT_IF_SENDER_GONE")
    if not isinstance(gone, list | tuple) or not all(
        isinstance(s, int) and 100 <= s <= 599 for s in gone
    ):
        errors.append(
            Error(
                f"{SETTING}['PERMANENT_IF_SENDER_GONE'] must be a list of HTTP "
                f"statuses such as [401], not {gone!r}.",
                id=f"{PREFIX}.E010",
            )
        )
    few = app_settings.get("PRIORITY_MAX_INBOXES")
    if few is not None and (isinstance(few, bool) or not isinstance(few, int) or few < 1):
        errors.append(
            Error(
                f"{SETTING}['PRIORITY_MAX_INBOXES'] must be None or a whole number "
                f"of 1 or more, not {few!r}.",
                id=f"{PREFIX}.E011",
            )
        )
    return errors


def _check_retry(retry: Any) -> list[CheckMessage]:
    if not isinstance(retry, dict):
        return [Error(f"{SETTING}['RETRY'] must be a dict, not {retry!r}.", id=f"{PREFIX}.E007")]
    problems = []
    schedule = retry.get("SCHEDULE")
    if schedule is not None and (
        not isinstance(schedule, list | tuple)
        or not schedule
        or not all(isinstance(w, int | float) and w > 0 for w in schedule)
    ):
        problems.append(
            f"SCHEDULE must be None or a non-empty list of waits in seconds, not {schedule!r}"
        )
    attempts = retry.get("ATTEMPTS")
    if isinstance(attempts, bool) or not isinstance(attempts, int) or attempts < 1:
        problems.append(f"ATTEMPTS must be a whole number of 1 or more, not {attempts!r}")
    for name in ("BASE", "CAP"):
        if not isinstance(retry.get(name), int | float) or retry[name] <= 0:
            problems.append(f"{name} must be a number of seconds above 0, not {retry.get(name)!r}")
    jitter = retry.get("JITTER")
    if not isinstance(jitter, int | float) or not 0 <= jitter < 1:
        problems.append(f"JITTER must be a fraction from 0 up to 1, not {jitter!r}")
    unknown = sorted(set(retry) - set(DEFAULTS["RETRY"]))
    if unknown:
        problems.append(f"unknown key(s) {', '.join(map(repr, unknown))}")
    return [Error(f"{SETTING}['RETRY']: {problem}.", id=f"{PREFIX}.E007") for problem in problems]


@register(Tags.database)
def check_sqlite(app_configs: Sequence[Any] | None = None, **kwargs: Any) -> list[CheckMessage]:
    """SQLite needs WAL and a busy timeout for a web process and the deliverer
    to write at once without "database is locked"."""
    from django.db import connections

    messages: list[CheckMessage] = []
    for alias in kwargs.get("databases") or []:
        connection = connections[alias]
        if connection.vendor != "sqlite":
            continue
        messages += sqlite_problems(alias, connection)
    return messages


def sqlite_problems(alias: str, connection: Any) -> list[CheckMessage]:
    messages: list[CheckMessage] = []
    if sqlite3.sqlite_version_info < (3, 35, 0):
        messages.append(
            Error(
                f"SQLite {sqlite3.sqlite_version} has no UPDATE … RETURNING, which claims need.",
                hint="Use SQLite 3.35 or newer.",
                id=f"{PREFIX}.E020",
            )
        )
    timeout = connection.settings_dict.get("OPTIONS", {}).get("timeout")
    if not isinstance(timeout, int | float) or timeout < 10:
        messages.append(
            Warning(
                f"The SQLite database {alias!r} has a busy timeout of {timeout or 5} s.",
                hint="Set DATABASES[...]['OPTIONS']['timeout'] = 20 (seconds) or more, so that "
                "the deliverer and web processes wait for each other's writes instead of failing "
                "with 'database is locked'.",
                id=f"{PREFIX}.W001",
            )
        )
    with connection.cursor() as cursor:
        cursor.execute("PRAGMA journal_mode")
        mode = str(cursor.fetchone()[0]).lower()
    if mode != "wal":
        messages.append(
            Warning(
                f"The SQLite database {alias!r} is in journal mode {mode!r}, not WAL.",
                hint="Use WAL so that readers do not block the deliverer's writes: on Django 5.1+ "
                "add 'init_command': 'PRAGMA journal_mode=WAL;' to OPTIONS, or run "
                "'PRAGMA journal_mode=WAL;' once on the database file (it persists).",
                id=f"{PREFIX}.W002",
            )
        )
    return messages


@register()
def check_webhooks(app_configs: Sequence[Any] | None = None, **kwargs: Any) -> list[CheckMessage]:
    """Each webhook destination parses; a message names it, never its URL (a credential)."""
    from django_federation_delivery.webhooks import parse_destination

    webhooks = (
        app_settings.get("WEBHOOKS") if isinstance(getattr(settings, SETTING, {}), dict) else {}
    )
    if not isinstance(webhooks, dict) or not all(isinstance(name, str) for name in webhooks):
        return [
            Error(
                f"{SETTING}['WEBHOOKS'] must be a dict of destination names to URLs.",
                hint='Write "WEBHOOKS": webhooks_from_env(env), which reads every WEBHOOK_<NAME> '
                "variable (from django_federation_delivery.webhooks).",
                id=f"{PREFIX}.E030",
            )
        ]
    errors: list[CheckMessage] = []
    for name, url in webhooks.items():
        try:
            parse_destination(name, url)
        except ImproperlyConfigured as exc:
            errors.append(
                Error(
                    str(exc),
                    hint=f"Set WEBHOOK_{name.upper()} (read by webhooks_from_env) to a URL of one "
                    "of the forms in the README's 'Webhooks (destinations)': slack://, "
                    "discord://, markdown://, telegram://, or https://…?secret=whsec_….",
                    id=f"{PREFIX}.E031",
                )
            )
    from django_federation_delivery.webhooks.policy import settings_problems

    if isinstance(getattr(settings, SETTING, {}), dict):
        errors += [
            Error(f"{SETTING}: {problem}.", id=f"{PREFIX}.E032") for problem in settings_problems()
        ]
    return errors
