"""Circuit breakers: the decisions in memory, the shared state in the database."""

from __future__ import annotations

import collections
import datetime as dt
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from django.db import OperationalError, connections
from django.utils import timezone

from django_federation_delivery import PortableInbox, breakers, overview, send, send_portable
from django_federation_delivery.breakers import (
    HELD_BY_BREAKER,
    Breakers,
    BreakerSettings,
    Decision,
    Scope,
    State,
    admit,
)
from django_federation_delivery.deliverer import Deliverer
from django_federation_delivery.dialect import aware_now
from django_federation_delivery.models import Breaker, Delivery, Status
from django_federation_delivery.store import CLAIM_ORDER

from .conftest import Inbox, Overlap, Received, RunningDeliverer, wait_until
from .keys import ALICE
from .operators import NOTE, open_breaker, quick_breaker
from .test_federation import DID
from .test_held_released import release_fails_once

NOW = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
SECOND = dt.timedelta(seconds=1)
SETTINGS = BreakerSettings(threshold=2, cool_off=60.0)


def test_a_destination_with_no_row_passes() -> None:
    assert admit(None, NOW) == (Decision.PASS, 0.0)
    assert admit(State(5, None, None), NOW) == (Decision.PASS, 0.0)


def test_an_open_breaker_holds_until_its_cool_off_ends_then_offers_a_probe() -> None:
    state = State(0, NOW + 30 * SECOND, None)
    assert admit(state, NOW) == (Decision.HOLD, 30.0)
    assert admit(state, NOW + 30 * SECOND)[0] is Decision.PROBE


def test_others_are_held_while_a_probe_is_under_way_and_not_after_it_lapses() -> None:
    probing = State(0, NOW - SECOND, NOW + 60 * SECOND)
    assert admit(probing, NOW)[0] is Decision.HOLD
    assert admit(probing, NOW + 61 * SECOND)[0] is Decision.PROBE, "a silent probe is given up"


def test_the_scope_picks_the_key() -> None:
    assert BreakerSettings(scope=Scope.HOST).key("a.example", "https://a.example/i") == "a.example"
    assert BreakerSettings(scope=Scope.INBOX).key("a.example", "https://a.example/i") == (
        "https://a.example/i"
    )
    # An inbox's query and userinfo may be credentials: the key, shown and in
    # the admin's URLs, has neither.
    inbox = "https://bot:pw0rd@a.example/i?token=s3cretvalue"
    assert BreakerSettings(scope=Scope.INBOX).key("a.example", inbox) == "https://a.example/i"


@pytest.mark.django_db(transaction=True)
class TestTheDatabaseSide:
    def breakers(self) -> Breakers:
        breakers = Breakers(SETTINGS)
        breakers.refresh()
        return breakers

    def fail(self, breakers: Breakers, times: int = 1) -> None:
        for _ in range(times):
            breakers.record("a.example", failed=True, probe="", now=timezone.now())
        breakers.flush()

    def test_failures_in_a_row_open_it_and_a_success_while_closed_starts_again(self) -> None:
        breakers = self.breakers()
        self.fail(breakers)
        breakers.record("a.example", failed=False, probe="", now=timezone.now())
        breakers.flush()
        assert not Breaker.objects.exists(), "a success forgets the count"
        self.fail(breakers)
        assert Breaker.objects.get().open_until is None
        self.fail(breakers)
        assert Breaker.objects.get().open_until is not None
        assert breakers.admit("a.example", timezone.now())[0] is Decision.HOLD

    def test_a_success_sent_before_it_opened_does_not_close_it(self) -> None:
        breakers = self.breakers()
        self.fail(breakers, 2)
        breakers.record("a.example", failed=False, probe="", now=timezone.now())
        breakers.flush()
        assert Breaker.objects.get().open_until is not None

    def test_two_processes_count_failures_together(self) -> None:
        one, other = self.breakers(), self.breakers()
        self.fail(one)
        self.fail(other)
        assert Breaker.objects.get().open_until is not None
        one.refresh()
        assert one.admit("a.example", timezone.now())[0] is Decision.HOLD

    def test_one_probe_at_a_time_among_all_then_its_outcome_decides(self) -> None:
        self.fail(self.breakers(), 2)
        Breaker.objects.update(open_until=timezone.now() - SECOND)
        contenders = [self.breakers() for _ in range(4)]
        decisions = [b.admit("a.example", timezone.now()) for b in contenders]
        probes = [d for d in decisions if d[0] is Decision.PROBE]
        assert len(probes) == 1
        winner = contenders[[d[0] for d in decisions].index(Decision.PROBE)]
        winner.record("a.example", failed=True, probe=probes[0][1], now=timezone.now())
        winner.flush()
        row = Breaker.objects.get()
        assert row.open_until is not None and row.open_until > timezone.now() + 50 * SECOND
        assert row.probe_token == ""
        Breaker.objects.update(open_until=timezone.now() - SECOND)
        again = self.breakers()
        decision, token, _ = again.admit("a.example", timezone.now())
        assert decision is Decision.PROBE
        again.record("a.example", failed=False, probe=token, now=timezone.now())
        again.flush()
        assert not Breaker.objects.exists(), "a successful probe closes it"

    def test_probes_taken_concurrently_by_threads_go_to_one(self) -> None:
        self.fail(self.breakers(), 2)
        Breaker.objects.update(open_until=timezone.now() - SECOND)
        tokens: list[str | None] = []
        barrier = threading.Barrier(6)

        def take() -> None:
            try:
                barrier.wait()
                tokens.append(breakers.take_probe("a.example", cool_off=60))
            finally:
                connections.close_all()

        threads = [threading.Thread(target=take) for _ in range(6)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        assert len([t for t in tokens if t]) == 1

    def test_closed_rows_nothing_touched_for_a_while_are_forgotten(self) -> None:
        self.fail(self.breakers())
        Breaker.objects.update(updated_at=timezone.now() - dt.timedelta(hours=1))
        assert breakers.breaker_rows(forget_after=600) == []

    def test_one_open_long_ago_whose_probe_never_reported_back_is_forgotten(self) -> None:
        # Its probe was taken and never reported back (the deliverer killed,
        # or the probe put back unsent as it stopped): the row counted as a
        # probe under way for ever, open in the gauge and the admin.
        hour, now = dt.timedelta(hours=1), timezone.now()
        Breaker.objects.create(key="gone.example", failures=10, open_until=now - 2 * hour)
        assert breakers.take_probe("gone.example", cool_off=60.0)
        Breaker.objects.update(probe_until=now - hour, updated_at=now - 2 * hour)
        assert breakers.breaker_rows(forget_after=600) == []
        assert overview.open_breakers() == 0

    def test_reading_the_rows_writes_nothing_while_none_is_stale(
        self, django_assert_num_queries: Any
    ) -> None:
        self.fail(self.breakers())
        Breaker.objects.create(
            key="probed.example",
            failures=10,
            open_until=timezone.now() - dt.timedelta(hours=1),
            probe_until=timezone.now() + dt.timedelta(seconds=30),
            updated_at=timezone.now() - dt.timedelta(hours=1),
        )
        with django_assert_num_queries(1):  # one SELECT: no DELETE, no lock taken
            rows = breakers.breaker_rows(forget_after=600)
        assert sorted(row.key for row in rows) == ["a.example", "probed.example"]

    def test_an_empty_table_is_read_with_one_statement(
        self, django_assert_num_queries: Any
    ) -> None:
        with django_assert_num_queries(1):
            assert breakers.breaker_rows(forget_after=600) == []


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_failing_host_is_held_after_the_threshold_and_probed_after_the_cool_off(
    inboxes: Callable[..., Inbox],
    start_deliverer: Callable[..., RunningDeliverer],
    settings: Any,
) -> None:
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "BREAKER": {"THRESHOLD": 3, "COOL_OFF": 1.0, "SCOPE": "host"},
        "RETRY": {"BASE": 0.2, "CAP": 0.2, "ATTEMPTS": 50, "JITTER": 0},
    }
    healthy = {"now": False}
    arrived: list[float] = []

    def respond(request: Received) -> tuple[int, dict[str, str], bytes]:
        arrived.append(time.time())
        return (202, {}, b"") if healthy["now"] else (503, {}, b"")

    down = inboxes("127.0.0.2", respond=respond)
    send(ALICE, {"type": "Note"}, [down.url(f"/{n}") for n in range(20)])
    runner = start_deliverer(concurrency=4, per_host=4)
    wait_until(lambda: Breaker.objects.filter(open_until__isnull=False).exists())
    open_until = Breaker.objects.get().open_until
    assert open_until is not None
    until = open_until.timestamp()
    wait_until(lambda: runner.deliverer.summary.held >= 20)
    # Between its opening and the end of its cool-off (the times of the row,
    # whenever this looked), nothing is sent to the host but what was already
    # in flight when it opened: at most the other three of the four allowed.
    # Without the breaker, 503s retried after 0.2 s come four at a time.
    while_open = [at for at in arrived if until - 1.0 <= at < until]
    assert len(while_open) <= 3, "held, not sent"
    healthy["now"] = True
    wait_until(lambda: not Delivery.objects.filter(status=Status.PENDING).exists(), timeout=30)
    runner.stop()
    assert not Breaker.objects.exists(), "closed by a probe's success"


@pytest.mark.django_db(transaction=True)
def test_a_paused_host_is_held_not_failed_until_resumed(
    inboxes: Callable[..., Inbox], start_deliverer: Callable[..., RunningDeliverer]
) -> None:
    from django_federation_delivery.controls import pause_host, resume_host

    sink = inboxes("127.0.0.2")
    other = inboxes("127.0.0.3")
    # A host on a port that is not the scheme's default is named with it.
    assert pause_host(sink.host) == 0
    send(ALICE, {"type": "Note"}, [sink.url("/a"), other.url("/b")])
    runner = start_deliverer()
    wait_until(lambda: len(other.received) == 1)
    paused = Delivery.objects.get(host=sink.host)
    assert (paused.status, paused.due_at, paused.attempts) == (Status.PENDING, None, 0)
    assert sink.received == []
    assert resume_host(sink.url("/")) == 1
    wait_until(lambda: len(sink.received) == 1, timeout=5)
    runner.stop()


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_host_paused_while_its_delivery_waits_for_a_slot_is_not_sent_it(
    inboxes: Callable[..., Inbox], start_deliverer: Callable[..., RunningDeliverer]
) -> None:
    from django_federation_delivery.controls import pause_host

    # The pause was looked at only at the claim: a delivery claimed with a
    # slow host's, waiting for a slot, was sent once one was free, seconds
    # after its host was paused.
    slow, paused = inboxes("127.0.0.2", delay=1.5), inboxes("127.0.0.3")
    send(ALICE, {"type": "Note"}, [slow.url(f"/{n}") for n in range(2)])
    send(ALICE, {"type": "Note"}, [paused.url("/inbox")])
    # One slot, and one more queued for the worker: the slow host's two take
    # them, and the other's, claimed with them, waits ready.
    runner = start_deliverer(concurrency=1, per_host=2, per_host_max=2)
    wait_until(lambda: len(slow.received) == 1)
    assert [d.host for d in runner.deliverer.in_hand().ready] == [paused.host]
    pause_host(paused.host)
    row = Delivery.objects.filter(host=paused.host)
    wait_until(lambda: row.get().lease_token is None, timeout=10)
    runner.stop()
    assert paused.received == []
    assert (row.get().status, row.get().attempts) == (Status.PENDING, 0)


@pytest.mark.django_db(transaction=True)
def test_a_dead_port_named_on_a_host_opens_its_own_breaker_not_the_host_s(
    inboxes: Callable[..., Inbox],
    closed_port: Callable[[], int],
    start_deliverer: Callable[..., RunningDeliverer],
    settings: Any,
) -> None:
    # Anyone may name an inbox on any port of a host: what fails there is
    # that port's, and the host's own server goes on being sent to.
    quick_breaker(settings)
    server = inboxes("127.0.0.1")
    dead = f"127.0.0.1:{closed_port()}"
    send(ALICE, {"type": "Note"}, [f"http://{dead}/u{n}/inbox" for n in range(4)])
    runner = start_deliverer()
    wait_until(lambda: Breaker.objects.filter(open_until__isnull=False).exists())
    batch = send(ALICE, {"type": "Note"}, [server.url("/users/bob/inbox")])
    assert batch is not None
    wait_until(lambda: Delivery.objects.filter(batch=batch, status=Status.DELIVERED).exists())
    runner.stop()
    assert list(Breaker.objects.values_list("key", flat=True)) == [dead]
    assert Delivery.objects.filter(host=dead, status=Status.PENDING).count() == 4


@pytest.mark.django_db(transaction=True)
def test_giving_up_a_host_fails_its_pending_deliveries_and_tells_receivers() -> None:
    from django_federation_delivery import signals
    from django_federation_delivery.controls import give_up, give_up_host, requeue

    batch = send(
        ALICE,
        {"type": "Note"},
        ["https://gone.example/a", "https://gone.example/b", "https://fine.example/c"],
    )
    failures: list[Any] = []
    finished: list[int] = []

    def failed(sender: Any, failure: Any, **kwargs: Any) -> None:
        failures.append(failure)

    def done(sender: Any, batch: Any, **kwargs: Any) -> None:
        finished.append(batch.id)

    signals.delivery_failed.connect(failed, weak=False)
    signals.batch_finished.connect(done, weak=False)
    try:
        assert give_up_host("gone.example") == 2
        counts = collections.Counter(Delivery.objects.values_list("host", "status"))
        assert counts == {("gone.example", "failed"): 2, ("fine.example", "pending"): 1}
        assert {f.inbox for f in failures} == {"https://gone.example/a", "https://gone.example/b"}
        assert finished == []
        assert requeue(Delivery.objects.filter(host="gone.example")) == 2
        assert batch is not None
        batch.refresh_from_db()
        assert batch.remaining == 3
        assert give_up_host("gone.example") == 2
        give_up(Delivery.objects.filter(host="fine.example"))
        assert finished == [batch.id]
    finally:
        signals.delivery_failed.disconnect(failed)
        signals.batch_finished.disconnect(done)


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_host_down_for_a_while_gets_everything_once_it_is_back(
    inboxes: Callable[..., Inbox],
    start_deliverer: Callable[..., RunningDeliverer],
    settings: Any,
) -> None:
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "BREAKER": {"THRESHOLD": 10, "COOL_OFF": 0.5, "SCOPE": "host"},
        "RETRY": {"BASE": 0.3, "CAP": 0.6, "ATTEMPTS": 100, "JITTER": 0.25},
    }
    lock = threading.Lock()
    down_since: list[float] = []
    failed: list[float] = []

    def down_for_a_while(request: Received) -> tuple[int, dict[str, str], bytes]:
        # Down for 1.5 s from the first request: three cool-offs.
        with lock:
            now = time.monotonic()
            if not down_since:
                down_since.append(now)
            if now - down_since[0] < 1.5:
                failed.append(now)
                return 503, {}, b""
        return 202, {}, b""

    server = inboxes("127.0.0.2", respond=down_for_a_while)
    send(ALICE, {"type": "Note"}, [server.url(f"/{n}") for n in range(50)])
    runner = start_deliverer()
    wait_until(lambda: Delivery.objects.filter(status=Status.DELIVERED).count() == 50, timeout=30)
    runner.stop()
    # Without a breaker, each of the 50 fails at least once while the host
    # is down. With one: the 10 failures that open it, what was already on
    # its way then (PER_HOST, 2), and a probe each cool-off while it is down.
    assert len(failed) <= 10 + 2 + 4, f"{len(failed)} requests failed: held while down"


@pytest.mark.django_db(transaction=True)
def test_a_held_hosts_backlog_keeps_no_other_host_waiting_and_is_claimed_in_the_room_left() -> None:
    # A host whose breaker is open, and its backlog, due before anything else
    # and more than a claim looks at (four rows for each of the 64 it takes).
    Breaker.objects.create(key="down.example", open_until=timezone.now() + 60 * SECOND)
    send(ALICE, {"type": "Note"}, [f"https://down.example/{n}" for n in range(300)])
    send(ALICE, {"type": "Note"}, ["https://up.example/inbox"])
    # The claim's make-up, which no run shows from outside: the loop's parts by hand.
    deliverer = Deliverer(concurrency=4, per_host=2, claim_size=64)
    deliverer.upkeep.refresh()
    deliverer.intake.claim_more()
    hosts = collections.Counter(held.host for held in deliverer.in_hand().ready)
    # Left out of the claim, the held host's backlog no longer fills its window
    # (the claim took two of it, PER_HOST, and nothing else); what is due to it
    # is claimed in the room left, for its breaker to hold again.
    assert hosts == {"up.example": 1, "down.example": 63}
    assert not deliverer.intake.caught_up


@pytest.mark.django_db(transaction=True)
def test_a_held_hosts_backlog_keeps_no_other_host_waiting(
    inboxes: Callable[..., Inbox], start_deliverer: Callable[..., RunningDeliverer]
) -> None:
    # A host whose breaker is open, and its backlog, due before anything else
    # and more than a claim looks at (four rows for each of the 64 it takes).
    Breaker.objects.create(key="down.example", open_until=timezone.now() + 60 * SECOND)
    send(ALICE, {"type": "Note"}, [f"https://down.example/{n}" for n in range(300)])
    up = inboxes("127.0.0.3")
    send(ALICE, {"type": "Note"}, [up.url()])
    runner = start_deliverer(concurrency=4, per_host=2, claim_size=64)
    wait_until(lambda: len(up.received) == 1, timeout=10)
    runner.stop()
    # Delivered while the held host's backlog waits, none of it sent or lost.
    down = Delivery.objects.filter(host="down.example")
    assert down.filter(status=Status.PENDING).count() == 300
    assert not down.filter(last_status__isnull=False).exists()


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_an_idle_loop_without_listen_claims_no_more_for_a_held_hosts_due_delivery() -> None:
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    Breaker.objects.create(key="down.example", open_until=timezone.now() + 60 * SECOND)

    def send_soon() -> None:
        # From a web process, as it were, while the loop idles.
        time.sleep(0.3)
        try:
            send(ALICE, {"type": "Note"}, ["https://down.example/inbox"])
        finally:
            connections.close_all()

    sender = threading.Thread(target=send_soon)
    with CaptureQueriesContext(connection) as queries:
        sender.start()
        summary = Deliverer(concurrency=4, per_host=2, claim_size=64).run(stop_after=2.5)
    sender.join()
    assert summary.held == 1  # at the held host's next pass
    # Due at once but left out of the claims until that pass, it is no reason
    # to claim again at each look for new work (every NEW_WORK_POLL_SECONDS
    # without LISTEN): a claim at the start, when it was sent, at the pass
    # and after it (4); before, one at each look too (10 in 2.5 s).
    claims = [
        q["sql"]
        for q in queries.captured_queries
        if "due_at <= " in q["sql"]
        and not q["sql"].startswith("SELECT EXISTS")
        # The held hosts' own claim, at their pass: the only one that names
        # the hosts it takes, where the others' list is NULL.
        and ("NULL IS NULL" in q["sql"] or "NULL::varchar[] IS NULL" in q["sql"])
    ]
    rounds = len(claims) if connection.vendor == "postgresql" else len(claims) / len(CLAIM_ORDER)
    assert rounds <= 6, len(claims)


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_two_deliverers_count_failures_together_and_probe_one_at_a_time(
    inboxes: Callable[..., Inbox],
    start_deliverer: Callable[..., RunningDeliverer],
    settings: Any,
) -> None:
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "BREAKER": {"THRESHOLD": 6, "COOL_OFF": 0.5, "SCOPE": "host"},
        "RETRY": {"BASE": 0.2, "CAP": 0.2, "ATTEMPTS": 100, "JITTER": 0},
    }
    # The first four answered together: two from each deliverer.
    slow_503 = Overlap(503, delay=0.05, together=4)
    down = inboxes("127.0.0.2", respond=slow_503)
    send(ALICE, {"type": "Note"}, [down.url(f"/{n}") for n in range(40)])
    first = start_deliverer(concurrency=4, per_host=2)
    second = start_deliverer(concurrency=4, per_host=2)
    wait_until(lambda: Breaker.objects.filter(open_until__isnull=False).exists())
    opened_after = len(down.received)

    def holds_back(deliverer: Deliverer) -> bool:
        # It knows the breaker is open, and what it let through before is
        # back: from now on only a probe goes out.
        state = deliverer.breakers.view.get(down.host) if deliverer.breakers else None
        in_flight = deliverer.in_hand().in_flight
        return bool(state and state.open_until) and all(sending.probe for sending in in_flight)

    # Marked once both hold back and no request (a probe) is being answered:
    # what is counted since are probes, whole.
    wait_until(
        lambda: (
            holds_back(first.deliverer) and holds_back(second.deliverer) and slow_503.mark_if_idle()
        )
    )
    before = len(down.received)
    # A probe holds its turn for one cool-off: longer than any request
    # here takes, even on a machine busy past its cores.
    time.sleep(3)  # six cool-offs: a probe each at most, one at a time among both
    probes = len(down.received) - before
    first.stop()
    second.stop()
    assert slow_503.most == 4, "both deliverers were sending (two per host each)"
    # Opened by both deliverers' failures counted together: no more than the
    # threshold, and what each had in flight or was writing (two per host,
    # written at most one batch late) as it happened.
    assert opened_after <= 6 + 2 * (2 * 2), "opened by the failures of both, counted together"
    assert slow_503.most_since_mark == 1, "one probe at a time between the two deliverers"
    assert 1 <= probes <= 3 / 0.5 + 1, f"{probes} probes in six cool-offs"
    held = first.deliverer.summary.held + second.deliverer.summary.held
    assert held > 20, "the rest were held by both, without a request"


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("status", [302, 404])
def test_answers_from_a_server_that_is_up_open_no_breaker(
    inbox: Inbox, start_deliverer: Callable[..., RunningDeliverer], settings: Any, status: int
) -> None:
    # Only a 5xx, 408, 429 or no answer counts against a host: a redirect, or
    # a 4xx PERMANENT_STATUS has made worth retrying, came from a server up.
    quick_breaker(
        settings, NEW_WORK_POLL_SECONDS=0.05, PERMANENT_STATUS="tests.test_breakers.never_final"
    )
    inbox.respond = lambda request: (status, {"Location": "http://127.0.0.1/elsewhere"}, b"")
    send(ALICE, NOTE, [inbox.url(f"/{n}") for n in range(4)])
    runner = start_deliverer(concurrency=1, per_host=1)
    wait_until(lambda: Delivery.objects.filter(attempts__gte=1).count() == 4)
    runner.stop()
    assert not Breaker.objects.filter(open_until__isnull=False).exists()
    assert len(inbox.received) == 4


def never_final(status: int) -> bool:
    return False


@pytest.mark.django_db(transaction=True)
def test_a_half_open_breaker_s_probe_failed_at_a_portable_inbox_s_first_gateway_holds_its_host(
    inboxes: Callable[..., Inbox], settings: Any
) -> None:
    quick_breaker(settings)
    down = inboxes("127.0.0.2", respond=lambda request: (503, {}, b""))
    later = inboxes("127.0.0.3")
    # The host's breaker opened a while ago; its cool-off is over: the next
    # delivery there is its probe.
    Breaker.objects.create(
        key=down.host, failures=10, open_until=timezone.now() - dt.timedelta(seconds=1)
    )
    # Four activities sent one after the other, each to a portable inbox
    # whose first gateway is on that host.
    for n in range(4):
        inbox = PortableInbox(f"ap://{DID}/actor{n}/inbox", [down.url(""), later.url("")])
        assert send_portable(ALICE, NOTE, [inbox]) is not None
        Deliverer().run(drain=True)
    assert len(later.received) == 4, "each delivered through the later gateway"
    # The probe went to the host and was answered 503: the host is still
    # down, and its breaker holds it for another cool-off.
    assert len(down.received) == 1, (
        f"the host whose breaker is open was POSTed {len(down.received)} times in a row: "
        "each probe that failed there was given back, as if no request had been made; "
        f"breaker now {list(Breaker.objects.values('failures', 'open_until', 'probe_token'))}"
    )


@pytest.mark.django_db(transaction=True)
def test_a_portable_inbox_s_own_open_breaker_holds_it_as_any_inbox_s(
    inboxes: Callable[..., Inbox], settings: Any
) -> None:
    # Kept per inbox, the breaker of a portable inbox with two gateways held
    # nothing: every attempt went to its second gateway, and its answers
    # were recorded on no breaker.
    quick_breaker(settings, BREAKER={"THRESHOLD": 2, "COOL_OFF": 60.0, "SCOPE": "inbox"})
    first, second = inboxes("127.0.0.2"), inboxes("127.0.0.3")
    inbox = f"ap://{DID}/actor/inbox"
    open_breaker(inbox)
    send_portable(ALICE, NOTE, [PortableInbox(inbox, [first.url(""), second.url("")])])
    assert Deliverer().run(drain=True).held == 1
    assert (first.received, second.received) == ([], [])


FLAKY = "flaky.example"


def probing_after_an_outage() -> tuple[Breakers, str]:
    """A breaker opened by two failures, its cool-off over: the probe it
    lets through taken, and its token."""
    breakers = Breakers(BreakerSettings(threshold=2, cool_off=60.0))
    now = aware_now()
    breakers.record(FLAKY, failed=True, probe="", now=now)
    breakers.record(FLAKY, failed=True, probe="", now=now)
    breakers.flush()
    assert Breaker.objects.get(key=FLAKY).open_until is not None
    Breaker.objects.filter(key=FLAKY).update(open_until=now - SECOND)
    breakers.refresh()
    decision, token, _ = breakers.admit(FLAKY, aware_now())
    assert decision is Decision.PROBE
    return breakers, token


@pytest.mark.django_db(transaction=True)
def test_a_failure_right_after_a_successful_probe_is_counted_and_holds_nothing() -> None:
    """A host's probe succeeds (its breaker closes) and the next delivery
    there, sent before the deliverer next writes its breakers, fails: that
    failure was counted on the open row, which the probe's success then
    deleted, and this deliverer, whose view the write left half-open, held
    the host's next deliveries a whole cool-off each, without a request,
    though the breaker was closed."""
    breakers, token = probing_after_an_outage()
    breakers.record(FLAKY, failed=False, probe=token, now=aware_now())  # closed
    # Admitted once closed, the next one there fails, before the next write.
    assert breakers.admit(FLAKY, aware_now())[0] is Decision.PASS
    breakers.record(FLAKY, failed=True, probe="", now=aware_now())
    breakers.flush()
    rows = list(Breaker.objects.values_list("failures", "open_until"))
    assert rows == [(1, None)], "closed, one failure in a row since the probe's success"
    decision, _, held = breakers.admit(FLAKY, aware_now())
    assert decision is Decision.PASS, f"held {held:.0f} s by a closed breaker"


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_probe_put_back_unsent_as_the_deliverer_stops_is_given_back(
    inboxes: Callable[..., Inbox],
    start_deliverer: Callable[..., RunningDeliverer],
    settings: Any,
) -> None:
    """A half-open host's delivery takes the probe and waits in the
    workers' queue behind a slow host's; the deliverer is stopped (a deploy)
    and puts it back unsent. The probe stayed taken: every other deliverer
    held the host, without a request, a try spent each time, for a whole
    cool-off, though no probe was under way. It is given back, as one that
    made no request is elsewhere."""
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "BREAKER": {"THRESHOLD": 2, "COOL_OFF": 300.0, "SCOPE": "host"},
        "SLOW_CONCURRENCY": 0,
        "SLOW_AFTER_SECONDS": 60,
    }
    slow = inboxes("127.0.0.2", delay=3.0)
    half_open = inboxes("127.0.0.3")
    Breaker.objects.create(
        key=half_open.host, failures=5, open_until=timezone.now() - SECOND, probe_token=""
    )
    send(ALICE, {"type": "Note"}, [slow.url("/inbox")])
    send(ALICE, {"type": "Note"}, [half_open.url("/inbox")])
    runner = start_deliverer(concurrency=1, per_host=1)
    # The one worker sends the slow host's; the other waits in its queue.
    wait_until(lambda: len(slow.received) == 1)
    wait_until(lambda: len(runner.deliverer.in_hand().in_flight) == 2)
    assert any(item.probe for item in runner.deliverer.in_hand().in_flight)
    assert Breaker.objects.get(key=half_open.host).probe_token != ""
    runner.stop()
    assert half_open.received == [], "put back unsent"
    row = Breaker.objects.get(key=half_open.host)
    assert (row.probe_token, row.probe_until) == ("", None), "no probe is under way"


@pytest.mark.django_db(transaction=True)
def test_the_backlog_of_more_than_200_held_hosts_keeps_no_other_host_waiting() -> None:
    """A host whose breaker holds everything is left out of the claims, so
    that its backlog never keeps the others waiting. With 250 hosts held,
    only the first 200 (by name) were left out: the backlog of the other
    50, due first, filled the claim, and a delivery to a healthy host
    waited for it to be claimed and held again, a claim at a time."""
    held = [f"down{n:03}.example" for n in range(250)]
    until = timezone.now() + 60 * SECOND
    Breaker.objects.bulk_create(Breaker(key=host, failures=10, open_until=until) for host in held)
    send(ALICE, {"type": "Note"}, [f"https://{host}/{n}" for host in held for n in range(2)])
    send(ALICE, {"type": "Note"}, ["https://up.example/inbox"])
    # The claim's make-up, as tests/test_breakers.py looks at it.
    deliverer = Deliverer(concurrency=4, per_host=2, claim_size=64)
    deliverer.upkeep.refresh()
    assert len(deliverer.upkeep.held_hosts()) == 250
    deliverer.intake.claim_more()
    hosts = collections.Counter(item.host for item in deliverer.in_hand().ready)
    assert hosts["up.example"] == 1, f"claimed: {len(hosts)} held hosts, no other"


@pytest.mark.django_db(transaction=True)
def test_failures_noted_before_a_successful_probe_reopen_the_breaker_it_closed() -> None:
    """Two deliveries in flight when the breaker opened time out, then,
    before the next write, the probe succeeds: the host is back. Written
    after the probe's success, those older failures opened a fresh row at
    once, and the host that just answered was held another cool-off. They
    go with the success, as an ordinary success forgets those before it."""
    breakers, token = probing_after_an_outage()
    # Two deliveries admitted before the breaker opened fail now (timed out)...
    breakers.record(FLAKY, failed=True, probe="", now=aware_now())
    breakers.record(FLAKY, failed=True, probe="", now=aware_now())
    # ... and then the probe succeeds: the host is back.
    breakers.record(FLAKY, failed=False, probe=token, now=aware_now())
    breakers.flush()
    rows = list(Breaker.objects.values_list("failures", "open_until"))
    assert all(open_until is None for _, open_until in rows), (
        f"the breaker its probe just closed is open again: {rows}"
    )
    decision, _, held = breakers.admit(FLAKY, aware_now())
    assert decision is Decision.PASS, f"the host that answered is held {held:.0f} s"


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("error_length", [None, 50])
def test_a_backlog_held_by_a_breaker_goes_once_an_operator_has_reset_it(
    inbox: Inbox, settings: Any, error_length: int | None
) -> None:
    """A host's breaker is open, its deliveries held (due after the
    cool-off, or a longer RETRY wait). The host is back and the operator
    resets its breaker (``reset_breaker``, the admin's action): its backlog
    is due at once, as a probe's success would have made it; with errors
    kept short (ERROR_LENGTH 50) too, found by their error as kept, cut."""
    from django_federation_delivery import controls

    if error_length is not None:
        settings.FEDERATION_DELIVERY = {
            **settings.FEDERATION_DELIVERY,
            "ERROR_LENGTH": error_length,
        }
    host = inbox.host
    Breaker.objects.create(key=host, failures=10, open_until=timezone.now() + 60 * SECOND)
    send(ALICE, NOTE, [inbox.url(f"/{n}") for n in range(5)])
    Deliverer().run(drain=True, stop_after=5)
    held = Delivery.objects.filter(status="pending", last_error__startswith="held:")
    assert held.count() == 5 and not inbox.received
    assert controls.reset_breaker(host) == 1
    Deliverer().run(drain=True, stop_after=10)
    assert len(inbox.received) == 5


@pytest.mark.django_db(transaction=True)
def test_what_a_breaker_just_opened_by_this_deliverer_held_stays_held() -> None:
    """A host fails twice (THRESHOLD 2): this deliverer's view opens its
    breaker at once, and the next delivery it claims there is written held
    for the cool-off. The flush that follows writes the failures that open
    the breaker before it looks at what was held: the row stays held, not
    made due for any deliverer to send to the failing host."""
    from django_federation_delivery.breakers import HELD_BY_BREAKER

    from .test_retractions import A, create, row

    host = "a.example"
    breakers = Breakers(BreakerSettings(threshold=2, cool_off=60.0))
    now = aware_now()
    breakers.record(host, failed=True, probe="", now=now)
    breakers.record(host, failed=True, probe="", now=now)
    decision, _, held_for = breakers.admit(host, now)
    assert decision.name == "HOLD" and held_for > 0
    # The triage holds the claimed row, which the outbox writes held.
    breakers.note_held(host)
    batch = send(ALICE, create(), [A])
    later = timezone.now() + dt.timedelta(seconds=held_for)
    Delivery.objects.filter(batch=batch).update(
        due_at=later, last_error=HELD_BY_BREAKER.format(key=host)
    )
    breakers.flush()
    assert Breaker.objects.filter(key=host).exists()
    assert row(batch, A).due_at > timezone.now() + dt.timedelta(seconds=30), (
        "held by an open breaker, made due at once"
    )


@pytest.mark.django_db(transaction=True)
def test_a_probe_s_success_written_as_the_database_blinks_still_releases_the_held_backlog(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A host's probe succeeds and its breaker closes; what the breaker held
    meanwhile is to go at once. The flush that writes the success meets the
    database away for a moment as it makes the held deliveries due: the
    row's deletion goes with it, and the next flush does both (the row gone
    alone, that one released nothing, and the backlog waited a cool-off)."""
    host = "flaky.example"
    cool_off = 60.0
    keeper = Breakers(BreakerSettings(threshold=2, cool_off=cool_off))
    now = aware_now()
    Breaker.objects.create(key=host, failures=10, open_until=timezone.now() - SECOND)
    keeper.refresh()
    decision, token, _ = keeper.admit(host, now)
    assert decision.name == "PROBE"
    # What the breaker held while its probe was under way.
    batch = send(ALICE, NOTE, [f"https://{host}/{n}" for n in range(3)])
    Delivery.objects.filter(batch=batch).update(
        due_at=timezone.now() + dt.timedelta(seconds=cool_off),
        last_error=HELD_BY_BREAKER.format(key=host),
    )
    keeper.record(host, failed=False, probe=token, now=aware_now())
    release_fails_once(monkeypatch)
    with pytest.raises(OperationalError):
        keeper.flush()
    keeper.flush()  # the database back: the loop's next flush
    assert not Breaker.objects.filter(key=host).exists(), "closed by its probe"
    late = Delivery.objects.filter(batch=batch, due_at__gt=timezone.now() + 10 * SECOND)
    assert late.count() == 0, f"{late.count()} held a cool-off longer, their breaker closed"


@pytest.mark.parametrize(("status", "opened"), [(404, False), (503, True)])
@pytest.mark.django_db(transaction=True)
def test_a_probe_a_later_gateway_answered_counts_the_first_gateways_own_answer(
    inboxes: Callable[..., Inbox], settings: Any, status: int, opened: bool
) -> None:
    """A host's breaker is due its probe, and the probe is a portable inbox
    that lists it as its first gateway. It answers 404 (up, but no gateway
    for this DID: anyone may list it), and a later gateway accepts: the
    breaker was opened again for another cool-off, holding every other
    delivery to the host, where the same 404 with no later gateway closes
    it. A 503 still fails the probe."""
    quick_breaker(settings)
    first = inboxes("127.0.0.2", respond=lambda request: (status, {}, b"no such actor"))
    later = inboxes("127.0.0.3")
    Breaker.objects.create(
        key=first.host, failures=10, open_until=timezone.now() - dt.timedelta(seconds=1)
    )
    send_portable(
        ALICE, NOTE, [PortableInbox(f"ap://{DID}/actor/inbox", [first.url(""), later.url("")])]
    )
    Deliverer().run(drain=True)
    assert Delivery.objects.get().status == Status.DELIVERED
    assert len(first.paths()) == 1, "the first gateway was the probe"
    breaker = Breaker.objects.filter(key=first.host).first()
    reopened = breaker is not None and breaker.open_until is not None
    assert reopened is opened, (status, breaker and breaker.open_until)


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_silent_host_gets_one_probe_at_a_time_whatever_the_cool_off(
    inboxes: Callable[..., Inbox],
    start_deliverer: Callable[..., RunningDeliverer],
    settings: Any,
) -> None:
    """A host whose breaker is half-open answers nothing for 4 s (under
    ATTEMPT_TIMEOUT). README: "then one delivery at a time goes through as a
    probe". With a COOL_OFF shorter than the attempt's time limit, the probe's
    turn lapses while it is still waiting for its answer, and the next held
    delivery takes another: the silent host is sent several probes at once."""
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "BREAKER": {"THRESHOLD": 2, "COOL_OFF": 1.0, "SCOPE": "host"},
        "RETRY": {"BASE": 0.2, "CAP": 0.2, "ATTEMPTS": 100, "JITTER": 0},
        "ATTEMPT_TIMEOUT": 8.0,
    }
    silent = Overlap(503, delay=4.0)
    started = time.monotonic()
    came: list[float] = []

    def respond(request: Any) -> Any:
        came.append(round(time.monotonic() - started, 1))
        return silent(request)

    down = inboxes("127.0.0.2", respond=respond)
    Breaker.objects.create(
        key=down.host, failures=5, open_until=timezone.now() - dt.timedelta(seconds=1)
    )
    send(ALICE, {"type": "Note"}, [down.url(f"/{n}") for n in range(10)])
    runner = start_deliverer(concurrency=4, per_host=4)
    wait_until(lambda: len(down.received) >= 1)
    time.sleep(3.5)
    runner.stop()
    assert silent.most == 1, (
        f"{silent.most} probes were waiting on the silent host at once (requests came at {came} s)"
    )


@pytest.mark.django_db(transaction=True)
def test_a_delivery_held_by_an_open_breaker_is_not_failed_before_its_deadline(
    inbox: Inbox, settings: Any
) -> None:
    """A host's breaker is open (a minute's cool-off); a batch to it must
    finish within 30 s. README: a delivery "held for a paused host or an open
    breaker ... is failed within 5 s of the deadline". It is failed at once,
    at its first hold, "the batch's deadline passed", 30 s before its
    deadline; the operator who resets the breaker a moment later (the host is
    back) finds it failed, never sent."""
    from django_federation_delivery import BatchOptions, controls, send_batch
    from django_federation_delivery.deliverer import Deliverer
    from django_federation_delivery.models import Delivery, Status

    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "BREAKER": {"THRESHOLD": 2, "COOL_OFF": 60.0, "SCOPE": "host"},
    }
    Breaker.objects.create(
        key=inbox.host, failures=5, open_until=timezone.now() + dt.timedelta(seconds=60)
    )
    batch = send_batch(
        ALICE,
        {"type": "Note"},
        [inbox.url("/inbox")],
        BatchOptions(deadline=dt.timedelta(seconds=30)),
    )
    assert batch is not None
    Deliverer().run(drain=True, stop_after=5)
    assert inbox.received == []
    controls.reset_breaker(inbox.host)
    Deliverer().run(drain=True, stop_after=5)
    row = Delivery.objects.get(batch=batch)
    assert (row.status, len(inbox.received)) == (Status.DELIVERED, 1), (
        f"{row.status} 30 s before its deadline: {row.last_error!r}"
    )


@pytest.mark.django_db(transaction=True)
def test_an_inbox_host_s_probe_is_reserved_for_an_inbox_s_attempt_not_a_webhook_s(
    settings: Any,
) -> None:
    # WEBHOOK_TIMEOUT an hour: an inbox host's probe was reserved for an
    # hour and 10 s, its deliveries all held that long if its deliverer died.
    quick_breaker(settings, ATTEMPT_TIMEOUT=30.0, WEBHOOK_TIMEOUT=3600.0)
    Breaker.objects.create(
        key="down.example", failures=5, open_until=timezone.now() - dt.timedelta(seconds=1)
    )
    deliverer = Deliverer()
    assert deliverer.breakers is not None
    deliverer.breakers.refresh()
    now = timezone.now()
    decision, token, _ = deliverer.breakers.admit("down.example", now)
    assert token, decision
    probe_until = Breaker.objects.get(key="down.example").probe_until
    assert probe_until is not None
    assert (probe_until - now).total_seconds() <= 60 + 5  # its cool-off: 40 s is less
