"""The supervisor of ``run_deliverer --processes``: how it names a child's end.

Its children, stops, restarts and giving up are tested end to end, as an
operator runs them, in ``test_run_deliverer.py``.
"""

from __future__ import annotations

import signal

import pytest

from django_federation_delivery.supervisor import describe_exit


@pytest.mark.parametrize(
    ("code", "said"),
    [
        (0, "exited with status 0"),
        (1, "exited with status 1"),
        (-signal.SIGKILL, "was killed by SIGKILL"),
        (-signal.SIGSEGV, "was killed by SIGSEGV"),
        (-200, "was killed by signal 200"),
        (None, "is still running"),
    ],
)
def test_a_childs_end_is_said_as_an_operator_reads_it(code: int | None, said: str) -> None:
    assert describe_exit(code) == said
