"""The enqueue side: ``send`` and ``send_batch``.

Everything is checked before anything is written, and what is written goes
into the caller's transaction: rolled back, nothing is queued.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import logging
import unicodedata
from collections.abc import Iterable, Mapping
from typing import Any

from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import transaction
from django.utils import timezone

from django_federation_delivery import addresses, availability, portable, retractions, tracing
from django_federation_delivery.addresses import host_of, normalize_inbox, quoted
from django_federation_delivery.channels.events import (
    MAX_DEPTH,
    colliding_key,
    nested_deeper,
    not_json,
)
from django_federation_delivery.conf import app_settings, database_alias
from django_federation_delivery.dialect import aware, aware_now, naive_zone
from django_federation_delivery.exceptions import InvalidDelivery
from django_federation_delivery.models import Batch, Kind, Lane, Retracts, SkippedInbox
from django_federation_delivery.portable import PortableInbox
from django_federation_delivery.signatures import body_sha256
from django_federation_delivery.store import queueing
from django_federation_delivery.store.retractions import REPLAY_TAG_PREFIX
from django_federation_delivery.store.sequences import lock_sequences

__all__ = [
    "BatchOptions",
    "SkippedInbox",
    "asend",
    "asend_batch",
    "asend_portable",
    "host_of",
    "normalize_inbox",
    "send",
    "send_batch",
    "send_portable",
]

logger = logging.getLogger(__name__)

TAG_LENGTH = Batch._meta.get_field("tag").max_length or 200
ORDERING_KEY_LENGTH = Batch._meta.get_field("ordering_key").max_length or 500
IDEMPOTENCY_KEY_LENGTH = Batch._meta.get_field("idempotency_key").max_length or 200
URL_LENGTH = 2048
#: The most ``max_attempts`` can be: what the column holds on every database.
MAX_ATTEMPTS = 2**31 - 1
#: What a sender must not hold: control characters (C0, DEL, C1), format
#: characters (a bidi override, a zero-width joiner) and the line and
#: paragraph separators, which a terminal showing a log may act on.
_CONTROL_CATEGORIES = frozenset(("Cc", "Cf", "Zl", "Zp"))
#: The activity as it is stored and sent: compact, UTF-8 as it is. One
#: encoder for every send, rather than one built by ``json.dumps`` at each.
_JSON = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), allow_nan=False)


@dataclasses.dataclass(frozen=True)
class BatchOptions:
    """What the deliveries of one send share."""

    #: A label to follow the batch by (in the admin, in signals).
    tag: str = ""
    #: An aware datetime, or a timedelta from now: a delivery not through by
    #: then is given up, and one that would next be tried after it at once.
    deadline: dt.datetime | dt.timedelta | None = None
    #: Each delivery is tried at most this often, when fewer than the retry
    #: policy allows; the backoff stays the policy's.
    max_attempts: int | None = None
    #: Claimed only when nothing else is due.
    low_priority: bool = False
    #: Deliveries sent with the same key reach each inbox in the order they
    #: were queued: the next waits until the one before it settles. Typically
    #: the object an activity is about, so its Delete cannot overtake its Create.
    ordering_key: str = ""
    #: Each delivery carries a Collection-Synchronization header (FEP-8fcf),
    #: written by the COLLECTION_SYNCHRONIZATION setting's callable.
    synchronize_collection: bool = False
    #: Sent again with the same key while the first batch is kept, the send
    #: queues nothing and returns that batch: a request its client retried
    #: does not fan out twice. Typically the id of what the request created.
    idempotency_key: str = ""


_OPTION_NAMES = frozenset(field.name for field in dataclasses.fields(BatchOptions))


def send(
    sender: str,
    activity: Mapping[str, Any],
    inboxes: Iterable[str],
    *,
    idempotency_key: str = "",
) -> Batch | None:
    """Queue ``activity``, signed by ``sender``, for each of ``inboxes`` once.

    An inbox that cannot be delivered to is skipped, never fatal: the batch's
    ``skipped`` lists each, redacted, with the reason. Returns the batch, or
    None when there was no inbox to send to. With an ``idempotency_key``
    a batch sent with already is kept under, nothing is queued and that
    batch is returned, whatever the inboxes given this time; when a webhook
    event's batch holds the key, ``InvalidDelivery`` naming it.
    """
    # "" is no key; anything else is checked as send_batch checks it: a key
    # of 0 or b"" is refused, not taken for none (a type check, all it costs).
    options = (
        None
        if isinstance(idempotency_key, str) and not idempotency_key
        else BatchOptions(idempotency_key=idempotency_key)
    )
    return send_batch(sender, activity, inboxes, options)


def send_batch(
    sender: str,
    activity: Mapping[str, Any],
    inboxes: Iterable[str],
    options: BatchOptions | Mapping[str, Any] | None = None,
    *,
    using: str | None = None,
) -> Batch | None:
    """:func:`send`, with the options a batch may carry (see :class:`BatchOptions`)."""
    return _queue(sender, activity, inboxes, options, portable=False, using=using)


def send_portable(
    sender: str,
    activity: Mapping[str, Any],
    inboxes: Iterable[PortableInbox],
    options: BatchOptions | Mapping[str, Any] | None = None,
    *,
    using: str | None = None,
) -> Batch | None:
    """Queue ``activity`` for each portable inbox (FEP-ef61), once each.

    Each delivery goes to the inbox at the first of its gateways that
    accepts it, of the first five that are bare http(s) origins, tried one
    after the other within one attempt. An inbox with no usable gateway is
    not queued; one listed twice, differing only in its query, is sent to once.
    """
    return _queue(sender, activity, inboxes, options, portable=True, using=using)


# From async code (an async view, under ASGI): each runs its sync twin in
# the thread Django's async ORM runs its queries in (thread-sensitive), on
# the same connection: what the caller wrote there and has not committed
# is what the send's transaction joins, and a send in autocommit is queued
# (and a deliverer woken) at once. Same arguments, errors and result.


async def asend(
    sender: str,
    activity: Mapping[str, Any],
    inboxes: Iterable[str],
    *,
    idempotency_key: str = "",
) -> Batch | None:
    """:func:`send`, awaited from async code."""
    return await sync_to_async(send, thread_sensitive=True)(
        sender, activity, inboxes, idempotency_key=idempotency_key
    )


async def asend_batch(
    sender: str,
    activity: Mapping[str, Any],
    inboxes: Iterable[str],
    options: BatchOptions | Mapping[str, Any] | None = None,
    *,
    using: str | None = None,
) -> Batch | None:
    """:func:`send_batch`, awaited from async code."""
    return await sync_to_async(send_batch, thread_sensitive=True)(
        sender, activity, inboxes, options, using=using
    )


async def asend_portable(
    sender: str,
    activity: Mapping[str, Any],
    inboxes: Iterable[PortableInbox],
    options: BatchOptions | Mapping[str, Any] | None = None,
    *,
    using: str | None = None,
) -> Batch | None:
    """:func:`send_portable`, awaited from async code."""
    return await sync_to_async(send_portable, thread_sensitive=True)(
        sender, activity, inboxes, options, using=using
    )


def _queue(
    sender: str,
    activity: Mapping[str, Any],
    inboxes: Iterable[Any],
    options: BatchOptions | Mapping[str, Any] | None,
    *,
    portable: bool,
    using: str | None,
) -> Batch | None:
    using = database_alias(using)
    opts = _options(options)
    sender = _sender(sender)
    body, encoded = _body(activity)
    targets, skipped = _portable_inboxes(inboxes) if portable else _inboxes(inboxes)
    idempotency_key = checked_idempotency_key(opts.idempotency_key)
    try:
        deadline = _deadline(opts.deadline)
    except _PastDeadline:
        # A retry given the first's deadline, passed since, returns its batch.
        kept = _kept(idempotency_key, skipped, using) if idempotency_key else None
        if kept is None:
            raise
        return kept
    max_attempts = _max_attempts(opts.max_attempts)
    tag = checked_tag(opts.tag)
    ordering_key = checked_text("ordering_key", opts.ordering_key, ORDERING_KEY_LENGTH)
    low_priority = _flag("low_priority", opts.low_priority)
    synchronize = _flag("synchronize_collection", opts.synchronize_collection)
    activity_id, object_id = retractions.about(activity)
    retraction = retractions.retraction_of(activity, object_id)
    gone = availability.unavailable_hosts(using=using) if targets else frozenset()
    left_out: list[str] = []
    if gone:
        targets, left = _available(targets, gone)
        if left and retraction is not None:
            # Where what it retracts is still pending, a retraction goes all
            # the same, after what was attempted there (retractions.py).
            there = retractions.pending_at(
                sender, retraction, [queued.inbox for queued in left], using=using
            )
            targets += [queued for queued in left if queued.inbox in there]
            left = [queued for queued in left if queued.inbox not in there]
        left_out = [queued.inbox for queued in left]
        skipped += [SkippedInbox(addresses.redact(inbox), UNAVAILABLE) for inbox in left_out]
    if skipped:
        _log_skipped(skipped, queued=len(targets))
    if not targets:
        # A retry whose inboxes have all been left out since (their host
        # marked unavailable, say) still returns the batch kept under its key.
        kept = _kept(idempotency_key, skipped, using)
        if kept is None and left_out and retraction is not None:
            _overtake_left_out(sender, retraction, left_out, using)
        return kept
    most = app_settings.max_inboxes
    if len(targets) > most:
        kept = _kept(idempotency_key, skipped, using)
        if kept is not None:
            return kept
        raise InvalidDelivery(
            f"{len(targets)} inboxes is more than MAX_INBOXES ({most}) for one send"
        )
    with queueing.writing(
        len(targets), ordering_key=ordering_key, alone=retraction is None, using=using
    ):
        if retraction is not None:
            # Its sequences first, then the rows it supersedes, as every
            # other writer in a key takes them (a send of the key, a
            # requeue): rows first, a send in the key at that moment, holding
            # the sequence and waiting on a row this held, deadlocked it.
            lock_sequences(
                ordering_key, [queued.inbox for queued in targets if queued.ordered], using
            )
            retractions.lock_retracted(
                sender, retraction, [queued.inbox for queued in targets], using=using
            )
        batch = queueing.enqueue(
            Batch(
                sender=sender,
                body=body,
                body_sha256=body_sha256(encoded),
                tag=tag,
                deadline=deadline,
                max_attempts=max_attempts,
                ordering_key=ordering_key,
                lane=_lane(len(targets), low_priority),
                synchronize_collection=synchronize,
                idempotency_key=idempotency_key,
                activity_id=activity_id,
                object_id=object_id,
                retracts=Retracts.NOTHING if retraction is None else retraction.retracts,
                # Each attempt's span is a child of the caller's (tracing.py).
                trace_context=tracing.carried(),
            ),
            _interleave_hosts(targets),
            using=using,
        )
        if retraction is not None and batch.created:
            batch.superseded = retractions.overtake(
                sender, retraction, batch=batch, left_out=left_out, using=using
            )
    batch = queueing.of_kind(batch, Kind.ACTIVITYPUB)
    batch.skipped = skipped
    return batch


def _kept(idempotency_key: str, skipped: list[SkippedInbox], using: str) -> Batch | None:
    """The batch kept under ``idempotency_key``, for a send that queues none:
    one query, only on that way out, never on a send's own. ``InvalidDelivery``
    when a webhook event's batch holds the key."""
    kept = queueing.kept_batch(idempotency_key, kind=Kind.ACTIVITYPUB, using=using)
    if kept is not None:
        kept.skipped = skipped
    return kept


def _options(options: BatchOptions | Mapping[str, Any] | None) -> BatchOptions:
    if options is None:
        return BatchOptions()
    if isinstance(options, BatchOptions):
        return options
    if not isinstance(options, Mapping):
        raise InvalidDelivery(f"options must be BatchOptions or a dict, not {quoted(options)}")
    # Sorted as named: keys of types that do not compare (1 and "colour")
    # are no TypeError, and a long one is named short.
    unknown = sorted(map(quoted, set(options) - _OPTION_NAMES))
    if unknown:
        raise InvalidDelivery(
            f"unknown batch option(s) {', '.join(unknown)}; "
            f"known: {', '.join(sorted(_OPTION_NAMES))}"
        )
    return BatchOptions(**options)


def _sender(sender: object) -> str:
    if not isinstance(sender, str) or not sender.strip():
        raise InvalidDelivery(f"sender must be a non-empty string, not {quoted(sender, path=True)}")
    if len(sender) > URL_LENGTH:
        raise InvalidDelivery(
            f"sender is longer than {URL_LENGTH} characters: {quoted(sender, path=True)}"
        )
    sender = _storable("sender", sender.strip())
    # Printable text (nearly every sender) holds none of them.
    if not sender.isprintable() and any(
        unicodedata.category(char) in _CONTROL_CATEGORIES for char in sender
    ):
        raise InvalidDelivery(
            f"sender must not contain control characters: {quoted(sender, path=True)}"
        )
    return sender


def _body(activity: object) -> tuple[str, bytes]:
    """The activity as it is stored and as it is sent, within MAX_BODY_BYTES."""
    if not isinstance(activity, Mapping):
        raise InvalidDelivery(f"activity must be a JSON object (a dict), not {quoted(activity)}")
    if not isinstance(activity, dict):
        activity = dict(activity)  # a mapping of another type: JSON writes only a dict
    try:
        text = _JSON.encode(activity)
    except (TypeError, ValueError) as exc:
        raise InvalidDelivery(
            f"activity cannot be written as JSON: {not_json(activity, exc)}"
        ) from exc
    except RecursionError as exc:
        # The encoder recurses once a level: past the interpreter's limit,
        # what is nested that deep is no activity anyone reads.
        raise _too_deep() from exc
    try:
        encoded = text.encode()
    except UnicodeEncodeError as exc:
        raise InvalidDelivery(
            "activity holds text that is not valid Unicode (a lone surrogate) near "
            f"{quoted(text[max(0, exc.start - 20) : exc.end + 20], path=True)}"
        ) from exc
    limit = app_settings.max_body_bytes
    if len(encoded) > limit:
        raise InvalidDelivery(
            f"activity is {len(encoded)} bytes as JSON, more than MAX_BODY_BYTES ({limit})"
        )
    # Once written, so that what is walked is neither circular nor too deep.
    # As deep as an event's data may be, and for the same reason: what the
    # encoder writes, the admin and the loop must read again (json.loads
    # recurses once a level too). Only an activity with that many brackets,
    # counted in C, can be that deep, so most are not walked for it.
    if text.count("{") + text.count("[") > MAX_DEPTH and nested_deeper(activity, MAX_DEPTH):
        raise _too_deep()
    collision = colliding_key(activity)
    if collision is not None:
        key, path = collision
        raise InvalidDelivery(
            f"activity has two keys that are both {quoted(key)} in JSON at {path}"
        )
    return text, encoded


def _too_deep() -> InvalidDelivery:
    return InvalidDelivery(
        f"activity is nested too deeply: more than {MAX_DEPTH} levels of arrays and "
        "objects one inside another"
    )


def _inboxes(inboxes: Iterable[str]) -> tuple[list[queueing.Queued], list[SkippedInbox]]:
    if isinstance(inboxes, str | addresses.BINARY) or not isinstance(inboxes, Iterable):
        raise InvalidDelivery(f"inboxes must be an iterable of URLs, not {quoted(inboxes)}")
    # Remote actors choose their inboxes: one that cannot be sent to is left
    # out, never allowed to stop the send (and roll back the caller's post).
    unique: dict[str, str] = {}
    skipped: list[SkippedInbox] = []
    for inbox in inboxes:
        try:
            url, host = addresses.canonical_and_host(inbox)
        except addresses.UnusableURL as exc:
            skipped.append(SkippedInbox(exc.redacted, exc.reason))
            continue
        unique.setdefault(url, host)
    return [queueing.Queued(inbox, host) for inbox, host in unique.items()], skipped


def _portable_inboxes(
    inboxes: Iterable[PortableInbox],
) -> tuple[list[queueing.Queued], list[SkippedInbox]]:
    if isinstance(inboxes, str | addresses.BINARY) or not isinstance(inboxes, Iterable):
        raise InvalidDelivery(
            f"inboxes must be an iterable of PortableInbox, not {quoted(inboxes)}"
        )
    queued: dict[str, queueing.Queued] = {}
    skipped: list[SkippedInbox] = []
    # Named with no usable gateway: skipped, unless listed again with one.
    unusable: dict[str, None] = {}
    for inbox in inboxes:
        if not isinstance(inbox, PortableInbox):
            shown = addresses.redact(inbox) if isinstance(inbox, str) else ""
            reason = f"is not a PortableInbox but {type(inbox).__name__}"
            skipped.append(SkippedInbox(shown, reason))
            continue
        name = portable.canonical(inbox.inbox)
        if name in queued:
            continue
        via = portable.targets(inbox)
        if not via:
            unusable[name] = None
            continue
        # The first gateway stands for the host: per-host limits and breakers.
        queued[name] = queueing.Queued(name, host_of(via[0]), tuple(via))
    skipped += [
        SkippedInbox(addresses.redact(name), "has no usable gateway")
        for name in unusable
        if name not in queued
    ]
    return list(queued.values()), skipped


#: Why an inbox of an unavailable host is left out, as ``skipped`` says.
UNAVAILABLE = "is on a host marked unavailable (no success for HOST_UNAVAILABLE_AFTER)"


def _available(
    targets: list[queueing.Queued], gone: frozenset[str]
) -> tuple[list[queueing.Queued], list[queueing.Queued]]:
    """``targets`` but those on a host marked unavailable, and those, left
    out. A portable inbox keeps the gateways not marked so, the first of
    them standing for its host; it is left out when none is left."""
    kept: list[queueing.Queued] = []
    left_out: list[queueing.Queued] = []
    for queued in targets:
        if queued.via and any(host_of(gateway) in gone for gateway in queued.via):
            via = tuple(gateway for gateway in queued.via if host_of(gateway) not in gone)
            queued = queued._replace(host=host_of(via[0]), via=via) if via else queued
        (left_out if queued.host in gone else kept).append(queued)
    return kept, left_out


def _overtake_left_out(
    sender: str, retraction: retractions.Retraction, left_out: list[str], using: str
) -> None:
    """A retraction whose inboxes were all left out, their hosts marked
    unavailable, and nothing it retracts pending at any, queues nothing;
    what it retracts there is looked at all the same: what came to be
    queued there since it looked is superseded, if never attempted."""
    # No savepoint, as a send's: the caller's transaction if one is open.
    with transaction.atomic(using=using, savepoint=False):
        retractions.overtake(sender, retraction, batch=None, left_out=left_out, using=using)


def _log_skipped(skipped: list[SkippedInbox], *, queued: int) -> None:
    first = skipped[0]
    example = f"{first.inbox!r} {first.reason}" if first.inbox else first.reason
    if queued:
        logger.warning(
            "Skipped %d inbox(es) that cannot be delivered to, queued %d; the first: %s",
            len(skipped),
            queued,
            example,
        )
    else:
        logger.warning(
            "Nothing queued: all %d inbox(es) were skipped as undeliverable; the first: %s",
            len(skipped),
            example,
        )


class _PastDeadline(InvalidDelivery):
    """A deadline that has passed: a retry's, given the first send's, too."""


def _deadline(deadline: object) -> dt.datetime | None:
    if deadline is None:
        return None
    now = aware_now()
    if isinstance(deadline, dt.timedelta):
        if deadline <= dt.timedelta(0):
            raise InvalidDelivery(f"deadline {quoted(deadline)} must be a positive timedelta")
        named = quoted(deadline)
        try:
            deadline = now + deadline
        except OverflowError as exc:
            raise InvalidDelivery(f"deadline {named} is too far ahead") from exc
    elif not isinstance(deadline, dt.datetime):
        raise InvalidDelivery(f"deadline must be a datetime or timedelta, not {quoted(deadline)}")
    else:
        if timezone.is_naive(deadline):
            if settings.USE_TZ:
                raise InvalidDelivery(f"deadline {quoted(deadline)} must be timezone-aware")
            # As Django takes every naive time with USE_TZ off: in TIME_ZONE.
            deadline = aware(deadline)
        named = deadline.isoformat()
    # Compared as they are (no conversion, which may overflow): one before
    # the calendar in some zone is past, not "too far ahead".
    if deadline <= now:
        raise _PastDeadline(f"deadline {named} is already past")
    try:
        # Stored in UTC and read back in the naive zone (TIME_ZONE with
        # USE_TZ off), and shown in the zone active for whoever looks (a
        # user's, as high as UTC+14): a zone ahead of UTC can push the year
        # past 9999, which no database reads back (PostgreSQL wrote it, then
        # failed every read of it) and the admin cannot show. A day short of
        # the calendar's end leaves room for every zone.
        deadline.astimezone(naive_zone())
        in_utc = deadline.astimezone(dt.UTC)
    except OverflowError as exc:
        raise InvalidDelivery(f"deadline {named} is too far ahead") from exc
    if in_utc > LATEST_DEADLINE:
        raise InvalidDelivery(f"deadline {named} is too far ahead")
    return in_utc


#: The latest deadline a send takes: a day short of the calendar's end, so
#: that it is a date in every time zone it may be shown in.
LATEST_DEADLINE = dt.datetime.max.replace(tzinfo=dt.UTC) - dt.timedelta(days=1)


def _max_attempts(max_attempts: object) -> int | None:
    if max_attempts is None:
        return None
    if (
        isinstance(max_attempts, bool)
        or not isinstance(max_attempts, int)
        or not 1 <= max_attempts <= MAX_ATTEMPTS
    ):
        raise InvalidDelivery(
            f"max_attempts must be a whole number from 1 to {MAX_ATTEMPTS}, "
            f"not {quoted(max_attempts)}"
        )
    return max_attempts


def checked_tag(value: object) -> str:
    """``value`` as a batch's tag: as :func:`checked_text`, and not one that
    begins as a replay's (``replay of batch N``): a batch tagged so, and
    keyed as a replay's, is taken for a replay's copy of batch N."""
    tag = checked_text("tag", value, TAG_LENGTH)
    # In any case: SQLite's LIKE, which tells a replay's copy, ignores it.
    if tag[: len(REPLAY_TAG_PREFIX)].lower() == REPLAY_TAG_PREFIX:
        raise InvalidDelivery(
            f"tag must not begin with {REPLAY_TAG_PREFIX!r}, which marks what a replay "
            f"queued: {quoted(tag)}"
        )
    return tag


def checked_idempotency_key(value: object) -> str:
    """``value`` as a send's idempotency key: ``InvalidDelivery`` naming it
    when it is no string, too long, or one no database can store."""
    return checked_text("idempotency_key", value, IDEMPOTENCY_KEY_LENGTH)


def checked_text(name: str, value: object, length: int) -> str:
    """``value`` as text a row keeps: ``InvalidDelivery`` naming it when it is
    no string, longer than ``length``, or one no database can store."""
    if not isinstance(value, str):
        raise InvalidDelivery(f"{name} must be a string, not {quoted(value)}")
    if len(value) > length:
        raise InvalidDelivery(f"{name} is longer than {length} characters: {quoted(value)}")
    return _storable(name, value)


def _storable(name: str, value: str) -> str:
    """``value``, when every database can store it: no NUL (PostgreSQL's text
    refuses it), no lone surrogate (not UTF-8)."""
    if "\x00" in value:
        raise InvalidDelivery(f"{name} must not contain NUL characters: {quoted(value)}")
    try:
        value.encode()
    except UnicodeEncodeError as exc:
        raise InvalidDelivery(
            f"{name} holds text that is not valid Unicode (a lone surrogate): {quoted(value)}"
        ) from exc
    return value


def _flag(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise InvalidDelivery(f"{name} must be True or False, not {quoted(value)}")
    return value


def _lane(inboxes: int, low_priority: object) -> str:
    if _flag("low_priority", low_priority):
        return Lane.LOW
    few = app_settings.priority_max_inboxes
    if few is not None and inboxes <= few:
        return Lane.PRIORITY
    return Lane.NORMAL


def _interleave_hosts(targets: list[queueing.Queued]) -> list[queueing.Queued]:
    """Hosts taken in turn, so that the first claims of a fan-out spread over
    many hosts instead of queueing behind one: each host's first inbox in the
    order given, then each one's second, and so on."""
    turns: dict[str, int] = {}
    rounds: list[list[queueing.Queued]] = []
    for target in targets:
        turn = turns[target.host] = turns.get(target.host, -1) + 1
        if turn == len(rounds):
            rounds.append([])
        rounds[turn].append(target)
    return [target for round_ in rounds for target in round_]
