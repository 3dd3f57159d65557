#!/usr/bin/env python
"""Webhooks: 1,000 events to three destinations, one of them down for a moment.

Each event is sent with ``send_webhook`` to three destinations, each a small
HTTP server on a loopback address of its own (127.0.0.21 to .23) in a child
process: ``ops``, a Slack-like hook (``slack+http://``, ``{"text": …}``), and
``audit`` and ``billing``, signed JSON verified with the ``standardwebhooks``
library. Every destination receives its events strictly in order, one at a
time: the loop sends the next only once the one before it is settled.

Each round runs two phases, in turns first:

* **with a failing destination**: ``billing`` answers 503 to its first five
  requests, so its first event is retried five times on a short schedule
  (``WEBHOOK_RETRY``, 0.2 s waits) and holds its later events meanwhile;
* **all healthy**: the same three destinations, ``billing`` answering 200
  from the start.

The figure is the time from the deliverer's start (``Deliverer.run()`` in a
thread, as ``run_deliverer`` runs it, on SQLite) until the two healthy
destinations, ``ops`` and ``audit``, have all their events, counted from
``delivery_settled`` in memory; and their ratio between the phases. Each
destination's receiver checks that the events arrived in order, and the
signed ones that each verified. It also prints events/s: the events over the
time until all three destinations had them all. It asserts nothing.

    python benchmarks/webhooks.py [--events 1000] [--rounds 3] [--down-for 5] [--wait 0.2]

See benchmarks/README.rst.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import dataclasses
import json
import multiprocessing
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

if not __package__:  # run as a script: benchmarks/ is on the path, the repository is not
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (
    DelivererThread,
    clear_all,
    environment_lines,
    load_average,
    positive,
    setup_django,
    sigterm_interrupts,
)

#: The destinations: name, kind, address. The last is the one that fails.
DESTINATIONS = [
    ("ops", "slack", "127.0.0.21"),
    ("audit", "json", "127.0.0.22"),
    ("billing", "json", "127.0.0.23"),
]
HEALTHY = ("ops", "audit")
FAILING = "billing"
#: The signing key of the signed-JSON destinations (a benchmark's, not a secret).
SECRET = "whsec_" + base64.b64encode(b"webhook-benchmark-key-32-bytes!!").decode()
EVENT_TYPE = "bench.event"


# --- The receivers, in a child process ----------------------------------------------------------


class Receiver:
    """One destination's server: notes the event number of every request, in
    arrival order, and answers 503 to the first ``down_for``, then 200."""

    def __init__(self, name: str, kind: str, address: str) -> None:
        from standardwebhooks import Webhook

        self.name = name
        self.kind = kind
        self.webhook = Webhook(SECRET) if kind == "json" else None
        self.lock = threading.Lock()
        self.reset(0)
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length)
                headers = {key.lower(): value for key, value in self.headers.items()}
                status = receiver.answer(headers, body)
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer((address, 0), Handler)
        self.server.daemon_threads = True
        self.port = int(self.server.server_address[1])
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def reset(self, down_for: int) -> None:
        with self.lock:
            self.down_for = down_for
            self.requests = 0
            self.answered: dict[int, int] = {}
            #: Event numbers, in arrival order, of the requests answered 200.
            self.accepted: list[int] = []
            self.unverified = 0

    def answer(self, headers: dict[str, str], body: bytes) -> int:
        try:
            if self.webhook is not None:
                n = int(self.webhook.verify(body, headers)["data"]["n"])
            else:
                n = int(json.loads(body)["text"].rsplit("n: ", 1)[1])
        except Exception:  # an unverified or unreadable request: counted, refused
            with self.lock:
                self.requests += 1
                self.unverified += 1
                self.answered[401] = self.answered.get(401, 0) + 1
            return 401
        with self.lock:
            self.requests += 1
            status = 503 if self.requests <= self.down_for else 200
            self.answered[status] = self.answered.get(status, 0) + 1
            if status == 200:
                self.accepted.append(n)
        return status

    def stats(self) -> dict[str, Any]:
        with self.lock:
            return {
                "requests": self.requests,
                "answered": dict(self.answered),
                "accepted": list(self.accepted),
                "unverified": self.unverified,
            }


def serve(conn: Connection) -> None:
    """The child process: the three receivers, driven by messages on ``conn``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops it
    receivers = {name: Receiver(name, kind, address) for name, kind, address in DESTINATIONS}
    conn.send({name: receiver.port for name, receiver in receivers.items()})
    while True:
        try:
            message = conn.recv()
        except EOFError:
            return
        if message[0] == "reset":
            for name, receiver in receivers.items():
                receiver.reset(message[1].get(name, 0))
            conn.send(True)
        elif message[0] == "stats":
            conn.send({name: receiver.stats() for name, receiver in receivers.items()})
        else:
            return


class Receivers:
    """The child process serving the three destinations."""

    def __init__(self) -> None:
        context = multiprocessing.get_context("spawn")
        self.conn, child = context.Pipe()
        self.process = context.Process(target=serve, args=(child,), name="receivers", daemon=True)
        self.process.start()
        if not self.conn.poll(30):
            raise RuntimeError("the receivers did not start")
        self.ports: dict[str, int] = self.conn.recv()

    def urls(self) -> dict[str, str]:
        urls = {}
        for name, kind, address in DESTINATIONS:
            netloc = f"{address}:{self.ports[name]}"
            if kind == "slack":
                urls[name] = f"slack+http://{netloc}/services/T0BENCH/B0BENCH/k3yk3yk3y"
            else:
                urls[name] = f"http://{netloc}/hooks/{name}?secret={SECRET}"
        return urls

    def reset(self, down_for: dict[str, int]) -> None:
        self.conn.send(("reset", down_for))
        self.conn.recv()

    def stats(self) -> dict[str, dict[str, Any]]:
        self.conn.send(("stats",))
        stats: dict[str, dict[str, Any]] = self.conn.recv()
        return stats

    def stop(self) -> None:
        if self.process.is_alive():
            with contextlib.suppress(OSError):
                self.conn.send(("stop",))
            self.process.join(5)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(5)


# --- One phase ----------------------------------------------------------------------------------


@dataclasses.dataclass
class Phase:
    failing: bool
    #: Seconds from the deliverer's start until each destination had all its
    #: events; None: not in time.
    finished: dict[str, float | None]
    stats: dict[str, dict[str, Any]]
    #: Attempts of the failing destination's first event.
    first_attempts: int
    queue_seconds: float
    cpu: float
    events: int
    note: str = ""

    @property
    def healthy(self) -> float | None:
        times = [self.finished[name] for name in HEALTHY]
        return None if None in times else max(t for t in times if t is not None)

    @property
    def total(self) -> float | None:
        times = list(self.finished.values())
        return None if None in times else max(t for t in times if t is not None)

    @property
    def rate(self) -> float:
        return self.events / self.total if self.total else 0.0

    @property
    def cpu_per_delivery(self) -> float:
        """Milliseconds of this process's CPU per delivery: what a busy machine
        disturbs less than the times."""
        return 1000 * self.cpu / max(1, len(DESTINATIONS) * self.events)

    def in_order(self, name: str) -> bool:
        return bool(self.stats[name]["accepted"] == list(range(self.events)))

    def lines(self, timeout: float) -> list[str]:
        def seconds(value: float | None) -> str:
            return f"{value:.2f} s" if value is not None else f"> {timeout:.0f} s"

        name = "with a failing destination" if self.failing else "all healthy"
        lines = [
            f"  {name:<27} healthy ones through in {seconds(self.healthy)}, all three in "
            f"{seconds(self.total)} ({self.rate:.1f} events/s, {3 * self.rate:.1f} "
            f"deliveries/s, {self.cpu_per_delivery:.2f} ms CPU each); queued in "
            f"{self.queue_seconds:.1f} s{self.note}"
        ]
        for destination, kind, _ in DESTINATIONS:
            stats = self.stats[destination]
            answered = ", ".join(f"{n}x {s}" for s, n in sorted(stats["answered"].items()))
            checked = (
                f"{stats['requests'] - stats['unverified']}/{stats['requests']} verified"
                if kind == "json"
                else f"{stats['requests'] - stats['unverified']}/{stats['requests']} readable"
            )
            tries = self.first_attempts
            first = (
                f", its first event took {tries} attempt{'' if tries == 1 else 's'}"
                if destination == FAILING
                else ""
            )
            lines.append(
                f"    {destination:<8} {seconds(self.finished[destination]):>9}  in order: "
                f"{'yes' if self.in_order(destination) else 'no'}  "
                f"{len(stats['accepted'])} accepted  {answered}  {checked}{first}"
            )
        return lines


def run_phase(
    args: argparse.Namespace, receivers: Receivers, urls: dict[str, str], *, failing: bool
) -> Phase:
    from django.conf import settings
    from django.db import transaction
    from django.test import override_settings

    from django_federation_delivery import send_webhook, signals
    from django_federation_delivery.deliverer import Deliverer
    from django_federation_delivery.models import Delivery
    from django_federation_delivery.webhooks.destinations import delivery_key

    clear_all()
    receivers.reset({FAILING: args.down_for} if failing else {})
    names = [name for name, _, _ in DESTINATIONS]
    options = {
        **settings.FEDERATION_DELIVERY,
        "WEBHOOKS": urls,
        "WEBHOOK_RETRY": [args.wait] * 8,
    }
    with override_settings(FEDERATION_DELIVERY=options):
        started = time.monotonic()
        with transaction.atomic():
            for n in range(args.events):
                send_webhook(names, EVENT_TYPE, {"n": n})
        queue_seconds = time.monotonic() - started

        # Counted as the coordinator settles them: no query.
        delivered = dict.fromkeys(names, 0)
        finished: dict[str, float | None] = dict.fromkeys(names)
        lock = threading.Lock()
        everything = threading.Event()

        def count(sender: Any, settled: signals.Settled, **kwargs: Any) -> None:
            if settled.outcome != "delivered" or settled.destination not in delivered:
                return
            with lock:
                delivered[settled.destination] += 1
                if delivered[settled.destination] == args.events:
                    finished[settled.destination] = time.monotonic()
                    if all(finished.values()):
                        everything.set()

        signals.delivery_settled.connect(count, weak=False, dispatch_uid="webhooks-count")
        runner = DelivererThread(Deliverer(concurrency=args.concurrency))
        cpu = time.process_time()
        note = ""
        try:
            runner.start()
            deadline = runner.started + args.timeout
            while not everything.wait(0.2):
                if time.monotonic() > deadline or not runner.alive():
                    break
        finally:
            stopped = runner.stop(timeout=60)
            signals.delivery_settled.disconnect(dispatch_uid="webhooks-count")
        cpu = time.process_time() - cpu
        if runner.error is not None:
            note += f"   WARNING: the deliverer raised {runner.error!r}"
        if not stopped:
            note += "   WARNING: the deliverer did not stop within 60 s"
        first = (
            Delivery.objects.filter(host=delivery_key(FAILING))
            .order_by("id")
            .values_list("attempts", flat=True)
            .first()
        )
    stats = receivers.stats()
    clear_all()
    return Phase(
        failing=failing,
        finished={
            name: (at - runner.started) if at is not None else None for name, at in finished.items()
        },
        stats=stats,
        first_attempts=first or 0,
        queue_seconds=queue_seconds,
        cpu=cpu,
        events=args.events,
        note=note,
    )


# --- The run ------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="1,000 events to three webhook destinations, one answering 503 at first: "
        "how long the healthy ones take, with it and without. Prints figures; asserts nothing."
    )
    parser.add_argument("--events", type=positive, default=1000, help="events (1000)")
    parser.add_argument("--rounds", type=positive, default=3, help="rounds (3)")
    parser.add_argument(
        "--down-for",
        type=positive,
        default=5,
        help="requests the failing destination answers 503 before it accepts (5)",
    )
    parser.add_argument(
        "--wait", type=float, default=0.2, help="seconds between a webhook's tries (0.2)"
    )
    parser.add_argument("--concurrency", type=positive, default=16, help="CONCURRENCY (16)")
    parser.add_argument(
        "--timeout",
        type=float,
        default=300.0,
        help="seconds a phase may take from the deliverer's start, at most (300)",
    )
    parser.add_argument("--tmpdir", default=None, help="where the temp dir (SQLite file) goes")
    args = parser.parse_args(argv)
    if not 0 < args.wait <= 60:
        parser.error("--wait: above 0 and at most 60 seconds")
    if args.down_for > 8:
        parser.error("--down-for: at most 8 (the schedule has nine tries)")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, sigterm_interrupts)
    workdir = Path(tempfile.mkdtemp(prefix="fd-webhooks-", dir=args.tmpdir))
    receivers: Receivers | None = None
    try:
        receivers = Receivers()
        return benchmark(args, workdir, receivers)
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    finally:
        if receivers is not None:
            receivers.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def benchmark(args: argparse.Namespace, workdir: Path, receivers: Receivers) -> int:
    database = setup_django(workdir, database_url=None)

    from django_federation_delivery.deliverer import Deliverer

    urls = receivers.urls()
    probe = Deliverer(concurrency=args.concurrency)
    print("django-federation-delivery webhooks: three destinations, one down for a moment")
    print(
        f"  {args.events} events, each to {len(DESTINATIONS)} destinations, strictly in order "
        f"to each; rounds {args.rounds}"
    )
    kinds = {"slack": "Slack-like (slack+http)", "json": "signed JSON (standardwebhooks)"}
    for name, kind, address in DESTINATIONS:
        role = (
            f"503 to its first {args.down_for} requests, then 200 (in the phase with a "
            "failing destination)"
            if name == FAILING
            else "200"
        )
        print(f"    {name:<8} {kinds[kind]:<31} {address}:{receivers.ports[name]}  {role}")
    print(
        f"  WEBHOOK_RETRY {args.wait:g} s x 8; concurrency {probe.concurrency}, per_host "
        f"{probe.per_host} (a destination takes one at a time: strict order)"
    )
    for line in environment_lines():
        print(f"  {line}")
    print(f"  database: {database}")
    print("  receivers: a child process, one ThreadingHTTPServer each")
    print(f"  a phase stops after {args.timeout:.0f} s at most", flush=True)
    print()

    rounds: list[dict[bool, Phase]] = []
    for number in range(1, args.rounds + 1):
        order = (True, False) if number % 2 else (False, True)
        names = " then ".join("failing" if failing else "healthy" for failing in order)
        print(f"round {number} ({names})", flush=True)
        phases: dict[bool, Phase] = {}
        for failing in order:
            phases[failing] = run_phase(args, receivers, urls, failing=failing)
            for line in phases[failing].lines(args.timeout):
                print(line, flush=True)
        rounds.append(phases)

    report(args, rounds)
    return 0


def report(args: argparse.Namespace, rounds: list[dict[bool, Phase]]) -> None:
    def seconds(value: float | None) -> str:
        return f"{value:.2f}" if value is not None else f">{args.timeout:.0f}"

    def value(phase: Phase) -> float:
        return phase.healthy if phase.healthy is not None else float("inf")

    print()
    print(
        f"events={args.events}  destinations={len(DESTINATIONS)}  down for {args.down_for}  "
        f"wait {args.wait:g} s  (seconds until ops and audit had every event)"
    )
    header = (
        f"{'round':<7}{'failing':>10}{'healthy':>10}{'ratio':>8}"
        f"{'events/s f':>12}{'events/s h':>12}{'cpu ms f/h':>13}{'in order':>10}"
    )
    print(header)
    print("-" * len(header))
    for number, phases in enumerate(rounds, 1):
        failing, healthy = phases[True], phases[False]
        ordered = all(p.in_order(name) for p in phases.values() for name, _, _ in DESTINATIONS)
        print(
            f"{number:<7}{seconds(failing.healthy):>10}{seconds(healthy.healthy):>10}"
            f"{value(failing) / value(healthy):>7.3f}x{failing.rate:>12.1f}{healthy.rate:>12.1f}"
            f"{f'{failing.cpu_per_delivery:.2f}/{healthy.cpu_per_delivery:.2f}':>13}"
            f"{'yes' if ordered else 'no':>10}"
        )
    print("-" * len(header))
    failing_median = statistics.median(value(p[True]) for p in rounds)
    healthy_median = statistics.median(value(p[False]) for p in rounds)
    ratio_median = statistics.median(value(p[True]) / value(p[False]) for p in rounds)
    print(
        f"{'median':<7}{failing_median:>10.2f}{healthy_median:>10.2f}{ratio_median:>7.3f}x"
        f"{statistics.median(p[True].rate for p in rounds):>12.1f}"
        f"{statistics.median(p[False].rate for p in rounds):>12.1f}"
    )
    print()
    print(
        f"the healthy destinations with a failing one / without: {ratio_median:.3f}x median "
        f"(ratio of the medians: {failing_median / healthy_median:.3f}x; target <= 1.1x)"
    )
    for name, _, _ in DESTINATIONS:
        ordered = all(p.in_order(name) for phases in rounds for p in phases.values())
        print(f"  {name:<8} in order: {'yes' if ordered else 'no'} (every phase of every round)")

    def through(phase: Phase) -> float:
        return phase.finished[FAILING] or float("inf")

    print(
        f"  {FAILING} itself was through in "
        f"{statistics.median(through(p[True]) for p in rounds):.2f} s after its "
        f"{args.down_for} failures ({args.down_for} waits of {args.wait:g} s), in "
        f"{statistics.median(through(p[False]) for p in rounds):.2f} s when healthy (medians)"
    )
    cpu_failing = statistics.median(p[True].cpu_per_delivery for p in rounds)
    cpu_healthy = statistics.median(p[False].cpu_per_delivery for p in rounds)
    print(
        f"CPU per delivery (this process, the receivers apart): {cpu_failing:.2f} ms with a "
        f"failing destination, {cpu_healthy:.2f} ms all healthy (medians)"
    )
    print(f"load average at the end: {load_average()}")
    problems = [
        f"round {number} {'with a failing destination' if failing else 'all healthy'}:{p.note}"
        for number, phases in enumerate(rounds, 1)
        for failing, p in phases.items()
        if p.note
    ]
    for problem in problems:
        print(problem)


if __name__ == "__main__":
    sys.exit(main())
