"""``manage.py demo``: a fan-out to local inboxes that check signatures, end to end.

Starts inbox servers on loopback addresses, queues a few hundred deliveries
with ``django_federation_delivery.send``, drains them with ``run_deliverer
--drain`` (again for the retries), and reports what each inbox saw and how
every delivery ended.
"""

from __future__ import annotations

import datetime as dt
import io
import ipaddress
import signal
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from django.conf import settings
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import transaction
from django.db.models import Count, Min
from django.test.utils import override_settings
from django.utils import timezone

from django_federation_delivery import BatchOptions, send, send_batch
from django_federation_delivery.conf import app_settings
from django_federation_delivery.models import Batch, Delivery, Status
from federation_demo.inbox import Behaviour, InboxServer
from federation_demo.keys import ALICE, BOB

#: The servers: an address each, and how each answers (None: nothing listens).
PLAN: list[tuple[str, Behaviour | None]] = [
    ("127.0.0.2", Behaviour.ACCEPT),
    ("127.0.0.3", Behaviour.ACCEPT),
    ("127.0.0.4", Behaviour.ACCEPT),
    ("127.0.0.5", Behaviour.UNAVAILABLE_ONCE),
    ("127.0.0.6", Behaviour.GONE),
    ("127.0.0.7", None),
]
DESCRIPTIONS = {
    Behaviour.ACCEPT: "accepts: 202",
    Behaviour.UNAVAILABLE_ONCE: "down: 503 to 12, then 202",
    Behaviour.GONE: "gone: 410",
    Behaviour.BAD_REQUEST: "always 400",
    None: "closed port: refused",
}
#: Retries 1 s, then 2 s apart, and a breaker that cools off in a second,
#: so the demo ends in seconds.
DEMO_RETRY = {"BASE": 1.0, "CAP": 2.0, "ATTEMPTS": 10, "JITTER": 0.25, "SCHEDULE": None}
DEMO_BREAKER = {"THRESHOLD": 10, "COOL_OFF": 1.0, "SCOPE": "host"}
#: The longest the demo waits for retries before it reports anyway.
RETRY_BUDGET_SECONDS = 30.0
MAX_DRAINS = 100
#: The fan-out's deadline.
DEADLINE = dt.timedelta(seconds=8)


class Command(BaseCommand):
    help = (
        "Deliver a signed fan-out to local inbox servers (one slow to start, one gone, "
        "one not listening) and report what happened. Needs "
        "FEDERATION_DELIVERY_ALLOWED_NETWORKS=127.0.0.0/8."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--inboxes", type=int, default=300, help="How many inboxes the fan-out goes to."
        )

    def handle(self, *args: Any, **options: Any) -> None:
        inboxes = int(options["inboxes"])
        if inboxes < len(PLAN):
            raise CommandError(f"--inboxes must be at least {len(PLAN)}")
        loopback = ipaddress.ip_address("127.0.0.2")
        if not any(loopback in network for network in app_settings.allowed_networks()):
            raise CommandError(
                "Deliveries to loopback are not allowed, so every one would be refused. "
                "Run with FEDERATION_DELIVERY_ALLOWED_NETWORKS=127.0.0.0/8 "
                "(scripts/demo does)."
            )
        demo_settings = {
            **settings.FEDERATION_DELIVERY,
            "RETRY": DEMO_RETRY,
            "BREAKER": DEMO_BREAKER,
        }
        with _servers() as servers, override_settings(FEDERATION_DELIVERY=demo_settings):
            batches = self._queue(servers, inboxes)
            self._drain(batches)
            self._report(servers, batches)

    def _queue(self, servers: list[tuple[str, InboxServer | None]], count: int) -> list[Batch]:
        netlocs = [netloc for netloc, _ in servers]
        inboxes = [
            f"http://{netlocs[n % len(netlocs)]}/users/u{n}/inbox" for n in range(1, count + 1)
        ]
        note = {
            "@context": "https://www.w3.org/ns/activitystreams",
            "id": f"{ALICE}/statuses/{int(time.time())}/activity",
            "type": "Create",
            "actor": ALICE,
            "to": ["https://www.w3.org/ns/activitystreams#Public"],
            "object": {"type": "Note", "attributedTo": ALICE, "content": "Hello, fediverse!"},
        }
        # Queued in the caller's transaction: had it rolled back, nothing would be sent.
        with transaction.atomic():
            # A deadline, so that what cannot get through (the closed port)
            # is given up in seconds rather than after the whole retry policy.
            fan_out = send_batch(
                ALICE, note, inboxes, BatchOptions(tag="demo-fan-out", deadline=DEADLINE)
            )
        follow = {
            "@context": "https://www.w3.org/ns/activitystreams",
            "id": f"{BOB}#follows/{int(time.time())}",
            "type": "Follow",
            "actor": BOB,
            "object": ALICE,
        }
        small = send(BOB, follow, inboxes[:3])
        batches = [batch for batch in (fan_out, small) if batch is not None]
        self.stdout.write(
            f"Queued {len(inboxes)} deliveries from {ALICE} and 3 from {BOB}, "
            f"to {len(servers)} hosts."
        )
        return batches

    def _drain(self, batches: list[Batch]) -> None:
        """Drain with progress, then drain again as the retries come due.

        ``run_deliverer --drain`` stops once nothing is due *now*; a delivery
        waiting for its retry, or held by an open circuit breaker, needs
        another drain once it is due. Those later drains print one line each.
        """
        pending = Delivery.objects.filter(batch__in=batches, status=Status.PENDING)
        stop_at = time.monotonic() + RETRY_BUDGET_SECONDS
        self.stdout.write(self.style.MIGRATE_HEADING("\nrun_deliverer --drain"))
        _run_deliverer(self.stdout)
        left = pending.count()
        if left:
            self.stdout.write(
                self.style.MIGRATE_HEADING(
                    f"\n{_deliveries(left)} wait for a retry or an open breaker: "
                    "draining again as they come due"
                )
            )
        for _ in range(MAX_DRAINS):
            if not left:
                return
            next_due = pending.aggregate(at=Min("due_at"))["at"]
            wait = max(0.0, (next_due - timezone.now()).total_seconds()) if next_due else 0.0
            if time.monotonic() + wait > stop_at:
                break
            time.sleep(wait + 0.05)
            out = io.StringIO()
            _run_deliverer(out)
            done = [line for line in out.getvalue().splitlines() if line.startswith("Done")]
            before, left = left, pending.count()
            if left != before:  # drains that only held something back say nothing new
                self.stdout.write(
                    f"  {done[-1] if done else out.getvalue().strip()}  ({left} left)"
                )
        self.stdout.write(
            self.style.WARNING(f"{_deliveries(pending.count())} still pending a retry.")
        )

    def _report(self, servers: list[tuple[str, InboxServer | None]], batches: list[Batch]) -> None:
        write = self.stdout.write
        write(self.style.MIGRATE_HEADING("\nWhat each inbox server saw"))
        write(f"  {'server':<22}{'behaves':<33}{'requests':>9}{'verified':>10}  answered")
        received = verified = 0
        refusals: dict[str, int] = {}
        for netloc, server in servers:
            if server is None:
                write(f"  {netloc:<22}{DESCRIPTIONS[None]:<33}{'-':>9}{'-':>10}  -")
                continue
            stats = server.stats
            received += stats.received
            verified += stats.verified
            for reason, times in stats.refusals.items():
                refusals[reason] = refusals.get(reason, 0) + times
            answered = ", ".join(f"{n}x {status}" for status, n in sorted(stats.answers.items()))
            write(
                f"  {netloc:<22}{DESCRIPTIONS[server.behaviour]:<33}"
                f"{stats.received:>9}{stats.verified:>10}  {answered or '-'}"
            )
        if received and received == verified:
            write(self.style.SUCCESS(f"  All {received} signatures and digests verified."))
        for reason, times in sorted(refusals.items()):
            write(self.style.ERROR(f"  {times}x refused with 401: {reason}"))

        deliveries = Delivery.objects.filter(batch__in=batches)
        write(self.style.MIGRATE_HEADING("\nDeliveries by status"))
        for row in deliveries.values("status").annotate(count=Count("id")).order_by("status"):
            example = ""
            if row["status"] != Status.DELIVERED:
                error = (
                    deliveries.filter(status=row["status"])
                    .exclude(last_error="")
                    .values_list("last_error", flat=True)
                    .first()
                )
                example = f"  (e.g. {error})" if error else ""
            write(f"  {row['status']:<10}{row['count']:>5}{example}")


@contextmanager
def _servers() -> Iterator[list[tuple[str, InboxServer | None]]]:
    """The plan's servers as (host:port, server or None), stopped on the way out.

    Where only 127.0.0.1 can be bound (macOS by default), every server listens
    there on a port of its own instead.
    """
    started: list[tuple[str, InboxServer | None]] = []
    try:
        for host, behaviour in PLAN:
            address = _bindable(host)
            if behaviour is None:
                started.append((f"{address}:{_closed_port(address)}", None))
                continue
            inbox = InboxServer(address, behaviour)
            started.append((inbox.netloc, inbox))
        yield started
    finally:
        for _, server in started:
            if server is not None:
                server.stop()


def _deliveries(count: int) -> str:
    return f"{count} delivery" if count == 1 else f"{count} deliveries"


def _bindable(host: str) -> str:
    try:
        with socket.socket() as probe:
            probe.bind((host, 0))
    except OSError:
        return "127.0.0.1"
    return host


def _closed_port(host: str) -> int:
    """A port nothing listens on: bound for a moment, then let go."""
    with socket.socket() as probe:
        probe.bind((host, 0))
        port: int = probe.getsockname()[1]
    return port


def _run_deliverer(stdout: Any) -> None:
    """``run_deliverer --drain``, leaving Ctrl-C as it was once it is done
    (the command takes SIGINT and SIGTERM over while it runs)."""
    handlers = {number: signal.getsignal(number) for number in (signal.SIGINT, signal.SIGTERM)}
    try:
        call_command("run_deliverer", "--drain", stdout=stdout)
    finally:
        for number, handler in handlers.items():
            signal.signal(number, handler)
