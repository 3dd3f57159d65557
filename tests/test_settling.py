from __future__ import annotations

from typing import Any

import pytest

from django_federation_delivery import store
from django_federation_delivery.decide import Outcome
from django_federation_delivery.retry import RetryPolicy
from django_federation_delivery.settling import Settler, Summary, failure

from .test_decide import JOB, answer


def test_an_outcome_compares_equal_to_the_string_receivers_know() -> None:
    assert [str(outcome) for outcome in Outcome] == [
        "delivered",
        "retrying",
        "held",
        "refused",
        "failed",
        "skipped",
        "superseded",
    ]
    assert Outcome.HELD == "held"


def test_the_summary_counts_each_outcome_in_its_own_field() -> None:
    summary = Summary()
    # The loop never supersedes: a send does (retractions.py).
    for outcome in set(Outcome) - {Outcome.SUPERSEDED}:
        summary.count(outcome)
    summary.count(Outcome.DELIVERED)
    assert (summary.delivered, summary.held, summary.skipped, summary.done) == (2, 1, 1, 7)


def test_a_failure_names_a_webhook_by_its_destination_and_an_inbox_by_nothing_more() -> None:
    given_up = store.GivenUp(id=3, batch_id=2, inbox="ops", last_status=None, destination="ops")
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
