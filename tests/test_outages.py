"""The loop's way to the database: outages said once, and their end only once seen."""

from __future__ import annotations

import logging
import threading
import time

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
    stopping.set()  # each wait between tries slept, by a sleep that returns at once
    logger = logging.getLogger("tests.outages")
    database = Database("default", stopping, logger=logger, sleep=lambda seconds: None)
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


def test_stopping_each_wait_is_waited_whole_but_none_past_its_bound() -> None:
    # A stop that has come cut every wait to nothing: the loop, writing what
    # it held before it stopped, tried again flat out for the whole lease.
    stopping = threading.Event()
    stopping.set()
    slept: list[float] = []
    database = Database(
        "default", stopping, logger=logging.getLogger("tests.outages"), sleep=slept.append
    )
    assert database(refused) is None
    assert database(refused) is None
    assert len(slept) == 2 and all(0.2 <= seconds <= 0.3 for seconds in slept), slept
    database.end_waits_by(time.monotonic() + 0.1)
    assert database(refused) is None
    assert 0 < slept[-1] <= 0.1
    database.end_waits_by(time.monotonic())
    assert database(refused) is None
    assert len(slept) == 3, "none once its bound has passed: the query is tried once"
    database.end_waits_by(None)
    assert database(refused) is None
    assert len(slept) == 4 and slept[-1] >= 0.2
