"""What each kind of destination receives, sent through ``requests`` to ``responses``."""

from __future__ import annotations

import base64
import datetime
import gc
import json
import math
import re
import time
import uuid
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
import responses
from django.core.exceptions import ImproperlyConfigured
from django.test import override_settings
from jinja2 import BytecodeCache
from jinja2.bccache import Bucket
from markdown_it import MarkdownIt
from standardwebhooks import Webhook
from standardwebhooks.webhooks import WebhookVerificationError

from django_federation_delivery.channels import Destination, Event, Request, parse_destination
from django_federation_delivery.channels.discord import DISCORD_LIMIT
from django_federation_delivery.channels.markdown import MARKDOWN_LIMIT
from django_federation_delivery.channels.matrix import MATRIX_LIMIT
from django_federation_delivery.channels.telegram import TELEGRAM_LIMIT
from django_federation_delivery.channels.text import render_text
from django_federation_delivery.exceptions import InvalidDelivery

SECRET = "whsec_" + base64.b64encode(bytes(range(32))).decode()
OTHER_SECRET = "whsec_" + base64.b64encode(bytes(range(50, 82))).decode()
WRONG_SECRET = "whsec_" + base64.b64encode(bytes(range(1, 33))).decode()

SLACK = "slack://hooks.slack.com/services/T0001/B0001/XXXXXXXXXXXXXXXXXXXXXXXX"
DISCORD = "discord://discord.com/api/webhooks/1234/token-token-token"
MARKDOWN = "markdown+http://127.0.0.1:8065/hooks/mattermostkey"
TELEGRAM = "telegram://123456:ABC-token@-1001234567890?api=http://127.0.0.1:8081"
SIGNED = f"https://audit.example/hooks/kasl?source=alerts&secret={SECRET}"


def build(destination: Destination, event: Event, now: float | None = None) -> Request:
    """The request of an attempt at ``now``, the current time by default."""
    return destination.request(event, now=time.time() if now is None else now)


def event(data: Any = None, event_type: str = "alert.raised", **fields: Any) -> Event:
    values: dict[str, Any] = {
        "event_id": "evt_01",
        "timestamp": datetime.datetime.now(datetime.UTC),
        "data": {"host": "db-1", "load": 7.5} if data is None else data,
    }
    values.update(fields)
    return Event.of(event_type, **values)


@pytest.fixture
def mocked() -> Iterator[responses.RequestsMock]:
    with responses.RequestsMock() as mock:
        yield mock


def sent(mocked: responses.RequestsMock, url: str, request: Request) -> Any:
    """POST ``request`` as the queue will, and what the receiver got."""
    mocked.post(url, status=200)
    answer = requests.post(request.url, data=request.body, headers=request.headers, timeout=5)
    assert answer.status_code == 200
    (call,) = mocked.calls
    assert call.request.headers["Content-Type"] == "application/json"
    return call.request


def test_slack_gets_text_with_the_fields_and_its_markup_escaped(
    mocked: responses.RequestsMock,
) -> None:
    destination = parse_destination("ops", SLACK)
    request = build(destination, event({"host": "<!channel> db & co", "load": 7.5}))
    received = sent(
        mocked, "https://hooks.slack.com/services/T0001/B0001/XXXXXXXXXXXXXXXXXXXXXXXX", request
    )
    assert json.loads(received.body) == {
        "text": "alert.raised\nhost: &lt;!channel&gt; db &amp; co\nload: 7.5"
    }


def test_slack_makes_no_quote_of_a_line_in_data() -> None:
    # Slack's mrkdwn quotes a line that starts with ">", which it takes, and
    # writes, as "&gt;": data with a line break must not start one.
    request = build(
        parse_destination("ops", SLACK), event({"note": "x\n> ALL CLEAR\n  >>> resolved"})
    )
    text = json.loads(request.body)["text"]
    assert not re.search(r"^\s*&gt;", text, re.MULTILINE)
    assert text.replace(WJ, "") == "alert.raised\nnote: x\n&gt; ALL CLEAR\n  &gt;&gt;&gt; resolved"


def test_slack_makes_no_link_of_a_url_in_data() -> None:
    # Slack makes a link of a URL in a message's text by itself (its text
    # is not verbatim): a word joiner inside "://" and "www." shows it as text.
    request = build(
        parse_destination("ops", SLACK),
        event({"note": "log in again at https://evil.example/login or www.evil.example"}),
    )
    text = json.loads(request.body)["text"]
    assert "://" not in text and "www." not in text
    assert text.replace(WJ, "") == (
        "alert.raised\nnote: log in again at https://evil.example/login or www.evil.example"
    )


WJ = "\u2060"  # the word joiner that keeps a mention or a link from being one
NBSP = "\u00a0"  # the space that keeps indentation from making code

#: What an event's data may say, and what a Markdown hook and Discord show of it.
MARKDOWN_CASES = [
    ("a < b & c", "a \\< b \\& c"),
    ("@channel @here @all @everyone", f"@{WJ}channel @{WJ}here @{WJ}all @{WJ}everyone"),
    ("ping @someone, mail a@b", f"ping @{WJ}someone, mail a@{WJ}b"),
    ("![logo](https://evil.example/a.png)", f"\\!\\[logo\\]\\(https:{WJ}//evil.example/a.png\\)"),
    ("[click](http://evil.example)", f"\\[click\\]\\(http:{WJ}//evil.example\\)"),
    ("see www.evil.example", f"see www{WJ}.evil.example"),
    ("**bold** _it_ `code` ~~gone~~", "\\*\\*bold\\*\\* \\_it\\_ \\`code\\` \\~\\~gone\\~\\~"),
    ("# head > quote | cell", "\\# head \\> quote \\| cell"),
    ("<https://evil.example> &amp; \\*", f"\\<https:{WJ}//evil.example\\> \\&amp; \\\\\\*"),
    ("$x^2$ at 1.5 on 2024-01-01", "\\$x^2\\$ at 1.5 on 2024-01-01"),
    ("x\n===\n- a\n+ b\n10. c\n1.5", "x\n\\===\n\\- a\n\\+ b\n10\\. c\n1.5"),
    ("x\n\n    code\n\t- item", f"x\n\n{NBSP * 4}code\n{NBSP * 4}\\- item"),
]


@pytest.mark.parametrize(("said", "shown"), MARKDOWN_CASES)
@pytest.mark.parametrize(
    ("url", "field"),
    [(MARKDOWN, "text"), (DISCORD, "content")],
    ids=["markdown", "discord"],
)
def test_markdown_and_discord_show_data_as_text_with_no_ping_link_or_image(
    url: str, field: str, said: str, shown: str
) -> None:
    request = build(parse_destination("chat", url), event({"note": said}))
    text = json.loads(request.body)[field]
    assert text == f"alert.raised\nnote: {shown}"
    assert not re.search(r"@\w", text) and "://" not in text and "www." not in text


#: Data that Markdown (CommonMark, GFM and the chat services' kin) would read as
#: markup, inline or at the start of a line it brings with it.
HOSTILE_MARKDOWN = [
    "db1\n\nALL CLEAR, IGNORE THE ALERT\n===",
    "x\n\n- fake item\n\n      indented code",
    "x\n---\n+ plus\n* star\n1. one\n2) two\n  - indented item\n\tTabbed code",
    "x\n> quote\n>>> discord quote\n-# discord subtext\n# heading\n### heading",
    "x\n```\nfenced\n```\n~~~\nfenced\n~~~",
    "x\n| a | b |\n|---|---|\n| c | d |\na | b\n--|--",
    "x\n***\n___\n- - -\n[ref]: https://evil.example\n[ref]",
    "[click](http://evil.example) ![img](https://evil.example/a.png) <https://x.example>",
    "<div>html</div>\n<script>alert(1)</script>\n&amp; &#42; \\*",
    "**bold** _it_ `code` ~~gone~~ ||spoiler|| $x$ www.evil.example",
    "@everyone @here <@123> <#456> <t:1:R> :emoji:",
    "end with two spaces  \nand a backslash\\\n9999999999. ten digits",
    # A carriage return alone ends a line too (CommonMark; the chat services
    # turn it into a line feed).
    "db1\r===",
    "x\r- fake item\r1. one\r> quote",
    "x\r\r    indented code",
    "x\r\n# heading",
]


def _paragraphs(text: str) -> list[list[Any]]:
    """``text`` parsed as CommonMark with GFM's tables and strikethrough (what
    chat services add): the inline tokens of each paragraph, its only blocks."""
    tokens = MarkdownIt("commonmark").enable(["table", "strikethrough"]).parse(text)
    blocks = {token.type for token in tokens} - {"paragraph_open", "paragraph_close", "inline"}
    assert not blocks, f"blocks made of data: {blocks} in {text!r}"
    return [token.children or [] for token in tokens if token.type == "inline"]


@pytest.mark.parametrize("said", HOSTILE_MARKDOWN)
@pytest.mark.parametrize(
    ("url", "field"),
    [(MARKDOWN, "text"), (DISCORD, "content")],
    ids=["markdown", "discord"],
)
def test_markdown_makes_no_block_or_inline_element_of_data(url: str, field: str, said: str) -> None:
    destination = parse_destination("chat", url)
    request = build(destination, event({"host": "db1", "note": said}))
    text = json.loads(request.body)[field]
    paragraphs = _paragraphs(text)
    # Text and line breaks only: no emphasis, code, link, image or HTML.
    assert {child.type for children in paragraphs for child in children} <= {
        "text",
        "softbreak",
        "hardbreak",
    }
    # Nor what Discord alone reads where a line starts: "-# subtext", ">>> quote".
    assert not re.search(r"^\s*(-#|>)", text, re.MULTILINE)
    # And every character shows as written, the line breaks with it.
    shown = "\n".join(
        "".join(child.content if child.type == "text" else "\n" for child in children)
        for children in paragraphs
    )
    written = render_text(destination, event({"host": "db1", "note": said}))

    def words(text: str) -> list[str]:
        return text.replace(WJ, "").split()

    assert words(shown) == words(written)


def test_a_markdown_hook_gets_the_text_with_its_fields(mocked: responses.RequestsMock) -> None:
    destination = parse_destination("chat", MARKDOWN)
    request = build(destination, event({"host": "db1", "tags": ["x", 1]}))
    received = sent(mocked, "http://127.0.0.1:8065/hooks/mattermostkey", request)
    assert json.loads(received.body) == {"text": 'alert.raised\nhost: db1\ntags: \\["x",1\\]'}


def test_discord_gets_content_and_pings_nobody(mocked: responses.RequestsMock) -> None:
    destination = parse_destination("discord", DISCORD)
    request = build(destination, event({"who": "@everyone"}))
    received = sent(mocked, "https://discord.com/api/v10/webhooks/1234/token-token-token", request)
    assert json.loads(received.body) == {
        "content": f"alert.raised\nwho: @{WJ}everyone",
        "allowed_mentions": {"parse": []},
    }


def test_telegram_gets_the_chat_escaped_html_and_parse_mode(
    mocked: responses.RequestsMock,
) -> None:
    destination = parse_destination("tg", TELEGRAM)
    request = build(destination, event({"host": "<b>db</b> & co"}))
    received = sent(mocked, "http://127.0.0.1:8081/bot123456:ABC-token/sendMessage", request)
    assert json.loads(received.body) == {
        "chat_id": -1001234567890,
        "text": f"alert.{WJ}raised\nhost: &lt;b&gt;db&lt;/b&gt; &amp; co",
        "parse_mode": "HTML",
        "link_preview_options": {"is_disabled": True},
    }


def test_telegram_text_makes_no_mention_nor_link_of_an_events_data() -> None:
    # Telegram mentions an @username in any text, notifying that member of
    # the group, and links (and previews) a URL, and a bare domain with a
    # top-level domain it knows ("evil.com/login", "root@evil.com").
    destination = parse_destination("tg", TELEGRAM)
    data = {"by": "@admin", "see": "https://x.example www.y.example", "or": "root@evil.com/a"}
    request = build(destination, event(data))
    text = json.loads(request.body)["text"]
    assert f"by: @{WJ}admin" in text
    assert f"see: https:{WJ}//x.{WJ}example www{WJ}.y.{WJ}example" in text
    assert f"or: root@{WJ}evil.{WJ}com/a" in text
    assert json.loads(request.body)["link_preview_options"] == {"is_disabled": True}


def test_signed_json_is_the_event_with_its_headers(mocked: responses.RequestsMock) -> None:
    destination = parse_destination("audit", SIGNED)
    when = datetime.datetime.now(datetime.UTC).replace(microsecond=250000)
    request = build(destination, event({"host": "db-1"}, event_id="evt_42", timestamp=when))
    received = sent(mocked, "https://audit.example/hooks/kasl?source=alerts", request)
    assert "secret" not in received.url
    assert json.loads(received.body) == {
        "type": "alert.raised",
        "id": "evt_42",
        "timestamp": when.isoformat().replace("+00:00", "Z"),
        "data": {"host": "db-1"},
    }
    assert received.headers["X-Webhook-Event"] == "alert.raised"
    assert received.headers["webhook-id"] == "evt_42"
    verified = Webhook(SECRET).verify(received.body, dict(received.headers))
    assert verified["data"] == {"host": "db-1"}


def test_signed_json_is_signed_at_the_attempts_time_with_the_events_id_and_body() -> None:
    destination = parse_destination("audit", SIGNED)
    sent_at = datetime.datetime.now(datetime.UTC) - datetime.timedelta(days=1)
    queued = event(event_id="evt_7", timestamp=sent_at)
    first = build(destination, queued, now=sent_at.timestamp() + 30)
    retry = build(destination, queued)

    assert first.headers["webhook-timestamp"] == str(int(sent_at.timestamp()) + 30)
    assert abs(int(retry.headers["webhook-timestamp"]) - datetime.datetime.now().timestamp()) < 5
    assert first.body == retry.body
    assert first.headers["webhook-id"] == retry.headers["webhook-id"] == "evt_7"
    # A day after the event, the retry verifies; the first attempt's
    # signature, a day old, no longer would.
    assert Webhook(SECRET).verify(retry.body, retry.headers)["id"] == "evt_7"
    with pytest.raises(WebhookVerificationError, match="too old"):
        Webhook(SECRET).verify(first.body, first.headers)


def test_several_secrets_each_sign_and_a_wrong_one_fails() -> None:
    destination = parse_destination(
        "audit", f"https://audit.example/h?secret={SECRET}&secret={OTHER_SECRET}"
    )
    request = build(destination, event())
    assert len(request.headers["webhook-signature"].split(" ")) == 2
    for secret in (SECRET, OTHER_SECRET):
        Webhook(secret).verify(request.body, request.headers)
    with pytest.raises(WebhookVerificationError):
        Webhook(WRONG_SECRET).verify(request.body, request.headers)


def test_a_changed_body_no_longer_verifies() -> None:
    request = build(parse_destination("audit", SIGNED), event())
    with pytest.raises(WebhookVerificationError):
        Webhook(SECRET).verify(request.body.replace(b"db-1", b"db-2"), request.headers)


def test_a_uuid_is_taken_as_the_event_id() -> None:
    event_id = uuid.uuid4()
    request = build(parse_destination("audit", SIGNED), event(event_id=event_id))
    assert request.headers["webhook-id"] == str(event_id)
    Webhook(SECRET).verify(request.body, request.headers)


def test_a_request_shows_the_destination_not_its_url() -> None:
    for url in (SLACK, TELEGRAM, SIGNED):
        request = build(parse_destination("ops", url), event())
        assert "://" not in repr(request)
        assert "ops (" in repr(request)


@pytest.mark.parametrize(
    ("url", "token"),
    [
        ("matrix://syt_s3cr3tAccessT0ken@matrix.example/!AbCdEf:example.org", "s3cr3tAccessT0ken"),
        ("ntfy://tk_s3cr3tNtfyT0ken99@ntfy.sh/alerts", "s3cr3tNtfyT0ken99"),
        (SIGNED, SECRET.removeprefix("whsec_")),
    ],
    ids=["matrix", "ntfy", "signed"],
)
def test_no_token_reaches_the_repr_of_a_request_or_a_parsed_url(url: str, token: str) -> None:
    # Matrix's and ntfy's token is sent in the Authorization header, which
    # the repr printed whole, in a log line or a debugger's view.
    request = build(parse_destination("ops", url), event())
    assert any(token in value for value in request.headers.values()) or token in url
    shown = repr(request)
    assert token not in shown, shown
    assert not [value for value in request.headers.values() if value in shown], shown
    assert "ops (" in shown
    assert "Content-Type" in shown, "the headers named, their values not"
    scheme = url.partition("://")[0]
    assert token not in repr(parse_destination("ops", url).channel.parse(url, scheme))


def test_data_that_is_not_an_object_is_shown_as_json() -> None:
    request = build(parse_destination("chat", SLACK), event(["a", 2]))
    assert json.loads(request.body) == {"text": 'alert.raised\n["a",2]'}


@pytest.mark.parametrize(
    ("url", "field", "limit"),
    [
        (DISCORD, "content", DISCORD_LIMIT),
        # It was sent whole: Rocket.Chat refuses more than 5,000 characters,
        # and Mattermost splits a longer text into posts wherever they fall.
        (MARKDOWN, "text", MARKDOWN_LIMIT),
    ],
)
def test_markdown_text_past_its_limit_is_cut_with_an_ellipsis(
    url: str, field: str, limit: int
) -> None:
    request = build(parse_destination("chat", url), event({"log": "x" * 20_000}))
    content = json.loads(request.body)[field]
    assert len(content) == limit
    assert content.endswith("x…")
    # Markup, each character escaped: never cut after the backslash, which
    # a chat then showed before the ellipsis.
    for log in ("#" * 20_000, "x" + "#" * 20_000):
        request = build(parse_destination("chat", url), event({"log": log}))
        content = json.loads(request.body)[field]
        assert len(content) <= limit
        shown = MarkdownIt("commonmark").render(content)
        assert "\\" not in shown and shown.endswith("#…</p>\n"), shown[-20:]


def test_telegram_text_is_cut_before_escaping_and_never_inside_an_entity() -> None:
    destination = parse_destination("tg", TELEGRAM)
    request = build(destination, event({"log": "&" * 5000}))
    text = json.loads(request.body)["text"]
    unescaped = text.replace("&amp;", "&")
    assert len(unescaped) == TELEGRAM_LIMIT
    assert text.endswith("&amp;…")


def test_a_cut_never_splits_a_character_counted_as_two() -> None:
    destination = parse_destination("discord", DISCORD)
    request = build(destination, event({"log": "🔥" * 1500}))
    content = json.loads(request.body)["content"]
    assert content.endswith("🔥…")
    assert len(content.encode("utf-16-le")) // 2 <= DISCORD_LIMIT


def test_text_within_the_limit_is_left_whole() -> None:
    destination = parse_destination("discord", DISCORD)
    text = json.loads(build(destination, event({"a": "b"})).body)["content"]
    assert "…" not in text


@pytest.mark.parametrize(
    ("event_type", "says"),
    [
        ("", "non-empty"),
        ("../../etc/passwd", "simple name"),
        ("alert/raised", "simple name"),
        ("alert..raised", "simple name"),
        (".hidden", "simple name"),
        ("x" * 101, "simple name"),
        (None, "non-empty"),
    ],
)
def test_an_event_type_that_is_not_a_simple_name_is_refused(event_type: Any, says: str) -> None:
    with pytest.raises(InvalidDelivery, match=says):
        event(event_type=event_type)


@pytest.mark.parametrize(
    "data", [{"when": datetime.date(2025, 1, 1)}, {"n": math.nan}, {"raw": b"bytes"}, {(1, 2): 3}]
)
def test_data_that_is_not_json_is_refused_naming_the_event(data: Any) -> None:
    with pytest.raises(InvalidDelivery, match=r"'alert\.raised' cannot be written as JSON"):
        event(data)


def test_a_lone_surrogate_is_refused_as_not_json() -> None:
    with pytest.raises(InvalidDelivery, match="JSON"):
        event({"text": "\ud800"})


@pytest.mark.parametrize("event_id", ["", "has space", "line\nbreak", "é", 42])
def test_an_event_id_that_cannot_be_a_header_is_refused(event_id: Any) -> None:
    with pytest.raises(InvalidDelivery, match="event id"):
        event(event_id=event_id)


#: How deep an event's data may be nested, as the README says.
MAX_DEPTH = 100


def nested(depth: int) -> list[object]:
    """0 in ``depth`` lists."""
    value: list[object] = [0]
    for _ in range(depth - 1):
        value = [value]
    return value


def test_data_nested_past_the_bound_is_refused_naming_the_depth() -> None:
    assert event({"d": nested(MAX_DEPTH - 1)}).data == {"d": nested(MAX_DEPTH - 1)}
    assert event(nested(MAX_DEPTH)).data == nested(MAX_DEPTH)
    # Written, and read back one level deeper by a loop already deep in its
    # stack, it raised a RecursionError there, at every start.
    for data in ({"d": nested(MAX_DEPTH)}, {"d": nested(960)}, nested(100_000)):
        with pytest.raises(InvalidDelivery) as raised:
            event(data)
        assert str(raised.value).startswith(
            f"The data of event 'alert.raised' is nested more than {MAX_DEPTH} levels deep"
        )


def test_a_stored_event_nested_past_what_json_reads_is_not_one() -> None:
    stored = event({"d": 0}).as_json()
    deep = stored.replace(b'{"d":0}', b"[" * 100_000 + b"]" * 100_000)
    with pytest.raises(InvalidDelivery, match=r"^not a stored event: RecursionError$"):
        Event.read(deep)
    deep = stored.replace(b'{"d":0}', b"[" * (MAX_DEPTH + 1) + b"]" * (MAX_DEPTH + 1))
    with pytest.raises(InvalidDelivery, match="nested more than"):
        Event.read(deep)


def test_a_naive_timestamp_is_refused() -> None:
    with pytest.raises(InvalidDelivery, match="aware datetime"):
        event(timestamp=datetime.datetime(2025, 1, 1))


def webhook_template(folder: Path, name: str, text: str) -> None:
    """A project's webhook template ``name`` in templates folder ``folder``."""
    webhooks = folder / "django_federation_delivery" / "webhooks"
    webhooks.mkdir(parents=True, exist_ok=True)
    (webhooks / name).write_text(text)


def test_a_template_named_after_the_event_type_is_used(settings: Any, tmp_path: Path) -> None:
    webhook_template(
        tmp_path,
        "alert.raised.txt",
        "{{ data.host }} is on fire for {{ destination.name }} <{{ event_id }}> & more\n",
    )
    settings.TEMPLATES = [{**settings.TEMPLATES[0], "DIRS": [tmp_path]}]
    slack = build(parse_destination("ops", SLACK), event())
    assert json.loads(slack.body) == {"text": "db-1 is on fire for ops &lt;evt_01&gt; &amp; more"}
    # Another type still gets the default.
    other = build(parse_destination("ops", MARKDOWN), event(event_type="alert.resolved"))
    assert json.loads(other.body)["text"].startswith("alert.resolved\nhost: db-1")


class MemoryBytecodeCache(BytecodeCache):
    """What Jinja2's FileSystemBytecodeCache does, kept in memory."""

    def __init__(self) -> None:
        self.stored: dict[str, bytes] = {}

    def load_bytecode(self, bucket: Bucket) -> None:
        if bucket.key in self.stored:
            bucket.bytecode_from_string(self.stored[bucket.key])

    def dump_bytecode(self, bucket: Bucket) -> None:
        self.stored[bucket.key] = bucket.bytecode_to_string()


@pytest.mark.parametrize("options", [{}, {"bytecode_cache": MemoryBytecodeCache()}])
def test_a_jinja2_template_writes_plain_text_each_kind_escapes_once(
    settings: Any, tmp_path: Path, options: dict[str, Any]
) -> None:
    # Django's Jinja2 backend escapes HTML by default: a title "Tom & Jerry
    # <3" reached Matrix and ntfy as "Tom &amp; Jerry &lt;3", and Slack as
    # "&amp;amp;"; with a bytecode cache, which keys a template by its name
    # alone, also once rendered without escaping (the code compiled first,
    # escaping, was loaded). Rendered twice: the second time as compiled.
    webhook_template(tmp_path, "alert.raised.txt", "{{ data.host }} & {{ data.title }}\n")
    settings.TEMPLATES = [
        settings.TEMPLATES[0],
        {
            "BACKEND": "django.template.backends.jinja2.Jinja2",
            "DIRS": [tmp_path],
            "OPTIONS": options,
        },
    ]
    title = 'Tom & Jerry <3 "quoted" it\'s'
    raised = event({"host": "db-1", "title": title})
    for _ in range(2):
        ntfy = build(parse_destination("phone", "ntfy://ntfy.example/alerts"), raised)
        assert ntfy.body.decode() == f"db-1 & {title}"
    slack = build(parse_destination("ops", SLACK), raised)
    assert json.loads(slack.body)["text"] == 'db-1 &amp; Tom &amp; Jerry &lt;3 "quoted" it\'s'


def test_a_jinja2_environment_rendered_with_goes_when_its_engine_does(
    settings: Any, tmp_path: Path
) -> None:
    # Its plain twin was kept by the package, and kept it: every engine a
    # project's tests made (one a TEMPLATES override) lived for the process.
    webhook_template(tmp_path, "alert.raised.txt", "{{ data.host }}\n")
    from django.template import engines

    with override_settings(
        TEMPLATES=[{"BACKEND": "django.template.backends.jinja2.Jinja2", "DIRS": [tmp_path]}]
    ):
        build(parse_destination("phone", "ntfy://ntfy.example/alerts"), event())
        environment = weakref.ref(engines.all()[0].env)
    gc.collect()
    assert environment() is None


def test_a_template_that_renders_nothing_sends_the_event_type(
    settings: Any, tmp_path: Path
) -> None:
    webhook_template(tmp_path, "quiet.txt", "{# nothing #}\n\n")
    settings.TEMPLATES = [{**settings.TEMPLATES[0], "DIRS": [tmp_path]}]
    request = build(parse_destination("tg", TELEGRAM), event(event_type="quiet"))
    assert json.loads(request.body)["text"] == "quiet"


def test_the_destination_object_is_what_build_request_takes() -> None:
    destination = parse_destination("ops", SLACK)
    assert isinstance(destination, Destination)
    assert build(destination, event()).display == "ops (Slack)"


# ntfy


NTFY = "ntfy://tk_ntfyAccessToken9@ntfy.example/alerts-db-7f3k?tags=warning,db&priority=high"


def test_ntfy_gets_plain_text_titled_and_tagged_with_its_token(
    mocked: responses.RequestsMock,
) -> None:
    destination = parse_destination("phone", NTFY)
    assert destination.display == "phone (ntfy)"
    request = build(destination, event({"host": "db-1"}))
    mocked.post("https://ntfy.example/alerts-db-7f3k", status=200)
    requests.post(request.url, data=request.body, headers=request.headers, timeout=5)
    (call,) = mocked.calls
    assert call.request.body == b"alert.raised\nhost: db-1"
    assert call.request.headers["Content-Type"] == "text/plain; charset=utf-8"
    assert call.request.headers["Title"] == "alert.raised"
    assert call.request.headers["Tags"] == "warning,db"
    assert call.request.headers["Priority"] == "high"
    assert call.request.headers["Authorization"] == "Bearer tk_ntfyAccessToken9"


def test_ntfy_without_a_token_sends_none_and_cuts_to_4096_bytes() -> None:
    destination = parse_destination("phone", "ntfy+http://127.0.0.1:8090/topic-x")
    request = build(destination, event({"log": "é" * 5000}))
    assert request.url == "http://127.0.0.1:8090/topic-x"
    assert "Authorization" not in request.headers and "Tags" not in request.headers
    assert len(request.body) <= 4096 and request.body.decode().endswith("…")


@pytest.mark.parametrize(
    "echo",
    [
        # Go's encoding/json writes "&" as \u0026; HTML as &amp;.
        '{"url": "https://chat.example/v1/spaces/AAAA/messages?key=AIzaKey12345\\u0026token=TOKsecret678"}',
        "key=AIzaKey12345&amp;token=TOKsecret678",
        "token TOKsecret678 is not valid, nor key AIzaKey12345",
    ],
    ids=["json", "html", "values alone"],
)
def test_a_hook_s_query_values_are_each_secret_however_its_receiver_writes_them(
    echo: str,
) -> None:
    url = "markdown://chat.example/v1/spaces/AAAA/messages?key=AIzaKey12345&token=TOKsecret678"
    text = parse_destination("chat", url).redact(f"the receiver answered 400: {echo}")
    assert "AIzaKey12345" not in text and "TOKsecret678" not in text


def test_a_secret_with_a_plus_is_redacted_as_a_form_parser_decodes_it() -> None:
    # A receiver that reads its query as a form reads "+" as a space.
    token = "Zm9vYmFy+c2VjcmV0+dG9rZW4"
    destination = parse_destination("audit", f"{SIGNED}&token={token}")
    text = destination.redact(f"unknown token {token.replace('+', ' ')}")
    assert "c2VjcmV0" not in text


def test_ntfy_declares_its_token_and_topic_secret() -> None:
    destination = parse_destination("phone", NTFY)
    text = destination.redact(f"POST https://ntfy.example/alerts-db-7f3k ({NTFY}) failed")
    assert "tk_ntfyAccessToken9" not in text and "alerts-db-7f3k" not in text
    assert "ntfy.example" in text


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("ntfy://user:pw@ntfy.example/topic", "access token"),
        ("ntfy://ntfy.example/", "one topic"),
        ("ntfy://ntfy.example/a/b", "one topic"),
        ("ntfy://ntfy.example/topic?priority=9", "'priority'"),
        ("ntfy://ntfy.example/topic?click=x", "'click'"),
    ],
)
def test_a_bad_ntfy_url_says_what_is_wrong(url: str, says: str) -> None:
    with pytest.raises(ImproperlyConfigured, match=says):
        parse_destination("phone", url)


# Matrix


MATRIX = "matrix://syt_matrixAccessToken42@matrix.example/!RoomIdAbc:example.org"
ROOM_URL = "https://matrix.example/_matrix/client/v3/rooms/%21RoomIdAbc%3Aexample.org"


def test_matrix_puts_a_text_message_with_the_event_id_in_the_transaction() -> None:
    destination = parse_destination("room", MATRIX)
    assert destination.display == "room (Matrix)"
    first = build(destination, event({"host": "db-1"}, event_id="evt/1"), now=1)
    retry = build(destination, event({"host": "db-1"}, event_id="evt/1"), now=600)
    assert first.method == "PUT"
    assert re.fullmatch(
        re.escape(f"{ROOM_URL}/send/m.room.message/evt%2F1.") + "[0-9a-f]{16}", first.url
    )
    # A retry is the same transaction: the homeserver keeps one message.
    assert (retry.url, retry.body) == (first.url, first.body)
    # Another destination's (another room, or another name), by the same
    # bot, is another transaction: a homeserver keeps them per token, not
    # per room, and took the second room's for the first's, posting nothing.
    other_room = parse_destination("room", MATRIX.replace("RoomIdAbc", "RoomIdXyz"))
    other_name = parse_destination("audit", MATRIX)
    transactions = {
        build(where, event({"host": "db-1"}, event_id="evt/1")).url.rsplit("/", 1)[1]
        for where in (destination, other_room, other_name)
    }
    assert len(transactions) == 3
    assert json.loads(first.body) == {
        "msgtype": "m.text",
        "body": "alert.raised\nhost: db-1",
        "m.mentions": {},
    }
    assert first.headers["Authorization"] == "Bearer syt_matrixAccessToken42"


@pytest.mark.parametrize(
    "value",
    ["\\" * 40000, '"' * 40000, "\x01" * 40000, "é\x01🔥\n" * 20000, "🔥" * 40000],
    ids=["backslashes", "quotes", "controls", "mixed", "astral"],
)
def test_a_matrix_message_never_grows_past_the_event_limit_as_json(value: str) -> None:
    # JSON writes '"' and '\\' in two bytes and a control character in six:
    # the text's own size does not bound the event the homeserver is sent,
    # and one past 64 KiB, its envelope included, is refused for good.
    request = build(parse_destination("room", MATRIX), event({"log": value}))
    content = json.loads(request.body)
    canonical = json.dumps(content, ensure_ascii=False, separators=(",", ":"), sort_keys=True)
    assert len(canonical.encode()) <= 60 * 1024
    assert len(request.body) <= 60 * 1024
    body = content["body"]
    assert body.endswith("…") and f"alert.raised\nlog: {value}".startswith(body[:-1])
    # Cut no shorter than it has to be: to the longest text, or to what fits.
    assert len(body.encode()) <= MATRIX_LIMIT
    assert len(body.encode()) > MATRIX_LIMIT - 8 or len(canonical.encode()) > 60 * 1024 - 8


def test_a_matrix_message_mentions_nobody_whatever_its_data_says() -> None:
    # Without "m.mentions", a homeserver applies the legacy push rules to the
    # body: "@room" notifies the whole room, a member's name pings them.
    request = build(parse_destination("room", MATRIX), event({"note": "@room db down"}))
    content = json.loads(request.body)
    assert content["m.mentions"] == {}
    assert content["body"] == "alert.raised\nnote: @room db down"


def test_a_matrix_room_of_version_12_is_sent_to_by_its_id() -> None:
    # Since room version 12, a room's id is "!" and the hash of its create
    # event: no ":server" part.
    room = "!31hneApxJ_1o-63DmFrpeqnkFfWppnzWso1JvH3ogLM"
    destination = parse_destination("room", f"matrix://syt_token42@matrix.example/{room}")
    request = build(destination, event(event_id="evt-1"))
    assert request.url.startswith(
        f"https://matrix.example/_matrix/client/v3/rooms/%21{room[1:]}/send/m.room.message/evt-1."
    )


def test_matrix_declares_its_token_secret_and_not_its_room() -> None:
    destination = parse_destination("room", MATRIX)
    text = destination.redact(f"{MATRIX} refused syt_matrixAccessToken42")
    assert "syt_matrixAccessToken42" not in text and "!RoomIdAbc:example.org" in text


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("matrix://matrix.example/!room:example.org", "access token"),
        ("matrix://tok@matrix.example/%23room:example.org", "not an alias"),
        ("matrix://tok@matrix.example/!", "not an alias"),
        ("matrix://tok@matrix.example/!room:example.org?x=1", "no parameters"),
    ],
)
def test_a_bad_matrix_url_says_what_is_wrong(url: str, says: str) -> None:
    with pytest.raises(ImproperlyConfigured, match=says):
        parse_destination("room", url)


def test_discord_is_sent_on_a_versioned_path_where_a_429_counts_seconds() -> None:
    # The URL Discord's "Copy Webhook URL" gives has no version: Discord then
    # answers as API v6, whose 429 says Retry-After in milliseconds, and
    # 6457 (6.5 s) was waited as 6,457 s, an hour once capped.
    destination = parse_destination("chat", DISCORD)
    request = build(destination, event({"host": "db1"}))
    assert request.url == "https://discord.com/api/v10/webhooks/1234/token-token-token"
    # Whole, the path sent to is as secret as the one given.
    said = destination.redact(f"no hook at {request.url}")
    assert said == "no hook at https://discord.com[redacted]"


@pytest.mark.parametrize(
    "timestamp",
    [
        datetime.datetime.max.replace(tzinfo=datetime.timezone(datetime.timedelta(hours=-1))),
        datetime.datetime.min.replace(tzinfo=datetime.timezone(datetime.timedelta(hours=1))),
    ],
    ids=["the last day at -01:00", "the first day at +01:00"],
)
def test_an_event_whose_timestamp_utc_cannot_hold_is_refused_naming_it(
    timestamp: datetime.datetime,
) -> None:
    """``Event.of`` checks an event: an aware timestamp past what UTC holds
    raised a bare ``OverflowError: date value out of range``."""
    with pytest.raises(InvalidDelivery, match=re.escape(timestamp.isoformat())):
        Event.of("alert.raised", "evt-1", timestamp, {"n": 1})
