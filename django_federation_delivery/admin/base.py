"""What every admin page of the app shares: read-only rows, acted on through actions."""

from __future__ import annotations

import contextlib
import datetime as dt
import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import urlencode

from django.conf import settings
from django.contrib import admin, messages
from django.contrib.admin.helpers import ACTION_CHECKBOX_NAME
from django.contrib.admin.options import IncorrectLookupParameters
from django.contrib.admin.utils import flatten_fieldsets
from django.contrib.admin.views.main import ChangeList
from django.core.exceptions import PermissionDenied, ValidationError
from django.db.models import Field, Model, QuerySet
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.urls import URLPattern, reverse
from django.utils.html import format_html
from django.utils.safestring import SafeString
from django.utils.text import smart_split
from django.utils.timesince import timesince, timeuntil
from django.utils.translation import gettext as _
from django.utils.translation import ngettext

from django_federation_delivery import controls, hosts
from django_federation_delivery.addresses import escaped, host_named
from django_federation_delivery.dialect import aware
from django_federation_delivery.models import Delivery, Host, Status

_M = TypeVar("_M", bound=Model)


if TYPE_CHECKING:
    _ModelAdmin = admin.ModelAdmin
else:

    class _ModelAdmin(admin.ModelAdmin):
        # django-stubs makes ModelAdmin generic; Django does not, at run time.
        def __class_getitem__(cls, item: Any) -> Any:
            return cls


#: The range of a 64-bit signed integer: the widest key column a database has.
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


#: The most words a list's search looks for: each is a condition on every
#: search field, and a thousand of them made a statement SQLite cannot run
#: ("Expression tree is too large"), answered with a 500.
MOST_SEARCH_WORDS = 20


class OperatorAdmin(_ModelAdmin[_M]):
    """Read-only rows, acted on only through actions that call ``controls``."""

    @property
    def urls(self) -> list[URLPattern]:
        """Its pages, none run in a request's transaction (``ATOMIC_REQUESTS``):
        an action on thousands of rows works in chunks, a replay of many
        hosts a host at a time, each its own transaction, whose locks one
        request's transaction would hold to its end, past the server's lock
        table ("out of shared memory", nothing done)."""
        patterns = self.get_urls()
        for pattern in patterns:
            view = pattern.callback
            view._non_atomic_requests = {  # type: ignore[attr-defined]
                *getattr(view, "_non_atomic_requests", ()),
                *settings.DATABASES,
            }
        return patterns

    def get_search_results(
        self, request: HttpRequest, queryset: QuerySet[Any], search_term: str
    ) -> tuple[QuerySet[Any], bool]:
        """The admin's search, for the first :data:`MOST_SEARCH_WORDS` words.
        One holding a NUL finds nothing: no text column holds one (PostgreSQL's
        cannot), and Django's autocomplete searches with no list around it."""
        if "\x00" in search_term:
            return queryset.none(), False
        words = list(smart_split(search_term))
        if len(words) > MOST_SEARCH_WORDS:
            search_term = " ".join(words[:MOST_SEARCH_WORDS])
        return super().get_search_results(request, queryset, search_term)

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
        return can(request, "change", Delivery)

    def has_change_host_permission(self, request: HttpRequest) -> bool:
        return can(request, "change", Host)

    def get_readonly_fields(self, request: HttpRequest, obj: _M | None = None) -> list[str]:
        return flatten_fieldsets(self.get_fieldsets(request, obj))

    def changelist_view(
        self, request: HttpRequest, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        # An action this user may not run is refused outright, rather than
        # ignored as the admin does when it offers none at all.
        action = posted_action(request) if request.method == "POST" else ""
        if action and action not in self.get_actions(request):
            raise PermissionDenied
        if action and not self.selectable(request.POST.getlist(ACTION_CHECKBOX_NAME)):
            # As the admin answers an action with nothing selected: a warning,
            # back to the list, nothing done.
            self.message_user(
                request,
                _("The selection holds a key no row can have: no items have been changed."),
                messages.WARNING,
            )
            return HttpResponseRedirect(request.get_full_path())
        response = super().changelist_view(request, extra_context)
        changelist = getattr(response, "context_data", None) or {}
        if "cl" in changelist:
            # One query for the whole page, rather than one a row.
            self.annotate_page(list(changelist["cl"].result_list))
        return response

    def selectable(self, selected: list[str]) -> bool:
        """Whether each key an action's form posted is one a row can have, so
        that the action's query can be made: no text column holds a NUL
        (PostgreSQL's cannot), and a number's key is a number its column
        holds (past a 64-bit integer, SQLite's driver cannot even bind it)."""
        field = self.model._meta.pk
        assert field is not None
        for key in selected:
            if "\x00" in key:
                return False
            try:
                value = field.to_python(key)
                if isinstance(value, int):
                    # The column's range, as the field's validators say it
                    # (Django 4.2's give none on SQLite), and at most what
                    # any database's 64-bit integer holds.
                    if not _INT64_MIN <= value <= _INT64_MAX:
                        return False
                    field.run_validators(value)
            except ValidationError:
                return False
        return True

    def get_object(
        self, request: HttpRequest, object_id: str, from_field: str | None = None
    ) -> _M | None:
        # A host's and a breaker's key is text: one holding a NUL names no
        # row, and is answered as the admin answers any such, not by a
        # database error.
        if "\x00" in object_id:
            return None
        return super().get_object(request, object_id, from_field)

    def get_changelist_instance(self, request: HttpRequest) -> ChangeList:
        # No text column holds a NUL (PostgreSQL's cannot): a filter or a
        # search with one is refused as the admin refuses a bad lookup, by
        # going back to the list unfiltered, not by a database error.
        if any("\x00" in text for item in request.GET.lists() for text in (item[0], *item[1])):
            raise IncorrectLookupParameters("a NUL in the query")
        return super().get_changelist_instance(request)

    def annotate_page(self, rows: list[_M]) -> None:
        """Attach what the columns show to the page's rows, in one query."""

    #: Lookups the app's own pages link to that no filter of this list makes
    #: (a batch's deliveries): allowed beside the filters'.
    linked_lookups: tuple[str, ...] = ()

    def lookup_allowed(self, lookup: str, value: str, request: HttpRequest | None = None) -> bool:
        # Django allows any lookup on the model's own fields: with the count
        # of rows answering, ?inbox__startswith= would tell an inbox's query
        # (a credential) a character at a time, and ?host__regex=( is a
        # database error. Only what the filters and the pages' own links use
        # is allowed; Django answers any other 400 (DisallowedModelAdminLookup).
        # Django 4.2 asks without the request.
        return lookup in self.allowed_lookups(request)

    def allowed_lookups(self, request: HttpRequest | None = None) -> set[str]:
        """The query parameters a list of these rows may be filtered by: each
        filter's, the date hierarchy's and :attr:`linked_lookups`."""
        allowed = set(self.linked_lookups)
        if self.date_hierarchy:
            allowed |= {f"{self.date_hierarchy}__{part}" for part in ("year", "month", "day")}
        list_filter = self.get_list_filter(request) if request is not None else self.list_filter
        for item in list_filter:
            if isinstance(item, type):
                if issubclass(item, admin.SimpleListFilter) and item.parameter_name:
                    allowed.add(item.parameter_name)
                continue
            # A field's own filter, of its choices (a status, a lane).
            field = item[0] if isinstance(item, tuple | list) else item
            name = field.name if isinstance(field, Field) else field
            if isinstance(name, str):
                allowed |= {f"{name}__exact", f"{name}__isnull"}
        return allowed


def kept_text(model: type[Model], field: str, *, blank: str = "") -> Callable[[Any, Any], str]:
    """A column, or a field of a row's page, showing ``model``'s ``field`` as
    it was given (a host project's tag, a stranger's host) :func:`escaped`,
    under the field's name and sorted by it."""
    found = model._meta.get_field(field)
    description = getattr(found, "verbose_name", field)

    def column(model_admin: Any, obj: Any) -> str:
        value = getattr(obj, field)
        return escaped(value) if value not in (None, "") else blank

    return admin.display(description=description, ordering=field)(column)


def host_searched(search_term: str) -> str:
    """The host a search names when it is not written as hosts are kept
    (``Bücher.Example.``, a URL on it); "" when it is, or names none."""
    term = search_term.strip()
    named = host_named(term)
    return named if named and named != term else ""


def can(request: HttpRequest, action: str, model: type[Model]) -> bool:
    opts = model._meta
    return request.user.has_perm(f"{opts.app_label}.{action}_{opts.model_name}")


def may_view(request: HttpRequest, site: admin.AdminSite, model: type[Model]) -> bool:
    """Whether the user may see ``model``'s rows on ``site``, as its own admin
    answers (the view or the change permission): another page shows them,
    and links to their list, only then, rather than a link answered 403."""
    model_admin = site._registry.get(model)
    return model_admin is not None and model_admin.has_view_permission(request)


def unlinked(
    fieldsets: Any, request: HttpRequest, site: admin.AdminSite, links: dict[str, Any]
) -> Any:
    """``fieldsets`` with each field of ``links`` (a field's name: the model
    it links to, and the field showing the same without a link) replaced by
    its plain twin where the user may not view that model: a row's page
    links to no page that answers 403."""
    hidden = {
        field: plain
        for field, (model, plain) in links.items()
        if not may_view(request, site, model)
    }
    if not hidden:
        return fieldsets
    return tuple(
        (name, {**options, "fields": tuple(hidden.get(f, f) for f in options["fields"])})
        for name, options in fieldsets
    )


def report(
    model_admin: admin.ModelAdmin[Any], request: HttpRequest, count: int, message: str
) -> None:
    level = messages.SUCCESS if count else messages.WARNING
    model_admin.message_user(request, message, level)


def pretty_json(text: str) -> SafeString:
    # A body that is not JSON is shown as it is stored; so is one nested too
    # deep to read again, or one escaping half a surrogate pair, which no
    # page can hold unescaped (each a row written by hand: a send refuses it).
    with contextlib.suppress(ValueError, RecursionError):
        pretty = json.dumps(json.loads(text), indent=2, ensure_ascii=False)
        if not pretty.isprintable():
            # What JSON leaves as it is but a page would act on (a bidi
            # override, a line separator) as its JSON escape: still the same
            # JSON, shown as every other kept text is.
            pretty = "".join(
                char if char.isprintable() or char == "\n" else json.dumps(char)[1:-1]
                for char in pretty
            )
        pretty.encode()
        text = pretty
    return format_html('<pre class="fd-body">{}</pre>', text)


def posted_action(request: HttpRequest) -> str:
    """The action a list's form posted, chosen as the admin chooses it: a
    form with actions above and below the list posts two, and ``index``
    says which was used (the last, read alone, is the unused one's "")."""
    posted = request.POST.getlist("action") or [""]
    try:
        index = int(request.POST.get("index", 0))
    except ValueError:
        index = 0
    try:
        return posted[index]
    except IndexError:
        return posted[-1]  # the admin then validates the last


def changelist_url(model: type[Model], site: admin.AdminSite, **params: Any) -> str:
    opts = model._meta
    url = reverse(f"admin:{opts.app_label}_{opts.model_name}_changelist", current_app=site.name)
    return f"{url}?{urlencode(params)}" if params else url


def host_count(count: int) -> str:
    return ngettext("%(count)d host", "%(count)d hosts", count) % {"count": count}


def pending_count(count: int) -> str:
    return ngettext("%(count)d pending delivery", "%(count)d pending deliveries", count) % {
        "count": count
    }


def pause_and_report(
    model_admin: admin.ModelAdmin[Any], request: HttpRequest, names: list[str], *, using: str
) -> None:
    # Each host by its name as kept (a row's, a breaker's), whatever it holds,
    # in the database of the rows that named it.
    already = hosts.paused_hosts(names, using=using)
    pausing = [name for name in names if name not in already]
    held = hosts.pause_hosts(pausing, using=using)
    message = _("Paused %(hosts)s: %(deliveries)s held until resumed.") % {
        "hosts": host_count(len(pausing)),
        "deliveries": pending_count(held),
    }
    if already:
        message += " " + ngettext(
            "%(count)d host was paused already.",
            "%(count)d hosts were paused already.",
            len(already),
        ) % {"count": len(already)}
    report(model_admin, request, len(pausing), message)


def resume_and_report(
    model_admin: admin.ModelAdmin[Any], request: HttpRequest, names: list[str], *, using: str
) -> None:
    paused = sorted(hosts.paused_hosts(names, using=using))
    released = hosts.resume_hosts(paused, using=using)
    held = ngettext("%(count)d held delivery", "%(count)d held deliveries", released) % {
        "count": released
    }
    report(
        model_admin,
        request,
        len(paused),
        _("Resumed %(hosts)s: %(deliveries)s due now.")
        % {"hosts": host_count(len(paused)), "deliveries": held},
    )


def give_up_and_report(
    model_admin: admin.ModelAdmin[Any], request: HttpRequest, names: list[str], *, using: str
) -> None:
    # A chunk of names a statement, as controls.give_up acts on its ids:
    # "select all" may name more hosts than SQLite takes parameters in one.
    pending = Delivery.objects.using(using).filter(status=Status.PENDING)
    count = sum(
        controls.give_up(pending.filter(host__in=names[start : start + controls.CHUNK]))
        for start in range(0, len(names), controls.CHUNK)
    )
    report(
        model_admin,
        request,
        count,
        _("Gave up %(deliveries)s to %(hosts)s.")
        % {"deliveries": pending_count(count), "hosts": host_count(len(names))},
    )


def next_due(delivery: Delivery, now: dt.datetime) -> str:
    """When a delivery is next due, relative to ``now``."""
    if delivery.status != Status.PENDING:
        return "—"
    if delivery.due_at is None:
        if delivery.after_id is not None:
            return _("held: waits on #%(id)s") % {"id": delivery.after_id}
        return _("held: host paused")
    # As instants, USE_TZ or not: with it off, two wall-clock times of
    # TIME_ZONE are an hour apart too many across the hour a clock skips.
    due, at = aware(delivery.due_at).astimezone(dt.UTC), aware(now).astimezone(dt.UTC)
    if due > at:
        if delivery.lease_token:
            return _("in flight (lease ends in %(time)s)") % {"time": timeuntil(due, at)}
        return _("in %(time)s") % {"time": timeuntil(due, at)}
    if at - due < dt.timedelta(minutes=1):
        return _("due now")
    return _("due %(time)s ago") % {"time": timesince(due, at)}
