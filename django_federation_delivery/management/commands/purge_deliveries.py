"""``manage.py purge_deliveries``: delete settled deliveries past their retention."""

from __future__ import annotations

import re
import time
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.core.management.base import CommandError, CommandParser
from django.utils.translation import gettext as _
from django.utils.translation import gettext_noop, ngettext

from django_federation_delivery import retention
from django_federation_delivery.addresses import quoted
from django_federation_delivery.checks import LONGEST_RETENTION
from django_federation_delivery.management.base import (
    TranslatedCommand,
    add_database_option,
    database_named,
    require_database,
)

UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
#: How often the progress line is written, at most.
PROGRESS_EVERY = 1.0


def parse_age(value: str) -> float:
    """``7d``, ``12h``, ``90m`` or ``3600s`` as seconds; a CommandError naming
    anything else."""
    # Text, even given to call_command: a bare number would say no unit.
    found = re.fullmatch(r"\s*(\d{1,12})\s*([smhd])\s*", value) if isinstance(value, str) else None
    seconds = int(found[1]) * UNITS[found[2]] if found else 0
    if not 0 < seconds <= LONGEST_RETENTION:
        raise CommandError(
            _(
                "--older-than expects an age such as 7d, 12h, 90m or 3600s "
                "(above 0, at most %(days).0fd), not %(value)s"
            )
            % {"days": LONGEST_RETENTION / 86400, "value": quoted(value)}
        )
    return float(seconds)


class Command(TranslatedCommand):
    help = gettext_noop(
        "Delete settled deliveries past their retention (the RETENTION setting, or "
        "--older-than for every settled status), a chunk at a time, then the batches "
        "left with no delivery and the hosts not seen since, and the history's minutes "
        "older than 7 days. Pending deliveries are never touched."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--older-than",
            default=None,
            help=_(
                "Delete every settled delivery older than this (7d, 12h, 90m, 3600s) "
                "instead of by RETENTION."
            ),
        )
        parser.add_argument(
            "--dry-run", action="store_true", help=_("Count what would be deleted; delete nothing.")
        )
        add_database_option(parser)

    def handle(self, *args: Any, **options: Any) -> None:
        using = database_named(options["database"])
        require_database(using)
        if options["older_than"] is not None:
            age = parse_age(options["older_than"])
            seconds = dict.fromkeys(retention.SETTLED, age)
        else:
            try:
                seconds = retention.retention_seconds()
            except ImproperlyConfigured as exc:
                raise CommandError(str(exc)) from exc
            if not seconds:
                # The history has a retention of its own.
                dry_run = bool(options["dry_run"])
                kept = retention.purge({}, dry_run=dry_run, using=using)
                said = (
                    ngettext(
                        "Dry run: RETENTION keeps every settled delivery; would delete "
                        "%(minutes)d history minute.",
                        "Dry run: RETENTION keeps every settled delivery; would delete "
                        "%(minutes)d history minutes.",
                        kept.history,
                    )
                    if dry_run
                    else ngettext(
                        "RETENTION keeps every settled delivery: deleted "
                        "%(minutes)d history minute.",
                        "RETENTION keeps every settled delivery: deleted "
                        "%(minutes)d history minutes.",
                        kept.history,
                    )
                )
                self.stdout.write(said % {"minutes": kept.history})
                return
        dry_run = bool(options["dry_run"])
        last = [time.monotonic()]

        def progress(deleted: int, elapsed: float) -> None:
            now = time.monotonic()
            if now - last[0] >= PROGRESS_EVERY:
                last[0] = now
                rate = deleted / max(elapsed, 1e-9)
                self.stdout.write(
                    "  "
                    + _("%(deleted)d deleted so far, %(rate).0f/s")
                    % {"deleted": deleted, "rate": rate}
                )
                self.stdout.flush()

        purged = retention.purge(
            retention.cutoffs_for(seconds), dry_run=dry_run, on_progress=progress, using=using
        )
        line = (_("Dry run: %(line)s.") if dry_run else _("%(line)s.")) % {"line": purged.line()}
        self.stdout.write(self.style.SUCCESS(line))
