"""Run the suite in tox environments, on SQLite and PostgreSQL, several runs at once.

    python scripts/pytest_matrix.py [--jobs N] ENV [ENV ...] [-- pytest arguments]

Each ENV is a tox environment already built (``tox run --notest``; inside
tox, the running one). In each, the suite runs on SQLite and, if
FD_POSTGRES_URL is set, on PostgreSQL (in the oldest and the newest cell,
POSTGRES_ENVS, or in the one asked for): ``-m "not slow"``, and in SLOW_ENV the
slow tests (subprocesses, Chromium, those that wait seconds) too, as runs
of their own, so that the
longest runs start first and no run waits for another: three at once
(pytest-xdist), the browser's apart, in one process with one Chromium.
Each run starts once one environment of its Python has collected the suite,
so that it finds it compiled (the slow tests' Python first); the browser's,
also once the file FD_CHROMIUM_STATUS names (if set) says Chromium's install,
which scripts/test runs in the background, ended with status 0. On PostgreSQL, the
tests that cannot reach a database, or test what no database changes, are
left out: they ran on SQLite, and would run the same. In PREPARED_ENV, the
PostgreSQL runs have psycopg prepare every statement. At most N runs go at
once (FD_TEST_JOBS; by default all of them): they share nothing (each has a
database of its own: see tests/settings.py), and each mostly waits on
sockets, subprocesses and timers (a "not slow" run alone on a quiet machine:
62 s of CPU in 204 s), so that only all of them at once keep two cores busy.
All at once, the two cores are the bound: 480 s for 622 s of CPU besides
the server's; with each "not slow" run in two processes, 438 s for 694 s
(see POSTGRES_WORKERS).

Each run's output is printed whole when it ends, under its name, then a
table of every run. Exits 0 only if every run passed; a run that selects no
test (pytest's exit status 5) passes only if another run of the same
environment and database ran tests, so that nothing passes having tested
nothing.

A run still going after FD_TEST_RUN_TIMEOUT seconds (by default 1200, four
times the longest seen with all runs at once on two cores) has hung where no
test's own timeout reaches (between tests, at exit, in an xdist worker): each
of its pytest processes writes every thread's stack (tests/conftest.py
registers that on SIGUSR1), which is printed with its output, and the run is
killed, it and every process it started, and failed.

After the table come the waits of tests/conftest.py's wait_until that took
more than half their bound, in any run, passed or not: where a slower machine
would fail first.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SLOW_ENV = "py313-django61"  # the newest cell; tox.ini installs Playwright there only
#: The cell whose PostgreSQL runs have psycopg prepare every statement at its
#: first run (OPTIONS prepare_threshold 0, see tests/settings.py), as a
#: project that sets prepare_threshold has it do; the others, Django's
#: default, prepare none.
PREPARED_ENV = SLOW_ENV
#: The cells whose "not slow" suite also runs on PostgreSQL, when the matrix
#: runs more than these: the oldest Django, with the lowest psycopg, and the
#: newest. The statements written by hand are the same under every Django,
#: and the two ends are where its PostgreSQL backend and psycopg differ
#: most; the cells between run the suite on SQLite.
POSTGRES_ENVS = ("py311-django42-lowest", SLOW_ENV)
NO_TESTS_COLLECTED = 5
SLOW_WORKERS = 3
#: The "not slow" runs on PostgreSQL, in two processes each: the longest
#: runs and the last to end (with all runs at once on two cores, 440 s in
#: one process, 383 s in two, for about 12 s more CPU each). Not those on
#: SQLite: two processes each made all runs 72 s of CPU more for 42 s less
#: in all, the two cores being the bound.
POSTGRES_WORKERS = 2
RUN_TIMEOUT = float(os.environ.get("FD_TEST_RUN_TIMEOUT", 1200))
#: How long the processes of a run that hung are given to write their stacks.
STACKS_GRACE = 5.0
#: pytest's closing line: "3 passed, 1 skipped in 2.50s", "no tests ran in 0.1s".
RESULT = re.compile(r"\b(passed|failed|errors?|no tests ran)\b.* in [\d.]+s")
#: The niceness of the runs without slow tests. The slow runs mostly wait on
#: subprocesses that start Django, and on a machine busy past its cores each
#: start takes seconds: they are the longest, and with first call on the CPU
#: they are not held back by the others, which take up what is left (all
#: runs at once on two cores: the slow SQLite run, the last to end, in 316 s
#: with the others at niceness 5, in 304 s at 15; but at 15 a test's own
#: server thread in those runs once waited past a 0.6 s timeout nine times
#: running).
NOT_SLOW_NICENESS = 5
#: Which tests a database's runs leave out, having run them on SQLite: those
#: that cannot reach a database (tests/conftest.py marks them no_database)
#: and those of what no database changes (marked any_database by hand).
ONLY = {"PostgreSQL": "not no_database and not any_database"}


@dataclass
class Run:
    env: str
    database: str
    marks: str
    python: str
    environ: dict[str, str]
    args: list[str]
    niceness: int = 0
    code: int | None = None
    seconds: float = 0.0
    #: CPU seconds of pytest and what it waited for (its workers, the
    #: processes its tests started), not of the PostgreSQL server.
    cpu: float = 0.0
    summary: str = ""
    timed_out: bool = False
    near_misses: list[str] = field(default_factory=list)
    output: bytes = field(default=b"", repr=False)
    #: Set once its Python has collected the suite (see warm): it starts then.
    warmed: threading.Event = field(default_factory=threading.Event, repr=False)
    #: A file it waits for before it starts, and what it must hold: "0", the
    #: status of Chromium's install, which scripts/test runs in the background.
    after: Path | None = None
    #: Why it did not start, if it did not.
    not_started: str = ""

    @property
    def name(self) -> str:
        return f"{self.env} on {self.database}, -m {self.marks!r}"

    def start_and_wait(self, timeout: float) -> None:
        started = time.monotonic()
        reports = Path(tempfile.mkdtemp(prefix="fd-test-reports-"))
        with tempfile.TemporaryFile() as output:
            nice = ["nice", "-n", str(self.niceness)] if self.niceness else []
            process = subprocess.Popen(
                [*nice, self.python, "-m", "pytest", "-m", self.marks, *self.args],
                cwd=ROOT,
                env={**self.environ, "FD_TEST_REPORTS": str(reports)},
                stdin=subprocess.DEVNULL,
                stdout=output,
                stderr=subprocess.STDOUT,
                # A group of its own, to be killed whole if it hangs.
                start_new_session=True,
            )
            watchdog = threading.Timer(timeout, self._hung, (process.pid,))
            watchdog.start()
            try:
                _, status, usage = os.wait4(process.pid, 0)
            finally:
                watchdog.cancel()
            process.returncode = self.code = os.waitstatus_to_exitcode(status)
            self.cpu = usage.ru_utime + usage.ru_stime
            output.seek(0)
            self.output = output.read() + dumped(reports)
        misses = reports / "near-misses.txt"
        if misses.exists():
            self.near_misses = misses.read_text(errors="replace").splitlines()
        shutil.rmtree(reports, ignore_errors=True)
        self.seconds = time.monotonic() - started
        # pytest's last word, not what a thread printed after it.
        lines = [
            line
            for line in self.output.decode(errors="replace").splitlines()
            if RESULT.search(line)
        ]
        self.summary = lines[-1].strip("= ") if lines else "(no result line)"

    def _hung(self, group: int) -> None:
        self.timed_out = True
        for sig, wait in ((signal.SIGUSR1, STACKS_GRACE), (signal.SIGKILL, 0.0)):
            try:
                os.killpg(group, sig)
            except ProcessLookupError:
                return
            time.sleep(wait)


def dumped(reports: Path) -> bytes:
    """The stacks a hung run's processes wrote, each under its process id."""
    return b"".join(
        f"\n----- the threads of process {path.stem[7:]} when the run was stopped -----\n".encode()
        + path.read_bytes()
        for path in sorted(reports.glob("stacks-*.txt"))
        if path.stat().st_size
    )


def interpreter(env: str) -> str:
    if os.environ.get("TOX_ENV_NAME") == env:
        return sys.executable
    python = ROOT / ".tox" / env / "bin" / "python"
    if not python.exists():
        sys.exit(f"{python} does not exist: build it first with tox run -e {env} --notest")
    return str(python)


def plan(envs: list[str], args: list[str]) -> list[Run]:
    base = {key: value for key, value in os.environ.items() if key != "DATABASE_URL"}
    databases = {"SQLite": base}
    if postgres_url := os.environ.get("FD_POSTGRES_URL"):
        databases = {"PostgreSQL": {**base, "DATABASE_URL": postgres_url}, **databases}
    else:
        print("FD_POSTGRES_URL is not set: the suite runs on SQLite only", flush=True)
    # Every run shows its slowest tests; parallel runs would race on one cache.
    args = ["--durations=15", "-p", "no:cacheprovider", *args]
    runs = []
    # The longest first: the slow tests, then PostgreSQL, then SQLite.
    if SLOW_ENV in envs:
        # They mostly wait (on subprocesses, leases): pytest-xdist runs three
        # at once, so that the longest runs are not the sum of them. With
        # four, the slow SQLite run was 20 s shorter, but the killed-mid-drain
        # test's second drain once ended with deliveries still pending (a
        # 15 s lease and 1 s attempts, on a machine that busy).
        # Its default scheduling: with --dist loadgroup (one worker for the
        # browser's tests), pytest-xdist 3.8 waits for ever once it has
        # replaced a worker that crashed.
        slow_args = ["-n", str(SLOW_WORKERS), *args]
        for database, environ in databases.items():
            only = f" and {ONLY[database]}" if database in ONLY else ""
            marks = f"slow and not browser{only}"
            label, run_environ = prepared(SLOW_ENV, database, environ)
            runs.append(Run(SLOW_ENV, label, marks, interpreter(SLOW_ENV), run_environ, slow_args))
        # The browser's tests (any_database) in a process of their own: one
        # Chromium serves them all, where each xdist worker would start one.
        sqlite = databases["SQLite"]
        browser = Run(SLOW_ENV, "SQLite", "browser", interpreter(SLOW_ENV), sqlite, args)
        if status := os.environ.get("FD_CHROMIUM_STATUS"):
            browser.after = Path(status)
        runs.append(browser)
    # A cell asked for alone runs on every database.
    postgres_envs = [env for env in envs if env in POSTGRES_ENVS] or envs
    for database, environ in databases.items():
        marks = f"not slow and {ONLY[database]}" if database in ONLY else "not slow"
        run_args = ["-n", str(POSTGRES_WORKERS), *args] if database == "PostgreSQL" else args
        for env in postgres_envs if database == "PostgreSQL" else envs:
            label, run_environ = prepared(env, database, environ)
            runs.append(
                Run(env, label, marks, interpreter(env), run_environ, run_args, NOT_SLOW_NICENESS)
            )
    return runs


def prepared(env: str, database: str, environ: dict[str, str]) -> tuple[str, dict[str, str]]:
    """The name of a run's database, and its environment: in PREPARED_ENV,
    PostgreSQL with every statement prepared."""
    if env != PREPARED_ENV or database != "PostgreSQL":
        return database, environ
    return f"{database} (prepared)", {**environ, "FD_PREPARE_THRESHOLD": "0"}


#: What has a Python compile the suite and rewrite its asserts, running no test.
COLLECT_ONLY = ("-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider")


def warm(runs: list[Run]) -> None:
    """Has one environment of each Python collect the suite before its runs
    start, and sets each run's ``warmed`` when its own Python has.

    Collecting compiles what the suite imports and rewrites the asserts of
    its modules, and keeps both (PYTHONPYCACHEPREFIX, by scripts/test and
    tox.ini): 7 s of CPU cold, 2.4 s after. Runs started together would each
    do it cold, as would each xdist worker. The first run's Python (the slow
    tests', the longest runs) goes first; the others' collect meanwhile at
    niceness 10. Anything wrong is left for the runs to say.
    """
    if sys.dont_write_bytecode or os.environ.get("PYTHONDONTWRITEBYTECODE"):
        for run in runs:
            run.warmed.set()
        return
    started = time.monotonic()
    pythons: dict[str, list[Run]] = {}
    for run in runs:
        pythons.setdefault(os.path.realpath(run.python), []).append(run)

    def collect(first: bool, waiting: list[Run]) -> None:
        run = waiting[0]
        nice = [] if first else ["nice", "-n", "10"]
        try:
            subprocess.run(
                [*nice, run.python, *COLLECT_ONLY],
                cwd=ROOT,
                env=run.environ,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                timeout=RUN_TIMEOUT,
            )
        except subprocess.TimeoutExpired:
            pass
        finally:
            print(f"collected in {run.env}: {time.monotonic() - started:.0f} s", flush=True)
            for each in waiting:
                each.warmed.set()

    for n, waiting in enumerate(pythons.values()):
        threading.Thread(target=collect, args=(n == 0, waiting), daemon=True).start()


def ready(run: Run) -> bool:
    """Waits for the file ``run.after`` (up to the run's own bound), and says
    whether it holds "0"; if not, ``run.not_started`` says why."""
    assert run.after is not None
    deadline = time.monotonic() + RUN_TIMEOUT
    while not run.after.exists() and time.monotonic() < deadline:
        time.sleep(0.5)
    try:
        status = run.after.read_text().strip()
    except OSError:
        status = ""
    if status != "0":
        run.not_started = f"not started: {run.after} holds {status!r}, not '0'"
    return not run.not_started


def run_all(runs: list[Run], jobs: int) -> None:
    free = threading.Semaphore(jobs)
    printing = threading.Lock()

    def one(run: Run) -> None:
        try:
            run.warmed.wait()
            if run.after is None or ready(run):
                run.start_and_wait(RUN_TIMEOUT)
        finally:
            free.release()
        with printing:
            print(f"\n----- {run.name}: {run.seconds:.0f} s, {run.cpu:.0f} s CPU -----", flush=True)
            sys.stdout.buffer.write(run.output)
            sys.stdout.flush()

    threads = []
    for run in runs:
        free.acquire()
        thread = threading.Thread(target=one, args=(run,))
        thread.start()
        threads.append(thread)
    for thread in threads:
        thread.join()


def verdicts(runs: list[Run]) -> dict[int, str]:
    """What failed, by the index of its run: a pytest failure, or a run that
    selected no test where no other run of its environment and database did."""
    tested = {(r.env, r.database) for r in runs if r.code in (0, 1)}
    failed = {}
    for index, run in enumerate(runs):
        if run.not_started:
            failed[index] = run.not_started
        elif run.timed_out:
            failed[index] = f"still going after {RUN_TIMEOUT:.0f} s: stopped (its stacks are above)"
        elif run.code == NO_TESTS_COLLECTED:
            if (run.env, run.database) not in tested:
                failed[index] = "no test ran in this environment on this database"
        elif run.code != 0:
            failed[index] = f"pytest exit status {run.code}"
    return failed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=int(os.environ.get("FD_TEST_JOBS", 0)))
    parser.add_argument("envs", nargs="+", metavar="ENV")
    argv = sys.argv[1:]
    pytest_args: list[str] = []
    if "--" in argv:
        split = argv.index("--")
        argv, pytest_args = argv[:split], argv[split + 1 :]
    options = parser.parse_args(argv)
    if options.jobs < 0:
        parser.error(f"--jobs must be at least 1 (or 0 for all at once), not {options.jobs}")

    started = time.monotonic()
    runs = plan(options.envs, pytest_args)
    jobs = options.jobs or len(runs)
    if jobs > 1:
        warm(runs)
    else:
        for run in runs:
            run.warmed.set()
    run_all(runs, jobs)
    failed = verdicts(runs)

    print(f"\n----- {len(runs)} runs, {jobs} at once -----", flush=True)
    for index, run in enumerate(runs):
        if index in failed:
            verdict = f"FAILED: {failed[index]}"
        elif run.code == NO_TESTS_COLLECTED:
            verdict = "none selected"
        else:
            verdict = "ok"
        times = f"{run.seconds:5.0f} s {run.cpu:5.0f} s CPU"
        print(f"{times}  {run.name:55}  {run.summary}  [{verdict}]")
    misses = [(run, line) for run in runs for line in run.near_misses]
    if misses:
        print(f"\n----- {len(misses)} waits past half their bound -----")
        for run, line in sorted(misses, key=lambda miss: -float(miss[1].split()[0])):
            print(f"{line}  [{run.env} on {run.database}]")
    took = f"{time.monotonic() - started:.0f} s, {sum(run.cpu for run in runs):.0f} s CPU"
    if failed:
        print(f"FAILED: {len(failed)} of {len(runs)} runs ({took})", flush=True)
        return 1
    print(f"passed: {len(runs)} runs ({took})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
