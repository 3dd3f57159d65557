"""``manage.py run_deliverer`` on PostgreSQL: several processes on one queue,
and a server restarted under a running deliverer."""

from __future__ import annotations

import collections
import glob
import json
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from django.db import connection

from django_federation_delivery import send
from django_federation_delivery.models import Delivery, Status

from .conftest import MANAGE, ROOT, Inbox, assert_each_reached_once_but, subprocess_env, wait_until
from .keys import ALICE

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

NOTE = {"type": "Create", "actor": ALICE}
POSTGRES = ROOT / "scripts" / "postgres"


@pytest.fixture(autouse=True)
def _postgres_only() -> None:
    if connection.vendor != "postgresql":
        pytest.skip("several processes claiming at once, and a server to restart: PostgreSQL only")


@pytest.fixture
def processes(tmp_path: Path) -> Iterator[Callable[..., subprocess.Popen[str]]]:
    """``run_deliverer`` in processes of their own, each writing to a log file."""
    started: list[subprocess.Popen[str]] = []

    def start(*args: str, env: dict[str, str]) -> subprocess.Popen[str]:
        log = open(tmp_path / f"deliverer-{len(started)}.log", "w")  # noqa: SIM115
        process = subprocess.Popen(
            [*MANAGE, "run_deliverer", *args],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            text=True,
        )
        log.close()  # the child has its own
        started.append(process)
        return process

    yield start
    for process in started:
        if process.poll() is None:
            process.kill()
        process.wait(10)


def output(tmp_path: Path, index: int = 0) -> str:
    return (tmp_path / f"deliverer-{index}.log").read_text()


def test_four_processes_of_sixteen_deliver_each_delivery_exactly_once(
    inboxes: Callable[..., Inbox],
    processes: Callable[..., subprocess.Popen[str]],
    tmp_path: Path,
) -> None:
    sinks = [inboxes(f"127.0.0.{n}") for n in range(2, 10)]
    urls = [sink.url(f"/d{n}") for n in range(125) for sink in sinks]
    send(ALICE, NOTE, urls)
    started = time.monotonic()
    process = processes(
        "--drain", "--processes=4", "--concurrency=16", "--per-host=4", env=subprocess_env()
    )
    # Bounded under the lease, as a slow shared machine needs (it took 18 s
    # alone, and over 120 s beside the other slow tests on two cores).
    assert process.wait(280) == 0, output(tmp_path)
    took = time.monotonic() - started
    text = output(tmp_path)
    assert len(set(re.findall(r"\[deliverer (\d)/4 pid \d+\] Done:", text))) == 4
    # No lease (LEASE_SECONDS, 300 s) can have lapsed in a run this short: a
    # delivery received twice would be two processes holding one row.
    assert took < 300
    assert_each_reached_once_but(sinks, urls, twice=0)
    assert collections.Counter(Delivery.objects.values_list("status", flat=True)) == {
        Status.DELIVERED: len(urls)
    }


class PrivatePostgres:
    """A second PostgreSQL of this test's own (scripts/postgres), to stop and
    start again on the same port under a running deliverer."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.url = ""

    def start(self, port: str = "") -> str:
        answer = subprocess.run(
            ["bash", str(POSTGRES), "start", str(self.dir), *([port] if port else [])],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert answer.returncode == 0, answer.stderr
        self.url = answer.stdout.strip()
        return self.url

    @property
    def port(self) -> str:
        return self.url.rsplit(":", 1)[1].split("/")[0]

    def stop(self) -> None:
        subprocess.run(
            ["bash", str(POSTGRES), "stop", str(self.dir)], capture_output=True, timeout=120
        )

    def remove(self) -> None:
        elsewhere = self.dir / "DATADIR_IS_ELSEWHERE"
        if elsewhere.exists():
            shutil.rmtree(elsewhere.read_text().strip(), ignore_errors=True)
        shutil.rmtree(self.dir, ignore_errors=True)

    def query(self, sql: str) -> list[tuple[Any, ...]]:
        import psycopg

        with psycopg.connect(self.url, autocommit=True) as conn:
            return list(conn.execute(sql).fetchall())


@pytest.fixture
def private_postgres(tmp_path: Path) -> Iterator[PrivatePostgres]:
    if not glob.glob("/usr/lib/postgresql/*/bin/initdb"):
        pytest.skip("no PostgreSQL server installed here to start a cluster of the test's own")
    server = PrivatePostgres(tmp_path / "pg")
    try:
        yield server
    finally:
        server.stop()
        server.remove()


def manage(*args: str, env: dict[str, str]) -> None:
    answer = subprocess.run([*MANAGE, *args], env=env, capture_output=True, text=True, timeout=120)
    assert answer.returncode == 0, answer.stdout + answer.stderr


def test_a_postgres_restarted_in_the_middle_of_a_drain_is_waited_out_and_nothing_is_lost(
    inboxes: Callable[..., Inbox],
    processes: Callable[..., subprocess.Popen[str]],
    private_postgres: PrivatePostgres,
    tmp_path: Path,
) -> None:
    url = private_postgres.start()
    # A short lease, so that a claim whose answer the restart cut off (the
    # rows leased, the deliverer never told) comes due again within the test.
    settings = {"LEASE_SECONDS": 15, "ATTEMPT_TIMEOUT": 2}
    env = subprocess_env(DATABASE_URL=url, FD_SETTINGS_JSON=json.dumps(settings))
    manage("migrate", "--verbosity=0", env=env)
    sinks = [inboxes(f"127.0.0.{n}", delay=0.02) for n in range(2, 6)]
    urls = [sink.url(f"/r{n}") for n in range(200) for sink in sinks]
    queueing = "from django_federation_delivery import send; from tests.keys import ALICE; " + (
        f"send(ALICE, {NOTE!r}, {urls!r})"
    )
    manage("shell", "-c", queueing, env=env)
    table = Delivery._meta.db_table
    assert private_postgres.query(f"SELECT count(*) FROM {table}") == [(len(urls),)]

    def received() -> int:
        return sum(len(sink.received) for sink in sinks)

    process = processes("--concurrency=8", env=env)
    wait_until(lambda: received() >= 100, timeout=60)
    private_postgres.stop()
    at_stop = received()
    time.sleep(2)  # the server is away
    assert process.poll() is None, output(tmp_path)
    assert private_postgres.start(private_postgres.port) == url, "back where it was"
    assert at_stop < len(urls), "stopped in the middle of the drain"

    def all_delivered() -> bool:
        rows = private_postgres.query(f"SELECT status, count(*) FROM {table} GROUP BY status")
        return rows == [(Status.DELIVERED, len(urls))]

    wait_until(all_delivered, timeout=90, step=0.5)
    assert process.poll() is None, "still running"
    process.send_signal(signal.SIGTERM)
    assert process.wait(30) == 0
    text = output(tmp_path)
    assert "The database is unavailable" in text and "The database is back" in text, text
    # Nothing lost; sent twice only if in flight when the server went: at
    # most a slot's worth each, the attempt in flight and one queued behind it.
    assert_each_reached_once_but(sinks, urls, twice=2 * 8)
