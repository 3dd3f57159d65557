"""Fewer index entries a delivery: each row is written three times (queued,
claimed, settled), and every index whose condition it meets gets an entry
each time.

- ``batch_id`` loses its own index: ``fd_delivery_once_per_inbox`` and
  ``fd_delivery_batch_status`` both begin with it.
- ``after_id`` and ``(status, settled_at)`` keep theirs only where they are
  set: NULL in most rows, and in every pending one.

The foreign keys are left as they are: only the indexes Django made for them
are dropped, by the names it gave them, so that neither database rebuilds the
table or checks its constraints again.
"""

import django.db.models.deletion
from django.db import migrations, models

TABLE = "federation_delivery_delivery"
#: The indexes Django made for the two foreign keys in 0001_initial.
BATCH_INDEX = "federation_delivery_delivery_batch_id_0a4ad23c"
AFTER_INDEX = "federation_delivery_delivery_after_id_ef7e9aed"


class Migration(migrations.Migration):
    dependencies = [
        ("federation_delivery", "0001_initial"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AlterField(
                    model_name="delivery",
                    name="after",
                    field=models.ForeignKey(
                        blank=True,
                        db_index=False,
                        null=True,
                        on_delete=django.db.models.deletion.SET_NULL,
                        related_name="+",
                        to="federation_delivery.delivery",
                        verbose_name="after",
                    ),
                ),
                migrations.AlterField(
                    model_name="delivery",
                    name="batch",
                    field=models.ForeignKey(
                        db_index=False,
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="deliveries",
                        to="federation_delivery.batch",
                        verbose_name="batch",
                    ),
                ),
            ],
            database_operations=[
                migrations.RunSQL(
                    f'DROP INDEX IF EXISTS "{BATCH_INDEX}"',
                    f'CREATE INDEX "{BATCH_INDEX}" ON "{TABLE}" ("batch_id")',
                ),
                migrations.RunSQL(
                    f'DROP INDEX IF EXISTS "{AFTER_INDEX}"',
                    f'CREATE INDEX "{AFTER_INDEX}" ON "{TABLE}" ("after_id")',
                ),
            ],
        ),
        migrations.RemoveIndex(
            model_name="delivery",
            name="fd_delivery_settled",
        ),
        migrations.AddIndex(
            model_name="delivery",
            index=models.Index(
                condition=models.Q(("settled_at__isnull", False)),
                fields=["status", "settled_at"],
                name="fd_delivery_settled",
            ),
        ),
        migrations.AddIndex(
            model_name="delivery",
            index=models.Index(
                condition=models.Q(("after__isnull", False)),
                fields=["after"],
                name="fd_delivery_after",
            ),
        ),
    ]
