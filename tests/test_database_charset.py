"""On MariaDB and MySQL, every text column the package writes holds any Unicode text,
whatever character set the database was created with.

A table takes its database's default character set: ``utf8mb3`` for a database created as
Django's MySQL notes show (``CHARACTER SET utf8``), ``latin1`` on a server that was never
told otherwise. Such a column refuses a 4-byte character (an emoji, a CJK extension), and
MariaDB's strict mode makes the whole statement fail: the audit copy of an expired record
whose account or operation holds one (the purge fails on every run, and storage grows
without bound), an outbox message whose task name holds one, an error text the relay
records. Each test migrates a database of its own, created with ``utf8mb3``, and writes there.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection, connections
from django.db.migrations.executor import MigrationExecutor
from django.db.utils import load_backend
from django.test import override_settings
from django.utils import timezone

from django_idempotency.models import (
    IdempotencyAuditRecord,
    IdempotencyRecord,
    IdempotencyStep,
    OutboxMessage,
)

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(connection.vendor != "mysql", reason="character sets of MariaDB/MySQL"),
]

ALIAS = "utf8mb3_database"
PIZZA = "\U0001f355"  # 4 bytes in UTF-8
#: The text columns the package writes with what a caller, a view or a task gave it (the
#: others hold names of its own: states, policies, hex digests).
WRITTEN = {
    ("django_idempotency_record", "account"),
    ("django_idempotency_record", "operation"),
    ("django_idempotency_record", "key"),
    ("django_idempotency_audit", "account"),
    ("django_idempotency_audit", "operation"),
    ("django_idempotency_audit", "key"),
    ("django_idempotency_step", "name"),
    ("django_idempotency_step", "result"),
    ("django_idempotency_outbox", "task"),
    ("django_idempotency_outbox", "last_error"),
    ("django_idempotency_outbox_key", "task"),
    ("django_idempotency_outbox_key", "key"),
}


@pytest.fixture
def utf8mb3_database() -> Iterator[str]:
    """A database created with ``utf8mb3`` as its default, the package's migrations applied:
    its alias. (A connection of this test alone, not in ``DATABASES``.)"""
    name = f"{connection.settings_dict['NAME']}_utf8mb3"
    with connection.cursor() as cursor:
        cursor.execute(f"DROP DATABASE IF EXISTS `{name}`")
        cursor.execute(f"CREATE DATABASE `{name}` CHARACTER SET utf8mb3 COLLATE utf8mb3_general_ci")
    settings_dict = {**connection.settings_dict, "NAME": name}
    own = load_backend(settings_dict["ENGINE"]).DatabaseWrapper(settings_dict, ALIAS)
    connections[ALIAS] = own
    try:
        executor = MigrationExecutor(own)
        executor.migrate(executor.loader.graph.leaf_nodes("django_idempotency"))
        yield ALIAS
    finally:
        own.close()
        del connections[ALIAS]
        with connection.cursor() as cursor:
            cursor.execute(f"DROP DATABASE IF EXISTS `{name}`")


def charsets(alias: str) -> dict[tuple[str, str], tuple[str, str]]:
    with connections[alias].cursor() as cursor:
        cursor.execute(
            "SELECT table_name, column_name, character_set_name, collation_name "
            "FROM information_schema.columns WHERE table_schema = DATABASE() "
            "AND table_name LIKE 'django_idempotency%%' AND character_set_name IS NOT NULL"
        )
        return {(table, col): (charset, collation) for table, col, charset, collation in cursor}


def test_every_column_written_with_callers_text_holds_4_byte_characters(utf8mb3_database):
    found = charsets(utf8mb3_database)
    assert {column: found[column][0] for column in WRITTEN} == dict.fromkeys(WRITTEN, "utf8mb4")


def test_names_in_the_audit_trail_and_task_names_compare_byte_for_byte(utf8mb3_database):
    found = charsets(utf8mb3_database)
    exact = {
        ("django_idempotency_audit", "account"),
        ("django_idempotency_audit", "operation"),
        ("django_idempotency_audit", "key"),
        ("django_idempotency_outbox", "task"),
    }
    assert {column: found[column][1] for column in exact} == dict.fromkeys(exact, "utf8mb4_bin")


def test_the_purge_copies_a_record_of_a_4_byte_account_to_the_audit_trail(utf8mb3_database):
    now = timezone.now()
    records = IdempotencyRecord.objects.using(utf8mb3_database)
    records.create(
        account=f"org:{PIZZA}",
        operation=f"POST /{PIZZA}/",
        key="k-1",
        request_hash="0" * 64,
        status="completed",
        response_status=201,
        response_body=b"{}",
        created_at=now - timedelta(days=2),
        expires_at=now - timedelta(days=1),
    )
    with override_settings(IDEMPOTENCY={"AUDIT": True}):
        result = records.delete_expired(now=now)
    audits = IdempotencyAuditRecord.objects.using(utf8mb3_database)
    assert (result.deleted, result.archived) == (1, 1)
    assert list(audits.values_list("account", "operation")) == [(f"org:{PIZZA}", f"POST /{PIZZA}/")]
    assert records.count() == 0


def test_outbox_messages_and_steps_keep_4_byte_text(utf8mb3_database):
    messages = OutboxMessage.objects.using(utf8mb3_database)
    message = messages.create(task=f"tasks.{PIZZA}", args=[PIZZA])
    messages.filter(pk=message.pk).update(last_error=f"refused: {PIZZA}")
    record = IdempotencyRecord.objects.using(utf8mb3_database).create(
        account="a", operation="o", key="k", request_hash="0" * 64, expires_at=timezone.now()
    )
    IdempotencyStep.objects.using(utf8mb3_database).create(
        record=record, name=PIZZA, result=f'"{PIZZA}"'
    )
    stored: Any = messages.values_list("task", "last_error").get()
    assert stored == (f"tasks.{PIZZA}", f"refused: {PIZZA}")
    steps = IdempotencyStep.objects.using(utf8mb3_database)
    assert list(steps.values_list("name", "result")) == [(PIZZA, f'"{PIZZA}"')]
