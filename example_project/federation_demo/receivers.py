"""Local stand-ins for webhook receivers, for the demo: a Slack incoming webhook
and a receiver of signed JSON that verifies each request as any would, with
the ``standardwebhooks`` library.

Each :class:`WebhookReceiver` is a stdlib ``ThreadingHTTPServer`` listening
where a configured destination points (its host and port), serving in a
thread of its own, and noting every request in arrival order: what it held,
whether it checked out, and what was answered.
"""

from __future__ import annotations

import dataclasses
import html
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import unquote, urlsplit

from standardwebhooks import Webhook
from standardwebhooks.webhooks import WebhookVerificationError

from django_federation_delivery.webhooks import Destination

#: The kinds the demo has a stand-in for.
KINDS = ("slack", "json")
#: How many requests a signed-JSON receiver answers 503 before it accepts.
SIGNED_JSON_DOWN_FOR = 2


@dataclasses.dataclass(frozen=True)
class Arrival:
    """One request, as the receiver saw it."""

    #: Slack: the message's text. Signed JSON: the event's type.
    text: str
    #: Signed JSON: the event's id (its ``webhook-id``); "" for Slack.
    event_id: str
    #: "verified", "well-formed", or why the request was refused.
    check: str
    status: int

    @property
    def ok(self) -> bool:
        return self.check in ("verified", "well-formed")


class WebhookReceiver:
    """A stand-in for ``destination`` on its host and port, until :meth:`stop`.

    Slack: a POST to the hook's path with ``{"text": …}`` is answered 200
    ``ok``; any other path 404 ``no_service``, as Slack answers. Signed JSON:
    each request is verified with ``standardwebhooks.Webhook(secret)``, where
    ``secret`` is the receiver's copy of the key (``whsec_…``), and answered
    401 when it does not verify; the first ``down_for`` are answered 503 (the
    receiver is down for a moment), the rest 200.
    """

    def __init__(self, destination: Destination, secret: str = "", down_for: int = 0) -> None:
        if destination.kind not in KINDS:
            raise ValueError(f"no stand-in for {destination.display}")
        self.destination = destination
        self.down_for = down_for
        self.arrivals: list[Arrival] = []
        self._webhook = Webhook(secret) if destination.kind == "json" else None
        target = urlsplit(destination.url)
        self._path = target.path + (f"?{target.query}" if target.query else "")
        self.host = target.hostname or ""
        self.port = target.port or 80
        self._lock = threading.Lock()
        self._httpd = ThreadingHTTPServer((self.host, self.port), _Handler)
        self._httpd.daemon_threads = True
        self._httpd.receiver = self  # type: ignore[attr-defined]
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, name=f"receiver-{self.netloc}", daemon=True
        )
        self._thread.start()

    @property
    def netloc(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def behaviour(self) -> str:
        if self._webhook is None:
            return 'Slack stand-in: 200 "ok" to {"text": …}'
        down = f"503 to its first {self.down_for} requests, then " if self.down_for else ""
        return f"verifies with standardwebhooks; {down}200"

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    def accepted(self) -> list[Arrival]:
        with self._lock:
            return [arrival for arrival in self.arrivals if arrival.status == 200]

    def answer(self, path: str, headers: dict[str, str], body: bytes) -> tuple[int, bytes]:
        """The status and body to answer a POST with, noting what came in."""
        if self._webhook is None:
            arrival = self._slack(path, headers, body)
        else:
            arrival = self._signed_json(self._webhook, headers, body)
        with self._lock:
            if arrival.status == 200 and self.down_for > len(self.arrivals):
                arrival = dataclasses.replace(arrival, status=503)
            self.arrivals.append(arrival)
        answers = {200: b"ok", 404: b"no_service", 503: b"down for a moment"}
        return arrival.status, answers.get(arrival.status, arrival.check.encode())

    def _slack(self, path: str, headers: dict[str, str], body: bytes) -> Arrival:
        if path != self._path:
            return Arrival("", "", "not this hook's path", 404)
        try:
            document = json.loads(body)
        except ValueError:
            return Arrival("", "", "not JSON", 400)
        if not isinstance(document, dict) or not isinstance(document.get("text"), str):
            return Arrival("", "", 'no "text"', 400)
        if headers.get("content-type") != "application/json":
            return Arrival("", "", "not sent as application/json", 400)
        # Slack shows "&amp;" as "&": the sender escapes & < > for its mrkdwn.
        return Arrival(html.unescape(document["text"]), "", "well-formed", 200)

    def _signed_json(self, webhook: Webhook, headers: dict[str, str], body: bytes) -> Arrival:
        try:
            event = webhook.verify(body, headers)
        except (WebhookVerificationError, ValueError) as exc:
            return Arrival("", headers.get("webhook-id", ""), f"does not verify: {exc}", 401)
        if headers.get("x-webhook-event") != event.get("type"):
            return Arrival("", "", "X-Webhook-Event is not the event's type", 400)
        return Arrival(str(event["type"]), str(event["id"]), "verified", 200)


def secret_of(url: str) -> str:
    """The first ``secret`` parameter of a signed-JSON destination's URL: the
    receiver's own copy of the key, as its operator was given it."""
    for pair in urlsplit(url).query.split("&"):
        key, _, value = pair.partition("=")
        if unquote(key) == "secret":
            return unquote(value)  # not unquote_plus: "+" is a base64 character
    return ""


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    timeout = 30
    server: Any

    def do_POST(self) -> None:
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            self._reply(411, b"")
            return
        body = self.rfile.read(int(length))
        headers = {name.lower(): value for name, value in self.headers.items()}
        status, text = self.server.receiver.answer(self.path, headers, body)
        self._reply(status, text)

    def _reply(self, status: int, text: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(text)))
        self.end_headers()
        self.wfile.write(text)

    def log_message(self, format: str, *args: Any) -> None:
        pass  # the demo reports what arrived instead
