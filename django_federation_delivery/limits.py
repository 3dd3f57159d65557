"""How many deliveries each host is sent at once: a limit that adapts.

A host starts at ``PER_HOST`` and moves between 1 and ``PER_HOST_MAX`` as
it answers: up by one for each round of answers that came back well (one
more for every *limit* answers, as TCP's congestion window grows), halved
at a sign of overload: a ``429`` or ``503``, no answer at all (a timeout, a
refused connection), or an answer far slower than the host's own fastest
lately. A big instance that answers in 20 ms soon takes many at once; a
small one that slows down or sheds load is sent fewer, without a setting
changed. Halving happens at most once a round: the answers to requests
already in flight when the limit fell do not halve it again.

Only the loop's thread reads and changes it; it is the loop's memory, lost
with it, and each host starts over at ``PER_HOST`` in a new run.
"""

from __future__ import annotations

import dataclasses

from django_federation_delivery.attempt import AttemptResult

__all__ = ["OVERLOADED", "SLOWER", "HostLimits"]

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
#: Hosts remembered; past it the ones seen longest ago are forgotten.
MOST_HOSTS = 10_000


@dataclasses.dataclass
class _Host:
    limit: float
    #: Its fastest answer lately, in seconds; None until it answered.
    fastest: float | None = None
    #: Answers to wait for before it may be halved again: those to requests
    #: that were in flight when it last was.
    recovering: int = 0


class HostLimits:
    """Each host's limit of deliveries at once, from ``start``, between 1 and
    ``most``. With ``most`` at ``start`` or below it never grows."""

    def __init__(self, start: int, most: int) -> None:
        self.start = max(1, start)
        self.most = max(1, most)
        self._hosts: dict[str, _Host] = {}

    def limit(self, host: str) -> int:
        """How many deliveries ``host`` may have in flight now."""
        found = self._hosts.get(host)
        if found is None:
            return min(self.start, self.most)
        return int(found.limit)

    def learn(self, host: str, result: AttemptResult) -> None:
        """What an attempt at ``host`` says of its load."""
        if result.held or not result.requests:
            return  # no request: nothing said
        found = self._hosts.get(host)
        if found is None:
            if len(self._hosts) >= MOST_HOSTS:
                del self._hosts[next(iter(self._hosts))]
            found = self._hosts[host] = _Host(float(min(self.start, self.most)))
        else:
            # Seen again: the last to be forgotten.
            self._hosts[host] = self._hosts.pop(host)
        seconds = result.duration
        answered = result.status is not None
        slow = answered and found.fastest is not None and seconds > SLOWER * found.fastest + NOISE
        if answered and result.status not in OVERLOADED:
            found.fastest = (
                seconds if found.fastest is None else min(seconds, found.fastest * (1 + FORGET))
            )
        if found.recovering:
            found.recovering -= 1
        if not answered or result.status in OVERLOADED or slow:
            if not found.recovering:
                found.recovering = int(found.limit)
                found.limit = max(1.0, found.limit / 2)
            return
        if not found.recovering:
            found.limit = min(float(self.most), found.limit + 1 / found.limit)
