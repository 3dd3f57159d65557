"""A fake of every receiver, on ``responses``: it answers each request the
deliverer makes, and verifies its signature as a real receiver does.

- An inbox's draft-cavage signature is verified with ``pyhttpsig`` (the
  signed headers Mastodon requires, a ``Digest`` matching the body), an
  RFC 9421 one with ``http-message-signatures`` (``Content-Digest`` matching
  the body); either made in Mastodon's window (its ``Date`` or ``created``
  at most an hour ahead, and at most 65 minutes old). The public key is the sender's
  own, from ``SENDER_KEYS``, found by the key id as a real receiver fetches
  it, whatever form ``SENDER_KEYS`` gives it (``<actor>#main-key``,
  ``<actor>/main-key``): the key of the sender the key id names less its
  fragment, or else of the sender of a queued batch whose body this is.
- A signed JSON webhook's ``webhook-*`` headers are verified with the
  ``standardwebhooks`` library, with its configured destination's secret.

What it is told to answer, it answers: 202 by default (with the Bot API's
``"ok": true`` to a Telegram bot's message); 401 to one scheme
(so that the deliverer knocks again in the other), 410, 429 with a
``Retry-After``, 503, for every URL or one. A request whose signature does
not verify is answered 401, as a server would, and kept with the reason.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import datetime as dt
import email.utils
import hashlib
import itertools
import math
import re
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any
from urllib.parse import urlsplit

import requests
import responses

from django_federation_delivery.addresses import normalize_inbox
from django_federation_delivery.exceptions import InvalidDelivery

__all__ = ["FakeInbox", "Received"]

#: How long a signature stands when it says no ``expires``, and the clock
#: skew allowed either side of its time, as Mastodon has them.
EXPIRES_AFTER = 5 * 60
CLOCK_SKEW = 3600
_ANY = re.compile(r"https?://.*")
#: A Telegram Bot API method a destination's request calls.
_TELEGRAM_SENT = re.compile(r"/bot[0-9]+:[^/]+/sendMessage$")
#: The fakes started and not stopped, the last the one answering; and how
#: many were started in all, each numbered so.
_STARTED: list[FakeInbox] = []
_NUMBERED = itertools.count()
#: The fake :func:`~django_federation_delivery.testing.deliver_all` was
#: given, which answers while it runs whichever fake was started last.
_ANSWERING: list[FakeInbox] = []


class _Layer:
    """The fakes' send, put on ``requests`` over whatever sent there then
    (its own, a project's ``responses`` mock, a layer below): it answers as
    the fake answering now, or hands the request on to what it was put over
    when none is. It is taken off once no fake needs it and it is on top:
    never from under another's patch, whose own stop puts back what it was
    put over (this, which then hands every request on)."""

    def __init__(self) -> None:
        self.original = requests.adapters.HTTPAdapter.send
        #: The fakes started on it, and whether deliver_all put it on top.
        self.members: list[FakeInbox] = []
        self.answering = False

        def send(adapter: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
            fake = _answering_now()
            if fake is None:
                _take_off_layers()
                return self.original(adapter, request, *args, **kwargs)
            return fake._send(adapter, request, *args, **kwargs)

        self.send = send
        requests.adapters.HTTPAdapter.send = send  # type: ignore[method-assign, assignment]

    @property
    def on_top(self) -> bool:
        return requests.adapters.HTTPAdapter.send is self.send

    @property
    def needed(self) -> bool:
        return self.answering or any(fake.active for fake in self.members)


#: The layers put on requests, oldest first.
_LAYERS: list[_Layer] = []


def _answering_now() -> FakeInbox | None:
    if _ANSWERING:
        return _ANSWERING[-1]
    return _STARTED[-1] if _STARTED else None


def _take_off_layers() -> None:
    """Take off the layer on requests while no fake needs it, and again the
    one under it. Those made after the one on requests are gone from it
    (undone under a project's own patch, whose stop put back what it was
    put over): forgotten."""
    while True:
        on = next((n for n in range(len(_LAYERS) - 1, -1, -1) if _LAYERS[n].on_top), None)
        if on is None:
            return  # none on requests: a project's own patch is on top
        del _LAYERS[on + 1 :]
        if _LAYERS[on].needed:
            return
        layer = _LAYERS.pop()
        requests.adapters.HTTPAdapter.send = layer.original  # type: ignore[method-assign]


def _layer_on_top() -> _Layer:
    """The fakes' layer on top of requests: the one there, or a new one over
    what is (nothing of the fakes', or a project's own patch)."""
    _take_off_layers()
    if _LAYERS and _LAYERS[-1].on_top:
        return _LAYERS[-1]
    _LAYERS.append(_Layer())
    return _LAYERS[-1]


def started_mark() -> int:
    """A mark of the fakes started so far: see :func:`stop_started_since`."""
    return next(_NUMBERED)


def stop_started_since(mark: int) -> list[FakeInbox]:
    """Stop the fakes started since ``mark`` and not stopped (by a test
    that failed before its ``stop()``), as a test ends: none answers a
    later test, nor patches its requests. Those a wider fixture started
    before it, or while it was being set up (:func:`keep_started_since`),
    are left. Returns those stopped."""
    left = [fake for fake in _STARTED if fake._number > mark and not fake._kept]
    for fake in reversed(left):
        fake.stop()
    return left


def keep_started_since(mark: int) -> None:
    """Leave to their fixture the fakes started since ``mark``: those a
    fixture wider than a test started as it was set up, even in a test that
    asked for it (``request.getfixturevalue``); its teardown stops them."""
    for fake in _STARTED:
        if fake._number > mark:
            fake._kept = True


class _EveryMethod(responses.CallbackResponse):
    """A callback for a request of any method to its URL: ``responses``
    matches one method a callback."""

    def matches(self, request: Any) -> tuple[bool, str]:
        if not self._url_matches(self.url, str(request.url)):
            return False, "URL does not match"
        return True, ""


@dataclasses.dataclass(frozen=True)
class Received:
    """A request the fake answered."""

    method: str
    url: str
    headers: Mapping[str, str]
    body: bytes
    #: "draft-cavage", "rfc9421", "standard-webhooks", or "" when unsigned.
    scheme: str
    #: Whether its signature verified ("" : it did, or there was none to check).
    problem: str
    status: int

    @property
    def verified(self) -> bool:
        return bool(self.scheme) and not self.problem

    def json(self) -> Any:
        import json

        return json.loads(self.body)


@dataclasses.dataclass
class _Rule:
    status: int
    url: str | None
    scheme: str | None
    retry_after: float | None
    times: int | None


class FakeInbox:
    """Every receiver at once, while started (``with FakeInbox() as fake:``,
    or :meth:`start` and :meth:`stop`)."""

    def __init__(self) -> None:
        self.received: list[Received] = []
        #: The database whose batches tell who signed (a key id that does
        #: not name its actor): ``deliver_all``'s, None for the app's.
        self.using: str | None = None
        self._rules: list[_Rule] = []
        #: Its place among the fakes started (:func:`stop_started_since`).
        self._number = -1
        #: Whether a wider fixture started it (:func:`keep_started_since`).
        self._kept = False

    @property
    def active(self) -> bool:
        return self in _STARTED

    @classmethod
    def current(cls) -> FakeInbox | None:
        """The fake started last and not yet stopped, which answers every
        request now (as ``responses`` patches the process): the
        ``fake_inbox`` fixture's, say; None when none is."""
        return _STARTED[-1] if _STARTED else None

    def start(self) -> FakeInbox:
        if self.active:
            return self
        mock = responses.RequestsMock(assert_all_requests_are_fired=False)
        # Whatever a kind of the project's own sends (json_request takes any method).
        mock.add(_EveryMethod("POST", _ANY, callback=self._answer))
        self._send = mock.unbound_on_send()
        self._number = next(_NUMBERED)
        self._kept = False
        _STARTED.append(self)
        _layer_on_top().members.append(self)
        return self

    def stop(self) -> None:
        """Stop it: the fakes' patch of requests is taken off once no fake
        started needs it, whatever order they are stopped in, and never
        from under a project's own ``responses`` mock."""
        if not self.active:
            return
        _STARTED.remove(self)
        _take_off_layers()

    @contextlib.contextmanager
    def answering(self) -> Iterator[FakeInbox]:
        """Within it, this fake answers every request, whichever fake was
        started last, even inside a project's own ``responses`` mock
        (``deliver_all(fake=…)``)."""
        layer = _layer_on_top()
        layer.answering = True
        _ANSWERING.append(self)
        try:
            yield self
        finally:
            _ANSWERING.remove(self)
            layer.answering = False
            _take_off_layers()

    def __enter__(self) -> FakeInbox:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def answer(
        self,
        status: int,
        *,
        url: str | None = None,
        scheme: str | None = None,
        retry_after: float | None = None,
        times: int | None = None,
    ) -> None:
        """From now on, answer ``status`` (to ``url`` only, if given; to
        requests signed in ``scheme`` only, "draft-cavage" or "rfc9421", if
        given), ``times`` times or for ever; with a ``Retry-After`` of
        ``retry_after`` seconds (whole, rounded up, as the header has them).
        The latest rule that matches wins. A ``url`` matches however it is
        written: its canonical form, as a send keeps it and POSTs to."""
        self._rules.append(
            _Rule(status, None if url is None else _canonical(url), scheme, retry_after, times)
        )

    def refuse_scheme(self, scheme: str) -> None:
        """Answer 401 to requests signed in ``scheme``, as a server that
        verifies only the other does: the deliverer knocks again."""
        self.answer(401, scheme=scheme)

    def to(self, url: str) -> list[Received]:
        """What was received at ``url`` (however it is written)."""
        url = _canonical(url)
        return [request for request in self.received if _canonical(request.url) == url]

    def _answer(self, request: requests.PreparedRequest) -> tuple[int, dict[str, str], bytes]:
        body = request.body or b""
        if isinstance(body, str):
            body = body.encode()
        headers = dict(request.headers)
        url = request.url or ""
        scheme, problem = _verify(request.method or "POST", url, headers, body, self.using)
        status, answer_headers = 202, {}
        for rule in reversed(self._rules):
            if rule.url is not None and rule.url != _canonical(url):
                continue
            if rule.scheme is not None and rule.scheme != scheme:
                continue
            if rule.times is not None:
                if rule.times <= 0:
                    continue
                rule.times -= 1
            status = rule.status
            if rule.retry_after is not None:
                # Delay-seconds is a whole number: "90.5" or "1e+06" is none.
                answer_headers["Retry-After"] = str(math.ceil(rule.retry_after))
            break
        if problem and status < 300:
            status = 401
        self.received.append(
            Received(request.method or "", url, headers, body, scheme, problem, status)
        )
        if status < 300 and _TELEGRAM_SENT.search(urlsplit(url).path):
            # The Bot API says in its body that it sent the message.
            return status, {"Content-Type": "application/json"}, b'{"ok": true, "result": {}}'
        return status, answer_headers, problem.encode()


def _canonical(url: str) -> str:
    """``url`` as a send keeps it (``https://Hooks.Example/in`` and the
    ``https://hooks.example/in`` requests sends to are one); as it is, if
    it is no URL a send would take."""
    try:
        return normalize_inbox(url)
    except InvalidDelivery:
        return url


def _verify(
    method: str, url: str, headers: Mapping[str, str], body: bytes, using: str | None
) -> tuple[str, str]:
    """The scheme a request is signed in, and what is wrong with it ("" if nothing)."""
    lower = {name.lower(): value for name, value in headers.items()}
    if "signature-input" in lower:
        return "rfc9421", _rfc9421_problem(method, url, headers, body, using)
    if "signature" in lower:
        return "draft-cavage", _cavage_problem(method, url, lower, body, using)
    if "webhook-signature" in lower:
        return "standard-webhooks", _standard_problem(url, headers, body)
    return "", ""


def _public_key(key_id: str, body: bytes, using: str | None) -> Any:
    """The public key whose id is ``key_id``, as a receiver fetches it.
    ``SENDER_KEYS`` is asked by sender, not by key id: the senders who may
    hold it are asked in turn, and one of their keys must have this very id."""
    from django.db import connections

    from django_federation_delivery.keys import KeyCache

    keys = KeyCache()
    try:
        for sender in _senders(key_id, body, using):
            key = keys.get(sender)
            if key is not None and key.key_id == key_id:
                return key.private_key.public_key()
    finally:
        # Asked from a deliverer's worker thread, SENDER_KEYS and the batches'
        # query may have opened a connection there: closed, so that none
        # outlives the test.
        if threading.current_thread() is not threading.main_thread():
            connections.close_all()
    raise LookupError(f"no key {key_id!r} in SENDER_KEYS")


def _senders(key_id: str, body: bytes, using: str | None) -> Iterator[str]:
    """Who may hold ``key_id``: first the sender it names less its fragment
    (``<actor>#main-key``; a request a test signs by hand), asked with no
    query; then the senders of the batches queued with this ``body``, one of
    which the deliverer signed for, whatever its key's id looks like
    (``<actor>/main-key``, the instance's key), in the database ``using``."""
    from django_federation_delivery.conf import database_alias
    from django_federation_delivery.models import Batch

    named = key_id.partition("#")[0]
    yield named
    try:
        text = body.decode()
    except UnicodeDecodeError:
        return
    queued = (
        Batch.objects.using(database_alias(using))
        .filter(body=text)
        .exclude(sender__in=("", named))
        .order_by()
        .values_list("sender", flat=True)
        .distinct()
    )
    yield from queued


def _cavage_problem(
    method: str, url: str, lower: Mapping[str, str], body: bytes, using: str | None
) -> str:
    import httpsig
    from cryptography.hazmat.primitives import serialization

    digest = "SHA-256=" + base64.b64encode(hashlib.sha256(body).digest()).decode()
    if lower.get("digest") != digest:
        return "the Digest does not match the body"
    date = email.utils.parsedate_to_datetime(lower.get("date", "Thu, 01 Jan 1970 00:00:00 GMT"))
    if problem := _time_problem("Date", date.timestamp()):
        return problem
    fields = dict(re.findall(r'(\w+)="([^"]*)"', lower["signature"]))
    try:
        public = _public_key(fields.get("keyId", ""), body, using)
    except LookupError as exc:
        return str(exc)
    pem = public.public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    parts = urlsplit(url)
    path = parts.path + ("?" + parts.query if parts.query else "")
    verifier = httpsig.HeaderVerifier(
        headers=dict(lower),
        secret=pem,
        method=method,
        path=path,
        required_headers=["(request-target)", "host", "date", "digest"],
        sign_header="signature",
    )
    try:
        return "" if verifier.verify() else "the draft-cavage signature does not verify"
    except Exception as exc:
        return f"the draft-cavage signature cannot be checked: {exc}"


def _time_problem(name: str, made: float) -> str:
    """Why a signature made at ``made`` (Unix time) is refused as Mastodon
    refuses it, or ""."""
    now = time.time()
    if made > now + CLOCK_SKEW:
        return f"the signature's {name} is more than an hour ahead"
    if now > made + EXPIRES_AFTER + CLOCK_SKEW:
        return f"the signature's {name} is more than 65 minutes old"
    return ""


def _rfc9421_problem(
    method: str, url: str, headers: Mapping[str, str], body: bytes, using: str | None
) -> str:
    from http_message_signatures import HTTPMessageVerifier, HTTPSignatureKeyResolver, algorithms

    class Keys(HTTPSignatureKeyResolver):
        def resolve_public_key(self, key_id: str) -> Any:
            return _public_key(key_id, body, using)

    lower = {name.lower(): value for name, value in headers.items()}
    digest = "sha-256=:" + base64.b64encode(hashlib.sha256(body).digest()).decode() + ":"
    if lower.get("content-digest") != digest:
        return "the Content-Digest does not match the body"
    created = re.search(r";created=(\d{1,12})\b", lower["signature-input"])
    if problem := _time_problem("created", float(created[1]) if created else 0.0):
        return problem
    ed25519 = 'alg="ed25519"' in lower["signature-input"]
    algorithm = algorithms.ED25519 if ed25519 else algorithms.RSA_V1_5_SHA256
    prepared = requests.Request(method, url, headers=dict(headers), data=body).prepare()
    try:
        # Its window is Mastodon's, checked above: the library's own (a day
        # old, five seconds ahead) would refuse what Mastodon takes.
        verifier = HTTPMessageVerifier(signature_algorithm=algorithm, key_resolver=Keys())
        verifier.max_clock_skew = dt.timedelta(seconds=CLOCK_SKEW)
        verifier.verify(prepared, max_age=None)
    except Exception as exc:
        return f"the RFC 9421 signature does not verify: {type(exc).__name__}"
    return ""


def _standard_problem(url: str, headers: Mapping[str, str], body: bytes) -> str:
    from standardwebhooks import Webhook

    from django_federation_delivery.webhooks.destinations import configured

    url = _canonical(url)
    # Destinations may share a URL, each with a secret of its own: any of
    # their keys verifying is the request's own.
    at_url = [
        destination
        # Those that parse: another's that does not is its problem alone.
        for destination in configured().destinations.values()
        if _canonical(destination.url) == url
    ]
    if not at_url:
        return "no configured destination has this URL"
    for destination in at_url:
        for key in destination.options.get("keys", ()):
            try:
                Webhook(base64.b64encode(key).decode()).verify(body, dict(headers))
            except Exception:
                continue
            return ""
    return "the webhook signature does not verify with the destination's secret"
