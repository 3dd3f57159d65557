"""The loop end to end: real inboxes on loopback, the real database."""

from __future__ import annotations

import collections
import datetime as dt
import email.utils
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpsig
import pytest
from django.db import OperationalError, connection, connections, transaction
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.backends.signals import connection_created
from django.utils import timezone

from django_federation_delivery import (
    BatchOptions,
    controls,
    send,
    send_batch,
    send_webhook,
    signals,
    wakeup,
)
from django_federation_delivery.addresses import quoted
from django_federation_delivery.conf import LEASE_MARGIN_SECONDS
from django_federation_delivery.deliverer import STOPPING_GRACE, Deliverer
from django_federation_delivery.models import Batch, Delivery, Host, Status
from django_federation_delivery.retry import LONGEST_WAIT
from django_federation_delivery.settling import Summary
from django_federation_delivery.store import CLAIM_ORDER, claims, settlements
from django_federation_delivery.transport import status_text
from django_federation_delivery.upkeep import RECYCLE_EVERY
from django_federation_delivery.writelock import PromptWriteLock

from .conftest import Inbox, Received, RunningDeliverer, wait_until
from .keys import ALICE, BROKEN, EDNA, rsa_key
from .operators import open_breaker, quick_breaker

pytestmark = pytest.mark.django_db(transaction=True)

NOTE = {"@context": "https://www.w3.org/ns/activitystreams", "type": "Create", "actor": ALICE}


def public_pem() -> str:
    from cryptography.hazmat.primitives import serialization

    return (
        rsa_key()
        .public_key()
        .public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
        .decode()
    )


def verifies(request: Received, body: bytes | None = None) -> bool:
    """Checks the draft-cavage signature as a receiving server would, with
    pyhttpsig, and the Digest against the body."""
    import base64
    import hashlib

    body = request.body if body is None else body
    digest = "SHA-256=" + base64.b64encode(hashlib.sha256(body).digest()).decode()
    if request.headers.get("Digest") != digest:
        return False
    verifier = httpsig.HeaderVerifier(
        headers=request.headers,
        secret=public_pem(),
        method="POST",
        path=request.path,
        required_headers=["(request-target)", "host", "date", "digest", "content-type"],
        sign_header="signature",
    )
    return bool(verifier.verify())


def status_of(batch: Batch | None) -> list[str]:
    assert batch is not None
    return list(
        Delivery.objects.filter(batch=batch).order_by("id").values_list("status", flat=True)
    )


def settled(batch: Batch | None, count: int | None = None) -> Callable[[], bool]:
    assert batch is not None
    expected = count if count is not None else batch.size

    def check() -> bool:
        return (
            Delivery.objects.filter(batch=batch).exclude(status=Status.PENDING).count() >= expected
        )

    return check


@pytest.fixture
def received_signals() -> Iterator[dict[str, list[Any]]]:
    seen: dict[str, list[Any]] = {"attempted": [], "settled": [], "failed": [], "finished": []}

    def attempted(sender: Any, attempt: Any, **kwargs: Any) -> None:
        seen["attempted"].append(attempt)

    def settled_(sender: Any, settled: Any, **kwargs: Any) -> None:
        seen["settled"].append(settled)

    def failed(sender: Any, failure: Any, **kwargs: Any) -> None:
        seen["failed"].append(failure)

    def finished(sender: Any, batch: Any, **kwargs: Any) -> None:
        seen["finished"].append(batch.id)

    pairs = [
        (signals.delivery_attempted, attempted),
        (signals.delivery_settled, settled_),
        (signals.delivery_failed, failed),
        (signals.batch_finished, finished),
    ]
    for signal, receiver in pairs:
        signal.connect(receiver, weak=False)
    yield seen
    for signal, receiver in pairs:
        signal.disconnect(receiver)


def fast_retries(settings: Any, **retry: Any) -> None:
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "RETRY": {"BASE": 0.1, "CAP": 0.2, "ATTEMPTS": 3, "JITTER": 0, **retry},
        "NEW_WORK_POLL_SECONDS": 0.05,
    }


def test_an_activity_is_delivered_signed_as_mastodon_signs(
    inbox: Inbox,
    start_deliverer: Callable[..., RunningDeliverer],
    received_signals: dict[str, list[Any]],
) -> None:
    inbox.respond = lambda request: (202, {}, b"") if verifies(request) else (401, {}, b"bad")
    batch = send(ALICE, NOTE, [inbox.url()])
    runner = start_deliverer()
    wait_until(settled(batch))
    runner.stop()
    assert status_of(batch) == [Status.DELIVERED]
    request = inbox.received[0]
    assert request.json() == NOTE
    assert request.headers["Content-Type"] == "application/activity+json"
    assert "application/activity+json" in request.headers["Accept"]
    assert request.headers["User-Agent"].startswith("django-federation-delivery/")
    signature = request.headers["Signature"]
    assert f'keyId="{ALICE}#main-key"' in signature
    assert 'algorithm="rsa-sha256"' in signature
    assert 'headers="(request-target) host date digest content-type"' in signature
    assert verifies(request)
    assert not verifies(request, body=request.body.replace(b"Create", b"Delete")), (
        "a tampered body is rejected by the verifier"
    )
    row = Delivery.objects.get()
    assert (row.attempts, row.last_status, row.lease_token) == (1, 202, None)
    assert [s.outcome for s in received_signals["settled"]] == ["delivered"]
    assert [a.outcome for a in received_signals["attempted"]] == ["delivered"]
    assert received_signals["finished"] == [batch.id]


def test_a_refusal_is_final_and_reported_with_its_status(
    inbox: Inbox,
    start_deliverer: Callable[..., RunningDeliverer],
    received_signals: dict[str, list[Any]],
) -> None:
    inbox.respond = lambda request: (410, {}, b"Gone " + b"x" * 1000)
    batch = send(ALICE, NOTE, [inbox.url()])
    runner = start_deliverer()
    wait_until(settled(batch))
    runner.stop()
    row = Delivery.objects.get()
    assert (row.status, row.last_status, row.attempts) == (Status.REFUSED, 410, 1)
    assert row.last_error.startswith("the inbox answered 410 Gone: Gone xxx")
    assert len(row.last_error) == 300
    assert len(inbox.received) == 1
    (failure,) = received_signals["failed"]
    assert (failure.status, failure.refused, failure.deadline) == (410, True, False)
    assert [(s.outcome, s.status) for s in received_signals["settled"]] == [("refused", 410)]


@pytest.mark.parametrize(
    ("status", "retry_after", "at_least", "at_most"),
    [
        (503, "120", 119, 121),
        (429, None, 0.05, 0.2),
        (503, "99999", 3599, 3601),
        (500, "http-date", 295, 301),
    ],
)
def test_a_passing_failure_is_retried_waiting_as_long_as_asked_within_an_hour(
    inbox: Inbox,
    start_deliverer: Callable[..., RunningDeliverer],
    settings: Any,
    status: int,
    retry_after: str | None,
    at_least: float,
    at_most: float,
) -> None:
    fast_retries(settings, ATTEMPTS=5)
    if retry_after == "http-date":
        retry_after = email.utils.formatdate(time.time() + 300, usegmt=True)
    headers = {"Retry-After": retry_after} if retry_after else {}
    calls: list[int] = []

    def respond(request: Received) -> tuple[int, dict[str, str], bytes]:
        calls.append(1)
        return (status, headers, b"later") if len(calls) == 1 else (202, {}, b"")

    inbox.respond = respond
    batch = send(ALICE, NOTE, [inbox.url()])
    runner = start_deliverer()
    wait_until(lambda: Delivery.objects.filter(attempts__gte=1).exists())
    if at_most > 1:
        runner.stop()
        row = Delivery.objects.get()
        assert (row.status, row.last_status) == (Status.PENDING, status)
        assert row.last_error == f"the inbox answered {status_text(status)}: later"
        assert row.last_attempt_at is not None and row.due_at is not None
        wait = (row.due_at - row.last_attempt_at).total_seconds()
        assert at_least <= wait <= at_most
    else:
        wait_until(settled(batch))
        runner.stop()
        assert status_of(batch) == [Status.DELIVERED]
        assert Delivery.objects.get().attempts == 2


@pytest.mark.django_db(transaction=True)
def test_a_redirect_to_a_location_that_does_not_read_is_the_inbox_s_answer(
    inbox: Inbox, start_deliverer: Callable[..., RunningDeliverer]
) -> None:
    # A Location that is not UTF-8 made the attempt crash: the row said
    # "internal error: UnicodeDecodeError" and had no status, and the host
    # was counted as giving no answer at all.
    inbox.respond = lambda request: (302, {"Location": "/\xff"}, b"moved")
    send(ALICE, NOTE, [inbox.url()])
    runner = start_deliverer()
    wait_until(lambda: Delivery.objects.filter(attempts__gte=1).exists())
    runner.stop()
    row = Delivery.objects.get()
    assert (row.status, row.last_status) == (Status.PENDING, 302)
    assert row.last_error == "the inbox answered 302 Found: moved"


def test_given_up_at_the_end_of_the_policy_and_at_max_attempts(
    inboxes: Callable[..., Inbox],
    start_deliverer: Callable[..., RunningDeliverer],
    settings: Any,
    received_signals: dict[str, list[Any]],
) -> None:
    fast_retries(settings, ATTEMPTS=3)
    failing = inboxes(respond=lambda request: (503, {}, b""))
    policy = send(ALICE, NOTE, [failing.url("/policy")])
    capped = send_batch(ALICE, NOTE, [failing.url("/capped")], BatchOptions(max_attempts=2))
    runner = start_deliverer()
    wait_until(settled(policy))
    wait_until(settled(capped))
    runner.stop()
    assert failing.paths().count("/policy") == 3
    assert failing.paths().count("/capped") == 2
    rows = {row.inbox.rsplit("/", 1)[1]: row for row in Delivery.objects.all()}
    assert rows["policy"].status == rows["capped"].status == Status.FAILED
    assert rows["policy"].last_error.startswith("gave up after 3 attempts: the inbox answered 503")
    assert {(f.deadline, f.refused, f.status) for f in received_signals["failed"]} == {
        (False, False, 503)
    }


@pytest.fixture(params=["USE_TZ", "USE_TZ off"])
def zone(request: pytest.FixtureRequest, settings: Any) -> str:
    """Each test twice: with Django's default, and with ``USE_TZ = False``,
    where a deadline is taken as every naive time is, in ``TIME_ZONE`` (the
    loop compared it with its aware times: a ``TypeError``)."""
    if request.param == "USE_TZ off":
        settings.USE_TZ = False
        settings.TIME_ZONE = "America/Los_Angeles"
    return str(request.param)


@pytest.mark.parametrize(
    ("zone", "naive"),
    [("USE_TZ", False), ("USE_TZ off", False), ("USE_TZ off", True)],
    ids=["USE_TZ", "USE_TZ off", "USE_TZ off-naive"],
    indirect=["zone"],
)
def test_a_retry_that_would_come_after_the_deadline_is_given_up_at_once(
    inbox: Inbox,
    start_deliverer: Callable[..., RunningDeliverer],
    received_signals: dict[str, list[Any]],
    zone: str,
    naive: bool,
) -> None:
    inbox.respond = lambda request: (503, {"Retry-After": "60"}, b"")
    deadline: Any = dt.timedelta(seconds=30)
    if naive:  # in TIME_ZONE
        deadline = timezone.now() + deadline
    batch = send_batch(ALICE, NOTE, [inbox.url()], {"deadline": deadline})
    left = Batch.objects.get().deadline - timezone.now()
    assert dt.timedelta(seconds=25) < left <= dt.timedelta(seconds=30)
    runner = start_deliverer()
    wait_until(settled(batch))
    runner.stop()
    row = Delivery.objects.get()
    assert row.status == Status.FAILED and row.attempts == 1
    assert row.last_error.startswith("the batch's deadline passed")
    (failure,) = received_signals["failed"]
    assert failure.deadline is True


def test_a_delivery_past_its_deadline_is_given_up_unsent(
    inbox: Inbox,
    start_deliverer: Callable[..., RunningDeliverer],
    received_signals: dict[str, list[Any]],
    zone: str,
) -> None:
    batch = send_batch(ALICE, NOTE, [inbox.url()], {"deadline": dt.timedelta(seconds=30)})
    Batch.objects.update(deadline=timezone.now() - dt.timedelta(seconds=1))
    runner = start_deliverer()
    wait_until(settled(batch))
    runner.stop()
    assert status_of(batch) == [Status.FAILED]
    assert inbox.received == []
    assert received_signals["failed"][0].deadline is True


@pytest.mark.slow
def test_a_delivery_waiting_for_a_worker_is_not_sent_after_its_batchs_deadline(
    inboxes: Callable[..., Inbox],
    start_deliverer: Callable[..., RunningDeliverer],
    received_signals: dict[str, list[Any]],
    settings: Any,
) -> None:
    # Claimed before its deadline, it waited in the workers' queue behind a
    # slow inbox's attempt (one worker) and was sent when one was free,
    # after the deadline: the deadline was looked at only at the claim.
    settings.FEDERATION_DELIVERY = {**settings.FEDERATION_DELIVERY, "SLOW_AFTER_SECONDS": 30}
    slow, fast = inboxes("127.0.0.2", delay=2.0), inboxes("127.0.0.3")
    options = BatchOptions(deadline=dt.timedelta(seconds=1.0))
    batch = send_batch(ALICE, NOTE, [slow.url(), fast.url()], options)
    runner = start_deliverer(concurrency=1)
    wait_until(settled(batch), timeout=10)
    runner.stop()
    assert (len(slow.received), fast.received) == (1, [])
    row = Delivery.objects.get(inbox=fast.url())
    assert row.status == Status.FAILED
    assert row.last_error == "the batch's deadline passed before it was sent"
    assert [failure.deadline for failure in received_signals["failed"]] == [True]
    # Never sent: no attempt counted or told, as for one whose deadline
    # passed at its claim or its slot.
    told = [a.delivery_id for a in received_signals["attempted"]]
    assert (row.attempts, row.last_attempt_at, told.count(row.id)) == (0, None, 0)


def test_what_waits_its_turn_or_for_its_paused_host_is_given_up_at_its_deadline(
    inbox: Inbox,
    start_deliverer: Callable[..., RunningDeliverer],
    received_signals: dict[str, list[Any]],
    zone: str,
) -> None:
    from django_federation_delivery.controls import pause_host

    # An Update waiting behind its ordering key on a Create that retries, or
    # held for its paused host, has no due time: no claim took it, so
    # nothing gave it up at its batch's deadline; it stayed pending, its
    # batch unfinished, until the Create left the queue (hours, by the
    # policy) or the host was resumed.
    create = send_batch(ALICE, NOTE, [inbox.url()], {"ordering_key": "post-1"})
    assert create is not None
    Delivery.objects.filter(batch=create).update(
        attempts=1, last_status=503, due_at=timezone.now() + dt.timedelta(hours=1)
    )
    options = {"ordering_key": "post-1", "deadline": dt.timedelta(seconds=30)}
    update = send_batch(ALICE, NOTE, [inbox.url()], options)
    pause_host("paused.example")
    held = send_batch(ALICE, NOTE, ["https://paused.example/inbox"], options)
    assert update is not None and held is not None
    assert not Delivery.objects.filter(batch__in=[update, held]).exclude(due_at=None).exists()
    Batch.objects.filter(id__in=[update.id, held.id]).update(
        deadline=timezone.now() - dt.timedelta(seconds=1)
    )
    runner = start_deliverer()
    wait_until(lambda: settled(update)() and settled(held)(), timeout=10)
    runner.stop()
    assert inbox.received == []
    assert status_of(update) == status_of(held) == [Status.FAILED]
    assert status_of(create) == [Status.PENDING]
    assert {failure.deadline for failure in received_signals["failed"]} == {True}
    assert sorted(received_signals["finished"]) == sorted([update.id, held.id])


@pytest.mark.slow
@pytest.mark.parametrize("unreached", ["low priority", "open breaker"])
def test_a_deadline_fails_what_no_claim_reaches_while_a_fan_out_keeps_the_loop_busy(
    inboxes: Callable[..., Inbox],
    start_deliverer: Callable[..., RunningDeliverer],
    failures: list[Any],
    unreached: str,
) -> None:
    # A steady fan-out in the normal lane: always something due there, so no
    # claim reaches the low lane (as documented), nor comes back short to
    # take what a host's open breaker holds. The batch's deadline passes
    # meanwhile: its delivery is due, not waiting on anything.
    crowd = [inboxes(f"127.0.0.{10 + n}", delay=0.4) for n in range(10)]
    normal = send_batch(ALICE, NOTE, [crowd[n % 10].url(f"/u{n}") for n in range(80)])
    quiet = inboxes("127.0.0.2")
    options: dict[str, Any] = {"deadline": dt.timedelta(seconds=1)}
    if unreached == "low priority":
        options["low_priority"] = True
    else:
        open_breaker(quiet.host, seconds=600)
    late = send_batch(ALICE, NOTE, [quiet.url()], options)
    assert normal is not None and late is not None
    runner = start_deliverer(concurrency=2, claim_size=2, per_host=1, per_host_max=1)
    started = time.monotonic()
    # Given up within 5 s of its deadline, as what waits its turn is.
    wait_until(lambda: settled(late)() or time.monotonic() - started > 8, timeout=12)
    took = time.monotonic() - started
    row = Delivery.objects.get(batch=late)
    fan_out_running = Batch.objects.get(id=normal.id).finished_at is None
    runner.stop()
    assert fan_out_running, "the fan-out kept the loop busy all along"
    assert row.status == Status.FAILED, (
        f"{took:.1f} s after the start, {took - 1:.0f} s past its deadline, the "
        f"delivery ({unreached}) is still {row.status}, its batch unfinished"
    )
    assert quiet.received == []
    assert [f.deadline for f in failures if f.batch_id == late.id] == [True]


@pytest.mark.slow
def test_a_deadline_fails_what_waits_claimed_behind_a_fan_out_within_the_sweeps_time(
    inboxes: Callable[..., Inbox],
    start_deliverer: Callable[..., RunningDeliverer],
    failures: list[Any],
) -> None:
    # A claim that finds the normal lane's due rows all on hosts at their
    # limit takes the low lane's: they wait in the deliverer's memory behind
    # the fan-out, under their lease, which the sweep leaves to their holder.
    # They were failed only at their slot, once the fan-out had gone.
    if connection.vendor == "postgresql":
        pytest.skip("PostgreSQL's claim takes no low-lane row while normal ones are due")
    crowd = [inboxes(f"127.0.0.{70 + n}", delay=0.3) for n in range(10)]
    normal = send(ALICE, NOTE, [host.url(f"/u/{n}") for n in range(40) for host in crowd])
    later = inboxes("127.0.0.90")
    low = send_batch(
        ALICE,
        NOTE,
        [later.url(f"/l/{n}") for n in range(20)],
        BatchOptions(low_priority=True, deadline=dt.timedelta(seconds=2)),
    )
    assert normal is not None and low is not None and low.deadline is not None
    runner = start_deliverer(concurrency=4)
    wait_until(
        lambda: any(item.claimed.batch_id == low.id for item in runner.deliverer.slots.ready)
    )
    # Within the 5 s the README gives, with room for a busy machine.
    wait_until(settled(low), timeout=(low.deadline - timezone.now()).total_seconds() + 8)
    fan_out_running = Batch.objects.get(id=normal.id).finished_at is None
    runner.stop()
    assert fan_out_running, "the fan-out kept the loop busy all along"
    # Some went while the fan-out's hosts were at their limit; none waits.
    statuses = collections.Counter(
        Delivery.objects.filter(batch=low).values_list("status", flat=True)
    )
    assert set(statuses) <= {Status.DELIVERED, Status.FAILED} and statuses[Status.FAILED]
    assert len(later.received) == statuses[Status.DELIVERED]
    told = [f.deadline for f in failures if f.batch_id == low.id]
    assert told == [True] * statuses[Status.FAILED]


def test_a_delivery_whose_lease_would_lapse_before_it_could_be_sent_is_not_sent(
    inbox: Inbox,
    start_deliverer: Callable[..., RunningDeliverer],
    received_signals: dict[str, list[Any]],
) -> None:
    # A lease shorter than the margin kept to write an outcome is spent at the claim.
    assert LEASE_MARGIN_SECONDS > 5.0
    batch = send(ALICE, NOTE, [inbox.url()])
    runner = start_deliverer(lease=5.0)
    wait_until(lambda: Delivery.objects.filter(attempts=1).exists())
    runner.stop()
    assert inbox.received == []
    row = Delivery.objects.get(batch=batch)
    assert (row.status, row.last_status, row.lease_token) == (Status.PENDING, None, None)
    assert row.last_error == "not sent: its lease ran out before a worker was free"
    assert row.due_at > timezone.now(), "retried later, by the policy"
    assert [a.outcome for a in received_signals["attempted"]] == ["held"]


def test_unsendable_deliveries_are_refused_for_good(
    inbox: Inbox,
    start_deliverer: Callable[..., RunningDeliverer],
    settings: Any,
) -> None:
    settings.FEDERATION_DELIVERY = {**settings.FEDERATION_DELIVERY, "ALLOWED_NETWORKS": []}
    private = send(ALICE, NOTE, [inbox.url("/private")])
    unknown = send("https://nobody.example/actor", NOTE, [inbox.url("/nokey")])
    runner = start_deliverer()
    wait_until(settled(private))
    wait_until(settled(unknown))
    runner.stop()
    assert inbox.received == [], "nothing reaches a loopback address unless allowed"
    for batch in (private, unknown):
        assert status_of(batch) == [Status.REFUSED]
    errors = dict(Delivery.objects.values_list("inbox", "last_error"))
    assert "127.0.0.1" in errors[inbox.url("/private")]
    assert errors[inbox.url("/nokey")] == "no key for sender https://nobody.example/actor"


def test_a_key_store_that_fails_is_retried_not_refused(
    inbox: Inbox,
    start_deliverer: Callable[..., RunningDeliverer],
    settings: Any,
) -> None:
    fast_retries(settings, ATTEMPTS=1000)  # never given up while the test runs
    batch = send(BROKEN, NOTE, [inbox.url()])
    runner = start_deliverer()
    # Until a retry's outcome is written, not only counted.
    wait_until(lambda: Delivery.objects.filter(attempts__gte=2).exclude(last_error="").exists())
    runner.stop()
    row = Delivery.objects.get(batch=batch)
    assert row.status == Status.PENDING
    assert inbox.received == [], "nothing is sent unsigned"
    assert "key could not be looked up" in row.last_error
    assert "away" not in row.last_error, "the key store's own message is not stored"


def test_a_key_store_that_fails_is_logged_with_the_sender_redacted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Written raw, a control character in a sender stored before send()
    # refused it was acted on by the terminal that showed the log.
    from .test_workers import in_flight, inboxes

    kind = inboxes()
    flight = in_flight(1, kind)
    sender = "https://social.example/users/al\x9bice?token=s3cret"
    batch = flight.batch._replace(sender=sender)

    def away(sender: str) -> None:
        raise ConnectionError("the key store is away")

    kind.keys.get = away  # type: ignore[method-assign]
    with caplog.at_level(logging.WARNING, logger="django_federation_delivery.deliverer"):
        job = kind.job(flight.claimed, batch)
    assert job.key is None and "could not be looked up: ConnectionError" in job.key_error
    (logged,) = [r.getMessage() for r in caplog.records if "Looking up the key" in r.getMessage()]
    assert logged == (
        "Looking up the key of https://social.example/users/al\\x9bice failed: ConnectionError"
    )


def test_a_receiver_that_raises_is_logged_and_the_loop_goes_on(
    inbox: Inbox,
    start_deliverer: Callable[..., RunningDeliverer],
    caplog: pytest.LogCaptureFixture,
) -> None:
    def broken(sender: Any, settled: Any, **kwargs: Any) -> None:
        raise RuntimeError("a receiver's bug")

    signals.delivery_settled.connect(broken, weak=False)
    try:
        with caplog.at_level(logging.ERROR, logger="django.dispatch"):
            first = send(ALICE, NOTE, [inbox.url("/1")])
            runner = start_deliverer()
            wait_until(settled(first))
            second = send(ALICE, NOTE, [inbox.url("/2")])
            wait_until(settled(second))
            runner.stop()
    finally:
        signals.delivery_settled.disconnect(broken)
    assert status_of(first) == status_of(second) == [Status.DELIVERED]
    logged = [r.getMessage() for r in caplog.records if "broken, a receiver of" in r.getMessage()]
    assert len(logged) == 2
    assert all("RuntimeError raised at test_deliverer.py:" in line for line in logged)


class Stop(BaseException):
    """What no ``except Exception`` catches, as a receiver's own library may raise."""


@pytest.mark.parametrize("error", [SystemExit(1), Stop()], ids=lambda e: type(e).__name__)
def test_a_receiver_that_raises_what_is_no_exception_is_logged_and_the_loop_goes_on(
    inbox: Inbox,
    start_deliverer: Callable[..., RunningDeliverer],
    caplog: pytest.LogCaptureFixture,
    error: BaseException,
) -> None:
    # Django's send_robust catches Exception only: a SystemExit stopped the
    # loop with the delivery sent and still pending, sent again after its lease.
    def exits(sender: Any, settled: Any, **kwargs: Any) -> None:
        raise error

    signals.delivery_settled.connect(exits, weak=False)
    try:
        with caplog.at_level(logging.ERROR, logger="django.dispatch"):
            first = send(ALICE, NOTE, [inbox.url("/1")])
            runner = start_deliverer()
            wait_until(settled(first), timeout=10)
            second = send(ALICE, NOTE, [inbox.url("/2")])
            wait_until(settled(second), timeout=10)
            assert runner.thread.is_alive()
            runner.stop()
    finally:
        signals.delivery_settled.disconnect(exits)
    assert status_of(first) == status_of(second) == [Status.DELIVERED]
    assert inbox.paths() == ["/1", "/2"], "each sent once"
    said = f"exits, a receiver of delivery_settled: {type(error).__name__} raised at"
    logged = [r for r in caplog.records if said in r.getMessage()]
    assert len(logged) == 2, "the receiver named, and its error's type"


@pytest.mark.parametrize("fault", ["KeyboardInterrupt", "SystemExit", "None"])
def test_an_attempt_that_raises_what_is_no_exception_or_returns_no_result_is_retried(
    inbox: Inbox,
    start_deliverer: Callable[..., RunningDeliverer],
    settings: Any,
    monkeypatch: pytest.MonkeyPatch,
    fault: str,
) -> None:
    # A host project's channel that raised KeyboardInterrupt or SystemExit
    # killed its worker thread unseen (the delivery in flight for ever, its
    # host's one slot never freed, stop() never returning); one that returned
    # None stopped the loop, its claim left leased.
    from django_federation_delivery.inboxes import InboxDeliveries

    fast_retries(settings)
    real = InboxDeliveries.attempt
    faulted: list[int] = []

    def attempt(self: InboxDeliveries, job: Any, transport: Any) -> Any:
        if job.targets[0].endswith("/bad") and not faulted:
            faulted.append(job.delivery_id)
            if fault == "KeyboardInterrupt":
                raise KeyboardInterrupt
            if fault == "SystemExit":
                raise SystemExit(3)
            return None
        return real(self, job, transport)

    monkeypatch.setattr(InboxDeliveries, "attempt", attempt)
    bad = send(ALICE, NOTE, [inbox.url("/bad")])
    runner = start_deliverer(concurrency=2, per_host=1, per_host_max=1)
    wait_until(lambda: bool(faulted), timeout=10)
    # The same host, which takes one at a time: sent only once the slot is free.
    good = send(ALICE, NOTE, [inbox.url("/good")])
    wait_until(
        lambda: not Delivery.objects.filter(status=Status.PENDING).exists(),
        timeout=10,
        state=lambda: list(Delivery.objects.values_list("inbox", "status", "last_error")),
    )
    assert runner.thread.is_alive()
    workers = runner.deliverer.workers
    assert all(thread.is_alive() for thread in workers._threads), "no dead thread counted"
    runner.stop(timeout=10)
    assert status_of(bad) == status_of(good) == [Status.DELIVERED]
    assert sorted(inbox.paths()) == ["/bad", "/good"], "each sent once"
    assert Delivery.objects.get(batch=bad).attempts == 2, "the fault was a failed attempt"


@pytest.mark.parametrize(
    ("step", "sent"),
    [("admit", ["/1", "/2"]), ("learn", ["/1", "/1", "/2"])],
    ids=["before its attempt", "after its attempt"],
)
def test_a_delivery_whose_way_through_the_loop_raises_is_a_passing_failure_the_loop_survives(
    inbox: Inbox,
    start_deliverer: Callable[..., RunningDeliverer],
    settings: Any,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    step: str,
    sent: list[str],
) -> None:
    # A fault in what the loop's thread does for one delivery, before its
    # attempt (admitting it past its breaker) or after (learning what its
    # answer taught), raised out of run(): the deliverer stopped, and every
    # delivery it held stayed leased until the lease lapsed.
    from django_federation_delivery.hoststats import HostStats
    from django_federation_delivery.triage import Triage

    fast_retries(settings)
    owner: Any = Triage if step == "admit" else HostStats
    real = getattr(owner, step)
    raised: list[int] = []

    def fault(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not raised:
            raised.append(1)
            raise KeyError("a token, SECRET")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(owner, step, fault)
    first = send(ALICE, NOTE, [inbox.url("/1")])
    runner = start_deliverer()
    wait_until(settled(first), timeout=10)
    second = send(ALICE, NOTE, [inbox.url("/2")])
    wait_until(settled(second), timeout=10)
    assert runner.thread.is_alive(), f"the loop stopped on {runner.error!r}"
    runner.stop()
    assert raised
    assert status_of(first) == status_of(second) == [Status.DELIVERED]
    assert inbox.paths() == sent
    assert Delivery.objects.get(batch=first).attempts == 2, "the fault was a failed attempt"
    (logged,) = [r.getMessage() for r in caplog.records if "in the loop" in r.getMessage()]
    delivery = Delivery.objects.get(batch=first).id
    assert logged.startswith(f"Delivery {delivery} raised KeyError at test_deliverer.py:"), logged
    assert logged.endswith("settled as a failed attempt")
    assert "SECRET" not in caplog.text, "the type, never the message"


def sent_until(
    deliverer: Deliverer, inbox: Inbox, error: type[BaseException]
) -> tuple[Batch | None, list[int]]:
    """A send to ``inbox``, then ``deliverer``'s drain, which is to raise
    ``error``: the batch, and those ``batch_finished`` was told of."""
    finished: list[int] = []

    def receiver(sender: Any, **kwargs: Any) -> None:
        finished.append(kwargs["batch"].id)

    signals.batch_finished.connect(receiver, weak=False)
    try:
        batch = send(ALICE, NOTE, [inbox.url("/one")])
        with pytest.raises(error):
            deliverer.run(drain=True)
    finally:
        signals.batch_finished.disconnect(receiver)
    return batch, finished


def failing_once_answered(deliverer: Deliverer, monkeypatch: pytest.MonkeyPatch) -> Deliverer:
    """``deliverer``, whose loop raises ``RuntimeError`` (a fault of its
    own, of no one delivery's way) once an answer waits to be written."""
    dispatch = deliverer.handoff.dispatch

    def fault() -> None:
        if deliverer.outbox:
            raise RuntimeError("a fault of the loop")
        dispatch()

    monkeypatch.setattr(deliverer.handoff, "dispatch", fault)
    return deliverer


@pytest.mark.django_db(transaction=True)
def test_a_loop_that_fails_writes_what_was_answered_before_it_raises(
    inbox: Inbox, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A fault of the loop itself, not of one delivery's way (a bug, an
    # error no turn expects), ends run() with it. What was answered and
    # waited in the outbox to be written was left to its lease, and sent
    # again once the lease ran out.
    deliverer = failing_once_answered(Deliverer(concurrency=1), monkeypatch)
    batch = send(ALICE, NOTE, [inbox.url(f"/{n}") for n in range(4)])
    with pytest.raises(RuntimeError, match="a fault of the loop"):
        deliverer.run(drain=True)
    # What was answered (in flight as it failed too), written; what was
    # claimed and not sent, put back due now, not left to its lease.
    received = inbox.paths()
    assert received
    for delivery in Delivery.objects.filter(batch=batch):
        if delivery.inbox.removeprefix(inbox.url("")) in received:
            assert delivery.status == Status.DELIVERED, delivery.inbox
        else:
            assert (delivery.status, delivery.lease_token) == (Status.PENDING, None)


@pytest.mark.django_db(transaction=True)
def test_a_loop_that_fails_tells_batch_finished_of_what_its_last_write_finished(
    inbox: Inbox, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Its last write, as it left on its error, finished the batch: it was
    # never told, and a receiver waiting for it never heard of it.
    deliverer = failing_once_answered(Deliverer(concurrency=1), monkeypatch)
    batch, finished = sent_until(deliverer, inbox, RuntimeError)
    assert status_of(batch) == [Status.DELIVERED]
    assert batch is not None and finished == [batch.id]


@pytest.mark.django_db(transaction=True)
def test_a_loop_interrupted_as_it_writes_writes_what_was_answered_before_it_raises(
    inbox: Inbox, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Interrupted in the outbox's write (Ctrl-C, an error of the loop's):
    # the outbox had let go of what it was writing, and the write as the
    # loop left found nothing; the answered delivery stayed claimed, and
    # was sent again once its lease ran out.
    real = settlements.settle
    calls: list[int] = []

    def interrupted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(settlements, "settle", interrupted)
    batch = send(ALICE, NOTE, [inbox.url("/one")])
    with pytest.raises(KeyboardInterrupt):
        Deliverer(concurrency=1).run(drain=True)
    assert inbox.paths() == ["/one"]
    (delivery,) = Delivery.objects.filter(batch=batch)
    assert (delivery.status, delivery.lease_token) == (Status.DELIVERED, None)


@pytest.mark.django_db(transaction=True)
def test_a_write_interrupted_once_committed_tells_batch_finished_as_the_loop_leaves(
    inbox: Inbox, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The interrupt came as the settle returned from its commit: written
    # again as the loop left, the settlement found its claim gone and wrote
    # nothing, and the batch it had finished was never told.
    real = settlements._written
    calls: list[int] = []

    def committed_then_interrupted(*args: Any, **kwargs: Any) -> Any:
        result = real(*args, **kwargs)
        calls.append(1)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return result

    monkeypatch.setattr(settlements, "_written", committed_then_interrupted)
    batch, finished = sent_until(Deliverer(concurrency=1), inbox, KeyboardInterrupt)
    assert status_of(batch) == [Status.DELIVERED]
    assert batch is not None and finished == [batch.id]


class InFlight:
    """A server's answer that counts the requests it is answering at once,
    and the most it ever was; ``wait`` is what answering takes."""

    def __init__(self, wait: Callable[[], object]) -> None:
        self.wait = wait
        self.now = self.most = 0
        self.lock = threading.Lock()

    def respond(self, request: Received) -> tuple[int, dict[str, str], bytes]:
        with self.lock:
            self.now += 1
            self.most = max(self.most, self.now)
        self.wait()
        with self.lock:
            self.now -= 1
        return 202, {}, b""

    def __repr__(self) -> str:
        return f"<InFlight now={self.now} most={self.most}>"


def test_a_host_that_answers_well_is_sent_more_at_once_up_to_the_most(
    inboxes: Callable[..., Inbox],
    start_deliverer: Callable[..., RunningDeliverer],
) -> None:
    active = InFlight(lambda: time.sleep(0.03))
    big = inboxes("127.0.0.2", respond=active.respond)
    batch = send(ALICE, NOTE, [big.url(f"/{n}") for n in range(120)])
    runner = start_deliverer(concurrency=8, per_host=2, per_host_max=5)
    # About a second alone; 12 s with every run of CI at once on two cores.
    wait_until(settled(batch), timeout=60)
    runner.stop()
    assert 2 < active.most <= 5, active


def test_a_host_answering_quick_404s_too_is_still_sent_more_at_once(
    inboxes: Callable[..., Inbox],
) -> None:
    # One inbox in ten gone there, answered 404 at once: each 404 was taken
    # for the host's fastest answer, every ordinary one then for one three
    # times slower, and the host was sent one at a time (its limit 1).
    active = InFlight(lambda: time.sleep(0.06))

    def respond(request: Received) -> tuple[int, dict[str, str], bytes]:
        return (404, {}, b"") if request.path.startswith("/gone") else active.respond(request)

    host = inboxes("127.0.0.2", respond=respond)
    urls = [host.url(f"/gone{n}" if n % 10 == 0 else f"/u{n}") for n in range(100)]
    send(ALICE, NOTE, urls)
    Deliverer(concurrency=16, per_host=2, per_host_max=8).run(drain=True)
    limit = Host.objects.get(name=host.host).concurrency_limit
    assert active.most >= 5 and limit is not None and limit >= 5, (active, limit)


def test_no_more_than_per_host_go_to_one_host_at_once(
    inboxes: Callable[..., Inbox],
    start_deliverer: Callable[..., RunningDeliverer],
) -> None:
    # The slow host answers nothing until the fast one has had everything: the
    # test holds whatever the load, as no clock decides it.
    release = threading.Event()
    active = InFlight(lambda: release.wait(30))
    slow = inboxes("127.0.0.2", respond=active.respond)
    fast = inboxes("127.0.0.3")
    batch = send(
        ALICE, NOTE, [slow.url(f"/{n}") for n in range(8)] + [fast.url(f"/{n}") for n in range(8)]
    )
    # A limit that cannot grow: the slow host's later answers come at once.
    runner = start_deliverer(concurrency=8, per_host=2, per_host_max=2)
    try:
        # Both of the slow host's slots taken, as well as the fast host served:
        # on a loaded machine the second slow request may reach its server last.
        wait_until(
            lambda: len(fast.received) == 8 and active.now == 2,
            state=lambda: (len(fast.received), active),
        )
        slow_begun = len(slow.received)
    finally:
        release.set()
    wait_until(settled(batch))
    runner.stop()
    assert active.most == 2
    assert slow_begun == 2, "the slow host holds two slots, not the loop"


@pytest.mark.slow
def test_a_host_that_refuses_even_one_at_a_time_rests_and_is_not_hammered(
    inboxes: Callable[..., Inbox],
    start_deliverer: Callable[..., RunningDeliverer],
    settings: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # As another deliverer's request in flight makes a host that takes one at
    # a time refuse this one's: each 503 at a limit of one has the host rest,
    # twice as long each time (0.1 s, 0.2 s, 0.4 s...), where the slot it
    # frees would otherwise go to the next of its deliveries at once.
    fast_retries(settings, ATTEMPTS=1000)  # never given up while the test runs
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "BREAKER": {"THRESHOLD": 10_000, "COOL_OFF": 60.0, "SCOPE": "host"},
    }
    busy = threading.Event()
    busy.set()
    # It answers the first request well (a host that never did is down, not
    # busy, and left to its breaker), then refuses each while busy.
    small = inboxes(
        "127.0.0.2",
        respond=lambda request: (
            (503, {}, b"") if busy.is_set() and len(small.received) > 1 else (202, {}, b"")
        ),
    )
    batch = send(ALICE, NOTE, [small.url(f"/{n}") for n in range(20)])
    claimed: list[int] = []
    real_claim = claims.claim

    def claim(*args: Any, **kwargs: Any) -> Any:
        found = real_claim(*args, **kwargs)
        claimed.append(len(found))
        return found

    monkeypatch.setattr(claims, "claim", claim)
    runner = start_deliverer(concurrency=8, per_host=1, per_host_max=4)
    wait_until(lambda: len(small.received) >= 1)
    before = len(claimed)
    time.sleep(2.0)
    refused, claims_resting = len(small.received), len(claimed) - before
    busy.clear()
    wait_until(settled(batch))
    runner.stop()
    # Resting: 0.1 + 0.2 + 0.4 + 0.8 s make five or six refusals in 2 s.
    # Without it, each of the 20 would be refused every 0.1-0.2 s: hundreds.
    assert 2 <= refused <= 12, refused
    # Nor is the database: while the host rests, its due deliveries wait for
    # the end of the rest, not for a claim at every turn of the loop (a write
    # transaction each, and all of a core: 2,095 claims in these 2 s, where
    # 12-15 follow the results and the rests' ends).
    assert claims_resting <= 150, claims_resting
    assert status_of(batch) == [Status.DELIVERED] * 20


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_retry_that_comes_due_while_the_only_other_work_rests_is_sent_at_once(
    inboxes: Callable[..., Inbox],
) -> None:
    # An idle loop that listens (PostgreSQL) is woken by a send; a retry that
    # comes due wakes nothing. With only a resting host's deliveries due, the
    # next due time says nothing of another host's retry: it is looked for.
    from django_federation_delivery.addresses import host_of

    from .test_limits import answered, known

    busy, other = inboxes("127.0.0.2"), inboxes("127.0.0.3")
    send(ALICE, NOTE, [busy.url("/busy")])
    retried = send(ALICE, NOTE, [other.url("/other")])
    Delivery.objects.filter(batch=retried).update(
        attempts=1, due_at=timezone.now() + dt.timedelta(seconds=0.5)
    )
    deliverer = Deliverer(concurrency=4, per_host=1, per_host_max=4)
    host = host_of(busy.url())
    known(deliverer.limits, host)
    for _ in range(8):
        # Refused at one, again and again: it rests 12.8 s.
        deliverer.limits.learn(host, answered(503))
    assert deliverer.limits.rest_left(host) > 10
    deliverer.run(stop_after=3.0)
    assert [request.path for request in other.received] == ["/other"], "sent when due"
    assert busy.received == [], "resting"


class OneAtATime:
    """A small host's answer: 202 after ``seconds``, or at once 503 to a
    request that finds another being answered; ``refused`` counts those."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.busy = threading.Lock()
        self.refused = 0

    def respond(self, request: Received) -> tuple[int, dict[str, str], bytes]:
        if not self.busy.acquire(blocking=False):
            self.refused += 1
            return 503, {}, b""
        try:
            time.sleep(self.seconds)
        finally:
            self.busy.release()
        return 202, {}, b""


def test_two_deliverers_leave_a_host_that_takes_one_at_a_time_to_one_of_them(
    inboxes: Callable[..., Inbox],
    start_deliverer: Callable[..., RunningDeliverer],
    settings: Any,
) -> None:
    # Each deliverer (each process of run_deliverer --processes 2) learns the
    # host's limit apart, and sends it at least one at a time: of two at once,
    # one is refused. The one refused rests, ever longer while refused.
    fast_retries(settings, ATTEMPTS=1000)
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "BREAKER": {"THRESHOLD": 10_000, "COOL_OFF": 60.0, "SCOPE": "host"},
    }
    small = OneAtATime(seconds=0.02)
    sink = inboxes("127.0.0.2", respond=small.respond)
    batch = send(ALICE, NOTE, [sink.url(f"/{n}") for n in range(60)])
    for _ in range(2):
        start_deliverer(concurrency=4, per_host=1, per_host_max=4)
    wait_until(settled(batch), timeout=60)
    assert status_of(batch) == [Status.DELIVERED] * 60
    # Some ten to twenty refusals, 41 once on a loaded machine; 290-330
    # without the rest.
    assert small.refused <= 80, small.refused


def test_a_database_that_is_away_for_a_moment_is_waited_out(
    inbox: Inbox,
    start_deliverer: Callable[..., RunningDeliverer],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    failures = {"claim": 2, "settle": 2}
    real_claim, real_settle = claims.claim, settlements.settle

    def claim(*args: Any, **kwargs: Any) -> Any:
        if failures["claim"]:
            failures["claim"] -= 1
            raise OperationalError("server closed the connection unexpectedly")
        return real_claim(*args, **kwargs)

    def settle(*args: Any, **kwargs: Any) -> Any:
        if failures["settle"]:
            failures["settle"] -= 1
            raise OperationalError("database is locked")
        return real_settle(*args, **kwargs)

    monkeypatch.setattr(claims, "claim", claim)
    monkeypatch.setattr(settlements, "settle", settle)
    batch = send(ALICE, NOTE, [inbox.url()])
    runner = start_deliverer()
    wait_until(settled(batch))
    runner.stop()
    assert failures == {"claim": 0, "settle": 0}
    assert status_of(batch) == [Status.DELIVERED]
    assert len(inbox.received) == 1, "an outcome not written at first is written, not re-sent"


@pytest.mark.slow
@pytest.mark.parametrize("back", [False, True], ids=["away", "back-within-the-grace"])
def test_a_stop_while_the_database_is_away_ends_after_a_grace_without_spinning(
    inbox: Inbox,
    start_deliverer: Callable[..., RunningDeliverer],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    back: bool,
) -> None:
    # Stopping, the loop writes what it holds while the leases hold. Each
    # failed write was waited out with the stop's event, which was set: no
    # wait at all. It tried flat out for the whole lease, which stop() waited
    # for (5 minutes with the default lease).
    real = settlements.settle
    away = threading.Event()
    away.set()
    tried: list[float] = []

    def settle(*args: Any, **kwargs: Any) -> Any:
        if away.is_set():
            tried.append(time.monotonic())
            raise OperationalError("server closed the connection unexpectedly")
        return real(*args, **kwargs)

    monkeypatch.setattr(settlements, "settle", settle)
    batch = send(ALICE, NOTE, [inbox.url("/a")])
    runner = start_deliverer(lease=20)
    wait_until(lambda: bool(tried), timeout=10)
    if back:
        threading.Timer(STOPPING_GRACE / 2, away.clear).start()
    asked = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="django_federation_delivery.deliverer"):
        runner.stop()
    took = time.monotonic() - asked
    during = [at for at in tried if at >= asked]
    assert took < STOPPING_GRACE + 2, f"stopped {took:.1f} s after it was asked"
    assert len(during) < 20, f"{len(during)} writes tried while stopping, in {took:.1f} s"
    assert inbox.paths() == ["/a"]
    if back:
        assert status_of(batch) == [Status.DELIVERED], "written once the database took it"
        assert "unwritten" not in caplog.text
    else:
        assert status_of(batch) == [Status.PENDING], "left to its lease"
        assert (
            "Stopping with 1 outcomes unwritten and 0 attempts in flight: the database "
            "took no write for 3 s"
        ) in caplog.text


@pytest.mark.slow
def test_a_stop_while_the_whole_database_is_away_ends_within_the_grace(
    start_deliverer: Callable[..., RunningDeliverer],
    monkeypatch: pytest.MonkeyPatch,
    settings: Any,
) -> None:
    # Holding nothing to write, every statement of its thread failing for
    # 10 s: each of the upkeep's statements (the heartbeat, the paused
    # hosts, the breakers) was waited out whole once stopping, up to 5 s
    # each, and the stop took 11-15 s where a write's grace is 3 s.
    away = threading.Event()
    main = threading.main_thread()
    real = BaseDatabaseWrapper.ensure_connection

    def ensure_connection(self: Any) -> None:
        if away.is_set() and threading.current_thread() is not main:
            raise OperationalError("unable to open database file")
        real(self)

    monkeypatch.setattr(BaseDatabaseWrapper, "ensure_connection", ensure_connection)
    # A beat each second: the idle loop meets the outage at once, on
    # PostgreSQL too, where LISTEN wakes it.
    settings.FEDERATION_DELIVERY = {**settings.FEDERATION_DELIVERY, "HEARTBEAT_SECONDS": 1.0}
    runner = start_deliverer(heartbeat=True)
    time.sleep(1.0)
    away.set()
    time.sleep(10.0)  # long enough for the waits between tries to grow past 2 s
    asked = time.monotonic()
    try:
        runner.stop(timeout=60)
    finally:
        away.clear()
    took = time.monotonic() - asked
    assert took < STOPPING_GRACE + 2, f"stopped {took:.1f} s after it was asked, holding nothing"


WEBHOOK_KEY = "routingKEY4b7c9"


@pytest.mark.parametrize("kind", ["verbatim", "belowzero"])
def test_one_settlement_the_database_refuses_holds_back_none_written_with_it(
    inboxes: Callable[..., Inbox],
    start_deliverer: Callable[..., RunningDeliverer],
    settings: Any,
    caplog: pytest.LogCaptureFixture,
    kind: str,
) -> None:
    # A kind's error holding a NUL (which PostgreSQL's text refuses), or a
    # status below zero (which no database takes as a last status): its
    # settle failed, read as the database away; every outcome written with
    # it was kept unwritten until its lease lapsed, then sent again, and the
    # one refused was never written. The NUL is now kept escaped, and the
    # status refused by the worker before any write (a settle the database
    # refuses is shown in test_store.py).
    inbox = inboxes(delay=0.3)
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "CHANNELS": ["tests.channels.Verbatim", "tests.channels.BelowZero"],
        "WEBHOOKS": {"ops": f"{kind}+http://{WEBHOOK_KEY}@127.0.0.1:{inbox.port}/page"},
        "WEBHOOK_RETRY": [0.1] * 8,
    }
    send_webhook("ops", "alert.raised", {"n": 1}, event_id="e1")
    batch = send(ALICE, NOTE, [inbox.url(f"/{n}") for n in range(4)])
    assert batch is not None
    caplog.set_level(logging.WARNING, logger="django_federation_delivery")
    runner = start_deliverer(lease=12)
    try:
        wait_until(
            lambda: Delivery.objects.filter(status=Status.PENDING).count() == 0,
            timeout=30,
            state=lambda: (
                sorted(inbox.paths()),
                list(Delivery.objects.values_list("kind", "status", "attempts")),
            ),
        )
    finally:
        runner.stop()
    assert sorted(inbox.paths()) == ["/0", "/1", "/2", "/3"], "each sent once"
    assert status_of(batch) == [Status.DELIVERED] * 4
    assert not [m for m in caplog.messages if "database is unavailable" in m]
    event = Delivery.objects.exclude(batch=batch).get()
    assert event.status == Status.FAILED
    if kind == "verbatim":
        # Kept as an answer's text is kept, escaped: every try written.
        assert event.attempts == 9
        assert event.last_error == (
            "gave up after 9 attempts: the receiver answered 500: \\x00\\x01binary"
        )
        seen = Host.objects.get(name="<ops>")
        assert seen.last_error == "the receiver answered 500: \\x00\\x01binary"
    else:
        # A status no answer has is the worker's to refuse now, before any
        # write: a failed try each time, told by the field and its type.
        assert (event.attempts, event.last_status) == (9, None)
        assert "the result's status (int) is not an HTTP status" in event.last_error


@pytest.mark.parametrize("forgotten", [False, True], ids=["batch-known", "batch-forgotten"])
def test_a_delivered_outcome_the_database_refuses_is_failed_and_told_failed_once(
    inboxes: Callable[..., Inbox],
    start_deliverer: Callable[..., RunningDeliverer],
    monkeypatch: pytest.MonkeyPatch,
    forgotten: bool,
) -> None:
    # The refused outcome is written failed; its receivers heard only
    # delivery_settled (delivered), never that it failed.
    from django.db import DataError

    inbox = inboxes()
    batch = send_batch(ALICE, NOTE, [inbox.url("/a"), inbox.url("/b")], {"tag": "note"})
    assert batch is not None
    refused = Delivery.objects.get(inbox=inbox.url("/b")).pk
    written = settlements._written

    def refuse(items: Any, *args: Any) -> Any:
        if any(i.claimed.id == refused and i.status == Status.DELIVERED for i in items):
            raise DataError("value out of range")
        return written(items, *args)

    monkeypatch.setattr(settlements, "_written", refuse)
    if forgotten:
        from django_federation_delivery.batches import KnownBatches

        monkeypatch.setattr(KnownBatches, "known", lambda self, id: None)
    told: list[signals.Failure] = []

    def failed(sender: Any, failure: signals.Failure, **kwargs: Any) -> None:
        told.append(failure)

    signals.delivery_failed.connect(failed)
    try:
        runner = start_deliverer()
        try:
            wait_until(lambda: not Delivery.objects.filter(status=Status.PENDING).exists())
            wait_until(lambda: bool(told), timeout=5)
        finally:
            runner.stop()
    finally:
        signals.delivery_failed.disconnect(failed)
    assert status_of(batch) == [Status.DELIVERED, Status.FAILED]
    assert [(f.delivery_id, f.batch_id, f.sender, f.tag, f.status) for f in told] == [
        (refused, batch.pk, ALICE, "note", None)
    ]
    assert told[0].error.startswith("the database refused its outcome (DataError")
    assert not told[0].refused and not told[0].deadline


def test_a_drain_does_not_end_while_the_database_is_away(
    inbox: Inbox, caplog: pytest.LogCaptureFixture
) -> None:
    from django.db import connection

    batch = send(ALICE, NOTE, [inbox.url(f"/{n}") for n in range(3)])
    refused: list[str] = []
    away_until = time.monotonic() + 1.5

    def away(execute: Callable[..., Any], sql: str, *args: Any) -> Any:
        # Every statement fails for a while, as when the server restarts.
        if time.monotonic() < away_until:
            refused.append(sql)
            raise OperationalError("terminating connection due to administrator command")
        return execute(sql, *args)

    # The deliverer's coordinator is this thread: its connection is this one.
    with (
        connection.execute_wrapper(away),
        caplog.at_level(logging.WARNING, logger="django_federation_delivery.deliverer"),
    ):
        summary = Deliverer().run(drain=True)
    assert refused, "the database was away when the drain began"
    assert summary.delivered == 3, "a claim that failed is not an empty queue"
    assert status_of(batch) == [Status.DELIVERED] * 3
    lines = [record.getMessage() for record in caplog.records]
    assert len([line for line in lines if "unavailable" in line]) == 1, "one line an outage"
    assert lines[-1] == "The database is back"


def test_what_was_claimed_as_the_database_went_away_is_sent_when_it_is_back(
    inbox: Inbox,
) -> None:
    # The claim is written, then the read of its batches meets the database
    # away: the rows were dropped from hand, leased for five minutes, and a
    # drain ended at once with them unsent.
    from django.db import connection

    batch = send(ALICE, NOTE, [inbox.url(f"/{n}") for n in range(3)])
    failed: list[str] = []

    def away_once(execute: Callable[..., Any], sql: str, *args: Any) -> Any:
        if not failed and "id, sender, body, body_sha256" in sql:
            failed.append(sql)
            raise OperationalError("server closed the connection unexpectedly")
        return execute(sql, *args)

    with connection.execute_wrapper(away_once):
        summary = Deliverer().run(drain=True, stop_after=10)
    assert failed, "the database went away after the claim"
    assert summary.delivered == 3
    assert sorted(inbox.paths()) == ["/0", "/1", "/2"]
    assert status_of(batch) == [Status.DELIVERED] * 3


@pytest.mark.parametrize("sorted_first", [False, True], ids=["unsorted", "sorted"])
def test_what_is_claimed_and_unsorted_as_a_deliverer_stops_is_put_back_due_now(
    monkeypatch: pytest.MonkeyPatch, sorted_first: bool
) -> None:
    # Stopping while the database is away after a claim: what it could not
    # sort goes back to the queue, due now, as what is ready does.
    batch = send(ALICE, NOTE, ["https://a.example/inbox", "https://b.example/inbox"])
    deliverer = Deliverer()
    real_read = deliverer.triage.batches.read
    monkeypatch.setattr(
        deliverer.triage.batches,
        "read",
        lambda claimed: real_read(claimed) if sorted_first else None,
    )
    deliverer.intake.claim_more()
    assert Delivery.objects.filter(lease_token__isnull=False).count() == 2
    deliverer.handoff.release_ready()
    deliverer.outbox.flush()
    rows = Delivery.objects.filter(batch=batch)
    assert [(row.status, row.lease_token) for row in rows] == [(Status.PENDING, None)] * 2
    assert all(row.due_at is not None and row.due_at <= timezone.now() for row in rows)


def test_a_drain_does_not_end_while_another_process_holds_what_is_due_for_a_moment(
    inbox: Inbox,
) -> None:
    # On PostgreSQL a claim passes rows another deliverer's claim has locked:
    # that claim comes back empty while they are due. Here another connection
    # holds them; the drain waits for them rather than ending with nothing.
    if connection.vendor != "postgresql":
        pytest.skip("only PostgreSQL's claim passes locked rows (SKIP LOCKED)")
    batch = send(ALICE, NOTE, [inbox.url(f"/{n}") for n in range(3)])
    locked, release = threading.Event(), threading.Event()

    def hold() -> None:
        other = connections.create_connection("default")
        try:
            with other.cursor() as cursor:
                cursor.execute("BEGIN")
                cursor.execute(f"SELECT id FROM {Delivery._meta.db_table} FOR UPDATE")
                locked.set()
                release.wait(10)
                cursor.execute("COMMIT")
        finally:
            other.close()

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert locked.wait(10)
        threading.Timer(0.5, release.set).start()
        summary = Deliverer().run(drain=True)
    finally:
        release.set()
        holder.join(10)
    assert summary.delivered == 3
    assert status_of(batch) == [Status.DELIVERED] * 3


@pytest.mark.parametrize("listens", ["at once", "after the first claim"])
def test_an_idle_loop_looks_for_new_work_with_a_read_not_a_claim(
    listens: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A claim is a write transaction (on SQLite it holds the write lock a web
    # process's send waits for); once one found nothing, the loop reads
    # whether anything has come due instead, until something has. A listener
    # that begins to listen after that claim (its connection slow to come)
    # has the loop read whether anything was sent before, not claim again.
    from django.test.utils import CaptureQueriesContext

    from django_federation_delivery import wakeup

    if listens != "at once":
        if connection.vendor != "postgresql":
            pytest.skip("no listener without PostgreSQL")
        connect = wakeup.PostgresListener._connect

        def slow_to_connect(listener: wakeup.PostgresListener) -> Any:
            time.sleep(0.4)
            return connect(listener)

        monkeypatch.setattr(wakeup.PostgresListener, "_connect", slow_to_connect)
    with CaptureQueriesContext(connection) as queries:
        Deliverer().run(stop_after=1.0)
    statements = [q["sql"] for q in queries.captured_queries]
    claims = [sql for sql in statements if "due_at <= " in sql and "EXISTS" not in sql]
    rounds = len(claims) if connection.vendor == "postgresql" else len(claims) / len(CLAIM_ORDER)
    assert rounds == 1, claims
    if connection.vendor == "sqlite":  # no LISTEN: it looks every NEW_WORK_POLL_SECONDS
        assert sum(sql.startswith("SELECT EXISTS") for sql in statements) >= 3


def test_on_sqlite_the_coordinator_takes_the_write_lock_promptly_and_only_while_it_runs(
    inbox: Inbox,
) -> None:
    seen: list[list[type]] = []

    def note(sender: Any, **kwargs: Any) -> None:
        # Sent from the coordinator: this thread, with its connection.
        seen.append([type(wrapper) for wrapper in connection.execute_wrappers])

    before = list(connection.execute_wrappers)
    send(ALICE, NOTE, [inbox.url()])
    signals.delivery_settled.connect(note, weak=False)
    try:
        Deliverer().run(drain=True)
    finally:
        signals.delivery_settled.disconnect(note)
    taken = [PromptWriteLock] if connection.vendor == "sqlite" else []
    assert seen == [[*(type(wrapper) for wrapper in before), *taken]]
    assert connection.execute_wrappers == before


LISTENING = "Listening for new deliveries"


def poll_once_a_minute(settings: Any) -> None:
    """A loop with nothing to do looks at the queue again only after a
    minute: what it does sooner, something woke it for."""
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "IDLE_POLL_SECONDS": 60,
        "NEW_WORK_POLL_SECONDS": 60,
    }


def wait_until_idle(caplog: pytest.LogCaptureFixture) -> None:
    """Until the loop sleeps with nothing to do, on PostgreSQL once LISTEN
    is in place (getting there wakes it, once)."""
    listens = connection.vendor == "postgresql"

    def idle() -> bool:
        messages = [record.getMessage() for record in list(caplog.records)]
        if listens:
            if LISTENING not in messages:
                return False
            messages = messages[messages.index(LISTENING) + 1 :]
        return any(message.startswith("Nothing to do") for message in messages)

    wait_until(idle, timeout=10)


def test_with_use_tz_off_an_idle_deliverer_sleeps_until_what_comes_due(
    inbox: Inbox, settings: Any
) -> None:
    # The idle wait subtracted the naive now of USE_TZ off from the aware
    # due time it read: a TypeError out of run() whenever a retry was near.
    settings.USE_TZ = False
    settings.TIME_ZONE = "America/Los_Angeles"
    batch = send(ALICE, NOTE, [inbox.url()])
    soon = timezone.now() + dt.timedelta(seconds=0.2)
    Delivery.objects.filter(batch=batch).update(due_at=soon)
    # Sleeps until it comes due (or the idle poll), then returns.
    Deliverer().intake.idle(listening=True)
    assert status_of(batch) == [Status.PENDING]


def test_a_send_wakes_an_idle_deliverer_in_the_same_process_at_once(
    inbox: Inbox,
    start_deliverer: Callable[..., RunningDeliverer],
    settings: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    poll_once_a_minute(settings)
    caplog.set_level(logging.DEBUG, logger="django_federation_delivery")
    runner = start_deliverer()
    wait_until_idle(caplog)  # for up to a minute
    batch = send(ALICE, NOTE, [inbox.url()])
    wait_until(settled(batch), timeout=5)
    runner.stop()
    assert status_of(batch) == [Status.DELIVERED]


def test_a_deliverer_on_postgresql_stops_at_once_when_idle(
    start_deliverer: Callable[..., RunningDeliverer],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if connection.vendor != "postgresql":
        pytest.skip("only PostgreSQL has a listener to stop")
    # A stop that waited for the listener's wait to end would take a minute:
    # "at once" may then be a few seconds on a machine busy past its cores.
    monkeypatch.setattr(wakeup.PostgresListener, "WAIT", 60.0)
    caplog.set_level(logging.DEBUG, logger="django_federation_delivery")
    runner = start_deliverer()
    wait_until_idle(caplog)  # the listener waits on its connection by now
    started = time.monotonic()
    runner.stop()
    took = time.monotonic() - started
    assert took < 5, f"stopped after {took:.2f} s: not at once"


def test_an_idle_deliverer_whose_listener_cannot_listen_still_looks_for_new_work(
    inbox: Inbox,
    start_deliverer: Callable[..., RunningDeliverer],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # LISTEN's connection cannot be had (the server away for it, a pooler
    # that takes no LISTEN): a listener that was there was counted as one
    # that listens, and the loop stopped looking every NEW_WORK_POLL_SECONDS,
    # so a send from another process waited for the idle poll (30 s).
    if connection.vendor != "postgresql":
        pytest.skip("LISTEN is PostgreSQL's")

    def cannot(self: Any) -> Any:
        raise OperationalError("connection refused")

    monkeypatch.setattr(wakeup.PostgresListener, "_connect", cannot)
    runner = start_deliverer()
    wait_until(lambda: runner.deliverer.intake._listener is not None, timeout=5)
    time.sleep(1.0)  # idle by now
    # As a send from another process: this process's deliverers are not woken.
    wakeup.unregister(runner.deliverer.intake.sent)
    batch = send(ALICE, NOTE, [inbox.url("/from-elsewhere")])
    sent = time.monotonic()
    wait_until(lambda: bool(inbox.received), timeout=35)
    took = time.monotonic() - sent
    runner.stop()
    assert took < 3, f"sent {took:.1f} s after it was queued"
    assert status_of(batch) == [Status.DELIVERED]


def test_a_connection_lost_while_idle_is_replaced_before_the_next_send(
    inbox: Inbox,
    start_deliverer: Callable[..., RunningDeliverer],
    settings: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    poll_once_a_minute(settings)
    caplog.set_level(logging.DEBUG, logger="django_federation_delivery")
    opened: list[tuple[int, Any]] = []

    def note(sender: Any, connection: Any, **kwargs: Any) -> None:
        opened.append((threading.get_ident(), connection))

    connection_created.connect(note, weak=False)
    try:
        runner = start_deliverer()
        wait_until_idle(caplog)
    finally:
        connection_created.disconnect(note)
    theirs = [wrapper for ident, wrapper in opened if ident == runner.thread.ident][-1]
    if connection.vendor == "postgresql":
        pid = theirs.connection.info.backend_pid
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_terminate_backend(%s)", [pid])

        def gone() -> bool:
            with connection.cursor() as cursor:
                cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE pid = %s", [pid])
                return cursor.fetchone() == (0,)

        wait_until(gone)
    else:
        theirs.connection.close()
    time.sleep(RECYCLE_EVERY)  # the next round recycles its connections
    batch = send(ALICE, NOTE, [inbox.url()])
    wait_until(settled(batch), timeout=10)
    runner.stop()
    assert status_of(batch) == [Status.DELIVERED]
    unavailable = [m for m in caplog.messages if "database is unavailable" in m]
    assert not unavailable, "replaced before use, not found broken"


def test_signals_are_sent_before_the_row_leaves_the_queue(
    inbox: Inbox, start_deliverer: Callable[..., RunningDeliverer]
) -> None:
    seen: list[str] = []

    def look(sender: Any, settled: Any, **kwargs: Any) -> None:
        seen.append(Delivery.objects.get(id=settled.delivery_id).status)

    signals.delivery_settled.connect(look, weak=False)
    try:
        batch = send(ALICE, NOTE, [inbox.url()])
        runner = start_deliverer()
        wait_until(settled(batch))
        runner.stop()
    finally:
        signals.delivery_settled.disconnect(look)
    assert seen == [Status.PENDING]
    assert status_of(batch) == [Status.DELIVERED]


def test_a_silent_server_holds_threads_not_the_slots_of_others(
    inboxes: Callable[..., Inbox],
    start_deliverer: Callable[..., RunningDeliverer],
    settings: Any,
) -> None:
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "SLOW_AFTER_SECONDS": 0.2,
        "SLOW_CONCURRENCY": 4,
    }
    # Silent until the test has seen the rest delivered (or for 20 s, past the
    # 15 s it waits for them, well within ATTEMPT_TIMEOUT).
    answer = threading.Event()
    silent = inboxes("127.0.0.2")
    silent.respond = lambda request: (answer.wait(20), (202, {}, b""))[1]
    fast = inboxes("127.0.0.3")
    send(ALICE, NOTE, [silent.url(f"/{n}") for n in range(2)])
    runner = start_deliverer(concurrency=2, per_host=2)
    wait_until(lambda: len(silent.received) == 2)
    send(ALICE, NOTE, [fast.url(f"/{n}") for n in range(10)])
    try:
        wait_until(lambda: len(fast.received) == 10, timeout=15)
        assert Delivery.objects.filter(host=silent.host, status=Status.PENDING).count() == 2, (
            "all sent while the silent server still held its two"
        )
    finally:
        answer.set()
    runner.stop()


def test_an_endless_retry_after_is_bounded_and_the_loop_goes_on(
    inbox: Inbox,
    inboxes: Callable[..., Inbox],
    start_deliverer: Callable[..., RunningDeliverer],
    settings: Any,
) -> None:
    # The longest RETRY_AFTER_MAX the checks take and the longest
    # Retry-After the parser takes: a due time past the year 9999 unless bounded.
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "RETRY_AFTER_MAX": LONGEST_WAIT,
        "NEW_WORK_POLL_SECONDS": 0.05,
    }
    inbox.respond = lambda request: (
        (503, {"Retry-After": "999999999999"}, b"") if request.path == "/slow" else (202, {}, b"")
    )
    runner = start_deliverer()
    send(ALICE, NOTE, [inbox.url("/slow")])
    wait_until(lambda: Delivery.objects.filter(attempts=1).exists())
    # To another host: this one rests as it asked (up to 30 s).
    later = send(ALICE, NOTE, [inboxes("127.0.0.3").url("/next")])
    wait_until(settled(later))
    assert runner.thread.is_alive(), "the loop is still running"
    runner.stop()
    row = Delivery.objects.get(inbox=inbox.url("/slow"))
    assert row.status == Status.PENDING and row.due_at is not None
    assert row.due_at <= timezone.now() + dt.timedelta(seconds=LONGEST_WAIT)
    assert row.due_at >= timezone.now() + dt.timedelta(seconds=LONGEST_WAIT - 60)


def test_a_batch_deleted_between_claim_and_read_is_dropped_and_the_loop_goes_on(
    inbox: Inbox,
    start_deliverer: Callable[..., RunningDeliverer],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    doomed = send(ALICE, NOTE, [inbox.url("/doomed")])
    kept = send(ALICE, NOTE, [inbox.url("/kept")])
    assert doomed is not None and kept is not None
    read_batches = claims.batches

    def deleted_meanwhile(ids: Any, **kwargs: Any) -> dict[int, claims.BatchInfo]:
        # An operator deletes the batch, its deliveries with it, just after
        # the deliverer claimed them and just before it reads the batch.
        Batch.objects.filter(pk=doomed.pk).delete()
        return read_batches(ids, **kwargs)

    monkeypatch.setattr(claims, "batches", deleted_meanwhile)
    with caplog.at_level(logging.WARNING, logger="django_federation_delivery.deliverer"):
        runner = start_deliverer()
        wait_until(settled(kept))
        monkeypatch.setattr(claims, "batches", read_batches)
        after = send(ALICE, NOTE, [inbox.url("/after")])
        wait_until(settled(after))
        runner.stop()
    assert sorted(inbox.paths()) == ["/after", "/kept"]
    assert not Delivery.objects.filter(batch_id=doomed.pk).exists()
    assert f"Batch(es) {doomed.pk} were deleted" in caplog.text


@pytest.mark.slow
def test_a_run_with_stop_after_stops_claiming_then_and_finishes_what_is_in_flight(
    inboxes: Callable[..., Inbox],
) -> None:
    slow = inboxes(delay=2.0)
    first = send(ALICE, NOTE, [slow.url("/first")])
    deliverer = Deliverer()
    later: list[Batch] = []

    def send_once_stopping() -> None:
        try:
            wait_until(lambda: deliverer.stopping, timeout=10)
            later.append(send(ALICE, NOTE, [slow.url("/second")]))
        finally:
            # This thread's own connection, as a web request would close it.
            connections.close_all()

    thread = threading.Thread(target=send_once_stopping)
    thread.start()
    started = time.monotonic()
    summary = deliverer.run(stop_after=0.5)
    took = time.monotonic() - started
    thread.join(10)
    assert took >= 2.0, f"returned after {took:.1f} s, before what was in flight was done"
    assert took < 8, f"returned after {took:.1f} s"
    assert summary.delivered == 1
    assert status_of(first) == [Status.DELIVERED]
    assert slow.paths() == ["/first"], "nothing was claimed once stopping"
    waiting = Delivery.objects.get(batch=later[0])
    assert (waiting.status, waiting.attempts) == (Status.PENDING, 0)


def test_an_idle_run_with_stop_after_returns_then_not_at_the_idle_poll(settings: Any) -> None:
    poll_once_a_minute(settings)
    started = time.monotonic()
    Deliverer().run(stop_after=0.3)
    took = time.monotonic() - started
    # Not at the idle poll, a minute away.
    assert 0.3 <= took < 10, f"returned after {took:.1f} s"


@pytest.mark.parametrize("value", [0, -1.0, float("nan")])
def test_a_stop_after_that_is_not_a_positive_number_is_refused_naming_it(value: float) -> None:
    with pytest.raises(ValueError, match=f"not {value!r}"):
        Deliverer().run(stop_after=value)


@pytest.mark.parametrize("value", [float("inf"), 1e10, pytest.param(10**400, id="past-a-float")])
def test_a_stop_after_past_what_a_timer_can_wait_is_refused_not_run_for_ever(
    value: float,
) -> None:
    # Past threading.TIMEOUT_MAX (292 years), the stop timer's thread died
    # of an OverflowError, and the run never stopped.
    deliverer = Deliverer()
    outcome: list[BaseException | Summary] = []

    def run() -> None:
        try:
            outcome.append(deliverer.run(stop_after=value))
        except BaseException as exc:
            outcome.append(exc)
        finally:
            connections.close_all()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(3)
    still_running = thread.is_alive()
    deliverer.stop()
    thread.join(30)
    assert not still_running, "it ran on"
    (error,) = outcome
    assert isinstance(error, ValueError), error
    assert "at most 9.22337e+09" in str(error) and f"not {quoted(value)}" in str(error)


@pytest.mark.slow
def test_a_run_that_loses_the_lock_it_holds_stops_claiming_and_finishes_what_is_in_flight(
    inboxes: Callable[..., Inbox],
) -> None:
    slow = inboxes(delay=2.0)
    first = send(ALICE, NOTE, [slow.url("/first")])
    held = threading.Event()
    held.set()
    deliverer = Deliverer(holding=held.is_set)
    later: list[Batch] = []

    def lose_it_then_send() -> None:
        try:
            wait_until(lambda: slow.received, timeout=10)
            held.clear()  # another round has it now
            wait_until(lambda: deliverer.stopping, timeout=10)
            later.append(send(ALICE, NOTE, [slow.url("/second")]))
        finally:
            connections.close_all()

    thread = threading.Thread(target=lose_it_then_send)
    thread.start()
    started = time.monotonic()
    summary = deliverer.run(stop_after=60)
    took = time.monotonic() - started
    thread.join(10)
    assert took < 10, f"returned after {took:.1f} s"
    assert summary.delivered == 1
    assert status_of(first) == [Status.DELIVERED]
    assert slow.paths() == ["/first"], "nothing was claimed once the lock was lost"
    waiting = Delivery.objects.get(batch=later[0])
    assert (waiting.status, waiting.attempts) == (Status.PENDING, 0)


def skip_every_inbox(inbox: str, activity: dict[str, Any]) -> bool:
    return True


async def _never_skip(inbox: str, activity: dict[str, Any]) -> bool:
    return False


def never_skip_wrapped(inbox: str, activity: dict[str, Any]) -> Any:
    """A plain function around an async one, as a decorator makes it: what
    the checks cannot see is async."""
    return _never_skip(inbox, activity)


@pytest.mark.django_db(transaction=True)
def test_a_callable_setting_answering_a_coroutine_is_taken_as_no_answer(
    inbox: Inbox, settings: Any, caplog: pytest.LogCaptureFixture
) -> None:
    # Its coroutine, never awaited, read as true: every delivery was
    # settled skipped, unsent, with a RuntimeWarning for a trace.
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "SKIP_IF": "tests.test_deliverer.never_skip_wrapped",
    }
    batch = send(ALICE, NOTE, [inbox.url("/a")])
    Deliverer().run(drain=True)
    assert status_of(batch) == [Status.DELIVERED]
    assert "SKIP_IF answered coroutine, which is awaited nowhere" in caplog.text


def test_outcomes_decided_with_nothing_in_flight_wait_to_be_written_together(
    settings: Any,
    monkeypatch: pytest.MonkeyPatch,
    start_deliverer: Callable[..., RunningDeliverer],
) -> None:
    # Claims whose every delivery is settled unsent leave nothing in flight,
    # turn after turn, as a stream of sends does between them: what came of
    # them is written once due, or once a claim finds nothing, not once a claim.
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "SKIP_IF": "tests.test_deliverer.skip_every_inbox",
    }
    send(ALICE, NOTE, [f"https://h{n}.example/inbox" for n in range(40)])
    writes: list[int] = []
    settle = settlements.settle

    def counted(outcomes: list[settlements.Settlement], **kwargs: Any) -> set[int]:
        writes.append(len(outcomes))
        return settle(outcomes, **kwargs)

    monkeypatch.setattr(settlements, "settle", counted)
    # Run as a stream is served (listening, not draining) for however long
    # twenty claims take on a busy machine.
    runner = start_deliverer(concurrency=16, claim_size=2)
    wait_until(lambda: not Delivery.objects.filter(status=Status.PENDING).exists())
    runner.stop()
    assert set(Delivery.objects.values_list("status", flat=True)) == {Status.SKIPPED}
    assert Delivery.objects.count() == 40
    # Twenty claims of two: one write each, before.
    assert sum(writes) == 40 and len(writes) <= 8, writes


def test_a_host_sent_many_at_once_is_sent_them_over_as_many_kept_connections(
    inbox: Inbox, start_deliverer: Callable[..., RunningDeliverer]
) -> None:
    # CONNECTIONS_PER_HOST None: as many kept idle as the host may be sent
    # at once, so that none is closed after one request and opened again
    # (a TCP and TLS handshake, on the internet).
    inbox.delay = 0.05  # so that four are in flight at once
    batch = send(ALICE, NOTE, [inbox.url(f"/users/u{n}/inbox") for n in range(48)])
    runner = start_deliverer(per_host=4, per_host_max=4)
    wait_until(settled(batch))
    runner.stop()
    assert status_of(batch) == [Status.DELIVERED] * 48
    assert inbox.connections <= 4, inbox.connections


@pytest.mark.django_db(transaction=True)
def test_a_portable_inbox_s_later_gateway_is_not_charged_to_the_first_one_s_host(
    inboxes: Callable[..., Inbox],
    start_deliverer: Callable[..., RunningDeliverer],
    settings: Any,
) -> None:
    # Anyone may list gateways for a portable inbox: one that answers 503
    # after a real server's 404 must not open that server's breaker, nor
    # mark it failing, and hold its own deliveries.
    from django_federation_delivery import PortableInbox, send_portable
    from django_federation_delivery.models import Breaker, Host

    # Told at once: a stranger's 503 told as the server failing would be seen.
    quick_breaker(settings, HOST_FAILING_AFTER=0.001)
    told: list[str] = []

    def failing(sender: Any, failing: signals.HostFailing, **kwargs: Any) -> None:
        told.append(failing.host)

    signals.host_failing.connect(failing, weak=False)

    def no_gateway_here(request: Received) -> tuple[int, dict[str, str], bytes]:
        return (404, {}, b"") if "apgateway" in request.path else (202, {}, b"")

    server = inboxes("127.0.0.2", respond=no_gateway_here)
    stranger = inboxes("127.0.0.3", respond=lambda request: (503, {}, b""))
    did = "did:key:z6MkhaXgBZDvotDkL5257faiztiGiC2QtKLGpbnnEGta2doK"
    portable = send_portable(
        ALICE,
        NOTE,
        [
            PortableInbox(f"ap://{did}/u{n}/inbox", [server.url(""), stranger.url("")])
            for n in range(3)
        ],
    )
    assert portable is not None
    runner = start_deliverer()
    wait_until(
        lambda: all(row.attempts for row in Delivery.objects.filter(batch=portable)), timeout=15
    )
    batch = send(ALICE, NOTE, [server.url("/users/bob/inbox")])
    wait_until(settled(batch), timeout=10)
    runner.stop()

    assert status_of(batch) == [Status.DELIVERED]
    signals.host_failing.disconnect(failing)
    assert not Breaker.objects.filter(key=server.host, failures__gt=0).exists()
    assert Host.objects.get(name=server.host).failing_since is None
    assert server.host not in told, "never told failing for the stranger's answers"


# A write made without an attempt keeps what the last attempt met.
LAST_ANSWERED = {**NOTE, "id": f"{ALICE}/activities/1", "object": f"{ALICE}/notes/1"}


@pytest.mark.django_db(transaction=True)
def test_a_deadline_seen_at_the_claim_keeps_the_last_answer_and_tells_it(
    inbox: Inbox,
    start_deliverer: Callable[..., RunningDeliverer],
    failures: list[Any],
) -> None:
    batch = send_batch(ALICE, LAST_ANSWERED, [inbox.url("/a")], {"deadline": dt.timedelta(hours=1)})
    assert batch is not None
    # It was tried once and answered 503; its retry comes due after the
    # batch's deadline has passed.
    Delivery.objects.filter(batch=batch).update(
        attempts=1, last_status=503, last_error="HTTP 503", due_at=timezone.now()
    )
    Batch.objects.filter(pk=batch.pk).update(deadline=timezone.now() - dt.timedelta(seconds=1))
    runner = start_deliverer()
    wait_until(lambda: Batch.objects.filter(pk=batch.pk, finished_at__isnull=False).exists())
    wait_until(lambda: len(failures) == 1, timeout=5)
    runner.stop()
    delivery = Delivery.objects.get(batch=batch)
    assert delivery.status == Status.FAILED
    assert inbox.received == []
    assert (failures[0].deadline, failures[0].status) == (True, 503), (
        "delivery_failed tells the status the inbox last answered with"
    )
    assert delivery.last_status == 503, "the last answer is kept on the row"


@pytest.mark.django_db(transaction=True)
def test_a_paused_hosts_retry_come_due_keeps_its_last_answer(
    inbox: Inbox,
    settings: Any,
    start_deliverer: Callable[..., RunningDeliverer],
) -> None:
    batch = send(ALICE, LAST_ANSWERED, [inbox.url("/a")])
    assert batch is not None
    # An operator pauses the flaky host while an attempt there is in flight;
    # that attempt's retry comes due while the host is paused.
    controls.pause_host(inbox.host)
    Delivery.objects.filter(batch=batch).update(
        attempts=3,
        last_status=503,
        last_error="HTTP 503 Service Unavailable",
        due_at=timezone.now(),
    )
    runner = start_deliverer()
    wait_until(
        lambda: (
            Delivery.objects.filter(batch=batch, lease_token__isnull=True)
            .exclude(due_at=None)
            .filter(due_at__gt=timezone.now() + dt.timedelta(seconds=2))
            .exists()
        ),
        state=lambda: list(Delivery.objects.values("due_at", "lease_token", "last_error")),
    )
    runner.stop()
    delivery = Delivery.objects.get(batch=batch)
    assert inbox.received == []
    assert (delivery.last_status, delivery.last_error) == (
        503,
        "HTTP 503 Service Unavailable",
    ), "holding it for its paused host keeps what it last met"


@pytest.mark.django_db(transaction=True)
def test_a_stopping_deliverers_hand_back_keeps_the_last_answer(
    inboxes: Callable[..., Inbox],
    start_deliverer: Callable[..., RunningDeliverer],
) -> None:
    slow = inboxes("127.0.0.1", delay=1.5)
    other = inboxes("127.0.0.2")
    batch = send(ALICE, LAST_ANSWERED, [slow.url("/first"), other.url("/second")])
    assert batch is not None
    second = Delivery.objects.get(batch=batch, inbox=other.url("/second"))
    # The second was tried before, and is due again.
    Delivery.objects.filter(pk=second.pk).update(
        attempts=1, last_status=503, last_error="HTTP 503 Service Unavailable"
    )
    runner = start_deliverer(concurrency=1)
    # Both claimed; one in flight, the other waiting for the one slot.
    wait_until(lambda: len(slow.received) == 1)
    assert Delivery.objects.filter(batch=batch, lease_token__isnull=False).count() == 2
    runner.stop()
    second.refresh_from_db()
    assert second.status == Status.PENDING and second.attempts == 1
    assert other.received == []
    assert (second.last_status, second.last_error) == (503, "HTTP 503 Service Unavailable"), (
        "handed back unsent, it keeps what its last attempt met"
    )


def test_a_direct_message_committed_after_a_claim_is_not_left_for_a_hosts_rest(
    inboxes: Callable[..., Inbox],
    start_deliverer: Callable[..., RunningDeliverer],
    settings: Any,
) -> None:
    # A web request's transaction (ATOMIC_REQUESTS) sends a direct message,
    # whose due time is written as the send runs, and commits a moment
    # later. Meanwhile the deliverer claims (woken by another send) and
    # finds nothing but a resting host's deliveries. Its commit's wake has
    # the next claim look at all that is due. It looked only for what came
    # due after that claim began, until the rest ended: the message waited.
    if connection.vendor != "postgresql":
        pytest.skip("SQLite's write lock puts the claim after the send's commit")
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "PRIORITY_MAX_INBOXES": 5,
        "BREAKER": None,
        "RETRY": {"BASE": 120, "CAP": 120, "ATTEMPTS": 5, "JITTER": 0},
    }
    answered: list[int] = []

    def busy_after_one(request: Any) -> tuple[int, dict[str, str], bytes]:
        answered.append(1)
        return (202, {}, b"") if len(answered) == 1 else (429, {}, b"")

    busy = inboxes("127.0.0.40", respond=busy_after_one)
    friend = inboxes("127.0.0.9")
    send(ALICE, NOTE, [busy.url(f"/u/{n}") for n in range(12)])
    runner = start_deliverer()
    limits = runner.deliverer.limits
    # Refused at a limit of one again and again, it rests ever longer
    # (0.1 s, 0.2 s, 0.4 s ...), each refused delivery waiting for its retry,
    # those not tried yet due, and left out of the claims while it rests.
    wait_until(
        lambda: limits.rest_left(busy.host) > 3.0,
        timeout=40,
        state=lambda: (len(answered), limits.rest_left(busy.host)),
    )

    def another_send() -> None:
        send(EDNA, NOTE, [busy.url("/other")])
        connections.close_all()

    with transaction.atomic():
        send(ALICE, {"type": "Create", "to": "friend"}, [friend.url()])
        other = threading.Thread(target=another_send)
        other.start()
        other.join()
        time.sleep(0.3)  # the deliverer claims, and finds nothing it may take
    started = time.monotonic()
    rest = limits.rest_left(busy.host)
    wait_until(lambda: bool(friend.received), timeout=10)
    took = time.monotonic() - started
    runner.stop()
    assert took < 1.5, (
        f"a direct message reached its inbox {took:.1f} s after its transaction "
        f"committed, while another host rested ({rest:.1f} s of rest left then)"
    )
