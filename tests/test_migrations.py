"""The migrations: what they do to rows queued before them."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from django.db import connection
from django.db.migrations.executor import MigrationExecutor

from django_federation_delivery.store import sequence_of

APP = "federation_delivery"


@pytest.fixture
def before_kinds() -> Iterator[MigrationExecutor]:
    """The database as 0001 left it; migrated to the last one again after."""
    executor = MigrationExecutor(connection)
    executor.migrate([(APP, "0001_initial")])
    executor.loader.build_graph()
    yield executor
    executor = MigrationExecutor(connection)
    executor.migrate(executor.loader.graph.leaf_nodes(APP))


@pytest.mark.django_db(transaction=True)
def test_a_webhook_delivery_queued_before_gets_its_kind_destination_and_inbox(
    before_kinds: MigrationExecutor,
) -> None:
    apps = before_kinds.loader.project_state([(APP, "0001_initial")]).apps
    Batch = apps.get_model(APP, "Batch")
    Delivery = apps.get_model(APP, "Delivery")
    event = Batch.objects.create(sender="", body="{}", body_sha256="", event_type="alert")
    note = Batch.objects.create(sender="https://a.example/u", body="{}", body_sha256="")
    old_sequence = sequence_of("webhook", "webhook:ops")
    Delivery.objects.create(
        batch=event, inbox="webhook:ops", host="webhook:ops", sequence=old_sequence
    )
    Delivery.objects.create(batch=event, inbox="webhook:on-call", host="webhook:on-call")
    Delivery.objects.create(batch=note, inbox="https://b.example/inbox", host="b.example")

    before_kinds.loader.build_graph()
    before_kinds.migrate([(APP, "0002_delivery_kind_destination")])

    apps = before_kinds.loader.project_state([(APP, "0002_delivery_kind_destination")]).apps
    rows = apps.get_model(APP, "Delivery").objects.order_by("id")
    assert list(rows.values_list("kind", "destination", "inbox", "host")) == [
        ("webhook", "ops", "ops", "webhook:ops"),
        ("webhook", "on-call", "on-call", "webhook:on-call"),
        ("activitypub", "", "https://b.example/inbox", "b.example"),
    ]
    # The next event to "ops" waits on this one: the sequence a send now writes.
    assert list(rows.values_list("sequence", flat=True)) == [
        sequence_of("webhook", "ops"),
        "",
        "",
    ]


@pytest.mark.django_db(transaction=True)
def test_webhook_events_queued_before_move_to_the_webhook_lane(
    before_kinds: MigrationExecutor,
) -> None:
    before_kinds.migrate([(APP, "0002_delivery_kind_destination")])
    before_kinds.loader.build_graph()
    apps = before_kinds.loader.project_state([(APP, "0002_delivery_kind_destination")]).apps
    Batch = apps.get_model(APP, "Batch")
    Delivery = apps.get_model(APP, "Delivery")
    event = Batch.objects.create(
        sender="", body="{}", body_sha256="", event_type="alert", lane="normal"
    )
    note = Batch.objects.create(sender="https://a.example/u", body="{}", body_sha256="")
    Delivery.objects.create(
        batch=event, inbox="ops", host="webhook:ops", kind="webhook", destination="ops"
    )
    Delivery.objects.create(batch=note, inbox="https://b.example/inbox", host="b.example")

    before_kinds.migrate([(APP, "0003_webhook_lane")])

    apps = before_kinds.loader.project_state([(APP, "0003_webhook_lane")]).apps
    deliveries = apps.get_model(APP, "Delivery").objects.order_by("id")
    assert list(deliveries.values_list("kind", "lane")) == [
        ("webhook", "webhook"),
        ("activitypub", "normal"),
    ]
    batches = apps.get_model(APP, "Batch").objects.order_by("id")
    assert list(batches.values_list("lane", flat=True)) == ["webhook", "normal"]
