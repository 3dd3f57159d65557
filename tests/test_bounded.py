"""A deliverer that runs for weeks keeps bounded state: what it holds of
hosts, batches and connections is forgotten once no longer needed."""

from __future__ import annotations

import base64
import gc
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from django.db import OperationalError

from django_federation_delivery import send, send_webhook, wakeup
from django_federation_delivery.deliverer import Deliverer
from django_federation_delivery.models import Delivery, Status
from django_federation_delivery.slots import InHand
from django_federation_delivery.webhooks.deliveries import WebhookDeliveries
from django_federation_delivery.workers import InFlight

from .conftest import Inbox, RunningDeliverer, wait_until
from .keys import ALICE

pytestmark = pytest.mark.django_db(transaction=True)

SECRET = "whsec_" + base64.b64encode(b"k" * 32).decode()
NOTE = {"@context": "https://www.w3.org/ns/activitystreams", "type": "Create", "actor": ALICE}


def quiet(runner: RunningDeliverer) -> Callable[[], bool]:
    deliverer = runner.deliverer
    return lambda: not deliverer.slots.busy and not deliverer.outbox and not deliverer._untold


BODY = 256_000


def delivered_then_idle(start_deliverer: Callable[..., RunningDeliverer], count: int) -> Deliverer:
    """A deliverer that has delivered ``count`` and has been idle a second:
    every batch finished, told and forgotten."""
    runner = start_deliverer()
    wait_until(
        lambda: Delivery.objects.filter(status=Status.DELIVERED).count() == count, timeout=60
    )
    wait_until(quiet(runner))
    time.sleep(1.0)
    deliverer = runner.deliverer
    assert not deliverer._batches._known, "finished batches are forgotten"
    return deliverer


def big_note(n: int) -> dict[str, Any]:
    return {**NOTE, "id": f"https://social.example/notes/{n}", "content": "x" * BODY}


def test_a_retried_batch_is_not_kept_in_memory_once_none_of_its_rows_is_in_hand(
    inboxes: Callable[..., Inbox],
    start_deliverer: Callable[..., RunningDeliverer],
    settings: Any,
) -> None:
    """Step 5 of docs/architecture.md: a claimed row's batch is "kept while
    its rows are in hand". A delivery that fails and waits for its retry (an
    hour on) is in hand no longer; its batch, body and all, should go."""
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "RETRY": {"BASE": 3600.0, "CAP": 3600.0, "ATTEMPTS": 5, "JITTER": 0},
        "NEW_WORK_POLL_SECONDS": 0.05,
    }
    down = inboxes(respond=lambda request: (500, {}, b"down"))
    count = 40
    for n in range(count):
        send(ALICE, big_note(n), [down.url(f"/inbox/{n}")])
    runner = start_deliverer()
    wait_until(
        lambda: Delivery.objects.filter(attempts=1, lease_token__isnull=True).count() == count,
        timeout=60,
    )
    wait_until(quiet(runner))
    time.sleep(1.0)  # idle
    deliverer = runner.deliverer
    assert deliverer.in_hand().ready == deliverer.in_hand().in_flight == ()
    kept = dict(deliverer._batches._known)
    held = sum(len(batch.body) for batch in kept.values())
    assert len(kept) == 0, (
        f"nothing in hand, yet {len(kept)} batches kept with {held:,} bytes of bodies "
        f"(up to MOST_KNOWN=1000 of MAX_BODY_BYTES=1 MiB each)"
    )


def test_a_finished_webhook_event_is_not_kept_in_memory(
    inbox: Inbox,
    start_deliverer: Callable[..., RunningDeliverer],
    settings: Any,
) -> None:
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "WEBHOOKS": {"ops": f"http://127.0.0.1:{inbox.port}/hook?secret={SECRET}"},
        "NEW_WORK_POLL_SECONDS": 0.05,
    }
    count = 20
    for n in range(count):
        send_webhook("ops", "alert.raised", {"n": n, "pad": "x" * BODY})
    deliverer = delivered_then_idle(start_deliverer, count)
    (webhooks,) = [kind for kind in deliverer.kinds if isinstance(kind, WebhookDeliveries)]
    events = dict(webhooks._events)
    assert len(events) == 0, (
        f"every batch finished, yet {len(events)} parsed events are kept "
        f"(each with its {BODY:,}-character payload)"
    )


def never_skip(inbox: str, activity: Any) -> bool:
    return False


def test_a_finished_activity_parsed_for_skip_if_is_not_kept_in_memory(
    inbox: Inbox,
    start_deliverer: Callable[..., RunningDeliverer],
    settings: Any,
) -> None:
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "SKIP_IF": never_skip,
        "NEW_WORK_POLL_SECONDS": 0.05,
    }
    count = 20
    for n in range(count):
        send(ALICE, big_note(n), [inbox.url(f"/inbox/{n}")])
    deliverer = delivered_then_idle(start_deliverer, count)
    activities = dict(deliverer.kinds.fallback._activities)
    assert len(activities) == 0, (
        f"every batch finished, yet {len(activities)} parsed activities are kept "
        f"(each with its {BODY:,}-character content)"
    )


def cannot_connect(self: wakeup.PostgresListener) -> None:
    raise OperationalError("FATAL: sorry, too many clients already")


def test_pausing_a_listener_that_cannot_connect_never_blocks_the_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """While the listener's connection cannot be had, the loop goes on
    (looking for new work itself); each claim still tells it to pause or
    listen again, a byte a change, which nobody reads meanwhile."""
    monkeypatch.setattr(wakeup.PostgresListener, "_connect", cannot_connect)
    listener = wakeup.PostgresListener(threading.Event())
    listener.start()
    turns = [0]

    def claims() -> None:
        # A full claim, then one that found nothing: as a burst of work does.
        for n in range(1000):
            listener.pause(n % 2 == 0)
            turns[0] += 1

    loop = threading.Thread(target=claims, daemon=True)
    loop.start()
    loop.join(5)
    blocked, done = loop.is_alive(), turns[0]
    listener.stop()  # closes the socket pair: a send blocked in it fails, and returns
    loop.join(5)
    assert not blocked, (
        f"the loop's pause() blocked for good after {done} changes, the listener "
        "not connected to read them"
    )


@pytest.mark.skipif(
    "DATABASE_URL" not in os.environ, reason="LISTEN/NOTIFY is PostgreSQL's (with psycopg 3)"
)
def test_a_deliverer_whose_listener_cannot_connect_goes_on_delivering(
    inbox: Inbox,
    start_deliverer: Callable[..., RunningDeliverer],
    settings: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(wakeup.PostgresListener, "_connect", cannot_connect)
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "CLAIM_SIZE": 1,
        "NEW_WORK_POLL_SECONDS": 0.05,
    }
    runner = start_deliverer()
    delivered = 0
    try:
        for n in range(300):
            send(ALICE, NOTE, [inbox.url(f"/inbox/{n}")])
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                if Delivery.objects.filter(status=Status.DELIVERED).count() > n:
                    break
                time.sleep(0.01)
            else:
                break
            delivered += 1
    finally:
        listener = runner.deliverer.intake._listener
        if listener is not None:
            # Should the loop block on it again: a send then fails, so that
            # the deliverer can be stopped and the test ends.
            listener._turn_reader.close()
    assert delivered == 300, (
        f"the deliverer stopped delivering after {delivered} sends: its loop is "
        "blocked telling the listener, which cannot connect, to pause"
    )


def test_settled_deliveries_are_not_kept_by_the_idle_workers(
    inbox: Inbox,
    start_deliverer: Callable[..., RunningDeliverer],
    settings: Any,
) -> None:
    settings.FEDERATION_DELIVERY = {**settings.FEDERATION_DELIVERY, "NEW_WORK_POLL_SECONDS": 0.05}
    count = 40
    for n in range(count):
        send(ALICE, big_note(n), [inbox.url(f"/inbox/{n}")])
    deliverer = delivered_then_idle(start_deliverer, count)
    assert deliverer.in_hand() == InHand((), ())
    gc.collect()
    # This deliverer's: a traceback an earlier test kept (its frames) may hold another's.
    mine = inbox.url("/inbox/")
    kept = [
        item
        for item in gc.get_objects()
        if isinstance(item, InFlight) and item.claimed.inbox.startswith(mine)
    ]
    held = sum(len(item.batch.body) for item in kept)
    assert len(kept) == 0, (
        f"nothing in hand, yet {len(kept)} settled deliveries are still referenced, with "
        f"{held:,} bytes of bodies (each idle worker thread's last, Workers._work's ``item``)"
    )
