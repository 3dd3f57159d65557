"""What the package's commands share: translated help, arguments refused by
name, and a database that can hold the queue."""

from __future__ import annotations

import contextlib
import ipaddress
import os
import sys
from collections.abc import Callable
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser, OutputWrapper
from django.db import DatabaseError, connections
from django.utils.translation import gettext as _

from django_federation_delivery.addresses import escaped, quoted
from django_federation_delivery.checks import lacking_migrations
from django_federation_delivery.conf import database_alias
from django_federation_delivery.exceptions import InvalidDelivery


class TranslatedCommand(BaseCommand):
    """A command whose ``help`` is shown in the active language.

    ``help`` is a class attribute, read before any language is active, and
    argparse wants text, not a lazy string: so it is marked with
    ``gettext_noop`` and translated here, when the parser is made.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # Started with no stdout or stderr (">&-", a service manager's), or a
        # deliverer process of such a one, Python has none, and each write
        # raised: the null device in their place.
        for name in ("stdout", "stderr"):
            if getattr(sys, name) is None:
                setattr(sys, name, open(os.devnull, "w"))  # noqa: SIM115 (kept open)
        super().__init__(*args, **kwargs)
        # OutputWrapper keeps the stream it writes to as _out.
        self.stdout = _Output(self.stdout._out)  # type: ignore[arg-type]
        stderr, self.stderr = self.stderr, _Output(self.stderr._out)  # type: ignore[arg-type]
        self.stderr.style_func = stderr.style_func

    def execute(self, *args: Any, **options: Any) -> str | None:
        # A stream given (call_command(stdout=...)) as Django would wrap it,
        # a broken pipe to it taken as the reader gone too.
        for name in ("stdout", "stderr"):
            if given := options.pop(name, None):
                setattr(self, name, _Output(given))
        try:
            return super().execute(*args, **options)
        finally:
            # What is left in the buffer, written now rather than as Python
            # exits, where a reader gone would fail it ("Exception ignored").
            self.stdout.flush()

    def create_parser(self, prog_name: str, subcommand: str, **kwargs: Any) -> CommandParser:
        parser = super().create_parser(prog_name, subcommand, **kwargs)
        parser.description = self.translated_help() if self.help else None
        return parser

    def translated_help(self) -> str:
        """``help`` in the active language (with its values, if it has any)."""
        return _(self.help)

    def waits_for_the_database(self) -> bool:
        """Whether a database the system checks cannot reach is the
        command's to wait out (``run_deliverer``), or to report (a probe),
        rather than refused in one line."""
        return False

    def check(self, *args: Any, **kwargs: Any) -> None:
        # Since Django 6.1 the model checks ask each database (whether it
        # has JSON): one that cannot be reached raised from deep inside them.
        try:
            super().check(*args, **kwargs)
        except DatabaseError as exc:
            if not self.waits_for_the_database():
                raise unreachable(database_alias(), exc) from None


class _Output(OutputWrapper):
    """A command's stdout or stderr whose reader may go away (``| head``):
    it has read what it wanted, and the rest goes nowhere, rather than fail
    the command. A broken pipe anywhere else is no business of this."""

    def write(  # type: ignore[override]
        self,
        msg: str = "",
        style_func: Callable[[str], str] | None = None,
        ending: str | None = None,
    ) -> None:
        try:
            super().write(msg, style_func, ending)
        except BrokenPipeError:
            sent_nowhere(self._out)

    def flush(self) -> None:
        try:
            super().flush()
        except BrokenPipeError:
            sent_nowhere(self._out)


def sent_nowhere(stream: Any) -> None:
    """Point ``stream``'s file, whose reader went away (``| head``, a
    ``tee`` ended by the same Ctrl-C), at the null device: what its buffer
    holds, and all said after, goes nowhere rather than fail again as
    Python flushes it on the way out ("Exception ignored", status 120)."""
    with contextlib.suppress(Exception):
        nowhere = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(nowhere, stream.fileno())
        finally:
            os.close(nowhere)


def whole(value: str | int, least: int, most: int, message: str) -> int:
    """``value`` as a whole number from ``least`` to ``most``; a CommandError
    with ``message`` (which says ``%(value)s``, and may say ``%(least)d`` and
    ``%(most)d``) naming anything else, a long value cut. An int is taken as
    its digits are: ``call_command`` passes its keyword options as given."""
    if isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    try:
        # Past 20 digits, past any bound here: not worth converting.
        number = int(value) if isinstance(value, str) and len(value) <= 20 else least - 1
    except ValueError:
        number = least - 1
    if not least <= number <= most:
        raise CommandError(message % {"value": quoted(value), "least": least, "most": most})
    return number


def positive(value: str, most: int = 10**9) -> int:
    """``value`` as a whole number from 1 to ``most``; a CommandError naming anything else."""
    return whole(
        value, 1, most, _("expected a whole number from %(least)d to %(most)d, not %(value)s")
    )


def ip_address(value: str) -> str:
    """``value`` as an IP address (``[::1]`` too); a CommandError naming anything else."""
    try:
        if not isinstance(value, str):  # call_command's keyword options are as given
            raise ValueError(value)
        return str(ipaddress.ip_address(value.strip().strip("[]")))
    except ValueError:
        raise CommandError(
            _("expected an IP address to serve metrics on, such as 127.0.0.1, not %(value)s")
            % {"value": quoted(value)}
        ) from None


def add_database_option(parser: CommandParser) -> None:
    """``--database ALIAS``: the queue's database; by default the app's, as
    :func:`database_named` finds it."""
    parser.add_argument(
        "--database",
        help=_(
            "The database alias the queue lives in (by default the one "
            "DATABASE_ROUTERS put the app in: 'default' unless they say otherwise)."
        ),
    )


def database_named(using: str | None) -> str:
    """``using``, a database alias in ``DATABASES``, or None for the app's
    (the one the routers write its deliveries to, ``"default"`` unless they
    say otherwise); a CommandError naming any other."""
    try:
        return database_alias(using)
    except InvalidDelivery:
        raise CommandError(
            # Quoted as the public API quotes it: a database URL given in
            # its place keeps its password out of the message.
            _("no database named %(alias)s in DATABASES") % {"alias": quoted(using)}
        ) from None


def require_database(using: str) -> None:
    """For a command that reads or writes the queue once: a CommandError
    saying the database ``using`` cannot be reached (the first line of its
    error, escaped), or lacks a migration (:func:`require_migrations`).
    ``run_deliverer`` waits an outage out instead."""
    try:
        connections[using].ensure_connection()
    except DatabaseError as exc:
        raise unreachable(using, exc) from None
    require_migrations(using)


def unreachable(using: str, exc: DatabaseError) -> CommandError:
    """The error of a command whose database ``using`` cannot be reached:
    the first line of what it met, escaped."""
    text = str(exc).strip()
    error = escaped(text.splitlines()[0])[:200] if text else type(exc).__name__
    return CommandError(
        _("The database %(alias)s cannot be reached (%(error)s).")
        % {"alias": quoted(using), "error": error}
    )


def require_migrations(using: str) -> None:
    """A CommandError naming the package's migrations the database lacks,
    if it lacks any: every statement on its tables would fail."""
    lacking = lacking_migrations(using)
    if lacking:
        raise CommandError(lacking)
