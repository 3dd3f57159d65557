"""What every kind of destination shares: the :class:`Channel` a kind
subclasses, the :class:`Destination` its URL parses into, the
:class:`Request` it builds for one attempt and the :class:`Verdict` it gives
on the answer.

A kind declares the secret parts of its URL when it parses one
(:meth:`Channel.parse` returns them in :class:`Parsed`); every text that
leaves the package about a destination goes through
:meth:`Destination.redact`, which takes out exactly those parts, in the forms
a message or an echoing receiver writes them. Nothing is guessed.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import logging
import re
import time
from collections.abc import Callable, Iterable, Mapping
from fnmatch import fnmatchcase
from http import HTTPStatus
from typing import Any, ClassVar, NamedTuple
from urllib.parse import unquote, urlsplit

from django.core.exceptions import ImproperlyConfigured
from django.utils.translation import gettext as _

from django_federation_delivery.addresses import replace_secrets, secret_forms
from django_federation_delivery.attempt import (
    AttemptResult,
    Job,
    Verdict,
    deadline_of,
    failed,
    is_refusal,
    judged,
    lapsed,
    readable_detail,
)
from django_federation_delivery.channels.events import Event, compact_json
from django_federation_delivery.channels.policy import Policy, PolicyError
from django_federation_delivery.exceptions import RefusedAddress, TransportError
from django_federation_delivery.transport import (
    Answer,
    Transport,
    answer_text,
    logs,
    parse_retry_after,
    status_text,
)
from django_federation_delivery.transport.failures import check_url

__all__ = [
    "MESSAGE_ROOM",
    "REDACTED",
    "Call",
    "Channel",
    "Destination",
    "Parsed",
    "Policy",
    "Request",
    "URLParts",
    "UnusableURL",
    "Verdict",
    "is_word",
    "policy_of",
    "safe_text",
    "word_shown",
]

logger = logging.getLogger("django_federation_delivery.channels")

REDACTED = "[redacted]"
#: Room beyond a kept body for what a message says around it
#: ("gave up after 9 attempts: the receiver answered 503 Service Unavailable: …").
MESSAGE_ROOM = 100
#: What a destination is asked to answer in: anything, it is only read for an error.
ACCEPT = "application/json, */*;q=0.5"
# A secret part shorter than this is too common a text to take out of a
# message wherever it is ("T01", "ops"): it is taken out only where it stands
# alone, unless a longer declared part holds it (a hook's segment, in its
# path), which is taken out; one shorter than MIN_SHORT is not at all.
MIN_REDACTED = 6
MIN_SHORT = 3
#: The longest wait a rate-limited answer's body is taken to ask, in seconds:
#: past a day it is a receiver's mistake, and the retry policy's wait stands.
MOST_WAITED = 86_400


class URLParts(NamedTuple):
    """A URL in parts, as :meth:`Channel.split` gives them."""

    scheme: str
    #: What comes before the "@", as written: often a token.
    userinfo: str
    #: With its port.
    host: str
    path: str
    query: str

    @property
    def origin(self) -> str:
        """``scheme://host[:port]``, without what came before the "@"."""
        return f"{self.scheme}://{self.host}"


class UnusableURL(ValueError):
    """A destination URL a kind cannot use. Its message says why in words that
    never quote the URL: it reaches ``manage.py check`` and the admin. A part
    it does not take is named by :func:`word_shown`."""


#: A part of a URL a message may name: a typo's letters ("slak", "prority").
_WORD = re.compile(r"[a-z][a-z_+.-]{0,15}")


def is_word(part: str) -> bool:
    """Whether ``part`` of a destination's URL is a short lowercase word, as
    a typo is: what has a digit in it or is long may be a token."""
    return bool(_WORD.fullmatch(part))


def word_shown(part: str) -> str:
    """``part`` of a destination's URL (a scheme, a parameter's name) as a
    message may name it: quoted if it :func:`is_word`; "(not shown)" if
    not, as it may be a token written where the word goes."""
    return repr(part) if is_word(part) else _("(not shown)")


@dataclasses.dataclass(frozen=True)
class Parsed:
    """What a kind makes of a URL: all of it the URL's, and so never shown."""

    #: Where requests go. Secret: never shown.
    url: str = dataclasses.field(repr=False)
    #: Every part of the URL that is a credential (a token, a hook's path, a
    #: signing key): what :meth:`Destination.redact` takes out of a text.
    secrets: tuple[str, ...] = dataclasses.field(repr=False)
    #: What else the kind needs to build a request (a chat id, signing keys),
    #: read by the kind alone.
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        """Secrets that are no list of texts are refused, named by their type
        alone: a string would be taken letter by letter, each letter too
        short to redact, and the whole never redacted."""
        secrets: Any = self.secrets
        if isinstance(secrets, str | bytes | bytearray) or not isinstance(secrets, Iterable):
            raise UnusableURL(
                _("its kind declares its secrets as %(type)s, not a tuple of strings")
                % {"type": type(secrets).__name__}
            )
        secrets = tuple(secrets)
        for secret in secrets:
            if not isinstance(secret, str):
                raise UnusableURL(
                    _("its kind declares a secret that is %(type)s, not a string")
                    % {"type": type(secret).__name__}
                )
        object.__setattr__(self, "secrets", secrets + _credentials_of(self.url))


def _credentials_of(url: str) -> tuple[str, ...]:
    """The password a URL's userinfo holds (``https://user:pw@host``), as it is
    written, decoded, and as ``requests`` sends it with its user (``Basic``,
    base64 of Latin-1, or of UTF-8 past it): secrets of any kind's URL,
    whether or not it declared them, for a receiver that refuses it may echo
    them. The user is no secret; nor is the password declared with it, which
    would leave a short one (a PIN) to that form alone, never taken out
    where it stands by itself."""
    try:
        netloc = urlsplit(url).netloc
    except ValueError:
        return ()
    user, _colon, password = netloc.rpartition("@")[0].partition(":")
    if not password:
        return ()
    plain = f"{unquote(user)}:{unquote(password)}"
    basic = []
    for encoding in ("latin-1", "utf-8"):
        try:
            basic.append(base64.b64encode(plain.encode(encoding)).decode("ascii"))
        except UnicodeEncodeError:
            continue
    return tuple(dict.fromkeys((password, unquote(password), *basic)))


@dataclasses.dataclass(frozen=True, eq=False)
class Destination:
    """A configured destination: a name, its kind, and what its URL parsed into.
    Only the name and the kind's label are ever shown."""

    name: str
    channel: Channel
    #: Where the request goes. Secret: never show or log it.
    url: str = dataclasses.field(repr=False)
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict, repr=False)
    _redacted: tuple[str, ...] = dataclasses.field(default=(), repr=False)
    #: The event types it is subscribed to, each a name or a pattern with "*"
    #: ("alert.*"); none: every event.
    events: tuple[str, ...] = ()
    #: Its short secret parts' forms, taken out only where each stands alone.
    _short: re.Pattern[str] | None = dataclasses.field(default=None, repr=False)

    @classmethod
    def of(
        cls, name: str, channel: Channel, parsed: Parsed, events: tuple[str, ...] = ()
    ) -> Destination:
        long, short = _forms(parsed.secrets)
        return cls(name, channel, parsed.url, parsed.options, long, events, _alone(short))

    def receives(self, event_type: str) -> bool:
        """Whether it is subscribed to events of ``event_type``."""
        return not self.events or any(fnmatchcase(event_type, pattern) for pattern in self.events)

    def __repr__(self) -> str:
        return f"<Destination {self.name!r} ({self.channel.label})>"

    def __str__(self) -> str:
        return self.display

    @property
    def kind(self) -> str:
        """The kind's name, as stored and filtered on: "slack", "json"."""
        return self.channel.name

    @property
    def display(self) -> str:
        """The name and the kind: what a message, the admin or a log may show."""
        return f"{self.name} ({self.channel.label})"

    def request(self, event: Event, *, now: float) -> Request:
        """The request that delivers ``event`` here, for an attempt at ``now``."""
        return self.channel.request(self, event, now=now)

    def redact(self, text: str) -> str:
        """``text`` with every secret part its kind declared replaced by
        [redacted], and the start of one that ends it (a text cut short); a
        short one only where it stands alone, not within a word or a number."""
        text = replace_secrets(text, self._redacted, REDACTED)
        return text if self._short is None else self._short.sub(REDACTED, text)

    def attempted(self, job: Any, transport: Transport) -> AttemptResult:
        """The attempt its kind makes at ``job`` (:meth:`Channel.attempt`),
        its error redacted: a kind's own ``attempt`` may quote what the
        receiver echoed, secret parts and all. What is no result is given
        back as it is, for whoever called it to refuse."""
        result = self.channel.attempt(job, transport)
        if isinstance(result, AttemptResult) and isinstance(result.error, str):
            error = self.redact(result.error)
            if error != result.error:
                result = dataclasses.replace(result, error=error)
        return result


@dataclasses.dataclass(frozen=True)
class Request:
    """The request one attempt makes: ``url`` and ``body`` are the destination's
    and the event's, and the headers' values may be its credential (Matrix's
    and ntfy's ``Authorization: Bearer``, a signature): none of them shown."""

    method: str
    url: str = dataclasses.field(repr=False)
    headers: Mapping[str, str]
    body: bytes = dataclasses.field(repr=False)
    #: The destination's name and kind, safe to show.
    display: str

    @property
    def sent_headers(self) -> dict[str, str]:
        """Its headers as :meth:`Channel.attempt` sends them (the transport
        adds its own under them): a JSON answer asked for, unless the kind's
        say otherwise. ``testing.Outgoing.headers()`` reads them here too."""
        return {"Accept": ACCEPT, **self.headers}

    def __repr__(self) -> str:
        # The headers by name alone: a kind of a host project's may put its
        # token in any of them.
        return (
            f"Request(method={self.method!r}, headers=<{', '.join(map(str, self.headers))}>, "
            f"display={self.display!r})"
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class Call(Job):
    """An attempt at a configured destination, as a worker is given it: the
    destination as configured now and the event as queued, or why it cannot
    be sent as it is (a destination that does not parse, an event that cannot
    be read back) and whether that can pass: one that can (a destination
    that parses again once its settings are fixed) holds it, spending no try."""

    destination: Destination | None
    event: Event | None
    problem: str = ""
    permanent: bool = False
    #: How much of a refusal's body is kept (``ERROR_LENGTH``).
    body_length: int = 300

    @property
    def message_length(self) -> int:
        return self.body_length + MESSAGE_ROOM


class Channel:
    """A kind of destination. Subclass it, set :attr:`name`, :attr:`label` and
    :attr:`schemes`, and write :meth:`parse` and :meth:`request`; override
    :meth:`judge` when the service says more than its status does, and
    :meth:`policy` when its deliveries are to be retried, ordered or laned
    otherwise than the ``WEBHOOK_*`` settings say.

    A kind is chosen by the scheme of a destination's URL. It never touches the
    database, and is one instance for the whole process: keep no state on it.
    """

    #: The kind's name, stored with its deliveries and shown in filters.
    name: ClassVar[str]
    #: Shown beside the destination's name: "ops (Slack)".
    label: ClassVar[str]
    #: The URL schemes that name this kind, lowercase. By convention ``kind``
    #: sends over HTTPS and ``kind+http`` over plain HTTP.
    schemes: ClassVar[tuple[str, ...]]
    #: Where a 429's JSON body gives the wait when no ``Retry-After`` does:
    #: the keys that lead to a number, and the seconds its unit is
    #: (``(("retry_after_ms",), 0.001)``); None when the service does not.
    wait_in_body: ClassVar[tuple[tuple[str, ...], float] | None] = None

    def parse(self, url: str, scheme: str) -> Parsed:
        """What ``url`` (whose scheme, lowercased, is ``scheme``) names, with
        its secret parts declared. Raise :class:`UnusableURL` saying what is
        wrong, never quoting the URL."""
        raise NotImplementedError

    def request(self, destination: Destination, event: Event, *, now: float) -> Request:
        """The request that delivers ``event``, made for an attempt at ``now``
        (Unix time): anything time-bound, such as a signature, is of ``now``."""
        raise NotImplementedError

    def policy(self) -> Policy:
        """How this kind's deliveries are queued, tried and retried: as the
        ``WEBHOOK_*`` settings say, unless the kind says otherwise (override
        it, changing what differs: ``dataclasses.replace(super().policy(),
        schedule=(60.0, 600.0))``). Asked as a send is written and as a
        deliverer starts, never for each attempt."""
        return Policy.for_webhooks()

    def judge(self, answer: Answer) -> Verdict:
        """A 2xx is delivered; a 4xx but 408 and 429 is refused for good
        (a hook deleted, a token revoked); anything else is tried again, after
        the ``Retry-After`` the receiver gave in seconds (for a 429 without
        one, the wait its body gives where :attr:`wait_in_body` says)."""
        if 200 <= answer.status < 300:
            return Verdict(delivered=True)
        retry_after = parse_retry_after(answer.headers.get("Retry-After"), dates=False)
        if retry_after is None and answer.status == 429 and self.wait_in_body is not None:
            retry_after = waited_in_body(answer.body, *self.wait_in_body)
        return Verdict(
            delivered=False,
            refused=is_refusal(answer.status),
            retry_after=retry_after,
            detail=answer.body.decode("utf-8", "replace"),
        )

    def attempt(
        self,
        job: Any,
        transport: Transport,
        *,
        clock: Callable[[], float] = time.monotonic,
        now: Callable[[], float] = time.time,
    ) -> AttemptResult:
        """One attempt at ``job`` (a :class:`Call` to one of this kind's
        destinations): the request :meth:`request` builds at ``now()``, sent
        once within the transport's time limit and before the job's lease
        ends (another process may take the delivery then: not made at all
        when that has passed), its answer judged by :meth:`judge`. A kind
        whose attempt is more than one request (an ActivityPub inbox's double
        knock) overrides it.

        The URL is the credential: every text that leaves here has been
        through the destination's :meth:`~Destination.redact` (and the
        transport's ``scheme://host/path`` cut to ``scheme://host``), a
        receiver echoing the URL included; urllib3's debug lines are redacted
        while it is sent."""
        started = clock()
        destination, event = job.destination, job.event
        assert destination is not None and event is not None, "a call with a problem is not made"
        deadline = deadline_of(job, transport.settings.attempt_timeout)
        if deadline is None:
            return lapsed(job)
        try:
            request = self.request(destination, event, now=now())
        except Exception as exc:
            # The project's template, most likely; fixed, the retry sends it.
            logger.warning(
                "The event %s for %s could not be written: %s",
                event.type,
                destination.display,
                type(exc).__name__,
            )
            error = f"the event could not be written for {destination.name}: {type(exc).__name__}"
            return failed(job, error, permanent=False, requests=0)
        try:
            with logs.redacting(destination.redact):
                answer = transport.post(
                    request.url,
                    request.body,
                    request.sent_headers,
                    deadline=deadline,
                    method=request.method,
                )
        except TransportError as exc:
            error = safe_text(destination, request.url, str(exc))[: job.message_length]
            if isinstance(exc, RefusedAddress) or exc.sent:
                result = failed(job, error, permanent=False, sent=exc.sent)
            else:
                # Its URL unusable (a kind's own, made of the event): no
                # request, and no address the settings could open.
                result = failed(job, error, permanent=False, requests=0)
        else:
            result = self._judged(job, answer, destination)
        return dataclasses.replace(result, duration=clock() - started)

    def _judged(self, job: Call, answer: Answer, destination: Destination) -> AttemptResult:
        verdict = self.judge(answer)
        detail, fault = readable_detail(verdict)
        if fault:
            logger.error(
                "The judge() of the %s kind gave a verdict the loop cannot read (%s): "
                "its detail is left out",
                self.name,
                fault,
            )
        # The whole of what was read is redacted before any of it is cut: a cut
        # secret would no longer be recognised.
        text = answer_text(destination.redact(detail))
        error = f"the receiver answered {status_text(answer.status)}"
        if text:
            error = f"{error}: {text[: job.body_length].rstrip()}"
        result = judged(job, answer.status, verdict, error)
        if answer.status == HTTPStatus.GONE and not result.delivered:
            # Not this event's refusal: the destination is gone, and disabled
            # for it (webhooks/life.py). The event waits with the others, its
            # tries kept. (A kind whose judge() reads a 410 as delivered,
            # an event the service had already, is delivered.)
            result = dataclasses.replace(result, permanent=False, held=True, retry_after=None)
        return result

    # Helpers for kinds.

    @staticmethod
    def json_request(
        destination: Destination,
        document: Any,
        *,
        method: str = "POST",
        url: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> Request:
        """A request whose body is ``document`` as compact JSON."""
        return Request(
            method,
            destination.url if url is None else url,
            {"Content-Type": "application/json", **(headers or {})},
            compact_json(document),
            destination.display,
        )

    @staticmethod
    def over(url: str, scheme: str) -> str:
        """``url`` with its ``kind://`` scheme made ``https://``, or ``http://``
        for ``kind+http://``."""
        return ("http" if scheme.endswith("+http") else "https") + url[len(scheme) :]

    @staticmethod
    def split(url: str) -> URLParts:
        """The parts of an http(s) URL; raises :class:`UnusableURL` when it has
        no host or a bad port."""
        try:
            parts = urlsplit(url)
            # ValueError for a port that is no number, or above 65535; 0 is
            # read as one, but no request can go to it (the transport's rule).
            if parts.port == 0:
                raise ValueError("port 0")
        except ValueError:
            raise UnusableURL(_("its URL is not a valid URL")) from None
        if not parts.hostname:
            raise UnusableURL(_("its URL has no host"))
        # By hand: a token may hold ":" that urlsplit would read as a password.
        userinfo, _at, host = parts.netloc.rpartition("@")
        return URLParts(parts.scheme, userinfo, host, parts.path, parts.query)

    @staticmethod
    def query_pairs(query: str) -> list[tuple[str, str]]:
        """A query's parameters, decoded (``+`` kept: base64 uses it)."""
        pairs = []
        for pair in query.split("&") if query else []:
            key, _sign, value = pair.partition("=")
            pairs.append((unquote(key), unquote(value)))
        return pairs


def policy_of(channel: Channel) -> Policy:
    """``channel``'s :meth:`~Channel.policy`, as the checks, ``send_webhook``
    and the loop ask for it: ``ImproperlyConfigured`` naming the kind when it
    cannot be had (it raises) or followed (it is no :class:`Policy`: a
    ``policy()`` that forgot its ``return`` gives None). A
    :class:`PolicyError`, the package's own words, is quoted; any other
    error is named by its type alone, as a kind's own code may put anything
    in its message, a secret it read included."""
    try:
        policy = channel.policy()
        if not isinstance(policy, Policy):
            raise PolicyError(
                _("its policy() returned %(type)s, not a Policy") % {"type": type(policy).__name__}
            )
    except PolicyError as exc:
        raise ImproperlyConfigured(
            _("The policy of the %(kind)r kind of webhook destination: %(problem)s.")
            % {"kind": channel.name, "problem": exc}
        ) from None
    except Exception as exc:
        raise ImproperlyConfigured(
            _("The policy of the %(kind)r kind of webhook destination could not be had: %(error)s.")
            % {"kind": channel.name, "error": type(exc).__name__}
        ) from None
    return policy


def waited_in_body(body: bytes, path: tuple[str, ...], unit: float) -> float | None:
    """The wait, in seconds, a rate-limited answer's JSON ``body`` gives at
    ``path`` in ``unit`` seconds; None when it gives none it can mean (not a
    number, below nought, past :data:`MOST_WAITED`)."""
    waited: Any
    try:
        waited = json.loads(body)
        for key in path:
            waited = waited[key]
        # A stranger's body: an int too big for a float, or nested past the
        # parser's depth, is as unreadable as one that is not JSON.
        seconds = float(waited) * unit if _is_number(waited) else None
    except (ValueError, TypeError, KeyError, IndexError, OverflowError, RecursionError):
        return None
    if seconds is None or not 0 <= seconds < MOST_WAITED:
        return None
    return seconds


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _forms(secrets: tuple[str, ...]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Each declared secret in every form a text may hold it (see
    :func:`~django_federation_delivery.addresses.secret_forms`): those of
    :data:`MIN_REDACTED` characters or more, and the shorter ones, to be
    taken out only where they stand alone (:func:`_alone`). A short one is
    left out where another declared part holds it (a hook's segment, in its
    path, which is taken out), or where it is too short or too plain to be
    told from ordinary text: fewer than :data:`MIN_SHORT` characters, or no
    letter or digit (the path ``/`` of a hook at the root)."""
    by_secret = {secret: secret_forms([secret]) for secret in dict.fromkeys(secrets)}
    long = sorted(
        {form for forms in by_secret.values() for form in forms if len(form) >= MIN_REDACTED},
        key=lambda form: (-len(form), form),
    )
    short: set[str] = set()
    for secret, forms in by_secret.items():
        others = [
            form
            for other, their in by_secret.items()
            if other != secret
            for form in their
            if len(form) >= MIN_REDACTED
        ]
        short.update(
            form
            for form in forms
            if MIN_SHORT <= len(form) < MIN_REDACTED
            and any(char.isalnum() for char in form)
            and not any(form in other for other in others)
        )
    return tuple(long), tuple(sorted(short, key=lambda form: (-len(form), form)))


def _alone(forms: tuple[str, ...]) -> re.Pattern[str] | None:
    """What finds each of ``forms`` where it stands alone: with no letter or
    digit just before or after it ("ops" in "ops down", not in "Oops")."""
    if not forms:
        return None
    either = "|".join(map(re.escape, forms))
    return re.compile(rf"(?<![^\W_])(?:{either})(?![^\W_])")


def safe_text(destination: Destination, url: str, text: str) -> str:
    """``text`` (a transport's error) in one line with nothing of the URL but
    its scheme and host: the path of a Slack or Discord hook, and a bot
    token, are the credential."""
    try:
        target = check_url(url)
    except TransportError:
        pass
    else:
        origin = target.display.split("://", 1)
        host = origin[1].split("/", 1)[0] if len(origin) == 2 else ""
        if host:
            text = text.replace(target.display, f"{origin[0]}://{host}")
    return " ".join(destination.redact(text).split())
