"""The queues at a glance: what overview.py tells people from what it reads."""

from __future__ import annotations

import datetime as dt

import pytest
from django.utils import timezone

from django_federation_delivery import heartbeats
from django_federation_delivery.heartbeats import Seen
from django_federation_delivery.overview import stalled

SECOND = dt.timedelta(seconds=1)


@pytest.mark.parametrize(
    ("live", "last_seen_ago", "due", "message"),
    [
        (False, None, 3, "No deliverer has been seen in the last day while 3 deliveries are due"),
        (False, 252, 1, "No deliverer seen for 4m 12s while 1 delivery is due"),
        (False, 30, 120, ""),  # dead, but a restart takes a moment
        (True, 1, 120, ""),
        (False, None, 0, ""),  # nothing to do
    ],
)
def test_work_due_with_no_deliverer_seen_for_a_minute_is_stalled(
    live: bool, last_seen_ago: float | None, due: int, message: str
) -> None:
    now = timezone.now()
    last_seen = now - last_seen_ago * SECOND if last_seen_ago is not None else None
    deliverer = heartbeats.SeenDeliverer("h", 1, "0.1", now, now, 0, 0.0)
    seen = Seen(live=(deliverer,) if live else (), last_seen=last_seen)
    assert stalled(seen, due, now) == message
