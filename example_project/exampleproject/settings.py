"""Settings for the example project, read from the environment (django-environ).

Every setting has a default good for trying the project out on one machine;
see example_project/README.rst for the variables.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import django
import environ
from django.core.exceptions import ImproperlyConfigured

from django_federation_delivery.webhooks import webhooks_from_env

BASE_DIR = Path(__file__).resolve().parent.parent  # example_project/
VAR_DIR = BASE_DIR / "var"  # the SQLite database
VAR_DIR.mkdir(exist_ok=True)

env = environ.Env()


def _database(variable: str, default: str) -> dict[str, Any]:
    """``variable``, a database URL, as a DATABASES entry. A malformed one is
    refused by name with the form it should have, never shown: it may hold a
    password, and so may django-environ's warnings, which print what it read."""
    url = env.str(variable, default=default)
    scheme, slashes, rest = url.partition("://")
    if not slashes or scheme.lower() not in env.DB_SCHEMES:
        # "//…", "postgres//…", and "postgres:/…", which django-environ reads
        # as a local database named after the rest, password and all.
        problem = "its scheme is missing, unknown or not followed by ://"
    elif scheme.lower() == "sqlite" and rest.partition("/")[0] not in ("", ":memory:"):
        # sqlite://var/db.sqlite3 would be db.sqlite3 wherever the process runs.
        problem = "a SQLite URL has no host: sqlite:////absolute/path"
    else:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                config: dict[str, Any] = env.db_url_config(url)
        except ValueError:  # a port that is not a number from 0 to 65535
            problem = "its port, or another part, could not be read"
        else:
            problem = _connection_options(config) or _sqlite_problem(config)
            if not problem:
                return config
    raise ImproperlyConfigured(
        f"{variable} must be a database URL such as postgres://user:password@host:5432/name "
        f"or sqlite:////path/to/db.sqlite3 ({problem}; the value is not shown)."
    )


def _connection_options(config: dict[str, Any]) -> str:
    """What is wrong with the ``conn_max_age`` and ``conn_health_checks`` a
    database URL's query gave (django-environ passes on, as text, what it
    cannot read), "" if nothing; ``conn_health_checks`` read as a bool."""
    age = config.get("CONN_MAX_AGE")
    # django-environ reads the value as a Python literal: "[600]" is a list.
    number = isinstance(age, int | float) and not isinstance(age, bool)
    if age is not None and not (number and 0 <= age < float("inf")):
        return "its conn_max_age is not a number of seconds, 0 or more, nor None"
    if "CONN_HEALTH_CHECKS" in config:
        checks = _truth(str(config["CONN_HEALTH_CHECKS"]))
        if checks is None:
            return "its conn_health_checks is not true or false"
        config["CONN_HEALTH_CHECKS"] = checks
    return ""


def _sqlite_problem(config: dict[str, Any]) -> str:
    """What is wrong with a SQLite database's path and its ``timeout``, ""
    if nothing; the timeout read as seconds."""
    if not config.get("ENGINE", "").endswith("sqlite3"):
        return ""
    name = str(config.get("NAME", ""))
    if name not in ("", ":memory:") and not Path(name).is_absolute():
        # sqlite:///var/db.sqlite3: var/db.sqlite3 from wherever the process runs.
        return "a SQLite path must be absolute: sqlite:////absolute/path"
    options = config.get("OPTIONS", {})
    if "timeout" in options:
        try:
            seconds = float(options["timeout"])
        except (TypeError, ValueError):
            seconds = -1.0
        if not 0 <= seconds < float("inf"):
            return "its timeout is not a number of seconds, 0 or more"
        options["timeout"] = seconds
    return ""


def _truth(text: str) -> bool | None:
    """``text`` as true or false: django-environ's words for true and their
    opposites, in any case; None for anything else."""
    if text.strip().lower() in env.BOOLEAN_TRUE_STRINGS:
        return True
    if text.strip().lower() in ("false", "off", "n", "no", "0"):
        return False
    return None


def _bool(variable: str, default: bool) -> bool:
    """``variable``, true or false (see :func:`_truth`); anything else is
    refused (not read as false)."""
    text = env.str(variable, default=str(default))
    truth = _truth(text)
    if truth is not None:
        return truth
    raise ImproperlyConfigured(
        f"{variable} must be true or false (yes or no, on or off, 1 or 0), not {text!r}."
    )


def _list(variable: str, default: tuple[str, ...] = ()) -> list[str]:
    """``variable``, a comma list: each item stripped, empty ones left out."""
    text = env.str(variable, default=",".join(default))
    return [item.strip() for item in text.split(",") if item.strip()]


def _positive(
    variable: str,
    default: float,
    kind: Callable[[str], float],
    what: str,
    most: float = float("inf"),
) -> float:
    """``variable``, a positive number read by ``kind``, finite and at most
    ``most``; else refused as not ``what``."""
    text = env.str(variable, default=str(default))
    try:
        number: float = kind(text)
    except ValueError:
        number = float("nan")
    if not (0 < number <= most and number < float("inf")):
        raise ImproperlyConfigured(f"{variable} must be {what}, not {text!r}.")
    return number


def _days(variable: str, default: float) -> float:
    """``variable``, a number of days, in seconds (RETENTION's unit), at
    most the package's longest retention (36,500 days)."""
    what = "a positive number of days, at most 36500"
    return _positive(variable, default, float, what, most=36500) * 86400


DEBUG = _bool("DEBUG", default=True)
# The default is for development only (DEBUG on): with DEBUG off, SECRET_KEY
# must be set, or sessions would be signed with a key anyone can read here.
# Read as it is: django-environ would take a value starting with "$", as
# one in fifty of Django's random keys does, for the name of another
# variable, and, that one unset, fall back to the default here, which is
# public.
if not DEBUG and not env.ENVIRON.get("SECRET_KEY"):
    raise ImproperlyConfigured("SECRET_KEY must be set when DEBUG is false.")
SECRET_KEY = env.ENVIRON.get("SECRET_KEY") or "django-insecure-example-project-dev-only"
# A comma list of system check ids not to show (scripts/demo silences the
# warning its loopback inboxes would raise, federation_delivery.W003).
SILENCED_SYSTEM_CHECKS = _list("SILENCED_SYSTEM_CHECKS")
ALLOWED_HOSTS = _list("ALLOWED_HOSTS", default=("localhost", "127.0.0.1", "[::1]"))

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django_federation_delivery",
    "federation_demo",
]

# django-q2, when installed (the package's "django-q" or "test" extra): its
# cluster can run the deliverer's rounds instead of run_deliverer
# (scripts/demo --django-q). The ORM broker: its queue is this database.
if find_spec("django_q") is not None:
    INSTALLED_APPS.append("django_q")
    Q_CLUSTER = {
        "name": "example-project",
        "orm": "default",
        "workers": _positive("Q_CLUSTER_WORKERS", 2, int, "a whole number of workers, 1 or more"),
        # A round must end within both: contrib.django_q's rounds fit their
        # bound to them (here 90 s, less 35 s to finish what is in flight).
        "timeout": 90,
        "retry": 120,
        # How often the ORM broker looks for a task: a round starts this soon.
        "poll": 0.2,
        "catch_up": False,
        "log_level": "WARNING",
    }

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "exampleproject.urls"
WSGI_APPLICATION = "exampleproject.wsgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [],
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

DATABASES = {"default": _database("DATABASE_URL", default=f"sqlite:///{VAR_DIR / 'db.sqlite3'}")}

if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    # A web process and run_deliverer write to the same file at once. Without
    # these, one of them soon fails with "database is locked":
    # - timeout: wait up to 20 s for the other's write instead of failing;
    # - WAL: readers do not block the writer, nor the writer readers;
    # - IMMEDIATE: a transaction takes the write lock when it begins, so it
    #   waits (timeout) rather than failing when it first writes.
    sqlite_options: dict[str, Any] = {"timeout": 20}
    if django.VERSION >= (5, 1):
        sqlite_options["init_command"] = "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;"
        sqlite_options["transaction_mode"] = "IMMEDIATE"
    # On Django 4.2, federation_demo.apps sets WAL when a connection opens.
    DATABASES["default"]["OPTIONS"] = {**sqlite_options, **DATABASES["default"].get("OPTIONS", {})}

DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
STATIC_ROOT = VAR_DIR / "static"


FEDERATION_DELIVERY = {
    "SENDER_KEYS": "federation_demo.keys.sender_key",
    # Deliveries go to public addresses only, unless networks are listed here
    # (a comma list, e.g. "127.0.0.0/8": scripts/demo sets both for its run):
    # for inboxes, and apart for webhook destinations.
    "ALLOWED_NETWORKS": _list("FEDERATION_DELIVERY_ALLOWED_NETWORKS"),
    "WEBHOOK_ALLOWED_NETWORKS": _list("FEDERATION_DELIVERY_WEBHOOK_ALLOWED_NETWORKS"),
    # Webhook destinations, one WEBHOOK_<NAME> variable each (none by default),
    # e.g. WEBHOOK_OPS=slack://hooks.slack.com/services/… ; the URL is a secret.
    "WEBHOOKS": webhooks_from_env(env),
    # How long settled deliveries are kept before a purge deletes them
    # (run_deliverer --purge, purge_deliveries, or django-q2's purge task):
    # in days, delivered and skipped ones, and failed and refused ones.
    "RETENTION": {
        "DELIVERED": _days("FEDERATION_DELIVERY_RETENTION_DAYS", 7),
        "SKIPPED": _days("FEDERATION_DELIVERY_RETENTION_DAYS", 7),
        "FAILED": _days("FEDERATION_DELIVERY_RETENTION_FAILED_DAYS", 30),
        "REFUSED": _days("FEDERATION_DELIVERY_RETENTION_FAILED_DAYS", 30),
    },
}

# The waits between a webhook's tries, a comma list of seconds (scripts/demo
# sets short ones); unset, the package's nine tries across a day.
_webhook_retry = _list("FEDERATION_DELIVERY_WEBHOOK_RETRY")
if _webhook_retry:
    try:
        _waits = [float(wait) for wait in _webhook_retry]
    except ValueError:
        _waits = []
    # Each above 0 and at most 30 days, as the package takes them.
    if not _waits or not all(0 < wait <= 30 * 86400 for wait in _waits):
        raise ImproperlyConfigured(
            "FEDERATION_DELIVERY_WEBHOOK_RETRY must be a comma list of seconds, each above 0 "
            f"and at most 2592000 (30 days), such as 30,120,600, not "
            f"{','.join(_webhook_retry)!r}."
        )
    FEDERATION_DELIVERY["WEBHOOK_RETRY"] = _waits

# The package's warnings, and a signal receiver that raised (the package
# logs it on django.dispatch), on the console whatever DEBUG says: Django's
# own defaults send django.dispatch's errors to ADMINS alone with DEBUG off.
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "loggers": {
        "django_federation_delivery": {"handlers": ["console"], "level": "WARNING"},
        "django.dispatch": {"handlers": ["console"], "level": "ERROR", "propagate": False},
    },
}

# runserver puts the whole environment in each request's META, which the
# DEBUG page and the mail a 500 sends to ADMINS list: DATABASE_URL and the
# WEBHOOK_<NAME> variables are credentials, hidden there as Django hides
# its own (exampleproject/reports.py).
DEFAULT_EXCEPTION_REPORTER_FILTER = "exampleproject.reports.EnvironmentHidingFilter"
