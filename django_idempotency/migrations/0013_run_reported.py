"""A task not under ``@idempotent_task()`` takes ``enqueue_once(unique_until="started")`` and
``"finished"``: its worker reports the run on the key's row (when it started, its lease,
when it ended), and the message says so (``run_reported``), so that the relay asks for the
report. Columns added with defaults or NULL: no table is rewritten.
"""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("django_idempotency", "0012_mysql_text_charset"),
    ]

    operations = [
        migrations.AddField(
            model_name="outboxmessage",
            name="run_reported",
            field=models.BooleanField(
                default=False,
                help_text="The worker reports this message's run on its unique key (enqueue_once until started or finished, the task not under @idempotent_task()).",
            ),
        ),
        migrations.AddField(
            model_name="outboxuniquekey",
            name="lease_expires_at",
            field=models.DateTimeField(
                blank=True,
                help_text="For a run the worker reports here: it holds the key until then unless it ended (a worker that died never says so).",
                null=True,
            ),
        ),
        migrations.AddField(
            model_name="outboxuniquekey",
            name="run_id",
            field=models.CharField(
                blank=True,
                default="",
                help_text="For a run the worker reports here: the id the worker knows it by, where it is not the message's (the result id of Django's Tasks framework's backend).",
                max_length=255,
            ),
        ),
        migrations.AddField(
            model_name="outboxuniquekey",
            name="started_at",
            field=models.DateTimeField(
                blank=True,
                help_text="For a run the worker reports here: when it started.",
                null=True,
            ),
        ),
        migrations.AddIndex(
            model_name="outboxuniquekey",
            index=models.Index(fields=["run_id"], name="idempotency_outbox_key_run_idx"),
        ),
        migrations.AlterField(
            model_name="outboxuniquekey",
            name="finished_at",
            field=models.DateTimeField(
                blank=True,
                help_text="When the task's run ended with an error (a success is its record's); for a run the worker reports here, when it ended.",
                null=True,
            ),
        ),
    ]
