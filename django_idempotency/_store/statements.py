"""The plumbing of the engine's fixed statements: cursors (prepared where the connection
allows it), table names, values prepared per field, and the owner's fence.

The engine's statements are fixed texts built once per database, never compiled by the ORM
per request. With ``OPTIONS["prepare_threshold"]`` on PostgreSQL they run on a cursor that
binds on the server, so psycopg prepares them: the server no longer parses and plans them on
every request. A connection whose pooler refuses a prepared statement stops preparing.
"""

from __future__ import annotations

import functools
import logging
import uuid
from collections.abc import Callable
from datetime import datetime
from typing import TYPE_CHECKING, Any

from django.db import connections
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.models import Field

from django_idempotency._store.records import STATE_COLUMNS, later
from django_idempotency._vendors import of
from django_idempotency.models import IdempotencyRecord, IdempotencyStep
from django_idempotency.states import IN_PROGRESS

if TYPE_CHECKING:
    from django_idempotency._context import Operation

logger = logging.getLogger("django_idempotency")

__all__ = [
    "claim_row",
    "cursor",
    "owned_by",
    "prepared",
    "prepared_row",
    "refused",
    "returning",
    "step_table",
    "table",
]


def prepares(connection: BaseDatabaseWrapper) -> bool:
    """Whether the engine's statements run prepared on this connection.

    PostgreSQL with ``OPTIONS["prepare_threshold"]`` set (Django leaves it ``None``: no
    prepared statements, which PgBouncer in transaction mode needs before 1.21), unless
    Django is logging queries (``DEBUG``, ``CaptureQueriesContext``, ``assertNumQueries``):
    its log reads a statement's text with its values from a client-side cursor only.
    """
    return (
        connection.settings_dict["OPTIONS"].get("prepare_threshold") is not None
        and of(connection.alias).prepares
        and not connection.queries_logged
        and connection.alias not in refused
    )


#: Aliases whose connections refused a prepared statement (a pooler that does not keep
#: them: PgBouncer before 1.21 in transaction mode): the engine prepares nothing there any
#: more, in this process.
refused: set[str] = set()


def stop_preparing(alias: str, raw: Any, error: Exception) -> None:
    """Prepare nothing more on ``alias``'s connections, and say why, once."""
    raw.prepare_threshold = None
    if alias not in refused:
        refused.add(alias)
        logger.warning(
            "the database %r refused a prepared statement (%s): a pooler in front of it "
            "does not keep them (PgBouncer before 1.21 in transaction mode). The engine's "
            "statements are no longer prepared on it; remove OPTIONS['prepare_threshold'], "
            "or set max_prepared_statements in PgBouncer 1.21+.",
            alias,
            type(error).__name__,
        )


def cursor(alias: str) -> Any:
    """A cursor for the fixed statements below.

    Django's own, which writes the values into the statement's text (client-side binding),
    unless the connection allows prepared statements (:func:`prepares`). Then a cursor that
    binds them on the server, so that psycopg prepares each of these statements once it has
    run ``prepare_threshold`` times on the connection, and the server no longer parses and
    plans it on every request (the claim, a function whose plans the server keeps anyway:
    only its one-line call). Django's own cursors do not prepare
    (they bind client-side unless ``OPTIONS["server_side_binding"]`` is set): this is the
    engine's statements only. Wrapped as Django wraps its cursors: its error classes, its
    execute wrappers, its thread check and its health check.
    """
    connection = connections[alias]
    if not prepares(connection):
        return connection.cursor()
    # As Django's cursor() does; no query log to keep here (see prepares).
    connection.close_if_health_check_failed()
    connection.ensure_connection()
    connection.validate_thread_sharing()
    with connection.wrap_database_errors:
        # What the backend does to the session for each cursor of its own, it does for this
        # one too: django-tenants sets the tenant's search_path there, without which these
        # statements would run in the schema of the connection's last cursor, perhaps
        # another tenant's. (A client-side cursor, closed unused: no round trip of its own.)
        backend: Any = connection  # _cursor(): Django's hook, which django-stubs leaves out
        backend._cursor().close()
        return connection.make_cursor(binding_cursor(connection.alias)(connection.connection))


@functools.lru_cache(maxsize=8)
def binding_cursor(alias: str) -> Any:
    """Django's server-binding cursor class for ``alias``, made to survive a table changed
    under it and a pooler that does not keep prepared statements.

    A connection keeps what it prepared. When a migration changes the type of a column a
    statement returns, PostgreSQL refuses that statement on the connection from then on
    ("cached plan must not change result type"). Outside a transaction (the claim's place)
    the cursor then drops the connection's prepared statements (``DEALLOCATE ALL``, which
    psycopg sees and forgets its own) and runs the statement once more, prepared anew.
    Inside one, the transaction is lost either way; its rollback makes psycopg drop them.
    """
    # Imported when first needed: the modules need psycopg, which only PostgreSQL does.
    from django.db.backends.postgresql.base import ServerBindingCursor
    from psycopg import errors, pq

    base: Any = ServerBindingCursor  # psycopg's Cursor, which django-stubs does not type

    class PreparingCursor(base):  # type: ignore[misc]
        def execute(self, query: Any, params: Any = None, **kwargs: Any) -> Any:
            try:
                return super().execute(query, params, **kwargs)
            except errors.FeatureNotSupported:
                if self.connection.info.transaction_status != pq.TransactionStatus.IDLE:
                    raise
                self.connection.execute("DEALLOCATE ALL")
                return super().execute(query, params, **kwargs)
            except (errors.InvalidSqlStatementName, errors.DuplicatePreparedStatement) as exc:
                # The statement was prepared on another server connection than the one it
                # ran on: a pooler hands them out per transaction. Outside a transaction it
                # runs again unprepared; inside one the transaction is lost either way.
                stop_preparing(alias, self.connection, exc)
                if self.connection.info.transaction_status != pq.TransactionStatus.IDLE:
                    raise
                return super().execute(query, params, prepare=False, **kwargs)

    return PreparingCursor


def table(alias: str) -> str:
    return str(connections[alias].ops.quote_name(IdempotencyRecord._meta.db_table))


def prepared(alias: str, name: str, value: Any) -> Any:
    field = IdempotencyRecord._meta.get_field(name)
    assert isinstance(field, Field)
    return field.get_db_prep_save(value, connections[alias])


def prepared_row(alias: str, row: dict[str, Any]) -> dict[str, Any]:
    return {name: prepared(alias, name, value) for name, value in row.items()}


def claim_row(op: Operation, token: uuid.UUID, now: datetime) -> dict[str, Any]:
    """The columns of the record a claim of ``op`` at ``now`` writes, with lease ``token``,
    each in the form the field stores (the portable insert and takeover; PostgreSQL's
    claim passes its values as they are)."""
    if now.tzinfo is not None:  # USE_TZ = True: elapsed time as it is, and no call made
        lease_ends, expires = now + op.lease, now + op.ttl
    else:
        lease_ends, expires = later(now, op.lease), later(now, op.ttl)
    return prepared_row(
        op.alias,
        {
            "account": op.account,
            "operation": op.operation,
            "key": op.key,
            "request_hash": op.request_hash,
            "fingerprint_version": op.fingerprint_version,
            "status": IN_PROGRESS,
            "lease_token": token,
            "lease_expires_at": lease_ends,
            "recovery_policy": op.recovery_policy,
            "recovery_attempts": 0,
            "response_status": None,
            "response_headers": [],
            "response_body": None,
            "created_at": now,
            "completed_at": None,
            "expires_at": expires,
        },
    )


def returning(alias: str) -> str:
    quote = connections[alias].ops.quote_name
    return ", ".join(quote(c) for c in STATE_COLUMNS)


def owned_by(quote: Callable[[str], str]) -> str:
    """The fence of every owner's statement: this record, this lease token, still in progress.

    Its parameters, in order: the record's id, the token, ``IN_PROGRESS``.
    """
    return f"{quote('id')} = %s AND {quote('lease_token')} = %s AND {quote('status')} = %s"


def step_table(alias: str) -> str:
    return str(connections[alias].ops.quote_name(IdempotencyStep._meta.db_table))
