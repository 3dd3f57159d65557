"""``manage.py enable_webhook NAME``: a disabled webhook destination sends again."""

from __future__ import annotations

from typing import Any

from django.core.management.base import CommandError, CommandParser
from django.utils.translation import gettext as _
from django.utils.translation import gettext_noop

from django_federation_delivery.addresses import escaped, quoted_name
from django_federation_delivery.management.base import (
    TranslatedCommand,
    add_database_option,
    database_named,
    require_database,
)
from django_federation_delivery.webhooks import life
from django_federation_delivery.webhooks.status import destination_status


class Command(TranslatedCommand):
    help = gettext_noop(
        "Enable a webhook destination the deliverer disabled (a 410 Gone, or no success "
        "for WEBHOOK_DISABLE_AFTER), or an operator paused: its waiting events are due "
        "now, and go in the order they were sent."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("name", help=_("The destination's name, as in WEBHOOKS."))
        add_database_option(parser)

    def handle(self, *args: Any, **options: Any) -> None:
        name, using = options["name"], database_named(options["database"])
        require_database(using)
        found = {status.name for status in destination_status(using=using)}
        if name not in found:
            raise CommandError(
                _("no webhook destination named %(name)s (known: %(known)s)")
                % {
                    "name": quoted_name(name),
                    "known": escaped(", ".join(sorted(found))) or _("none"),
                }
            )
        self.stdout.write(life.enabled(name, life.enable(name, using=using)))
