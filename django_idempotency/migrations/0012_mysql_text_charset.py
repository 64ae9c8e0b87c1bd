"""On MySQL/MariaDB, store any Unicode text in every column that holds a caller's text.

A table takes the character set its database was created with: ``utf8mb3`` for a database
created as Django's MySQL notes show (``CHARACTER SET utf8``), ``latin1`` on a server never
told otherwise. Such a column refuses a 4-byte character (an emoji), and in strict mode
the whole statement fails: the audit copy of a record whose account or operation holds
one (so the purge fails on every run), an outbox message of such a task name, a relay's
error text. 0003, 0006 and 0010 already made the record's names, step names and the keys of
``enqueue_once`` ``utf8mb4``; these are the rest.

The audit trail's names and the outbox's task names also compare byte for byte, as the
record's names do: a look-up of ``abc`` does not find ``ABC``. Undoing this migration
leaves the columns as they are (they hold text the former ones could not).
"""

from __future__ import annotations

from django.db import migrations
from django.db.backends.base.schema import BaseDatabaseSchemaEditor
from django.db.migrations.state import StateApps

NAME = "varchar(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL"
TEXT = "longtext CHARACTER SET utf8mb4 NOT NULL"
COLUMNS = {
    "django_idempotency_audit": {"account": NAME, "operation": NAME, "key": NAME},
    "django_idempotency_outbox": {"task": NAME, "last_error": TEXT},
    "django_idempotency_step": {"result": TEXT},
}


def utf8mb4(apps: StateApps, schema_editor: BaseDatabaseSchemaEditor) -> None:
    if schema_editor.connection.vendor != "mysql":
        return
    quote = schema_editor.quote_name
    for table, columns in COLUMNS.items():
        changes = ", ".join(f"MODIFY {quote(name)} {kind}" for name, kind in columns.items())
        schema_editor.execute(f"ALTER TABLE {quote(table)} {changes}")


class Migration(migrations.Migration):
    dependencies = [("django_idempotency", "0011_claim_function")]

    # MySQL cannot run DDL inside a transaction.
    atomic = False

    operations = [migrations.RunPython(utf8mb4, migrations.RunPython.noop, elidable=False)]
