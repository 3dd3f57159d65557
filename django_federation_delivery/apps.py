from __future__ import annotations

from django.apps import AppConfig
from django.utils.translation import gettext_lazy as _


class FederationDeliveryConfig(AppConfig):
    name = "django_federation_delivery"
    label = "federation_delivery"
    verbose_name = _("Federation delivery")
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from django_federation_delivery import checks  # noqa: F401  (registers them)
