"""``manage.py purge_deliveries``."""

from __future__ import annotations

import datetime as dt
import io
from typing import Any

import pytest
from django.core.management import CommandError, call_command
from django.utils import timezone

from django_federation_delivery.management.commands.purge_deliveries import parse_age
from django_federation_delivery.models import Batch, Delivery, DeliveryHistory, Status

pytestmark = pytest.mark.django_db(transaction=True)


def settled(days: float, status: Status = Status.DELIVERED, count: int = 3) -> Batch:
    now = timezone.now()
    batch = Batch.objects.create(sender="https://a.example/u", body="{}", created_at=now)
    Batch.objects.filter(id=batch.id).update(created_at=now - dt.timedelta(days=days, hours=1))
    Delivery.objects.bulk_create(
        [
            Delivery(
                batch=batch,
                inbox=f"https://a.example/{n}",
                host="a.example",
                status=status,
                settled_at=now - dt.timedelta(days=days),
            )
            for n in range(count)
        ]
    )
    return batch


def purge(*args: str) -> str:
    out = io.StringIO()
    call_command("purge_deliveries", *args, stdout=out)
    return out.getvalue()


def test_it_deletes_by_retention_and_says_what_per_status() -> None:
    settled(8)
    settled(8, Status.FAILED)
    kept = settled(1)
    pending = settled(60, Status.PENDING)
    output = purge()
    assert (
        "deleted 3 deliveries (delivered 3, skipped 0, failed 0, refused 0, superseded 0), 1 batch,"
        in output
    )
    assert set(Batch.objects.values_list("id", flat=True)) >= {kept.id, pending.id}
    assert Delivery.objects.filter(status=Status.PENDING).count() == 3
    assert Delivery.objects.filter(status=Status.FAILED).count() == 3


def test_older_than_applies_to_every_settled_status_and_never_to_pending() -> None:
    settled(2)
    settled(2, Status.REFUSED)
    settled(2, Status.PENDING)
    kept = settled(0.5, Status.SKIPPED)
    output = purge("--older-than", "36h")
    assert "deleted 6 deliveries" in output
    assert set(Delivery.objects.values_list("status", flat=True)) == {"pending", "skipped"}
    assert Batch.objects.filter(id=kept.id).exists()


def test_a_dry_run_counts_and_deletes_nothing() -> None:
    settled(40)
    settled(40, Status.FAILED)
    output = purge("--dry-run")
    assert "Dry run: would delete 6 deliveries" in output
    assert "2 batches" in output
    assert Delivery.objects.count() == 6 and Batch.objects.count() == 2


def test_a_retention_of_none_purges_nothing(settings: Any) -> None:
    settings.FEDERATION_DELIVERY = {**settings.FEDERATION_DELIVERY, "RETENTION": None}
    settled(400)
    assert "keeps every settled delivery: deleted 0 history minutes" in purge()
    assert Delivery.objects.count() == 3


def test_a_dry_run_with_a_retention_of_none_says_what_it_would_delete(settings: Any) -> None:
    # It said what the real purge says ("nothing to purge but 3 history
    # minutes"): no one could tell whether the minutes were gone.
    settings.FEDERATION_DELIVERY = {**settings.FEDERATION_DELIVERY, "RETENTION": None}
    old = timezone.now() - dt.timedelta(days=30)
    for n in range(3):
        DeliveryHistory.objects.create(minute=old + dt.timedelta(minutes=n), delivered=1)
    assert "Dry run: RETENTION keeps every settled delivery; would delete 3 history" in purge(
        "--dry-run"
    )
    assert DeliveryHistory.objects.count() == 3
    assert "deleted 3 history minutes" in purge()
    assert DeliveryHistory.objects.count() == 0


@pytest.mark.parametrize(
    ("value", "seconds"),
    [("7d", 7 * 86400), ("12h", 43200), ("90m", 5400), ("3600s", 3600), (" 1d ", 86400)],
)
def test_an_age_is_read_in_days_hours_minutes_or_seconds(value: str, seconds: float) -> None:
    assert parse_age(value) == seconds


@pytest.mark.parametrize("value", ["7", "0d", "-1d", "1w", "1.5h", "d", "", "99999999999d"])
def test_a_bad_age_is_refused_naming_it_before_anything_is_deleted(value: str) -> None:
    settled(40)
    with pytest.raises(CommandError, match=f"not {value!r}"):
        purge(f"--older-than={value}")
    assert Delivery.objects.count() == 3


def test_a_webhook_url_pasted_as_the_age_is_named_by_its_host_alone() -> None:
    secret = "https://hooks.slack.com/services/T0AAAA1/B0BBBB2/s3cretT0kenV4lue9"
    with pytest.raises(CommandError, match=r"hooks\.slack\.com") as refused:
        purge(f"--older-than={secret}")
    assert "s3cret" not in str(refused.value) and "services" not in str(refused.value)


def test_a_bad_retention_is_refused_naming_it(settings: Any) -> None:
    settings.FEDERATION_DELIVERY = {**settings.FEDERATION_DELIVERY, "RETENTION": {"FAILED": -5}}
    settled(400, Status.FAILED)
    with pytest.raises(CommandError, match="-5"):
        purge()
    assert Delivery.objects.count() == 3


def test_an_unknown_database_is_refused_naming_it() -> None:
    with pytest.raises(CommandError, match="'elsewhere'"):
        purge("--database=elsewhere")
