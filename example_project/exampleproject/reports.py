"""What Django's error reports (the DEBUG page, the mail a 500 sends to
``ADMINS``) leave out."""

from __future__ import annotations

import re

from django.views.debug import SafeExceptionReporterFilter


class EnvironmentHidingFilter(SafeExceptionReporterFilter):
    """Django's filter, hiding also the variables this project reads
    credentials from: ``DATABASE_URL`` (its password) and ``WEBHOOK_<NAME>``
    (a webhook URL is a secret), which ``runserver`` copies, with the rest
    of the environment, into each request's ``META``."""

    hidden_settings = re.compile(
        "API|AUTH|TOKEN|KEY|SECRET|PASS|SIGNATURE|HTTP_COOKIE|DATABASE_URL|WEBHOOK",
        flags=re.IGNORECASE,
    )
