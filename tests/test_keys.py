from __future__ import annotations

import datetime as dt
import time
from collections.abc import Callable
from typing import Any

import pytest
from django.utils import timezone

from django_federation_delivery import send
from django_federation_delivery.keys import FAILURE_SECONDS, KeyCache, LookupFailedLately
from django_federation_delivery.models import Batch, Breaker, Delivery, Status
from django_federation_delivery.signatures import SenderKey

from . import keys
from .conftest import Inbox, RunningDeliverer, wait_until
from .keys import ALICE, rsa_key


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


def test_a_lookup_that_raised_is_not_made_again_for_a_few_seconds(settings: Any) -> None:
    asked: list[str] = []

    def away(sender: str) -> None:
        asked.append(sender)
        raise ConnectionError("the vault at 10.0.0.5 refused")

    settings.FEDERATION_DELIVERY = {**settings.FEDERATION_DELIVERY, "SENDER_KEYS": away}
    now = [0.0]
    cache = KeyCache(clock=lambda: now[0])
    with pytest.raises(ConnectionError):
        cache.get(ALICE)
    now[0] += FAILURE_SECONDS - 0.1
    with pytest.raises(LookupFailedLately, match=r"^ConnectionError$"):
        cache.get(ALICE)
    assert asked == [ALICE]
    now[0] += 0.2
    with pytest.raises(ConnectionError):
        cache.get(ALICE)
    assert asked == [ALICE, ALICE], "asked again once the few seconds are over"


# What a key store gets wrong fails its sender's deliveries alone.

NOTE = {"type": "Create", "actor": ALICE}
GARBLED = "https://social.example/users/garbled"
KEYLESS = "https://nobody.example/actor"


def _with_keys(settings: Any, provider: Callable[[str], SenderKey | None], **more: Any) -> None:
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "SENDER_KEYS": provider,
        "NEW_WORK_POLL_SECONDS": 0.05,
        **more,
    }


def half_open(host: str) -> None:
    """The host's breaker opened a while ago and its cool-off is over."""
    Breaker.objects.create(
        key=host, failures=5, open_until=timezone.now() - dt.timedelta(seconds=1)
    )


def garbled_keys(sender: str) -> SenderKey | None:
    # A key store that hands back the key id as it is stored, in bytes.
    if sender == GARBLED:
        return SenderKey(f"{GARBLED}#main-key".encode(), rsa_key())  # type: ignore[arg-type]
    if sender == ALICE:
        return SenderKey(f"{ALICE}#main-key", rsa_key())
    return None


@pytest.mark.django_db(transaction=True)
def test_a_key_whose_id_is_not_text_refuses_its_delivery_with_a_clear_error(
    inbox: Inbox, start_deliverer: Callable[..., RunningDeliverer], settings: Any
) -> None:
    _with_keys(settings, garbled_keys)
    send(GARBLED, NOTE, [inbox.url()])
    runner = start_deliverer()
    wait_until(lambda: Delivery.objects.filter(attempts__gte=1).exclude(last_error="").exists())
    runner.stop()
    row = Delivery.objects.get()
    assert inbox.received == [], "nothing is sent"
    assert "key id" in row.last_error, f"a clear error, not {row.last_error!r}"
    assert row.status == Status.REFUSED, "refused for good, as any key id that cannot be signed"


@pytest.mark.django_db(transaction=True)
def test_a_key_whose_id_is_not_text_charges_the_inbox_host_nothing(
    inbox: Inbox, start_deliverer: Callable[..., RunningDeliverer], settings: Any
) -> None:
    # A breaker that opens at the second failure: the garbled sender's two
    # deliveries, which make no request, must not open it for everyone.
    _with_keys(
        settings,
        garbled_keys,
        BREAKER={"THRESHOLD": 2, "COOL_OFF": 60.0, "SCOPE": "host"},
        RETRY={"BASE": 60, "CAP": 60, "ATTEMPTS": 5, "JITTER": 0},
    )
    send(GARBLED, NOTE, [inbox.url("/1"), inbox.url("/2"), inbox.url("/3")])
    runner = start_deliverer()
    wait_until(lambda: Delivery.objects.filter(attempts__gte=1).count() == 3)
    send(ALICE, NOTE, [inbox.url("/alice")])
    try:
        wait_until(
            lambda: (
                Delivery.objects.filter(status=Status.DELIVERED).exists()
                or Delivery.objects.filter(inbox=inbox.url("/alice"), attempts__gte=1).exists()
            ),
            timeout=10,
        )
    finally:
        runner.stop()
    alice = Delivery.objects.get(inbox=inbox.url("/alice"))
    assert not Breaker.objects.filter(open_until__isnull=False).exists(), (
        f"no breaker opened by deliveries that made no request: "
        f"{list(Breaker.objects.values('key', 'failures'))}"
    )
    assert alice.status == Status.DELIVERED, f"another sender's delivery: {alice.last_error!r}"


@pytest.mark.django_db(transaction=True)
def test_a_keyless_delivery_takes_no_probe_from_another_senders(
    inbox: Inbox, start_deliverer: Callable[..., RunningDeliverer], settings: Any
) -> None:
    # The host's breaker opened a while ago and its cool-off is over: the
    # next delivery that goes is its probe. One from a sender with no key
    # makes no request, so it must not be the one that takes the probe and
    # leaves the host held for another cool-off.
    _with_keys(
        settings,
        lambda sender: SenderKey(f"{ALICE}#main-key", rsa_key()) if sender == ALICE else None,
        BREAKER={"THRESHOLD": 2, "COOL_OFF": 30.0, "SCOPE": "host"},
        RETRY={"BASE": 60, "CAP": 60, "ATTEMPTS": 5, "JITTER": 0},
    )
    half_open(inbox.host)
    send(KEYLESS, NOTE, [inbox.url("/keyless")])
    send(ALICE, NOTE, [inbox.url("/alice")])
    runner = start_deliverer()
    try:
        wait_until(
            lambda: Delivery.objects.filter(inbox=inbox.url("/alice"), attempts__gte=1).exists(),
            timeout=10,
        )
        time.sleep(0.5)
    finally:
        runner.stop()
    alice = Delivery.objects.get(inbox=inbox.url("/alice"))
    assert alice.status == Status.DELIVERED, (
        f"the probe went to the keyless delivery; the other sender's was held: "
        f"{alice.last_error!r}, due in {(alice.due_at - timezone.now()).total_seconds():.0f} s"
    )


@pytest.mark.django_db(transaction=True)
def test_a_key_store_that_fails_slowly_is_not_asked_once_a_row_holding_up_other_senders(
    inboxes: Callable[..., Inbox],
    start_deliverer: Callable[..., RunningDeliverer],
    settings: Any,
) -> None:
    # The key store times out (a quarter of a second here) for one sender
    # with a fan-out queued; another sender's direct message is queued just
    # after it. Asked again for every row of the claim, the failing store
    # holds the loop, and the other sender's delivery, rows x its timeout.
    asked: list[str] = []

    def slow_store(sender: str) -> SenderKey | None:
        asked.append(sender)
        if sender == "https://social.example/users/vault":
            time.sleep(0.25)
            raise TimeoutError("the vault did not answer")
        return SenderKey(f"{ALICE}#main-key", rsa_key()) if sender == ALICE else None

    _with_keys(settings, slow_store, RETRY={"BASE": 60, "CAP": 60, "ATTEMPTS": 5, "JITTER": 0})
    direct = inboxes("127.0.0.3")
    # Forty hosts (no request is ever made to them: the key is never had).
    fan_out = [f"http://127.0.0.2:{40000 + n}/inbox" for n in range(40)]
    send("https://social.example/users/vault", NOTE, fan_out)
    send(ALICE, NOTE, [direct.url()])
    started = time.monotonic()
    runner = start_deliverer()
    try:
        wait_until(lambda: len(direct.received) == 1, timeout=30)
        took = time.monotonic() - started
    finally:
        runner.stop()
    vault_asks = asked.count("https://social.example/users/vault")
    assert took < 3, (
        f"the other sender's delivery waited {took:.1f} s behind a failing key store, "
        f"asked {vault_asks} times for one sender"
    )


@pytest.mark.django_db(transaction=True)
def test_a_key_store_that_returns_garbage_says_so_in_last_error(
    inbox: Inbox, start_deliverer: Callable[..., RunningDeliverer], settings: Any
) -> None:
    # A key store that hands back the PEM itself instead of a SenderKey: the
    # package knows exactly what is wrong ("SENDER_KEYS returned str ...;
    # it must return a SenderKey or None"), but the operator is told only
    # "TypeError", in the row and in the log.
    pem = "-----BEGIN PRIVATE KEY-----\nMIIE...\n-----END PRIVATE KEY-----\n"
    _with_keys(
        settings, lambda sender: pem, RETRY={"BASE": 60, "CAP": 60, "ATTEMPTS": 5, "JITTER": 0}
    )
    send(ALICE, NOTE, [inbox.url()])
    runner = start_deliverer()
    wait_until(lambda: Delivery.objects.filter(attempts__gte=1).exclude(last_error="").exists())
    runner.stop()
    row = Delivery.objects.get()
    assert inbox.received == []
    assert "PRIVATE KEY" not in row.last_error
    assert "SENDER_KEYS" in row.last_error and "SenderKey" in row.last_error, (
        f"last_error does not say what is wrong: {row.last_error!r}"
    )


@pytest.mark.django_db(transaction=True)
def test_a_probe_that_made_no_request_is_given_back(
    inbox: Inbox, start_deliverer: Callable[..., RunningDeliverer], settings: Any
) -> None:
    # The host's breaker is half-open. The delivery that takes its probe
    # cannot be signed (known only as it is signed): no request, nothing
    # learned of the host. The next delivery there probes at once, not a
    # cool-off later.
    _with_keys(settings, garbled_keys, BREAKER={"THRESHOLD": 2, "COOL_OFF": 30.0, "SCOPE": "host"})
    half_open(inbox.host)
    send(GARBLED, NOTE, [inbox.url("/garbled")])
    runner = start_deliverer()
    try:
        wait_until(lambda: Delivery.objects.filter(status=Status.REFUSED).exists())
        send(ALICE, NOTE, [inbox.url("/alice")])
        wait_until(lambda: Delivery.objects.filter(inbox=inbox.url("/alice"), attempts=1).exists())
    finally:
        runner.stop()
    alice = Delivery.objects.get(inbox=inbox.url("/alice"))
    assert alice.status == Status.DELIVERED, alice.last_error
    assert not Breaker.objects.filter(key=inbox.host).exists(), "closed by the probe that answered"


def test_a_lookup_that_fails_slowly_is_not_made_again_for_each_delivery(settings: Any) -> None:
    # A key store that times out after 10 s (a vault across the network).
    now = [0.0]
    asked: list[str] = []

    def times_out(sender: str) -> None:
        asked.append(sender)
        now[0] += 10.0
        raise TimeoutError

    settings.FEDERATION_DELIVERY = {**settings.FEDERATION_DELIVERY, "SENDER_KEYS": times_out}
    cache = KeyCache(clock=lambda: now[0])
    with pytest.raises(TimeoutError):
        cache.get(ALICE)
    # The next of the sender's deliveries in the claim, a moment later.
    now[0] += 0.01
    with pytest.raises((LookupFailedLately, TimeoutError)):
        cache.get(ALICE)
    assert asked == [ALICE], (
        f"asked {len(asked)} times: the failure was remembered from before the lookup began, "
        "and had expired by the time it was kept (10 s on the loop thread for each delivery)"
    )
