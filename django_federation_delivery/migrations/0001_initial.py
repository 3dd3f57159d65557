"""The queue's tables, as the unreleased 0.x leaves them.

Indexes are named for what they serve (``fd_delivery_due``: the pending rows
a claim reads, in lane and due order). A delivery has few index entries, as
each row is written three times (queued, claimed, settled): its foreign keys
have no index of their own (``fd_delivery_once_per_inbox`` and
``fd_delivery_batch_status`` begin with the batch; ``after`` and
``(status, settled_at)`` are indexed only where they are set);
``fd_delivery_destination`` holds a webhook destination's pending events in
the order they were sent.

On PostgreSQL the batch table leaves half of each page free
(``fillfactor`` 50): a batch's row is updated as its deliveries settle, and
with room on its page the new version stays there (a HOT update) and leaves
the table's indexes alone. SQLite has no such setting.
"""

import django.db.models.deletion
import django.utils.timezone
from django.db import migrations, models

FILLFACTOR = 50


class SetFillfactor(migrations.operations.base.Operation):
    """A table's fillfactor on PostgreSQL (nothing elsewhere), written with
    the schema editor, so that ``sqlmigrate`` prints it as ``migrate`` runs
    it; reset when migrated back."""

    reversible = True
    reduces_to_sql = True

    def __init__(self, model_name, fillfactor):  # type: ignore[no-untyped-def]
        self.model_name = model_name
        self.fillfactor = fillfactor

    def deconstruct(self):  # type: ignore[no-untyped-def]
        return (
            self.__class__.__qualname__,
            [],
            {"model_name": self.model_name, "fillfactor": self.fillfactor},
        )

    def state_forwards(self, app_label, state):  # type: ignore[no-untyped-def]
        pass

    def _alter(self, app_label, schema_editor, state, storage):  # type: ignore[no-untyped-def]
        model = state.apps.get_model(app_label, self.model_name)
        alias = schema_editor.connection.alias
        if schema_editor.connection.vendor != "postgresql" or not self.allow_migrate_model(
            alias, model
        ):
            return
        table = schema_editor.quote_name(model._meta.db_table)
        schema_editor.execute(f"ALTER TABLE {table} {storage}")

    def database_forwards(self, app_label, schema_editor, from_state, to_state):  # type: ignore[no-untyped-def]
        self._alter(app_label, schema_editor, to_state, f"SET (fillfactor = {self.fillfactor})")

    def database_backwards(self, app_label, schema_editor, from_state, to_state):  # type: ignore[no-untyped-def]
        self._alter(app_label, schema_editor, from_state, "RESET (fillfactor)")

    def describe(self):  # type: ignore[no-untyped-def]
        return f"Set the fillfactor of {self.model_name} to {self.fillfactor} on PostgreSQL"


class Migration(migrations.Migration):
    initial = True

    dependencies = []

    operations = [
        migrations.CreateModel(
            name="Breaker",
            fields=[
                (
                    "key",
                    models.CharField(
                        max_length=2048, primary_key=True, serialize=False, verbose_name="key"
                    ),
                ),
                ("failures", models.PositiveIntegerField(default=0, verbose_name="failures")),
                (
                    "open_until",
                    models.DateTimeField(blank=True, null=True, verbose_name="open until"),
                ),
                (
                    "probe_token",
                    models.CharField(
                        blank=True, default="", max_length=32, verbose_name="probe token"
                    ),
                ),
                (
                    "probe_until",
                    models.DateTimeField(blank=True, null=True, verbose_name="probe until"),
                ),
                (
                    "updated_at",
                    models.DateTimeField(
                        default=django.utils.timezone.now, verbose_name="updated at"
                    ),
                ),
            ],
            options={
                "verbose_name": "breaker",
                "verbose_name_plural": "breakers",
            },
        ),
        migrations.CreateModel(
            name="DeliveryHistory",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("minute", models.DateTimeField(unique=True, verbose_name="minute")),
                ("delivered", models.PositiveIntegerField(default=0, verbose_name="delivered")),
                ("retried", models.PositiveIntegerField(default=0, verbose_name="retried")),
                ("refused", models.PositiveIntegerField(default=0, verbose_name="refused")),
                ("failed", models.PositiveIntegerField(default=0, verbose_name="failed")),
                (
                    "breakers_opened",
                    models.PositiveIntegerField(default=0, verbose_name="breakers opened"),
                ),
            ],
            options={
                "verbose_name": "delivery history",
                "verbose_name_plural": "delivery history",
            },
        ),
        migrations.CreateModel(
            name="Batch",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("sender", models.CharField(max_length=2048, verbose_name="sender")),
                ("body", models.TextField(verbose_name="body")),
                ("body_sha256", models.CharField(max_length=64, verbose_name="body sha256")),
                (
                    "tag",
                    models.CharField(blank=True, default="", max_length=200, verbose_name="tag"),
                ),
                ("deadline", models.DateTimeField(blank=True, null=True, verbose_name="deadline")),
                (
                    "max_attempts",
                    models.PositiveIntegerField(blank=True, null=True, verbose_name="max attempts"),
                ),
                (
                    "ordering_key",
                    models.CharField(
                        blank=True, default="", max_length=500, verbose_name="ordering key"
                    ),
                ),
                (
                    "lane",
                    models.CharField(
                        choices=[
                            ("webhook", "webhook"),
                            ("priority", "priority"),
                            ("normal", "normal"),
                            ("low", "low"),
                        ],
                        default="normal",
                        max_length=16,
                        verbose_name="lane",
                    ),
                ),
                (
                    "synchronize_collection",
                    models.BooleanField(default=False, verbose_name="synchronize collection"),
                ),
                (
                    "event_type",
                    models.CharField(
                        blank=True, default="", max_length=100, verbose_name="event type"
                    ),
                ),
                (
                    "event_id",
                    models.CharField(
                        blank=True, default="", max_length=200, verbose_name="event id"
                    ),
                ),
                (
                    "activity_id",
                    models.CharField(
                        blank=True, default="", max_length=2048, verbose_name="activity id"
                    ),
                ),
                (
                    "object_id",
                    models.CharField(
                        blank=True, default="", max_length=2048, verbose_name="object id"
                    ),
                ),
                (
                    "retracts",
                    models.CharField(
                        blank=True,
                        choices=[
                            ("", "nothing"),
                            ("object", "its object"),
                            ("activity", "an activity"),
                        ],
                        default="",
                        max_length=8,
                        verbose_name="retracts",
                    ),
                ),
                (
                    "idempotency_key",
                    models.CharField(
                        blank=True, default="", max_length=200, verbose_name="idempotency key"
                    ),
                ),
                (
                    "trace_context",
                    models.TextField(blank=True, default="", verbose_name="trace context"),
                ),
                (
                    "created_at",
                    models.DateTimeField(
                        default=django.utils.timezone.now, verbose_name="created at"
                    ),
                ),
                ("size", models.PositiveIntegerField(default=0, verbose_name="size")),
                ("remaining", models.PositiveIntegerField(default=0, verbose_name="remaining")),
                (
                    "finished_at",
                    models.DateTimeField(blank=True, null=True, verbose_name="finished at"),
                ),
            ],
            options={
                "verbose_name": "batch",
                "verbose_name_plural": "batches",
                "ordering": ["-created_at"],
                "indexes": [
                    models.Index(fields=["tag"], name="fd_batch_tag"),
                    models.Index(fields=["created_at"], name="fd_batch_created"),
                    models.Index(
                        condition=models.Q(("object_id__gt", "")),
                        fields=["object_id"],
                        name="fd_batch_object",
                    ),
                    models.Index(
                        condition=models.Q(("activity_id__gt", "")),
                        fields=["activity_id"],
                        name="fd_batch_activity",
                    ),
                    models.Index(
                        condition=models.Q(("deadline__isnull", False)),
                        fields=["deadline"],
                        name="fd_batch_deadline",
                    ),
                ],
                "constraints": [
                    models.UniqueConstraint(
                        condition=models.Q(("idempotency_key__gt", "")),
                        fields=("idempotency_key",),
                        name="fd_batch_idempotency_key",
                    )
                ],
            },
        ),
        migrations.CreateModel(
            name="DelivererHeartbeat",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("host", models.CharField(max_length=255, verbose_name="host")),
                ("pid", models.PositiveIntegerField(verbose_name="pid")),
                (
                    "version",
                    models.CharField(blank=True, default="", max_length=50, verbose_name="version"),
                ),
                ("started_at", models.DateTimeField(verbose_name="started at")),
                ("last_seen", models.DateTimeField(verbose_name="last seen")),
                ("interval", models.FloatField(verbose_name="interval")),
                ("in_flight", models.PositiveIntegerField(default=0, verbose_name="in flight")),
                ("rate", models.FloatField(default=0.0, verbose_name="rate")),
            ],
            options={
                "verbose_name": "deliverer heartbeat",
                "verbose_name_plural": "deliverer heartbeats",
                "indexes": [models.Index(fields=["last_seen"], name="fd_heartbeat_last_seen")],
            },
        ),
        migrations.CreateModel(
            name="Host",
            fields=[
                (
                    "name",
                    models.CharField(
                        max_length=255, primary_key=True, serialize=False, verbose_name="name"
                    ),
                ),
                (
                    "scheme",
                    models.CharField(blank=True, default="", max_length=16, verbose_name="scheme"),
                ),
                (
                    "paused_at",
                    models.DateTimeField(blank=True, null=True, verbose_name="paused at"),
                ),
                (
                    "disabled_reason",
                    models.CharField(
                        blank=True, default="", max_length=400, verbose_name="disabled because"
                    ),
                ),
                (
                    "failing_since",
                    models.DateTimeField(blank=True, null=True, verbose_name="failing since"),
                ),
                (
                    "failing_told_at",
                    models.DateTimeField(blank=True, null=True, verbose_name="told failing at"),
                ),
                (
                    "unavailable_since",
                    models.DateTimeField(blank=True, null=True, verbose_name="unavailable since"),
                ),
                (
                    "probed_at",
                    models.DateTimeField(blank=True, null=True, verbose_name="probed at"),
                ),
                (
                    "first_seen_at",
                    models.DateTimeField(blank=True, null=True, verbose_name="first seen"),
                ),
                (
                    "last_delivered_at",
                    models.DateTimeField(blank=True, null=True, verbose_name="last delivered"),
                ),
                ("last_error", models.TextField(blank=True, default="", verbose_name="last error")),
                (
                    "last_error_at",
                    models.DateTimeField(blank=True, null=True, verbose_name="last error at"),
                ),
                (
                    "answer_p50_ms",
                    models.FloatField(blank=True, null=True, verbose_name="answer time p50 (ms)"),
                ),
                (
                    "answer_p95_ms",
                    models.FloatField(blank=True, null=True, verbose_name="answer time p95 (ms)"),
                ),
                (
                    "concurrency_limit",
                    models.PositiveIntegerField(
                        blank=True, null=True, verbose_name="limit at once"
                    ),
                ),
                (
                    "resting_until",
                    models.DateTimeField(blank=True, null=True, verbose_name="resting until"),
                ),
                ("updated_at", models.DateTimeField(auto_now=True, verbose_name="updated at")),
            ],
            options={
                "verbose_name": "host",
                "verbose_name_plural": "hosts",
                "indexes": [
                    models.Index(
                        condition=models.Q(("failing_since__isnull", False)),
                        fields=["failing_since"],
                        name="fd_host_failing",
                    ),
                    models.Index(
                        condition=models.Q(("unavailable_since__isnull", False)),
                        fields=["unavailable_since"],
                        name="fd_host_unavailable",
                    ),
                ],
            },
        ),
        migrations.CreateModel(
            name="Delivery",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                (
                    "kind",
                    models.CharField(
                        choices=[("activitypub", "ActivityPub inbox"), ("webhook", "webhook")],
                        default="activitypub",
                        max_length=16,
                        verbose_name="kind",
                    ),
                ),
                (
                    "destination",
                    models.CharField(
                        blank=True, default="", max_length=64, verbose_name="destination"
                    ),
                ),
                ("inbox", models.CharField(max_length=2048, verbose_name="inbox")),
                ("host", models.CharField(max_length=255, verbose_name="host")),
                ("via", models.JSONField(blank=True, default=list, verbose_name="via")),
                (
                    "lane",
                    models.CharField(
                        choices=[
                            ("webhook", "webhook"),
                            ("priority", "priority"),
                            ("normal", "normal"),
                            ("low", "low"),
                        ],
                        default="normal",
                        max_length=16,
                        verbose_name="lane",
                    ),
                ),
                (
                    "status",
                    models.CharField(
                        choices=[
                            ("pending", "pending"),
                            ("delivered", "delivered"),
                            ("refused", "refused"),
                            ("skipped", "skipped"),
                            ("failed", "failed"),
                            ("superseded", "superseded"),
                        ],
                        default="pending",
                        max_length=16,
                        verbose_name="status",
                    ),
                ),
                ("attempts", models.PositiveIntegerField(default=0, verbose_name="attempts")),
                (
                    "due_at",
                    models.DateTimeField(
                        blank=True,
                        default=django.utils.timezone.now,
                        null=True,
                        verbose_name="due at",
                    ),
                ),
                (
                    "lease_token",
                    models.CharField(
                        blank=True,
                        editable=False,
                        max_length=32,
                        null=True,
                        verbose_name="lease token",
                    ),
                ),
                (
                    "last_attempt_at",
                    models.DateTimeField(blank=True, null=True, verbose_name="last attempt at"),
                ),
                (
                    "last_status",
                    models.PositiveSmallIntegerField(
                        blank=True, null=True, verbose_name="last status"
                    ),
                ),
                ("last_error", models.TextField(blank=True, default="", verbose_name="last error")),
                (
                    "settled_at",
                    models.DateTimeField(blank=True, null=True, verbose_name="settled at"),
                ),
                (
                    "sequence",
                    models.CharField(
                        blank=True, default="", max_length=64, verbose_name="sequence"
                    ),
                ),
                (
                    "after",
                    models.ForeignKey(
                        blank=True,
                        db_index=False,
                        null=True,
                        on_delete=django.db.models.deletion.SET_NULL,
                        related_name="+",
                        to="federation_delivery.delivery",
                        verbose_name="after",
                    ),
                ),
                (
                    "not_before",
                    models.DateTimeField(blank=True, null=True, verbose_name="not before"),
                ),
                (
                    "batch",
                    models.ForeignKey(
                        db_index=False,
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="deliveries",
                        to="federation_delivery.batch",
                        verbose_name="batch",
                    ),
                ),
            ],
            options={
                "verbose_name": "delivery",
                "verbose_name_plural": "deliveries",
                "indexes": [
                    models.Index(
                        condition=models.Q(("status", "pending")),
                        fields=["lane", "due_at"],
                        name="fd_delivery_due",
                    ),
                    models.Index(fields=["batch", "status"], name="fd_delivery_batch_status"),
                    models.Index(fields=["host", "status"], name="fd_delivery_host_status"),
                    models.Index(
                        condition=models.Q(("settled_at__isnull", False)),
                        fields=["status", "settled_at"],
                        name="fd_delivery_settled",
                    ),
                    models.Index(
                        condition=models.Q(("after__isnull", False)),
                        fields=["after"],
                        name="fd_delivery_after",
                    ),
                    models.Index(
                        condition=models.Q(
                            ("settled_at__isnull", True),
                            models.Q(("sequence", ""), _negated=True),
                        ),
                        fields=["sequence", "id"],
                        name="fd_delivery_sequence",
                    ),
                    models.Index(
                        condition=models.Q(("kind", "webhook"), ("status", "pending")),
                        fields=["destination", "id"],
                        name="fd_delivery_destination",
                    ),
                ],
                "constraints": [
                    models.UniqueConstraint(
                        fields=("batch", "inbox"), name="fd_delivery_once_per_inbox"
                    )
                ],
            },
        ),
        SetFillfactor(model_name="batch", fillfactor=FILLFACTOR),
    ]
