"""SIGTERM and SIGINT for the processes that deliver: the first one stops,
a second one (where that is wanted) ends the process at once.

Python runs a signal's handler in the main thread, between two of its
bytecodes, wherever that thread is: inside an Event's ``wait`` holding that
Event's lock, writing a line, or in the handler of the signal before. A
handler that set that Event, or wrote a line, would wait for ever on what it
interrupted; one run inside the handler before it would find the first stop
not yet made, and stop again rather than exit. So the handler here only notes
the signal and writes its number down a pipe, and a thread of its own reads it
and acts: ``first`` for the first signal, ``again`` for any after. ``again``
is also called by the handler itself, as soon as a signal comes after the
first: it must only end the process (``os._exit``), which is safe anywhere.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

from django.utils import translation

logger = logging.getLogger("django_federation_delivery.deliverer")

#: The signals that stop a deliverer, or a supervisor of deliverers.
STOP = (signal.SIGTERM, signal.SIGINT)


class StopSignals:
    """Takes :data:`STOP` over from :meth:`install` to :meth:`restore`."""

    def __init__(
        self,
        first: Callable[[int], object],
        again: Callable[[int], object] | None = None,
    ) -> None:
        self.first = first
        self.again = again
        self._noted = False
        self._acted = False
        self._write: int | None = None
        self._previous: dict[int, Any] = {}

    def install(self) -> bool:
        """Takes the signals over; returns False, doing nothing, outside the
        main thread (where Python lets no one)."""
        if threading.current_thread() is not threading.main_thread():
            return False
        read, write = os.pipe()
        # A handler never waits, even on a pipe nobody reads any more.
        os.set_blocking(write, False)
        self._write = write
        # What it says, it says in the language of the thread that installed it.
        language = translation.get_language()
        threading.Thread(
            target=self._relay,
            args=(read, language),
            name="federation-delivery-signals",
            daemon=True,
        ).start()
        self._previous = {number: signal.signal(number, self._handle) for number in STOP}
        return True

    def restore(self) -> None:
        """Gives the signals back to the handlers they had; the thread ends."""
        for number, handler in self._previous.items():
            signal.signal(number, handler)
        self._previous = {}
        write, self._write = self._write, None
        if write is not None:
            os.close(write)

    def _handle(self, number: int, frame: FrameType | None) -> None:
        if self._noted and self.again is not None:
            self.again(number)
            return
        self._noted = True
        write = self._write
        if write is not None:
            # Full, or closed by restore() meanwhile: nothing to tell.
            with contextlib.suppress(OSError):
                os.write(write, bytes([number]))

    def _relay(self, read: int, language: str | None) -> None:
        if language is not None:
            translation.activate(language)
        try:
            while chunk := os.read(read, 16):
                for number in chunk:
                    self._act(number)
        finally:
            os.close(read)

    def _act(self, number: int) -> None:
        acted, self._acted = self._acted, True
        action = self.again if acted else self.first
        if action is None:
            return
        try:
            action(number)
        except Exception:
            # Nothing else would see it: the thread goes on to the next one.
            logger.exception("Acting on signal %d failed", number)
