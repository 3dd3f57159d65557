"""Hosts gone for good stop costing: marked unavailable after a week without
a success, skipped by sends, probed once a day, cleared when seen again."""

from __future__ import annotations

import datetime as dt
import re
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from django.core.management import call_command
from django.db import OperationalError, connections, transaction
from django.utils import timezone

from django_federation_delivery import (
    PortableInbox,
    availability,
    mark_host_seen,
    send,
    send_portable,
    signals,
    upkeep,
)
from django_federation_delivery.addresses import host_of, quoted, split
from django_federation_delivery.availability import (
    PROBE_ROUND,
    PROBES_LEAST,
    PROBES_MOST,
    mark_unavailable,
    probe_due,
    probes_a_round,
    unavailable_hosts,
)
from django_federation_delivery.deliverer import Deliverer
from django_federation_delivery.dialect import aware_now
from django_federation_delivery.health import HostWatch
from django_federation_delivery.models import Batch, Delivery, Host, Status
from django_federation_delivery.sending import UNAVAILABLE
from django_federation_delivery.store import claims

from .conftest import Inbox
from .keys import ALICE
from .test_federation import DID
from .test_health import answered

WEEK = 7 * 86400.0
NOTE = {"type": "Create", "id": f"{ALICE}/activities/1", "actor": ALICE}


def failing(name: str, days: float, **fields: Any) -> Host:
    since = timezone.now() - dt.timedelta(days=days)
    return Host.objects.create(name=name, failing_since=since, **fields)


@pytest.fixture
def recovered() -> Iterator[list[signals.HostRecovered]]:
    told: list[signals.HostRecovered] = []

    def receive(recovered: signals.HostRecovered, **kwargs: Any) -> None:
        told.append(recovered)

    signals.host_recovered.connect(receive, weak=False)
    yield told
    signals.host_recovered.disconnect(receive)


@pytest.mark.django_db
def test_a_host_failing_for_a_week_is_marked_once_and_a_day_is_not_enough() -> None:
    failing("gone.example", 8)
    failing("flaky.example", 1)
    Host.objects.create(name="fine.example")
    assert mark_unavailable(WEEK) == ["gone.example"]
    assert mark_unavailable(WEEK) == [], "once, however many deliverers look"
    assert unavailable_hosts() == {"gone.example"}
    assert mark_unavailable(None) == []


@pytest.mark.django_db
def test_a_host_delivered_to_since_it_began_failing_is_not_marked_unavailable() -> None:
    # The deliverer that delivered there may not have cleared its failing
    # since yet (health.py reads the failing hosts every so often); every
    # deliverer writes when it last delivered to a host (hoststats.py).
    now = timezone.now()
    failing("back.example", 8, last_delivered_at=now - dt.timedelta(hours=1))
    failing("gone.example", 8, last_delivered_at=now - dt.timedelta(days=9))
    assert mark_unavailable(WEEK) == ["gone.example"]


@pytest.mark.django_db
def test_a_send_skips_an_unavailable_hosts_inboxes_and_says_so() -> None:
    failing("gone.example", 8, unavailable_since=timezone.now())
    batch = send(ALICE, NOTE, ["https://gone.example/inbox", "https://up.example/inbox"])
    assert batch is not None
    assert list(Delivery.objects.values_list("inbox", flat=True)) == ["https://up.example/inbox"]
    assert [(s.inbox, s.reason) for s in batch.skipped] == [
        ("https://gone.example/inbox", UNAVAILABLE)
    ]
    assert batch.size == 1
    assert send(ALICE, NOTE, ["https://gone.example/u/1/inbox"]) is None
    assert Batch.objects.count() == 1, "nothing written for a send to it alone"


@pytest.mark.django_db(transaction=True)
def test_a_host_seen_again_is_sent_to_and_told_recovered(
    recovered: list[signals.HostRecovered],
) -> None:
    now = timezone.now()
    failing("gone.example", 8, unavailable_since=now, failing_told_at=now)
    assert send(ALICE, NOTE, ["https://gone.example/inbox"]) is None
    assert mark_host_seen("gone.example") is True
    host = Host.objects.get(name="gone.example")
    assert (host.unavailable_since, host.failing_since, host.failing_told_at) == (None, None, None)
    assert [r.host for r in recovered] == ["gone.example"]
    assert send(ALICE, NOTE, ["https://gone.example/inbox"]) is not None
    assert mark_host_seen("gone.example") is False
    assert mark_host_seen("never.example") is False
    # Failing but not yet unavailable: it was marked, and is no longer.
    failing("failing.example", 0.5)
    assert mark_host_seen("failing.example") is True
    assert Host.objects.get(name="failing.example").failing_since is None


@pytest.mark.django_db(transaction=True)
def test_a_delivery_an_unavailable_host_accepts_clears_its_mark_as_seeing_it_does(
    recovered: list[signals.HostRecovered],
) -> None:
    # It cleared its failing since and told it recovered, but left it
    # marked: sends skipped it until its next probe, up to a day on.
    now = timezone.now()
    failing("gone.example", 8, unavailable_since=now, failing_told_at=now)
    assert unavailable_hosts() == {"gone.example"}
    row = claims.Claimed(1, 1, "https://gone.example/inbox", "gone.example", 0, (), "t", 0.0)
    HostWatch(3600.0)(row, answered(202), aware_now())  # a retry, queued before the mark
    host = Host.objects.get(name="gone.example")
    assert (host.unavailable_since, host.failing_since, host.failing_told_at) == (None, None, None)
    assert unavailable_hosts() == frozenset(), "sent to again, at once"
    assert send(ALICE, NOTE, ["https://gone.example/inbox"]) is not None
    assert mark_host_seen("gone.example") is False
    assert [r.host for r in recovered] == ["gone.example"], "told once"


@pytest.mark.django_db(transaction=True)
def test_with_use_tz_off_a_host_seen_again_is_told_recovered_at_aware_times(
    settings: Any, recovered: list[signals.HostRecovered]
) -> None:
    # A signal's times are aware whatever USE_TZ says: the host project
    # compares them with the deliverer's (host_failing's).
    settings.USE_TZ = False
    settings.TIME_ZONE = "America/Los_Angeles"
    now = timezone.now()
    failing("gone.example", 8, unavailable_since=now, failing_told_at=now)
    assert mark_host_seen("gone.example") is True
    [told] = recovered
    assert timezone.is_aware(told.failing_since) and timezone.is_aware(told.recovered_at)
    assert told.recovered_at - told.failing_since >= dt.timedelta(days=8)


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    "seen",
    [
        "Bücher.example",
        "BÜCHER.example.",
        "https://bücher.example/users/alice",
        "https://bücher.example/users/a\u200bl\u202eice",
    ],
)
def test_a_host_is_seen_by_its_name_in_any_form_or_a_url_on_it(seen: str) -> None:
    now = timezone.now()
    failing("xn--bcher-kva.example", 8, unavailable_since=now)
    assert mark_host_seen(seen) is True
    assert Host.objects.get(name="xn--bcher-kva.example").unavailable_since is None
    # A webhook destination's key is no host name, and is taken as it is.
    failing("<ops>", 8, unavailable_since=now)
    assert mark_host_seen("<ops>") is True


@pytest.mark.django_db
@pytest.mark.parametrize(
    "bad",
    [
        *("", "  ", "https:///nothing", None, "a\x00b", "a\x1b[2Jb"),
        # Names no inbox's host can have: taken as they were, they cleared
        # nothing, and the call said "not marked" of a typing mistake.
        *("exa mple.com", "example.com:99999", "example.com:https", "<not a destination>"),
    ],
)
def test_a_host_seen_that_names_no_host_is_refused_naming_it(bad: Any) -> None:
    # A URL is named by its origin only: its path may be the credential.
    with pytest.raises(ValueError, match=re.escape(quoted(bad))):
        mark_host_seen(bad)


@pytest.mark.django_db(transaction=True)
def test_a_host_seen_while_another_thread_reads_the_marks_is_sent_to_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A thread reads the unavailable hosts (its minute over) just as another
    thread of the process marks one seen and commits: what the first read
    before that is not kept, or every send here would skip the host for a
    minute more, where a mark cleared in this process counts at once."""
    failing("gone.example", 8, unavailable_since=timezone.now())
    availability.forget_known()
    real = frozenset
    cleared = threading.Event()

    def read(names: Any = ()) -> frozenset[Any]:
        found = real(names)
        if "gone.example" in found and not cleared.is_set():
            # Between the read and its keeping: mark_host_seen elsewhere.
            def other() -> None:
                try:
                    assert mark_host_seen("gone.example") is True
                finally:
                    connections.close_all()

            cleared.set()
            thread = threading.Thread(target=other)
            thread.start()
            thread.join(10)
        return found

    monkeypatch.setattr(availability, "frozenset", read, raising=False)
    try:
        assert "gone.example" in unavailable_hosts()
        monkeypatch.undo()
        assert cleared.is_set()
        batch = send(ALICE, NOTE, ["https://gone.example/inbox"])
        assert batch is not None and not batch.skipped
    finally:
        availability.forget_known()


@pytest.mark.django_db(transaction=True)
def test_a_host_with_no_mark_seen_in_a_views_transaction_holds_no_lock_for_it() -> None:
    """``mark_host_seen`` is called for each activity a host project
    receives, in its view's transaction too. For a host with no mark it
    wrote the host's row all the same, locking it (on SQLite, the database)
    until the view ended: the deliverer's write of the hosts it saw waited
    for the view, and every delivery with it."""
    from django_federation_delivery.store.hosts import SeenHost, record_hosts

    Host.objects.create(name="fine.example")
    in_view, done, wrote = threading.Event(), threading.Event(), threading.Event()

    def view() -> None:
        try:
            with transaction.atomic():
                assert mark_host_seen("https://fine.example/users/alice") is False
                in_view.set()
                done.wait(15)  # the rest of the view: fetching the actor, say
        finally:
            connections.close_all()

    def deliverer() -> None:
        try:
            now = aware_now()
            record_hosts(
                [SeenHost("fine.example", now, now, "", None, 80.0, 90.0, 4, None)], now=now
            )
            wrote.set()
        finally:
            connections.close_all()

    viewing = threading.Thread(target=view)
    viewing.start()
    writing = threading.Thread(target=deliverer)
    try:
        assert in_view.wait(10)
        writing.start()
        assert wrote.wait(3), "the deliverer's write waited for the view's transaction"
    finally:
        done.set()
        viewing.join(20)
        if writing.ident is not None:
            writing.join(20)


@pytest.mark.django_db(transaction=True)
def test_a_deliverer_marks_at_its_start_and_probes_each_unavailable_host_once_a_day(
    inboxes: Callable[..., Inbox], closed_port: Callable[[], int]
) -> None:
    up = inboxes("127.0.0.2", respond=lambda request: (404, {}, b""))
    dead = f"127.0.0.3:{closed_port()}"
    failing(up.host, 8)
    failing(dead, 9)
    # Where each was last sent to says where it is probed.
    send(ALICE, NOTE, [up.url("/inbox"), f"http://{dead}/inbox"])
    Delivery.objects.update(status=Status.DELIVERED, settled_at=timezone.now(), due_at=None)
    Deliverer().run(drain=True)
    assert [(r.method, r.path) for r in up.received] == [("GET", "/.well-known/nodeinfo")]
    # A 404 is an answer: the host is up. The dead one stays marked.
    assert unavailable_hosts() == {dead}
    assert Host.objects.get(name=dead).probed_at is not None
    assert probe_due() == [], "probed once a day"


def unavailable_backlog(count: int, now: dt.datetime) -> None:
    """``count`` hosts unavailable for weeks, each last probed a day ago,
    minutes apart, as a day's rounds left them: all due again."""
    Host.objects.bulk_create(
        Host(
            name=f"gone{n:04d}.example",
            failing_since=now - dt.timedelta(days=30),
            unavailable_since=now - dt.timedelta(days=20),
            probed_at=now - dt.timedelta(days=1, minutes=n % 60),
        )
        for n in range(count)
    )


def a_day_of_probes(now: dt.datetime) -> list[str]:
    """The hosts one deliverer's hourly upkeep takes to probe in a day."""
    probed: list[str] = []
    for hour in range(24):
        probed += [name for name, _url in probe_due(now=now + dt.timedelta(hours=hour))]
    return probed


@pytest.mark.django_db
def test_a_host_newly_marked_unavailable_is_probed_at_the_next_round() -> None:
    # On PostgreSQL, "the longest unprobed first" put the hosts never probed
    # last: behind 500 hosts due again, one newly marked was never probed.
    now = timezone.now()
    unavailable_backlog(500, now)
    failing("new.example", 8)
    assert mark_unavailable(WEEK, now=now) == ["new.example"]
    assert "new.example" in [name for name, _url in probe_due(now=now)]


@pytest.mark.django_db
def test_each_unavailable_host_is_probed_once_a_day_however_many() -> None:
    # 20 an hour, 480 a day: of 500 unavailable hosts, 20 waited a day more.
    now = timezone.now()
    unavailable_backlog(500, now)
    probed = a_day_of_probes(now)
    assert sorted(probed) == sorted(Host.objects.values_list("name", flat=True)), "each once"


@pytest.mark.django_db
def test_a_round_probes_a_share_of_the_unavailable_hosts_within_its_bounds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    now = timezone.now()
    assert probes_a_round() == PROBES_LEAST
    unavailable_backlog(500, now)
    failing("<ops>", 30, unavailable_since=now)  # no inbox's host: not counted
    assert probes_a_round() == 22, "a 23rd of them: a round may come late"
    # Past the most (500: 11,500 hosts), each in its turn, less often than daily.
    assert PROBES_MOST == 500
    monkeypatch.setattr(availability, "PROBES_MOST", 21)
    assert probes_a_round() == 21


def test_a_probe_round_is_the_deliverers_hourly_upkeep() -> None:
    # What a round's share of the unavailable hosts is reckoned by.
    assert PROBE_ROUND.total_seconds() == upkeep.HOSTS_EVERY


@pytest.mark.django_db
def test_an_operator_marks_a_host_as_seen_from_the_admin() -> None:
    from .test_admin import act, login

    failing("gone.example", 8, unavailable_since=timezone.now())
    said = act(login("operator"), "host", "mark_seen", ["gone.example"])
    assert said == ["1 host marked seen, 1 of them no longer unavailable."]
    assert unavailable_hosts() == frozenset()


@pytest.mark.django_db
def test_marking_a_failing_host_seen_says_it_was() -> None:
    # Failing for two hours, not yet unavailable: its mark was cleared, and
    # the admin warned "0 hosts are no longer unavailable", as if nothing.
    from .test_admin import act, login

    failing("down.example", 2 / 24)
    assert act(login("operator"), "host", "mark_seen", ["down.example"]) == ["1 host marked seen."]
    assert Host.objects.get(name="down.example").failing_since is None


@pytest.mark.django_db
def test_the_hosts_list_filters_the_unavailable_ones() -> None:
    from .test_admin import login

    failing("gone.example", 8, unavailable_since=timezone.now())
    Host.objects.create(name="up.example")
    page = login("operator").get("/admin/federation_delivery/host/?unavailable=yes")
    assert page.status_code == 200
    assert b"gone.example" in page.content and b"up.example" not in page.content


def test_none_turns_marking_off_in_the_checks(settings: Any) -> None:
    settings.FEDERATION_DELIVERY = {**settings.FEDERATION_DELIVERY, "HOST_UNAVAILABLE_AFTER": None}
    call_command("check")


@pytest.mark.django_db(transaction=True)
def test_a_host_seen_in_a_transaction_is_sent_to_once_it_commits() -> None:
    # mark_host_seen in the host project's transaction (ATOMIC_REQUESTS, an
    # inbox view): a send in another thread of the same process meanwhile
    # reads the still committed mark; once the seeing commits, sends in this
    # process must no longer skip the host ("one cleared here, at once").
    failing("gone.example", 8, unavailable_since=timezone.now())
    marked, commit = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def view() -> None:
        try:
            with transaction.atomic():
                assert mark_host_seen("gone.example") is True
                marked.set()
                commit.wait(10)
        except BaseException as exc:  # surfaced below
            errors.append(exc)
            marked.set()
        finally:
            connections.close_all()

    thread = threading.Thread(target=view)
    thread.start()
    assert marked.wait(10)
    # Another request's send while the view's transaction is open.
    assert send(ALICE, NOTE, ["https://gone.example/inbox"]) is None
    commit.set()
    thread.join(10)
    assert not errors, errors
    assert Host.objects.get(name="gone.example").unavailable_since is None, "seen, committed"
    batch = send(ALICE, NOTE, ["https://gone.example/users/bob/inbox"])
    assert batch is not None, (
        "seen and committed in this process, yet sends still skip it: "
        f"unavailable_hosts() = {set(availability.unavailable_hosts())}"
    )


class Rollback(Exception):
    pass


def seen_and_sent_to_then_undone(*, savepoint: bool) -> None:
    with transaction.atomic(savepoint=savepoint):
        assert mark_host_seen("gone.example") is True
        # A send in the same transaction reads the mark it cleared.
        assert send(ALICE, NOTE, ["https://gone.example/users/bob/inbox"]) is not None
        raise Rollback


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("undone", ["transaction", "savepoint"])
def test_a_host_seen_in_a_transaction_rolled_back_is_still_skipped(undone: str) -> None:
    failing("gone.example", 8, unavailable_since=timezone.now())
    availability.forget_known()
    with transaction.atomic():
        with pytest.raises(Rollback):
            seen_and_sent_to_then_undone(savepoint=undone == "savepoint")
        if undone == "transaction":
            transaction.set_rollback(True)
    assert Host.objects.get(name="gone.example").unavailable_since is not None
    assert not Delivery.objects.exists()
    # What the rolled back transaction read is no other send's.
    assert send(ALICE, {**NOTE, "id": "x"}, ["https://gone.example/inbox"]) is None, (
        "still marked unavailable, yet the send queued to it: "
        f"unavailable_hosts() = {set(availability.unavailable_hosts())}"
    )


@pytest.mark.django_db
@pytest.mark.parametrize(
    "inbox",
    [
        "http://plain.example/inbox",
        "https://[2001:db8::1]/inbox",
        "https://[2001:db8::80]/inbox",
        "http://[2001:db8::1]/inbox",
        "https://social.example:8443/inbox",
        "https://192.0.2.7:8443/inbox",
        "https://[2001:db8::1]:8443/inbox",
    ],
)
def test_a_host_with_no_delivery_kept_is_probed_where_its_inboxes_were(inbox: str) -> None:
    # Unavailable for weeks, its deliveries purged (RETENTION; the Host row is
    # kept while marked): the probe's URL is made from the host's key alone,
    # "https://" + key. An http inbox's key ends in ":80", and an IPv6 host's
    # key on 443 has no brackets: the URL is never the host's, never answers
    # (https on port 80; "https://2001:db8::1/..." is no URL at all), and the
    # host is never seen again by its daily probe.
    name = host_of(inbox)
    failing(name, 8, unavailable_since=timezone.now())
    ((probed, url),) = availability.probe_due()
    assert probed == name
    expected = split(inbox).origin + availability.PROBE_PATH
    assert url == expected, f"host {name!r} probed at {url!r}"


@pytest.mark.django_db(transaction=True)
def test_a_portable_inbox_s_gateway_host_marked_unavailable_is_probed_where_it_answers(
    inboxes: Callable[..., Inbox],
) -> None:
    """A portable inbox's gateway at ``http://host:port`` whose host was
    marked unavailable was probed at ``https://host:port/...`` (guessed, as
    if no delivery kept its origin), where it cannot answer: up all along,
    it stayed unavailable, every send skipping its inboxes. It is probed at
    its gateway's origin, as a plain inbox is at its own."""
    gateway = inboxes("127.0.0.2", respond=lambda request: (404, {}, b""))
    send_portable(
        ALICE,
        {"type": "Create", "actor": ALICE},
        [
            PortableInbox(
                f"ap://{DID}/actor/inbox",
                [gateway.url("")],
            )
        ],
    )
    Delivery.objects.update(status=Status.DELIVERED, settled_at=timezone.now(), due_at=None)
    # No success there for 8 days: the deliverer marks it unavailable at its
    # start (HOST_UNAVAILABLE_AFTER, 7 days), then probes it.
    Host.objects.create(name=gateway.host, failing_since=timezone.now() - dt.timedelta(days=8))
    Deliverer().run(drain=True)
    assert [(r.method, r.path) for r in gateway.received] == [("GET", "/.well-known/nodeinfo")]
    assert availability.unavailable_hosts() == set(), "the gateway answered its probe: it is up"


@pytest.mark.django_db(transaction=True)
def test_a_probe_finds_its_hosts_latest_inbox_without_reading_what_was_sent_since() -> None:
    # A host marked unavailable is sent nothing: its latest delivery is
    # behind every row sent since. Read as "the first by id, descending",
    # the primary key was walked back past all of them, at each probe
    # taken (0.12 s at 200,000, in the loop's thread).
    from django.db import connection

    from .conftest import run_explained, statements_of_undone

    if connection.vendor != "postgresql":
        pytest.skip("PostgreSQL's planner")
    gone = [f"https://gone.example/u{n}/inbox" for n in range(300)]
    others = [f"https://h{n % 200}.example/u{n}/inbox" for n in range(2000)]
    note = {"type": "Note", "actor": ALICE}
    send(ALICE, note, gone + others[:500])
    for _ in range(20):
        send(ALICE, note, others)
    Delivery.objects.update(status=Status.DELIVERED, settled_at=timezone.now(), due_at=None)
    with connection.cursor() as cursor:
        cursor.execute(f"ANALYZE {Delivery._meta.db_table}")
    Host.objects.update_or_create(name="gone.example", defaults={"unavailable_since": aware_now()})
    with statements_of_undone() as executed:
        taken = availability.probe_due(most=1)
    assert taken == [("gone.example", "https://gone.example/.well-known/nodeinfo")]
    for _, plan in run_explained(executed):
        removed = [int(n) for n in re.findall(r"Rows Removed by Filter: (\d+)", plan)]
        assert max(removed, default=0) < 1000, plan


@pytest.mark.django_db(transaction=True)
def test_a_probe_answered_while_the_database_blinks_marks_the_host_seen_once_it_is_back(
    inboxes: Callable[..., Inbox], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An unavailable host answers its daily probe, but the write that marks
    it seen meets the database away for a moment. The loop writes it once
    the database is back: taken as probed, it stayed marked unavailable,
    its inboxes left out of sends another whole day, though it answered."""
    up = inboxes("127.0.0.2", respond=lambda request: (404, {}, b""))
    Host.objects.create(name=up.host, failing_since=timezone.now() - dt.timedelta(days=8))
    send(ALICE, NOTE, [up.url("/inbox")])
    Delivery.objects.update(status=Status.DELIVERED, settled_at=timezone.now(), due_at=None)
    real = availability.mark_seen
    blinked: list[str] = []

    def mark_seen(host: str, **kwargs: Any) -> bool:
        if not blinked:
            blinked.append(host)
            raise OperationalError("server closed the connection unexpectedly")
        return real(host, **kwargs)

    monkeypatch.setattr(availability, "mark_seen", mark_seen)
    Deliverer().run(drain=True, stop_after=10)
    assert blinked == [up.host] and len(up.received) == 1, "probed, its answer not written"
    row = Host.objects.get(name=up.host)
    assert row.unavailable_since is None and row.failing_since is None
