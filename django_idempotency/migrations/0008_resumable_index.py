"""A partial index of the resumable records (recovery policy "resume"), for their statistic
and gauge by status. Only those records have an entry: no other claim writes to it."""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("django_idempotency", "0007_response_body_permission"),
    ]

    operations = [
        migrations.AddIndex(
            model_name="idempotencyrecord",
            index=models.Index(
                condition=models.Q(("recovery_policy", "resume")),
                fields=["recovery_policy"],
                name="idempotency_resumable_idx",
            ),
        ),
    ]
