"""The queues page: the whole delivery system at a glance, in a bounded number of queries."""

from __future__ import annotations

import datetime as dt

from django.contrib import admin
from django.contrib.admin.utils import quote
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest
from django.template.response import TemplateResponse
from django.urls import reverse
from django.utils.safestring import SafeString, mark_safe
from django.utils.translation import gettext

from django_federation_delivery import charts, history, overview
from django_federation_delivery.admin.base import changelist_url, may_view
from django_federation_delivery.admin.destinations import can_enable, destination_rows
from django_federation_delivery.models import Batch, Breaker, Delivery, Host, Lane, Status
from django_federation_delivery.overview import BREAKER_STATES


def queues_page(model_admin: admin.ModelAdmin[Delivery], request: HttpRequest) -> TemplateResponse:
    """The queues at a glance: each lane's due, scheduled, in-flight and held
    deliveries, the live deliverers, the webhook destinations, the hosts
    failing most, the open breakers and the paused hosts; and the history's
    charts, the last hour by minute and the last two days by hour.

    Breakers, hosts and batches are shown, and linked to, only to a user
    who may see their own lists: the view permission on deliveries opens
    this page, not theirs."""
    if not model_admin.has_view_permission(request):
        raise PermissionDenied
    request.current_app = model_admin.admin_site.name
    status = overview.overview()
    site = model_admin.admin_site
    see_breakers, see_hosts = may_view(request, site, Breaker), may_view(request, site, Host)

    def deliveries(**params: str) -> str:
        return changelist_url(Delivery, site, **params)

    def lane_links(lane: str) -> dict[str, str]:
        lane_filter = {"lane__exact": lane} if lane != "all" else {}
        return {
            state: deliveries(queue=state, **lane_filter)
            for state in ("due", "scheduled", "in_flight", "held")
        }

    lanes = [
        (
            lane,
            Lane(lane.lane).label if lane.lane in Lane.values else gettext("all"),
            lane_links(lane.lane),
            overview.format_duration(lane.lag) if lane.oldest_due_at else "—",
        )
        for lane in (*status.lanes, status.total)
    ]
    context = {
        **model_admin.admin_site.each_context(request),
        "title": gettext("Queues at a glance"),
        "opts": model_admin.opts,
        "overview": status,
        "lanes": lanes,
        # Their heartbeats are shown here only: no admin of their own.
        "deliverers": status.deliverers,
        "stalled": status.stalled,
        "deliveries_url": deliveries(),
        "batches_url": changelist_url(Batch, site) if may_view(request, site, Batch) else "",
        "breakers_url": changelist_url(Breaker, site) if see_breakers else "",
        "hosts_url": changelist_url(Host, site) if see_hosts else "",
        "may_view_breakers": see_breakers,
        "may_view_hosts": see_hosts,
        "destinations_url": reverse(
            "admin:federation_delivery_delivery_destinations", current_app=site.name
        ),
        "destinations": destination_rows(site, status.at),
        "can_enable": can_enable(request),
        "enable_url": reverse(
            "admin:federation_delivery_delivery_enable_destination", current_app=site.name
        ),
        "history_charts": history_charts(status.at),
        "failing_hosts": [
            (
                host,
                deliveries(host=host.host, status__exact=Status.PENDING),
                BREAKER_STATES.get(host.breaker, host.breaker),
            )
            for host in status.failing_hosts
        ],
        "open_breakers": [
            (
                breaker,
                # A blank key (a row no deliverer wrote) has no page to link to.
                reverse(
                    "admin:federation_delivery_breaker_change",
                    args=[quote(breaker.key)],
                    current_app=site.name,
                )
                if breaker.key
                else "",
                BREAKER_STATES.get(breaker.state, breaker.state),
            )
            for breaker in (status.open_breakers if see_breakers else ())
        ],
        "paused_hosts": [
            (name, deliveries(host=name, status__exact=Status.PENDING))
            for name in (status.paused_hosts if see_hosts else ())
        ],
        # Every paused host, on the hosts' list, when more are than are shown.
        "all_paused_url": (
            changelist_url(Host, site, paused="yes")
            if see_hosts and status.paused_host_count > len(status.paused_hosts)
            else ""
        ),
    }
    return TemplateResponse(request, "admin/federation_delivery/queues.html", context)


def history_charts(now: dt.datetime) -> list[SafeString]:
    """The two charts, as inline SVG: one query, of at most two days of minutes."""
    minutes, hours = history.recent(now=now)
    return [
        # charts.chart escapes all it writes.
        mark_safe(
            charts.chart(
                minutes,
                title=gettext("Last hour, by minute"),
                id="fd-history-minutes",
                unit="minute",
                time_format="%H:%M",
                label_every=10,
            )
        ),
        mark_safe(
            charts.chart(
                hours,
                title=gettext("Last two days, by hour"),
                id="fd-history-hours",
                unit="hour",
                time_format="%a %H:%M",
                label_every=6,
            )
        ),
    ]
