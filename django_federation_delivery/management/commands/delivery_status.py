"""``manage.py delivery_status``: the admin's queues page, in a terminal."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import DEFAULT_DB_ALIAS, connections

from django_federation_delivery.overview import Overview, format_duration, overview


def _count(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        number = -1
    if number < 0:
        raise CommandError(f"expected a whole number of 0 or more, not {value!r}")
    return number


def printable(value: object) -> str:
    """``value`` as text safe to print to a terminal: what is not printable
    (an escape sequence, a line break, a bidi override) in a host or inbox
    that came from the network is shown escaped, never acted on."""
    text = str(value)
    if text.isprintable():
        return text
    return "".join(
        char if char.isprintable() else char.encode("unicode_escape").decode("ascii")
        for char in text
    )


def _when(value: Any) -> str:
    return value.strftime("%Y-%m-%d %H:%M:%S") if value is not None else "—"


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], *, numeric: int = 1) -> str:
    """Columns padded to their widest cell; those from ``numeric`` on right-aligned."""
    cells = [list(map(printable, headers)), *([printable(cell) for cell in row] for row in rows)]
    widths = [max(len(row[column]) for row in cells) for column in range(len(headers))]
    lines = []
    for row in cells:
        padded = [
            cell.rjust(width) if column >= numeric else cell.ljust(width)
            for column, (cell, width) in enumerate(zip(row, widths, strict=True))
        ]
        lines.append("  ".join(padded).rstrip())
    return "\n".join(lines)


def render(status: Overview) -> str:
    """The overview as text tables, as the admin's queues page shows it."""
    lanes = table(
        ["lane", "due", "scheduled", "in flight", "held", "lag", "delivered 1h", "failed 24h"],
        [
            [
                lane.lane,
                lane.due,
                lane.scheduled,
                lane.in_flight,
                lane.held,
                format_duration(lane.lag) if lane.oldest_due_at else "—",
                lane.delivered_last_hour,
                lane.failed_last_day,
            ]
            for lane in (*status.lanes, status.total)
        ],
    )
    parts = [f"Queues at {_when(status.at)} UTC", "", lanes, "", "Hosts failing most"]
    if status.failing_hosts:
        parts.append(
            table(
                ["host", "retrying", "last status", "breaker", "failures", "open until", "paused"],
                [
                    [
                        host.host,
                        host.retrying,
                        "—" if host.last_status is None else host.last_status,
                        host.breaker or "—",
                        host.failures,
                        _when(host.open_until),
                        "paused" if host.paused else "—",
                    ]
                    for host in status.failing_hosts
                ],
                numeric=1,
            )
        )
    else:
        parts.append("  none")
    parts += ["", f"Breakers open now: {status.open_breaker_count}"]
    if status.open_breakers:
        parts.append(
            table(
                ["destination", "state", "failures", "open until", "probe"],
                [
                    [
                        breaker.key,
                        breaker.state,
                        breaker.failures,
                        _when(breaker.open_until),
                        "under way" if breaker.probing else "—",
                    ]
                    for breaker in status.open_breakers
                ],
                numeric=2,
            )
        )
    paused = ", ".join(printable(host) for host in status.paused_hosts)
    parts += ["", f"Paused hosts: {paused or 'none'}"]
    return "\n".join(parts)


class Command(BaseCommand):
    help = (
        "Show the delivery queues: each lane's due, scheduled, in-flight and held "
        "deliveries and its lag, recent outcomes, the hosts failing most and the "
        "open breakers. --json for scripts."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--json", action="store_true", help="Print JSON, for scripts.")
        parser.add_argument(
            "--hosts",
            type=str,
            default="10",
            help="How many of the hosts failing most to show (default 10).",
        )
        parser.add_argument(
            "--database", default=DEFAULT_DB_ALIAS, help="The database alias the queue lives in."
        )

    def handle(self, *args: Any, **options: Any) -> None:
        hosts = _count(options["hosts"])
        using = options["database"]
        if using not in connections:
            raise CommandError(f"no database named {using!r} in DATABASES")
        status = overview(hosts=hosts, using=using)
        if options["json"]:
            self.stdout.write(json.dumps(status.as_json(), indent=2))
        else:
            self.stdout.write(render(status))
