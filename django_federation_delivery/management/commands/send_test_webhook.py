"""``manage.py send_test_webhook NAME``: a ``ping`` to a destination now, for setting one up."""

from __future__ import annotations

import sys
import time
import uuid
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.core.management.base import CommandError, CommandParser
from django.utils.translation import gettext as _
from django.utils.translation import gettext_noop

from django_federation_delivery.addresses import escaped, quoted_name
from django_federation_delivery.channels import Call, Event
from django_federation_delivery.channels.base import policy_of
from django_federation_delivery.conf import app_settings
from django_federation_delivery.management.base import TranslatedCommand
from django_federation_delivery.transport import Connections, Transport, status_text
from django_federation_delivery.webhooks.deliveries import webhook_transport_settings
from django_federation_delivery.webhooks.destinations import configured
from django_federation_delivery.webhooks.policy import WebhookPolicy
from django_federation_delivery.webhooks.sending import event_time
from django_federation_delivery.workers import guarded

#: The exit status when the destination did not take the ping.
NOT_DELIVERED = 1


class Command(TranslatedCommand):
    help = gettext_noop(
        "Send a 'ping' event to the webhook destination NAME now, outside the queue "
        "(nothing is written), and print what it answered: the status, the time it "
        "took, and the error with the URL's secret parts taken out. Exits 1 unless it "
        "was delivered."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("name", help=_("The destination's name, as in WEBHOOKS."))

    def handle(self, *args: Any, **options: Any) -> None:
        name = options["name"]
        try:
            found = configured()
            destination = found.lookup(name)
            if destination is None:
                raise CommandError(
                    _("no webhook destination named %(name)s is configured (configured: %(known)s)")
                    % {
                        "name": quoted_name(name),
                        "known": escaped(", ".join(found.names)) or _("none"),
                    }
                )
            if isinstance(destination, str):
                raise CommandError(destination)  # what is wrong, never the URL
            WebhookPolicy.from_settings()  # the settings it starts from, checked
            policy = WebhookPolicy.of(policy_of(destination.channel))
        # As manage.py check would have said, had it run (--skip-checks).
        except ImproperlyConfigured as exc:
            raise CommandError(str(exc)) from None
        settings = webhook_transport_settings(app_settings.transport_settings(), policy.policy)
        event = Event.of("ping", uuid.uuid4(), event_time(), {"test": True})
        connections = Connections(settings)
        transport = Transport(settings, connections)
        try:
            call = Call(
                delivery_id=0,
                destination=destination,
                event=event,
                body_length=policy.body_length,
            )
            # As a worker makes it: whatever the kind's code raises or
            # returns, a result, its error named by type, escaped.
            result = guarded(
                call,
                lambda: destination.attempted(call, transport),
                started=time.monotonic(),
                what="a test ping",
                by=type(destination.channel).__name__,
            )
        finally:
            transport.close()
            connections.close()
        answered = status_text(result.status) if result.status is not None else _("no answer")
        line = _("%(destination)s: %(answered)s in %(seconds).3f s") % {
            "destination": destination.display,
            "answered": answered,
            "seconds": result.duration,
        }
        if result.delivered:
            self.stdout.write(_("%(line)s: delivered.") % {"line": line})
            return
        self.stdout.write(
            _("%(line)s: not delivered: %(error)s") % {"line": line, "error": result.error}
        )
        self.stdout.flush()
        sys.exit(NOT_DELIVERED)
