"""WSGI entry point: ``gunicorn --chdir example_project exampleproject.wsgi``."""

from __future__ import annotations

import os

from django.core.wsgi import get_wsgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "exampleproject.settings")

application = get_wsgi_application()
