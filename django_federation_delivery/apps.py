from __future__ import annotations

from django.apps import AppConfig


class FederationDeliveryConfig(AppConfig):
    name = "django_federation_delivery"
    label = "federation_delivery"
    verbose_name = "Federation delivery"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from django_federation_delivery import checks  # noqa: F401  (registers them)
