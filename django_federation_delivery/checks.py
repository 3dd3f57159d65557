"""System checks for the ``FEDERATION_DELIVERY`` settings and the database."""

from __future__ import annotations

import math
import sqlite3
from collections.abc import Sequence
from typing import Any

from django.conf import settings
from django.core.checks import CheckMessage, Error, Tags, Warning, register
from django.core.exceptions import ImproperlyConfigured
from django.utils.translation import gettext as _
from django.utils.translation import ngettext

from django_federation_delivery.breakers import Scope
from django_federation_delivery.conf import DEFAULTS, LEASE_MARGIN_SECONDS, SETTING, app_settings
from django_federation_delivery.retry import LONGEST_WAIT
from django_federation_delivery.signatures import Scheme

PREFIX = "federation_delivery"


#: Whole-number settings: the least and the most each may be. The most is
#: far past any real need, and keeps a typo from starving the machine.
WHOLE_NUMBERS: dict[str, tuple[int, int]] = {
    "CLAIM_SIZE": (1, 10_000),
    "CONCURRENCY": (1, 1_000),
    "PER_HOST": (1, 1_000),
    "SLOW_CONCURRENCY": (0, 10_000),
    "MAX_ANSWER_BYTES": (1, 64 << 20),
    "ERROR_LENGTH": (1, 100_000),
    "CONNECTIONS_PER_HOST": (1, 1_000),
    # 0: no keep-alive at all.
    "MAX_IDLE_CONNECTIONS": (0, 10_000),
    "MAX_INBOXES": (1, 10_000_000),
    "MAX_BODY_BYTES": (1, 16 << 20),
}
HOUR = 3600.0
DAY = 24 * HOUR
#: Settings in seconds: each above 0, finite, and at most this.
SECONDS: dict[str, float] = {
    "KEY_CACHE_SECONDS": DAY,
    "RETRY_AFTER_MAX": LONGEST_WAIT,
    "LEASE_SECONDS": DAY,
    "IDLE_POLL_SECONDS": HOUR,
    "NEW_WORK_POLL_SECONDS": 60.0,
    "SLOW_AFTER_SECONDS": HOUR,
    "CONNECT_TIMEOUT": 600.0,
    "ATTEMPT_TIMEOUT": HOUR,
    "IDLE_CONNECTION_SECONDS": HOUR,
}
#: The longest RETENTION of a status: past it, None (for ever) says it better.
LONGEST_RETENTION = 100 * 365 * DAY
#: HEARTBEAT_SECONDS: more often is a write a second for nothing; less, a
#: dead deliverer unnoticed for half an hour.
HEARTBEAT_RANGE = (1.0, 600.0)
MOST_ATTEMPTS = 10_000
MOST_THRESHOLD = 1_000_000
USER_AGENT_LENGTH = 500


@register()
def check_settings(app_configs: Sequence[Any] | None = None, **kwargs: Any) -> list[CheckMessage]:
    errors: list[CheckMessage] = []
    value = getattr(settings, SETTING, {})
    if not isinstance(value, dict):
        return [
            Error(
                _("%(setting)s must be a dict, not %(value)s.")
                % {"setting": SETTING, "value": _shown(value)},
                hint=_("Write %(setting)s = {...}.") % {"setting": SETTING},
                id=f"{PREFIX}.E001",
            )
        ]
    for name in app_settings.unknown_keys():
        errors.append(
            Error(
                _("%(setting)s has an unknown setting %(name)r.")
                % {"setting": SETTING, "name": name},
                hint=_("Known settings: %(names)s.") % {"names": ", ".join(sorted(DEFAULTS))},
                id=f"{PREFIX}.E002",
            )
        )
    if app_settings.get("SENDER_KEYS") is None:
        errors.append(
            Error(
                _("%(setting)s['SENDER_KEYS'] is not set: nothing can be signed.")
                % {"setting": SETTING},
                hint=_(
                    "Name a callable that takes a sender and returns a SenderKey or None, "
                    "e.g. 'myapp.federation.sender_key'."
                ),
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
            errors.append(
                Error(
                    str(exc),
                    hint=_("Write a dotted path such as 'myapp.federation.function', or None."),
                    id=f"{PREFIX}.E004",
                )
            )
    for name, (least, most) in WHOLE_NUMBERS.items():
        number = app_settings.get(name)
        if not _whole(number, least, most):
            errors.append(
                Error(
                    _(
                        "%(setting)s[%(name)r] must be a whole number from %(least)d to %(most)d, "
                        "not %(value)s."
                    )
                    % {
                        "setting": SETTING,
                        "name": name,
                        "least": least,
                        "most": most,
                        "value": _shown(number),
                    },
                    hint=_default_hint(name),
                    id=f"{PREFIX}.E005",
                )
            )
    for name, longest in SECONDS.items():
        number = app_settings.get(name)
        if not _seconds(number, longest):
            errors.append(
                Error(
                    _(
                        "%(setting)s[%(name)r] must be a number of seconds above 0 and at most "
                        "%(longest).0f, not %(value)s."
                    )
                    % {
                        "setting": SETTING,
                        "name": name,
                        "longest": longest,
                        "value": _shown(number),
                    },
                    hint=_default_hint(name),
                    id=f"{PREFIX}.E006",
                )
            )
    errors += _check_retry(app_settings.get("RETRY"))
    try:
        app_settings.allowed_networks()
    except ImproperlyConfigured as exc:
        errors.append(
            Error(
                str(exc),
                hint=_("A list of networks, such as ['127.0.0.0/8'], or [] for none."),
                id=f"{PREFIX}.E008",
            )
        )
    first = app_settings.get("FIRST_SCHEME")
    if not isinstance(first, str) or first not in {scheme.value for scheme in Scheme}:
        errors.append(
            Error(
                _("%(setting)s['FIRST_SCHEME'] is %(value)s.")
                % {"setting": SETTING, "value": _shown(first)},
                hint=_("Use one of %(schemes)s.")
                % {"schemes": ", ".join(repr(s.value) for s in Scheme)},
                id=f"{PREFIX}.E009",
            )
        )
    gone = app_settings.get("PERMANENT_IF_SENDER_GONE")
    if not isinstance(gone, list | tuple) or not all(_whole(s, 100, 599) for s in gone):
        errors.append(
            Error(
                _(
                    "%(setting)s['PERMANENT_IF_SENDER_GONE'] must be a list of HTTP "
                    "statuses such as [401], not %(value)s."
                )
                % {"setting": SETTING, "value": _shown(gone)},
                hint=_("Statuses from 100 to 599; [] for none."),
                id=f"{PREFIX}.E010",
            )
        )
    few = app_settings.get("PRIORITY_MAX_INBOXES")
    if few is not None and not _whole(few, 1, WHOLE_NUMBERS["MAX_INBOXES"][1]):
        errors.append(
            Error(
                _(
                    "%(setting)s['PRIORITY_MAX_INBOXES'] must be None or a whole number "
                    "from 1 to %(most)d, not %(value)s."
                )
                % {
                    "setting": SETTING,
                    "most": WHOLE_NUMBERS["MAX_INBOXES"][1],
                    "value": _shown(few),
                },
                hint=_("A few, such as 5: sends to that many inboxes or fewer go first."),
                id=f"{PREFIX}.E011",
            )
        )
    errors += _check_breaker(app_settings.get("BREAKER"), value.get("BREAKER", ...))
    for name in ("VERIFY_TLS", "WAIT_AS_ASKED"):
        flag = app_settings.get(name)
        if not isinstance(flag, bool):
            errors.append(
                Error(
                    _("%(setting)s[%(name)r] must be True or False, not %(value)s.")
                    % {"setting": SETTING, "name": name, "value": _shown(flag)},
                    hint=_default_hint(name),
                    id=f"{PREFIX}.E013",
                )
            )
    agent = app_settings.get("USER_AGENT")
    if (
        not isinstance(agent, str)
        or not agent.strip()
        or len(agent) > USER_AGENT_LENGTH
        or not (agent.isascii() and agent.isprintable())
    ):
        errors.append(
            Error(
                _(
                    "%(setting)s['USER_AGENT'] must be a non-empty line of printable ASCII "
                    "of at most %(most)d characters, not %(value)s."
                )
                % {"setting": SETTING, "most": USER_AGENT_LENGTH, "value": _shown(agent)},
                hint=_(
                    "Something like 'myserver/1.0 (+https://myserver.example)': it is "
                    "sent as a header, which a line break or a NUL would corrupt."
                ),
                id=f"{PREFIX}.E014",
            )
        )
    lease, timeout = app_settings.get("LEASE_SECONDS"), app_settings.get("ATTEMPT_TIMEOUT")
    if (
        _seconds(lease, SECONDS["LEASE_SECONDS"])
        and _seconds(timeout, SECONDS["ATTEMPT_TIMEOUT"])
        and timeout + LEASE_MARGIN_SECONDS > lease
    ):
        errors.append(
            Error(
                _(
                    "%(setting)s['ATTEMPT_TIMEOUT'] (%(timeout)r) and %(margin)g s to write its "
                    "outcome do not fit in LEASE_SECONDS (%(lease)r): an attempt could outlast "
                    "its lease and the delivery be sent twice."
                )
                % {
                    "setting": SETTING,
                    "timeout": timeout,
                    "margin": LEASE_MARGIN_SECONDS,
                    "lease": lease,
                },
                hint=_("Make LEASE_SECONDS at least ATTEMPT_TIMEOUT + %(margin)g.")
                % {"margin": LEASE_MARGIN_SECONDS},
                id=f"{PREFIX}.E015",
            )
        )
    errors += _check_retention(app_settings.get("RETENTION"))
    heartbeat = app_settings.get("HEARTBEAT_SECONDS")
    fewest, longest = HEARTBEAT_RANGE
    if not _seconds(heartbeat, longest) or heartbeat < fewest:
        errors.append(
            Error(
                _(
                    "%(setting)s['HEARTBEAT_SECONDS'] must be a number of seconds from "
                    "%(fewest)g to %(longest)g, not %(value)s."
                )
                % {
                    "setting": SETTING,
                    "fewest": fewest,
                    "longest": longest,
                    "value": _shown(heartbeat),
                },
                hint=_(
                    "Leave it out for the default, 5: each run_deliverer process writes its "
                    "heartbeat that often, and is taken for dead after three missed."
                ),
                id=f"{PREFIX}.E034",
            )
        )
    return errors


def _default_hint(name: str) -> str:
    return _("Leave it out for the default, %(default)r.") % {"default": DEFAULTS[name]}


def _whole(value: Any, least: int, most: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and least <= value <= most


def _seconds(value: Any, longest: float) -> bool:
    # inf and nan are floats too: a wait of either overflows a datetime.
    return (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and 0 < value <= longest
    )


def _shown(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}…"


def _check_retry(retry: Any) -> list[CheckMessage]:
    if not isinstance(retry, dict):
        return [
            Error(
                _("%(setting)s['RETRY'] must be a dict, not %(value)s.")
                % {"setting": SETTING, "value": _shown(retry)},
                hint=_("For example {'BASE': 30, 'CAP': 3600, 'ATTEMPTS': 12, 'JITTER': 0.25}."),
                id=f"{PREFIX}.E007",
            )
        ]
    problems = []
    schedule = retry.get("SCHEDULE")
    if schedule is not None and (
        not isinstance(schedule, list | tuple)
        or not schedule
        or len(schedule) >= MOST_ATTEMPTS
        or not all(_seconds(wait, LONGEST_WAIT) for wait in schedule)
    ):
        problems.append(
            _(
                "SCHEDULE must be None or a non-empty list of waits in seconds, each above 0 "
                "and at most %(longest).0f, not %(value)s"
            )
            % {"longest": LONGEST_WAIT, "value": _shown(schedule)}
        )
    attempts = retry.get("ATTEMPTS")
    if not _whole(attempts, 1, MOST_ATTEMPTS):
        problems.append(
            _("ATTEMPTS must be a whole number from 1 to %(most)d, not %(value)s")
            % {"most": MOST_ATTEMPTS, "value": _shown(attempts)}
        )
    for name in ("BASE", "CAP"):
        if not _seconds(retry.get(name), LONGEST_WAIT):
            problems.append(
                _(
                    "%(name)s must be a number of seconds above 0 and at most %(longest).0f, "
                    "not %(value)s"
                )
                % {"name": name, "longest": LONGEST_WAIT, "value": _shown(retry.get(name))}
            )
    jitter = retry.get("JITTER")
    if isinstance(jitter, bool) or not isinstance(jitter, int | float) or not 0 <= jitter < 1:
        problems.append(
            _("JITTER must be a fraction from 0 up to 1, not %(value)s") % {"value": _shown(jitter)}
        )
    unknown = sorted(set(retry) - set(DEFAULTS["RETRY"]))
    if unknown:
        problems.append(_unknown_keys(unknown))
    return [
        Error(
            _("%(setting)s['RETRY']: %(problem)s.") % {"setting": SETTING, "problem": problem},
            hint=_("Known keys: %(keys)s; leave one out for its default.")
            % {"keys": ", ".join(DEFAULTS["RETRY"])},
            id=f"{PREFIX}.E007",
        )
        for problem in problems
    ]


def _unknown_keys(unknown: list[str]) -> str:
    return ngettext("unknown key %(keys)s", "unknown keys %(keys)s", len(unknown)) % {
        "keys": ", ".join(map(repr, unknown))
    }


def _check_retention(retention: Any) -> list[CheckMessage]:
    if retention is None:
        return []  # everything kept
    hint = _(
        "Seconds by settled status, such as {'DELIVERED': 7 * 86400, 'SKIPPED': 7 * 86400, "
        "'FAILED': 30 * 86400, 'REFUSED': 30 * 86400}; None for a status keeps it for ever, "
        "and RETENTION None keeps everything."
    )
    if not isinstance(retention, dict):
        return [
            Error(
                _("%(setting)s['RETENTION'] must be a dict or None, not %(value)s.")
                % {"setting": SETTING, "value": _shown(retention)},
                hint=hint,
                id=f"{PREFIX}.E033",
            )
        ]
    problems = []
    for name, seconds in retention.items():
        if name not in DEFAULTS["RETENTION"]:
            problems.append(
                _("unknown status %(name)s (pending rows are never purged)")
                % {"name": _shown(name)}
            )
        elif seconds is not None and not _seconds(seconds, LONGEST_RETENTION):
            problems.append(
                _(
                    "%(name)s must be None or a number of seconds above 0 and at most "
                    "%(longest).0f, not %(value)s"
                )
                % {"name": name, "longest": LONGEST_RETENTION, "value": _shown(seconds)}
            )
    return [
        Error(
            _("%(setting)s['RETENTION']: %(problem)s.") % {"setting": SETTING, "problem": problem},
            hint=hint,
            id=f"{PREFIX}.E033",
        )
        for problem in problems
    ]


def _check_breaker(breaker: Any, given: Any) -> list[CheckMessage]:
    """``breaker`` as merged with the defaults; ``given`` as written (``...``
    when not written at all)."""
    if given is None or given == {}:
        return []  # breakers off
    if not isinstance(given, dict) and given is not ...:
        return [
            Error(
                _("%(setting)s['BREAKER'] must be a dict or None, not %(value)s.")
                % {"setting": SETTING, "value": _shown(given)},
                hint=_(
                    "For example {'THRESHOLD': 10, 'COOL_OFF': 60, 'SCOPE': 'host'}; "
                    "None turns breakers off."
                ),
                id=f"{PREFIX}.E012",
            )
        ]
    problems = []
    threshold = breaker.get("THRESHOLD")
    if not _whole(threshold, 1, MOST_THRESHOLD):
        problems.append(
            _("THRESHOLD must be a whole number from 1 to %(most)d, not %(value)s")
            % {"most": MOST_THRESHOLD, "value": _shown(threshold)}
        )
    cool_off = breaker.get("COOL_OFF")
    if not _seconds(cool_off, DAY):
        problems.append(
            _(
                "COOL_OFF must be a number of seconds above 0 and at most %(longest).0f, "
                "not %(value)s"
            )
            % {"longest": DAY, "value": _shown(cool_off)}
        )
    scope = breaker.get("SCOPE")
    if not isinstance(scope, str) or scope not in {s.value for s in Scope}:
        problems.append(
            _("SCOPE must be one of %(scopes)s, not %(value)s")
            % {"scopes": ", ".join(repr(s.value) for s in Scope), "value": _shown(scope)}
        )
    unknown = sorted(set(breaker) - set(DEFAULTS["BREAKER"]))
    if unknown:
        problems.append(_unknown_keys(unknown))
    return [
        Error(
            _("%(setting)s['BREAKER']: %(problem)s.") % {"setting": SETTING, "problem": problem},
            hint=_("Known keys: %(keys)s; None turns breakers off.")
            % {"keys": ", ".join(DEFAULTS["BREAKER"])},
            id=f"{PREFIX}.E012",
        )
        for problem in problems
    ]


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
                _("SQLite %(version)s has no UPDATE … RETURNING, which claims need.")
                % {"version": sqlite3.sqlite_version},
                hint=_("Use SQLite 3.35 or newer."),
                id=f"{PREFIX}.E020",
            )
        )
    timeout = connection.settings_dict.get("OPTIONS", {}).get("timeout")
    if not isinstance(timeout, int | float) or timeout < 10:
        messages.append(
            Warning(
                _("The SQLite database %(alias)r has a busy timeout of %(timeout)s s.")
                % {"alias": alias, "timeout": timeout or 5},
                hint=_(
                    "Set DATABASES[...]['OPTIONS']['timeout'] = 20 (seconds) or more, so that "
                    "the deliverer and web processes wait for each other's writes instead of "
                    "failing with 'database is locked'."
                ),
                id=f"{PREFIX}.W001",
            )
        )
    with connection.cursor() as cursor:
        cursor.execute("PRAGMA journal_mode")
        mode = str(cursor.fetchone()[0]).lower()
    if mode != "wal":
        messages.append(
            Warning(
                _("The SQLite database %(alias)r is in journal mode %(mode)r, not WAL.")
                % {"alias": alias, "mode": mode},
                hint=_(
                    "Use WAL so that readers do not block the deliverer's writes: on Django 5.1+ "
                    "add 'init_command': 'PRAGMA journal_mode=WAL;' to OPTIONS, or run "
                    "'PRAGMA journal_mode=WAL;' once on the database file (it persists)."
                ),
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
                _("%(setting)s['WEBHOOKS'] must be a dict of destination names to URLs.")
                % {"setting": SETTING},
                hint=_(
                    'Write "WEBHOOKS": webhooks_from_env(env), which reads every WEBHOOK_<NAME> '
                    "variable (from django_federation_delivery.webhooks)."
                ),
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
                    hint=_(
                        "Set %(variable)s (read by webhooks_from_env) to a URL of one of the "
                        "forms in the README's 'Webhooks (destinations)': slack://, discord://, "
                        "markdown://, telegram://, or https://…?secret=whsec_…."
                    )
                    % {"variable": f"WEBHOOK_{name.upper()}"},
                    id=f"{PREFIX}.E031",
                )
            )
    from django_federation_delivery.webhooks.policy import settings_problems

    if isinstance(getattr(settings, SETTING, {}), dict):
        errors += [
            Error(
                _("%(setting)s: %(problem)s.") % {"setting": SETTING, "problem": problem},
                hint=_(
                    "Leave it out for the default: the nine tries across a day, "
                    "Retry-After honoured up to an hour, 10 s a request."
                ),
                id=f"{PREFIX}.E032",
            )
            for problem in settings_problems()
        ]
    return errors
