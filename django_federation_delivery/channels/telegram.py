"""Telegram bots: ``telegram://<bot token>@<chat id>[?api=<Bot API server>]``."""

from __future__ import annotations

import json
import re
from urllib.parse import urlsplit

from django.utils.translation import gettext as _

from django_federation_delivery.attempt import Verdict, is_refusal
from django_federation_delivery.channels.base import (
    Channel,
    Destination,
    Parsed,
    Request,
    UnusableURL,
    waited_in_body,
    word_shown,
)
from django_federation_delivery.channels.events import Event
from django_federation_delivery.channels.text import (
    WORD_JOINER,
    cut,
    escape_entities,
    no_mentions_or_links,
    render_text,
)
from django_federation_delivery.transport import Answer

__all__ = ["TELEGRAM_API", "TELEGRAM_LIMIT", "Telegram"]

TELEGRAM_API = "https://api.telegram.org"
#: A dot between two characters of a word: a domain's, which Telegram links.
DOMAIN_DOT = re.compile(r"(?<=\w)\.(?=\w)")
#: The longest ``text`` Telegram takes once its entities are parsed.
TELEGRAM_LIMIT = 4096

_BOT_TOKEN = re.compile(r"[0-9]+:[A-Za-z0-9_-]+")
#: The start of a Bot API answer that says it sent the message.
_OK_FIRST = re.compile(rb'\s*\{\s*"ok"\s*:\s*true\b')
# A numeric chat id (negative for groups and channels) or a public @username.
_CHAT = re.compile(r"-?[0-9]+|@[A-Za-z][A-Za-z0-9_]{3,}")


class Telegram(Channel):
    """POST ``<api>/bot<token>/sendMessage`` with the chat, the text in
    Telegram's HTML (``& < >`` escaped, cut to 4,096 characters) and
    ``parse_mode: "HTML"``. The bot token is secret; the chat is not.

    Telegram makes a mention of an ``@username`` in any text, which notifies
    that member of a group, and a link (with its preview, fetched by
    Telegram) of a URL: a word joiner after each ``@`` before a name and
    inside each ``://`` and ``www.`` keeps an event's data from either, as
    for a Markdown hook.

    The Bot API says in its body whether it sent the message (``"ok":
    true``): a 2xx that does not (a Bot API server or a proxy that answers
    ``{"ok": false, "error_code": 400, ...}`` with a 200, or a page that is
    no Bot API answer) is not delivered: refused for good for the 4xx its
    ``error_code`` gives, tried again otherwise."""

    name = "telegram"
    label = "Telegram"
    schemes = ("telegram",)
    # The Bot API's 429 says how long to wait in its body, in seconds, and
    # sends no Retry-After (https://core.telegram.org/bots/api#responseparameters).
    wait_in_body = (("parameters", "retry_after"), 1.0)

    def parse(self, url: str, scheme: str) -> Parsed:
        # Split by hand: the token has a ":" that urlsplit would read as a
        # password, and a chat may be an @username.
        rest = url[len("telegram://") :]
        authority, _mark, query = rest.partition("?")
        token, at, chat = authority.partition("@")
        if not at or not _BOT_TOKEN.fullmatch(token):
            raise UnusableURL(
                _("a Telegram URL is telegram://<bot token>@<chat id>, with a token like 123:ABC")
            )
        chat = chat.rstrip("/")
        if not _CHAT.fullmatch(chat):
            raise UnusableURL(
                _("a Telegram chat is a number such as -1001234567890 or an @username")
            )
        api = TELEGRAM_API
        for key, value in self.query_pairs(query):
            if key != "api":
                raise UnusableURL(
                    _("a Telegram URL takes only the parameter 'api', not %(key)s")
                    % {"key": word_shown(key)}
                )
            api = value.rstrip("/")
            try:
                parts = urlsplit(api)
                if parts.port == 0:  # ValueError too for one no number, or above 65535
                    raise ValueError("port 0")
            except ValueError:
                raise UnusableURL(_("its api parameter is not a valid URL")) from None
            if parts.scheme not in ("http", "https") or not parts.hostname or parts.query:
                raise UnusableURL(
                    _("its api parameter must be an http(s) base URL such as http://127.0.0.1:8081")
                )
        return Parsed(
            url=f"{api}/bot{token}/sendMessage",
            secrets=(f"bot{token}", token, token.split(":", 1)[1]),
            options={"chat_id": int(chat) if chat.lstrip("-").isdigit() else chat},
        )

    def request(self, destination: Destination, event: Event, *, now: float) -> Request:
        # Telegram links a bare domain too ("evil.com/login"): a word joiner
        # after each dot inside a word, as inside "://" and "www.".
        text = no_mentions_or_links(render_text(destination, event))
        text = DOMAIN_DOT.sub("." + WORD_JOINER, text)
        document = {
            "chat_id": destination.options["chat_id"],
            # Cut before escaping: Telegram counts the text its entities stand for.
            "text": escape_entities(cut(text, TELEGRAM_LIMIT)),
            "parse_mode": "HTML",
            # Nor is a page fetched to preview what a link it makes anyway shows.
            "link_preview_options": {"is_disabled": True},
        }
        return self.json_request(destination, document)

    def judge(self, answer: Answer) -> Verdict:
        verdict = super().judge(answer)
        if not verdict.delivered:
            return verdict
        try:
            said = json.loads(answer.body)
        except (ValueError, RecursionError):
            # Cut to MAX_ANSWER_BYTES (its answer repeats the whole message):
            # the Bot API writes "ok" first.
            said = {"ok": True} if _OK_FIRST.match(answer.body) else None
        if isinstance(said, dict) and said.get("ok") is True:
            return verdict
        code = said.get("error_code") if isinstance(said, dict) else None
        if not isinstance(code, int) or isinstance(code, bool):
            code = None
        return Verdict(
            delivered=False,
            refused=code is not None and is_refusal(code),
            retry_after=waited_in_body(answer.body, *self.wait_in_body) if code == 429 else None,
            detail=answer.body.decode("utf-8", "replace"),
        )
