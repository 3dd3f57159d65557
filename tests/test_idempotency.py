"""Idempotent sends: the same key again, while its batch is kept, queues
nothing and returns the first batch; on both databases, and when two sends
with one key race."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from django.db import close_old_connections, connection, transaction

from django_federation_delivery import BatchOptions, InvalidDelivery, send, send_batch, send_webhook
from django_federation_delivery.models import Batch, Delivery

from .keys import ALICE

NOTE = {"type": "Create", "actor": ALICE, "object": {"type": "Note", "content": "hello"}}
INBOXES = [f"https://h{n}.example/inbox" for n in range(5)]


@pytest.mark.django_db
def test_a_send_retried_with_its_key_returns_the_first_batch_and_queues_nothing() -> None:
    first = send(ALICE, NOTE, INBOXES, idempotency_key="post-42")
    again = send(ALICE, NOTE, [*INBOXES, "https://late.example/inbox"], idempotency_key="post-42")
    assert first is not None and again is not None
    assert again.pk == first.pk and again.size == 5
    assert Batch.objects.count() == 1 and Delivery.objects.count() == 5
    other = send_batch(ALICE, NOTE, INBOXES, BatchOptions(idempotency_key="post-43"))
    assert other is not None and other.pk != first.pk
    # Without a key, every send is its own.
    send(ALICE, NOTE, INBOXES)
    send(ALICE, NOTE, INBOXES)
    assert Batch.objects.count() == 4 and Delivery.objects.count() == 20


@pytest.mark.django_db
def test_once_its_batch_is_purged_a_key_sends_again() -> None:
    first = send(ALICE, NOTE, INBOXES[:1], idempotency_key="post-42")
    assert first is not None
    first.delete()
    second = send(ALICE, NOTE, INBOXES[:1], idempotency_key="post-42")
    assert second is not None and second.pk != first.pk
    assert Delivery.objects.get().batch_id == second.pk


@pytest.mark.django_db
def test_a_webhook_event_retried_with_its_key_is_queued_once(settings: Any) -> None:
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "WEBHOOKS": {
            "ops": "slack://hooks.slack.com/services/T0AAAA1/B0BBBB2/s3cretT0kenV4lue9",
            "audit": "markdown://hooks.example/audit/t0kenV4lue9abc",
        },
    }
    first = send_webhook("*", "deploy.done", {"n": 1}, idempotency_key="deploy-7")
    again = send_webhook("*", "deploy.done", {"n": 1}, idempotency_key="deploy-7")
    assert first is not None and again is not None and again.pk == first.pk
    assert Delivery.objects.count() == 2


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("key", "said"),
    [
        (42, "idempotency_key must be a string, not 42"),
        ("k" * 201, "idempotency_key is longer than 200 characters"),
        ("a\x00b", "idempotency_key must not contain NUL characters"),
    ],
)
def test_a_bad_key_is_refused_naming_it_with_nothing_written(key: Any, said: str) -> None:
    with pytest.raises(InvalidDelivery, match=said):
        send(ALICE, NOTE, INBOXES, idempotency_key=key)
    with pytest.raises(InvalidDelivery, match=said):
        send_webhook("ops", "deploy.done", {}, idempotency_key=key)
    assert not Batch.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_two_sends_with_one_key_at_once_queue_one_batch() -> None:
    if connection.vendor != "postgresql":
        pytest.skip("SQLite's writers take turns: no two sends are ever at once")
    inside = threading.Event()
    results: list[Batch | None] = []

    def first() -> None:
        try:
            with transaction.atomic():
                results.append(send(ALICE, NOTE, INBOXES, idempotency_key="post-42"))
                inside.set()
                # Held open while the other send waits on the key.
                threading.Event().wait(0.5)
        finally:
            close_old_connections()

    thread = threading.Thread(target=first)
    thread.start()
    assert inside.wait(10)
    with transaction.atomic():
        second = send(ALICE, NOTE, INBOXES, idempotency_key="post-42")
    thread.join(10)
    assert results[0] is not None and second is not None
    assert second.pk == results[0].pk
    assert Batch.objects.count() == 1 and Delivery.objects.count() == 5


@pytest.mark.django_db
def test_an_operator_finds_a_batch_by_its_key() -> None:
    from .test_admin import html, login, url

    send(ALICE, NOTE, INBOXES, idempotency_key="post-42")
    send(ALICE, NOTE, INBOXES, idempotency_key="post-420")
    operator = login("operator")
    found = html(operator, url("batch") + "?q=post-42")
    assert "1 result" in found
    batch = Batch.objects.get(idempotency_key="post-42")
    assert "post-42" in html(operator, url("batch", "change", batch.pk))
