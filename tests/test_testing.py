"""django_federation_delivery.testing: the outbox, the fake receiver that
verifies signatures, deliver_all, the pytest fixtures and the TestCase mixin,
as a host project's tests use them."""

from __future__ import annotations

import base64
import contextlib
import io
import os
import secrets
import subprocess
import sys
import textwrap
import time
import unittest
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
import responses
from django.db import transaction
from django.test import TestCase, TransactionTestCase
from django.utils import timezone

from django_federation_delivery import (
    PortableInbox,
    SenderKey,
    send,
    send_batch,
    send_portable,
    send_webhook,
    signals,
)
from django_federation_delivery.deliverer import Deliverer
from django_federation_delivery.models import Delivery, Host, Status
from django_federation_delivery.testing import DeliveryTestMixin, Outgoing, deliver_all
from django_federation_delivery.testing.fake import FakeInbox

from . import channels
from .conftest import Inbox
from .keys import ALICE, EDNA, rsa_key

pytestmark = pytest.mark.django_db(transaction=True)

ROOT = Path(__file__).resolve().parent.parent
#: requests as no fake patches it.
UNPATCHED = requests.adapters.HTTPAdapter.send
NOTE = {"type": "Create", "id": f"{ALICE}/activities/1", "actor": ALICE}
INBOX = "https://mastodon.example/users/bob/inbox"
GONE = "https://gone.example/users/carol/inbox"
DID = "did:key:z6MkhaXgBZDvotDkL5257faiztiGiC2QtKLGpbnnEGta2doK"
KEY = base64.b64encode(secrets.token_bytes(32)).decode()
SLACK = "slack://hooks.slack.com/services/T0AAAA1/B0BBBB2/s3cretT0kenV4lue9"


def test_posting_sends_a_signed_create_that_a_real_server_would_accept(
    delivery_outbox: list[Outgoing], fake_inbox: FakeInbox
) -> None:
    send(ALICE, NOTE, [INBOX])
    assert [(out.inbox, out.activity["type"]) for out in delivery_outbox] == [(INBOX, "Create")]
    deliver_all(fake=fake_inbox)
    assert [(r.url, r.scheme, r.verified) for r in fake_inbox.received] == [
        (INBOX, "draft-cavage", True)
    ]


def test_the_outbox_lists_every_kind_of_send_with_the_headers_it_would_sign(
    delivery_outbox: list[Outgoing], settings: Any
) -> None:
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "WEBHOOKS": {"audit": f"https://hooks.example/in?secret=whsec_{KEY}"},
    }
    send(ALICE, NOTE, [INBOX, "https://b.example:0/inbox"])
    send_portable(
        ALICE, NOTE, [PortableInbox("ap://did:key:z6Mk/actor/inbox", ["https://g.example"])]
    )
    send_webhook("audit", "user.created", {"name": "Zoë"})
    inbox, portable, hook = delivery_outbox
    assert (inbox.kind, inbox.sender, inbox.via) == ("activitypub", ALICE, ())
    assert portable.via == ("https://g.example/.well-known/apgateway/did:key:z6Mk/actor/inbox",)
    assert (hook.kind, hook.inbox, hook.destination) == ("webhook", "audit", "audit")
    assert hook.event["data"] == {"name": "Zoë"}
    cavage = inbox.headers()
    assert cavage["Signature"].startswith(f'keyId="{ALICE}#main-key"')
    assert "Signature-Input" in inbox.headers(scheme="rfc9421")
    assert {"webhook-id", "webhook-timestamp", "webhook-signature"} <= set(hook.headers())
    assert Delivery.objects.count() == 3, "queued, and nothing sent"


class Failed(Exception):
    """Raised to roll back what was sent."""


def _rolled_back() -> None:
    with contextlib.suppress(Failed), transaction.atomic():
        send(ALICE, NOTE, [INBOX])
        raise Failed
    # On SQLite the next row written takes the ids the rolled back one had.
    send(ALICE, {**NOTE, "id": f"{ALICE}/activities/2"}, [INBOX])


def _savepoint_rolled_back() -> None:
    with transaction.atomic():
        send(ALICE, {**NOTE, "id": f"{ALICE}/activities/2"}, [INBOX])
        with contextlib.suppress(Failed), transaction.atomic():
            send(ALICE, NOTE, [INBOX])
            raise Failed
        send_webhook("ops", "alert.raised", {"host": "db1"})


def _webhook_rolled_back() -> None:
    with contextlib.suppress(Failed), transaction.atomic():
        send_webhook("ops", "alert.raised", {"host": "db1"})
        raise Failed


@pytest.mark.parametrize(
    "database",
    [
        pytest.param("transactional_db", marks=pytest.mark.django_db(transaction=True)),
        # Django's TestCase: the test's own transaction never commits.
        pytest.param("db", marks=pytest.mark.django_db),
    ],
)
@pytest.mark.parametrize(
    "undo",
    [_rolled_back, _savepoint_rolled_back, _webhook_rolled_back],
    ids=["transaction", "savepoint", "webhook"],
)
def test_the_outbox_lists_what_is_queued_and_not_what_a_rollback_undid(
    undo: Any, database: str, delivery_outbox: list[Outgoing], settings: Any
) -> None:
    settings.FEDERATION_DELIVERY = {**settings.FEDERATION_DELIVERY, "WEBHOOKS": {"ops": SLACK}}
    undo()
    queued = list(Delivery.objects.order_by("id").values_list("id", "kind", "inbox"))
    assert len(delivery_outbox) == len(queued)
    assert [(out.delivery_id, out.kind, out.inbox) for out in delivery_outbox] == queued


class TestCaseTests(DeliveryTestMixin, TestCase):
    """A project on Django's runner, in a TestCase: nothing commits."""

    def test_a_send_a_savepoint_rolled_back_is_not_in_the_outbox(self) -> None:
        with contextlib.suppress(Failed), transaction.atomic():
            send(ALICE, NOTE, [INBOX])
            raise Failed
        send(ALICE, NOTE, ["https://pleroma.example/inbox"])
        assert [out.inbox for out in self.delivery_outbox] == ["https://pleroma.example/inbox"]


def test_a_server_that_verifies_only_rfc9421_is_knocked_on_twice(fake_inbox: FakeInbox) -> None:
    fake_inbox.refuse_scheme("draft-cavage")
    send(ALICE, NOTE, [INBOX])
    deliver_all(fake=fake_inbox)
    assert [(r.scheme, r.status, r.verified) for r in fake_inbox.received] == [
        ("draft-cavage", 401, True),
        ("rfc9421", 202, True),
    ]
    assert Host.objects.get(name="mastodon.example").scheme == "rfc9421"


def test_an_ed25519_sender_is_verified_in_rfc9421(fake_inbox: FakeInbox) -> None:
    send(EDNA, {**NOTE, "actor": EDNA}, [INBOX])
    deliver_all(fake=fake_inbox)
    ((request),) = fake_inbox.received
    assert (request.scheme, request.verified) == ("rfc9421", True)


def key_beside_the_actor(sender: str) -> SenderKey | None:
    """Keys as GoToSocial names them: ``<actor>/main-key``, no fragment."""
    return SenderKey(f"{sender}/main-key", rsa_key())


@pytest.mark.parametrize("scheme", ["draft-cavage", "rfc9421"])
def test_the_fake_verifies_a_signature_whatever_the_form_of_its_key_id(
    scheme: str, settings: Any, fake_inbox: FakeInbox
) -> None:
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "SENDER_KEYS": f"{__name__}.key_beside_the_actor",
        "FIRST_SCHEME": scheme,
    }
    send(ALICE, NOTE, [INBOX])
    assert deliver_all(fake=fake_inbox).delivered == 1
    assert [(r.scheme, r.status, r.problem) for r in fake_inbox.received] == [(scheme, 202, "")]
    signed = {name.lower(): value for name, value in fake_inbox.received[0].headers.items()}
    said = signed.get("signature-input") or signed["signature"]
    assert f'="{ALICE}/main-key"' in said, "the key id as SENDER_KEYS gives it"


def synchronization(sender: str, inbox: str) -> str:
    return f'collectionId="{sender}/followers", url="{sender}/followers_sync", digest="{"0" * 64}"'


def test_outgoing_headers_are_the_headers_an_attempt_sends_synchronization_included(
    delivery_outbox: list[Outgoing], fake_inbox: FakeInbox, settings: Any
) -> None:
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "COLLECTION_SYNCHRONIZATION": f"{__name__}.synchronization",
    }
    send_batch(ALICE, NOTE, [INBOX], {"synchronize_collection": True})
    send(ALICE, {**NOTE, "id": f"{ALICE}/activities/2"}, [INBOX])
    synchronized, plain = delivery_outbox
    headers = synchronized.headers()
    assert headers["Collection-Synchronization"] == synchronization(ALICE, INBOX)
    assert "collection-synchronization" in headers["Signature"]
    assert "Collection-Synchronization" not in plain.headers()
    deliver_all(fake=fake_inbox)
    sent = {request.body: request.headers for request in fake_inbox.received}
    assert set(sent[synchronized.body]) >= set(headers)
    for name in ("Collection-Synchronization", "Content-Type", "Digest", "Host"):
        assert sent[synchronized.body][name] == headers[name]


def test_outgoing_headers_of_a_portable_inbox_are_those_its_attempt_sends(
    inboxes: Callable[..., Inbox], settings: Any, delivery_outbox: list[Outgoing]
) -> None:
    # An attempt at a portable inbox sends no Collection-Synchronization
    # header, nor asks for one about its ap:// name: headers() neither.
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "COLLECTION_SYNCHRONIZATION": f"{__name__}.synchronization",
    }
    gateway = inboxes("127.0.0.2")
    send_portable(
        ALICE,
        NOTE,
        [PortableInbox(f"ap://{DID}/actor/inbox", [gateway.url("")])],
        {"synchronize_collection": True},
    )
    ((outgoing),) = delivery_outbox
    shown = {name.lower() for name in outgoing.headers()}
    Deliverer().run(drain=True)
    ((request),) = gateway.received
    assert "collection-synchronization" not in {name.lower() for name in request.headers}
    assert "collection-synchronization" not in shown


def test_outgoing_headers_of_an_ed25519_sender_are_signed_in_rfc9421_as_an_attempt_signs_them(
    delivery_outbox: list[Outgoing], fake_inbox: FakeInbox
) -> None:
    send(EDNA, {**NOTE, "actor": EDNA}, [INBOX])
    (out,) = delivery_outbox
    for scheme in (None, "draft-cavage", "rfc9421"):
        headers = out.headers(scheme=scheme)
        assert 'alg="ed25519"' in headers["Signature-Input"], scheme
    deliver_all(fake=fake_inbox)
    ((request),) = fake_inbox.received
    assert request.scheme == "rfc9421"


def test_outgoing_headers_hold_what_the_transport_adds_to_an_attempt(
    settings: Any, delivery_outbox: list[Outgoing], fake_inbox: FakeInbox
) -> None:
    agent = "social.example/2.0 (+https://social.example/about)"
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "USER_AGENT": agent,
        "WEBHOOKS": {"audit": f"https://hooks.example/in?secret=whsec_{KEY}"},
    }
    send(ALICE, NOTE, [INBOX])
    send_webhook("audit", "user.created", {"name": "Zoë"})
    inbox, hook = delivery_outbox
    told = {out.kind: out.headers() for out in (inbox, hook)}
    deliver_all(fake=fake_inbox)
    sent = {request.url: request.headers for request in fake_inbox.received}
    for out, url in ((inbox, INBOX), (hook, "https://hooks.example/in")):
        for name in ("User-Agent", "Accept", "Accept-Encoding"):
            assert told[out.kind][name] == sent[url][name], (out.kind, name)
    assert told["activitypub"]["User-Agent"] == agent
    assert told["activitypub"]["Accept-Encoding"] == "identity"


def test_410_429_and_503_come_to_what_a_real_server_would_make_of_them(
    fake_inbox: FakeInbox,
) -> None:
    failures: list[signals.Failure] = []

    def failed(failure: signals.Failure, **kwargs: Any) -> None:
        failures.append(failure)

    gone, busy, down = (f"https://{name}.example/inbox" for name in ("gone", "busy", "down"))
    fake_inbox.answer(410, url=gone)
    fake_inbox.answer(429, url=busy, retry_after=600)
    fake_inbox.answer(503, url=down)
    send(ALICE, NOTE, [gone, busy, down])
    signals.delivery_failed.connect(failed, weak=False)
    try:
        summary = deliver_all(fake=fake_inbox)
    finally:
        signals.delivery_failed.disconnect(failed)
    assert (summary.refused, summary.retrying) == (1, 2)
    assert [(f.inbox, f.status, f.refused) for f in failures] == [(gone, 410, True)]
    rows = {row.inbox: row for row in Delivery.objects.all()}
    assert rows[gone].status == Status.REFUSED
    assert rows[busy].status == rows[down].status == Status.PENDING
    assert rows[busy].due_at is not None and rows[down].due_at is not None
    assert rows[busy].due_at > rows[down].due_at, "Retry-After is waited out"


def test_a_signature_that_does_not_verify_is_answered_401_and_kept_with_why() -> None:
    with FakeInbox() as fake:
        requests.post(
            INBOX,
            data=b'{"type":"Create"}',
            headers={
                "Digest": "SHA-256=" + base64.b64encode(b"x" * 32).decode(),
                "Signature": 'keyId="x",headers="date",signature="AA=="',
            },
            timeout=5,
        )
        requests.post(INBOX, data=b"{}", timeout=5)
    tampered, unsigned = fake.received
    assert (tampered.status, tampered.verified) == (401, False)
    assert tampered.problem == "the Digest does not match the body"
    assert (unsigned.scheme, unsigned.status, unsigned.verified) == ("", 202, False)


@pytest.mark.parametrize("scheme", ["draft-cavage", "rfc9421"])
def test_a_signature_made_with_another_key_does_not_verify(scheme: str) -> None:
    from cryptography.hazmat.primitives.asymmetric import rsa

    from django_federation_delivery.signatures import Scheme, SenderKey, body_sha256, sign_request

    body = b'{"type":"Create"}'
    other = SenderKey(f"{ALICE}#main-key", rsa.generate_private_key(65537, 2048))
    headers = sign_request(Scheme(scheme), url=INBOX, body_sha256=body_sha256(body), key=other)
    with FakeInbox() as fake:
        requests.post(INBOX, data=body, headers=headers, timeout=5)
    ((received),) = fake.received
    assert (received.scheme, received.status, received.verified) == (scheme, 401, False)
    assert "does not verify" in received.problem


@pytest.mark.parametrize("scheme", ["draft-cavage", "rfc9421"])
@pytest.mark.parametrize(
    ("made", "status"),
    [(0, 202), (-3600, 202), (-7200, 401), (3000, 202), (7200, 401)],
)
def test_the_fake_takes_a_signature_only_in_mastodons_window(
    scheme: str, made: int, status: int
) -> None:
    # Mastodon: with no "expires", a signature expires 5 minutes after its
    # Date (or "created"), and an hour's clock skew is allowed either side.
    from django_federation_delivery.signatures import Scheme, body_sha256, sign_request

    body = b'{"type":"Create"}'
    key = SenderKey(f"{ALICE}#main-key", rsa_key())
    headers = sign_request(
        Scheme(scheme), url=INBOX, body_sha256=body_sha256(body), key=key, now=time.time() + made
    )
    with FakeInbox() as fake:
        requests.post(INBOX, data=body, headers=headers, timeout=5)
    ((received),) = fake.received
    assert (received.scheme, received.status) == (scheme, status), received.problem


def test_the_fake_verifies_destinations_at_one_url_each_with_its_own_secret(
    fake_inbox: FakeInbox, settings: Any
) -> None:
    first, second = secrets.token_bytes(32), secrets.token_bytes(32)
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "WEBHOOKS": {
            "billing": f"https://hooks.example/in?secret=whsec_{base64.b64encode(first).decode()}",
            "audit": f"https://hooks.example/in?secret=whsec_{base64.b64encode(second).decode()}",
        },
    }
    send_webhook("billing", "invoice.paid", {"id": 1})
    send_webhook("audit", "user.created", {"name": "Zoë"})
    deliver_all(fake=fake_inbox)
    assert sorted((r.json()["type"], r.status, r.verified) for r in fake_inbox.received) == [
        ("invoice.paid", 202, True),
        ("user.created", 202, True),
    ]


def test_a_signed_json_webhook_is_verified_with_its_destinations_secret(
    fake_inbox: FakeInbox, settings: Any
) -> None:
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "WEBHOOKS": {"audit": f"https://hooks.example/in?secret=whsec_{KEY}"},
    }
    send_webhook("audit", "user.created", {"name": "Zoë"})
    deliver_all(fake=fake_inbox)
    ((request),) = fake_inbox.received
    assert (request.url, request.scheme, request.verified) == (
        "https://hooks.example/in",
        "standard-webhooks",
        True,
    )
    assert request.json()["type"] == "user.created"


def test_deliver_all_brings_its_own_fake_when_given_none() -> None:
    send(ALICE, NOTE, [INBOX])
    assert deliver_all().delivered == 1


@pytest.mark.django_db(transaction=False)
def test_deliver_all_in_a_test_that_does_not_commit_is_refused_and_the_test_goes_on(
    fake_inbox: FakeInbox,
) -> None:
    # The deliverer commits as it goes and closes its thread's connections:
    # run in the test's transaction, it ended it, and the test's next query
    # failed "Cannot operate on a closed database".
    send(ALICE, NOTE, [INBOX])
    with pytest.raises(RuntimeError, match=r"transaction=True.*TransactionTestCase"):
        deliver_all(fake=fake_inbox)
    assert fake_inbox.received == []
    assert list(Delivery.objects.values_list("status", flat=True)) == [Status.PENDING]


def test_deliver_all_in_an_atomic_block_is_refused(fake_inbox: FakeInbox) -> None:
    with transaction.atomic():
        send(ALICE, NOTE, [INBOX])
        with pytest.raises(RuntimeError, match="inside a transaction on the database 'default'"):
            deliver_all(fake=fake_inbox)
    assert deliver_all(fake=fake_inbox).delivered == 1


class MixinTests(DeliveryTestMixin, TransactionTestCase):
    """A project on Django's runner."""

    available_apps = ["django_federation_delivery"]

    def test_a_send_is_in_the_outbox_and_delivered_to_the_fake(self) -> None:
        send(ALICE, NOTE, [INBOX])
        assert [out.inbox for out in self.delivery_outbox] == [INBOX]
        assert self.deliver_all().delivered == 1
        assert self.fake_inbox.received[0].verified


class HostProjectTests(DeliveryTestMixin, TransactionTestCase):
    """Two tests of a project on Django's runner, the first leaving this
    process's set of unavailable hosts read, and empty."""

    __test__ = False  # run by the test below, in this order
    available_apps = ["django_federation_delivery"]

    def test_posting_sends(self) -> None:
        send(ALICE, NOTE, [INBOX])
        assert [out.inbox for out in self.delivery_outbox] == [INBOX]

    def test_a_follower_on_a_server_gone_for_good_is_left_out(self) -> None:
        Host.objects.create(name="gone.example", unavailable_since=timezone.now())
        batch = send(ALICE, NOTE, [INBOX, GONE])
        assert batch is not None
        assert [out.inbox for out in self.delivery_outbox] == [INBOX]
        assert [skipped.inbox for skipped in batch.skipped] == [GONE]


def test_the_mixin_starts_each_test_with_nothing_an_earlier_one_left_in_the_process() -> None:
    suite = unittest.TestSuite(
        [
            HostProjectTests("test_posting_sends"),
            HostProjectTests("test_a_follower_on_a_server_gone_for_good_is_left_out"),
        ]
    )
    said = io.StringIO()
    result = unittest.TextTestRunner(stream=said, verbosity=2).run(suite)
    assert result.wasSuccessful(), said.getvalue()


def test_what_is_forgotten_between_tests_includes_the_rounds_host_rests(settings: Any) -> None:
    # A process's rounds keep each host's rest for the next round: after a
    # test whose fake answered 429 Retry-After: 30, a project's next test's
    # round sent that host nothing, passing or failing by the order run.
    from django_federation_delivery.contrib.django_q import deliver_round
    from django_federation_delivery.testing import forget_kept

    settings.Q_CLUSTER = {"orm": "default", "timeout": 90, "retry": 120}
    with FakeInbox() as fake:
        fake.answer(429, retry_after=30)
        send(ALICE, NOTE, [INBOX])
        deliver_round(1)
        assert len(fake.received) == 1
    forget_kept()  # as the plugin and the mixin do before each test
    with FakeInbox() as fake:
        send(ALICE, NOTE, ["https://mastodon.example/users/carol/inbox"])
        deliver_round(1)
        assert len(fake.received) == 1


HOST_PROJECT_TESTS = """
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    import pytest
    import requests
    from django.utils import timezone

    from django_federation_delivery import send
    from django_federation_delivery.models import Host
    from django_federation_delivery.testing.fake import FakeInbox

    ALICE = "https://social.example/users/alice"
    NOTE = {"type": "Create", "id": f"{ALICE}/activities/1", "actor": ALICE}
    INBOX = "https://mastodon.example/users/bob/inbox"
    GONE = "https://gone.example/users/carol/inbox"


    @pytest.mark.django_db(transaction=True)
    def test_1_posting_sends(delivery_outbox):
        send(ALICE, NOTE, [INBOX])
        assert [out.inbox for out in delivery_outbox] == [INBOX]


    @pytest.mark.django_db(transaction=True)
    def test_2_a_follower_on_a_server_gone_for_good_is_left_out():
        # None of the plugin's fixtures asked for.
        Host.objects.create(name="gone.example", unavailable_since=timezone.now())
        batch = send(ALICE, NOTE, [INBOX, GONE])
        assert [skipped.inbox for skipped in batch.skipped] == [GONE]


    def test_3_leaves_a_fake_of_its_own_over_the_fixtures(fake_inbox):
        FakeInbox().start()  # never stopped, as in a test that failed first


    def test_4_a_real_request_reaches_a_local_server():
        server = ThreadingHTTPServer(("127.0.0.1", 0), Ok)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        try:
            answer = requests.get(f"http://127.0.0.1:{server.server_port}/", timeout=5)
            assert answer.text == "ok"
        finally:
            server.shutdown()
            server.server_close()


    @pytest.fixture(scope="module")
    def module_fake():
        with FakeInbox() as fake:
            yield fake


    def test_5_asks_for_the_module_fake_as_it_runs(request):
        assert request.getfixturevalue("module_fake").active


    def test_6_is_handed_the_module_fake_still_started(request):
        assert request.getfixturevalue("module_fake").active


    class Ok(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"ok")

        def log_message(self, *args):
            pass
"""


@pytest.mark.slow
def test_the_pytest_plugin_starts_and_ends_each_test_as_a_host_project_expects(
    tmp_path: Path,
) -> None:
    # A project's suite: the plugin, pytest-django, and none of this
    # repository's conftest.
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "test_host_project.py").write_text(textwrap.dedent(HOST_PROJECT_TESTS))
    env = dict(
        os.environ,
        DJANGO_SETTINGS_MODULE="tests.settings",
        PYTHONPATH=str(ROOT),
        FD_TEST_DB_DIR=str(tmp_path),
    )
    env.pop("DATABASE_URL", None)
    env.pop("PYTEST_ADDOPTS", None)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_host_project.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    # A module's fake that a test sets up is left to the module; a fake a
    # test left started over the fixture's is stopped, and requests as it was.
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "6 passed" in done.stdout


@pytest.mark.parametrize(
    "url",
    ["https://Gone.Example/users/carol/inbox", "https://bücher.example/users/carol/inbox"],
    ids=["capitals", "idn"],
)
def test_a_fake_rule_for_an_inbox_url_applies_to_the_inbox_sent_to_with_that_url(
    fake_inbox: FakeInbox, url: str
) -> None:
    # The URL a test hands both send() and answer() (a follower's inbox as the
    # project keeps it): send() queues and POSTs its canonical form, the fake
    # compares the string as given, and the 410 rule is never applied.
    fake_inbox.answer(410, url=url)
    send(ALICE, NOTE, [url])
    deliver_all(fake=fake_inbox)
    assert Delivery.objects.get().status == Status.REFUSED, "answer(410, url=...) was ignored"
    assert len(fake_inbox.to(url)) == 1, "fake.to(url) finds nothing sent to it"


@pytest.mark.parametrize(
    "url",
    ["https://Hooks.Example/in", "https://bücher.example/in"],
    ids=["capitals", "idn"],
)
def test_a_signed_json_webhook_to_a_url_not_spelt_canonically_verifies(
    fake_inbox: FakeInbox, settings: Any, url: str
) -> None:
    # The fake finds the destination's secret by comparing its configured URL
    # with the request's, which requests has made canonical: a signature a
    # real receiver accepts is answered 401, and the event is not delivered.
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "WEBHOOKS": {"audit": f"{url}?secret=whsec_{KEY}"},
    }
    send_webhook("audit", "user.created", {"name": "Zoë"})
    deliver_all(fake=fake_inbox)
    ((request),) = fake_inbox.received
    assert (request.scheme, request.problem, request.status) == ("standard-webhooks", "", 202)
    assert Delivery.objects.get().status == Status.DELIVERED


@pytest.mark.parametrize(
    ("retry_after", "at_least"),
    [(90.5, 90), (1_000_000, 3500)],
    ids=["fraction", "a-million-seconds"],
)
def test_the_fakes_retry_after_is_one_the_deliverer_reads(
    fake_inbox: FakeInbox, retry_after: float, at_least: float
) -> None:
    # answer(429, retry_after=...) writes the header with "%g": "90.5",
    # "1e+06", which no Retry-After is and the deliverer ignores: the
    # delivery comes back after the policy's backoff (about 30 s) instead
    # of the wait asked (capped at RETRY_AFTER_MAX, an hour).
    fake_inbox.answer(429, retry_after=retry_after)
    send(ALICE, NOTE, [INBOX])
    before = timezone.now()
    deliver_all(fake=fake_inbox)
    row = Delivery.objects.get()
    assert row.status == Status.PENDING and row.due_at is not None
    waited = (row.due_at - before).total_seconds()
    assert waited >= at_least, f"due again after {waited:.0f} s, not the Retry-After asked"


def test_the_outbox_added_to_a_list_leaves_out_what_a_rollback_undid(
    delivery_outbox: list[Outgoing],
) -> None:
    with contextlib.suppress(Failed), transaction.atomic():
        send(ALICE, NOTE, [INBOX])
        raise Failed
    # "Every way of reading it reads what is left": len(), iteration,
    # indexing and == did; +, * and > read the undone send as queued.
    nothing: list[Outgoing] = []
    assert delivery_outbox + nothing == []
    assert nothing + delivery_outbox == []
    assert delivery_outbox * 2 == []
    assert not delivery_outbox > nothing
    assert len(delivery_outbox) == 0


# A queue kept in a database of its own.

BOTH = pytest.mark.django_db(transaction=True, databases=["default", "queue"])


@BOTH
def test_the_fake_finds_who_signed_in_the_database_deliver_all_delivers_from(
    settings: Any,
) -> None:
    # A key id that does not name its actor is told by the batches queued
    # with the body: looked for in "default", it was found nowhere, and the
    # fake refused a good signature twice.
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "SENDER_KEYS": f"{__name__}.key_beside_the_actor",
    }
    send_batch(ALICE, NOTE, ["https://a.example/inbox"], using="queue")
    with FakeInbox() as fake:
        summary = deliver_all(fake=fake, using="queue")
    answers = [(r.status, r.problem) for r in fake.received]
    assert summary.delivered == 1, f"the fake refused a good signature: {answers}"


@BOTH
@pytest.mark.usefixtures("queue_router")
def test_deliver_all_in_a_transaction_on_another_database_is_refused() -> None:
    # The app routed to "queue", the project's own write in "default": run,
    # the deliverer would close "default"'s connection too, the caller's
    # transaction lost with no error told.
    from django_q.models import Schedule

    send(ALICE, NOTE, ["https://a.example/inbox"])
    with FakeInbox(), transaction.atomic():
        Schedule.objects.create(name="the project's", func="math.floor")
        with pytest.raises(RuntimeError, match="'default'"):
            deliver_all()
        assert Schedule.objects.count() == 1, "the caller's transaction goes on"
    assert list(Delivery.objects.values_list("status", flat=True)) == [Status.PENDING]


class PatchPager(channels.Pager):
    """A pager whose service takes an alert as a PATCH of its incident."""

    name = "patchpager"
    schemes = ("patchpager", "patchpager+http")

    def request(self, destination: Any, event: Any, *, now: float) -> Any:
        return self.json_request(destination, {"dedup_key": event.id}, method="PATCH")


PAGER_KEY = "routingKEY4b7c9"


def send_to_pager(settings: Any, kind: str = "tests.channels.Pager", scheme: str = "pager") -> None:
    """One event sent to a destination of ``kind`` (a class's dotted path),
    its URL under ``scheme``."""
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "CHANNELS": [kind],
        "WEBHOOKS": {"oncall": f"{scheme}://{PAGER_KEY}@pager.example/v2/enqueue"},
    }
    send_webhook("oncall", "alert.raised", {"n": 1})


class QueryPager(channels.Pager):
    """A pager whose service takes an alert as an HTTP QUERY (or any method
    of its own: json_request takes any)."""

    name = "querypager"
    schemes = ("querypager", "querypager+http")

    def request(self, destination: Any, event: Any, *, now: float) -> Any:
        return self.json_request(destination, {"dedup_key": event.id}, method="QUERY")


@pytest.mark.parametrize(
    ("kind", "scheme", "method"),
    [
        ("tests.channels.Pager", "pager", "POST"),
        (f"{__name__}.PatchPager", "patchpager", "PATCH"),
        (f"{__name__}.QueryPager", "querypager", "QUERY"),
    ],
    ids=["POST", "PATCH", "QUERY"],
)
def test_the_fake_answers_a_kind_of_ones_own_whatever_its_method(
    settings: Any, fake_inbox: FakeInbox, kind: str, scheme: str, method: str
) -> None:
    # A kind sending another method than the fake listed (PATCH, then QUERY,
    # PROPFIND) was never answered: responses refused the connection, and
    # the event was left retrying, "connection failed".
    send_to_pager(settings, kind, scheme)
    deliver_all(fake=fake_inbox)
    assert [request.method for request in fake_inbox.received] == [method]
    assert list(Delivery.objects.values_list("status", flat=True)) == [Status.DELIVERED]


def test_a_fake_left_started_by_an_earlier_test_does_not_answer_the_next(settings: Any) -> None:
    """A test that started a FakeInbox by hand, told it answer(400), and
    failed before its stop(): every later test's deliver_all() was answered
    by it (400, refused), not by a fresh fake (202). The plugin now stops,
    as a test ends, what the test left started."""
    from django_federation_delivery.testing import fake

    mark = fake.started_mark()
    leaked = FakeInbox().start()
    leaked.answer(400)
    # "The earlier test" failed here; the plugin ends it.
    assert fake.stop_started_since(mark) == [leaked] and not leaked.active
    send_to_pager(settings)
    deliver_all()
    assert list(Delivery.objects.values_list("status", flat=True)) == [Status.DELIVERED]
    assert leaked.received == [], "the earlier test's fake received the next test's request"


@pytest.mark.django_db(transaction=True)
def test_a_telegram_bot_s_message_is_answered_as_the_bot_api_answers(
    settings: Any, fake_inbox: FakeInbox
) -> None:
    # A 202 with no body is no message sent for a Telegram kind, which
    # reads the Bot API's "ok": the event was left retrying.
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "WEBHOOKS": {"tg": "telegram://123456:ABCdefSECRETtok_en@-1001234567890"},
    }
    send_webhook("tg", "alert.raised", {"n": 1})
    deliver_all(fake=fake_inbox)
    assert list(Delivery.objects.values_list("status", flat=True)) == [Status.DELIVERED]
    assert [request.status for request in fake_inbox.received] == [202]


def test_fakes_stopped_in_any_order_leave_requests_as_it_was() -> None:
    """The fake_inbox fixture's fake stopped as its test ends, then a fake
    the test left started: the second stop put the first's patch back on
    requests, and every later real request was refused by responses."""
    first = FakeInbox().start()
    second = FakeInbox().start()
    assert FakeInbox.current() is second
    first.stop()
    assert FakeInbox.current() is second and second.active
    second.stop()
    assert requests.adapters.HTTPAdapter.send is UNPATCHED


@pytest.mark.django_db(transaction=True)
def test_deliver_all_is_answered_by_the_fake_it_is_given(settings: Any) -> None:
    # Given an older fake while a newer one was started, the newer answered,
    # and the one the test asserted on received nothing.
    older = FakeInbox().start()
    with FakeInbox() as newer:
        send_to_pager(settings)
        deliver_all(fake=older)
    older.stop()
    assert [request.status for request in older.received] == [202]
    assert newer.received == []


@pytest.mark.django_db(transaction=True)
def test_a_fake_started_inside_a_project_s_own_responses_mock_answers(settings: Any) -> None:
    # A fake started, then the project's own mock of its API, then a fake
    # inside it: one patch shared by the fakes left the project's on top,
    # which refused the delivery.
    outer = FakeInbox().start()
    try:
        with responses.RequestsMock(assert_all_requests_are_fired=False) as own:
            own.add(responses.GET, "https://api.project.example/x", json={})
            with FakeInbox() as inner:
                send_to_pager(settings)
                assert deliver_all(fake=inner).delivered == 1
                assert [request.status for request in inner.received] == [202]
        assert outer.received == []
    finally:
        outer.stop()
    assert requests.adapters.HTTPAdapter.send is UNPATCHED


@pytest.mark.parametrize("fixture", [False, True], ids=["alone", "under a fixture's fake"])
def test_a_fake_left_started_inside_a_project_s_own_mock_leaves_requests_as_it_was(
    fixture: bool,
) -> None:
    # @responses.activate ended first (it ends with the test body), then the
    # fake the test left started was stopped: its stop put the project's
    # stopped mock back on requests, which refused every later request. Under
    # a fixture's fake, the layer the project's mock put back was never taken
    # off, one made later and gone standing in its way.
    from django_federation_delivery.testing import fake

    outer = FakeInbox().start() if fixture else None
    mark = fake.started_mark()

    @responses.activate
    def project_test() -> None:
        FakeInbox().start()
        raise AssertionError("failed before its stop()")

    with pytest.raises(AssertionError):
        project_test()
    fake.stop_started_since(mark)  # as the plugin and the mixin end a test
    if outer is not None:
        outer.stop()  # the fixture's teardown
    assert requests.adapters.HTTPAdapter.send is UNPATCHED


@pytest.mark.parametrize("order", ["in order", "the first first"])
def test_fakes_around_a_project_s_own_mock_leave_requests_as_it_was(order: str) -> None:
    first = FakeInbox().start()
    own = responses.RequestsMock(assert_all_requests_are_fired=False)
    own.start()
    second = FakeInbox().start()
    assert FakeInbox.current() is second
    if order == "in order":
        second.stop()
        own.stop()
        first.stop()
    else:
        first.stop()
        second.stop()
        own.stop()
    assert FakeInbox.current() is None
    # What is left of the fakes' hands each request on, and is taken off at
    # the next start.
    FakeInbox().start().stop()
    assert requests.adapters.HTTPAdapter.send is UNPATCHED


@pytest.mark.django_db(transaction=True)
def test_deliver_all_given_a_fake_inside_a_project_s_own_mock_is_answered_by_it(
    settings: Any,
) -> None:
    # The fixture's fake, then the project's mock of its own API, and
    # deliver_all(fake=...) within it: the project's mock refused the delivery.
    own = responses.RequestsMock(assert_all_requests_are_fired=False)
    with FakeInbox() as given, own:
        own.add(responses.GET, "https://api.project.example/x", json={})
        send_to_pager(settings)
        assert deliver_all(fake=given).delivered == 1
    assert [request.status for request in given.received] == [202]
    assert requests.adapters.HTTPAdapter.send is UNPATCHED


class LeavesAFakeStarted(DeliveryTestMixin, TransactionTestCase):
    __test__ = False  # run by the test below
    available_apps = ["django_federation_delivery"]

    def test_starts_one_and_fails(self) -> None:
        FakeInbox().start().answer(400)
        raise AssertionError("failed before its stop()")


def test_the_mixin_stops_a_fake_its_test_left_started() -> None:
    # It answered every later request: a deliver_all() of a test after it
    # without the mixin, a real request to a local server.
    said = io.StringIO()
    result = unittest.TextTestRunner(stream=said).run(
        LeavesAFakeStarted("test_starts_one_and_fails")
    )
    assert len(result.failures) == 1, said.getvalue()
    assert FakeInbox.current() is None
    assert requests.adapters.HTTPAdapter.send is UNPATCHED


@pytest.fixture(scope="module")
def module_fake() -> Iterator[FakeInbox]:
    with FakeInbox() as started:
        yield started


# Last in the module: its module's fake answers what it does not, until the module ends.
@pytest.mark.parametrize(
    "started_by", ["fake_inbox", "fake_inbox, then delivery_outbox", "a module's fixture"]
)
def test_deliver_all_without_fake_is_answered_by_the_fake_the_test_has(
    settings: Any, request: pytest.FixtureRequest, started_by: str
) -> None:
    # deliver_all() started a fake of its own over the fixture's, which
    # answered 202: the fixture's answer(400) was ignored, and it received
    # nothing. Then delivery_outbox, asked for after fake_inbox, forgot the
    # test's fake; then each test's start forgot a module fixture's.
    name = "module_fake" if started_by == "a module's fixture" else "fake_inbox"
    started: FakeInbox = request.getfixturevalue(name)
    if started_by.endswith("delivery_outbox"):
        request.getfixturevalue("delivery_outbox")
    started.answer(400)
    send_to_pager(settings)
    deliver_all()
    assert [answered.status for answered in started.received] == [400]
    assert list(Delivery.objects.values_list("status", flat=True)) == [Status.REFUSED]
    assert FakeInbox.current() is started
