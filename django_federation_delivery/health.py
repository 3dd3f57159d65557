"""A host's health: since when it has been failing, told once each way.

A host fails when an attempt at it gets no answer, or a 5xx or 429; any
other answer, a refusal included, says it is up. The first failure after it
was up is written on its ``Host`` row (``failing_since``). Failing for
``HOST_FAILING_AFTER`` (an hour by default), ``host_failing`` is sent; up
again after that, ``host_recovered``. Up, a host marked unavailable is seen
again, as ``mark_host_seen`` sees it (``availability.seen``): both marks
are cleared together. Each once a change, however many
deliverers see it: a row's ``failing_told_at`` is claimed by the one update
that sets it, or clears it.

The loop tells a :class:`HostWatch` what came of each attempt at an inbox.
It writes only when a host's state changes (it starts failing, is told
failing, recovers), never for each success: it keeps which hosts are
failing, read from the ``Host`` table as it first looks and again every
tenth of ``HOST_FAILING_AFTER`` (a minute at most:
``hosts.read_failing_every``), and as it sees them in between. So a host
another deliverer saw fail is cleared by this one's next success, and one
seen again (``mark_host_seen``, the daily probe, the admin) is failing
again, told again, and can be marked unavailable again, from this one's
next failure. One another deliverer delivered to while it had it failing
(that one's view did not, so its success cleared nothing) is cleared as the
table is read, and its next failure is its first: its clock is never
counted from before a success by more than that while. Telling a host
failing, it asks the table first: one that was cleared, or started failing
again later, since it was read is not told from the old failure.
"""

from __future__ import annotations

import datetime as dt
import logging

from django.db import transaction
from django.db.models import QuerySet

from django_federation_delivery import availability, signals
from django_federation_delivery.attempt import AttemptResult
from django_federation_delivery.conf import database_alias
from django_federation_delivery.dialect import aware, orm_datetime
from django_federation_delivery.hosts import (
    UP_AT,
    UP_SINCE_FAILING,
    failing_hosts,
    failing_since,
    read_failing_every,
)
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
        #: How long what was read of the failing hosts is kept.
        self.read_every = read_failing_every(self.failing_after)
        #: Each host seen failing, since when, and whether it was told so;
        #: None until read from the table.
        self._failing: dict[str, tuple[dt.datetime, bool]] | None = None
        #: When it was read, by the loop's clock (the attempts' ``now``).
        self._read_at: dt.datetime | None = None

    def __call__(self, row: claims.Claimed, result: AttemptResult, now: dt.datetime) -> bool:
        """Take in what came of an attempt at ``row``'s host. Never stops the
        host taking deliveries: always False (see ``Settler.watch``)."""
        failing = is_failure(result)
        if failing is None:
            return False
        host = row.host
        known = self._known(now)
        if not failing:
            if host in known:
                # Forgotten once written: a write the database missed is
                # made again by the host's next success.
                self._recovered(host, now)
                known.pop(host, None)
            return False
        since, told = known.get(host) or (failing_since(host, now, using=self.using), False)
        if not told and now - since >= self.failing_after:
            since, told = self._tell_failing(host, result.error, now)
        known[host] = (since, told)
        return False

    def _known(self, now: dt.datetime) -> dict[str, tuple[dt.datetime, bool]]:
        """The hosts failing, as the table had them at most ``read_every``
        ago (or, the clock set back, since): one query that often, at an
        attempt, never one an attempt."""
        read_at = self._read_at
        if (
            self._failing is None
            or read_at is None
            or not read_at <= now < read_at + self.read_every
        ):
            self._failing = {}
            for name, failing in failing_hosts(using=self.using).items():
                if failing.up is None:
                    self._failing[name] = (failing.since, failing.told is not None)
                else:
                    # Up since it began failing: its next failure is its
                    # first, not one its failing clock had counted from
                    # before (a host failing without a break would be told
                    # only when found so, an hour late).
                    availability.seen(
                        name, now=failing.up, using=self.using, marked=UP_SINCE_FAILING
                    )
            self._read_at = now
        return self._failing

    def _hosts(self, host: str) -> QuerySet[Host]:
        return Host.objects.using(self.using).filter(name=host)

    def _tell_failing(self, host: str, error: str, now: dt.datetime) -> tuple[dt.datetime, bool]:
        """Tell ``host`` failing, once however many deliverers see it: if its
        row says it has failed for ``failing_after`` and no one told it yet.
        What the row says of it then: since when it fails, and whether it
        was told. This deliverer's view may be a while old (``read_every``):
        the host may have been seen again since, or have failed again later."""
        old_enough = orm_datetime(now - self.failing_after, self.using)  # naive, with USE_TZ off
        with transaction.atomic(using=self.using):
            claimed = (
                self._hosts(host)
                .filter(failing_since__lte=old_enough, failing_told_at__isnull=True)
                # Nor one another deliverer has delivered to since (see below).
                .exclude(UP_SINCE_FAILING)
                .update(failing_told_at=orm_datetime(now, self.using))
            )
            found = self._hosts(host).values_list("failing_since", "failing_told_at", UP_AT).first()
            if claimed and found is not None and found[0] is not None:
                began = aware(found[0])
                failing = signals.HostFailing(host=host, failing_since=began, error=error)
                transaction.on_commit(lambda: _tell_failing(failing), using=self.using)
                return began, True
        since, told, delivered = found if found is not None else (None, None, None)
        if since is not None and delivered is not None:
            # Delivered to since it began failing, by a deliverer whose view
            # (read_every) did not have it failing, so that its success
            # cleared nothing: up then, and this failure its first.
            availability.seen(host, now=aware(delivered), using=self.using, marked=UP_SINCE_FAILING)
            return failing_since(host, now, using=self.using), False
        if since is None:
            # Seen again since it was read: this failure is its first.
            return failing_since(host, now, using=self.using), False
        return aware(since), told is not None

    def _recovered(self, host: str, now: dt.datetime) -> None:
        # Up, as mark_host_seen has it: failing no more and, if it was marked
        # unavailable, no longer skipped by sends (it was until its next
        # probe, up to a day on); host_recovered once, if told failing.
        availability.seen(host, now=now, using=self.using)


def _tell_failing(failing: signals.HostFailing) -> None:
    logger.warning(
        "Host %s failing since %s: %s",
        failing.host,
        failing.failing_since.isoformat(timespec="seconds"),
        failing.error,
    )
    signals.send_safely(signals.host_failing, failing=failing)
