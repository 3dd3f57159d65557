"""What the loop keeps up between rounds, each at its own pace.

Its database connection (recycled as Django does between requests), its
heartbeat, the queue's gauges, and its view of the circuit breakers and the
paused hosts: each costs a query, so none is done every round.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from django.db import DatabaseError, close_old_connections, connections

from django_federation_delivery import availability, controls, metrics
from django_federation_delivery.breakers import Breakers
from django_federation_delivery.dialect import aware_now
from django_federation_delivery.heartbeats import Heartbeat
from django_federation_delivery.hosts import paused_hosts
from django_federation_delivery.hoststats import HostStats
from django_federation_delivery.outages import Runner
from django_federation_delivery.settling import Summary
from django_federation_delivery.slots import Slots
from django_federation_delivery.store.retractions import release_stranded
from django_federation_delivery.store.wakes import wake_all
from django_federation_delivery.transport import TransportSettings

logger = logging.getLogger("django_federation_delivery.deliverer")

#: How often the queue's gauges are read from the database (metrics.read_queue).
GAUGES_EVERY = 5.0
#: How often CONN_MAX_AGE and CONN_HEALTH_CHECKS are applied, as Django does
#: between requests: not every round, which with the default CONN_MAX_AGE of
#: 0 would be a new connection for each.
RECYCLE_EVERY = 1.0
#: How often the breakers and the paused hosts are read again.
VIEW_EVERY = 1.0
#: How often deliveries left waiting on one that has settled are released
#: (see ``store/retractions.release_stranded``): rare, and never urgent.
STRANDED_EVERY = 30.0
#: How often what waits past its batch's deadline is given up
#: (``controls.give_up_overdue``): one index read of the batches whose
#: deadline passed since the last look, less OVERDUE_OVERLAP (a send's
#: transaction may commit after its deadline); a run's first looks back
#: OVERDUE_FIRST. What waits past an older deadline goes when it is
#: released, given up by the claim that takes it.
OVERDUE_EVERY = 5.0
OVERDUE_OVERLAP = 60.0
OVERDUE_FIRST = 86400.0
#: How often hosts failing for HOST_UNAVAILABLE_AFTER are marked unavailable,
#: and the unavailable ones due a probe are probed (see availability.py).
HOSTS_EVERY = 3600.0
#: Beyond a probe's time limit, what writing what it saw may take.
PROBE_WRITE = 1.0
#: How often a lock the run holds (a round's) is asked after.
LOCK_EVERY = 1.0


@dataclasses.dataclass(kw_only=True, eq=False)
class Upkeep:
    """The coordinator's periodic chores, run through its ``db``."""

    #: Runs a query; None when the database was away.
    db: Runner
    using: str
    slots: Slots
    summary: Summary
    breakers: Breakers | None
    heartbeat: Heartbeat | None
    #: Whether to keep the queue's gauges up to date.
    metrics: bool
    #: What the loop sees of each host, written every few seconds.
    hoststats: HostStats | None = None
    #: HOST_UNAVAILABLE_AFTER (None: no host is marked), and how unavailable
    #: hosts are probed (None: they are not).
    unavailable_after: float | None = None
    probe_settings: TransportSettings | None = None
    #: Set when the loop stops: no probe is started after it, so that one
    #: started before ends within the time the loop's attempts have to.
    stopping: threading.Event = dataclasses.field(default_factory=threading.Event)
    #: Whether the run still holds a lock (a round's), asked every LOCK_EVERY:
    #: once not, the loop is stopped. None: it holds none.
    holding: Callable[[], bool] | None = None
    #: The kinds of delivery, each asked every STRANDED_EVERY to make due
    #: what nothing else would (``release_stuck``).
    kinds: Iterable[Any] = ()
    #: The hosts an operator paused, as last read.
    paused: frozenset[str] = dataclasses.field(default=frozenset(), init=False)
    _view_read: float = dataclasses.field(default=-1.0, init=False)
    _gauges_read: float = dataclasses.field(default=-1.0, init=False)
    # At once, then every STRANDED_EVERY: a round of django-q2's or Django's
    # tasks (contrib/rounds.py), often shorter, makes an Upkeep of its own.
    _stranded_read: float = dataclasses.field(default=-STRANDED_EVERY, init=False)
    _overdue_read: float = dataclasses.field(default=-OVERDUE_EVERY, init=False)
    #: Set once the run has ended: no probe follows the one under way.
    _ended: threading.Event = dataclasses.field(default_factory=threading.Event, init=False)
    #: When the run's end waits for its probes no longer (monotonic).
    _finish_by: float = dataclasses.field(default=math.inf, init=False)
    #: Where the next look for what waits past its deadline starts.
    _overdue_since: dt.datetime | None = dataclasses.field(default=None, init=False)
    _hosts_read: float = dataclasses.field(default=-HOSTS_EVERY, init=False)
    _prober: threading.Thread | None = dataclasses.field(default=None, init=False)
    #: Hosts whose probe was answered, not written (the database away then):
    #: written by the loop at its next refresh, which waits the database out.
    _answered: set[str] = dataclasses.field(default_factory=set, init=False)
    _answered_lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, init=False)
    #: When the probe under way is out of time (monotonic).
    _probe_until: float = dataclasses.field(default=0.0, init=False)
    _lock_asked: float = dataclasses.field(default_factory=time.monotonic, init=False)
    _recycled: float = dataclasses.field(default_factory=time.monotonic, init=False)

    def recycle_connections(self) -> None:
        """Close a connection past CONN_MAX_AGE, or one that failed, and have
        the next query check it first with CONN_HEALTH_CHECKS: one lost while
        idle is replaced, not found broken by the next claim. A second stands
        for a request: every round would reconnect at every claim with the
        default CONN_MAX_AGE of 0."""
        if time.monotonic() - self._recycled < RECYCLE_EVERY:
            return
        self._recycled = time.monotonic()
        self.db(close_old_connections)

    def beat(self) -> None:
        """Record the heartbeat when it is due: every HEARTBEAT_SECONDS, not
        every round; read the queue's gauges every GAUGES_EVERY, when
        metrics are served; and ask after the lock the run holds (a round's)
        every LOCK_EVERY, stopping the loop once it is lost. All here, as an
        idle deliverer only beats, woken for whichever comes first
        (:meth:`until_beat`)."""
        if (
            self.holding is not None
            and not self.stopping.is_set()
            and time.monotonic() - self._lock_asked >= LOCK_EVERY
        ):
            self._lock_asked = time.monotonic()
            if not self.holding():
                # Another has the lock: the loop claims no more, and finishes
                # what is in flight (Deliverer.stop, here in the loop's own
                # thread, which needs no waking).
                self.stopping.set()
        if self.heartbeat is not None and self.heartbeat.due():
            self.db(
                self.heartbeat.beat,
                in_flight=len(self.slots.in_flight),
                delivered=self.summary.delivered,
            )
        if self.metrics and time.monotonic() - self._gauges_read >= GAUGES_EVERY:
            self._gauges_read = time.monotonic()
            self.db(metrics.observe_queue, using=self.using)

    def until_beat(self) -> float | None:
        """Seconds until :meth:`beat`, or the sweeps of :meth:`refresh`, have
        something to do (None: never). An idle loop woken only by sends
        (LISTEN) wakes by then: its heartbeat and idle poll may be minutes
        apart, and its gauges, unread as long, would have an alert take a
        live deliverer for a dead one; a round, idle, would not notice it
        lost its lock; and what waits past its deadline (held for a paused
        host, or its turn) is failed within OVERDUE_EVERY of it, idle too."""
        now = time.monotonic()
        times: list[float] = [
            max(0.0, self._overdue_read + OVERDUE_EVERY - now),
            max(0.0, self._stranded_read + STRANDED_EVERY - now),
        ]
        if self.heartbeat is not None:
            times.append(self.heartbeat.until_due())
        if self.holding is not None and not self.stopping.is_set():
            times.append(max(0.0, self._lock_asked + LOCK_EVERY - time.monotonic()))
        if self.metrics:
            times.append(max(0.0, self._gauges_read + GAUGES_EVERY - time.monotonic()))
        return min(times, default=None)

    def refresh(self) -> None:
        """Re-read the breakers and the paused hosts, about once a second;
        record the heartbeat and read the queue's gauges when due (:meth:`beat`);
        release what was left waiting on a settled delivery every
        STRANDED_EVERY; give up what waits past its batch's deadline every
        OVERDUE_EVERY; look after the hosts gone for good every HOSTS_EVERY."""
        self.beat()
        if time.monotonic() - self._stranded_read >= STRANDED_EVERY:
            self._stranded_read = time.monotonic()
            released = self.db(release_stranded, now=aware_now(), using=self.using) or 0
            for kind in self.kinds:
                released += self.db(kind.release_stuck) or 0
            if released:
                # Due now: this loop may be idle, and so may others.
                self.db(wake_all, self.using)
        if time.monotonic() - self._overdue_read >= OVERDUE_EVERY:
            self._overdue_read = time.monotonic()
            self.give_up_overdue()
        if self.hoststats is not None and self.hoststats.due():
            self.db(self.hoststats.write, now=aware_now(), using=self.using)
        self.write_answered()
        if time.monotonic() - self._hosts_read >= HOSTS_EVERY:
            self._hosts_read = time.monotonic()
            self.look_after_hosts()
        if time.monotonic() - self._view_read < VIEW_EVERY:
            return
        self._view_read = time.monotonic()
        if self.breakers is not None:
            self.db(self.breakers.refresh)
        self._read_paused()

    def write_answered(self) -> None:
        """Mark seen the hosts whose probe answered while the database was
        away: taken for the day as they were probed, they were skipped by
        sends for another whole day, though they answered."""
        if not self._answered:
            return
        with self._answered_lock:
            answered, self._answered = self._answered, set()
        for host in sorted(answered):
            if self.db(availability.mark_seen, host, using=self.using) is None:
                with self._answered_lock:
                    self._answered.add(host)

    def give_up_overdue(self) -> None:
        """Give up what waits past its batch's deadline, of the batches whose
        deadline passed since the last look (see OVERDUE_EVERY)."""
        now = aware_now()
        since = self._overdue_since or now - dt.timedelta(seconds=OVERDUE_FIRST)
        if self.db(controls.give_up_overdue, since=since, now=now, using=self.using) is not None:
            self._overdue_since = now - dt.timedelta(seconds=OVERDUE_OVERLAP)

    def look_after_hosts(self) -> None:
        """Mark the hosts failing for HOST_UNAVAILABLE_AFTER unavailable, and
        probe, in a thread of their own, those due a probe (once a day each):
        a host that answers is seen again."""
        self.db(availability.mark_unavailable, self.unavailable_after, using=self.using)
        if (
            self.probe_settings is None
            or self.stopping.is_set()
            or (self._prober and self._prober.is_alive())
        ):
            return
        # This hour's share of them, taken one at a time, as each is probed:
        # a stop leaves those it did not reach due, not taken for a day unprobed.
        share = self.db(availability.probes_a_round, using=self.using)
        if not share:
            return  # the database away: the next hour's round
        due = self.db(availability.probe_due, most=1, using=self.using)
        if due:
            self._probe_until = self._probe_time(self.probe_settings)
            self._prober = threading.Thread(
                target=self._probe, args=(due[0], share, self.probe_settings), daemon=True
            )
            self._prober.start()

    def _probe(self, first: tuple[str, str], share: int, settings: TransportSettings) -> None:
        try:
            host, url = first
            for probed in range(1, share + 1):
                if availability.probe(url, settings):
                    try:
                        availability.mark_seen(host, using=self.using)
                    except DatabaseError:
                        with self._answered_lock:
                            self._answered.add(host)
                        raise
                # None started once stopping, nor one that would end after
                # the run (a drain) has waited for its probes: it would
                # outlast the time the loop has to finish (a round's, fitted
                # to its task queue's), or the process itself.
                if probed == share or self.stopping.is_set() or self._ended.is_set():
                    return
                if time.monotonic() + settings.attempt_timeout > self._finish_by:
                    return
                due = availability.probe_due(most=1, using=self.using)
                if not due:
                    return
                ((host, url),) = due
                self._probe_until = self._probe_time(settings)
        except Exception as exc:
            # Tried again at the host's next probe, a day on; the loop goes on.
            logger.warning("Probing unavailable hosts failed: %s", type(exc).__name__)
        finally:
            connections.close_all()  # this thread's own

    @staticmethod
    def _probe_time(settings: TransportSettings) -> float:
        """When a probe starting now is out of time (monotonic)."""
        return time.monotonic() + settings.attempt_timeout + PROBE_WRITE

    def finish(self, timeout: float) -> None:
        """The run has ended: wait for the probes under way, at most
        ``timeout`` seconds, none started that would end later; once
        stopping, only until the one under way is out of time, as none
        follows it. None is started once this returns."""
        self._finish_by = time.monotonic() + timeout
        if self._prober is not None:
            if self.stopping.is_set():
                timeout = min(timeout, max(0.0, self._probe_until - time.monotonic()))
            self._prober.join(timeout)
        self._ended.set()

    def start(self) -> None:
        """A run begins: probes may follow one another again."""
        self._ended.clear()
        self._finish_by = math.inf

    def held_hosts(self) -> list[str]:
        """The hosts whose circuit breaker holds every delivery now."""
        if self.breakers is None:
            return []
        return self.breakers.holding_hosts(aware_now())

    def paused_among(self, hosts: Iterable[str]) -> frozenset[str]:
        """Which of ``hosts`` are paused: read again when any seemed to be,
        since, though the view is not a second old, one may have been resumed."""
        hosts = frozenset(hosts)
        if hosts & self.paused:
            self._read_paused()
        return hosts & self.paused

    def _read_paused(self) -> None:
        paused = self.db(paused_hosts, using=self.using)
        if paused is not None:
            self.paused = frozenset(paused)
