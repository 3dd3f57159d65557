"""Users of the admin, and queues and hosts in known states, for the tests."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable
from typing import Any

from django.contrib.auth.models import Permission, User
from django.db.models import F
from django.utils import timezone

from django_federation_delivery import send
from django_federation_delivery.models import Batch, Breaker, Delivery, Host, Status

from .keys import ALICE

MODELS = ("batch", "delivery", "breaker", "host")
NOTE = {"@context": "https://www.w3.org/ns/activitystreams", "type": "Create", "object": "x"}
PASSWORD = "correct horse battery staple"


def user(username: str, actions: Iterable[str] = ("view", "change")) -> User:
    """A staff user with ``actions`` permissions on every model of the app
    ("change_host" and the like name one model only)."""
    person = User.objects.create_user(username, password=PASSWORD, is_staff=True)
    codenames = [
        action if "_" in action else f"{action}_{model}" for action in actions for model in MODELS
    ]
    person.user_permissions.set(
        Permission.objects.filter(
            content_type__app_label="federation_delivery", codename__in=set(codenames)
        )
    )
    return person


def queue(hosts: Iterable[str] = ("a.example", "b.example"), per_host: int = 2, **kw: str) -> Batch:
    """A batch of ``per_host`` pending deliveries to each host, due now."""
    inboxes = [f"https://{host}/users/u{n}/inbox" for host in hosts for n in range(per_host)]
    batch = send(kw.get("sender", ALICE), NOTE, inboxes)
    assert batch is not None
    if "tag" in kw:
        Batch.objects.filter(pk=batch.pk).update(tag=kw["tag"])
        batch.refresh_from_db()
    return batch


def settle(
    delivery: Delivery,
    status: Status,
    *,
    last_status: int | None = None,
    attempts: int = 3,
    ago: dt.timedelta = dt.timedelta(minutes=1),
) -> None:
    """Settle ``delivery`` as ``status`` ``ago``, as the deliverer would have."""
    Delivery.objects.filter(pk=delivery.pk).update(
        status=status,
        attempts=attempts,
        due_at=None,
        last_status=last_status,
        last_error="" if status == Status.DELIVERED else f"HTTP {last_status}",
        last_attempt_at=timezone.now() - ago,
        settled_at=timezone.now() - ago,
    )
    Batch.objects.filter(pk=delivery.batch_id, remaining__gt=0).update(remaining=F("remaining") - 1)


def quick_breaker(settings: Any, **more: Any) -> None:
    """A breaker that opens at the second failure and stays open a minute,
    and retries a minute apart: what a host is charged with shows at once,
    and nothing is tried again meanwhile."""
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "BREAKER": {"THRESHOLD": 2, "COOL_OFF": 60.0, "SCOPE": "host"},
        "RETRY": {"BASE": 60, "CAP": 60, "ATTEMPTS": 5, "JITTER": 0},
        **more,
    }


def open_breaker(key: str, failures: int = 10, seconds: float = 60) -> Breaker:
    breaker, _ = Breaker.objects.update_or_create(
        key=key,
        defaults={
            "failures": failures,
            "open_until": timezone.now() + dt.timedelta(seconds=seconds),
        },
    )
    return breaker


def unavailable_and_due_a_probe(inbox: str, host: str, now: dt.datetime) -> None:
    """``host`` marked unavailable two days ago, after failing for a week, and
    due its daily probe, which goes where ``inbox``, its last delivery, was."""
    batch = send(ALICE, NOTE, [inbox])
    Delivery.objects.filter(batch=batch).update(
        status=Status.FAILED, settled_at=now - dt.timedelta(days=8), due_at=None
    )
    Host.objects.update_or_create(
        name=host,
        defaults={
            "failing_since": now - dt.timedelta(days=9),
            "unavailable_since": now - dt.timedelta(days=2),
        },
    )
