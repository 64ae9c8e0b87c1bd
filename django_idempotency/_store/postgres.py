"""PostgreSQL's claim: a new key inserted, or the record in its way handed back, in one
statement run by a server-side function (see :data:`CLAIM`); and the guard of a statement
a watchdog bounds."""

from __future__ import annotations

__all__ = ["CLAIM", "LATE", "ON_TIME", "refusal"]

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
