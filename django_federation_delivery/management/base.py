"""What the package's commands share: translated help, and arguments refused by name."""

from __future__ import annotations

import ipaddress
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.utils.translation import gettext as _


class TranslatedCommand(BaseCommand):
    """A command whose ``help`` is shown in the active language.

    ``help`` is a class attribute, read before any language is active, and
    argparse wants text, not a lazy string: so it is marked with
    ``gettext_noop`` and translated here, when the parser is made.
    """

    def create_parser(self, prog_name: str, subcommand: str, **kwargs: Any) -> CommandParser:
        parser = super().create_parser(prog_name, subcommand, **kwargs)
        parser.description = self.translated_help() if self.help else None
        return parser

    def translated_help(self) -> str:
        """``help`` in the active language (with its values, if it has any)."""
        return _(self.help)


def positive(value: str, most: int = 10**9) -> int:
    """``value`` as a whole number from 1 to ``most``; a CommandError naming anything else."""
    try:
        number = int(value)
    except ValueError:
        number = 0
    if not 1 <= number <= most:
        raise CommandError(
            _("expected a whole number from 1 to %(most)d, not %(value)r")
            % {"most": most, "value": value}
        )
    return number


def ip_address(value: str) -> str:
    """``value`` as an IP address (``[::1]`` too); a CommandError naming anything else."""
    try:
        return str(ipaddress.ip_address(value.strip().strip("[]")))
    except ValueError:
        raise CommandError(
            _("expected an IP address to serve metrics on, such as 127.0.0.1, not %(value)r")
            % {"value": value}
        ) from None
