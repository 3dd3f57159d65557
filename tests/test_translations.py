"""Translations: every string people read goes through gettext, and the catalogue is current.

A pseudo-translation wraps each message in «…» (and says which plural form
ngettext chose), so a string left unmarked shows up as text outside any «…».
"""

from __future__ import annotations

import datetime as dt
import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from html.parser import HTMLParser
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings
from django.contrib.admin.helpers import ACTION_CHECKBOX_NAME
from django.core.exceptions import ImproperlyConfigured
from django.core.management import call_command, load_command_class
from django.core.management.base import BaseCommand, CommandError
from django.test import Client
from django.urls import reverse
from django.utils.translation import trans_real

import django_federation_delivery
from django_federation_delivery import controls
from django_federation_delivery.charts import time_label
from django_federation_delivery.checks import check_settings
from django_federation_delivery.conf import app_settings
from django_federation_delivery.contrib.django_q import cluster_limit, round_seconds
from django_federation_delivery.models import Batch, DelivererHeartbeat, Status
from django_federation_delivery.retention import Purged
from django_federation_delivery.settling import Summary
from django_federation_delivery.supervisor import describe_exit
from django_federation_delivery.webhooks import parse_destination

from . import operators
from .operators import queue, settle

PACKAGE = Path(django_federation_delivery.__file__).parent
CATALOGUE = PACKAGE / "locale" / "en" / "LC_MESSAGES" / "django.po"


class Pseudo:
    """The active translation, with every message wrapped in «…»; ngettext
    also says the form it chose, ``[one]`` or ``[many]``."""

    def __init__(self, real: Any) -> None:
        self.real = real

    def gettext(self, message: str) -> str:
        return f"«{message}»"

    def ngettext(self, singular: str, plural: str, number: int) -> str:
        return f"«[one] {singular}»" if number == 1 else f"«[many] {plural}»"

    def __getattr__(self, name: str) -> Any:
        # to_language(), plural() and the rest: the real catalogue's.
        return getattr(self.real, name)


@pytest.fixture
def pseudo() -> Iterator[None]:
    active = trans_real._active
    previous = getattr(active, "value", None)
    active.value = Pseudo(trans_real.translation(settings.LANGUAGE_CODE))
    try:
        yield
    finally:
        if previous is None:
            del active.value
        else:
            active.value = previous


def untranslated(text: str) -> str:
    """What is left of ``text`` once every «…» (nested ones too) is taken out."""
    while True:
        shorter = re.sub(r"«[^«»]*»", "", text)
        if shorter == text:
            return text
        text = shorter


class MainText(HTMLParser):
    """The text of ``#content-main``, without the charts (their time labels
    are dates, not messages) and without style or script."""

    def __init__(self) -> None:
        super().__init__()
        self.depth = 0
        self.skipping = 0
        self.text: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if self.depth:
            self.depth += tag == "div"
            self.skipping += tag in ("svg", "style", "script")
        elif tag == "div" and ("id", "content-main") in attrs:
            self.depth = 1

    def handle_endtag(self, tag: str) -> None:
        if self.depth:
            self.depth -= tag == "div"
            self.skipping -= tag in ("svg", "style", "script")

    def handle_data(self, data: str) -> None:
        if self.depth and not self.skipping:
            self.text.append(data)


def letters(text: str) -> list[str]:
    return re.findall(r"[^\W\d_]+", text)


def login() -> Client:
    client = Client()
    client.force_login(operators.user("operator"))
    return client


@pytest.mark.django_db
def test_every_word_of_the_queues_page_is_translated(pseudo: None) -> None:
    # Work due and no deliverer (a warning), a paused host, breakers: most tables filled.
    queue(hosts=["a.example"], per_host=1)
    controls.pause_host("paused.example")
    page = login().get(reverse("admin:federation_delivery_delivery_queues")).content.decode()
    assert "<title>«Queues at a glance»" in page
    parser = MainText()
    parser.feed(page)
    text = " ".join(parser.text).replace("paused.example", "")
    assert "«Warning: «No deliverer has been seen" in text, "the warning, and its reason"
    assert letters(untranslated(text)) == []
    # The charts: legend, axis title, and the summary read out by screen readers.
    assert "«delivered»" in page and "«breaker opened»" in page
    assert "«time (UTC), one point a minute»" in page
    assert "«Last hour, by minute»: " in page


@pytest.mark.django_db
def test_an_action_message_is_translated_with_the_plural_form_ngettext_chose(
    pseudo: None,
) -> None:
    rows = list(queue(per_host=2).deliveries.order_by("id"))
    for row in rows[:3]:
        settle(row, Status.FAILED)
    client = login()
    changelist = reverse("admin:federation_delivery_delivery_changelist")

    def requeue(ids: list[int]) -> list[str]:
        response = client.post(
            changelist,
            {"action": "requeue", ACTION_CHECKBOX_NAME: [str(id) for id in ids], "index": "0"},
            follow=True,
        )
        return [str(message) for message in response.context["messages"]]

    assert requeue([rows[0].pk]) == [
        "«[one] Requeued 1 delivery, due now, after what it waits on, or once its paused host "
        "is resumed; pending or delivered ones, those past their batch's deadline, and those "
        "a later Delete or Undo of their sender took back, are left alone.»"
    ]
    assert requeue([rows[1].pk, rows[2].pk]) == [
        "«[many] Requeued 2 deliveries, due now, after what they wait on, or once their paused "
        "host is resumed; pending or delivered ones, those past their batch's deadline, and "
        "those a later Delete or Undo of their sender took back, are left alone.»"
    ]


def test_a_system_check_says_what_is_wrong_and_what_to_write_in_translation(
    pseudo: None, settings: Any
) -> None:
    settings.FEDERATION_DELIVERY = {**settings.FEDERATION_DELIVERY, "CLAIM_SIZE": 0}
    (error,) = [m for m in check_settings() if m.id == "federation_delivery.E005"]
    assert error.msg == (
        "«FEDERATION_DELIVERY['CLAIM_SIZE'] must be a whole number from 1 to 10000, not 0.»"
    )
    assert error.hint == "«Leave it out for the default, 64.»"


@pytest.mark.django_db
def test_a_command_prints_and_refuses_in_translation(pseudo: None) -> None:
    out = StringIO()
    call_command("delivery_status", stdout=out)
    text = out.getvalue()
    assert "«Deliverers»" in text and "«Hosts failing most»" in text
    assert "«lane»" in text.splitlines()[2]
    with pytest.raises(
        CommandError, match=r"^«expected a whole number from 0 to 100000, not 'x'»$"
    ):
        call_command("delivery_status", "--hosts", "x")


COMMANDS = ("run_deliverer", "purge_deliveries", "delivery_status", "delivery_schedule")


@pytest.mark.parametrize("name", COMMANDS)
def test_a_command_s_help_and_each_of_its_arguments_help_are_translated(
    pseudo: None, name: str
) -> None:
    command = load_command_class("django_federation_delivery", name)
    parser = command.create_parser("manage.py", name)
    assert parser.description and parser.description.startswith("«")
    assert letters(untranslated(parser.description)) == []
    # Django's own options (--verbosity, --settings…) are Django's to translate.
    django_s = {action.dest for action in BaseCommand().create_parser("manage.py", "x")._actions}
    own = [action for action in parser._actions if action.dest not in django_s]
    assert own, "the command has arguments of its own"
    for action in own:
        assert action.help and letters(untranslated(action.help)) == [], action.dest
    # Without GNU gettext the catalogue test is skipped: the help is in it all the same.
    assert command.help in messages(CATALOGUE)


def test_the_run_and_purge_lines_are_translated_with_the_plural_ngettext_chose(
    pseudo: None,
) -> None:
    run = Summary(delivered=3, failed=1).line()
    assert run.startswith("«delivered 3, retrying 0, refused 0, failed 1,")
    assert letters(untranslated(run)) == []
    purged = Purged(deliveries={"delivered": 1, "failed": 0}, batches=1, hosts=2, history=1)
    line = purged.line()
    assert "«[one] deleted 1 delivery» («delivered» 1, «failed» 0)" in line
    assert "«[one] 1 batch»" in line and "«[many] 2 hosts»" in line
    assert "«[one] 1 history minute»" in line
    assert letters(untranslated(line)) == []
    assert (
        "«[many] would delete 2 deliveries»"
        in Purged(deliveries={"delivered": 2}, dry_run=True).line()
    )


@pytest.mark.django_db
def test_the_purge_command_says_what_it_did_in_translation(pseudo: None) -> None:
    out = StringIO()
    call_command("purge_deliveries", "--dry-run", "--older-than", "1d", stdout=out)
    (line,) = out.getvalue().splitlines()
    assert line.startswith("«Dry run: «") and letters(untranslated(line)) == []


def test_the_supervisor_says_how_a_deliverer_ended_in_translation(pseudo: None) -> None:
    assert describe_exit(-signal.SIGKILL) == "«was killed by SIGKILL»"
    assert describe_exit(-200) == "«was killed by «signal 200»»"
    assert describe_exit(3) == "«exited with status 3»"
    assert describe_exit(None) == "«is still running»"


def test_settings_errors_are_translated(pseudo: None, settings: Any) -> None:
    settings.FEDERATION_DELIVERY = {**settings.FEDERATION_DELIVERY, "ALLOWED_NETWORKS": ["x"]}
    with pytest.raises(ImproperlyConfigured) as caught:
        app_settings.allowed_networks()
    settings.FEDERATION_DELIVERY = {**settings.FEDERATION_DELIVERY, "SKIP_IF": "no.such.thing"}
    with pytest.raises(ImproperlyConfigured) as imported:
        app_settings.callable_setting("SKIP_IF")
    with pytest.raises(ImproperlyConfigured) as destination:
        parse_destination("alerts", "ftp://example.com/hook")
    settings.Q_CLUSTER = {"timeout": "soon"}
    with pytest.raises(ImproperlyConfigured) as cluster:
        cluster_limit()
    settings.Q_CLUSTER = {"timeout": 40, "retry": 60}
    with pytest.raises(ImproperlyConfigured) as bound:
        round_seconds(30)
    for error in (caught, imported, destination, cluster, bound):
        text = str(error.value)
        assert text.startswith("«") and letters(untranslated(text)) == [], text


def test_what_a_model_says_of_itself_is_translated(pseudo: None) -> None:
    heartbeat = DelivererHeartbeat(pid=12, host="worker-1")
    assert str(heartbeat) == "«deliverer pid 12 on worker-1»"
    batch = Batch(pk=7, sender="https://social.example/users/alice")
    assert str(batch) == "««batch 7» from https://social.example/users/alice»"


def test_the_chart_s_weekdays_are_translated(pseudo: None) -> None:
    monday = dt.datetime(2024, 1, 1, 13, 5, tzinfo=dt.UTC)
    assert time_label(monday, "%a %H:%M") == "«Mon» 13:05"
    assert time_label(monday, "%H:%M") == "13:05"


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("xgettext") is None, reason="makemessages needs GNU gettext")
def test_the_committed_catalogue_holds_every_message_of_the_code(tmp_path: Path) -> None:
    copy = tmp_path / "django_federation_delivery"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__", "en"))
    # No settings: makemessages needs none, and the copy is not on the path.
    # -P: the copy's own modules are not put on the path of the process.
    env = {name: value for name, value in os.environ.items() if name != "DJANGO_SETTINGS_MODULE"}
    subprocess.run(
        [sys.executable, "-P", "-m", "django", "makemessages", "--locale", "en", "--no-location"],
        cwd=copy,
        env=env,
        check=True,
        capture_output=True,
        timeout=120,
    )
    made = copy / "locale" / "en" / "LC_MESSAGES" / "django.po"
    assert messages(CATALOGUE) == messages(made), (
        "the catalogue is out of date: run `django-admin makemessages -l en` in "
        "django_federation_delivery/"
    )


def messages(po: Path) -> set[str]:
    """The msgids (and plural msgids) of a .po file, continuation lines joined."""
    found: set[str] = set()
    current: list[str] | None = None
    for line in [*po.read_text(encoding="utf-8").splitlines(), ""]:
        if line.startswith(("msgid ", "msgid_plural ")):
            if current is not None:
                found.add("".join(current))
            current = [line.split(" ", 1)[1][1:-1]]
        elif line.startswith('"') and current is not None:
            current.append(line[1:-1])
        elif current is not None:
            found.add("".join(current))
            current = None
    return found - {""}


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("args", "code", "prefix"),
    [
        ([], 0, "OK: «"),
        (["--max-lag", "soon"], 3, "UNKNOWN: «"),
    ],
)
def test_a_health_check_s_first_word_stays_english(
    pseudo: None, args: list[str], code: int, prefix: str
) -> None:
    # Monitoring reads the first word; the rest is for the operator, translated.
    out = StringIO()
    exited = 0
    try:
        call_command("delivery_status", "--check", *args, stdout=out)
    except SystemExit as exit_:
        exited = exit_.code
    assert exited == code
    assert out.getvalue().startswith(prefix), out.getvalue()
