"""Translations: every string people read goes through gettext, and the catalogue is current.

A pseudo-translation wraps each message in «…» (and says which plural form
ngettext chose), so a string left unmarked shows up as text outside any «…».
"""

from __future__ import annotations

import os
import re
import shutil
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
from django.core.management import call_command
from django.core.management.base import CommandError
from django.test import Client
from django.urls import reverse
from django.utils.translation import trans_real

import django_federation_delivery
from django_federation_delivery import controls
from django_federation_delivery.checks import check_settings
from django_federation_delivery.models import Status

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
        "«[one] Requeued 1 delivery, due now; pending or delivered ones are left alone.»"
    ]
    assert requeue([rows[1].pk, rows[2].pk]) == [
        "«[many] Requeued 2 deliveries, due now; pending or delivered ones are left alone.»"
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
    with pytest.raises(CommandError, match=r"^«expected a whole number of 0 or more, not 'x'»$"):
        call_command("delivery_status", "--hosts", "x")


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
