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


class KeyCache:
    """``SENDER_KEYS`` answers, each kept for ``KEY_CACHE_SECONDS``."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._keys: dict[str, tuple[float, SenderKey | None]] = {}

    def get(self, sender: str) -> SenderKey | None:
        """The sender's key, or None when there is no such sender.

        Whatever the provider raises is raised: a key store that is away for
        a moment does not make the delivery wrong.
        """
        now = self._clock()
        with self._lock:
            cached = self._keys.get(sender)
        if cached is not None and cached[0] > now:
            return cached[1]
        provider = app_settings.callable_setting("SENDER_KEYS")
        if provider is None:
            return None
        key = provider(sender)
        if key is not None and not isinstance(key, SenderKey):
            raise TypeError(
                f"SENDER_KEYS returned {type(key).__name__} for {sender!r}; "
                "it must return a SenderKey or None"
            )
        ttl = app_settings.key_cache_seconds
        with self._lock:
            if len(self._keys) > 10_000:
                self._keys.clear()
            self._keys[sender] = (now + ttl, key)
        return key

    def clear(self) -> None:
        with self._lock:
            self._keys.clear()
