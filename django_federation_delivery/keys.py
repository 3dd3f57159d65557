"""Senders' keys, asked of the host project and kept in memory briefly.

No private key is ever written to the queue: the deliverer asks the callable
named by ``SENDER_KEYS`` when it sends.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from django_federation_delivery.conf import app_settings
from django_federation_delivery.signatures import SenderKey

#: How long a lookup that raised is not made again (``KEY_CACHE_SECONDS``,
#: if shorter): a key store that fails slowly is asked once in that time
#: for a sender, not once for each of its deliveries in a claim.
FAILURE_SECONDS = 5.0


class NotAKey(TypeError):
    """``SENDER_KEYS`` answered something that is neither a key nor None."""


class LookupFailedLately(Exception):
    """The lookup of this sender's key raised a moment ago: not made again
    yet. ``reason`` is what :func:`failure_reason` said of it."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def failure_reason(exc: BaseException) -> str:
    """What a failed lookup came to, safe to show and keep: the name of what
    the key store raised (its message may hold anything), or what was wrong
    with its answer."""
    if isinstance(exc, LookupFailedLately | NotAKey):
        return str(exc)
    return type(exc).__name__


class KeyCache:
    """``SENDER_KEYS`` answers, each kept for ``KEY_CACHE_SECONDS``; a
    failure, for :data:`FAILURE_SECONDS`."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._keys: dict[str, tuple[float, SenderKey | LookupFailedLately | None]] = {}

    def get(self, sender: str) -> SenderKey | None:
        """The sender's key, or None when there is no such sender.

        Whatever the provider raises is raised: a key store that is away for
        a moment does not make the delivery wrong. Asked again within
        :data:`FAILURE_SECONDS`, :class:`LookupFailedLately` is raised
        instead, with the reason.
        """
        now = self._clock()
        with self._lock:
            cached = self._keys.get(sender)
        if cached is not None and cached[0] > now:
            if isinstance(cached[1], LookupFailedLately):
                raise LookupFailedLately(cached[1].reason)
            return cached[1]
        provider = app_settings.callable_setting("SENDER_KEYS")
        if provider is None:
            return None
        ttl = app_settings.key_cache_seconds
        try:
            key = provider(sender)
            if key is not None and not isinstance(key, SenderKey):
                raise NotAKey(
                    f"SENDER_KEYS returned {type(key).__name__}; it must return a SenderKey or None"
                )
        except Exception as exc:
            # From its end: a lookup that fails slowly is not made again at once.
            until = self._clock() + min(ttl, FAILURE_SECONDS)
            self._keep(sender, until, LookupFailedLately(failure_reason(exc)))
            raise
        self._keep(sender, now + ttl, key)
        return key

    def _keep(
        self, sender: str, until: float, answer: SenderKey | LookupFailedLately | None
    ) -> None:
        with self._lock:
            if len(self._keys) > 10_000:
                self._keys.clear()
            self._keys[sender] = (until, answer)

    def clear(self) -> None:
        with self._lock:
            self._keys.clear()
