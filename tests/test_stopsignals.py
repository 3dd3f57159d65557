"""SIGTERM and SIGINT as run_deliverer and its supervisor take them: acted on
outside the handler, once, and a second one ends the process.

Sent to this process for real: Python runs a handler in the main thread,
between two of its bytecodes, which is what these tests are about. The
processes' own stops are tested end to end in ``test_run_deliverer.py``.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from django_federation_delivery.stopsignals import StopSignals

pytestmark = pytest.mark.timeout(20)


class Record:
    def __init__(self) -> None:
        self.first: list[int] = []
        self.again: list[int] = []
        self.acted = threading.Event()

    def on_first(self, number: int) -> None:
        self.first.append(number)
        self.acted.set()

    def on_again(self, number: int) -> None:
        self.again.append(number)


@pytest.fixture
def record() -> Record:
    return Record()


def installed(signals: StopSignals) -> StopSignals:
    assert threading.current_thread() is threading.main_thread()
    assert signals.install()
    return signals


def test_the_first_signal_is_acted_on_in_a_thread_of_its_own_and_the_handlers_come_back(
    record: Record,
) -> None:
    before = signal.getsignal(signal.SIGTERM)
    threads: list[threading.Thread] = []

    def first(number: int) -> None:
        threads.append(threading.current_thread())
        record.on_first(number)

    signals = installed(StopSignals(first, record.on_again))
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        assert record.acted.wait(10)
    finally:
        signals.restore()
    assert record.first == [signal.SIGTERM]
    assert record.again == []
    assert threads[0] is not threading.main_thread()
    assert signal.getsignal(signal.SIGTERM) is before
    threads[0].join(5)
    assert not threads[0].is_alive(), "its thread ends once the handlers are given back"


def test_a_signal_while_the_main_thread_holds_what_the_stop_takes_is_acted_on_once_it_is_let_go(
    record: Record,
) -> None:
    # What a deliverer's main thread holds while it waits on an Event: the
    # Event's own lock, which the stop takes to set it. Acted on in the
    # handler, the stop would wait for ever on the thread it interrupted.
    lock = threading.Lock()

    def first(number: int) -> None:
        with lock:
            record.on_first(number)

    signals = installed(StopSignals(first, record.on_again))
    try:
        with lock:
            os.kill(os.getpid(), signal.SIGINT)
            # The handler runs between these bytecodes, then this goes on.
            for _ in range(10_000):
                pass
            assert not record.acted.is_set()
        assert record.acted.wait(10)
    finally:
        signals.restore()
    assert record.first == [signal.SIGINT]


def test_a_second_signal_calls_again_at_once_even_before_the_first_is_acted_on(
    record: Record,
) -> None:
    # The first one's action is held up: the second is still seen as a
    # second (the case of a second Ctrl-C while the first is being said).
    hold = threading.Event()

    def first(number: int) -> None:
        hold.wait(10)
        record.on_first(number)

    signals = installed(StopSignals(first, record.on_again))
    try:
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(10_000):
            pass
        assert record.again == [signal.SIGTERM]
        hold.set()
        assert record.acted.wait(10)
    finally:
        signals.restore()
    assert record.first == [signal.SIGINT]


def test_without_again_a_second_signal_does_nothing_more(record: Record) -> None:
    threads: list[threading.Thread] = []

    def first(number: int) -> None:
        threads.append(threading.current_thread())
        record.on_first(number)

    signals = installed(StopSignals(first))
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        assert record.acted.wait(10)
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGINT)
    finally:
        signals.restore()
    # Its thread reads what was sent before the handlers came back, then ends.
    threads[0].join(5)
    assert not threads[0].is_alive()
    assert record.first == [signal.SIGTERM]


def test_outside_the_main_thread_nothing_is_taken_over(record: Record) -> None:
    before = signal.getsignal(signal.SIGINT)
    taken: list[bool] = []
    thread = threading.Thread(target=lambda: taken.append(StopSignals(record.on_first).install()))
    thread.start()
    thread.join(5)
    assert taken == [False]
    assert signal.getsignal(signal.SIGINT) is before


def test_a_failing_action_is_logged_not_lost(caplog: pytest.LogCaptureFixture) -> None:
    done = threading.Event()

    def first(number: int) -> None:
        done.set()
        raise RuntimeError("boom")

    signals = installed(StopSignals(first))
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        assert done.wait(10)
        deadline = time.monotonic() + 10
        while "boom" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        signals.restore()
    assert f"Acting on signal {signal.SIGTERM:d} failed" in caplog.text
    assert "RuntimeError: boom" in caplog.text


def test_the_first_is_acted_on_in_the_language_of_the_thread_that_installed_them(
    record: Record,
) -> None:
    from django.utils import translation

    languages: list[str | None] = []

    def first(number: int) -> None:
        languages.append(translation.get_language())
        record.on_first(number)

    with translation.override("fr"):
        signals = installed(StopSignals(first))
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        assert record.acted.wait(10)
    finally:
        signals.restore()
    assert languages == ["fr"]
