"""What a kind of destination asks of the queue: its :class:`Policy`.

Every built-in webhook kind takes the ``WEBHOOK_*`` settings
(:meth:`Policy.for_webhooks`); a kind of the host project's may answer
differently in its :meth:`~django_federation_delivery.channels.Channel.policy`,
say a shorter schedule for a pager, or no order for a notification feed.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Final

from django_federation_delivery.retry import DAY_SCHEDULE, LONGEST_WAIT, RetryPolicy
from django_federation_delivery.transport.networks import IPNetwork, network

__all__ = ["LANES", "Policy", "PolicyError", "is_wait"]

#: The lanes a policy may name, claimed in this order (``models.Lane``).
LANES: Final = ("webhook", "priority", "normal", "low")


class PolicyError(ValueError):
    """A policy the queue cannot follow, said in the package's own words,
    which name the bad value: what ``manage.py check`` shows (E036). Any
    other error a kind's ``policy()`` raises is named by its type alone."""


@dataclasses.dataclass(frozen=True)
class Policy:
    """How deliveries to one kind of destination are queued, tried and retried."""

    #: The waits between tries: one try more than waits.
    schedule: tuple[float, ...] = DAY_SCHEDULE
    #: Each wait up to this fraction shorter, at random, so that deliveries
    #: failed together are not all tried again together.
    jitter: float = 0.0
    #: The longest a receiver's ``Retry-After`` is taken at its word, unless
    #: the schedule's own wait is longer.
    retry_after_max: float = 3600.0
    #: One request, from connecting to the end of the answer.
    timeout: float = 10.0
    #: The non-public networks its destinations may be on: each as text
    #: (``"127.0.0.0/8"``), as ``WEBHOOK_ALLOWED_NETWORKS`` takes them, or an
    #: ``ipaddress`` network; kept as networks.
    allowed_networks: tuple[IPNetwork, ...] = ()
    #: The largest event it is sent, as JSON; a larger one is refused by
    #: ``send_webhook`` with nothing written.
    max_bytes: int = 1 << 20
    #: The lane its events are claimed from (one of :data:`LANES`).
    lane: str = "webhook"
    #: Whether each destination receives its events one at a time, oldest
    #: first (a failing one holding the later ones back), or each as soon as
    #: it can (a feed of notifications, where a late one is worth less than
    #: the next on time).
    ordered: bool = True

    def __post_init__(self) -> None:
        """A policy the queue cannot follow is refused as it is made, naming
        the bad value (``manage.py check`` reports it, E036)."""
        if self.lane not in LANES:
            raise PolicyError(f"its lane is one of {', '.join(LANES)}, not {self.lane!r}")
        if not isinstance(self.schedule, tuple) or not all(map(is_wait, self.schedule)):
            raise PolicyError(
                f"its schedule is a tuple of waits in seconds, each above 0 and at most "
                f"{LONGEST_WAIT:g}, not {self.schedule!r}"
            )
        if not (is_wait(self.jitter) or self.jitter == 0) or self.jitter >= 1:
            raise PolicyError(f"its jitter is a fraction from 0 to below 1, not {self.jitter!r}")
        if not is_wait(self.timeout):
            raise PolicyError(
                f"its timeout is a number of seconds above 0 and at most {LONGEST_WAIT:g}, "
                f"not {self.timeout!r}"
            )
        # Any longer is taken as the longest: no wait is ever longer (retry.py).
        if not _number(self.retry_after_max) or not self.retry_after_max > 0:
            raise PolicyError(
                f"its retry_after_max is a number of seconds above 0, not {self.retry_after_max!r}"
            )
        # Written as WEBHOOK_ALLOWED_NETWORKS writes them, text, or as
        # networks: kept as networks, read by the transport.
        networks: Any = self.allowed_networks
        try:
            if not isinstance(networks, tuple | list):
                raise TypeError(type(networks).__name__)
            object.__setattr__(self, "allowed_networks", tuple(map(network, networks)))
        except (TypeError, ValueError):
            raise PolicyError(
                f"its allowed_networks is a tuple of networks such as '127.0.0.0/8', "
                f"not {networks!r}"
            ) from None
        if not isinstance(self.ordered, bool):
            raise PolicyError(f"its ordered is True or False, not {self.ordered!r}")
        if not isinstance(self.max_bytes, int) or isinstance(self.max_bytes, bool):
            raise PolicyError(f"its max_bytes is a whole number, not {self.max_bytes!r}")
        if self.max_bytes < 1:
            raise PolicyError(f"its max_bytes is at least 1, not {self.max_bytes!r}")

    @property
    def retry(self) -> RetryPolicy:
        """Its schedule and jitter, as the settler follows them."""
        return RetryPolicy(schedule=self.schedule, jitter=self.jitter)

    @classmethod
    def for_webhooks(cls) -> Policy:
        """As the ``WEBHOOK_*`` settings say: every built-in kind's policy."""
        from django_federation_delivery.conf import app_settings

        return cls(
            schedule=tuple(app_settings.webhook_retry),
            retry_after_max=app_settings.webhook_retry_after_max,
            timeout=app_settings.webhook_timeout,
            allowed_networks=app_settings.allowed_networks("WEBHOOK_ALLOWED_NETWORKS"),
            max_bytes=app_settings.webhook_max_bytes,
        )


def is_wait(value: Any) -> bool:
    """Whether ``value`` is a wait the queue can keep: seconds above 0 and at
    most ``LONGEST_WAIT``."""
    # inf and nan are floats too: a wait of either overflows a datetime. The
    # bounds come first: an int is compared exactly, however large, where
    # math.isfinite() would convert it to a float (OverflowError for 10**400).
    return _number(value) and 0 < value <= LONGEST_WAIT and math.isfinite(value)


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
