"""What a message may show of a URL, and what of it no message may hold.

An inbox's query or userinfo, and a webhook URL whole, may be a credential:
what is logged, stored as an error, sent with a signal or shown in the admin
goes through :func:`redact`, and an inbox's answer is kept with its target's
:func:`credentials` replaced. Pure: no Django, no network, and neither raises,
as both run on URLs already refused.
"""

from __future__ import annotations

import re
from urllib.parse import unquote, unquote_plus

__all__ = ["credentials", "redact"]

_USERINFO = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*:)?(//)?[^/]*@")
_ORIGIN_ONLY = re.compile(r"^(?:[A-Za-z][A-Za-z0-9+.-]*:)?(?://)?[^/\\?#]*")
_MESSAGE_URL_LENGTH = 200
# A part of a query or userinfo shorter than this ("a=1") is not worth hiding on its own.
_PART_LENGTH = 4


def redact(url: str, *, whole_path: bool = False) -> str:
    """The URL as a message may show it: no userinfo, query or fragment, one printable
    line, short. With ``whole_path``, only ``scheme://host[:port]`` (for a URL whose
    path is itself the credential). Never raises."""
    text = str(url)
    # Up to the last "@" before the path, "//" or not ("http:user:pw@host"), even when
    # a "?" comes first: a password may hold one.
    text = _USERINFO.sub(r"\1\2", text)
    if whole_path:
        matched = _ORIGIN_ONLY.match(text)
        text = matched.group(0) if matched else ""
    else:
        text = re.split(r"[?#]", text, maxsplit=1)[0]
    text = text[: _MESSAGE_URL_LENGTH + 1]
    # Escaped as repr() escapes: one line, and nothing that prints as something else.
    text = repr(text)[1:-1]
    if len(text) > _MESSAGE_URL_LENGTH:
        text = text[: _MESSAGE_URL_LENGTH - 3] + "..."
    return text


def credentials(url: str) -> list[str]:
    """What of ``url`` no message may hold: its userinfo and query, whole and in parts
    (user, password, each parameter and its value), as written and decoded; longest
    first, so that replacing them in turn leaves no piece of a longer one."""
    text = str(url)
    found: set[str] = set()
    matched = _USERINFO.match(text)
    if matched:
        userinfo = matched.group(0)[len(matched.group(1) or "") + len(matched.group(2) or "") : -1]
        found.add(userinfo)
        found.update(piece for piece in userinfo.split(":") if len(piece) >= _PART_LENGTH)
        text = text[matched.end() :]
    query = text.partition("#")[0].partition("?")[2]
    if query:
        found.add(query)
        for parameter in re.split(r"[&;]", query):
            value = parameter.partition("=")[2]
            found.update(part for part in (parameter, value) if len(part) >= _PART_LENGTH)
    decoded = {decode(secret) for secret in found for decode in (unquote, unquote_plus)}
    return sorted((found | decoded) - {""}, key=lambda secret: (-len(secret), secret))
