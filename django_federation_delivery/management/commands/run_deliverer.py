"""``manage.py run_deliverer``: the claim-and-send loop."""

from __future__ import annotations

import ipaddress
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import DEFAULT_DB_ALIAS, connections
from django.utils.translation import gettext as _

from django_federation_delivery import metrics, store, supervisor
from django_federation_delivery.checks import WHOLE_NUMBERS, check_settings, sqlite_problems
from django_federation_delivery.deliverer import Deliverer
from django_federation_delivery.retention import PeriodicPurge
from django_federation_delivery.settling import Summary
from django_federation_delivery.supervisor import GaveUp, Supervisor

# What the command prints is translated; its log lines stay in English, as
# operators grep them (and so throughout the package's logging).
logger = logging.getLogger("django_federation_delivery.deliverer")

#: ``--processes``: one a core is the point; past a few hundred, a mistake.
MOST_PROCESSES = 256
#: ``--purge``: the first purge this long after the start (or after the
#: interval, if shorter), the deliverer's own start done by then.
FIRST_PURGE = 60.0
#: The options a child is started with (the rest are the supervisor's).
CHILD_OPTIONS = (
    "drain",
    "concurrency",
    "per_host",
    "database",
    "metrics_port",
    "metrics_addr",
    "log_interval",
    "purge",
    "purge_interval",
    "verbosity",
    "no_color",
    "force_color",
)


def _positive(value: str, most: int = 10**9) -> int:
    try:
        number = int(value)
    except ValueError:
        number = 0
    if not 1 <= number <= most:
        raise CommandError(
            _("expected a whole number from 1 to %(most)d, not %(value)r")
            % {"most": most, "value": value}
        )
    return number


def _address(value: str) -> str:
    try:
        return str(ipaddress.ip_address(value.strip().strip("[]")))
    except ValueError:
        raise CommandError(
            _("expected an IP address to serve metrics on, such as 127.0.0.1, not %(value)r")
            % {"value": value}
        ) from None


BAR = 30


def _log_rates(interval: float) -> Callable[[Summary], None]:
    """A log line every ``interval`` seconds: what was done since the last one."""
    last = {"done": 0, "delivered": 0, "at": time.monotonic()}

    def log(summary: Summary) -> None:
        now = time.monotonic()
        elapsed = max(now - last["at"], 1e-9)
        rate = (summary.delivered - last["delivered"]) / elapsed
        logger.info(
            "%s; %.1f delivered/s and %.1f attempts/s in the last %.0f s",
            summary.line(),
            rate,
            (summary.done - last["done"]) / elapsed,
            elapsed,
        )
        last.update(done=summary.done, delivered=summary.delivered, at=now)

    return log


@dataclass
class _Child:
    """What a deliverer started by ``--processes`` knows of its place."""

    index: int
    count: int
    #: Set by a stop that came before the deliverer was made.
    stopped: threading.Event

    @property
    def prefix(self) -> str:
        return f"[deliverer {self.index}/{self.count} pid {os.getpid()}] "


def _prefix_log_records(prefix: str) -> None:
    """Every log record of this process starts with ``prefix``: the lines of
    N deliverers sharing a terminal or a journal say whose they are."""
    make = logging.getLogRecordFactory()

    def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = make(*args, **kwargs)
        record.msg = f"{prefix}{record.msg}"
        return record

    logging.setLogRecordFactory(factory)


def run_child(index: int, count: int, options: dict[str, Any]) -> None:
    """One of ``run_deliverer --processes N``, in a spawned process of its own."""
    child = _Child(index, count, supervisor.stop_requested)
    _prefix_log_records(child.prefix)
    command = Command(no_color=options["no_color"], force_color=options["force_color"])
    command.child = child
    if options["metrics_port"] is not None:
        # Checked by the supervisor: every child's port is within 1 to 65535.
        options = {**options, "metrics_port": str(int(options["metrics_port"]) + index - 1)}
    if index != 1:
        # One purge is enough: the first child's (the supervisor owns no database).
        options = {**options, "purge": False}
    try:
        command.handle(**options, processes="1")
    except CommandError as exc:
        command.stderr.write(f"{child.prefix}CommandError: {exc}")
        sys.exit(1)


class Command(BaseCommand):
    help = (
        "Send what is queued: claim due deliveries and send them, until stopped "
        "(SIGTERM or SIGINT finishes what is in flight; a second one exits at once). "
        "With --drain, stop once nothing is due. With --processes N, N deliverers "
        "in processes of their own under this one."
    )
    #: Set in a process started by ``--processes``.
    child: _Child | None = None

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--drain",
            action="store_true",
            help="Exit once nothing is due, with progress and a summary.",
        )
        parser.add_argument(
            "--concurrency",
            type=str,
            default=None,
            help="Deliveries in flight at once (default: CONCURRENCY, 16).",
        )
        parser.add_argument(
            "--per-host",
            type=str,
            default=None,
            help="Deliveries in flight at once to one host (default: PER_HOST, 2).",
        )
        parser.add_argument(
            "--database", default=DEFAULT_DB_ALIAS, help="The database alias the queue lives in."
        )
        parser.add_argument(
            "--metrics-port",
            type=str,
            default=None,
            help="Serve Prometheus metrics on this port (needs the 'prometheus' extra).",
        )
        parser.add_argument(
            "--metrics-addr",
            type=str,
            default="127.0.0.1",
            help="The address the metrics are served on (default 127.0.0.1, this machine "
            "only; 0.0.0.0 or :: for every interface).",
        )
        parser.add_argument(
            "--processes",
            type=str,
            default="1",
            help="Deliverers to run, each in a process of its own, under this one "
            "(default 1: this process delivers). One a core; restarted if they die.",
        )
        parser.add_argument(
            "--log-interval",
            type=str,
            default="60",
            help="Seconds between the log lines with rates and counts (default 60).",
        )
        parser.add_argument(
            "--purge",
            action="store_true",
            help="Also delete settled deliveries past RETENTION, as purge_deliveries does, "
            "in a thread of its own: shortly after the start, then every --purge-interval "
            "(with --processes, the first deliverer only).",
        )
        parser.add_argument(
            "--purge-interval",
            type=str,
            default="3600",
            help="Seconds between purges with --purge (default 3600).",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        processes = _positive(options["processes"], MOST_PROCESSES)
        # Held to what the settings may say (checks.WHOLE_NUMBERS): a thread a slot.
        concurrency = (
            _positive(options["concurrency"], WHOLE_NUMBERS["CONCURRENCY"][1])
            if options["concurrency"]
            else None
        )
        per_host = (
            _positive(options["per_host"], WHOLE_NUMBERS["PER_HOST"][1])
            if options["per_host"]
            else None
        )
        using = options["database"]
        if using not in connections:
            raise CommandError(_("no database named %(alias)r in DATABASES") % {"alias": using})
        if connections[using].vendor == "sqlite" and self.child is None:
            for problem in sqlite_problems(using, connections[using]):
                self.stderr.write(self.style.WARNING(f"{problem.msg} {problem.hint}"))
        drain = bool(options["drain"])
        interval = float(_positive(options["log_interval"], 86_400))
        purge_every = float(_positive(options["purge_interval"], 7 * 86_400))
        # Run from call_command, or with --skip-checks, the system checks have
        # not run: a bad setting is still an error that says what to write,
        # not a traceback from deep in the loop.
        problems = [message for message in check_settings() if message.is_serious()]
        if problems:
            raise CommandError(
                "\n".join(f"{m.id}: {m.msg} {m.hint or ''}".rstrip() for m in problems)
            )
        port = options["metrics_port"]
        number = _positive(port, 65535) if port is not None else 0
        addr = _address(options["metrics_addr"]) if port is not None else ""
        if processes > 1:
            # Refused here, once, rather than by every child dying at once.
            if port is not None and not metrics.available():
                raise CommandError(metrics.NEEDS_CLIENT)
            if number + processes - 1 > 65535:
                raise CommandError(
                    _(
                        "--metrics-port %(port)r with --processes %(processes)d needs ports "
                        "%(first)d to %(last)d, past 65535"
                    )
                    % {
                        "port": port,
                        "processes": processes,
                        "first": number,
                        "last": number + processes - 1,
                    }
                )
            self._supervise(processes, {name: options[name] for name in CHILD_OPTIONS})
            return
        if port is not None:
            try:
                server = metrics.start_server(number, addr=addr)
            except ImproperlyConfigured as exc:
                raise CommandError(str(exc)) from exc
            except OSError as exc:
                raise CommandError(
                    _("cannot serve metrics on %(addr)s port %(port)d: %(error)s")
                    % {"addr": addr, "port": number, "error": exc}
                ) from exc
            shown = f"[{addr}]" if ":" in addr else addr
            self._say(
                _("Metrics at %(url)s") % {"url": f"http://{shown}:{server.server_port}/metrics"}
            )
        self._due = store.count_due(using=using) if drain else 0
        try:
            deliverer = Deliverer(
                concurrency=concurrency,
                per_host=per_host,
                using=using,
                on_progress=self._progress if drain else _log_rates(interval),
                progress_interval=1.0 if drain else interval,
                metrics=port is not None,
                heartbeat=True,
            )
        except ImproperlyConfigured as exc:
            raise CommandError(str(exc)) from exc
        previous = self._install_signals(deliverer)
        self._watch_supervisor(deliverer)
        message = (
            _("Delivering until nothing is due: %(concurrency)d in flight, %(per_host)d per host.")
            if drain
            else _("Delivering until stopped: %(concurrency)d in flight, %(per_host)d per host.")
        )
        self._say(message % {"concurrency": deliverer.concurrency, "per_host": deliverer.per_host})
        purging = None
        if options["purge"]:
            purging = PeriodicPurge(purge_every, first=min(FIRST_PURGE, purge_every), using=using)
            purging.start()
            self._say(
                _("Purging what is past RETENTION every %(seconds).0f s.")
                % {"seconds": purge_every}
            )
        try:
            summary = deliverer.run(drain=drain)
        finally:
            if purging is not None:
                purging.stop()
            # Called from code (call_command), the caller's handlers come back.
            for number, handler in previous.items():
                signal.signal(number, handler)
        self._say(self.style.SUCCESS(_("Done: %(summary)s.") % {"summary": summary.line()}))

    def _supervise(self, processes: int, options: dict[str, Any]) -> None:
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
        self._say(message % {"processes": processes, "ports": ports})
        children = Supervisor(
            processes, f"{__name__}.run_child", (options,), drain=drain, say=self._warn
        )
        try:
            children.run()
        except GaveUp as exc:
            raise CommandError(str(exc)) from exc
        done = (
            _("Done: all %(processes)d deliverer processes finished.")
            if drain and not children.stopping
            else _("Done: all %(processes)d deliverer processes stopped.")
        )
        self._say(self.style.SUCCESS(done % {"processes": processes}))

    def _progress(self, summary: Summary) -> None:
        """A bar of what was due at the start and has been dealt with since."""
        done = summary.done
        total = max(self._due, done, 1)
        filled = round(BAR * done / total)
        bar = "#" * filled + "." * (BAR - filled)
        self._say(f"  [{bar}] {done}/{total}  {summary.line()}")

    def _say(self, line: str) -> None:
        # Flushed: an operator (or a supervisor reading a pipe) sees it now,
        # not when a buffer fills.
        self.stdout.write(f"{self.child.prefix}{line}" if self.child else line)
        self.stdout.flush()

    def _warn(self, line: str) -> None:
        self.stderr.write(f"{self.child.prefix}{line}" if self.child else line)
        self.stderr.flush()

    def _watch_supervisor(self, deliverer: Deliverer) -> None:
        """A child stops when its supervisor is gone (killed, say), rather
        than deliver on unwatched with nobody to stop it."""
        parent = multiprocessing.parent_process() if self.child else None
        if parent is None:
            return

        def watch() -> None:
            multiprocessing.connection.wait([parent.sentinel])
            if not deliverer.stopping:
                logger.warning("The supervisor is gone: stopping")
                deliverer.stop()

        threading.Thread(target=watch, name="federation-delivery-supervisor", daemon=True).start()

    def _install_signals(self, deliverer: Deliverer) -> dict[int, Any]:
        if threading.current_thread() is not threading.main_thread():
            return {}

        child = self.child

        def stop(number: int, frame: FrameType | None) -> None:
            if child is not None:
                # Under a supervisor, a signal only ever stops: Ctrl-C in a
                # terminal (or systemd's stop) reaches this process and the
                # supervisor both, and the supervisor passes it on. A forced
                # stop is the supervisor's SIGKILL.
                if not deliverer.stopping:
                    self._warn(_("Stopping: finishing what is in flight."))
                    deliverer.stop()
                return
            if deliverer.stopping:
                # A second signal: the operator means it.
                os._exit(128 + number)
            self._warn(_("Stopping: finishing what is in flight (again to exit at once)."))
            deliverer.stop()

        previous: dict[int, Any] = {
            number: signal.signal(number, stop) for number in (signal.SIGTERM, signal.SIGINT)
        }
        if child is not None and child.stopped.is_set():
            stop(signal.SIGTERM, None)
        return previous
