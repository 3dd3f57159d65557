#!/usr/bin/env python
"""Faults: dead servers should cost the healthy ones nothing.

10,000 deliveries (D=100 to each of H=100 hosts) are queued with ``send()``
and a deliverer is started in a thread (not drain: as ``run_deliverer``
runs), with the package's defaults: CONCURRENCY 16, PER_HOST 2, BREAKER
threshold 10 / cool-off 60 s / scope host, ATTEMPT_TIMEOUT 30 s, slow after
2 s (+32 threads), the default retry policy. Of the hosts

* 75 are healthy: nginx answering 202;
* 20 answer 503 to everything: nginx too, each request logged;
* 5 never answer: a listening socket each in this process, which accepts,
  reads and counts what it is sent, and never writes a byte.

The figure is the time from the deliverer's start until every delivery to a
healthy host has been delivered (**with faults**), against the same run with
only the 7,500 deliveries to the healthy hosts queued (**fault-free**); and the
requests each faulty host received until then, against what the breaker
allows: ``THRESHOLD`` failures open it, at most ``PER_HOST - 1`` more were
already on their way when the last of those came back, then at most one probe
a cool-off.

Once the healthy deliveries are through the deliverer is stopped as SIGTERM
stops ``run_deliverer``; the silent hosts then hang up on what they hold, so
that the attempts still waiting on them end at once (not counted).

    python benchmarks/faults.py [--rounds 3] [--hosts 100] [--deliveries-per-host 100]
        [--failing 20] [--silent 5] [--attempt-timeout SECONDS] [--watch SECONDS]

See benchmarks/README.rst. It prints figures; it asserts nothing.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import math
import random
import selectors
import shutil
import signal
import socket
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
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
    keepalive_check,
    load_average,
    make_activity,
    positive,
    setup_django,
    sigterm_interrupts,
)

FAILING_STATUS = 503


# --- The silent hosts ---------------------------------------------------------------------------


class SilentHosts:
    """A listening socket on each address, on a port of its own, that accepts
    every connection, reads and counts what comes (requests: the ``POST ``s
    that start them) and never answers. One thread serves them all."""

    def __init__(self, addresses: Sequence[str]) -> None:
        self.addresses = list(addresses)
        self.ports: dict[str, int] = {}
        self.connections: collections.Counter[str] = collections.Counter()
        self.requests: collections.Counter[str] = collections.Counter()
        self._selector = selectors.DefaultSelector()
        self._listeners: list[socket.socket] = []
        #: Each open connection: its address, and the last bytes read (a
        #: "POST " split between two reads is still counted, once).
        self._open: dict[socket.socket, tuple[str, bytes]] = {}
        self._lock = threading.Lock()
        self._hanging_up = False
        self._hang_up_now = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="silent-hosts", daemon=True)

    def start(self) -> None:
        for address in self.addresses:
            listener = socket.socket()
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((address, 0))
            listener.listen(4096)
            listener.setblocking(False)
            self.ports[address] = int(listener.getsockname()[1])
            self._listeners.append(listener)
            self._selector.register(listener, selectors.EVENT_READ, address)
        self._thread.start()

    def url(self, address: str, path: str) -> str:
        return f"http://{address}:{self.ports[address]}{path}"

    def counts(self) -> tuple[collections.Counter[str], collections.Counter[str]]:
        """(connections accepted, requests read) by address, so far."""
        with self._lock:
            return collections.Counter(self.connections), collections.Counter(self.requests)

    def hang_up(self, on: bool = True) -> None:
        """On: close every connection held, and each new one as it comes."""
        self._hanging_up = on
        if on:
            self._hang_up_now.set()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)
        for listener in self._listeners:
            listener.close()
        self._listeners.clear()

    def _serve(self) -> None:
        try:
            while not self._stop.is_set():
                for key, _ in self._selector.select(0.1):
                    sock: socket.socket = key.fileobj  # type: ignore[assignment]
                    if sock in self._open:
                        self._read(sock)
                    else:
                        self._accept(sock, key.data)
                if self._hang_up_now.is_set():
                    self._hang_up_now.clear()
                    for sock in list(self._open):
                        self._close(sock)
        finally:
            for sock in list(self._open):
                self._close(sock)
            self._selector.close()

    def _accept(self, listener: socket.socket, address: str) -> None:
        try:
            conn, _ = listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        with self._lock:
            self.connections[address] += 1
        if self._hanging_up:
            conn.close()
            return
        conn.setblocking(False)
        self._open[conn] = (address, b"")
        self._selector.register(conn, selectors.EVENT_READ)

    def _read(self, conn: socket.socket) -> None:
        try:
            data = conn.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._close(conn)  # the client gave up (its attempt timed out)
            return
        address, tail = self._open[conn]
        seen = tail + data
        with self._lock:
            self.requests[address] += seen.count(b"POST ")
        self._open[conn] = (address, seen[-4:])

    def _close(self, conn: socket.socket) -> None:
        self._open.pop(conn, None)
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(conn)
        conn.close()


# --- One phase ----------------------------------------------------------------------------------


@dataclasses.dataclass
class Phase:
    faulty: bool
    healthy: int
    delivered: int
    #: Seconds from the deliverer's start to the last healthy delivery; None: not in time.
    seconds: float | None
    #: This process's CPU seconds until then.
    cpu: float
    #: Requests each failing (503) host answered, and each silent host read,
    #: until every healthy delivery was delivered; and connections the silent ones accepted.
    failing_requests: dict[str, int]
    silent_requests: dict[str, int]
    silent_connections: dict[str, int]
    #: The same, counted until the end of the watch (None: no watch).
    watched: tuple[float, dict[str, int], dict[str, int]] | None
    #: New connections nginx accepted and requests it served until then.
    nginx_connections: int
    nginx_requests: int
    summary: str
    #: The destinations with an open breaker at the end.
    open_breakers: set[str]
    note: str = ""

    @property
    def rate(self) -> float:
        return self.delivered / self.seconds if self.seconds else 0.0

    @property
    def cpu_ms(self) -> float:
        return 1000 * self.cpu / self.delivered if self.delivered else 0.0

    def line(self, timeout: float) -> str:
        name = "with faults" if self.faulty else "fault-free"
        took = f"{self.seconds:6.2f} s" if self.seconds is not None else f"> {timeout:.0f} s"
        text = (
            f"  {name:<12} healthy {self.delivered}/{self.healthy} in {took} "
            f"({self.rate:.1f}/s)   cpu {self.cpu_ms:.2f} ms/delivery   nginx: "
            f"{self.nginx_connections} connections, {self.nginx_requests} requests"
        )
        if self.faulty:
            failing = sum(self.failing_requests.values())
            silent = sum(self.silent_requests.values())
            connections = sum(self.silent_connections.values())
            text += (
                f"   to the faulty hosts: {failing} requests to the {FAILING_STATUS}s, "
                f"{silent} to the silent ones ({connections} connections)"
            )
        return f"{text}\n               deliverer at the end: {self.summary}{self.note}"


@dataclasses.dataclass(frozen=True)
class Layout:
    healthy: list[str]
    failing: list[str]
    silent: list[str]

    def kind(self, host: str) -> str:
        """Which kind of host ``host`` is: an address, or a delivery's host key (with its port)."""
        address = host.partition(":")[0]
        if address in self.failing:
            return str(FAILING_STATUS)
        return "silent" if address in self.silent else "202"


def make_layout(args: argparse.Namespace) -> Layout:
    """Which host is which: faulty ones picked at random (seeded) among all."""
    addresses = [f"127.0.0.{FIRST_HOST + n}" for n in range(args.hosts)]
    picked = random.Random(args.seed).sample(addresses, args.failing + args.silent)
    failing, silent = picked[: args.failing], picked[args.failing :]
    healthy = [address for address in addresses if address not in picked]
    return Layout(healthy=healthy, failing=sorted(failing, key=_octets), silent=sorted(silent))


def _octets(address: str) -> tuple[int, ...]:
    return tuple(int(part) for part in address.split("."))


def run_phase(
    args: argparse.Namespace,
    *,
    faulty: bool,
    inboxes: Sequence[str],
    healthy_inboxes: frozenset[str],
    layout: Layout,
    sink: Sink,
    silent: SilentHosts,
) -> Phase:
    from django.conf import settings
    from django.test import override_settings

    from django_federation_delivery import signals
    from django_federation_delivery.deliverer import Deliverer
    from django_federation_delivery.models import Breaker
    from django_federation_delivery.sending import send
    from tests.keys import ALICE

    clear_all()
    options = dict(settings.FEDERATION_DELIVERY)
    if args.attempt_timeout is not None:
        options["ATTEMPT_TIMEOUT"] = args.attempt_timeout
    activity = make_activity(ALICE)
    with override_settings(FEDERATION_DELIVERY=options):
        send(ALICE, activity, inboxes)  # not timed

        # Counted as the coordinator settles them: no query.
        delivered = 0
        last = 0.0
        through = threading.Event()

        def count(sender: Any, settled: signals.Settled, **kwargs: Any) -> None:
            nonlocal delivered, last
            if settled.outcome == "delivered" and settled.inbox in healthy_inboxes:
                delivered += 1
                last = time.monotonic()
                if delivered >= len(healthy_inboxes):
                    through.set()

        failing_before = sink.failing_requests()
        silent_connections_before, silent_before = silent.counts()
        connections_before, requests_before = sink.counters()
        signals.delivery_settled.connect(count, weak=False, dispatch_uid="faults-count")
        runner = DelivererThread(Deliverer())
        cpu = time.process_time()
        note = ""
        watched = None
        try:
            runner.start()
            deadline = runner.started + args.timeout
            next_trace = runner.started
            while not through.wait(0.05) and time.monotonic() < deadline and runner.alive():
                if args.trace and time.monotonic() >= next_trace:
                    print(trace_line(runner, layout, delivered), flush=True)
                    next_trace += 1.0
            seconds = last - runner.started if through.is_set() else None
            cpu = time.process_time() - cpu
            # The faulty hosts' counts until then.
            failing = sink.failing_requests() - failing_before
            connections_now, requests_now = silent.counts()
            silent_connections = connections_now - silent_connections_before
            silent_requests = requests_now - silent_before
            connections_after, requests_after = sink.counters()
            if faulty and args.watch > 0 and seconds is not None:
                watch_end = runner.started + args.watch
                while time.monotonic() < watch_end and runner.alive():
                    time.sleep(0.2)
                _, requests_watched = silent.counts()
                watched = (
                    time.monotonic() - runner.started,
                    dict(sink.failing_requests() - failing_before),
                    dict(requests_watched - silent_before),
                )
        finally:
            # SIGTERM: stop claiming, finish what is in flight; the silent
            # hosts hang up on what they hold, so that this is quick.
            runner.deliverer.stop()
            silent.hang_up()
            stopped = runner.stop(timeout=runner.deliverer.transport_settings.attempt_timeout + 30)
            silent.hang_up(False)
            signals.delivery_settled.disconnect(dispatch_uid="faults-count")
        open_breakers = set(
            Breaker.objects.filter(open_until__isnull=False).values_list("key", flat=True)
        )
    if runner.error is not None:
        note += f"\n  WARNING: the deliverer raised {runner.error!r}"
    if not stopped:
        note += "\n  WARNING: the deliverer did not stop in time"
    if seconds is None:
        note += (
            f"\n  WARNING: {len(healthy_inboxes) - delivered} healthy deliveries were not "
            f"delivered after {args.timeout:.0f} s"
        )
    summary = runner.summary.line()
    clear_all()
    return Phase(
        faulty=faulty,
        healthy=len(healthy_inboxes),
        delivered=delivered,
        seconds=seconds,
        cpu=cpu,
        failing_requests={address: failing[address] for address in layout.failing},
        silent_requests={address: silent_requests[address] for address in layout.silent},
        silent_connections={address: silent_connections[address] for address in layout.silent},
        watched=watched,
        # Less the counters query of the "before" (it is counted once it is served).
        nginx_connections=connections_after - connections_before - 1,
        nginx_requests=requests_after - requests_before - 1,
        summary=summary,
        open_breakers=open_breakers,
        note=note,
    )


def trace_line(runner: DelivererThread, layout: Layout, delivered: int) -> str:
    """What the deliverer holds now, by kind of host: claimed and waiting
    for a slot (ready), and handed to the workers (in flight, of which slow)."""
    deliverer: Any = runner.deliverer
    in_hand = deliverer.in_hand()
    flight = in_hand.in_flight
    cutoff = time.monotonic() - deliverer.slow_after
    slow = collections.Counter(
        layout.kind(sending.host) for sending in flight if 0 < sending.started <= cutoff
    )
    in_flight = collections.Counter(layout.kind(sending.host) for sending in flight)
    waiting = collections.Counter(layout.kind(held.host) for held in in_hand.ready)
    kinds = ("202", str(FAILING_STATUS), "silent")

    def show(counts: collections.Counter[str]) -> str:
        return "/".join(str(counts[kind]) for kind in kinds)

    return (
        f"    t={time.monotonic() - runner.started:6.1f} s  healthy delivered {delivered:>5}  "
        f"ready {show(waiting)}  in flight {show(in_flight)} (slow {show(slow)})  "
        f"[202/{FAILING_STATUS}/silent]  {runner.summary.line()}"
    )


# --- The run ------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="The time until every delivery to a healthy host is through, with 20 of "
        "100 hosts answering 503 and 5 never answering, against the same without them; "
        "and the requests the faulty hosts received. Prints figures; asserts nothing."
    )
    parser.add_argument("--hosts", type=positive, default=100, help="H hosts in all (100)")
    parser.add_argument(
        "--deliveries-per-host", type=positive, default=100, help="D deliveries each (100)"
    )
    parser.add_argument(
        "--failing", type=int, default=20, help=f"hosts answering {FAILING_STATUS} (20)"
    )
    parser.add_argument("--silent", type=int, default=5, help="hosts never answering (5)")
    parser.add_argument("--rounds", type=positive, default=3, help="rounds (3)")
    parser.add_argument(
        "--attempt-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="ATTEMPT_TIMEOUT for both runs (default: the setting's, 30 s unless FD_SETTINGS_JSON"
        " says otherwise)",
    )
    parser.add_argument(
        "--watch",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="keep the run with faults going until SECONDS after its start, and count the "
        "faulty hosts' requests until then too (to see the probes: more than COOL_OFF)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=240.0,
        help="seconds a run may take to deliver the healthy deliveries, at most (240)",
    )
    parser.add_argument("--warmup", type=int, default=500, help="deliveries before round 1 (500)")
    parser.add_argument("--seed", type=int, default=1, help="which hosts are faulty (1)")
    parser.add_argument(
        "--trace",
        action="store_true",
        help="print, every second of each run, what the deliverer holds "
        "(Deliverer.in_hand(): a diagnostic, not a figure)",
    )
    parser.add_argument(
        "--nginx-workers", default="1", help="nginx worker_processes (1; 'auto' = one per CPU)"
    )
    parser.add_argument(
        "--tmpdir", default=None, help="where the temp dir (SQLite file, nginx) goes"
    )
    args = parser.parse_args(argv)
    if args.hosts > 240:
        parser.error("--hosts: at most 240 (127.0.0.10 … 127.0.0.249)")
    if args.failing < 0 or args.silent < 0 or args.failing + args.silent >= args.hosts:
        parser.error("--failing and --silent: 0 or more, and fewer than --hosts together")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, sigterm_interrupts)
    layout = make_layout(args)
    workdir = Path(tempfile.mkdtemp(prefix="fd-faults-", dir=args.tmpdir))
    sink = Sink(
        layout.healthy,
        workdir / "nginx",
        workers=args.nginx_workers,
        failing=dict.fromkeys(layout.failing, FAILING_STATUS),
    )
    silent = SilentHosts(layout.silent)
    try:
        sink.start()
        silent.start()
        return benchmark(args, workdir, layout, sink, silent)
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    finally:
        silent.stop()
        sink.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def benchmark(
    args: argparse.Namespace, workdir: Path, layout: Layout, sink: Sink, silent: SilentHosts
) -> int:
    database = setup_django(workdir, database_url=None)

    from django.conf import settings
    from django.test import override_settings

    from django_federation_delivery.conf import app_settings
    from django_federation_delivery.deliverer import Deliverer
    from tests.keys import ALICE, sender_key

    sender_key(ALICE)  # the RSA key is made once, here, not in a timed run
    options = dict(settings.FEDERATION_DELIVERY)
    if args.attempt_timeout is not None:
        options["ATTEMPT_TIMEOUT"] = args.attempt_timeout
    with override_settings(FEDERATION_DELIVERY=options):
        probe = Deliverer()
        breaker = app_settings.get("BREAKER")
        retry = app_settings.get("RETRY")
        timeout = probe.transport_settings.attempt_timeout
        connect_timeout = probe.transport_settings.connect_timeout

    url = {
        **{address: sink.url_at(address, "") for address in layout.healthy + layout.failing},
        **{address: silent.url(address, "") for address in layout.silent},
    }
    addresses = [f"127.0.0.{FIRST_HOST + n}" for n in range(args.hosts)]
    every = [
        f"{url[address]}/users/u{i}/inbox"
        for i in range(args.deliveries_per_host)
        for address in addresses
    ]
    healthy_hosts = set(layout.healthy)
    healthy = [inbox for inbox in every if inbox.split("/")[2].split(":")[0] in healthy_hosts]
    healthy_set = frozenset(healthy)
    body = b'{"type": "Create"}'
    checks = [keepalive_check(sink, body)]
    if layout.failing:
        checks.append(keepalive_check(sink, body, address=layout.failing[0]))

    print("django-federation-delivery faults: dead servers should cost the healthy ones nothing")
    print(
        f"  {len(every)} deliveries: {args.deliveries_per_host} to each of {args.hosts} hosts; "
        f"{len(layout.healthy)} healthy (202), {len(layout.failing)} answering "
        f"{FAILING_STATUS}, {len(layout.silent)} silent; rounds {args.rounds}"
    )
    print(f"  {FAILING_STATUS}: {' '.join(layout.failing) or '-'}")
    print(f"  silent: {' '.join(layout.silent) or '-'}")
    print(
        f"  deliverer: concurrency {probe.concurrency}, per_host {probe.per_host}, slow after "
        f"{probe.slow_after:g} s (+{probe.slow_concurrency}), claim size {probe.claim_size}; "
        f"ATTEMPT_TIMEOUT {timeout:g} s, CONNECT_TIMEOUT {connect_timeout:g} s"
        + (" (set by --attempt-timeout)" if args.attempt_timeout is not None else "")
    )
    print(
        f"  BREAKER {breaker}; RETRY BASE {retry['BASE']:g} s, CAP {retry['CAP']:g} s, "
        f"ATTEMPTS {retry['ATTEMPTS']}"
    )
    for line in environment_lines():
        print(f"  {line}")
    print(f"  database: {database}")
    print(
        f"  sink: nginx {sink.version()}, worker_processes {sink.workers}, port {sink.port}; "
        "keep-alive check "
        + ", ".join(
            f"{ok}/50 on {sockets} socket(s), {accepted} accepted"
            for ok, sockets, accepted in checks
        )
    )
    if args.watch:
        print(f"  the run with faults is watched until {args.watch:.0f} s after its start")
    print(flush=True)

    if args.warmup > 0:
        from django_federation_delivery.sending import send

        warm = healthy[: args.warmup]
        print(f"warm-up ({len(warm)} healthy deliveries, not counted) …", flush=True)
        clear_all()
        send(ALICE, make_activity(ALICE), warm)
        Deliverer().run(drain=True)
        clear_all()

    rounds: list[dict[bool, Phase]] = []
    for number in range(1, args.rounds + 1):
        order = (True, False) if number % 2 else (False, True)
        names = " then ".join("with faults" if faulty else "fault-free" for faulty in order)
        print(f"round {number} ({names})", flush=True)
        phases: dict[bool, Phase] = {}
        for faulty in order:
            phases[faulty] = run_phase(
                args,
                faulty=faulty,
                inboxes=every if faulty else healthy,
                healthy_inboxes=healthy_set,
                layout=layout,
                sink=sink,
                silent=silent,
            )
            print(phases[faulty].line(args.timeout), flush=True)
        with_faults, clean = phases[True], phases[False]
        lines = faulty_lines(with_faults, layout, breaker, probe.per_host, timeout, args.timeout)
        print(lines, flush=True)
        if with_faults.seconds and clean.seconds:
            print(f"  ratio with faults / fault-free: {with_faults.seconds / clean.seconds:.3f}")
        elif clean.seconds:
            print(
                f"  ratio with faults / fault-free: > {args.timeout / clean.seconds:.3f} "
                "(not through in time)"
            )
        rounds.append(phases)

    report(args, rounds, layout, breaker, probe.per_host)
    return 0


def request_bound(seconds: float, breaker: dict[str, Any], per_host: int) -> int:
    """The most requests the breaker lets reach a failing host in ``seconds``."""
    return (
        int(breaker["THRESHOLD"]) + (per_host - 1) + math.ceil(seconds / float(breaker["COOL_OFF"]))
    )


def faulty_lines(
    phase: Phase,
    layout: Layout,
    breaker: dict[str, Any],
    per_host: int,
    attempt_timeout: float,
    timeout: float,
) -> str:
    lines = []
    if phase.seconds is not None:
        bound = request_bound(phase.seconds, breaker, per_host)
        lines.append(
            f"  requests until the healthy were through ({phase.seconds:.1f} s; bound {bound}):"
        )
    else:
        bound = request_bound(timeout, breaker, per_host)
        lines.append(f"  requests in the {timeout:.0f} s the run was given (bound {bound}):")
    windows: list[tuple[str, dict[str, int], dict[str, int]]] = [
        ("", phase.failing_requests, phase.silent_requests)
    ]
    if phase.watched is not None:
        seconds, failing, silent = phase.watched
        windows.append(
            (
                f" (watched, {seconds:.0f} s; bound {request_bound(seconds, breaker, per_host)})",
                failing,
                silent,
            )
        )
    for label, failing, silent in windows:
        if layout.failing:
            values = [failing[address] for address in layout.failing]
            lines.append(
                f"    {FAILING_STATUS} hosts{label}: {' '.join(map(str, values))}   "
                f"max {max(values)}, median {statistics.median(values):g}"
            )
        if layout.silent:
            values = [silent[address] for address in layout.silent]
            lines.append(
                f"    silent hosts{label}: {' '.join(map(str, values))}   "
                f"max {max(values)}, median {statistics.median(values):g}"
            )
    if layout.silent:
        connections = [phase.silent_connections[address] for address in layout.silent]
        lines.append(f"    silent hosts' connections accepted: {' '.join(map(str, connections))}")
        if phase.seconds is not None and phase.seconds < attempt_timeout:
            lines.append(
                f"    NOTE: through in {phase.seconds:.1f} s < ATTEMPT_TIMEOUT "
                f"{attempt_timeout:g} s: no attempt to a silent host had ended yet (what "
                "follows one is not measured)"
            )
    opened = collections.Counter(layout.kind(key) for key in phase.open_breakers)
    lines.append(
        f"    breakers open at the end: {opened[str(FAILING_STATUS)]}/{len(layout.failing)} "
        f"{FAILING_STATUS} hosts, {opened['silent']}/{len(layout.silent)} silent, "
        f"{opened['202']} healthy"
    )
    return "\n".join(lines)


def report(
    args: argparse.Namespace,
    rounds: list[dict[bool, Phase]],
    layout: Layout,
    breaker: dict[str, Any],
    per_host: int,
) -> None:
    # A run not through in time counts as the time it was given: a lower bound, shown ">".
    Bounded = tuple[float, bool]

    def took(phase: Phase) -> Bounded:
        return (phase.seconds, False) if phase.seconds is not None else (args.timeout, True)

    def show(value: Bounded, spec: str) -> str:
        return ("" if not value[1] else ">") + format(value[0], spec)

    def median(values: list[Bounded]) -> Bounded:
        middle = statistics.median(value for value, _ in values)
        # Only a lower bound when a bound lies at or below it.
        return middle, any(lower and value <= middle for value, lower in values)

    print()
    print(
        f"{args.hosts} hosts x {args.deliveries_per_host}: {len(layout.healthy)} healthy, "
        f"{len(layout.failing)} answering {FAILING_STATUS}, {len(layout.silent)} silent   "
        "(seconds until every healthy delivery is delivered; requests per faulty host until then)"
    )
    header = (
        f"{'round':<7}{'order':<14}{'faults':>8}{'clean':>8}{'ratio':>8}"
        f"{'503 max':>9}{'median':>8}{'silent max':>12}{'median':>8}{'bound':>7}"
    )
    print(header)
    print("-" * len(header))
    ratios: list[Bounded] = []
    with_seconds: list[Bounded] = []
    clean_seconds: list[Bounded] = []
    worst_failing, worst_silent = [], []
    for number, phases in enumerate(rounds, 1):
        faulty, clean = took(phases[True]), took(phases[False])
        with_seconds.append(faulty)
        clean_seconds.append(clean)
        # A fault-free run not through in time leaves the ratio unknown.
        ratio = (faulty[0] / clean[0], faulty[1]) if not clean[1] else (math.nan, False)
        if not clean[1]:
            ratios.append(ratio)
        failing = list(phases[True].failing_requests.values()) or [0]
        silent = list(phases[True].silent_requests.values()) or [0]
        worst_failing.append(max(failing))
        worst_silent.append(max(silent))
        bound = request_bound(faulty[0], breaker, per_host)
        order = "faults,clean" if number % 2 else "clean,faults"
        print(
            f"{number:<7}{order:<14}{show(faulty, '.2f'):>8}{show(clean, '.2f'):>8}"
            f"{show(ratio, '.3f'):>8}{max(failing):>9}{statistics.median(failing):>8g}"
            f"{max(silent):>12}{statistics.median(silent):>8g}{bound:>7}"
        )
    print("-" * len(header))
    with_median, clean_median = median(with_seconds), median(clean_seconds)
    ratio_median = median(ratios) if ratios else (math.nan, False)
    print(
        f"{'median':<21}{show(with_median, '.2f'):>8}{show(clean_median, '.2f'):>8}"
        f"{show(ratio_median, '.3f'):>8}{statistics.median(worst_failing):>9g}{'':>8}"
        f"{statistics.median(worst_silent):>12g}"
    )
    print()
    of_medians = (with_median[0] / clean_median[0], with_median[1] and not clean_median[1])
    print(
        f"median ratio with faults / fault-free: {show(ratio_median, '.3f')} (ratio of the "
        f"medians: {show(of_medians, '.3f')}; the issue asks <= 1.3)"
    )
    late = sum(lower for _, lower in with_seconds)
    if late:
        print(
            f"  {late} of {len(rounds)} runs with faults were not through in the "
            f"{args.timeout:.0f} s given: counted as {args.timeout:.0f} s, a lower bound ('>')"
        )
    cpu_faulty = statistics.median(p[True].cpu_ms for p in rounds)
    cpu_clean = statistics.median(p[False].cpu_ms for p in rounds)
    print(
        f"CPU per healthy delivery, with faults / fault-free: {cpu_faulty:.2f} / {cpu_clean:.2f} ms"
    )
    print(
        f"bound on the requests to one faulty host in T seconds: THRESHOLD {breaker['THRESHOLD']} "
        f"failures open its breaker, + PER_HOST-1 = {per_host - 1} already in flight when the "
        f"last of them comes back, + at most one probe per COOL_OFF {breaker['COOL_OFF']:g} s: "
        f"ceil(T / {breaker['COOL_OFF']:g})"
    )
    print(f"load average at the end: {load_average()}")
    problems = [phase.note for phases in rounds for phase in phases.values() if phase.note]
    for problem in problems:
        print(problem.strip())
    if not problems:
        print("every healthy delivery was delivered, in every run")


if __name__ == "__main__":
    sys.exit(main())
