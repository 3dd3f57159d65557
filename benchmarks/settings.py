"""The tests' settings, with SQLite configured as the example project
configures it: WAL, ``synchronous=NORMAL``, a 20 s busy timeout, and
transactions that take the write lock as they begin (``IMMEDIATE``).

For benchmarks that run ``manage.py run_deliverer`` and the senders as
processes of their own (``steady.py``): each process opens its own
connections, so the options must be settings, not a signal set up in one
process. ``FD_SQLITE_NAME`` names the file; ``DATABASE_URL`` a PostgreSQL.
"""

from __future__ import annotations

from tests.settings import *  # noqa: F403
from tests.settings import DATABASES

if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    DATABASES["default"]["OPTIONS"] = {
        "timeout": 20,
        "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
        "transaction_mode": "IMMEDIATE",
    }
