"""The recorded steps of resumable operations (``recovery="resume"``).

On PostgreSQL and MariaDB/MySQL the step's reference to its record is a foreign key with
``ON DELETE CASCADE``, so every way a record is deleted (the purge's raw batches included)
takes its steps along; on MariaDB/MySQL step names compare byte for byte, like keys.
"""

from __future__ import annotations

import django.db.models.deletion
import django.utils.timezone
from django.db import migrations, models
from django.db.backends.base.schema import BaseDatabaseSchemaEditor
from django.db.migrations.state import StateApps

STEP = "django_idempotency_step"
RECORD = "django_idempotency_record"
CONSTRAINT = "idempotency_step_record_fk"


def cascade(apps: StateApps, schema_editor: BaseDatabaseSchemaEditor) -> None:
    vendor = schema_editor.connection.vendor
    if vendor not in ("postgresql", "mysql"):
        return
    quote = schema_editor.quote_name
    if vendor == "mysql":
        schema_editor.execute(
            f"ALTER TABLE {quote(STEP)} MODIFY {quote('name')} varchar(255) "
            "CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL"
        )
    schema_editor.execute(
        f"ALTER TABLE {quote(STEP)} ADD CONSTRAINT {quote(CONSTRAINT)} FOREIGN KEY "
        f"({quote('record_id')}) REFERENCES {quote(RECORD)} ({quote('id')}) ON DELETE CASCADE"
    )


def no_cascade(apps: StateApps, schema_editor: BaseDatabaseSchemaEditor) -> None:
    vendor = schema_editor.connection.vendor
    if vendor not in ("postgresql", "mysql"):
        return
    quote = schema_editor.quote_name
    drop = "FOREIGN KEY" if vendor == "mysql" else "CONSTRAINT"
    schema_editor.execute(f"ALTER TABLE {quote(STEP)} DROP {drop} {quote(CONSTRAINT)}")


class Migration(migrations.Migration):
    dependencies = [("django_idempotency", "0005_outbox")]

    # MySQL cannot run DDL inside a transaction.
    atomic = False

    operations = [
        migrations.CreateModel(
            name="IdempotencyStep",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("name", models.CharField(max_length=255)),
                ("result", models.TextField()),
                ("created_at", models.DateTimeField(default=django.utils.timezone.now)),
                (
                    "record",
                    models.ForeignKey(
                        db_constraint=False,
                        db_index=False,
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="steps",
                        to="django_idempotency.idempotencyrecord",
                    ),
                ),
            ],
            options={
                "verbose_name": "idempotency step",
                "verbose_name_plural": "idempotency steps",
                "db_table": "django_idempotency_step",
                "constraints": [
                    models.UniqueConstraint(
                        fields=("record", "name"), name="idempotency_step_unique"
                    )
                ],
            },
        ),
        migrations.RunPython(cascade, no_cascade),
    ]
