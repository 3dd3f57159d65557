"""What each setting may be: the bounds, and the tests of a value against them."""

from __future__ import annotations

import math
from typing import Any, TypeGuard

from django.utils.translation import gettext as _
from django.utils.translation import ngettext

from django_federation_delivery.conf import DEFAULTS
from django_federation_delivery.retry import LONGEST_WAIT

PREFIX = "federation_delivery"


#: Whole-number settings: the least and the most each may be. The most is
#: far past any real need, and keeps a typo from starving the machine.
WHOLE_NUMBERS: dict[str, tuple[int, int]] = {
    "CLAIM_SIZE": (1, 10_000),
    "CONCURRENCY": (1, 1_000),
    "PER_HOST": (1, 1_000),
    "PER_HOST_MAX": (1, 1_000),
    "SLOW_CONCURRENCY": (0, 10_000),
    # Enough of any answer to say whether it took the request (a Bot API
    # answer cut before its "ok": true would be a message sent again).
    "MAX_ANSWER_BYTES": (1024, 64 << 20),
    "ERROR_LENGTH": (1, 100_000),
    "CONNECTIONS_PER_HOST": (1, 1_000),
    # 0: no keep-alive at all.
    "MAX_IDLE_CONNECTIONS": (0, 10_000),
    "MAX_INBOXES": (1, 10_000_000),
    "MAX_BODY_BYTES": (1, 16 << 20),
    "WEBHOOK_MAX_BYTES": (1, 16 << 20),
}
HOUR = 3600.0
DAY = 24 * HOUR
#: Of those, the ones None leaves to follow another setting.
WHOLE_NUMBERS_OR_NONE = frozenset({"CONNECTIONS_PER_HOST"})
#: Settings in seconds: each above 0, finite, and at most this.
SECONDS: dict[str, float] = {
    "KEY_CACHE_SECONDS": DAY,
    "RETRY_AFTER_MAX": LONGEST_WAIT,
    "LEASE_SECONDS": DAY,
    "IDLE_POLL_SECONDS": HOUR,
    "NEW_WORK_POLL_SECONDS": 60.0,
    "SLOW_AFTER_SECONDS": HOUR,
    "CONNECT_TIMEOUT": 600.0,
    "ATTEMPT_TIMEOUT": HOUR,
    "IDLE_CONNECTION_SECONDS": HOUR,
    "WEBHOOK_DISABLE_AFTER": 365 * DAY,
    "HOST_FAILING_AFTER": 365 * DAY,
    "HOST_UNAVAILABLE_AFTER": 365 * DAY,
}
#: Of those, the ones None turns off.
SECONDS_OR_NONE = frozenset({"HOST_UNAVAILABLE_AFTER"})
#: The settings naming a callable, each with the arguments the package
#: calls it with, in order (the README's settings table).
CALLABLES: dict[str, tuple[str, ...]] = {
    "SENDER_KEYS": ("sender",),
    "SENDER_GONE": ("sender",),
    "PERMANENT_STATUS": ("status",),
    "SKIP_IF": ("inbox", "activity"),
    "COLLECTION_SYNCHRONIZATION": ("sender", "inbox"),
}
#: The longest RETENTION of a status: past it, None (for ever) says it better.
LONGEST_RETENTION = 100 * 365 * DAY
#: HEARTBEAT_SECONDS: more often is a write a second for nothing; less, a
#: dead deliverer unnoticed for half an hour.
HEARTBEAT_RANGE = (1.0, 600.0)
MOST_ATTEMPTS = 10_000
MOST_THRESHOLD = 1_000_000
USER_AGENT_LENGTH = 500


def default_hint(name: str) -> str:
    return _("Leave it out for the default, %(default)r.") % {"default": DEFAULTS[name]}


def is_whole(value: Any, least: int, most: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and least <= value <= most


def is_seconds(value: object, longest: float) -> TypeGuard[float]:
    # inf and nan are floats too: a wait of either overflows a datetime. The
    # bounds come first: an int is compared exactly, however large, where
    # math.isfinite() would convert it to a float (OverflowError for 10**400).
    return (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and 0 < value <= longest
        and math.isfinite(value)
    )


def unknown_keys(unknown: list[Any]) -> str:
    return ngettext("unknown key %(keys)s", "unknown keys %(keys)s", len(unknown)) % {
        "keys": ", ".join(map(repr, unknown))
    }
