"""Webhook destinations as the settings hold them: a name and a URL each,
read from the environment by :func:`webhooks_from_env`, and parsed by the
kind their URL's scheme picks (``channels/``). The URL is the credential, so a
:class:`~django_federation_delivery.channels.Destination` shows only its name
and kind.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from django.core.exceptions import ImproperlyConfigured
from django.utils.translation import gettext as _

from django_federation_delivery.channels import Destination, parse_destination

__all__ = [
    "KEY_PREFIX",
    "Destination",
    "configured_destinations",
    "delivery_key",
    "destination_name",
    "parse_destination",
    "webhooks_from_env",
]

#: What a webhook delivery's ``inbox`` and ``host`` hold: the destination's
#: name, never its URL, which is looked up in the settings when it is sent.
KEY_PREFIX = "webhook:"


def delivery_key(name: str) -> str:
    """The ``inbox`` and ``host`` of a delivery to destination ``name``."""
    return KEY_PREFIX + name


def destination_name(key: str) -> str:
    """The destination a delivery's ``inbox`` or ``host`` names; "" for an inbox URL."""
    return key[len(KEY_PREFIX) :] if key.startswith(KEY_PREFIX) else ""


class _HasEnviron(Protocol):
    ENVIRON: Mapping[str, str]


def webhooks_from_env(
    env: _HasEnviron | Mapping[str, str], prefix: str = "WEBHOOK_"
) -> dict[str, str]:
    """Every ``<prefix><NAME>`` variable of ``env`` (a django-environ ``Env``, or a
    mapping such as ``os.environ``) as ``{"name": url}``, the name lowercased.

    An empty variable is left out, as unset. The URLs are checked by the system
    checks (``manage.py check``), so a bad one is reported by its name, not here.
    """
    environ: Mapping[str, str] = env if isinstance(env, Mapping) else env.ENVIRON
    found = {}
    for variable in sorted(environ):
        if not variable.startswith(prefix) or variable == prefix:
            continue
        value = environ[variable]
        if value.strip():
            found[variable[len(prefix) :].lower()] = value.strip()
    return found


def configured_destinations() -> dict[str, Destination]:
    """``FEDERATION_DELIVERY["WEBHOOKS"]``, parsed: ``ImproperlyConfigured`` (naming
    the destination) for the first bad one."""
    from django_federation_delivery.conf import SETTING, app_settings

    webhooks = app_settings.get("WEBHOOKS")
    if not isinstance(webhooks, Mapping):
        raise ImproperlyConfigured(
            _("%(setting)s['WEBHOOKS'] must be a dict of names to URLs, not %(type)s.")
            % {"setting": SETTING, "type": type(webhooks).__name__}
        )
    return {name: parse_destination(name, url) for name, url in webhooks.items()}
