"""Webhook destinations as the settings hold them: a name and a URL each,
read from the environment by :func:`webhooks_from_env`, and parsed by the
kind their URL's scheme picks (``channels/``). The URL is the credential, so a
:class:`~django_federation_delivery.channels.Destination` shows only its name
and kind.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any, NamedTuple, Protocol

from django.core.exceptions import ImproperlyConfigured
from django.utils.translation import gettext as _

# Defined beside the inboxes' hosts, where the loop, which may not import
# the webhooks' modules, finds it too.
from django_federation_delivery.addresses import delivery_key, quoted, scheme_and_host
from django_federation_delivery.channels import Destination, parse_destination
from django_federation_delivery.channels.registry import Registry, is_name, registry

__all__ = [
    "Configured",
    "Destination",
    "configured",
    "configured_destinations",
    "delivery_key",
    "parse_destination",
    "webhooks_from_env",
]


class _HasEnviron(Protocol):
    ENVIRON: Mapping[str, str]


class WebhookURL(str):
    """A webhook destination's URL: itself wherever it is used, but for its
    ``repr``, its scheme and host alone (``'slack://hooks.slack.com/…'``),
    or its scheme alone when what comes where the host goes is no host (a
    bot's token, ``telegram://123:TOKEN``). Django's error reports (the
    DEBUG page, and the mail a 500 sends to ``ADMINS``) and ``diffsettings``
    show the settings by their ``repr``, and hide no setting named
    ``WEBHOOKS``: the URL is the credential."""

    __slots__ = ()

    def __repr__(self) -> str:
        return repr(scheme_and_host(str(self)))


def webhooks_from_env(
    env: _HasEnviron | Mapping[str, str], prefix: str = "WEBHOOK_"
) -> dict[str, str]:
    """Every ``<prefix><NAME>`` variable of ``env`` (a django-environ ``Env``, or a
    mapping such as ``os.environ``) as ``{"name": url}``, the name lowercased.

    An empty variable is left out, as unset. The URLs are checked by the system
    checks (``manage.py check``), so a bad one is reported by its name, not here.
    Each URL is a :class:`WebhookURL`, which an error report shows as its
    scheme and host. Two variables that give one name (``WEBHOOK_OPS`` and
    ``WEBHOOK_ops``) are ``ImproperlyConfigured``, naming both: neither is
    the one meant.

    It reads no setting, and importing it reads none: a settings file calls
    it while Django reads that very file, and a setting read then would load
    the half-read file again and keep it as the settings, so that an error
    the file raised next would be swallowed by ``manage.py`` (which finds "no
    issues" in the half it kept) instead of stopping it.
    """
    environ: Mapping[str, str] = env if isinstance(env, Mapping) else env.ENVIRON
    found: dict[str, str] = {}
    read_from: dict[str, str] = {}
    for variable in sorted(environ):
        if not variable.startswith(prefix) or variable == prefix:
            continue
        value = environ[variable]
        if not value.strip():
            continue
        name = variable[len(prefix) :].lower()
        if name in read_from:
            # The variables are named, their values never: each is a secret URL.
            # English, as Django's own settings errors are: this runs in the
            # settings file, where translating would read the settings (the
            # file half read) and fail, the apps not loaded.
            raise ImproperlyConfigured(
                f"The variables {read_from[name]} and {variable} both set the webhook "
                f"destination {name!r}: keep one of them."
            )
        read_from[name] = variable
        found[name] = WebhookURL(value.strip())
    return found


@dataclasses.dataclass(frozen=True)
class Configured:
    """``FEDERATION_DELIVERY["WEBHOOKS"]``, parsed once for as long as it and
    ``CHANNELS`` stay as they are."""

    #: The destinations whose URL parses, by name.
    destinations: Mapping[str, Destination]
    #: What is wrong with each of the others, by name: a message that names
    #: the destination, never its URL. One whose name is no name (a URL
    #: written there, whose path is the credential) is kept under a
    #: placeholder, "<a name that is not valid #1>", which holds nothing of it.
    problems: Mapping[str, str]

    @property
    def names(self) -> list[str]:
        """Every configured name, good or not, sorted."""
        return sorted([*self.destinations, *self.problems])

    def lookup(self, name: str) -> Destination | str | None:
        """The destination ``name``; what is wrong with it when it does not
        parse; None when it is not configured."""
        return self.destinations.get(name) or self.problems.get(name)


def configured() -> Configured:
    """The configured destinations. ``ImproperlyConfigured`` when ``WEBHOOKS``
    is not a dict of names to URLs, or ``CHANNELS`` cannot be loaded."""
    from django_federation_delivery.conf import SETTING, app_settings

    webhooks = app_settings.get("WEBHOOKS")
    if not isinstance(webhooks, Mapping):
        raise ImproperlyConfigured(
            _("%(setting)s['WEBHOOKS'] must be a dict of names to URLs, not %(type)s.")
            % {"setting": SETTING, "type": type(webhooks).__name__}
        )
    kinds = registry()
    written = tuple((name, _Form.of(value)) for name, value in webhooks.items())
    try:
        return _parsed(written, kinds)
    except TypeError:  # a value that cannot be hashed: not a URL, said by its problem
        return _parsed.__wrapped__(written, kinds)


class _Form(NamedTuple):
    """A destination written as ``{"url": …, "events": [...]}``, hashable."""

    url: Any
    events: tuple[Any, ...]
    #: What else the dict has: an error.
    unknown: tuple[str, ...] = ()

    @classmethod
    def of(cls, value: Any) -> Any:
        if not isinstance(value, Mapping):
            return value
        events = value.get("events", ())
        return cls(
            value.get("url"),
            tuple(events) if isinstance(events, list | tuple) else (events,),
            tuple(sorted(str(key) for key in value if key not in ("url", "events"))),
        )


@functools.lru_cache(maxsize=8)
def _parsed(webhooks: tuple[tuple[Any, Any], ...], kinds: Registry) -> Configured:
    destinations: dict[str, Destination] = {}
    problems: dict[str, str] = {}
    for name, value in webhooks:
        try:
            if isinstance(value, _Form) and value.unknown and is_name(name):
                raise ImproperlyConfigured(
                    _(
                        "Webhook destination %(name)r: a destination written as a dict "
                        "has 'url' and 'events', not %(keys)s."
                    )
                    # Each as an error names a value: a URL written as a key
                    # (the credential) as its scheme and host.
                    % {"name": name, "keys": ", ".join(map(quoted, value.unknown))}
                )
            if isinstance(value, _Form):
                destinations[name] = kinds.parse(name, value.url, value.events)
            else:
                destinations[name] = kinds.parse(name, value)
        except ImproperlyConfigured as exc:  # names the destination, never its URL
            problems[_problem_key(name, problems)] = str(exc)
    return Configured(destinations, problems)


def _problem_key(name: object, problems: Mapping[str, str]) -> str:
    """What a destination that does not parse is listed by: its name, or, when
    that is no name, a placeholder that holds nothing of it. What is written
    there may be a URL (its path the credential), and the names are shown
    wherever a destination is: the checks, ``delivery_status``, the admin."""
    if is_name(name):
        return str(name)
    return f"<a name that is not valid #{sum(key.startswith('<') for key in problems) + 1}>"


def configured_destinations() -> dict[str, Destination]:
    """The configured destinations by name: ``ImproperlyConfigured`` (naming
    the destination) for the first that does not parse."""
    found = configured()
    for problem in found.problems.values():
        raise ImproperlyConfigured(problem)
    return dict(found.destinations)
