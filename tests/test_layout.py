"""The package's layout: a module does one thing, and past ~400 lines is split.

No database and no network: the package's source files, read as text and as
syntax trees (migrations left out: Django writes them).
"""

from __future__ import annotations

import ast
from pathlib import Path

import django_federation_delivery

PACKAGE = Path(django_federation_delivery.__file__).parent
MAX_MODULE_LINES = 400
MAX_CLASS_LINES = 250


def modules() -> list[Path]:
    return sorted(
        path
        for path in PACKAGE.rglob("*.py")
        if "migrations" not in path.relative_to(PACKAGE).parts
    )


def name_of(path: Path) -> str:
    return path.relative_to(PACKAGE).as_posix()


def module_lengths() -> dict[str, int]:
    return {name_of(path): len(path.read_text("utf-8").splitlines()) for path in modules()}


def parse(path: Path) -> ast.Module:
    """``path`` parsed. Python 3.11 before 3.11.8 shares the AST builder's
    recursion count between threads (CPython gh-106905): another thread using
    the ast module meanwhile (printing a traceback, say: 3.11 parses its lines
    to place the carets) can fail a parse here with a spurious SystemError.
    Tried again, then raised."""
    source = path.read_text("utf-8")
    for _ in range(4):
        try:
            return ast.parse(source, filename=str(path))
        except SystemError as exc:
            if "recursion depth mismatch" not in str(exc):
                raise
    return ast.parse(source, filename=str(path))


def class_lengths() -> dict[str, int]:
    lengths = {}
    for path in modules():
        tree = parse(path)
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                # From its decorators, if any, to its last line.
                first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                last = node.end_lineno or node.lineno
                lengths[f"{name_of(path)}::{node.name}"] = last - first + 1
    return lengths


def test_the_walk_finds_the_packages_modules_and_classes_but_no_migration() -> None:
    lengths = module_lengths()
    assert {"__init__.py", "store/claims.py", "transport/__init__.py"} <= set(lengths)
    assert not [name for name in lengths if name.startswith("migrations/")]
    assert "store/settlements.py::Settlement" in class_lengths()


def test_no_module_is_over_400_lines() -> None:
    too_long = {name: lines for name, lines in module_lengths().items() if lines > MAX_MODULE_LINES}
    assert not too_long, f"over {MAX_MODULE_LINES} lines, to be split by concern: {too_long}"


def test_no_class_is_over_250_lines() -> None:
    too_long = {name: lines for name, lines in class_lengths().items() if lines > MAX_CLASS_LINES}
    assert not too_long, f"over {MAX_CLASS_LINES} lines, to be split: {too_long}"
