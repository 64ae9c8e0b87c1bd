"""The checks that need a connection: ``manage.py check --database <alias>``.

- E051: ``CLAIM_DATABASE`` reaching another database than ``DATABASE`` (claims made there
  are never completed where the work commits, and run again once per lease);
- E052: the package's migrations not applied on ``DATABASE`` (every protected request
  would be refused as if the database were down). ``migrate`` runs the database checks
  first, and is not stopped by it.

Each test points the alias ``claims`` (the same database, in tests/settings.py) elsewhere
for its duration: an empty database of its own.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
from django.core import checks
from django.core.management import call_command
from django.core.management.base import SystemCheckError
from django.db import connection, connections, transaction
from django.test import override_settings

from django_idempotency import IdempotencyError, run_once
from django_idempotency.models import IdempotencyRecord

pytestmark = pytest.mark.django_db(transaction=True, databases="__all__")

E051 = "django_idempotency.E051"
E052 = "django_idempotency.E052"
TABLES = (
    "django_idempotency_audit",
    "django_idempotency_outbox",
    "django_idempotency_record",
    "django_idempotency_step",
)


def found(*ids: str, databases: list[str] | None = None) -> list[Any]:
    return [m for m in checks.run_checks(databases=databases) if m.id in ids]


@pytest.fixture
def elsewhere(tmp_path: Path) -> Iterator[str]:
    """The alias ``claims`` pointed at an empty database of its own; its name."""
    claims = connections["claims"]
    saved = dict(claims.settings_dict)
    name = f"test_idem_elsewhere_{os.getpid()}"
    if connection.vendor == "sqlite":
        name = str(tmp_path / "elsewhere.sqlite3")
    else:
        with connections["provider"].cursor() as cursor:
            cursor.execute(f"CREATE DATABASE {name}")
    claims.close()
    claims.settings_dict["NAME"] = name
    try:
        yield name
    finally:
        claims.close()
        claims.settings_dict.clear()
        claims.settings_dict.update(saved)
        if connection.vendor != "sqlite":
            with connections["provider"].cursor() as cursor:
                cursor.execute(f"DROP DATABASE {name}")


def test_e051_a_claim_database_reaching_another_database(elsewhere):
    with override_settings(IDEMPOTENCY={"CLAIM_DATABASE": "claims"}):
        (error,) = found(E051, databases=["default"])
    assert "IDEMPOTENCY['CLAIM_DATABASE'] ('claims')" in error.msg
    assert "run again" in error.msg
    assert "same database" in error.hint
    with (
        override_settings(IDEMPOTENCY={"CLAIM_DATABASE": "claims"}),
        pytest.raises(SystemCheckError, match="E051"),
    ):
        call_command("check", databases=["default"], stdout=StringIO())


def test_e051_under_check_database_naming_the_claim_database(elsewhere):
    """``check --database claims``, the alias that is wrong, connects to both as well."""
    with override_settings(IDEMPOTENCY={"CLAIM_DATABASE": "claims"}):
        (error,) = found(E051, databases=["claims"])
    assert "IDEMPOTENCY['CLAIM_DATABASE'] ('claims')" in error.msg


def test_e051_not_for_a_claim_database_on_the_same_database():
    with override_settings(IDEMPOTENCY={"CLAIM_DATABASE": "claims"}):
        assert found(E051, databases=["default"]) == []
        assert found(E051, databases=["claims"]) == []
        assert found(E051) == []


@pytest.mark.skipif(connection.vendor != "sqlite", reason="SQLite's database files")
@pytest.mark.parametrize("spelled", ["a-path-object", "relative", "through-a-link"])
def test_e051_not_for_one_sqlite_file_spelled_another_way(tmp_path, monkeypatch, spelled):
    """Django's own settings name the file as a ``Path`` (``BASE_DIR / "db.sqlite3"``): the
    same file named by a string, a relative path or a symbolic link is the same database,
    never an Error that stops ``runserver`` and ``migrate``."""
    database = tmp_path / "db.sqlite3"
    database.touch()
    (tmp_path / "link.sqlite3").symlink_to(database)
    monkeypatch.chdir(tmp_path)
    default, claims = connections["default"].settings_dict, connections["claims"].settings_dict
    monkeypatch.setitem(default, "NAME", str(database))
    other = {"a-path-object": database, "relative": "db.sqlite3", "through-a-link": "link.sqlite3"}
    monkeypatch.setitem(claims, "NAME", other[spelled])
    with override_settings(IDEMPOTENCY={"CLAIM_DATABASE": "claims"}):
        assert found(E051) == []
        assert found(E051, databases=["default"]) == []
    monkeypatch.setitem(claims, "NAME", str(tmp_path / "another.sqlite3"))
    with override_settings(IDEMPOTENCY={"CLAIM_DATABASE": "claims"}):
        (error,) = found(E051)
    assert "another.sqlite3" in error.msg


def let_go(alias: Any) -> None:
    """Close ``alias``'s connection, and its Django pool where it has one."""
    alias.close()
    if getattr(alias, "pool", None) is not None:
        alias.close_pool()


@pytest.fixture
def other_schema() -> Iterator[str]:
    """The alias ``claims`` on the same database, with a ``search_path`` that finds the
    package's tables (migrated there) in another schema; the schema's name. As when a
    pooler in front of it drops the ``options`` that set ``DATABASE``'s schema."""
    claims = connections["claims"]
    saved = dict(claims.settings_dict["OPTIONS"])
    schema = f"idem_elsewhere_{os.getpid()}"
    with connections["provider"].cursor() as cursor:
        cursor.execute(f"CREATE SCHEMA {schema}")
    let_go(claims)
    claims.settings_dict["OPTIONS"] = {**saved, "options": f"-c search_path={schema}"}
    try:
        call_command("migrate", "django_idempotency", database="claims", stdout=StringIO())
        yield schema
    finally:
        let_go(claims)  # a Django pool's connections keep the search_path they were made with
        claims.settings_dict["OPTIONS"] = saved
        with connections["provider"].cursor() as cursor:
            cursor.execute(f"DROP SCHEMA {schema} CASCADE")


@pytest.mark.skipif(connection.vendor != "postgresql", reason="PostgreSQL's schemas")
@pytest.mark.skipif(
    os.environ.get("TEST_DB") == "pgbouncer",
    reason="PgBouncer refuses the options startup parameter that sets the search_path",
)
def test_e051_a_claim_database_whose_search_path_finds_other_tables(other_schema):
    """Same server, same database, another record table: each claim is made where the work
    never completes it, so the body runs, loses its lease and runs again after it."""
    calls: list[int] = []
    with override_settings(IDEMPOTENCY={"CLAIM_DATABASE": "claims"}):
        with pytest.raises(IdempotencyError), transaction.atomic():
            run_once(lambda: calls.append(1), account="a", operation="o", key="k")
        (error,) = found(E051, databases=["default"])
    assert calls == [1]  # what E051 is there to prevent: a body whose outcome is never kept
    assert IdempotencyRecord.objects.count() == 0
    assert other_schema in error.msg
    assert "search_path" in error.msg


def test_e051_another_engine_is_told_without_a_connection(elsewhere):
    claims = connections["claims"]
    other = "mysql" if connection.vendor != "mysql" else "postgresql"
    saved = claims.vendor
    claims.vendor = other  # what the ENGINE of another backend would give
    try:
        with override_settings(IDEMPOTENCY={"CLAIM_DATABASE": "claims"}):
            # Told before any connection is made (the engines differ). Named databases, as
            # under --database: without them Django 6.1 (tox) reported nothing here.
            (error,) = found(E051, databases=["default"])
    finally:
        claims.vendor = saved
    assert f"it is {other}" in error.msg


def test_e052_the_packages_tables_missing(elsewhere):
    with override_settings(IDEMPOTENCY={"DATABASE": "claims"}):
        (error,) = found(E052, databases=["claims"])
        assert found(E052) == []  # needs --database: a connection tells
    for table in TABLES:
        assert table in error.msg
    assert "0001_initial" in error.msg
    assert error.hint == "Run: python manage.py migrate django_idempotency --database claims"


def test_e052_a_later_migration_not_applied(elsewhere):
    out = StringIO()
    call_command("migrate", "django_idempotency", "0008", database="claims", stdout=out)
    with override_settings(IDEMPOTENCY={"DATABASE": "claims"}):
        (error,) = found(E052, databases=["claims"])
    assert "0009_outbox_delivery" in error.msg
    assert "0010_outbox_unique_key" in error.msg
    assert "0008" not in error.msg
    # The tables 0008 made are there, one column short: only 0010's own table is missing.
    missing = error.msg.partition(" are missing")[0] if " are missing" in error.msg else ""
    assert "django_idempotency_outbox_key" in missing
    for table in ("django_idempotency_record", "django_idempotency_outbox,"):
        assert table not in missing


def test_migrate_is_not_stopped_by_e052_and_clears_it(elsewhere):
    with override_settings(IDEMPOTENCY={"DATABASE": "claims"}):
        call_command("migrate", database="claims", stdout=StringIO())  # runs the checks
        assert found(E052, databases=["claims"]) == []
    assert set(TABLES) <= set(connections["claims"].introspection.table_names())
