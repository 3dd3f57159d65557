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


def counts_as_failure(status: int | None, permanent: bool) -> bool:
    """A 5xx, 408, 429 or no answer counts; an answer that will not change is
    the server working."""
    return not permanent


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
