"""An operator's controls, where they meet the deliverers working at the same time."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from django.utils import timezone

from django_federation_delivery import controls, send, signals
from django_federation_delivery.models import Delivery, Status
from django_federation_delivery.store import settlements

from .keys import ALICE

pytestmark = pytest.mark.django_db

NOTE = {"type": "Note"}


@pytest.fixture
def failures() -> Iterator[list[Any]]:
    seen: list[Any] = []

    def failed(sender: Any, failure: Any, **kwargs: Any) -> None:
        seen.append(failure)

    signals.delivery_failed.connect(failed, weak=False)
    yield seen
    signals.delivery_failed.disconnect(failed)


def test_give_up_tells_only_of_what_it_changed_not_of_what_was_settled_meanwhile(
    monkeypatch: pytest.MonkeyPatch, failures: list[Any]
) -> None:
    batch = send(ALICE, NOTE, [f"https://a.example/u{n}" for n in range(3)])
    assert batch is not None
    first, *others = batch.deliveries.order_by("id")
    give_up_rows = settlements.give_up_rows

    def delivered_meanwhile(ids: list[int], *args: Any, **kwargs: Any) -> list[int]:
        # A deliverer's outcome lands between the operator's look at what is
        # pending and the write.
        Delivery.objects.filter(pk=first.pk).update(
            status=Status.DELIVERED, due_at=None, lease_token=None, settled_at=timezone.now()
        )
        return give_up_rows(ids, *args, **kwargs)

    monkeypatch.setattr(settlements, "give_up_rows", delivered_meanwhile)
    assert controls.give_up(Delivery.objects.filter(batch=batch)) == 2
    assert sorted(f.delivery_id for f in failures) == [row.pk for row in others]
    assert {(f.sender, f.error) for f in failures} == {(ALICE, "given up by an operator")}
    first.refresh_from_db()
    assert first.status == Status.DELIVERED and first.last_error == ""
