"""contrib.django_q: rounds of the deliverer and the purge as django-q2 tasks,
in-process and in a real ``qcluster`` (its ORM broker, the test database);
and ``manage.py delivery_schedule``, which writes their schedules."""

from __future__ import annotations

import collections
import contextlib
import datetime as dt
import importlib
import io
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import django
import pytest
from django.core.exceptions import ImproperlyConfigured
from django.core.management import CommandError, call_command
from django.db import connection, connections, transaction
from django.db.migrations.recorder import MigrationRecorder
from django.db.transaction import TransactionManagementError
from django.utils import timezone
from django_q.models import Schedule, Task
from django_q.tasks import async_task

from django_federation_delivery import contrib, heartbeats, send, send_webhook
from django_federation_delivery.addresses import quoted
from django_federation_delivery.contrib import django_q, rounds
from django_federation_delivery.contrib.django_q import (
    ANOTHER_ROUND,
    PURGE_SCHEDULE,
    PURGE_TASK,
    ROUND_SCHEDULE,
    ROUND_TASK,
    cluster_limit,
    deliver_round,
    ensure_schedules,
    purge_task,
    round_lock,
    round_seconds,
)
from django_federation_delivery.models import DelivererHeartbeat, Delivery, Host, Status

from .channels import queued_then_kind_removed
from .conftest import (
    MANAGE,
    ROOT,
    Inbox,
    Received,
    assert_each_reached_once_but,
    at_once,
    subprocess_env,
    wait_until,
)
from .keys import ALICE
from .operators import unavailable_and_due_a_probe
from .test_webhooks_deliveries import configure, signed

pytestmark = pytest.mark.django_db(transaction=True)

NOTE = {"type": "Create", "actor": ALICE}


def cluster(settings: Any, **conf: Any) -> None:
    settings.Q_CLUSTER = {"orm": "default", **conf}


def statuses() -> collections.Counter[str]:
    return collections.Counter(Delivery.objects.values_list("status", flat=True))


# The sweeps every STRANDED_EVERY (30 s) count from each Deliverer's start:
# a round is a new Deliverer, and one shorter than 30 s (25 s under
# django-q2's default retry of 60, the 5 s rounds of scripts/demo) never
# runs them, however many rounds come.


def test_rounds_release_a_delivery_left_waiting_on_a_settled_one(
    inboxes: Callable[..., Inbox], settings: Any
) -> None:
    cluster(settings, timeout=90, retry=120)
    first_inbox, waiting_inbox = inboxes(), inboxes()
    first = send(ALICE, NOTE, [first_inbox.url()])
    waiting = send(ALICE, {"type": "Note", "actor": ALICE}, [waiting_inbox.url()])
    assert first is not None and waiting is not None
    # What a retraction leaves when the one it waits on settled at that
    # very moment (the state test_retractions' sweep test makes).
    settled = Delivery.objects.get(batch=first)
    Delivery.objects.filter(pk=settled.pk).update(
        status=Status.DELIVERED, settled_at=timezone.now(), due_at=None
    )
    Delivery.objects.filter(batch=waiting).update(after=settled, due_at=None)
    for _ in range(3):
        deliver_round(2)
    row = Delivery.objects.get(batch=waiting)
    assert (row.status, len(waiting_inbox.received)) == (Status.DELIVERED, 1), (
        f"after 3 rounds still {row.status}, after_id={row.after_id}, due_at={row.due_at}: "
        "no round ever runs the sweep of stranded deliveries"
    )


def test_rounds_release_a_webhook_event_left_due_at_no_time(
    inboxes: Callable[..., Inbox], settings: Any
) -> None:
    cluster(settings, timeout=90, retry=120)
    receiver = inboxes()
    configure(settings, {"ops": signed(receiver)})
    for n in range(2):
        send_webhook("ops", "alert.raised", {"n": n})
    # The first event's hold written after an enable that came while its
    # attempt was in hand (test_webhooks_life's race): due at no time, no
    # lease, waiting on nothing. Only release_stuck makes it due again.
    head = Delivery.objects.order_by("id").first()
    assert head is not None
    Delivery.objects.filter(pk=head.pk).update(due_at=None, after=None, lease_token=None)
    for _ in range(3):
        deliver_round(2)
    assert statuses() == {Status.DELIVERED: 2}, (
        f"after 3 rounds: {dict(statuses())}, {len(receiver.received)} received: "
        "no round ever runs release_stuck"
    )


def test_a_host_resting_as_it_asked_is_left_alone_by_the_next_round(
    inboxes: Callable[..., Inbox], settings: Any
) -> None:
    # Its rest was the round's memory alone: the next round, a moment later,
    # sent its other deliveries at once, seconds after it asked for 30.
    cluster(settings, timeout=90, retry=120)
    settings.FEDERATION_DELIVERY = {**settings.FEDERATION_DELIVERY, "PER_HOST": 1}
    answered = 0

    def respond(request: Received) -> tuple[int, dict[str, str], bytes]:
        nonlocal answered
        answered += 1
        return (429, {"Retry-After": "30"}, b"") if answered == 1 else (202, {}, b"")

    busy = inboxes(respond=respond)
    send(ALICE, NOTE, [busy.url(f"/u{n}") for n in range(3)])
    deliver_round(1)
    deliver_round(1)
    assert answered == 1


def test_between_rounds_the_heartbeat_shows_nothing_in_flight(
    inboxes: Callable[..., Inbox], settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    cluster(settings, timeout=90, retry=120)
    settings.FEDERATION_DELIVERY = {**settings.FEDERATION_DELIVERY, "HEARTBEAT_SECONDS": 1.0}
    monkeypatch.setattr(django_q, "_heartbeats", {})
    slow = inboxes(delay=2.5)
    send(ALICE, NOTE, [slow.url()])
    result = deliver_round(1)
    assert result["delivered"] == 1
    # The round is over: nothing of this process is in flight any more, but
    # delivery_status and the admin show its row alive for three minutes.
    (live,) = heartbeats.seen().live
    assert live.in_flight == 0, (
        f"the round ended, and its heartbeat still says {live.in_flight} in flight"
    )


# The cluster's limits, and the bound of a round.


def test_the_limit_is_the_shorter_of_timeout_and_retry(settings: Any) -> None:
    cluster(settings, timeout=90, retry=120)
    assert cluster_limit() == 90
    cluster(settings, timeout=300, retry=120)
    assert cluster_limit() == 120


def test_a_cluster_of_alt_clusters_is_limited_by_its_own_timeout_and_retry(
    settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A cluster started with Q_CLUSTER_NAME=deliveries takes its timeout and
    # retry from ALT_CLUSTERS: a round sized for the main one's 90 s was
    # killed at 12 s, every minute.
    alternatives = {"deliveries": {"name": "other", "timeout": 12, "retry": 20}}
    cluster(settings, name="main", timeout=90, retry=120, ALT_CLUSTERS=alternatives)
    assert cluster_limit() == 90
    monkeypatch.setenv("Q_CLUSTER_NAME", "deliveries")
    assert cluster_limit() == 12
    for name in ("main", "elsewhere"):  # the main one; one with no settings of its own
        monkeypatch.setenv("Q_CLUSTER_NAME", name)
        assert cluster_limit() == 90


def test_without_a_timeout_the_limit_is_retry_or_its_default_of_60_s(settings: Any) -> None:
    cluster(settings, retry=200)
    assert cluster_limit() == 200
    cluster(settings, timeout=-1)
    assert cluster_limit() == 60
    # No limit with no retry either: a broker that never hands a task on
    # (Redis's, which reads none). A retry of 0 is no such thing (below).
    cluster(settings, timeout=None, retry=None)
    assert cluster_limit() is None


@pytest.mark.parametrize("timeout", [90, None])
def test_a_retry_of_0_is_refused_as_django_q2_hands_the_round_on_at_once(
    settings: Any, monkeypatch: pytest.MonkeyPatch, timeout: int | None
) -> None:
    from django_q.brokers.orm import ORM
    from django_q.conf import Conf

    # What django-q2's ORM broker does with it (brokers/orm.py): a task a
    # worker took is leased until now + retry, then taken again: at once.
    monkeypatch.setattr(Conf, "RETRY", 0)
    broker = ORM(list_key="retry-0")
    broker.enqueue("a round")
    taken = broker.dequeue()
    time.sleep(0.01)
    assert broker.dequeue() == taken, "handed on again at once"
    cluster(settings, timeout=timeout, retry=0)
    with pytest.raises(ImproperlyConfigured, match=r"Q_CLUSTER\['retry'\] is 0.*Set retry above"):
        round_seconds()


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("timeout", "90"),
        ("retry", -5),
        ("timeout", True),
        pytest.param("timeout", 10**400, id="timeout-past-a-float"),
    ],
)
def test_a_limit_that_is_not_a_positive_number_is_refused_naming_it(
    settings: Any, name: str, value: Any
) -> None:
    cluster(settings, **{name: value})
    said = rf"Q_CLUSTER\['{name}'\].*not {re.escape(quoted(value))}"
    with pytest.raises(ImproperlyConfigured, match=said):
        cluster_limit()


def test_the_default_round_is_50_s_when_the_cluster_leaves_room(settings: Any) -> None:
    cluster(settings, timeout=90, retry=120)
    assert round_seconds() == 50


def test_the_default_round_is_shortened_to_leave_time_to_finish_what_is_in_flight(
    settings: Any,
) -> None:
    # The defaults: 60 s of retry; 30 s of ATTEMPT_TIMEOUT and 5 s to write.
    cluster(settings)
    assert round_seconds() == 60 - 30 - 5


def test_a_round_that_would_not_fit_in_the_cluster_is_refused_saying_what_would(
    settings: Any,
) -> None:
    cluster(settings, timeout=60, retry=90)
    with pytest.raises(ImproperlyConfigured) as raised:
        round_seconds(50)
    message = str(raised.value)
    assert "A round of 50 s, and 35 s to finish" in message
    assert "at most 25 s" in message
    assert "timeout at least 85" in message
    assert round_seconds(25) == 25


def test_a_cluster_that_leaves_no_room_for_a_round_is_refused(settings: Any) -> None:
    cluster(settings, timeout=30, retry=40)
    with pytest.raises(ImproperlyConfigured, match="timeout to at least 85"):
        round_seconds()


@pytest.mark.parametrize(
    "value",
    [
        0,
        -1,
        float("nan"),
        float("inf"),
        "10",
        86401,
        1e10,
        # JSON holds it: it overflowed a float, naming nothing.
        pytest.param(10**400, id="past-a-float"),
    ],
)
def test_a_round_of_no_positive_number_of_seconds_up_to_a_day_is_refused_naming_it(
    value: Any,
) -> None:
    with pytest.raises(ValueError, match=re.escape(f"at most 86400, not {quoted(value)}")):
        round_seconds(value)


# The lock.


def test_one_round_holds_the_lock_at_a_time_and_the_next_takes_it_after() -> None:
    with round_lock() as first:
        assert first
        with round_lock() as second:
            assert not second, "held by the first"
    with round_lock() as third:
        assert third, "released by the first"


def test_the_lock_is_held_across_threads_each_with_its_own_connections() -> None:
    outcome: list[bool] = []

    def other() -> None:
        with round_lock() as held:
            outcome.append(held)
        connection.close()

    with round_lock() as held:
        assert held
        thread = threading.Thread(target=other)
        thread.start()
        thread.join(10)
    assert outcome == [False]


@pytest.mark.slow
def test_the_lock_of_a_killed_process_is_released_at_once() -> None:
    code = (
        "import time\n"
        "from django_federation_delivery.contrib.django_q import round_lock\n"
        "with round_lock() as held:\n"
        "    print('held' if held else 'not held', flush=True)\n"
        "    time.sleep(120)\n"
    )
    holder = subprocess.Popen(
        [*MANAGE, "shell", "-c", code],
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None
        # After whatever the shell says first (Django 5.2 lists its imports).
        said = next(line.strip() for line in holder.stdout if "held" in line)
        assert said == "held"
        with round_lock() as held:
            assert not held, "held by the other process"
        holder.kill()
        holder.wait(10)
        # The database notices a dead session at once, the kernel a dead file's lock.
        wait_until(lambda: _takes_the_lock(), timeout=10, step=0.1)
    finally:
        if holder.poll() is None:
            holder.kill()
        holder.wait(10)
        if holder.stdout:
            holder.stdout.close()


def _takes_the_lock() -> bool:
    with round_lock() as held:
        return held


postgresql_only = pytest.mark.skipif(
    connection.vendor != "postgresql", reason="the advisory lock is PostgreSQL's"
)


def lock_holders() -> list[int]:
    """The sessions that hold an advisory lock on this test's database: not
    another xdist worker's, whose tests take theirs at the same time."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted "
            "AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
        )
        return [pid for (pid,) in cursor.fetchall()]


def sessions_ended(*pids: int) -> None:
    """The sessions ``pids`` (or, with none, every other of the test database)
    ended, as a restart or a failover ends them."""
    with connection.cursor() as cursor:
        if pids:
            cursor.execute("SELECT pg_terminate_backend(pid) FROM unnest(%s) pid", [list(pids)])
        else:
            cursor.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE datname = current_database() AND pid <> pg_backend_pid()"
            )
    if pids:
        wait_until(lambda: not set(pids) & set(lock_holders()), timeout=10)


@postgresql_only
def test_a_lock_whose_session_ended_is_taken_again_unless_another_has_it() -> None:
    with rounds._held_lock() as kept:
        assert kept is not None and kept()
        (holder,) = lock_holders()
        sessions_ended(holder)
        with round_lock() as other:
            assert other, "gone with its session"
            assert kept() is False, "another round has it now"
        assert kept() is True, "taken again"
        assert len(lock_holders()) == 1
    assert lock_holders() == []


@contextlib.contextmanager
def round_in_a_thread(seconds: float) -> Iterator[tuple[threading.Thread, dict[str, Any]]]:
    """``deliver_round(seconds)`` in a thread: its result, or what it raised."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = deliver_round(seconds)
        except BaseException as exc:
            outcome["error"] = exc
        finally:
            connections.close_all()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield thread, outcome
    finally:
        thread.join(60)


@postgresql_only
def test_a_round_whose_lock_session_the_database_ended_still_gives_its_counts(
    inbox: Inbox, settings: Any
) -> None:
    cluster(settings, timeout=90, retry=120)
    send(ALICE, NOTE, [inbox.url()])
    with round_in_a_thread(2) as (_thread, outcome):
        wait_until(lambda: len(lock_holders()) == 1, timeout=10)
        wait_until(lambda: len(inbox.received) == 1, timeout=10)
        # A restart: the lock's session ends, and the loop's.
        sessions_ended()
    # It raised the error of its unlock, on the session gone.
    assert "error" not in outcome, f"it delivered 1, and raised {outcome['error']!r}"
    assert outcome["value"]["ran"] is True and outcome["value"]["delivered"] == 1


@postgresql_only
def test_a_round_whose_lock_session_the_database_ended_takes_it_again_before_the_next(
    inbox: Inbox, settings: Any
) -> None:
    cluster(settings, timeout=90, retry=120)
    send(ALICE, NOTE, [inbox.url()])
    with round_in_a_thread(4) as (thread, _outcome):
        wait_until(lambda: len(lock_holders()) == 1, timeout=10)
        wait_until(lambda: len(inbox.received) == 1, timeout=10)
        sessions_ended()
        time.sleep(2)  # the database back; the next minute's round comes
        with round_lock() as next_round_runs:
            overlap = next_round_runs and thread.is_alive()
    assert not overlap, "two rounds at once: the first still ran without its lock"


# A round, in-process.


def test_a_round_delivers_what_is_due_and_says_what_it_did(inbox: Inbox, settings: Any) -> None:
    cluster(settings, timeout=90, retry=120)
    send(ALICE, NOTE, [inbox.url("/a"), inbox.url("/b")])
    result = deliver_round(1)
    assert result["ran"] is True
    assert (result["delivered"], result["retrying"], result["failed"]) == (2, 0, 0)
    assert statuses() == {Status.DELIVERED: 2}
    assert 1 <= result["seconds"] < 5


def test_rounds_keep_one_heartbeat_alive_between_them_so_the_status_check_passes(
    inbox: Inbox, settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    cluster(settings, timeout=90, retry=120)
    monkeypatch.setattr(django_q, "_heartbeats", {})
    send(ALICE, NOTE, [inbox.url("/a")])
    deliver_round(1)
    (row,) = DelivererHeartbeat.objects.all()
    # Left when the round ended, with the schedule's period as its interval:
    # alive until three periods pass without another round.
    assert (row.pid, row.interval) == (os.getpid(), django_q.ROUND_PERIOD)
    assert [d.pid for d in heartbeats.seen().live] == [os.getpid()]
    first_seen = row.last_seen
    send(ALICE, NOTE, [inbox.url("/b")])
    deliver_round(1)
    (again,) = DelivererHeartbeat.objects.all()
    assert again.pk == row.pk and again.last_seen > first_seen
    call_command("delivery_status", "--check", stdout=io.StringIO())
    # Three periods without a round: taken for dead.
    later = timezone.now() + dt.timedelta(seconds=3 * django_q.ROUND_PERIOD + 1)
    assert heartbeats.seen(now=later).live == ()


def test_a_round_with_a_silent_server_returns_within_its_bound_and_one_attempt(
    inboxes: Callable[..., Inbox], settings: Any
) -> None:
    silent = inboxes(delay=20)
    settings.FEDERATION_DELIVERY = {**settings.FEDERATION_DELIVERY, "ATTEMPT_TIMEOUT": 2}
    cluster(settings, timeout=90, retry=120)
    send(ALICE, NOTE, [silent.url()])
    started = time.monotonic()
    result = deliver_round(1)
    took = time.monotonic() - started
    # The bound, one attempt's timeout, and the time to finish.
    assert took < 1 + 2 + django_q.FINISH_MARGIN, f"returned after {took:.1f} s"
    assert (result["ran"], result["retrying"], result["delivered"]) == (True, 1, 0)
    delivery = Delivery.objects.get()
    assert (delivery.status, delivery.attempts) == (Status.PENDING, 1)


def test_the_time_to_finish_counts_a_kind_whose_own_policy_gives_an_attempt_longer(
    inboxes: Callable[..., Inbox], settings: Any
) -> None:
    silent = inboxes(delay=30)
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "ATTEMPT_TIMEOUT": 1,
        "WEBHOOK_TIMEOUT": 1,
        "CHANNELS": ["tests.channels.SlowPager"],
        "WEBHOOKS": {"oncall": f"slowpager+http://routingKEY4b7c9@127.0.0.1:{silent.port}/page"},
    }
    # Its policy gives an attempt 10 s: 15 s to finish a round, not 6.
    assert django_q.finish_seconds() == 10 + django_q.FINISH_MARGIN
    cluster(settings, timeout=20, retry=30)
    assert round_seconds() == 5
    # A task may take 7 s: a round of 1 s would still be finishing at 11.
    cluster(settings, timeout=7, retry=20)
    send_webhook("oncall", "alert.raised", {"host": "db1"})
    with pytest.raises(ImproperlyConfigured, match="a round needs 15 s to finish"):
        deliver_round()
    assert silent.received == []


@pytest.mark.slow
def test_a_round_fits_the_cluster_while_unavailable_hosts_are_probed(
    inboxes: Callable[..., Inbox], settings: Any
) -> None:
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "ATTEMPT_TIMEOUT": 6,
        "WEBHOOK_TIMEOUT": 1,
    }
    # A task may take 12 s: a round of 1 s, and 11 s to finish it.
    cluster(settings, timeout=12, retry=30)
    assert round_seconds() == 1
    now = timezone.now()
    for address in ("127.0.0.2", "127.0.0.3", "127.0.0.4"):
        silent = inboxes(address, delay=30)
        unavailable_and_due_a_probe(silent.url(), silent.host, now)
    # And one delivery in flight as the round stops claiming.
    send(ALICE, NOTE, [inboxes(delay=30).url()])
    started = time.monotonic()
    deliver_round()
    took = time.monotonic() - started
    # It took 13 s: the probes went on past the in-flight attempt's end.
    assert took <= 12, f"took {took:.1f} s, Q_CLUSTER allows 12 s"
    # The one probed as the round stopped; the others left due, for the next.
    assert Host.objects.filter(probed_at__isnull=False).count() == 1


def test_a_round_while_another_runs_returns_at_once_saying_so(inbox: Inbox, settings: Any) -> None:
    cluster(settings, timeout=90, retry=120)
    send(ALICE, NOTE, [inbox.url()])
    with round_lock() as held:
        assert held
        started = time.monotonic()
        result = deliver_round(5)
        # Not the round's 5 s: at once, give or take a machine busy past its cores.
        assert time.monotonic() - started < 3
    assert result == {"ran": False, "reason": ANOTHER_ROUND}
    assert inbox.received == []
    assert statuses() == {Status.PENDING: 1}


def test_a_round_that_would_not_fit_sends_nothing(inbox: Inbox, settings: Any) -> None:
    cluster(settings, timeout=60, retry=90)
    send(ALICE, NOTE, [inbox.url()])
    with pytest.raises(ImproperlyConfigured, match="A round of 40 s"):
        deliver_round(40)
    assert inbox.received == []


def test_a_round_under_bad_settings_says_what_to_write_and_sends_nothing(
    inbox: Inbox, settings: Any
) -> None:
    send(ALICE, NOTE, [inbox.url()])
    settings.FEDERATION_DELIVERY = {**settings.FEDERATION_DELIVERY, "CONCURRENCY": 0}
    with pytest.raises(ImproperlyConfigured, match="CONCURRENCY"):
        deliver_round(1)
    assert inbox.received == []


def test_a_round_refuses_what_run_deliverer_refuses_and_spends_no_try(
    inbox: Inbox, settings: Any
) -> None:
    # A round checked the settings alone: with the kind of a destination
    # taken out of CHANNELS while its events waited, run_deliverer refused
    # to start (E031), but a round ran and spent every try, with no request.
    cluster(settings, timeout=90, retry=120)
    queued_then_kind_removed(settings, inbox.port)
    with pytest.raises(CommandError, match=r"federation_delivery\.E031: .*'oncall'") as refused:
        call_command("run_deliverer", "--drain")
    with pytest.raises(ImproperlyConfigured) as raised:
        deliver_round(2)
    assert str(raised.value) == str(refused.value), "the same checks, saying the same"
    row = Delivery.objects.get()
    assert (row.status, row.attempts, inbox.received) == (Status.PENDING, 0, [])


# The purge.


def test_the_purge_task_deletes_what_is_past_retention_and_gives_the_counts(
    inbox: Inbox, settings: Any
) -> None:
    cluster(settings, timeout=90, retry=120)
    send(ALICE, NOTE, [inbox.url("/old"), inbox.url("/new")])
    deliver_round(1)
    Delivery.objects.filter(inbox=inbox.url("/old")).update(
        settled_at=timezone.now() - dt.timedelta(days=8)
    )
    result = purge_task()
    assert result["deliveries"]["delivered"] == 1
    assert result["finished"] is True
    assert list(Delivery.objects.values_list("inbox", flat=True)) == [inbox.url("/new")]


# The schedules.


def test_the_schedules_are_created_once_and_then_left_as_they_are() -> None:
    assert ensure_schedules() == {ROUND_SCHEDULE: "created", PURGE_SCHEDULE: "created"}
    round_ = Schedule.objects.get(name=ROUND_SCHEDULE)
    assert (round_.func, round_.schedule_type, round_.minutes, round_.repeats) == (
        ROUND_TASK,
        Schedule.MINUTES,
        1,
        -1,
    )
    purge = Schedule.objects.get(name=PURGE_SCHEDULE)
    assert (purge.func, purge.schedule_type, purge.repeats) == (PURGE_TASK, Schedule.HOURLY, -1)
    assert ensure_schedules() == {ROUND_SCHEDULE: "unchanged", PURGE_SCHEDULE: "unchanged"}
    assert Schedule.objects.count() == 2


def test_a_schedule_changed_by_hand_is_brought_back_keeping_its_next_run(settings: Any) -> None:
    cluster(settings, timeout=90, retry=120)
    ensure_schedules()
    next_run = timezone.now() + dt.timedelta(seconds=42)
    Schedule.objects.filter(name=ROUND_SCHEDULE).update(minutes=10, next_run=next_run)
    Schedule.objects.create(name=ROUND_SCHEDULE, func=ROUND_TASK)  # a second one
    assert ensure_schedules(seconds=20)[ROUND_SCHEDULE] == "updated"
    schedule = Schedule.objects.get(name=ROUND_SCHEDULE)
    assert (schedule.minutes, schedule.kwargs, schedule.next_run) == (
        1,
        "{'seconds': 20.0}",
        next_run,
    )


def test_a_schedule_given_a_due_time_keyword_or_a_hook_by_hand_is_brought_back() -> None:
    # It stayed "unchanged": the scheduler called each round with a keyword
    # it does not take, and every round failed (TypeError).
    ensure_schedules()
    Schedule.objects.update(intended_date_kwarg="scheduled_for", hook="myproject.hooks.done")
    assert ensure_schedules() == {ROUND_SCHEDULE: "updated", PURGE_SCHEDULE: "updated"}
    assert set(Schedule.objects.values_list("intended_date_kwarg", "hook")) == {(None, None)}


def test_two_processes_writing_the_schedules_at_once_write_one_of_each(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Both read none before either wrote (web workers' ready(), a deploy's
    # migration beside the command), and each made its own: two rounds a
    # minute, two purges an hour. Each now waits for the other's writes.
    both_read = threading.Barrier(2, timeout=1)
    create = Schedule.objects.create

    def create_once_both_read(**fields: Any) -> Any:
        with contextlib.suppress(threading.BrokenBarrierError):
            both_read.wait()
        return create(**fields)

    monkeypatch.setattr(Schedule.objects, "create", create_once_both_read)
    said = at_once(ensure_schedules, 2)
    assert sorted(Schedule.objects.values_list("name", flat=True)) == sorted(
        [ROUND_SCHEDULE, PURGE_SCHEDULE]
    ), said
    assert sorted(said, key=str) == [  # type: ignore[type-var]
        {ROUND_SCHEDULE: "created", PURGE_SCHEDULE: "created"},
        {ROUND_SCHEDULE: "unchanged", PURGE_SCHEDULE: "unchanged"},
    ]


def test_no_purge_deletes_the_purge_schedule_it_made_and_no_other() -> None:
    # Run again, the command brings the schedules back to what it says: a
    # purge it made before would go on every hour.
    call_command("delivery_schedule", stdout=io.StringIO())
    Schedule.objects.create(name="the project's own purge", func=PURGE_TASK, schedule_type="D")
    out = io.StringIO()
    call_command("delivery_schedule", "--no-purge", stdout=out)
    lines = out.getvalue().splitlines()
    assert lines[:2] == [f"{ROUND_SCHEDULE}: unchanged", f"{PURGE_SCHEDULE}: deleted"]
    assert "A round of 25 s every minute: run qcluster" in lines[-1]
    assert set(Schedule.objects.values_list("name", flat=True)) == {
        ROUND_SCHEDULE,
        "the project's own purge",
    }
    assert ensure_schedules(purge=False) == {ROUND_SCHEDULE: "unchanged"}


def test_a_schedule_for_a_round_that_would_not_fit_is_refused_and_nothing_written(
    settings: Any,
) -> None:
    cluster(settings, timeout=60, retry=90)
    with pytest.raises(ImproperlyConfigured, match="A round of 50 s"):
        ensure_schedules(seconds=50)
    assert not Schedule.objects.exists()


def test_the_command_writes_the_schedules_and_says_what_they_do() -> None:
    out = io.StringIO()
    call_command("delivery_schedule", stdout=out)
    lines = out.getvalue().splitlines()
    assert f"{ROUND_SCHEDULE}: created" in lines
    assert f"{PURGE_SCHEDULE}: created" in lines
    # The test cluster: 60 s of timeout, 30 s of ATTEMPT_TIMEOUT and 5 s to write.
    assert "A round of 25 s every minute, a purge every hour" in lines[-1]
    call_command("delivery_schedule", "--remove", stdout=out)
    assert not Schedule.objects.exists()


@pytest.mark.parametrize("args", [[], ["--remove"]], ids=["write", "remove"])
def test_the_command_without_django_qs_tables_says_to_migrate_them(args: list[str]) -> None:
    table = Schedule._meta.db_table
    with connection.cursor() as cursor:
        cursor.execute(f"ALTER TABLE {table} RENAME TO fd_test_schedule_away")
    try:
        said = r"migrations applied \(manage.py migrate django_q\)"
        with pytest.raises(CommandError, match=said):
            call_command("delivery_schedule", *args, stdout=io.StringIO())
    finally:
        with connection.cursor() as cursor:
            cursor.execute(f"ALTER TABLE fd_test_schedule_away RENAME TO {table}")
    assert not Schedule.objects.exists()


@pytest.mark.parametrize("value", ["0", "soon", "nan", "-3", "0.5", "1e-300", "86401", "1e10"])
def test_the_command_refuses_a_bad_round_naming_it(value: str) -> None:
    with pytest.raises(CommandError, match=f"from 1 to 86400, not {value!r}"):
        call_command("delivery_schedule", f"--round-seconds={value}")
    assert not Schedule.objects.exists()


def test_the_command_names_a_webhook_url_given_as_the_round_by_its_host_alone() -> None:
    secret = "https://hooks.slack.com/services/T0AAAA1/B0BBBB2/s3cretT0kenV4lue9"
    with pytest.raises(CommandError, match=r"hooks\.slack\.com") as refused:
        call_command("delivery_schedule", f"--round-seconds={secret}")
    assert "s3cret" not in str(refused.value)


@pytest.mark.parametrize("other", ["--round-seconds=nan", "--no-purge"])
def test_the_command_refuses_to_remove_with_another_option(other: str) -> None:
    call_command("delivery_schedule", stdout=io.StringIO())
    with pytest.raises(CommandError, match="--remove deletes both schedules"):
        call_command("delivery_schedule", "--remove", other)
    assert Schedule.objects.count() == 2, "nothing deleted"


def test_the_command_refuses_a_round_that_would_not_fit() -> None:
    with pytest.raises(CommandError, match="at most 25 s"):
        call_command("delivery_schedule", "--round-seconds=40")


@pytest.mark.parametrize("remove", [False, True])
def test_without_django_q_installed_the_command_says_to_add_it(settings: Any, remove: bool) -> None:
    settings.INSTALLED_APPS = [app for app in settings.INSTALLED_APPS if app != "django_q"]
    with pytest.raises(CommandError, match='"django_q" in INSTALLED_APPS'):
        call_command("delivery_schedule", *(["--remove"] if remove else []))


def test_without_django_q2_the_import_says_which_extra_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "django_q", None)  # an import of it fails
    monkeypatch.delitem(sys.modules, "django_federation_delivery.contrib.django_q")
    monkeypatch.delattr(contrib, "django_q")  # as if never imported
    with pytest.raises(ImportError, match=r'pip install "django-federation-delivery\[django-q\]"'):
        importlib.import_module("django_federation_delivery.contrib.django_q")
    with pytest.raises(CommandError, match="django-q2"):
        call_command("delivery_schedule")


@pytest.mark.django_db(transaction=True)
def test_a_round_on_a_database_that_lacks_the_packages_migration_is_refused(
    inbox: Inbox, settings: Any
) -> None:
    """A project upgrades and restarts its qcluster before ``migrate``:
    ``run_deliverer`` refuses to start ("lacks a migration ... run manage.py
    migrate first"), but every round spent its whole bound waiting out "no
    such table" as an outage and returned ``{"ran": True, "delivered": 0}``:
    a successful task every minute, nothing ever sent."""
    settings.Q_CLUSTER = {"orm": "default", "timeout": 90, "retry": 120}
    send(ALICE, {"type": "Create", "actor": ALICE}, [inbox.url()])
    table = Delivery._meta.db_table
    recorder = MigrationRecorder(connection)
    # As after an upgrade whose migration was not run: not recorded, and what
    # it makes is not there.
    recorder.record_unapplied("federation_delivery", "0001_initial")
    with connection.cursor() as cursor:
        cursor.execute(f"ALTER TABLE {table} RENAME TO fd_moved_away")
    try:
        started = time.monotonic()
        try:
            result: Any = deliver_round(2)
        except Exception as exc:  # what a refusal would be
            result = exc
        took = time.monotonic() - started
    finally:
        with connection.cursor() as cursor:
            cursor.execute(f"ALTER TABLE fd_moved_away RENAME TO {table}")
        recorder.record_applied("federation_delivery", "0001_initial")
    assert isinstance(result, Exception) and "migrate" in str(result), (
        f"the round ran {took:.1f} s on a database without the package's migration "
        f"and said it succeeded: {result!r}"
    )
    assert not inbox.received


@pytest.mark.skipif(django.VERSION >= (6, 0), reason="the ImportError is raised below Django 6.0")
def test_below_django_6_importing_contrib_tasks_as_apps_load_raises_the_import_error() -> None:
    """Imported on an older Django, ``contrib.tasks`` raises ImportError
    saying which it needs (README). Guarded (``try: ... except
    ImportError``) in a module Django imports as apps load (a
    ``models.py``), it raised ``AppRegistryNotReady`` instead: its message
    was translated at import, before translations can be."""
    code = (
        "import django\n"
        "from django.conf import settings\n"
        "settings.INSTALLED_APPS\n"  # configured, the apps not loaded yet
        "try:\n"
        "    import django_federation_delivery.contrib.tasks\n"
        "except ImportError as exc:\n"
        "    print('ImportError:', exc)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        env=dict(os.environ, DJANGO_SETTINGS_MODULE="tests.settings", PYTHONPATH=str(ROOT)),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0 and "needs Django 6.0 or later" in done.stdout, (
        done.stderr.strip().splitlines()[-1:] or done.stdout
    )


# In a real cluster: ``manage.py qcluster`` with the ORM broker on the test database.


@dataclass
class Cluster:
    process: subprocess.Popen[bytes]
    log: Path

    def kill(self) -> None:
        """SIGKILL to qcluster and every process under it (its own group)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(10)


@pytest.fixture
def clusters(tmp_path: Path) -> Iterator[Callable[..., Cluster]]:
    started: list[Cluster] = []

    def start(
        settings: dict[str, Any] | None = None, q_cluster: dict[str, Any] | None = None
    ) -> Cluster:
        log = tmp_path / f"qcluster-{len(started)}.log"
        with open(log, "wb") as out:
            process = subprocess.Popen(
                [*MANAGE, "qcluster"],
                env=subprocess_env(
                    FD_SETTINGS_JSON=json.dumps(settings or {}),
                    FD_Q_CLUSTER_JSON=json.dumps(q_cluster or {}),
                ),
                stdout=out,
                stderr=subprocess.STDOUT,
                # A group of its own: the test kills it and its workers at once.
                start_new_session=True,
            )
        started.append(Cluster(process, log))
        return started[-1]

    yield start
    for cluster_ in started:
        cluster_.kill()
        # Shown when the test failed: what the cluster said.
        print(f"--- {cluster_.log.name}:\n{cluster_.log.read_text(errors='replace')}")


def results(func: str) -> list[Any]:
    return [task.result for task in Task.objects.filter(func=func).order_by("stopped")]


@pytest.mark.slow
def test_a_send_is_delivered_by_the_scheduled_round_of_a_cluster(
    inbox: Inbox, clusters: Callable[..., Cluster]
) -> None:
    assert ensure_schedules(seconds=5) == {ROUND_SCHEDULE: "created", PURGE_SCHEDULE: "created"}
    send(ALICE, NOTE, [inbox.url()])
    # django-q2's scheduler looks at the schedules once its guard has counted
    # 30 s of cycles: with a cycle of 30 s, at once on starting, rather than
    # half a minute later.
    clusters(q_cluster={"guard_cycle": 30})
    wait_until(lambda: statuses() == {Status.DELIVERED: 1}, timeout=90, step=0.2)
    assert inbox.paths() == ["/inbox"]
    wait_until(lambda: results(ROUND_TASK) and results(PURGE_TASK), timeout=30, step=0.2)
    assert results(ROUND_TASK)[0]["ran"] is True
    assert results(ROUND_TASK)[0]["delivered"] == 1
    assert results(PURGE_TASK)[0]["finished"] is True
    round_ = Schedule.objects.get(name=ROUND_SCHEDULE)
    assert round_.next_run > timezone.now(), "the next round is scheduled"


@pytest.mark.slow
def test_two_rounds_enqueued_at_once_in_a_cluster_never_overlap(
    inbox: Inbox, clusters: Callable[..., Cluster]
) -> None:
    send(ALICE, NOTE, [inbox.url()])
    # Two workers in the test cluster: one each, at once.
    async_task(ROUND_TASK, 4)
    async_task(ROUND_TASK, 4)
    clusters()
    wait_until(lambda: len(results(ROUND_TASK)) == 2, timeout=90, step=0.2)
    first, second = results(ROUND_TASK)
    # Had it started after the other ended, it would have run: it came while
    # the other held the lock, and ended first.
    assert first == {"ran": False, "reason": ANOTHER_ROUND}
    assert second["ran"] is True
    assert second["delivered"] == 1
    assert second["seconds"] >= 4
    assert inbox.paths() == ["/inbox"]


@pytest.mark.slow
def test_a_cluster_killed_mid_round_loses_nothing_and_repeats_only_what_was_in_flight(
    inboxes: Callable[..., Inbox], clusters: Callable[..., Cluster]
) -> None:
    sinks = [inboxes(f"127.0.0.{n}", delay=0.1) for n in range(2, 6)]
    urls = [sink.url(f"/u{n}") for n in range(100) for sink in sinks]
    send(ALICE, NOTE, urls)

    def received() -> int:
        return sum(len(sink.received) for sink in sinks)

    concurrency = 8
    # A short lease that still holds an attempt and the margin to write it.
    # The attempt's time is all the lease leaves: at 1 s, an answer slowed
    # past it on a machine busy past its cores was tried again and reached
    # its inbox twice, a repeat the kill had no part in.
    settings = {"LEASE_SECONDS": 15, "ATTEMPT_TIMEOUT": 5, "CONCURRENCY": concurrency}
    first = clusters(settings)
    async_task(ROUND_TASK, 20)
    wait_until(lambda: received() >= 40, timeout=90)
    first.kill()
    assert received() < len(urls), "killed in the middle of the round, not at its end"
    assert statuses()[Status.PENDING] > 0
    # The killed round's leases lapse; its lock went with its process.
    leased = Delivery.objects.filter(status=Status.PENDING, lease_token__isnull=False)
    wait_until(lambda: not leased.filter(due_at__gt=timezone.now()).exists(), timeout=60)
    clusters(settings)
    # What is left takes 5 s at PER_HOST's two at a time; the rest of the
    # round is room for a machine busy past its cores.
    async_task(ROUND_TASK, 30)
    wait_until(
        lambda: statuses() == {Status.DELIVERED: len(urls)}, timeout=200, step=0.2, state=statuses
    )
    # In flight at the kill: being sent (CONCURRENCY: no host here is slow,
    # so no thread past those), queued for the next free worker (as many),
    # or sent with the outcome not yet written (a write's worth, 4 ×
    # CONCURRENCY: on a machine busy past its cores more than the 0.1 s'
    # worth waits): README's "What a crash sends twice". Nothing else twice.
    assert_each_reached_once_but(sinks, urls, twice=6 * concurrency)


@pytest.mark.parametrize("opened", ["atomic()", "set_autocommit(False)"])
def test_a_round_in_the_callers_transaction_is_refused_and_leaves_it_alone(
    inbox: Inbox, opened: str
) -> None:
    # Run there (a task backend that runs it at once, in a view's atomic()),
    # the loop would close the thread's connection: the caller's writes,
    # its send among them, rolled back with no error told. With autocommit
    # turned off, it was run: the uncommitted send delivered, then undone.
    with contextlib.ExitStack() as caller:
        if opened == "atomic()":
            caller.enter_context(transaction.atomic())
        else:
            transaction.set_autocommit(False)
            caller.callback(transaction.set_autocommit, True)
            caller.callback(transaction.commit)
        batch = send(ALICE, NOTE, [inbox.url("/a")])
        with pytest.raises(TransactionManagementError, match="on_commit"):
            deliver_round(1)
    assert Delivery.objects.filter(batch=batch).exists(), "the send committed with the rest"
    assert inbox.received == []


def test_rounds_of_another_period_keep_the_process_s_one_heartbeat() -> None:
    kept: dict[str, heartbeats.Heartbeat] = {}
    first = rounds.kept_heartbeat(kept, "default", period=60)
    again = rounds.kept_heartbeat(kept, "default", period=300)
    assert again is first, "one row for the process, not one more for each period"
    assert first.alive_for == 300
