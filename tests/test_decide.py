"""decide(): what an attempt comes to, as a table: no database, no clock."""

from __future__ import annotations

import dataclasses
import datetime as dt
from typing import Any

import pytest

from django_federation_delivery.attempt import AttemptResult, failed, held, judged
from django_federation_delivery.channels.activitypub import ActivityPub, InboxJob
from django_federation_delivery.decide import Outcome, Ruling, decide
from django_federation_delivery.retry import DAY_SCHEDULE, RetryPolicy
from django_federation_delivery.signatures import Scheme
from django_federation_delivery.transport import Answer

NOW = dt.datetime(2025, 1, 1, 12, 0, tzinfo=dt.UTC)
JOB = InboxJob(
    delivery_id=1,
    targets=("https://social.example/inbox",),
    body=b"{}",
    body_sha256="",
    key=None,
    sender="https://here.example/users/alice",
    scheme=Scheme.CAVAGE,
)


def answer(
    status: int, *, retry_after: float | None = None, permanent: bool = False
) -> AttemptResult:
    """What an inbox answering ``status`` makes of an attempt."""
    if 200 <= status < 300:
        return AttemptResult(
            job=JOB,
            delivered=True,
            status=status,
            error="",
            permanent=False,
            retry_after=None,
            accepted_scheme=Scheme.CAVAGE,
            duration=0.1,
        )
    return dataclasses.replace(
        failed(JOB, f"HTTP {status}", permanent=permanent), status=status, retry_after=retry_after
    )


def after(seconds: float) -> dt.datetime:
    return NOW + dt.timedelta(seconds=seconds)


# The policy's waits without jitter: 30 s doubling to an hour, 12 attempts in all.
CASES: list[tuple[str, AttemptResult, int, dict[str, Any], Ruling]] = [
    ("delivered", answer(202), 1, {}, Ruling(Outcome.DELIVERED)),
    (
        "delivered past the deadline is still delivered",
        answer(202),
        12,
        {"deadline": after(-60), "max_attempts": 3},
        Ruling(Outcome.DELIVERED),
    ),
    (
        "a permanent status is refused",
        answer(410, permanent=True),
        1,
        {},
        Ruling(Outcome.REFUSED, error="HTTP 410"),
    ),
    (
        "a passing status is refused when the sender is gone",
        answer(401),
        1,
        {"sender_gone": True},
        Ruling(Outcome.REFUSED, error="HTTP 401"),
    ),
    (
        "a 503 is retried after the policy's wait",
        answer(503),
        1,
        {},
        Ruling(Outcome.RETRYING, due_at=after(30), error="HTTP 503"),
    ),
    (
        "the wait doubles with each attempt",
        answer(503),
        3,
        {},
        Ruling(Outcome.RETRYING, due_at=after(120), error="HTTP 503"),
    ),
    (
        "Retry-After longer than the policy's wait is waited as asked",
        answer(429, retry_after=600),
        1,
        {},
        Ruling(Outcome.RETRYING, due_at=after(600), error="HTTP 429"),
    ),
    (
        "Retry-After shorter than the policy's wait is not",
        answer(503, retry_after=10),
        3,
        {},
        Ruling(Outcome.RETRYING, due_at=after(120), error="HTTP 503"),
    ),
    (
        "Retry-After is capped at RETRY_AFTER_MAX",
        answer(503, retry_after=86400),
        1,
        {"retry_after_max": 3600.0},
        Ruling(Outcome.RETRYING, due_at=after(3600), error="HTTP 503"),
    ),
    (
        "Retry-After is ignored without WAIT_AS_ASKED",
        answer(503, retry_after=600),
        1,
        {"wait_as_asked": False},
        Ruling(Outcome.RETRYING, due_at=after(30), error="HTTP 503"),
    ),
    (
        "the batch's max attempts gives up",
        answer(503),
        3,
        {"max_attempts": 3},
        Ruling(Outcome.FAILED, error="gave up after 3 attempts: HTTP 503"),
    ),
    (
        "the end of the retry policy gives up",
        answer(503),
        12,
        {},
        Ruling(Outcome.FAILED, error="gave up after 12 attempts: HTTP 503"),
    ),
    (
        "a 503 on the 12th attempt past the deadline is given up by the policy",
        answer(503),
        12,
        {"deadline": after(-60)},
        Ruling(Outcome.FAILED, error="gave up after 12 attempts: HTTP 503"),
    ),
    (
        "a retry due past the batch's deadline gives up",
        answer(503),
        2,
        {"deadline": after(59)},
        Ruling(Outcome.FAILED, error="the batch's deadline passed: HTTP 503", deadline=True),
    ),
    (
        "a retry due just before the deadline is retried",
        answer(503),
        2,
        {"deadline": after(61)},
        Ruling(Outcome.RETRYING, due_at=after(60), error="HTTP 503"),
    ),
    (
        "held by a breaker waits at least the policy's wait",
        held(JOB, "held: open", retry_after=5.0),
        1,
        {},
        Ruling(Outcome.HELD, due_at=after(30), error="held: open"),
    ),
    (
        "held by a breaker waits out its cool-off when longer",
        held(JOB, "held: open", retry_after=300.0),
        1,
        {},
        Ruling(Outcome.HELD, due_at=after(300), error="held: open"),
    ),
    (
        # A breaker's cool-off is the package's own wait, not a server's
        # Retry-After: without WAIT_AS_ASKED, a breaker's held deliveries
        # came round at each retry wait, each a try, until given up.
        "held by a breaker waits out its cool-off without WAIT_AS_ASKED",
        held(JOB, "held: open", retry_after=300.0),
        1,
        {"wait_as_asked": False},
        Ruling(Outcome.HELD, due_at=after(300), error="held: open"),
    ),
    (
        "held by a breaker waits out a cool-off longer than RETRY_AFTER_MAX",
        held(JOB, "held: open", retry_after=7200.0),
        1,
        {"retry_after_max": 3600.0},
        Ruling(Outcome.HELD, due_at=after(7200), error="held: open"),
    ),
    (
        "held at the last attempt is given up (an inbox's hold spends a try)",
        held(JOB, "held: open", retry_after=5.0),
        12,
        {},
        Ruling(Outcome.FAILED, error="gave up after 12 attempts: held: open"),
    ),
    (
        "a webhook's hold, before any try, waits the policy's first wait",
        held(JOB, "held: open", retry_after=5.0),
        0,
        {"holds_spend_tries": False},
        Ruling(Outcome.HELD, due_at=after(30), error="held: open"),
    ),
    (
        "a webhook's hold spends no try: past the policy's last it waits its last wait",
        held(JOB, "held: open", retry_after=5.0),
        12,
        {"holds_spend_tries": False},
        Ruling(Outcome.HELD, due_at=after(3600), error="held: open"),
    ),
    (
        "a webhook's hold spends no try: past the batch's max attempts it still waits",
        held(JOB, "held: open", retry_after=5.0),
        3,
        {"max_attempts": 3, "holds_spend_tries": False},
        Ruling(Outcome.HELD, due_at=after(120), error="held: open"),
    ),
    (
        # Failed at once, 299 s early: a reset or a probe's success could not
        # release it, and delivery_failed said its deadline had passed.
        "a webhook's hold past the batch's deadline is held until the deadline",
        held(JOB, "held: open", retry_after=300.0),
        1,
        {"deadline": after(299), "holds_spend_tries": False},
        Ruling(Outcome.HELD, due_at=after(299), error="held: open"),
    ),
    (
        "an inbox's hold past the batch's deadline is held until the deadline",
        held(JOB, "held: open", retry_after=300.0),
        1,
        {"deadline": after(30)},
        Ruling(Outcome.HELD, due_at=after(30), error="held: open"),
    ),
    (
        "a hold once the batch's deadline has passed is given up",
        held(JOB, "held: open", retry_after=300.0),
        1,
        {"deadline": after(0), "holds_spend_tries": False},
        Ruling(Outcome.FAILED, error="the batch's deadline passed: held: open", deadline=True),
    ),
]


@pytest.mark.parametrize(
    ("result", "attempts", "batch", "expected"),
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
def test_what_an_attempt_comes_to(
    result: AttemptResult, attempts: int, batch: dict[str, Any], expected: Ruling
) -> None:
    ruling = decide(result, attempts, RetryPolicy(), now=NOW, rand=lambda: 0.0, **batch)
    assert ruling == expected


def test_the_policys_jitter_is_drawn_from_the_rand_given() -> None:
    ruling = decide(answer(503), 1, RetryPolicy(), now=NOW, rand=lambda: 1.0)
    assert ruling.due_at == after(22.5)


def test_a_fixed_schedule_retries_by_it_and_gives_up_after_its_nine_tries() -> None:
    policy = RetryPolicy(schedule=DAY_SCHEDULE, jitter=0.0)
    assert decide(answer(503), 8, policy, now=NOW).due_at == after(DAY_SCHEDULE[7])
    assert decide(answer(503), 9, policy, now=NOW).outcome is Outcome.FAILED


def waited_after_503(retry_after: str) -> float:
    """Seconds before the retry of a 503 answered with ``retry_after``, as
    an inbox's answer is judged, without jitter, RETRY_AFTER_MAX an hour."""
    answer = Answer(status=503, headers={"Retry-After": retry_after}, body=b"", elapsed=0.1)
    result = judged(JOB, 503, ActivityPub().judge(answer), "the inbox answered 503")
    ruling = decide(result, 1, RetryPolicy(jitter=0.0), now=NOW, retry_after_max=3600.0)
    assert ruling.outcome is Outcome.RETRYING and ruling.due_at is not None
    return (ruling.due_at - NOW).total_seconds()


@pytest.mark.parametrize(
    "retry_after",
    ["999999999999", "10000000000000", "9" * 400, "Fri, 31 Dec 9999 23:59:59 GMT"],
)
def test_a_retry_after_longer_than_the_longest_wait_waits_the_longest(retry_after: str) -> None:
    # However it is written, the server that asks to be left alone longest
    # is never knocked on sooner than one asking less.
    assert waited_after_503(retry_after) == 3600.0
