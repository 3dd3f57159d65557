"""Batches: one row per send, its progress drawn as a bar."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from django.contrib import admin
from django.db.models import Count, Exists, OuterRef, QuerySet
from django.http import HttpRequest
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString
from django.utils.translation import gettext, ngettext
from django.utils.translation import gettext_lazy as _

from django_federation_delivery import controls
from django_federation_delivery.addresses import escaped
from django_federation_delivery.admin.base import (
    OperatorAdmin,
    changelist_url,
    kept_text,
    pending_count,
    pretty_json,
    report,
    unlinked,
)
from django_federation_delivery.models import Batch, Delivery, Status

# Kept as the delivery's last error: like the errors of attempts and the log
# lines, it stays in English, whatever language the operator reads.
CANCELLED = "cancelled by an operator"
#: Colours of a batch's progress bar, in the order drawn.
PROGRESS = (
    (Status.DELIVERED, "#3a9a4a"),
    (Status.REFUSED, "#d9822b"),
    (Status.FAILED, "#c83232"),
    (Status.SKIPPED, "#9a9a9a"),
    (Status.SUPERSEDED, "#b8a0d0"),
    (Status.PENDING, "#7aa9d6"),
)

if TYPE_CHECKING:
    from django_stubs_ext import StrOrPromise


class TagFilter(admin.SimpleListFilter):
    """Offers the tags of the recent tagged batches (a bounded read: by the
    index on the tag when tagged batches are few among many, on their time
    when most are); any tag works as ``?tag=``."""

    title = _("tag")
    parameter_name = "tag"
    recent = 500

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        # Untagged ones left out by the read: 500 sends without a tag after
        # a tagged one left no tag to offer.
        tagged = Batch.objects.filter(tag__gt="").order_by("-created_at")
        tags = set(tagged.values_list("tag", flat=True)[: self.recent])
        if self.value():
            tags.add(str(self.value()))
        return [(tag, escaped(tag)) for tag in sorted(tags - {""})]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        value = self.value()
        return queryset.filter(tag=value) if value else queryset


class BatchStateFilter(admin.SimpleListFilter):
    title = _("state")
    parameter_name = "state"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, StrOrPromise]]:
        return [
            ("pending", _("in progress")),
            ("finished", _("finished")),
            ("failures", _("with failures")),
        ]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        match self.value():
            case "pending":
                return queryset.filter(finished_at__isnull=True)
            case "finished":
                return queryset.filter(finished_at__isnull=False)
            case "failures":
                # One index probe a batch, on (batch, status).
                failed = Delivery.objects.filter(
                    batch=OuterRef("pk"), status__in=[Status.FAILED, Status.REFUSED]
                )
                return queryset.filter(Exists(failed))
        return queryset


def batch_progress(batch_ids: Iterable[int]) -> dict[int, dict[str, int]]:
    """How many deliveries of each batch stand at each status: one grouped query."""
    counts: dict[int, dict[str, int]] = {id: dict.fromkeys(Status.values, 0) for id in batch_ids}
    if counts:
        rows = (
            Delivery.objects.filter(batch_id__in=list(counts))
            .values_list("batch_id", "status")
            .annotate(count=Count("id"))
            .order_by()
        )
        for batch_id, status, count in rows:
            counts[batch_id][status] = count
    return counts


@admin.register(Batch)
class BatchAdmin(OperatorAdmin[Batch]):
    list_display = (
        "id",
        "shown_tag",
        "shown_sender",
        "event",
        "created_at",
        "deadline",
        "lane",
        "progress",
    )
    list_filter = (TagFilter, BatchStateFilter, "lane")
    search_fields = ("tag", "sender", "event_type", "=idempotency_key")
    ordering = ("-created_at",)
    actions = ("requeue_failed", "cancel_pending")
    fieldsets = (
        (
            None,
            {
                "fields": (
                    "shown_tag",
                    "shown_sender",
                    "lane",
                    "created_at",
                    "deadline",
                    "finished_at",
                )
            },
        ),
        (_("Deliveries"), {"fields": ("progress", "deliveries", "size", "remaining")}),
        # What a later Delete or Undo by the sender overtakes (retractions.py).
        (_("About"), {"fields": ("shown_activity_id", "shown_object_id", "retracts")}),
        (
            _("Options"),
            {
                "fields": (
                    "max_attempts",
                    "shown_ordering_key",
                    "synchronize_collection",
                    "shown_idempotency_key",
                ),
                "classes": ("collapse",),
            },
        ),
        (_("Body"), {"fields": ("pretty_body", "shown_body_sha256")}),
    )
    # A webhook event's batch: its type and id, and no sender.
    webhook_fieldsets = (
        (
            None,
            {
                "fields": (
                    "shown_tag",
                    "shown_event_type",
                    "shown_event_id",
                    "lane",
                    "created_at",
                    "deadline",
                    "finished_at",
                )
            },
        ),
        fieldsets[1],
        fieldsets[3],
        (_("Event"), {"fields": ("pretty_body", "shown_body_sha256")}),
    )

    def get_fieldsets(self, request: HttpRequest, obj: Batch | None = None) -> Any:
        fieldsets = self.webhook_fieldsets if obj is not None and obj.event_type else self.fieldsets
        links = {"deliveries": (Delivery, "delivery_count")}
        return unlinked(fieldsets, request, self.admin_site, links)

    def get_queryset(self, request: HttpRequest) -> QuerySet[Batch]:
        # The list shows no body; the change page fetches it when it shows it.
        return super().get_queryset(request).defer("body")

    def annotate_page(self, rows: list[Batch]) -> None:
        counts = batch_progress(row.id for row in rows)
        for row in rows:
            row._fd_progress = counts[row.id]  # type: ignore[attr-defined]

    @admin.display(description=_("progress"))
    def progress(self, obj: Batch) -> SafeString:
        counts: dict[str, int] = (
            getattr(obj, "_fd_progress", None) or batch_progress([obj.id])[obj.id]
        )
        return progress_bar(counts, obj.size)

    # What the host project gave, shown with nothing that reads as something else.
    shown_tag = kept_text(Batch, "tag")
    shown_sender = kept_text(Batch, "sender")
    shown_activity_id = kept_text(Batch, "activity_id")
    shown_object_id = kept_text(Batch, "object_id")
    shown_ordering_key = kept_text(Batch, "ordering_key")
    shown_idempotency_key = kept_text(Batch, "idempotency_key")
    shown_event_type = kept_text(Batch, "event_type")
    shown_event_id = kept_text(Batch, "event_id")
    shown_body_sha256 = kept_text(Batch, "body_sha256")

    @admin.display(description=_("event"), ordering="event_type")
    def event(self, obj: Batch) -> str:
        return escaped(obj.event_type) if obj.event_type else "—"

    @admin.display(description=_("deliveries"))
    def deliveries(self, obj: Batch) -> SafeString:
        url = changelist_url(Delivery, self.admin_site, batch__id__exact=obj.id)
        return format_html('<a href="{}">{}</a>', url, self.delivery_count(obj))

    @admin.display(description=_("deliveries"))
    def delivery_count(self, obj: Batch) -> str:
        return ngettext("%(count)d delivery", "%(count)d deliveries", obj.size) % {
            "count": obj.size
        }

    @admin.display(description=_("body"))
    def pretty_body(self, obj: Batch) -> SafeString:
        return pretty_json(obj.body)

    @admin.action(
        permissions=["change_delivery"],
        description=_("Requeue the failed deliveries of the selected batches"),
    )
    def requeue_failed(self, request: HttpRequest, queryset: QuerySet[Batch]) -> None:
        deliveries = Delivery.objects.using(controls.database_of(queryset))
        failed = deliveries.filter(batch__in=queryset.values("id"), status=Status.FAILED)
        count = controls.requeue(failed.only("id"))
        report(
            self,
            request,
            count,
            gettext(
                "Requeued %(deliveries)s of %(batches)s, due now, after what they wait on, or "
                "once their paused host is resumed."
            )
            % {
                "deliveries": ngettext(
                    "%(count)d failed delivery", "%(count)d failed deliveries", count
                )
                % {"count": count},
                "batches": batch_count(queryset.count()),
            },
        )

    @admin.action(
        permissions=["change_delivery"],
        description=_("Cancel the pending deliveries of the selected batches"),
    )
    def cancel_pending(self, request: HttpRequest, queryset: QuerySet[Batch]) -> None:
        deliveries = Delivery.objects.using(controls.database_of(queryset))
        # Pending as settled_at says it: by the batches' rows, not the due index.
        pending = deliveries.filter(batch__in=queryset.values("id"), settled_at__isnull=True)
        count = controls.give_up(pending, CANCELLED)
        report(
            self,
            request,
            count,
            gettext("Cancelled %(deliveries)s of %(batches)s.")
            % {"deliveries": pending_count(count), "batches": batch_count(queryset.count())},
        )


def batch_count(count: int) -> str:
    return ngettext("%(count)d batch", "%(count)d batches", count) % {"count": count}


#: The colour of what a purge deleted of a batch's deliveries.
PURGED_COLOUR = "#e6e6e6"


def progress_bar(counts: dict[str, int], size: int = 0) -> SafeString:
    """A batch's deliveries by status, drawn as a bar with its counts beneath;
    of its ``size``, those a purge deleted (settled past their retention)
    as purged, so that a batch partly purged is not drawn as what is left."""
    purged = max(0, size - sum(counts.values()))
    total = sum(counts.values()) + purged or 1
    parts: list[tuple[StrOrPromise, str, int]] = [
        (Status(status).label, colour, counts.get(status, 0)) for status, colour in PROGRESS
    ]
    parts.append((gettext("purged"), PURGED_COLOUR, purged))
    bar = format_html_join(
        "",
        '<span style="width:{}%;background:{}" title="{} {}"></span>',
        (
            (f"{100 * count / total:.2f}", colour, count, status)
            for status, colour, count in parts
            if count
        ),
    )
    legend = " · ".join(
        gettext("%(count)d %(status)s") % {"count": count, "status": status}
        for status, _colour, count in parts
        if count
    )
    return format_html(
        '<div class="fd-progress" style="display:flex;width:14em;height:0.8em;'
        'border-radius:3px;overflow:hidden;background:#ddd">{}</div>'
        '<div class="fd-progress-legend" style="font-size:0.85em">{}</div>',
        bar,
        legend or gettext("no deliveries"),
    )
