"""The worker pool: attempts on threads that never touch the database (HTTP faked)."""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import responses

from django_federation_delivery.attempt import AttemptResult, Job, failed
from django_federation_delivery.batches import BatchInfo
from django_federation_delivery.channels import Policy
from django_federation_delivery.channels.activitypub import ActivityPub, InboxJob
from django_federation_delivery.hosts import KnownSchemes
from django_federation_delivery.inboxes import InboxDeliveries
from django_federation_delivery.kinds import DeliveryKind
from django_federation_delivery.models import Lane
from django_federation_delivery.settling import Settler, Summary
from django_federation_delivery.signatures import Scheme, SenderKey, body_sha256
from django_federation_delivery.store import Claimed
from django_federation_delivery.transport import TransportSettings, idle
from django_federation_delivery.webhooks.deliveries import WebhookDeliveries
from django_federation_delivery.webhooks.policy import WebhookPolicy
from django_federation_delivery.workers import InFlight, Workers, guarded

from .keys import rsa_key
from .test_limits import answered
from .test_webhooks_attempt import job as webhook_job

INBOX = "https://remote.example/inbox"
BODY = b'{"type":"Create"}'
#: What the kinds' transports may reach: the tests' servers on loopback.
LOOPBACK = TransportSettings(
    user_agent="tests", allowed_networks=(ipaddress.ip_network("127.0.0.0/8"),)
)


def inboxes(settings: TransportSettings = LOOPBACK) -> InboxDeliveries:
    """The inbox kind, as far as workers use it: the attempt and its transport."""
    channel = ActivityPub(is_permanent=lambda status: 400 <= status < 500, error_length=300)
    return InboxDeliveries(
        Settler.from_settings(Summary(), channel.policy()),
        KnownSchemes(Scheme.CAVAGE, lambda *args, **kwargs: None, using="default"),
        settings,
        channel=channel,
    )


def webhooks(settings: TransportSettings = LOOPBACK) -> WebhookDeliveries:
    policy = WebhookPolicy(Policy(allowed_networks=settings.allowed_networks))
    return WebhookDeliveries(policy, policy.settler(Summary()), settings)


def in_flight(number: int, kind: DeliveryKind | None = None) -> InFlight:
    sender = "https://social.example/users/alice"
    return InFlight(
        claimed=Claimed(
            id=number,
            batch_id=1,
            inbox=INBOX,
            host="remote.example",
            attempts=0,
            via=(),
            token="t",
            leased_until=time.time() + 300,
        ),
        batch=BatchInfo(
            id=1,
            sender=sender,
            body=BODY,
            body_sha256=body_sha256(BODY),
            tag="",
            deadline=None,
            max_attempts=None,
            synchronize_collection=False,
            ordered=False,
        ),
        kind=kind or inboxes(),
        job=InboxJob(
            delivery_id=number,
            targets=(INBOX,),
            body=BODY,
            body_sha256=body_sha256(BODY),
            key=SenderKey(f"{sender}#main-key", rsa_key()),
            sender=sender,
            scheme=Scheme.CAVAGE,
        ),
    )


@pytest.fixture
def mocked() -> Iterator[responses.RequestsMock]:
    with responses.RequestsMock(assert_all_requests_are_fired=False) as mock:
        mock.post(INBOX, status=202)
        yield mock


@pytest.fixture
def pool() -> Iterator[Callable[..., Workers]]:
    made: list[Workers] = []

    def make(needed: int = 2) -> Workers:
        workers = Workers(
            TransportSettings(user_agent="tests", idle_timeout=0.2),
            wake=threading.Event(),
            needed=lambda: needed,
            longest=30.0,
        )
        made.append(workers)
        return workers

    yield make
    for workers in made:
        workers.stop()


def results(workers: Workers, count: int) -> list[tuple[InFlight, AttemptResult]]:
    return [workers.results.get(timeout=10) for _ in range(count)]


@pytest.mark.usefixtures("mocked")
def test_each_delivery_handed_over_comes_back_with_its_result(
    pool: Callable[..., Workers],
) -> None:
    workers = pool()
    workers.grow_to(2)
    for number in range(1, 6):
        workers.put(in_flight(number))

    done = results(workers, 5)

    assert sorted(item.claimed.id for item, _ in done) == [1, 2, 3, 4, 5]
    assert all(result.delivered and result.status == 202 for _, result in done)
    assert all(item.started > 0 for item, _ in done)
    assert workers.wake.is_set()


@pytest.mark.usefixtures("mocked")
@pytest.mark.parametrize(
    ("fault", "error"),
    [
        # Python raises an operator's Ctrl-C in the main thread only: one in a
        # worker is the attempt's own doing.
        (KeyError, "internal error: KeyError"),  # a bug
        (KeyboardInterrupt, "internal error: KeyboardInterrupt"),
        (SystemExit, "internal error: SystemExit"),
        (None, "internal error: NoneType returned"),
        ("a token", "internal error: str returned"),
    ],
    ids=["KeyError", "KeyboardInterrupt", "SystemExit", "None", "str"],
)
def test_an_attempt_that_raises_or_returns_no_result_is_a_passing_failure_the_worker_survives(
    pool: Callable[..., Workers],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    fault: Any,
    error: str,
) -> None:
    # Either killed the worker unseen, its delivery never coming back (or,
    # returned, stopped the loop as it read the result).
    kind = inboxes()
    real = kind.attempt

    def attempt(job: Job, *args: Any, **kwargs: Any) -> Any:
        if job.delivery_id == 1:
            if isinstance(fault, type):
                raise fault
            return fault
        return real(job, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(kind, "attempt", attempt)
    workers = pool(needed=1)
    workers.grow_to(1)
    workers.put(in_flight(1, kind))
    workers.put(in_flight(2, kind))

    (first, broken), (second, fine) = results(workers, 2)

    assert (first.claimed.id, second.claimed.id) == (1, 2)
    assert not broken.delivered and not broken.permanent and broken.job is first.job
    assert broken.error == error
    logged = "\n".join(caplog.messages)
    if isinstance(fault, type):
        assert f"An attempt at delivery 1 raised {fault.__name__}" in logged, logged
    else:
        returned = rf"An attempt at delivery 1 by \w+ returned {type(fault).__name__},"
        assert re.search(returned, logged), logged
    assert "a token" not in logged and INBOX not in logged, "nothing of the job or result"
    assert fine.delivered
    assert len(workers) == 1 and all(thread.is_alive() for thread in workers._threads)


#: What a kind's result may hold that the loop cannot read, and how it is told.
UNREADABLE = [
    # A Retry-After header's text, passed on as it was read.
    ("retry_after", "Thu, 01 Jan SECRET", "retry_after (str) is not seconds"),
    ("retry_after", -1.0, "retry_after (float) is not seconds"),
    ("retry_after", float("nan"), "retry_after (float) is not seconds"),
    ("retry_after", True, "retry_after (bool) is not seconds"),
    # An int past any float (read from a hostile body's digits): the check
    # itself raised OverflowError, and the worker thread died with its slot.
    ("retry_after", 10**400, "retry_after (int) is not seconds"),
    ("duration", 10**400, "duration (int) is not seconds (not negative, at most a day)"),
    ("error", None, "error (NoneType) is not a str"),
    ("status", "503 SECRET", "status (str) is not an HTTP status (100 to 999) or None"),
    # Not a status the database keeps (its column is a small integer).
    ("status", 70000, "status (int) is not an HTTP status (100 to 999) or None"),
    ("delivered", 1, "delivered (int) is not True or False"),
    ("permanent", "SECRET", "permanent (str) is not True or False"),
    ("accepted_scheme", "cavage", "accepted_scheme (str) is not a Scheme or None"),
    ("duration", float("inf"), "duration (float) is not seconds (not negative, at most a day)"),
    # Finite, but past what a timedelta (1e11) or the answer times' float32
    # samples (1e39) hold: the loop raised OverflowError, or wrote no host's
    # picture while the sample was kept.
    ("duration", 1e11, "duration (float) is not seconds (not negative, at most a day)"),
    ("duration", 1e39, "duration (float) is not seconds (not negative, at most a day)"),
    ("requests", -1, "requests (int) is not a count (not negative)"),
    ("held", None, "held (NoneType) is not True or False"),
    ("elsewhere", "SECRET", "elsewhere (str) is not True or False"),
]


@pytest.mark.usefixtures("mocked")
@pytest.mark.parametrize(
    ("field", "value", "fault"),
    UNREADABLE,
    ids=[f"{field}={value!r:.20}" for field, value, _fault in UNREADABLE],
)
def test_a_result_the_loop_cannot_read_is_a_passing_failure_told_by_its_field_and_type(
    pool: Callable[..., Workers],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    field: str,
    value: Any,
    fault: str,
) -> None:
    # What the loop made of it (decide(), the settler) raised in the loop's
    # own thread: run() ended, every delivery it held left leased.
    kind = inboxes()
    real = kind.attempt

    def attempt(job: Job, *args: Any, **kwargs: Any) -> Any:
        result = real(job, *args, **kwargs)  # type: ignore[arg-type]
        return dataclasses.replace(result, **{"delivered": False, field: value})

    monkeypatch.setattr(kind, "attempt", attempt)
    workers = pool(needed=1)
    workers.grow_to(1)
    workers.put(in_flight(1, kind))

    ((item, result),) = results(workers, 1)

    assert result.delivered is False and result.permanent is False and not result.held
    assert result.retry_after is None and result.job is item.job
    assert result.error.startswith(f"internal error: the result's {fault}"), result.error
    logged = "\n".join(caplog.messages)
    assert re.search(
        r"An attempt at delivery 1 by \w+ returned a result the loop cannot read", logged
    )
    assert fault in logged and "a failed attempt" in logged, logged
    assert "SECRET" not in logged + result.error, "the type, never the value"


@pytest.mark.usefixtures("mocked")
def test_a_delivered_result_the_loop_cannot_read_stays_delivered(
    pool: Callable[..., Workers],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Sent and taken: made a failure, it would be sent again, and received twice.
    kind = inboxes()
    real = kind.attempt

    def attempt(job: Job, *args: Any, **kwargs: Any) -> Any:
        result = real(job, *args, **kwargs)  # type: ignore[arg-type]
        return dataclasses.replace(result, error=None, duration="SECRET")

    monkeypatch.setattr(kind, "attempt", attempt)
    workers = pool(needed=1)
    workers.grow_to(1)
    workers.put(in_flight(1, kind))

    ((_item, result),) = results(workers, 1)

    assert result.delivered is True and result.status == 202
    assert (result.error, result.duration) == ("", 0.0)
    logged = "\n".join(caplog.messages)
    assert "error (NoneType) is not a str; duration (str) is not seconds" in logged, logged
    assert "kept as delivered" in logged and "SECRET" not in logged


def test_an_attempts_error_comes_back_escaped_as_an_answers_text_is(
    pool: Callable[..., Workers], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A host project's kind that tells what it met as it met it: a NUL, which
    # PostgreSQL's text refuses, and an escape sequence, which a terminal
    # showing the log acts on.
    kind = inboxes()

    def attempt(job: Job, *args: Any, **kwargs: Any) -> AttemptResult:
        error = "answered: \x00\x1b[2J\ud800 café" if job.delivery_id == 1 else "answered: café"
        return failed(job, error, permanent=False)

    monkeypatch.setattr(kind, "attempt", attempt)
    workers = pool()
    workers.grow_to(2)
    for number in (1, 2):
        workers.put(in_flight(number, kind))

    raw, plain = (
        result for _, result in sorted(results(workers, 2), key=lambda done: done[0].claimed.id)
    )

    assert raw.error == "answered: \\x00\\x1b[2J\\ud800 café"
    assert plain.error == "answered: café", "what is printable is kept as it is"


@pytest.mark.usefixtures("mocked")
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_thread_that_ends_however_it_ends_is_counted_no_longer(
    pool: Callable[..., Workers],
) -> None:
    # A thread that died stayed counted: the pool never made another in its
    # place, and stopping waited for it.
    workers = pool(needed=1)

    class Ends:
        """A wake that ends the thread that sets it, once."""

        def __init__(self) -> None:
            self.ended = False

        def set(self) -> None:
            if not self.ended:
                self.ended = True
                raise SystemExit  # ends a thread without a word

    workers.wake = Ends()  # type: ignore[assignment]
    workers.grow_to(1)
    (thread,) = workers._threads
    workers.put(in_flight(1))
    results(workers, 1)
    # Joined, so that it has ended, and its SystemExit been reported, within
    # this test (whose filter it meets), not during the next one.
    thread.join(10)
    assert not thread.is_alive()
    assert len(workers) == 0
    workers.grow_to(1)
    workers.put(in_flight(2))
    ((item, result),) = results(workers, 1)
    assert item.claimed.id == 2 and result.delivered
    assert len(workers) == 1


@pytest.mark.usefixtures("mocked")
def test_a_thread_beyond_what_is_needed_ends_after_its_attempt(
    pool: Callable[..., Workers],
) -> None:
    needed = [4]
    workers = pool()
    workers.needed = lambda: needed[0]
    workers.grow_to(4)
    assert len(workers) == 4

    needed[0] = 1
    for number in range(1, 4):
        workers.put(in_flight(number))
    results(workers, 3)

    deadline = time.monotonic() + 10
    while len(workers) > 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(workers) == 1


def test_a_result_wakes_the_coordinator_only_with_work_to_hand_out_or_results_to_take(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # CONCURRENCY 8: a result wakes it when fewer than 4 jobs wait, or 2 results.
    workers = Workers(
        TransportSettings(user_agent="tests"),
        wake=threading.Event(),
        needed=lambda: 1,
        longest=30.0,
        concurrency=8,
    )
    go = threading.Semaphore(0)

    def attempt(item: InFlight, *args: Any) -> AttemptResult:
        assert go.acquire(timeout=10)
        return AttemptResult(
            job=item.job,
            delivered=True,
            status=202,
            error="",
            permanent=False,
            retry_after=None,
            accepted_scheme=None,
            duration=0.0,
        )

    monkeypatch.setattr(workers, "_attempt", attempt)

    def finished(count: int) -> None:
        deadline = time.monotonic() + 10
        while workers.results.qsize() < count and time.monotonic() < deadline:
            time.sleep(0.005)
        assert workers.results.qsize() == count

    try:
        for number in range(1, 9):
            workers.put(in_flight(number))
        workers.grow_to(1)
        go.release()
        finished(1)
        # Six jobs still wait, one result: nothing to do yet.
        assert not workers.wake.is_set()
        go.release()
        finished(2)
        assert workers.wake.is_set()  # two results
        workers.wake.clear()
        workers.results.get_nowait()
        workers.results.get_nowait()
        for waiting in (5, 4):
            go.release()
            finished(1)
            # Five jobs wait, then four: not yet short.
            assert not workers.wake.is_set(), waiting
            workers.results.get_nowait()
        go.release()
        finished(1)
        # Three wait: time to hand out more.
        assert workers.wake.is_set()
    finally:
        for _ in range(8):
            go.release()
        workers.stop()


def test_what_waits_for_a_free_worker_can_be_taken_back(pool: Callable[..., Workers]) -> None:
    workers = pool()  # no thread started: everything put waits
    for number in range(1, 4):
        workers.put(in_flight(number))

    assert [item.claimed.id for item in workers.take_queued()] == [1, 2, 3]
    assert workers.take_queued() == []


@pytest.mark.usefixtures("mocked")
def test_an_urgent_delivery_is_taken_by_the_next_free_worker_before_those_queued(
    pool: Callable[..., Workers],
) -> None:
    # A webhook event or a direct message handed out while a fan-out's
    # deliveries waited in the workers' queue waited behind them.
    workers = pool(needed=1)
    for number in range(1, 4):
        workers.put(in_flight(number))
    urgent = in_flight(4)
    urgent.batch = urgent.batch._replace(lane=Lane.PRIORITY)
    workers.put(urgent)
    workers.grow_to(1)
    assert [item.claimed.id for item, _ in results(workers, 4)] == [4, 1, 2, 3]
    workers.put(urgent)
    assert [item.claimed.id for item in workers.take_queued()] == [4], "taken back too"


# Keep-alive inboxes on many ports, in a process of their own so that only the
# client's sockets are this process's.
SERVERS = """
import sys, threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    timeout = 60

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.send_response(202)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass

servers = [ThreadingHTTPServer(("127.0.0.1", 0), Handler) for _ in range(int(sys.argv[1]))]
for server in servers:
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
print(" ".join(str(server.server_address[1]) for server in servers), flush=True)
sys.stdin.read()
"""


@pytest.fixture
def ports() -> Iterator[list[int]]:
    """200 inboxes on 127.0.0.1, each on a port (a connection pool) of its own."""
    process = subprocess.Popen(
        [sys.executable, "-c", SERVERS, "200"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None and process.stdin is not None
    try:
        yield [int(port) for port in process.stdout.readline().split()]
    finally:
        process.stdin.close()  # it reads to the end, then exits
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        process.stdout.close()


def loopback_workers(needed: int, **settings: Any) -> Workers:
    """Workers that may send to 127.0.0.0/8, with these transport settings."""
    return Workers(
        dataclasses.replace(LOOPBACK, **settings),
        wake=threading.Event(),
        needed=lambda: needed,
        longest=30.0,
    )


def open_sockets() -> set[str]:
    """This process's open sockets, as /proc names them ("socket:[inode]")."""
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # closed meanwhile, or the directory's own descriptor
        if link.startswith("socket:"):
            found.add(link)
    return found


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts sockets in /proc")
def test_sending_to_many_hosts_leaves_no_more_sockets_open_than_the_bound(
    ports: list[int],
) -> None:
    limit = 8
    # Nothing closed for being idle long: only the bound can close them.
    workers = loopback_workers(16, idle_timeout=300, max_idle_connections=limit)
    before = open_sockets()
    try:
        workers.grow_to(16)
        for number, port in enumerate(ports, start=1):
            item = in_flight(number)
            item.job = dataclasses.replace(item.job, targets=(f"http://127.0.0.1:{port}/inbox",))
            workers.put(item)
        done = results(workers, len(ports))

        # Every attempt is over once its result is in: what is left open is idle.
        left = open_sockets() - before
    finally:
        workers.stop()

    assert [result.status for _, result in done] == [202] * len(ports)
    assert 0 < len(left) <= limit
    assert len(idle.IDLE) == 0, "closed with the workers"


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts sockets in /proc")
@pytest.mark.parametrize("kind", ["inbox", "webhook"])
def test_deliveries_to_one_host_reuse_one_connection_whichever_worker_sends_them(
    ports: list[int], kind: str
) -> None:
    workers = loopback_workers(8)
    url = f"http://127.0.0.1:{ports[0]}/inbox"
    before = open_sockets()
    try:
        workers.grow_to(8)
        statuses = []
        for number in range(1, 25):  # one at a time: each finds the last one's connection idle
            item = in_flight(number)
            if kind == "inbox":
                item.job = dataclasses.replace(item.job, targets=(url,))
            else:
                item.kind = webhooks()
                item.job = webhook_job(url.replace("http://", "slack+http://"))
            workers.put(item)
            statuses += [result.status for _, result in results(workers, 1)]
        left = open_sockets() - before
    finally:
        workers.stop()

    assert statuses == [202] * 24
    assert len(left) == 1
    assert len(idle.IDLE) == 0, "closed with the workers"


def test_a_keep_alive_connection_unused_for_the_idle_timeout_is_closed_while_its_host_is_used(
    inboxes: Callable[..., Any],
) -> None:
    # A pool hands out its most recently used connection first: after a
    # burst, the others lay under it, never taken, never closed, as long as
    # the host was sent to one at a time.
    from django_federation_delivery.transport import Connections, Transport

    from .conftest import Overlap

    inbox = inboxes(respond=Overlap(202, 0.0, together=4, wait=10))
    settings = TransportSettings(
        user_agent="t",
        allowed_networks=(ipaddress.ip_network("127.0.0.0/8"),),
        connections_per_host=4,
        idle_timeout=0.5,
    )
    connections = Connections(settings)
    transports = [Transport(settings, connections) for _ in range(4)]
    try:
        burst = [threading.Thread(target=t.post, args=(inbox.url(), b"{}", {})) for t in transports]
        for thread in burst:
            thread.start()
        for thread in burst:
            thread.join(20)
        assert inbox.connections == 4
        until = time.monotonic() + 1.5
        while time.monotonic() < until:
            transports[0].post(inbox.url(), b"{}", {})
            time.sleep(0.1)
        with idle.IDLE.lock:
            left = sum(1 for conn in idle.IDLE._idle if conn.port == inbox.port)
        assert left == 1, f"{left - 1} connections unused for 1.5 s still open"
    finally:
        connections.close()


class _Touchy(float):
    """A float subclass a kind's own code may hold (a unit type), whose
    comparison with a plain number raises."""

    def __ge__(self, other: object) -> bool:
        raise TypeError("compare units, not numbers")

    def __le__(self, other: object) -> bool:
        raise TypeError("compare units, not numbers")


def test_a_delivered_result_whose_duration_cannot_be_compared_stays_delivered() -> None:
    """A delivered result whose duration's comparisons raise was made a
    crashed attempt, a passing failure: retried, delivered twice."""
    result = dataclasses.replace(answered(202), duration=_Touchy(0.1))
    read = guarded(
        result.job, lambda: result, started=time.monotonic(), what="delivery 1", by="Kind"
    )
    assert read.delivered is True and read.error == ""
