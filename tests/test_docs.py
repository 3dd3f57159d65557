"""The README's reference says what each management command takes."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest
from django.core.management import BaseCommand, get_commands, load_command_class

README = Path(__file__).resolve().parent.parent / "README.rst"
APP = "django_federation_delivery"


def section(title: str) -> str:
    text = README.read_text(encoding="utf-8")
    start = text.index(f"\n{title}\n{'=' * len(title)}\n")
    following = re.search(r"\n[^\n]+\n=+\n", text[start + len(title) + 2 :])
    assert following is not None
    return text[start : start + len(title) + 2 + following.start()]


def package_commands() -> list[str]:
    return sorted(name for name, app in get_commands().items() if app == APP)


def options(name: str) -> set[str]:
    parser = load_command_class(APP, name).create_parser("manage.py", name)
    # Django's own (--verbosity, --settings, …) are its documentation's.
    django_own = set(BaseCommand().create_parser("manage.py", name)._option_string_actions)
    return {
        flag
        for action in parser._actions
        if not isinstance(action, argparse._HelpAction)
        for flag in action.option_strings
        if flag.startswith("--") and flag not in django_own
    }


def test_the_package_has_the_commands_the_reference_lists() -> None:
    listed = set(re.findall(r"^``([a-z_]+)(?: [A-Z]+)?``$", section("Management commands"), re.M))
    assert listed == set(package_commands())


@pytest.mark.parametrize("name", package_commands())
def test_the_reference_names_every_option_of(name: str) -> None:
    reference = section("Management commands")
    entry = re.search(rf"^``{name}(?: [A-Z]+)?``\n((?:    .*\n)+)", reference, re.M)
    assert entry is not None, name
    named = set(re.findall(r"``(--[a-z-]+)", entry.group(1)))
    assert named == options(name)


ARCHITECTURE = README.parent / "docs" / "architecture.md"
PACKAGE = README.parent / APP


@pytest.mark.parametrize(
    "module",
    sorted(
        path.name
        for path in PACKAGE.iterdir()
        if (path.suffix == ".py" and path.name != "__init__.py")
        or (path.is_dir() and (path / "__init__.py").exists() and path.name != "migrations")
    ),
)
def test_the_architecture_map_places_every_module(module: str) -> None:
    # A module the map does not name is one a newcomer cannot find from it.
    # By its own name: "hosts.py" is not named by "store/hosts.py".
    named = re.escape(module if module.endswith(".py") else f"{module}/")
    assert re.search(rf"(?<![\w/.]){named}", ARCHITECTURE.read_text(encoding="utf-8"))


def test_the_testing_sections_pytest_example_runs_as_a_module_when_pasted() -> None:
    # Pasted into a fresh test module, the example is imported as it stands:
    # each name its decorators and defaults use must be imported by it.
    text = section("Testing your project")
    block = text[text.index("passes or fails whatever ran before it::") :]
    code = []
    for line in block.splitlines()[2:]:
        if line and not line.startswith("    "):
            break
        code.append(line[4:])
    namespace: dict[str, object] = {"__name__": "test_host_project"}
    exec(compile("\n".join(code), "test_host_project.py", "exec"), namespace)
    assert callable(namespace["test_posting_sends_a_signed_create"])
