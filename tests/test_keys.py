from __future__ import annotations

from typing import Any

import pytest

from django_federation_delivery import send
from django_federation_delivery.keys import KeyCache
from django_federation_delivery.models import Batch, Delivery

from . import keys
from .keys import ALICE


def test_a_key_is_asked_for_once_and_kept_briefly() -> None:
    now = [0.0]
    cache = KeyCache(clock=lambda: now[0])
    keys.calls.clear()
    first = cache.get(ALICE)
    assert cache.get(ALICE) is first
    assert keys.calls == [ALICE]
    now[0] += 61
    cache.get(ALICE)
    assert keys.calls == [ALICE, ALICE], "asked again after KEY_CACHE_SECONDS"


def test_no_such_sender_is_none_and_a_wrong_answer_is_an_error(settings: Any) -> None:
    assert KeyCache().get("https://nobody.example/actor") is None
    settings.FEDERATION_DELIVERY = {**settings.FEDERATION_DELIVERY, "SENDER_KEYS": lambda s: "pem"}
    with pytest.raises(TypeError, match="SenderKey or None"):
        KeyCache().get(ALICE)


@pytest.mark.django_db
def test_sending_never_asks_for_or_stores_a_private_key() -> None:
    keys.calls.clear()
    send(ALICE, {"type": "Note"}, ["https://a.example/inbox"])
    assert keys.calls == []
    stored = " ".join(str(v) for row in Batch.objects.values() for v in row.values())
    stored += " ".join(str(v) for row in Delivery.objects.values() for v in row.values())
    assert "PRIVATE KEY" not in stored
