"""send_webhook: what it writes (never a URL), what it refuses, and the order it sets up."""

from __future__ import annotations

import json
from typing import Any

import pytest
from asgiref.sync import async_to_sync
from django.core.exceptions import ImproperlyConfigured
from django.db import transaction

from django_federation_delivery import InvalidDelivery, asend_webhook, send_webhook
from django_federation_delivery.models import Batch, Delivery, Status
from django_federation_delivery.webhooks import Event

from .conftest import at_once

SECRET = "whsec_" + "QUJDREVGR0hJSktMTU5PUFFSU1RVVldYWVo0NTY3ODk="
WEBHOOKS = {
    "ops": "slack://hooks.slack.com/services/T0AAAA1/B0BBBB2/s3cretT0kenV4lue9",
    "audit": f"https://receiver.example/hooks?secret={SECRET}",
}


@pytest.fixture(autouse=True)
def destinations(settings: Any) -> None:
    settings.FEDERATION_DELIVERY = {**settings.FEDERATION_DELIVERY, "WEBHOOKS": WEBHOOKS}


def nothing_written() -> bool:
    return not Batch.objects.exists() and not Delivery.objects.exists()


def every_value_written() -> str:
    rows = [*Batch.objects.values(), *Delivery.objects.values()]
    return json.dumps(rows, default=str)


@pytest.mark.django_db
def test_an_event_is_one_batch_with_one_delivery_a_destination_and_no_url() -> None:
    batch = send_webhook(["ops", "audit", "ops"], "alert.raised", {"host": "db1"}, event_id="e1")
    assert batch is not None
    stored = Batch.objects.get()
    event = Event.read(stored.body)
    assert (event.type, event.id, event.data) == ("alert.raised", "e1", {"host": "db1"})
    assert (stored.event_type, stored.event_id, stored.size) == ("alert.raised", "e1", 2)
    deliveries = Delivery.objects.order_by("id")
    assert [(d.inbox, d.host) for d in deliveries] == [
        ("ops", "<ops>"),
        ("audit", "<audit>"),
    ]
    written = every_value_written()
    for secret in ("hooks.slack.com", "s3cretT0kenV4lue9", "receiver.example", SECRET[6:]):
        assert secret not in written


@pytest.mark.django_db
def test_an_event_gets_a_fresh_id_and_an_aware_timestamp_kept_to_the_microsecond() -> None:
    first = send_webhook("ops", "alert.raised", None)
    second = send_webhook("ops", "alert.raised", None)
    assert first is not None and second is not None
    assert first.event_id != second.event_id and len(first.event_id) == 36
    event = Event.read(Batch.objects.get(id=first.id).body)
    assert event.timestamp.utcoffset() is not None
    # Read back, it writes the very bytes it was stored as: the same signature every retry.
    assert event.as_json().decode() == Batch.objects.get(id=first.id).body


@pytest.mark.django_db
def test_events_to_one_destination_wait_each_on_the_one_before() -> None:
    for n in range(3):
        send_webhook("ops", "alert.raised", {"n": n})
    send_webhook("audit", "alert.raised", {"n": 0})
    ops = list(Delivery.objects.filter(host="<ops>").order_by("id"))
    assert ops[0].after_id is None and ops[0].due_at is not None
    assert [d.after_id for d in ops[1:]] == [ops[0].id, ops[1].id]
    assert all(d.due_at is None for d in ops[1:])
    assert len({d.sequence for d in ops}) == 1
    audit = Delivery.objects.get(host="<audit>")
    assert audit.after_id is None and audit.due_at is not None
    assert audit.sequence != ops[0].sequence


@pytest.mark.django_db
def test_an_unknown_destination_is_named_and_nothing_written() -> None:
    with pytest.raises(InvalidDelivery, match=r"no webhook destination named 'opz'.*audit, ops"):
        send_webhook(["ops", "opz"], "alert.raised", {})
    assert nothing_written()


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("event_type", "data", "message"),
    [
        ("", {}, "An event type must be a non-empty string"),
        ("../etc/passwd", {}, "is not a simple name"),
        ("alert.raised", {"when": {1, 2}}, r"JSON: a set at \$\.when, which JSON cannot"),
        ("alert.raised", {("a", 1): 1}, r"JSON: a tuple \(a key\) at \$, which JSON cannot"),
        # Named by the codec's place in the document alone.
        ("alert.raised", {"files": ["ok", "bad\udcff"]}, r"a lone surrogate at \$\.files\[1\]"),
        ("alert.raised", float("nan"), r"cannot be written as JSON: nan at \$, which"),
        ("alert.raised", {"p95": [1.0, float("inf")]}, r"inf at \$\.p95\[1\], which JSON"),
    ],
)
def test_bad_input_is_named_and_nothing_written(event_type: str, data: Any, message: str) -> None:
    with pytest.raises(InvalidDelivery, match=message):
        send_webhook("ops", event_type, data)
    assert nothing_written()


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("data", "said"),
    [
        ({1: "a", "1": "b"}, "both '1' in JSON at $."),
        ({"host": {None: "a", "null": "b"}}, "both 'null' in JSON at $.host."),
        ([{"ok": 1}, {False: 0, "false": 1}], "both 'false' in JSON at $[1]."),
    ],
)
def test_keys_that_are_one_once_written_as_json_are_refused_naming_where(
    data: Any, said: str
) -> None:
    # json.dumps keeps the last of the two: what was stored was not what was given.
    with pytest.raises(InvalidDelivery) as raised:
        send_webhook("ops", "alert.raised", data)
    assert str(raised.value) == (f"The data of event 'alert.raised' has two keys that are {said}")
    assert nothing_written()
    # Keys that stay apart as JSON are sent as JSON writes them.
    batch = send_webhook("ops", "alert.raised", {1: "a", "2": "b", None: "c"})
    assert batch is not None
    assert Event.read(Batch.objects.get().body).data == {"1": "a", "2": "b", "null": "c"}


@pytest.mark.django_db
def test_an_event_over_webhook_max_bytes_is_refused_naming_its_size_and_the_limit(
    settings: Any,
) -> None:
    data = {"log": "x" * (1 << 20)}
    with pytest.raises(InvalidDelivery, match=r"is 10\d{5} bytes as JSON, more than "):
        send_webhook("ops", "build.log", data)
    with pytest.raises(InvalidDelivery, match=r"WEBHOOK_MAX_BYTES \(1048576\)"):
        send_webhook(["ops", "audit"], "build.log", data)
    assert nothing_written()
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "WEBHOOK_MAX_BYTES": 2 << 20,
    }
    assert send_webhook("ops", "build.log", data) is not None


@pytest.mark.django_db
@pytest.mark.parametrize(
    "destination", [None, 3, b"ops", bytearray(b"ops"), memoryview(b"ops"), [3]]
)
def test_a_destination_that_is_not_a_name_is_refused(destination: Any) -> None:
    with pytest.raises(InvalidDelivery, match="destination") as raised:
        send_webhook(destination, "alert.raised", {})
    # Binary data was once taken for a list and refused as its first byte, 111:
    # the value named is the one given.
    named = destination[0] if isinstance(destination, list) else destination
    assert str(raised.value).endswith(f"not {named!r}")
    assert nothing_written()


def nested(depth: int) -> list[object]:
    """0 in ``depth`` lists."""
    value: list[object] = [0]
    for _ in range(depth - 1):
        value = [value]
    return value


@pytest.mark.django_db(transaction=True)
def test_data_nested_too_deeply_is_refused_sync_and_async_and_nothing_written() -> None:
    said = r"The data of event 'alert\.raised' is nested more than \d+ levels deep"
    with pytest.raises(InvalidDelivery, match=said):
        send_webhook("ops", "alert.raised", {"d": nested(960)})
    with pytest.raises(InvalidDelivery, match=said):
        async_to_sync(asend_webhook)("ops", "alert.raised", {"d": nested(960)})
    assert nothing_written()


@pytest.mark.django_db
@pytest.mark.parametrize("event_id", ["has space", "", 0, False], ids=repr)
def test_a_bad_event_id_is_refused(event_id: Any) -> None:
    # "" and 0 were given a random id, as if none had been: only None is.
    with pytest.raises(InvalidDelivery, match=f"An event id .*, not {event_id!r}"):
        send_webhook("ops", "alert.raised", {}, event_id=event_id)
    assert nothing_written()


@pytest.mark.django_db
def test_a_misconfigured_destination_is_reported_by_its_name_only(settings: Any) -> None:
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "WEBHOOKS": {"ops": "slack://hooks.slack.com"},
    }
    with pytest.raises(ImproperlyConfigured, match="'ops'") as raised:
        send_webhook("ops", "alert.raised", {})
    assert "hooks.slack.com" not in str(raised.value)
    assert nothing_written()


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("name", "bad", "named"),
    [
        ("WEBHOOK_MAX_BYTES", "1MB", "['WEBHOOK_MAX_BYTES'] = '1MB'"),
        ("WEBHOOK_MAX_BYTES", 0, "['WEBHOOK_MAX_BYTES'] = 0"),
        ("WEBHOOK_RETRY", "often", "WEBHOOK_RETRY must be a non-empty list of waits"),
        ("WEBHOOK_TIMEOUT", "10s", "WEBHOOK_TIMEOUT must be a number of seconds"),
        ("WEBHOOK_RETRY_AFTER_MAX", 0, "WEBHOOK_RETRY_AFTER_MAX must be"),
        ("WEBHOOK_ALLOWED_NETWORKS", ["localhost"], "has 'localhost'"),
    ],
)
def test_send_webhook_under_a_bad_webhook_setting_raises_its_error_naming_it(
    settings: Any, name: str, bad: Any, named: str
) -> None:
    # Not "the policy of the 'slack' kind … could not be had: ImproperlyConfigured".
    settings.FEDERATION_DELIVERY = {**settings.FEDERATION_DELIVERY, name: bad}
    with pytest.raises(ImproperlyConfigured) as raised:
        send_webhook(["ops", "audit"], "alert.raised", {"x": 1})
    assert named in str(raised.value), str(raised.value)
    assert "s3cret" not in str(raised.value) and SECRET not in str(raised.value)
    assert nothing_written()


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("kind", "error"),
    [
        ("Unsettled", " could not be had: ImproperlyConfigured."),
        ("Misvalued", " could not be had: ValueError."),
        ("Forgetful", ": its policy() returned NoneType, not a Policy."),
    ],
)
def test_a_kind_whose_policy_fails_is_named_with_its_error_s_type_alone(
    settings: Any, kind: str, error: str
) -> None:
    # Its message is the project's code's, and may hold a secret, whatever
    # the error: even an ImproperlyConfigured is not repeated. A policy()
    # that returned None raised AttributeError from deep in the send.
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "CHANNELS": [f"tests.channels.{kind}"],
        "WEBHOOKS": {"pager": f"{kind.lower()}://routingKEY4b7c9@pager.example/x"},
    }
    with pytest.raises(ImproperlyConfigured) as raised:
        send_webhook("pager", "alert.raised", {"x": 1})
    assert str(raised.value) == (
        f"The policy of the {kind.lower()!r} kind of webhook destination{error}"
    )
    assert nothing_written()


@pytest.mark.django_db
def test_an_empty_list_of_destinations_queues_nothing() -> None:
    assert send_webhook([], "alert.raised", {}) is None
    assert nothing_written()


@pytest.mark.django_db(transaction=True)
def test_a_rolled_back_transaction_queues_nothing() -> None:
    def caller() -> None:
        with transaction.atomic():
            send_webhook("ops", "alert.raised", {})
            assert Delivery.objects.count() == 1
            raise RuntimeError("the caller's own failure")

    with pytest.raises(RuntimeError):
        caller()
    assert nothing_written()
    batch = send_webhook("ops", "alert.raised", {})
    assert batch is not None
    delivery = Delivery.objects.get()
    assert delivery.status == Status.PENDING and delivery.after_id is None


@pytest.mark.django_db(transaction=True)
def test_sends_at_once_to_one_destination_still_make_one_line_of_waits() -> None:
    def sender() -> None:
        for n in range(8):
            send_webhook("ops", "alert.raised", {"n": n})

    assert at_once(sender, 3, timeout=60) == [None] * 3
    waits = list(Delivery.objects.filter(host="<ops>").values_list("after_id", flat=True))
    assert len(waits) == 24
    # One head, and every other delivery waits on a different one: none is
    # released beside another when the one before it settles.
    assert waits.count(None) == 1
    assert len(set(waits)) == 24


@pytest.mark.django_db
def test_each_event_goes_only_where_it_is_subscribed(settings: Any) -> None:
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "WEBHOOKS": {
            # In the URL (no kind sees the parameter), or as a dict.
            "alerts": WEBHOOKS["ops"] + "?events=alert.*",
            "deploys": {"url": WEBHOOKS["audit"], "events": ["deploy.finished", "alert.resolved"]},
            "all": WEBHOOKS["audit"],
        },
    }

    def sent_to(event_type: str, destination: Any = "*") -> list[str]:
        batch = send_webhook(destination, event_type, {})
        if batch is None:
            return []
        return sorted(batch.deliveries.values_list("destination", flat=True))

    assert sent_to("alert.raised") == ["alerts", "all"]
    assert sent_to("alert.resolved") == ["alerts", "all", "deploys"]
    assert sent_to("deploy.finished") == ["all", "deploys"]
    assert sent_to("deploy.started") == ["all"]
    # Named, a destination still gets only what it is subscribed to.
    assert sent_to("deploy.started", ["alerts", "deploys"]) == []
    assert sent_to("alert.raised", "alerts") == ["alerts"]


@pytest.mark.django_db
def test_every_destination_with_none_configured_queues_nothing(settings: Any) -> None:
    settings.FEDERATION_DELIVERY = {**settings.FEDERATION_DELIVERY, "WEBHOOKS": {}}
    assert send_webhook("*", "alert.raised", {}) is None
    assert nothing_written()


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("destination", "event_type", "event_id"),
    [
        (WEBHOOKS["ops"], "alert.raised", None),
        ([WEBHOOKS["audit"]], "alert.raised", None),
        ([WEBHOOKS["ops"].encode()], "alert.raised", None),
        ("ops", WEBHOOKS["audit"], None),
        ("ops", "alert.raised", f"{WEBHOOKS['audit']} "),
    ],
)
def test_a_destination_s_url_given_for_a_name_is_never_repeated(
    destination: Any, event_type: str, event_id: Any
) -> None:
    # A URL pasted where its name goes: its path and query are the credential.
    with pytest.raises(InvalidDelivery) as raised:
        send_webhook(destination, event_type, {}, event_id=event_id)
    said = str(raised.value)
    assert "s3cretT0kenV4lue9" not in said and SECRET[6:] not in said, said
    assert nothing_written()


@pytest.mark.django_db
def test_an_event_to_every_destination_skips_one_whose_url_does_not_parse(
    settings: Any, caplog: pytest.LogCaptureFixture
) -> None:
    # A typo in one destination's URL (one subscribed to deploy events
    # alone, even) made every send_webhook("*") raise, queueing nothing: an
    # alert to every good destination was lost, the caller's view a 500.
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "WEBHOOKS": {
            "ops": "slack://hooks.slack.com/services/T0AAAA1/B0BBBB2/s3cretT0kenV4lue9",
            "deploys": {"url": "slak://hooks.slack.com/services/T0/B0/x", "events": ["deploy.*"]},
        },
    }
    batch = send_webhook("*", "alert.raised", {"host": "db1"})
    assert batch is not None
    assert list(Delivery.objects.values_list("destination", flat=True)) == ["ops"]
    assert "'deploys'" in caplog.text and "services/T0" not in caplog.text
    with pytest.raises(ImproperlyConfigured, match="'deploys'"):
        send_webhook("deploys", "deploy.finished", {})


BOT_TOKEN = "4815162342:ABCsecretBotToken_x"


@pytest.mark.django_db
@pytest.mark.parametrize(
    "pasted",
    [
        # The chat left out, or written as a path.
        f"telegram://{BOT_TOKEN}",
        f"telegram://{BOT_TOKEN}/-1001",
        # Copied with the line's end from a .env file, the slashes lost.
        f"telegram:{BOT_TOKEN}@-1001\n",
        # The slashes lost, and the chat left out; its API's "bot" form;
        # pasted after a space, or in angle brackets.
        f"telegram:{BOT_TOKEN}",
        f"telegram:bot{BOT_TOKEN}",
        f" telegram:{BOT_TOKEN}",
        f"<telegram:{BOT_TOKEN}>",
    ],
)
def test_a_telegram_url_given_for_a_name_never_repeats_the_bot_token(
    settings: Any, pasted: str
) -> None:
    # The refusal ("no webhook destination named …") kept what came where
    # the host goes, the token; and took a value with a line's end for a
    # word, shown whole.
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "WEBHOOKS": {"tg": f"telegram://{BOT_TOKEN}@-1001"},
    }
    with pytest.raises(InvalidDelivery) as raised:
        send_webhook(pasted, "alert.raised", {})
    message = str(raised.value)
    assert "ABCsecret" not in message and "telegram:" in message, message


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("pasted", "secret", "shown"),
    [
        # matrix://<access token>@<homeserver>/<room>, its slashes lost.
        (
            "matrix:syt_SECRETaccessTOKEN@matrix.example/!room:matrix.example",
            "SECRETaccess",
            "'matrix:matrix.example/…'",
        ),
        # ntfy://<token>@ntfy.sh/<topic>, its slashes lost; a host with no
        # dot (a compose service's name, localhost, an IP literal) too.
        ("ntfy:tk_SECRETaccessTOKEN@ntfy.sh/alerts", "SECRETaccess", "'ntfy:ntfy.sh/…'"),
        ("ntfy:tk_SECRETaccessTOKEN@localhost/alerts", "SECRETaccess", "'ntfy:localhost/…'"),
        (
            "ntfy:tk_SECRETaccessTOKEN@[::1]:8080/alerts",
            "SECRETaccess",
            "'ntfy:[::1]:8080/…'",
        ),
        (
            "matrix:syt_SECRETaccessTOKEN@synapse/!room:matrix.example",
            "SECRETaccess",
            "'matrix:synapse/…'",
        ),
        # Before a host and a port, no topic yet.
        ("ntfy:tk_SECRETaccessTOKEN@localhost:8080", "SECRETaccess", "'ntfy:localhost:8080/…'"),
        # A self-hosted ntfy's topic, no token, its slashes lost.
        ("ntfy:ntfy/mySECRETtopic", "SECRETtopic", "'ntfy:ntfy/…'"),
        ("ntfy+http:localhost:8080/mySECRETtopic", "SECRETtopic", "'ntfy+http:localhost:8080/…'"),
        # Without its scheme: its host only, dotted or not.
        ("hunter2SECRET@ntfy.example.com/alerts", "hunter2SECRET", "'ntfy.example.com/…'"),
        ("tk_SECRETaccessTOKEN@localhost:8080/alerts", "SECRETaccess", "'localhost:8080/…'"),
        ("tk_SECRETaccessTOKEN@[::1]:8080/alerts", "SECRETaccess", "'[::1]:8080/…'"),
        # A token before its host, no path; a bot's token alone, or before its chat.
        ("syt_SECRETaccessTOKEN@matrix.example", "SECRETaccess", "'matrix.example/…'"),
        (BOT_TOKEN, "ABCsecret", "named '…'"),
        (f"{BOT_TOKEN}@-1001", "ABCsecret", "named '…'"),
        # Copied with a line's end or its quotes; before an IPv6 homeserver.
        ("syt_SECRETaccessTOKEN@matrix.example ", "SECRETaccess", "'matrix.example/…'"),
        ('"syt_SECRETaccessTOKEN@matrix.example"', "SECRETaccess", "'matrix.example/…'"),
        ("syt_SECRETaccessTOKEN@[::1]:8008", "SECRETaccess", "'[::1]:8008/…'"),
        # A service's token alone: an ntfy access token, a Discord webhook's.
        ("tk_AgQdq7mVBoFD37zQVN29RhuMzNIz2", "AgQdq7mVBoFD37", "named '…'"),
        ("Xq3J9vK2mP7wLr8TzYb4NcQe1HdFgUs6AoIiWjEkRxCvBnMlZpOa5ShGu0Dy-t_fVsR2", "vK2mP7", "'…'"),
        # A Slack or Discord hook's path alone.
        ("T0AAAA1/B0BBBB2/s3cretT0kenV4lue9", "s3cretT0ken", "named '…'"),
        ("1234567890123456789/Xq3J9vK2mP7wLr8TzYb4NcQe1HdFgUs6AoIiWjEkRxCv", "vK2mP7", "'…'"),
    ],
)
def test_a_token_before_a_host_given_for_a_name_is_never_repeated(
    pasted: str, secret: str, shown: str
) -> None:
    # A user alone (a token) before its host was taken for a word, as
    # "order:created@v1" is, and shown whole.
    with pytest.raises(InvalidDelivery) as raised:
        send_webhook(pasted, "alert.raised", {})
    message = str(raised.value)
    assert secret not in message and shown in message, message


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("destination", "event_type", "named"),
    [
        # An event type with a dotted version, taken for a user before a host.
        ("oncall", "order:created@v1.2", "'order:created@v1.2'"),
        # A mistyped name with colons, taken for a bot's token.
        (
            "ops:alerts:production-europe-west1",
            "alert.raised",
            "'ops:alerts:production-europe-west1'",
        ),
        # Mistyped names a token's rules might take for a token: an "@", capitals.
        ("production-alerts@ops", "alert.raised", "'production-alerts@ops'"),
        ("Prod_Alerts_EU_West_1", "alert.raised", "'Prod_Alerts_EU_West_1'"),
        ("Production-Alerts-2024", "alert.raised", "'Production-Alerts-2024'"),
    ],
)
def test_a_value_that_is_no_url_is_named_whole(
    settings: Any, destination: str, event_type: str, named: str
) -> None:
    # Refused, it was named cut ("'order:/…'", "'ops:…'"): the user could
    # not see which value was wrong.
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "CHANNELS": ["tests.channels.Pager"],
        "WEBHOOKS": {"oncall": "pager://routingKEY4b7c9@pager.example/v2/enqueue"},
    }
    with pytest.raises(InvalidDelivery) as raised:
        send_webhook(destination, event_type, {"n": 1})
    assert named in str(raised.value)
