"""Webhook destinations: a name and a URL, parsed once into what a request needs.

The URL is the credential (a Slack hook's path, a bot token, a signing
secret), so a :class:`Destination` shows only its name and kind: in its repr,
its str, and every error raised here. :meth:`Destination.redact` takes its
secret parts out of any text, such as an error that echoes the URL.
"""

from __future__ import annotations

import base64
import binascii
import enum
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol
from urllib.parse import quote, unquote, urlsplit

from django.core.exceptions import ImproperlyConfigured
from django.utils.translation import gettext as _
from django.utils.translation import gettext_noop

__all__ = [
    "KEY_PREFIX",
    "Destination",
    "Kind",
    "configured_destinations",
    "delivery_key",
    "destination_name",
    "parse_destination",
    "webhooks_from_env",
]


class Kind(enum.StrEnum):
    """What a destination receives, and so how an event is written for it."""

    SLACK = "slack", "Slack"
    DISCORD = "discord", "Discord"
    # Mattermost, Rocket.Chat and other hooks that take {"text": markdown}.
    MARKDOWN = "markdown", gettext_noop("Markdown hook")
    TELEGRAM = "telegram", "Telegram"
    # The event as JSON, signed as the Standard Webhooks specification says.
    SIGNED_JSON = "json", gettext_noop("Signed JSON")

    label: str

    def __new__(cls, value: str, label: str) -> Kind:
        member = str.__new__(cls, value)
        member._value_ = value
        member.label = label
        return member


# Hook kinds: "<kind>://" sends over https, "<kind>+http://" over plain http.
_HOOK_KINDS = {kind.value: kind for kind in (Kind.SLACK, Kind.DISCORD, Kind.MARKDOWN)}

TELEGRAM_API = "https://api.telegram.org"

_NAME = re.compile(r"[a-z0-9][a-z0-9_-]{0,63}")
_BOT_TOKEN = re.compile(r"[0-9]+:[A-Za-z0-9_-]+")
# A numeric chat id (negative for groups and channels) or a public @username.
_CHAT = re.compile(r"-?[0-9]+|@[A-Za-z][A-Za-z0-9_]{3,}")
_SECRET_PREFIX = "whsec_"
# The Standard Webhooks specification asks for keys of 24 to 64 bytes.
_MIN_SECRET_BYTES = 24
# Parts of a URL shorter than this are too common to take out of text.
_MIN_REDACTED = 6
REDACTED = "[redacted]"
#: What a webhook delivery's ``inbox`` and ``host`` hold: the destination's
#: name, never its URL, which is looked up in the settings when it is sent.
KEY_PREFIX = "webhook:"


def delivery_key(name: str) -> str:
    """The ``inbox`` and ``host`` of a delivery to destination ``name``."""
    return KEY_PREFIX + name


def destination_name(key: str) -> str:
    """The destination a delivery's ``inbox`` or ``host`` names; "" for an inbox URL."""
    return key[len(KEY_PREFIX) :] if key.startswith(KEY_PREFIX) else ""


@dataclass(frozen=True, eq=False)
class Destination:
    """A configured webhook destination; only ``name`` and ``kind`` are for display."""

    name: str
    kind: Kind
    #: Where the request goes. Secret: never show or log it.
    url: str = field(repr=False)
    #: Signed JSON: the signing keys, each giving one signature (rotation).
    secrets: tuple[bytes, ...] = field(default=(), repr=False)
    #: Telegram: the chat the bot posts to.
    chat_id: int | str | None = field(default=None, repr=False)
    _secret_parts: tuple[str, ...] = field(default=(), repr=False)

    def __repr__(self) -> str:
        return f"<Destination {self.name!r} ({self.kind.label})>"

    def __str__(self) -> str:
        return self.display

    @property
    def display(self) -> str:
        """The name and the kind: what a message, the admin or a log may show."""
        return f"{self.name} ({self.kind.label})"

    def redact(self, text: str) -> str:
        """``text`` with every secret part of this destination replaced by [redacted]:
        its URLs, path, path segments, query, bot token and signing secrets."""
        for part in self._secret_parts:
            text = text.replace(part, REDACTED)
        return text


def parse_destination(name: str, url: str) -> Destination:
    """The destination ``url`` names. ``ImproperlyConfigured`` naming ``name`` (never
    the URL) if it is not one of the forms in this package's docstring."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ImproperlyConfigured(
            _(
                "A webhook destination's name must be 1 to 64 lowercase letters, digits, '_' "
                "or '-', not %(name)r."
            )
            % {"name": name}
        )

    def bad(problem: str) -> ImproperlyConfigured:
        return ImproperlyConfigured(
            _("Webhook destination %(name)r: %(problem)s.") % {"name": name, "problem": problem}
        )

    if not isinstance(url, str):
        raise bad(_("its URL must be a string, not %(type)s") % {"type": type(url).__name__})
    if not url.strip():
        raise bad(_("its URL is empty"))
    url = url.strip()
    if re.search(r"[\x00-\x20\x7f]", url):
        raise bad(_("its URL has spaces or control characters in it"))
    scheme, colon, _rest = url.partition("://")
    scheme = scheme.lower()
    if not colon:
        raise bad(_("its URL has no scheme such as slack:// or https://"))
    if "#" in url:
        raise bad(_("its URL has a fragment (#…), which is never sent"))
    if scheme == "telegram":
        return _telegram(name, url, bad)
    if scheme in ("http", "https"):
        return _signed_json(name, url, bad)
    kind_name, plus, transport = scheme.partition("+")
    kind = _HOOK_KINDS.get(kind_name)
    if kind is None or (plus and transport != "http"):
        raise bad(
            _(
                "its scheme %(scheme)r is not one of slack, discord, markdown, telegram, "
                "https or http (slack+http, discord+http, markdown+http for plain HTTP)"
            )
            % {"scheme": scheme}
        )
    target = ("http" if plus else "https") + url[len(scheme) :]
    path = _checked_path(target, bad)
    if path.strip("/") == "":
        raise bad(
            _("a %(kind)s URL needs the hook's path, as the service gave it")
            % {"kind": _(kind.label)}
        )
    return Destination(
        name=name,
        kind=kind,
        url=target,
        _secret_parts=_parts(url, target, path, urlsplit(target).query),
    )


def _checked_path(url: str, bad: Any) -> str:
    """The path of ``url``, once it is known to have a host and a valid port."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError for a bad port
    except ValueError:
        raise bad(_("its URL is not a valid URL")) from None
    if not parts.hostname:
        raise bad(_("its URL has no host"))
    return parts.path


def _telegram(name: str, url: str, bad: Any) -> Destination:
    # telegram://<bot token>@<chat id>[?api=<base URL>]. Split by hand: the
    # token has a ":" that urlsplit would read as a password, and a chat may
    # be an @username.
    rest = url[len("telegram://") :]
    authority, _mark, query = rest.partition("?")
    token, at, chat = authority.partition("@")
    if not at or not _BOT_TOKEN.fullmatch(token):
        raise bad(
            _("a Telegram URL is telegram://<bot token>@<chat id>, with a token like 123:ABC")
        )
    chat = chat.rstrip("/")
    if not _CHAT.fullmatch(chat):
        raise bad(_("a Telegram chat is a number such as -1001234567890 or an @username"))
    api = TELEGRAM_API
    for key, value in _query_pairs(query):
        if key != "api":
            raise bad(
                _("a Telegram URL takes only the parameter 'api', not %(key)r") % {"key": key}
            )
        api = value.rstrip("/")
        try:
            parts = urlsplit(api)
        except ValueError:
            raise bad(_("its api parameter is not a valid URL")) from None
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.query:
            raise bad(
                _("its api parameter must be an http(s) base URL such as http://127.0.0.1:8081")
            )
    target = f"{api}/bot{token}/sendMessage"
    secret = token.split(":", 1)[1]
    return Destination(
        name=name,
        kind=Kind.TELEGRAM,
        url=target,
        chat_id=int(chat) if chat.lstrip("-").isdigit() else chat,
        _secret_parts=_parts(url, target, f"bot{token}", token, secret),
    )


def _signed_json(name: str, url: str, bad: Any) -> Destination:
    base, _mark, query = url.partition("?")
    kept, secrets, raw = [], [], []
    for pair in query.split("&") if query else []:
        key, _sign, value = pair.partition("=")
        if unquote(key) != "secret":
            kept.append(pair)
            continue
        secret = unquote(value)  # not unquote_plus: "+" is a base64 character
        raw += [value, secret, secret.removeprefix(_SECRET_PREFIX)]
        secrets.append(_secret_key(secret, bad))
    if not secrets:
        raise bad(
            _(
                "a signed JSON URL needs a secret: add ?secret=whsec_… (the key, base64, "
                "as the Standard Webhooks specification writes it)"
            )
        )
    target = base + ("?" + "&".join(kept) if kept else "")
    _checked_path(target, bad)
    return Destination(
        name=name,
        kind=Kind.SIGNED_JSON,
        url=target,
        secrets=tuple(secrets),
        _secret_parts=_parts(url, target, query, *raw),
    )


def _secret_key(secret: str, bad: Any) -> bytes:
    if not secret.startswith(_SECRET_PREFIX):
        raise bad(_("a secret must start with 'whsec_', followed by the key in base64"))
    encoded = secret[len(_SECRET_PREFIX) :]
    try:
        key = base64.b64decode(encoded + "=" * (-len(encoded) % 4), validate=True)
    except (binascii.Error, ValueError):
        raise bad(_("a secret after 'whsec_' is not valid base64")) from None
    if len(key) < _MIN_SECRET_BYTES:
        raise bad(
            _(
                "a secret's key is %(length)d bytes; use %(least)d to 64 random bytes, "
                "e.g. 'whsec_' + base64 of secrets.token_bytes(32)"
            )
            % {"length": len(key), "least": _MIN_SECRET_BYTES}
        )
    return key


def _query_pairs(query: str) -> list[tuple[str, str]]:
    pairs = []
    for pair in query.split("&") if query else []:
        key, _sign, value = pair.partition("=")
        pairs.append((unquote(key), unquote(value)))
    return pairs


def _parts(*texts: str) -> tuple[str, ...]:
    """What :meth:`Destination.redact` takes out, longest first (a whole URL before
    the path inside it): each text, and of a URL its forms without scheme or query,
    its path, query and the path segments that look like tokens; each also as a
    percent- or JSON-escaped text would quote it."""
    pieces: set[str] = set()
    for text in texts:
        pieces.add(text)
        if "://" not in text:
            continue
        parts = urlsplit(text)
        without_scheme = text.split("://", 1)[1]
        pieces |= {without_scheme, without_scheme.split("?", 1)[0], text.split("?", 1)[0]}
        # A token rather than a word such as "services" or "webhooks".
        segments = parts.path.split("/")
        pieces |= {parts.path, parts.query}
        pieces |= {s for s in segments if len(s) >= 16 or any(c.isdigit() for c in s)}
    found = {
        form
        for piece in pieces
        for form in (piece, quote(piece, safe=""), piece.replace("/", "\\/"))
        if len(form) >= _MIN_REDACTED
    }
    return tuple(sorted(found, key=len, reverse=True))


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
