"""urllib3's lines, made safe to keep: one filter on its loggers.

urllib3 logs each request line, path and query included. A query may be a
credential, so it is always cut; and for a webhook the path itself is the
credential, so while a thread sends one, its lines also go through the
destination's redaction (:func:`redacting`). Every value a line shows,
whatever its type, goes through both as its text, and is cut to
``MAX_VALUE`` characters: an exception's message, an answer's header lines
are a stranger's text, of any length. No line keeps a traceback or a stack,
which a handler writes whole, past any filter, the exception's message with
it; urllib3's warning of an answer's header lines it could not parse, which
quotes them, is told in a fixed line.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator, Mapping

__all__ = ["redacting"]

LOGGERS = (
    "urllib3.connectionpool",
    "urllib3.connection",
    "urllib3.poolmanager",
    "urllib3.response",
    "urllib3.util.retry",
)

#: The most of one value a line shows, in characters.
MAX_VALUE = 200

#: urllib3's warning for an answer whose header lines it could not all
#: parse, which shows the unparsed ones (an inbox may echo its query there,
#: a webhook's receiver its path) and the traceback; its URL is kept.
_UNPARSED_HEADERS = "Failed to parse headers"
_UNPARSED_LINE = "Failed to parse headers (url=%s): malformed header lines in the answer"

_this_thread = threading.local()

Redact = Callable[[str], str]


@contextlib.contextmanager
def redacting(redact: Redact) -> Iterator[None]:
    """While inside, this thread's urllib3 lines go through ``redact`` too."""
    _this_thread.redact = redact
    try:
        yield
    finally:
        _this_thread.redact = None


def _safe(value: object, redact: Redact | None) -> object:
    """``value`` as a line may show it: a number as it is (a ``%d`` needs
    one), anything else as its text, up to any query, redacted, cut."""
    if isinstance(value, int | float):
        return value
    text = str(value).partition("?")[0]
    if redact is not None:
        # Before the cut: a secret cut short would no longer be recognised.
        text = redact(text)
    return text if len(text) <= MAX_VALUE else text[:MAX_VALUE] + "..."


class _SafeLines(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.exc_info = None
        record.exc_text = None
        record.stack_info = None
        if isinstance(record.msg, str) and _UNPARSED_HEADERS in record.msg:
            # After what a deliverer process puts before each of its lines
            # ("[deliverer 1/2 pid 123] "), kept.
            before = record.msg[: record.msg.index(_UNPARSED_HEADERS)]
            url = record.args[0] if isinstance(record.args, tuple) and record.args else ""
            record.msg, record.args = f"{before}{_UNPARSED_LINE}", (url,)
        redact: Redact | None = getattr(_this_thread, "redact", None)
        if isinstance(record.args, tuple):
            record.args = tuple(_safe(arg, redact) for arg in record.args)
        elif isinstance(record.args, Mapping):
            record.args = {name: _safe(arg, redact) for name, arg in record.args.items()}
        if redact is not None:
            record.msg = redact(record.getMessage())
            record.args = None
        return True


_FILTER = _SafeLines()
for _name in LOGGERS:
    logging.getLogger(_name).addFilter(_FILTER)
