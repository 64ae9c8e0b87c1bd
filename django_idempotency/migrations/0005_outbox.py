"""The transactional outbox: messages committed with the business state, sent by the relay."""

import uuid

import django.utils.timezone
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("django_idempotency", "0004_record_index_set"),
    ]

    operations = [
        migrations.CreateModel(
            name="OutboxMessage",
            fields=[
                (
                    "id",
                    models.UUIDField(
                        default=uuid.uuid4, editable=False, primary_key=True, serialize=False
                    ),
                ),
                (
                    "task",
                    models.CharField(help_text="The registered name of the task.", max_length=255),
                ),
                ("args", models.JSONField(blank=True, default=list)),
                ("kwargs", models.JSONField(blank=True, default=dict)),
                (
                    "status",
                    models.CharField(
                        choices=[("pending", "pending"), ("sent", "sent"), ("dead", "dead")],
                        default="pending",
                        max_length=8,
                    ),
                ),
                (
                    "attempts",
                    models.PositiveIntegerField(default=0, help_text="Failed sends so far."),
                ),
                ("available_at", models.DateTimeField(default=django.utils.timezone.now)),
                ("created_at", models.DateTimeField(default=django.utils.timezone.now)),
                ("sent_at", models.DateTimeField(blank=True, null=True)),
                ("last_error", models.TextField(blank=True, default="")),
            ],
            options={
                "verbose_name": "outbox message",
                "verbose_name_plural": "outbox messages",
                "db_table": "django_idempotency_outbox",
                "indexes": [
                    models.Index(
                        fields=["status", "available_at"], name="idempotency_outbox_due_idx"
                    ),
                    models.Index(fields=["status", "sent_at"], name="idempotency_outbox_sent_idx"),
                    models.Index(fields=["created_at"], name="idempotency_outbox_created_idx"),
                ],
            },
        ),
    ]
