"""Idempotent sends: the same key again, while its batch is kept, queues
nothing and returns the first batch; on both databases, and when two sends
with one key race."""

from __future__ import annotations

import datetime as dt
import re
import threading
from typing import Any

import pytest
from django.db import close_old_connections, connection, transaction
from django.utils import timezone

from django_federation_delivery import (
    BatchOptions,
    InvalidDelivery,
    availability,
    send,
    send_batch,
    send_webhook,
)
from django_federation_delivery.models import Batch, Delivery, Host

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


def _hosts_gone(settings: Any) -> list[str]:
    now = timezone.now()
    for n in range(len(INBOXES)):
        Host.objects.create(name=f"h{n}.example", failing_since=now, unavailable_since=now)
    availability.forget_known()
    return INBOXES


def _unusable(settings: Any) -> list[str]:
    return [inbox.replace("https:", "ftp:") for inbox in INBOXES]


def _too_many(settings: Any) -> list[str]:
    settings.FEDERATION_DELIVERY = {**settings.FEDERATION_DELIVERY, "MAX_INBOXES": 3}
    return INBOXES


@pytest.mark.django_db
@pytest.mark.parametrize("since", [_hosts_gone, _unusable, _too_many])
def test_a_send_retried_with_nothing_left_to_queue_still_returns_the_first_batch(
    since: Any, settings: Any
) -> None:
    # Retried once its inboxes are all left out (their hosts since marked
    # unavailable, or each unusable) or too many, the send once returned
    # None, or raised, where the first batch is kept.
    first = send(ALICE, NOTE, INBOXES, idempotency_key="post-42")
    inboxes = since(settings)
    again = send(ALICE, NOTE, inboxes, idempotency_key="post-42")
    assert first is not None and again is not None
    assert (again.pk, again.created, again.size) == (first.pk, False, 5)
    assert Batch.objects.count() == 1 and Delivery.objects.count() == 5
    # Without a batch kept under the key, it is what a send without one is.
    if since is _too_many:
        with pytest.raises(InvalidDelivery, match="more than MAX_INBOXES"):
            send(ALICE, NOTE, inboxes, idempotency_key="post-43")
    else:
        assert send(ALICE, NOTE, inboxes, idempotency_key="post-43") is None
    assert Batch.objects.count() == 1


@pytest.mark.django_db
def test_a_send_retried_past_the_deadline_it_was_given_returns_the_first_batch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A view's client retried once the deadline the view gives (an absolute
    # time) had passed: InvalidDelivery "deadline ... is already past", where
    # the first batch was kept under the key.
    from django_federation_delivery import sending

    deadline = timezone.now() + dt.timedelta(minutes=5)
    options = BatchOptions(idempotency_key="post-42", deadline=deadline)
    first = send_batch(ALICE, NOTE, INBOXES, options)
    later = deadline + dt.timedelta(seconds=1)
    monkeypatch.setattr(sending, "aware_now", lambda: later)
    again = send_batch(ALICE, NOTE, INBOXES, options)
    assert first is not None and again is not None
    assert (again.pk, again.created) == (first.pk, False)
    assert Batch.objects.count() == 1
    # Without a batch kept under the key, it is refused.
    other = BatchOptions(idempotency_key="post-43", deadline=deadline)
    with pytest.raises(InvalidDelivery, match="is already past"):
        send_batch(ALICE, NOTE, INBOXES, other)


@pytest.mark.django_db
def test_a_webhook_retried_once_its_destination_s_url_broke_returns_the_first_batch(
    settings: Any,
) -> None:
    # A destination whose URL no longer parses raised ImproperlyConfigured
    # (a 500) at the retry, where the first batch was kept under the key.
    from django.core.exceptions import ImproperlyConfigured

    hooks = {"tg": "telegram://4815162342:ABCsecretBotToken_x@-1001"}
    settings.FEDERATION_DELIVERY = {**settings.FEDERATION_DELIVERY, "WEBHOOKS": hooks}
    first = send_webhook("tg", "deploy.done", {"n": 1}, idempotency_key="deploy-7")
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "WEBHOOKS": {"tg": "telegram://not-a-token"},
    }
    again = send_webhook("tg", "deploy.done", {"n": 1}, idempotency_key="deploy-7")
    assert first is not None and again is not None and again.pk == first.pk
    with pytest.raises(ImproperlyConfigured):
        send_webhook("tg", "deploy.done", {"n": 1}, idempotency_key="deploy-8")


@pytest.mark.django_db
def test_a_webhook_retried_once_the_kinds_broke_raises_the_settings_error(
    settings: Any,
) -> None:
    # Only the destination's own URL is the retry's to forgive: CHANNELS
    # broken for every destination was hidden behind the kept batch.
    from django.core.exceptions import ImproperlyConfigured

    hooks = {"ops": "slack://hooks.slack.com/services/T0AAAA1/B0BBBB2/s3cretT0kenV4lue9"}
    settings.FEDERATION_DELIVERY = {**settings.FEDERATION_DELIVERY, "WEBHOOKS": hooks}
    assert send_webhook("ops", "deploy.done", {"n": 1}, idempotency_key="deploy-7") is not None
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "CHANNELS": ["no_such_module.Kind"],
    }
    with pytest.raises(ImproperlyConfigured):
        send_webhook("ops", "deploy.done", {"n": 1}, idempotency_key="deploy-7")


@pytest.mark.django_db
@pytest.mark.parametrize("key", ["2024:annual-report-2024", "welcome_mail_bob@example.com"])
def test_a_key_held_by_the_other_kind_of_send_is_named_whole(settings: Any, key: str) -> None:
    # Quoted as a destination's name is, for the tokens one may be taken for,
    # the key was shown '…' or 'example.com/…': not which of them clashed.
    hooks = {"ops": "slack://hooks.slack.com/services/T0AAAA1/B0BBBB2/s3cretT0kenV4lue9"}
    settings.FEDERATION_DELIVERY = {**settings.FEDERATION_DELIVERY, "WEBHOOKS": hooks}
    assert send(ALICE, NOTE, INBOXES[:1], idempotency_key=key) is not None
    with pytest.raises(InvalidDelivery) as refused:
        send_webhook("ops", "report.published", {"n": 1}, idempotency_key=key)
    assert str(refused.value).startswith(f"idempotency_key {key!r} is held by")


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
def test_a_webhook_event_retried_to_no_subscribed_destination_returns_the_first_batch(
    settings: Any,
) -> None:
    slack = "slack://hooks.slack.com/services/T0AAAA1/B0BBBB2/s3cretT0kenV4lue9"
    settings.FEDERATION_DELIVERY = {**settings.FEDERATION_DELIVERY, "WEBHOOKS": {"ops": slack}}
    first = send_webhook("ops", "deploy.done", {"n": 1}, idempotency_key="deploy-7")
    # Since subscribed to alerts only: the retry is sent to no destination.
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "WEBHOOKS": {"ops": slack + "?events=alert.*"},
    }
    again = send_webhook("ops", "deploy.done", {"n": 1}, idempotency_key="deploy-7")
    assert first is not None and again is not None
    assert (again.pk, again.created) == (first.pk, False)
    assert Delivery.objects.count() == 1
    assert send_webhook("ops", "deploy.done", {"n": 1}, idempotency_key="deploy-8") is None


SLACK = "slack://hooks.slack.com/services/T0AAAA1/B0BBBB2/s3cretT0kenV4lue9"


def _activity(inboxes: list[str] = INBOXES) -> Batch | None:
    return send(ALICE, NOTE, inboxes, idempotency_key="post-1")


def _webhook(destination: str = "ops") -> Batch | None:
    return send_webhook(destination, "post.created", {"id": 1}, idempotency_key="post-1")


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("first", "then", "held_by"),
    [
        (_activity, _webhook, "an activity's batch"),
        (_webhook, _activity, "a webhook event's batch"),
        # Retried with nothing left to queue: returned the other kind's batch.
        (_activity, lambda: _webhook("quiet"), "an activity's batch"),
        (_webhook, lambda: _activity(["ftp://a.example/inbox"]), "a webhook event's batch"),
        (
            _webhook,
            lambda: _activity([*INBOXES, "https://late.example/inbox"]),
            "a webhook event's batch",
        ),
    ],
    ids=[
        "webhook-after-activity",
        "activity-after-webhook",
        "webhook-to-none",
        "activity-to-none",
        "activity-too-many",
    ],
)
def test_a_key_held_by_the_other_kind_of_send_is_refused_naming_it_with_nothing_written(
    settings: Any, first: Any, then: Any, held_by: str
) -> None:
    # One view federates a post and announces it, each keyed by the post:
    # the webhook event was silently dropped, send_webhook returning the
    # activity's batch as if it were the event's.
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "WEBHOOKS": {"ops": SLACK, "quiet": {"url": SLACK, "events": ["alert.*"]}},
        "MAX_INBOXES": len(INBOXES),
    }
    kept = first()
    assert kept is not None
    before = list(Delivery.objects.values_list("id", flat=True))
    with pytest.raises(InvalidDelivery) as refused:
        then()
    assert str(refused.value).startswith(f"idempotency_key 'post-1' is held by {held_by}")
    assert list(Batch.objects.values_list("id", flat=True)) == [kept.pk]
    assert list(Delivery.objects.values_list("id", flat=True)) == before
    # The same kind of send is returned the kept batch, as ever.
    again = first()
    assert again is not None and (again.pk, again.created) == (kept.pk, False)


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("first", [_activity, _webhook], ids=["activity", "webhook"])
def test_a_key_refused_as_held_by_the_other_kind_leaves_the_callers_transaction_usable(
    settings: Any, first: Any
) -> None:
    settings.FEDERATION_DELIVERY = {**settings.FEDERATION_DELIVERY, "WEBHOOKS": {"ops": SLACK}}
    first()
    with transaction.atomic():
        with pytest.raises(InvalidDelivery, match="post-1"):
            _webhook() if first is _activity else _activity()
        # The refusal raised as any bad argument does: the caller goes on.
        batch = send(ALICE, NOTE, INBOXES[:1], idempotency_key="post-2")
    assert batch is not None
    assert Batch.objects.filter(idempotency_key="post-2").exists()


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("key", "said"),
    [
        (42, "idempotency_key must be a string, not 42"),
        # No string, if falsy: refused, never taken for no key ("" alone is).
        (0, "idempotency_key must be a string, not 0"),
        (False, "idempotency_key must be a string, not False"),
        (b"", "idempotency_key must be a string, not b''"),
        ((), "idempotency_key must be a string, not ()"),
        (None, "idempotency_key must be a string, not None"),
        ("k" * 201, "idempotency_key is longer than 200 characters"),
        ("a\x00b", "idempotency_key must not contain NUL characters"),
    ],
)
def test_a_bad_key_is_refused_naming_it_with_nothing_written(key: Any, said: str) -> None:
    for sent in (
        lambda: send(ALICE, NOTE, INBOXES, idempotency_key=key),
        lambda: send_batch(ALICE, NOTE, INBOXES, {"idempotency_key": key}),
        lambda: send_webhook("ops", "deploy.done", {}, idempotency_key=key),
    ):
        with pytest.raises(InvalidDelivery, match=re.escape(said)):
            sent()
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


@pytest.mark.django_db
def test_a_webhook_event_retried_after_its_destination_left_the_settings_returns_its_batch(
    settings: Any,
) -> None:
    # README: "Whatever the retry is given ... returns the kept batch too, not
    # None or an error", as a send's retry with more than MAX_INBOXES does.
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "WEBHOOKS": {"ops": SLACK, "old": SLACK},
    }
    first = send_webhook("old", "deploy.done", {"n": 1}, idempotency_key="deploy-7")
    assert first is not None
    settings.FEDERATION_DELIVERY = {**settings.FEDERATION_DELIVERY, "WEBHOOKS": {"ops": SLACK}}
    try:
        again = send_webhook("old", "deploy.done", {"n": 1}, idempotency_key="deploy-7")
    except Exception as exc:
        pytest.fail(f"the retry raised {type(exc).__name__}: {exc}; batch {first.pk} is kept")
    assert again is not None and (again.pk, again.created) == (first.pk, False)
