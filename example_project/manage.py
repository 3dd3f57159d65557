#!/usr/bin/env python
"""The example project's manage.py: run it from anywhere, e.g. from the repo root as
``python example_project/manage.py demo``."""

from __future__ import annotations

import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> None:
    # The example project's own packages, and the repo root so that the
    # package in this checkout is used even when it is not installed.
    for path in (HERE.parent, HERE):
        if str(path) not in sys.path:
            sys.path.insert(0, str(path))
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "exampleproject.settings")
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)


if __name__ == "__main__":
    main()
