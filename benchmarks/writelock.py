#!/usr/bin/env python
"""How soon a claim gets SQLite's write lock from a busy sender, with the
deliverer's prompt lock (``writelock.py``) and with SQLite's busy handler alone.

A thread of this process (``tests/lockholder.py``) plays a web process
sending one post after another: it holds the write lock 0.5 to 1.5 ms each
time and takes it again 0.2 to 0.5 ms after each commit. From inside one of
its transactions, a claim (``BEGIN IMMEDIATE``, then the claim's UPDATE)
waits for the lock; the figure is how many more of the sender's transactions
go by before the claim gets in (the one under way when it began must end
first, and is not counted), and how long the claim took. The two ways take
turns, claim by claim, so that whatever else the machine does weighs on both
alike. SQLite's handler looks at the lock after 1, 3, 8, 18, 33, 53 … ms and
misses the free moments between; the prompt lock looks every millisecond or
so.

Prints the figures of each way, and their ratios, for each round; asserts
nothing.

    python benchmarks/writelock.py [--rounds 5] [--claims 50]

See benchmarks/README.rst.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

if not __package__:  # run as a script: benchmarks/ is on the path, the repository is not
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (
    clear_queue,
    environment_lines,
    in_workdir,
    load_average,
    make_activity,
    positive,
    setup_django,
)

WAYS = ("prompt lock", "busy handler")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=positive, default=5, help="rounds (5)")
    parser.add_argument(
        "--claims", type=positive, default=50, help="claims of each way a round (50)"
    )
    parser.add_argument("--tmpdir", default=None)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    return in_workdir("fd-writelock-", args.tmpdir, lambda workdir: benchmark(args, workdir))


def benchmark(args: argparse.Namespace, workdir: Path) -> int:
    database = setup_django(workdir, database_url=None)

    import django
    from django.db import connection

    from django_federation_delivery import send, writelock
    from django_federation_delivery.store import claims
    from tests.keys import ALICE
    from tests.lockholder import Holder

    if django.VERSION < (5, 1):
        sys.exit("Django 4.2 has no transaction_mode: its BEGIN takes no lock to wait for")
    connection.close()
    connection.settings_dict["OPTIONS"].update({"timeout": 20, "transaction_mode": "IMMEDIATE"})
    connection.ensure_connection()

    print("django-federation-delivery: a claim waiting for a busy sender's write lock")
    for line in environment_lines():
        print(f"  {line}")
    print(f"  database: {database}, transaction_mode=IMMEDIATE, busy timeout 20 s")
    print(f"  rounds {args.rounds}; claims of each way a round {args.claims}")
    print()

    activity = make_activity(ALICE)
    draw = random.Random(1)
    path = str(connection.settings_dict["NAME"])
    results: list[dict[str, Figures]] = []
    for number in range(1, args.rounds + 1):
        send(ALICE, activity, [f"https://a.example/inbox/{n}" for n in range(2 * args.claims)])
        sender = Holder(
            path, lambda: draw.uniform(0.0005, 0.0015), lambda: draw.uniform(0.0002, 0.0005)
        )
        sender.start()
        by_way = {way: Figures() for way in WAYS}
        try:
            for _ in range(args.claims):
                by_way["busy handler"].claim(sender, claims.claim)
                remove = writelock.install("default")
                try:
                    by_way["prompt lock"].claim(sender, claims.claim)
                finally:
                    remove()
        finally:
            sender.stopping.set()
            sender.join(10)
        results.append(by_way)
        print(f"  round {number}: " + "; ".join(by_way[way].said(way) for way in WAYS))
        print(f"    load average {load_average()}", flush=True)
        clear_queue()

    print()
    print(
        f"{'round':<7}{'passed by: prompt':>18}{'busy handler':>14}{'ratio':>8}"
        f"{'mean claim ms: prompt':>24}{'busy handler':>14}{'ratio':>8}"
    )
    passed_ratios, wait_ratios = [], []
    for number, by_way in enumerate(results, 1):
        prompt, busy = (by_way[way] for way in WAYS)
        passed = (sum(prompt.passed), sum(busy.passed))
        waits = (statistics.fmean(prompt.waits) * 1000, statistics.fmean(busy.waits) * 1000)
        passed_ratio = passed[0] / passed[1] if passed[1] else float("nan")
        wait_ratio = waits[0] / waits[1] if waits[1] else float("nan")
        passed_ratios.append(passed_ratio)
        wait_ratios.append(wait_ratio)
        print(
            f"{number:<7}{passed[0]:>18}{passed[1]:>14}{passed_ratio:>8.2f}"
            f"{waits[0]:>24.2f}{waits[1]:>14.2f}{wait_ratio:>8.2f}"
        )
    print(
        f"median ratio prompt lock/busy handler: transactions passed by "
        f"{statistics.median(passed_ratios):.2f}, claim time {statistics.median(wait_ratios):.2f}"
    )
    print(
        "(passed by: the sender's transactions that went by while a claim waited, beyond "
        "the one under way, summed over the round's claims; claim ms: the mean claim, "
        "long waits included)"
    )
    print(f"load average at the end: {load_average()}")
    return 0


@dataclasses.dataclass
class Figures:
    """What came of one way's claims in a round."""

    #: For each claim, the sender's transactions that went by while it waited,
    #: beyond the one under way when it began.
    passed: list[int] = dataclasses.field(default_factory=list)
    #: For each claim, how long it took, in seconds.
    waits: list[float] = dataclasses.field(default_factory=list)

    def claim(self, sender: Any, claim: Callable[..., list[Any]]) -> None:
        # From inside one of the sender's transactions: the claim must wait.
        if not sender.holding.wait(10):
            raise SystemExit(f"the sender holds no lock: {sender.error!r}")
        before = sender.committed
        started = time.perf_counter()
        if len(claim(1, 60)) != 1:
            raise SystemExit("a claim found nothing to claim")
        self.waits.append(time.perf_counter() - started)
        self.passed.append(max(0, sender.committed - before - 1))

    def said(self, way: str) -> str:
        return (
            f"{way} {sum(self.passed)} passed by, "
            f"claim {statistics.median(self.waits) * 1000:.2f} ms median, "
            f"{max(self.waits) * 1000:.1f} ms at most"
        )


if __name__ == "__main__":
    sys.exit(main())
