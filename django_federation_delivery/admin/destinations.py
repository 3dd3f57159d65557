"""Webhook destinations: from the settings, not a model, as their URLs are credentials."""

from __future__ import annotations

import dataclasses
import datetime as dt

from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import reverse
from django.utils import timezone
from django.utils.text import Truncator
from django.utils.translation import gettext

from django_federation_delivery import overview
from django_federation_delivery.admin.base import can, changelist_url, next_due
from django_federation_delivery.models import Delivery, Host, Status
from django_federation_delivery.webhooks import life
from django_federation_delivery.webhooks.status import DestinationStatus, destination_status


@dataclasses.dataclass(frozen=True)
class DestinationRow:
    """A destination as a row of the admin's table: what it shows, and its links."""

    status: DestinationStatus
    age: str
    next_try: str
    short_error: str
    deliveries_url: str
    pending_url: str
    head_url: str
    #: What it is doing (``DestinationStatus.state``).
    state: str


def destination_rows(site: admin.AdminSite, now: dt.datetime | None = None) -> list[DestinationRow]:
    """Every destination's row: three queries, however many there are."""
    now = now or timezone.now()
    rows = []
    for status in destination_status(now=now):
        head = status.head
        head_url = ""
        next_try = "—"
        if head is not None:
            head_url = reverse(
                "admin:federation_delivery_delivery_change",
                args=[head.delivery_id],
                current_app=site.name,
            )
            next_try = next_due(
                Delivery(
                    status=Status.PENDING,
                    due_at=head.due_at,
                    lease_token="held" if head.in_flight else None,
                ),
                now,
            )
        rows.append(
            DestinationRow(
                status=status,
                age=overview.format_duration(status.age) if status.oldest_queued_at else "—",
                next_try=next_try,
                short_error=Truncator(head.last_error).chars(120) if head else "",
                deliveries_url=changelist_url(Delivery, site, destination=status.name),
                pending_url=changelist_url(
                    Delivery, site, destination=status.name, status__exact=Status.PENDING
                ),
                head_url=head_url,
                state=status.state(now),
            )
        )
    return rows


def enable_destination(
    model_admin: admin.ModelAdmin[Delivery], request: HttpRequest
) -> HttpResponseRedirect:
    """POST ``name``: enable that destination again; its events go, in order.
    It resumes the destination's ``Host`` row, as the hosts' Resume action
    does: it needs what that action needs, the change permission on hosts."""
    if request.method != "POST" or not can_enable(request):
        raise PermissionDenied
    name = request.POST.get("name", "")
    if not any(status.name == name for status in destination_status()):
        raise PermissionDenied
    # A page loaded while it was disabled may be posted after another
    # operator (or enable_webhook) enabled it: then nothing is done, and
    # said as the command says it.
    released = life.enable(name)
    level = messages.WARNING if released is None else messages.SUCCESS
    model_admin.message_user(request, life.enabled(name, released), level)
    site = model_admin.admin_site
    return HttpResponseRedirect(
        reverse("admin:federation_delivery_delivery_destinations", current_app=site.name)
    )


def can_enable(request: HttpRequest) -> bool:
    """Whether the user may enable a destination again (and is offered to)."""
    return can(request, "change", Host)


def destinations_page(
    model_admin: admin.ModelAdmin[Delivery], request: HttpRequest
) -> TemplateResponse:
    """The webhook destinations: each one's name, kind and pending events, and
    where the first of those stands."""
    if not model_admin.has_view_permission(request):
        raise PermissionDenied
    request.current_app = model_admin.admin_site.name
    site = model_admin.admin_site
    now = timezone.now()
    context = {
        **site.each_context(request),
        "can_enable": can_enable(request),
        "enable_url": reverse(
            "admin:federation_delivery_delivery_enable_destination", current_app=site.name
        ),
        "title": gettext("Webhook destinations"),
        "opts": model_admin.opts,
        "at": now,
        "destinations": destination_rows(site, now),
        "deliveries_url": changelist_url(Delivery, site),
        "queues_url": reverse("admin:federation_delivery_delivery_queues", current_app=site.name),
    }
    return TemplateResponse(request, "admin/federation_delivery/destinations.html", context)
