"""``manage.py delivery_replay --host NAME --since TIME``: send a host again
what it was sent since then (``--destination NAME`` for a webhook destination)."""

from __future__ import annotations

import datetime as dt
from typing import Any

from django.core.management.base import CommandError, CommandParser
from django.utils import timezone
from django.utils.dateparse import parse_datetime
from django.utils.translation import gettext as _
from django.utils.translation import gettext_noop

from django_federation_delivery.addresses import host_named, quoted, quoted_name
from django_federation_delivery.conf import shown
from django_federation_delivery.dialect import aware_now
from django_federation_delivery.management.base import (
    TranslatedCommand,
    add_database_option,
    database_named,
    require_database,
)
from django_federation_delivery.replay import ever_sent, replay, replayed


class Command(TranslatedCommand):
    help = gettext_noop(
        "Queue again, in new batches and in their original order, what was delivered to a "
        "host (or a webhook destination), or given up on it, since a moment: after it was "
        "restored from a backup, say."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        which = parser.add_mutually_exclusive_group(required=True)
        which.add_argument("--host", help=_("An inbox's host, as the admin's hosts list has it."))
        which.add_argument("--destination", help=_("A webhook destination's name."))
        parser.add_argument(
            "--since",
            required=True,
            help=_(
                "The moment to replay from: a date and time such as 2026-12-01T08:00 (in "
                "the current time zone unless it says its own), or a span back from now "
                "such as 6h or 2d."
            ),
        )
        add_database_option(parser)

    def handle(self, *args: Any, **options: Any) -> None:
        using = database_named(options["database"])
        require_database(using)
        for option in ("host", "destination"):
            value = options[option]
            if value is not None and not value.strip():
                raise CommandError(
                    _("--%(option)s %(value)r names nothing") % {"option": option, "value": value}
                )
            if value is not None and not value.isprintable():
                raise CommandError(
                    _("--%(option)s %(value)s holds a character no name holds")
                    % {"option": option, "value": quoted(value)}
                )
        since = moment(options["since"])
        host, destination = options["host"] or "", options["destination"] or ""
        if host and not host_named(host):  # "http://"
            raise CommandError(_("--host %(value)s names no host") % {"value": quoted(host)})
        try:
            batches = replay(host=host, destination=destination, since=since, using=using)
        except ValueError as error:
            # A destination no longer configured; a moment off the calendar
            # in TIME_ZONE (SQLite with USE_TZ off).
            raise CommandError(str(error)) from None
        if not batches and not ever_sent(host=host, destination=destination, using=using):
            # A mistyped name, not a host with nothing to send again.
            raise CommandError(
                _("no host named %(name)s has been sent to") % {"name": quoted(host)}
                if host
                else _("no webhook destination named %(name)s has been sent to")
                % {"name": quoted_name(destination)}
            )
        self.stdout.write(
            # Whole: a moment given with a fraction of a second is another
            # replay than the same moment printed without it.
            _("Since %(since)s.") % {"since": since.isoformat()} + " " + replayed(batches)
        )


#: A span back from now: its unit, in seconds.
UNITS = {"m": 60, "h": 3600, "d": 86400}
#: The longest date and time read (2026-12-01T08:00:00.000000+01:00 is 32).
MOST_MOMENT = 40


def moment(value: str | dt.datetime) -> dt.datetime:
    """``value`` as an aware datetime before now: ISO 8601, or a span back
    from now ("6h"), or a datetime given to ``call_command``;
    ``CommandError`` naming it otherwise (a moment not in the past would
    replay nothing, and say so as if it had looked)."""
    if isinstance(value, dt.datetime):
        return _in_the_past(value, quoted(value.isoformat()))
    if not isinstance(value, str):
        raise _neither(shown(value))
    text = value.strip()
    named = quoted(value)
    number = text[:-1]
    if number.isascii() and number.isdigit() and text[-1:] in UNITS:
        if not number.strip("0"):
            raise _not_past(named)
        try:
            # Past 10**12 units, before the year 1 whatever the unit.
            if len(number) > 12:
                raise OverflowError
            # In whole seconds, as its line prints it: that moment given
            # again (--since) is this replay's, and queues nothing more.
            back = aware_now() - dt.timedelta(seconds=int(number) * UNITS[text[-1]])
            return back.replace(microsecond=0)
        except OverflowError:
            raise CommandError(
                _("--since %(value)s reaches back before the year 1") % {"value": named}
            ) from None
    parsed = None
    if len(text) <= MOST_MOMENT:
        try:
            parsed = parse_datetime(text)
        except ValueError:
            parsed = None
    if parsed is None:
        raise _neither(named)
    return _in_the_past(parsed, named)


def _neither(named: str) -> CommandError:
    return CommandError(
        _("--since %(value)s is neither a date and time (2026-12-01T08:00) nor a span (6h)")
        % {"value": named}
    )


def _in_the_past(parsed: dt.datetime, named: str) -> dt.datetime:
    """``parsed``, aware, if it falls on the calendar in UTC and before now."""
    try:
        if timezone.is_naive(parsed):
            parsed = timezone.make_aware(parsed)
        # In UTC, as the database keeps it: a moment at the edge of the
        # calendar, with its offset, may fall off it.
        parsed.astimezone(dt.UTC)
    except (ValueError, OverflowError):
        raise CommandError(
            _("--since %(value)s falls outside the calendar in UTC") % {"value": named}
        ) from None
    if parsed >= aware_now():
        raise _not_past(named)
    return parsed


def _not_past(shown: str) -> CommandError:
    return CommandError(
        _("--since %(value)s is not in the past: what is replayed was settled since then")
        % {"value": shown}
    )
