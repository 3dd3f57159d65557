#!/usr/bin/env python
"""Throughput: the claim-and-send loop against a bare thread pool, on a fast local sink.

N deliveries to H hosts, in the same process and the same run, sent twice per
round:

* by a **bare pool**: a ``ThreadPoolExecutor`` whose tasks only sign (draft-cavage,
  RSA-2048) and POST with a per-thread :class:`Transport`, no database at all;
* by **the loop**: ``send()`` queues the N inboxes (not timed), then
  ``Deliverer(concurrency=C, per_host=P).run(drain=True)`` (what ``manage.py
  run_deliverer --drain`` runs) claims, sends and settles them (timed).

The sink is nginx (Debian's ``nginx-light``, installed with apt-get when missing)
answering 202 on 127.0.0.10 … 127.0.0.(10+H-1), started and stopped by this
script. It prints deliveries per second for each, their ratio, and the medians
over the rounds; it asserts nothing. The queue is a fresh SQLite file in a temp
directory (WAL), or with ``--database-url`` a throwaway PostgreSQL whose batches
it deletes.

    python benchmarks/throughput.py [--deliveries 5000] [--hosts 10] [--rounds 3]
        [--concurrency 16] [--per-host 16] [--database-url URL]

See benchmarks/README.rst.
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import io
import os
import platform
import pstats
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

if not __package__:  # run as a script: benchmarks/ is on the path, the repository is not
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (
    BarePoster,
    Sink,
    around_worker_threads,
    clear_queue,
    delivered_rows,
    keepalive_check,
    make_activity,
    package_fingerprint,
    positive,
    queue_deliveries,
    setup_django,
    sigterm_interrupts,
)

if TYPE_CHECKING:
    from django_federation_delivery.signatures import SenderKey
    from django_federation_delivery.transport import TransportSettings

# --- What each phase measured -----------------------------------------------------------------


@dataclasses.dataclass
class Phase:
    name: str
    expected: int
    delivered: int
    seconds: float
    cpu: float  # this process's CPU seconds
    sink_cpu: float  # nginx's CPU seconds
    connections: int  # new TCP connections nginx accepted
    requests: int  # requests nginx served
    note: str = ""

    @property
    def rate(self) -> float:
        return self.delivered / self.seconds if self.seconds > 0 else 0.0

    @property
    def cpu_ms(self) -> float:
        """This process's CPU milliseconds per delivery: less sensitive than the
        rate to other processes taking the CPUs, more to the GIL's contention."""
        return 1000 * self.cpu / self.delivered if self.delivered else 0.0

    def line(self) -> str:
        return (
            f"  {self.name:<22} {self.delivered:>6}/{self.expected:<6} in {self.seconds:6.2f} s "
            f"{self.rate:8.1f}/s   cpu {100 * self.cpu / self.seconds:4.0f}%   "
            f"nginx cpu {100 * self.sink_cpu / self.seconds:3.0f}%   "
            f"{self.connections} connections, {self.requests} requests{self.note}"
        )


def measure(name: str, expected: int, sink: Sink, run: Callable[[], tuple[int, str]]) -> Phase:
    accepted, served = sink.counters()
    sink_cpu = sink.cpu_seconds()
    cpu = time.process_time()
    started = time.perf_counter()
    delivered, note = run()
    seconds = time.perf_counter() - started
    cpu = time.process_time() - cpu
    sink_cpu = sink.cpu_seconds() - sink_cpu
    accepted_after, served_after = sink.counters()
    return Phase(
        name=name,
        expected=expected,
        delivered=delivered,
        seconds=seconds,
        cpu=cpu,
        sink_cpu=sink_cpu,
        # Less the counters query of the "before" (it is counted once it is served).
        connections=accepted_after - accepted - 1,
        requests=served_after - served - 1,
        note=note,
    )


# --- The bare pool: sign and POST, nothing else -----------------------------------------------


def bare_pool(
    urls: Sequence[str],
    body: bytes,
    digest: str,
    key: SenderKey,
    settings: TransportSettings,
    concurrency: int,
) -> tuple[int, str]:
    poster = BarePoster(body, digest, key, settings)
    with ThreadPoolExecutor(concurrency, thread_name_prefix="bare-pool") as pool:
        delivered = sum(pool.map(poster, urls))
    poster.close()
    errors = poster.errors
    note = f"   errors: {len(errors)}, first: {errors[0]}" if errors else ""
    return delivered, note


# --- The loop: queue with send(), then Deliverer.run(drain=True) -----------------------------


def run_loop(concurrency: int, per_host: int, profile: Path | None = None) -> tuple[int, str]:
    from django.db import connection

    from django_federation_delivery.deliverer import Deliverer

    statements = 0

    def count(execute: Callable[..., Any], sql: str, *rest: Any) -> Any:
        nonlocal statements
        statements += 1
        return execute(sql, *rest)

    # The coordinator is this thread, and this is its connection (BEGINs are
    # counted, COMMITs are not: they are no statement).
    coordinator_cpu = time.thread_time()
    with connection.execute_wrapper(count):
        if profile is None:
            summary = Deliverer(concurrency=concurrency, per_host=per_host).run(drain=True)
        else:
            summary = profiled_run(concurrency, per_host, profile)
    others = summary.retrying + summary.refused + summary.failed + summary.skipped
    coordinator_cpu = time.thread_time() - coordinator_cpu
    attempts = max(1, summary.attempts)
    note = (
        f", {statements / attempts:.2f} SQL statements/delivery"
        f", coordinator cpu {1000 * coordinator_cpu / attempts:.2f} ms/delivery"
    )
    if others:
        note += f"   NOT delivered: {summary.line()}"
    return summary.delivered, note


def profiled_run(concurrency: int, per_host: int, directory: Path) -> Any:
    """Deliverer.run under cProfile: the coordinator (this thread) and every
    worker thread each profiled, written to DIRECTORY as pstats files."""
    from django_federation_delivery.deliverer import Deliverer

    workers: list[cProfile.Profile] = []
    lock = threading.Lock()

    def profile_worker() -> cProfile.Profile:
        profile = cProfile.Profile()
        with lock:
            workers.append(profile)
        profile.enable()
        return profile

    coordinator = cProfile.Profile()
    deliverer = Deliverer(concurrency=concurrency, per_host=per_host)
    with around_worker_threads(profile_worker, cProfile.Profile.disable):
        coordinator.enable()
        try:
            summary = deliverer.run(drain=True)
        finally:
            coordinator.disable()
    directory.mkdir(parents=True, exist_ok=True)
    coordinator.dump_stats(directory / "coordinator.pstats")
    merged = pstats.Stats(workers[0])
    for profile in workers[1:]:
        merged.add(profile)
    merged.dump_stats(directory / "workers.pstats")
    return summary


def print_profile(directory: Path, top: int) -> None:
    for name in ("coordinator", "workers"):
        for order in ("cumulative", "tottime"):
            out = io.StringIO()
            stats = pstats.Stats(str(directory / f"{name}.pstats"), stream=out)
            stats.strip_dirs().sort_stats(order).print_stats(top)
            text = out.getvalue()
            text = text[text.find("   ncalls") :] if "   ncalls" in text else text
            print(f"\n--- {name} thread{'s' if name == 'workers' else ''}, by {order} ---")
            print(text.rstrip())


# --- The run ------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="run_deliverer's loop against a bare sign-and-POST thread pool, "
        "on nginx answering 202 on loopback. Prints figures; asserts nothing."
    )
    parser.add_argument("--deliveries", "-n", type=positive, default=5000, help="N (5000)")
    parser.add_argument("--hosts", type=positive, default=10, help="H sink addresses (10)")
    parser.add_argument("--rounds", type=positive, default=3, help="rounds (3)")
    parser.add_argument("--concurrency", type=positive, default=16, help="threads, both (16)")
    parser.add_argument(
        "--per-host",
        type=positive,
        default=16,
        help="the loop's per_host (16: no limit below the bare pool's, which has none)",
    )
    parser.add_argument(
        "--with-default-per-host",
        action="store_true",
        help="also run the loop with the default PER_HOST (2) each round (wants --hosts >= 8)",
    )
    parser.add_argument(
        "--database-url",
        default=None,
        help="a PostgreSQL DATABASE_URL to queue in instead of a fresh SQLite file; a "
        "THROWAWAY one: its public schema is dropped, made again and migrated, and every "
        "batch in it is deleted between phases",
    )
    parser.add_argument(
        "--sqlite-synchronous",
        choices=["NORMAL", "FULL"],
        default="NORMAL",
        help="PRAGMA synchronous for SQLite (NORMAL, as the example project and tests run)",
    )
    parser.add_argument(
        "--warmup", type=int, default=500, help="deliveries of each kind before round 1 (500)"
    )
    parser.add_argument(
        "--nginx-workers", default="1", help="nginx worker_processes (1; 'auto' = one per CPU)"
    )
    parser.add_argument(
        "--tmpdir", default=None, help="where the temp dir (SQLite file, nginx) goes"
    )
    parser.add_argument(
        "--profile",
        type=Path,
        default=None,
        metavar="DIR",
        help="after the rounds, run the loop once more under cProfile (all threads), "
        "write DIR/coordinator.pstats and DIR/workers.pstats and print the top functions",
    )
    parser.add_argument("--profile-top", type=int, default=25, help="functions shown (25)")
    parser.add_argument(
        "--switch-interval",
        type=float,
        default=None,
        metavar="SECONDS",
        help="sys.setswitchinterval for the whole run (Python's default: 0.005)",
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    signal.signal(signal.SIGTERM, sigterm_interrupts)
    workdir = Path(tempfile.mkdtemp(prefix="fd-throughput-", dir=args.tmpdir))
    sink = Sink(args.hosts, workdir / "nginx", workers=args.nginx_workers)
    try:
        return benchmark(args, workdir, sink)
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    finally:
        sink.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def benchmark(args: argparse.Namespace, workdir: Path, sink: Sink) -> int:
    sink.start()
    database = setup_django(
        workdir, database_url=args.database_url, synchronous=args.sqlite_synchronous
    )

    from importlib import metadata

    import django

    from django_federation_delivery.conf import app_settings
    from django_federation_delivery.deliverer import Deliverer
    from django_federation_delivery.models import Batch
    from tests.keys import ALICE, sender_key

    n, hosts = args.deliveries, args.hosts
    key = sender_key(ALICE)
    assert key is not None
    activity = make_activity(ALICE)
    # Spread over the hosts in turn, as send() queues them.
    inboxes = [sink.url(i, f"/users/u{i}/inbox") for i in range(n)]
    # The bare pool sends exactly the bytes the loop sends: those of a queued batch.
    queue_deliveries(ALICE, activity, inboxes[:1])
    batch = Batch.objects.get()
    body, digest = batch.body.encode(), batch.body_sha256
    clear_queue()
    # The transport the loop's workers use, to the setting.
    probe = Deliverer(concurrency=args.concurrency, per_host=args.per_host)
    transport_settings = probe.transport_settings
    # Extra threads for deliveries that turn slow, where the package has them.
    loop_threads = probe.concurrency + int(getattr(probe, "slow_concurrency", 0))

    ok, sockets, accepted = keepalive_check(sink, body)
    keepalive = f"{ok}/50 answered 202 on {sockets} socket(s), nginx accepted {accepted}"
    default_per_host = int(app_settings.get("PER_HOST"))

    print("django-federation-delivery throughput: run_deliverer's loop vs a bare thread pool")
    print(f"  N={n} deliveries to H={hosts} hosts, {n // hosts} each; rounds {args.rounds}")
    print(
        f"  concurrency {args.concurrency} (both); loop per_host {args.per_host}"
        + (f" (and {default_per_host}, the default)" if args.with_default_per_host else "")
        + "; bare pool: no per-host limit"
    )
    print(f"  threads: bare pool {args.concurrency}, loop {loop_threads} workers + 1 coordinator")
    print(f"  package: django-federation-delivery {package_fingerprint()}")
    bits = getattr(key.private_key, "key_size", "?")
    print(f"  body {len(body)} bytes, signed draft-cavage with {key.algorithm.upper()}-{bits}")
    versions = ", ".join(
        f"{name} {metadata.version(name)}" for name in ("requests", "urllib3", "cryptography")
    )
    print(f"  Python {platform.python_version()}, Django {django.get_version()}, {versions}")
    print(f"  database: {database}")
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    print(f"  GIL switch interval: {sys.getswitchinterval() * 1000:g} ms")
    print(f"  CPUs: {cpus} usable ({os.cpu_count()} online), {platform.machine()}")
    print(f"  load average at the start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(
        f"  sink: {sink.version()}, worker_processes {sink.workers}, "
        f"{sink.addresses[0]}…{sink.addresses[-1]} port {sink.port}"
    )
    print(f"  sink keep-alive check: {keepalive}")
    if sockets != 1 or accepted != 1 or ok != 50:
        print("  WARNING: the sink does not keep connections alive: figures are not comparable")
    if args.with_default_per_host and hosts * default_per_host < args.concurrency:
        print(
            f"  NOTE: {hosts} hosts x per_host {default_per_host} < concurrency "
            f"{args.concurrency}: the per_host={default_per_host} run is limited by that"
        )
    print(flush=True)

    def bare(count: int) -> Callable[[], tuple[int, str]]:
        return lambda: bare_pool(
            inboxes[:count], body, digest, key, transport_settings, args.concurrency
        )

    def loop(count: int, per_host: int) -> Callable[[], tuple[int, str]]:
        def run() -> tuple[int, str]:
            delivered, note = run_loop(args.concurrency, per_host)
            rows = delivered_rows()
            if rows != delivered:
                note += f"   WARNING: {rows} rows delivered, the summary says {delivered}"
            return delivered, note

        return run

    def loop_phase(name: str, count: int, per_host: int) -> Phase:
        clear_queue()
        queue_deliveries(ALICE, activity, inboxes[:count])  # not timed
        phase = measure(name, count, sink, loop(count, per_host))
        clear_queue()
        return phase

    if args.warmup > 0:
        warm = min(args.warmup, n)
        print(f"warm-up ({warm} of each, not counted) …", flush=True)
        measure("bare pool", warm, sink, bare(warm))
        loop_phase("loop", warm, args.per_host)

    rounds: list[dict[str, Phase]] = []
    for number in range(1, args.rounds + 1):
        order = ("bare", "loop") if number % 2 else ("loop", "bare")
        print(f"round {number} ({' then '.join(order)})", flush=True)
        phases: dict[str, Phase] = {}
        for kind in order:
            if kind == "bare":
                phases[kind] = measure("bare pool", n, sink, bare(n))
            else:
                phases[kind] = loop_phase(f"loop per_host={args.per_host}", n, args.per_host)
            print(phases[kind].line(), flush=True)
        if args.with_default_per_host:
            phases["loop2"] = loop_phase(f"loop per_host={default_per_host}", n, default_per_host)
            print(phases["loop2"].line(), flush=True)
        print(f"  ratio loop/bare: {phases['loop'].rate / phases['bare'].rate:.3f}", flush=True)
        rounds.append(phases)

    report(args, rounds, default_per_host)

    if args.profile is not None:
        print(f"\nprofiling one more loop run of {n} (cProfile, every thread) …", flush=True)
        clear_queue()
        queue_deliveries(ALICE, activity, inboxes)
        phase = measure(
            "loop under cProfile",
            n,
            sink,
            lambda: run_loop(args.concurrency, args.per_host, profile=args.profile),
        )
        clear_queue()
        print(phase.line())
        print_profile(args.profile, args.profile_top)
    return 0


def report(args: argparse.Namespace, rounds: list[dict[str, Phase]], default_per_host: int) -> None:
    extra = args.with_default_per_host
    print()
    print(
        f"N={args.deliveries}  H={args.hosts}  concurrency={args.concurrency}  "
        f"per_host={args.per_host}  (deliveries per second)"
    )
    header = f"{'round':<8}{'order':<12}{'bare pool':>11}{'loop':>11}{'loop/bare':>11}"
    if extra:
        header += f"{f'loop ph={default_per_host}':>14}{'ratio':>8}"
    header += f"{'cpu ms/delivery: bare':>24}{'loop':>7}"
    print(header)
    print("-" * len(header))
    ratios, ratios2 = [], []
    for number, phases in enumerate(rounds, 1):
        bare, loop = phases["bare"], phases["loop"]
        ratio = loop.rate / bare.rate
        ratios.append(ratio)
        order = "bare,loop" if number % 2 else "loop,bare"
        row = f"{number:<8}{order:<12}{bare.rate:>11.1f}{loop.rate:>11.1f}{ratio:>11.3f}"
        if extra:
            ratio2 = phases["loop2"].rate / bare.rate
            ratios2.append(ratio2)
            row += f"{phases['loop2'].rate:>14.1f}{ratio2:>8.3f}"
        row += f"{bare.cpu_ms:>24.2f}{loop.cpu_ms:>7.2f}"
        print(row)
    print("-" * len(header))

    def median(kind: str, value: Callable[[Phase], float]) -> float:
        return statistics.median(value(phases[kind]) for phases in rounds)

    bare_median = median("bare", lambda p: p.rate)
    loop_median = median("loop", lambda p: p.rate)
    median_ratio = statistics.median(ratios)
    row = f"{'median':<20}{bare_median:>11.1f}{loop_median:>11.1f}{median_ratio:>11.3f}"
    if extra:
        loop2_median = median("loop2", lambda p: p.rate)
        row += f"{loop2_median:>14.1f}{statistics.median(ratios2):>8.3f}"
    bare_cpu, loop_cpu = median("bare", lambda p: p.cpu_ms), median("loop", lambda p: p.cpu_ms)
    row += f"{bare_cpu:>24.2f}{loop_cpu:>7.2f}"
    print(row)
    print(
        f"\nmedian ratio loop/bare: {median_ratio:.3f} "
        f"(ratio of the median rates: {loop_median / bare_median:.3f}; the issue asks >= 0.8)"
    )
    print(
        f"CPU per delivery, loop/bare: {loop_cpu / bare_cpu:.2f}x "
        f"({loop_cpu - bare_cpu:+.2f} ms a delivery in the loop)"
    )
    print(f"load average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    short = [
        f"round {number} {kind}: {p.delivered}/{p.expected}"
        for number, phases in enumerate(rounds, 1)
        for kind, p in phases.items()
        if p.delivered != p.expected
    ]
    if short:
        print("WARNING: not everything was delivered: " + "; ".join(short))
    else:
        print("every delivery was delivered, in every phase")


if __name__ == "__main__":
    sys.exit(main())
