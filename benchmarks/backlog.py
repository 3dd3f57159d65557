#!/usr/bin/env python
"""A dead host with a standing backlog, beside a healthy stream.

The shape of a server whose followers include an instance that went away:
thousands of deliveries to it wait behind its open circuit breaker while
new posts keep coming. A deliverer (``Deliverer.run()`` in a thread, as
``run_deliverer`` runs it) sends a stream of fan-outs, one every 50 ms, each
to one inbox on a healthy host (a local HTTP server answering 202) and to 24
on a dead one (a port that refuses connections), for ``--seconds``; in one
phase the dead host also has ``--backlog`` deliveries queued before the
stream starts, in the other it has none. The breaker is the default one but
for a short cool-off (``--cool-off``, 2 s; the default is 60), so that a run
sees several.

Prints, for each phase and round, how long the healthy host's deliveries
took from ``send()`` to their arrival (median, 90th and 99th percentile,
most), how many claims the deliverer made and the rows they took (and of
those, the dead host's), and the attempts it counted (a delivery held back
by the open breaker counts as one); then the medians of each over the
rounds, and the ratio of the healthy deliveries' 90th percentile with the
backlog to without. Asserts nothing.

    python benchmarks/backlog.py [--rounds 3] [--backlog 3000] [--cool-off 2]
        [--seconds 14] [--database-url URL]

See benchmarks/README.rst.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import socket
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

if not __package__:  # run as a script: benchmarks/ is on the path, the repository is not
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (
    DelivererThread,
    add_database_and_tmpdir,
    clear_all,
    environment_lines,
    in_workdir,
    load_average,
    make_activity,
    percentile,
    positive,
    setup_django,
)

HEALTHY = "127.0.0.2"
DEAD = "127.0.0.3"
#: A send of the stream: one inbox on the healthy host, this many on the dead one.
DEAD_PER_SEND = 24
SEND_EVERY = 0.05
#: What the deliverer is given to send what is left once the stream ends.
SETTLE = 3.0
PHASES = ("without the backlog", "with the backlog")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=positive, default=3, help="rounds of both phases (3)")
    parser.add_argument(
        "--backlog", type=positive, default=3000, help="deliveries queued to the dead host (3000)"
    )
    parser.add_argument("--cool-off", type=float, default=2.0, help="the breaker's COOL_OFF (2)")
    parser.add_argument(
        "--seconds", type=float, default=14.0, help="how long the stream lasts (14)"
    )
    add_database_and_tmpdir(parser)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    return in_workdir("fd-backlog-", args.tmpdir, lambda workdir: benchmark(args, workdir))


@dataclasses.dataclass
class Phase:
    """What one phase of one round came to."""

    #: Seconds from each healthy delivery's send() to its arrival.
    latencies: list[float]
    sent: int
    claims: int
    rows: int
    dead_rows: int
    attempts: int

    def quantile(self, share: float) -> float:
        return percentile(self.latencies, share)

    def said(self) -> str:
        return (
            f"{len(self.latencies)}/{self.sent} healthy, in s: median {self.quantile(0.5):.3f} "
            f"p90 {self.quantile(0.9):.3f} p99 {self.quantile(0.99):.3f} "
            f"most {max(self.latencies, default=float('nan')):.3f}; claims {self.claims}, "
            f"rows {self.rows} ({self.dead_rows} the dead host's), attempts {self.attempts}"
        )


def benchmark(args: argparse.Namespace, workdir: Path) -> int:
    database = setup_django(workdir, database_url=args.database_url or None)

    from django.conf import settings
    from django.test.utils import override_settings

    from django_federation_delivery import intake, send
    from django_federation_delivery.conf import DEFAULTS
    from django_federation_delivery.deliverer import Deliverer
    from tests.conftest import start_inbox
    from tests.keys import ALICE

    arrivals: dict[str, float] = {}

    def arrived(request: Any) -> tuple[int, dict[str, str], bytes]:
        arrivals.setdefault(request.path, time.monotonic())
        return 202, {}, b""

    healthy, server = start_inbox(HEALTHY, respond=arrived)
    # Bound and never listening: every connection to it is refused.
    dead = socket.socket()
    dead.bind((DEAD, 0))
    dead_port = dead.getsockname()[1]
    activity = make_activity(ALICE)
    # The loop's claims, counted where it makes them: the rows each took, and whose.
    counts: collections.Counter[str] = collections.Counter()
    claim = intake.claims.claim

    def counted_claim(*claim_args: Any, **kwargs: Any) -> Any:
        rows = claim(*claim_args, **kwargs)
        counts["claims"] += 1
        counts["rows"] += len(rows)
        counts["dead rows"] += sum(1 for row in rows if row.host == f"{DEAD}:{dead_port}")
        return rows

    def dead_inboxes(prefix: str, count: int) -> list[str]:
        return [f"http://{DEAD}:{dead_port}/{prefix}/{n}" for n in range(count)]

    def phase(backlog: int, number: int) -> Phase:
        clear_all()
        arrivals.clear()
        counts.clear()
        for start in range(0, backlog, 500):
            send(
                ALICE,
                activity,
                dead_inboxes(f"backlog/{number}/{start}", min(500, backlog - start)),
            )
        runner = DelivererThread(Deliverer())
        runner.start()
        sent: dict[str, float] = {}
        ends = time.monotonic() + args.seconds
        while time.monotonic() < ends:
            path = f"/r{number}/s{len(sent)}"
            sent[path] = time.monotonic()
            send(ALICE, activity, [healthy.url(path), *dead_inboxes(path, DEAD_PER_SEND)])
            time.sleep(SEND_EVERY)
        time.sleep(SETTLE)
        if not runner.stop(60):
            raise SystemExit("the deliverer did not stop within 60 s")
        if runner.error is not None:
            raise SystemExit(f"the deliverer failed: {runner.error!r}")
        return Phase(
            latencies=[arrivals[path] - at for path, at in sent.items() if path in arrivals],
            sent=len(sent),
            claims=counts["claims"],
            rows=counts["rows"],
            dead_rows=counts["dead rows"],
            attempts=runner.summary.attempts,
        )

    print("django-federation-delivery: a dead host's standing backlog beside a healthy stream")
    for line in environment_lines():
        print(f"  {line}")
    print(f"  database: {database}")
    print(
        f"  rounds {args.rounds}; backlog {args.backlog}; breaker cool-off {args.cool_off:g} s; "
        f"a send every {SEND_EVERY * 1000:.0f} ms for {args.seconds:g} s, to 1 healthy inbox "
        f"and {DEAD_PER_SEND} dead ones"
    )
    breaker = {**DEFAULTS["BREAKER"], "COOL_OFF": args.cool_off}
    configured = {**settings.FEDERATION_DELIVERY, "BREAKER": breaker}
    results: dict[str, list[Phase]] = {name: [] for name in PHASES}
    intake.claims.claim = counted_claim  # type: ignore[assignment]
    try:
        with override_settings(FEDERATION_DELIVERY=configured):
            for number in range(1, args.rounds + 1):
                print(f"round {number}, load {load_average()}", flush=True)
                for name, backlog in zip(PHASES, (0, args.backlog), strict=True):
                    result = phase(backlog, number)
                    results[name].append(result)
                    print(f"  {name:<20} {result.said()}", flush=True)
    finally:
        intake.claims.claim = claim  # type: ignore[assignment]
        server.shutdown()
        server.server_close()
        dead.close()

    print()

    def median(name: str, figure: Callable[[Phase], float]) -> float:
        return statistics.median(figure(result) for result in results[name])

    for name in PHASES:
        print(
            f"median {name:<20} healthy p50 {median(name, lambda p: p.quantile(0.5)):.3f} s, "
            f"p90 {median(name, lambda p: p.quantile(0.9)):.3f} s, "
            f"p99 {median(name, lambda p: p.quantile(0.99)):.3f} s; "
            f"claims {median(name, lambda p: p.claims):.0f}, "
            f"the dead host's rows claimed {median(name, lambda p: p.dead_rows):.0f}, "
            f"attempts {median(name, lambda p: p.attempts):.0f}"
        )
    ratios = [
        with_.quantile(0.9) / without.quantile(0.9)
        for without, with_ in zip(*(results[name] for name in PHASES), strict=True)
    ]
    print(
        f"healthy p90 with the backlog / without: median {statistics.median(ratios):.1f}x "
        f"({', '.join(f'{ratio:.1f}' for ratio in ratios)})"
    )
    print(f"load average at the end: {load_average()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
