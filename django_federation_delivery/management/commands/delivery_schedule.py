"""``manage.py delivery_schedule``: the django-q2 schedules of contrib.django_q."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.core.management.base import CommandError, CommandParser
from django.db import DatabaseError
from django.utils.translation import gettext as _
from django.utils.translation import gettext_noop, ngettext

from django_federation_delivery.addresses import quoted
from django_federation_delivery.management.base import TranslatedCommand


class Command(TranslatedCommand):
    help = gettext_noop(
        "Create or bring up to date the django-q2 schedules that deliver from a "
        "qcluster instead of run_deliverer: a round of the deliverer every minute "
        "and a purge every hour. Safe to run again. Needs the 'django-q' extra."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--round-seconds",
            default=None,
            help=_(
                "How long each round claims and sends before it finishes what is in "
                "flight (default: 50, or less if Q_CLUSTER's timeout and retry need it)."
            ),
        )
        parser.add_argument(
            "--no-purge",
            action="store_true",
            help=_("Schedule the rounds only, and delete the purge's schedule if it made one."),
        )
        parser.add_argument(
            "--remove", action="store_true", help=_("Delete both schedules instead.")
        )

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            from django_federation_delivery.contrib import django_q
        except ImportError as exc:
            raise CommandError(str(exc)) from exc
        if options["remove"] and (options["round_seconds"] is not None or options["no_purge"]):
            raise CommandError(_("--remove deletes both schedules: it takes no other option"))
        if options["remove"]:
            with _schedules_readable():
                try:
                    deleted = django_q.remove_schedules()
                except ImproperlyConfigured as exc:
                    raise CommandError(str(exc)) from exc
            self.stdout.write(
                ngettext("Deleted %(count)d schedule.", "Deleted %(count)d schedules.", deleted)
                % {"count": deleted}
            )
            return
        seconds = None
        if options["round_seconds"] is not None:
            value = options["round_seconds"]
            try:
                seconds = float(value)  # text, or a number given to call_command
            except (TypeError, ValueError, OverflowError):
                seconds = 0.0
            # Under a second, a round would end before its deliverer had
            # claimed; past a day, the rounds refuse it (MOST_SECONDS).
            if not 1 <= seconds <= django_q.MOST_SECONDS:
                raise CommandError(
                    _(
                        "--round-seconds expects a number of seconds, from 1 to %(most)g, "
                        "not %(value)s"
                    )
                    % {"value": quoted(value), "most": django_q.MOST_SECONDS}
                )
        with _schedules_readable():
            try:
                done = django_q.ensure_schedules(seconds=seconds, purge=not options["no_purge"])
            except ImproperlyConfigured as exc:
                raise CommandError(str(exc)) from exc
        bound = django_q.round_seconds(seconds)
        said = {
            "created": _("created"),
            "updated": _("updated"),
            "unchanged": _("unchanged"),
            "deleted": _("deleted"),
        }
        for name, what in done.items():
            self.stdout.write(f"{name}: {said[what]}")
        self.stdout.write(
            self.style.SUCCESS(
                (
                    _("A round of %(seconds)g s every minute: run qcluster to start them.")
                    if options["no_purge"]
                    else _(
                        "A round of %(seconds)g s every minute, a purge every hour: "
                        "run qcluster to start them."
                    )
                )
                % {"seconds": bound}
            )
        )


@contextlib.contextmanager
def _schedules_readable() -> Iterator[None]:
    """django-q's schedules that cannot be read or written (its migrations
    not run, the database away): a ``CommandError`` saying so, not a
    traceback."""
    try:
        yield
    except DatabaseError as exc:
        # The first line of the database's own words: psycopg adds more.
        said = str(exc).strip().partition("\n")[0][:200] or type(exc).__name__
        raise CommandError(
            _(
                "django-q's schedules cannot be written (%(error)s): are its "
                "migrations applied (manage.py migrate django_q)?"
            )
            % {"error": said}
        ) from exc
