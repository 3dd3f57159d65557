"""The loop's way to the database: outages said once, and their end only once seen."""

from __future__ import annotations

import logging
import threading

import pytest
from django.db import OperationalError, connection

from django_federation_delivery.outages import Database

pytestmark = pytest.mark.django_db(transaction=True)


def select_one() -> int:
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1")
        return int(cursor.fetchone()[0])


def refused() -> None:
    raise OperationalError("terminating connection due to administrator command")


def test_an_outage_ends_with_a_statement_that_ran_not_with_a_call_that_needed_none(
    caplog: pytest.LogCaptureFixture,
) -> None:
    stopping = threading.Event()
    stopping.set()  # no waiting between tries
    logger = logging.getLogger("tests.outages")
    database = Database("default", stopping, logger=logger)
    with caplog.at_level(logging.WARNING, logger="tests.outages"):
        assert database(refused) is None
        assert database.failing
        # Nothing reached the database: that says nothing of whether it is back.
        assert database(lambda: "nothing to write") == "nothing to write"
        assert database.failing
        assert database(refused) is None
        said = [record.getMessage() for record in caplog.records]
        assert said == [
            "The database is unavailable (terminating connection due to administrator "
            "command); waiting it out"
        ]
        assert database(select_one) == 1
        assert not database.failing
        assert database(lambda: "nothing") == "nothing"
    said = [record.getMessage() for record in caplog.records]
    assert said[1:] == ["The database is back"]
