"""The loop's looks for work while it is idle or busy, and the urgent lanes' share of a host."""

from __future__ import annotations

import datetime as dt
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from django.db import OperationalError, connection, transaction
from django.utils import timezone

from django_federation_delivery import send
from django_federation_delivery.deliverer import Deliverer
from django_federation_delivery.models import Delivery
from django_federation_delivery.store import claims

from .conftest import Inbox, Received, RunningDeliverer, sent_in_an_open_transaction, wait_until
from .keys import ALICE

pytestmark = pytest.mark.django_db(transaction=True)

POST = f"{ALICE}/notes/1"
NOTE_OF_ALICE = {"type": "Create", "actor": ALICE}


def create(obj: Any = POST) -> dict[str, Any]:
    return {"type": "Create", "id": f"{ALICE}/activities/1", "actor": ALICE, "object": obj}


def delete(obj: Any = POST) -> dict[str, Any]:
    return {"type": "Delete", "id": f"{ALICE}/activities/d", "actor": ALICE, "object": obj}


def test_an_idle_deliverer_does_not_spin_claiming_rows_a_retraction_being_written_holds(
    inbox: Inbox,
) -> None:
    """A web request deletes a post (its ``Delete`` sent in the request's
    transaction, which runs on for a moment). An idle deliverer on PostgreSQL
    claimed in a tight loop meanwhile: each claim, a write transaction,
    passed the rows the retraction locked (SKIP LOCKED) and found nothing,
    and the next read said they were still due, with no wait in between."""
    from django.test.utils import CaptureQueriesContext

    if connection.vendor != "postgresql":
        pytest.skip("only PostgreSQL's claim passes locked rows (SKIP LOCKED)")
    inboxes = [inbox.url(f"/{n}") for n in range(3)]
    send(ALICE, create(), inboxes)
    # The Delete supersedes the Create's rows, locked until its request ends.
    with (
        sent_in_an_open_transaction(ALICE, delete(), inboxes),
        CaptureQueriesContext(connection) as queries,
    ):
        Deliverer().run(stop_after=1.0)
    claims = [q["sql"] for q in queries.captured_queries if "SKIP LOCKED" in q["sql"]]
    # An idle loop that found nothing claimable waits: for a result, a wake,
    # or at least NEW_WORK_POLL_SECONDS (0.1 s) before it looks again.
    assert len(claims) <= 12, f"{len(claims)} claims in 1 s"


class TakesAtMost:
    """A host that takes ``most`` requests at once: one more is answered 429
    at once; each taken is answered 202 after ``delay``."""

    def __init__(self, most: int, delay: float) -> None:
        self.most = most
        self.delay = delay
        self.lock = threading.Lock()
        self.now = 0
        self.refused: list[tuple[float, str]] = []
        #: The most at once since the first refusal.
        self.most_after_refusal = 0

    def __call__(self, request: Received) -> tuple[int, dict[str, str], bytes]:
        with self.lock:
            self.now += 1
            if self.refused:
                self.most_after_refusal = max(self.most_after_refusal, self.now)
            if self.now > self.most:
                self.refused.append((time.monotonic(), request.path))
                self.now -= 1
                return 429, {}, b""
        time.sleep(self.delay)
        with self.lock:
            self.now -= 1
        return 202, {}, b""


@pytest.mark.parametrize(
    ("per_host", "takes"),
    [(1, 1), (2, 3)],
    ids=["per-host-1-halved-to-1", "default-per-host-halved-to-2"],
)
@pytest.mark.slow
def test_a_host_that_refused_is_not_sent_as_many_at_once_again_by_the_urgent_lanes(
    inboxes: Callable[..., Inbox],
    start_deliverer: Callable[..., RunningDeliverer],
    settings: Any,
    per_host: int,
    takes: int,
) -> None:
    """A host takes ``takes`` requests at once. It answered well, its limit
    grew, and it answered 429 to one past what it takes: its limit is halved
    (to 1 from 2 with ``--per-host 1``; to 2 from 4 or 5 with the default
    ``PER_HOST`` of 2), and it is sent no more than that until it has grown
    back. The urgent lanes kept a limit of their own there, the halved limit
    not being below ``PER_HOST``: direct messages went beside the fan-out,
    the host was sent as many at once as it had just refused, and they met
    429s."""
    settings.FEDERATION_DELIVERY = {**settings.FEDERATION_DELIVERY, "PRIORITY_MAX_INBOXES": 1}
    host = TakesAtMost(takes, 0.3)
    big = inboxes("127.0.0.31", respond=host)
    runner = start_deliverer(concurrency=16, per_host=per_host, per_host_max=8)
    # A fan-out there: the host answers well, its limit grows, until it
    # refuses one past what it takes.
    send(ALICE, create(), [big.url(f"/u{n}") for n in range(60)])
    wait_until(lambda: bool(host.refused), timeout=20)
    for n in range(6):
        send(ALICE, {"type": "Create", "to": f"dm{n}"}, [big.url(f"/dm{n}")])
    time.sleep(3.0)
    runner.stop()
    refused_dms = [path for _, path in host.refused if path.startswith("/dm")]
    assert host.most_after_refusal <= takes, (host.most_after_refusal, host.refused)
    assert not refused_dms, refused_dms


def test_a_direct_message_from_another_process_is_not_left_for_a_second_by_a_busy_deliverer(
    inboxes: Callable[..., Inbox],
    start_deliverer: Callable[..., RunningDeliverer],
    settings: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """PostgreSQL. A deliverer busy with a fan-out (its LISTEN paused, as its
    claims come back full) looks for urgent work every 0.1 s; a direct
    message to a slow host is due but left out (that host at its limit), so
    its urgent claims find nothing and it looks only for what came due since,
    all of it again a pass later. A web process sends a direct message to
    another host in its request's transaction, committed a moment after one
    of those urgent claims: its due time is before that claim, and no wake
    comes. It waited for the pass; it is claimed at the next look."""
    if connection.vendor != "postgresql":
        pytest.skip("on SQLite a claim waits for the send's write lock")
    from django_federation_delivery.store import claims, wakes

    settings.FEDERATION_DELIVERY = {**settings.FEDERATION_DELIVERY, "PRIORITY_MAX_INBOXES": 1}
    slow = inboxes("127.0.0.41", delay=8.0)
    fast = inboxes("127.0.0.42")
    fan = [inboxes(f"127.0.0.{50 + n}", delay=2.0) for n in range(10)]
    for n in range(3):
        send(ALICE, {"type": "Create", "to": f"s{n}"}, [slow.url(f"/s{n}")])
    send(ALICE, create(), [sink.url(f"/u{n}") for sink in fan for n in range(8)])
    empty_urgent: list[float] = []
    dm_claimed: list[float] = []
    real_claim = claims.claim

    def claim(*args: Any, **kwargs: Any) -> Any:
        got = real_claim(*args, **kwargs)
        if kwargs.get("lanes") == claims.URGENT and got == []:
            empty_urgent.append(time.monotonic())
        if any(row.inbox.endswith("/dm") for row in got or []):
            dm_claimed.append(time.monotonic())
        return got

    monkeypatch.setattr(claims, "claim", claim)
    # A pass over what is left out three times as long: what waited for it
    # waited seconds, not a look.
    from django_federation_delivery import intake as intake_module

    monkeypatch.setattr(intake_module, "HOLD_PASS_SECONDS", 3.0)
    # The web process is another process: no wake in this one.
    monkeypatch.setattr(wakes, "notify_local", lambda: None)
    runner = start_deliverer(concurrency=4, claim_size=8)
    intake = runner.deliverer.intake
    wait_until(lambda: len(slow.received) == 2 and bool(empty_urgent), timeout=20)
    wait_until(lambda: intake._listener is not None and not intake._listener.listening)
    sent, release = threading.Event(), threading.Event()
    committed: list[float] = []

    def request() -> None:
        from django.db import connection as own

        try:
            with transaction.atomic():
                send(ALICE, {"type": "Create", "to": "friend"}, [fast.url("/dm")])
                sent.set()
                release.wait(10)
            committed.append(time.monotonic())
        finally:
            own.close()

    web = threading.Thread(target=request)
    web.start()
    assert sent.wait(10)
    # Urgent looks made meanwhile, the direct message written due before them.
    time.sleep(0.5)
    release.set()
    web.join(10)
    wait_until(lambda: bool(dm_claimed), timeout=10)
    took = dm_claimed[0] - committed[0]
    runner.stop()
    assert took < 1.5, f"the direct message was claimed {took:.2f} s after its commit"


@pytest.mark.slow
def test_a_direct_message_whose_batch_read_failed_once_goes_with_the_next_claim(
    inboxes: Callable[..., Inbox],
    start_deliverer: Callable[..., RunningDeliverer],
    settings: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A busy deliverer's urgent look claims a direct message; reading its
    batch meets the database away for a moment, and it is kept to be
    sorted at the next turn. The ordinary claim of the same turn takes a
    fan-out's deliveries and sorts them with it: the message is sent, not
    forgotten under its lease (300 s) for minutes."""
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "PRIORITY_MAX_INBOXES": 1,
        "CONCURRENCY": 2,
    }
    slow = inboxes(delay=6.0)
    fan = inboxes("127.0.0.2")
    # The direct message goes to the host the fan-out keeps at its limit:
    # the urgent look alone may claim it (the urgent lanes' limit of their own).
    dm = slow
    real = claims.batches
    dm_batch: list[int] = []
    failed = threading.Event()

    def batches(ids: Any, **kwargs: Any) -> Any:
        if dm_batch and dm_batch[0] in set(ids) and not failed.is_set():
            failed.set()
            raise OperationalError("the database went away for a moment")
        return real(ids, **kwargs)

    monkeypatch.setattr(claims, "batches", batches)
    runner = start_deliverer()
    # Two to a slow host keep the deliverer busy (in flight, nothing ready).
    send(ALICE, NOTE_OF_ALICE, [slow.url("/s1"), slow.url("/s2")])
    wait_until(lambda: len(slow.received) == 2, timeout=20)
    with transaction.atomic():
        batch = send(ALICE, NOTE_OF_ALICE, [dm.url("/dm")])
        dm_batch.append(batch.id)
        fanned = send(ALICE, NOTE_OF_ALICE, [fan.url(f"/f{n}") for n in range(4)])
        # The message due in a moment, the fan-out's a little after it.
        at = timezone.now() + dt.timedelta(seconds=0.6)
        Delivery.objects.filter(batch=batch).update(due_at=at)
        Delivery.objects.filter(batch=fanned).update(due_at=at + dt.timedelta(seconds=0.15))
    try:
        wait_until(lambda: failed.is_set(), timeout=10)
        wait_until(lambda: len(fan.received) == 4, timeout=20)
        deadline = time.monotonic() + 8
        while time.monotonic() < deadline and "/dm" not in dm.paths():
            time.sleep(0.05)
        row = Delivery.objects.get(batch_id=batch.id)
        assert "/dm" in dm.paths(), (
            f"the direct message was not sent within 8 s of the database's "
            f"moment away; its row: status={row.status}, due in "
            f"{(row.due_at - timezone.now()).total_seconds():.0f} s (its lease)"
        )
    finally:
        runner.stop()
