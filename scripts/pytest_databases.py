"""Run pytest on SQLite and, if FD_POSTGRES_URL is set, on PostgreSQL, both at once.

    python scripts/pytest_databases.py [pytest arguments]

tox.ini runs this in each environment. The two runs share nothing (each
has a database of its own: see tests/settings.py), and each spends much of
its time waiting on sockets, subprocesses and timers, so together they take
little longer than either. Each run's output is printed whole, under its
name, when it ends. Exits 0 only if every run passed: a run that selects
no test at all (pytest's exit status 5) is a failure, not a pass.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import time
from typing import IO

NO_TESTS_COLLECTED = 5


def main(args: list[str]) -> int:
    env = {key: value for key, value in os.environ.items() if key != "DATABASE_URL"}
    runs: dict[str, dict[str, str]] = {"SQLite": env}
    postgres_url = os.environ.get("FD_POSTGRES_URL")
    if postgres_url:
        runs["PostgreSQL"] = {**env, "DATABASE_URL": postgres_url}
    else:
        print("FD_POSTGRES_URL is not set: the suite runs on SQLite only", flush=True)

    started = time.monotonic()
    failed: list[str] = []
    with contextlib.ExitStack() as stack:
        running: dict[str, tuple[subprocess.Popen[bytes], IO[bytes]]] = {}
        for name, run_env in runs.items():
            output = stack.enter_context(tempfile.TemporaryFile())
            process = subprocess.Popen(
                [sys.executable, "-m", "pytest", *args],
                env=run_env,
                stdin=subprocess.DEVNULL,
                stdout=output,
                stderr=subprocess.STDOUT,
            )
            running[name] = (process, output)

        for name, (process, output) in running.items():
            code = process.wait()
            output.seek(0)
            print(f"\n----- pytest on {name} -----", flush=True)
            sys.stdout.buffer.write(output.read())
            sys.stdout.flush()
            if code == NO_TESTS_COLLECTED:
                failed.append(f"{name}: no test ran (pytest exit status 5)")
            elif code != 0:
                failed.append(f"{name}: pytest exit status {code}")

    took = time.monotonic() - started
    if failed:
        print(f"\nFAILED ({took:.0f} s): " + "; ".join(failed), flush=True)
        return 1
    print(f"\npassed on {' and '.join(runs)} ({took:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
