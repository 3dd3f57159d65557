"""asend(), asend_portable() and asend_webhook(): the same sends, awaited from
async views under Django's ASGI test client."""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

import django
import pytest
from asgiref.sync import async_to_sync
from django.db import transaction
from django.test import AsyncClient

from django_federation_delivery import asend
from django_federation_delivery.models import Batch, Delivery

from .keys import ALICE

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.urls("tests.async_views"),
]


def post(path: str, document: dict[str, Any] | None = None) -> tuple[int, Any]:
    async def request() -> Any:
        return await AsyncClient().post(
            path, json.dumps(document or {}), content_type="application/json"
        )

    response = async_to_sync(request)()
    return response.status_code, json.loads(response.content)


def test_an_async_view_queues_a_send_and_reports_the_inboxes_it_left_out() -> None:
    status, said = post(
        "/post",
        {"id": f"{ALICE}/1", "inboxes": ["https://a.example/inbox", "https://b.example:0/inbox"]},
    )
    assert status == 200
    batch = Batch.objects.get()
    assert said["batch"] == batch.pk
    ((inbox, reason),) = said["skipped"]
    assert inbox == "https://b.example:0/inbox" and "port 0" in reason
    assert list(Delivery.objects.values_list("inbox", flat=True)) == ["https://a.example/inbox"]
    # The same key again: the first batch, nothing more queued.
    assert post("/post", {"id": f"{ALICE}/1", "inboxes": ["https://c.example/inbox"]}) == (
        200,
        {"batch": batch.pk, "skipped": []},
    )
    assert Delivery.objects.count() == 1


def test_a_bad_argument_is_refused_naming_it_with_nothing_written() -> None:
    status, said = post("/post", {"id": f"{ALICE}/2", "inboxes": "https://a.example/inbox"})
    assert status == 400 and "inboxes must be an iterable of URLs" in said["error"]
    assert not Batch.objects.exists()


def test_a_key_that_is_no_string_is_refused_by_asend_as_by_send() -> None:
    # The view keys the send by the id it is given: 0 is no "", and is
    # refused, not taken for no key.
    status, said = post("/post", {"id": 0, "inboxes": ["https://a.example/inbox"]})
    assert (status, said["error"]) == (400, "idempotency_key must be a string, not 0")
    assert not Batch.objects.exists()


def test_a_portable_inbox_and_a_webhook_event_are_sent_from_async_views(settings: Any) -> None:
    status, said = post(
        "/post",
        {
            "id": f"{ALICE}/3",
            "portable": True,
            "inboxes": [["ap://did:key:z6Mk/actor/inbox", "https://g.example"]],
        },
    )
    assert status == 200 and said["batch"] is not None
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "WEBHOOKS": {"ops": "slack://hooks.slack.com/services/T0AAAA1/B0BBBB2/s3cretT0kenV4lue9"},
    }
    status, said = post("/alert")
    assert status == 200
    assert Delivery.objects.get(batch_id=said["batch"]).destination == "ops"


def test_an_await_inside_the_callers_transaction_is_rolled_back_with_it() -> None:
    # asend runs in the thread the caller's transaction is open in, on its
    # connection: rolled back, nothing is queued.
    class Failed(Exception):
        pass

    def view() -> None:
        with transaction.atomic():
            async_to_sync(asend)(ALICE, {"type": "Create", "id": "x"}, ["https://a.example/inbox"])
            assert Delivery.objects.count() == 1, "queued in this transaction"
            raise Failed

    with pytest.raises(Failed):
        view()
    assert not Delivery.objects.exists()


def test_the_views_run_under_the_asgi_handler() -> None:
    from django.core.signals import request_started

    handlers: list[str] = []

    def started(sender: Any, **kwargs: Any) -> None:
        handlers.append(sender.__name__)

    request_started.connect(started)
    try:
        post("/post", {"id": f"{ALICE}/4", "inboxes": ["https://a.example/inbox"]})
    finally:
        request_started.disconnect(started)
    assert handlers == ["AsyncClientHandler"]


@pytest.mark.skipif(django.VERSION < (5, 0), reason="Django calls async receivers from 5.0 on")
def test_an_asend_cancelled_once_committed_lets_its_async_receivers_finish(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An async view awaiting ``asend`` of a Delete is cancelled once the
    send has committed (its client went away): the async receivers of
    ``delivery_settled`` the commit started were cancelled with it, midway,
    and each logged as raising ``CancelledError``. They finish, and nothing
    is logged. (The cancellation reached the receivers, through asgiref,
    not the view's await, which returns the batch: it was sent.)"""
    from django_federation_delivery import send, signals

    finished: list[str] = []
    started = asyncio.Event()

    async def receiver(settled: signals.Settled, **kwargs: Any) -> None:
        started.set()
        await asyncio.sleep(0.3)
        finished.append(settled.outcome)

    post = f"{ALICE}/notes/1"
    inbox = "https://a.example/inbox"
    send(ALICE, {"type": "Create", "id": f"{ALICE}/a/1", "object": post}, [inbox])
    signals.delivery_settled.connect(receiver, weak=False)

    async def view() -> None:
        delete = {"type": "Delete", "id": f"{ALICE}/a/d", "object": post}
        task = asyncio.ensure_future(asend(ALICE, delete, [inbox]))
        await asyncio.wait_for(started.wait(), 10)  # committed, its receiver under way
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.5)

    try:
        async_to_sync(view)()
    finally:
        signals.delivery_settled.disconnect(receiver)
    assert finished == ["superseded"], caplog.text[-800:]
    assert "CancelledError" not in caplog.text
