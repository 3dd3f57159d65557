"""``manage.py demo``: a fan-out to local inboxes that check signatures, end to end.

Starts inbox servers on loopback addresses, queues a few hundred deliveries
with ``django_federation_delivery.send``, drains them with ``run_deliverer
--drain --purge`` (again for the retries) or, with ``--django-q``, has a
running ``qcluster`` deliver them in rounds; and reports what each inbox saw,
how every delivery ended, how long the fan-out took, and what the signal
receivers recorded of each remote server.

Then the webhooks: for each destination configured (``WEBHOOK_<NAME>``) on a
loopback address, a stand-in receiver where it points (a Slack incoming
webhook, or a signed-JSON receiver verifying with ``standardwebhooks``, down
for its first two requests); two alerts raised, then resolved, with
``send_webhook``, drained the same way, and what each destination received,
in order, reported.
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
from urllib.parse import urlsplit

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import transaction
from django.db.models import Count, Max, Min
from django.test.utils import override_settings
from django.utils import timezone
from django.utils.module_loading import import_string

from django_federation_delivery import BatchOptions, send, send_batch, send_webhook
from django_federation_delivery.channels import render_text
from django_federation_delivery.conf import app_settings
from django_federation_delivery.models import Batch, Delivery, Status
from django_federation_delivery.webhooks import (
    Destination,
    Event,
    configured_destinations,
)
from django_federation_delivery.webhooks.destinations import delivery_key
from django_federation_delivery.webhooks.policy import WebhookPolicy
from federation_demo.inbox import Behaviour, InboxServer
from federation_demo.keys import ALICE, BOB, public_keys
from federation_demo.models import RemoteServer
from federation_demo.receivers import (
    KINDS,
    SIGNED_JSON_DOWN_FOR,
    Arrival,
    WebhookReceiver,
    secret_of,
)
from federation_demo.rounds import PING_TASK, ROUND_TASK, demo_settings

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
#: The longest the demo waits for retries before it reports anyway.
RETRY_BUDGET_SECONDS = 30.0
#: --django-q: the longest the cluster may take to run a first task, and to
#: deliver what was queued, before the demo fails saying so.
CLUSTER_START_SECONDS = 60.0
CLUSTER_BUDGET_SECONDS = 60.0
#: --django-q: each round's bound; the next is queued when one ends.
CLUSTER_ROUND_SECONDS = 5.0
MAX_DRAINS = 100
#: The fan-out's deadline: what has not got through by then (the closed
#: port's) is given up. Long enough for the host that answers 503 at first,
#: rested and held by its breaker a while, to take all of its deliveries on
#: a slow, busy machine too: at 8 s, one in two runs gave up part of them.
DEADLINE = dt.timedelta(seconds=15)
#: The webhook events: two alerts raised, then resolved, each to every destination.
ALERTS: list[tuple[str, dict[str, str]]] = [
    ("alert.raised", {"alert": "A-1", "host": "db1", "summary": "disk 91% full"}),
    ("alert.raised", {"alert": "A-2", "host": "web2", "summary": "5xx on 4% of requests"}),
    ("alert.resolved", {"alert": "A-1", "host": "db1"}),
    ("alert.resolved", {"alert": "A-2", "host": "web2"}),
]
ORDINALS = {1: "1st", 2: "2nd", 3: "3rd"}


class Command(BaseCommand):
    help = (
        "Deliver a signed fan-out to local inbox servers (one slow to start, one gone, "
        "one not listening) and report what happened. Needs "
        "FEDERATION_DELIVERY_ALLOWED_NETWORKS=127.0.0.0/8 (and "
        "FEDERATION_DELIVERY_WEBHOOK_ALLOWED_NETWORKS=127.0.0.0/8 for its webhooks)."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--inboxes", type=int, default=300, help="How many inboxes the fan-out goes to."
        )
        parser.add_argument(
            "--django-q",
            action="store_true",
            help="Have a running qcluster deliver (rounds queued with async_task) instead of "
            "run_deliverer in this process (scripts/demo --django-q starts one).",
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
        self.cluster = bool(options["django_q"])
        #: --django-q: the rounds queued, the last maybe still running.
        self.rounds: list[str] = []
        if self.cluster:
            self._wait_for_cluster()
        keys = public_keys()  # the demo's actors, made with their keys if need be
        with _servers(keys) as servers, override_settings(FEDERATION_DELIVERY=demo_settings()):
            batches = self._queue(servers, inboxes)
            self._drain(batches)
            self._report(servers, batches)
            self._webhooks()

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
        if self.cluster:
            self._drain_in_cluster(batches)
        else:
            self._drain_here(batches)

    def _wait_for_cluster(self) -> None:
        """Until a task queued now has run: the cluster is up, and a round
        queued later starts as soon as the broker is polled."""
        if "django_q" not in settings.INSTALLED_APPS:
            raise CommandError(
                '--django-q needs django-q2: pip install "django-federation-delivery[django-q]"'
            )
        async_task, result = (
            import_string("django_q.tasks.async_task"),
            import_string("django_q.tasks.result"),
        )
        self.stdout.write("Waiting for the qcluster to run a first task...")
        started = time.monotonic()
        if result(async_task(PING_TASK), wait=int(CLUSTER_START_SECONDS * 1000)) != "pong":
            raise CommandError(
                f"No qcluster ran a task within {CLUSTER_START_SECONDS:g} s: start one "
                "(python example_project/manage.py qcluster), as scripts/demo --django-q does."
            )
        self.stdout.write(f"  it did, {time.monotonic() - started:.1f} s later.")

    def _drain_in_cluster(self, batches: list[Batch]) -> None:
        """Rounds in the cluster, one after another, until nothing is pending;
        a failure, naming what is left, past CLUSTER_BUDGET_SECONDS."""
        async_task = import_string("django_q.tasks.async_task")
        task_model = import_string("django_q.models.Task")
        pending = Delivery.objects.filter(batch__in=batches, status=Status.PENDING)
        self.stdout.write(
            self.style.MIGRATE_HEADING(
                f"\nqcluster: rounds of {CLUSTER_ROUND_SECONDS:g} s (async_task {ROUND_TASK})"
            )
        )
        stop_at = time.monotonic() + CLUSTER_BUDGET_SECONDS
        rounds = self.rounds
        queued = len(rounds)
        while pending.exists():
            if time.monotonic() > stop_at:
                raise CommandError(
                    f"{_deliveries(pending.count())} still pending after "
                    f"{CLUSTER_BUDGET_SECONDS:g} s of rounds in the qcluster: is it running, "
                    "on this database? (its log says why a round failed)"
                )
            # A round's result is saved when it ends: then the next is queued.
            # (One queued while another runs would return at once: "another
            # round is running".)
            if not rounds or task_model.objects.filter(id=rounds[-1]).exists():
                rounds.append(async_task(ROUND_TASK, CLUSTER_ROUND_SECONDS))
            time.sleep(0.1)
        done = Delivery.objects.filter(batch__in=batches).values("status")
        by_status = ", ".join(
            f"{row['count']} {row['status']}"
            for row in done.annotate(count=Count("id")).order_by("status")
        )
        self.stdout.write(f"  Done, {len(rounds) - queued} more round(s) queued: {by_status}.")

    def _drain_here(self, batches: list[Batch]) -> None:
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

        self._report_timing(batches[0])
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
        self._report_remote_servers()

    def _report_timing(self, fan_out: Batch) -> None:
        """From the send to the first and the last delivery of the fan-out."""
        times = Delivery.objects.filter(batch=fan_out, status=Status.DELIVERED).aggregate(
            first=Min("settled_at"), last=Max("settled_at")
        )
        if times["first"] is None:
            return
        first = (times["first"] - fan_out.created_at).total_seconds()
        last = (times["last"] - fan_out.created_at).total_seconds()
        how = (
            "rounds in a qcluster, started before the send"
            if self.cluster
            else "run_deliverer --drain, started after the send in this process"
        )
        self.stdout.write(self.style.MIGRATE_HEADING("\nFan-out timing"))
        self.stdout.write(
            f"  From the send to the first delivery {first:.2f} s, to the last {last:.2f} s; "
            f"delivered by {how}."
        )

    def _report_remote_servers(self) -> None:
        """The RemoteServer rows the project's signal receivers filled."""
        write = self.stdout.write
        write(
            self.style.MIGRATE_HEADING(
                "\nRemote servers, as the project's signal receivers recorded them"
            )
        )
        write(f"  {'host':<16}{'delivered':>10}{'failures':>10}  {'last failure':<14}gone")
        for server in RemoteServer.objects.all():
            failure = "-"
            if server.last_failure_at is not None:
                failure = str(server.last_failure_status or "no answer")
            gone = "-"
            if server.gone and server.gone_at is not None:
                gone = f"yes, since {server.gone_at:%H:%M:%S}"
            write(
                f"  {server.host:<16}{server.delivered:>10}{server.failures:>10}  "
                f"{failure:<14}{gone}"
            )

    def _webhooks(self) -> None:
        """Events to every local webhook destination configured, drained, and
        what each received, in arrival order."""
        write = self.stdout.write
        write(self.style.MIGRATE_HEADING("\nWebhooks"))
        try:
            configured = configured_destinations()
            policy = WebhookPolicy.from_settings().policy
        except ImproperlyConfigured as exc:  # names the destination, never its URL
            raise CommandError(str(exc)) from None
        local = [d for d in configured.values() if d.kind in KINDS and _on_loopback(d)]
        for destination in configured.values():
            if destination not in local:
                write(
                    f"  {destination.display}: left alone (the demo sends only to Slack or "
                    "signed JSON destinations on a loopback address, to its own stand-ins)"
                )
        if not local:
            write(
                "  No webhook destination on a loopback address is configured: set "
                "WEBHOOK_<NAME> variables (scripts/demo does; see example_project/README.rst)."
            )
            return
        loopback = ipaddress.ip_address("127.0.0.1")
        if not any(loopback in network for network in policy.allowed_networks):
            raise CommandError(
                "Webhook deliveries to loopback are not allowed, so every one would fail. "
                "Run with FEDERATION_DELIVERY_WEBHOOK_ALLOWED_NETWORKS=127.0.0.0/8 "
                "(scripts/demo does)."
            )
        waits = ", ".join(f"{wait:g} s" for wait in policy.schedule)
        write(f"  Destinations from WEBHOOK_<NAME>; retried after {waits} (WEBHOOK_RETRY).")
        with _receivers(local) as receivers:
            batches = []
            for event_type, data in ALERTS:
                # Each in its own transaction, as an application would send them.
                batch = send_webhook([d.name for d in local], event_type, data)
                assert batch is not None
                batches.append(batch)
            sent = ", ".join(f"{event_type} {data['alert']}" for event_type, data in ALERTS)
            write(f"Queued {len(batches)} events for {len(local)} destinations: {sent}.")
            self._drain(batches)
            self._report_webhooks(receivers, batches)

    def _report_webhooks(self, receivers: list[WebhookReceiver], batches: list[Batch]) -> None:
        write = self.stdout.write
        write(self.style.MIGRATE_HEADING("\nWhat each webhook destination received"))
        events = [Event.read(batch.body) for batch in batches]
        for receiver in receivers:
            destination = receiver.destination
            write(f"  {destination.display} at {receiver.netloc}: {receiver.behaviour}")
            write(
                f"    {'arrived':<9}{'event':<16}{'alert':<7}{'check':<13}{'attempts':>8}  answered"
            )
            rows = {
                row.batch_id: row
                for row in Delivery.objects.filter(
                    batch__in=batches, host=delivery_key(destination.name)
                )
            }
            # Which queued event each request was: by its id, or for Slack by its text.
            keys = [_arrival_key(destination, event) for event in events]
            arrivals = list(receiver.arrivals)
            accepted = [keys.index(key) for key in map(_key, receiver.accepted()) if key in keys]
            for place, index in enumerate(accepted, 1):
                event, row = events[index], rows.get(batches[index].id)
                answered = [a for a in arrivals if _key(a) == keys[index]]
                write(
                    f"    {ORDINALS.get(place, f'{place}th'):<9}{event.type:<16}"
                    f"{event.data['alert']:<7}{answered[-1].check:<13}"
                    f"{row.attempts if row else '-':>8}  "
                    + ", ".join(str(a.status) for a in answered)
                )
            in_order = accepted == list(range(len(events)))
            checked = sum(a.ok for a in arrivals)
            summary = (
                f"    in order: {'yes' if in_order else 'NO'}; {len(accepted)} of {len(events)} "
                f"events accepted; {checked} of {len(arrivals)} requests "
                + ("verified" if destination.kind == "json" else "well-formed")
            )
            style = (
                self.style.SUCCESS if in_order and checked == len(arrivals) else self.style.ERROR
            )
            write(style(summary))
            for arrival in arrivals:
                if not arrival.ok:
                    write(self.style.ERROR(f"    {arrival.status}: {arrival.check}"))
            if destination.kind != "json":
                for index in accepted[:2]:
                    write(f"    e.g. {keys[index]}")
        deliveries = Delivery.objects.filter(batch__in=batches)
        by_status = ", ".join(
            f"{row['status']} {row['count']}"
            for row in deliveries.values("status").annotate(count=Count("id")).order_by("status")
        )
        write(f"  Webhook deliveries by status: {by_status}")


def _arrival_key(destination: Destination, event: Event) -> str:
    """What identifies ``event`` among the requests ``destination`` received."""
    if destination.kind == "json":
        return event.id
    return render_text(destination, event)


def _key(arrival: Arrival) -> str:
    return arrival.event_id or arrival.text


def _on_loopback(destination: Destination) -> bool:
    try:
        return ipaddress.ip_address(urlsplit(destination.url).hostname or "").is_loopback
    except ValueError:
        return False


@contextmanager
def _receivers(destinations: list[Destination]) -> Iterator[list[WebhookReceiver]]:
    """A stand-in where each destination points, stopped on the way out."""
    started: list[WebhookReceiver] = []
    try:
        for destination in destinations:
            try:
                receiver = WebhookReceiver(
                    destination,
                    secret=secret_of(str(app_settings.get("WEBHOOKS")[destination.name])),
                    down_for=SIGNED_JSON_DOWN_FOR if destination.kind == "json" else 0,
                )
            except OSError as exc:
                # Its host and port: never a user and password it may hold.
                host = urlsplit(destination.url).netloc.rpartition("@")[2]
                raise CommandError(
                    f"Cannot start the stand-in for {destination.display} on {host}: "
                    f"{exc.strerror}."
                ) from None
            started.append(receiver)
        yield started
    finally:
        for receiver in started:
            receiver.stop()


@contextmanager
def _servers(keys: dict[str, str]) -> Iterator[list[tuple[str, InboxServer | None]]]:
    """The plan's servers as (host:port, server or None), each knowing the
    actors' public ``keys``, stopped on the way out.

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
            inbox = InboxServer(address, keys, behaviour)
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
    """``run_deliverer --drain --purge``, leaving Ctrl-C as it was once it is
    done (the command takes SIGINT and SIGTERM over while it runs). A
    deployment runs ``run_deliverer --purge``: the purge thread deletes what
    is past RETENTION, first a minute after the start, then hourly."""
    handlers = {number: signal.getsignal(number) for number in (signal.SIGINT, signal.SIGTERM)}
    try:
        call_command("run_deliverer", "--drain", "--purge", stdout=stdout)
    finally:
        for number, handler in handlers.items():
            signal.signal(number, handler)
