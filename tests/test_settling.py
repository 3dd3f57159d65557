from __future__ import annotations

import dataclasses
import datetime as dt
from typing import Any

import pytest

from django_federation_delivery import store
from django_federation_delivery.attempt import AttemptResult, failed, held
from django_federation_delivery.channels.activitypub import InboxJob
from django_federation_delivery.retry import DAY_SCHEDULE, RetryPolicy
from django_federation_delivery.settling import Settler, Summary, Verdict, decide, failure
from django_federation_delivery.signals import Outcome
from django_federation_delivery.signatures import Scheme

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
CASES: list[tuple[str, AttemptResult, int, dict[str, Any], Verdict]] = [
    ("delivered", answer(202), 1, {}, Verdict(Outcome.DELIVERED)),
    (
        "delivered past the deadline is still delivered",
        answer(202),
        12,
        {"deadline": after(-60), "max_attempts": 3},
        Verdict(Outcome.DELIVERED),
    ),
    (
        "a permanent status is refused",
        answer(410, permanent=True),
        1,
        {},
        Verdict(Outcome.REFUSED, error="HTTP 410"),
    ),
    (
        "a passing status is refused when the sender is gone",
        answer(401),
        1,
        {"sender_gone": True},
        Verdict(Outcome.REFUSED, error="HTTP 401"),
    ),
    (
        "a 503 is retried after the policy's wait",
        answer(503),
        1,
        {},
        Verdict(Outcome.RETRYING, due_at=after(30), error="HTTP 503"),
    ),
    (
        "the wait doubles with each attempt",
        answer(503),
        3,
        {},
        Verdict(Outcome.RETRYING, due_at=after(120), error="HTTP 503"),
    ),
    (
        "Retry-After longer than the policy's wait is waited as asked",
        answer(429, retry_after=600),
        1,
        {},
        Verdict(Outcome.RETRYING, due_at=after(600), error="HTTP 429"),
    ),
    (
        "Retry-After shorter than the policy's wait is not",
        answer(503, retry_after=10),
        3,
        {},
        Verdict(Outcome.RETRYING, due_at=after(120), error="HTTP 503"),
    ),
    (
        "Retry-After is capped at RETRY_AFTER_MAX",
        answer(503, retry_after=86400),
        1,
        {"retry_after_max": 3600.0},
        Verdict(Outcome.RETRYING, due_at=after(3600), error="HTTP 503"),
    ),
    (
        "Retry-After is ignored without WAIT_AS_ASKED",
        answer(503, retry_after=600),
        1,
        {"wait_as_asked": False},
        Verdict(Outcome.RETRYING, due_at=after(30), error="HTTP 503"),
    ),
    (
        "the batch's max attempts gives up",
        answer(503),
        3,
        {"max_attempts": 3},
        Verdict(Outcome.FAILED, error="gave up after 3 attempts: HTTP 503"),
    ),
    (
        "the end of the retry policy gives up",
        answer(503),
        12,
        {},
        Verdict(Outcome.FAILED, error="gave up after 12 attempts: HTTP 503"),
    ),
    (
        "a 503 on the 12th attempt past the deadline is given up by the policy",
        answer(503),
        12,
        {"deadline": after(-60)},
        Verdict(Outcome.FAILED, error="gave up after 12 attempts: HTTP 503"),
    ),
    (
        "a retry due past the batch's deadline gives up",
        answer(503),
        2,
        {"deadline": after(59)},
        Verdict(Outcome.FAILED, error="the batch's deadline passed: HTTP 503", deadline=True),
    ),
    (
        "a retry due just before the deadline is retried",
        answer(503),
        2,
        {"deadline": after(61)},
        Verdict(Outcome.RETRYING, due_at=after(60), error="HTTP 503"),
    ),
    (
        "held by a breaker waits at least the policy's wait",
        held(JOB, "held: open", retry_after=5.0),
        1,
        {},
        Verdict(Outcome.HELD, due_at=after(30), error="held: open"),
    ),
    (
        "held by a breaker waits out its cool-off when longer",
        held(JOB, "held: open", retry_after=300.0),
        1,
        {},
        Verdict(Outcome.HELD, due_at=after(300), error="held: open"),
    ),
    (
        "held at the last attempt is given up",
        held(JOB, "held: open", retry_after=5.0),
        12,
        {},
        Verdict(Outcome.FAILED, error="gave up after 12 attempts: held: open"),
    ),
]


@pytest.mark.parametrize(
    ("result", "attempts", "batch", "expected"),
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
def test_what_an_attempt_comes_to(
    result: AttemptResult, attempts: int, batch: dict[str, Any], expected: Verdict
) -> None:
    verdict = decide(result, attempts, RetryPolicy(), now=NOW, rand=lambda: 0.0, **batch)
    assert verdict == expected


def test_the_policys_jitter_is_drawn_from_the_rand_given() -> None:
    verdict = decide(answer(503), 1, RetryPolicy(), now=NOW, rand=lambda: 1.0)
    assert verdict.due_at == after(22.5)


def test_a_fixed_schedule_retries_by_it_and_gives_up_after_its_nine_tries() -> None:
    policy = RetryPolicy(schedule=DAY_SCHEDULE)
    assert decide(answer(503), 8, policy, now=NOW).due_at == after(DAY_SCHEDULE[7])
    assert decide(answer(503), 9, policy, now=NOW).outcome is Outcome.FAILED


def test_an_outcome_compares_equal_to_the_string_receivers_know() -> None:
    assert [str(outcome) for outcome in Outcome] == [
        "delivered",
        "retrying",
        "held",
        "refused",
        "failed",
        "skipped",
    ]
    assert Outcome.HELD == "held"


def test_the_summary_counts_each_outcome_in_its_own_field() -> None:
    summary = Summary()
    for outcome in Outcome:
        summary.count(outcome)
    summary.count(Outcome.DELIVERED)
    assert (summary.delivered, summary.held, summary.skipped, summary.done) == (2, 1, 1, 7)


def test_a_failure_names_a_webhook_by_its_destination_and_an_inbox_by_nothing_more() -> None:
    given_up = store.GivenUp(
        id=3, batch_id=2, inbox="webhook:ops", last_status=None, destination="ops"
    )
    payload = failure(given_up, sender="", tag="t", event_type="deploy", status=None, error="gone")
    assert (payload.delivery_id, payload.batch_id, payload.destination) == (3, 2, "ops")
    assert (payload.deadline, payload.refused) == (False, False)
    inbox = store.GivenUp(
        id=4, batch_id=2, inbox="https://a.example/inbox", last_status=500, destination=""
    )
    assert (
        failure(inbox, sender="s", tag="", event_type="", status=500, error="x").destination == ""
    )


def test_a_signal_nobody_receives_is_not_made_and_one_received_is(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from django_federation_delivery import signals
    from django_federation_delivery.batches import BatchInfo

    made: list[str] = []

    def counted(name: str) -> Any:
        real = getattr(signals, name)

        def make(*args: Any, **kwargs: Any) -> Any:
            made.append(name)
            return real(*args, **kwargs)

        return make

    for name in ("Attempted", "Settled"):
        monkeypatch.setattr(signals, name, counted(name))
    row = store.Claimed(1, 2, "https://social.example/inbox", "social.example", 0, (), "t", 0.0)
    batch = BatchInfo(2, JOB.sender, b"{}", "", "", None, None, False, False)
    settler = Settler(policy=RetryPolicy(), summary=Summary())
    settler.attempted(row, batch, answer(202))
    assert made == []
    received: list[Any] = []

    def receiver(sender: object, settled: Any, **kwargs: object) -> None:
        received.append(settled)

    signals.delivery_settled.connect(receiver)
    try:
        settler.attempted(row, batch, answer(202))
    finally:
        signals.delivery_settled.disconnect(receiver)
    assert made == ["Settled"]
    assert [(s.delivery_id, s.outcome) for s in received] == [(1, Outcome.DELIVERED)]
