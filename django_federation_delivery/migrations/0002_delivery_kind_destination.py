"""A delivery's kind and its webhook destination, each a column of its own.

Until now a webhook delivery told both only through its inbox and host,
written as the prefix ``webhook:`` and the destination's name: the rows
queued so far are given their kind and destination from there, and their
inbox is the name alone, as a send writes it from now on (their ordering
sequence follows).
"""

import hashlib

from django.db import migrations, models

#: How a webhook delivery's inbox and host were written before this migration.
OLD_PREFIX = "webhook:"
#: The ordering key of every webhook batch.
ORDERING_KEY = "webhook"


def name_destinations(apps, schema_editor):  # type: ignore[no-untyped-def]
    Delivery = apps.get_model("federation_delivery", "Delivery")
    rows = Delivery.objects.using(schema_editor.connection.alias)
    hosts = rows.filter(host__startswith=OLD_PREFIX).values_list("host", flat=True).distinct()
    for host in list(hosts):
        name = host[len(OLD_PREFIX) :]
        deliveries = rows.filter(host=host)
        deliveries.update(kind="webhook", destination=name, inbox=name)
        # Each destination's events are one sequence: its ordering key (the
        # one every webhook batch has) and its inbox, now the name.
        deliveries.exclude(sequence="").update(sequence=sequence_of(ORDERING_KEY, name))


def sequence_of(ordering_key: str, inbox: str) -> str:
    """As ``store.sequences.sequence_of`` writes it."""
    return hashlib.sha256(f"{ordering_key}\n{inbox}".encode()).hexdigest()


class Migration(migrations.Migration):
    dependencies = [
        ("federation_delivery", "0001_initial"),
    ]

    operations = [
        migrations.AddField(
            model_name="delivery",
            name="kind",
            field=models.CharField(
                choices=[("activitypub", "ActivityPub inbox"), ("webhook", "webhook")],
                default="activitypub",
                max_length=16,
                verbose_name="kind",
            ),
        ),
        migrations.AddField(
            model_name="delivery",
            name="destination",
            field=models.CharField(
                blank=True, default="", max_length=64, verbose_name="destination"
            ),
        ),
        migrations.AddIndex(
            model_name="delivery",
            index=models.Index(
                condition=models.Q(("kind", "webhook"), ("status", "pending")),
                fields=["destination", "id"],
                name="fd_delivery_destination",
            ),
        ),
        # After the index: on PostgreSQL, rows updated in a transaction leave
        # their foreign keys' checks pending until it commits, and no index
        # can be made on the table meanwhile.
        migrations.RunPython(name_destinations, migrations.RunPython.noop),
    ]
