"""System checks for the ``FEDERATION_DELIVERY`` settings and the database.

Importing this package registers them all (``apps.py`` does, once ready),
but for ``federation_delivery.W005``, which ``contrib/tasks.py`` registers
when a project imports it.
"""

from __future__ import annotations

from collections.abc import Callable

from django.core.checks import CheckMessage

from django_federation_delivery.checks.bounds import (
    LONGEST_RETENTION,
    PREFIX,
    SECONDS,
    WHOLE_NUMBERS,
)
from django_federation_delivery.checks.database import (
    check_isolation,
    check_routing,
    check_sqlite,
    lacking_migrations,
    sqlite_problems,
    unapplied_migrations,
)
from django_federation_delivery.checks.policies import check_retention
from django_federation_delivery.checks.values import check_inbox_networks, check_settings
from django_federation_delivery.checks.webhooks import check_removed_destinations, check_webhooks

__all__ = [
    "DELIVERER_CHECKS",
    "LONGEST_RETENTION",
    "PREFIX",
    "SECONDS",
    "WHOLE_NUMBERS",
    "check_inbox_networks",
    "check_isolation",
    "check_removed_destinations",
    "check_retention",
    "check_routing",
    "check_settings",
    "check_sqlite",
    "check_webhooks",
    "deliverer_problems",
    "lacking_migrations",
    "sqlite_problems",
    "unapplied_migrations",
]


#: What a deliverer is checked for before it sends, run by the commands or
#: a task queue's round (called directly, or run with ``--skip-checks``, the
#: system checks have not run): a bad setting, an inbox network, a kind of
#: destination that does not load or a webhook destination that does not
#: parse, each of which would fail every delivery it touches.
DELIVERER_CHECKS = (check_settings, check_inbox_networks, check_webhooks)


def deliverer_problems(*checks: Callable[[], list[CheckMessage]]) -> str:
    """What ``checks`` (by default :data:`DELIVERER_CHECKS`) find serious and
    the project did not silence, one a line, each with its id and hint (""
    when nothing): what ``run_deliverer`` and a round refuse to start on,
    saying what to write."""
    problems = [
        message
        for check in checks or DELIVERER_CHECKS
        for message in check()
        # As manage.py check: what the project silenced is not told.
        if message.is_serious() and not message.is_silenced()
    ]
    return "\n".join(f"{m.id}: {m.msg} {m.hint or ''}".rstrip() for m in problems)
