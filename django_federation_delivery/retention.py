"""Retention: settled deliveries, emptied batches, forgotten hosts and old history are deleted.

A fan-out to 5,000 inboxes a few hundred times a day settles a million rows
a day; kept for ever, they fill the disk. :func:`purge` deletes what is past
``RETENTION``, a chunk at a time, each chunk its own short transaction: on
SQLite the write lock is held for one chunk, never for the whole purge, and
on PostgreSQL no transaction lasts long enough to hold back vacuum. The
command ``purge_deliveries``, ``run_deliverer --purge`` and a periodic task
all call it.

The queue's history (history.py) is kept for ``history.KEPT`` (7 days),
whatever ``RETENTION`` says: a few thousand small rows, not the table's size.

A pending delivery is never deleted (every statement names the settled
status it deletes; one waiting on a delivery deleted is released, as the
deliverer's sweep releases it), nor a batch that still has a delivery, nor a host paused,
failing or marked unavailable, or one with a breaker. A retraction's
delivery a replay reads is kept as long as what it took back may be.
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.db import connections, transaction
from django.db.models import Exists, OuterRef, Q
from django.utils import translation
from django.utils.translation import gettext as _
from django.utils.translation import ngettext

from django_federation_delivery import history
from django_federation_delivery.addresses import host_of
from django_federation_delivery.conf import app_settings, database_alias
from django_federation_delivery.dialect import aware, aware_now, orm_datetime
from django_federation_delivery.models import Batch, Breaker, Delivery, Host, Retracts, Status
from django_federation_delivery.store import locks, purges, settlements
from django_federation_delivery.store.queueing import CHUNK

logger = logging.getLogger(__name__)

#: Rows deleted by one statement, in one transaction.
PURGE_CHUNK = 5_000
#: The statuses that can be purged, in the order they are.
SETTLED = (Status.DELIVERED, Status.SKIPPED, Status.FAILED, Status.REFUSED, Status.SUPERSEDED)


def retention_seconds(setting: Any = ...) -> dict[Status, float]:
    """The ``RETENTION`` setting as {status: seconds}, the statuses kept for
    ever left out (all of them when the setting is None)."""
    from django_federation_delivery.checks import check_retention

    value = app_settings.get("RETENTION") if setting is ... else setting
    problems = check_retention(value)
    if problems:
        raise ImproperlyConfigured(f"{problems[0].msg} {problems[0].hint}")
    if not isinstance(value, Mapping):  # None: everything kept
        return {}
    return {
        status: float(value[status.name])
        for status in SETTLED
        if value.get(status.name) is not None
    }


def cutoffs_for(
    retention: Mapping[Status, float], now: dt.datetime | None = None
) -> dict[Status, dt.datetime]:
    # In UTC: a span of real time, across a clock change too (with USE_TZ
    # off, timezone.now() is TIME_ZONE's wall clock).
    now = now or aware_now()
    return {status: now - dt.timedelta(seconds=seconds) for status, seconds in retention.items()}


@dataclass
class Purged:
    """What a purge deleted (or, dry, would delete)."""

    deliveries: dict[str, int] = field(default_factory=dict)
    batches: int = 0
    hosts: int = 0
    #: Minutes of history older than ``history.KEPT``.
    history: int = 0
    seconds: float = 0.0
    #: Delivery statements run: one a chunk, and one more for each status
    #: to find that nothing is left.
    chunks: int = 0
    dry_run: bool = False

    @property
    def deleted(self) -> int:
        return sum(self.deliveries.values())

    def line(self) -> str:
        """What was deleted, in the active language (English in a log line)."""
        deliveries = (
            ngettext(
                "would delete %(count)d delivery", "would delete %(count)d deliveries", self.deleted
            )
            if self.dry_run
            else ngettext(
                "deleted %(count)d delivery", "deleted %(count)d deliveries", self.deleted
            )
        ) % {"count": self.deleted}
        per_status = ", ".join(
            f"{Status(status).label} {count}" for status, count in self.deliveries.items()
        )
        return _(
            "%(deliveries)s (%(per_status)s), %(batches)s, %(hosts)s, %(history)s "
            "in %(seconds).1f s"
        ) % {
            "deliveries": deliveries,
            "per_status": per_status or _("none"),
            "batches": ngettext("%(count)d batch", "%(count)d batches", self.batches)
            % {"count": self.batches},
            "hosts": ngettext("%(count)d host", "%(count)d hosts", self.hosts)
            % {"count": self.hosts},
            "history": ngettext(
                "%(count)d history minute", "%(count)d history minutes", self.history
            )
            % {"count": self.history},
            "seconds": self.seconds,
        }


#: Told after each chunk: deliveries deleted so far, seconds since the start.
Progress = Callable[[int, float], None]


def purge(
    cutoffs: Mapping[Status, dt.datetime],
    *,
    dry_run: bool = False,
    chunk: int = PURGE_CHUNK,
    pause: float = 0.0,
    on_progress: Progress | None = None,
    should_stop: Callable[[], bool] = lambda: False,
    using: str | None = None,
) -> Purged:
    """Delete the deliveries of each status in ``cutoffs`` settled before its
    cutoff, then the batches left with no delivery and the hosts not seen
    since (see :func:`_forgotten_hosts`). ``pause`` seconds between chunks
    leave SQLite's one write lock to the deliverer; ``should_stop`` is asked
    between chunks, and a purge stopped early has deleted only whole chunks.
    The history's old minutes go first, by ``history.KEPT``, whatever the cutoffs."""
    alias = using or database_alias()
    started = time.monotonic()
    purged = Purged(dry_run=dry_run)
    purged.history = history.purge(dry_run=dry_run, using=alias)
    if not cutoffs:
        purged.seconds = time.monotonic() - started
        return purged
    # Aware, as cutoffs_for makes them: a caller's naive ones (timezone.now()
    # with USE_TZ off) are in TIME_ZONE.
    cutoffs = {Status(status): aware(cutoff) for status, cutoff in cutoffs.items()}
    if Status.PENDING in cutoffs:
        raise ValueError("pending deliveries are never purged")
    # A batch created after the newest cutoff, or a host written to after
    # the oldest, is kept whatever else holds: nothing of theirs is that old.
    batch_cutoff = max(cutoffs.values())
    host_cutoff = min(cutoffs.values())
    retractions = _retractions_cutoff(cutoffs)
    if dry_run:
        manager = Delivery.objects.using(alias)
        purgeable = Q()
        for status, cutoff in cutoffs.items():
            gone = Q(status=status, settled_at__lt=orm_datetime(cutoff, alias)) & (
                Q(settled_at__lt=orm_datetime(retractions.get(status, cutoff), alias))
                | Q(batch__retracts=Retracts.NOTHING)
            )
            purged.deliveries[status.value] = manager.filter(gone).count()
            purgeable |= gone
        kept = manager.filter(batch=OuterRef("pk")).exclude(purgeable)
        purged.batches = (
            Batch.objects.using(alias)
            .filter(created_at__lt=orm_datetime(batch_cutoff, alias))
            .exclude(Exists(kept))
            .count()
        )
        kept_for_host = manager.filter(host=OuterRef("name")).exclude(purgeable)
        purged.hosts = len(_forgotten_hosts(host_cutoff, kept_for_host, alias))
        purged.seconds = time.monotonic() - started
        return purged
    for status, cutoff in cutoffs.items():
        purged.deliveries[status.value] = 0
        deleting = purges.delete_settled(
            status, cutoff, chunk, alias, retractions_cutoff=retractions.get(status)
        )
        for count in deleting:
            purged.chunks += 1
            purged.deliveries[status.value] += count
            if on_progress is not None:
                on_progress(purged.deleted, time.monotonic() - started)
            if should_stop():
                purged.seconds = time.monotonic() - started
                return purged
            if pause:
                time.sleep(pause)
    purged.batches = purges.delete_empty_batches(batch_cutoff, chunk, alias, should_stop)
    if not should_stop():
        remaining = Delivery.objects.using(alias).filter(host=OuterRef("name"))
        hosts = _forgotten_hosts(host_cutoff, remaining, alias)
        for start in range(0, len(hosts), CHUNK):
            purged.hosts += _delete_hosts(hosts[start : start + CHUNK], host_cutoff, alias)
    purged.seconds = time.monotonic() - started
    return purged


def _retractions_cutoff(cutoffs: Mapping[Status, dt.datetime]) -> dict[Status, dt.datetime]:
    """When a retraction's deliveries of each status are purged: once what
    they took back is, which a replay or a requeue would send again (any
    settled status, superseded too: ``replay.REPLAYED`` and
    ``controls.REQUEUED_FROM``), so at the oldest cutoff, and never while a
    status is kept for ever. A replay and a requeue leave out what a retraction
    sent to the host took back by that retraction's delivery there: gone
    first, they would send a deleted post's ``Create`` again, with no
    ``Delete`` after it (a ``Create`` given up is kept 30 days by default, the
    ``Delete`` delivered after it 7)."""
    known = [cutoffs.get(status) for status in settlements.FINAL]
    oldest = purges.EARLIEST if None in known else min(at for at in known if at is not None)
    # Of every status: a Delete refused or skipped at the host (kept 7 days
    # by default) took back what it was about there as well as one delivered.
    return {status: min(cutoff, oldest) for status, cutoff in cutoffs.items()}


#: A host with none of these marks: one with any is kept whatever its age.
#: A pause is an operator's doing (or a disabled destination's, its reason
#: with it); a host marked unavailable is what keeps sends from its inboxes,
#: its row written when it was marked and only its probe's time since; a
#: failing one is on its way to that mark, and told failing, is owed
#: ``host_recovered`` when it answers.
_UNMARKED = Q(paused_at__isnull=True, failing_since__isnull=True, unavailable_since__isnull=True)


def _forgotten_hosts(cutoff: dt.datetime, deliveries: Any, alias: str) -> list[str]:
    """Hosts not seen since ``cutoff``: no delivery of theirs is kept (one
    pending, or settled within its retention, is a sign of life) and their
    row was last written before it (a scheme learnt, a pause or resume).
    A host with a mark (``_UNMARKED``'s), and one with a breaker, are kept
    whatever their age: they are an operator's, the deliverer's or the
    breaker's doing, not history."""
    candidates = list(
        Host.objects.using(alias)
        .filter(_UNMARKED, updated_at__lt=orm_datetime(cutoff, alias))
        .exclude(Exists(deliveries))
        .values_list("name", flat=True)
    )
    if not candidates:
        return []
    # Breakers are few (only failing destinations have one); their key is a
    # host, or an inbox URL under scope "inbox".
    broken: set[str] = set()
    for key in Breaker.objects.using(alias).values_list("key", flat=True):
        broken.add(key)
        if "://" in key:
            broken.add(host_of(key))
    return [name for name in candidates if name not in broken]


def _delete_hosts(names: list[str], cutoff: dt.datetime, alias: str) -> int:
    # The conditions again: a host paused or marked, written to or sent to
    # since they were read is kept.
    deliveries = Delivery.objects.using(alias).filter(host=OuterRef("name"))
    forgotten = (
        Host.objects.using(alias)
        .filter(_UNMARKED, name__in=names, updated_at__lt=orm_datetime(cutoff, alias))
        .exclude(Exists(deliveries))
    )

    def delete() -> int:
        with transaction.atomic(using=alias):
            if connections[alias].vendor == "sqlite":
                locks.write_first(alias)
                return int(forgotten.delete()[0])
            # Locked in name order first, as every writer of many hosts
            # locks them (an operator's pause of the same hosts): a DELETE
            # locks them in the order its plan reads them.
            locked = list(
                forgotten.select_for_update()
                .order_by(locks.in_name_order(alias))
                .values_list("name", flat=True)
            )
            return int(forgotten.filter(name__in=locked).delete()[0]) if locked else 0

    return locks.again_on_deadlock(alias, delete)


def purge_by_setting(**options: Any) -> Purged:
    """A purge by the ``RETENTION`` setting: what a periodic task calls."""
    return purge(cutoffs_for(retention_seconds()), **options)


class PeriodicPurge:
    """``run_deliverer --purge``: :func:`purge_by_setting` every ``interval``
    seconds, the first ``first`` seconds after :meth:`start`.

    A thread of its own, with its own database connections (closed after
    each purge), rather than chunks in the loop's idle time: a busy
    deliverer may have no idle time for days, and a purge must not wait for
    one. It never stalls deliveries: on PostgreSQL it locks only the rows it
    deletes, which no claim wants; on SQLite, whose one write lock it shares
    with the loop, each chunk is a short transaction of its own and it
    pauses ``pause`` seconds between chunks, so that the loop's claims and
    settlements, waiting under the busy timeout, go in between.
    """

    def __init__(
        self, interval: float, *, first: float, using: str | None = None, pause: float = 0.05
    ) -> None:
        self.interval = interval
        self.first = first
        self.using = using or database_alias()
        self.pause = pause
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name="federation-delivery-purge", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Stop, a purge under way at the end of its chunk."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _run(self) -> None:
        delay = self.first
        while not self._stop.wait(delay):
            delay = self.interval
            try:
                purged = purge_by_setting(
                    using=self.using, pause=self.pause, should_stop=self._stop.is_set
                )
            except Exception:
                # A database away now is there at the next; the loop goes on.
                logger.exception("The purge failed; the next in %.0f s", self.interval)
            else:
                # Log lines stay English: operators grep them.
                with translation.override(None):
                    logger.info("Purge: %s", purged.line())
            finally:
                connections.close_all()
