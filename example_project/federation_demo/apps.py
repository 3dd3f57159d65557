from __future__ import annotations

from typing import Any

import django
from django.apps import AppConfig
from django.db.backends.signals import connection_created


def _sqlite_wal(sender: Any, connection: Any, **kwargs: Any) -> None:
    """Django < 5.1 has no SQLite ``init_command``: set WAL when a connection
    opens, so the web process and run_deliverer do not lock each other out."""
    if connection.vendor == "sqlite":
        with connection.cursor() as cursor:
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute("PRAGMA synchronous=NORMAL")


class FederationDemoConfig(AppConfig):
    name = "federation_demo"
    verbose_name = "Federation delivery demo"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from django_federation_delivery.signals import delivery_failed, delivery_settled
        from federation_demo import remote_servers

        # Strong references and a dispatch_uid each: connected once, however
        # often ready() runs (as it may in tests).
        delivery_settled.connect(
            remote_servers.count_delivered, dispatch_uid="federation_demo_delivered"
        )
        delivery_failed.connect(remote_servers.count_failure, dispatch_uid="federation_demo_failed")
        if django.VERSION < (5, 1):
            connection_created.connect(_sqlite_wal, dispatch_uid="federation_demo_sqlite_wal")
