"""example_project: its signal receivers (RemoteServer), its key provider
(Actor), its admin, and ``manage.py demo`` end to end.

The example app is not one of the suite's apps (its receivers would count
every delivery of every test), so each test runs ``example_project/manage.py``
in a subprocess, on a database of its own made for this module: a file on
SQLite, a fresh database on the suite's PostgreSQL server. All are slow.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import pytest
from django.db import connection

from .conftest import ROOT

pytestmark = pytest.mark.slow

EXAMPLE_MANAGE = [sys.executable, str(ROOT / "example_project" / "manage.py")]
ALICE = "http://example.test/users/alice"


@pytest.fixture(scope="module")
def example_env(
    tmp_path_factory: pytest.TempPathFactory, django_db_blocker: Any
) -> Iterator[dict[str, str]]:
    """The example project's environment, on its own database, migrated."""
    if connection.vendor == "postgresql":
        settings = connection.settings_dict
        name = f"example_{os.getpid()}_{uuid.uuid4().hex[:8]}"
        with django_db_blocker.unblock(), connection.cursor() as cursor:
            cursor.execute(f'CREATE DATABASE "{name}"')
        url = (
            f"postgres://{settings['USER']}:{settings['PASSWORD'] or ''}@{settings['HOST']}:"
            f"{settings['PORT']}/{name}"
        )
    else:
        name = ""
        url = f"sqlite:///{tmp_path_factory.mktemp('example') / 'db.sqlite3'}"
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("WEBHOOK_")},
        "DATABASE_URL": url,
        "DJANGO_SETTINGS_MODULE": "exampleproject.settings",
        "FEDERATION_DELIVERY_ALLOWED_NETWORKS": "127.0.0.0/8",
        "FEDERATION_DELIVERY_WEBHOOK_ALLOWED_NETWORKS": "127.0.0.0/8",
        "PYTHONPATH": str(ROOT),
    }
    try:
        manage(env, "migrate", "--noinput", "-v0")
        yield env
    finally:
        if name:
            with django_db_blocker.unblock(), connection.cursor() as cursor:
                cursor.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def manage(env: dict[str, str], *args: str) -> str:
    """The example project's ``manage.py`` with ``args``, which must succeed;
    what it printed."""
    done = subprocess.run(
        [*EXAMPLE_MANAGE, *args], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def run(env: dict[str, str], code: str) -> Any:
    """``code`` run by ``manage.py shell`` in the example project; what it
    printed last, read as JSON."""
    return json.loads(manage(env, "shell", "-c", code).strip().splitlines()[-1])


def example_variables(tmp_path: Path, variables: dict[str, str]) -> dict[str, str]:
    """An environment with none of the caller's example project variables but
    ``variables``, on a SQLite file in ``tmp_path`` unless they say otherwise."""
    return {
        **{
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("WEBHOOK_", "FEDERATION_DELIVERY_", "Q_CLUSTER_"))
            and k not in ("DEBUG", "SECRET_KEY", "ALLOWED_HOSTS", "SILENCED_SYSTEM_CHECKS")
        },
        "DATABASE_URL": f"sqlite:///{tmp_path / 'db.sqlite3'}",
        "DJANGO_SETTINGS_MODULE": "exampleproject.settings",
        "PYTHONPATH": str(ROOT),
        **variables,
    }


def refused(tmp_path: Path, variables: dict[str, str], *args: str) -> str:
    """``manage.py args`` in the example project with ``variables`` set, which
    its settings must refuse: the command must fail; what it printed on stderr."""
    env = example_variables(tmp_path, variables)
    done = subprocess.run(
        [*EXAMPLE_MANAGE, *args], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode != 0, done.stdout + done.stderr
    return done.stderr


@pytest.mark.any_database
def test_check_fails_naming_both_variables_that_set_one_webhook_destination(
    tmp_path: Path,
) -> None:
    # Neither is the one meant; "System check identified no issues" would
    # send one of them's events astray.
    stderr = refused(
        tmp_path,
        {
            "WEBHOOK_OPS": "slack://hooks.slack.com/services/T1/B1/one",
            "WEBHOOK_ops": "slack://hooks.slack.com/services/T2/B2/two",
        },
        "check",
    )
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("django.core.exceptions.ImproperlyConfigured: "), stderr
    assert "WEBHOOK_OPS" in last and "WEBHOOK_ops" in last
    assert "B1/one" not in stderr and "B2/two" not in stderr


@pytest.mark.any_database
def test_the_deliverer_does_not_start_with_a_bad_variable_and_names_it(tmp_path: Path) -> None:
    stderr = refused(
        tmp_path, {"FEDERATION_DELIVERY_RETENTION_DAYS": "abc"}, "run_deliverer", "--drain"
    )
    last = stderr.strip().splitlines()[-1]
    assert last == (
        "django.core.exceptions.ImproperlyConfigured: FEDERATION_DELIVERY_RETENTION_DAYS "
        "must be a positive number of days, at most 36500, not 'abc'."
    ), stderr


# Imports the settings module afresh for each case (a name and its
# variables), as manage.py would, in one process for them all: what it read,
# or the traceback manage.py would show; and all it printed or warned.
READ_SETTINGS = """
import contextlib, io, json, os, sys, traceback, warnings
base = dict(os.environ)
found = {}
for case, variables in json.loads(sys.argv[1]).items():
    os.environ.clear()
    os.environ.update(base, **variables)
    sys.modules.pop("exampleproject.settings", None)
    printed = io.StringIO()
    with (
        warnings.catch_warnings(record=True) as warned,
        contextlib.redirect_stdout(printed),
        contextlib.redirect_stderr(printed),
    ):
        warnings.simplefilter("always")
        try:
            import exampleproject.settings as s
        except Exception:
            found[case] = {"error": traceback.format_exc()}
        else:
            found[case] = {"read": {
                "SECRET_KEY": s.SECRET_KEY,
                "DEBUG": s.DEBUG,
                "ALLOWED_HOSTS": s.ALLOWED_HOSTS,
                "SILENCED_SYSTEM_CHECKS": s.SILENCED_SYSTEM_CHECKS,
                "DATABASE": {k: s.DATABASES["default"].get(k) for k in ("NAME", "HOST", "PORT")},
                "CONNECTION": {k: s.DATABASES["default"].get(k) for k in (
                    "CONN_MAX_AGE", "CONN_HEALTH_CHECKS")},
                "WORKERS": getattr(s, "Q_CLUSTER", {}).get("workers"),
                **{k: s.FEDERATION_DELIVERY.get(k) for k in (
                    "ALLOWED_NETWORKS", "WEBHOOK_ALLOWED_NETWORKS", "WEBHOOK_RETRY")},
            }}
    found[case]["printed"] = printed.getvalue() + "".join(str(w.message) for w in warned)
print(json.dumps(found, default=str))
"""

PASSWORD = "s3cretpw"
DID = "did:key:z6MkhaXgBZDvotDkL5257faiztiGiC2QtKLGpbnnEGta2doK"
WORKERS_READ = find_spec("django_q") is not None  # Q_CLUSTER_WORKERS, else unread

# Each refused: a variable, and values that must not start the project.
REFUSED = {
    "DATABASE_URL": [
        f"//app:{PASSWORD}@db.internal/app",  # no scheme
        f"postgres//app:{PASSWORD}@db.internal/app",  # no colon after it
        f"postgres://app:{PASSWORD}@db.internal:54e2/app",  # a port no number
        # One slash: read as a local database "app:s3cretpw@db.internal/app".
        f"postgres:/app:{PASSWORD}@db.internal/app",
        # Two slashes: db.sqlite3 wherever the process runs, its "host" left out.
        f"sqlite://app:{PASSWORD}@var/db.sqlite3",
        # Passed on as text by django-environ: a TypeError at the first query,
        # and "false" read as true.
        f"postgres://app:{PASSWORD}@db.internal/app?conn_max_age=10m",
        f"postgres://app:{PASSWORD}@db.internal/app?conn_max_age=-1",
        # Read as Python literals: a list, a complex number, a bool.
        f"postgres://app:{PASSWORD}@db.internal/app?conn_max_age=%5B600%5D",
        f"postgres://app:{PASSWORD}@db.internal/app?conn_max_age=1j",
        f"postgres://app:{PASSWORD}@db.internal/app?conn_max_age=True",
        f"postgres://app:{PASSWORD}@db.internal/app?conn_health_checks=maybe",
        # Three slashes: var/db.sqlite3 from wherever each process runs, one
        # database for migrate, another for the deliverer.
        "sqlite:///var/db.sqlite3",
        # A TypeError at the first connection, naming neither.
        "sqlite:////tmp/db.sqlite3?timeout=abc",
        "sqlite:////tmp/db.sqlite3?timeout=-1",
    ],
    # "false" with no SECRET_KEY: sessions signed with the key written here.
    "DEBUG": ["ture", "enabled", "", "false"],
    "FEDERATION_DELIVERY_WEBHOOK_RETRY": ["-1", "nan", "30,inf", "0"],
    # A finite number of days whose seconds are not.
    "FEDERATION_DELIVERY_RETENTION_DAYS": ["1e305", "36501"],
    "FEDERATION_DELIVERY_RETENTION_FAILED_DAYS": ["1e305"],
    **({"Q_CLUSTER_WORKERS": ["two", "2.5", "-1", "0"]} if WORKERS_READ else {}),
}

# Each accepted: variables, and what the settings must read from them.
ACCEPTED: list[tuple[dict[str, str], dict[str, Any]]] = [
    ({}, {"DEBUG": True, "ALLOWED_HOSTS": ["localhost", "127.0.0.1", "[::1]"]}),
    *(({"DEBUG": word}, {"DEBUG": True}) for word in ("TRUE", "yes", "On", "1")),
    *(
        ({"DEBUG": word, "SECRET_KEY": "k"}, {"DEBUG": False})
        for word in ("false", "No", " off ", "0")
    ),
    (
        {"DATABASE_URL": f"postgres://app:{PASSWORD}@db.internal:6432/app"},
        {"DATABASE": {"NAME": "app", "HOST": "db.internal", "PORT": 6432}},
    ),
    (
        {"DATABASE_URL": "postgres://db.internal/app?conn_max_age=600&conn_health_checks=false"},
        {"CONNECTION": {"CONN_MAX_AGE": 600, "CONN_HEALTH_CHECKS": False}},
    ),
    (
        {"DATABASE_URL": "postgres://db.internal/app?conn_health_checks=On"},
        {"CONNECTION": {"CONN_MAX_AGE": None, "CONN_HEALTH_CHECKS": True}},
    ),
    # A comma list: each item stripped, empty ones left out.
    (
        {
            "ALLOWED_HOSTS": " localhost, app.example ,",
            "SILENCED_SYSTEM_CHECKS": "federation_delivery.W001, federation_delivery.W003",
            "FEDERATION_DELIVERY_ALLOWED_NETWORKS": "127.0.0.0/8, ::1/128",
            "FEDERATION_DELIVERY_WEBHOOK_ALLOWED_NETWORKS": "10.0.0.0/8,, 192.168.0.0/16",
        },
        {
            "ALLOWED_HOSTS": ["localhost", "app.example"],
            "SILENCED_SYSTEM_CHECKS": ["federation_delivery.W001", "federation_delivery.W003"],
            "ALLOWED_NETWORKS": ["127.0.0.0/8", "::1/128"],
            "WEBHOOK_ALLOWED_NETWORKS": ["10.0.0.0/8", "192.168.0.0/16"],
        },
    ),
    ({"FEDERATION_DELIVERY_WEBHOOK_RETRY": "0.5, 1,"}, {"WEBHOOK_RETRY": [0.5, 1.0]}),
    # One of Django's random keys in fifty starts with "$", which
    # django-environ reads as the name of another variable.
    ({"SECRET_KEY": "$k9#x-7q!not-a-variable"}, {"SECRET_KEY": "$k9#x-7q!not-a-variable"}),
    *([({"Q_CLUSTER_WORKERS": " 3 "}, {"WORKERS": 3})] if WORKERS_READ else []),
]


@pytest.fixture(scope="module")
def settings_read(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """What the settings made of each case of REFUSED and ACCEPTED, by name."""
    cases = {
        **{
            f"{variable}={value}": {variable: value}
            for variable, values in REFUSED.items()
            for value in values
        },
        **{f"accepted {n}": variables for n, (variables, _) in enumerate(ACCEPTED)},
    }
    done = subprocess.run(
        [sys.executable, "-c", READ_SETTINGS, json.dumps(cases)],
        env={
            **example_variables(tmp_path_factory.mktemp("settings"), {}),
            "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "example_project")]),
        },
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    found: dict[str, Any] = json.loads(done.stdout)
    return found


@pytest.mark.any_database
def test_the_settings_refuse_a_malformed_variable_by_name_never_showing_a_password(
    settings_read: dict[str, Any],
) -> None:
    wrong = {}
    for variable, values in REFUSED.items():
        for value in values:
            found = settings_read[f"{variable}={value}"]
            last = found.get("error", "").strip().splitlines()[-1:]
            if not (
                last
                and last[0].startswith("django.core.exceptions.ImproperlyConfigured: ")
                and variable in last[0]
            ):
                wrong[f"{variable}={value!r}"] = last or found["read"]
            if PASSWORD in found.get("error", "") + found["printed"]:
                wrong[f"{variable}={value!r}"] = "its password shown"
    assert not wrong, wrong


@pytest.mark.any_database
def test_the_settings_read_each_accepted_form_of_a_variable(
    settings_read: dict[str, Any],
) -> None:
    wrong = {}
    for n, (variables, expected) in enumerate(ACCEPTED):
        found = settings_read[f"accepted {n}"]
        read = {k: found.get("read", {}).get(k) for k in expected}
        if read != expected or found["printed"]:
            wrong[str(variables)] = found.get("error") or (read, found["printed"])
    assert not wrong, wrong


SIGNALS = """
import json
from django_federation_delivery.signals import (
    Failure, Settled, delivery_failed, delivery_settled, send_safely,
)
from federation_demo.models import RemoteServer

def failed(inbox, status, refused=False, deadline=False, destination=""):
    send_safely(delivery_failed, failure=Failure(
        delivery_id=1, batch_id=1, inbox=inbox, sender="", tag="", status=status,
        error="", deadline=deadline, refused=refused, destination=destination))

def settled(inbox, outcome="delivered", status=202, destination=""):
    send_safely(delivery_settled, settled=Settled(
        delivery_id=1, batch_id=1, inbox=inbox, sender="", tag="", outcome=outcome,
        status=status, destination=destination))

def rows():
    return {
        row.host: [row.gone, row.gone_at is not None, row.failures,
                   row.last_failure_status, row.delivered,
                   row.gone_at.isoformat() if row.gone_at else None]
        for row in RemoteServer.objects.all()
    }
"""


def test_the_example_projects_own_tests_pass_with_the_testing_helpers(
    example_env: dict[str, str],
) -> None:
    # Django's runner makes a test database of its own beside example_env's.
    done = subprocess.run(
        [*EXAMPLE_MANAGE, "test", "federation_demo", "--noinput", "-v2"],
        env=example_env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "Ran 2 tests" in done.stderr and "OK" in done.stderr


@pytest.mark.any_database
def test_a_410_refusal_marks_the_server_gone_once_and_counts_each_failure(
    example_env: dict[str, str],
) -> None:
    rows = run(
        example_env,
        SIGNALS
        + """
failed("https://gone.example/users/a/inbox", 410, refused=True)
first = rows()["gone.example"][5]
failed("https://gone.example/users/b/inbox", 410, refused=True)
settled("https://gone.example/users/c/inbox", outcome="refused", status=410)
print(json.dumps({"rows": rows(), "first": first}))
""",
    )
    gone, has_gone_at, failures, status, delivered, gone_at = rows["rows"]["gone.example"]
    assert (gone, has_gone_at, failures, status, delivered) == (True, True, 2, 410, 0)
    assert gone_at == rows["first"], "gone since the first 410, not the last"


@pytest.mark.any_database
def test_failures_without_a_410_count_against_the_server_and_leave_it_not_gone(
    example_env: dict[str, str],
) -> None:
    rows = run(
        example_env,
        SIGNALS
        + """
failed("https://down.example/inbox", None, deadline=True)
failed("https://down.example:8443/other/inbox", 503)
failed("https://strict.example/inbox", 400, refused=True)
print(json.dumps(rows()))
""",
    )
    # A row a host and port, as the package's breakers count: another port
    # is another server.
    assert rows["down.example"][:5] == [False, False, 1, None, 0]
    assert rows["down.example:8443"][:5] == [False, False, 1, 503, 0]
    assert rows["strict.example"][:5] == [False, False, 1, 400, 0]


@pytest.mark.any_database
def test_each_delivery_counts_as_delivered_and_webhook_deliveries_are_left_out(
    example_env: dict[str, str],
) -> None:
    rows = run(
        example_env,
        SIGNALS
        + """
for n in range(3):
    settled(f"https://busy.example/users/{n}/inbox")
settled("https://busy.example/users/x/inbox", outcome="skipped", status=None)
settled("ops", destination="ops")
failed("ops", 410, refused=True, destination="ops")
print(json.dumps(rows()))
""",
    )
    assert rows["busy.example"][:5] == [False, False, 0, None, 3]
    assert not [host for host in rows if "ops" in host]


@pytest.mark.any_database
def test_a_portable_inboxs_deliveries_count_against_its_gateways_host(
    example_env: dict[str, str],
) -> None:
    # Its inbox, ap://did:…, names no host: counted against none, a 410
    # from its gateway never marked that server gone.
    found = run(
        example_env,
        f"""
import json
from django_federation_delivery import PortableInbox, send, send_portable
from django_federation_delivery.testing import deliver_all
from django_federation_delivery.testing.fake import FakeInbox
from federation_demo.keys import ALICE
from federation_demo.models import RemoteServer
note = {{"type": "Create", "id": ALICE + "/notes/portable/activity", "actor": ALICE}}
send(ALICE, note, ["https://gw.example/users/carol/inbox"])
# Counted against the gateway's host, as Delivery.host names it.
send_portable(ALICE, note, [PortableInbox("ap://{DID}/actor/inbox", ["https://gw.example"])])
send_portable(ALICE, note, [PortableInbox("ap://{DID}/other/inbox", ["https://gw-gone.example"])])
fake = FakeInbox()
fake.answer(410, url="https://gw-gone.example/.well-known/apgateway/{DID}/other/inbox")
deliver_all(fake=fake)
print(json.dumps({{r.host: [r.delivered, r.failures, r.gone] for r in RemoteServer.objects.all()}}))
""",
    )
    assert (found.get("gw.example"), found.get("gw-gone.example")) == ([2, 0, False], [0, 1, True])


@pytest.mark.any_database
def test_the_debug_page_under_runserver_shows_no_database_password_or_webhook_url(
    tmp_path: Path,
) -> None:
    # runserver puts the process's environment in every request's META,
    # which the DEBUG page (and the mail a 500 sends to ADMINS) lists.
    hook = "s3cretHookToken9"
    code = f"""
import sys
from django.core.servers.basehttp import ServerHandler
from django.test import RequestFactory
from django.views.debug import technical_500_response
request = RequestFactory().get("/admin/", **ServerHandler.os_environ)
try:
    raise RuntimeError("a view's bug")
except RuntimeError:
    page = technical_500_response(request, *sys.exc_info()).content.decode()
print("shown:", "{PASSWORD}" in page, "{hook}" in page, "DATABASE_URL" in page)
"""
    variables = {
        "DATABASE_URL": f"postgres://app:{PASSWORD}@127.0.0.1:1/app",
        "WEBHOOK_OPS": f"slack://hooks.slack.com/services/T1/B1/{hook}",
    }
    done = subprocess.run(
        [*EXAMPLE_MANAGE, "shell", "-c", code],
        env=example_variables(tmp_path, variables),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    # Listed, its value hidden.
    assert done.stdout.strip().splitlines()[-1] == "shown: False False True"


@pytest.mark.any_database
@pytest.mark.parametrize("debug", ["true", "false"])
def test_a_signal_receiver_that_raises_is_logged_whatever_debug_says(
    tmp_path: Path, debug: str
) -> None:
    # The package logs it on django.dispatch, whose errors Django's defaults
    # send to ADMINS alone with DEBUG off.
    code = """
from django_federation_delivery.signals import Settled, delivery_settled, send_safely
def broken(sender, settled, **kwargs):
    raise RuntimeError("the receiver broke")
delivery_settled.connect(broken, dispatch_uid="broken")
send_safely(delivery_settled, settled=Settled(
    delivery_id=1, batch_id=1, inbox="https://a.example/inbox", sender="", tag="",
    outcome="delivered", status=202))
"""
    done = subprocess.run(
        [*EXAMPLE_MANAGE, "shell", "-c", code],
        env=example_variables(tmp_path, {"DEBUG": debug, "SECRET_KEY": "k"}),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "broken, a receiver of delivery_settled: RuntimeError raised at" in done.stderr
    assert "the receiver broke" not in done.stderr, "not its message: it may quote a token"


@pytest.mark.any_database
def test_the_key_provider_makes_a_demo_actor_once_and_reads_its_key_from_the_row(
    example_env: dict[str, str],
) -> None:
    found = run(
        example_env,
        f"""
import json
from federation_demo.keys import sender_key
from federation_demo.models import Actor
first, again = sender_key({ALICE!r}), sender_key({ALICE!r})
row = Actor.objects.get(uri={ALICE!r})
print(json.dumps({{
    "key_ids": [first.key_id, again.key_id],
    "same_key": first.public_key_pem() == again.public_key_pem() == row.public_key_pem,
    "actors": Actor.objects.filter(uri={ALICE!r}).count(),
    "private_in_str": "PRIVATE" in str(row) + repr(row),
    "stranger": repr(sender_key("http://example.test/users/mallory")),
    "elsewhere": repr(sender_key("https://other.example/users/alice")),
}}))
""",
    )
    assert found["key_ids"] == [f"{ALICE}#main-key"] * 2
    assert found["same_key"] is True
    assert found["actors"] == 1
    assert found["private_in_str"] is False
    assert (found["stranger"], found["elsewhere"]) == ("None", "None")


@pytest.mark.any_database
def test_the_admin_shows_actors_keys_by_id_and_public_half_only(
    example_env: dict[str, str],
) -> None:
    page = run(
        example_env,
        f"""
import json
from django.contrib.auth.models import User
from django.test import Client
from federation_demo.keys import sender_key
from federation_demo.models import Actor, RemoteServer
sender_key({ALICE!r})
actor = Actor.objects.get(uri={ALICE!r})
RemoteServer.objects.get_or_create(host="gone.example", defaults={{"gone": True}})
User.objects.filter(username="admin").delete()
client = Client()
client.force_login(User.objects.create_superuser("admin", "", "x"))
change = client.get(f"/admin/federation_demo/actor/{{actor.pk}}/change/", HTTP_HOST="localhost")
servers = client.get("/admin/federation_demo/remoteserver/?gone__exact=1", HTTP_HOST="localhost")
text = change.content.decode()
print(json.dumps({{
    "status": [change.status_code, servers.status_code],
    "key_id": actor.key_id in text,
    "public": actor.public_key_pem.splitlines()[1] in text,
    "private": actor.private_key_pem.splitlines()[1] in text or "PRIVATE KEY" in text,
    "gone_listed": "gone.example" in servers.content.decode(),
}}))
""",
    )
    assert page["status"] == [200, 200]
    assert (page["key_id"], page["public"], page["gone_listed"]) == (True, True, True)
    assert page["private"] is False


def test_the_demo_fills_the_remote_servers_table_from_a_real_fan_out(
    example_env: dict[str, str], tmp_path: Path
) -> None:
    out = manage(example_env, "demo", "--inboxes", "12")
    assert "All " in out and "signatures and digests verified." in out
    table = out.split("as the project's signal receivers recorded them")[1].split("\n\n")[0]
    # Keyed by address: each server's row is its address and its port.
    lines = {
        line.split()[0].partition(":")[0]: line.split()
        for line in table.splitlines()[2:]
        if line.strip()
    }
    # The 410 inbox (127.0.0.6) is gone; the closed port (127.0.0.7) failed
    # without an answer; an accepting one (127.0.0.2) took its two.
    assert lines["127.0.0.6"][1:5] == ["0", "2", "410", "yes,"]
    assert lines["127.0.0.7"][1:6] == ["0", "2", "no", "answer", "-"]
    assert lines["127.0.0.2"][1:4] == ["2", "0", "-"]
    assert "From the send to the first delivery" in out


def test_the_demo_sends_its_alerts_to_its_webhook_stand_ins_in_order(
    example_env: dict[str, str],
) -> None:
    # The destinations scripts/demo configures: a Slack stand-in and a signed
    # JSON one, on loopback ports free now, retried within seconds.
    exports = subprocess.run(
        [sys.executable, str(ROOT / "example_project/federation_demo/local_webhooks.py")],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    webhooks = dict(
        line.removeprefix("export ").replace("'", "").split("=", 1) for line in exports.splitlines()
    )
    env = {**example_env, **webhooks, "FEDERATION_DELIVERY_WEBHOOK_RETRY": "0.5,1,2,2"}
    out = manage(env, "demo", "--inboxes", "12")
    received = out.split("What each webhook destination received")[1]
    assert received.count("in order: yes; 4 of 4 events accepted") == 2
    assert "6 of 6 requests verified" in received
    assert "Webhook deliveries by status: delivered 8" in received


@pytest.mark.any_database
def test_the_demo_names_a_stand_in_by_its_address_never_its_password(
    example_env: dict[str, str],
) -> None:
    # A signed-JSON destination behind basic auth on a port something else
    # holds: "Cannot start the stand-in for audit (Signed JSON) on
    # user:password@127.0.0.9:…", its password on the terminal.
    import base64
    import socket

    key = "whsec_" + base64.b64encode(b"k" * 32).decode().replace("=", "%3D")
    with socket.socket() as busy:
        busy.bind(("127.0.0.9", 0))
        busy.listen()
        port = busy.getsockname()[1]
        env = {
            **example_env,
            "SILENCED_SYSTEM_CHECKS": "federation_delivery.W003",
            "WEBHOOK_AUDIT": f"http://user:{PASSWORD}@127.0.0.9:{port}/hooks/audit?secret={key}",
        }
        done = subprocess.run(
            [*EXAMPLE_MANAGE, "demo", "--inboxes", "6"],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert f"Cannot start the stand-in for audit (Signed JSON) on 127.0.0.9:{port}" in done.stderr
    assert PASSWORD not in done.stdout + done.stderr
