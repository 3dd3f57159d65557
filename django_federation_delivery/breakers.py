"""Circuit breakers: holding back deliveries to a destination that keeps failing.

After ``threshold`` failures in a row a destination's breaker opens, and its
deliveries are held — retried as failures, without a request — until
``cool_off`` has passed. Then one delivery at a time goes through as a probe
while the others are held; the probe's success closes the breaker, its
failure opens it for another cool-off, and a probe that never reports back
stops being one after the cool-off.

The decisions here are plain functions of a breaker's state and the time;
:class:`BreakerView` keeps what the database holds in memory, refreshed about
once a second, so that admitting a delivery to a healthy destination costs no
query. The database side is in ``queue.py``.
"""

from __future__ import annotations

import collections
import dataclasses
import datetime as dt
import enum
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from django_federation_delivery.models import Breaker


class Scope(enum.StrEnum):
    #: One breaker per host: a server that is down fails every inbox on it.
    HOST = "host"
    #: One per inbox, as Mastodon keeps them.
    INBOX = "inbox"


@dataclasses.dataclass(frozen=True)
class BreakerSettings:
    threshold: int = 10
    cool_off: float = 60.0
    scope: Scope = Scope.HOST

    def key(self, host: str, inbox: str) -> str:
        return host if self.scope is Scope.HOST else inbox


@dataclasses.dataclass(frozen=True)
class State:
    """A destination's breaker as last read: no row means closed and healthy."""

    failures: int
    open_until: dt.datetime | None
    probe_until: dt.datetime | None


class Decision(enum.Enum):
    PASS = "pass"
    #: Cool-off over and no probe under way: this delivery may try to take the probe.
    PROBE = "probe"
    HOLD = "hold"


def admit(state: State | None, now: dt.datetime) -> tuple[Decision, float]:
    """Whether a delivery may be sent now, and if held, for about how long."""
    if state is None or state.open_until is None:
        return Decision.PASS, 0.0
    if now < state.open_until:
        return Decision.HOLD, (state.open_until - now).total_seconds()
    if state.probe_until is not None and now < state.probe_until:
        return Decision.HOLD, (state.probe_until - now).total_seconds()
    return Decision.PROBE, 0.0


class BreakerView:
    """The breakers the database holds, as of the last refresh."""

    def __init__(self) -> None:
        self._states: dict[str, State] = {}

    def refresh(self, breakers: Iterable[Breaker]) -> None:
        self._states = {
            breaker.key: State(breaker.failures, breaker.open_until, breaker.probe_until)
            for breaker in breakers
        }

    def get(self, key: str) -> State | None:
        return self._states.get(key)

    def set(self, key: str, state: State | None) -> None:
        if state is None:
            self._states.pop(key, None)
        else:
            self._states[key] = state

    def __len__(self) -> int:
        return len(self._states)


class Breakers:
    """The coordinator's breakers: admission answered from memory, outcomes
    written to the database a batch at a time.

    The database is the truth every process shares; this view of it is
    refreshed about once a second, and updated at once with what this process
    learns, so that it holds back a failing destination without waiting.
    """

    def __init__(self, settings: BreakerSettings, *, using: str | None = None) -> None:
        self.settings = settings
        self.using = using
        self.view = BreakerView()
        self._failures: collections.Counter[str] = collections.Counter()
        self._successes: set[str] = set()
        self._probes: list[tuple[str, str, bool]] = []

    def refresh(self) -> None:
        from django_federation_delivery import queue

        forget = max(2 * self.settings.cool_off, 600.0)
        self.view.refresh(queue.breakers(forget_after=forget, using=self.using))

    def admit(self, key: str, now: dt.datetime) -> tuple[Decision, str, float]:
        """(decision, probe token, seconds to hold). Taking the probe is one
        atomic statement in the database: one probe among all processes."""
        from django_federation_delivery import queue

        decision, held = admit(self.view.get(key), now)
        if decision is not Decision.PROBE:
            return decision, "", held
        cool_off = self.settings.cool_off
        token = queue.take_probe(key, cool_off=cool_off, using=self.using)
        state = self.view.get(key)
        until = now + dt.timedelta(seconds=cool_off)
        self.view.set(key, State(0, state.open_until if state else now, until))
        if token is None:
            return Decision.HOLD, "", cool_off
        return Decision.PROBE, token, 0.0

    def record(self, key: str, *, failed: bool, probe: str, now: dt.datetime) -> None:
        """Note how a delivery that was let through went."""
        state = self.view.get(key)
        if probe:
            self._probes.append((key, probe, failed))
            reopened = State(0, now + dt.timedelta(seconds=self.settings.cool_off), None)
            self.view.set(key, reopened if failed else None)
        elif failed:
            self._failures[key] += 1
            failures = (state.failures if state else 0) + 1
            open_until = state.open_until if state else None
            if open_until is None and failures >= self.settings.threshold:
                open_until = now + dt.timedelta(seconds=self.settings.cool_off)
            self.view.set(key, State(failures, open_until, state.probe_until if state else None))
        elif state is not None and state.open_until is None:
            # The healthy path writes only when there was a count to forget.
            self._successes.add(key)
            self.view.set(key, None)

    def flush(self) -> int:
        """Write what was noted; kept for the next flush if this one fails."""
        from django_federation_delivery import queue

        written = len(self._failures) + len(self._successes) + len(self._probes)
        if not written:
            return 0
        settings = self.settings
        standing = queue.record_failures(
            self._failures,
            threshold=settings.threshold,
            cool_off=settings.cool_off,
            using=self.using,
        )
        self._failures = collections.Counter()
        # What every process counted together, so that this one holds back as
        # soon as the breaker opens, not at its next refresh.
        for key, (failures, open_until) in standing.items():
            state = self.view.get(key)
            probe_until = state.probe_until if state else None
            self.view.set(key, State(failures, open_until, probe_until))
        queue.record_successes(self._successes, using=self.using)
        self._successes = set()
        while self._probes:
            key, token, failed = self._probes[0]
            queue.record_probe(
                key, token, failed=failed, cool_off=settings.cool_off, using=self.using
            )
            self._probes.pop(0)
        return written
