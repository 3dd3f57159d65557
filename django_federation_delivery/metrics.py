"""Prometheus metrics of the deliverer, with the optional ``prometheus`` extra.

The deliverer calls :func:`record_attempt` after each attempt and refreshes
the gauges with :func:`observe_queue` (or :func:`set_lag` and
:func:`set_open_breakers`); ``run_deliverer --metrics-port`` serves them with
:func:`start_server`. Without ``prometheus_client`` installed every recording
function does nothing, so that the deliverer may call them unconditionally,
and :func:`start_server` raises ``ImproperlyConfigured``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from django.core.exceptions import ImproperlyConfigured
from django.utils.translation import gettext_noop

from django_federation_delivery.decide import Outcome

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

try:
    import prometheus_client
except ImportError:  # pragma: no cover - exercised where the extra is not installed
    prometheus_client = None  # type: ignore[assignment]

__all__ = [
    "OUTCOMES",
    "available",
    "observe_queue",
    "record_attempt",
    "set_lag",
    "set_open_breakers",
    "start_server",
]

#: What an attempt can come to, as ``delivery_attempted`` reports it.
OUTCOMES = (Outcome.DELIVERED, Outcome.RETRYING, Outcome.HELD, Outcome.REFUSED, Outcome.FAILED)
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
        self.duration = prometheus_client.Histogram(
            f"{PREFIX}_attempt_duration_seconds",
            "How long delivery attempts took, in seconds.",
            buckets=DURATION_BUCKETS,
        )
        self.lag = prometheus_client.Gauge(
            f"{PREFIX}_lag_seconds",
            "How long the longest-waiting due delivery has waited, in seconds.",
        )
        self.open_breakers = prometheus_client.Gauge(
            f"{PREFIX}_open_breakers",
            "Circuit breakers open or half-open: destinations whose deliveries are held.",
        )


# Registered once, in the default registry, where a host project's own
# exporter (django-prometheus, say) finds them too.
_metrics = _Metrics() if prometheus_client is not None else None


def available() -> bool:
    """Whether ``prometheus_client`` is installed."""
    return _metrics is not None


def record_attempt(outcome: str, duration: float) -> None:
    """Count one attempt that came to ``outcome`` (one of :data:`OUTCOMES`)
    and took ``duration`` seconds."""
    if outcome not in OUTCOMES:
        # A label per typo would make a new time series each.
        raise ValueError(f"unknown outcome {outcome!r}; expected one of {', '.join(OUTCOMES)}")
    if _metrics is None:
        return
    _metrics.attempts_by_outcome[outcome].inc()
    _metrics.duration.observe(max(duration, 0.0))


def set_lag(seconds: float) -> None:
    """How long the longest-waiting due delivery has waited, in seconds."""
    if _metrics is not None:
        _metrics.lag.set(max(seconds, 0.0))


def set_open_breakers(count: int) -> None:
    """How many circuit breakers are open or half-open."""
    if _metrics is not None:
        _metrics.open_breakers.set(count)


def observe_queue(*, using: str | None = None) -> None:
    """Set both gauges from the database: four small indexed queries, for a
    deliverer to call every few seconds."""
    if _metrics is None:
        return
    from django_federation_delivery import overview

    set_lag(overview.lag(using=using))
    set_open_breakers(overview.open_breakers(using=using))


def start_server(port: int, addr: str = "127.0.0.1") -> WSGIServer:
    """Serve the metrics at ``http://addr:port/metrics`` from a daemon thread.

    Returns the server: ``shutdown()`` it to stop. Port 0 takes a free port,
    which the server's ``server_port`` tells. This machine only unless
    ``addr`` says otherwise: the figures name no secret, but hosts and rates
    are nobody else's business.
    """
    if prometheus_client is None:
        raise ImproperlyConfigured(NEEDS_CLIENT)
    server, _thread = prometheus_client.start_http_server(port, addr=addr)
    return server
