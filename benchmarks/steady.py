#!/usr/bin/env python
"""Steady stream: sends arriving one at a time while ``run_deliverer`` runs.

A **producer** process calls ``send()`` as fast as it can, each send in its
own transaction as a web request would make it: one inbox each, or with
``--mix`` one send in five to 20 inboxes. On the other side, either

* ``manage.py run_deliverer`` (``--processes N``), a process of its own with
  the default settings, started before the producer; or
* a **bare pool**: N processes of 16 threads that only sign and POST, fed by
  the same producer, which hands each inbox to them through a pipe once its
  ``send()`` has committed.

Timed from the producer's first ``send()`` to the last 202 counted at the
sink (nginx on 127.0.0.10 …, as throughput.py). With ``--faults`` the
deliverer runs twice instead: with 20 % of the hosts answering 503 and 5 %
never answering, and with every host healthy; the figure is the time until
every delivery to a healthy host has its 202.

Prints figures, asserts nothing. See benchmarks/README.rst.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import cProfile
import dataclasses
import io
import json
import os
import pstats
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

if not __package__:  # run as a script: benchmarks/ is on the path, the repository is not
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (
    FIRST_HOST,
    ROOT,
    BarePoster,
    Sink,
    _die_with_parent,
    around_worker_threads,
    clear_all,
    environment_lines,
    keepalive_check,
    load_average,
    make_activity,
    median_or_nan,
    migrate_fresh,
    positive,
    sigterm_interrupts,
    stat_fields,
)

SENDER = "https://social.example/users/alice"  # tests.keys.ALICE
#: A send of --mix goes to this many inboxes, one send in MIX_EVERY.
MIX_INBOXES = 20
MIX_EVERY = 5
#: How often the sink's counters are read while a phase runs.
POLL = 0.02
CONFIG_ENV = "FD_STEADY_CONFIG"

# --- The child processes ------------------------------------------------------------------------


def child_env(workdir: Path, database_url: str | None) -> dict[str, str]:
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "benchmarks.settings"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.pop("FD_SETTINGS_JSON", None)  # the package's defaults, and tests.settings' two
    if database_url:
        env["DATABASE_URL"] = database_url
    else:
        env.pop("DATABASE_URL", None)
        env["FD_SQLITE_NAME"] = str(workdir / "queue.sqlite3")
    return env


def setup_child() -> dict[str, Any]:
    import django

    django.setup()
    return dict(json.loads(os.environ[CONFIG_ENV]))


def producer_main() -> None:
    """Send the plan, one ``send()`` a transaction; hand each inbox to the
    bare pools' pipes (round robin) once its send has committed."""
    config = setup_child()
    from django.db import connection, transaction

    from django_federation_delivery import send

    plan: list[list[str]] = json.loads(Path(config["plan"]).read_text())
    pipes: list[int] = config["pipes"]
    activity = make_activity(SENDER)
    counter = SqlCounter() if config.get("count_sql") else None
    connection.ensure_connection()
    profile = cProfile.Profile() if config.get("profile") else None
    durations: list[float] = []
    turn = 0
    cpu = time.process_time()
    first = time.monotonic()
    if profile is not None:
        profile.enable()
    for number, inboxes in enumerate(plan):
        # A send of its own (its activity's id), as each post or follow is.
        one = {**activity, "id": f"{SENDER}/statuses/{number}/activity"}
        started = time.perf_counter()
        with transaction.atomic():
            send(SENDER, one, inboxes)
        durations.append(time.perf_counter() - started)
        for inbox in inboxes:
            if pipes:
                os.write(pipes[turn % len(pipes)], inbox.encode() + b"\n")
                turn += 1
    if profile is not None:
        profile.disable()
        profile.dump_stats(Path(config["profile"]) / "producer.pstats")
    last = time.monotonic()
    cpu = time.process_time() - cpu
    for fd in pipes:
        os.close(fd)
    durations.sort()
    result = {
        "first": first,
        "last": last,
        "cpu": cpu,
        "sends": len(plan),
        "median_ms": 1000 * statistics.median(durations),
        "p90_ms": 1000 * durations[int(0.9 * (len(durations) - 1))],
        "sql": counter.figures() if counter is not None else None,
    }
    print(json.dumps(result), flush=True)


def pool_main() -> None:
    """A bare pool: 16 threads that sign (draft-cavage) and POST each inbox
    read from stdin, with the transport the deliverer's workers use (its
    connections a thread's own, or with "shared" one set for the threads)."""
    config = setup_child()
    from django_federation_delivery.conf import app_settings
    from tests.keys import sender_key

    key = sender_key(SENDER)
    assert key is not None
    settings = app_settings.transport_settings()
    body = Path(config["body"]).read_bytes()
    digest = config["digest"]
    poster = BarePoster(body, digest, key, settings, shared=config["shared"])

    print("ready", flush=True)
    with ThreadPoolExecutor(config["threads"], thread_name_prefix="bare-pool") as pool:
        futures = [pool.submit(poster, line.decode().strip()) for line in sys.stdin.buffer]
    delivered = sum(future.result() for future in futures)
    poster.close()
    print(json.dumps({"delivered": delivered, "errors": poster.errors[:3]}), flush=True)


class SqlCounter:
    """Counts every statement of this process and the time spent in it, by
    its first word(s); COMMIT included (Django commits on the connection,
    not through a cursor). ``BEGIN IMMEDIATE`` is where SQLite waits for
    the write lock: its time is the process's lock waits."""

    def __init__(self) -> None:
        from django.db.backends.signals import connection_created

        self.counts: collections.Counter[str] = collections.Counter()
        self.seconds: collections.defaultdict[str, float] = collections.defaultdict(float)
        self.lock = threading.Lock()
        connection_created.connect(self.created, weak=False)
        from django.db import connection

        if connection.connection is not None:
            self.created(None, connection)

    def note(self, kind: str, seconds: float) -> None:
        with self.lock:
            self.counts[kind] += 1
            self.seconds[kind] += seconds

    def created(self, sender: Any, connection: Any, **kwargs: Any) -> None:
        if self.wrap not in connection.execute_wrappers:
            # The outermost: a BEGIN the deliverer tries again until it takes
            # the lock (writelock.py) is one statement, its sleeps included.
            connection.execute_wrappers.insert(0, self.wrap)
        commit = connection._commit
        if getattr(commit, "counted", False):
            return

        def counted_commit() -> Any:
            started = time.perf_counter()
            try:
                return commit()
            finally:
                self.note("COMMIT", time.perf_counter() - started)

        counted_commit.counted = True  # type: ignore[attr-defined]
        connection._commit = counted_commit

    def wrap(self, execute: Callable[..., Any], sql: str, *rest: Any) -> Any:
        started = time.perf_counter()
        try:
            return execute(sql, *rest)
        finally:
            words = sql.split(None, 2)
            kind = words[0].upper() if words else "?"
            if kind == "BEGIN" and len(words) > 1:
                kind += " " + words[1].upper()
            self.note(kind, time.perf_counter() - started)

    def figures(self) -> dict[str, Any]:
        with self.lock:
            return {"counts": dict(self.counts), "seconds": dict(self.seconds)}


def deliverer_main() -> None:
    """``run_deliverer`` (one process) with statements counted and/or the
    coordinator and workers profiled: the diagnostic run, not a timed one."""
    config = setup_child()
    from django.core.management import call_command

    with contextlib.ExitStack() as stack:
        if config.get("count_sql"):
            counter = SqlCounter()
            # The CPU of each thread: the coordinator's, and the workers' together.
            threads = {"coordinator": 0.0, "workers": 0.0}
            adding = threading.Lock()

            def worker_ended(begun: None) -> None:
                with adding:
                    # A worker's CPU time since its thread started.
                    threads["workers"] += time.thread_time()

            stack.enter_context(around_worker_threads(lambda: None, worker_ended))
            started = time.thread_time()

            def dump() -> None:
                threads["coordinator"] = time.thread_time() - started
                figures = {**counter.figures(), "threads": threads}
                Path(config["count_sql"]).write_text(json.dumps(figures))

            stack.callback(dump)
        directory = config.get("profile")
        if directory:
            profiles: list[cProfile.Profile] = []
            lock = threading.Lock()

            def profile_worker() -> cProfile.Profile:
                profile = cProfile.Profile(time.thread_time)
                with lock:
                    profiles.append(profile)
                profile.enable()
                return profile

            def dump_profiles() -> None:
                coordinator.disable()
                coordinator.dump_stats(Path(directory) / "coordinator.pstats")
                merged = pstats.Stats(profiles[0])
                for profile in profiles[1:]:
                    merged.add(profile)
                merged.dump_stats(Path(directory) / "workers.pstats")

            stack.enter_context(around_worker_threads(profile_worker, cProfile.Profile.disable))
            coordinator = cProfile.Profile(time.thread_time)
            coordinator.enable()
            stack.callback(dump_profiles)
        call_command("run_deliverer", verbosity=0)


# --- The coordinator ----------------------------------------------------------------------------


def tree_pids(pid: int) -> list[int]:
    pids, todo = [], [pid]
    while todo:
        current = todo.pop()
        pids.append(current)
        with contextlib.suppress(OSError, ValueError):
            children = Path(f"/proc/{current}/task/{current}/children").read_text()
            todo.extend(int(child) for child in children.split())
    return pids


def loop_pids(root: int, processes: int) -> list[int]:
    """The processes of ``run_deliverer`` (pid ``root``) that run a loop: itself,
    or with ``--processes`` above 1 its supervisor's children, less the
    resource tracker that multiprocessing starts beside them."""
    if processes == 1:
        return [root]
    loops = []
    for pid in tree_pids(root)[1:]:
        with contextlib.suppress(OSError):
            if b"resource_tracker" not in Path(f"/proc/{pid}/cmdline").read_bytes():
                loops.append(pid)
    return loops


def connected_to(pids: set[int], port: int) -> set[int]:
    """Those of ``pids`` with a TCP connection open to ``port`` on loopback:
    their sockets' inodes, looked up in /proc/net/tcp."""
    inodes: dict[str, int] = {}
    for pid in pids:
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if target.startswith("socket:["):
                        inodes[target[8:-1]] = pid
    found: set[int] = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        # The remote address as HEXIP:HEXPORT; state 01 is ESTABLISHED.
        remote_port = int(fields[2].rsplit(":", 1)[1], 16)
        if remote_port == port and fields[3] == "01" and fields[9] in inodes:
            found.add(inodes[fields[9]])
    return found


def cpu_seconds(pids: Sequence[int], *, ended: bool = False) -> float:
    """CPU used so far by these processes and their children; with ``ended``
    also by the children each root has waited for since it started (a
    PostgreSQL server's backends that have exited)."""
    ticks = 0
    for root in pids:
        for pid in tree_pids(root):
            with contextlib.suppress(OSError, ValueError, IndexError):
                fields = stat_fields(f"/proc/{pid}/stat")
                ticks += int(fields[11]) + int(fields[12])
                if ended and pid == root:
                    ticks += int(fields[13]) + int(fields[14])
    return ticks / os.sysconf("SC_CLK_TCK")


def thread_cpu(pids: Sequence[int]) -> tuple[float, float]:
    """CPU used so far by the main threads of these processes and their
    children (a deliverer's coordinators, and a supervisor's idle one), and by
    their other threads (the workers; on PostgreSQL the listener too). A
    thread that has ended is no longer counted: read it while they run."""
    ticks = [0, 0]
    for root in pids:
        for pid in tree_pids(root):
            tasks: list[str] = []
            with contextlib.suppress(OSError):
                tasks = os.listdir(f"/proc/{pid}/task")
            for task in tasks:
                with contextlib.suppress(OSError, ValueError, IndexError):
                    fields = stat_fields(f"/proc/{pid}/task/{task}/stat")
                    ticks[int(task) != pid] += int(fields[11]) + int(fields[12])
    hz = os.sysconf("SC_CLK_TCK")
    return ticks[0] / hz, ticks[1] / hz


def server_pid() -> int | None:
    """The PostgreSQL postmaster's pid when it runs on this machine (its
    backends are its children), or None: SQLite, or a server elsewhere."""
    from django.db import connection

    if connection.vendor != "postgresql":
        return None
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        backend = int(cursor.fetchone()[0])
    with contextlib.suppress(OSError, ValueError, IndexError):
        status = Path(f"/proc/{backend}/status").read_text()
        parent = int(status.split("\nPPid:", 1)[1].split()[0])
        if Path(f"/proc/{parent}/cmdline").read_bytes().split(b"\0")[0].endswith(b"postgres"):
            return parent
    return None


def machine_ticks() -> tuple[int, int]:
    """(busy, all) jiffies of every CPU so far, from /proc/stat."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]
    return sum(fields) - idle, sum(fields)


class Served:
    """Requests a sink answered, less the counters' own queries."""

    def __init__(self, sink: Sink) -> None:
        self.sink = sink
        self.queries = 0

    def __call__(self) -> int:
        _, served = self.sink.counters()
        self.queries += 1
        return served - self.queries


@dataclasses.dataclass
class Phase:
    name: str
    expected: int
    delivered: int
    seconds: float
    cpu: float  # the deliverer's (or the pools') processes
    producer: dict[str, Any]
    busy: float  # the machine's share of CPU time in use
    note: str = ""
    #: Connections the sink accepted during the phase, when it counts them.
    connections: int | None = None
    #: CPU of the PostgreSQL server on this machine (every backend, the
    #: producer's too), when there is one.
    server: float | None = None
    #: The deliverer's CPU by thread: its processes' main threads (the
    #: coordinators) and their other threads (the workers).
    threads: tuple[float, float] | None = None

    @property
    def rate(self) -> float:
        return self.delivered / self.seconds if self.seconds > 0 else 0.0

    @property
    def cpu_ms(self) -> float:
        return 1000 * self.cpu / self.delivered if self.delivered else float("nan")

    @property
    def server_ms(self) -> float:
        if self.server is None or not self.delivered:
            return float("nan")
        return 1000 * self.server / self.delivered

    def threads_ms(self) -> tuple[float, float]:
        if self.threads is None or not self.delivered:
            return float("nan"), float("nan")
        main, others = self.threads
        return 1000 * main / self.delivered, 1000 * others / self.delivered

    @property
    def producer_ms(self) -> float:
        """The producer's CPU per delivery it queued."""
        return 1000 * self.producer["cpu"] / self.expected if self.producer else float("nan")

    def line(self) -> str:
        send = (
            f"send() {self.producer['median_ms']:.2f}/{self.producer['p90_ms']:.2f} ms "
            f"median/p90, producer {self.producer['last'] - self.producer['first']:.2f} s"
            if self.producer
            else "producer: no result"
        )
        server = "" if self.server is None else f", server {self.server_ms:.2f}"
        if self.threads is not None:
            main, others = self.threads_ms()
            server += f"; coordinators {main:.2f}, workers {others:.2f}"
        return (
            f"  {self.name:<24} {self.delivered:>6}/{self.expected:<6} in {self.seconds:6.2f} s "
            f"{self.rate:7.1f}/s  cpu {self.cpu_ms:.2f} ms/delivery (producer "
            f"{self.producer_ms:.2f}{server})  {send}  machine {100 * self.busy:.0f}% busy"
            f"{'' if self.connections is None else f', {self.connections} connections'}"
            f"{self.note}"
        )


class Bench:
    def __init__(self, args: argparse.Namespace, workdir: Path) -> None:
        self.args = args
        self.workdir = workdir
        self.env = child_env(workdir, args.database_url)
        self.children: list[subprocess.Popen[bytes]] = []
        self.body_file = workdir / "body.json"
        self.digest = ""
        #: The local PostgreSQL server's postmaster, once the database is set up.
        self.server: int | None = None

    def spawn(
        self, command: list[str], config: dict[str, Any] | None = None, **kwargs: Any
    ) -> subprocess.Popen[bytes]:
        env = {**self.env, CONFIG_ENV: json.dumps(config or {})}
        process = subprocess.Popen(
            command,
            env=env,
            cwd=ROOT,
            start_new_session=True,  # Ctrl-C is the coordinator's to handle
            preexec_fn=_die_with_parent,
            **kwargs,
        )
        self.children.append(process)
        return process

    def role(self, name: str) -> list[str]:
        return [sys.executable, str(Path(__file__).resolve()), "--role", name]

    def stop_children(self) -> None:
        for process in self.children:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in self.children:
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(5)
        self.children.clear()

    def warm_up(
        self,
        deliverer: subprocess.Popen[bytes],
        counter: Callable[[], int],
        inbox: str,
        processes: int,
    ) -> None:
        """Ready once each of its loop processes has delivered a warm-up send
        (not counted): each is up, the package imported, the sender's key
        made, and the deliverer idle. Which loop claims a send is theirs to
        settle, so warm-up sends go one at a time until each has connected to
        the sink."""
        from django_federation_delivery import send

        port = urllib.parse.urlsplit(inbox).port
        assert port is not None
        deadline = time.monotonic() + 60
        waiting: set[int] = set()
        while not waiting:  # --processes: the supervisor's children, once started
            waiting = set(loop_pids(deliverer.pid, processes))
            if len(waiting) < processes:
                waiting = set()
                if time.monotonic() > deadline or deliverer.poll() is not None:
                    raise RuntimeError("run_deliverer did not start its processes")
                time.sleep(POLL)
        while waiting:
            # Each loop looks for new work on a timer of its own: a send made
            # at a random moment goes to each of them in turn, sooner or later.
            time.sleep(random.uniform(0, 0.3))
            before = counter()
            send(SENDER, make_activity(SENDER), [inbox])
            while counter() < before + 1:
                if time.monotonic() > deadline or deliverer.poll() is not None:
                    raise RuntimeError("run_deliverer did not deliver a warm-up send")
                time.sleep(POLL)
            waiting -= connected_to(waiting, port)

    def run_phase(
        self,
        name: str,
        side: str,
        plan: list[list[str]],
        counter: Callable[[], int],
        expected: int,
        warm_inbox: str,
        *,
        diagnose: dict[str, Any] | None = None,
        before_stop: Callable[[], None] = lambda: None,
    ) -> Phase:
        """One run: ``side`` is "deliverer" or "bare"; ``counter`` counts the
        202s that finish the phase (``expected`` of them)."""
        clear_all()
        plan_file = self.workdir / "plan.json"
        plan_file.write_text(json.dumps(plan))
        processes = self.args.processes
        sides: list[subprocess.Popen[bytes]] = []
        pipes: list[int] = []
        pools: list[subprocess.Popen[bytes]] = []
        try:
            if side == "deliverer":
                if diagnose:
                    command = self.role("deliverer")
                else:
                    command = [sys.executable, "-m", "django", "run_deliverer", "-v", "0"]
                    command += ["--processes", str(processes)]
                # Its progress lines would only interleave with the figures.
                sides.append(self.spawn(command, diagnose, stdout=subprocess.DEVNULL))
                self.warm_up(sides[0], counter, warm_inbox, 1 if diagnose else processes)
                time.sleep(1.0)  # into its idle wait, as between a server's posts
            else:
                for _ in range(processes):
                    read, write = os.pipe()
                    pool = self.spawn(
                        self.role("pool"),
                        {
                            "body": str(self.body_file),
                            "digest": self.digest,
                            "threads": 16,
                            "shared": self.args.bare_shared,
                        },
                        stdin=read,
                        stdout=subprocess.PIPE,
                    )
                    os.close(read)
                    pipes.append(write)
                    pools.append(pool)
                    assert pool.stdout is not None
                    if pool.stdout.readline().strip() != b"ready":
                        raise RuntimeError("a bare pool did not start")
                sides.extend(pools)
            pids = [process.pid for process in sides]
            served = counter if isinstance(counter, Served) else None
            if served is not None:
                accepted, queries = served.sink.counters()[0], served.queries
            base = counter()
            cpu = cpu_seconds(pids)
            threads = thread_cpu(pids) if side == "deliverer" else None
            server = cpu_seconds([self.server], ended=True) if self.server else None
            busy, ticks = machine_ticks()
            config = {"plan": str(plan_file), "pipes": pipes}
            if diagnose:
                config.update(diagnose)
            producer = self.spawn(
                self.role("producer"), config, stdout=subprocess.PIPE, pass_fds=pipes
            )
            for fd in pipes:
                os.close(fd)
            pipes = []
            deadline = time.monotonic() + self.args.timeout
            done, finished = 0, None
            while time.monotonic() < deadline:
                done = counter() - base
                if done >= expected:
                    finished = time.monotonic()
                    break
                if producer.poll() not in (None, 0):
                    break
                time.sleep(POLL)
            cpu = cpu_seconds(pids) - cpu
            if threads is not None:
                after = thread_cpu(pids)
                threads = (after[0] - threads[0], after[1] - threads[1])
            if server is not None:
                server = cpu_seconds([self.server], ended=True) - server
            busy_after, ticks_after = machine_ticks()
            connections = None
            if served is not None:
                # Each query of the counters is a connection of its own.
                made = served.queries - queries + 1
                connections = served.sink.counters()[0] - accepted - made
            out, _ = producer.communicate(timeout=60)
            result = json.loads(out.splitlines()[-1]) if out.strip() else {}
            note = ""
            if finished is None:
                note = f"   NOT THROUGH within {self.args.timeout:.0f} s"
                finished = time.monotonic()
            seconds = finished - result["first"] if result else float("nan")
            before_stop()
            if side == "deliverer":
                for process in sides:
                    process.send_signal(signal.SIGTERM)
            # The pools end by themselves: the producer closed their pipes.
            for process in sides:
                process.wait(60)
            for pool in pools:
                assert pool.stdout is not None
                answer = json.loads(pool.stdout.read().splitlines()[-1])
                if answer["errors"]:
                    note += f"   pool errors, first: {answer['errors'][0]}"
            return Phase(
                name=name,
                expected=expected,
                delivered=done,
                seconds=seconds,
                cpu=cpu,
                producer=result,
                busy=(busy_after - busy) / max(1, ticks_after - ticks),
                note=note,
                connections=connections,
                server=server,
                threads=threads,
            )
        finally:
            for fd in pipes:
                os.close(fd)
            self.stop_children()


def make_plan(sends: int, mix: bool, url: Callable[[int, str], str], hosts: int) -> list[list[str]]:
    """Each send's inboxes: one, or with ``mix`` 20 on 20 hosts one send in
    five; inbox n on host n mod H."""
    plan, n = [], 0
    for number in range(sends):
        count = MIX_INBOXES if mix and number % MIX_EVERY == MIX_EVERY - 1 else 1
        plan.append([url(i % hosts, f"/users/u{i}/inbox") for i in range(n, n + count)])
        n += count
    return plan


def setup_database(workdir: Path, database_url: str | None) -> str:
    os.environ.update(child_env(workdir, database_url))
    if not database_url:
        os.environ.pop("DATABASE_URL", None)
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    import django
    from django.db import connection

    django.setup()
    migrate_fresh()
    clear_all()
    if connection.vendor == "sqlite":
        with connection.cursor() as cursor:
            cursor.execute("PRAGMA journal_mode")
            mode = cursor.fetchone()[0]
            cursor.execute("PRAGMA synchronous")
            sync = {0: "OFF", 1: "NORMAL", 2: "FULL", 3: "EXTRA"}[cursor.fetchone()[0]]
        return f"SQLite, journal_mode={mode}, synchronous={sync}, BEGIN IMMEDIATE, timeout 20 s"
    with connection.cursor() as cursor:
        cursor.execute("SELECT version()")
        return str(cursor.fetchone()[0]).split(" on ")[0]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="run_deliverer against a bare pool, fed one send() at a time by a "
        "producer process, on nginx answering 202 on loopback. Prints figures; asserts nothing."
    )
    parser.add_argument("--role", default="coordinator", help=argparse.SUPPRESS)
    parser.add_argument("--sends", type=positive, default=None, help="sends (3000; 2000 --faults)")
    parser.add_argument("--hosts", type=positive, default=100, help="sink addresses (100)")
    parser.add_argument("--mix", action="store_true", help="one send in five to 20 inboxes")
    parser.add_argument(
        "--bare-shared",
        action="store_true",
        help="the bare pool's threads share their connections, as the deliverer's workers do",
    )
    parser.add_argument(
        "--processes", type=positive, default=1, help="run_deliverer --processes N; N bare pools"
    )
    parser.add_argument(
        "--faults",
        action="store_true",
        help="the deliverer with 20%% of hosts answering 503 and 5%% silent, against all healthy",
    )
    parser.add_argument("--failing", type=float, default=0.20, help="--faults: 503 share (0.2)")
    parser.add_argument("--silent", type=float, default=0.05, help="--faults: silent share (0.05)")
    parser.add_argument("--seed", type=int, default=1, help="--faults: which hosts are faulty")
    parser.add_argument("--rounds", type=positive, default=5, help="rounds (5)")
    parser.add_argument("--timeout", type=float, default=180.0, help="most a phase may take (180)")
    parser.add_argument(
        "--database-url",
        default=None,
        help="a THROWAWAY PostgreSQL: its public schema dropped, made again and migrated; "
        "every batch deleted between phases",
    )
    parser.add_argument(
        "--count-sql",
        action="store_true",
        help="after the rounds, one more deliverer run counting its statements and lock waits",
    )
    parser.add_argument(
        "--profile",
        type=Path,
        default=None,
        metavar="DIR",
        help="after the rounds, one more deliverer run under cProfile (coordinator, workers, "
        "producer), written to DIR/*.pstats; the top functions printed",
    )
    parser.add_argument("--profile-top", type=int, default=20, help="functions shown (20)")
    parser.add_argument("--nginx-workers", default="1", help="nginx worker_processes (1)")
    parser.add_argument("--tmpdir", default=None, help="where the temp dir goes")
    args = parser.parse_args(argv)
    if args.sends is None:
        args.sends = 2000 if args.faults else 3000
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    roles = {"producer": producer_main, "pool": pool_main, "deliverer": deliverer_main}
    if args.role in roles:
        roles[args.role]()
        return 0
    signal.signal(signal.SIGTERM, sigterm_interrupts)
    workdir = Path(tempfile.mkdtemp(prefix="fd-steady-", dir=args.tmpdir))
    bench = Bench(args, workdir)
    sinks: list[Sink] = []
    try:
        if args.faults:
            return faults(args, bench, sinks)
        return compare(args, bench, sinks)
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    finally:
        bench.stop_children()
        for sink in sinks:
            sink.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def prepare(bench: Bench, database: str, sink: Sink) -> None:
    """The body the bare pools send: that of a batch queued by send()."""
    from django_federation_delivery import send
    from django_federation_delivery.models import Batch

    send(SENDER, make_activity(SENDER), [sink.url(0, "/users/probe/inbox")])
    batch = Batch.objects.get()
    bench.body_file.write_text(batch.body)
    bench.digest = batch.body_sha256
    clear_all()
    ok, sockets, _ = keepalive_check(sink, batch.body.encode())
    for line in environment_lines():
        print(f"  {line}")
    print(f"  database: {database}")
    print(f"  sink: {sink.version()}, keep-alive check {ok}/50 on {sockets} socket(s)")
    print(flush=True)


def compare(args: argparse.Namespace, bench: Bench, sinks: list[Sink]) -> int:
    sink = Sink(args.hosts, bench.workdir / "nginx", workers=args.nginx_workers)
    sinks.append(sink)
    sink.start()
    database = setup_database(bench.workdir, args.database_url)
    bench.server = server_pid()
    plan = make_plan(args.sends, args.mix, sink.url, args.hosts)
    expected = sum(map(len, plan))
    shape = f"{args.sends} sends" + (
        f", one in {MIX_EVERY} to {MIX_INBOXES} inboxes" if args.mix else ", one inbox each"
    )
    print("django-federation-delivery steady stream: run_deliverer vs a bare pool, same producer")
    print(f"  {shape}: {expected} deliveries over {args.hosts} hosts; rounds {args.rounds}")
    print(
        f"  run_deliverer --processes {args.processes} (default settings) | bare pool: "
        f"{args.processes} process(es) x 16 threads fed through pipes, "
        + ("sharing their connections" if args.bare_shared else "each with its own connections")
    )
    prepare(bench, database, sink)
    served = Served(sink)
    warm = sink.url(0, "/users/warm/inbox")
    rounds: list[dict[str, Phase]] = []
    for number in range(1, args.rounds + 1):
        order = ("bare", "deliverer") if number % 2 else ("deliverer", "bare")
        print(f"round {number} ({' then '.join(order)}), load {load_average()}", flush=True)
        phases = {}
        for side in order:
            name = "bare pool" if side == "bare" else f"run_deliverer -p {args.processes}"
            phases[side] = bench.run_phase(name, side, plan, served, expected, warm)
            print(phases[side].line(), flush=True)
        print(f"  ratio deliverer/bare: {phases['deliverer'].rate / phases['bare'].rate:.3f}")
        rounds.append(phases)
    report(rounds)
    if args.count_sql or args.profile:
        diagnose(args, bench, plan, served, expected, warm)
    return 0


def report(rounds: list[dict[str, Phase]]) -> None:
    print()
    header = (
        f"{'round':<7}{'bare/s':>9}{'deliv/s':>9}{'ratio':>8}{'cpu ms bare':>13}{'deliv':>7}"
        f"{'x':>7}{'producer ms b/d':>17}{'send ms med/p90 (d)':>22}{'busy b/d':>11}"
    )
    print(header)
    print("-" * len(header))
    for number, phases in enumerate(rounds, 1):
        b, d = phases["bare"], phases["deliverer"]
        send_ms = f"{d.producer.get('median_ms', 0):.2f} / {d.producer.get('p90_ms', 0):.2f}"
        print(
            f"{number:<7}{b.rate:>9.1f}{d.rate:>9.1f}{d.rate / b.rate:>8.3f}{b.cpu_ms:>13.2f}"
            f"{d.cpu_ms:>7.2f}{d.cpu_ms / b.cpu_ms:>7.2f}"
            f"{f'{b.producer_ms:.2f} / {d.producer_ms:.2f}':>17}"
            f"{send_ms:>22} "
            f"{f'{100 * b.busy:.0f}% / {100 * d.busy:.0f}%':>11}"
        )

    def median(side: str, value: Callable[[Phase], float]) -> float:
        return median_or_nan([value(phases[side]) for phases in rounds])

    ratio = median_or_nan([p["deliverer"].rate / p["bare"].rate for p in rounds])
    cpu_ratio = median_or_nan([p["deliverer"].cpu_ms / p["bare"].cpu_ms for p in rounds])
    print("-" * len(header))
    print(
        f"median: bare {median('bare', lambda p: p.rate):.1f}/s, deliverer "
        f"{median('deliverer', lambda p: p.rate):.1f}/s, ratio {ratio:.3f} (target >= 0.9)"
    )
    print(
        f"median CPU ms a delivery: bare {median('bare', lambda p: p.cpu_ms):.2f}, deliverer "
        f"{median('deliverer', lambda p: p.cpu_ms):.2f}, ratio {cpu_ratio:.2f}x (target <= 1.15x); "
        f"producer {median('bare', lambda p: p.producer_ms):.2f} / "
        f"{median('deliverer', lambda p: p.producer_ms):.2f}"
    )
    print(
        f"median deliverer CPU ms a delivery by thread: coordinators "
        f"{median('deliverer', lambda p: p.threads_ms()[0]):.2f}, workers "
        f"{median('deliverer', lambda p: p.threads_ms()[1]):.2f}"
    )
    print(
        f"median send(): {median('deliverer', lambda p: p.producer.get('median_ms', 0)):.2f} ms, "
        f"p90 {median('deliverer', lambda p: p.producer.get('p90_ms', 0)):.2f} ms "
        f"(with the deliverer running); with the bare pool "
        f"{median('bare', lambda p: p.producer.get('median_ms', 0)):.2f} / "
        f"{median('bare', lambda p: p.producer.get('p90_ms', 0)):.2f} ms"
    )
    if rounds and rounds[0]["bare"].server is not None:
        print(
            "median PostgreSQL server CPU ms a delivery (all its processes, the producer's "
            f"backend too): bare {median('bare', lambda p: p.server_ms):.2f}, deliverer "
            f"{median('deliverer', lambda p: p.server_ms):.2f}"
        )
    print(f"load average at the end: {load_average()}")
    short = [
        f"round {n} {side}: {p.delivered}/{p.expected}"
        for n, phases in enumerate(rounds, 1)
        for side, p in phases.items()
        if p.delivered < p.expected
    ]
    print("WARNING: not all delivered: " + "; ".join(short) if short else "all delivered")


def diagnose(
    args: argparse.Namespace,
    bench: Bench,
    plan: list[list[str]],
    counter: Callable[[], int],
    expected: int,
    warm: str,
) -> None:
    """One more deliverer run (one process), with statements counted and/or
    cProfile on: its time is not a figure."""
    config: dict[str, Any] = {}
    sql_file = bench.workdir / "sql.json"
    if args.count_sql:
        config["count_sql"] = str(sql_file)
    if args.profile:
        args.profile.mkdir(parents=True, exist_ok=True)
        config["profile"] = str(args.profile.resolve())
    processes, args.processes = args.processes, 1
    print("\ndiagnostic run (one run_deliverer process; not a figure) …", flush=True)
    phase = bench.run_phase(
        "run_deliverer (diag)", "deliverer", plan, counter, expected, warm, diagnose=config
    )
    args.processes = processes
    print(phase.line())
    if args.count_sql:
        for who, figures in (
            ("deliverer", json.loads(sql_file.read_text())),
            ("producer", phase.producer.get("sql") or {}),
        ):
            counts, seconds = figures.get("counts", {}), figures.get("seconds", {})
            total = sum(counts.values())
            per = "delivery" if who == "deliverer" else "send"
            n = expected if who == "deliverer" else len(plan)
            print(
                f"  {who}: {total / n:.2f} statements a {per} (COMMIT included; the warm-up's "
                f"and idle polls' too), {1000 * sum(seconds.values()) / n:.2f} ms in them a {per}"
            )
            for kind, count in sorted(counts.items(), key=lambda kv: -kv[1]):
                print(
                    f"    {kind:<18} {count:>7}  {count / n:6.2f}/{per}  "
                    f"{1000 * seconds[kind]:9.1f} ms in all, "
                    f"{1000 * seconds[kind] / count:6.2f} ms each"
                )
            if threads := figures.get("threads"):
                print(
                    f"    CPU a delivery: the coordinator's {1000 * threads['coordinator'] / n:.2f}"
                    f" ms, the workers' {1000 * threads['workers'] / n:.2f} ms (thread times)"
                )
    if args.profile:
        for name in ("coordinator", "workers", "producer"):
            path = args.profile / f"{name}.pstats"
            if not path.exists():
                continue
            out = io.StringIO()
            stats = pstats.Stats(str(path), stream=out)
            stats.strip_dirs().sort_stats("cumulative").print_stats(args.profile_top)
            text = out.getvalue()
            print(f"\n--- {name}, by cumulative time ---")
            print(text[text.find("   ncalls") :].rstrip())


def faults(args: argparse.Namespace, bench: Bench, sinks: list[Sink]) -> int:
    from benchmarks.faults import SilentHosts

    addresses = [f"127.0.0.{FIRST_HOST + n}" for n in range(args.hosts)]
    chooser = random.Random(args.seed)
    faulty = chooser.sample(addresses, round(args.hosts * (args.failing + args.silent)))
    failing = sorted(faulty[: round(args.hosts * args.failing)])
    quiet = sorted(set(faulty) - set(failing))
    healthy = [a for a in addresses if a not in faulty]
    good = Sink(healthy, bench.workdir / "good", workers=args.nginx_workers)
    bad = Sink(["127.0.0.250"], bench.workdir / "bad", failing={a: 503 for a in failing})
    fine = Sink(sorted(faulty), bench.workdir / "fine", workers=args.nginx_workers)
    sinks.extend([good, bad, fine])
    for sink in sinks:
        sink.start()
    silent = SilentHosts(quiet)
    silent.start()
    database = setup_database(bench.workdir, args.database_url)
    bench.server = server_pid()

    def url(with_faults: bool) -> Callable[[int, str], str]:
        def at(n: int, path: str) -> str:
            address = addresses[n]
            if address in healthy:
                return good.url_at(address, path)
            if not with_faults:
                return fine.url_at(address, path)
            if address in failing:
                return bad.url_at(address, path)
            return silent.url(address, path)

        return at

    plans = {kind: make_plan(args.sends, args.mix, url(kind), args.hosts) for kind in (True, False)}
    expected = sum(1 for inboxes in plans[True] for inbox in inboxes if f"{good.port}/" in inbox)
    print("django-federation-delivery steady stream with dead hosts: run_deliverer, faults or none")
    print(
        f"  {args.sends} sends over {args.hosts} hosts: {len(failing)} answer 503, {len(quiet)} "
        f"never answer; {expected} deliveries to healthy hosts timed; rounds {args.rounds}"
    )
    print(f"  503: {' '.join(failing)}\n  silent: {' '.join(quiet)}")
    prepare(bench, database, good)
    served = Served(good)
    warm = good.url(0, "/users/warm/inbox")
    rounds = []
    try:
        for number in range(1, args.rounds + 1):
            order = (True, False) if number % 2 else (False, True)
            print(f"round {number}, load {load_average()}", flush=True)
            phases = {}
            for kind in order:
                name = "with faults" if kind else "all healthy"
                before = sum(bad.failing_requests().values()), sum(silent.counts()[1].values())
                phases[kind] = bench.run_phase(
                    name,
                    "deliverer",
                    plans[kind],
                    served,
                    expected,
                    warm,
                    before_stop=silent.hang_up if kind else lambda: None,
                )
                silent.hang_up(False)
                after = sum(bad.failing_requests().values()), sum(silent.counts()[1].values())
                counts = f"   503s {after[0] - before[0]}, silent {after[1] - before[1]}"
                print(phases[kind].line() + (counts if kind else ""), flush=True)
            print(f"  ratio faults/healthy: {phases[True].seconds / phases[False].seconds:.3f}")
            rounds.append(phases)
    finally:
        silent.stop()
    ratios = [p[True].seconds / p[False].seconds for p in rounds]
    print()
    for number, phases in enumerate(rounds, 1):
        print(
            f"round {number}: with faults {phases[True].seconds:.2f} s, all healthy "
            f"{phases[False].seconds:.2f} s, ratio {ratios[number - 1]:.3f}; cpu ms/delivery "
            f"{phases[True].cpu_ms:.2f} / {phases[False].cpu_ms:.2f}"
        )
    print(
        f"median: with faults {median_or_nan([p[True].seconds for p in rounds]):.2f} s, all "
        f"healthy {median_or_nan([p[False].seconds for p in rounds]):.2f} s, ratio "
        f"{median_or_nan(ratios):.3f} (target <= 1.1)"
    )
    print(f"load average at the end: {load_average()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
