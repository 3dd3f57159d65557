"""When the signals are sent, and what a receiver may do: none runs inside
the package's own write, and whatever one raises the loop goes on."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import Any

import django
import pytest
from django.db import IntegrityError, OperationalError, connection

from django_federation_delivery import controls, send, send_webhook, signals
from django_federation_delivery.conf import app_settings
from django_federation_delivery.models import Batch, Delivery, Host, Status
from django_federation_delivery.settling import Summary
from django_federation_delivery.store import settlements
from django_federation_delivery.webhooks.deliveries import WebhookDeliveries

from .conftest import Inbox, RunningDeliverer, wait_until
from .keys import ALICE

NOTE = {"@context": "https://www.w3.org/ns/activitystreams", "type": "Create", "actor": ALICE}

#: A row every receiver below makes, made already: each call meets an IntegrityError.
TAKEN = "made-by-a-receiver.example"


class MakesARow:
    """A receiver that is safe to repeat as receivers are asked to be:
    "make it, or it was made already". Each call meets an IntegrityError,
    which it catches or not; and it notes whether it ran inside a transaction."""

    def __init__(self, *, catch: bool) -> None:
        self.catch = catch
        self.calls: list[dict[str, Any]] = []
        self.in_transaction: list[bool] = []

    def __call__(self, sender: Any, **kwargs: Any) -> None:
        self.calls.append(kwargs)
        self.in_transaction.append(connection.in_atomic_block)
        try:
            Host.objects.create(name=TAKEN)
        except IntegrityError:
            if not self.catch:
                raise


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("catch", [True, False], ids=["caught", "raised"])
def test_a_batch_finished_receiver_that_meets_a_database_error_undoes_no_settle(
    inbox: Inbox, start_deliverer: Callable[..., RunningDeliverer], catch: bool
) -> None:
    # Sent inside the settle's transaction, its error rolled the settle back
    # unseen: the delivery stayed leased, and was sent again every lease.
    Host.objects.create(name=TAKEN)
    receiver = MakesARow(catch=catch)
    signals.batch_finished.connect(receiver, weak=False)
    try:
        batch = send(ALICE, NOTE, [inbox.url("/a"), inbox.url("/b")])
        assert batch is not None
        runner = start_deliverer()
        wait_until(
            lambda: (
                Batch.objects.filter(id=batch.id, finished_at__isnull=False).exists()
                and len(receiver.calls) == 1
            ),
            timeout=10,
            state=lambda: list(Delivery.objects.values_list("status", "lease_token")),
        )
        assert runner.thread.is_alive()
        runner.stop()
    finally:
        signals.batch_finished.disconnect(receiver)
    assert set(Delivery.objects.values_list("status", "lease_token")) == {(Status.DELIVERED, None)}
    assert sorted(inbox.paths()) == ["/a", "/b"], "each sent once"
    assert [call["batch"].id for call in receiver.calls] == [batch.id]
    assert receiver.in_transaction == [False]


@pytest.mark.django_db(transaction=True)
def test_a_database_error_reading_a_finished_batch_delays_its_signal_and_loses_nothing(
    inbox: Inbox,
    start_deliverer: Callable[..., RunningDeliverer],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Read inside the settle's own call, a moment's error there made the
    # committed settle count as unwritten: written again, its rows no longer
    # its claim's, and the batch never told finished.
    from django_federation_delivery.store import countdowns

    read = countdowns.finished_batches
    calls: list[list[int]] = []

    def away_at_first(ids: Any, **kwargs: Any) -> Any:
        calls.append(list(ids))
        if len(calls) == 1:
            raise OperationalError("database is locked")
        return read(ids, **kwargs)

    monkeypatch.setattr(countdowns, "finished_batches", away_at_first)
    told: list[int] = []

    def receiver(sender: Any, batch: Batch, **kwargs: Any) -> None:
        told.append(batch.id)

    signals.batch_finished.connect(receiver, weak=False)
    try:
        batch = send(ALICE, NOTE, [inbox.url("/a")])
        assert batch is not None
        runner = start_deliverer()
        wait_until(lambda: told == [batch.id], timeout=10, state=lambda: (calls, told))
        runner.stop()
    finally:
        signals.batch_finished.disconnect(receiver)
    assert calls == [[batch.id], [batch.id]]
    assert inbox.paths() == ["/a"], "sent once"


@pytest.mark.django_db(transaction=True)
def test_an_operators_give_up_is_told_once_committed() -> None:
    # delivery_failed and batch_finished were sent inside the give-up's
    # transaction: a receiver's caught error undid it (on SQLite silently,
    # the count still returned; on PostgreSQL with an error).
    Host.objects.create(name=TAKEN)
    failed, finished = MakesARow(catch=True), MakesARow(catch=True)
    signals.delivery_failed.connect(failed, weak=False)
    signals.batch_finished.connect(finished, weak=False)
    try:
        batch = send(ALICE, NOTE, ["https://gone.example/a", "https://gone.example/b"])
        assert batch is not None
        assert controls.give_up(Delivery.objects.filter(batch=batch)) == 2
    finally:
        signals.delivery_failed.disconnect(failed)
        signals.batch_finished.disconnect(finished)
    assert set(Delivery.objects.values_list("status", flat=True)) == {Status.FAILED}
    assert Batch.objects.get(id=batch.id).finished_at is not None
    assert sorted(call["failure"].inbox for call in failed.calls) == [
        "https://gone.example/a",
        "https://gone.example/b",
    ]
    assert [call["batch"].id for call in finished.calls] == [batch.id]
    assert failed.in_transaction == [False, False]
    assert finished.in_transaction == [False]


@pytest.mark.django_db(transaction=True)
def test_a_removed_destinations_events_are_told_failed_once_by_two_deliverers_giving_them_up(
    settings: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Two deliverers start at once after a deploy removed a destination, and
    # each gives up what is pending to it. delivery_failed (and the WARNING
    # line) was sent for each row the second had read as pending, although
    # the first failed them before the second wrote: told twice.
    webhooks = {"gone": "slack+http://127.0.0.1:9/services/T1/B1/x1"}
    settings.FEDERATION_DELIVERY = {**settings.FEDERATION_DELIVERY, "WEBHOOKS": webhooks}
    send_webhook("gone", "alert.raised", {"n": 0})
    send_webhook("gone", "alert.raised", {"n": 1})
    settings.FEDERATION_DELIVERY = {**settings.FEDERATION_DELIVERY, "WEBHOOKS": {}}
    first, second = (
        WebhookDeliveries.from_settings(Summary(), app_settings.transport_settings())
        for _ in range(2)
    )
    write = settlements.give_up_rows
    meanwhile: list[int] = []

    def first_gives_up_first(*args: Any, **kwargs: Any) -> Any:
        # The second has read its rows as pending; the first gives them all
        # up before the second writes.
        if not meanwhile:
            with monkeypatch.context() as unpatched:
                unpatched.setattr(settlements, "give_up_rows", write)
                meanwhile.append(first.give_up_unusable())
        return write(*args, **kwargs)

    told: list[int] = []

    def failed(sender: Any, failure: signals.Failure, **kwargs: Any) -> None:
        told.append(failure.delivery_id)

    signals.delivery_failed.connect(failed)
    caplog.set_level(logging.WARNING, logger="django_federation_delivery")
    try:
        with monkeypatch.context() as patched:
            patched.setattr(settlements, "give_up_rows", first_gives_up_first)
            assert second.give_up_unusable() == 0
    finally:
        signals.delivery_failed.disconnect(failed)
    assert meanwhile == [2]
    assert set(Delivery.objects.values_list("status", flat=True)) == {Status.FAILED}
    assert sorted(told) == sorted(Delivery.objects.values_list("id", flat=True))
    assert len([m for m in caplog.messages if "given up" in m]) == 2


class Stop(BaseException):
    """What no ``except Exception`` catches, as a receiver's own library may raise."""


def settled_to(receivers: list[Callable[..., Any]], caplog: pytest.LogCaptureFixture) -> None:
    """Send ``delivery_settled`` (settled=7) safely to ``receivers``, connected
    in this order and then disconnected, what it logs caught by ``caplog``."""
    for receiver in receivers:
        signals.delivery_settled.connect(receiver, weak=False)
    try:
        with caplog.at_level(logging.ERROR, logger="django.dispatch"):
            signals.send_safely(signals.delivery_settled, settled=7)
    finally:
        for receiver in receivers:
            signals.delivery_settled.disconnect(receiver)


def raising(error: BaseException) -> Callable[..., None]:
    def receiver(sender: Any, **kwargs: Any) -> None:
        raise error

    receiver.__qualname__ = f"raises_{type(error).__name__}"
    return receiver


@pytest.mark.parametrize("error", [SystemExit(3), Stop("stopped")], ids=["SystemExit", "Stop"])
def test_a_receiver_that_raises_what_is_no_exception_is_logged_and_not_raised(
    caplog: pytest.LogCaptureFixture, error: BaseException
) -> None:
    called: list[int] = []
    receivers = [
        raising(RuntimeError("a bug")),
        raising(error),
        lambda sender, **kwargs: called.append(kwargs["settled"]),
    ]
    settled_to(receivers, caplog)
    assert called == [7], "the receiver after them called all the same"
    # By the error's type and where it was raised, not its message, which
    # may quote what the receiver was given (an inbox's query, its token).
    line = raising.__code__.co_firstlineno + 2
    messages = [record.getMessage().split("\n")[0] for record in caplog.records]
    assert messages == [
        "Error calling tests.test_signals.raises_RuntimeError, a receiver of delivery_settled: "
        f"RuntimeError raised at test_signals.py:{line}",
        f"Error calling tests.test_signals.raises_{type(error).__name__}, "
        f"a receiver of delivery_settled: {type(error).__name__} raised at test_signals.py:{line}",
    ]
    for record in caplog.records:
        assert "Traceback (most recent call last):" in record.getMessage(), "with its calls"
        assert "in receiver\n    raise error" in record.getMessage()


class Notifier:
    """A receiver that is an object, as a host project's may be: it has no
    ``__qualname__``, and its repr raises."""

    def __call__(self, sender: Any, **kwargs: Any) -> None:
        raise RuntimeError("the pager is away")

    def __repr__(self) -> str:
        raise RuntimeError("no repr")


def notify(sender: Any, *, channel: str, **kwargs: Any) -> None:
    raise RuntimeError(f"{channel} is away")


@pytest.mark.parametrize(
    ("receiver", "named"),
    [
        (functools.partial(notify, channel="ops"), "functools.partial(tests.test_signals.notify)"),
        (Notifier(), "<tests.test_signals.Notifier object at 0x"),
    ],
    ids=["partial", "object"],
)
def test_a_receiver_with_no_name_that_raises_is_logged_and_the_others_are_called(
    caplog: pytest.LogCaptureFixture, receiver: Callable[..., None], named: str
) -> None:
    # Django's send_robust logs a receiver by its __qualname__: a partial or
    # an object has none, and the AttributeError went past it, the receivers
    # after the one that raised never called.
    called: list[int] = []

    def after(sender: Any, settled: int, **kwargs: Any) -> None:
        called.append(settled)

    settled_to([receiver, after], caplog)
    assert called == [7]
    (record,) = caplog.records
    assert record.getMessage().startswith(f"Error calling {named}"), record.getMessage()
    assert "a receiver of delivery_settled: RuntimeError raised at " in record.getMessage()
    assert "Traceback (most recent call last):" in record.getMessage(), "with its calls"


@pytest.mark.django_db(transaction=True)
def test_a_partial_receiver_that_raises_leaves_the_other_receivers_called_by_the_loop(
    inboxes: Callable[..., Inbox],
) -> None:
    from django_federation_delivery.deliverer import Deliverer

    gone = inboxes(respond=lambda request: (410, {}, b"")).url("/gone")
    marked: list[str] = []

    def mark_gone(sender: Any, failure: signals.Failure, **kwargs: Any) -> None:
        marked.append(failure.inbox)

    first = functools.partial(notify, channel="ops")
    signals.delivery_failed.connect(first, weak=False)
    signals.delivery_failed.connect(mark_gone)
    try:
        send(ALICE, NOTE, [gone])
        Deliverer().run(drain=True)
    finally:
        signals.delivery_failed.disconnect(first)
        signals.delivery_failed.disconnect(mark_gone)
    assert marked == [gone]


@pytest.mark.skipif(django.VERSION < (5, 0), reason="Django calls async receivers from 5.0 on")
def test_an_async_receiver_that_raises_is_logged_and_the_others_are_called(
    caplog: pytest.LogCaptureFixture,
) -> None:
    called: list[str] = []

    async def fails(sender: Any, **kwargs: Any) -> None:
        raise RuntimeError("an async bug")

    async def after(sender: Any, **kwargs: Any) -> None:
        called.append("async")

    def synchronous(sender: Any, **kwargs: Any) -> None:
        called.append("sync")

    settled_to([fails, after, synchronous], caplog)
    assert sorted(called) == ["async", "sync"]
    (record,) = caplog.records
    assert "fails" in record.getMessage() and "RuntimeError raised at" in record.getMessage()


def test_a_keyboard_interrupt_in_a_receiver_is_let_through() -> None:
    # In the main thread it is the operator's Ctrl-C.
    receiver = raising(KeyboardInterrupt())
    signals.delivery_settled.connect(receiver, weak=False)
    try:
        with pytest.raises(KeyboardInterrupt):
            signals.send_safely(signals.delivery_settled, settled=7)
    finally:
        signals.delivery_settled.disconnect(receiver)


@pytest.mark.skipif(django.VERSION < (5, 0), reason="Django calls async receivers from 5.0 on")
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("flavour", ["async", "sync"])
def test_a_receivers_keyboard_interrupt_outside_the_main_thread_is_its_error(
    inbox: Inbox, start_deliverer: Callable[..., RunningDeliverer], flavour: str
) -> None:
    # Python raises Ctrl-C in the main thread only: an async receiver runs
    # in its event loop's thread, and a deliverer may run in a thread of its
    # own. Let through, it ended the loop, the delivery sent and left pending
    # under its lease, to be sent again.
    raised: list[int] = []

    async def async_receiver(sender: Any, settled: signals.Settled, **kwargs: Any) -> None:
        if not raised:
            raised.append(settled.delivery_id)
            raise KeyboardInterrupt

    def sync_receiver(sender: Any, settled: signals.Settled, **kwargs: Any) -> None:
        if not raised:
            raised.append(settled.delivery_id)
            raise KeyboardInterrupt

    receiver = async_receiver if flavour == "async" else sync_receiver
    signals.delivery_settled.connect(receiver, weak=False)
    try:
        send(ALICE, NOTE, [inbox.url("/a")])
        runner = start_deliverer()
        wait_until(
            lambda: (
                (bool(raised) and not runner.thread.is_alive())
                or Delivery.objects.filter(status=Status.DELIVERED).exists()
            ),
            timeout=10,
        )
        time.sleep(0.5)
        alive, error = runner.thread.is_alive(), runner.error
        rows = list(Delivery.objects.values_list("status", "lease_token"))
        runner.error = None  # not raised again by the fixture's stop
    finally:
        signals.delivery_settled.disconnect(receiver)
    assert inbox.paths() == ["/a"]
    assert error is None and alive, f"the loop ended on the receiver's {error!r}"
    assert rows == [(Status.DELIVERED, None)]


@pytest.mark.django_db(transaction=True)
def test_a_receivers_error_quoting_the_inbox_is_logged_without_its_message(
    inboxes: Callable[..., Inbox], caplog: pytest.LogCaptureFixture
) -> None:
    # A receiver's error may quote what it was given, an inbox's token in
    # its query: its message and traceback were logged whole.
    from django_federation_delivery.deliverer import Deliverer

    gone = inboxes(respond=lambda request: (410, {}, b""))
    url = gone.url("/inbox?token=sekrit99")

    def mark_gone(sender: Any, failure: signals.Failure, **kwargs: Any) -> None:
        raise LookupError(f"no server has the inbox {failure.inbox}")

    signals.delivery_failed.connect(mark_gone, weak=False)
    try:
        with caplog.at_level(logging.DEBUG):
            send(ALICE, NOTE, [url])
            Deliverer().run(drain=True)
    finally:
        signals.delivery_failed.disconnect(mark_gone)
    formatter = logging.Formatter()
    lines = [formatter.format(record) for record in caplog.records]
    assert any("mark_gone" in line and "LookupError raised at" in line for line in lines)
    assert not [line for line in lines if "sekrit99" in line]
