"""The loop's side of inbox deliveries: the job for a claimed one (the body,
the sender's key, the headers the host project adds, the scheme to knock in
first) and the attempt at it, judged by the ActivityPub retry policy."""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from django_federation_delivery import addresses
from django_federation_delivery.attempt import AttemptResult, permanent_status
from django_federation_delivery.batches import BatchInfo
from django_federation_delivery.channels.activitypub import ActivityPub, InboxJob
from django_federation_delivery.conf import app_settings
from django_federation_delivery.exceptions import SigningError
from django_federation_delivery.health import HostWatch
from django_federation_delivery.hosts import KnownSchemes
from django_federation_delivery.keys import KeyCache, LookupFailedLately, failure_reason
from django_federation_delivery.settling import Settler, Summary, ask
from django_federation_delivery.signatures.request import check_header_value
from django_federation_delivery.store import claims
from django_federation_delivery.store.claims import lease_deadline
from django_federation_delivery.transport import Transport, TransportSettings

__all__ = ["InboxDeliveries", "lease_deadline", "synchronization_headers"]

#: Past this many activities parsed for SKIP_IF, they are parsed again as needed.
MOST_ACTIVITIES = 1000
#: What a batch's activity is kept as when its body is not JSON: SKIP_IF is
#: not asked about it.
UNREADABLE = object()
#: FEP-8fcf's header, written by COLLECTION_SYNCHRONIZATION.
SYNCHRONIZATION_HEADER = "Collection-Synchronization"

# The loop's logger: where an operator looks for what the loop met.
logger = logging.getLogger("django_federation_delivery.deliverer")


class InboxDeliveries:
    """What one deliverer does for deliveries to inboxes, with the sender
    keys cached."""

    def __init__(
        self,
        settler: Settler,
        schemes: KnownSchemes,
        transport_settings: TransportSettings,
        *,
        channel: ActivityPub | None = None,
        skip_if: Callable[..., Any] | None = None,
        synchronization: Callable[..., Any] | None = None,
    ) -> None:
        self._settler = settler
        self.schemes = schemes
        self.transport_settings = transport_settings
        #: What makes each attempt and judges its answer.
        self.channel = channel or ActivityPub()
        #: SKIP_IF: whether to drop a delivery unsent as it comes due.
        self.skip_if = skip_if
        #: COLLECTION_SYNCHRONIZATION: the header for a sender and an inbox.
        self.synchronization = synchronization
        self.keys = KeyCache()
        #: The activities SKIP_IF was asked about, by batch id.
        self._activities: dict[int, Any] = {}

    @classmethod
    def from_settings(
        cls,
        summary: Summary,
        schemes: KnownSchemes,
        transport_settings: TransportSettings,
        *,
        using: str | None = None,
    ) -> InboxDeliveries:
        """As the settings say: the inbox kind's policy (RETRY, ATTEMPT_TIMEOUT,
        ALLOWED_NETWORKS and the rest), PERMANENT_STATUS, SKIP_IF."""
        given = app_settings.callable_setting("PERMANENT_STATUS")
        channel = ActivityPub(
            is_permanent=_asked(given) if given is not None else permanent_status,
            error_length=app_settings.error_length,
        )
        policy = channel.policy()
        watch = HostWatch(app_settings.host_failing_after, using=using)
        return cls(
            dataclasses.replace(Settler.from_settings(summary, policy), watch=watch),
            schemes,
            dataclasses.replace(
                transport_settings,
                attempt_timeout=policy.timeout,
                allowed_networks=policy.allowed_networks,
            ),
            channel=channel,
            skip_if=app_settings.callable_setting("SKIP_IF"),
            synchronization=app_settings.callable_setting("COLLECTION_SYNCHRONIZATION"),
        )

    @property
    def timeout(self) -> float:
        return self.transport_settings.attempt_timeout

    def skipped(self, row: claims.Claimed, batch: BatchInfo) -> bool:
        """Whether SKIP_IF drops ``row`` unsent."""
        if self.skip_if is None:
            return False
        activity = self._activity(batch)
        if activity is UNREADABLE:
            # Not skipped: SKIP_IF drops what it is shown, and it cannot be
            # shown this. Sent as stored, nothing is lost: the inbox accepts
            # it or refuses it, and a refusal is kept in last_error for an
            # operator to see. Dropped or failed here, on a body SKIP_IF never
            # saw, a delivery the sender meant could be lost without a word
            # from anyone who could judge it.
            return False
        return bool(ask("SKIP_IF", self.skip_if, row.inbox, activity))

    def _activity(self, batch: BatchInfo) -> Any:
        """The activity ``batch`` sends, parsed once for all its inboxes;
        :data:`UNREADABLE` when its body is not JSON (written by hand)."""
        if batch.id not in self._activities:
            if len(self._activities) > MOST_ACTIVITIES:
                self._activities.clear()
            try:
                self._activities[batch.id] = json.loads(batch.body)
            except (ValueError, RecursionError) as exc:
                # Told once a batch, by its id: the body is the sender's, not a log's.
                logger.warning(
                    "The activity of batch %d cannot be read (%s); SKIP_IF is not "
                    "asked about its deliveries, which are sent as stored",
                    batch.id,
                    type(exc).__name__,
                )
                self._activities[batch.id] = UNREADABLE
        return self._activities[batch.id]

    def forget(self, batch_ids: Iterable[int]) -> None:
        """The activities parsed for SKIP_IF of ``batch_ids``, none of whose
        deliveries is in hand."""
        for id in batch_ids:
            self._activities.pop(id, None)

    def unusable(self, claimed: Iterable[claims.Claimed]) -> set[str]:
        """An inbox is always one to try."""
        return set()

    def give_up(self, hosts: Iterable[str]) -> int:
        return 0

    def give_up_unusable(self) -> int:
        return 0

    def release_stuck(self) -> int:
        return 0  # an inbox's held deliveries are its host's pause's

    def job(self, row: claims.Claimed, batch: BatchInfo) -> InboxJob:
        """The job for ``row``, a claimed delivery of ``batch``."""
        key_error = ""
        key = None
        try:
            key = self.keys.get(batch.sender)
        except Exception as exc:
            # The key store is the host project's; it being away for a
            # moment does not make the delivery wrong. Logged as it fails,
            # not again for each delivery it fails meanwhile.
            reason = failure_reason(exc)
            if not isinstance(exc, LookupFailedLately):
                logger.warning(
                    "Looking up the key of %s failed: %s", addresses.redact(batch.sender), reason
                )
            key_error = f"the sender's key could not be looked up: {reason}"
        extra = (
            synchronization_headers(
                self.synchronization, batch.sender, row.inbox, via=row.via or ()
            )
            if batch.synchronize_collection and key is not None
            else {}
        )
        return InboxJob(
            delivery_id=row.id,
            extra_headers=extra,
            targets=row.via or (row.inbox,),
            body=batch.body,
            body_sha256=batch.body_sha256,
            key=key,
            sender=batch.sender,
            scheme=self.schemes.scheme_for(row.host),
            key_error=key_error,
            lease_deadline=lease_deadline(row),
        )

    def settler(self, row: claims.Claimed) -> Settler:
        """The one settler of every inbox delivery."""
        return self._settler

    def transport_settings_for(self, job: InboxJob) -> TransportSettings:
        """The one transport's settings of every inbox delivery."""
        return self.transport_settings

    def attempt(self, job: InboxJob, transport: Transport) -> AttemptResult:
        return self.channel.attempt(job, transport)


def synchronization_headers(
    synchronization: Callable[..., Any] | None,
    sender: str,
    inbox: str,
    *,
    via: Sequence[str] = (),
) -> dict[str, str]:
    """The ``Collection-Synchronization`` header of a delivery of ``sender``'s
    to ``inbox``, in a batch sent with ``synchronize_collection``, as
    ``synchronization`` (COLLECTION_SYNCHRONIZATION) writes it when the
    delivery is made; none when it writes none, raises, or writes what
    cannot be signed or sent (logged), so that the activity is delivered
    without it either way. A job and a test's ``Outgoing.headers()`` both
    take it from here, so that a test sees the header an attempt sends.

    None for a portable inbox (``via`` its gateways): its ap:// name is no
    URL on a host, and one header would go to every gateway's host."""
    if synchronization is None or via:
        return {}
    header = ask("COLLECTION_SYNCHRONIZATION", synchronization, sender, inbox)
    if header is None or header == "":
        return {}
    if not isinstance(header, str):
        wrote = f"{type(header).__name__}, not text"
    else:
        try:
            value = check_header_value(SYNCHRONIZATION_HEADER, header)
        except SigningError:
            wrote = "a character that is not printable ASCII"
        else:
            return {SYNCHRONIZATION_HEADER: value} if value else {}
    # Left out, as when the callable raises: signed, it would refuse the
    # delivery for good, and a receiver does without the header, never
    # without the activity. The value is not logged: the line stays short.
    logger.warning(
        "The Collection-Synchronization header of a delivery from %s to %s is left out: "
        "COLLECTION_SYNCHRONIZATION wrote %s",
        addresses.redact(sender),
        addresses.redact(inbox),
        wrote,
    )
    return {}


def _asked(is_permanent: Callable[[int], Any]) -> Callable[[int], bool]:
    """The project's ``PERMANENT_STATUS``, asked as its other callables are
    (``settling.ask``): one that answers an awaitable (a plain function
    wrapping an async one) is logged and taken as no answer, not as true:
    the answer retried, not refused for good."""

    def asked(status: int) -> bool:
        return bool(ask("PERMANENT_STATUS", is_permanent, status))

    return asked
