#!/usr/bin/env python
"""The admin's queues page and ``delivery_status`` against a big table.

Fills a fresh database with N deliveries shaped like a busy server's table:
most delivered over the last month, some failed or refused, a few percent
pending (due, scheduled, in flight, held), spread over H hosts, with a few
open breakers and a paused host, and two days of history (2,880 minutes, for
the page's charts). Then times, over R rounds, the overview's queries alone,
the history's read and charts alone, and a GET of the queues page through the
test client (as a logged-in superuser), and prints their medians, the page's
query count, and each overview and history query's plan (SQLite's EXPLAIN QUERY PLAN, PostgreSQL's
EXPLAIN). It asserts nothing.

    python benchmarks/queues_page.py [--deliveries 100000] [--hosts 2000]
        [--rounds 5] [--database-url URL]

Without --database-url it runs on a temporary SQLite file, or on --sqlite
PATH, filled once and kept for the next run.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--deliveries", type=int, default=100_000)
    parser.add_argument("--hosts", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--database-url", default="")
    parser.add_argument(
        "--sqlite", default="", help="Use (and keep) this SQLite file; filled only when empty."
    )
    args = parser.parse_args()

    sys.path.insert(0, str(ROOT))
    os.environ["DJANGO_SETTINGS_MODULE"] = "tests.settings"
    scratch = tempfile.TemporaryDirectory(prefix="fd-queues-")
    if args.database_url:
        os.environ["DATABASE_URL"] = args.database_url
    else:
        os.environ.pop("DATABASE_URL", None)
        os.environ["FD_SQLITE_NAME"] = args.sqlite or str(Path(scratch.name) / "queues.sqlite3")

    import django

    django.setup()
    from django.db import connection
    from django.test import Client
    from django.test.utils import CaptureQueriesContext, setup_test_environment

    from benchmarks.common import migrate_fresh

    setup_test_environment()
    migrate_fresh()
    if connection.vendor == "sqlite":
        with connection.cursor() as cursor:
            cursor.execute("PRAGMA journal_mode=WAL")

    from django_federation_delivery.models import Delivery, DeliveryHistory

    if not Delivery.objects.exists():
        fill(args.deliveries, args.hosts)
    # Refilled each run, so that the two days shown end now.
    DeliveryHistory.objects.all().delete()
    fill_history()
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE")

    from django.contrib.auth.models import User

    from django_federation_delivery import overview
    from django_federation_delivery.admin.queues import history_charts
    from django_federation_delivery.history import recent

    User.objects.filter(username="bench").delete()
    User.objects.create_superuser("bench", password="bench")
    client = Client()
    client.force_login(User.objects.get(username="bench"))
    page = "/admin/federation_delivery/delivery/queues/"

    def timed(function: object) -> float:
        start = time.perf_counter()
        function()  # type: ignore[operator]
        return time.perf_counter() - start

    client.get(page)
    overview_times = [timed(overview.overview) for _ in range(args.rounds)]
    history_times = [timed(recent) for _ in range(args.rounds)]
    charts_times = [
        timed(lambda: history_charts(dt.datetime.now(dt.UTC))) for _ in range(args.rounds)
    ]
    page_times = [timed(lambda: client.get(page)) for _ in range(args.rounds)]
    with CaptureQueriesContext(connection) as captured:
        assert client.get(page).status_code == 200
    print(
        f"{connection.vendor}, {Delivery.objects.count()} deliveries:\n"
        f"  overview() median {statistics.median(overview_times) * 1000:.1f} ms\n"
        f"  history.recent() median {statistics.median(history_times) * 1000:.1f} ms, "
        f"with both charts drawn {statistics.median(charts_times) * 1000:.1f} ms "
        f"({DeliveryHistory.objects.count()} history minutes)\n"
        f"  queues page median {statistics.median(page_times) * 1000:.1f} ms, "
        f"{len(captured)} queries"
    )
    with CaptureQueriesContext(connection) as captured:
        overview.overview()
        recent()
    explain = "EXPLAIN QUERY PLAN " if connection.vendor == "sqlite" else "EXPLAIN "
    with connection.cursor() as cursor:
        for query in captured.captured_queries:
            started = time.perf_counter()
            cursor.execute(query["sql"])
            cursor.fetchall()
            took = (time.perf_counter() - started) * 1000
            print(f"\n{took:7.1f} ms  {query['sql'][:160]}")
            cursor.execute(explain + query["sql"])
            for row in cursor.fetchall():
                print("           ", row[-1])
    scratch.cleanup()


def fill_history() -> None:
    """Two days of history, a row a minute up to now, as a busy server's."""
    from django.utils import timezone

    from django_federation_delivery.history import minute_of
    from django_federation_delivery.models import DeliveryHistory

    rng = random.Random(11)
    now = minute_of(timezone.now())
    DeliveryHistory.objects.bulk_create(
        DeliveryHistory(
            minute=now - dt.timedelta(minutes=n),
            delivered=rng.randint(200, 900),
            retried=rng.randint(0, 60),
            refused=rng.randint(0, 10),
            failed=rng.randint(0, 5),
            breakers_opened=1 if rng.random() < 0.01 else 0,
        )
        for n in range(2 * 24 * 60)
    )


def fill(count: int, hosts: int) -> None:
    """``count`` deliveries in batches of 100, shaped like a busy server's table."""
    from django.db import transaction
    from django.utils import timezone

    from django_federation_delivery import controls
    from django_federation_delivery.models import Batch, Breaker, Delivery, Lane, Status

    rng = random.Random(7)
    now = timezone.now()
    names = [f"h{n}.example" for n in range(hosts)]
    started = time.perf_counter()
    with transaction.atomic():
        batches = Batch.objects.bulk_create(
            Batch(sender="https://social.example/users/alice", body='{"type": "Note"}', size=100)
            for _ in range(count // 100 + 1)
        )
        rows = []
        for n in range(count):
            host = names[n % hosts]
            roll = rng.random()
            row = Delivery(
                batch=batches[n // 100],
                inbox=f"https://{host}/users/u{n}/inbox",
                host=host,
                lane=Lane.LOW if roll < 0.1 else Lane.NORMAL,
                attempts=1,
                last_status=202,
            )
            if roll < 0.96:  # settled over the last month
                row.settled_at = now - dt.timedelta(seconds=rng.uniform(0, 30 * 86400))
                row.status = (
                    Status.DELIVERED
                    if roll < 0.90
                    else Status.FAILED
                    if roll < 0.94
                    else Status.REFUSED
                )
                row.due_at = None
            elif roll < 0.975:  # retrying later
                row.due_at = now + dt.timedelta(seconds=rng.uniform(1, 3600))
                row.last_status = 503
            elif roll < 0.98:  # in flight
                row.due_at = now + dt.timedelta(seconds=300)
                row.lease_token = "bench"
            else:  # due, some for a while
                row.due_at = now - dt.timedelta(seconds=rng.uniform(0, 120))
                row.attempts = 0
                row.last_status = None
            rows.append(row)
            if len(rows) == 5000:
                Delivery.objects.bulk_create(rows)
                rows = []
        Delivery.objects.bulk_create(rows)
        Breaker.objects.bulk_create(
            Breaker(key=name, failures=10, open_until=now + dt.timedelta(seconds=60))
            for name in names[:20]
        )
    controls.pause_host(names[-1])
    print(f"filled {count} deliveries in {time.perf_counter() - started:.1f}s")


if __name__ == "__main__":
    main()
