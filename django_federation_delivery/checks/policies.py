"""Checks of the settings that are policies of their own: RETRY, RETENTION, BREAKER."""

from __future__ import annotations

from typing import Any

from django.core.checks import CheckMessage, Error
from django.utils.translation import gettext as _

from django_federation_delivery.breakers import Scope
from django_federation_delivery.checks.bounds import (
    DAY,
    LONGEST_RETENTION,
    MOST_ATTEMPTS,
    MOST_THRESHOLD,
    PREFIX,
    is_seconds,
    is_whole,
    unknown_keys,
)
from django_federation_delivery.conf import DEFAULTS, SETTING, shown
from django_federation_delivery.retry import LONGEST_WAIT


def check_retry(retry: Any) -> list[CheckMessage]:
    if not isinstance(retry, dict):
        return [
            Error(
                _("%(setting)s['RETRY'] must be a dict, not %(value)s.")
                % {"setting": SETTING, "value": shown(retry)},
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
        or not all(is_seconds(wait, LONGEST_WAIT) for wait in schedule)
    ):
        problems.append(
            _(
                "SCHEDULE must be None or a non-empty list of at most %(most)d waits in "
                "seconds, each above 0 and at most %(longest).0f, not %(value)s"
            )
            % {"most": MOST_ATTEMPTS - 1, "longest": LONGEST_WAIT, "value": shown(schedule)}
        )
    attempts = retry.get("ATTEMPTS")
    if not is_whole(attempts, 1, MOST_ATTEMPTS):
        problems.append(
            _("ATTEMPTS must be a whole number from 1 to %(most)d, not %(value)s")
            % {"most": MOST_ATTEMPTS, "value": shown(attempts)}
        )
    for name in ("BASE", "CAP"):
        if not is_seconds(retry.get(name), LONGEST_WAIT):
            problems.append(
                _(
                    "%(name)s must be a number of seconds above 0 and at most %(longest).0f, "
                    "not %(value)s"
                )
                % {"name": name, "longest": LONGEST_WAIT, "value": shown(retry.get(name))}
            )
    jitter = retry.get("JITTER")
    if isinstance(jitter, bool) or not isinstance(jitter, int | float) or not 0 <= jitter < 1:
        problems.append(
            _("JITTER must be a fraction from 0 up to 1, not %(value)s") % {"value": shown(jitter)}
        )
    # Sorted by their reprs: keys of different types do not compare.
    unknown = sorted(set(retry) - set(DEFAULTS["RETRY"]), key=repr)
    if unknown:
        problems.append(unknown_keys(unknown))
    return [
        Error(
            _("%(setting)s['RETRY']: %(problem)s.") % {"setting": SETTING, "problem": problem},
            hint=_("Known keys: %(keys)s; leave one out for its default.")
            % {"keys": ", ".join(DEFAULTS["RETRY"])},
            id=f"{PREFIX}.E007",
        )
        for problem in problems
    ]


def check_retention(retention: Any) -> list[CheckMessage]:
    if retention is None:
        return []  # everything kept
    hint = _(
        "Seconds by settled status, such as {'DELIVERED': 7 * 86400, 'SKIPPED': 7 * 86400, "
        "'FAILED': 30 * 86400, 'REFUSED': 30 * 86400, 'SUPERSEDED': 7 * 86400}; None for a "
        "status keeps it for ever, and RETENTION None keeps everything."
    )
    if not isinstance(retention, dict):
        return [
            Error(
                _("%(setting)s['RETENTION'] must be a dict or None, not %(value)s.")
                % {"setting": SETTING, "value": shown(retention)},
                hint=hint,
                id=f"{PREFIX}.E033",
            )
        ]
    problems = []
    for name, seconds in retention.items():
        if name not in DEFAULTS["RETENTION"]:
            problems.append(
                _("unknown status %(name)s (pending rows are never purged)") % {"name": shown(name)}
            )
        elif seconds is not None and not is_seconds(seconds, LONGEST_RETENTION):
            problems.append(
                _(
                    "%(name)s must be None or a number of seconds above 0 and at most "
                    "%(longest).0f, not %(value)s"
                )
                % {"name": name, "longest": LONGEST_RETENTION, "value": shown(seconds)}
            )
    return [
        Error(
            _("%(setting)s['RETENTION']: %(problem)s.") % {"setting": SETTING, "problem": problem},
            hint=hint,
            id=f"{PREFIX}.E033",
        )
        for problem in problems
    ]


def check_breaker(breaker: Any, given: Any) -> list[CheckMessage]:
    """``breaker`` as merged with the defaults; ``given`` as written (``...``
    when not written at all)."""
    if given is None or given == {}:
        return []  # breakers off
    if not isinstance(given, dict) and given is not ...:
        return [
            Error(
                _("%(setting)s['BREAKER'] must be a dict or None, not %(value)s.")
                % {"setting": SETTING, "value": shown(given)},
                hint=_(
                    "For example {'THRESHOLD': 10, 'COOL_OFF': 60, 'SCOPE': 'host'}; "
                    "None turns breakers off."
                ),
                id=f"{PREFIX}.E012",
            )
        ]
    problems = []
    threshold = breaker.get("THRESHOLD")
    if not is_whole(threshold, 1, MOST_THRESHOLD):
        problems.append(
            _("THRESHOLD must be a whole number from 1 to %(most)d, not %(value)s")
            % {"most": MOST_THRESHOLD, "value": shown(threshold)}
        )
    cool_off = breaker.get("COOL_OFF")
    if not is_seconds(cool_off, DAY):
        problems.append(
            _(
                "COOL_OFF must be a number of seconds above 0 and at most %(longest).0f, "
                "not %(value)s"
            )
            % {"longest": DAY, "value": shown(cool_off)}
        )
    scope = breaker.get("SCOPE")
    if not isinstance(scope, str) or scope not in {s.value for s in Scope}:
        problems.append(
            _("SCOPE must be one of %(scopes)s, not %(value)s")
            % {"scopes": ", ".join(repr(s.value) for s in Scope), "value": shown(scope)}
        )
    # Sorted by their reprs: keys of different types do not compare.
    unknown = sorted(set(breaker) - set(DEFAULTS["BREAKER"]), key=repr)
    if unknown:
        problems.append(unknown_keys(unknown))
    return [
        Error(
            _("%(setting)s['BREAKER']: %(problem)s.") % {"setting": SETTING, "problem": problem},
            hint=_("Known keys: %(keys)s; None turns breakers off.")
            % {"keys": ", ".join(DEFAULTS["BREAKER"])},
            id=f"{PREFIX}.E012",
        )
        for problem in problems
    ]
