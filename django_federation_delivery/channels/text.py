"""What the chat kinds share: an event written as plain text by a template,
escaped for a service's markup, and cut to what the service takes.

The text comes from the template ``django_federation_delivery/webhooks/<event
type>.txt``, falling back to ``django_federation_delivery/webhooks/default.txt``;
a project overrides either in its own templates. A template writes plain text:
each kind then escapes what its markup would read as markup, so an event's
data can neither break the message nor mention anyone.
"""

from __future__ import annotations

import re
import threading
from typing import TYPE_CHECKING, Any

from django.template import Context
from django.template.backends.django import Template as DjangoTemplate
from django.template.loader import select_template

from django_federation_delivery.channels.events import Event, compact_json

if TYPE_CHECKING:
    from django_federation_delivery.channels.base import Destination

__all__ = [
    "ELLIPSIS",
    "WORD_JOINER",
    "break_links",
    "cut",
    "cut_bytes",
    "cut_json",
    "cut_markdown",
    "escape_entities",
    "escape_markdown",
    "no_mentions_or_links",
    "render_text",
]

TEMPLATES = "django_federation_delivery/webhooks"
ELLIPSIS = "…"


def render_text(destination: Destination, event: Event) -> str:
    """The event's template rendered as plain text (no HTML escaping), stripped."""
    template = select_template(
        [f"{TEMPLATES}/{event.type}.txt", f"{TEMPLATES}/default.txt"],
    )
    context = {
        "event_type": event.type,
        "event_id": event.id,
        "timestamp": event.timestamp,
        "data": event.data,
        "fields": _fields(event.data),
        "data_json": "" if isinstance(event.data, dict) else compact_json(event.data).decode(),
        "destination": {"name": destination.name, "kind": destination.kind},
    }
    if isinstance(template, DjangoTemplate):
        # Plain text: Django's autoescaping would write "&amp;" into a chat message.
        text = template.template.render(Context(context, autoescape=False))
    elif type(template).__module__ == JINJA2_BACKEND:
        # Jinja2's too, on by default in Django's backend for it.
        jinja2 = template.template
        text = _plain(jinja2.environment).get_template(jinja2.name).render(context)
    else:
        text = template.render(context)
    return str(text).strip() or event.type


#: Django's backend for Jinja2 templates (not imported: Jinja2 is optional).
JINJA2_BACKEND = "django.template.backends.jinja2"
#: Where an environment keeps its plain twin: it goes when the environment does.
_PLAIN = "_federation_delivery_plain"
_plain_lock = threading.Lock()


def _plain(environment: Any) -> Any:
    """``environment`` with autoescaping off, made once: its loader and
    filters, and a cache of its own for what it compiles. Not its bytecode
    cache, which keys a template by its name alone: it would give back the
    escaping code compiled first."""
    with _plain_lock:
        plain = vars(environment).get(_PLAIN)
        if plain is None:
            plain = environment.overlay(autoescape=False, bytecode_cache=None)
            setattr(environment, _PLAIN, plain)
        return plain


def _fields(data: Any) -> list[tuple[str, str]]:
    """A JSON object's members as (name, text): strings as they are, the rest as JSON."""
    if not isinstance(data, dict):
        return []
    return [
        (str(name), value if isinstance(value, str) else compact_json(value).decode())
        for name, value in data.items()
    ]


def escape_entities(text: str) -> str:
    """``& < >`` as entities: what Slack's mrkdwn and Telegram's HTML both ask for."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


#: What Markdown (CommonMark, and the chat services' kin of it) reads as
#: markup wherever it is: emphasis and strike, code, links and images,
#: headings, quotes, tables, HTML, entities and (Mattermost's, Rocket.Chat's)
#: TeX. A backslash before each makes it a character.
MARKDOWN_MARKUP = re.compile(r"([\\`*_~\[\]()<>#!|&$])")
#: What is markup only where a line starts (after any indentation): a list
#: item's marker ("-", "+", "1."; "*" and "1)" are escaped anyway), a setext
#: heading's underline ("===", "---"), a thematic break and Discord's "-#".
#: A backslash before the marker (before "." after a number) makes it text.
LINE_MARKUP = re.compile(r"^([ \t]*)(?:([-+=])|([0-9]+)(?=\.(?:[ \t]|$)))", re.MULTILINE)
#: The spaces and tabs that start a line, which would make it indented code
#: or the inside of a list item.
INDENTATION = re.compile(r"^[ \t]+", re.MULTILINE)
#: U+00A0, the space Markdown does not count as indentation, and shows.
NO_BREAK_SPACE = "\u00a0"
#: A mention: "@" before a name (@channel, @here, @all, @everyone, @someone).
MENTION = re.compile(r"@(?=\w)")
#: What a service makes a link of by itself: a scheme's "://" and "www.".
AUTOLINK = re.compile(r"(:)(//)|\b(www)(\.)", re.IGNORECASE)
#: A line's end: ``\r\n``, or a ``\r`` alone, as Markdown reads one.
LINE_ENDING = re.compile(r"\r\n?")
#: U+2060, invisible and unbreaking: what keeps a mention or a link from being one.
WORD_JOINER = "\u2060"


def escape_markdown(text: str) -> str:
    """``text`` as Markdown that shows it as written: its markup escaped, and
    neither a mention (``@channel``, ``@all``, ``@everyone``) nor a link or
    image made of it.

    Its lines are kept, each shown as a line of text: what would make one a
    heading, a list item, a quote, a rule or code where it starts is escaped
    too, and its indentation written as no-break spaces, which keep it (a
    stack trace's, a JSON document's) without making code of it. Folding the
    lines of a value into one would read as safely, but turn a log or a
    traceback into one long line an operator has to take apart again.

    A carriage return ends a line as a line feed does (CommonMark reads a
    ``\\r`` alone as a line's end, and the renderers of the chat services
    turn it into ``\\n``): each is written ``\\n``, so that what starts the
    line after it is escaped too."""
    text = LINE_ENDING.sub("\n", text)
    text = MARKDOWN_MARKUP.sub(r"\\\1", text)
    text = LINE_MARKUP.sub(_escape_line_start, text)
    text = INDENTATION.sub(_no_break, text)
    return no_mentions_or_links(text)


def no_mentions_or_links(text: str) -> str:
    """``text`` with a word joiner after each ``@`` before a name and inside
    each ``://`` and ``www.``: neither a mention nor a link is made of it."""
    return break_links(MENTION.sub("@" + WORD_JOINER, text))


def break_links(text: str) -> str:
    """``text`` with a word joiner inside each ``://`` and ``www.``: what a
    service would make a link of by itself, shown as written."""
    return AUTOLINK.sub(lambda m: WORD_JOINER.join(part for part in m.groups() if part), text)


def _escape_line_start(match: re.Match[str]) -> str:
    lead, marker, number = match.groups()
    if number is not None:
        return f"{lead}{number}\\"  # before the "." that follows
    return f"{lead}\\{marker}"


def _no_break(match: re.Match[str]) -> str:
    # A tab as far as Markdown takes one: to the next multiple of four.
    return NO_BREAK_SPACE * len(match.group().expandtabs(4))


def cut(text: str, limit: int) -> str:
    """``text`` in at most ``limit`` UTF-16 code units (what Discord and
    Telegram count, never fewer than characters), cut between characters and
    ended with an ellipsis when too long."""
    return _cut(text, limit, _utf16_length)


def cut_markdown(text: str, limit: int) -> str:
    """:func:`cut` of what :func:`escape_markdown` wrote, never between a
    backslash and the character it escapes: a chat would show the backslash
    before the ellipsis, which the event never had."""
    kept = cut(text, limit)
    if kept == text:
        return text
    body = kept.removesuffix(ELLIPSIS)
    if (len(body) - len(body.rstrip("\\"))) % 2:
        body = body[:-1]
    return body + ELLIPSIS


def cut_bytes(text: str, limit: int) -> str:
    """``text`` in at most ``limit`` bytes of UTF-8, cut as :func:`cut` cuts."""
    return _cut(text, limit, lambda part: len(part.encode()))


def cut_json(text: str, limit: int) -> str:
    """``text`` in at most ``limit`` bytes once written in a JSON string as
    :func:`~django_federation_delivery.channels.events.compact_json` writes
    it (UTF-8, ``"`` and ``\\`` in two bytes, a control character in two or
    six), cut as :func:`cut` cuts: what a service that bounds the JSON it is
    sent takes, whatever the text is made of."""
    return _cut(text, limit, _json_length)


def _json_length(text: str) -> int:
    # What json.dumps(ensure_ascii=False) writes, less the quotes around it.
    return len(compact_json(text)) - 2


def _cut(text: str, limit: int, length: Any) -> str:
    if length(text) <= limit:
        return text
    room = limit - length(ELLIPSIS)
    kept = []
    for character in text:
        room -= length(character)
        if room < 0:
            break
        kept.append(character)
    return "".join(kept).rstrip() + ELLIPSIS


def _utf16_length(text: str) -> int:
    return len(text.encode("utf-16-le", "surrogatepass")) // 2
