"""What ``run_deliverer`` does around its deliverer: the progress it prints,
the rates it logs, the stop signals, and a child's place under ``--processes``."""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from django.core.management.base import CommandError
from django.db import connections
from django.utils import translation
from django.utils.translation import gettext as _

from django_federation_delivery.deliverer import Deliverer
from django_federation_delivery.settling import Summary
from django_federation_delivery.stopsignals import StopSignals
from django_federation_delivery.supervisor import GaveUp, Supervisor, exit_if_importing_main

logger = logging.getLogger("django_federation_delivery.deliverer")

#: The width of ``--drain``'s progress bar, in characters.
BAR = 30

Say = Callable[[str], None]


def log_rates(interval: float) -> Callable[[Summary], None]:
    """A log line every ``interval`` seconds: what was done since the last one."""
    last = {"attempts": 0, "delivered": 0, "at": time.monotonic()}

    def log(summary: Summary) -> None:
        now = time.monotonic()
        elapsed = max(now - last["at"], 1e-9)
        rate = (summary.delivered - last["delivered"]) / elapsed
        # Log lines stay English: operators grep them.
        with translation.override(None):
            line = summary.line()
        logger.info(
            "%s; %.1f delivered/s and %.1f attempts/s in the last %.0f s",
            line,
            rate,
            # Requests made: not the skipped, held or superseded, none made.
            (summary.attempts - last["attempts"]) / elapsed,
            elapsed,
        )
        last.update(attempts=summary.attempts, delivered=summary.delivered, at=now)

    return log


def drain_progress(due: int | None, say: Say) -> Callable[[Summary], None]:
    """A bar of what was ``due`` at the start and has left the queue since
    (delivered, refused, failed, skipped or superseded): a retry or a hold is a step, not
    the end, and counting each would carry the count past what was due.

    ``due`` None: one of several deliverers draining the queue together
    (``--processes``), which sees only what it sent itself. Its counts alone,
    then: a bar of what all of them share would end short of its total."""

    def progress(summary: Summary) -> None:
        if due is None:
            say(f"  {summary.line()}")
            return
        done = (
            summary.delivered
            + summary.refused
            + summary.failed
            + summary.skipped
            + summary.superseded
        )
        # What came due since the start (a retry's wait ending, a new send)
        # carries the count past what was due: the total follows it.
        total = max(due, done)
        filled = round(BAR * done / total) if total else BAR
        bar = "#" * filled + "." * (BAR - filled)
        say(f"  [{bar}] {done}/{total}  {summary.line()}")

    return progress


@dataclass
class Child:
    """What a deliverer started by ``--processes`` knows of its place."""

    index: int
    count: int
    #: Set by a stop that came before the deliverer was made.
    stopped: threading.Event

    @property
    def prefix(self) -> str:
        return f"[deliverer {self.index}/{self.count} pid {os.getpid()}] "


def prefix_log_records(prefix: str) -> None:
    """Every log record of this process starts with ``prefix``: the lines of
    N deliverers sharing a terminal or a journal say whose they are."""
    make = logging.getLogRecordFactory()

    def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = make(*args, **kwargs)
        record.msg = f"{prefix}{record.msg}"
        return record

    logging.setLogRecordFactory(factory)


def supervise(processes: int, target: str, options: dict[str, Any], *, say: Say, warn: Say) -> str:
    """Run ``processes`` children of ``target`` until they stop; gives the
    line that says how they ended, or raises a CommandError saying why not."""
    exit_if_importing_main()  # a child of an unguarded script: its parent says so
    # The children open their own: nothing of this process's is shared or kept.
    connections.close_all()
    drain = bool(options["drain"])
    message = (
        _("Starting %(processes)d deliverer processes until nothing is due%(ports)s.")
        if drain
        else _("Starting %(processes)d deliverer processes until stopped%(ports)s.")
    )
    ports = ""
    if options["metrics_port"] is not None:
        first = int(options["metrics_port"])
        ports = _(", metrics on ports %(first)d to %(last)d") % {
            "first": first,
            "last": first + processes - 1,
        }
    say(message % {"processes": processes, "ports": ports})
    children = Supervisor(processes, target, (options,), drain=drain, say=warn)
    try:
        children.run()
    except GaveUp as exc:
        raise CommandError(str(exc)) from exc
    done = (
        _("Done: all %(processes)d deliverer processes finished.")
        if drain and not children.stopping
        else _("Done: all %(processes)d deliverer processes stopped.")
    )
    return done % {"processes": processes}


def watch_supervisor(deliverer: Deliverer, child: Child | None) -> None:
    """A child stops when its supervisor is gone (killed, say), rather than
    deliver on unwatched with nobody to stop it."""
    parent = multiprocessing.parent_process() if child else None
    if parent is None:
        return

    def watch() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        if not deliverer.stopping:
            logger.warning("The supervisor is gone: stopping")
            deliverer.stop()

    threading.Thread(target=watch, name="federation-delivery-supervisor", daemon=True).start()


def install_stop_signals(deliverer: Deliverer, child: Child | None, warn: Say) -> StopSignals:
    """SIGTERM and SIGINT stop ``deliverer``; when it runs alone (not as a
    ``child`` of a supervisor), a second one exits at once. The caller calls
    ``restore()`` on what this gives when it is done."""

    def exit_now(number: int) -> None:
        # A second signal: the operator means it.
        os._exit(128 + number)

    def stop(number: int) -> None:
        if deliverer.stopping:
            if child is None:
                exit_now(number)  # stopping already: as good as a second one
            return
        # Stopped first: the line is said after, whatever becomes of it.
        deliverer.stop()
        if child is None:
            warn(_("Stopping: finishing what is in flight (again to exit at once)."))
        else:
            warn(_("Stopping: finishing what is in flight."))

    # Under a supervisor, a signal only ever stops: Ctrl-C in a terminal (or
    # systemd's stop) reaches this process and the supervisor both, and the
    # supervisor passes it on. A forced stop is the supervisor's SIGKILL.
    signals = StopSignals(stop, exit_now if child is None else None)
    signals.install()
    if child is not None and child.stopped.is_set():
        stop(signal.SIGTERM)
    return signals
