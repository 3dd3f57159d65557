"""The check of the ``FEDERATION_DELIVERY`` setting, value by value."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

from django.conf import settings
from django.core.checks import CheckMessage, Error, Warning, register
from django.core.exceptions import ImproperlyConfigured
from django.utils.translation import gettext as _

from django_federation_delivery.checks.bounds import (
    CALLABLES,
    HEARTBEAT_RANGE,
    PREFIX,
    SECONDS,
    SECONDS_OR_NONE,
    USER_AGENT_LENGTH,
    WHOLE_NUMBERS,
    WHOLE_NUMBERS_OR_NONE,
    default_hint,
    is_seconds,
    is_whole,
)
from django_federation_delivery.checks.policies import check_breaker, check_retention, check_retry
from django_federation_delivery.conf import (
    DEFAULTS,
    LEASE_MARGIN_SECONDS,
    SETTING,
    app_settings,
    shown,
    shown_path,
)
from django_federation_delivery.signatures import Scheme
from django_federation_delivery.transport.networks import opens_local


@register()
def check_settings(app_configs: Sequence[Any] | None = None, **kwargs: Any) -> list[CheckMessage]:
    errors: list[CheckMessage] = []
    try:
        value = app_settings.user_settings()
    except ImproperlyConfigured as exc:
        return [
            Error(
                str(exc),
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
    for name, arguments in CALLABLES.items():
        try:
            function = app_settings.callable_setting(name)
        except ImproperlyConfigured as exc:
            errors.append(
                Error(
                    str(exc),
                    hint=_("Write a dotted path such as 'myapp.federation.function', or None."),
                    id=f"{PREFIX}.E004",
                )
            )
            continue
        refused = None if function is None else _refused_call(function, arguments)
        if refused is not None:
            call = f"{name}({', '.join(arguments)})"
            errors.append(
                Error(
                    _("%(setting)s[%(name)r] = %(value)s cannot be called as %(call)s: %(error)s.")
                    % {
                        "setting": SETTING,
                        "name": name,
                        "value": _callable_shown(app_settings.get(name)),
                        "call": call,
                        "error": refused,
                    },
                    hint=_(
                        "The package calls it as %(call)s: name a callable that takes those "
                        "arguments, in that order, and needs no other."
                    )
                    % {"call": call},
                    id=f"{PREFIX}.E004",
                )
            )
    for name, (least, most) in WHOLE_NUMBERS.items():
        number = app_settings.get(name)
        if number is None and name in WHOLE_NUMBERS_OR_NONE:
            continue
        if not is_whole(number, least, most):
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
                        "value": shown(number),
                    },
                    hint=default_hint(name),
                    id=f"{PREFIX}.E005",
                )
            )
    for name, longest in SECONDS.items():
        number = app_settings.get(name)
        if number is None and name in SECONDS_OR_NONE:
            continue
        if not is_seconds(number, longest):
            message = (
                _(
                    "%(setting)s[%(name)r] must be None or a number of seconds above 0 and "
                    "at most %(longest).0f, not %(value)s."
                )
                if name in SECONDS_OR_NONE
                else _(
                    "%(setting)s[%(name)r] must be a number of seconds above 0 and at most "
                    "%(longest).0f, not %(value)s."
                )
            )
            errors.append(
                Error(
                    message
                    % {
                        "setting": SETTING,
                        "name": name,
                        "longest": longest,
                        "value": shown(number),
                    },
                    hint=default_hint(name),
                    id=f"{PREFIX}.E006",
                )
            )
    errors += check_retry(app_settings.get("RETRY"))
    for name in ("ALLOWED_NETWORKS", "WEBHOOK_ALLOWED_NETWORKS"):
        try:
            app_settings.allowed_networks(name)
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
                % {"setting": SETTING, "value": shown(first)},
                hint=_("Use one of %(schemes)s.")
                % {"schemes": ", ".join(repr(s.value) for s in Scheme)},
                id=f"{PREFIX}.E009",
            )
        )
    gone = app_settings.get("PERMANENT_IF_SENDER_GONE")
    if not isinstance(gone, list | tuple) or not all(is_whole(s, 100, 599) for s in gone):
        errors.append(
            Error(
                _(
                    "%(setting)s['PERMANENT_IF_SENDER_GONE'] must be a list of HTTP "
                    "statuses such as [401], not %(value)s."
                )
                % {"setting": SETTING, "value": shown(gone)},
                hint=_("Statuses from 100 to 599; [] for none."),
                id=f"{PREFIX}.E010",
            )
        )
    few = app_settings.get("PRIORITY_MAX_INBOXES")
    if few is not None and not is_whole(few, 1, WHOLE_NUMBERS["MAX_INBOXES"][1]):
        errors.append(
            Error(
                _(
                    "%(setting)s['PRIORITY_MAX_INBOXES'] must be None or a whole number "
                    "from 1 to %(most)d, not %(value)s."
                )
                % {
                    "setting": SETTING,
                    "most": WHOLE_NUMBERS["MAX_INBOXES"][1],
                    "value": shown(few),
                },
                hint=_("A few, such as 5: sends to that many inboxes or fewer go first."),
                id=f"{PREFIX}.E011",
            )
        )
    errors += check_breaker(app_settings.get("BREAKER"), value.get("BREAKER", ...))
    for name in ("VERIFY_TLS", "WAIT_AS_ASKED"):
        flag = app_settings.get(name)
        if not isinstance(flag, bool):
            errors.append(
                Error(
                    _("%(setting)s[%(name)r] must be True or False, not %(value)s.")
                    % {"setting": SETTING, "name": name, "value": shown(flag)},
                    hint=default_hint(name),
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
                % {"setting": SETTING, "most": USER_AGENT_LENGTH, "value": shown(agent)},
                hint=_(
                    "Something like 'myserver/1.0 (+https://myserver.example)': it is "
                    "sent as a header, which a line break or a NUL would corrupt."
                ),
                id=f"{PREFIX}.E014",
            )
        )
    lease, timeout = app_settings.get("LEASE_SECONDS"), app_settings.get("ATTEMPT_TIMEOUT")
    if (
        is_seconds(lease, SECONDS["LEASE_SECONDS"])
        and is_seconds(timeout, SECONDS["ATTEMPT_TIMEOUT"])
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
    errors += check_retention(app_settings.get("RETENTION"))
    heartbeat = app_settings.get("HEARTBEAT_SECONDS")
    fewest, longest = HEARTBEAT_RANGE
    if not is_seconds(heartbeat, longest) or heartbeat < fewest:
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
                    "value": shown(heartbeat),
                },
                hint=_(
                    "Leave it out for the default, 5: each run_deliverer process writes its "
                    "heartbeat that often, and is taken for dead after three missed."
                ),
                id=f"{PREFIX}.E034",
            )
        )
    return errors


def _refused_call(function: Callable[..., Any], arguments: tuple[str, ...]) -> str | None:
    """Why ``function`` cannot be called with ``arguments`` (as many
    positional ones), or None if it can, or if its signature cannot be had
    (a builtin, a function written in C): taken at its word. An ``async``
    one cannot: called, it answers a coroutine, never awaited, which reads
    as true (every delivery skipped, every sender gone)."""
    if inspect.iscoroutinefunction(function) or inspect.iscoroutinefunction(
        type(function).__call__
    ):
        return "it is an async function, and the package awaits nothing: write a plain one"
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):
        return None
    try:
        signature.bind(*arguments)
    except TypeError as exc:
        return str(exc)
    return None


def _callable_shown(value: object) -> str:
    """A callable setting's value as an error names it: its dotted path, or a
    callable given itself by its qualified name, never its ``repr`` (a
    partial's shows what it was given, a key maybe)."""
    if isinstance(value, str):
        return shown_path(value)
    module = getattr(value, "__module__", None)
    qualname = getattr(value, "__qualname__", None)
    if isinstance(module, str) and isinstance(qualname, str):
        return f"{module}.{qualname}"
    return type(value).__name__


@register()
def check_inbox_networks(
    app_configs: Sequence[Any] | None = None, **kwargs: Any
) -> list[CheckMessage]:
    """A warning for each local network ``ALLOWED_NETWORKS`` opens to inboxes."""
    if not isinstance(getattr(settings, SETTING, {}), dict):
        return []  # E001 says so
    try:
        opened = app_settings.allowed_networks()
    except ImproperlyConfigured:
        return []  # E008 says so
    return [
        Warning(
            _(
                "%(setting)s['ALLOWED_NETWORKS'] opens %(network)s to inboxes: anyone who "
                "names an inbox there has the deliverer POST to your own services."
            )
            % {"setting": SETTING, "network": network},
            hint=_(
                "Open it to webhook destinations alone with WEBHOOK_ALLOWED_NETWORKS; "
                "keep it in ALLOWED_NETWORKS only where inboxes really are local "
                "(tests, a private federation)."
            ),
            id=f"{PREFIX}.W003",
        )
        # Opened to inboxes, they are open to whoever names an inbox there.
        for network in opened
        if opens_local(network)
    ]
