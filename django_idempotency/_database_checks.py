"""The checks that need a connection (``manage.py check --database <alias>``): the package's
tables on ``DATABASE``, and ``CLAIM_DATABASE`` on the same database as ``DATABASE``.

Each reads the server, never writes. ``migrate`` runs the database checks before it
migrates: there the tables are missing by nature, and the check leaves them to it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from django.apps import apps
from django.core.checks import CheckMessage, Error
from django.db import DatabaseError, connections

from django_idempotency import _check_ids
from django_idempotency._vendors import Vendor, of_connection

__all__ = [
    "in_each_schema",
    "missing_tables",
    "names_this_app",
    "not_the_same_database",
    "tenant_schemas",
]

T = TypeVar("T")


def missing_tables(alias: str, databases: Iterable[str]) -> list[CheckMessage]:
    """E052: the package's tables (or a later migration of them) are missing on ``alias``;
    under django-tenants with the package among the tenant apps, in a tenant's schema."""
    if alias not in databases or _under_migrate():
        return []
    from django.db.migrations.loader import MigrationLoader

    connection = connections[alias]
    if _tenant_layout(connection):
        return _missing_in_tenants(alias)
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
    alias: str, claims: str | None, databases: Iterable[str] | None
) -> list[CheckMessage]:
    """E051: ``CLAIM_DATABASE`` reaches another database than ``DATABASE``.

    ``databases`` ``None``: told from the settings, where they differ in engine or in the
    file of SQLite (a check that runs without ``--database``; Django 6.1 runs no
    database-tagged check then). Else, under ``check --database`` naming either alias, from
    both connections where the settings tell nothing: the server's own name for the
    database and for itself, and on PostgreSQL the schema in which each finds the record
    table.
    """
    if claims is None or claims == alias:
        return []
    mine, theirs = connections[alias], connections[claims]
    vendor, other = of_connection(mine), of_connection(theirs)
    told_by_settings = vendor.name != other.name or vendor.single_file
    if told_by_settings != (databases is None):
        return []  # the other check's part
    if vendor.name != other.name:
        why = f"it is {other.name}, {alias!r} is {vendor.name}"
    elif vendor.single_file:
        if _same_file(mine.settings_dict["NAME"], theirs.settings_dict["NAME"]):
            return []
        why = f"it is the file {theirs.settings_dict['NAME']!r}, not {mine.settings_dict['NAME']!r}"
    elif (
        databases is None
        or (alias not in databases and claims not in databases)
        or vendor.identity_sql is None
    ):
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


def _same_file(one: Any, other: Any) -> bool:
    """Whether two ``NAME``s of a single-file database open one file: the same path as a
    ``Path`` (Django's own settings: ``BASE_DIR / "db.sqlite3"``) or a string, relative or
    absolute, or through a symbolic link."""
    if one == other:  # the usual case: a copy of the other entry
        return True
    try:
        same: bool = os.path.realpath(os.fspath(one)) == os.path.realpath(os.fspath(other))
    except TypeError:  # not a path (another backend's idea of a name)
        return False
    return same


def names_this_app(apps: Iterable[object]) -> bool:
    """Whether a list of apps (``INSTALLED_APPS``, django-tenants' ``SHARED_APPS`` or
    ``TENANT_APPS``) names this package, by its name or its app config."""
    return any(
        isinstance(app, str)
        and (app == "django_idempotency" or app.startswith("django_idempotency.apps."))
        for app in apps
    )


def _tenant_layout(connection: Any) -> bool:
    """Whether the tables belong in the tenants' schemas: django-tenants' backend (it keeps a
    tenant on the connection) with the package among the ``TENANT_APPS``. The connection's
    own schema (the public one, under ``check``) then says nothing of them."""
    import importlib.util

    from django.conf import settings

    tenant_apps = getattr(settings, "TENANT_APPS", None)
    return (
        callable(getattr(connection, "set_tenant", None))
        and importlib.util.find_spec("django_tenants") is not None
        and isinstance(tenant_apps, (list, tuple))
        and names_this_app(tenant_apps)
    )


#: The schemas E052 names in its message; the others are counted.
_NAMED = 5


def tenant_schemas(alias: str) -> list[str] | None:
    """The schemas the package's tables belong in on ``alias`` under django-tenants with the
    package among the tenant apps: every tenant's (the public one only where the package is
    a shared app too). ``None`` without that layout, where the connection's own schema holds
    them. Raises ``DatabaseError`` where the tenants cannot be read."""
    if not _tenant_layout(connections[alias]):
        return None
    from django.conf import settings
    from django_tenants.utils import get_public_schema_name, get_tenant_model

    public = get_public_schema_name()
    in_public = names_this_app(getattr(settings, "SHARED_APPS", ()))
    schemas = sorted(
        name
        for name in get_tenant_model().objects.using(alias).values_list("schema_name", flat=True)
        if name != public or in_public
    )
    if in_public and public not in schemas:
        schemas.insert(0, public)
    return schemas


def in_each_schema(alias: str, schemas: list[str], read: Callable[[], T]) -> dict[str, T]:
    """``read()`` with the connection of ``alias`` set to each of ``schemas`` in turn, the
    connection's own tenant set back afterwards: ``{schema: what it read}``."""
    connection: Any = connections[alias]  # django-tenants' wrapper
    before = connection.tenant
    found: dict[str, T] = {}
    try:
        for schema in schemas:
            connection.set_schema(schema)
            found[schema] = read()
    finally:
        connection.set_tenant(before)
    return found


def _missing_in_tenants(alias: str) -> list[CheckMessage]:
    """E052 under django-tenants: the tenants whose schema lacks a table of the package, or
    a migration of it (see :func:`tenant_schemas`). The tables of every schema in one query,
    their migrations in one per 100."""
    from django.db.migrations.loader import MigrationLoader

    config = apps.get_app_config("django_idempotency")
    tables = sorted(m._meta.db_table for m in config.get_models() if m._meta.managed)
    connection = connections[alias]
    try:
        schemas = tenant_schemas(alias) or []
        loader = MigrationLoader(None, ignore_no_migrations=True)
        migrations = sorted(name for app, name in loader.graph.nodes if app == config.label)
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT n.nspname, c.relname FROM pg_catalog.pg_class c"
                " JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace"
                " WHERE c.relkind IN ('r', 'p') AND n.nspname = ANY(%s)"
                " AND c.relname = ANY(%s)",
                [schemas, [*tables, "django_migrations"]],
            )
            present: dict[str, set[str]] = {}
            for schema, table in cursor.fetchall():
                present.setdefault(schema, set()).add(table)
            recorded = sorted(s for s, found in present.items() if "django_migrations" in found)
            applied = _applied(connection, cursor, config.label, recorded)
    except DatabaseError:  # cannot connect, or the shared schema is not migrated yet
        return []
    broken = [
        schema
        for schema in schemas
        if not set(tables) <= present.get(schema, set())
        or not set(migrations) <= applied.get(schema, set())
    ]
    if not broken:
        return []
    named = ", ".join(repr(schema) for schema in broken[:_NAMED])
    if len(broken) > _NAMED:
        named += f" and {len(broken) - _NAMED} more"
    which = "the schema of the tenant" if len(broken) == 1 else "the schemas of the tenants"
    return [
        Error(
            f"The idempotency database {alias!r} is not migrated in {which} {named}: the "
            "package's tables (or a later migration of them) are missing there. Every "
            "protected request of such a tenant would be refused (503 "
            "idempotency_store_unavailable), and all_tenants_command stops at it: the "
            "purge, the recovery and the relay of the tenants after it would not run.",
            hint=f"Run: python manage.py migrate_schemas --schema={broken[0]}"
            + (", and so for each (migrate_schemas --tenant: all)" if len(broken) > 1 else ""),
            id=_check_ids.error("TABLES_MISSING"),
        )
    ]


def _applied(connection: Any, cursor: Any, app: str, schemas: list[str]) -> dict[str, set[str]]:
    """The package's migrations that each schema's ``django_migrations`` records."""

    def quote(schema: str) -> str:
        # The name is part of the statement's text, which takes parameters: a "%" in it
        # (django-tenants accepts one) is doubled, or the statement would be refused.
        return str(connection.ops.quote_name(schema)).replace("%", "%%")

    applied: dict[str, set[str]] = {}
    for start in range(0, len(schemas), 100):  # one statement per 100 schemas
        chunk = schemas[start : start + 100]
        cursor.execute(
            " UNION ALL ".join(
                f"SELECT %s, name FROM {quote(schema)}.django_migrations WHERE app = %s"
                for schema in chunk
            ),
            [value for schema in chunk for value in (schema, app)],
        )
        for schema, name in cursor.fetchall():
            applied.setdefault(schema, set()).add(name)
    return applied


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
