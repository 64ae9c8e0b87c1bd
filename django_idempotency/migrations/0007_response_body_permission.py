"""The permission to see stored response bodies in the admin: view_response_body."""

from django.db import migrations


class Migration(migrations.Migration):
    dependencies = [
        ("django_idempotency", "0006_steps"),
    ]

    operations = [
        migrations.AlterModelOptions(
            name="idempotencyrecord",
            options={
                "permissions": [("view_response_body", "Can view stored response bodies")],
                "verbose_name": "idempotency record",
                "verbose_name_plural": "idempotency records",
            },
        ),
    ]
