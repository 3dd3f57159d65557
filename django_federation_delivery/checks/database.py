"""Checks of the database the queue lives in."""

from __future__ import annotations

import re
import sqlite3
from collections.abc import Sequence
from typing import Any

from django.core.checks import CheckMessage, Error, Tags, Warning, register
from django.db import OperationalError
from django.utils.translation import gettext as _
from django.utils.translation import ngettext

from django_federation_delivery.addresses import quoted
from django_federation_delivery.checks.bounds import PREFIX
from django_federation_delivery.store.sql import busy_timeout, journal_mode


@register(Tags.database)
def check_sqlite(app_configs: Sequence[Any] | None = None, **kwargs: Any) -> list[CheckMessage]:
    """SQLite needs WAL and a busy timeout for a web process and the deliverer
    to write at once without "database is locked": asked of the queue's
    databases alone, the app's (:func:`~conf.database_alias`) and any its
    routers let its tables into. Another SQLite database, the project's own,
    is none of the queue's business (``migrate`` of it would stop on E020)."""
    from django.conf import settings
    from django.db import connections, router

    from django_federation_delivery.conf import database_alias
    from django_federation_delivery.models import Delivery

    messages: list[CheckMessage] = []
    for alias in kwargs.get("databases") or []:
        connection = connections[alias]
        if connection.vendor != "sqlite":
            continue
        routed = bool(settings.DATABASE_ROUTERS) and router.allow_migrate_model(alias, Delivery)
        if alias == database_alias() or routed:
            messages += sqlite_problems(alias, connection)
    return messages


@register()
def check_routing(app_configs: Sequence[Any] | None = None, **kwargs: Any) -> list[CheckMessage]:
    """The database the routers write the app's rows to is one in
    ``DATABASES``, and one they let ``migrate`` make its tables in: else a
    send fails on a connection that does not exist, or on a table that
    ``migrate`` recorded as made and never made, and the deliverer waits
    that out as an outage, for ever. Asks the routers only: no query."""
    from django.conf import settings
    from django.db import router

    from django_federation_delivery.conf import database_alias
    from django_federation_delivery.models import Delivery

    alias = database_alias()
    if alias not in settings.DATABASES:
        return [
            Error(
                _(
                    "DATABASE_ROUTERS write the app's deliveries to the database %(alias)s, "
                    "which is not in DATABASES."
                )
                % {"alias": quoted(alias)},
                hint=_("Add it to DATABASES, or have the router name one that is."),
                id=f"{PREFIX}.E037",
            )
        ]
    if not router.allow_migrate_model(alias, Delivery):
        return [
            Error(
                _(
                    "DATABASE_ROUTERS write the app's deliveries to the database %(alias)s, "
                    "but their allow_migrate() keeps its tables out of it: migrate makes "
                    "none there."
                )
                % {"alias": quoted(alias)},
                hint=_(
                    "Have allow_migrate() return True for the app label "
                    "federation_delivery on that database."
                ),
                id=f"{PREFIX}.E038",
            )
        ]
    return []


@register()
def check_isolation(app_configs: Sequence[Any] | None = None, **kwargs: Any) -> list[CheckMessage]:
    """A send with an ordering key waits for the sends before it in its
    sequence to commit, then reads the last of them: under PostgreSQL's
    REPEATABLE READ or SERIALIZABLE, its transaction's snapshot is older
    than that commit, so two sends in one sequence at once would both wait
    on the same earlier delivery and go side by side. Read from the
    settings (``OPTIONS['isolation_level']``, as Django sets it, or
    ``default_transaction_isolation`` in ``OPTIONS['options']``): no query.
    Set another way (``ALTER DATABASE … SET``), a send in a sequence
    refuses it (``sequences.lock_sequences``)."""
    from django.conf import settings
    from django.db import connections

    from django_federation_delivery.conf import database_alias

    alias = database_alias()
    if alias not in settings.DATABASES:
        return []  # check_routing's to say
    # The vendor, not the ENGINE's name: PostGIS's is PostgreSQL's. Asking
    # it opens no connection.
    vendor = connections[alias].vendor
    return isolation_problems(alias, settings.DATABASES.get(alias, {}), vendor)


def isolation_problems(alias: str, database: dict[str, Any], vendor: str) -> list[CheckMessage]:
    """:func:`check_isolation` of the database ``alias``, as ``DATABASES``
    sets it (``database``), of ``vendor``."""
    if vendor != "postgresql":
        return []
    options = database.get("OPTIONS", {})
    level = _level_of(options.get("isolation_level"))
    if level is None:
        level = _level_in(options.get("options"))
    # PostgreSQL runs READ UNCOMMITTED as READ COMMITTED.
    if level is None or level in ("read committed", "read uncommitted"):
        return []
    return [
        Error(
            _(
                "The queue's database %(alias)r runs its transactions at %(level)s: sends "
                "with one ordering key at once would not wait on each other."
            )
            % {"alias": alias, "level": level.upper()},
            hint=_(
                "Use READ COMMITTED, PostgreSQL's default, for the database the queue is in "
                "(leave out OPTIONS['isolation_level'] and default_transaction_isolation), "
                "or route the app's models to a database of its own that does "
                "(DATABASE_ROUTERS)."
            ),
            id=f"{PREFIX}.E021",
        )
    ]


def _level_of(level: Any) -> str | None:
    """The isolation level ``OPTIONS['isolation_level']`` names, in
    PostgreSQL's words; None if it names none Django knows (Django's own
    error, at connection)."""
    if level is None:
        return None
    from django.db.backends.postgresql.psycopg_any import IsolationLevel

    try:
        return IsolationLevel(level).name.replace("_", " ").lower()
    except ValueError:
        return None


#: ``default_transaction_isolation`` set in libpq's ``options`` (``-c`` or
#: ``--``, a space in the value escaped with a backslash).
_DEFAULT_ISOLATION = re.compile(
    r"(?:-c\s*|--)default[-_]transaction[-_]isolation\s*=\s*((?:\\.|[^\s\\])+)", re.IGNORECASE
)


def _level_in(options: Any) -> str | None:
    """The isolation level libpq's ``options`` string sets for each
    transaction by default, if it sets one (the last, as the server reads
    them)."""
    if not isinstance(options, str):
        return None
    found = _DEFAULT_ISOLATION.findall(options)
    if not found:
        return None
    return re.sub(r"\\(.)", r"\1", found[-1]).strip("'\"").lower()


def sqlite_problems(alias: str, connection: Any) -> list[CheckMessage]:
    messages: list[CheckMessage] = []
    if sqlite3.sqlite_version_info < (3, 35, 0):
        messages.append(
            Error(
                _("SQLite %(version)s has no UPDATE … RETURNING, which claims need.")
                % {"version": sqlite3.sqlite_version},
                hint=_("Use SQLite 3.35 or newer."),
                id=f"{PREFIX}.E020",
            )
        )
    timeout = _busy_timeout(connection)
    if timeout < 10:
        messages.append(
            Warning(
                _("The SQLite database %(alias)r has a busy timeout of %(timeout)s s.")
                % {"alias": alias, "timeout": f"{timeout:g}"},
                hint=_(
                    "Set DATABASES[...]['OPTIONS']['timeout'] = 20 (seconds) or more, so that "
                    "the deliverer and web processes wait for each other's writes instead of "
                    "failing with 'database is locked'."
                ),
                id=f"{PREFIX}.W001",
            )
        )
    # A database in memory (the test runner's) has no WAL to switch to; one
    # that cannot be read now (locked past its timeout) is not looked at.
    try:
        mode = journal_mode(connection)
    except OperationalError:
        return messages
    if mode != "wal" and not connection.is_in_memory_db():
        messages.append(
            Warning(
                _("The SQLite database %(alias)r is in journal mode %(mode)r, not WAL.")
                % {"alias": alias, "mode": mode},
                hint=_(
                    "Use WAL so that readers do not block the deliverer's writes: on Django 5.1+ "
                    "add 'init_command': 'PRAGMA journal_mode=WAL;' to OPTIONS, or run "
                    "'PRAGMA journal_mode=WAL;' once on the database file (it persists)."
                ),
                id=f"{PREFIX}.W002",
            )
        )
    return messages


def _busy_timeout(connection: Any) -> float:
    """The seconds ``connection`` waits for SQLite's write lock: as it has it
    (``OPTIONS['timeout']``, or a ``PRAGMA busy_timeout`` its
    ``init_command`` ran), or as its settings say when it cannot be opened
    now (sqlite3's own 5 s when they say nothing)."""
    try:
        connection.ensure_connection()
        return busy_timeout(connection.connection) / 1000
    except OperationalError:
        timeout = connection.settings_dict.get("OPTIONS", {}).get("timeout")
        return float(timeout) if isinstance(timeout, int | float) else 5.0


def unapplied_migrations(alias: str) -> list[str]:
    """The package's migrations the database ``alias`` lacks, by name, in
    the order they apply; none when it has them all, or cannot be reached
    now (the loop waits an outage out)."""
    from django.db import DatabaseError, connections
    from django.db.migrations.executor import MigrationExecutor

    label = "federation_delivery"  # the app's label (apps.py)
    try:
        executor = MigrationExecutor(connections[alias])
        leaves = [node for node in executor.loader.graph.leaf_nodes() if node[0] == label]
        plan = executor.migration_plan(leaves)
    except DatabaseError:
        return []
    return [f"{migration.app_label}.{migration.name}" for migration, backwards in plan]


def lacking_migrations(alias: str) -> str:
    """What refuses to work on the database ``alias`` (``run_deliverer``, a
    round): the package's migrations it lacks, named, and what to run; ""
    when it lacks none."""
    missing = unapplied_migrations(alias)
    if not missing:
        return ""
    from django.db import DEFAULT_DB_ALIAS

    migrate = "manage.py migrate" + ("" if alias == DEFAULT_DB_ALIAS else f" --database {alias}")
    return ngettext(
        "The database %(alias)r lacks a migration of the package's (%(names)s): "
        "run %(migrate)s first.",
        "The database %(alias)r lacks %(count)d migrations of the package's "
        "(%(names)s): run %(migrate)s first.",
        len(missing),
    ) % {"alias": alias, "count": len(missing), "names": ", ".join(missing), "migrate": migrate}
