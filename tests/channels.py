"""Kinds of destination defined outside the package, as a host project writes them."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from django.core.exceptions import ImproperlyConfigured

from django_federation_delivery.attempt import AttemptResult, failed
from django_federation_delivery.channels import (
    Channel,
    Destination,
    Event,
    Parsed,
    Policy,
    Request,
    UnusableURL,
    Verdict,
    render_text,
)
from django_federation_delivery.transport import Answer, Transport


def queued_then_kind_removed(settings: Any, port: int, **options: Any) -> dict[str, Any]:
    """An event queued to "oncall", a destination of the Pager kind on
    127.0.0.1 at ``port``, then the kind taken out of ``CHANNELS``: its URL
    no longer parses. Returns the settings as they were when it was queued."""
    from django_federation_delivery import send_webhook

    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "CHANNELS": ["tests.channels.Pager"],
        "WEBHOOKS": {"oncall": f"pager+http://routingKEY4b7c9@127.0.0.1:{port}/page"},
        **options,
    }
    send_webhook("oncall", "alert.raised", {})
    kept: dict[str, Any] = settings.FEDERATION_DELIVERY
    settings.FEDERATION_DELIVERY = {**kept, "CHANNELS": []}
    return kept


class Pager(Channel):
    """An on-call pager: ``pager://<routing key>@host/<path>`` POSTs
    ``{"routing_key", "summary", "dedup_key"}``; it answers 200 with
    ``{"status": "error"}`` when it did not take the page."""

    name = "pager"
    label = "Pager"
    schemes = ("pager", "pager+http")

    def parse(self, url: str, scheme: str) -> Parsed:
        parts = self.split(self.over(url, scheme))  # pager:// is sent over https://
        if len(parts.userinfo) < 8:
            raise UnusableURL("a pager URL is pager://<routing key>@<host>/<path>")
        key = parts.userinfo
        return Parsed(url=parts.origin + parts.path, secrets=(key,), options={"key": key})

    def request(self, destination: Destination, event: Event, *, now: float) -> Request:
        document = {
            "routing_key": destination.options["key"],
            "summary": render_text(destination, event),
            "dedup_key": event.id,
        }
        return self.json_request(destination, document)

    def judge(self, answer: Answer) -> Verdict:
        verdict = super().judge(answer)
        if verdict.delivered:
            try:
                status = json.loads(answer.body).get("status")
            except (ValueError, AttributeError):
                status = None
            if status == "error":
                return Verdict(False, detail=answer.body.decode("utf-8", "replace"))
        return verdict


class SlackAgain(Pager):
    """A kind that takes a scheme a built-in one has."""

    name = "slack2"
    schemes = ("slack",)


class Siren(Pager):
    """A pager whose pages are few and urgent: three tries 50 ms apart,
    claimed in the priority lane, at most 300 bytes an event."""

    name = "siren"
    label = "Siren"
    schemes = ("siren", "siren+http")

    def policy(self) -> Policy:
        return dataclasses.replace(
            super().policy(), schedule=(0.05, 0.05), lane="priority", max_bytes=300
        )


class Broken(Pager):
    """A kind whose policy names a lane there is not."""

    name = "broken"
    label = "Broken"
    schemes = ("broken",)

    def policy(self) -> Policy:
        return dataclasses.replace(super().policy(), lane="urgent")


class Feed(Pager):
    """A feed of notifications: each event goes as soon as it can, a failing
    one holding back none behind it."""

    name = "feed"
    label = "Feed"
    schemes = ("feed", "feed+http")

    def policy(self) -> Policy:
        return dataclasses.replace(super().policy(), schedule=(0.3,), ordered=False)


class Fragile(Pager):
    """A kind whose parse fails with something other than ``UnusableURL``,
    its message holding the URL: a host project's mistake."""

    name = "fragile"
    label = "Fragile"
    schemes = ("fragile",)

    def parse(self, url: str, scheme: str) -> Parsed:
        raise RuntimeError(f"cannot parse {url}")


class Quoting(Pager):
    """A kind whose ``UnusableURL`` quotes what it does not take of the URL's
    query: a host project's mistake, where a token may be pasted."""

    name = "quoting"
    label = "Quoting"
    schemes = ("quoting",)

    def parse(self, url: str, scheme: str) -> Parsed:
        for key, value in self.query_pairs(self.split(self.over(url, scheme)).query):
            raise UnusableURL(f"a quoting URL takes no {key!r} (given {value!r})")
        return super().parse(url, scheme)


class Configured(Pager):
    """A kind that takes its API base when made: ``CHANNELS`` makes each
    kind with no arguments."""

    name = "configured"
    label = "Configured"
    schemes = ("configured",)

    def __init__(self, api_base: str) -> None:
        self.api_base = api_base


class OneScheme(Pager):
    """A kind whose schemes were written as one string, not a tuple: taken
    as a sequence, each of its letters, none twice, would be a scheme."""

    name = "pagery"
    label = "Pager Y"
    schemes = "pagery"  # type: ignore[assignment]


class Unmade(Pager):
    """A kind that fails as it is made, its message holding a secret: a
    setting it reads, say."""

    name = "unmade"
    label = "Unmade"
    schemes = ("unmade",)

    def __init__(self) -> None:
        raise RuntimeError("no token: t0kenS3CRET is revoked")


class Unsettled(Pager):
    """A kind whose policy fails with a message holding a secret, as one
    reading a setting of its own may, whatever kind of error it raises."""

    name = "unsettled"
    label = "Unsettled"
    schemes = ("unsettled",)

    def policy(self) -> Policy:
        raise ImproperlyConfigured("PAGER_TOKEN t0kenS3CRET is revoked")


class Misvalued(Pager):
    """A kind whose policy fails with a ValueError of its own code, its
    message holding a secret: the error Policy's own checks raise too."""

    name = "misvalued"
    label = "Misvalued"
    schemes = ("misvalued",)

    def policy(self) -> Policy:
        raise ValueError("PAGER_TOKEN t0kenS3CRET is revoked")


class Forgetful(Pager):
    """A kind whose policy() forgets its ``return``: it gives None."""

    name = "forgetful"
    label = "Forgetful"
    schemes = ("forgetful", "forgetful+http")

    def policy(self) -> Policy:
        dataclasses.replace(super().policy(), schedule=(30.0, 90.0))
        return None  # type: ignore[return-value]


class LocalPager(Pager):
    """A pager on the local network, opened by its policy as
    ``WEBHOOK_ALLOWED_NETWORKS`` writes a network: as text."""

    name = "localpager"
    label = "Local pager"
    schemes = ("localpager", "localpager+http")

    def policy(self) -> Policy:
        return dataclasses.replace(super().policy(), allowed_networks=("127.0.0.0/8",))


class Unlisted(Pager):
    """A pager whose one secret is declared as a string, not a tuple of one."""

    name = "unlisted"
    label = "Unlisted"
    schemes = ("unlisted", "unlisted+http")

    def parse(self, url: str, scheme: str) -> Parsed:
        parsed = super().parse(url, scheme)
        return dataclasses.replace(parsed, secrets=parsed.options["key"])


class PinPager(Pager):
    """A pager whose key is a PIN of five characters, declared secret: as
    the pager's, but for the pager's own length."""

    name = "pinpager"
    label = "PIN pager"
    schemes = ("pinpager", "pinpager+http")

    def parse(self, url: str, scheme: str) -> Parsed:
        pin, _at, rest = url.partition("@")
        parsed = super().parse(f"{pin}{'0' * 8}@{rest}", scheme)
        key = self.split(self.over(url, scheme)).userinfo
        return dataclasses.replace(parsed, secrets=(key,), options={"key": key})


class RawPager(Pager):
    """A pager whose judge hands the answer's body on as it read it: bytes."""

    name = "rawpager"
    label = "Raw pager"
    schemes = ("rawpager", "rawpager+http")

    def judge(self, answer: Answer) -> Verdict:
        return Verdict(200 <= answer.status < 300, detail=answer.body)  # type: ignore[arg-type]


class HeaderPager(Pager):
    """A pager whose judge passes the receiver's ``Retry-After`` on as it
    reads it: the header's text, not seconds, as many a hand-written one does."""

    name = "headerpager"
    label = "Header pager"
    schemes = ("headerpager", "headerpager+http")

    def judge(self, answer: Answer) -> Verdict:
        if answer.status == 503:
            return Verdict(False, retry_after=answer.headers.get("Retry-After"))  # type: ignore[arg-type]
        return super().judge(answer)


class NoErrorPager(Pager):
    """A pager whose own attempt says "no error" as None, not ""."""

    name = "noerrorpager"
    label = "No-error pager"
    schemes = ("noerrorpager", "noerrorpager+http")

    def attempt(self, job: Any, transport: Transport, **kwargs: Any) -> AttemptResult:
        result = super().attempt(job, transport, **kwargs)
        return dataclasses.replace(result, error=result.error or None)  # type: ignore[arg-type]


class Verbatim(Pager):
    """A kind whose own attempt tells what the receiver said as it said it,
    a NUL byte included (a binary answer, decoded)."""

    name = "verbatim"
    label = "Verbatim"
    schemes = ("verbatim", "verbatim+http")

    def attempt(self, job: Any, transport: Any, **kwargs: Any) -> AttemptResult:
        return failed(job, "the receiver answered 500: \x00\x01binary", permanent=False)


class BelowZero(Pager):
    """A kind whose own attempt tells a status no answer has, below zero:
    one the database refuses to store as a delivery's last status."""

    name = "belowzero"
    label = "Below zero"
    schemes = ("belowzero", "belowzero+http")

    def attempt(self, job: Any, transport: Any, **kwargs: Any) -> AttemptResult:
        return dataclasses.replace(failed(job, "no answer", permanent=False), status=-1)


class SlowPager(Pager):
    """A pager whose service answers slowly: its policy gives an attempt 10 s."""

    name = "slowpager"
    label = "Slow pager"
    schemes = ("slowpager", "slowpager+http")

    def policy(self) -> Policy:
        return dataclasses.replace(super().policy(), timeout=10.0)


class Callback(Pager):
    """A pager that posts each event to the callback URL the event carries
    (``json_request(url=…)``), else to its destination's."""

    name = "callback"
    label = "Callback"
    schemes = ("callback", "callback+http")

    def request(self, destination: Destination, event: Event, *, now: float) -> Request:
        data = event.data if isinstance(event.data, dict) else {}
        url = data.get("callback") or destination.url
        return self.json_request(destination, {"id": event.id}, url=url)


class Once(Pager):
    """A pager tried once, never again (``schedule=()``), on the public
    internet alone."""

    name = "once"
    label = "Once"
    schemes = ("once", "once+http")

    def policy(self) -> Policy:
        return dataclasses.replace(super().policy(), schedule=(), allowed_networks=())
