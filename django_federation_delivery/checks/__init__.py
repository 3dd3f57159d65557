"""System checks for the ``FEDERATION_DELIVERY`` settings and the database.

Importing this package registers them all (``apps.py`` does, once ready),
but for ``federation_delivery.W005``, which ``contrib/tasks.py`` registers
when a project imports it.
"""

from __future__ import annotations

from django_federation_delivery.checks.bounds import (
    LONGEST_RETENTION,
    PREFIX,
    SECONDS,
    WHOLE_NUMBERS,
)
from django_federation_delivery.checks.database import (
    check_sqlite,
    sqlite_problems,
    unapplied_migrations,
)
from django_federation_delivery.checks.policies import check_retention
from django_federation_delivery.checks.values import check_inbox_networks, check_settings
from django_federation_delivery.checks.webhooks import check_removed_destinations, check_webhooks

__all__ = [
    "LONGEST_RETENTION",
    "PREFIX",
    "SECONDS",
    "WHOLE_NUMBERS",
    "check_inbox_networks",
    "check_removed_destinations",
    "check_retention",
    "check_settings",
    "check_sqlite",
    "check_webhooks",
    "sqlite_problems",
    "unapplied_migrations",
]
