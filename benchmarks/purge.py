#!/usr/bin/env python
"""Retention: how fast ``purge_deliveries`` deletes settled rows.

Fills a fresh database with N settled deliveries, 40 days old (past every
default retention), in batches of 5,000 inboxes over 500 hosts, plus a
batch of pending ones that must stay; then times
``retention.purge_by_setting()`` (what ``manage.py purge_deliveries`` and
``run_deliverer --purge`` run, in chunks of 5,000) and prints rows/s, the
chunks, and what was left. It asserts nothing.

    python benchmarks/purge.py [--deliveries 1000000] [--database-url URL]
    python benchmarks/purge.py --quick          # 100,000 rows

Without --database-url it runs on a temporary SQLite file (WAL,
synchronous=NORMAL). With one, point it at a THROWAWAY PostgreSQL database:
its public schema is dropped, made again and migrated.
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import environment_lines, positive, setup_django

PER_BATCH = 5_000
HOSTS = 500
PENDING = 1_000


def fill(count: int) -> None:
    """``count`` settled rows, 40 days old, written by the database itself."""
    from django.db import connection
    from django.utils import timezone

    from django_federation_delivery.dialect import quoted_table
    from django_federation_delivery.models import Batch, Delivery

    now = timezone.now()
    old = now - dt.timedelta(days=40)
    batches = Batch.objects.bulk_create(
        [
            Batch(sender="https://bench.example/u", body="{}", created_at=old)
            for _ in range(count // PER_BATCH + 2)
        ]
    )
    table = quoted_table(Delivery, connection)
    statuses = ["delivered"] * 7 + ["failed", "refused", "skipped"]
    pick = "CASE i %% 10 " + " ".join(f"WHEN {n} THEN %s" for n in range(10)) + " END"
    adapt = connection.ops.adapt_datetimefield_value
    step = 200_000  # rows an INSERT, so that neither database builds one huge CTE
    for start in range(0, count, step):
        size = min(step, count - start)
        with connection.cursor() as cursor:
            cursor.execute(
                f"INSERT INTO {table} (batch_id, kind, destination, inbox, host, via, lane, "
                "status, attempts, due_at, lease_token, last_attempt_at, last_status, "
                "last_error, settled_at, sequence, after_id) "
                f"WITH RECURSIVE n(i) AS (SELECT {start + 1} UNION ALL SELECT i + 1 FROM n "
                f"WHERE i < {start + size}) "
                f"SELECT {batches[0].id} + (i - 1) / {PER_BATCH}, 'activitypub', '', "
                f"'https://h' || (i %% {HOSTS}) || '.example/users/' || i || '/inbox', "
                f"'h' || (i %% {HOSTS}) || '.example', '[]', 'normal', {pick}, 1, NULL, NULL, "
                "%s, 202, '', %s, '', NULL FROM n",
                [*statuses, adapt(old), adapt(old)],
            )
    Delivery.objects.bulk_create(
        [
            Delivery(batch=batches[-1], inbox=f"https://p.example/{n}/inbox", host="p.example")
            for n in range(PENDING)
        ]
    )
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--deliveries", type=positive, default=1_000_000)
    parser.add_argument("--quick", action="store_true", help="100,000 rows instead")
    parser.add_argument("--database-url", default="")
    args = parser.parse_args()
    count = 100_000 if args.quick else args.deliveries

    with tempfile.TemporaryDirectory(prefix="fd-purge-") as scratch:
        database = setup_django(Path(scratch), database_url=args.database_url or None)
        from django_federation_delivery import retention
        from django_federation_delivery.models import Batch, Delivery

        for line in environment_lines():
            print(line)
        print(f"database: {database}")
        started = time.perf_counter()
        fill(count)
        print(
            f"filled {count} settled + {PENDING} pending rows in "
            f"{time.perf_counter() - started:.1f} s"
        )

        progress: list[tuple[int, float]] = []
        purged = retention.purge_by_setting(
            on_progress=lambda deleted, elapsed: progress.append((deleted, elapsed))
        )
        deleting = progress[-1][1] if progress else purged.seconds
        print(
            f"purge: {purged.line()}; {purged.chunks} chunks of at most "
            f"{retention.PURGE_CHUNK}\n"
            f"  {purged.deleted / purged.seconds:,.0f} rows/s overall, "
            f"{purged.deleted / max(deleting, 1e-9):,.0f} rows/s for the deliveries alone "
            f"({deleting:.1f} s), batches and hosts {purged.seconds - deleting:.1f} s"
        )
        if progress:
            longest = max(
                b[1] - a[1] for a, b in zip([(0, 0.0), *progress], progress, strict=False)
            )
            print(f"  longest chunk: {longest * 1000:.0f} ms (the most a writer waits)")
        print(
            f"left: {Delivery.objects.count()} deliveries "
            f"({Delivery.objects.filter(status='pending').count()} pending), "
            f"{Batch.objects.count()} batches"
        )
        from benchmarks.common import load_average

        print(f"load average at the end: {load_average()}")
        if args.database_url:
            Delivery.objects.all().delete()
            Batch.objects.all().delete()


if __name__ == "__main__":
    main()
