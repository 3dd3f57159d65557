"""The admin: the queues at a glance, and batches, deliveries, breakers and hosts.

Rows are read-only here: no add, no edit, no delete, as a hand-edited row
would bypass the queue's bookkeeping (a batch's count of what remains, the
signals). An operator acts through the actions, which call ``controls``, and
each action needs the change permission of what it changes: requeueing and
giving up need ``change_delivery``, pausing and resuming ``change_host`` (and
so does enabling a webhook destination again, which resumes its host row),
resetting a breaker ``change_breaker``.
"""

from __future__ import annotations

from django_federation_delivery.admin.base import next_due
from django_federation_delivery.admin.batches import BatchAdmin, batch_progress, progress_bar
from django_federation_delivery.admin.deliveries import DeliveryAdmin
from django_federation_delivery.admin.hosts import BreakerAdmin, HostAdmin, host_pending

__all__ = [
    "BatchAdmin",
    "BreakerAdmin",
    "DeliveryAdmin",
    "HostAdmin",
    "batch_progress",
    "host_pending",
    "next_due",
    "progress_bar",
]
