"""``manage.py run_deliverer``: the claim-and-send loop."""

from __future__ import annotations

import ipaddress
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import DEFAULT_DB_ALIAS, connections

from django_federation_delivery import metrics, queue
from django_federation_delivery.checks import WHOLE_NUMBERS, check_settings, sqlite_problems
from django_federation_delivery.deliverer import Deliverer
from django_federation_delivery.settling import Summary

logger = logging.getLogger("django_federation_delivery.deliverer")


def _positive(value: str, most: int = 10**9) -> int:
    try:
        number = int(value)
    except ValueError:
        number = 0
    if not 1 <= number <= most:
        raise CommandError(f"expected a whole number from 1 to {most}, not {value!r}")
    return number


def _address(value: str) -> str:
    try:
        return str(ipaddress.ip_address(value.strip().strip("[]")))
    except ValueError:
        raise CommandError(
            f"expected an IP address to serve metrics on, such as 127.0.0.1, not {value!r}"
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


class Command(BaseCommand):
    help = (
        "Send what is queued: claim due deliveries and send them, until stopped "
        "(SIGTERM or SIGINT finishes what is in flight; a second one exits at once). "
        "With --drain, stop once nothing is due."
    )

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
            "--log-interval",
            type=str,
            default="60",
            help="Seconds between the log lines with rates and counts (default 60).",
        )

    def handle(self, *args: Any, **options: Any) -> None:
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
            raise CommandError(f"no database named {using!r} in DATABASES")
        if connections[using].vendor == "sqlite":
            for problem in sqlite_problems(using, connections[using]):
                self.stderr.write(self.style.WARNING(f"{problem.msg} {problem.hint}"))
        drain = bool(options["drain"])
        interval = float(_positive(options["log_interval"], 86_400))
        # Run from call_command, or with --skip-checks, the system checks have
        # not run: a bad setting is still an error that says what to write,
        # not a traceback from deep in the loop.
        problems = [message for message in check_settings() if message.is_serious()]
        if problems:
            raise CommandError(
                "\n".join(f"{m.id}: {m.msg} {m.hint or ''}".rstrip() for m in problems)
            )
        port = options["metrics_port"]
        if port is not None:
            number = _positive(port, 65535)
            addr = _address(options["metrics_addr"])
            try:
                server = metrics.start_server(number, addr=addr)
            except ImproperlyConfigured as exc:
                raise CommandError(str(exc)) from exc
            except OSError as exc:
                raise CommandError(f"cannot serve metrics on {addr} port {number}: {exc}") from exc
            shown = f"[{addr}]" if ":" in addr else addr
            self._say(f"Metrics at http://{shown}:{server.server_port}/metrics")
        self._due = queue.count_due(using=using) if drain else 0
        try:
            deliverer = Deliverer(
                concurrency=concurrency,
                per_host=per_host,
                using=using,
                on_progress=self._progress if drain else _log_rates(interval),
                progress_interval=1.0 if drain else interval,
                metrics=port is not None,
            )
        except ImproperlyConfigured as exc:
            raise CommandError(str(exc)) from exc
        previous = self._install_signals(deliverer)
        mode = "until nothing is due" if drain else "until stopped"
        self._say(
            f"Delivering {mode}: {deliverer.concurrency} in flight, {deliverer.per_host} per host."
        )
        try:
            summary = deliverer.run(drain=drain)
        finally:
            # Called from code (call_command), the caller's handlers come back.
            for number, handler in previous.items():
                signal.signal(number, handler)
        self._say(self.style.SUCCESS(f"Done: {summary.line()}."))

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
        self.stdout.write(line)
        self.stdout.flush()

    def _install_signals(self, deliverer: Deliverer) -> dict[int, Any]:
        if threading.current_thread() is not threading.main_thread():
            return {}

        def stop(number: int, frame: FrameType | None) -> None:
            if deliverer.stopping:
                # A second signal: the operator means it.
                os._exit(128 + number)
            self.stderr.write("Stopping: finishing what is in flight (again to exit at once).")
            deliverer.stop()

        return {number: signal.signal(number, stop) for number in (signal.SIGTERM, signal.SIGINT)}
