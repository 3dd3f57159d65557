"""Sending a host again what it was sent: after it was restored from a backup,
or misconfigured for a while.

:func:`replay` queues again, in new batches, every delivery to one host (or
webhook destination) that was delivered or given up since a moment: one new
batch for each batch they came from, with its body, its sender, its event
and what it is about as they were, so that a receiver de-duplicating by id
sees the same ids, and a ``Delete`` or ``Undo`` sent later overtakes what
of it was never tried as it would the original; what one sent before took
back is not replayed, and one replayed goes, as it would requeued, only
after what it retracts still pending at the inbox. Each inbox receives them
in their original order, one after the other (an ordering key of the
replay's own; a destination's own sequence for a webhook destination), in
the low lane for activities, so that a catch-up never delays what is sent
live. Replayed again for the same host and moment while the new batches
are kept, it queues nothing more (their idempotency keys), delivered or
not: what a replay wrote is never itself replayed, nor what was settled
after the first run. A copy keeps its batch's deadline and most attempts;
a batch past its deadline, and an event to a destination no longer
configured, are not replayed.
"""

from __future__ import annotations

import datetime as dt
import functools
import hashlib

from django.core.exceptions import ImproperlyConfigured
from django.db import transaction
from django.db.models import Count, Exists, Min, OuterRef, Q, QuerySet
from django.utils.translation import gettext as _
from django.utils.translation import ngettext

from django_federation_delivery import tracing
from django_federation_delivery.addresses import host_named, quoted, quoted_name, required_host
from django_federation_delivery.channels import Destination
from django_federation_delivery.channels.base import policy_of
from django_federation_delivery.channels.policy import LANES, PolicyError
from django_federation_delivery.conf import database_alias
from django_federation_delivery.dialect import aware_now, orm_datetime
from django_federation_delivery.models import Batch, Delivery, Host, Kind, Lane, Retracts, Status
from django_federation_delivery.store import queueing, retractions, sequences
from django_federation_delivery.store.claims import stored_gateways
from django_federation_delivery.store.locks import again_on_deadlock, write_first
from django_federation_delivery.webhooks.destinations import configured, delivery_key
from django_federation_delivery.webhooks.sending import ORDERING_KEY as WEBHOOK_ORDERING_KEY

__all__ = ["REPLAYED", "ever_sent", "replay", "replayed"]

#: What is sent again: what reached the host, and what was given up on it.
REPLAYED = (Status.DELIVERED, Status.FAILED)

#: The batches replayed a step: what a replay holds in memory at once (their
#: bodies among it), however much it replays.
STEP = 500

#: How a batch a replay wrote begins its idempotency key, and its tag: what
#: tells it from a send's with no column of its own.
KEY_PREFIX = retractions.REPLAY_KEY_PREFIX
TAG_PREFIX = retractions.REPLAY_TAG_PREFIX


def replay(
    *,
    host: str = "",
    destination: str = "",
    since: dt.datetime,
    using: str | None = None,
) -> list[Batch]:
    """Queue again what was delivered to ``host`` (an inbox's host, in any
    form, or a URL on it) or ``destination`` (a webhook destination's name),
    or given up on it, since ``since``; returns the new batches, oldest
    first. ``ValueError`` unless exactly one of ``host`` and ``destination``
    is given, for a ``host`` or ``destination`` that names none (or a
    destination no longer configured), or for a ``since`` that is no aware
    datetime, or off the calendar."""
    if bool(host) == bool(destination):
        raise ValueError("replay needs a host or a destination, and not both")
    if destination and not (isinstance(destination, str) and destination.isprintable()):
        # No destination's name holds a control character, nor is anything but text.
        raise ValueError(
            f"replay needs a webhook destination's name, not {quoted_name(destination)}"
        )
    if destination and destination not in _sendable_destinations():
        # Queued, its copies would each be given up at once, unattempted.
        raise ValueError(
            f"no webhook destination named {quoted_name(destination)} is configured: "
            "nothing would send its events again"
        )
    key = required_host(host, "replay") if host else delivery_key(destination)
    return replay_host(key, since=since, using=using)


def to_replay(keys: list[str], *, since: dt.datetime, using: str | None = None) -> dict[str, int]:
    """How many deliveries :func:`replay_host` of each of ``keys`` would queue
    again, for each key that has any: one count on the index of (host,
    status), each row's batch read by its primary key (see
    :func:`_replayable`). A count a :data:`~store.queueing.CHUNK` of keys:
    the admin's "select all" may name more hosts than SQLite takes
    parameters in a statement, most of them with nothing to replay."""
    manager = Delivery.objects.using(using or database_alias())
    counts: dict[str, int] = {}
    for start in range(0, len(keys), queueing.CHUNK):
        matching = _replayable(
            manager.filter(
                host__in=keys[start : start + queueing.CHUNK],
                status__in=REPLAYED,
                settled_at__gte=orm_datetime(since, using),
            )
        )
        counts.update(matching.values_list("host").annotate(count=Count("id")).order_by())
    return counts


def replay_host(key: str, *, since: dt.datetime, using: str | None = None) -> list[Batch]:
    """:func:`replay` for the deliveries whose host is exactly ``key``, as a
    ``Host`` row names it (the admin's action): read as it is, whatever it holds."""
    if not isinstance(since, dt.datetime):
        raise ValueError(f"since must be a datetime, not {quoted(since)}")
    if since.tzinfo is None:
        raise ValueError(f"since must carry its time zone, not {since.isoformat()}")
    try:
        # In UTC: one moment is one replay (its keys), whatever its offset.
        since = since.astimezone(dt.UTC)
    except OverflowError:
        raise ValueError(f"since {since.isoformat()} falls outside the calendar in UTC") from None
    alias = database_alias(using)
    try:
        # On SQLite with USE_TZ off, in TIME_ZONE: a day off UTC's.
        after = orm_datetime(since, alias)
    except OverflowError:
        raise ValueError(f"since {since.isoformat()} falls outside the calendar") from None

    def write() -> list[Batch]:
        replayed: list[Batch] = []
        with transaction.atomic(using=alias):
            # On SQLite, its write lock before its reads: read first, another
            # connection's write in between (a deliverer settling, a view
            # sending, another replay) made its first write fail at once,
            # "database is locked", instead of waiting its turn.
            write_first(alias)
            # Read in the transaction: a retraction sent since is seen.
            settled = Delivery.objects.using(alias).filter(
                host=key, status__in=REPLAYED, settled_at__gte=after
            )
            chosen = _replayable(settled, host=key)
            batch_ids = _in_order(chosen)
            # An earlier run is looked for by all it may have replayed: what
            # it did is left out now (a retraction took it back since, its
            # deadline passed), and what went live since was replayed as new.
            earlier = _replayed_before(key, since, _in_order(settled), alias)
            if earlier:
                # Run again: what the first run replayed, no more, by its
                # keys. What was settled since was sent live to a host
                # already restored; by time, one settled as the first run
                # wrote, or in the hour a clock goes back through, was not.
                batch_ids = [batch_id for batch_id in batch_ids if batch_id in earlier]
            for start in range(0, len(batch_ids), STEP):
                step = batch_ids[start : start + STEP]
                replayed += _replay_step(key, since, chosen.filter(batch_id__in=step), alias)
        return replayed

    # A step locks the last delivery of each sequence it adds to, and what
    # a retraction it copies waits on, step after step: PostgreSQL may end
    # it to undo a deadlock with a deliverer's settle or an operator's
    # action, and it is then made again, from the start.
    return again_on_deadlock(alias, write)


def _in_order(deliveries: QuerySet[Delivery]) -> list[int]:
    """The batches of ``deliveries``, in the order their first delivery was sent in."""
    return list(
        deliveries.values("batch_id")
        .annotate(first=Min("id"))
        .order_by("first")
        .values_list("batch_id", flat=True)
    )


def _replayed_before(key: str, since: dt.datetime, batch_ids: list[int], alias: str) -> set[int]:
    """Those of ``batch_ids`` an earlier replay of ``key`` since ``since``
    wrote a batch for that is still kept (found by its idempotency key): a
    step of keys at a time."""
    found: set[int] = set()
    for start in range(0, len(batch_ids), queueing.CHUNK):
        keys = {
            _replay_key(f"{batch_id}\n{key}", since): batch_id
            for batch_id in batch_ids[start : start + queueing.CHUNK]
        }
        kept = Batch.objects.using(alias).filter(idempotency_key__in=list(keys))
        found.update(
            keys[idempotency_key]
            for idempotency_key in kept.values_list("idempotency_key", flat=True)
        )
    return found


def _sendable_destinations() -> set[str]:
    """The names of the webhook destinations configured now; none if
    ``WEBHOOKS`` itself is malformed (the system checks say so)."""
    try:
        return set(configured().names)
    except ImproperlyConfigured:
        return set()


def _replayable(deliveries: QuerySet[Delivery], *, host: str = "") -> QuerySet[Delivery]:
    """``deliveries`` less those of the batches a replay wrote, and of those
    a retraction sent since took back.

    Once a replay's batch was delivered, it too was sent since the moment:
    replayed again, the same moment's replay would send its body a third
    time under a key of its own, and each later run another copy. What it
    came from is replayed, once (its key).

    A batch its sender's later ``Delete`` (of what it is about) or ``Undo``
    (of it) took back is not sent again, whether the retraction went to the
    host or left it out (unavailable then): it would land after the
    retraction, or before one still waiting for its retry, or bring back
    to a host that never had it what was deleted or undone. A retraction
    superseded at the host (undone before it went) took nothing back
    there. The retraction, if it was sent to the host since the moment,
    is replayed itself.

    Given the ``host`` all of ``deliveries`` go to (a replay's), the
    retractions are read once, and the batches they took back left out by
    their ids (:func:`_retracted_at`); else each delivery asks (the
    admin's counts of many hosts)."""
    # Both its key and its tag: a send given either alone is still replayed.
    # Read through the batch's primary key, one lookup a delivery matched.
    mine = deliveries.exclude(
        batch__idempotency_key__startswith=KEY_PREFIX, batch__tag__startswith=TAG_PREFIX
    )
    now = orm_datetime(aware_now(), deliveries.db)
    gone = Q(kind=Kind.WEBHOOK) & ~Q(destination__in=_sendable_destinations())
    if host:
        taken_back = _retracted_at(mine, host)
        return mine.exclude(batch_id__in=taken_back).exclude(batch__deadline__lte=now).exclude(gone)
    # Each by the partial index on what the retraction names (its condition
    # written out): a few rows for an object, whatever the table holds. A
    # retraction superseded at this host (undone before it went), or undone
    # since and never sent here, took nothing back here; a replay's copy of
    # one is none.
    here = Delivery.objects.filter(batch_id=OuterRef("pk"), host=OuterRef(OuterRef("host")))
    undone = Batch.objects.filter(
        id__gt=OuterRef("pk"),
        sender=OuterRef("sender"),
        retracts=Retracts.ACTIVITY,
        object_id=OuterRef("activity_id"),
        object_id__gt="",
    ).exclude(idempotency_key__startswith=KEY_PREFIX, tag__startswith=TAG_PREFIX)
    later = (
        Batch.objects.filter(
            id__gt=OuterRef("batch_id"), sender=OuterRef("batch__sender"), object_id__gt=""
        )
        .exclude(idempotency_key__startswith=KEY_PREFIX, tag__startswith=TAG_PREFIX)
        .exclude(Exists(here.filter(status=Status.SUPERSEDED)))
        .exclude(~Exists(here) & Exists(undone))
    )
    deleted = later.filter(retracts=Retracts.OBJECT, object_id=OuterRef("batch__object_id"))
    undid = later.filter(retracts=Retracts.ACTIVITY, object_id=OuterRef("batch__activity_id"))
    # Nor what no deliverer would send: a batch past its deadline (its
    # requeue is refused too), an event to a destination no longer configured.
    # A retraction is taken back by an Undo of it alone, not by a later
    # Delete of the object it deletes too.
    return (
        mine.exclude(Q(batch__retracts=Retracts.NOTHING) & Exists(deleted))
        .exclude(Exists(undid))
        .exclude(batch__deadline__lte=now)
        .exclude(gone)
    )


def _retracted_at(deliveries: QuerySet[Delivery], host: str) -> list[int]:
    """The batches of ``deliveries`` that a later retraction of their sender
    took back at ``host`` (``retractions.retracted_at_host``): two
    statements, however many. Asked of each delivery, each read the
    retraction's batch through its index on (batch, status) until it found
    the host: 2,000 rows replayed, each about a post later deleted by a
    Delete to 10,000 inboxes, took 2 s."""
    batches = deliveries.values_list("batch_id", flat=True).distinct().order_by()
    return sorted(retractions.retracted_at_host(batches, host, using=deliveries.db))


def _replay_step(
    key: str, since: dt.datetime, deliveries: QuerySet[Delivery], alias: str
) -> list[Batch]:
    """One step of a replay: its batches written, each inbox's first new
    delivery waiting on the last one before it (an earlier step's, or what
    its sequence had pending), and the others chained behind it."""
    rows = deliveries.order_by("id").values_list(
        "batch_id", "inbox", "host", "via", "destination", "kind"
    )
    by_batch: dict[int, list[queueing.Queued]] = {}
    kinds: dict[int, str] = {}
    lanes: dict[int, Lane] = {}
    way = functools.cache(_webhook_way)
    for batch_id, inbox, row_host, via, row_destination, kind in rows:
        gateways = stored_gateways(via)
        if gateways is None:
            # Gateways written by hand as no list of URLs: no attempt could
            # use them, as the loop that failed the row found.
            continue
        # A webhook event goes as its destination's kind says now, as a send
        # would: in its order or not, in its lane.
        ordered, lane = way(row_destination) if kind == Kind.WEBHOOK else (True, Lane.LOW)
        by_batch.setdefault(batch_id, []).append(
            queueing.Queued(inbox, row_host, gateways, row_destination, ordered)
        )
        kinds[batch_id] = kind
        lanes[batch_id] = min(lanes.get(batch_id, lane), lane, key=LANES.index)
    batches = Batch.objects.using(alias).in_bulk(list(by_batch))
    # A webhook event waits its turn in its destination's own sequence; an
    # activity in the replay's, in the low lane.
    keys = {
        batch_id: WEBHOOK_ORDERING_KEY if kind == Kind.WEBHOOK else _replay_key(key, since)
        for batch_id, kind in kinds.items()
    }
    # Each sequence is locked, and what its first new delivery waits on
    # looked up, once; the others are chained to the one before them once
    # all are written: the step's batches written together, with no lookup.
    first_waits: dict[str, dict[str, int]] = {}
    for ordering_key in sorted(set(keys.values())):
        inboxes = sorted(
            {
                item.inbox
                for other, queued in by_batch.items()
                if keys[other] == ordering_key
                for item in queued
            }
        )
        sequences.lock_sequences(ordering_key, inboxes, alias)
        first_waits[ordering_key] = sequences.last_of_sequences(ordering_key, None, inboxes, alias)
    items = []
    for batch_id, queued in by_batch.items():
        original = batches.get(batch_id)
        if original is None:
            # Purged since its deliveries were read, with them: nothing is
            # left of it to send again.
            continue
        new = Batch(
            sender=original.sender,
            body=original.body,
            body_sha256=original.body_sha256,
            tag=f"{TAG_PREFIX}{original.pk}",
            ordering_key=keys[batch_id],
            lane=lanes[batch_id],
            synchronize_collection=original.synchronize_collection,
            event_type=original.event_type,
            event_id=original.event_id,
            # About what its original was about: a Delete (or Undo) sent
            # later overtakes it while it was never tried, as it would
            # the original, rather than reaching the inbox before it.
            activity_id=original.activity_id,
            object_id=original.object_id,
            retracts=original.retracts,
            idempotency_key=_replay_key(f"{original.pk}\n{key}", since),
            # Given up as its original would be: the same deadline (not
            # passed: see _replayable) and the same most attempts.
            deadline=original.deadline,
            max_attempts=original.max_attempts,
            # Its attempts' spans are children of the replay's.
            trace_context=tracing.carried(),
        )
        items.append(queueing.Enqueued(new, queued, kinds[batch_id]))
    replayed = queueing.enqueue_all(items, waits_on=first_waits, using=alias)
    # A retraction's copy goes after what it retracts still pending at its
    # inbox (a Create retrying there), as the retraction requeued would:
    # due at once, it reached the inbox first. One waiting its turn among
    # the replay's waits on that turn first, and on what it retracts once
    # released (a release makes a retraction's wait again).
    retractions.wait_on_retracted(
        [new.pk for new in replayed if new.created and new.retracts], using=alias
    )
    for new in replayed:
        # What is returned keeps no body: a replay of 100,000 batches holds
        # one step's bodies at a time. Read, it is loaded as a deferred field is.
        new.__dict__.pop("body", None)
    return replayed


def _webhook_way(name: str) -> tuple[bool, Lane]:
    """What the kind of the webhook destination ``name`` asks of a replay of
    its events, as of a send: whether they keep their order, and their lane.
    A destination no longer configured, or whose kind's policy cannot be
    had, as a built-in kind's: in order, in the webhook lane."""
    try:
        destination = configured().lookup(name)
        if not isinstance(destination, Destination):
            return True, Lane.WEBHOOK
        policy = policy_of(destination.channel)
    except (ImproperlyConfigured, PolicyError):
        return True, Lane.WEBHOOK
    return policy.ordered, Lane(policy.lane)


def ever_sent(*, host: str = "", destination: str = "", using: str | None = None) -> bool:
    """Whether ``host`` (in any form) or ``destination`` has a delivery in
    the queue, or a row of its own: whether a replay to it that finds
    nothing found nothing to send, rather than the wrong name."""
    key = host_named(host) if host else delivery_key(destination)
    alias = using or database_alias()
    return bool(key) and (
        Delivery.objects.using(alias).filter(host=key).exists()
        or Host.objects.using(alias).filter(name=key).exists()
    )


def replayed(batches: list[Batch]) -> str:
    """What a replay queued, as the command and the admin say it: the
    batches it wrote, not those an earlier replay of the same moment wrote
    and it returned again."""
    new = [batch for batch in batches if batch.created]
    deliveries = sum(batch.size for batch in new)
    said = _("Queued again: %(deliveries)s, in %(batches)s.") % {
        "deliveries": ngettext("%(count)d delivery", "%(count)d deliveries", deliveries)
        % {"count": deliveries},
        "batches": ngettext("%(count)d new batch", "%(count)d new batches", len(new))
        % {"count": len(new)},
    }
    earlier = len(batches) - len(new)
    if earlier:
        said += " " + ngettext(
            "%(count)d batch was queued by an earlier replay of the same moment.",
            "%(count)d batches were queued by an earlier replay of the same moment.",
            earlier,
        ) % {"count": earlier}
    return said


def _replay_key(what: str, since: dt.datetime) -> str:
    """A replay's key for ``what``: the same for one moment, however it was
    written. ``since`` in UTC is written "+00:00", as the keys replays made
    before it was read in UTC wrote a moment given in UTC: those are known again."""
    moment = since.astimezone(dt.UTC).isoformat()
    digest = hashlib.sha256(f"{what}\n{moment}".encode()).hexdigest()
    return f"{KEY_PREFIX}{digest[:40]}"
