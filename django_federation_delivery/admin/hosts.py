"""Breakers and hosts: a destination's state, and the controls that act on it."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from django.contrib import admin, messages
from django.contrib.admin.utils import display_for_value
from django.db import transaction
from django.db.models import Count, Q, QuerySet
from django.http import HttpRequest
from django.utils import timezone
from django.utils.translation import gettext, ngettext
from django.utils.translation import gettext_lazy as _

from django_federation_delivery import breakers, controls
from django_federation_delivery.addresses import host_named, redact
from django_federation_delivery.admin.base import (
    OperatorAdmin,
    give_up_and_report,
    host_searched,
    kept_text,
    pause_and_report,
    report,
    resume_and_report,
)
from django_federation_delivery.availability import seen_all
from django_federation_delivery.dialect import aware_now
from django_federation_delivery.models import Breaker, Delivery, Host, Status
from django_federation_delivery.overview import BREAKER_STATES
from django_federation_delivery.picture import (
    TROUBLE,
    TROUBLES,
    HostPicture,
    kept_host_picture,
    milliseconds,
    resting_until,
)
from django_federation_delivery.replay import replay_host, replayed, to_replay

if TYPE_CHECKING:
    from django_stubs_ext import StrOrPromise

#: The most deliveries the hosts list's replay queues in one request; more
#: are left to ``manage.py delivery_replay``.
MOST_REPLAYED = 10_000


class BreakerStateFilter(admin.SimpleListFilter):
    title = _("state")
    parameter_name = "state"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, StrOrPromise]]:
        return list(BREAKER_STATES.items())

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


@admin.register(Breaker)
class BreakerAdmin(OperatorAdmin[Breaker]):
    list_display = ("shown_key", "state", "failures", "open_until", "probe", "updated_at")
    list_filter = (BreakerStateFilter,)
    search_fields = ("key",)
    ordering = ("-updated_at",)
    actions = ("reset", "pause_hosts", "resume_hosts", "give_up_hosts")
    fieldsets = (
        (None, {"fields": ("shown_key", "state", "failures", "open_until", "probe", "updated_at")}),
    )

    # A host, or an inbox (whose query may be a credential) when breakers are per inbox.
    @admin.display(description=_("key"), ordering="key")
    def shown_key(self, obj: Breaker) -> str:
        return redact(obj.key)

    @admin.display(description=_("state"))
    def state(self, obj: Breaker) -> str:
        return str(BREAKER_STATES.get(obj.state, obj.state))

    @admin.display(description=_("probe"))
    def probe(self, obj: Breaker) -> str:
        if obj.probe_until is None or obj.probe_until <= timezone.now():
            return "—"
        return gettext("under way, waited for until %(time)s") % {
            "time": display_for_value(obj.probe_until, "—")
        }

    @admin.action(permissions=["change"], description=_("Reset the selected breakers (closed)"))
    def reset(self, request: HttpRequest, queryset: QuerySet[Breaker]) -> None:
        # Each by its key as kept, whatever it holds.
        using = controls.database_of(queryset)
        count = breakers.reset_breakers(queryset.values_list("key", flat=True), using=using)
        report(
            self,
            request,
            count,
            ngettext("Reset %(count)d breaker.", "Reset %(count)d breakers.", count)
            % {"count": count},
        )

    @admin.action(
        permissions=["change_host"], description=_("Pause the hosts of the selected breakers")
    )
    def pause_hosts(self, request: HttpRequest, queryset: QuerySet[Breaker]) -> None:
        pause_and_report(self, request, hosts_of(queryset), using=controls.database_of(queryset))

    @admin.action(
        permissions=["change_host"],
        description=_("Resume the paused hosts of the selected breakers"),
    )
    def resume_hosts(self, request: HttpRequest, queryset: QuerySet[Breaker]) -> None:
        resume_and_report(self, request, hosts_of(queryset), using=controls.database_of(queryset))

    @admin.action(
        permissions=["change_delivery"],
        description=_("Give up everything pending for the hosts of the selected breakers"),
    )
    def give_up_hosts(self, request: HttpRequest, queryset: QuerySet[Breaker]) -> None:
        give_up_and_report(self, request, hosts_of(queryset), using=controls.database_of(queryset))


def hosts_of(selected: QuerySet[Breaker]) -> list[str]:
    """The hosts the selected breakers are about. A breaker kept per host
    names its host (a destination's ``<ops>`` too); one kept per inbox, the
    inbox's host, or for a portable inbox (``ap://``, on no host of its own)
    the hosts its pending deliveries go to, its gateways'. A key no host can
    have (too long, a control character: a row written by hand) names none."""
    found: set[str] = set()
    portable: list[str] = []
    for key in selected.values_list("key", flat=True):
        if key.startswith("ap://"):
            portable.append(key)
        else:
            found.add(host_named(key))
    deliveries = Delivery.objects.using(selected.db).filter(status=Status.PENDING)
    for start in range(0, len(portable), controls.CHUNK):
        found.update(
            deliveries.filter(inbox__in=portable[start : start + controls.CHUNK])
            .values_list("host", flat=True)
            .distinct()
        )
    return sorted(found - {""})


def pictured(obj: Host) -> HostPicture | None:
    """The host's picture, read once for the fields of its page: by the
    row's name exactly, never made canonical, which could name another host."""
    if not hasattr(obj, "_fd_picture"):
        obj._fd_picture = kept_host_picture(obj.name)  # type: ignore[attr-defined]
    return obj._fd_picture  # type: ignore[attr-defined,no-any-return]


#: A host's trouble, as the operator reads it.
TROUBLE_SHOWN = {
    "unavailable": _("unavailable"),
    "failing": _("failing"),
    "paused": _("paused"),
    "ok": _("ok"),
}


class UnavailableFilter(admin.SimpleListFilter):
    title = _("unavailable")
    parameter_name = "unavailable"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, StrOrPromise]]:
        return [("yes", _("unavailable")), ("no", _("available"))]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        match self.value():
            case "yes":
                return queryset.filter(unavailable_since__isnull=False)
            case "no":
                return queryset.filter(unavailable_since__isnull=True)
        return queryset


class PausedFilter(admin.SimpleListFilter):
    title = _("paused")
    parameter_name = "paused"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, StrOrPromise]]:
        return [("yes", _("paused")), ("no", _("not paused"))]

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
    # Sorted by trouble: unavailable, failing (longest first), paused, then the rest.
    list_display = (
        "shown_name",
        "trouble",
        "failing_since",
        "unavailable_since",
        "paused",
        "pending",
        "concurrency_limit",
        "resting",
        "answer_p95",
        "last_delivered_at",
        "shown_scheme",
    )
    list_filter = (PausedFilter, UnavailableFilter)
    search_fields = ("name",)
    actions = ("pause", "resume", "give_up", "replay_day", "mark_seen")

    def get_search_results(
        self, request: HttpRequest, queryset: QuerySet[Host], search_term: str
    ) -> tuple[QuerySet[Host], bool]:
        """The name as written, or as hosts are kept (``Bücher.Example.``)."""
        found, duplicates = super().get_search_results(request, queryset, search_term)
        if host := host_searched(search_term):
            found |= queryset.filter(name=host)
        return found, duplicates

    fieldsets = (
        (
            None,
            {
                "fields": (
                    "shown_name",
                    "trouble",
                    "first_seen_at",
                    "last_delivered_at",
                    "failing_since",
                    "failing_told_at",
                    "unavailable_since",
                    "probed_at",
                    "paused_at",
                    "shown_scheme",
                )
            },
        ),
        (
            _("As the deliverers see it"),
            {
                "fields": (
                    "breaker",
                    "answer_p50",
                    "answer_p95",
                    "concurrency_limit",
                    "resting",
                    "pending",
                    "last_day",
                    "shown_last_error",
                    "last_error_at",
                    "updated_at",
                )
            },
        ),
    )

    # A name as kept: an inbox's host, or whatever a row no send wrote holds.
    shown_name = kept_text(Host, "name", blank="—")
    shown_last_error = kept_text(Host, "last_error")
    shown_scheme = kept_text(Host, "scheme")

    def get_queryset(self, request: HttpRequest) -> QuerySet[Host]:
        # Annotated before it is ordered: the order is by trouble.
        hosts = self.model._default_manager.get_queryset().annotate(trouble_rank=TROUBLE)
        return hosts.order_by(*self.get_ordering(request))

    def get_ordering(self, request: HttpRequest) -> tuple[str, ...]:
        return ("trouble_rank", "failing_since", "name")

    @admin.display(description=_("trouble"), ordering="trouble_rank")
    def trouble(self, obj: Host) -> str:
        rank = getattr(obj, "trouble_rank", None)
        if rank is None:
            picture = pictured(obj)
            return str(TROUBLE_SHOWN[picture.trouble]) if picture else str(TROUBLE_SHOWN["ok"])
        return str(TROUBLE_SHOWN[TROUBLES[rank]])

    @admin.display(description=_("breaker (failures in a row)"))
    def breaker(self, obj: Host) -> str:
        picture = pictured(obj)
        if picture is None:
            return "—"
        return gettext("%(state)s (%(failures)d)") % {
            "state": BREAKER_STATES.get(picture.breaker, picture.breaker),
            "failures": picture.failures_in_a_row,
        }

    @admin.display(description=_("resting until"), ordering="resting_until")
    def resting(self, obj: Host) -> str:
        # Formatted here: the page would show a method's None as "None".
        return str(display_for_value(resting_until(obj, timezone.now()), "—"))

    @admin.display(description=_("answer time p50"), ordering="answer_p50_ms")
    def answer_p50(self, obj: Host) -> str:
        return milliseconds(obj.answer_p50_ms)

    @admin.display(description=_("answer time p95"), ordering="answer_p95_ms")
    def answer_p95(self, obj: Host) -> str:
        return milliseconds(obj.answer_p95_ms)

    @admin.display(description=_("last 24 hours"))
    def last_day(self, obj: Host) -> str:
        picture = pictured(obj)
        if picture is None:
            return "—"
        return ", ".join(
            f"{Status(status).label} {count}" for status, count in picture.last_day.items()
        )

    def annotate_page(self, rows: list[Host]) -> None:
        counts = host_pending(row.name for row in rows)
        for row in rows:
            row._fd_pending = counts[row.name]  # type: ignore[attr-defined]

    @admin.display(description=_("paused"), boolean=True, ordering="paused_at")
    def paused(self, obj: Host) -> bool:
        return obj.paused_at is not None

    @admin.display(description=_("pending (held)"))
    def pending(self, obj: Host) -> str:
        pending, held = getattr(obj, "_fd_pending", None) or host_pending([obj.name])[obj.name]
        if not held:
            return str(pending)
        return gettext("%(pending)d (%(held)d held)") % {"pending": pending, "held": held}

    @admin.action(permissions=["change"], description=_("Pause the selected hosts"))
    def pause(self, request: HttpRequest, queryset: QuerySet[Host]) -> None:
        names = list(queryset.values_list("name", flat=True))
        pause_and_report(self, request, names, using=controls.database_of(queryset))

    @admin.action(permissions=["change"], description=_("Resume the selected paused hosts"))
    def resume(self, request: HttpRequest, queryset: QuerySet[Host]) -> None:
        names = list(queryset.values_list("name", flat=True))
        resume_and_report(self, request, names, using=controls.database_of(queryset))

    @admin.action(
        permissions=["change"],
        description=_("Mark the selected hosts as seen: sends no longer skip them"),
    )
    def mark_seen(self, request: HttpRequest, queryset: QuerySet[Host]) -> None:
        # Each row by its name as kept, whatever it holds; all or none.
        using = controls.database_of(queryset)
        names = list(queryset.values_list("name", flat=True))
        with transaction.atomic(using=using):
            seen = seen_all(names, using=using)
        # A host failing, not yet unavailable, is seen too: its mark cleared.
        said = (
            ngettext(
                "%(count)d host marked seen, %(gone)d of them no longer unavailable.",
                "%(count)d hosts marked seen, %(gone)d of them no longer unavailable.",
                seen.marked,
            )
            if seen.unavailable
            else ngettext(
                "%(count)d host marked seen.", "%(count)d hosts marked seen.", seen.marked
            )
        ) % {"count": seen.marked, "gone": seen.unavailable}
        report(self, request, seen.marked, said)

    @admin.action(
        permissions=["change_delivery"],
        description=_("Send again what the selected hosts were sent in the last 24 hours"),
    )
    def replay_day(self, request: HttpRequest, queryset: QuerySet[Host]) -> None:
        # Aware whatever USE_TZ says, as replay() takes it; from the minute's
        # start, so that a second click in that minute (a page sent twice)
        # names the same moment, whose replay is queued once.
        since = (aware_now() - dt.timedelta(days=1)).replace(second=0, microsecond=0)
        using = controls.database_of(queryset)
        names = list(queryset.values_list("name", flat=True))
        counts = to_replay(names, since=since, using=using)
        count = sum(counts.values())
        if count > MOST_REPLAYED:
            # At about a millisecond each, past a web server's time limit.
            self.message_user(
                request,
                gettext(
                    "%(count)d deliveries to replay are more than one page's request "
                    "should write (%(most)d): nothing was queued. Run manage.py "
                    "delivery_replay --host NAME --since 24h for each host instead."
                )
                % {"count": count, "most": MOST_REPLAYED},
                messages.WARNING,
            )
            return

        # Only the hosts with something to replay ("select all" may name tens
        # of thousands), each in a transaction of its own, as delivery_replay
        # --host makes it (one transaction's locks for thousands of hosts
        # fill PostgreSQL's lock table): a page sent again names the same
        # moment, and queues only what was not.
        batches = [
            batch
            for name in names
            if name in counts
            for batch in replay_host(name, since=since, using=using)
        ]
        self.message_user(request, replayed(batches))

    @admin.action(
        permissions=["change_delivery"],
        description=_("Give up everything pending for the selected hosts"),
    )
    def give_up(self, request: HttpRequest, queryset: QuerySet[Host]) -> None:
        names = list(queryset.values_list("name", flat=True))
        give_up_and_report(self, request, names, using=controls.database_of(queryset))
