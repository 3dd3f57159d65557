"""How the loop takes work from the queue: it claims more when few claimed
deliveries are ready to go, knows when nothing more is due, and otherwise
waits for what comes next (a result, a send, or the next due time)."""

from __future__ import annotations

import dataclasses
import datetime as dt
import logging
import threading
import time

from django.utils import timezone

from django_federation_delivery.dialect import aware_now, connection_for, is_postgresql
from django_federation_delivery.outages import Runner
from django_federation_delivery.retry import jitter
from django_federation_delivery.slots import Slots
from django_federation_delivery.store import claims
from django_federation_delivery.triage import Triage
from django_federation_delivery.upkeep import Upkeep
from django_federation_delivery.wakeup import PostgresListener

__all__ = ["Intake"]

# The loop's logger: where an operator looks for what the loop met.
logger = logging.getLogger("django_federation_delivery.deliverer")

#: How long the loop leaves the hosts whose breaker holds everything alone
#: once nothing of theirs was due: what is sent to them meanwhile waits that
#: long at most to be held.
HOLD_PASS_SECONDS = 1.0
#: How often a loop with enough in hand to keep its slots busy (a fan-out's
#: deliveries) looks for what came due in the urgent lanes meanwhile (a
#: webhook event, a direct message): one index read, and a claim of those
#: lanes alone only when it finds some. Sends from other processes do not
#: wake it then (its LISTEN is paused while claims come back full).
URGENT_LOOK_SECONDS = 0.1


class SendWake(threading.Event):
    """A loop's wake, as a send sets it (in this process, or by NOTIFY): set,
    it sets the loop's ``wake`` too, and stays set until the next claim reads
    it. What the send queued was written due before its transaction
    committed, maybe before a claim that found nothing and after it: only
    what came due since that claim is then no look at all."""

    def __init__(self, wake: threading.Event) -> None:
        super().__init__()
        self._wake = wake

    def set(self) -> None:
        super().set()
        self._wake.set()


@dataclasses.dataclass(kw_only=True, eq=False)
class Intake:
    """One deliverer's claims and waits. ``caught_up`` says that the last
    claim found nothing due: anything that may have changed that clears it
    (:meth:`look_again`)."""

    db: Runner
    using: str
    slots: Slots
    triage: Triage
    upkeep: Upkeep
    #: Set by a result, a send or a stop: it ends a wait.
    wake: threading.Event
    stopping: threading.Event
    concurrency: int
    per_host: int
    claim_size: int
    lease: float
    idle_poll: float
    new_work_poll: float
    caught_up: bool = dataclasses.field(default=False, init=False)
    _caught_up_at: float = dataclasses.field(default=0.0, init=False)
    #: When the hosts whose breaker holds everything are next looked at.
    _held_pass_at: float = dataclasses.field(default=0.0, init=False)
    #: Until when the hosts the last claim left out (held, or resting) have
    #: nothing to claim, however due: what of theirs is due until then says
    #: nothing of whether to claim again.
    _left_out_until: float = dataclasses.field(default=0.0, init=False)
    #: When the last claim that found nothing began (the database's clock).
    _found_nothing_at: dt.datetime | None = dataclasses.field(default=None, init=False)
    #: Whether the last claim found nothing at all.
    _found_nothing: bool = dataclasses.field(default=False, init=False)
    #: When the urgent lanes were last looked at (:meth:`_claim_urgent`).
    _urgent_looked_at: float = dataclasses.field(default=0.0, init=False)
    #: Whether the last urgent claim took nothing: the urgent look then
    #: leaves out the hosts the claim leaves out.
    _urgent_left_out: bool = dataclasses.field(default=False, init=False)
    #: Hosts whose urgent rows due another transaction held at the last
    #: look, left out of the urgent looks until when (``time.monotonic()``).
    _urgent_passing: dict[str, float] = dataclasses.field(default_factory=dict, init=False)
    #: Where the next pass over the held hosts begins, past MOST_HOSTS of them,
    #: and how many of them the passes since the last that took any took none of.
    _held_turn: int = dataclasses.field(default=0, init=False)
    _held_none: int = dataclasses.field(default=0, init=False)
    #: Set by a send: the next claim looks at all that is due, not only at
    #: what came due since the last one that found nothing.
    sent: SendWake = dataclasses.field(init=False)
    #: Set when the listener begins to listen (again): what was sent before
    #: it woke nobody, and the next look reads whether anything at all is
    #: due. A read, not a claim: nothing may have been sent meanwhile.
    listened: SendWake = dataclasses.field(init=False)
    #: Whether the next look reads all that is due (:attr:`listened`).
    _look_at_all: bool = dataclasses.field(default=False, init=False)
    #: Whether a claim passes the rows another transaction holds (PostgreSQL).
    _passes_locked: bool = dataclasses.field(default=False, init=False)
    #: The hosts at their limit that the last claim that found nothing left out.
    _left_at_limit: set[str] = dataclasses.field(default_factory=set, init=False)
    #: PostgreSQL's listener, while :meth:`listen` has one: paused while
    #: claims come back full, as the loop claims again then unwoken.
    _listener: PostgresListener | None = dataclasses.field(default=None, init=False)
    #: Claimed, and not sorted yet: their batches could not be read (the
    #: database away). Held under their lease, sorted before the next claim.
    _unsorted: list[claims.Claimed] = dataclasses.field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        self.sent = SendWake(self.wake)
        self.listened = SendWake(self.wake)
        self._passes_locked = is_postgresql(connection_for(self.using))

    def listen(self) -> bool:
        """Be woken by sends from other processes (PostgreSQL's LISTEN), where
        the database can; whether it does."""
        if not PostgresListener.available(self.using):
            return False
        self._listener = PostgresListener(self.sent, listened=self.listened, using=self.using)
        self._listener.start()
        return True

    def _listening(self) -> bool:
        """Whether a send from another process wakes the loop now: a listener
        that listens, not one that is connecting, or failing to."""
        return self._listener is not None and self._listener.listening

    def stop_listening(self) -> None:
        if self._listener is not None:
            self._listener.stop()
            self._listener = None

    def look_again(self, host: str | None = None) -> None:
        """Something may have come due (a result's retry, a send): the next
        claim looks, whatever the last one found. With the ``host`` of a
        result, whose slot it frees: one the last claim that found nothing
        left out at its limit is claimed for again at once."""
        self.caught_up = False
        if host is not None and host in self._left_at_limit:
            self._left_at_limit.clear()
            self._found_nothing = False

    def claim_more(self) -> None:
        """Keep a few claimed deliveries ready for the next free slots,
        claimed many at a time rather than one round trip a delivery."""
        if self._unsorted and not self._sort([]):
            return
        # Only what can go as soon as a slot is free counts as ready: a claimed
        # delivery waiting for a host already at PER_HOST (a silent one, say)
        # must not keep the others from being claimed.
        if self.sent.is_set():
            self.sent.clear()
            self._found_nothing = False
        if self.listened.is_set():
            self.listened.clear()
            self._look_at_all = True
        if self.slots.sendable(max(1, self.concurrency // 2)):
            self._claim_urgent()
            return
        if self.slots.busy:
            # The claim below leaves out the hosts at their limit; the urgent
            # lanes have a host's limit again of their own, and a direct
            # message to a host a fan-out keeps at its limit is looked for
            # all the same.
            self._claim_urgent()
        if (
            self.caught_up
            and self.slots.busy
            and time.monotonic() - self._caught_up_at < self.new_work_poll
        ):
            # Nothing more was due: the next result, a wake, or (for work
            # queued by another process without NOTIFY) a moment says when to look.
            return
        if self._found_nothing and self._anything_due() is False:
            # Nothing has come due since a claim found nothing (another
            # deliverer took it, or this one has caught up): a read says so,
            # where a claim is a write transaction, and on SQLite it holds
            # the write lock a web process's send is waiting for.
            self.caught_up = True
            self._caught_up_at = time.monotonic()
            return
        saturated = self.slots.saturated_hosts()
        # Hosts whose breaker holds everything are left out of the claim:
        # their backlog, due first, would fill its window and leave the hosts
        # behind it waiting while it is held, PER_HOST at a time.
        held = [host for host in self.upkeep.held_hosts() if host not in saturated]
        limit = max(1, self.claim_size - len(self.slots.ready))
        claiming_at = timezone.now()
        claimed = self.db(
            claims.claim,
            limit,
            self.lease,
            per_host=self.per_host,
            exclude_hosts=[*saturated, *held],
            using=self.using,
        )
        if claimed is not None and held and len(claimed) < limit:
            claimed = self._claim_held(claimed, held, limit - len(claimed))
        if claimed is None:
            # The database is away (and was waited on in ``db``): that says
            # nothing about what is due, and a drain must not end on it.
            self.caught_up = False
            return
        # Fewer than asked may only mean the hosts at the head of the queue
        # had their share (a claim takes at most PER_HOST to one host); nothing
        # at all means nothing more is due.
        self.caught_up = self._found_nothing = not claimed
        self._caught_up_at = time.monotonic()
        if not claimed:
            self._found_nothing_at = claiming_at
            self._left_out_until = self._next_claimable(held)
            self._left_at_limit = set(saturated)
            if not self._left_out_until and (saturated or self._passes_locked):
                # What is due may not be claimable: the hosts at their limit
                # have theirs (a result that frees a slot there has the next
                # claim made at once: look_again), and, on PostgreSQL, rows
                # another transaction holds (a Delete being written locks
                # what it supersedes) are passed. Only what came due since is
                # looked for until a pass later: claimed again at every look,
                # each a write transaction finding nothing, for as long as the
                # hosts stayed at their limit or that transaction open.
                # (SQLite's claim holds the write lock: it passes nothing.)
                self._left_out_until = time.monotonic() + HOLD_PASS_SECONDS
        if self._listener is not None:
            self._listener.pause(len(claimed) >= limit)
        if claimed:
            self._sort(claimed)

    def _sort(self, claimed: list[claims.Claimed]) -> bool:
        """Hand ``claimed``, and what is kept unsorted, to the slots, sorted;
        whether it could be. If not (the database away as their batches were
        read), they are kept under their lease to be sorted at the next turn,
        and a drain goes on: a lease that lapses meanwhile makes no attempt
        (``attempt.deadline_of``). What an urgent look kept is sorted with
        the claim that follows it in the same turn, not dropped by it."""
        claimed = [*self._unsorted, *claimed]
        ready = self.triage.sort(claimed, holding=self.slots.holding())
        if ready is None:
            self._unsorted = claimed
            self.caught_up = False
            return False
        self._unsorted = []
        for item in ready:
            self.slots.add(item)
        return True

    def take_unsorted(self) -> list[claims.Claimed]:
        """Stopping: what is claimed and not sorted, no longer held here."""
        unsorted, self._unsorted = self._unsorted, []
        return unsorted

    def drained(self) -> bool:
        """Whether a drain is over: the last claim found nothing, and nothing
        is due. On PostgreSQL a claim passes the rows another deliverer's
        claim is taking at that moment: they are due until it commits, and
        may come back (a claim locks more rows than it takes)."""
        return self.caught_up and self.db(claims.has_due, using=self.using) is False

    def _claim_urgent(self) -> None:
        """With enough in hand, still take what is due in the urgent lanes,
        which goes before what is ready (``Slots.add``), every
        URGENT_LOOK_SECONDS at most: a direct message or an alert never
        waits for a fan-out's claimed deliveries to be sent first."""
        now = time.monotonic()
        if now - self._urgent_looked_at < URGENT_LOOK_SECONDS:
            return
        self._urgent_looked_at = now
        # No more ahead of the slots than a claim's worth, however many are due.
        room = self.claim_size - self.slots.urgent_ready()
        if room < 1:
            return
        passing = [host for host, until in self._urgent_passing.items() if until > now]
        if len(passing) < len(self._urgent_passing):
            self._urgent_passing = {host: self._urgent_passing[host] for host in passing}
        left_out = [
            *self.slots.saturated_hosts(urgent=True),
            *self.upkeep.held_hosts(),
            *passing,
        ]
        if self._urgent_left_out:
            # What is due to a host the claim leaves out (at its limit,
            # resting, held by its breaker) is taken by no claim: once one
            # took nothing, the look leaves those hosts out too. (Looking
            # only at what came due since, it missed a send committed after
            # that claim, written due before it, that no wake told of.)
            due = self.db(
                claims.has_claimable,
                exclude_hosts=left_out,
                lanes=claims.URGENT,
                using=self.using,
            )
        else:
            due = self.db(claims.has_due, lanes=claims.URGENT, using=self.using)
        if not due:
            return
        claimed = self.db(
            claims.claim,
            room,
            self.lease,
            per_host=self.per_host,
            exclude_hosts=left_out,
            lanes=claims.URGENT,
            using=self.using,
        )
        if claimed is None:
            return
        if not claimed and self._urgent_left_out:
            # The look said yes, leaving out the same hosts: what it saw,
            # another transaction holds (a Delete being written locks what it
            # supersedes), which PostgreSQL's claim passes. Their hosts are
            # left out of the looks for a pass, the others looked at as ever:
            # else a claim every look, each a write transaction finding
            # nothing, while that one stays open.
            held_elsewhere = self.db(
                claims.claimable_due_hosts,
                exclude_hosts=left_out,
                lanes=claims.URGENT,
                using=self.using,
            )
            for host in held_elsewhere or ():
                self._urgent_passing[host] = now + HOLD_PASS_SECONDS
        self._urgent_left_out = not claimed
        if claimed:
            self._sort(claimed)

    def _claim_held(
        self, claimed: list[claims.Claimed], held: list[str], room: int
    ) -> list[claims.Claimed] | None:
        """``claimed``, and what is due to the ``held`` hosts in the room left:
        each is held again by its breaker as it is handed out, as the claim
        would have had it. Looked for again at most every HOLD_PASS_SECONDS
        once none was due."""
        if time.monotonic() < self._held_pass_at:
            return claimed
        # A claim names at most MOST_HOSTS hosts: past them, in turns, so
        # that each held host's rows are held again (a drain ends) and none
        # waits on the first ones by name.
        hosts = sorted(held)
        if len(hosts) > claims.MOST_HOSTS:
            start = self._held_turn % len(hosts)
            hosts = (hosts[start:] + hosts[:start])[: claims.MOST_HOSTS]
            self._held_turn = start + claims.MOST_HOSTS
        more = self.db(claims.claim, room, self.lease, only_hosts=hosts, using=self.using)
        if more is None:
            # The database went away meanwhile: what was claimed still goes
            # (its leases are taken); nothing claimed says nothing of what is due.
            return claimed or None
        if more:
            self._held_none = 0
        else:
            self._held_none += len(hosts)
            if self._held_none >= len(held):
                # A turn over every one of them took nothing.
                self._held_pass_at = time.monotonic() + HOLD_PASS_SECONDS
                self._held_none = 0
        return [*claimed, *more]

    def _next_claimable(self, held: list[str]) -> float:
        """When a host left out of a claim that found nothing may next have a
        delivery claimed: the end of the first rest, or the next pass over
        the ``held`` hosts (0.0: none was left out)."""
        times = [self._held_pass_at] if held else []
        rested = self.slots.until_rested()
        if rested is not None:
            times.append(time.monotonic() + rested)
        return min(times, default=0.0)

    def _anything_due(self) -> bool | None:
        """Whether anything is due (None: the database is away). While the
        hosts the last claim left out (held, resting, or at their limit) stay
        left out, what of theirs is due says nothing: only what came due
        since the last claim that found nothing counts (else a loop whose
        only work is theirs would claim again at every turn, finding nothing
        each time)."""
        waiting = (
            self._found_nothing
            and not self._look_at_all
            and time.monotonic() < self._left_out_until
        )
        since = self._found_nothing_at if waiting else None
        due: bool | None = self.db(claims.has_due, since=since, using=self.using)
        if due is not None:
            self._look_at_all = False
        return due

    def wait(self, timeout: float) -> None:
        if self.wake.wait(timeout):
            # A result, or new work queued: either may mean something is due.
            self.caught_up = False
        self.wake.clear()

    def idle(self, *, listening: bool | None = None, by: float | None = None) -> None:
        """Sleep until the next due time or the idle poll, whichever is
        sooner; a send wakes it, and without LISTEN so does a cheap look for
        new work every ``NEW_WORK_POLL_SECONDS``. ``listening`` (by default,
        whether the listener :meth:`listen` started listens now, asked again
        at each look: one that cannot connect, or lost its connection, wakes
        nobody) says a send from another process wakes it too, so no look is
        needed, unless what is due is left out of the claims for now: the
        next due time then says nothing of the others'. It sleeps until
        ``by`` at the latest (``time.monotonic()``: a progress line due), and
        closes a connection lost, or past ``CONN_MAX_AGE``, before each look."""
        if self._listener is not None:
            self._listener.pause(False)
        due = self.db(claims.next_due, using=self.using)
        sleep = jitter(self.idle_poll)
        # Whether to look for what comes due meanwhile, whether or not a send
        # from another process wakes it.
        look = False
        if due is not None:
            # Aware, as the due time read is, whatever USE_TZ says.
            sleep = min(sleep, max(0.0, (due - aware_now()).total_seconds()))
            if sleep == 0.0:
                # Due, yet the claim found nothing: it is a held or resting
                # host's, left alone until its next pass or the end of its
                # rest (or a result, or a send). Meanwhile another host's
                # retry may come due, which no NOTIFY tells of: looked for.
                sleep = max(0.0, self._left_out_until - time.monotonic())
                look = True
        deadline = time.monotonic() + sleep
        if by is not None:
            deadline = min(deadline, by)
        if not self.wake.is_set():
            # Only when nothing has woken it already: what follows wakes it.
            logger.debug("Nothing to do: idle for up to %.1f s", sleep)
        while not self.stopping.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                break
            looking = look or not (self._listening() if listening is None else listening)
            step = min(left, self.new_work_poll) if looking else left
            beat = self.upkeep.until_beat()
            if beat is not None:
                # An idle deliverer is alive too, and its gauges are read.
                step = min(step, beat)
            if self.wake.wait(step):
                break
            # Replaced before anything is asked of it: a connection the server
            # dropped while this one idled is no outage.
            self.upkeep.recycle_connections()
            self.upkeep.refresh()
            if looking and self._anything_due() is True:
                break
        self.wake.clear()
        self.caught_up = False
