"""Several deliverer processes under one: ``run_deliverer --processes N``.

Each child is a whole deliverer in a fresh interpreter, started with
multiprocessing's *spawn* context. Fork would hand every child a copy of the
parent's database connections (one socket, used by N processes at once) and
of whatever lock another thread held at that instant; re-running the command
line with ``subprocess`` would have to rebuild how it was started (manage.py,
django-admin, ``python -m django``, ``--pythonpath``), which spawn carries
over by itself: the main module, ``sys.path`` and the environment.

The supervisor owns no database connection. It forwards a stop to every
child, restarts a child that dies, and gives up on one that dies at once
every time rather than spin.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import multiprocessing.connection
import multiprocessing.resource_tracker
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import FrameType
from typing import Any

from django.utils import translation
from django.utils.translation import gettext as _
from django.utils.translation import ngettext

from django_federation_delivery.stopsignals import STOP, StopSignals

# What reaches the operator (the stop, why the supervisor gave up) is
# translated; the log lines stay English, as operators grep them.
logger = logging.getLogger("django_federation_delivery.deliverer")

#: A child that dies sooner than this after starting died "at once".
QUICK_DEATH = 30.0
#: Deaths at once in a row, for one child, before the supervisor gives up.
GIVE_UP_AFTER = 5
#: The wait before a restart after deaths at once: doubled each time.
FIRST_BACKOFF = 0.5
MOST_BACKOFF = 30.0


#: A child's exit status when the script that started it runs its command
#: as it is imported (no ``if __name__ == "__main__":``): see
#: :func:`importing_main`.
UNGUARDED_MAIN = 86


def exit_if_importing_main() -> None:
    """Exit at once, with :data:`UNGUARDED_MAIN`, in a spawned child that is
    still importing the script that started its parent.

    Spawn imports that script again in each child; one whose last lines are
    not under ``if __name__ == "__main__":`` runs its command again there,
    and a ``run_deliverer --processes N`` would start children of its own
    from each child, which multiprocessing refuses, again and again. The
    parent says why, once."""
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        os._exit(UNGUARDED_MAIN)


#: Set in a child by a SIGTERM or SIGINT that came before its target took
#: over the signals: the target stops as soon as it starts.
stop_requested = threading.Event()


def _bootstrap(target: str, *args: Any) -> None:
    """A child's first steps: listen for a stop, set Django up, then run
    ``target`` (a dotted path: a module that defines models can only be
    imported once Django is set up, so it cannot be pickled by reference)."""

    def early(number: int, frame: FrameType | None) -> None:
        stop_requested.set()

    for number in STOP:
        signal.signal(number, early)
    # Held since the fork (_holding_sigint): a Ctrl-C that came while this
    # interpreter started is taken now, as a stop.
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    import django
    from django.utils.module_loading import import_string

    django.setup()
    import_string(target)(*args)


def unguarded_main() -> str:
    """What the supervisor says when its children ran the command again."""
    return _(
        "%(script)s runs its command when it is imported, so each deliverer process ran it "
        "again instead of delivering: put its last lines under 'if __name__ == \"__main__\":', "
        "as Django's own manage.py does"
    ) % {"script": os.path.basename(sys.argv[0]) or "the script"}


@contextlib.contextmanager
def _holding_sigint() -> Iterator[None]:
    """Blocks SIGINT in this thread while a child is started, which inherits
    the mask: a Ctrl-C reaches the whole group, and an interpreter still
    starting (before :func:`_bootstrap` takes the signals) would die of it,
    with status 1, a failure, when it is only the stop the supervisor passes
    on itself. Held, it waits for the child to take it as a stop. This
    process loses nothing: another of its threads takes the signal
    meanwhile, or it comes once unblocked. (multiprocessing starts its
    resource tracker the same way, bpo-33613.)"""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    # Started now, not in the child's start: its own start unblocks SIGINT.
    multiprocessing.resource_tracker.ensure_running()
    before = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


class GaveUp(Exception):
    """The supervisor stopped: a child kept dying, or did not stop cleanly."""


def describe_exit(code: int | None) -> str:
    """A child's end, as an operator reads it: ``was killed by SIGKILL``."""
    if code is None:
        return _("is still running")
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = _("signal %(number)d") % {"number": -code}
        return _("was killed by %(signal)s") % {"signal": name}
    return _("exited with status %(status)d") % {"status": code}


@dataclass
class _Child:
    index: int
    process: multiprocessing.process.BaseProcess | None = None
    pid: int = 0
    started: float = 0.0
    quick_deaths: int = 0
    restart_at: float | None = None
    exitcode: int | None = None
    #: Ended once the supervisor was stopping: its end is what the stop came
    #: to. One that died before (its restart then cancelled) was a death of
    #: its own, said as it came.
    ended_stopping: bool = False

    @property
    def running(self) -> bool:
        return self.process is not None and self.exitcode is None


class Supervisor:
    """Runs ``target(index, count, *args)`` in ``count`` child processes
    (``index`` from 1) until they stop; ``target`` is a dotted path.

    SIGTERM or SIGINT stops them all (each finishes what it has in flight); a
    second one kills them. A child that dies is restarted; with ``drain``, a
    child that exits 0 has finished and is not.
    """

    def __init__(
        self,
        count: int,
        target: str,
        args: tuple[Any, ...] = (),
        *,
        drain: bool = False,
        say: Callable[[str], None] = print,
        quick_death: float = QUICK_DEATH,
        give_up_after: int = GIVE_UP_AFTER,
    ) -> None:
        self.context = multiprocessing.get_context("spawn")
        self.children = [_Child(index) for index in range(1, count + 1)]
        self.target = target
        self.args = args
        self.drain = drain
        self.say = say
        self.quick_death = quick_death
        self.give_up_after = give_up_after
        self._stopping = threading.Event()

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    def run(self) -> None:
        """Start the children and wait for them all to stop. Raises
        :class:`GaveUp` when a child kept dying or did not stop cleanly."""
        exit_if_importing_main()
        signals = StopSignals(self._stop_saying_so, self._kill_and_exit)
        signals.install()
        try:
            for child in self.children:
                self._start(child)
            self._watch()
        finally:
            signals.restore()
        unclean = [
            child
            for child in self.children
            # What the stop came to; killed by it while still starting, a
            # child had claimed nothing.
            if child.ended_stopping and child.exitcode not in (0, -signal.SIGTERM, -signal.SIGINT)
        ]
        if unclean:
            raise GaveUp(
                "; ".join(
                    _("deliverer %(index)d (pid %(pid)d) %(ended)s")
                    % {
                        "index": child.index,
                        "pid": child.pid,
                        "ended": describe_exit(child.exitcode),
                    }
                    for child in unclean
                )
            )

    def stop(self) -> None:
        """Ask every child to finish what is in flight and exit."""
        self._stopping.set()
        for child in self.children:
            child.restart_at = None
            if child.running and child.process is not None:
                child.process.terminate()  # SIGTERM

    def _kill_children(self) -> None:
        """Kill every child at once; what they had in flight is sent again
        once its lease lapses. Sets nothing and takes no lock: it is called
        in a signal's handler (see stopsignals)."""
        for child in self.children:
            if child.running and child.process is not None:
                child.process.kill()
        for child in self.children:
            if child.running and child.process is not None:
                child.process.join(5)

    def _start(self, child: _Child) -> None:
        process = self.context.Process(
            target=_bootstrap,
            args=(self.target, child.index, len(self.children), *self.args),
            name=f"deliverer-{child.index}",
        )
        with _holding_sigint():
            process.start()
        before = child.pid
        child.process, child.pid = process, process.pid or 0
        child.started, child.restart_at, child.exitcode = time.monotonic(), None, None
        if before:
            logger.warning(
                "Restarted deliverer %d: pid %d (was pid %d)", child.index, child.pid, before
            )
        if self.stopping:
            # The stop came while this one was being started.
            process.terminate()

    def _watch(self) -> None:
        while True:
            running = [child for child in self.children if child.running]
            # Once stopping, a restart is nothing to wait for, whatever set it:
            # this returns once no child runs.
            waiting = [
                child
                for child in self.children
                if child.restart_at is not None and not self.stopping
            ]
            if not running and not waiting:
                return
            now = time.monotonic()
            timeout = min([1.0, *(child.restart_at - now for child in waiting if child.restart_at)])
            sentinels = [child.process.sentinel for child in running if child.process]
            if sentinels:
                multiprocessing.connection.wait(sentinels, max(0.0, timeout))
            else:
                self._stopping.wait(max(0.0, timeout))
            for child in running:
                assert child.process is not None
                if child.process.exitcode is not None:
                    self._ended(child)
            now = time.monotonic()
            for child in self.children:
                if not self.stopping and child.restart_at is not None and child.restart_at <= now:
                    self._start(child)

    def _ended(self, child: _Child) -> None:
        assert child.process is not None
        child.process.join()
        child.exitcode = child.process.exitcode
        lived = time.monotonic() - child.started
        # Read once: a stop that comes from here on (in the signals' thread)
        # came after this death, which was not its doing.
        child.ended_stopping = self.stopping
        if child.ended_stopping or (self.drain and child.exitcode == 0):
            return
        if child.exitcode == UNGUARDED_MAIN:
            # Every restart would end the same way: say why, once.
            self.stop()
            self._watch()
            raise GaveUp(unguarded_main())
        child.quick_deaths = child.quick_deaths + 1 if lived < self.quick_death else 0
        if child.quick_deaths >= self.give_up_after:
            with translation.override(None):
                logger.error("Stopping every deliverer: %s", self._giving_up(child))
            self.stop()
            self._watch()
            raise GaveUp(self._giving_up(child))
        backoff = (
            min(MOST_BACKOFF, FIRST_BACKOFF * 2 ** (child.quick_deaths - 1))
            if child.quick_deaths
            else 0.0
        )
        with translation.override(None):
            logger.warning(
                "Deliverer %d (pid %d) %s after %.1f s; restarting it%s",
                child.index,
                child.pid,
                describe_exit(child.exitcode),
                lived,
                f" in {backoff:g} s" if backoff else "",
            )
        # Set even if a stop came meanwhile: _watch waits for no restart once stopping.
        child.restart_at = time.monotonic() + backoff

    def _giving_up(self, child: _Child) -> str:
        return ngettext(
            "deliverer %(index)d (pid %(pid)d) %(ended)s, %(times)d time in a row within "
            "%(seconds)g s of starting: giving up (its output above says why)",
            "deliverer %(index)d (pid %(pid)d) %(ended)s, %(times)d times in a row within "
            "%(seconds)g s of starting: giving up (its output above says why)",
            child.quick_deaths,
        ) % {
            "index": child.index,
            "pid": child.pid,
            "ended": describe_exit(child.exitcode),
            "times": child.quick_deaths,
            "seconds": self.quick_death,
        }

    def _stop_saying_so(self, number: int) -> None:
        # The first signal (StopSignals counts them): it stops, even when the
        # supervisor was stopping already of itself (giving up). Only a
        # second one kills.
        running = sum(child.running for child in self.children)
        # Stopped before it is said: a line that cannot be written never
        # leaves the stop unmade.
        self.stop()
        self.say(
            ngettext(
                "Stopping: %(count)d deliverer finishing what is in flight "
                "(again to kill them at once).",
                "Stopping: %(count)d deliverers finishing what is in flight "
                "(again to kill them at once).",
                running,
            )
            % {"count": running}
        )

    def _kill_and_exit(self, number: int) -> None:
        # A second signal: the operator means it.
        self._kill_children()
        os._exit(128 + number)
