"""The demo's delivery policy, and its round as a django-q2 task.

``manage.py demo`` delivers under a short retry policy and a breaker that
cools off in a second, so that it ends in seconds: in its own process
(run_deliverer) it overrides the settings itself; a ``qcluster`` runs
:func:`demo_round` instead, the package's ``deliver_round`` under the same
policy. A deployment schedules the package's round as it is
(``manage.py delivery_schedule``).
"""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.test.utils import override_settings

#: Retries 1 s, then 2 s apart, and a breaker that cools off in a second.
DEMO_RETRY = {"BASE": 1.0, "CAP": 2.0, "ATTEMPTS": 10, "JITTER": 0.25, "SCHEDULE": None}
DEMO_BREAKER = {"THRESHOLD": 10, "COOL_OFF": 1.0, "SCOPE": "host"}
ROUND_TASK = f"{__name__}.demo_round"
PING_TASK = f"{__name__}.ping"


def demo_settings() -> dict[str, Any]:
    """``FEDERATION_DELIVERY`` with the demo's retry policy and breaker."""
    return {**settings.FEDERATION_DELIVERY, "RETRY": DEMO_RETRY, "BREAKER": DEMO_BREAKER}


def demo_round(seconds: float) -> dict[str, Any]:
    """A django-q2 task: ``deliver_round(seconds)`` under the demo's policy."""
    # Imported here: the run_deliverer variant needs no django-q2.
    from django_federation_delivery.contrib.django_q import deliver_round

    with override_settings(FEDERATION_DELIVERY=demo_settings()):
        return deliver_round(seconds)


def ping() -> str:
    """A django-q2 task that does nothing: run, it shows the cluster is up."""
    return "pong"
