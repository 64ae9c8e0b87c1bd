"""Migration ``0013_run_reported`` on a database that holds messages and keys, on every
database: applied, the rows written before it read as messages and keys whose runs are not
reported (nothing of theirs changes meaning); undone, the rows stay, without the columns."""

from __future__ import annotations

import uuid
from datetime import timedelta

import pytest
from django.core.management import call_command
from django.db import connection, transaction
from django.db.migrations.executor import MigrationExecutor
from django.utils import timezone

from django_idempotency import outbox
from django_idempotency.models import OutboxMessage, OutboxStatus, OutboxUniqueKey

pytestmark = pytest.mark.django_db(transaction=True)

celery = pytest.importorskip("celery", reason="Celery is an optional dependency")

APP = "django_idempotency"
BEFORE, AFTER = "0012_mysql_text_charset", "0013_run_reported"
ADDED = {
    "django_idempotency_outbox": {"run_reported"},
    "django_idempotency_outbox_key": {"run_id", "started_at", "lease_expires_at"},
}


def columns(table: str) -> set[str]:
    with connection.cursor() as cursor:
        return {
            column.name for column in connection.introspection.get_table_description(cursor, table)
        }


def test_0013_forward_and_back_on_a_database_with_rows():
    from tests.testapp.tasks import hold_plain

    call_command("migrate", APP, BEFORE, verbosity=0)
    try:
        for table, added in ADDED.items():
            assert not columns(table) & added
        # The rows as the release before wrote them: through that migration state's models.
        state = MigrationExecutor(connection).loader.project_state((APP, BEFORE))
        message_model = state.apps.get_model(APP, "OutboxMessage")
        key_model = state.apps.get_model(APP, "OutboxUniqueKey")
        now = timezone.now()
        waiting = message_model.objects.create(task="tests.hold_plain", args=["w", 0.0])
        sent = message_model.objects.create(
            task="tests.hold_plain", args=["s", 0.0], status=OutboxStatus.SENT, sent_at=now
        )
        for key, message in (("waiting", waiting), ("sent", sent)):
            key_model.objects.create(
                task="tests.hold_plain",
                key=key,
                message_id=message.id,
                unique_until="finished",
                run_ttl=timedelta(days=1),
            )

        call_command("migrate", APP, AFTER, verbosity=0)
        for table, added in ADDED.items():
            assert columns(table) >= added
        assert set(OutboxMessage.objects.values_list("run_reported", flat=True)) == {False}
        assert set(
            OutboxUniqueKey.objects.values_list("run_id", "started_at", "lease_expires_at")
        ) == {("", None, None)}
        # Both still hold their keys, as before: waiting, and sent within the run's ttl.
        with transaction.atomic():
            assert outbox.enqueue_once("waiting", hold_plain, "w", 0.0) == waiting.id
            assert outbox.enqueue_once("sent", hold_plain, "s", 0.0) == sent.id
            new = outbox.enqueue_once("new", hold_plain, "n", 0.0)
        assert OutboxMessage.objects.get(pk=new).run_reported
        OutboxUniqueKey.objects.filter(message_id=new).update(
            run_id=str(uuid.uuid4()), started_at=now, lease_expires_at=now
        )

        call_command("migrate", APP, BEFORE, verbosity=0)
        for table, added in ADDED.items():
            assert not columns(table) & added
        assert message_model.objects.count() == 3
        assert key_model.objects.count() == 3
    finally:
        call_command("migrate", APP, verbosity=0)
    assert OutboxMessage.objects.count() == 3
    assert set(OutboxMessage.objects.values_list("run_reported", flat=True)) == {False}


def test_the_run_id_has_one_index_for_its_one_lookup():
    """A worker of Django's Tasks framework finds its run's key by ``run_id =``: one index
    serves it. No second one (PostgreSQL's ``varchar_pattern_ops`` twin for ``LIKE``, which
    no query of ours makes) to write on every enqueue and every hand-over."""
    with connection.cursor() as cursor:
        constraints = connection.introspection.get_constraints(
            cursor, OutboxUniqueKey._meta.db_table
        )
    on_run_id = [
        name
        for name, constraint in constraints.items()
        if constraint["index"] and constraint["columns"] == ["run_id"]
    ]
    assert len(on_run_id) == 1, on_run_id
