"""Checks of the webhook destinations and their settings."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from django.conf import settings
from django.core.checks import CheckMessage, Error, Tags, Warning, register
from django.core.exceptions import ImproperlyConfigured
from django.utils.translation import gettext as _
from django.utils.translation import ngettext

from django_federation_delivery.checks.bounds import PREFIX
from django_federation_delivery.conf import SETTING, app_settings

if TYPE_CHECKING:
    from django_federation_delivery.channels import Destination


@register()
def check_webhooks(app_configs: Sequence[Any] | None = None, **kwargs: Any) -> list[CheckMessage]:
    """The kinds added load, and each webhook destination parses; a message
    names it, never its URL (a credential)."""
    from django_federation_delivery.channels import registry
    from django_federation_delivery.webhooks.destinations import configured

    if not isinstance(getattr(settings, SETTING, {}), dict):
        return []
    try:
        registry()
    except ImproperlyConfigured as exc:
        return [
            Error(
                str(exc),
                hint=_(
                    "CHANNELS lists dotted paths to Channel subclasses of "
                    "django_federation_delivery.channels, each made with no arguments, "
                    "with a name and a tuple of schemes of its own."
                ),
                id=f"{PREFIX}.E035",
            )
        ]
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
    errors: list[CheckMessage] = [
        Error(
            problem,
            hint=_hint(name),
            id=f"{PREFIX}.E031",
        )
        for name, problem in configured().problems.items()
    ]
    errors += _policy_errors(configured().destinations.values())
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


def _policy_errors(destinations: Iterable[Destination]) -> list[CheckMessage]:
    """An error for each kind in use whose policy cannot be had (E036), once
    a kind; only when the settings it starts from are good."""
    from django_federation_delivery.channels.base import policy_of
    from django_federation_delivery.webhooks.policy import settings_policy

    try:
        settings_policy()
    except ImproperlyConfigured:
        # A WEBHOOK_* setting is wrong: E005, E008 or E032 says which.
        return []
    errors: list[CheckMessage] = []
    seen = set()
    for destination in destinations:
        channel = destination.channel
        if channel.name in seen:
            continue
        seen.add(channel.name)
        try:
            policy_of(channel)
        except ImproperlyConfigured as exc:
            errors.append(
                Error(
                    str(exc),
                    hint=_(
                        "A kind's policy() returns a Policy (django_federation_delivery.channels): "
                        "the WEBHOOK_* settings' by default, changed with dataclasses.replace()."
                    ),
                    id=f"{PREFIX}.E036",
                )
            )
    return errors


@register(Tags.database)
def check_removed_destinations(
    app_configs: Sequence[Any] | None = None, **kwargs: Any
) -> list[CheckMessage]:
    """A warning while pending events wait for a destination no longer
    configured (a WEBHOOK_<NAME> variable emptied or removed, say): the next
    deliverer to start gives them up."""
    from django.db import DatabaseError

    from django_federation_delivery.webhooks.status import destination_status

    if not isinstance(getattr(settings, SETTING, {}), dict):
        return []
    messages: list[CheckMessage] = []
    for alias in kwargs.get("databases") or []:
        try:
            destinations = destination_status(using=alias)
        except DatabaseError:
            continue  # not migrated yet: nothing can be pending
        messages += [
            Warning(
                ngettext(
                    "%(count)d event waits for the webhook destination %(name)r, which is "
                    "no longer configured: the next deliverer to start gives it up.",
                    "%(count)d events wait for the webhook destination %(name)r, which is "
                    "no longer configured: the next deliverer to start gives them up.",
                    destination.pending,
                )
                % {"count": destination.pending, "name": destination.name},
                hint=_(
                    "Set %(name)r in WEBHOOKS again (its variable %(variable)s, where "
                    "webhooks_from_env reads them) to deliver them, or give them up in "
                    "the admin."
                )
                % {"name": destination.name, "variable": f"WEBHOOK_{destination.name.upper()}"},
                id=f"{PREFIX}.W004",
            )
            for destination in destinations
            if not destination.configured and destination.pending
        ]
    return messages


def _hint(name: str) -> str:
    """What to do about a destination's problem: for one whose name is no
    name (shown by a placeholder, as it may be its URL), how to name it."""
    from django_federation_delivery.channels.registry import is_name

    if not is_name(name):
        return _(
            "Name each destination of WEBHOOKS with 1 to 64 lowercase letters, digits, "
            "'_' or '-' (WEBHOOK_<NAME> for webhooks_from_env), and give its URL as the value."
        )
    return _(
        "Set %(name)r in WEBHOOKS (its variable %(variable)s, where "
        "webhooks_from_env reads them) to a URL of one of the forms in the "
        "README's 'Webhooks (destinations)'."
    ) % {"name": name, "variable": f"WEBHOOK_{name.upper()}"}
