"""The keys of ``outbox.enqueue_once``: which message holds (task, key).

On PostgreSQL and MariaDB/MySQL the key's reference to its message is a foreign key with
``ON DELETE CASCADE``, so the purge's raw batches take a message's key along; on
MariaDB/MySQL task names and keys compare byte for byte (``abc`` is not ``ABC``).
"""

from __future__ import annotations

import django.db.models.deletion
import django.utils.timezone
from django.db import migrations, models
from django.db.backends.base.schema import BaseDatabaseSchemaEditor
from django.db.migrations.state import StateApps

KEY = "django_idempotency_outbox_key"
MESSAGE = "django_idempotency_outbox"
CONSTRAINT = "idempotency_outbox_key_message_fk"


def cascade(apps: StateApps, schema_editor: BaseDatabaseSchemaEditor) -> None:
    vendor = schema_editor.connection.vendor
    if vendor not in ("postgresql", "mysql"):
        return
    quote = schema_editor.quote_name
    if vendor == "mysql":
        changes = ", ".join(
            f"MODIFY {quote(column)} varchar(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin "
            "NOT NULL"
            for column in ("task", "key")
        )
        schema_editor.execute(f"ALTER TABLE {quote(KEY)} {changes}")
    schema_editor.execute(
        f"ALTER TABLE {quote(KEY)} ADD CONSTRAINT {quote(CONSTRAINT)} FOREIGN KEY "
        f"({quote('message_id')}) REFERENCES {quote(MESSAGE)} ({quote('id')}) ON DELETE CASCADE"
    )


def no_cascade(apps: StateApps, schema_editor: BaseDatabaseSchemaEditor) -> None:
    vendor = schema_editor.connection.vendor
    if vendor not in ("postgresql", "mysql"):
        return
    quote = schema_editor.quote_name
    drop = "FOREIGN KEY" if vendor == "mysql" else "CONSTRAINT"
    schema_editor.execute(f"ALTER TABLE {quote(KEY)} DROP {drop} {quote(CONSTRAINT)}")


class Migration(migrations.Migration):
    dependencies = [("django_idempotency", "0009_outbox_delivery")]

    # MySQL cannot run DDL inside a transaction.
    atomic = False

    operations = [
        migrations.CreateModel(
            name="OutboxUniqueKey",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                (
                    "task",
                    models.CharField(help_text="The registered name of the task.", max_length=255),
                ),
                ("key", models.CharField(max_length=255)),
                (
                    "unique_until",
                    models.CharField(
                        choices=[
                            ("started", "started"),
                            ("finished", "finished"),
                            ("duration", "duration"),
                        ],
                        help_text="When the message stops holding the key.",
                        max_length=16,
                    ),
                ),
                (
                    "held_until",
                    models.DateTimeField(
                        blank=True,
                        help_text="For a duration: the key is held until then.",
                        null=True,
                    ),
                ),
                (
                    "run_ttl",
                    models.DurationField(
                        blank=True,
                        help_text="How long the worker keeps its record of a run: a message "
                        "sent longer ago with no record of a run no longer holds the key.",
                        null=True,
                    ),
                ),
                (
                    "finished_at",
                    models.DateTimeField(
                        blank=True,
                        help_text="When the task's run ended with an error (a success is its "
                        "record's).",
                        null=True,
                    ),
                ),
                ("created_at", models.DateTimeField(default=django.utils.timezone.now)),
                (
                    "message",
                    models.OneToOneField(
                        db_constraint=False,
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="unique_key",
                        to="django_idempotency.outboxmessage",
                    ),
                ),
            ],
            options={
                "verbose_name": "outbox unique key",
                "verbose_name_plural": "outbox unique keys",
                "db_table": "django_idempotency_outbox_key",
                "constraints": [
                    models.UniqueConstraint(
                        fields=("task", "key"), name="idempotency_outbox_key_unique"
                    )
                ],
            },
        ),
        migrations.RunPython(cascade, no_cascade),
    ]
