"""A webhook destination's life: failing, disabled, enabled again.

A destination that answers ``410 Gone`` is disabled at once, and so is one
that has failed without one success for ``WEBHOOK_DISABLE_AFTER`` (five days
by default). Disabling pauses the destination's key as an operator pauses a
host (``hosts.py``), with the reason kept beside it: its events are held, in
order, and never dropped, until it is enabled again (the admin's
destinations page, ``manage.py enable_webhook NAME``, or :func:`enable`).
``webhook_destination_disabled`` is sent once, when it is disabled.

The loop tells a :class:`Watch` what came of each webhook attempt; it writes
only when a destination's state changes (it starts failing, recovers, or is
disabled), never for each success.
"""

from __future__ import annotations

import datetime as dt
import logging
from http import HTTPStatus

from django.db import transaction
from django.db.models import Max, QuerySet
from django.utils import timezone
from django.utils.translation import gettext, ngettext

from django_federation_delivery import hosts, signals
from django_federation_delivery.attempt import AttemptResult
from django_federation_delivery.conf import database_alias
from django_federation_delivery.dialect import aware, aware_now, orm_datetime
from django_federation_delivery.models import Delivery, Host, Kind, Status
from django_federation_delivery.store import claims
from django_federation_delivery.store.locks import in_id_order
from django_federation_delivery.webhooks.destinations import delivery_key

__all__ = ["GONE", "Watch", "disable", "enable", "enabled"]

logger = logging.getLogger(__name__)

#: The status that disables a destination at once.
GONE = HTTPStatus.GONE


def disable(
    name: str, reason: str, *, now: dt.datetime | None = None, using: str | None = None
) -> bool:
    """Disable the destination ``name``: its events are held, in order, until
    :func:`enable`. Whether it was disabled now (not already paused or
    disabled); ``webhook_destination_disabled`` is then sent once, on commit."""
    alias = using or database_alias()
    key = delivery_key(name)
    # Aware, as the loop's time is, whatever USE_TZ says; naive in TIME_ZONE
    # for the ORM with USE_TZ off (SQLite's backend refuses an aware one).
    now = aware(now or timezone.now())
    at = orm_datetime(now, alias)
    manager = Host.objects.using(alias)
    with transaction.atomic(using=alias):
        changed = manager.filter(name=key, paused_at__isnull=True).update(
            paused_at=at, disabled_reason=reason, updated_at=at
        )
        if not changed:
            _host, created = manager.get_or_create(
                name=key, defaults={"paused_at": at, "disabled_reason": reason}
            )
            if not created:
                return False  # paused already, by an operator or by another deliverer
        hosts.hold(key, using=alias)
        disabled = signals.DestinationDisabled(destination=name, reason=reason, disabled_at=now)
        transaction.on_commit(lambda: _tell(disabled), using=alias)
    return True


def _tell(disabled: signals.DestinationDisabled) -> None:
    logger.warning(
        "Webhook destination %r disabled: %s. Its events wait until it is enabled "
        "again (manage.py enable_webhook %s, or the admin's destinations page).",
        disabled.destination,
        disabled.reason,
        disabled.destination,
    )
    signals.send_safely(signals.webhook_destination_disabled, disabled=disabled)


def enable(name: str, *, using: str | None = None) -> int | None:
    """Enable the destination ``name`` again (or resume it, paused): its held
    events are due now, the first in line first. Returns how many wait to
    go, in order; None, with nothing changed, if it is neither disabled nor
    paused (enabled since the page asking was loaded): its failing clock and
    its first event's retry are the deliverer's, not to be reset."""
    alias = using or database_alias()
    key = delivery_key(name)
    with transaction.atomic(using=alias):
        # Its reason for being disabled goes with the pause (resume_host).
        # The write says whether it is paused: asked first, another
        # operator's enabling could come in between. Failing no more; nor
        # unavailable, a mark only an inbox's host gets now, but a
        # destination's key could get before (availability.py): left, it was
        # shown unavailable and probed daily for ever.
        paused = Host.objects.using(alias).filter(name=key, paused_at__isnull=False)
        if not paused.update(failing_since=None, unavailable_since=None, probed_at=None):
            return None
        # By the index on a destination's pending events (its condition
        # said): by its host and status, every pending row was read.
        pending = Delivery.objects.using(alias).filter(
            destination=name, kind=Kind.WEBHOOK, status=Status.PENDING
        )
        # The first in line may have a retry of its own to wait for (it was
        # in flight when the destination was disabled): due now too, but no
        # sooner than the lease of an attempt still in flight when it was
        # given up, then requeued; before the resume, which forgets that.
        now = orm_datetime(aware_now(), alias)
        waiting = pending.filter(after__isnull=True, lease_token__isnull=True, due_at__gt=now)
        in_id_order(waiting).update(due_at=hosts.no_sooner_than_kept(now))
        hosts.resume_host(key, using=alias)
        # The first goes now, and each of the others once the one before it
        # is delivered: every one of them goes again, not the first alone.
        return pending.count()


def enabled(name: str, released: int | None) -> str:
    """What enabling ``name`` did, for the admin's message and the command:
    ``released`` as :func:`enable` returns it."""
    if released is None:
        return gettext("%(name)s is not disabled: nothing to do.") % {"name": name}
    return ngettext(
        "%(name)s enabled again: %(count)d event is due now.",
        "%(name)s enabled again: %(count)d events are due now, in order.",
        released,
    ) % {"name": name, "count": released}


class Watch:
    """What one deliverer makes of each webhook attempt for its destination's
    life. It keeps which destinations are failing (as the table had them at
    most a tenth of ``WEBHOOK_DISABLE_AFTER`` ago, a minute at most:
    ``hosts.read_failing_every``; and as it saw them since), so that a
    success writes only when one of them recovers, whichever deliverer saw
    it fail."""

    def __init__(self, disable_after: float, *, using: str | None = None) -> None:
        self.disable_after = dt.timedelta(seconds=disable_after)
        self.using = using or database_alias()
        #: How long what was read of the failing destinations is kept.
        self.read_every = hosts.read_failing_every(self.disable_after)
        #: The key of each destination failing, and since when; None until
        #: read from the table.
        self._failing: dict[str, dt.datetime] | None = None
        #: When it was read, by the loop's clock (the attempts' ``now``).
        self._read_at: dt.datetime | None = None

    def __call__(self, row: claims.Claimed, result: AttemptResult, now: dt.datetime) -> bool:
        """Take in what came of an attempt; whether it disabled the destination."""
        name = row.destination
        if not name:
            return False
        failing = self._known(now)
        if result.delivered:
            if row.host in failing:
                # With any unavailable mark left from before (see enable());
                # forgotten once written, as a host's recovery is (health.py).
                self._hosts(row.host).update(failing_since=None, unavailable_since=None)
                failing.pop(row.host, None)
            return False
        if result.status == GONE:
            failing.pop(row.host, None)
            disable(name, "the receiver answered 410 Gone", now=now, using=self.using)
            return True
        if (result.held and not result.refused_address) or not (
            result.requests or result.refused_address
        ):
            # No answer from the destination: it said nothing of itself. (Its
            # address refused, it did: its URL is its operator's.)
            return False
        since = failing.get(row.host) or hosts.failing_since(row.host, now, using=self.using)
        failing[row.host] = since
        if now - since < self.disable_after:
            return False
        # What this deliverer read may be a while old: the row's since counts
        # (none, once enabled again: failing from now), and so does another
        # deliverer's success since.
        since = hosts.failing_since(row.host, now, using=self.using)
        since = self._last_success_since(row.host, since)
        failing[row.host] = since
        if now - since < self.disable_after:
            return False
        reason = f"no success for {_span(self.disable_after)} (WEBHOOK_DISABLE_AFTER)"
        disable(name, reason, now=now, using=self.using)
        failing.pop(row.host, None)
        return True

    def _known(self, now: dt.datetime) -> dict[str, dt.datetime]:
        """The destinations failing: read from the table (another deliverer,
        or this one's last run, may have seen them fail; an operator may
        have enabled one again) at most ``read_every`` ago, or since the
        clock was set back; kept up to date by this one in between."""
        read_at = self._read_at
        if (
            self._failing is None
            or read_at is None
            or not read_at <= now < read_at + self.read_every
        ):
            self._failing = {}
            for key, failing in hosts.failing_hosts(destinations=True, using=self.using).items():
                if failing.up is None:
                    self._failing[key] = failing.since
                else:
                    # Up since it began failing: its next failure is its
                    # first (one after a quiet spell would disable it).
                    self._hosts(key).filter(hosts.UP_SINCE_FAILING).update(
                        failing_since=None, unavailable_since=None
                    )
            self._read_at = now
        return self._failing

    def _hosts(self, key: str) -> QuerySet[Host]:
        return Host.objects.using(self.using).filter(name=key)

    def _last_success_since(self, key: str, since: dt.datetime) -> dt.datetime:
        last: dt.datetime | None = (
            Delivery.objects.using(self.using)
            .filter(
                host=key, status=Status.DELIVERED, settled_at__gt=orm_datetime(since, self.using)
            )
            .aggregate(last=Max("settled_at"))["last"]
        )
        if last is None:
            return since
        self._hosts(key).update(failing_since=last)
        return aware(last)


def _span(span: dt.timedelta) -> str:
    seconds = span.total_seconds()
    return f"{seconds / 86400:g} days" if seconds >= 86400 else f"{seconds:g} s"
