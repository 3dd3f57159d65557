"""``manage.py delivery_status``: the admin's queues page, in a terminal;
with ``--check``, a health check for a probe (Kubernetes, Nagios, cron)."""

from __future__ import annotations

import datetime as dt
import json
import socket
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NoReturn

from django.core import checks
from django.core.management.base import CommandError, CommandParser, SystemCheckError
from django.db import DatabaseError
from django.utils.translation import gettext as _
from django.utils.translation import gettext_noop, ngettext

from django_federation_delivery import heartbeats, store
from django_federation_delivery.addresses import escaped, quoted, redact
from django_federation_delivery.dialect import aware
from django_federation_delivery.management.base import (
    TranslatedCommand,
    add_database_option,
    database_named,
    require_database,
    whole,
)
from django_federation_delivery.overview import (
    BREAKER_STATES,
    Overview,
    format_duration,
    lag,
    overview,
    stalled,
)
from django_federation_delivery.picture import HostPicture, host_picture, milliseconds
from django_federation_delivery.webhooks.status import DestinationStatus, destination_status

if TYPE_CHECKING:
    from django.apps import AppConfig

#: ``--check`` exits with this when unhealthy: Nagios's CRITICAL; any
#: non-zero status fails a Kubernetes exec probe.
UNHEALTHY = 2
#: ``--check`` exits with this when something needs an operator but nothing is
#: lost yet: Nagios's WARNING.
WARNED = 1
#: ``--check`` exits with this when it cannot check as asked (an unknown
#: database, a bad number): Nagios's UNKNOWN, never read as a warning.
UNKNOWN = 3
#: ``--max-lag`` by default, in seconds.
MAX_LAG = 300


#: The most hosts listed, and of seconds of lag allowed.
MOST_HOSTS = 100_000
MOST_SECONDS = 10**9


def _count(value: str) -> int:
    return whole(
        value, 0, MOST_HOSTS, _("expected a whole number from %(least)d to %(most)d, not %(value)s")
    )


def _seconds(value: str) -> int:
    return whole(
        value,
        0,
        MOST_SECONDS,
        _("expected a whole number of seconds from %(least)d to %(most)d, not %(value)s"),
    )


def _when(value: Any) -> str:
    """A time in UTC, as the header says every time shown is: one read naive
    (``USE_TZ = False``) is in ``TIME_ZONE``."""
    if value is None:
        return "—"
    return aware(value).astimezone(dt.UTC).strftime("%Y-%m-%d %H:%M:%S")


def _json(document: dict[str, Any]) -> str:
    return json.dumps(document, indent=2, default=_bytes_shown)


def _bytes_shown(value: Any) -> str:
    """``json.dumps``'s hook for what JSON has no type for: a column SQLite
    keeps as a BLOB (written by hand: the package writes text) is read as
    bytes. Given as the tables show it (``b'a.example'``), escaped, not
    decoded: the row holds no such text, which a script would take for a
    host's name."""
    if isinstance(value, bytes):
        return escaped(value)
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], *, numeric: int = 1) -> str:
    """Columns padded to their widest cell; those from ``numeric`` on right-aligned."""
    cells = [list(map(escaped, headers)), *([escaped(cell) for cell in row] for row in rows)]
    widths = [max(len(row[column]) for row in cells) for column in range(len(headers))]
    lines = []
    for row in cells:
        padded = [
            cell.rjust(width) if column >= numeric else cell.ljust(width)
            for column, (cell, width) in enumerate(zip(row, widths, strict=True))
        ]
        lines.append("  ".join(padded).rstrip())
    return "\n".join(lines)


def render_host(picture: HostPicture) -> str:
    """One host's picture, a line a fact."""

    breaker = BREAKER_STATES.get(picture.breaker, picture.breaker)
    rows = [
        (_("trouble"), picture.trouble),
        (_("first seen"), _when(picture.first_seen_at)),
        (_("last delivered"), _when(picture.last_delivered_at)),
        (_("failing since"), _when(picture.failing_since)),
        (_("unavailable since"), _when(picture.unavailable_since)),
        (_("paused at"), _when(picture.paused_at)),
        (_("breaker"), f"{breaker} ({picture.failures_in_a_row} {_('failures in a row')})"),
        (_("scheme learned"), picture.scheme or "—"),
        (
            _("answer time p50 / p95"),
            f"{milliseconds(picture.answer_p50_ms)} / {milliseconds(picture.answer_p95_ms)}",
        ),
        (_("limit at once"), picture.concurrency_limit or "—"),
        (_("resting until"), _when(picture.resting_until)),
        (_("pending (held)"), f"{picture.pending} ({picture.held})"),
        (
            _("last 24 hours"),
            # What came of them, not the outcomes that none came to.
            ", ".join(f"{status} {count}" for status, count in picture.last_day.items() if count)
            or "—",
        ),
        (_("last error"), f"{_when(picture.last_error_at)} {picture.last_error}".strip()),
    ]
    return f"{escaped(picture.name)}\n" + table(["", ""], rows, numeric=2).split("\n", 1)[1]


def render(
    status: Overview, destinations: Sequence[DestinationStatus] = (), *, failing: bool = True
) -> str:
    """The overview as text tables, as the admin's queues page shows it;
    without the hosts failing most unless ``failing`` (``--hosts 0``)."""
    lanes = table(
        [
            _("lane"),
            _("due"),
            _("scheduled"),
            _("in flight"),
            _("held"),
            _("lag"),
            _("delivered 1h"),
            _("failed 24h"),
            _("superseded 24h"),
        ],
        [
            [
                lane.lane,
                lane.due,
                lane.scheduled,
                lane.in_flight,
                lane.held,
                format_duration(lane.lag) if lane.oldest_due_at else "—",
                lane.delivered_last_hour,
                lane.failed_last_day,
                lane.superseded_last_day,
            ]
            for lane in (*status.lanes, status.total)
        ],
    )
    parts = [
        _("Queues at %(time)s UTC") % {"time": _when(status.at)},
        "",
        lanes,
        "",
        _("Deliverers"),
    ]
    if status.deliverers:
        parts.append(
            table(
                [
                    _("host"),
                    _("pid"),
                    _("version"),
                    _("up since"),
                    _("last seen"),
                    _("in flight"),
                    _("delivered/s"),
                ],
                [
                    [
                        deliverer.host,
                        deliverer.pid,
                        deliverer.version,
                        _when(deliverer.started_at),
                        _when(deliverer.last_seen),
                        deliverer.in_flight,
                        f"{deliverer.rate:.1f}",
                    ]
                    for deliverer in status.deliverers
                ],
                numeric=5,
            )
        )
        more = status.deliverer_count - len(status.deliverers)
        if more > 0:
            parts.append("  " + _("and %(count)d more") % {"count": more})
    else:
        last = status.deliverer_last_seen
        parts.append(
            "  "
            + (
                _("none running (last seen %(time)s)") % {"time": _when(last)}
                if last
                else _("none running")
            )
        )
    if failing:
        parts += ["", _("Hosts failing most")]
    if status.failing_hosts:
        parts.append(
            table(
                [
                    _("host"),
                    _("retrying"),
                    _("last status"),
                    _("breaker"),
                    _("failures"),
                    _("open until"),
                    _("paused"),
                ],
                [
                    [
                        host.host,
                        host.retrying,
                        "—" if host.last_status is None else host.last_status,
                        BREAKER_STATES.get(host.breaker, host.breaker) or "—",
                        host.failures,
                        _when(host.open_until),
                        _("paused") if host.paused else "—",
                    ]
                    for host in status.failing_hosts
                ],
                numeric=1,
            )
        )
    elif failing:
        parts.append("  " + _("none"))
    parts += ["", _("Breakers open now: %(count)d") % {"count": status.open_breaker_count}]
    if status.open_breakers:
        parts.append(
            table(
                [_("destination"), _("state"), _("failures"), _("open until"), _("probe")],
                [
                    [
                        # Cut as the admin's list cuts it (the JSON has it whole).
                        redact(breaker.key),
                        BREAKER_STATES.get(breaker.state, breaker.state),
                        breaker.failures,
                        _when(breaker.open_until),
                        _("under way") if breaker.probing else "—",
                    ]
                    for breaker in status.open_breakers
                ],
                numeric=2,
            )
        )
    paused = ", ".join(escaped(host) for host in status.paused_hosts)
    more = status.paused_host_count - len(status.paused_hosts)
    if more > 0:
        paused += _(", and %(count)d more") % {"count": more}
    parts += ["", _("Paused hosts: %(hosts)s") % {"hosts": paused or _("none")}]
    if destinations:
        parts += ["", _("Webhook destinations")]
        parts.append(
            table(
                [_("destination"), _("kind"), _("pending"), _("state")],
                [
                    [
                        escaped(destination.name),
                        destination.kind or _("no longer configured"),
                        destination.pending,
                        escaped(destination.state(status.at)),
                    ]
                    for destination in destinations
                ],
                numeric=2,
            )
        )
    if status.stalled:
        # Last, where a terminal leaves the eye.
        parts += ["", _("WARNING: %(why)s.") % {"why": status.stalled}]
    return "\n".join(parts)


class Command(TranslatedCommand):
    help = gettext_noop(
        "Show the delivery queues: each lane's due, scheduled, in-flight and held "
        "deliveries and its lag, recent outcomes, the hosts failing most and the "
        "open breakers, the live deliverers. --json for scripts; --check for a probe: "
        "exits %(status)d with one line saying why when work is due and no deliverer is "
        "alive, or the oldest due delivery has waited longer than --max-lag."
    )

    def translated_help(self) -> str:
        return _(self.help) % {"status": UNHEALTHY}

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--json", action="store_true", help=_("Print JSON, for scripts."))
        parser.add_argument(
            "--hosts",
            type=str,
            default="10",
            help=_("How many of the hosts failing most to show (default 10)."),
        )
        parser.add_argument(
            "--host",
            metavar="NAME",
            help=_(
                "Show one host's picture instead: first seen, last delivered, failing and "
                "unavailable since, breaker, pause, scheme, answer times, limit, pending, "
                "the last 24 hours and its last error."
            ),
        )
        add_database_option(parser)
        parser.add_argument(
            "--check",
            action="store_true",
            help=_(
                "Print one line and exit 0 when healthy; %(critical)d (CRITICAL) when work is "
                "due and no deliverer has been seen for %(seconds)g s, the oldest due "
                "delivery has waited longer than --max-lag, a webhook destination is "
                "disabled, or the queue cannot be read; %(warning)d (WARNING) when events "
                "wait for a webhook destination no longer configured; %(unknown)d (UNKNOWN) "
                "when the check cannot be made as asked, or the settings fail the system "
                "checks."
            )
            % {
                "critical": UNHEALTHY,
                "warning": WARNED,
                "unknown": UNKNOWN,
                "seconds": heartbeats.NO_DELIVERER_AFTER,
            },
        )
        parser.add_argument(
            "--max-lag",
            type=str,
            default=None,
            help=_(
                "With --check: the longest a due delivery may wait, in seconds (default "
                "%(seconds)d; 0 to not check the lag)."
            )
            % {"seconds": MAX_LAG},
        )
        parser.add_argument(
            "--this-host",
            action="store_true",
            help=_(
                "With --check: count only the deliverers on this machine (its host name), "
                "as a probe beside one deliverer wants."
            ),
        )

    #: Whether the command runs as ``--check``: its system checks are then
    #: the probe's too.
    probing = False

    def run_from_argv(self, argv: list[str]) -> None:
        # Arguments argparse refuses from a command line end the process with
        # its status 2, CRITICAL to a probe: with --check (or an abbreviation
        # argparse takes for it, or either given a value with "="), they are
        # the probe's UNKNOWN line instead.
        self.probing = any(
            len(name) > 2 and "--check".startswith(name)
            for name in (arg.split("=", 1)[0] for arg in argv[2:])
        )
        super().run_from_argv(argv)

    def create_parser(self, prog_name: str, subcommand: str, **kwargs: Any) -> CommandParser:
        parser = super().create_parser(prog_name, subcommand, **kwargs)
        if self.probing:
            parser.error = self._unknown_arguments  # type: ignore[method-assign]
        return parser

    def _unknown_arguments(self, message: str) -> NoReturn:
        self.stdout.write(f"UNKNOWN: {escaped(message)}")
        self.stdout.flush()
        sys.exit(UNKNOWN)

    def execute(self, *args: Any, **options: Any) -> Any:
        self.probing = bool(options.get("check"))
        if not self.probing:
            return super().execute(*args, **options)
        try:
            return super().execute(*args, **options)
        except CommandError as exc:
            # A probe reads the first word and the status: the option is
            # wrong (here, or Django's own: --force-color with --no-color),
            # which says nothing of the queue.
            self._unknown_arguments(str(exc))

    def waits_for_the_database(self) -> bool:
        return self.probing  # the probe's line says the queue cannot be read

    def check(
        self,
        app_configs: Sequence[AppConfig] | None = None,
        tags: Sequence[str] | None = None,
        display_num_errors: bool = False,
        include_deployment_checks: bool = False,
        fail_level: int = checks.ERROR,
        databases: Sequence[str] | None = None,
    ) -> None:
        """The system checks, which every command runs first. With
        ``--check``, settings that fail them are said in the probe's one
        line, as UNKNOWN, naming the checks: ``SystemCheckError`` would exit
        1, Nagios's WARNING, with no such line, and what a deliverer refuses
        to start with says nothing of the queue."""
        try:
            super().check(
                app_configs,
                tags,
                display_num_errors,
                include_deployment_checks,
                fail_level,
                databases,
            )
        except SystemCheckError:
            if not self.probing:
                raise
            # SystemCheckError keeps only its text: the issues are read again
            # for their ids alone, as their messages may quote a setting's
            # value, and a probe's line ends up in mails and pages.
            failing = [
                issue
                for issue in checks.run_checks(
                    app_configs=app_configs,
                    tags=tags,
                    include_deployment_checks=include_deployment_checks,
                    databases=databases,
                )
                if issue.is_serious(fail_level) and not issue.is_silenced()
            ]
            ids = ", ".join(sorted({escaped(issue.id or "?") for issue in failing}))
            why = ngettext(
                "settings no deliverer starts with: they fail the system check %(ids)s "
                "(manage.py check says why)",
                "settings no deliverer starts with: they fail %(count)d system checks "
                "(%(ids)s; manage.py check says why)",
                len(failing),
            ) % {"count": len(failing), "ids": ids}
            self.stdout.write(f"UNKNOWN: {why}")
            self.stdout.flush()
            sys.exit(UNKNOWN)

    def handle(self, *args: Any, **options: Any) -> None:
        hosts = _count(options["hosts"])
        using = database_named(options["database"])
        if options["check"] and (options["host"] is not None or options["json"]):
            raise CommandError(
                _("--check prints one line for the whole queue: it takes neither --host nor --json")
            )
        if not options["check"] and (options["this_host"] or options["max_lag"] is not None):
            raise CommandError(_("--this-host and --max-lag go with --check"))
        if options["check"]:
            max_lag = _seconds(
                options["max_lag"] if options["max_lag"] is not None else str(MAX_LAG)
            )
            try:
                healthy, line = check(
                    max_lag=max_lag,
                    host=socket.gethostname() if options["this_host"] else None,
                    using=using,
                )
                code = 0 if healthy else UNHEALTHY
                if healthy:
                    # The queue is worked; a destination may still need an operator.
                    code, line = destinations_check(using=using) or (0, line)
            except DatabaseError as exc:
                # Away, or without its tables: nothing can be delivered either.
                error = escaped(str(exc).strip().splitlines()[0] if str(exc).strip() else "")
                unread = _("the queue cannot be read (%(error)s)") % {
                    "error": error[:200] or type(exc).__name__
                }
                code, line = UNHEALTHY, f"CRITICAL: {unread}"
            self.stdout.write(line)
            if code:
                self.stdout.flush()
                sys.exit(code)
            return
        require_database(using)
        if options["host"] is not None:
            picture = host_picture(options["host"], using=using)
            if picture is None:
                raise CommandError(
                    _("no host named %(host)s has been sent to") % {"host": quoted(options["host"])}
                )
            if options["json"]:
                self.stdout.write(_json(picture.as_json()))
            else:
                self.stdout.write(render_host(picture))
            return
        status = overview(hosts=hosts, using=using)
        destinations = destination_status(now=status.at, using=using)
        if options["json"]:
            document = status.as_json()
            document["webhook_destinations"] = [d.as_json() for d in destinations]
            self.stdout.write(_json(document))
        else:
            self.stdout.write(render(status, destinations, failing=hosts > 0))


def check(*, max_lag: int, host: str | None = None, using: str) -> tuple[bool, str]:
    """Whether the queue is being worked, and one line saying so or why not:
    a few index reads and one small query, cheap enough for a probe every
    few seconds."""
    from django.utils import timezone

    now = timezone.now()
    due = store.count_due(using=using)
    seen = heartbeats.seen(now=now, host=host, using=using)
    where = _(" on %(host)s") % {"host": escaped(host)} if host is not None else ""
    stalled_because = stalled(seen, due, now, where=where)
    # OK, WARNING, CRITICAL and UNKNOWN stay as they are in any language:
    # monitoring reads them.
    if stalled_because:
        return False, f"CRITICAL: {stalled_because}"
    alive = _("%(count)d deliverer(s) alive%(where)s") % {"count": seen.alive, "where": where}
    waited = lag(now=now, using=using)
    if max_lag and waited > max_lag:
        late = _(
            "the oldest due delivery has waited %(waited)s, longer than --max-lag %(most)d s "
            "(%(due)d due, %(alive)s)"
        ) % {"waited": format_duration(waited), "most": max_lag, "due": due, "alive": alive}
        return False, f"CRITICAL: {late}"
    healthy = _("%(alive)s, %(due)d due, lag %(lag)s") % {
        "alive": alive,
        "due": due,
        "lag": format_duration(waited),
    }
    return True, f"OK: {healthy}"


def destinations_check(*, using: str) -> tuple[int, str] | None:
    """A webhook destination that needs an operator, as ``--check`` says it:
    one disabled (CRITICAL: its events, those waiting and any sent since,
    wait until it is enabled), or events waiting for one no longer
    configured (WARNING: a deliverer gives them up); None if none."""
    destinations = destination_status(using=using)
    disabled = [d for d in destinations if d.disabled and d.configured]
    if disabled:
        named = "; ".join(
            _("%(name)s (%(pending)d waiting): %(reason)s")
            % {
                "name": escaped(d.name),
                "pending": d.pending,
                "reason": escaped(d.disabled_reason or _("paused")),
            }
            for d in disabled
        )
        why = _(
            "webhook destination(s) disabled, their events held until enabled again: "
            "%(named)s (manage.py enable_webhook NAME)"
        ) % {"named": named}
        return UNHEALTHY, f"CRITICAL: {why}"
    removed = [d for d in destinations if not d.configured and d.pending]
    if removed:
        named = ", ".join(f"{escaped(d.name)} ({d.pending})" for d in removed)
        why = _(
            "events wait for webhook destination(s) no longer configured, which a "
            "deliverer gives up: %(named)s"
        ) % {"named": named}
        return WARNED, f"WARNING: {why}"
    return None
