"""What a deliverer sees of each host it sends to, written every few seconds
for the host's picture (the admin's host page, ``delivery_status --host``).

For each host: its answer times (the last ``SAMPLES``, whose median and 95th
percentile are written), when a delivery to it was last accepted, the last
error an attempt met, the limit it is sent at now and until when it rests
(``limits.py``). Kept in the loop's memory and written together, one
statement for every host seen since the last write, every ``WRITE_EVERY``
seconds: never a write a delivery.

A deliverer may send to tens of thousands of hosts, so what it keeps of one
is small and bounded: its answer times are 4-byte floats in an array of at
most ``SAMPLES`` (800 bytes), overwritten oldest first once full. Kept as
Python floats in a deque, they took some 6 KB a host once full, and the
deliverer of ``benchmarks/pg_scale.py rss`` (10,000 hosts) grew by 9.5 MB
from its 10,000th delivery to its 30,000th.
"""

from __future__ import annotations

import array
import dataclasses
import datetime as dt
import statistics
import time

from django_federation_delivery.attempt import AttemptResult
from django_federation_delivery.limits import HostLimits
from django_federation_delivery.store.hosts import SeenHost, record_hosts

__all__ = ["HostStats"]

#: Answer times kept a host.
SAMPLES = 200
#: How often what was seen is written.
WRITE_EVERY = 10.0
#: Hosts kept, their answer times with them: past it, the one seen least
#: lately is forgotten, once written (a host new since the last write
#: waits for the next, when all are new).
MOST_HOSTS = 20_000
#: The longest error kept.
ERROR_LENGTH = 400


@dataclasses.dataclass(slots=True)
class _Seen:
    #: The last SAMPLES answer times, in seconds, in no order once full.
    answers: array.array[float] = dataclasses.field(default_factory=lambda: array.array("f"))
    #: Where the next answer time goes once SAMPLES are kept: over the oldest.
    oldest: int = 0
    #: When this deliverer first saw it answer, or not answer.
    first_at: dt.datetime | None = None
    delivered_at: dt.datetime | None = None
    error: str = ""
    error_at: dt.datetime | None = None
    #: Seen since the last write.
    fresh: bool = True

    def answered(self, seconds: float) -> None:
        if len(self.answers) < SAMPLES:
            self.answers.append(seconds)
        else:
            self.answers[self.oldest] = seconds
            self.oldest = (self.oldest + 1) % SAMPLES


class HostStats:
    """One deliverer's view of each host, told each attempt by the loop."""

    def __init__(self, limits: HostLimits) -> None:
        #: The limit each host is sent at now, and its rest.
        self.limits = limits
        self._hosts: dict[str, _Seen] = {}
        self._written = time.monotonic()

    def learn(self, host: str, result: AttemptResult, now: dt.datetime) -> None:
        """What an attempt at ``host`` came to."""
        if not result.requests:
            return  # no request (held by a breaker, say): nothing seen
        # Kept in the order last seen: the first is the one seen least lately.
        seen = self._hosts.pop(host, None)
        if seen is None:
            if len(self._hosts) >= MOST_HOSTS and not self._forget_one():
                return
            # Seen when its first request went out: ``now`` is when the
            # attempt came back, up to its time limit later.
            began = now - dt.timedelta(seconds=max(0.0, result.duration))
            seen = _Seen(first_at=began)
        self._hosts[host] = seen
        seen.fresh = True
        if result.status is not None:
            seen.answered(result.duration)
        if result.delivered:
            seen.delivered_at = now
        elif result.error:
            seen.error = result.error[:ERROR_LENGTH]
            seen.error_at = now

    def _forget_one(self) -> bool:
        """Forget the host seen least lately, if it was written since:
        whether one was."""
        host, seen = next(iter(self._hosts.items()))
        if seen.fresh:
            return False
        del self._hosts[host]
        return True

    def due(self) -> bool:
        return time.monotonic() - self._written >= WRITE_EVERY

    def write(self, *, now: dt.datetime, using: str | None = None) -> int:
        """Write what was seen of each host since the last write. Returns how
        many hosts; what fails to be written is written next time."""
        self._written = time.monotonic()
        fresh = [(host, seen) for host, seen in self._hosts.items() if seen.fresh]
        if not fresh:
            return 0
        rows = [self._row(host, seen, now) for host, seen in fresh]
        written = record_hosts(rows, now=now, using=using)
        for _, seen in fresh:
            seen.fresh = False
        return written

    def _row(self, host: str, seen: _Seen, now: dt.datetime) -> SeenHost:
        p50 = p95 = None
        rest = self.limits.rest_left(host)
        if seen.answers:
            ms = sorted(seconds * 1000 for seconds in seen.answers)
            p50 = statistics.median(ms)
            p95 = ms[min(len(ms) - 1, round(0.95 * (len(ms) - 1)))]
        return SeenHost(
            name=host,
            first_seen_at=seen.first_at,
            last_delivered_at=seen.delivered_at,
            last_error=seen.error,
            last_error_at=seen.error_at,
            answer_p50_ms=p50,
            answer_p95_ms=p95,
            concurrency_limit=self.limits.limit(host),
            resting_until=now + dt.timedelta(seconds=rest) if rest else None,
        )
