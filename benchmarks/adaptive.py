"""Adaptive per-host concurrency against fixed limits: a big host beside a small one.

Two hosts, each an HTTP server in a process of its own on loopback:

- the *big* one answers every request in ``--big-ms`` (40 ms), however many
  come at once: a large instance far away, where requests in flight are
  what throughput is made of;
- the *small* one works one request at a time, ``--small-ms`` (15 ms)
  each, so its answer time grows with the requests in flight, and it
  answers ``503`` to any request that finds as many as its capacity already
  waiting: a small instance that sheds load. Two are run, one after the
  other: with a capacity of 3 (today's default limit of 2 never overloads
  it) and of 1 (it does).

Each round queues ``--big`` (300) deliveries to the big host and ``--small`` (80) to the
small one, interleaved, and runs a deliverer until every one is delivered:
with the limit adapting (``PER_HOST`` 2 to ``PER_HOST_MAX`` 8, the defaults)
and with each fixed limit (``PER_HOST`` = ``PER_HOST_MAX`` = 1, 2, 4, 8).
A 503 is retried after 0.2 s (``RETRY`` base), and a breaker cools off in
2 s, so that a round measures the limits, not the retry schedule.

Printed: for each, the median seconds to deliver everything, its rate, the
ratio of the adaptive rate to it, the 503s the small host answered, and the
connections the big host accepted (a new one is a TCP and TLS handshake
away from a real instance).

    .venv/bin/python benchmarks/adaptive.py [--rounds 3] [--database-url URL]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (
    DelivererThread,
    add_database_and_tmpdir,
    clear_all,
    environment_lines,
    in_workdir,
    load_average,
    make_activity,
    package_fingerprint,
    positive,
    setup_django,
)

BIG, SMALL = "127.0.0.2", "127.0.0.3"
SENDER = "https://social.example/users/alice"  # tests.keys.ALICE
STATUS = "/_status"


def serve(address: str, port: int, ms: float, capacity: int | None, ready: Any) -> None:
    """Answer POSTs as the big host (``capacity`` None) or the small one."""
    lock = threading.Lock()
    worker = threading.Lock()  # the small host's one request at a time
    counts = {"answered": 0, "refused": 0, "waiting": 0, "connections": 0}

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: Any) -> None:
            pass

        def setup(self) -> None:
            super().setup()
            with lock:  # a handler a connection: keep-alive's requests share one
                counts["connections"] += 1

        def _answer(self, status: int, body: bytes = b"") -> None:
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            with lock:
                body = json.dumps(counts).encode()
            self._answer(200, body)

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            if capacity is None:
                time.sleep(ms / 1000)
                with lock:
                    counts["answered"] += 1
                self._answer(202)
                return
            with lock:
                if counts["waiting"] >= capacity:
                    counts["refused"] += 1
                    refuse = True
                else:
                    counts["waiting"] += 1
                    refuse = False
            if refuse:
                self._answer(503)
                return
            with worker:
                time.sleep(ms / 1000)
            with lock:
                counts["waiting"] -= 1
                counts["answered"] += 1
            self._answer(202)

    class Server(ThreadingHTTPServer):
        daemon_threads = True
        request_queue_size = 256

    server = Server((address, port), Handler)
    ready.put(server.server_address[1])
    server.serve_forever()


def counts(address: str, port: int) -> dict[str, int]:
    import http.client

    connection = http.client.HTTPConnection(address, port, timeout=5)
    try:
        connection.request("GET", STATUS)
        return dict(json.loads(connection.getresponse().read()))
    finally:
        connection.close()


def one_round(
    big_port: int, small_port: int, args: argparse.Namespace, start: int, most: int
) -> tuple[float, int, int]:
    """Seconds to deliver everything, the 503s the small host answered, and
    the connections the big one accepted."""
    from django.db import connections as databases

    from django_federation_delivery import send
    from django_federation_delivery.deliverer import Deliverer
    from django_federation_delivery.models import Delivery, Status

    pending = Delivery.objects.filter(status=Status.PENDING)
    clear_all()
    # The small host's share spread evenly among the big one's.
    share = args.small / (args.big + args.small)
    inboxes = []
    big = small = 0
    while big < args.big or small < args.small:
        if small < args.small and (big >= args.big or small < share * (big + small + 1)):
            inboxes.append(f"http://{SMALL}:{small_port}/users/s{small}/inbox")
            small += 1
        else:
            inboxes.append(f"http://{BIG}:{big_port}/users/b{big}/inbox")
            big += 1
    activity = make_activity(SENDER)
    refused_before = counts(SMALL, small_port)["refused"]
    connections_before = counts(BIG, big_port)["connections"]
    sent = threading.Event()
    if args.stream is None:
        send(SENDER, activity, inboxes)
        sent.set()
    runners = [
        DelivererThread(Deliverer(per_host=start, per_host_max=most))
        for _ in range(args.deliverers)
    ]
    for each in runners:
        each.start()
    runner = runners[0]
    if args.stream is not None:

        def stream() -> None:
            # One inbox a send, one send every --stream seconds, while it runs.
            try:
                for n, inbox in enumerate(inboxes):
                    time.sleep(max(0.0, runner.started + n * args.stream - time.monotonic()))
                    send(SENDER, activity, [inbox])
            finally:
                databases.close_all()
                sent.set()

        threading.Thread(target=stream, daemon=True).start()
    total = args.big + args.small
    deadline = time.monotonic() + args.timeout
    while time.monotonic() < deadline:
        if sent.is_set() and not pending.exists():
            break
        time.sleep(0.02)
    seconds = time.monotonic() - runner.started
    for each in runners:
        each.stop(60)
    delivered = Delivery.objects.filter(status=Status.DELIVERED).count()
    if delivered < total:
        print(f"  WARNING: {delivered} of {total} delivered", flush=True)
    # Less the one the count itself came over.
    connections = counts(BIG, big_port)["connections"] - connections_before - 1
    return seconds, counts(SMALL, small_port)["refused"] - refused_before, connections


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=positive, default=3)
    parser.add_argument("--big", type=positive, default=300)
    parser.add_argument("--small", type=positive, default=80)
    parser.add_argument("--big-ms", type=float, default=40.0)
    parser.add_argument("--small-ms", type=float, default=15.0)
    parser.add_argument(
        "--capacities", default="3,1", help="the small hosts' capacities, one run each"
    )
    parser.add_argument(
        "--stream",
        type=float,
        default=None,
        metavar="SECONDS",
        help="send one inbox at a time, this many seconds apart, while the deliverer runs "
        "(default: all in one send before it starts)",
    )
    parser.add_argument(
        "--deliverers",
        type=positive,
        default=1,
        help="deliverers at once, each with limits of its own, as run_deliverer --processes N "
        "runs them (1)",
    )
    parser.add_argument("--timeout", type=float, default=120.0)
    add_database_and_tmpdir(parser)
    args = parser.parse_args()
    return in_workdir("fd-adaptive-", args.tmpdir, lambda workdir: run(workdir, args))


def run(workdir: Path, args: argparse.Namespace) -> int:
    import os

    context = multiprocessing.get_context("spawn")
    ready = context.Queue()
    capacities = [int(value) for value in args.capacities.split(",")]
    servers = [context.Process(target=serve, args=(BIG, 0, args.big_ms, None, ready), daemon=True)]
    servers += [
        context.Process(target=serve, args=(SMALL, 0, args.small_ms, capacity, ready), daemon=True)
        for capacity in capacities
    ]
    ports = []
    for server in servers:
        server.start()
        ports.append(ready.get(timeout=30))
    big_port, *small_ports = ports
    os.environ["FD_SETTINGS_JSON"] = json.dumps(
        {
            "ALLOWED_NETWORKS": ["127.0.0.0/8"],
            "RETRY": {"BASE": 0.2, "CAP": 2.0, "ATTEMPTS": 50, "JITTER": 0.25},
            "BREAKER": {"THRESHOLD": 10, "COOL_OFF": 2.0, "SCOPE": "host"},
        }
    )
    try:
        database = setup_django(workdir, database_url=args.database_url or None)
        print(
            f"adaptive per-host concurrency: a big host ({args.big_ms:g} ms, any number at "
            f"once) beside a small one ({args.small_ms:g} ms each, one at a time, 503 past "
            f"its capacity waiting); {args.big} + {args.small} deliveries a round, "
            + (
                "queued in one send before the deliverer starts"
                if args.stream is None
                else f"one a send, {args.stream * 1000:g} ms apart, while it runs"
            )
        )
        for line in [database, package_fingerprint(), *environment_lines()]:
            print(f"  {line}")
        for capacity, small_port in zip(capacities, small_ports, strict=True):
            report(args, big_port, small_port, capacity)
        return 0
    finally:
        for server in servers:
            server.terminate()
            server.join(5)


def report(args: argparse.Namespace, big_port: int, small_port: int, capacity: int) -> None:
    print(f"\nthe small host's capacity: {capacity}", flush=True)
    limits = [("adaptive 2..8", 2, 8)] + [(f"fixed {n}", n, n) for n in (1, 2, 4, 8)]
    seconds: dict[str, list[float]] = {name: [] for name, *_ in limits}
    refused: dict[str, list[int]] = {name: [] for name, *_ in limits}
    opened: dict[str, list[int]] = {name: [] for name, *_ in limits}
    for number in range(1, args.rounds + 1):
        # Each round runs every limit, in turn, so that the machine's load
        # at one moment falls on all of them alike.
        for name, start, most in limits:
            took, shed, connections = one_round(big_port, small_port, args, start, most)
            seconds[name].append(took)
            refused[name].append(shed)
            opened[name].append(connections)
            print(
                f"  round {number}: {name:<14} {took:7.2f} s  503s {shed:5d}  "
                f"connections to the big host {connections:4d}",
                flush=True,
            )
    total = args.big + args.small
    adaptive = statistics.median(seconds["adaptive 2..8"])
    print(f"\n  load average: {load_average()}")
    print(
        f"  {'limit':<14} {'seconds':>8} {'per s':>8} {'adaptive ×':>11} {'503s':>6} "
        f"{'connections':>12}"
    )
    for name, *_ in limits:
        median = statistics.median(seconds[name])
        print(
            f"  {name:<14} {median:8.2f} {total / median:8.0f} {median / adaptive:11.2f} "
            f"{statistics.median(refused[name]):6.0f} {statistics.median(opened[name]):12.0f}"
        )
    print(
        "  (adaptive ×: how many times the adaptive rate; above 1, adaptive is faster; "
        f"connections: those the big host accepted for its {args.big} deliveries)"
    )


if __name__ == "__main__":
    sys.exit(main())
