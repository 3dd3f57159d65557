"""The overview behind the queues page, and ``manage.py delivery_status``."""

from __future__ import annotations

import contextlib
import datetime as dt
import io
import json
import re
import socket
from typing import Any

import pytest
from django.core.management import CommandError, call_command, load_command_class
from django.core.management.base import SystemCheckError
from django.db import connection
from django.utils import timezone

from django_federation_delivery import controls, hosts, overview, send
from django_federation_delivery.models import Breaker, DelivererHeartbeat, Delivery, Lane, Status

from .conftest import piped_to_head
from .keys import ALICE
from .operators import open_breaker, queue, settle

pytestmark = pytest.mark.django_db

MINUTE = dt.timedelta(minutes=1)


@pytest.fixture
def busy() -> dict[str, int]:
    """A queue with one delivery in each state the overview tells apart."""
    rows = list(
        queue(
            hosts=["a.example", "b.example", "c.example", "d.example"], per_host=2
        ).deliveries.order_by("id")
    )
    now = timezone.now()
    Delivery.objects.filter(pk=rows[0].pk).update(due_at=now - 7 * MINUTE)  # lagging
    Delivery.objects.filter(pk=rows[1].pk).update(  # retrying later
        due_at=now + 30 * MINUTE, attempts=2, last_status=503, last_error="HTTP 503"
    )
    Delivery.objects.filter(pk=rows[2].pk).update(  # in flight
        due_at=now + 5 * MINUTE, lease_token="a-deliverer", lane=Lane.PRIORITY
    )
    settle(rows[3], Status.DELIVERED, last_status=202, ago=10 * MINUTE)
    settle(rows[4], Status.DELIVERED, last_status=202, ago=2 * 60 * MINUTE)  # too long ago
    settle(rows[5], Status.FAILED, last_status=500, ago=3 * 60 * MINUTE)
    settle(rows[6], Status.FAILED, last_status=500, ago=2 * 24 * 60 * MINUTE)  # too long ago
    open_breaker(rows[1].host, failures=4)
    Breaker.objects.create(key="https://e.example/inbox", failures=2)  # closed
    controls.pause_host(rows[7].host)
    return {"retrying_host": rows[1].pk}


def test_the_overview_counts_each_lane(busy: dict[str, int]) -> None:
    status = overview.overview()
    normal, priority, low = (
        {lane.lane: lane for lane in status.lanes}[name]
        for name in (Lane.NORMAL, Lane.PRIORITY, Lane.LOW)
    )
    assert (normal.due, normal.scheduled, normal.in_flight, normal.held) == (1, 1, 0, 1)
    assert (priority.due, priority.scheduled, priority.in_flight, priority.held) == (0, 0, 1, 0)
    assert low.pending == 0 and low.lag == 0 and low.oldest_due_at is None
    assert 7 * 60 <= normal.lag < 7 * 60 + 30
    assert (normal.delivered_last_hour, normal.failed_last_day) == (1, 1)
    total = status.total
    assert (total.lane, total.pending, total.lag) == ("all", 4, normal.lag)


def test_the_overview_names_failing_hosts_open_breakers_and_paused_hosts(
    busy: dict[str, int],
) -> None:
    status = overview.overview()
    retrying = Delivery.objects.get(pk=busy["retrying_host"]).host
    [failing] = status.failing_hosts
    assert (failing.host, failing.retrying, failing.last_status) == (retrying, 1, 503)
    assert (failing.breaker, failing.failures, failing.paused) == ("open", 4, False)
    [breaker] = status.open_breakers
    assert (breaker.key, breaker.state, breaker.probing) == (retrying, "open", False)
    assert status.open_breaker_count == 1
    assert status.paused_hosts == ("d.example",)


def test_a_breaker_past_its_cool_off_is_half_open() -> None:
    Breaker.objects.create(key="a.example", failures=0, open_until=timezone.now() - MINUTE)
    [breaker] = overview.overview().open_breakers
    assert breaker.state == "half-open"
    assert overview.open_breakers() == 1


def test_lag_is_the_wait_of_the_oldest_due_delivery() -> None:
    assert overview.lag() == 0.0
    queue()
    Delivery.objects.filter(pk=Delivery.objects.order_by("id")[0].pk).update(
        due_at=timezone.now() - 3 * MINUTE
    )
    assert 180 <= overview.lag() < 200


def test_an_empty_queue() -> None:
    status = overview.overview()
    assert [lane.lane for lane in status.lanes] == ["webhook", "priority", "normal", "low"]
    assert status.total.pending == 0
    assert status.failing_hosts == status.open_breakers == status.paused_hosts == ()


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0, "0s"), (42.9, "42s"), (252, "4m 12s"), (3 * 3600 + 300, "3h 5m"), (90000, "1d 1h")],
)
def test_format_duration(seconds: float, text: str) -> None:
    assert overview.format_duration(seconds) == text


def run(*args: str) -> str:
    out = io.StringIO()
    call_command("delivery_status", *args, stdout=out)
    return out.getvalue()


def test_delivery_status_prints_the_overview_as_tables(busy: dict[str, int]) -> None:
    text = run()
    lines = text.splitlines()
    assert lines[0].startswith("Queues at ")
    header = lines[2].split()
    assert header[:3] == ["lane", "due", "scheduled"]
    rows = {line.split()[0]: line.split() for line in lines[3:8]}
    assert set(rows) == {"webhook", "priority", "normal", "low", "all"}
    assert rows["webhook"] == ["webhook", "0", "0", "0", "0", "—", "0", "0", "0"]
    # lane, due, scheduled, in flight, held, lag (two words), delivered 1h, failed 24h
    assert rows["normal"][:5] == ["normal", "1", "1", "0", "1"]
    assert rows["normal"][5] == "7m" and rows["normal"][-3:] == ["1", "1", "0"]
    assert rows["low"] == ["low", "0", "0", "0", "0", "—", "0", "0", "0"]
    assert rows["all"][:5] == ["all", "1", "1", "1", "1"]
    retrying = Delivery.objects.get(pk=busy["retrying_host"]).host
    failing = text.split("Hosts failing most\n")[1].splitlines()
    assert failing[0].split() == [
        "host",
        "retrying",
        "last",
        "status",
        "breaker",
        "failures",
        "open",
        "until",
        "paused",
    ]
    assert failing[1].split()[:5] == [retrying, "1", "503", "open", "4"]
    assert "Breakers open now: 1" in text
    assert "Paused hosts: d.example" in text


def test_delivery_status_columns_line_up() -> None:
    queue(hosts=[f"h{n}.example" for n in range(12)], per_host=1)
    lines = run().splitlines()[2:7]
    # Right-aligned numbers: every row is as wide as the header.
    assert len({len(line) for line in lines}) == 1, lines


def test_delivery_status_json_is_for_scripts(busy: dict[str, int]) -> None:
    data = json.loads(run("--json"))
    assert set(data) == {
        "at",
        "lanes",
        "total",
        "failing_hosts",
        "open_breakers",
        "open_breaker_count",
        "paused_hosts",
        "paused_host_count",
        "deliverers",
        "deliverer_last_seen",
        "deliverer_count",
        "stalled",
        "webhook_destinations",
    }
    dt.datetime.fromisoformat(data["at"])
    normal = next(lane for lane in data["lanes"] if lane["lane"] == "normal")
    assert {key: normal[key] for key in ("due", "scheduled", "in_flight", "held", "pending")} == {
        "due": 1,
        "scheduled": 1,
        "in_flight": 0,
        "held": 1,
        "pending": 3,
    }
    assert 7 * 60 <= normal["lag"] < 7 * 60 + 30
    dt.datetime.fromisoformat(normal["oldest_due_at"])
    assert data["total"]["pending"] == 4
    assert data["failing_hosts"][0]["breaker"] == "open"
    assert data["open_breakers"][0]["state"] == "open"
    assert data["paused_hosts"] == ["d.example"]


@pytest.mark.django_db(databases=["default", "queue"])
@pytest.mark.usefixtures("default_refuses_the_app")
def test_under_a_router_delivery_status_reads_the_database_the_app_is_routed_to() -> None:
    # "default" refuses the app's tables (conftest), as where migrate made
    # them in "queue" alone.
    queue(hosts=["a.example"], per_host=3)
    controls.pause_host("a.example")
    data = json.loads(run("--json"))
    assert (data["total"]["pending"], data["paused_hosts"]) == (3, ["a.example"])
    assert "a.example" in run("--host", "a.example")
    Delivery.objects.update(due_at=timezone.now())
    assert check() == (
        2,
        "CRITICAL: No deliverer has been seen in the last day while 3 deliveries are due\n",
    )


def test_delivery_status_hosts_limits_the_failing_hosts(busy: dict[str, int]) -> None:
    assert json.loads(run("--json", "--hosts", "0"))["failing_hosts"] == []
    # Its section left out: it said "none", as when no host fails.
    assert "Hosts failing most" in run()
    assert "Hosts failing most" not in run("--hosts", "0")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--hosts", "many"], "expected a whole number from 0 to 100000, not 'many'"),
        (["--hosts", "-1"], "expected a whole number from 0 to 100000, not '-1'"),
        (["--hosts", "9" * 20], "expected a whole number from 0 to 100000, not '9{20}'"),
        (["--hosts", "9" * 5000], r"not '9{80}…'$"),
        (["--this-host"], "--this-host and --max-lag go with --check"),
        (["--max-lag", "60"], "--this-host and --max-lag go with --check"),
        (["--database", "elsewhere"], "no database named 'elsewhere' in DATABASES"),
    ],
)
def test_delivery_status_refuses_bad_arguments(args: list[str], message: str) -> None:
    with pytest.raises(CommandError, match=message):
        run(*args)


def test_delivery_status_escapes_what_a_terminal_would_act_on() -> None:
    # Hosts and inboxes come from the network: a hostile one must not clear
    # the operator's screen, retitle the window or reorder what is shown.
    hostile = "evil\x1b[2J\u202e.example"
    (row, *_) = queue(hosts=["a.example"], per_host=1).deliveries.all()
    Delivery.objects.filter(pk=row.pk).update(host=hostile, attempts=1, last_status=503)
    open_breaker(hostile, failures=4)
    open_breaker("https://b.example/\x1b]0;owned\x07inbox", failures=12)
    # A row written as it is, which pause_host would refuse.
    hosts.pause_host("paused\r\n.example")
    text = run()
    assert not any(char in text for char in "\x1b\x07\r\u202e"), repr(text)
    assert "evil\\x1b[2J\\u202e.example" in text
    assert "https://b.example/\\x1b]0;owned\\x07inbox" in text
    assert "Paused hosts: paused\\r\\n.example" in text
    assert json.loads(run("--json"))["paused_hosts"] == ["paused\r\n.example"]


# Deliverers, and --check.


def heartbeat(seconds_ago: float, *, pid: int, host: str = "worker-1") -> DelivererHeartbeat:
    seen = timezone.now() - dt.timedelta(seconds=seconds_ago)
    return DelivererHeartbeat.objects.create(
        host=host,
        pid=pid,
        version="1.2.3",
        started_at=seen - 2 * 60 * MINUTE,
        last_seen=seen,
        interval=5.0,
        in_flight=3,
        rate=2.5,
    )


#: "a\xff.example" as bytes, not text: a column SQLite keeps as a BLOB,
#: written by hand (whatever a column's type, SQLite keeps what it is given).
BLOB = "X'61ff2e6578616d706c65'"


@pytest.mark.parametrize(
    ("table", "column", "where", "args"),
    [
        ("delivery", "host", "attempts > 0", ()),
        ("breaker", "key", "open_until IS NOT NULL", ()),
        ("delivererheartbeat", "host", "pid = 1111", ()),
        ("delivererheartbeat", "version", "pid = 1111", ()),
        ("host", "last_error", "name = 'd.example'", ("--host", "d.example")),
    ],
)
def test_delivery_status_shows_a_column_sqlite_keeps_as_a_blob_as_bytes(
    busy: dict[str, int], table: str, column: str, where: str, args: tuple[str, ...]
) -> None:
    if connection.vendor != "sqlite":
        pytest.skip("only SQLite keeps a BLOB in a text column")
    heartbeat(1, pid=1111)
    with connection.cursor() as cursor:
        cursor.execute(f"UPDATE federation_delivery_{table} SET {column} = {BLOB} WHERE {where}")
    # As bytes, in the tables and the JSON alike: never as text it is not.
    shown = "b'a\\xff.example'"
    assert shown in run(*args)
    assert shown in strings(json.loads(run(*args, "--json")))


def strings(value: Any) -> list[str]:
    """Every string a JSON document holds."""
    if isinstance(value, dict):
        return [text for item in value.values() for text in strings(item)]
    if isinstance(value, list):
        return [text for item in value for text in strings(item)]
    return [value] if isinstance(value, str) else []


def test_delivery_status_lists_the_live_deliverers_and_warns_last_when_none_is() -> None:
    queue(hosts=["a.example"], per_host=4)
    heartbeat(1, pid=1111)
    heartbeat(600, pid=2222)
    text = run()
    deliverers = text.split("Deliverers\n")[1].split("\n\n")[0].splitlines()
    assert deliverers[0].split()[:3] == ["host", "pid", "version"]
    [line] = deliverers[1:]
    assert line.split()[:3] == ["worker-1", "1111", "1.2.3"]
    assert line.split()[-2:] == ["3", "2.5"]
    assert "WARNING" not in text
    DelivererHeartbeat.objects.filter(pid=1111).delete()
    text = run()
    assert "Deliverers\n  none running (last seen " in text
    # Seen 600 s before the heartbeat was written: a slow machine's seconds
    # since are added, not the test's to fix.
    assert re.fullmatch(
        r"WARNING: No deliverer seen for 10m \d+s while 4 deliveries are due\.",
        text.splitlines()[-1],
    ), text.splitlines()[-1]


def test_delivery_status_json_lists_the_live_deliverers() -> None:
    queue(hosts=["a.example"], per_host=2)
    alive = heartbeat(1, pid=1111)
    data = json.loads(run("--json"))
    [deliverer] = data["deliverers"]
    assert deliverer["pid"] == 1111 and deliverer["host"] == "worker-1"
    assert deliverer["in_flight"] == 3 and deliverer["rate"] == 2.5
    assert dt.datetime.fromisoformat(deliverer["last_seen"]) == alive.last_seen
    assert data["deliverer_last_seen"] == alive.last_seen.isoformat()
    assert data["stalled"] == ""
    alive.delete()
    data = json.loads(run("--json"))
    assert (data["deliverers"], data["deliverer_last_seen"]) == ([], None)
    assert (
        data["stalled"] == "No deliverer has been seen in the last day while 2 deliveries are due"
    )


def check(*args: str, system_checks: bool = False) -> tuple[int, str]:
    """``delivery_status --check``: its exit status and its one line; with
    ``system_checks``, after the system checks, as ``manage.py`` runs it."""
    out = io.StringIO()
    try:
        call_command("delivery_status", "--check", *args, stdout=out, skip_checks=not system_checks)
        code = 0
    except SystemExit as exc:
        code = int(exc.code or 0)
    return code, out.getvalue()


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (["--max-lag", "nan"], "of seconds from 0 to 1000000000, not 'nan'"),
        (["--host", "a.example"], "--check prints one line for the whole queue: it takes neither"),
        (["--json"], "it takes neither --host nor --json"),
        (["--database", "elsewhere"], "no database named 'elsewhere' in DATABASES"),
        (["--hosts", "many"], "expected a whole number from 0 to 100000, not 'many'"),
    ],
)
def test_check_asked_wrongly_is_unknown_not_a_warning(args: list[str], line: str) -> None:
    # Nagios reads 1 as WARNING and 2 as CRITICAL: a probe set up wrong says
    # so as UNKNOWN (3), never as a state of the queue.
    code, out = check(*args)
    assert code == 3
    assert out.startswith("UNKNOWN: ") and line in out, out
    assert out.count("\n") == 1


@pytest.mark.parametrize(
    ("bad", "failing"),
    [
        ({"CONCURRENCY": 0}, "federation_delivery.E005"),
        ({"WEBHOOKS": {"ops": "ftp://hooks.example/secret"}}, "federation_delivery.E031"),
    ],
)
def test_check_with_settings_no_deliverer_starts_with_is_unknown_naming_the_checks(
    settings: Any, bad: dict[str, Any], failing: str
) -> None:
    # Work due, and a deliverer would refuse these settings: a probe reads
    # the first word and the status, not "SystemCheckError" and 1 (WARNING).
    queue(hosts=["a.example"], per_host=1)
    settings.FEDERATION_DELIVERY = {**settings.FEDERATION_DELIVERY, **bad}
    code, line = check(system_checks=True)
    assert code == 3
    assert line.startswith("UNKNOWN: ") and failing in line, line
    assert line.count("\n") == 1 and "secret" not in line
    # Without --check, the command refuses them as every command does.
    with pytest.raises(SystemCheckError, match=failing):
        call_command("delivery_status", stdout=io.StringIO(), skip_checks=False)


def test_check_is_healthy_with_nothing_due_and_no_deliverer() -> None:
    assert check() == (0, "OK: 0 deliverer(s) alive, 0 due, lag 0s\n")


def test_check_is_healthy_with_a_live_deliverer_and_a_short_lag() -> None:
    (row, *_) = queue(hosts=["a.example"], per_host=3).deliveries.all()
    Delivery.objects.filter(pk=row.pk).update(due_at=timezone.now() - 2 * MINUTE)
    heartbeat(1, pid=1111)
    code, line = check()
    assert code == 0
    assert line.startswith("OK: 1 deliverer(s) alive, 3 due, lag 2m ")


def test_check_fails_when_work_is_due_and_no_deliverer_was_ever_seen() -> None:
    queue(hosts=["a.example"], per_host=3)
    assert check() == (
        2,
        "CRITICAL: No deliverer has been seen in the last day while 3 deliveries are due\n",
    )


def test_check_fails_when_work_is_due_and_the_deliverer_died() -> None:
    queue(hosts=["a.example"], per_host=1)
    heartbeat(252, pid=1111)  # killed: it stopped beating four minutes ago
    code, line = check()
    # 252 s before the row was written, and however long this machine took since.
    assert code == 2
    assert re.fullmatch(r"CRITICAL: No deliverer seen for 4m 1\d+s while 1 delivery is due\n", line)


def test_check_gives_a_deliverer_that_just_died_a_minute_to_come_back() -> None:
    queue(hosts=["a.example"], per_host=1)
    heartbeat(30, pid=1111)
    code, line = check()
    assert (code, line.split(",")[0]) == (0, "OK: 0 deliverer(s) alive")


def test_check_fails_when_the_oldest_due_delivery_waited_longer_than_max_lag() -> None:
    (row, *_) = queue(hosts=["a.example"], per_host=2).deliveries.all()
    Delivery.objects.filter(pk=row.pk).update(due_at=timezone.now() - 7 * MINUTE)
    heartbeat(1, pid=1111)
    code, line = check()
    assert code == 2
    assert line.startswith("CRITICAL: the oldest due delivery has waited 7m ")
    assert line.endswith(", longer than --max-lag 300 s (2 due, 1 deliverer(s) alive)\n")
    assert check("--max-lag", "600")[0] == 0
    assert check("--max-lag", "0")[0] == 0, "0: the lag is not checked"
    assert check("--max-lag", "60")[0] == 2


def test_check_on_this_host_counts_only_its_own_deliverers() -> None:
    import socket

    queue(hosts=["a.example"], per_host=1)
    heartbeat(1, pid=1111, host="elsewhere")
    assert check()[0] == 0
    assert check("--this-host") == (
        2,
        f"CRITICAL: No deliverer on {socket.gethostname()} has been seen in the last day "
        "while 1 delivery is due\n",
    )
    heartbeat(1, pid=2222, host=socket.gethostname())
    code, line = check("--this-host")
    # The lag is however long the machine took since queueing: a second or
    # more on a busy one.
    assert code == 0
    assert re.fullmatch(
        rf"OK: 1 deliverer\(s\) alive on {re.escape(socket.gethostname())}, 1 due, lag \d+s\n",
        line,
    ), line


@pytest.mark.parametrize("value", ["-1", "soon", "1e9999"])
def test_check_refuses_a_bad_max_lag_naming_it(value: str) -> None:
    code, line = check("--max-lag", value)
    assert code == 3 and line.startswith("UNKNOWN: ") and f"not {value!r}" in line, line


def run_from_command_line(*args: str) -> tuple[int, str, str]:
    """``manage.py delivery_status ARGS`` in this process, as a probe runs it:
    its exit status, stdout and stderr."""
    out, err = io.StringIO(), io.StringIO()
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        # Made here, as manage.py makes it: its stdout is sys.stdout now.
        command = load_command_class("django_federation_delivery", "delivery_status")
        try:
            command.run_from_argv(["manage.py", "delivery_status", *args])
        except SystemExit as exc:
            code = int(exc.code or 0)
    return code, out.getvalue(), err.getvalue()


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--check", "--max-lag"], "argument --max-lag: expected one argument"),
        (["--check", "--max-lag", "-1h"], "argument --max-lag: expected one argument"),
        (["--max-lag", "600", "--chec", "--this-hots"], "unrecognized arguments: --this-hots"),
        (["--check", "--hosts"], "argument --hosts: expected one argument"),
        # A flag given a value: a probe all the same.
        (["--check=true"], "argument --check: ignored explicit argument 'true'"),
        (["--che=1"], "argument --check: ignored explicit argument '1'"),
        # Refused by Django's own command, not argparse: it exited 1, WARNING.
        (
            ["--check", "--force-color", "--no-color"],
            "The --no-color and --force-color options can't be used together.",
        ),
    ],
)
def test_a_probe_whose_arguments_are_refused_is_unknown_not_a_state_of_the_queue(
    args: list[str], said: str
) -> None:
    # From a command line argparse exits 2 on them, which Nagios reads as
    # CRITICAL: a probe set up wrong must not be read as a state of the queue.
    code, out, err = run_from_command_line(*args)
    assert code == 3, (code, out, err)
    assert out == f"UNKNOWN: {said}\n"


@pytest.mark.django_db
def test_arguments_argparse_refuses_without_check_are_its_usage_and_status_2() -> None:
    code, out, err = run_from_command_line("--hosts")
    assert (code, out) == (2, "")
    assert "argument --hosts: expected one argument" in err


@pytest.mark.django_db
def test_with_use_tz_off_the_times_shown_are_in_utc_as_the_header_says(settings: Any) -> None:
    settings.USE_TZ = False
    settings.TIME_ZONE = "America/New_York"
    out = io.StringIO()
    call_command("delivery_status", stdout=out)
    header = out.getvalue().splitlines()[0]
    said = re.fullmatch(r"Queues at (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d) UTC", header)
    assert said is not None, header
    shown = dt.datetime.strptime(said[1], "%Y-%m-%d %H:%M:%S").replace(tzinfo=dt.UTC)
    assert abs((shown - dt.datetime.now(dt.UTC)).total_seconds()) < 120, header
    out = io.StringIO()
    call_command("delivery_status", "--json", stdout=out)
    at = dt.datetime.fromisoformat(json.loads(out.getvalue())["at"])
    assert at.utcoffset() is not None
    assert abs((at - dt.datetime.now(dt.UTC)).total_seconds()) < 120


def test_every_live_deliverer_is_counted_and_those_not_listed_said() -> None:
    # run_deliverer --processes takes up to 256 on one machine: past 100,
    # "--check --this-host" said "OK: 100 deliverer(s) alive".
    here = socket.gethostname()
    for pid in range(150):
        heartbeat(1, pid=1000 + pid, host=here)
    heartbeat(3600, pid=9999, host=here)  # long dead
    code, line = check("--this-host")
    assert (code, line.partition(",")[0]) == (0, f"OK: 150 deliverer(s) alive on {here}")
    status = io.StringIO()
    call_command("delivery_status", "--json", stdout=status)
    data = json.loads(status.getvalue())
    assert (len(data["deliverers"]), data["deliverer_count"]) == (100, 150)
    status = io.StringIO()
    call_command("delivery_status", stdout=status)
    assert "  and 50 more" in status.getvalue()


@pytest.mark.django_db
def test_a_host_s_last_day_names_only_the_outcomes_its_deliveries_came_to() -> None:
    batch = queue(hosts=["a.example"], per_host=5)
    rows = list(batch.deliveries.order_by("id"))
    assert "last 24 hours          —" in run("--host", "a.example")
    for row, status in zip(rows, [Status.DELIVERED] * 3 + [Status.FAILED] * 2, strict=True):
        settle(row, status)
    assert "last 24 hours          delivered 3, failed 2\n" in run("--host", "a.example")


@pytest.mark.django_db
def test_with_use_tz_off_the_check_says_its_line(settings: Any) -> None:
    # It handed the ORM an aware time, which SQLite refuses with USE_TZ off:
    # a traceback instead of the probe's line.
    settings.USE_TZ = False
    settings.TIME_ZONE = "America/New_York"
    queue(hosts=["a.example"], per_host=2)
    assert check() == (
        2,
        "CRITICAL: No deliverer has been seen in the last day while 2 deliveries are due\n",
    )


@pytest.mark.django_db
def test_with_use_tz_off_a_destination_s_times_carry_their_offset(settings: Any) -> None:
    from django_federation_delivery import send_webhook
    from django_federation_delivery.webhooks.destinations import delivery_key

    settings.USE_TZ = False
    settings.TIME_ZONE = "America/New_York"
    hook = "slack://hooks.slack.com/services/T0AAAA1/B0BBBB2/s3cretT0kenV4lue9"
    settings.FEDERATION_DELIVERY = {**settings.FEDERATION_DELIVERY, "WEBHOOKS": {"ops": hook}}
    send_webhook("ops", "thing.happened", {})
    hosts.pause_host(delivery_key("ops"))
    hosts.failing_since(delivery_key("ops"), timezone.now())
    data = json.loads(run("--json"))
    [ops] = data["webhook_destinations"]
    for name in ("paused_at", "failing_since"):
        assert dt.datetime.fromisoformat(ops[name]).utcoffset() is not None, ops[name]


@pytest.mark.django_db
def test_delivery_status_shows_a_long_inbox_breakers_key_as_the_admin_does(settings: Any) -> None:
    """A breaker kept per inbox, for a portable inbox on an RSA ``did:key``:
    its key is the whole inbox, which ``delivery_status`` printed whole in
    its "Breakers open now" table, every row padded to it, where the
    admin's list cuts it to 200 as a message does."""
    from django_federation_delivery.addresses import redact
    from django_federation_delivery.breakers import BreakerSettings, Scope

    from .operators import open_breaker

    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "BREAKER": {"THRESHOLD": 2, "COOL_OFF": 60.0, "SCOPE": "inbox"},
    }
    did = "did:key:z4MXj1wBzi9jUstyP" + "Mq" * 190
    key = BreakerSettings(scope=Scope.INBOX).key("", f"ap://{did}/actor/inbox")
    open_breaker(key)
    open_breaker("b.example")
    out = io.StringIO()
    call_command("delivery_status", stdout=out)
    table = out.getvalue().partition("Breakers open now")[2].split("\n\n")[0]
    widest = max(len(line) for line in table.splitlines())
    assert redact(key) in table and widest < 300, (widest, table[:400])


def test_hosts_lists_as_many_failing_hosts_as_asked_past_a_statements_parameters(
    parameters_a_statement: int,
) -> None:
    # --hosts N (up to 100,000) with more hosts retrying than a statement
    # takes parameters: the failing hosts' breakers were read with one
    # "key IN (...)" of them all, and the command ended in a traceback.
    names = [f"h{n}.example" for n in range(parameters_a_statement + 1)]
    batch = queue(hosts=names[:1], per_host=1)
    Delivery.objects.bulk_create(
        Delivery(batch=batch, inbox=f"https://{name}/inbox", host=name) for name in names[1:]
    )
    Delivery.objects.update(attempts=1, last_status=503)
    out = io.StringIO()
    call_command("delivery_status", "--hosts", str(len(names)), stdout=out)
    failing = out.getvalue().partition("Hosts failing most\n")[2].split("\n\n")[0]
    assert len(failing.splitlines()) == len(names) + 1  # the header, then each host


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_delivery_status_piped_to_head_exits_0_without_a_broken_pipe_traceback() -> None:
    """``delivery_status --hosts 2000 --json | head -1`` (a script under
    ``set -o pipefail``): once head had gone, the command ended in a
    ``BrokenPipeError`` traceback and status 1."""
    inboxes = [f"https://h{n}.example/inbox" for n in range(2000)]
    send(ALICE, {"type": "Create", "id": f"{ALICE}/a/1", "actor": ALICE}, inboxes)
    Delivery.objects.update(attempts=1, last_status=503)
    code, errors = piped_to_head(["delivery_status", "--hosts=2000", "--json"], 60)
    assert (code, "Traceback" in errors) == (0, False), (code, errors[-800:])
