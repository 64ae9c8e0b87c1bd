"""The checks that need a connection (``manage.py check --database <alias>``): the package's
tables on ``DATABASE``, and ``CLAIM_DATABASE`` on the same database as ``DATABASE``.

Each reads the server, never writes. ``migrate`` runs the database checks before it
migrates: there the tables are missing by nature, and the check leaves them to it.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any

from django.apps import apps
from django.core.checks import CheckMessage, Error
from django.db import DatabaseError, connections

from django_idempotency import _check_ids
from django_idempotency._vendors import Vendor, of_connection

__all__ = ["missing_tables", "not_the_same_database"]


def missing_tables(alias: str, databases: Iterable[str]) -> list[CheckMessage]:
    """E052: the package's tables (or a later migration of them) are missing on ``alias``."""
    if alias not in databases or _under_migrate():
        return []
    from django.db.migrations.loader import MigrationLoader

    connection = connections[alias]
    try:
        tables = set(connection.introspection.table_names())
        loader = MigrationLoader(connection, ignore_no_migrations=True)
    except DatabaseError:  # cannot connect: the first request says so (503), as does migrate
        return []
    config = apps.get_app_config("django_idempotency")
    missing = sorted(
        model._meta.db_table
        for model in config.get_models()
        if model._meta.managed and model._meta.db_table not in tables
    )
    unapplied = sorted(
        name
        for app, name in loader.graph.nodes
        if app == config.label and (app, name) not in loader.applied_migrations
    )
    if not missing and not unapplied:
        return []
    what = []
    if missing:
        what.append(f"the tables {', '.join(missing)} are missing")
    if unapplied:
        what.append(f"its migrations {', '.join(unapplied)} are not applied")
    return [
        Error(
            f"The idempotency database {alias!r} is not migrated: {'; '.join(what)}. "
            + (
                "Every protected request would be refused (503 idempotency_store_unavailable)."
                if missing
                else "Protected requests may be refused (503 idempotency_store_unavailable) "
                "until they are."
            ),
            hint=f"Run: python manage.py migrate django_idempotency --database {alias}",
            id=_check_ids.error("TABLES_MISSING"),
        )
    ]


def not_the_same_database(
    alias: str, claims: str | None, databases: Iterable[str]
) -> list[CheckMessage]:
    """E051: ``CLAIM_DATABASE`` reaches another database than ``DATABASE``.

    Told from the settings where they differ in engine, or in the file of SQLite; else,
    under ``check --database <DATABASE>``, from both connections (the server's own name for
    the database and for itself, and on PostgreSQL the schema in which each finds the
    record table).
    """
    if claims is None or claims == alias:
        return []
    mine, theirs = connections[alias], connections[claims]
    vendor, other = of_connection(mine), of_connection(theirs)
    if vendor.name != other.name:
        why = f"it is {other.name}, {alias!r} is {vendor.name}"
    elif vendor.single_file:
        if mine.settings_dict["NAME"] == theirs.settings_dict["NAME"]:
            return []
        why = f"it is the file {theirs.settings_dict['NAME']!r}, not {mine.settings_dict['NAME']!r}"
    elif alias not in databases or vendor.identity_sql is None:
        return []
    else:
        try:
            ours, claimed = _identity(mine, vendor), _identity(theirs, vendor)
        except DatabaseError:  # either cannot connect: the first claim says so (503)
            return []
        if ours == claimed:
            return []
        why = f"it reaches the database {claimed[0]!r}, {alias!r} reaches {ours[0]!r}"
        if ours[:2] == claimed[:2]:
            why = (
                f"its search_path finds the record table in the schema {claimed[2]!r}, "
                f"that of {alias!r} in {ours[2]!r}"
            )
        elif ours[0] == claimed[0]:
            why = f"it reaches a database named {claimed[0]!r} on another server"
    return [
        Error(
            f"IDEMPOTENCY['CLAIM_DATABASE'] ({claims!r}) is not the database of "
            f"IDEMPOTENCY['DATABASE'] ({alias!r}): {why}. Claims made there are never "
            "completed where the work commits: every such call would lose its lease and "
            "run again.",
            hint=(
                f"Point {claims!r} at the same database as {alias!r} (the same server, "
                "database name and search_path; through a pooler of its own if you like), "
                "or set CLAIM_DATABASE to None."
            ),
            id=_check_ids.error("CLAIM_DATABASE_ELSEWHERE"),
        )
    ]


def _identity(connection: Any, vendor: Vendor) -> tuple[Any, ...]:
    # What names a database on its server, as seen from a connection to it (through a
    # pooler too: PgBouncer's database name is an alias, the server's is not), and where
    # the vendor says, the schema in which the connection finds the record table.
    sql = vendor.identity_sql or ""
    with connection.cursor() as cursor:
        if "%(table)s" in sql:
            record = apps.get_model("django_idempotency", "IdempotencyRecord")
            cursor.execute(sql, {"table": record._meta.db_table})
        else:
            cursor.execute(sql)
        return tuple(cursor.fetchone())


def _under_migrate() -> bool:
    """Whether ``migrate`` is running the checks, before it creates the tables."""
    from django.core.management.commands.migrate import Command as Migrate

    frame = sys._getframe(1)
    while frame is not None:
        if isinstance(frame.f_locals.get("self"), Migrate):
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False
