"""Every host's picture: what the deliverers saw of it, written every few
seconds; read by the admin's host page and ``delivery_status --host``."""

from __future__ import annotations

import datetime as dt
import json
import re
import time
from collections.abc import Callable
from io import StringIO
from typing import Any

import pytest
from django.contrib.admin.utils import quote
from django.core.management import CommandError, call_command
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from django_federation_delivery import hoststats, send, send_batch, send_webhook
from django_federation_delivery.breakers import Breakers, BreakerSettings, Decision
from django_federation_delivery.deliverer import Deliverer
from django_federation_delivery.hoststats import SAMPLES, HostStats
from django_federation_delivery.limits import REST, HostLimits
from django_federation_delivery.models import Breaker, Delivery, Host, Status
from django_federation_delivery.picture import host_picture
from django_federation_delivery.store.hosts import CHUNK, SeenHost, record_hosts

from .conftest import Inbox
from .keys import ALICE
from .test_admin import html, login, url
from .test_limits import Clock, answered, known

NOTE = {"type": "Create", "id": f"{ALICE}/activities/1", "actor": ALICE}


def seen(name: str, **fields: Any) -> SeenHost:
    values: dict[str, Any] = {
        "first_seen_at": None,
        "last_delivered_at": None,
        "last_error": "",
        "last_error_at": None,
        "answer_p50_ms": None,
        "answer_p95_ms": None,
        "concurrency_limit": None,
        "resting_until": None,
        **fields,
    }
    return SeenHost(name, **values)


@pytest.mark.django_db(transaction=True)
def test_what_a_deliverer_saw_of_each_host_is_written_for_its_picture(
    inboxes: Callable[..., Inbox],
) -> None:
    up = inboxes("127.0.0.2")
    down = inboxes("127.0.0.3", respond=lambda request: (503, {}, b"busy"))
    send(ALICE, NOTE, [up.url(f"/u{n}/inbox") for n in range(5)] + [down.url("/inbox")])
    before = timezone.now()
    Deliverer().run(drain=True)

    good = host_picture(up.host)
    assert good is not None
    assert good.trouble == "ok" and good.first_seen_at is not None
    assert good.first_seen_at >= before and good.last_delivered_at is not None
    # First seen at its first answer, not when the deliverer wrote it down.
    assert good.first_seen_at <= good.last_delivered_at
    assert good.answer_p50_ms is not None and good.answer_p95_ms is not None
    assert 0 < good.answer_p50_ms <= good.answer_p95_ms
    assert good.concurrency_limit is not None and good.concurrency_limit >= 1
    assert good.last_day["delivered"] == 5 and good.pending == 0

    bad = host_picture(down.host)
    assert bad is not None
    assert (bad.trouble, bad.pending, bad.last_delivered_at) == ("failing", 1, None)
    assert bad.failing_since is not None and "503" in bad.last_error
    assert host_picture("never.example") is None
    assert host_picture("") is None and host_picture("http://") is None
    assert host_picture("a\x00b") is None, "no name holds it: never asked of the database"


@pytest.mark.django_db
def test_a_hosts_answer_times_are_its_last_samples_whatever_it_was_sent() -> None:
    # 500 answers, 0 ms to 499 ms: what is written is of the last SAMPLES
    # (300 ms to 499 ms), kept in a bounded array overwritten oldest first.
    stats = HostStats(HostLimits(2, 2))
    for ms in range(500):
        stats.learn("busy.example", answered(seconds=ms / 1000), timezone.now())
    assert stats.write(now=timezone.now()) == 1
    host = Host.objects.get(name="busy.example")
    assert SAMPLES == 200
    assert host.answer_p50_ms == pytest.approx(399.5, abs=0.01)
    assert host.answer_p95_ms == pytest.approx(489, abs=0.01)
    kept = stats._hosts["busy.example"].answers
    assert len(kept) == SAMPLES and kept.itemsize == 4


@pytest.mark.django_db
def test_a_resting_host_shows_until_when_and_no_longer_once_it_is_over() -> None:
    # Refused at one four times in a row: it rests 0.8 s from the last.
    clock = Clock()
    limits = known(HostLimits(1, 8, clock=clock), "small.example")
    stats = HostStats(limits)
    now = timezone.now()
    for _ in range(4):
        limits.learn("small.example", answered(503))
        stats.learn("small.example", answered(503), now)
    stats.learn("big.example", answered(), now)
    clock.now += 0.3
    assert stats.write(now=now) == 2
    until = now + dt.timedelta(seconds=8 * REST - 0.3)
    host = Host.objects.get(name="small.example")
    assert host.resting_until == until
    assert Host.objects.get(name="big.example").resting_until is None
    picture = host_picture("small.example", now=now)
    assert picture is not None and picture.resting_until == until
    assert picture.as_json()["resting_until"] == until.isoformat()
    later = host_picture("small.example", now=until)
    assert later is not None and later.resting_until is None, "a rest over is none"
    # Another deliverer that sees it not resting does not undo the rest;
    # a later rest replaces it.
    record_hosts([seen("small.example", concurrency_limit=1)], now=now)
    assert Host.objects.get(name="small.example").resting_until == until
    record_hosts([seen("small.example", resting_until=until + dt.timedelta(seconds=5))], now=now)
    assert Host.objects.get(name="small.example").resting_until == until + dt.timedelta(seconds=5)


@pytest.mark.django_db
def test_hosts_past_a_statements_chunk_are_all_written_in_one_transaction() -> None:
    now = timezone.now()
    many = [seen(f"h{n}.example", answer_p50_ms=float(n)) for n in range(2 * CHUNK + 1)]
    with CaptureQueriesContext(connection) as captured:
        assert record_hosts(many, now=now) == len(many)
    # A statement a chunk, not one value of every host: a bounded size.
    writes = [q["sql"] for q in captured.captured_queries if "INSERT INTO" in q["sql"]]
    assert len(writes) == 3, [len(sql) for sql in writes]
    written = dict(Host.objects.values_list("name", "answer_p50_ms"))
    assert written == {host.name: host.answer_p50_ms for host in many}


@pytest.mark.django_db
def test_a_host_is_first_seen_when_its_first_request_went_out() -> None:
    # A slow host's first attempt came back 9 s after it began: it was first
    # seen then, not at the answer.
    stats = HostStats(HostLimits(2, 8))
    now = timezone.now()
    stats.learn("slow.example", answered(202, seconds=9.0), now)
    stats.learn("slow.example", answered(202, seconds=1.0), now + dt.timedelta(seconds=5))
    stats.write(now=now + dt.timedelta(seconds=5))
    host = Host.objects.get(name="slow.example")
    assert host.first_seen_at == now - dt.timedelta(seconds=9)
    assert host.last_delivered_at == now + dt.timedelta(seconds=5)


@pytest.mark.django_db
def test_a_host_is_first_seen_at_the_earliest_sighting_any_deliverer_wrote() -> None:
    now = timezone.now()
    minute = dt.timedelta(minutes=1)
    record_hosts([seen("a.example", first_seen_at=now - minute)], now=now)
    assert Host.objects.get(name="a.example").first_seen_at == now - minute
    # Another deliverer, which first saw it later, and one that saw it earlier.
    record_hosts([seen("a.example", first_seen_at=now)], now=now)
    assert Host.objects.get(name="a.example").first_seen_at == now - minute
    record_hosts([seen("a.example", first_seen_at=now - 2 * minute)], now=now)
    assert Host.objects.get(name="a.example").first_seen_at == now - 2 * minute
    # A row made without one (a pause) takes the first sighting written.
    Host.objects.create(name="b.example", paused_at=now)
    record_hosts([seen("b.example", first_seen_at=now - minute)], now=now)
    assert Host.objects.get(name="b.example").first_seen_at == now - minute
    # No sighting given: the time of the write.
    record_hosts([seen("c.example")], now=now)
    assert Host.objects.get(name="c.example").first_seen_at == now


@pytest.mark.django_db
def test_a_later_success_or_error_is_never_undone_by_an_older_one() -> None:
    now = timezone.now()
    hour = dt.timedelta(hours=1)
    record_hosts(
        [seen("a.example", last_delivered_at=now, last_error="new", last_error_at=now)], now=now
    )
    record_hosts(
        [
            seen(
                "a.example",
                last_delivered_at=now - hour,
                last_error="old",
                last_error_at=now - hour,
                answer_p50_ms=12.0,
                concurrency_limit=4,
            )
        ],
        now=now + hour,
    )
    host = Host.objects.get(name="a.example")
    assert (host.last_delivered_at, host.last_error, host.last_error_at) == (now, "new", now)
    assert (host.first_seen_at, host.answer_p50_ms, host.concurrency_limit) == (now, 12.0, 4)
    assert host.updated_at == now + hour


@pytest.mark.django_db
def test_delivery_status_shows_one_hosts_picture_and_its_json() -> None:
    now = timezone.now()
    Host.objects.create(
        name="a.example",
        failing_since=now - dt.timedelta(hours=2),
        answer_p50_ms=40.0,
        answer_p95_ms=900.0,
        concurrency_limit=3,
        last_error="HTTP 503",
        last_error_at=now,
    )
    Breaker.objects.create(key="a.example", failures=7)
    batch = send(ALICE, NOTE, ["https://a.example/1", "https://a.example/2"])
    Delivery.objects.filter(batch=batch, inbox="https://a.example/2").update(
        status=Status.FAILED, settled_at=now, due_at=None
    )
    out = StringIO()
    call_command("delivery_status", "--host", "a.example", stdout=out)
    text = out.getvalue()
    assert text.startswith("a.example\n")
    assert re.search(r"answer time p50 / p95\s+40 ms / 900 ms", text)
    assert re.search(r"breaker\s+closed \(7 failures in a row\)", text)
    assert re.search(r"pending \(held\)\s+1 \(0\)", text)
    assert re.search(r"resting until\s+—", text)
    assert "failed 1" in text and "HTTP 503" in text
    out = StringIO()
    call_command("delivery_status", "--host", "a.example", "--json", stdout=out)
    document = json.loads(out.getvalue())
    assert (document["trouble"], document["failures_in_a_row"]) == ("failing", 7)
    assert document["last_day"]["failed"] == 1 and document["concurrency_limit"] == 3
    assert document["resting_until"] is None
    with pytest.raises(CommandError, match=r"'b\.example'"):
        call_command("delivery_status", "--host", "b.example")


@pytest.mark.django_db
@pytest.mark.parametrize("named", ["Bücher.Example.", "https://bücher.example/users/bob"])
def test_a_host_is_shown_however_it_is_written(named: str) -> None:
    send(ALICE, NOTE, ["https://bücher.example/inbox"])
    out = StringIO()
    call_command("delivery_status", "--host", named, stdout=out)
    assert out.getvalue().startswith("xn--bcher-kva.example\n")
    assert re.search(r"pending \(held\)\s+1 \(0\)", out.getvalue())


@pytest.mark.django_db
def test_a_webhook_destination_is_shown_by_its_key(settings: Any) -> None:
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "WEBHOOKS": {"ops": "slack://hooks.slack.com/services/T0PIC/B0PIC/picS3cret"},
    }
    send_webhook("ops", "alert.raised", {"host": "db1"})
    out = StringIO()
    call_command("delivery_status", "--host", "<ops>", stdout=out)
    assert out.getvalue().startswith("<ops>\n")
    assert re.search(r"pending \(held\)\s+1 \(0\)", out.getvalue())
    assert "picS3cret" not in out.getvalue()


@pytest.mark.django_db
def test_the_hosts_list_puts_the_most_troubled_first_and_a_host_page_shows_it_all() -> None:
    now = timezone.now()
    Host.objects.create(
        name="a-ok.example",
        concurrency_limit=8,
        resting_until=dt.datetime(2020, 1, 2, tzinfo=dt.UTC),  # over: not shown
    )
    Host.objects.create(
        name="b-paused.example",
        paused_at=now,
        resting_until=dt.datetime(2100, 1, 2, tzinfo=dt.UTC),
    )
    Host.objects.create(
        name="c-failing-lately.example",
        failing_since=now,
        answer_p50_ms=44.4,
        answer_p95_ms=48.09015989303589,
    )
    Host.objects.create(name="d-failing-long.example", failing_since=now - dt.timedelta(days=1))
    Host.objects.create(
        name="e-gone.example", failing_since=now - dt.timedelta(days=8), unavailable_since=now
    )
    client = login("operator")
    page = html(client, url("host"))
    order = [m.group(1) for m in re.finditer(r">([a-e]-[a-z-]+\.example)<", page)]
    assert order == [
        "e-gone.example",
        "d-failing-long.example",
        "c-failing-lately.example",
        "b-paused.example",
        "a-ok.example",
    ]
    detail = html(client, url("host", "change", "d-failing-long.example")).lower()
    for label in ("failures in a row", "answer time p95", "limit at once", "last 24 hours"):
        assert label in detail, label
    assert "2100" in page and "2020" not in page
    for name, shown in (("a-ok.example", False), ("b-paused.example", True)):
        detail = html(client, url("host", "change", name)).lower()
        assert "resting until" in detail
        assert ("2100" in detail) is shown and "2020" not in detail
        assert "none" not in re.sub(r"<[^>]+>", " ", detail), "an empty field is a dash"
    # Answer times as the command shows them, in whole milliseconds.
    assert "48 ms" in page and "48.09" not in page
    detail = html(client, url("host", "change", "c-failing-lately.example"))
    assert "44 ms" in detail and "48 ms" in detail and "44.4" not in detail


def shown_field(page: str, name: str) -> str:
    found = re.search(rf'field-{name}\b.*?<div class="readonly">(.*?)</div>', page, re.S)
    assert found is not None, name
    return found.group(1)


@pytest.mark.django_db
@pytest.mark.parametrize("kept", ["Victim.Example.", "victim.example:443"])
def test_a_host_page_pictures_its_row_by_the_name_it_keeps(kept: str) -> None:
    # A row named as no send names a host (an older version's, a host
    # project's) is that row's page, never another host's picture.
    send(ALICE, NOTE, ["https://victim.example/inbox"])
    Delivery.objects.update(status=Status.DELIVERED, settled_at=timezone.now(), due_at=None)
    Breaker.objects.create(
        key="victim.example", failures=7, open_until=timezone.now() + dt.timedelta(minutes=5)
    )
    Host.objects.create(name="victim.example")
    Host.objects.create(name=kept)
    client = login("operator")
    victim = html(client, url("host", "change", "victim.example"))
    assert shown_field(victim, "breaker") == "open (7)"
    assert "delivered 1" in shown_field(victim, "last_day")
    page = html(client, url("host", "change", quote(kept)))
    assert shown_field(page, "breaker") == "closed (0)"
    assert "delivered 0" in shown_field(page, "last_day")


# A breaker's failures in a row, as the picture shows them.


@pytest.mark.django_db
def test_failures_in_a_row_start_again_at_a_success_seen_between_two_writes() -> None:
    # A host failed 9 times (written). Then, before the breakers' next write,
    # it accepted one delivery and failed two: 2 failures in a row.
    Host.objects.create(name="flaky.example")
    breakers = Breakers(BreakerSettings(threshold=10, cool_off=60.0))
    now = timezone.now()
    for _ in range(9):
        breakers.record("flaky.example", failed=True, probe="", now=now)
    breakers.flush()
    breakers.record("flaky.example", failed=False, probe="", now=now)
    breakers.record("flaky.example", failed=True, probe="", now=now)
    breakers.record("flaky.example", failed=True, probe="", now=now)
    breakers.flush()
    picture = host_picture("flaky.example")
    assert picture is not None
    assert (picture.breaker, picture.failures_in_a_row) == ("closed", 2), (
        f"after 9 failures, a success, then 2 failures the picture shows "
        f"breaker {picture.breaker!r} with {picture.failures_in_a_row} failures in a row"
    )


@pytest.mark.django_db
def test_failures_in_a_row_after_a_failed_probe_are_not_shown_as_none() -> None:
    # Two failures open the breaker; its probe, the next attempt, fails too:
    # three attempts in a row failed.
    Host.objects.create(name="down.example")
    breakers = Breakers(BreakerSettings(threshold=2, cool_off=0.2))
    now = timezone.now()
    for _ in range(2):
        breakers.record("down.example", failed=True, probe="", now=now)
    breakers.flush()
    assert host_picture("down.example").failures_in_a_row == 2  # type: ignore[union-attr]
    time.sleep(0.3)
    decision, token, _held = breakers.admit("down.example", timezone.now())
    assert decision is Decision.PROBE and token
    breakers.record("down.example", failed=True, probe=token, now=timezone.now())
    breakers.flush()
    picture = host_picture("down.example")
    assert picture is not None and picture.breaker == "open"
    assert picture.failures_in_a_row >= 3, (
        f"3 failed attempts in a row (2, then the probe): the picture shows "
        f"{picture.failures_in_a_row} failures in a row"
    )


@pytest.mark.django_db
def test_answer_times_of_a_host_survive_a_write_when_the_deliverer_knows_many_hosts() -> None:
    # A deliverer that has sent to more than MOST_HOSTS // 2 hosts: a host
    # answered 100 times in 10 ms, is written, then answers once in 1000 ms.
    # Its median of its last answers (at most 200) is 10 ms.
    stats = HostStats(HostLimits(2, 8))
    now = timezone.now()
    for n in range(hoststats.MOST_HOSTS // 2):
        stats.learn(f"h{n}.example", answered(seconds=0.05), now)
    for _ in range(100):
        stats.learn("steady.example", answered(seconds=0.010), now)
    stats.write(now=now)
    assert Host.objects.get(name="steady.example").answer_p50_ms == pytest.approx(10, abs=0.01)
    stats.learn("steady.example", answered(seconds=1.0), now)
    stats.write(now=now)
    host = Host.objects.get(name="steady.example")
    assert host.answer_p50_ms == pytest.approx(10, abs=0.01), (
        f"median of 100 answers of 10 ms and one of 1000 ms shown as {host.answer_p50_ms} ms"
    )
    assert host.answer_p95_ms == pytest.approx(10, abs=0.01), host.answer_p95_ms


SLACK_TOKEN = "Tok3nS3cretValue42"


@pytest.mark.django_db(transaction=True)
def test_a_destination_gone_shows_its_410_as_its_last_error(
    inboxes: Callable[..., Inbox], settings: Any
) -> None:
    box = inboxes("127.0.0.6", respond=lambda request: (410, {}, b"this hook was removed"))
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "WEBHOOKS": {"ops": f"slack+http://{box.host}/services/T0/B0/{SLACK_TOKEN}"},
    }
    send_webhook("ops", "alert.raised", {"host": "db1"})
    Deliverer().run(drain=True)
    assert len(box.received) == 1
    picture = host_picture("<ops>")
    assert picture is not None and picture.trouble == "paused"
    assert "410" in picture.last_error, (
        f"the destination answered 410 Gone; its picture's last error is {picture.last_error!r}, "
        f"first seen {picture.first_seen_at}, answer p50 {picture.answer_p50_ms}"
    )
    assert picture.first_seen_at is not None
    assert SLACK_TOKEN not in picture.last_error


@pytest.mark.django_db
def test_answer_times_of_a_host_idle_for_one_write_are_kept_among_many_hosts() -> None:
    """A deliverer sending to more than 10,000 hosts: one that answered 100
    times in 10 ms, then was not sent to for one 10-second write, then
    answered once in 1000 ms, is shown the median of its last answers, 10
    ms: its answer times were thrown away whenever it missed a write, and
    it was shown 1000 ms. What is forgotten is the host seen least lately."""
    stats = HostStats(HostLimits(2, 8))
    now = timezone.now()
    for _ in range(100):
        stats.learn("steady.example", answered(seconds=0.010), now)
    stats.write(now=now)
    assert Host.objects.get(name="steady.example").answer_p50_ms == pytest.approx(10, abs=0.01)
    # The next 10 seconds: the deliverer sends to many other hosts, not this one.
    for n in range(hoststats.MOST_HOSTS // 2 + 1):
        stats.learn(f"h{n}.example", answered(seconds=0.05), now)
    stats.write(now=now)
    # Then it answers once, slowly.
    stats.learn("steady.example", answered(seconds=1.0), now)
    stats.write(now=now)
    host = Host.objects.get(name="steady.example")
    assert host.answer_p50_ms == pytest.approx(10, abs=0.01), (
        f"median of 100 answers of 10 ms and one of 1000 ms shown as {host.answer_p50_ms} ms"
    )


@pytest.mark.django_db(transaction=True)
def test_a_host_whose_inbox_breaker_is_open_is_shown_open(
    inboxes: Callable[..., Inbox], settings: Any
) -> None:
    """With ``BREAKER["SCOPE"] = "inbox"`` (as Mastodon keeps them), a host
    whose one inbox has failed again and again, its breaker open, shows so
    on its page and in ``delivery_status --host``, its inboxes' worst, not
    "closed (0 failures in a row)" for want of a breaker keyed by its name."""
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "BREAKER": {"THRESHOLD": 2, "COOL_OFF": 60.0, "SCOPE": "inbox"},
        "RETRY": {"BASE": 0.05, "CAP": 0.1, "ATTEMPTS": 4, "JITTER": 0.0},
    }
    down = inboxes("127.0.0.3", respond=lambda request: (503, {}, b"down"))
    send_batch(ALICE, NOTE, [down.url("/inbox")], {"max_attempts": 4})
    Deliverer().run(stop_after=1.5)
    (breaker,) = Breaker.objects.all()
    assert breaker.state in ("open", "half-open") and breaker.failures >= 2
    picture = host_picture(down.host)
    assert picture is not None
    assert (picture.breaker, picture.failures_in_a_row) != ("closed", 0), (
        f"its inbox's breaker is {breaker.state} after {breaker.failures} failures in a row"
    )


@pytest.mark.django_db(transaction=True)
def test_refusals_to_requests_sent_one_at_a_time_each_halve_the_limit(
    inboxes: Callable[..., Inbox], settings: Any
) -> None:
    """A host grown to 8 answers 503 to four requests in a row, each sent
    alone after the answer to the one before: none was in flight when the
    limit fell, so each halves it, down to 1 (shown so on its page). Taken
    for answers to requests in flight at the fall, three of them left it at
    4, and the next fan-out was sent 4 at once."""
    settings.FEDERATION_DELIVERY = {**settings.FEDERATION_DELIVERY, "BREAKER": {}}
    status = [202]
    # Each answer 0.1 s: one three times slower (a sign of overload) is then
    # 0.3 s late, not the 2 ms of an answer at once, which a machine running
    # every run of CI at once may well take, and halve the limit as it grows.
    inbox = inboxes("127.0.0.2", respond=lambda request: (status[0], {}, b""), delay=0.1)
    deliverer = Deliverer(per_host=2, per_host_max=8)
    for n in range(6):
        send_batch(ALICE, {**NOTE, "id": f"{NOTE['id']}/ok{n}"}, [inbox.url(f"/{n}")], {})
        deliverer.run(drain=True)
    assert deliverer.limits.limit(inbox.host) == 8
    status[0] = 503
    for n in range(4):
        note = {**NOTE, "id": f"{NOTE['id']}/busy{n}"}
        send_batch(ALICE, note, [inbox.url(f"/busy/{n}")], {"max_attempts": 1})
        deliverer.run(drain=True)
    assert len(inbox.received) == 10
    picture = host_picture(inbox.host)
    assert picture is not None
    assert picture.concurrency_limit == 1, (
        f"four 503s in a row, each to a request sent alone: sent {picture.concurrency_limit} "
        "at once next"
    )


@pytest.mark.django_db(transaction=True)
def test_a_host_that_asks_to_wait_is_sent_nothing_more_until_then(
    inboxes: Callable[..., Inbox],
) -> None:
    """A host answers 429 with ``Retry-After: 3`` to a fan-out of six of its
    inboxes: the two sent at once wait, and so does the host, for its other
    four. Its Retry-After held only the delivery it answered: the others
    were sent one after the other, 0.1 s apart, each refused in its turn."""
    inbox = inboxes("127.0.0.2", respond=lambda request: (429, {"Retry-After": "3"}, b""))
    send(ALICE, NOTE, [inbox.url(f"/{n}") for n in range(6)])
    deliverer = Deliverer(per_host=2, per_host_max=8)
    deliverer.run(stop_after=1.5)
    assert len(inbox.received) == 2, [request.path for request in inbox.received]
    assert sorted(Delivery.objects.values_list("attempts", flat=True)) == [0, 0, 0, 0, 1, 1]
    assert deliverer.limits.rest_left(inbox.host) > 0


def _open_breaker(key: str, failures: int = 12) -> None:
    Breaker.objects.create(
        key=key, failures=failures, open_until=timezone.now() + dt.timedelta(minutes=5)
    )


@pytest.mark.django_db
def test_a_plain_http_hosts_open_inbox_breaker_is_shown_on_its_own_page() -> None:
    """BREAKER SCOPE "inbox": the inbox http://plain.example/inbox (host key
    ``plain.example:80``) has an open breaker. Its host's page says so; the
    page of ``plain.example`` (the HTTPS server, another host) does not."""
    Host.objects.create(name="plain.example:80")
    Host.objects.create(name="plain.example")
    _open_breaker("http://plain.example/inbox")
    own = host_picture("plain.example:80")
    other = host_picture("plain.example")
    assert own is not None and other is not None
    assert (own.breaker, own.failures_in_a_row) == ("open", 12), (
        f"plain.example:80 shown {own.breaker}, {own.failures_in_a_row} failures"
    )
    assert (other.breaker, other.failures_in_a_row) == ("closed", 0), (
        f"plain.example (HTTPS) shown {other.breaker} for another port's inbox"
    )


@pytest.mark.django_db
@pytest.mark.parametrize("host", ["2001:db8::1", "2001::1", "::1"])
def test_an_ipv6_hosts_open_inbox_breaker_is_shown_on_its_page(host: str) -> None:
    """BREAKER SCOPE "inbox": the inbox https://[2001:db8::1]/inbox (host key
    ``2001:db8::1``, unbracketed on 443) has an open breaker after 12
    failures: its host's page, and ``delivery_status --host``, say so."""
    Host.objects.create(name=host)
    _open_breaker(f"https://[{host}]/inbox")
    picture = host_picture(host)
    assert picture is not None
    assert (picture.breaker, picture.failures_in_a_row) == ("open", 12), (
        f"shown {picture.breaker}, {picture.failures_in_a_row} failures"
    )


@pytest.mark.django_db
def test_a_strangers_inbox_breakers_naming_a_host_leave_its_open_breaker_shown(
    settings: Any,
) -> None:
    """BREAKER SCOPE "inbox". A stranger's server has 500 failing inboxes
    whose paths spell another host's name (https://evil.example/victim.example/N).
    victim.example's own inbox breaker is open after 12 failures: its
    picture says so, not "closed (0)" for the stranger's keys read first."""
    Breaker.objects.bulk_create(
        Breaker(key=f"https://evil.example/victim.example/{n}", failures=1) for n in range(500)
    )
    _open_breaker("https://victim.example/inbox")
    Host.objects.create(name="victim.example")
    picture = host_picture("victim.example")
    assert picture is not None
    assert (picture.breaker, picture.failures_in_a_row) == ("open", 12)


@pytest.mark.skipif(
    connection.vendor != "postgresql",
    reason="PostgreSQL keeps the instant; SQLite's naive text cannot tell the two 01:10s",
)
@pytest.mark.django_db
def test_a_breaker_opened_in_the_hour_a_clock_goes_back_through_is_pictured_open(
    settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # New York with USE_TZ off, 01:10 EDT the night the clocks go back: the
    # breaker opens for an hour, until 01:10 EST. At 01:20 EDT the host's
    # picture said "half-open": the wall-clock times the ORM reads were
    # compared (01:20 < 01:10 is false), not the instants.
    from django_federation_delivery.breakers import take_probe
    from django_federation_delivery.dialect import aware_now

    settings.USE_TZ = False
    settings.TIME_ZONE = "America/New_York"
    monkeypatch.setattr(timezone, "now", lambda: dt.datetime(2024, 11, 3, 1, 10))
    Host.objects.create(name="a.example")
    breakers = Breakers(BreakerSettings(threshold=2, cool_off=3600.0))
    breakers.refresh()
    for _ in range(2):
        breakers.record("a.example", failed=True, probe="", now=aware_now())
    breakers.flush()
    monkeypatch.setattr(timezone, "now", lambda: dt.datetime(2024, 11, 3, 1, 20))
    assert take_probe("a.example", cool_off=3600.0) is None, "the breakers hold it"
    picture = host_picture("a.example")
    assert picture is not None and picture.breaker == "open"


@pytest.mark.django_db
def test_a_host_s_picture_counts_the_breaker_of_a_portable_inbox_kept_under_it(
    settings: Any,
) -> None:
    # Kept per inbox, a portable inbox's breaker (keyed by its ap:// name)
    # was left out of the host its rows are kept under: "closed", while it
    # held what was pending there.
    from django_federation_delivery import PortableInbox, send_portable

    from .operators import open_breaker
    from .test_federation import DID

    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "BREAKER": {"THRESHOLD": 1, "COOL_OFF": 60.0, "SCOPE": "inbox"},
    }
    inbox = f"ap://{DID}/actor/inbox"
    send_portable(ALICE, NOTE, [PortableInbox(inbox, ["https://gw.example"])])
    open_breaker(inbox, failures=7)
    picture = host_picture("gw.example")
    assert picture is not None and picture.pending == 1
    assert (picture.breaker, picture.failures_in_a_row) == ("open", 7)
