"""The tests' settings, with SQLite configured as the example project
configures it: WAL, ``synchronous=NORMAL``, a 20 s busy timeout, and
transactions that take the write lock as they begin (``IMMEDIATE``).

For benchmarks that run ``manage.py run_deliverer`` and the senders as
processes of their own (``steady.py``): each process opens its own
connections, so the options must be settings, not a signal set up in one
process. ``FD_SQLITE_NAME`` names the file; ``DATABASE_URL`` a PostgreSQL.
"""

from __future__ import annotations

from benchmarks.common import SQLITE_OPTIONS
from tests.settings import *  # noqa: F403
from tests.settings import DATABASES

if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    DATABASES["default"]["OPTIONS"] = dict(SQLITE_OPTIONS)

# benchmarks/django_q.py's cluster: the example project's, as a small project
# runs it (2 workers), with room for the default 50 s round.
Q_CLUSTER = {
    "name": "federation-delivery-benchmarks",
    "orm": "default",
    "workers": 2,
    "timeout": 90,
    "retry": 120,
    "poll": 0.2,
    "catch_up": False,
    "log_level": "WARNING",
}
