"""urllib3's DEBUG lines, made safe to keep: one filter on its loggers.

urllib3 logs each request line, path and query included. A query may be a
credential, so it is always cut; and for a webhook the path itself is the
credential, so while a thread sends one, its lines also go through the
destination's redaction (:func:`redacting`).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator

__all__ = ["redacting"]

LOGGERS = (
    "urllib3.connectionpool",
    "urllib3.connection",
    "urllib3.poolmanager",
    "urllib3.response",
    "urllib3.util.retry",
)

_this_thread = threading.local()


@contextlib.contextmanager
def redacting(redact: Callable[[str], str]) -> Iterator[None]:
    """While inside, this thread's urllib3 lines go through ``redact`` too."""
    _this_thread.redact = redact
    try:
        yield
    finally:
        _this_thread.redact = None


class _SafeLines(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(
                arg.partition("?")[0] if isinstance(arg, str) else arg for arg in record.args
            )
        redact: Callable[[str], str] | None = getattr(_this_thread, "redact", None)
        if redact is not None:
            record.msg = redact(record.getMessage())
            record.args = None
        return True


_FILTER = _SafeLines()
for _name in LOGGERS:
    logging.getLogger(_name).addFilter(_FILTER)
