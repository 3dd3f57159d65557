"""``manage.py run_deliverer``: the claim-and-send loop."""

from __future__ import annotations

import contextlib
import sys
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.core.management.base import CommandError, CommandParser
from django.db import OperationalError, connections
from django.utils.translation import gettext as _
from django.utils.translation import gettext_noop

from django_federation_delivery import metrics, store, supervisor
from django_federation_delivery.addresses import quoted
from django_federation_delivery.checks import (
    WHOLE_NUMBERS,
    deliverer_problems,
    sqlite_problems,
)
from django_federation_delivery.conf import app_settings
from django_federation_delivery.deliverer import Deliverer
from django_federation_delivery.management.base import (
    TranslatedCommand,
    add_database_option,
    database_named,
    ip_address,
    positive,
    require_migrations,
    sent_nowhere,
)
from django_federation_delivery.management.running import (
    Child,
    drain_progress,
    install_stop_signals,
    log_rates,
    prefix_log_records,
    supervise,
    watch_supervisor,
)
from django_federation_delivery.retention import PeriodicPurge, purge_by_setting

#: ``--processes``: one a core is the point; past a few hundred, a mistake.
MOST_PROCESSES = 256
#: ``--purge``: the first purge this long after the start (or after the
#: interval, if shorter), the deliverer's own start done by then.
FIRST_PURGE = 60.0
#: ``--purge-interval`` when not given: seconds between purges.
PURGE_EVERY = "3600"
#: The options a child is started with (the rest are the supervisor's).
CHILD_OPTIONS = (
    "drain",
    "concurrency",
    "per_host",
    "per_host_max",
    "database",
    "metrics_port",
    "metrics_addr",
    "log_interval",
    "purge",
    "purge_interval",
    "verbosity",
    "no_color",
    "force_color",
)


def run_child(index: int, count: int, options: dict[str, Any]) -> None:
    """One of ``run_deliverer --processes N``, in a spawned process of its own."""
    child = Child(index, count, supervisor.stop_requested)
    prefix_log_records(child.prefix)
    command = Command(no_color=options["no_color"], force_color=options["force_color"])
    command.child = child
    if options["metrics_port"] is not None:
        # Checked by the supervisor: every child's port is within 1 to 65535.
        options = {**options, "metrics_port": str(int(options["metrics_port"]) + index - 1)}
    if index != 1:
        # One purge is enough: the first child's (the supervisor owns no database).
        options = {**options, "purge": False, "purge_interval": None}
    try:
        command.handle(**options, processes="1")
    except CommandError as exc:
        command.stderr.write(f"{child.prefix}CommandError: {exc}")
        sys.exit(1)


class Command(TranslatedCommand):
    help = gettext_noop(
        "Send what is queued: claim due deliveries and send them, until stopped "
        "(SIGTERM or SIGINT finishes what is in flight; a second one exits at once). "
        "With --drain, stop once nothing is due. With --processes N, N deliverers "
        "in processes of their own under this one."
    )
    #: Set in a process started by ``--processes``.
    child: Child | None = None

    def waits_for_the_database(self) -> bool:
        return True  # the loop waits an outage out, however long

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--drain",
            action="store_true",
            help=_("Exit once nothing is due, with progress and a summary."),
        )
        parser.add_argument(
            "--concurrency",
            type=str,
            default=None,
            help=_("Deliveries in flight at once (default: CONCURRENCY, 16)."),
        )
        parser.add_argument(
            "--per-host",
            type=str,
            default=None,
            help=_(
                "Deliveries in flight at once to one host as it starts (default: PER_HOST, 2); "
                "it moves between 1 and --per-host-max as the host answers."
            ),
        )
        parser.add_argument(
            "--per-host-max",
            type=str,
            default=None,
            help=_("The most in flight at once to one host (default: PER_HOST_MAX, 8)."),
        )
        add_database_option(parser)
        parser.add_argument(
            "--metrics-port",
            type=str,
            default=None,
            help=_("Serve Prometheus metrics on this port (needs the 'prometheus' extra)."),
        )
        parser.add_argument(
            "--metrics-addr",
            type=str,
            default="127.0.0.1",
            help=_(
                "The address the metrics are served on (default 127.0.0.1, this machine "
                "only; 0.0.0.0 or :: for every interface)."
            ),
        )
        parser.add_argument(
            "--processes",
            type=str,
            default="1",
            help=_(
                "Deliverers to run, each in a process of its own, under this one "
                "(default 1: this process delivers). One a core; restarted if they die."
            ),
        )
        parser.add_argument(
            "--log-interval",
            type=str,
            default="60",
            help=_("Seconds between the log lines with rates and counts (default 60)."),
        )
        parser.add_argument(
            "--purge",
            action="store_true",
            help=_(
                "Also delete settled deliveries past RETENTION, as purge_deliveries does, "
                "in a thread of its own: shortly after the start, then every --purge-interval "
                "(with --processes, the first deliverer only); with --drain, once, after it."
            ),
        )
        parser.add_argument(
            "--purge-interval",
            type=str,
            default=None,
            help=_("Seconds between purges with --purge (default 3600)."),
        )

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            self._run(**options)
        except KeyboardInterrupt:
            # A Ctrl-C that came before the loop (or the supervisor) took
            # SIGINT as a stop, while the checks ran or the migrations were
            # looked at, or after it gave it back: the shell's status for
            # it, and one line rather than a traceback.
            self.stderr.write(_("Interrupted."))
            sys.exit(130)

    def _run(self, **options: Any) -> None:
        processes = positive(options["processes"], MOST_PROCESSES)
        # Held to what the settings may say (checks.WHOLE_NUMBERS): a thread a slot.
        concurrency = (
            positive(options["concurrency"], WHOLE_NUMBERS["CONCURRENCY"][1])
            if options["concurrency"] is not None
            else None
        )
        per_host = (
            positive(options["per_host"], WHOLE_NUMBERS["PER_HOST"][1])
            if options["per_host"] is not None
            else None
        )
        per_host_max = (
            positive(options["per_host_max"], WHOLE_NUMBERS["PER_HOST_MAX"][1])
            if options["per_host_max"] is not None
            else None
        )
        if per_host_max is not None:
            if per_host is not None and per_host > per_host_max:
                raise CommandError(
                    _("--per-host %(start)d is more than --per-host-max %(most)d")
                    % {"start": per_host, "most": per_host_max}
                )
            # The most asked for holds whatever PER_HOST says: a start below it.
            per_host = min(per_host or app_settings.per_host, per_host_max)
        using = database_named(options["database"])
        if connections[using].vendor == "sqlite" and self.child is None:
            for problem in sqlite_problems(using, connections[using]):
                self.stderr.write(self.style.WARNING(f"{problem.msg} {problem.hint}"))
        drain = bool(options["drain"])
        interval = float(positive(options["log_interval"], 86_400))
        every = options["purge_interval"]
        if every is not None and not options["purge"]:
            # Checked, then dropped, it would read as purges that never come.
            raise CommandError(
                _("--purge-interval %(seconds)s needs --purge: without it nothing is purged")
                % {"seconds": quoted(every)}
            )
        purge_every = float(positive(every if every is not None else PURGE_EVERY, 7 * 86_400))
        if every is not None and drain:
            raise CommandError(
                _(
                    "--purge-interval %(seconds)s does not go with --drain: a drain's "
                    "--purge runs once, after the queue is drained"
                )
                % {"seconds": quoted(every)}
            )
        # Run from call_command, or with --skip-checks, the system checks have
        # not run: a bad setting, a kind of destination that does not load or a
        # webhook that does not parse is still an error that says what to
        # write, not a traceback from deep in the loop (or every event to
        # that destination failed).
        problems = deliverer_problems()
        if problems:
            raise CommandError(problems)
        if self.child is None:
            # Without them, every claim would fail, and be waited out as an outage.
            require_migrations(using)
        port = options["metrics_port"]
        number = positive(port, 65535) if port is not None else 0
        # Checked with or without --metrics-port: a typo is not left to lie in wait.
        addr = ip_address(options["metrics_addr"])
        # Refused here (under --processes, once, rather than by every child dying at once).
        if port is not None and not metrics.available():
            raise CommandError(_(metrics.NEEDS_CLIENT))
        if processes > 1:
            if number + processes - 1 > 65535:
                raise CommandError(
                    _(
                        "--metrics-port %(port)r with --processes %(processes)d needs ports "
                        "%(first)d to %(last)d, past 65535"
                    )
                    % {
                        "port": port,
                        "processes": processes,
                        "first": number,
                        "last": number + processes - 1,
                    }
                )
            if port is not None:
                # Refused once, as alone: every child would die of it (a port
                # taken later is one child's, restarted as any other death).
                try:
                    metrics.check_address(addr)
                except OSError as exc:
                    raise CommandError(
                        _("cannot serve metrics on %(addr)s: %(error)s")
                        % {"addr": addr, "error": exc}
                    ) from exc
            children = {name: options[name] for name in CHILD_OPTIONS}
            ended = supervise(
                processes, f"{__name__}.run_child", children, say=self._say, warn=self._warn
            )
            self._say(self.style.SUCCESS(ended))
            return
        # The metrics served until the command returns, however it does: a
        # drain run again in this process (a periodic job) takes its port again.
        with contextlib.ExitStack() as serving:
            if port is not None:
                try:
                    server = metrics.start_server(number, addr=addr)
                except ImproperlyConfigured as exc:
                    raise CommandError(str(exc)) from exc
                except OSError as exc:
                    raise CommandError(
                        _("cannot serve metrics on %(addr)s port %(port)d: %(error)s")
                        % {"addr": addr, "port": number, "error": exc}
                    ) from exc
                serving.callback(metrics.stop_server, server)
                shown = f"[{addr}]" if ":" in addr else addr
                self._say(
                    _("Metrics at %(url)s")
                    % {"url": f"http://{shown}:{server.server_port}/metrics"}
                )
            # A child of --processes shares what is due with the others: no total
            # of its own. Nor a drain begun while the database is away, which
            # the loop waits out.
            due = None
            if drain and self.child is None:
                with contextlib.suppress(OperationalError):
                    due = store.count_due(using=using)
            try:
                deliverer = Deliverer(
                    concurrency=concurrency,
                    per_host=per_host,
                    per_host_max=per_host_max,
                    using=using,
                    on_progress=drain_progress(due, self._say) if drain else log_rates(interval),
                    progress_interval=1.0 if drain else interval,
                    metrics=port is not None,
                    heartbeat=True,
                )
            except ImproperlyConfigured as exc:
                raise CommandError(str(exc)) from exc
            signals = install_stop_signals(deliverer, self.child, self._warn)
            watch_supervisor(deliverer, self.child)
            message = (
                _(
                    "Delivering until nothing is due: %(concurrency)d in flight, %(per_host)d per "
                    "host at first, up to %(most)d."
                )
                if drain
                else _(
                    "Delivering until stopped: %(concurrency)d in flight, %(per_host)d per host at "
                    "first, up to %(most)d."
                )
            )
            self._say(
                message
                % {
                    "concurrency": deliverer.concurrency,
                    "per_host": deliverer.per_host,
                    "most": deliverer.limits.most,
                }
            )
            purging = None
            if options["purge"] and drain:
                # Its periodic purge's first run would come after most drains end.
                self._say(_("Purging what is past RETENTION once the queue is drained."))
            elif options["purge"]:
                purging = PeriodicPurge(
                    purge_every, first=min(FIRST_PURGE, purge_every), using=using
                )
                purging.start()
                self._say(
                    _("Purging what is past RETENTION every %(seconds).0f s.")
                    % {"seconds": purge_every}
                )
            try:
                summary = deliverer.run(drain=drain)
            finally:
                if purging is not None:
                    purging.stop()
                # Called from code (call_command), the caller's handlers come back.
                signals.restore()
            self._say(self.style.SUCCESS(_("Done: %(summary)s.") % {"summary": summary.line()}))
            if options["purge"] and drain and not deliverer.stopping:
                purged = purge_by_setting(using=using)
                self._say(_("Purged: %(purged)s.") % {"purged": purged.line()})

    def _say(self, line: str) -> None:
        # Flushed: an operator (or a supervisor reading a pipe) sees it now,
        # not when a buffer fills.
        self._write(self.stdout, line)

    def _warn(self, line: str) -> None:
        self._write(self.stderr, line)

    def _write(self, stream: Any, line: str) -> None:
        """``line`` written and flushed, or not at all: an output whose
        reader went away (``| head``, a ``tee`` ended by the same Ctrl-C)
        is no reason to stop delivering, nor to leave a stop unmade."""
        try:
            stream.write(f"{self.child.prefix}{line}" if self.child else line)
            stream.flush()
        except BrokenPipeError:
            # Gone for good (not a failure of a drain that delivered everything).
            sent_nowhere(stream)
        except OSError:
            pass
