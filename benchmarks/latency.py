#!/usr/bin/env python
"""Latency: a direct message queued behind a big fan-out, with the priority lane and without.

Each phase queues a fan-out to N inboxes (30,000 by default) with ``send()``,
over H hosts of a fast sink (nginx answering 202), starts a deliverer in a
thread (not drain: as ``run_deliverer`` runs), and once it has delivered a
head start of the fan-out (1,000) queues one direct message with ``send()``,
to one inbox on a host of its own: a small HTTP server in this process, on
127.0.0.250, noting when the POST arrives. The figure is the time from just
before that ``send()`` to the arrival, measured on one clock.

Each round runs two phases, in turn first:

* **without the lane**: ``PRIORITY_MAX_INBOXES`` unset. The message waits in
  the normal lane behind what is left of the fan-out (claimed by due time),
  so the figure is about the time the fan-out takes to drain;
* **with the lane**: ``PRIORITY_MAX_INBOXES=5``: the message is claimed
  before the rest of the fan-out; the phase ends when it has arrived.

With ``--answer-ms MS`` the fan-out's hosts answer each request after MS
milliseconds (Python servers in a process of their own instead of nginx):
servers that are each a little slow, where one claim of the fan-out keeps
every slot busy for rounds, which is where a message could wait behind what
the deliverer had already claimed.

With ``--webhook`` the message of the phases with the lane is a webhook
event instead, sent with ``send_webhook()`` to a signed JSON destination at
the same recipient: webhooks have a lane of their own, whatever
``PRIORITY_MAX_INBOXES`` says. ``--database-url`` runs it on a (throwaway)
PostgreSQL instead of SQLite.

It prints each latency, their medians side by side and their ratio, and the
fan-out's rate. It asserts nothing.

    python benchmarks/latency.py [--fan-out 30000] [--hosts 100] [--rounds 3]
        [--head-start 1000] [--concurrency 16] [--per-host 2] [--priority-max 5]
        [--answer-ms 0] [--webhook] [--database-url postgres://…]

See benchmarks/README.rst.
"""

from __future__ import annotations

import argparse
import dataclasses
import http.server
import math
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

if not __package__:  # run as a script: benchmarks/ is on the path, the repository is not
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (
    FIRST_HOST,
    DelivererThread,
    Sink,
    clear_all,
    environment_lines,
    free_port,
    keepalive_check,
    load_average,
    make_activity,
    positive,
    setup_django,
    sigterm_interrupts,
)

#: Where the direct message goes: a host of its own, not one of the sink's.
RECIPIENT_ADDRESS = "127.0.0.250"
#: The signing key of the webhook destination (``--webhook``).
WEBHOOK_SECRET = "whsec_QUJDREVGR0hJSktMTU5PUFFSU1RVVldYWVo0NTY3ODk="


# --- The recipient of the direct message ------------------------------------------------------


class Recipient:
    """A small HTTP server in this process that answers 202 and notes when
    each POST arrived (``time.monotonic()``, the clock the sender is timed on)."""

    def __init__(self, address: str = RECIPIENT_ADDRESS) -> None:
        arrivals: dict[str, float] = {}
        arrived = threading.Condition()

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                now = time.monotonic()  # the request line and headers are in
                length = int(self.headers.get("Content-Length") or 0)
                self.rfile.read(length)
                self.send_response(202)
                self.send_header("Content-Length", "0")
                self.end_headers()
                with arrived:
                    arrivals.setdefault(self.path, now)
                    arrived.notify_all()

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.arrivals = arrivals
        self._arrived = arrived
        self.server = http.server.ThreadingHTTPServer((address, 0), Handler)
        self.server.daemon_threads = True
        self.address = address
        self.port = int(self.server.server_address[1])
        self._thread = threading.Thread(
            target=self.server.serve_forever, name="recipient", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        if self._thread.is_alive():
            self.server.shutdown()
        self.server.server_close()

    def url(self, path: str) -> str:
        return f"http://{self.address}:{self.port}{path}"

    def wait(self, path: str, deadline: float, stop: Callable[[], bool]) -> float | None:
        """When ``path`` was POSTed to, waiting until ``deadline`` (monotonic),
        or None; ``stop`` says to give up early (the deliverer died)."""
        with self._arrived:
            while path not in self.arrivals:
                left = deadline - time.monotonic()
                if left <= 0 or stop():
                    return None
                self._arrived.wait(min(left, 0.5))
            return self.arrivals[path]


# --- Slow hosts (--answer-ms) ------------------------------------------------------------------


def serve_slowly(addresses: Sequence[str], port: int, ms: float, ready: Any) -> None:
    """Answer 202 to every POST after ``ms`` milliseconds, on each of
    ``addresses`` at ``port``: a server a thread, in a process of its own."""

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            time.sleep(ms / 1000)
            self.send_response(202)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, format: str, *args: Any) -> None:
            pass

    class Server(http.server.ThreadingHTTPServer):
        daemon_threads = True
        request_queue_size = 256

    servers = [Server((address, port), Handler) for address in addresses]
    for server in servers:
        threading.Thread(target=server.serve_forever, daemon=True).start()
    ready.put(True)
    threading.Event().wait()


class SlowSink:
    """The fan-out's hosts, each answering after ``ms`` milliseconds: as
    :class:`~benchmarks.common.Sink`'s addresses and URLs, not nginx."""

    def __init__(self, hosts: int, ms: float) -> None:
        self.addresses = [f"127.0.0.{FIRST_HOST + n}" for n in range(hosts)]
        self.ms = ms
        self.port = 0
        self.process: Any = None

    def start(self) -> None:
        import multiprocessing

        context = multiprocessing.get_context("spawn")
        ready = context.Queue()
        self.port = free_port(self.addresses)
        self.process = context.Process(
            target=serve_slowly, args=(self.addresses, self.port, self.ms, ready), daemon=True
        )
        self.process.start()
        ready.get(timeout=60)

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.join(5)

    def url(self, n: int, path: str) -> str:
        return f"http://{self.addresses[n % len(self.addresses)]}:{self.port}{path}"


# --- One phase ----------------------------------------------------------------------------------


@dataclasses.dataclass
class Phase:
    lane: bool
    #: Whether the message was a webhook event (in its own lane), not a direct message.
    webhook: bool
    #: Seconds from just before the message's send() to its arrival; None: not in time.
    latency: float | None
    #: The lane the message was queued in, as written.
    queued_in: str
    #: Fan-out deliveries delivered when the message was queued, and when it arrived.
    ahead_done: int
    done_at_arrival: int
    #: The fan-out's deliveries delivered in the phase, and over how long.
    fan_out_delivered: int
    fan_out_seconds: float
    #: Seconds send() took to queue the fan-out, and the message.
    queue_seconds: float
    send_seconds: float
    cpu: float
    note: str = ""

    @property
    def rate(self) -> float:
        return self.fan_out_delivered / self.fan_out_seconds if self.fan_out_seconds > 0 else 0.0

    def line(self, fan_out: int, timeout: float) -> str:
        name = "webhook" if self.webhook else "with the lane" if self.lane else "without the lane"
        latency = f"{self.latency:8.3f} s" if self.latency is not None else f"> {timeout:.0f} s "
        left = fan_out - self.ahead_done
        return (
            f"  {name:<17} message {latency} (lane {self.queued_in}, queued behind "
            f"{left} of the fan-out, {self.done_at_arrival - self.ahead_done} of them "
            f"delivered before it)   fan-out {self.fan_out_delivered} in "
            f"{self.fan_out_seconds:.1f} s, {self.rate:.1f}/s   "
            f"send() {self.send_seconds * 1000:.0f} ms   "
            f"queued the fan-out in {self.queue_seconds:.1f} s{self.note}"
        )


def run_phase(
    args: argparse.Namespace,
    *,
    lane: bool,
    label: str,
    fan_out: Sequence[str],
    recipient: Recipient,
    activity: dict[str, Any],
    message: dict[str, Any],
) -> Phase:
    from django.conf import settings
    from django.test import override_settings

    from django_federation_delivery import send_webhook, signals
    from django_federation_delivery.deliverer import Deliverer
    from django_federation_delivery.models import Batch
    from django_federation_delivery.sending import send
    from tests.keys import ALICE

    clear_all()
    options = {
        key: value
        for key, value in settings.FEDERATION_DELIVERY.items()
        if key != "PRIORITY_MAX_INBOXES"
    }
    webhook = lane and args.webhook
    path = f"/users/{label}/inbox"
    if webhook:
        options["WEBHOOKS"] = {"alerts": f"{recipient.url(path)}?secret={WEBHOOK_SECRET}"}
    elif lane:
        options["PRIORITY_MAX_INBOXES"] = args.priority_max
    with override_settings(FEDERATION_DELIVERY=options):
        started = time.monotonic()
        batch = send(ALICE, activity, fan_out)
        queue_seconds = time.monotonic() - started
        assert batch is not None
        fan_out_batch = batch.id

        # Counted as the coordinator settles them: no query.
        delivered = 0
        last = 0.0
        all_delivered = threading.Event()

        def count(sender: Any, settled: signals.Settled, **kwargs: Any) -> None:
            nonlocal delivered, last
            if settled.batch_id == fan_out_batch and settled.outcome == "delivered":
                delivered += 1
                last = time.monotonic()
                if delivered >= len(fan_out):
                    all_delivered.set()

        signals.delivery_settled.connect(count, weak=False, dispatch_uid="latency-count")
        runner = DelivererThread(Deliverer(concurrency=args.concurrency, per_host=args.per_host))
        cpu = time.process_time()
        note = ""
        try:
            runner.start()
            deadline = runner.started + args.timeout
            head_start = min(args.head_start, len(fan_out) - 1)
            while delivered < head_start and time.monotonic() < deadline and runner.alive():
                time.sleep(0.005)
            ahead_done = delivered
            queued = time.monotonic()
            if webhook:
                dm = send_webhook("alerts", "alert.raised", {"disk": "full", "label": label})
            else:
                dm = send(ALICE, message, [recipient.url(path)])
            send_seconds = time.monotonic() - queued
            assert dm is not None
            queued_in = str(Batch.objects.values_list("lane", flat=True).get(id=dm.id))
            arrival = recipient.wait(path, deadline, lambda: not runner.alive())
            done_at_arrival = delivered
            latency = None if arrival is None else arrival - queued
            if not lane:
                # What the message waited behind: the fan-out's drain, for its rate.
                all_delivered.wait(max(0.0, deadline - time.monotonic()))
        finally:
            stopped = runner.stop(timeout=60)
            signals.delivery_settled.disconnect(dispatch_uid="latency-count")
        cpu = time.process_time() - cpu
        if runner.error is not None:
            note += f"   WARNING: the deliverer raised {runner.error!r}"
        if not stopped:
            note += "   WARNING: the deliverer did not stop within 60 s"
        if arrival is None:
            note += f"   WARNING: the message had not arrived after {args.timeout:.0f} s"
    clear_all()
    return Phase(
        lane=lane,
        webhook=webhook,
        latency=latency,
        queued_in=queued_in,
        ahead_done=ahead_done,
        done_at_arrival=done_at_arrival,
        fan_out_delivered=delivered,
        fan_out_seconds=(last or time.monotonic()) - runner.started,
        queue_seconds=queue_seconds,
        send_seconds=send_seconds,
        cpu=cpu,
        note=note,
    )


# --- The run ------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="The time from queueing a direct message behind a big fan-out to its "
        "delivery, with the priority lane and without. Prints figures; asserts nothing."
    )
    parser.add_argument("--fan-out", type=positive, default=30_000, help="N inboxes (30000)")
    parser.add_argument("--hosts", type=positive, default=100, help="H sink addresses (100)")
    parser.add_argument("--rounds", type=positive, default=3, help="rounds (3)")
    parser.add_argument(
        "--head-start",
        type=positive,
        default=1000,
        help="fan-out deliveries delivered before the message is queued (1000)",
    )
    parser.add_argument("--concurrency", type=positive, default=16, help="CONCURRENCY (16)")
    parser.add_argument("--per-host", type=positive, default=2, help="PER_HOST (2)")
    parser.add_argument(
        "--priority-max",
        type=positive,
        default=5,
        help="PRIORITY_MAX_INBOXES in the phases with the lane (5)",
    )
    parser.add_argument(
        "--answer-ms",
        type=float,
        default=0.0,
        help="the fan-out's hosts answer after this many ms (Python servers; 0: nginx at once)",
    )
    parser.add_argument(
        "--webhook",
        action="store_true",
        help="with the lane, the message is a webhook event (its own lane), not a direct message",
    )
    parser.add_argument(
        "--database-url",
        default=None,
        help="a THROWAWAY PostgreSQL to run on (its public schema dropped, made again and "
        "migrated); SQLite if not given",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=300.0,
        help="seconds a phase may take from the deliverer's start, at most (300)",
    )
    parser.add_argument(
        "--nginx-workers", default="1", help="nginx worker_processes (1; 'auto' = one per CPU)"
    )
    parser.add_argument(
        "--tmpdir", default=None, help="where the temp dir (SQLite file, nginx) goes"
    )
    args = parser.parse_args(argv)
    if args.hosts > 230:
        parser.error("--hosts: at most 230 (127.0.0.10 … 127.0.0.239)")
    if args.fan_out < 2:
        parser.error("--fan-out: at least 2")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, sigterm_interrupts)
    workdir = Path(tempfile.mkdtemp(prefix="fd-latency-", dir=args.tmpdir))
    sink: Sink | SlowSink = (
        SlowSink(args.hosts, args.answer_ms)
        if args.answer_ms > 0
        else Sink(args.hosts, workdir / "nginx", workers=args.nginx_workers)
    )
    recipient: Recipient | None = None
    try:
        sink.start()
        recipient = Recipient()
        recipient.start()
        return benchmark(args, workdir, sink, recipient)
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    finally:
        if recipient is not None:
            recipient.stop()
        sink.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def benchmark(
    args: argparse.Namespace, workdir: Path, sink: Sink | SlowSink, recipient: Recipient
) -> int:
    database = setup_django(workdir, database_url=args.database_url)

    from django_federation_delivery.deliverer import Deliverer
    from tests.keys import ALICE, sender_key

    sender_key(ALICE)  # the RSA key is made once, here, not in a timed phase
    activity = make_activity(ALICE)
    message = {**make_activity(ALICE), "id": f"{ALICE}/statuses/1/direct", "to": []}
    fan_out = [sink.url(i, f"/users/u{i}/inbox") for i in range(args.fan_out)]
    probe = Deliverer(concurrency=args.concurrency, per_host=args.per_host)

    what = "a webhook event" if args.webhook else "a direct message"
    print(f"django-federation-delivery latency: {what} behind a fan-out")
    print(
        f"  fan-out to N={args.fan_out} inboxes on H={args.hosts} hosts, the message queued "
        f"once {args.head_start} are delivered; rounds {args.rounds}"
    )
    print(
        f"  concurrency {probe.concurrency}, per_host {probe.per_host}, slow after "
        f"{probe.slow_after:g} s (+{probe.slow_concurrency}), claim size {probe.claim_size}; "
        + (
            "with the lane: a webhook event, in the webhook lane"
            if args.webhook
            else f"with the lane: PRIORITY_MAX_INBOXES={args.priority_max}"
        )
    )
    for line in environment_lines():
        print(f"  {line}")
    print(f"  database: {database}")
    if isinstance(sink, Sink):
        ok, sockets, accepted = keepalive_check(sink, b"{}")
        print(
            f"  sink: nginx {sink.version()}, worker_processes {sink.workers}, "
            f"{sink.addresses[0]}…{sink.addresses[-1]} port {sink.port}; keep-alive check "
            f"{ok}/50 on {sockets} socket(s), {accepted} accepted"
        )
    else:
        print(
            f"  sink: Python servers answering after {sink.ms:g} ms, "
            f"{sink.addresses[0]}…{sink.addresses[-1]} port {sink.port}"
        )
    print(f"  the message's recipient: {recipient.url('/…')} (in this process)")
    print(f"  a phase stops after {args.timeout:.0f} s at most", flush=True)
    print()

    rounds: list[dict[bool, Phase]] = []
    for number in range(1, args.rounds + 1):
        order = (False, True) if number % 2 else (True, False)
        names = " then ".join("with" if lane else "without" for lane in order)
        print(f"round {number} ({names} the lane)", flush=True)
        phases: dict[bool, Phase] = {}
        for lane in order:
            phases[lane] = run_phase(
                args,
                lane=lane,
                label=f"dm-{number}-{'lane' if lane else 'nolane'}",
                fan_out=fan_out,
                recipient=recipient,
                activity=activity,
                message=message,
            )
            print(phases[lane].line(args.fan_out, args.timeout), flush=True)
        rounds.append(phases)

    report(args, rounds)
    return 0


def report(args: argparse.Namespace, rounds: list[dict[bool, Phase]]) -> None:
    def seconds(value: float | None) -> str:
        return f"{value:.3f}" if value is not None else f">{args.timeout:.0f}"

    def latency(phase: Phase) -> float:
        # A message that never arrived counts as the phase's bound (a lower bound).
        return phase.latency if phase.latency is not None else math.inf

    print()
    print(
        f"N={args.fan_out}  H={args.hosts}  concurrency={args.concurrency}  "
        f"per_host={args.per_host}  head start {args.head_start}  (seconds from send() to arrival)"
    )
    header = (
        f"{'round':<8}{'order':<15}{'without lane':>14}{'with lane':>12}{'ratio':>10}"
        f"{'fan-out/s':>12}{'left ahead':>12}"
    )
    print(header)
    print("-" * len(header))
    for number, phases in enumerate(rounds, 1):
        without, with_lane = phases[False], phases[True]
        ratio = latency(without) / latency(with_lane)
        order = "without,with" if number % 2 else "with,without"
        print(
            f"{number:<8}{order:<15}{seconds(without.latency):>14}{seconds(with_lane.latency):>12}"
            f"{ratio:>9.0f}x{without.rate:>12.1f}{args.fan_out - without.ahead_done:>12}"
        )
    print("-" * len(header))
    without_median = statistics.median(latency(p[False]) for p in rounds)
    with_median = statistics.median(latency(p[True]) for p in rounds)
    ratio_median = statistics.median(latency(p[False]) / latency(p[True]) for p in rounds)
    rate_median = statistics.median(p[False].rate for p in rounds)
    print(
        f"{'median':<23}{seconds(without_median if math.isfinite(without_median) else None):>14}"
        f"{seconds(with_median if math.isfinite(with_median) else None):>12}"
        f"{ratio_median:>9.0f}x{rate_median:>12.1f}"
    )
    print()
    print(
        f"median latency without the lane / with it: {ratio_median:.0f}x (ratio of the "
        f"medians: {without_median / with_median:.0f}x)"
    )
    left = statistics.median(args.fan_out - p[False].ahead_done for p in rounds)
    print(
        f"without the lane the message waits for the fan-out to drain: {left:.0f} left at "
        f"{rate_median:.1f}/s is {left / rate_median:.1f} s (median rate of the full drains)"
    )
    lane_rates = [p[True].rate for p in rounds]
    print(
        f"fan-out rate: {rate_median:.1f}/s draining (without the lane), "
        f"{statistics.median(lane_rates):.1f}/s until the message arrived (with it)"
    )
    cpu = statistics.median(
        1000 * p[False].cpu / max(1, p[False].fan_out_delivered) for p in rounds
    )
    print(f"CPU per fan-out delivery (without the lane, whole process): {cpu:.2f} ms")
    print(f"load average at the end: {load_average()}")
    problems = [
        f"round {number} {'with' if lane else 'without'} the lane:{phase.note}"
        for number, phases in enumerate(rounds, 1)
        for lane, phase in phases.items()
        if phase.note
    ]
    for problem in problems:
        print(problem)
    if not problems:
        print("every message arrived, and every fan-out without the lane drained, in every round")


if __name__ == "__main__":
    sys.exit(main())
