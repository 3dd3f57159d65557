"""The claim-and-send loop.

A coordinator (the thread that calls :meth:`Deliverer.run`) owns the
database: it claims due deliveries a few at a time, settles what came of
them, and sends the signals. A pool of worker threads (``workers.py``) owns
the sockets: each makes one attempt at a time with a pooled transport of its
own. A slow or silent inbox holds one worker, never a batch.

The coordinator's parts: ``intake.py`` claims and waits for work,
``triage.py`` sorts what was claimed and admits it past its breaker,
``handoff.py`` hands it to the workers and takes back what came of it,
``outbox.py`` writes that, and ``upkeep.py`` keeps the connection, the
heartbeat and the views of the breakers and the paused hosts up to date.
Each delivery's batch is of a kind (``kinds.py``: inboxes or webhooks) that
makes its job and its attempt and judges what came of it. The
:class:`Deliverer` builds them and runs the loop (:meth:`~Deliverer.run`);
one delivery's way through it is :meth:`~Deliverer.perform`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Generator, Iterator

from django.core.exceptions import ImproperlyConfigured
from django.db import DatabaseError, connections

from django_federation_delivery import signals, tracing, wakeup, writelock
from django_federation_delivery.addresses import quoted
from django_federation_delivery.attempt import AttemptResult, is_host_failure
from django_federation_delivery.batches import BatchInfo, KnownBatches
from django_federation_delivery.breakers import Breakers
from django_federation_delivery.checks import check_settings, deliverer_problems
from django_federation_delivery.conf import LEASE_MARGIN_SECONDS, app_settings, database_alias
from django_federation_delivery.decide import Outcome
from django_federation_delivery.dialect import aware_now
from django_federation_delivery.handoff import Handoff
from django_federation_delivery.heartbeats import Heartbeat
from django_federation_delivery.hosts import KnownSchemes
from django_federation_delivery.hoststats import HostStats
from django_federation_delivery.inboxes import InboxDeliveries
from django_federation_delivery.intake import Intake
from django_federation_delivery.kinds import DeliveryKind, Kinds
from django_federation_delivery.limits import OVERLOADED, HostLimits
from django_federation_delivery.outages import Database, Unblocker
from django_federation_delivery.outbox import Outbox
from django_federation_delivery.settling import Summary, ask, tell_failed, tell_settled
from django_federation_delivery.slots import InHand, Slots
from django_federation_delivery.store import claims, settlements
from django_federation_delivery.triage import Triage
from django_federation_delivery.upkeep import OVERDUE_EVERY, Upkeep
from django_federation_delivery.webhooks.deliveries import WebhookDeliveries
from django_federation_delivery.workers import InFlight, Workers

logger = logging.getLogger(__name__)

#: The longest a result waits for the loop while deliveries are in flight:
#: workers wake it only when it has work to hand out or results to take in.
RESULTS_WITHIN = 0.02
#: How long, in seconds, a stop waits for a database that takes none of
#: what it writes: it then ends, leaving what it holds to the leases.
STOPPING_GRACE = 3.0
#: How long, in seconds, a stop waits for an attempt past its time limit
#: (a kind's own code that blocks before its request, where no time limit
#: reaches): it then ends, leaving that delivery to its lease.
OVERRUN_GRACE = 1.0
#: How long, in seconds, a stopped loop's last writes (its hosts' figures,
#: its heartbeat's removal) wait for SQLite's write lock, all told.
FINAL_WRITES_WAIT = 1.0


def host_limits(per_host: int | None = None, per_host_max: int | None = None) -> HostLimits:
    """Each host's limit at once, as a deliverer starts them: from
    ``per_host`` (``PER_HOST``) up to ``per_host_max`` (``PER_HOST_MAX``,
    never below the start)."""
    start = max(1, per_host or app_settings.per_host)
    return HostLimits(start, max(start, per_host_max or app_settings.per_host_max))


def longest_attempt() -> float:
    """The longest one attempt may take, of any kind, as a deliverer made
    now lets it (:attr:`Kinds.longest`): ``ATTEMPT_TIMEOUT`` for an inbox;
    for a webhook, ``WEBHOOK_TIMEOUT``, or the time limit of a configured
    destination's kind's own policy when it is longer."""
    webhooks = WebhookDeliveries.from_settings(Summary(), app_settings.transport_settings())
    return max(app_settings.attempt_timeout, webhooks.timeout)


def transaction_open() -> str | None:
    """The database this thread is in a transaction on, if any: a run in
    this thread would roll it back, unsaid, as it closes the thread's
    connections (rounds refuse to start then, and so does ``deliver_all``)."""
    for connection in connections.all(initialized_only=True):
        # Or one begun by turning autocommit off (set_autocommit(False)).
        if connection.in_atomic_block or (
            connection.connection is not None and not connection.get_autocommit()
        ):
            return str(connection.alias)
    return None


class Deliverer:
    """Claims due deliveries and sends them until stopped (or, with
    ``drain``, until nothing is due)."""

    def __init__(
        self,
        *,
        concurrency: int | None = None,
        per_host: int | None = None,
        per_host_max: int | None = None,
        claim_size: int | None = None,
        lease: float | None = None,
        using: str | None = None,
        on_progress: Callable[[Summary], None] | None = None,
        progress_interval: float = 1.0,
        metrics: bool = False,
        heartbeat: bool | Heartbeat = False,
        holding: Callable[[], bool] | None = None,
        limits: HostLimits | None = None,
    ) -> None:
        # Built from code, without the commands' checks: a setting they refuse
        # would fail the loop, or every delivery, once running. (A webhook
        # destination that does not parse fails its own events alone.)
        if problems := deliverer_problems(check_settings):
            raise ImproperlyConfigured(problems)
        self.concurrency = max(1, concurrency or app_settings.concurrency)
        self.per_host = max(1, per_host or app_settings.per_host)
        #: Each host's limit at once: from ``per_host``, up to ``PER_HOST_MAX``
        #: (never below ``per_host``), down to 1, as it answers; and its rests.
        #: Given, those an earlier loop learned (a round's: contrib.rounds).
        self.limits = limits or host_limits(self.per_host, per_host_max)
        #: What it sees of each host, for the host's picture.
        self.hoststats = HostStats(self.limits)
        self.slow_after = app_settings.slow_after_seconds
        self.slow_concurrency = max(0, app_settings.slow_concurrency)
        self.claim_size = max(1, claim_size or app_settings.claim_size)
        self.lease = float(lease or app_settings.lease_seconds)
        using = using or database_alias()
        #: The queue's database: the one named, else the app's (as routed).
        self.using = using
        self._stopping = threading.Event()
        #: Runs a query; None when the database was away (and waited out).
        self._db = Database(using, self._stopping, logger=logger)
        self._unblocker = Unblocker(using, logger=logger)
        #: Stopping, when a write the database did not take is waited for no
        #: longer (``STOPPING_GRACE`` after the first); None while they are taken.
        self._leave_at: float | None = None
        #: When the loop first saw it was stopping (``time.monotonic()``).
        self._stopped_at: float | None = None
        #: Stopping, whether what is in flight is left to its lease, unwaited.
        self._left_in_flight = False
        #: Stopping, whether a write left outcomes another transaction held.
        self._held_by_others = False
        #: Stopping, when any other wait on a database that is away ends:
        #: ``STOPPING_GRACE`` after the stop (the upkeep's statements, with
        #: nothing to write, were each waited out whole, up to 5 s each).
        self._stop_waits_end: float | None = None
        #: When a stop asked for by :meth:`stop` ends its waits (monotonic).
        self._stop_by: float | None = None
        #: The loop's connection's write lock, on SQLite, while it runs.
        self._prompt_lock: writelock.PromptWriteLock | None = None
        self.idle_poll = app_settings.idle_poll_seconds
        self.new_work_poll = app_settings.new_work_poll_seconds
        self.schemes = KnownSchemes(app_settings.first_scheme, self._db, using=using)
        self.transport_settings = app_settings.transport_settings(most_per_host=self.limits.most)
        self.breakers = Breakers.from_settings(using=using)
        #: Whether to keep the queue's gauges (lag, open breakers) up to date.
        self.metrics = metrics
        #: Whether it records a heartbeat (run_deliverer's do; see heartbeats.py),
        #: or the one it keeps up (a round's, carried from one round to the next).
        self.heartbeat: Heartbeat | None = (
            heartbeat
            if isinstance(heartbeat, Heartbeat)
            else Heartbeat(app_settings.heartbeat_seconds, using=using)
            if heartbeat
            else None
        )
        self.on_progress = on_progress
        self.progress_interval = progress_interval
        self.summary = Summary()
        # The two kinds of delivery, each by its own rules, on the same loop.
        inboxes = InboxDeliveries.from_settings(
            self.summary, self.schemes, self.transport_settings, using=using
        )
        self.kinds = Kinds(
            inboxes,
            WebhookDeliveries.from_settings(
                self.summary,
                self.transport_settings,
                using=using,
                on_finished=self._batches_finished,
            ),
        )
        if self.breakers is not None:
            # A probe is its own for as long as its attempt may take and its
            # outcome takes to be written, within its lease: an inbox's, or a
            # webhook destination's (whose kind's own time limit may be longer).
            def probe_time(kind: DeliveryKind) -> float:
                return min(kind.timeout + LEASE_MARGIN_SECONDS, self.lease)

            self.breakers.probe_time = probe_time(self.kinds.fallback)
            self.breakers.webhook_probe_time = max(map(probe_time, self.kinds))
        self._wake = threading.Event()
        #: When ``on_progress`` is next told, as ``time.monotonic()``: an
        #: idle loop wakes for it.
        self._next_progress = 0.0
        #: When the ready deliveries are next looked at for a deadline passed.
        self._overdue_ready_at = 0.0
        #: The writes that met the database unable to write, which may have
        #: committed: what finished batches they wrote is told once written
        #: again (``settlements.settle``'s ``tried``).
        self._tried: settlements.Tried = {}
        self.workers = Workers(
            self.transport_settings,
            wake=self._wake,
            needed=lambda: self.slots.threads_wanted(),
            longest=self.kinds.longest,
            concurrency=self.concurrency,
            # The threads the others share (Handoff's most): past them, a
            # thread made for an urgent delivery is kept for urgent ones.
            others_at_once=self.concurrency + self.slow_concurrency,
        )
        self.slots = Slots(
            concurrency=self.concurrency,
            per_host=self.limits.allowed,
            slow_after=self.slow_after,
            resting=self.limits.resting,
            lowered=self.limits.lowered,
            urgent_most=self.limits.start,
        )
        #: Outcomes written together in one transaction, at most WRITE_WITHIN
        #: seconds late and four for each slot: what a crash would send again.
        self.outbox = Outbox(self._settle, size=4 * self.concurrency)
        self._batches = KnownBatches(self._db, using=using)
        #: Batches finished by a committed write, ``batch_finished`` not sent yet.
        self._untold: list[int] = []
        self.upkeep = Upkeep(
            db=self._db,
            using=using,
            slots=self.slots,
            summary=self.summary,
            breakers=self.breakers,
            heartbeat=self.heartbeat,
            metrics=metrics,
            hoststats=self.hoststats,
            unavailable_after=app_settings.host_unavailable_after,
            # An unavailable host is probed as its inboxes are reached.
            probe_settings=inboxes.transport_settings,
            stopping=self._stopping,
            holding=holding,
            kinds=self.kinds,
        )
        self.triage = Triage(
            db=self._db,
            batches=self._batches,
            schemes=self.schemes,
            upkeep=self.upkeep,
            kinds=self.kinds,
            outbox=self.outbox,
            breakers=self.breakers,
        )
        self.intake = Intake(
            db=self._db,
            using=using,
            slots=self.slots,
            triage=self.triage,
            upkeep=self.upkeep,
            wake=self._wake,
            stopping=self._stopping,
            concurrency=self.concurrency,
            per_host=self.per_host,
            claim_size=self.claim_size,
            lease=self.lease,
            idle_poll=self.idle_poll,
            new_work_poll=self.new_work_poll,
        )
        self.handoff = Handoff(
            db=self._db,
            workers=self.workers,
            slots=self.slots,
            intake=self.intake,
            outbox=self.outbox,
            perform=self.perform,
            conclude=self.conclude,
            concurrency=self.concurrency,
            slow_concurrency=self.slow_concurrency,
            write=self._write,
            give_back=None if self.breakers is None else self.breakers.give_back,
        )

    # The public controls.

    def stop(self) -> None:
        """Stop claiming, finish what is in flight, then return from :meth:`run`."""
        # From the stop on, a wait for the database away ends within the
        # grace, even one the loop is in the middle of (an idle sweep's).
        if self._stop_by is None:
            self._stop_by = time.monotonic() + STOPPING_GRACE
        self._db.end_waits_by(self._stop_by)
        # And on PostgreSQL a statement stuck past it, on a lock another holds.
        self._unblocker.start(self._stop_by)
        # And on SQLite a wait for the write lock the loop is in.
        if self._prompt_lock is not None:
            self._prompt_lock.end_by(self._stop_by)
        self._stopping.set()
        self._wake.set()

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    def in_hand(self) -> InHand:
        """What it holds now: claimed and waiting for a slot, or with the
        workers. Safe to call from another thread."""
        return self.slots.in_hand()

    def run(self, *, drain: bool = False, stop_after: float | None = None) -> Summary:
        """Claim and send until :meth:`stop` (or, with ``drain``, until
        nothing is due and nothing is in flight). With ``stop_after``, stop
        as :meth:`stop` does that many seconds after the start: what is in
        flight then is finished before it returns; so are the probes of
        unavailable hosts under way, and none is started after. Given a lock
        it holds (``holding``: a round's), it stops so too once the lock is
        lost. Returns what it did.

        Each turn: take in what the workers finished (``handoff.collect``),
        hand ready deliveries to free workers (``handoff.dispatch``), write
        what is due to be written, claim more (``intake``), and wait for
        what comes next. Each delivery goes through :meth:`perform`.
        """
        # Compared, never made a float: an int past a float's range would
        # raise OverflowError. Past TIMEOUT_MAX the stop timer's thread dies
        # of it, and the run never stops.
        if stop_after is not None and not 0 < stop_after <= threading.TIMEOUT_MAX:
            raise ValueError(
                f"stop_after must be a positive number of seconds, at most "
                f"{threading.TIMEOUT_MAX:g}, not {quoted(stop_after)}"
            )
        with self._running(listen=not drain, stop_after=stop_after):
            for kind in self.kinds:
                self._db(kind.give_up_unusable)
            self._next_progress = time.monotonic() + self.progress_interval
            self._stop_waits_end = None
            self._stopped_at, self._left_in_flight = None, False
            self._held_by_others = False
            while True:
                if self.stopping and self._stop_waits_end is None:
                    self._stopped_at = time.monotonic()
                    self._stop_waits_end = self._stop_by or time.monotonic() + STOPPING_GRACE
                    # Never sooner than a grace for writes begun already (a
                    # write failed as the stop came): its tries would then
                    # have no wait between them until that grace ends.
                    self._end_waits_by(max(self._stop_waits_end, self._leave_at or 0.0))
                self.upkeep.recycle_connections()
                self.upkeep.refresh()
                self._fail_overdue_ready()
                self.handoff.collect()
                # Workers first, the database after: a free slot never waits on a write.
                self.handoff.dispatch()
                if self.outbox.due():
                    self._write()
                if self._untold:
                    self._db(self._tell_finished)
                if self.stopping:
                    if self._wound_down():
                        break
                else:
                    self.intake.claim_more()
                    self.handoff.dispatch()
                if (
                    drain
                    and not self.slots.busy
                    and not self.outbox
                    and not self._untold
                    and self.intake.drained()
                ):
                    break
                if self.on_progress is not None and time.monotonic() >= self._next_progress:
                    self._progress()
                    self._next_progress = time.monotonic() + self.progress_interval
                self._pause(caught_up=drain or self.intake.caught_up)
        if self.on_progress is not None:
            self._progress()
        return self.summary

    def _progress(self) -> None:
        """Tell ``on_progress``; one that raises (its output's reader gone:
        ``run_deliverer --drain | head``) is logged, never a reason to leave
        the loop with answered attempts unwritten, sent again after their
        lease."""
        assert self.on_progress is not None
        ask("on_progress", self.on_progress, self.summary)

    def _fail_overdue_ready(self) -> None:
        """Every ``OVERDUE_EVERY``: what waits for a slot past its batch's
        deadline is failed now, as the sweep fails what no claim holds
        (``Upkeep.give_up_overdue``), not once its slot comes."""
        now = time.monotonic()
        if now < self._overdue_ready_at:
            return
        self._overdue_ready_at = now + OVERDUE_EVERY
        for item in self.slots.take_overdue(aware_now()):
            settled = self.triage.waited(item)
            if settled is not None:
                self.outbox.add(settled)

    def perform(self, item: InFlight) -> Generator[None, AttemptResult, None]:
        """One delivery's way once it has a slot, step by step.

        Before it, ``intake`` claimed the delivery and ``triage`` sorted it
        with the others of its claim: one past its batch's deadline, dropped
        by ``SKIP_IF`` or to a paused host was settled there (and is, if its
        deadline passed or its host was paused while it waited for its
        slot); this one has its batch, its kind and its job. The loop drives this generator: it runs
        to the attempt, pauses while a worker makes it through the kind's
        channel, and is resumed with the result.
        """
        # What changed while it waited for its slot: its batch's deadline
        # passed, or its host was paused.
        settled = self.triage.waited(item)
        if settled is not None:
            self.outbox.add(settled)
            return
        # Admit: the destination's breaker may hold it, without a request.
        result = self.triage.admit(item)
        if result is None:
            # Attempt, in a worker thread, through its kind (workers.py).
            result = yield
            if result.overtaken and (settled := self.triage.waited(item)) is not None:
                # Its deadline passed while it waited for a worker: unsent, as
                # at its slot, no attempt counted nor told; a probe given back.
                self.learn_breaker(item, result)
                self.outbox.add(settled)
                return
            if item.elsewhere:
                result = dataclasses.replace(result, elsewhere=True)
            # What the answer taught: the signature scheme the host accepts,
            # how many it takes at once, and a success or a failure for its
            # breaker; nothing, when another host answered (a portable
            # inbox's later gateway, which a stranger may name).
            if not result.elsewhere:
                self.schemes.learn(item.claimed.host, result.accepted_scheme)
                host = item.claimed.host
                # Those in flight beside it: answers to requests sent before
                # a fall of its limit say nothing of the lower limit.
                self.limits.learn(
                    host,
                    result,
                    beside=self.slots.in_flight_to(host) - 1,
                    asked=self._asked(item, result),
                )
                self.hoststats.learn(item.claimed.host, result, aware_now())
            self.learn_breaker(item, result)
        self.conclude(item, result)

    @staticmethod
    def _asked(item: InFlight, result: AttemptResult) -> float | None:
        """The seconds a ``429`` or ``503`` asked its host to be left alone,
        when the delivery's kind waits as asked (``WAIT_AS_ASKED``)."""
        if result.retry_after is None or result.status not in OVERLOADED:
            return None
        return result.retry_after if item.kind.settler(item.claimed).wait_as_asked else None

    def learn_breaker(self, item: InFlight, result: AttemptResult) -> None:
        """What ``item``'s attempt tells its destination's breaker, if it
        asked one."""
        if self.breakers is None or not item.breaker:
            return
        if result.requests and not result.elsewhere:
            failed = not result.delivered and not result.permanent
            self.breakers.record(
                item.breaker,
                failed=failed and is_host_failure(result.status),
                probe=item.probe,
                now=aware_now(),
            )
        elif result.requests and item.probe:
            # Answered by a portable inbox's later gateway: the first, whose
            # breaker it probed, did not accept it; failed the probe if its
            # answer was a host's failure (a 404 came from a host up).
            self.breakers.record(
                item.breaker, failed=result.first_failed, probe=item.probe, now=aware_now()
            )
        elif item.probe:
            # No request made: nothing learned, the probe given back at once.
            self.triage.db(self.breakers.give_back, item.breaker, item.probe)

    def conclude(self, item: InFlight, result: AttemptResult) -> None:
        """What came of ``item``'s attempt, decided, told and put to be
        written: the end of :meth:`perform`, and what ``handoff`` does with
        a crash in its way."""
        # Decide (decide.py), signal and count (settling.py)...
        settlement = item.kind.settler(item.claimed).attempted(item.claimed, item.batch, result)
        # ...end the attempt's span, with the otel extra (tracing.py)...
        tracing.attempted(item, result, settlement)
        # ...and settle: written with others in one transaction (outbox.py, _write).
        self.outbox.add(settlement)

    @contextlib.contextmanager
    def _running(self, *, listen: bool, stop_after: float | None) -> Iterator[None]:
        """What a run holds while it runs: the wake-up, the listener, the
        heartbeat, the workers, the stop timer and the write lock; each let go
        of however the run ends."""
        wakeup.register(self.intake.sent)
        self._unblocker.watch()
        self.upkeep.start()
        if listen:
            self.intake.listen()
        self.summary.started = time.monotonic()
        if self.heartbeat is not None:
            self.heartbeat.begin()
        self.workers.grow_to(self.concurrency)
        timer = None
        if stop_after is not None:
            # The stop an operator's signal makes, from a timer: it ends the
            # loop's every wait, so that none outlasts the bound.
            timer = threading.Timer(stop_after, self.stop)
            timer.daemon = True
            timer.start()
        # On SQLite, this thread's claims and settles take the write lock as it frees.
        remove_prompt_lock = writelock.install(self.using)
        self._prompt_lock = writelock.installed(self.using)
        if self._prompt_lock is not None and self._stop_by is not None:
            self._prompt_lock.end_by(self._stop_by)
        failed = False
        try:
            yield
        except BaseException:
            failed = True
            raise
        finally:
            # What is written from here on is tried once, and on SQLite waits
            # a second at most for the write lock: nothing comes after to be
            # waited for.
            self._db.end_waits_by(time.monotonic())
            writelock.bound_waits(self.using, time.monotonic() + FINAL_WRITES_WAIT)
            if timer is not None:
                timer.cancel()
            self.summary.stopped = time.monotonic()
            if failed:
                self._leave_on_error(self.handoff.release_ready)
            # Stopping with the database away past the grace, what is in
            # flight is left to its lease: its outcome would not be written.
            self.workers.stop(
                wait=not (self.slots.in_flight and (self._waited_enough() or self._left_in_flight))
            )
            if failed:
                self._leave_on_error(self.handoff.collect, self._write, self._tell_untold)
            # The probe under way, until it is done; none after it.
            self.upkeep.finish(self.transport_settings.attempt_timeout + 1)
            self.upkeep.write_answered()
            self._db(self.hoststats.write, now=aware_now(), using=self.using)
            self.intake.stop_listening()
            if self.heartbeat is not None:
                # Stopped cleanly (or on an error it could not wait out): no
                # longer listed as alive.
                self._db(self.heartbeat.remove)
            wakeup.unregister(self.intake.sent)
            self._unblocker.done()
            # This thread owned the ORM's connections: close them.
            connections.close_all()
            remove_prompt_lock()
            self._prompt_lock = None
            self._end_waits_by(None)

    def _leave_on_error(self, *steps: Callable[[], None]) -> None:
        """The loop left on an error of its own (a fault of no one delivery's
        way): the stop's ``steps`` taken all the same, each tried once, so
        that what was claimed and not sent is put back, and what was answered
        written, not left to the lease (and then sent again). One that fails
        too is logged: the loop's error is the one raised."""
        for step in steps:
            try:
                step()
            except Exception:
                logger.exception("Leaving the loop on an error, %s failed too", step.__name__)

    def _tell_untold(self) -> None:
        """``batch_finished`` of the batches written finished and not yet told."""
        if self._untold:
            self._db(self._tell_finished)

    def _end_waits_by(self, at: float | None) -> None:
        """Stopping: wait for the database no later than ``at`` (a
        ``time.monotonic()``), between tries and, on SQLite, for the write
        lock itself, whatever the connection's busy timeout; None: as before."""
        self._db.end_waits_by(at)
        writelock.bound_waits(self.using, at)

    def _wound_down(self) -> bool:
        """Stopping: what was not sent is put back; whether all that was in
        flight has come back and been written, or the database has taken
        none of it for ``STOPPING_GRACE``: what is left is then left to its
        lease."""
        self.handoff.release_ready()
        if self._db.failing and self._leave_at is None:
            # Away already, nothing waiting to be written: the grace starts
            # now, not once an attempt in flight (up to ATTEMPT_TIMEOUT) comes
            # back to a write the database cannot take.
            self._leave_at = time.monotonic() + STOPPING_GRACE
            self._end_waits_by(self._leave_at)
        elif not self._db.failing and self._leave_at is not None and not self.outbox:
            # Back, with nothing unwritten: what is in flight is waited for.
            self._leave_at = None
            self._end_waits_by(self._stop_waits_end)
        if not self._waited_enough():
            if self.slots.in_flight and not self._overran():
                return False
            self._write()
        if self._untold and self._db(self._tell_finished) is None:
            # Not tried again once stopping: the database is away.
            logger.warning(
                "batch_finished was not sent for batches %s: the database was "
                "unavailable as the deliverer stopped",
                ", ".join(map(str, self._untold)),
            )
            self._untold = []
        if not self._waited_enough():
            if self.outbox:
                return False
            if self.slots.in_flight:
                self._left_in_flight = True
                logger.warning(
                    "Stopping with %d attempts in flight past their time limit (%g s): a "
                    "kind's code that does not return. Their deliveries come due again "
                    "once their lease runs out",
                    len(self.slots.in_flight),
                    self.kinds.longest,
                )
            return True
        if self._held_by_others and self.outbox and not self._db.failing:
            logger.warning(
                "Stopping with %d outcomes unwritten: another transaction held their "
                "rows for %g s (a send in their sequence, not yet committed). Their "
                "deliveries come due again once their lease runs out, and some may be "
                "sent again",
                len(self.outbox),
                STOPPING_GRACE,
            )
        elif self.outbox or self.slots.in_flight:
            logger.warning(
                "Stopping with %d outcomes unwritten and %d attempts in flight: the "
                "database took no write for %g s. Their deliveries come due again once "
                "their lease runs out, and some may be sent again",
                len(self.outbox),
                len(self.slots.in_flight),
                STOPPING_GRACE,
            )
        return True

    def _overran(self) -> bool:
        """Stopping, whether every attempt in flight has had its time limit
        (the kinds' longest) and ``OVERRUN_GRACE`` since it began, or since
        the stop for one not begun: what still runs is a kind's code that
        no time limit reaches, and would hold the stop for as long as it
        likes (a round past its task's time limit)."""
        started = [item.started for item in self.slots.in_flight.values()]
        since = max([self._stopped_at or time.monotonic(), *started])
        return time.monotonic() >= since + self.kinds.longest + OVERRUN_GRACE

    def _waited_enough(self) -> bool:
        """Stopping, whether the database has taken no write for ``STOPPING_GRACE``."""
        return self._leave_at is not None and time.monotonic() >= self._leave_at

    def _pause(self, *, caught_up: bool) -> None:
        """Between two turns: write what waits to be written when it is due
        (or when nothing else is to be done), else wait for what comes next."""
        if self._untold:
            return  # told again at once: a failure to tell has waited already (self._db)
        if self._tried and not self.outbox:
            self._tell_let_go()
            return
        if self.breakers is not None and not self.outbox and self.breakers.unwritten():
            # Left by a flush the database failed (a probe's success): with
            # nothing else to write, no outbox write would come to flush it.
            self._db(self.breakers.flush)
        busy = self.slots.busy
        if self.outbox and self.outbox.deferred() and not busy and self.intake.caught_up:
            # What another transaction held, and what came back since, are
            # written a moment from now: not after an idle poll.
            self.intake.wait(min(self.outbox.until_due(), self.new_work_poll))
            return
        if self.outbox and (not busy or self.outbox.due()) and not self.outbox.deferred():
            if self.outbox.due() or caught_up:
                self._write()  # not at each lull; a failing database is waited out
            return
        if busy or not self.intake.caught_up:
            # Woken by the next result, when one in flight turns slow,
            # or when what is unwritten is due to be written.
            self.intake.wait(
                min(
                    self.slots.until_next_slow(),
                    self.outbox.until_due(),
                    self.new_work_poll,
                    RESULTS_WITHIN if self.slots.in_flight else self.new_work_poll,
                )
            )
        else:
            self.intake.idle(by=self._next_progress if self.on_progress is not None else None)

    # The coordinator's writes.

    def _settle(self, outcomes: list[settlements.Settlement]) -> bool:
        """The outbox's write: whether the database took it."""
        written = self._db(
            settlements.settle,
            outcomes,
            on_finished=self._batches_finished,
            on_failed_instead=self._failed_instead,
            on_superseded=self._superseded,
            # Held by a send not yet committed: written at a later flush.
            on_busy=self.outbox.keep_held,
            using=self.using,
            tried=self._tried,
        )
        if written is not None and self._tried:
            # A write passes all that waits: what it left in ``tried`` was
            # let go by the outbox, its lease run out.
            self._tell_let_go()
        return written is not None

    def _tell_let_go(self) -> None:
        """What the outbox let go after a write whose answer was lost (its
        lease ran out while the database was away): the batches that write
        finished, committed all the same, told; never written again, they
        were never told. Left for the next turn while the database is away."""
        found = self._db(settlements.finished_unanswered, dict(self._tried), using=self.using)
        if found is None:
            return
        self._tried.clear()
        if found:
            self._batches_finished(found)

    def _failed_instead(self, failed: settlements.Settlement) -> None:
        """``delivery_failed`` of a delivery written failed, committed, because
        the database refused to store what came of its attempt (a value it
        cannot hold): its receivers would otherwise never hear of it."""
        row = failed.claimed
        batch = self._batch_to_tell(row, "delivery_failed")
        if batch is not None:
            tell_failed(row, batch, None, failed.last_error)

    def _superseded(self, written: list[settlements.Settlement]) -> None:
        """``delivery_settled`` of the deliveries put back without a request
        (held back, handed back, retried unsent) that a write superseded,
        committed (a retraction sent while they were claimed waited on
        them), and the summary's count of them, taken off what it counted
        them as."""
        for item in written:
            if item.counted:
                self.summary.count(Outcome(item.counted), by=-1)
            self.summary.count(Outcome.SUPERSEDED)
            row = item.claimed
            if not signals.listened(signals.delivery_settled):
                continue
            batch = self._batch_to_tell(row, "delivery_settled")
            if batch is not None:
                tell_settled(row, batch, Outcome.SUPERSEDED, None)

    def _batch_to_tell(self, row: claims.Claimed, signal: str) -> BatchInfo | None:
        """The batch of ``row``, whose ``signal`` a committed write is to
        send: read if it is no longer known. A database error there is
        logged, never raised into the write that has committed; None then,
        or if the batch was deleted meanwhile (and the delivery with it)."""
        batch = self._batches.known(row.batch_id)
        if batch is not None:
            return batch
        try:
            return claims.batches({row.batch_id}, using=self.using).get(row.batch_id)
        except DatabaseError as exc:
            logger.warning(
                "%s was not sent for delivery %d: its batch could not be read (%s)",
                signal,
                row.id,
                type(exc).__name__,
            )
            return None

    def _write(self) -> None:
        waiting = bool(self.outbox)
        if self.outbox.flush():
            self._forget_out_of_hand()
            if self.stopping and self.outbox:
                # What another transaction held (a view's, still open: busy)
                # is tried again, until the grace ends once nothing is in
                # flight (whose outcomes the database takes), and no longer.
                self._held_by_others = True
                if self._leave_at is None and not self.slots.in_flight:
                    self._leave_at = time.monotonic() + STOPPING_GRACE
                    self._end_waits_by(self._leave_at)
            elif self._leave_at is not None:
                self._leave_at = None
                self._end_waits_by(self._stop_waits_end)
            if self.breakers is not None:
                self._db(self.breakers.flush)
            self.schemes.write()
        elif waiting and self.stopping and self._leave_at is None:
            # Stopping, the database took none of it: it is tried again,
            # each try waited for, until the grace ends (_wound_down).
            self._leave_at = time.monotonic() + STOPPING_GRACE
            self._end_waits_by(self._leave_at)

    def _forget_out_of_hand(self) -> None:
        """Let go of what was read of the batches none of whose deliveries
        is in hand now, once what came of them is written: one waiting for
        its retry, or held, is read again when it is claimed again, rather
        than kept, body and all, until its batch finishes."""
        slots = self.slots
        held = {item.claimed.batch_id for item in slots.ready}
        held.update(item.claimed.batch_id for item in slots.in_flight.values())
        gone = self._batches.keep_only(held)
        if gone:
            self.kinds.forget(gone)

    def _batches_finished(self, ids: list[int]) -> None:
        """Batches a write finished, once it has committed: told by the loop
        right after (:meth:`_tell_finished`). Telling reads the batches: a
        database error there must not make the committed write count as
        unwritten (written again, its rows no longer its claim's, and the
        batches never told), so it is a step of its own, tried again until
        the database takes it."""
        self._untold += ids

    def _tell_finished(self) -> bool:
        """``batch_finished`` for the batches finished and not told yet."""
        ids = self._untold
        signals.send_batches_finished(ids, using=self.using)
        self._untold = []
        for id in ids:
            self._batches.forget(id)
        self.kinds.forget(ids)
        return True
