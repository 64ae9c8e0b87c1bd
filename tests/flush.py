"""How the database is emptied after each transactional test (``tests/conftest.py`` installs it).

Django's ``TransactionTestCase`` empties it with ``manage.py flush``: on PostgreSQL one
``TRUNCATE`` of every table (new files for each table, its indexes and TOAST, and a scan of
the shared buffers), then the ``post_migrate`` signal, whose receivers read and write the
content types and permissions again, app by app. On the CI machine that came to about half a
second after each of the suite's 1,959 transactional tests on PostgreSQL, more than the test
itself took for most of them, and ``post_migrate`` a tenth of a second on SQLite.

``empty`` leaves the same state, cheaper:

- every table but the content types' and the permissions' is emptied with ``DELETE`` (on
  PostgreSQL in one transaction, the deferrable constraints deferred; on the others with the
  statements of Django's flush, which are ``DELETE`` already);
- the content types and permissions, what ``post_migrate`` writes, are kept when they hold
  exactly the rows the last full flush left, for the same models and the same receivers of
  ``post_migrate``: the signal would then write nothing, and is not sent.

Django's own flush runs instead, and its result becomes the one to compare with, the first
time, whenever a test changed a content type or a permission, and where a PostgreSQL table
(its dead rows included: the CI server runs without autovacuum, and a ``DELETE`` leaves them
until a ``VACUUM``) grew past ``LARGEST_DELETED`` bytes. A test that asks for more than an
empty database (``reset_sequences``, ``serialized_rollback``, ``available_apps``) and a
database on another engine (django-tenants' schemas, say) keep Django's flush.
"""

from __future__ import annotations

import hashlib
from typing import Any

from django.apps import apps
from django.contrib.auth.models import Permission
from django.contrib.contenttypes.models import ContentType
from django.core.management import call_command
from django.core.management.color import no_style
from django.db import connections, transaction
from django.db.models.signals import post_migrate
from django.test import TransactionTestCase

ENGINES = frozenset(
    {
        "django.db.backends.postgresql",
        "django.db.backends.sqlite3",
        "django.db.backends.mysql",
    }
)
#: PostgreSQL: a table (heap and TOAST) past this size is truncated, by Django's flush.
LARGEST_DELETED = 256 * 1024
#: The models whose rows ``post_migrate`` writes.
KEPT = (ContentType, Permission)

_django_teardown = TransactionTestCase._fixture_teardown
#: Per database alias: the digest of what Django's last flush there left in ``KEPT``.
_left_by_flush: dict[str, str] = {}


def install() -> None:
    """Empty the database this way after every transactional test."""
    TransactionTestCase._fixture_teardown = _fixture_teardown  # type: ignore[method-assign]


def _fixture_teardown(self: TransactionTestCase) -> None:
    if self.reset_sequences or self.serialized_rollback or self.available_apps is not None:
        _django_teardown(self)
        return
    for alias in self._databases_names(include_mirrors=False):
        empty(alias)


def empty(alias: str) -> str:
    """Empty the database ``alias`` as Django's flush does (``post_migrate`` included):
    ``"deleted"`` when its tables were emptied with ``DELETE`` and the content types and
    permissions kept, ``"flushed"`` when Django's flush ran."""
    connection = connections[alias]
    kept = {model._meta.db_table for model in KEPT}
    tables = [
        table
        for table in connection.introspection.django_table_names(
            only_existing=True, include_views=False
        )
        if table not in kept
    ]
    if (
        connection.settings_dict["ENGINE"] not in ENGINES
        or _left_by_flush.get(alias) != digest(alias)
        or (connection.vendor == "postgresql" and _grown(alias, tables))
    ):
        call_command(
            "flush",
            verbosity=0,
            interactive=False,
            database=alias,
            reset_sequences=False,
            inhibit_post_migrate=False,
        )
        _left_by_flush[alias] = digest(alias)
        return "flushed"
    if connection.vendor == "postgresql":
        quote = connection.ops.quote_name
        with transaction.atomic(using=alias), connection.cursor() as cursor:
            cursor.execute("SET CONSTRAINTS ALL DEFERRED")
            for table in tables:
                cursor.execute(f"DELETE FROM {quote(table)}")
    else:
        connection.ops.execute_sql_flush(
            connection.ops.sql_flush(no_style(), tables, reset_sequences=False)
        )
    return "deleted"


def digest(alias: str) -> str:
    """The rows of ``KEPT`` on ``alias``, the models whose content types and permissions
    ``post_migrate`` would write, and its receivers."""
    seen: list[Any] = [
        [model._meta.label for model in apps.get_models(include_auto_created=True)],
        [receiver[0] for receiver in post_migrate.receivers],
    ]
    for model in KEPT:
        seen.append(list(model._default_manager.using(alias).order_by("pk").values_list()))
    return hashlib.sha256(repr(seen).encode()).hexdigest()


def _grown(alias: str, tables: list[str]) -> bool:
    with connections[alias].cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM unnest(%s::text[]) AS t(name)"
            " WHERE pg_table_size(quote_ident(t.name)::regclass) > %s",
            [tables, LARGEST_DELETED],
        )
        (grown,) = cursor.fetchone()
    return bool(grown)
