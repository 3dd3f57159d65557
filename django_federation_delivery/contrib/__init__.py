"""Integrations with other packages, each optional: they sit on top of the
app and call the same API a host project would."""

from __future__ import annotations


def told(message: str) -> str:
    """``message`` (marked with ``gettext_noop``) in the active language once
    Django's apps are ready; as written before that: a module a project
    imports while its apps load (a ``models.py`` guarding the import)
    cannot translate, which raises ``AppRegistryNotReady`` in place of the
    ``ImportError`` that says what is needed."""
    from django.apps import apps
    from django.utils.translation import gettext

    return gettext(message) if apps.ready else message
