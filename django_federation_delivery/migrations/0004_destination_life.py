"""A webhook destination's life: why the deliverer disabled it, and since when it fails."""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("federation_delivery", "0003_webhook_lane"),
    ]

    operations = [
        migrations.AddField(
            model_name="host",
            name="disabled_reason",
            field=models.CharField(
                blank=True, default="", max_length=400, verbose_name="disabled because"
            ),
        ),
        migrations.AddField(
            model_name="host",
            name="failing_since",
            field=models.DateTimeField(blank=True, null=True, verbose_name="failing since"),
        ),
    ]
