"""How many deliveries each host is sent at once: a limit that adapts.

A host starts at ``PER_HOST`` and moves between 1 and ``PER_HOST_MAX`` as
it answers, as TCP's congestion window does: until it first shows a sign of
overload, up by one for each answer that came back well (doubling a round);
after that, up by one a round (one more for every *limit* answers); halved
at a sign of overload: a ``429`` or ``503``, no answer at all (a timeout, a
refused connection), or an answer far slower than the host's own fastest
delivery lately (a quick refusal, a 404 for an account gone, says nothing of
its pace). A big instance that answers in 20 ms soon takes many at once; a
small one that slows down or sheds load is sent fewer, without a setting
changed. Halving happens at most once a round: the answers to requests
already in flight when the limit fell do not halve it again.

The limit a host was halved from is not asked of it again for a while:
the limit grows back, a round at a time, to one below it, and to it only
``PROBE_AFTER`` seconds after the halving, twice as long each time the host
is halved there (or below) once more, up to ``MOST_PROBE_AFTER``. Measured
in time, not in answers, so that a small host that sheds load at some limit
is asked it again as rarely however many deliveries are queued for it.

A host that answers a ``429`` or ``503`` with a ``Retry-After`` rests as
long as it asks, up to ``MOST_REST``: it said so of itself, not of one
delivery. A host that refuses at a limit of one (a ``429`` or ``503``: too many, not
now), where halving cannot go, *rests*: it is sent nothing for ``REST``
seconds, twice as long at each refusal in a row (up to ``MOST_REST``), half
as long again after each answer that came back well; and it is not sent
two at once until ``PROBE_AFTER`` seconds after its last refusal. One
deliverer alone rarely needs it; several, each with a limit of its own
(``run_deliverer --processes N``), send a host at least one each: a host
that takes one at a time refuses all but one of them, again and again,
unless the others step back. Resting, the one refused most leaves the
host to the others, and asks again ever more rarely while refused.

Only a host that has given some other answer before (a 2xx, or a 4xx or
5xx but 429 and 503) rests ever longer: busy, not down. One that has
answered nothing but 429 or 503 may be down, or busy with another
deliverer: it is sent its next request no sooner than ``REST`` after each
refusal, never longer, and is otherwise its breaker's and its retries' to
deal with, as the operator set them; a rest of up to ``MOST_REST`` would
override both.

With ``PER_HOST_MAX`` not above ``PER_HOST`` the limit is fixed: neither
grown nor halved, and never rested, as every host's was before limits
adapted.

Only the loop's thread reads and changes it; it is the loop's memory, lost
with it, and each host starts over at ``PER_HOST`` in a new run.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

from django_federation_delivery.attempt import AttemptResult

__all__ = [
    "MOST_PROBE_AFTER",
    "MOST_REST",
    "OVERLOADED",
    "PROBE_AFTER",
    "REST",
    "SLOWER",
    "HostLimits",
]

#: Answers that say "too many, not now".
OVERLOADED = frozenset({429, 503})
#: An answer this many times slower than the host's fastest lately is a
#: sign of a queue building up on its side.
SLOWER = 3.0
#: Differences below this are noise, however fast the host.
NOISE = 0.025
#: The fastest answer is forgotten this fast: each answer lets it grow by
#: this fraction, so that a host whose usual pace changes is not judged by
#: an old one for ever.
FORGET = 0.02
#: The least a host's fastest delivery is taken to be, in seconds.
FASTEST_FLOOR = 0.001
#: Seconds before a host is asked again the limit it was halved from;
#: doubled each time it is halved at or below that again, up to MOST_PROBE_AFTER.
PROBE_AFTER = 30.0
MOST_PROBE_AFTER = 3600.0
#: Hosts remembered; past it the ones seen longest ago are forgotten.
MOST_HOSTS = 10_000
#: Seconds a host that answers 429 or 503 at a limit of one is first sent
#: nothing; doubled at each refusal in a row, up to MOST_REST, halved at
#: each good answer.
REST = 0.1
MOST_REST = 30.0


@dataclasses.dataclass(slots=True)
class _Host:
    limit: float
    #: Its fastest delivery lately, in seconds; None until one.
    fastest: float | None = None
    #: Answers to wait for before it may be halved again: those to requests
    #: that were in flight when it last was.
    recovering: int = 0
    #: The limit it was last halved from, until it is reached again.
    ceiling: int | None = None
    #: When (the clock's seconds) it may grow to its ceiling.
    probe_at: float = 0.0
    #: Seconds it waited last before being asked its ceiling again.
    wait: float = 0.0
    #: Not yet overloaded: it grows by one an answer, not one a round.
    starting: bool = True
    #: The limit it was last halved from (kept once the ceiling is passed).
    halved_from: int | None = None
    #: Seconds of its last rest (0 when none is owed): see REST.
    rest: float = 0.0
    #: Whether it has given an answer but 429 and 503 (up: busy, not down).
    up: bool = False
    #: Whether its limit was last lowered by a refusal (429, 503), not by
    #: answers slowing down or not coming: see HostLimits.lowered.
    refused: bool = False


class HostLimits:
    """Each host's limit of deliveries at once, from ``start``, between 1 and
    ``most``. With ``most`` at ``start`` or below it is fixed at ``most``:
    never grown, never halved, as before limits adapted. ``clock`` gives the
    seconds the waits before a probe are measured in."""

    def __init__(
        self, start: int, most: int, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.start = max(1, start)
        self.most = max(1, most)
        self.clock = clock
        self._hosts: dict[str, _Host] = {}
        #: The hosts resting, and until when (the clock's seconds).
        self._resting: dict[str, float] = {}

    def limit(self, host: str) -> int:
        """The limit learned of ``host``: how many it is sent at once."""
        found = self._hosts.get(host)
        if found is None:
            return min(self.start, self.most)
        return int(found.limit)

    def lowered(self, host: str) -> bool:
        """Whether ``host`` refused as many at once as it was sent lately
        (429, 503): its limit below where it starts, or halved and not grown
        back to where it was halved from, last for a refusal. Its urgent
        deliveries then share its limit with the others (``slots.Slots``),
        which would otherwise send it as many as it refused. Halved as its
        answers slowed, it refused nothing: they keep their own."""
        found = self._hosts.get(host)
        if found is None or not found.refused:
            return False
        return int(found.limit) < self.start or found.ceiling is not None

    def allowed(self, host: str) -> int:
        """How many deliveries ``host`` may have in flight now: its limit,
        or none while it rests."""
        if self._resting and host in self._resting:
            if self.clock() < self._resting[host]:
                return 0
            del self._resting[host]
        return self.limit(host)

    def rest_left(self, host: str) -> float:
        """Seconds ``host`` still rests: 0.0 when it does not."""
        until = self._resting.get(host)
        return 0.0 if until is None else max(0.0, until - self.clock())

    def resting(self) -> dict[str, float]:
        """The hosts resting now, none of whose deliveries is to be claimed,
        and the seconds of rest each has left."""
        if not self._resting:
            return {}
        now = self.clock()
        for host in [host for host, until in self._resting.items() if until <= now]:
            del self._resting[host]
        return {host: until - now for host, until in self._resting.items()}

    def learn(
        self,
        host: str,
        result: AttemptResult,
        *,
        beside: int | None = None,
        asked: float | None = None,
    ) -> None:
        """What an attempt at ``host`` says of its load. ``beside``: how many
        other requests to it are in flight (as many as its limit, unknown):
        when the limit falls, their answers are not taken for answers to
        the lower limit. ``asked``: the seconds a ``429`` or ``503`` asked
        to be left alone (its ``Retry-After``, when its kind honours it):
        the host rests that long, up to ``MOST_REST``."""
        if result.held or not result.requests:
            return  # no request: nothing said
        if self.most <= self.start:
            return  # a fixed limit
        found = self._hosts.get(host)
        if found is None:
            if len(self._hosts) >= MOST_HOSTS:
                forgotten = next(iter(self._hosts))
                del self._hosts[forgotten]
                self._resting.pop(forgotten, None)
            found = self._hosts[host] = _Host(float(min(self.start, self.most)))
        else:
            # Seen again: the last to be forgotten.
            self._hosts[host] = self._hosts.pop(host)
        seconds = result.duration
        answered = result.status is not None
        slow = answered and found.fastest is not None and seconds > SLOWER * found.fastest + NOISE
        if result.delivered:
            # Of the answers that did the work alone: a quick refusal (a 404
            # for an account gone) would make every ordinary answer slow.
            # Never below a floor: at 0 s (a kind's own result that did not
            # time itself), it would never grow again.
            taken = max(seconds, FASTEST_FLOOR)
            found.fastest = (
                taken if found.fastest is None else min(taken, found.fastest * (1 + FORGET))
            )
        elif answered and result.status not in OVERLOADED and found.fastest is not None:
            # Forgotten with any other answer too, toward its own time: a
            # host that now only refuses (a 410 for each account of an
            # instance closing down), more slowly than it once delivered, is
            # not judged by that for ever; quicker refusals move nothing.
            found.fastest = min(found.fastest * (1 + FORGET), max(found.fastest, seconds))
        if answered and result.status not in OVERLOADED:
            found.up = True
        elif answered:
            # Refused: kept until its limit has grown back (HostLimits.lowered).
            found.refused = True
        if found.recovering:
            found.recovering -= 1
        if not answered or result.status in OVERLOADED or slow:
            if not found.recovering:
                # Limits are compared as whole numbers: as many at once.
                again = found.halved_from is not None and int(found.limit) <= found.halved_from
                found.wait = min(MOST_PROBE_AFTER, found.wait * 2) if again else PROBE_AFTER
                found.probe_at = self.clock() + found.wait
                found.recovering = int(found.limit) if beside is None else max(0, beside)
                found.ceiling = found.halved_from = int(found.limit)
                found.starting = False
                if found.limit < 2 and result.status in OVERLOADED:
                    if not found.up:
                        # Refused at one by a host that has answered nothing
                        # else: down, or busy with another deliverer. It is
                        # sent its next one no sooner than REST from now, as
                        # long each time: its retries and its breaker are
                        # the operator's, and left to run as set.
                        self._resting[host] = self.clock() + REST
                    else:
                        # Refused at one, which cannot be halved, by a host
                        # that has given another answer (busy, not down): it
                        # rests, and is not sent two at once for PROBE_AFTER
                        # from now, however many refusals came before (after
                        # an outage's many, 30 s, not the hour a doubled
                        # wait would reach).
                        found.ceiling = 2
                        found.wait = PROBE_AFTER
                        found.probe_at = self.clock() + found.wait
                        found.rest = min(MOST_REST, found.rest * 2) if found.rest else REST
                        self._resting[host] = self.clock() + found.rest
                found.limit = max(1.0, found.limit / 2)
            if asked and result.status in OVERLOADED:
                # Asked of the host, not of this delivery alone (which waits
                # all it asked): nothing else is sent it meanwhile, but one
                # request every MOST_REST at most, however long it asked.
                until = self.clock() + min(asked, MOST_REST)
                if until > self._resting.get(host, 0.0):
                    self._resting[host] = until
            return
        if found.rest:
            found.rest = found.rest / 2 if found.rest >= 2 * REST else 0.0
        if not found.recovering:
            if found.ceiling is not None and int(found.limit) >= found.ceiling:
                found.ceiling = None  # reached again, and answering well
            if found.ceiling is None and int(found.limit) >= self.start:
                found.refused = False
            grown = min(
                float(self.most), found.limit + (1.0 if found.starting else 1 / found.limit)
            )
            if (
                found.ceiling is not None
                and grown >= found.ceiling
                and self.clock() < found.probe_at
            ):
                grown = max(found.limit, found.ceiling - 1.0)  # not yet: one below it
            found.limit = grown
