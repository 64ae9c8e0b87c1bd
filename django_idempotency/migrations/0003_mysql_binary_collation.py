"""On MySQL/MariaDB, compare accounts, operations and keys byte for byte.

Their default collations ignore case (``utf8mb4_general_ci``), so the unique constraint would
take ``abc`` and ``ABC`` for one key, and two accounts differing only in case for one caller.
Other databases already compare these columns exactly.
"""

from __future__ import annotations

from django.db import migrations
from django.db.backends.base.schema import BaseDatabaseSchemaEditor
from django.db.migrations.state import StateApps

COLUMNS = ("account", "operation", "key")
TABLE = "django_idempotency_record"


def binary_collation(apps: StateApps, schema_editor: BaseDatabaseSchemaEditor) -> None:
    if schema_editor.connection.vendor != "mysql":
        return
    quote = schema_editor.quote_name
    changes = ", ".join(
        f"MODIFY {quote(column)} varchar(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL"
        for column in COLUMNS
    )
    schema_editor.execute(f"ALTER TABLE {quote(TABLE)} {changes}")


def default_collation(apps: StateApps, schema_editor: BaseDatabaseSchemaEditor) -> None:
    if schema_editor.connection.vendor != "mysql":
        return
    quote = schema_editor.quote_name
    changes = ", ".join(
        f"MODIFY {quote(column)} varchar(255) CHARACTER SET utf8mb4 NOT NULL" for column in COLUMNS
    )
    schema_editor.execute(f"ALTER TABLE {quote(TABLE)} {changes}")


class Migration(migrations.Migration):
    dependencies = [("django_idempotency", "0002_audit_trail")]

    # MySQL cannot run DDL inside a transaction.
    atomic = False

    operations = [migrations.RunPython(binary_collation, default_collation)]
