#!/usr/bin/env python
"""What ``send()`` costs the caller: one inbox, twenty, ten thousand.

Times ``send()`` on a fresh SQLite file (WAL, ``synchronous=NORMAL``,
``transaction_mode`` IMMEDIATE and a busy timeout: the example project's
settings), or with ``--database-url`` on a throwaway PostgreSQL:

* one inbox, each send its own transaction (as a web request in autocommit
  would send);
* one inbox, inside a transaction already open (``ATOMIC_REQUESTS``, or the
  caller's own ``transaction.atomic()``) and begun by a statement of the
  caller's (as a view writes the post it then sends): the send alone is
  timed, not the ``BEGIN`` nor the commit;
* twenty inboxes on twenty hosts, each its own transaction;
* ten thousand inboxes, on ten thousand hosts and on one host;
* the floor: the statements of a one-inbox send, run through the driver
  alone on the same connection, with no Django and none of the package's
  Python around them: on SQLite its two and the commit, through ``sqlite3``;
  on PostgreSQL its one, in autocommit, through psycopg, bound on the server
  as the package binds it (so prepared too when the URL asks it, with
  ``?prepare_threshold=5``);
* with ``--celery``, beside them: Celery's ``apply_async`` of a task that
  does nothing, given the same activity, to a Redis broker on 127.0.0.1
  (started here; Celery and redis-py installed with pip if missing), as many
  calls a round, and the ratios of the one-inbox sends to it.

It prints the median and 90th percentile of each, and the SQL statements one
send runs; with ``--profile``, the top of a cProfile of the one-inbox and the
ten-thousand-inbox sends. It asserts nothing.

    python benchmarks/send.py [--rounds 5] [--sends 200] [--fan-out 10000]
        [--profile] [--celery] [--database-url URL]

See benchmarks/README.rst.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import dataclasses
import io
import pstats
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

if not __package__:  # run as a script: benchmarks/ is on the path, the repository is not
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (
    RedisServer,
    add_database_and_tmpdir,
    clear_queue,
    environment_lines,
    in_workdir,
    install_missing,
    load_average,
    make_activity,
    percentile,
    positive,
    setup_django,
    spread,
    use_sqlite_options,
)

#: What apply_async is measured with: installed when missing.
CELERY_REQUIREMENTS = ("celery>=5.4", "redis>=5.0")

#: Hosts the small sends go to, in turn: a queue that already knows a few.
SMALL_HOSTS = 50
#: The one-inbox sends, and what --celery sets beside them.
OWN, OPEN = "1 inbox, own transaction", "1 inbox, open transaction"
APPLY_ASYNC = "celery apply_async, Redis"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=positive, default=5, help="rounds of every case (5)")
    parser.add_argument(
        "--sends", type=positive, default=200, help="small sends timed per case and round (200)"
    )
    parser.add_argument(
        "--fan-out", type=positive, default=10_000, help="inboxes of the big send (10000)"
    )
    parser.add_argument("--profile", action="store_true", help="print the top of a cProfile")
    parser.add_argument(
        "--celery",
        action="store_true",
        help="also time Celery's apply_async to a local Redis, side by side",
    )
    add_database_and_tmpdir(parser)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    return in_workdir("fd-send-", args.tmpdir, lambda workdir: benchmark(args, workdir))


def benchmark(args: argparse.Namespace, workdir: Path) -> int:
    broker = RedisServer(workdir / "redis") if args.celery else None
    try:
        if broker is not None:
            broker.start()
        return measure(args, workdir, broker)
    finally:
        if broker is not None:
            broker.stop()


def measure(args: argparse.Namespace, workdir: Path, broker: RedisServer | None) -> int:
    database = setup_django(workdir, database_url=args.database_url or None)

    from django.db import connection, transaction
    from django.test.utils import CaptureQueriesContext

    from django_federation_delivery import send
    from tests.keys import ALICE

    # What the example project (and README) recommend, on every connection.
    database += use_sqlite_options(connection)

    activity = make_activity(ALICE)
    counter = iter(range(10**9))

    def small(count: int) -> list[str]:
        return [
            f"https://h{n % SMALL_HOSTS}.example/users/u{n}/inbox"
            for n in (next(counter) for _ in range(count))
        ]

    def own_transaction(count: int) -> Callable[[], Timing]:
        def one() -> Timing:
            inboxes = small(count)
            with timed() as took:
                send(ALICE, activity, inboxes)
            return took

        return one

    def open_transaction() -> Timing:
        inboxes = small(1)
        with transaction.atomic():
            with connection.cursor() as cursor:  # the caller's own statement first
                cursor.execute("SELECT 1")
            with timed() as took:
                send(ALICE, activity, inboxes)
        return took

    def fan_out(same_host: bool) -> Callable[[], Timing]:
        def one() -> Timing:
            n = next(counter)
            if same_host:
                inboxes = [f"https://big.example/users/u{n}-{i}/inbox" for i in range(args.fan_out)]
            else:
                inboxes = [f"https://h{n}-{i}.example/users/u/inbox" for i in range(args.fan_out)]
            with timed() as took:
                send(ALICE, activity, inboxes)
            return took

        return one

    def bare_sqlite() -> Callable[[], Timing]:
        from django_federation_delivery.dialect import db_datetime
        from django_federation_delivery.store import queueing, sql

        batch = send(ALICE, activity, small(1))
        assert batch is not None
        batch_sql = sql.statement(connection, "insert_batch")
        deliveries_sql = sql.statement(connection, "insert_deliveries")
        batch_values = queueing._batch_values(batch, connection)
        due = db_datetime(batch.created_at, connection)
        mode = connection.settings_dict["OPTIONS"].get("transaction_mode", "")

        def one() -> Timing:
            (inbox,) = small(1)
            host = inbox.split("/")[2]
            raw = connection.connection
            with timed() as took:
                raw.execute(f"BEGIN {mode}")
                (batch_id,) = raw.execute(
                    batch_sql.qmark, batch_sql.bind({"batch": batch_values})
                ).fetchone()
                # The values as the package lays them out, so that the floor
                # follows its statement whatever columns it gains.
                params = queueing._delivery_params(
                    connection, batch, [queueing.Queued(inbox, host)], {}, due, "activitypub"
                )
                given = {"batch_id": batch_id, **params}
                _, qmark = deliveries_sql.shaped(given)
                raw.execute(qmark, deliveries_sql.bind(given))
                raw.execute("COMMIT")
            return took

        return one

    def bare_postgresql() -> Callable[[], Timing]:
        import psycopg

        from django_federation_delivery.dialect import db_datetime
        from django_federation_delivery.store import queueing, sql

        batch = send(ALICE, activity, small(1))
        assert batch is not None
        statement = sql.statement(connection, "insert_batch_and_delivery")
        batch_values = queueing._batch_values(batch, connection)
        due = db_datetime(batch.created_at, connection)

        def one() -> Timing:
            (inbox,) = small(1)
            host = inbox.split("/")[2]
            # Bound on the server, as the package binds it: prepared, as its
            # statement is, when the connection's prepare_threshold asks.
            with timed() as took, psycopg.Cursor(connection.connection) as cursor:
                # In autocommit, as a send outside a transaction runs it.
                params = queueing._delivery_params(
                    connection,
                    batch,
                    [queueing.Queued(inbox, host)],
                    {},
                    due,
                    "activitypub",
                    one_row=True,
                )
                cursor.execute(statement.text, statement.bind({"batch": batch_values, **params}))
                cursor.fetchone()
            return took

        return one

    cases: list[tuple[str, Callable[[], Timing], int]] = [
        (OWN, own_transaction(1), args.sends),
        (OPEN, open_transaction, args.sends),
        ("20 inboxes, 20 hosts", own_transaction(20), max(1, args.sends // 4)),
        # "one send of": never the same name as the case above, whatever --fan-out.
        (f"one send of {args.fan_out} inboxes, {args.fan_out} hosts", fan_out(False), 1),
        (f"one send of {args.fan_out} inboxes, 1 host", fan_out(True), 1),
    ]
    if connection.vendor == "sqlite":
        cases.append(("floor: bare sqlite3, 1 inbox", bare_sqlite(), args.sends))
    else:
        cases.append(("floor: bare psycopg, 1 inbox", bare_postgresql(), args.sends))
    if broker is not None:
        cases.append((APPLY_ASYNC, apply_async(broker, activity), args.sends))

    print("django-federation-delivery: what send() costs the caller")
    for line in environment_lines():
        print(f"  {line}")
    print(f"  database: {database}")
    if broker is not None:
        print(f"  broker: {broker.version()}, {broker.url}; {library_versions()}")
    print(f"  rounds {args.rounds}; small sends per case and round {args.sends}")

    def clear() -> None:
        clear_queue()
        if broker is not None:
            broker.command("FLUSHDB")  # the messages published, never consumed

    # Warm up: compiled queries, imports, the database's caches, the broker's connection.
    for _, run, _ in [*cases[:3], *(case for case in cases if case[0] == APPLY_ASYNC)]:
        for _ in range(20):
            run()
    clear()

    rounds: dict[str, list[list[Timing]]] = {name: [] for name, _, _ in cases}
    for number in range(1, args.rounds + 1):
        for name, run, times in cases:
            rounds[name].append([run() for _ in range(times)])
        clear()
        print(f"  round {number} done, load average {load_average()}", flush=True)
    timings = {name: [timing for one in each for timing in one] for name, each in rounds.items()}

    statements: dict[str, int] = {}
    for name, run, _ in cases:
        with CaptureQueriesContext(connection):
            statements[name] = run().statements
    clear()

    print()
    print(
        f"{'case':<40} {'sends':>6} {'median ms':>10} {'p90 ms':>10} {'cpu ms':>8} "
        f"{'statements':>11}"
    )
    for name, _, _ in cases:
        wall = [timing.wall for timing in timings[name]]
        cpu = [timing.cpu for timing in timings[name]]
        counted = str(statements[name]) if statements[name] else "-"
        print(
            f"{name:<40} {len(wall):>6} {statistics.median(wall) * 1000:>10.3f} "
            f"{percentile(wall, 0.9) * 1000:>10.3f} {statistics.median(cpu) * 1000:>8.3f} "
            f"{counted:>11}"
        )
    print(
        "\n(statements: those Django logs while the send runs, BEGIN, COMMIT and "
        "savepoints included: each a round trip on PostgreSQL; cpu ms: the median of this "
        "thread's CPU time, which other work on the machine disturbs less; the floor's "
        "statements are not Django's, and not counted)"
    )
    if broker is not None:
        side_by_side(rounds)
    print(f"load average at the end: {load_average()}")

    if args.profile:
        profile("1 inbox, own transaction, x1000", lambda: [cases[0][1]() for _ in range(1000)])
        profile(cases[3][0], cases[3][1])
        clear_queue()
    return 0


def apply_async(broker: RedisServer, activity: dict[str, Any]) -> Callable[[], Timing]:
    """One call a time: Celery's ``apply_async`` of a task that does nothing,
    given ``activity``, published as JSON to ``broker``; no worker runs and
    no result is kept, so each call is the publishing alone."""
    install_missing(CELERY_REQUIREMENTS, ["celery", "redis"])
    from celery import Celery

    app = Celery("fd-bench", broker=broker.url, set_as_current=False)
    app.conf.update(
        task_serializer="json",
        accept_content=["json"],
        task_ignore_result=True,
        broker_connection_retry_on_startup=False,
    )

    @app.task(name="bench.noop", ignore_result=True)
    def noop(activity: dict[str, Any]) -> None:
        return None

    def one() -> Timing:
        with timed() as took:
            noop.apply_async(args=(activity,))
        return took

    return one


def library_versions() -> str:
    from importlib import metadata

    return ", ".join(f"{name} {metadata.version(name)}" for name in ("celery", "kombu", "redis"))


def side_by_side(rounds: dict[str, list[list[Timing]]]) -> None:
    """Each one-inbox send beside apply_async: the median of the rounds'
    medians and their range, and the ratio's, round by round."""

    def medians(name: str) -> list[float]:
        return [statistics.median(t.wall for t in one) * 1000 for one in rounds[name]]

    count = len(rounds[APPLY_ASYNC])
    print(
        f"\nsend() beside Celery's apply_async to Redis, the same calls in each of {count} "
        "rounds (the median of the rounds' medians, and their range):"
    )
    floor = [name for name in rounds if name.startswith("floor:")]
    for name in (OWN, OPEN, *floor, APPLY_ASYNC):
        print(f"  {name:<38} {spread(medians(name), 3)} ms")
    broker = medians(APPLY_ASYNC)
    for name in (OWN, OPEN, *floor):
        ratios = [mine / theirs for mine, theirs in zip(medians(name), broker, strict=True)]
        label = name.split(", ")[0] if name in floor else name.split(", ")[1]
        print(f"  {label + ' / apply_async':<38} {spread(ratios, 2)}   target ≤ 0.5")


@dataclasses.dataclass
class Timing:
    wall: float = 0.0
    cpu: float = 0.0
    #: The statements run meanwhile, while Django logs them (else 0).
    statements: int = 0


@contextlib.contextmanager
def timed() -> Iterator[Timing]:
    from django.db import connection

    took = Timing()
    logged = len(connection.queries_log)
    wall, cpu = time.perf_counter(), time.thread_time()
    try:
        yield took
    finally:
        took.wall = time.perf_counter() - wall
        took.cpu = time.thread_time() - cpu
        took.statements = len(connection.queries_log) - logged


def profile(title: str, run: Callable[[], Any]) -> None:
    profiler = cProfile.Profile()
    profiler.enable()
    run()
    profiler.disable()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(25)
    print(f"\n--- cProfile: {title}, by own time ---")
    print(out.getvalue())


if __name__ == "__main__":
    sys.exit(main())
