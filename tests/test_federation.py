"""What a fediverse server relies on beyond the core: schemes, lanes, order."""

from __future__ import annotations

import base64
import datetime as dt
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from django.utils import timezone
from http_message_signatures import HTTPMessageVerifier, HTTPSignatureKeyResolver, algorithms

from django_federation_delivery import (
    PortableInbox,
    controls,
    send,
    send_batch,
    send_portable,
    send_webhook,
)
from django_federation_delivery.deliverer import Deliverer
from django_federation_delivery.models import Breaker, Delivery, Host, Status
from django_federation_delivery.store import claims

from .conftest import Inbox, Received, RunningDeliverer, wait_until
from .keys import ALICE, rsa_key
from .operators import quick_breaker

pytestmark = pytest.mark.django_db(transaction=True)

NOTE = {"type": "Create", "actor": ALICE}
SECRET = "whsec_" + base64.b64encode(b"k" * 32).decode()


class _Keys(HTTPSignatureKeyResolver):
    def resolve_public_key(self, key_id: str) -> Any:
        assert key_id == f"{ALICE}#main-key"
        return rsa_key().public_key()


def rfc9421_verifies(request: Received) -> bool:
    """Checks an RFC 9421 signature with the http-message-signatures package."""
    import requests

    prepared = requests.Request(
        "POST",
        f"http://{request.host}{request.path}",
        headers=request.headers,
        data=request.body,
    ).prepare()
    try:
        HTTPMessageVerifier(
            signature_algorithm=algorithms.RSA_V1_5_SHA256, key_resolver=_Keys()
        ).verify(prepared)
    except Exception:
        return False
    return True


def only_rfc9421(request: Received) -> tuple[int, dict[str, str], bytes]:
    if "Signature-Input" not in request.headers:
        return 401, {}, b"draft-cavage is not accepted here"
    return (202, {}, b"") if rfc9421_verifies(request) else (401, {}, b"bad signature")


def schemes_of(inbox: Inbox) -> list[str]:
    return [
        "rfc9421" if "Signature-Input" in request.headers else "draft-cavage"
        for request in inbox.received
    ]


def test_a_host_knocked_on_twice_is_remembered_across_a_restart(
    inbox: Inbox, start_deliverer: Callable[..., RunningDeliverer]
) -> None:
    inbox.respond = only_rfc9421
    send(ALICE, NOTE, [inbox.url("/first")])
    runner = start_deliverer()
    wait_until(lambda: Delivery.objects.filter(status=Status.DELIVERED).count() == 1)
    assert schemes_of(inbox) == ["draft-cavage", "rfc9421"], "the first knocks twice"
    send(ALICE, NOTE, [inbox.url("/second")])
    wait_until(lambda: Delivery.objects.filter(status=Status.DELIVERED).count() == 2)
    runner.stop()
    assert schemes_of(inbox)[2:] == ["rfc9421"], "later ones once"
    assert Host.objects.get(name=inbox.host).scheme == "rfc9421"
    send(ALICE, NOTE, [inbox.url("/after-restart")])
    restarted = start_deliverer()
    wait_until(lambda: Delivery.objects.filter(status=Status.DELIVERED).count() == 3)
    restarted.stop()
    assert schemes_of(inbox)[3:] == ["rfc9421"], "remembered by the database, not the process"
    assert Delivery.objects.filter(status=Status.DELIVERED).count() == 3


@pytest.mark.slow
def test_a_delete_never_overtakes_its_create_while_the_create_is_retried(
    inboxes: Callable[..., Inbox],
    start_deliverer: Callable[..., RunningDeliverer],
    settings: Any,
) -> None:
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "RETRY": {"BASE": 1.0, "CAP": 1.0, "ATTEMPTS": 5, "JITTER": 0},
    }
    creates_refused = {"count": 0}

    def down_at_first(request: Received) -> tuple[int, dict[str, str], bytes]:
        if request.json()["type"] == "Create" and creates_refused["count"] < 2:
            creates_refused["count"] += 1
            return 503, {}, b"busy"
        return 202, {}, b""

    slow = inboxes("127.0.0.2", respond=down_at_first)
    well = inboxes("127.0.0.3")
    targets = [slow.url(), well.url()]
    send_batch(ALICE, {"type": "Create", "id": "n1"}, targets, {"ordering_key": "n1"})
    send_batch(ALICE, {"type": "Delete", "id": "n1"}, targets, {"ordering_key": "n1"})
    runner = start_deliverer()
    wait_until(lambda: [r.json()["type"] for r in well.received] == ["Create", "Delete"])
    assert [r.json()["type"] for r in slow.received] == ["Create"], "the others go on"
    wait_until(lambda: Delivery.objects.filter(status=Status.DELIVERED).count() == 4)
    runner.stop()
    assert [r.json()["type"] for r in slow.received] == ["Create", "Create", "Create", "Delete"]


def skip_unavailable(inbox: str, activity: dict[str, Any]) -> bool:
    return "unavailable" in inbox and activity.get("type") != "Follow"


def synchronization_header(sender: str, inbox: str) -> str:
    followers = f"{sender}/followers"
    return f'collectionId="{followers}", url="{followers}?sync", digest="{"0" * 64}"'


def sender_is_gone(sender: str) -> bool:
    return sender.endswith("/deleted")


def test_skip_if_drops_deliveries_unsent_as_skipped(
    inbox: Inbox, start_deliverer: Callable[..., RunningDeliverer], settings: Any
) -> None:
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "SKIP_IF": "tests.test_federation.skip_unavailable",
    }
    skipped = send(ALICE, {"type": "Create"}, [inbox.url("/unavailable/inbox")])
    follow = send(ALICE, {"type": "Follow"}, [inbox.url("/unavailable/inbox")])
    sent = send(ALICE, {"type": "Create"}, [inbox.url("/fine/inbox")])
    assert skipped and follow and sent
    runner = start_deliverer()
    wait_until(lambda: not Delivery.objects.filter(status=Status.PENDING).exists())
    runner.stop()
    assert Delivery.objects.get(batch=skipped).status == Status.SKIPPED
    assert Delivery.objects.get(batch=follow).status == Status.DELIVERED
    assert sorted(inbox.paths()) == ["/fine/inbox", "/unavailable/inbox"]
    assert runner.deliverer.summary.skipped == 1


def test_a_synchronized_batch_carries_a_signed_collection_synchronization_header(
    inbox: Inbox, start_deliverer: Callable[..., RunningDeliverer], settings: Any
) -> None:
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "COLLECTION_SYNCHRONIZATION": "tests.test_federation.synchronization_header",
    }
    send_batch(ALICE, NOTE, [inbox.url("/sync")], {"synchronize_collection": True})
    send(ALICE, NOTE, [inbox.url("/plain")])
    runner = start_deliverer()
    wait_until(lambda: Delivery.objects.filter(status=Status.DELIVERED).count() == 2)
    runner.stop()
    by_path = {request.path: request.headers for request in inbox.received}
    assert by_path["/sync"]["Collection-Synchronization"] == synchronization_header(
        ALICE, inbox.url("/sync")
    )
    assert "collection-synchronization" in by_path["/sync"]["Signature"]
    assert "Collection-Synchronization" not in by_path["/plain"]


def synchronization_raising(sender: str, inbox: str) -> str:
    raise RuntimeError("the followers table is away")


def synchronization_not_ascii(sender: str, inbox: str) -> str:
    # What a hand-written callable may write for a follower collection on an IDN.
    return 'collectionId="https://b\u00fccher.example/followers", url="s3cret", digest="0"'


def synchronization_two_lines(sender: str, inbox: str) -> str:
    return synchronization_header(sender, inbox) + "\r\nX-s3cret: 1"


def synchronization_bytes(sender: str, inbox: str) -> bytes:
    return synchronization_header(sender, inbox).encode()


@pytest.mark.parametrize("written", ["raising", "not_ascii", "two_lines", "bytes"])
def test_a_synchronization_header_that_cannot_be_sent_is_left_out_and_the_activity_delivered(
    inbox: Inbox, settings: Any, caplog: pytest.LogCaptureFixture, written: str
) -> None:
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "COLLECTION_SYNCHRONIZATION": f"tests.test_federation.synchronization_{written}",
    }
    send_batch(ALICE, NOTE, [inbox.url("/sync?token=s3cret")], {"synchronize_collection": True})
    with caplog.at_level("WARNING", logger="django_federation_delivery"):
        Deliverer().run(drain=True)
    delivery = Delivery.objects.get()
    assert (delivery.status, len(inbox.received)) == (Status.DELIVERED, 1), delivery.last_error
    assert "Collection-Synchronization" not in inbox.received[0].headers
    assert "COLLECTION_SYNCHRONIZATION" in caplog.text
    if written != "raising":
        (line,) = [r.getMessage() for r in caplog.records if "COLLECTION_SYNC" in r.msg]
        assert ALICE in line and f"{inbox.url('/sync')}" in line
        assert "s3cret" not in line and "b\u00fccher" not in line, line


def test_a_401_ends_a_delivery_from_a_sender_that_is_gone(
    inbox: Inbox, start_deliverer: Callable[..., RunningDeliverer], settings: Any
) -> None:
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "PERMANENT_STATUS": "tests.test_federation.only_404_is_final",
        "PERMANENT_IF_SENDER_GONE": [401],
        "SENDER_GONE": "tests.test_federation.sender_is_gone",
        "RETRY": {"BASE": 60},
    }
    inbox.respond = lambda request: (401, {}, b"")
    gone = send("https://social.example/users/deleted", NOTE, [inbox.url("/a")])
    alive = send(ALICE, NOTE, [inbox.url("/b")])
    runner = start_deliverer()
    wait_until(lambda: Delivery.objects.filter(attempts__gte=1).count() == 2)
    runner.stop()
    assert Delivery.objects.get(batch=gone).status == Status.REFUSED
    assert Delivery.objects.get(batch=alive).status == Status.PENDING, "retried: not gone"


def only_404_is_final(status: int) -> bool:
    return status == 404


#: What a project keeps of the statuses it treats as final, and why.
FINAL = {404: "no such actor", 410: "actor gone"}


def final_reason(status: int) -> str | None:
    return FINAL.get(status)


@pytest.mark.django_db(transaction=True)
def test_a_permanent_status_callable_may_answer_any_truthy_value(
    inbox: Inbox, start_deliverer: Callable[..., RunningDeliverer], settings: Any
) -> None:
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "PERMANENT_STATUS": "tests.test_federation.final_reason",
        "RETRY": {"BASE": 60},
    }
    inbox.respond = lambda request: (410, {}, b"gone")
    send(ALICE, NOTE, [inbox.url()])
    runner = start_deliverer()
    wait_until(lambda: Delivery.objects.filter(attempts__gte=1).exists())
    runner.stop()
    row = Delivery.objects.get()
    assert (row.status, row.last_status, row.last_error) == (
        Status.REFUSED,
        410,
        "the inbox answered 410 Gone: gone",
    )


async def _never_final(status: int) -> bool:
    return False


def never_final_wrapped(status: int) -> Any:
    """A plain function around an async one, as a decorator makes it: the
    checks cannot see that it is async."""
    return _never_final(status)


@pytest.mark.filterwarnings("ignore:coroutine:RuntimeWarning")
@pytest.mark.django_db(transaction=True)
def test_a_permanent_status_answering_a_coroutine_is_taken_as_no_answer(
    inbox: Inbox, settings: Any, caplog: pytest.LogCaptureFixture
) -> None:
    # Its coroutine read as true: an inbox's passing 503 refused the
    # delivery for good, with only a RuntimeWarning to say why.
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "PERMANENT_STATUS": f"{__name__}.never_final_wrapped",
    }
    inbox.respond = lambda request: (503, {}, b"busy")
    send(ALICE, NOTE, [inbox.url()])
    Deliverer().run(drain=True)
    row = Delivery.objects.get()
    assert (row.status, row.last_status) == (Status.PENDING, 503), (row.status, row.last_error)
    assert any("PERMANENT_STATUS answered coroutine" in r.getMessage() for r in caplog.records), [
        r.getMessage() for r in caplog.records
    ]


def test_a_direct_message_is_not_queued_behind_a_fan_out(
    inboxes: Callable[..., Inbox],
    start_deliverer: Callable[..., RunningDeliverer],
    settings: Any,
) -> None:
    settings.FEDERATION_DELIVERY = {**settings.FEDERATION_DELIVERY, "PRIORITY_MAX_INBOXES": 5}
    crowd = inboxes("127.0.0.2", delay=0.05)
    friend = inboxes("127.0.0.3")
    send(ALICE, NOTE, [crowd.url(f"/u{n}") for n in range(400)])
    runner = start_deliverer(concurrency=4, per_host=4)
    wait_until(lambda: len(crowd.received) >= 20)
    send(ALICE, {"type": "Create", "to": "friend"}, [friend.url()])
    wait_until(lambda: len(friend.received) == 1, timeout=10)
    waiting = 400 - len(crowd.received)
    runner.stop()
    assert waiting > 300, "sent while the fan-out was still draining"


def urgent_target(
    inboxes: Callable[..., Inbox], settings: Any, **options: Any
) -> Callable[[str], Inbox]:
    """An inbox that takes a direct message and, as the destination "ops",
    webhook events; with it, what sends one of them (``"webhook"``, or a
    direct message)."""
    target = inboxes("127.0.0.3")
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "PRIORITY_MAX_INBOXES": 5,
        "WEBHOOKS": {"ops": f"http://{target.address}:{target.port}/hook?secret={SECRET}"},
        **options,
    }

    def send_urgent(urgent: str) -> Inbox:
        if urgent == "webhook":
            send_webhook("ops", "alert.raised", {"n": 1})
        else:
            send(ALICE, {"type": "Create", "to": "friend"}, [target.url()])
        return target

    return send_urgent


@pytest.mark.parametrize("urgent", ["direct-message", "direct-message-low-fan-out", "webhook"])
def test_an_urgent_send_goes_before_a_fan_out_to_many_slow_hosts_already_claimed(
    inboxes: Callable[..., Inbox],
    start_deliverer: Callable[..., RunningDeliverer],
    settings: Any,
    urgent: str,
) -> None:
    # A fan-out to 100 hosts, each answering in 0.5 s: one claim keeps the 16
    # slots busy for rounds, and none of its hosts is at PER_HOST, so the
    # loop claimed nothing more while it had enough ready. A direct message
    # or an alert sent then was claimed only once that ran low, and waited
    # behind all of it, ready and queued for the workers: 80 deliveries.
    send_urgent = urgent_target(inboxes, settings)
    crowd = [inboxes(f"127.0.0.{10 + n % 50}", delay=0.5) for n in range(100)]
    low = urgent == "direct-message-low-fan-out"
    fan_out = [crowd[n % 100].url(f"/u{n}") for n in range(300)]
    send_batch(ALICE, NOTE, fan_out, {"low_priority": low})

    def received() -> int:
        return sum(len(inbox.received) for inbox in crowd)

    runner = start_deliverer(concurrency=16)
    wait_until(lambda: received() >= 40)
    before = received()
    target = send_urgent(urgent)
    wait_until(lambda: len(target.received) == 1, timeout=15)
    behind = received() - before
    runner.stop()
    # What was in flight as it was sent may go first, and a little more on
    # a busy machine; not what waited to be sent after it.
    assert behind < 40, f"{behind} deliveries of the fan-out went before it"


@pytest.mark.slow
def test_a_direct_message_does_not_wait_for_an_attempt_of_a_fan_out_to_end(
    inboxes: Callable[..., Inbox],
    start_deliverer: Callable[..., RunningDeliverer],
    settings: Any,
) -> None:
    # Every slot held by a fan-out's attempts to hosts that take 3 s to
    # answer: a direct message went in the first slot that freed, once one
    # of them had ended. Urgent deliveries have slots of their own.
    target = inboxes("127.0.0.3")
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "PRIORITY_MAX_INBOXES": 5,
    }
    answered: list[str] = []

    def answer(request: Received) -> tuple[int, dict[str, str], bytes]:
        answered.append(request.path)  # once its 3 s are over
        return 202, {}, b""

    crowd = [inboxes(f"127.0.0.{10 + n}", delay=3.0, respond=answer) for n in range(8)]
    send_batch(ALICE, NOTE, [crowd[n % 8].url(f"/u{n}") for n in range(32)], {})
    runner = start_deliverer(concurrency=4)
    wait_until(lambda: sum(len(inbox.received) for inbox in crowd) >= 4)
    send(ALICE, {"type": "Create", "to": "friend"}, [target.url()])
    wait_until(lambda: len(target.received) == 1, timeout=15)
    ended = list(answered)
    runner.stop()
    assert ended == [], f"sent once {len(ended)} attempts of the fan-out had ended"


def every_thread_held(
    inboxes: Callable[..., Inbox],
    start_deliverer: Callable[..., RunningDeliverer],
    delay: float,
) -> tuple[RunningDeliverer, list[str], Callable[[Received], tuple[int, dict[str, str], bytes]]]:
    """A fan-out of 16 to 8 servers that answer only after ``delay`` seconds,
    sent by a deliverer of CONCURRENCY 2 (SLOW_CONCURRENCY 2, as the settings
    given to :func:`urgent_target` say): once this returns, its slow
    attempts hold every thread the others share. Also returned: the paths
    answered so far (none until ``delay`` has passed), and the answer that
    notes them, for another server as slow."""
    answered: list[str] = []

    def answer(request: Received) -> tuple[int, dict[str, str], bytes]:
        answered.append(request.path)  # once its delay is over
        return 202, {}, b""

    crowd = [inboxes(f"127.0.0.{10 + n}", delay=delay, respond=answer) for n in range(8)]
    send_batch(ALICE, NOTE, [crowd[n % 8].url(f"/u{n}") for n in range(16)], {})
    runner = start_deliverer(concurrency=2)
    slots = runner.deliverer.slots
    wait_until(lambda: len(runner.deliverer.workers) >= 4 and slots.slow_count() >= 4)
    return runner, answered, answer


def every_thread_held_by_a_fan_out(
    inboxes: Callable[..., Inbox],
    start_deliverer: Callable[..., RunningDeliverer],
    settings: Any,
    delay: float,
) -> tuple[
    Callable[[str], Inbox],
    RunningDeliverer,
    list[str],
    Callable[[Received], tuple[int, dict[str, str], bytes]],
]:
    """:func:`every_thread_held`, slow after 0.2 s, with SLOW_CONCURRENCY 2
    and no breaker; first, what sends an urgent delivery (:func:`urgent_target`)."""
    send_urgent = urgent_target(
        inboxes, settings, SLOW_AFTER_SECONDS=0.2, SLOW_CONCURRENCY=2, BREAKER=None
    )
    return (send_urgent, *every_thread_held(inboxes, start_deliverer, delay=delay))


@pytest.mark.slow
@pytest.mark.parametrize("urgent", ["direct-message", "webhook"])
def test_an_urgent_send_goes_while_a_fan_outs_slow_attempts_hold_every_thread(
    inboxes: Callable[..., Inbox],
    start_deliverer: Callable[..., RunningDeliverer],
    settings: Any,
    urgent: str,
) -> None:
    # A fan-out's servers that take the connection and answer only at the
    # time limit (as many of 10,000 do) hold every thread the pool may have,
    # CONCURRENCY + SLOW_CONCURRENCY: a direct message or an alert waited
    # for one of those attempts to end (13.9 s with the defaults and a 20 s
    # limit). Its slots are its own, and so are their threads.
    send_urgent, runner, answered, _ = every_thread_held_by_a_fan_out(
        inboxes, start_deliverer, settings, delay=4.0
    )
    target = send_urgent(urgent)
    wait_until(lambda: len(target.received) == 1, timeout=15)
    ended = list(answered)
    runner.stop()
    assert ended == [], f"sent once {len(ended)} attempts of the fan-out had ended"


@pytest.mark.slow
def test_a_second_direct_message_goes_while_a_fan_outs_slow_attempts_hold_every_thread(
    inboxes: Callable[..., Inbox],
    start_deliverer: Callable[..., RunningDeliverer],
    settings: Any,
) -> None:
    # The thread made for the first outlived it and took a queued attempt
    # of the fan-out's (five of them at once, for the four they share): the
    # second direct message had no thread until the fan-out's ended.
    send_urgent, runner, answered, _ = every_thread_held_by_a_fan_out(
        inboxes, start_deliverer, settings, delay=6.0
    )
    slots = runner.deliverer.slots
    target = send_urgent("direct-message")
    wait_until(lambda: len(target.received) == 1, timeout=10)
    wait_until(lambda: slots.urgent_in_flight == 0, timeout=5)
    time.sleep(0.3)  # a queued attempt of the fan-out's, free for a thread to take
    running = sum(1 for item in list(slots.in_flight.values()) if item.started)
    send_urgent("direct-message")
    wait_until(lambda: len(target.received) == 2, timeout=15)
    ended = list(answered)
    runner.stop()
    assert ended == [], f"sent once {len(ended)} attempts of the fan-out had ended"
    assert running == 4, f"{running} of the fan-out's attempts at once, for the 4 they share"


@pytest.mark.slow
def test_a_direct_message_goes_while_the_fan_out_and_an_earlier_slow_one_hold_every_thread(
    inboxes: Callable[..., Inbox],
    start_deliverer: Callable[..., RunningDeliverer],
    settings: Any,
) -> None:
    # As above, but a first direct message went to a server that is silent
    # too: it turned slow on a thread past CONCURRENCY + SLOW_CONCURRENCY. A
    # second one still has a thread of its own. It waited for two attempts
    # to end: the slow urgent one was counted among the threads the
    # fan-out's slow ones already filled.
    send_urgent, runner, answered, answer = every_thread_held_by_a_fan_out(
        inboxes, start_deliverer, settings, delay=5.0
    )
    silent_friend = inboxes("127.0.0.4", delay=5.0, respond=answer)
    send(ALICE, {"type": "Create", "to": "friend", "n": 1}, [silent_friend.url()])
    slots = runner.deliverer.slots
    wait_until(lambda: slots.slow_count(urgent=True) >= 1, timeout=4)
    target = send_urgent("direct-message")
    wait_until(lambda: len(target.received) == 1, timeout=15)
    ended = list(answered)
    runner.stop()
    assert ended == [], f"sent once {len(ended)} attempts (the fan-out's, the first's) had ended"


@pytest.mark.slow
def test_a_direct_message_in_the_key_of_a_fan_out_holding_every_thread_goes_after_its_turn(
    inboxes: Callable[..., Inbox],
    start_deliverer: Callable[..., RunningDeliverer],
    settings: Any,
) -> None:
    # Sent in the fan-out's ordering key, the direct message waits for the
    # fan-out's delivery to its inbox, as ordering says; that one, queued
    # behind the fan-out's slow servers, waited in the fan-out's lane for
    # one of their attempts to end. It goes as urgently as the message.
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "PRIORITY_MAX_INBOXES": 5,
        "SLOW_AFTER_SECONDS": 0.2,
        "SLOW_CONCURRENCY": 2,
        "BREAKER": None,
    }
    answered: list[str] = []

    def answer(request: Received) -> tuple[int, dict[str, str], bytes]:
        answered.append(request.path)
        return 202, {}, b""

    friend = inboxes("127.0.0.3")
    crowd = [inboxes(f"127.0.0.{10 + n}", delay=4.0, respond=answer) for n in range(16)]
    key = {"ordering_key": f"{ALICE}/outbox"}
    post = {"type": "Create", "id": f"{ALICE}/post"}
    targets = [crowd[n % 16].url(f"/u{n}") for n in range(32)]
    send_batch(ALICE, post, [*targets, friend.url()], key)
    runner = start_deliverer(concurrency=2, claim_size=4)
    slots = runner.deliverer.slots
    wait_until(lambda: len(runner.deliverer.workers) >= 4 and slots.slow_count() >= 4)
    # Its turn comes after the 16 hosts' first: not claimed yet.
    assert Delivery.objects.get(inbox=friend.url()).lease_token is None
    message = {"type": "Create", "id": f"{ALICE}/message", "to": "friend"}
    send_batch(ALICE, message, [friend.url()], key)
    wait_until(lambda: len(friend.received) == 2, timeout=15)
    ended = list(answered)
    runner.stop()
    assert [received.json()["id"] for received in friend.received] == [post["id"], message["id"]]
    assert ended == [], f"sent once {len(ended)} attempts of the fan-out had ended"


def counting_claims(monkeypatch: pytest.MonkeyPatch) -> list[tuple[float, Any, int]]:
    """Every claim the loop makes: (when, its lanes, how many it took)."""
    made: list[tuple[float, Any, int]] = []
    claim = claims.claim

    def counted(*args: Any, **kwargs: Any) -> Any:
        rows = claim(*args, **kwargs)
        made.append((time.monotonic(), kwargs.get("lanes"), len(rows)))
        return rows

    monkeypatch.setattr(claims, "claim", counted)
    return made


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("why", ["breaker-open"])
def test_an_urgent_row_whose_host_is_left_out_is_not_claimed_for_again_and_again(
    inboxes: Callable[..., Inbox],
    start_deliverer: Callable[..., RunningDeliverer],
    settings: Any,
    monkeypatch: pytest.MonkeyPatch,
    why: str,
) -> None:
    # A fan-out to slow hosts keeps the loop with enough ready; a direct
    # message is due to a host the claim leaves out (its breaker open; at
    # PER_HOST with the fan-out's deliveries, it is not: see the next
    # test). has_due(URGENT) says yes
    # at every look, and the urgent claim, a write transaction (on SQLite
    # the write lock a web process's send waits for), finds nothing: again
    # every URGENT_LOOK_SECONDS for as long as the host stays left out.
    settings.FEDERATION_DELIVERY = {**settings.FEDERATION_DELIVERY, "PRIORITY_MAX_INBOXES": 5}
    crowd = [inboxes(f"127.0.0.{10 + n}", delay=3) for n in range(8)]
    send_batch(ALICE, NOTE, [crowd[n % 8].url(f"/u{n}") for n in range(64)], {})
    if why == "breaker-open":
        target = inboxes("127.0.0.3")
        Breaker.objects.create(
            key=f"127.0.0.3:{target.port}",
            failures=10,
            open_until=timezone.now() + dt.timedelta(minutes=5),
        )
    else:
        target = crowd[0]
    made = counting_claims(monkeypatch)
    runner = start_deliverer(concurrency=4)
    wait_until(lambda: sum(len(inbox.received) for inbox in crowd) >= 4)
    send(ALICE, {"type": "Create", "to": "friend"}, [target.url("/dm")])
    if why == "breaker-open":
        assert Delivery.objects.get(inbox=target.url("/dm")).host == f"127.0.0.3:{target.port}"
    time.sleep(0.3)
    started = time.monotonic()
    time.sleep(1.5)
    ended = time.monotonic()
    runner.stop()
    assert Delivery.objects.get(inbox=target.url("/dm")).attempts == 0, "still left out"
    urgent = [n for at, lanes, n in made if lanes is not None and started <= at <= ended]
    assert len(urgent) <= 3, (
        f"{len(urgent)} urgent claims in 1.5 s, taking {sum(urgent)} rows: the direct "
        f"message's host is left out ({why})"
    )


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_direct_message_to_a_host_a_fan_out_keeps_at_its_limit_goes_at_once(
    inboxes: Callable[..., Inbox],
    start_deliverer: Callable[..., RunningDeliverer],
    settings: Any,
) -> None:
    # A fan-out to one big host answering each request in 2 s, at its
    # PER_HOST all the time: a direct message to a user there waited for
    # one of the fan-out's attempts to end (1.5 s). The urgent lanes have
    # a host's limit again of their own.
    settings.FEDERATION_DELIVERY = {**settings.FEDERATION_DELIVERY, "PRIORITY_MAX_INBOXES": 5}
    started_at: dict[str, float] = {}

    def answer(request: Received) -> tuple[int, dict[str, str], bytes]:
        started_at.setdefault(request.path, time.monotonic())
        time.sleep(0 if request.path == "/dm" else 2.0)
        return 202, {}, b""

    big = inboxes("127.0.0.20", respond=answer)
    send_batch(ALICE, NOTE, [big.url(f"/u{n}") for n in range(40)], {})
    runner = start_deliverer(concurrency=16)
    wait_until(lambda: len(big.received) >= 2)
    time.sleep(0.5)
    sent = time.monotonic()
    send(ALICE, {"type": "Create", "to": "friend"}, [big.url("/dm")])
    wait_until(lambda: "/dm" in started_at, timeout=20)
    runner.stop()
    # An attempt of the fan-out's there takes 2 s; the look for urgent
    # work is every 0.1 s.
    assert started_at["/dm"] - sent < 1.0


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_busy_deliverer_claims_no_more_than_claim_size_ahead_of_its_slots(
    inboxes: Callable[..., Inbox],
    start_deliverer: Callable[..., RunningDeliverer],
    settings: Any,
) -> None:
    # 40 direct messages (priority lane) to 40 slow hosts, two deliverers
    # with CLAIM_SIZE 8. The first one's urgent look claims CLAIM_SIZE more
    # every 0.1 s, however many it has ready already: it holds them all,
    # leased, and sends them two at a time while the second has nothing.
    # (The same 40 as one fan-out, normal lane: the first holds 12 at most,
    # the second takes the rest.)
    settings.FEDERATION_DELIVERY = {**settings.FEDERATION_DELIVERY, "PRIORITY_MAX_INBOXES": 5}
    crowd = [inboxes(f"127.0.0.{20 + n}", delay=2) for n in range(40)]
    for inbox in crowd:
        send(ALICE, {"type": "Create", "to": "friend"}, [inbox.url("/dm")])
    assert set(Delivery.objects.values_list("lane", flat=True)) == {"priority"}
    first = start_deliverer(concurrency=2, claim_size=8)
    wait_until(lambda: sum(len(inbox.received) for inbox in crowd) >= 2)
    time.sleep(1.0)
    second = start_deliverer(concurrency=2, claim_size=8)
    time.sleep(1.0)
    held = [
        len(runner.deliverer.slots.ready) + len(runner.deliverer.slots.in_flight)
        for runner in (first, second)
    ]
    second.stop()
    first.stop()
    assert held[0] <= 8 + 2 * 2 and held[1] > 0, (
        f"with CLAIM_SIZE 8 and CONCURRENCY 2, the first deliverer holds {held[0]} of the 40 "
        f"direct messages, the second {held[1]}"
    )


DID = "did:key:z6MkhaXgBZDvotDkL5257faiztiGiC2QtKLGpbnnEGta2doK"
CREATE = {"type": "Create", "actor": ALICE}


def test_a_portable_inbox_is_delivered_through_its_first_gateway_that_accepts(
    inboxes: Callable[..., Inbox], start_deliverer: Callable[..., RunningDeliverer]
) -> None:
    down = inboxes("127.0.0.2", respond=lambda request: (503, {}, b""))
    up = inboxes("127.0.0.3")
    gateways = [down.url(""), "https://gw.example/with/path", up.url("")]
    batch = send_portable(
        ALICE,
        NOTE,
        [
            PortableInbox(f"ap://{DID}/actor/inbox", gateways),
            PortableInbox(f"ap://{DID}/actor/inbox?x=1", gateways),
            PortableInbox(f"ap://{DID}/other/inbox", ["ftp://nowhere.example"]),
        ],
    )
    assert batch is not None
    row = Delivery.objects.get()
    assert row.inbox == f"ap://{DID}/actor/inbox"
    assert row.via == [
        down.url(f"/.well-known/apgateway/{DID}/actor/inbox"),
        up.url(f"/.well-known/apgateway/{DID}/actor/inbox"),
    ]
    assert row.host == down.host
    runner = start_deliverer()
    wait_until(lambda: Delivery.objects.filter(status=Status.DELIVERED).exists())
    runner.stop()
    path = f"/.well-known/apgateway/{DID}/actor/inbox"
    assert down.paths() == [path] and up.paths() == [path]
    row.refresh_from_db()
    assert row.attempts == 1, "the gateways were tried within one attempt"
    assert verifies_at(up.received[0])


def verifies_at(request: Received) -> bool:
    from .test_deliverer import verifies

    return verifies(request)


def test_a_portable_send_with_no_usable_gateway_queues_nothing() -> None:
    assert send_portable(ALICE, NOTE, [PortableInbox(f"ap://{DID}/inbox", ["https://x/y"])]) is None
    assert not Delivery.objects.exists()


def test_a_portable_inbox_s_own_breaker_can_be_reset_by_its_inbox(
    inboxes: Callable[..., Inbox],
    start_deliverer: Callable[..., RunningDeliverer],
    settings: Any,
) -> None:
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "BREAKER": {"THRESHOLD": 1, "COOL_OFF": 60.0, "SCOPE": "inbox"},
        "RETRY": {"BASE": 60, "CAP": 60, "ATTEMPTS": 5, "JITTER": 0},
    }
    down = inboxes("127.0.0.2", respond=lambda request: (503, {}, b""))
    inbox = f"ap://{DID}/actor/inbox"
    batch = send_portable(ALICE, NOTE, [PortableInbox(inbox, [down.url("")])])
    assert batch is not None
    runner = start_deliverer()
    wait_until(lambda: Breaker.objects.filter(failures__gt=0).exists())
    runner.stop()
    assert list(Breaker.objects.values_list("key", flat=True)) == [inbox]
    # README: reset_breaker takes "an inbox's URL in any spelling for a breaker kept
    # per inbox"; the portable inbox's breaker is keyed by its ap:// inbox.
    # It raised ValueError: only http(s) URLs were read.
    assert controls.reset_breaker(inbox.replace("ap://", "AP://")) == 1
    assert not Breaker.objects.exists()


def test_a_paused_host_gets_no_request_as_a_portable_inbox_s_later_gateway(
    inboxes: Callable[..., Inbox],
    start_deliverer: Callable[..., RunningDeliverer],
) -> None:
    first = inboxes("127.0.0.2", respond=lambda request: (503, {}, b""))
    paused = inboxes("127.0.0.3")
    controls.pause_host(paused.host)
    batch = send_portable(
        ALICE, NOTE, [PortableInbox(f"ap://{DID}/actor/inbox", [first.url(""), paused.url("")])]
    )
    assert batch is not None
    runner = start_deliverer()
    wait_until(lambda: Delivery.objects.filter(attempts__gte=1).exists())
    runner.stop()
    assert first.received, "the first gateway was tried"
    assert paused.paths() == [], (
        f"host {paused.host} is paused, yet it was POSTed {paused.paths()} "
        "as a portable inbox's later gateway"
    )


def test_a_portable_inbox_goes_to_its_later_gateway_while_its_first_one_s_breaker_is_open(
    inboxes: Callable[..., Inbox],
    start_deliverer: Callable[..., RunningDeliverer],
    settings: Any,
) -> None:
    quick_breaker(settings)
    first, later = inboxes("127.0.0.2"), inboxes("127.0.0.3")
    opened = timezone.now() + dt.timedelta(hours=1)
    Breaker.objects.create(key=first.host, failures=10, open_until=opened)
    batch = send_portable(
        ALICE, NOTE, [PortableInbox(f"ap://{DID}/actor/inbox", [first.url(""), later.url("")])]
    )
    assert batch is not None
    runner = start_deliverer()
    wait_until(lambda: Delivery.objects.filter(status=Status.DELIVERED).exists())
    runner.stop()
    assert first.paths() == [] and len(later.paths()) == 1
    # Not the first's host's answer: its breaker stays as it was, and the
    # later gateway's host, which anyone may list, is charged nothing.
    assert list(Breaker.objects.values_list("key", "failures", "open_until")) == [
        (first.host, 10, opened)
    ]
    assert verifies_at(later.received[0])


def test_a_portable_inbox_s_later_gateway_whose_breaker_is_open_gets_no_request(
    inboxes: Callable[..., Inbox],
    start_deliverer: Callable[..., RunningDeliverer],
    settings: Any,
) -> None:
    quick_breaker(settings)
    first = inboxes("127.0.0.2", respond=lambda request: (503, {}, b""))
    broken = inboxes("127.0.0.3")
    Breaker.objects.create(
        key=broken.host, failures=10, open_until=timezone.now() + dt.timedelta(hours=1)
    )
    batch = send_portable(
        ALICE, NOTE, [PortableInbox(f"ap://{DID}/actor/inbox", [first.url(""), broken.url("")])]
    )
    assert batch is not None
    runner = start_deliverer()
    wait_until(lambda: Delivery.objects.filter(attempts__gte=1).exists())
    runner.stop()
    assert len(first.paths()) == 1 and broken.paths() == []


asked_to_synchronize: list[tuple[str, str]] = []


def recording_synchronization(sender: str, inbox: str) -> None:
    asked_to_synchronize.append((sender, inbox))


def test_a_portable_inbox_is_sent_no_synchronization_header_and_none_is_asked(
    inboxes: Callable[..., Inbox], settings: Any, caplog: pytest.LogCaptureFixture
) -> None:
    # Asked for its ap:// name, the README's recipe raised at every delivery
    # (an ERROR line each), and a header one returned went to every gateway.
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "COLLECTION_SYNCHRONIZATION": f"{__name__}.recording_synchronization",
    }
    asked_to_synchronize.clear()
    gateway = inboxes("127.0.0.2")
    inbox = PortableInbox(f"ap://{DID}/actor/inbox", [gateway.url("")])
    send_portable(ALICE, NOTE, [inbox], {"synchronize_collection": True})
    send_batch(ALICE, NOTE, [gateway.url("/users/bob/inbox")], {"synchronize_collection": True})
    Deliverer().run(drain=True)
    assert asked_to_synchronize == [(ALICE, gateway.url("/users/bob/inbox"))]
    assert len(gateway.received) == 2
    assert "ERROR" not in caplog.text


@pytest.mark.slow
def test_a_later_gateway_paused_while_its_delivery_waits_for_a_slot_gets_no_request(
    inboxes: Callable[..., Inbox],
    start_deliverer: Callable[..., RunningDeliverer],
    settings: Any,
) -> None:
    """ "A later gateway on a host an operator paused is left out of each
    attempt while the pause lasts" (README). A portable delivery claimed
    before the pause, waiting for its slot behind a slow one (and one in the
    worker's queue), was POSTed to the paused later gateway seconds after
    the loop read the pause: its first gateway's host was checked again as
    it got its slot, its later gateways' hosts were not."""
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "CONCURRENCY": 1,
        "SLOW_AFTER_SECONDS": 60,
    }
    release = threading.Event()

    def slow(request: Any) -> Any:
        release.wait(20)
        return 202, {}, b""

    busy = inboxes("127.0.0.4", respond=slow)
    first = inboxes("127.0.0.2", respond=lambda request: (503, {}, b""))
    later = inboxes("127.0.0.3")
    filler = inboxes("127.0.0.5")
    send_batch(ALICE, CREATE, [busy.url("/busy")], {"low_priority": True})
    send_batch(ALICE, CREATE, [filler.url("/filler")], {"low_priority": True})
    send_portable(
        ALICE,
        CREATE,
        [PortableInbox(f"ap://{DID}/actor/inbox", [first.url(""), later.url("")])],
        {"low_priority": True},
    )
    runner = start_deliverer()
    wait_until(lambda: len(busy.received) == 1)
    # All claimed: the filler waits in the worker's queue, the portable one
    # for a slot, which the slow one holds.
    assert not Delivery.objects.filter(lease_token__isnull=True).exists()
    controls.pause_host(later.host)
    time.sleep(2.5)  # the loop reads the paused hosts every second
    release.set()
    wait_until(lambda: Delivery.objects.filter(attempts__gte=1).count() == 3)
    runner.stop()
    assert first.paths(), "the first gateway was tried"
    assert later.paths() == [], (
        f"host {later.host} was paused 2.5 s before, yet it was POSTed {later.paths()} "
        "as a portable inbox's later gateway"
    )
