#!/usr/bin/env python
"""Replay: how long ``delivery_replay`` takes to queue again what a big host
was sent, beside what sending the same took.

Sends N activities, each to one inbox on one host (a big instance's shared
inbox, as a day of posts reaches it), one ``send()`` each, all in one
transaction; settles them delivered; then times ``replay(host=…)`` (what
``manage.py delivery_replay`` and the admin's action run): N new batches,
each inbox's chained one behind the other. Prints the seconds of each and
their ratio, round by round, and how much the replay grew the process's
resident memory. Asserts nothing.

    python benchmarks/replay.py [--deliveries 10000] [--rounds 3] [--database-url URL]

Without --database-url it runs on a temporary SQLite file (WAL,
synchronous=NORMAL). With one, point it at a THROWAWAY PostgreSQL database:
its public schema is dropped, made again and migrated.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import environment_lines, load_average, positive, setup_django

HOST = "big.example"
#: Inboxes on the host: its shared inbox, and a few of its users'.
INBOXES = 4


def one_round(count: int) -> tuple[float, float, float, int]:
    """Send ``count``, settle them, replay them: the seconds of the sends and
    of the replay, how much the process's resident memory grew by the end of
    the replay (what it returns held), in MB, and how many deliveries it
    queued."""
    from django.db import transaction
    from django.utils import timezone

    from django_federation_delivery import send
    from django_federation_delivery.models import Batch, Delivery, Status
    from django_federation_delivery.replay import replay
    from tests.keys import ALICE

    Delivery.objects.all().delete()
    Batch.objects.all().delete()
    started = time.perf_counter()
    with transaction.atomic():
        for n in range(count):
            activity = {
                "type": "Create",
                "id": f"{ALICE}/activities/{n}",
                "actor": ALICE,
                "object": {"type": "Note", "content": "x" * 300},
            }
            send(ALICE, activity, [f"https://{HOST}/users/u{n % INBOXES}/inbox"])
    sending = time.perf_counter() - started
    now = timezone.now()
    Delivery.objects.update(status=Status.DELIVERED, settled_at=now, due_at=None)
    resident = resident_mb()
    started = time.perf_counter()
    batches = replay(host=HOST, since=now - dt.timedelta(hours=1))
    replaying = time.perf_counter() - started
    grown = resident_mb() - resident
    return sending, replaying, grown, sum(batch.size for batch in batches)


def resident_mb() -> float:
    """This process's resident memory now, in MB (Linux)."""
    with open("/proc/self/statm") as statm:
        pages = int(statm.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--deliveries", type=positive, default=10_000, help="N (10000)")
    parser.add_argument("--rounds", type=positive, default=3, help="rounds (3)")
    parser.add_argument(
        "--database-url",
        default="",
        help="a THROWAWAY PostgreSQL: its public schema dropped, made again and migrated",
    )
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="fd-replay-") as scratch:
        database = setup_django(Path(scratch), database_url=args.database_url or None)
        for line in environment_lines():
            print(line)
        print(f"database: {database}")
        print(
            f"{args.deliveries} one-inbox sends to {HOST} ({INBOXES} inboxes), "
            f"then replay(host={HOST!r}); {args.rounds} rounds\n"
        )
        print(f"{'round':<6} {'send s':>8} {'replay s':>9} {'ratio':>6} {'RSS +MB':>8}  queued")
        ratios, replays = [], []
        for number in range(1, args.rounds + 1):
            sending, replaying, grown, queued = one_round(args.deliveries)
            ratios.append(replaying / sending)
            replays.append(replaying)
            print(
                f"{number:<6} {sending:>8.2f} {replaying:>9.2f} {replaying / sending:>6.2f} "
                f"{grown:>8.1f}  {queued}",
                flush=True,
            )
        print(
            f"median: replay {statistics.median(replays):.2f} s "
            f"({1000 * statistics.median(replays) / args.deliveries:.3f} ms a delivery), "
            f"{statistics.median(ratios):.2f}x the sends"
        )
        print(f"load average at the end: {load_average()}")


if __name__ == "__main__":
    main()
