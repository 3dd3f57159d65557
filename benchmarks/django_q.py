#!/usr/bin/env python
"""run_deliverer against a django-q2 ``qcluster`` running the deliverer's rounds.

Two parts, each side by side in the same run (the sides in turn, first
swapped each round):

* **Fan-out drained**: N deliveries (2,000 over 100 hosts of nginx answering
  202, as throughput.py) queued by one ``send()``, then delivered by
  ``manage.py run_deliverer --drain`` started as a process, or by a
  ``qcluster`` already running (ORM broker, 2 workers) given rounds back to
  back: each round's task queues the next with ``async_task`` as it ends.
  Timed from the start (the process started, the first round queued) to the
  last 202 at the sink.
* **Steady stream**: a producer process sends one-inbox activities at a fixed
  rate while ``run_deliverer`` runs, or while a ``qcluster`` runs its
  scheduled rounds: the ``Schedule`` of ``delivery_schedule`` (a 50 s round
  every minute), or with ``--period P`` that shape shortened: a round of
  5/6 of P queued every P seconds by this script (django-q2 schedules no
  more often than every minute, and looks at its schedules every 30 s). The
  figure is each activity's time from just before its ``send()`` to its
  arrival at a small server in this process (one clock: CLOCK_MONOTONIC).

Every child is killed at the end, whatever happens, and the whole run is
bounded by ``--time-limit``. Prints figures; asserts nothing. See
benchmarks/README.rst.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

if not __package__:
    # Run as a script: its folder comes first on the path, where this file
    # would shadow django-q2's ``django_q``. The repository instead.
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from benchmarks.common import (
    Sink,
    clear_all,
    environment_lines,
    keepalive_check,
    load_average,
    make_activity,
    median_or_nan,
    positive,
    sigterm_interrupts,
)
from benchmarks.latency import Recipient
from benchmarks.steady import (
    POLL,
    SENDER,
    Bench,
    Served,
    cpu_seconds,
    setup_child,
    setup_database,
)

#: The task that runs a round and then queues the next (see round_after_round).
CHAIN_TASK = f"{__package__ or 'benchmarks'}.django_q.round_after_round"
#: The steady stream's inboxes: one small server on each of these addresses.
RECIPIENTS = [f"127.0.0.{n}" for n in range(240, 250)]
#: How long a cluster may take to start and run its first (warm-up) rounds.
START_TIMEOUT = 120.0


# --- In the cluster, and in the producer ---------------------------------------------------------


def round_after_round(seconds: float | None, left: int) -> dict[str, Any]:
    """A django-q2 task: a round (``deliver_round``), then the next one queued
    as this one ends, ``left`` rounds in all: rounds back to back."""
    from django_q.tasks import async_task

    from django_federation_delivery.contrib.django_q import deliver_round

    result = deliver_round(seconds)
    if left > 1:
        async_task(CHAIN_TASK, seconds, left - 1)
    return result


def producer_main() -> None:
    """Send one activity to each URL of the plan at the plan's rate, each
    ``send()`` a transaction of its own; print when each was sent."""
    config = setup_child()
    from django.db import connection, transaction

    from django_federation_delivery import send

    activity = make_activity(SENDER)
    connection.ensure_connection()
    interval = 1.0 / config["rate"]
    sent: list[tuple[str, float]] = []
    start = time.monotonic()
    urls: list[str] = json.loads(Path(config["plan"]).read_text())
    for number, url in enumerate(urls):
        time.sleep(max(0.0, start + number * interval - time.monotonic()))
        one = {**activity, "id": f"{SENDER}/statuses/{number}/activity"}
        at = time.monotonic()
        with transaction.atomic():
            send(SENDER, one, [url])
        sent.append((path_of(url), at))
    print(json.dumps({"sent": sent, "seconds": time.monotonic() - start}), flush=True)


def path_of(url: str) -> str:
    return "/" + url.split("/", 3)[3]


# --- The two sides ------------------------------------------------------------------------------


def clear_cluster_tables() -> None:
    """django-q2's queue, results and schedules: nothing of one phase reaches the next."""
    from django_q.models import OrmQ, Schedule, Task

    OrmQ.objects.all().delete()
    Task.objects.all().delete()
    Schedule.objects.all().delete()


def round_results() -> int:
    from django_q.models import Task

    return Task.objects.count()


class Side:
    """The processes of one side: ``run_deliverer`` or a ``qcluster``."""

    def __init__(self, bench: Bench, kind: str, log: Path) -> None:
        self.bench = bench
        self.kind = kind
        self.log = log
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def name(self) -> str:
        return "run_deliverer" if self.kind == "deliverer" else "qcluster"

    def start(self, *options: str) -> None:
        command = [sys.executable, "-m", "django"]
        command += (
            ["run_deliverer", "-v", "0", *options] if self.kind == "deliverer" else ["qcluster"]
        )
        with open(self.log, "ab") as out:
            # A session of its own (Bench.spawn): killed as a group at the end.
            self.process = self.bench.spawn(command, stdout=out, stderr=subprocess.STDOUT)

    def cpu(self) -> float:
        return cpu_seconds([self.process.pid]) if self.process is not None else 0.0

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def kill(self) -> None:
        """SIGKILL to the process and all under it (a round in a cluster's
        worker would otherwise run to its bound); what it had claimed is
        nothing here: the phase is over."""
        process, self.process = self.process, None
        if process is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(10)
        with contextlib.suppress(ValueError):
            self.bench.children.remove(process)

    def said(self) -> str:
        return self.log.read_text(errors="replace")[-2000:] if self.log.exists() else ""


@contextlib.contextmanager
def phase_side(bench: Bench, kind: str, log: str) -> Iterator[Side]:
    """A phase's side, on an empty queue; killed when the phase ends, whatever ends it."""
    clear_all()
    clear_cluster_tables()
    side = Side(bench, kind, bench.workdir / log)
    try:
        yield side
    finally:
        side.kill()
        clear_cluster_tables()


def start_cluster(side: Side, warm: Callable[[], bool]) -> None:
    """Start a qcluster and wait until two rounds at once (one a worker)
    have run: the workers have imported the package, ``warm`` says the
    warm-up send was delivered."""
    from django_q.tasks import async_task

    from django_federation_delivery.contrib.django_q import ROUND_TASK

    side.start()
    async_task(ROUND_TASK, 1)
    async_task(ROUND_TASK, 1)
    deadline = time.monotonic() + START_TIMEOUT
    while not (warm() and round_results() >= 2):
        if time.monotonic() > deadline or not side.alive():
            raise RuntimeError(f"the qcluster did not run its first rounds:\n{side.said()}")
        time.sleep(0.1)
    clear_cluster_tables()


# --- Part 1: a fan-out drained ------------------------------------------------------------------


@dataclasses.dataclass
class Drain:
    side: str
    expected: int
    delivered: int
    first: float  # seconds from the start to the first 202
    last: float  # and to the last
    cpu: float  # the side's processes, from the start to the last 202
    load: str
    note: str = ""

    @property
    def rate(self) -> float:
        return self.delivered / self.last if self.last > 0 else 0.0

    @property
    def cpu_ms(self) -> float:
        return 1000 * self.cpu / self.delivered if self.delivered else math.nan

    def line(self) -> str:
        return (
            f"  {self.side:<14} {self.delivered:>6}/{self.expected:<6} first {self.first:6.2f} s, "
            f"last {self.last:6.2f} s  {self.rate:7.1f}/s  cpu {self.cpu_ms:.2f} ms/delivery  "
            f"load {self.load}{self.note}"
        )


def drain_phase(
    args: argparse.Namespace, bench: Bench, kind: str, sink: Sink, served: Served, warm: str
) -> Drain:
    from django_q.tasks import async_task

    from django_federation_delivery import send

    with phase_side(bench, kind, f"{kind}.log") as side:
        if kind == "qcluster":
            before = served()
            send(SENDER, make_activity(SENDER), [warm])
            start_cluster(side, lambda: served() > before)
            clear_all()
        inboxes = [sink.url(i, f"/users/u{i}/inbox") for i in range(args.deliveries)]
        send(SENDER, make_activity(SENDER), inboxes)  # queued beforehand: not timed
        base = served()
        cpu_before = side.cpu()
        started = time.monotonic()
        if kind == "deliverer":
            side.start("--drain")
        else:
            # Enough rounds to outlast the phase's timeout.
            from django_federation_delivery.contrib.django_q import round_seconds

            bound = round_seconds(args.drain_round_seconds)
            async_task(CHAIN_TASK, args.drain_round_seconds, math.ceil(args.timeout / bound) + 1)
        deadline = started + args.timeout
        done, first, last, cpu, note = 0, math.nan, math.nan, 0.0, ""
        while True:
            sample = side.cpu()
            cpu = max(cpu, sample)  # a run_deliverer that has just exited reads as 0
            done = served() - base
            now = time.monotonic()
            if done and math.isnan(first):
                first = now - started
            if done >= args.deliveries:
                last = now - started
                break
            if now > deadline:
                note = f"   NOT THROUGH within {args.timeout:.0f} s"
                last = now - started
                break
            if kind == "deliverer" and not side.alive() and served() - base < args.deliveries:
                note = f"   run_deliverer exited early:\n{side.said()}"
                last = now - started
                break
            time.sleep(POLL)
        cpu = max(cpu, side.cpu()) - cpu_before
        return Drain(
            side=side.name,
            expected=args.deliveries,
            delivered=done,
            first=first,
            last=last,
            cpu=cpu,
            load=load_average(),
            note=note,
        )


# --- Part 2: a steady stream --------------------------------------------------------------------


@dataclasses.dataclass
class Stream:
    side: str
    latencies: list[float]  # of those that arrived, sorted
    sent: int
    cpu: float  # the side's processes, from the stream's start to its last arrival
    rounds: str
    load: str
    note: str = ""

    def figure(self, share: float) -> float:
        if not self.latencies:
            return math.nan
        return self.latencies[min(len(self.latencies) - 1, int(share * (len(self.latencies) - 1)))]

    @property
    def median(self) -> float:
        return median_or_nan(self.latencies)

    @property
    def cpu_ms(self) -> float:
        return 1000 * self.cpu / len(self.latencies) if self.latencies else math.nan

    def line(self) -> str:
        return (
            f"  {self.side:<14} {len(self.latencies):>5}/{self.sent:<5} arrived; send→received "
            f"median {self.median:7.3f} s, p90 {self.figure(0.9):7.3f} s, max "
            f"{self.figure(1.0):7.3f} s  cpu {self.cpu_ms:.2f} ms/delivery  {self.rounds}"
            f"load {self.load}{self.note}"
        )


class Schedule:
    """The rounds a cluster gets in the steady stream: the real ``Schedule``
    of ``delivery_schedule``, or (``period`` < 60) that shape shortened,
    queued by this script."""

    def __init__(self, period: float) -> None:
        self.period = period
        self.real = period >= 60
        self.bound = 50.0 if self.real else round(period * 5 / 6, 1)
        self.next = 0.0
        self.queued = 0

    def describe(self) -> str:
        if self.real:
            return "delivery_schedule's Schedule: a 50 s round every minute (django-q2's scheduler)"
        return f"a {self.bound:g} s round every {self.period:g} s (queued by this script)"

    def begin(self) -> None:
        if self.real:
            from django_federation_delivery.contrib.django_q import ensure_schedules

            ensure_schedules()
        else:
            self.next = time.monotonic()
        self.tick()

    def tick(self) -> None:
        if self.real or time.monotonic() < self.next:
            return
        from django_q.tasks import async_task

        from django_federation_delivery.contrib.django_q import ROUND_TASK

        async_task(ROUND_TASK, self.bound)
        self.queued += 1
        self.next += self.period


def stream_phase(
    args: argparse.Namespace, bench: Bench, kind: str, recipients: list[Recipient], number: int
) -> Stream:
    from django_federation_delivery import send

    arrivals: dict[str, float] = {}
    for recipient in recipients:
        recipient.arrivals.clear()

    def missing(paths: set[str]) -> set[str]:
        for recipient in recipients:
            # A dict merged in C, under the GIL: safe while its server adds to it.
            arrivals.update(recipient.arrivals)
        return paths - arrivals.keys()

    def arrived(path: str) -> bool:
        return not missing({path})

    def probe(name: str) -> str:
        path = f"/users/{name}-{number}-{kind}/inbox"
        send(SENDER, make_activity(SENDER), [recipients[0].url(path)])
        return path

    schedule = Schedule(args.period)
    with phase_side(bench, kind, f"stream-{kind}.log") as side:
        if kind == "qcluster":
            warm = probe("warm")
            start_cluster(side, lambda: arrived(warm))
            # The stream begins as the first round does: delivered, this
            # send says a round is running.
            first = probe("first-round")
            schedule.begin()
            wait_for(lambda: arrived(first), START_TIMEOUT, side, schedule.tick)
        else:
            side.start()
            first = probe("warm")
            wait_for(lambda: arrived(first), START_TIMEOUT, side)
            time.sleep(1.0)  # into its idle wait, as between a server's posts
        count = round(args.rate * args.stream_seconds)
        urls = [
            recipients[n % len(recipients)].url(f"/users/s{number}-{kind}-{n}/inbox")
            for n in range(count)
        ]
        plan = bench.workdir / "stream.json"  # too long for the environment
        plan.write_text(json.dumps(urls))
        config = {"plan": str(plan), "rate": args.rate}
        cpu_before = side.cpu()
        producer = bench.spawn(
            [sys.executable, "-m", "benchmarks.django_q", "--role", "producer"],
            config,
            stdout=subprocess.PIPE,
        )
        paths = {path_of(url) for url in urls}
        # The last send may wait out a whole gap between rounds, and a round.
        bound = args.stream_seconds + 2 * schedule.period + 60
        wait_for(lambda: not missing(paths), bound, side, schedule.tick, 0.1)
        cpu = side.cpu() - cpu_before
        out, _ = producer.communicate(timeout=60)
        sent = dict(json.loads(out.splitlines()[-1])["sent"]) if out.strip() else {}
        latencies = sorted(arrivals[path] - at for path, at in sent.items() if path in arrivals)
        note = "" if len(latencies) == count else f"   {count - len(latencies)} NOT ARRIVED"
        rounds = ""
        if kind == "qcluster":
            from django_q.models import Task

            from django_federation_delivery.contrib.django_q import ROUND_TASK

            ran = [t.result for t in Task.objects.filter(func=ROUND_TASK)]
            run = sum(1 for r in ran if isinstance(r, dict) and r.get("ran"))
            rounds = f"rounds {run} run, {len(ran) - run} locked out or failed; "
        return Stream(
            side=side.name,
            latencies=latencies,
            sent=len(sent),
            cpu=cpu,
            rounds=rounds,
            load=load_average(),
            note=note,
        )


def wait_for(
    done: Callable[[], bool],
    timeout: float,
    side: Side,
    tick: Callable[[], None] = lambda: None,
    step: float = POLL,
) -> bool:
    """Wait until ``done``, calling ``tick`` meanwhile; False after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            return False
        if not side.alive():
            raise RuntimeError(f"{side.name} exited:\n{side.said()}")
        tick()
        time.sleep(step)
    return True


# --- The run ------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="run_deliverer against a django-q2 qcluster running the deliverer's rounds: "
        "a fan-out drained, and the latency of a steady stream. Prints figures; asserts nothing."
    )
    parser.add_argument("--role", default="coordinator", help=argparse.SUPPRESS)
    parser.add_argument("--deliveries", "-n", type=positive, default=2000, help="fan-out (2000)")
    parser.add_argument("--hosts", type=positive, default=100, help="sink addresses (100)")
    parser.add_argument("--rounds", type=positive, default=3, help="fan-out rounds (3)")
    parser.add_argument(
        "--drain-round-seconds",
        type=float,
        default=None,
        help="the bound of the fan-out's rounds (the package's default under Q_CLUSTER: 50)",
    )
    parser.add_argument("--rate", type=float, default=20.0, help="stream: sends a second (20)")
    parser.add_argument(
        "--stream-seconds", type=float, default=None, help="stream: how long (two periods)"
    )
    parser.add_argument(
        "--period",
        type=float,
        default=60.0,
        help="stream: the rounds' period: 60, delivery_schedule's Schedule (a 50 s round every "
        "minute); less, that shape shortened (a round of 5/6 of it, queued by this script)",
    )
    parser.add_argument("--stream-rounds", type=positive, default=1, help="stream rounds (1)")
    parser.add_argument("--skip-drain", action="store_true", help="the stream only")
    parser.add_argument("--skip-stream", action="store_true", help="the fan-out only")
    parser.add_argument("--timeout", type=float, default=180.0, help="a fan-out phase, most (180)")
    parser.add_argument(
        "--time-limit", type=float, default=1800.0, help="the whole run, most (1800 s)"
    )
    parser.add_argument(
        "--database-url",
        default=None,
        help="a THROWAWAY PostgreSQL: its public schema dropped, made again and migrated; "
        "the queue and django-q2 tables emptied between phases",
    )
    parser.add_argument("--nginx-workers", default="1", help="nginx worker_processes (1)")
    parser.add_argument("--tmpdir", default=None, help="where the temp dir goes")
    args = parser.parse_args(argv)
    if not 1 <= args.period <= 60:
        parser.error(f"--period: between 1 and 60 seconds, not {args.period:g}")
    if args.period == 60 and args.stream_seconds is None:
        args.stream_seconds = 120.0
    args.stream_seconds = args.stream_seconds or 2 * args.period
    if args.rate <= 0 or args.rate > 200:
        parser.error(f"--rate: more than 0 and at most 200 a second, not {args.rate:g}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.role == "producer":
        producer_main()
        return 0
    signal.signal(signal.SIGTERM, sigterm_interrupts)
    # The global bound: the alarm ends the run as Ctrl-C would, through the finally below.
    signal.signal(signal.SIGALRM, sigterm_interrupts)
    signal.alarm(math.ceil(args.time_limit))
    workdir = Path(tempfile.mkdtemp(prefix="fd-django-q-", dir=args.tmpdir))
    bench = Bench(args, workdir)
    sink = Sink(args.hosts, workdir / "nginx", workers=args.nginx_workers)
    recipients = [Recipient(address) for address in RECIPIENTS]
    try:
        sink.start()
        for recipient in recipients:
            recipient.start()
        return benchmark(args, bench, sink, recipients)
    except KeyboardInterrupt:
        print(f"\ninterrupted (or past --time-limit), load {load_average()}", file=sys.stderr)
        return 130
    finally:
        signal.alarm(0)
        bench.stop_children()
        for recipient in recipients:
            recipient.stop()
        sink.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def benchmark(
    args: argparse.Namespace, bench: Bench, sink: Sink, recipients: list[Recipient]
) -> int:
    database = setup_database(bench.workdir, args.database_url)
    from django.conf import settings

    from django_federation_delivery.contrib.django_q import round_seconds

    ok, sockets, _ = keepalive_check(sink, b"{}")
    conf = settings.Q_CLUSTER
    print("django-federation-delivery: run_deliverer vs a django-q2 qcluster running rounds")
    for line in environment_lines():
        print(f"  {line}")
    print(f"  database: {database}")
    print(
        f"  qcluster: ORM broker, {conf['workers']} workers, poll {conf['poll']} s, timeout "
        f"{conf['timeout']} s, retry {conf['retry']} s: a round's default bound "
        f"{round_seconds():g} s"
    )
    print(f"  sink: nginx {sink.version()}, keep-alive check {ok}/50 on {sockets} socket(s)")
    print(flush=True)
    if not args.skip_drain:
        drains(args, bench, sink)
    if not args.skip_stream:
        streams(args, bench, recipients)
    print(f"load average at the end: {load_average()}")
    return 0


Figures = TypeVar("Figures", Drain, Stream)


def interleaved(count: int, run: Callable[[str, int], Figures]) -> list[dict[str, Figures]]:
    """``count`` rounds of both sides, the first swapped each round; each
    phase's line printed as it ends."""
    rounds: list[dict[str, Figures]] = []
    for number in range(1, count + 1):
        order = ("deliverer", "qcluster") if number % 2 else ("qcluster", "deliverer")
        print(f"round {number} ({' then '.join(order)}), load {load_average()}", flush=True)
        phases: dict[str, Figures] = {}
        for kind in order:
            phases[kind] = run(kind, number)
            print(phases[kind].line(), flush=True)
        rounds.append(phases)
    return rounds


def drains(args: argparse.Namespace, bench: Bench, sink: Sink) -> None:
    from django_federation_delivery.contrib.django_q import round_seconds

    bound = round_seconds(args.drain_round_seconds)
    print(
        f"fan-out drained: {args.deliveries} deliveries over {args.hosts} hosts, queued "
        f"beforehand; run_deliverer --drain started as a process | a running qcluster given "
        f"{bound:g} s rounds back to back; rounds {args.rounds}"
    )
    served = Served(sink)
    warm = sink.url(0, "/users/warm/inbox")
    rounds = interleaved(
        args.rounds, lambda kind, number: drain_phase(args, bench, kind, sink, served, warm)
    )

    def median(kind: str, value: Callable[[Drain], float]) -> float:
        return median_or_nan([value(phases[kind]) for phases in rounds])

    rate = median_or_nan([p["qcluster"].rate / p["deliverer"].rate for p in rounds])
    cpu = median_or_nan([p["qcluster"].cpu_ms / p["deliverer"].cpu_ms for p in rounds])
    print(
        f"median: run_deliverer {median('deliverer', lambda p: p.rate):.1f}/s (first 202 after "
        f"{median('deliverer', lambda p: p.first):.2f} s, last after "
        f"{median('deliverer', lambda p: p.last):.2f} s), qcluster "
        f"{median('qcluster', lambda p: p.rate):.1f}/s (first "
        f"{median('qcluster', lambda p: p.first):.2f} s, last "
        f"{median('qcluster', lambda p: p.last):.2f} s)"
    )
    print(
        f"median ratio qcluster/run_deliverer: rate {rate:.3f}; CPU a delivery {cpu:.2f}x "
        f"({median('qcluster', lambda p: p.cpu_ms):.2f} / "
        f"{median('deliverer', lambda p: p.cpu_ms):.2f} ms); load {load_average()}",
        flush=True,
    )
    print()


def streams(args: argparse.Namespace, bench: Bench, recipients: list[Recipient]) -> None:
    schedule = Schedule(args.period)
    print(
        f"steady stream: {args.rate:g} one-inbox sends a second for {args.stream_seconds:g} s "
        f"({len(recipients)} inbox hosts, in this process); run_deliverer running | a qcluster "
        f"with {schedule.describe()}; rounds {args.stream_rounds}"
    )
    rounds = interleaved(
        args.stream_rounds,
        lambda kind, number: stream_phase(args, bench, kind, recipients, number),
    )
    for kind in ("deliverer", "qcluster"):
        name = "run_deliverer" if kind == "deliverer" else "qcluster"
        print(
            f"median over rounds, {name}: send→received median "
            f"{median_or_nan([p[kind].median for p in rounds]):.3f} s, p90 "
            f"{median_or_nan([p[kind].figure(0.9) for p in rounds]):.3f} s, max "
            f"{median_or_nan([p[kind].figure(1.0) for p in rounds]):.3f} s"
        )
    ratio = median_or_nan([p["qcluster"].median / p["deliverer"].median for p in rounds])
    print(f"median latency ratio qcluster/run_deliverer: {ratio:.1f}x; load {load_average()}")
    print()


if __name__ == "__main__":
    sys.exit(main())
