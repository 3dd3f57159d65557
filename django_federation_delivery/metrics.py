"""Prometheus metrics of the deliverer, with the optional ``prometheus`` extra.

The deliverer calls :func:`record_attempt` after each attempt and refreshes
the gauges with :func:`observe_queue`, which reads them all from the database
with :func:`read_queue` (:func:`set_lag` and :func:`set_open_breakers` set
two of them by hand); ``run_deliverer --metrics-port`` serves them with
:func:`start_server`. Without ``prometheus_client`` installed every recording
function does nothing, so that the deliverer may call them unconditionally,
and :func:`start_server` raises ``ImproperlyConfigured``.

The gauges say what the database says, whichever deliverer serves them: each
serves the same figures. No label carries a URL: lanes, outcomes and webhook
destinations' names only, and hosts are counted, not named.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import socket
import threading
from collections.abc import Mapping
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from django.core.exceptions import ImproperlyConfigured
from django.utils.translation import gettext_noop

from django_federation_delivery.conf import database_alias
from django_federation_delivery.decide import Outcome

try:
    import prometheus_client
except ImportError:  # pragma: no cover - exercised where the extra is not installed
    prometheus_client = None  # type: ignore[assignment]

__all__ = [
    "OUTCOMES",
    "QueueReading",
    "available",
    "check_address",
    "observe_queue",
    "read_queue",
    "record_attempt",
    "set_lag",
    "set_open_breakers",
    "start_server",
]

#: What an attempt can come to, as ``delivery_attempted`` reports it.
OUTCOMES = (Outcome.DELIVERED, Outcome.RETRYING, Outcome.HELD, Outcome.REFUSED, Outcome.FAILED)
#: Why an attempt did not deliver, as the failures counter's label says it:
#: what the receiver answered, by class, or that it did not answer, or that
#: no request was made (no key, a signature that could not be made, a lease
#: spent). Bounded: an error's text would make a time series each.
REASONS = ("no_answer", "status_429", "status_4xx", "status_5xx", "status_other", "not_sent")
#: Attempt durations in seconds: from a fast local inbox to ATTEMPT_TIMEOUT.
DURATION_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
PREFIX = "federation_delivery"
#: Marked for translation: run_deliverer says it in the active language. Raised
#: here in English, as start_server may be called before Django is set up.
NEEDS_CLIENT = gettext_noop(
    "Serving metrics needs prometheus_client: pip install 'django-federation-delivery[prometheus]'."
)


class _Metrics:
    def __init__(self) -> None:
        assert prometheus_client is not None
        self.attempts = prometheus_client.Counter(
            f"{PREFIX}_attempts",
            "Delivery attempts, by outcome.",
            ["outcome"],
        )
        # Every outcome shows from the start, at nought, so that rate() sees
        # the first one; each one's counter is kept, not looked up again an attempt.
        self.attempts_by_outcome: dict[str, prometheus_client.Counter] = {
            outcome: self.attempts.labels(outcome=outcome) for outcome in OUTCOMES
        }
        self.failures = prometheus_client.Counter(
            f"{PREFIX}_failed_attempts",
            "Attempts that did not deliver (not those held without a request), by reason.",
            ["reason"],
        )
        self.failures_by_reason: dict[str, prometheus_client.Counter] = {
            reason: self.failures.labels(reason=reason) for reason in REASONS
        }
        self.duration = prometheus_client.Histogram(
            f"{PREFIX}_attempt_duration_seconds",
            "How long delivery attempts took, in seconds (not those made without a request).",
            buckets=DURATION_BUCKETS,
        )
        self.lag = _gauge(
            "lag_seconds", "How long the longest-waiting due delivery has waited, in seconds."
        )
        self.open_breakers = _gauge(
            "open_breakers",
            "Circuit breakers open or half-open: destinations whose deliveries are held.",
        )
        self.lane_lag = _gauge(
            "lane_lag_seconds",
            "How long the longest-waiting due delivery of each lane has waited, in seconds.",
            "lane",
        )
        self.deliverers_alive = _gauge(
            "deliverers_alive", "Deliverers alive, on any machine: those whose heartbeat is recent."
        )
        self.hosts_failing = _gauge(
            "hosts_failing",
            "Inbox hosts failing (no success since a failure), not marked unavailable.",
        )
        self.hosts_told_failing = _gauge(
            "hosts_told_failing",
            "Inbox hosts failing for HOST_FAILING_AFTER (host_failing was sent), "
            "not marked unavailable.",
        )
        self.hosts_unavailable = _gauge(
            "hosts_unavailable", "Inbox hosts marked unavailable: sends leave their inboxes out."
        )
        self.destination_disabled = _gauge(
            "webhook_destination_disabled",
            "1 for a configured webhook destination disabled or paused (its events wait), else 0.",
            "destination",
        )
        #: The destinations with a series now: one removed from the settings
        #: loses its series, rather than keeping its last value for ever.
        self.destinations: set[str] = set()
        self.refreshed = _gauge(
            "gauges_refreshed_timestamp_seconds",
            "When this process last read the gauges from the database, in seconds since the epoch.",
        )


def _gauge(name: str, documentation: str, *labels: str) -> prometheus_client.Gauge:
    assert prometheus_client is not None
    return prometheus_client.Gauge(f"{PREFIX}_{name}", documentation, labels)


# Registered once, in the default registry, where a host project's own
# exporter (django-prometheus, say) finds them too.
_metrics = _Metrics() if prometheus_client is not None else None


def available() -> bool:
    """Whether ``prometheus_client`` is installed."""
    return _metrics is not None


def record_attempt(
    outcome: str, duration: float, *, status: int | None = None, requests: int = 1
) -> None:
    """Count one attempt that came to ``outcome`` (one of :data:`OUTCOMES`)
    and, if it made a request, time it: ``duration`` seconds; one that did
    not deliver (retrying, refused or failed, or held after its request)
    also by its reason (:func:`failure_reason` of the ``status`` answered
    and the ``requests`` made)."""
    if outcome not in OUTCOMES:
        # A label per typo would make a new time series each.
        raise ValueError(f"unknown outcome {outcome!r}; expected one of {', '.join(OUTCOMES)}")
    if _metrics is None:
        return
    _metrics.attempts_by_outcome[outcome].inc()
    if requests:
        # One that made none (held by its breaker, its key missing) timed no
        # request: counted at nought, it would drag the median and mean down.
        _metrics.duration.observe(max(duration, 0.0))
    if outcome in _FAILED or (outcome == Outcome.HELD and requests):
        # Held after a request: the answer that disabled its destination (a
        # 410, the last 5xx before WEBHOOK_DISABLE_AFTER), a failure too.
        _metrics.failures_by_reason[failure_reason(status, requests)].inc()


_FAILED = frozenset({Outcome.RETRYING, Outcome.REFUSED, Outcome.FAILED})


def failure_reason(status: int | None, requests: int) -> str:
    """Why an attempt did not deliver, one of :data:`REASONS`."""
    if not requests:
        return "not_sent"
    if status is None:
        return "no_answer"
    if status == 429:
        return "status_429"
    if 400 <= status < 500:
        return "status_4xx"
    if status >= 500:
        return "status_5xx"
    return "status_other"


def set_lag(seconds: float) -> None:
    """How long the longest-waiting due delivery has waited, in seconds."""
    if _metrics is not None:
        _metrics.lag.set(max(seconds, 0.0))


def set_open_breakers(count: int) -> None:
    """How many circuit breakers are open or half-open."""
    if _metrics is not None:
        _metrics.open_breakers.set(count)


@dataclasses.dataclass(frozen=True)
class QueueReading:
    """What the gauges say, as :func:`read_queue` read it."""

    #: Each lane's lag: how long its longest-waiting due delivery has waited.
    lane_lags: Mapping[str, float]
    open_breakers: int
    deliverers_alive: int
    hosts_failing: int
    hosts_told_failing: int
    hosts_unavailable: int
    #: Each configured webhook destination, by name: whether it is disabled
    #: (by the deliverer, or paused by an operator), as ``delivery_status
    #: --check`` counts it.
    destinations_disabled: Mapping[str, bool]

    @property
    def lag(self) -> float:
        return max(self.lane_lags.values(), default=0.0)


def read_queue(*, now: dt.datetime | None = None, using: str | None = None) -> QueueReading:
    """Read every gauge from the database, in at most eight queries whatever
    the size of the queue: one index read a lane (``fd_delivery_due``), the
    breakers, the heartbeats, the hosts failing and unavailable (one count
    over the hosts' table, which holds a row a host, not a delivery), and
    the configured destinations' rows by their keys."""
    # Imported here: this module is imported before Django is set up.
    from django.db.models import Count, Q
    from django.utils import timezone

    from django_federation_delivery import heartbeats, overview
    from django_federation_delivery.addresses import delivery_key, is_destination_name
    from django_federation_delivery.conf import app_settings
    from django_federation_delivery.models import Host

    now = now or timezone.now()
    alias = using or database_alias()
    lane_lags = overview.lane_lags(now=now, using=alias)
    # A webhook destination's row is named in angle brackets (its delivery
    # key); its failing is its own (see disabled, below), not a host's.
    available = Q(unavailable_since__isnull=True)
    hosts = (
        Host.objects.using(alias)
        # Only the hosts in trouble: read from their partial indexes.
        .filter(Q(failing_since__isnull=False) | Q(unavailable_since__isnull=False))
        .exclude(name__startswith="<")
        .aggregate(
            failing=Count("name", filter=Q(failing_since__isnull=False) & available),
            told=Count("name", filter=Q(failing_told_at__isnull=False) & available),
            unavailable=Count("name", filter=~available),
        )
    )
    webhooks = app_settings.get("WEBHOOKS")
    # Only names a destination may have: a URL written where its name goes
    # is no label to export (the check reports it, without it).
    given = webhooks if isinstance(webhooks, Mapping) else {}
    names = sorted(name for name in given if is_destination_name(name))
    keys = {name: delivery_key(name) for name in names}
    disabled = (
        set(
            Host.objects.using(alias)
            .filter(name__in=keys.values(), paused_at__isnull=False)
            .values_list("name", flat=True)
        )
        if keys
        else set()
    )
    return QueueReading(
        lane_lags=lane_lags,
        open_breakers=overview.open_breakers(using=alias),
        deliverers_alive=heartbeats.seen(now=now, using=alias).alive,
        hosts_failing=hosts["failing"],
        hosts_told_failing=hosts["told"],
        hosts_unavailable=hosts["unavailable"],
        destinations_disabled={name: key in disabled for name, key in keys.items()},
    )


def observe_queue(*, using: str | None = None) -> None:
    """Set every gauge from the database (:func:`read_queue`), for a deliverer
    to call every few seconds."""
    if _metrics is None:
        return
    reading = read_queue(using=using)
    set_lag(reading.lag)
    for lane, seconds in reading.lane_lags.items():
        _metrics.lane_lag.labels(lane=lane).set(seconds)
    set_open_breakers(reading.open_breakers)
    _metrics.deliverers_alive.set(reading.deliverers_alive)
    _metrics.hosts_failing.set(reading.hosts_failing)
    _metrics.hosts_told_failing.set(reading.hosts_told_failing)
    _metrics.hosts_unavailable.set(reading.hosts_unavailable)
    for name in _metrics.destinations - set(reading.destinations_disabled):
        _metrics.destination_disabled.remove(name)
    for name, disabled in reading.destinations_disabled.items():
        _metrics.destination_disabled.labels(destination=name).set(int(disabled))
    _metrics.destinations = set(reading.destinations_disabled)
    # Last, and only when every query above answered: a loop that hangs, or a
    # database away, leaves it behind, which an alert can see.
    _metrics.refreshed.set_to_current_time()


def start_server(port: int, addr: str = "127.0.0.1") -> WSGIServer:
    """Serve the metrics at ``http://addr:port/metrics`` from a daemon thread.

    Returns the server: ``shutdown()`` it to stop. Port 0 takes a free port,
    which the server's ``server_port`` tells. This machine only unless
    ``addr`` says otherwise: the figures name no secret, but hosts and rates
    are nobody else's business.
    """
    if prometheus_client is None:
        raise ImproperlyConfigured(NEEDS_CLIENT)
    family, _address = _listening(addr, port)
    server_class = type("_MetricsServer", (_MetricsServer,), {"address_family": family})
    server: WSGIServer = make_server(
        addr, port, prometheus_client.make_wsgi_app(), server_class, _MetricsHandler
    )
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    return server


def stop_server(server: WSGIServer) -> None:
    """Stop serving, and let the port go."""
    server.shutdown()
    server.server_close()


#: How long a scraper may take to send its request, and how many may be
#: answered at once: anyone who reaches the port (``--metrics-addr 0.0.0.0``)
#: could otherwise hold a thread of the deliverer's for each connection
#: that sends half a request, for as long as it likes.
CLIENT_TIMEOUT = 10.0
MOST_CLIENTS = 16


class _MetricsHandler(WSGIRequestHandler):
    def setup(self) -> None:
        super().setup()
        self.connection.settimeout(CLIENT_TIMEOUT)  # read now: a test may shorten it
        # For the whole request too: one sent a byte at a time, each within
        # the timeout, would hold its thread for as long as it liked.
        self._deadline = threading.Timer(CLIENT_TIMEOUT, self._cut)
        self._deadline.daemon = True
        self._deadline.start()

    def _cut(self) -> None:
        with contextlib.suppress(OSError):
            self.connection.shutdown(socket.SHUT_RDWR)

    def finish(self) -> None:
        self._deadline.cancel()
        super().finish()

    def log_message(self, format: str, *args: object) -> None:
        pass


class _MetricsServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._clients = threading.BoundedSemaphore(MOST_CLIENTS)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._clients.acquire(blocking=False):
            self.shutdown_request(request)  # past MOST_CLIENTS: closed at once
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._clients.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client gone or timed out: nothing to print on the deliverer's stderr


def check_address(addr: str) -> None:
    """Raises the ``OSError`` that serving on ``addr`` would, whatever the
    port (an address of none of this machine's interfaces), by binding a free
    port there for a moment, as :func:`start_server` would bind it.
    ``run_deliverer --processes`` asks before starting any child: each would
    die of it, and be started again and again."""
    family, sockaddr = _listening(addr, 0)
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.bind(sockaddr)


def _listening(addr: str, port: int) -> tuple[socket.AddressFamily, Any]:
    """The family and socket address a server listening on ``addr`` binds
    (IPv4 or IPv6, as the address is)."""
    family, _type, _proto, _name, sockaddr = socket.getaddrinfo(
        addr, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    return family, sockaddr
