"""Rounds of the deliverer, and the purge, run by a django-q2 cluster.

A project that already runs ``qcluster`` needs no ``run_deliverer`` beside
it: a schedule runs :func:`deliver_round` every minute, each round the same
claim-and-send loop for a bounded time, and :func:`purge_task` every hour.
:func:`ensure_schedules` (or ``manage.py delivery_schedule``) writes the two
``Schedule`` rows.

A round must be over before the cluster gives up on it: django-q2 kills a
worker past ``Q_CLUSTER["timeout"]`` and, with the ORM broker among others,
hands a task not acknowledged within ``retry`` to another worker. So a round
claims for its bound only, then finishes what is in flight (an attempt lasts
at most ``ATTEMPT_TIMEOUT``, ``WEBHOOK_TIMEOUT`` or a webhook kind's own time
limit; a probe of an unavailable host, none of which starts after the bound,
at most ``ATTEMPT_TIMEOUT``) before it returns, and a bound that would not fit
is refused, naming the settings. Nothing is lost if it is killed all the
same: what it had claimed comes due again when its lease lapses.

Two rounds never run at once (a round still going when the next minute
comes, two clusters, a task handed on past ``retry``, a round of Django's
tasks): a round takes a lock first, and returns at once if another holds
it. What a round is, its lock and its heartbeat are ``contrib.rounds``'s,
shared with ``contrib.tasks``; what is django-q2's is here.
"""

from __future__ import annotations

import hashlib
import os
import sys
from typing import Any

from django.utils.translation import gettext as _
from django.utils.translation import gettext_noop

from django_federation_delivery.contrib import told

try:
    import django_q  # noqa: F401
except ImportError as exc:
    # Translated once the apps are ready (imported by a task or a command).
    raise ImportError(
        told(
            gettext_noop(
                "django_federation_delivery.contrib.django_q needs django-q2: "
                'pip install "django-federation-delivery[django-q]"'
            )
        )
    ) from exc

from django.apps import apps
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.db import connections, router, transaction
from django.db.models import F

from django_federation_delivery.addresses import quoted
from django_federation_delivery.conf import database_alias
from django_federation_delivery.contrib import rounds
from django_federation_delivery.contrib.rounds import (
    ADVISORY_KEY,
    ANOTHER_ROUND,
    FINISH_MARGIN,
    LOCK_SUFFIX,
    MOST_SECONDS,
    ROUND_SECONDS,
    finish_seconds,
    round_lock,
)
from django_federation_delivery.heartbeats import Heartbeat
from django_federation_delivery.store import locks

__all__ = [
    "ADVISORY_KEY",
    "ANOTHER_ROUND",
    "FINISH_MARGIN",
    "LOCK_SUFFIX",
    "MOST_SECONDS",
    "ROUND_SECONDS",
    "cluster_limit",
    "deliver_round",
    "ensure_schedules",
    "finish_seconds",
    "purge_task",
    "remove_schedules",
    "round_lock",
    "round_seconds",
]

#: What a purge leaves of the cluster's limit for its last chunk.
PURGE_MARGIN = 10.0
#: django-q2's ``retry`` when Q_CLUSTER does not set one.
DJANGO_Q_RETRY = 60

ROUND_TASK = f"{__name__}.deliver_round"
PURGE_TASK = f"{__name__}.purge_task"
ROUND_SCHEDULE = "django_federation_delivery: deliver round"
PURGE_SCHEDULE = "django_federation_delivery: purge"


def cluster_limit() -> float | None:
    """The seconds a task may take under ``Q_CLUSTER``: its ``timeout``, and
    ``retry`` (django-q2's default 60 when unset), whichever is shorter.
    None: no limit (no timeout, and a retry of None: a broker that never
    hands a task on, as Redis's). In a cluster of ``ALT_CLUSTERS``, its own."""
    conf = getattr(settings, "Q_CLUSTER", None) or {}
    if not isinstance(conf, dict):
        raise ImproperlyConfigured(
            _("Q_CLUSTER must be a dict, not %(type)s.") % {"type": type(conf).__name__}
        )
    conf = this_cluster(conf)
    limits = []
    for name, default in (("timeout", None), ("retry", DJANGO_Q_RETRY)):
        value = conf.get(name, default)
        if value is None or (name == "timeout" and value == -1):
            continue  # no timeout; no retry
        if name == "retry" and value == 0 and not isinstance(value, bool):
            # Not "never": django-q2's ORM broker leases a task it hands a
            # worker until now + retry (brokers/orm.py, ORM.timeout) and
            # hands one whose lease has passed to the next worker that asks
            # (ORM.dequeue): with 0, at once, while the round runs; SQS's
            # visibility timeout and the MongoDB broker do the same.
            raise ImproperlyConfigured(
                _(
                    "Q_CLUSTER['retry'] is 0, which django-q2's ORM broker takes for "
                    "handing a task to another worker at once, not for never: a round "
                    "would run again while it runs. Set retry above Q_CLUSTER's timeout, "
                    "and above %(least)g s: a round and the time it takes to finish."
                )
                % {"least": ROUND_SECONDS + finish_seconds()}
            )
        # Compared, never made a float first: an int past a float's range
        # would raise OverflowError, naming nothing.
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not 0 < value <= sys.float_info.max
        ):
            raise ImproperlyConfigured(
                _("Q_CLUSTER[%(name)r] must be a positive number of seconds, not %(value)s.")
                % {"name": name, "value": quoted(value)}
            )
        limits.append(float(value))
    return min(limits) if limits else None


def this_cluster(conf: dict[str, Any]) -> dict[str, Any]:
    """``Q_CLUSTER`` as the cluster this process runs reads it: started with
    ``Q_CLUSTER_NAME`` naming one of its ``ALT_CLUSTERS``, that one's
    settings over the rest (django-q2's ``Conf``), its timeout and retry
    among them."""
    name = os.environ.get("Q_CLUSTER_NAME")
    if not name or name in (conf.get("name"), conf.get("cluster_name")):
        return conf
    alternatives = conf.get("ALT_CLUSTERS")
    own = alternatives.get(name) if isinstance(alternatives, dict) else None
    if not isinstance(own, dict):
        return conf
    return {**conf, **{key: value for key, value in own.items() if key not in NAMES}}


#: What a cluster of ALT_CLUSTERS does not take from its own settings.
NAMES = frozenset({"name", "cluster_name"})


def round_seconds(seconds: float | None = None) -> float:
    """The bound of a round: ``seconds``, or ROUND_SECONDS made shorter if
    the cluster's limit needs it. A bound that, with the time to finish what
    is in flight, would not fit in the cluster's limit is refused, naming
    the settings to change."""
    limit = cluster_limit()
    finish = finish_seconds()
    if seconds is None:
        seconds = ROUND_SECONDS if limit is None else min(ROUND_SECONDS, limit - finish)
        if seconds < 1:
            raise ImproperlyConfigured(
                _(
                    "Q_CLUSTER's timeout and retry allow a task %(limit)g s, and a round needs "
                    "%(finish)g s to finish what is in flight (its longest attempt: "
                    "ATTEMPT_TIMEOUT, WEBHOOK_TIMEOUT or a webhook kind's own time limit, and "
                    "%(margin)g s) beyond the time it claims: set "
                    "Q_CLUSTER's timeout to at least %(least)g and retry above it."
                )
                % {
                    "limit": limit,
                    "finish": finish,
                    "margin": FINISH_MARGIN,
                    "least": finish + ROUND_SECONDS,
                }
            )
        return seconds
    seconds = rounds.positive(
        seconds, _("a round's seconds must be a positive number, at most %(most)g, not %(value)s")
    )
    if limit is not None and seconds + finish > limit:
        raise ImproperlyConfigured(
            _(
                "A round of %(seconds)g s, and %(finish)g s to finish what is in flight "
                "(its longest attempt: ATTEMPT_TIMEOUT, WEBHOOK_TIMEOUT or a webhook kind's "
                "own time limit, and %(margin)g s), do not fit in the "
                "%(limit)g s Q_CLUSTER's timeout and retry allow a task: make the round at "
                "most %(most)g s, or Q_CLUSTER's timeout at least %(least)g and retry above it."
            )
            % {
                "seconds": seconds,
                "finish": finish,
                "margin": FINISH_MARGIN,
                "limit": limit,
                "most": max(limit - finish, 0),
                "least": seconds + finish,
            }
        )
    return seconds


#: This process's heartbeat, by database: its rounds keep one row up to date.
_heartbeats: dict[str, Heartbeat] = {}
#: The round schedule's period: between two rounds, a process is still alive.
ROUND_PERIOD = 60.0


def _heartbeat(using: str) -> Heartbeat:
    """The heartbeat this process's rounds keep, alive for three periods of
    the schedule after the last round."""
    return rounds.kept_heartbeat(_heartbeats, using, period=ROUND_PERIOD)


def deliver_round(seconds: float | None = None, *, using: str | None = None) -> dict[str, Any]:
    """A task: claim and send for ``seconds`` (see :func:`round_seconds`),
    then finish what is in flight and return what was done. Returns at once,
    saying so, when another round is running. ``using``: the queue's
    database, the app's (as routed) unless named."""
    rounds.refuse_bad_settings()
    bound = round_seconds(seconds)
    alias = using or database_alias()
    return rounds.run_round(bound, using=alias, heartbeat=_heartbeat(alias))


def purge_task(*, using: str | None = None) -> dict[str, Any]:
    """A task: :func:`retention.purge_by_setting`, a chunk at a time, stopped
    between chunks in time to return before the cluster's limit (the next
    purge goes on where it stopped). Returns what it deleted."""
    limit = cluster_limit()
    seconds = None if limit is None else max(limit - PURGE_MARGIN, 1.0)
    return rounds.run_purge(using=using or database_alias(), seconds=seconds)


def ensure_schedules(
    *, seconds: float | None = None, model: Any = None, purge: bool = True
) -> dict[str, str]:
    """Create, or bring up to date, the ``Schedule`` rows: a round every
    minute (of ``seconds``, or the default bound) and, with ``purge``, the
    purge every hour; without it, the purge's row written before is deleted
    (by its name, as the rows are found: a schedule of the project's own is
    left). Safe to run again: gives each schedule's name and "created",
    "updated", "unchanged" or "deleted". ``model`` is the Schedule model to
    use, ``apps.get_model("django_q", "Schedule")`` in a data migration."""
    model = model or _schedule_model()
    round_seconds(seconds)  # a round that cannot fit is refused now, not every minute
    wanted: dict[str, dict[str, Any]] = {
        ROUND_SCHEDULE: {
            "func": ROUND_TASK,
            "schedule_type": "I",  # Schedule.MINUTES
            "minutes": 1,
            # As django-q2 reads them: a dict's literal.
            "kwargs": "" if seconds is None else repr({"seconds": float(seconds)}),
        },
        PURGE_SCHEDULE: {"func": PURGE_TASK, "schedule_type": "H"},  # Schedule.HOURLY
    }
    if not purge:
        del wanted[PURGE_SCHEDULE]
    # What the scheduler would call a round or a purge with otherwise, where
    # this version of django-q2 has it: a keyword neither takes.
    unset = {"args": "", "kwargs": "", "minutes": None, "repeats": -1}
    unset.update(dict.fromkeys(HANDS_OFF & {field.name for field in model._meta.get_fields()}))
    done: dict[str, str] = {}
    alias = router.db_for_write(model)
    with transaction.atomic(using=alias):
        # Read and written as one: two processes writing them at once (web
        # workers' ready(), a deploy's migration beside the command) would
        # each find none and make one.
        _lock_schedules(model, alias)
        for name, fields in wanted.items():
            fields = {**unset, **fields}
            rows = list(model.objects.using(alias).filter(name=name).order_by("pk"))
            if not rows:
                model.objects.using(alias).create(name=name, **fields)
                done[name] = "created"
                continue
            schedule, extra = rows[0], rows[1:]
            for row in extra:
                row.delete()
            changed = [f for f, value in fields.items() if getattr(schedule, f) != value]
            for field in changed:
                setattr(schedule, field, fields[field])
            if changed:
                # The next run is kept: the schedule goes on where it was.
                schedule.save(update_fields=changed)
            done[name] = "updated" if changed or extra else "unchanged"
        if not purge:
            # Brought back to what is asked: a purge scheduled before would go
            # on every hour.
            gone, _kinds = model.objects.using(alias).filter(name=PURGE_SCHEDULE).delete()
            if gone:
                done[PURGE_SCHEDULE] = "deleted"
    return done


#: Fields of a schedule, in some versions of django-q2, that make the
#: scheduler call its task otherwise: a keyword given the time it was due
#: (``intended_date_kwarg``), a hook. Left unset.
HANDS_OFF = frozenset({"intended_date_kwarg", "hook"})


#: The PostgreSQL advisory lock the schedules are written under.
SCHEDULES_KEY = int.from_bytes(
    hashlib.sha256(b"django_federation_delivery.contrib.django_q.schedules").digest()[:8],
    "big",
    signed=True,
)


def _lock_schedules(model: Any, alias: str) -> None:
    """Hold off any other writer of the schedules until the transaction
    ends: on PostgreSQL by an advisory lock, on SQLite by its write lock."""
    locks.transaction_lock(alias, SCHEDULES_KEY)
    if connections[alias].vendor == "sqlite":
        # A write that changes nothing takes the lock, waiting as any does.
        model.objects.using(alias).filter(pk__lt=0).update(name=F("name"))


def remove_schedules(*, model: Any = None) -> int:
    """Delete the schedules :func:`ensure_schedules` writes; gives how many."""
    model = model or _schedule_model()
    deleted, _ = model.objects.filter(name__in=[ROUND_SCHEDULE, PURGE_SCHEDULE]).delete()
    return int(deleted)


def _schedule_model() -> Any:
    if not apps.is_installed("django_q"):
        raise ImproperlyConfigured(
            _('django-q2 schedules need "django_q" in INSTALLED_APPS (and its migrations run).')
        )
    from django_q.models import Schedule

    return Schedule
