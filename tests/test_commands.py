"""The management commands as an operator types them, or a project's code
calls them: what no one setting up or scripting them should meet (a
traceback, a secret, raw control bytes), and the exit statuses they say."""

from __future__ import annotations

import contextlib
import datetime as dt
import re
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from io import StringIO
from typing import Any

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from django_federation_delivery.channels import Verdict
from django_federation_delivery.transport import Answer

from .channels import Pager
from .conftest import MANAGE, Inbox, subprocess_env

KEY = "routingKEY4b7c9"


class Misjudging(Pager):
    """A kind whose judge() raises on an answer it did not expect, its
    message quoting what it holds: a host project's mistake, which the
    deliverer takes as a failed attempt."""

    name = "misjudging"
    label = "Misjudging"
    schemes = ("misjudging", "misjudging+http")

    def judge(self, answer: Answer) -> Verdict:
        raise KeyError(f"no 'status' in the answer for {KEY}")


def ping(*args: str) -> tuple[int, str]:
    out = StringIO()
    try:
        call_command("send_test_webhook", *args, stdout=out)
    except SystemExit as exit:
        return int(exit.code or 0), out.getvalue()
    return 0, out.getvalue()


def test_send_test_webhook_tells_a_kinds_judge_that_raises_as_not_delivered(
    settings: Any, inbox: Inbox
) -> None:
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "CHANNELS": [f"{__name__}.Misjudging"],
        "WEBHOOKS": {"oncall": f"misjudging+http://{KEY}@127.0.0.1:{inbox.port}/page"},
    }
    code, line = ping("oncall")
    assert len(inbox.received) == 1
    assert code == 1 and "not delivered" in line, line
    assert KEY not in line


def test_send_test_webhook_prints_a_kinds_own_error_escaped(settings: Any, inbox: Inbox) -> None:
    # The deliverer keeps, tells and logs such an error escaped (README, "A
    # kind of your own"): the command wrote the NUL and the control byte raw.
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "CHANNELS": ["tests.channels.Verbatim"],
        "WEBHOOKS": {"oncall": f"verbatim+http://{KEY}@127.0.0.1:{inbox.port}/page"},
    }
    code, line = ping("oncall")
    assert code == 1
    assert "\x00" not in line and "\x01" not in line, f"printed raw: {line!r}"
    assert r"\x00\x01binary" in line, line


@pytest.mark.parametrize(
    "bad",
    [{"WEBHOOK_TIMEOUT": "abc"}, {"WEBHOOK_RETRY": "soon"}, {"WEBHOOKS": "ops"}],
    ids=["WEBHOOK_TIMEOUT", "WEBHOOK_RETRY", "WEBHOOKS"],
)
def test_send_test_webhook_refuses_a_bad_setting_as_a_command_error(
    settings: Any, inbox: Inbox, bad: dict[str, Any]
) -> None:
    # Run from call_command (or with --skip-checks) the system checks have not
    # run: run_deliverer, enable_webhook, delivery_status, delivery_replay and
    # purge_deliveries each refuse such settings with a CommandError naming
    # them; send_test_webhook let ImproperlyConfigured through, a traceback.
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "WEBHOOKS": {"ops": f"slack+http://127.0.0.1:{inbox.port}/services/T0/B0/xyzzy42"},
        **bad,
    }
    with pytest.raises(CommandError, match=next(iter(bad))):
        ping("ops")
    assert not inbox.received


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("command", "options"),
    [
        ("delivery_schedule", {"round_seconds": 0}),
        ("purge_deliveries", {"older_than": 3600, "dry_run": True}),
        ("delivery_replay", {"host": "a.example", "since": dt.datetime(2026, 1, 1, tzinfo=dt.UTC)}),
    ],
    ids=[
        "delivery_schedule round_seconds=0",
        "purge_deliveries older_than=3600",
        "delivery_replay since=datetime",
    ],
)
def test_an_option_given_to_call_command_as_it_is_is_taken_or_refused_naming_it(
    command: str, options: dict[str, Any]
) -> None:
    # call_command passes keyword options as they are given, unparsed: the
    # numbers of run_deliverer and delivery_status are taken as ints
    # (management.base.whole, tests/test_run_deliverer.py); these died on
    # them with a TypeError or an AttributeError from deep in the command.
    with contextlib.suppress(CommandError):
        call_command(command, stdout=StringIO(), **options)


AWAY = "/nonexistent-fd-tests/dir/queue.sqlite3"


@pytest.mark.parametrize(
    "command",
    [
        ["delivery_status"],
        ["delivery_status", "--json"],
        ["purge_deliveries", "--dry-run"],
        ["delivery_replay", "--host", "a.example", "--since", "1h"],
        ["enable_webhook", "ops"],
    ],
    ids=" ".join,
)
def test_a_command_on_a_database_it_cannot_reach_says_so_without_a_traceback(
    command: list[str],
) -> None:
    # delivery_status --check says "CRITICAL: the queue cannot be read
    # (unable to open database file)", and delivery_schedule a CommandError:
    # the others printed a Python traceback, from deep in Django's backend.
    env = subprocess_env(FD_SQLITE_NAME=AWAY)
    env.pop("DATABASE_URL", None)
    done = subprocess.run([*MANAGE, *command], env=env, capture_output=True, text=True, timeout=120)
    last = done.stderr.strip().splitlines()[-1:] or [""]
    assert "Traceback" not in done.stderr, f"a traceback, ending: {last[0]}"
    assert done.returncode == 1, done.stderr[-600:]
    assert done.stderr.startswith("CommandError: "), done.stderr[-600:]
    assert "unable to open database file" in done.stderr


def test_the_check_option_help_gives_every_exit_status_the_readme_does() -> None:
    # README, "Health checks": 0 OK, 1 WARNING (events for a destination no
    # longer configured), 2 CRITICAL (also a disabled destination, or a queue
    # that cannot be read), 3 UNKNOWN (a check set up wrong). --help said 0
    # and 2 only, and of 2 only the stall and the lag.
    from django.core.management import load_command_class

    command = load_command_class("django_federation_delivery", "delivery_status")
    parser = command.create_parser("manage.py", "delivery_status")
    (said,) = [action.help for action in parser._actions if action.dest == "check"]
    assert re.search(r"\b1\b", said) and re.search(r"\b3\b", said) and "disabled" in said, said


def test_send_test_webhook_stops_on_an_operators_ctrl_c_not_a_kinds_internal_error(
    settings: Any, inboxes: Callable[..., Inbox], caplog: pytest.LogCaptureFixture
) -> None:
    # The attempt is made as a worker makes it (workers.guarded), where any
    # exception is the kind's crash; but the command's runs in the main
    # thread, where a KeyboardInterrupt is the operator's Ctrl-C: it stops
    # the command, and is not told as the destination's kind crashing.
    # The request outlasts the Ctrl-C by far, so that a timer thread started
    # late on a busy machine still interrupts it: 0.5 s when all is well.
    slow = inboxes("127.0.0.1", delay=30)
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "WEBHOOKS": {"ops": f"slack+http://127.0.0.1:{slow.port}/services/T0/B0/xyzzy42"},
        "WEBHOOK_TIMEOUT": 30,
    }
    main = threading.get_ident()
    handler = signal.getsignal(signal.SIGINT)
    fired: list[float] = []
    started = time.monotonic()

    def interrupt() -> None:
        fired.append(time.monotonic() - started)
        signal.pthread_kill(main, signal.SIGINT)

    timer = threading.Timer(0.5, interrupt)
    out = StringIO()
    code: Any = None
    interrupted = False
    timer.start()
    try:
        call_command("send_test_webhook", "ops", stdout=out)
    except SystemExit as exit:
        code = exit.code
    except KeyboardInterrupt:
        interrupted = True
    finally:
        timer.cancel()
    assert interrupted, (
        f"Ctrl-C did not stop the command: it exited {code} printing {out.getvalue()!r}, "
        f"and logged {[r.getMessage() for r in caplog.records if r.levelname == 'ERROR']}; "
        f"SIGINT's handler was {handler!r}, sent at {fired} s"
    )


#: A database URL given where an alias goes: its password a secret.
PASSWORD = "hunter2pw"


@pytest.mark.parametrize(
    "args",
    [
        ("delivery_status",),
        ("delivery_status", "--check"),
        ("delivery_replay", "--host", "a.example", "--since", "1h"),
        ("purge_deliveries", "--dry-run"),
        ("enable_webhook", "ops"),
        ("run_deliverer", "--drain"),
    ],
)
def test_a_database_url_given_as_database_is_refused_without_its_password(
    args: tuple[str, ...],
) -> None:
    """``--database postgres://fd:PASSWORD@db.example/fd`` was refused with
    the password in the message (and, with ``--check``, in the probe's
    UNKNOWN line, which monitoring mails on). It is shown as the public
    API shows it, its host and no password."""
    out, err = StringIO(), StringIO()
    said = ""
    url = f"postgres://fd:{PASSWORD}@db.example:5432/fd"
    try:
        call_command(*args, "--database", url, stdout=out, stderr=err)
    except CommandError as refused:
        said = str(refused)
    except SystemExit:
        pass
    said += out.getvalue() + err.getvalue()
    assert "db.example" in said, said
    assert PASSWORD not in said, said


@pytest.mark.django_db
def test_a_broken_pipe_of_the_command_s_own_work_is_no_success() -> None:
    # A project's post_save receiver of a Batch, whose broker's socket was
    # closed, raised BrokenPipeError as delivery_replay queued the copies:
    # the command took it for its reader gone, said nothing, and returned.
    from django.db.models.signals import post_save

    from django_federation_delivery import send
    from django_federation_delivery.models import Batch, Delivery, Status

    from .keys import ALICE

    send(ALICE, {"type": "Create", "actor": ALICE}, ["https://a.example/inbox"])
    Delivery.objects.update(status=Status.DELIVERED, settled_at=dt.datetime.now(dt.UTC))

    def broker(sender: object, **kwargs: object) -> None:
        raise BrokenPipeError(32, "Broken pipe (the broker's socket)")

    post_save.connect(broker, sender=Batch, dispatch_uid="broker")
    try:
        with pytest.raises(BrokenPipeError, match="the broker's socket"):
            call_command("delivery_replay", "--host=a.example", "--since=1h", stdout=StringIO())
    finally:
        post_save.disconnect(sender=Batch, dispatch_uid="broker")


@pytest.mark.django_db
def test_a_command_called_with_a_pipe_whose_reader_went_away_returns() -> None:
    # call_command("delivery_status", stdout=<a pipe>) read by a head that
    # ended: a stream given is wrapped as Django wraps it, whose broken pipe
    # escaped call_command, where manage.py ... | head ends quietly.
    import os

    read, write = os.pipe()
    os.close(read)
    with open(write, "w") as out:
        call_command("delivery_status", stdout=out)
        with contextlib.suppress(BrokenPipeError):
            out.flush()
