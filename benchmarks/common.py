"""What the benchmarks share: the nginx sink, Django on a throwaway database,
a deliverer run in a thread, and the few helpers around them.

Not a benchmark itself; see README.rst. The scripts are run from the
repository root (``.venv/bin/python benchmarks/NAME.py``) and import this as
``benchmarks.common``.
"""

from __future__ import annotations

import argparse
import atexit
import collections
import contextlib
import ctypes
import http.client
import os
import platform
import re
import shutil
import signal
import socket
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from django_federation_delivery.deliverer import Deliverer
    from django_federation_delivery.settling import Summary

ROOT = Path(__file__).resolve().parent.parent
#: The sink listens on 127.0.0.FIRST_HOST and the H - 1 addresses after it.
FIRST_HOST = 10
STATUS_PATH = "/_sink/status"
#: The access log of the addresses that answer with an error (see ``Sink``).
FAILING_LOG = "failing.log"


# --- The sink: nginx answering 202 ------------------------------------------------------------


def find_nginx() -> str:
    """nginx's path, installing Debian's nginx-light first if there is none."""
    return find_program("nginx", "nginx-light")


def find_program(name: str, package: str) -> str:
    """``name``'s path, installing Debian's ``package`` with apt-get first if
    there is none (as root; otherwise the script stops, saying what to install)."""

    def found() -> str | None:
        return shutil.which(name) or shutil.which(name, path="/usr/sbin:/usr/local/sbin")

    path = found()
    if path:
        return path
    apt = shutil.which("apt-get")
    if apt is None or os.geteuid() != 0:
        sys.exit(f"{name} is not installed; install {package} (apt-get install {package})")
    print(f"{name} is not installed: installing {package} with apt-get …", flush=True)
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}

    def apt_get(*words: str) -> int:
        return subprocess.run([apt, *words], env=env, stdout=subprocess.DEVNULL).returncode

    installed = apt_get("install", "-y", "-q", package) == 0
    # Failing that, the package lists may never have been fetched on this machine.
    installed = installed or (
        apt_get("update", "-q") == 0 and apt_get("install", "-y", "-q", package) == 0
    )
    if not installed:
        sys.exit(f"apt-get could not install {package}")
    path = found()
    if not path:
        sys.exit(f"{package} was installed but no {name} binary was found")
    return path


def install_missing(requirements: Sequence[str], modules: Sequence[str]) -> None:
    """Make ``modules`` importable: if any is missing, pip installs
    ``requirements`` into the running interpreter's environment. (Not an
    extra of the package's: what only a benchmark compares with is no option
    a user installs.)"""
    import importlib
    import importlib.util

    if all(importlib.util.find_spec(module) for module in modules):
        return
    print(f"installing with pip: {' '.join(requirements)} …", flush=True)
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_INPUT": "1"}
    answer = subprocess.run([sys.executable, "-m", "pip", "install", "-q", *requirements], env=env)
    importlib.invalidate_caches()
    if answer.returncode != 0 or not all(importlib.util.find_spec(module) for module in modules):
        sys.exit(f"pip could not install {' '.join(requirements)}")


def terminate(process: subprocess.Popen[Any] | None, timeout: float) -> None:
    """SIGTERM to a child still running, then SIGKILL if it is still there
    after ``timeout`` seconds."""
    if process is None or process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(10)


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    """In the nginx child: be sent SIGTERM if this script dies, even by SIGKILL."""
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGTERM)


def free_port(addresses: Sequence[str]) -> int:
    """A port that is free on every address (nginx is told to bind them all)."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind((addresses[0], 0))
            port = int(probe.getsockname()[1])
        try:
            for address in addresses[1:]:
                with socket.socket() as other:
                    other.bind((address, port))
        except OSError:
            continue
        return port
    raise RuntimeError("no port free on every sink address")


def stat_fields(path: str) -> list[str]:
    """The fields of a ``/proc/…/stat`` file after the command's name: the
    14th and 15th (indexes 11 and 12) are user and system ticks, the 16th and
    17th those of the children waited for."""
    return Path(path).read_text().rsplit(")", 1)[1].split()


class Sink:
    """nginx, in the foreground as this script's child, answering 202 to every POST.

    ``hosts``: how many addresses answer 202 (127.0.0.FIRST_HOST on), or the
    addresses themselves. ``failing``: more addresses, each with the status
    it answers every request with (503, say); only those requests are logged,
    to ``FAILING_LOG``, one line each, and counted by :meth:`failing_requests`.
    """

    def __init__(
        self,
        hosts: int | Sequence[str],
        workdir: Path,
        *,
        workers: str = "1",
        failing: Mapping[str, int] | None = None,
    ) -> None:
        if isinstance(hosts, int):
            self.addresses = [f"127.0.0.{FIRST_HOST + n}" for n in range(hosts)]
        else:
            self.addresses = list(hosts)
        self.failing = dict(failing or {})
        self.dir = workdir
        self.workers = workers
        self.port = 0
        self.nginx = ""
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def error_log(self) -> Path:
        return self.dir / "error.log"

    @property
    def every_address(self) -> list[str]:
        return [*self.addresses, *self.failing]

    def config(self) -> str:
        listen = "\n".join(
            f"        listen {address}:{self.port} backlog=4096;" for address in self.addresses
        )
        temp = "\n".join(
            f"    {kind}_temp_path {self.dir / kind};"
            for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
        )
        user = "user nobody nogroup;\n" if os.geteuid() == 0 else ""
        return f"""\
# Written by benchmarks/common.py: a sink that is not the bottleneck.
{user}daemon off;
master_process on;
worker_processes {self.workers};
pid {self.dir / "nginx.pid"};
error_log {self.error_log} warn;
events {{
    worker_connections 4096;
}}
http {{
    access_log off;
    server_tokens off;
{temp}
    # Bodies stay in memory, never in a temp file.
    client_body_buffer_size 64k;
    client_max_body_size 1m;
    keepalive_requests 100000;
    keepalive_timeout 120s;
    server {{
{listen}
        # "return" below 400 sends its answer through ngx_http_send_response,
        # which reads and discards the request body first: keep-alive holds
        # (checked at start by keepalive_check).
        location / {{
            return 202;
        }}
        location = {STATUS_PATH} {{
            stub_status;
        }}
    }}
{self._failing_config()}}}
"""

    def _failing_config(self) -> str:
        """A server per error status, logging each request it answers."""
        if not self.failing:
            return ""
        by_status: dict[int, list[str]] = collections.defaultdict(list)
        for address, status in self.failing.items():
            by_status[status].append(address)
        blocks = ["    log_format fd_failing '$server_addr $status $msec';"]
        for status, addresses in sorted(by_status.items()):
            listen = "\n".join(
                f"        listen {address}:{self.port} backlog=4096;" for address in addresses
            )
            # An error answer goes through ngx_http_special_response_handler,
            # which discards the body too; keep-alive holds for 503 (not for
            # 400, 413, 414, 500 or 501, which nginx always closes after).
            blocks.append(
                f"""\
    server {{
{listen}
        access_log {self.dir / FAILING_LOG} fd_failing;
        location / {{
            return {status};
        }}
    }}"""
            )
        return "\n".join(blocks) + "\n"

    def start(self) -> None:
        self.nginx = find_nginx()
        self.dir.mkdir(parents=True, exist_ok=True)
        # The workers run as nobody: they need to reach their temp directories.
        # (The sink's directory and the script's temp directory, made 0700 by mkdtemp.)
        for directory in (self.dir, self.dir.parent):
            directory.chmod(0o755)
        for _ in range(5):
            self.port = free_port(self.every_address)
            conf = self.dir / "nginx.conf"
            conf.write_text(self.config())
            with open(self.dir / "stderr.log", "ab") as stderr:
                self.process = subprocess.Popen(
                    [self.nginx, "-p", str(self.dir), "-c", str(conf), "-e", str(self.error_log)],
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=stderr,
                    # Ctrl-C is this script's to handle: it stops nginx itself.
                    start_new_session=True,
                    preexec_fn=_die_with_parent,
                )
            atexit.register(self.stop)
            if self._wait_ready(10.0):
                return
            self.stop()
            if "Address already in use" not in self.log():
                break
        raise RuntimeError(f"nginx did not start:\n{self.log()}")

    def log(self) -> str:
        texts = []
        for name in ("error.log", "stderr.log"):
            with contextlib.suppress(OSError):
                texts.append((self.dir / name).read_text(errors="replace"))
        return "".join(texts)[-3000:]

    def _wait_ready(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        pending = list(self.every_address)
        while pending and time.monotonic() < deadline:
            if self.process is None or self.process.poll() is not None:
                return False
            try:
                with socket.create_connection((pending[0], self.port), timeout=0.2):
                    pending.pop(0)
            except OSError:
                time.sleep(0.05)
        return not pending

    def stop(self) -> None:
        process, self.process = self.process, None
        terminate(process, 5)  # SIGTERM: a fast shutdown, workers included

    def version(self) -> str:
        answer = subprocess.run([self.nginx, "-v"], capture_output=True, text=True)
        return (answer.stderr or answer.stdout).strip().removeprefix("nginx version: ")

    def url(self, n: int, path: str) -> str:
        return f"http://{self.addresses[n % len(self.addresses)]}:{self.port}{path}"

    def url_at(self, address: str, path: str) -> str:
        return f"http://{address}:{self.port}{path}"

    def counters(self) -> tuple[int, int]:
        """(connections accepted, requests served) so far, this query's own included."""
        conn = http.client.HTTPConnection(self.addresses[0], self.port, timeout=5)
        try:
            conn.request("GET", STATUS_PATH)
            text = conn.getresponse().read().decode()
        finally:
            conn.close()
        match = re.search(r"^\s*(\d+)\s+(\d+)\s+(\d+)\s*$", text, re.MULTILINE)
        if match is None:
            raise RuntimeError(f"unexpected stub_status answer: {text!r}")
        return int(match[1]), int(match[3])

    def failing_requests(self) -> collections.Counter[str]:
        """Requests each failing address has answered so far (nginx writes
        each line of its access log as the request ends, unbuffered)."""
        counts: collections.Counter[str] = collections.Counter()
        with contextlib.suppress(FileNotFoundError), open(self.dir / FAILING_LOG, "rb") as log:
            for line in log:
                address = line.split(b" ", 1)[0].decode()
                counts[address] += 1
        return counts

    def cpu_seconds(self) -> float:
        """CPU time used so far by nginx, master and workers."""
        if self.process is None:
            return 0.0
        pids = [self.process.pid]
        with contextlib.suppress(OSError):
            children = Path(f"/proc/{self.process.pid}/task/{self.process.pid}/children")
            pids += [int(pid) for pid in children.read_text().split()]
        ticks = 0
        for pid in pids:
            with contextlib.suppress(OSError, ValueError, IndexError):
                fields = stat_fields(f"/proc/{pid}/stat")
                ticks += int(fields[11]) + int(fields[12])  # utime, stime
        return ticks / os.sysconf("SC_CLK_TCK")


class RedisServer:
    """Debian's redis-server (installed with apt-get if missing) as this
    script's child, on a free port of 127.0.0.1, keeping nothing on disk
    (``--save ''``, ``--appendonly no``): a broker for a benchmark. Stopped
    by :meth:`stop`, at exit, or by the kernel if the script dies."""

    def __init__(self, workdir: Path) -> None:
        self.dir = workdir
        self.port = 0
        self.binary = ""
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> str:
        """Start it; its URL."""
        self.binary = find_program("redis-server", "redis-server")
        self.dir.mkdir(parents=True, exist_ok=True)
        log = self.dir / "redis.log"
        for _ in range(5):
            self.port = free_port(["127.0.0.1"])
            self.process = subprocess.Popen(
                [
                    *(self.binary, "--bind", "127.0.0.1", "--port", str(self.port)),
                    *("--save", "", "--appendonly", "no", "--daemonize", "no"),
                    *("--dir", str(self.dir), "--logfile", str(log)),
                ],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,  # Ctrl-C is this script's: it stops the server
                preexec_fn=_die_with_parent,
            )
            atexit.register(self.stop)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and self.process.poll() is None:
                with contextlib.suppress(OSError):
                    if self.command("PING") == "+PONG":
                        return self.url
                time.sleep(0.05)
            self.stop()
        text = log.read_text(errors="replace")[-2000:] if log.exists() else ""
        raise RuntimeError(f"redis-server did not start:\n{text}")

    def command(self, *words: str) -> str:
        """One command (inline, words without spaces), its answer's first line."""
        with socket.create_connection(("127.0.0.1", self.port), timeout=5) as conn:
            conn.sendall(" ".join(words).encode() + b"\r\n")
            return conn.makefile("rb").readline().decode().strip()

    def version(self) -> str:
        answer = subprocess.run([self.binary, "--version"], capture_output=True, text=True)
        return answer.stdout.strip()

    def stop(self) -> None:
        process, self.process = self.process, None
        terminate(process, 5)


def keepalive_check(
    sink: Sink, body: bytes, requests: int = 50, address: str | None = None
) -> tuple[int, int, int]:
    """POST ``requests`` times on one connection: (answered as expected,
    sockets used, connections nginx accepted for them). 1 and 1 mean
    keep-alive holds. ``address``: one of the sink's failing ones, to check
    those (expected: their status); by default its last 202 address."""
    address = address or sink.addresses[-1]
    expected = sink.failing.get(address, 202)
    before, _ = sink.counters()
    conn = http.client.HTTPConnection(address, sink.port, timeout=5)
    sockets: set[int] = set()
    ok = 0
    try:
        for n in range(requests):
            conn.request(
                "POST",
                f"/users/check{n}/inbox",
                body=body,
                headers={"Content-Type": "application/activity+json"},
            )
            answer = conn.getresponse()
            answer.read()
            ok += answer.status == expected
            if conn.sock is not None:
                sockets.add(id(conn.sock))
            else:
                sockets.add(-n - 1)  # closed by the server: the next request reconnects
    finally:
        conn.close()
    after, _ = sink.counters()
    return ok, len(sockets), after - before - 1


# --- The queue ----------------------------------------------------------------------------------


def queue_deliveries(sender: str, activity: dict[str, Any], inboxes: Sequence[str]) -> None:
    from django_federation_delivery.sending import send

    send(sender, activity, inboxes)


def clear_queue() -> None:
    from django.db import connection

    from django_federation_delivery.models import Batch, Delivery

    Batch.objects.all().delete()
    Delivery.objects.all().delete()  # none left: deleted with their batches
    if connection.vendor == "sqlite":
        with connection.cursor() as cursor:
            cursor.execute("PRAGMA wal_checkpoint(TRUNCATE)")


def clear_all() -> None:
    """The queue, and what the deliverers remember of hosts: breakers, schemes,
    pauses. Nothing of one phase reaches the next."""
    from django_federation_delivery.models import Breaker, Host

    Breaker.objects.all().delete()
    Host.objects.all().delete()
    clear_queue()


def delivered_rows() -> int:
    from django_federation_delivery.models import Delivery, Status

    return Delivery.objects.filter(status=Status.DELIVERED).count()


class DelivererThread:
    """``Deliverer.run()`` (not drain: as ``run_deliverer`` runs it) in a
    thread of its own; :meth:`stop` is what SIGTERM does to run_deliverer."""

    def __init__(self, deliverer: Deliverer) -> None:
        self.deliverer = deliverer
        self.started = 0.0
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="deliverer", daemon=True)

    def _run(self) -> None:
        try:
            self.deliverer.run()
        except BaseException as exc:  # reported by the caller
            self.error = exc
            traceback.print_exc()

    def start(self) -> None:
        self.started = time.monotonic()
        self._thread.start()

    @property
    def summary(self) -> Summary:
        return self.deliverer.summary

    def alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self, timeout: float) -> bool:
        """Stop claiming, wait for what is in flight; whether it ended in time."""
        self.deliverer.stop()
        self._thread.join(timeout)
        return not self._thread.is_alive()


#: What the deliverer's worker threads are named: "federation-delivery-<n>".
WORKER_THREADS = "federation-delivery-"


@contextlib.contextmanager
def around_worker_threads(begin: Callable[[], Any], end: Callable[[Any], None]) -> Iterator[None]:
    """While inside, each of the deliverer's worker threads calls ``begin()``
    as it starts and ``end(what begin returned)`` as it ends: told apart by
    their names, so that a benchmark profiles or times them without reaching
    into the deliverer."""
    original = threading.Thread.run

    def run(thread: threading.Thread) -> None:
        if not thread.name.startswith(WORKER_THREADS):
            original(thread)
            return
        begun = begin()
        try:
            original(thread)
        finally:
            end(begun)

    threading.Thread.run = run  # type: ignore[method-assign]
    try:
        yield
    finally:
        threading.Thread.run = original  # type: ignore[method-assign]


# --- The bare pool's work ---------------------------------------------------------------------


class BarePoster:
    """What each thread of a bare pool does with a URL: sign ``body`` with
    ``key`` (draft-cavage) and POST it over a transport of the thread's own,
    the deliverer's workers' transport; True on a 2xx. Each thread keeps its
    own connections, as a thread pool with a requests session a thread does;
    with ``shared``, the threads share one set, as the deliverer's workers do.
    Errors are kept in :attr:`errors`; :meth:`close` closes every thread's
    transport."""

    def __init__(
        self, body: bytes, digest: str, key: Any, settings: Any, *, shared: bool = False
    ) -> None:
        from django_federation_delivery.exceptions import TransportError
        from django_federation_delivery.signatures import Scheme, sign_request
        from django_federation_delivery.transport import Connections, Transport

        self._error, self._sign, self._transport = TransportError, sign_request, Transport
        self._scheme = Scheme.CAVAGE
        self.body, self.digest, self.key, self.settings = body, digest, key, settings
        self.connections = Connections(settings) if shared else None
        self.transports: list[Any] = []
        self.errors: list[str] = []
        self._local = threading.local()
        self._lock = threading.Lock()

    def __call__(self, url: str) -> bool:
        transport = getattr(self._local, "transport", None)
        if transport is None:
            transport = self._local.transport = self._transport(self.settings, self.connections)
            with self._lock:
                self.transports.append(transport)
        headers = self._sign(self._scheme, url=url, body_sha256=self.digest, key=self.key)
        try:
            answer = transport.post(url, self.body, headers)
        except self._error as exc:
            self.errors.append(str(exc))
            return False
        return bool(200 <= answer.status < 300)

    def close(self) -> None:
        for transport in self.transports:
            transport.close()
        if self.connections is not None:
            self.connections.close()


# --- Setting up Django on a fresh database ------------------------------------------------------


def setup_django(workdir: Path, *, database_url: str | None, synchronous: str = "NORMAL") -> str:
    """Point tests.settings at a fresh database, set Django up, migrate
    (:func:`migrate_fresh`). Returns a description of the database."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    os.environ["DJANGO_SETTINGS_MODULE"] = "tests.settings"
    if database_url:
        os.environ["DATABASE_URL"] = database_url
    else:
        os.environ.pop("DATABASE_URL", None)
        path = workdir / "queue.sqlite3"
        os.environ["FD_SQLITE_NAME"] = str(path)
        with contextlib.closing(sqlite3.connect(path)) as db:
            db.execute("PRAGMA journal_mode=WAL")  # it persists in the file

    import django
    from django.db import connection
    from django.db.backends.signals import connection_created

    django.setup()
    if connection.vendor == "sqlite":

        def pragmas(sender: Any, connection: Any, **kwargs: Any) -> None:
            if connection.vendor == "sqlite":
                with connection.cursor() as cursor:
                    cursor.execute(f"PRAGMA synchronous={synchronous}")

        connection_created.connect(pragmas, weak=False)
    migrate_fresh()
    clear_queue()
    if connection.vendor == "sqlite":
        with connection.cursor() as cursor:
            cursor.execute("PRAGMA journal_mode")
            mode = cursor.fetchone()[0]
            cursor.execute("PRAGMA synchronous")
            sync = {0: "OFF", 1: "NORMAL", 2: "FULL", 3: "EXTRA"}[cursor.fetchone()[0]]
        return (
            f"SQLite {sqlite3.sqlite_version}, journal_mode={mode}, synchronous={sync}, "
            f"file {connection.settings_dict['NAME']}"
        )
    with connection.cursor() as cursor:
        cursor.execute("SELECT version()")
        version = str(cursor.fetchone()[0]).split(" on ")[0]
    return f"{connection.vendor} ({version})"


def migrate_fresh() -> None:
    """Migrate the database Django is set up on. A PostgreSQL one (a
    throwaway server's) has its public schema dropped and made again first:
    tables that an earlier version of the package's migrations made, which
    ``migrate`` takes as up to date, would lack a later column, and each
    statement naming it would fail, and be waited out as an outage."""
    from django.core.management import call_command
    from django.db import connection

    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("DROP SCHEMA public CASCADE")
            cursor.execute("CREATE SCHEMA public")
    call_command("migrate", verbosity=0)


#: SQLite as the example project (and README) configure it: WAL,
#: ``synchronous=NORMAL``, a 20 s busy timeout, transactions that take the
#: write lock as they begin. benchmarks/settings.py sets them for processes.
SQLITE_OPTIONS: dict[str, Any] = {
    "timeout": 20,
    "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
    "transaction_mode": "IMMEDIATE",
}


def use_sqlite_options(connection: Any) -> str:
    """On SQLite, :data:`SQLITE_OPTIONS` for this process's connection from
    its next opening on; what it adds to the database's description."""
    if connection.vendor != "sqlite":
        return ""
    connection.close()
    connection.settings_dict["OPTIONS"].update(SQLITE_OPTIONS)
    return ", transaction_mode=IMMEDIATE"


def package_fingerprint() -> str:
    """The package's version, its git commit and a digest of its source as run
    (other work may sit uncommitted in the tree; the digest tells runs apart)."""
    import hashlib

    import django_federation_delivery as package

    source = Path(package.__file__).resolve().parent
    digest = hashlib.sha256()
    for path in sorted(source.rglob("*.py")):
        digest.update(str(path.relative_to(source)).encode() + b"\0" + path.read_bytes())
    commit = ""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        answer = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        commit = answer.stdout.strip()
    version = getattr(package, "__version__", "?")
    return f"{version}, git {commit or '?'}, source sha256 {digest.hexdigest()[:12]}"


def environment_lines() -> list[str]:
    """The package, Python and library versions, the CPUs and the load: what
    a figure needs next to it to be compared with another."""
    from importlib import metadata

    import django

    versions = ", ".join(
        f"{name} {metadata.version(name)}" for name in ("requests", "urllib3", "cryptography")
    )
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return [
        f"package: django-federation-delivery {package_fingerprint()}",
        f"Python {platform.python_version()}, Django {django.get_version()}, {versions}",
        f"CPUs: {cpus} usable ({os.cpu_count()} online), {platform.machine()}",
        f"load average at the start: {load_average()}",
    ]


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def make_activity(sender: str) -> dict[str, Any]:
    """A Create of a Note the size of an ordinary post (about 1.5 kB of JSON)."""
    note = f"{sender}/statuses/109876543210"
    public = "https://www.w3.org/ns/activitystreams#Public"
    text = " ".join(["A note of ordinary length, sent to many inboxes at once."] * 8)
    return {
        "@context": ["https://www.w3.org/ns/activitystreams", "https://w3id.org/security/v1"],
        "id": f"{note}/activity",
        "type": "Create",
        "actor": sender,
        "published": "2025-01-01T12:00:00Z",
        "to": [public],
        "cc": [f"{sender}/followers"],
        "object": {
            "id": note,
            "type": "Note",
            "attributedTo": sender,
            "published": "2025-01-01T12:00:00Z",
            "url": note.replace("/users/", "/@").replace("/statuses/", "/"),
            "to": [public],
            "cc": [f"{sender}/followers"],
            "sensitive": False,
            "content": f"<p>{text}</p>",
            "tag": [],
            "attachment": [],
        },
    }


# --- Running ------------------------------------------------------------------------------------


def positive(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"expected 1 or more, not {value}")
    return number


def sigterm_interrupts(number: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt  # unwinds through the finally blocks that stop nginx


def add_database_and_tmpdir(parser: argparse.ArgumentParser) -> None:
    """``--database-url`` (a throwaway PostgreSQL, by default $DATABASE_URL;
    SQLite without one) and ``--tmpdir``, as the in-process benchmarks take them."""
    parser.add_argument(
        "--database-url",
        default=os.environ.get("DATABASE_URL", ""),
        help="a THROWAWAY PostgreSQL, its public schema dropped and made again "
        "(default: $DATABASE_URL; without it, SQLite)",
    )
    parser.add_argument("--tmpdir", default=None)


def in_workdir(prefix: str, tmpdir: str | None, body: Callable[[Path], int]) -> int:
    """``body(workdir)`` in a fresh temporary directory, removed after; SIGTERM
    and Ctrl-C end it with status 130."""
    signal.signal(signal.SIGTERM, sigterm_interrupts)
    workdir = Path(tempfile.mkdtemp(prefix=prefix, dir=tmpdir))
    try:
        return body(workdir)
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def percentile(values: Sequence[float], fraction: float) -> float:
    """The value ``fraction`` of the way up ``values`` sorted (nan for none)."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def spread(values: Sequence[float], digits: int) -> str:
    """The median of ``values``, and their range: "1.23 (1.10–1.41)"."""
    return (
        f"{statistics.median(values):.{digits}f} "
        f"({min(values):.{digits}f}–{max(values):.{digits}f})"
    )


def median_or_nan(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")
