from __future__ import annotations

import base64
import dataclasses
import datetime as dt
import hashlib
import json
import logging
import re
import threading
from typing import Any

import pytest
from django.db import IntegrityError, connection, transaction
from django.db.transaction import TransactionManagementError
from django.test.utils import CaptureQueriesContext
from django.utils import timezone
from django.utils.translation import gettext_lazy

from django_federation_delivery import (
    BatchOptions,
    InvalidDelivery,
    send,
    send_batch,
    send_webhook,
    wakeup,
)
from django_federation_delivery.models import Batch, Delivery, Lane, Status
from django_federation_delivery.sending import UNAVAILABLE

from .keys import ALICE

NOTE = {"type": "Create", "actor": ALICE, "object": {"type": "Note", "content": "héllo"}}


def nested(depth: int) -> list[object]:
    value: list[object] = []
    for _ in range(depth):
        value = [value]
    return value


DEEP = nested(100_000)


def nothing_written() -> bool:
    return not Batch.objects.exists() and not Delivery.objects.exists()


@pytest.mark.django_db
def test_a_send_stores_the_body_once_with_its_digest_and_a_delivery_per_inbox() -> None:
    inboxes = [f"https://host{n}.example/inbox" for n in range(5)]
    batch = send(ALICE, NOTE, inboxes)
    assert batch is not None
    stored = Batch.objects.get()
    assert json.loads(stored.body) == NOTE
    expected = base64.b64encode(hashlib.sha256(stored.body.encode()).digest()).decode()
    assert stored.body_sha256 == expected
    assert stored.size == stored.remaining == 5
    deliveries = Delivery.objects.filter(batch=stored)
    assert sorted(d.inbox for d in deliveries) == sorted(inboxes)
    assert {d.status for d in deliveries} == {Status.PENDING}
    assert all(d.due_at is not None and d.due_at <= timezone.now() for d in deliveries)


@pytest.mark.django_db
def test_duplicate_inboxes_are_sent_to_once_however_they_are_spelt() -> None:
    send(
        ALICE,
        NOTE,
        [
            "https://a.example/inbox",
            "https://A.EXAMPLE:443/inbox",
            "https://a.example/inbox#x",
            "https://a.example./inbox",
            "https://a.example/./x/../inbox",
            "https://a.example/other",
        ],
    )
    assert sorted(Delivery.objects.values_list("inbox", flat=True)) == [
        "https://a.example/inbox",
        "https://a.example/other",
    ]


@pytest.mark.django_db
def test_an_inbox_that_cannot_be_delivered_to_is_skipped_and_the_others_queued(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Remote actors choose their inboxes: one bad one must not stop a user from posting.
    with caplog.at_level(logging.WARNING, logger="django_federation_delivery.sending"):
        batch = send(
            ALICE,
            NOTE,
            [
                "https://a.example/inbox",
                "ftp://b.example/inbox",
                "https://evil.example:99999/inbox",
                "https://u:SECRET@evil.example/inbox",
                42,
                "https://c.example/in\r\nX-Injected: 1",
            ],
        )
    assert batch is not None
    assert list(Delivery.objects.values_list("inbox", flat=True)) == ["https://a.example/inbox"]
    assert batch.size == 1
    assert [(skipped.inbox, skipped.reason) for skipped in batch.skipped] == [
        ("ftp://b.example/inbox", "has scheme 'ftp', not http or https"),
        ("https://evil.example:99999/inbox", "has port 99999, not from 1 to 65535"),
        ("https://evil.example/inbox", "carries a user or password"),
        ("", "is not a string but int"),
        (
            "https://c.example/in\\r\\nX-Injected: 1",
            "has a control or whitespace character (U+000D)",
        ),
    ]
    assert dataclasses.is_dataclass(batch.skipped[0])
    with pytest.raises(dataclasses.FrozenInstanceError):
        batch.skipped[0].reason = "x"  # type: ignore[misc]
    (record,) = caplog.records
    assert record.levelno == logging.WARNING
    assert "Skipped 5 inbox(es)" in record.getMessage()
    assert "SECRET" not in caplog.text
    assert not Batch.objects.get().skipped, "not stored"


@pytest.mark.django_db
def test_a_send_whose_inboxes_are_all_skipped_writes_nothing_and_says_so(
    caplog: pytest.LogCaptureFixture, django_assert_num_queries: Any
) -> None:
    with (
        caplog.at_level(logging.WARNING, logger="django_federation_delivery.sending"),
        django_assert_num_queries(0),
    ):
        assert send(ALICE, NOTE, ["https://a.example:0/inbox", None]) is None
    assert nothing_written()
    (record,) = caplog.records
    assert record.levelno == logging.WARNING
    assert record.getMessage().startswith("Nothing queued: all 2 inbox(es) were skipped")
    assert "port 0" in record.getMessage()


@pytest.mark.django_db
def test_skipping_an_inbox_costs_no_query() -> None:
    # The hosts marked unavailable are read once a minute, not at each send.
    send(ALICE, NOTE, ["https://c.example/inbox"])
    with CaptureQueriesContext(connection) as plain:
        send(ALICE, NOTE, ["https://a.example/inbox"])
    with CaptureQueriesContext(connection) as skipping:
        send(ALICE, NOTE, ["https://a.example/inbox", "https://b.example:0/inbox"])
    assert len(skipping) == len(plain)


@pytest.mark.django_db
def test_sending_to_no_inbox_writes_nothing() -> None:
    assert send(ALICE, NOTE, []) is None
    assert nothing_written()


@pytest.mark.django_db(transaction=True)
def test_a_rolled_back_transaction_queues_nothing() -> None:
    def caller() -> None:
        with transaction.atomic():
            send(ALICE, NOTE, ["https://a.example/inbox"])
            raise RuntimeError("the caller's own failure")

    with pytest.raises(RuntimeError):
        caller()
    assert nothing_written()


@pytest.mark.django_db(transaction=True)
def test_a_send_the_database_refuses_rolls_back_the_callers_transaction_unless_in_its_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # No savepoint of its own: a send inside the caller's transaction is its
    # statements alone, and one that fails dooms that transaction, as any
    # other statement of the caller's would.
    from django_federation_delivery import sending

    def every_inbox_twice(targets: list[Any]) -> list[Any]:
        return targets * 2  # the database refuses a second delivery to one inbox

    with transaction.atomic():
        send(ALICE, NOTE, ["https://a.example/inbox"])
        with CaptureQueriesContext(connection) as captured:
            send(ALICE, NOTE, ["https://b.example/inbox"])
        assert not [q for q in captured if "SAVEPOINT" in q["sql"]], captured.captured_queries
        monkeypatch.setattr(sending, "_interleave_hosts", every_inbox_twice)
        with pytest.raises(IntegrityError):
            send(ALICE, NOTE, ["https://c.example/inbox"])
        with pytest.raises(TransactionManagementError):
            Batch.objects.count()
    assert nothing_written()
    # In an atomic() of its own, the caller carries on past it.
    with transaction.atomic():
        monkeypatch.undo()
        send(ALICE, NOTE, ["https://a.example/inbox"])
        monkeypatch.setattr(sending, "_interleave_hosts", every_inbox_twice)
        with pytest.raises(IntegrityError), transaction.atomic():
            send(ALICE, NOTE, ["https://c.example/inbox"])
    assert list(Delivery.objects.values_list("inbox", flat=True)) == ["https://a.example/inbox"]


@pytest.mark.django_db(transaction=True)
def test_a_send_in_autocommit_is_one_statement_on_postgresql_and_whole_or_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Its batch and deliveries are one statement there, atomic by itself:
    # no BEGIN and COMMIT around it, two round trips fewer. A send of many
    # statements (SQLite's two; an ordering key's locks) is a transaction.
    from django_federation_delivery import sending

    send(ALICE, NOTE, ["https://first.example/inbox"])  # reads the hosts gone for a minute
    woken = threading.Event()
    wakeup.register(woken)
    try:
        with CaptureQueriesContext(connection) as captured:
            send(ALICE, NOTE, [f"https://h{n}.example/inbox" for n in range(20)])
    finally:
        wakeup.unregister(woken)
    assert woken.is_set(), "woken at once: the rows are committed"
    statements = [q["sql"] for q in captured.captured_queries]
    if connection.vendor == "postgresql":
        assert len(statements) == 1, statements
        assert statements[0].startswith("WITH b AS (INSERT INTO"), statements
    else:
        assert len(statements) > 2 and statements[-1] == "COMMIT", statements
    with CaptureQueriesContext(connection) as ordered:
        send_batch(ALICE, NOTE, ["https://a.example/inbox"], {"ordering_key": "thread-1"})
    assert ordered.captured_queries[-1]["sql"] == "COMMIT", ordered.captured_queries
    assert Delivery.objects.count() == 22

    # A statement the database refuses leaves nothing of its send.
    monkeypatch.setattr(sending, "_interleave_hosts", lambda targets: targets * 2)
    with pytest.raises(IntegrityError):
        send(ALICE, NOTE, ["https://c.example/inbox"])
    assert Batch.objects.count() == 3 and Delivery.objects.count() == 22


@pytest.mark.django_db(transaction=True)
def test_a_committed_send_wakes_a_deliverer_in_this_process_only_on_commit() -> None:
    woken = threading.Event()
    wakeup.register(woken)
    try:
        with transaction.atomic():
            send(ALICE, NOTE, ["https://a.example/inbox"])
            assert not woken.is_set(), "woken before the rows can be seen"
        assert woken.is_set()
    finally:
        wakeup.unregister(woken)


@pytest.mark.django_db(transaction=True)
def test_a_send_on_a_kept_connection_the_server_dropped_reconnects(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A send runs its statement on the driver's cursor when nothing logs
    # queries: it must still check a kept connection at a request's start,
    # as Django's cursor does with CONN_HEALTH_CHECKS, and not fail on one
    # the server closed since the last request.
    if connection.vendor != "postgresql":
        pytest.skip("an SQLite connection is never dropped by a server")
    import psycopg
    from django.db import close_old_connections

    monkeypatch.setitem(connection.settings_dict, "CONN_MAX_AGE", None)
    monkeypatch.setitem(connection.settings_dict, "CONN_HEALTH_CHECKS", True)
    connection.close()
    try:
        send(ALICE, NOTE, ["https://first.example/inbox"])  # reads the hosts gone for a minute
        pid = connection.connection.info.backend_pid
        with psycopg.connect(connection.connection.info.dsn, autocommit=True) as other:
            other.execute("SELECT pg_terminate_backend(%s)", [pid])
        close_old_connections()  # as the next request's start does
        batch = send(ALICE, NOTE, ["https://second.example/inbox"])
        assert batch is not None
        assert connection.connection.info.backend_pid != pid
        assert list(Delivery.objects.values_list("inbox", flat=True).order_by("id")) == [
            "https://first.example/inbox",
            "https://second.example/inbox",
        ]
    finally:
        connection.close()


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("sender", "activity", "inboxes", "options", "named"),
    [
        ("", NOTE, ["https://a.example/inbox"], None, "''"),
        ("   ", NOTE, ["https://a.example/inbox"], None, "'   '"),
        (None, NOTE, ["https://a.example/inbox"], None, "None"),
        (ALICE, ["not", "an", "object"], ["https://a.example/inbox"], None, "['not'"),
        (ALICE, "a string", ["https://a.example/inbox"], None, "'a string'"),
        (ALICE, {"n": float("nan")}, ["https://a.example/inbox"], None, "JSON"),
        (ALICE, {"when": object()}, ["https://a.example/inbox"], None, "JSON"),
        (ALICE, NOTE, "https://a.example/inbox", None, "'https://a.example/…'"),
        (ALICE, NOTE, 42, None, "42"),
        (ALICE, NOTE, ["ftp://b.example/inbox"], {"max_attempts": 0}, "0"),
        (ALICE, NOTE, ["https://a.example/inbox"], {"tags": "x"}, "'tags'"),
        # Keys of types that do not compare once raised TypeError from sorting them.
        (ALICE, NOTE, ["https://a.example/inbox"], {1: 2, "colour": 3}, "'colour', 1"),
        (ALICE, NOTE, ["https://a.example/inbox"], {"max_attempts": 0}, "0"),
        (ALICE, NOTE, ["https://a.example/inbox"], {"max_attempts": "3"}, "'3'"),
        (ALICE, NOTE, ["https://a.example/inbox"], {"deadline": "tomorrow"}, "'tomorrow'"),
        (
            ALICE,
            NOTE,
            ["https://a.example/inbox"],
            {"deadline": dt.datetime(2030, 1, 1)},
            "timezone-aware",
        ),
        (
            ALICE,
            NOTE,
            ["https://a.example/inbox"],
            {"deadline": timezone.now() - dt.timedelta(seconds=1)},
            "already past",
        ),
        (ALICE, NOTE, ["https://a.example/inbox"], {"tag": "x" * 201}, "longer than 200"),
        # What marks a replay's copy (with its key), its original's id read from it.
        (ALICE, NOTE, ["https://a.example/inbox"], {"tag": "replay of batch x"}, "marks what"),
        (ALICE, NOTE, ["https://a.example/inbox"], {"low_priority": "yes"}, "'yes'"),
        (ALICE, NOTE, ["https://a.example/inbox"], ["tag"], "['tag']"),
        (ALICE, NOTE, ["https://a.example/inbox"], {"max_attempts": 10**30}, "1000000000000"),
        (ALICE, NOTE, ["https://a.example/inbox"], {"tag": "a\x00b"}, "'a\\x00b'"),
        (ALICE, NOTE, ["https://a.example/inbox"], {"ordering_key": "k\x00"}, "'k\\x00'"),
        (ALICE, NOTE, ["https://a.example/inbox"], {"tag": "\ud800"}, "'\\ud800'"),
        (ALICE + "\x00", NOTE, ["https://a.example/inbox"], None, "NUL"),
        (ALICE + "\r\nX: y", NOTE, ["https://a.example/inbox"], None, "alice\\r\\nX: y'"),
        # C1 controls (8-bit terminals act on CSI), a line separator, a bidi mark.
        (ALICE + "\x85x", NOTE, ["https://a.example/inbox"], None, "control characters"),
        (ALICE + "\x9b2J", NOTE, ["https://a.example/inbox"], None, "alice\\x9b2J'"),
        (ALICE + "\u2028x", NOTE, ["https://a.example/inbox"], None, "alice\\u2028x'"),
        (ALICE + "\u2029x", NOTE, ["https://a.example/inbox"], None, "control characters"),
        (ALICE + "\u202e", NOTE, ["https://a.example/inbox"], None, "alice\\u202e'"),
        (ALICE, {"content": "a\ud800b"}, ["https://a.example/inbox"], None, '"a\\ud800b"'),
        (ALICE, {"deep": DEEP}, ["https://a.example/inbox"], None, "nested too deeply"),
        # 101 deep: past what an event's data may be, read again by every part.
        (ALICE, {"deep": nested(99)}, ["https://a.example/inbox"], None, "more than 100 levels"),
        (
            ALICE,
            NOTE,
            ["https://a.example/inbox"],
            {"deadline": dt.timedelta.max},
            "days=999999999",
        ),
        (
            ALICE,
            NOTE,
            ["https://a.example/inbox"],
            {"deadline": dt.datetime.max.replace(tzinfo=dt.timezone(-dt.timedelta(hours=5)))},
            "9999-12-31",
        ),
    ],
)
def test_bad_input_is_refused_naming_the_value_and_nothing_is_written(
    sender: object, activity: object, inboxes: object, options: object, named: str
) -> None:
    with pytest.raises(InvalidDelivery) as raised:
        send_batch(sender, activity, inboxes, options)  # type: ignore[arg-type]
    assert named in str(raised.value)
    assert len(str(raised.value)) < 300, "the value is named, shortened"
    assert nothing_written()


@pytest.mark.django_db
def test_an_activity_nested_a_hundred_deep_is_queued_and_read_back_as_written() -> None:
    # The bound is the one an event's data has; up to it, what is stored is
    # what the loop, the admin and SKIP_IF read again.
    activity = {"type": "Create", "actor": ALICE, "deep": nested(98)}
    batch = send_batch(ALICE, activity, ["https://a.example/inbox"])
    assert json.loads(Batch.objects.get(pk=batch.pk).body) == activity


@pytest.mark.django_db
@pytest.mark.parametrize("how", ["send_batch", "send_webhook"])
def test_with_use_tz_off_the_batch_a_send_returns_has_the_times_django_reads(
    settings: Any, how: str
) -> None:
    """With ``USE_TZ`` off, the batch a send returns (and hands to
    ``post_save``) has its times as the same row read back: naive in
    ``TIME_ZONE``, where they were aware in UTC (``timezone.now() -
    batch.created_at`` raised ``TypeError``, and ``batch.save()`` on
    SQLite refused them)."""
    settings.USE_TZ = False
    settings.TIME_ZONE = "Europe/Paris"
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "WEBHOOKS": {"ops": "slack://hooks.slack.com/services/T0/B0/s3cretT0ken"},
    }
    if how == "send_batch":
        options = BatchOptions(deadline=dt.timedelta(hours=1), tag="post-1")
        batch = send_batch(ALICE, NOTE, ["https://a.example/inbox"], options)
    else:
        batch = send_webhook("ops", "alert.raised", {"host": "db1"})
    assert batch is not None
    stored = Batch.objects.get(pk=batch.pk)
    assert timezone.is_naive(stored.created_at)
    assert (batch.created_at, batch.deadline) == (stored.created_at, stored.deadline)
    assert timezone.now() - batch.created_at < dt.timedelta(minutes=1)
    batch.save()


@pytest.mark.django_db
def test_a_deadline_past_the_calendar_where_it_is_stored_is_refused_naming_it(
    settings: Any,
) -> None:
    # With USE_TZ off a deadline is stored and read in TIME_ZONE: one in the
    # calendar in UTC but past it in Tokyo raised a bare OverflowError on
    # SQLite, and on PostgreSQL was written, then failed every read of its
    # batch, the deliverer's claims with it ("the database is unavailable").
    settings.USE_TZ = False
    settings.TIME_ZONE = "Asia/Tokyo"
    deadline = dt.datetime(9999, 12, 31, 20, 0, tzinfo=dt.UTC)
    with pytest.raises(InvalidDelivery, match="deadline 9999-12-31T20:00:00"):
        send_batch(ALICE, NOTE, ["https://a.example/inbox"], {"deadline": deadline})
    assert nothing_written()


@pytest.mark.django_db
@pytest.mark.parametrize("given", ["never", "a timedelta"])
def test_a_deadline_past_the_calendar_where_it_is_shown_is_refused_naming_it(
    settings: Any, given: str
) -> None:
    # With USE_TZ the admin shows a deadline in TIME_ZONE: datetime.max in
    # UTC, the usual "never", was queued, and from then on the admin's batch
    # list and the batch's page failed (OverflowError) for every operator.
    settings.TIME_ZONE = "Europe/Paris"
    never = dt.datetime.max.replace(tzinfo=dt.UTC)
    deadline: dt.datetime | dt.timedelta = never
    named = "9999-12-31T23:59:59.999999+00:00"
    if given == "a timedelta":
        deadline = never - timezone.now() - dt.timedelta(minutes=1)
        named = f"days={deadline.days}"
    with pytest.raises(InvalidDelivery) as raised:
        send_batch(ALICE, NOTE, ["https://a.example/inbox"], {"deadline": deadline})
    assert named in str(raised.value) and "too far ahead" in str(raised.value)
    assert nothing_written()


@pytest.mark.django_db
def test_a_deadline_past_the_calendar_in_a_user_s_zone_is_refused() -> None:
    # TIME_ZONE "UTC" took datetime.max; the admin then failed for every
    # operator whose own zone (activated as Django's docs advise) is ahead.
    never = dt.datetime.max.replace(tzinfo=dt.UTC)
    with pytest.raises(InvalidDelivery, match="too far ahead"):
        send_batch(ALICE, NOTE, ["https://a.example/inbox"], {"deadline": never})
    assert nothing_written()
    latest = never - dt.timedelta(days=1)
    batch = send_batch(ALICE, NOTE, ["https://a.example/inbox"], {"deadline": latest})
    assert batch is not None and batch.deadline == latest
    assert latest.astimezone(dt.timezone(dt.timedelta(hours=14))).year == 9999


@pytest.mark.django_db
@pytest.mark.parametrize("use_tz", [True, False])
def test_a_deadline_before_the_calendar_is_refused_as_past(settings: Any, use_tz: bool) -> None:
    # It overflowed as it was converted to UTC (or to TIME_ZONE, where it
    # is kept with USE_TZ off), and was said to be "too far ahead".
    settings.USE_TZ = use_tz
    settings.TIME_ZONE = "America/New_York"
    early = dt.datetime(1, 1, 1, 1, tzinfo=dt.timezone(dt.timedelta(hours=5 if use_tz else 0)))
    with pytest.raises(InvalidDelivery) as raised:
        send_batch(ALICE, NOTE, ["https://a.example/inbox"], {"deadline": early})
    assert f"deadline {early.isoformat()} is already past" in str(raised.value)
    assert nothing_written()


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("activity", "said"),
    [
        ({"type": "Note", 1: "first", "1": "second"}, "both '1' in JSON at $"),
        ({"object": {"a": 1, None: 2, "null": 3}}, "both 'null' in JSON at $.object"),
        ({"tag": [{}, {True: 1, "true": 2}]}, "both 'true' in JSON at $.tag[1]"),
        ({"@context": [{"x": {2.5: 0, "2.5": 1}}]}, """both '2.5' in JSON at $["@context"][0].x"""),
        ({"a": ({-7: 0, "-7": 1},)}, "both '-7' in JSON at $.a[0]"),
    ],
)
def test_keys_that_are_one_once_written_as_json_are_refused_naming_where(
    activity: dict[Any, Any], said: str
) -> None:
    # A receiver would read one of the two, or refuse the body; the digest is of both.
    with pytest.raises(InvalidDelivery) as raised:
        send(ALICE, activity, ["https://a.example/inbox"])
    assert str(raised.value) == f"activity has two keys that are {said}"
    assert nothing_written()


@pytest.mark.django_db
def test_keys_of_other_types_that_stay_apart_in_json_are_sent_as_json_writes_them() -> None:
    activity = {"type": "Note", 1: "a", 1.0 + 0.5: "b", None: "c", False: "d", "1.0": "e"}
    batch = send(ALICE, {**activity, "object": [{2: "f", "3": "g"}]}, ["https://a.example/inbox"])
    assert batch is not None
    assert json.loads(Batch.objects.get().body) == {
        "type": "Note",
        "1": "a",
        "1.5": "b",
        "null": "c",
        "false": "d",
        "1.0": "e",
        "object": [{"2": "f", "3": "g"}],
    }


@pytest.mark.django_db
@pytest.mark.parametrize("kind", [{"x": 1}, [{"x": 1}, "Delete"], [["Delete"]], 5, None])
def test_a_type_that_is_no_name_is_sent_as_given(kind: Any) -> None:
    activity = {"type": kind, "object": "https://a.example/notes/1"}
    batch = send(ALICE, activity, ["https://a.example/inbox"])
    assert batch is not None and json.loads(Batch.objects.get().body) == activity
    assert batch.superseded == 0


@pytest.mark.django_db
def test_a_body_past_max_body_bytes_is_refused_as_encoded(settings: Any) -> None:
    settings.FEDERATION_DELIVERY = {**settings.FEDERATION_DELIVERY, "MAX_BODY_BYTES": 100}
    # 59 characters, 104 bytes in UTF-8: the limit is on what is sent.
    activity = {"content": "é" * 45}
    assert len(json.dumps(activity, ensure_ascii=False, separators=(",", ":"))) == 59
    with pytest.raises(InvalidDelivery, match=r"is 104 bytes as JSON, more than MAX_BODY_BYTES"):
        send(ALICE, activity, ["https://a.example/inbox"])
    assert nothing_written()
    assert send(ALICE, {"content": "é" * 30}, ["https://a.example/inbox"]) is not None


@pytest.mark.django_db
def test_more_inboxes_than_max_inboxes_are_refused_counted_once_each(settings: Any) -> None:
    settings.FEDERATION_DELIVERY = {**settings.FEDERATION_DELIVERY, "MAX_INBOXES": 3}
    with pytest.raises(InvalidDelivery, match=r"4 inboxes is more than MAX_INBOXES \(3\)"):
        send(ALICE, NOTE, [f"https://a.example/{n}" for n in range(4)])
    assert nothing_written()
    # A duplicate is one inbox.
    assert send(ALICE, NOTE, [f"https://a.example/{n % 3}" for n in range(6)]) is not None


@pytest.mark.django_db
def test_the_defaults_take_a_large_body_and_fan_out() -> None:
    body = {"content": "x" * 500_000}
    inboxes = [f"https://h{n % 50}.example/u{n}" for n in range(2_000)]
    batch = send(ALICE, body, inboxes)
    assert batch is not None and batch.size == 2_000
    assert Delivery.objects.filter(batch=batch).count() == 2_000


@pytest.mark.django_db
def test_batch_options_are_kept_on_the_batch() -> None:
    deadline = timezone.now() + dt.timedelta(hours=1)
    batch = send_batch(
        ALICE,
        NOTE,
        ["https://a.example/inbox"],
        BatchOptions(tag="move-followers", deadline=deadline, max_attempts=3),
    )
    assert batch is not None
    batch.refresh_from_db()
    assert (batch.tag, batch.deadline, batch.max_attempts) == ("move-followers", deadline, 3)
    relative = send_batch(
        ALICE, NOTE, ["https://a.example/inbox"], {"deadline": dt.timedelta(minutes=5)}
    )
    assert relative is not None and relative.deadline is not None
    assert relative.deadline > timezone.now() + dt.timedelta(minutes=4)


@pytest.mark.django_db
def test_lanes_follow_the_send(settings: object) -> None:
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,  # type: ignore[attr-defined]
        "PRIORITY_MAX_INBOXES": 2,
    }
    few = send(ALICE, NOTE, ["https://a.example/inbox"])
    many = send(ALICE, NOTE, [f"https://a.example/{n}" for n in range(3)])
    low = send_batch(ALICE, NOTE, ["https://a.example/inbox"], {"low_priority": True})
    assert few is not None and many is not None and low is not None
    assert (few.lane, many.lane, low.lane) == (Lane.PRIORITY, Lane.NORMAL, Lane.LOW)
    assert set(Delivery.objects.filter(batch=low).values_list("lane", flat=True)) == {Lane.LOW}


@pytest.mark.django_db
def test_a_fan_out_is_queued_with_hosts_taken_in_turn() -> None:
    inboxes = [f"https://{host}.example/u{n}" for host in "abc" for n in range(3)]
    send(ALICE, NOTE, inboxes)
    hosts = list(Delivery.objects.order_by("id").values_list("host", flat=True))
    assert hosts[:3] == ["a.example", "b.example", "c.example"]
    assert sorted(hosts) == sorted(h + ".example" for h in "abc" for _ in range(3))


@pytest.mark.django_db
def test_send_portable_takes_an_iterable_of_portable_inboxes_only() -> None:
    from django_federation_delivery import send_portable

    with pytest.raises(InvalidDelivery, match="PortableInbox"):
        send_portable(ALICE, NOTE, "ap://did:key:z6Mk/inbox")  # type: ignore[arg-type]
    assert nothing_written()


@pytest.mark.django_db
@pytest.mark.parametrize("portable", [False, True])
@pytest.mark.parametrize("binary", [bytes, bytearray, memoryview])
def test_one_inbox_given_as_binary_for_a_list_is_refused_naming_it(
    portable: bool, binary: type[bytes | bytearray | memoryview]
) -> None:
    # A bytearray or a memoryview (what a socket or a file read gives) was
    # iterated as numbers: every "inbox" skipped, None returned, nothing
    # queued, and only a WARNING line said so.
    from django_federation_delivery import send_portable

    given = binary(b"https://a.example/inbox")
    with pytest.raises(InvalidDelivery, match="inboxes must be an iterable of") as raised:
        (send_portable if portable else send_batch)(ALICE, NOTE, given)  # type: ignore[operator]
    assert ("<memory at" if binary is memoryview else f"<{binary.__name__}>") in str(raised.value)
    assert nothing_written()


@pytest.mark.django_db
def test_a_portable_inbox_with_an_at_in_its_path_is_shown_with_its_did() -> None:
    # Its DID's colons were read as a user and a password holding a "/":
    # skipped, it was listed as "ap://bob/inbox"; queued, shown so.
    from django_federation_delivery import PortableInbox, send_portable

    did = "did:key:z6MkhaXgBZDvotDkL5257faiztiGiC2QtKLGpbnnEGta2doK"
    alice, bob = (f"ap://{did}/users/@{name}/inbox" for name in ("alice", "bob"))
    batch = send_portable(
        ALICE, NOTE, [PortableInbox(alice, ["https://gw.example"]), PortableInbox(bob, [])]
    )
    assert batch is not None
    assert [item.inbox for item in batch.skipped] == [bob]
    assert str(Delivery.objects.get(batch=batch)).startswith(alice)


@pytest.mark.django_db
def test_send_portable_skips_what_is_not_a_portable_inbox_or_has_no_usable_gateway() -> None:
    from django_federation_delivery import PortableInbox, send_portable

    inboxes = [
        "ap://did:key:z6Mk/inbox",
        PortableInbox("ap://did:key:z6Mk/inbox?token=SECRET", ["ftp://gw.example"]),
    ]
    assert send_portable(ALICE, NOTE, inboxes) is None  # type: ignore[arg-type]
    assert nothing_written()
    batch = send_portable(
        ALICE, NOTE, [*inboxes, PortableInbox("ap://did:key:z6Mk/other", ["https://gw.example"])]
    )  # type: ignore[arg-type]
    assert batch is not None
    assert [(skipped.inbox, skipped.reason) for skipped in batch.skipped] == [
        ("ap://did:key:z6Mk/inbox", "is not a PortableInbox but str"),
        ("ap://did:key:z6Mk/inbox", "has no usable gateway"),
    ]


@pytest.mark.django_db
def test_a_portable_inbox_listed_again_with_a_usable_gateway_is_queued_not_skipped() -> None:
    # Listed twice (two recipients' actors), first with no usable gateway:
    # it was queued, and listed as skipped too ("Skipped 1 ... queued 1").
    from django_federation_delivery import PortableInbox, send_portable

    inbox = "ap://did:key:z6Mk/actor/inbox"
    batch = send_portable(
        ALICE,
        NOTE,
        [
            PortableInbox(inbox, ["https://gw.example/not/bare"]),
            PortableInbox(inbox, ["https://gw.example"]),
        ],
    )
    assert batch is not None
    assert Delivery.objects.get().inbox == inbox
    assert batch.skipped == []


@pytest.mark.django_db
def test_a_portable_inbox_goes_through_its_gateways_that_are_not_marked_unavailable() -> None:
    from django_federation_delivery import PortableInbox, availability, send_portable
    from django_federation_delivery.models import Host

    now = timezone.now()
    for name in ("dead.example", "gone.example"):
        Host.objects.create(name=name, failing_since=now, unavailable_since=now)
    availability.forget_known()
    inbox = "ap://did:key:z6MkAlice/actor/inbox"
    gateways = ["https://dead.example", "https://live.example", "https://gone.example"]
    batch = send_portable(
        ALICE, NOTE, [PortableInbox(inbox, gateways), PortableInbox(f"{inbox}2", gateways[::2])]
    )

    # The gateways gone for good are left out of the one it still has, which
    # now stands for its host; the one with none left is skipped.
    assert batch is not None
    assert [(skipped.inbox, skipped.reason) for skipped in batch.skipped] == [
        (f"{inbox}2", UNAVAILABLE)
    ]
    (row,) = Delivery.objects.all()
    assert (row.inbox, row.host) == (inbox, "live.example")
    assert row.via == ["https://live.example/.well-known/apgateway/did:key:z6MkAlice/actor/inbox"]


def test_a_portable_inbox_that_is_not_an_ap_uri_is_refused_naming_it() -> None:
    from django_federation_delivery import PortableInbox

    with pytest.raises(InvalidDelivery, match=re.escape("https://a.example/inbox")):
        PortableInbox("https://a.example/inbox", ["https://gw.example"])


@pytest.mark.django_db
def test_the_batch_a_send_returns_is_saved_as_the_orm_saves_one() -> None:
    from django.db.models.signals import post_save

    saved: list[tuple[Batch, bool]] = []

    def receiver(sender: Any, instance: Batch, created: bool, **kwargs: Any) -> None:
        saved.append((instance, created))

    post_save.connect(receiver, sender=Batch)
    try:
        batch = send(ALICE, NOTE, ["https://a.example/inbox"])
    finally:
        post_save.disconnect(receiver, sender=Batch)
    assert batch is not None and saved == [(batch, True)]
    assert not batch._state.adding and batch._state.db == "default"
    stored = Batch.objects.get(pk=batch.pk)
    assert (stored.size, stored.remaining, stored.body, stored.created_at) == (
        1,
        1,
        batch.body,
        batch.created_at,
    )
    assert [d.batch_id for d in Delivery.objects.all()] == [batch.pk]


#: A webhook's URL, pasted where something else goes: its path is the credential.
HOOK = "https://hooks.slack.com/services/T0AAAA1/B0BBBB2/s3cretT0kenV4lue9"


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("activity", "inboxes", "options"),
    [
        (HOOK, ["https://a.example/inbox"], None),
        (NOTE, HOOK, None),
        (NOTE, ["https://a.example/inbox"], HOOK),
        (NOTE, ["https://a.example/inbox"], {"deadline": HOOK}),
        (NOTE, ["https://a.example/inbox"], {"low_priority": HOOK}),
        (NOTE, ["https://a.example/inbox"], {"max_attempts": HOOK}),
        (NOTE, ["https://a.example/inbox"], {"synchronize_collection": [HOOK]}),
        (NOTE, ["https://a.example/inbox"], {"tag": HOOK.encode()}),
        (NOTE, ["https://a.example/inbox"], {"ordering_key": HOOK * 10}),
    ],
)
def test_a_credential_given_where_it_does_not_go_is_never_repeated(
    activity: Any, inboxes: Any, options: Any
) -> None:
    with pytest.raises(InvalidDelivery) as raised:
        send_batch(ALICE, activity, inboxes, options)
    said = str(raised.value)
    assert "s3cretT0ken" not in said and "B0BBBB2" not in said, said
    assert len(said) < 300, said
    assert nothing_written()


@pytest.mark.django_db
@pytest.mark.parametrize(
    "given",
    [
        "https://gw.example/.well-known/apgateway/did:key:z6Mk/inbox?token=t0kenS3CRET",
        "ap://did:key:z6Mk/inbox?token=t0kenS3CRET",
        "portable",
    ],
)
def test_one_portable_inbox_given_for_a_list_is_refused_without_its_query(given: str) -> None:
    from django_federation_delivery import PortableInbox, send_portable

    inboxes: object = given
    if given == "portable":
        inboxes = PortableInbox("ap://did:key:z6Mk/inbox?token=t0kenS3CRET", ["https://gw.example"])
    with pytest.raises(InvalidDelivery, match="iterable of PortableInbox") as raised:
        send_portable(ALICE, NOTE, inboxes)  # type: ignore[arg-type]
    assert "S3CRET" not in str(raised.value), str(raised.value)
    assert nothing_written()


@pytest.mark.django_db
@pytest.mark.parametrize("using", ["elsewhere", "", 0, True, ["default"]])
def test_a_database_not_in_databases_is_refused_naming_it(using: Any, settings: Any) -> None:
    from django_federation_delivery import mark_host_seen, send_webhook
    from django_federation_delivery.replay import replay

    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "WEBHOOKS": {"ops": HOOK.replace("https://", "slack://")},
    }
    said = f"no database named {re.escape(repr(using))} in DATABASES"
    with pytest.raises(InvalidDelivery, match=said):
        send_batch(ALICE, NOTE, ["https://a.example/inbox"], using=using)
    with pytest.raises(InvalidDelivery, match=said):
        send_webhook("ops", "alert.raised", {}, using=using)
    with pytest.raises(InvalidDelivery, match=said):
        replay(host="a.example", since=timezone.now(), using=using)
    with pytest.raises(InvalidDelivery, match=said):
        mark_host_seen("a.example", using=using)
    assert nothing_written()


@pytest.mark.django_db(databases=["default", "queue"])
@pytest.mark.usefixtures("default_refuses_the_app")
def test_with_a_router_putting_the_app_in_another_database_send_writes_there(
    settings: Any,
) -> None:
    # The app is routed to "queue", and "default" refuses any statement on
    # its tables, as where migrate made them in "queue" alone: whatever is
    # given no database works in the one the router names.
    from django_federation_delivery import controls, mark_host_seen, send_webhook

    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "WEBHOOKS": {"ops": HOOK.replace("https://", "slack://")},
    }
    batch = send(ALICE, NOTE, ["https://a.example/inbox", "https://b.example/inbox"])
    assert batch is not None and batch._state.db == "queue"
    assert send_webhook("ops", "alert.raised", {"x": 1}) is not None
    assert controls.pause_host("a.example") == 1
    assert controls.resume_host("a.example") == 1
    assert controls.give_up_host("b.example") == 1
    assert mark_host_seen("b.example") is False
    assert controls.reset_breaker("b.example") == 0
    assert sorted(Delivery.objects.using("queue").values_list("host", "status")) == [
        ("<ops>", Status.PENDING),
        ("a.example", Status.PENDING),
        ("b.example", Status.FAILED),
    ]


@pytest.mark.django_db
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_a_number_json_has_none_for_is_refused_naming_it_and_where(value: float) -> None:
    activity = {**NOTE, "object": {"type": "Note", "tag": [{"score": value}]}}
    with pytest.raises(InvalidDelivery) as refused:
        send(ALICE, activity, ["https://a.example/inbox"])
    assert f"{value!r} at $.object.tag[0].score, which JSON has no number for" in str(refused.value)
    assert not Batch.objects.exists()


SENDS: dict[str, Any] = {
    "send": lambda data: send(ALICE, data, ["https://a.example/inbox"]),
    "send_webhook": lambda data: send_webhook("ops", "post.created", data),
}


@pytest.fixture
def ops(settings: Any) -> None:
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "WEBHOOKS": {"ops": HOOK.replace("https://", "slack://")},
    }


@pytest.mark.django_db
@pytest.mark.usefixtures("ops")
@pytest.mark.parametrize("how", ["send", "send_webhook"])
@pytest.mark.parametrize(
    ("data", "said"),
    [
        # The encoder stops at the NaN; the tuple key after it is no JSON key.
        ({"type": "Note", "score": float("nan"), (1, 2): "x"}, "nan at $.score"),
        ({"type": "Note", "tag": {float("nan"): 1}}, "nan (a key) at $.tag"),
        ({"type": "Note", 10**5000: "x"}, "an integer (a key) at $, longer than the"),
        ({"type": "Note", "n": [10**5000]}, "an integer at $.n[0], longer than the"),
        # Named as "Object of type __proxy__ is not JSON serializable", and not where.
        (
            {"type": "Note", "object": {"summary": gettext_lazy("Hello")}},
            "a lazy translation (str() it first) at $.object.summary, which JSON cannot write",
        ),
        ({"type": "Note", "at": [dt.datetime(2026, 1, 1)]}, "a datetime at $.at[0], which"),
    ],
    ids=[
        "nan-before-a-tuple-key",
        "nan-key",
        "long-integer-key",
        "long-integer",
        "lazy-translation",
        "datetime",
    ],
)
def test_a_key_or_number_json_cannot_write_is_refused_naming_it_and_where(
    how: str, data: dict[Any, Any], said: str
) -> None:
    # Before, the tuple key and the long integer raised a TypeError or a
    # ValueError from the walk that looks for what to name, not
    # InvalidDelivery; the NaN key was refused naming neither it nor where.
    with pytest.raises(InvalidDelivery) as refused:
        SENDS[how](data)
    assert said in str(refused.value)
    assert not Batch.objects.exists() and not Delivery.objects.exists()


@pytest.mark.django_db
def test_an_activity_given_as_any_mapping_is_sent_as_a_dict_would_be() -> None:
    import types

    batch = send(ALICE, types.MappingProxyType(NOTE), ["https://a.example/inbox"])
    assert batch is not None
    assert json.loads(batch.body) == NOTE
