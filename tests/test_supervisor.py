"""The supervisor of ``run_deliverer --processes``: how it names a child's
end, and what a stop makes of a child's death, with children of these tests'
own (processes, so marked slow).

Its children, stops, restarts and giving up are tested end to end, as an
operator runs them, in ``test_run_deliverer.py``.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from django_federation_delivery import supervisor as supervising
from django_federation_delivery.supervisor import GaveUp, Supervisor, describe_exit, stop_requested

from .conftest import wait_until

#: The longest a test waits for a spawned child to start and run (a fresh
#: interpreter that sets Django up), on a machine busy past its cores.
STARTED = 150.0


def exits_at_once(index: int, count: int) -> None:
    """A child that cannot start: it exits 3 as soon as it runs."""
    os._exit(3)


def fails_its_stop(index: int, count: int, ready: str) -> None:
    """A child that says it runs (a file), then exits 1 once told to stop."""
    Path(ready).touch()
    # Polled: a stop's handler sets the Event, which a wait() could be holding.
    while not stop_requested.is_set():
        time.sleep(0.05)
    os._exit(1)


class OnRestart(logging.Handler):
    """Calls ``action`` as the supervisor says it restarts a child, from
    within its handling of the child's death."""

    def __init__(self, action: Callable[[], object]) -> None:
        super().__init__()
        self.action = action
        self.done = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if not self.done.is_set() and "restarting it" in record.getMessage():
            self.done.set()
            self.action()


class Running:
    """A supervisor's ``run()`` in a thread of its own (where it takes no
    signals over), with ``on_restart`` told of a child's restart."""

    def __init__(self, supervisor: Supervisor, on_restart: Callable[[], object]) -> None:
        self.supervisor = supervisor
        self.errors: list[BaseException] = []
        self.hook = OnRestart(on_restart)
        self.logger = logging.getLogger("django_federation_delivery.deliverer")
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            self.supervisor.run()
        except BaseException as exc:
            self.errors.append(exc)

    def __enter__(self) -> Running:
        self.logger.addHandler(self.hook)
        self.thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.logger.removeHandler(self.hook)
        if self.thread.is_alive():
            # Let a supervisor that never returns go: nothing else ends its loop.
            for child in self.supervisor.children:
                child.restart_at = None
            self.thread.join(10)


@pytest.mark.parametrize(
    ("code", "said"),
    [
        (0, "exited with status 0"),
        (1, "exited with status 1"),
        (-signal.SIGKILL, "was killed by SIGKILL"),
        (-signal.SIGSEGV, "was killed by SIGSEGV"),
        (-200, "was killed by signal 200"),
        (None, "is still running"),
    ],
)
def test_a_childs_end_is_said_as_an_operator_reads_it(code: int | None, said: str) -> None:
    assert describe_exit(code) == said


@pytest.mark.slow
def test_a_stop_while_a_childs_death_is_handled_leaves_no_restart_to_wait_for() -> None:
    # The stop is acted on in the signals' thread, at any point of the main
    # thread's: here, after the supervisor found itself not stopping and
    # before it set the child's restart. That restart never comes once
    # stopping; waited for, the supervisor never returned, polling without
    # a wait (100% of a core).
    supervisor = Supervisor(1, f"{__name__}.exits_at_once", say=lambda line: None)
    with Running(supervisor, on_restart=supervisor.stop) as running:
        wait_until(running.hook.done.is_set, timeout=STARTED)
        running.thread.join(10)
        returned = not running.thread.is_alive()
    assert returned, "stopped, with no child running, it returns"
    assert running.errors == [], "the child died before the stop: no failure of the stop"


@pytest.mark.slow
def test_a_stop_during_a_restarts_backoff_is_no_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    # The child died before the stop, and waits for its restart, which the
    # stop cancels: it was said as it died, and the stop ended with no
    # deliverer running, as a stop does (it raised GaveUp: run_deliverer
    # exited 1). A long backoff, so that the stop comes within it.
    monkeypatch.setattr(supervising, "FIRST_BACKOFF", 60.0)
    supervisor = Supervisor(1, f"{__name__}.exits_at_once", say=lambda line: None)

    def stop_soon() -> None:
        # From another thread, as the signals' thread would.
        threading.Timer(0.1, supervisor.stop).start()

    with Running(supervisor, on_restart=stop_soon) as running:
        wait_until(running.hook.done.is_set, timeout=STARTED)
        running.thread.join(30)
        returned = not running.thread.is_alive()
    assert returned
    assert running.errors == [], "a stop is not a failure"


@pytest.mark.slow
def test_a_child_that_fails_as_it_stops_is_still_reported(tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    supervisor = Supervisor(1, f"{__name__}.fails_its_stop", (str(ready),), say=lambda line: None)
    with Running(supervisor, on_restart=lambda: None) as running:
        wait_until(ready.exists, timeout=STARTED)
        supervisor.stop()
        running.thread.join(30)
    assert not running.thread.is_alive()
    assert [type(error) for error in running.errors] == [GaveUp]
    assert "deliverer 1 (pid " in str(running.errors[0])
    assert str(running.errors[0]).endswith(") exited with status 1")
