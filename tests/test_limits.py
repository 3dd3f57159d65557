"""Each host's limit of deliveries at once: up while it answers well, halved
at a sign of overload, once a round, between 1 and the most; refused at
one, the host rests."""

from __future__ import annotations

import pytest

from django_federation_delivery.attempt import AttemptResult, Job, failed, held
from django_federation_delivery.limits import (
    MOST_PROBE_AFTER,
    MOST_REST,
    PROBE_AFTER,
    REST,
    HostLimits,
    _Host,
)

JOB = Job(delivery_id=1)
HOST = "big.example"


def answered(status: int = 202, seconds: float = 0.02) -> AttemptResult:
    return AttemptResult(
        job=JOB,
        delivered=200 <= status < 300,
        status=status,
        error="",
        permanent=False,
        retry_after=None,
        accepted_scheme=None,
        duration=seconds,
    )


def no_answer() -> AttemptResult:
    return failed(JOB, "timed out after 30 s", permanent=False)


def known(limits: HostLimits, *hosts: str, limit: int = 1) -> HostLimits:
    """``limits`` with each host (``HOST`` by default) known to have answered
    well, in 20 ms, at ``limit``: refused at one, it is a busy host's
    refusal, and it rests (one that never answered well is left to its
    breaker)."""
    for host in hosts or (HOST,):
        limits._hosts[host] = _Host(float(limit), fastest=0.02, starting=False, up=True)
    return limits


def answers_to_reach(limits: HostLimits, limit: int) -> int:
    count = 0
    while limits.limit(HOST) < limit:
        limits.learn(HOST, answered())
        count += 1
    return count


def test_a_host_grows_an_answer_at_a_time_until_overloaded_then_a_round_at_a_time() -> None:
    limits = HostLimits(2, 32)
    assert limits.limit(HOST) == 2
    limits.learn(HOST, answered())
    assert limits.limit(HOST) == 3
    for _ in range(13):
        limits.learn(HOST, answered())
    assert limits.limit(HOST) == 16
    assert limits.limit("other.example") == 2, "each host its own"
    limits.learn(HOST, answered(503))
    assert limits.limit(HOST) == 8
    for _ in range(15):  # the other answers of the round it was halved in
        limits.learn(HOST, answered())
    assert limits.limit(HOST) == 8
    # Now a round (as many answers as its limit) for one more.
    assert answers_to_reach(limits, 9) in (8, 9)


def test_a_limit_never_passes_the_most() -> None:
    limits = HostLimits(2, 8)
    for _ in range(200):
        limits.learn(HOST, answered())
    assert limits.limit(HOST) == 8


@pytest.mark.parametrize(
    "overload",
    [answered(503), answered(429), no_answer(), answered(202, seconds=0.5)],
    ids=["503", "429", "no answer", "far slower than its fastest"],
)
def test_a_sign_of_overload_halves_the_limit_once_a_round(overload: AttemptResult) -> None:
    limits = HostLimits(7, 8)
    limits.learn(HOST, answered(seconds=0.02))
    assert limits.limit(HOST) == 8
    limits.learn(HOST, overload)
    assert limits.limit(HOST) == 4
    # The answers to the other requests of that round do not halve it again.
    for _ in range(7):
        limits.learn(HOST, overload)
    assert limits.limit(HOST) == 4
    limits.learn(HOST, overload)
    assert limits.limit(HOST) == 2
    for _ in range(10):
        limits.learn(HOST, overload)
    assert limits.limit(HOST) == 1, "never below one"


def test_a_refusal_answered_fast_is_no_overload_and_no_request_says_nothing() -> None:
    limits = HostLimits(4, 16)
    for _ in range(5):
        limits.learn(HOST, answered(404))
    assert limits.limit(HOST) == 9
    for _ in range(20):
        limits.learn(HOST, held(JOB, "its breaker is open", retry_after=60.0))
        limits.learn(HOST, failed(JOB, "no key for the sender", permanent=True, requests=0))
    assert limits.limit(HOST) == 9


def test_a_host_slower_than_its_fastest_but_within_noise_is_not_overloaded() -> None:
    limits = HostLimits(2, 8)
    limits.learn(HOST, answered(seconds=0.001))
    for _ in range(3):
        limits.learn(HOST, answered(seconds=0.02))  # 20 times slower, but 20 ms
    assert limits.limit(HOST) == 6


def test_with_the_most_at_the_start_a_limit_is_fixed_never_grown_nor_halved() -> None:
    limits = HostLimits(2, 2)
    for _ in range(100):
        limits.learn(HOST, answered())
    assert limits.limit(HOST) == 2
    for overload in (answered(503), answered(429), no_answer(), answered(seconds=5.0)):
        for _ in range(5):
            limits.learn(HOST, overload)
    assert limits.limit(HOST) == 2
    assert HostLimits(4, 2).limit(HOST) == 2, "the most, if below the start"


class Clock:
    """Seconds that pass only when a test says so."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_limit_grows_back_to_one_below_where_it_was_halved_and_to_it_after_a_wait() -> None:
    clock = Clock()
    limits = HostLimits(2, 8, clock=clock)
    for _ in range(4):
        limits.learn(HOST, answered())
    assert limits.limit(HOST) == 6
    limits.learn(HOST, answered(503))
    assert limits.limit(HOST) == 3
    for _ in range(200):  # however many answer well meanwhile
        limits.learn(HOST, answered())
    assert limits.limit(HOST) == 5, "one below where it was halved"
    clock.now += PROBE_AFTER - 1
    limits.learn(HOST, answered())
    assert limits.limit(HOST) == 5
    clock.now += 1
    # Then a round at a time again, past it too.
    assert answers_to_reach(limits, 6) <= 6
    assert answers_to_reach(limits, 7) <= 7
    assert limits.limit("other.example") == 2, "each host its own"


def test_a_host_halved_again_where_it_was_is_asked_that_limit_ever_more_rarely() -> None:
    clock = Clock()
    limits = HostLimits(2, 8, clock=clock)
    waits = []
    for _ in range(10):
        limits.learn(HOST, answered(503))  # at two: too many
        assert limits.limit(HOST) == 1
        halved = clock.now
        while limits.limit(HOST) < 2:
            clock.now += 1
            limits.learn(HOST, answered())
        waits.append(clock.now - halved)
    assert waits[:3] == [PROBE_AFTER, 2 * PROBE_AFTER, 4 * PROBE_AFTER]
    assert waits[-1] == MOST_PROBE_AFTER
    # Halved from higher than before, it waits the first wait again.
    answers_to_reach(limits, 3)
    limits.learn(HOST, answered(503))
    assert limits.limit(HOST) == 1
    halved = clock.now
    while limits.limit(HOST) < 3:
        clock.now += 1
        limits.learn(HOST, answered())
    assert clock.now - halved == PROBE_AFTER


@pytest.mark.parametrize("overload", [answered(503), answered(429)])
def test_a_host_refused_at_one_rests_twice_as_long_at_each_refusal_in_a_row(
    overload: AttemptResult,
) -> None:
    clock = Clock()
    limits = known(HostLimits(1, 8, clock=clock))
    limits.learn(HOST, overload)
    assert limits.limit(HOST) == 1, "the limit learned is still one"
    assert limits.allowed(HOST) == 0, "but none goes while it rests"
    assert list(limits.resting()) == [HOST]
    assert limits.allowed("other.example") == 1, "each host its own"
    clock.now += REST
    assert limits.allowed(HOST) == 1
    assert list(limits.resting()) == []
    rest = REST
    for _ in range(12):
        rest = min(MOST_REST, rest * 2)
        limits.learn(HOST, overload)
        clock.now += rest * 0.999
        assert limits.allowed(HOST) == 0, rest
        clock.now += rest * 0.002
        assert limits.allowed(HOST) == 1, rest
    assert rest == MOST_REST


def test_a_host_that_answered_only_404s_rests_ever_longer_refusing_at_one() -> None:
    # Up, but never delivered to (its accounts gone): it rested REST at each
    # refusal, never longer, taken for a host that never answered.
    clock = Clock()
    limits = HostLimits(1, 8, clock=clock)
    limits.learn(HOST, answered(404))
    rests = []
    for _ in range(12):
        limits.learn(HOST, answered(503))
        if rest := limits.rest_left(HOST):
            rests.append(rest)
        clock.now += rest + 0.001
    assert rests[:4] == pytest.approx([REST, 2 * REST, 4 * REST, 8 * REST])


@pytest.mark.parametrize("status", [429, 503])
def test_a_host_that_asks_to_be_left_alone_rests_as_long_as_it_asks_up_to_the_most(
    status: int,
) -> None:
    # A Retry-After held the one delivery it answered: the host's other
    # deliveries went on, each refused in its turn, one at a time.
    clock = Clock()
    limits = known(HostLimits(2, 8, clock=clock), limit=4)
    limits.learn(HOST, answered(status), asked=5.0)
    assert limits.allowed(HOST) == 0 and limits.rest_left(HOST) == 5.0
    assert limits.allowed("other.example") == 2, "each host its own"
    clock.now += 5.0
    assert limits.allowed(HOST) == 2, "halved once, from 4"
    limits.learn(HOST, answered(status), asked=86_400.0)
    assert limits.rest_left(HOST) == MOST_REST, "however long it asks"
    # A shorter ask never cuts a longer rest short; and only an overload asks.
    limits.learn(HOST, answered(status), asked=1.0)
    assert limits.rest_left(HOST) == MOST_REST
    clock.now += MOST_REST
    limits.learn(HOST, answered(404), asked=60.0)
    assert limits.allowed(HOST) >= 1


def test_a_fixed_limit_rests_for_no_retry_after() -> None:
    limits = HostLimits(4, 4)
    limits.learn(HOST, answered(429), asked=60.0)
    assert limits.allowed(HOST) == 4


def test_the_rest_left_counts_down_to_none() -> None:
    clock = Clock()
    limits = known(HostLimits(1, 8, clock=clock))
    assert limits.rest_left(HOST) == 0.0
    limits.learn(HOST, answered(503))
    limits.learn(HOST, answered(503))  # 0.2 s, from now
    assert limits.rest_left(HOST) == pytest.approx(2 * REST)
    clock.now += REST
    assert limits.rest_left(HOST) == pytest.approx(REST)
    clock.now += REST
    assert limits.rest_left(HOST) == 0.0
    assert limits.rest_left("other.example") == 0.0


def test_each_good_answer_halves_the_rest_a_refusal_at_one_then_owes() -> None:
    clock = Clock()
    limits = known(HostLimits(1, 8, clock=clock))
    for _ in range(4):  # rests of 0.1, 0.2, 0.4, 0.8 s
        limits.learn(HOST, answered(503))
        clock.now += 10
    limits.learn(HOST, answered())
    limits.learn(HOST, answered(503))
    assert limits.allowed(HOST) == 0
    clock.now += 0.8 - 1e-6
    assert limits.allowed(HOST) == 0, "0.8 s: twice the 0.4 s left after one good answer"
    clock.now += 1e-6
    assert limits.allowed(HOST) == 1
    for _ in range(10):
        limits.learn(HOST, answered())
    limits.learn(HOST, answered(503))
    clock.now += REST
    assert limits.allowed(HOST) == 1, "after good answers enough, a first rest again"


def test_a_host_halved_to_one_from_above_rests_only_once_refused_at_one() -> None:
    clock = Clock()
    limits = known(HostLimits(2, 8, clock=clock), limit=2)
    limits.learn(HOST, answered(503))
    assert (limits.limit(HOST), limits.allowed(HOST)) == (1, 1)
    limits.learn(HOST, answered(503))  # the other request of that round
    assert limits.allowed(HOST) == 1
    limits.learn(HOST, answered(503))
    assert limits.allowed(HOST) == 0


def test_a_host_slow_or_silent_at_one_is_not_rested_only_one_refusing() -> None:
    limits = HostLimits(1, 8)
    limits.learn(HOST, answered(seconds=0.01))
    limits.learn(HOST, answered(seconds=0.5))
    for _ in range(3):
        limits.learn(HOST, no_answer())  # the breaker's to hold
    assert (limits.limit(HOST), limits.allowed(HOST)) == (1, 1)
    assert list(limits.resting()) == []


def test_a_host_that_never_answered_well_rests_no_longer_than_a_first_rest() -> None:
    # Down, or busy with another deliverer: its next request waits REST, as
    # long at every refusal; a longer rest would hold it past the retry
    # policy and the breaker's cool-off, which are the operator's to set.
    clock = Clock()
    limits = HostLimits(1, 8, clock=clock)
    for _ in range(12):
        limits.learn(HOST, answered(503))
        assert (limits.limit(HOST), limits.allowed(HOST)) == (1, 0)
        assert limits.rest_left(HOST) == pytest.approx(REST)
        clock.now += REST
        assert (limits.allowed(HOST), list(limits.resting())) == (1, [])
    limits.learn(HOST, answered())
    limits.learn(HOST, answered(503))  # at two: halved
    limits.learn(HOST, answered(503))  # the other of that round
    limits.learn(HOST, answered(503))  # at one, having answered well: busy
    assert list(limits.resting()) == [HOST]


def test_a_fixed_limit_never_rests() -> None:
    limits = HostLimits(1, 1)
    for _ in range(5):
        limits.learn(HOST, answered(503))
    assert limits.allowed(HOST) == 1
    assert list(limits.resting()) == []


@pytest.mark.parametrize("refusals", [1, 200], ids=["one refusal", "an outage's"])
def test_a_host_refused_at_one_is_sent_two_at_once_again_a_probe_after_its_last(
    refusals: int,
) -> None:
    clock = Clock()
    limits = known(HostLimits(1, 8, clock=clock))
    for _ in range(refusals):
        limits.learn(HOST, answered(503))
        clock.now += 60.0
    clock.now -= 60.0
    for _ in range(20):
        clock.now += 1.0
        limits.learn(HOST, answered())
    assert limits.limit(HOST) == 1
    clock.now += PROBE_AFTER
    limits.learn(HOST, answered())
    assert limits.limit(HOST) == 2


@pytest.mark.parametrize(
    ("first", "then"),
    [(answered(202, 0.02), 410), (answered(202, 0.0), 202)],
    ids=["then only refusals", "first timed at 0 s"],
)
def test_a_host_answering_in_200_ms_is_not_judged_by_its_first_delivery_for_ever(
    first: AttemptResult, then: int
) -> None:
    # Delivered to once in 20 ms, then answering only refusals (a 410 for
    # each account of an instance closing down) in 200 ms: each was taken
    # for overload against that one delivery's time, for ever, and the
    # host was sent one at a time however many answers came. So too after
    # a first delivery timed at 0 s (a kind of the project's own that left
    # its duration at the default), which pinned its fastest at 0.
    clock = Clock()
    limits = HostLimits(4, 16, clock=clock)
    limits.learn(HOST, first)
    for _ in range(2000):
        clock.now += 0.2
        limits.learn(HOST, answered(then, 0.2))
    assert limits.limit(HOST) == 16


def test_quick_refusals_do_not_blind_a_host_to_its_deliveries_slowing_down() -> None:
    """Every answer but a 429 or 503 grew a host's fastest delivery by 2 %,
    even one far quicker: after 1,000 quick 410s (5 ms) a host delivered to
    in 20 ms had a "fastest delivery" of some 8,000,000 s, and its
    deliveries slowing a hundredfold (2 s) were no sign of overload."""
    clock = Clock()
    limits = HostLimits(4, 16, clock=clock)
    limits.learn(HOST, answered(202, 0.02))
    for _ in range(1000):
        clock.now += 0.01
        limits.learn(HOST, answered(410, 0.005))
    assert limits.limit(HOST) == 16
    for _ in range(20):
        clock.now += 2.0
        limits.learn(HOST, answered(202, 2.0))
    assert limits.limit(HOST) < 16, "deliveries 100 times slower than its pace: overload"


@pytest.mark.parametrize(
    ("overload", "lowered"),
    [(answered(503), True), (answered(429), True), (answered(202, seconds=1.5), False)],
    ids=["503", "429", "slower"],
)
def test_only_a_host_that_refused_has_its_urgent_deliveries_share_its_limit(
    overload: AttemptResult, lowered: bool
) -> None:
    # Halved as its answers slowed under a fan-out, a host that refused
    # nothing had a direct message wait for one of the fan-out's attempts
    # there: README says it goes at once, beside them.
    limits = known(HostLimits(4, 8), limit=4)
    limits.learn(HOST, overload)
    assert limits.limit(HOST) == 2
    assert limits.lowered(HOST) is lowered


@pytest.mark.parametrize("then", [answered(202, seconds=1.5), no_answer()], ids=["slow", "none"])
def test_a_host_that_refused_then_slowed_still_shares_its_limit_with_urgent_ones(
    then: AttemptResult,
) -> None:
    # Refused at 2, halved to 1; its next answer slow, or none: the refusal
    # was forgotten at that halving, and a direct message sent beside the
    # fan-out's attempt, two at once again, the number it just refused.
    limits = known(HostLimits(2, 8), limit=2)
    limits.learn(HOST, answered(503), beside=0)
    assert (limits.limit(HOST), limits.lowered(HOST)) == (1, True)
    limits.learn(HOST, then, beside=0)
    assert (limits.limit(HOST), limits.lowered(HOST)) == (1, True)


def test_a_refusal_while_a_slowed_host_recovers_shares_its_limit_with_urgent_ones() -> None:
    # Halved for slowness, 4 to 2; a 503 from a request still in flight,
    # which halves nothing, did not count as a refusal.
    limits = known(HostLimits(4, 8), limit=4)
    limits.learn(HOST, answered(202, seconds=1.5), beside=3)
    assert (limits.limit(HOST), limits.lowered(HOST)) == (2, False)
    limits.learn(HOST, answered(503), beside=2)
    assert (limits.limit(HOST), limits.lowered(HOST)) == (2, True)
