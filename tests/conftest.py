"""Fixtures: real inboxes on loopback, and a deliverer running in a thread."""

from __future__ import annotations

import collections
import contextlib
import faulthandler
import json
import os
import re
import signal
import socket
import socketserver
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from django.db import OperationalError, connection, connections, transaction
from django.db.backends.signals import connection_created
from django.dispatch import receiver

from django_federation_delivery.deliverer import Deliverer

from .settings import TEST_DB_DIR

ROOT = Path(__file__).resolve().parent.parent
(ROOT / "tests" / "var").mkdir(exist_ok=True)

#: Where scripts/pytest_matrix.py reads what a run tells it besides its output.
REPORTS = Path(os.environ["FD_TEST_REPORTS"]) if "FD_TEST_REPORTS" in os.environ else None
if REPORTS:
    # It asks a run that hung for its stacks with SIGUSR1: each pytest
    # process (an xdist worker too) writes its threads' to a file of its own.
    _STACKS_FILE = open(REPORTS / f"stacks-{os.getpid()}.txt", "w")  # noqa: SIM115
    faulthandler.register(signal.SIGUSR1, file=_STACKS_FILE, all_threads=True)


def selects(config: pytest.Config, *marks: str) -> bool:
    """Whether the run's ``-m`` expression keeps a test marked with exactly
    ``marks``."""
    from _pytest.mark.expression import Expression

    if not config.option.markexpr:
        return True
    expression = Expression.compile(config.option.markexpr)
    return expression.evaluate(lambda name, **_: name in marks)


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    # Every browser test is slow, any_database and browser: where those are
    # deselected, Playwright need not be installed (tox.ini installs it only
    # where they run), so the module is not even imported. Anywhere else, a
    # missing one is an error.
    if collection_path.name == "test_browser.py" and not selects(
        config, "slow", "any_database", "browser"
    ):
        return True
    return None


#: What a test asks for to reach the database: one asking for none of them,
#: and not marked django_db, cannot (pytest-django refuses it).
DATABASE_FIXTURES = frozenset(
    {
        "db",
        "transactional_db",
        "django_db_reset_sequences",
        "django_db_serialized_rollback",
        "live_server",
        # test_example_project.py: a database of its own, made on the same server.
        "example_env",
    }
)


#: What a test of the web side asks for; one that asks for none uses no
#: table but the queue's (and django-q2's broker).
WEB_FIXTURES = frozenset(
    {"client", "admin_client", "admin_user", "django_user_model", "live_server", "rf"}
)
#: The modules whose tests sign in to the admin (users, sessions, permissions),
#: or go through the middleware (test_async.py's ASGI requests).
WEB_MODULES = frozenset(
    {
        "test_admin.py",
        "test_async.py",
        "test_admin_webhooks.py",
        "test_browser.py",
        "test_channels_registry.py",
        "test_secrets.py",
    }
)
#: The apps of a test of the queue, whose tables alone a transactional test
#: empties after it. Django's flush of every table, and the permissions and
#: content types it makes again, cost more than most such tests.
QUEUE_APPS = ["django_federation_delivery", "django_q"]

#: A stranger's answer that would set a terminal's title, clear its screen,
#: turn the text red and reverse the rest, on a line of its own; and the one
#: line it is kept as.
HOSTILE_ANSWER = "body\x1b]0;PWNED\x07\x1b[2J\x1b[31mRED\u202eevil\r\nFAKE-LINE"
HOSTILE_ANSWER_ESCAPED = r"body\x1b]0;PWNED\x07\x1b[2J\x1b[31mRED\u202eevil FAKE-LINE"


class Unprintable:
    """A value given where a name goes whose text cannot even be had."""

    def __str__(self) -> str:
        raise RuntimeError("no text")

    __repr__ = __str__


def _flushes(marker: pytest.Mark | None, fixtures: set[str]) -> bool:
    if marker is not None:
        if marker.kwargs.get("available_apps") is not None:
            return False
        return bool(marker.kwargs.get("transaction", marker.args[0] if marker.args else False))
    return "transactional_db" in fixtures


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Marked before -m selects: the runs on PostgreSQL leave out what never
    # reaches a database, having run it on SQLite already. And a test of the
    # queue that commits is emptied after, of the queue's tables only.
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        marker = item.get_closest_marker("django_db")
        if marker is None and DATABASE_FIXTURES.isdisjoint(fixtures):
            item.add_marker(pytest.mark.no_database)
        elif (
            _flushes(marker, fixtures)
            and WEB_FIXTURES.isdisjoint(fixtures)
            and item.path.name not in WEB_MODULES
        ):
            kwargs = marker.kwargs if marker else {}
            queue_only = pytest.mark.django_db(
                **{**kwargs, "transaction": True, "available_apps": QUEUE_APPS}
            )
            item.add_marker(queue_only, append=False)
    # The longest first: pytest-xdist hands out tests in this order, and a
    # run that starts a minute-long one last ends on it alone.
    items.sort(key=lambda item: not _longest(item))


#: The modules whose slow tests start processes (deliverers, supervisors, a
#: qcluster) and wait out leases: the longest of the suite are theirs, 40 to
#: 90 s each with every run at once.
LONGEST_MODULES = frozenset(
    {"test_run_deliverer.py", "test_run_deliverer_postgres.py", "test_django_q.py"}
)


def _longest(item: pytest.Item) -> bool:
    return item.path.name in LONGEST_MODULES and item.get_closest_marker("slow") is not None


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    for pattern in (f"test-{os.getpid()}.sqlite3*", f"test-{os.getpid()}-queue.sqlite3*"):
        for leftover in TEST_DB_DIR.glob(pattern):
            leftover.unlink(missing_ok=True)


@pytest.fixture
def parameters_a_statement() -> Iterator[int]:
    """SQLite taking 999 parameters a statement, as it was built by default
    before 3.32 (32766 since; Debian's build takes 250000), which
    ``dialect.rows_per_statement`` provides for; on PostgreSQL, as many,
    for the queries a test counts."""
    if connection.vendor != "sqlite":
        yield 999
        return
    connection.ensure_connection()
    raw = connection.connection
    before = raw.getlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER)
    raw.setlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER, 999)
    try:
        yield raw.getlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER)
    finally:
        raw.setlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER, before)


@pytest.fixture
def closed_port() -> Iterator[Callable[[], int]]:
    """Gives ports on 127.0.0.1 where a connection is refused, until the test
    ends: each is bound and not listening. A port let go at once could be
    taken meanwhile by any of the processes of the runs side by side (a
    server, or a client's own end), and answer."""
    held: list[socket.socket] = []

    def make() -> int:
        sock = socket.socket()
        held.append(sock)
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])

    yield make
    for sock in held:
        sock.close()


class QueueRouter:
    """Puts the app's tables in the database "queue", as a project's router
    puts an app in a database of its own; the rest (users, sessions, django-q2's
    broker) is left to "default"."""

    def db_for_read(self, model: type[Any], **hints: Any) -> str | None:
        return "queue" if model._meta.app_label == "federation_delivery" else None

    db_for_write = db_for_read

    def allow_migrate(self, db: str, app_label: str, **hints: Any) -> bool | None:
        return db == "queue" if app_label == "federation_delivery" else None


@pytest.fixture(autouse=True)
def _checks_need_no_query() -> None:
    """Since Django 6.1, ``run_checks()`` runs the model checks against every
    database, and on SQLite the one of ``JSONField`` asks the database once a
    connection: a query in a test that did not ask for the database (or not
    for "queue"), which the test refuses, unless an earlier test in the
    same process happened to ask already. SQLite's answer is the same for
    every file (one library, whose JSON the package needs), so each is told it."""
    for alias in ("default", "queue"):
        features = connections[alias].features
        if connections[alias].vendor == "sqlite" and "supports_json_field" not in vars(features):
            features.supports_json_field = True


@pytest.fixture
def queue_router(settings: Any) -> None:
    """The app routed to the database "queue", which a test asks for with
    "default": ``django_db(databases=["default", "queue"])``."""
    settings.DATABASE_ROUTERS = [QueueRouter()]


def _refuse_the_apps_tables(execute: Any, sql: str, *args: Any) -> Any:
    assert "federation_delivery_" not in sql, f"the app's tables are not in 'default': {sql}"
    return execute(sql, *args)


@pytest.fixture
def default_refuses_the_app(queue_router: None) -> Iterator[None]:
    """The app routed to "queue", and "default" refusing, in the test's
    thread, any statement on the app's tables: as in a project whose router
    let ``migrate`` make them in "queue" alone, where what reads or writes
    them in "default" fails."""
    with connections["default"].execute_wrapper(_refuse_the_apps_tables):
        yield


@pytest.fixture(autouse=True, scope="session")
def _postgres_flush_by_delete() -> Iterator[None]:
    """On PostgreSQL, a transactional test's tables are emptied after it with
    DELETE, as SQLite's are, rather than Django's TRUNCATE: a TRUNCATE of a
    few rows makes every table and index new, 22 ms of the server's CPU each
    time, more than half of all it did in a run of the suite. The foreign
    keys are checked at the commit, once all is deleted."""
    if connection.vendor != "postgresql":
        yield
        return
    operations = type(connection.ops)
    truncate = operations.sql_flush

    def sql_flush(
        self: Any, style: Any, tables: list[str], *, reset_sequences: bool = False, **kwargs: Any
    ) -> list[str]:
        if reset_sequences or not tables:
            return truncate(self, style, tables, reset_sequences=reset_sequences, **kwargs)
        quote = self.quote_name
        return ["SET CONSTRAINTS ALL DEFERRED", *(f"DELETE FROM {quote(t)}" for t in tables)]

    with pytest.MonkeyPatch.context() as patched:
        patched.setattr(operations, "sql_flush", sql_flush)
        yield


@receiver(connection_created)
def _sqlite_wal(sender: Any, connection: Any, **kwargs: Any) -> None:
    # What a deployment on SQLite runs with (see example_project/settings.py).
    if connection.vendor == "sqlite":
        with connection.cursor() as cursor:
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute("PRAGMA synchronous=NORMAL")


class LeftOver:
    """Sessions of an earlier test still on the test database when the next
    began, and what held up a test: shown at the end of the run. Kept in a
    file, so that the workers of a run split by pytest-xdist (``-n``) tell
    the process that prints the summary."""

    def __init__(self) -> None:
        # Each worker's parent is the run's own process.
        run = os.getppid() if "PYTEST_XDIST_WORKER" in os.environ else os.getpid()
        self.path = ROOT / "tests" / "var" / f"left-over-{run}.txt"

    def append(self, line: str) -> None:
        with self.path.open("a") as out:
            out.write(line.replace("\n", " ") + "\n")

    def extend(self, lines: Iterable[str]) -> None:
        for line in lines:
            self.append(line)

    def take(self) -> list[str]:
        try:
            lines = self.path.read_text().splitlines()
        except FileNotFoundError:
            return []
        self.path.unlink(missing_ok=True)
        return lines


LEFT_OVER = LeftOver()

# What a process keeps from one test to the next (the hosts marked
# unavailable, read once a minute) is forgotten before each test by the
# package's own pytest plugin, as in a host project's suite.


@pytest.fixture(autouse=True)
def _no_session_left_over(request: pytest.FixtureRequest) -> None:
    """On PostgreSQL, a test that uses the database should start alone on it.

    A process a test killed can leave its server session running a
    statement, holding its locks, until the server notices; a later test's
    DELETE or flush would wait on them. Any such session is named in the
    run's summary (not ended: it may be one this process still uses).
    """
    if request.node.get_closest_marker("django_db") is None or connection.vendor != "postgresql":
        return
    blocker = request.getfixturevalue("django_db_blocker")
    with blocker.unblock(), connection.cursor() as cursor:
        cursor.execute(
            "SELECT pid, application_name, state, wait_event_type, wait_event, "
            "round(extract(epoch FROM now() - state_change)), left(query, 200) "
            "FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid() "
            "AND backend_type = 'client backend'"
        )
        for pid, app, state, kind, event, age, query in cursor.fetchall():
            LEFT_OVER.append(
                f"before {request.node.nodeid}: session {pid} ({app or 'no name'}), "
                f"{state} for {age} s, waiting on {kind}/{event}: {query!r}"
            )


#: After this long in one test, what every session on PostgreSQL is doing
#: (and waiting on) is recorded once for the run's summary: a test stuck on
#: a lock names the lock's holder before the timeout ends it.
STUCK_AFTER = 120.0


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    if connection.vendor != "postgresql" or item.get_closest_marker("django_db") is None:
        yield
        return
    done = threading.Event()

    def look() -> None:
        if done.wait(STUCK_AFTER):
            return
        from django.db import connections

        other = connections.create_connection("default")
        try:
            with other.cursor() as cursor:
                cursor.execute(
                    "SELECT pid, pg_blocking_pids(pid), application_name, state, "
                    "wait_event_type, wait_event, round(extract(epoch FROM now() - query_start)), "
                    "left(query, 300) FROM pg_stat_activity "
                    "WHERE datname = current_database() AND pid <> pg_backend_pid()"
                )
                rows = cursor.fetchall()
        except Exception as error:  # a report, not a test: it must not fail one
            rows = [("?", "?", f"could not look: {error}", "", "", "", "", "")]
        finally:
            other.close()
        LEFT_OVER.append(f"{item.nodeid} still running after {STUCK_AFTER:g} s; sessions:")
        LEFT_OVER.extend(
            f"  {pid} blocked by {blockers} ({app or 'no name'}), {state}, waiting on "
            f"{kind}/{event}, for {age} s: {query!r}"
            for pid, blockers, app, state, kind, event, age, query in rows
        )

    watcher = threading.Thread(target=look, name="stuck-test-watcher", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join()


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if "PYTEST_XDIST_WORKER" in os.environ:
        return  # a worker's summary is not shown: the run's own process prints it
    if lines := LEFT_OVER.take():
        terminalreporter.section("PostgreSQL sessions left over by a test, or holding one up")
        for line in lines:
            terminalreporter.write_line(line)


@dataclass
class Received:
    path: str
    headers: dict[str, str]
    body: bytes
    host: str
    method: str = "POST"

    def json(self) -> Any:
        return json.loads(self.body)


Answer = tuple[int, dict[str, str], bytes]


class Overlap:
    """A ``respond`` that answers ``status`` after ``delay`` seconds, and counts
    how many requests were being answered at once: at most, and at most since
    :meth:`mark` (or :meth:`mark_if_idle`). With ``together``, the first
    ``together`` requests are answered only once they have all come (or after
    ``wait`` seconds): a test sees its clients send at once, whatever the load."""

    def __init__(self, status: int, delay: float, *, together: int = 0, wait: float = 20) -> None:
        self.status = status
        self.delay = delay
        self.together = together
        self.wait = wait
        self._lock = threading.Lock()
        self._all_came = threading.Condition(self._lock)
        self._came = 0
        self._now = 0
        self._marked = False
        self.most = 0
        self.most_since_mark = 0

    def __call__(self, request: Received) -> Answer:
        with self._lock:
            self._came += 1
            self._now += 1
            self.most = max(self.most, self._now)
            if self._marked:
                self.most_since_mark = max(self.most_since_mark, self._now)
            if self._came <= self.together:
                self._all_came.notify_all()
                self._all_came.wait_for(lambda: self._came >= self.together, self.wait)
        time.sleep(self.delay)
        with self._lock:
            self._now -= 1
        return self.status, {}, b""

    def mark(self) -> None:
        with self._lock:
            self._marked = True

    def mark_if_idle(self) -> bool:
        """Mark, if no request is being answered: whether it did."""
        with self._lock:
            if self._now == 0:
                self._marked = True
            return self._marked


@dataclass
class Inbox:
    """A real HTTP server on a loopback address that records what it is sent
    and answers what ``respond`` says (202 by default)."""

    address: str
    port: int = 0
    received: list[Received] = field(default_factory=list)
    respond: Callable[[Received], Answer] = lambda request: (202, {}, b"")
    delay: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock)
    #: The connections it accepted (each keeps alive for many requests).
    connections: int = 0

    def url(self, path: str = "/inbox") -> str:
        return f"http://{self.address}:{self.port}{path}"

    @property
    def host(self) -> str:
        """What its deliveries' ``host`` is: its address and its port."""
        return f"{self.address}:{self.port}"

    def paths(self) -> list[str]:
        with self.lock:
            return [request.path for request in self.received]


class _Handler(BaseHTTPRequestHandler):
    inbox: Inbox
    protocol_version = "HTTP/1.1"

    def setup(self) -> None:
        super().setup()
        with self.inbox.lock:  # a handler a connection
            self.inbox.connections += 1

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length)
        # The target as it came on the wire: http.server turns a leading "//" into "/".
        target = self.requestline.split(" ")[1]
        request = Received(
            target, dict(self.headers.items()), body, self.headers["Host"], self.command
        )
        with self.inbox.lock:
            self.inbox.received.append(request)
        if self.inbox.delay:
            time.sleep(self.inbox.delay)
        status, headers, answer = self.inbox.respond(request)
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    # A Matrix message is PUT; a probe of an unavailable host is a GET.
    do_PUT = do_POST
    do_GET = do_POST

    def log_message(self, format: str, *args: Any) -> None:
        pass


class LoopbackServer(ThreadingHTTPServer):
    """A ThreadingHTTPServer whose bind looks nothing up. http.server's asks
    DNS for the address's name (``socket.getfqdn``), which for a 127.0.0.x
    that /etc/hosts does not name waits for the resolver: 50 ms an inbox
    here, 5 s of a test that starts a hundred."""

    def server_bind(self) -> None:
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = self.server_address[:2]

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that hung up before its answer was written (a delivery
        # that timed out, as tests make them) is what the test asked for,
        # not a fault of the server's to print.
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


class InboxServer(LoopbackServer):
    daemon_threads = True
    # Room for a deliverer's burst of connections while the accepting thread
    # waits for the GIL: past socketserver's 5, a connection's SYN is dropped
    # and sent again a second later.
    request_queue_size = 128


def start_inbox(address: str = "127.0.0.1", **options: Any) -> tuple[Inbox, ThreadingHTTPServer]:
    inbox = Inbox(address=address, **options)
    handler = type("Handler", (_Handler,), {"inbox": inbox})
    server = InboxServer((address, 0), handler)
    inbox.port = server.server_address[1]
    threading.Thread(
        target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
    ).start()
    return inbox, server


@pytest.fixture
def inboxes() -> Iterator[Callable[..., Inbox]]:
    """Start inboxes on loopback addresses: ``inboxes("127.0.0.2", respond=...)``."""
    servers: list[ThreadingHTTPServer] = []

    def make(address: str = "127.0.0.1", **options: Any) -> Inbox:
        inbox, server = start_inbox(address, **options)
        servers.append(server)
        return inbox

    yield make
    # All at once: each waits up to its poll interval to see it is asked.
    stopping = [threading.Thread(target=server.shutdown) for server in servers]
    for thread in stopping:
        thread.start()
    for thread in stopping:
        thread.join()
    for server in servers:
        server.server_close()


@pytest.fixture
def inbox(inboxes: Callable[..., Inbox]) -> Inbox:
    return inboxes()


class RunningDeliverer:
    def __init__(self, deliverer: Deliverer) -> None:
        self.deliverer = deliverer
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.deliverer.run()
        except BaseException as exc:  # surfaced by stop()
            self.error = exc

    def stop(self, timeout: float = 30) -> None:
        self.deliverer.stop()
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the deliverer did not stop"
        if self.error is not None:
            raise self.error


@pytest.fixture
def start_deliverer() -> Iterator[Callable[..., RunningDeliverer]]:
    """Run deliverers in background threads; each is stopped after the test."""
    running: list[RunningDeliverer] = []

    def start(**options: Any) -> RunningDeliverer:
        runner = RunningDeliverer(Deliverer(**options))
        running.append(runner)
        return runner

    yield start
    for runner in running:
        if runner.thread.is_alive():
            runner.stop()


def assert_each_reached_once_but(
    sinks: Iterable[Inbox], urls: Iterable[str], *, twice: int
) -> None:
    """Every one of ``urls`` reached its inbox among ``sinks``, once, but for
    at most ``twice`` of them (those in flight when a process or the
    database went away), each reached exactly twice."""
    counts = collections.Counter(
        f"http://{request.host}{request.path}" for sink in sinks for request in sink.received
    )
    assert set(counts) == set(urls), "every delivery reached its inbox"
    repeated = [url for url, count in counts.items() if count > 1]
    assert all(counts[url] == 2 for url in repeated), "none more than twice"
    assert len(repeated) <= twice, f"only those in flight repeat: {len(repeated)} > {twice}"


def at_once(work: Callable[[], object], threads: int, timeout: float = 30.0) -> list[object]:
    """``work`` in ``threads`` threads at once, each on connections of its
    own (closed after): what each returned or raised, in the order done."""
    done: list[object] = []

    def run() -> None:
        try:
            done.append(work())
        except BaseException as exc:
            done.append(exc)
        finally:
            connections.close_all()

    started = [threading.Thread(target=run) for _ in range(threads)]
    for thread in started:
        thread.start()
    for thread in started:
        thread.join(timeout)
    return done


def wait_until(
    condition: Callable[[], bool],
    timeout: float = 20.0,
    step: float = 0.02,
    state: Callable[[], object] | None = None,
) -> None:
    """Poll ``condition`` until it holds; fail the test if it does not in time,
    saying what ``state`` gives then.

    The polls start ``step`` apart and draw out to a tenth of a second: a
    poll is a query or two, and with every run of the suite at once on two
    cores, a wait lasts several times as long, and so did its polling."""
    started = time.monotonic()
    deadline = started + timeout
    delay, longest = step, max(step, 0.1)
    while time.monotonic() < deadline:
        if condition():
            near_miss(time.monotonic() - started, timeout)
            return
        time.sleep(delay)
        delay = min(delay * 1.5, longest)
    then = f"; then: {state()!r}" if state else ""
    raise AssertionError(f"not within {timeout} s: {condition}{then}")


def near_miss(took: float, bound: float) -> None:
    """Tells scripts/pytest_matrix.py of a wait that took more than half its
    bound: the next slower machine fails there. Called by the waiting helper
    itself (wait_until, wait_for_line), so that the line named is its caller's."""
    if REPORTS is None or took <= bound / 2:
        return
    caller = sys._getframe(2)
    where = f"{Path(caller.f_code.co_filename).name}:{caller.f_lineno}"
    test = os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0]
    with open(REPORTS / "near-misses.txt", "a") as out:
        out.write(f"{took:5.1f} s of {bound:g} s  {test} ({where})\n")


def piped_to_head(args: list[str], timeout: float) -> tuple[int, str]:
    """``manage.py ARGS | head -1``: the command's status and what it wrote
    on stderr, once its first line was read and its stdout closed."""
    process = subprocess.Popen(
        [*MANAGE, *args],
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None and process.stderr is not None
        process.stdout.readline()
        process.stdout.close()
        code = process.wait(timeout)
        return code, process.stderr.read()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)
        for stream in (process.stdout, process.stderr):
            if stream is not None:
                stream.close()


def subprocess_env(**extra: str) -> dict[str, str]:
    """The environment for a ``manage.py`` subprocess that shares this test's database."""
    env = dict(os.environ, DJANGO_SETTINGS_MODULE="tests.settings", PYTHONPATH=str(ROOT))
    # As a supervisor runs it: output through a pipe, buffered unless flushed.
    env.pop("PYTHONUNBUFFERED", None)
    settings = connection.settings_dict
    if connection.vendor == "sqlite":
        env["FD_SQLITE_NAME"] = str(settings["NAME"])
    else:
        env["DATABASE_URL"] = (
            f"postgres://{settings['USER']}:{settings['PASSWORD'] or ''}@{settings['HOST']}:"
            f"{settings['PORT']}/{settings['NAME']}"
        )
    env.update(extra)
    return env


MANAGE = [sys.executable, "-m", "django"]


@pytest.fixture
def failures() -> Iterator[list[Any]]:
    """Every ``delivery_failed`` payload told while the test runs, from any thread."""
    from django_federation_delivery import signals

    seen: list[Any] = []
    lock = threading.Lock()

    def receiver(sender: Any, failure: Any, **kwargs: Any) -> None:
        with lock:
            seen.append(failure)

    signals.delivery_failed.connect(receiver, weak=False)
    yield seen
    signals.delivery_failed.disconnect(receiver)


@contextlib.contextmanager
def statements_run() -> Iterator[list[tuple[str, Any]]]:
    """The statements run inside, with their parameters, as they run; the
    savepoints of the test's own transaction left out."""
    executed: list[tuple[str, Any]] = []

    def capture(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        if not sql.startswith(("SAVEPOINT", "RELEASE")):
            executed.append((sql, params))
        return execute(sql, params, many, context)

    with connection.execute_wrapper(capture):
        yield executed


class Undone(Exception):
    """Raised to roll back what was run only to be looked at."""


@contextlib.contextmanager
def statements_of_undone() -> Iterator[list[tuple[str, Any]]]:
    """The statements run inside, as :func:`statements_run` has them, and
    all they did rolled back after."""
    with contextlib.suppress(Undone), transaction.atomic(), statements_run() as executed:
        yield executed
        raise Undone


def run_explained(executed: list[tuple[str, Any]]) -> list[tuple[str, str]]:
    """PostgreSQL: ``executed`` run again in turn, each read or write under
    EXPLAIN ANALYZE (the plan it gets in the state the ones before it left,
    and how often each of its nodes ran), then rolled back: each one's text
    and plan."""
    plans = []
    with contextlib.suppress(Undone), transaction.atomic(), connection.cursor() as cursor:
        for text, params in executed:
            if text.lstrip().upper().startswith(("SELECT", "UPDATE", "WITH", "INSERT", "DELETE")):
                cursor.execute("EXPLAIN ANALYZE " + text, params)
                plans.append((text, "\n".join(line for (line,) in cursor.fetchall())))
            else:
                cursor.execute(text, params)
        raise Undone
    return plans


def statistics_of_a_server() -> None:
    """PostgreSQL's statistics of a queue as a server has it (skipped on
    another database): many small sends, settled long ago, analyzed. They
    count a row or two a batch, and few pending rows: the planner's guesses
    a long-settled queue leads it to."""
    from django.utils import timezone

    from django_federation_delivery import send
    from django_federation_delivery.models import Delivery, Status

    from .keys import ALICE

    if connection.vendor != "postgresql":
        pytest.skip("PostgreSQL's planner")
    for n in range(400):
        note = {
            "type": "Create",
            "id": f"{ALICE}/activities/1",
            "actor": ALICE,
            "object": f"{ALICE}/notes/old{n}",
        }
        send(ALICE, note, [f"https://o{n}.example/{k}/inbox" for k in range(3)])
    Delivery.objects.update(status=Status.DELIVERED, settled_at=timezone.now())
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE federation_delivery_delivery, federation_delivery_batch")


def reads_a_batch_once_a_row(plan: str) -> bool:
    """Whether an EXPLAIN ANALYZE plan reads deliveries by their batch
    (the index on (batch, status)) more than once: once a row of another
    node, the whole of a batch each time."""
    by_batch = [line for line in plan.splitlines() if "fd_delivery_batch_status" in line]
    return not all(re.search(r"loops=1\)", line) for line in by_batch)


def sqlite_steps(action: Callable[[], Any], every: int) -> int:
    """How many times ``every`` SQLite virtual-machine steps ``action`` runs
    on the default connection: a statement's cost counted whatever the
    machine's speed."""
    connection.ensure_connection()
    raw = connection.connection
    steps = [0]

    def count() -> int:
        steps[0] += 1
        return 0

    raw.set_progress_handler(count, every)
    try:
        action()
    finally:
        raw.set_progress_handler(None, every)
    return steps[0]


def reads_by_primary_key(plan: str, table: str) -> bool:
    """Whether a PostgreSQL plan reads ``table`` through its primary key: an
    index scan or a bitmap of it, whichever the planner's estimate picks;
    either reads only the rows asked for."""
    return f"Index Scan using {table}_pkey" in plan or f"Bitmap Index Scan on {table}_pkey" in plan


@contextlib.contextmanager
def away_at(fragment: str) -> Iterator[list[str]]:
    """The database away for a moment, as a connection lost: the first
    statement run inside whose text holds ``fragment`` raises
    ``OperationalError`` before it runs. Yields the statements it failed."""
    failed: list[str] = []

    def blink(execute: Any, sql: str, *args: Any) -> Any:
        if not failed and fragment in sql:
            failed.append(sql)
            raise OperationalError("server closed the connection unexpectedly")
        return execute(sql, *args)

    with connection.execute_wrapper(blink):
        yield failed


def waiting_on_locks() -> int:
    """How many sessions of this database wait on a lock (PostgreSQL)."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity "
            "WHERE datname = current_database() AND wait_event_type = 'Lock'"
        )
        return int(cursor.fetchone()[0])


@contextlib.contextmanager
def sent_in_an_open_transaction(sender: str, activity: Any, inboxes: list[str]) -> Iterator[None]:
    """``activity`` sent by ``sender`` in another connection's transaction (a
    web request's), which stays open, its rows locked, until the block ends."""
    from django.db import connection as own

    from django_federation_delivery import send

    locked, release = threading.Event(), threading.Event()

    def request() -> None:
        try:
            with transaction.atomic():
                send(sender, activity, inboxes)
                locked.set()
                release.wait(30)
        finally:
            own.close()

    thread = threading.Thread(target=request)
    thread.start()
    try:
        assert locked.wait(10)
        yield
    finally:
        release.set()
        thread.join(30)
