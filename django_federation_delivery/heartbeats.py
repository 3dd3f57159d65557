"""Heartbeats: each running deliverer says it is alive, so that a dead one shows.

Every ``run_deliverer`` process (each child under ``--processes``) keeps one
``DelivererHeartbeat`` row up to date: inserted at its first beat, then one
UPDATE every ``HEARTBEAT_SECONDS`` (never more often, on SQLite least of all),
and marked stopped when it stops cleanly (its interval 0): no longer alive,
but its last beat, the stop's time, still says when a deliverer was last
seen, so that a stop and a restart within :data:`NO_DELIVERER_AFTER` is not
taken for a stall; the next deliverer to start on the same machine deletes,
at its first beat, the rows of those that stopped there before it started.
A killed deliverer's row is no longer refreshed: it is
dead once :data:`DEAD_AFTER` of its own intervals have passed. Either is
deleted once a day old by the next deliverer to beat (at its first beat,
and hourly after).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import os
import socket
import time

from django.db.models import Max, Q, QuerySet

from django_federation_delivery import __version__
from django_federation_delivery.conf import database_alias
from django_federation_delivery.dialect import aware, aware_now, orm_datetime
from django_federation_delivery.models import DelivererHeartbeat

__all__ = ["Heartbeat", "Seen", "SeenDeliverer", "seen"]

#: Intervals without a beat after which a deliverer is taken for dead.
DEAD_AFTER = 3
#: A row not refreshed for this long is deleted, unless its interval (a
#: round's period) keeps it alive longer.
FORGET_AFTER = dt.timedelta(days=1)
#: The longest interval a row may have (a scheduled round's period, at most a
#: day), and so the longest a row can be alive without a beat: one of an
#: interval longer than a third of FORGET_AFTER is kept, and read, this long.
LONGEST_ALIVE = dt.timedelta(days=1) * DEAD_AFTER
#: How often a live deliverer deletes such rows.
FORGET_EVERY = 3600.0
#: Work due and no deliverer seen for this long: the warning (``overview.stalled``),
#: and ``--check``.
NO_DELIVERER_AFTER = 60.0
#: The most rows one look reads: the live ones come first.
MOST_LISTED = 100
#: The interval of a deliverer that stopped cleanly: never alive.
STOPPED = 0.0


class Heartbeat:
    """One deliverer's row. :meth:`beat` when :meth:`due`; :meth:`remove` on
    a clean stop. Database errors are the caller's (the deliverer's ``_db``
    waits them out): a failed beat is tried again at the next interval.

    ``alive_for`` is the longest a live deliverer goes between beats, stored
    in its row (``interval``): it is taken for dead :data:`DEAD_AFTER` of
    those after its last beat. It is ``interval`` for ``run_deliverer``;
    for rounds run by a scheduler (``contrib.django_q``, ``contrib.tasks``), which beat
    while they run and not between, the schedule's period, and ``kept``:
    the row stays when a round ends, and the process's next round takes it
    up again (:meth:`begin`).
    """

    def __init__(
        self,
        interval: float,
        *,
        using: str | None = None,
        alive_for: float | None = None,
        kept: bool = False,
    ) -> None:
        self.interval = interval
        self.alive_for = max(interval, alive_for or interval)
        self.kept = kept
        self.using = using or database_alias()
        self.pid = os.getpid()
        self.machine = socket.gethostname()[:255]
        #: Its row's id, once an insert has said it.
        self.pk: int | None = None
        self.started_at = orm_datetime(aware_now(), self.using)
        self.next_at = time.monotonic()
        self._delivered = 0
        self._counted_at = time.monotonic()
        self._forgot_at = -FORGET_EVERY

    def begin(self) -> None:
        """A run starts: beat at once, counting what it delivers from zero."""
        self.next_at = self._counted_at = time.monotonic()
        self._delivered = 0

    def due(self) -> bool:
        return time.monotonic() >= self.next_at

    def until_due(self) -> float:
        return max(0.0, self.next_at - time.monotonic())

    def beat(self, *, in_flight: int, delivered: int) -> None:
        """Say this deliverer is alive, with ``delivered`` the count since it started."""
        clock = time.monotonic()
        # Set first: a beat the database refused waits for the next interval.
        self.next_at = clock + self.interval
        elapsed = clock - self._counted_at
        rate = (delivered - self._delivered) / elapsed if elapsed > 0 else 0.0
        self._delivered, self._counted_at = delivered, clock
        now = aware_now()
        fields = {
            "last_seen": orm_datetime(now, self.using),
            "in_flight": in_flight,
            "rate": round(rate, 3),
            # Alive again, should it have been marked stopped by an earlier run.
            "interval": self.alive_for,
        }
        rows = DelivererHeartbeat.objects.using(self.using)
        # One UPDATE; an INSERT when it finds no row: the first time, or
        # when the row was deleted meanwhile (the database was away for a
        # day, say).
        if not self._row(rows).update(**fields):
            self.pk = rows.create(
                host=self.machine,
                pid=self.pid,
                version=__version__[:50],
                started_at=self.started_at,
                **fields,
            ).pk
            # Its machine's deliverers that stopped before it started said
            # when one was last seen there; this one says it now. A cron
            # job's --drain each minute so keeps one row, not one a run for
            # a day. One that stopped since is kept: it ran beside this one.
            before = rows.filter(host=self.machine, interval=STOPPED, last_seen__lt=self.started_at)
            before.exclude(pk=self.pk).delete()
        if clock - self._forgot_at >= FORGET_EVERY:
            self._forgot_at = clock
            rows.exclude(_kept(now, self.using)).delete()

    def remove(self) -> None:
        """This deliverer stopped: it is no longer alive (unless ``kept``:
        a round's, alive until the next), and was last seen now, with
        nothing in flight."""
        rows = self._row(DelivererHeartbeat.objects.using(self.using))
        now = orm_datetime(aware_now(), self.using)
        if self.kept:
            rows.update(last_seen=now, in_flight=0, rate=0.0)
        else:
            rows.update(last_seen=now, interval=STOPPED, in_flight=0, rate=0.0)

    def _row(self, rows: QuerySet[DelivererHeartbeat]) -> QuerySet[DelivererHeartbeat]:
        """This deliverer's row: by its id, or, until an insert has said it,
        by what that insert wrote. An insert can go through and raise all the
        same (its answer lost on the way back): the next beat then finds the
        row, rather than writing a second and leaving the first to look like
        a killed deliverer's."""
        if self.pk is not None:
            return rows.filter(pk=self.pk)
        return rows.filter(host=self.machine, pid=self.pid, started_at=self.started_at)


@dataclasses.dataclass(frozen=True)
class SeenDeliverer:
    host: str
    pid: int
    version: str
    started_at: dt.datetime
    last_seen: dt.datetime
    in_flight: int
    #: Delivered per second over the interval before its last beat.
    rate: float


@dataclasses.dataclass(frozen=True)
class Seen:
    """The live deliverers, and when any deliverer (dead or stopped ones
    too) last beat."""

    #: The first :data:`MOST_LISTED` of them, by host and pid.
    live: tuple[SeenDeliverer, ...]
    #: None: none in the last day.
    last_seen: dt.datetime | None
    #: How many are alive, listed or not.
    alive: int = 0


def seen(
    *, now: dt.datetime | None = None, host: str | None = None, using: str | None = None
) -> Seen:
    """The deliverers alive as of ``now`` (on ``host`` only, if given), and
    how many: two queries, the second of the rows beating lately only (those
    of the processes alive, and of any that died within their last beats'
    span), however many a day of restarts left. Times are compared as
    instants, whatever ``USE_TZ`` says (the hour a clock goes back through
    twice included)."""
    alias = using or database_alias()
    # In UTC: two times of one zone subtract as wall-clock times.
    now = aware_now() if now is None else aware(now).astimezone(dt.UTC)
    rows = DelivererHeartbeat.objects.using(alias).filter(_kept(now, alias))
    if host is not None:
        rows = rows.filter(host=host)
    latest = rows.aggregate(last=Max("last_seen"), longest=Max("interval"))
    ahead = now + dt.timedelta(seconds=NO_DELIVERER_AFTER)
    if latest["last"] is not None and aware(latest["last"]) > ahead:
        # A beat from a clock ahead hides when the others were last seen:
        # the last is the latest of the others.
        others = rows.filter(last_seen__lte=orm_datetime(ahead, alias))
        latest["last"] = others.aggregate(last=Max("last_seen"))["last"]
    if latest["last"] is None:
        return Seen(live=(), last_seen=None)
    lately = now - dt.timedelta(seconds=DEAD_AFTER * max(latest["longest"] or 0.0, 0.0))
    live = [
        row
        for row in rows.filter(last_seen__gte=orm_datetime(lately, alias), interval__gt=STOPPED)
        # One seen later than now by more than an interval is of a clock
        # that is wrong, not a deliverer that is alive.
        if -row.interval
        <= (now - aware(row.last_seen)).total_seconds()
        <= DEAD_AFTER * row.interval
    ]
    listed = sorted(live, key=lambda row: (row.host, row.pid))[:MOST_LISTED]
    return Seen(
        live=tuple(
            SeenDeliverer(
                host=row.host,
                pid=row.pid,
                version=row.version,
                started_at=row.started_at,
                last_seen=row.last_seen,
                in_flight=row.in_flight,
                rate=row.rate,
            )
            for row in listed
        ),
        last_seen=latest["last"],
        alive=len(live),
    )


def _kept(now: dt.datetime, using: str) -> Q:
    """The rows kept as of ``now``: refreshed within :data:`FORGET_AFTER`, or
    of an interval long enough to be alive longer without a beat (a daily
    round's process, alive for three days after its last)."""
    long = FORGET_AFTER.total_seconds() / DEAD_AFTER
    return Q(last_seen__gte=orm_datetime(now - FORGET_AFTER, using)) | Q(
        interval__gt=long, last_seen__gte=orm_datetime(now - LONGEST_ALIVE, using)
    )
