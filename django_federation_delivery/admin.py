"""The admin: the queues at a glance, and batches, deliveries, breakers and hosts.

Rows are read-only here: no add, no edit, no delete, as a hand-edited row
would bypass the queue's bookkeeping (a batch's count of what remains, the
signals). An operator acts through the actions, which call ``controls``, and
each action needs the change permission of what it changes: requeueing and
giving up need ``change_delivery``, pausing and resuming ``change_host``,
resetting a breaker ``change_breaker``.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import urlencode

from django.contrib import admin, messages
from django.contrib.admin.utils import flatten_fieldsets, quote
from django.core.exceptions import PermissionDenied
from django.db.models import Count, Exists, Model, OuterRef, Q, QuerySet
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.urls import URLPattern, path, reverse
from django.utils import timezone
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString
from django.utils.text import Truncator
from django.utils.timesince import timesince, timeuntil

from django_federation_delivery import controls, overview
from django_federation_delivery.models import Batch, Breaker, Delivery, Host, Status
from django_federation_delivery.sending import host_of

_M = TypeVar("_M", bound=Model)

if TYPE_CHECKING:
    _ModelAdmin = admin.ModelAdmin
else:

    class _ModelAdmin(admin.ModelAdmin):
        # django-stubs makes ModelAdmin generic; Django does not, at run time.
        def __class_getitem__(cls, item: Any) -> Any:
            return cls


CANCELLED = "cancelled by an operator"
#: Colours of a batch's progress bar, in the order drawn.
PROGRESS = (
    (Status.DELIVERED, "#3a9a4a"),
    (Status.REFUSED, "#d9822b"),
    (Status.FAILED, "#c83232"),
    (Status.SKIPPED, "#9a9a9a"),
    (Status.PENDING, "#7aa9d6"),
)


def _plural(count: int, singular: str, plural: str) -> str:
    return f"{count} {singular if count == 1 else plural}"


def host_of_key(key: str) -> str:
    """The host a breaker is about: its key, or the host of an inbox key."""
    return host_of(key) if "://" in key else key


class OperatorAdmin(_ModelAdmin[_M]):
    """Read-only rows, acted on only through actions that call ``controls``."""

    # The full count is a second COUNT(*) per filtered page: not on big tables.
    show_full_result_count = False
    if hasattr(admin, "ShowFacets"):  # Django 5.0+
        # Facets are a COUNT per filter choice over the whole table.
        show_facets = admin.ShowFacets.NEVER

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: _M | None = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: _M | None = None) -> bool:
        # Asked with no object, for the actions; a row's own change form is
        # shown read-only, as a save would write the whole row back over what
        # a deliverer wrote meanwhile.
        return obj is None and super().has_change_permission(request)

    def has_change_delivery_permission(self, request: HttpRequest) -> bool:
        return _can(request, "change", Delivery)

    def has_change_host_permission(self, request: HttpRequest) -> bool:
        return _can(request, "change", Host)

    def get_readonly_fields(self, request: HttpRequest, obj: _M | None = None) -> list[str]:
        return flatten_fieldsets(self.get_fieldsets(request, obj))

    def changelist_view(
        self, request: HttpRequest, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        # An action this user may not run is refused outright, rather than
        # ignored as the admin does when it offers none at all.
        action = request.POST.get("action", "") if request.method == "POST" else ""
        if action and action not in self.get_actions(request):
            raise PermissionDenied
        response = super().changelist_view(request, extra_context)
        changelist = getattr(response, "context_data", None) or {}
        if "cl" in changelist:
            # One query for the whole page, rather than one a row.
            self.annotate_page(list(changelist["cl"].result_list))
        return response

    def annotate_page(self, rows: list[_M]) -> None:
        """Attach what the columns show to the page's rows, in one query."""


def _can(request: HttpRequest, action: str, model: type[Model]) -> bool:
    opts = model._meta
    return request.user.has_perm(f"{opts.app_label}.{action}_{opts.model_name}")


def _report(
    model_admin: admin.ModelAdmin[Any], request: HttpRequest, count: int, message: str
) -> None:
    level = messages.SUCCESS if count else messages.WARNING
    model_admin.message_user(request, message, level)


def _pretty_json(text: str) -> SafeString:
    # A body that is not JSON is shown as it is stored.
    with contextlib.suppress(ValueError):
        text = json.dumps(json.loads(text), indent=2, ensure_ascii=False)
    return format_html('<pre class="fd-body">{}</pre>', text)


def _changelist_url(model: type[Model], site: admin.AdminSite, **params: Any) -> str:
    opts = model._meta
    url = reverse(f"admin:{opts.app_label}_{opts.model_name}_changelist", current_app=site.name)
    return f"{url}?{urlencode(params)}" if params else url


# Deliveries.


class LastStatusClassFilter(admin.SimpleListFilter):
    title = "last status"
    parameter_name = "last_status_class"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [("2xx", "2xx"), ("3xx", "3xx"), ("4xx", "4xx"), ("5xx", "5xx"), ("none", "none")]

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

    title = "queue"
    parameter_name = "queue"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [
            ("due", "due now"),
            ("scheduled", "scheduled"),
            ("in_flight", "in flight"),
            ("held", "held"),
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
    """Offers the paused hosts and those with breakers (small tables); any
    other host is filtered by ``?host=`` all the same."""

    title = "host"
    parameter_name = "host"
    offered = 20

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        paused = Host.objects.filter(paused_at__isnull=False).values_list("name", flat=True)
        failing = Breaker.objects.exclude(key__contains="://").order_by("-failures")
        names = {*paused[: self.offered], *failing.values_list("key", flat=True)[: self.offered]}
        if self.value():
            names.add(str(self.value()))
        return [(name, name) for name in sorted(names)]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        value = self.value()
        return queryset.filter(host=value) if value else queryset


@admin.register(Delivery)
class DeliveryAdmin(OperatorAdmin[Delivery]):
    list_display = (
        "id",
        "host",
        "inbox",
        "sender",
        "status",
        "attempts",
        "next_due",
        "last_status",
        "short_error",
    )
    list_display_links = ("id", "inbox")
    list_filter = ("status", "lane", QueueFilter, LastStatusClassFilter, HostFilter)
    search_fields = ("inbox", "batch__sender", "batch__tag")
    list_select_related = ("batch",)
    ordering = ("-id",)
    actions = ("requeue", "give_up", "pause_hosts")
    fieldsets = (
        (None, {"fields": ("batch_link", "inbox", "host", "via", "lane", "status")}),
        (
            "Attempts",
            {
                "fields": (
                    "attempts",
                    "next_due",
                    "due_at",
                    "last_attempt_at",
                    "last_status",
                    "last_error",
                    "settled_at",
                )
            },
        ),
        ("Ordering", {"fields": ("sequence", "after"), "classes": ("collapse",)}),
        ("Body", {"fields": ("body",)}),
    )

    def get_queryset(self, request: HttpRequest) -> QuerySet[Delivery]:
        # A list shows no body: 100 rows need not fetch 100 of them.
        return super().get_queryset(request).select_related("batch").defer("batch__body")

    def get_urls(self) -> list[URLPattern]:
        opts = self.opts
        queues = path(
            "queues/",
            self.admin_site.admin_view(self.queues_view),
            name=f"{opts.app_label}_{opts.model_name}_queues",
        )
        # Before the model's own, whose "<path:object_id>/" would take it.
        return [queues, *super().get_urls()]

    def queues_view(self, request: HttpRequest) -> TemplateResponse:
        if not self.has_view_permission(request):
            raise PermissionDenied
        request.current_app = self.admin_site.name
        status = overview.overview()
        site = self.admin_site

        def deliveries(**params: str) -> str:
            return _changelist_url(Delivery, site, **params)

        def lane_links(lane: str) -> dict[str, str]:
            lane_filter = {"lane__exact": lane} if lane != "all" else {}
            return {
                state: deliveries(queue=state, **lane_filter)
                for state in ("due", "scheduled", "in_flight", "held")
            }

        lanes = [
            (
                lane,
                lane_links(lane.lane),
                overview.format_duration(lane.lag) if lane.oldest_due_at else "—",
            )
            for lane in (*status.lanes, status.total)
        ]
        context = {
            **self.admin_site.each_context(request),
            "title": "Queues at a glance",
            "opts": self.opts,
            "overview": status,
            "lanes": lanes,
            "deliveries_url": deliveries(),
            "batches_url": _changelist_url(Batch, site),
            "breakers_url": _changelist_url(Breaker, site),
            "hosts_url": _changelist_url(Host, site),
            "failing_hosts": [
                (host, deliveries(host=host.host, status__exact=Status.PENDING))
                for host in status.failing_hosts
            ],
            "open_breakers": [
                (
                    breaker,
                    reverse(
                        "admin:federation_delivery_breaker_change",
                        args=[quote(breaker.key)],
                        current_app=site.name,
                    ),
                )
                for breaker in status.open_breakers
            ],
            "paused_hosts": [
                (name, deliveries(host=name, status__exact=Status.PENDING))
                for name in status.paused_hosts
            ],
        }
        return TemplateResponse(request, "admin/federation_delivery/queues.html", context)

    @admin.display(description="sender", ordering="batch__sender")
    def sender(self, obj: Delivery) -> str:
        return obj.batch.sender

    @admin.display(description="next due", ordering="due_at")
    def next_due(self, obj: Delivery) -> str:
        return next_due(obj, timezone.now())

    @admin.display(description="last error")
    def short_error(self, obj: Delivery) -> str:
        return Truncator(obj.last_error).chars(80)

    @admin.display(description="batch")
    def batch_link(self, obj: Delivery) -> SafeString:
        url = reverse(
            "admin:federation_delivery_batch_change",
            args=[obj.batch_id],
            current_app=self.admin_site.name,
        )
        return format_html('<a href="{}">{}</a>', url, obj.batch)

    @admin.display(description="body (the batch's, as sent)")
    def body(self, obj: Delivery) -> SafeString:
        return _pretty_json(obj.batch.body)

    @admin.action(
        permissions=["change"],
        description="Requeue the selected failed, refused or skipped deliveries (due now)",
    )
    def requeue(self, request: HttpRequest, queryset: QuerySet[Delivery]) -> None:
        eligible = queryset.filter(status__in=[Status.FAILED, Status.REFUSED, Status.SKIPPED])
        # Only the ids are needed, not the rows and their batches.
        count = controls.requeue(eligible.select_related(None).only("id"))
        _report(
            self,
            request,
            count,
            f"Requeued {_plural(count, 'delivery', 'deliveries')}, due now; "
            "pending or delivered ones are left alone.",
        )

    @admin.action(permissions=["change"], description="Give up the selected pending deliveries")
    def give_up(self, request: HttpRequest, queryset: QuerySet[Delivery]) -> None:
        count = controls.give_up(queryset)
        _report(
            self,
            request,
            count,
            f"Gave up {_plural(count, 'pending delivery', 'pending deliveries')}; "
            "settled ones are left alone.",
        )

    @admin.action(
        permissions=["change_host"], description="Pause the hosts of the selected deliveries"
    )
    def pause_hosts(self, request: HttpRequest, queryset: QuerySet[Delivery]) -> None:
        hosts = sorted(set(queryset.values_list("host", flat=True)))
        _pause(self, request, hosts)


def next_due(delivery: Delivery, now: dt.datetime) -> str:
    """When a delivery is next due, relative to ``now``."""
    if delivery.status != Status.PENDING:
        return "—"
    if delivery.due_at is None:
        if delivery.after_id is not None:
            return f"held: waits on #{delivery.after_id}"
        return "held: host paused"
    if delivery.due_at > now:
        if delivery.lease_token:
            return f"in flight (lease ends in {timeuntil(delivery.due_at, now)})"
        return f"in {timeuntil(delivery.due_at, now)}"
    if now - delivery.due_at < dt.timedelta(minutes=1):
        return "due now"
    return f"due {timesince(delivery.due_at, now)} ago"


# Batches.


class TagFilter(admin.SimpleListFilter):
    """Offers the tags of recent batches (a bounded read); any tag works as ``?tag=``."""

    title = "tag"
    parameter_name = "tag"
    recent = 500

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        tags = set(
            Batch.objects.order_by("-created_at").values_list("tag", flat=True)[: self.recent]
        )
        if self.value():
            tags.add(str(self.value()))
        return [(tag, tag) for tag in sorted(tags - {""})]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        value = self.value()
        return queryset.filter(tag=value) if value else queryset


class BatchStateFilter(admin.SimpleListFilter):
    title = "state"
    parameter_name = "state"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [
            ("pending", "in progress"),
            ("finished", "finished"),
            ("failures", "with failures"),
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
    list_display = ("id", "tag", "sender", "created_at", "deadline", "lane", "progress")
    list_filter = (TagFilter, BatchStateFilter, "lane")
    search_fields = ("tag", "sender")
    ordering = ("-created_at",)
    actions = ("requeue_failed", "cancel_pending")
    fieldsets = (
        (None, {"fields": ("tag", "sender", "lane", "created_at", "deadline", "finished_at")}),
        ("Deliveries", {"fields": ("progress", "deliveries", "size", "remaining")}),
        (
            "Options",
            {
                "fields": ("max_attempts", "ordering_key", "synchronize_collection"),
                "classes": ("collapse",),
            },
        ),
        ("Body", {"fields": ("pretty_body", "body_sha256")}),
    )

    def get_queryset(self, request: HttpRequest) -> QuerySet[Batch]:
        # The list shows no body; the change page fetches it when it shows it.
        return super().get_queryset(request).defer("body")

    def annotate_page(self, rows: list[Batch]) -> None:
        counts = batch_progress(row.id for row in rows)
        for row in rows:
            row._fd_progress = counts[row.id]  # type: ignore[attr-defined]

    @admin.display(description="progress")
    def progress(self, obj: Batch) -> SafeString:
        counts: dict[str, int] = (
            getattr(obj, "_fd_progress", None) or batch_progress([obj.id])[obj.id]
        )
        return progress_bar(counts)

    @admin.display(description="deliveries")
    def deliveries(self, obj: Batch) -> SafeString:
        url = _changelist_url(Delivery, self.admin_site, batch__id__exact=obj.id)
        return format_html('<a href="{}">{}</a>', url, _plural(obj.size, "delivery", "deliveries"))

    @admin.display(description="body")
    def pretty_body(self, obj: Batch) -> SafeString:
        return _pretty_json(obj.body)

    @admin.action(
        permissions=["change_delivery"],
        description="Requeue the failed deliveries of the selected batches",
    )
    def requeue_failed(self, request: HttpRequest, queryset: QuerySet[Batch]) -> None:
        failed = Delivery.objects.filter(batch__in=queryset.values("id"), status=Status.FAILED)
        count = controls.requeue(failed.only("id"))
        _report(
            self,
            request,
            count,
            f"Requeued {_plural(count, 'failed delivery', 'failed deliveries')} "
            f"of {_plural(queryset.count(), 'batch', 'batches')}, due now.",
        )

    @admin.action(
        permissions=["change_delivery"],
        description="Cancel the pending deliveries of the selected batches",
    )
    def cancel_pending(self, request: HttpRequest, queryset: QuerySet[Batch]) -> None:
        pending = Delivery.objects.filter(batch__in=queryset.values("id"), status=Status.PENDING)
        count = controls.give_up(pending, CANCELLED)
        _report(
            self,
            request,
            count,
            f"Cancelled {_plural(count, 'pending delivery', 'pending deliveries')} "
            f"of {_plural(queryset.count(), 'batch', 'batches')}.",
        )


def progress_bar(counts: dict[str, int]) -> SafeString:
    """A batch's deliveries by status, drawn as a bar with its counts beneath."""
    total = sum(counts.values()) or 1
    parts = [(status, colour, counts.get(status, 0)) for status, colour in PROGRESS]
    bar = format_html_join(
        "",
        '<span style="width:{}%;background:{}" title="{} {}"></span>',
        (
            (f"{100 * count / total:.2f}", colour, count, status)
            for status, colour, count in parts
            if count
        ),
    )
    legend = " · ".join(f"{count} {status}" for status, _, count in parts if count)
    return format_html(
        '<div class="fd-progress" style="display:flex;width:14em;height:0.8em;'
        'border-radius:3px;overflow:hidden;background:#ddd">{}</div>'
        '<div class="fd-progress-legend" style="font-size:0.85em">{}</div>',
        bar,
        legend or "no deliveries",
    )


# Breakers and hosts.


class BreakerStateFilter(admin.SimpleListFilter):
    title = "state"
    parameter_name = "state"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [("closed", "closed"), ("open", "open"), ("half-open", "half-open")]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        now = timezone.now()
        match self.value():
            case "closed":
                return queryset.filter(open_until__isnull=True)
            case "open":
                return queryset.filter(open_until__gt=now)
            case "half-open":
                return queryset.filter(open_until__lte=now)
        return queryset


def _paused(hosts: Iterable[str]) -> set[str]:
    return set(
        Host.objects.filter(name__in=list(hosts), paused_at__isnull=False).values_list(
            "name", flat=True
        )
    )


def _pause(model_admin: admin.ModelAdmin[Any], request: HttpRequest, hosts: list[str]) -> None:
    already = _paused(hosts)
    pausing = [host for host in hosts if host not in already]
    held = sum(controls.pause_host(host) for host in pausing)
    _report(
        model_admin,
        request,
        len(pausing),
        f"Paused {_plural(len(pausing), 'host', 'hosts')}: "
        f"{_plural(held, 'pending delivery', 'pending deliveries')} held until resumed."
        + (
            f" {_plural(len(already), 'host was', 'hosts were')} paused already." if already else ""
        ),
    )


def _resume(model_admin: admin.ModelAdmin[Any], request: HttpRequest, hosts: list[str]) -> None:
    paused = sorted(_paused(hosts))
    released = sum(controls.resume_host(host) for host in paused)
    _report(
        model_admin,
        request,
        len(paused),
        f"Resumed {_plural(len(paused), 'host', 'hosts')}: "
        f"{_plural(released, 'held delivery', 'held deliveries')} due now.",
    )


def _give_up_hosts(
    model_admin: admin.ModelAdmin[Any], request: HttpRequest, hosts: list[str]
) -> None:
    count = sum(controls.give_up_host(host) for host in hosts)
    _report(
        model_admin,
        request,
        count,
        f"Gave up {_plural(count, 'pending delivery', 'pending deliveries')} "
        f"to {_plural(len(hosts), 'host', 'hosts')}.",
    )


@admin.register(Breaker)
class BreakerAdmin(OperatorAdmin[Breaker]):
    list_display = ("key", "state", "failures", "open_until", "probe", "updated_at")
    list_filter = (BreakerStateFilter,)
    search_fields = ("key",)
    ordering = ("-updated_at",)
    actions = ("reset", "pause_hosts", "resume_hosts", "give_up_hosts")
    fieldsets = (
        (None, {"fields": ("key", "state", "failures", "open_until", "probe", "updated_at")}),
    )

    @admin.display(description="state")
    def state(self, obj: Breaker) -> str:
        return obj.state

    @admin.display(description="probe")
    def probe(self, obj: Breaker) -> str:
        if obj.probe_until is None or obj.probe_until <= timezone.now():
            return "—"
        return f"under way, waited for until {obj.probe_until:%Y-%m-%d %H:%M:%S}"

    @admin.action(permissions=["change"], description="Reset the selected breakers (closed)")
    def reset(self, request: HttpRequest, queryset: QuerySet[Breaker]) -> None:
        count = sum(controls.reset_breaker(key) for key in queryset.values_list("key", flat=True))
        _report(self, request, count, f"Reset {_plural(count, 'breaker', 'breakers')}.")

    @admin.action(
        permissions=["change_host"], description="Pause the hosts of the selected breakers"
    )
    def pause_hosts(self, request: HttpRequest, queryset: QuerySet[Breaker]) -> None:
        _pause(self, request, _hosts_of(queryset))

    @admin.action(
        permissions=["change_host"], description="Resume the paused hosts of the selected breakers"
    )
    def resume_hosts(self, request: HttpRequest, queryset: QuerySet[Breaker]) -> None:
        _resume(self, request, _hosts_of(queryset))

    @admin.action(
        permissions=["change_delivery"],
        description="Give up everything pending for the hosts of the selected breakers",
    )
    def give_up_hosts(self, request: HttpRequest, queryset: QuerySet[Breaker]) -> None:
        _give_up_hosts(self, request, _hosts_of(queryset))


def _hosts_of(breakers: QuerySet[Breaker]) -> list[str]:
    return sorted({host_of_key(key) for key in breakers.values_list("key", flat=True)} - {""})


class PausedFilter(admin.SimpleListFilter):
    title = "paused"
    parameter_name = "paused"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [("yes", "paused"), ("no", "not paused")]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        match self.value():
            case "yes":
                return queryset.filter(paused_at__isnull=False)
            case "no":
                return queryset.filter(paused_at__isnull=True)
        return queryset


def host_pending(names: Iterable[str]) -> dict[str, tuple[int, int]]:
    """Pending and held deliveries to each host: one query on (host, status)."""
    names = list(names)
    found: dict[str, tuple[int, int]] = dict.fromkeys(names, (0, 0))
    if names:
        rows = (
            Delivery.objects.filter(host__in=names, status=Status.PENDING)
            .values_list("host")
            .annotate(pending=Count("id"), held=Count("id", filter=Q(due_at__isnull=True)))
            .order_by()
        )
        found.update((host, (pending, held)) for host, pending, held in rows)
    return found


@admin.register(Host)
class HostAdmin(OperatorAdmin[Host]):
    list_display = ("name", "paused", "paused_at", "pending", "scheme", "updated_at")
    list_filter = (PausedFilter,)
    search_fields = ("name",)
    ordering = ("name",)
    actions = ("pause", "resume", "give_up")
    fieldsets = ((None, {"fields": ("name", "paused_at", "pending", "scheme", "updated_at")}),)

    def annotate_page(self, rows: list[Host]) -> None:
        counts = host_pending(row.name for row in rows)
        for row in rows:
            row._fd_pending = counts[row.name]  # type: ignore[attr-defined]

    @admin.display(description="paused", boolean=True, ordering="paused_at")
    def paused(self, obj: Host) -> bool:
        return obj.paused_at is not None

    @admin.display(description="pending (held)")
    def pending(self, obj: Host) -> str:
        pending, held = getattr(obj, "_fd_pending", None) or host_pending([obj.name])[obj.name]
        return f"{pending} ({held} held)" if held else str(pending)

    @admin.action(permissions=["change"], description="Pause the selected hosts")
    def pause(self, request: HttpRequest, queryset: QuerySet[Host]) -> None:
        _pause(self, request, list(queryset.values_list("name", flat=True)))

    @admin.action(permissions=["change"], description="Resume the selected paused hosts")
    def resume(self, request: HttpRequest, queryset: QuerySet[Host]) -> None:
        _resume(self, request, list(queryset.values_list("name", flat=True)))

    @admin.action(
        permissions=["change_delivery"],
        description="Give up everything pending for the selected hosts",
    )
    def give_up(self, request: HttpRequest, queryset: QuerySet[Host]) -> None:
        _give_up_hosts(self, request, list(queryset.values_list("name", flat=True)))


__all__ = [
    "BatchAdmin",
    "BreakerAdmin",
    "DeliveryAdmin",
    "HostAdmin",
    "batch_progress",
    "host_pending",
    "next_due",
    "progress_bar",
]
