#!/usr/bin/env python
"""At scale, on PostgreSQL or SQLite: the claim's cost, the deliverer's memory,
several processes, a restart.

Four measurements, each printing its figures and asserting nothing:

* ``claim``: the time of one claim (``store.claim`` of CLAIM_SIZE) with
  10,000 pending rows, then with 1,000,000, and their ratio; each claim's rows
  are put back as they were, so every claim sees the same queue. Then the
  plan of the claim's own SQL at 1,000,000 (PostgreSQL's ``EXPLAIN (ANALYZE,
  BUFFERS)``, SQLite's ``EXPLAIN QUERY PLAN``).
* ``rss``: 100,000 deliveries to 10,000 hosts drained by one ``run_deliverer``
  process; its resident memory every 10,000 deliveries.
* ``processes``: 20,000 deliveries drained by ``run_deliverer --processes 4``
  with CONCURRENCY 16; how many times each was received.
* ``restart``: the same, with the private PostgreSQL stopped once a third of
  them are received and started again (on the same port) 5 s later; how long
  it was away, how long until each delivery was received, how many times
  each was. Only with the private PostgreSQL (not with ``--database-url``,
  nor on SQLite).

The queue is, with ``--database sqlite``, a fresh SQLite file in the temp
directory, configured as the example project configures it (WAL,
``synchronous=NORMAL``, ``BEGIN IMMEDIATE``); otherwise PostgreSQL: the one
of ``--database-url``, which must be a THROWAWAY database (the script
drops its public schema, makes it again and migrates it), or by default a private one
started with scripts/postgres in the temp directory and stopped at the end.
The inboxes are a small asyncio HTTP server in a child process answering 202,
on as many loopback addresses (127.1.x.y) as there are hosts: a host is an
address, whatever the port.

    python benchmarks/pg_scale.py [claim|rss|processes|restart|all] [--rounds 3]
                                  [--database sqlite | --database-url URL]

See benchmarks/README.rst.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import multiprocessing
import os
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

if not __package__:  # run as a script: benchmarks/ is on the path, the repository is not
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (
    ROOT,
    environment_lines,
    load_average,
    make_activity,
    positive,
    setup_django,
    sigterm_interrupts,
    spread,
    terminate,
    use_sqlite_options,
)

POSTGRES = ROOT / "scripts" / "postgres"


# --- The inboxes: an asyncio server in a child process ------------------------------------------


def host_address(n: int) -> str:
    """The n-th host's loopback address: 127.1.0.1, 127.1.0.2, … (250 to a /24)."""
    return f"127.1.{n // 250}.{n % 250 + 1}"


def serve(addresses: list[str], counts: Any, total: Any, control: Connection) -> None:
    """In the child: answer 202 to every POST on every address, one port for
    all; count each ``/d/<n>`` in ``counts[n]``, and note when each was first
    and again received, for the duplicates."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops it
    # A listening socket an address, and the deliverer's connections besides.
    _, most = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (most, most))
    first: dict[int, float] = {}
    again: list[tuple[int, float]] = []
    size = len(counts)

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                line, _, rest = head.partition(b"\r\n")
                length = 0
                for header in rest.split(b"\r\n"):
                    if header[:15].lower() == b"content-length:":
                        length = int(header[15:])
                if length:
                    await reader.readexactly(length)
                path = line.split(b" ")[1] if line.count(b" ") >= 2 else b""
                if path.startswith(b"/d/") and path[3:].isdigit() and int(path[3:]) < size:
                    n = int(path[3:])
                    counts[n] += 1
                    if counts[n] == 1:
                        first[n] = time.time()
                    else:
                        again.append((n, time.time()))
                total.value += 1
                writer.write(b"HTTP/1.1 202 Accepted\r\nContent-Length: 0\r\n\r\n")
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            pass
        finally:
            writer.close()

    async def main() -> None:
        servers = []
        port = 0
        for address in addresses:
            server = await asyncio.start_server(handle, address, port, backlog=1024)
            port = port or server.sockets[0].getsockname()[1]
            servers.append(server)
        control.send(port)
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        def command() -> None:
            try:
                asked = control.recv()
            except EOFError:
                asked = "stop"
            if asked == "again":
                control.send([(n, first.get(n, 0.0), at) for n, at in again])
            elif not done.done():
                done.set_result(None)

        loop.add_reader(control.fileno(), command)
        await done
        for server in servers:
            server.close()

    asyncio.run(main())


class Inboxes:
    def __init__(self, hosts: int, deliveries: int) -> None:
        context = multiprocessing.get_context("spawn")
        self.addresses = [host_address(n) for n in range(hosts)]
        self.counts = context.Array("i", deliveries, lock=False)
        self.total = context.Value("q", 0, lock=False)
        self.control, child = context.Pipe()
        self.process = context.Process(
            target=serve,
            args=(self.addresses, self.counts, self.total, child),
            name="inboxes",
            daemon=True,
        )
        self.process.start()
        if not self.control.poll(120):
            raise RuntimeError("the inboxes did not start")
        self.port = int(self.control.recv())

    def reset(self) -> None:
        """Nothing received yet, for the next round."""
        for n in range(len(self.counts)):
            self.counts[n] = 0
        self.total.value = 0

    def url(self, n: int) -> str:
        return f"http://{self.addresses[n % len(self.addresses)]}:{self.port}/d/{n}"

    def again(self) -> list[tuple[int, float, float]]:
        self.control.send("again")
        return list(self.control.recv())

    def stop(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            self.control.send("stop")
        self.process.join(5)
        if self.process.is_alive():
            self.process.kill()


# --- PostgreSQL ---------------------------------------------------------------------------------


class PrivatePostgres:
    def __init__(self, directory: Path) -> None:
        self.dir = directory

    def start(self, port: int | None = None) -> str:
        """Start the server (on ``port``, or a free one); its URL."""
        answer = subprocess.run(
            ["bash", str(POSTGRES), "start", str(self.dir), *([str(port)] if port else [])],
            capture_output=True,
            text=True,
            timeout=300,
        )
        if answer.returncode != 0:
            sys.exit(f"scripts/postgres could not start a server:\n{answer.stderr}")
        return answer.stdout.strip()

    def stop(self, *, remove: bool = True) -> None:
        """Stop the server (fast: open connections are cut); with ``remove``,
        its data directory goes too."""
        subprocess.run(["bash", str(POSTGRES), "stop", str(self.dir)], capture_output=True)
        if not remove:
            return
        elsewhere = self.dir / "DATADIR_IS_ELSEWHERE"
        if elsewhere.exists():
            shutil.rmtree(elsewhere.read_text().strip(), ignore_errors=True)


def table() -> str:
    from django_federation_delivery.models import Delivery

    return Delivery._meta.db_table


def execute(sql: str, params: Sequence[Any] = ()) -> Any:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        return cursor.fetchall() if cursor.description else None


#: What differs between the two databases in the statements that fill the
#: queue: the rows' numbers, an empty JSON list, and now plus a number of
#: milliseconds (on SQLite, text as Django writes a datetime: naive UTC).
DIALECTS = {
    "postgresql": {
        "series": "generate_series(%s, %s) AS g",
        "empty": "'[]'::jsonb",
        "at": "now() + ({}) * interval '1 millisecond'",
    },
    "sqlite": {
        "series": "(WITH RECURSIVE n(g) AS (SELECT %s UNION ALL SELECT g + 1 FROM n "
        "WHERE g < %s) SELECT g FROM n) AS n",
        "empty": "'[]'",
        "at": "strftime('%%Y-%%m-%%d %%H:%%M:%%f', 'now', (({}) / 1000.0) || ' seconds') || '000'",
    },
}


def dialect() -> dict[str, str]:
    from django.db import connection

    return DIALECTS[connection.vendor]


def new_batch(tag: str) -> int:
    from django_federation_delivery.models import Batch

    return int(Batch.objects.create(sender="https://bench.example/users/a", body="{}", tag=tag).pk)


def insert_pending(start: int, end: int, hosts: int) -> None:
    """Pending rows ``start`` to ``end`` (inclusive): 70% due within the last
    hour, 30% retries due within a day; 5% in the low lane, a few not-due ones
    in the priority lane; a fifth of them to ten big hosts, the rest spread
    over ``hosts``."""
    sql = dialect()
    retry, due = (
        sql["at"].format("1000 * (1 + g %% 86400)"),
        sql["at"].format("-3600000 + g %% 3600000"),
    )
    for chunk in range(start, end + 1, 100_000):
        last = min(end, chunk + 99_999)
        execute(
            f"INSERT INTO {table()} (batch_id, kind, destination, inbox, host, via, lane, "
            "status, attempts, due_at, last_error, sequence) "
            "SELECT %s, 'activitypub', '', "
            f"'https://' || h || '/users/u' || g || '/inbox', h, {sql['empty']}, "
            "CASE WHEN g %% 2000 = 0 THEN 'priority' WHEN g %% 20 = 1 THEN 'low' "
            "ELSE 'normal' END, 'pending', CASE WHEN g %% 10 < 3 THEN 1 + g %% 5 ELSE 0 END, "
            f"CASE WHEN g %% 10 < 3 OR g %% 2000 = 0 THEN {retry} ELSE {due} END, "
            "'', '' FROM (SELECT g, 'h' || CASE WHEN g %% 5 = 0 THEN g %% 10 "
            "ELSE (CAST(g AS bigint) * 7919) %% %s END || '.example' AS h "
            f"FROM {sql['series']}) AS s",
            [new_batch(f"pending {chunk}"), hosts, chunk, last],
        )


def insert_settled(count: int, hosts: int) -> None:
    sql = dialect()
    settled = sql["at"].format("-1000 * (g %% 86400)")
    for chunk in range(1, count + 1, 100_000):
        last = min(count, chunk + 99_999)
        execute(
            f"INSERT INTO {table()} (batch_id, kind, destination, inbox, host, via, lane, "
            "status, attempts, due_at, last_error, sequence, settled_at, last_attempt_at, "
            "last_status) "
            "SELECT %s, 'activitypub', '', "
            "'https://h' || ((CAST(g AS bigint) * 7919) %% %s) || '.example/users/s' "
            "|| g || '/inbox', "
            f"'h' || ((CAST(g AS bigint) * 7919) %% %s) || '.example', {sql['empty']}, "
            "'normal', CASE WHEN g %% 20 = 0 THEN 'failed' WHEN g %% 20 = 1 THEN 'refused' "
            f"ELSE 'delivered' END, 1, NULL, '', '', {settled}, {settled}, 202 "
            f"FROM {sql['series']}",
            [new_batch(f"settled {chunk}"), hosts, hosts, chunk, last],
        )


def empty_queue() -> None:
    """Every delivery and batch, in a statement each, then what the
    deliverers remember of hosts: the ORM's delete would collect a million
    rows in memory first, and on SQLite pass more parameters to one
    statement than it takes."""
    from benchmarks.common import clear_all
    from django_federation_delivery.models import Batch

    execute(f"DELETE FROM {table()}")
    execute(f"DELETE FROM {Batch._meta.db_table}")
    clear_all()


def vacuum() -> None:
    """On PostgreSQL, ``VACUUM ANALYZE``: what autovacuum would do by and by.
    On SQLite, the WAL written back into the file, and no ``ANALYZE``: the
    package never runs it, so a deployment's planner has no statistics."""
    from django.db import connection

    connection.ensure_connection()
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute(f"VACUUM ANALYZE {table()}")
        else:
            cursor.execute("PRAGMA wal_checkpoint(TRUNCATE)")


# --- claim: the claim's cost with 10,000 and 1,000,000 pending rows -----------------------------


def claim_times(args: argparse.Namespace) -> list[float]:
    """Medians (ms) of ``--claims`` claims, one a round; each claim's rows put back."""
    from django_federation_delivery import store
    from django_federation_delivery.conf import app_settings

    size = int(app_settings.get("CLAIM_SIZE"))
    execute("DROP TABLE IF EXISTS fd_bench_due")
    execute(
        f"CREATE TABLE fd_bench_due AS SELECT id, due_at FROM {table()} WHERE status = 'pending'"
    )
    execute("CREATE UNIQUE INDEX fd_bench_due_id ON fd_bench_due (id)")
    restore = (
        f"UPDATE {table()} SET due_at = (SELECT o.due_at FROM fd_bench_due AS o "
        f"WHERE o.id = {table()}.id), lease_token = NULL WHERE id IN ({{}})"
    )
    medians = []
    short = 0
    for _ in range(args.rounds):
        times = []
        for _ in range(args.claims):
            started = time.perf_counter()
            claimed = store.claim(size, 300.0, per_host=2)
            times.append((time.perf_counter() - started) * 1000)
            short += len(claimed) < size
            if claimed:
                execute(restore.format(", ".join(["%s"] * len(claimed))), [r.id for r in claimed])
        medians.append(statistics.median(times))
        print(
            f"    {args.claims} claims: median {medians[-1]:.2f} ms, "
            f"min {min(times):.2f}, max {max(times):.2f}  (load {load_average()})",
            flush=True,
        )
    if short:
        print(f"    ({short} claims took fewer than CLAIM_SIZE {size})")
    return medians


def explain_claim() -> None:
    """The plan of each statement a claim runs, rolled back: PostgreSQL's
    ``EXPLAIN (ANALYZE, BUFFERS)``, SQLite's ``EXPLAIN QUERY PLAN``."""
    from django.db import connection, transaction

    from django_federation_delivery import store
    from django_federation_delivery.conf import app_settings

    statements: list[tuple[str, Any]] = []
    explain = (
        "EXPLAIN (ANALYZE, BUFFERS)" if connection.vendor == "postgresql" else "EXPLAIN QUERY PLAN"
    )

    def capture(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        if sql.lstrip().upper().startswith(("WITH", "SELECT", "UPDATE")):  # not a savepoint
            statements.append((sql, params))
        return execute(sql, params, many, context)

    with transaction.atomic():
        with connection.execute_wrapper(capture):
            store.claim(int(app_settings.get("CLAIM_SIZE")), 300.0, per_host=2)
        transaction.set_rollback(True)
    for number, (sql, params) in enumerate(statements, 1):
        print(f"\n  statement {number} of {len(statements)}: {sql}\n  params: {params}")
        with transaction.atomic():
            plan = execute(f"{explain} {sql}", params)
            transaction.set_rollback(True)
        for row in plan:
            print(f"    {row[-1]}")  # SQLite's: id, parent, notused, detail


def run_claim(args: argparse.Namespace) -> None:
    print(
        f"\n== claim: {args.small:,} then {args.large:,} pending rows, "
        f"{args.settled:,} settled, {args.claim_hosts:,} hosts, {args.database} ==",
        flush=True,
    )
    empty_queue()
    started = time.monotonic()
    insert_settled(args.settled, args.claim_hosts)
    insert_pending(1, args.small, args.claim_hosts)
    vacuum()
    print(
        f"  inserted {args.settled:,} settled and {args.small:,} pending rows "
        f"in {time.monotonic() - started:.1f} s",
        flush=True,
    )
    small = claim_times(args)
    started = time.monotonic()
    insert_pending(args.small + 1, args.large, args.claim_hosts)
    vacuum()
    print(
        f"  inserted {args.large - args.small:,} more pending rows "
        f"in {time.monotonic() - started:.1f} s",
        flush=True,
    )
    large = claim_times(args)
    explain_claim()
    median_small, median_large = statistics.median(small), statistics.median(large)
    ratios = [mine / theirs for mine, theirs in zip(large, small, strict=True)]
    print(
        f"\n  claim, the median of {args.rounds} rounds' medians (their range): "
        f"{spread(small, 2)} ms with {args.small:,} pending, {spread(large, 2)} ms with "
        f"{args.large:,}: ratio {median_large / median_small:.3f} (target at most 1.2); "
        f"round by round {spread(ratios, 3)}"
    )
    execute("DROP TABLE IF EXISTS fd_bench_due")
    empty_queue()
    vacuum()


# --- rss and processes: run_deliverer draining a queue ------------------------------------------


def queue_deliveries(inboxes: Inboxes, count: int) -> float:
    """``send()`` the deliveries, 10,000 inboxes a batch; returns when it began (time.time())."""
    from django_federation_delivery.sending import send
    from tests.keys import ALICE

    empty_queue()
    activity = make_activity(ALICE)
    queued_at = time.time()
    started = time.monotonic()
    for start in range(0, count, 10_000):
        send(ALICE, activity, [inboxes.url(n) for n in range(start, min(count, start + 10_000))])
    print(f"  queued {count:,} deliveries in {time.monotonic() - started:.1f} s", flush=True)
    return queued_at


def start_deliverer(
    args: argparse.Namespace,
    workdir: Path,
    *options: str,
    drain: bool = True,
    settings: dict[str, Any] | None = None,
) -> Any:
    """``run_deliverer`` (``--drain``: until nothing is due) with ``options``,
    the benchmarks' settings (the tests', and SQLite as the example project
    configures it) and ``settings`` over them; its output to deliverer.log.
    On SQLite, the file is named by $FD_SQLITE_NAME, as setup_django set it."""
    from django.db import connection

    database = connection.settings_dict
    env = dict(os.environ, DJANGO_SETTINGS_MODULE="benchmarks.settings", PYTHONPATH=str(ROOT))
    if connection.vendor == "postgresql":
        env["DATABASE_URL"] = (
            f"postgres://{database['USER']}:{database['PASSWORD'] or ''}@{database['HOST']}:"
            f"{database['PORT']}/{database['NAME']}"
        )
    if settings:
        env["FD_SETTINGS_JSON"] = json.dumps(
            {**json.loads(os.environ.get("FD_SETTINGS_JSON") or "{}"), **settings}
        )
    log = open(workdir / "deliverer.log", "w")  # noqa: SIM115
    with log:
        return subprocess.Popen(
            [sys.executable, "-m", "django", "run_deliverer"]
            + (["--drain"] if drain else [])
            + list(options),
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # Ctrl-C is for this script, which stops it
        )


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def stop_process(process: Any) -> None:
    terminate(process, 30)


def run_rss(args: argparse.Namespace, workdir: Path) -> None:
    count, every = args.rss_deliveries, args.rss_every
    print(
        f"\n== rss: {count:,} deliveries to {args.rss_hosts:,} hosts, one run_deliverer, "
        f"{args.database} ==",
        flush=True,
    )
    inboxes = Inboxes(args.rss_hosts, count)
    try:
        ratios, growths, firsts, lasts = [], [], [], []
        for number in range(1, args.rounds + 1):
            inboxes.reset()
            queue_deliveries(inboxes, count)
            started = time.monotonic()
            process = start_deliverer(args, workdir)
            samples: list[tuple[int, int, float]] = []
            try:
                mark = every
                while time.monotonic() - started < args.timeout:
                    received = inboxes.total.value
                    if received >= mark:
                        samples.append((received, rss_kb(process.pid), time.monotonic() - started))
                        print(
                            f"    {received:>7,} received: RSS {samples[-1][1] / 1024:.1f} MB "
                            f"at {samples[-1][2]:.0f} s (load {load_average()})",
                            flush=True,
                        )
                        mark += every
                    if process.poll() is not None:
                        break
                    time.sleep(0.05)
            finally:
                stop_process(process)
            took = time.monotonic() - started
            first = samples[0][1] / 1024 if samples else float("nan")
            later = [kb / 1024 for _, kb, _ in samples[1:]] or [float("nan")]
            ratios.append(max(later) / first)
            growths.append(later[-1] / first)
            firsts.append(first)
            lasts.append(later[-1])
            print(
                f"  round {number}: exit {process.returncode}, {inboxes.total.value:,} received "
                f"in {took:.1f} s ({inboxes.total.value / took:.0f}/s); RSS {first:.1f} MB at "
                f"{every:,}, {later[-1]:.1f} MB at the last: growth {growths[-1]:.3f}; the most "
                f"after the first {every:,} / the first: {ratios[-1]:.3f} (flat within 20%: "
                f"{'yes' if ratios[-1] <= 1.2 else 'no'})",
                flush=True,
            )
        print(
            f"\n  rss, the median of {args.rounds} rounds (their range): the first "
            f"{spread(firsts, 1)} MB, the last {spread(lasts, 1)} MB; growth, the last / the "
            f"first {spread(growths, 3)}; the most / the first {spread(ratios, 3)} "
            "(target at most 1.2)"
        )
    finally:
        inboxes.stop()


def received_once(inboxes: Inboxes, count: int) -> str:
    """How many of the ``count`` deliveries were received once, never, more
    than once, and the rows' statuses."""
    from django_federation_delivery.models import Delivery

    received = collections.Counter(inboxes.counts[n] for n in range(count))
    statuses = collections.Counter(Delivery.objects.values_list("status", flat=True))
    return (
        f"received once {received[1]:,}, never {received[0]:,}, more than once "
        f"{count - received[0] - received[1]:,}; rows {dict(statuses)}"
    )


def print_duplicates(inboxes: Inboxes, queued_at: float, lease: float) -> None:
    for n, first, at in inboxes.again():
        # A lease can have lapsed only once LEASE_SECONDS had passed since
        # the delivery was queued: no claim was earlier.
        lapsed = at - queued_at >= lease
        print(
            f"    duplicate /d/{n}: first at {first - queued_at:.1f} s, again at "
            f"{at - queued_at:.1f} s after queueing; lease ({lease:.0f} s) could "
            f"have lapsed: {'yes' if lapsed else 'NO'}"
        )


def run_processes(args: argparse.Namespace, workdir: Path) -> None:
    from django_federation_delivery.conf import app_settings

    count = args.deliveries
    lease = float(app_settings.get("LEASE_SECONDS"))
    print(
        f"\n== processes: {count:,} deliveries to {args.hosts} hosts, run_deliverer "
        f"--processes {args.processes} --concurrency {args.concurrency} ==",
        flush=True,
    )
    inboxes = Inboxes(args.hosts, count)
    try:
        rates = []
        for number in range(1, args.rounds + 1):
            inboxes.reset()
            queued_at = queue_deliveries(inboxes, count)
            started = time.monotonic()
            process = start_deliverer(
                args,
                workdir,
                f"--processes={args.processes}",
                f"--concurrency={args.concurrency}",
            )
            try:
                process.wait(args.timeout)
            except subprocess.TimeoutExpired:
                print(f"  not through in {args.timeout} s: stopped")
            finally:
                stop_process(process)
            took = time.monotonic() - started
            rates.append(count / took)
            print(
                f"  round {number}: exit {process.returncode}, {took:.1f} s "
                f"({count / took:.0f}/s, load {load_average()}); {received_once(inboxes, count)}",
                flush=True,
            )
            print_duplicates(inboxes, queued_at, lease)
        print(
            f"\n  processes: median {statistics.median(rates):.0f} deliveries/s over "
            f"{args.rounds} rounds"
        )
    finally:
        inboxes.stop()


def run_restart(args: argparse.Namespace, workdir: Path, server: PrivatePostgres | None) -> None:
    from django.db import connection, connections

    from django_federation_delivery.models import Delivery, Status

    count = args.deliveries
    print(
        f"\n== restart: {count:,} deliveries to {args.hosts} hosts, run_deliverer "
        f"--processes {args.processes} --concurrency {args.concurrency}; PostgreSQL stopped "
        f"once a third are received, started again {args.away:g} s later ==",
        flush=True,
    )
    if server is None:
        print(
            "  skipped: it restarts the private PostgreSQL this script starts "
            "(not with --database-url, nor on SQLite)"
        )
        return
    port = int(connection.settings_dict["PORT"])
    # A claim whose answer the stop cut off leaves its rows leased: they come
    # due again when the lease ends, sooner than the default 300 s. An attempt
    # and the write of its outcome must fit in the lease (check E015).
    lease = args.restart_lease
    settings = {"LEASE_SECONDS": lease, "ATTEMPT_TIMEOUT": min(30.0, lease - 10)}
    print(f"  settings: {settings}", flush=True)
    inboxes = Inboxes(args.hosts, count)

    def wait_for(condition: Any, deadline: float, process: Any, step: float = 0.05) -> bool:
        """Whether ``condition`` came to hold by ``deadline`` while ``process`` ran."""
        while time.monotonic() < deadline and process.poll() is None:
            if condition():
                return True
            time.sleep(step)
        return bool(condition())

    try:
        for number in range(1, args.rounds + 1):
            inboxes.reset()
            queued_at = queue_deliveries(inboxes, count)
            connections.close_all()  # this script's own does not outlive the restart
            started = time.monotonic()
            deadline = started + args.timeout
            process = start_deliverer(
                args,
                workdir,
                f"--processes={args.processes}",
                f"--concurrency={args.concurrency}",
                drain=False,
                settings=settings,
            )
            try:
                if not wait_for(lambda: inboxes.total.value >= count // 3, deadline, process):
                    log = (workdir / "deliverer.log").read_text(errors="replace")
                    print(f"  round {number}: run_deliverer ended early:\n{log[-2000:]}")
                    return
                at_stop = inboxes.total.value
                stopped = time.monotonic()
                server.stop(remove=False)
                time.sleep(args.away)
                server.start(port)
                away = time.monotonic() - stopped
                received_all = wait_for(lambda: 0 not in inboxes.counts[:], deadline, process)
                took = time.monotonic() - started

                def settled() -> bool:
                    delivered = Delivery.objects.filter(status=Status.DELIVERED).count()
                    return bool(delivered == count)

                wait_for(settled, deadline, process, step=0.5)
                running = process.poll() is None
            finally:
                stop_process(process)
            log = (workdir / "deliverer.log").read_text(errors="replace")
            print(
                f"  round {number}: PostgreSQL away {away:.1f} s, stopped at {at_stop:,} "
                f"received; every delivery received "
                + (f"{took:.1f} s after the start" if received_all else "NOT within the timeout")
                + f" (load {load_average()}); still running then: {'yes' if running else 'NO'}, "
                f"exit {process.returncode}; "
                f"{received_once(inboxes, count)}; the deliverers logged the database "
                f"unavailable {log.count('The database is unavailable')} times, back "
                f"{log.count('The database is back')} times",
                flush=True,
            )
            print_duplicates(inboxes, queued_at, lease)
    finally:
        inboxes.stop()


# --- Running ------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "what", nargs="?", default="all", choices=["claim", "rss", "processes", "restart", "all"]
    )
    parser.add_argument(
        "--database",
        choices=["postgresql", "sqlite"],
        default="postgresql",
        help="postgresql (default) or sqlite (a fresh file in the temp directory)",
    )
    parser.add_argument(
        "--database-url",
        default=None,
        help="a THROWAWAY PostgreSQL (default: a private one, started here)",
    )
    parser.add_argument("--rounds", type=positive, default=3, help="rounds (3)")
    parser.add_argument("--small", type=positive, default=10_000, help="claim: pending (10000)")
    parser.add_argument(
        "--large", type=positive, default=1_000_000, help="claim: pending (1000000)"
    )
    parser.add_argument("--settled", type=int, default=500_000, help="claim: settled (500000)")
    parser.add_argument("--claim-hosts", type=positive, default=5000, help="claim: hosts (5000)")
    parser.add_argument("--claims", type=positive, default=200, help="claim: a round (200)")
    parser.add_argument(
        "--rss-deliveries", type=positive, default=100_000, help="rss: deliveries (100000)"
    )
    parser.add_argument("--rss-hosts", type=positive, default=10_000, help="rss: hosts (10000)")
    parser.add_argument(
        "--rss-every",
        type=positive,
        default=10_000,
        help="rss: a sample every so many deliveries (10000)",
    )
    parser.add_argument(
        "--deliveries", type=positive, default=20_000, help="processes: deliveries (20000)"
    )
    parser.add_argument("--hosts", type=positive, default=100, help="processes: hosts (100)")
    parser.add_argument("--processes", type=positive, default=4, help="processes: (4)")
    parser.add_argument("--concurrency", type=positive, default=16, help="processes: (16)")
    parser.add_argument(
        "--away", type=positive, default=5.0, help="restart: seconds the server is down (5)"
    )
    parser.add_argument(
        "--restart-lease",
        type=positive,
        default=30.0,
        help="restart: LEASE_SECONDS (30; ATTEMPT_TIMEOUT 10 s less, 30 s at most)",
    )
    parser.add_argument(
        "--timeout", type=positive, default=1200, help="the most a drain may take, seconds (1200)"
    )
    parser.add_argument("--tmpdir", default=None, help="where the temp dir goes")
    args = parser.parse_args(argv)
    if args.database_url and args.database == "sqlite":
        parser.error("--database-url names a PostgreSQL: not with --database sqlite")
    if args.large <= args.small:
        parser.error("--large must be more than --small")
    if args.restart_lease < 12:
        parser.error("--restart-lease: at least 12 s, an attempt's 2 s and 10 s to write it")
    if args.rss_hosts > 250 * 250:
        parser.error("--rss-hosts: at most 62500 loopback addresses")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, sigterm_interrupts)
    workdir = Path(tempfile.mkdtemp(prefix="fd-scale-", dir=args.tmpdir))
    sqlite = args.database == "sqlite"
    private = None if args.database_url or sqlite else PrivatePostgres(workdir / "pg")
    try:
        url = args.database_url or (private.start() if private else None)
        database = setup_django(workdir, database_url=url)
        from django.db import connection

        print(database + use_sqlite_options(connection))
        for line in environment_lines():
            print(line)
        if args.what in ("claim", "all"):
            run_claim(args)
        if args.what in ("rss", "all"):
            run_rss(args, workdir)
        if args.what in ("processes", "all"):
            run_processes(args, workdir)
        if args.what in ("restart", "all"):
            run_restart(args, workdir, private)
        print(f"\nload average at the end: {load_average()}")
        return 0
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    finally:
        from django.db import connections

        with contextlib.suppress(Exception):
            connections.close_all()
        if private is not None:
            private.stop()
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
