"""The ``FEDERATION_DELIVERY`` settings: defaults in one place, read lazily.

Every read goes through :data:`app_settings`, which looks at
``django.conf.settings`` each time, so ``override_settings`` works in tests.
Misconfiguration is reported by the system checks in ``checks/``; the
accessors here raise ``ImproperlyConfigured`` naming the bad value when code
uses one anyway. Code reads a setting through its typed accessor
(``app_settings.concurrency`` is an ``int``), converted in one place rather
than cast at every use; ``get`` gives the raw value, as the checks want it.
:func:`database_alias` checks the one Django setting the public API is
given a name from: a database alias (``using``), in ``DATABASES``; and says
which one is meant when none is given, as ``DATABASE_ROUTERS`` route the app.
"""

from __future__ import annotations

import functools
import ipaddress
import re
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Generic, TypeVar, overload

from django.apps import apps
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.db import connections, router
from django.utils.module_loading import import_string
from django.utils.translation import gettext as _

from django_federation_delivery import __version__
from django_federation_delivery.addresses import quoted
from django_federation_delivery.exceptions import InvalidDelivery
from django_federation_delivery.retry import DAY_SCHEDULE, RetryPolicy
from django_federation_delivery.signatures import Scheme

if TYPE_CHECKING:
    from django_federation_delivery.transport import TransportSettings

SETTING = "FEDERATION_DELIVERY"
# Time an attempt leaves its lease for the outcome to be written before it lapses.
LEASE_MARGIN_SECONDS = 10.0

DEFAULTS: dict[str, Any] = {
    # A dotted path to ``callable(sender: str) -> SenderKey | None``.
    "SENDER_KEYS": None,
    # A dotted path to ``callable(sender: str) -> bool``: whether the sender
    # is gone for good (a deleted account). None: no sender is ever gone.
    "SENDER_GONE": None,
    # How long a sender's key is kept in memory before it is asked for again.
    "KEY_CACHE_SECONDS": 60.0,
    # A send to at most this many inboxes goes to the priority lane, claimed
    # before any other. None: no priority lane.
    "PRIORITY_MAX_INBOXES": None,
    # The most one send may queue: inboxes (after duplicates are dropped),
    # and the activity's size as JSON encoded in UTF-8, as it is sent.
    "MAX_INBOXES": 100_000,
    "MAX_BODY_BYTES": 1 << 20,
    # A dotted path to ``callable(inbox: str, activity: dict) -> bool``, asked
    # as each delivery comes due: True drops it unsent (settled as skipped),
    # as for a server the project has since marked unavailable.
    "SKIP_IF": None,
    # A dotted path to ``callable(sender: str, inbox: str) -> str | None``:
    # the Collection-Synchronization header (FEP-8fcf) a delivery of a batch
    # sent with synchronize_collection carries, written when it is sent.
    "COLLECTION_SYNCHRONIZATION": None,
    # A dotted path to ``callable(status: int) -> bool``: which answers are
    # final. None: every 4xx but 408 and 429.
    "PERMANENT_STATUS": None,
    # Statuses that are final when the sender is gone (Mastodon gives up on
    # a 401 to a deleted account).
    "PERMANENT_IF_SENDER_GONE": [],
    # Exponential backoff by default: BASE seconds doubling to CAP, ATTEMPTS
    # tries in all, each wait up to JITTER shorter at random. SCHEDULE, when
    # given, is a list of waits in seconds used instead (one try more than
    # waits).
    "RETRY": {"BASE": 30.0, "CAP": 3600.0, "ATTEMPTS": 12, "JITTER": 0.25, "SCHEDULE": None},
    # Whether a retry waits at least as long as Retry-After asks, and the
    # longest such wait honoured.
    "WAIT_AS_ASKED": True,
    "RETRY_AFTER_MAX": 3600.0,
    # How many due deliveries one claim takes, and for how long.
    "CLAIM_SIZE": 64,
    "LEASE_SECONDS": 300.0,
    # Deliveries in flight at once, in all and to one host: a host starts at
    # PER_HOST and moves between 1 and PER_HOST_MAX as it answers (limits.py).
    "CONCURRENCY": 16,
    "PER_HOST": 2,
    "PER_HOST_MAX": 8,
    # A delivery in flight this long gives its slot up to the next, so that
    # silent servers hold threads, not slots; at most SLOW_CONCURRENCY of
    # them at once beyond CONCURRENCY.
    "SLOW_AFTER_SECONDS": 2.0,
    "SLOW_CONCURRENCY": 32,
    # The longest the loop sleeps with nothing due (jittered by a quarter),
    # and how often it looks for new work queued by another process.
    "IDLE_POLL_SECONDS": 30.0,
    "NEW_WORK_POLL_SECONDS": 0.1,
    # How often a run_deliverer process records that it is alive (one small
    # write each time): three intervals without one and it is taken for dead.
    "HEARTBEAT_SECONDS": 5.0,
    # Circuit breakers: THRESHOLD failures in a row open one for COOL_OFF
    # seconds, then one probe at a time; SCOPE "host" or "inbox". None or {}: off.
    "BREAKER": {"THRESHOLD": 10, "COOL_OFF": 60.0, "SCOPE": "host"},
    # The wire.
    "CONNECT_TIMEOUT": 10.0,
    "ATTEMPT_TIMEOUT": 30.0,
    "MAX_ANSWER_BYTES": 1 << 20,
    "ERROR_LENGTH": 300,
    # Idle keep-alive connections kept to a host; None: as many as a host
    # may be sent at once (PER_HOST_MAX), so that none in use is closed
    # after its one request.
    "CONNECTIONS_PER_HOST": None,
    "IDLE_CONNECTION_SECONDS": 10.0,
    # Idle keep-alive connections kept open in the whole process, across
    # every worker; past it the least recently used are closed. Each is a
    # file descriptor (see "File descriptors" in the README).
    "MAX_IDLE_CONNECTIONS": 256,
    "VERIFY_TLS": True,
    # Networks inboxes may be on although they are not public, such as
    # ["127.0.0.0/8"] in tests. Empty: public addresses only. An inbox URL is
    # chosen by a stranger: open only what no service of yours listens on.
    "ALLOWED_NETWORKS": [],
    # The same for webhook destinations, which only the project configures
    # (a Telegram Bot API server on loopback, say); inboxes are not let in.
    "WEBHOOK_ALLOWED_NETWORKS": [],
    "USER_AGENT": f"django-federation-delivery/{__version__}",
    # "draft-cavage" or "rfc9421": the scheme a host is first tried in.
    "FIRST_SCHEME": "draft-cavage",
    # Webhook destinations, {"name": URL}: see django_federation_delivery.webhooks.
    "WEBHOOKS": {},
    # Kinds of destination the project adds, as dotted paths to Channel
    # subclasses (see django_federation_delivery.channels), beside the built-in ones.
    "CHANNELS": [],
    # Webhook deliveries: the waits between tries (nine tries across a day),
    # the longest Retry-After honoured unless the scheduled wait is longer,
    # and the time one request may take.
    "WEBHOOK_RETRY": list(DAY_SCHEDULE),
    "WEBHOOK_RETRY_AFTER_MAX": 3600.0,
    "WEBHOOK_TIMEOUT": 10.0,
    # The largest event send_webhook() takes, as JSON: a receiver is not a
    # file store, and a chat kind cuts its message far shorter anyway.
    "WEBHOOK_MAX_BYTES": 1 << 20,
    # A destination failing without one success for this long is disabled:
    # its events wait, in order, until an operator enables it again.
    "WEBHOOK_DISABLE_AFTER": 5 * 86400.0,
    # An inbox's host with no answer but 5xx and 429 (or none) for this long
    # is told failing (host_failing), once, and told up again once it answers.
    "HOST_FAILING_AFTER": 3600.0,
    # An inbox's host with no success for this long is marked unavailable:
    # sends skip its inboxes until it is seen again (a daily probe, an
    # operator, or mark_host_seen). None never marks one.
    "HOST_UNAVAILABLE_AFTER": 7 * 86400.0,
    # How long settled deliveries are kept, in seconds, by status, before
    # purge_deliveries (or run_deliverer --purge) deletes them; a status set
    # to None is kept for ever, and RETENTION None keeps everything.
    "RETENTION": {
        "DELIVERED": 7 * 86400.0,
        "SKIPPED": 7 * 86400.0,
        "FAILED": 30 * 86400.0,
        "REFUSED": 30 * 86400.0,
        "SUPERSEDED": 7 * 86400.0,
    },
}

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
T = TypeVar("T")

#: A dotted path, as a setting naming a callable or a class holds one: at
#: least one dot, each part a name, and no longer than any real one.
DOTTED_PATH = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+")
MOST_PATH_LENGTH = 200


def is_dotted_path(value: object) -> bool:
    """Whether ``value`` is text in the form of a dotted path: the only value
    of a setting naming a callable (or a class) that an error may repeat."""
    return (
        isinstance(value, str)
        and len(value) <= MOST_PATH_LENGTH
        and DOTTED_PATH.fullmatch(value) is not None
    )


def shown(value: Any, limit: int = 80) -> str:
    """``value`` as an error may show it: its repr, cut at ``limit``; one
    Python will not write out (an int of more digits than it writes, or a
    list holding one) by its type."""
    try:
        text = repr(value)
    except ValueError:
        if isinstance(value, int):
            # An int with more digits than Python writes out (sys.int_info).
            text = f"<int of {value.bit_length()} bits>"
        else:
            text = f"<{type(value).__name__} not shown>"
    return text if len(text) <= limit else f"{text[:limit]}…"


def import_error(path: object, exc: Exception) -> str:
    """What an error importing ``path`` may say of ``exc``: an ImportError's
    own message when ``path`` is a dotted path (else none: it repeats the
    value, which may be a secret pasted there), or the type of what the
    module raised as it ran (a KeyError for a variable it reads, say),
    whose message may be a secret."""
    if isinstance(exc, ImportError):
        return str(exc) if is_dotted_path(path) else ""
    return type(exc).__name__


def shown_path(value: object) -> str:
    """A value given where a dotted path goes, as an error may show it: the
    path quoted, or anything else by its type alone. What a project writes
    there by mistake may be what the callable was to return (a private key
    pasted whole, or a dict of them), which no check or log repeats."""
    if is_dotted_path(value):
        return repr(value)
    return _("%(type)s (not shown: it is not a dotted path)") % {"type": type(value).__name__}


class Typed(Generic[T]):
    """A setting read as one type: the attribute ``name`` reads ``NAME``,
    converted by ``convert``. A value it cannot convert (one the system
    checks would have reported) raises ``ImproperlyConfigured`` naming it;
    for a setting of dotted paths (``paths``), naming only its type when it
    is not one, as :func:`shown_path` does."""

    def __init__(self, convert: Callable[[Any], T], *, paths: bool = False) -> None:
        self.convert = convert
        # Whether the setting holds dotted paths: a value that is not one is
        # then never repeated (see shown_path()).
        self.paths = paths
        self.name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name.upper()
        if self.name not in DEFAULTS:
            raise TypeError(f"{SETTING} has no setting {self.name!r}")

    @overload
    def __get__(self, instance: None, owner: type) -> Typed[T]: ...

    @overload
    def __get__(self, instance: AppSettings, owner: type) -> T: ...

    def __get__(self, instance: AppSettings | None, owner: type) -> Typed[T] | T:
        if instance is None:
            return self
        value = instance.get(self.name)
        try:
            return self.convert(value)
        # OverflowError: an int too large for a float (10**400 seconds);
        # AttributeError: a policy read from what is no mapping ("often").
        except (KeyError, TypeError, ValueError, OverflowError, AttributeError) as exc:
            if self.paths and not is_dotted_path(value):
                raise ImproperlyConfigured(
                    _(
                        "%(setting)s[%(name)r] must be a list of dotted paths, not %(value)s. "
                        "Run manage.py check for what to write instead."
                    )
                    % {"setting": SETTING, "name": self.name, "value": shown_path(value)}
                ) from None
            raise ImproperlyConfigured(
                _(
                    "%(setting)s[%(name)r] = %(value)s cannot be used: %(error)s. "
                    "Run manage.py check for what to write instead."
                )
                % {"setting": SETTING, "name": self.name, "value": shown(value, 200), "error": exc}
            ) from exc


def _statuses(values: Iterable[Any]) -> frozenset[int]:
    return frozenset(int(value) for value in values)


def _waits(values: Iterable[Any]) -> tuple[float, ...]:
    return tuple(float(value) for value in values)


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


def _most_bytes(value: Any) -> int:
    most = int(value)
    if most < 1:
        raise ValueError("an event takes at least 1 byte")
    return most


def _paths(values: Any) -> tuple[str, ...]:
    if isinstance(values, str) or not all(isinstance(value, str) for value in values):
        raise TypeError("a list of dotted paths is needed")
    return tuple(values)


class AppSettings:
    """``FEDERATION_DELIVERY`` with its defaults, looked up on every access."""

    # Typed accessors, each named after its setting in lower case.
    key_cache_seconds = Typed(float)
    max_inboxes = Typed(int)
    priority_max_inboxes = Typed(_optional_int)
    max_body_bytes = Typed(int)
    permanent_if_sender_gone = Typed(_statuses)
    retry = Typed(RetryPolicy.from_setting)
    wait_as_asked = Typed(bool)
    retry_after_max = Typed(float)
    claim_size = Typed(int)
    lease_seconds = Typed(float)
    concurrency = Typed(int)
    per_host = Typed(int)
    per_host_max = Typed(int)
    slow_after_seconds = Typed(float)
    slow_concurrency = Typed(int)
    idle_poll_seconds = Typed(float)
    new_work_poll_seconds = Typed(float)
    heartbeat_seconds = Typed(float)
    connect_timeout = Typed(float)
    attempt_timeout = Typed(float)
    max_answer_bytes = Typed(int)
    error_length = Typed(int)
    connections_per_host = Typed(_optional_int)
    idle_connection_seconds = Typed(float)
    max_idle_connections = Typed(int)
    verify_tls = Typed(bool)
    user_agent = Typed(str)
    first_scheme = Typed(Scheme)
    webhook_retry = Typed(_waits)
    webhook_retry_after_max = Typed(float)
    webhook_timeout = Typed(float)
    webhook_max_bytes = Typed(_most_bytes)
    webhook_disable_after = Typed(float)
    host_failing_after = Typed(float)
    host_unavailable_after = Typed(_optional_float)
    channels = Typed(_paths, paths=True)

    def user_settings(self) -> dict[str, Any]:
        """The setting as the project wrote it; ``ImproperlyConfigured`` when
        it is no dict, naming its type alone: its value may hold a webhook's
        URL, the credential."""
        value = getattr(settings, SETTING, {})
        if not isinstance(value, dict):
            raise ImproperlyConfigured(
                _("%(setting)s must be a dict, not %(type)s.")
                % {"setting": SETTING, "type": type(value).__name__}
            )
        return value

    def get(self, name: str) -> object:
        """A setting as written (merged with its default, for a dict): not
        yet checked, so ``object``; code reads the typed accessors."""
        if name not in DEFAULTS:
            raise AttributeError(f"{SETTING} has no setting {name!r}")
        default = DEFAULTS[name]
        value = self.user_settings().get(name, default)
        if isinstance(default, dict) and isinstance(value, dict):
            return {**default, **value}
        return value

    def __getattr__(self, name: str) -> Any:
        if name.isupper():
            return self.get(name)
        raise AttributeError(name)

    def written(self, name: str) -> Any:
        """A setting as the project wrote it, not merged with its default
        (``BREAKER = {}`` means off, not "the defaults")."""
        return self.user_settings().get(name, DEFAULTS[name])

    def unknown_keys(self) -> list[object]:
        """The keys of the setting that name no setting, in a stable order
        whatever their types (``{1: 2, "Zzz": 3}`` has two)."""
        return sorted(set(self.user_settings()) - set(DEFAULTS), key=repr)

    def callable_setting(self, name: str) -> Callable[..., Any] | None:
        """The callable a setting names (a dotted path, or the callable itself)."""
        value = self.get(name)
        if value is None:
            return None
        if callable(value):
            return value
        if not isinstance(value, str):
            raise _not_a_path(name, value)
        try:
            found = import_string(value)
        except Exception as exc:  # SyntaxError, and what a module raises as it runs
            if not is_dotted_path(value):
                # Its error repeats it: neither is shown.
                raise _not_a_path(name, value) from None
            raise ImproperlyConfigured(
                _("%(setting)s[%(name)r] = %(value)r cannot be imported: %(error)s")
                % {
                    "setting": SETTING,
                    "name": name,
                    "value": value,
                    "error": import_error(value, exc),
                }
            ) from None
        if not callable(found):
            if not is_dotted_path(value):
                raise _not_a_path(name, value)
            raise ImproperlyConfigured(
                _("%(setting)s[%(name)r] = %(value)r is not callable.")
                % {"setting": SETTING, "name": name, "value": value}
            )
        return found  # type: ignore[no-any-return]

    def allowed_networks(self, name: str = "ALLOWED_NETWORKS") -> tuple[Network, ...]:
        """The non-public networks ``name`` opens: ``ALLOWED_NETWORKS`` to
        inboxes, ``WEBHOOK_ALLOWED_NETWORKS`` to webhook destinations."""
        from django_federation_delivery.transport.networks import network

        networks = []
        values = self.get(name)
        if not isinstance(values, list | tuple):
            raise ImproperlyConfigured(
                _("%(setting)s[%(name)r] must be a list of networks, not %(value)s.")
                % {"setting": SETTING, "name": name, "value": shown(values, 200)}
            )
        for value in values:
            try:
                networks.append(network(value))
            except (TypeError, ValueError) as exc:
                raise ImproperlyConfigured(
                    _(
                        "%(setting)s[%(name)r] has %(value)s, which is not a network "
                        "such as '127.0.0.0/8'."
                    )
                    % {"setting": SETTING, "name": name, "value": shown(value, 200)}
                ) from exc
        return tuple(networks)

    def transport_settings(self, *, most_per_host: int | None = None) -> TransportSettings:
        """The transport's settings; ``most_per_host`` is the most a deliverer
        sends one host at once, which ``CONNECTIONS_PER_HOST`` None follows
        (``PER_HOST_MAX``, or ``PER_HOST`` if higher, when not given)."""
        from django_federation_delivery.transport import TransportSettings

        kept = self.connections_per_host
        if kept is None:
            kept = most_per_host or max(self.per_host, self.per_host_max)
        return TransportSettings(
            user_agent=self.user_agent,
            connect_timeout=self.connect_timeout,
            attempt_timeout=self.attempt_timeout,
            max_answer_bytes=self.max_answer_bytes,
            allowed_networks=self.allowed_networks(),
            connections_per_host=kept,
            idle_timeout=self.idle_connection_seconds,
            max_idle_connections=self.max_idle_connections,
            verify_tls=self.verify_tls,
        )


app_settings = AppSettings()


def _not_a_path(name: str, value: object) -> ImproperlyConfigured:
    """The error of a setting naming a callable that holds no dotted path to
    one, showing the value only if it is one (see :func:`shown_path`)."""
    return ImproperlyConfigured(
        _("%(setting)s[%(name)r] must be a dotted path to a callable, not %(value)s.")
        % {"setting": SETTING, "name": name, "value": shown_path(value)}
    )


def database_alias(using: object = None) -> str:
    """``using`` as the public API takes it: an alias in ``DATABASES``, or
    None for the app's database: the one its routers (``DATABASE_ROUTERS``)
    write its deliveries to, ``"default"`` when none of them chooses;
    ``InvalidDelivery`` (a ``ValueError``) naming it otherwise, before
    anything is written."""
    if using is None:
        return router.db_for_write(_delivery_model())
    if not isinstance(using, str) or using not in connections:
        raise InvalidDelivery(f"no database named {quoted(using)} in DATABASES")
    return using


@functools.cache
def _delivery_model() -> type[Any]:
    # The app's models are asked of the registry once it is ready: they are
    # imported after this module.
    return apps.get_model("federation_delivery", "Delivery")
