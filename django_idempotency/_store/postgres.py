"""PostgreSQL's claim: a new key inserted, or the record in its way handed back, in one
statement (see :func:`claim_sql`)."""

from __future__ import annotations

import functools
import re
from datetime import timedelta

from django.db import connections

from django_idempotency import _policies
from django_idempotency._store.records import EXISTING_COLUMNS, TIMES
from django_idempotency._store.statements import table
from django_idempotency.states import IN_PROGRESS

__all__ = ["LATE", "ON_TIME", "claim_sql", "refusal"]

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


# The columns PostgreSQL's claim writes: an expression written into the statement, or None
# for a value bound under the column's own name (or written, when it is the same for every
# request of an operation and a plain word: see claim_sql). The lease token is
# drawn by the server, the lease's and the record's ends are the claim's time plus the
# intervals written into the statement ({lease}, {ttl}). The columns it leaves out are NULL.
CLAIM_COLUMNS: dict[str, str | None] = {
    "account": None,
    "operation": None,
    "key": None,
    "request_hash": None,
    "fingerprint_version": None,
    "status": f"'{IN_PROGRESS}'",
    "lease_token": "gen_random_uuid()",
    "lease_expires_at": "%(created_at)s + {lease}",
    "recovery_policy": None,
    "recovery_attempts": "0",
    "response_headers": "'[]'::jsonb",
    "created_at": None,
    "expires_at": "%(created_at)s + {ttl}",
}


def interval(value: timedelta) -> str:
    # In microseconds: exact, and a time span that no daylight-saving change stretches.
    return f"interval '{value // MICROSECOND} microseconds'"


MICROSECOND = timedelta(microseconds=1)


# A value that may be written into the statement as a string literal as it is: no quote, no
# backslash, no percent sign (the statement is a template of placeholders).
WRITABLE = re.compile(r"[A-Za-z0-9_.:-]{1,255}")


@functools.lru_cache(maxsize=512)
def claim_sql(
    alias: str,
    operation: str,
    fingerprint_version: str,
    recovery_policy: str,
    lease: timedelta,
    ttl: timedelta,
    guarded: bool = False,
) -> str:
    """The claim: insert a new key, or hand back the existing row, in one statement.

    ``guarded`` (a claim a watchdog bounds, see ``_autonomous._bounded``): the INSERT runs
    only before ``%(deadline)s`` on the server's clock, so that a statement a pooler hands a
    server connection after the caller gave up writes nothing, and says so (see ``LATE``).

    The INSERT runs only when no row holds the key (``NOT EXISTS``): a replay or a conflict
    then writes nothing, takes no transaction id (not even the id sequence's, which an
    attempted insert would advance) and waits for nobody. Two new claims racing for one key
    meet in ``ON CONFLICT DO NOTHING``, which does not lock the winner's row. The outer
    SELECT hands back the row in the way, from the statement's snapshot. Its first row tells
    which happened: a NULL status is the claim's own insert (and, ``guarded``, a NULL id the
    guard's refusal).

    What is the same for every request of an operation is written into the statement
    (when it is a plain word: ``WRITABLE``), which is built once per operation; the key, the
    account, the request's hash and the time are bound. (Why: the docs' "Choices we made".)

    Under the recovery policy ``"retry"`` the claim's commit does not wait for its WAL
    flush: the view's own commit, which follows, flushes the claim with it, so a server
    crash can lose a claim only together with the view's work, and an absent claim is what
    ``"retry"`` does anyway. The claim is visible to every other claim at once either way.
    """
    quote = connections[alias].ops.quote_name
    into = table(alias)
    written = {
        column: f"'{value}'"
        for column, value in (
            ("operation", operation),
            ("fingerprint_version", fingerprint_version),
            ("recovery_policy", recovery_policy),
        )
        if WRITABLE.fullmatch(value)
    }

    def value_of(column: str) -> str:
        # A bound string is cast to text: bound on the server (prepared statements), a value
        # the statement uses twice must have one type, and the SELECT list gives it none.
        cast = "" if column == "created_at" else "::text"
        return written.get(column, f"%({column})s{cast}")

    columns = ", ".join(quote(column) for column in CLAIM_COLUMNS)
    values = ", ".join(
        expression.format(lease=interval(lease), ttl=interval(ttl))
        if expression
        else value_of(column)
        for column, expression in CLAIM_COLUMNS.items()
    )
    identity = " AND ".join(f"{quote(c)} = {value_of(c)}" for c in ("account", "operation", "key"))
    # The two times as seconds since the epoch, a double (see "Choices we made").
    existing = ", ".join(
        f"date_part('epoch', {quote(c)})" if c in TIMES else quote(c) for c in EXISTING_COLUMNS
    )
    nulls = ", ".join("NULL" for _ in EXISTING_COLUMNS[1:])
    durable = _policies.recovery_policy(recovery_policy).durable_claim
    flush = "NULL" if durable else "set_config('synchronous_commit', 'off', true)"
    returned = f"{quote('id')}, {quote('lease_token')}"
    sql = (
        f"WITH {f'{LATE}, ' if guarded else ''}claim AS (INSERT INTO {into} ({columns})"
        f" SELECT {values} WHERE NOT EXISTS (SELECT 1 FROM {into} WHERE {identity})"
        f"{ON_TIME if guarded else ''}"
        f" ON CONFLICT (account, operation, key) DO NOTHING RETURNING {returned})"
        f" SELECT {quote('id')}, {nulls}, {quote('lease_token')}, {flush} FROM claim"
        # The outer SELECT shares the INSERT's snapshot, so it never sees the row the claim
        # inserted: no guard is needed to keep the two branches apart.
        f" UNION ALL SELECT {existing}, NULL, NULL FROM {into} WHERE {identity}"
    )
    if guarded:
        # The rows before the refusal, if any, tell what is in the way: a refusal is never
        # read as a record that vanished.
        sql += refusal(len(EXISTING_COLUMNS) + 2)
    return sql
