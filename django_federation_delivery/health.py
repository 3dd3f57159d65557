"""A host's health: since when it has been failing, told once each way.

A host fails when an attempt at it gets no answer, or a 5xx or 429; any
other answer, a refusal included, says it is up. The first failure after it
was up is written on its ``Host`` row (``failing_since``). Failing for
``HOST_FAILING_AFTER`` (an hour by default), ``host_failing`` is sent; up
again after that, ``host_recovered``. Each once a change, however many
deliverers see it: a row's ``failing_told_at`` is claimed by the one update
that sets it, or clears it.

The loop tells a :class:`HostWatch` what came of each attempt at an inbox.
It writes only when a host's state changes (it starts failing, is told
failing, recovers), never for each success: it keeps which hosts are
failing, read once from the ``Host`` table as it first looks, then as it
sees them. A host another deliverer started seeing failing since then, and
this one sees up, is cleared by the next deliverer that sees it both ways.
"""

from __future__ import annotations

import datetime as dt
import logging

from django.db import transaction
from django.db.models import QuerySet

from django_federation_delivery import signals
from django_federation_delivery.attempt import AttemptResult
from django_federation_delivery.conf import database_alias
from django_federation_delivery.dialect import orm_datetime
from django_federation_delivery.hosts import failing_hosts, failing_since
from django_federation_delivery.models import Host
from django_federation_delivery.store import claims

__all__ = ["HostWatch", "is_failure"]

logger = logging.getLogger("django_federation_delivery.deliverer")


def is_failure(result: AttemptResult) -> bool | None:
    """Whether ``result`` says its host is failing; None when it says nothing
    (no request was made, or the answer was another host's: a portable
    inbox's later gateway, which anyone may list)."""
    if result.held or not result.requests or result.elsewhere:
        return None
    if result.delivered:
        return False
    return result.status is None or result.status >= 500 or result.status == 429


class HostWatch:
    """What one deliverer makes of each inbox attempt for its host's health."""

    def __init__(self, failing_after: float, *, using: str | None = None) -> None:
        self.failing_after = dt.timedelta(seconds=failing_after)
        self.using = using or database_alias()
        #: Each host seen failing, since when, and whether it was told so;
        #: None until read from the table.
        self._failing: dict[str, tuple[dt.datetime, bool]] | None = None

    def __call__(self, row: claims.Claimed, result: AttemptResult, now: dt.datetime) -> bool:
        """Take in what came of an attempt at ``row``'s host. Never stops the
        host taking deliveries: always False (see ``Settler.watch``)."""
        failing = is_failure(result)
        if failing is None:
            return False
        host = row.host
        known = self._known()
        if not failing:
            if host in known:
                self._recovered(host, known.pop(host)[0], now)
            return False
        since, told = known.get(host) or (failing_since(host, now, using=self.using), False)
        if not told and now - since >= self.failing_after:
            told = True
            self._tell_failing(host, since, result.error, now)
        known[host] = (since, told)
        return False

    def _known(self) -> dict[str, tuple[dt.datetime, bool]]:
        """The hosts failing, as the table had them when first asked."""
        if self._failing is None:
            self._failing = {
                name: (since, told is not None)
                for name, (since, told) in failing_hosts(using=self.using).items()
            }
        return self._failing

    def _hosts(self, host: str) -> QuerySet[Host]:
        return Host.objects.using(self.using).filter(name=host)

    def _tell_failing(self, host: str, since: dt.datetime, error: str, now: dt.datetime) -> None:
        with transaction.atomic(using=self.using):
            claimed = (
                self._hosts(host)
                .filter(failing_told_at__isnull=True)
                .update(failing_told_at=orm_datetime(now))  # naive, with USE_TZ off
            )
            if claimed:
                failing = signals.HostFailing(host=host, failing_since=since, error=error)
                transaction.on_commit(lambda: _tell_failing(failing), using=self.using)

    def _recovered(self, host: str, since: dt.datetime, now: dt.datetime) -> None:
        with transaction.atomic(using=self.using):
            told = (
                self._hosts(host)
                .filter(failing_told_at__isnull=False)
                .update(failing_since=None, failing_told_at=None)
            )
            if not told:
                self._hosts(host).update(failing_since=None)
            else:
                recovered = signals.HostRecovered(host=host, failing_since=since, recovered_at=now)
                transaction.on_commit(lambda: _tell_recovered(recovered), using=self.using)


def _tell_failing(failing: signals.HostFailing) -> None:
    logger.warning(
        "Host %s failing since %s: %s",
        failing.host,
        failing.failing_since.isoformat(timespec="seconds"),
        failing.error,
    )
    signals.send_safely(signals.host_failing, failing=failing)


def _tell_recovered(recovered: signals.HostRecovered) -> None:
    logger.warning(
        "Host %s up again after failing since %s",
        recovered.host,
        recovered.failing_since.isoformat(timespec="seconds"),
    )
    signals.send_safely(signals.host_recovered, recovered=recovered)
