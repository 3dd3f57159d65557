"""The kinds a project can send to, found by the scheme of a destination's URL:
the built-in ones, and those ``FEDERATION_DELIVERY["CHANNELS"]`` adds by
dotted path."""

from __future__ import annotations

import functools
import inspect
import re
from collections.abc import Iterable, Sequence

from django.core.exceptions import ImproperlyConfigured
from django.utils.module_loading import import_string
from django.utils.translation import gettext as _

from django_federation_delivery.addresses import (
    credentials,
    is_destination_name,
    quoted,
    replace_secrets,
)
from django_federation_delivery.channels.base import (
    Channel,
    Destination,
    UnusableURL,
    is_word,
    word_shown,
)
from django_federation_delivery.channels.discord import Discord
from django_federation_delivery.channels.markdown import Markdown
from django_federation_delivery.channels.matrix import Matrix
from django_federation_delivery.channels.ntfy import Ntfy
from django_federation_delivery.channels.slack import Slack
from django_federation_delivery.channels.standard import StandardWebhooks
from django_federation_delivery.channels.telegram import Telegram

__all__ = ["BUILT_IN", "Registry", "is_name", "parse_destination", "registry"]

BUILT_IN: tuple[type[Channel], ...] = (
    Slack,
    Discord,
    Markdown,
    Telegram,
    Ntfy,
    Matrix,
    StandardWebhooks,
)

_KIND_NAME = re.compile(r"[a-z][a-z0-9_-]{0,31}")
#: A scheme a kind may take: RFC 3986's, lowercase, as a URL's is looked up.
_URL_SCHEME = re.compile(r"[a-z][a-z0-9+.-]*")


class Registry:
    """One instance of each kind, by scheme and by name."""

    def __init__(self, kinds: Iterable[type[Channel]]) -> None:
        self.by_scheme: dict[str, Channel] = {}
        self.by_name: dict[str, Channel] = {}
        for kind in kinds:
            for attribute in ("name", "label", "schemes"):
                if not getattr(kind, attribute, None):
                    raise ImproperlyConfigured(
                        _("The channel %(kind)s does not set %(attribute)s.")
                        % {"kind": _dotted(kind), "attribute": attribute}
                    )
            if not (isinstance(kind.name, str) and _KIND_NAME.fullmatch(kind.name)):
                raise ImproperlyConfigured(
                    _("The channel %(kind)s's name %(name)s is not a short lowercase word.")
                    % {"kind": _dotted(kind), "name": quoted(kind.name)}
                )
            _check_schemes(kind)
            channel = _made(kind)
            if kind.name in self.by_name:
                raise ImproperlyConfigured(
                    _("The channels %(one)s and %(other)s are both named %(name)r.")
                    % {
                        "one": _dotted(type(self.by_name[kind.name])),
                        "other": _dotted(kind),
                        "name": kind.name,
                    }
                )
            self.by_name[kind.name] = channel
            for scheme in kind.schemes:
                if scheme in self.by_scheme:
                    raise ImproperlyConfigured(
                        _("The channels %(one)s and %(other)s both take the scheme %(scheme)r.")
                        % {
                            "one": _dotted(type(self.by_scheme[scheme])),
                            "other": _dotted(kind),
                            "scheme": scheme,
                        }
                    )
                self.by_scheme[scheme] = channel

    @property
    def schemes(self) -> list[str]:
        return sorted(self.by_scheme)

    def parse(self, name: str, url: object, events: Sequence[object] = ()) -> Destination:
        """The destination ``url`` names, subscribed to ``events`` and to those
        its ``?events=`` parameter lists (every event if neither says).
        ``ImproperlyConfigured`` naming ``name`` (never the URL) if no kind can
        use it, or its kind fails to parse it: a kind's error other than
        :class:`UnusableURL` is named by its type alone. A ``name`` that is no
        name is shown as :func:`quoted` shows a value: a URL written there
        (its path the credential) by its host only."""
        if not is_name(name):
            raise ImproperlyConfigured(
                _(
                    "A webhook destination's name must be 1 to 64 lowercase letters, digits, "
                    "'_' or '-', not %(name)s."
                )
                % {"name": quoted(name)}
            )
        try:
            written, listed = _subscriptions(url)
            subscribed = _patterns([*events, *listed])
            channel, url, scheme = self._channel_for(written)
            return _destination(name, channel, url, scheme, subscribed)
        except UnusableURL as exc:
            raise ImproperlyConfigured(
                _("Webhook destination %(name)r: %(problem)s.") % {"name": name, "problem": exc}
            ) from None

    def _channel_for(self, url: object) -> tuple[Channel, str, str]:
        if not isinstance(url, str):
            raise UnusableURL(
                _("its URL must be a string, not %(type)s") % {"type": type(url).__name__}
            )
        url = url.strip()
        if not url:
            raise UnusableURL(_("its URL is empty"))
        if re.search(r"[\x00-\x20\x7f]", url):
            raise UnusableURL(_("its URL has spaces or control characters in it"))
        try:
            url.encode()
        except UnicodeEncodeError:
            # A byte that is not UTF-8 in the environment, as os.environ gives it.
            raise UnusableURL(_("its URL holds text that is not UTF-8")) from None
        scheme, colon, _rest = url.partition("://")
        scheme = scheme.lower()
        if not colon:
            raise UnusableURL(_("its URL has no scheme such as slack:// or https://"))
        if "#" in url:
            raise UnusableURL(_("its URL has a fragment (#…), which is never sent"))
        channel = self.by_scheme.get(scheme)
        if channel is None:
            raise UnusableURL(
                _("its scheme %(scheme)s is not one of those known: %(known)s")
                % {
                    "scheme": word_shown(scheme),
                    "known": ", ".join(self.schemes),
                }
            )
        return channel, url, scheme


def _destination(
    name: str, channel: Channel, url: str, scheme: str, events: tuple[str, ...]
) -> Destination:
    """The destination ``channel`` makes of ``url``: :class:`UnusableURL`
    whatever its ``parse`` raises (or what it returns makes fail), so that
    one destination a kind fails on (a host project's kind may raise
    anything) is that destination's problem alone, never every send's, the
    checks' and the loop's. An error other than UnusableURL is named by its
    type: its message may quote the URL, the credential."""
    try:
        return Destination.of(name, channel, channel.parse(url, scheme), events)
    except UnusableURL as exc:
        # A host project's kind may name what it does not take: never what
        # of its userinfo or query may be a token pasted in the wrong place.
        tokens = [part for part in credentials(url) if not is_word(part)]
        raise UnusableURL(replace_secrets(str(exc), tokens, _("(not shown)"))) from None
    except Exception as exc:
        raise UnusableURL(
            _("its kind %(kind)s could not parse its URL: %(error)s")
            % {"kind": channel.name, "error": type(exc).__name__}
        ) from None


def is_name(name: object) -> bool:
    """Whether ``name`` can name a webhook destination: 1 to 64 lowercase
    letters, digits, "_" or "-", the first a letter or a digit."""
    return is_destination_name(name)


#: An event type, or a pattern of them with "*": "alert.*", "deploy.finished".
_PATTERN = re.compile(r"[A-Za-z0-9_*]+(?:[.-][A-Za-z0-9_*]+)*")


def _subscriptions(url: object) -> tuple[object, list[str]]:
    """``url`` without its ``events=`` parameters (no kind sees them), and
    the event types they list, comma-separated."""
    if not isinstance(url, str) or "?" not in url:
        return url, []
    base, _mark, query = url.partition("?")
    kept, listed = [], []
    for pair in query.split("&"):
        key, _sign, value = pair.partition("=")
        if key == "events":
            listed += [part.strip() for part in value.split(",")]
        else:
            kept.append(pair)
    return base + ("?" + "&".join(kept) if kept else ""), listed


def _patterns(events: Sequence[object]) -> tuple[str, ...]:
    for pattern in events:
        if not isinstance(pattern, str) or not _PATTERN.fullmatch(pattern):
            # Not quoted: whatever it is, it was written in the URL.
            raise UnusableURL(
                _(
                    "its events list something that is not an event type or a pattern "
                    "of them, such as alert.* or deploy.finished"
                )
            )
    return tuple(dict.fromkeys(str(pattern) for pattern in events))


def registry() -> Registry:
    """The kinds known under the current settings."""
    from django_federation_delivery.conf import app_settings

    return _registry(tuple(app_settings.channels))


def parse_destination(name: str, url: str) -> Destination:
    """The destination ``url`` names, by the kind its scheme picks."""
    return registry().parse(name, url)


@functools.lru_cache(maxsize=8)
def _registry(paths: tuple[str, ...]) -> Registry:
    return Registry([*BUILT_IN, *(_imported(path) for path in paths)])


def _imported(path: str) -> type[Channel]:
    from django_federation_delivery.conf import SETTING, import_error, shown_path

    try:
        found = import_string(path)
    except Exception as exc:  # SyntaxError, and what a module raises as it runs, included
        # What is no dotted path is shown by its type alone (shown_path).
        raise ImproperlyConfigured(
            _("%(setting)s['CHANNELS'] has %(path)s, which cannot be imported: %(error)s")
            % {"setting": SETTING, "path": shown_path(path), "error": import_error(path, exc)}
        ) from None
    if not (isinstance(found, type) and issubclass(found, Channel)):
        raise ImproperlyConfigured(
            _("%(setting)s['CHANNELS'] has %(path)s, which is not a Channel subclass.")
            % {"setting": SETTING, "path": shown_path(path)}
        )
    return found


def _check_schemes(kind: type[Channel]) -> None:
    """``ImproperlyConfigured`` unless ``kind``'s schemes are a tuple (or a
    list) of lowercase URL schemes: a string written there would be taken
    letter by letter, each a scheme of its own."""
    schemes: object = kind.schemes
    if not (
        isinstance(schemes, tuple | list)
        and all(isinstance(scheme, str) and _URL_SCHEME.fullmatch(scheme) for scheme in schemes)
    ):
        raise ImproperlyConfigured(
            _(
                "The channel %(kind)s's schemes must be a tuple of lowercase URL schemes, "
                "such as ('pager', 'pager+http'), not %(schemes)s."
            )
            % {"kind": _dotted(kind), "schemes": quoted(schemes)}
        )


def _made(kind: type[Channel]) -> Channel:
    """The one instance of ``kind``, made with no arguments as every kind is:
    ``ImproperlyConfigured`` naming it when it cannot be, so that a kind of a
    host project's is ``manage.py check``'s error (E035), never a traceback
    from every send and the loop. An error its ``__init__`` raises is named
    by its type alone: its message may quote a setting it read, a secret."""
    try:
        signature = inspect.signature(kind)
    except (TypeError, ValueError):  # none to be had: made, and judged by what it raises
        signature = None
    if signature is not None:
        try:
            signature.bind()
        except TypeError as exc:
            raise ImproperlyConfigured(
                _(
                    "The channel %(kind)s cannot be made with no arguments, as CHANNELS "
                    "makes it: %(problem)s."
                )
                % {"kind": _dotted(kind), "problem": exc}
            ) from None
    try:
        return kind()
    except Exception as exc:
        raise ImproperlyConfigured(
            _("The channel %(kind)s could not be made: %(error)s.")
            % {"kind": _dotted(kind), "error": type(exc).__name__}
        ) from None


def _dotted(kind: type[Channel]) -> str:
    return f"{kind.__module__}.{kind.__qualname__}"
