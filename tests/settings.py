"""Settings for the test suite.

SQLite unless ``DATABASE_URL`` names another database: ``scripts/test`` runs
the suite once on each, starting a private PostgreSQL for the second run.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import environ

BASE_DIR = Path(__file__).resolve().parent
TEST_DB_DIR = Path(os.environ.get("FD_TEST_DB_DIR") or BASE_DIR / "var")

env = environ.Env()

SECRET_KEY = "tests-only-not-secret"
DEBUG = False
USE_TZ = True
TIME_ZONE = "UTC"
ROOT_URLCONF = "tests.urls"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django_federation_delivery",
    # contrib.django_q: its tests run rounds in a real qcluster.
    "django_q",
]

# The cluster of contrib.django_q's tests: the ORM broker on the test
# database, a timeout that leaves a round room, and a retry past it.
Q_CLUSTER = {
    "name": "federation-delivery-tests",
    "orm": "default",
    "workers": 2,
    "timeout": 60,
    "retry": 90,
    "poll": 0.2,
    "catch_up": False,
    "save_limit": 100,
    "log_level": "WARNING",
    # A test's own cluster settings (tests/test_django_q.py).
    **json.loads(os.environ.get("FD_Q_CLUSTER_JSON", "{}")),
}

# The backends of contrib.tasks's tests (Django 6.0 and later; unread
# before). Its tasks are declared on "federation_delivery": a queue its
# tests run as a worker would, which its system check finds fit to run
# them. The tests enqueue them on the others too.
TASKS = {
    "default": {"BACKEND": "django.tasks.backends.immediate.ImmediateBackend"},
    "federation_delivery": {"BACKEND": "tests.taskqueue.QueueBackend"},
    "dummy": {"BACKEND": "django.tasks.backends.dummy.DummyBackend"},
}

# The admin's CSS, served by the live server of the browser tests.
STATIC_URL = "static/"

MIDDLEWARE = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ]
        },
    }
]

if "DATABASE_URL" in os.environ:
    DATABASES = {"default": env.db("DATABASE_URL")}
    # One test database per run, as with SQLite below: scripts/test runs
    # several at once on one server.
    DATABASES["default"]["TEST"] = {"NAME": f"test_{DATABASES['default']['NAME']}_{os.getpid()}"}
    # psycopg prepares a statement once a connection has run it so many times
    # (0: at once); Django's default, unset, prepares none.
    if os.environ.get("FD_PREPARE_THRESHOLD"):
        DATABASES["default"].setdefault("OPTIONS", {})["prepare_threshold"] = int(
            os.environ["FD_PREPARE_THRESHOLD"]
        )
else:
    # A file, not memory: the deliverer's threads open connections of their
    # own, and WAL with a busy timeout is what a real deployment runs.
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.sqlite3",
            # A subprocess deliverer is pointed at the test database by name.
            "NAME": os.environ.get("FD_SQLITE_NAME", str(BASE_DIR / "var" / "tests.sqlite3")),
            "OPTIONS": {"timeout": 20},
            # One file per test run, so that runs side by side (tox envs, a
            # developer's and CI's) never share a database; in FD_TEST_DB_DIR
            # if set (scripts/test sets a directory in memory).
            "TEST": {"NAME": str(TEST_DB_DIR / f"test-{os.getpid()}.sqlite3")},
        }
    }

# A second database, for the tests of a queue kept elsewhere than in
# "default" (``using``, ``--database``, a router): on the same server, or a
# file beside. Made for a run only when a test asks for it by name
# (``django_db(databases=[...])``).
if "DATABASE_URL" in os.environ:
    DATABASES["queue"] = {
        **DATABASES["default"],
        "TEST": {"NAME": f"test_{DATABASES['default']['NAME']}_queue_{os.getpid()}"},
    }
else:
    DATABASES["queue"] = {
        **DATABASES["default"],
        "NAME": str(BASE_DIR / "var" / "queue.sqlite3"),
        "TEST": {"NAME": str(TEST_DB_DIR / f"test-{os.getpid()}-queue.sqlite3")},
    }

# The tests' inboxes are on loopback on purpose: the warning that says a
# server should not open it to inboxes is tested by itself (test_checks.py).
SILENCED_SYSTEM_CHECKS = ["federation_delivery.W003"]

# Logging in is most of what the admin tests do: a hasher that takes no time.
PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]

FEDERATION_DELIVERY = {
    "SENDER_KEYS": "tests.keys.sender_key",
    # Every test server listens on loopback, inboxes and webhook receivers
    # alike; nothing else is ever allowed.
    "ALLOWED_NETWORKS": ["127.0.0.0/8"],
    "WEBHOOK_ALLOWED_NETWORKS": ["127.0.0.0/8"],
    # A test sends its whole outcome to a subprocess deliverer this way.
    **json.loads(os.environ.get("FD_SETTINGS_JSON", "{}")),
}

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "loggers": {
        "django_federation_delivery": {
            "handlers": ["console"],
            # DEBUG in a subprocess deliverer whose test waits for its idle line.
            "level": os.environ.get("FD_LOG_LEVEL", "WARNING"),
        }
    },
}
