"""contrib.tasks: rounds, the purge and the breakers' upkeep as Django's
tasks, enqueued on Django's ImmediateBackend (run at once, in the test) and
on a backend with a queue and a worker (tests/taskqueue.py); and the system
check that warns of a backend that would not run them usefully."""

from __future__ import annotations

import pytest

pytest.importorskip("django.tasks", reason="django.tasks is Django 6.0's: contrib.tasks needs it")

import collections
import datetime as dt
import importlib
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import django
from django.core.checks.registry import registry
from django.db import connections, transaction
from django.tasks import TaskResultStatus, task_backends
from django.tasks.backends.immediate import ImmediateBackend
from django.utils import timezone

from django_federation_delivery import contrib, heartbeats, send
from django_federation_delivery.contrib import django_q, rounds, tasks
from django_federation_delivery.contrib.rounds import ANOTHER_ROUND
from django_federation_delivery.deliverer import Deliverer
from django_federation_delivery.models import Breaker, DelivererHeartbeat, Delivery, Status

from .conftest import Inbox
from .keys import ALICE
from .taskqueue import QueueBackend

NOTE = {"type": "Create", "actor": ALICE}
db = pytest.mark.django_db(transaction=True)


def statuses() -> collections.Counter[str]:
    return collections.Counter(Delivery.objects.values_list("status", flat=True))


def queue() -> QueueBackend:
    backend = task_backends[tasks.ALIAS]
    assert isinstance(backend, QueueBackend)
    return backend


@pytest.fixture(autouse=True)
def _empty_queue() -> None:
    """The backend is made once a thread: what an earlier test left is not this one's."""
    queue().queued.clear()
    queue().results.clear()


@pytest.fixture
def declared_on() -> Iterator[Callable[[type], None]]:
    """Put another backend in the place of the one the tasks are declared on."""

    def put(backend: type) -> None:
        task_backends[tasks.BACKEND] = backend(alias=tasks.BACKEND, params={})

    yield put
    del task_backends[tasks.BACKEND]  # made again from TASKS when next asked for


# Where the tasks are declared.


def test_the_tasks_are_declared_on_the_backend_named_for_them_when_there_is_one(
    settings: Any,
) -> None:
    assert tasks.BACKEND == "federation_delivery"
    for declared in (tasks.deliver_round, tasks.purge, tasks.breaker_upkeep):
        assert declared.backend == "federation_delivery"
    settings.TASKS = {"default": {"BACKEND": "django.tasks.backends.immediate.ImmediateBackend"}}
    assert tasks.backend_alias() == "default"


def test_below_django_6_the_import_says_which_django_it_needs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(django, "VERSION", (5, 2, 9, "final", 0))
    monkeypatch.delitem(sys.modules, "django_federation_delivery.contrib.tasks")
    monkeypatch.delattr(contrib, "tasks")  # as if never imported
    with pytest.raises(ImportError, match=r"needs Django 6\.0 or later.*this is Django 5\.2\.9"):
        importlib.import_module("django_federation_delivery.contrib.tasks")


# A round.


@db
def test_a_round_enqueued_on_the_immediate_backend_delivers_and_says_what_it_did(
    inbox: Inbox,
) -> None:
    send(ALICE, NOTE, [inbox.url("/a"), inbox.url("/b")])
    result = tasks.deliver_round.using(backend="default").enqueue(1)
    assert result.status == TaskResultStatus.SUCCESSFUL, result.errors
    summary = result.return_value
    assert summary["ran"] is True
    assert (summary["delivered"], summary["retrying"], summary["failed"]) == (2, 0, 0)
    assert 1 <= summary["seconds"] < 5
    assert sorted(inbox.paths()) == ["/a", "/b"]
    assert statuses() == {Status.DELIVERED: 2}


@db
def test_a_round_run_by_a_worker_takes_its_arguments_from_json_and_beats_for_its_period(
    inbox: Inbox, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tasks, "_heartbeats", {})
    send(ALICE, NOTE, [inbox.url()])
    result = tasks.deliver_round.enqueue(1, period=300, using="default")
    assert inbox.received == [], "queued, not run"
    assert queue().work() == 1
    assert result.return_value["delivered"] == 1
    assert statuses() == {Status.DELIVERED: 1}
    # Alive for three of the project's periods after the round, not a minute's.
    (heartbeat,) = DelivererHeartbeat.objects.all()
    assert heartbeat.interval == 300


@db
def test_a_round_while_one_of_django_q2_runs_returns_at_once_saying_so(inbox: Inbox) -> None:
    send(ALICE, NOTE, [inbox.url()])
    with django_q.round_lock() as held:
        assert held
        result = tasks.deliver_round.using(backend="default").enqueue(5)
    assert result.return_value == {"ran": False, "reason": ANOTHER_ROUND}
    assert inbox.received == []
    assert statuses() == {Status.PENDING: 1}


@db
def test_a_round_enqueued_on_the_dummy_backend_never_runs(inbox: Inbox) -> None:
    send(ALICE, NOTE, [inbox.url()])
    result = tasks.deliver_round.using(backend="dummy").enqueue(1)
    assert result.status == TaskResultStatus.READY
    assert inbox.received == []


# Bad arguments.


@db
@pytest.mark.parametrize(
    ("declared", "kwargs", "said"),
    [
        (
            "deliver_round",
            {"seconds": 0},
            "a round's seconds must be a positive number, at most 86400, not 0",
        ),
        (
            "deliver_round",
            {"seconds": "10"},
            "a round's seconds must be a positive number, at most 86400, not '10'",
        ),
        (
            "deliver_round",
            {"seconds": True},
            "a round's seconds must be a positive number, at most 86400, not True",
        ),
        # JSON holds an int of any size: one past a float's overflowed, naming nothing.
        pytest.param(
            "deliver_round",
            {"seconds": 10**400},
            "a round's seconds must be a positive number, at most 86400, not 1000",
            id="deliver_round-seconds-past-a-float",
        ),
        ("deliver_round", {"period": -60}, "a round's period must be a positive number of seconds"),
        pytest.param(
            "deliver_round",
            {"seconds": 1, "period": 10**400},
            "a round's period must be a positive number of seconds, at most 86400, not 1000",
            id="deliver_round-period-past-a-float",
        ),
        ("deliver_round", {"using": "elsewhere"}, "using must name a database of DATABASES"),
        (
            "purge",
            {"seconds": float("inf")},
            "a purge's seconds must be a positive number, at most 86400, not inf",
        ),
        pytest.param(
            "purge",
            {"seconds": 10**400},
            "a purge's seconds must be a positive number, at most 86400, not 1000",
            id="purge-seconds-past-a-float",
        ),
        ("breaker_upkeep", {"using": 3}, "using must name a database of DATABASES, not 3"),
    ],
)
def test_a_bad_argument_fails_the_task_naming_it_and_nothing_is_sent(
    inbox: Inbox, declared: str, kwargs: dict[str, Any], said: str
) -> None:
    send(ALICE, NOTE, [inbox.url()])
    result = getattr(tasks, declared).using(backend="default").enqueue(**kwargs)
    assert result.status == TaskResultStatus.FAILED
    (error,) = result.errors
    assert error.exception_class is ValueError
    assert said in error.traceback
    assert inbox.received == []


@db
@pytest.mark.parametrize("seconds", [86401, 1e10])
def test_a_round_of_more_than_a_day_is_refused_not_run_for_ever(
    inbox: Inbox, monkeypatch: pytest.MonkeyPatch, seconds: float
) -> None:
    # 1e10 s is past what the round's stop timer can wait: its thread died,
    # and the round delivered and held the lock for ever.
    made: list[Deliverer] = []

    class Recorded(Deliverer):
        def __init__(self, *args: Any, **options: Any) -> None:
            super().__init__(*args, **options)
            made.append(self)

    monkeypatch.setattr(rounds, "Deliverer", Recorded)
    send(ALICE, NOTE, [inbox.url()])
    results: list[Any] = []

    def run() -> None:
        try:
            results.append(tasks.deliver_round.using(backend="default").enqueue(seconds))
        finally:
            connections.close_all()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(4)
    still_running = thread.is_alive()
    for deliverer in made:
        deliverer.stop()
    thread.join(30)
    assert not still_running, "the round still ran 4 s later"
    (result,) = results
    assert result.status == TaskResultStatus.FAILED
    (error,) = result.errors
    assert error.exception_class is ValueError
    assert f"at most 86400, not {seconds!r}" in error.traceback
    assert inbox.received == []


def test_an_argument_json_cannot_hold_is_refused_as_it_is_enqueued() -> None:
    with pytest.raises(TypeError, match="Unsupported type"):
        tasks.deliver_round.enqueue(seconds=dt.timedelta(seconds=10))
    assert queue().queued == []


# The purge, and the breakers' upkeep.


@db
def test_the_purge_deletes_what_is_past_retention_and_gives_the_counts(inbox: Inbox) -> None:
    send(ALICE, NOTE, [inbox.url("/old"), inbox.url("/new")])
    tasks.deliver_round.using(backend="default").enqueue(1)
    Delivery.objects.filter(inbox=inbox.url("/old")).update(
        settled_at=timezone.now() - dt.timedelta(days=8)
    )
    result = tasks.purge.enqueue(seconds=60)
    assert queue().work() == 1
    assert result.return_value["deliveries"]["delivered"] == 1
    assert result.return_value["finished"] is True
    assert list(Delivery.objects.values_list("inbox", flat=True)) == [inbox.url("/new")]


@db
def test_the_breaker_upkeep_forgets_stale_breakers_and_counts_those_that_stand() -> None:
    now = timezone.now()
    long_ago = now - dt.timedelta(hours=2)
    Breaker.objects.bulk_create(
        [
            # Closed, and untouched for longer than twice the cool-off: forgotten.
            Breaker(key="quiet.example", failures=3, updated_at=long_ago),
            # Open long ago, no probe since: forgotten.
            Breaker(key="gone.example", failures=0, open_until=long_ago, updated_at=long_ago),
            # Open now, and counting failures now: they stand.
            Breaker(key="down.example", failures=10, open_until=now + dt.timedelta(seconds=60)),
            Breaker(key="flaky.example", failures=2),
        ]
    )
    result = tasks.breaker_upkeep.using(backend="default").enqueue()
    assert result.return_value == {"ran": True, "forgotten": 2, "standing": 2, "holding": 1}
    assert sorted(Breaker.objects.values_list("key", flat=True)) == [
        "down.example",
        "flaky.example",
    ]


@db
def test_with_breakers_turned_off_the_upkeep_says_so(settings: Any) -> None:
    settings.FEDERATION_DELIVERY = {**settings.FEDERATION_DELIVERY, "BREAKER": None}
    result = tasks.breaker_upkeep.using(backend="default").enqueue()
    assert result.return_value == {"ran": False, "reason": tasks.BREAKERS_OFF}


# The system check.


def test_the_check_is_registered_by_importing_the_module() -> None:
    assert tasks.check_backend in registry.get_checks()


def test_a_backend_with_workers_is_fit_to_run_the_tasks() -> None:
    assert tasks.check_backend() == []


def test_the_immediate_backend_is_warned_of_as_it_would_hold_a_request(
    declared_on: Callable[[type], None],
) -> None:
    declared_on(ImmediateBackend)
    (warning,) = tasks.check_backend()
    assert warning.id == "federation_delivery.W005"
    assert "ImmediateBackend" in warning.msg
    assert "hold that request for 50 s and more" in warning.msg
    assert "TASKS['federation_delivery']" in (warning.hint or "")


def test_a_subclass_of_the_immediate_backend_is_warned_of_too(
    declared_on: Callable[[type], None],
) -> None:
    declared_on(type("Inline", (ImmediateBackend,), {}))
    assert [m.id for m in tasks.check_backend()] == ["federation_delivery.W005"]


def test_the_dummy_backend_is_warned_of_as_it_never_runs_a_task() -> None:
    (warning,) = tasks.backend_problems("dummy")
    assert warning.id == "federation_delivery.W005"
    assert "never runs a task" in warning.msg
    assert "keep DummyBackend to tests" in (warning.hint or "")


@db
def test_a_round_run_inside_the_callers_transaction_never_silently_undoes_it(
    inbox: Inbox,
) -> None:
    # Django's default TASKS backend is the ImmediateBackend (and it is what
    # Django recommends for tests): deliver_round.enqueue() inside a
    # transaction (ATOMIC_REQUESTS, a view's atomic(), a test's) runs the
    # round there, on the caller's connection. It should refuse, saying to
    # enqueue it with transaction.on_commit (which works), or leave the
    # caller's transaction alone; instead it delivers, then closes the
    # connection in the middle of the caller's transaction: the caller's
    # writes, its send included, are rolled back, and no error reaches it.
    with transaction.atomic():
        send(ALICE, NOTE, [inbox.url()])
        result = tasks.deliver_round.using(backend="default").enqueue(1)
    kept = Delivery.objects.count()
    assert kept == 1, (
        f"the caller's transaction was silently rolled back (its send gone: {kept} rows), "
        f"while the inbox received {inbox.paths()}; the round {result.status}: "
        f"{result.errors[0].traceback.strip().splitlines()[-1] if result.errors else ''}"
    )


@db
def test_one_process_whose_rounds_change_period_is_one_live_deliverer_not_several(
    inbox: Inbox, monkeypatch: pytest.MonkeyPatch
) -> None:
    # "each process's rounds keep one heartbeat": one process runs these
    # rounds, one at a time, told their period as the README says
    # (deliver_round.enqueue(period=300)), by two schedules, or the project
    # going from a round every minute to one every five.
    monkeypatch.setattr(tasks, "_heartbeats", {})
    for period in (60, 300, 60, 300, 60):
        tasks.deliver_round.using(backend="default").enqueue(0.3, period=period)
    live = heartbeats.seen().live
    assert len(live) == 1, (
        f"one process, one round at a time, and {len(live)} live deliverers shown "
        f"({DelivererHeartbeat.objects.count()} heartbeat rows): "
        f"{[(d.pid, d.started_at.time().isoformat()) for d in live]}"
    )
