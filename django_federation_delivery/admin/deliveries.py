"""Deliveries: one row per inbox, with the actions that requeue and give up."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from django.contrib import admin
from django.core.exceptions import ImproperlyConfigured
from django.db.models import Q, QuerySet
from django.http import HttpRequest, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import URLPattern, path, reverse
from django.utils import timezone
from django.utils.html import format_html
from django.utils.safestring import SafeString
from django.utils.text import Truncator
from django.utils.translation import gettext, ngettext
from django.utils.translation import gettext_lazy as _

from django_federation_delivery import controls
from django_federation_delivery.addresses import escaped, redact
from django_federation_delivery.admin.base import (
    OperatorAdmin,
    host_searched,
    kept_text,
    may_view,
    next_due,
    pause_and_report,
    pending_count,
    pretty_json,
    report,
    unlinked,
)
from django_federation_delivery.admin.destinations import destinations_page, enable_destination
from django_federation_delivery.admin.queues import queues_page
from django_federation_delivery.conf import database_alias
from django_federation_delivery.models import Batch, Breaker, Delivery, Host, Kind, Status
from django_federation_delivery.store.claims import BAD_GATEWAYS
from django_federation_delivery.webhooks.destinations import configured, delivery_key

if TYPE_CHECKING:
    from django_stubs_ext import StrOrPromise


class LastStatusClassFilter(admin.SimpleListFilter):
    title = _("last status")
    parameter_name = "last_status_class"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, StrOrPromise]]:
        return [("2xx", "2xx"), ("3xx", "3xx"), ("4xx", "4xx"), ("5xx", "5xx"), ("none", _("none"))]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        value = self.value()
        if value == "none":
            return queryset.filter(last_status__isnull=True)
        if value in ("2xx", "3xx", "4xx", "5xx"):
            low = int(value[0]) * 100
            return queryset.filter(last_status__gte=low, last_status__lt=low + 100)
        return queryset


class QueueFilter(admin.SimpleListFilter):
    """Where a pending delivery stands: the columns of the queues page."""

    title = _("queue")
    parameter_name = "queue"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, StrOrPromise]]:
        return [
            ("due", _("due now")),
            ("scheduled", _("scheduled")),
            ("in_flight", _("in flight")),
            ("held", _("held")),
        ]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        now = timezone.now()
        pending = queryset.filter(status=Status.PENDING)
        match self.value():
            case "due":
                return pending.filter(due_at__lte=now)
            case "scheduled":
                return pending.filter(due_at__gt=now, lease_token__isnull=True)
            case "in_flight":
                return pending.filter(due_at__gt=now, lease_token__isnull=False)
            case "held":
                return pending.filter(due_at__isnull=True)
        return queryset


class HostFilter(admin.SimpleListFilter):
    """Offers the paused hosts and those with breakers (small tables), each
    to a user who may see their rows; any other host is filtered by
    ``?host=`` all the same."""

    title = _("host")
    parameter_name = "host"
    offered = 20

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        site = model_admin.admin_site
        names: set[str] = set()
        if may_view(request, site, Host):
            paused = (
                Host.objects.using(database_alias())
                .filter(paused_at__isnull=False)
                .order_by("name")
            )
            names.update(paused.values_list("name", flat=True)[: self.offered])
        if may_view(request, site, Breaker):
            failing = Breaker.objects.exclude(key__contains="://").order_by("-failures")
            names.update(failing.values_list("key", flat=True)[: self.offered])
        if self.value():
            names.add(str(self.value()))
        return [(name, escaped(name)) for name in sorted(names)]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        value = self.value()
        return queryset.filter(host=value) if value else queryset


class KindFilter(admin.SimpleListFilter):
    """ActivityPub activities, or webhook events."""

    title = _("kind")
    parameter_name = "kind"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, StrOrPromise]]:
        return [(Kind.ACTIVITYPUB, _("ActivityPub")), (Kind.WEBHOOK, _("webhook"))]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        value = self.value()
        return queryset.filter(kind=value) if value in Kind.values else queryset


class DestinationFilter(admin.SimpleListFilter):
    """Offers the configured webhook destinations (from the settings: no query);
    one configured no more is filtered by ``?destination=`` all the same."""

    title = _("webhook destination")
    parameter_name = "destination"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        try:
            names = set(configured().names)
        except ImproperlyConfigured:  # said by manage.py check
            names = set()
        if self.value():
            names.add(str(self.value()))
        return [(name, escaped(name)) for name in sorted(names)]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        value = self.value()
        # By the destination's host key: (host, status) is indexed.
        return queryset.filter(host=delivery_key(str(value))) if value else queryset


@admin.register(Delivery)
class DeliveryAdmin(OperatorAdmin[Delivery]):
    list_display = (
        "id",
        "shown_host",
        "shown_inbox",
        "sender",
        "event",
        "status",
        "attempts",
        "next_due",
        "last_status",
        "short_error",
    )
    list_display_links = ("id", "shown_inbox")
    list_filter = (
        "status",
        "lane",
        QueueFilter,
        LastStatusClassFilter,
        KindFilter,
        DestinationFilter,
        HostFilter,
    )
    # Hosts and ids, never the inbox: its query and userinfo may be a
    # credential, which a search could be made to tell a character at a time.
    search_fields = ("host", "destination", "batch__sender", "batch__tag", "batch__event_type")
    list_select_related = ("batch",)
    # A batch's page links to its deliveries.
    linked_lookups = ("batch__id__exact",)
    ordering = ("-id",)
    actions = ("requeue", "give_up", "pause_hosts")
    fieldsets = (
        (
            None,
            {"fields": ("batch_link", "shown_inbox", "shown_host", "shown_via", "lane", "status")},
        ),
        (
            _("Attempts"),
            {
                "fields": (
                    "attempts",
                    "next_due",
                    "due_at",
                    "last_attempt_at",
                    "last_status",
                    "shown_last_error",
                    "settled_at",
                )
            },
        ),
        (_("Ordering"), {"fields": ("shown_sequence", "after"), "classes": ("collapse",)}),
        (_("Body"), {"fields": ("body",)}),
    )
    webhook_fieldsets = (
        (None, {"fields": ("batch_link", "destination", "event", "event_id", "lane", "status")}),
        *fieldsets[1:3],
        (_("Event (the batch's, as sent)"), {"fields": ("body",)}),
    )

    def get_fieldsets(self, request: HttpRequest, obj: Delivery | None = None) -> Any:
        webhook = obj is not None and obj.kind == Kind.WEBHOOK
        fieldsets = self.webhook_fieldsets if webhook else self.fieldsets
        return unlinked(fieldsets, request, self.admin_site, {"batch_link": (Batch, "batch_name")})

    def get_queryset(self, request: HttpRequest) -> QuerySet[Delivery]:
        # A list shows no body: 100 rows need not fetch 100 of them.
        return super().get_queryset(request).select_related("batch").defer("batch__body")

    def get_search_results(
        self, request: HttpRequest, queryset: QuerySet[Delivery], search_term: str
    ) -> tuple[QuerySet[Delivery], bool]:
        """The search fields, a number as a delivery's id or its batch's, and
        a host in any form."""
        found, duplicates = super().get_search_results(request, queryset, search_term)
        term = search_term.strip()
        if term.isascii() and term.isdigit() and len(term) < 19:
            found |= queryset.filter(Q(pk=int(term)) | Q(batch_id=int(term)))
        if host := host_searched(term):
            found |= queryset.filter(host=host)
        return found, duplicates

    def get_urls(self) -> list[URLPattern]:
        opts = self.opts
        queues = path(
            "queues/",
            self.admin_site.admin_view(self.queues_view),
            name=f"{opts.app_label}_{opts.model_name}_queues",
        )
        destinations = path(
            "destinations/",
            self.admin_site.admin_view(self.destinations_view),
            name=f"{opts.app_label}_{opts.model_name}_destinations",
        )
        enable = path(
            "destinations/enable/",
            self.admin_site.admin_view(self.enable_destination_view),
            name=f"{opts.app_label}_{opts.model_name}_enable_destination",
        )
        # Before the model's own, whose "<path:object_id>/" would take them.
        return [queues, destinations, enable, *super().get_urls()]

    def queues_view(self, request: HttpRequest) -> TemplateResponse:
        return queues_page(self, request)

    def destinations_view(self, request: HttpRequest) -> TemplateResponse:
        return destinations_page(self, request)

    def enable_destination_view(self, request: HttpRequest) -> HttpResponseRedirect:
        return enable_destination(self, request)

    # An inbox's query may be a credential: the admin shows none (see
    # addresses.redact), and does not sort by it either, as the place of an
    # inbox whose URL one chose (any remote actor's) would tell whether
    # another's query sorts before or after it, a character at a time.
    @admin.display(description=_("inbox"))
    def shown_inbox(self, obj: Delivery) -> str:
        return redact(obj.inbox)

    shown_host = kept_text(Delivery, "host")
    shown_last_error = kept_text(Delivery, "last_error")
    shown_sequence = kept_text(Delivery, "sequence")

    # A webhook delivery names its destination, whose URL is never shown.
    @admin.display(description=_("webhook destination"))
    def destination(self, obj: Delivery) -> str:
        return escaped(obj.destination) if obj.destination else "—"

    @admin.display(description=_("event"), ordering="batch__event_type")
    def event(self, obj: Delivery) -> str:
        return escaped(obj.batch.event_type) if obj.batch.event_type else "—"

    @admin.display(description=_("event id"))
    def event_id(self, obj: Delivery) -> str:
        return escaped(obj.batch.event_id) if obj.batch.event_id else "—"

    @admin.display(description=_("via"))
    def shown_via(self, obj: Delivery) -> str:
        via: Any = obj.via
        if via is None:
            return ""
        # Written by hand as anything but a list of URLs (a number, an
        # object, whose keys are no gateways): shown as the loop says it
        # when it fails the row, not iterated.
        if not isinstance(via, list) or not all(isinstance(url, str) for url in via):
            return BAD_GATEWAYS
        return ", ".join(redact(url) for url in via)

    @admin.display(description=_("sender"), ordering="batch__sender")
    def sender(self, obj: Delivery) -> str:
        return escaped(obj.batch.sender)

    @admin.display(description=_("next due"), ordering="due_at")
    def next_due(self, obj: Delivery) -> str:
        return next_due(obj, timezone.now())

    @admin.display(description=_("last error"))
    def short_error(self, obj: Delivery) -> str:
        return Truncator(escaped(obj.last_error)).chars(80)

    @admin.display(description=_("batch"))
    def batch_link(self, obj: Delivery) -> SafeString:
        url = reverse(
            "admin:federation_delivery_batch_change",
            args=[obj.batch_id],
            current_app=self.admin_site.name,
        )
        return format_html('<a href="{}">{}</a>', url, obj.batch)

    @admin.display(description=_("batch"))
    def batch_name(self, obj: Delivery) -> str:
        return str(obj.batch)

    @admin.display(description=_("body (the batch's, as sent)"))
    def body(self, obj: Delivery) -> SafeString:
        return pretty_json(obj.batch.body)

    @admin.action(
        permissions=["change"],
        description=_(
            "Requeue the selected failed, refused, skipped or superseded deliveries (due now, "
            "or once a paused host is resumed)"
        ),
    )
    def requeue(self, request: HttpRequest, queryset: QuerySet[Delivery]) -> None:
        eligible = queryset.filter(status__in=controls.REQUEUED_FROM)
        # Only the ids are needed, not the rows and their batches.
        count = controls.requeue(eligible.select_related(None).only("id"))
        report(
            self,
            request,
            count,
            ngettext(
                "Requeued %(count)d delivery, due now, after what it waits on, or once its paused "
                "host is resumed; pending or "
                "delivered ones, those past their batch's deadline, and those a later Delete or "
                "Undo of their sender took back, are left alone.",
                "Requeued %(count)d deliveries, due now, after what they wait on, or once their "
                "paused host is resumed; pending or "
                "delivered ones, those past their batch's deadline, and those a later Delete or "
                "Undo of their sender took back, are left alone.",
                count,
            )
            % {"count": count},
        )

    @admin.action(permissions=["change"], description=_("Give up the selected pending deliveries"))
    def give_up(self, request: HttpRequest, queryset: QuerySet[Delivery]) -> None:
        count = controls.give_up(queryset)
        report(
            self,
            request,
            count,
            gettext("Gave up %(deliveries)s; settled ones are left alone.")
            % {"deliveries": pending_count(count)},
        )

    @admin.action(
        permissions=["change_host"], description=_("Pause the hosts of the selected deliveries")
    )
    def pause_hosts(self, request: HttpRequest, queryset: QuerySet[Delivery]) -> None:
        # Each host once, by the (host, status) index: "select all" may be
        # tens of thousands of deliveries to a few hosts.
        hosts = sorted(queryset.order_by().values_list("host", flat=True).distinct())
        pause_and_report(self, request, hosts, using=controls.database_of(queryset))
