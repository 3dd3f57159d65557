"""The operator's views at a big server's scale (tens of thousands of hosts,
hundreds of thousands of rows): a bounded number of queries, none fetching
a whole table into Python, and what they show true."""

from __future__ import annotations

import contextlib
import datetime as dt
import io
import json
from collections.abc import Iterator
from typing import Any

import pytest
from django.core.management import call_command
from django.db import connection
from django.db.backends.utils import CursorWrapper
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from django_federation_delivery.models import Batch, Breaker, Delivery, Host, Lane, Status

from .test_admin import act_on_all, login, url

pytestmark = pytest.mark.django_db


@pytest.fixture
def operator() -> Client:
    return login("operator")


class Fetched:
    """Rows each query handed to Python, by its SQL."""

    def __init__(self) -> None:
        self.rows: dict[str, int] = {}
        self.last = ""
        self.queries = 0

    def most(self) -> tuple[int, str]:
        return max(((n, sql) for sql, n in self.rows.items()), default=(0, ""))

    def of(self, table: str) -> int:
        """Rows fetched by the queries that read ``table`` (FROM it)."""
        return sum(n for sql, n in self.rows.items() if f'FROM "{table}"' in sql)


@contextlib.contextmanager
def fetched(monkeypatch: pytest.MonkeyPatch) -> Iterator[Fetched]:
    """Count the rows every query returns to Python (Django's cursor: queries
    are logged, as under CaptureQueriesContext, so the package's too)."""
    seen = Fetched()
    execute = CursorWrapper.execute

    def counting_execute(self: Any, sql: str, params: Any = None) -> Any:
        seen.last = sql
        seen.queries += 1
        seen.rows.setdefault(sql, 0)
        return execute(self, sql, params)

    def fetchone(self: Any) -> Any:
        row = self.cursor.fetchone()
        if row is not None:
            seen.rows[seen.last] = seen.rows.get(seen.last, 0) + 1
        return row

    def fetchmany(self: Any, size: int = 100) -> Any:
        rows = self.cursor.fetchmany(size)
        seen.rows[seen.last] = seen.rows.get(seen.last, 0) + len(rows)
        return rows

    def fetchall(self: Any) -> Any:
        rows = self.cursor.fetchall()
        seen.rows[seen.last] = seen.rows.get(seen.last, 0) + len(rows)
        return rows

    monkeypatch.setattr(CursorWrapper, "execute", counting_execute)
    monkeypatch.setattr(CursorWrapper, "fetchone", fetchone, raising=False)
    monkeypatch.setattr(CursorWrapper, "fetchmany", fetchmany, raising=False)
    monkeypatch.setattr(CursorWrapper, "fetchall", fetchall, raising=False)
    with CaptureQueriesContext(connection):
        yield seen
    monkeypatch.undo()


def fill(hosts: int, deliveries: int, *, paused: float = 0.01, failing: float = 0.02) -> list[str]:
    """``hosts`` Host rows (some unavailable, failing, paused) and
    ``deliveries`` deliveries over them, a mix of every state."""
    now = timezone.now()
    names = [f"h{n:06d}.example" for n in range(hosts)]
    rows = []
    for n, name in enumerate(names):
        row = Host(name=name, first_seen_at=now, last_delivered_at=now)
        if n % 100 < 1:
            row.unavailable_since = now - dt.timedelta(days=1)
            row.failing_since = now - dt.timedelta(days=8)
        elif n % 100 < 1 + failing * 100:
            row.failing_since = now - dt.timedelta(minutes=n % 997)
        elif n % 100 < 1 + failing * 100 + paused * 100:
            row.paused_at = now
        rows.append(row)
    Host.objects.bulk_create(rows, batch_size=5000)
    batches = Batch.objects.bulk_create(
        [
            Batch(sender="https://social.example/users/alice", body="{}", size=100)
            for _ in range(deliveries // 100 + 1)
        ],
        batch_size=5000,
    )
    made = []
    for n in range(deliveries):
        host = names[n % hosts]
        row = Delivery(
            batch=batches[n // 100],
            inbox=f"https://{host}/users/u{n}/inbox",
            host=host,
            lane=Lane.NORMAL,
            attempts=1,
            last_status=202,
        )
        kind = n % 10
        if kind < 6:
            row.status, row.due_at, row.settled_at = Status.DELIVERED, None, now
        elif kind < 7:
            row.status, row.due_at, row.settled_at = Status.FAILED, None, now
        elif kind < 8:
            row.due_at = now + dt.timedelta(minutes=5)
            row.last_status = 503
            row.attempts = 2
        else:
            row.due_at = now - dt.timedelta(seconds=5)
            row.attempts = 0
            row.last_status = None
        made.append(row)
    Delivery.objects.bulk_create(made, batch_size=5000)
    Breaker.objects.bulk_create(
        [
            Breaker(key=name, failures=10, open_until=now + dt.timedelta(minutes=1))
            for name in names[: max(1, hosts // 100)]
        ]
    )
    return names


def pause_many(count: int) -> list[str]:
    """``count`` hosts an operator paused (a blocklist, paused by "select all")."""
    now = timezone.now()
    names = [f"p{n:06d}.example" for n in range(count)]
    Host.objects.bulk_create([Host(name=name, paused_at=now) for name in names], batch_size=5000)
    return names


HOSTS = "federation_delivery_host"


def test_the_queues_page_reads_a_bounded_number_of_paused_hosts(
    operator: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    fill(100, 1000, paused=0)
    read = []
    sizes = []
    for paused in (100, 3_000):
        Host.objects.filter(name__startswith="p").delete()
        pause_many(paused)
        operator.get(url("delivery", "queues"))
        with fetched(monkeypatch) as seen:
            response = operator.get(url("delivery", "queues"))
        assert response.status_code == 200
        read.append(seen.of(HOSTS))
        sizes.append(len(response.content))
    assert read[1] <= 1000, (
        f"the queues page fetched {read} rows of the hosts table for 100 and 3,000 paused "
        f"hosts (the page {sizes} bytes): every paused host is read and listed"
    )


@pytest.mark.parametrize("args", [[], ["--json"]])
def test_delivery_status_reads_a_bounded_number_of_paused_hosts(
    monkeypatch: pytest.MonkeyPatch, args: list[str]
) -> None:
    fill(100, 1000, paused=0)
    pause_many(3_000)
    out = io.StringIO()
    with fetched(monkeypatch) as seen:
        call_command("delivery_status", *args, stdout=out)
    text = out.getvalue()
    listed = len(json.loads(text)["paused_hosts"]) if args else text.count("p0")
    assert seen.of(HOSTS) <= 1000, (
        f"delivery_status {' '.join(args)} fetched {seen.of(HOSTS)} rows of the hosts table "
        f"and printed {listed} paused hosts ({len(text)} characters) for 3,000 paused hosts"
    )
    if args:
        data = json.loads(text)
        assert (len(data["paused_hosts"]), data["paused_host_count"]) == (50, 3_000)
        assert data["paused_hosts"][0] == "p000000.example"
    else:
        assert "p000049.example, and 2950 more" in text


def test_the_deliveries_list_reads_only_the_paused_hosts_its_filter_offers(
    operator: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    fill(100, 1000, paused=0)
    pause_many(3_000)
    operator.get(url("delivery"))
    with fetched(monkeypatch) as seen:
        response = operator.get(url("delivery"))
    assert response.status_code == 200
    page = response.content.decode()
    offered = page.count("?host=p0")
    assert seen.of(HOSTS) <= 100, (
        f"the deliveries list fetched {seen.of(HOSTS)} rows of the hosts table to offer "
        f"{offered} paused hosts in its host filter"
    )


def _selects_hosts_of_deliveries(sql: str) -> bool:
    """Whether ``sql`` reads the host column alone of the deliveries (each
    Django version words it its own way: DISTINCT or not, AS or not)."""
    columns, _, rest = sql.partition(" FROM ")
    return rest.startswith('"federation_delivery_delivery"') and (
        columns.endswith('"federation_delivery_delivery"."host"')
        or columns.endswith('"federation_delivery_delivery"."host" AS "host"')
    )


def test_pausing_the_hosts_of_all_selected_deliveries_reads_each_host_once(
    operator: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    fill(5, 5_000)
    first = Delivery.objects.order_by("id").values_list("id", flat=True).first()
    with fetched(monkeypatch) as seen:
        response = act_on_all(operator, "delivery", "pause_hosts", first)
    assert response.status_code == 302
    assert Host.objects.filter(paused_at__isnull=False).count() == 5
    read = max(n for sql, n in seen.rows.items() if _selects_hosts_of_deliveries(sql))
    assert read <= 100, (
        f"pausing the 5 hosts of 5,000 selected deliveries fetched {read} rows, "
        "each delivery's host"
    )


def retry(retrying: dict[str, int]) -> None:
    """As many deliveries as ``retrying`` says to each of its hosts, each
    tried three times and due again in five minutes."""
    now = timezone.now()
    batch = Batch.objects.create(sender="https://social.example/users/alice", body="{}", size=1)
    Delivery.objects.bulk_create(
        [
            Delivery(
                batch=batch,
                inbox=f"https://{host}/users/u{n}/inbox",
                host=host,
                attempts=3,
                last_status=503,
                due_at=now + dt.timedelta(minutes=5),
            )
            for host, count in retrying.items()
            for n in range(count)
        ],
        batch_size=5000,
    )


def failing_most() -> list[dict[str, Any]]:
    """The hosts failing most, as ``delivery_status --json`` lists them."""
    out = io.StringIO()
    call_command("delivery_status", "--json", stdout=out)
    return list(json.loads(out.getvalue())["failing_hosts"])


def test_the_hosts_failing_most_include_the_open_breaker_failing_most() -> None:
    now = timezone.now()
    retrying: dict[str, int] = {"worst.example": 300}
    retrying.update({f"busy{n}.example": 400 for n in range(10)})
    retrying.update({f"q{n}.example": 1 for n in range(10)})
    retry(retrying)
    # Many breakers open, as on a server sending to tens of thousands of hosts:
    # ten opened a little earlier, with 5 failures; the worst one just now, with 500.
    Breaker.objects.bulk_create(
        [
            Breaker(key=f"q{n}.example", failures=5, open_until=now + dt.timedelta(seconds=10))
            for n in range(10)
        ]
        + [Breaker(key="worst.example", failures=500, open_until=now + dt.timedelta(seconds=50))]
    )
    shown = [
        (host["host"], host["breaker"], host["failures"], host["retrying"])
        for host in failing_most()
    ]
    assert ("worst.example", "open", 500, 300) in shown, (
        "the hosts failing most leave out worst.example (breaker open, 500 failures in a "
        f"row, 300 retrying) and show {shown}"
    )


def test_the_hosts_failing_most_are_the_first_of_all_in_the_order_shown() -> None:
    # Shown: open breakers first, then the most retrying, then the most
    # failures. Eleven open hosts have 5 retrying deliveries each; z.example
    # has the most failures of them (3, the others 1), so it is the first of
    # the eleven. Its candidates were taken by retrying, ties by name (a0 to
    # a9), and by failures among every breaker (x0 to x9, 100 failures, none
    # retrying): z.example was none of them, and a9.example is shown instead.
    now = timezone.now()
    retry({f"a{n}.example": 5 for n in range(10)} | {"z.example": 5})
    until = now + dt.timedelta(minutes=1)
    Breaker.objects.bulk_create(
        [Breaker(key=f"a{n}.example", failures=1, open_until=until) for n in range(10)]
        + [Breaker(key="z.example", failures=3, open_until=until)]
        + [Breaker(key=f"x{n}.example", failures=100, open_until=until) for n in range(10)]
    )
    shown = [(host["host"], host["retrying"], host["failures"]) for host in failing_most()]
    assert ("z.example", 5, 3) in shown, (
        f"the hosts failing most leave out z.example (open, 5 retrying, 3 failures) and show "
        f"{shown}"
    )


def test_resetting_every_breaker_takes_a_few_statements_a_chunk(
    operator: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    import time

    now = timezone.now()
    Breaker.objects.bulk_create(
        [
            Breaker(key=f"h{n:06d}.example", failures=10, open_until=now + dt.timedelta(minutes=1))
            for n in range(3_000)
        ],
        batch_size=5000,
    )
    started = time.perf_counter()
    with fetched(monkeypatch) as seen:
        response = act_on_all(operator, "breaker", "reset", "h000000.example")
    took = time.perf_counter() - started
    assert response.status_code == 302
    assert not Breaker.objects.exists()
    assert seen.queries <= 200, (
        f"resetting 3,000 selected breakers made {seen.queries} queries "
        f"({took:.1f} s), a DELETE a breaker"
    )
