"""``manage.py run_deliverer`` as an operator runs it: a process of its own."""

from __future__ import annotations

import collections
import contextlib
import datetime as dt
import functools
import io
import json
import logging
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from django.core.management import CommandError, call_command
from django.db import connection, connections, transaction
from django.utils import timezone

from django_federation_delivery import send
from django_federation_delivery.deliverer import Deliverer
from django_federation_delivery.models import Batch, Delivery, Status
from django_federation_delivery.wakeup import NOTIFY_CHANNEL

from .conftest import (
    MANAGE,
    ROOT,
    Inbox,
    Overlap,
    Received,
    RunningDeliverer,
    assert_each_reached_once_but,
    near_miss,
    piped_to_head,
    subprocess_env,
    wait_until,
)
from .keys import ALICE

# The tests that start a deliverer process are marked slow; the rest run in-process.
# Those of signals, supervision and heartbeats are marked any_database: CI
# runs them on SQLite only, and the ones whose subject is the queue on both.
pytestmark = pytest.mark.django_db(transaction=True)

#: The longest a test waits for what a fresh process does first (it imports
#: Django, migrates nothing, connects): a supervisor and its two children
#: took 50 s with every run of the suite at once on two cores.
STARTED = 150.0
#: An inbox that answers after this long, and attempts let to wait for it: a
#: process finishing what is in flight would take minutes …
STUCK = 250.0
STUCK_SETTINGS = {"ATTEMPT_TIMEOUT": 200, "LEASE_SECONDS": 300}
#: … and one told to stop at once, well under one, on a machine busy past its
#: cores.
AT_ONCE = 60.0
NOTE = {"type": "Create", "actor": ALICE}


@pytest.fixture
def processes() -> Iterator[Callable[..., subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []

    def start(
        *args: str,
        settings: dict[str, Any] | None = None,
        log_level: str = "WARNING",
        env: dict[str, str] | None = None,
        closed: int | None = None,
    ) -> subprocess.Popen[str]:
        """``closed``: 1 or 2, started with no stdout or no stderr (``>&-``),
        the other still read."""
        environment = subprocess_env(
            FD_SETTINGS_JSON=json.dumps(settings or {}), FD_LOG_LEVEL=log_level, **(env or {})
        )
        process = subprocess.Popen(
            [*MANAGE, "run_deliverer", *args],
            env=environment,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            preexec_fn=None if closed is None else functools.partial(os.close, closed),
        )
        started.append(process)
        return process

    yield start
    for process in started:
        if process.poll() is None:
            process.kill()
        process.wait(10)
        if process.stdout:
            process.stdout.close()


def wait_for_line(process: subprocess.Popen[str], text: str, timeout: float = STARTED) -> str:
    """The first line of the process's output holding ``text``; fails after
    ``timeout`` seconds rather than waiting on a silent process for ever."""
    assert process.stdout is not None
    lines: queue.SimpleQueue[str | None] = queue.SimpleQueue()

    def read() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            lines.put(line)
            if text in line:
                return
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    started = time.monotonic()
    deadline = started + timeout
    seen: list[str] = []
    while (left := deadline - time.monotonic()) > 0:
        try:
            line = lines.get(timeout=left)
        except queue.Empty:
            break
        if line is None:
            break
        seen.append(line)
        if text in line:
            near_miss(time.monotonic() - started, timeout)
            return line
    raise AssertionError(f"{text!r} never came; output was:\n{''.join(seen)}")


def statuses() -> collections.Counter[str]:
    return collections.Counter(Delivery.objects.values_list("status", flat=True))


def test_drain_sends_what_is_due_with_progress_and_a_summary(inbox: Inbox) -> None:
    send(ALICE, NOTE, [inbox.url(f"/{n}") for n in range(30)])
    out = io.StringIO()
    handler = signal.getsignal(signal.SIGTERM)
    call_command("run_deliverer", "--drain", stdout=out)
    assert signal.getsignal(signal.SIGTERM) is handler, "the caller's handler is put back"
    text = out.getvalue()
    assert "Done: delivered 30, retrying 0, refused 0, failed 0" in text
    assert "[##############################] 30/30" in text, "a progress bar of what was due"
    assert "/s)" in text
    assert statuses() == {Status.DELIVERED: 30}


def test_a_ctrl_c_before_the_loop_takes_it_exits_130_with_one_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # While the migrations were looked at: a KeyboardInterrupt's traceback.
    from django_federation_delivery.management.commands import run_deliverer

    def interrupted(using: str) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(run_deliverer, "require_migrations", interrupted)
    err = io.StringIO()
    with pytest.raises(SystemExit) as exited:
        call_command("run_deliverer", "--drain", stderr=err)
    assert exited.value.code == 130
    assert err.getvalue() == "Interrupted.\n"


def test_the_drain_bar_counts_deliveries_that_left_the_queue_never_past_what_was_due() -> None:
    from django_federation_delivery.management.running import drain_progress
    from django_federation_delivery.settling import Summary

    said: list[str] = []
    bar = drain_progress(10, said.append)
    # Retries and holds are steps of a delivery still in the queue.
    bar(Summary(delivered=3, refused=1, retrying=9, held=6))
    bar(Summary(delivered=8, failed=1, skipped=1, retrying=12, held=9))
    assert [line.split("  ")[1] for line in said] == [
        "[############..................] 4/10",
        "[##############################] 10/10",
    ]
    # Nothing due: nothing left to do, not one thing of one.
    said.clear()
    drain_progress(0, said.append)(Summary())
    assert said[0].split("  ")[1] == "[##############################] 0/0"


def test_a_drain_shared_by_processes_shows_each_its_own_counts_not_a_bar_of_the_whole() -> None:
    from django_federation_delivery.management.running import drain_progress
    from django_federation_delivery.settling import Summary

    said: list[str] = []
    # One of two children, what is due shared between them: how much of it
    # this one will send is not known, so no total is.
    drain_progress(None, said.append)(Summary(delivered=15, skipped=1, retrying=2))
    (line,) = said
    assert line.startswith("  delivered 15, retrying 2, refused 0, failed 0, skipped 1, held 0")
    assert "[" not in line and "/" not in line.split("(")[0]


@pytest.mark.parametrize("option", ["--concurrency", "--per-host", "--per-host-max"])
@pytest.mark.parametrize("value", ["0", "-3", "many", "100000", ""])
def test_a_bad_number_is_refused_naming_it(option: str, value: str) -> None:
    with pytest.raises(CommandError, match=repr(value)):
        call_command("run_deliverer", "--drain", f"{option}={value}")


@pytest.mark.parametrize(
    ("command", "options"),
    [
        ("run_deliverer", {"drain": True, "concurrency": 4, "per_host": 2}),
        ("run_deliverer", {"drain": True, "log_interval": 5, "purge": True}),
        ("delivery_status", {"hosts": 3}),
    ],
)
def test_a_number_given_to_call_command_as_an_int_is_taken(
    command: str, options: dict[str, Any]
) -> None:
    # call_command passes keyword options as they are given, unparsed: an
    # int was "object of type 'int' has no len()".
    call_command(command, stdout=io.StringIO(), stderr=io.StringIO(), **options)


@pytest.mark.django_db(transaction=True)
def test_a_drain_with_purge_purges_once_the_queue_is_drained(inbox: Inbox) -> None:
    # A cron job's drain: its purge thread's first run, a minute after the
    # start, came after the drain had ended, and nothing was ever purged.
    old = send(ALICE, NOTE, [inbox.url("/old")])
    long_ago = timezone.now() - dt.timedelta(days=400)
    Delivery.objects.filter(batch=old).update(status=Status.DELIVERED, settled_at=long_ago)
    Batch.objects.filter(id=old.id).update(created_at=long_ago)
    fresh = send(ALICE, NOTE, [inbox.url("/fresh")])
    out = io.StringIO()
    call_command("run_deliverer", "--drain", "--purge", stdout=out)
    assert "Purging what is past RETENTION once the queue is drained." in out.getvalue()
    assert "Purged: " in out.getvalue()
    assert Delivery.objects.get(batch=fresh).status == Status.DELIVERED
    assert not Batch.objects.filter(id=old.id).exists()
    # An interval, given as an int and taken, has nothing to say then.
    with pytest.raises(CommandError, match=r"^--purge-interval 60 does not go with --drain"):
        call_command("run_deliverer", drain=True, purge=True, purge_interval=60)


def test_a_number_given_to_call_command_as_anything_else_is_refused_naming_it() -> None:
    with pytest.raises(CommandError, match="not True"):
        call_command("run_deliverer", drain=True, concurrency=True)
    with pytest.raises(CommandError, match="not 127"):
        call_command("run_deliverer", drain=True, metrics_port=9100, metrics_addr=127)


def test_per_host_max_below_per_host_lowers_the_start_or_is_refused() -> None:
    # --per-host-max 1, PER_HOST 2: "2 per host at first, up to 2".
    out = io.StringIO()
    call_command("run_deliverer", "--drain", "--per-host-max=1", stdout=out)
    assert "1 per host at first, up to 1." in out.getvalue()
    with pytest.raises(CommandError, match=r"^--per-host 5 is more than --per-host-max 3$"):
        call_command("run_deliverer", "--drain", "--per-host=5", "--per-host-max=3")


def test_a_long_bad_number_is_named_cut() -> None:
    with pytest.raises(CommandError) as refused:
        call_command("run_deliverer", "--drain", "--concurrency=" + "9" * 5000)
    assert str(refused.value).endswith("not '" + "9" * 80 + "…'")


@pytest.mark.slow
@pytest.mark.any_database
def test_sigterm_stops_claiming_finishes_what_is_in_flight_and_exits_0(
    inboxes: Callable[..., Inbox], processes: Callable[..., subprocess.Popen[str]]
) -> None:
    slow = inboxes(delay=1.5)
    send(ALICE, NOTE, [slow.url("/first")])
    process = processes("--concurrency=1")
    wait_for_line(process, "Delivering until stopped")
    wait_until(lambda: len(slow.received) == 1, timeout=STARTED)
    # Claimed, but waiting for the one busy slot when the stop comes: put back.
    send(ALICE, NOTE, [slow.url("/second")])
    wait_until(lambda: Delivery.objects.filter(lease_token__isnull=False).count() == 2)
    process.send_signal(signal.SIGTERM)
    assert process.wait(20) == 0
    assert slow.paths() == ["/first"]
    delivered = Delivery.objects.get(inbox=slow.url("/first"))
    assert delivered.status == Status.DELIVERED
    waiting = Delivery.objects.get(inbox=slow.url("/second"))
    assert (waiting.status, waiting.attempts, waiting.lease_token) == (Status.PENDING, 0, None)


@pytest.mark.slow
@pytest.mark.any_database
def test_a_second_signal_exits_at_once(
    inboxes: Callable[..., Inbox], processes: Callable[..., subprocess.Popen[str]]
) -> None:
    stuck = inboxes(delay=STUCK)
    send(ALICE, NOTE, [stuck.url()])
    process = processes(settings=STUCK_SETTINGS)
    wait_until(lambda: len(stuck.received) == 1, timeout=STARTED)
    process.send_signal(signal.SIGINT)
    wait_for_line(process, "Stopping: finishing what is in flight")
    started = time.monotonic()
    process.send_signal(signal.SIGINT)
    assert process.wait(AT_ONCE) != 0
    assert time.monotonic() - started < AT_ONCE
    assert Delivery.objects.get().status == Status.PENDING, "sent again once its lease lapses"


@pytest.mark.slow
@pytest.mark.parametrize("backlog", [0, 150], ids=["idle", "after a backlog"])
def test_a_send_from_another_process_wakes_an_idle_deliverer(
    inbox: Inbox, processes: Callable[..., subprocess.Popen[str]], backlog: int
) -> None:
    postgresql = connections["default"].vendor == "postgresql"
    send(ALICE, NOTE, [inbox.url(f"/u{n}") for n in range(backlog)])
    # Claims of two, to one host of PER_HOST 2: each comes back full (so that
    # on PostgreSQL it stops listening) or empty (and it listens again).
    settings = {"IDLE_POLL_SECONDS": 120, "CLAIM_SIZE": 2}
    process = processes(settings=settings, log_level="DEBUG")
    if postgresql:
        # Getting to LISTEN wakes the loop once: idle only after that.
        wait_for_line(process, "Listening for new deliveries")
        if backlog:
            wait_until(lambda: listeners_last("UNLISTEN"), timeout=STARTED)
    wait_until(lambda: len(inbox.received) == backlog, timeout=STARTED)
    wait_for_line(process, "Nothing to do: idle")  # for two minutes unless woken
    send(ALICE, NOTE, [inbox.url()])
    queued = time.monotonic()
    wait_until(lambda: len(inbox.received) == backlog + 1, timeout=STARTED)
    took = time.monotonic() - queued
    process.send_signal(signal.SIGTERM)
    assert process.wait(20) == 0
    # The idle poll is two minutes away.
    assert took < 30, f"woken after {took:.1f} s, not by the idle poll"


def listeners_last(statement: str) -> bool:
    """Whether a connection's last statement was ``statement`` of the channel."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE query = %s",
            [f"{statement} {NOTIFY_CHANNEL}"],
        )
        return bool(cursor.fetchone()[0])


@pytest.mark.slow
def test_a_deliverer_killed_mid_drain_loses_nothing_and_repeats_only_what_was_in_flight(
    inboxes: Callable[..., Inbox], processes: Callable[..., subprocess.Popen[str]]
) -> None:
    sinks = [inboxes(f"127.0.0.{n}") for n in range(2, 6)]
    # 500 in all, killed at 150: a few hundred are enough to be cut mid-way,
    # and the second drain's wait stays well inside its bound with every run
    # of the suite at once (1,000 took 119 s of the 150).
    urls = [sink.url(f"/u{n}") for n in range(125) for sink in sinks]
    send(ALICE, NOTE, urls)
    concurrency = 8
    # A short lease that still holds an attempt, the margin to write what came of
    # it (LEASE_MARGIN_SECONDS) and a few seconds of waiting for a worker.
    settings = {"LEASE_SECONDS": 15, "ATTEMPT_TIMEOUT": 1}
    first = processes("--drain", f"--concurrency={concurrency}", "--per-host=4", settings=settings)
    wait_until(lambda: sum(len(sink.received) for sink in sinks) >= 150, timeout=150)
    first.kill()
    first.wait(10)
    at_kill = sum(len(sink.received) for sink in sinks)
    assert at_kill < len(urls), "killed in the middle, not at the end"
    # The dead process's leases lapse (a claim leases a delivery by pushing
    # its due time forward).
    leased = Delivery.objects.filter(status=Status.PENDING, lease_token__isnull=False)
    wait_until(lambda: not leased.filter(due_at__gt=timezone.now()).exists(), timeout=60)
    # Not --drain, which ends once nothing is due: on a busy machine an attempt
    # of the first process may have timed out (1 s) or waited past its lease,
    # and its retry comes due half a minute later.
    second = processes(f"--concurrency={concurrency}", settings=settings)
    everything = {Status.DELIVERED: len(urls)}
    wait_until(lambda: statuses() == everything, timeout=150, state=statuses)
    second.send_signal(signal.SIGTERM)
    assert second.wait(60) == 0
    assert statuses() == everything
    # In flight at the kill: handed to the workers (at most two per slot: one
    # being sent or sent, one queued for the next free worker), or sent with
    # their outcome collected but not yet written (at most one write's worth,
    # four per slot). Nothing else is sent twice.
    assert_each_reached_once_but(sinks, urls, twice=(2 + 4) * concurrency)


@pytest.mark.slow
def test_a_web_process_and_the_deliverer_write_at_once_without_database_is_locked(
    inboxes: Callable[..., Inbox], processes: Callable[..., subprocess.Popen[str]]
) -> None:
    sink = inboxes()
    # Sixteen at once to the one inbox, not PER_HOST's two: as many writes
    # as it can make meet the web process's (and with two, 800 took 46 s on
    # PostgreSQL with every run of the suite at once).
    process = processes(
        "--concurrency=16", "--per-host=16", settings={"NEW_WORK_POLL_SECONDS": 0.05}
    )
    wait_for_line(process, "Delivering until stopped")
    errors: list[BaseException] = []

    def web(worker: int) -> None:
        try:
            for request in range(40):
                with transaction.atomic():
                    send(ALICE, NOTE, [sink.url(f"/w{worker}/{request}/{n}") for n in range(5)])
        except BaseException as exc:
            errors.append(exc)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=web, args=(worker,)) for worker in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert errors == []
    wait_until(lambda: statuses() == {Status.DELIVERED: 800}, timeout=120, state=statuses)
    process.send_signal(signal.SIGTERM)
    assert process.wait(20) == 0
    output = process.stdout.read() if process.stdout else ""
    assert "locked" not in output
    assert "unavailable" not in output


def test_a_running_deliverer_logs_its_rates_and_counts(caplog: pytest.LogCaptureFixture) -> None:
    from django_federation_delivery.management.running import log_rates
    from django_federation_delivery.settling import Summary

    log = log_rates(60)
    summary = Summary(delivered=120, retrying=3)
    with caplog.at_level(logging.INFO, logger="django_federation_delivery.deliverer"):
        log(summary)
    (record,) = caplog.records
    assert "delivered 120, retrying 3" in record.getMessage()
    assert "delivered/s" in record.getMessage()
    # Skipped, held or superseded, none was attempted: the line said each was.
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="django_federation_delivery.deliverer"):
        log(Summary(delivered=120, retrying=3, skipped=500, held=500, superseded=10))
    assert " 0.0 delivered/s and 0.0 attempts/s" in caplog.records[0].getMessage()


@pytest.mark.slow
@pytest.mark.any_database
def test_metrics_are_served_on_the_port_named(
    inbox: Inbox, processes: Callable[..., subprocess.Popen[str]]
) -> None:
    import urllib.request

    port = free_ports(1)
    process = processes(f"--metrics-port={port}")
    assert f"Metrics at http://127.0.0.1:{port}/metrics" in wait_for_line(process, "Metrics at")
    wait_for_line(process, "Delivering until stopped")
    send(ALICE, NOTE, [inbox.url()])
    wait_until(lambda: statuses() == {Status.DELIVERED: 1}, timeout=STARTED)

    def scrape() -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as answer:
            return str(answer.read().decode())

    wait_until(lambda: "federation_delivery_lag_seconds" in scrape())
    text = scrape()
    # Served on 127.0.0.1 only, unless --metrics-addr says otherwise.
    elsewhere = ("127.0.0.2", port)
    with pytest.raises(ConnectionRefusedError), socket.create_connection(elsewhere, timeout=5):
        pass
    process.send_signal(signal.SIGTERM)
    assert process.wait(20) == 0
    assert 'federation_delivery_attempts_total{outcome="delivered"} 1.0' in text
    assert "federation_delivery_attempt_duration_seconds_count 1.0" in text
    assert "federation_delivery_open_breakers 0.0" in text


def test_a_bad_metrics_port_is_refused_naming_it() -> None:
    with pytest.raises(CommandError, match="70000"):
        call_command("run_deliverer", "--drain", "--metrics-port=70000")


@pytest.mark.parametrize("port", [["--metrics-port=9108"], []], ids=["with a port", "alone"])
def test_a_bad_metrics_address_is_refused_naming_it(port: list[str]) -> None:
    with pytest.raises(CommandError, match="'everywhere'"):
        call_command("run_deliverer", "--drain", *port, "--metrics-addr=everywhere")
    # As any value is named: escaped, cut, a URL pasted by its host alone.
    with pytest.raises(CommandError) as refused:
        call_command("run_deliverer", "--drain", *port, "--metrics-addr=http://u:pw@h.example/x")
    assert "pw" not in str(refused.value) and "h.example" in str(refused.value)


@pytest.mark.parametrize(
    ("setting", "named"),
    [
        ({"BREAKER": {"SCOPE": "domain"}}, "federation_delivery.E012: .*'domain'"),
        ({"RETRY_AFTER_MAX": float("inf")}, "federation_delivery.E006: .*inf"),
        ({"FIRST_SCHEME": "cavage"}, "federation_delivery.E009: .*'cavage'"),
    ],
)
def test_a_misconfigured_deliverer_does_not_start_and_says_why(
    settings: Any, setting: dict[str, Any], named: str
) -> None:
    settings.FEDERATION_DELIVERY = {**settings.FEDERATION_DELIVERY, **setting}
    with pytest.raises(CommandError, match=named):
        call_command("run_deliverer", "--drain")


def test_a_deliverer_does_not_start_on_a_database_that_lacks_a_migration(inbox: Inbox) -> None:
    from django.db import connection
    from django.db.migrations.recorder import MigrationRecorder

    send(ALICE, NOTE, [inbox.url()])
    # As after an upgrade whose migration was not run: the tables are there,
    # the migration is not recorded.
    recorder = MigrationRecorder(connection)
    recorder.record_unapplied("federation_delivery", "0001_initial")
    message = (
        r"The database 'default' lacks a migration of the package's "
        r"\(federation_delivery\.0001_initial\): run manage\.py migrate first\."
    )
    try:
        with pytest.raises(CommandError, match=message):
            call_command("run_deliverer", "--drain", stdout=io.StringIO())
    finally:
        recorder.record_applied("federation_delivery", "0001_initial")
    assert statuses() == {Status.PENDING: 1}, "nothing claimed"
    assert not inbox.received


@pytest.mark.django_db(transaction=True, databases=["default", "queue"])
@pytest.mark.usefixtures("default_refuses_the_app")
def test_under_a_router_the_deliverer_drains_the_database_the_app_is_routed_to(
    inbox: Inbox,
) -> None:
    # "default" refuses the app's tables (conftest), as where migrate made
    # them in "queue" alone: the command's database is the router's.
    from django.db.migrations.recorder import MigrationRecorder

    send(ALICE, NOTE, [inbox.url(f"/{n}") for n in range(3)])
    recorder = MigrationRecorder(connections["queue"])
    recorder.record_unapplied("federation_delivery", "0001_initial")
    try:
        # It told to run "manage.py migrate", which migrates "default" alone.
        with pytest.raises(
            CommandError,
            match=r"The database 'queue' lacks a migration .*: run manage.py migrate "
            r"--database queue first",
        ):
            call_command("run_deliverer", "--drain", stdout=io.StringIO())
    finally:
        recorder.record_applied("federation_delivery", "0001_initial")
    out = io.StringIO()
    call_command("run_deliverer", "--drain", stdout=out)
    assert "Done: delivered 3, retrying 0, refused 0, failed 0" in out.getvalue()
    assert len(inbox.received) == 3
    assert statuses() == {Status.DELIVERED: 3}
    # A deliverer made by code, given no database, takes the same.
    send(ALICE, NOTE, [inbox.url("/3")])
    assert Deliverer().run(drain=True).delivered == 1
    assert statuses() == {Status.DELIVERED: 4}


def test_a_database_away_at_the_start_is_left_to_the_loop_to_wait_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from django.db import OperationalError
    from django.db.migrations.executor import MigrationExecutor

    from django_federation_delivery.checks import unapplied_migrations

    def away(*args: Any, **kwargs: Any) -> Any:
        raise OperationalError("connection refused")

    monkeypatch.setattr(MigrationExecutor, "migration_plan", away)
    assert unapplied_migrations("default") == []


def test_a_drain_begun_while_the_database_is_away_waits_it_out_and_sends(inbox: Inbox) -> None:
    # A cron job's drain during a failover: the drain's total, and on SQLite
    # its journal mode, were read before the loop, and failed with a traceback.
    from django.db import OperationalError

    batch = send(ALICE, NOTE, [inbox.url(f"/{n}") for n in range(3)])
    assert batch is not None
    away_until = time.monotonic() + 1.5
    refused: list[str] = []

    def away(execute: Callable[..., Any], sql: str, *args: Any) -> Any:
        if time.monotonic() < away_until:
            refused.append(sql)
            raise OperationalError("terminating connection due to administrator command")
        return execute(sql, *args)

    out = io.StringIO()
    with connection.execute_wrapper(away):
        call_command("run_deliverer", "--drain", stdout=out, stderr=out)
    assert refused, "the database was away as the drain began"
    assert sorted(inbox.paths()) == ["/0", "/1", "/2"]
    assert [row.status for row in batch.deliveries.all()] == [Status.DELIVERED] * 3
    assert "Done: delivered 3," in out.getvalue(), out.getvalue()


@pytest.mark.slow
def test_two_deliverer_processes_share_a_breaker_and_one_probe_at_a_time(
    inboxes: Callable[..., Inbox], processes: Callable[..., subprocess.Popen[str]]
) -> None:
    from django_federation_delivery.models import Breaker

    # The first four answered together: both processes were sending at once.
    # Then a probe's answer takes a tenth of its cool-off (a probe holds the
    # breaker for one cool-off): at 0.3 s of 0.5, two probes once overlapped
    # with every run of the suite at once.
    slow_503 = Overlap(503, delay=0.1, together=4)
    down = inboxes("127.0.0.2", respond=slow_503)
    shared = {
        "BREAKER": {"THRESHOLD": 6, "COOL_OFF": 1.0, "SCOPE": "host"},
        "RETRY": {"BASE": 0.2, "CAP": 0.2, "ATTEMPTS": 100, "JITTER": 0},
    }
    first = processes("--concurrency=4", "--per-host=2", settings=shared)
    second = processes("--concurrency=4", "--per-host=2", settings=shared)
    for process in (first, second):
        wait_for_line(process, "Delivering until stopped")
    send(ALICE, NOTE, [down.url(f"/{n}") for n in range(60)])
    wait_until(lambda: Breaker.objects.filter(open_until__isnull=False).exists(), timeout=STARTED)
    opened_after = len(down.received)
    time.sleep(1.0)  # what was in flight when it opened has come back by now
    slow_503.mark()
    before = len(down.received)
    time.sleep(4.0)  # four cool-offs: a probe each at most, among both processes
    probes = len(down.received) - before
    for process in (first, second):
        process.send_signal(signal.SIGTERM)
    assert first.wait(20) == 0 and second.wait(20) == 0
    assert slow_503.most >= 4, "both processes were sending at first (two per host each)"
    assert opened_after <= 6 + 2 * (2 * 2), "opened by both processes' failures, counted together"
    assert slow_503.most_since_mark == 1, "one probe at a time between the two processes"
    assert 1 <= probes <= 4 / 1.0 + 1, f"{probes} probes in four cool-offs"


# --processes N: N deliverers under one supervisor.


class Output:
    """Everything a process writes, read as it comes by a thread of its own."""

    def __init__(self, process: subprocess.Popen[str]) -> None:
        assert process.stdout is not None
        self._stdout = process.stdout
        self._lines: list[str] = []
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        # The pipe is closed under it when a failed test's fixture kills the process.
        with contextlib.suppress(ValueError):
            for line in self._stdout:
                with self._lock:
                    self._lines.append(line)

    def text(self) -> str:
        with self._lock:
            return "".join(self._lines)

    def wait_for(self, pattern: str, timeout: float = STARTED) -> re.Match[str]:
        """The first match of the regular expression ``pattern`` in what was written."""
        found: list[re.Match[str]] = []

        def seen() -> bool:
            match = re.search(pattern, self.text())
            if match:
                found.append(match)
            return match is not None

        try:
            wait_until(seen, timeout=timeout)
        except AssertionError:
            raise AssertionError(f"{pattern!r} never came; output was:\n{self.text()}") from None
        return found[0]

    def finish(self) -> str:
        """All of it, once the process has exited."""
        self._thread.join(10)
        return self.text()


class Gate:
    """A ``respond`` that holds every request until ``needed`` are being
    answered at once (or ``timeout`` passes), then lets all through."""

    def __init__(self, needed: int, timeout: float) -> None:
        self.needed = needed
        self.timeout = timeout
        self._lock = threading.Lock()
        self._now = 0
        self.opened = threading.Event()

    def __call__(self, request: Received) -> tuple[int, dict[str, str], bytes]:
        with self._lock:
            self._now += 1
            if self._now >= self.needed:
                self.opened.set()
        self.opened.wait(self.timeout)
        with self._lock:
            self._now -= 1
        return 202, {}, b""


def gone(pid: int) -> bool:
    """Whether process ``pid`` has exited (a zombie left to an init that does
    not reap counts: it runs nothing)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        return False


CHILD = r"\[deliverer (\d+)/2 pid (\d+)\]"


@pytest.mark.slow
def test_two_processes_drain_a_fan_out_each_delivery_once_both_doing_part_of_it(
    inboxes: Callable[..., Inbox], processes: Callable[..., subprocess.Popen[str]]
) -> None:
    # Two in flight at most for one deliverer (--concurrency=2): three at once
    # at the inbox means both are sending. The first child's requests wait
    # there for the second child to start (50 s and more with every run of
    # the suite at once): its attempts must outlast that wait, or they time
    # out and come due again after the drain has ended.
    gate = Gate(needed=3, timeout=STARTED)
    sink = inboxes(respond=gate)
    urls = [sink.url(f"/{n}") for n in range(100)]
    send(ALICE, NOTE, urls)
    process = processes(
        "--processes=2",
        "--drain",
        "--concurrency=2",
        settings={"ATTEMPT_TIMEOUT": STARTED + 20, "LEASE_SECONDS": 300},
    )
    output = Output(process)
    assert process.wait(280) == 0, output.finish()
    text = output.finish()
    assert gate.opened.is_set(), "both deliverers were sending at once"
    assert statuses() == {Status.DELIVERED: 100}
    assert collections.Counter(sink.paths()) == {f"/{n}": 1 for n in range(100)}
    done = {
        int(index): int(delivered)
        for index, _, delivered in re.findall(CHILD + r" Done: delivered (\d+)", text)
    }
    assert set(done) == {1, 2}, text
    assert all(done.values()), f"each did part of the work: {done}"
    assert sum(done.values()) == 100
    # Each child's progress counts what it sent itself: no bar of the 100 due,
    # which the two share, would end anywhere near 100/100.
    assert not re.search(CHILD + r" +\[[#.]*\] \d+/\d+", text), text
    shown = {
        int(index): int(delivered)
        for index, _, delivered in re.findall(CHILD + r" +delivered (\d+),", text)
    }
    assert shown == done, text
    assert "Done: all 2 deliverer processes finished." in text


@pytest.mark.slow
@pytest.mark.any_database
def test_sigterm_to_the_supervisor_stops_both_children_and_exits_0_losing_nothing(
    inboxes: Callable[..., Inbox], processes: Callable[..., subprocess.Popen[str]]
) -> None:
    slow = inboxes(delay=1.5)
    send(ALICE, NOTE, [slow.url(f"/{n}") for n in range(20)])
    process = processes("--processes=2", "--concurrency=1")
    output = Output(process)
    # One at a time each: two at the inbox means both children are mid-send.
    wait_until(lambda: len(slow.received) >= 2, timeout=STARTED)
    pids = {int(output.wait_for(rf"\[deliverer {n}/2 pid (\d+)\]")[1]) for n in (1, 2)}
    process.send_signal(signal.SIGTERM)
    assert process.wait(30) == 0, output.finish()
    text = output.finish()
    assert "Done: all 2 deliverer processes stopped." in text
    assert all(gone(pid) for pid in pids), "both children stopped and were waited for"
    sent = slow.paths()
    assert len(sent) == len(set(sent)) >= 2
    # What was in flight finished; the rest waits, unclaimed, for the next deliverer.
    delivered = Delivery.objects.filter(status=Status.DELIVERED)
    assert {slow.url(path) for path in sent} == set(delivered.values_list("inbox", flat=True))
    waiting = Delivery.objects.exclude(status=Status.DELIVERED)
    assert set(waiting.values_list("status", "attempts", "lease_token")) == {
        (Status.PENDING, 0, None)
    }
    assert waiting.count() == 20 - len(sent)


@pytest.mark.slow
@pytest.mark.parametrize("count", ["1", "2"])
def test_a_drain_started_with_no_stdout_delivers_and_exits_0(
    inbox: Inbox, processes: Callable[..., subprocess.Popen[str]], count: str
) -> None:
    # "run_deliverer --drain >&-" (cron, a service started with no stdout):
    # its first line raised AttributeError, in the supervisor before any
    # child started, and nothing was delivered.
    send(ALICE, NOTE, [inbox.url(f"/{n}") for n in range(3)])
    process = processes("--drain", f"--processes={count}", closed=1)
    output = Output(process)
    assert process.wait(150) == 0, output.finish()
    assert statuses() == {Status.DELIVERED: 3}, output.finish()


@pytest.mark.slow
@pytest.mark.any_database
def test_sigterm_stops_a_supervisor_started_with_no_stderr(
    processes: Callable[..., subprocess.Popen[str]],
) -> None:
    # "run_deliverer --processes 2 2>&-": the supervisor said it was stopping
    # before it stopped, the line raised, and the stop was never made; only
    # a second signal ended them, killing what was in flight.
    process = processes("--processes=2", closed=2)
    output = Output(process)
    for n in (1, 2):
        output.wait_for(rf"\[deliverer {n}/2 pid \d+\] Delivering until stopped")
    process.send_signal(signal.SIGTERM)
    assert process.wait(60) == 0, output.finish()


@pytest.mark.slow
@pytest.mark.any_database
def test_a_child_killed_is_restarted_with_a_log_line_and_the_work_completes(
    inboxes: Callable[..., Inbox], processes: Callable[..., subprocess.Popen[str]]
) -> None:
    sinks = [inboxes(f"127.0.0.{n}", delay=0.1) for n in (2, 3)]
    urls = [sink.url(f"/k{n}") for n in range(100) for sink in sinks]
    send(ALICE, NOTE, urls)
    # What the killed child had claimed comes due again once its lease lapses.
    settings = {"LEASE_SECONDS": 11, "ATTEMPT_TIMEOUT": 1}
    process = processes("--processes=2", "--concurrency=4", settings=settings)
    output = Output(process)
    pid = int(output.wait_for(r"\[deliverer 1/2 pid (\d+)\] Delivering until stopped")[1])
    wait_until(lambda: sum(len(sink.received) for sink in sinks) >= 50, timeout=STARTED)
    os.kill(pid, signal.SIGKILL)
    at_kill = sum(len(sink.received) for sink in sinks)
    output.wait_for(rf"Deliverer 1 \(pid {pid}\) was killed by SIGKILL after [\d.]+ s; restarting")
    new = int(output.wait_for(rf"Restarted deliverer 1: pid (\d+) \(was pid {pid}\)")[1])
    assert new != pid
    output.wait_for(rf"\[deliverer 1/2 pid {new}\] Delivering until stopped")
    # Bounded as the other process tests are: 72 s of 90 were seen with
    # every run of the suite at once on two cores.
    wait_until(lambda: statuses() == {Status.DELIVERED: len(urls)}, timeout=150)
    process.send_signal(signal.SIGTERM)
    assert process.wait(30) == 0, output.finish()
    assert at_kill < len(urls), "killed in the middle, not at the end"
    received = {
        f"http://{request.host}{request.path}" for sink in sinks for request in sink.received
    }
    assert received == set(urls)


@pytest.mark.slow
@pytest.mark.any_database
def test_a_second_signal_to_the_supervisor_kills_the_children_at_once(
    inboxes: Callable[..., Inbox], processes: Callable[..., subprocess.Popen[str]]
) -> None:
    stuck = inboxes(delay=STUCK)
    send(ALICE, NOTE, [stuck.url(f"/{n}") for n in range(4)])
    process = processes("--processes=2", "--concurrency=1", settings=STUCK_SETTINGS)
    output = Output(process)
    wait_until(lambda: len(stuck.received) >= 2, timeout=STARTED)
    pids = {int(output.wait_for(rf"\[deliverer {n}/2 pid (\d+)\]")[1]) for n in (1, 2)}
    process.send_signal(signal.SIGINT)
    output.wait_for(r"Stopping: 2 deliverers finishing what is in flight")
    started = time.monotonic()
    process.send_signal(signal.SIGINT)
    assert process.wait(AT_ONCE) == 128 + signal.SIGINT
    assert time.monotonic() - started < AT_ONCE
    wait_until(lambda: all(gone(pid) for pid in pids), timeout=AT_ONCE)
    assert set(Delivery.objects.values_list("status", flat=True)) == {Status.PENDING}


@pytest.mark.slow
@pytest.mark.any_database
def test_children_stop_when_their_supervisor_is_killed(
    processes: Callable[..., subprocess.Popen[str]],
) -> None:
    process = processes("--processes=2")
    output = Output(process)
    pids = {
        int(output.wait_for(rf"\[deliverer {n}/2 pid (\d+)\] Delivering until stopped")[1])
        for n in (1, 2)
    }
    process.kill()
    process.wait(10)
    wait_until(lambda: all(gone(pid) for pid in pids), timeout=30)
    assert output.finish().count("The supervisor is gone: stopping") == 2


def free_ports(count: int) -> int:
    """The first of ``count`` consecutive ports free on 127.0.0.1, below the
    ephemeral range: the machine's own outgoing connections (to PostgreSQL,
    to the inboxes) never take them between this look and the bind."""
    import random

    for _ in range(100):
        first = random.randrange(20_000, 30_000)
        try:
            for port in range(first, first + count):
                with socket.socket() as probe:
                    probe.bind(("127.0.0.1", port))
        except OSError:
            continue
        return first
    raise AssertionError("no free ports in a row")


@pytest.mark.slow
@pytest.mark.any_database
def test_each_child_serves_its_metrics_on_the_port_after_the_last(
    processes: Callable[..., subprocess.Popen[str]],
) -> None:
    import urllib.request

    port = free_ports(2)
    process = processes("--processes=2", f"--metrics-port={port}")
    output = Output(process)
    output.wait_for(rf"metrics on ports {port} to {port + 1}")
    for index, served in ((1, port), (2, port + 1)):
        output.wait_for(rf"\[deliverer {index}/2 pid \d+\] Metrics at http://127.0.0.1:{served}/")
        with urllib.request.urlopen(f"http://127.0.0.1:{served}/metrics", timeout=5) as answer:
            assert b"federation_delivery_attempts_total" in answer.read()
    process.send_signal(signal.SIGTERM)
    assert process.wait(30) == 0, output.finish()


@pytest.mark.slow
@pytest.mark.any_database
def test_a_child_that_dies_at_once_every_time_is_given_up_with_a_clear_message(
    processes: Callable[..., subprocess.Popen[str]],
) -> None:
    port = free_ports(2)
    with socket.socket() as taken:
        # The second child's port is somebody else's: it cannot start.
        taken.bind(("127.0.0.1", port + 1))
        taken.listen()
        process = processes("--processes=2", f"--metrics-port={port}")
        output = Output(process)
        first = int(output.wait_for(r"\[deliverer 1/2 pid (\d+)\] Delivering until stopped")[1])
        assert process.wait(3 * STARTED) == 1, output.finish()
    text = output.finish()
    assert f"cannot serve metrics on 127.0.0.1 port {port + 1}" in text
    assert "Deliverer 2 (pid " in text and "exited with status 1" in text
    assert "restarting it in 0.5 s" in text and "restarting it in 4 s" in text, "backing off"
    assert re.search(
        r"CommandError: deliverer 2 \(pid \d+\) exited with status 1, 5 times in a row "
        r"within 30 s of starting: giving up",
        text,
    )
    assert gone(first), "the healthy one was stopped too"
    assert re.search(r"\[deliverer 1/2 pid \d+\] Done:", text), "and it stopped cleanly"


@pytest.mark.slow
@pytest.mark.any_database
def test_one_signal_while_the_supervisor_gives_up_stops_gracefully_and_it_still_says_why(
    inboxes: Callable[..., Inbox], processes: Callable[..., subprocess.Popen[str]]
) -> None:
    # Giving up, the supervisor stops the healthy child gracefully. A signal
    # then is the operator's first: it stops too, it does not kill (it did:
    # the child was killed mid-send, its delivery left to be sent again, and
    # the supervisor exited 143 without saying why it gave up).
    held = threading.Event()

    def hold(request: Received) -> tuple[int, dict[str, str], bytes]:
        held.wait(STUCK)
        return 202, {}, b""

    sink = inboxes(respond=hold)
    send(ALICE, NOTE, [sink.url("/held")])
    port = free_ports(2)
    try:
        with socket.socket() as taken:
            # The second child's port is somebody else's: it cannot start.
            taken.bind(("127.0.0.1", port + 1))
            taken.listen()
            process = processes(
                "--processes=2",
                f"--metrics-port={port}",
                "--concurrency=1",
                settings=STUCK_SETTINGS,
            )
            output = Output(process)
            first = int(output.wait_for(r"\[deliverer 1/2 pid (\d+)\] Delivering until stopped")[1])
            wait_until(lambda: len(sink.received) == 1, timeout=STARTED)
            output.wait_for("Stopping every deliverer", timeout=3 * STARTED)
        process.send_signal(signal.SIGTERM)
        said = "Stopping: 1 deliverer finishing what is in flight"
        wait_until(lambda: said in output.text() or process.poll() is not None, timeout=AT_ONCE)
        assert process.poll() is None and not gone(first), output.text()
    finally:
        held.set()
    assert process.wait(AT_ONCE) == 1, output.finish()
    text = output.finish()
    assert re.search(
        r"CommandError: deliverer 2 \(pid \d+\) exited with status 1, 5 times in a row", text
    ), text
    assert re.search(rf"\[deliverer 1/2 pid {first}\] Done: delivered 1,", text), text
    assert statuses() == {Status.DELIVERED: 1}
    assert sink.paths() == ["/held"], "sent once"


#: Run by a spawned deliverer's interpreter as it starts (its site import):
#: it says so in a file, then takes its time, as on a busy machine.
SLOW_START = """\
import os, sys, time
if "--multiprocessing-fork" in sys.orig_argv:
    open(os.path.join(os.environ["FD_TEST_STARTING"], str(os.getpid())), "w").close()
    time.sleep(30)
"""


def holds_sigint(pid: int) -> bool:
    """Whether process ``pid`` has a SIGINT pending: blocked, not yet taken."""
    with open(f"/proc/{pid}/status") as status:
        pending = [
            int(line.split()[1], 16) for line in status if line.startswith(("SigPnd:", "ShdPnd:"))
        ]
    return any(mask & 1 << (signal.SIGINT - 1) for mask in pending)


@pytest.mark.slow
@pytest.mark.any_database
def test_ctrl_c_while_the_children_start_stops_them_and_exits_0(
    tmp_path: Any, processes: Callable[..., subprocess.Popen[str]]
) -> None:
    # A terminal's Ctrl-C reaches the supervisor and its children at once. A
    # child still in its interpreter's start died of it, with status 1 ("Fatal
    # Python error"), and the supervisor exited 1 with "CommandError:
    # deliverer 2 (pid N) exited with status 1" (1 run in 5, Ctrl-C in the
    # first 150 ms). The children's share comes first here.
    (tmp_path / "sitecustomize.py").write_text(SLOW_START)
    starting = tmp_path / "starting"
    starting.mkdir()
    process = processes(
        "--processes=2",
        env={
            "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}",
            "FD_TEST_STARTING": str(starting),
        },
    )
    output = Output(process)
    wait_until(lambda: len(list(starting.iterdir())) == 2, timeout=STARTED)
    children = [int(path.name) for path in starting.iterdir()]
    for pid in children:
        os.kill(pid, signal.SIGINT)
    wait_until(lambda: all(gone(pid) or holds_sigint(pid) for pid in children), timeout=AT_ONCE)
    assert not any(gone(pid) for pid in children), output.text()
    process.send_signal(signal.SIGINT)
    assert process.wait(AT_ONCE) == 0, output.finish()
    text = output.finish()
    assert "Done: all 2 deliverer processes stopped." in text, text
    assert all(gone(pid) for pid in children)


#: A manage.py whose command runs when it is imported: no ``__main__`` guard.
UNGUARDED = """\
import sys

from django.core.management import execute_from_command_line

execute_from_command_line(sys.argv)
"""


@pytest.mark.slow
@pytest.mark.any_database
def test_processes_started_from_a_script_without_a_main_guard_say_so_once(
    tmp_path: Any,
) -> None:
    script = tmp_path / "manage.py"
    script.write_text(UNGUARDED)
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, str(script), "run_deliverer", "--drain", "--processes=2"],
        env=subprocess_env(FD_LOG_LEVEL="WARNING"),
        capture_output=True,
        text=True,
        timeout=3 * STARTED,
    )
    text = done.stdout + done.stderr
    assert done.returncode == 1, text
    assert text.count("CommandError: manage.py runs its command when it is imported") == 1, text
    assert 'if __name__ == "__main__":' in text
    # Without restarting the children, nor their tracebacks.
    assert "Traceback" not in text and "restarting" not in text, text
    assert time.monotonic() - started < 2 * STARTED


@pytest.mark.parametrize("value", ["0", "-2", "many", "1000"])
def test_a_bad_number_of_processes_is_refused_naming_it(value: str) -> None:
    with pytest.raises(CommandError, match=repr(value)):
        call_command("run_deliverer", "--drain", f"--processes={value}")
    assert not Delivery.objects.exists()


def test_metrics_ports_past_the_last_for_the_processes_are_refused() -> None:
    with pytest.raises(CommandError, match="'65535' with --processes 2 needs ports 65535 to 65536"):
        call_command("run_deliverer", "--drain", "--processes=2", "--metrics-port=65535")


def test_metrics_for_processes_without_prometheus_are_refused_before_any_starts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from django_federation_delivery import metrics

    monkeypatch.setattr(metrics, "_metrics", None)
    with pytest.raises(CommandError, match=r"django-federation-delivery\[prometheus\]"):
        call_command("run_deliverer", "--processes=2", "--metrics-port=9108")


def test_a_metrics_address_none_can_serve_on_is_refused_before_any_process_starts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Alone, run_deliverer refuses it, naming it. Under --processes every
    # child died of it, was started again with backoff, and after half a
    # minute the supervisor gave up naming the child, not the address.
    from django_federation_delivery.management.commands import run_deliverer

    started: list[int] = []

    def supervise(processes: int, *args: Any, **kwargs: Any) -> str:
        started.append(processes)
        return "Done."

    monkeypatch.setattr(run_deliverer, "supervise", supervise)
    with pytest.raises(CommandError, match=r"cannot serve metrics on 192\.0\.2\.1: "):
        call_command(
            "run_deliverer", "--processes=2", "--metrics-port=9108", "--metrics-addr=192.0.2.1"
        )
    assert started == []
    # One this machine has is left to the children, each on its own port.
    call_command(
        "run_deliverer", "--processes=2", "--metrics-port=9108", "--metrics-addr=127.0.0.1"
    )
    assert started == [2]


def test_purge_runs_a_purge_in_the_deliverer_and_logs_it(
    inbox: Inbox, caplog: pytest.LogCaptureFixture
) -> None:
    import datetime as dt

    from django_federation_delivery.models import Batch

    old = send(ALICE, NOTE, [inbox.url("/old")])
    Delivery.objects.filter(batch=old).update(
        status=Status.DELIVERED, settled_at=timezone.now() - dt.timedelta(days=8)
    )
    Batch.objects.filter(id=old.id).update(created_at=timezone.now() - dt.timedelta(days=8))
    fresh = send(ALICE, NOTE, [inbox.url("/fresh")])

    def stop_once_purged() -> None:
        try:
            wait_until(lambda: not Batch.objects.filter(id=old.id).exists(), timeout=30)
            wait_until(lambda: len(inbox.received) == 1, timeout=30)
        finally:
            connections.close_all()
            os.kill(os.getpid(), signal.SIGTERM)

    watcher = threading.Thread(target=stop_once_purged)
    watcher.start()
    out = io.StringIO()
    with caplog.at_level(logging.INFO, logger="django_federation_delivery"):
        call_command("run_deliverer", "--purge", "--purge-interval=1", stdout=out, stderr=out)
    watcher.join()
    assert "Purging what is past RETENTION every 1 s." in out.getvalue()
    assert not Delivery.objects.filter(batch_id=old.id).exists()
    # The fresh one was delivered meanwhile, and is kept.
    assert Delivery.objects.get(batch=fresh).status == Status.DELIVERED
    purges = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Purge: ")]
    assert any("deleted 1 delivery (delivered 1," in line for line in purges), purges
    assert not any(t.name == "federation-delivery-purge" for t in threading.enumerate())


def test_under_processes_only_the_first_child_purges(monkeypatch: pytest.MonkeyPatch) -> None:
    from django_federation_delivery.management.commands import run_deliverer

    seen: dict[int, bool] = {}

    def handle(self: Any, *args: Any, **options: Any) -> None:
        seen[self.child.index] = options["purge"]

    monkeypatch.setattr(run_deliverer.Command, "handle", handle)
    # Not this test process's log records: they would keep the prefix.
    monkeypatch.setattr(run_deliverer, "prefix_log_records", lambda prefix: None)
    options = {name: None for name in run_deliverer.CHILD_OPTIONS}
    for index in (1, 2, 3):
        run_deliverer.run_child(index, 3, {**options, "purge": True, "no_color": False})
    assert seen == {1: True, 2: False, 3: False}


@pytest.mark.parametrize("value", ["0", "soon", "604801"])
def test_a_bad_purge_interval_is_refused_naming_it(value: str) -> None:
    with pytest.raises(CommandError, match=repr(value)):
        call_command("run_deliverer", "--drain", "--purge", f"--purge-interval={value}")


def test_a_purge_interval_without_purge_is_refused_rather_than_dropped() -> None:
    """``--purge-interval 600`` alone was checked as a number, then dropped:
    the deliverer ran and never purged, and said nothing of it."""
    with pytest.raises(CommandError, match="--purge-interval '600' needs --purge"):
        call_command("run_deliverer", "--drain", "--purge-interval=600")


# Heartbeats: who is alive, as the queues page and delivery_status --check see it.


@pytest.mark.slow
@pytest.mark.any_database
def test_a_deliverer_process_beats_while_it_runs_and_marks_its_row_when_stopped(
    processes: Callable[..., subprocess.Popen[str]],
) -> None:
    from django_federation_delivery import heartbeats
    from django_federation_delivery.models import DelivererHeartbeat

    process = processes(settings={"HEARTBEAT_SECONDS": 1})
    wait_until(lambda: DelivererHeartbeat.objects.filter(pid=process.pid).exists(), timeout=90)
    row = DelivererHeartbeat.objects.get()
    assert (row.host, row.interval) == (socket.gethostname(), 1.0)
    # Idle, it beats all the same: last_seen moves on, one UPDATE of one row.
    wait_until(lambda: DelivererHeartbeat.objects.get().last_seen > row.last_seen, timeout=10)
    assert DelivererHeartbeat.objects.count() == 1
    process.send_signal(signal.SIGTERM)
    assert process.wait(20) == 0
    stopped = DelivererHeartbeat.objects.get()
    assert (stopped.pid, stopped.interval) == (process.pid, heartbeats.STOPPED)
    assert heartbeats.seen() == heartbeats.Seen(live=(), last_seen=stopped.last_seen)


@pytest.mark.slow
@pytest.mark.any_database
def test_two_deliverer_processes_show_as_two_live_deliverers(
    processes: Callable[..., subprocess.Popen[str]],
) -> None:
    from django_federation_delivery import heartbeats
    from django_federation_delivery.models import DelivererHeartbeat

    process = processes("--processes=2", settings={"HEARTBEAT_SECONDS": 1})
    output = Output(process)
    pids = {
        int(output.wait_for(rf"\[deliverer {n}/2 pid (\d+)\] Delivering until stopped")[1])
        for n in (1, 2)
    }
    wait_until(lambda: DelivererHeartbeat.objects.count() == 2, timeout=STARTED)
    assert {deliverer.pid for deliverer in heartbeats.seen().live} == pids
    assert process.pid not in pids, "the supervisor delivers nothing, and beats for nothing"
    process.send_signal(signal.SIGTERM)
    assert process.wait(30) == 0, output.finish()
    # What each process said, and every row, should a row be missing: once in
    # CI, on a machine 100% busy, one stopped child's row was gone.
    text = output.finish()
    rows = list(DelivererHeartbeat.objects.values_list("pid", "interval", "last_seen"))
    assert heartbeats.seen().live == (), (rows, text)
    # One row each, marked stopped: none written twice, none deleted by the other.
    assert sorted(pid for pid, _, _ in rows) == sorted(pids), (rows, text)
    assert {interval for _, interval, _ in rows} == {heartbeats.STOPPED}, (rows, text)


@pytest.mark.slow
def test_an_idle_deliverer_logs_its_rate_line_every_log_interval(
    start_deliverer: Callable[..., RunningDeliverer],
) -> None:
    # Idle, it slept until the idle poll (up to 30 s) and told no progress
    # meanwhile: a line every 60 to 90 s for --log-interval 60.
    from django_federation_delivery.management.running import log_rates

    lines: list[float] = []
    rates = log_rates(0.5)

    def progress(summary: Any) -> None:
        lines.append(time.monotonic())
        rates(summary)

    runner = start_deliverer(on_progress=progress, progress_interval=0.5, heartbeat=True)
    time.sleep(3.0)
    runner.stop()
    assert len(lines) >= 5, f"{len(lines)} rate lines in 3 s, one due every 0.5 s"


# An output whose reader went away (a pipe to head or tee that ended).

CREATE = {"@context": "https://www.w3.org/ns/activitystreams", "type": "Create", "actor": ALICE}


def quick_retries(settings: Any) -> None:
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "RETRY": {"BASE": 0.1, "CAP": 0.2, "ATTEMPTS": 3, "JITTER": 0},
        "NEW_WORK_POLL_SECONDS": 0.05,
    }


class BrokenPipeStream:
    """A command's stdout or stderr whose reader went away (a pipe to
    ``head`` or ``tee`` that ended, a log collector that died): writes are
    taken until ``broken`` is set, or ``lines`` have been written; each
    later one raises ``BrokenPipeError``, as Python's own stream does."""

    def __init__(self, lines: int | None = None) -> None:
        self.lines = lines
        self.broken = threading.Event()
        self.written: list[str] = []

    def _check(self) -> None:
        if self.broken.is_set() or (self.lines is not None and len(self.written) >= self.lines):
            raise BrokenPipeError(32, "Broken pipe")

    def write(self, text: str) -> int:
        self._check()
        self.written.append(text)
        return len(text)

    def flush(self) -> None:
        if self.broken.is_set():
            raise BrokenPipeError(32, "Broken pipe")

    def isatty(self) -> bool:
        return False


@pytest.mark.slow
def test_a_drain_whose_stdout_breaks_delivers_everything_once(
    inboxes: Callable[..., Inbox], settings: Any
) -> None:
    """``run_deliverer --drain | head -1`` (or a log collector that dies):
    the first progress line met a broken pipe, which tore the loop down,
    and the deliveries it had sent and been answered for were left pending
    under their lease, their outcomes never written: each was sent to its
    inbox a second time once the lease lapsed. The drain goes on unheard."""
    quick_retries(settings)
    sink = inboxes(delay=0.4)
    batch = send(ALICE, CREATE, [sink.url(f"/{i}") for i in range(16)])
    out = BrokenPipeStream(lines=1)  # the "Delivering until nothing is due" line only
    call_command(
        "run_deliverer",
        "--drain",
        "--concurrency",
        "2",
        "--per-host",
        "2",
        "--per-host-max",
        "2",
        stdout=out,
        stderr=BrokenPipeStream(),
    )
    statuses = collections.Counter(
        Delivery.objects.filter(batch=batch).values_list("status", flat=True)
    )
    assert statuses == {Status.DELIVERED: 16}, statuses
    assert sorted(int(request.path.strip("/")) for request in sink.received) == list(range(16))


@pytest.mark.slow
def test_a_sigterm_stops_run_deliverer_even_when_its_stderr_is_gone(
    inboxes: Callable[..., Inbox], settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``run_deliverer 2>&1 | tee deliverer.log``: Ctrl-C (or a SIGTERM to
    the pipeline) ends ``tee`` too, and the deliverer's "Stopping: finishing
    what is in flight" line meets a broken pipe. The stop is then never
    made: the deliverer goes on claiming and sending, and only a second
    signal ends it, at once (``os._exit``), with what is in flight unwritten."""
    from django_federation_delivery.management.commands import run_deliverer

    quick_retries(settings)
    sink = inboxes()
    made: list[Deliverer] = []
    install = run_deliverer.install_stop_signals

    def recording(deliverer: Deliverer, *args: Any) -> Any:
        made.append(deliverer)
        return install(deliverer, *args)

    monkeypatch.setattr(run_deliverer, "install_stop_signals", recording)
    err = BrokenPipeStream()
    signalled: list[float] = []

    def operator() -> None:
        wait_until(lambda: bool(made) and len(sink.received) >= 1)
        err.broken.set()  # tee is gone
        signalled.append(time.monotonic())
        os.kill(os.getpid(), signal.SIGTERM)
        # The test's own bound: stopped from here if the signal did not.
        time.sleep(5)
        made[0].stop()

    send(ALICE, CREATE, [sink.url("/1")])
    thread = threading.Thread(target=operator, daemon=True)
    thread.start()
    call_command("run_deliverer", stdout=BrokenPipeStream(), stderr=err)
    returned = time.monotonic()
    thread.join(10)
    assert returned - signalled[0] < 4, (
        f"SIGTERM did not stop the deliverer: it ran on for {returned - signalled[0]:.1f} s, "
        "until the test stopped it"
    )


@pytest.mark.slow
def test_run_deliverer_drain_piped_to_head_exits_0_without_a_broken_pipe_error(
    inboxes: Callable[..., Inbox],
) -> None:
    """``run_deliverer --drain | head -1`` in a script (``set -o pipefail``,
    or cron reading the status): the drain goes on once head has gone, but
    the lines it could not write stayed in the stdout buffer, which Python
    flushed again at exit: "Exception ignored ... BrokenPipeError", status
    120, a failure for a drain that delivered everything."""
    slow = inboxes(delay=0.3)
    send(ALICE, {"type": "Create", "actor": ALICE}, [slow.url(f"/{n}") for n in range(6)])
    code, errors = piped_to_head(
        ["run_deliverer", "--drain", "--concurrency=1", "--per-host=1", "--per-host-max=1"], 150
    )
    statuses = set(Delivery.objects.values_list("status", flat=True))
    assert statuses == {Status.DELIVERED}, statuses
    assert (code, "BrokenPipeError" in errors) == (0, False), (code, errors[-600:])
