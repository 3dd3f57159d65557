"""The queue's data: a Batch per send, a Delivery per inbox, a Breaker per failing host."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from django.db import models
from django.db.models import Q
from django.utils import timezone
from django.utils.translation import gettext
from django.utils.translation import gettext_lazy as _

from django_federation_delivery.addresses import escaped, redact


@dataclasses.dataclass(frozen=True)
class SkippedInbox:
    """An inbox a send left out, as a message may show it (see ``addresses.redact``), and why.

    Not stored: listed on the batch a send returns (``Batch.skipped``).
    """

    inbox: str
    reason: str


class Lane(models.TextChoices):
    """Which deliveries are claimed first: each lane's before the next's."""

    # Webhook events: an alert never waits behind an activity's fan-out.
    WEBHOOK = "webhook", _("webhook")
    # A send to few inboxes (a direct message, a reply): before any other activity.
    PRIORITY = "priority", _("priority")
    NORMAL = "normal", _("normal")
    # What can wait: claimed only when nothing else is due.
    LOW = "low", _("low")


class Kind(models.TextChoices):
    """What a delivery goes to, and so how the loop sends it (``kinds.py``)."""

    # An ActivityPub inbox: ``inbox`` is its URL, ``host`` its host.
    ACTIVITYPUB = "activitypub", _("ActivityPub inbox")
    # A configured webhook destination, named by ``destination``: its URL,
    # the credential, is read from the settings when it is sent.
    WEBHOOK = "webhook", _("webhook")


class Status(models.TextChoices):
    """Where a delivery stands. Only ``pending`` is still in the queue."""

    # Waiting to be sent, being sent, or waiting to be retried.
    PENDING = "pending", _("pending")
    # The inbox accepted it (2xx).
    DELIVERED = "delivered", _("delivered")
    # The inbox answered with a status that will not change, or the URL,
    # address or signature could not be used: not tried again.
    REFUSED = "refused", _("refused")
    # Dropped unsent, because the host project said so when it came due.
    SKIPPED = "skipped", _("skipped")
    # Given up: the retry policy, max attempts or the batch's deadline ran out.
    FAILED = "failed", _("failed")
    # Never attempted, and overtaken by its sender's retraction (a Delete of
    # what it was about, an Undo of it) queued to the same inbox.
    SUPERSEDED = "superseded", _("superseded")


class Retracts(models.TextChoices):
    """What a batch's activity takes back, of its sender's earlier batches."""

    NOTHING = "", _("nothing")
    # A Delete: the batches about its object.
    OBJECT = "object", _("its object")
    # An Undo: the batches of the activity it undoes.
    ACTIVITY = "activity", _("an activity")


class Batch(models.Model):
    """One send: one activity from one sender to many inboxes.

    The body is stored once here, with its digest, however many inboxes it
    goes to.
    """

    sender = models.CharField(verbose_name=_("sender"), max_length=2048)
    # The JSON exactly as it is sent; its SHA-256 is computed once, at send.
    body = models.TextField(verbose_name=_("body"))
    body_sha256 = models.CharField(verbose_name=_("body sha256"), max_length=64)
    tag = models.CharField(verbose_name=_("tag"), max_length=200, blank=True, default="")
    deadline = models.DateTimeField(verbose_name=_("deadline"), null=True, blank=True)
    max_attempts = models.PositiveIntegerField(
        verbose_name=_("max attempts"), null=True, blank=True
    )
    # Deliveries with one ordering key reach each inbox in the order queued.
    ordering_key = models.CharField(
        verbose_name=_("ordering key"), max_length=500, blank=True, default=""
    )
    lane = models.CharField(
        verbose_name=_("lane"), max_length=16, choices=Lane.choices, default=Lane.NORMAL
    )
    # Sent with a Collection-Synchronization header (FEP-8fcf) that the host
    # project's COLLECTION_SYNCHRONIZATION writes for the sender and inbox.
    synchronize_collection = models.BooleanField(
        verbose_name=_("synchronize collection"), default=False
    )
    # A webhook event (see webhooks/): its type and id, blank for an activity.
    # The body is then the event as JSON, timestamp included, so that every
    # retry sends the very same bytes. Its deliveries name their destination,
    # never its URL.
    event_type = models.CharField(
        verbose_name=_("event type"), max_length=100, blank=True, default=""
    )
    event_id = models.CharField(verbose_name=_("event id"), max_length=200, blank=True, default="")
    #: An activity's id, and the id of the object it is about (blank when it
    #: has none, or it is not one string or object with an id): what a later
    #: Undo, or Delete, by the same sender overtakes (see retractions.py).
    activity_id = models.CharField(
        verbose_name=_("activity id"), max_length=2048, blank=True, default=""
    )
    object_id = models.CharField(
        verbose_name=_("object id"), max_length=2048, blank=True, default=""
    )
    #: Whether it is a retraction, and of what: its deliveries then go to
    #: an inbox only once what it retracts (``object_id``) has left the queue
    #: there, and a replay leaves out what it retracted.
    retracts = models.CharField(
        verbose_name=_("retracts"),
        max_length=8,
        choices=Retracts.choices,
        blank=True,
        default=Retracts.NOTHING,
    )
    #: The key a send was given so that, sent again with it, it queues
    #: nothing and returns this batch (while this batch is kept).
    idempotency_key = models.CharField(
        verbose_name=_("idempotency key"), max_length=200, blank=True, default=""
    )
    #: The W3C trace context (traceparent and tracestate, as JSON) of the
    #: OpenTelemetry span that sent it, if one was recording: each attempt's
    #: span is its child (tracing.py). Blank without the ``otel`` extra.
    trace_context = models.TextField(verbose_name=_("trace context"), blank=True, default="")
    created_at = models.DateTimeField(verbose_name=_("created at"), default=timezone.now)
    # How many deliveries it queued, and how many are still pending: the
    # batch is finished when that reaches nought.
    size = models.PositiveIntegerField(verbose_name=_("size"), default=0)
    remaining = models.PositiveIntegerField(verbose_name=_("remaining"), default=0)
    finished_at = models.DateTimeField(verbose_name=_("finished at"), null=True, blank=True)

    #: Not stored: on the batch a send returns, the inboxes it left out and why,
    skipped: Sequence[SkippedInbox] = ()
    #: how many deliveries of earlier batches it superseded (a retraction's),
    superseded: int = 0
    #: and whether it was written by that send (not, for one returned for
    #: its idempotency key).
    created: bool = True

    class Meta:
        verbose_name = _("batch")
        verbose_name_plural = _("batches")
        ordering = ["-created_at"]
        indexes = [
            models.Index(fields=["tag"], name="fd_batch_tag"),
            models.Index(fields=["created_at"], name="fd_batch_created"),
            # What a retraction looks up, among the batches that have one.
            models.Index(
                fields=["object_id"], condition=Q(object_id__gt=""), name="fd_batch_object"
            ),
            models.Index(
                fields=["activity_id"], condition=Q(activity_id__gt=""), name="fd_batch_activity"
            ),
            # The batches whose deadline passed lately, which may still fail
            # a delivery waiting its turn (controls.give_up_overdue), among
            # the few that have one. Not of the unfinished alone: a column in
            # a condition written by every settle that finishes a batch
            # would make each such write touch every index of the table.
            models.Index(
                fields=["deadline"], condition=Q(deadline__isnull=False), name="fd_batch_deadline"
            ),
        ]
        constraints = [
            # Partial: a send without a key adds nothing to it.
            models.UniqueConstraint(
                fields=["idempotency_key"],
                condition=models.Q(idempotency_key__gt=""),
                name="fd_batch_idempotency_key",
            ),
        ]

    def __str__(self) -> str:
        # Shown in the admin's titles and links: as the host project gave it,
        # with nothing that reads as something else (a bidi override).
        label = escaped(self.tag) if self.tag else gettext("batch %(id)s") % {"id": self.pk}
        if self.event_type:
            return gettext("%(label)s: webhook event %(event)s") % {
                "label": label,
                "event": escaped(self.event_type),
            }
        return gettext("%(label)s from %(sender)s") % {
            "label": label,
            "sender": escaped(self.sender),
        }


class Delivery(models.Model):
    """One inbox of a batch, and how its delivery stands."""

    # No index of its own: the two below that begin with it serve.
    batch = models.ForeignKey(
        Batch,
        verbose_name=_("batch"),
        on_delete=models.CASCADE,
        related_name="deliveries",
        db_index=False,
    )
    kind = models.CharField(
        verbose_name=_("kind"), max_length=16, choices=Kind.choices, default=Kind.ACTIVITYPUB
    )
    # A webhook's destination, by its name; blank for an inbox.
    destination = models.CharField(
        verbose_name=_("destination"), max_length=64, blank=True, default=""
    )
    inbox = models.CharField(verbose_name=_("inbox"), max_length=2048)
    # What slots, breakers and pauses go by: an inbox's host, or for a webhook
    # a key of its destination that no inbox's host can be (see sending).
    host = models.CharField(verbose_name=_("host"), max_length=255)
    # Where to POST, in order, when not the inbox itself: the gateways of a
    # portable inbox (FEP-ef61), tried one after the other within one attempt.
    via = models.JSONField(verbose_name=_("via"), default=list, blank=True)
    # The batch's lane, kept here so that one index finds what is due; or a
    # sooner one, that of a delivery waiting on it in its sequence.
    lane = models.CharField(
        verbose_name=_("lane"), max_length=16, choices=Lane.choices, default=Lane.NORMAL
    )
    status = models.CharField(
        verbose_name=_("status"), max_length=16, choices=Status.choices, default=Status.PENDING
    )
    attempts = models.PositiveIntegerField(verbose_name=_("attempts"), default=0)
    # When it is next due. A claim pushes it forward by the lease, so a
    # delivery whose process died comes due again by itself. Given up while
    # leased, a row keeps its lease's end here, which a requeue waits for.
    due_at = models.DateTimeField(
        verbose_name=_("due at"), null=True, blank=True, default=timezone.now
    )
    # Taken with the claim: only its holder may settle the row. NULL while
    # nobody holds it, which no token can ever match.
    lease_token = models.CharField(  # noqa: DJ001
        verbose_name=_("lease token"), max_length=32, null=True, blank=True, editable=False
    )
    last_attempt_at = models.DateTimeField(verbose_name=_("last attempt at"), null=True, blank=True)
    last_status = models.PositiveSmallIntegerField(
        verbose_name=_("last status"), null=True, blank=True
    )
    last_error = models.TextField(verbose_name=_("last error"), blank=True, default="")
    settled_at = models.DateTimeField(verbose_name=_("settled at"), null=True, blank=True)
    # An ordered delivery's sequence (its ordering key and inbox, hashed),
    # and the one before it that it waits on, with no due time until that
    # one settles.
    sequence = models.CharField(verbose_name=_("sequence"), max_length=64, blank=True, default="")
    after = models.ForeignKey(
        "self",
        verbose_name=_("after"),
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="+",
        db_index=False,
    )
    # While it waits: the time it was due when it was made to wait, no
    # sooner than which it is due once released. Later than then only
    # while the lease of an attempt of it (or of the one it waited on)
    # still runs, which may be answered until its end.
    not_before = models.DateTimeField(verbose_name=_("not before"), null=True, blank=True)

    class Meta:
        verbose_name = _("delivery")
        verbose_name_plural = _("deliveries")
        constraints = [
            models.UniqueConstraint(fields=["batch", "inbox"], name="fd_delivery_once_per_inbox"),
        ]
        indexes = [
            # The claim: pending rows of a lane by due time, and nothing else,
            # so that it costs the same with a million settled rows.
            models.Index(
                fields=["lane", "due_at"],
                condition=Q(status="pending"),
                name="fd_delivery_due",
            ),
            models.Index(fields=["batch", "status"], name="fd_delivery_batch_status"),
            models.Index(fields=["host", "status"], name="fd_delivery_host_status"),
            # What settled in a window (the last hour, the last day), for the
            # overview and retention, without reading every settled row.
            # Partial, as the two below: a row is written again at its claim
            # and at its settling, into every index whose condition it meets.
            models.Index(
                fields=["status", "settled_at"],
                condition=Q(settled_at__isnull=False),
                name="fd_delivery_settled",
            ),
            # Those waiting on a delivery, released once it settles; and what
            # the foreign key checks when one is deleted.
            models.Index(
                fields=["after"],
                condition=Q(after__isnull=False),
                name="fd_delivery_after",
            ),
            # The last pending delivery of a sequence, which a new one waits on:
            # its highest id, read from the index however long the backlog.
            # Pending as "settled_at IS NULL" says it, not the status: the
            # statements that read it then cannot be planned through the due
            # index instead, every pending row read and sorted, which
            # statistics of a queue long settled (few pending rows) chose
            # (an ordered fan-out of 10,000 behind another: 15 s).
            models.Index(
                fields=["sequence", "id"],
                condition=Q(settled_at__isnull=True) & ~Q(sequence=""),
                name="fd_delivery_sequence",
            ),
            # A webhook destination's pending events (its queue, its status):
            # an entry for those rows alone.
            models.Index(
                fields=["destination", "id"],
                condition=models.Q(status="pending", kind="webhook"),
                name="fd_delivery_destination",
            ),
        ]

    def __str__(self) -> str:
        # Shown in the admin's titles and links: the inbox's query stays out of them.
        return f"{redact(self.inbox)} ({self.get_status_display()})"


class Host(models.Model):
    """What is remembered of a destination host, shared by every process.

    A host has a row once a deliverer has sent it something, or there is
    something else to remember (a pause, a scheme). What the deliverers saw
    of it (its answer times, its limit, its last success and error) is
    written every few seconds, for the hosts they sent to (hoststats.py),
    not at each delivery.
    """

    name = models.CharField(verbose_name=_("name"), max_length=255, primary_key=True)
    # The signature scheme the host last accepted, when it is not the one
    # tried first; blank while unknown.
    scheme = models.CharField(verbose_name=_("scheme"), max_length=16, blank=True, default="")
    # Paused by an operator: its deliveries are held, not failed, until resumed.
    paused_at = models.DateTimeField(verbose_name=_("paused at"), null=True, blank=True)
    # A webhook destination's (its host is the destination's key): why the
    # deliverer disabled it (paused it), blank when an operator paused it;
    # and since when it has been failing without a success, if it is.
    disabled_reason = models.CharField(
        verbose_name=_("disabled because"), max_length=400, blank=True, default=""
    )
    failing_since = models.DateTimeField(verbose_name=_("failing since"), null=True, blank=True)
    #: When ``host_failing`` was sent for it (health.py); cleared when it recovers.
    failing_told_at = models.DateTimeField(verbose_name=_("told failing at"), null=True, blank=True)
    #: Marked unavailable, with no success for HOST_UNAVAILABLE_AFTER: sends
    #: skip its inboxes until it is seen again (availability.py); and when
    #: the deliverer last probed it.
    unavailable_since = models.DateTimeField(
        verbose_name=_("unavailable since"), null=True, blank=True
    )
    probed_at = models.DateTimeField(verbose_name=_("probed at"), null=True, blank=True)
    #: What the deliverers saw (hoststats.py): when one first sent to it,
    #: last had a delivery accepted, and last met an error (that error,
    #: redacted as a delivery's last error is);
    first_seen_at = models.DateTimeField(verbose_name=_("first seen"), null=True, blank=True)
    last_delivered_at = models.DateTimeField(
        verbose_name=_("last delivered"), null=True, blank=True
    )
    last_error = models.TextField(verbose_name=_("last error"), blank=True, default="")
    last_error_at = models.DateTimeField(verbose_name=_("last error at"), null=True, blank=True)
    #: its answer times lately, in milliseconds (the median and the 95th
    #: percentile of the last few hundred), and how many it may be sent at
    #: once now (limits.py), as the deliverer that wrote last saw them.
    answer_p50_ms = models.FloatField(verbose_name=_("answer time p50 (ms)"), null=True, blank=True)
    answer_p95_ms = models.FloatField(verbose_name=_("answer time p95 (ms)"), null=True, blank=True)
    concurrency_limit = models.PositiveIntegerField(
        verbose_name=_("limit at once"), null=True, blank=True
    )
    #: Until when a deliverer sends it nothing, after it refused even one
    #: at a time (limits.py): the latest any deliverer wrote.
    resting_until = models.DateTimeField(verbose_name=_("resting until"), null=True, blank=True)
    updated_at = models.DateTimeField(verbose_name=_("updated at"), auto_now=True)

    class Meta:
        verbose_name = _("host")
        verbose_name_plural = _("hosts")
        # The few hosts in trouble, read every few seconds (the gauges, the
        # sends' unavailable hosts, the hourly marking) among every host sent to.
        indexes = [
            models.Index(
                fields=["failing_since"],
                condition=Q(failing_since__isnull=False),
                name="fd_host_failing",
            ),
            models.Index(
                fields=["unavailable_since"],
                condition=Q(unavailable_since__isnull=False),
                name="fd_host_unavailable",
            ),
        ]

    def __str__(self) -> str:
        return escaped(self.name)


class Breaker(models.Model):
    """A destination (a host, or an inbox) that is failing.

    Kept in the database so that every deliverer counts failures together and
    lets one probe through between them all. A healthy destination has no
    row: the healthy path writes nothing here.
    """

    key = models.CharField(verbose_name=_("key"), max_length=2048, primary_key=True)
    # Failures in a row while closed.
    failures = models.PositiveIntegerField(verbose_name=_("failures"), default=0)
    # Open (or half-open once it has passed) until then; NULL while closed.
    open_until = models.DateTimeField(verbose_name=_("open until"), null=True, blank=True)
    # The probe under way, and when it stops being waited for.
    probe_token = models.CharField(
        verbose_name=_("probe token"), max_length=32, blank=True, default=""
    )
    probe_until = models.DateTimeField(verbose_name=_("probe until"), null=True, blank=True)
    updated_at = models.DateTimeField(verbose_name=_("updated at"), default=timezone.now)

    class Meta:
        verbose_name = _("breaker")
        verbose_name_plural = _("breakers")

    def __str__(self) -> str:
        return redact(self.key)

    @property
    def state(self) -> str:
        """closed, open or half-open, as of now."""
        now = timezone.now()
        if self.open_until is None:
            return "closed"
        return "open" if now < self.open_until else "half-open"


class DelivererHeartbeat(models.Model):
    """A deliverer, as it last said: one row a ``run_deliverer`` process,
    written every ``HEARTBEAT_SECONDS``, and marked stopped (its interval 0,
    its last beat the stop) when it stops cleanly.

    A killed deliverer leaves its row behind, no longer refreshed: it counts
    as dead once three of its intervals have passed. Either is deleted after
    a day by the next deliverer to start (or to beat an hour later).
    """

    host = models.CharField(verbose_name=_("host"), max_length=255)
    pid = models.PositiveIntegerField(verbose_name=_("pid"))
    version = models.CharField(verbose_name=_("version"), max_length=50, blank=True, default="")
    started_at = models.DateTimeField(verbose_name=_("started at"))
    last_seen = models.DateTimeField(verbose_name=_("last seen"))
    # Seconds between its heartbeats: what "three intervals" means for this
    # row; 0 once it stopped cleanly.
    interval = models.FloatField(verbose_name=_("interval"))
    # Deliveries handed to its workers when it last beat.
    in_flight = models.PositiveIntegerField(verbose_name=_("in flight"), default=0)
    # Delivered per second over the interval before its last beat.
    rate = models.FloatField(verbose_name=_("rate"), default=0.0)

    class Meta:
        verbose_name = _("deliverer heartbeat")
        verbose_name_plural = _("deliverer heartbeats")
        indexes = [models.Index(fields=["last_seen"], name="fd_heartbeat_last_seen")]

    def __str__(self) -> str:
        return gettext("deliverer pid %(pid)d on %(host)s") % {
            "pid": self.pid,
            "host": escaped(self.host),
        }


class DeliveryHistory(models.Model):
    """What came of deliveries in one UTC minute, for the queues page's charts.

    One row a minute that saw anything, added to by whoever settles
    deliveries (see history.py): the charts read at most two days of these,
    however many deliveries the table holds.
    """

    minute = models.DateTimeField(verbose_name=_("minute"), unique=True)
    delivered = models.PositiveIntegerField(verbose_name=_("delivered"), default=0)
    # Attempts that failed and were rescheduled; not those held unsent by
    # an open breaker or a paused host.
    retried = models.PositiveIntegerField(verbose_name=_("retried"), default=0)
    refused = models.PositiveIntegerField(verbose_name=_("refused"), default=0)
    # Given up: out of attempts or past the deadline, or by an operator.
    failed = models.PositiveIntegerField(verbose_name=_("failed"), default=0)
    # Breakers that opened: a destination's failures in a row reached the threshold.
    breakers_opened = models.PositiveIntegerField(verbose_name=_("breakers opened"), default=0)

    class Meta:
        verbose_name = _("delivery history")
        verbose_name_plural = _("delivery history")

    def __str__(self) -> str:
        return gettext("%(minute)s UTC") % {"minute": f"{self.minute:%Y-%m-%d %H:%M}"}
