"""PostgreSQL: its claim, a new key inserted or the record in its way handed back in one
statement run by a server-side function (see :data:`CLAIM`); the guard of a statement a
watchdog bounds; and its answers to the checklist of :class:`.base.Vendor`."""

from __future__ import annotations

import functools
import importlib
import re
from typing import Any

from django.db import Error, OperationalError
from django.db.backends.base.base import BaseDatabaseWrapper

from django_idempotency._vendors.base import Vendor, at_most

__all__ = [
    "CLAIM",
    "CLAIM_ARGUMENTS",
    "CLAIM_MIGRATION",
    "LATE",
    "ON_TIME",
    "PostgreSQL",
    "claim_text",
    "refusal",
]

# The guard of a claim that a watchdog bounds (see _autonomous._bounded): its write runs only
# before %(deadline)s on the server's clock, and past it a last row without an id says so
# (refusal). The clock is read once, in a common table expression of the statement's (LATE,
# joined to the write's condition by ON_TIME): the statement either writes or reports that
# it was late, never both and never neither, whatever the order of its rows.
LATE = "late AS MATERIALIZED (SELECT clock_timestamp() >= %(deadline)s AS past)"
ON_TIME = " AND NOT (SELECT past FROM late)"


def refusal(columns: int) -> str:
    """The guard's last row, of ``columns`` NULLs, when the statement came too late."""
    return f" UNION ALL SELECT {', '.join('NULL' for _ in range(columns))} FROM late WHERE past"


#: The claim: one call of the function migration 0011 created,
#: ``django_idempotency_record_claim`` (its statement: see that migration's docstring), every
#: value bound. The server keeps the plans of a PL/pgSQL function's statements for the life
#: of its connection, so the claim is no longer parsed and planned on every request, with no
#: prepared statement in the protocol (any pooler keeps it). Its rows are those of the
#: statement it runs: the claim's own insert (its id, NULLs, its lease token, and, where the
#: recovery policy's claim need not be durable, the commit relaxed), the record in the way
#: (``EXISTING_COLUMNS``, its times as seconds since the epoch), and, with a deadline past on
#: the server's clock, a last row of NULLs that says the claim wrote nothing (see ``LATE``).
CLAIM = f"SELECT * FROM django_idempotency_record_claim({', '.join(['%s'] * 11)})"

#: The migration whose ``CLAIM_FUNCTION`` defines the claim's function as it is now.
CLAIM_MIGRATION = "django_idempotency.migrations.0011_claim_function"


@functools.lru_cache(maxsize=1)
def claim_text() -> str:
    """The statement the claim's function runs, as text with named parameters (one per
    argument of the function, ``%(p_key)s``, each cast to its type): the first claim of a
    server connection sends it (see ``_store.claiming``).

    A function's first call on a server connection loads PL/pgSQL and compiles the function,
    about a millisecond more than the statement sent as text; a connection per request
    (Django's default ``CONN_MAX_AGE = 0``, and every request under ASGI) would pay it on
    every claim. It is read from the function's definition in its migration, never written
    twice: the same statement, the same rows.
    """
    definition: str = importlib.import_module(CLAIM_MIGRATION).CLAIM_FUNCTION
    arguments = definition[definition.index("(") + 1 : definition.index(") RETURNS")]
    types = dict(argument.split(None, 1) for argument in map(str.strip, arguments.split(",")))
    body = definition.split("RETURN QUERY", 1)[1].rsplit("END", 1)[0].strip().rstrip(";")
    return re.sub(
        r"\bp_[a-z_]+\b",
        lambda name: f"(%({name.group()})s::{types[name.group()]})",
        body.replace("%", "%%"),
    )


#: The names of the claim function's arguments, in their order (``claim_text``'s parameters).
CLAIM_ARGUMENTS = (
    "p_account",
    "p_operation",
    "p_key",
    "p_request_hash",
    "p_fingerprint_version",
    "p_recovery_policy",
    "p_created_at",
    "p_lease",
    "p_ttl",
    "p_deadline",
    "p_relaxed_commit",
)


# Deadlocks and serialization failures: the server rolled the transaction back and asks for
# it to run again.
_RETRYABLE = frozenset({"40P01", "40001"})
# The connection itself lost: SQLSTATE class 08 (connection exceptions), and 57P01 to 57P03
# (terminated by an administrator, a crash or a shutdown; the server cannot take
# connections now). A psycopg OperationalError without a SQLSTATE is the same: the server
# closed the connection, or the client could not reach it.
_LOST = frozenset({"57P01", "57P02", "57P03"})
# Whose SQLSTATE is read: psycopg's (sqlstate) and psycopg2's (pgcode) errors.
_NO_STATE = object()


def _sqlstate(exc: Error) -> Any:
    """The SQLSTATE of the driver's error under ``exc``: ``None`` when it carries none,
    ``_NO_STATE`` when it is no psycopg error."""
    cause: Any = exc.__cause__
    if hasattr(cause, "sqlstate"):
        return cause.sqlstate
    if hasattr(cause, "pgcode"):
        return cause.pgcode
    return _NO_STATE


class PostgreSQL(Vendor):
    """PostgreSQL, through psycopg 3 (psycopg2 where Django still takes it)."""

    name = "postgresql"

    claim_function = True
    native_values = True
    headers_cast = "::jsonb"
    takeover_returning = True
    share_lock = " FOR SHARE"
    prepares = True
    json_rows = True

    def carries_commit(self, connection: BaseDatabaseWrapper) -> bool:
        # psycopg 3 (psycopg2's commit() sends a COMMIT of its own whatever the server's state).
        driver: Any = connection  # Database: the backend's driver module, which stubs leave out
        return bool(driver.Database.__name__ == "psycopg")

    separate_claims = True
    watchdog = True

    def claim_connection_options(self, options: dict[str, Any], seconds: int) -> str | None:
        # libpq's least connect timeout is 2 s; the statements are bounded by the watchdog.
        at_most(options, "connect_timeout", max(2, seconds))
        return None

    def snapshot_isolation(self, connection: BaseDatabaseWrapper) -> str | None:
        with connection.cursor() as cursor:
            cursor.execute("SELECT current_setting('transaction_isolation')")
            (level,) = cursor.fetchone()
        return str(level) if level in ("repeatable read", "serializable") else None

    def retryable(self, exc: Error, bounded: bool) -> bool:
        return _sqlstate(exc) in _RETRYABLE

    def connection_lost(self, exc: Error) -> bool:
        state = _sqlstate(exc)
        if state is _NO_STATE:
            return False
        if state is None:
            return isinstance(exc, OperationalError)
        return str(state).startswith("08") or state in _LOST

    purge_batch = "statement"
    table_bytes_sql = "SELECT pg_total_relation_size(%s::regclass)"
    loose_index_scan = True
    insert_on_conflict = True
    newest_read = " FOR SHARE"
    notify_sql = "SELECT pg_notify(%s, '')"

    # The schema too where the connection's search_path finds the record table: the same
    # database seen through another search_path (a pooler that drops the "options" which
    # set DATABASE's) reaches other tables.
    identity_sql = (
        "SELECT current_database(), system_identifier, n.nspname"
        " FROM pg_control_system()"
        " LEFT JOIN pg_class c ON c.oid = to_regclass(quote_ident(%(table)s))"
        " LEFT JOIN pg_namespace n ON n.oid = c.relnamespace"
    )
    # The standbys a failover can promote: physical streaming replication, not a logical
    # subscriber (a walsender of a logical slot) nor a base backup being taken.
    replication_sql = (
        "SELECT current_setting('synchronous_standby_names'),"
        " current_setting('synchronous_commit'),"
        " count(*), count(*) FILTER (WHERE r.sync_state = 'async')"
        " FROM pg_stat_replication r"
        " WHERE r.state <> 'backup' AND NOT EXISTS (SELECT 1 FROM pg_replication_slots s"
        " WHERE s.slot_type = 'logical' AND s.active_pid = r.pid)"
    )
