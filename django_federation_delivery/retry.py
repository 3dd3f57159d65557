"""Retry policies: plain functions of attempts and time, no database, no socket."""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Callable, Mapping, Sequence
from typing import Any

#: The waits of the fixed schedule a webhook sender typically wants: nine
#: tries across about a day.
DAY_SCHEDULE = (30.0, 120.0, 600.0, 1800.0, 3600.0, 10800.0, 21600.0, 43200.0)
#: No wait is ever longer, whatever the settings or an inbox say: 30 days.
#: The checks hold RETRY_AFTER_MAX and the policy's waits to it as well.
LONGEST_WAIT = 30 * 24 * 3600.0


def jitter(
    seconds: float, fraction: float = 0.25, rand: Callable[[], float] = random.random
) -> float:
    """``seconds``, up to ``fraction`` shorter at random, so that many waits
    started together do not all end together."""
    return seconds * (1.0 - fraction * rand())


@dataclasses.dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff with jitter, or a fixed schedule of waits."""

    base: float = 30.0
    cap: float = 3600.0
    attempts: int = 12
    jitter: float = 0.25
    #: Waits in seconds, one per retry; when given, it replaces the backoff
    #: and allows ``len(schedule) + 1`` tries in all, each wait up to
    #: ``jitter`` shorter (a fixed schedule is usually given none).
    schedule: tuple[float, ...] | None = None

    @classmethod
    def from_setting(cls, value: Mapping[str, Any]) -> RetryPolicy:
        schedule: Sequence[float] | None = value.get("SCHEDULE")
        return cls(
            base=float(value["BASE"]),
            cap=float(value["CAP"]),
            attempts=int(value["ATTEMPTS"]),
            # A schedule written out is waited as written.
            jitter=float(value["JITTER"]) if schedule is None else 0.0,
            schedule=tuple(float(wait) for wait in schedule) if schedule is not None else None,
        )

    @property
    def waits(self) -> tuple[float, ...]:
        """Its waits before each retry, before jitter: the schedule, or the
        backoff written out."""
        if self.schedule is not None:
            return self.schedule
        return tuple(
            min(self.cap, self.base * 2.0 ** min(made - 1, 1023))
            for made in range(1, self.attempts)
        )

    @property
    def max_attempts(self) -> int:
        return len(self.schedule) + 1 if self.schedule is not None else self.attempts

    def delay(self, made: int, rand: Callable[[], float] = random.random) -> float | None:
        """The wait before the next try once ``made`` tries have failed, or
        None when the policy has no try left."""
        if made >= self.max_attempts:
            return None
        if self.schedule is not None:
            wait = self.schedule[made - 1]
        else:
            # 2.0 ** 1024 raises OverflowError; by then every wait is the cap.
            wait = min(self.cap, self.base * 2.0 ** min(made - 1, 1023))
        return jitter(wait, self.jitter, rand) if self.jitter else wait


def wait_before_retry(
    policy_wait: float, retry_after: float | None, *, wait_as_asked: bool, longest: float
) -> float:
    """The policy's wait, or longer when the inbox asked for longer, but never
    longer than ``longest`` on the inbox's word alone, nor than
    :data:`LONGEST_WAIT` at all: what comes back is always a finite number of
    seconds that a datetime can be moved by."""
    wait = policy_wait
    if retry_after is not None and wait_as_asked and math.isfinite(retry_after):
        wait = max(policy_wait, min(retry_after, longest))
    return bounded(wait)


def bounded(seconds: float) -> float:
    """``seconds`` within 0 and :data:`LONGEST_WAIT`; what is not a number
    waits the longest rather than not at all."""
    if math.isnan(seconds):
        return LONGEST_WAIT
    return min(max(seconds, 0.0), LONGEST_WAIT)
