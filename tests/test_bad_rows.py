"""Rows the loop cannot send as they are stored (changed by hand, behind the
package's back): each fails alone, saying why, and the loop goes on with the
rows claimed beside it."""

from __future__ import annotations

import base64
import logging
from collections.abc import Callable
from typing import Any
from unittest import mock

import pytest
from django.db import connection

from django_federation_delivery import send, send_webhook, signals
from django_federation_delivery.deliverer import Deliverer
from django_federation_delivery.kinds import unknown_kind
from django_federation_delivery.models import Batch, Delivery, Status
from django_federation_delivery.webhooks.deliveries import WebhookDeliveries

from .conftest import Inbox, RunningDeliverer, wait_until
from .keys import ALICE

pytestmark = pytest.mark.django_db(transaction=True)

NOTE = {"@context": "https://www.w3.org/ns/activitystreams", "type": "Create", "actor": ALICE}
BAD_GATEWAYS = "its stored gateways (via) are not a list of URLs"
SECRET = "whsec_" + base64.b64encode(b"k" * 32).decode()


def row(batch: Batch) -> Delivery:
    return Delivery.objects.get(batch=batch)


def settled(*batches: Batch) -> Callable[[], bool]:
    return lambda: not Delivery.objects.filter(batch__in=batches, status=Status.PENDING).exists()


def rows() -> list[tuple[str, str, int, str]]:
    return list(
        Delivery.objects.order_by("id").values_list("inbox", "status", "attempts", "last_error")
    )


def still_running(runner: RunningDeliverer) -> None:
    """The loop kept running: stopped now, it raises nothing."""
    assert runner.thread.is_alive(), f"the loop stopped: {runner.error!r}"
    runner.stop()


@pytest.mark.parametrize("via", [5, {"a": 1}], ids=["a number", "an object"])
def test_a_row_whose_stored_gateways_are_not_a_list_fails_alone_and_the_loop_goes_on(
    inbox: Inbox,
    start_deliverer: Callable[..., RunningDeliverer],
    failures: list[signals.Failure],
    caplog: pytest.LogCaptureFixture,
    via: Any,
) -> None:
    bad = send(ALICE, NOTE, [inbox.url("/bad?token=s3cretT0ken")])
    good = send(ALICE, NOTE, [inbox.url("/good")])
    Delivery.objects.filter(batch=bad).update(via=via)

    with caplog.at_level(logging.WARNING, logger="django_federation_delivery.deliverer"):
        runner = start_deliverer()
        wait_until(settled(bad, good), timeout=10, state=lambda: (rows(), runner.error))
        still_running(runner)

    failed = row(bad)
    assert (failed.status, failed.attempts, failed.last_error) == (Status.FAILED, 0, BAD_GATEWAYS)
    assert row(good).status == Status.DELIVERED
    assert inbox.paths() == ["/good"], "nothing sent to an object's keys as gateways"
    assert [(f.delivery_id, f.error) for f in failures] == [(failed.id, BAD_GATEWAYS)]
    lines = [r.getMessage() for r in caplog.records if str(failed.id) in r.getMessage()]
    assert lines == [f"Delivery {failed.id} cannot be sent and is failed: {BAD_GATEWAYS}"]
    assert not any("s3cretT0ken" in r.getMessage() for r in caplog.records)


def test_a_row_of_a_kind_no_deliverer_sends_fails_alone_once_and_the_loop_goes_on(
    inbox: Inbox,
    start_deliverer: Callable[..., RunningDeliverer],
    failures: list[signals.Failure],
    caplog: pytest.LogCaptureFixture,
) -> None:
    bad = send(ALICE, NOTE, [inbox.url("/bad")])
    good = send(ALICE, NOTE, [inbox.url("/good")])
    # The column has choices, not a constraint: a value written by hand.
    Delivery.objects.filter(batch=bad).update(kind="bo\x1bgus")

    with caplog.at_level(logging.WARNING, logger="django_federation_delivery.deliverer"):
        runner = start_deliverer()
        wait_until(settled(bad, good), timeout=10, state=lambda: (rows(), runner.error))
        still_running(runner)

    failed = row(bad)
    said = "its kind 'bo\\x1bgus' is not one this deliverer sends"
    assert (failed.status, failed.attempts, failed.last_error) == (Status.FAILED, 0, said)
    assert row(good).status == Status.DELIVERED
    assert inbox.paths() == ["/good"]
    assert [(f.delivery_id, f.error) for f in failures] == [(failed.id, said)]
    warned = [r for r in caplog.records if said in r.getMessage()]
    assert len(warned) == 1, "one warning for the row, not one each lease"
    assert "\x1b" not in warned[0].getMessage()


def test_an_unknown_kind_is_named_quoted_and_cut() -> None:
    said = unknown_kind("x" * 10_000)
    assert said.startswith("its kind 'xxx") and len(said) < 200


def test_skip_if_with_a_body_that_is_not_json_sends_it_as_stored_and_the_loop_goes_on(
    inbox: Inbox,
    start_deliverer: Callable[..., RunningDeliverer],
    settings: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    asked: list[str] = []

    def skip_if(target: str, activity: Any) -> bool:
        asked.append(target)
        return target.endswith("/skip")

    settings.FEDERATION_DELIVERY = {**settings.FEDERATION_DELIVERY, "SKIP_IF": skip_if}
    bad = send(ALICE, NOTE, [inbox.url("/bad")])
    good = send(ALICE, NOTE, [inbox.url("/good"), inbox.url("/skip")])
    Batch.objects.filter(id=bad.id).update(body="{not json")

    with caplog.at_level(logging.WARNING, logger="django_federation_delivery.deliverer"):
        runner = start_deliverer()
        wait_until(settled(bad, good), timeout=10, state=lambda: (rows(), runner.error))
        still_running(runner)

    # Not dropped on a guess: sent as it was stored, for the inbox to judge.
    assert row(bad).status == Status.DELIVERED
    assert [r.body for r in inbox.received if r.path == "/bad"] == [b"{not json"]
    statuses = dict(Delivery.objects.filter(batch=good).values_list("inbox", "status"))
    assert statuses == {inbox.url("/good"): Status.DELIVERED, inbox.url("/skip"): Status.SKIPPED}
    assert sorted(asked) == sorted([inbox.url("/good"), inbox.url("/skip")])
    warned = [r.getMessage() for r in caplog.records if f"batch {bad.id} " in r.getMessage()]
    assert len(warned) == 1 and "not json" not in warned[0]


@pytest.mark.parametrize(
    ("column", "value", "outcome"),
    [
        # The batch's: sent as its bytes.
        ("body", b'{"type": "Note"}', Status.DELIVERED),
        ("inbox", b"http://127.0.0.1/bad", Status.REFUSED),
        ("host", b"127.0.0.1", Status.DELIVERED),
        ("kind", b"activitypub", Status.FAILED),
        ("destination", b"ops", Status.DELIVERED),
        ("via", b"[]", Status.FAILED),
    ],
    ids=["body", "inbox", "host", "kind", "destination", "via"],
)
def test_on_sqlite_a_column_stored_as_a_blob_settles_its_row_alone_and_the_loop_goes_on(
    inbox: Inbox,
    start_deliverer: Callable[..., RunningDeliverer],
    column: str,
    value: bytes,
    outcome: Status,
) -> None:
    if connection.vendor != "sqlite":
        pytest.skip("only SQLite keeps a BLOB in a text column")
    bad = send(ALICE, NOTE, [inbox.url("/bad")])
    good = send(ALICE, NOTE, [inbox.url("/good")])
    # SQLite's JSON functions refuse a BLOB: the claim read its rows and
    # their batches with them, and was dropped as if the database were away,
    # every claim.
    table, key = (Batch, "id") if column == "body" else (Delivery, "batch_id")
    with connection.cursor() as cursor:
        cursor.execute(
            f"UPDATE {table._meta.db_table} SET {column} = %s WHERE {key} = %s", [value, bad.id]
        )

    runner = start_deliverer()
    wait_until(settled(bad, good), timeout=10, state=lambda: (rows(), runner.error))
    still_running(runner)

    # Read as none: a column the loop only goes by (its host, a destination
    # on an inbox's row) leaves the row sent; one it sends by settles it unsent.
    assert row(bad).status == outcome
    assert row(good).status == Status.DELIVERED
    expected = ["/bad", "/good"] if outcome == Status.DELIVERED else ["/good"]
    assert sorted(inbox.paths()) == expected


def deep_event(depth: int) -> str:
    """A stored event whose data is 0 in ``depth`` lists, as no send writes it."""
    data = "[" * depth + "0" + "]" * depth
    return (
        '{"type":"alert.raised","id":"e1","timestamp":"2025-01-01T00:00:00Z","data":{"d":'
        + data
        + "}}"
    )


def signed_hook_to(inbox: Inbox, settings: Any) -> None:
    """Webhook destination ``ops``: a signed JSON endpoint at ``inbox``."""
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "WEBHOOKS": {"ops": f"http://127.0.0.1:{inbox.port}/hook?secret={SECRET}"},
        "WEBHOOK_ALLOWED_NETWORKS": ["127.0.0.0/8"],
    }


@pytest.mark.parametrize("depth", [960, 100_000], ids=["past the loop's stack", "past any"])
def test_a_stored_event_nested_too_deeply_fails_alone_and_the_loop_goes_on(
    inbox: Inbox, settings: Any, failures: list[signals.Failure], depth: int
) -> None:
    signed_hook_to(inbox, settings)
    bad = send_webhook("ops", "alert.raised", {"d": 0})
    assert bad is not None
    good = send(ALICE, NOTE, [inbox.url("/good")])
    # Read one level deeper than it was written, by a loop already deep in
    # its stack: a RecursionError nothing caught stopped the loop each start.
    Batch.objects.filter(id=bad.id).update(body=deep_event(depth))

    Deliverer().run(drain=True, stop_after=10)

    failed = row(bad)
    said = f"the stored event of batch {bad.id} cannot be read"
    assert (failed.status, failed.attempts, failed.last_error) == (Status.REFUSED, 1, said)
    assert row(good).status == Status.DELIVERED
    assert inbox.paths() == ["/good"]


def test_a_job_that_cannot_be_made_fails_its_row_alone_naming_only_the_error_type(
    inbox: Inbox,
    settings: Any,
    failures: list[signals.Failure],
    caplog: pytest.LogCaptureFixture,
) -> None:
    signed_hook_to(inbox, settings)
    bad = send_webhook("ops", "alert.raised", {"n": 1})
    assert bad is not None
    good = send(ALICE, NOTE, [inbox.url("/good")])

    def broken(self: Any, batch: Any) -> Any:
        raise RuntimeError(f"cannot reach http://127.0.0.1:{inbox.port}/hook?secret={SECRET}")

    with (
        mock.patch.object(WebhookDeliveries, "_event", broken),
        caplog.at_level(logging.WARNING, logger="django_federation_delivery.deliverer"),
    ):
        Deliverer().run(drain=True, stop_after=10)

    failed = row(bad)
    said = "its job could not be made: RuntimeError"
    assert (failed.status, failed.attempts, failed.last_error) == (Status.FAILED, 0, said)
    assert row(good).status == Status.DELIVERED
    assert inbox.paths() == ["/good"]
    assert [(f.delivery_id, f.error) for f in failures] == [(failed.id, said)]
    shown = " ".join(r.getMessage() for r in caplog.records)
    assert said in shown and SECRET[6:] not in shown and "/hook" not in shown
