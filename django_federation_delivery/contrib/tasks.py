"""Rounds of the deliverer, the purge and the breakers' upkeep as Django's
tasks (``django.tasks``, Django 6.0 and later).

A project whose task backend has workers running anyway can have them do
the app's periodic work instead of running ``run_deliverer``: it enqueues
:data:`deliver_round` every minute and :data:`purge` every hour, from
whatever runs its periodic jobs (Django's tasks have no schedule of their
own). Each is a ``django.tasks.Task``: ``deliver_round.enqueue()``,
``purge.enqueue(seconds=600)``. A round is ``contrib.rounds``'s, the same
as django-q2's, and takes the same lock: two never run at once, whichever
ran them.

The tasks are declared on the ``TASKS`` backend named ``federation_delivery``
when there is one, else on ``default``: a project can keep Django's
ImmediateBackend for its own small tasks and send these to workers.

Importing the module registers its system check (``W005``), as importing
``django.tasks`` registers Django's: a backend that runs a task in the
process that enqueues it (ImmediateBackend: a round would hold the request
that enqueued it) or never runs it (DummyBackend) is warned of.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import django
from django.utils.translation import gettext as _
from django.utils.translation import gettext_noop

from django_federation_delivery.contrib import told

if django.VERSION < (6, 0):
    # Translated once the apps are ready (imported by a task or a view).
    raise ImportError(
        told(
            gettext_noop(
                "django_federation_delivery.contrib.tasks needs Django 6.0 or later, "
                "whose django.tasks it declares its tasks with; this is Django %(version)s."
            )
        )
        % {"version": django.get_version()}
    )

from django.conf import settings
from django.core.checks import CheckMessage, Warning, register
from django.db import connections
from django.tasks import DEFAULT_TASK_BACKEND_ALIAS, task, task_backends
from django.tasks.backends.dummy import DummyBackend
from django.tasks.backends.immediate import ImmediateBackend
from django.utils import timezone

from django_federation_delivery.breakers import Breakers
from django_federation_delivery.checks import PREFIX
from django_federation_delivery.conf import database_alias
from django_federation_delivery.contrib import rounds
from django_federation_delivery.heartbeats import Heartbeat
from django_federation_delivery.models import Breaker

__all__ = [
    "ALIAS",
    "BACKEND",
    "ROUND_PERIOD",
    "backend_problems",
    "breaker_upkeep",
    "check_backend",
    "deliver_round",
    "purge",
]

#: The TASKS backend the tasks are declared on when the project names one so.
ALIAS = "federation_delivery"
#: How often rounds are taken to be enqueued when ``deliver_round`` is not told.
ROUND_PERIOD = 60.0
BREAKERS_OFF = "breakers are turned off"


def backend_alias() -> str:
    """The TASKS backend the tasks are declared on: ``federation_delivery``
    if TASKS has it, else ``default``."""
    return ALIAS if ALIAS in settings.TASKS else DEFAULT_TASK_BACKEND_ALIAS


BACKEND = backend_alias()

#: This process's heartbeat, by database: its rounds keep one row up to date.
_heartbeats: dict[str, Heartbeat] = {}


def _database(using: object) -> str:
    if using is None:
        return database_alias()
    if not isinstance(using, str) or using not in connections:
        raise ValueError(
            _("using must name a database of DATABASES, not %(value)r") % {"value": using}
        )
    return using


@task(backend=BACKEND)
def deliver_round(
    seconds: float | None = None,
    *,
    period: float = ROUND_PERIOD,
    using: str | None = None,
) -> dict[str, Any]:
    """Claim and send for ``seconds`` (50 when not told, a day at most), then
    finish what is in flight (up to the longest attempt: ``ATTEMPT_TIMEOUT``,
    ``WEBHOOK_TIMEOUT`` or a webhook kind's own time limit, and 5 s) and
    return what was done; at once, saying so, when another round is running.
    ``period``: how often the project enqueues a round, in seconds (a day at
    most); the process is taken for a dead deliverer three periods after its
    last round."""
    bound = (
        rounds.ROUND_SECONDS
        if seconds is None
        else rounds.positive(
            seconds,
            _("a round's seconds must be a positive number, at most %(most)g, not %(value)s"),
        )
    )
    every = rounds.positive(
        period,
        _("a round's period must be a positive number of seconds, at most %(most)g, not %(value)s"),
    )
    using = _database(using)
    rounds.refuse_bad_settings()
    heartbeat = rounds.kept_heartbeat(_heartbeats, using, period=every)
    return rounds.run_round(bound, using=using, heartbeat=heartbeat)


@task(backend=BACKEND)
def purge(seconds: float | None = None, *, using: str | None = None) -> dict[str, Any]:
    """Delete what is past ``RETENTION``, a chunk at a time; with ``seconds``,
    stop between chunks once they have passed (``finished`` is then false,
    and the next purge goes on). Returns what it deleted."""
    bound = (
        None
        if seconds is None
        else rounds.positive(
            seconds,
            _("a purge's seconds must be a positive number, at most %(most)g, not %(value)s"),
        )
    )
    return rounds.run_purge(using=_database(using), seconds=bound)


@task(backend=BACKEND)
def breaker_upkeep(*, using: str | None = None) -> dict[str, Any]:
    """Forget the breakers nothing has touched for twice their cool-off (ten
    minutes at the least): closed ones, and ones open long ago with no probe
    under way. It is what a deliverer does as it reads the breakers, every
    second while it runs and as each round starts; a breaker needs nothing
    else done over time (a probe that never reports back stops being one by
    its time alone). Returns how many were forgotten, how many stand, and
    how many of those hold every delivery now."""
    using = _database(using)
    breakers = Breakers.from_settings(using=using)
    if breakers is None:
        return {"ran": False, "reason": BREAKERS_OFF}
    before = Breaker.objects.using(using).count()
    breakers.refresh()
    standing = len(breakers.view)
    return {
        "ran": True,
        "forgotten": max(before - standing, 0),
        "standing": standing,
        "holding": len(breakers.view.holding(timezone.now())),
    }


def backend_problems(alias: str) -> list[CheckMessage]:
    """What keeps the TASKS backend ``alias`` from running the tasks usefully."""
    backend = task_backends[alias]
    if isinstance(backend, DummyBackend):
        return [
            Warning(
                _(
                    "The delivery tasks are declared on TASKS[%(alias)r], a DummyBackend, "
                    "which never runs a task: no round, purge or breaker upkeep enqueued "
                    "there would happen."
                )
                % {"alias": alias},
                hint=_(
                    "Give TASKS a backend whose workers run tasks, as "
                    "TASKS[%(name)r] for these tasks alone; keep DummyBackend to tests."
                )
                % {"name": ALIAS},
                id=f"{PREFIX}.W005",
            )
        ]
    if isinstance(backend, ImmediateBackend):
        return [
            Warning(
                _(
                    "The delivery tasks are declared on TASKS[%(alias)r], an ImmediateBackend, "
                    "which runs a task in the process that enqueues it: a round enqueued "
                    "in a request would hold that request for %(seconds)g s and more."
                )
                % {"alias": alias, "seconds": rounds.ROUND_SECONDS},
                hint=_(
                    "Give TASKS a backend whose workers run tasks outside the web "
                    "processes, as TASKS[%(name)r] for these tasks alone; or, if only a "
                    "command of your own enqueues them, silence federation_delivery.W005."
                )
                % {"name": ALIAS},
                id=f"{PREFIX}.W005",
            )
        ]
    return []


@register()
def check_backend(app_configs: Sequence[Any] | None = None, **kwargs: Any) -> list[CheckMessage]:
    """The backend the tasks are declared on, as :func:`backend_problems` sees it."""
    return backend_problems(deliver_round.backend)
