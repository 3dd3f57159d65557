"""Webhook destinations: the URL forms, the environment, redaction and the system check."""

from __future__ import annotations

import base64
import logging
import os
import subprocess
import sys
from typing import Any

import environ
import pytest
from django.core.exceptions import ImproperlyConfigured
from django.test import RequestFactory
from django.views.debug import ExceptionReporter, SafeExceptionReporterFilter

from django_federation_delivery import send_webhook
from django_federation_delivery.checks import check_webhooks
from django_federation_delivery.webhooks import (
    Destination,
    configured_destinations,
    parse_destination,
    webhooks_from_env,
)
from django_federation_delivery.webhooks.destinations import WebhookURL

from .conftest import ROOT

KEY = bytes(range(32))
SECRET = "whsec_" + base64.b64encode(KEY).decode()
OTHER_KEY = bytes(range(100, 132))
OTHER_SECRET = "whsec_" + base64.b64encode(OTHER_KEY).decode()

SLACK = "slack://hooks.slack.com/services/T0001/B0001/XXXXXXXXXXXXXXXXXXXXXXXX"
DISCORD = "discord://discord.com/api/webhooks/123456789012345678/DiscordTokenDiscordToken"
MARKDOWN = "markdown://chat.example/hooks/mattermostkey123456789"
TELEGRAM = "telegram://123456:ABC-telegram_token@-1001234567890"


@pytest.mark.parametrize(
    ("url", "kind", "sent_to"),
    [
        (
            SLACK,
            "slack",
            "https://hooks.slack.com/services/T0001/B0001/XXXXXXXXXXXXXXXXXXXXXXXX",
        ),
        (
            "slack+http://127.0.0.1:8000/services/T/B/X",
            "slack",
            "http://127.0.0.1:8000/services/T/B/X",
        ),
        (
            DISCORD,
            "discord",
            # On a versioned path: unversioned, a 429's wait is in milliseconds.
            "https://discord.com/api/v10/webhooks/123456789012345678/DiscordTokenDiscordToken",
        ),
        (
            "discord+http://127.0.0.1/api/webhooks/1/t",
            "discord",
            "http://127.0.0.1/api/v10/webhooks/1/t",
        ),
        (MARKDOWN, "markdown", "https://chat.example/hooks/mattermostkey123456789"),
        ("MARKDOWN+HTTP://chat.example/hooks/k", "markdown", "http://chat.example/hooks/k"),
        (
            TELEGRAM,
            "telegram",
            "https://api.telegram.org/bot123456:ABC-telegram_token/sendMessage",
        ),
        (
            "telegram://1:t@@my_channel?api=http://127.0.0.1:8081/",
            "telegram",
            "http://127.0.0.1:8081/bot1:t/sendMessage",
        ),
        (
            f"https://audit.example/hooks/kasl?secret={SECRET}",
            "json",
            "https://audit.example/hooks/kasl",
        ),
        (
            f"http://127.0.0.1:9000/in?a=1&secret={SECRET}&b=2&secret={OTHER_SECRET}",
            "json",
            "http://127.0.0.1:9000/in?a=1&b=2",
        ),
        # An empty pair, as a URL pasted with a trailing "&" has, is no parameter.
        (f"http://127.0.0.4:9/h?secret={SECRET}&", "json", "http://127.0.0.4:9/h"),
        (f"http://127.0.0.4:9/h?&secret={SECRET}", "json", "http://127.0.0.4:9/h"),
        (f"http://127.0.0.4:9/h?a=1&&secret={SECRET}&", "json", "http://127.0.0.4:9/h?a=1"),
    ],
)
def test_each_form_gives_its_kind_and_the_url_requests_go_to(
    url: str, kind: str, sent_to: str
) -> None:
    destination = parse_destination("ops", url)
    assert destination.kind == kind
    assert destination.url == sent_to


def test_a_telegram_chat_is_a_number_or_a_username() -> None:
    assert parse_destination("t", TELEGRAM).options["chat_id"] == -1001234567890
    assert parse_destination("t", "telegram://1:t@@my_channel").options["chat_id"] == "@my_channel"


def test_signed_json_keeps_every_secret_decoded_in_order() -> None:
    url = f"https://a.example/h?secret={SECRET}&secret={OTHER_SECRET}"
    assert parse_destination("audit", url).options["keys"] == (KEY, OTHER_KEY)


def test_a_plus_in_a_secret_is_base64_not_a_space() -> None:
    key = bytes([0xFB] * 30)  # base64 "+/v7…": both of base64's own symbols
    secret = "whsec_" + base64.b64encode(key).decode()
    assert "+" in secret
    assert parse_destination("a", f"https://a.example/h?secret={secret}").options["keys"] == (key,)
    percent_encoded = secret.replace("+", "%2B").replace("/", "%2F")
    assert parse_destination("a", f"https://a.example/h?secret={percent_encoded}").options[
        "keys"
    ] == (key,)


BAD = [
    ("", "empty"),
    ("hooks.slack.com/services/T/B/XXXXXXXXXXXXSECRET", "no scheme"),
    ("ftp://example.com/XXXXXXXXXXXXSECRET", "'ftp'"),
    ("slack+https://hooks.slack.com/services/XXXXXXXXXXXXSECRET", "'slack+https'"),
    ("slack://hooks.slack.com", "path"),
    ("slack://hooks.slack.com/", "path"),
    ("slack:///services/XXXXXXXXXXXXSECRET", "no host"),
    ("slack://hooks.slack.com:99999/XXXXXXXXXXXXSECRET", "not a valid URL"),
    ("slack://hooks.slack.com/services/XXXXXXXXXXXXSECRET#x", "fragment"),
    ("slack://hooks.slack.com/services/XXXXXXXXXXXX SECRET", "spaces"),
    ("telegram://XXXXXXXXXXXXSECRET", "telegram://<bot token>@<chat id>"),
    ("telegram://123:XXXXXXXXXXXXSECRET@", "chat"),
    ("telegram://123:XXXXXXXXXXXXSECRET@general", "chat"),
    ("telegram://123:XXXXXXXXXXXXSECRET@-100?thread=5", "'thread'"),
    # A token pasted into the query, where a parameter's name goes.
    ("telegram://123:XXXXXXXXXXXXSECRET@-100?XXXXXXXXXXXXSECRET", "(not shown)"),
    ("ntfy://ntfy.sh/alerts?tk_9sQwErTyXSECRET", "(not shown)"),
    ("ntfy://ntfy.sh/alerts?prority=3", "'prority'"),
    ("telegram://123:XXXXXXXXXXXXSECRET@-100?api=ftp://127.0.0.1", "api"),
    ("https://audit.example/hooks/XXXXXXXXXXXXSECRET", "needs a secret"),
    ("https://audit.example/hooks?secret=XXXXXXXXXXXXSECRET", "whsec_"),
    ("https://audit.example/hooks?secret=whsec_XXXXXXXXXXXXSECRET!", "base64"),
    ("https://audit.example/hooks?secret=whsec_" + base64.b64encode(b"short").decode(), "5 bytes"),
    (
        "https://audit.example/hooks?secret=whsec_" + base64.b64encode(b"k" * 65).decode(),
        "65 bytes; at most 64",
    ),
    # A scheme mistyped, or a token written where the scheme goes.
    ("slak://hooks.slack.com/services/T0/B0/XXXXXXXXXXXXSECRET", "'slak'"),
    ("xxxxxxxxxxxxsecret://hooks.slack.com/services/T0", "(not shown)"),
    ("t0ken://hooks.slack.com/services/T0", "(not shown)"),
]


@pytest.mark.parametrize(("url", "says"), BAD)
def test_a_bad_url_is_an_error_naming_the_destination_and_not_its_secret(
    url: str, says: str
) -> None:
    with pytest.raises(ImproperlyConfigured) as raised:
        parse_destination("oncall", url)
    message = str(raised.value)
    assert "'oncall'" in message
    assert says in message
    assert "SECRET" not in message
    assert raised.value.__cause__ is None or "SECRET" not in str(raised.value.__cause__)
    assert raised.value.__suppress_context__ or raised.value.__context__ is None


@pytest.mark.parametrize("name", ["", "Ops", "on call", "a/b", "x" * 65, 3])
def test_a_bad_name_is_an_error(name: Any) -> None:
    with pytest.raises(ImproperlyConfigured, match="name"):
        parse_destination(name, SLACK)


@pytest.mark.parametrize(
    "url", [SLACK, DISCORD, MARKDOWN, TELEGRAM, f"https://a.example/h?secret={SECRET}"]
)
def test_repr_and_str_show_the_name_and_kind_only(url: str) -> None:
    destination = parse_destination("ops", url)
    shown = repr(destination) + str(destination) + destination.display
    assert "ops" in shown
    assert destination.channel.label in shown
    assert "://" not in shown
    assert "token" not in shown.lower()
    assert "whsec" not in shown


@pytest.mark.parametrize(
    ("url", "leaks"),
    [
        (SLACK, ["XXXXXXXXXXXXXXXXXXXXXXXX", "/services/T0001/B0001/XXXXXXXXXXXXXXXXXXXXXXXX"]),
        (DISCORD, ["DiscordTokenDiscordToken", "123456789012345678/DiscordTokenDiscordToken"]),
        (MARKDOWN, ["mattermostkey123456789"]),
        (
            TELEGRAM,
            ["123456:ABC-telegram_token", "ABC-telegram_token", "bot123456:ABC-telegram_token"],
        ),
        (f"https://a.example/h?secret={SECRET}", [SECRET, SECRET[len("whsec_") :]]),
    ],
)
def test_redact_takes_every_secret_part_out_of_a_text(url: str, leaks: list[str]) -> None:
    destination = parse_destination("ops", url)
    texts = [
        f"POST {url} failed",
        f"POST {destination.url} failed",
        # The transport's own message: the URL without its query, host lowercased.
        f"{destination.url.split('?')[0]}: connection refused",
        # An answer that echoes the request, JSON-escaped.
        '{"error": "' + destination.url.replace("/", "\\/") + '"}',
        *(f"bad token {leak}!" for leak in leaks),
    ]
    for text in texts:
        redacted = destination.redact(text)
        assert "[redacted]" in redacted or not any(leak in text for leak in leaks)
        for leak in leaks:
            assert leak not in redacted, (text, redacted)


@pytest.mark.parametrize(
    "url",
    [SLACK, DISCORD, MARKDOWN, TELEGRAM, f"https://a.example/h?secret={SECRET}"],
    ids=["slack", "discord", "markdown", "telegram", "json"],
)
def test_redact_takes_out_a_secret_cut_short_at_the_end_of_a_text(url: str) -> None:
    # An answer read to MAX_ANSWER_BYTES may end in the first half of an echo.
    destination = parse_destination("ops", url)
    secret = max(destination._redacted, key=len)
    for cut in range(4, len(secret)):
        redacted = destination.redact(f"no hook at {secret[:cut]}")
        assert "[redacted]" in redacted and secret[:cut] not in redacted, (cut, redacted)


def test_a_signed_json_receivers_own_query_is_secret_whatever_its_form() -> None:
    destination = parse_destination(
        "audit", f"https://a.example/h?t0kenvalue&key=k3yvalue1&secret={SECRET}"
    )
    assert destination.url == "https://a.example/h?t0kenvalue&key=k3yvalue1"
    redacted = destination.redact("echo: t0kenvalue k3yvalue1 key=k3yvalue1")
    assert redacted == "echo: [redacted] [redacted] [redacted]"


def test_a_destination_names_the_events_it_receives_in_its_url_or_as_a_dict(
    settings: Any,
) -> None:
    from django_federation_delivery.webhooks.destinations import configured

    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "WEBHOOKS": {
            "ops": SLACK + "?events=alert.*,deploy.finished",
            "audit": {"url": f"https://a.example/h?secret={SECRET}", "events": ["user.*"]},
            "all": TELEGRAM,
            "bad": {"url": SLACK, "events": ["alert.*", "a b"]},
            "typo": {"url": SLACK, "event": ["alert.*"]},
            "badurl": SLACK + "?events=alert.*,XXXXXXXXXXXXSECRET!",
        },
    }
    found = configured()
    ops, audit, every = (found.destinations[name] for name in ("ops", "audit", "all"))
    assert ops.events == ("alert.*", "deploy.finished") and "events" not in ops.url
    assert ops.url == "https://hooks.slack.com/services/T0001/B0001/XXXXXXXXXXXXXXXXXXXXXXXX"
    assert audit.events == ("user.*",) and every.events == ()
    assert [ops.receives(t) for t in ("alert.raised", "deploy.finished", "deploy.x")] == [
        True,
        True,
        False,
    ]
    assert every.receives("anything.at_all")
    assert "'bad'" in found.problems["bad"] and "not an event type" in found.problems["bad"]
    assert "has 'url' and 'events', not 'event'" in found.problems["typo"]
    assert "SECRET" not in found.problems["badurl"]


@pytest.mark.django_db
def test_a_url_written_as_a_key_of_a_destinations_dict_is_shown_by_its_host_only(
    settings: Any, caplog: pytest.LogCaptureFixture
) -> None:
    # {"ops": {URL: [events]}}, or a stray key holding the URL beside "url":
    # E031 quoted the key whole, the hook's secret path with it, in the
    # check, in send_webhook's error and in send_webhook("*")'s warning.
    hook = "slack://hooks.slack.com/services/T0AAAA1/B0BBBB2/s3cretT0kenV4lue9"
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "WEBHOOKS": {
            "ops": {hook: ["alert.*"]},
            "audit": {"url": "http://127.0.0.1:9/hooks", "events": ["alert.*"], hook: True},
        },
    }
    checked = [f"{m.msg} {m.hint}" for m in check_webhooks()]
    with caplog.at_level(logging.WARNING):
        send_webhook("*", "alert.raised", {"host": "db1"})
    said = " ".join([*checked, caplog.text])
    assert "E031" in " ".join(m.id or "" for m in check_webhooks())
    assert "'slack://hooks.slack.com/…'" in said, said
    assert "s3cret" not in said, said


def test_redact_leaves_the_rest_of_a_text_alone() -> None:
    destination = parse_destination("ops", SLACK)
    text = "the receiver answered 404 Not Found: no_service (services are down)"
    assert destination.redact(text) == text


def test_webhooks_from_env_reads_every_prefixed_variable_lowercased() -> None:
    env = environ.Env()
    env.ENVIRON = {
        "WEBHOOK_OPS": SLACK,
        "WEBHOOK_ONCALL": f" {TELEGRAM} ",
        "WEBHOOK_EMPTY": "  ",
        "WEBHOOK_": "slack://nameless.example/x",
        "WEBHOOKS": "not one",
        "DATABASE_URL": "sqlite://",
    }
    assert webhooks_from_env(env) == {"ops": SLACK, "oncall": TELEGRAM}


def test_webhooks_from_env_takes_a_mapping_and_another_prefix() -> None:
    found = webhooks_from_env({"HOOK_AUDIT": MARKDOWN, "WEBHOOK_OPS": SLACK}, prefix="HOOK_")
    assert found == {"audit": MARKDOWN}


def test_two_variables_naming_one_destination_are_an_error_naming_both() -> None:
    # Both would be "ops": keeping either would send the other's events astray.
    env = {"WEBHOOK_OPS": SLACK, "WEBHOOK_ops": DISCORD, "WEBHOOK_AUDIT": MARKDOWN}
    with pytest.raises(ImproperlyConfigured) as raised:
        webhooks_from_env(env)
    message = str(raised.value)
    assert "WEBHOOK_OPS" in message and "WEBHOOK_ops" in message and "'ops'" in message
    assert "XXXXXXXX" not in message and "DiscordToken" not in message
    # One of them empty is as if unset: no clash.
    assert webhooks_from_env({**env, "WEBHOOK_ops": " "}) == {"ops": SLACK, "audit": MARKDOWN}


def test_a_settings_file_reads_the_environment_with_no_setting_read_yet() -> None:
    # A settings file imports and calls webhooks_from_env while Django reads
    # that very file. A setting read then loads the half-read file again and
    # keeps it: an error the file raises after is swallowed by manage.py,
    # whose check then finds "no issues". Any setting read here fails: the
    # settings module does not exist.
    code = (
        "from django.conf import settings\n"
        "from django_federation_delivery.webhooks import webhooks_from_env\n"
        "try:\n"
        "    webhooks_from_env({'WEBHOOK_OPS': 'slack://a', 'WEBHOOK_ops': 'slack://b'})\n"
        "except Exception as error:\n"
        "    print(type(error).__name__, error)\n"
        "print(settings.configured)\n"
    )
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "no_such_settings", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "ImproperlyConfigured The variables WEBHOOK_OPS and WEBHOOK_ops both set the webhook "
        "destination 'ops': keep one of them.",
        "False",
    ]


def test_configured_destinations_parses_the_setting(settings: Any) -> None:
    settings.FEDERATION_DELIVERY = {**settings.FEDERATION_DELIVERY, "WEBHOOKS": {"ops": SLACK}}
    (destination,) = configured_destinations().values()
    assert isinstance(destination, Destination)
    assert destination.display == "ops (Slack)"


def test_the_check_passes_good_destinations(settings: Any) -> None:
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "WEBHOOKS": {"ops": SLACK, "tg": TELEGRAM, "audit": f"https://a.example/?secret={SECRET}"},
    }
    assert check_webhooks() == []


def test_the_check_names_a_bad_destination_and_its_variable_not_its_secret(
    settings: Any,
) -> None:
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "WEBHOOKS": {"ops": SLACK, "oncall": "slack://hooks.slack.com/services/SECRET#here"},
    }
    (message,) = check_webhooks()
    assert message.id == "federation_delivery.E031"
    assert "'oncall'" in message.msg
    assert "WEBHOOK_ONCALL" in (message.hint or "")
    assert "SECRET" not in message.msg + (message.hint or "")


@pytest.mark.parametrize("webhooks", [["slack://x.example/y"], "slack://x.example/y", {1: "x"}])
def test_the_check_refuses_a_setting_that_is_not_names_to_urls(
    settings: Any, webhooks: Any
) -> None:
    settings.FEDERATION_DELIVERY = {**settings.FEDERATION_DELIVERY, "WEBHOOKS": webhooks}
    assert [m.id for m in check_webhooks()] == ["federation_delivery.E030"]
    assert "slack://" not in check_webhooks()[0].msg


def test_the_setting_is_parsed_once_until_it_changes(settings: Any) -> None:
    from unittest import mock

    from django_federation_delivery.channels.registry import Registry
    from django_federation_delivery.webhooks.destinations import configured

    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "WEBHOOKS": {"ops": SLACK, "tg": TELEGRAM, "bad": "slack://parsed-once.example"},
    }
    with mock.patch.object(Registry, "parse", autospec=True, side_effect=Registry.parse) as parse:
        first = configured()
        for _ in range(3):
            assert configured() is first
            assert first.lookup("ops") is configured().destinations["ops"]
        assert parse.call_count == 3
        assert first.names == ["bad", "ops", "tg"]
        assert "'bad'" in str(first.lookup("bad")) and first.lookup("gone") is None
        settings.FEDERATION_DELIVERY = {
            **settings.FEDERATION_DELIVERY,
            "WEBHOOKS": {"ops": "slack://parsed-once.example/services/T/B/changed"},
        }
        assert configured().names == ["ops"]
        assert parse.call_count == 4


SLACK_TOKEN = "xTOKENsecret1"
BOT_TOKEN = "ABCsecretBotToken_x"
REPORTED = {
    "WEBHOOK_OPS": f"slack://hooks.slack.com/services/T0SECRETA/B0SECRETB/{SLACK_TOKEN}",
    "WEBHOOK_TG": f"telegram://4815162342:{BOT_TOKEN}@-1001",
    # Pasted with a slash lost, or both, or the chat left out: where the
    # host goes, a bot's token.
    "WEBHOOK_OPS_SLASH": f"slack:/hooks.slack.com/services/T0SECRETA/B0SECRETB/{SLACK_TOKEN}",
    "WEBHOOK_TG_SLASH": f"telegram:/4815162342:{BOT_TOKEN}@-1001",
    "WEBHOOK_TG_NO_SLASH": f"telegram:4815162342:{BOT_TOKEN}@-1001",
    "WEBHOOK_TG_NO_CHAT": f"telegram://4815162342:{BOT_TOKEN}",
    "WEBHOOK_TG_CHAT_AS_PATH": f"telegram://4815162342:{BOT_TOKEN}/-1001",
}


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("https://[2001:db8::1]/hooks/s3cret", "'https://[2001:db8::1]/…'"),
        ("http://hooks.example:443/s3cret", "'http://hooks.example:443/…'"),
        ("slack:/hooks.slack.com/services/T0/B0/s3cret", "'slack://hooks.slack.com/…'"),
        ("telegram://4815162342:s3cret", "'telegram:…'"),
    ],
)
def test_a_webhook_urls_repr_is_its_scheme_and_host_as_written(url: str, shown: str) -> None:
    # Its host key was shown: an IPv6 address unbracketed, port 443 of
    # http:// dropped (port 80 then).
    assert repr(WebhookURL(url)) == shown


def test_django_error_reports_do_not_show_the_webhook_urls_in_the_settings(settings: Any) -> None:
    # The README's way: "WEBHOOKS": webhooks_from_env(env). Django's error
    # report (the DEBUG page, and the mail a 500 sends to ADMINS) lists the
    # settings, hiding only those named like KEY, TOKEN, SECRET: the URLs,
    # the credentials themselves, were shown whole.
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "WEBHOOKS": webhooks_from_env(REPORTED),
    }
    shown = repr(SafeExceptionReporterFilter().get_safe_settings()["FEDERATION_DELIVERY"])
    try:
        raise ValueError("any view's error")
    except ValueError:
        report = ExceptionReporter(RequestFactory().get("/"), *sys.exc_info())
        text = report.get_traceback_text()
    for place, found in (("safe settings", shown), ("error report", text)):
        leaked = [token for token in (SLACK_TOKEN, BOT_TOKEN) if token in found]
        assert not leaked, f"{leaked} in Django's {place}"
