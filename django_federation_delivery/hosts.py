"""Hosts: those an operator paused, and the signature scheme each last accepted.

A paused host's deliveries have no due time, so the claim never sees them;
resuming makes them due now. The scheme a host accepted is kept here so that
every process, and the next start, knocks in it first.
"""

from __future__ import annotations

from collections.abc import Iterable

from django.db import DEFAULT_DB_ALIAS, transaction
from django.utils import timezone

from django_federation_delivery import wakeup
from django_federation_delivery.models import Delivery, Host, Status


def paused_hosts(*, using: str | None = None) -> set[str]:
    manager = Host.objects.using(using or DEFAULT_DB_ALIAS)
    return set(manager.filter(paused_at__isnull=False).values_list("name", flat=True))


def pause_host(host: str, *, using: str | None = None) -> int:
    """Hold a host's deliveries, unsent and not failed: they have no due time
    until :func:`resume_host`. Returns how many were held now; those in
    flight finish, and any retry of theirs is held when it comes due."""
    alias = using or DEFAULT_DB_ALIAS
    with transaction.atomic(using=alias):
        Host.objects.using(alias).update_or_create(
            name=host, defaults={"paused_at": timezone.now()}
        )
        return int(
            Delivery.objects.using(alias)
            .filter(host=host, status=Status.PENDING, lease_token__isnull=True)
            .exclude(due_at__isnull=True)
            .update(due_at=None)
        )


def resume_host(host: str, *, using: str | None = None) -> int:
    """Make a paused host's held deliveries due now. Returns how many."""
    alias = using or DEFAULT_DB_ALIAS
    now = timezone.now()
    with transaction.atomic(using=alias):
        Host.objects.using(alias).filter(name=host).update(paused_at=None, updated_at=now)
        released = (
            Delivery.objects.using(alias)
            .filter(host=host, status=Status.PENDING, due_at__isnull=True, after__isnull=True)
            .update(due_at=now)
        )
    transaction.on_commit(wakeup.notify_local, using=alias)
    return int(released)


def host_schemes(hosts: Iterable[str], *, using: str | None = None) -> dict[str, str]:
    """The scheme each of ``hosts`` last accepted, for those that have one."""
    manager = Host.objects.using(using or DEFAULT_DB_ALIAS)
    return dict(
        manager.filter(name__in=list(hosts)).exclude(scheme="").values_list("name", "scheme")
    )


def remember_schemes(schemes: dict[str, str], *, using: str | None = None) -> int:
    """Record the scheme each host accepted, for every process and the next start."""
    if not schemes:
        return 0
    Host.objects.using(using or DEFAULT_DB_ALIAS).bulk_create(
        [
            Host(name=name, scheme=scheme, updated_at=timezone.now())
            for name, scheme in schemes.items()
        ],
        update_conflicts=True,
        unique_fields=["name"],
        update_fields=["scheme", "updated_at"],
    )
    return len(schemes)
