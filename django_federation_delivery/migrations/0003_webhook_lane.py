"""Webhook events get a lane of their own, claimed before every other.

The events queued so far, pending in the lane a send gave them, move to it,
with their batches.
"""

from django.db import migrations, models

LANES = [
    ("webhook", "webhook"),
    ("priority", "priority"),
    ("normal", "normal"),
    ("low", "low"),
]


def move_webhooks(apps, schema_editor):  # type: ignore[no-untyped-def]
    alias = schema_editor.connection.alias
    Batch = apps.get_model("federation_delivery", "Batch")
    Delivery = apps.get_model("federation_delivery", "Delivery")
    Delivery.objects.using(alias).filter(kind="webhook").update(lane="webhook")
    Batch.objects.using(alias).exclude(event_type="").update(lane="webhook")


class Migration(migrations.Migration):
    dependencies = [
        ("federation_delivery", "0002_delivery_kind_destination"),
    ]

    operations = [
        migrations.AlterField(
            model_name="batch",
            name="lane",
            field=models.CharField(
                choices=LANES, default="normal", max_length=16, verbose_name="lane"
            ),
        ),
        migrations.AlterField(
            model_name="delivery",
            name="lane",
            field=models.CharField(
                choices=LANES, default="normal", max_length=16, verbose_name="lane"
            ),
        ),
        migrations.RunPython(move_webhooks, migrations.RunPython.noop, elidable=True),
    ]
