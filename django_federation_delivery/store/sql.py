"""The statements the package runs outside the ORM, and the one place that
runs them.

Every statement is a named block of ``queries.sql``, read and parsed once
(see the top of that file for its few rules); where PostgreSQL and SQLite
differ, a block has a variant for each. This module alone holds a cursor:
the store's modules, and the two that set up connections of their own
(``writelock.py``, ``wakeup.py``), ask for a statement by its name, with its
parameters by theirs.

Where the two databases differ by more than a statement's text, what each
runs is here too, in one function: a settle (:meth:`Statements.settle`) is
one statement on PostgreSQL and a few steps on SQLite, and a count-down
(:meth:`Statements.count_down`) locks its batches first on PostgreSQL and
reads those it finishes first on SQLite.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re
import sqlite3
import threading
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from importlib import resources
from typing import Any, NamedTuple

from django.db import connections

from django_federation_delivery.conf import database_alias
from django_federation_delivery.dialect import id_array, json_parameter
from django_federation_delivery.models import (
    Batch,
    Breaker,
    Delivery,
    DeliveryHistory,
    Host,
    Retracts,
    Status,
)

__all__ = [
    "NOTIFY_CHANNEL",
    "Settled",
    "Statement",
    "Statements",
    "busy_timeout",
    "counts_while_settling",
    "journal_mode",
    "listen",
    "on",
    "set_busy_timeout",
    "statement",
    "statements_of",
]

#: The PostgreSQL channel a send notifies and a listener listens on.
NOTIFY_CHANNEL = "federation_delivery"

#: The databases a block may be written for.
VENDORS = ("postgresql", "sqlite")

#: How a batch a replay wrote begins its idempotency key, and its tag (the
#: original's id follows): what tells it from a send's with no column of
#: its own (``replay.py``).
REPLAY_KEY_PREFIX = "replay-"
REPLAY_TAG_PREFIX = "replay of batch "
#: What a statement that reads the batch a retraction was sent as
#: (``sent_as`` in queries.sql) is given: a replay's copy's is its original.
_SENT_AS = {
    "replay_key": f"{REPLAY_KEY_PREFIX}%",
    "replay_tag": f"{REPLAY_TAG_PREFIX}%",
    "replay_tag_start": len(REPLAY_TAG_PREFIX) + 1,
}

_BLOCK = re.compile(r"^-- name: (\w+)(?: \[(\w+)\])?\s*$")
_FILLED = re.compile(r"\{(\w+)\}")
_PARAMETER = re.compile(r"%\(((?:\*{1,2}|~)?\w+)\)([sd])")
#: Where a statement's rows go, until their number is known.
_ROWS = "\0rows\0"


@dataclasses.dataclass(frozen=True)
class Statement:
    """One named statement, for one database: its text with a ``%s`` a
    parameter, as Django's cursors take it, and SQLite's own (``?``), with
    the names of its parameters in the order they are bound."""

    name: str
    text: str
    qmark: str
    #: The parameters in order, a name as often as the text names it.
    order: tuple[str, ...]
    #: Those that stand for several values: a sequence, spread.
    spread: frozenset[str]
    #: Integers written into the text (``%(name)d``), where it takes no parameters.
    literal: tuple[str, ...]
    #: Every name it takes.
    names: frozenset[str]
    #: The one that is rows of parameters, if any.
    rows: str | None = None
    #: Whether it is planned for the values bound at each run, never
    #: prepared (a ``%(~name)s`` parameter: a list of any length).
    each_run: bool = False
    #: The text and SQLite's for a number and length of rows.
    _shaped: dict[tuple[int, int], tuple[str, str]] = dataclasses.field(
        default_factory=dict, compare=False, repr=False
    )

    def bind(self, given: Mapping[str, Any]) -> list[Any]:
        """The parameters, in order, of the values ``given`` by name."""
        if given.keys() != self.names:
            raise TypeError(
                f"statement {self.name!r} takes {sorted(self.names)}, given {sorted(given)}"
            )
        if not self.spread:
            return [given[name] for name in self.order]
        values: list[Any] = []
        for name in self.order:
            if name == self.rows:
                values.extend(value for row in given[name] for value in row)
            elif name in self.spread:
                values.extend(given[name])
            else:
                values.append(given[name])
        return values

    def shaped(self, given: Mapping[str, Any]) -> tuple[str, str]:
        """The text and SQLite's, with as many rows as ``given`` has."""
        if self.rows is None:
            return self.text, self.qmark
        rows = given[self.rows]
        shape = (len(rows), len(rows[0]) if rows else 0)
        texts = self._shaped.get(shape)
        if texts is None:
            written = ", ".join(["(" + ", ".join(["%s"] * shape[1]) + ")"] * shape[0])
            texts = (
                self.text.replace(_ROWS, written),
                self.qmark.replace(_ROWS, written.replace("%s", "?")),
            )
            # Those of the sizes most sends have (a few rows, a whole chunk),
            # and not one a fan-out's last chunk once there are enough.
            if shape[0] <= _KEPT_ROWS or len(self._shaped) < _KEPT_SHAPES:
                self._shaped[shape] = texts
        return texts

    def written(self, given: Mapping[str, Any]) -> str:
        """The text with its integers written in."""
        return self.text % {name: int(given[name]) for name in self.literal}


def _blocks() -> dict[tuple[str, str | None], str]:
    """The blocks of ``queries.sql``, by name and database (None: both),
    their comment lines left out and their white space made single spaces."""
    source = resources.files(__package__).joinpath("queries.sql").read_text("utf-8")
    blocks: dict[tuple[str, str | None], list[str]] = {}
    lines: list[str] | None = None
    for line in source.splitlines():
        named = _BLOCK.match(line)
        if named:
            name, vendor = named.groups()
            if vendor is not None and vendor not in VENDORS:
                raise ValueError(f"queries.sql: {name} is for no database we know: {vendor}")
            if (name, vendor) in blocks:
                raise ValueError(f"queries.sql: {name} [{vendor}] is written twice")
            lines = blocks[(name, vendor)] = []
        elif lines is not None and not line.lstrip().startswith("--"):
            lines.append(line)
    return {
        key: " ".join(" ".join(text).split()).replace("( ", "(").replace(" )", ")")
        for key, text in blocks.items()
    }


def _quote(name: str) -> str:
    """A name as both databases quote it (and Django's backends for them)."""
    return f'"{name}"'


def _filled() -> dict[str, str]:
    """What ``{name}`` stands for, but the other blocks."""
    quote = _quote
    tables = {
        "delivery": Delivery,
        "batch": Batch,
        "host": Host,
        "history": DeliveryHistory,
        "breaker": Breaker,
    }
    return {
        **{name: quote(model._meta.db_table) for name, model in tables.items()},
        "pending": f"'{Status.PENDING}'",
        "channel": NOTIFY_CHANNEL,
        "batch_columns": ", ".join(quote(field.column) for field in _batch_fields()),
        "batch_values": "%(*batch)s",
    }


def _batch_fields() -> list[Any]:
    """The columns a batch's INSERT writes: all of the model's but its id."""
    return [field for field in Batch._meta.concrete_fields if not field.primary_key]


def _compile(vendor: str) -> dict[str, Statement]:
    """Every statement as ``vendor``'s database runs it."""
    blocks = _blocks()
    filled = _filled()
    spread_sizes = {"batch": len(_batch_fields())}

    def text_of(name: str, seen: tuple[str, ...]) -> str:
        if name in seen:
            raise ValueError(f"queries.sql: {' > '.join((*seen, name))} names itself")
        block = blocks.get((name, vendor), blocks.get((name, None)))
        if block is None:
            raise KeyError(f"queries.sql: no {name} for {vendor}")
        return _FILLED.sub(
            lambda found: (
                filled[found[1]] if found[1] in filled else text_of(found[1], (*seen, name))
            ),
            block,
        )

    compiled = {}
    for name in {name for name, block_vendor in blocks if block_vendor in (None, vendor)}:
        order: list[str] = []
        spread: set[str] = set()
        literal: list[str] = []
        rows: list[str] = []
        each_run: list[str] = []

        def placeholder(found: re.Match[str]) -> str:
            parameter, kind = found[1], found[2]
            if kind == "d":
                literal.append(parameter)  # noqa: B023 (this statement's, bound now)
                return f"%({parameter})d"
            if parameter.startswith("**"):
                parameter = parameter[2:]
                rows.append(parameter)  # noqa: B023
                spread.add(parameter)  # noqa: B023
                order.append(parameter)  # noqa: B023
                return _ROWS
            if parameter.startswith("~"):
                parameter = parameter[1:]
                each_run.append(parameter)  # noqa: B023
            elif parameter.startswith("*"):
                parameter = parameter[1:]
                spread.add(parameter)  # noqa: B023
                order.append(parameter)  # noqa: B023
                return ", ".join(["%s"] * spread_sizes[parameter])
            order.append(parameter)  # noqa: B023
            return "%s"

        text = _PARAMETER.sub(placeholder, text_of(name, ()))
        if literal and order:
            raise ValueError(f"queries.sql: {name} has both integers and parameters")
        if len(rows) > 1:
            raise ValueError(f"queries.sql: {name} has more than one list of rows")
        compiled[name] = Statement(
            name,
            text,
            text.replace("%s", "?"),
            tuple(order),
            frozenset(spread),
            tuple(literal),
            frozenset(order) | frozenset(literal),
            rows[0] if rows else None,
            bool(each_run),
        )
    return compiled


#: Texts kept of each statement with rows, one a number of rows: any of a
#: few rows, and up to so many in all.
_KEPT_ROWS = 16
_KEPT_SHAPES = 32

_compiled: dict[str, dict[str, Statement]] = {}
_compiling = threading.Lock()


def statements_of(vendor: str) -> dict[str, Statement]:
    """Every statement as ``vendor``'s database runs it, by name."""
    named = _compiled.get(vendor)
    if named is None:
        with _compiling:
            named = _compiled.get(vendor) or _compile(vendor)
            _compiled[vendor] = named
    return named


def statement(connection: Any, name: str) -> Statement:
    """The statement ``name`` as ``connection``'s database runs it."""
    return statements_of(connection.vendor)[name]


class Settled(NamedTuple):
    """What a settle wrote."""

    #: The deliveries whose claim still held: those written.
    written: set[int]
    #: The batches it finished, in id order.
    finished: list[int]
    #: Whether it added to the history itself (or left that to the caller).
    counted: bool
    #: The ordered deliveries another transaction held locked (a send that
    #: is making one wait on them, not yet committed): not written, to be
    #: written again, while their claim holds.
    busy: frozenset[int] = frozenset()


class Statements:
    """Named statements, run on ``connection`` through one cursor, opened by
    ``with``.

    Django's cursor, unless ``driver`` and the driver's own will do: for the
    few statements of a send, which read no datetime back (Django's cursor
    reads them in the connection's zone), when nothing logs or wraps
    queries. What Django's wrapper adds around one statement (the ``%s`` to
    ``?`` rewrite on SQLite, the checks, a cursor from Django's factory on
    PostgreSQL) costs more than SQLite takes to insert a row: a one-inbox
    send, a fifth more (``benchmarks/send.py``); on PostgreSQL, a tenth of
    a send's CPU. Errors are translated, a broken transaction refused and a
    kept connection checked, as Django's cursor does. On PostgreSQL the
    parameters are bound on the server either way, so that psycopg may
    prepare the statements (see :func:`_server_binding_cursor`).
    """

    def __init__(self, connection: Any, *, driver: bool = False) -> None:
        self.connection = connection
        self.postgresql = connection.vendor == "postgresql"
        self._named = statements_of(connection.vendor)
        self._driver = (
            driver
            and (connection.vendor == "sqlite" or _is_psycopg3(connection))
            and not connection.queries_logged
            and not connection.execute_wrappers
        )
        self._cursor: Any = None

    def __enter__(self) -> Statements:
        if self._driver:
            # As Django's cursor() begins: a persistent connection gone bad
            # since the last request is replaced (CONN_HEALTH_CHECKS).
            self.connection.validate_thread_sharing()
            self.connection.close_if_health_check_failed()
            self.connection.ensure_connection()
            raw = self.connection.connection
            self._cursor = _server_cursor(raw) if self.postgresql else raw.cursor()
        elif self.postgresql and not self.connection.queries_logged:
            # Not while Django logs queries (DEBUG, a test counting them): it
            # logs no text for a statement psycopg has prepared.
            self._cursor = _server_binding_cursor(self.connection)
        else:
            self._cursor = self.connection.cursor()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._cursor.close()

    def _execute(self, name: str, given: Mapping[str, Any]) -> Any:
        statement = self._named[name]
        if statement.literal:
            self._cursor.execute(statement.written(given))
            return self._cursor
        text, qmark = statement.shaped(given)
        if self._driver:
            if self.connection.needs_rollback:
                self.connection.validate_no_broken_transaction()
            with self.connection.wrap_database_errors:
                if self.postgresql and statement.each_run:
                    self._cursor.execute(text, statement.bind(given), prepare=False)
                else:
                    self._cursor.execute(text if self.postgresql else qmark, statement.bind(given))
        elif self.postgresql and statement.each_run:
            with _unprepared(self.connection):
                self._cursor.execute(text, statement.bind(given))
        else:
            self._cursor.execute(text, statement.bind(given))
        return self._cursor

    def run(self, name: str, /, **given: Any) -> int:
        """Run ``name``; how many rows it changed."""
        return int(self._execute(name, given).rowcount)

    def one(self, name: str, /, **given: Any) -> Any:
        """Run ``name``; its one row (None if it returned none)."""
        return self._execute(name, given).fetchone()

    def all(self, name: str, /, **given: Any) -> list[Any]:
        """Run ``name``; its rows."""
        return list(self._execute(name, given).fetchall())

    def value(self, name: str, /, **given: Any) -> Any:
        """Run ``name``; the first value of its one row, or None for no row."""
        row = self._execute(name, given).fetchone()
        return None if row is None else row[0]

    def json(self, name: str, /, **given: Any) -> Any:
        """Run ``name``, an SQLite statement that returns its rows as one
        JSON value (each row a statement returns is an sqlite3 step of its
        own, and each step hands the interpreter to the worker threads and
        waits to get it back); that value, read."""
        return json.loads(self.value(name, **given))

    def ids(self, ids: Iterable[int]) -> str:
        """``ids`` as a statement takes a list of them: a PostgreSQL array
        (one string for psycopg to quote, where a list is adapted an element
        at a time) or an SQLite JSON list."""
        if self.postgresql:
            return id_array(ids)
        return json.dumps(list(ids))

    def lock_for_writing(self) -> None:
        """SQLite: have the transaction hold the write lock from now on, for
        a read whose rows it then writes. A deferred ``BEGIN`` (Django 4.2,
        or no ``transaction_mode``) takes it at the first write: a read
        before that sees rows another connection may change before the
        write, which then fails at once ("database is locked") instead of
        waiting. A transaction begun ``IMMEDIATE`` holds it already."""
        connection = self.connection
        mode = getattr(connection, "transaction_mode", None)
        if (
            connection.vendor == "sqlite"
            and connection.in_atomic_block
            and mode not in ("IMMEDIATE", "EXCLUSIVE")
        ):
            self.run("lock_for_writing")

    def count_down(self, leaving: Counter[int], now: Any) -> list[int]:
        """Take ``leaving`` (how many deliveries leave each batch) off the
        batches' counts, finishing at ``now`` those that reach nought;
        return those, in id order.

        On PostgreSQL the batches' rows are locked first, in id order:
        deliverers counting down the same batches at once then wait on each
        other rather than deadlock. On SQLite the batches it finishes are
        read first, as one value."""
        if not leaving:
            return []
        rows = self._batch_counts(leaving)
        if self.postgresql:
            counted = self.all("count_down", rows=rows, now=now)
            return sorted(batch for batch, remaining in counted if remaining == 0)
        finished = sorted(self.json("finishing_batches", rows=rows))
        self.run("count_down", rows=rows, now=now)
        return finished

    def count_up(self, arriving: Counter[int]) -> None:
        """Add ``arriving`` (how many deliveries come back to each batch) to
        the batches' counts, none of them finished any more: one statement
        however many batches, locked first as :meth:`count_down` locks them."""
        if arriving:
            self.run("count_up", rows=self._batch_counts(arriving))

    def _batch_counts(self, counts: Counter[int]) -> str:
        """``counts`` as the JSON list ``leaving`` reads; on PostgreSQL their
        batches locked first, in id order."""
        items = sorted(counts.items())
        if self.postgresql:
            self.run("lock_batches", ids=self.ids(batch for batch, _ in items))
        return json_parameter(items)

    def release_next(self, settled: Iterable[int], now: Any) -> list[int]:
        """Make due the deliveries that waited on ``settled`` ones; a
        retraction's is made to wait again, on the next delivery still
        pending of what it retracts, if any (``wait_again``). Returns the
        ids released."""
        return self.release("release_next", self.ids(settled), now)

    def release(self, name: str, ids: str, now: Any) -> list[int]:
        """Run ``name``, a release of ``ids`` (``release``, ``release_next``),
        and what it returned as :meth:`released` takes it. On PostgreSQL,
        in a transaction, with no JIT compilation, and the caller's setting
        put back after: what each row inherits is a recursive lookup
        costed, under a server's statistics, past JIT's thresholds, and
        compiling a chunk of 500 took a second for a tenth of that run
        (giving up 2,500 waited on took 6 s, 0.5 s without)."""
        if not (self.postgresql and self.connection.in_atomic_block):
            return self.released(self.all(name, ids=ids, now=now))
        was = self.value("jit_off")
        released = self.released(self.all(name, ids=ids, now=now))
        self.value("jit_as", was=was)
        return released

    def released(self, rows: Iterable[Sequence[Any]]) -> list[int]:
        """What a release returned (``released_rows``): the ids of those made
        due (not those that wait on another still), once the retractions'
        among them have been made to wait again."""
        released = [(id, retracts) for id, after, retracts in rows if after is None]
        retracting = [id for id, retracts in released if retracts]
        if retracting:
            self.wait_again(retracting)
        return [id for id, _ in released]

    def wait_again(self, ids: Iterable[int]) -> int:
        """Make those of ``ids`` that are a retraction's deliveries, still
        pending and waiting on nothing, wait on the last delivery still
        pending to their inbox of what their batch retracts, if any
        (``wait_again``). Returns how many now wait.

        SQLite looks each up in the statement (``next_retracted``).
        PostgreSQL reads them first, as a retraction's first wait is read
        (``attempted_before``): its sender's earlier batches about what it
        retracts, then, given as lists, their last delivery still pending
        to each inbox, by the index on (batch, inbox) whatever the
        statistics say."""
        if not self.postgresql:
            return self.run("wait_again", ids=self.ids(ids), **_SENT_AS)
        waiting: dict[tuple[int, int, str, str, str], list[tuple[int, str]]] = {}
        for id, inbox, batch, sent_as, sender, retracts, about in self.all(
            "retractions_waiting", ids=self.ids(ids), **_SENT_AS
        ):
            waiting.setdefault((batch, sent_as, sender, retracts, about), []).append((id, inbox))
        mine: list[int] = []
        lasts: list[int] = []
        for (batch, sent_as, sender, retracts, about), rows in waiting.items():
            name = "batches_about" if retracts == Retracts.OBJECT else "batches_of_activity"
            earlier = [id for id, _ in self.all(name, about=about, sender=sender, batch=batch)]
            # Sent before it: a replay's copy, written after all, retracts
            # what its original did, not what the sender sent since.
            earlier = [id for id in earlier if id < sent_as]
            if not earlier:
                continue
            last = dict(
                self.all(
                    "attempted_before",
                    batches=self.ids(earlier),
                    inboxes=[inbox for _, inbox in rows],
                )
            )
            for id, inbox in rows:
                if inbox in last:
                    mine.append(id)
                    lasts.append(last[inbox])
        if not mine:
            return 0
        waits = json.dumps({str(id): last for id, last in zip(mine, lasts, strict=True)})
        return self.run("wait_again", ids=self.ids(mine), waits=waits)

    def settle(
        self,
        rows: Sequence[Sequence[Any]],
        *,
        final: Mapping[int, int],
        ordered: Sequence[int],
        now: Any,
        count: bool = True,
    ) -> Settled:
        """Write the settlements ``rows`` (each its id, token, status,
        attempts, due time, last status, last error, attempt time and settle
        time, then the history's minute and count name) whose claim still
        holds; release what waited on those written final (the next of an
        ordered one's sequence, a retraction waiting on an attempted one,
        which waits again while another of what it retracts is pending
        there: :meth:`released`); count the batches of the ``final`` ones
        ({id: batch}) down.

        On PostgreSQL all of it is one statement (``settle``), which adds to
        the history too unless ``count`` is false (``settle_uncounted``);
        with ``ordered`` deliveries a statement before it locks them (see
        ``lock_free_deliveries``: a send may be making one wait on them; one
        a send holds is not written now, but returned as ``busy``. A
        retraction making one wait on a row being settled is not waited for:
        ``store/retractions.release_stranded`` frees what it left waiting).
        On SQLite each is a step, in the same order, the write lock held from
        the first; the history is left to the caller."""
        if self.postgresql:
            busy: frozenset[int] = frozenset()
            if ordered:
                # Those a send holds are left for a later write, never
                # waited for: the send's transaction is its caller's, and
                # may stay open as long as its view likes.
                locked, held_up, there = self.one("lock_free_deliveries", ids=self.ids(ordered))
                # One gone (its batch deleted) is no one's to wait for.
                busy = frozenset(there) - set(locked) | set(held_up)
            if busy:
                rows = [row for row in rows if row[0] not in busy]
                final = {id: batch for id, batch in final.items() if id not in busy}
                if not rows:
                    return Settled(set(), [], count, busy)
            given = json_parameter(rows)
            written, finished, retracting = self.one(
                "settle" if count else "settle_uncounted",
                rows=given,
                ids=self.ids(row[0] for row in rows),
                now=now,
                final=self.ids(sorted(final)),
                leaving=self.ids(sorted(set(final.values()))),
            )
            if retracting:
                self.wait_again(retracting)
            return Settled(set(written), list(finished), count, busy)
        given = json_parameter(rows)
        self.lock_for_writing()
        written = set(self.json("settle_written", rows=given))
        if written:
            self.run("settle_rows", rows=given)
        released = [id for id in final if id in written]
        if released:
            self.release_next(released, now)
        leaving = Counter(batch for id, batch in final.items() if id in written)
        return Settled(written, self.count_down(leaving, now), False)


def _server_binding_cursor(connection: Any) -> Any:
    """Django's cursor on PostgreSQL, but one that sends the parameters apart
    from the text (psycopg 3's server-side binding), whatever the ORM's
    cursors do (``OPTIONS["server_side_binding"]``).

    Each statement then reaches the server as the same text, whatever is
    bound, so that psycopg prepares it once the connection has run it
    ``prepare_threshold`` times (``OPTIONS["prepare_threshold"]``; Django's
    default, None, prepares nothing, for a pooler that cannot keep prepared
    statements), and the server parses and plans it once a connection, not
    at each claim and settle. A long value (a settle's JSON rows, a list of
    ids) is sent as it is, not quoted into the text. The cursor is Django's
    all the same: wrapped and its errors translated as any."""
    # Imported only here: it needs psycopg, which SQLite does not.
    from django.db.backends.postgresql import base

    connection.ensure_connection()
    raw = connection.connection
    binding = getattr(base, "ServerBindingCursor", None)  # psycopg 2 has none
    if binding is None or raw.cursor_factory is binding:
        return connection.cursor()
    factory = raw.cursor_factory
    raw.cursor_factory = binding
    try:
        return connection.cursor()
    finally:
        raw.cursor_factory = factory


def _is_psycopg3(connection: Any) -> bool:
    """Whether ``connection`` is PostgreSQL's through psycopg 3."""
    if connection.vendor != "postgresql":
        return False
    from django.db.backends.postgresql import base

    return bool(getattr(base, "is_psycopg3", False))


@contextlib.contextmanager
def _unprepared(connection: Any) -> Iterator[None]:
    """What Django's cursor runs inside is not prepared by psycopg 3, whatever
    the connection's ``prepare_threshold``: planned each time for the values
    bound. (psycopg 2 prepares nothing.)"""
    raw = connection.connection
    if getattr(raw, "prepare_threshold", None) is None:
        yield
        return
    threshold = raw.prepare_threshold
    raw.prepare_threshold = None
    try:
        yield
    finally:
        raw.prepare_threshold = threshold


def _server_cursor(raw: Any) -> Any:
    """psycopg 3's own cursor on ``raw``: it binds on the server, whatever
    cursor factory Django gave the connection."""
    import psycopg

    return psycopg.Cursor(raw)


def on(using: Any = None, *, driver: bool = False) -> Statements:
    """:class:`Statements` on the connection ``using`` (an alias, or a
    connection itself)."""
    if using is None or isinstance(using, str):
        using = connections[using or database_alias()]
    return Statements(using, driver=driver)


def counts_while_settling(connection: Any) -> bool:
    """Whether a settle adds to the history in its own statement (PostgreSQL),
    so that one whose history cannot be written fails as a whole."""
    return connection.vendor == "postgresql"  # type: ignore[no-any-return]


def listen(conn: Any, listening: bool) -> None:
    """PostgreSQL: have ``conn``, a psycopg connection of its own, listen for
    sends' notifications, or stop."""
    conn.execute(statements_of("postgresql")["listen" if listening else "unlisten"].text)


def ping(conn: Any) -> None:
    """PostgreSQL: ask ``conn``, a psycopg connection of its own, a question
    that takes a round trip."""
    conn.execute(statements_of("postgresql")["ping"].text)


def busy_timeout(raw: sqlite3.Connection) -> int:
    """SQLite: the busy timeout of ``raw``, a driver's connection, in milliseconds."""
    return int(raw.execute(statements_of("sqlite")["busy_timeout"].text).fetchone()[0])


def set_busy_timeout(raw: sqlite3.Connection, milliseconds: int) -> None:
    """SQLite: set the busy timeout of ``raw``, a driver's connection."""
    statement = statements_of("sqlite")["set_busy_timeout"]
    raw.execute(statement.written({"milliseconds": milliseconds}))


def journal_mode(connection: Any) -> str:
    """SQLite's journal mode, lowercase ("wal", "delete", …)."""
    with on(connection) as db:
        return str(db.value("journal_mode")).lower()
